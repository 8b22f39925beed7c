"""The Prometheus metrics (gpuwatchd/daemon/metrics.py, docs/metrics.md): what is written, how,
and that the shipped alert rules and dashboard use only metrics that exist.

Snapshots are hand-built (tests/support/snapshots.py) and assessed for real; the file is parsed
back with prometheus_client's own parser. The engine's event fields are checked by feeding a
simulated scenario's timeline to :meth:`Metrics.observe`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd import __version__
from gpuwatchd.config.schema import default_policy
from gpuwatchd.core.model import (
    MIB,
    FindingKind,
    GpuHealth,
    GpuInfo,
    HolderScan,
    NvmlReading,
    Snapshot,
    Support,
    XidEvent,
)
from gpuwatchd.core.vocabulary import EventName, LadderStatus, Level
from gpuwatchd.daemon.lifecycle import Daemon
from gpuwatchd.daemon.metrics import TEXTFILE_MODE, Metrics, remove_textfile, write_textfile
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.plan.state import Ladder, PlanState
from gpuwatchd.decide.policy import Detection, MetricsPolicy, Policy
from gpuwatchd.decide.verdict import NodeVerdict, judge
from gpuwatchd.engine.edges import PollReport
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.sim.simulation import simulate
from tests.support.snapshots import GIB, HostBuilder, gpu_uuid

REPO = Path(__file__).resolve().parents[2]
CONTRIB = [
    *sorted((REPO / "contrib" / "prometheus").glob("*.yml")),
    *sorted((REPO / "contrib" / "grafana").glob("*.json")),
]
ALERTS = REPO / "contrib" / "prometheus" / "gpuwatchd-alerts.yml"
WALL = 1_700_000_123.5

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples_of(text: str) -> Samples:
    """Every sample of an exposition text, keyed by (name, labels)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def gpu(index: int) -> dict[str, str]:
    return {"gpu": gpu_uuid(index), "index": str(index)}


def host() -> Snapshot:
    """GPU 0: a live trainer; 1: ghost memory; 2: a live owner without a memory figure;
    3: memory unreadable; 4: lost; 5: MIG."""
    return (
        HostBuilder()
        .gpu(0, allocated=900 * MIB)
        .proc(100, holds={0}, uvm=True)
        .nvml(0, 100, used=800 * MIB)
        .gpu(1, allocated=4 * GIB)
        .nvml(1, 555, used=None)  # a dead PID: not accounted, and not a live owner
        .gpu(2, allocated=3 * GIB)
        .proc(200, holds={2}, uvm=True)
        .nvml(2, 200, used=None)
        .gpu(3, memory_known=False)
        .gpu(4, allocated=1 * GIB, lost=True)
        .gpu(5, allocated=1 * GIB, mig=True)
        .build()
    )


def assessed(snapshot: Snapshot) -> Assessment:
    return assess(snapshot, AssessState(), Detection())


def poll(
    metrics: Metrics,
    snapshot: Snapshot,
    state: PlanState | None = None,
    *,
    dry_run: bool = True,
    seconds: float = 0.25,
    rejected: bool = False,
) -> str | None:
    report = PollReport(
        snapshot, assessed(snapshot), state or PlanState(), seconds=seconds, started_wall=WALL
    )
    return metrics.after_poll(report, dry_run=dry_run, policy_rejected=rejected)


@pytest.fixture
def textfile(tmp_path: Path) -> Path:
    folder = tmp_path / "node-exporter"
    folder.mkdir()
    return folder / "gpuwatchd.prom"


@pytest.fixture
def restrictive_umask() -> Iterator[None]:
    old = os.umask(0o077)  # the unit's UMask=
    try:
        yield
    finally:
        os.umask(old)


def written(path: Path) -> Samples:
    return samples_of(path.read_text())


# --- the file ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("restrictive_umask")
def test_the_file_is_written_whole_readable_by_node_exporter_and_parses(textfile: Path) -> None:
    textfile.write_text("old\n")
    old_inode = textfile.stat().st_ino
    assert poll(Metrics(str(textfile)), host()) is None
    mode = textfile.stat()
    assert stat.S_IMODE(mode.st_mode) == TEXTFILE_MODE  # despite UMask=0077
    assert mode.st_ino != old_inode  # renamed over, not rewritten in place
    assert sorted(p.name for p in textfile.parent.iterdir()) == ["gpuwatchd.prom"]
    samples = written(textfile)
    assert value(samples, "gpuwatchd_build_info", version=__version__) == 1
    assert value(samples, "gpuwatchd_last_successful_poll_timestamp_seconds") == WALL + 0.25


def test_a_link_at_the_path_is_replaced_not_followed(tmp_path: Path, textfile: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    textfile.symlink_to(victim)
    write_textfile(str(textfile), b"x 1\n")
    assert victim.read_text() == "keep\n"
    assert not textfile.is_symlink()
    assert textfile.read_text() == "x 1\n"


def test_a_folder_on_the_path_swapped_for_a_link_is_not_followed(tmp_path: Path) -> None:
    """node_exporter's folder (or one above it) is often another user's: one replaced by a
    link to elsewhere makes the write fail (logged), and nothing is written through it."""
    owned_by_exporter = tmp_path / "prometheus"
    (owned_by_exporter / "node-exporter").mkdir(parents=True)
    textfile = owned_by_exporter / "node-exporter" / "gpuwatchd.prom"
    metrics = Metrics(str(textfile))
    assert poll(metrics, host()) is None
    elsewhere = tmp_path / "etc-cron.d"
    elsewhere.mkdir()
    owned_by_exporter.rename(tmp_path / "moved")
    owned_by_exporter.symlink_to(elsewhere)
    (elsewhere / "node-exporter").mkdir()
    with structlog.testing.capture_logs() as logs:
        error = poll(metrics, host())
    assert error is not None
    assert "symbolic link" in error
    assert list((elsewhere / "node-exporter").iterdir()) == []
    assert [e["event"] for e in logs] == [EventName.METRICS_WRITE_FAILED]


def test_a_failed_rename_leaves_the_old_file_and_no_temporary_file(
    textfile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    textfile.write_text("old 1\n")

    def refuse(src: str, dst: str, **dir_fds: int) -> None:
        raise OSError(28, "No space left on device", dst)

    monkeypatch.setattr(os, "rename", refuse)  # the state directory's atomic write
    metrics = Metrics(str(textfile))
    with structlog.testing.capture_logs() as logs:
        error = poll(metrics, host())
    assert error == "No space left on device"
    assert textfile.read_text() == "old 1\n"
    assert sorted(p.name for p in textfile.parent.iterdir()) == ["gpuwatchd.prom"]
    assert [e["event"] for e in logs] == [EventName.METRICS_WRITE_FAILED]


def test_a_write_failure_never_raises_is_logged_once_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "gpuwatchd.prom"
    metrics = Metrics(str(path))
    with structlog.testing.capture_logs() as logs:
        first = poll(metrics, host())
        second = poll(metrics, host())
    assert first is not None
    assert first == second
    # The error, then what to do about a folder that is missing (ReadWritePaths=).
    assert first.startswith(f"No such file or directory: {path.parent} does not exist; ")
    assert logs == [
        {
            "event": EventName.METRICS_WRITE_FAILED,
            "log_level": "error",
            "path": str(path),
            "error": first,
        }
    ]
    path.parent.mkdir()
    assert poll(metrics, host()) is None
    assert value(written(path), "gpuwatchd_textfile_write_errors_total") == 2
    shutil.rmtree(path.parent)  # a failure after a success is said again
    with structlog.testing.capture_logs() as logs:
        assert poll(metrics, host()) == first
    assert len(logs) == 1


def test_a_directory_at_the_path_is_a_failure_not_a_crash(textfile: Path) -> None:
    textfile.mkdir()
    assert poll(Metrics(str(textfile)), host()) is not None


def test_without_a_textfile_nothing_is_written(tmp_path: Path) -> None:
    metrics = Metrics(None)
    assert poll(metrics, host()) is None
    assert list(tmp_path.iterdir()) == []
    assert b"gpuwatchd_findings" in metrics.render()


@pytest.mark.parametrize("once", [False, True])
def test_only_the_daemon_writes_the_file_never_run_once(
    textfile: Path, once: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epilog's ``run --once`` on a node whose daemon died rewrote the file after each
    poll: its fresh last-poll time silenced GpuwatchdSilent for as long as jobs kept ending,
    though docs/metrics.md says the dead daemon's file stays and grows old."""
    policy = replace(
        default_policy(), state_dir=str(textfile.parent.parent / "state"), dry_run=True,
        metrics=MetricsPolicy(textfile=str(textfile)),
    )  # fmt: skip
    stale = "gpuwatchd_last_successful_poll_timestamp_seconds 1.0\n"  # the dead daemon's
    textfile.write_text(stale)
    daemon = Daemon(policy, config_path="/nonexistent/gpuwatchd.yaml", once=once)
    snapshot = HostBuilder().gpu(0).build()
    report = PollReport(snapshot, assessed(snapshot), PlanState(), seconds=0.5, started_wall=WALL)
    monkeypatch.setattr(daemon.engine, "poll", lambda inputs: report)
    daemon.poll_once()
    daemon.store.close()
    last = value(written(textfile), "gpuwatchd_last_successful_poll_timestamp_seconds")
    assert (textfile.read_text() == stale, last) == (once, 1.0 if once else WALL + 0.5)


def test_changing_the_path_removes_the_file_written_before(tmp_path: Path) -> None:
    first, second = tmp_path / "a.prom", tmp_path / "b.prom"
    metrics = Metrics(str(first))
    poll(metrics, host())
    metrics.set_textfile(str(second))
    assert not first.exists()
    poll(metrics, host())
    assert second.exists()
    metrics.set_textfile(None)
    assert not second.exists()


def test_a_new_path_that_fails_as_the_old_one_did_is_said_naming_it(tmp_path: Path) -> None:
    """A failure is said once until a write succeeds: after a reload changed the path, the new
    path's failure was unsaid when its error read as the old one's, and the journal named only
    the file no longer written."""
    first, second = tmp_path / "a" / "gpuwatchd.prom", tmp_path / "b" / "gpuwatchd.prom"
    first.mkdir(parents=True)
    second.mkdir(parents=True)
    metrics = Metrics(str(first))
    with structlog.testing.capture_logs() as logs:
        poll(metrics, host())
        metrics.set_textfile(str(second))
        poll(metrics, host())
        poll(metrics, host())
    assert [(e["path"], e["error"]) for e in logs] == [
        (str(first), "Is a directory"),
        (str(second), "Is a directory"),
    ]


def test_changing_the_path_removes_only_the_file_written_before_never_through_a_link(
    tmp_path: Path,
) -> None:
    """node_exporter's user owns the folder: a folder swapped for a link between the write and
    the change makes no file elsewhere (not ours, the same name) go."""
    folder, elsewhere = tmp_path / "textfiles", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    metrics = Metrics(str(folder / "gpuwatchd.prom"))
    poll(metrics, host())
    folder.rename(tmp_path / "moved")
    folder.symlink_to(elsewhere)
    (elsewhere / "gpuwatchd.prom").write_text("someone else's\n")
    metrics.set_textfile(str(tmp_path / "new.prom"))
    assert (elsewhere / "gpuwatchd.prom").read_text() == "someone else's\n"


def test_the_registry_is_private() -> None:
    from prometheus_client import REGISTRY

    Metrics(None)
    Metrics(None)  # a second instance would clash in a shared registry
    assert REGISTRY.get_sample_value("gpuwatchd_findings", {"kind": "ghost_memory"}) is None


# --- the gauges -------------------------------------------------------------------------------


def test_per_gpu_memory_gauges(textfile: Path) -> None:
    poll(Metrics(str(textfile)), host())
    s = written(textfile)
    alloc, acc, unacc, ghost = (
        f"gpuwatchd_gpu_memory_{what}_bytes"
        for what in ("allocated", "accounted", "unaccounted", "ghost")
    )
    # GPU 0: the trainer accounts for 800 of 900 MiB.
    assert value(s, alloc, **gpu(0)) == 900 * MIB
    assert value(s, acc, **gpu(0)) == 800 * MIB
    assert value(s, unacc, **gpu(0)) == 100 * MIB
    assert value(s, ghost, **gpu(0)) == 0
    # GPU 1: only a dead PID is listed: nothing accounted, the excess is ghost memory.
    assert value(s, acc, **gpu(1)) == 0
    assert value(s, unacc, **gpu(1)) == 4 * GIB
    assert value(s, ghost, **gpu(1)) == 4 * GIB - Detection().default_baseline
    for index in range(6):
        assert value(s, "gpuwatchd_gpu_lost", **gpu(index)) == (1 if index == 4 else 0)


def test_unknown_memory_has_no_sample_never_a_zero(textfile: Path) -> None:
    poll(Metrics(str(textfile)), host())
    s = written(textfile)
    names = {name for name, _ in s}

    def has(name: str, index: int) -> bool:
        return (f"gpuwatchd_gpu_memory_{name}_bytes", frozenset(gpu(index).items())) in s

    assert "gpuwatchd_gpu_memory_accounted_bytes" in names
    # GPU 2: a live owner's figure is unknown, so accounted and unaccounted are unknown.
    assert has("allocated", 2)
    assert not has("accounted", 2)
    assert not has("unaccounted", 2)
    # GPU 3: no memory reading at all.
    assert not any(has(what, 3) for what in ("allocated", "unaccounted", "ghost"))
    # GPU 4: lost, its figures are stale.
    assert not any(has(what, 4) for what in ("allocated", "accounted", "unaccounted", "ghost"))
    # GPU 5: MIG, memory-based detection is off: only the reading.
    assert has("allocated", 5)
    assert not any(has(what, 5) for what in ("accounted", "unaccounted", "ghost"))


def test_a_gpu_of_unknown_coherence_has_no_memory_judgement_samples(textfile: Path) -> None:
    # Its NUMA node could not be read: coherent or not is unknown, so detection is off there
    # (as in assess) and its ghost figure is no known 0.
    snapshot = HostBuilder().gpu(0, allocated=4 * GIB, numa_unknown=True).build()
    poll(Metrics(str(textfile)), snapshot)
    s = written(textfile)
    assert value(s, "gpuwatchd_gpu_memory_allocated_bytes", **gpu(0)) == 4 * GIB
    for what in ("accounted", "unaccounted", "ghost"):
        assert (f"gpuwatchd_gpu_memory_{what}_bytes", frozenset(gpu(0).items())) not in s


def test_a_gpu_that_disappears_loses_its_samples(textfile: Path) -> None:
    metrics = Metrics(str(textfile))
    poll(metrics, host())
    poll(metrics, HostBuilder().gpu(0).build())
    gpus = {dict(labels).get("gpu") for _, labels in written(textfile)}
    assert gpus - {None} == {gpu_uuid(0)}


def test_each_gpu_says_whether_a_new_job_may_have_it_and_why_not(textfile: Path) -> None:
    """check-clean's verdict per GPU (what node-problem-detector reads); a node that could
    not be judged has no sample, never a 0 or a 1."""
    snapshot = host()
    assessment = assessed(snapshot)
    verdict = judge(snapshot, assessment, Policy())
    metrics = Metrics(str(textfile))
    metrics.after_poll(
        PollReport(snapshot, assessment, PlanState(), verdict, seconds=0.1, started_wall=WALL),
        dry_run=True,
        policy_rejected=False,
    )
    s = written(textfile)
    assert value(s, "gpuwatchd_gpu_clean", **gpu(0)) == 1  # a live trainer: clean
    assert value(s, "gpuwatchd_gpu_clean", **gpu(1)) == 0  # ghost memory
    reasons = value(s, "gpuwatchd_gpu_not_clean_reasons", **gpu(1), kind="ghost_memory")
    assert reasons is not None
    assert reasons >= 1
    assert value(s, "gpuwatchd_gpu_clean", **gpu(4)) == 0  # lost
    unjudged = NodeVerdict(gpus=verdict.gpus, unavailable="NVML unavailable")
    metrics.after_poll(
        PollReport(snapshot, assessment, PlanState(), unjudged, seconds=0.1, started_wall=WALL),
        dry_run=True,
        policy_rejected=False,
    )
    assert not [key for key in written(textfile) if key[0] == "gpuwatchd_gpu_clean"]


def test_findings_by_kind_every_kind_present(textfile: Path) -> None:
    poll(Metrics(str(textfile)), host())
    s = written(textfile)
    counts = {kind.value: value(s, "gpuwatchd_findings", kind=kind.value) for kind in FindingKind}
    assert counts["ghost_memory"] == 1
    assert counts["dead_process"] == 1
    others = [
        count for kind, count in counts.items() if kind not in ("ghost_memory", "dead_process")
    ]
    assert others == [0] * (len(FindingKind) - 2)


def ladder(status: LadderStatus, pid: int) -> Ladder:
    return Ladder(
        target=f"{pid}@1", pid=pid, start_ticks=1, finding_key=f"orphaned:g:{pid}@1",
        rule="orphans", gpu=None, steps=(("SIGTERM", 30.0),), step=1, due=None,
        status=status, dry_run=False, started=0.0,
    )  # fmt: skip


def test_state_flags_and_ladders(textfile: Path) -> None:
    state = PlanState(
        ladders={
            "a": ladder(LadderStatus.ACTIVE, 1),
            "b": ladder(LadderStatus.ACTIVE, 2),
            "c": ladder(LadderStatus.STUCK, 3),
        },
        paused=True,
        forced_dry_run=True,
        circuit_open=True,
    )
    wedged = HostBuilder(wedged=True).gpu(0).build()
    metrics = Metrics(str(textfile))
    poll(metrics, wedged, state, dry_run=False, rejected=True)
    s = written(textfile)
    assert value(s, "gpuwatchd_ladders", status="active") == 2
    assert value(s, "gpuwatchd_ladders", status="stuck") == 1
    assert value(s, "gpuwatchd_ladders", status="ended") == 0
    on = ("paused", "kill_cap_latched", "reset_circuit_open", "nvml_wedged", "policy_rejected")
    for flag in on:
        assert value(s, f"gpuwatchd_{flag}") == 1, flag
    assert value(s, "gpuwatchd_dry_run") == 0
    assert value(s, "gpuwatchd_nvml_unavailable") == 0
    poll(metrics, HostBuilder().gpu(0).build())
    s = written(textfile)
    for flag in on:
        assert value(s, f"gpuwatchd_{flag}") == 0, flag
    assert value(s, "gpuwatchd_dry_run") == 1


def test_nvml_unavailable(textfile: Path) -> None:
    down = HostBuilder().build()
    down = Snapshot(
        monotonic=down.monotonic, wall_time=down.wall_time, boot_id=down.boot_id,
        nvml=NvmlReading(available=False, error="no driver"), processes={},
        holders=down.holders,
    )  # fmt: skip
    poll(Metrics(str(textfile)), down)
    assert value(written(textfile), "gpuwatchd_nvml_unavailable") == 1


def test_poll_duration_time_and_full_scans(textfile: Path) -> None:
    metrics = Metrics(str(textfile))
    poll(metrics, HostBuilder(scan_mode="full").gpu(0).build(), seconds=0.5)
    poll(metrics, HostBuilder(scan_mode="full").gpu(0).build(), seconds=0.25)
    poll(metrics, HostBuilder(scan_mode="targeted").gpu(0).build(), seconds=0.125)
    s = written(textfile)
    assert value(s, "gpuwatchd_full_scans_total") == 2
    assert value(s, "gpuwatchd_last_poll_full_scan") == 0
    assert value(s, "gpuwatchd_last_poll_duration_seconds") == 0.125
    assert value(s, "gpuwatchd_poll_duration_seconds_count") == 3
    assert value(s, "gpuwatchd_poll_duration_seconds_sum") == 0.875
    # When the poll completed (it started at WALL), as docs/metrics.md says: an alert on its
    # age does not fire just after a poll that took long (a reset).
    assert value(s, "gpuwatchd_last_successful_poll_timestamp_seconds") == WALL + 0.125


# --- the counters -----------------------------------------------------------------------------


def test_counters_count_events(textfile: Path) -> None:
    metrics = Metrics(str(textfile))
    events: list[tuple[str, dict[str, object]]] = [
        (EventName.ACTION_SIGNAL, {"signal": "SIGTERM", "outcome": "delivered", "pid": 7}),
        (EventName.ACTION_SIGNAL, {"signal": "SIGTERM", "outcome": "delivered", "pid": 8}),
        (EventName.ACTION_SIGNAL, {"signal": "SIGKILL", "outcome": "dry_run"}),
        (EventName.ACTION_SIGNAL, {"signal": "SIGWHAT", "outcome": "surprise"}),
        (EventName.RESET_OUTCOME, {"result": "failed", "gpu": gpu_uuid(0)}),
        (EventName.RESET_OUTCOME, {"result": "success"}),
        (EventName.RESET_RESUMED, {"result": "success"}),  # its reset.outcome is what counts
        (EventName.HOOK_RUN, {"hook": "on_failure", "dry_run": False, "returncode": 0}),
        (EventName.HOOK_RUN, {"hook": "on_failure", "dry_run": False, "returncode": 1}),
        (
            EventName.HOOK_RUN,
            {"hook": "on_failure", "dry_run": False, "returncode": None, "timed_out": True},
        ),
        (EventName.HOOK_RUN, {"hook": "on_failure", "dry_run": True, "outcome": "dry_run"}),
        (EventName.FINDING_NEW, {"kind": FindingKind.ORPHANED, "pid": 9}),
        (EventName.FINDING_CHANGED, {"kind": FindingKind.ORPHANED}),  # not a new one
        (EventName.RESET_STEP, {"step": "reset", "status": "ok"}),  # not an outcome
    ]
    for name, fields in events:
        metrics.observe(name, Level.INFO, fields)
    assert metrics.write() is None
    s = written(textfile)
    assert value(s, "gpuwatchd_signals_total", signal="SIGTERM", outcome="delivered") == 2
    assert value(s, "gpuwatchd_signals_total", signal="SIGKILL", outcome="dry_run") == 1
    assert value(s, "gpuwatchd_signals_total", signal="other", outcome="other") == 1
    assert value(s, "gpuwatchd_resets_total", result="failed") == 1
    assert value(s, "gpuwatchd_resets_total", result="success") == 1
    assert value(s, "gpuwatchd_resets_total", result="timeout") == 0  # known from the start
    assert value(s, "gpuwatchd_hooks_total", hook="on_failure", result="ok") == 1
    assert value(s, "gpuwatchd_hooks_total", hook="on_failure", result="failed") == 2
    assert value(s, "gpuwatchd_hooks_total", hook="on_failure", result="dry_run") == 1
    assert value(s, "gpuwatchd_findings_new_total", kind="orphaned") == 1
    assert value(s, "gpuwatchd_findings_new_total", kind="zombie") == 0
    assert not any("pid" in dict(labels) for _, labels in s)


def test_a_mig_instance_recreated_is_counted_as_a_recovery_not_a_gpu_reset() -> None:
    result = simulate(
        load_scenario(str(REPO / "examples/scenarios/mig-ghost-instance-recovery.yaml"))
    )
    metrics = Metrics(None)
    for entry in result.timeline:
        metrics.observe(entry.name, entry.level, entry.fields)
    s = samples_of(metrics.render().decode())
    assert value(s, "gpuwatchd_mig_recoveries_total", result="success") == 1
    assert value(s, "gpuwatchd_resets_total", result="success") == 0


def test_the_engines_event_fields_are_the_ones_counted() -> None:
    """Feed real engine events (a simulated scenario) to observe: a renamed field shows."""
    result = simulate(load_scenario(str(REPO / "examples/scenarios/reset-fails-drain.yaml")))
    orphans = simulate(load_scenario(str(REPO / "examples/scenarios/dataloader-orphans.yaml")))
    metrics = Metrics(None)
    for entry in [*result.timeline, *orphans.timeline]:
        metrics.observe(entry.name, entry.level, entry.fields)
    s = samples_of(metrics.render().decode())
    assert value(s, "gpuwatchd_resets_total", result="failed") == 1
    assert value(s, "gpuwatchd_mig_recoveries_total", result="failed") == 0
    assert value(s, "gpuwatchd_hooks_total", hook="on_failure", result="ok") == 1
    assert value(s, "gpuwatchd_findings_new_total", kind="ghost_memory") == 1
    assert value(s, "gpuwatchd_findings_new_total", kind="orphaned") == 3
    assert value(s, "gpuwatchd_signals_total", signal="SIGTERM", outcome="delivered") == 3
    assert value(s, "gpuwatchd_signals_total", signal="SIGKILL", outcome="delivered") == 1
    assert not any(dict(labels).get("outcome") == "other" for _, labels in s)


# --- contrib: alert rules and dashboard -------------------------------------------------------

SUFFIXES = ("_bucket", "_count", "_sum")


def names_written() -> set[str]:
    """Every family and sample name Metrics writes, with all its metrics populated."""
    metrics = Metrics(None)
    metrics.observe(
        EventName.ACTION_SIGNAL, Level.INFO, {"signal": "SIGTERM", "outcome": "delivered"}
    )
    metrics.observe(EventName.HOOK_RUN, Level.INFO, {"hook": "on_failure", "returncode": 0})
    poll(metrics, host())
    names: set[str] = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def used_names(path: Path) -> set[str]:
    return set(re.findall(r"\bgpuwatchd_[a-z_]+", path.read_text()))


def test_contrib_files_exist() -> None:
    assert ALERTS in CONTRIB
    assert any(path.suffix == ".json" for path in CONTRIB)
    for path in CONTRIB:
        if path.suffix == ".json":
            json.loads(path.read_text())


@pytest.mark.parametrize("path", CONTRIB, ids=lambda path: path.name)
def test_every_metric_the_contrib_files_use_exists(path: Path) -> None:
    known = names_written()
    used = used_names(path)
    assert used, f"{path.name} uses no gpuwatchd metric"
    unknown = {
        name
        for name in used
        if name not in known and not (name.endswith(SUFFIXES) and name.rsplit("_", 1)[0] in known)
    }
    assert not unknown, f"{path.name} uses metrics gpuwatchd does not write: {sorted(unknown)}"


def test_every_metric_is_documented() -> None:
    doc = (REPO / "docs" / "metrics.md").read_text()
    families = {
        family.name for family in text_string_to_metric_families(Metrics(None).render().decode())
    }
    # prometheus_client's companion gauges, documented once for all counters
    undocumented = {name for name in families if name not in doc and not name.endswith("_created")}
    assert not undocumented


@pytest.mark.parametrize(
    "args",
    [("check", "rules", str(ALERTS)), ("test", "rules", str(ALERTS.with_suffix(".test.yml")))],
    ids=["check", "unit-tests"],
)
def test_promtool_accepts_the_alert_rules(args: tuple[str, ...]) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH (Debian: apt-get install prometheus)")
    check = subprocess.run([promtool, *args], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((REPO / "contrib" / "grafana" / "gpuwatchd-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each query, with Grafana's variables filled in, as a recording rule promtool checks."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH (Debian: apt-get install prometheus)")
    exprs = dashboard_exprs()
    assert exprs
    rules = [
        {"record": f"gpuwatchd:dashboard_query_{n}", "expr": expr
         .replace("$__rate_interval", "5m").replace("$instance", ".*")}
        for n, expr in enumerate(exprs)
    ]  # fmt: skip
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    check = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_gpu_health_gauges_follow_the_reading_and_unknown_has_no_sample() -> None:
    known = GpuHealth(
        events=Support.OK,
        xids=(XidEvent(13, 1.0), XidEvent(13, 2.0), XidEvent(95, 3.0)),
        recovery_action=1,
        recovery_support=Support.OK,
        remap_correctable=2,
        remap_uncorrectable=1,
        remap_pending=True,
        remap_failure=False,
        remap_support=Support.OK,
    )
    unknown = GpuHealth(remap_support=Support.UNKNOWN)
    gpus = (
        GpuInfo(index=0, uuid="GPU-a", minor=0, processes=(), health=known),
        GpuInfo(index=1, uuid="GPU-b", minor=1, processes=(), health=unknown),
    )
    snapshot = Snapshot(
        monotonic=1.0,
        wall_time=2.0,
        boot_id="b",
        nvml=NvmlReading(available=True, gpus=gpus),
        processes={},
        holders=HolderScan(mode="full"),
    )
    assessment = assess(snapshot, AssessState(), Detection())
    metrics = Metrics(None)
    metrics.after_poll(PollReport(snapshot, assessment, PlanState(), seconds=0.1, started_wall=2.0),
                       dry_run=True, policy_rejected=False)  # fmt: skip
    text = metrics.render().decode()
    assert 'gpuwatchd_gpu_xid_events{gpu="GPU-a",index="0",xid="13"} 2.0' in text
    assert 'gpuwatchd_gpu_xid_events{gpu="GPU-a",index="0",xid="95"} 1.0' in text
    assert 'gpuwatchd_gpu_recovery_action{gpu="GPU-a",index="0"} 1.0' in text
    assert 'gpuwatchd_gpu_remapped_rows{cause="uncorrectable",gpu="GPU-a",index="0"} 1.0' in text
    assert 'gpuwatchd_gpu_remap_pending{gpu="GPU-a",index="0"} 1.0' in text
    health_names = ("xid_events", "remapped_rows", "remap_pending", "remap_failure",
                    "recovery_action")  # fmt: skip
    for family in text_string_to_metric_families(text):
        if family.name.removeprefix("gpuwatchd_gpu_") in health_names:
            assert all(s.labels["gpu"] != "GPU-b" for s in family.samples), family.name
    assert 'gpuwatchd_findings{kind="reset_required"} 1.0' in text


def test_remove_textfile_removes_only_a_metrics_file_gpuwatchd_wrote(tmp_path: Path) -> None:
    """What the package's prerm relies on: our own *.prom goes; a file of someone else's, a
    name not ending in .prom, a link, a directory or a missing file stay (and never raise)."""
    ours = tmp_path / "gpuwatchd.prom"
    Metrics(str(ours)).write()
    assert remove_textfile(str(ours)) is True
    assert not ours.exists()
    assert remove_textfile(str(ours)) is False  # already gone

    foreign = tmp_path / "smartmon.prom"
    foreign.write_text("# HELP smartmon_up x\nsmartmon_up 1\n")
    assert remove_textfile(str(foreign)) is False
    assert foreign.exists()

    renamed = tmp_path / "gpuwatchd.txt"
    Metrics(str(renamed)).write()
    assert remove_textfile(str(renamed)) is False
    assert renamed.exists()

    target = tmp_path / "target.prom"
    Metrics(str(target)).write()
    link = tmp_path / "link.prom"
    link.symlink_to(target)
    assert remove_textfile(str(link)) is False
    assert link.is_symlink()
    assert target.exists()

    (tmp_path / "dir.prom").mkdir()
    assert remove_textfile(str(tmp_path / "dir.prom")) is False


def test_remove_textfile_never_follows_a_link_on_the_way_to_the_folder(tmp_path: Path) -> None:
    """As writing does, removing reaches node_exporter's folder (often another user's) by a
    walk from / that follows no link: a folder swapped for a link to elsewhere makes root
    remove nothing there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ours = elsewhere / "gpuwatchd.prom"
    Metrics(str(ours)).write()
    (tmp_path / "textfile").symlink_to(elsewhere)
    assert remove_textfile(str(tmp_path / "textfile" / "gpuwatchd.prom")) is False
    assert ours.exists()
    assert remove_textfile(str(ours)) is True
