"""The holder pass: each process that holds device files, given a role by the orphan rule
(docs/findings.md), which wants positive evidence: a dead owner's tie, kcmp inheritance,
memory without an owner, the likely heir of a leak from before the daemon watched, an ended
job. In detail: docs/internals.md, section `gpuwatchd.decide.assess.holders`.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuwatchd.core.model import (
    DeviceHolding,
    FindingKind,
    GpuInfo,
    ProcessIdentity,
    ProcessInfo,
    Snapshot,
    as_int,
    fields_of,
)
from gpuwatchd.decide.assess.host_view import HostView, relation
from gpuwatchd.decide.assess.shared import AssessorState, Outcome, mib
from gpuwatchd.decide.assess.state import Inheritance, Lineage
from gpuwatchd.decide.floor import is_infrastructure
from gpuwatchd.decide.patterns import command_text

_HIDDEN = "holds the GPU without a context; not explained by a live context owner"


class HolderPass(AssessorState):
    """Every process that holds device files."""

    def assess_holders(self) -> None:
        host = self.host
        for pid, holding in sorted(host.holdings.items()):
            held = [g for g in host.gpus if g.minor is not None and g.minor in holding.gpu_minors]
            proc = host.procs.get(pid)
            outcome = self.classify(pid, proc, holding, held)
            if proc is not None and outcome.kind is not None:
                self.add(
                    outcome.kind,
                    outcome.gpu or (held[0] if held else None),
                    pid,
                    proc.start_ticks,
                    outcome.note,
                    memory=as_int(outcome.evidence.get("memory")),
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
                listed_here = gpu is not None and any(
                    row.entry.pid == pid for row in host.listings[gpu.uuid]
                )
                if role == "context_owner" and gpu is not None and not listed_here:
                    note = "owns a context on another GPU; CUDA opens every visible GPU"
                self.role(pid, gpu, role, owner, note)

    def classify(
        self, pid: int, proc: ProcessInfo | None, holding: DeviceHolding, held: list[GpuInfo]
    ) -> Outcome:
        host = self.host
        if proc is None:
            return Outcome("unknown", "no process facts (exited during the scan?)")
        if (by_state := self.by_process_state(pid, proc)) is not None:
            return by_state
        job = proc.cgroup.job_key if proc.cgroup is not None else None
        ended = job_ended(proc, host.snapshot)
        abandoned = Outcome(
            "hidden",
            f"its job {job} has ended while it still holds the GPU ({ended})",
            kind=FindingKind.ABANDONED,
            evidence={"job": job, "ended_by": ended},
        )
        if pid in host.listed_alive:
            if ended is not None:
                abandoned.role = "context_owner"
                return abandoned
            return Outcome("context_owner", "owns a context (listed by NVML)")
        heir_of = self.heir_of_dead_owner(proc)
        worker, unknown_links = self.worker_of(proc, heir_of)
        if worker is not None:
            return worker
        if ended is not None:
            return abandoned
        if (unexplained := self.unexplained(proc, holding, held, unknown_links)) is not None:
            return unexplained
        if heir_of is not None:
            gpu = held[0]
            why = (
                f"holds GPU {gpu.index} through open files of dead owner PID "
                f"{heir_of['dead_pid']} (kcmp, recorded while it lived); owns no context "
                "anywhere and no live context owner is its ancestor or descendant"
            )
            return Outcome("orphaned", why, kind=FindingKind.ORPHANED, gpu=gpu, evidence=heir_of)
        return (
            self.tied_to_dead_owner(proc, held)
            or self.likely_heir(proc, held)
            or self.hidden(f"{_HIDDEN}; nothing ties it to a dead owner")
        )

    def by_process_state(self, pid: int, proc: ProcessInfo) -> Outcome | None:
        """The role that the process's own state settles: infrastructure, zombie, stuck."""
        if is_infrastructure(proc):
            return Outcome("management", "infrastructure (never a target)")
        if proc.is_zombie:
            if pid in self.host.listed_alive:
                return Outcome("context_owner", "zombie leader; live threads")
            return Outcome("unknown", "zombie that still holds device files (live threads?)")
        if proc.is_uninterruptible:
            return Outcome("stuck", "uninterruptible sleep (D)")
        return None

    def worker_of(
        self, proc: ProcessInfo, heir_of: dict[str, object] | None
    ) -> tuple[Outcome | None, list[str]]:
        """A worker of a live owner, or None and the owners whose relation to it is unknown."""
        host = self.host
        unknown_links: list[str] = []
        for owner in sorted(host.listed_alive.values(), key=lambda p: p.pid):
            related, link = relation(host, proc, owner)
            if related and heir_of is not None and _tree_link(host, proc, owner) is False:
                continue  # not in its tree, and kcmp proved it holds a dead owner's files
            if related:
                return Outcome("worker", f"worker of PID {owner.pid} ({link})", owner.pid), []
            if related is None:
                unknown_links.append(f"PID {owner.pid}: {link}")
        return None, unknown_links

    def unexplained(
        self,
        proc: ProcessInfo,
        holding: DeviceHolding,
        held: list[GpuInfo],
        unknown_links: list[str],
    ) -> Outcome | None:
        """A holder that no rule can call orphaned: NVML-only, unattributed, or undecided."""
        host = self.host
        if not holding.uvm:
            return Outcome(
                "management",
                "NVML-only client (no nvidia-uvm): not a kill target, but it blocks a reset",
                kind=FindingKind.HIDDEN_HOLDER if held else None,
                evidence={"nvml_only": True},
            )
        if not held:
            return Outcome(
                "hidden",
                "holds nvidiactl/nvidia-uvm but no GPU's device file: cannot be attributed",
                kind=FindingKind.HIDDEN_HOLDER,
                evidence={"unattributed": True},
            )
        if unknown_links:
            return self.hidden(
                f"{_HIDDEN}; its relation to live owners is unknown ({'; '.join(unknown_links)})",
                undecided=True,
            )
        if proc.identity is None:
            return self.hidden(f"{_HIDDEN}; its start time is unknown", undecided=True)
        unseen = [g for g in host.gpus if g.lost or g.processes is None]
        if unseen:
            return self.hidden(
                f"{_HIDDEN}; GPU(s) {', '.join(str(g.index) for g in unseen)} could not say "
                "whether it owns a context there",
                undecided=True,
            )
        if cut := [o.pid for o, shared in self.recorded_inheritance(proc) if shared is None]:
            return self.hidden(  # the rules below never see an answer cut short
                f"{_HIDDEN}; kcmp could not compare its device files with PID {cut[0]}'s: it "
                "or that owner had more fd entries than a poll reads",
                undecided=True,
            )
        return None

    def tied_to_dead_owner(self, proc: ProcessInfo, held: list[GpuInfo]) -> Outcome | None:
        """Orphaned through a tie to a dead owner or its memory (or holding only its own files)."""
        for gpu in held:
            tie = self.dead_owner_tie(proc, gpu) or self.unaccounted_without_owner(gpu, proc)
            if tie is None:
                continue
            owner_pid = as_int(tie.get("dead_pid", tie.get("former_owner")))
            if owner_pid is not None and self.opened_own_files(proc, owner_pid):
                return Outcome(
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
                    f"holds GPU {gpu.index}, whose {mib(as_int(tie['allocated']))} allocated "
                    f"no live context owner accounts for; owns no context anywhere"
                )
            return Outcome("orphaned", why, kind=FindingKind.ORPHANED, gpu=gpu, evidence=tie)
        return None

    def likely_heir(self, proc: ProcessInfo, held: list[GpuInfo]) -> Outcome | None:
        """The likely heir of a leak from before the daemon watched (docs/internals.md)."""
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
            memory = f"{mib(as_int(tie['allocated']))} allocated on GPU {gpu.index}"
            why = (
                f"likely heir of the {memory} that no live context owner accounts for: its {link} "
                f"leader PID {leader} is gone"
            )
            if self.detection.orphans_without_history:
                why += " and it owns no context anywhere (detection.orphans_without_history)"
                return Outcome(
                    "orphaned", why, kind=FindingKind.ORPHANED, gpu=gpu, evidence=evidence
                )
            del evidence["tie"]
            evidence["likely_heir"] = True
            why += (
                ", but gpuwatchd never saw that owner alive (a leak from before it watched); "
                f"check it and kill PID {proc.pid} by hand, or set "
                "detection.orphans_without_history: true"
            )
            return Outcome(
                "hidden", why, kind=FindingKind.HIDDEN_HOLDER, gpu=gpu, evidence=evidence
            )
        return None

    def recorded_inheritance(self, proc: ProcessInfo) -> Inheritance:
        return self.inheritance.get(proc.identity, ()) if proc.identity is not None else ()

    def opened_own_files(self, proc: ProcessInfo, owner_pid: int) -> bool:
        """kcmp found none of ``proc``'s device files to be owner ``owner_pid``'s own."""
        answers = [shared for o, shared in self.recorded_inheritance(proc) if o.pid == owner_pid]
        return bool(answers) and not any(answers)

    def heir_of_dead_owner(self, proc: ProcessInfo) -> dict[str, object] | None:
        """Evidence that ``proc`` holds open files (kcmp) of owners all positively dead."""
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

    def hidden(self, note: str, *, undecided: bool = False) -> Outcome:
        """A hidden holder; ``undecided``: the orphan rule was not decided (docs/internals.md)."""
        evidence: dict[str, object] = {"undecided": True} if undecided else {}
        return Outcome("hidden", note, kind=FindingKind.HIDDEN_HOLDER, evidence=evidence)

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

    def unaccounted_without_owner(
        self, gpu: GpuInfo, proc: ProcessInfo
    ) -> dict[str, object] | None:
        """Evidence that ``proc`` may inherit ownerless memory on ``gpu`` (docs/internals.md)."""
        tie = self.memory_without_owner(gpu)
        since = self.unaccounted_since.get(gpu.uuid)
        recorded = self.lineage.get(proc.identity) if proc.identity is not None else None
        if tie is None or since is None or recorded is None or recorded.first_seen > since:
            return None
        live, procs = set(self.host.listed_alive), self.host.procs
        # A PID that names another process now (or one of unknown start) may be what the
        # lineage recorded: reused, it proves nothing.
        former = {
            o.pid
            for o in self.owners
            if o.pid not in live and (o.pid not in procs or procs[o.pid].identity == o)
        }
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


def job_ended(proc: ProcessInfo, snapshot: Snapshot) -> str | None:
    """Why ``proc``'s job is known to be over, or None (docs/internals.md)."""
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


def _process_evidence(
    proc: ProcessInfo, lineage: Mapping[ProcessIdentity, Lineage]
) -> dict[str, object]:
    recorded = lineage.get(proc.identity) if proc.identity is not None else None
    return {
        **fields_of(proc, ("ppid", "pgid", "sid", "user")),
        "cmdline": command_text(proc.cmdline) if proc.cmdline is not None else None,
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
    """("session" or "process group", leader PID) when that leader is known not to exist;
    None when ``proc`` leads its own session (nothing was lost) or either is unknown."""
    if proc.sid is None or proc.pgid is None or proc.sid == proc.pid:
        return None
    for link, leader in (("session", proc.sid), ("process group", proc.pgid)):
        if leader != proc.pid and leader > 0 and leader in absent:
            return link, leader
    return None
