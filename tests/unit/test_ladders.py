"""The kill ladder poll by poll (decide/plan/ladders.py): what a target in an odd state gets at
the moment its next step is due, what act's outcomes do to the ladder, who is told, and when
the daemon must wake next. Each test is a short timeline of ``plan`` and ``record_*`` calls.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gpuwatchd.core.checked import MAX_REASON
from gpuwatchd.core.model import MIB, Finding, FindingKind, NvmlReading, Snapshot, Spare, SubIdRange
from gpuwatchd.core.vocabulary import EventName, LadderStatus, Level, check_ladder_transition
from gpuwatchd.decide.plan.decisions import next_deadline, pending_keys, plan
from gpuwatchd.decide.plan.intents import HookIntent, PlanResult, SignalIntent
from gpuwatchd.decide.plan.outcomes import record_exit, record_signal
from gpuwatchd.decide.plan.resets import reset_gates
from gpuwatchd.decide.plan.state import Latch, PlanState
from gpuwatchd.decide.policy import Limits, Policy, Protect, ResetPolicy, Rule, Step
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


def orphan(pid: int, *, gpu: str | None = GPU0, kind: FindingKind = FindingKind.ORPHANED,
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


@pytest.mark.parametrize("case", ["undecided", "NVML unavailable"])
def test_a_finding_gone_for_a_poll_that_cannot_tell_holds_the_ladder(case: str) -> None:
    """Another GPU's process list unread (or one lost) for a poll turns the orphan into a
    hidden holder the orphan rule could not decide; NVML unavailable leaves no GPU to judge it
    by. Unknown is not resolved: the ladder holds, tells nobody it was released, and goes on
    with its SIGKILL (no second SIGTERM, no new wait) once the orphan is seen again."""
    state = started(A)
    snapshot = host(A).build()
    findings = []
    if case == "undecided":
        findings = [replace(orphan(A, kind=FindingKind.HIDDEN_HOLDER, actionable=False),
                            evidence={"uvm": True, "undecided": True})]  # fmt: skip
    else:
        snapshot = replace(snapshot, nvml=NvmlReading(available=False, error="timed out"))
    flicker = poll(findings, snapshot, state, 10.0)
    assert whys(flicker, EventName.ESCALATION_RESOLVED) == [], case
    assert (signals(flicker), on_action(flicker)) == ([], []), case
    assert f"{A}@{10_000 + A * 7}" in flicker.state.ladders, case
    back = poll([orphan(A)], host(A).build(), flicker.state, 20.0)
    assert signals(back) == [], case  # the SIGTERM's wait still runs
    assert signals(poll([orphan(A)], host(A).build(), back.state, 30.0)) == [
        (A, "SIGKILL", 2, False)
    ], case


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
    assert pending_keys(result.state, [flipped.key])
    assert not pending_keys(result.state, [orphan(A).key])
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
    if outcome == "zombie":  # act saw it turn zombie: its parent is not known there
        reap = [e.fields for e in out.events if e.name == EventName.ZOMBIE_NEEDS_REAP]
        assert [(f["pid"], f["gpu"], f["parent"]) for f in reap] == [(A, GPU0, None)]
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
    assert not pending_keys(result.state, [orphan(A).key])


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


# --- what each end of a ladder says, and to whom ----------------------------------------------


def told(result: PlanResult) -> list[tuple[str, str]]:
    """(outcome, why) of each on_action notice."""
    return [
        (str(i.facts["outcome"]), str(i.facts["why"]))
        for i in result.intents
        if isinstance(i, HookIntent) and i.hook == "on_action"
    ]


def levels(result: PlanResult, name: str) -> list[tuple[str, Level]]:
    return [(str(e.fields.get("why")), e.level) for e in result.events if e.name == name]


def test_the_ends_of_a_ladder_say_why_at_their_level() -> None:
    state = started(A)
    resolved = poll([], host(A).build(), state, 30.0)
    assert levels(resolved, EventName.ESCALATION_RESOLVED) == [("finding resolved", Level.INFO)]
    kill = deliver(poll([orphan(A)], host(A).build(), state, 30.0), 30.0).state
    survived = poll([orphan(A)], host(A).build(), kill, 40.0)
    assert told(survived) == [("survived", "target still alive after the last step")]
    protected = replace(POLICY, protect=Protect(users=("bob",)))
    refused = poll([orphan(A)], host(A).build(), state, 30.0, protected)
    (why,) = whys(refused, EventName.ACTION_REFUSED)
    assert why.startswith("protect: ")
    assert told(refused) == [("failed", f"refused: {why}")]


def test_each_step_names_its_rule_and_finding_and_carries_the_targets_facts() -> None:
    result = poll([orphan(A)], host(A).build(), started(A), 30.0)
    (kill,) = [i for i in result.intents if isinstance(i, SignalIntent)]
    assert (kill.rule, kill.reason) == ("orphans", "rule orphans step 2/2: orphaned")
    assert (kill.facts["user"], kill.facts["uid"]) == ("bob", 1000)


@pytest.mark.parametrize(
    ("case", "stuck_finding", "state_d", "new"),
    [
        ("a stuck finding in the middle of the ladder", True, False, False),
        ("alive in D state after the last step", False, True, False),
        ("stuck before anything was sent", True, False, True),
    ],
)
def test_a_stuck_target_is_reported_with_its_facts(
    case: str, stuck_finding: bool, state_d: bool, new: bool
) -> None:
    findings = [orphan(A, kind=FindingKind.STUCK)] if stuck_finding else [orphan(A)]
    builder = host(A, state="D") if state_d else host(A)
    if new:  # a rule for stuck targets starts no ladder: it reports them
        pol = replace(POLICY, rules=(*POLICY.rules, Rule("stuck", FindingKind.STUCK, LADDER)))
        result = poll(findings, builder.build(), PlanState(), 0.0, pol)
    else:
        state = started(A)
        if state_d:  # the SIGKILL too was sent
            state = deliver(poll([orphan(A)], host(A).build(), state, 30.0), 30.0).state
        result = poll(findings, builder.build(), state, 40.0)
    stuck = [e.fields for e in result.events if e.name == EventName.TARGET_STUCK]
    assert [(f["user"], f["uid"]) for f in stuck] == [("bob", 1000)], case
    (hook,) = [i for i in result.intents if isinstance(i, HookIntent) and i.hook == "on_failure"]
    assert hook.facts["user"] == "bob", case


@pytest.mark.parametrize(
    ("argument", "logged"),
    [
        ("x" * 4089, "python " + "x" * 4089),  # 4096 characters: whole
        ("x" * 4090, "python " + "x" * 4089 + " [... 1 characters cut]"),
        ("x" * 100_000, "python " + "x" * 4089 + " [... 95911 characters cut]"),
    ],
)
def test_a_targets_command_line_is_logged_cut_to_what_a_pattern_sees(
    argument: str, logged: str
) -> None:
    """A user's arguments may be megabytes: every event and intent carries the command line's
    first 4096 characters and how many were cut (EventName.TARGET_STUCK, ACTION_SIGNAL's
    facts, ESCALATION_ENDED)."""
    kill = poll([orphan(A)], host(A, cmdline=("python", argument)).build(), started(A), 30.0)
    (intent,) = [i for i in kill.intents if isinstance(i, SignalIntent)]
    assert intent.facts["cmdline"] == logged
    stuck = poll(
        [orphan(A, kind=FindingKind.STUCK)],
        host(A, state="D", cmdline=("python", argument)).build(),
        started(A),
        40.0,
    )
    assert [e.fields["cmdline"] for e in stuck.events if e.name == EventName.TARGET_STUCK] == [
        logged
    ]


# --- zombies ------------------------------------------------------------------------------------


def zombie(pid: int, evidence: dict[str, object]) -> Finding:
    return replace(orphan(pid, kind=FindingKind.ZOMBIE), evidence=evidence)


@pytest.mark.parametrize(
    ("case", "finding", "listed", "reap"),
    [
        ("the finding's parent wins", zombie(A, {"ppid": 55}), True, (A, GPU0, 55)),
        ("else the process's parent", zombie(A, {}), True, (A, GPU0, 77)),
        ("no process, no parent", zombie(A, {}), False, (A, GPU0, None)),
        ("a parent that is no PID", zombie(A, {"ppid": "77"}), True, (A, GPU0, None)),
        ("an orphan that became a zombie", orphan(A, gpu=GPU1), True, (A, GPU1, 77)),
        ("PID 0 is told as it is", zombie(0, {"ppid": 55}), False, (0, GPU0, 55)),
    ],
)
def test_a_zombie_is_reported_once_with_its_parent_to_reap_it(
    case: str, finding: Finding, listed: bool, reap: tuple[int, str, int | None]
) -> None:
    builder = host(gpus=2)
    if listed:
        builder.proc(A, user="bob", state="Z", ppid=77)
    first = poll([finding], builder.build(), PlanState(), 0.0)
    again = poll([finding], builder.build(), first.state, 1.0)
    both = (*first.events, *again.events)
    events = [e.fields for e in both if e.name == EventName.ZOMBIE_NEEDS_REAP]
    assert [(f["pid"], f["gpu"], f["parent"]) for f in events] == [reap], case
    assert signals(first) == signals(again) == [], case


def test_a_ladder_whose_target_turns_zombie_always_says_so_even_if_said_before() -> None:
    """A's start time was unreadable when it turned zombie (its ladder waited; the finding's
    reap notice was said); once known, its ladder ends and says it again, with its GPU."""
    state = started(A)
    unknown = host().proc(A, user="bob", state="Z", ppid=77, start=None)
    first = poll([orphan(A)], unknown.build(), state, 30.0)
    assert names(first).count(EventName.ZOMBIE_NEEDS_REAP) == 1
    known = host().proc(A, user="bob", state="Z", ppid=77)
    ended = poll([orphan(A)], known.build(), first.state, 31.0)
    assert whys(ended, EventName.ESCALATION_RESOLVED) == ["target exited (zombie)"]
    reap = [e.fields for e in ended.events if e.name == EventName.ZOMBIE_NEEDS_REAP]
    assert [(f["pid"], f["gpu"], f["parent"]) for f in reap] == [(A, GPU0, 77)]


# --- which finding a ladder follows -------------------------------------------------------------

C = 3000  # a third target

ABANDONED = orphan(A, kind=FindingKind.ABANDONED)


def abandoned_rule(*users: str) -> Rule:
    return Rule("abandoned", FindingKind.ABANDONED, LADDER, users=users)


@pytest.mark.parametrize(
    ("case", "findings", "rules", "follows"),
    [
        ("its own finding, though another sorts first", [orphan(A), ABANDONED],
         (abandoned_rule(),), orphan(A).key),
        ("another finding a rule for its user selects", [ABANDONED], (abandoned_rule("bob"),),
         ABANDONED.key),
        ("another finding no rule selects", [ABANDONED], (), None),
        ("another finding only another user's rule selects", [ABANDONED],
         (abandoned_rule("alice"),), None),
    ],
)  # fmt: skip
def test_a_ladder_follows_its_own_finding_else_one_a_rule_selects_for_its_target(
    case: str, findings: list[Finding], rules: tuple[Rule, ...], follows: str | None
) -> None:
    pol = replace(POLICY, rules=(*POLICY.rules, *rules))
    result = poll(findings, host(A).build(), started(A), 30.0, pol)
    keys = [i.finding_key for i in result.intents if isinstance(i, SignalIntent)]
    assert keys == ([] if follows is None else [follows]), case
    resolved = whys(result, EventName.ESCALATION_RESOLVED)
    assert resolved == ([] if follows else ["finding resolved"]), case


# --- what holds a ladder ------------------------------------------------------------------------

SPARED = f"pid {A} (start ticks {10_000 + A * 7}) is spared (debugging)"


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("paused", "paused"),
        ("paused: maintenance", "paused (maintenance)"),
        ("dry_run", "dry_run"),
        ("pid spare", f"spare: {SPARED}"),
        ("job spare", "spare: job slurm:42 is spared (debugging); this process's job is unknown"),
        ("job spare, its step's tree", "spare: job slurm:42 is spared (debugging)"),
        # Before, only a new ladder checked these: a started one went on to SIGKILL.
        ("report-only finding", "not_actionable: the assessment is report-only"),
        ("report-only GPU", "report_only: its process list could not be read"),
    ],
)
def test_a_held_ladder_says_what_holds_it(case: str, why: str) -> None:
    state, pol, builder = started(A), POLICY, host(A)
    finding = orphan(A, actionable=case != "report-only finding")
    report_only = {GPU0: why.partition(": ")[2]} if case == "report-only GPU" else {}
    spares: tuple[Spare, ...] = ()
    if case.startswith("paused"):
        state = replace(state, paused=True, paused_reason=case.partition(": ")[2] or None)
    elif case == "dry_run":  # dry-run by the policy, not by a kill cap
        pol = replace(POLICY, dry_run=True)
    elif case == "pid spare":
        spares = (Spare(f"pid:{A}", WALL + 99.0, "debugging", pid=A, start_ticks=10_000 + A * 7),)
    elif case.startswith("job spare"):  # A's cgroup is unknown, or A runs under its slurmstepd
        spares = (Spare("job:slurm:42", WALL + 99.0, "debugging", job="slurm:42"),)
        if case == "job spare":
            builder.change(A, cgroup=None)
        else:
            builder.proc(500, ppid=1, start=100, user="root", uid=0, exe="/usr/sbin/slurmstepd",
                         cmdline=("slurmstepd: [42.0]",))  # fmt: skip
            builder.change(A, ppid=500)
    snapshot = replace(builder.build(), spares=spares)
    result = plan([finding], snapshot, state, pol, now=30.0, wall=WALL + 30.0,
                  report_only=report_only)  # fmt: skip
    assert signals(result) == [], case
    # Held (said at info), not refused: the ladder goes on when the spare ends.
    assert levels(result, EventName.ACTION_REFUSED) == [(why, Level.INFO)], case
    assert told(result) == [], case


@pytest.mark.parametrize(
    ("case", "finding", "wedged", "refused"),
    [
        ("report-only", orphan(A, actionable=False), False,
         ("not_actionable: the assessment is report-only", Level.INFO)),
        ("NVML wedged", orphan(A), True,
         ("blocked: NVML is wedged (a call missed its deadline)", Level.WARNING)),
    ],
)  # fmt: skip
def test_a_ladder_that_may_not_start_says_why_at_its_level(
    case: str, finding: Finding, wedged: bool, refused: tuple[str, Level]
) -> None:
    snapshot = host(A).build()
    snapshot = replace(snapshot, nvml=replace(snapshot.nvml, wedged=wedged))
    result = poll([finding], snapshot, PlanState(), 0.0)
    assert levels(result, EventName.ACTION_REFUSED) == [refused], case


@pytest.mark.parametrize(
    ("case", "name"),
    [
        ("confirming", EventName.ESCALATION_CONFIRMING),
        ("report-only", EventName.RULE_REPORT_ONLY),
        ("quiet", EventName.ACTION_DEFERRED),
    ],
)
def test_what_a_finding_waits_for_is_said_once(case: str, name: str) -> None:
    state, pol = PlanState(), POLICY
    if case == "confirming":
        pol = replace(POLICY, rules=(Rule("orphans", FindingKind.ORPHANED, LADDER, for_=50.0),))
    elif case == "report-only":
        pol = replace(POLICY, rules=(Rule("orphans", FindingKind.ORPHANED, (Step(None, 9.0),)),))
    else:
        state = PlanState(quiet_until={GPU0: 100.0})
    first = poll([orphan(A)], host(A).build(), state, 0.0, pol)
    again = poll([orphan(A)], host(A).build(), first.state, 1.0, pol)
    assert (names(first).count(name), names(again).count(name)) == (1, 0), case
    assert signals(first) == signals(again) == [], case


# --- a GPU's quiet time after a signal ----------------------------------------------------------


def test_a_signal_makes_its_gpu_quiet_for_post_action_delay_and_never_shortens_it() -> None:
    first = poll([orphan(A)], host(A, B).build(), PlanState(), 0.0)
    assert first.state.quiet_until == {GPU0: 0.0}  # post_action_delay is 0 here
    second = poll([orphan(A), orphan(B)], host(A, B).build(), deliver(first, 0.0).state, 0.5)
    assert signals(second) == [(B, "SIGTERM", 1, False)]
    quiet = replace(deliver(second, 0.5).state, quiet_until={GPU0: 500.0})  # e.g. after a reset
    kill = poll([orphan(A), orphan(B)], host(A, B).build(), quiet, 30.0)
    assert signals(kill) == [(A, "SIGKILL", 2, False)]
    assert kill.state.quiet_until == {GPU0: 500.0}
    later = poll([orphan(A), orphan(B), orphan(C)], host(A, B, C).build(), kill.state, 100.0)
    deferred = [e.fields for e in later.events if e.name == EventName.ACTION_DEFERRED]
    assert [(f["pid"], f["until"]) for f in deferred] == [(C, 500.0)]


def test_a_signal_about_no_gpu_makes_no_gpu_quiet() -> None:
    result = poll([orphan(A, gpu=None)], host(A).build(), PlanState(), 0.0)
    assert signals(result) == [(A, "SIGTERM", 1, False)]
    assert result.state.quiet_until == {}


# --- the kill caps ------------------------------------------------------------------------------


def test_a_users_hourly_cap_counts_only_that_users_targets() -> None:
    pol = replace(POLICY, limits=replace(POLICY.limits, max_signalled_per_hour=1))
    state = started(A, pol=pol)
    builder = host(A).proc(B, user="carol", uid=2000, holds={0}, uvm=True)
    builder.proc(C, user="bob", holds={0}, uvm=True)
    result = poll([orphan(A), orphan(B), orphan(C)], builder.build(), state, 5.0, pol)
    assert signals(result) == [(B, "SIGTERM", 1, False), (C, "SIGTERM", 1, True)]


def test_the_node_latch_says_why_when_it_lifts_and_leaves_nothing_behind() -> None:
    limits = replace(POLICY.limits, node_max_signalled_per_hour=1, kill_cap_latch=600.0)
    pol = replace(POLICY, limits=limits)
    state = started(A, pol=pol)
    capped = poll([orphan(A), orphan(B)], host(A, B).build(), state, 5.0, pol)
    assert signals(capped) == [(B, "SIGTERM", 1, True)]
    over = "more than 1 processes in one hour on the node"
    assert (capped.state.forced_dry_run, capped.state.forced_reason) == (True, over)
    lifted = poll([], host().build(), capped.state, 700.0, pol)
    assert whys(lifted, EventName.LIMITS_KILL_CAP_EXPIRED) == [over]
    latch = lifted.state
    assert (latch.forced_dry_run, latch.forced_reason, latch.forced_since) == (False, None, None)
    assert latch.forced_since_monotonic is None


def test_real_ladders_book_nothing_in_dry_runs_shadow() -> None:
    """Enforcement's own caps count real ladders; a dry run's would-be caps (the shadow) only
    what a policy's dry run would have done, never a real step or a ladder a real cap forced
    to a dry run."""
    kill = poll([orphan(A)], host(A).build(), started(A), 30.0)
    assert signals(kill) == [(A, "SIGKILL", 2, False)]
    assert kill.state.shadow == PlanState().shadow
    pol = replace(POLICY, limits=replace(POLICY.limits, max_signalled_per_poll=0))
    capped = poll([orphan(A), orphan(B)], host(A, B).build(), PlanState(), 0.0, pol)
    assert signals(capped) == [(A, "SIGTERM", 1, True), (B, "SIGTERM", 1, True)]
    assert levels(capped, EventName.LIMITS_KILL_CAP_REACHED) == [
        ("more than 0 processes of uid:1000 in one poll", Level.CRITICAL)
    ]
    assert capped.state.shadow == PlanState().shadow


def test_a_first_signal_after_report_only_steps_passes_the_kill_cap_no_more() -> None:
    """Caps are checked where a target is counted, at its first real signal: ladders that
    started with a report-only step all pass the start, and the cap stops them at the kill."""
    pol = replace(POLICY, rules=(
        Rule("orphans", FindingKind.ORPHANED, (Step(None, 30.0), Step("SIGKILL", 10.0))),
    ), limits=Limits(max_signalled_per_poll=2, max_signalled_per_hour=2,
                     node_max_signalled_per_hour=2, post_action_delay=0.0))  # fmt: skip
    pids = list(range(A, A + 10))
    snapshot, findings = host(*pids).build(), [orphan(p) for p in pids]
    first = poll(findings, snapshot, PlanState(), 0.0, pol)
    assert signals(first) == []
    assert len(first.state.ladders) == 10
    due = poll(findings, snapshot, first.state, 30.0, pol)
    assert signals(due) == [(A, "SIGKILL", 2, False), (A + 1, "SIGKILL", 2, False)]
    over = "more than 2 processes in one hour on the node"
    assert levels(due, EventName.LIMITS_KILL_CAP_REACHED) == [(over, Level.CRITICAL)]
    assert due.state.forced_dry_run
    held = poll(findings, snapshot, deliver(due, 30.0).state, 31.0, pol)
    assert signals(held) == []
    assert whys(due, EventName.ACTION_REFUSED) == ["dry_run (kill cap engaged)"] * 8
    assert whys(held, EventName.ACTION_REFUSED) == []  # said once
    # A user's cap alone: the ladder that would pass it holds, and only that user's latch.
    pol = replace(pol, limits=replace(pol.limits, node_max_signalled_per_hour=32))
    first = poll(findings, snapshot, PlanState(), 0.0, pol)
    due = poll(findings, snapshot, first.state, 30.0, pol)
    assert len(signals(due)) == 2
    assert not due.state.forced_dry_run
    assert set(due.state.scope_latches) == {"uid:1000"}


def test_a_rootless_containers_process_counts_against_its_owners_kill_cap() -> None:
    """uid 100005 is in mallory's sub-uid range: her latch and her would-be cap are its."""
    p, q = 4000, 4001
    builder = host()
    for pid, uid in ((p, 100_005), (q, 100_006)):
        builder.proc(pid, user=None, uid=uid, holds={0}, uvm=True)
    ranges = (SubIdRange(100_000, 65_536, "mallory", 1001),)
    snapshot = replace(builder.build(), subuid_ranges=ranges)
    latches = {"uid:1001": Latch("storm", WALL, 0.0)}
    new = poll([orphan(p)], snapshot, PlanState(scope_latches=latches), 0.0)
    assert signals(new) == [(p, "SIGTERM", 1, True)]
    real = deliver(poll([orphan(p)], snapshot, PlanState(), 0.0), 0.0).state
    held = poll([orphan(p)], snapshot, replace(real, scope_latches=latches), 30.0)
    assert levels(held, EventName.ACTION_REFUSED) == [("dry_run (kill cap engaged)", Level.INFO)]
    dry = replace(POLICY, dry_run=True, limits=replace(POLICY.limits, max_signalled_per_hour=1))
    first = deliver(poll([orphan(p)], snapshot, PlanState(), 0.0, dry), 0.0, "dry_run").state
    second = poll([orphan(p), orphan(q)], snapshot, first, 1.0, dry)
    assert levels(second, EventName.LIMITS_KILL_CAP_REACHED) == [
        ("more than 1 processes of uid:1001 in one hour", Level.WARNING)
    ]


def test_a_latch_without_a_start_counts_from_now_on_the_monotonic_clock() -> None:
    """A node latch from an older state file (no start): it is anchored when first seen, so a
    wall clock that jumps ahead does not lift it early."""
    pol = replace(POLICY, limits=replace(POLICY.limits, kill_cap_latch=600.0))
    old = PlanState(forced_dry_run=True, forced_reason="storm")
    first = plan([], host().build(), old, pol, now=0.0, wall=WALL)
    jumped = plan([], host().build(), first.state, pol, now=10.0, wall=WALL + 10_000.0)
    assert whys(jumped, EventName.LIMITS_KILL_CAP_EXPIRED) == []
    assert jumped.state.forced_dry_run
    lifted = plan([], host().build(), jumped.state, pol, now=600.0, wall=WALL + 10_590.0)
    assert whys(lifted, EventName.LIMITS_KILL_CAP_EXPIRED) == ["storm"]


@pytest.mark.parametrize("since", [None, WALL], ids=["no-start", "no-anchor"])
def test_an_older_latch_once_anchored_holds_through_a_step_too_small_to_rebase(
    since: float | None,
) -> None:
    """Latches from older state files (no start, or a wall start with no monotonic anchor)
    are anchored on the monotonic clock at the first poll: a later forward step of the wall
    clock under the plan's rebase threshold (under a minute) does not lift them early."""
    pol = replace(POLICY, limits=replace(POLICY.limits, kill_cap_latch=600.0))
    latches = {} if since is None else {"uid:1000": Latch("storm", since)}
    old = PlanState(
        forced_dry_run=True, forced_reason="storm", forced_since=since, scope_latches=latches
    )
    first = plan([], host().build(), old, pol, now=0.0, wall=WALL)
    stepped = plan([], host().build(), first.state, pol, now=500.0, wall=WALL + 550.0)
    late = plan([], host().build(), stepped.state, pol, now=560.0, wall=WALL + 610.0)
    assert whys(late, EventName.LIMITS_KILL_CAP_EXPIRED) == []
    assert late.state.forced_dry_run
    assert set(late.state.scope_latches) == set(old.scope_latches)
    lifted = plan([], host().build(), late.state, pol, now=600.0, wall=WALL + 650.0)
    assert whys(lifted, EventName.LIMITS_KILL_CAP_EXPIRED) == ["storm"] * (
        1 + len(old.scope_latches)
    )


def test_a_saved_latch_reason_of_any_size_is_said_cut_when_the_latch_lifts() -> None:
    """A state file is read after a crash, an older version or a disk error: the 100,000
    characters of a latch's reason were said whole as ``why`` when it lifted."""
    pol = replace(POLICY, limits=replace(POLICY.limits, kill_cap_latch=600.0))
    huge = "storm " + "x" * 100_000
    saved = replace(started(A, pol=pol), forced_dry_run=True, forced_reason=huge,
                    forced_since=WALL, forced_since_monotonic=0.0,
                    scope_latches={"uid:1000": Latch(huge, WALL, 0.0)})  # fmt: skip
    state = PlanState.from_json(json.loads(json.dumps(saved.to_json())))
    assert state.ladders == saved.ladders  # the rest of the state is read with it
    lifted = poll([], host().build(), state, 700.0, pol)
    assert whys(lifted, EventName.LIMITS_KILL_CAP_EXPIRED) == [huge[:MAX_REASON]] * 2


def test_only_an_active_ladder_moves_and_an_unknown_status_is_refused() -> None:
    """A terminal ladder stays as it is while its process lives (never signalled again)."""
    assert [check_ladder_transition("active", s) for s in LadderStatus] == list(LadderStatus)
    for old in ("ended", "stuck", "failed"):
        for new in LadderStatus:
            with pytest.raises(ValueError, match=f"^ladder cannot go from {old} to {new}$"):
                check_ladder_transition(old, new)
    for source, target in (("active", "gone"), ("gone", "active")):
        with pytest.raises(ValueError, match="'gone' is not a valid LadderStatus"):
            check_ladder_transition(source, target)
