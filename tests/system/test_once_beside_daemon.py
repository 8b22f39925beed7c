"""End to end: `run --once` beside a running daemon (a Slurm epilog), and `check-clean` (a prolog).

Like tests/system/test_e2e_run.py, each ``host_*`` function runs as PID 1 of its own PID namespace
(tests/support/simhost.py) with the fake NVML and real processes, so nothing here can reach a
process this test did not start.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support.daemonrun import ORPHAN_RULE, Run, orphan_host
from tests.support.fakenvml import GiB, MiB, gpu, process
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)

pytestmark = [needs_pid_namespace(), pytest.mark.slow]

# The orphan ignores SIGTERM: the daemon's ladder needs its SIGTERM wait (2 s) and a SIGKILL, so
# the once-run starts while the daemon is still at work.
SLOW_RULE = {
    **ORPHAN_RULE,
    "steps": [{"signal": "SIGTERM", "wait": "2s"}, {"signal": "SIGKILL", "wait": "1s"}],
}


def _once(host: SimHost, run: Run, timeout: str) -> dict[str, Any]:
    started = time.monotonic()
    result = host.gpuwatchd(
        "run", "--once", "--timeout", timeout, "--config", str(run.config), timeout=90
    )
    return {
        "code": result.returncode,
        "output": result.stdout + result.stderr,
        "took": time.monotonic() - started,
    }


def _free_when_gone(host: SimHost, name: str) -> None:
    """Idle GPU 0 in the fake NVML once ``name`` is dead (a zombie counts: it holds nothing).
    Never reaps: the main thread's subprocess must get its own child's exit status."""
    deadline = time.monotonic() + 60
    while host.alive(host.pids[name]) and time.monotonic() < deadline:
        time.sleep(0.02)
    host.nvml([gpu(0)])


def host_once_waits_for_the_daemon(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        orphan_host(host, ignore_term=True)
        run = Run(host, rules=[SLOW_RULE])
        run.start()
        assert run.wait_for(lambda: run.saw(EventName.DAEMON_START)), "the daemon did not start"
        alive_before = host.alive(host.pids["worker"])
        # As the driver does: once the last holder is dead, NVML no longer lists the job.
        driver = threading.Thread(target=_free_when_gone, args=(host, "worker"), daemon=True)
        driver.start()
        once = _once(host, run, "30s")
        gone = not host.alive(host.pids["worker"])  # dead; a zombie until reaped
        run.stop()
        signals = [
            (e.get("pid"), e.get("signal"), e.get("outcome"))
            for e in run.events()
            if e.get("event") == EventName.ACTION_SIGNAL
        ]
        return {
            **once,
            "alive_before": alive_before,
            "gone": gone,
            "signals": signals,
            "pids": host.pids,
        }


def host_once_times_out_beside_a_dry_run_daemon(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        orphan_host(host)
        run = Run(host, dry_run=True)
        run.start()
        assert run.wait_for(lambda: run.saw(EventName.DAEMON_START)), "the daemon did not start"
        once = _once(host, run, "3s")
        alive = host.alive(host.pids["worker"])
        run.stop()
        return {**once, "alive": alive, "pids": host.pids}


def host_check_clean(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """GPU 0 keeps a dead job's memory (its trainer died, a worker holds it); GPU 1 is idle.
    No daemon runs."""
    with SimHost(root, gpus=2) as host:
        orphan_host(host)
        host.nvml(
            [
                gpu(0, allocated=3 * GiB, processes=[process(host.pids["trainer"], 700 * MiB)]),
                gpu(1),
            ]
        )
        config = str(host.config(rules=[ORPHAN_RULE]))
        results = {}
        for name, args in {
            "gpu0": ["--gpu", "0"],
            "gpu1": ["--gpu", "1"],
            "all": [],
            "cuda_visible": ["--gpu", "1,0"],
            "unknown": ["--gpu", "7"],
        }.items():
            result = host.gpuwatchd("check-clean", "--config", config, *args)
            results[name] = {
                "code": result.returncode,
                "stdout": result.stdout,
                "stderr": result.stderr,
            }
        uuid = host.scan_json()["gpus"][0]["uuid"]
        return {"results": results, "uuid0": uuid, "alive": host.alive(host.pids["worker"])}


# --- tests ---------------------------------------------------------------------------------


def run_scenario(name: str, tmp_path: Path) -> dict[str, Any]:
    return run_in_pid_namespace(f"{__name__}:{name}", {}, root=tmp_path, timeout=150)


def test_once_beside_the_daemon_waits_for_its_progress_and_acts_on_nothing(
    tmp_path: Path,
) -> None:
    result = run_scenario("host_once_waits_for_the_daemon", tmp_path)
    assert result["code"] == 0, result["output"]
    assert result["alive_before"] is True
    assert result["gone"] is True
    assert result["took"] > 1.0  # it waited for the ladder (SIGTERM ignored, 2 s, SIGKILL)
    worker = result["pids"]["worker"]
    assert [worker, "SIGKILL", "delivered"] in result["signals"]  # lists after JSON
    # The once-run only watched: no action of its own, no loop of its own.
    assert EventName.ACTION_SIGNAL not in result["output"]
    assert EventName.DAEMON_START not in result["output"]
    assert "is running; waiting" in result["output"]


def test_once_beside_a_dry_run_daemon_ends_with_75_naming_the_finding(
    tmp_path: Path,
) -> None:
    """A dry-run daemon acts on nothing: once its dry-run ladder has ended (or at the
    timeout, whichever comes first) the epilog gives up, naming the orphan."""
    result = run_scenario("host_once_times_out_beside_a_dry_run_daemon", tmp_path)
    assert result["code"] == 75, result["output"]
    assert result["alive"] is True
    worker = result["pids"]["worker"]
    last = result["output"].strip().splitlines()[-1]
    assert "timed out" in last or "nothing the daemon does will change it" in last
    assert "GPU 0 GPU-" in last
    assert f"orphaned pid {worker}" in last
    assert EventName.ACTION_SIGNAL not in result["output"]


def test_check_clean_refuses_a_gpu_with_a_dead_jobs_memory_and_passes_an_idle_one(
    tmp_path: Path,
) -> None:
    result = run_scenario("host_check_clean", tmp_path)
    runs = result["results"]
    assert runs["gpu0"]["code"] == 1, runs["gpu0"]
    lines = runs["gpu0"]["stdout"].splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"GPU 0 {result['uuid0']}: ")
    assert runs["gpu1"] == {"code": 0, "stdout": "", "stderr": ""}
    assert runs["all"]["code"] == 1
    assert runs["cuda_visible"]["code"] == 1
    assert runs["unknown"]["code"] == 2
    assert "names no GPU" in runs["unknown"]["stderr"]
    assert result["alive"] is True  # a read-only scan
