"""``gpuwatchd scan`` beside a running daemon builds on the daemon's holder view (issue 16).

End to end, inside a PID namespace: a real daemon runs on a simulated host with its device
watch; ``scan --json`` then says it used the daemon's view and scanned only the processes it
names (a targeted scan), and finds the same holders as ``scan --full``, which walks all of
``/proc``. A process that opens a device file while the daemon runs is in the next served
scan; once the daemon stops, ``scan`` walks again. The view file itself is hostile input:
garbage, another boot or a dead daemon's view is refused with a reason.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.cli_scan import scan_pids
from gpuwatchd.core.model import HolderScan
from gpuwatchd.served import holders as holder_view
from gpuwatchd.served import nvml as nvml_view
from tests.support.fakenvml import MiB, gpu, process
from tests.support.published import doc, view_clean, wait_for
from tests.support.simhost import SimHost, pid_namespace_command, run_in_pid_namespace

pytestmark = pytest.mark.skipif(
    pid_namespace_command() is None,
    reason="needs a PID namespace (root, or unprivileged user namespaces) for end-to-end tests",
)


def _scan(host: SimHost, config: Path, *extra: str) -> dict[str, Any]:
    result = host.gpuwatchd("scan", "--json", "--config", str(config), *extra)
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def host_served(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with SimHost(root) as host:
        host.spawn("job", [{"open": host.cuda(0)}])
        host.spawn("probe", [{"open": host.dev("nvidiactl")}])
        pids = host.wait_ready("job", "probe")
        host.nvml([gpu(0, allocated=600 * MiB, processes=[process(pids["job"], 600 * MiB)])])
        config = host.config(interval="200ms")
        daemon = host.start_daemon("run", "--config", str(config))
        view = host.state_dir / holder_view.VIEW_FILE
        try:
            wait_for(lambda: view_clean(view))
            served = _scan(host, config)
            full = _scan(host, config, "--full")
            out["served"] = {"view": served["daemon_view"], "mode": served["scan_mode"],
                             "holders": sorted(scan_pids(served))}  # fmt: skip
            out["full"] = {"view": full["daemon_view"], "mode": full["scan_mode"],
                           "holders": sorted(scan_pids(full))}  # fmt: skip
            host.spawn("late", [{"open": host.dev("nvidia0")}])
            pids.update(host.wait_ready("late"))
            late = pids["late"]
            wait_for(lambda: view_clean(view) and late in {h[0] for h in doc(view)["holders"]})
            again = _scan(host, config)
            out["late"] = {"view": again["daemon_view"], "holders": sorted(scan_pids(again))}
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=30)
        after = _scan(host, config)
        out["stopped"] = {"view": after["daemon_view"], "mode": after["scan_mode"]}
        out["pids"] = pids
    return out


def test_scan_beside_the_daemon_builds_on_its_view_and_finds_what_a_walk_finds(
    tmp_path: Path,
) -> None:
    result = run_in_pid_namespace(f"{__name__}:host_served", {}, root=tmp_path, timeout=120)
    pids = result["pids"]
    served, full = result["served"], result["full"]
    assert served["view"]["used"] is True, served["view"]
    assert served["mode"] == "targeted", served["view"]
    assert full["view"]["used"] is False
    assert full["mode"] == "full"
    assert served["holders"] == full["holders"]
    assert {pids["job"], pids["probe"]} <= set(served["holders"])
    assert result["late"]["view"]["used"] is True
    assert pids["late"] in result["late"]["holders"]
    assert result["stopped"]["view"]["used"] is False
    assert result["stopped"]["mode"] == "full"


# --- the daemon's NVML reading ----------------------------------------------------------------


def _scan_env(host: SimHost, config: Path, env: dict[str, str], *extra: str) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "--config", str(config), "scan", *extra],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def host_reading(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with SimHost(root) as host:
        host.spawn("job", [{"open": host.cuda(0)}])
        pids = host.wait_ready("job")
        host.nvml([gpu(0, allocated=600 * MiB, processes=[process(pids["job"], 600 * MiB)])])
        # A long interval: the daemon polls again only when a device file is opened (the
        # scans' own NVML workers), so a file forged here stays until the next scan reads it.
        config = host.config(interval="60s")
        daemon = host.start_daemon("run", "--config", str(config))
        view = host.state_dir / holder_view.VIEW_FILE
        reading = host.state_dir / nvml_view.READING_FILE

        def polled() -> object:
            return doc(reading).get("polled")

        def republished(before: object) -> bool:
            return view_clean(view) and polled() not in (None, before)

        def settled() -> None:
            """Wait until the daemon has stopped re-polling (each device file a scan's NVML
            worker opened may wake it once, a second apart)."""
            last, since = polled(), time.monotonic()
            while time.monotonic() - since < 2.5 or not view_clean(view):
                time.sleep(0.1)
                if polled() != last:
                    last, since = polled(), time.monotonic()

        try:
            wait_for(lambda: republished(None))
            # The scan's own NVML would find nothing: a report with the GPU came from the daemon.
            blind = {**host.env(), "FAKENVML_STATE": str(root / "no-such-state.json")}
            served = _scan_env(host, config, blind, "--json")
            full = _scan_env(host, config, blind, "--json", "--full")
            text = _scan_env(host, config, blind)
            out["served"] = {"code": served.returncode, "stderr": served.stderr,
                             "report": json.loads(served.stdout or "{}")}  # fmt: skip
            out["full"] = {"code": full.returncode}
            out["text"] = text.stdout.splitlines()[:1]
            for name, change in (
                ("garbage", None),
                ("old", {"read_at": time.time() - 300}),
                ("other daemon", {"daemon": {"pid": 1, "start_ticks": 1}}),
            ):
                settled()
                before = polled()
                forged = (
                    b"{not json"
                    if change is None
                    else json.dumps({**doc(reading), **change}).encode()
                )
                reading.write_bytes(forged)  # as the daemon's user, mode 0600: trusted
                stamp = None if change is None else change.get("read_at")
                if isinstance(stamp, float):  # last confirmed then, too (the file's time)
                    os.utime(reading, (stamp, stamp))
                result = _scan_env(host, config, host.env(), "--json")
                report = json.loads(result.stdout or "{}")
                out[name] = {"code": result.returncode, "view": report.get("daemon_view"),
                             "nvml": report.get("nvml_reading"),
                             "gpus": len(report.get("gpus", []))}  # fmt: skip
                wait_for(functools.partial(republished, before))
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=30)
    return out


@pytest.fixture(scope="module")
def reading_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One end-to-end run for the tests below (a daemon start costs seconds)."""
    root = tmp_path_factory.mktemp("reading")
    result: dict[str, Any] = run_in_pid_namespace(
        f"{__name__}:host_reading", {}, root=root, timeout=180
    )
    return result


def test_a_served_scan_takes_the_daemons_fresh_nvml_reading_and_says_so(
    reading_run: dict[str, Any],
) -> None:
    result = reading_run
    served = result["served"]
    assert served["code"] == 0, served["stderr"]
    report = served["report"]
    assert report["daemon_view"]["used"] is True, report["daemon_view"]
    assert report["nvml_reading"]["source"] == "daemon", report["nvml_reading"]
    age = report["nvml_reading"]["age_s"]
    assert isinstance(age, float)
    assert 0.0 <= age <= 61.0
    assert report["gpus"][0]["memory"]["used"] == 600 * MiB
    # The same scan reading NVML itself (--full) finds no driver: the report above was the
    # daemon's reading, and this scan started no NVML worker.
    assert result["full"]["code"] == 69
    assert "NVML: the daemon's reading" in result["text"][0]


@pytest.mark.parametrize("forged", ["garbage", "old", "other daemon"])
def test_a_forged_corrupt_or_stale_daemon_reading_is_not_believed_the_scan_reads_nvml(
    reading_run: dict[str, Any], forged: str
) -> None:
    case = reading_run[forged]
    assert case["code"] == 0
    assert case["view"]["used"] is True, case["view"]
    assert case["nvml"]["source"] == "own", case["nvml"]
    why = {"garbage": "unusable: not JSON", "old": "old (older than 61s)",
           "other daemon": "another process than the running daemon"}  # fmt: skip
    assert why[forged] in case["nvml"]["reason"]
    assert case["gpus"] == 1


# --- the view as hostile input ----------------------------------------------------------------


def _view(**over: Any) -> dict[str, object]:
    doc = holder_view.encode(
        boot_id="b" * 36,
        daemon_pid=100,
        daemon_start_ticks=5000,
        worker_pids=frozenset({101}),
        polled=1000.0,
        fresh_for=31.0,
        settings=("/proc", "/dev", 195),
        holders=HolderScan(mode="full", holdings={}),
        start_ticks={},
        dead_listed=frozenset({7}),
    )
    doc.update(over)
    return doc


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[]",
        b"{" * 100_000,
        json.dumps(_view(version=2)).encode(),
        json.dumps(_view(boot_id=7)).encode(),
        json.dumps(_view(holders=[[0, 1]])).encode(),
        json.dumps(_view(holders=[["1", 1]])).encode(),
        json.dumps(_view(holders=[[1, 2]] * (holder_view.MAX_HOLDERS + 1))).encode(),
        json.dumps(_view(polled="soon")).encode(),
        json.dumps(_view(settings=["/proc", "/dev"])).encode(),
        b" " * (holder_view.MAX_BYTES + 1),
    ],
)
def test_a_malformed_view_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - every reason is a ValueError with a message
        holder_view.parse(raw)


@pytest.mark.parametrize(
    ("now", "boot", "ticks", "settings", "why"),
    [
        (1010.0, "b" * 36, 5000, ("/proc", "/dev", 195), None),
        (1010.0, "c" * 36, 5000, ("/proc", "/dev", 195), "another boot"),
        (1010.0, "b" * 36, None, ("/proc", "/dev", 195), "not running"),
        (1010.0, "b" * 36, 5001, ("/proc", "/dev", 195), "not running"),
        (1010.0, "b" * 36, 5000, ("/proc", "/tmp/dev", 195), "other settings"),
        (1032.0, "b" * 36, 5000, ("/proc", "/dev", 195), "older than"),
    ],
)
def test_a_view_is_used_only_from_this_boot_a_running_daemon_same_settings_and_fresh(
    now: float, boot: str, ticks: int | None, settings: tuple[str, str, int], why: str | None
) -> None:
    view = holder_view.parse(json.dumps(_view()).encode())
    reason = holder_view.usable(
        view, now_wall=now, boot_id=boot, settings=settings, daemon_start_ticks=ticks
    )
    assert (reason is None) if why is None else (reason is not None and why in reason)


def test_a_view_claiming_to_stay_fresh_for_a_day_is_trusted_only_max_fresh() -> None:
    view = holder_view.parse(json.dumps(_view(fresh_for=86400.0)).encode())
    assert view.fresh_for == holder_view.MAX_FRESH
