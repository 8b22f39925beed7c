"""The parts of the real-GPU core-loop test that need no GPU: the CUDA launcher's argument
handling and its clean failures (tests/support/cuda_launcher.py), its fork with inherited device
files under a fake libcuda.so.1 (tests/support/fakecuda.c), and the daemon policy the scenario
writes (tests/support/gpucoreloop.py), accepted by ``check-config``."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.gpucoreloop import (
    LAUNCHER,
    LAUNCHER_NO_CUDA,
    MiB,
    RealGpus,
    build_fakecuda,
    bus_key,
    core_loop_policy,
    launcher_argv,
    rule_pattern,
)

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for fakecuda.c")


def _libcuda_here() -> bool:
    probe = [sys.executable, "-c", "import ctypes; ctypes.CDLL('libcuda.so.1')"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


def launch(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(LAUNCHER), *args],
        capture_output=True, text=True, timeout=timeout, check=False, env=env,
    )  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        [],  # --tag is required
        ["--tag", "a.b"],  # the tag goes into a regex: words only
        ["--tag", "x y"],
        ["--tag", "t" * 65],
        ["--tag", "t", "--mib", "0"],
        ["--tag", "t", "--mib", "65537"],
        ["--tag", "t", "--mib", "lots"],
        ["--tag", "t", "--device", "-1"],
        ["--tag", "t", "--api", "jax"],
        ["--tag", "t", "--lifetime", "0"],
    ],
)
def test_the_launcher_refuses_bad_arguments_with_exit_2(args: list[str]) -> None:
    result = launch(*args)
    assert result.returncode == 2, result
    assert "usage:" in result.stderr
    assert result.stdout == ""


@pytest.mark.skipif(_libcuda_here(), reason="a real libcuda.so.1 is installed here")
def test_without_libcuda_the_launcher_says_so_and_exits_3(tmp_path: Path) -> None:
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    result = launch("--tag", "nolib", env=env)
    assert result.returncode == LAUNCHER_NO_CUDA
    assert "no NVIDIA GPU/driver: libcuda.so.1 not found" in result.stderr
    assert result.stdout == ""


def _fake_env(devices: Path, **extra: str) -> dict[str, str]:
    library = build_fakecuda()
    return {
        **os.environ,
        "LD_LIBRARY_PATH": str(library.parent),
        "FAKECUDA_DEVICES": str(devices),
        **extra,
    }


@needs_cc
@pytest.mark.parametrize(
    ("call", "error", "code", "message"),
    [
        ("cuInit", "100", LAUNCHER_NO_CUDA, "no NVIDIA GPU/driver: cuInit: CUDA_ERROR_NO_DEVICE"),
        ("cuMemAlloc_v2", "2", 4, "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2)"),
        ("cuDevicePrimaryCtxRetain", "999", 4, "cuDevicePrimaryCtxRetain: CUDA_ERROR_UNKNOWN"),
    ],
)
def test_a_failing_cuda_call_is_named_and_no_worker_is_forked(
    tmp_path: Path, call: str, error: str, code: int, message: str
) -> None:
    env = _fake_env(tmp_path, FAKECUDA_FAIL=call, FAKECUDA_ERROR=error)
    result = launch("--tag", "fails", env=env)
    assert result.returncode == code, result
    assert message in result.stderr
    assert result.stdout == ""  # no report: nothing was forked


def _fd_targets(pid: int) -> set[str]:
    folder = Path(f"/proc/{pid}/fd")
    return {os.readlink(folder / fd) for fd in os.listdir(folder)}


@needs_cc
def test_the_worker_inherits_the_device_files_and_the_launcher_reports_both(
    tmp_path: Path,
) -> None:
    devices = tmp_path / "dev"
    devices.mkdir()
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0"):
        (devices / name).write_bytes(b"\0" * 4096)
    launcher = subprocess.Popen(
        [*launcher_argv("forks", mib=3), "--lifetime", "60"],
        stdout=subprocess.PIPE, text=True, env=_fake_env(devices, FAKECUDA_BUS_ID="0000:3b:00.0"),
    )  # fmt: skip
    assert launcher.stdout is not None
    report: dict[str, Any] = json.loads(launcher.stdout.readline())
    worker = report["worker"]
    pidfd = os.pidfd_open(worker)
    try:
        stat = Path(f"/proc/{worker}/stat").read_text()
        assert int(stat[stat.rindex(")") + 2 :].split()[1]) == launcher.pid  # ours, pinned
        assert report["launcher"] == launcher.pid
        assert report["pci_bus_id"] == "0000:3b:00.0"
        assert re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", report["uuid"])
        assert (report["api"], report["mib"], report["device"]) == ("driver", 3, 0)
        held = {str(devices / n) for n in ("nvidiactl", "nvidia-uvm", "nvidia0")}
        assert held <= _fd_targets(launcher.pid)
        assert held <= _fd_targets(worker)  # inherited across the fork
        assert str(devices / "nvidia0") in Path(f"/proc/{worker}/maps").read_text()
        assert os.readlink(f"/proc/{worker}/fd/1") == os.devnull  # not the launcher's pipe
        assert re.search(rule_pattern("forks"), " ".join(launcher_argv("forks", mib=3)))
        cmdline = Path(f"/proc/{worker}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert re.search(rule_pattern("forks"), cmdline)
        assert not re.search(rule_pattern("fork"), cmdline)  # another run's tag never matches
    finally:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os.close(pidfd)
        launcher.kill()
        launcher.wait()


@pytest.mark.parametrize(
    ("devices_dir", "namespace_check"), [("/dev", True), ("/dev", False), ("/tmp/dev", False)]
)
def test_the_core_loop_policy_passes_check_config(
    tmp_path: Path, devices_dir: str, namespace_check: bool
) -> None:
    policy = core_loop_policy(
        tag="gpu123", state_dir=tmp_path / "state", devices_dir=devices_dir,
        namespace_check=namespace_check,
    )  # fmt: skip
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(yaml.safe_dump(policy, sort_keys=False))
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "check-config", str(config)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r["name"] for r in policy["rules"]] == ["core-loop-test"]
    assert policy["dry_run"] is False
    assert policy["reset"]["enabled"] is False
    assert policy["health"]["enabled"] is False


def test_the_real_readings_parse_what_nvidia_smi_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RealGpus reads memory and PIDs through nvidia-smi's CSV (a stand-in prints it here)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "--query-gpu=*) printf '00000000:17:00.0, 1234\\n00000000:3B:00.0, 5\\n' ;;\n"
        "--query-compute-apps=*) printf '4242\\n[N/A]\\n77\\n' ;;\n"
        "esac\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gpus = RealGpus()
    assert gpus.memory() == {"0000:17:00.0": 1234 * MiB, "0000:3b:00.0": 5 * MiB}
    assert gpus.listed() == {4242, 77}
    assert bus_key("0000:3B:00.0") == bus_key("00000000:3b:00.0") == "0000:3b:00.0"
