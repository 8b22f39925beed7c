"""End to end: monitors beside ghost memory, the real ``gpuwatchd run`` in a PID namespace.

Two monitors of the test's own hold GPU 0 the way gpustat and ``nvidia-smi -l`` do — nvidiactl
and /dev/nvidia0 (one by fd, one by a mapping), no nvidia-uvm, no context, no memory — beside
memory a dead job left (NVML lists nobody). The finding is ``ghost_memory`` all the same. Not
listed in ``reset.monitors``, they block the reset, named; listed by command, the daemon sends
each SIGTERM, the fake reset (tests/support/daemonrun.py's script, which refuses while anything
holds the node, as the driver does) runs, and the test's own supervisor starts each monitor
again a moment later. Nothing here can reach a real ``nvidia-smi``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support.daemonrun import Run, fake_smi, smi_calls
from tests.support.fakenvml import GiB, gpu
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)

pytestmark = [needs_pid_namespace(), pytest.mark.slow]

RESTART_DELAY = 3.0  # the supervisor's pause before it starts a monitor again


def _monitor_steps(host: SimHost, comm: str) -> list[dict[str, Any]]:
    node = host.dev("nvidia0")[0]
    if comm == "gpustat":
        return [{"comm": comm}, {"open": host.dev("nvidiactl", "nvidia0")}, {"sleep": 3600}]
    # nvidia-smi -l: nvidiactl by fd, the GPU's node by a mapping only
    opened: list[dict[str, Any]] = [{"open": host.dev("nvidiactl")}, {"mmap": node}]
    return [{"comm": comm}, *opened, {"sleep": 3600}]


class Supervisor:
    """The test's own supervisor: starts each monitor again ``RESTART_DELAY`` after it exits."""

    def __init__(self, host: SimHost, names: list[str]) -> None:
        self.host = host
        self.names = names
        self.started: dict[str, list[int]] = {name: [] for name in names}
        self.stopping = threading.Event()
        for name in names:
            self._start(name)
        self.thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self.thread.start()

    def _start(self, name: str) -> None:
        (self.host.ready_dir / name).unlink(missing_ok=True)
        self.host.spawn(name, _monitor_steps(self.host, name))
        self.started[name].append(self.host.wait_ready(name)[name])

    def _run(self) -> None:
        while not self.stopping.wait(0.05):
            for name in self.names:
                if not self.host.alive(self.started[name][-1]):
                    time.sleep(RESTART_DELAY)
                    if not self.stopping.is_set():
                        self._start(name)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)


def _holds_node(host: SimHost, pid: int) -> bool:
    node = str(host.devices_dir / "nvidia0")
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return node in maps or any(_link(fd) == node for fd in fds)


def _link(path: Path) -> str | None:
    try:
        return str(path.readlink())
    except OSError:
        return None


def host_monitors_beside_ghost(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        host.nvml([gpu(0, allocated=3 * GiB)])
        supervisor = Supervisor(host, ["gpustat", "smi-loop"])
        reset = fake_smi(host)
        if arg["listed"]:
            reset["monitors"] = [
                {"command": '"name": "gpustat"'},
                {"command": '"name": "smi-loop"'},
            ]
        run = Run(host, reset=reset)
        # The prolog's verdict, before the daemon acts: dirty with ghost memory, the monitors
        # named as what would block its reset (as beside dcgm-exporter, less that name).
        check = host.gpuwatchd("check-clean", "--config", str(run.config))
        run.start()
        if arg["listed"]:
            run.wait_for(lambda: run.saw(EventName.RESET_OUTCOME), timeout=40)
            # Back after the reset: the supervisor started each again, holding the GPU.
            run.wait_for(
                lambda: all(len(p) > 1 for p in supervisor.started.values()),
                timeout=3 * RESTART_DELAY + 10,
            )
        else:
            run.wait_for(lambda: run.saw(EventName.RESET_REFUSED), timeout=40)
            time.sleep(2)  # more polls: still no reset
        run.stop()
        supervisor.stop()
        started = supervisor.started
        return {
            "started": started,
            "back": {name: _holds_node(host, pids[-1]) for name, pids in started.items()},
            "events": run.events(),
            "calls": smi_calls(host),
            "check": {"code": check.returncode, "out": check.stdout, "err": check.stderr},
        }


def _scenario(tmp_path: Path, *, listed: bool) -> dict[str, Any]:
    return run_in_pid_namespace(
        f"{__name__}:host_monitors_beside_ghost", {"listed": listed}, root=tmp_path, timeout=180
    )


def _of(result: dict[str, Any], event: str) -> list[dict[str, Any]]:
    return [e for e in result["events"] if e.get("event") == event]


def test_monitors_beside_ghost_memory_block_its_reset_naming_them(tmp_path: Path) -> None:
    result = _scenario(tmp_path, listed=False)
    kinds = {e.get("kind") for e in _of(result, EventName.FINDING_NEW)}
    assert "ghost_memory" in kinds
    assert "unaccounted_memory" not in kinds
    pids = {pid for pids in result["started"].values() for pid in pids}
    refused = [str(e.get("why")) for e in _of(result, EventName.RESET_REFUSED)]
    assert any(f"monitor pid {pid} (" in why for why in refused for pid in pids), refused
    assert not [c for c in result["calls"] if "--gpu-reset" in c]
    assert [len(p) for p in result["started"].values()] == [1, 1], "never signalled"
    check = result["check"]
    assert check["code"] == 1, check
    assert check["out"].startswith("GPU 0 GPU-"), check
    assert ": ghost_memory GPU 0 has 3072 MiB allocated" in check["out"], check


def test_listed_monitors_are_stopped_for_the_reset_and_are_back_afterwards(tmp_path: Path) -> None:
    result = _scenario(tmp_path, listed=True)
    [outcome] = _of(result, EventName.RESET_OUTCOME)
    assert outcome["result"] == "success", outcome
    assert len([c for c in result["calls"] if "--gpu-reset" in c]) == 1
    stopped = [e for e in _of(result, EventName.RESET_STEP) if e.get("step") == "stop_monitors"]
    assert [e["status"] for e in stopped] == ["ok"]
    first = {name: pids[0] for name, pids in result["started"].items()}
    assert sorted(stopped[0]["monitors"]) == sorted(
        f"pid {pid} ({name})" for name, pid in first.items()
    )
    assert result["back"] == {"gpustat": True, "smi-loop": True}
    assert _of(result, EventName.ACTION_SIGNAL) == [], "no kill ladder: a monitor is never a target"
