"""One lock between the pytest-xdist workers of a run over the machine's real ``/proc``.

A :class:`~tests.support.simhost.SimHost` command or daemon run outside a PID namespace of its
own walks the whole ``/proc`` of the test machine, so it also sees the processes a test on the
other worker is running. A few tests make shapes that any full walk must report: a process
with more threads' own fd tables than a scan reads is unreadable, which makes every GPU
``unknown`` (correct: the daemon reports and does not act), and hundreds of private tables
being built or torn down slow the walk and race it. The result of a SimHost test must not
depend on what runs beside it, so:

- a test that makes such processes asks for the ``proc_alone`` fixture: it holds the lock
  exclusively from before its first process until after its last;
- every SimHost command and daemon holds it shared while it runs (:func:`shared`).

A test inside a PID namespace of its own (``run_in_pid_namespace``) sees only its own
processes: that helper leaves the lock's path out of the environment it passes in, and
:func:`shared` does nothing there. Without xdist, one process runs one test at a time and
nothing is locked. The lock file lives in the run's base temporary folder, shared by its
workers. Writers come first: a waiting ``proc_alone`` test holds a gate that new shared
holders wait at, so a stream of short commands on the other worker cannot starve it; a process
whose daemon holds the lock already passes the gate (it would otherwise wait on itself).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import time
from collections.abc import Iterator
from typing import ClassVar

import pytest

ENV = "GPUWATCHD_TESTS_PROC_LOCK"  # the lock file's path in this run, set in each xdist worker
WAIT = 600.0  # seconds before a test gives up waiting for the lock (something never let go)


class _Here:
    alone = False  # this process holds the lock exclusively: its own commands need not wait
    # Children started holding the lock shared (daemons): while one lives, this process holds
    # the lock already, and a new holder here skips the gate. Were it to queue behind a waiting
    # proc_alone test, that test would wait for the daemon and the daemon's test for the
    # command: neither would move until the wait timed out.
    children: ClassVar[list[subprocess.Popen[str]]] = []


def note_child(child: subprocess.Popen[str]) -> None:
    """``child`` was given the lock's fd by :func:`shared` and holds the lock until it exits."""
    _Here.children.append(child)


def _holding() -> bool:
    """Whether a child of this process still holds the lock shared."""
    _Here.children = [child for child in _Here.children if child.poll() is None]
    return bool(_Here.children)


def _lock(path: str, mode: int, what: str) -> int:
    """An fd of ``path`` with ``mode`` (LOCK_SH or LOCK_EX) held on it; waits up to WAIT."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + WAIT
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                pytest.fail(f"{what}: {path} still locked by another worker after {WAIT:.0f} s")
            time.sleep(0.02)


@contextlib.contextmanager
def shared() -> Iterator[int | None]:
    """Hold the lock shared while the body runs (no ``proc_alone`` test runs meanwhile).

    Yields the locked fd, to pass to a child that outlives the body (``pass_fds``): the lock
    belongs to the open file, so the child keeps holding it until it exits. None where no
    lock is needed (no xdist, inside a PID namespace of its own, or in the ``proc_alone``
    test's own process)."""
    path = os.environ.get(ENV)
    if not path or _Here.alone:
        yield None
        return
    gate = None if _holding() else _lock(f"{path}.gate", fcntl.LOCK_SH, "shared /proc")
    try:
        fd = _lock(path, fcntl.LOCK_SH, "shared /proc")
    finally:
        if gate is not None:
            os.close(gate)
    try:
        yield fd
    finally:
        os.close(fd)  # never LOCK_UN: a child given this fd still holds the lock


@pytest.fixture(scope="session", autouse=True)
def _proc_lock_path(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Under xdist, name the lock file in the run's base folder (each worker's is below it)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[ENV] = str(tmp_path_factory.getbasetemp().parent / "proc.lock")


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Hold the lock exclusively while the body runs: waits for the shared holders of now and
    holds back new ones (the gate first, so that they queue behind this wait)."""
    path = os.environ.get(ENV)
    if not path:
        yield
        return
    gate = _lock(f"{path}.gate", fcntl.LOCK_EX, "proc_alone")
    try:
        fd = _lock(path, fcntl.LOCK_EX, "proc_alone")
    except BaseException:
        os.close(gate)
        raise
    _Here.alone = True
    try:
        yield
    finally:
        _Here.alone = False
        os.close(fd)
        os.close(gate)


@pytest.fixture
def proc_alone() -> Iterator[None]:
    """For a test whose processes another worker's walk of /proc must not see: no SimHost
    command runs outside a PID namespace of its own meanwhile (see the module)."""
    with alone():
        yield
