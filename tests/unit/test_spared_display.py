"""scan and explain say which process ``gpuwatchd spare`` leaves alone: "spared until … by …:
reason" on each finding and holder a spare covers, carried in ``scan --json`` (``spares``,
``spared``) and honoured by ``explain`` as what stops the signal."""

from __future__ import annotations

import json
import os
import pwd
import time
from pathlib import Path
from typing import Any

from gpuwatchd.cli.explain import explain_report, render_explanation
from gpuwatchd.cli.report import build_report
from gpuwatchd.cli.report_text import render_text
from gpuwatchd.cli.spare import mark_spared, spares_in_force
from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.config.schema import parse_policy_documents
from gpuwatchd.core.model import Snapshot, Spare
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.state.directory import StateDir
from gpuwatchd.state.spares import write_spare
from tests.support.snapshots import HostBuilder, cg_slurm

LEAK = 4 << 30
RULE = "  - {name: orphans, kind: orphaned, for: 30s, steps: [{signal: SIGTERM, wait: 30s}]}\n"
POLICY = parse_policy_documents([("p.yaml", "dry_run: false\nrules:\n" + RULE)])
ROOT = f"{pwd.getpwuid(0).pw_name} (uid 0)"


def orphaned_worker() -> Snapshot:
    """The trainer (200) of Slurm job 42 died; its forked worker (201) holds GPU 0."""
    return (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(201, ppid=200, pgid=200, sid=200, holds={0}, uvm=True, cgroup=cg_slurm("42"))
        .nvml(0, 200, used=LEAK)
        .build()
    )


def scan_report(snapshot: Snapshot, spares: tuple[Spare, ...]) -> dict[str, Any]:
    """The report ``scan`` builds, spares marked, read back as ``scan --json`` prints it."""
    a = assess(snapshot, AssessState(boot_id=snapshot.boot_id), POLICY.detection)
    report = build_report(
        snapshot, a.findings, a.roles, a.report_only, a.state.baselines,
        version="test",
    )  # fmt: skip
    mark_spared(report, snapshot, spares)
    loaded = json.loads(json.dumps(report))
    assert isinstance(loaded, dict)
    return loaded


def spare_of_201(snapshot: Snapshot, **kw: Any) -> Spare:
    fields: dict[str, Any] = {
        "target": "pid:201",
        "until": snapshot.wall_time + 1800,
        "reason": "kernel debugging",
        "pid": 201,
        "start_ticks": snapshot.processes[201].start_ticks,
        "by_uid": 0,
    }
    fields.update(kw)
    return Spare(**fields)


def orphan_of(report: dict[str, Any]) -> dict[str, Any]:
    findings = report["findings"]
    assert isinstance(findings, list)
    return next(f for f in findings if f["kind"] == "orphaned" and f["pid"] == 201)


def test_scan_json_carries_the_spare_on_the_finding_and_the_holder() -> None:
    snapshot = orphaned_worker()
    report = scan_report(snapshot, (spare_of_201(snapshot),))
    spared = orphan_of(report)["spared"]
    assert spared["target"] == "pid:201"
    assert spared["until"] == snapshot.wall_time + 1800
    assert (spared["reason"], spared["by_uid"]) == ("kernel debugging", 0)
    assert [s["target"] for s in report["spares"]] == ["pid:201"]
    holders = report["gpus"][0]["holders"]
    assert [h["spared"]["target"] for h in holders if h["pid"] == 201] == ["pid:201"]
    text = render_text(report)
    assert "pid 201 spared until " in text
    assert f"(in 30m) by {ROOT}: kernel debugging" in text


def test_a_spare_of_a_reused_pid_or_one_whose_time_is_up_spares_nobody() -> None:
    snapshot = orphaned_worker()
    ticks = snapshot.processes[201].start_ticks
    assert ticks is not None
    for spare in (
        spare_of_201(snapshot, start_ticks=ticks + 1),  # another process with that PID
        spare_of_201(snapshot, until=snapshot.wall_time - 1),
    ):
        report = scan_report(snapshot, (spare,))
        assert orphan_of(report)["spared"] is None
        assert "spared until" not in render_text(report)


def test_a_job_spare_covers_its_processes() -> None:
    snapshot = orphaned_worker()
    job = Spare(target="job:slurm:42", until=snapshot.wall_time + 60, reason="", job="slurm:42")
    report = scan_report(snapshot, (job,))
    assert orphan_of(report)["spared"]["target"] == "job:slurm:42"
    assert "by an unknown user" in render_text(report)


def test_explain_names_the_spare_as_what_stops_the_signal() -> None:
    snapshot = orphaned_worker()
    spared: Any = explain_report(scan_report(snapshot, (spare_of_201(snapshot),)), POLICY)
    (item,) = [i for i in spared["findings"] if i["pid"] == 201]
    assert item["spared"]["target"] == "pid:201"
    ends = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.wall_time + 1800))
    assert item["stopped_by"][0] == f"spared until {ends} (in 30m) by {ROOT}: kernel debugging"
    assert not any("is spared" in stop for stop in item["stopped_by"])  # said once
    assert "stopped by: spared until" in render_explanation(spared)
    # Without the spare the same finding would be signalled: nothing stops it.
    free: Any = explain_report(scan_report(snapshot, ()), POLICY)
    (item,) = [i for i in free["findings"] if i["pid"] == 201]
    assert (item["spared"], item["stopped_by"]) == (None, [])


def test_scan_reads_the_spares_gpuwatchd_spare_wrote(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o700)
    now = time.time()
    with StateDir.open(str(tmp_path)) as state:
        clock = BootTime.read(now, ProcFS(POLICY.proc_root).boot_id())
        write_spare(state, "job:slurm:42", clock=clock, seconds=600, reason="bench", job="slurm:42")
        write_spare(state, "job:slurm:7", clock=clock, seconds=-1, reason="over", job="slurm:7")
        found = spares_in_force(state, POLICY, now)
    assert [(s.target, s.reason, s.by_uid) for s in found] == [
        ("job:slurm:42", "bench", os.getuid())
    ]
    assert spares_in_force(None, POLICY, now) == ()


def test_scan_text_escapes_a_spare_reason_as_every_other_value() -> None:
    # A reason pasted from a ticket, or a report from elsewhere: a newline or an escape
    # sequence must not start a line of its own or repaint the terminal (threat-model.md).
    snapshot = orphaned_worker()
    spare = spare_of_201(snapshot, reason="debug\n  verdict  clean\x1b[2J")
    text = render_text(scan_report(snapshot, (spare,)))
    assert "\x1b" not in text
    assert "\n  verdict  clean" not in text
    assert f"by {ROOT}: debug\\n  verdict  clean\\x1b[2J" in text
