"""The core loop on a GPU, as one scenario: a daemon in enforce mode watches a CUDA job, the
job's launcher dies, the daemon finds the forked worker ``orphaned`` and signals it, and the
GPU's memory comes back.

``tests/system/test_gpu.py`` runs :func:`core_loop` on the real driver (``RealGpus``: the real
``/dev``, the real NVML, ``nvidia-smi`` queries for memory); ``tests/system/test_core_loop_fake.py``
runs the very same code on the fake host (``FakeGpus``: the fake NVML, ``fakecuda.c`` as
``libcuda.so.1``), so every part that needs no GPU is exercised on every machine.

Safety (docs/design-notes.md, "The core loop on a real GPU"): the daemon's only rule matches
this run's own launcher by a tag in its command line; resets and health actions are off and
every reset command is ``false``; the node may signal at most two processes an hour. The
scenario signals only the launcher it started and the worker that launcher forked (identity
pinned with a pidfd while the launcher still lives). Run inside a PID namespace of its own
(:func:`tests.support.simhost.run_in_pid_namespace`) where the driver reports PIDs as the
namespace sees them; :func:`core_loop` says when it does not (``namespace_unusable``).

The scenario records what happened (timings, events, memory) and asserts nothing: the tests
judge the record, and on a real GPU it is written to ``$OUT`` for docs/design-notes.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from gpuwatchd.core.vocabulary import EventName

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = Path(__file__).with_name("cuda_launcher.py")
FAKECUDA_SOURCE = Path(__file__).with_name("fakecuda.c")
FAKECUDA_DIR = REPO_ROOT / "tests" / "fakenvml" / "build" / "fakecuda"
MiB = 1024 * 1024
LAUNCH_MIB = 1024
MEMORY_SLACK = 64 * MiB  # what may move on an idle GPU between two reads
POLL = 0.1
# Seconds each phase may take at most (the test's bounded time).
BOUNDS = {"daemon": 60.0, "launch": 120.0, "watched": 30.0, "signalled": 30.0, "freed": 30.0}
# Exit codes of cuda_launcher.py.
LAUNCHER_NO_CUDA = 3


def rule_pattern(tag: str) -> str:
    """The only rule's command filter: this run's launcher (and its forked worker) alone."""
    return rf"cuda_launcher\.py --tag {tag} "


def core_loop_policy(
    *, tag: str, state_dir: Path, devices_dir: str, namespace_check: bool
) -> dict[str, Any]:
    """The daemon's policy for the scenario (checked by ``check-config`` where no GPU is)."""
    false = shutil.which("false") or "/bin/false"
    return {
        "interval": "500ms",
        "dry_run": False,
        "state_dir": str(state_dir),
        "devices_dir": devices_dir,
        "namespace_check": namespace_check,
        "log": {"format": "json"},
        "rules": [
            {
                "name": "core-loop-test",
                "kind": "orphaned",
                "for": "0s",
                "commands": [rule_pattern(tag)],
                "steps": [{"signal": "SIGTERM", "wait": "5s"}, {"signal": "SIGKILL", "wait": "5s"}],
            }
        ],
        "reset": {
            "enabled": False,
            "command": [false, "--gpu-reset", "-i", "{uuid}"],
            "persistence_command": [false, "-pm", "{mode}", "-i", "{uuid}"],
            "health_command": [false, "-q", "-i", "{uuid}"],
            "mig_recovery_commands": [[false, "mig", "-i", "{uuid}", "-gi", "{gi}"]],
        },
        "health": {"enabled": False},
        "limits": {
            "post_action_delay": "0s",
            "max_signalled_per_hour": 2,
            "node_max_signalled_per_hour": 2,
        },
    }


def bus_key(text: str) -> str:
    """One spelling of a PCI bus id: CUDA's ``0000:17:00.0`` and NVML's ``00000000:17:00.0``."""
    domain, bus, rest = text.strip().lower().split(":")
    return f"{int(domain, 16):04x}:{bus}:{rest}"


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.pop("NOTIFY_SOCKET", None)
    env.pop("JOURNAL_STREAM", None)
    return env


class RealGpus:
    """The real driver: ``/dev``, the real NVML in the daemon, ``nvidia-smi`` for readings
    (this process never opens a GPU itself, so it is never a holder)."""

    devices_dir = "/dev"

    def env(self) -> dict[str, str]:
        return _base_env()

    @staticmethod
    def _smi(query: str) -> list[list[str]]:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]

    def memory(self) -> dict[str, int]:
        """Allocated memory per GPU (bus id → bytes), as nvidia-smi shows it."""
        rows = self._smi("--query-gpu=pci.bus_id,memory.used")
        return {bus_key(bus): int(used) * MiB for bus, used in rows}

    def listed(self) -> set[int]:
        """The PIDs NVML lists as compute processes."""
        return {int(r[0]) for r in self._smi("--query-compute-apps=pid") if r[0].isdigit()}

    def launched(self, report: Mapping[str, Any]) -> None:
        del report  # the real driver needs no help

    def close(self) -> None:
        pass


class FakeGpus:
    """The fake host: fake NVML state and device files, ``fakecuda.c`` as libcuda.so.1; plays
    the driver (the launcher listed with its memory until the last inherited file is gone)."""

    def __init__(self, root: Path) -> None:
        from tests.support.fakenvml import gpu
        from tests.support.simhost import SimHost

        self.host = SimHost(root / "host")
        self.idle = [gpu(0)]
        self.host.nvml(self.idle)
        self.devices_dir = str(self.host.devices_dir)
        self.libcuda = build_fakecuda()

    def env(self) -> dict[str, str]:
        env = self.host.env()
        env["LD_LIBRARY_PATH"] = f"{self.libcuda.parent}{os.pathsep}{env['LD_LIBRARY_PATH']}"
        env["FAKECUDA_DEVICES"] = self.devices_dir
        env["FAKECUDA_BUS_ID"] = bus_key(self.idle[0]["pci_bus_id"])
        return env

    def _state(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.host.fake.state_path.read_text())
        return data

    def memory(self) -> dict[str, int]:
        return {bus_key(g["pci_bus_id"]): g["memory"]["used"] for g in self._state()["gpus"]}

    def listed(self) -> set[int]:
        return {p["pid"] for g in self._state()["gpus"] for p in g["processes"]["compute"]}

    def launched(self, report: Mapping[str, Any]) -> None:
        from tests.support.fakenvml import gpu, process

        used = report["mib"] * MiB
        self.host.pids.update(launcher=report["launcher"], worker=report["worker"])
        listed = [process(report["launcher"], used)]
        self.host.nvml([gpu(0, allocated=2 * MiB + used, processes=listed)])
        self.host.free_when_gone(["worker"], self.idle, delay=0.2)

    def close(self) -> None:
        self.host.close()


def build_fakecuda() -> Path:
    """Compile ``fakecuda.c`` as ``libcuda.so.1`` (once; rebuilt when the source is newer)."""
    library = FAKECUDA_DIR / "libcuda.so.1"
    if library.exists() and library.stat().st_mtime >= FAKECUDA_SOURCE.stat().st_mtime:
        return library
    FAKECUDA_DIR.mkdir(parents=True, exist_ok=True)
    partial = FAKECUDA_DIR / f".libcuda.{os.getpid()}.so"
    compiler = os.environ.get("CC", "cc")
    subprocess.run(
        [compiler, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
         "-Wl,-soname,libcuda.so.1", "-o", str(partial), str(FAKECUDA_SOURCE)],
        check=True, capture_output=True,
    )  # fmt: skip
    os.replace(partial, library)
    return library


def launcher_argv(tag: str, *, mib: int = LAUNCH_MIB, api: str = "driver") -> list[str]:
    return [sys.executable, str(LAUNCHER), "--tag", tag, "--mib", str(mib), "--api", api]


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str | None:
    """The launcher's report line, or None when it exited or did not answer in time."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], POLL)
        if ready:
            line = proc.stdout.readline()
            return line or None
        if proc.poll() is not None:
            return None
    return None


def _events(log: Path) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    with contextlib.suppress(OSError):
        for line in log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    found.append(event)
    return found


def _holders(state: Path) -> set[int] | None:
    """The PIDs of the daemon's last clean holder view (``holders.json``), None before one."""
    try:
        view = json.loads((state / "holders.json").read_text())
    except (OSError, ValueError):
        return None
    return {entry[0] for entry in view.get("holders", [])} if view.get("clean") else None


def _until(check: Callable[[], bool], bound: float, start: float) -> float | None:
    """Seconds since ``start`` when ``check`` first held, or None when it did not in ``bound``."""
    deadline = time.monotonic() + bound
    while True:
        if os.getpid() == 1:  # a namespace's init reaps what is re-parented to it
            with contextlib.suppress(ChildProcessError):
                os.waitpid(-1, os.WNOHANG)
        if check():
            return round(time.monotonic() - start, 2)
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL)


def _exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


def _parent_of(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[1])


def core_loop(arg: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """The scenario (module docstring); ``arg``: ``mode`` (``real`` or ``fake``), ``tag``,
    optional ``api`` and ``mib``. Returns the record."""
    side: RealGpus | FakeGpus = FakeGpus(root) if arg["mode"] == "fake" else RealGpus()
    try:
        return _run(side, arg, root)
    finally:
        side.close()


def _run(side: RealGpus | FakeGpus, arg: Mapping[str, Any], root: Path) -> dict[str, Any]:
    tag, api, mib = arg["tag"], arg.get("api", "driver"), int(arg.get("mib", LAUNCH_MIB))
    in_namespace = os.getpid() == 1
    record: dict[str, Any] = {"mode": arg["mode"], "api": api, "pid_namespace": in_namespace}
    state = root / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    config = root / "gpuwatchd.yaml"
    policy = core_loop_policy(
        tag=tag, state_dir=state, devices_dir=side.devices_dir, namespace_check=not in_namespace
    )
    config.write_text(yaml.safe_dump(policy, sort_keys=False))
    log = root / "daemon.log"
    env = side.env()
    with open(log, "w", encoding="utf-8") as out:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "gpuwatchd", "run", "--config", str(config)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    launcher: subprocess.Popen[str] | None = None
    pidfd: int | None = None
    try:
        if _until(lambda: _holders(state) is not None, BOUNDS["daemon"], time.monotonic()) is None:
            record["failed"] = "the daemon published no clean holder view"
            return record
        before = side.memory()  # with the daemon's NVML worker up, as it stays
        with open(root / "launcher.err", "w", encoding="utf-8") as err:
            launcher = subprocess.Popen(
                launcher_argv(tag, mib=mib, api=api),
                env=env, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
            )  # fmt: skip
        line = _read_line(launcher, BOUNDS["launch"])
        if line is None:
            code = launcher.poll()
            why = (root / "launcher.err").read_text().strip()[-2000:]
            record["skip" if code == LAUNCHER_NO_CUDA else "failed"] = f"launcher: {why} ({code})"
            return record
        report = json.loads(line)
        owner, worker = report["launcher"], report["worker"]
        pidfd = os.pidfd_open(worker)
        if _parent_of(worker) != owner:  # the PID is pinned now; it must be our launcher's child
            record["failed"] = f"PID {worker} is not the launcher's worker"
            os.close(pidfd)
            pidfd = None
            return record
        record["report"] = report
        side.launched(report)
        bus = bus_key(report["pci_bus_id"])
        if bus not in before:
            record["failed"] = (
                f"the launcher's GPU {bus} is not among nvidia-smi's {sorted(before)}"
            )
            return record
        if _until(lambda: owner in side.listed(), 10.0, time.monotonic()) is None:
            record["namespace_unusable"] = (
                f"NVML does not list the launcher as PID {owner}: the driver reports PIDs of "
                "another PID namespace"
            )
            return record
        record["allocated"] = side.memory()[bus] - before[bus]
        started = time.monotonic()
        record["watched_after"] = _until(
            lambda: {owner, worker} <= (_holders(state) or set()), BOUNDS["watched"], started
        )
        time.sleep(1.0)  # one more poll: the owner's context and the worker's lineage recorded
        killed = time.monotonic()
        launcher.kill()
        launcher.wait()
        record["signalled_after"] = _until(
            lambda: any(
                e.get("event") == EventName.ACTION_SIGNAL and e.get("pid") == worker
                for e in _events(log)
            ),
            BOUNDS["signalled"],
            killed,
        )
        record["exited_after"] = _until(lambda: _exited(pidfd), BOUNDS["signalled"], killed)
        record["freed_after"] = _until(
            lambda: side.memory()[bus] <= before[bus] + MEMORY_SLACK and owner not in side.listed(),
            BOUNDS["freed"],
            killed,
        )
        record["memory_before"], record["memory_after"] = before[bus], side.memory()[bus]
        return record
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            record["daemon_exit"] = daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            record["daemon_exit"] = daemon.wait()
        if pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
        if launcher is not None:
            launcher.kill()
            launcher.wait()
        events = _events(log)
        record["signals"] = [
            {k: e.get(k) for k in ("pid", "signal", "outcome", "dry_run", "rule", "kind")}
            for e in events
            if e.get("event") == EventName.ACTION_SIGNAL
        ]
        record["findings"] = [
            {k: e.get(k) for k in ("kind", "pid", "gpu", "actionable")}
            for e in events
            if e.get("event") == EventName.FINDING_NEW
        ]
        record["errors"] = [e for e in events if e.get("level") in ("error", "critical")][:20]
        record["log_tail"] = log.read_text()[-4000:] if log.exists() else ""


def assert_core_loop(record: Mapping[str, Any]) -> None:
    """What the scenario must show, on the real driver as on the fake host."""
    assert "failed" not in record, record
    report = record["report"]
    worker = report["worker"]
    assert record["allocated"] >= report["mib"] * MiB - MEMORY_SLACK, "the job's memory not seen"
    assert record["watched_after"] is not None, "the daemon never listed the launcher and worker"
    assert "orphaned" in {f["kind"] for f in record["findings"] if f["pid"] == worker}, record
    signals = record["signals"]
    assert signals, f"the worker was not signalled: {record['log_tail']}"
    assert {s["pid"] for s in signals} == {worker}, f"signals to other processes: {signals}"
    first = signals[0]
    assert (first["signal"], first["outcome"], first["dry_run"]) == ("SIGTERM", "delivered", False)
    assert record["signalled_after"] is not None
    assert record["exited_after"] is not None, "the worker outlived the ladder"
    assert record["freed_after"] is not None, (
        f"memory not back in {BOUNDS['freed']}s: {record['memory_before']} bytes before the job, "
        f"{record['memory_after']} after"
    )
    assert record["daemon_exit"] == 0, record["log_tail"]
