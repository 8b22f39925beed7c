"""The reset of a whole MIG GPU in the plan (issue 37, part 2).

GPU 0 is in MIG mode with GPU instances 1 and 2, and NVML's recovery action says GPU_RESET.
With ``reset.allow_mig`` the reset is planned once no process uses any instance, carrying the
layout to create again afterwards; while an instance is in use, or when the layout could not
be created again as it is, it is never planned.
"""

from __future__ import annotations

import dataclasses

from gpuwatchd.core.model import FindingKind, Snapshot
from gpuwatchd.core.vocabulary import ResetResult
from gpuwatchd.decide.plan.intents import HookIntent
from gpuwatchd.decide.plan.outcomes import record_reset
from gpuwatchd.decide.plan.resets import reset_gates
from gpuwatchd.decide.plan.state import PlanState, unfinished_recoveries
from gpuwatchd.decide.policy import Policy, ResetPolicy, default_rules
from tests.support.healthcases import health
from tests.support.migcases import LEAK, play, run
from tests.support.migsnap import Inst, with_mig
from tests.support.snapshots import HostBuilder


def policy(*, allow_mig: bool = True) -> Policy:
    return dataclasses.replace(
        Policy(dry_run=False, rules=default_rules()),
        reset=ResetPolicy(enabled=True, confirm_for=0.0, allow_mig=allow_mig),
    )


def needs_reset(busy: bool = False, cis: tuple[int, ...] = (0,)) -> Snapshot:
    """GPU 0 in MIG mode (GI 1 at placement 1, GI 2 at 2), its recovery action GPU_RESET.
    ``busy``: a live trainer 700 in GI 2."""
    builder = HostBuilder().gpu(0)
    if busy:
        builder = builder.proc(700, ppid=1, holds={0}, uvm=True)
    snapshot = with_mig(
        builder.build(),
        instances=[
            Inst(1, cis=cis),
            Inst(2, processes=((700, LEAK),) if busy else (), profile="3g.40gb"),
        ],
        caps={700: [(2, 0)]} if busy else {},
    )
    (gpu,) = snapshot.nvml.gpus
    reading = dataclasses.replace(
        snapshot.nvml, gpus=(dataclasses.replace(gpu, health=health(recovery_action=1)),)
    )
    return dataclasses.replace(snapshot, nvml=reading)


def gate_names(snapshot: Snapshot, chosen: Policy) -> list[str]:
    result = run(snapshot)
    (finding,) = [f for f in result.findings if f.kind is FindingKind.RESET_REQUIRED]
    gates = reset_gates(finding, snapshot, chosen, report_only=result.report_only,
                        findings=result.findings)  # fmt: skip
    return [g.name for g in gates]


def test_an_idle_mig_gpu_asking_for_a_reset_is_reset_once_with_its_layout() -> None:
    """Before: the GPU stayed report-only as a whole ("MIG enabled: the GPU as a whole is
    report-only") and no reset was ever planned."""
    snapshot = needs_reset()
    assert gate_names(snapshot, policy()) == []
    (intent,) = play(snapshot, policy(), steps=6)
    assert intent.instance is None
    assert [(r.gi, r.profile, r.placement, r.size) for r in intent.layout] == [
        (1, 19, 1, 1),
        (2, 19, 2, 1),
    ]
    assert intent.facts["mig_layout"] == [
        "MIG GPU instance 1 of GPU 0 (GI profile 19, placement 1:1)",
        "MIG GPU instance 2 of GPU 0 (GI profile 19, placement 2:1)",
    ]


def test_a_busy_mig_gpu_is_never_reset_while_an_instance_is_in_use() -> None:
    snapshot = needs_reset(busy=True)
    assert "mig_busy" in gate_names(snapshot, policy())
    assert play(snapshot, policy(), steps=6) == []


def test_without_allow_mig_the_mig_gpu_stays_report_only() -> None:
    assert gate_names(needs_reset(), policy(allow_mig=False))[:1] == ["report_only"]
    assert play(needs_reset(), policy(allow_mig=False), steps=6) == []


def test_a_layout_that_could_not_be_created_again_refuses_the_reset() -> None:
    """Two compute instances in GI 1: ``-cgi ... -C`` would bring back one; never reset."""
    snapshot = needs_reset(cis=(0, 1))
    assert "mig_layout" in gate_names(snapshot, policy())
    assert play(snapshot, policy(), steps=6) == []


def test_a_failed_layout_restore_keeps_every_instance_unfinished_until_seen_back() -> None:
    """The GPU is not clean (check-clean, status's verdict) while any instance of its layout
    may be missing; a success clears them."""
    (intent,) = play(needs_reset(), policy(), steps=6)
    booked = record_reset(PlanState(), intent, ResetResult.FAILED, now=0.0, wall=0.0)
    failed = booked.state
    assert sorted(u.gi for u in failed.mig_unfinished.values()) == [1, 2]
    said = unfinished_recoveries(failed)[intent.gpu]
    assert "MIG GPU instance 1" in said
    assert "MIG GPU instance 2" in said
    hooks = [i.hook for i in booked.intents if isinstance(i, HookIntent)]
    assert "on_failure" in hooks
    done = record_reset(failed, intent, ResetResult.SUCCESS, now=1.0, wall=1.0).state
    assert done.mig_unfinished == {}
