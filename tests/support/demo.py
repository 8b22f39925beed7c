"""``make demo``: the daemon's main job, end to end, on a simulated GPU host.

A fake NVML (tests/fakenvml) stands in for the driver, and real processes stand in for jobs:

- GPU 0: a live training job with two DataLoader workers — healthy, must be left alone;
- GPU 1: a job whose trainer crashed; NVML still lists the dead trainer, and its two forked
  workers inherited the device files and keep 2 GiB pinned;
- GPU 2: 3 GiB allocated that no process holds any more (a context leaked after an Xid).

Last, ``gpuwatchd simulate`` replays the most common incident (orphaned DataLoader workers) on
a virtual clock with the shipped policy's timings, as an admin would before enforcing.

The demo runs the real ``gpuwatchd scan``, then ``gpuwatchd run --once`` with an enforcing
policy (SIGTERM → SIGKILL for orphans; a reset for ghost memory through a fake ``nvidia-smi``
that only prints and restores the fake GPU), then ``scan`` again. A small "driver" loop frees a
GPU's memory once nothing holds its device file, as the real driver does. Everything runs
inside a fresh PID namespace when one is available, so nothing outside the demo can be touched;
otherwise only the demo's own children exist to be found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.support.fakenvml import GiB, MiB, gpu, process
from tests.support.simhost import SimHost, pid_namespace_command, run_in_pid_namespace

FAKE_SMI = """#!/bin/sh
# A stand-in for nvidia-smi: never touches a GPU. A reset restores the fake GPU's memory.
echo "    [fake nvidia-smi] $*" >&2
case " $* " in
*" --gpu-reset "*)
    cp "{restored}" "{state}.tmp" && mv "{state}.tmp" "{state}"
    echo "GPU 00000000:38:00.0 was successfully reset."
    echo "All done." ;;
esac
exit 0
"""


SHOWN_FIELDS = ("kind", "pid", "signal", "outcome", "step", "status", "result", "rule")


def compact(log_lines: str, started: float, indices: dict[str, int]) -> str:
    """The daemon's JSON events as one short line each (the journal keeps every field); a GPU
    is shown by its index (``indices``: UUID to NVML index, from ``scan --json``)."""
    out = []
    for line in log_lines.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            out.append(line)
            continue
        stamp = datetime.fromisoformat(event.get("timestamp", "").replace("Z", "+00:00"))
        fields = "  ".join(
            f"{key}={event[key]}" for key in SHOWN_FIELDS if event.get(key) not in (None, "")
        )
        gpu = str(event.get("gpu") or "")
        where = f"GPU {indices[gpu]}" if gpu in indices else (f"GPU {gpu}" if gpu else "")
        reason = str(event.get("reason") or event.get("why") or "")
        if len(reason) > 90:
            reason = reason[:87] + "..."
        out.append(
            f"  +{stamp.timestamp() - started:5.2f}s  {event.get('level', ''):<8} "
            f"{event.get('event', ''):<20} {where:<13} {fields}"
            + (f"\n{'':>34}{reason}" if reason else "")
        )
    return "\n".join(out)


def banner(text: str) -> None:
    """A section heading, in bold only on a terminal (never ANSI codes into a pipe or file)."""
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    print(f"\n{bold}=== {text}{plain}\n", flush=True)


def free_released_gpus(host: SimHost) -> bool:
    """One pass of the emulated driver: a GPU whose device file nobody holds any more loses
    its process list and memory. True when something changed."""
    state = json.loads(host.fake.state_path.read_text())
    changed = False
    for entry in state["gpus"]:
        node = str(host.devices_dir / f"nvidia{entry['minor']}")
        listed = entry["processes"]["compute"]
        if listed and not _held(node):
            entry["processes"]["compute"] = []
            entry["memory"]["used"] = 2 * MiB
            changed = True
    if changed:
        host.fake.write(state)
    return changed


def emulate_driver(host: SimHost, stop: threading.Event) -> None:
    """Free a GPU's memory and process list once no process holds its device file."""
    while not stop.is_set():
        free_released_gpus(host)
        stop.wait(0.01)


def _held(path: str) -> bool:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                    return True
            except OSError:
                continue
    return False


def demo(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=3) as host:
        # Low PIDs look like system processes (PID <= 2 is on the floor): take them first.
        host.spawn("sshd", [{"sleep": 3600}])
        host.wait_ready("sshd")
        w1 = host.script("loader-1", [{"sleep": 3600}])
        w2 = host.script("loader-2", [{"sleep": 3600}])
        host.spawn(
            "trainer", [{"setsid": True}, {"open": host.cuda(0)}, {"fork": w1}, {"fork": w2}]
        )
        o1 = host.script("orphan-1", [{"sleep": 3600}])
        o2 = host.script("orphan-2", [{"ignore": "SIGTERM"}, {"sleep": 3600}])
        host.spawn(
            "crashed",
            [{"setsid": True}, {"open": host.cuda(1)}, {"fork": o1}, {"fork": o2}, {"exit": 1}],
        )
        pids = host.wait_ready("trainer", "loader-1", "loader-2", "crashed", "orphan-1", "orphan-2")
        host.wait_gone("crashed")
        host.nvml(
            [
                gpu(0, allocated=6 * GiB, processes=[process(pids["trainer"], 6 * GiB)]),
                gpu(1, allocated=2 * GiB, processes=[process(pids["crashed"], 2 * GiB)]),
                gpu(2, allocated=3 * GiB),
            ]
        )
        idle = json.loads(host.fake.state_path.read_text())
        idle["gpus"][2]["memory"]["used"] = 2 * MiB
        restored = host.root / "restored.json"
        restored.write_text(json.dumps(idle))
        smi = host.root / "nvidia-smi"
        smi.write_text(FAKE_SMI.format(restored=restored, state=host.fake.state_path))
        smi.chmod(0o755)

        print("Simulated host: 3 GPUs (fake NVML), real processes:")
        for name, pid in sorted(pids.items(), key=lambda item: item[1]):
            print(f"  pid {pid:>4}  {name}")

        banner("1. gpuwatchd scan — who holds each GPU, and why it matters")
        config = host.config(
            dry_run=False,
            interval="500ms",
            log={"format": "json"},
            rules=[
                {
                    "name": "orphans",
                    "kind": "orphaned",
                    "for": "1s",
                    "steps": [
                        {"signal": "SIGTERM", "wait": "2s"},
                        {"signal": "SIGKILL", "wait": "2s"},
                    ],
                }
            ],
            limits={"post_action_delay": "1s"},
            reset={
                "enabled": True,
                "command": [str(smi), "--gpu-reset", "-i", "{uuid}"],
                "persistence_command": [str(smi), "-pm", "{mode}", "-i", "{uuid}"],
                "health_command": [str(smi), "-q", "-i", "{uuid}"],
                "confirm_for": "3s",
            },
        )
        print(host.gpuwatchd("scan", "--config", str(config)).stdout)
        listed = json.loads(host.gpuwatchd("scan", "--json", "--config", str(config)).stdout)
        indices = {g["uuid"]: g["index"] for g in listed["gpus"]}

        banner("2. gpuwatchd run --once (enforcing) — escalate, then reset the leaked GPU")
        stop = threading.Event()
        driver = threading.Thread(target=emulate_driver, args=(host, stop), daemon=True)
        driver.start()
        started, wall = time.monotonic(), time.time()
        proc = host.gpuwatchd(
            "run", "--once", "--timeout", "60s", "--config", str(config), timeout=120
        )
        print(compact(proc.stdout + proc.stderr, wall, indices))
        print(f"\n(run --once exited {proc.returncode} after {time.monotonic() - started:.1f}s;")
        print(" every event above is one structured journal entry with all its inputs)")
        stop.set()
        driver.join()
        host.reap()
        # The real driver frees memory as the last holder exits; the emulation polls. Let it
        # catch up with the last exit before the final scan, so the demo ends the same way
        # every time (it used to end, one run in three, with GPU 1 still "holding" 2 GiB).
        free_released_gpus(host)

        banner("3. Afterwards")
        for name in ("trainer", "loader-1", "loader-2", "orphan-1", "orphan-2"):
            state = "alive" if host.alive(pids[name]) else "gone"
            print(f"  {name:<10} pid {pids[name]:>4}: {state}")
        print()
        print(host.gpuwatchd("scan", "--config", str(config)).stdout)
        final = json.loads(host.gpuwatchd("scan", "--json", "--config", str(config)).stdout)
        return {
            "ok": True,
            "exit_code": proc.returncode,
            "alive": {name: host.alive(pid) for name, pid in pids.items() if name != "crashed"},
            "findings": [f["kind"] for f in final["findings"]],
            "allocated": [g["memory"]["used"] for g in final["gpus"]],
        }


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="gpuwatchd-demo-"))
    if pid_namespace_command() is not None:
        result = run_in_pid_namespace(
            "tests.support.demo:demo", {}, root=root, timeout=300, stream=True
        )
    else:
        print("(no PID namespace available: running among this user's own processes)")
        result = demo({}, root)
    banner(
        "4. Predict before you enforce: gpuwatchd simulate (the real decision core, virtual clock)"
    )
    scenario = (
        Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "dataloader-orphans.yaml"
    )
    sys.stdout.flush()
    simulated = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "simulate", str(scenario)], check=False
    )
    return 0 if result.get("ok") and simulated.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
