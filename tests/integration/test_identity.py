"""Who a process is, from facts a user cannot forge (collect/procfs.py, decide/floor.py).

Real processes of this test, started as root and as an unprivileged user (uid 1001, through
``setpriv``): a program a user named like the NVIDIA infrastructure, argv[0] set to
``nvidia-cuda-mps-server``, copies of a program in folders a user can write. Only root's
program, in root's folder, run by root or a system service, is infrastructure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.model import ProcessInfo
from gpuwatchd.decide.floor import (
    infrastructure,
    mps_server,
    trusted_identity,
    unverified_infrastructure,
)
from tests.support.folders import traversable_folder

USER = 1001
SLEEP = shutil.which("sleep") or "/bin/sleep"
BASH = shutil.which("bash") or "/bin/bash"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files and run as uid 1001"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)"),
]

Start = Callable[..., ProcessInfo]


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder every user may traverse (pytest's own are root's, mode 0700)."""
    with traversable_folder("gpuwatchd-identity-") as path:
        yield path


@pytest.fixture
def start() -> Iterator[Start]:
    """Start ``program`` (argv[0] ``argv0``) as root or as uid 1001; its facts once it runs.
    Runs: its command line is the one asked, which the kernel sets after comm and a set-user-ID
    program's credentials (a reading in between has an empty one: no argv[0] claim, no owner
    read). Then read afresh: a reading begun earlier may have read ``status`` before setpriv
    dropped to uid 1001."""
    children: list[subprocess.Popen[bytes]] = []
    procfs = ProcFS()

    def run(program: str, *, argv0: str | None = None, uid: int = 0) -> ProcessInfo:
        shell = 'exec -a "$1" "$2" 600'
        argv = [BASH, "-c", shell, "bash", argv0 or program, program]
        if uid:
            argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
        child = subprocess.Popen(argv, cwd="/", stdin=subprocess.DEVNULL)
        children.append(child)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            info = procfs.read_process(child.pid)
            if info is not None and info.cmdline == (argv0 or program, "600"):
                settled = procfs.read_process(child.pid)
                assert settled is not None
                return settled
            time.sleep(0.01)
        raise TimeoutError(f"{program} did not start")

    yield run
    for child in children:
        child.kill()
        child.wait(timeout=10)


def _copy(folder: Path, name: str, *, owner: int = 0, mode: int = 0o755) -> str:
    folder.mkdir(mode=mode, exist_ok=True)
    folder.chmod(mode)
    os.chown(folder, owner, owner)
    target = folder / name
    shutil.copy(SLEEP, target)
    os.chown(target, owner, owner)
    target.chmod(0o755)
    return str(target)


def test_roots_program_in_roots_folder_run_by_root_is_infrastructure(
    folder: Path, start: Start
) -> None:
    info = start(_copy(folder / "sbin", "nv-hostengine"))
    assert info.exe_trusted is True
    assert trusted_identity(info) is True
    assert "nv-hostengine" in str(infrastructure(info))


def test_roots_program_run_by_a_user_in_no_system_service_is_an_ordinary_process(
    folder: Path, start: Start
) -> None:
    info = start(_copy(folder / "sbin", "nv-hostengine"), uid=USER)
    assert (info.uid, info.exe_trusted) == (USER, True)
    assert infrastructure(info) is None
    assert unverified_infrastructure(info) is None


@pytest.mark.parametrize(
    ("owner", "mode", "why"),
    [
        (USER, 0o755, "a user's own copy"),
        (0, 0o1777, "root's file in a folder anyone may write (like /tmp)"),
        (0, 0o775, "root's file in a group-writable folder"),
    ],
)
def test_a_program_a_user_could_have_placed_is_not_trusted_whoever_runs_it(
    folder: Path, start: Start, owner: int, mode: int, why: str
) -> None:
    program = _copy(folder / "bin", "nvidia-cuda-mps-server", owner=owner, mode=mode)
    for uid in (0, USER):
        info = start(program, uid=uid)
        assert info.exe_trusted is False, why
        assert infrastructure(info) is None, why
        assert not mps_server(info), why


def test_a_deleted_program_is_not_trusted(folder: Path, start: Start) -> None:
    program = _copy(folder / "sbin", "nvidia-persistenced")
    path = Path(program)
    running = start(program)
    assert running.exe_trusted is True
    path.unlink()
    info = ProcFS().read_process(running.pid)
    assert info is not None
    assert str(info.exe).endswith(" (deleted)")
    assert info.exe_trusted is False
    assert infrastructure(info) is None


def test_argv0_claiming_the_mps_server_grants_nothing(start: Start) -> None:
    """The attack of issue 20: argv[0] `nvidia-cuda-mps-server`, run by a user, made every
    finding on the node report-only."""
    info = start(SLEEP, argv0="nvidia-cuda-mps-server", uid=USER)
    assert info.cmdline is not None
    assert info.cmdline[0] == "nvidia-cuda-mps-server"
    assert "nvidia-cuda-mps-server" in info.names
    assert not mps_server(info)
    assert infrastructure(info) is None
    assert unverified_infrastructure(info) is None  # known to be sleep: a possible target


def test_a_set_user_id_root_program_run_by_a_user_is_the_users(folder: Path, start: Start) -> None:
    """A user runs root's set-user-ID program (``passwd``, ``su``: effective uid 0, waiting for
    input) with argv[0] ``nvidia-cuda-mps-server``: argv[0] is still the user's word, so the
    process is the user's (its real uid), never root's MPS server making the node report-only."""
    program = _copy(folder / "bin", "passwd")
    os.chmod(program, 0o4755)  # noqa: S103 - set-user-ID root: the point of the test
    info = start(program, argv0="nvidia-cuda-mps-server", uid=USER)
    assert (info.uid, info.exe_trusted) == (USER, True)
    assert not mps_server(info)
    assert infrastructure(info) is None
    assert unverified_infrastructure(info) is None


def test_exe_ownership_is_read_only_for_processes_that_claim_an_infrastructure_name(
    start: Start,
) -> None:
    plain = start(SLEEP, uid=USER)
    assert plain.exe_trusted is None  # not asked: its names claim nothing
