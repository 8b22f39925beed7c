"""The systemd-nspawn container the real-systemd tests boot: paths, the reason those tests skip,
the container handle and its wait helper."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "systemd"
UNIT = "gpuwatchd.service"
CI_DIR = "/srv/ci"  # the host's exchange dir, bind-mounted read-write into the container
TOOLS = ("systemd-nspawn", "nsenter", "dpkg-buildpackage", "lintian", "dh", "systemd-analyze")


def _missing_prerequisite() -> str | None:
    if os.geteuid() != 0:
        return "needs root (boots a container with systemd-nspawn)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if shutil.which("mmdebstrap") is None and shutil.which("debootstrap") is None:
        missing.append("mmdebstrap|debootstrap")
    if missing:
        return f"missing {', '.join(missing)} (run tests/systemd/host-setup.sh)"
    if not Path("/sys/fs/cgroup").is_dir():
        return "no /sys/fs/cgroup"
    return None


_REASON = _missing_prerequisite()


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def wait_for(what: str, check: Callable[[], bool], timeout: float, step: float = 0.2) -> float:
    """Poll ``check`` until true; return the seconds it took, or fail naming ``what``."""
    start = time.monotonic()
    while True:
        if check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


class Container:
    """A booted container: run commands inside, exchange files through ``ci`` (= /srv/ci)."""

    def __init__(self, root: Path, ci: Path, artifacts: Path) -> None:
        self.root = root
        self.ci = ci
        self.artifacts = artifacts
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.leader = 0
        self.cgroups: list[Path] = []

    # -- lifecycle ---------------------------------------------------------------------------
    def boot(self) -> None:
        name = f"gpuwatchd-it-{os.getpid()}"
        hybrid = Path("/sys/fs/cgroup/systemd").is_dir()
        if hybrid:
            bases = [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified")]
        else:
            bases = [Path("/sys/fs/cgroup")]
        # Own cgroup per container: two nspawns started from one cgroup clobber each other.
        self.cgroups = [b / name for b in bases if b.is_dir()]
        for cg in self.cgroups:
            cg.mkdir(exist_ok=True)
        procs = [str(cg / "cgroup.procs") for cg in self.cgroups]

        def enter_cgroup() -> None:
            os.setsid()
            for p in procs:
                Path(p).write_text(str(os.getpid()))

        console = (self.artifacts / "console.log").open("wb")
        self.nspawn = subprocess.Popen(
            [
                "systemd-nspawn",
                f"--directory={self.root}",
                "--boot",
                "--register=no",
                "--keep-unit",
                "--console=read-only",
                "--private-network",
                f"--machine={name}",
                f"--bind={self.ci}:{CI_DIR}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            preexec_fn=enter_cgroup,  # noqa: PLW1509 - only cgroup/session setup, no locks
        )
        console.close()

        def booted() -> bool:
            assert self.nspawn is not None
            if self.nspawn.poll() is not None:
                log = (self.artifacts / "console.log").read_text(errors="replace")
                pytest.fail(f"systemd-nspawn exited {self.nspawn.returncode}:\n{log[-3000:]}")
            if self.leader and not Path(f"/proc/{self.leader}").exists():
                self.leader = 0  # a helper nspawn forks on the way, gone: look again
            if not self.leader:
                kids = subprocess.run(
                    ["pgrep", "-P", str(self.nspawn.pid)],
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout.split()
                # The container's PID 1 is systemd; nspawn's helpers are not.
                inits = [k for k in kids if _comm(int(k)) == "systemd"]
                if not inits:
                    return False
                self.leader = int(inits[0])
            state = self.sh("systemctl is-system-running", check=False).stdout.strip()
            return state in ("running", "degraded")

        wait_for("the container to boot", booted, timeout=60)

    def shutdown(self) -> None:
        """Power off (SIGRTMIN+4 to the container's systemd); kill it if that hangs."""
        nspawn = self.nspawn
        if nspawn is not None and nspawn.poll() is None:
            if self.leader:
                os.kill(self.leader, signal.SIGRTMIN + 4)
            try:
                nspawn.wait(timeout=30)
            except subprocess.TimeoutExpired:
                if self.leader:  # SIGKILL to the container's PID 1 ends its whole namespace
                    os.kill(self.leader, signal.SIGKILL)
                try:
                    nspawn.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    nspawn.kill()
                    nspawn.wait(timeout=10)
        for cg in self.cgroups:
            dirs = sorted(cg.rglob("*"), key=lambda p: len(p.parts), reverse=True)
            for sub in [*dirs, cg]:
                for _ in range(25):
                    try:
                        if sub.is_dir():
                            sub.rmdir()
                        break
                    except OSError:
                        time.sleep(0.2)
                else:
                    print(f"warning: could not remove cgroup {sub}")

    # -- inside ------------------------------------------------------------------------------
    def run(
        self, argv: list[str], *, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["nsenter", "-t", str(self.leader), "-a", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
        )
        if check and proc.returncode != 0:
            pytest.fail(f"{argv} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def sh(self, script: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(["sh", "-c", script], check=check)

    def prop(self, name: str) -> str:
        return self.run(["systemctl", "show", "-p", name, "--value", UNIT]).stdout.strip()

    def journal(self, *extra: str) -> list[dict[str, Any]]:
        out = self.run(["journalctl", "-u", UNIT, "-o", "json", "--no-pager", *extra]).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def messages(self) -> list[str]:
        return [str(e.get("MESSAGE", "")) for e in self.journal()]

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)

    def nvml(self, gpus: list[dict[str, Any]]) -> None:
        """Replace the fake NVML state atomically (the library re-reads it on every call)."""
        tmp = self.ci / "nvml.json.tmp"
        tmp.write_text(json.dumps({"gpus": gpus}))
        os.replace(tmp, self.ci / "nvml.json")
