"""The lock between xdist workers over the real /proc (tests/support/proclock.py): a SimHost
command waits while another worker's ``proc_alone`` test runs, a daemon holds the lock until it
exits, and a ``proc_alone`` test waiting for a command holds new ones back, but not those of the
test whose daemon it waits for."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import proclock
from tests.support.simhost import REPO_ROOT, SimHost

# Another worker's proc_alone test: says "alone" once it holds the lock, lets go at a line.
OTHER_WORKER = """
import sys
from tests.support import proclock
with proclock.alone():
    print("alone", flush=True)
    sys.stdin.readline()
"""

# A third worker's SimHost command: says "shared" once it holds the lock.
THIRD_WORKER = """
from tests.support import proclock
with proclock.shared():
    print("shared", flush=True)
"""


@pytest.fixture
def lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "proc.lock"
    monkeypatch.setenv(proclock.ENV, str(path))
    return path


@pytest.fixture
def other_worker() -> Iterator[Callable[[], subprocess.Popen[str]]]:
    """Starts another worker's proc_alone test (killed at the end, so no command waits on)."""
    started: list[subprocess.Popen[str]] = []

    def start() -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        started.append(
            subprocess.Popen(
                [sys.executable, "-c", OTHER_WORKER],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def _held(path: Path) -> bool:
    """Whether anyone holds ``path`` locked (asked from an open file of its own)."""
    probe = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(probe)
    return False


def test_without_xdist_nothing_is_locked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(proclock.ENV, raising=False)
    with proclock.shared() as fd:
        assert fd is None


def _wait_held(path: Path, other: subprocess.Popen[str]) -> None:
    """Wait until ``other`` holds ``path`` (it lives meanwhile)."""
    deadline = time.monotonic() + 30
    while not _held(path):
        assert other.poll() is None
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _command(host: SimHost) -> tuple[threading.Thread, list[int]]:
    """``true`` run as a SimHost command in a thread; its exit code lands in the list."""
    done: list[int] = []
    thread = threading.Thread(
        target=lambda: done.append(host.run(["true"]).returncode), daemon=True
    )
    thread.start()
    return thread, done


def _let_go(other: subprocess.Popen[str]) -> None:
    assert other.stdout is not None
    assert other.stdin is not None
    assert other.stdout.readline() == "alone\n"
    other.stdin.write("\n")
    other.stdin.flush()
    assert other.wait(timeout=30) == 0


def test_a_command_waits_while_another_worker_runs_a_proc_alone_test(
    lock: Path, tmp_path: Path, other_worker: Callable[[], subprocess.Popen[str]]
) -> None:
    host = SimHost(tmp_path / "host")
    other = other_worker()
    _wait_held(lock, other)
    thread, done = _command(host)
    time.sleep(0.3)
    assert done == [], "a command ran beside a proc_alone test"
    _let_go(other)
    thread.join(timeout=30)
    assert done == [0]
    assert not _held(lock)


def test_a_daemon_holds_the_lock_until_it_exits_and_a_waiting_proc_alone_test_goes_first(
    lock: Path, tmp_path: Path, other_worker: Callable[[], subprocess.Popen[str]]
) -> None:
    host = SimHost(tmp_path / "host")
    daemon = host.popen(["sleep", "60"])
    try:
        assert _held(lock), "the daemon's lock outlives popen's return"
        other = other_worker()
        _wait_held(Path(f"{lock}.gate"), other)  # it waits for the daemon, holding the gate
        # A third worker's command queues behind it.
        third = subprocess.Popen(
            [sys.executable, "-c", THIRD_WORKER],
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.3)
        assert third.poll() is None, "a new command went before the waiting proc_alone test"
        # The daemon's own test is not held back: it would wait on its own daemon, and the
        # proc_alone test on that daemon, until both timed out.
        thread, done = _command(host)
        thread.join(timeout=30)
        assert done == [0], "a command of the test whose daemon holds the lock was held back"
        assert other.poll() is None
    finally:
        daemon.kill()
        daemon.wait()
    _let_go(other)
    assert third.communicate(timeout=30)[0] == "shared\n"
    assert not _held(lock)
