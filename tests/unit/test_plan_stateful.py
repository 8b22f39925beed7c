"""A Hypothesis state machine drives plan() and record_*() like the daemon does, through random
findings, processes that appear, exit and have their PID reused, clocks that advance (the wall
clock also stepping back), reboots, restarts from saved state, admin pause and clears, and
checks the invariants of docs/architecture.md, testing without a GPU after every poll:

- never a SignalIntent for a floor or protected process, or for an identity that is not the
  live process holding that PID (PID reuse);
- never a ResetIntent for a GPU with a live holder, or while another reset is in flight;
- never more resets of a GPU within the window than ``max_resets``;
- the real steps of a ladder come in order, each at most once;
- never more distinct processes signalled per poll / per hour than the kill cap;
- GPU health: never a health reset while NVML lists a live job anywhere on the node (no device
  isolation), never a signal for it; a drain wait keeps its start across restarts, is bounded
  (past ``drain_timeout`` with a job still there it has given up: ``on_failure`` once per
  wait), and the drain hooks run once per wait.

Profiles (tests/conftest.py): ``default`` (120 examples of 60 steps, ~6 s) and ``ci`` (800 of
80, about 90 s on one core) are derandomized: the same examples every run. ``make explore``
runs them random and longer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpuwatchd.core import model
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.plan.decisions import clear_circuit, clear_forced_dry_run, plan, set_paused
from gpuwatchd.decide.plan.intents import HookIntent, ResetIntent, SignalIntent, target_key
from gpuwatchd.decide.plan.outcomes import record_exit, record_reset, record_signal
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import (
    FLOOR_PROCESS_NAMES,
    Detection,
    HealthPolicy,
    Hook,
    Limits,
    Policy,
    Protect,
    ResetPolicy,
    Rule,
    Step,
)

GPUS = ("GPU-aaaa", "GPU-bbbb")
GIB = 1024 * model.MIB
SELF_PID = 4242
NORMAL_SLOTS = (1000, 1001, 1002, 1003, 1004)
SLOTS = (*NORMAL_SLOTS, *NORMAL_SLOTS, 1, 1500, SELF_PID)
KINDS = (
    model.FindingKind.ORPHANED,
    model.FindingKind.ABANDONED,
    model.FindingKind.HIDDEN_HOLDER,
    model.FindingKind.STUCK,
    model.FindingKind.ZOMBIE,
)
HOLDER_KINDS = {k.value for k in KINDS}
NAMES = ("python3",) * 6 + ("nv-hostengine", "nvidia-persiste", "Xorg")
USERS = ("bob",) * 6 + ("alice", None)

POLICY = Policy(
    dry_run=False,
    rules=(
        Rule("orphans", model.FindingKind.ORPHANED,
             (Step("SIGTERM", 5.0), Step("SIGKILL", 3.0)), 2.0),
        Rule("abandoned", model.FindingKind.ABANDONED, (Step("SIGKILL", 1.0),)),
        Rule("stuck", model.FindingKind.STUCK, (Step(None, 0.0),)),
    ),
    protect=Protect(users=("alice",)),
    limits=Limits(
        max_signalled_per_poll=2,
        max_signalled_per_hour=4,
        node_max_signalled_per_hour=6,
        kill_cap_latch=600.0,
        post_action_delay=3.0,
    ),
    reset=ResetPolicy(
        confirm_for=10.0, cooldown=20.0, max_resets=2, window=200.0, max_failures=2,
        drain=(Hook(("drain-node",)),),
    ),
    health=HealthPolicy(drain_timeout=60.0),
)  # fmt: skip
HEALTH = (
    model.FindingKind.RESET_REQUIRED,
    model.FindingKind.REBOOT_REQUIRED,
    model.FindingKind.DRAIN_REQUIRED,
)


def is_floor_or_protected(p: model.ProcessInfo) -> bool:
    """The oracle: never signalled. A floor name counts only from root (uid 0) whose program
    is not known to be a user's: trusted, it is infrastructure; unread, it is unknown. A
    user's process in a login session that calls itself so is a look-alike: a fair target."""
    floor_comms = {n[:15] for n in FLOOR_PROCESS_NAMES}
    claims = bool(p.names & FLOOR_PROCESS_NAMES) or (p.comm or "") in floor_comms
    return (
        p.pid <= 2
        or p.pid == SELF_PID
        or (claims and p.uid == 0 and p.exe_trusted is not False)
        or p.user in (None, "alice")
    )


class EscalationMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.state = PlanState()
        self.policy = POLICY
        self.mono = 100.0
        self.clock = 0.0  # forward time only, across reboots: what the reset limits count
        self.wall = 1_700_000_000.0
        self.boot = 0
        self.ticks = 1000
        self.procs: dict[int, model.ProcessInfo] = {}
        self.findings: dict[int, model.FindingKind] = {}
        self.ghosts: set[str] = set()
        # Incidents whose real reset was refused (final scan, hooks, the driver's "in use"):
        # never reset again (drain and before hooks at most once) until the incident ends.
        self.refused_incidents: set[str] = set()
        self.in_flight: ResetIntent | None = None
        # Oracles, in the model's own time (monotonic; the wall clock only ever steps back).
        self.real_steps: dict[str, int] = {}
        self.first_signalled: dict[str, float] = {}
        self.signalled_uid: dict[str, int | None] = {}  # whose cap a target counted against
        self.resets_done: list[tuple[str, float]] = []
        self.polls = 0
        self.health: dict[str, model.FindingKind] = {}  # GPU → its health finding
        self.listed: set[int] = set()  # live jobs NVML lists (on GPU pid % 2)
        self.drains: dict[tuple[str, bool], int] = {}  # (finding, dry_run) → drain hooks
        self.timeouts: dict[str, int] = {}  # GPU → drain timeouts this wait
        self.wait_since: dict[str, float] = {}

    # --- the world ----------------------------------------------------------------------------

    @rule(
        slot=st.sampled_from(SLOTS),
        name=st.sampled_from(NAMES),
        user=st.sampled_from(USERS),
        kind=st.sampled_from((None, model.FindingKind.ORPHANED, *KINDS)),
        job=st.booleans(),
        root=st.booleans(),
        exe_trusted=st.sampled_from((True, False, None)),
    )
    def spawn(
        self,
        slot: int,
        name: str,
        user: str | None,
        kind: model.FindingKind | None,
        job: bool,
        *,
        root: bool = False,
        exe_trusted: bool | None = None,
    ) -> None:
        if slot in self.procs:
            return
        self.born(
            slot,
            uid=0 if root else 1000,
            user=user,
            comm=name,
            cmdline=(name, "job.py"),
            cgroup=model.CgroupInfo("/user.slice/session-3.scope"),
            exe_trusted=exe_trusted,
        )
        if kind is not None:
            self.set_finding(slot, kind)
        elif job:
            self.list_job(slot)

    def born(self, slot: int, **fields: Any) -> None:
        """A new sleeping process at ``slot``, its own session leader, its parent init."""
        self.ticks += 1
        self.procs[slot] = model.ProcessInfo(
            pid=slot, start_ticks=self.ticks, state="S", ppid=1, pgid=slot, sid=slot, **fields
        )

    @rule(slot=st.sampled_from(SLOTS))
    def list_job(self, slot: int) -> None:
        """A live process owns a context: NVML lists it (a job, blocking health resets)."""
        p = self.procs.get(slot)
        if p is not None and p.state != "Z" and slot != SELF_PID:
            self.listed.add(slot)

    @rule(gpu=st.sampled_from(GPUS), kind=st.sampled_from((None, *HEALTH)))
    def gpu_health(self, gpu: str, kind: model.FindingKind | None) -> None:
        """The driver asks for a reset, a reboot or a drain (or stops asking)."""
        if kind is None:
            self.health.pop(gpu, None)
        else:
            self.health[gpu] = kind

    @rule(slot=st.sampled_from(SLOTS), seen_by_act=st.booleans())
    def exit(self, slot: int, seen_by_act: bool) -> None:
        self.listed.discard(slot)
        p = self.procs.pop(slot, None)
        self.findings.pop(slot, None)
        if p is not None and seen_by_act and p.identity is not None:
            self.state = record_exit(self.state, p.identity, now=self.mono).state

    @rule(slot=st.sampled_from(SLOTS), keep_finding=st.booleans())
    def reuse_pid(self, slot: int, keep_finding: bool) -> None:
        """The process exits and an unrelated one gets its PID before the next poll."""
        p = self.procs.get(slot)
        if p is None:
            return
        self.listed.discard(slot)
        self.born(slot, uid=1000, user="bob", comm="python3", cmdline=("python3", "other.py"))
        if not keep_finding:
            self.findings.pop(slot, None)

    @rule(slot=st.sampled_from(SLOTS), kind=st.sampled_from(KINDS))
    def set_finding(self, slot: int, kind: model.FindingKind) -> None:
        p = self.procs.get(slot)
        if p is None:
            return
        self.findings[slot] = kind
        state = {model.FindingKind.STUCK: "D", model.FindingKind.ZOMBIE: "Z"}.get(kind, "S")
        self.procs[slot] = replace(p, state=state)

    @rule(slot=st.sampled_from(SLOTS))
    def clear_finding(self, slot: int) -> None:
        self.findings.pop(slot, None)

    def advance(self, dt: float) -> None:
        self.mono += dt
        self.wall += dt
        self.clock += dt

    @rule(
        what=st.sampled_from(["ghost", "ghost", "jump", "jump", "wall_back", "reboot"]),
        gpu=st.sampled_from(GPUS),
        amount=st.sampled_from([1.0, 10.0, 30.0, 300.0, 2000.0, 86400.0]),
    )
    def world(self, what: str, gpu: str, amount: float) -> None:
        """Ghost memory comes or goes; time jumps; the wall clock steps back; a reboot."""
        if what == "ghost":
            self.ghosts ^= {gpu}
        elif what == "jump":
            self.advance(min(amount, 2000.0))
        elif what == "wall_back":
            self.mono += 0.1
            self.clock += 0.1
            self.wall -= amount
        else:
            self.boot += 1
            self.mono = 50.0
            self.wall += 120.0
            self.clock += 120.0
            self.procs.clear()
            self.findings.clear()
            self.listed.clear()
            self.drains.clear()  # a new boot: a new episode, drained afresh
            self.wait_since.clear()
            self.timeouts.clear()
            self.in_flight = None
            self.real_steps.clear()
            self.first_signalled.clear()
            self.signalled_uid.clear()
            self.refused_incidents.clear()

    @rule(what=st.sampled_from(["pause", "resume", "clear_kill_cap", "clear_circuit", "restart"]))
    def admin(self, what: str) -> None:
        """An admin's switches, and a daemon restart from its saved state."""
        if what in ("pause", "resume"):
            self.state = set_paused(self.state, what == "pause", reason="test")
        elif what == "clear_kill_cap":
            self.state = clear_forced_dry_run(self.state)
        elif what == "clear_circuit":
            self.state = clear_circuit(self.state)
            self.refused_incidents.clear()
        else:
            self.state = PlanState.from_json(json.loads(json.dumps(self.state.to_json())))

    @precondition(lambda self: self.in_flight is not None)
    @rule(outcome=st.sampled_from(["success", "failed", "timeout", "refused", "in_use", "dry_run"]))
    def finish_reset(self, outcome: str) -> None:
        intent = self.in_flight
        assert intent is not None
        if intent.dry_run:
            outcome = "dry_run"
        elif outcome == "dry_run":
            outcome = "success"
        result = record_reset(self.state, intent, outcome, now=self.mono, wall=self.wall)
        self.state = result.state
        self.in_flight = None
        if outcome in ("refused", "in_use"):
            self.refused_incidents.add(intent.finding_key)
            assert not [i for i in result.intents if isinstance(i, HookIntent)], "not a failure"
        if outcome in ("success", "failed", "timeout"):
            self.resets_done.append((intent.gpu, self.clock))
        if outcome == "success":
            self.ghosts.discard(intent.gpu)
            if intent.finding_key.startswith(model.FindingKind.RESET_REQUIRED.value):
                self.health.pop(intent.gpu, None)  # the driver is satisfied
        if outcome in ("failed", "timeout"):
            # on_failure, then the on_action notification of a reset that ran; nothing else.
            assert [(type(i), i.hook) for i in result.intents if isinstance(i, HookIntent)] == [
                (HookIntent, "on_failure"),
                (HookIntent, "on_action"),
            ]
            assert len(result.intents) == 2
        if outcome == "success":
            assert [i.hook for i in result.intents if isinstance(i, HookIntent)] == ["on_action"]

    # --- one poll -----------------------------------------------------------------------------

    def _snapshot(self) -> tuple[list[model.Finding], model.Snapshot]:
        findings = []
        holdings = {}
        for pid, kind in sorted(self.findings.items()):
            p = self.procs[pid]
            gpu = GPUS[pid % 2]
            findings.append(
                model.Finding(
                    kind, gpu, pid, p.start_ticks, "test", 300 * model.MIB, True, {"uvm": True}
                )
            )
            holdings[pid] = model.DeviceHolding(pid, frozenset({pid % 2}), uvm=True)
        for gpu in sorted(self.ghosts):
            findings.append(
                model.Finding(model.FindingKind.GHOST_MEMORY, gpu, None, None, "ghost", model.MIB)
            )
        for gpu, kind in sorted(self.health.items()):
            findings.append(model.Finding(kind, gpu, None, None, "the driver asks", None))
        for pid in sorted(self.listed):
            old = holdings.get(pid, model.DeviceHolding(pid, uvm=True))
            holdings[pid] = replace(old, gpu_minors_fd=old.gpu_minors_fd | {pid % 2})
        snapshot = model.Snapshot(
            monotonic=self.mono,
            wall_time=self.wall,
            boot_id=f"boot-{self.boot}",
            nvml=model.NvmlReading(
                available=True,
                gpus=tuple(
                    model.GpuInfo(
                        index=i,
                        uuid=u,
                        minor=i,
                        mig_enabled=False,
                        processes=tuple(
                            model.NvmlProcess(pid, 300 * model.MIB, "compute")
                            for pid in sorted(self.listed)
                            if pid % 2 == i
                        ),
                    )
                    for i, u in enumerate(GPUS)
                ),
            ),
            processes=dict(self.procs),
            holders=model.HolderScan("full", holdings),
            self_pids=frozenset({SELF_PID}),
        )
        return findings, snapshot

    @rule(
        kill_works=st.booleans(),
        term_works=st.booleans(),
        dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 5.0]),
    )
    def poll(self, kill_works: bool, term_works: bool, dt: float) -> None:
        """The daemon's loop: time passes, then one poll, and act reports each outcome."""
        self.advance(dt)
        for pid, p in self.procs.items():
            if self.findings.get(pid) not in (
                model.FindingKind.ORPHANED,
                model.FindingKind.ABANDONED,
            ):
                # No actionable finding about this process: a later one is a new episode,
                # which may start again from step 1.
                self.real_steps.pop(f"{pid}@{p.start_ticks}", None)
        findings, snapshot = self._snapshot()
        self.refused_incidents &= {f.key for f in findings}  # an incident that ended is over
        result = plan(findings, snapshot, self.state, self.policy, now=self.mono, wall=self.wall)
        self.state = result.state
        self.polls += 1
        new_this_poll: dict[int | None, int] = {}  # uid -> identities first signalled
        for intent in result.intents:
            if isinstance(intent, SignalIntent):
                assert intent.identity.pid in self.findings, "a signal for a health finding"
                uid = self.procs[intent.identity.pid].uid
                new = self._check_and_deliver(intent, kill_works, term_works)
                new_this_poll[uid] = new_this_poll.get(uid, 0) + new
            elif isinstance(intent, ResetIntent):
                self._check_reset(intent, findings)
            elif intent.hook == "reset_drain":
                key = (str(intent.facts.get("finding")), intent.dry_run)
                self.drains[key] = self.drains.get(key, 0) + 1
                assert self.drains[key] == 1, "the drain hooks ran twice for one finding"
            elif "still held after" in intent.reason:
                gpu = str(intent.facts.get("gpu"))
                self.timeouts[gpu] = self.timeouts.get(gpu, 0) + 1
                assert self.timeouts[gpu] == 1, "on_failure twice for one drain wait"
        assert all(n <= self.policy.limits.max_signalled_per_poll for n in new_this_poll.values())
        self._check_health_waits()

    def _check_health_waits(self) -> None:
        waits = self.state.health_waits
        current = {f"{kind.value}:{gpu}:gpu" for gpu, kind in self.health.items()}
        # A finding that is gone starts afresh when it comes back.
        self.drains = {k: v for k, v in self.drains.items() if k[0] in current}
        for gpu in GPUS:
            if self.health.get(gpu) is None or gpu not in waits:
                self.wait_since.pop(gpu, None)
                self.timeouts.pop(gpu, None)
                continue
            wait = waits[gpu]
            since = self.wait_since.setdefault(gpu, wait.since)
            # Only a switch between dry-run and real (the kill cap, an admin) starts a new wait.
            assert since == wait.since or (wait.finding_key, not wait.dry_run) in self.drains, (
                "the drain wait lost its start"
            )
            self.wait_since[gpu] = wait.since
            jobs = [pid for pid in self.listed if pid in self.procs]
            if jobs and self.mono - wait.since >= self.policy.health.drain_timeout:
                assert wait.expired, "a drain wait went past its timeout"

    def _check_and_deliver(self, intent: SignalIntent, kill_works: bool, term_works: bool) -> int:
        identity = intent.identity
        p = self.procs.get(identity.pid)
        # The identity is the live process holding that PID, never a reuse, never a zombie.
        assert p is not None
        assert p.start_ticks == identity.start_ticks
        assert p.state != "Z"
        assert not is_floor_or_protected(p), p
        key = target_key(identity)
        new = 0
        if not intent.dry_run:
            assert intent.step == self.real_steps.get(key, 0) + 1, (intent, self.real_steps)
            self.real_steps[key] = intent.step
            if key not in self.first_signalled:
                self.first_signalled[key] = self.mono
                self.signalled_uid[key] = p.uid
                new = 1
            hour = [k for k, t in self.first_signalled.items() if self.mono - t < 3600.0]
            assert len(hour) <= self.policy.limits.node_max_signalled_per_hour
            mine = [k for k in hour if self.signalled_uid.get(k) == p.uid]
            assert len(mine) <= self.policy.limits.max_signalled_per_hour
        outcome = "dry_run" if intent.dry_run else "delivered"
        self.state = record_signal(self.state, intent, outcome, now=self.mono).state
        dies = (intent.signal == "SIGKILL" and kill_works) or term_works
        if not intent.dry_run and dies and p.state != "D":
            self.procs.pop(identity.pid)
            self.findings.pop(identity.pid, None)
        return new

    def _check_reset(self, intent: ResetIntent, findings: list[model.Finding]) -> None:
        assert self.in_flight is None, "a second reset while one is in flight"
        if intent.finding_key.startswith(model.FindingKind.RESET_REQUIRED.value):
            # A zombie (its whole thread group gone) holds no file and no memory: not a job.
            jobs = [
                pid for pid in self.listed if pid in self.procs and self.procs[pid].state != "Z"
            ]
            assert jobs == [], f"a health reset while NVML lists live jobs {jobs}"
            assert self.health.get(intent.gpu) is model.FindingKind.RESET_REQUIRED
        holders = [
            f for f in findings if f.gpu == intent.gpu and f.pid is not None and f.kind in KINDS
        ]
        assert holders == [], holders
        if not intent.dry_run:
            assert intent.finding_key not in self.refused_incidents, "a refused incident again"
            window = self.policy.reset.window
            recent = [t for g, t in self.resets_done if g == intent.gpu and self.clock - t < window]
            assert len(recent) < self.policy.reset.max_resets
        self.in_flight = intent

    @invariant()
    def state_survives_json(self) -> None:
        assert PlanState.from_json(json.loads(json.dumps(self.state.to_json()))) == self.state


TestEscalation = EscalationMachine.TestCase


# --- issue 15: the inheritance evidence, through assess and plan together ----------------------
#
# A small host of jobs (a shell leading each session, an owner with a context, its forked and
# spawned workers), idle notebook kernels that lead their own sessions, owners that die (their
# memory pinned by forked workers only), shells that exit, kcmp available or not, the
# `orphans_without_history` key on or off, and a leak from before the daemon watched. Every poll
# runs assess() and plan() as the engine does. Invariant: no healthy process is ever signalled —
# owners, shells, notebooks, workers of a live owner, and spawn workers whose own files kcmp
# recorded, or a spawn worker whose fd table a poll's budget cut short ("flood": undecided).
# Only a forked worker of a dead owner may be (or, under today's rules without kcmp evidence, a
# spawn worker whose parent died).


@dataclass
class _Proc:
    pid: int
    role: str  # shell, owner, fork, spawn, flood, notebook
    ppid: int
    sid: int
    gpu: int = 0
    owner: int | None = None
    recorded: bool = False  # kcmp's answer about it was seen while its owner lived


class InheritanceMachine(RuleBasedStateMachine):
    @initialize(
        kcmp=st.booleans(),
        key=st.booleans(),
        leak_before=st.booleans(),
        listed_dead=st.booleans(),
    )
    def start(self, kcmp: bool, key: bool, leak_before: bool, listed_dead: bool) -> None:
        self.kcmp = kcmp
        self.detection = Detection(orphans_without_history=key)
        self.policy = Policy(
            dry_run=False,
            rules=(Rule("orphans", model.FindingKind.ORPHANED, (Step("SIGTERM", 1.0),), 0.0),),
        )
        self.procs: dict[int, _Proc] = {}
        self.dead_owners: dict[int, tuple[int, bool]] = {}  # owner pid -> (gpu, NVML lists it)
        self.next_pid = 2000
        self.mono = 100.0
        self.astate = AssessState(boot_id="boot-1")
        self.pstate = PlanState()
        if leak_before:  # all of this happened before the first poll
            shell = self._new("shell", ppid=1, sid=None)
            owner = self._new("owner", ppid=shell.pid, sid=shell.sid)
            self._new("fork", ppid=owner.pid, sid=owner.sid, owner=owner.pid)
            self._die(owner.pid, listed_dead)
            self.procs.pop(shell.pid)

    def _new(self, role: str, *, ppid: int, sid: int | None, owner: int | None = None,
             gpu: int = 0) -> _Proc:  # fmt: skip
        self.next_pid += 1
        proc = _Proc(self.next_pid, role, ppid, sid if sid is not None else self.next_pid, gpu,
                     owner)  # fmt: skip
        self.procs[proc.pid] = proc
        return proc

    def _die(self, pid: int, listed_dead: bool) -> None:
        proc = self.procs.pop(pid)
        for child in self.procs.values():
            if child.ppid == pid:
                child.ppid = 1
        if proc.role == "owner":
            self.dead_owners[pid] = (proc.gpu, listed_dead)

    def _pick(self, role: str, index: int) -> _Proc | None:
        found = [p for p in self.procs.values() if p.role == role]
        return found[index % len(found)] if found else None

    @rule(gpu=st.sampled_from((0, 1)), share=st.integers(0, 3))
    def start_job(self, gpu: int, share: int) -> None:
        """A job: a new shell and session, or (torchrun) a rank in an existing live session."""
        shell = self._pick("shell", share) if share else None
        if shell is None:
            shell = self._new("shell", ppid=1, sid=None)
        self._new("owner", ppid=shell.pid, sid=shell.sid, gpu=gpu)

    @rule(index=st.integers(0, 5), role=st.sampled_from(("fork", "spawn", "flood")))
    def add_worker(self, index: int, role: str) -> None:
        owner = self._pick("owner", index)
        if owner is not None:
            self._new(role, ppid=owner.pid, sid=owner.sid, owner=owner.pid, gpu=owner.gpu)

    @rule()
    def notebook(self) -> None:
        self._new("notebook", ppid=1, sid=None)

    @rule(index=st.integers(0, 5), listed_dead=st.booleans())
    def kill_owner(self, index: int, listed_dead: bool) -> None:
        owner = self._pick("owner", index)
        if owner is not None:
            self._die(owner.pid, listed_dead)

    @rule(index=st.integers(0, 5))
    def exit_shell(self, index: int) -> None:
        shell = self._pick("shell", index)
        if shell is not None:
            self._die(shell.pid, False)

    @rule()
    def restart(self) -> None:
        self.astate = AssessState.from_json(json.loads(json.dumps(self.astate.to_json())))

    def _pinned(self, owner: int) -> bool:
        return any(p.role == "fork" and p.owner == owner for p in self.procs.values())

    def _snapshot(self) -> model.Snapshot:
        holdings: dict[int, model.DeviceHolding] = {}
        listed: dict[int, list[model.NvmlProcess]] = {0: [], 1: []}
        used = {0: 2 * model.MIB, 1: 2 * model.MIB}
        sharing: list[model.FileSharing] = []
        for p in self.procs.values():
            if p.role == "owner":  # CUDA opens every GPU; a context on its own
                holdings[p.pid] = model.DeviceHolding(p.pid, frozenset({0, 1}), ctl=True, uvm=True)
                listed[p.gpu].append(model.NvmlProcess(p.pid, GIB, "compute"))
                used[p.gpu] += GIB
            elif p.role in ("fork", "spawn", "flood", "notebook"):
                holdings[p.pid] = model.DeviceHolding(p.pid, frozenset({p.gpu}), ctl=True, uvm=True)
            owner = self.procs.get(p.owner) if p.owner is not None else None
            if owner is not None and self.kcmp:
                cut = p.role == "flood"  # kcmp's read cut short by the fd budget
                shared = None if cut else p.role == "fork"
                sharing.append(model.FileSharing(p.pid, owner.pid, shared, cut))
        for pid, (gpu, listed_dead) in self.dead_owners.items():
            if self._pinned(pid):
                used[gpu] += GIB
                if listed_dead:
                    listed[gpu].append(model.NvmlProcess(pid, GIB, "compute"))
        leaders = {v for p in self.procs.values() if p.pid in holdings for v in (p.sid,)}
        gpus = tuple(
            model.GpuInfo(
                index=i,
                uuid=GPUS[i],
                minor=i,
                mig_enabled=False,
                memory=model.GpuMemory(
                    80 * GIB, 80 * GIB - used[i] - model.MIB, model.MIB, used[i]
                ),
                processes=tuple(listed[i]),
            )
            for i in (0, 1)
        )
        processes = {
            p.pid: model.ProcessInfo(p.pid, 10 * p.pid, "S", p.ppid, p.sid, p.sid, uid=1000,
                               user="bob", comm="python3", cmdline=("python3", p.role),
                               cgroup=model.CgroupInfo("/user.slice/session-3.scope"))
            for p in self.procs.values()
        }  # fmt: skip
        return model.Snapshot(
            monotonic=self.mono,
            wall_time=1_700_000_000.0 + self.mono,
            boot_id="boot-1",
            nvml=model.NvmlReading(available=True, gpus=gpus),
            processes=processes,
            holders=model.HolderScan("full", holdings),
            absent_pids=frozenset(v for v in leaders if v not in self.procs),
            file_sharing=tuple(sharing),
        )

    def _healthy(self, p: _Proc) -> bool:
        owner_alive = p.owner is not None and p.owner in self.procs
        return (
            p.role in ("shell", "owner", "notebook")
            or owner_alive
            or (p.role in ("spawn", "flood") and p.recorded)
        )

    @rule(dt=st.sampled_from([0.5, 1.0, 5.0, 30.0]))
    def poll(self, dt: float) -> None:
        self.mono += dt
        snapshot = self._snapshot()
        assessment = assess(snapshot, self.astate, self.detection)
        self.astate = assessment.state
        result = plan(
            list(assessment.findings), snapshot, self.pstate, self.policy, now=self.mono,
            wall=snapshot.wall_time,
        )  # fmt: skip
        self.pstate = result.state
        for intent in result.intents:
            if not isinstance(intent, SignalIntent):
                continue
            target = self.procs[intent.identity.pid]
            assert not self._healthy(target), (target, assessment.findings)
            self.pstate = record_signal(self.pstate, intent, "delivered", now=self.mono).state
            self._die(target.pid, False)
        for p in self.procs.values():  # kcmp answered while the owner lived
            if self.kcmp and p.owner is not None and p.owner in self.procs:
                p.recorded = True


TestInheritance = InheritanceMachine.TestCase
