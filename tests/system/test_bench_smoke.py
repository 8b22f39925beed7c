"""Smoke run of the benchmarks (``bench/run.py --quick``): they run, agree with fuser and lsof.

No timing is asserted here (CI machines are noisy); the figures themselves are reported by
``make bench`` and docs/performance.md. What is pinned: the quick run finishes, writes its JSON,
the full scan found exactly the holder set that fuser and lsof found, the steady-state host
produced no findings, and — where a PID namespace exists — the latency scenarios saw the
orphan signalled and its exit noticed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.simhost import pid_namespace_command

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(
        shutil.which("fuser") is None or shutil.which("lsof") is None,
        reason="needs fuser (psmisc) and lsof to compare against",
    ),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "run.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "figure" in proc.stdout  # the table was printed
    data: dict[str, Any] = json.loads((out / "quick-latest.json").read_text())
    return data


def test_quick_bench_full_scan_finds_the_same_holders_as_fuser_and_lsof(
    quick_results: dict[str, Any],
) -> None:
    scan = quick_results["main"]["scan_path_mode"]
    assert scan["identical_sets"], scan.get("differences")
    assert scan["set_sizes"] == {
        "gpuwatchd": scan["holders_expected"],
        "fuser": scan["holders_expected"],
        "lsof": scan["holders_expected"],
    }


def test_quick_bench_device_number_mode_agrees_with_fuser_in_a_namespace(
    quick_results: dict[str, Any],
) -> None:
    if not quick_results["host"]["pid_namespace"]:
        pytest.skip("device-number mode is only benchmarked inside a PID namespace")
    scan = quick_results["main"]["scan_device_mode"]
    assert scan["identical_sets"], scan.get("differences")


def test_quick_bench_steady_host_polls_without_findings(quick_results: dict[str, Any]) -> None:
    poll = quick_results["main"]["poll"]
    assert poll["findings_last_poll"] == 0
    assert poll["full_scans"] >= 1  # the 60 s full-scan cadence played out on the virtual clock
    assert poll["targeted_median_ms"] is not None
    memory = quick_results["main"]["memory"]
    assert memory["samples"], "RSS was sampled"


@pytest.mark.skipif(pid_namespace_command() is None, reason="latency needs a PID namespace")
def test_quick_bench_latency_sees_orphan_signalled_and_gone(
    quick_results: dict[str, Any],
) -> None:
    latency = quick_results["latency"]
    by_kind = {t["ignore_term"]: t for t in latency["trials"]}
    assert by_kind[False]["signals"][0] == "SIGTERM"
    assert "gone_ms" in by_kind[False]
    assert by_kind[True]["signals"][:2] == ["SIGTERM", "SIGKILL"]
    assert "kill_slack_ms" in by_kind[True]


def test_quick_bench_whole_process_scan_alone_and_beside_the_daemon(
    quick_results: dict[str, Any],
) -> None:
    """Issue 16's rows: the whole ``scan`` process against fuser, alone (a walk) and beside a
    running daemon (built on its view), with the same holders as fuser every time."""
    (row,) = quick_results["cli_scan"]
    assert row["alone"]["identical_sets"]
    assert row["alone"]["scan_mode"] == "full"
    beside = row["with_daemon"]
    assert beside["identical_sets"]
    assert beside["scan_mode"] == "targeted"
    # Each served round starts from a clean view: each is served (issue 25).
    assert beside["served_rounds"] == beside["rounds"]
    # An open just before a served scan is never missed (walked or served, it is listed).
    stale = row["stale"]
    assert stale["rounds"] >= 1
    assert stale["missed"] == 0, stale
    cpu = quick_results["main"]["daemon_cpu"]
    assert cpu["opens_every_30s"]["walks"] >= 1  # the opens made the daemon walk
    real = cpu["real_quiet"]
    assert real["cpu_s"] > 0, real  # the real daemon ran and was measured
    assert not real["worker_restarted"]
