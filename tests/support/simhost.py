"""A simulated GPU host for end-to-end tests and the demo: fake NVML plus real processes.

Owns: a temporary devices folder, the fake NVML state, scripted actor processes
(``tests/support/actor.py``) that hold the fake device files the way CUDA jobs do, a policy file
pointing the daemon at all of that, and running the real ``gpuwatchd`` command against it.

End-to-end tests run inside their own PID namespace (docs/architecture.md, testing without a GPU),
so a bug in the daemon can only reach the test's own processes: :func:`run_in_pid_namespace`
re-executes a function of a test module as PID 1 of a fresh namespace (``unshare --pid --fork
--mount-proc``) and returns what it returned. Inside, actors are this module's children; orphans are
re-parented to it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import fakenvml, proclock
from tests.support.fakenvml import FakeNvml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEVICE_FILE_SIZE = 4096  # room for one mapped page, as actors map device files


class SimHost:
    """One simulated host under ``root``. Call :meth:`close` (or use ``with``) to clean up."""

    def __init__(self, root: Path, *, gpus: int = 1) -> None:
        self.root = Path(root)
        self.devices_dir = self.root / "dev"
        self.ready_dir = self.root / "ready"
        self.state_dir = self.root / "state"
        for folder in (self.devices_dir, self.ready_dir, self.state_dir):
            folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        for name in ["nvidiactl", "nvidia-uvm", *(f"nvidia{i}" for i in range(gpus))]:
            self.make_device(name)
        self.fake = FakeNvml(self.root, devices_dir=self.devices_dir)
        self.children: list[int] = []
        self.pids: dict[str, int] = {}

    def __enter__(self) -> SimHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def make_device(self, name: str) -> Path:
        path = self.devices_dir / name
        if not path.exists():
            with open(path, "wb") as handle:
                handle.write(b"\0" * DEVICE_FILE_SIZE)
        return path

    def dev(self, *names: str) -> list[str]:
        """Paths of device files by short name: ``dev("nvidia0", "nvidiactl")``."""
        return [str(self.make_device(name)) for name in names]

    def cuda(self, minor: int) -> list[str]:
        """The device files a CUDA process on GPU ``minor`` holds: ctl, uvm and the GPU node."""
        return self.dev("nvidiactl", "nvidia-uvm", f"nvidia{minor}")

    # --- processes ------------------------------------------------------------------------

    def script(self, name: str, steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return {"name": name, "ready_dir": str(self.ready_dir), "steps": list(steps)}

    def spawn(self, name: str, steps: Sequence[Mapping[str, Any]]) -> None:
        """Start an actor (a child of this process) running ``steps``."""
        argv = [sys.executable, "-m", "tests.support.actor", json.dumps(self.script(name, steps))]
        env = dict(os.environ)
        env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
        pid = os.posix_spawn(sys.executable, argv, env)
        self.children.append(pid)

    def spawn_stuck(self, name: str, files: Sequence[str]) -> None:
        """Start a process that holds ``files`` and then sleeps uninterruptibly (state D)."""
        binary = str(fakenvml.ensure_built().parent / "dstate")
        ready = str(self.ready_dir / name)
        self.children.append(os.posix_spawn(binary, [binary, ready, *files], dict(os.environ)))

    def wait_state(self, name: str, state: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.state_of(self.pids[name]) != state:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} never reached state {state}")
            time.sleep(0.01)

    def wait_ready(self, *names: str, timeout: float = 20.0) -> dict[str, int]:
        """Wait until the named actors have announced their PIDs; returns all known PIDs."""
        deadline = time.monotonic() + timeout
        while True:
            missing = [n for n in names if not (self.ready_dir / n).exists()]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"actors not ready: {missing}")
            time.sleep(0.01)
        for name in names:
            self.pids[name] = int((self.ready_dir / name).read_text())
        return dict(self.pids)

    def wait_gone(self, *names: str, timeout: float = 10.0) -> None:
        """Wait until the named actors have exited, reaping whatever this process may reap."""
        deadline = time.monotonic() + timeout
        while any(self.state_of(self.pids[n]) is not None for n in names):
            self.reap()
            if time.monotonic() > deadline:
                raise TimeoutError(f"actors still alive: {names}")
            time.sleep(0.01)

    def reap(self) -> None:
        """Reap every exited child (including orphans re-parented to us as namespace init)."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    @staticmethod
    def alive(pid: int) -> bool:
        """True while ``pid`` exists and is not a zombie."""
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
                text = handle.read()
        except OSError:
            return False
        return text[text.rindex(")") + 2] != "Z"

    @staticmethod
    def state_of(pid: int) -> str | None:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
                text = handle.read()
        except OSError:
            return None
        return text[text.rindex(")") + 2]

    def close(self) -> None:
        for name, pid in self.pids.items():
            del name
            if self.alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
        self.reap()

    def free_when_gone(
        self, names: Sequence[str], gpus: Sequence[Mapping[str, Any]], *, delay: float = 0.0
    ) -> threading.Thread:
        """Play the driver: once every named actor is dead (a zombie counts, it holds nothing),
        wait ``delay`` seconds — a real driver takes a moment to tear a context down, and NVML
        keeps listing the dead owner with its memory meanwhile — then make ``gpus`` the NVML
        state. Runs in a thread; never reaps (the main thread's subprocesses keep their own
        children's exit status)."""

        def run() -> None:
            deadline = time.monotonic() + 120
            while any(self.alive(self.pids[n]) for n in names) and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(delay)
            self.nvml(gpus)

        thread = threading.Thread(target=run, name="fake-driver", daemon=True)
        thread.start()
        return thread

    # --- NVML and policy ------------------------------------------------------------------

    def nvml(self, gpus: Sequence[Mapping[str, Any]], **over: Any) -> None:
        self.fake.write(fakenvml.state(gpus, **over))

    def no_reset_command(self) -> str:
        """A stand-in for nvidia-smi that only records its argv and fails: the default here,
        so that no test can ever reach a real ``nvidia-smi --gpu-reset``."""
        path = self.root / "refuse-nvidia-smi"
        if not path.exists():
            log = self.root / "refused-calls.log"
            path.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\necho "fake: refused" >&2\nexit 1\n')
            path.chmod(0o755)
        return str(path)

    def config(self, **overrides: Any) -> Path:
        """Write a policy pointing at this host; ``overrides`` are top-level YAML keys.

        Unless a test gives its own ``reset`` section, every command the reset procedure could
        run (a MIG instance's recovery too) points at :meth:`no_reset_command`.
        """
        fake = self.no_reset_command()
        policy: dict[str, Any] = {
            "interval": "200ms",
            "dry_run": True,
            "state_dir": str(self.state_dir),
            "devices_dir": str(self.devices_dir),
            "nvml_timeout": "5s",
            "namespace_check": False,
            "reset": {
                "command": [fake, "--gpu-reset", "-i", "{uuid}"],
                "persistence_command": [fake, "-pm", "{mode}", "-i", "{uuid}"],
                "health_command": [fake, "-q", "-i", "{uuid}"],
                "mig_recovery_commands": [[fake, "mig", "-i", "{uuid}", "-gi", "{gi}", "-dgi"]],
            },
        }
        policy.update(overrides)
        # The kernel log is this host's file (kernel_xid writes it), never the machine's journal.
        health = policy.setdefault("health", {})
        if isinstance(health, dict):
            health.setdefault("kernel_log", str(self.kmsg))
        path = self.root / "gpuwatchd.yaml"
        path.write_text(yaml.safe_dump(policy, sort_keys=False))
        return path

    @property
    def kmsg(self) -> Path:
        """The host's kernel log: a file in /dev/kmsg's format (health.kernel_log)."""
        path = self.root / "kmsg"
        path.touch()
        return path

    def kernel_xid(
        self, gpu_index: int, xid: int, rest: str = "", *, ago: float = 0.0, count: int = 1
    ) -> None:
        """Log ``count`` NVIDIA Xid lines for the fake GPU ``gpu_index`` (its PCI address as the
        kernel prints it), stamped ``ago`` seconds ago on the kernel's clock."""
        usec = int((time.clock_gettime(time.CLOCK_MONOTONIC) - ago) * 1e6)
        pci = f"0000:{0x18 + 0x10 * gpu_index:02x}:00"  # fakenvml.gpu's bus id
        tail = f", {rest}" if rest else ""
        with self.kmsg.open("a") as log:
            log.write(f"3,1,{usec},-;NVRM: Xid (PCI:{pci}): {xid}{tail}\n" * count)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.fake.env())
        env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
        env.pop("NOTIFY_SOCKET", None)
        env.pop("JOURNAL_STREAM", None)
        return env

    # Every command and daemon here walks the machine's whole /proc unless it runs in a PID
    # namespace of its own: it holds tests/support/proclock.py's lock shared, so that no test
    # making processes such a walk must report (``proc_alone``) runs on another worker meanwhile.

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        check: bool = False,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` to its end in this host's environment (or ``env``), output captured."""
        with proclock.shared():
            return subprocess.run(
                list(argv),
                env=self.env() if env is None else dict(env),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=check,
                **kwargs,
            )

    def popen(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[str]:
        """Start ``argv`` in this host's environment (or ``env``); it inherits the shared lock's
        fd and so holds the lock until it exits."""
        with proclock.shared() as fd:
            passed = (*kwargs.pop("pass_fds", ()), *(() if fd is None else (fd,)))
            child = subprocess.Popen(
                list(argv),
                env=self.env() if env is None else dict(env),
                text=True,
                pass_fds=passed,
                **kwargs,
            )
        if fd is not None:
            proclock.note_child(child)
        return child

    def gpuwatchd(
        self, *args: str, timeout: float = 60.0, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Run the real command line (``python -m gpuwatchd``) against this host."""
        return self.run([sys.executable, "-m", "gpuwatchd", *args], timeout=timeout, check=check)

    def start_daemon(self, *args: str) -> subprocess.Popen[str]:
        return self.popen(
            [sys.executable, "-m", "gpuwatchd", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def scan_json(self, config: Path | None = None) -> dict[str, Any]:
        result = self.gpuwatchd("scan", "--json", "--config", str(config or self.config()))
        if result.returncode not in (0, 77):
            raise AssertionError(f"scan failed ({result.returncode}): {result.stderr}")
        data: dict[str, Any] = json.loads(result.stdout)
        return data


# --- PID namespaces ---------------------------------------------------------------------------


def pid_namespace_command() -> list[str] | None:
    """The unshare prefix that gives a fresh PID namespace here, or None when none works."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    candidates = [[unshare, "--pid", "--fork", "--mount-proc", "--kill-child"]]
    if os.geteuid() != 0:
        candidates = [[unshare, "--user", "--map-root-user", *candidates[0][1:]]]
    for prefix in candidates:
        probe = subprocess.run([*prefix, "true"], capture_output=True, check=False)
        if probe.returncode == 0:
            return prefix
    return None


def needs_pid_namespace() -> pytest.MarkDecorator:
    """The mark that skips a test where ``pid_namespace_command`` finds no way to make one."""
    return pytest.mark.skipif(
        pid_namespace_command() is None,
        reason="needs a PID namespace (root, or unprivileged user namespaces)",
    )


def run_in_pid_namespace(
    target: str,
    arg: Mapping[str, Any],
    *,
    root: Path,
    timeout: float = 120.0,
    stream: bool = False,
) -> dict[str, Any]:
    """Run ``module:function(arg, root)`` as PID 1 of a new PID namespace; return its result.

    The function gets a :class:`SimHost`-friendly root folder and returns a JSON-able dict.
    ``stream`` lets its output through to ours (for the demo) instead of capturing it.
    Its exceptions come back as an AssertionError carrying the inner traceback.
    """
    prefix = pid_namespace_command()
    if prefix is None:
        raise RuntimeError("no PID namespace available (needs root or user namespaces)")
    out = root / "result.json"
    env = dict(os.environ)
    env.pop(proclock.ENV, None)  # inside, /proc holds only the test's own processes: no lock
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        [
            *prefix,
            sys.executable,
            "-m",
            "tests.support.simhost",
            target,
            json.dumps(dict(arg)),
            str(root),
            str(out),
        ],
        env=env,
        capture_output=not stream,
        text=True,
        timeout=timeout,
        check=False,
    )
    if not out.exists():
        raise AssertionError(
            f"{target} produced no result (exit {proc.returncode})\n{proc.stdout}\n{proc.stderr}"
        )
    result: dict[str, Any] = json.loads(out.read_text())
    if "__error__" in result:
        raise AssertionError(f"{target} failed inside the namespace:\n{result['__error__']}")
    return result


def _namespace_main(target: str, arg_json: str, root: str, out: str) -> None:
    import traceback

    module_name, _, func_name = target.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        result = func(json.loads(arg_json), Path(root))
    except BaseException:  # report everything to the outer test
        result = {"__error__": traceback.format_exc()}
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    _namespace_main(*sys.argv[1:5])
