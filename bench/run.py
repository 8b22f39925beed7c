"""``make bench``: every benchmark of issue 6, a table on stdout and JSON in ``bench/results/``.

Owns the run order, the scales, the summary figures and the targets they are held against. The
whole run re-executes itself as PID 1 of a fresh PID namespace (``unshare --pid --fork
--mount-proc --kill-child``) when one is available, so ``/proc`` holds only the benchmark's own
processes, every count is exact, and everything it started dies with it. Without a namespace it
runs on the host and skips the latency scenarios (they signal processes).

``--quick`` shrinks every figure to a seconds-long smoke run (``tests/system/test_bench_smoke.py``).
Numbers from ``--quick`` mean nothing; only the default run is reported in docs/performance.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench import latency, unit_limits  # noqa: E402
from bench.cli_scan import compare_cli, stale_rounds  # noqa: E402
from bench.host import ProcessPool, cuda_devices  # noqa: E402
from bench.quiet import measure as measure_quiet  # noqa: E402
from bench.scan import CHAR_PROCFS, CHAR_STANDINS, compare  # noqa: E402
from gpuwatchd.collect.procfs import ProcFS  # noqa: E402
from gpuwatchd.served import holders as holder_view  # noqa: E402
from tests.support.fakenvml import MiB, gpu, process  # noqa: E402
from tests.support.simhost import SimHost, pid_namespace_command  # noqa: E402

FULL: dict[str, Any] = {
    "default": (2000, 8),
    "scales": [(500, 8), (8000, 8), (2000, 1), (2000, 16)],
    "holders": 64,
    "fds": 50,
    "scan_rounds": 5,
    "scale_scan_rounds": 3,
    "polls": 240,
    "scale_polls": 120,
    "interval": 5.0,
    "mem_polls": 10000,
    "mem_interval": 0.5,
    "latency_trials": 3,
    "latency_interval": 1.0,
    "latency_for": 1.0,
    "latency_wait": 1.0,
    "cli_scales": [500, 2000, 4000, 8000],
    "cli_rounds": 5,
    "hour_polls": 720,  # an hour at the 5 s interval
    "opens_polls": 180,  # a quarter of an hour, with an open every 30 s
    "quiet_minutes": 5.0,  # the real daemon, wall time, after the warm-up
    "quiet_warmup": 30.0,
    "stale_rounds": 20,  # open a device file, then a served scan at once
}
QUICK: dict[str, Any] = {
    "default": (100, 2),
    "scales": [],
    "holders": 8,
    "fds": 10,
    "scan_rounds": 1,
    "scale_scan_rounds": 1,
    "polls": 24,
    "scale_polls": 12,
    "interval": 5.0,
    "mem_polls": 100,
    "mem_interval": 0.5,
    "latency_trials": 1,
    "latency_interval": 0.2,
    "latency_for": 0.0,
    "latency_wait": 0.3,
    "cli_scales": [100],
    "cli_rounds": 1,
    "hour_polls": 24,
    "opens_polls": 12,
    "quiet_minutes": 0.15,  # two polls at least
    "quiet_warmup": 0.5,
    "stale_rounds": 2,
}
TARGETS = {
    "poll_cpu_median_ms": 5.0,
    "poll_cpu_p99_ms": 15.0,
    "daemon_core_percent": 0.2,
    "scan_ratio": 0.5,
    "rss_mib": 60.0,
    "gone_ms": 50.0,
    "kill_slack_ms": 100.0,
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    at = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[at]


# --- poll loop --------------------------------------------------------------------------------


def nvml_state(host: SimHost, holders: dict[int, tuple[str, ...]], gpus: int) -> None:
    """Every holder is listed by NVML on its GPU with 500 MiB: a healthy, busy node."""
    per_gpu: dict[int, list[dict[str, Any]]] = {index: [] for index in range(gpus)}
    for pid, paths in holders.items():
        minor = int(paths[-1].rsplit("nvidia", 1)[1])
        per_gpu[minor].append(process(pid, 500 * MiB))
    host.nvml(
        [
            gpu(index, allocated=(2 + 500 * len(procs)) * MiB, processes=procs)
            for index, procs in per_gpu.items()
        ]
    )


def run_pollloop(
    host: SimHost, polls: int, interval: float, rss_every: int = 0, open_every: int = 0
) -> dict[str, Any]:
    config = host.config(log={"format": "json"})
    out = host.root / f"poll-{time.monotonic_ns()}.json"
    spec = {
        "config": str(config),
        "polls": polls,
        "virtual_interval": interval,
        "rss_every": rss_every,
        "open_every": open_every,
        "out": str(out),
    }
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "pollloop.py"), json.dumps(spec)],
        env=host.env(),
        check=True,
    )
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def summarise_polls(data: dict[str, Any]) -> dict[str, Any]:
    total = [(d + w) / 1e6 for d, w in zip(data["daemon_ns"], data["worker_ns"], strict=True)]
    daemon = [d / 1e6 for d in data["daemon_ns"]]
    worker = [w / 1e6 for w in data["worker_ns"]]
    targeted = [t for t, full in zip(total, data["full"], strict=True) if not full]
    fulls = [t for t, full in zip(total, data["full"], strict=True) if full]
    # The first poll starts the NVML worker and fills caches: not steady state.
    steady = total[1:]
    interval = data["virtual_interval"]
    return {
        "polls": data["polls"],
        "full_scans": len(fulls),
        "cpu_median_ms": statistics.median(steady),
        "cpu_p99_ms": percentile(steady, 0.99),
        "targeted_median_ms": statistics.median(targeted) if targeted else None,
        "targeted_p99_ms": percentile(targeted, 0.99) if targeted else None,
        "full_median_ms": statistics.median(fulls) if fulls else None,
        "daemon_median_ms": statistics.median(daemon[1:]),
        "worker_median_ms": statistics.median(worker[1:]),
        "core_percent": 100 * statistics.fmean(steady) / 1e3 / interval,
        "daemon_core_percent": 100 * statistics.fmean(daemon[1:]) / 1e3 / interval,
        "findings_last_poll": data["findings_last_poll"],
        "wall_s": data["wall_s"],
    }


def summarise_memory(data: dict[str, Any]) -> dict[str, Any]:
    samples = data["rss"]
    totals = [(s["daemon_kib"] + s["worker_kib"]) / 1024 for s in samples]
    half = len(samples) // 2
    last_half = totals[half:] if half else totals
    return {
        "polls": data["polls"],
        "rss_end_mib": totals[-1] if totals else None,
        "daemon_end_mib": samples[-1]["daemon_kib"] / 1024 if samples else None,
        "worker_end_mib": samples[-1]["worker_kib"] / 1024 if samples else None,
        "growth_last_half_mib": (last_half[-1] - last_half[0]) if last_half else None,
        "max_last_half_mib": max(last_half) if last_half else None,
        "samples": samples,
    }


def daemon_cpu(data: dict[str, Any]) -> dict[str, Any]:
    """CPU of daemon + worker over the whole run (first poll excluded), per virtual hour."""
    cpu = [(d + w) / 1e9 for d, w in zip(data["daemon_ns"], data["worker_ns"], strict=True)][1:]
    seconds = data["virtual_interval"] * len(cpu)
    per_hour = sum(cpu) * 3600 / seconds if seconds else float("nan")
    return {
        "polls": len(cpu),
        "walks": sum(data["full"][1:]),
        "cpu_s_per_hour": per_hour,
        "core_percent": 100 * per_hour / 3600,
    }


# --- whole-process scan, alone and beside a daemon ------------------------------------------


def _wait_for_view(host: SimHost, daemon: int, holders: int, timeout: float = 120.0) -> bool:
    """Wait until daemon ``daemon`` (not an earlier one) has published all ``holders``."""
    path = host.state_dir / holder_view.VIEW_FILE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            view = json.loads(path.read_text())
            if (
                view["daemon"]["pid"] == daemon
                and len(view["holders"]) >= holders
                and view.get("clean") is True
            ):
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    return False


def cli_scans(pool: ProcessPool, root: Path, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """``gpuwatchd scan --json`` as a whole process against fuser (and lsof), at each scale,
    alone and beside a running daemon (which it then builds on)."""
    host = SimHost(root / "cli", gpus=8)
    pool.set_holders(cuda_devices(host.devices_dir, cfg["holders"], 8))
    expected = set(pool.holders)
    nvml_state(host, pool.holders, 8)
    config = host.config(interval="1s")
    files = [str(host.devices_dir / n) for n in ("nvidiactl", "nvidia-uvm")]
    files += [str(host.devices_dir / f"nvidia{i}") for i in range(8)]
    rows = []
    for fillers in cfg["cli_scales"]:
        print(f"[bench] whole-process scan: {fillers} processes", flush=True)
        pool.set_fillers(fillers)
        row: dict[str, Any] = {"processes": fillers}
        row["alone"] = compare_cli(host, config, files, expected, rounds=cfg["cli_rounds"])
        daemon = host.start_daemon("run", "--config", str(config))
        try:
            if _wait_for_view(host, daemon.pid, len(expected)):
                row["with_daemon"] = compare_cli(
                    host,
                    config,
                    files,
                    expected,
                    rounds=cfg["cli_rounds"],
                    with_lsof=False,
                    ignore=frozenset({daemon.pid, *ProcFS().children(daemon.pid)}),
                    before_each=functools.partial(_wait_for_view, host, daemon.pid, len(expected)),
                )
                if fillers == cfg["cli_scales"][0] and cfg["stale_rounds"]:
                    print("[bench] an open, then a served scan at once", flush=True)
                    row["stale"] = stale_rounds(
                        host,
                        config,
                        cfg["stale_rounds"],
                        functools.partial(_wait_for_view, host, daemon.pid, len(expected)),
                    )
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)
        rows.append(row)
    pool.set_fillers(0)
    return rows


# --- one scale point ------------------------------------------------------------------------


def scale_point(
    pool: ProcessPool, root: Path, fillers: int, gpus: int, cfg: dict[str, Any], *, main: bool
) -> dict[str, Any]:
    point_root = root / f"n{fillers}-g{gpus}"
    host = SimHost(point_root, gpus=gpus)
    pool.set_fillers(fillers)
    pool.set_holders(cuda_devices(host.devices_dir, cfg["holders"], gpus))
    expected = set(pool.holders)
    files = [str(host.devices_dir / n) for n in ("nvidiactl", "nvidia-uvm")]
    files += [str(host.devices_dir / f"nvidia{i}") for i in range(gpus)]
    rounds = cfg["scan_rounds"] if main else cfg["scale_scan_rounds"]
    ignore = {os.getpid()}
    result: dict[str, Any] = {"processes": fillers, "gpus": gpus, "holders": len(expected)}
    result["scan_path_mode"] = compare(
        ProcFS(devices_dir=str(host.devices_dir)), files, expected, rounds=rounds, ignore=ignore
    )
    nvml_state(host, pool.holders, gpus)
    polls = cfg["polls"] if main else cfg["scale_polls"]
    result["poll"] = summarise_polls(run_pollloop(host, polls, cfg["interval"]))
    if main and os.getpid() == 1:
        # Device-number mode needs a /proc where nothing else holds /dev/null: our namespace.
        pool.set_holders([list(CHAR_STANDINS)] * cfg["holders"])
        char = compare(
            ProcFS(**CHAR_PROCFS),  # type: ignore[arg-type]
            list(CHAR_STANDINS),
            set(pool.holders),
            rounds=rounds,
            ignore=ignore,
        )
        result["scan_device_mode"] = char
        pool.set_holders(cuda_devices(host.devices_dir, cfg["holders"], gpus))
        nvml_state(host, pool.holders, gpus)
    if main:
        quiet = run_pollloop(host, cfg["hour_polls"], cfg["interval"])
        opens = run_pollloop(host, cfg["opens_polls"], cfg["interval"], open_every=6)
        result["daemon_cpu"] = {"quiet": daemon_cpu(quiet), "opens_every_30s": daemon_cpu(opens)}
        if cfg["quiet_minutes"] > 0:
            print(f"[bench] the real daemon, quiet, {cfg['quiet_minutes']:g} min", flush=True)
            result["daemon_cpu"]["real_quiet"] = measure_quiet(
                host, cfg["quiet_minutes"], cfg["quiet_warmup"]
            )
        mem = run_pollloop(
            host, cfg["mem_polls"], cfg["mem_interval"], rss_every=cfg["mem_polls"] // 20
        )
        result["memory"] = summarise_memory(mem)
    return result


# --- report -----------------------------------------------------------------------------------


def verdict(value: float | None, limit: float) -> str:
    if value is None:
        return "n/a"
    return "ok" if value <= limit else "MISS"


def table(results: dict[str, Any]) -> str:
    main = results["main"]
    rows: list[tuple[str, str, str, str]] = []
    poll = main["poll"]
    rows.append(
        (
            "poll CPU median (daemon+worker)",
            f"{poll['cpu_median_ms']:.2f} ms",
            "<= 5 ms",
            verdict(poll["cpu_median_ms"], TARGETS["poll_cpu_median_ms"]),
        )
    )
    rows.append(
        (
            "poll CPU p99",
            f"{poll['cpu_p99_ms']:.2f} ms",
            "<= 15 ms",
            verdict(poll["cpu_p99_ms"], TARGETS["poll_cpu_p99_ms"]),
        )
    )
    rows.append(
        (
            "  targeted polls median / p99",
            f"{poll['targeted_median_ms']:.2f} / {poll['targeted_p99_ms']:.2f} ms",
            "",
            "",
        )
    )
    if poll["full_median_ms"] is not None:
        rows.append(("  full-scan polls median", f"{poll['full_median_ms']:.1f} ms", "", ""))
    rows.append(
        (
            "daemon CPU at 5 s interval",
            f"{poll['daemon_core_percent']:.3f} % core",
            "<= 0.2 %",
            verdict(poll["daemon_core_percent"], TARGETS["daemon_core_percent"]),
        )
    )
    rows.append(("  daemon+worker at 5 s", f"{poll['core_percent']:.3f} % core", "", ""))
    for mode in ("scan_path_mode", "scan_device_mode"):
        scan = main.get(mode)
        if not scan:
            continue
        for tool in ("fuser", "lsof"):
            ratio = scan[f"ratio_vs_{tool}"]
            rows.append(
                (
                    f"full scan vs {tool} ({mode[5:]})",
                    f"{scan['gpuwatchd_wall_ms']:.0f} / {scan[f'{tool}_wall_ms']:.0f} ms"
                    f" = {ratio:.2f}x",
                    "<= 0.5x",
                    verdict(ratio, TARGETS["scan_ratio"]),
                )
            )
        rows.append(
            (
                f"  holder sets identical ({mode[5:]})",
                str(scan["identical_sets"]),
                "True",
                "ok" if scan["identical_sets"] else "MISS",
            )
        )
    cpu = main.get("daemon_cpu")
    if cpu:
        goals: tuple[tuple[str, str, float | None], ...] = (
            ("quiet", "daemon CPU, quiet node, virtual hour", 0.1),
            ("opens_every_30s", "daemon CPU, an open every 30 s", None),
        )
        real = cpu.get("real_quiet")
        if real and "core_percent" in real:
            rows.append(
                (
                    f"daemon+worker CPU, real daemon, {real['seconds'] / 60:.1f} min quiet",
                    f"{real['core_percent']:.3f} % core = {real['cpu_s_per_hour']:.1f} s/h",
                    "<= 0.1 %",
                    verdict(real["core_percent"], 0.1),
                )
            )
        elif real:
            rows.append(("daemon CPU, real daemon, quiet", str(real.get("error")), "", "MISS"))
        for key, label, goal in goals:
            entry = cpu[key]
            rows.append(
                (
                    label,
                    f"{entry['core_percent']:.3f} % core = {entry['cpu_s_per_hour']:.1f} s/h",
                    "" if goal is None else f"<= {goal} %",
                    "" if goal is None else verdict(entry["core_percent"], goal),
                )
            )
    if poll["targeted_median_ms"] is not None:
        rows.append(
            (
                "steady poll p50 / p99 (issue 16)",
                f"{poll['targeted_median_ms']:.2f} / {poll['targeted_p99_ms']:.2f} ms",
                "<= 2 ms",
                verdict(poll["targeted_median_ms"], 2.0),
            )
        )
    mem = main.get("memory")
    if mem:
        rows.append(
            (
                f"RSS after {mem['polls']} polls",
                f"{mem['rss_end_mib']:.1f} MiB",
                "<= 60 MiB",
                verdict(mem["rss_end_mib"], TARGETS["rss_mib"]),
            )
        )
        rows.append(
            ("  growth over last half", f"{mem['growth_last_half_mib']:+.2f} MiB", "~0", "")
        )
    lat = results.get("latency")
    if lat:
        for key, label, limit in (
            ("gone_ms", "exit seen after SIGTERM exit", "<= 50 ms"),
            ("kill_slack_ms", "SIGKILL after wait, slack", "<= 100 ms"),
            ("acted_slack_ms", "orphan acted, beyond for+interval", "<= 0 ms"),
        ):
            value = lat.get(f"{key}_max")
            limit_v = {"gone_ms": 50.0, "kill_slack_ms": 100.0, "acted_slack_ms": 0.0}[key]
            rows.append(
                (
                    label + " (max)",
                    "n/a" if value is None else f"{value:.1f} ms",
                    limit,
                    verdict(value, limit_v),
                )
            )
    width = max(len(r[0]) for r in rows)
    lines = [f"{'figure':<{width}}  {'measured':<28} {'target':<10} verdict"]
    lines += [f"{a:<{width}}  {b:<28} {c:<10} {d}" for a, b, c, d in rows]
    if results.get("scales"):
        lines.append("")
        lines.append(
            "scale: procs gpus | poll med/p99 ms | targeted med ms | full-poll ms | "
            "%core@5s | scan ms | fuser ms | lsof ms | ratio f/l | same"
        )
        for point in results["scales"]:
            p, s = point["poll"], point["scan_path_mode"]
            lines.append(
                f"  {point['processes']:>5} {point['gpus']:>4} | "
                f"{p['cpu_median_ms']:6.2f}/{p['cpu_p99_ms']:7.1f} | "
                f"{p['targeted_median_ms'] or 0:6.2f} | {p['full_median_ms'] or 0:7.1f} | "
                f"{p['core_percent']:.3f} | {s['gpuwatchd_wall_ms']:6.0f} | "
                f"{s['fuser_wall_ms']:6.0f} | {s['lsof_wall_ms']:6.0f} | "
                f"{s['ratio_vs_fuser']:.2f}/{s['ratio_vs_lsof']:.2f} | {s['identical_sets']}"
            )
    lines += _cli_lines(results.get("cli_scan") or [])
    return "\n".join(lines)


def _cli_lines(cli_scan: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    if cli_scan:
        lines.append("")
        lines.append(
            "whole-process scan --json: procs | alone ms (fuser, lsof) ratio f/l | "
            "beside daemon ms (fuser) ratio | same"
        )
        targets = {500: (None, 1.0), 2000: (1.0, 0.5), 4000: (0.8, None)}
        for row in cli_scan:
            alone, beside = row["alone"], row.get("with_daemon")
            goal_alone, goal_beside = targets.get(row["processes"], (None, None))
            line = (
                f"  {row['processes']:>5} | {alone['gpuwatchd_ms']:6.0f} "
                f"({alone['fuser_ms']:.0f}, {alone['lsof_ms']:.0f}) "
                f"{alone['ratio_vs_fuser']:.2f}/{alone['ratio_vs_lsof']:.2f}"
            )
            if goal_alone is not None:
                line += f" [<= {goal_alone}: {verdict(alone['ratio_vs_fuser'], goal_alone)}]"
            if beside is not None:
                line += (
                    f" | {beside['gpuwatchd_ms']:6.0f} ({beside['fuser_ms']:.0f}) "
                    f"{beside['ratio_vs_fuser']:.2f} {beside['scan_mode']}"
                )
                if goal_beside is not None:
                    line += f" [<= {goal_beside}: {verdict(beside['ratio_vs_fuser'], goal_beside)}]"
            else:
                line += " | (daemon view not ready)"
            same = alone["identical_sets"] and (beside is None or beside["identical_sets"])
            lines.append(line + f" | {same}")
            if beside is not None and "served_rounds" in beside:
                lines.append(
                    f"        served from the view: {beside['served_rounds']}/{beside['rounds']}, "
                    f"answered by the daemon: {beside.get('answered_rounds', 0)}/"
                    f"{beside['rounds']}"
                )
            stale = row.get("stale")
            if stale:
                lines.append(
                    f"        an open, then a served scan at once: {stale['missed']} missed of "
                    f"{stale['rounds']} ({stale['served']} served, {stale.get('answered', 0)} "
                    "of them answered by the daemon; the rest walked) "
                    f"[must be 0: {'ok' if stale['missed'] == 0 else 'MISS'}]"
                )
    return lines


# --- main -------------------------------------------------------------------------------------


def run_all(cfg: dict[str, Any], root: Path) -> dict[str, Any]:
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "pid_namespace": os.getpid() == 1,
        },
        "config": dict(cfg.items()),
    }
    pool = ProcessPool(root / "scratch", fds=cfg["fds"])
    try:
        fillers, gpus = cfg["default"]
        print(f"[bench] default host: {fillers} processes, {gpus} GPUs", flush=True)
        results["main"] = scale_point(pool, root, fillers, gpus, cfg, main=True)
        if os.getpid() == 1 and cfg.get("latency", True):
            print("[bench] latency scenarios", flush=True)
            results["latency"] = latency.run(root / "latency", cfg)
            results["unit_limits"] = unit_limits.measure(root / "unit-limits")
        results["scales"] = [results["main"]]
        for fillers, gpus in cfg["scales"]:
            print(f"[bench] scale: {fillers} processes, {gpus} GPUs", flush=True)
            results["scales"].append(scale_point(pool, root, fillers, gpus, cfg, main=False))
        results["scales"].sort(key=lambda p: (p["gpus"] != 8, p["gpus"], p["processes"]))
        results["cli_scan"] = cli_scans(pool, root, cfg)
    finally:
        pool.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    parser.add_argument("--main-only", action="store_true", help="skip the scale points")
    parser.add_argument("--mem-polls", type=int, help="polls of the memory run (default 10000)")
    parser.add_argument("--no-latency", action="store_true", help="skip the latency scenarios")
    parser.add_argument("--no-namespace", action="store_true", help="run on the host /proc")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.inner and not args.no_namespace and os.getpid() != 1:
        prefix = pid_namespace_command()
        if prefix is not None:
            argv = [*prefix, sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
            return subprocess.run([*argv, "--inner"], check=False).returncode
        print("[bench] no PID namespace: running on the host, latency skipped", flush=True)
    cfg = dict(QUICK if args.quick else FULL)
    if args.main_only:
        cfg["scales"] = []
    if args.mem_polls:
        cfg["mem_polls"] = args.mem_polls
    cfg["latency"] = not args.no_latency
    with tempfile.TemporaryDirectory(prefix="gpuwatchd-bench-") as tmp:
        results = run_all(cfg, Path(tmp))
    text = table(results)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "quick" if args.quick else "bench"
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for path in (out / f"{name}-{stamp}.json", out / f"{name}-latest.json"):
        path.write_text(json.dumps(results, indent=1))
    print(f"[bench] JSON: {out / f'{name}-latest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
