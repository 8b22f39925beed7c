"""Two checkouts' real daemons on one quiet node, alternately: the before/after of the quiet row.

``python bench/quiet_ab.py NAME=TREE NAME=TREE [--rounds N] [--minutes M]`` builds the default
host of ``make bench`` once (2,000 filler processes, 64 GPU processes on 8 GPUs, the fake NVML
listing each with 500 MiB) in a fresh PID namespace, then runs each tree's ``gpuwatchd run``
(its own ``.venv``) in turn on it, ``rounds`` times: A B A B ..., so both see the same machine
load. Each measurement is :func:`bench.quiet.measure`: daemon + NVML worker CPU over ``minutes``
of wall time after a 30 s warm-up. With ``--polls P`` each measurement is instead the tree's
``bench/pollloop.py``: P polls on a virtual 5 s clock, the median CPU of a targeted poll (daemon
and NVML worker, and each). Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host import ProcessPool, cuda_devices
from bench.quiet import measure
from bench.run import nvml_state, summarise_polls
from tests.support.simhost import SimHost, pid_namespace_command


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help="NAME=PATH of a checkout with its .venv")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=30.0)
    parser.add_argument("--processes", type=int, default=2000)
    parser.add_argument("--polls", type=int, help="the poll loop instead of the real daemon")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.inner and os.getpid() != 1:
        prefix = pid_namespace_command()
        if prefix is None:
            print("no PID namespace", file=sys.stderr)
            return 1
        argv = [*prefix, sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--inner"]
        return subprocess.run(argv, check=False).returncode
    trees = [(name, Path(path).resolve()) for name, path in (t.split("=", 1) for t in args.trees)]
    with tempfile.TemporaryDirectory(prefix="gpuwatchd-quiet-ab-") as tmp:
        pool = ProcessPool(Path(tmp) / "scratch")
        try:
            host = SimHost(Path(tmp) / "host", gpus=8)
            pool.set_fillers(args.processes)
            pool.set_holders(cuda_devices(host.devices_dir, 64, 8))
            nvml_state(host, pool.holders, 8)
            for round_ in range(args.rounds):
                for name, tree in trees:
                    if args.polls:
                        result = _polls(host, args.polls, tree)
                    else:
                        result = measure(host, args.minutes, args.warmup, tree)
                    print(json.dumps({"tree": name, "round": round_, **result}), flush=True)
        finally:
            pool.close()
    return 0


def _polls(host: SimHost, polls: int, tree: Path) -> dict[str, Any]:
    """``polls`` of the tree's ``bench/pollloop.py`` on ``host``: CPU per poll (module doc)."""
    out = host.root / f"poll-{time.monotonic_ns()}.json"
    spec = {
        "config": str(host.config(log={"format": "json"})),
        "polls": polls,
        "virtual_interval": 5.0,
        "out": str(out),
    }
    subprocess.run(
        [
            str(tree / ".venv" / "bin" / "python"),
            str(tree / "bench" / "pollloop.py"),
            json.dumps(spec),
        ],
        env={**host.env(), "PYTHONPATH": str(tree)},
        check=True,
    )
    got = summarise_polls(json.loads(out.read_text()))
    keep = ("targeted_median_ms", "daemon_median_ms", "worker_median_ms", "core_percent")
    return {key: got[key] for key in keep} | {"loadavg": os.getloadavg()}


if __name__ == "__main__":
    sys.exit(main())
