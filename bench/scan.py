"""The full holder scan against ``fuser -v`` and ``lsof`` on the same device files.

Owns timing the three side by side (interleaved rounds, medians) and checking that they found
the same holder set. Two setups: path mode (regular files in a temp folder, as the tests use)
and device-number mode (real character devices from ``/dev`` standing in for NVIDIA nodes).
It only reads ``/proc``; it never signals.
"""

from __future__ import annotations

import re
import resource
import statistics
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from gpuwatchd.collect.procfs import ProcFS

# Device-number mode stand-ins, all major 1: /dev/null (1:3) is "GPU 3", /dev/full (1:7) is
# nvidiactl, /dev/random (1:8) nvidia-uvm.
CHAR_STANDINS = ("/dev/full", "/dev/random", "/dev/null")
CHAR_PROCFS = {
    "devices_dir": "/dev",
    "device_major": 1,
    "uvm_major": 1,
    "ctl_minor": 7,
    "uvm_minor": 8,
    "match_by_path": False,
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_tool(argv: Sequence[str]) -> tuple[float, float, set[int]]:
    """(wall s, CPU s, PIDs on stdout) of one run of fuser or lsof."""
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.run(
        list(argv),
        stdin=subprocess.PIPE,
        capture_output=True,
        check=False,
    )
    wall = time.perf_counter() - t0
    cpu = _children_cpu() - cpu0
    if argv[0].endswith("lsof"):  # -F p: one "p<PID>" line per process
        pids = {int(line[1:]) for line in proc.stdout.split() if line.startswith(b"p")}
    else:  # fuser: PIDs on stdout, everything else on stderr
        pids = {int(n) for n in re.findall(rb"\d+", proc.stdout)}
    return wall, cpu, pids


def compare(
    procfs: ProcFS,
    files: Sequence[str],
    expected: set[int],
    *,
    rounds: int,
    ignore: set[int],
) -> dict[str, Any]:
    """Interleave ``rounds`` runs of our full scan, fuser and lsof; medians and holder sets."""
    ours_wall: list[float] = []
    ours_cpu: list[float] = []
    tools: dict[str, dict[str, list[float]]] = {
        "fuser": {"wall": [], "cpu": []},
        "lsof": {"wall": [], "cpu": []},
    }
    sets: dict[str, set[int]] = {}
    argvs = {
        "fuser": ["fuser", "-v", *files],
        "lsof": ["lsof", "-n", "-P", "-w", "-F", "p", *files],
    }
    for _ in range(rounds):
        c0, t0 = time.process_time(), time.perf_counter()
        scan = procfs.holders.scan(None)
        ours_wall.append(time.perf_counter() - t0)
        ours_cpu.append(time.process_time() - c0)
        sets["gpuwatchd"] = set(scan.holdings) - ignore
        for name, argv in argvs.items():
            wall, cpu, pids = _run_tool(argv)
            tools[name]["wall"].append(wall)
            tools[name]["cpu"].append(cpu)
            sets[name] = pids - ignore
    ours = statistics.median(ours_wall)
    result: dict[str, Any] = {
        "rounds": rounds,
        "holders_expected": len(expected),
        "gpuwatchd_wall_ms": ours * 1e3,
        "gpuwatchd_cpu_ms": statistics.median(ours_cpu) * 1e3,
        "identical_sets": all(found == expected for found in sets.values()),
        "set_sizes": {name: len(found) for name, found in sets.items()},
    }
    for name, timing in tools.items():
        wall = statistics.median(timing["wall"])
        result[f"{name}_wall_ms"] = wall * 1e3
        result[f"{name}_cpu_ms"] = statistics.median(timing["cpu"]) * 1e3
        result[f"ratio_vs_{name}"] = ours / wall if wall else None
    if not result["identical_sets"]:
        result["differences"] = {
            name: {
                "missing": sorted(expected - found)[:10],
                "extra": sorted(found - expected)[:10],
            }
            for name, found in sets.items()
            if found != expected
        }
    return result
