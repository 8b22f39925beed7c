"""systemd's delegation mark, read from real cgroups (collect/cgroups.py, collect/procfs.py).

A ``Delegate=`` unit's cgroup carries the ``trusted.delegate`` / ``user.delegate`` extended
attribute: its manager (slurmstepd, a user's systemd, a container runtime) places others' work
below it, so the floor (decide/floor.py) does not count it as root's placement. These tests set
real marks on real cgroups of a scratch subtree (``cgroup_base``) and read them through
``delegation_mark`` and through ``ProcFS`` (a fake ``/proc`` whose ``self/mountinfo`` names the
scratch subtree as the hierarchy), and end with real processes in real job cgroups.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.collect.cgroups import delegation_mark, parse_systemd_mount
from gpuwatchd.collect.jobs import cgroup2_mount
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.model import ProcessInfo
from gpuwatchd.decide.floor import infrastructure, mps_server, unverified_infrastructure
from tests.support.fakeproc import FakeProc
from tests.support.folders import traversable_folder

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to set trusted.* xattrs")


def _cgroup(base: Path, path: str, mark: tuple[str, bytes] | None = None) -> Path:
    folder = base / path.strip("/")
    folder.mkdir(parents=True, exist_ok=True)
    if mark is not None:
        os.setxattr(folder, *mark)
    return folder


BATCH = "system.slice/batch.service"


@pytest.mark.parametrize(
    ("marked", "mark", "asked", "expected"),
    [
        (None, None, "/system.slice/nvidia-dcgm.service", False),
        (BATCH, ("trusted.delegate", b"1"), f"/{BATCH}", True),
        # A mark above the process's own cgroup covers the subtree.
        (BATCH, ("trusted.delegate", b"1"), f"/{BATCH}/w/1", True),
        (BATCH, ("user.delegate", b"1"), f"/{BATCH}/w", True),
        (BATCH, ("trusted.delegate", b"0"), f"/{BATCH}", False),
        # The cgroup is gone (the process moved, or a path that is no cgroup): unknown.
        (None, None, "/system.slice/gone.service", None),
        (None, None, "/system.slice/../escape", None),
    ],
    ids=["unmarked", "trusted-mark", "mark-above", "user-mark", "mark-zero", "gone", "dot-dot"],
)  # fmt: skip
def test_delegation_mark_reads_real_marks_on_the_cgroup_and_above(
    cgroup_base: Path,
    marked: str | None,
    mark: tuple[str, bytes] | None,
    asked: str,
    expected: bool | None,
) -> None:
    _cgroup(cgroup_base, "system.slice/nvidia-dcgm.service")
    _cgroup(cgroup_base, f"{BATCH}/w/1")
    if marked is not None:
        _cgroup(cgroup_base, marked, mark)
    assert delegation_mark(str(cgroup_base), asked) is expected


@pytest.fixture
def fake_host(tmp_path: Path, cgroup_base: Path) -> FakeProc:
    """A fake /proc whose mountinfo says systemd's (v2) hierarchy is ``cgroup_base``."""
    fake = FakeProc(tmp_path / "proc")
    fake.write(
        "self/mountinfo",
        f"41 31 0:38 / {cgroup_base} rw,relatime - cgroup2 cgroup2 rw\n",
    )
    return fake


def test_procfs_reads_the_mark_for_processes_in_infrastructure_units(
    fake_host: FakeProc, cgroup_base: Path
) -> None:
    """Root's worker in an unmarked NVIDIA unit is infrastructure; in a marked (delegated) one
    it is an ordinary process; where the mark cannot be read it is never signalled and grants
    nothing; a process in no infrastructure unit is not asked at all."""
    _cgroup(cgroup_base, "system.slice/nvidia-dcgm.service")
    _cgroup(cgroup_base, "system.slice/nvsm-core.service", ("trusted.delegate", b"1"))
    _cgroup(cgroup_base, "system.slice/cron.service")
    units = {
        300: "nvidia-dcgm.service",
        301: "nvsm-core.service",
        302: "nvidia-imex.service",  # no such cgroup: unreadable
        303: "cron.service",
    }
    for pid, unit in units.items():
        fake_host.add(pid, comm="worker", uid=0, cgroup=f"0::/system.slice/{unit}\n")
    procfs = ProcFS(str(fake_host.root))
    facts = {pid: procfs.read_process(pid) for pid in units}
    delegated = {pid: info.cgroup.delegated for pid, info in facts.items() if info and info.cgroup}
    assert delegated == {300: False, 301: True, 302: None, 303: None}
    dcgm, nvsm, imex, cron = (facts[pid] for pid in units)
    assert dcgm is not None
    assert nvsm is not None
    assert imex is not None
    assert cron is not None
    assert infrastructure(dcgm) == "infrastructure unit nvidia-dcgm.service"
    assert infrastructure(nvsm) is None
    assert unverified_infrastructure(nvsm) is None
    assert infrastructure(imex) is None
    assert unverified_infrastructure(imex) is not None
    assert infrastructure(cron) is None
    assert unverified_infrastructure(cron) is None


def _assert_roots_dcgm_worker_unverified(fake: FakeProc) -> None:
    """Root's worker 300 in nvidia-dcgm.service, its delegation mark unknown: not
    infrastructure, only unverified infrastructure."""
    fake.add(300, comm="worker", uid=0, cgroup="0::/system.slice/nvidia-dcgm.service\n")
    info = ProcFS(str(fake.root)).read_process(300)
    assert info is not None
    assert info.cgroup is not None
    assert info.cgroup.delegated is None
    assert infrastructure(info) is None
    assert unverified_infrastructure(info) is not None


def test_without_a_mountinfo_the_mark_is_unknown(tmp_path: Path) -> None:
    _assert_roots_dcgm_worker_unverified(FakeProc(tmp_path / "proc"))


# --- real processes in real cgroups at the hierarchy's top ---------------------------------

USER = 1001
SLEEP = shutil.which("sleep") or "/bin/sleep"


@pytest.fixture
def system_slice() -> Iterator[list[Path]]:
    """``system.slice`` at the top of systemd's hierarchies (the unified one, and
    ``name=systemd`` on a hybrid host), made for this test: skipped where a service manager
    already keeps one (not ours to touch)."""
    v2 = cgroup2_mount()
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        systemd = parse_systemd_mount(handle.read())
    mounts = [Path(m) for m in dict.fromkeys((v2, systemd)) if m is not None]
    if v2 is None or not mounts:
        pytest.skip("needs a cgroup v2 hierarchy")
    if any((m / "system.slice").exists() for m in mounts):
        pytest.skip("a service manager keeps system.slice here")
    made: list[Path] = []
    try:
        for mount in mounts:
            (mount / "system.slice").mkdir()
            made.append(mount / "system.slice")
    except OSError as exc:
        pytest.skip(f"cannot create cgroups: {exc}")
    yield made
    for top in made:
        mount = top.parent
        for path in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if path.is_dir():
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (mount / "cgroup.procs").write_text(pid)
                path.rmdir()
        for pid in (top / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (mount / "cgroup.procs").write_text(pid)
        top.rmdir()


@pytest.fixture
def mps_program() -> Iterator[str]:
    """Root's genuine-looking MPS control daemon: a root-owned program in a root-owned folder."""
    with traversable_folder("gpuwatchd-delegation-") as folder:
        target = folder / "nvidia-cuda-mps-control"
        shutil.copy(SLEEP, target)
        target.chmod(0o755)
        yield str(target)


def _start_in(tops: list[Path], path: str, program: str, uid: int) -> subprocess.Popen[bytes]:
    """Start ``program 600`` as ``uid``, moved into cgroup ``path`` of every hierarchy."""
    argv = [program, "600"]
    if uid:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    child = subprocess.Popen(argv, cwd="/", stdin=subprocess.DEVNULL)
    relative = path.strip("/").removeprefix("system.slice/")
    for top in tops:
        folder = top / relative
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cgroup.procs").write_text(str(child.pid))
    return child


def _facts(pid: int) -> ProcessInfo:
    procfs = ProcFS()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = procfs.read_process(pid)
        if info is not None and info.exe is not None and info.exe.endswith("mps-control"):
            return info
        time.sleep(0.01)
    raise TimeoutError(f"pid {pid} did not exec")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_an_mps_daemon_a_user_starts_in_a_slurm_job_or_a_crontab_is_no_mps_server(
    system_slice: list[Path], mps_program: str
) -> None:
    """Before: root's program run by a user in ``system.slice/slurmstepd.scope/job_*`` was in
    "a system service's cgroup": trusted, and the node went report-only. Root's own daemon in
    its unit is still the MPS server, and so is the user's run of it in the MPS unit, where
    only the unit's manager places it."""
    job = "/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0"
    children = [
        _start_in(system_slice, job, mps_program, USER),
        _start_in(system_slice, "/system.slice/nvidia-mps.service", mps_program, 0),
        _start_in(system_slice, "/system.slice/nvidia-mps.service", mps_program, USER),
        # A crontab job where cron's PAM stack has no pam_systemd.
        _start_in(system_slice, "/system.slice/cron.service", mps_program, USER),
    ]
    try:
        in_job, roots, in_unit, in_cron = (_facts(child.pid) for child in children)
        assert in_cron.cgroup is not None
        assert in_cron.cgroup.systemd_unit == "cron.service"
        assert not mps_server(in_cron)
        assert infrastructure(in_cron) is None
        assert in_job.cgroup is not None
        assert in_job.cgroup.slurm_job == "4242"
        assert (in_job.uid, in_job.exe_trusted) == (USER, True)
        assert not mps_server(in_job)
        assert infrastructure(in_job) is None
        assert unverified_infrastructure(in_job) is None
        assert mps_server(roots)
        assert in_unit.cgroup is not None
        assert in_unit.cgroup.delegated is False
        assert mps_server(in_unit)
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=10)


def test_without_cap_sys_admin_the_mark_is_unknown(fake_host: FakeProc, cgroup_base: Path) -> None:
    """The kernel hides trusted.* from a reader without CAP_SYS_ADMIN: every read would say
    "no mark", so the mark is unknown and root's worker in the DCGM unit only unverified."""
    _cgroup(cgroup_base, "system.slice/nvidia-dcgm.service")
    fake_host.write("self/status", "Name:\tgpuwatchd\nCapEff:\t0000000000080000\n")  # PTRACE
    _assert_roots_dcgm_worker_unverified(fake_host)
