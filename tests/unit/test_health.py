"""GPU health, pure: the Xid catalogue, the recovery action, row remapping and retired pages give
findings (decide/health/judge.py), and plan turns them into drain, wait, reset or reboot hooks —
never a signal, never a reset with a live holder, the wait bounded and kept across restarts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gpuwatchd.core.model import (
    FindingKind,
    GpuHealth,
    ProcessInfo,
    Snapshot,
    Support,
    XidEvent,
)
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.health.judge import assess_health, note_reset, rebase_wall
from gpuwatchd.decide.health.state import (
    GpuHealthState,
    HealthState,
    Sighting,
    XidDetail,
    XidLog,
    XidRecord,
)
from gpuwatchd.decide.health.xid_catalogue import XidAction, xid_action
from gpuwatchd.decide.plan.decisions import plan, set_paused
from gpuwatchd.decide.plan.intents import HookIntent, PlanResult, ResetIntent, SignalIntent
from gpuwatchd.decide.plan.outcomes import record_reset
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import HealthPolicy, Hook, Policy, ResetPolicy
from tests.support.healthcases import GPU0, GPU1, gpu, health, snap

DRAIN = Hook(("scontrol", "update", "state=drain"))
FAIL = Hook(("page-oncall",))


def live(pid: int) -> ProcessInfo:
    return ProcessInfo(pid=pid, start_ticks=500 + pid, state="S", ppid=1, pgid=pid, sid=pid,
                       cmdline=("python3", "train.py"))  # fmt: skip


def policy(**health_over: object) -> Policy:
    return Policy(
        dry_run=False,
        reset=ResetPolicy(drain=(DRAIN,), cooldown=0.0, max_resets=3),
        health=replace(HealthPolicy(), **health_over),  # type: ignore[arg-type]
        on_failure=(FAIL,),
    )


def kinds(h: GpuHealth, state: HealthState | None = None) -> list[FindingKind]:
    result = assess_health(snap(gpu(0, GPU0, h)), state or HealthState(), boot_changed=False)
    return [f.kind for f in result.findings]


# --- findings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "expected"),
    [
        ({}, []),
        ({"recovery_action": 1}, [FindingKind.RESET_REQUIRED]),
        ({"recovery_action": 4}, [FindingKind.RESET_REQUIRED]),
        ({"recovery_action": 2}, [FindingKind.REBOOT_REQUIRED]),
        ({"recovery_action": 3}, [FindingKind.DRAIN_REQUIRED]),
        ({"recovery_action": 200}, [FindingKind.DRAIN_REQUIRED]),  # reported, not actionable
        ({"recovery_action": None, "recovery_support": Support.UNKNOWN}, []),
        ({"remap_pending": True}, [FindingKind.RESET_REQUIRED]),
        ({"remap_failure": True}, [FindingKind.REBOOT_REQUIRED]),
        ({"remap_failure": True, "remap_pending": True}, [FindingKind.REBOOT_REQUIRED]),
        ({"remap_pending": None, "remap_support": Support.UNKNOWN}, []),
        ({"pages_pending": True, "pages_support": Support.OK}, [FindingKind.REBOOT_REQUIRED]),
        ({"xids": (XidEvent(95, 1.0),)}, [FindingKind.RESET_REQUIRED]),
        ({"xids": (XidEvent(79, 1.0),)}, [FindingKind.REBOOT_REQUIRED]),
        ({"xids": (XidEvent(13, 1.0), XidEvent(45, 2.0), XidEvent(31, 3.0))}, []),
        ({"xids": (XidEvent(154, 1.0),), "recovery_action": 4}, [FindingKind.RESET_REQUIRED]),
        (
            {
                "xids": (XidEvent(154, 1.0),),
                "recovery_support": Support.NOT_SUPPORTED,
                "recovery_action": None,
            },
            [],
        ),
        ({"xids": (XidEvent(63, 1.0), XidEvent(92, 1.0), XidEvent(94, 1.0))}, []),
    ],
)
def test_health_readings_give_the_strongest_finding(
    over: dict[str, object], expected: list[FindingKind]
) -> None:
    assert kinds(health(**over)) == expected


def test_application_xids_are_counted_but_never_a_reason() -> None:
    assert xid_action(13) is XidAction.RESTART_APP
    assert xid_action(31) is XidAction.RESTART_APP
    assert xid_action(43) is XidAction.IGNORE
    result = assess_health(
        snap(gpu(0, GPU0, health(xids=(XidEvent(13, 5.0), XidEvent(13, 6.0))))),
        HealthState(),
        boot_changed=False,
    )
    assert result.findings == ()
    assert result.state.gpus[GPU0].xids[13].count == 2


def test_xids_are_remembered_across_polls_with_counts_and_times() -> None:
    first = assess_health(snap(gpu(0, GPU0, health(xids=(XidEvent(95, 10.0),)))), HealthState(),
                          boot_changed=False)  # fmt: skip
    second = assess_health(snap(gpu(0, GPU0, health(xids=(XidEvent(95, 20.0),)))), first.state,
                           boot_changed=False)  # fmt: skip
    (finding,) = second.findings
    assert finding.kind is FindingKind.RESET_REQUIRED
    assert finding.pid is None
    assert finding.evidence["xids"] == {
        "95": {"count": 2, "first": 10.0, "last": 20.0, "action": "reset", "bucket": "RESET_GPU"}
    }
    assert "Xid 95 (Uncontained memory error) seen 2 time(s)" in finding.reason
    assert finding.evidence["since"] == first.findings[0].evidence["since"]
    # A new boot forgets them.
    after_boot = assess_health(snap(gpu(0, GPU0, health())), second.state, boot_changed=True)
    assert after_boot.findings == ()
    assert after_boot.state.gpus[GPU0].xids == {}


def test_a_boot_id_that_cannot_be_read_is_no_new_boot_and_forgets_nothing() -> None:
    """Xid 79 asks for a reboot; one poll cannot read the boot id: the same boot as far as
    anyone knows, so the GPU still needs its reboot then and once the id is read again. A
    new id read after it is a new boot."""
    first = assess(snap(gpu(0, GPU0, health(xids=(XidEvent(79, 10.0),)))), AssessState(),
                   Policy().detection)  # fmt: skip
    unknown = replace(snap(gpu(0, GPU0, health()), t=1005.0), boot_id=None)
    blind = assess(unknown, first.state, Policy().detection)
    assert blind.state.boot_id == "boot-1"
    again = assess(snap(gpu(0, GPU0, health()), t=1010.0), blind.state, Policy().detection)
    for result in (first, blind, again):
        assert [f.kind for f in result.findings] == [FindingKind.REBOOT_REQUIRED]
    rebooted = replace(snap(gpu(0, GPU0, health()), t=20.0), boot_id="boot-2")
    assert assess(rebooted, blind.state, Policy().detection).findings == ()


def test_a_reset_clears_xid_reasons_but_a_field_still_asking_means_reboot() -> None:
    seen = assess_health(snap(gpu(0, GPU0, health(xids=(XidEvent(95, 10.0),)))), HealthState(),
                         boot_changed=False).state  # fmt: skip
    after = note_reset(seen, GPU0, 50.0)
    assert kinds(health(), after) == []
    assert kinds(health(recovery_action=1), after) == [FindingKind.REBOOT_REQUIRED]
    assert kinds(health(remap_pending=True), after) == [FindingKind.REBOOT_REQUIRED]
    # An Xid after the reset asks again for a reset, not a reboot.
    assert kinds(health(xids=(XidEvent(95, 60.0),)), after) == [FindingKind.RESET_REQUIRED]


def test_an_xid_after_a_reset_asks_again_when_the_wall_clock_stepped_back_in_between() -> None:
    """A reset at wall 1000, then the clock steps back an hour; 20 s after the reset Xid 48
    is stamped at the stepped time. Moved back by the step, the reset is still before it."""
    state = note_reset(HealthState(), GPU0, 1000.0)
    stepped = 1020.0 - 3600.0
    moved = rebase_wall(state, 3600.0)
    assert moved.gpus[GPU0].last_reset == 1000.0 - 3600.0
    assert kinds(health(xids=(XidEvent(48, stepped),)), moved) == [FindingKind.RESET_REQUIRED]
    assert kinds(health(xids=(XidEvent(48, stepped),)), state) == []  # not moved: dealt with
    assert rebase_wall(state, 0.0) is state
    assert rebase_wall(state, 0.5).gpus[GPU0].last_reset == 999.5  # any step back counts
    assert rebase_wall(state, -5.0) is state  # forward: time passed


def _history_at(at: float) -> GpuHealthState:
    """A health history with every wall time an offset from ``at`` (and two that are not)."""
    return GpuHealthState(
        xids={48: XidRecord(3, at, at + 1)},
        last_reset=at + 2,
        since={"reset_required": at + 3},
        assumed_reset=at + 4,
        assumed_cured=("remap",),
        fabric_since=at + 5,
        checked_reset=at + 2,
        unhealed=("recovery:1",),
        klog_pos=77,  # microseconds since boot: no wall time
        sightings=(Sighting(48, at + 6, "nvml"),),
        details={48: XidDetail(9, "python3", "slurm:1", "text", False, at + 7)},
        xid_log={48: XidLog(at + 8, 2, at + 9, at + 10)},
    )


def test_a_backward_step_moves_every_wall_time_of_the_health_history_and_nothing_else() -> None:
    state = HealthState(gpus={GPU0: _history_at(5000.0), GPU1: GpuHealthState()})
    after = rebase_wall(state, 1000.0)
    assert after.gpus == {GPU0: _history_at(4000.0), GPU1: GpuHealthState()}


def test_health_state_round_trips_and_rejects_garbage() -> None:
    reading = health(xids=(XidEvent(95, 10.0),), remap_pending=True)
    state = assess_health(snap(gpu(0, GPU0, reading)), HealthState(), boot_changed=False).state
    state = note_reset(state, GPU0, 42.0)
    assert HealthState.from_json(json.loads(json.dumps(state.to_json()))) == state
    bad: object
    for bad in ({GPU0: {"xids": {"x": [1, 1.0, 1.0]}}}, {GPU0: {"xids": {"95": [1, "a", 1.0]}}},
                {GPU0: {"last_reset": float("inf")}}, []):  # fmt: skip
        with pytest.raises(ValueError, match=r"health|expected"):
            HealthState.from_json(bad)
    round_tripped = AssessState.from_json(
        json.loads(json.dumps(AssessState(health=state).to_json()))
    )
    assert round_tripped.health == state


def test_a_lost_or_unread_gpu_gets_no_health_finding_and_keeps_its_history() -> None:
    seen = assess_health(snap(gpu(0, GPU0, health(xids=(XidEvent(95, 10.0),)))), HealthState(),
                         boot_changed=False).state  # fmt: skip
    lost = replace(gpu(0, GPU0, health(recovery_action=2)), lost=True)
    for blind in (lost, gpu(0, GPU0, None)):
        result = assess_health(snap(blind, t=1100.0), seen, boot_changed=False)
        assert result.findings == ()
        assert result.state == seen


def test_a_finding_holds_since_its_first_poll_and_a_new_incident_starts_anew() -> None:
    """``since`` (evidence and state) is the wall time the finding was first made, kept while
    it holds and forgotten once it resolves."""
    first_wall = snap(t=1000.0).wall_time
    state = HealthState()
    for t in (1000.0, 1100.0):
        result = assess_health(snap(gpu(0, GPU0, health(recovery_action=1)), t=t), state,
                               boot_changed=False)  # fmt: skip
        state = result.state
        (finding,) = result.findings
        assert finding.evidence["since"] == first_wall
        assert state.gpus[GPU0].since == {"reset_required": first_wall}
    state = assess_health(snap(gpu(0, GPU0, health()), t=1200.0), state, boot_changed=False).state
    assert state.gpus[GPU0].since == {}
    again = assess_health(snap(gpu(0, GPU0, health(recovery_action=1)), t=1300.0), state,
                          boot_changed=False)  # fmt: skip
    assert again.findings[0].evidence["since"] == snap(t=1300.0).wall_time


GPU_RESET_REASON = (
    "the driver's recovery action is GPU_RESET (1): NVIDIA: end the GPU's processes and reset it"
)
UNKNOWN_ACTION_REASON = (
    "the driver's recovery action is unknown (200): a value gpuwatchd does not know; reported, "
    "never acted on"
)
FABRIC_ERROR = {"fabric_support": Support.OK, "fabric_state": 3, "fabric_status": 5}


@pytest.mark.parametrize(
    ("over", "kind", "actionable", "others"),
    [
        ({"recovery_action": 1}, FindingKind.RESET_REQUIRED, True, []),
        (
            {"recovery_action": 1, "pages_support": Support.OK, "pages_pending": True},
            FindingKind.REBOOT_REQUIRED,
            True,
            [GPU_RESET_REASON],
        ),
        ({"recovery_action": 200}, FindingKind.DRAIN_REQUIRED, False, []),
        # One reason gpuwatchd may act on makes the finding actionable.
        ({"recovery_action": 200, **FABRIC_ERROR}, FindingKind.DRAIN_REQUIRED, True, []),
    ],
)
def test_a_finding_names_its_kinds_reasons_and_only_the_weaker_kinds_as_others(
    over: dict[str, object], kind: FindingKind, actionable: bool, others: list[str]
) -> None:
    (finding,) = assess_health(snap(gpu(0, GPU0, health(**over))), HealthState(),
                               boot_changed=False).findings  # fmt: skip
    assert (finding.kind, finding.actionable) == (kind, actionable)
    assert finding.evidence["other_reasons"] == others
    assert finding.reason == "; ".join(finding.evidence["reasons"])  # type: ignore[arg-type]


# --- plan -------------------------------------------------------------------------------------


class Run:
    """Drives assess + plan like the engine does (reset outcomes booked by hand)."""

    def __init__(self, pol: Policy) -> None:
        self.policy = pol
        self.assess_state = AssessState()
        self.plan_state = PlanState()

    def poll(self, snapshot: Snapshot) -> PlanResult:
        assessment = assess(snapshot, self.assess_state, self.policy.detection)
        self.assess_state = assessment.state
        result = plan(assessment.findings, snapshot, self.plan_state, self.policy,
                      now=snapshot.monotonic, wall=snapshot.wall_time,
                      report_only=assessment.report_only)  # fmt: skip
        self.plan_state = result.state
        return result

    def book(self, intent: ResetIntent, t: float, outcome: str = "success") -> PlanResult:
        result = record_reset(self.plan_state, intent, outcome, now=t, wall=1_700_000_000.0 + t)
        self.plan_state = result.state
        if outcome == "success":
            health = note_reset(self.assess_state.health, intent.gpu, 1_700_000_000.0 + t)
            self.assess_state = replace(self.assess_state, health=health)
        return result

    def restart(self) -> None:
        """A daemon restart: both states through their JSON form."""
        self.plan_state = PlanState.from_json(json.loads(json.dumps(self.plan_state.to_json())))
        self.assess_state = AssessState.from_json(
            json.loads(json.dumps(self.assess_state.to_json()))
        )


def names(result: PlanResult) -> list[str]:
    return [e.name for e in result.events]


def resets(result: PlanResult) -> list[ResetIntent]:
    return [i for i in result.intents if isinstance(i, ResetIntent)]


def hooks(result: PlanResult) -> list[str]:
    return [i.hook for i in result.intents if isinstance(i, HookIntent)]


def test_idle_gpu_asking_for_a_reset_is_drained_then_reset_at_once() -> None:
    run = Run(policy())
    result = run.poll(snap(gpu(0, GPU0, health(recovery_action=1))))
    assert hooks(result) == ["reset_drain"]
    assert EventName.HEALTH_DRAIN_STARTED in names(result)
    (intent,) = resets(result)
    assert intent.gpu == GPU0
    assert not intent.dry_run
    run.book(intent, 1001.0)
    # The driver cleared the action after the reset: the finding resolves, nothing more.
    after = run.poll(snap(gpu(0, GPU0, health()), t=1010.0))
    assert resets(after) == []
    assert EventName.FINDING_RESOLVED in names(after)
    assert run.plan_state.health_waits == {}


def test_unisolated_node_waits_for_a_live_job_on_another_gpu_and_never_signals_it() -> None:
    run = Run(policy(drain_timeout=3600.0))
    job = live(4242)
    pending = health(remap_pending=True)
    busy = (gpu(0, GPU0, pending), gpu(1, GPU1, health(), pids=(4242,)))
    first = run.poll(snap(*busy, procs=(job,)))
    assert hooks(first) == ["reset_drain"]
    assert resets(first) == []
    assert EventName.HEALTH_DRAIN_WAITING in names(first)
    assert not any(isinstance(i, SignalIntent) for i in first.intents)
    run.restart()  # the wait survives: no second drain, the same start
    second = run.poll(snap(*busy, t=1600.0, procs=(job,)))
    assert hooks(second) == []
    assert resets(second) == []
    assert run.plan_state.health_waits[GPU0].since == 1000.0
    done = run.poll(snap(gpu(0, GPU0, pending), gpu(1, GPU1, health()), t=1700.0))
    (intent,) = resets(done)
    assert intent.gpu == GPU0
    assert hooks(done) == []


def test_with_device_isolation_a_job_on_another_gpu_does_not_block() -> None:
    run = Run(policy(device_isolation=True))
    result = run.poll(snap(gpu(0, GPU0, health(recovery_action=4)),
                           gpu(1, GPU1, health(), pids=(4242,)), procs=(live(4242),)))  # fmt: skip
    assert len(resets(result)) == 1


def test_drain_wait_is_bounded_then_on_failure_once_and_a_reset_only_once_free() -> None:
    run = Run(policy(drain_timeout=600.0))
    job = live(77)
    state_of = (gpu(0, GPU0, health(recovery_action=1), pids=(77,)),)
    run.poll(snap(*state_of, procs=(job,)))
    assert run.plan_state.waiting  # the timeout is a deadline the engine wakes for
    late = run.poll(snap(*state_of, t=1601.0, procs=(job,)))
    assert EventName.HEALTH_DRAIN_TIMED_OUT in names(late)
    assert hooks(late) == ["on_failure"]
    assert resets(late) == []
    later = run.poll(snap(*state_of, t=2000.0, procs=(job,)))
    assert hooks(later) == []
    assert resets(later) == []
    freed = run.poll(snap(gpu(0, GPU0, health(recovery_action=1)), t=2100.0))
    assert len(resets(freed)) == 1
    assert hooks(freed) == [], "no second drain, no second page"


def test_reboot_required_runs_on_failure_and_drain_once_and_never_resets() -> None:
    run = Run(policy())
    readings = [snap(gpu(0, GPU0, health(xids=(XidEvent(79, 1.0),)))),
                snap(gpu(0, GPU0, health()), t=1100.0)]  # fmt: skip
    first, second = run.poll(readings[0]), run.poll(readings[1])
    assert EventName.GPU_NEEDS_REBOOT in names(first)
    assert hooks(first) == ["on_failure", "reset_drain"]
    assert resets(first) == []
    assert hooks(second) == []
    assert resets(second) == []
    assert EventName.GPU_NEEDS_REBOOT not in names(second)


@pytest.mark.parametrize("case", ["reboot", "lost", "drain timed out"])
def test_a_pause_holds_the_on_failure_hooks_and_says_so(case: str) -> None:
    """A pause holds every hook (docs/escalation.md, docs/operations.md §7): a GPU that needs
    a reboot, is lost, or whose drain timed out is still reported, but no on_failure hook (a
    page, a node drain) runs during the maintenance; ``action.refused`` says why."""
    run = Run(policy(drain_timeout=600.0))
    said = EventName.GPU_NEEDS_REBOOT
    reading = snap(gpu(0, GPU0, health(xids=(XidEvent(79, 1.0),))))
    if case == "lost":
        reading = snap(replace(gpu(0, GPU0, health()), lost=True))
    elif case == "drain timed out":
        busy = (gpu(0, GPU0, health(recovery_action=1), pids=(77,)),)
        run.poll(snap(*busy, procs=(live(77),)))  # the drain wait began before the pause
        reading, said = snap(*busy, t=1601.0, procs=(live(77),)), EventName.HEALTH_DRAIN_TIMED_OUT
    run.plan_state = set_paused(run.plan_state, True, reason="driver upgrade")
    result = run.poll(reading)
    assert said in names(result)
    assert hooks(result) == []
    (refused,) = [e for e in result.events if e.name == EventName.ACTION_REFUSED]
    assert str(refused.fields["why"]).startswith("paused: driver upgrade; on_failure not run: ")
    assert refused.fields["gpu"] == GPU0


@pytest.mark.parametrize("case", ["reboot", "drain"])
def test_a_gpu_first_seen_needing_a_reboot_or_drain_while_paused_is_drained_after_resume(
    case: str,
) -> None:
    """A pause holds the drain hooks; after ``resume`` they run once, for a GPU that needs a
    reboot as for one that needs a drain (the reboot's page stays unrun: docs/escalation.md).
    A reboot's drain was lost: its finding had been said while paused, and only then drained."""
    run = Run(policy())
    reading = snap(gpu(0, GPU0, health(xids=(XidEvent(79, 1.0),))))
    if case == "drain":
        reading = snap(gpu(0, GPU0, health(recovery_action=3)))
    run.plan_state = set_paused(run.plan_state, True, reason="driver upgrade")
    assert hooks(run.poll(reading)) == []
    run.plan_state = set_paused(run.plan_state, False, reason="")
    later = replace(reading, monotonic=1100.0)
    assert hooks(run.poll(later)) == ["reset_drain"]
    assert hooks(run.poll(replace(reading, monotonic=1200.0))) == []


def test_drain_p2p_settling_to_gpu_reset_drains_once_and_a_later_incident_drains_again() -> None:
    """DRAIN_P2P (drain_required) then GPU_RESET (reset_required) is one incident on one GPU:
    the drain hooks ran for the first finding, so the reset that follows is drained already
    (also across a restart). After the reset's after hooks undrained the node, a new incident
    of the GPU drains again."""
    run = Run(policy())
    p2p = run.poll(snap(gpu(1, GPU0, health(recovery_action=3))))
    assert hooks(p2p) == ["reset_drain"]
    (drain,) = [i for i in p2p.intents if isinstance(i, HookIntent)]
    assert (drain.facts["pci_bus_id"], drain.facts["minor"]) == ("00000000:11:00.0", 1)
    assert run.plan_state.health_drained == {GPU0: False}
    run.restart()
    settled = run.poll(snap(gpu(1, GPU0, health(recovery_action=1)), t=1100.0))
    assert hooks(settled) == [], "drained already for this incident"
    (started,) = [e for e in settled.events if e.name == EventName.HEALTH_DRAIN_STARTED]
    assert started.fields["drained_already"] is True
    (intent,) = resets(settled)
    assert intent.drained
    run.book(intent, 1101.0)
    assert run.plan_state.health_drained == {}
    run.poll(snap(gpu(1, GPU0, health()), t=1110.0))  # resolved
    again = run.poll(snap(gpu(1, GPU0, health(recovery_action=3)), t=2000.0))
    assert hooks(again) == ["reset_drain"]


def test_a_failed_health_reset_leaves_the_incident_drained() -> None:
    """Only a reset that succeeded had its after hooks undo the drain (an undrain hook learns
    the result and keeps a failed GPU's node drained): after a failure the incident's next
    finding does not drain again."""
    run = Run(policy())
    (intent,) = resets(run.poll(snap(gpu(0, GPU0, health(recovery_action=1)))))
    run.book(intent, 1001.0, outcome="failed")
    assert run.plan_state.health_drained == {GPU0: False}
    worse = run.poll(snap(gpu(0, GPU0, health(recovery_action=2)), t=1100.0))
    assert hooks(worse) == ["on_failure"]  # reboot_required: paged, not drained twice


def test_a_drain_incident_that_ends_without_a_reset_drains_again_next_time() -> None:
    run = Run(policy())
    assert hooks(run.poll(snap(gpu(0, GPU0, health(recovery_action=3))))) == ["reset_drain"]
    run.poll(snap(gpu(0, GPU0, health()), t=1100.0))  # the driver's answer: nothing to do
    assert run.plan_state.health_drained == {}
    later = run.poll(snap(gpu(0, GPU0, health(recovery_action=1)), t=1200.0))
    assert hooks(later) == ["reset_drain"]


def test_a_dry_runs_drain_does_not_stand_in_for_a_real_one() -> None:
    run = Run(replace(policy(), dry_run=True))
    first = run.poll(snap(gpu(0, GPU0, health(recovery_action=3))))
    assert [(i.hook, i.dry_run) for i in first.intents if isinstance(i, HookIntent)] == [
        ("reset_drain", True)
    ]
    run.policy = replace(run.policy, dry_run=False)  # a reload: enforcing now
    real = run.poll(snap(gpu(0, GPU0, health(recovery_action=1)), t=1100.0))
    assert [(i.hook, i.dry_run) for i in real.intents if isinstance(i, HookIntent)] == [
        ("reset_drain", False)
    ]


def test_no_drain_hooks_book_no_drain_and_hooks_added_by_a_reload_still_run() -> None:
    """With no ``reset.drain`` hooks nothing is drained: the GPU is not booked as drained, so
    the incident's next finding does not say ``drained_already`` and hooks a reload added run."""
    run = Run(replace(policy(), reset=ResetPolicy(cooldown=0.0, max_resets=3)))
    assert hooks(run.poll(snap(gpu(0, GPU0, health(recovery_action=3))))) == []
    assert run.plan_state.health_drained == {}
    run.policy = policy()  # a reload: drain hooks now
    settled = run.poll(snap(gpu(0, GPU0, health(recovery_action=1)), t=1100.0))
    assert hooks(settled) == ["reset_drain"]
    (started,) = [e for e in settled.events if e.name == EventName.HEALTH_DRAIN_STARTED]
    assert started.fields["drained_already"] is False


def test_still_unhealthy_after_the_reset_escalates_to_reboot() -> None:
    run = Run(policy())
    (intent,) = resets(run.poll(snap(gpu(0, GPU0, health(recovery_action=1)))))
    run.book(intent, 1001.0)
    after = run.poll(snap(gpu(0, GPU0, health(recovery_action=1)), t=1010.0))
    assert resets(after) == []
    assert EventName.GPU_NEEDS_REBOOT in names(after)
    assert "on_failure" in hooks(after)


@pytest.mark.parametrize(
    ("pol", "expected_hooks"),
    [
        (policy(action="report"), []),
        (policy(action="drain"), ["reset_drain"]),
        (replace(policy(), reset=ResetPolicy(enabled=False, drain=(DRAIN,))), ["reset_drain"]),
        (policy(enabled=False), []),
    ],
)
def test_without_action_reset_there_is_no_reset(pol: Policy, expected_hooks: list[str]) -> None:
    run = Run(pol)
    result = run.poll(snap(gpu(0, GPU0, health(recovery_action=1))))
    again = run.poll(snap(gpu(0, GPU0, health(recovery_action=1)), t=1100.0))
    assert resets(result) == []
    assert resets(again) == []
    assert hooks(result) == expected_hooks
    assert hooks(again) == []


def test_health_resets_obey_protect_limits_and_dry_run() -> None:
    protected = replace(policy(), protect=replace(policy().protect, gpus=(GPU0,)))
    assert resets(Run(protected).poll(snap(gpu(0, GPU0, health(recovery_action=1))))) == []
    dry = replace(policy(), dry_run=True)
    (intent,) = resets(Run(dry).poll(snap(gpu(0, GPU0, health(recovery_action=1)))))
    assert intent.dry_run
    limited = replace(policy(), reset=replace(policy().reset, max_resets=1, cooldown=0.0))
    run = Run(limited)
    (first,) = resets(run.poll(snap(gpu(0, GPU0, health(xids=(XidEvent(95, 1.0),))))))
    run.book(first, 1001.0)
    again = run.poll(snap(gpu(0, GPU0, health(xids=(XidEvent(95, 1_700_001_100.0),))), t=1100.0))
    assert resets(again) == []
    assert EventName.RESET_LIMIT_REACHED in names(again)


def test_application_xid_13_changes_nothing() -> None:
    run = Run(policy())
    result = run.poll(snap(gpu(0, GPU0, health(xids=(XidEvent(13, 1.0),)))))
    assert result.intents == ()
    assert EventName.FINDING_NEW not in names(result)


@pytest.mark.parametrize(
    ("drained", "would_succeed", "left"),
    [
        (True, True, {}),  # a dry drain, undone by the would-be reset's after hooks
        (True, False, {GPU0: True}),  # a would-be reset refused: no undrain would run
        (False, True, {GPU0: False}),  # a real drain: a dry run's reset undoes nothing
    ],
)
def test_a_dry_runs_reset_undoes_only_a_dry_runs_drain(
    drained: bool, would_succeed: bool, left: dict[str, bool]
) -> None:
    intent = ResetIntent(GPU0, None, 0, f"reset_required:{GPU0}:gpu", True, "test", {})
    state = PlanState(health_drained={GPU0: drained})
    booked = record_reset(state, intent, "dry_run", now=1.0, wall=1_700_000_001.0,
                          would_succeed=would_succeed)  # fmt: skip
    assert booked.state.health_drained == left


def test_an_xid_detail_keeps_its_json_keys_and_their_order() -> None:
    """The state file's and the evidence's bytes: these names, in this order."""
    detail = XidDetail(pid=7, process="py", job="42", text="Xid 79", before_start=True, wall=1.5)
    saved = HealthState(gpus={GPU0: GpuHealthState(details={79: detail})}).to_json()
    assert json.dumps(saved[GPU0]["details"]["79"]) == (  # type: ignore[index]
        '{"pid": 7, "process": "py", "job": "42", "text": "Xid 79", "before_start": true,'
        ' "wall": 1.5}'
    )
