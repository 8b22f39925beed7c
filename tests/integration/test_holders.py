"""Tests for gpuwatchd.collect.holders: the scan for holders of NVIDIA device files.

Scans run over fake /proc trees (tests/support/fakeproc.py) and over real child processes of
this test, which hold stand-in device files (path mode) or real character devices
(device-number mode with ``device_major=1``: /dev/null is 1:3).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.collect.holders import (
    FD_BATCH,
    DeviceFiles,
    HolderScanner,
    lines_containing,
    match_device_name,
)
from gpuwatchd.collect.kcmp import Kcmp
from gpuwatchd.collect.procfs import ProcFS
from tests.support.children import (
    HOLD_FD,
    SYS_EXIT,
    Spawn,
    hold,
    map_only,
    private_tables,
    wait_for_state,
    zombie_leader,
)
from tests.support.fakeproc import FakeProc

REPO = Path(__file__).resolve().parents[2]


def scanner(root: str = "/proc", **settings: Any) -> HolderScanner:
    """A holder scanner over the /proc tree at ``root``."""
    procfs = ProcFS(root)
    return HolderScanner(procfs, DeviceFiles(procfs, **settings))


# --- pure helpers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("nvidia0", ("gpu", 0)), ("nvidia247", ("gpu", 247)), ("nvidiactl", ("ctl", 0)),
        ("nvidia-uvm", ("uvm", 0)), ("nvidia-uvm-tools", None), ("nvidia-modeset", None),
        ("nvidia0x", None), ("null", None),
    ],
)  # fmt: skip
def test_device_names_stand_for_a_gpu_nvidiactl_or_nvidia_uvm(
    name: str, expected: tuple[str, int] | None
) -> None:
    assert match_device_name(name) == expected


def test_lines_containing_splits_at_newline_only_and_reports_each_line_once() -> None:
    data = "a /dev/x nvidia\nb\rc /dev/y\u2028\nplain\nlast /dev/z".encode()
    assert lines_containing(data, (b"/dev/", b"nvidia")) == [
        b"a /dev/x nvidia",
        "b\rc /dev/y\u2028".encode(),
        b"last /dev/z",
    ]


# --- holder scans over a fake /proc -------------------------------------------------------


def test_path_mode_finds_fd_and_map_holders(fake: FakeProc, devices: Path) -> None:
    fds = {0: "/dev/null", 3: "pipe:[77]", 4: f"{devices}/nvidia0", 5: f"{devices}/nvidiactl"}
    fake.add(700, fds={**fds, 6: f"{devices}/nvidia-uvm", 7: f"{devices}/nvidia0"})
    fake.add(701, fds={3: f"{devices}/nvidia1-not-a-device", 4: str(devices)})
    fake.add(702)
    fake.add_mapping(702, f"{devices}/nvidia3")
    fake.add_mapping(702, f"{devices}/nvidiactl")
    scan = scanner(str(fake.root), devices_dir=str(devices)).scan()
    assert scan.mode == "full"
    assert set(scan.holdings) == {700, 702}
    assert scan.holdings[700].gpu_minors_fd == {0}
    assert not scan.holdings[700].gpu_minors_map
    assert scan.holdings[700].ctl
    assert scan.holdings[700].uvm
    assert scan.holdings[702].gpu_minors_map == {3}
    assert not scan.holdings[702].gpu_minors_fd
    assert scan.holdings[702].ctl
    assert not scan.holdings[702].uvm
    assert scan.unreadable == frozenset()


def test_a_maps_file_of_hundreds_of_megabytes_is_read_a_block_at_a_time(
    fake: FakeProc, devices: Path
) -> None:
    """Any user can map one file 65,530 times (``vm.max_map_count``) under a 4 KiB path: a maps
    file of 270 MB, read whole twice over (the chunks, then their join) by a walk, past the
    unit's MemoryMax. Read a block at a time, a walk still finds every device line in it."""
    fake.add(720)
    hostile = f"/home/u/{'d' * 200}/" * 19 + "f"
    lines = [f"{a:x}-{a + 0x1000:x} r--s 00000000 08:01 99 {hostile}\n" for a in range(1_600)]
    for at, name in ((0, "nvidia0"), (777, "nvidia1"), (1_599, "nvidiactl")):
        lines[at] = f"{at:x}-{at + 0x1000:x} rw-s 00000000 00:05 123 {devices}/{name}\n"
    (fake.root / "720" / "maps").write_text("".join(lines))
    tracemalloc.start()
    try:
        scan = scanner(str(fake.root), devices_dir=str(devices)).scan([720])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak >> 10} KiB held for a {len(lines) * len(hostile) >> 10} KiB file"
    assert scan.holdings[720].gpu_minors_map == {0, 1}
    assert scan.holdings[720].ctl


def test_a_table_of_half_a_million_fds_is_read_a_batch_at_a_time(
    fake: FakeProc, devices: Path
) -> None:
    """Any user may open 524,288 fds (systemd's default hard limit), each a dup of one file under
    a 4 KiB path: their link texts, all held at once, are 2 GB. Read a batch at a time, a walk
    still sees the device among them."""
    fake.add(730, fds={1_023: f"{devices}/nvidia1"})
    hostile = f"/home/u/{'d' * 200}/" * 19 + "f"
    for fd in range(3, 1_023):
        fake.open_fd(730, fd, hostile)
    walk = scanner(str(fake.root), devices_dir=str(devices))
    assert walk.fd_batch == FD_BATCH
    walk.fd_batch = 64  # as 1,024 of half a million fds: a batch is a sixteenth of the table
    tracemalloc.start()
    try:
        scan = walk.scan([730])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak >> 10} KiB held for {1_020 * len(hostile) >> 10} KiB of links"
    assert scan.holdings[730].gpu_minors_fd == {1}


def test_targeted_scan_looks_at_exactly_the_given_pids(fake: FakeProc, devices: Path) -> None:
    fake.add(710, fds={3: f"{devices}/nvidia0"})
    fake.add(711, fds={3: f"{devices}/nvidia1"})
    holders = scanner(str(fake.root), devices_dir=str(devices))
    scan = holders.scan([711, 999])
    assert scan.mode == "targeted"
    assert set(scan.holdings) == {711}
    assert set(holders.scan(exclude=[710]).holdings) == {711}


@pytest.mark.parametrize("stat", ["readable", "unreadable"])
def test_scan_skips_kernel_threads_and_records_unreadable_processes(
    fake: FakeProc, devices: Path, stat: str
) -> None:
    """A ``stat`` unreadable (EISDIR here; EACCES, EMFILE on a host) does not make a process
    whose fds could not be read gone, nor one that seems to hold nothing (a zombie leader's
    live thread may): unknown, both."""
    fake.add_kernel_thread(2)
    base = fake.add(720, fds={3: f"{devices}/nvidia0"})
    fake.add_mapping(720, f"{devices}/nvidia1")
    (base / "fd" / "3").unlink()
    (base / "fd").rmdir()
    (base / "fd").write_text("not a directory")  # reading the fds fails: unknown
    empty = fake.add(721)
    if stat == "unreadable":
        for folder in (base, empty):
            (folder / "stat").unlink()
            (folder / "stat").mkdir()
    scan = scanner(str(fake.root), devices_dir=str(devices)).scan()
    assert scan.unreadable == ({720} if stat == "readable" else {720, 721})
    assert scan.holdings[720].gpu_minors_map == {1}  # what could be read is still reported
    assert 2 not in scan.holdings


def test_scan_skips_processes_that_vanish(fake: FakeProc, devices: Path) -> None:
    base = fake.add(730, fds={3: f"{devices}/nvidia0"})
    shutil.rmtree(base / "fd")
    (base / "maps").unlink()
    scan = scanner(str(fake.root), devices_dir=str(devices)).scan([730])
    assert scan.holdings == {}
    assert scan.unreadable == frozenset()


def test_device_number_mode_identifies_fds_by_rdev_not_name(fake: FakeProc) -> None:
    # In a container host GPU 3 can be called /dev/nvidia0: the number wins over the name.
    fake.add(740, fds={3: "/dev/null", 4: "/dev/full", 5: "socket:[1]"})
    fake.add(741, fds={3: "/tmp/nvidia0"})  # a regular file named like a GPU
    holders = scanner(str(fake.root), match_by_path=False, device_major=1, ctl_minor=7)
    scan = holders.scan()
    assert set(scan.holdings) == {740}
    assert scan.holdings[740].gpu_minors_fd == {3}
    assert scan.holdings[740].ctl


def test_device_number_mode_identifies_mappings_through_map_files(fake: FakeProc) -> None:
    fake.add(750)
    fake.add_mapping(750, "/dev/nvidia0", map_file="/dev/null", inode=11)
    fake.add_mapping(750, "/dev/nvidia-uvm", map_file="/dev/random", inode=12)
    fake.add_mapping(750, "/dev/shm/torch_123", map_file="/dev/null", inode=13)
    holders = scanner(str(fake.root), match_by_path=False, device_major=1, uvm_major=1, uvm_minor=8)
    scan = holders.scan()
    assert scan.holdings[750].gpu_minors_map == {3}  # 1:3, whatever the path says
    assert scan.holdings[750].uvm
    assert scan.matched_by_name == frozenset()


def test_device_number_mode_falls_back_to_the_root_path_when_its_inode_matches(
    fake: FakeProc,
) -> None:
    null_inode = os.stat("/dev/null").st_ino
    fake.add(760)
    fake.add_mapping(760, "/dev/null", inode=null_inode)
    fake.set_root_link(760, "/")
    fake.add(761)
    fake.add_mapping(761, "/dev/null", inode=null_inode + 1)  # another file by now
    fake.set_root_link(761, "/")
    scan = scanner(str(fake.root), match_by_path=False, device_major=1).scan()
    assert set(scan.holdings) == {760}
    assert scan.holdings[760].gpu_minors_map == {3}


def test_nvidia_uvm_loaded_after_a_scan_is_recognised_at_the_next(fake: FakeProc) -> None:
    """nvidia-uvm is loaded on demand (by the first CUDA program's nvidia-modprobe), often after
    the daemon started: a major absent from /proc/devices is looked up again by the next scan."""
    fake.add(780, fds={3: "/dev/tty", 4: "/dev/null"})  # 5:0 stands for nvidia-uvm, 1:3 GPU 3
    holders = scanner(str(fake.root), match_by_path=False, device_major=1)
    assert not holders.scan().holdings[780].uvm
    fake.write("devices", "Character devices:\n  1 mem\n  5 nvidia-uvm\n195 nvidia-frontend\n")
    assert holders.scan().holdings[780].uvm


def test_device_number_mode_falls_back_to_the_name_and_says_so(fake: FakeProc) -> None:
    fake.add(770)
    fake.add_mapping(770, "/dev/nvidia2")
    fake.add_mapping(770, "/dev/zero (deleted)")
    scan = scanner(str(fake.root), match_by_path=False).scan()
    assert scan.holdings[770].gpu_minors_map == {2}
    assert scan.matched_by_name == {770}


# --- real child processes -----------------------------------------------------------------


def test_real_child_holding_a_device_file_through_an_fd(spawn: Spawn, devices: Path) -> None:
    child = spawn(hold([f"{devices}/nvidia0"]))
    scan = scanner(devices_dir=str(devices)).scan([child.pid])
    assert scan.holdings[child.pid].gpu_minors_fd == {0}
    assert scan.holdings[child.pid].gpu_minors_map == frozenset()
    full = scanner(devices_dir=str(devices)).scan()
    assert full.holdings[child.pid] == scan.holdings[child.pid]
    assert os.getpid() not in full.holdings


def test_real_child_holding_a_device_through_a_mapping_only(spawn: Spawn, devices: Path) -> None:
    child = spawn(map_only(f"{devices}/nvidia1"))
    holding = scanner(devices_dir=str(devices)).scan([child.pid]).holdings[child.pid]
    assert holding.gpu_minors_map == {1}
    assert holding.gpu_minors_fd == frozenset()
    assert holding.via(1) == ("map",)


def test_real_child_holding_ctl_and_uvm(spawn: Spawn, devices: Path) -> None:
    child = spawn(hold([f"{devices}/nvidiactl", f"{devices}/nvidia-uvm"]))
    holding = scanner(devices_dir=str(devices)).scan([child.pid]).holdings[child.pid]
    assert holding.ctl
    assert holding.uvm
    assert holding.gpu_minors == frozenset()


def test_real_child_in_device_number_mode_with_real_character_devices(
    spawn: Spawn, tmp_path: Path
) -> None:
    child = spawn(hold(["/dev/null", "/dev/full", "/dev/random"]))
    holders = scanner(
        devices_dir=str(tmp_path), match_by_path=False, device_major=1, ctl_minor=7,
        uvm_major=1, uvm_minor=8,
    )  # fmt: skip
    holding = holders.scan([child.pid]).holdings[child.pid]
    assert holding.gpu_minors_fd == {3}  # /dev/null is 1:3
    assert holding.ctl
    assert holding.uvm


def test_shared_dev_zero_mapping_is_anonymous_memory_not_a_device(
    spawn: Spawn, tmp_path: Path
) -> None:
    # mmap(MAP_SHARED) of /dev/zero becomes shmem ("/dev/zero (deleted)"), not device 1:5.
    child = spawn(map_only("/dev/zero"))
    holders = scanner(devices_dir=str(tmp_path), match_by_path=False, device_major=1)
    assert child.pid not in holders.scan([child.pid]).holdings


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the scan as another user")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_unprivileged_scan_records_another_users_process_as_unreadable(
    spawn: Spawn, devices: Path
) -> None:
    child = spawn(hold([f"{devices}/nvidia0"]))  # runs as root
    code = (
        "import json, sys\n"
        "from gpuwatchd.collect.procfs import ProcFS\n"
        f"p = ProcFS(devices_dir={str(devices)!r}).holders\n"
        f"t = p.scan([{child.pid}]); f = p.scan()\n"
        "print(json.dumps({'t': sorted(t.unreadable), 'h': sorted(t.holdings), "
        "'f': sorted(f.unreadable)}))\n"
    )
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, "-c", code],
        capture_output=True, text=True, check=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)}, cwd="/",
    )  # fmt: skip
    seen = json.loads(out.stdout)
    assert seen["t"] == [child.pid]
    assert seen["h"] == []
    assert child.pid in seen["f"]
    procfs = ProcFS()
    kernel_threads = {
        pid
        for pid in procfs.list_pids()
        if (fields := procfs.read_stat(pid)) is not None and fields.kernel_thread
    }
    assert kernel_threads
    assert not kernel_threads & set(seen["f"])


@pytest.mark.skipif(SYS_EXIT is None, reason="exit(2) syscall number unknown on this machine")
def test_real_zombie_leader_is_scanned_through_its_live_thread(spawn: Spawn, devices: Path) -> None:
    # The main thread alone exits (SYS_exit, not exit_group): the leader turns Z while another
    # thread keeps the shared fd table, and so the device file, alive.
    child = spawn(zombie_leader(str(devices / "nvidia0")))
    holders = scanner(devices_dir=str(devices))
    wait_for_state(holders.procfs, child.pid, "Z")
    holding = holders.scan([child.pid]).holdings[child.pid]
    assert holding.gpu_minors_fd == {0}


# --- threads with a file descriptor table of their own (issue 20) ------------------------------

CLONE_FILES = 0x400
OWN_TABLE = """
libc = ctypes.CDLL(None, use_errno=True)
import threading
opened = threading.Event()

def hold():
    if libc.unshare({clone_files}) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_FILES)")
    held = os.open({path!r}, os.O_RDONLY)  # in this thread's table only
    opened.set()
    time.sleep(60)

threading.Thread(target=hold, daemon=True).start()
opened.wait()
{leader}
"""


def _own_table(path: str, leader: str = "") -> str:
    body = OWN_TABLE.format(clone_files=CLONE_FILES, path=path, leader=leader)
    return HOLD_FD.format(body=body)


def _fds_of(pid: int) -> set[str]:
    return {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}


def test_a_thread_holding_a_device_in_a_table_of_its_own_is_a_holder(
    spawn: Spawn, devices: Path
) -> None:
    """The attack of issue 20: a thread that called unshare(CLONE_FILES) keeps /dev/nvidia0
    open where /proc/PID/fd does not show it. Before, every scan said nobody held the GPU."""
    child = spawn(_own_table(str(devices / "nvidia0")))
    assert str(devices / "nvidia0") not in _fds_of(child.pid)  # the leader's table is clean
    targeted = scanner(devices_dir=str(devices)).scan([child.pid])
    assert targeted.holdings[child.pid].gpu_minors_fd == {0}
    assert child.pid not in targeted.unreadable
    full = scanner(devices_dir=str(devices)).scan()
    assert full.holdings[child.pid].gpu_minors_fd == {0}


def test_without_kcmp_every_threads_table_is_read(spawn: Spawn, devices: Path) -> None:
    """Where kcmp cannot tell (ENOSYS under seccomp, say) the walk reads each thread's table
    instead of trusting that threads share one: slower, never blind."""
    from gpuwatchd.collect.kcmp import Kcmp

    child = spawn(_own_table(str(devices / "nvidia1")))
    holders = scanner(devices_dir=str(devices))
    holders._kcmp = Kcmp(number=-1)  # no such syscall: ENOSYS
    holding = holders.scan([child.pid]).holdings[child.pid]
    assert holding.gpu_minors_fd == {1}


def test_threads_sharing_the_leaders_table_add_nothing(spawn: Spawn, devices: Path) -> None:
    """A process whose threads share its table is judged by /proc/PID/fd alone: what the
    leader holds, no more (and a thread's private table is added to it, not instead)."""
    leader_holds = f"kept = os.open({str(devices / 'nvidiactl')!r}, os.O_RDONLY)"
    child = spawn(_own_table(str(devices / "nvidia3"), leader=leader_holds))
    holding = scanner(devices_dir=str(devices)).scan([child.pid]).holdings[child.pid]
    assert holding.ctl
    assert holding.gpu_minors_fd == {3}
    plain = spawn(
        HOLD_FD.format(
            body=f"import threading\nheld = os.open({str(devices / 'nvidia0')!r}, os.O_RDONLY)\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()"
        )
    )
    shared = scanner(devices_dir=str(devices)).scan([plain.pid]).holdings[plain.pid]
    assert shared.gpu_minors_fd == {0}
    assert not shared.ctl


# A plain thread first (the lowest tid, sharing the leader's table), then one with a table of its
# own holding the device file; then the leader alone exits (SYS_exit): Z, two threads live.
ZOMBIE_OWN_TABLE = """
import threading
plain_up = threading.Event()
threading.Thread(target=lambda: (plain_up.set(), time.sleep(60)), daemon=True).start()
plain_up.wait()
{own_table}
print('ready', flush=True)
ctypes.CDLL(None).syscall({sys_exit}, 0)
"""


@pytest.mark.skipif(SYS_EXIT is None, reason="exit(2) syscall number unknown on this machine")
def test_a_zombie_leaders_thread_holding_a_device_in_a_table_of_its_own_is_a_holder(
    spawn: Spawn, devices: Path
) -> None:
    """A zombie leader is read through its first live thread; what the other threads' own
    tables hold is added to that, not dropped (before: the walk read the table holding
    /dev/nvidia0, then returned the first thread's findings alone, and missed the holder)."""
    own_table = OWN_TABLE.format(clone_files=CLONE_FILES, path=str(devices / "nvidia0"), leader="")
    body = ZOMBIE_OWN_TABLE.format(own_table=own_table, sys_exit=SYS_EXIT)
    child = spawn(HOLD_FD.format(body=body).replace('print("ready", flush=True)\n', "", 1))
    holders = scanner(devices_dir=str(devices))
    wait_for_state(holders.procfs, child.pid, "Z")
    scan = holders.scan([child.pid])
    assert scan.holdings[child.pid].gpu_minors_fd == {0}
    assert child.pid not in scan.unreadable


# --- the scan's cost in threads with tables of their own (issue 34, finding 10) ------------------


class _CountingKcmp(Kcmp):
    """The real kcmp, counting the system calls made."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0
        syscall = self._syscall
        assert syscall is not None

        def counted(*args: Any) -> int:
            self.asked += 1
            return syscall(*args)

        self._syscall = counted


@pytest.mark.usefixtures("proc_alone")  # 430 threads: every walk of /proc beside it reads them
def test_private_tables_cost_kcmp_linear_in_threads_and_each_table_is_read_once(
    spawn: Spawn, devices: Path
) -> None:
    """Before: each thread was compared with every table read so far, N²/2 kcmp calls (the
    attack: 4,000 such threads made a scan 32 s). Now one kcmp with the leader, then a binary
    search among the tables read: here 400 threads, under 430 x 11 questions (old: 80,000);
    the 30 threads sharing the first thread's table add no read of it."""
    threads = 400
    child = spawn(private_tables(threads, str(devices / "nvidia3"), sharing=30))
    holders = scanner(devices_dir=str(devices))
    holders._kcmp = counting = _CountingKcmp()
    reads: list[str] = []
    real = holders._scan_fds

    def counted(fd_dir: str, found: Any) -> int:
        reads.append(fd_dir)
        return real(fd_dir, found)

    holders._scan_fds = counted  # type: ignore[method-assign]
    scan = holders.scan([child.pid])
    assert scan.holdings[child.pid].gpu_minors_fd == {3}
    assert child.pid not in scan.unreadable
    assert counting.asked < (threads + 30) * 11
    assert len(reads) == 1 + threads  # the leader's table, then each thread's own once


def test_a_process_past_the_thread_table_budget_is_an_unknown_holder(
    spawn: Spawn, devices: Path
) -> None:
    """Past the budget the scan stops reading the process's thread tables: it is unreadable
    (blocks resets, never a target) and says why in ``thread_tables_unread``."""
    child = spawn(private_tables(40, str(devices / "nvidia1")))
    holders = scanner(devices_dir=str(devices))
    holders.thread_table_budget = 20
    scan = holders.scan([child.pid])
    assert child.pid in scan.unreadable
    assert scan.thread_tables_unread == {child.pid}
    full = scanner(devices_dir=str(devices)).scan([child.pid])
    assert full.holdings[child.pid].gpu_minors_fd == {1}
    assert not full.unreadable
    assert not full.thread_tables_unread


# Opens "nvidia0" (1:3) in the folder, then, in a mount namespace of its own, a tmpfs over the
# folder and another "nvidia0" (1:5) there: both fd links read ".../nvidia0".
SAME_TEXT = """
import ctypes, os, stat, time
folder = {folder!r}
first = os.open(folder + "/nvidia0", os.O_RDONLY)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x00020000) == 0, ctypes.get_errno()  # CLONE_NEWNS
assert libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0  # MS_REC | MS_PRIVATE
assert libc.mount(b"none", folder.encode(), b"tmpfs", 0, None) == 0, ctypes.get_errno()
os.mknod(folder + "/nvidia0", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
second = os.open(folder + "/nvidia0", os.O_RDONLY)
print("ready", flush=True)
time.sleep(60)
"""


def test_two_fds_whose_links_read_the_same_are_each_identified_by_number(
    spawn: Spawn, tmp_path: Path
) -> None:
    """An fd's link is its path as the reader resolves it: two files in different mount
    namespaces (a host's and a container's /dev/nvidia0) read the same and are different
    devices, so a full scan in device-number mode (the reset's final one) looks at each fd,
    not each link text."""
    folder = tmp_path / "dev"
    folder.mkdir()
    os.mknod(folder / "nvidia0", 0o600 | 0o020000, os.makedev(1, 3))
    child = spawn(SAME_TEXT.format(folder=str(folder)))
    links = {os.readlink(f"/proc/{child.pid}/fd/{fd}") for fd in (3, 4)}
    assert links == {str(folder / "nvidia0")}  # the precondition: one text, two devices
    scan = scanner(devices_dir=str(folder), match_by_path=False, device_major=1).scan()
    assert scan.holdings[child.pid].gpu_minors_fd == {3, 5}
