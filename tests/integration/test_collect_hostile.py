"""Collection on a hostile host: text that fakes lines, a current folder and environment that
try to steer the NVML worker, and a worker that SIGKILL cannot end.

The daemon runs as root and reads text that unprivileged users partly write (cgroup names,
file paths, ``comm``). Every test here is one such attack or failure, and pins that collection
sees through it: lines break at ``\\n`` only; the worker runs isolated (``python -I``, ``/`` as
its folder, an environment built from scratch); a worker stuck in the kernel is the only one
left behind, NVML reads as wedged without blocking, and a new worker starts with backoff once
it is gone. The unkillable worker is made twice: at the subprocess seam (a worker whose SIGKILL
is lost, runs anywhere) and for real (a FUSE file whose FLUSH never returns, root only).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
from structlog.testing import capture_logs

from gpuwatchd.collect.collector import Collector
from gpuwatchd.collect.holders import DeviceFiles, HolderScanner
from gpuwatchd.collect.jobs import cgroup2_mount
from gpuwatchd.collect.nvml import (
    WORKER_FILE,
    NvmlClient,
    library_folders,
    worker_environment,
)
from gpuwatchd.collect.procfs import ProcFS, parse_proc_devices
from gpuwatchd.core.model import (
    FindingKind,
    GpuInfo,
    GpuMemory,
    HolderScan,
    NvmlProcess,
    NvmlReading,
)
from gpuwatchd.core.paths import NVML_LAUNCHER_FILE
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.full_scan import FullScanReason
from gpuwatchd.decide.policy import Detection
from tests.support.fakenvml import FakeNvml, gpu, open_device_files, state
from tests.support.fakeproc import FakeProc, make_devices
from tests.support.simhost import SimHost
from tests.support.unkillable import HangingFuse, Unavailable

LINE_BREAKS = ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
BREAK_IDS = [f"U+{ord(c):04X}" for c in LINE_BREAKS]
USER_SUBTREE = "/user.slice/user-1000.slice/user@1000.service/app.slice"


@pytest.fixture
def clock() -> list[float]:
    """A hand-driven monotonic clock for backoff: ``clock[0]`` is now."""
    return [1000.0]


# --- kernel text split at \n only -------------------------------------------------------------


@pytest.mark.parametrize("brk", LINE_BREAKS, ids=BREAK_IDS)
def test_process_in_a_cgroup_named_to_inject_a_line_keeps_its_own_job(
    fake: FakeProc, brk: str
) -> None:
    path = f"{USER_SUBTREE}/x{brk}0::/system.slice/slurmstepd.scope/job_999/step_0/user/task_0"
    fake.add(300, cgroup=f"0::{path}\n")

    info = ProcFS(str(fake.root)).read_process(300)

    assert info is not None
    assert info.cgroup is not None
    assert info.cgroup.path == path
    assert info.cgroup.slurm_job is None
    assert info.cgroup.job_key != "slurm:999"


@pytest.mark.parametrize("brk", LINE_BREAKS, ids=BREAK_IDS)
def test_comm_with_a_line_break_cannot_fake_a_status_field(fake: FakeProc, brk: str) -> None:
    """``comm`` (15 bytes, the process's own choice) is the ``Name:`` line of status."""
    base = fake.add(310, uid=1000, nspid=(310, 7))
    (base / "status").write_text(
        f"Name:\tx{brk}Uid:\t0\t0\t0\t0{brk}NSpid:\t1\n"
        "Umask:\t0022\nState:\tS\nUid:\t1000\t1000\t1000\t1000\nNSpid:\t310\t7\n"
    )

    info = ProcFS(str(fake.root)).read_process(310)

    assert info is not None
    assert (info.uid, info.nspid) == (1000, (310, 7))


@pytest.mark.parametrize("brk", LINE_BREAKS, ids=BREAK_IDS)
def test_mapped_path_with_a_line_break_cannot_fake_a_device_mapping(
    fake: FakeProc, tmp_path: Path, brk: str
) -> None:
    """The kernel escapes only ``\\n`` in a mapped path; a user may name folders anything."""
    devices = make_devices(tmp_path / "devs", minors=(0,))
    forged = f"7f0000001000-7f0000002000 rw-s 00000000 00:05 77 {devices}/nvidia0"
    fake.add(320, maps=[f"7f0000000000-7f0000001000 rw-s 00000000 00:05 76   /tmp/x{brk}{forged}"])

    scan = ProcFS(str(fake.root), devices_dir=str(devices)).holders.scan()

    assert 320 not in scan.holdings


def test_proc_devices_lines_break_at_newline_only() -> None:
    assert parse_proc_devices("Character devices:\n 10 misc\x1e234 nvidia-uvm\n") == {}


def test_cgroup2_mount_point_with_a_carriage_return_is_read_whole(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_bytes(
        b"30 24 0:26 / /run ro - tmpfs tmpfs ro\n31 30 0:27 / /mnt/cg\rroup rw - cgroup2 none rw\n"
    )
    assert cgroup2_mount(str(mountinfo)) == "/mnt/cg\rroup"


# --- the NVML worker runs isolated -------------------------------------------------------------


def plant_hostile_code(folder: Path, marker: Path) -> None:
    """What a user who can write ``folder`` would leave there for a root ``gpuwatchd``."""
    payload = f"import pathlib\npathlib.Path({str(marker)!r}).write_text(__file__)\n"
    for relative in (
        "gpuwatchd/__init__.py",
        "gpuwatchd/collect/__init__.py",
        "gpuwatchd/collect/nvml_worker.py",
        "pynvml.py",
    ):
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(payload)


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[Path, Path]:
    """(a folder full of hostile modules, the file they write when run)."""
    folder = tmp_path / "hostile"
    marker = tmp_path / "hostile-code-ran"
    plant_hostile_code(folder, marker)
    return folder, marker


def _read_untouched(env: dict[str, str], marker: Path) -> NvmlReading:
    """One read by a worker with ``env``: available, and the hostile code never ran."""
    client = NvmlClient(timeout=5.0, env=env)
    try:
        reading = client.read()
    finally:
        client.stop()

    assert not marker.exists(), f"ran {marker.read_text()}"
    assert reading.available
    return reading


def test_worker_ignores_modules_in_the_current_folder(
    fake_nvml: FakeNvml, hostile: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, marker = hostile
    fake_nvml.write(state([gpu(0)]))
    monkeypatch.chdir(folder)
    reading = _read_untouched(fake_nvml.env(), marker)
    assert len(reading.gpus) == 1


def test_worker_ignores_pythonpath_from_the_environment_and_from_env(
    fake_nvml: FakeNvml, hostile: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, marker = hostile
    fake_nvml.write(state([gpu(0)]))
    monkeypatch.setenv("PYTHONPATH", str(folder))
    _read_untouched({**fake_nvml.env(), "PYTHONPATH": str(folder)}, marker)


def test_worker_runs_isolated_in_the_root_folder_with_only_what_nvml_needs(
    fake_nvml: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvml.write(state([gpu(0)]))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUWATCHD_TEST_SECRET", "not for the worker")
    monkeypatch.setenv("PYTHONSTARTUP", str(tmp_path / "startup.py"))
    client = NvmlClient(timeout=5.0, env=fake_nvml.env())
    try:
        client.read()
        (pid,) = client.worker_pids
        cwd = os.readlink(f"/proc/{pid}/cwd")
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        cmdline = psutil.Process(pid).cmdline()
    finally:
        client.stop()

    names = {entry.split(b"=", 1)[0].decode() for entry in raw.split(b"\0") if entry}
    assert cwd == "/"
    assert names == {"PATH", "LD_LIBRARY_PATH", "FAKENVML_STATE", "FAKENVML_DEVICES_DIR"}
    assert cmdline[1:3] == ["-I", NVML_LAUNCHER_FILE]
    assert WORKER_FILE in cmdline
    assert not any("\n" in arg for arg in cmdline)  # one readable line in systemctl status


@pytest.mark.parametrize(
    ("inherited", "extra", "expected"),
    [
        ({"PATH": "/bin", "HOME": "/root", "LD_PRELOAD": "/x.so"}, {}, {"PATH": "/bin"}),
        ({}, {}, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}),
        ({"FAKENVML_STATE": "/s", "PYTHONPATH": "/h"}, {"PYTHONHOME": "/h", "X": "1"},
         {"FAKENVML_STATE": "/s", "X": "1", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}),
        ({"LD_LIBRARY_PATH": "/a"}, {"LD_LIBRARY_PATH": "/b"},
         {"LD_LIBRARY_PATH": "/b", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}),
    ],
    ids=["drops-the-rest", "default-path", "no-python-variables", "extra-overrides"],
)  # fmt: skip
def test_worker_environment_keeps_only_the_allowed_names(
    inherited: dict[str, str], extra: dict[str, str], expected: dict[str, str]
) -> None:
    assert worker_environment(inherited, extra) == expected


def test_library_folder_is_never_the_current_folder_or_a_relative_entry(tmp_path: Path) -> None:
    here, vendor, site = tmp_path / "here", tmp_path / "vendor", tmp_path / "site"
    for folder in (here, vendor, site):
        folder.mkdir()
        (folder / "pynvml.py").write_text("")
    # python -m puts the current folder first; an empty PYTHONPATH element adds it again.
    path = [str(here), "", ".", "here", str(here), str(tmp_path / "empty"), str(vendor), str(site)]

    assert library_folders(path, cwd=str(here)) == [str(vendor)]
    assert library_folders([str(here)], cwd=str(here)) == []


def test_scan_from_a_hostile_folder_does_not_run_its_code(
    tmp_path: Path, hostile: tuple[Path, Path]
) -> None:
    """The attack as an admin would meet it: ``gpuwatchd scan`` (the installed script) run as
    root from a folder another user can write."""
    folder, marker = hostile
    script = Path(sys.executable).with_name("gpuwatchd")
    if not script.exists():
        pytest.skip(f"no installed console script at {script}")
    with SimHost(tmp_path / "host") as host:
        host.nvml([gpu(0)])
        result = host.run(
            [str(script), "scan", "--json", "--config", str(host.config())], cwd=folder
        )

    assert not marker.exists(), f"ran {marker.read_text()}"
    assert result.returncode in (0, 77), result.stderr


def test_worker_finds_pynvml_in_a_vendor_folder_as_the_debian_launcher_sets_it(
    fake_nvml: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The .deb vendors pynvml in /usr/lib/gpuwatchd/vendor and puts it on the launcher's
    sys.path; the isolated worker must be given that folder (PYTHONPATH no longer reaches it)."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    if sys.prefix == sys.base_prefix or not base.exists():
        pytest.skip("needs a base interpreter without this virtualenv's packages")
    probe = subprocess.run(
        [str(base), "-I", "-c", "import pynvml"], capture_output=True, check=False
    )
    if probe.returncode == 0:
        pytest.skip(f"{base} has pynvml of its own")
    spec = importlib.util.find_spec("pynvml")
    assert spec is not None
    assert spec.origin is not None
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    shutil.copy(spec.origin, vendor / "pynvml.py")
    monkeypatch.syspath_prepend(str(vendor))  # what the launcher's sys.path.insert does
    fake_nvml.write(state([gpu(0)]))
    client = NvmlClient(timeout=10.0, env=fake_nvml.env(), python=str(base))
    try:
        reading = client.read()
    finally:
        client.stop()

    assert reading.available, reading.error
    assert len(reading.gpus) == 1


# --- a worker that SIGKILL cannot end ----------------------------------------------------------


class _LostKill(subprocess.Popen[bytes]):
    """A real worker whose SIGKILL never arrives: what the client sees of a process stuck in
    the driver (D state), which keeps living after SIGKILL until its kernel call returns."""

    def send_signal(self, sig: int) -> None:
        if sig != signal.SIGKILL:
            super().send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Spawner:
    """The client's ``spawn``: unkillable workers while ``unkillable`` is set, normal ones after."""

    def __init__(self) -> None:
        self.unkillable = True
        self.started: list[subprocess.Popen[bytes]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        kind = _LostKill if self.unkillable else subprocess.Popen
        proc = kind(*args, **kwargs)
        self.started.append(proc)
        return proc

    def end_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)  # our own child, for real
                proc.wait(timeout=10)


@pytest.fixture
def spawner() -> Iterator[Spawner]:
    spawner = Spawner()
    yield spawner
    spawner.end_all()


def _events(logs: Sequence[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == name]


def _timed_read(client: NvmlClient) -> tuple[NvmlReading, float, list[MutableMapping[str, Any]]]:
    """One read, the seconds it took, and what it logged."""
    with capture_logs() as logs:
        started = time.monotonic()
        reading = client.read()
        took = time.monotonic() - started
    return reading, took, logs


def test_worker_surviving_sigkill_is_the_only_one_left_and_a_new_one_starts_after_it(
    fake_nvml: FakeNvml, clock: list[float], spawner: Spawner
) -> None:
    fake_nvml.write(state([gpu(0)], delays={"nvmlDeviceGetComputeRunningProcesses_v3": 60.0}))
    client = NvmlClient(
        timeout=1.0,
        env=fake_nvml.env(),
        clock=lambda: clock[0],
        backoff_initial=5.0,
        spawn=spawner,
    )
    try:
        wedged, took, logs = _timed_read(client)
        assert wedged.wedged
        assert wedged.available
        assert took < 2.0  # the deadline plus the reaping grace, never the 60 s hang
        (hung,) = spawner.started
        assert client.worker_pids == {hung.pid}
        assert hung.poll() is None
        assert [e["log_level"] for e in _events(logs, EventName.NVML_WORKER_HUNG)] == ["critical"]
        assert open_device_files(hung.pid, fake_nvml.devices_dir) == {"nvidiactl", "nvidia0"}

        # Past the backoff, and still no second worker while the hung one lives.
        clock[0] += 10.0
        started = time.monotonic()
        again = client.read()
        assert time.monotonic() - started < 0.2
        assert again.wedged
        assert again.error is not None
        assert f"pid {hung.pid}" in again.error
        assert len(spawner.started) == 1
        assert client.worker_pids == {hung.pid}
        assert client.stop() is False  # it still holds the device files: no reset now

        # The kernel call returns at last and the worker dies: the next poll starts afresh.
        spawner.unkillable = False
        fake_nvml.write(state([gpu(0)]))
        os.kill(hung.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while psutil.Process(hung.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with capture_logs() as logs:
            recovered = client.read()
        assert recovered.available
        assert not recovered.wedged
        assert len(spawner.started) == 2
        assert client.worker_pids == {spawner.started[1].pid}
        assert _events(logs, EventName.NVML_HUNG_WORKER_EXITED)
    finally:
        client.stop()


def _state_of(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@pytest.mark.root
@pytest.mark.slow
def test_worker_stuck_in_the_kernel_for_real_reads_wedged_and_is_replaced_after_backoff(
    fake_nvml: FakeNvml, clock: list[float], tmp_path: Path, hanging_fuse: HangingFuse
) -> None:
    """A real unkillable worker: it holds a file whose close never completes, so SIGKILL leaves
    it in state D. Until it is gone no worker starts; then one does, once the backoff is over."""
    starts = tmp_path / "starts"
    recovered_flag = tmp_path / "driver-recovered"
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\n"
        f'echo "$$" >> "{starts}"\n'
        f'if [ -e "{recovered_flag}" ]; then exec "{sys.executable}" "$@"; fi\n'
        f'exec 3<"{hanging_fuse.file}"\n'
        "exec sleep 3600\n"
    )
    python.chmod(0o755)
    fake_nvml.write(state([gpu(0)]))
    client = NvmlClient(
        timeout=2.0,
        env=fake_nvml.env(),
        python=str(python),
        clock=lambda: clock[0],
        backoff_initial=5.0,
    )
    try:
        wedged, took, logs = _timed_read(client)
        assert wedged.wedged
        assert took < 3.0
        (pid,) = client.worker_pids
        assert _state_of(pid) == "D"
        assert hanging_fuse.flushes >= 1
        assert _events(logs, EventName.NVML_WORKER_HUNG)

        clock[0] += 1.0  # within the backoff
        started = time.monotonic()
        assert client.read().wedged
        assert time.monotonic() - started < 0.2
        assert client.worker_pids == {pid}

        hanging_fuse.release()  # the kernel call returns; the worker finishes dying
        deadline = time.monotonic() + 10
        while client.worker_pids:
            assert time.monotonic() < deadline, f"pid {pid} still {_state_of(pid)}"
            time.sleep(0.05)
        recovered_flag.touch()
        clock[0] += 1.0  # gone, but the backoff (5 s from the wedge) is not over
        assert client.read().wedged
        assert starts.read_text().split() == [str(pid)]

        clock[0] += 4.0
        recovered = client.read()
        assert recovered.available, recovered.error
        assert len(starts.read_text().split()) == 2
    finally:
        client.stop()


# --- a process whose stat cannot be read is alive, its facts unknown ---------------------------


class _Listed:
    """An NVML source that lists ``pids`` on GPU 0 (minor 0) holding 2 GiB."""

    worker_pids: frozenset[int] = frozenset()

    def __init__(self, *pids: int) -> None:
        listed = tuple(NvmlProcess(pid, 1 << 30, "compute") for pid in pids)
        memory = GpuMemory(total=80 << 30, free=78 << 30, reserved=0, allocated=2 << 30)
        gpu = GpuInfo(0, "GPU-0", minor=0, memory=memory, processes=listed, mig_enabled=False)
        self.reading = NvmlReading(available=True, gpus=(gpu,))

    def read(self) -> NvmlReading:
        return self.reading


@pytest.mark.root
def test_a_file_named_like_a_device_on_a_file_system_that_never_answers_stalls_no_scan(
    tmp_path: Path,
) -> None:
    """A user holds a file whose path says ``nvidia`` on a file system that stops answering (a
    FUSE server of theirs mounted ``allow_other``, a hung NFS home): the scan learns it is no
    device from the attributes the kernel has, and never waits on that file system."""
    try:
        fuse = HangingFuse(tmp_path / "nvidia-data").start()
    except Unavailable as why:
        pytest.skip(f"no FUSE: {why}")
    holder = subprocess.Popen(["/bin/sh", "-c", f'exec 3<"{fuse.file}"; exec sleep 600'])
    found: list[object] = []
    try:
        deadline = time.monotonic() + 10
        while not any(os.readlink(f"/proc/{holder.pid}/fd/{fd}") == str(fuse.file)
                      for fd in os.listdir(f"/proc/{holder.pid}/fd")):  # fmt: skip
            assert time.monotonic() < deadline
            time.sleep(0.01)
        fuse.hang_getattr = True
        scan = threading.Thread(
            target=lambda: found.append(ProcFS().holders.scan([holder.pid])), daemon=True
        )
        scan.start()
        scan.join(timeout=5)
        assert not scan.is_alive(), "the scan waits on the FUSE server"
    finally:
        fuse.close()  # aborts the connection: a scan still waiting ends
        holder.kill()
        holder.wait(timeout=10)
    assert found == [HolderScan(mode="targeted")]


def test_a_program_or_mapping_on_a_file_system_that_never_answers_stalls_no_look_up(
    fake: FakeProc, tmp_path: Path
) -> None:
    """The same file system (a FUSE server that answers no stat) under the two other looks at
    a file by path: ``exe_trusted`` (a process named like infrastructure runs a program from
    it) and a mapping's ``/proc/PID/root`` fallback (``map_files`` unreadable)."""
    try:
        fuse = HangingFuse(tmp_path / "nvidia-data").start()
    except Unavailable as why:
        pytest.skip(f"no FUSE: {why}")
    fake.add(800, exe=str(fuse.file))
    fake.set_root_link(800, "/")
    fake.add_mapping(800, str(fuse.file), inode=2)  # the server's inode of its file
    procfs = ProcFS(str(fake.root))
    holders = HolderScanner(procfs, DeviceFiles(procfs, match_by_path=False, device_major=1))
    found: list[object] = []
    try:
        fuse.hang_getattr = True
        look = threading.Thread(
            target=lambda: found.extend([procfs.exe_trusted(800, str(fuse.file)), holders.scan()]),
            daemon=True,
        )
        look.start()
        look.join(timeout=5)
        assert not look.is_alive(), "the look-up waits on the FUSE server"
    finally:
        fuse.close()  # aborts the connection: a look-up still waiting ends
    assert found == [True, HolderScan(mode="full")]  # root's file in root's folder; no device


def test_a_listed_owner_whose_stat_fails_to_read_is_not_dead_and_its_worker_no_orphan(
    fake: FakeProc, tmp_path: Path
) -> None:
    """An error reading ``/proc/PID/stat`` other than "no such process" (EACCES, EMFILE, EIO;
    EISDIR here) says nothing of whether the process lives. A live trainer read that way must
    not become a dead listed PID (``dead_process``), nor its DataLoader worker an orphan with a
    dead owner: at a poll that remembered its facts, nor at one that reads them afresh."""
    devices = make_devices(tmp_path / "devs")
    fake.add(600, fds={3: f"{devices}/nvidia0", 4: f"{devices}/nvidia-uvm"})
    fake.add(601, ppid=600, pgrp=600, session=600, fds={3: f"{devices}/nvidia0"})
    fake.add_mapping(601, f"{devices}/nvidia-uvm")
    procfs = ProcFS(str(fake.root), devices_dir=str(devices))
    collector = Collector(procfs, _Listed(600), namespace_check=False)
    state = AssessState(boot_id=None)
    first = collector.collect(full=True)
    assert first.processes[600].start_ticks == 1000
    state = assess(first, state, Detection()).state
    stat = fake.root / "600" / "stat"
    stat.unlink()
    stat.mkdir()  # its reads now fail with EISDIR
    for full in (False, True):
        snapshot = collector.collect(full=full)
        assert snapshot.processes[600].identity is None  # alive, facts unknown
        # Not taken for a newly dead listed PID, even for a moment: no walk of /proc for one.
        assert collector.last_scan_reason is (FullScanReason.FORCED if full else None)
        result = assess(snapshot, state, Detection())
        kinds = {(f.kind, f.pid) for f in result.findings}
        assert (FindingKind.DEAD_PROCESS, 600) not in kinds
        assert (FindingKind.ORPHANED, 601) not in kinds
