"""The unit's MemoryMax=/TasksMax= still leave headroom over what the daemon really uses.

Runs bench/unit_limits.py's measurement (a real daemon killing an orphan, then resetting the
GPU, with reset and on_action hooks, sampled through /proc) in its own PID namespace, and holds
its peaks against the unit's limits with the headroom docs/operations.md promises (4x memory,
8x tasks at least).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.simhost import needs_pid_namespace, run_in_pid_namespace
from tests.support.unitfile import memory_bytes, values

pytestmark = [needs_pid_namespace(), pytest.mark.slow]


def host_measure(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    from bench.unit_limits import measure

    return measure(root / "unit-limits")


def test_the_busy_daemon_stays_far_below_the_units_limits(tmp_path: Path) -> None:
    found = run_in_pid_namespace(f"{__name__}:host_measure", {}, root=tmp_path, timeout=120)
    # The measurement saw what it claims to measure: the kill, the reset and its three hooks,
    # with the hook running beside the daemon and its NVML worker.
    assert found["killed"] is True
    assert found["reset"] is True
    assert found["hooks"] == 3
    assert found["on_action"] >= 1
    assert found["peak_processes"] >= 3
    (memory,) = values("MemoryMax")
    (tasks,) = values("TasksMax")
    assert 0 < found["peak_rss_mib"] * 1024**2 * 4 <= memory_bytes(memory), found
    assert 0 < found["peak_tasks"] * 8 <= int(tasks), found
