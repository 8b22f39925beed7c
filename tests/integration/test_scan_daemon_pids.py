"""A one-shot scan counts a running daemon's NVML worker as the daemon's, and nothing else.

``running_daemon`` (gpuwatchd/cli/scan.py) is what keeps ``check-clean`` from calling every
GPU dirty beside a daemon that runs outside its systemd unit. Who the daemon is comes from the
kernel — the process holding the instance lock in ``state_dir`` — never from a PID written in
``state.json`` or ``holders.json``. Real processes, all this test's own children: a stand-in
daemon (a program named ``gpuwatchd``) that takes the lock, with one child whose command line
names the NVML worker file and one that does not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.cli.scan import running_daemon
from gpuwatchd.collect.nvml import WORKER_FILE
from gpuwatchd.core.model import HolderScan
from gpuwatchd.daemon.host import procfs_for
from gpuwatchd.decide.policy import Policy
from gpuwatchd.served import holders as holder_view
from gpuwatchd.state.directory import StateDir

DAEMON = """\
import fcntl, os, subprocess, sys, time
sleep = "import time; time.sleep(60)"
if sys.argv[2] != "-":
    lock = os.open(os.path.join(sys.argv[2], "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
worker = subprocess.Popen([sys.executable, "-c", sleep, sys.argv[1]])
other = subprocess.Popen([sys.executable, "-c", sleep, "something-else.py"])
print(worker.pid, other.pid, flush=True)
time.sleep(60)
"""


def _start(tmp_path: Path, state_dir: str) -> tuple[subprocess.Popen[str], int, int]:
    script = tmp_path / "gpuwatchd"
    script.write_text(f"#!{sys.executable}\n{DAEMON}")
    script.chmod(0o755)
    proc = subprocess.Popen(
        [str(script), WORKER_FILE, state_dir],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    worker, other = (int(x) for x in proc.stdout.readline().split())
    return proc, worker, other


def _stop(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.05)


@pytest.fixture
def state(tmp_path: Path) -> Iterator[StateDir]:
    with StateDir.open(str(tmp_path / "state"), create=True) as directory:
        yield directory


@pytest.fixture
def daemon(tmp_path: Path, state: StateDir) -> Iterator[tuple[int, int, int]]:
    """(daemon pid, worker pid, other child pid) of a stand-in daemon holding the lock."""
    proc, worker, other = _start(tmp_path, state.path)
    try:
        yield proc.pid, worker, other
    finally:
        _stop(proc)


def test_the_lock_holder_and_its_worker_are_recognised(
    daemon: tuple[int, int, int], state: StateDir
) -> None:
    pid, worker, other = daemon
    policy = Policy()
    deadline = time.monotonic() + 10
    while state.lock_holder() is None:  # the stand-in takes the lock right after it starts
        assert time.monotonic() < deadline
        time.sleep(0.01)
    found = running_daemon(state, procfs_for(policy))
    assert found is not None
    assert (found.pid, found.workers) == (pid, frozenset({worker}))
    assert other not in found.pids


def _fake_proc_locks(tmp_path: Path, state: StateDir, pid: int, before: list[str]) -> str:
    """A proc root where ``pid`` holds ``state``'s lock through its fd 3, listed in
    /proc/locks after the lines ``before`` (the kernel lists newer locks first)."""
    root = tmp_path / "proc"
    (root / str(pid) / "fdinfo").mkdir(parents=True)
    (root / str(pid) / "fd").mkdir()
    lock = Path(state.path) / "lock"
    (root / str(pid) / "fd" / "3").symlink_to(lock)
    ours = f"FLOCK  ADVISORY  WRITE {pid} 00:2a:{lock.stat().st_ino} 0 EOF"
    (root / str(pid) / "fdinfo" / "3").write_text(f"pos:\t0\nflags:\t02\nlock:\t1: {ours}\n")
    (root / "locks").write_text("".join(f"{line}\n" for line in [*before, f"99999: {ours}"]))
    return str(root)


def test_the_lock_holder_is_found_behind_any_number_of_other_locks(
    tmp_path: Path, state: StateDir
) -> None:
    """Only the first MiB of /proc/locks was read: ~20,000 flocks any user takes on files of
    their own, newer than the daemon's, hid it (reload: no daemon; scan: its NVML worker a
    stranger). Read whole, a line at a time; a line too long is cut, not a reason to stop."""
    lock = Path(state.path) / "lock"
    lock.write_text("4242\n")
    others = [f"{n}: FLOCK  ADVISORY  WRITE {200000 + n % 50} 00:2a:{7000000 + n} 0 EOF"
              for n in range(1, 22_001)]  # fmt: skip
    others.insert(5, "x" * 100_000)  # one line longer than any the kernel writes
    # a candidate on the same inode that holds no descriptor of it: looked past
    others.append(f"22001: FLOCK  ADVISORY  WRITE 4343 00:2a:{lock.stat().st_ino} 0 EOF")
    root = _fake_proc_locks(tmp_path, state, 4242, others)
    assert os.path.getsize(os.path.join(root, "locks")) > 1 << 20  # past the MiB once read
    assert state.lock_holder(root) == 4242
    assert state.lock_holder(_fake_proc_locks(tmp_path / "few", state, 4242, others[:3])) == 4242


def test_a_gpuwatchd_that_holds_no_lock_hides_nothing(tmp_path: Path, state: StateDir) -> None:
    """What state.json says about the daemon's PID is not taken for it: without the lock, a
    process named gpuwatchd (anyone may name one so) is an ordinary process."""
    proc, _worker, _other = _start(tmp_path, "-")
    try:
        state.write("state.json", json.dumps({"status": {"pid": proc.pid}}).encode())
        assert state.lock_holder() is None
        policy = Policy()
        assert running_daemon(state, procfs_for(policy)) is None
        assert running_daemon(None, procfs_for(policy)) is None
    finally:
        _stop(proc)


def _forged_view(daemon_pid: int, workers: list[int], policy: Policy) -> bytes:
    procfs = procfs_for(policy)
    fields = procfs.read_stat(daemon_pid)
    assert fields is not None
    boot_id = procfs.boot_id()
    assert boot_id is not None
    view = holder_view.HolderView.of(
        boot_id=boot_id,
        daemon_pid=daemon_pid,
        daemon_start_ticks=fields.starttime,
        worker_pids=frozenset(workers),
        polled=time.time(),
        fresh_for=60.0,
        settings=(policy.proc_root, policy.devices_dir, policy.device_major),
        holders=HolderScan("full"),
        start_ticks={},
        dead_listed=frozenset(),
    )
    return json.dumps(view.document()).encode()


def test_a_holder_view_naming_another_process_as_the_daemon_hides_nothing(
    tmp_path: Path, state: StateDir, daemon: tuple[int, int, int]
) -> None:
    """holders.json could name any process (a GPU holder) as "the daemon" or its worker: the
    PIDs it names are never taken for the daemon's (a scan reads no holders.json at all)."""
    pid, worker, other = daemon
    policy = Policy()
    procfs = procfs_for(policy)
    deadline = time.monotonic() + 10
    while state.lock_holder() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for forged in (
        _forged_view(other, [worker], policy),
        _forged_view(pid, [worker, other], policy),
    ):
        state.write(holder_view.VIEW_FILE, forged)
        running = running_daemon(state, procfs)
        assert running is not None
        assert (running.pid, running.workers) == (pid, frozenset({worker}))
        assert other not in running.pids
