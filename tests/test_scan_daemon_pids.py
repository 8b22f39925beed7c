"""A one-shot scan counts a running daemon's NVML worker as the daemon's, and nothing else.

``running_daemon_pids`` (gpuwatchd/cli/scan.py) is what keeps ``check-clean`` from calling every
GPU dirty beside a daemon that runs outside its systemd unit. Real processes, all this test's
own children: a stand-in daemon (a program named ``gpuwatchd``) with one child whose command
line names the NVML worker file and one that does not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.cli.scan import procfs_for, running_daemon_pids
from gpuwatchd.collect.nvml import WORKER_FILE
from gpuwatchd.decide.policy import Policy

DAEMON = """\
import subprocess, sys, time
sleep = "import time; time.sleep(60)"
worker = subprocess.Popen([sys.executable, "-c", sleep, sys.argv[1]])
other = subprocess.Popen([sys.executable, "-c", sleep, "something-else.py"])
print(worker.pid, other.pid, flush=True)
time.sleep(60)
"""


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[int, int, int]]:
    """(daemon pid, worker pid, other child pid) of a stand-in daemon."""
    script = tmp_path / "gpuwatchd"
    script.write_text(f"#!{sys.executable}\n{DAEMON}")
    script.chmod(0o755)
    proc = subprocess.Popen(
        [str(script), WORKER_FILE], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    worker, other = (int(x) for x in proc.stdout.readline().split())
    try:
        yield proc.pid, worker, other
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(0.05)


def test_the_daemon_and_its_worker_are_recognised(daemon: tuple[int, int, int]) -> None:
    pid, worker, other = daemon
    policy = Policy()
    found = running_daemon_pids(policy, {"status": {"pid": pid}}, procfs_for(policy))
    assert found == frozenset({pid, worker})
    assert other not in found


def test_a_pid_that_is_not_gpuwatchd_hides_nothing(daemon: tuple[int, int, int]) -> None:
    _pid, worker, other = daemon
    policy = Policy()
    procfs = procfs_for(policy)
    # A reused PID: the state names a process that is not gpuwatchd.
    assert running_daemon_pids(policy, {"status": {"pid": other}}, procfs) == frozenset()
    assert running_daemon_pids(policy, {"status": {"pid": worker}}, procfs) == frozenset()
    assert running_daemon_pids(policy, {}, procfs) == frozenset()
    assert running_daemon_pids(policy, {"status": {"pid": "7"}}, procfs) == frozenset()
