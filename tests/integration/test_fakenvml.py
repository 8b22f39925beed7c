"""The fake libnvidia-ml.so.1 itself, called through ctypes in this process.

These pin the behaviour other tests rely on: strict JSON parsing, the size-probe protocol of
process lists, the v2 struct version check, init reference counting and the device files it
opens and closes. The library is loaded by full path, so LD_LIBRARY_PATH is not involved; its
environment variables are read at every call, so ``monkeypatch.setenv`` reaches it.
"""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakenvml import FakeNvml, gpu, open_device_files, state
from tests.support.nvmlctypes import (
    GPU_IS_LOST,
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    MEMORY_V2,
    NOT_SUPPORTED,
    SUCCESS,
    UNINITIALIZED,
    UNKNOWN,
    VERSION_MISMATCH,
    MemoryV2,
    ProcessInfo,
    fake_in_process,
    handle,
    initialised,
    load,
)


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return load()


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    return fake_in_process(tmp_path, monkeypatch)


@pytest.fixture
def session(lib: ctypes.CDLL, fake: FakeNvml) -> Iterator[ctypes.CDLL]:
    """An initialised library over a two-GPU state; shut down afterwards."""
    with initialised(lib, fake, [gpu(0), gpu(1)]) as opened:
        yield opened


def uuid_of(lib: ctypes.CDLL, device: ctypes.c_void_p) -> tuple[int, str]:
    buffer = ctypes.create_string_buffer(96)
    rc = lib.nvmlDeviceGetUUID(device, buffer, 96)
    return rc, buffer.value.decode()


@pytest.mark.parametrize(
    ("raw_uuid", "expected"),
    [
        pytest.param('"GPU-plain"', "GPU-plain", id="plain"),
        pytest.param('"GPU-\\u00e9\\ud83d\\ude00"', "GPU-\u00e9\U0001f600", id="unicode-escapes"),
        pytest.param('"a\\"b\\\\c\\/d\\n"', 'a"b\\c/d\n', id="escapes"),
    ],
)
def test_strings_are_decoded_as_json_says(
    session: ctypes.CDLL, fake: FakeNvml, raw_uuid: str, expected: str
) -> None:
    text = json.dumps(state([gpu(0, uuid="PLACEHOLDER")])).replace('"PLACEHOLDER"', raw_uuid)
    fake.state_path.write_text(" \n" + text + "\n\t")

    assert uuid_of(session, handle(session, 0)) == (SUCCESS, expected)


@pytest.mark.parametrize(
    "broken",
    [
        '{"gpus": [',
        '{"gpus": []} trailing',
        "[1, 2]",
        "",
        '{"a": tru}',
        '{"a": "\x01"}',
        "{'a': 1}",
    ],
)
def test_malformed_state_makes_calls_fail_with_unknown(
    session: ctypes.CDLL, fake: FakeNvml, broken: str
) -> None:
    fake.state_path.write_text(broken)
    count = ctypes.c_uint()

    assert session.nvmlDeviceGetCount_v2(ctypes.byref(count)) == UNKNOWN


def test_process_list_answers_the_size_probe_then_fills_the_buffer(
    session: ctypes.CDLL, fake: FakeNvml
) -> None:
    listed: list[dict[str, Any]] = [
        {"pid": 7, "used_memory": 2**40},
        {"pid": 8, "used_memory": None},
    ]
    fake.write(state([gpu(0, processes=listed)]))
    device = handle(session, 0)
    count = ctypes.c_uint(0)

    probe = session.nvmlDeviceGetComputeRunningProcesses_v3(device, ctypes.byref(count), None)
    assert (probe, count.value) == (INSUFFICIENT_SIZE, 2)

    buffer = (ProcessInfo * 9)()
    count.value = 9
    rc = session.nvmlDeviceGetComputeRunningProcesses_v3(device, ctypes.byref(count), buffer)
    assert (rc, count.value) == (SUCCESS, 2)
    assert [(p.pid, p.usedGpuMemory) for p in buffer[:2]] == [(7, 2**40), (8, 2**64 - 1)]
    assert buffer[0].gpuInstanceId == 0xFFFFFFFF


def test_empty_process_list_succeeds_on_the_probe(session: ctypes.CDLL) -> None:
    count = ctypes.c_uint(0)

    rc = session.nvmlDeviceGetGraphicsRunningProcesses_v3(
        handle(session, 0), ctypes.byref(count), None
    )

    assert (rc, count.value) == (SUCCESS, 0)


@pytest.mark.parametrize(("version", "expected"), [(MEMORY_V2, SUCCESS), (1, VERSION_MISMATCH)])
def test_memory_v2_checks_the_struct_version(
    session: ctypes.CDLL, version: int, expected: int
) -> None:
    memory = MemoryV2(version=version)

    assert session.nvmlDeviceGetMemoryInfo_v2(handle(session, 0), ctypes.byref(memory)) == expected


def test_forced_errors_lost_gpus_and_bad_handles(session: ctypes.CDLL, fake: FakeNvml) -> None:
    fake.write(
        state(
            [gpu(0, lost=True), gpu(1, errors={"nvmlDeviceGetUUID": NOT_SUPPORTED})],
            errors={"nvmlDeviceGetUUID": UNKNOWN},
        )
    )
    device = ctypes.c_void_p()

    assert session.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(device)) == GPU_IS_LOST
    assert uuid_of(session, handle(session, 1))[0] == NOT_SUPPORTED  # per-GPU beats global
    assert session.nvmlDeviceGetHandleByIndex_v2(2, ctypes.byref(device)) == INVALID_ARGUMENT
    assert uuid_of(session, ctypes.c_void_p(16))[0] == INVALID_ARGUMENT


def test_device_files_follow_the_init_reference_count(lib: ctypes.CDLL, fake: FakeNvml) -> None:
    fake.write(state([gpu(0, minor=4), gpu(1, minor=6)]))
    me = os.getpid()

    assert lib.nvmlInit_v2() == SUCCESS
    assert open_device_files(me, fake.devices_dir) == {"nvidiactl"}
    handle(lib, 1)
    assert open_device_files(me, fake.devices_dir) == {"nvidiactl", "nvidia6"}
    assert lib.nvmlInitWithFlags(0) == SUCCESS
    assert lib.nvmlShutdown() == SUCCESS
    assert open_device_files(me, fake.devices_dir) == {"nvidiactl", "nvidia6"}
    assert lib.nvmlShutdown() == SUCCESS
    assert open_device_files(me, fake.devices_dir) == set()
    assert lib.nvmlShutdown() == UNINITIALIZED


def test_init_error_fails_init_and_opens_nothing(lib: ctypes.CDLL, fake: FakeNvml) -> None:
    fake.write(state([gpu(0)], init_error=9))

    assert lib.nvmlInit_v2() == 9
    assert open_device_files(os.getpid(), fake.devices_dir) == set()
    count = ctypes.c_uint()
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == UNINITIALIZED


class FabricInfoV3(ctypes.Structure):
    """nvmlGpuFabricInfo_v3_t as nvml.h and pynvml lay it out (v2 is the first 36 bytes)."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * 16),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
        ("healthMask", ctypes.c_uint32),
        ("healthSummary", ctypes.c_uint8),
    ]


FABRIC_V2, FABRIC_V3 = 0x02000024, 0x03000028


def test_fabric_info_checks_the_struct_version_and_never_writes_past_v2(
    session: ctypes.CDLL, fake: FakeNvml
) -> None:
    assert ctypes.sizeof(FabricInfoV3) == FABRIC_V3 & 0xFFFFFF
    fabric = {"state": 3, "status": 0, "health_mask": 0x1102, "health_summary": 1, "clique_id": 7}
    fake.write(state([gpu(0, fabric={**fabric, "max_version": 2}), gpu(1)]))
    info = FabricInfoV3(version=FABRIC_V2, healthSummary=0xEE)
    assert session.nvmlDeviceGetGpuFabricInfoV(handle(session, 0), ctypes.byref(info)) == SUCCESS
    assert (info.state, info.healthMask, info.cliqueId) == (3, 0x1102, 7)
    assert info.healthSummary == 0xEE  # byte 36 belongs to the caller under v2
    v3 = FabricInfoV3(version=FABRIC_V3)
    assert session.nvmlDeviceGetGpuFabricInfoV(handle(session, 0), ctypes.byref(v3)) == (
        VERSION_MISMATCH
    )
    fake.write(state([gpu(0, fabric=fabric), gpu(1)]))
    assert session.nvmlDeviceGetGpuFabricInfoV(handle(session, 0), ctypes.byref(v3)) == SUCCESS
    assert v3.healthSummary == 1
    odd = FabricInfoV3(version=0x01000020)
    assert session.nvmlDeviceGetGpuFabricInfoV(handle(session, 0), ctypes.byref(odd)) == (
        VERSION_MISMATCH
    )
    assert session.nvmlDeviceGetGpuFabricInfoV(handle(session, 1), ctypes.byref(v3)) == (
        NOT_SUPPORTED
    )
