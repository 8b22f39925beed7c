"""The escalation state machine, one behaviour per test: matching, the floor, ladders, caps,
pause, dry-run, resets and persistence. Everything here is pure: time is passed in."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwatchd.core.checked import MAX_REASON, MAX_STRING
from gpuwatchd.core.model import (
    MIB,
    CgroupInfo,
    DeviceHolding,
    Finding,
    FindingKind,
    GpuInfo,
    GpuMemory,
    ProcessIdentity,
    ProcessInfo,
    Snapshot,
    SubIdRange,
)
from gpuwatchd.core.vocabulary import EventName, LadderStatus
from gpuwatchd.decide.plan.decisions import (
    another_boots,
    clear_circuit,
    clear_forced_dry_run,
    forget_reset_refusals,
    hidden_holders,
    next_deadline,
    pending_keys,
    plan,
    set_paused,
)
from gpuwatchd.decide.plan.intents import HookIntent, PlanResult, ResetIntent, kill_cap_scope
from gpuwatchd.decide.plan.outcomes import record_exit, record_reset, record_signal
from gpuwatchd.decide.plan.shadow import MAX_ENTRIES, DryShadow
from gpuwatchd.decide.plan.state import (
    HealthWait,
    Ladder,
    Latch,
    MigUnfinished,
    PlanState,
    ResetInFlight,
    ResetRefusal,
    SeenFinding,
)
from gpuwatchd.decide.policy import SIGNAL_NAMES, Limits, Policy, Protect, ResetPolicy, Rule, Step
from gpuwatchd.decide.targets import refusal, rule_for
from tests.support.plancases import (
    BUS0,
    GPU0,
    GPU1,
    LADDER,
    ghost,
    gpu,
    orphan,
    policy,
    proc,
    signals,
    snap,
)

# --- builders ---------------------------------------------------------------------------------


def resets(result: PlanResult) -> list[ResetIntent]:
    return [i for i in result.intents if isinstance(i, ResetIntent)]


def hooks(result: PlanResult) -> list[HookIntent]:
    return [i for i in result.intents if isinstance(i, HookIntent)]


def names(result: PlanResult) -> list[str]:
    return [e.name for e in result.events]


def event(result: PlanResult, name: str) -> Mapping[str, object]:
    found = [e for e in result.events if e.name == name]
    assert found, f"no {name} in {names(result)}"
    return found[0].fields


# --- rule_for ---------------------------------------------------------------------------------

SLURM = CgroupInfo(
    path="/system.slice/slurmstepd.scope/job_77/step_0", slurm_job="77", systemd_unit=None
)
UNIT = CgroupInfo(path="/system.slice/trainer.service", systemd_unit="trainer.service")


def _rule(kind: FindingKind = FindingKind.ORPHANED, **kw: Any) -> Rule:
    return Rule("r", kind, LADDER, **kw)


@pytest.mark.parametrize(
    ("rule", "process", "memory", "lasted", "matches"),
    [
        (_rule(), proc(), 1, 0.0, True),
        (_rule(FindingKind.ABANDONED), proc(), 1, 0.0, False),
        (_rule(for_=30), proc(), 1, 29.9, False),
        (_rule(for_=30), proc(), 1, 30.0, True),
        (_rule(min_memory=100), proc(), 100, 0.0, True),
        (_rule(min_memory=100), proc(), 99, 0.0, False),
        (_rule(min_memory=100), proc(), None, 0.0, False),
        (_rule(users=("b*",)), proc(), 1, 0.0, True),
        (_rule(users=("alice",)), proc(), 1, 0.0, False),
        (_rule(users=("*",)), proc(user=None), 1, 0.0, False),
        (_rule(users=("*",)), None, 1, 0.0, False),
        (_rule(commands=(re.compile(r"train\.py"),)), proc(), 1, 0.0, True),
        (_rule(commands=(re.compile(r"^python3 train"),)), proc(), 1, 0.0, True),
        (_rule(commands=(re.compile("serve"),)), proc(), 1, 0.0, False),
        (_rule(commands=(re.compile(".*"),)), proc(cmdline=None), 1, 0.0, False),
        (_rule(cgroups=("/system.slice/*",)), proc(cgroup=UNIT), 1, 0.0, True),
        (_rule(cgroups=("/kubepods/*",)), proc(cgroup=UNIT), 1, 0.0, False),
        (_rule(units=("trainer.*",)), proc(cgroup=UNIT), 1, 0.0, True),
        (_rule(units=("*",)), proc(cgroup=SLURM), 1, 0.0, False),
        (_rule(jobs=("slurm:7*",)), proc(cgroup=SLURM), 1, 0.0, True),
        (_rule(jobs=("*",)), proc(), 1, 0.0, False),  # a login session scope names no job
    ],
)
def test_rule_for_filters_and_unknown_values_never_match(
    rule: Rule, process: ProcessInfo | None, memory: int | None, lasted: float, matches: bool
) -> None:
    p = proc()
    finding = orphan(p, memory=memory)
    found = rule_for(finding, process, policy(rules=[rule]), lasted=lasted)
    assert (found is rule) is matches


def test_rule_for_picks_the_first_matching_rule_in_order() -> None:
    first = Rule("only-alice", FindingKind.ORPHANED, LADDER, users=("alice",))
    second = Rule("everyone", FindingKind.ORPHANED, LADDER)
    assert rule_for(orphan(proc()), proc(), policy(rules=[first, second]), lasted=0) is second


# --- refusal: floor, protect, identity --------------------------------------------------------


ROOT: dict[str, Any] = {"uid": 0, "exe_trusted": True}


def _refused(p: ProcessInfo | None, **kw: object) -> str | None:
    target = p if p is not None else proc()
    finding = orphan(target)
    s = snap([target] if p is not None else [])
    ancestors = frozenset({77})
    protect = kw.get("protect")
    pol = policy(protect=protect if isinstance(protect, Protect) else None)
    return refusal(p, finding, s, pol, ancestors)


@pytest.mark.parametrize(
    ("process", "expected"),
    [
        (proc(1), "floor: pid 1"),
        (proc(2), "floor: pid 2"),
        (proc(3, kernel_thread=True, cmdline=()), "floor: kernel thread"),
        (proc(4242), "floor: the daemon itself"),
        (proc(77), "floor: an ancestor"),
        (proc(comm="nvidia-persiste", cmdline=None, **ROOT), "floor: infrastructure process"),
        (proc(comm="x", exe="/usr/bin/nv-hostengine", **ROOT), "floor: infrastructure process"),
        (proc(comm="x", cmdline=("/usr/bin/dcgm-exporter",), **ROOT), "floor: infrastructure"),
        (proc(comm="nvidia-smi", **ROOT), "floor: infrastructure process nvidia-smi"),
        (proc(comm="Xorg", **ROOT), "floor: infrastructure process Xorg"),
        # A user's look-alikes are ordinary targets; an unreadable identity is never signalled.
        (proc(comm="nvidia-smi", exe_trusted=False), None),
        (proc(comm="x", exe="/home/bob/nv-hostengine", exe_trusted=False), None),
        (proc(comm="Xorg", uid=None), "floor: goes by 'Xorg'"),
        (proc(comm="Xorg", uid=0), "floor: goes by 'Xorg'"),
        (
            proc(
                uid=0,
                cgroup=CgroupInfo(
                    "/system.slice/nvidia-persistenced.service",
                    systemd_unit="nvidia-persistenced.service",
                    delegated=False,
                ),
            ),
            "floor: infrastructure unit",
        ),
        (
            proc(uid=0, cgroup=CgroupInfo("/system.slice/nvsm-core.service", delegated=False)),
            "floor: infrastructure unit",
        ),
        (None, "identity: process not in the snapshot"),
        (proc(ticks=None), "identity: start time unknown"),
        (proc(), None),
    ],
)
def test_refusal_floor_no_configuration_can_lower(
    process: ProcessInfo | None, expected: str | None
) -> None:
    why = _refused(process)
    if expected is None:
        assert why is None
    else:
        assert why is not None
        assert why.startswith(expected)


@pytest.mark.parametrize(
    ("uvm_evidence", "holding_uvm", "refused"),
    [
        (True, True, False),
        (False, True, True),  # the assessment says it is an NVML-only client
        (None, False, True),  # the scan says it does not hold nvidia-uvm
        (None, None, True),  # nobody knows: unknown never leads to a signal
        (True, None, False),
    ],
)
def test_refusal_nvml_only_clients_are_floor(
    uvm_evidence: bool | None, holding_uvm: bool | None, refused: bool
) -> None:
    p = proc()
    evidence = {} if uvm_evidence is None else {"uvm": uvm_evidence}
    finding = orphan(p, evidence=evidence)
    holders = {} if holding_uvm is None else {p.pid: DeviceHolding(p.pid, uvm=holding_uvm)}
    why = refusal(p, finding, snap([p], holders=holders), policy(), frozenset())
    assert (why is not None and why.startswith("floor: ")) is refused


@pytest.mark.parametrize(
    ("protect", "process", "expected"),
    [
        (Protect(users=("bo*",)), proc(), "protect: user bob"),
        (Protect(users=("alice",)), proc(), None),
        (Protect(users=("alice",)), proc(user=None), "protect: user unknown"),
        (Protect(commands=(re.compile("train"),)), proc(), "protect: command matches"),
        (Protect(commands=(re.compile("serve"),)), proc(), None),
        (Protect(commands=(re.compile("x"),)), proc(cmdline=None), "protect: command line"),
        (Protect(units=("trainer.*",)), proc(cgroup=UNIT), "protect: unit trainer.service"),
        (Protect(units=("other.*",)), proc(cgroup=UNIT), None),
        (Protect(cgroups=("/system.slice/*",)), proc(cgroup=UNIT), "protect: cgroup"),
        (Protect(gpus=(GPU0,)), proc(), "protect: GPU"),
        (Protect(gpus=(GPU0.lower(),)), proc(), "protect: GPU"),
        (Protect(gpus=("0000:3b:00.0",)), proc(), "protect: GPU"),  # bus id, other spelling
        (Protect(gpus=(GPU1,)), proc(), None),
    ],
)
def test_refusal_protect_overrides_rules(
    protect: Protect, process: ProcessInfo, expected: str | None
) -> None:
    why = _refused(process, protect=protect)
    if expected is None:
        assert why is None
    else:
        assert why is not None
        assert why.startswith(expected)


def test_refusal_protect_unknown_cgroup_refuses() -> None:
    p = replace(proc(), cgroup=None)
    why = refusal(p, orphan(p), snap([p]), policy(protect=Protect(units=("x",))), frozenset())
    assert why == "protect: cgroup unknown"


def test_refusal_floor_comes_before_protect() -> None:
    why = _refused(proc(1), protect=Protect(users=("*",)))
    assert why is not None
    assert why.startswith("floor:")


def test_refusal_pid_reused_between_finding_and_snapshot() -> None:
    old = proc(ticks=500)
    new = proc(ticks=900)
    why = refusal(new, orphan(old), snap([new]), policy(), frozenset())
    assert why == "identity: the PID now belongs to another process"


# --- ladders ----------------------------------------------------------------------------------


WALL = 1_700_000_000.0  # run()'s wall clock at now=0


def run(
    findings: Sequence[Finding],
    s: Snapshot,
    state: PlanState,
    pol: Policy,
    *,
    now: float,
    wall: float | None = None,
    **kw: object,
) -> PlanResult:
    report_only = kw.get("report_only")
    return plan(
        findings,
        s,
        state,
        pol,
        now=now,
        wall=WALL + now if wall is None else wall,
        report_only=report_only if isinstance(report_only, dict) else None,
    )


def test_ladder_sigterm_then_sigkill_exactly_at_delivered_plus_wait_then_ended() -> None:
    p = proc()
    f = orphan(p)
    pol = policy()
    s = snap([p])
    r = run([f], s, PlanState(), pol, now=100.0)
    (term,) = signals(r)
    assert (term.signal, term.step, term.dry_run) == ("SIGTERM", 1, False)
    assert term.identity == ProcessIdentity(p.pid, 500)
    assert term.facts["user"] == "bob"
    assert term.facts["cmdline"] == "python3 train.py"
    delivered = record_signal(r.state, term, "delivered", now=100.5).state
    assert next_deadline(delivered) == 130.5
    assert pending_keys(delivered, [f.key])
    r = run([f], s, delivered, pol, now=130.4)
    assert signals(r) == []
    r = run([f], s, r.state, pol, now=130.5)
    (kill,) = signals(r)
    assert (kill.signal, kill.step) == ("SIGKILL", 2)
    state = record_signal(r.state, kill, "delivered", now=130.5).state
    r = run([f], s, state, pol, now=140.4)
    assert signals(r) == []
    r = run([f], s, r.state, pol, now=140.5)
    assert signals(r) == []
    assert event(r, EventName.ESCALATION_ENDED)["rule"] == "orphans"
    assert [e.level for e in r.events if e.name == EventName.ESCALATION_ENDED] == ["error"]
    assert not pending_keys(r.state, [f.key])
    # Ended means ended: no more signals to that identity, however long it lives.
    for later in (200.0, 1000.0, 5000.0):
        r = run([f], s, r.state, pol, now=later)
        assert signals(r) == []


def first_poll(
    pol: Policy | None = None, *, now: float = 0.0
) -> tuple[ProcessInfo, Finding, Policy, PlanResult]:
    """The default process, its orphan finding, the policy (the default one unless given) and
    the first plan, at ``now``."""
    p = proc()
    f = orphan(p)
    pol = pol if pol is not None else policy()
    return p, f, pol, run([f], snap([p]), PlanState(), pol, now=now)


def test_exit_after_sigterm_resolves_without_sigkill() -> None:
    _p, f, pol, r = first_poll()
    (term,) = signals(r)
    state = record_signal(r.state, term, "delivered", now=0.0).state
    done = record_exit(state, term.identity, now=0.2)
    assert names(done) == [EventName.ESCALATION_RESOLVED]
    assert not pending_keys(done.state, [f.key])
    r = run([], snap([]), done.state, pol, now=30.0)
    assert signals(r) == []
    assert EventName.FINDING_RESOLVED in names(r)


def test_finding_that_goes_away_stops_the_ladder() -> None:
    p, _f, pol, r = first_poll()
    state = record_signal(r.state, signals(r)[0], "delivered", now=0.0).state
    r = run([], snap([p]), state, pol, now=5.0)
    assert event(r, EventName.ESCALATION_RESOLVED)["why"] == "finding resolved"
    r = run([], snap([p]), r.state, pol, now=31.0)
    assert signals(r) == []


def test_target_disappearing_resolves_the_ladder() -> None:
    _p, _f, pol, r = first_poll()
    state = record_signal(r.state, signals(r)[0], "delivered", now=0.0).state
    r = run([], snap([]), state, pol, now=31.0)
    assert event(r, EventName.ESCALATION_RESOLVED)["why"] == "target gone"
    assert signals(r) == []


def test_pid_reuse_never_receives_the_old_ladders_next_step() -> None:
    old = proc(pid=1000, ticks=500)
    f_old = orphan(old)
    pol = policy()
    r = run([f_old], snap([old]), PlanState(), pol, now=0.0)
    state = record_signal(r.state, signals(r)[0], "delivered", now=0.0).state
    # The target exits; an unrelated process takes PID 1000 and even looks like an orphan.
    new = proc(pid=1000, ticks=9000)
    r = run([orphan(new)], snap([new]), state, pol, now=31.0)
    assert event(r, EventName.ESCALATION_RESOLVED)["why"] == "target gone (PID reused)"
    sigs = signals(r)
    # The newcomer gets its own ladder from step 1 (its own finding), never the old SIGKILL.
    assert all(s.identity == ProcessIdentity(1000, 9000) and s.step == 1 for s in sigs)


def test_pid_reuse_reported_by_act_aborts_the_ladder() -> None:
    p = proc()
    r = run([orphan(p)], snap([p]), PlanState(), policy(), now=0.0)
    out = record_signal(r.state, signals(r)[0], "reused", now=0.0)
    assert EventName.ESCALATION_ABORTED in names(out)
    assert out.state.ladders == {}


@pytest.mark.parametrize("outcome", ["denied", "failed"])
def test_denied_or_failed_signal_ends_the_ladder_without_retry(outcome: str) -> None:
    p, f, pol, r = first_poll()
    out = record_signal(r.state, signals(r)[0], outcome, now=0.0)
    assert event(out, EventName.ESCALATION_ENDED)["why"] == outcome
    for now in (1.0, 31.0, 100.0):
        assert signals(run([f], snap([p]), out.state, pol, now=now)) == []


def test_stale_signal_record_changes_nothing() -> None:
    p = proc()
    r = run([orphan(p)], snap([p]), PlanState(), policy(), now=0.0)
    term = signals(r)[0]
    out = record_signal(r.state, replace(term, step=2), "delivered", now=0.0)
    assert out.state == r.state
    with pytest.raises(ValueError, match="outcome"):
        record_signal(r.state, term, "exploded", now=0.0)


def test_for_window_is_honoured_and_is_a_deadline() -> None:
    rule = Rule("orphans", FindingKind.ORPHANED, LADDER, for_=30.0)
    p, f, pol, r = first_poll(policy(rules=[rule]), now=10.0)
    assert signals(r) == []
    assert EventName.ESCALATION_CONFIRMING in names(r)
    assert next_deadline(r.state) == 40.0
    assert pending_keys(r.state, [f.key])
    r = run([f], snap([p]), r.state, pol, now=39.9)
    assert signals(r) == []
    r = run([f], snap([p]), r.state, pol, now=40.0)
    assert [s.signal for s in signals(r)] == ["SIGTERM"]


def test_finding_that_flaps_restarts_its_confirmation_window() -> None:
    rule = Rule("orphans", FindingKind.ORPHANED, LADDER, for_=30.0)
    p, f, pol, r = first_poll(policy(rules=[rule]), now=0.0)
    r = run([], snap([p]), r.state, pol, now=20.0)
    r = run([f], snap([p]), r.state, pol, now=25.0)
    r = run([f], snap([p]), r.state, pol, now=50.0)
    assert signals(r) == []
    r = run([f], snap([p]), r.state, pol, now=55.0)
    assert len(signals(r)) == 1


def test_post_action_delay_defers_new_targets_on_the_same_gpu() -> None:
    pol = policy(limits=Limits(post_action_delay=15.0))
    a = proc(1000)
    b = proc(1001)
    c = proc(1002)
    r = run([orphan(a)], snap([a, b, c]), PlanState(), pol, now=0.0)
    assert len(signals(r)) == 1
    state = record_signal(r.state, signals(r)[0], "delivered", now=0.0).state
    fb = orphan(b)
    fc = orphan(c, gpu_uuid=GPU1)
    r = run([orphan(a), fb, fc], snap([a, b, c]), state, pol, now=5.0)
    # GPU1 is not affected by the delay; GPU0 is, and says so (debug, not silence).
    assert [s.identity.pid for s in signals(r)] == [1002]
    deferred = [e for e in r.events if e.name == EventName.ACTION_DEFERRED]
    assert [(e.fields["pid"], e.level) for e in deferred] == [(1001, "debug")]
    assert pending_keys(r.state, [fb.key])
    r = run([orphan(a), fb, fc], snap([a, b, c]), r.state, pol, now=15.0)
    assert 1001 in [s.identity.pid for s in signals(r)]


def test_targets_on_one_gpu_judged_in_the_same_poll_all_start() -> None:
    ps = [proc(1000 + i) for i in range(3)]
    r = run([orphan(p) for p in ps], snap(ps), PlanState(), policy(), now=0.0)
    assert sorted(s.identity.pid for s in signals(r)) == [1000, 1001, 1002]


# --- kill cap, dry-run, pause -----------------------------------------------------------------


def test_kill_cap_per_poll_latches_that_user_into_dry_run_with_one_critical_event() -> None:
    pol = policy(limits=Limits(max_signalled_per_poll=2, max_signalled_per_hour=100))
    ps = [proc(1000 + i) for i in range(4)]
    r = run([orphan(p) for p in ps], snap(ps), PlanState(), pol, now=0.0)
    real = [s for s in signals(r) if not s.dry_run]
    assert len(real) == 2
    assert all(s.dry_run for s in signals(r) if s not in real)
    cap = [e for e in r.events if e.name == EventName.LIMITS_KILL_CAP_REACHED]
    assert len(cap) == 1
    assert (cap[0].level, cap[0].fields["scope"]) == ("critical", "uid:1000")
    assert set(r.state.scope_latches) == {"uid:1000"}
    assert not r.state.forced_dry_run  # one user's storm is not the node's
    # The latch survives a restart and holds the user's real ladders already in progress.
    state = PlanState.from_json(json.loads(json.dumps(r.state.to_json())))
    for s in real:
        state = record_signal(state, s, "delivered", now=0.0).state
    r = run([orphan(p) for p in ps], snap(ps), state, pol, now=31.0)
    assert [s for s in signals(r) if not s.dry_run] == []
    assert EventName.LIMITS_KILL_CAP_REACHED not in names(r)
    held = [e.fields["why"] for e in r.events if e.name == EventName.ACTION_REFUSED]
    assert held == ["dry_run (kill cap engaged)"] * len(real)  # the user's latch, said so
    # An explicit clear lifts it at once.
    r = run([orphan(p) for p in ps], snap(ps), clear_forced_dry_run(r.state), pol, now=32.0)
    assert {s.signal for s in signals(r) if not s.dry_run} >= {"SIGKILL"}


def test_one_users_storm_of_seventeen_orphans_does_not_latch_the_node() -> None:
    """The attack of issue 20: seventeen orphans of one dead parent passed the node-wide
    per-poll cap (16) and switched the whole node to dry-run, until an admin came."""
    storm = [proc(3000 + i, uid=1001, user="mallory") for i in range(17)]
    other = proc(4000, uid=1002, user="olivia")
    everyone = [*storm, other]
    r = run([orphan(p) for p in everyone], snap(everyone), PlanState(), policy(limits=Limits()),
            now=0.0)  # fmt: skip
    real = {s.identity.pid for s in signals(r) if not s.dry_run}
    assert other.pid in real
    assert len(real & {p.pid for p in storm}) == 16
    assert set(r.state.scope_latches) == {"uid:1001"}
    assert not r.state.forced_dry_run
    # Next poll: olivia's next orphan is acted on for real; mallory's stay dry-run.
    late = proc(4001, uid=1002, user="olivia")
    late_storm = proc(3100, uid=1001, user="mallory")
    r = run([orphan(late), orphan(late_storm)], snap([late, late_storm]), r.state,
            policy(limits=Limits()), now=20.0)  # fmt: skip
    assert {(s.identity.pid, s.dry_run) for s in signals(r)} == {(4001, False), (3100, True)}


def test_a_users_orphans_spread_over_its_sub_uids_count_against_that_user_not_the_node() -> None:
    """Issue 34 #11: a user owning a sub-uid range (/etc/subuid: rootless containers) ran
    orphans as several of those uids; each uid had a cap of its own, so together they passed
    the node-wide cap and latched the whole node. Now they count against the range's owner:
    that user is latched, the node is not, and another user is still acted on."""
    limits = Limits(max_signalled_per_poll=10, max_signalled_per_hour=4,
                    node_max_signalled_per_hour=6)  # fmt: skip
    ranges = (SubIdRange(100_000, 65_536, "mallory", 1001), SubIdRange(200_000, 10, "ghost", None))
    storm = [proc(3000 + i, uid=100_000 + 7 * i, user=None) for i in range(8)]
    other = proc(4000, uid=1002, user="olivia")
    everyone = [*storm, other]
    s = replace(snap(everyone), subuid_ranges=ranges)
    r = run([orphan(p) for p in everyone], s, PlanState(), policy(limits=limits), now=0.0)
    real = {x.identity.pid for x in signals(r) if not x.dry_run}
    assert other.pid in real
    assert len(real & {p.pid for p in storm}) == 4
    assert set(r.state.scope_latches) == {"uid:1001"}
    assert not r.state.forced_dry_run
    assert kill_cap_scope(proc(uid=200_003), ranges) == "user:ghost"  # a name without a uid
    assert kill_cap_scope(proc(uid=165_536), ranges) == "uid:165536"  # past the range
    assert kill_cap_scope(None, ranges) == "uid:unknown"  # no process: its owner is unknown


def test_a_latch_expires_after_kill_cap_latch_with_a_warning_and_dry_run_ladders_restart() -> None:
    limits = Limits(max_signalled_per_poll=1, max_signalled_per_hour=100, kill_cap_latch=600.0)
    pol = policy(limits=limits)
    a, b = proc(1000), proc(1001)
    r = run([orphan(a), orphan(b)], snap([a, b]), PlanState(), pol, now=0.0)
    assert [(s.identity.pid, s.dry_run) for s in signals(r)] == [(1000, False), (1001, True)]
    until = event(r, EventName.LIMITS_KILL_CAP_REACHED)["until"]
    assert until == WALL + 600.0
    state = r.state
    for s in signals(r):
        state = record_signal(state, s, "dry_run" if s.dry_run else "delivered", now=0.0).state
    r = run([orphan(a), orphan(b)], snap([a, b]), state, pol, now=599.0, wall=WALL + 599.0)
    assert EventName.LIMITS_KILL_CAP_EXPIRED not in names(r)
    r = run([orphan(a), orphan(b)], snap([a, b]), r.state, pol, now=600.0, wall=WALL + 600.0)
    expired = event(r, EventName.LIMITS_KILL_CAP_EXPIRED)
    assert (expired["scope"], expired["lasted"]) == ("uid:1000", 600.0)
    assert [e.level for e in r.events if e.name == EventName.LIMITS_KILL_CAP_EXPIRED] == ["warning"]
    assert r.state.scope_latches == {}
    # b's dry-run ladder ends as it was, then b starts over for real (from SIGTERM).
    r = run([orphan(a), orphan(b)], snap([a, b]), r.state, pol, now=640.0, wall=WALL + 640.0)
    r = run([orphan(a), orphan(b)], snap([a, b]), r.state, pol, now=641.0, wall=WALL + 641.0)
    assert EventName.ESCALATION_RESTARTED in names(r)
    assert [(s.identity.pid, s.signal, s.dry_run) for s in signals(r)] == [(1001, "SIGTERM", False)]


def test_the_node_cap_latches_everything_and_expires_too() -> None:
    limits = Limits(max_signalled_per_poll=10, max_signalled_per_hour=10,
                    node_max_signalled_per_hour=3, kill_cap_latch=60.0)  # fmt: skip
    pol = policy(limits=limits)
    ps = [proc(5000 + i, uid=2000 + i) for i in range(4)]
    r = run([orphan(p) for p in ps], snap(ps), PlanState(), pol, now=0.0)
    assert [s.dry_run for s in signals(r)] == [False, False, False, True]
    assert r.state.forced_dry_run
    assert event(r, EventName.LIMITS_KILL_CAP_REACHED)["scope"] == "node"
    r = run([], snap([]), r.state, pol, now=59.0, wall=WALL + 59.0)
    assert r.state.forced_dry_run  # not before limits.kill_cap_latch
    r = run([], snap([]), r.state, pol, now=61.0, wall=WALL + 61.0)
    assert event(r, EventName.LIMITS_KILL_CAP_EXPIRED)["scope"] == "node"
    assert not r.state.forced_dry_run


def test_a_latch_saved_without_its_start_expires_after_a_restart_instead_of_never() -> None:
    """A state file from before latches expired: forced dry-run with no start time. It must
    not persist forever without an admin: its time starts at the first poll after loading."""
    saved = PlanState(forced_dry_run=True, forced_reason="more than 64 processes in one hour")
    state = PlanState.from_json(json.loads(json.dumps(saved.to_json())))
    pol = policy(limits=Limits(kill_cap_latch=3600.0))
    r = run([], snap([]), state, pol, now=0.0, wall=WALL)
    assert r.state.forced_dry_run
    assert r.state.forced_since == WALL
    r = run([], snap([]), r.state, pol, now=3600.0, wall=WALL + 3600.0)
    assert not r.state.forced_dry_run


@pytest.mark.parametrize("step", [-3300.0, +7200.0], ids=["back", "forward"])
def test_a_wall_clock_step_either_way_neither_lifts_nor_stretches_a_latch(step: float) -> None:
    """Issue 34: a latch holds ``kill_cap_latch`` on the monotonic clock. Stepped forward
    (chrony after a bad RTC), the wall clock lifted it at once; stepped back, it held for the
    step too. Both latches, the node's and one user's."""
    limits = Limits(max_signalled_per_poll=1, node_max_signalled_per_hour=2, kill_cap_latch=600.0)
    pol = policy(limits=limits)
    ps = [proc(1000), proc(1001), proc(2000, uid=2000), proc(2001, uid=2000)]
    r = run([orphan(p) for p in ps], snap(ps), PlanState(), pol, now=0.0, wall=WALL)
    assert r.state.scope_latches
    assert r.state.forced_dry_run
    state = PlanState.from_json(json.loads(json.dumps(r.state.to_json())))  # a restart
    r = run([], snap([]), state, pol, now=300.0, wall=WALL + 300.0 + step)
    r = run([], snap([]), r.state, pol, now=599.0, wall=WALL + 599.0 + step)
    assert r.state.scope_latches
    assert r.state.forced_dry_run
    r = run([], snap([]), r.state, pol, now=600.0, wall=WALL + 600.0 + step)
    assert not r.state.scope_latches
    assert not r.state.forced_dry_run
    lasted = [e.fields["lasted"] for e in r.events if e.name == EventName.LIMITS_KILL_CAP_EXPIRED]
    assert lasted == [600.0, 600.0]


def test_a_latch_from_before_a_reboot_holds_the_wall_time_it_has_left() -> None:
    """Across a reboot the monotonic clock restarts: the latch is anchored again once, by the
    wall time it has held, and counts on the new boot's clock from there."""
    pol = policy(limits=Limits(max_signalled_per_poll=1, kill_cap_latch=600.0))
    a, b = proc(1000), proc(1001)
    r = run([orphan(a), orphan(b)], snap([a, b]), PlanState(), pol, now=5000.0, wall=WALL)
    rebooted = snap([], boot_id="boot-b")
    r = run([], rebooted, r.state, pol, now=10.0, wall=WALL + 200.0)
    assert r.state.scope_latches
    r = run([], rebooted, r.state, pol, now=409.0, wall=WALL + 599.0 + 3600.0)  # and a step
    assert r.state.scope_latches
    r = run([], rebooted, r.state, pol, now=410.0, wall=WALL + 600.0 + 3600.0)
    assert not r.state.scope_latches


def test_a_latch_from_a_state_file_before_the_monotonic_anchor_holds_its_wall_time_left() -> None:
    """State files users have: latches with a wall ``since`` only. They load, and hold the
    time they have left by the wall clock, then on the monotonic clock."""
    pol = policy(limits=Limits(max_signalled_per_poll=1, node_max_signalled_per_hour=1,
                               kill_cap_latch=600.0))  # fmt: skip
    a, b = proc(1000), proc(1001, uid=1001)
    r = run([orphan(a), orphan(b)], snap([a, b]), PlanState(), pol, now=0.0, wall=WALL)
    saved = r.state.to_json()
    assert saved.pop("forced_since_monotonic") == 0.0
    old = PlanState.from_json(saved)
    assert old.forced_dry_run
    assert old.forced_since_monotonic is None
    r = run([], snap([]), old, pol, now=9000.0, wall=WALL + 100.0)  # a restart, 100 s later
    r = run([], snap([]), r.state, pol, now=9499.0, wall=WALL + 7200.0)  # and a step
    assert r.state.forced_dry_run
    r = run([], snap([]), r.state, pol, now=9500.0, wall=WALL + 7201.0)
    assert not r.state.forced_dry_run


def test_kill_cap_per_hour_counts_distinct_identities_over_a_rolling_hour() -> None:
    pol = policy(limits=Limits(max_signalled_per_poll=10, max_signalled_per_hour=3))
    state = PlanState()
    real_pids: list[int] = []
    for i in range(3):
        p = proc(2000 + i)
        r = run([orphan(p)], snap([p]), state, pol, now=100.0 * i)
        real_pids += [s.identity.pid for s in signals(r) if not s.dry_run]
        state = r.state
    assert real_pids == [2000, 2001, 2002]
    p = proc(2003)
    r = run([orphan(p)], snap([p]), state, pol, now=300.0)
    assert [s.dry_run for s in signals(r)] == [True]
    why = event(r, EventName.LIMITS_KILL_CAP_REACHED)["why"]
    assert why == "more than 3 processes of uid:1000 in one hour"


def test_kill_cap_window_rolls_after_an_hour() -> None:
    pol = policy(limits=Limits(max_signalled_per_poll=10, max_signalled_per_hour=1))
    a, b = proc(1000), proc(1001)
    r = run([orphan(a)], snap([a]), PlanState(), pol, now=0.0)
    assert [s.dry_run for s in signals(r)] == [False]
    r = run([orphan(b)], snap([b]), r.state, pol, now=3600.0)
    assert [s.dry_run for s in signals(r)] == [False]
    assert not r.state.forced_dry_run
    assert not r.state.scope_latches


def test_dry_run_emits_intents_marked_dry_and_advances_the_timeline() -> None:
    p, f, pol, r = first_poll(policy(dry_run=True))
    (term,) = signals(r)
    assert term.dry_run
    state = record_signal(r.state, term, "dry_run", now=0.0).state
    r = run([f], snap([p]), state, pol, now=30.0)
    (kill,) = signals(r)
    assert (kill.signal, kill.dry_run) == ("SIGKILL", True)
    state = record_signal(r.state, kill, "dry_run", now=30.0).state
    r = run([f], snap([p]), state, pol, now=40.0)
    assert [e.level for e in r.events if e.name == EventName.ESCALATION_ENDED] == ["info"]
    # Dry-run signals are not counted by the kill cap.
    assert r.state.signal_history == ()
    # Switching dry-run off starts a real ladder from step 1, never straight at SIGKILL.
    # (after the post-action delay the dry-run SIGKILL at 30 s set, as a real one would)
    r = run([f], snap([p]), r.state, policy(), now=45.0)
    assert EventName.ESCALATION_RESTARTED in names(r)
    assert [(s.signal, s.step, s.dry_run) for s in signals(r)] == [("SIGTERM", 1, False)]


def test_pause_emits_no_intents_and_ladders_hold_until_resume() -> None:
    pol = policy()
    p, q = proc(1000), proc(1001)
    r = run([orphan(p)], snap([p, q]), PlanState(), pol, now=0.0)
    state = record_signal(r.state, signals(r)[0], "delivered", now=0.0).state
    state = set_paused(state, True, reason="maintenance")
    findings = [orphan(p), orphan(q)]
    r = run(findings, snap([p, q]), state, pol, now=31.0)
    assert r.intents == ()
    whys = [e.fields["why"] for e in r.events if e.name == EventName.ACTION_REFUSED]
    assert any("paused" in str(w) for w in whys)
    assert len(whys) == 2
    assert next_deadline(r.state) is None or next_deadline(r.state) > 31.0  # type: ignore[operator]
    r2 = run(findings, snap([p, q]), r.state, pol, now=40.0)
    assert r2.intents == ()
    assert EventName.ACTION_REFUSED not in names(r2)  # said once, not every poll
    r = run(findings, snap([p, q]), set_paused(r2.state, False, reason="done"), pol, now=50.0)
    assert sorted((s.identity.pid, s.signal) for s in signals(r)) == [
        (1000, "SIGKILL"),
        (1001, "SIGTERM"),
    ]


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"wedged": True}, "blocked: NVML is wedged"),
        ({"host_namespaces": False}, "blocked: host PID/cgroup namespaces"),
        ({"host_namespaces": None}, "blocked: host PID/cgroup namespaces"),
    ],
)
def test_node_wide_blocks_refuse_all_actions(kw: Mapping[str, bool | None], why: str) -> None:
    p = proc()
    s = snap([p], **kw)  # type: ignore[arg-type]
    r = run([orphan(p)], s, PlanState(), policy(), now=0.0)
    assert r.intents == ()
    assert str(event(r, EventName.ACTION_REFUSED)["why"]).startswith(why)


def test_report_only_gpu_and_non_actionable_findings_are_refused_with_reason() -> None:
    p, q = proc(1000), proc(1001)
    findings = [orphan(p), orphan(q, gpu_uuid=GPU1, actionable=False)]
    r = run(findings, snap([p, q]), PlanState(), policy(), now=0.0, report_only={GPU0: "MIG"})
    assert r.intents == ()
    whys = sorted(str(e.fields["why"]) for e in r.events if e.name == EventName.ACTION_REFUSED)
    assert whys[0].startswith("not_actionable")
    assert whys[1] == "report_only: MIG"


def test_protected_target_is_refused_once_and_never_signalled() -> None:
    p = proc(comm="nv-hostengine", exe="/usr/bin/nv-hostengine", **ROOT)
    f = orphan(p)
    state = PlanState()
    for now in (0.0, 5.0, 10.0):
        r = run([f], snap([p]), state, policy(), now=now)
        assert r.intents == ()
        state = r.state
        refusals = [e for e in r.events if e.name == EventName.ACTION_REFUSED]
        assert len(refusals) == (1 if now == 0.0 else 0)


def test_zombie_is_never_signalled_and_its_parent_is_named() -> None:
    z = proc(1000, state="Z", cmdline=(), ppid=555)
    f = orphan(z, kind=FindingKind.ZOMBIE, evidence={"ppid": 555})
    rules = [Rule("zombies", FindingKind.ZOMBIE, LADDER)]
    r = run([f], snap([z]), PlanState(), policy(rules=rules), now=0.0)
    assert r.intents == ()
    assert event(r, EventName.ZOMBIE_NEEDS_REAP)["parent"] == 555


def test_target_turning_zombie_mid_ladder_resolves_and_names_the_parent() -> None:
    p = proc(ppid=555)
    f = orphan(p)
    r = run([f], snap([p]), PlanState(), policy(), now=0.0)
    state = record_signal(r.state, signals(r)[0], "delivered", now=0.0).state
    z = replace(p, state="Z")
    r = run([f], snap([z]), state, policy(), now=31.0)
    assert signals(r) == []
    assert event(r, EventName.ZOMBIE_NEEDS_REAP)["parent"] == 555


def test_stuck_target_gets_on_failure_once_and_never_a_sigkill_loop() -> None:
    p, f, pol, r = first_poll()
    state = record_signal(r.state, signals(r)[0], "delivered", now=0.0).state
    d = replace(p, state="D")
    stuck = orphan(d, kind=FindingKind.STUCK)
    ran: list[tuple[str, object]] = []
    for now in (31.0, 45.0, 100.0, 1000.0):
        r = run([f, stuck], snap([d]), state, pol, now=now)
        assert signals(r) == []
        ran += [(h.hook, h.facts.get("outcome")) for h in hooks(r)]
        state = r.state
        if now == 31.0:
            assert [e.level for e in r.events if e.name == EventName.TARGET_STUCK] == ["critical"]
    # on_failure once; and on_action once, because a SIGTERM was really sent to it.
    assert sorted(ran, key=str) == [("on_action", "stuck"), ("on_failure", None)]


def test_a_stuck_target_pages_in_the_mode_of_its_users_kill_cap_latch() -> None:
    """Past a user's kill cap that user's targets are handled in dry-run (docs/escalation.md):
    so is the on_failure hook of one found stuck (here as one of the user's sub-uids); another
    user's stuck target pages for real."""
    pol = policy(limits=Limits(max_signalled_per_poll=1, max_signalled_per_hour=100))
    ranges = (SubIdRange(100_000, 65_536, "bob", 1000),)
    a, b, c = proc(1000), proc(1001, uid=100_007), proc(2000, uid=1002, user="olivia")
    r = run([orphan(p) for p in (a, b, c)], replace(snap([a, b, c]), subuid_ranges=ranges),
            PlanState(), pol, now=0.0)  # fmt: skip
    assert set(r.state.scope_latches) == {"uid:1000"}
    stuck = [replace(p, state="D") for p in (b, c)]
    found = [orphan(a), *(orphan(p, kind=FindingKind.STUCK) for p in stuck)]
    r = run(found, replace(snap([a, *stuck]), subuid_ranges=ranges), r.state, pol, now=1.0)
    paged = {h.facts["pid"]: h.dry_run for h in hooks(r) if h.hook == "on_failure"}
    assert paged == {1001: True, 2000: False}


def test_a_target_stuck_while_paused_is_reported_but_runs_no_on_failure_hook() -> None:
    """A pause holds every hook (docs/escalation.md): the target is still said stuck."""
    p, f, pol, r = first_poll()
    state = record_signal(r.state, signals(r)[0], "delivered", now=0.0).state
    d = replace(p, state="D")
    paused = set_paused(state, True, reason="maintenance")
    r = run([f, orphan(d, kind=FindingKind.STUCK)], snap([d]), paused, pol, now=31.0)
    assert EventName.TARGET_STUCK in names(r)
    (told,) = hooks(r)  # on_action: the SIGTERM was sent before the pause
    assert (told.hook, told.facts["why"]) == ("on_action", "target is in uninterruptible sleep (D)")
    why = event(r, EventName.ACTION_REFUSED)["why"]
    assert str(why).startswith("paused: maintenance; on_failure not run: ")


def test_target_still_in_d_state_after_its_last_step_is_stuck_not_ended() -> None:
    p = proc()
    f = orphan(p)
    pol = policy()
    state = PlanState()
    for now in (0.0, 30.0):
        r = run([f], snap([p]), state, pol, now=now)
        state = record_signal(r.state, signals(r)[0], "delivered", now=now).state
    r = run([f], snap([replace(p, state="D")]), state, pol, now=40.0)
    assert EventName.TARGET_STUCK in names(r)
    assert EventName.ESCALATION_ENDED not in names(r)
    assert [h.hook for h in hooks(r)] == ["on_failure", "on_action"]


def test_stuck_finding_with_a_stuck_rule_runs_on_failure_once_without_signals() -> None:
    d = proc(state="D")
    f = orphan(d, kind=FindingKind.STUCK)
    pol = policy(rules=[Rule("stuck", FindingKind.STUCK, (Step(None, 0.0),), for_=60.0)])
    r = run([f], snap([d]), PlanState(), pol, now=0.0)
    assert r.intents == ()
    r = run([f], snap([d]), r.state, pol, now=60.0)
    assert [type(i) for i in r.intents] == [HookIntent]
    r = run([f], snap([d]), r.state, pol, now=120.0)
    assert r.intents == ()


def test_boot_id_change_drops_identity_ladders_but_keeps_reset_history() -> None:
    p = proc()
    f = orphan(p)
    r = run([f], snap([p]), PlanState(), policy(), now=0.0)
    state = record_signal(r.state, signals(r)[0], "delivered", now=0.0).state
    state = replace(state, reset_history=((GPU0, 1_700_000_000.0),), last_reset={GPU0: 1.7e9})
    r = run([f], snap([p], boot_id="boot-b"), state, policy(), now=31.0)
    assert EventName.STATE_BOOT_CHANGED in names(r)
    # The same pid@ticks after a reboot is a different process: a new ladder from step 1.
    assert [(s.signal, s.step) for s in signals(r)] == [("SIGTERM", 1)]
    assert r.state.reset_history == ((GPU0, 1_700_000_000.0),)
    assert r.state.boot_id == "boot-b"


def test_a_plan_of_an_unknown_boot_drops_its_monotonic_times_and_keeps_what_the_gpus_hold() -> None:
    """The start that cannot read this boot's id takes the saved plan's monotonic times for
    another boot's, and keeps what only a reboot ends on the GPUs: this may be the same boot (a
    refused reset stays refused, a half-done MIG GPU not clean, a drain done is not run again).
    After a known reboot those go too."""
    state = PlanState(
        boot_id="boot-a",
        seen={"k": SeenFinding(5000.0, "d", GPU0, None)},
        quiet_until={GPU0: 9000.0},
        signal_history=(("1@2", 5000.0),),
        last_monotonic=5000.0,
        reset_history=((GPU0, WALL),),
        reset_refusals={GPU0: ResetRefusal("k", "refused", True, WALL)},
        health_drained={GPU0: False},
        mig_unfinished={"MIG-a": MigUnfinished(GPU1, 1, 19, 6, 1, WALL, "failed")},
    )
    for reboot in (False, True):
        r = another_boots(state, rebooted=reboot)
        assert (r.seen, r.quiet_until, r.signal_history, r.last_monotonic) == ({}, {}, (), None)
        assert r.reset_history == state.reset_history
        held = (r.reset_refusals, r.health_drained, r.mig_unfinished)
        if reboot:
            assert held == ({}, {}, {})
        else:
            assert held == (state.reset_refusals, state.health_drained, state.mig_unfinished)
    assert another_boots(state) == another_boots(state, rebooted=True)


# --- resets -----------------------------------------------------------------------------------


def _reset_run(
    findings: Sequence[Finding],
    state: PlanState,
    now: float,
    *,
    wall: float | None = None,
    pol: Policy | None = None,
    gpus: Sequence[GpuInfo] = (gpu(), gpu(GPU1, 1)),
    procs: Sequence[ProcessInfo] = (),
    holders: Mapping[int, DeviceHolding] | None = None,
) -> PlanResult:
    s = snap(procs, gpus=gpus, holders=holders if holders is not None else {})
    return run(findings, s, state, pol or policy(), now=now, wall=wall)


def test_reset_waits_for_confirm_for_then_emits_one_intent() -> None:
    g = ghost()
    r = _reset_run([g], PlanState(), 0.0)
    assert r.intents == ()
    assert next_deadline(r.state) == 60.0
    assert pending_keys(r.state, [g.key])
    r = _reset_run([g], r.state, 59.9)
    assert r.intents == ()
    r = _reset_run([g], r.state, 60.0)
    (intent,) = resets(r)
    assert (intent.gpu, intent.pci_bus_id, intent.minor, intent.dry_run) == (GPU0, BUS0, 0, False)
    assert pending_keys(r.state, [g.key])
    # One in flight at a time: nothing more until act reports.
    r2 = _reset_run([g, ghost(GPU1)], r.state, 200.0)
    assert resets(r2) == []
    done = record_reset(r2.state, intent, "success", now=201.0, wall=1_700_000_201.0)
    assert EventName.RESET_SUCCEEDED in names(done)
    assert done.state.reset_in_flight is None


def test_reset_cooldown_and_limit_per_window_with_wall_clock_stepping_back() -> None:
    pol = policy(reset=ResetPolicy(confirm_for=0.0, cooldown=100.0, max_resets=2, window=1000.0))
    g = ghost()
    wall = 1_700_000_000.0
    r = _reset_run([g], PlanState(), 0.0, wall=wall, pol=pol)
    state = record_reset(r.state, resets(r)[0], "success", now=0.0, wall=wall).state
    # 50 s pass, then the wall clock steps back an hour: the step counts as no time passed,
    # so the limits clock reads 50 s at ``back`` and runs on from there.
    r = _reset_run([g], state, 50.0, wall=wall + 50, pol=pol)
    assert resets(r) == []
    back = wall - 3600
    r = _reset_run([g], r.state, 51.0, wall=back, pol=pol)
    assert EventName.CLOCK_STEPPED_BACK in names(r)
    assert resets(r) == []
    r = _reset_run([g], r.state, 100.0, wall=back + 49, pol=pol)
    assert resets(r) == []
    r = _reset_run([g], r.state, 101.0, wall=back + 50, pol=pol)
    (second,) = resets(r)
    state = record_reset(r.state, second, "success", now=101.0, wall=back + 50).state
    # Two resets within the window: the limit holds, even long after the cooldown.
    r = _reset_run([g], state, 500.0, wall=back + 449, pol=pol)
    assert resets(r) == []
    assert EventName.RESET_LIMIT_REACHED in names(r)
    # A restart in between neither forgets the limit nor repeats a reset.
    state = PlanState.from_json(json.loads(json.dumps(r.state.to_json())))
    r = _reset_run([g], state, 1000.0, wall=back + 949, pol=pol)
    assert resets(r) == []
    r = _reset_run([g], r.state, 1001.0, wall=back + 950, pol=pol)
    assert len(resets(r)) == 1  # the first reset (limits clock 0) left the 1000 s window


def test_a_forward_wall_clock_step_unlocks_neither_the_cooldown_nor_the_reset_limit() -> None:
    """Measured within one boot against the monotonic clock, a forward step counts as no time
    passed, as a backward one does; a poll's own jitter (up to a minute) is no step."""
    pol = policy(reset=ResetPolicy(confirm_for=0.0, cooldown=100.0, max_resets=1, window=1000.0))
    g = ghost()
    wall = 1_700_000_000.0
    r = _reset_run([g], PlanState(), 0.0, wall=wall, pol=pol)
    state = record_reset(r.state, resets(r)[0], "success", now=0.0, wall=wall).state
    r = _reset_run([g], state, 50.0, wall=wall + 50 + 60, pol=pol)  # a slow poll's minute
    assert EventName.CLOCK_STEPPED_FORWARD not in names(r)
    assert EventName.RESET_LIMIT_REACHED in names(r)
    ahead = wall + 86_400  # then the wall clock steps a day forward
    r = _reset_run([g], r.state, 51.0, wall=ahead + 111, pol=pol)
    assert event(r, EventName.CLOCK_STEPPED_FORWARD) == {"seconds": 86_400.0, "wall": ahead + 111}
    assert resets(r) == []
    assert r.state.reset_history == ((GPU0, ahead),)
    # A restart in between keeps the reference; the window ends 1000 s after the reset.
    state = PlanState.from_json(json.loads(json.dumps(r.state.to_json())))
    r = _reset_run([g], state, 939.0, wall=ahead + 999, pol=pol)
    assert resets(r) == []
    r = _reset_run([g], r.state, 940.0, wall=ahead + 1000, pol=pol)
    assert len(resets(r)) == 1


def test_another_boots_monotonic_time_is_no_reference_for_a_forward_step() -> None:
    """After a reboot (or from a state file without ``last_monotonic``) the first poll has no
    monotonic reference: the wall time since counts as time passed, as before."""
    wall = 1_700_000_000.0
    state = replace(PlanState(boot_id="boot-a"), last_wall=wall, last_monotonic=5.0,
                    last_reset={GPU0: wall})  # fmt: skip
    for s in (snap([], boot_id="boot-b"), snap([])):
        old = state if s.boot_id == "boot-b" else replace(state, last_monotonic=None)
        r = run([], s, old, policy(), now=100.0, wall=wall + 10_000)
        assert EventName.CLOCK_STEPPED_FORWARD not in names(r)
        assert r.state.last_reset == {GPU0: wall}
        assert r.state.last_monotonic == 100.0
    old_file = state.to_json()
    del old_file["last_monotonic"]
    assert PlanState.from_json(old_file).last_monotonic is None


def test_reset_circuit_breaker_opens_after_consecutive_failures_until_cleared() -> None:
    pol = policy(reset=ResetPolicy(confirm_for=0.0, cooldown=0.0, max_resets=10, max_failures=2))
    g, h = ghost(), ghost(GPU1)
    state = PlanState()
    for i, outcome in enumerate(("failed", "timeout")):
        r = _reset_run([g, h], state, 100.0 * i, pol=pol)
        (intent,) = resets(r)
        out = record_reset(r.state, intent, outcome, now=100.0 * i, wall=1e9 + 100 * i)
        assert [x.hook for x in hooks(out)] == ["on_failure", "on_action"]
        assert EventName.RESET_FAILED in names(out)
        state = out.state
    r = _reset_run([g, h], state, 300.0, pol=pol)
    assert resets(r) == []
    assert [e.level for e in r.events if e.name == EventName.RESET_CIRCUIT_OPEN] == ["critical"]
    r = _reset_run([g, h], r.state, 400.0, pol=pol)
    assert EventName.RESET_CIRCUIT_OPEN not in names(r)  # said once
    r = _reset_run([g, h], clear_circuit(r.state), 500.0, pol=pol)
    assert len(resets(r)) == 1


def test_a_clear_latches_request_older_than_a_failed_reset_keeps_the_circuit_it_opened() -> None:
    """A request left while the daemon was down is taken by the next start's first poll: a
    reset that start resumed and that failed (after the request) keeps the breaker's count and
    circuit; one that failed before the request is lifted, as one of no known time is."""
    pol = policy(reset=ResetPolicy(confirm_for=0.0, cooldown=0.0, max_resets=10, max_failures=2))
    g, h, w = ghost(), ghost(GPU1), 1e9
    state, made = PlanState(), w + 50
    for i, outcome in enumerate(("failed", "timeout")):
        (intent,) = resets(r := _reset_run([g, h], state, 100.0 * i, wall=w + 100 * i, pol=pol))
        state = record_reset(r.state, intent, outcome, now=100.0 * i, wall=w + 100 * i).state
    assert state.last_failure == w + 100
    kept = clear_circuit(state, made)
    assert (kept.reset_failures, kept.last_failure) == (2, w + 100)
    r = _reset_run([g, h], kept, 300.0, wall=w + 300, pol=pol)
    assert resets(r) == []
    assert EventName.RESET_CIRCUIT_OPEN in names(r)
    assert clear_circuit(r.state, made) == r.state  # opened after the request: nobody saw it
    for lifted in (clear_circuit(r.state, made + 100), clear_circuit(r.state)):
        assert (lifted.circuit_open, lifted.reset_failures, lifted.last_failure) == (False, 0, None)
        assert len(resets(_reset_run([g, h], lifted, 500.0, wall=w + 500, pol=pol))) == 1
    old_file = r.state.to_json()
    del old_file["last_failure"]  # an older state file: unknown, lifted by any request
    assert not clear_circuit(PlanState.from_json(old_file), made).circuit_open
    success = record_reset(r.state, intent, "success", now=600.0, wall=w + 600)
    assert (success.state.reset_failures, success.state.last_failure) == (0, None)
    back = _reset_run([g, h], r.state, 400.0, wall=w - 3600, pol=pol)  # the clock steps back
    assert back.state.last_failure == w + 100 - 3900  # the 3900 s step counts as no time
    assert not clear_circuit(back.state, w - 3599).circuit_open  # made after, on this clock


def test_an_admins_clear_lifts_the_latches_set_by_its_request_and_keeps_those_set_after() -> None:
    """`resume --clear-latches` is made at a wall time and taken at a later poll (the next
    start's, when the daemon was down): what was latched or booked after it, nobody saw."""
    made = 1000.0
    seen, later = (
        MigUnfinished(GPU0, 1, 19, 6, 1, made, "failed"),
        MigUnfinished(GPU1, 1, 19, 6, 1, made + 1.0, "failed"),
    )
    state = PlanState(
        forced_dry_run=True, forced_reason="lost", forced_since=made + 1.0,
        scope_latches={"uid:1": Latch("cap", made), "uid:2": Latch("cap", made + 1.0)},
        reset_refusals={GPU0: ResetRefusal("a", "refused", False, made),
                        GPU1: ResetRefusal("b", "refused", False, made + 1.0)},
        mig_unfinished={"MIG-a": seen, "MIG-b": later}, circuit_open=True, reset_failures=2,
    )  # fmt: skip
    cleared = clear_circuit(clear_forced_dry_run(state, made), made)
    assert (cleared.forced_dry_run, cleared.forced_since) == (True, made + 1.0)
    assert list(cleared.scope_latches) == ["uid:2"]
    assert list(cleared.reset_refusals) == [GPU1]
    assert list(cleared.mig_unfinished) == ["MIG-b"]
    assert (cleared.circuit_open, cleared.reset_failures) == (False, 0)  # no failure's time
    lifted = clear_forced_dry_run(replace(state, forced_since=made), made)
    assert (lifted.forced_dry_run, lifted.forced_reason, lifted.forced_since) == (False, None, None)
    unknown = clear_forced_dry_run(replace(state, forced_since=None), made)  # an older file's
    assert not unknown.forced_dry_run
    everything = clear_circuit(clear_forced_dry_run(state))  # a request of no known time
    left = (everything.scope_latches, everything.reset_refusals, everything.mig_unfinished)
    assert left == ({}, {}, {})
    assert not everything.forced_dry_run


@pytest.mark.parametrize("step", [-3600.0, +7200.0], ids=["back", "forward"])
def test_a_wall_clock_step_moves_a_refused_reset_and_a_half_done_mig_recovery_as_a_latch(
    step: float,
) -> None:
    """A refused reset and a MIG recovery left half done are kept by the wall time they were
    booked at, which `resume --clear-latches` compares with its request. A wall-clock step
    moved the latches and the last failure but not these: stepped back an hour, a request made
    after them on the clock as it is now kept both (the reset stayed refused, the MIG GPU not
    clean), and `refused_at` was off by the step."""
    pol = policy(reset=ResetPolicy(confirm_for=0.0, cooldown=0.0, max_resets=10))
    g = ghost()
    r = _reset_run([g], PlanState(), 0.0, pol=pol)
    state = record_reset(r.state, resets(r)[0], "in_use", now=0.0, wall=WALL).state
    half = MigUnfinished(GPU1, 1, 19, 6, 1, WALL, "failed")
    state = replace(
        state, mig_unfinished={"MIG-a": half}, scope_latches={"uid:1": Latch("cap", WALL)}
    )
    r = _reset_run([g], state, 0.0, wall=WALL + step, pol=pol)  # the next poll, stepped
    assert event(r, EventName.CLOCK_STEPPED_BACK if step < 0 else EventName.CLOCK_STEPPED_FORWARD)
    moved = WALL + step  # the step counts as no time passed, for each of them alike
    assert r.state.scope_latches["uid:1"].since == moved
    assert r.state.reset_refusals[GPU0].since == moved
    assert r.state.mig_unfinished["MIG-a"].since == moved
    assert hidden_holders(r.state)[GPU0]["refused_at"] == moved
    cleared = clear_circuit(clear_forced_dry_run(r.state, moved + 5.0), moved + 5.0)
    assert (cleared.scope_latches, cleared.reset_refusals, cleared.mig_unfinished) == ({}, {}, {})
    assert len(resets(_reset_run([g], cleared, 100.0, wall=WALL + 100.0 + step, pol=pol))) == 1


def _with_memory(allocated: int) -> GpuInfo:
    memory = GpuMemory(total=80 << 30, free=None, reserved=512 * MIB, allocated=allocated)
    return replace(gpu(), memory=memory)


def test_in_use_is_refused_not_failed_and_holds_the_incident_until_memory_changes() -> None:
    """nvidia-smi's "In use by another client" after a clear final scan: a hidden holder. No
    failure, no breaker, no on_failure; the GPU gets a hidden-holder verdict and its incident
    is not tried again (with its drain and before hooks) until something changes."""
    pol = policy(reset=ResetPolicy(confirm_for=0.0, cooldown=0.0, max_resets=10, max_failures=1))
    g = ghost()
    r = _reset_run([g], PlanState(), 0.0, pol=pol, gpus=[_with_memory(10 << 30)])
    (intent,) = resets(r)
    out = record_reset(r.state, intent, "in_use", now=0.0, wall=WALL)
    assert hooks(out) == []
    assert out.state.reset_failures == 0
    assert out.state.reset_history == ()
    refused = event(out, EventName.RESET_REFUSED)
    assert refused["hidden_holder"] is True
    assert hidden_holders(out.state)[GPU0]["gap"] == "driver_in_use"
    state = out.state
    for t in (10.0, 3600.0, 7200.0):  # no cooldown here: the incident itself is held
        r = _reset_run([g], state, t, pol=pol, gpus=[_with_memory(10 << 30)])
        assert resets(r) == []
        assert EventName.RESET_CIRCUIT_OPEN not in names(r)
        state = r.state
    assert state.reset_refusals[GPU0].allocated == 10 << 30
    r = _reset_run([g], state, 7300.0, pol=pol, gpus=[_with_memory(6 << 30)])
    assert event(r, EventName.RESET_REFUSAL_CLEARED)["gpu"] == GPU0
    assert len(resets(r)) == 1


@pytest.mark.parametrize("outcome", ["refused", "in_use"])
def test_a_refused_incident_is_tried_again_only_when_it_ends_or_an_admin_or_reload_says(
    outcome: str,
) -> None:
    pol = policy(reset=ResetPolicy(confirm_for=0.0, cooldown=0.0, max_resets=10))
    g = ghost()
    r = _reset_run([g], PlanState(), 0.0, pol=pol)
    state = record_reset(r.state, resets(r)[0], outcome, now=0.0, wall=WALL).state
    r = _reset_run([g], state, 100.0, pol=pol)
    assert resets(r) == []
    assert "a reset for this incident was refused" in str(event(r, EventName.RESET_REFUSED)["why"])
    # The admin's switch, a reload, the incident's end or a reboot each let it be tried again.
    assert len(resets(_reset_run([g], clear_circuit(r.state), 101.0, pol=pol))) == 1
    assert len(resets(_reset_run([g], forget_reset_refusals(r.state), 101.0, pol=pol))) == 1
    gone = _reset_run([], r.state, 101.0, pol=pol)
    assert gone.state.reset_refusals == {}
    back = _reset_run([g], gone.state, 102.0, pol=pol)
    assert len(resets(back)) == 1
    rebooted = run([g], snap(boot_id="boot-b"), r.state, pol, now=1.0)
    assert len(resets(rebooted)) == 1


def test_a_refusal_survives_a_restart() -> None:
    pol = policy(reset=ResetPolicy(confirm_for=0.0, cooldown=0.0, max_resets=10))
    r = _reset_run([ghost()], PlanState(), 0.0, pol=pol)
    state = record_reset(r.state, resets(r)[0], "in_use", now=0.0, wall=WALL).state
    state = PlanState.from_json(json.loads(json.dumps(state.to_json())))
    assert resets(_reset_run([ghost()], state, 100.0, pol=pol)) == []


def test_reset_success_clears_the_consecutive_failure_count() -> None:
    pol = policy(reset=ResetPolicy(confirm_for=0.0, cooldown=0.0, max_resets=10, max_failures=2))
    state = PlanState()
    for i, outcome in enumerate(("failed", "success", "failed")):
        r = _reset_run([ghost()], state, 100.0 * i, pol=pol)
        state = record_reset(r.state, resets(r)[0], outcome, now=100.0 * i, wall=1e9 + i).state
    r = _reset_run([ghost()], state, 400.0, pol=pol)
    assert len(resets(r)) == 1


def test_reset_needing_reboot_raises_critical_event_and_on_failure() -> None:
    r = _reset_run([ghost()], PlanState(), 60.0)
    r = _reset_run([ghost()], r.state, 120.0)
    out = record_reset(r.state, resets(r)[0], "failed", now=121.0, wall=1e9, needs_reboot=True)
    assert EventName.GPU_NEEDS_REBOOT in names(out)
    assert [h.hook for h in hooks(out)] == ["on_failure", "on_action"]


LIVE = proc(3000)


@pytest.mark.parametrize(
    ("case", "findings", "gpus", "procs", "holders", "why"),
    [
        (
            "hidden holder",
            [ghost(), orphan(LIVE, kind=FindingKind.HIDDEN_HOLDER)],
            (gpu(),),
            (LIVE,),
            {},
            "live holder: hidden_holder pid 3000",
        ),
        (
            "holder in the scan",
            [ghost()],
            (gpu(),),
            (LIVE,),
            {3000: DeviceHolding(3000, frozenset({0}))},
            "live holder: pid 3000 holds the GPU",
        ),
        ("MIG", [ghost()], (gpu(mig=True),), (), {}, "MIG enabled"),
        ("MIG unknown", [ghost()], (gpu(mig=None),), (), {}, "MIG mode unknown"),
        ("A100 NVLink", [ghost()], (gpu(arch=7, nvlinks=12),), (), {}, "NVLink peers"),
        ("V100 NVLink", [ghost()], (gpu(arch=5, nvlinks=6),), (), {}, "NVLink peers"),
        ("lost", [ghost()], (gpu(lost=True),), (), {}, "GPU is lost (needs reboot)"),
        ("absent", [ghost()], (gpu(GPU1, 1),), (), {}, "GPU not in this snapshot"),
    ],
)
def test_reset_refused_with_reason(  # noqa: PLR0917 -- one parameter per table column
    case: str,
    findings: Sequence[Finding],
    gpus: Sequence[GpuInfo],
    procs: Sequence[ProcessInfo],
    holders: Mapping[int, DeviceHolding],
    why: str,
) -> None:
    first = _reset_run(findings, PlanState(), 0.0, gpus=gpus, procs=procs, holders=holders)
    r = _reset_run(findings, first.state, 61.0, gpus=gpus, procs=procs, holders=holders)
    assert resets(first) + resets(r) == [], case
    whys = [
        str(e.fields["why"])
        for e in first.events + r.events
        if e.name == EventName.RESET_REFUSED and e.fields["kind"] == "ghost_memory"
    ]
    assert any(w.startswith(why) for w in whys), (case, whys)


@pytest.mark.parametrize(
    ("arch", "nvlinks", "allow", "expected"),
    [
        (9, 18, False, 1),  # Hopper: individual reset
        (7, 0, False, 1),  # Ampere without active links
        (None, None, False, 1),  # unknown topology: nvidia-smi itself refuses if peers needed
        (7, 12, True, 1),  # Ampere with links, admin says Fabric Manager runs
        (7, 12, False, 0),
    ],
)
def test_nvlink_gate_only_blocks_known_group_resets(
    arch: int | None, nvlinks: int | None, allow: bool, expected: int
) -> None:
    pol = policy(reset=ResetPolicy(confirm_for=60.0, allow_nvlink_group=allow))
    gpus = (gpu(arch=arch, nvlinks=nvlinks),)
    first = _reset_run([ghost()], PlanState(), 0.0, gpus=gpus, pol=pol)
    r = _reset_run([ghost()], first.state, 61.0, gpus=gpus, pol=pol)
    assert len(resets(first) + resets(r)) == expected


def test_reset_not_blocked_by_infrastructure_or_our_own_worker_in_the_plan() -> None:
    persistenced = proc(3001, comm="nvidia-persiste", exe="/usr/bin/nvidia-persistenced", **ROOT)
    holders = {
        3001: DeviceHolding(3001, frozenset({0})),
        4242: DeviceHolding(4242, frozenset({0})),  # the daemon's own NVML worker
    }
    r = _reset_run([ghost()], PlanState(), 0.0, procs=[persistenced], holders=holders)
    r = _reset_run([ghost()], r.state, 61.0, procs=[persistenced], holders=holders)
    assert len(resets(r)) == 1


@pytest.mark.parametrize("entry", [GPU0, "0000:3b:00.0", BUS0])
def test_reset_refused_for_protected_gpu(entry: str) -> None:
    pol = policy(protect=Protect(gpus=(entry,)))
    r = _reset_run([ghost()], PlanState(), 0.0, pol=pol)
    assert str(event(r, EventName.RESET_REFUSED)["why"]).startswith("protect: gpus")
    r = _reset_run([ghost()], r.state, 61.0, pol=pol)
    assert resets(r) == []


def test_reset_dry_run_is_marked_and_uses_its_own_cooldown_not_the_limits() -> None:
    pol = policy(dry_run=True)
    r = _reset_run([ghost()], PlanState(), 0.0, pol=pol)
    r = _reset_run([ghost()], r.state, 60.0, pol=pol)
    (intent,) = resets(r)
    assert intent.dry_run
    out = record_reset(r.state, intent, "dry_run", now=60.0, wall=1_700_000_060.0)
    assert out.state.reset_history == ()
    assert out.state.reset_failures == 0
    r = _reset_run([ghost()], out.state, 100.0, pol=pol)
    assert resets(r) == []  # dry-run cooldown: not every poll
    r = _reset_run([ghost()], r.state, 101.0, pol=policy())
    assert len(resets(r)) == 1  # real mode ignores the dry-run cooldown


def test_reset_disabled_never_emits() -> None:
    pol = policy(reset=ResetPolicy(enabled=False, confirm_for=0.0))
    r = _reset_run([ghost()], PlanState(), 100.0, pol=pol)
    assert r.intents == ()


def test_boot_change_clears_a_reset_in_flight() -> None:
    state = replace(
        PlanState(boot_id="boot-a"),
        reset_in_flight=ResetInFlight(GPU0, ghost().key, False, 5.0, 15.0),
    )
    r = run([], snap([], boot_id="boot-b"), state, policy(), now=1.0)
    assert r.state.reset_in_flight is None


# --- events and persistence -------------------------------------------------------------------


def test_finding_events_new_changed_resolved() -> None:
    p = proc()
    f = orphan(p)
    r = run([f], snap([p]), PlanState(), policy(rules=[]), now=0.0)
    assert names(r) == [EventName.FINDING_NEW]
    r = run([replace(f, reason="other")], snap([p]), r.state, policy(rules=[]), now=1.0)
    assert names(r) == [EventName.FINDING_CHANGED]
    r = run([], snap([p]), r.state, policy(rules=[]), now=3.0)
    assert names(r) == [EventName.FINDING_RESOLVED]
    assert event(r, EventName.FINDING_RESOLVED)["lasted"] == 3.0


def test_every_emitted_event_is_in_the_catalogue_with_a_known_level() -> None:
    p = proc()
    r = run([orphan(p), ghost()], snap([p]), PlanState(), policy(), now=0.0)
    for e in r.events:
        assert e.name in set(EventName)
        assert e.level in ("debug", "info", "warning", "error", "critical")


def test_plan_is_deterministic() -> None:
    ps = [proc(1000 + i) for i in range(5)]
    fs = [orphan(p) for p in ps] + [ghost()]
    a = run(fs, snap(ps), PlanState(), policy(), now=7.0)
    b = run(list(reversed(fs)), snap(ps), PlanState(), policy(), now=7.0)
    assert a == b


_text = st.text(st.characters(codec="utf-8"), max_size=12)
_time = st.floats(min_value=-1e10, max_value=1e10, allow_nan=False)
_ladders = st.builds(
    Ladder,
    target=_text,
    pid=st.integers(1, 2**22),
    start_ticks=st.integers(0, 2**62),
    finding_key=_text,
    rule=_text,
    gpu=st.none() | _text,
    steps=st.lists(st.tuples(st.none() | st.sampled_from(SIGNAL_NAMES), _time), max_size=3).map(
        tuple
    ),
    step=st.just(0),
    due=st.none() | _time,
    status=st.sampled_from(["active", "ended", "stuck", "failed"]),
    dry_run=st.booleans(),
    started=_time,
).map(lambda lad: replace(lad, target=f"{lad.pid}@{lad.start_ticks}"))  # saved as its target
_states = st.builds(
    PlanState,
    boot_id=st.none() | _text,
    seen=st.dictionaries(
        _text, st.builds(SeenFinding, _time, _text, st.none() | _text, st.none() | _text)
    ),
    notes=st.dictionaries(_text, _text),
    waiting=st.dictionaries(_text, _time),
    ladders=st.lists(_ladders, max_size=3).map(lambda ls: {lad.target: lad for lad in ls}),
    quiet_until=st.dictionaries(_text, _time),
    last_reset=st.dictionaries(_text, _time),
    last_dry_reset=st.dictionaries(_text, _time),
    reset_history=st.lists(st.tuples(_text, _time)).map(tuple),
    reset_failures=st.integers(0, 100),
    circuit_open=st.booleans(),
    reset_in_flight=st.none() | st.builds(ResetInFlight, _text, _text, st.booleans(), _time, _time),
    signal_history=st.lists(st.tuples(_text, _time)).map(tuple),
    forced_dry_run=st.booleans(),
    forced_reason=st.none() | _text,
    paused=st.booleans(),
    paused_reason=st.none() | _text,
    last_wall=st.none() | _time,
)


@given(_states)
def test_state_json_round_trip(state: PlanState) -> None:
    assert PlanState.from_json(json.loads(json.dumps(state.to_json()))) == state


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        {"version": 2},
        {"version": True},
        {"version": 1.0},
        {"paused": "yes"},
        {"ladders": {"x": {"pid": 1}}},
        {"reset_history": [["gpu"]]},
        {"reset_failures": -1},
        {"waiting": {"k": True}},
        {"seen": {"k": {"first_seen": "now"}}},
    ],
)
def test_state_from_json_rejects_malformed_data(data: object) -> None:
    with pytest.raises(ValueError, match=r"\w"):
        PlanState.from_json(data)


@pytest.mark.parametrize(
    ("target", "pid"), [("42@7", 42), ("²@7", None), ("4a@7", None), ("9" * 5000 + "@7", None)]
)
def test_a_saved_findings_target_names_its_pid_only_in_ascii_digits(
    target: str, pid: int | None
) -> None:
    """A state file is hostile input: ``'²'.isdigit()`` is True, and ``int('²')`` used to raise
    out of ``plan`` when the finding resolved."""
    saved = {"seen": {"k": {"first_seen": 1.0, "digest": "d", "gpu": None, "target": target}}}
    r = plan([], snap(), PlanState.from_json(saved), policy(), now=5.0, wall=5.0)
    assert event(r, EventName.FINDING_RESOLVED)["pid"] == pid


_SAVED_LADDER = Ladder("7@70", 7, 70, "f", "orphans", "GPU-0", (("SIGTERM", 30.0), (None, 0.0)),
                       1, 40.0, LadderStatus.ACTIVE, False, 10.0, "alice")  # fmt: skip


def test_a_saved_ladder_keeps_its_keys_in_the_file_order() -> None:
    saved: Any = PlanState(ladders={"7@70": _SAVED_LADDER}).to_json()["ladders"]
    assert json.dumps(saved) == json.dumps({"7@70": {
        "target": "7@70", "pid": 7, "start_ticks": 70, "finding": "f", "rule": "orphans",
        "gpu": "GPU-0", "steps": [["SIGTERM", 30.0], [None, 0.0]], "step": 1, "due": 40.0,
        "status": "active", "dry_run": False, "started": 10.0, "user": "alice"}})  # fmt: skip
    older = {k: v for k, v in saved["7@70"].items() if k != "user"}  # before "user" was saved
    restored = PlanState.from_json({"ladders": {"7@70": older}}).ladders["7@70"]
    assert restored == replace(_SAVED_LADDER, user=None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": [["SIGTERM"]]}, "plan.ladders.7@70.steps[0]: expected [signal, wait]"),
        ({"steps": [["SIGTERM", "x"]]}, "plan.ladders.7@70: expected a number"),
        ({"steps": "SIGTERM"}, "plan.ladders.7@70.steps: expected a list"),
        # Only a signal the config allows (never SIGSTOP: a stopped job keeps its memory).
        ({"steps": [["SIGSTOP", 30.0]]}, "plan.ladders.7@70.steps[0]: not a signal a ladder sends"),
        ({"steps": [["sigterm", 30.0]]}, "plan.ladders.7@70.steps[0]: not a signal a ladder sends"),
        ({"status": "gone"}, "plan.ladders.7@70: invalid status or step"),
        ({"step": 3}, "plan.ladders.7@70: invalid status or step"),
        ({"step": -1}, "plan.ladders.7@70: invalid status or step"),
        ({"pid": "7"}, "plan.ladders.7@70.pid: expected an integer"),
        ({"finding": None}, "plan.ladders.7@70.finding: expected a string"),
        ({"user": 5}, "plan.ladders.7@70.user: expected a string"),
        # Each under its own target: a copy under another key repeated its step every poll.
        ({"target": "8@70"}, "plan.ladders.7@70: not saved under its target"),
        ({"pid": 8}, "plan.ladders.7@70: not saved under its target"),
        ({"start_ticks": 71}, "plan.ladders.7@70: not saved under its target"),
    ],
)
def test_a_damaged_saved_ladder_is_named_in_the_error(
    change: dict[str, object], message: str
) -> None:
    saved = PlanState(ladders={"7@70": _SAVED_LADDER}).to_json()
    ladders: Any = saved["ladders"]
    ladders["7@70"].update(change)
    with pytest.raises(ValueError, match=re.escape(message)):
        PlanState.from_json(json.loads(json.dumps(saved)))


def test_a_saved_ladder_under_another_key_is_damage() -> None:
    """It would be advanced under its own target while the copy under the other key repeated
    its step at every poll (a real signal each time)."""
    ladder: Any = PlanState(ladders={"7@70": _SAVED_LADDER}).to_json()["ladders"]
    with pytest.raises(ValueError, match=re.escape("plan.ladders.X7@70: not saved under its")):
        PlanState.from_json({"ladders": {"X7@70": ladder["7@70"]}})


@pytest.mark.parametrize(
    ("part", "value", "message"),
    [
        ("notes", [], "plan.notes: expected an object"),
        ("notes", {"k": 1}, "plan.notes.k: expected a string"),
        ("signal_scopes", [], "plan.signal_scopes: expected an object"),
    ],
)
def test_a_damaged_part_of_the_saved_plan_is_named_by_its_place(
    part: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        PlanState.from_json({part: value})


@pytest.mark.parametrize(
    ("place", "saved"),
    [
        ("forced_reason", lambda why: PlanState(forced_dry_run=True, forced_reason=why)),
        ("paused_reason", lambda why: PlanState(paused=True, paused_reason=why)),
        ("a kill-cap latch", lambda why: PlanState(scope_latches={"uid:7": Latch(why, 1.0)})),
        ("a reset refusal", lambda why: PlanState(reset_refusals={
            GPU0: ResetRefusal("k", why, False, 1.0)})),
        ("a MIG recovery's outcome", lambda why: PlanState(mig_unfinished={
            "MIG-0": MigUnfinished(GPU0, 1, 19, 6, 1, 1.0, why)})),
        ("the would-be node latch", lambda why: PlanState(shadow=DryShadow(capped=why))),
        ("a would-be latch", lambda why: PlanState(shadow=DryShadow(latches={
            "uid:7": (why, 1.0)}))),
    ],
)  # fmt: skip
def test_a_saved_reason_of_any_size_is_read_cut_and_the_rest_of_the_plan_with_it(
    place: str, saved: Callable[[str], PlanState]
) -> None:
    """A state file is read after a crash, an older version or a disk error: a reason in it
    (said in events, the STATUS line and ``status``) is cut as a pause's is, never refused (that
    would move the whole file aside), and one of this length or shorter is kept whole."""
    kept = "r" * MAX_REASON
    assert PlanState.from_json(json.loads(json.dumps(saved(kept).to_json()))) == saved(kept)
    huge = replace(saved(kept + "x" * 100_000), signal_history=(("7@70", 3.0),))
    read = PlanState.from_json(json.loads(json.dumps(huge.to_json())))
    assert read == replace(saved(kept), signal_history=(("7@70", 3.0),)), place


@pytest.mark.parametrize(
    ("place", "saved"),
    [
        ("plan.ladders.7@70.rule", lambda name: PlanState(ladders={
            "7@70": replace(_SAVED_LADDER, rule=name)})),
        ("plan.ladders.7@70.user", lambda name: PlanState(ladders={
            "7@70": replace(_SAVED_LADDER, user=name)})),
        ("plan.ladders.7@70.finding", lambda name: PlanState(ladders={
            "7@70": replace(_SAVED_LADDER, finding_key=name)})),
        ("plan.ladders.7@70.gpu", lambda name: PlanState(ladders={
            "7@70": replace(_SAVED_LADDER, gpu=name)})),
        ("plan.scope_latches", lambda name: PlanState(scope_latches={name: Latch("cap", 1.0)})),
        ("plan.shadow.latches", lambda name: PlanState(shadow=DryShadow(latches={
            name: ("cap", 1.0)}))),
        # Every key and identifier the plan saves is a name: the daemon's are short (finding
        # keys of kind, GPU UUID and pid@start_ticks; GPU and MIG UUIDs; uid:N scopes).
        ("plan.boot_id", lambda name: PlanState(boot_id=name)),
        ("plan.seen", lambda name: PlanState(seen={name: SeenFinding(1.0, "d", None, None)})),
        ("plan.seen.k.gpu", lambda name: PlanState(seen={"k": SeenFinding(1.0, "d", name, None)})),
        ("plan.notes", lambda name: PlanState(notes={name: "quiet"})),
        ("plan.health_waits.g.finding", lambda name: PlanState(health_waits={
            "g": HealthWait(name, 1.0, False)})),
        ("plan.reset_refusals", lambda name: PlanState(reset_refusals={
            name: ResetRefusal("k", "busy", False, 1.0)})),
        ("plan.reset_refusals.g.finding", lambda name: PlanState(reset_refusals={
            "g": ResetRefusal(name, "busy", False, 1.0)})),
        ("plan.mig_unfinished.m.gpu", lambda name: PlanState(mig_unfinished={
            "m": MigUnfinished(name, 1, 19, 6, 1, 1.0, "failed")})),
    ],
)  # fmt: skip
def test_a_saved_name_events_carry_whole_is_refused_past_a_policy_string_s_length(
    place: str, saved: Callable[[str], PlanState]
) -> None:
    """A ladder's rule, user, finding and GPU, a kill-cap scope, a refused reset's GPU and
    finding reach events whole (a signal's rule, an expired latch's scope, a cleared refusal):
    one longer than a policy's strings may be (MAX_STRING) is damage, refused naming its place
    as other malformed values are (cut, it would name another)."""
    kept = "n" * MAX_STRING
    assert PlanState.from_json(json.loads(json.dumps(saved(kept).to_json()))) == saved(kept)
    with pytest.raises(ValueError, match=rf"^{place}: 'n+\.\.\. is longer than {MAX_STRING} char"):
        PlanState.from_json(json.loads(json.dumps(saved(kept + "n").to_json())))


def test_a_saved_ladder_s_target_is_a_name_as_its_key_is() -> None:
    """JSON reads integers of up to 4,300 digits: a target ``pid@start_ticks`` of two such
    (its key too) is refused past MAX_STRING, as every name events carry."""
    digits = int("7" * (MAX_STRING // 2))
    lad = replace(_SAVED_LADDER, target=f"{digits}@{digits // 10}", pid=digits,
                  start_ticks=digits // 10)  # fmt: skip
    assert PlanState.from_json(PlanState(ladders={lad.target: lad}).to_json()).ladders == {
        lad.target: lad
    }
    longer = replace(lad, target=f"{digits}@{digits}", start_ticks=digits)
    with pytest.raises(ValueError, match=rf"^plan.ladders: '7+\.\.\. is longer than {MAX_STRING}"):
        PlanState.from_json(PlanState(ladders={longer.target: longer}).to_json())


def test_a_saved_plan_holds_as_many_kill_cap_latches_as_its_shadow_would_be_ones() -> None:
    """One latch per kill-cap scope (a user): no more than the dry-run shadow keeps
    (MAX_ENTRIES), so ``limits.latches_cleared`` lists at most as many."""
    latches = {f"uid:{uid}": Latch("cap", 1.0) for uid in range(MAX_ENTRIES)}
    assert PlanState.from_json(PlanState(scope_latches=latches).to_json()).scope_latches == latches
    latches["uid:unknown"] = Latch("cap", 1.0)
    with pytest.raises(
        ValueError, match=f"^plan.scope_latches: expected an object of at most {MAX_ENTRIES}$"
    ):
        PlanState.from_json(PlanState(scope_latches=latches).to_json())


def test_ladder_follows_the_process_when_its_finding_changes_kind() -> None:
    rules = [
        Rule("orphans", FindingKind.ORPHANED, LADDER),
        Rule("abandoned", FindingKind.ABANDONED, (Step("SIGKILL", 5.0),)),
    ]
    pol = policy(rules=rules)
    p = proc()
    r = run([orphan(p)], snap([p]), PlanState(), pol, now=0.0)
    state = record_signal(r.state, signals(r)[0], "delivered", now=0.0).state
    flipped = orphan(p, kind=FindingKind.ABANDONED)
    # orphaned → abandoned: no fresh ladder (SIGKILL at once); the SIGTERM's wait still holds.
    r = run([flipped], snap([p]), state, pol, now=20.0)
    assert signals(r) == []
    r = run([flipped], snap([p]), r.state, pol, now=30.0)
    assert [(s.signal, s.step, s.finding_key) for s in signals(r)] == [("SIGKILL", 2, flipped.key)]


@pytest.mark.parametrize(("moved", "cleared"), [(64 * MIB - 1, False), (64 * MIB, True)])
def test_a_refused_incident_is_tried_again_once_its_memory_moved_64_mib(
    moved: int, cleared: bool
) -> None:
    pol = policy(reset=ResetPolicy(confirm_for=0.0, cooldown=0.0, max_resets=10))
    g = ghost()
    r = _reset_run([g], PlanState(), 0.0, pol=pol, gpus=[_with_memory(10 << 30)])
    state = record_reset(r.state, resets(r)[0], "in_use", now=0.0, wall=WALL).state
    state = _reset_run([g], state, 10.0, pol=pol, gpus=[_with_memory(10 << 30)]).state
    r = _reset_run([g], state, 20.0, pol=pol, gpus=[_with_memory((10 << 30) - moved)])
    assert (EventName.RESET_REFUSAL_CLEARED in names(r)) is cleared
    assert len(resets(r)) == int(cleared)
