"""A real ``gpuwatchd run`` under test inside a PID namespace: the daemon handle, the orphan,
stuck-holder and healthy-job scenarios, the fake reset script and the scratch cgroup fixture the
end-to-end tests share."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support.fakenvml import GiB, MiB, gpu, process
from tests.support.simhost import SimHost

ORPHAN_RULE = {
    "name": "orphans",
    "kind": "orphaned",
    "for": "0s",
    "steps": [{"signal": "SIGTERM", "wait": "2s"}, {"signal": "SIGKILL", "wait": "1s"}],
}


# The driver's refusal of a reset while any process holds the GPU's device file (a piece of the
# fake `nvidia-smi` scripts' `--gpu-reset` branch).
REFUSE_WHILE_HELD = r"""    for fd in /proc/[0-9]*/fd/*; do
        case $(readlink "$fd" 2>/dev/null) in
        "%(device)s") echo "GPU 00000000:18:00.0: In use by another client"; exit 255 ;;
        esac
    done
"""

# A stand-in for `nvidia-smi`: logs its argv; a reset refuses while any process holds the GPU's
# device file (as the driver does), else restores the fake GPU's memory to idle.
FAKE_SMI = (
    r"""#!/bin/sh
here=${0%%/*}
echo "$*" >> "%(log)s"
case " $* " in
*" --gpu-reset "*)
    if [ -f "%(behaviour)s" ]; then read -r behaviour < "%(behaviour)s"; else behaviour=ok; fi
    if [ "$behaviour" = hang ]; then sleep 1000 & echo $! > "%(root)s/hang.pid"; wait; fi
"""
    + REFUSE_WHILE_HELD
    + r"""    cp "%(restored)s" "%(state)s.tmp" && mv "%(state)s.tmp" "%(state)s"
    echo "GPU 00000000:18:00.0 was successfully reset."
    echo "All done." ;;
esac
exit 0
"""
)


class Run:
    """One daemon under test inside the namespace."""

    def __init__(self, host: SimHost, **config: Any) -> None:
        self.host = host
        self.log = host.root / "daemon.log"
        config.setdefault("dry_run", False)
        config.setdefault("rules", [ORPHAN_RULE])
        config.setdefault("log", {"format": "json"})
        config.setdefault("limits", {"post_action_delay": "0s"})
        self.config = host.config(**config)
        self.proc: subprocess.Popen[str] | None = None

    def start(self, *extra: str, env: Mapping[str, str] | None = None) -> None:
        """Start the daemon; ``env`` adds to the host's environment (libfaketime, say)."""
        handle = open(self.log, "a", encoding="utf-8")  # noqa: SIM115 - owned by the child
        self.proc = self.host.popen(
            [sys.executable, "-m", "gpuwatchd", "run", "--config", str(self.config), *extra],
            env={**self.host.env(), **(env or {})},
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
        handle.close()

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def events(self) -> list[dict[str, Any]]:
        found = []
        if self.log.exists():
            for line in self.log.read_text().splitlines():
                try:
                    found.append(json.loads(line))
                except ValueError:
                    found.append({"event": "<unparsed>", "line": line})
        return found

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
        """Whether ``predicate`` came true within ``timeout`` seconds (or when the daemon
        exited). Generous: a wait that succeeds returns at once, and on a loaded 2-core CI
        machine a daemon's poll once took over 20 s to show in its metrics file."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.host.reap()
            if predicate():
                return True
            if self.proc is not None and self.proc.poll() is not None:
                return predicate()
            time.sleep(0.02)
        return predicate()

    def reload_with(self, name: str, text: str) -> None:
        """Write drop-in ``name`` (``text``) into the policy's conf.d and send the daemon
        SIGHUP, as an admin's reload does."""
        dropins = self.config.parent / "conf.d"
        dropins.mkdir(exist_ok=True)
        (dropins / name).write_text(text)
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGHUP)

    def saw(self, event: str, **fields: Any) -> bool:
        return any(
            e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
            for e in self.events()
        )


def orphan_host(host: SimHost, *, ignore_term: bool = False, comm: str | None = None) -> None:
    """A trainer that held GPU 0 has died; its forked worker keeps the device files."""
    worker_steps: list[dict[str, Any]] = []
    if comm:
        worker_steps.append({"comm": comm})
    if ignore_term:
        worker_steps.append({"ignore": "SIGTERM"})
    worker_steps.append({"sleep": 3600})
    worker = host.script("worker", worker_steps)
    host.spawn("trainer", [{"setsid": True}, {"open": host.cuda(0)}, {"fork": worker}, {"exit": 0}])
    pids = host.wait_ready("trainer", "worker")
    host.wait_gone("trainer")
    host.nvml([gpu(0, allocated=700 * MiB, processes=[process(pids["trainer"], 700 * MiB)])])


def job_host(host: SimHost, *, probe: bool = False) -> dict[str, int]:
    """A live job holding GPU 0, NVML listing it with 600 MiB; with ``probe``, also a process
    holding only nvidiactl. Their pids, by name ("job", "probe")."""
    host.spawn("job", [{"open": host.cuda(0)}])
    if probe:
        host.spawn("probe", [{"open": host.dev("nvidiactl")}])
    pids = host.wait_ready("job", *(["probe"] if probe else []))
    host.nvml([gpu(0, allocated=600 * MiB, processes=[process(pids["job"], 600 * MiB)])])
    return pids


def stuck_host(host: SimHost) -> dict[str, int]:
    """A holder of GPU 0 in uninterruptible sleep (D): it cannot be killed. NVML lists 1 GiB
    allocated and no process. Its pid, by name ("stuck")."""
    host.spawn_stuck("stuck", host.cuda(0))
    pids = host.wait_ready("stuck")
    host.wait_state("stuck", "D")
    host.nvml([gpu(0, allocated=GiB)])
    return pids


def fake_smi(host: SimHost) -> dict[str, Any]:
    """Write the fake reset script; returns the reset config pointing at it."""
    idle = json.loads(host.fake.state_path.read_text())
    for entry in idle["gpus"]:
        entry["memory"]["used"] = 2 * MiB
        entry["processes"] = {"compute": [], "graphics": [], "mps": []}
    restored = host.root / "restored.json"
    restored.write_text(json.dumps(idle))
    script = host.root / "fake-nvidia-smi"
    script.write_text(
        FAKE_SMI
        % {
            "log": host.root / "smi.log",
            "behaviour": host.root / "reset.behaviour",
            "root": host.root,
            "device": host.devices_dir / "nvidia0",
            "restored": restored,
            "state": host.fake.state_path,
        }
    )
    script.chmod(0o755)
    smi = str(script)
    return {
        "enabled": True,
        "command": [smi, "--gpu-reset", "-i", "{uuid}"],
        "persistence_command": [smi, "-pm", "{mode}", "-i", "{uuid}"],
        "health_command": [smi, "-q", "-i", "{uuid}"],
        "confirm_for": "1s",
        "timeout": "3s",
        "cooldown": "1h",
        "max_resets": 3,
        "window": "1h",
    }


def evidence_files(host: SimHost, config: Path) -> dict[str, Any]:
    """The evidence files the daemon kept in the host's state_dir (act/evidence.py): each one's
    name, mode and header, and what ``explain --json`` (on the first) and ``status --json``
    say of them, read with the real command line after the daemon stopped."""
    paths = sorted(host.state_dir.glob("evidence-*.json"))
    files = []
    for path in paths:
        doc = json.loads(path.read_text())
        files.append(
            {
                "path": str(path),
                "mode": stat.S_IMODE(path.stat().st_mode),
                "size": path.stat().st_size,
                **{k: doc.get(k) for k in ("action", "gpu", "dry_run", "reason", "truncated")},
                "report_gpus": [g["uuid"] for g in (doc.get("report") or {}).get("gpus", [])],
                "trees": [t["pid"] for t in doc.get("process_trees") or []],
                "report_spares": (doc.get("report") or {}).get("spares"),
            }
        )
    explained: dict[str, Any] | None = None
    if paths:
        out = host.gpuwatchd("explain", "--json", "--config", str(config), str(paths[0]))
        explained = {"code": out.returncode, "stderr": out.stderr}
        if out.returncode == 0:
            explained.update(json.loads(out.stdout))
    status = host.gpuwatchd("status", "--json", "--config", str(config))
    return {
        "files": files,
        "explain": explained,
        "status": json.loads(status.stdout).get("evidence") if status.stdout else None,
    }


def mig_recovery_argvs(smi: str) -> list[list[str]]:
    """``reset.mig_recovery_commands`` run by the script ``smi``: destroy the compute instance,
    destroy the GPU instance, create it again at its placement."""
    return [
        [smi, "mig", "-i", "{uuid}", "-gi", "{gi}", "-ci", "{ci}", "-dci"],
        [smi, "mig", "-i", "{uuid}", "-gi", "{gi}", "-dgi"],
        [smi, "mig", "-i", "{uuid}", "-cgi", "{profile}:{placement}", "-C"],
    ]


def smi_calls(host: SimHost) -> list[str]:
    path = host.root / "smi.log"
    return path.read_text().splitlines() if path.exists() else []


def _signals(run: Run) -> list[dict[str, Any]]:
    return [
        {k: e.get(k) for k in ("pid", "signal", "outcome", "dry_run", "timestamp")}
        for e in run.events()
        if e.get("event") == EventName.ACTION_SIGNAL
    ]


SLURM_SCOPE = "system.slice/slurmstepd.scope"


@pytest.fixture
def cgroup_base() -> Any:
    """A scratch cgroup v2 subtree the test may create and move its own processes into."""
    from gpuwatchd.collect.jobs import cgroup2_mount

    mount = cgroup2_mount()
    if mount is None or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup v2 hierarchy to build a Slurm job's cgroups")
    base = Path(mount) / f"gpuwatchd-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        base.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create cgroups under {mount}: {exc}")
    yield base
    for path in sorted(base.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir():
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (Path(mount) / "cgroup.procs").write_text(pid)
            path.rmdir()
    base.rmdir()


def _epoch(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
