"""The real daemon on a quiet node: its CPU (and its NVML worker's) over minutes of wall time.

``bench/pollloop.py`` counts the CPU of ``poll_once`` on a virtual clock; this runs the real
``gpuwatchd run`` (shipped defaults: interval 5 s, backstop 10 min) on the benchmark's host,
waits until it has published a clean holder view and a warm-up has passed, then reads the
on-CPU nanoseconds of every thread of the daemon and of its children (the NVML worker) from
``/proc/PID/task/*/schedstat`` at the start and the end of the window, and the ticks of
``/proc/PID/stat`` (utime + stime) as a second reading. Everything the daemon does counts: the
polls, the wait between them, the state and view writes, the watchdog. ``tree`` runs another
checkout's daemon (its ``.venv``) on the same host: ``bench/quiet_ab.py`` alternates two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.pollloop import task_cpu_ns
from gpuwatchd.collect.procfs import ProcFS
from tests.support.simhost import SimHost


def _ticks(pid: int) -> int:
    """utime + stime of ``pid`` from ``/proc/PID/stat`` (clock ticks; 0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])


def _cpu_ns(pid: int) -> tuple[int, int, frozenset[int]]:
    """On-CPU ns and stat ticks of ``pid`` and its children, and which children those were."""
    kids = frozenset(ProcFS().children(pid))
    ns = task_cpu_ns(pid) + sum(task_cpu_ns(k) for k in kids)
    return ns, _ticks(pid) + sum(_ticks(k) for k in kids), kids


def _clean_view(host: SimHost, pid: int) -> bool:
    try:
        view = json.loads((host.state_dir / "holders.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(view.get("clean") is True and view.get("daemon", {}).get("pid") == pid)


def measure(
    host: SimHost, minutes: float, warmup: float, tree: Path | None = None
) -> dict[str, Any]:
    """CPU of a real daemon over ``minutes`` after ``warmup`` seconds (module docstring)."""
    config = host.config(interval="5s", log={"format": "json"})
    log = open(host.root / "quiet-daemon.log", "wb")  # noqa: SIM115 - closed below
    env, python = host.env(), sys.executable
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
        python = str(tree / ".venv" / "bin" / "python")
    daemon = subprocess.Popen(
        [python, "-m", "gpuwatchd", "run", "--config", str(config)],
        # `python -m` puts the working folder first on sys.path: the tree's, or another
        # checkout's package would be the one measured.
        cwd=None if tree is None else str(tree),
        env=env,
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
        cpu0, ticks0, kids0 = _cpu_ns(daemon.pid)
        wall0 = time.monotonic()
        time.sleep(minutes * 60)
        cpu1, ticks1, kids1 = _cpu_ns(daemon.pid)
        wall = time.monotonic() - wall0
        load = os.getloadavg()
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
        "stat_core_percent": 100 * (ticks1 - ticks0) / os.sysconf("SC_CLK_TCK") / wall,
        "loadavg": load,
        "worker_restarted": kids0 != kids1,
    }


if __name__ == "__main__":  # pragma: no cover - a manual run: python -m bench.quiet ROOT MIN
    root = Path(sys.argv[1])
    with SimHost(root, gpus=8) as sim:
        print(json.dumps(measure(sim, float(sys.argv[2]), 10.0)))
