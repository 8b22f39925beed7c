"""Remediation latency of the real ``gpuwatchd run`` daemon, from its JSON log timestamps.

Owns the latency scenarios. It must run as PID 1 of a PID namespace (``bench/run.py`` sees to
that): the orphaned worker is re-parented to this process, and the daemon can only see and
signal this namespace's processes. Each trial starts a fresh daemon on a simulated host, lets it
settle, then kills the trainer (its own child) so the worker becomes an orphan, and measures:

- *acted*: orphan born (trainer's pidfd readable) → the daemon's first ``action.signal``;
  the target is the rule's ``for`` window plus one interval;
- *gone*: the worker's exit (its pidfd readable here) → the daemon's ``target.exited``;
- *kill slack*: ``SIGTERM`` → ``SIGKILL`` minus the step's configured wait, for a worker that
  ignores SIGTERM.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from gpuwatchd.core.vocabulary import EventName
from tests.support.daemonrun import Run
from tests.support.fakenvml import MiB, gpu, process
from tests.support.simhost import SimHost


def _exit_time(pid: int, box: dict[str, float]) -> threading.Thread:
    """A thread that records ``time.time()`` when ``pid`` exits (its pidfd turns readable)."""
    pidfd = os.pidfd_open(pid)

    def watch() -> None:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            while not poller.poll(100):
                if box.get("stop"):
                    return
            box["exited"] = time.time()
        finally:
            os.close(pidfd)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def trial(root: Path, cfg: dict[str, Any], *, ignore_term: bool) -> dict[str, Any]:
    interval, window, wait = cfg["latency_interval"], cfg["latency_for"], cfg["latency_wait"]
    with SimHost(root) as host:
        worker_steps: list[dict[str, Any]] = [{"ignore": "SIGTERM"}] if ignore_term else []
        worker_steps.append({"sleep": 3600})
        worker = host.script("worker", worker_steps)
        host.spawn(
            "trainer", [{"setsid": True}, {"open": host.cuda(0)}, {"fork": worker}, {"sleep": 3600}]
        )
        pids = host.wait_ready("trainer", "worker")
        host.nvml([gpu(0, allocated=700 * MiB, processes=[process(pids["trainer"], 700 * MiB)])])
        rule = {
            "name": "orphans",
            "kind": "orphaned",
            "for": f"{window}s",
            "steps": [
                {"signal": "SIGTERM", "wait": f"{wait}s"},
                {"signal": "SIGKILL", "wait": "2s"},
            ],
        }
        run = Run(host, interval=f"{interval}s", rules=[rule])
        run.start()
        run.wait_for(lambda: run.saw(EventName.DAEMON_START), timeout=30)
        time.sleep(2 * interval + 0.2)  # a few quiet polls: the trainer is alive and listed
        trainer_box: dict[str, float] = {}
        worker_box: dict[str, float] = {}
        worker_thread = _exit_time(pids["worker"], worker_box)
        trainer_thread = _exit_time(pids["trainer"], trainer_box)
        os.kill(pids["trainer"], signal.SIGKILL)  # our own child: the job dies
        trainer_thread.join(timeout=5)
        run.wait_for(lambda: run.saw(EventName.TARGET_EXITED, pid=pids["worker"]), timeout=30)
        worker_thread.join(timeout=5)
        worker_box["stop"] = 1.0
        run.stop()
        events = run.events()
    signals = [
        e
        for e in events
        if e.get("event") == EventName.ACTION_SIGNAL and e.get("pid") == pids["worker"]
    ]
    exited = [
        e
        for e in events
        if e.get("event") == EventName.TARGET_EXITED and e.get("pid") == pids["worker"]
    ]
    result: dict[str, Any] = {
        "ignore_term": ignore_term,
        "signals": [e.get("signal") for e in signals],
    }
    orphan_at = trainer_box.get("exited")
    if signals and orphan_at is not None:
        acted = (_stamp(signals[0]) - orphan_at) * 1e3
        result["acted_ms"] = acted
        result["acted_slack_ms"] = acted - (window + interval) * 1e3
    if exited and "exited" in worker_box:
        result["gone_ms"] = (_stamp(exited[0]) - worker_box["exited"]) * 1e3
    if ignore_term and len(signals) >= 2:
        result["kill_slack_ms"] = (_stamp(signals[1]) - _stamp(signals[0]) - wait) * 1e3
    return result


def run(root: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Trials of both kinds; the worst figure of each is what the targets are held against."""
    trials = []
    for index in range(cfg["latency_trials"]):
        for ignore_term in (False, True):
            trials.append(
                trial(root / f"trial-{index}-{int(ignore_term)}", cfg, ignore_term=ignore_term)
            )
    summary: dict[str, Any] = {
        "interval_s": cfg["latency_interval"],
        "for_s": cfg["latency_for"],
        "wait_s": cfg["latency_wait"],
        "trials": trials,
    }
    for key in ("gone_ms", "kill_slack_ms", "acted_ms", "acted_slack_ms"):
        values = [t[key] for t in trials if key in t]
        summary[f"{key}_max"] = max(values) if values else None
        summary[f"{key}_median"] = sorted(values)[len(values) // 2] if values else None
    return summary
