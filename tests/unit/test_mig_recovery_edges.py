"""The edges of a MIG GPU instance's recovery, one condition at a time.

Each test pins one condition the recovery rests on (decide/mig/recovery.py, the instance gates
of decide/plan/resets.py, the full-scan rule of decide/full_scan.py), so that changing it is
seen: what counts as back after the re-creation, what may still use the instance, which state
file records are believed, and when a GPU instance's memory makes a poll walk all of /proc.
"""

from __future__ import annotations

import dataclasses

import pytest

from gpuwatchd.core.model import (
    MIB,
    Finding,
    FindingKind,
    GpuInfo,
    GpuMemory,
    HolderScan,
    MigDevice,
    NvmlProcess,
    ProcessInfo,
    Snapshot,
)
from gpuwatchd.core.vocabulary import ResetResult
from gpuwatchd.decide.full_scan import has_unowned_memory, unowned_memory_threshold
from gpuwatchd.decide.mig.recovery import (
    InstanceRecovery,
    from_record,
    instance_blockers,
    recovered,
    recovery_blockers,
    recovery_of,
)
from gpuwatchd.decide.plan.intents import ResetIntent
from gpuwatchd.decide.plan.outcomes import record_reset
from gpuwatchd.decide.plan.resets import reset_gates
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import Detection, Policy, Protect, ResetPolicy
from tests.support.migsnap import Inst, mig_uuid, with_mig
from tests.support.snapshots import HostBuilder, gpu_uuid

LEAK = 4 * 1024 * MIB
GI1 = mig_uuid(0, 1)


def host(*instances: Inst, builder: HostBuilder | None = None, **mig: object) -> Snapshot:
    base = (builder or HostBuilder()).gpu(0).proc(700, ppid=1, holds={0}, uvm=True).build()
    options: dict[str, object] = {"instances": list(instances), "caps": {700: [(2, 0)]}}
    options.update(mig)
    return with_mig(base, **options)  # type: ignore[arg-type]


LEAKY = host(Inst(1, allocated=LEAK), Inst(2, allocated=LEAK, processes=((700, LEAK),)))
RECOVERY = recovery_of(LEAKY, GI1)


def recovery() -> InstanceRecovery:
    assert isinstance(RECOVERY, InstanceRecovery)
    return RECOVERY


def with_devices(snapshot: Snapshot, **changes: object) -> Snapshot:
    """``snapshot`` with every MIG device of GPU 0 changed."""
    gpu = snapshot.nvml.gpus[0]
    devices = tuple(dataclasses.replace(d, **changes) for d in gpu.mig_devices or ())  # type: ignore[arg-type]
    gpus = (dataclasses.replace(gpu, mig_devices=devices), *snapshot.nvml.gpus[1:])
    return dataclasses.replace(snapshot, nvml=dataclasses.replace(snapshot.nvml, gpus=gpus))


# --- back after the re-creation --------------------------------------------------------------


def test_a_gpu_whose_instances_cannot_be_judged_is_not_back() -> None:
    unjudged = host(Inst(1), Inst(2), table=False)
    said = recovered(recovery(), unjudged, max_used=64 * MIB)
    assert said is not None
    assert said.startswith("GPU 0: ")
    plain = HostBuilder().gpu(0).build()
    assert recovered(recovery(), plain, max_used=64 * MIB) == (
        "GPU 0: the GPU is not in MIG mode in this snapshot"
    )


def test_the_recreated_instance_is_found_behind_another_with_a_lower_id() -> None:
    """Instance 0 (placement 0) comes first and is not it; instance 1 at placement 1 is."""
    after = host(Inst(0), Inst(1), Inst(2, allocated=LEAK, processes=((700, LEAK),)))
    assert recovered(recovery(), after, max_used=64 * MIB) is None


def test_memory_exactly_at_the_limit_is_back_and_unknown_memory_is_not() -> None:
    after = host(Inst(1, allocated=64 * MIB), Inst(2))
    assert recovered(recovery(), after, max_used=64 * MIB) is None
    unknown = host(Inst(1, allocated=None), Inst(2))
    assert recovered(recovery(), unknown, max_used=64 * MIB) == (
        "GPU instance 1 is back; its memory use is unknown"
    )


def test_an_instance_missing_from_mig_minors_is_not_back() -> None:
    after = host(Inst(1), Inst(2))
    table = {
        minor: cap
        for minor, cap in (after.mig_caps or {}).items()
        if not (cap.gi == 1 and cap.ci is None)
    }
    said = recovered(recovery(), dataclasses.replace(after, mig_caps=table), max_used=64 * MIB)
    assert said == "GPU instance 1 is back but mig-minors does not list it"


# --- what it can re-create ---------------------------------------------------------------------


def test_an_unknown_compute_instance_or_mig_uuid_refuses_the_recovery() -> None:
    assert recovery_of(with_devices(LEAKY, ci=None), GI1) == (
        "GPU instance 1: its compute instance id is unknown"
    )
    no_uuid = with_devices(LEAKY, uuid=None)
    named = f"MIG-{gpu_uuid(0)}/1/0"  # how a finding names an instance without a MIG UUID
    assert recovery_of(no_uuid, named) == "GPU instance 1: its MIG UUID is unknown"


def test_a_compute_instance_of_part_of_its_gpu_instance_or_of_unknown_size_is_not_recreated() -> (
    None
):
    """``-C`` creates the GPU instance's full-size compute instance: a ``1c.3g.40gb`` one (one
    slice of a 3-slice GPU instance) would not come back as it was."""
    partial = host(Inst(1, allocated=LEAK, profile="1c.3g.40gb"), Inst(2))
    assert recovery_of(partial, GI1) == (
        "GPU instance 1: its compute instance (1c.3g.40gb) is a part of it, which -C would not "
        "bring back; recover it by hand"
    )
    unknown = with_devices(LEAKY, profile=None)
    assert recovery_of(unknown, GI1) == "GPU instance 1: its compute instance's profile is unknown"


# --- what may still use it ---------------------------------------------------------------------


def test_a_dead_or_zombie_process_listed_in_the_instance_blocks_nothing() -> None:
    zombie = HostBuilder().proc(650, ppid=1, state="Z")
    snapshot = host(
        Inst(1, allocated=LEAK, processes=((600, LEAK), (650, 1))),  # 600 is dead
        Inst(2, allocated=LEAK, processes=((700, LEAK),)),
        builder=zombie,
    )
    assert instance_blockers(snapshot, GI1) == []


def test_the_final_scan_leaves_out_only_our_own_unreadable_processes() -> None:
    holders = HolderScan(mode="full", holdings={}, unreadable=frozenset({11, 12}))
    why = recovery_blockers(LEAKY, holders, {}, frozenset({11}), GI1)
    assert why == ["pid 12: fds/maps unreadable (unknown is not none)"]


# --- a state file's record ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        {"uuid": ""},
        {"mig_uuid": ""},
        {"uuid": 7},
        {"mig_uuid": None},
        {"gi": -1},
        {"gi": True},
        {"placement": "0"},
        {"size": None},
        {"size": 0},  # no GI profile holds no memory slice
    ],
)
def test_a_damaged_recovery_record_is_not_believed(damage: dict[str, object]) -> None:
    assert from_record(recovery().record()) == recovery()
    assert from_record({**recovery().record(), **damage}) is None
    assert from_record([recovery().record()]) is None


# --- the instance's gates ----------------------------------------------------------------------


def ghost() -> Finding:
    return Finding(FindingKind.GHOST_MEMORY, GI1, None, None, "ghost", memory=LEAK)


def gates(snapshot: Snapshot, policy: Policy, findings: list[Finding]) -> list[tuple[str, str]]:
    found = reset_gates(ghost(), snapshot, policy, report_only={}, findings=findings)
    return [(g.name, g.why) for g in found]


def recovering(protect: Protect | None = None) -> Policy:
    return dataclasses.replace(
        Policy(dry_run=False),
        reset=ResetPolicy(enabled=True, mig_recovery=True),
        protect=protect or Protect(),
    )


def test_without_mig_recovery_the_mig_gate_is_the_only_one() -> None:
    off = dataclasses.replace(
        Policy(dry_run=False),
        reset=ResetPolicy(enabled=True),
        protect=Protect(gpus=(gpu_uuid(0),)),
    )
    assert [name for name, _ in gates(LEAKY, off, [])] == ["mig"]


def test_a_lost_parent_gpu_is_the_only_gate() -> None:
    gpu = LEAKY.nvml.gpus[0]
    lost = dataclasses.replace(
        LEAKY,
        nvml=dataclasses.replace(
            LEAKY.nvml, gpus=(dataclasses.replace(gpu, lost=True), *LEAKY.nvml.gpus[1:])
        ),
    )
    assert gates(lost, recovering(Protect(gpus=(gpu_uuid(0),))), []) == [
        ("gpu", "GPU is lost (needs reboot)")
    ]


def test_a_finding_about_a_live_process_in_the_instance_holds_it_and_no_other() -> None:
    live = Finding(FindingKind.ORPHANED, GI1, 900, 1, "orphan")
    elsewhere = Finding(FindingKind.ORPHANED, mig_uuid(0, 2), 901, 1, "orphan")
    no_pid = Finding(FindingKind.ORPHANED, GI1, None, None, "orphan")
    not_live = Finding(FindingKind.DEAD_PROCESS, GI1, 902, 1, "dead")
    assert gates(LEAKY, recovering(), [live, elsewhere, no_pid, not_live]) == [
        ("live_holder", "live holder: orphaned pid 900 holds it")
    ]


# --- a recovery booked -------------------------------------------------------------------------


def test_a_recovery_leaves_its_gpu_health_drain_as_it_was() -> None:
    intent = ResetIntent(
        gpu=gpu_uuid(0), pci_bus_id=None, minor=0, finding_key=ghost().key, dry_run=False,
        reason="ghost", facts={}, instance=recovery(),
    )  # fmt: skip
    state = PlanState(health_drained={gpu_uuid(0): True})
    booked = record_reset(state, intent, ResetResult.SUCCESS, now=10.0, wall=10.0)
    assert booked.state.health_drained == {gpu_uuid(0): True}
    whole = dataclasses.replace(intent, instance=None)
    booked = record_reset(state, whole, ResetResult.SUCCESS, now=10.0, wall=10.0)
    assert booked.state.health_drained == {}


# --- when a GPU instance's memory makes a poll walk all of /proc ---------------------------------

DETECTION = Detection()
LIVE = {700: ProcessInfo(pid=700, start_ticks=1, state="S", ppid=1, pgid=700, sid=700)}


def gpu(
    allocated: int | None,
    *,
    devices: tuple[MigDevice, ...] | None = None,
    lost: bool = False,
    numa_node: int | None = None,
    mig_enabled: bool | None = None,
) -> GpuInfo:
    memory = None if allocated is None else GpuMemory(80 * 1024 * MIB, None, 0, allocated)
    return GpuInfo(
        index=0, uuid="GPU-0", name="H100", pci_bus_id=None, minor=0, memory=memory,
        processes=(), mig_devices=devices, lost=lost, numa_node=numa_node,
        mig_enabled=mig_enabled,
    )  # fmt: skip


def device(gi: int, allocated: int, pids: tuple[int, ...] = ()) -> MigDevice:
    return MigDevice(
        index=gi, uuid=f"MIG-{gi}", gi=gi, ci=0,
        memory=GpuMemory(10 * 1024 * MIB, None, 0, allocated),
        processes=tuple(NvmlProcess(p, 1, "compute") for p in pids),
    )  # fmt: skip


def test_a_lost_coherent_or_unread_gpu_never_makes_a_full_scan() -> None:
    assert has_unowned_memory(gpu(LEAK, lost=True), {}, DETECTION) is False
    assert has_unowned_memory(gpu(LEAK, numa_node=1), {}, DETECTION) is False
    assert has_unowned_memory(gpu(None), {}, DETECTION) is False
    assert has_unowned_memory(gpu(2 * MIB), {}, DETECTION) is False
    assert has_unowned_memory(gpu(LEAK), {}, DETECTION) is True
    # A known holder of its node explains a whole GPU's memory: no full scan for it.
    assert has_unowned_memory(gpu(LEAK), {}, DETECTION, frozenset({0})) is False


def test_only_a_gpu_in_mig_mode_is_asked_instance_by_instance() -> None:
    # Not in MIG mode: its own memory says it, whatever its (empty) MIG device list says.
    assert has_unowned_memory(gpu(LEAK, devices=()), {}, DETECTION) is True
    # In MIG mode with its instances unread: the parent's figures are all there is.
    assert has_unowned_memory(gpu(LEAK, mig_enabled=True), {}, DETECTION) is True


def test_each_instance_is_asked_and_the_threshold_itself_is_not_unowned() -> None:
    at = unowned_memory_threshold(DETECTION)
    idle_then_leak = (device(1, 2 * MIB), device(2, LEAK))
    assert has_unowned_memory(gpu(LEAK, mig_enabled=True, devices=idle_then_leak), LIVE,
                              DETECTION) is True  # fmt: skip
    at_threshold = (device(1, at),)
    assert has_unowned_memory(gpu(at, mig_enabled=True, devices=at_threshold), LIVE,
                              DETECTION) is False  # fmt: skip
    owned = (device(1, LEAK, (700,)),)
    assert has_unowned_memory(gpu(LEAK, mig_enabled=True, devices=owned), LIVE,
                              DETECTION) is False  # fmt: skip


def test_the_recovery_record_keeps_its_keys_and_their_order() -> None:
    """The state file's bytes: every field, in this order, under these names."""
    record = recovery().record()
    assert list(record) == [
        "uuid",
        "pci_bus_id",
        "gpu_index",
        "gi",
        "ci",
        "mig_uuid",
        "profile",
        "placement",
        "size",
    ]
    assert record == {key: getattr(recovery(), key) for key in record}
