"""MIG through NVML: the fake library's MIG calls, and the worker's reading of MIG devices.

The first half calls the fake ``libnvidia-ml.so.1`` through ctypes with NVML's own signatures
(``nvmlDeviceGetMigDeviceHandleByIndex``, ``nvmlDeviceGetGpuInstanceId``, ...) and pins the
semantics the rest of the MIG tests rely on: per-instance memory and processes on MIG handles,
aggregates on the parent, instance ids in process entries. The second half reads the same
states through NvmlClient → worker → the real pynvml.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.collect.nvml import NvmlClient
from tests.support import nvmlctypes
from tests.support.fakenvml import (
    FakeNvml,
    GiB,
    MiB,
    gpu,
    mig_device,
    process,
    state,
)
from tests.support.nvmlctypes import (
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    MEMORY_V2,
    NO_INSTANCE,
    NOT_FOUND,
    NOT_SUPPORTED,
    SUCCESS,
    MemoryV2,
    ProcessInfo,
    handle,
)


class Placement(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


class GpuInstanceInfo(ctypes.Structure):
    _fields_ = [
        ("device", ctypes.c_void_p),
        ("id", ctypes.c_uint),
        ("profileId", ctypes.c_uint),
        ("placement", Placement),
    ]


def two_instances(**over: Any) -> dict[str, Any]:
    """GPU 0 with MIG on: GI 1 (a trainer, PID 4242, 600 MiB) at index 0, a hole at index 1,
    GI 2 with two compute instances (PID 5151 in CI 1) sharing 1 GiB at indices 2 and 3."""
    return gpu(
        0,
        allocated=2 * MiB,
        mig_mode=1,
        mig_devices=[
            mig_device(1, 0, allocated=600 * MiB, processes=[process(4242, 500 * MiB)]),
            None,
            mig_device(2, 0, profile="1c.3g.40gb", total=40 * GiB, allocated=1 * GiB),
            mig_device(
                2,
                1,
                profile="2c.3g.40gb",
                total=40 * GiB,
                allocated=1 * GiB,
                processes=[process(5151, 700 * MiB)],
            ),
        ],
        **over,
    )


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    return nvmlctypes.fake_in_process(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return nvmlctypes.load()


@pytest.fixture
def session(lib: ctypes.CDLL, fake: FakeNvml) -> Iterator[ctypes.CDLL]:
    """GPU 0 as ``two_instances`` and a plain GPU 1, initialised; shut down afterwards."""
    with nvmlctypes.initialised(lib, fake, [two_instances(), gpu(1)]) as opened:
        yield opened


def mig_handle(
    lib: ctypes.CDLL, parent: ctypes.c_void_p, index: int
) -> tuple[int, ctypes.c_void_p]:
    device = ctypes.c_void_p()
    rc = lib.nvmlDeviceGetMigDeviceHandleByIndex(parent, ctypes.c_uint(index), ctypes.byref(device))
    return rc, device


def processes(lib: ctypes.CDLL, device: ctypes.c_void_p) -> list[tuple[int, int, int]]:
    count = ctypes.c_uint(0)
    rc = lib.nvmlDeviceGetComputeRunningProcesses_v3(device, ctypes.byref(count), None)
    if rc == SUCCESS:
        return []
    assert rc == INSUFFICIENT_SIZE
    infos = (ProcessInfo * (count.value + 5))()
    count = ctypes.c_uint(count.value + 5)
    assert lib.nvmlDeviceGetComputeRunningProcesses_v3(device, ctypes.byref(count), infos) == 0
    return [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in infos[: count.value]]


def allocated(lib: ctypes.CDLL, device: ctypes.c_void_p) -> tuple[int, int]:
    memory = MemoryV2(version=MEMORY_V2)
    assert lib.nvmlDeviceGetMemoryInfo_v2(device, ctypes.byref(memory)) == SUCCESS
    return memory.total, memory.used


def instance_ids(lib: ctypes.CDLL, device: ctypes.c_void_p) -> tuple[int, int, int, int]:
    gi, ci = ctypes.c_uint(99), ctypes.c_uint(99)
    rc_gi = lib.nvmlDeviceGetGpuInstanceId(device, ctypes.byref(gi))
    rc_ci = lib.nvmlDeviceGetComputeInstanceId(device, ctypes.byref(ci))
    return rc_gi, gi.value, rc_ci, ci.value


def test_mig_device_handles_by_index_with_holes_and_the_max_count(session: ctypes.CDLL) -> None:
    """Index 1 is a hole (NOT_FOUND), past the list is NOT_FOUND, a GPU with MIG off has a
    maximum of 0 MIG devices ("zero if MIG is not supported or enabled")."""
    parent = handle(session, 0)
    count = ctypes.c_uint(0)
    assert session.nvmlDeviceGetMaxMigDeviceCount(parent, ctypes.byref(count)) == SUCCESS
    assert count.value == 7
    assert mig_handle(session, parent, 0)[0] == SUCCESS
    assert mig_handle(session, parent, 1)[0] == NOT_FOUND
    assert mig_handle(session, parent, 4)[0] == NOT_FOUND
    plain = handle(session, 1)
    assert session.nvmlDeviceGetMaxMigDeviceCount(plain, ctypes.byref(count)) == SUCCESS
    assert count.value == 0
    assert mig_handle(session, plain, 0)[0] == NOT_FOUND


def test_instance_ids_on_mig_handles_and_not_supported_on_the_parent(
    session: ctypes.CDLL,
) -> None:
    parent = handle(session, 0)
    assert instance_ids(session, mig_handle(session, parent, 0)[1]) == (0, 1, 0, 0)
    assert instance_ids(session, mig_handle(session, parent, 3)[1]) == (0, 2, 0, 1)
    rc_gi, _, rc_ci, _ = instance_ids(session, parent)
    assert (rc_gi, rc_ci) == (NOT_SUPPORTED, NOT_SUPPORTED)
    is_mig = ctypes.c_uint(7)
    assert session.nvmlDeviceIsMigDeviceHandle(parent, ctypes.byref(is_mig)) == SUCCESS
    assert is_mig.value == 0
    assert (
        session.nvmlDeviceIsMigDeviceHandle(mig_handle(session, parent, 0)[1], ctypes.byref(is_mig))
        == 0
    )
    assert is_mig.value == 1
    back = ctypes.c_void_p()
    mig = mig_handle(session, parent, 2)[1]
    assert session.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig, ctypes.byref(back)) == 0
    assert back.value == parent.value


def test_memory_is_per_gpu_instance_and_the_parent_reports_the_aggregate(
    session: ctypes.CDLL,
) -> None:
    """Both compute instances of GI 2 report the GI's memory; the parent counts it once."""
    parent = handle(session, 0)
    assert allocated(session, mig_handle(session, parent, 0)[1]) == (10 * GiB, 600 * MiB)
    assert allocated(session, mig_handle(session, parent, 2)[1]) == (40 * GiB, 1 * GiB)
    assert allocated(session, mig_handle(session, parent, 3)[1]) == (40 * GiB, 1 * GiB)
    assert allocated(session, parent)[1] == 2 * MiB + 600 * MiB + 1 * GiB


def test_processes_carry_instance_ids_on_mig_handles_and_in_the_parent_aggregate(
    session: ctypes.CDLL,
) -> None:
    parent = handle(session, 0)
    assert processes(session, mig_handle(session, parent, 0)[1]) == [(4242, 1, 0)]
    assert processes(session, mig_handle(session, parent, 2)[1]) == []
    assert processes(session, mig_handle(session, parent, 3)[1]) == [(5151, 2, 1)]
    assert processes(session, parent) == [(4242, 1, 0), (5151, 2, 1)]


def test_without_mig_process_entries_carry_no_instance(lib: ctypes.CDLL, fake: FakeNvml) -> None:
    fake.write(state([gpu(0, processes=[process(77)])]))
    assert lib.nvmlInit_v2() == SUCCESS
    try:
        assert processes(lib, handle(lib, 0)) == [(77, NO_INSTANCE, NO_INSTANCE)]
    finally:
        lib.nvmlShutdown()


def test_gpu_instance_info_gives_profile_and_placement(session: ctypes.CDLL) -> None:
    parent = handle(session, 0)
    instance = ctypes.c_void_p()
    assert session.nvmlDeviceGetGpuInstanceById(parent, 1, ctypes.byref(instance)) == SUCCESS
    info = GpuInstanceInfo()
    assert session.nvmlGpuInstanceGetInfo(instance, ctypes.byref(info)) == SUCCESS
    assert (info.id, info.profileId, info.placement.start, info.placement.size) == (1, 19, 1, 1)
    assert info.device == parent.value
    assert session.nvmlDeviceGetGpuInstanceById(parent, 9, ctypes.byref(instance)) == NOT_FOUND


def test_a_mig_handle_of_a_destroyed_instance_is_invalid(
    session: ctypes.CDLL, fake: FakeNvml
) -> None:
    parent = handle(session, 0)
    mig = mig_handle(session, parent, 0)[1]
    fake.write(state([gpu(0, mig_mode=1, mig_devices=[]), gpu(1)]))
    memory = MemoryV2(version=MEMORY_V2)
    assert session.nvmlDeviceGetMemoryInfo_v2(mig, ctypes.byref(memory)) == INVALID_ARGUMENT


# --- the worker's reading ---------------------------------------------------------------------


@pytest.fixture
def client(tmp_path: Path) -> Iterator[tuple[FakeNvml, NvmlClient]]:
    fake = FakeNvml(tmp_path)
    nvml = NvmlClient(timeout=5.0, env=fake.env())
    try:
        yield fake, nvml
    finally:
        nvml.stop()


def test_the_worker_reads_each_mig_device_with_its_instance_memory_and_processes(
    client: tuple[FakeNvml, NvmlClient],
) -> None:
    fake, nvml = client
    fake.write(state([two_instances(), gpu(1)]))

    mig_gpu, plain = nvml.read().gpus

    assert mig_gpu.mig_enabled is True
    assert plain.mig_devices is None
    devices = mig_gpu.mig_devices
    assert devices is not None
    assert [(d.index, d.gi, d.ci, d.profile) for d in devices] == [
        (0, 1, 0, "1g.10gb"),
        (2, 2, 0, "1c.3g.40gb"),
        (3, 2, 1, "2c.3g.40gb"),
    ]
    first = devices[0]
    assert first.uuid is not None
    assert first.uuid.startswith("MIG-")
    assert first.memory is not None
    assert first.memory.allocated == 600 * MiB
    assert first.processes is not None
    assert [p.pid for p in first.processes] == [4242]
    assert (first.gi_profile_id, first.placement) == (19, (1, 1))
    assert first.error is None


def test_an_unreadable_mig_device_list_is_unknown(client: tuple[FakeNvml, NvmlClient]) -> None:
    fake, nvml = client
    fake.write(state([two_instances(errors={"nvmlDeviceGetMaxMigDeviceCount": 999})]))

    (mig_gpu,) = nvml.read().gpus

    assert mig_gpu.mig_enabled is True
    assert mig_gpu.mig_devices is None
    assert mig_gpu.error is not None
    assert "nvmlDeviceGetMaxMigDeviceCount" in mig_gpu.error


def test_an_instance_without_the_v2_memory_query_reads_v1_and_leaves_allocated_unknown(
    client: tuple[FakeNvml, NvmlClient],
) -> None:
    fake, nvml = client
    fake.write(state([two_instances(v2_memory=False)]))

    (mig_gpu,) = nvml.read().gpus

    assert mig_gpu.mig_devices is not None
    memory = mig_gpu.mig_devices[0].memory
    assert memory is not None
    assert (memory.api, memory.allocated, memory.used_v1) == ("v1", None, 600 * MiB)
    assert mig_gpu.mig_devices[0].error is None


@pytest.mark.parametrize(
    ("call", "unknown"),
    [
        pytest.param("nvmlDeviceGetComputeRunningProcesses_v3", "processes", id="processes"),
        pytest.param("nvmlDeviceGetMemoryInfo_v2", "memory", id="memory"),
    ],
)
def test_an_instance_whose_processes_or_memory_cannot_be_read_is_unknown_and_named(
    client: tuple[FakeNvml, NvmlClient], call: str, unknown: str
) -> None:
    """Unknown, not empty: the failing call is named, and the other instances still read."""
    fake, nvml = client
    broken = two_instances()
    broken["mig_devices"][0]["errors"] = {call: 999}
    fake.write(state([broken]))

    (mig_gpu,) = nvml.read().gpus

    assert mig_gpu.mig_devices is not None
    first = mig_gpu.mig_devices[0]
    assert getattr(first, unknown) is None
    assert first.error is not None
    assert call in first.error
    assert mig_gpu.mig_devices[1].processes == ()
