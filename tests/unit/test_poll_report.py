"""The poll's contract: one value in (:class:`PollInputs`), one report out (:class:`PollReport`).

The daemon, ``run --once`` and ``simulate`` hand the engine the admin switches with the poll and
read what the poll did from its report; they never read or set the engine's attributes (only
its methods are called), so what the engine does is said in one place.
"""

from __future__ import annotations

import ast
import inspect
import math
import pathlib
from dataclasses import replace

import pytest

from gpuwatchd.core.model import Spare
from gpuwatchd.core.vocabulary import Cleanliness, EventName
from gpuwatchd.daemon.metrics import Metrics
from gpuwatchd.daemon.notify import describe_status
from gpuwatchd.decide.plan.intents import SignalIntent
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.verdict import STATE_UNREAD, UNREADABLE, cannot_tell
from gpuwatchd.engine.cycle import Engine, EngineState
from gpuwatchd.engine.edges import Pause, PollInputs
from tests.support.enginerig import W0, ghost_host, make_policy, orphan_host, rig

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "gpuwatchd"
# The modules that drive the engine: whatever they read of a poll comes from its report.
DRIVERS = ("daemon/lifecycle.py", "daemon/serving.py", "cli/run.py", "cli/once.py", "sim/*.py")


def _engine_uses(path: pathlib.Path) -> list[tuple[int, str, bool]]:
    """(line, attribute, whether it is assigned) of each ``<...>.engine.<attribute>``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        named = (isinstance(owner, ast.Attribute) and owner.attr == "engine") or (
            isinstance(owner, ast.Name) and owner.id == "engine"
        )
        if named:
            found.append((node.lineno, node.attr, isinstance(node.ctx, ast.Store | ast.Del)))
    return found


def _is_method(name: str) -> bool:
    try:
        return inspect.isfunction(inspect.getattr_static(Engine, name))
    except AttributeError:  # an attribute set in __init__: state, not a method
        return False


def test_the_drivers_only_call_the_engines_methods_and_read_no_attribute() -> None:
    bad = [
        f"{path.relative_to(PACKAGE)}:{line}: engine.{name}" + (" set" if stored else "")
        for pattern in DRIVERS
        for path in sorted(PACKAGE.glob(pattern))
        for line, name, stored in _engine_uses(path)
        if stored or not _is_method(name)
    ]
    assert bad == [], "read the poll's report (or add an explicit method): " + ", ".join(bad)


def test_the_guard_sees_an_attribute_read_and_a_write(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "d.py"
    source.write_text(
        "x = self.engine.last_snapshot\nself.engine.policy = p\nself.engine.poll()\n"
        "engine.wake_at()\n"
    )
    uses = _engine_uses(source)
    assert uses == [(1, "last_snapshot", False), (2, "policy", True), (3, "poll", False),
                    (4, "wake_at", False)]  # fmt: skip
    assert [_is_method(name) for _, name, _ in uses] == [False, False, True, True]


def test_the_report_carries_what_the_poll_saw_decided_and_did() -> None:
    policy = make_policy()
    r = rig(policy, orphan_host)
    r.clock.now = 2.0
    report = r.engine.poll(PollInputs(started=1.5, started_wall=W0 + 1.5))
    assert report.snapshot.monotonic == 2.0  # the reading of this poll
    assert "orphaned" in {f.kind for f in report.assessment.findings}
    assert report.verdict is not None
    assert [g.clean for g in report.verdict.gpus] == [False]
    (signal,) = report.intents  # what the plan asked for, carried out
    assert isinstance(signal, SignalIntent)
    assert (signal.identity.pid, signal.signal) == (201, "SIGTERM")
    assert r.actuator.signals == [(201, "SIGTERM", False)]
    assert report.plan == r.engine.standing().plan  # as the poll left it
    assert [lad.status for lad in report.plan.ladders.values()] == ["active"]
    assert (report.started, report.started_wall) == (1.5, W0 + 1.5)  # the caller's readings
    assert report.seconds == 0.5
    assert report.wake_at == r.engine.wake_at()
    # Each observer reads what it needs from the report alone.
    status = describe_status(report, policy.dry_run)
    assert "1 GPU watched" in status
    assert "1 not clean" in status
    assert "1 action under way" in status
    metrics = Metrics(None)
    metrics.after_poll(report, dry_run=False, policy_rejected=False)
    assert "gpuwatchd_poll_duration_seconds_sum 0.5" in metrics.render().decode()


def test_the_admin_switches_come_in_with_the_poll() -> None:
    r = rig(make_policy(), orphan_host)
    ticks = orphan_host(0.0).build().processes[201].start_ticks
    spare = Spare(target="pid:201", until=W0 + 600.0, reason="debug", pid=201, start_ticks=ticks)
    report = r.engine.poll(PollInputs(pause=Pause("maintenance", until=W0 + 60.0)))
    assert report.plan.paused
    assert r.actuator.signals == []
    (paused,) = r.sink.named(EventName.DAEMON_PAUSED)
    assert (paused["reason"], paused["until"]) == ("maintenance", W0 + 60.0)
    r.clock.now = 2.0  # the same pause, cut to limits.max_pause (state/pause.py): said again
    r.engine.poll(PollInputs(pause=Pause("maintenance", until=W0 + 30.0)))
    assert [p["until"] for p in r.sink.named(EventName.DAEMON_PAUSED)] == [W0 + 60.0, W0 + 30.0]
    r.clock.now = 5.0
    report = r.engine.poll(PollInputs(pause=Pause(None), spares=(spare,), spares_read_at=W0))
    assert not report.plan.paused
    assert r.sink.named(EventName.DAEMON_RESUMED)
    assert [s.target for s in report.snapshot.spares] == ["pid:201"]
    assert r.actuator.signals == [], "a spared process is not signalled"
    r.clock.now = 10.0
    report = r.engine.poll(PollInputs())  # nothing handed: the switches stay as they are
    assert not report.plan.paused
    assert [s.target for s in report.snapshot.spares] == ["pid:201"]
    report = r.engine.poll(PollInputs(clear_latches=math.inf))
    assert r.sink.named(EventName.LIMITS_LATCHES_CLEARED)
    failed = replace(report.plan, circuit_open=True, reset_failures=2, last_failure=W0 + 11.0)
    r.engine.state.plan = failed  # a reset failed after the request: its circuit holds
    report = r.engine.poll(PollInputs(clear_latches=W0 + 10.0))
    assert (report.plan.circuit_open, report.plan.reset_failures) == (True, 2)
    assert r.sink.named(EventName.LIMITS_LATCHES_CLEARED)[-1]["kept"] == ["circuit"]


@pytest.mark.parametrize(
    ("reason", "unknown"),
    [(f"{UNREADABLE} (moved to x): what it held is unknown", True), ("kill cap reached", False)],
    ids=["saved-state-unreadable", "kill-cap"],
)
def test_no_gpu_is_clean_while_latched_on_a_saved_state_it_could_not_read(
    reason: str, unknown: bool
) -> None:
    """The daemon moved an unreadable saved state aside: what it held (a reset or MIG recovery
    half done) is unknown, so its verdict (metrics, status) calls no GPU clean, as check-clean
    says, until the latch lifts. Another latch says nothing of the saved state."""
    plan = PlanState(forced_dry_run=True, forced_reason=reason, forced_since=W0)
    r = rig(make_policy(), lambda t: ghost_host(t, allocated=0), state=EngineState(plan=plan))
    report = r.engine.poll()
    assert report.verdict is not None
    (gpu,) = report.verdict.gpus
    assert gpu.clean is not unknown
    if unknown:
        assert (gpu.state, gpu.reasons[0].kind) == (Cleanliness.UNKNOWN, STATE_UNREAD)
        assert gpu.reasons[0].text == cannot_tell(reason)
    metrics = Metrics(None)
    metrics.after_poll(report, dry_run=True, policy_rejected=False)
    (line,) = [x for x in metrics.render().decode().splitlines() if "gpu_clean{" in x]
    assert line.endswith(" 0.0" if unknown else " 1.0")
    lifted = r.engine.poll(PollInputs(clear_latches=math.inf))  # resume --clear-latches
    assert lifted.verdict is not None
    assert [g.clean for g in lifted.verdict.gpus] == [True]
