"""Dry run previews enforcement: the same decisions, in the same order, once, marked would-be.

A dry run keeps a shadow of the limits and history enforcement would have (decide/plan/shadow.py):
a would-be reset counts against ``max_resets`` and the cooldown and is assumed to have
succeeded; a would-be ladder counts against the kill cap, whose would-be latch holds what
enforcement's would hold; a would-be SIGKILL is assumed to end its target. These tests run the
daemon's own engine (``simulate``) once dry and once enforcing (``--enforce``) over the same
incident and compare the decision lists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.cli.main import main
from gpuwatchd.core.model import ProcessIdentity
from gpuwatchd.core.vocabulary import EventName, LadderStatus
from gpuwatchd.decide.plan.decisions import clear_forced_dry_run
from gpuwatchd.decide.plan.intents import HookIntent, ResetIntent
from gpuwatchd.decide.plan.outcomes import record_assumed_exit, record_reset
from gpuwatchd.decide.plan.shadow import DryShadow, ShadowWork
from gpuwatchd.decide.plan.state import Ladder, PlanState
from gpuwatchd.decide.policy import Limits
from gpuwatchd.sim.scenario import load_scenario, parse_scenario
from gpuwatchd.sim.simulation import simulate
from gpuwatchd.sim.timeline import SimulationResult

SCENARIOS = Path(__file__).resolve().parents[2] / "examples" / "scenarios"
GPU0 = "GPU-00000000-0000-4000-8000-000000000000"

# What the daemon decides (observations of the world, the reset's inner steps and the bookings
# that repeat reset.outcome are left out).
DECISIONS = (
    EventName.HEALTH_DRAIN_STARTED,
    EventName.HEALTH_DRAIN_WAITING,
    EventName.HEALTH_DRAIN_TIMED_OUT,
    EventName.ESCALATION_STEP_DUE,
    EventName.ESCALATION_RESOLVED,
    EventName.ESCALATION_ENDED,
    EventName.ACTION_SIGNAL,
    EventName.ACTION_REFUSED,
    EventName.LIMITS_KILL_CAP_REACHED,
    EventName.RESET_DUE,
    EventName.RESET_REFUSED,
    EventName.RESET_LIMIT_REACHED,
    EventName.RESET_OUTCOME,
    EventName.HOOK_RUN,
    EventName.GPU_NEEDS_REBOOT,
)
WOULD_BE: dict[str, str] = {EventName.ACTION_SIGNAL: "outcome", EventName.RESET_OUTCOME: "result"}


def decisions(result: SimulationResult) -> list[tuple[object, ...]]:
    """(event, time, GPU, pid, signal, step, hook, argv) per decision, marks left out."""
    return [
        (
            e.name,
            e.t,
            e.fields.get("gpu"),
            e.fields.get("pid"),
            e.fields.get("signal"),
            e.fields.get("step") if e.name == EventName.ESCALATION_STEP_DUE else None,
            e.fields.get("hook"),
            json.dumps(e.fields.get("argv")),
        )
        for e in result.timeline
        if e.name in DECISIONS
    ]


def assert_marked_would_be(result: SimulationResult) -> None:
    for e in result.timeline:
        if e.name not in DECISIONS:
            continue
        if "dry_run" in e.fields:
            assert e.fields["dry_run"] is True, (e.name, e.fields)
        if e.name in WOULD_BE:
            assert e.fields[WOULD_BE[e.name]] == "dry_run", (e.name, e.fields)


def both(text: str) -> tuple[SimulationResult, SimulationResult]:
    scenario = parse_scenario("incident.yaml", text)
    dry = simulate(scenario)
    assert dry.policy.dry_run
    enforcing = simulate(scenario, enforce=True)
    assert not enforcing.policy.dry_run
    return dry, enforcing


# A GPU whose driver keeps raising Xid 95 (say a failing HBM stack): enforcement resets it at
# most max_resets times per window, a cooldown apart, then says the limit is reached.
FLAPPING = """\
duration: 12m
policy:
  dry_run: true
  reset:
    max_resets: 2
    cooldown: 2m
    drain:
      - command: [scontrol, update, "nodename={hostname}", drain, "reason={uuid} {pci_bus_id}"]
    after:
      - command: [/usr/local/sbin/undrain, "{pci_bus_id}"]
gpus:
  - index: 0
  - index: 1
events:
  - {at: 30s, xid: {gpu: 0, xid: 95}}
  - {at: 3m, xid: {gpu: 0, xid: 95}}
  - {at: 6m, xid: {gpu: 0, xid: 95}}
  - {at: 9m, xid: {gpu: 0, xid: 95}}
"""


def test_a_health_incident_previews_the_same_resets_limit_and_hooks_as_enforcement() -> None:
    dry, enforcing = both(FLAPPING)
    assert decisions(dry) == decisions(enforcing)
    assert_marked_would_be(dry)
    assert [r for _, _, r in enforcing.resets()] == ["success", "success"]
    assert [r for _, _, r in dry.resets()] == ["dry_run", "dry_run"]
    # max_resets: 2 stops both runs at the third incident, in the same words.
    (limit,) = dry.entries(EventName.RESET_LIMIT_REACHED)
    (real_limit,) = enforcing.entries(EventName.RESET_LIMIT_REACHED)
    assert limit.t == real_limit.t
    assert limit.fields["why"] == real_limit.fields["why"]
    # The health findings come and go at the same times too (the would-be reset is assumed
    # to have succeeded, and the timeline says so).
    health = (EventName.FINDING_NEW, EventName.FINDING_RESOLVED)
    assert [(e.name, e.t) for e in dry.timeline if e.name in health] == [
        (e.name, e.t) for e in enforcing.timeline if e.name in health
    ]
    assumed = dry.entries(EventName.RESET_DRY_RUN)
    assert len(assumed) == 2
    assert all(str(e.fields["assumed"]).startswith("success") for e in assumed)
    assert "assumed to have succeeded" in assumed[0].text


def test_would_be_hooks_show_their_argv_filled_in() -> None:
    dry, enforcing = both(FLAPPING)
    drains = [e for e in dry.entries(EventName.HOOK_RUN) if e.fields["hook"] == "reset_drain"]
    assert drains[0].fields["argv"] == [
        "scontrol", "update", "nodename=sim-node", "drain", f"reason={GPU0} 00000000:17:00.0",
    ]  # fmt: skip
    assert drains[0].fields["dry_run"] is True
    real = [e for e in enforcing.entries(EventName.HOOK_RUN) if e.fields["hook"] == "reset_drain"]
    assert real[0].fields["argv"] == drains[0].fields["argv"]
    assert real[0].fields["returncode"] == 0  # it ran: every placeholder had its value
    # The reset procedure's own would-be hooks are filled in as well.
    after = [
        e for e in dry.entries(EventName.RESET_STEP)
        if e.fields["step"] == "after_hooks" and e.fields["status"] == "would_run"
    ]  # fmt: skip
    assert after[0].fields["hooks"] == [["/usr/local/sbin/undrain", "00000000:17:00.0"]]


def test_each_would_be_reset_appears_once_per_incident_not_once_per_cooldown() -> None:
    # The case: generous limits, a short cooldown, one incident the driver keeps
    # reporting (the recovery action stays GPU_RESET until a reset). Enforcement resets once.
    text = """\
duration: 9m
policy:
  dry_run: true
  reset: {max_resets: 5, cooldown: 30s}
gpus:
  - index: 0
    health: {recovery_action: NONE}
events:
  - {at: 20s, health: {gpu: 0, recovery_action: GPU_RESET}}
"""
    dry, enforcing = both(text)
    assert len(dry.entries(EventName.RESET_DUE)) == 1
    # A dry run does not read the GPU again before the reset command (as_planned).
    steps = [
        e for e in enforcing.entries(EventName.RESET_STEP) if e.fields["status"] != "as_planned"
    ]
    assert len(dry.entries(EventName.RESET_STEP)) == len(steps) == 11
    assert decisions(dry) == decisions(enforcing)
    assert dry.final["open_findings"] == enforcing.final["open_findings"] == []


def kill_storm(workers: int, cap: int) -> str:
    procs = "".join(
        f"""  - name: worker-{i}
    pid: {4250 + i}
    ppid: trainer
    pgid: trainer
    user: alice
    command: python train.py
    cgroup: /user.slice/user-1000.slice/session-3.scope
    holds: {{gpus: [0], via: map}}
    on_sigterm: ignore
"""
        for i in range(workers)
    )
    return f"""\
duration: 4m
policy:
  dry_run: true
  limits: {{max_signalled_per_poll: {cap}}}
  on_action:
    - command: [/usr/local/sbin/notify, "{{user}}"]
gpus:
  - index: 0
processes:
  - name: trainer
    pid: 4242
    user: alice
    command: python train.py
    cgroup: /user.slice/user-1000.slice/session-3.scope
    holds: [0]
    nvml: {{0: 10GiB}}
{procs}events:
  - {{at: 20s, exit: trainer}}
"""


def test_a_kill_storm_previews_the_same_ladders_cap_and_holds_as_enforcement() -> None:
    dry, enforcing = both(kill_storm(workers=6, cap=4))
    assert decisions(dry) == decisions(enforcing)
    assert_marked_would_be(dry)
    # Enforcement: 4 real SIGTERMs, the cap, 2 forced dry-run ladders; the 4 held after it.
    assert [o for _, _, _, o in enforcing.signals()].count("delivered") == 4
    (cap,) = dry.entries(EventName.LIMITS_KILL_CAP_REACHED)
    assert cap.fields["dry_run"] is True
    assert cap.level == "warning"  # a would-be latch switches nothing
    assert "would be reached" in cap.text
    held = [e for e in dry.entries(EventName.ACTION_REFUSED) if "kill cap" in str(e.fields["why"])]
    assert len(held) == 4
    # The cap is per user: enforcement latches alice's targets only, and so does the preview.
    (real_cap,) = enforcing.entries(EventName.LIMITS_KILL_CAP_REACHED)
    assert cap.fields["scope"] == real_cap.fields["scope"] == "uid:1000"
    # Both count the 4 ladders that signalled within the hour before the cap.
    assert cap.fields["signalled_this_hour"] == real_cap.fields["signalled_this_hour"] == 4
    # A dry run never latches anything for real; a user's cap does not latch the node.
    assert dry.final["forced_dry_run"] is False
    assert enforcing.final["forced_dry_run"] is False


def test_a_kill_storm_after_a_report_only_step_previews_the_same_cap_and_holds() -> None:
    """Ladders that begin with a report-only step pass their start uncounted; enforcement
    checks the cap at their first signal, and so does the preview: the would-be latch holds
    the rest instead of forcing them on."""
    rules = """  rules:
    - name: orphans
      kind: orphaned
      steps: [{signal: null, wait: 30s}, {signal: SIGKILL, wait: 10s}]
"""
    text = kill_storm(workers=6, cap=2).replace("  on_action:", rules + "  on_action:", 1)
    dry, enforcing = both(text)
    assert decisions(dry) == decisions(enforcing)
    assert_marked_would_be(dry)
    assert [o for _, _, _, o in enforcing.signals()].count("delivered") == 2
    (cap,) = dry.entries(EventName.LIMITS_KILL_CAP_REACHED)
    assert cap.fields["dry_run"] is True
    assert cap.fields["scope"] == "uid:1000"
    assert len(dry.signals()) == 2  # the rest held, not run on as forced would-be ladders
    held = [e for e in dry.entries(EventName.ACTION_REFUSED) if "kill cap" in str(e.fields["why"])]
    assert len(held) == 4


def test_one_users_kill_storm_previews_a_latch_for_that_user_only() -> None:
    """Bob's orphaned worker, its ladder already under way when alice's storm comes:
    enforcement latches alice alone and goes on signalling bob's for real; the preview holds
    alice's would-be ladders only, as enforcement does, and lets bob's run on."""
    text = kill_storm(workers=6, cap=4)
    bob = """  - name: bob-trainer
    pid: 5242
    user: bob
    uid: 1001
    command: python other.py
    cgroup: /user.slice/user-1001.slice/session-4.scope
    holds: [0]
    nvml: {0: 2GiB}
  - name: bob-worker
    pid: 5250
    ppid: bob-trainer
    pgid: bob-trainer
    user: bob
    uid: 1001
    command: python other.py
    cgroup: /user.slice/user-1001.slice/session-4.scope
    holds: {gpus: [0], via: map}
    on_sigterm: ignore
events:
  - {at: 10s, exit: bob-trainer}
"""
    text = text.replace("events:\n", bob, 1)
    dry, enforcing = both(text)
    # The same decisions at the same times; within one instant the virtual world reports real
    # exits in its own order, the preview its assumed ones in signal order.
    assert sorted(map(str, decisions(dry))) == sorted(map(str, decisions(enforcing)))
    assert [d[1] for d in decisions(dry)] == [d[1] for d in decisions(enforcing)]
    assert_marked_would_be(dry)
    real = {(p, sig) for _, p, sig, o in enforcing.signals() if o == "delivered"}
    assert ("bob-worker", "SIGKILL") in real  # bob's ladder ran to its end, for real
    would = {(p, sig) for _, p, sig, _ in dry.signals()}
    assert ("bob-worker", "SIGKILL") in would
    held = [e for e in dry.entries(EventName.ACTION_REFUSED) if "kill cap" in str(e.fields["why"])]
    assert held
    assert all(str(e.fields.get("process", "")) != "bob-worker" for e in held)


def test_a_would_be_sigkill_ends_its_ladder_as_a_real_one_would() -> None:
    dry, enforcing = both(kill_storm(workers=2, cap=16))
    assert decisions(dry) == decisions(enforcing)
    resolved = dry.entries(EventName.ESCALATION_RESOLVED)
    assert len(resolved) == 2
    assert all("would-be SIGKILL" in str(e.fields["why"]) for e in resolved)
    # Its on_action notification is shown as a would-be one, filled in.
    notes = [e for e in dry.entries(EventName.HOOK_RUN) if e.fields["hook"] == "on_action"]
    assert [e.fields["argv"] for e in notes] == [["/usr/local/sbin/notify", "alice"]] * 2
    # Never a second ladder for a target assumed gone: no signal after the SIGKILLs.
    last_kill = max(t for t, _, s, _ in dry.signals() if s == "SIGKILL")
    assert all(t <= last_kill for t, _, _, _ in dry.signals())


def test_a_dry_run_with_sigterm_exits_differs_only_where_it_cannot_know() -> None:
    # SIGTERM can be caught: a dry run cannot assume it ends a target, so its preview goes
    # on to SIGKILL where enforcement saw the target exit. Nothing else differs.
    text = kill_storm(workers=1, cap=16).replace("    on_sigterm: ignore\n", "")
    dry, enforcing = both(text)
    assert [s for _, _, s, _ in enforcing.signals()] == ["SIGTERM"]
    assert [s for _, _, s, _ in dry.signals()] == ["SIGTERM", "SIGKILL"]


# --- the shadow in plan -----------------------------------------------------------------------


def dry_reset(state: PlanState, t: float, *, would_succeed: bool) -> PlanState:
    intent = ResetIntent(GPU0, None, 0, f"reset_required:{GPU0}:gpu", True, "test", {})
    return record_reset(
        state, intent, "dry_run", now=t, wall=1000.0 + t, would_succeed=would_succeed
    ).state


def test_only_a_would_be_reset_that_goes_all_the_way_is_booked() -> None:
    state = dry_reset(PlanState(), 1.0, would_succeed=True)
    assert state.shadow.resets == ((GPU0, 1001.0),)
    assert state.shadow.done == {f"reset_required:{GPU0}:gpu": 1001.0}
    refused = dry_reset(PlanState(), 1.0, would_succeed=False)
    assert refused.shadow == DryShadow()
    assert refused.last_dry_reset == {GPU0: 1001.0}  # the cooldown still applies


def test_the_shadow_survives_a_restart_and_rejects_garbage() -> None:
    state = dry_reset(PlanState(), 1.0, would_succeed=True)
    again = PlanState.from_json(json.loads(json.dumps(state.to_json())))
    assert again.shadow == state.shadow
    assert PlanState.from_json({}).shadow == DryShadow()  # older state files: empty
    bad: Any
    for bad in (
        {"resets": [["gpu"]]},
        {"resets": [["gpu", "soon"]]},
        {"done": ["x"]},
        {"capped": 3},
        {"forced": [1]},
        {"scopes": {"1@2": 3}},
        {"capped_since": "now"},
        {"latches": {"uid:1000": ["why"]}},
        {"latches": {"uid:1000": ["why", "then"]}},
        "shadow",
    ):
        with pytest.raises(ValueError, match="shadow"):
            PlanState.from_json({"shadow": bad})


def ladder(*, dry: bool, status: LadderStatus = LadderStatus.ACTIVE) -> Ladder:
    return Ladder(
        target="4250@77", pid=4250, start_ticks=77, finding_key="orphaned:g:4250@77",
        rule="orphans", gpu="g", steps=(("SIGTERM", 30.0), ("SIGKILL", 10.0)), step=2,
        due=120.0, status=status, dry_run=dry, started=50.0, user="alice",
    )  # fmt: skip


def test_a_would_be_sigkill_ends_only_an_active_dry_ladder() -> None:
    identity = ProcessIdentity(4250, 77)
    state = PlanState(ladders={"4250@77": ladder(dry=True)}, waiting={"orphaned:g:4250@77": 120.0})
    result = record_assumed_exit(state, identity, now=110.0)
    assert result.state.ladders["4250@77"].status is LadderStatus.ENDED  # kept: never again
    assert result.state.waiting == {}
    assert [e.name for e in result.events] == [EventName.ESCALATION_RESOLVED]
    assert [(i.hook, i.dry_run) for i in result.intents if isinstance(i, HookIntent)] == [
        ("on_action", True)
    ]
    assert len(result.intents) == 1
    for other in (ladder(dry=False), ladder(dry=True, status=LadderStatus.STUCK)):
        untouched = PlanState(ladders={"4250@77": other})
        assert record_assumed_exit(untouched, identity, now=110.0).state == untouched


def test_clearing_the_latches_clears_the_would_be_one_too() -> None:
    state = PlanState(shadow=DryShadow(capped="more than 4", forced=("1@2",)))
    assert clear_forced_dry_run(state).shadow == DryShadow()
    users = PlanState(shadow=DryShadow(latches={"uid:1000": ("more than 4", 5.0)}, forced=("1@2",)))
    assert clear_forced_dry_run(users).shadow == DryShadow()


def test_a_would_be_latch_counts_per_user_survives_a_restart_and_expires_as_enforcements() -> None:
    """The shadow counts a user's would-be ladders against that user's caps (the node's
    hourly cap against everyone's), holds only that user's, and lifts after
    ``limits.kill_cap_latch`` like enforcement's latch; the node's lifts the same way."""
    limits = Limits(max_signalled_per_poll=2, max_signalled_per_hour=64,
                    node_max_signalled_per_hour=4, kill_cap_latch=600.0)  # fmt: skip
    work = ShadowWork(DryShadow())
    for n in range(2):
        assert work.admit(f"{n}@1", "uid:1000", limits, wall=100.0) is None
        work.count(f"{n}@1", "uid:1000", now=10.0)
    assert work.admit("9@1", "uid:1001", limits, wall=100.0) is None  # bob: his own count
    work.count("9@1", "uid:1001", now=10.0)
    latched = work.admit("2@1", "uid:1000", limits, wall=100.0)
    assert latched == ("uid:1000", "more than 2 processes of uid:1000 in one poll")
    assert work.holds("0@1", "uid:1000")
    assert not work.holds("2@1", "uid:1000")
    assert not work.holds("9@1", "uid:1001")
    saved = DryShadow.from_json(json.loads(json.dumps(work.freeze().to_json())))
    assert saved == work.freeze()
    assert saved.scopes == {"0@1": "uid:1000", "1@1": "uid:1000", "9@1": "uid:1001"}
    later = ShadowWork(saved)
    assert later.expire(699.0, 600.0) == []
    assert later.expire(700.0, 600.0) == [("uid:1000", latched[1], 600.0)]
    assert not later.holds("0@1", "uid:1000")
    # The node's hourly cap counts everyone's: the fifth would-be ladder latches the node.
    later.count("3@1", "uid:1002", now=20.0)
    assert later.admit("5@1", "uid:1003", limits, wall=800.0) == (
        "node", "more than 4 processes in one hour on the node"
    )  # fmt: skip
    assert later.holds("9@1", "uid:1001")
    assert later.expire(1400.0, 600.0) == [
        ("node", "more than 4 processes in one hour on the node", 600.0)
    ]


# --- simulate --enforce -----------------------------------------------------------------------


def test_simulate_enforce_previews_a_dry_run_policy_as_enforcing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "storm.yaml"
    path.write_text(kill_storm(workers=2, cap=16))
    assert main(["simulate", str(path)]) == 0
    dry = capsys.readouterr().out
    assert main(["simulate", "--enforce", str(path)]) == 0
    enforcing = capsys.readouterr().out
    assert "dry-run; policy: built-in defaults + the scenario's policy\n" in dry
    assert (
        "enforcing; policy: built-in defaults + the scenario's policy (--enforce: dry_run off)"
        in enforcing
    )
    assert "Sent SIGKILL to pid 4250 (worker-0) on GPU 0" in enforcing
    assert "Dry run: would send SIGKILL to pid 4250 (worker-0) on GPU 0" in dry


def test_simulate_help_tells_where_its_policy_comes_from(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "/etc/gpuwatchd" not in text
    assert "default: the built-in defaults with the scenario's policy over them" in text
    assert "--enforce" in text


@pytest.mark.parametrize(
    "name",
    ["xid-95-reset", "xid-48-solo-idle", "xid-154-drain-and-reset", "pending-row-remap-unisolated",
     "drain-p2p-settles-to-reset", "xid-94-two-jobs", "recovery-action-unknown"],
)  # fmt: skip
def test_the_example_health_scenarios_preview_as_they_enforce(name: str) -> None:
    """Every health scenario whose resets succeed (a dry run assumes they do: it cannot know
    that a reset command will fail or a fabric stay stuck) previews exactly."""
    text = (SCENARIOS / f"{name}.yaml").read_text()
    assert "  dry_run: false\n" in text
    enforcing = simulate(load_scenario(str(SCENARIOS / f"{name}.yaml")))
    dry = simulate(parse_scenario(name, text.replace("  dry_run: false\n", "  dry_run: true\n")))
    assert dry.policy.dry_run
    assert not enforcing.policy.dry_run
    assert decisions(dry) == decisions(enforcing)
    assert_marked_would_be(dry)
