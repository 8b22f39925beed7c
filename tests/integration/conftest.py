"""Fixtures several integration modules share (a module's own fixture of the same name wins)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fakeproc import FakeProc, make_devices


@pytest.fixture
def fake(tmp_path: Path) -> FakeProc:
    """An empty fake ``/proc`` to add processes to."""
    return FakeProc(tmp_path / "proc")


@pytest.fixture
def devices(tmp_path: Path) -> Path:
    """A device folder: ``nvidia0``, ``nvidia1``, ``nvidia3``, ``nvidiactl``, ``nvidia-uvm``."""
    return make_devices(tmp_path / "devs", minors=(0, 1, 3))
