"""The real daemon on a quiet node: its CPU (and its NVML worker's) over minutes of wall time.

``bench/pollloop.py`` counts the CPU of ``poll_once`` on a virtual clock; this runs the real
``gpuwatchd run`` (shipped defaults: interval 5 s, backstop 10 min) on the benchmark's host,
waits until it has published a clean holder view and a warm-up has passed, then reads the
on-CPU nanoseconds of every thread of the daemon and of its children (the NVML worker) from
``/proc/PID/task/*/schedstat`` at the start and the end of the window. Everything the daemon
does counts: the polls, the wait between them, the state and view writes, the watchdog.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.pollloop import task_cpu_ns
from gpuwatchd.collect.procfs import ProcFS
from tests.support.simhost import SimHost


def _cpu_ns(pid: int) -> tuple[int, frozenset[int]]:
    """On-CPU ns of ``pid`` and its children, and which children those were."""
    kids = frozenset(ProcFS().children(pid))
    return task_cpu_ns(pid) + sum(task_cpu_ns(k) for k in kids), kids


def _clean_view(host: SimHost, pid: int) -> bool:
    try:
        view = json.loads((host.state_dir / "holders.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(view.get("clean") is True and view.get("daemon", {}).get("pid") == pid)


def measure(host: SimHost, minutes: float, warmup: float) -> dict[str, Any]:
    """CPU of a real daemon over ``minutes`` after ``warmup`` seconds (module docstring)."""
    config = host.config(interval="5s", log={"format": "json"})
    log = open(host.root / "quiet-daemon.log", "wb")  # noqa: SIM115 - closed below
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(config)],
        env=host.env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not _clean_view(host, daemon.pid):
            if time.monotonic() > deadline or daemon.poll() is not None:
                return {"error": "the daemon published no clean view"}
            time.sleep(0.1)
        time.sleep(warmup)
        cpu0, kids0 = _cpu_ns(daemon.pid)
        wall0 = time.monotonic()
        time.sleep(minutes * 60)
        cpu1, kids1 = _cpu_ns(daemon.pid)
        wall = time.monotonic() - wall0
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        log.close()
    cpu_s = (cpu1 - cpu0) / 1e9
    return {
        "seconds": wall,
        "warmup_s": warmup,
        "cpu_s": cpu_s,
        "core_percent": 100 * cpu_s / wall,
        "cpu_s_per_hour": cpu_s * 3600 / wall,
        "worker_restarted": kids0 != kids1,
    }


if __name__ == "__main__":  # pragma: no cover - a manual run: python -m bench.quiet ROOT MIN
    root = Path(sys.argv[1])
    with SimHost(root, gpus=8) as sim:
        print(json.dumps(measure(sim, float(sys.argv[2]), 10.0)))
