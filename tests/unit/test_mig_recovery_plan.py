"""Ghost memory in a MIG GPU instance, in the plan: the instance's own gates, then its recovery.

GPU 0 is in MIG mode with GPU instances 1 and 2. GPU instance 1 holds memory nothing uses
(ghost memory); in GPU instance 2 a trainer lives. With ``reset.mig_recovery`` the plan asks
act to re-create GPU instance 1 in place (a :class:`ResetIntent` with ``instance``), after the
confirmation window, under its parent GPU's limits; never a reset of the GPU, never anything
for GPU instance 2, and never while anything may use GPU instance 1.
"""

from __future__ import annotations

import dataclasses

import pytest

from gpuwatchd.core.model import MIB, Finding, FindingKind, Snapshot
from gpuwatchd.core.vocabulary import Cleanliness, EventName, ResetResult
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.plan.decisions import hidden_holders, plan
from gpuwatchd.decide.plan.intents import HookIntent, ResetIntent
from gpuwatchd.decide.plan.outcomes import record_reset
from gpuwatchd.decide.plan.resets import reset_gates
from gpuwatchd.decide.plan.state import PlanState, ResetRefusal, unfinished_recoveries
from gpuwatchd.decide.policy import Detection, Policy, Protect, ResetPolicy, default_rules
from gpuwatchd.decide.verdict import judge
from tests.support.migcases import GI1, GI2, LEAK, first_reset, play, run
from tests.support.migsnap import Inst, with_mig
from tests.support.snapshots import HostBuilder, gpu_uuid

CONFIRM = 60.0


def policy(*, recovery: bool = True, dry_run: bool = False, cooldown: float = 3600.0) -> Policy:
    return dataclasses.replace(
        Policy(dry_run=dry_run, rules=default_rules()),
        reset=ResetPolicy(
            enabled=True, confirm_for=CONFIRM, mig_recovery=recovery, cooldown=cooldown
        ),
    )


def ghost_beside_live_job(builder: HostBuilder | None = None, **mig: object) -> Snapshot:
    """GI 1: 4 GiB allocated, no process listed, no holder. GI 2: live trainer 700 (listed,
    holding GI 2's capabilities and the parent node)."""
    base = (builder or HostBuilder()).gpu(0).proc(700, ppid=1, holds={0}, uvm=True).build()
    options: dict[str, object] = {
        "instances": [
            Inst(1, allocated=LEAK),
            Inst(2, allocated=LEAK, processes=((700, LEAK),), profile="3g.40gb"),
        ],
        "caps": {700: [(2, 0)]},
    }
    options.update(mig)
    return with_mig(base, **options)  # type: ignore[arg-type]


def gates_of(snapshot: Snapshot, chosen: Policy) -> list[tuple[str, str]]:
    """The gates of GI 1's ghost memory (found with nothing holding it) in ``snapshot``, as
    the plan checks them when the finding is still open and something may hold it now."""
    clean = run(ghost_beside_live_job())
    (ghost,) = [f for f in clean.findings if f.kind is FindingKind.GHOST_MEMORY]
    assert ghost.gpu == GI1
    result = run(snapshot)
    gates = reset_gates(ghost, snapshot, chosen, report_only=result.report_only,
                        findings=result.findings)  # fmt: skip
    return [(g.name, g.why) for g in gates]


def test_ghost_memory_in_one_instance_asks_for_its_recovery_once_and_for_nothing_else() -> None:
    asked = play(ghost_beside_live_job(), policy())
    assert len(asked) == 1
    (intent,) = asked
    assert intent.gpu == gpu_uuid(0)  # the parent: its limits and history
    assert intent.instance is not None
    assert (intent.instance.gi, intent.instance.mig_uuid, intent.instance.profile) == (1, GI1, 19)
    assert (intent.instance.placement, intent.instance.size) == (1, 1)
    assert intent.dry_run is False
    assert intent.facts["instance"] == GI1


def test_no_recovery_before_the_confirmation_window_ends() -> None:
    assert play(ghost_beside_live_job(), policy(), steps=6) == []  # 50 s < 60 s


def test_without_mig_recovery_the_instance_is_only_reported() -> None:
    chosen = policy(recovery=False)
    assert gates_of(ghost_beside_live_job(), chosen) == [
        ("mig", "a MIG instance of GPU 0: no GPU reset of an instance (reset.mig_recovery is off)")
    ]
    assert play(ghost_beside_live_job(), chosen) == []


def test_a_dry_run_asks_for_the_same_recovery_marked_dry() -> None:
    (intent,) = play(ghost_beside_live_job(), policy(dry_run=True))
    assert intent.dry_run is True
    assert intent.instance is not None
    assert intent.instance.gi == 1


def test_the_live_job_in_the_other_instance_is_no_gate_of_this_one() -> None:
    assert gates_of(ghost_beside_live_job(), policy()) == []


def test_a_live_holder_of_the_instance_capabilities_blocks_its_recovery() -> None:
    snapshot = ghost_beside_live_job(
        HostBuilder().proc(800, ppid=1, holds={0}, uvm=True), caps={700: [(2, 0)], 800: [(1, 0)]}
    )
    gates = gates_of(snapshot, policy())
    assert ("live_holder", "live holder: GPU instance 1: PID 800 holding its capability files") in (
        gates
    )


def test_a_user_process_holding_only_the_parent_node_blocks_as_unknown() -> None:
    snapshot = ghost_beside_live_job(HostBuilder().proc(801, ppid=1, holds={0}))
    assert gates_of(snapshot, policy()) == [
        (
            "live_holder",
            "live holder: GPU instance 1: PID 801 holding its GPU's device node, instance unknown",
        )
    ]


def test_verified_infrastructure_holding_the_parent_node_does_not_block() -> None:
    persistenced = HostBuilder().proc(
        802, ppid=1, holds={0}, comm="nvidia-persiste", exe="/usr/bin/nvidia-persistenced",
        uid=0, user="root", exe_trusted=True,
    )  # fmt: skip
    snapshot = ghost_beside_live_job(persistenced)
    assert gates_of(snapshot, policy()) == []
    assert len(play(snapshot, policy())) == 1


def test_an_instance_with_two_compute_instances_is_not_recreated() -> None:
    snapshot = ghost_beside_live_job(
        instances=[
            Inst(1, allocated=LEAK, cis=(0, 1)),
            Inst(2, allocated=LEAK, processes=((700, LEAK),), profile="3g.40gb"),
        ]
    )
    (gate,) = gates_of(snapshot, policy())
    assert gate[0] == "mig_recovery"
    assert "has 2 compute instances" in gate[1]
    assert play(snapshot, policy()) == []


@pytest.mark.parametrize("protected", ["parent", "instance"])
def test_protecting_the_gpu_or_the_instance_protects_it(protected: str) -> None:
    entry = gpu_uuid(0) if protected == "parent" else GI1
    chosen = dataclasses.replace(policy(), protect=Protect(gpus=(entry,)))
    assert ("protect", f"protect: gpus {entry}") in gates_of(ghost_beside_live_job(), chosen)
    assert play(ghost_beside_live_job(), chosen) == []


def test_a_recovery_is_booked_on_its_parent_gpu_with_its_instance_named() -> None:
    snapshot = ghost_beside_live_job()
    result = run(snapshot)
    state = PlanState()
    intent = None
    for step in range(12):
        now = snapshot.monotonic + 10.0 * step
        out = plan(result.findings, snapshot, state, policy(), now=now, wall=now,
                   report_only=result.report_only)  # fmt: skip
        state = out.state
        intent = next((i for i in out.intents if isinstance(i, ResetIntent)), intent)
    assert intent is not None
    booked = record_reset(state, intent, ResetResult.SUCCESS, now=200.0, wall=200.0)
    assert list(booked.state.reset_history) == [(gpu_uuid(0), 200.0)]
    (success,) = [e for e in booked.events if e.name == EventName.RESET_SUCCEEDED]
    assert success.fields["instance"] == GI1
    (action,) = [i for i in booked.intents if isinstance(i, HookIntent) and i.hook == "on_action"]
    assert action.facts["action"] == "mig_recovery"


def test_a_refused_recovery_waits_for_its_own_instance_s_memory_not_the_other_s() -> None:
    """The driver refused GPU instance 1 "in use": tried again only when something changed
    there. The live job in GPU instance 2 growing by 1 GiB changes nothing about GPU instance
    1; GPU instance 1's own memory moving by 128 MiB does."""
    chosen = policy(cooldown=0.0)
    snapshot = ghost_beside_live_job()
    intent, state, now = first_reset(snapshot, chosen)
    state = record_reset(state, intent, ResetResult.IN_USE, now=now, wall=now).state

    def poll(snap: Snapshot, at: float) -> tuple[list[str], list[ResetIntent]]:
        nonlocal state
        found = run(snap)
        out = plan(found.findings, snap, state, chosen, now=at, wall=at,
                   report_only=found.report_only)  # fmt: skip
        state = out.state
        cleared = [str(e.fields["why"]) for e in out.events
                   if e.name == EventName.RESET_REFUSAL_CLEARED]  # fmt: skip
        return cleared, [i for i in out.intents if isinstance(i, ResetIntent)]

    assert poll(snapshot, now + 10) == ([], [])  # notes GPU instance 1's memory
    other_grew = ghost_beside_live_job(
        instances=[
            Inst(1, allocated=LEAK),
            Inst(2, allocated=LEAK + 1024 * MIB, processes=((700, LEAK),), profile="3g.40gb"),
        ]
    )
    assert poll(other_grew, now + 20) == ([], [])
    own_moved = ghost_beside_live_job(
        instances=[
            Inst(1, allocated=LEAK + 128 * MIB),
            Inst(2, allocated=LEAK, processes=((700, LEAK),), profile="3g.40gb"),
        ]
    )
    cleared, _ = poll(own_moved, now + 30)
    assert cleared == [f"its allocated memory changed ({LEAK} -> {LEAK + 128 * MIB} bytes)"]


def test_each_instance_keeps_its_own_refusal_and_its_hidden_holder_evidence() -> None:
    """Issue 34, finding 4: the driver refused GPU instance 1 "in use", then GPU instance 2's
    recovery was refused by the procedure (a hook failed). Each refusal is kept for its own
    instance: GPU instance 1 is not tried again (with its drain and hooks) at the next cooldown,
    and its hidden-holder evidence stays; neither ever becomes a reset of the whole GPU."""
    chosen = policy(cooldown=0.0)
    snapshot = with_mig(
        HostBuilder().gpu(0).build(),
        instances=[Inst(1, allocated=LEAK), Inst(2, allocated=LEAK, profile="3g.40gb")],
    )
    result = run(snapshot)
    state = PlanState()
    outcomes = {GI1: ResetResult.IN_USE, GI2: ResetResult.REFUSED}
    asked: list[str | None] = []
    for step in range(30):
        now = snapshot.monotonic + 10.0 * step
        found = _with_refused(snapshot, state)
        out = plan(found.findings, snapshot, state, chosen, now=now, wall=now,
                   report_only=found.report_only)  # fmt: skip
        state = out.state
        for intent in out.intents:
            if isinstance(intent, ResetIntent):
                assert intent.instance is not None  # never the whole GPU
                asked.append(intent.instance.mig_uuid)
                booked = record_reset(state, intent, outcomes[intent.instance.mig_uuid],
                                      now=now, wall=now)  # fmt: skip
                state = booked.state
    assert sorted(asked, key=str) == sorted([GI1, GI2])
    assert set(state.reset_refusals) == {GI1, GI2}
    assert list(hidden_holders(state)) == [GI1]
    assert result.findings  # the ghosts were there all along


def _with_refused(snapshot: Snapshot, state: PlanState) -> Assessment:
    """The assessment as the daemon makes it: with the driver's refusals (plan.hidden_holders)."""
    return assess(snapshot, AssessState(boot_id=snapshot.boot_id), Detection(),
                  driver_refused=hidden_holders(state))  # fmt: skip


def test_an_instance_the_driver_refused_in_use_blocks_a_reset_of_the_whole_gpu() -> None:
    """Issue 34: "in use" with no holder found is retried later, never turned into a reset of
    the whole GPU, even where ``reset.allow_mig`` allows one of an idle MIG GPU."""
    snapshot = with_mig(HostBuilder().gpu(0).build(), instances=[Inst(1, allocated=LEAK)])
    refusal = ResetRefusal("ghost_memory:" + GI1, "in use", True, 100.0)
    found = _with_refused(snapshot, PlanState(reset_refusals={GI1: refusal}))
    (hidden,) = [f for f in found.findings if f.kind is FindingKind.HIDDEN_HOLDER]
    assert hidden.gpu == GI1
    whole = Finding(FindingKind.GHOST_MEMORY, gpu_uuid(0), None, None, "leak")
    chosen = dataclasses.replace(
        policy(), reset=dataclasses.replace(policy().reset, allow_mig=True)
    )
    gates = reset_gates(whole, snapshot, chosen, report_only={}, findings=found.findings)
    assert [g.name for g in gates] == ["live_holder"]
    assert GI1 in gates[0].why


def test_a_recovery_stopped_halfway_keeps_its_gpu_dirty_until_the_instance_is_back() -> None:
    """Issue 34, finding 5: ``-dgi`` ran, the re-create did not. GPU instance 1 is gone, and its
    ghost_memory finding with it; the GPU must not be called clean (check-clean, the undrain
    timer) until an instance of its GI profile is at its placement again."""
    chosen = policy()
    snapshot = ghost_beside_live_job()
    intent, state, now = first_reset(snapshot, chosen)
    state = record_reset(state, intent, ResetResult.FAILED, now=now, wall=now).state
    assert list(state.mig_unfinished) == [GI1]
    assert PlanState.from_json(state.to_json()) == state  # kept across a restart

    trainer = Inst(2, allocated=LEAK, processes=((700, LEAK),), profile="3g.40gb")
    gone = ghost_beside_live_job(instances=[trainer])
    found = run(gone)
    before = judge(gone, found, chosen)  # what the verdict said without it: clean
    assert before.gpus[0].state is Cleanliness.CLEAN
    verdict = judge(gone, found, chosen, unfinished=unfinished_recoveries(state))
    (parent,) = [g for g in verdict.gpus if g.uuid == gpu_uuid(0)]
    assert parent.state is Cleanliness.DIRTY
    assert [r.kind for r in parent.reasons] == ["mig_unfinished"]
    assert "MIG GPU instance 1" in parent.reasons[0].text
    out = plan(found.findings, gone, state, chosen, now=now + 10, wall=now + 10,
               report_only=found.report_only)  # fmt: skip
    assert out.state.mig_unfinished == state.mig_unfinished  # still gone: still dirty

    back = ghost_beside_live_job(instances=[Inst(1), trainer])  # re-created by hand
    found = run(back)
    out = plan(found.findings, back, out.state, chosen, now=now + 20, wall=now + 20,
               report_only=found.report_only)  # fmt: skip
    assert out.state.mig_unfinished == {}
    (cleared,) = [e for e in out.events if e.name == EventName.RESET_MIG_UNFINISHED_CLEARED]
    assert cleared.fields["instance"] == GI1
    assert judge(back, found, chosen, unfinished=unfinished_recoveries(out.state)).clean


def test_a_refusal_saved_under_the_parent_gpu_by_an_older_version_still_holds_its_instance() -> (
    None
):
    """A state file from before refusals were kept per instance has GPU instance 1's refusal
    under its parent GPU; it still holds GPU instance 1's incident (found by its key)."""
    snapshot = ghost_beside_live_job()
    result = run(snapshot)
    (ghost,) = [f for f in result.findings if f.kind is FindingKind.GHOST_MEMORY]
    old = ResetRefusal(ghost.key, "the driver refused: in use", True, snapshot.wall_time)
    state = PlanState(reset_refusals={gpu_uuid(0): old})
    asked = []
    for step in range(12):
        now = snapshot.monotonic + 10.0 * step
        out = plan(result.findings, snapshot, state, policy(cooldown=0.0), now=now, wall=now,
                   report_only=result.report_only)  # fmt: skip
        state = out.state
        asked += [i for i in out.intents if isinstance(i, ResetIntent)]
    assert asked == []
