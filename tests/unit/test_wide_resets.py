"""Reset gates and the full-scan rule that the wide mutation run (tests/mutation, ``--wide``)
found untested, one behaviour each: the level a refusal is logged at, the gates' names, which
pid-less findings hold a GPU, a refused reset whose GPU left the snapshot, the dry run's
history counted on top of the real one, and what a reset intent carries.
"""

from __future__ import annotations

import dataclasses

import pytest

from gpuwatchd.core.model import (
    ARCH_VOLTA,
    MIB,
    Finding,
    FindingKind,
    GpuMemory,
    MigDevice,
    Snapshot,
)
from gpuwatchd.core.vocabulary import EventName, Level
from gpuwatchd.decide.full_scan import has_unowned_memory
from gpuwatchd.decide.plan.intents import ResetIntent
from gpuwatchd.decide.plan.resets import ResetGate, instance_recovery, reset_gates
from gpuwatchd.decide.plan.shadow import DryShadow
from gpuwatchd.decide.plan.state import PlanState, ResetRefusal
from gpuwatchd.decide.policy import Detection, Policy, ResetPolicy
from tests.support.gatecases import GPU0, GPU1, WALL, _ghost, _plan, _policy, _resets, _whys
from tests.support.migsnap import Inst, mig_uuid, with_mig
from tests.support.snapshots import HostBuilder

GI1 = mig_uuid(0, 1)
GIB = 1024 * MIB

# --- the full-scan rule: a GPU instance whose memory could not be read -------------------------


def _instance(gi: int, memory: GpuMemory | None) -> MigDevice:
    return MigDevice(index=gi, uuid=mig_uuid(0, gi), gi=gi, ci=0, memory=memory, processes=())


@pytest.mark.parametrize(
    ("others", "due"),
    [
        ((), False),  # unknown memory is no reason to scan every poll
        ((3 * GIB,), True),  # the next instance still counts
    ],
)
def test_an_instance_whose_memory_is_unknown_is_skipped_not_fatal(
    others: tuple[int, ...], due: bool
) -> None:
    devices = (
        _instance(1, None),
        *(
            _instance(2 + n, GpuMemory(total=10 * GIB, free=None, reserved=0, allocated=a))
            for n, a in enumerate(others)
        ),
    )
    (gpu,) = HostBuilder().gpu(0, mig=True).build().nvml.gpus
    gpu = dataclasses.replace(gpu, mig_devices=devices)
    assert has_unowned_memory(gpu, {}, Detection()) is due


# --- reset_gates: each gate's name, reason and level --------------------------------------------


def _mig_host(*, lost: bool = False, cis: tuple[int, ...] = (0,)) -> Snapshot:
    base = HostBuilder().gpu(0, lost=lost).build()
    return with_mig(base, instances=[Inst(1, allocated=4 * GIB, cis=cis)])


def _instance_ghost() -> Finding:
    return dataclasses.replace(_ghost(), gpu=GI1)


_RECOVERY = _policy(reset=ResetPolicy(confirm_for=60.0, mig_recovery=True))
_LOST = "GPU is lost (needs reboot)"


@pytest.mark.parametrize(
    ("case", "snapshot", "finding", "policy", "expected"),
    [
        (
            "not actionable",
            HostBuilder().gpu(0).build(),
            dataclasses.replace(_ghost(), actionable=False),
            _policy(),
            [ResetGate("not_actionable", "not_actionable", Level.INFO)],
        ),
        (
            "host namespaces not visible",
            HostBuilder(host_namespaces=None).gpu(0).build(),
            _ghost(),
            _policy(),
            [
                ResetGate(
                    "blocked", "blocked: host PID/cgroup namespaces not visible", Level.WARNING
                )
            ],
        ),
        (
            "GPU not in the snapshot",
            HostBuilder().gpu(0).build(),
            _ghost(GPU1),
            _policy(),
            [ResetGate("gpu", "GPU not in this snapshot", Level.WARNING)],
        ),
        (
            "GPU lost",
            HostBuilder().gpu(0, lost=True).build(),
            _ghost(),
            _policy(),
            [ResetGate("gpu", _LOST, Level.WARNING)],
        ),
        (
            "the parent of the instance lost",
            _mig_host(lost=True),
            _instance_ghost(),
            _RECOVERY,
            [ResetGate("gpu", _LOST, Level.WARNING)],
        ),
        (
            "an instance of two compute instances",
            _mig_host(cis=(0, 1)),
            _instance_ghost(),
            _RECOVERY,
            [
                ResetGate(
                    "mig_recovery",
                    "a MIG instance of GPU 0 cannot be re-created in place: GPU instance 1 has "
                    "2 compute instances: re-creating it would not restore them; recover it by "
                    "hand",
                    Level.WARNING,
                )
            ],
        ),
    ],
)
def test_each_gate_says_its_name_reason_and_level(
    case: str, snapshot: Snapshot, finding: Finding, policy: Policy, expected: list[ResetGate]
) -> None:
    gates = reset_gates(finding, snapshot, policy, report_only={}, findings=[])
    assert gates == expected, case


def test_the_refusal_is_logged_at_its_gates_level() -> None:
    snapshot = HostBuilder().gpu(0, lost=True).build()
    result = _plan([_ghost()], snapshot, PlanState(), _policy(), 0.0)
    (refused,) = [e for e in result.events if e.name == EventName.RESET_REFUSED]
    assert (refused.level, refused.fields["why"]) == (Level.WARNING, _LOST)


def test_a_gpu_reset_only_with_its_nvlink_peers_is_the_nvlink_gate() -> None:
    (gpu,) = HostBuilder().gpu(0).build().nvml.gpus
    peers = dataclasses.replace(gpu, architecture=ARCH_VOLTA, nvlink_active=4)
    empty = HostBuilder().build()
    snapshot = dataclasses.replace(empty, nvml=dataclasses.replace(empty.nvml, gpus=(peers,)))
    assert peers.reset_needs_nvlink_peers is True
    gates = reset_gates(_ghost(), snapshot, _policy(), report_only={}, findings=[])
    assert [(g.name, g.level) for g in gates] == [("nvlink", Level.INFO)]


# --- _live_holder: a pid-less finding holds the GPU only when the driver said so ---------------


@pytest.mark.parametrize(
    ("kind", "holder"),
    [
        (FindingKind.HIDDEN_HOLDER, True),
        (FindingKind.ZOMBIE, False),
        (FindingKind.ORPHANED, False),
        (FindingKind.ABANDONED, False),
        (FindingKind.STUCK, False),
    ],
)
def test_only_a_pid_less_hidden_holder_is_a_live_holder(kind: FindingKind, holder: bool) -> None:
    pidless = Finding(kind=kind, gpu=GPU0, pid=None, start_ticks=None, reason="pid-less")
    snapshot = HostBuilder().gpu(0).build()
    gates = reset_gates(_ghost(), snapshot, _policy(), report_only={}, findings=[pidless])
    assert [g.name for g in gates] == (["live_holder"] if holder else [])


# --- a refused reset whose GPU left the snapshot ------------------------------------------------


def test_a_refusal_of_a_gpu_gone_from_the_snapshot_is_cleared_with_its_incident() -> None:
    refusal = ResetRefusal(_ghost().key, "in use", in_use=True, since=WALL)
    state = PlanState(reset_refusals={GPU0: refusal})
    result = _plan([], HostBuilder().gpu(1).build(), state, _policy(), 0.0)
    assert _whys(result, EventName.RESET_REFUSAL_CLEARED) == [
        "the incident is over (its finding resolved)"
    ]
    assert result.state.reset_refusals == {}


# --- the dry run's history on top of the real one ----------------------------------------------


def _dry_policy(**reset: float) -> Policy:
    values = {"confirm_for": 0.0, "cooldown": 0.0, "max_resets": 2, "window": 3600.0, **reset}
    return dataclasses.replace(_policy(reset=ResetPolicy(**values)), dry_run=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "state", "policy", "event", "why"),
    [
        (
            "one real and one would-be reset reach max_resets",
            PlanState(
                reset_history=((GPU0, WALL - 100.0),),
                shadow=DryShadow(resets=((GPU0, WALL - 50.0),)),
            ),
            _dry_policy(),
            EventName.RESET_LIMIT_REACHED,
            "2 reset(s) of this GPU within 3600s",
        ),
        (
            "a real reset newer than the last would-be one still cools down",
            PlanState(last_reset={GPU0: WALL - 100.0}, last_dry_reset={GPU0: WALL - 1000.0}),
            _dry_policy(cooldown=600.0),
            EventName.RESET_REFUSED,
            "cooldown",
        ),
    ],
)
def test_a_dry_run_counts_the_real_history_too(
    case: str, state: PlanState, policy: Policy, event: str, why: str
) -> None:
    result = _plan([_ghost()], HostBuilder().gpu(0).build(), state, policy, 0.0)
    assert _resets(result) == [], case
    assert _whys(result, event) == [why], case


# --- what a reset intent carries -----------------------------------------------------------------


def _due(finding: Finding, snapshot: Snapshot, policy: Policy) -> ResetIntent:
    first = _plan([finding], snapshot, PlanState(), policy, 0.0)
    (intent,) = _resets(_plan([finding], snapshot, first.state, policy, 60.0))
    return intent


def test_a_ghost_reset_carries_its_evidence_and_reason() -> None:
    ghost = dataclasses.replace(_ghost(), evidence={"baseline": 2 * MIB})
    intent = _due(ghost, HostBuilder().gpu(0).build(), _policy())
    assert intent.facts["evidence"] == {"baseline": 2 * MIB}
    assert intent.reason == f"ghost memory confirmed for 60s: {ghost.reason}"


def test_an_instance_recovery_says_why_it_is_due() -> None:
    snapshot = with_mig(HostBuilder().gpu(0).build(), instances=[Inst(1, allocated=4 * GIB)])
    intent = _due(_instance_ghost(), snapshot, _RECOVERY)
    assert intent.instance is not None
    assert intent.reason == f"ghost memory confirmed for 60s: {_ghost().reason}"


def test_a_whole_gpu_finding_needs_no_instance_recovery() -> None:
    """explain asks it of every ghost with reset.mig_recovery on: a whole GPU's is a GPU reset."""
    snapshot = with_mig(HostBuilder().gpu(0).gpu(1).build(), instances=[Inst(1)])
    assert instance_recovery(snapshot, _ghost(GPU1)) is None
    assert instance_recovery(snapshot, _instance_ghost()) is not None
