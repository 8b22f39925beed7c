"""The NVML layer end to end: NvmlClient → worker process → real pynvml → the fake library.

Every test here runs the real, unmodified pynvml against tests/fakenvml through
LD_LIBRARY_PATH, so the symbols, struct layouts and two-call protocols are the ones a real driver
sees.
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from structlog.testing import capture_logs

from gpuwatchd.collect import nvml as nvml_module
from gpuwatchd.collect.nvml import (
    UNAVAILABLE_PREFIX,
    WORKER_FILE,
    NvmlClient,
    library_folders,
    worker_command,
    worker_environment,
)
from gpuwatchd.core.model import GpuInfo, GpuMemory, NvmlProcess
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.events.words import VALUE_MAX, short
from tests.support.fakenvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNKNOWN,
    FakeNvml,
    GiB,
    MiB,
    gpu,
    open_device_files,
    process,
    state,
)


@pytest.fixture
def clock() -> list[float]:
    """A hand-driven monotonic clock for backoff: ``clock[0]`` is now."""
    return [1000.0]


@pytest.fixture
def client(fake_nvml: FakeNvml, clock: list[float]) -> Iterator[NvmlClient]:
    nvml = NvmlClient(timeout=5.0, env=fake_nvml.env(), clock=lambda: clock[0], backoff_initial=2.0)
    yield nvml
    nvml.stop()


def worker_children() -> set[int]:
    """Our live child processes running the NVML worker."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if WORKER_FILE in child.cmdline():
                found.add(child.pid)
        except psutil.Error:
            continue
    return found


def holders_of(devices_dir: Path) -> dict[int, set[str]]:
    """Every process (any on the host: the folder is this test's own) holding a file in it."""
    found = {}
    for pid in psutil.pids():
        held = open_device_files(pid, devices_dir)
        if held:
            found[pid] = held
    return found


# --- readings ---------------------------------------------------------------------------------


def test_two_gpus_report_identity_v2_memory_and_every_process_list(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    fake_nvml.write(
        state(
            [
                gpu(
                    0,
                    allocated=3 * GiB,
                    reserved=520 * MiB,
                    processes=[process(4242, 2 * GiB), process(4243, None)],
                    graphics=[process(4242, 1 * GiB)],
                ),
                gpu(
                    1, uuid="GPU-second", pci_bus_id="00000000:9C:00.0", minor=7, mps=[process(77)]
                ),
            ],
            driver_version="535.104.05",
        )
    )

    reading = client.read()

    assert reading.available
    assert not reading.wedged
    assert reading.error is None
    assert reading.driver_version == "535.104.05"
    first, second = reading.gpus
    # Health fields are pinned in tests/integration/test_nvml_health.py.
    assert dataclasses.replace(first, health=None) == GpuInfo(
        index=0,
        uuid="GPU-00000000-face-4000-8000-000000000000",
        name="NVIDIA H100 80GB HBM3",
        pci_bus_id="00000000:18:00.0",
        minor=0,
        memory=GpuMemory(
            total=80 * GiB,
            free=80 * GiB - 3 * GiB - 520 * MiB,
            reserved=520 * MiB,
            allocated=3 * GiB,
            api="v2",
        ),
        processes=(
            NvmlProcess(pid=4242, used_memory=2 * GiB, kind="compute"),
            NvmlProcess(pid=4243, used_memory=None, kind="compute"),
            NvmlProcess(pid=4242, used_memory=1 * GiB, kind="graphics"),
        ),
        mig_enabled=False,
        persistence_mode=True,
        numa_node=None,
        architecture=9,
        nvlink_active=0,
    )
    assert (second.uuid, second.pci_bus_id, second.minor) == ("GPU-second", "00000000:9C:00.0", 7)
    assert second.processes == (NvmlProcess(pid=77, used_memory=500 * MiB, kind="mps"),)
    assert not second.coherent_memory


def test_eight_gpu_host_reads_every_gpu_with_its_own_memory_and_processes(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    fake_nvml.write(
        state(
            gpu(i, allocated=(i + 1) * GiB, processes=[process(1000 + i, (i + 1) * GiB)])
            for i in range(8)
        )
    )

    reading = client.read()

    assert [g.index for g in reading.gpus] == list(range(8))
    assert len({g.uuid for g in reading.gpus}) == 8
    for i, info in enumerate(reading.gpus):
        assert info.memory is not None
        assert info.memory.allocated == (i + 1) * GiB
        assert info.processes == (NvmlProcess(1000 + i, (i + 1) * GiB, "compute"),)
        assert info.error is None


def test_state_changes_between_polls_are_seen_by_the_same_worker(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    fake_nvml.write(state([gpu(0, processes=[process(10)])]))
    first = client.read()
    pids = client.worker_pids
    fake_nvml.update_gpu(0, processes={"compute": []}, memory={"total": 80 * GiB, "used": 0})

    second = client.read()

    assert client.worker_pids == pids
    assert first.gpus[0].processes == (NvmlProcess(10, 500 * MiB, "compute"),)
    assert second.gpus[0].processes == ()
    assert second.gpus[0].memory is not None
    assert second.gpus[0].memory.allocated == 0


@pytest.mark.parametrize(
    "over",
    [
        pytest.param({"v2_memory": False}, id="v2-not-supported"),
        pytest.param(
            {"errors": {"nvmlDeviceGetMemoryInfo_v2": NVML_ERROR_FUNCTION_NOT_FOUND}},
            id="v2-symbol-absent",
        ),
    ],
)
def test_v1_memory_fallback_leaves_allocated_unknown_and_is_logged_once_per_gpu(
    fake_nvml: FakeNvml, client: NvmlClient, over: dict[str, Any]
) -> None:
    fake_nvml.write(state([gpu(0, allocated=1 * GiB, reserved=512 * MiB, **over), gpu(1)]))

    with capture_logs() as logs:
        readings = [client.read(), client.read()]

    for reading in readings:
        memory = reading.gpus[0].memory
        assert memory == GpuMemory(
            total=80 * GiB,
            free=80 * GiB - 1 * GiB - 512 * MiB,
            reserved=None,
            allocated=None,
            api="v1",
            used_v1=1 * GiB + 512 * MiB,  # v1 "used" includes the driver's reservation
        )
        assert reading.gpus[1].memory is not None
        assert reading.gpus[1].memory.api == "v2"
    fallbacks = [e for e in logs if e["event"] == EventName.NVML_MEMORY_V1_FALLBACK]
    assert [e["gpu"] for e in fallbacks] == [readings[0].gpus[0].uuid]


@pytest.mark.parametrize(
    ("function", "field"),
    [
        ("nvmlDeviceGetPersistenceMode", "persistence_mode"),
        ("nvmlDeviceGetNumaNodeId", "numa_node"),
        ("nvmlDeviceGetName", "name"),
        ("nvmlDeviceGetPciInfo_v3", "pci_bus_id"),
    ],
)
def test_not_supported_value_is_none_without_an_error(
    fake_nvml: FakeNvml, client: NvmlClient, function: str, field: str
) -> None:
    fake_nvml.write(
        state(
            [gpu(0, numa_node=0, errors={function: NVML_ERROR_NOT_SUPPORTED}), gpu(1, numa_node=1)]
        )
    )

    reading = client.read()

    assert getattr(reading.gpus[0], field) is None
    assert reading.gpus[0].error is None
    assert getattr(reading.gpus[1], field) is not None


@pytest.mark.parametrize(
    ("over", "architecture", "active", "needs_peers"),
    [
        ({}, 9, 0, False),
        ({"architecture": 9, "nvlink_links": 18, "nvlink_active": 18}, 9, 18, False),
        ({"architecture": 7, "nvlink_links": 12, "nvlink_active": 12}, 7, 12, True),
        ({"architecture": 5, "nvlink_links": 6, "nvlink_active": 6}, 5, 6, True),
        ({"architecture": 7, "nvlink_links": 12, "nvlink_active": 0}, 7, 0, False),
        ({"architecture": 7, "errors": {"nvmlDeviceGetNvLinkState": 999}}, 7, None, None),
    ],
    ids=[
        "no-nvlink",
        "hopper-nvlink",
        "ampere-nvlink",
        "volta-nvlink",
        "ampere-links-down",
        "error",
    ],
)
def test_nvlink_topology_says_whether_a_reset_needs_the_peers(  # noqa: PLR0917 -- table columns
    fake_nvml: FakeNvml,
    client: NvmlClient,
    over: dict[str, Any],
    architecture: int,
    active: int | None,
    needs_peers: bool | None,
) -> None:
    fake_nvml.write(state([gpu(0, **over)]))

    info = client.read().gpus[0]

    assert (info.architecture, info.nvlink_active) == (architecture, active)
    assert info.reset_needs_nvlink_peers is needs_peers


def test_mig_not_supported_means_mig_disabled_not_unknown(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    """A GPU without MIG has it off; unknown would wrongly refuse every reset of it."""
    fake_nvml.write(state([gpu(0, errors={"nvmlDeviceGetMigMode": NVML_ERROR_NOT_SUPPORTED})]))

    info = client.read().gpus[0]

    assert info.mig_enabled is False
    assert info.error is None


def test_numa_node_marks_coherent_memory_and_missing_numa_node_does_not(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    failed = {"nvmlDeviceGetNumaNodeId": NVML_ERROR_UNKNOWN}
    older = {"nvmlDeviceGetNumaNodeId": NVML_ERROR_FUNCTION_NOT_FOUND}  # predates coherent GPUs
    fake_nvml.write(
        state([gpu(0, numa_node=2), gpu(1), gpu(2, errors=failed), gpu(3, errors=older)])
    )

    coherent, plain, unknown, old = client.read().gpus

    assert (coherent.numa_node, coherent.coherent_memory) == (2, True)
    assert (plain.numa_node, plain.coherent_memory) == (None, False)
    # A query that failed is unknown, never "not coherent" (ghost detection stays off there).
    assert (unknown.numa_node, unknown.coherent_memory) == (None, None)
    assert "nvmlDeviceGetNumaNodeId" in (unknown.error or "")
    assert (old.numa_node, old.coherent_memory, old.error) == (None, False, None)


def test_other_error_on_one_value_is_none_plus_a_gpu_error_and_the_rest_is_read(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    fake_nvml.write(state([gpu(0, errors={"nvmlDeviceGetMigMode": NVML_ERROR_UNKNOWN})]))

    (info,) = client.read().gpus

    assert info.mig_enabled is None
    assert info.error is not None
    assert "nvmlDeviceGetMigMode" in info.error
    assert info.memory is not None
    assert info.memory.allocated is not None
    assert not info.lost


def test_an_identity_value_that_failed_once_is_read_again_on_the_next_poll(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    fake_nvml.write(
        state([gpu(0, minor=3, errors={"nvmlDeviceGetMinorNumber": NVML_ERROR_UNKNOWN})])
    )
    (first,) = client.read().gpus
    fake_nvml.update_gpu(0, errors={})

    (second,) = client.read().gpus

    assert first.minor is None
    assert first.error is not None
    assert "nvmlDeviceGetMinorNumber" in first.error
    assert second.minor == 3
    assert second.error is None


def test_a_gpu_lost_after_an_identity_value_failed_keeps_the_identity_read(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    fake_nvml.write(state([gpu(0, errors={"nvmlDeviceGetMinorNumber": NVML_ERROR_UNKNOWN})]))
    (first,) = client.read().gpus
    fake_nvml.update_gpu(0, lost=True)

    (lost,) = client.read().gpus

    assert lost.lost
    assert first.uuid
    assert (lost.uuid, lost.pci_bus_id) == (first.uuid, first.pci_bus_id)


def test_process_list_falls_back_to_v2_symbol_when_v3_is_absent(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    absent = {"nvmlDeviceGetComputeRunningProcesses_v3": NVML_ERROR_FUNCTION_NOT_FOUND}
    fake_nvml.write(state([gpu(0, processes=[process(31, None)], errors=absent)]))

    (info,) = client.read().gpus

    assert info.processes == (NvmlProcess(31, None, "compute"),)
    assert info.error is None


@pytest.mark.parametrize("code", [NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_UNKNOWN])
def test_unreadable_compute_list_makes_the_process_list_unknown(
    fake_nvml: FakeNvml, client: NvmlClient, code: int
) -> None:
    failing = {"nvmlDeviceGetComputeRunningProcesses_v3": code}
    fake_nvml.write(state([gpu(0, processes=[process(5)], errors=failing)]))

    (info,) = client.read().gpus

    assert info.processes is None


def test_gpu_lost_mid_run_marks_only_that_gpu_and_keeps_its_identity(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    fake_nvml.write(state([gpu(0, processes=[process(9)]), gpu(1, processes=[process(10)])]))
    before = client.read()
    fake_nvml.update_gpu(0, lost=True)

    after = client.read()

    lost, healthy = after.gpus
    assert not before.gpus[0].lost
    assert lost.lost
    assert (lost.uuid, lost.minor, lost.pci_bus_id) == (
        before.gpus[0].uuid,
        before.gpus[0].minor,
        before.gpus[0].pci_bus_id,
    )
    assert lost.memory is None
    assert lost.processes is None
    assert not healthy.lost
    assert healthy == before.gpus[1]


# --- the driver missing or failing --------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
        (NVML_ERROR_LIB_RM_VERSION_MISMATCH, "version mismatch"),
    ],
)
def test_init_failure_reads_as_unavailable_with_the_reason(
    fake_nvml: FakeNvml, client: NvmlClient, code: int, message: str
) -> None:
    fake_nvml.write(state([gpu(0)], init_error=code))

    reading = client.read()

    assert not reading.available
    assert reading.error is not None
    assert reading.error.startswith("NVIDIA driver/NVML not available: ")
    assert message in reading.error
    assert reading.gpus == ()
    assert client.worker_pids == frozenset()


def test_unparsable_state_reads_as_unavailable(fake_nvml: FakeNvml, client: NvmlClient) -> None:
    fake_nvml.state_path.write_text('{"gpus": [')

    reading = client.read()

    assert not reading.available


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None,
    reason="a real libnvidia-ml is installed, so an empty LD_LIBRARY_PATH still finds one",
)
def test_missing_library_reads_as_unavailable_with_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    client = NvmlClient(timeout=5.0, env={"LD_LIBRARY_PATH": str(empty)})
    try:
        reading = client.read()
    finally:
        client.stop()

    assert not reading.available
    assert reading.error == (
        "NVIDIA driver/NVML not available: "
        "libnvidia-ml.so.1 not found (is the NVIDIA driver installed?)"
    )


def test_unavailable_driver_is_retried_only_after_backoff(
    fake_nvml: FakeNvml, client: NvmlClient, clock: list[float]
) -> None:
    fake_nvml.write(state([gpu(0)], init_error=NVML_ERROR_DRIVER_NOT_LOADED))
    assert not client.read().available
    fake_nvml.write(state([gpu(0)]))  # the driver loads

    clock[0] += 1.0  # backoff is 2 s
    during_backoff = client.read()
    clock[0] += 1.5
    after_backoff = client.read()

    assert not during_backoff.available
    assert after_backoff.available
    assert len(after_backoff.gpus) == 1


# --- deadlines --------------------------------------------------------------------------------


HANG = {"nvmlDeviceGetComputeRunningProcesses_v3": 30.0}


def _hung(fake_nvml: FakeNvml, clock: list[float], *, timeout: float, backoff: float) -> NvmlClient:
    """A client of GPU 0 whose process query hangs for 30 s."""
    fake_nvml.write(state([gpu(0)], delays=HANG))
    return NvmlClient(
        timeout=timeout, env=fake_nvml.env(), clock=lambda: clock[0], backoff_initial=backoff
    )


def test_a_driver_that_stays_hung_is_logged_wedged_once_a_stretch(
    fake_nvml: FakeNvml, clock: list[float]
) -> None:
    client = _hung(fake_nvml, clock, timeout=0.5, backoff=1.0)
    try:
        with capture_logs() as logs:
            for _ in range(3):  # three retries of a driver that stays hung
                assert client.read().wedged
                clock[0] += 60.0
            fake_nvml.write(state([gpu(0)]))
            # This read starts a fresh worker (an interpreter, pynvml): the default deadline,
            # so that a loaded machine's slow start-up is not taken for a hung driver.
            client.timeout = 10.0
            assert client.read().available
            client.timeout = 0.5
            fake_nvml.write(state([gpu(0)], delays=HANG))
            assert client.read().wedged  # a new stretch is logged again
        wedged = [e for e in logs if e["event"] == EventName.NVML_WEDGED]
        assert [e["log_level"] for e in wedged] == ["critical", "critical"]
    finally:
        client.stop()


def test_hung_call_reads_as_wedged_within_the_deadline_and_recovers_after_backoff(
    fake_nvml: FakeNvml, clock: list[float]
) -> None:
    client = _hung(fake_nvml, clock, timeout=1.0, backoff=5.0)
    try:
        started = time.monotonic()
        with capture_logs() as logs:
            wedged = client.read()
        took = time.monotonic() - started
        dead_worker = [e["pid"] for e in logs if e["event"] == EventName.NVML_WEDGED]

        assert wedged.wedged
        assert wedged.available
        assert wedged.error == "NVML call did not return within 1s (driver may be hung)"
        assert took < 1.5
        assert [e["log_level"] for e in logs if e["event"] == EventName.NVML_WEDGED] == ["critical"]
        assert dead_worker[0] is not None
        assert not psutil.pid_exists(dead_worker[0])
        assert client.worker_pids == frozenset()

        # During backoff nothing is started and the answer comes at once.
        fake_nvml.write(state([gpu(0)]))
        started = time.monotonic()
        still = client.read()
        assert still.wedged
        assert time.monotonic() - started < 0.2
        assert worker_children() == set()

        clock[0] += 5.0
        recovered = client.read()
        assert recovered.available
        assert not recovered.wedged
        assert len(recovered.gpus) == 1
    finally:
        client.stop()


# --- worker lifetime and device files -----------------------------------------------------------


def test_worker_holds_nvidiactl_and_each_gpus_minor_node_while_it_lives(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    fake_nvml.write(state([gpu(0, minor=3), gpu(1, minor=5)]))

    client.read()

    (pid,) = client.worker_pids
    assert open_device_files(pid, fake_nvml.devices_dir) == {"nvidiactl", "nvidia3", "nvidia5"}


def test_worker_pids_name_every_live_worker_of_ours(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    fake_nvml.write(state([gpu(0)]))
    assert client.worker_pids == frozenset()

    client.read()

    assert len(client.worker_pids) == 1
    assert worker_children() == set(client.worker_pids)


def test_stop_ends_the_worker_and_releases_every_device_file(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    fake_nvml.write(state(gpu(i) for i in range(4)))
    client.read()
    (pid,) = client.worker_pids
    assert open_device_files(pid, fake_nvml.devices_dir) == {
        "nvidiactl",
        "nvidia0",
        "nvidia1",
        "nvidia2",
        "nvidia3",
    }

    stopped = client.stop()

    assert stopped
    assert client.worker_pids == frozenset()
    assert not psutil.pid_exists(pid)
    assert worker_children() == set()
    assert holders_of(fake_nvml.devices_dir) == {}


def test_read_after_stop_starts_a_fresh_worker(fake_nvml: FakeNvml, client: NvmlClient) -> None:
    fake_nvml.write(state([gpu(0)]))
    client.read()
    (first,) = client.worker_pids
    client.stop()

    reading = client.read()

    assert reading.available
    (second,) = client.worker_pids
    assert second != first


def test_worker_that_died_is_replaced_on_a_later_poll(
    fake_nvml: FakeNvml, client: NvmlClient, clock: list[float]
) -> None:
    fake_nvml.write(state([gpu(0)]))
    client.read()
    (pid,) = client.worker_pids
    os.kill(pid, 9)  # our own child
    deadline = time.monotonic() + 5
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)

    broken = client.read()
    clock[0] += 10.0
    healed = client.read()

    assert not broken.available
    assert broken.error is not None
    assert "exited unexpectedly" in broken.error
    assert healed.available
    assert pid not in client.worker_pids


REPLIER = """import sys
for request in sys.stdin:
    if "shutdown" in request:
        print('{"shutdown": true}', flush=True)
        break
    print(open(sys.argv[1]).read().strip(), flush=True)
"""


@pytest.mark.parametrize(
    "gpus",
    [
        '[{"index": 0, "memory": {"total": Infinity}}]',
        '[{"index": 0, "processes": [{"pid": NaN}]}]',
        pytest.param('[{"index": 0, "minor": 1' + "0" * 400 + "}]", id="huge-minor"),
        '[{"index": 0, "processes": [{"pid": 7, "used_memory": -1}]}]',
        '[{"index": 0, "processes": {"pid": 7}}]',
        '[{"index": 0, "error": ["lost"]}]',
        '[{"index": 0, "lost": "false"}]',  # bool() would read it lost
        '[{"index": 0, "mig_mode": "false"}]',  # ... and MIG on
        '[{"index": 0, "persistence_mode": 2}]',
        '[{"index": 0, "numa_node_unknown": "true"}]',
        '[{"index": 0, "memory": {"api": ["v1"]}}]',  # str() would read it "['v1']"
        '[{"index": 0, "processes": [{"pid": 7, "kind": 1}]}]',
        pytest.param('[{"index": 0}], "driver_version": 550', id="driver-version-number"),
        '[{"uuid": "GPU-0"}]',
        '{"0": {"index": 0}}',
        '["GPU-0"]',
        pytest.param("[" * 100_000 + "]" * 100_000, id="nested-too-deeply"),
    ],
)
def test_a_malformed_worker_reply_reads_as_unavailable_said_once(
    tmp_path: Path, clock: list[float], gpus: str
) -> None:
    """The worker runs the vendor's library and its replies cross a pipe: a value of another
    type, or one NVML's C types cannot hold, makes the poll's reading unavailable (said once,
    as a failed read), never an exception out of the poll nor a number to act on."""
    reply, script = tmp_path / "reply", tmp_path / "worker.py"
    reply.write_text(f'{{"available": true, "gpus": {gpus}}}')
    script.write_text(REPLIER)

    def spawn(argv: list[str], **options: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, str(script), str(reply)], **options)

    client = NvmlClient(timeout=5.0, clock=lambda: clock[0], backoff_initial=2.0, spawn=spawn)
    try:
        with capture_logs() as logs:
            broken = [client.read(), client.read()]
            clock[0] += 10.0  # past the backoff: asked again, the same reply
            broken.append(client.read())
        reply.write_text('{"available": true, "notices": ["memory_v1", 7], "gpus": [{"index": 0}]}')
        clock[0] += 10.0
        healed = client.read()
    finally:
        client.stop()
    for reading in broken:
        assert not reading.available
        assert reading.gpus == ()
        assert str(reading.error).startswith(f"{UNAVAILABLE_PREFIX}NVML worker sent ")
    said = [e["event"] for e in logs if e["log_level"] != "debug"]
    assert said == [EventName.NVML_UNAVAILABLE]
    assert [g.index for g in healed.gpus] == [0]


def test_a_memory_v1_notice_is_said_with_its_values_escaped_and_cut(
    tmp_path: Path, clock: list[float]
) -> None:
    """The worker's memory-v1 notice gave its event the uuid through str() (a 7 was GPU "7")
    and the reason and index raw (a newline, an escape sequence, any length): each is shown as
    event values are (docs/events.md), escaped and cut; a uuid or reason not a string is
    unknown, the GPU then named by its index."""
    uuid, reason = "GPU-0\nevent=forged" + "x" * 500, "v2 \x1b[2J" + "y" * 500
    notices = [
        {"notice": "memory_v1", "index": 0, "uuid": uuid, "reason": reason},
        {"notice": "memory_v1", "index": 1, "uuid": 7, "reason": ["not", "text"]},
    ]
    reply, script = tmp_path / "reply", tmp_path / "worker.py"
    reply.write_text(json.dumps({"available": True, "notices": notices, "gpus": [{"index": 0}]}))
    script.write_text(REPLIER)

    def spawn(argv: list[str], **options: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, str(script), str(reply)], **options)

    client = NvmlClient(timeout=5.0, clock=lambda: clock[0], spawn=spawn)
    try:
        with capture_logs() as logs:
            assert client.read().available
    finally:
        client.stop()
    said = [e for e in logs if e["event"] == EventName.NVML_MEMORY_V1_FALLBACK]
    assert [(e["gpu"], e["index"], e["reason"]) for e in said] == [
        (short(uuid), 0, short(reason)),
        ("index:1", 1, None),
    ]
    assert len(short(uuid)) == VALUE_MAX
    assert "\n" not in short(uuid)


PATCHED_WORKER = """import ast, sys
sys.path.insert(0, sys.argv[1])
import pynvml
from gpuwatchd.collect import nvml_worker
pynvml.nvmlSystemGetDriverVersion = lambda: ast.literal_eval(sys.argv[2])
sys.exit(nvml_worker.main())
"""


@pytest.mark.parametrize(
    ("version", "driver", "error"),
    [("b'550.54.15'", "550.54.15", None), ("550", None, "driver_version: expected a string")],
)
def test_a_driver_version_not_a_string_is_never_made_one(
    fake_nvml: FakeNvml, clock: list[float], version: str, driver: str | None, error: str | None
) -> None:
    """The library's driver version went through ``str()``: bytes became "b'550.54.15'" and a
    number text that looks valid. Bytes are decoded as the other texts are; anything else is
    a reply not of the worker's shape (NVML unavailable), naming the field."""
    fake_nvml.write(state([gpu(0)]))
    root = str(Path(__file__).resolve().parents[2])

    def spawn(argv: list[str], **options: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", PATCHED_WORKER, root, version], **options)

    client = NvmlClient(timeout=5.0, env=fake_nvml.env(), clock=lambda: clock[0], spawn=spawn)
    try:
        reading = client.read()
    finally:
        client.stop()
    assert reading.driver_version == driver
    assert error is None or error in str(reading.error)


def test_a_reply_that_never_ends_is_cut_at_its_bound_not_read_into_memory(
    tmp_path: Path, clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that writes without ever ending its line is given up at ``MAX_REPLY`` bytes
    (unavailable, said once), before the poll's deadline, not read into memory whole."""
    monkeypatch.setattr(nvml_module, "MAX_REPLY", 1 << 20)
    script = tmp_path / "worker.py"
    script.write_text("import sys\nsys.stdin.readline()\nwhile 1:\n    print('x' * 4096, end='')\n")

    def spawn(argv: list[str], **options: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, str(script)], **options)

    client = NvmlClient(timeout=20.0, clock=lambda: clock[0], backoff_initial=2.0, spawn=spawn)
    try:
        with capture_logs() as logs:
            reading = client.read()
    finally:
        client.stop()
    assert not reading.available  # not wedged: the deadline did not end it
    assert reading.error == f"{UNAVAILABLE_PREFIX}NVML worker sent a reply over 1 MiB"
    assert [e["event"] for e in logs if e["log_level"] != "debug"] == [EventName.NVML_UNAVAILABLE]
    assert not client.worker_pids


def test_the_worker_runs_from_compiled_code_kept_beside_its_file(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    """A worker start does not compile the worker's source again (~7 ms of each start): the
    bootstrap runs the file through the import system, which keeps its compiled code in
    ``__pycache__`` beside it, as for any module of the package."""
    fake_nvml.write(state([gpu(0)]))
    worker = tmp_path / "copy" / "nvml_worker.py"
    worker.parent.mkdir()
    shutil.copyfile(WORKER_FILE, worker)
    argv = worker_command(sys.executable, library_folders(sys.path, os.getcwd()), str(worker))
    proc = subprocess.run(
        argv,
        input='{"op": "read"}\n',
        env=worker_environment(os.environ, fake_nvml.env()),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    reply = json.loads(proc.stdout.splitlines()[0])
    assert reply["available"] is True
    assert [g["uuid"] for g in reply["gpus"]] == [gpu(0)["uuid"]]
    compiled = worker.parent / "__pycache__" / f"nvml_worker.{sys.implementation.cache_tag}.pyc"
    assert compiled.is_file()
