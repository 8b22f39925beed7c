"""``gpuwatchd scan`` beside a running daemon builds on the daemon's holder view (issue 16).

End to end, inside a PID namespace: a real daemon runs on a simulated host with its device
watch; ``scan --json``, answered by the daemon, then says it used the daemon's view and scanned
only the processes it names (a targeted scan), and finds the same holders as ``scan --full``,
which walks all of ``/proc``. A process that opens a device file while the daemon runs is in
the next served scan; once the daemon stops, ``scan`` walks again. The daemon's view is used
only from this boot, for the same settings and while fresh; its NVML reading only while fresh.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.cli_scan import scan_pids
from gpuwatchd.core.model import DeviceHolding, HolderScan
from gpuwatchd.served import holders as holder_view
from gpuwatchd.served import nvml as nvml_view
from tests.support.daemonrun import job_host
from tests.support.fakenvml import MiB
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
        pids = job_host(host, probe=True)
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
        job_host(host)
        # A long interval: the daemon polls again only when a device file is opened.
        config = host.config(interval="60s")
        daemon = host.start_daemon("run", "--config", str(config))
        view = host.state_dir / holder_view.VIEW_FILE
        reading = host.state_dir / nvml_view.READING_FILE

        def polled() -> object:
            return doc(reading).get("polled")

        def republished(before: object) -> bool:
            return view_clean(view) and polled() not in (None, before)

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
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=30)
    return out


@pytest.fixture(scope="module")
def reading_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One end-to-end run for the tests below (a daemon start costs seconds)."""
    root = tmp_path_factory.mktemp("reading")
    return run_in_pid_namespace(f"{__name__}:host_reading", {}, root=root, timeout=180)


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


# --- when the daemon's view and reading are current -------------------------------------------


def _view(**over: Any) -> holder_view.HolderView:
    fields: dict[str, Any] = {
        "boot_id": "b" * 36,
        "daemon_pid": 100,
        "daemon_start_ticks": 5000,
        "worker_pids": frozenset({101}),
        "polled": 1000.0,
        "fresh_for": 31.0,
        "settings": ("/proc", "/dev", 195),
        "holders": HolderScan(mode="full", holdings={}),
        "start_ticks": {},
        "dead_listed": frozenset({7}),
    }
    return holder_view.HolderView.of(**{**fields, **over})


@pytest.mark.parametrize(
    ("now", "boot", "settings", "why"),
    [
        (1010.0, "b" * 36, ("/proc", "/dev", 195), None),
        (1010.0, "c" * 36, ("/proc", "/dev", 195), "another boot"),
        (1010.0, None, ("/proc", "/dev", 195), "another boot"),
        (1010.0, "b" * 36, ("/proc", "/tmp/dev", 195), "other settings"),
        (1032.0, "b" * 36, ("/proc", "/dev", 195), "older than"),
        (994.0, "b" * 36, ("/proc", "/dev", 195), "older than"),  # the clock was set back
    ],
)
def test_a_view_is_used_only_from_this_boot_same_settings_and_fresh(
    now: float, boot: str | None, settings: tuple[str, str, int], why: str | None
) -> None:
    reason = holder_view.usable(_view(), now_wall=now, boot_id=boot, settings=settings)
    assert (reason is None) if why is None else (reason is not None and why in reason)


def test_a_view_claiming_to_stay_fresh_for_a_day_is_trusted_only_max_fresh() -> None:
    view = _view(fresh_for=86400.0)
    now = 1000.0 + holder_view.MAX_FRESH
    assert holder_view.usable(view, now_wall=now, boot_id="b" * 36, settings=view.settings) is None
    late = holder_view.usable(view, now_wall=now + 1, boot_id="b" * 36, settings=view.settings)
    assert f"older than {holder_view.MAX_FRESH:g}s" in str(late)


def test_the_view_leaves_out_the_daemons_own_processes_and_keeps_each_holders_start() -> None:
    view = _view(
        holders=HolderScan(
            mode="full", holdings={p: DeviceHolding(p) for p in (100, 101, 7000, 7001)}
        ),
        start_ticks={7000: 55, 100: 1},
    )
    assert view.holders == {7000, 7001}
    assert view.holder_ticks == {7000: 55, 7001: None}
    assert view.document()["holders"] == [[7000, 55], [7001, None]]


@pytest.mark.parametrize("over", ["holders", "dead_listed"])
def test_a_view_cut_at_max_holders_says_so_and_is_never_served_from(over: str) -> None:
    """A holder the view leaves out would hold nothing to a scan built on it: a view longer
    than MAX_HOLDERS says it is cut (``holders.json`` too), and the daemon declines to use it."""
    many = range(1000, 1001 + holder_view.MAX_HOLDERS)
    field: dict[str, Any] = {
        "holders": HolderScan(mode="full", holdings={p: DeviceHolding(p) for p in many}),
        "dead_listed": frozenset(many),
    }
    view = _view(**{over: field[over]})
    assert (view.cut, view.document()["cut"], _view().document()["cut"]) == (True, True, False)
    reason = holder_view.usable(view, now_wall=1010.0, boot_id="b" * 36, settings=view.settings)
    assert reason == f"cut at {holder_view.MAX_HOLDERS} holders or dead PIDs"
