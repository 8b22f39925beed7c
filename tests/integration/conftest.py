"""Fixtures several integration modules share (a module's own fixture of the same name wins)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fakeproc import FakeProc, make_devices
from tests.support.unkillable import HangingFuse, Unavailable


@pytest.fixture
def fake(tmp_path: Path) -> FakeProc:
    """An empty fake ``/proc`` to add processes to."""
    return FakeProc(tmp_path / "proc")


@pytest.fixture
def devices(tmp_path: Path) -> Path:
    """A device folder: ``nvidia0``, ``nvidia1``, ``nvidia3``, ``nvidiactl``, ``nvidia-uvm``."""
    return make_devices(tmp_path / "devs", minors=(0, 1, 3))


@pytest.fixture
def hanging_fuse(tmp_path: Path) -> Iterator[HangingFuse]:
    """A FUSE file whose close never completes: a process killed with it open stays in state D."""
    try:
        fuse = HangingFuse(tmp_path / "fuse").start()
    except Unavailable as why:
        pytest.skip(f"no unkillable process without FUSE: {why}")
    try:
        yield fuse
    finally:
        fuse.close()  # aborts the connection first: nothing stays stuck
