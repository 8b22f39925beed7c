"""Whole-process ``gpuwatchd scan --json`` against ``fuser -v`` on one simulated host.

Owns timing what an operator actually runs: the whole ``gpuwatchd`` process (interpreter,
imports, NVML worker, the ``/proc`` walk, assessment, the JSON written) beside ``fuser -v`` and
``lsof`` on the same device files, interleaved, medians of ``rounds``, and checking that
the holder sets agree. It runs inside the benchmark's PID namespace (``bench/run.py``), so the
holder sets are exact. It only reads ``/proc`` and runs read-only commands; it never signals.

Run alone for a quick look (``python bench/cli_scan.py 2000``): it re-executes itself in a
fresh PID namespace and prints one line per process count.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.host import ProcessPool, cuda_devices  # noqa: E402
from bench.scan import _run_tool  # noqa: E402
from tests.support.simhost import SimHost  # noqa: E402


def scan_pids(report: dict[str, Any]) -> set[int]:
    """Every PID the report shows holding a device file (GPU tables and the node section)."""
    found: set[int] = set()
    for gpu in report.get("gpus", []):
        for holder in gpu.get("holders", []):
            if holder.get("via"):
                found.add(int(holder["pid"]))
    for holder in report.get("node_holders", []):
        found.add(int(holder["pid"]))
    return found


def _difference(found: set[int], expected: set[int]) -> dict[str, Any]:
    extra = sorted(found - expected)[:10]
    return {"missing": sorted(expected - found)[:10], "extra": extra, "what": _describe(extra)}


def _describe(pids: Sequence[int]) -> dict[int, str]:
    """ppid and command line of each PID, to tell what an unexpected holder is."""
    described = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                ppid = handle.read().rpartition(b")")[2].split()[1].decode()
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmdline = handle.read().replace(b"\0", b" ")[:200].decode(errors="replace")
        except OSError:
            described[pid] = "gone"
            continue
        described[pid] = f"ppid {ppid}: {cmdline}"
    return described


def scan_env(host: SimHost) -> dict[str, str]:
    """The host's environment with bytecode caching on, in a folder of the host's own: an
    installed package is byte-compiled, so compiling every module on every run (what
    ``PYTHONDONTWRITEBYTECODE`` in a developer's shell causes) is not what an operator pays."""
    env = host.env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(host.root / "pycache")
    return env


def run_scan(
    host: SimHost, config: Path, extra: Sequence[str] = (), source: Path | None = None
) -> tuple[float, dict[str, Any]]:
    """(wall seconds, parsed report) of one whole ``gpuwatchd scan --json`` process.
    ``source``: run the ``gpuwatchd`` package found in this folder instead (an A/B run)."""
    argv = [sys.executable, "-m", "gpuwatchd", "--config", str(config), "scan", "--json", *extra]
    env = scan_env(host)
    if source is not None:  # and run there: `-m` puts the working directory first on the path
        env["PYTHONPATH"] = str(source)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, check=False, cwd=source)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 77):
        raise RuntimeError(f"scan failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    report: dict[str, Any] = json.loads(proc.stdout)
    return wall, report


def compare_cli(
    host: SimHost,
    config: Path,
    files: Sequence[str],
    expected: set[int],
    *,
    rounds: int,
    extra: Sequence[str] = (),
    with_lsof: bool = True,
    ignore: frozenset[int] = frozenset(),
    before_each: Callable[[], object] | None = None,
    baseline: Path | None = None,
) -> dict[str, Any]:
    """Interleave ``rounds`` whole-process scans with fuser (and lsof); medians, sets.
    ``ignore``: PIDs left out of every set (a running daemon and its NVML worker, which the
    tools list and gpuwatchd rightly does not). ``before_each``: called before each of our scans
    (beside a daemon: wait until its view is clean again — the previous scan's NVML worker
    opened the device files, which the daemon re-walks for). ``baseline``: a folder holding
    another ``gpuwatchd`` package (an older commit's, say), run in the same rounds too."""
    ours: list[float] = []
    theirs: list[float] = []
    tools: dict[str, list[float]] = {"fuser": [], "lsof": []} if with_lsof else {"fuser": []}
    same = True
    scan_mode = None
    differences: dict[str, dict[str, list[int]]] = {}
    argvs = {
        "fuser": ["fuser", "-v", *files],
        "lsof": ["lsof", "-n", "-P", "-w", "-F", "p", *files],
    }
    run_scan(host, config, extra)  # warm-up: fills the bytecode cache and the page cache
    if baseline is not None:
        run_scan(host, config, extra, baseline)
    served = answered = daemon_reading = 0
    for _ in range(rounds):
        if baseline is not None:
            if before_each is not None:
                before_each()
            wall, report = run_scan(host, config, extra, baseline)
            theirs.append(wall)
            same &= scan_pids(report) - ignore == expected
        if before_each is not None:
            before_each()
        wall, report = run_scan(host, config, extra)
        ours.append(wall)
        scan_mode = report.get("scan_mode")
        served += report.get("daemon_view", {}).get("used") is True
        answered += report.get("daemon_view", {}).get("answered_by") == "daemon"
        daemon_reading += report.get("nvml_reading", {}).get("source") == "daemon"
        found = scan_pids(report) - ignore
        same &= found == expected
        if found != expected:
            differences["gpuwatchd"] = _difference(found, expected)
        for name, walls in tools.items():
            wall, _, pids = _run_tool(argvs[name])
            walls.append(wall)
            same &= pids - ignore == expected
            if pids - ignore != expected:
                differences[name] = _difference(pids - ignore, expected)
    median = statistics.median(ours)
    result: dict[str, Any] = {
        "rounds": rounds,
        "scan_mode": scan_mode,
        "gpuwatchd_ms": median * 1e3,
        "identical_sets": same,
        "served_rounds": served,
        "answered_rounds": answered,
        "daemon_reading_rounds": daemon_reading,
    }
    if differences:
        result["differences"] = differences
    for name, walls in tools.items():
        ref = statistics.median(walls)
        result[f"{name}_ms"] = ref * 1e3
        result[f"ratio_vs_{name}"] = median / ref if ref else None
    if theirs:
        result["baseline_ms"] = statistics.median(theirs) * 1e3
        ref = statistics.median(tools["fuser"])
        result["baseline_ratio_vs_fuser"] = statistics.median(theirs) / ref if ref else None
    return result


def _start_daemon(host: SimHost, config: Path, source: Path | None) -> subprocess.Popen[bytes]:
    """``gpuwatchd run`` from this checkout, or from the package in ``source``."""
    env = host.env()
    if source is not None:
        env["PYTHONPATH"] = str(source)
    return subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(config)],
        env=env, cwd=source, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _cpu_ticks(pids: Sequence[int]) -> int:
    """utime + stime of ``pids`` (clock ticks; a gone one counts 0)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                fields = handle.read().rpartition(b")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total


def compare_served_ab(
    host: SimHost,
    config: Path,
    files: Sequence[str],
    expected: set[int],
    *,
    rounds: int,
    baseline: Path,
    blocks: int = 3,
) -> dict[str, Any]:
    """Served scans of this checkout and of ``baseline``, each beside a daemon of its own code,
    in alternating blocks (a daemon per block), with fuser in every round; medians.

    A scan counts a daemon's NVML worker as the daemon's own only when it runs the scan's own
    worker file (``gpuwatchd.cli.scan.running_daemon``); a scan from another folder therefore
    never builds on this checkout's daemon, and would be timed walking: each version needs its
    own daemon."""
    from bench.run import _wait_for_view
    from gpuwatchd.collect.procfs import ProcFS

    walls: dict[str, list[float]] = {"ours": [], "base": []}
    cpus: dict[str, list[float]] = {"ours": [], "base": []}  # the scan and its NVML worker
    daemon_cpu: dict[str, float] = {"ours": 0.0, "base": 0.0}  # the daemon's, while serving
    tick = os.sysconf("SC_CLK_TCK")
    fuser: list[float] = []
    served = {"ours": 0, "base": 0}
    answered = {"ours": 0, "base": 0}
    daemon_reading = {"ours": 0, "base": 0}
    same = True
    per_block = max(1, -(-rounds // blocks))
    for source in (None, baseline):  # warm-up: fills the bytecode cache and the page cache
        run_scan(host, config, (), source)
    for _ in range(blocks):
        for name, source in (("base", baseline), ("ours", None)):
            daemon = _start_daemon(host, config, source)
            try:
                wait = functools.partial(_wait_for_view, host, daemon.pid, len(expected))
                if not wait():
                    raise RuntimeError(f"the {name} daemon published no clean view")
                ignore = frozenset({daemon.pid, *ProcFS().children(daemon.pid)})
                before = _cpu_ticks(sorted(ignore))
                for _ in range(per_block):
                    wait()
                    used = resource.getrusage(resource.RUSAGE_CHILDREN)
                    wall, report = run_scan(host, config, (), source)
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    cpus[name].append(
                        after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime
                    )
                    walls[name].append(wall)
                    served[name] += report.get("daemon_view", {}).get("used") is True
                    answered[name] += report.get("daemon_view", {}).get("answered_by") == "daemon"
                    source_name = report.get("nvml_reading", {}).get("source")
                    daemon_reading[name] += source_name == "daemon"
                    same &= scan_pids(report) - ignore == expected
                    tool_wall, _, pids = _run_tool(["fuser", "-v", *files])
                    fuser.append(tool_wall)
                    same &= pids - ignore == expected
                wait()  # the walk the last scan caused, if any, is counted too
                daemon_cpu[name] += (_cpu_ticks(sorted(ignore)) - before) / tick
            finally:
                daemon.terminate()
                daemon.wait(timeout=60)
    ours, base, ref = (statistics.median(v) for v in (walls["ours"], walls["base"], fuser))
    return {
        "rounds": len(walls["ours"]),
        "scan_mode": "served",
        "gpuwatchd_ms": ours * 1e3,
        "baseline_ms": base * 1e3,
        "fuser_ms": ref * 1e3,
        "ratio_vs_fuser": ours / ref,
        "baseline_ratio_vs_fuser": base / ref,
        "identical_sets": same,
        "served_rounds": served["ours"],
        "baseline_served_rounds": served["base"],
        "answered_rounds": answered["ours"],
        "daemon_reading_rounds": daemon_reading["ours"],
        "scan_cpu_ms": statistics.median(cpus["ours"]) * 1e3,
        "baseline_scan_cpu_ms": statistics.median(cpus["base"]) * 1e3,
        "daemon_cpu_ms_per_scan": daemon_cpu["ours"] * 1e3 / len(walls["ours"]),
        "baseline_daemon_cpu_ms_per_scan": daemon_cpu["base"] * 1e3 / len(walls["base"]),
    }


def _standalone(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    from bench.run import _wait_for_view, nvml_state
    from gpuwatchd.collect.procfs import ProcFS

    counts = arg["counts"]
    baseline = Path(arg["baseline"]) if arg.get("baseline") else None
    results = []
    with SimHost(root, gpus=8) as host:
        pool = ProcessPool(root / "scratch", fds=50)
        try:
            holders = pool.set_holders(cuda_devices(host.devices_dir, 64, 8))
            nvml_state(host, pool.holders, 8)
            config = host.config(interval="1s") if arg["served"] else host.config()
            files = [str(p) for p in sorted(host.devices_dir.iterdir())]
            if arg.get("after_daemon"):
                # A node where the daemon ran (and stopped): its compiled policy is kept in
                # state_dir (gpuwatchd/state/compiled_policy.py), so scan reads no YAML.
                daemon = host.start_daemon("run", "--config", str(config))
                try:
                    if not _wait_for_view(host, daemon.pid, len(holders)):
                        raise RuntimeError("the daemon published no clean view")
                finally:
                    daemon.terminate()
                    daemon.wait(timeout=60)
            for count in counts:
                pool.set_fillers(count)
                if arg["served"] and baseline is not None:
                    row = compare_served_ab(
                        host, config, files, set(holders), rounds=arg["rounds"],
                        baseline=baseline,
                    )  # fmt: skip
                elif not arg["served"]:
                    row = compare_cli(
                        host, config, files, set(holders), rounds=arg["rounds"],
                        with_lsof=False, baseline=baseline,
                    )  # fmt: skip
                else:
                    daemon = host.start_daemon("run", "--config", str(config))
                    try:
                        wait = functools.partial(_wait_for_view, host, daemon.pid, len(holders))
                        if not wait():
                            raise RuntimeError("the daemon published no clean view")
                        row = compare_cli(
                            host, config, files, set(holders), rounds=arg["rounds"],
                            with_lsof=False, baseline=baseline, before_each=wait,
                            ignore=frozenset({daemon.pid, *ProcFS().children(daemon.pid)}),
                        )  # fmt: skip
                    finally:
                        daemon.terminate()
                        daemon.wait(timeout=60)
                row["processes"] = count
                results.append(row)
        finally:
            pool.close()
    return {"rows": results}


def main() -> int:
    import argparse
    import tempfile

    from tests.support.simhost import run_in_pid_namespace

    parser = argparse.ArgumentParser(description="whole-process scan against fuser")
    parser.add_argument("counts", nargs="*", type=int, default=[2000], help="other processes")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--served", action="store_true", help="beside a running daemon")
    parser.add_argument(
        "--after-daemon",
        action="store_true",
        help="alone, where a daemon ran before (its compiled policy is in state_dir)",
    )
    parser.add_argument(
        "--baseline", metavar="DIR", help="a folder with another gpuwatchd package, run too"
    )
    args = parser.parse_args()
    baseline = str(Path(args.baseline).resolve()) if args.baseline else None
    with tempfile.TemporaryDirectory(prefix="gw-cliscan-") as tmp:
        result = run_in_pid_namespace(
            "bench.cli_scan:_standalone",
            {"counts": args.counts, "rounds": args.rounds, "served": args.served,
             "baseline": baseline, "after_daemon": args.after_daemon},
            root=Path(tmp),
            timeout=1800,
        )  # fmt: skip
    for row in result["rows"]:
        line = (
            f"{row['processes']:>6} procs  scan {row['gpuwatchd_ms']:7.1f} ms  "
            f"fuser {row['fuser_ms']:7.1f} ms  ratio {row['ratio_vs_fuser']:.2f}  "
            f"same {row['identical_sets']}  mode {row['scan_mode']}  "
            f"served {row['served_rounds']}/{row['rounds']}  "
            f"answered by the daemon {row.get('answered_rounds', 0)}/{row['rounds']}  "
            f"daemon's NVML {row['daemon_reading_rounds']}/{row['rounds']}"
        )
        if "baseline_ms" in row:
            line += (
                f"  baseline {row['baseline_ms']:7.1f} ms "
                f"ratio {row['baseline_ratio_vs_fuser']:.2f}"
            )
        if "baseline_served_rounds" in row:
            line += (
                f" served {row['baseline_served_rounds']}/{row['rounds']}\n"
                f"        CPU per scan (scan + its NVML worker): {row['scan_cpu_ms']:.1f} ms, "
                f"baseline {row['baseline_scan_cpu_ms']:.1f} ms; the daemon's, per scan: "
                f"{row['daemon_cpu_ms_per_scan']:.1f} ms, "
                f"baseline {row['baseline_daemon_cpu_ms_per_scan']:.1f} ms"
            )
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def stale_rounds(
    host: SimHost, config: Path, rounds: int, before_each: Callable[[], object]
) -> dict[str, Any]:
    """Beside a running daemon: a process opens ``nvidia0`` and, the moment the open has
    returned, a whole ``scan --json`` runs; each report must list the opener (docs/scan.md,
    "When a served scan can miss a holder"). Each round starts from a clean view."""
    path = host.devices_dir / "nvidia0"
    missed: list[dict[str, Any]] = []
    served = answered = 0
    reasons: dict[str, int] = {}
    for _ in range(rounds):
        before_each()
        opener = subprocess.Popen(
            ["sh", "-c", f'exec 3<"{path}"; echo opened; exec sleep 600'],
            stdout=subprocess.PIPE,
        )
        try:
            assert opener.stdout is not None
            opener.stdout.readline()  # the open has returned
            _, report = run_scan(host, config)
        finally:
            opener.kill()
            opener.wait()
        view = report.get("daemon_view", {})
        served += view.get("used") is True
        answered += view.get("answered_by") == "daemon"
        reason = str(view.get("reason"))
        reasons[reason] = reasons.get(reason, 0) + 1
        if opener.pid not in scan_pids(report):
            missed.append(view)
    return {"rounds": rounds, "missed": len(missed), "served": served, "answered": answered,
            "reasons": reasons, "missed_views": missed[:3]}  # fmt: skip
