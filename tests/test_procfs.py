"""Tests for gpuwatchd.collect.procfs: the /proc parsers, process facts and the device-holder scan.

Parsers are pinned by tables; facts and scans by fake /proc trees (tests/support/fakeproc.py)
and by real child processes of this test, which hold stand-in device files (path mode) or real
character devices (device-number mode with ``device_major=1``: /dev/null is 1:3).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatchd.collect.procfs import (
    PROC_CGROUP_INIT_INO,
    PROC_PID_INIT_INO,
    ProcFS,
    StatFields,
    parse_cgroup,
    parse_proc_devices,
    parse_stat,
)
from gpuwatchd.model import CgroupInfo
from tests.support.fakeproc import PF_KTHREAD, FakeProc, format_stat, make_devices

REPO = Path(__file__).resolve().parent.parent
DOCKER_ID = "4f9a" * 16
CTR_ID = "ab12" * 16
POD_UID = "0b7c3f5e-2d2a-4c55-9a6e-1f2e3d4c5b6a"

# --- parse_stat ---------------------------------------------------------------------------


def _stat_line(comm: str, state: str = "S", flags: int = 0, threads: int = 1) -> str:
    return format_stat(
        42, comm, state=state, ppid=7, pgrp=40, session=30, flags=flags,
        num_threads=threads, starttime=987654,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        pytest.param(
            _stat_line("python3"),
            StatFields(42, "python3", "S", 7, 40, 30, 0, 1, 987654),
            id="normal",
        ),
        pytest.param(
            _stat_line("foo) Z 1 ("),
            StatFields(42, "foo) Z 1 (", "S", 7, 40, 30, 0, 1, 987654),
            id="hostile-comm-fakes-zombie-and-ppid",
        ),
        pytest.param(
            _stat_line("tmux: server"),
            StatFields(42, "tmux: server", "S", 7, 40, 30, 0, 1, 987654),
            id="comm-with-space",
        ),
        pytest.param(
            _stat_line("a)b)"),
            StatFields(42, "a)b)", "S", 7, 40, 30, 0, 1, 987654),
            id="comm-ending-in-parens",
        ),
        pytest.param(
            _stat_line("python3", state="Z", threads=3),
            StatFields(42, "python3", "Z", 7, 40, 30, 0, 3, 987654),
            id="zombie-with-live-threads",
        ),
        pytest.param(
            _stat_line("nccl", state="D"),
            StatFields(42, "nccl", "D", 7, 40, 30, 0, 1, 987654),
            id="uninterruptible",
        ),
        pytest.param(
            _stat_line("kworker/0:1", flags=PF_KTHREAD | 0x40),
            StatFields(42, "kworker/0:1", "S", 7, 40, 30, PF_KTHREAD | 0x40, 1, 987654),
            id="kernel-thread",
        ),
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


# --- parse_cgroup -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            f"0::/system.slice/docker-{DOCKER_ID}.scope\n",
            CgroupInfo(f"/system.slice/docker-{DOCKER_ID}.scope", DOCKER_ID, "docker",
                       systemd_unit=f"docker-{DOCKER_ID}.scope"),
            id="docker-systemd-driver",
        ),
        pytest.param(
            f"12:devices:/docker/{DOCKER_ID}\n1:name=systemd:/docker/{DOCKER_ID}\n",
            CgroupInfo(f"/docker/{DOCKER_ID}", DOCKER_ID, "docker"),
            id="docker-cgroupfs-driver-v1",
        ),
        pytest.param(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            f"{POD_UID.replace('-', '_')}.slice/cri-containerd-{CTR_ID}.scope\n",
            CgroupInfo("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
                       f"{POD_UID.replace('-', '_')}.slice/cri-containerd-{CTR_ID}.scope",
                       CTR_ID, "containerd", POD_UID,
                       systemd_unit=f"cri-containerd-{CTR_ID}.scope"),
            id="k8s-containerd-burstable",
        ),
        pytest.param(
            f"0::/kubepods.slice/kubepods-pod{POD_UID.replace('-', '_')}.slice/"
            f"cri-containerd-{CTR_ID}.scope\n",
            CgroupInfo(f"/kubepods.slice/kubepods-pod{POD_UID.replace('-', '_')}.slice/"
                       f"cri-containerd-{CTR_ID}.scope", CTR_ID, "containerd", POD_UID,
                       systemd_unit=f"cri-containerd-{CTR_ID}.scope"),
            id="k8s-containerd-guaranteed",
        ),
        pytest.param(
            f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
            f"{POD_UID.replace('-', '_')}.slice/crio-{CTR_ID}.scope\n",
            CgroupInfo(f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
                       f"{POD_UID.replace('-', '_')}.slice/crio-{CTR_ID}.scope",
                       CTR_ID, "crio", POD_UID, systemd_unit=f"crio-{CTR_ID}.scope"),
            id="k8s-crio",
        ),
        pytest.param(
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            f"{POD_UID.replace('-', '_')}.slice/crio-conmon-{CTR_ID}.scope\n",
            CgroupInfo(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
                       f"{POD_UID.replace('-', '_')}.slice/crio-conmon-{CTR_ID}.scope",
                       CTR_ID, "crio", POD_UID, systemd_unit=f"crio-conmon-{CTR_ID}.scope"),
            id="k8s-crio-conmon",
        ),
        pytest.param(
            f"0::/kubepods/burstable/pod{POD_UID}/{CTR_ID}\n",
            CgroupInfo(f"/kubepods/burstable/pod{POD_UID}/{CTR_ID}", CTR_ID, None, POD_UID),
            id="k8s-cgroupfs-driver",
        ),
        pytest.param(
            f"0::/machine.slice/libpod-{CTR_ID}.scope/container\n",
            CgroupInfo(f"/machine.slice/libpod-{CTR_ID}.scope/container", CTR_ID, "podman",
                       systemd_unit=f"libpod-{CTR_ID}.scope"),
            id="podman",
        ),
        pytest.param(
            "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_1\n",
            CgroupInfo("/system.slice/slurmstepd.scope/job_4242/step_0/user/task_1",
                       slurm_job="4242", slurm_step="0", systemd_unit="slurmstepd.scope"),
            id="slurm-v2-step",
        ),
        pytest.param(
            "0::/system.slice/slurmstepd.scope/job_77/step_batch/user/task_0\n",
            CgroupInfo("/system.slice/slurmstepd.scope/job_77/step_batch/user/task_0",
                       slurm_job="77", slurm_step="batch", systemd_unit="slurmstepd.scope"),
            id="slurm-v2-batch",
        ),
        pytest.param(
            "0::/system.slice/node07_slurmstepd.scope/job_77/step_extern/slurm_processes\n",
            CgroupInfo("/system.slice/node07_slurmstepd.scope/job_77/step_extern/"
                       "slurm_processes", slurm_job="77", slurm_step="extern",
                       systemd_unit="node07_slurmstepd.scope"),
            id="slurm-v2-multi-slurmd-extern",
        ),
        pytest.param(
            "0::/system.slice/slurmstepd.scope/system\n",
            CgroupInfo("/system.slice/slurmstepd.scope/system",
                       systemd_unit="slurmstepd.scope"),
            id="slurmstepd-itself-is-no-job",
        ),
        pytest.param(
            "11:memory:/slurm/uid_1000/job_913/step_interactive/task_0\n"
            "5:devices:/slurm/uid_1000/job_913/step_interactive/task_0\n"
            "1:name=systemd:/system.slice/slurmd.service\n",
            CgroupInfo("/slurm/uid_1000/job_913/step_interactive/task_0",
                       slurm_job="913", slurm_step="interactive"),
            id="slurm-v1",
        ),
        pytest.param(
            "0::/system.slice/nvidia-persistenced.service\n",
            CgroupInfo("/system.slice/nvidia-persistenced.service",
                       systemd_unit="nvidia-persistenced.service"),
            id="systemd-service",
        ),
        pytest.param(
            "0::/user.slice/user-1000.slice/session-4.scope\n",
            CgroupInfo("/user.slice/user-1000.slice/session-4.scope",
                       systemd_unit="session-4.scope"),
            id="login-session",
        ),
        pytest.param(
            "0::/user.slice/user-1000.slice/user@1000.service/app.slice/"
            "app-jupyter.service\n",
            CgroupInfo("/user.slice/user-1000.slice/user@1000.service/app.slice/"
                       "app-jupyter.service", systemd_unit="app-jupyter.service"),
            id="user-service",
        ),
        pytest.param(
            "0::/user.slice/user-1000.slice/user@1000.service/init.scope\n",
            CgroupInfo("/user.slice/user-1000.slice/user@1000.service/init.scope",
                       systemd_unit="init.scope"),
            id="user-manager",
        ),
        pytest.param("0::/\n", CgroupInfo("/"), id="root"),
        pytest.param(
            "9:name=systemd:/\n4:memory:/process_api/836a\n0::/\n",
            CgroupInfo("/"),
            id="hybrid-prefers-unified",
        ),
        pytest.param(
            "3:cpu:/batch\n1:name=systemd:/system.slice/cron.service\n",
            CgroupInfo("/system.slice/cron.service", systemd_unit="cron.service"),
            id="v1-prefers-name-systemd",
        ),
        pytest.param("", None, id="empty"),
        pytest.param("garbage without colons\n", None, id="garbage"),
        pytest.param("0::relative/path\n", None, id="relative-path"),
        pytest.param("0::/docker/not-an-id\n", CgroupInfo("/docker/not-an-id"), id="odd-path"),
    ],
)  # fmt: skip
def test_parse_cgroup(text: str, expected: CgroupInfo | None) -> None:
    assert parse_cgroup(text) == expected


@pytest.mark.parametrize(
    ("text", "job_key"),
    [
        ("0::/system.slice/slurmstepd.scope/job_9/step_0/user/task_0\n", "slurm:9"),
        (f"0::/kubepods/pod{POD_UID}/{CTR_ID}\n", f"pod:{POD_UID}"),
        (f"0::/system.slice/docker-{DOCKER_ID}.scope\n", f"container:{DOCKER_ID}"),
        ("0::/system.slice/train.service\n", "unit:train.service"),
        ("0::/user.slice/user-1000.slice/session-4.scope\n", None),
        ("0::/user.slice/user-1000.slice\n", None),
        ("0::/\n", None),
    ],
)
def test_parsed_cgroups_group_jobs_but_never_shared_slices(text: str, job_key: str | None) -> None:
    info = parse_cgroup(text)
    assert info is not None
    assert info.job_key == job_key


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


@pytest.fixture
def fake(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


@pytest.fixture
def devices(tmp_path: Path) -> Path:
    return make_devices(tmp_path / "devs", minors=(0, 1, 3))


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


def test_read_process_returns_none_for_a_missing_pid(fake: FakeProc) -> None:
    procfs = ProcFS(str(fake.root))
    assert procfs.read_process(999) is None
    assert procfs.read_processes([999]) == {}


def test_read_process_keeps_unknown_fields_none(fake: FakeProc) -> None:
    base = fake.add(500, uid=123456)  # no such user
    (base / "stat").write_text("500 (broken")
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
    assert procfs.uvm_major() == 511


def test_host_facts_fall_back_when_files_are_missing(tmp_path: Path) -> None:
    procfs = ProcFS(str(tmp_path))
    assert procfs.boot_id() is None
    assert procfs.pid_max() == 4194304
    assert procfs.uvm_major() is None
    assert procfs.sees_host_namespaces() is None
    assert procfs.list_pids() == []


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


# --- holder scans over a fake /proc -------------------------------------------------------


def test_path_mode_finds_fd_and_map_holders(fake: FakeProc, devices: Path) -> None:
    fds = {0: "/dev/null", 3: "pipe:[77]", 4: f"{devices}/nvidia0", 5: f"{devices}/nvidiactl"}
    fake.add(700, fds={**fds, 6: f"{devices}/nvidia-uvm", 7: f"{devices}/nvidia0"})
    fake.add(701, fds={3: f"{devices}/nvidia1-not-a-device", 4: str(devices)})
    fake.add(702)
    fake.add_mapping(702, f"{devices}/nvidia3")
    fake.add_mapping(702, f"{devices}/nvidiactl")
    scan = ProcFS(str(fake.root), devices_dir=str(devices)).scan_holders()
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


def test_targeted_scan_looks_at_exactly_the_given_pids(fake: FakeProc, devices: Path) -> None:
    fake.add(710, fds={3: f"{devices}/nvidia0"})
    fake.add(711, fds={3: f"{devices}/nvidia1"})
    procfs = ProcFS(str(fake.root), devices_dir=str(devices))
    scan = procfs.scan_holders([711, 999])
    assert scan.mode == "targeted"
    assert set(scan.holdings) == {711}
    assert set(procfs.scan_holders(exclude=[710]).holdings) == {711}


def test_scan_skips_kernel_threads_and_records_unreadable_processes(
    fake: FakeProc, devices: Path
) -> None:
    fake.add_kernel_thread(2)
    base = fake.add(720, fds={3: f"{devices}/nvidia0"})
    fake.add_mapping(720, f"{devices}/nvidia1")
    (base / "fd" / "3").unlink()
    (base / "fd").rmdir()
    (base / "fd").write_text("not a directory")  # reading the fds fails: unknown
    scan = ProcFS(str(fake.root), devices_dir=str(devices)).scan_holders()
    assert scan.unreadable == {720}
    assert scan.holdings[720].gpu_minors_map == {1}  # what could be read is still reported
    assert 2 not in scan.holdings


def test_scan_skips_processes_that_vanish(fake: FakeProc, devices: Path) -> None:
    base = fake.add(730, fds={3: f"{devices}/nvidia0"})
    shutil.rmtree(base / "fd")
    (base / "maps").unlink()
    scan = ProcFS(str(fake.root), devices_dir=str(devices)).scan_holders([730])
    assert scan.holdings == {}
    assert scan.unreadable == frozenset()


def test_device_number_mode_identifies_fds_by_rdev_not_name(fake: FakeProc) -> None:
    # In a container host GPU 3 can be called /dev/nvidia0: the number wins over the name.
    fake.add(740, fds={3: "/dev/null", 4: "/dev/full", 5: "socket:[1]"})
    fake.add(741, fds={3: "/tmp/nvidia0"})  # a regular file named like a GPU
    procfs = ProcFS(str(fake.root), match_by_path=False, device_major=1, ctl_minor=7)
    scan = procfs.scan_holders()
    assert set(scan.holdings) == {740}
    assert scan.holdings[740].gpu_minors_fd == {3}
    assert scan.holdings[740].ctl


def test_device_number_mode_identifies_mappings_through_map_files(fake: FakeProc) -> None:
    fake.add(750)
    fake.add_mapping(750, "/dev/nvidia0", map_file="/dev/null", inode=11)
    fake.add_mapping(750, "/dev/nvidia-uvm", map_file="/dev/random", inode=12)
    fake.add_mapping(750, "/dev/shm/torch_123", map_file="/dev/null", inode=13)
    procfs = ProcFS(str(fake.root), match_by_path=False, device_major=1, uvm_major=1, uvm_minor=8)
    scan = procfs.scan_holders()
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
    scan = ProcFS(str(fake.root), match_by_path=False, device_major=1).scan_holders()
    assert set(scan.holdings) == {760}
    assert scan.holdings[760].gpu_minors_map == {3}


def test_device_number_mode_falls_back_to_the_name_and_says_so(fake: FakeProc) -> None:
    fake.add(770)
    fake.add_mapping(770, "/dev/nvidia2")
    fake.add_mapping(770, "/dev/zero (deleted)")
    scan = ProcFS(str(fake.root), match_by_path=False).scan_holders()
    assert scan.holdings[770].gpu_minors_map == {2}
    assert scan.matched_by_name == {770}


# --- real child processes -----------------------------------------------------------------

Spawn = Callable[[str], "subprocess.Popen[str]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start a Python child running ``code``; wait for it to print "ready"; kill it after."""
    children: list[subprocess.Popen[str]] = []

    def start(code: str) -> subprocess.Popen[str]:
        child = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        children.append(child)
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "ready", line
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)


HOLD_FD = """
import ctypes, mmap, os, time
{body}
print("ready", flush=True)
time.sleep(60)
"""

# Python's mmap.mmap keeps a dup of the fd, so map through libc to leave a mapping alone.
MAP_ONLY = """
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
fd = os.open({path!r}, os.O_RDWR)
addr = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
os.close(fd)
"""


def _hold(paths: list[str]) -> str:
    opens = ", ".join(f"os.open({p!r}, os.O_RDONLY)" for p in paths)
    return HOLD_FD.format(body=f"held = [{opens}]")


def _map_only(path: str) -> str:
    return HOLD_FD.format(body=MAP_ONLY.format(path=path))


def test_real_child_holding_a_device_file_through_an_fd(spawn: Spawn, devices: Path) -> None:
    child = spawn(_hold([f"{devices}/nvidia0"]))
    scan = ProcFS(devices_dir=str(devices)).scan_holders([child.pid])
    assert scan.holdings[child.pid].gpu_minors_fd == {0}
    assert scan.holdings[child.pid].gpu_minors_map == frozenset()
    full = ProcFS(devices_dir=str(devices)).scan_holders()
    assert full.holdings[child.pid] == scan.holdings[child.pid]
    assert os.getpid() not in full.holdings


def test_real_child_holding_a_device_through_a_mapping_only(spawn: Spawn, devices: Path) -> None:
    child = spawn(_map_only(f"{devices}/nvidia1"))
    holding = ProcFS(devices_dir=str(devices)).scan_holders([child.pid]).holdings[child.pid]
    assert holding.gpu_minors_map == {1}
    assert holding.gpu_minors_fd == frozenset()
    assert holding.via(1) == ("map",)


def test_real_child_holding_ctl_and_uvm(spawn: Spawn, devices: Path) -> None:
    child = spawn(_hold([f"{devices}/nvidiactl", f"{devices}/nvidia-uvm"]))
    holding = ProcFS(devices_dir=str(devices)).scan_holders([child.pid]).holdings[child.pid]
    assert holding.ctl
    assert holding.uvm
    assert holding.gpu_minors == frozenset()


def test_real_child_in_device_number_mode_with_real_character_devices(
    spawn: Spawn, tmp_path: Path
) -> None:
    child = spawn(_hold(["/dev/null", "/dev/full", "/dev/random"]))
    procfs = ProcFS(
        devices_dir=str(tmp_path), match_by_path=False, device_major=1, ctl_minor=7,
        uvm_major=1, uvm_minor=8,
    )  # fmt: skip
    holding = procfs.scan_holders([child.pid]).holdings[child.pid]
    assert holding.gpu_minors_fd == {3}  # /dev/null is 1:3
    assert holding.ctl
    assert holding.uvm


def test_shared_dev_zero_mapping_is_anonymous_memory_not_a_device(
    spawn: Spawn, tmp_path: Path
) -> None:
    # mmap(MAP_SHARED) of /dev/zero becomes shmem ("/dev/zero (deleted)"), not device 1:5.
    child = spawn(_map_only("/dev/zero"))
    procfs = ProcFS(devices_dir=str(tmp_path), match_by_path=False, device_major=1)
    assert child.pid not in procfs.scan_holders([child.pid]).holdings


def _wait_for_state(procfs: ProcFS, pid: int, state: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        fields = procfs.read_stat(pid)
        if fields is not None and fields.state == state:
            return
        time.sleep(0.01)
    pytest.fail(f"pid {pid} never reached state {state}")


def test_real_zombie_child_has_state_z_and_holds_nothing(devices: Path) -> None:
    code = f"import os; fd = os.open({str(devices / 'nvidia0')!r}, os.O_RDONLY)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        procfs = ProcFS(devices_dir=str(devices))
        _wait_for_state(procfs, child.pid, "Z")  # exited, not yet reaped by us
        info = procfs.read_process(child.pid)
        assert info is not None
        assert info.is_zombie
        assert info.cmdline == ()
        scan = procfs.scan_holders([child.pid])
        assert scan.holdings == {}
        assert scan.unreadable == frozenset()
    finally:
        child.wait(timeout=10)


def test_real_vanished_pid_reads_as_none(devices: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=10)
    procfs = ProcFS(devices_dir=str(devices))
    assert procfs.read_process(child.pid) is None
    assert procfs.scan_holders([child.pid]).holdings == {}


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


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the scan as another user")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_unprivileged_scan_records_another_users_process_as_unreadable(
    spawn: Spawn, devices: Path
) -> None:
    child = spawn(_hold([f"{devices}/nvidia0"]))  # runs as root
    code = (
        "import json, sys; from gpuwatchd.collect.procfs import ProcFS\n"
        f"p = ProcFS(devices_dir={str(devices)!r})\n"
        f"t = p.scan_holders([{child.pid}]); f = p.scan_holders()\n"
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


SYS_EXIT = {"x86_64": 60, "aarch64": 93}.get(os.uname().machine)


@pytest.mark.skipif(SYS_EXIT is None, reason="exit(2) syscall number unknown on this machine")
def test_real_zombie_leader_is_scanned_through_its_live_thread(spawn: Spawn, devices: Path) -> None:
    # The main thread alone exits (SYS_exit, not exit_group): the leader turns Z while another
    # thread keeps the shared fd table, and so the device file, alive.
    body = (
        f"fd = os.open({str(devices / 'nvidia0')!r}, os.O_RDONLY)\n"
        "import threading; threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "print('ready', flush=True)\n"
        f"ctypes.CDLL(None).syscall({SYS_EXIT}, 0)"
    )
    child = spawn(HOLD_FD.format(body=body).replace('print("ready", flush=True)\n', "", 1))
    procfs = ProcFS(devices_dir=str(devices))
    _wait_for_state(procfs, child.pid, "Z")
    holding = procfs.scan_holders([child.pid]).holdings[child.pid]
    assert holding.gpu_minors_fd == {0}
