"""Two checkouts' real daemons on one quiet node, alternately: the before/after of the quiet row.

``python bench/quiet_ab.py NAME=TREE NAME=TREE [--rounds N] [--minutes M]`` builds the default
host of ``make bench`` once (2,000 filler processes, 64 GPU processes on 8 GPUs, the fake NVML
listing each with 500 MiB) in a fresh PID namespace, then runs each tree's ``gpuwatchd run``
(its own ``.venv``) in turn on it, ``rounds`` times: A B A B ..., so both see the same machine
load. Each measurement is :func:`bench.quiet.measure`: daemon + NVML worker CPU over ``minutes``
of wall time after a 30 s warm-up. Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host import ProcessPool, cuda_devices
from bench.quiet import measure
from bench.run import nvml_state
from tests.support.simhost import SimHost, pid_namespace_command


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help="NAME=PATH of a checkout with its .venv")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=30.0)
    parser.add_argument("--processes", type=int, default=2000)
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
                    result = measure(host, args.minutes, args.warmup, tree)
                    print(json.dumps({"tree": name, "round": round_, **result}), flush=True)
        finally:
            pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
