"""NVML through ctypes, for the tests that call the fake ``libnvidia-ml.so.1`` in this process.

Owns NVML's return codes and structs as nvml.h lays them out, loading the library by full path
(so LD_LIBRARY_PATH is not involved) and pointing its environment at a ``FakeNvml`` state.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakenvml import FakeNvml, ensure_built, state

SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
GPU_IS_LOST = 15
VERSION_MISMATCH = 25
UNKNOWN = 999
NO_INSTANCE = 0xFFFFFFFF
MEMORY_V2 = 0x02000028  # nvmlMemory_v2's struct version


class ProcessInfo(ctypes.Structure):
    """nvmlProcessInfo_v2_t, which the ``_v3`` process queries fill."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class MemoryV2(ctypes.Structure):
    """nvmlMemory_v2_t; ``version`` must be ``MEMORY_V2``."""

    _fields_ = [("version", ctypes.c_uint)] + [
        (name, ctypes.c_ulonglong) for name in ("total", "reserved", "free", "used")
    ]


def load() -> ctypes.CDLL:
    """The fake library, built first when it is missing or older than its source."""
    return ctypes.CDLL(str(ensure_built()))


def fake_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """A fake state under ``tmp_path`` that the library loaded here reads (it reads its
    environment at every call, so ``monkeypatch.setenv`` reaches it)."""
    nvml = FakeNvml(tmp_path)
    for key, value in nvml.env().items():
        if key != "LD_LIBRARY_PATH":
            monkeypatch.setenv(key, value)
    return nvml


def handle(lib: ctypes.CDLL, index: int) -> ctypes.c_void_p:
    device = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(device)) == SUCCESS
    return device


@contextmanager
def initialised(lib: ctypes.CDLL, fake: FakeNvml, gpus: Sequence[Any]) -> Iterator[ctypes.CDLL]:
    """``lib`` initialised over a state of ``gpus``; shut down (and checked) afterwards."""
    fake.write(state(list(gpus)))
    assert lib.nvmlInit_v2() == SUCCESS
    yield lib
    assert lib.nvmlShutdown() == SUCCESS
