"""The reset gates with history and the drain wait (decide/plan/decisions.py,
decide/health/judge.py): what
keeps a health reset waiting, a reset that needs a reboot, the gates a snapshot alone decides,
the post-action delay and cooldown around a reset, and the bounded drain wait. The holder
gates, pause and ladders are in tests/unit/test_gates.py, whose builders these tests share.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuwatchd.core.model import Finding, FindingKind, ProcessIdentity, Snapshot
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.health.judge import drain_blockers
from gpuwatchd.decide.plan.decisions import (
    forget_reset_refusals,
    hidden_holders,
    next_deadline,
    plan,
    set_paused,
)
from gpuwatchd.decide.plan.intents import HookIntent, ResetIntent
from gpuwatchd.decide.plan.outcomes import record_exit, record_reset
from gpuwatchd.decide.plan.resets import reset_gates
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import HealthPolicy, Limits, Policy
from tests.support.gatecases import (
    GPU0,
    GPU1,
    JOB,
    RESET_DRAIN,
    SELF,
    WALL,
    _after_sigterm,
    _ghost,
    _health,
    _hooks,
    _idle_host,
    _job_host,
    _orphan,
    _plan,
    _policy,
    _protect,
    _resets,
    _signals,
    _whys,
)
from tests.support.snapshots import HostBuilder, gpu_uuid

# --- what keeps a health reset waiting ----------------------------------------------------------


def _drain_host(*listings: tuple[int, int, str]) -> Snapshot:
    """``(gpu, pid, what)``: NVML lists ``pid`` on ``gpu``; ``what`` is "live", "zombie",
    "dead" (no such process), "self", "unreadable" or "holder" (no facts, but holds files)."""
    builder = HostBuilder(self_pids=frozenset({SELF})).gpu(0).gpu(1)
    for gpu, pid, what in listings:
        builder.nvml(gpu, pid)
        if what == "live":
            builder.proc(pid, holds={gpu}, uvm=True)
        elif what == "zombie":
            builder.proc(pid, state="Z")
        elif what == "unreadable":
            builder.unreadable(pid)
        elif what == "holder":
            builder.hold(pid, {gpu}, uvm=True)
        elif what == "self":
            builder.hold(pid, {gpu})  # our NVML worker holds the device files it reads
    return builder.build()


@pytest.mark.parametrize("isolated", [False, True])
@pytest.mark.parametrize(
    ("case", "listings", "same_gpu", "other_gpu"),
    [
        ("nothing listed", [], [], []),
        ("a job here", [(0, 800, "live")], ["pid 800 on this GPU"], []),
        (
            "a job on the other GPU",
            [(1, 800, "live")],
            [],
            ["pid 800 on GPU 1 (no device isolation)"],
        ),
        (
            "dead, zombie and our own PID listed first, then a job",
            [(0, 30, "dead"), (0, 31, "zombie"), (0, SELF, "self"), (0, 800, "live")],
            ["pid 800 on this GPU"],
            [],
        ),
        (
            "a listed PID whose facts are missing but whose files could not be read",
            [(0, 30, "dead"), (0, 801, "unreadable")],
            ["pid 801 on this GPU"],
            [],
        ),
        (
            "a listed PID without facts that holds device files",
            [(1, 30, "dead"), (1, 802, "holder")],
            [],
            ["pid 802 on GPU 1 (no device isolation)"],
        ),
    ],
)
def test_drain_blockers_by_what_nvml_lists_and_device_isolation(
    isolated: bool, case: str, listings: list[tuple[int, int, str]], same_gpu: list[str],
    other_gpu: list[str],
) -> None:  # fmt: skip
    snapshot = _drain_host(*listings)
    gpu = snapshot.nvml.gpus[0]
    expected = same_gpu + ([] if isolated else other_gpu)
    assert drain_blockers(gpu, snapshot, device_isolation=isolated) == expected, case


@pytest.mark.parametrize(
    ("case", "gpu0", "isolated", "expected"),
    [
        ("a job on GPU 0, isolated", "job", True, ["pid 801 on this GPU"]),
        (
            "a job on GPU 0, not isolated",
            "job",
            False,
            ["pid 800 on GPU 0 (no device isolation)", "pid 801 on this GPU"],
        ),
        ("GPU 0's list unknown, isolated", "unknown", True, ["pid 801 on this GPU"]),
        (
            "GPU 0's list unknown, not isolated",
            "unknown",
            False,
            ["the process list of GPU 0 is unknown", "pid 801 on this GPU"],
        ),
    ],
)
def test_the_gpu_before_the_one_to_reset_never_hides_its_own_job(
    case: str, gpu0: str, isolated: bool, expected: list[str]
) -> None:
    builder = HostBuilder().gpu(0, processes_readable=gpu0 != "unknown").gpu(1)
    if gpu0 == "job":
        builder.proc(800, holds={0}, uvm=True).nvml(0, 800)
    builder.proc(801, holds={1}, uvm=True).nvml(1, 801)
    snapshot = builder.build()
    assert drain_blockers(snapshot.nvml.gpus[1], snapshot, device_isolation=isolated) == (
        expected
    ), case


@pytest.mark.parametrize("isolated", [False, True])
def test_an_unknown_process_list_keeps_a_health_reset_waiting_unless_isolated_elsewhere(
    isolated: bool,
) -> None:
    builder = HostBuilder().gpu(0).gpu(1, processes_readable=False)
    other_unknown = builder.build()
    assert drain_blockers(other_unknown.nvml.gpus[0], other_unknown, device_isolation=isolated) == (
        [] if isolated else ["the process list of GPU 1 is unknown"]
    )
    here_unknown = HostBuilder().gpu(0, processes_readable=False).gpu(1).build()
    assert drain_blockers(here_unknown.nvml.gpus[0], here_unknown, device_isolation=isolated) == [
        "the process list of GPU 0 is unknown"
    ]


# --- a reset that leaves the GPU needing a reboot -----------------------------------------------

_INTENT = ResetIntent(
    gpu=GPU0, pci_bus_id="00000000:10:00.0", minor=0, finding_key="ghost_memory:x:gpu",
    dry_run=False, reason="ghost memory", facts={"user": None},
)  # fmt: skip


@pytest.mark.parametrize(
    ("outcome", "on_failure"),
    [
        ("success", [f"{GPU0} needs a reboot"]),
        ("refused", [f"{GPU0} needs a reboot"]),
        ("dry_run", [f"{GPU0} needs a reboot"]),
        ("failed", [f"reset of {GPU0} failed"]),  # one on_failure: the failure says it
        ("timeout", [f"reset of {GPU0} timeout"]),
    ],
)
def test_a_reset_that_needs_a_reboot_says_so_critically_and_runs_on_failure_once(
    outcome: str, on_failure: list[str]
) -> None:
    result = record_reset(PlanState(), _INTENT, outcome, now=10.0, wall=WALL, needs_reboot=True)
    assert [e.level for e in result.events if e.name == EventName.GPU_NEEDS_REBOOT] == ["critical"]
    assert [h.reason for h in _hooks(result, "on_failure")] == on_failure
    plain = record_reset(PlanState(), _INTENT, outcome, now=10.0, wall=WALL)
    assert EventName.GPU_NEEDS_REBOOT not in [e.name for e in plain.events]
    assert len(_hooks(plain, "on_failure")) == len(on_failure) - (
        0 if outcome in ("failed", "timeout") else 1
    )
    # Booked while paused (a reset a restart finished): said, no page (docs/escalation.md).
    paused = set_paused(PlanState(), True, reason="maintenance")
    held = record_reset(paused, _INTENT, outcome, now=10.0, wall=WALL, needs_reboot=True)
    assert _hooks(held, "on_failure") == []
    refused = [e.fields for e in held.events if e.name == EventName.ACTION_REFUSED]
    why = "paused: maintenance; on_failure not run: "
    assert [(f["gpu"], f["why"]) for f in refused] == [(GPU0, why + r) for r in on_failure]


# --- the reset gates a snapshot alone decides------------------------------------------------------


def _snapshot_with(**nvml: object) -> Snapshot:
    snapshot = _idle_host()
    return replace(snapshot, nvml=replace(snapshot.nvml, **nvml))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "finding", "snapshot", "report_only", "gates"),
    [
        ("not actionable", replace(_ghost(), actionable=False), _idle_host(), {},
         [("not_actionable", "not_actionable")]),
        ("a report-only GPU", _ghost(), _idle_host(), {GPU0: "MIG enabled"},
         [("report_only", "report_only: MIG enabled")]),
        ("NVML wedged", _ghost(), _snapshot_with(wedged=True), {},
         [("blocked", "blocked: NVML is wedged (a call missed its deadline)")]),
        ("host namespaces unknown", _ghost(), replace(_idle_host(), host_namespaces=None), {},
         [("blocked", "blocked: host PID/cgroup namespaces not visible")]),
        ("the GPU is lost", _ghost(), _snapshot_with(gpus=tuple(
            replace(g, lost=True) for g in _idle_host().nvml.gpus)), {},
         [("gpu", "GPU is lost (needs reboot)")]),
        ("the GPU is gone", _ghost(gpu_uuid(7)), _idle_host(), {},
         [("gpu", "GPU not in this snapshot")]),
    ],
)  # fmt: skip
def test_reset_gates_of_a_snapshot_and_plan_never_resets_past_one(
    case: str,
    finding: Finding,
    snapshot: Snapshot,
    report_only: dict[str, str],
    gates: list[tuple[str, str]],
) -> None:
    found = reset_gates(finding, snapshot, _policy(), report_only=report_only, findings=[])
    assert [(g.name, g.why) for g in found] == gates, case
    state = PlanState()
    for now in (0.0, 61.0, 4000.0):
        result = plan([finding], snapshot, state, _policy(), now=now, wall=WALL + now,
                      report_only=report_only)  # fmt: skip
        state = result.state
        assert _resets(result) == [], (case, now)


# --- a reset and the post-action delay ---------------------------------------------------------


def _quiet_policy() -> Policy:
    return _policy(
        limits=Limits(max_signalled_per_poll=4, max_signalled_per_hour=32, post_action_delay=30.0),
        reset=replace(_policy().reset, confirm_for=10.0, cooldown=600.0),
    )


def test_a_reset_waits_out_the_post_action_delay_of_a_signal_on_its_gpu() -> None:
    """The orphan got its SIGTERM at 0 and exited at 1: GPU 0 shows ghost memory, but no reset
    before the post-action delay (30 s) is over; the daemon wakes for it."""
    pol = _quiet_policy()
    state, finding = _after_sigterm(pol)
    state = record_exit(state, ProcessIdentity(JOB, finding.start_ticks or 0), now=1.0).state
    result = _plan([_ghost()], _idle_host(), state, pol, 2.0)
    result = _plan([_ghost()], _idle_host(), result.state, pol, 12.0)
    assert _resets(result) == []
    assert next_deadline(result.state) == 30.0
    (intent,) = _resets(_plan([_ghost()], _idle_host(), result.state, pol, 30.0))
    assert intent.gpu == GPU0


def test_a_started_reset_keeps_new_targets_on_its_gpu_waiting_and_says_how_long_it_waited() -> None:
    pol = _quiet_policy()
    state = _plan([_ghost()], _idle_host(), PlanState(), pol, 5.0).state
    result = _plan([_ghost()], _idle_host(), state, pol, 66.0)
    (intent,) = _resets(result)
    assert intent.reason.startswith("ghost memory confirmed for 61s: ")
    assert (intent.facts["lasted"], intent.drained) == (61.0, False)
    snapshot = _job_host().build()
    later = _plan([_ghost(), _orphan(snapshot)], snapshot, result.state, pol, 67.0)
    assert _signals(later) == []
    assert next_deadline(later.state) == 96.0  # 66 + post_action_delay


@pytest.mark.parametrize(("delay", "due"), [(30.0, 130.0), (0.5, 100.5), (0.0, None)])
def test_a_booked_reset_keeps_its_gpu_quiet_for_the_post_action_delay(
    delay: float, due: float | None
) -> None:
    pol = _policy(
        limits=Limits(max_signalled_per_poll=4, max_signalled_per_hour=32, post_action_delay=delay),
        reset=replace(_policy().reset, confirm_for=0.0),
    )
    result = _plan([_ghost()], _idle_host(), PlanState(), pol, 50.0)
    (intent,) = _resets(result)
    booked = record_reset(result.state, intent, "success", now=100.0, wall=WALL + 100.0)
    assert next_deadline(booked.state) == due
    if due is not None:
        assert booked.state.quiet_until[GPU0] == due
    # A reset not in flight (a restart lost it) leaves nothing due.
    loose = record_reset(PlanState(), intent, "success", now=100.0, wall=WALL + 100.0)
    assert next_deadline(loose.state) is None
    assert loose.state.quiet_until == {}


@pytest.mark.parametrize("outcome", ["success", "failed", "timeout", "refused", "in_use"])
def test_a_reset_attempt_starts_the_cooldown_of_its_gpu(outcome: str) -> None:
    """Also a refused one: once its incident may be tried again (here: a reload forgot the
    refusal), the cooldown still holds the next attempt."""
    pol = _policy(reset=replace(
        _policy().reset, confirm_for=0.0, cooldown=600.0, max_resets=5, max_failures=5
    ))  # fmt: skip
    result = _plan([_ghost()], _idle_host(), PlanState(), pol, 0.0)
    (intent,) = _resets(result)
    state = record_reset(result.state, intent, outcome, now=1.0, wall=WALL + 1.0).state
    if outcome in ("refused", "in_use"):
        assert set(state.reset_refusals) == {GPU0}
        state = forget_reset_refusals(state)
    again = _plan([_ghost()], _idle_host(), state, pol, 300.0)
    assert _resets(again) == []
    assert "cooldown" in _whys(again, EventName.RESET_REFUSED)
    assert len(_resets(_plan([_ghost()], _idle_host(), again.state, pol, 602.0))) == 1


def test_an_unknown_reset_outcome_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown reset outcome 'exploded'"):
        record_reset(PlanState(), _INTENT, "exploded", now=1.0, wall=WALL)


# --- a health reset: its gates, its drain wait ----------------------------------------------------


def test_a_health_reset_refused_by_a_gate_says_why() -> None:
    pol = _protect(gpus=(GPU0,))
    result = _plan([_health()], _idle_host(), PlanState(), pol, 0.0)
    assert _resets(result) == []
    assert _whys(result, EventName.RESET_REFUSED) == [f"protect: gpus {GPU0}"]


def test_the_health_drain_wait_is_due_at_its_timeout_and_ends_exactly_there() -> None:
    pol = _policy(
        reset=replace(_policy().reset, drain=RESET_DRAIN),
        health=HealthPolicy(action="reset", drain_timeout=600.0),
    )
    busy = _idle_host(job_on=0)
    result = _plan([_health()], busy, PlanState(), pol, 100.0)
    assert next_deadline(result.state) == 700.0  # the wait's end wakes the daemon
    result = _plan([_health()], busy, result.state, pol, 699.0)
    assert EventName.HEALTH_DRAIN_TIMED_OUT not in [e.name for e in result.events]
    result = _plan([_health()], busy, result.state, pol, 700.0)
    assert [e.name for e in result.events].count(EventName.HEALTH_DRAIN_TIMED_OUT) == 1
    assert len(_hooks(result, "on_failure")) == 1
    assert next_deadline(result.state) is None  # given up: nothing is due (no busy loop)
    freed = _plan([_health()], _idle_host(), result.state, pol, 900.0)
    (intent,) = _resets(freed)
    assert intent.drained  # the drain hooks ran before the wait: act does not run them again


def test_a_dry_runs_refused_reset_holds_its_incident_as_enforcement_would_until_it_acts() -> None:
    """Enforcement books a reset its final scan refused and does not try that incident again
    (its drain and before hooks once). A dry run previews the same: its would-be reset whose
    read-only final scan found the GPU held holds the incident past the cooldown — in the
    preview only: the moment the daemon enforces, the would-be refusal is gone."""
    dry = _policy(dry_run=True, reset=replace(
        _policy().reset, confirm_for=0.0, cooldown=60.0, max_resets=5
    ))  # fmt: skip
    first = _plan([_ghost()], _idle_host(), PlanState(), dry, 0.0)
    (intent,) = _resets(first)
    assert intent.dry_run
    state = record_reset(first.state, intent, "dry_run", now=1.0, wall=WALL + 1.0).state
    assert state.reset_refusals[GPU0].dry_run
    later = _plan([_ghost()], _idle_host(), state, dry, 300.0)  # past the cooldown
    assert _resets(later) == []
    assert any("would have been refused" in w for w in _whys(later, EventName.RESET_REFUSED))
    assert hidden_holders(later.state) == {}  # no driver's word: no hidden holder
    enforcing = replace(dry, dry_run=False)
    real = _plan([_ghost()], _idle_host(), later.state, enforcing, 301.0)
    assert real.state.reset_refusals == {}
    (again,) = _resets(real)
    assert not again.dry_run


def test_a_gpu_the_driver_says_is_in_use_has_a_live_holder_for_every_reset() -> None:
    """The GPU-level hidden_holder (a reset the driver refused as in use) holds every reset of
    that GPU — a health reset too, not only the refused incident's."""
    hidden = Finding(
        kind=FindingKind.HIDDEN_HOLDER, gpu=GPU0, pid=None, start_ticks=None,
        reason="the driver refused to reset GPU 0", evidence={"gap": "driver_in_use"},
    )  # fmt: skip
    for finding in (_ghost(), _health()):
        gates = reset_gates(finding, _idle_host(), _policy(), report_only={}, findings=[hidden])
        assert [(g.name, g.why) for g in gates] == [
            ("live_holder", "live holder: hidden_holder: the driver refused the last reset, "
             "in use by another client")
        ]  # fmt: skip
    other = reset_gates(_ghost(GPU1), _idle_host(), _policy(), report_only={}, findings=[hidden])
    assert other == []


def test_a_dry_runs_would_be_reset_deals_with_its_incident_and_starts_the_cooldown() -> None:
    """Assumed to have succeeded: the same incident is not reset again while it lasts, and a
    new one on that GPU waits for the cooldown, as after a real reset; its would-be
    notification is shown."""
    dry = _policy(dry_run=True, reset=replace(
        _policy().reset, confirm_for=0.0, cooldown=600.0, max_resets=5
    ))  # fmt: skip
    first = _plan([_ghost()], _idle_host(), PlanState(), dry, 0.0)
    (intent,) = _resets(first)
    booked = record_reset(
        first.state, intent, "dry_run", now=1.0, wall=WALL + 1.0, would_succeed=True
    )
    assert [(i.hook, i.dry_run) for i in booked.intents if isinstance(i, HookIntent)] == [
        ("on_action", True)
    ]
    later = _plan([_ghost()], _idle_host(), booked.state, dry, 900.0)  # past the cooldown
    assert _resets(later) == []
    assert any("assumed to have dealt with it" in w for w in _whys(later, EventName.RESET_REFUSED))
    gone = _plan([], _idle_host(), booked.state, dry, 100.0)  # the incident ended
    again = _plan([_ghost()], _idle_host(), gone.state, dry, 200.0)  # a new one, too soon
    assert _resets(again) == []
    assert "cooldown" in _whys(again, EventName.RESET_REFUSED)
