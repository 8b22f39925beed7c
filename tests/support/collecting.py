"""A ``Collector`` over the fake driver (tests/support/fakenvml.py), as the integration tests of
collection build it: its device files, its NVML through the worker, no namespace check."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpuwatchd.collect.collector import Collector
from gpuwatchd.collect.nvml import NvmlClient
from gpuwatchd.collect.procfs import ProcFS
from tests.support.fakenvml import FakeNvml


@contextmanager
def fake_collector(
    fake_nvml: FakeNvml, clock: list[float] | None = None, **options: Any
) -> Iterator[Collector]:
    """The collector, its NVML worker closed afterwards; ``clock`` (one time, changed in place)
    drives both its monotonic and its wall clock."""
    if clock is not None:
        options.update(clock=lambda: clock[0], wall_clock=lambda: clock[0])
    nvml = NvmlClient(timeout=10.0, env=fake_nvml.env())
    try:
        yield Collector(
            ProcFS(devices_dir=str(fake_nvml.devices_dir)), nvml, namespace_check=False, **options
        )
    finally:
        nvml.stop()
