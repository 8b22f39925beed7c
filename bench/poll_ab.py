"""Two checkouts' steady polls on one quiet node, alternately: CPU per targeted poll.

``python bench/poll_ab.py NAME=TREE NAME=TREE [--rounds N] [--polls P]`` builds the default
host of ``make bench`` once in a fresh PID namespace (as ``bench/quiet_ab.py``), then runs each
tree's ``bench/pollloop.py`` (its own ``.venv``) in turn, ``rounds`` times: ``polls`` polls on a
virtual 5 s clock each. Prints one JSON line per run: the median CPU of a targeted poll (daemon
and NVML worker, and each), from :func:`bench.run.summarise_polls`.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host import ProcessPool, cuda_devices
from bench.run import nvml_state, summarise_polls
from tests.support.simhost import SimHost, pid_namespace_command


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help="NAME=PATH of a checkout with its .venv")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--polls", type=int, default=300)
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
    with tempfile.TemporaryDirectory(prefix="gpuwatchd-poll-ab-") as tmp:
        pool = ProcessPool(Path(tmp) / "scratch")
        try:
            host = SimHost(Path(tmp) / "host", gpus=8)
            pool.set_fillers(args.processes)
            pool.set_holders(cuda_devices(host.devices_dir, 64, 8))
            nvml_state(host, pool.holders, 8)
            config = host.config(log={"format": "json"})
            for round_ in range(args.rounds):
                for name, tree in trees:
                    out = host.root / f"poll-{time.monotonic_ns()}.json"
                    spec = {
                        "config": str(config),
                        "polls": args.polls,
                        "virtual_interval": 5.0,
                        "rss_every": 0,
                        "open_every": 0,
                        "out": str(out),
                    }
                    env = {**host.env(), "PYTHONPATH": str(tree)}
                    python = str(tree / ".venv" / "bin" / "python")
                    subprocess.run(
                        [python, str(tree / "bench" / "pollloop.py"), json.dumps(spec)],
                        env=env,
                        check=True,
                    )
                    got = summarise_polls(json.loads(out.read_text()))
                    keep = (
                        "targeted_median_ms",
                        "daemon_median_ms",
                        "worker_median_ms",
                        "full_median_ms",
                        "core_percent",
                    )
                    row = {"tree": name, "round": round_, **{k: got[k] for k in keep}}
                    print(json.dumps({**row, "loadavg": os.getloadavg()}), flush=True)
        finally:
            pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
