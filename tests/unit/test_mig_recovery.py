"""The recovery of one MIG GPU instance (decide/mig/recovery.py): what it re-creates, the
command lines it fills in (every value checked), when it refuses, and how it is verified.

GPU 0 is in MIG mode with GPU instances 1 and 2 (tests/support/migsnap.py: GI profile 19,
placement ``(gi, 1)``); instance 1 holds a leak, instance 2 a live job.
"""

from __future__ import annotations

import dataclasses

import pytest

from gpuwatchd.core.model import MIB, GpuInfo, MigDevice, Snapshot
from gpuwatchd.decide.argv import (
    MIG_PLACEHOLDERS,
    ArgvError,
    check_command,
    format_argv,
    placeholders_in,
)
from gpuwatchd.decide.mig.recovery import (
    InstanceRecovery,
    instance_blockers,
    instance_changed,
    layout_argvs,
    layout_missing,
    placement_taken,
    recovered,
    recovery_argvs,
    recovery_of,
    resume_point,
)
from gpuwatchd.decide.policy import DEFAULT_MIG_RECOVERY_COMMANDS
from tests.support.migsnap import Inst, mig_uuid, with_mig
from tests.support.snapshots import HostBuilder, gpu_uuid

LEAK = 4 * 1024 * MIB


def host(*instances: Inst) -> Snapshot:
    base = HostBuilder().gpu(0).proc(700, ppid=1, pgid=700, sid=700, holds={0}, uvm=True).build()
    return with_mig(base, instances=list(instances), caps={700: [(2, 0)]})


LEAKY = host(Inst(1, allocated=LEAK), Inst(2, allocated=LEAK, processes=((700, LEAK),)))


def test_the_recovery_of_an_instance_names_its_parent_gi_ci_profile_and_placement() -> None:
    recovery = recovery_of(LEAKY, mig_uuid(0, 1))

    assert isinstance(recovery, InstanceRecovery)
    assert (recovery.uuid, recovery.gi, recovery.ci, recovery.mig_uuid) == (
        gpu_uuid(0),
        1,
        0,
        mig_uuid(0, 1),
    )
    assert (recovery.profile, recovery.placement, recovery.size) == (19, 1, 1)


def test_the_default_commands_destroy_and_recreate_only_that_instance_by_the_gpu_uuid() -> None:
    recovery = recovery_of(LEAKY, mig_uuid(0, 1))
    assert isinstance(recovery, InstanceRecovery)

    argvs = recovery_argvs(recovery, DEFAULT_MIG_RECOVERY_COMMANDS)

    uuid = gpu_uuid(0)
    assert argvs == (
        ("nvidia-smi", "mig", "-i", uuid, "-gi", "1", "-ci", "0", "-dci"),
        ("nvidia-smi", "mig", "-i", uuid, "-gi", "1", "-dgi"),
        ("nvidia-smi", "mig", "-i", uuid, "-cgi", "19:1", "-C"),
    )


def test_the_default_commands_pass_the_command_checks_with_the_mig_placeholders() -> None:
    for argv in DEFAULT_MIG_RECOVERY_COMMANDS:
        check_command(argv, MIG_PLACEHOLDERS)


def test_a_mig_placeholder_is_not_allowed_where_only_gpu_placeholders_are() -> None:
    with pytest.raises(ArgvError, match="unknown placeholder"):
        placeholders_in("{gi}", ("uuid", "pci_bus_id", "minor"))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("gi", "-1"),
        ("gi", "1,2"),
        ("ci", "100"),
        ("profile", "19 -dgi"),
        ("placement", "01"),
        ("mig_uuid", "GPU-00000000-0000-4000-8000-000000000000"),
    ],
)
def test_a_hostile_mig_value_is_refused_before_anything_runs(name: str, value: str) -> None:
    with pytest.raises(ValueError, match="refusing to run"):
        format_argv(("nvidia-smi", "{" + name + "}"), **{name: value})


def test_a_recovery_whose_value_is_malformed_fills_in_nothing() -> None:
    recovery = recovery_of(LEAKY, mig_uuid(0, 1))
    assert isinstance(recovery, InstanceRecovery)
    bad = dataclasses.replace(recovery, uuid="GPU-0,1")

    with pytest.raises(ValueError, match="refusing to run"):
        recovery_argvs(bad, DEFAULT_MIG_RECOVERY_COMMANDS)


def test_an_instance_with_several_compute_instances_is_not_recreated() -> None:
    snapshot = host(Inst(1, allocated=LEAK, cis=(0, 1)), Inst(2))

    why = recovery_of(snapshot, mig_uuid(0, 1))

    assert why == (
        "GPU instance 1 has 2 compute instances: re-creating it would not restore them; "
        "recover it by hand"
    )


def _without(snapshot: Snapshot, **unknown: object) -> Snapshot:
    gpu = snapshot.nvml.gpus[0]
    devices = tuple(dataclasses.replace(d, **unknown) for d in gpu.mig_devices or ())  # type: ignore[arg-type]
    gpus = (dataclasses.replace(gpu, mig_devices=devices), *snapshot.nvml.gpus[1:])
    return dataclasses.replace(snapshot, nvml=dataclasses.replace(snapshot.nvml, gpus=gpus))


@pytest.mark.parametrize(
    ("unknown", "value", "why"),
    [
        ("gi_profile_id", None, "GPU instance 1: its GI profile id is unknown"),
        ("placement", None, "GPU instance 1: its placement is unknown"),
        ("placement", (1, 0), "GPU instance 1: its placement is unknown"),  # of no slice
    ],
)
def test_an_unknown_profile_or_placement_refuses_the_recovery(
    unknown: str, value: object, why: str
) -> None:
    assert recovery_of(_without(LEAKY, **{unknown: value}), mig_uuid(0, 1)) == why


def test_a_whole_gpu_or_an_unknown_name_has_no_instance_recovery() -> None:
    assert recovery_of(LEAKY, gpu_uuid(0)) == "not a judged MIG GPU instance in this snapshot"
    assert recovery_of(LEAKY, None) == "not a judged MIG GPU instance in this snapshot"


def test_recovery_is_verified_by_the_same_profile_and_placement_with_its_memory_freed() -> None:
    recovery = recovery_of(LEAKY, mig_uuid(0, 1))
    assert isinstance(recovery, InstanceRecovery)
    # The driver may give the re-created instance a new GI id; placement (1, 1) is what counts.
    after = host(Inst(2, allocated=LEAK, processes=((700, LEAK),)), Inst(1, allocated=2 * MIB))

    assert recovered(recovery, after, max_used=64 * MIB) is None
    assert recovered(recovery, LEAKY, max_used=64 * MIB) == (
        f"GPU instance 1 is back but still uses {LEAK} bytes"
    )
    gone = host(Inst(2, allocated=LEAK, processes=((700, LEAK),)))
    assert recovered(recovery, gone, max_used=64 * MIB) == (
        "no GPU instance with GI profile 19 at placement 1"
    )


def test_an_idle_leaky_instance_has_no_blocker_though_the_other_instance_is_busy() -> None:
    assert instance_blockers(LEAKY, mig_uuid(0, 1)) == []
    assert instance_blockers(LEAKY, mig_uuid(0, 2)) == [
        "GPU instance 2: PID 700 listed by NVML in it",
        "GPU instance 2: PID 700 holding its capability files",
    ]


def test_a_holder_of_the_instance_capabilities_blocks_its_recovery() -> None:
    base = HostBuilder().gpu(0).proc(601, ppid=1, pgid=600, sid=600, holds={0}, uvm=True).build()
    snapshot = with_mig(base, instances=[Inst(1, allocated=LEAK), Inst(2)], caps={601: [(1, 0)]})

    assert instance_blockers(snapshot, mig_uuid(0, 1)) == [
        "GPU instance 1: PID 601 holding its capability files"
    ]


def test_a_parent_only_holder_blocks_every_instance_of_its_gpu() -> None:
    base = HostBuilder().gpu(0).proc(650, ppid=1, pgid=650, sid=650, holds={0}, uvm=True).build()
    snapshot = with_mig(base, instances=[Inst(1, allocated=LEAK), Inst(2)], caps={})

    assert instance_blockers(snapshot, mig_uuid(0, 1)) == [
        "GPU instance 1: PID 650 holding its GPU's device node, instance unknown"
    ]


def test_an_unreadable_process_list_or_an_unknown_instance_blocks() -> None:
    snapshot = host(Inst(1, allocated=LEAK, readable=False), Inst(2))

    assert "GPU instance 1: its process list is unknown" in instance_blockers(
        snapshot, mig_uuid(0, 1)
    )
    assert instance_blockers(LEAKY, gpu_uuid(0)) == [
        "not a judged MIG GPU instance in this snapshot"
    ]


# --- the GPU read again: before the commands, before the re-create, after a crash -------------

_PLANNED = InstanceRecovery(
    uuid="GPU-1", pci_bus_id=None, gpu_index=0, gi=1, ci=0, mig_uuid="MIG-1", profile=19,
    placement=2, size=2,
)  # fmt: skip


def _reading(*devices: MigDevice | None, readable: bool = True) -> GpuInfo:
    listed = tuple(d for d in devices if d is not None)
    return GpuInfo(index=0, uuid="GPU-1", mig_enabled=True,
                   mig_devices=listed if readable else None)  # fmt: skip


def _device(gi: int, uuid: str, placement: tuple[int, int] | None, profile: int = 19) -> MigDevice:
    return MigDevice(index=0, uuid=uuid, gi=gi, ci=0, gi_profile_id=profile, placement=placement)


PLANNED_DEVICE = _device(1, "MIG-1", (2, 2))


@pytest.mark.parametrize(
    ("reading", "changed"),
    [
        (_reading(PLANNED_DEVICE), None),
        (_reading(_device(1, "MIG-2", (2, 2))), "MIG UUID MIG-2 (planned MIG-1)"),
        (_reading(_device(1, "MIG-1", (2, 2), profile=14)), "GI profile 14 (planned 19)"),
        (_reading(_device(1, "MIG-1", None)), "placement None (planned (2, 2))"),
        (_reading(), "GPU instance 1 is no longer listed"),
        (_reading(readable=False), "its MIG devices could not be read"),
        (None, "not in the fresh NVML reading"),
    ],
)
def test_the_planned_instance_is_told_by_uuid_profile_and_placement(
    reading: GpuInfo | None, changed: str | None
) -> None:
    said = instance_changed(_PLANNED, reading)
    assert said == changed if changed is None else changed in str(said)


@pytest.mark.parametrize(
    ("reading", "taken"),
    [
        (_reading(_device(4, "MIG-4", (4, 1))), None),  # beside it
        (_reading(_device(5, "MIG-5", (0, 2))), None),  # ends where it starts
        (_reading(_device(3, "MIG-3", (3, 1))), "GPU instance 3 (MIG-3) occupies placement 3:1"),
        (_reading(_device(6, "MIG-6", (0, 4))), "occupies placement 0:4"),  # spans it
        (_reading(_device(1, "MIG-9", (6, 1))), "GPU instance 1 is still listed"),  # id reused
        (_reading(_device(7, "MIG-7", None)), "GPU instance 7: its placement is unknown"),
        (_reading(_device(2, "MIG-2", (2, 0))), "GPU instance 2: its placement is unknown"),
        (_reading(readable=False), "its MIG devices could not be read"),
    ],
)
def test_the_re_create_needs_its_whole_placement_free(reading: GpuInfo, taken: str | None) -> None:
    said = placement_taken(_PLANNED, reading)
    assert said == taken if taken is None else taken in str(said)


@pytest.mark.parametrize(
    ("reading", "done", "point"),
    [
        (_reading(), 2, 2),  # between -dgi and -cgi: the re-create
        (_reading(), 1, 1),  # during -dgi: -dgi again, then the re-create
        (_reading(), 0, 0),  # none done: all of them again
        (_reading(), None, 2),  # an old record: the re-create alone
        (_reading(), 7, 2),  # a count out of range is no count
        (_reading(), 3, 2),  # ... nor is one that says all were done
        (_reading(_device(3, "MIG-3", (2, 2))), 2, 3),  # re-created (new UUID): checked only
        (_reading(dataclasses.replace(PLANNED_DEVICE, uuid=None)), 2, 3),  # UUID unread: as well
        (_reading(_device(3, "MIG-3", (2, 2), profile=9)), 2, "occupies placement 2:2"),
        (_reading(readable=False), 2, "its MIG devices could not be read"),
    ],
)
def test_a_crashed_recovery_goes_on_where_the_reading_allows(
    reading: GpuInfo, done: int | None, point: int | str
) -> None:
    said = resume_point(_PLANNED, reading, done, 3)
    assert said == point if isinstance(point, int) else point in str(said)


def test_a_whole_gpu_layout_misses_the_instances_the_reading_lacks_by_profile_and_placement() -> (
    None
):
    beside = dataclasses.replace(_PLANNED, gi=2, mig_uuid="MIG-2", placement=4, size=1)
    layout = (_PLANNED, beside)
    assert layout_missing(layout, _reading(_device(5, "MIG-5", (4, 1)))) == [0]  # ids may be new
    assert layout_missing(layout, _reading(_device(1, "MIG-1", (2, 2), profile=14))) == [0, 1]
    assert layout_missing(layout, _reading(PLANNED_DEVICE, _device(2, "MIG-2", (4, 1)))) == []
    assert layout_missing((), None) == []  # nothing recorded: nothing to read
    assert "could not be read" in str(layout_missing(layout, _reading(readable=False)))


def test_a_layout_is_created_again_by_the_last_command_alone_and_by_none_without_commands() -> None:
    planned = dataclasses.replace(_PLANNED, uuid=gpu_uuid(0))
    beside = dataclasses.replace(planned, gi=2, mig_uuid="MIG-2", placement=4, size=1)
    assert layout_argvs((planned, beside), DEFAULT_MIG_RECOVERY_COMMANDS) == (
        ("nvidia-smi", "mig", "-i", gpu_uuid(0), "-cgi", "19:2", "-C"),
        ("nvidia-smi", "mig", "-i", gpu_uuid(0), "-cgi", "19:4", "-C"),
    )
    assert layout_argvs((planned,), ()) == ()
