"""Findings: what one snapshot, plus what earlier polls remembered, says about the host.

This module owns the decision "who holds this GPU, why, and is anything wrong": PID validation
and PID trust (docs/design-notes.md §3), the orphan rule with its positive evidence (§4), zombies
and D state (§5), ghost and unaccounted memory with the learned idle baseline (§6), report-only
conditions (§11), and the per-process lineage recorded when a process is first seen.

It is pure: no I/O, no clock reads (time is ``snapshot.monotonic``), no signals, no policy rules.
It must never turn an unknown value into an actionable finding: every ``None`` on the path to
``orphaned`` or ``ghost_memory`` yields a weaker, informational result instead, and the reason is
written down. Deciding what to *do* about a finding is ``plan.py``'s job. The kinds and their
evidence fields are documented in ``docs/findings.md``.

Around it: ``host_view.py`` indexes the snapshot, ``assess_state.py`` owns what is carried
between polls (lineage, owners, its JSON), ``baselines.py`` the idle-memory baselines. What is
left here is one decision table — listings, holders, memory — and it is long (about 950 lines)
because the orphan rule and its neighbours (worker, hidden, stuck, unknown, the likely heir of
a leak from before the daemon watched, the kcmp proof of inheritance) share one body of
evidence: split, each half would have to recompute the other's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from gpuwatchd.decide.assess_state import (
    AssessState,
    Lineage,
    update_inheritance,
    update_lineage,
    update_owners,
)
from gpuwatchd.decide.baselines import (
    V1_BASELINE_SUFFIX,
    learn_baselines,
    memory_figure,
)
from gpuwatchd.decide.floor import is_infrastructure
from gpuwatchd.decide.health import assess_health
from gpuwatchd.decide.host_view import HostView, Listing, relation
from gpuwatchd.decide.mig import (
    MigLayout,
    annotate_findings,
    annotate_report_only,
    instance_view,
    mig_layout,
)
from gpuwatchd.decide.policy import Detection, HealthPolicy
from gpuwatchd.model import (
    MIB,
    DeviceHolding,
    Finding,
    FindingKind,
    GpuInfo,
    ProcessIdentity,
    ProcessInfo,
    Snapshot,
    as_int,
)
from gpuwatchd.vocabulary import HolderRoleName

NODE = "node"  # key of node-wide entries in ``Assessment.report_only`` and ``HolderRole.gpu``


# --- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HolderRole:
    """How one holder (or NVML-listed PID) of one GPU is explained, for ``scan`` output.

    ``role`` is one of "context_owner", "worker" (of ``owner_pid``), "management" (an NVML-only
    client or infrastructure), "orphaned", "hidden", "stuck" or "unknown". ``gpu`` is the GPU's
    UUID, or "node" for a process that holds only nvidiactl / nvidia-uvm. ``via`` says how the
    GPU's device file is held ("fd", "map"). The daemon's own processes never appear.
    """

    pid: int
    gpu: str
    role: HolderRoleName
    owner_pid: int | None
    via: tuple[str, ...]
    note: str


@dataclass(frozen=True)
class Assessment:
    """The outcome of one assessment.

    ``report_only`` maps a GPU UUID, or "node", to why nothing may be acted on there; findings
    under such a condition carry ``actionable=False``. ``notes`` maps a GPU UUID to why a check
    could not conclude (an unreadable process, a targeted scan, the v1 memory API...).
    """

    findings: tuple[Finding, ...]
    roles: tuple[HolderRole, ...]
    report_only: Mapping[str, str]
    state: AssessState
    notes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


# --- PID trust and report-only conditions -----------------------------------------------------


def _dead_pid_explained(
    host: HostView, pid: int, lineage: Mapping[ProcessIdentity, Lineage]
) -> bool:
    """A dead listed PID is explained when we saw it alive or a live process descends from it."""
    if any(ident.pid == pid for ident in lineage):
        return True
    for proc in host.procs.values():
        if pid in (proc.ppid, proc.pgid, proc.sid):
            return True
        if proc.identity is not None:
            recorded = lineage.get(proc.identity)
            if recorded is not None and pid in (recorded.ppid, recorded.pgid, recorded.sid):
                return True
    return False


def _pid_trust_problem(
    host: HostView, detection: Detection, lineage: Mapping[ProcessIdentity, Lineage]
) -> str | None:
    """Why NVML's process lists cannot be trusted this poll, or None (docs/design-notes.md §3).

    One PID outside 1..pid_max is proof the list was decoded wrong (a struct layout mismatch
    yields 0 and 4294967295), so any such PID loses trust. Dead PIDs are normal after a crash,
    so they lose trust only when ``pid_trust_min_unresolved`` of them are unexplained: never
    seen alive by us and not the parent, group or session of any live process.
    """
    if host.invalid:
        shown = ", ".join(f"{pid} on {uuid}" for uuid, pid in host.invalid[:5])
        return f"NVML listed impossible PIDs ({shown}); process lists are not trusted"
    dead = sorted(
        {row.entry.pid for rows in host.listings.values() for row in rows if row.status == "dead"}
    )
    unexplained = [pid for pid in dead if not _dead_pid_explained(host, pid, lineage)]
    if len(unexplained) >= detection.pid_trust_min_unresolved:
        shown = ", ".join(str(pid) for pid in unexplained[:8])
        return (
            f"{len(unexplained)} PIDs listed by NVML do not resolve and nothing explains them "
            f"({shown}); process lists are not trusted"
        )
    return None


def _report_only(host: HostView, trust_problem: str | None) -> dict[str, str]:
    snapshot = host.snapshot
    node: list[str] = []
    if not snapshot.nvml.available:
        node.append(f"NVML unavailable: {snapshot.nvml.error or 'no driver'}")
    if snapshot.nvml.wedged:
        node.append("NVML is wedged (a call missed its deadline): no destructive action")
    if snapshot.mps_server_running:
        node.append("an MPS server is running: clients' contexts live in the server")
    if snapshot.host_namespaces is False:
        node.append("not in the host PID/cgroup namespaces: NVML's PIDs point elsewhere")
    elif snapshot.host_namespaces is None:
        node.append("cannot tell whether the host PID/cgroup namespaces are visible")
    if trust_problem is not None:
        node.append(trust_problem)
    result: dict[str, str] = {}
    if node:
        result[NODE] = "; ".join(node)
    for gpu in host.gpus:
        if gpu.lost:
            result[gpu.uuid] = f"GPU lost: {gpu.error or 'not answering'}"
        elif gpu.mig_enabled:
            result[gpu.uuid] = "MIG enabled: processes and memory live in MIG instances"
        elif gpu.processes is None:
            result[gpu.uuid] = "its process list could not be read"
    return result


# --- the assessment ---------------------------------------------------------------------------


@dataclass
class _Outcome:
    """The classification of one process that holds device files."""

    role: str
    note: str
    owner_pid: int | None = None
    kind: FindingKind | None = None
    gpu: GpuInfo | None = None  # the GPU the finding is about; None = first held GPU
    evidence: dict[str, object] = field(default_factory=dict)


class _Assessor:
    def __init__(
        self,
        snapshot: Snapshot,
        previous: AssessState,
        detection: Detection,
    ) -> None:
        self.host = HostView(snapshot)
        self.detection = detection
        host = self.host
        tracked = [host.procs[pid] for pid in host.holdings if pid in host.procs]
        tracked += [
            row.proc for rows in host.listings.values() for row in rows if row.proc is not None
        ]
        self.lineage = update_lineage(host, previous, tracked)
        self.inheritance = update_inheritance(host, previous, self.lineage)
        self.baselines = learn_baselines(host, previous.baselines, detection)
        same_boot = snapshot.boot_id is not None and snapshot.boot_id == previous.boot_id
        self.owners = update_owners(
            host, previous.owners if same_boot else frozenset(), self.lineage
        )
        self.unaccounted_since: dict[str, float] = {}
        for gpu in host.gpus:
            if self.memory_without_owner(gpu) is not None:
                since = previous.unaccounted_since.get(gpu.uuid) if same_boot else None
                self.unaccounted_since[gpu.uuid] = (
                    since if since is not None else snapshot.monotonic
                )
        self.report_only = _report_only(host, _pid_trust_problem(host, detection, self.lineage))
        self.findings: list[Finding] = []
        self.roles: list[HolderRole] = []
        self.notes: dict[str, list[str]] = {}
        self.stuck_done: set[int] = set()

    # -- helpers --

    def note(self, gpu: GpuInfo, text: str) -> None:
        self.notes.setdefault(gpu.uuid, []).append(text)

    def baseline(self, gpu: GpuInfo) -> tuple[int | None, int | None, bool]:
        """(figure, baseline, learned) for ghost-style comparisons; figure None = no check."""
        figure = memory_figure(gpu, self.baselines)
        if figure is None:
            return None, None, False
        key, value = figure
        if key in self.baselines:
            return value, self.baselines[key], True
        if key.endswith(V1_BASELINE_SUFFIX):
            return None, None, False  # v1 "used" includes the reservation: learn first
        return value, self.detection.default_baseline, False

    def blocked(self, gpus: Iterable[GpuInfo]) -> bool:
        if NODE in self.report_only:
            return True
        return any(g.uuid in self.report_only for g in gpus)

    def add(
        self,
        kind: FindingKind,
        gpu: GpuInfo | None,
        proc_pid: int | None,
        start_ticks: int | None,
        reason: str,
        *,
        memory: int | None = None,
        informational: bool = False,
        gpus: Iterable[GpuInfo] = (),
        evidence: Mapping[str, object] | None = None,
    ) -> None:
        scope = list(gpus) or ([gpu] if gpu is not None else [])
        self.findings.append(
            Finding(
                kind=kind,
                gpu=gpu.uuid if gpu is not None else None,
                pid=proc_pid,
                start_ticks=start_ticks,
                reason=reason,
                memory=memory,
                actionable=not informational and not self.blocked(scope),
                evidence=dict(evidence or {}),
            )
        )

    def unaccounted_without_owner(
        self, gpu: GpuInfo, proc: ProcessInfo
    ) -> dict[str, object] | None:
        """Evidence that ``proc`` may be the heir of memory on ``gpu`` that no live owner holds.

        The memory must be above baseline + margin with no live context owner at all, and the
        process must have been seen no later than the moment that state began: a process that
        arrived afterwards (a new job's process that opened every GPU but has no context yet)
        cannot have inherited it.
        """
        tie = self.memory_without_owner(gpu)
        since = self.unaccounted_since.get(gpu.uuid)
        recorded = self.lineage.get(proc.identity) if proc.identity is not None else None
        if tie is None or since is None or recorded is None or recorded.first_seen > since:
            return None
        # Positive evidence: when first seen, its parent, group or session was a process this
        # daemon saw owning a context (and which owns none now). A process that merely
        # initialised CUDA before the leak (a notebook that asked for the device count) has no
        # such link and stays a hidden holder.
        live = set(self.host.listed_alive)
        former = {o.pid for o in self.owners if o.pid not in live}
        for link, value in (
            ("recorded parent", recorded.ppid),
            ("recorded process group", recorded.pgid),
            ("recorded session", recorded.sid),
        ):
            if value is not None and value in former and value != proc.pid:
                return {
                    **tie,
                    "unaccounted_since": since,
                    "first_seen": recorded.first_seen,
                    "former_owner": value,
                    "link": link,
                }
        return None

    def memory_without_owner(self, gpu: GpuInfo) -> dict[str, object] | None:
        """Evidence that ``gpu`` holds memory above baseline+margin with no live owner at all."""
        if gpu.coherent_memory or gpu.processes is None or gpu.lost:
            return None
        rows = self.host.listings[gpu.uuid]
        if any(r.status == "alive" or r.entry.pid in self.host.listed_alive for r in rows):
            return None
        figure, baseline, learned = self.baseline(gpu)
        if figure is None or baseline is None:
            return None
        if figure <= baseline + self.detection.ghost_margin:
            return None
        return {
            "tie": "unaccounted_memory",
            "allocated": figure,
            "baseline": baseline,
            "baseline_learned": learned,
            "margin": self.detection.ghost_margin,
            "memory": figure - baseline,
        }

    # -- NVML listings --

    def assess_listings(self) -> None:
        host = self.host
        for gpu in host.gpus:
            for row in host.listings[gpu.uuid]:
                pid, used = row.entry.pid, row.entry.used_memory
                if row.status == "dead":
                    heirs = self.heirs_of(pid)
                    self.add(
                        FindingKind.DEAD_PROCESS,
                        gpu,
                        pid,
                        None,
                        f"NVML lists PID {pid} on GPU {gpu.index}, but no such process exists"
                        + (f"; {len(heirs)} live process(es) descend from it" if heirs else ""),
                        memory=used,
                        evidence={
                            "used_memory": used,
                            "process_kind": row.entry.kind,
                            "heirs": heirs,
                            "seen_alive": any(i.pid == pid for i in self.lineage),
                        },
                    )
                    continue
                proc = row.proc
                if proc is None:  # never: only dead rows lack their process
                    continue
                if row.status == "zombie":
                    holding = host.holds_anything(pid)
                    self.add(
                        FindingKind.ZOMBIE,
                        gpu,
                        pid,
                        proc.start_ticks,
                        f"NVML lists zombie PID {pid} on GPU {gpu.index}; its parent "
                        f"{proc.ppid if proc.ppid is not None else '(unknown)'} must reap it",
                        memory=used,
                        evidence={
                            "used_memory": used,
                            "ppid": proc.ppid,
                            "parent_cmdline": self.cmdline_of(proc.ppid),
                            "holds_device_files": holding,
                        },
                    )
                    if holding:
                        self.role(pid, gpu, "context_owner", None, "zombie leader; live threads")
                    continue
                if proc.is_uninterruptible:
                    self.add_stuck(proc, gpu, [gpu])
                holds = host.holds_gpu(pid, gpu)
                if holds is None:
                    self.role(
                        pid, gpu, "unknown", None, "listed; whether it holds the GPU is unknown"
                    )
                elif not holds:
                    self.role(
                        pid,
                        gpu,
                        "unknown",
                        None,
                        "listed by NVML but holds no device file of this GPU (PID reused?)",
                    )

    def heirs_of(self, dead_pid: int) -> list[int]:
        heirs = []
        for pid, proc in sorted(self.host.procs.items()):
            recorded = self.lineage.get(proc.identity) if proc.identity is not None else None
            ids = {proc.ppid, proc.pgid, proc.sid}
            if recorded is not None:
                ids.add(recorded.ppid)
            if dead_pid in ids and not proc.is_zombie:
                heirs.append(pid)
        return heirs

    def cmdline_of(self, pid: int | None) -> str | None:
        proc = self.host.procs.get(pid) if pid is not None else None
        if proc is None or proc.cmdline is None:
            return None
        return " ".join(proc.cmdline)

    def role(self, pid: int, gpu: GpuInfo | None, role: str, owner: int | None, note: str) -> None:
        via: tuple[str, ...] = ()
        holding = self.host.holdings.get(pid)
        if gpu is not None and gpu.minor is not None and holding is not None:
            via = holding.via(gpu.minor)
        self.roles.append(
            HolderRole(
                pid, gpu.uuid if gpu is not None else NODE, HolderRoleName(role), owner, via, note
            )
        )

    def add_stuck(self, proc: ProcessInfo, gpu: GpuInfo | None, gpus: list[GpuInfo]) -> None:
        if proc.pid in self.stuck_done:
            return
        self.stuck_done.add(proc.pid)
        self.add(
            FindingKind.STUCK,
            gpu,
            proc.pid,
            proc.start_ticks,
            f"PID {proc.pid} is in uninterruptible sleep (D) while holding the GPU: "
            "it cannot be killed; drain or reboot",
            gpus=gpus,
            evidence={"state": proc.state, "gpus": [g.uuid for g in gpus]},
        )

    # -- holders --

    def assess_holders(self) -> None:
        host = self.host
        for pid, holding in sorted(host.holdings.items()):
            held = host.held_gpus(holding)
            proc = host.procs.get(pid)
            outcome = self.classify(pid, proc, holding, held)
            if proc is not None and outcome.kind is not None:
                target = outcome.gpu or (held[0] if held else None)
                memory = as_int(outcome.evidence.get("memory"))
                self.add(
                    outcome.kind,
                    target,
                    pid,
                    proc.start_ticks,
                    outcome.note,
                    memory=memory,
                    informational=outcome.kind is FindingKind.HIDDEN_HOLDER,
                    gpus=held,
                    evidence={
                        **outcome.evidence,
                        "gpus": [g.uuid for g in held],
                        "uvm": holding.uvm,
                        "ctl": holding.ctl,
                        **_process_evidence(proc, self.lineage),
                    },
                )
            if outcome.role == "stuck" and proc is not None:
                self.add_stuck(proc, held[0] if held else None, held)
            targets: list[GpuInfo | None] = list(held) or [None]
            for gpu in targets:
                role, owner, note = outcome.role, outcome.owner_pid, outcome.note
                listed_here = gpu is not None and pid in _listed_pids(host.listings[gpu.uuid])
                if role == "context_owner" and gpu is not None and not listed_here:
                    note = "owns a context on another GPU; CUDA opens every visible GPU"
                self.role(pid, gpu, role, owner, note)

    def classify(
        self,
        pid: int,
        proc: ProcessInfo | None,
        holding: DeviceHolding,
        held: list[GpuInfo],
    ) -> _Outcome:
        host = self.host
        if proc is None:
            return _Outcome("unknown", "no process facts (exited during the scan?)")
        if is_infrastructure(proc):
            return _Outcome("management", "infrastructure (never a target)")
        if proc.is_zombie:
            if pid in host.listed_alive:
                return _Outcome("context_owner", "zombie leader; live threads")
            return _Outcome("unknown", "zombie that still holds device files (live threads?)")
        if proc.is_uninterruptible:
            return _Outcome("stuck", "uninterruptible sleep (D)")
        job = proc.cgroup.job_key if proc.cgroup is not None else None
        ended = job_ended(proc, host.snapshot)
        job_ended_now = ended is not None
        abandoned = _Outcome(
            "hidden",
            f"its job {job} has ended while it still holds the GPU ({ended})",
            kind=FindingKind.ABANDONED,
            evidence={"job": job, "ended_by": ended},
        )
        if pid in host.listed_alive:
            if job_ended_now:
                abandoned.role = "context_owner"
                return abandoned
            return _Outcome("context_owner", "owns a context (listed by NVML)")
        unknown_links: list[str] = []
        heir_of = self.heir_of_dead_owner(proc)
        for owner in sorted(host.listed_alive.values(), key=lambda p: p.pid):
            related, link = relation(host, proc, owner)
            if related and heir_of is not None and _tree_link(host, proc, owner) is False:
                # Only a session, group or job joins it to this live owner, and kcmp proved
                # it holds a dead owner's own files (a dead torchrun rank's worker).
                continue
            if related:
                return _Outcome("worker", f"worker of PID {owner.pid} ({link})", owner.pid)
            if related is None:
                unknown_links.append(f"PID {owner.pid}: {link}")
        if job_ended_now:
            return abandoned
        if not holding.uvm:
            return _Outcome(
                "management",
                "NVML-only client (no nvidia-uvm): not a kill target, but it blocks a reset",
                kind=FindingKind.HIDDEN_HOLDER if held else None,
                evidence={"nvml_only": True},
            )
        if not held:
            return _Outcome(
                "hidden",
                "holds nvidiactl/nvidia-uvm but no GPU's device file: cannot be attributed",
                kind=FindingKind.HIDDEN_HOLDER,
                evidence={"unattributed": True},
            )
        hidden = "holds the GPU without a context; not explained by a live context owner"
        if unknown_links:
            return self.hidden(
                f"{hidden}; its relation to live owners is unknown ({'; '.join(unknown_links)})",
                undecided=True,
            )
        if proc.identity is None:
            return self.hidden(f"{hidden}; its start time is unknown", undecided=True)
        unseen = [g for g in host.gpus if g.lost or g.processes is None]
        if unseen:
            return self.hidden(
                f"{hidden}; GPU(s) {', '.join(str(g.index) for g in unseen)} could not say "
                "whether it owns a context there",
                undecided=True,
            )
        if heir_of is not None:
            gpu = held[0]
            why = (
                f"holds GPU {gpu.index} through open files of dead owner PID "
                f"{heir_of['dead_pid']} (kcmp, recorded while it lived); owns no context "
                "anywhere and no live context owner is its ancestor or descendant"
            )
            return _Outcome("orphaned", why, kind=FindingKind.ORPHANED, gpu=gpu, evidence=heir_of)
        for gpu in held:
            tie = self.dead_owner_tie(proc, gpu) or self.unaccounted_without_owner(gpu, proc)
            if tie is None:
                continue
            owner_pid = as_int(tie.get("dead_pid", tie.get("former_owner")))
            if owner_pid is not None and self.opened_own_files(proc, owner_pid):
                return _Outcome(
                    "hidden",
                    f"holds GPU {gpu.index} only through files it opened itself (kcmp: none is "
                    f"PID {owner_pid}'s, a spawn/forkserver worker): killing it frees none of "
                    "that owner's memory",
                    kind=FindingKind.HIDDEN_HOLDER,
                    gpu=gpu,
                    evidence={"own_files": True, "owner": owner_pid},
                )
            if tie["tie"] == "dead_owner":
                why = (
                    f"inherited GPU {gpu.index} from dead owner PID {tie['dead_pid']} "
                    f"({tie['link']}); owns no context and no live owner explains it"
                )
            else:
                why = (
                    f"holds GPU {gpu.index}, whose {_mib(as_int(tie['allocated']))} allocated "
                    f"no live context owner accounts for; owns no context anywhere"
                )
            return _Outcome("orphaned", why, kind=FindingKind.ORPHANED, gpu=gpu, evidence=tie)
        heir = self.likely_heir(proc, held)
        if heir is not None:
            return heir
        return self.hidden(f"{hidden}; nothing ties it to a dead owner")

    def likely_heir(self, proc: ProcessInfo, held: list[GpuInfo]) -> _Outcome | None:
        """A leak from before the daemon watched: the likely heir, without history.

        Every other orphan condition holds (the caller checked them); on a GPU it holds, memory
        above baseline + margin has no live context owner, the holder was known when that began,
        and its session or process-group leader no longer exists (looked up this poll: positive
        evidence, ``Snapshot.absent_pids``). A process that leads its own session (a notebook
        kernel) never qualifies. Reported as a ``hidden_holder`` naming the lost leader, or
        ``orphaned`` with ``tie: lost_leader`` under ``detection.orphans_without_history``.
        """
        lost = _lost_leader(proc, self.host.snapshot.absent_pids)
        answers = self.recorded_inheritance(proc)
        if lost is None or (answers and not any(shared for _, shared in answers)):
            return None  # kcmp: it opened its own files, so it is nobody's heir
        link, leader = lost
        for gpu in held:
            tie = self.memory_without_owner(gpu)
            since = self.unaccounted_since.get(gpu.uuid)
            recorded = self.lineage.get(proc.identity) if proc.identity is not None else None
            if tie is None or since is None or recorded is None or recorded.first_seen > since:
                continue
            evidence: dict[str, object] = {
                **tie,
                "tie": "lost_leader",
                "lost_leader": leader,
                "link": link,
                "unaccounted_since": since,
                "first_seen": recorded.first_seen,
            }
            memory = f"{_mib(as_int(tie['allocated']))} allocated on GPU {gpu.index}"
            if self.detection.orphans_without_history:
                why = (
                    f"likely heir of the {memory} that no live context owner accounts for: its "
                    f"{link} leader PID {leader} is gone and it owns no context anywhere "
                    "(detection.orphans_without_history)"
                )
                return _Outcome(
                    "orphaned", why, kind=FindingKind.ORPHANED, gpu=gpu, evidence=evidence
                )
            del evidence["tie"]
            evidence["likely_heir"] = True
            why = (
                f"likely heir of the {memory} that no live context owner accounts for: its {link} "
                f"leader PID {leader} is gone, but gpuwatchd never saw that owner alive (a leak "
                f"from before it watched); check it and kill PID {proc.pid} by hand, or set "
                "detection.orphans_without_history: true"
            )
            return _Outcome(
                "hidden", why, kind=FindingKind.HIDDEN_HOLDER, gpu=gpu, evidence=evidence
            )
        return None

    def recorded_inheritance(self, proc: ProcessInfo) -> tuple[tuple[ProcessIdentity, bool], ...]:
        return self.inheritance.get(proc.identity, ()) if proc.identity is not None else ()

    def opened_own_files(self, proc: ProcessInfo, owner_pid: int) -> bool:
        """kcmp found none of ``proc``'s device files to be owner ``owner_pid``'s own."""
        answers = [shared for o, shared in self.recorded_inheritance(proc) if o.pid == owner_pid]
        return bool(answers) and not any(answers)

    def heir_of_dead_owner(self, proc: ProcessInfo) -> dict[str, object] | None:
        """Evidence that ``proc`` holds open files of an owner that is now dead (kcmp).

        Recorded while that owner lived (``FileSharing.shared`` True); its death must be
        positive too: NVML lists its PID dead or as a zombie, its PID now names another
        process, or its PID was looked up and does not exist. That holds for every owner whose
        files it shares: if one of them lives, or its fate is unknown, the files are still
        that owner's too and killing the holder frees nothing, so it is nobody's heir.
        """
        host = self.host
        listed_dead = {
            row.entry.pid: row.status
            for rows in host.listings.values()
            for row in rows
            if row.status != "alive" and row.entry.pid not in host.listed_alive
        }
        evidence: dict[str, object] | None = None
        for owner, shared in self.recorded_inheritance(proc):
            if not shared or owner.pid == proc.pid:
                continue
            now = host.procs.get(owner.pid)
            if now is not None and now.start_ticks == owner.start_ticks:
                if owner.pid not in listed_dead:
                    return None  # alive (or a zombie that NVML does not list dead)
                status = listed_dead[owner.pid]
            elif owner.pid in listed_dead:
                status = listed_dead[owner.pid]
            elif now is not None and now.start_ticks is not None:
                status = "reused"
            elif owner.pid in host.snapshot.absent_pids:
                status = "dead"
            else:
                return None  # not described, not looked up: unknown is not dead
            if evidence is None:
                evidence = {
                    "tie": "inherited_files",
                    "dead_pid": owner.pid,
                    "dead_start_ticks": owner.start_ticks,
                    "dead_status": status,
                    "link": "kcmp",
                }
        return evidence

    def hidden(self, note: str, *, undecided: bool = False) -> _Outcome:
        """A hidden holder; ``undecided``: the orphan rule could not be decided for it (a
        relation, its start time or a GPU's list unknown), recorded as ``evidence.undecided``
        so the clean verdict (decide/verdict.py) counts it unknown, not merely a holder."""
        evidence: dict[str, object] = {"undecided": True} if undecided else {}
        return _Outcome("hidden", note, kind=FindingKind.HIDDEN_HOLDER, evidence=evidence)

    def dead_owner_tie(self, proc: ProcessInfo, gpu: GpuInfo) -> dict[str, object] | None:
        """A dead or zombie PID listed on ``gpu`` that is its parent, group or session."""
        recorded = self.lineage.get(proc.identity) if proc.identity is not None else None
        links = [
            ("recorded parent", recorded.ppid if recorded is not None else None),
            ("parent", proc.ppid),
            ("process group", proc.pgid),
            ("session", proc.sid),
        ]
        for row in self.host.listings[gpu.uuid]:
            if row.status == "alive" or row.entry.pid in self.host.listed_alive:
                continue
            for link, value in links:
                if value is not None and value == row.entry.pid:
                    return {
                        "tie": "dead_owner",
                        "dead_pid": row.entry.pid,
                        "dead_status": row.status,
                        "link": link,
                        "memory": row.entry.used_memory,
                    }
        return None

    # -- GPU-level memory findings --

    def assess_memory(self) -> None:
        for gpu in self.host.gpus:
            if gpu.lost:
                continue
            if gpu.coherent_memory:
                self.note(gpu, "coherent memory (NUMA node set): memory-based detection is off")
                continue
            if gpu.mig_enabled:
                self.note(gpu, "MIG enabled: memory-based detection is off")
                continue
            self.check_ghost(gpu)
            self.check_unaccounted(gpu)

    def check_ghost(self, gpu: GpuInfo) -> None:
        host, detection = self.host, self.detection
        figure, baseline, learned = self.baseline(gpu)
        if figure is None or baseline is None:
            memory = gpu.memory
            if memory is not None and memory.api == "v1":
                self.note(
                    gpu, "v1 memory API: no ghost detection until an idle baseline is learned"
                )
            elif memory is None or memory.allocated is None:
                self.note(gpu, "allocated memory unknown: no ghost detection")
            return
        if figure <= baseline + detection.ghost_margin:
            return
        excess = figure - baseline
        why_not: list[str] = []
        if gpu.minor is None:
            why_not.append("its minor number is unknown, so its holders cannot be found")
        if gpu.processes is None:
            why_not.append("its process list could not be read")
        live = [row.entry.pid for row in host.listings[gpu.uuid] if row.status != "dead"]
        if live:
            why_not.append(f"NVML lists live PID(s) {_pids(live)}")
        holders = [h.pid for h in host.holders_of(gpu) if not host.is_floor(h.pid)]
        if holders:
            why_not.append(f"held by PID(s) {_pids(holders)}")
        if not host.full_scan:
            why_not.append("the holder scan was targeted, not full")
        suspects = host.unreadable_suspects()
        if suspects:
            why_not.append(f"PID(s) {_pids(suspects)} could not be read (unknown is not none)")
        if why_not:
            self.note(gpu, f"{_mib(excess)} above baseline but not ghost: " + "; ".join(why_not))
            return
        dead = [row.entry.pid for row in host.listings[gpu.uuid]]
        self.add(
            FindingKind.GHOST_MEMORY,
            gpu,
            None,
            None,
            f"GPU {gpu.index} has {_mib(figure)} allocated, {_mib(excess)} above its "
            f"{'learned' if learned else 'default'} idle baseline, and no live process holds it",
            memory=excess,
            evidence={
                "allocated": figure,
                "baseline": baseline,
                "baseline_learned": learned,
                "margin": detection.ghost_margin,
                "memory_api": gpu.memory.api if gpu.memory is not None else None,
                "dead_pids": dead,
            },
        )

    def check_unaccounted(self, gpu: GpuInfo) -> None:
        host = self.host
        memory = gpu.memory
        if memory is None or memory.allocated is None or gpu.processes is None:
            return
        holders = [h.pid for h in host.holders_of(gpu) if not host.is_floor(h.pid)]
        if not holders:
            return
        baseline = self.baselines.get(gpu.uuid, self.detection.default_baseline)
        live = [row for row in host.listings[gpu.uuid] if row.status != "dead"]
        figures = [row.entry.used_memory for row in live]
        if any(value is None for value in figures):
            self.note(gpu, "a live owner's memory figure is unknown: unaccounted memory unchecked")
            return
        accounted = sum(value for value in figures if value is not None)
        excess = memory.allocated - accounted - baseline
        if excess <= self.detection.unaccounted_margin:
            return
        self.add(
            FindingKind.UNACCOUNTED_MEMORY,
            gpu,
            None,
            None,
            f"GPU {gpu.index} has {_mib(memory.allocated)} allocated but its live context owners "
            f"account for {_mib(accounted)}; {_mib(excess)} is unexplained",
            memory=excess,
            informational=True,
            evidence={
                "allocated": memory.allocated,
                "accounted": accounted,
                "baseline": baseline,
                "margin": self.detection.unaccounted_margin,
                "live_owners": [row.entry.pid for row in live],
                "holders": holders,
            },
        )

    def assess_driver_refusals(self, refused: Mapping[str, Mapping[str, object]]) -> None:
        """A GPU whose reset the driver refused as in use while no scan saw a holder has a
        hidden holder: the one finding that says what a /proc walk cannot see."""
        for gpu in self.host.gpus:
            evidence = refused.get(gpu.uuid)
            if evidence is None:
                continue
            self.add(
                FindingKind.HIDDEN_HOLDER,
                gpu,
                None,
                None,
                f"the driver refused to reset GPU {gpu.index}: in use by another client, yet no "
                "holder scan found one. Something holds the GPU where no walk of /proc looks: a "
                "file descriptor in flight in a unix-socket message (SCM_RIGHTS), a holder in "
                "another PID namespace or a VM, or a thread whose files could not be read. No "
                "reset of this GPU until its memory changes, the incident ends, the "
                "configuration is reloaded or `gpuwatchd resume --clear-latches` is run",
                informational=True,
                evidence=dict(evidence),
            )

    def result(self) -> Assessment:
        order = {gpu.uuid: gpu.index for gpu in self.host.gpus}
        findings = sorted(
            self.findings,
            key=lambda f: (order.get(f.gpu or "", -1), f.kind.value, f.pid or 0),
        )
        roles = sorted(self.roles, key=lambda r: (order.get(r.gpu, -1), r.pid))
        return Assessment(
            findings=tuple(findings),
            roles=tuple(roles),
            report_only=self.report_only,
            state=AssessState(
                baselines=self.baselines,
                lineage=self.lineage,
                boot_id=self.host.snapshot.boot_id,
                unaccounted_since=self.unaccounted_since,
                owners=self.owners,
                inheritance=self.inheritance,
            ),
            notes={uuid: tuple(lines) for uuid, lines in self.notes.items()},
        )


def job_ended(proc: ProcessInfo, snapshot: Snapshot) -> str | None:
    """Why ``proc``'s job is known to be over, or None (collect/jobs.py gathers the facts).

    Its own job cgroup directory was judged ended at the scheduler's location (a directory
    of the same job id elsewhere says nothing about this one); or the scheduler said the job
    ended, *after* this process started, and no slurmstepd started since serves the job (a
    requeued job with the same id). An unknown start time is never older than anything.
    """
    cgroup = proc.cgroup
    job = cgroup.job_key if cgroup is not None else None
    if cgroup is None or job is None:
        return None
    job_dir = cgroup.slurm_job_dir
    if job_dir is not None and job_dir in snapshot.ended_job_dirs:
        return f"no slurmstepd is left in {job_dir}"
    said = snapshot.handovers.get(job)
    if said is None or proc.start_ticks is None or proc.start_ticks >= said:
        return None
    stepd = snapshot.job_stepds.get(job)
    if stepd is not None and stepd >= said:
        return None  # a slurmstepd started after the word: the job id runs again (requeued)
    return "the scheduler said so after it started"


def assess(
    snapshot: Snapshot,
    previous: AssessState,
    detection: Detection,
    *,
    driver_refused: Mapping[str, Mapping[str, object]] | None = None,
    health_policy: HealthPolicy | None = None,
) -> Assessment:
    """Judge one snapshot: findings with evidence, each holder's role, and the new state.

    ``driver_refused`` maps a GPU UUID to the evidence of a reset the driver refused as in
    use while no scan saw a holder (``plan.hidden_holders``): each is a GPU-level
    ``hidden_holder`` while plan keeps the refusal. ``health_policy`` carries GPU health's
    detection options (``health.xid_63``, ``xid_94``, ``fabric_stuck_after``; default: the
    built-in ones).

    Pure: reads only its arguments. Processes whose job is known to be over
    (:func:`job_ended`) are ``abandoned``.
    """
    result = assess_processes(snapshot, previous, detection, driver_refused=driver_refused)
    return with_health(result, snapshot, previous, health_policy)


def assess_processes(
    snapshot: Snapshot,
    previous: AssessState,
    detection: Detection,
    *,
    driver_refused: Mapping[str, Mapping[str, object]] | None = None,
) -> Assessment:
    """:func:`assess` without GPU health: the findings about processes and memory, the roles,
    and the state other than ``health`` (its ``health`` is the default). Pure; the clock enters
    only as ``snapshot.monotonic`` stamped on state entries that are new."""
    # MIG (decide/mig.py): each GPU instance is judged as a GPU of its own.
    layout = mig_layout(snapshot)
    assessor = _Assessor(instance_view(snapshot, layout), previous, detection)
    assessor.assess_listings()
    assessor.assess_holders()
    assessor.assess_memory()
    assessor.assess_driver_refusals(driver_refused or {})
    return _with_mig(assessor.result(), layout, snapshot)


def with_health(
    result: Assessment,
    snapshot: Snapshot,
    previous: AssessState,
    health_policy: HealthPolicy | None,
) -> Assessment:
    """``result`` (:func:`assess_processes`) with GPU health assessed and joined."""
    # GPU health (decide/health.py): its findings join the others; its history rides along.
    boot_changed = previous.boot_id not in (None, snapshot.boot_id)
    health = assess_health(
        snapshot, previous.health, boot_changed=boot_changed, policy=health_policy
    )
    return replace(
        result,
        findings=result.findings + health.findings,
        state=replace(result.state, health=health.state),
    )


def _with_mig(result: Assessment, layout: MigLayout, snapshot: Snapshot) -> Assessment:
    """Findings about a MIG instance name it; a parent-only holder is said to be one."""
    if not layout.judged and not layout.unjudged:
        return result
    roles = tuple(
        replace(role, gpu=layout.parent_only[role.pid][0])
        if role.gpu == NODE and role.pid in layout.parent_only
        else role
        for role in result.roles
    )
    return replace(
        result,
        findings=tuple(annotate_findings(result.findings, layout, snapshot)),
        roles=roles,
        report_only=annotate_report_only(result.report_only, layout),
    )


def _process_evidence(
    proc: ProcessInfo, lineage: Mapping[ProcessIdentity, Lineage]
) -> dict[str, object]:
    recorded = lineage.get(proc.identity) if proc.identity is not None else None
    return {
        "ppid": proc.ppid,
        "pgid": proc.pgid,
        "sid": proc.sid,
        "user": proc.user,
        "cmdline": " ".join(proc.cmdline) if proc.cmdline is not None else None,
        "cgroup": proc.cgroup.path if proc.cgroup is not None else None,
        "job": proc.cgroup.job_key if proc.cgroup is not None else None,
        "recorded_ppid": recorded.ppid if recorded is not None else None,
        "first_seen": recorded.first_seen if recorded is not None else None,
    }


def _tree_link(host: HostView, a: ProcessInfo, b: ProcessInfo) -> bool | None:
    """Whether one of ``a`` and ``b`` descends from the other; None when a chain is broken."""
    above_a, complete_a = host.ancestors(a)
    above_b, complete_b = host.ancestors(b)
    if b.pid in above_a or a.pid in above_b:
        return True
    return False if complete_a and complete_b else None


def _lost_leader(proc: ProcessInfo, absent: frozenset[int]) -> tuple[str, int] | None:
    """("session" or "process group", leader PID) when that leader is known not to exist.

    None when ``proc`` leads its own session (a notebook kernel, a daemon: nothing was lost)
    or when its session or group is unknown.
    """
    if proc.sid is None or proc.pgid is None or proc.sid == proc.pid:
        return None
    for link, leader in (("session", proc.sid), ("process group", proc.pgid)):
        if leader != proc.pid and leader > 0 and leader in absent:
            return link, leader
    return None


def _listed_pids(rows: Iterable[Listing]) -> set[int]:
    return {row.entry.pid for row in rows}


def _mib(value: int | None) -> str:
    return "an unknown amount of" if value is None else f"{value // MIB} MiB"


def _pids(pids: Iterable[int]) -> str:
    return ", ".join(str(pid) for pid in pids)
