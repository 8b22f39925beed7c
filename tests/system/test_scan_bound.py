"""End to end: one user's threads cannot make the holder scan outlast systemd's watchdog
(issue 34, finding 10).

The attack: a process with thousands of threads that each called ``unshare(CLONE_FILES)`` (a
file descriptor table of its own), and a holder that opens ``nvidiactl`` every 2 s so every
poll walks all of ``/proc``. Before, each walk compared every thread's table with every table
read before it (N²/2 kcmp calls: 32 s at 4,000 threads), and the gap between watchdog pings
passed ``WatchdogSec=30s``. The real daemon runs here with ``NOTIFY_SOCKET`` pointing at the
test's own datagram socket, so the pings and the end of each poll (its ``STATUS=`` line) are
timed as systemd would see them.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support.children import private_tables
from tests.support.daemonrun import Run
from tests.support.fakenvml import GiB, gpu
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)

# The flood is visible to every walk of the machine's /proc (past the budget: an unreadable
# process, so every GPU unknown): no SimHost command on another worker runs meanwhile.
pytestmark = [needs_pid_namespace(), pytest.mark.slow, pytest.mark.usefixtures("proc_alone")]

WATCHDOG_USEC = 30_000_000  # the unit's WatchdogSec=30s

OPENER = """
import os, sys, time
while True:
    os.close(os.open(sys.argv[1], os.O_RDONLY))
    time.sleep(2)
"""


class _NotifyListener:
    """The test's NOTIFY_SOCKET: the monotonic time of each WATCHDOG=1 and STATUS= datagram."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.pings: list[float] = []
        self.polls: list[float] = []
        self.stop = False
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while not self.stop:
            try:
                data = self.sock.recv(65536).decode(errors="replace")
            except TimeoutError:
                continue
            now = time.monotonic()
            if "WATCHDOG=1" in data.splitlines():
                self.pings.append(now)
            if any(line.startswith("STATUS=") for line in data.splitlines()):
                self.polls.append(now)

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.sock.close()


def host_thread_flood(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        host.nvml([gpu(0, allocated=2 * GiB)])  # memory no listed process owns
        flood = host.root / "flood.py"
        flood.write_text(private_tables(arg["threads"], host.dev("nvidia0")[0], fds=arg["fds"]))
        child = _start(host, [sys.executable, str(flood)])
        _wait_ready(child, arg["threads"])
        _start(host, [sys.executable, "-c", OPENER, host.dev("nvidiactl")[0]])
        listener = _NotifyListener(host.root / "notify.sock")
        run = Run(host, interval="1s")
        started = time.monotonic()
        run.start(
            env={
                "NOTIFY_SOCKET": str(host.root / "notify.sock"),
                "WATCHDOG_USEC": str(WATCHDOG_USEC),
            }
        )
        run.wait_for(lambda: len(listener.polls) >= arg["polls"], timeout=arg["within"])
        run.stop()
        listener.close()
        marks = [started, *listener.pings]
        return {
            "flood": child.pid,
            "events": sorted({str(e.get("event")) for e in run.events()}),
            "polls": len(listener.polls),
            "poll_gaps": [b - a for a, b in itertools.pairwise(listener.polls)],
            "max_ping_gap": max(b - a for a, b in itertools.pairwise(marks))
            if listener.pings
            else None,
            "new": [
                (e.get("kind"), e.get("pid"))
                for e in run.events()
                if e.get("event") == EventName.FINDING_NEW
            ],
            "unread": [
                e.get("pid")
                for e in run.events()
                if e.get("event") == EventName.COLLECT_THREAD_TABLES_UNREAD
            ],
        }


def _start(host: SimHost, argv: list[str]) -> Any:
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    host.children.append(child.pid)
    return child


def _wait_ready(child: Any, threads: int) -> None:
    line = child.stdout.readline()
    assert line.strip() == "ready", line
    assert len(os.listdir(f"/proc/{child.pid}/task")) > threads


def test_four_thousand_private_tables_keep_every_poll_inside_the_watchdog(tmp_path: Path) -> None:
    """4,000 threads with tables of their own, one of them holding GPU 0, and nvidiactl
    opened every 2 s: every poll walks all of /proc, reads each table once, finds the
    hidden holder, and ends far inside the watchdog; no ping gap nears WatchdogSec."""
    result = run_in_pid_namespace(
        f"{__name__}:host_thread_flood",
        {"threads": 4000, "fds": 0, "polls": 8, "within": 120},
        root=tmp_path,
        timeout=240,
    )
    assert result["polls"] >= 8, result
    assert ["hidden_holder", result["flood"]] in [list(n) for n in result["new"]], result
    assert result["unread"] == []  # every table read: the budget is not reached
    assert result["max_ping_gap"] is not None
    assert result["max_ping_gap"] < WATCHDOG_USEC / 1e6 / 3, result
    assert max(result["poll_gaps"]) < 10, result


def test_a_process_past_the_thread_table_budget_is_said_once_and_blocks_without_a_finding(
    tmp_path: Path,
) -> None:
    """1,200 private tables of 70 descriptors each pass the per-process budget (65,536): the
    scan stops reading them, says so once (``collect.thread_tables_unread``), and the process
    is an unknown holder (no finding names it: it is never a target); polls stay short."""
    result = run_in_pid_namespace(
        f"{__name__}:host_thread_flood",
        {"threads": 1200, "fds": 64, "polls": 6, "within": 90},
        root=tmp_path,
        timeout=200,
    )
    assert result["polls"] >= 6, result
    assert result["unread"] == [result["flood"]], result
    assert result["flood"] not in [pid for _, pid in result["new"]]
    assert max(result["poll_gaps"]) < 10, result
