"""Kept ``/proc/PID/stat`` and ``children`` descriptors answer as a fresh open would
(collect/statfiles.py).

Real processes, this test's own children: a live one reads as ``ProcFS.read_stat`` reads it,
its state changes show through the kept descriptor, a zombie reads ``Z``, a reaped one reads as
gone and its descriptor is dropped, and the single-thread ``children`` shortcut lists what
``ProcFS.children`` lists — and is not taken for a process with more threads. A ``proc_root``
that is a plain folder keeps nothing.
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

from gpuwatchd.collect import statfiles
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.collect.statfiles import StatFiles
from tests.support.children import Spawn


@pytest.fixture
def files() -> Iterator[StatFiles]:
    reader = StatFiles("/proc")
    assert reader.keeping
    yield reader
    reader.retain(())  # every descriptor closed


def _wait_state(pid: int, state: str) -> None:
    deadline = time.monotonic() + 10
    while getattr(ProcFS().read_stat(pid), "state", None) != state:
        assert time.monotonic() < deadline, f"pid {pid} never reached {state}"
        time.sleep(0.01)


def test_a_kept_descriptor_reads_what_a_fresh_open_reads_until_the_process_is_reaped(
    files: StatFiles,
) -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        _wait_state(child.pid, "S")
        first = files.read(child.pid)
        assert first is not None
        assert first == ProcFS().read_stat(child.pid)
        assert len(files) == 1
        assert files.read(child.pid) is first  # the same bytes: the same answer
        child.send_signal(signal.SIGSTOP)
        _wait_state(child.pid, "T")
        stopped = files.read(child.pid)
        assert stopped is not None
        assert stopped.state == "T"  # read anew through the kept descriptor
        child.send_signal(signal.SIGCONT)
        child.kill()
        _wait_state(child.pid, "Z")
        zombie = files.read(child.pid)
        assert zombie is not None
        assert zombie.state == "Z"
        assert zombie.starttime == first.starttime
    finally:
        child.kill()
        child.wait()
    assert files.read(child.pid) is None  # reaped: gone, as a fresh open says
    assert len(files) == 0


def test_children_of_a_single_threaded_process_match_the_task_listing(files: StatFiles) -> None:
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(ProcFS().children(parent.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert files.children(parent.pid) is None  # not read this poll: not known
        fields = files.read(parent.pid)
        assert fields is not None
        assert fields.num_threads == 1
        assert files.children(parent.pid) == ProcFS().children(parent.pid)
        assert ProcFS().descendants([parent.pid], files.children) == set(
            ProcFS().descendants([parent.pid])
        )
        files.retain([])  # the next poll: counts forgotten, descriptors of others closed
        assert files.children(parent.pid) is None
        assert len(files) == 0
    finally:
        for kid in ProcFS().children(parent.pid):
            os.kill(kid, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_a_process_with_more_threads_is_listed_the_usual_way(files: StatFiles) -> None:
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\n"
    child = subprocess.Popen([sys.executable, "-c", code + "time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while getattr(files.read(child.pid), "num_threads", 1) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert files.children(child.pid) is None
    finally:
        child.kill()
        child.wait()


def test_the_number_of_kept_descriptors_is_bounded(
    files: StatFiles, spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(statfiles, "MAX_OPEN", 1)
    # A second process whose fields stand still between two reads: a child of ours, asleep
    # (under pytest-xdist our parent is the controller, running and sleeping by turns).
    other = spawn("import time\nprint('ready', flush=True)\ntime.sleep(60)\n").pid
    deadline = time.monotonic() + 10
    while (now := ProcFS().read_stat(other)) is None or now.state != "S":
        assert time.monotonic() < deadline, now
        time.sleep(0.01)
    assert files.read(os.getpid()) is not None
    assert files.read(other) == ProcFS().read_stat(other)
    assert len(files) == 1


def test_a_plain_folder_as_proc_root_keeps_nothing(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    stat = tmp_path / "42" / "stat"
    stat.write_text("42 (x) S 1 42 42 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 777 0 0\n")
    reader = StatFiles(str(tmp_path))
    assert not reader.keeping
    first = reader.read(42)
    assert first is not None
    assert first.starttime == 777
    assert len(reader) == 0
    stat.write_text("42 (x) S 1 42 42 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 888 0 0\n")
    second = reader.read(42)
    assert second is not None
    assert second.starttime == 888
