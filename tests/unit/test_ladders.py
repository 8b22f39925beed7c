"""The kill ladder poll by poll (decide/plan/decisions.py): what a target in an odd state gets at
the moment
its next step is due, what act's outcomes do to the ladder, who is told, and when the daemon
must wake next. Each test is a short timeline of ``plan`` and ``record_*`` calls.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuwatchd.core.model import MIB, Finding, FindingKind, NvmlReading, Snapshot
from gpuwatchd.decide.plan.decisions import (
    EventName,
    HookIntent,
    PlanResult,
    PlanState,
    SignalIntent,
    next_deadline,
    pending,
    plan,
    record_exit,
    record_signal,
    reset_gates,
)
from gpuwatchd.decide.policy import Limits, Policy, ResetPolicy, Rule, Step
from tests.support.snapshots import HostBuilder, gpu_uuid

GPU0, GPU1 = gpu_uuid(0), gpu_uuid(1)
WALL = 1_700_000_000.0
A, B = 1000, 2000  # two targets; A's ladder sorts first
LADDER = (Step("SIGTERM", 30.0), Step("SIGKILL", 10.0))
POLICY = Policy(
    dry_run=False,
    rules=(Rule("orphans", FindingKind.ORPHANED, LADDER),),
    limits=Limits(max_signalled_per_poll=8, max_signalled_per_hour=32, post_action_delay=0.0),
    reset=ResetPolicy(confirm_for=10.0, cooldown=600.0, max_resets=3, window=3600.0),
)


def host(*pids: int, gpus: int = 1, **changes: object) -> HostBuilder:
    builder = HostBuilder()
    for index in range(gpus):
        builder.gpu(index)
    for pid in pids:
        builder.proc(pid, user="bob", holds={0}, uvm=True)
        if changes:
            builder.change(pid, **changes)
    return builder


def orphan(pid: int, *, gpu: str = GPU0, kind: FindingKind = FindingKind.ORPHANED,
           actionable: bool = True) -> Finding:  # fmt: skip
    return Finding(
        kind=kind, gpu=gpu, pid=pid, start_ticks=10_000 + pid * 7, reason="orphaned",
        memory=512 * MIB, actionable=actionable, evidence={"uvm": True},
    )  # fmt: skip


def poll(
    findings: list[Finding], snapshot: Snapshot, state: PlanState, now: float,
    pol: Policy = POLICY,
) -> PlanResult:  # fmt: skip
    return plan(findings, snapshot, state, pol, now=now, wall=WALL + now)


def signals(result: PlanResult) -> list[tuple[int, str, int, bool]]:
    return [
        (i.identity.pid, i.signal, i.step, i.dry_run)
        for i in result.intents
        if isinstance(i, SignalIntent)
    ]


def deliver(result: PlanResult, now: float, outcome: str = "delivered") -> PlanResult:
    """act's outcome for every signal of ``result`` (in order), booked at ``now``."""
    state, intents, events = result.state, [], []
    for intent in result.intents:
        if isinstance(intent, SignalIntent):
            out = record_signal(state, intent, outcome, now=now)
            state = out.state
            intents += list(out.intents)
            events += list(out.events)
    return PlanResult(tuple(intents), tuple(events), state)


def on_action(result: PlanResult) -> list[str]:
    return [
        str(i.facts["outcome"])
        for i in result.intents
        if isinstance(i, HookIntent) and i.hook == "on_action"
    ]


def names(result: PlanResult) -> list[str]:
    return [e.name for e in result.events]


def whys(result: PlanResult, name: str) -> list[str]:
    return [str(e.fields.get("why")) for e in result.events if e.name == name]


def started(*pids: int, pol: Policy = POLICY, at: float = 0.0) -> PlanState:
    """Every pid's SIGTERM delivered at ``at`` (0): their SIGKILLs are due 30 s later."""
    first = poll([orphan(p) for p in pids], host(*pids).build(), PlanState(), at, pol)
    assert [s[:3] for s in signals(first)] == [(p, "SIGTERM", 1) for p in pids]
    return deliver(first, at).state


# --- the target at the moment its SIGKILL is due --------------------------------------------------


@pytest.mark.parametrize(
    ("case", "a_now", "resolved"),
    [
        ("A is not described in this snapshot (unknown: wait)", None, []),
        ("A's start time is unknown (unknown: wait)", "ticks", []),
        ("A's PID now names another process", "reused", ["target gone (PID reused)"]),
        ("A is a zombie", "zombie", ["target exited (zombie)"]),
    ],
)
def test_a_target_in_doubt_gets_nothing_and_the_next_ladder_still_advances(
    case: str, a_now: str | None, resolved: list[str]
) -> None:
    state = started(A, B)
    builder = host(B)
    if a_now == "ticks":
        builder.proc(A, user="bob", start=None, holds={0}, uvm=True)
    elif a_now == "reused":
        builder.proc(A, user="carol", start=99_999, holds={0}, uvm=True)
    elif a_now == "zombie":
        builder.proc(A, user="bob", state="Z", ppid=77)
    # A zombie is no orphan any more (NVML would list it as a zombie, under another key).
    findings = [orphan(B)] if a_now == "zombie" else [orphan(A), orphan(B)]
    result = poll(findings, builder.build(), state, 30.0)
    assert signals(result) == [(B, "SIGKILL", 2, False)], case
    assert whys(result, EventName.ESCALATION_RESOLVED) == resolved, case
    ladder_refusals = [
        e for e in result.events if e.name == EventName.ACTION_REFUSED and e.level == "warning"
    ]
    assert ladder_refusals == [], case  # no step of A's ladder was even considered
    if resolved:
        assert f"{A}@{10_000 + A * 7}" not in result.state.ladders, case
    if a_now == "zombie":
        reap = [e.fields for e in result.events if e.name == EventName.ZOMBIE_NEEDS_REAP]
        assert [(f["pid"], f["parent"]) for f in reap] == [(A, 77)], case
    if not resolved:  # the ladder waits for A to be known again, then goes on
        assert f"{A}@{10_000 + A * 7}" in result.state.ladders, case
        again = poll([orphan(A), orphan(B)], host(A, B).build(), result.state, 31.0)
        assert (A, "SIGKILL", 2, False) in signals(again), case


def test_a_target_missing_from_the_snapshot_with_its_finding_gone_but_stuck_is_kept() -> None:
    """Not described and no longer orphaned, but a stuck finding names it: the ladder stays
    (as stuck), it is not counted as freed."""
    state = started(A)
    stuck = orphan(A, kind=FindingKind.STUCK)
    result = poll([stuck], host().build(), state, 30.0)
    assert signals(result) == []
    assert whys(result, EventName.ESCALATION_RESOLVED) == []
    assert f"{A}@{10_000 + A * 7}" in result.state.ladders
    gone = poll([], host().build(), state, 30.0)
    assert whys(gone, EventName.ESCALATION_RESOLVED) == ["target gone"]
    assert on_action(gone) == ["freed"]


def test_a_finding_that_resolves_when_the_next_step_is_due_stops_the_ladder_there() -> None:
    state = started(A)
    result = poll([], host(A).build(), state, 30.0)
    assert signals(result) == []
    assert whys(result, EventName.ESCALATION_RESOLVED) == ["finding resolved"]
    assert on_action(result) == ["released"]  # the SIGTERM was real: its owner is told
    assert result.state.ladders == {}


def test_a_ladder_never_follows_another_process_or_a_report_only_finding() -> None:
    """A's orphan finding is gone; B's remains, and A is now described by a finding that is not
    actionable: A's ladder stops, it does not take over either."""
    state = started(A, B)
    now_hidden = orphan(A, kind=FindingKind.ABANDONED, actionable=False)
    pol = replace(POLICY, rules=(*POLICY.rules, Rule("abandoned", FindingKind.ABANDONED, LADDER)))
    result = poll([orphan(B), now_hidden], host(A, B).build(), state, 30.0, pol)
    assert signals(result) == [(B, "SIGKILL", 2, False)]
    assert whys(result, EventName.ESCALATION_RESOLVED) == ["finding resolved"]


def test_a_ladder_that_follows_its_target_to_another_finding_is_pending_on_that_finding() -> None:
    state = started(A)
    pol = replace(POLICY, rules=(*POLICY.rules, Rule("abandoned", FindingKind.ABANDONED, LADDER)))
    flipped = orphan(A, kind=FindingKind.ABANDONED)
    result = poll([flipped], host(A).build(), state, 5.0, pol)
    assert pending(result.state, [flipped.key])
    assert not pending(result.state, [orphan(A).key])
    assert signals(poll([flipped], host(A).build(), result.state, 30.0, pol)) == [
        (A, "SIGKILL", 2, False)
    ]


def test_a_target_alive_after_its_last_step_tells_on_action_it_survived() -> None:
    state = started(A)
    kill = deliver(poll([orphan(A)], host(A).build(), state, 30.0), 30.0).state
    result = poll([orphan(A)], host(A).build(), kill, 40.0)
    assert whys(result, EventName.ESCALATION_ENDED) == ["target still alive after the last step"]
    assert on_action(result) == ["survived"]


# --- when the daemon must wake --------------------------------------------------------------------


def test_the_next_deadline_is_the_next_step_and_other_waits_are_kept() -> None:
    pol = replace(POLICY, rules=(Rule("orphans", FindingKind.ORPHANED, LADDER, for_=50.0),))
    first = poll([orphan(A), orphan(B)], host(A, B).build(), PlanState(), 0.0, pol)
    assert next_deadline(first.state) == 50.0  # both confirming
    state = poll([orphan(A), orphan(B)], host(A, B).build(), first.state, 50.0, pol)
    intents = [i for i in state.intents if isinstance(i, SignalIntent)]
    assert next_deadline(state.state) == 80.0
    booked = record_signal(state.state, intents[0], "delivered", now=52.0)
    assert booked.state.waiting == {orphan(A).key: 82.0, orphan(B).key: 80.0}
    waiting = poll([orphan(A), orphan(B)], host(A, B).build(), booked.state, 60.0, pol)
    assert next_deadline(waiting.state) == 80.0


# --- act's outcomes--------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "at_step", "told"),
    [
        ("gone", 1, []),  # gone before anything was sent: nothing to tell
        ("gone", 2, ["freed"]),  # the SIGTERM was sent: it freed the GPU
        ("zombie", 2, ["freed"]),
        ("denied", 1, ["failed"]),
        ("failed", 2, ["failed"]),
        ("reused", 2, []),
    ],
)
def test_acts_outcome_ends_the_ladder_and_tells_on_action_only_what_was_sent(
    outcome: str, at_step: int, told: list[str]
) -> None:
    result = poll([orphan(A)], host(A).build(), PlanState(), 0.0)
    if at_step == 2:
        state = deliver(result, 0.0).state
        result = poll([orphan(A)], host(A).build(), state, 30.0)
    out = deliver(result, 30.0, outcome)
    assert on_action(out) == told
    ended = {
        "gone": EventName.ESCALATION_RESOLVED, "zombie": EventName.ESCALATION_RESOLVED,
        "reused": EventName.ESCALATION_ABORTED, "denied": EventName.ESCALATION_ENDED,
        "failed": EventName.ESCALATION_ENDED,
    }[outcome]  # fmt: skip
    assert whys(out, ended) == [outcome]
    ladder = out.state.ladders.get(f"{A}@{10_000 + A * 7}")
    assert (ladder is None) == (outcome in ("gone", "zombie", "reused"))
    if outcome == "zombie":
        assert EventName.ZOMBIE_NEEDS_REAP in names(out)
    if ladder is not None:  # denied or failed: never retried
        assert signals(poll([orphan(A)], host(A).build(), out.state, 100.0)) == []


def test_a_signal_booked_after_its_ladder_was_dropped_changes_nothing() -> None:
    first = poll([orphan(A)], host(A).build(), PlanState(), 0.0)
    (sigterm,) = [i for i in first.intents if isinstance(i, SignalIntent)]
    exited = record_exit(first.state, sigterm.identity, now=0.1)
    out = record_signal(exited.state, sigterm, "delivered", now=0.2)
    assert out.state == exited.state
    assert [e.fields.get("stale") for e in out.events] == [True]


def test_an_exit_after_a_real_signal_frees_and_tells_on_action() -> None:
    state = started(A, at=5.0)
    out = record_exit(state, orphan(A).identity or pytest.fail("no identity"), now=12.0)
    assert whys(out, EventName.ESCALATION_RESOLVED) == ["target exited"]
    (resolved,) = [e.fields for e in out.events if e.name == EventName.ESCALATION_RESOLVED]
    assert resolved["after"] == 7.0
    assert on_action(out) == ["freed"]
    (hook,) = [i for i in out.intents if isinstance(i, HookIntent)]
    assert hook.facts["user"] == "bob"  # whose process it was, for the owner's notice


# --- rules whose steps only report-----------------------------------------------------------------


def test_a_report_step_before_a_kill_step_sends_nothing_then_the_kill() -> None:
    pol = replace(POLICY, rules=(
        Rule("orphans", FindingKind.ORPHANED, (Step(None, 20.0), Step("SIGKILL", 5.0))),
    ))  # fmt: skip
    first = poll([orphan(A)], host(A).build(), PlanState(), 0.0, pol)
    assert signals(first) == []
    assert next_deadline(first.state) == 20.0
    assert first.state.signal_history == ()  # reporting is no kill: the cap does not count it
    assert signals(poll([orphan(A)], host(A).build(), first.state, 20.0, pol)) == [
        (A, "SIGKILL", 2, False)
    ]
    # Resolved after only reporting: nothing was done, so nobody is told.
    gone = poll([], host(A).build(), first.state, 5.0, pol)
    assert on_action(gone) == []


def test_a_rule_that_only_reports_starts_no_ladder() -> None:
    pol = replace(POLICY, rules=(Rule("orphans", FindingKind.ORPHANED, (Step(None, 20.0),)),))
    result = poll([orphan(A)], host(A).build(), PlanState(), 0.0, pol)
    assert signals(result) == []
    assert names(result).count(EventName.RULE_REPORT_ONLY) == 1
    assert result.state.ladders == {}
    assert not pending(result.state, [orphan(A).key])


# --- dry-run lifted in the middle of a ladder ----------------------------------------------------


def test_a_dry_run_ladder_starts_over_for_real_once_dry_run_is_lifted() -> None:
    dry = replace(POLICY, dry_run=True)
    first = poll([orphan(A)], host(A).build(), PlanState(), 0.0, dry)
    assert signals(first) == [(A, "SIGTERM", 1, True)]
    state = deliver(first, 0.0, "dry_run").state
    result = poll([orphan(A)], host(A).build(), state, 30.0, POLICY)
    # Never the would-be step 2, real or dry: the target starts over from step 1, for real.
    assert signals(result) == [(A, "SIGTERM", 1, False)]
    assert EventName.ESCALATION_RESTARTED in names(result)


# --- the node stops being safe in the middle of a ladder -----------------------------------------


@pytest.mark.parametrize(
    ("case", "change", "why"),
    [
        ("NVML wedged", {"wedged": True}, "NVML is wedged (a call missed its deadline)"),
        ("NVML gone", {"available": False}, "NVML unavailable"),
    ],
)
def test_a_ladder_holds_while_the_node_is_not_safe_to_act_on(
    case: str, change: dict[str, bool], why: str
) -> None:
    state = started(A)
    snapshot = host(A).build()
    snapshot = replace(snapshot, nvml=replace(snapshot.nvml, **change))  # type: ignore[arg-type]
    result = poll([orphan(A)], snapshot, state, 30.0)
    assert signals(result) == [], case
    assert whys(result, EventName.ACTION_REFUSED) == [why], case
    assert signals(poll([orphan(A)], host(A).build(), result.state, 31.0)) == [
        (A, "SIGKILL", 2, False)
    ], case


def test_unavailable_nvml_is_named_in_every_reset_gate_list() -> None:
    snapshot = host().build()
    down = replace(snapshot, nvml=NvmlReading(available=False, gpus=snapshot.nvml.gpus))
    ghost = Finding(FindingKind.GHOST_MEMORY, GPU0, None, None, "ghost", memory=4096 * MIB)
    gates = reset_gates(ghost, down, POLICY, report_only={}, findings=[])
    assert [(g.name, g.why) for g in gates] == [("blocked", "blocked: NVML unavailable")]
