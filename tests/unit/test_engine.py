"""The engine's cycle with fake edges: no processes, no sleeping, no commands.

Each test builds an :class:`Engine` over a scripted reader (snapshots from HostBuilder), a
recording actuator, a hand-moved clock and a list sink, and pins one behaviour of the one poll
cycle that ``run``, ``run --once`` and ``simulate`` share.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import pytest

from gpuwatchd.act.commands import CommandResult
from gpuwatchd.act.reset_target import ResetTarget
from gpuwatchd.act.signals import SignalResult
from gpuwatchd.core.model import (
    MIB,
    FindingKind,
    GpuInfo,
    KernelXid,
    NvmlReading,
    ProcessIdentity,
    Snapshot,
    Spare,
    XidEvent,
)
from gpuwatchd.core.vocabulary import EventName, SignalOutcome
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.health.judge import assess_health, note_reset
from gpuwatchd.decide.health.state import HealthState
from gpuwatchd.decide.mig.recovery import InstanceRecovery
from gpuwatchd.decide.plan.decisions import set_paused
from gpuwatchd.decide.plan.state import PlanState, ResetInFlight
from gpuwatchd.decide.policy import Policy
from gpuwatchd.engine.cycle import Engine, EngineState
from gpuwatchd.engine.edges import MAX_KEPT_RUNS, MAX_KEPT_XIDS, Pause, TakenXids
from gpuwatchd.events.catalogue import CATALOGUE, render
from gpuwatchd.events.words import short
from tests.support.enginerig import (
    GPU0,
    LEAK,
    W0,
    Actuator,
    Clock,
    Reader,
    Rig,
    Sink,
    T,
    ghost_host,
    make_policy,
    orphan_host,
    rig,
)
from tests.support.healthcases import GPU0 as HEALTH_GPU
from tests.support.healthcases import GPU1 as HEALTH_GPU1
from tests.support.healthcases import gpu, health, snap
from tests.support.snapshots import HostBuilder, cg_session

MIG_UUID = "MIG-12345678-1234-1234-1234-123456789abc"
HOUR = 3600.0


def reset_commands(r: Rig) -> list[tuple[str, ...]]:
    return [argv for argv, env in r.actuator.commands if "--gpu-reset" in argv]


# --- dry-run ------------------------------------------------------------------------------------


def test_dry_run_runs_no_hook_signal_or_reset_command_and_says_what_it_would_do() -> None:
    pol = make_policy("reset: {confirm_for: 0s}", dry_run=True)

    def host(t: float) -> HostBuilder:
        # GPU 0: a leaked context's memory and nothing holding it (ghost memory → reset).
        # GPU 1: a dead trainer's worker in D state (stuck → on_failure hooks), and one that
        # is not stuck (orphaned → signals).
        b = ghost_host(t).gpu(1, allocated=LEAK).nvml(1, 300, used=LEAK)
        b.proc(301, ppid=1, pgid=300, sid=300, holds={1}, uvm=True, state="D")
        return b.proc(302, ppid=1, pgid=300, sid=300, holds={1}, uvm=True)

    r = rig(pol, host)
    for t in (0.0, 31.0, 42.0, 100.0):
        r.poll_at(t)
    assert r.actuator.commands == [], "dry-run must never run a command or hook"
    assert r.actuator.signals, "dry-run goes through the signal path (signal 0)"
    assert all(dry for _, _, dry in r.actuator.signals)
    hooks = r.sink.named(EventName.HOOK_RUN)
    assert hooks
    assert all(h["outcome"] == "dry_run" and h["dry_run"] is True for h in hooks)
    assert [o["result"] for o in r.sink.named(EventName.RESET_OUTCOME)] == ["dry_run"]
    assert {s["outcome"] for s in r.sink.named(EventName.ACTION_SIGNAL)} == {"dry_run"}
    assert r.reader.stopped == 0, "a dry-run reset does not stop the NVML worker"
    # What an admin reviews with `journalctl -p warning`: each would-be action, once.
    warned = {n for n, level, _ in r.sink.events if level == "warning"}
    assert {EventName.ACTION_SIGNAL, EventName.HOOK_RUN, EventName.RESET_OUTCOME} <= warned
    quiet = {EventName.ESCALATION_STEP_DUE, EventName.RESET_DUE, EventName.RESET_DRY_RUN}
    assert not quiet & warned


def test_enforcing_runs_the_hooks_and_the_reset_through_the_slow_runner() -> None:
    pol = make_policy("reset: {confirm_for: 0s}")

    def host(t: float) -> HostBuilder:
        b = ghost_host(t).gpu(1, allocated=LEAK).nvml(1, 300, used=LEAK)
        return b.proc(301, ppid=1, pgid=300, sid=300, holds={1}, uvm=True, state="D")

    r = rig(pol, host)
    r.poll_at(0.0)
    r.poll_at(61.0)
    hook_runs = [(argv, env) for argv, env in r.actuator.commands if argv[0] == "drain-node"]
    assert len(hook_runs) == 1
    assert hook_runs[0][1] is not None
    assert hook_runs[0][1]["GPUWATCHD_EVENT"] == "on_failure"
    assert len(reset_commands(r)) == 1
    assert r.slow_calls == ["slow", "slow"], "each reset and each hook run is slow work"
    (hook,) = r.sink.named(EventName.HOOK_RUN)
    assert (hook["returncode"], hook["dry_run"]) == (0, False)


# --- ladders ------------------------------------------------------------------------------------


def test_a_ladder_continues_across_a_restart() -> None:
    pol = make_policy()
    first = rig(pol, orphan_host)
    first.poll_at(0.0)
    assert first.actuator.signals == [(201, "SIGTERM", False)]
    # The daemon stops; its state goes through the state file's JSON and back.
    saved = first.engine.state
    restored = EngineState(
        assess=AssessState.from_json(saved.assess.to_json()),
        plan=PlanState.from_json(saved.plan.to_json()),
    )
    second = rig(pol, orphan_host, state=restored)
    second.poll_at(10.0)
    assert second.actuator.signals == [], "the SIGTERM's 30s wait is still running"
    second.poll_at(31.0)
    assert second.actuator.signals == [(201, "SIGKILL", False)], "step 2, not step 1 again"


def test_a_spare_keeps_the_time_it_had_left_when_the_wall_clock_steps_before_the_snapshot() -> None:
    """The daemon reads the spares, then collects the snapshot: a wall clock stepped forward
    in between must not end a spare early (issue 34). Its end moves with the snapshot's wall
    time, by the time it had left when read."""
    r = rig(make_policy(), orphan_host)
    ticks = orphan_host(0.0).build().processes[201].start_ticks
    read_at = W0 - 7200.0  # read two hours of wall time before the snapshot's
    spare = Spare(target="pid:201", until=read_at + 60.0, reason="debug", pid=201,
                  start_ticks=ticks)  # fmt: skip
    r.engine.set_spares((spare,), read_at=read_at)
    report = r.poll_at(0.0)
    assert r.actuator.signals == []
    assert [s.until for s in report.snapshot.spares] == [W0 + 60.0]


@dataclass
class SteppedReader(Reader):
    """GPU 0 reports Xid 48, read after the wall clock stepped back an hour: the snapshot and
    the Xid carry the stepped wall time."""

    def collect(self) -> Snapshot:
        stepped = snap(t=self.clock.now).wall_time - HOUR
        reading = health(xids=(XidEvent(48, stepped),))
        return replace(snap(gpu(0, HEALTH_GPU, reading), t=self.clock.now), wall_time=stepped)


def test_an_xid_after_a_reset_asks_for_one_again_when_the_wall_clock_stepped_back_since() -> None:
    """Our reset of GPU 0 at wall R, the last poll at R + 10, then the clock steps back an
    hour: Xid 48, 20 s after the reset, is after it (the health history moves with the step,
    as the plan's wall times do)."""
    reset_at = snap(t=1000.0).wall_time
    health_state = note_reset(HealthState(), HEALTH_GPU, reset_at)
    state = EngineState(
        assess=AssessState(boot_id="boot-1", health=health_state),
        plan=PlanState(boot_id="boot-1", last_wall=reset_at + 10.0),
    )
    clock, sink = Clock(now=1020.0), Sink()
    engine = Engine(make_policy(dry_run=True), reader=SteppedReader(clock, ghost_host),
                    actuator=Actuator(), clock=clock, sink=sink, state=state)  # fmt: skip
    report = engine.poll()
    assert [f.kind for f in report.assessment.findings] == [FindingKind.RESET_REQUIRED]
    assert engine.state.assess.health.gpus[HEALTH_GPU].last_reset == reset_at - HOUR + 10.0
    (stepped,) = sink.named(EventName.CLOCK_STEPPED_BACK)
    assert stepped["seconds"] == HOUR - 10.0


@dataclass
class StepClock(Clock):
    """A clock whose wall time can be stepped back ``step`` seconds."""

    step: float = 0.0

    def wall(self) -> float:
        return super().wall() - self.step


@dataclass
class XidThenHealthyReader(Reader):
    """GPU 0 reports Xid 48 five seconds before the first poll, then nothing; healthy after."""

    polls: int = 0

    def collect(self) -> Snapshot:
        self.polls += 1
        wall = self.clock.wall()
        xids = (XidEvent(48, wall - 5.0),) if self.polls == 1 else ()
        reading = snap(gpu(0, HEALTH_GPU, health(xids=xids)), t=self.clock.now)
        return replace(reading, wall_time=wall)

    def read_gpus(self) -> tuple[GpuInfo, ...]:
        return (gpu(0, HEALTH_GPU, health()),)


@dataclass
class SteppingActuator(Actuator):
    """The wall clock steps back an hour while the reset command runs."""

    clock: StepClock = field(default_factory=StepClock)

    def run_command(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        if "--gpu-reset" in argv:
            self.clock.step = HOUR
        return super().run_command(argv, timeout=timeout, env=env)


def test_a_wall_clock_step_during_a_reset_moves_the_xids_it_dealt_with_back_too() -> None:
    """Xid 48 asks for a reset; the wall clock steps back an hour while it runs, so its time
    is an hour earlier than the Xid's. The health history moves back with that step as the
    plan's times do: the Xid stays before the reset (dealt with), no second reset."""
    clock, sink = StepClock(), Sink()
    reader = XidThenHealthyReader(clock, ghost_host)
    engine = Engine(make_policy("reset: {cooldown: 0s}"), reader=reader,
                    actuator=SteppingActuator(clock=clock), clock=clock, sink=sink)  # fmt: skip
    engine.poll()
    assert [o["result"] for o in sink.named(EventName.RESET_OUTCOME)] == ["success"]
    assert [e["seconds"] for e in sink.named(EventName.CLOCK_STEPPED_BACK)] == [HOUR]
    clock.now = 20.0
    assert engine.poll().assessment.findings == ()
    assert [o["result"] for o in sink.named(EventName.RESET_OUTCOME)] == ["success"]


def test_a_denied_signal_ends_the_ladder_and_is_never_retried() -> None:
    pol = make_policy()
    r = rig(pol, orphan_host, actuator=Actuator(outcome=SignalOutcome.DENIED))
    r.poll_at(0.0)
    assert r.actuator.signals == [(201, "SIGTERM", False)]
    (ended,) = r.sink.named(EventName.ESCALATION_ENDED)
    assert ended["outcome"] == "denied"
    for t in (31.0, 60.0, 120.0):
        r.poll_at(t)
    assert r.actuator.signals == [(201, "SIGTERM", False)]


def test_an_exit_reported_by_the_actuator_resolves_the_ladder() -> None:
    pol = make_policy()
    r = rig(pol, orphan_host)
    r.poll_at(0.0)
    (pid, _, _) = r.actuator.signals[0]
    snapshot = orphan_host(0.0).build()
    identity = ProcessIdentity(pid, snapshot.processes[pid].start_ticks or 0)
    r.clock.now = 0.5
    r.engine.note_exits([identity])
    assert r.sink.named(EventName.TARGET_EXITED)
    assert r.sink.named(EventName.ESCALATION_RESOLVED)
    assert r.engine.state.plan.ladders == {}


def test_wake_at_is_the_next_step_or_the_interval() -> None:
    pol = make_policy()
    r = rig(pol, orphan_host)
    r.poll_at(0.0)
    assert r.engine.wake_at() == pol.interval  # the SIGTERM's wait (30s) is further off
    r.clock.now = 28.0
    assert r.engine.wake_at() == 30.0


# --- resets -------------------------------------------------------------------------------------


def test_a_refused_reset_runs_its_hooks_once_per_incident_and_again_after_a_reload() -> None:
    """The final scan refuses (a holder the poll did not see, e.g. one that opens nvidiactl
    now and then): the drain and before hooks ran once. The same incident is not tried again
    every cooldown; a reload (or ``resume --clear-latches``) lets it be tried again."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 10m}")
    r = rig(pol, ghost_host)
    r.reader.blockers = [777]  # the final scan finds a holder: refused, nothing run
    r.poll_at(0.0)
    assert [o["result"] for o in r.sink.named(EventName.RESET_OUTCOME)] == ["refused"]
    assert reset_commands(r) == []
    assert r.engine.state.plan.reset_in_flight is None
    r.reader.blockers = []
    r.poll_at(300.0)  # within the cooldown
    r.poll_at(601.0)  # after it: still the same incident
    r.poll_at(3601.0)
    assert r.reader.final_scans == 1
    whys = [e["why"] for e in r.sink.named(EventName.RESET_REFUSED)]
    assert any("a reset for this incident was refused" in str(why) for why in whys)
    r.engine.reload(r.engine.policy, hostname=r.engine.hostname)
    assert r.sink.named(EventName.RESET_REFUSAL_CLEARED)
    r.poll_at(3602.0)
    assert r.reader.final_scans == 2
    assert len(reset_commands(r)) == 1
    assert [o["result"] for o in r.sink.named(EventName.RESET_OUTCOME)] == ["refused", "success"]
    assert r.sink.named(EventName.RESET_SUCCEEDED)


def test_a_failed_reset_runs_the_on_failure_hooks_it_asks_for() -> None:
    pol = make_policy("reset: {confirm_for: 0s}")
    r = rig(pol, ghost_host, actuator=Actuator(returncode=255))
    r.poll_at(0.0)
    assert [o["result"] for o in r.sink.named(EventName.RESET_OUTCOME)] == ["failed"]
    assert r.sink.named(EventName.RESET_FAILED)
    hooks = r.sink.named(EventName.HOOK_RUN)
    assert [h["hook"] for h in hooks] == ["on_failure"]
    assert hooks[0]["returncode"] == 255  # the fake answers every command alike


def _interrupted_during_the_reset(pol: Policy, **more: object) -> EngineState:
    """The state a daemon killed while the reset of ``GPU0`` ran leaves: the in-flight plan
    state and the progress record the procedure wrote just before the reset command (with
    ``more`` fields)."""
    first = rig(pol, ghost_host)

    def crash(work: Callable[[], T]) -> T:
        raise KeyboardInterrupt  # the daemon is killed while the reset runs

    first.engine.slow = crash
    with contextlib.suppress(KeyboardInterrupt):
        first.poll_at(0.0)
    assert first.engine.state.plan.reset_in_flight is not None
    record: dict[str, object] = {
        "uuid": GPU0,
        "pci_bus_id": "00000000:10:00.0",
        "minor": 0,
        "persistence_was_on": False,
        "step": "reset",
        "reset_started": True,
        **more,
    }
    return EngineState(
        assess=first.engine.state.assess, plan=first.engine.state.plan, reset_in_progress=record
    )


def test_an_interrupted_reset_is_booked_so_later_resets_are_not_refused_as_in_flight() -> None:
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m}")
    state = _interrupted_during_the_reset(pol)
    second = rig(pol, lambda t: ghost_host(t, allocated=2 * MIB), state=state)
    second.clock.now = 5.0
    second.engine.resume_interrupted_reset()
    assert reset_commands(second) == [], "the reset command is never run again"
    assert second.engine.state.reset_in_progress is None
    assert second.engine.state.plan.reset_in_flight is None
    assert second.sink.named(EventName.RESET_SUCCEEDED)


def test_a_reset_undone_after_a_restart_in_its_drain_is_held_saying_so() -> None:
    """A restart while the reset's drain hook ran undoes the reset and holds it for the
    incident (no crash loop), with a reason that says the restart, not the procedure, held it."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m}")
    state = _interrupted_during_the_reset(pol, step="drain", reset_started=False)
    second = rig(pol, ghost_host, state=state)
    second.clock.now = 5.0
    second.engine.resume_interrupted_reset()
    assert reset_commands(second) == []
    why = "the daemon restarted during the reset, before it took effect"
    assert [e["why"] for e in second.sink.named(EventName.RESET_REFUSED)] == [why]
    assert second.engine.state.plan.reset_refusals[GPU0].reason == why


@dataclass
class _KilledInTheAfterHook(Actuator):
    """The daemon is killed (SIGKILL: nothing more runs) while a reset's after hook runs."""

    def run_command(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        if (env or {}).get("GPUWATCHD_EVENT") == "reset_after":
            raise KeyboardInterrupt
        return super().run_command(argv, timeout=timeout, env=env)


def test_a_crash_while_another_boots_reset_is_undone_leaves_it_another_boots() -> None:
    """After a reboot the start undoes the last boot's reset outside the GPU and books none of
    it. Killed in its after hook, the next start still takes the record for another boot's: no
    outcome booked (a success would have dealt with this boot's Xids of the GPU)."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m, after: [{command: [undrain]}]}")
    state = _interrupted_during_the_reset(pol, step="after_hooks", result="success", rebooted=True)
    second = rig(pol, ghost_host, state=state, actuator=_KilledInTheAfterHook())
    with contextlib.suppress(KeyboardInterrupt):
        second.engine.resume_interrupted_reset()
    record = second.engine.state.reset_in_progress
    assert record is not None
    assert record["step"] == "after_hooks"
    third = rig(pol, ghost_host, state=second.engine.state)
    third.engine.resume_interrupted_reset()
    assert [c for c, _env in third.actuator.commands] == [("undrain",)]  # run again
    assert third.sink.named(EventName.RESET_OUTCOME) == []
    cleared = third.sink.named(EventName.RESET_IN_FLIGHT_CLEARED)
    assert [c["why"] for c in cleared] == ["the node rebooted since it was decided on"]


def test_the_journal_of_a_resumed_reset_says_it_ended_once_it_has() -> None:
    """``EventName.RESET_RESUMED`` was said as the resume began, with the step it was
    interrupted at: its sentence said the reset had ended ('ended: ?') before anything ran, with
    two fields the catalogue does not declare. Now it says the resume begins; the one at the end
    says how."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m}")
    second = rig(pol, ghost_host, state=_interrupted_during_the_reset(pol))
    second.engine.resume_interrupted_reset()
    resumed = second.sink.named(EventName.RESET_RESUMED)
    said = [render(EventName.RESET_RESUMED, fields) for fields in resumed]
    assert said == [
        f"Resuming the interrupted reset of {GPU0} from step reset.",
        f"The interrupted reset of {GPU0} ended: success: interrupted at step reset after the"
        " reset command started; health check passed; memory back to baseline.",
    ]
    declared = set(CATALOGUE[EventName.RESET_RESUMED].fields)
    assert all(set(fields) <= declared for fields in resumed)


@pytest.mark.parametrize("step", ["reset", "no such step"])
def test_a_huge_record_is_shown_cut_in_every_event_of_its_resume(step: str) -> None:
    """A record is read from the state file (hostile, up to its size): ``EventName.RESET_RESUME``
    shows its GPU, step and commands, each cut as events cut values, and no event of the resume
    carries it whole (not the reason an unreadable one is failed with either)."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m}")
    extra: dict[str, object] = {f"key{n}": "x" * 100 for n in range(10_000)}
    state = _interrupted_during_the_reset(pol, commands={"reset": [["y" * 100_000]]}, **extra)
    assert isinstance(state.reset_in_progress, dict)
    state.reset_in_progress["step"] = step
    second = rig(pol, ghost_host, state=state)
    second.engine.resume_interrupted_reset()
    (resume,) = second.sink.named(EventName.RESET_RESUME)
    shown = resume["record"]
    assert isinstance(shown, dict)
    assert (shown["uuid"], shown["step"]) == (GPU0, step)
    assert str(shown["commands"]).startswith("{'reset': [['yyy")
    assert max(len(repr(fields)) for _, _, fields in second.sink.events) < 5000


@pytest.mark.parametrize(
    "uuid", ["y" * 100_000, "GPU-1\nforged", GPU0[:13]], ids=["huge", "a-newline", "a-prefix"]
)
def test_a_record_whose_uuid_is_no_gpus_is_unreadable_and_never_shown_whole(uuid: str) -> None:
    """A record's ``uuid`` is the state file's (any string, as large as the file) and was
    shown whole in ``EventName.RESET_RESUMED``, each step's events and the reasons: one not in the
    format NVML gives a GPU's UUID is an unreadable record, shown cut, and nothing is run."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m, after: [{command: [undrain]}]}")
    state = _interrupted_during_the_reset(pol, uuid=uuid)
    second = rig(pol, ghost_host, state=state)
    second.engine.resume_interrupted_reset()
    (failed,) = second.sink.named(EventName.RESET_RESUME_FAILED)
    assert str(failed["reason"]).startswith("unreadable reset record {")
    (resumed,) = second.sink.named(EventName.RESET_RESUMED)
    assert (resumed["result"], resumed["gpu"]) == ("failed", short(uuid))
    assert second.actuator.commands == []
    assert max(len(repr(fields)) for _, _, fields in second.sink.events) < 5000


def test_a_stop_before_the_reset_starts_leaves_no_reset_in_flight() -> None:
    """SIGTERM while the poll that hands a reset to act collects: the reset never starts and
    books nothing, so the state the stop saves holds no in-flight marker (nothing would ever
    clear it: every later reset would be refused as in flight)."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m}")
    r = rig(pol, ghost_host)
    r.engine.stopping = lambda: True
    r.poll_at(0.0)
    assert r.actuator.commands == []
    assert r.engine.state.reset_in_progress is None
    assert r.engine.state.plan.reset_in_flight is None
    (cleared,) = r.sink.named(EventName.RESET_IN_FLIGHT_CLEARED)
    assert cleared["gpu"] == GPU0
    assert cleared["why"] == "the daemon stopped before it started"


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_stop_during_a_poll_still_sends_its_signals_so_a_restart_never_skips_a_step(
    dry_run: bool,
) -> None:
    """The state saved before the poll acts counts its SIGTERM as sent: a stop there that
    left it would have the restarted ladder go on to SIGKILL a target never asked to end."""
    r = rig(make_policy(dry_run=dry_run), orphan_host)
    r.engine.stopping = lambda: True  # SIGTERM to the daemon as the poll starts to carry out
    r.poll_at(0.0)
    assert r.actuator.signals == [(201, "SIGTERM", dry_run)]
    assert [s["signal"] for s in r.sink.named(EventName.ACTION_SIGNAL)] == ["SIGTERM"]


def test_a_reset_in_flight_with_no_record_is_cleared_at_start_and_resets_go_on() -> None:
    """A crash before the reset's first record (or a state an older version saved after its
    last, before the booking) leaves the marker alone: the start clears it, books nothing,
    and a later reset runs."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m}")
    first = rig(pol, ghost_host)

    def crash(work: Callable[[], T]) -> T:
        raise KeyboardInterrupt  # killed before the procedure's first step was recorded

    first.engine.slow = crash
    with contextlib.suppress(KeyboardInterrupt):
        first.poll_at(0.0)
    state = first.engine.state
    assert state.plan.reset_in_flight is not None
    assert state.reset_in_progress is None
    second = rig(pol, ghost_host, state=state)
    second.clock.now = 10.0
    second.engine.resume_interrupted_reset()
    assert second.engine.state.plan.reset_in_flight is None
    assert [e["gpu"] for e in second.sink.named(EventName.RESET_IN_FLIGHT_CLEARED)] == [GPU0]
    assert not second.sink.named(EventName.RESET_OUTCOME), "nothing is booked"
    second.poll_at(100.0)
    assert len(reset_commands(second)) == 1


class _Killed(Exception):
    """SIGKILL of the daemon: nothing after it runs."""


@dataclass
class _KilledAtTheBooking(Sink):
    """The daemon is killed as a reset's outcome is booked (nothing of it saved yet)."""

    def emit(self, name: str, level: str, fields: Mapping[str, object]) -> None:
        super().emit(name, level, fields)
        if name == EventName.RESET_OUTCOME:
            raise _Killed


@pytest.mark.parametrize("resumed", [False, True], ids=["reset", "resume"])
def test_a_reset_killed_before_its_outcome_is_saved_is_booked_at_the_next_start(
    resumed: bool,
) -> None:
    """Killed after a reset's last step, before the state booking its outcome was saved, the
    start found no record: it booked nothing, so the cooldown did not count the reset and the
    next poll reset the GPU again. The last step's record stays until the booking is saved."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1h}")
    state = _interrupted_during_the_reset(pol) if resumed else EngineState()
    first = rig(pol, ghost_host, state=state)
    saved: list[EngineState] = []

    def checkpoint() -> bool:
        now = first.engine.state
        record = json.loads(json.dumps(now.reset_in_progress))
        plan = PlanState.from_json(now.plan.to_json())
        saved.append(EngineState(AssessState.from_json(now.assess.to_json()), plan, record))
        return True

    first.engine.checkpoint, first.engine.sink = checkpoint, _KilledAtTheBooking()
    with contextlib.suppress(_Killed):
        first.engine.resume_interrupted_reset() if resumed else first.poll_at(0.0)
    assert len(reset_commands(first)) == 1 - resumed
    second = rig(pol, ghost_host, state=saved[-1])
    second.clock.now = 10.0
    second.engine.resume_interrupted_reset()
    assert [o["result"] for o in second.sink.named(EventName.RESET_OUTCOME)] == ["success"]
    second.poll_at(60.0)
    assert reset_commands(second) == [], "the cooldown counts the reset"


@dataclass
class _BugInTheReset(Actuator):
    """The reset procedure raises (a bug) as it runs the reset command."""

    def run_command(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        if "--gpu-reset" in argv:
            raise RuntimeError("a bug")
        return super().run_command(argv, timeout=timeout, env=env)


def test_a_reset_whose_procedure_crashed_is_over_once_booked() -> None:
    """A procedure that raises is booked as a failed reset; the save that booked it kept its
    last progress record: the state said the reset under way for good (``status``, ``run
    --once`` waited on it) and the next start, however much later, resumed it (a health check,
    the after hooks with a result other than the one booked). The booking save drops it."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m, after: [{command: [undrain]}]}")
    first = rig(pol, ghost_host, actuator=_BugInTheReset())
    first.poll_at(0.0)
    assert [e["gpu"] for e in first.sink.named(EventName.RESET_CRASHED)] == [GPU0]
    assert [o["result"] for o in first.sink.named(EventName.RESET_OUTCOME)] == ["failed"]
    assert first.engine.state.reset_in_progress is None
    second = rig(pol, ghost_host, state=first.engine.state)
    second.clock.now = 3600.0
    second.engine.resume_interrupted_reset()
    assert second.actuator.commands == []
    assert not second.sink.named(EventName.RESET_RESUMED)


class _BugInTheAfterHook(Actuator):
    """The reset procedure raises (a bug) as it runs the ``after`` hook, ``undrain``."""

    def run_command(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        if argv[0] == "undrain":
            raise RuntimeError("a bug")
        return super().run_command(argv, timeout=timeout, env=env)


def test_a_resume_that_crashes_is_booked_failed_and_the_start_goes_on() -> None:
    """A bug the saved record leads the resume into must not end every start (the daemon in a
    restart loop, the node unwatched): it is said (``EventName.RESET_CRASHED``), booked as a
    failed reset, and the record dropped, so the next start has nothing to resume."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m, after: [{command: [undrain]}]}")
    second = rig(pol, ghost_host, state=_interrupted_during_the_reset(pol))
    second.actuator = second.engine.actuator = _BugInTheAfterHook()
    second.engine.resume_interrupted_reset()
    assert [e["gpu"] for e in second.sink.named(EventName.RESET_CRASHED)] == [GPU0]
    ended = [e for e in second.sink.named(EventName.RESET_RESUMED) if "result" in e]
    assert [e["result"] for e in ended] == ["failed"]
    assert second.engine.state.reset_in_progress is None
    assert second.engine.state.plan.reset_in_flight is None
    assert [o["result"] for o in second.sink.named(EventName.RESET_OUTCOME)] == ["failed"]


def test_a_hostile_reset_in_flight_is_cleared_at_start_and_shown_cut() -> None:
    """The marker is read from the state file (hostile, up to its size): its GPU and finding
    key are shown in ``EventName.RESET_IN_FLIGHT_CLEARED`` cut as event values are, never whole."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m}")
    first = rig(pol, ghost_host)
    flight = ResetInFlight("G\n" + "x" * 100_000, "k" * 100_000, False, 0.0, 0.0)
    state = replace(first.engine.state, plan=replace(PlanState(), reset_in_flight=flight))
    second = rig(pol, ghost_host, state=state)
    second.engine.resume_interrupted_reset()
    assert second.engine.state.plan.reset_in_flight is None
    (cleared,) = second.sink.named(EventName.RESET_IN_FLIGHT_CLEARED)
    assert (cleared["gpu"], cleared["finding"]) == (short(flight.gpu), short(flight.finding_key))
    assert len(str(cleared["gpu"])) < 1000
    assert "\n" not in str(cleared["gpu"])


@pytest.mark.parametrize("paused", ["saved", "while the daemon was down"])
def test_a_reset_that_fails_during_a_pause_runs_no_on_failure_hook_and_says_so(
    paused: str,
) -> None:
    """A pause holds every ``on_failure`` hook (docs/escalation.md): a reset the last run left
    in progress, whose outcome (failed) is booked at a restart while paused, pages nobody
    (``action.refused`` says so); its ``on_action`` notification, of a reset that ran, is sent.
    So with a pause set while the daemon was down, read before the first poll."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m}\non_action:\n  - [notify]")
    state = _interrupted_during_the_reset(pol)
    pause = None
    if paused == "saved":
        state.plan = set_paused(state.plan, True, reason="driver upgrade")
    else:
        pause = Pause("driver upgrade")
    second = rig(pol, ghost_host, state=state, actuator=Actuator(returncode=255))
    second.engine.resume_interrupted_reset(pause)
    assert [o["result"] for o in second.sink.named(EventName.RESET_OUTCOME)] == ["failed"]
    hooks = [argv for argv, _ in second.actuator.commands if argv[0] != "nvidia-smi"]
    assert hooks == [("notify",)]
    assert [e["why"] for e in second.sink.named(EventName.ACTION_REFUSED)] == [
        f"paused: driver upgrade; on_failure not run: reset of {GPU0} failed"
    ]


def test_a_resumed_mig_gpu_reset_that_failed_leaves_each_instance_of_its_layout_unfinished() -> (
    None
):
    """The record's MIG layout is booked with the resumed outcome, as a reset that was not
    interrupted books it: a failure leaves each GPU instance dirty until it is seen back."""
    pol = make_policy("reset: {confirm_for: 0s, cooldown: 1m}")
    instance = InstanceRecovery(GPU0, "00000000:10:00.0", 0, 1, 0, MIG_UUID, 19, 6, 1)
    second = rig(
        pol, ghost_host, state=_interrupted_during_the_reset(pol, mig_layout=[instance.record()])
    )
    second.engine.resume_interrupted_reset()
    assert [o["result"] for o in second.sink.named(EventName.RESET_OUTCOME)] == ["failed"]
    assert list(second.engine.state.plan.mig_unfinished) == [MIG_UUID]


def test_each_step_is_checkpointed_before_it_is_carried_out() -> None:
    """A daemon killed right after sending a signal, before its end-of-poll save, must neither
    repeat the step on restart nor forget it in the kill cap."""
    pol = make_policy()
    saved: list[EngineState] = []

    class Killed(Exception):
        pass

    class DiesAfterSignal(Actuator):
        def signal(self, identity: ProcessIdentity, signal: str, *, dry_run: bool) -> SignalResult:
            super().signal(identity, signal, dry_run=dry_run)
            raise Killed  # SIGKILL of the daemon right after the signal left

    first = rig(pol, orphan_host, actuator=DiesAfterSignal())

    def checkpoint() -> bool:
        state = first.engine.state
        saved.append(
            EngineState(
                assess=AssessState.from_json(state.assess.to_json()),
                plan=PlanState.from_json(state.plan.to_json()),
            )
        )
        return True

    first.engine.checkpoint = checkpoint
    with contextlib.suppress(Killed):
        first.poll_at(0.0)
    assert first.actuator.signals == [(201, "SIGTERM", False)]
    assert saved, "nothing was persisted before the signal"
    on_disk = saved[-1]
    assert len(on_disk.plan.signal_history) == 1, "the kill cap counts the target"
    second = rig(pol, orphan_host, state=on_disk)
    second.poll_at(5.0)
    assert second.actuator.signals == [], "SIGTERM is not sent a second time"
    second.poll_at(31.0)
    assert second.actuator.signals == [(201, "SIGKILL", False)]


def test_no_signal_is_sent_while_the_state_that_records_it_cannot_be_saved() -> None:
    """state_dir full: the step is withheld (an event says which and why), the kill cap counts
    nothing, the ladder holds; once the state can be saved the step is taken, exactly once."""
    pol = make_policy()
    r = rig(pol, orphan_host)
    disk_full = [True]
    saved: list[int] = []

    def checkpoint() -> bool:
        if disk_full[0]:
            return False
        saved.append(len(r.engine.state.plan.signal_history))
        return True

    r.engine.checkpoint = checkpoint
    r.poll_at(0.0)
    r.poll_at(5.0)
    assert r.actuator.signals == []
    withheld = r.sink.named(EventName.ACTION_WITHHELD)
    assert len(withheld) == 2
    assert withheld[0]["steps"] == ["SIGTERM to pid 201"]
    assert "cannot be saved" in str(withheld[0]["why"])
    assert r.engine.state.plan.signal_history == ()
    assert not r.engine.state.plan.paused, "the hold is for one poll, not a pause"
    disk_full[0] = False
    r.poll_at(10.0)
    assert r.actuator.signals == [(201, "SIGTERM", False)]
    assert saved[0] == 1, "saved with the signal counted, before it was sent"
    r.poll_at(12.0)
    assert r.actuator.signals == [(201, "SIGTERM", False)], "not repeated"


def test_a_reset_stops_before_a_step_it_cannot_record() -> None:
    """The reset procedure records each step before it runs; when that fails, the reset
    command is never run."""
    pol = make_policy("reset: {confirm_for: 0s}")
    r = rig(pol, ghost_host)
    calls = [0]

    def checkpoint() -> bool:
        calls[0] += 1
        return calls[0] == 1  # the intent is saved; the procedure's first step is not

    r.engine.checkpoint = checkpoint
    for t in (0.0, 5.0, 10.0):
        r.poll_at(t)
    assert reset_commands(r) == []
    steps = r.sink.named(EventName.RESET_STEP)
    assert any(e.get("status") == "record_failed" for e in steps), steps


def test_a_gpu_that_is_lost_is_reported_once_as_needing_a_reboot_and_runs_on_failure() -> None:
    pol = make_policy()
    lost = [False]

    def host(t: float) -> HostBuilder:
        return HostBuilder(monotonic=t, wall_time=W0 + t).gpu(0, allocated=LEAK, lost=lost[0])

    r = rig(pol, host)
    r.poll_at(0.0)
    assert r.sink.named(EventName.GPU_NEEDS_REBOOT) == []
    lost[0] = True
    r.poll_at(5.0)
    r.poll_at(10.0)
    (event,) = r.sink.named(EventName.GPU_NEEDS_REBOOT)
    assert event["gpu"] == GPU0
    assert (EventName.GPU_NEEDS_REBOOT, "critical") in {(n, lvl) for n, lvl, _ in r.sink.events}
    hooks = [argv for argv, env in r.actuator.commands if env and env.get("GPUWATCHD_EVENT")]
    assert hooks == [("drain-node", "reason=gpu")], "on_failure runs once per loss"
    lost[0] = False
    r.poll_at(15.0)
    lost[0] = True
    r.poll_at(20.0)
    assert len(r.sink.named(EventName.GPU_NEEDS_REBOOT)) == 2


def test_each_real_action_is_one_warning_line() -> None:
    """A signal used to be said twice at warning (step due, action), a reset three times."""
    pol = make_policy("reset: {confirm_for: 0s}")

    def host(t: float) -> HostBuilder:
        b = ghost_host(t).gpu(1, allocated=LEAK).nvml(1, 300, used=LEAK)
        return b.proc(301, ppid=1, pgid=300, sid=300, holds={1}, uvm=True)

    r = rig(pol, host)
    r.poll_at(0.0)
    warned = [
        n for n, level, _ in r.sink.events if level == "warning" and not n.startswith("finding.")
    ]
    assert sorted(warned) == [EventName.ACTION_SIGNAL, EventName.RESET_OUTCOME], warned


class _HealthResetHost:
    """GPU 0 asks for a reset (recovery action 1); job 4242 still holds it: the reset waits."""

    def __init__(self, t: float) -> None:
        self.t = t

    def build(self) -> Snapshot:
        builder = ghost_host(self.t, allocated=2 * MIB)
        snapshot = builder.proc(4242, holds={0}, uvm=True).nvml(0, 4242, used=900 * MIB).build()
        gpus = tuple(replace(g, health=health(recovery_action=1)) for g in snapshot.nvml.gpus)
        return replace(snapshot, nvml=replace(snapshot.nvml, gpus=gpus))


def test_a_stop_during_a_poll_still_runs_its_hooks_so_a_restart_never_skips_them() -> None:
    """The state saved before the poll acts books its hooks as run (a health reset's drain
    done, a stuck target's page sent): a stop there leaves the resets still to come, never
    a hook, or after the restart the reset would skip a drain that never ran."""
    pol = make_policy("reset: {drain: [[drain-gpu, '{uuid}']], confirm_for: 0s, cooldown: 0s}")
    first = rig(pol, _HealthResetHost)  # type: ignore[arg-type]
    first.engine.stopping = lambda: True  # SIGTERM as the poll starts to carry out
    first.poll_at(0.0)
    assert [a for a, _ in first.actuator.commands] == [("drain-gpu", GPU0)]
    assert first.engine.state.plan.health_drained == {GPU0: False}
    stuck = rig(make_policy(), lambda t: orphan_host(t, state="D"))
    stuck.engine.stopping = lambda: True
    for t in (0.0, 30.0, 60.0):  # confirmed: stuck at 30 s
        stuck.poll_at(t)
    assert len(stuck.sink.named(EventName.TARGET_STUCK)) == 1
    assert [a for a, _ in stuck.actuator.commands] == [("drain-node", "reason=gpu")]


@pytest.mark.parametrize(
    ("case", "protect", "spared", "stopped"),
    [
        ("a monitor", "", False, [4100]),
        ("protect.users names its user", "protect: {users: [alice]}", False, []),
        ("protect.commands names it", "protect: {commands: [gpustat]}", False, []),
        ("the last poll's spare covers it", "", True, []),
    ],
)
def test_the_reset_stops_no_monitor_a_spare_or_protect_covers(
    case: str, protect: str, spared: bool, stopped: list[int]
) -> None:
    """Engine.find_monitors hands the monitors' choice the last poll's spares and the policy's
    protect: the reset never signals what a kill ladder would be refused."""
    pol = make_policy(f"reset: {{monitors: [{{command: gpustat}}]}}\n{protect}")
    builder = HostBuilder().gpu(0)
    builder.proc(4100, holds={0}, comm="gpustat", user="alice", cmdline=("gpustat", "-i"))
    scan = builder.change(4100, cgroup=cg_session()).build()
    r = rig(pol, lambda t: ghost_host(t, allocated=2 * MIB))
    r.reader.final_scan = lambda minor: (scan.holders, scan.processes)  # type: ignore[method-assign]
    if spared:
        ticks = scan.processes[4100].start_ticks
        spare = Spare("pid:4100", W0 + 600.0, "alice debugs", pid=4100, start_ticks=ticks)
        r.engine.set_spares((spare,), read_at=W0)
    r.poll_at(0.0)
    target = ResetTarget(uuid=GPU0, pci_bus_id=None, minor=0, persistence_was_on=False)
    assert [m.identity.pid for m in r.engine.find_monitors(target)] == stopped, case


@dataclass
class TwoGpuReader(Reader):
    """GPUs 0 and 1, healthy; a reading of every GPU between polls takes GPU 1's Xid 48."""

    def collect(self) -> Snapshot:
        return snap(gpu(0, HEALTH_GPU, health()), gpu(1, HEALTH_GPU1, health()), t=self.clock.now)

    def read_gpus(self) -> tuple[GpuInfo, ...]:
        xid = XidEvent(48, self.clock.wall())
        return gpu(0, HEALTH_GPU, health()), gpu(1, HEALTH_GPU1, health(xids=(xid,)))


def test_xid_events_a_reading_of_one_gpu_took_are_the_next_polls() -> None:
    """The reset procedure reads its GPU again (its memory after the reset, its NVLink fabric,
    a MIG GPU before a command): that reading takes every GPU's queued Xid events, so the
    engine keeps the others' for its next poll, where each is judged once."""
    clock = Clock()
    engine = Engine(make_policy(dry_run=True), reader=TwoGpuReader(clock, ghost_host),
                    actuator=Actuator(), clock=clock, sink=Sink())  # fmt: skip
    target = ResetTarget(uuid=HEALTH_GPU, pci_bus_id=None, minor=0, persistence_was_on=False)
    assert engine.reread_gpu(target) == gpu(0, HEALTH_GPU, health())
    zero, one = (g.health for g in engine.poll().snapshot.nvml.gpus)
    assert zero is not None
    assert one is not None
    assert (zero.xids, [x.xid for x in one.xids]) == ((), [48])
    assert all(g.health and g.health.xids == () for g in engine.poll().snapshot.nvml.gpus)


def test_xids_kept_through_a_storm_are_bounded_and_a_later_xid_is_still_judged() -> None:
    """An Xid storm on one GPU while a reset waits for another's NVLink fabric (a reading a
    second for up to 30 minutes, up to 256 events each) was kept whole: ~460,000 events in the
    next poll's one GPU, each reading's append a copy of all before. Past MAX_KEPT_XIDS a GPU's
    kept events fold to the first and the last of each Xid number: bounded, the times the
    judge reads kept, and an Xid that came after the storm still judged."""
    taken = TakenXids()
    for second in range(40):
        storm = tuple(XidEvent(13, 1_700_000_000.0 + second) for _ in range(256))
        taken.add([gpu(1, HEALTH_GPU1, health(xids=storm))])
        assert len(taken.events[HEALTH_GPU1]) <= MAX_KEPT_XIDS
    taken.add([gpu(1, HEALTH_GPU1, health(xids=(XidEvent(48, 1_700_000_050.0),)))])
    read = taken.first_in(snap(gpu(0, HEALTH_GPU, health()), gpu(1, HEALTH_GPU1, health())))
    xids = [
        (x.xid, x.wall - 1_700_000_000.0) for g in read.nvml.gpus if g.health for x in g.health.xids
    ]
    assert (xids[0], xids[-2:]) == ((13, 0.0), [(13, 39.0), (48, 50.0)])
    found = assess_health(read, HealthState(), boot_changed=False).findings
    assert [(f.kind, f.gpu) for f in found] == [(FindingKind.RESET_REQUIRED, HEALTH_GPU1)]


def test_taken_xid_events_go_through_the_state_file_and_back() -> None:
    """NVML's events are saved (nothing delivers them again); the kernel log's are not (the
    next start reads this boot's log again); a file from before the key has none."""
    taken = TakenXids()
    events = XidEvent(48, 1_700_000_900.5), XidEvent(79, 1_700_000_901.0)
    logged = KernelXid("0000:11:00", 48, 900.0, 900.0, 7)
    taken.add([gpu(1, HEALTH_GPU1, health(xids=events))], (logged,))
    saved = json.loads(json.dumps(taken.to_json()))
    assert saved == {HEALTH_GPU1: [[48, 1_700_000_900.5], [79, 1_700_000_901.0]]}
    assert TakenXids.from_json(saved) == TakenXids({HEALTH_GPU1: events})
    assert TakenXids.from_json({}) == TakenXids()


@pytest.mark.parametrize(
    "saved",
    [
        [],
        {HEALTH_GPU1: {}},
        {HEALTH_GPU1: [48, 900.0]},
        {HEALTH_GPU1: [[48]]},
        {HEALTH_GPU1: [[48, 900.0, 1]]},
        {HEALTH_GPU1: [["48", 900.0]]},
        {HEALTH_GPU1: [[True, 900.0]]},
        {HEALTH_GPU1: [[48.0, 900.0]]},
        {HEALTH_GPU1: [[-1, 900.0]]},
        {HEALTH_GPU1: [[0x10000, 900.0]]},  # past the collector's MAX_XID: garbage
        {HEALTH_GPU1: [[48, None]]},
        {HEALTH_GPU1: [[48, "900"]]},
        {HEALTH_GPU1: [[48, float("inf")]]},
        {HEALTH_GPU1: [[48, -1.0]]},  # before 1970: the collector drops it (one pair reader)
        {HEALTH_GPU1: [[48, 900.0]] * (MAX_KEPT_XIDS + 1)},  # more than a GPU keeps
    ],
)
def test_saved_taken_xids_not_of_the_written_shape_are_refused_naming_them(saved: object) -> None:
    with pytest.raises(ValueError, match="taken_xids"):
        TakenXids.from_json(saved)


@dataclass
class UnreadThenReadReader(Reader):
    """The kernel log says Xid 48 of GPU 1 at the first poll, whose NVML reading has no health
    for GPU 1 (not lost: its fields unread); every poll after reads it."""

    polls: int = 0

    def collect(self) -> Snapshot:
        self.polls += 1
        first = self.polls == 1
        gpus = gpu(0, HEALTH_GPU, health()), gpu(1, HEALTH_GPU1, None if first else health())
        reading = snap(*gpus, t=self.clock.now)
        logged = KernelXid("0000:11:00", 48, reading.wall_time, reading.wall_time, 7)
        return replace(reading, kernel_xids=(logged,) if first else ())


def test_a_kernel_log_xid_of_a_gpu_whose_health_is_unread_is_judged_at_a_poll_that_reads_it() -> (
    None
):
    """A GPU whose health a poll could not read (not lost) is not judged that poll: the kernel
    log's Xids naming it, read once, were dropped with it, never judged. They wait for a poll
    that reads its health, as NVML's events do, and are judged there, once."""
    clock = Clock()
    engine = Engine(make_policy(dry_run=True), reader=UnreadThenReadReader(clock, ghost_host),
                    actuator=Actuator(), clock=clock, sink=Sink())  # fmt: skip
    assert engine.poll().assessment.findings == ()
    clock.now = 10.0
    report = engine.poll()
    assert [x.xid for x in report.snapshot.kernel_xids] == [48]
    assert [(f.kind, f.gpu) for f in report.assessment.findings] == [
        (FindingKind.RESET_REQUIRED, HEALTH_GPU1)
    ]
    clock.now = 20.0
    assert engine.poll().snapshot.kernel_xids == ()


def test_kernel_log_xids_kept_for_an_unread_gpu_are_bounded_and_others_pass() -> None:
    """A GPU whose health is never read keeps at most MAX_KEPT_RUNS of its kernel-log runs (the
    first); a run naming no GPU NVML reports is not kept (the judge drops it)."""
    taken = TakenXids()
    unread = snap(gpu(0, HEALTH_GPU, health()), gpu(1, HEALTH_GPU1, None))
    runs = tuple(KernelXid("0000:11:00", 13, 900.0, 900.0, n) for n in range(MAX_KEPT_RUNS + 5))
    nobody = KernelXid("0000:99:00", 13, 900.0, 900.0, 1000)
    for _ in range(3):
        assert taken.first_in(replace(unread, kernel_xids=(*runs, nobody))).kernel_xids == (nobody,)
    assert taken.kernel == runs[:MAX_KEPT_RUNS]


def test_xids_kept_for_the_next_poll_wait_for_a_poll_that_reads_their_gpu() -> None:
    """The Xids a reading between polls took (the reset procedure's) went into the next poll
    whatever it read: with NVML unavailable that poll, or one GPU's health unread, they were
    dropped, never judged. They wait for a poll that reads their GPU's health (the kernel
    log's, for one that names GPUs: the collector reads the log only then)."""
    double_bit = XidEvent(48, 1_700_000_900.0)
    logged = KernelXid("0000:11:00", 48, 900.0, 900.0, 7)
    taken = TakenXids()
    taken.add([gpu(1, HEALTH_GPU1, health(xids=(double_bit,)))], (logged,))
    unavailable = replace(snap(), nvml=NvmlReading(available=False, error="timed out"))
    assert taken.first_in(unavailable) == unavailable
    unread = snap(gpu(0, HEALTH_GPU, health()), gpu(1, HEALTH_GPU1, None))
    assert taken.first_in(unread) == unread
    read = taken.first_in(snap(gpu(0, HEALTH_GPU, health()), gpu(1, HEALTH_GPU1, health())))
    assert [g.health.xids for g in read.nvml.gpus if g.health] == [(), (double_bit,)]
    assert read.kernel_xids == (logged,)
    again = snap(gpu(1, HEALTH_GPU1, health()))
    assert taken.first_in(again) == again
