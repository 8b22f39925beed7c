"""The full holder walk's shortcuts cannot lose a holder (issue 16, the walk).

Three shortcuts make the walk cheaper than reading every fd and mapping in full, and each is
pinned here against the shapes where it could go wrong:

- **The prefilter** (``DeviceFiles.may_hold``): a process's fd targets are searched as one
  joined text for the marker the exact test needs, and the per-fd matching runs only on a
  hit. Why it cannot miss: the exact tests themselves look only at targets that contain that
  marker (path mode: the device folder's prefix; device-number mode: ``/dev/`` or
  ``nvidia``), and a target that contains a marker still contains it after joining with a
  separator no marker holds. Mappings are not behind this prefilter at all: ``maps`` is read
  for every process, so a mapping whose fd was closed is still found.
- **Kernel threads** are skipped without reading their files: only children of kthreadd with
  no ``exe`` link and PF_KTHREAD set.
- **Forked workers**: the per-process work spread over processes gives the same holdings, in
  the same order, as one process.

Each shape runs with the walk in one process and with it forced over forked workers.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.collect import spread
from gpuwatchd.collect.holders import DeviceFiles, HolderScanner
from gpuwatchd.collect.procfs import ProcFS
from tests.support.children import HOLD_FD, SYS_EXIT, Spawn, hold, map_only, zombie_leader
from tests.support.fakeproc import FakeProc


def full_scanner(workers: int, **settings: Any) -> HolderScanner:
    procfs = ProcFS("/proc")
    scanner = HolderScanner(procfs, DeviceFiles(procfs, **settings), workers=workers)
    scanner.min_slice = 1  # fork even for a handful of processes
    return scanner


# --- the prefilter, exactly -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("targets", "by_path", "expected"),
    [
        (["/tmp/x", "pipe:[1]", "socket:[2]"], True, False),
        (["/tmp/x", "{dev}/nvidiactl"], True, True),
        (["{dev}/nvidia-uvm"], True, True),
        (["anon_inode:[eventfd]", "/dev/pts/0"], False, True),  # a /dev path: stat decides
        (["/usr/lib/x.so", "pipe:[3]"], False, False),
        (["/nvidia0"], False, True),  # a container's odd name: stat decides
        (["/de", "v/nvidia0"], False, True),  # "nvidia" alone is a marker
        ([], False, False),
    ],
)
def test_prefilter_passes_every_target_an_exact_test_could_accept(
    devices: Path, targets: list[str], by_path: bool, expected: bool
) -> None:
    scanner = ProcFS(devices_dir=str(devices), match_by_path=by_path).holders
    prefix = scanner.devices.prefix.rstrip("/")
    assert scanner.devices.may_hold([t.format(dev=prefix) for t in targets]) is expected


def test_prefilter_never_rejects_a_target_the_exact_tests_look_at(devices: Path) -> None:
    """The exhaustive form of the argument: any target holding a marker passes, wherever it
    sits among any other targets."""
    fillers = ["/tmp/a", "pipe:[1]", "socket:[9]", "", "anon_inode:bpf", "/de", "v/"]
    for by_path in (True, False):
        scanner = ProcFS(devices_dir=str(devices), match_by_path=by_path).holders
        hits = (
            [scanner.devices.prefix + "nvidia0"]
            if by_path
            else ["/dev/nvidia0", "/dev/zero", "/x/nvidia", "/dev/"]
        )
        for hit in hits:
            for at in range(len(fillers) + 1):
                assert scanner.devices.may_hold([*fillers[:at], hit, *fillers[at:]])


# --- the shapes, on real children -------------------------------------------------------------

HIGH_FD = """
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
fd = os.open({path!r}, os.O_RDONLY)
os.dup2(fd, 3000)
os.close(fd)
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_a_mapping_without_an_fd_is_found(spawn: Spawn, devices: Path, workers: int) -> None:
    child = spawn(map_only(str(devices / "nvidia1")))
    holding = full_scanner(workers, devices_dir=str(devices)).scan().holdings[child.pid]
    assert holding.gpu_minors_map == {1}
    assert holding.gpu_minors_fd == frozenset()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_process_holding_only_nvidiactl_is_found(
    spawn: Spawn, devices: Path, workers: int
) -> None:
    child = spawn(hold([str(devices / "nvidiactl")]))
    holding = full_scanner(workers, devices_dir=str(devices)).scan().holdings[child.pid]
    assert holding.ctl
    assert not holding.uvm
    assert holding.gpu_minors == frozenset()


@pytest.mark.skipif(
    os.geteuid() != 0 and resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4096,
    reason="needs a hard fd limit of at least 4096",
)
@pytest.mark.parametrize("workers", [1, 2])
def test_an_fd_above_1024_is_found(spawn: Spawn, devices: Path, workers: int) -> None:
    child = spawn(HOLD_FD.format(body=HIGH_FD.format(path=str(devices / "nvidia3"))))
    assert os.readlink(f"/proc/{child.pid}/fd/3000") == str(devices / "nvidia3")
    holding = full_scanner(workers, devices_dir=str(devices)).scan().holdings[child.pid]
    assert holding.gpu_minors_fd == {3}


@pytest.mark.skipif(SYS_EXIT is None, reason="exit(2) syscall number unknown on this machine")
@pytest.mark.parametrize("workers", [1, 2])
def test_a_thread_group_whose_leader_exited_is_found(
    spawn: Spawn, devices: Path, workers: int
) -> None:
    child = spawn(zombie_leader(str(devices / "nvidia0")))
    procfs = ProcFS("/proc")
    for _ in range(500):
        fields = procfs.read_stat(child.pid)
        if fields is not None and fields.state == "Z":
            break
        os.sched_yield()
        __import__("time").sleep(0.01)
    holding = full_scanner(workers, devices_dir=str(devices)).scan().holdings[child.pid]
    assert holding.gpu_minors_fd == {0}


@pytest.mark.parametrize("workers", [1, 2])
def test_device_number_mode_finds_fd_and_mapping_holders(
    spawn: Spawn, tmp_path: Path, workers: int
) -> None:
    # /dev/null is 1:3 ("GPU 3"), /dev/full 1:7 (nvidiactl); a mapping of /dev/zero is shmem,
    # so the mapping-only child maps a regular file and must not count.
    by_fd = spawn(hold(["/dev/null", "/dev/full"]))
    settings = {"devices_dir": str(tmp_path), "match_by_path": False, "device_major": 1,
                "ctl_minor": 7, "uvm_major": 1, "uvm_minor": 8}  # fmt: skip
    scan = full_scanner(workers, **settings).scan()
    assert scan.holdings[by_fd.pid].gpu_minors_fd == {3}
    assert scan.holdings[by_fd.pid].ctl


def test_forked_workers_give_the_same_holdings_in_the_same_order(
    spawn: Spawn, devices: Path
) -> None:
    children = [spawn(hold([str(devices / f"nvidia{m}")])) for m in (0, 1, 3)]
    one = full_scanner(1, devices_dir=str(devices)).scan()
    many = full_scanner(spread.MAX_WORKERS, devices_dir=str(devices)).scan()
    assert list(one.holdings.items()) == list(many.holdings.items())
    assert {c.pid for c in children} <= set(many.holdings)


# --- the merge and the fork rules, alone ------------------------------------------------------


def _rows(pids: Iterable[int], tick: spread.Tick = None) -> list[spread.Row]:
    flags = (True, False, False)
    return [
        (pid, (pid % 8,), (), *flags, pid % 5 == 0, pid % 7 == 0, (), (), ((0, 1, None),))
        for pid in pids
    ]


def test_spread_merges_in_input_order_whatever_the_split() -> None:
    pids = list(range(1000, 1100))
    for workers in (2, 3, 4):
        assert spread.scan_spread(_rows, pids, workers=workers, min_slice=10) == _rows(pids)


def test_a_walk_too_short_to_share_reads_neither_the_cpus_nor_the_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A targeted poll's few processes (fewer than two slices) are scanned here at once: no
    worker could be worth it, so the CPUs and /proc/loadavg are not asked."""

    def asked() -> int:
        raise AssertionError("asked")

    monkeypatch.setattr(spread, "_cpus", asked)
    for pids in ([], list(range(1, 20))):
        assert spread.scan_spread(_rows, pids, min_slice=10) == _rows(pids)
    with pytest.raises(AssertionError, match="asked"):
        spread.scan_spread(_rows, list(range(1, 21)), min_slice=10)


def test_a_slice_whose_worker_failed_is_scanned_here() -> None:
    parent = os.getpid()

    def scan(pids: Sequence[int], tick: spread.Tick) -> list[spread.Row]:
        if os.getpid() != parent:
            raise RuntimeError("the worker dies")
        return _rows(pids)

    pids = list(range(50))
    assert spread.scan_spread(scan, pids, workers=3, min_slice=5) == _rows(pids)


def test_a_slow_workers_progress_is_told_here_and_a_stuck_ones_is_not() -> None:
    """The daemon feeds its watchdog through ``progress`` (only this process may notify
    systemd): a worker whose slice advances slowly shows it by heartbeats on its pipe; one
    stuck in one call sends none, so a hang is never hidden."""
    parent = os.getpid()

    def advancing(pids: Sequence[int], tick: spread.Tick) -> list[spread.Row]:
        for _ in range(12 if os.getpid() != parent else 0):  # 1.2 s in steps of 0.1 s
            time.sleep(0.1)
            assert tick is not None
            tick()
        return _rows(pids)

    def stuck(pids: Sequence[int], tick: spread.Tick) -> list[spread.Row]:
        if os.getpid() != parent:
            time.sleep(1.2)  # one long call, no tick
        return _rows(pids)

    pids = list(range(20))
    told: list[int] = []
    assert spread.scan_spread(
        advancing, pids, workers=2, min_slice=5, progress=lambda: told.append(1)
    ) == _rows(pids)
    assert len(told) >= 3  # two heartbeats at least (one each 0.5 s), then the rows
    quiet: list[int] = []
    assert spread.scan_spread(
        stuck, pids, workers=2, min_slice=5, progress=lambda: quiet.append(1)
    ) == _rows(pids)
    assert len(quiet) == 1  # the rows only: no heartbeat from a worker that made no progress


@pytest.mark.parametrize(
    ("processes", "cpus", "idle", "limit", "expected"),
    [
        (2000, 2, 2, None, 2),
        (2000, 2, 1, None, 1),  # the other core is busy: no fork
        (300, 8, 8, None, 1),  # too few processes to pay for a fork
        (8000, 16, 16, None, spread.MAX_WORKERS),
        (8000, 16, 16, 1, 1),
    ],
)
def test_worker_count(
    processes: int, cpus: int, idle: int, limit: int | None, expected: int
) -> None:
    assert spread.worker_count(processes, cpus=cpus, idle=idle, max_workers=limit) == expected


@pytest.mark.parametrize(
    ("loadavg", "cpus", "expected"),
    [("0.5 0.4 0.3 1/200 99", 4, 4), ("2.0 1.0 1.0 3/200 99", 2, 1), ("junk", 4, 1)],
)
def test_idle_cpus_counts_runnable_tasks_other_than_us(
    loadavg: str, cpus: int, expected: int
) -> None:
    assert spread.idle_cpus(loadavg, cpus) == expected


# --- kernel threads ---------------------------------------------------------------------------


def test_kernel_threads_are_kthreadds_children_without_exe_and_with_pf_kthread(
    tmp_path: Path,
) -> None:
    fake = FakeProc(tmp_path / "proc")
    fake.add(2, comm="kthreadd", ppid=0, flags=0x00200000, cmdline=(), exe=None)
    fake.add_kernel_thread(30)
    fake.add(31, comm="modprobe", ppid=2, exe="/usr/sbin/modprobe")  # a user-mode helper
    fake.add(32, comm="helper", ppid=2, exe=None)  # a zombie helper leader: no PF_KTHREAD
    fake.add(40, comm="python", ppid=1)
    assert ProcFS(str(fake.root)).kernel_threads() == {2, 30}


def test_without_children_files_no_process_is_skipped_as_a_kernel_thread(tmp_path: Path) -> None:
    fake = FakeProc(tmp_path / "proc", children_files=False)
    fake.add(2, comm="kthreadd", ppid=0, flags=0x00200000, cmdline=(), exe=None)
    fake.add_kernel_thread(30)
    assert ProcFS(str(fake.root)).kernel_threads() == frozenset()


def test_the_real_kthreadd_children_are_kernel_threads() -> None:
    procfs = ProcFS("/proc")
    for pid in procfs.kernel_threads():
        fields = procfs.read_stat(pid)
        assert fields is None or fields.kernel_thread
    assert os.getpid() not in procfs.kernel_threads()
    assert sys.executable  # the scan of ourselves is covered by test_holders
