"""`make demo` ends the same way every time: the orphans gone, the live job untouched, every
GPU back to idle, no finding left (it used to end, one run in three, with GPU 1 still showing
2 GiB and a fresh ghost-memory finding)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.demo import compact
from tests.support.fakenvml import MiB
from tests.support.simhost import pid_namespace_command, run_in_pid_namespace


@pytest.mark.slow
@pytest.mark.root
def test_the_demo_ends_with_a_clean_node(tmp_path: Path) -> None:
    if pid_namespace_command() is None:
        pytest.skip("needs a PID namespace (root or user namespaces) to run the demo safely")
    for attempt in range(2):
        root = tmp_path / f"run{attempt}"
        root.mkdir()
        result = run_in_pid_namespace("tests.support.demo:demo", {}, root=root, timeout=300)
        assert result["exit_code"] == 0
        assert result["alive"] == {
            "sshd": True,
            "trainer": True,
            "loader-1": True,
            "loader-2": True,
            "orphan-1": False,
            "orphan-2": False,
        }
        assert result["findings"] == []
        # GPU 0 keeps its live job's memory; GPUs 1 and 2 are back to idle.
        assert [used <= 2 * MiB for used in result["allocated"]] == [False, True, True]


def test_the_demo_names_a_gpu_by_its_index_not_a_uuid_prefix() -> None:
    line = (
        '{"timestamp": "2026-12-06T00:00:01Z", "level": "warning", "event": "finding.new",'
        ' "gpu": "GPU-00000001-face-4000-8000-000000000001", "kind": "orphaned", "pid": 7}'
    )
    shown = compact(line, 0.0, {"GPU-00000001-face-4000-8000-000000000001": 1})
    assert "GPU 1 " in shown
    assert "00000001" not in shown
