"""Tests for gpuwatchd.collect.procfs: the /proc parsers and the process and host facts.

Parsers are pinned by tables; facts by fake /proc trees (tests/support/fakeproc.py) and by real
child processes of this test. The holder scan is tests/integration/test_holders.py; cgroup parsing
is tests/unit/test_cgroups.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.collect.inherit import InheritanceProbe
from gpuwatchd.collect.procfs import (
    PROC_CGROUP_INIT_INO,
    PROC_PID_INIT_INO,
    ProcFS,
    parse_proc_devices,
)
from gpuwatchd.core.procstat import StatFields, parse_stat
from gpuwatchd.decide.patterns import MAX_COMMAND_TEXT, command_search, command_text
from tests.support.children import Spawn, wait_for_state
from tests.support.fakeproc import PF_KTHREAD, FakeProc, format_stat

DOCKER_ID = "4f9a" * 16
CTR_ID = "ab12" * 16
POD_UID = "0b7c3f5e-2d2a-4c55-9a6e-1f2e3d4c5b6a"

# --- parse_stat ---------------------------------------------------------------------------


def _stat_line(comm: str, state: str = "S", flags: int = 0, threads: int = 1) -> str:
    return format_stat(
        42, comm, state=state, ppid=7, pgrp=40, session=30, flags=flags,
        num_threads=threads, starttime=987654,
    )  # fmt: skip


def _stat_case(comm: str, case: str, state: str = "S", flags: int = 0, threads: int = 1) -> Any:
    """A stat line of PID 42 (parent 7, group 40, session 30, started at 987654) and its
    fields as ``parse_stat`` must read them."""
    expected = StatFields(42, comm, state, 7, 40, 30, flags, threads, 987654, ("0",) * 7)
    return pytest.param(_stat_line(comm, state, flags, threads), expected, id=case)


def test_parse_stat_marks_a_program_by_where_its_code_stack_and_arguments_lie() -> None:
    """Fields 26-28 and 48-51 (numbered as in proc(5)); a shorter line gives what it has."""
    line = "42 (a b) " + " ".join(["S"] + [str(n) for n in range(4, 53)])
    full, short = parse_stat(line), parse_stat(line.rsplit(" ", 8)[0])
    assert full is not None
    assert short is not None
    assert full.exec_mark == ("26", "27", "28", "48", "49", "50", "51")
    assert short.exec_mark == ("26", "27", "28")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        _stat_case("python3", "normal"),
        _stat_case("foo) Z 1 (", "hostile-comm-fakes-zombie-and-ppid"),
        _stat_case("tmux: server", "comm-with-space"),
        _stat_case("a)b)", "comm-ending-in-parens"),
        _stat_case("python3", "zombie-with-live-threads", state="Z", threads=3),
        _stat_case("nccl", "uninterruptible", state="D"),
        _stat_case("kworker/0:1", "kernel-thread", flags=PF_KTHREAD | 0x40),
        pytest.param("42 (python3) S 7 40 30 0 -1", None, id="truncated"),
        pytest.param("", None, id="empty"),
        pytest.param("42 python3 S 7 40 30", None, id="no-parens"),
        pytest.param(_stat_line("x").replace(" 987654", " soon"), None, id="non-numeric"),
    ],
)
def test_parse_stat(line: str, expected: StatFields | None) -> None:
    assert parse_stat(line) == expected


def test_parse_stat_flags_kernel_threads_only_by_pf_kthread() -> None:
    kthread = parse_stat(_stat_line("kworker", flags=PF_KTHREAD))
    user = parse_stat(_stat_line("kworker", flags=0x400040))
    assert kthread is not None
    assert kthread.kernel_thread
    assert user is not None
    assert not user.kernel_thread


def test_parse_proc_devices_reads_only_character_devices() -> None:
    text = (
        "Character devices:\n  1 mem\n  4 /dev/vc/0\n195 nvidia-frontend\n"
        "234 nvidia-uvm\n510 nvidia-caps\n\nBlock devices:\n  7 loop\n234 blkext\n"
    )
    assert parse_proc_devices(text) == {
        "mem": 1, "/dev/vc/0": 4, "nvidia-frontend": 195, "nvidia-uvm": 234, "nvidia-caps": 510,
    }  # fmt: skip
    assert parse_proc_devices("") == {}


# --- facts from a fake /proc --------------------------------------------------------------


def test_read_process_reports_every_fact(fake: FakeProc) -> None:
    fake.add(
        300, comm="foo) Z 1 (", state="D", ppid=200, pgrp=250, session=100, starttime=5555,
        uid=0, cmdline=("python3", "train.py", "--lr", "0.1"), exe="/usr/bin/python3.11",
        cgroup="0::/system.slice/slurmstepd.scope/job_12/step_batch/user/task_0\n",
        nspid=(300, 7),
    )  # fmt: skip
    info = ProcFS(str(fake.root)).read_process(300)
    assert info is not None
    assert (info.pid, info.start_ticks, info.state) == (300, 5555, "D")
    assert (info.ppid, info.pgid, info.sid) == (200, 250, 100)
    assert (info.uid, info.user) == (0, "root")
    assert info.comm == "foo) Z 1 ("
    assert info.cmdline == ("python3", "train.py", "--lr", "0.1")
    assert info.exe == "/usr/bin/python3.11"
    assert info.cgroup is not None
    assert info.cgroup.slurm_job == "12"
    assert info.nspid == (300, 7)
    assert not info.kernel_thread


def test_read_process_flags_kernel_threads_with_empty_cmdline(fake: FakeProc) -> None:
    fake.add_kernel_thread(55)
    info = ProcFS(str(fake.root)).read_process(55)
    assert info is not None
    assert info.kernel_thread
    assert info.cmdline == ()
    assert info.exe is None


def test_read_process_tells_a_reused_pid_by_its_start_ticks(fake: FakeProc) -> None:
    procfs = ProcFS(str(fake.root))
    fake.add(400, starttime=1000, cmdline=("old",))
    before = procfs.read_process(400)
    fake.add(400, starttime=2000, cmdline=("new",))
    after = procfs.read_process(400)
    assert before is not None
    assert after is not None
    assert before.identity != after.identity
    assert (before.cmdline, after.cmdline) == (("old",), ("new",))


@pytest.mark.parametrize(
    "cmdline",
    [
        pytest.param(("python3", *("x" * 100_000,) * 20, "--secret"), id="two-megabytes"),
        pytest.param(("a", *("",) * 40_000, "--secret"), id="a-run-of-empty-arguments"),
        pytest.param(("\u00e9" * 300_000, "--secret"), id="two-bytes-a-character"),
    ],
)
def test_a_huge_command_line_is_read_only_as_far_as_a_pattern_sees(
    fake: FakeProc, cmdline: tuple[str, ...]
) -> None:
    """A user's arguments may be megabytes (the kernel allows a quarter of the stack limit), and
    the facts of every holder are kept: read whole, a few hundred such processes outgrow the
    unit's MemoryMax. What is read still gives every pattern and event the same answer."""
    fake.add(300, cmdline=cmdline)
    info = ProcFS(str(fake.root)).read_process(300)
    assert info is not None
    assert info.cmdline is not None
    assert sum(len(arg.encode()) + 1 for arg in info.cmdline) <= 4 * MAX_COMMAND_TEXT + 8
    read, whole = " ".join(info.cmdline), " ".join(cmdline)
    assert command_text(info.cmdline)[:MAX_COMMAND_TEXT] == whole[:MAX_COMMAND_TEXT]
    for pattern in (re.compile("--secret"), re.compile("^python3 x"), re.compile("\\s$")):
        assert command_search(pattern, read) == command_search(pattern, whole), pattern


def test_read_process_returns_none_for_a_missing_pid(fake: FakeProc) -> None:
    procfs = ProcFS(str(fake.root))
    assert procfs.read_process(999) is None
    assert procfs.read_processes([999]) == {}


@pytest.mark.parametrize(
    ("tgid_line", "expected"),
    [("Tgid:\t500\n", 500), ("Tgid:\t77\n", 77), ("Tgid:\tx\n", None), ("", None)],
)
def test_thread_group_is_the_tgid_of_status_and_none_when_unreadable(
    fake: FakeProc, tgid_line: str, expected: int | None
) -> None:
    """A thread's /proc/TID exists (unlisted): its Tgid names the process it belongs to."""
    base = fake.add(500)
    (base / "status").write_text(f"Name:\tTgid: 9\n{tgid_line}Pid:\t500\n")
    procfs = ProcFS(str(fake.root))
    assert procfs.thread_group(500) == expected
    assert procfs.thread_group(999) is None


@pytest.mark.parametrize("stat", ["unparsable", "unreadable"])
def test_read_process_keeps_unknown_fields_none(fake: FakeProc, stat: str) -> None:
    """A ``stat`` that cannot be parsed, or read for a reason other than "no such process"
    (EISDIR here; EACCES, EMFILE on a host), leaves its facts unknown: the process is not gone."""
    base = fake.add(500, uid=123456)  # no such user
    if stat == "unparsable":
        (base / "stat").write_text("500 (broken")
    else:
        (base / "stat").unlink()
        (base / "stat").mkdir()
    (base / "cgroup").unlink()
    info = ProcFS(str(fake.root)).read_process(500)
    assert info is not None
    assert info.start_ticks is None
    assert info.state is None
    assert info.identity is None
    assert info.uid == 123456
    assert info.user is None
    assert info.cgroup is None


def test_host_facts_come_from_the_injected_root(fake: FakeProc) -> None:
    fake.write("sys/kernel/pid_max", "32768\n")
    fake.write("devices", "Character devices:\n195 nvidia-frontend\n511 nvidia-uvm\n")
    procfs = ProcFS(str(fake.root))
    assert procfs.boot_id() == "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    assert procfs.pid_max() == 32768
    assert procfs.holders.devices.major("nvidia-uvm") == 511


def test_boot_id_is_read_again_from_a_tree_that_is_not_proc(fake: FakeProc) -> None:
    procfs = ProcFS(str(fake.root))
    assert procfs.boot_id() == "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    fake.write("sys/kernel/random/boot_id", "11111111-2222-3333-4444-555555555555\n")
    assert procfs.boot_id() == "11111111-2222-3333-4444-555555555555"


def test_boot_id_is_read_once_from_the_real_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quiet poll asks for it four times; the kernel's does not change while it runs."""
    procfs = ProcFS("/proc")
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
        assert procfs.boot_id() == handle.read().strip()
    reads: list[str] = []
    monkeypatch.setattr("gpuwatchd.collect.procfs._read_text", reads.append)
    assert procfs.boot_id() == procfs.boot_id()
    assert not reads


def test_host_facts_fall_back_when_files_are_missing(tmp_path: Path) -> None:
    procfs = ProcFS(str(tmp_path))
    assert procfs.boot_id() is None
    assert procfs.pid_max() == 4194304
    assert procfs.holders.devices.major("nvidia-uvm") is None
    assert procfs.sees_host_namespaces() is None
    assert procfs.list_pids() == []


def test_names_that_python_calls_digits_but_are_not_ascii_are_no_pids(
    fake: FakeProc, devices: Path
) -> None:
    """A proc_root (a container's, a test's) may hold any name: ``'²'.isdigit()`` is True and
    int() refuses it, int() reads ``'١٢'`` as 12. Neither is a PID, a thread, an fd, a major."""
    fake.add_kernel_thread(2)
    base = fake.add(300, fds={3: f"{devices}/nvidia0"})
    odd = ("\u00b2", "\u0661\u0662")  # '²' and ARABIC-INDIC ONE, TWO
    for name in odd:
        (fake.root / name).mkdir()
        (base / "task" / name).mkdir()  # a second "thread": the holder scan lists task/
        (base / "fd" / name).symlink_to(f"{devices}/nvidia0")
    (fake.root / "2" / "task" / "2" / "children").write_text("300 ² ١٢ ")
    (base / "task" / "300" / "children").write_text("١٢ ² 301 ")
    procfs = ProcFS(str(fake.root), devices_dir=str(devices), match_by_path=True)
    assert sorted(procfs.list_pids()) == [2, 300]
    assert procfs.kernel_threads() == {2}
    assert procfs.children(300) == [301]  # neither dropped nor read as PID 12
    assert set(procfs.holders.scan().holdings) == {300}
    assert InheritanceProbe(procfs.holders, str(fake.root)).device_fds(300) == [3]
    lines = "".join(f"{name} x\n" for name in odd)
    assert parse_proc_devices(f"Character devices:\n195 nvidia\n{lines}") == {"nvidia": 195}


OTHER_NS = 4026532999


@pytest.mark.parametrize(
    ("pid_ns", "cgroup_ns", "init_ns", "expected"),
    [
        (PROC_PID_INIT_INO, PROC_CGROUP_INIT_INO, PROC_PID_INIT_INO, True),
        (PROC_PID_INIT_INO, PROC_CGROUP_INIT_INO, None, True),
        (PROC_PID_INIT_INO, None, None, True),  # kernel without cgroup namespaces
        (OTHER_NS, PROC_CGROUP_INIT_INO, None, False),  # a container without hostPID
        (PROC_PID_INIT_INO, OTHER_NS, None, False),  # a private cgroup namespace
        (PROC_PID_INIT_INO, PROC_CGROUP_INIT_INO, OTHER_NS, False),  # /proc of a container
    ],
)
def test_sees_host_namespaces(
    fake: FakeProc, pid_ns: int, cgroup_ns: int | None, init_ns: int | None, expected: bool
) -> None:
    fake.add(1, comm="systemd", ppid=0)
    fake.add(600)
    fake.set_self(600, pid_ns=pid_ns, cgroup_ns=cgroup_ns)
    if init_ns is not None:
        (fake.root / "1" / "ns").mkdir()
        (fake.root / "1" / "ns" / "pid").symlink_to(f"pid:[{init_ns}]")
    assert ProcFS(str(fake.root)).sees_host_namespaces() is expected


@pytest.mark.parametrize(
    ("link", "target", "expected"),
    [
        ("pid", "pid:[garbled", None),  # our own PID namespace unknown: no answer
        ("cgroup", "cgroup:[garbled", False),  # a cgroup namespace not known to be the host's
    ],
)
def test_sees_host_namespaces_with_an_unparsable_link(
    fake: FakeProc, link: str, target: str, expected: bool | None
) -> None:
    fake.add(600)
    fake.set_self(600, pid_ns=PROC_PID_INIT_INO, cgroup_ns=PROC_CGROUP_INIT_INO)
    (fake.root / "600" / "ns" / link).unlink()
    (fake.root / "600" / "ns" / link).symlink_to(target)
    assert ProcFS(str(fake.root)).sees_host_namespaces() is expected


@pytest.mark.parametrize("children_files", [True, False], ids=["children-files", "stat-scan"])
def test_children_and_descendants(tmp_path: Path, children_files: bool) -> None:
    fake = FakeProc(tmp_path / "proc", children_files=children_files)
    for pid, ppid in ((10, 1), (11, 10), (12, 10), (13, 11), (20, 1), (21, 20)):
        fake.add(pid, ppid=ppid)
    procfs = ProcFS(str(fake.root))
    assert procfs.children(10) == [11, 12]
    assert procfs.children(13) == []
    assert procfs.descendants([10]) == {11, 12, 13}
    assert procfs.descendants([10, 20, 999]) == {11, 12, 13, 21}


def test_a_gone_pid_asked_first_leaves_the_children_files_probe_to_a_live_one(
    tmp_path: Path,
) -> None:
    """The probe for ``task/*/children`` cannot tell from a process that has exited: asked
    about one first, it must not answer "no children files" and walk every stat of /proc."""
    fake = FakeProc(tmp_path / "proc")
    for pid, ppid in ((10, 1), (11, 10), (12, 11)):
        fake.add(pid, ppid=ppid)
    procfs = ProcFS(str(fake.root))
    walks: list[list[int]] = []
    list_pids = procfs.list_pids

    def walk() -> list[int]:
        walks.append(list_pids())
        return walks[-1]

    procfs.list_pids = walk  # type: ignore[method-assign]
    assert procfs.children(999) == []
    assert procfs.descendants([999, 10]) == {11, 12}
    assert walks == []


# --- compatibility: ProcFS builds the holder scan ----------------------------------------


def test_procfs_still_offers_the_holder_scan_it_used_to_own(fake: FakeProc, devices: Path) -> None:
    fake.add(780, fds={3: f"{devices}/nvidia0"})
    procfs = ProcFS(str(fake.root), devices_dir=str(devices))
    assert procfs.holders.scan() == ProcFS(str(fake.root), devices_dir=str(devices)).holders.scan()
    assert set(procfs.holders.scan([780]).holdings) == {780}


# --- real child processes -----------------------------------------------------------------


def test_real_zombie_child_has_state_z_and_holds_nothing(devices: Path) -> None:
    code = f"import os; fd = os.open({str(devices / 'nvidia0')!r}, os.O_RDONLY)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        procfs = ProcFS(devices_dir=str(devices))
        wait_for_state(procfs, child.pid, "Z")  # exited, not yet reaped by us
        info = procfs.read_process(child.pid)
        assert info is not None
        assert info.is_zombie
        assert info.cmdline == ()
        scan = procfs.holders.scan([child.pid])
        assert scan.holdings == {}
        assert scan.unreadable == frozenset()
    finally:
        child.wait(timeout=10)


def test_real_vanished_pid_reads_as_none(devices: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=10)
    procfs = ProcFS(devices_dir=str(devices))
    assert procfs.read_process(child.pid) is None
    assert procfs.holders.scan([child.pid]).holdings == {}


def test_a_child_forked_by_a_thread_is_listed_in_that_threads_children_file_only(
    spawn: Spawn,
) -> None:
    """Why children() reads every thread's file (a holder's data loader thread starts the
    workers): the kernel lists a child under the thread that forked it, not the leader."""
    code = (
        "import subprocess, sys, threading, time\n"
        "def fork():\n"
        "    g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "    print('ready', flush=True); print(threading.get_native_id(), g.pid, flush=True)\n"
        "    g.wait()\n"
        "threading.Thread(target=fork).start()\n"
    )
    child = spawn(code)
    assert child.stdout is not None
    tid, grandchild = (int(n) for n in child.stdout.readline().split())
    try:
        task = Path(f"/proc/{child.pid}/task")
        assert (task / str(child.pid) / "children").read_text().split() == []
        assert (task / str(tid) / "children").read_text().split() == [str(grandchild)]
        assert ProcFS().children(child.pid) == [grandchild]
    finally:
        os.kill(grandchild, signal.SIGKILL)  # unreaped until its parent waits: not reused
        child.wait(timeout=10)


def test_real_descendants_include_grandchildren(spawn: Spawn) -> None:
    code = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('ready', flush=True); print(g.pid, flush=True)\n"
        "try:\n    time.sleep(60)\nfinally:\n    g.kill()\n"
    )
    child = spawn(code)
    assert child.stdout is not None
    grandchild = int(child.stdout.readline())
    try:
        procfs = ProcFS()
        assert procfs.children(child.pid) == [grandchild]
        assert procfs.descendants([child.pid]) == {grandchild}
        info = procfs.read_process(grandchild)
        assert info is not None
        assert info.ppid == child.pid
    finally:
        child.terminate()  # its finally kills the grandchild
        child.wait(timeout=10)
