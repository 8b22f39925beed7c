"""The daemon's pure pieces: the one-line status and what blocks a reset in the final scan."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog
from structlog.testing import capture_logs

from gpuwatchd.act.reset_target import Commands, ResetTarget, progress_record
from gpuwatchd.cli.run import run_daemon
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.config.files import policy_files_key
from gpuwatchd.config.schema import default_policy
from gpuwatchd.core.model import (
    DeviceHolding,
    Finding,
    FindingKind,
    GpuInfo,
    HolderScan,
    NvmlReading,
    ProcessInfo,
    Snapshot,
    XidEvent,
)
from gpuwatchd.core.vocabulary import EventName, ExitCode, LadderStatus, Level, ResetStep
from gpuwatchd.daemon.lifecycle import Daemon
from gpuwatchd.daemon.notify import Notifier, describe_status
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.floor import reset_blockers
from gpuwatchd.decide.health.state import GpuHealthState, HealthState, XidRecord
from gpuwatchd.decide.mig.recovery import InstanceRecovery
from gpuwatchd.decide.plan import state as plan_state
from gpuwatchd.decide.plan.state import Ladder, Latch, PlanState, ResetInFlight, SeenFinding
from gpuwatchd.decide.verdict import UNREADABLE
from gpuwatchd.engine.edges import Pause, PollReport, TakenXids
from gpuwatchd.events.catalogue import render
from gpuwatchd.served.scan_socket import SOCKET_NAME, ScanAnswer
from gpuwatchd.state.directory import StateDir
from gpuwatchd.state.pause import clear_latches
from gpuwatchd.state.saved import STATE
from tests.support.enginerig import W0, Actuator, Clock, Reader, ghost_host
from tests.support.healthcases import GPU0 as HEALTH_GPU0
from tests.support.healthcases import GPU1 as HEALTH_GPU1
from tests.support.healthcases import gpu, health, snap
from tests.support.resetrig import instance_gpu


def snapshot(reading: NvmlReading) -> Snapshot:
    return Snapshot(
        monotonic=1.0,
        wall_time=1.0,
        boot_id="b",
        nvml=reading,
        processes={},
        holders=HolderScan(mode="full"),
    )


def assessment(findings: int = 0) -> Assessment:
    found = tuple(
        Finding(FindingKind.ORPHANED, "GPU-0", 100 + i, 5, "reason") for i in range(findings)
    )
    return Assessment(findings=found, roles=(), report_only={}, state=AssessState())


def ladder(target: str, status: str) -> Ladder:
    return Ladder(
        target=target,
        pid=1,
        start_ticks=1,
        finding_key="k",
        rule="orphans",
        gpu="GPU-0",
        steps=(("SIGTERM", 1.0),),
        step=0,
        due=None,
        status=LadderStatus(status),
        dry_run=False,
        started=0.0,
    )


GPUS = (GpuInfo(0, "GPU-0"), GpuInfo(1, "GPU-1", lost=True))


@pytest.mark.parametrize(
    ("reading", "state", "dry_run", "expected"),
    [
        (
            NvmlReading(available=False, error="no lib"),
            PlanState(),
            True,
            "NVML unavailable: no lib",
        ),
        (
            NvmlReading(available=True, gpus=GPUS[:1]),
            PlanState(),
            False,
            "1 GPU watched, 0 findings, 0 actions under way",
        ),
        (
            NvmlReading(available=True, wedged=True, gpus=GPUS[:1]),
            PlanState(),
            True,
            "driver wedged, 1 GPU watched",
        ),
        (NvmlReading(available=True, gpus=GPUS), PlanState(), True, "1 lost (needs reboot)"),
        (
            NvmlReading(available=True, gpus=GPUS[:1]),
            PlanState(ladders={"a": ladder("a", "active"), "b": ladder("b", "stuck")}),
            False,
            "1 action under way, 1 stuck in D state (needs drain/reboot)",
        ),
        (NvmlReading(available=True, gpus=GPUS[:1]), PlanState(paused=True), False, "paused"),
        (
            NvmlReading(available=True, gpus=GPUS[:1]),
            PlanState(forced_dry_run=True),
            False,
            "forced dry-run",
        ),
        (
            NvmlReading(available=True, gpus=GPUS[:1]),
            PlanState(forced_dry_run=True, forced_reason=f"{UNREADABLE} (moved to x): ..."),
            False,
            "saved state unreadable: forced dry-run",
        ),
        (
            NvmlReading(available=True, gpus=GPUS[:1]),
            PlanState(circuit_open=True),
            False,
            "circuit breaker",
        ),
    ],
    ids=[
        "no-nvml",
        "quiet",
        "wedged",
        "lost",
        "actions-and-stuck",
        "paused",
        "kill-cap",
        "state-unreadable",
        "circuit",
    ],
)
def test_status_line_says_what_an_admin_needs_first(
    reading: NvmlReading, state: PlanState, dry_run: bool, expected: str
) -> None:
    status = describe_status(PollReport(snapshot(reading), assessment(), state), dry_run)
    assert expected in status
    assert "\n" not in status


def test_status_counts_findings() -> None:
    reading = NvmlReading(available=True, gpus=GPUS[:1])
    report = PollReport(snapshot(reading), assessment(3), PlanState())
    assert "3 findings" in describe_status(report, True)


def test_an_nvml_error_in_the_status_line_is_one_short_line_of_text() -> None:
    """The error is the NVML worker's text (a reply up to 64 MiB): a newline in it would be a
    notification of its own to systemd (WATCHDOG=trigger restarts the daemon), and a datagram
    that large is dropped whole, its WATCHDOG=1 with it."""
    error = "no lib\nWATCHDOG=trigger\n" + "x" * 1_000_000
    report = PollReport(snapshot(NvmlReading(False, error=error)), assessment(), PlanState())
    status = describe_status(report, False)
    assert status.startswith("NVML unavailable: no lib\\nWATCHDOG=trigger\\nxxx")
    assert status.endswith("... (retrying)")
    assert "\n" not in status
    assert len(status) < 200


def proc(pid: int, comm: str) -> ProcessInfo:
    return ProcessInfo(pid=pid, start_ticks=1, state="S", ppid=1, pgid=pid, sid=pid, comm=comm)


@pytest.mark.parametrize(
    ("holdings", "unreadable", "blocked_by"),
    [
        ({}, frozenset(), []),
        ({10: DeviceHolding(10, gpu_minors_fd=frozenset({0}))}, frozenset(), [10]),
        ({10: DeviceHolding(10, gpu_minors_map=frozenset({0}))}, frozenset(), [10]),
        (
            {10: DeviceHolding(10, gpu_minors_fd=frozenset({1}), ctl=True, uvm=True)},
            frozenset(),
            [],
        ),
        ({10: DeviceHolding(10, ctl=True)}, frozenset(), [10]),
        ({10: DeviceHolding(10, uvm=True)}, frozenset(), [10]),
        ({}, frozenset({33}), [33]),
        ({99: DeviceHolding(99, gpu_minors_fd=frozenset({0}))}, frozenset({99}), []),
    ],
    ids=[
        "nobody",
        "fd-holder",
        "map-holder",
        "live-job-on-another-gpu",
        "ctl-only",
        "uvm-only",
        "unreadable",
        "ourselves",
    ],
)
def test_final_scan_blockers(
    holdings: dict[int, DeviceHolding], unreadable: frozenset[int], blocked_by: list[int]
) -> None:
    scan = HolderScan(mode="full", holdings=holdings, unreadable=unreadable)
    processes = {pid: proc(pid, f"p{pid}") for pid in (*holdings, *unreadable)}
    reasons = reset_blockers(scan, processes, 0, self_pids=frozenset({99}))
    assert [int(r.split()[1].rstrip(":")) for r in reasons] == blocked_by


def test_unknown_minor_blocks_the_reset() -> None:
    assert reset_blockers(HolderScan(mode="full"), {}, None, frozenset())


@pytest.mark.parametrize(
    ("allocated", "baselines", "expected"),
    [
        (None, {}, None),
        (10 * 1024 * 1024, {}, True),  # within the default baseline + margin
        (2 * 1024**3, {}, False),
        (900 * 1024 * 1024, {"GPU-0": 800 * 1024 * 1024}, True),  # learned baseline
        (1200 * 1024 * 1024, {"GPU-0": 800 * 1024 * 1024}, False),
    ],
)
def test_memory_back_to_baseline_after_a_reset(
    allocated: int | None, baselines: dict[str, int], expected: bool | None
) -> None:
    from gpuwatchd.decide.assess.baselines import back_to_baseline
    from gpuwatchd.decide.policy import Detection

    state = AssessState(baselines=baselines)
    assert back_to_baseline("GPU-0", allocated, state, Detection()) is expected


def _daemon_with_config(tmp_path: Path, text: str) -> tuple[Daemon, Path]:
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(text)
    config.chmod(0o644)
    state_dir = tmp_path / "state"
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=True)
    return Daemon(policy, config_path=str(config)), config


def test_a_rejected_reload_is_kept_in_the_status_until_a_good_policy_loads(
    tmp_path: Path,
) -> None:
    daemon, config = _daemon_with_config(tmp_path, "dry_run: true\n")
    config.write_text("dry_run: maybe\n")
    daemon._do_reload()
    rejected = daemon.status_section()["policy_rejected"]
    assert isinstance(rejected, dict)
    assert "dry_run" in str(rejected["error"])
    daemon.save_state()
    saved = json.loads((tmp_path / "state" / "state.json").read_text())
    assert saved["status"]["policy_rejected"]["error"] == rejected["error"]
    config.write_text("dry_run: true\n")
    daemon._do_reload()
    assert daemon.status_section()["policy_rejected"] is None


def test_a_reload_is_in_the_saved_status_at_once(tmp_path: Path) -> None:
    """`gpuwatchd status` reads the saved state: after a reload to enforcing it must not say
    dry-run until the once-a-minute refresh."""
    daemon, config = _daemon_with_config(tmp_path, "dry_run: true\n")
    assert daemon.save_state()
    saved = json.loads((tmp_path / "state" / "state.json").read_text())
    assert saved["status"]["mode"] == "dry-run"
    config.write_text("dry_run: false\n")
    daemon._do_reload()
    assert daemon.save_state()
    saved = json.loads((tmp_path / "state" / "state.json").read_text())
    assert (saved["status"]["mode"], saved["status"]["dry_run"]) == ("enforcing", False)


def test_a_reload_under_run_dry_run_says_the_dry_run_in_force(tmp_path: Path) -> None:
    """`run --dry-run` stays a dry run whatever a reloaded file says: config.reloaded (like
    daemon.start) says the mode in force, not the file's."""
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text("dry_run: false\n")
    config.chmod(0o644)
    policy = dataclasses.replace(default_policy(), state_dir=str(tmp_path / "state"))
    daemon = Daemon(policy, config_path=str(config), dry_run=True)
    with capture_logs() as logs:
        daemon._do_reload()
    (reloaded,) = [e for e in logs if e["event"] == EventName.CONFIG_RELOADED]
    assert daemon.policy.dry_run
    assert reloaded["dry_run"] is True


def test_a_reload_turns_the_namespace_check_on(tmp_path: Path) -> None:
    """A key the reload does not keep (config.reload_partial) is in force after it: the
    collector checks the namespaces once the reloaded policy says so."""
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text("dry_run: true\n")  # namespace_check: true, its default
    config.chmod(0o644)
    policy = dataclasses.replace(
        default_policy(), state_dir=str(tmp_path / "state"), dry_run=True, namespace_check=False
    )
    daemon = Daemon(policy, config_path=str(config))
    assert not daemon.collector.namespace_check
    daemon._do_reload()
    assert daemon.policy.namespace_check
    assert daemon.collector.namespace_check


def test_a_scan_that_cannot_be_accepted_is_tried_once_until_the_next_poll(tmp_path: Path) -> None:
    """accept() out of file descriptors leaves the connection queued and scan.sock readable:
    the wait woke at once, again and again until the next poll, saying
    ``EventName.DAEMON_SCAN_REQUEST_FAILED`` on every pass. It leaves the socket until the next
    poll now."""
    policy = dataclasses.replace(default_policy(), state_dir=str(tmp_path / "st"), dry_run=True)
    refused = ScanAnswer(False, "not now")
    daemon = Daemon(policy, config_path="/nonexistent.yaml", scan_answer=lambda *_: refused)
    daemon._serving.listen()
    daemon.report = SimpleNamespace(wake_at=daemon.clock() + 0.5)  # type: ignore[assignment]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    with socket.socket(socket.AF_UNIX) as scan:
        scan.connect(str(tmp_path / "st" / SOCKET_NAME))  # queued: the daemon's accept is next
        try:
            top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (top + 16, hard))
            with contextlib.suppress(OSError):
                while True:  # every descriptor below the limit taken
                    held.append(os.dup(0))
            with capture_logs() as logs:
                daemon._wait()
        finally:
            for fd in held:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            daemon._serving.close()
            daemon.host.close()
    failed = [e for e in logs if e["event"] == EventName.DAEMON_SCAN_REQUEST_FAILED]
    assert [e["problem"] for e in failed] == ["accept: Too many open files"]


def test_a_reload_says_the_log_format_needs_a_restart_and_keeps_it(tmp_path: Path) -> None:
    """The log format is set up once, at start (cli/run.py): a reload that changes it says so
    as a key only a restart changes, and the policy in force keeps the one in use."""
    text = f"dry_run: true\nstate_dir: {tmp_path / 'state'}\n"
    daemon, config = _daemon_with_config(tmp_path, text)
    config.write_text(text + "log:\n  format: json\n")
    with capture_logs() as logs:
        daemon._do_reload()
    (partial,) = [e for e in logs if e["event"] == EventName.CONFIG_RELOAD_PARTIAL]
    assert partial["needs_restart"] == ["log.format"]
    assert daemon.policy.log_format == "logfmt"


class _Recorder(Notifier):
    """What the daemon would tell systemd."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []

    def notify(self, message: str) -> None:
        self.sent.append(message)


def test_policy_files_that_stop_validating_show_without_any_reload(tmp_path: Path) -> None:
    """`systemctl reload` checks the files first and sends no signal when they are bad, so the
    daemon reads them again itself when they change: a typo in a drop-in shows at the next
    poll in the status, its exit code and the STATUS line (issue 35, finding 2), and goes
    when the files validate again; the running policy is untouched throughout."""
    daemon, config = _daemon_with_config(tmp_path, "dry_run: true\n")
    daemon._files_key = policy_files_key(str(config))  # as at start
    daemon.notifier = recorder = _Recorder()
    daemon._check_files()  # nothing changed: nothing read, nothing said
    assert daemon.policy_rejected is None
    drop_in = tmp_path / "conf.d" / "90-typo.yaml"
    drop_in.parent.mkdir()
    drop_in.write_text("interval: sometimes\n")
    drop_in.chmod(0o644)
    with capture_logs() as logs:
        daemon._check_files()
        daemon._check_files()  # unchanged since: said once
    (event,) = [e for e in logs if e["event"] == EventName.CONFIG_FILES_REJECTED]
    assert event["log_level"] == "error"
    assert "90-typo.yaml" in event["error"]
    rejected = daemon.status_section()["policy_rejected"]
    assert isinstance(rejected, dict)
    assert "90-typo.yaml" in str(rejected["error"])
    assert daemon.policy.dry_run is True
    assert daemon.policy.interval == default_policy().interval
    daemon.save_state()
    saved = json.loads((tmp_path / "state" / "state.json").read_text())
    assert any("policy files rejected" in a for a in saved["status"]["document"]["attention"])
    reading = NvmlReading(available=True, gpus=GPUS[:1])
    daemon._notify_status(PollReport(snapshot(reading), assessment(), PlanState()))
    assert recorder.sent[-1].startswith("STATUS=policy rejected, running the previous one")
    drop_in.write_text("interval: 10s\n")
    daemon._check_files()
    assert daemon.status_section()["policy_rejected"] is None
    assert daemon.policy.interval == default_policy().interval  # applied only at a reload


def test_a_rejected_reload_while_running_the_fallback_keeps_saying_so(tmp_path: Path) -> None:
    """Started on its last accepted policy, the daemon keeps saying so through a rejected
    reload and files that validate again: only a reload leaves the fallback."""
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text("dry_run: maybe\n")
    config.chmod(0o644)
    policy = dataclasses.replace(default_policy(), state_dir=str(tmp_path / "state"))
    at_start = {"at": 1.0, "error": "old", "at_start": True, "running": "the last accepted"}
    daemon = Daemon(policy, config_path=str(config), rejected_at_start=at_start)
    daemon._files_key = policy_files_key(str(config))
    daemon._do_reload()
    rejected = daemon.status_section()["policy_rejected"]
    assert isinstance(rejected, dict)
    assert rejected["at_start"] is True
    assert rejected["running"] == "the last accepted"
    assert "dry_run" in str(rejected["error"])
    config.write_text("dry_run: true\n")
    daemon._check_files()
    assert daemon.status_section()["policy_rejected"] == rejected
    with capture_logs() as logs:
        daemon._do_reload()
    assert daemon.status_section()["policy_rejected"] is None
    # Leaving the fallback is said, even where the policy itself is the same.
    (reloaded,) = [e for e in logs if e["event"] == EventName.CONFIG_RELOADED]
    assert "dry_run" in reloaded["rejection_ended"]  # the last error said
    said = render(str(EventName.CONFIG_RELOADED), reloaded)
    assert said.startswith("Policy reloaded: the files validate again;"), said
    assert "nothing changed" not in said


def test_the_collector_describes_every_ladders_target_holder_or_not(tmp_path: Path) -> None:
    """A terminal ladder's target that holds nothing is no longer taken for gone (its ladder
    kept, never signalled again while it lives): the daemon's polls read the plan's targets."""
    daemon, _ = _daemon_with_config(tmp_path, "dry_run: true\n")
    assert list(daemon.collector.watched()) == []
    ladders = {
        "7@1": dataclasses.replace(ladder("7@1", "ended"), pid=7),
        "9@1": ladder("9@1", "active"),
    }
    daemon.engine.state.plan = dataclasses.replace(daemon.engine.state.plan, ladders=ladders)
    assert sorted(daemon.collector.watched()) == [1, 7]


def test_actions_are_remembered_for_status_and_written_with_the_state(tmp_path: Path) -> None:
    daemon, _ = _daemon_with_config(tmp_path, "dry_run: true\n")
    sink = daemon.engine.sink
    for pid in range(25):
        sink.emit(EventName.ACTION_SIGNAL, Level.INFO, {"pid": pid, "signal": "SIGTERM",
                                                "outcome": "dry_run", "gpu": "GPU-1",
                                                "dry_run": True})  # fmt: skip
    sink.emit(EventName.FINDING_NEW, Level.WARNING, {"pid": 1})
    actions = daemon.status_section()["recent_actions"]
    assert isinstance(actions, list)
    assert len(actions) == 20
    assert actions[-1]["pid"] == 24
    assert actions[-1]["outcome"] == "dry_run"
    daemon.save_state()
    saved = json.loads((tmp_path / "state" / "state.json").read_text())
    assert saved["status"]["recent_actions"][-1]["pid"] == 24
    assert saved["status"]["mode"] == "dry-run"


def test_the_state_names_the_daemon_before_its_first_poll_starts_the_nvml_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prolog's check-clean knows the daemon's NVML worker only through the PID in the state
    file; written after the first poll, a check in that window saw the worker as a holder."""
    daemon, _ = _daemon_with_config(tmp_path, "dry_run: true\n")
    (tmp_path / "state").mkdir(mode=0o700)
    seen: list[object] = []

    def first_poll() -> None:
        state = tmp_path / "state" / "state.json"
        seen.append(json.loads(state.read_text())["status"]["pid"] if state.exists() else None)
        daemon._stop = True

    monkeypatch.setattr(daemon, "poll_once", first_poll)
    monkeypatch.setattr(daemon, "_install_signal_handlers", lambda: None)
    monkeypatch.setattr(daemon, "_wait", lambda: None)
    daemon.run()
    assert seen == [os.getpid()]


_GOOD_PLAN = PlanState().to_json()
_GOOD = {"version": 1, "assess": AssessState().to_json(), "plan": _GOOD_PLAN}
_REFUSED_STATE = (EventName.STATE_INVALID, EventName.STATE_CORRUPT)


@pytest.mark.parametrize(
    "content",
    [
        json.dumps({**_GOOD, "plan": {**_GOOD_PLAN, "version": 99}}).encode(),
        json.dumps({**_GOOD, "plan": {**_GOOD_PLAN, "ladders": "garbage"}}).encode(),
        json.dumps({**_GOOD, "reset_in_progress": [1]}).encode(),
        json.dumps({**_GOOD, "taken_xids": {"GPU-1": [[48, "noon"]]}}).encode(),
        json.dumps({**_GOOD, "version": 2}).encode(),
        json.dumps({**_GOOD, "version": True}).encode(),  # == 1 in Python, no version 1
        b"{not json",
    ],
    ids=[
        "plan-version",
        "plan-part",
        "reset-record",
        "taken-xids",
        "envelope-version",
        "true",
        "corrupt",
    ],
)
def test_an_unreadable_state_is_kept_aside_and_the_daemon_holds_in_a_latched_dry_run(
    tmp_path: Path, content: bytes
) -> None:
    """Half-done ladders, resets, MIG recoveries and the kill cap's hour are in the state: one
    the daemon cannot read is not overwritten by its next save, and no step is taken until the
    latch lifts (limits.kill_cap_latch, or `resume --clear-latches`)."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / "state.json").write_bytes(content)
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=False)
    daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    with capture_logs() as logs:
        daemon._load_state()
    assert daemon.save_state()
    aside = [p for p in state_dir.iterdir() if p.name.startswith("state.json.corrupt-")]
    assert [p.read_bytes() for p in aside] == [content]
    said = [e for e in logs if e["event"] == EventName.STATE_CORRUPT]
    assert [e["moved_to"] for e in said] == [str(aside[0])]
    plan = daemon.engine.state.plan
    assert plan.forced_dry_run
    assert str(aside[0]) in str(plan.forced_reason)
    saved = json.loads((state_dir / "state.json").read_text())
    document = saved["status"]["document"]
    assert document["effective_mode"] == "forced-dry-run"
    assert str(aside[0]) in document["kill_cap"]["reason"]


def _refusals_said(tmp_path: Path, doc: dict[str, object]) -> list[str]:
    """What loading a state file holding ``doc`` said, refusing it (both events' reason)."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / "state.json").write_text(json.dumps(doc))
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=False)
    with capture_logs() as logs:
        Daemon(policy, config_path=str(tmp_path / "none.yaml"))._load_state()
    said = [e.get("error") or e["why"] for e in logs if e["event"] in _REFUSED_STATE]
    assert len(said) == 2
    return said


@pytest.mark.parametrize("part", ["envelope", "assess", "plan"])
def test_a_saved_version_of_any_size_is_said_cut_short(tmp_path: Path, part: str) -> None:
    """A state file's version is any JSON value, as large as the file: the message refusing
    it (``EventName.STATE_INVALID``'s ``error``, ``EventName.STATE_CORRUPT``'s ``why``) shows it
    cut, as other messages show a hostile value."""
    huge = "9" * 100_000
    parts = {"assess": AssessState().to_json(), "plan": _GOOD_PLAN}
    doc = (
        {**_GOOD, "version": huge}
        if part == "envelope"
        else {**_GOOD, part: {**parts[part], "version": huge}}
    )
    said = _refusals_said(tmp_path, doc)
    assert all("version" in why and "'9999" in why and len(why) < 200 for why in said), said


_HUGE = "k" * 100_000


@pytest.mark.parametrize(
    ("part", "entries"),
    [
        ("assess", {"baselines": {_HUGE: "x"}}),
        ("assess", {"unaccounted_since": {_HUGE: "x"}}),
        ("assess", {"owners": [[_HUGE]]}),
        ("assess", {"inheritance": [{"pid": _HUGE}]}),
        ("plan", {"waiting": {_HUGE: "x"}}),
        ("plan", {"shadow": {**PlanState().shadow.to_json(), "done": {_HUGE: "x"}}}),
    ],
)
def test_a_saved_key_or_entry_of_any_size_is_said_cut_short(
    tmp_path: Path, part: str, entries: dict[str, object]
) -> None:
    """A state file's keys and entries are as large as the file: the reader's message naming
    one (``EventName.STATE_INVALID``'s ``error``, ``EventName.STATE_CORRUPT``'s ``why``) is
    cut as event values are, wherever in the state it was."""
    parts = {"assess": AssessState().to_json(), "plan": _GOOD_PLAN}
    doc = {**_GOOD, part: {**parts[part], **entries}}
    said = _refusals_said(tmp_path, doc)
    assert all("kkkk" in why and len(why) <= 160 for why in said), [w[:200] for w in said]


def test_a_clear_latches_request_left_while_the_daemon_was_down_never_lifts_a_later_latch(
    tmp_path: Path,
) -> None:
    """`resume --clear-latches` run while the daemon is down leaves its request to the next
    start's first poll: it lifts the latches there were when it was made, never the one that
    start set for a saved state it could not read (nobody has looked at it); the event says
    which latch it kept."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    with StateDir.open(str(state_dir)) as directory:
        clear_latches(directory)  # the admin's request, before this start
    (state_dir / "state.json").write_bytes(b"{not json")
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=False)
    daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    daemon.engine.reader, daemon.engine.actuator = Reader(Clock(), ghost_host), Actuator()
    with capture_logs() as logs:
        daemon._load_state()
        daemon.engine.poll(daemon._read_switches())
    assert daemon.engine.state.plan.forced_dry_run, "the unread state's latch holds"
    (cleared,) = [e for e in logs if e["event"] == EventName.LIMITS_LATCHES_CLEARED]
    assert cleared["kept"] == ["node"]
    assert render(str(EventName.LIMITS_LATCHES_CLEARED), cleared).endswith(
        "circuit breaker; kept, set after the request: node."
    )
    assert not (state_dir / "clear-latches").exists(), "the request is taken, once"


@pytest.mark.parametrize("content", [None, json.dumps(_GOOD)])
def test_a_readable_or_missing_state_starts_without_a_latch(
    tmp_path: Path, content: str | None
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    if content is not None:
        (state_dir / "state.json").write_text(content)
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=False)
    daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    daemon._load_state()
    assert not daemon.engine.state.plan.forced_dry_run
    assert [p.name for p in state_dir.iterdir()] == ([] if content is None else ["state.json"])


@pytest.mark.parametrize("mode", [0o660, 0o606])
def test_a_lock_file_that_fails_the_trust_rule_is_an_unusable_state_dir_exit_78(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], mode: int
) -> None:
    """docs/threat-model.md: a lock file writable by group or others is state_dir's fault
    (exit 78, ``EventName.STATE_DIR_UNUSABLE``), not a missing privilege (exit 77) though it
    says EPERM."""
    monkeypatch.setattr(Daemon, "_run_locked", lambda self: 0)  # never polls
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    lock = state_dir / "lock"
    lock.write_text("")
    lock.chmod(mode)
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=True)
    try:
        code = run_daemon(
            policy, config_path=str(tmp_path / "none.yaml"), dry_run=True, once=False,
            once_timeout=1.0,
        )  # fmt: skip
    finally:  # it configures structlog for the whole process: the next test's must not see it
        structlog.reset_defaults()
    assert code == ExitCode.CONFIG
    said = "".join(capfd.readouterr())  # run_daemon configures the log output itself
    assert EventName.STATE_DIR_UNUSABLE in said
    assert EventName.DAEMON_NO_PERMISSION not in said


def test_a_state_dir_replaced_while_running_holds_every_action(tmp_path: Path) -> None:
    """The daemon keeps its state_dir open: once the folder at that path is another (removed
    and made again), a `gpuwatchd pause` written there would go unseen, so nothing is read
    from the old one and the poll is held as for an unusable state_dir."""
    daemon, _ = _daemon_with_config(tmp_path, "dry_run: true\n")
    assert daemon._read_switches().pause == Pause(None, resumed="gpuwatchd resume")
    state_dir = tmp_path / "state"
    state_dir.rename(tmp_path / "old")
    state_dir.mkdir(mode=0o700)
    with capture_logs() as logs:
        assert daemon._read_switches().pause == Pause("state_dir unusable")
    [said] = [e for e in logs if e["event"] == EventName.STATE_DIR_UNUSABLE]
    assert "replaced since the start" in said["error"]


_UUID = "GPU-12345678-1234-1234-1234-123456789abc"
_RECOVERY = InstanceRecovery(
    uuid=_UUID, pci_bus_id="00000000:1A:00.0", gpu_index=0, gi=1, ci=0,
    mig_uuid="MIG-12345678-1234-1234-1234-123456789abd", profile=19, placement=6, size=1,
)  # fmt: skip
_SMI = "/nonexistent/fake-smi"  # never run: the actuator only records
_CGI = (_SMI, "mig", "-i", _UUID, "-cgi", "19:6", "-C")


class _RebootedReader(Reader):
    def read_gpus(self) -> tuple[GpuInfo, ...]:  # MIG mode on, the instance gone
        return (instance_gpu(_RECOVERY, present=False),)


@pytest.mark.parametrize("boot", ["another", "this", "unknown"])
def test_a_half_done_mig_recovery_of_another_boot_is_not_finished_after_the_reboot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, boot: str
) -> None:
    """A reboot takes every MIG instance down: the record the last boot left (its instance
    destroyed, the daemon killed before ``-cgi``) never re-creates it; only the same boot's
    record does. The reset in flight is cleared, nothing booked. So too when the start that
    read it saved the state as this boot's, then died before the resume, and when neither
    boot id is known (a reboot may have given the GPU to a new job: nothing proves the same
    boot, and the resume checks no holder before it runs a command)."""
    if boot == "unknown":
        monkeypatch.setattr(ProcFS, "boot_id", lambda self: None)
    dci = (_SMI, "mig", "-i", _UUID, "-gi", "1", "-ci", "0", "-dci")
    dgi = (_SMI, "mig", "-i", _UUID, "-gi", "1", "-dgi")
    commands = Commands(
        (dci, dgi, _CGI),
        (_SMI, "-q", "-i", _UUID),
        (_SMI, "-i", _UUID, "-pm", "0"),
        (_SMI, "-i", _UUID, "-pm", "1"),
    )
    target = ResetTarget(_UUID, _RECOVERY.pci_bus_id, 0, None, recovery=_RECOVERY)
    progress = {"commands": commands.record(), "persistence_off": False, "units_stopped": [],
                "reset_started": True, "result": None, "commands_done": 2}  # fmt: skip
    flight = ResetInFlight(_UUID, f"ghost_memory:{_RECOVERY.mig_uuid}", False, 100.0, 0.0)
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=False)
    daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    saved_boot = "00000000-0000-0000-0000-0" if boot == "another" else daemon.procfs.boot_id()
    assert (saved_boot is None) == (boot == "unknown")
    state = {
        "boot_id": saved_boot,
        "assess": AssessState().to_json(),
        "plan": dataclasses.replace(PlanState(), reset_in_flight=flight).to_json(),
        "reset_in_progress": progress_record(target, ResetStep.RESET, progress),
    }
    (state_dir / "state.json").write_bytes(STATE.encode(STATE.envelope(state)))
    daemon._load_state()
    assert daemon.save_state()  # the start's first save, before the resume: then it dies
    daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    daemon._load_state()
    actuator = Actuator()
    daemon.engine.actuator = actuator
    daemon.engine.reader = _RebootedReader(Clock(), ghost_host)
    with capture_logs() as logs:
        daemon.engine.resume_interrupted_reset()
    ran = [argv for argv, _ in actuator.commands]
    assert (_CGI in ran) == (boot == "this")
    assert daemon.engine.state.plan.reset_in_flight is None
    if boot != "this":
        assert ran == []
        assert not [e for e in logs if e["event"] == EventName.RESET_OUTCOME]
        (cleared,) = [e for e in logs if e["event"] == EventName.RESET_IN_FLIGHT_CLEARED]
        assert cleared["why"] == "the node rebooted since it was decided on"


@pytest.mark.parametrize("saved_boot", ["none", "this"])
def test_a_state_saved_with_no_boot_id_is_another_boots_and_its_xids_are_forgotten(
    tmp_path: Path, saved_boot: str
) -> None:
    """The start takes a state saved with no boot id for another boot's
    (``EventName.STATE_NEW_BOOT``): its health history is that boot's (the reboot cleared what its
    Xids asked for) and is forgotten, as a new boot id read by a poll forgets it, also across a save
    before the first poll. This boot's is kept."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=False)
    daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    boot = daemon.procfs.boot_id() if saved_boot == "this" else None
    history = HealthState(gpus={_UUID: GpuHealthState(xids={79: XidRecord(1, 100.0, 100.0)})})
    state = {
        "boot_id": boot,
        "assess": AssessState(boot_id=boot, health=history).to_json(),
        "plan": PlanState().to_json(),
    }
    (state_dir / "state.json").write_bytes(STATE.encode(STATE.envelope(state)))
    for _ in range(2):  # the start's first save, then it dies before its first poll
        daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
        daemon._load_state()
        assert daemon.engine.state.assess.health == (history if boot else HealthState())
        assert daemon.save_state()


@dataclass
class _XidReader(Reader):
    """GPUs 0 and 1. The first poll's reading takes Xid 48 of GPU ``first``; a reading of the
    GPUs between polls (a reset procedure's) takes Xid 48 of GPU 1."""

    first: int = 0
    polls: int = 0

    def collect(self) -> Snapshot:
        self.polls += 1
        xid = XidEvent(48, self.clock.wall())
        gpus = [gpu(0, HEALTH_GPU0, health()), gpu(1, HEALTH_GPU1, health())]
        if self.polls == 1:
            gpus[self.first] = gpu(self.first, gpus[self.first].uuid, health(xids=(xid,)))
        return snap(*gpus, t=self.clock.now)

    def read_gpus(self) -> tuple[GpuInfo, ...]:
        xid = XidEvent(48, self.clock.wall())
        return gpu(0, HEALTH_GPU0, health()), gpu(1, HEALTH_GPU1, health(xids=(xid,)))


@pytest.mark.parametrize(
    ("taken", "boot"),
    [("by a poll", "this"), ("between polls", "this"), ("between polls", "another")],
)
def test_an_xid_that_asks_for_a_reset_is_still_known_after_a_stop_before_the_reset(
    tmp_path: Path, taken: str, boot: str
) -> None:
    """NVML delivers an Xid event once, and with ``health.kernel_log`` off nothing reads it
    again. Xid 48 of GPU 1 (reset it), then a stop before its reset, then a start: one a poll
    read is in the health history the state file keeps; one a reading between polls took (GPU
    0's reset reading it again) waited in memory for the next poll, and the stop lost it: the
    restarted daemon never reset GPU 1. The state file keeps it too (``taken_xids``), for this
    boot only: a reboot re-initialises every GPU."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=False)
    daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    first = _XidReader(Clock(), ghost_host, first=1 if taken == "by a poll" else 0)
    daemon.engine.reader, daemon.engine.actuator = first, Actuator()
    daemon._stop = taken == "by a poll"  # SIGTERM: a reset not started is left
    daemon.engine.poll()  # its checkpoint saves the state: then a stop (or a crash)
    assert [argv[-1] for argv in reset_argvs(daemon)] == ([] if daemon._stop else [HEALTH_GPU0])
    if boot == "another":
        saved = json.loads((state_dir / "state.json").read_text())
        (state_dir / "state.json").write_bytes(STATE.encode({**saved, "boot_id": "another"}))
    daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    daemon._load_state()
    daemon.engine.reader = _XidReader(Clock(600.0), ghost_host, polls=1)
    daemon.engine.actuator = Actuator()
    found = [(f.kind, f.gpu) for f in daemon.engine.poll().assessment.findings]
    expected = [(FindingKind.RESET_REQUIRED, HEALTH_GPU1)] if boot == "this" else []
    assert found == expected
    assert [argv[-1] for argv in reset_argvs(daemon)] == [gpu for _, gpu in expected]


def test_a_checkpoint_saves_the_xid_events_a_reading_took_since_the_last_one(
    tmp_path: Path,
) -> None:
    """A reading inside a reset (its health check, each second of an NVLink fabric wait)
    takes Xid events, and the reset's next step checkpoints: the state file has them then,
    though nothing else changed (a crash keeps them)."""
    daemon, _ = _daemon_with_config(tmp_path, "dry_run: true\n")
    (tmp_path / "state").mkdir(mode=0o700)
    daemon.engine.reader = _XidReader(Clock(), ghost_host, polls=1)
    daemon.engine.poll()
    target = ResetTarget(uuid=HEALTH_GPU0, pci_bus_id=None, minor=0, persistence_was_on=False)
    daemon.engine.memory_back_to_baseline(target)  # takes GPU 1's Xid 48
    assert daemon.save_state()
    saved = json.loads((tmp_path / "state" / "state.json").read_text())
    assert saved["taken_xids"] == {HEALTH_GPU1: [[48, W0]]}


def test_a_save_that_finds_nothing_changed_encodes_no_taken_xids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each poll's checkpoint compares the Xids taken as they are in memory and encodes them
    only for a write: a quiet node's poll builds no JSON of them."""
    daemon, _ = _daemon_with_config(tmp_path, "dry_run: true\n")
    (tmp_path / "state").mkdir(mode=0o700)
    assert daemon.save_state()

    def encode(self: TakenXids) -> dict[str, object]:
        raise AssertionError("taken Xids encoded for a save that writes nothing")

    monkeypatch.setattr(TakenXids, "to_json", encode)
    assert daemon.save_state()


def test_the_threat_model_names_every_section_of_the_state_file(tmp_path: Path) -> None:
    """docs/threat-model.md says what state.json holds, each of its top-level keys by name."""
    daemon, _ = _daemon_with_config(tmp_path, "dry_run: true\n")
    (tmp_path / "state").mkdir(mode=0o700)
    assert daemon.save_state()
    saved = json.loads((tmp_path / "state" / "state.json").read_text())
    doc = Path(__file__).parents[2].joinpath("docs", "threat-model.md").read_text()
    said = doc.partition("What is in it: `state.json` (")[2].partition("),\n")[0]
    assert [key for key in saved if f"`{key}`" not in said] == []


def reset_argvs(daemon: Daemon) -> list[tuple[str, ...]]:
    assert isinstance(daemon.engine.actuator, Actuator)
    return [argv for argv, _ in daemon.engine.actuator.commands if "--gpu-reset" in argv]


def test_slow_work_before_ready_extends_the_units_start_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """READY=1 comes after the first completed poll, and systemd ends a start that outlasts
    TimeoutStartSec=2min: a reset resumed at start, or begun by the first poll (reset.timeout
    and each hook up to 10 min), was killed half done and resumed again at each restart, its
    hooks run again, until the start limit left the node unwatched. Slow work before READY=1
    now extends the start timeout as it runs; after it, it only feeds the watchdog."""
    daemon, _ = _daemon_with_config(tmp_path, "dry_run: true\n")
    (tmp_path / "state").mkdir(mode=0o700)
    daemon.notifier = recorder = _Recorder()
    extend = "WATCHDOG=1\nEXTEND_TIMEOUT_USEC=60000000"

    def first_poll() -> None:
        daemon._fed(lambda: None)  # a reset the first poll runs
        daemon._stop = True

    monkeypatch.setattr(daemon.engine, "resume_interrupted_reset", lambda pause: None)
    monkeypatch.setattr(daemon, "poll_once", first_poll)
    monkeypatch.setattr(daemon, "_install_signal_handlers", lambda: None)
    monkeypatch.setattr(daemon, "_wait", lambda: None)
    daemon.run()
    assert recorder.sent[:3] == [extend, extend, "READY=1"]  # the resume's, the poll's
    daemon._fed(lambda: None)
    assert recorder.sent[-1] == "WATCHDOG=1"


def test_the_nvml_worker_is_stopped_before_the_lock_is_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scan or check-clean beside the daemon knows its NVML worker only as a child of the
    lock's holder: with the lock released first, a prolog's check-clean in between saw the
    stopping daemon's worker as a holder of every GPU it had open (not clean)."""
    daemon, _ = _daemon_with_config(tmp_path, "dry_run: true\n")
    (tmp_path / "state").mkdir(mode=0o700)
    holders: list[int | None] = []
    stop = daemon.nvml.stop

    def stop_worker() -> bool:
        holders.append(daemon.store.directory().lock_holder())
        return stop()

    monkeypatch.setattr(daemon.nvml, "stop", stop_worker)
    monkeypatch.setattr(daemon, "poll_once", lambda: setattr(daemon, "_stop", True))
    monkeypatch.setattr(daemon, "_install_signal_handlers", lambda: None)
    monkeypatch.setattr(daemon, "_wait", lambda: None)
    assert daemon.run() == ExitCode.OK
    assert holders == [os.getpid()]


def test_a_hostile_saved_boot_id_is_shown_cut_in_the_new_boot_event(tmp_path: Path) -> None:
    """The saved boot id is the state file's (as large as the file, any JSON value): the
    ``EventName.STATE_NEW_BOOT`` event showed it whole; it shows it as event values are, escaped and
    cut (none stays none)."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir))
    for saved, shown in (("b\n" + "x" * 1_000_000, "b\\n" + "x" * 154 + "..."), (None, None)):
        state = {"boot_id": saved, "plan": PlanState().to_json()}
        (state_dir / "state.json").write_bytes(STATE.encode(STATE.envelope(state)))
        daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
        with capture_logs() as logs:
            daemon._load_state()
        (event,) = [e for e in logs if e["event"] == EventName.STATE_NEW_BOOT]
        assert event["saved_boot_id"] == shown


@pytest.mark.parametrize("same", [True, False], ids=["the-daemon", "its-pid-reused"])
def test_reload_signals_the_lock_holder_only_while_its_pid_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, same: bool
) -> None:
    """`gpuwatchd reload` found the daemon as the lock's holder, then sent SIGHUP to its PID:
    a daemon that exited in between left a PID another process may take, and SIGHUP ends
    most. It is sent through a pidfd now, to the process judged (its start time) or none."""
    from gpuwatchd.cli import reload

    (tmp_path / "state").mkdir(mode=0o700)
    policy = dataclasses.replace(default_policy(), state_dir=str(tmp_path / "state"))
    child = subprocess.Popen(["sleep", "1000"])
    try:
        judged = ProcFS().read_process(child.pid)
        assert judged is not None
        assert judged.start_ticks is not None
        if not same:
            judged = dataclasses.replace(judged, start_ticks=judged.start_ticks - 1)
        monkeypatch.setattr(reload, "lock_holder", lambda *_: (judged, ""))
        code = reload.reload_command(policy, "gpuwatchd.yaml")
        if same:
            assert (code, child.wait(5)) == (ExitCode.OK, -signal.SIGHUP)
        else:
            assert code == reload.NOT_RUNNING
            with pytest.raises(subprocess.TimeoutExpired):
                child.wait(0.3)  # not signalled
    finally:
        child.kill()
        child.wait()


def test_a_reload_asked_before_the_first_poll_completes_sends_no_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd takes READY=1 as the end of the start (`systemctl start` returns when the daemon
    is really watching): a SIGHUP during the start (a reset resumed, say) made the reload say
    RELOADING=1 and READY=1 before the first poll. It reloads as before, silently."""
    daemon, _ = _daemon_with_config(tmp_path, "dry_run: true\n")
    (tmp_path / "state").mkdir(mode=0o700)
    daemon.notifier = recorder = _Recorder()
    before_the_poll: list[str] = []

    def first_poll() -> None:
        before_the_poll.extend(recorder.sent)
        daemon._stop = True

    monkeypatch.setattr(
        daemon.engine, "resume_interrupted_reset", lambda pause: setattr(daemon, "_reload", True)
    )
    monkeypatch.setattr(daemon, "poll_once", first_poll)
    monkeypatch.setattr(daemon, "_install_signal_handlers", lambda: None)
    monkeypatch.setattr(daemon, "_wait", lambda: None)
    with capture_logs() as logs:
        daemon.run()
    assert EventName.CONFIG_RELOADED in [e["event"] for e in logs]
    assert not [m for m in before_the_poll if m.startswith(("READY=", "RELOADING="))]
    assert "READY=1" in recorder.sent


def _old_plan(boot: str | None) -> PlanState:
    """A plan saved in boot ``boot`` with times on both clocks and a reset in flight."""
    return PlanState(
        boot_id=boot,
        seen={"ghost_memory:x": SeenFinding(5000.0, "d", _UUID, None)},
        quiet_until={_UUID: 9000.0},
        reset_history=((_UUID, 1.0e9),),
        reset_in_flight=ResetInFlight(_UUID, "ghost_memory:x", False, 5000.0, 0.0),
        signal_history=(("1@2", 5000.0),),
        scope_latches={"uid:1000": Latch("cap", 1.0e9, 5000.0)},
        mig_unfinished={
            _RECOVERY.mig_uuid: plan_state.MigUnfinished(_UUID, 1, 19, 6, 1, 5000.0, "failed")
        },
    )


@pytest.mark.parametrize("saved_boot", ["none", "this"])
def test_a_plan_saved_with_no_boot_id_is_another_boots_and_its_monotonic_times_are_dropped(
    tmp_path: Path, saved_boot: str
) -> None:
    """A plan saved with no boot id, read by a start that takes it for another boot's
    (``EventName.STATE_NEW_BOOT``), loses what a poll reading a new boot id drops: its first-seen
    times, quiet windows, kill-cap history and half-done MIG recovery are on the old boot's
    monotonic clock (restarted near 0 by the reboot). Its reset history and latch are kept, the
    latch's monotonic anchor dropped; the reset in flight is left to the resume, which says it
    clears it. This boot's plan is kept whole, also across a save before the first poll."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=False)
    daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    boot = daemon.procfs.boot_id() if saved_boot == "this" else None
    plan = _old_plan(boot)
    flight = plan.reset_in_flight
    state = {"boot_id": boot, "assess": AssessState(boot_id=boot).to_json(), "plan": plan.to_json()}
    (state_dir / "state.json").write_bytes(STATE.encode(STATE.envelope(state)))
    for _ in range(2):  # the start's first save, then it dies before its first poll
        daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
        daemon._load_state()
        loaded = daemon.engine.state.plan
        if boot is not None:
            assert loaded == plan
        else:
            assert (loaded.seen, loaded.quiet_until, loaded.signal_history) == ({}, {}, ())
            assert loaded.mig_unfinished == {}
            assert loaded.scope_latches == {"uid:1000": Latch("cap", 1.0e9, None)}
            assert (loaded.reset_history, loaded.reset_in_flight) == (plan.reset_history, flight)
        assert daemon.save_state()


@pytest.mark.parametrize("saved_boot", ["none", "read"])
def test_a_start_that_cannot_read_the_boot_id_takes_the_plans_monotonic_times_for_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved_boot: str
) -> None:
    """A boot id that cannot be read proves no same boot: the plan's monotonic times were kept
    and measured on this boot's monotonic clock (an old boot's quiet window held for that boot's
    uptime, a deadline passed at once), and the first poll, reading no id, dropped nothing. The
    start now drops them as for a plan saved with no boot id (``EventName.STATE_NEW_BOOT``, also
    when neither id is known), and keeps what only a reboot would have ended on the GPU (a
    refused reset, a half-done MIG recovery, a drain done): this may be the same boot."""
    monkeypatch.setattr(ProcFS, "boot_id", lambda self: None)
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=False)
    boot = "11111111-2222-3333-4444-555555555555" if saved_boot == "read" else None
    plan = dataclasses.replace(
        _old_plan(boot),
        last_wall=1.0e9,
        last_monotonic=5000.0,
        reset_refusals={_UUID: plan_state.ResetRefusal("ghost_memory:x", "refused", True, 1.0e9)},
        health_drained={_UUID: False},
    )
    flight = plan.reset_in_flight
    state = {"boot_id": boot, "assess": AssessState(boot_id=boot).to_json(), "plan": plan.to_json()}
    (state_dir / "state.json").write_bytes(STATE.encode(STATE.envelope(state)))
    for _ in range(2):  # the start's first save (with no boot id), then the next start
        daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
        with capture_logs() as logs:
            daemon._load_state()
        loaded = daemon.engine.state.plan
        dropped = (loaded.seen, loaded.quiet_until, loaded.signal_history, loaded.last_monotonic)
        assert dropped == ({}, {}, (), None)
        assert loaded.scope_latches == {"uid:1000": Latch("cap", 1.0e9, None)}
        assert (loaded.reset_history, loaded.reset_in_flight) == (plan.reset_history, flight)
        kept = (loaded.reset_refusals, loaded.mig_unfinished, loaded.health_drained)
        assert kept == (plan.reset_refusals, plan.mig_unfinished, plan.health_drained)
        said = [e["boot_id"] for e in logs if e["event"] == EventName.STATE_NEW_BOOT]
        assert said == [None]
        assert daemon.save_state()


def test_the_stop_writes_the_last_polls_wall_time_so_a_restart_sees_a_clock_set_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan's ``last_wall`` is in no save key (it moves every poll), so the file kept the
    one of the minute's first write, and a start after a stop missed a backward wall-clock
    step smaller than its age (a reset's time then later than an Xid after it). The stop
    writes the last poll's."""
    daemon, _ = _daemon_with_config(tmp_path, "dry_run: true\n")
    (tmp_path / "state").mkdir(mode=0o700)
    walls = iter([1200.0, 1230.0])

    def poll() -> None:  # a quiet poll: only its wall time moves
        daemon.last_poll_wall = wall = next(walls)
        daemon.engine.state.plan = dataclasses.replace(daemon.engine.state.plan, last_wall=wall)
        daemon.save_state()
        daemon._stop = wall == 1230.0

    monkeypatch.setattr(daemon, "poll_once", poll)
    monkeypatch.setattr(daemon, "_install_signal_handlers", lambda: None)
    monkeypatch.setattr(daemon, "_wait", lambda: None)
    assert daemon.run() == ExitCode.OK
    saved = json.loads((tmp_path / "state" / "state.json").read_text())
    assert saved["plan"]["last_wall"] == 1230.0


def test_a_clear_latches_request_taken_by_a_poll_that_crashes_is_not_lost(tmp_path: Path) -> None:
    """The poll took the request (the file removed) and lifted the latch in memory, said so
    (``EventName.LIMITS_LATCHES_CLEARED``), then crashed reading the GPUs before its
    checkpoint: the next start found the latch saved, and the request gone. The lifted latch is
    saved at once."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=False)
    daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    latched = PlanState(forced_dry_run=True, forced_reason="kill cap", forced_since=1.0)
    daemon.engine.restore(dataclasses.replace(daemon.engine.state, plan=latched))
    assert daemon.save_state()
    with StateDir.open(str(state_dir)) as directory:
        clear_latches(directory)

    def crash() -> Snapshot:
        raise OSError("EIO reading the GPUs")

    daemon.engine.reader = Reader(Clock(), ghost_host)
    daemon.engine.reader.collect = crash  # type: ignore[method-assign]
    with pytest.raises(OSError, match="EIO"):
        daemon.engine.poll(daemon._read_switches())
    daemon.store.close()
    again = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    again._load_state()
    assert not again.engine.state.plan.forced_dry_run, "the admin's request was lost"
    again.store.close()
