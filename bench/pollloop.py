"""Child process: the real daemon's poll (collect, assess, plan, act, persist) in a tight loop.

Run as ``python bench/pollloop.py SPEC_JSON``. Builds a real
:class:`gpuwatchd.daemon.lifecycle.Daemon` from a policy file and calls :meth:`Daemon.poll_once`
back to back, with a virtual monotonic
clock that advances ``virtual_interval`` seconds per poll, so the daemon's own cadence (a full
holder scan every 60 s, ``for`` windows) plays out as at that interval without the sleeps.

Per poll it records the CPU time of this process (``time.process_time``, all threads) and of
the NVML worker (``/proc/PID/task/*/schedstat``, nanoseconds on CPU), and whether the holder
scan was full; every ``rss_every`` polls the RSS of both. It writes one JSON object to
``out``. It measures; it never signals anything. With ``profile`` set to a path, the polls after
the first run under ``cProfile`` (process-time clock) and its stats are dumped there.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatchd.config.schema import load_policy
from gpuwatchd.daemon.lifecycle import Daemon
from gpuwatchd.events.logs import configure_logging


def task_cpu_ns(pid: int) -> int:
    """Nanoseconds on CPU of every thread of ``pid`` (0 when it is gone)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as handle:
                total += int(handle.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class VirtualClock:
    """A monotonic clock the loop advances by hand."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def main(spec: dict[str, Any]) -> dict[str, Any]:
    configure_logging(fmt="json", level="warning", stream=io.StringIO())
    policy = load_policy(spec["config"], check_permissions=False)
    clock = VirtualClock()
    daemon = Daemon(policy, config_path=spec["config"], clock=clock)
    if spec.get("device_watch", True):
        daemon._start_device_watch()  # as `run` does: walks on cause, backstop sweep
    polls: int = spec["polls"]
    step: float = spec["virtual_interval"]
    rss_every: int = spec.get("rss_every", 0)
    # Open (and close) a device file every this many polls, as a job starting would: the
    # device watch sees it and the daemon walks /proc at its next poll.
    open_every: int = spec.get("open_every", 0)
    opened = os.path.join(policy.devices_dir, "nvidia0")
    profiler = cProfile.Profile(time.process_time) if spec.get("profile") else None
    daemon_ns: list[int] = []
    worker_ns: list[int] = []
    full: list[bool] = []
    rss: list[dict[str, int]] = []
    wall_started = time.perf_counter()
    try:
        for index in range(polls):
            workers = sorted(daemon.nvml.worker_pids)
            w0 = sum(task_cpu_ns(p) for p in workers)
            if open_every and index and index % open_every == 0:
                os.close(os.open(opened, os.O_RDONLY))
            if profiler is not None and index == 1:
                profiler.enable()
            t0 = time.process_time_ns()
            report = daemon.poll_once()
            t1 = time.process_time_ns()
            workers_after = sorted(daemon.nvml.worker_pids)
            w1 = sum(task_cpu_ns(p) for p in workers_after)
            daemon_ns.append(t1 - t0)
            # A worker started during this poll counts from zero.
            worker_ns.append(max(0, w1 - w0) if workers == workers_after else w1)
            full.append(report.snapshot.holders.mode == "full")
            if rss_every and (index + 1) % rss_every == 0:
                rss.append(
                    {
                        "poll": index + 1,
                        "daemon_kib": rss_kib(os.getpid()),
                        "worker_kib": sum(rss_kib(p) for p in workers_after),
                    }
                )
            clock.now += step
        findings = len(daemon.report.assessment.findings) if daemon.report else None
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(spec["profile"])
    finally:
        daemon.signaller.close()
        daemon.nvml.stop()
        daemon.device_watch.close()
    return {
        "polls": polls,
        "virtual_interval": step,
        "wall_s": time.perf_counter() - wall_started,
        "daemon_ns": daemon_ns,
        "worker_ns": worker_ns,
        "full": full,
        "rss": rss,
        "findings_last_poll": findings,
    }


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    result = main(spec)
    with open(spec["out"], "w", encoding="utf-8") as out:
        json.dump(result, out)
