"""The read-only ``gpuwatchd scan``: one collection, assessed and reported, never an action nor a
state write; the daemon's state file, when readable, gives baselines and first-seen times. And
the daemon's answer to a ``scan`` that asked it (docs/scan.md, "Answered by the daemon").

In detail: docs/internals.md, section `gpuwatchd.cli.scan`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from gpuwatchd import __version__
from gpuwatchd.cli.process_kind import lock_holder
from gpuwatchd.cli.report import build_report
from gpuwatchd.cli.report_text import render_text
from gpuwatchd.cli.spare import mark_spared, spares_in_force
from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.collect.capabilities import missing_capabilities
from gpuwatchd.collect.collector import Collector, WalkDue
from gpuwatchd.collect.jobs import cgroup2_mount
from gpuwatchd.collect.nvml import WORKER_FILE, NvmlClient, NvmlSource
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.checked import decimal
from gpuwatchd.core.escape import escape
from gpuwatchd.core.model import Snapshot, Spare
from gpuwatchd.core.vocabulary import ExitCode
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.plan.state import PlanState, unfinished_recoveries
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.verdict import NodeVerdict, cannot_tell, judge, lost_state, unread_verdict
from gpuwatchd.events.words import short
from gpuwatchd.served import holders as holder_view
from gpuwatchd.served import nvml as nvml_view
from gpuwatchd.served.guard import ServedPoll
from gpuwatchd.served.holders import HolderView
from gpuwatchd.state.directory import StateDir, StateDirError
from gpuwatchd.state.pause import pause_in_force, read_ended_jobs
from gpuwatchd.state.saved import (
    STATE,
    STATE_FILE,
    SavedState,
    cannot_read,
    read_saved_state,
    signalled_last_hour,
)

if TYPE_CHECKING:
    from gpuwatchd.served.scan_socket import ScanAnswer, ScanRequest


@dataclass(frozen=True)
class ScanResult:
    """One scan: its report, and the verdict on each GPU (:mod:`gpuwatchd.decide.verdict`) that
    ``check-clean`` and ``run --once`` answer with and the report shows."""

    report: dict[str, object] | None
    error: str | None = None
    permission_note: str | None = None
    wedged: bool = False
    verdict: NodeVerdict | None = None
    declined: str | None = None  # served: why the daemon's last poll could not be served from
    # Why the daemon's saved state (its half-done recoveries and resets) could not be read.
    state_unread: str | None = None


class ScanOutput(NamedTuple):
    """What ``scan`` prints (stdout, then each stderr line) and the code it exits with."""

    stdout: str
    stderr: tuple[str, ...]
    exit_code: int


def scan_output(result: ScanResult, *, as_json: bool, color: bool) -> ScanOutput:
    """The one rendering of a scan's outcome, for the command and for the daemon answering it
    (:func:`answer_served`): the report as JSON or text, and the exit code of
    docs/scan.md with its one line on stderr."""
    if result.report is None or (result.error is not None and not as_json):
        error = result.error or "NVIDIA driver/NVML not available"
        return ScanOutput("", (f"gpuwatchd: {error}",), ExitCode.UNAVAILABLE)
    if as_json:
        text = json.dumps(result.report, indent=2, sort_keys=False) + "\n"
    else:
        text = render_text(result.report, color=color)
    if result.error is not None:
        return ScanOutput(text, (f"gpuwatchd: {result.error}",), ExitCode.UNAVAILABLE)
    if result.wedged:
        wedged = "gpuwatchd: NVML did not answer within nvml_timeout: the driver may be wedged"
        return ScanOutput(text, (wedged,), ExitCode.UNAVAILABLE)
    if result.permission_note:
        return ScanOutput(text, (f"gpuwatchd: {result.permission_note}",), ExitCode.NOPERM)
    unread, verdict = result.state_unread, result.verdict
    if unread is not None and verdict is not None and any(g.clean for g in verdict.gpus):
        # The report shows such a GPU unknown: check-clean cannot tell either (75).
        return ScanOutput(text, (escape(f"gpuwatchd: {cannot_tell(unread)}"),), ExitCode.TEMPFAIL)
    return ScanOutput(text, (), ExitCode.OK)


def answer_served(
    request: ScanRequest, config_path: str, state_dir: str, served: ServedPoll | None
) -> ScanAnswer:
    """The daemon's answer to ``request``: the report of a scan built on its last poll
    (``served``; None: none to serve from), with the policy the command would have used, or a
    refusal saying why (the command then walks by itself). ``config_path``: the main file the
    daemon was started with; ``state_dir``: the one it runs in."""
    from gpuwatchd.served.scan_socket import ScanAnswer
    from gpuwatchd.state.compiled_policy import load_compiled

    if request.config != os.path.abspath(config_path):
        return ScanAnswer(False, "the daemon runs with another configuration file")
    policy = load_compiled(request.config, state_dir)
    if policy is None:
        return ScanAnswer(False, "the configuration files changed since the daemon accepted them")
    if policy.state_dir != state_dir:
        return ScanAnswer(False, "the configuration names another state_dir")
    if served is None:
        return ScanAnswer(False, "the daemon has no holder view (its device watch is not working)")
    result = scan_host(policy, served=served)
    if result.declined is not None:
        return ScanAnswer(False, result.declined)
    output = scan_output(result, as_json=request.as_json, color=request.color)
    return ScanAnswer(True, "answered", output.exit_code, output.stdout, output.stderr)


def read_boot_time(proc_root: str) -> float | None:
    """``btime`` from ``<proc_root>/stat``: the boot time in wall seconds, as the kernel writes
    it (whole ASCII digits: never ``nan`` or ``inf``), None when unknown."""
    try:
        with open(os.path.join(proc_root, "stat"), encoding="ascii") as handle:
            for line in handle:
                if line.startswith("btime "):
                    return decimal(line[6:].strip())
    except (OSError, ValueError):
        return None
    return None


@dataclass(frozen=True)
class RunningDaemon:
    """The gpuwatchd instance that holds the lock in ``state_dir`` now, and its NVML workers."""

    pid: int
    workers: frozenset[int]

    @property
    def pids(self) -> frozenset[int]:
        return frozenset({self.pid, *self.workers})


def running_daemon(state_dir: StateDir | None, procfs: ProcFS) -> RunningDaemon | None:
    """The daemon (:func:`lock_holder`, run by root or this user) and its NVML workers (its
    direct children of that user running the worker file) when one runs now beside this
    command, so that its worker is no ``hidden_holder`` here either; else None."""
    if state_dir is None:
        return None
    daemon = lock_holder(state_dir, procfs, state_dir.owners)[0]
    if daemon is None:
        return None
    pid = daemon.pid
    workers = {
        child
        for child, info in procfs.read_processes(procfs.descendants([pid])).items()
        if info.ppid == pid and info.uid == daemon.uid and WORKER_FILE in (info.cmdline or ())
    }
    return RunningDaemon(pid, frozenset(workers))


def scan_host(
    policy: Policy,
    *,
    nvml: NvmlClient | None = None,
    why: str = "--full",
    served: ServedPoll | None = None,
) -> ScanResult:
    """One collection, assessed and reported. ``nvml``: a client the caller started ahead and
    closes itself (else one is made here). Alone (``served`` None) it walks all of ``/proc``;
    ``why`` says why the daemon's view was not used. ``served``: the daemon's last poll, when
    the daemon answers (:func:`answer_served`): built on when current (:func:`_current`)
    and the full-scan rule asks for no walk, else no report and ``declined`` says why.
    StateDirError when the state directory exists but cannot be trusted (a link on its path,
    another owner, writable by others): the caller refuses (exit 78); one this user may not
    open is ``state_unread``, never "no state"."""
    saved = SavedState()
    try:
        state_dir: StateDir | None = StateDir.open(policy.state_dir)
    except StateDirError:
        raise
    except FileNotFoundError:  # no daemon ran here
        state_dir = None
    except OSError as exc:  # EACCES to a user (0700, root's): its state is unseen, not none
        state_dir, saved = None, SavedState(problem=cannot_read(policy.state_dir, exc))
    with state_dir or contextlib.nullcontext():
        if state_dir is not None:
            saved = read_saved_state(state_dir)
        return _scan_host(policy, state_dir, saved, nvml=nvml, why=why, served=served)


def _scan_host(
    policy: Policy,
    state_dir: StateDir | None,
    saved: SavedState,
    *,
    nvml: NvmlClient | None,
    why: str,
    served: ServedPoll | None,
) -> ScanResult:
    # As :func:`gpuwatchd.daemon.host.procfs_for` builds it; that module is not imported here: it
    # brings the daemon's actuator and structlog (with asyncio), which a scan never uses.
    procfs = ProcFS(
        policy.proc_root, devices_dir=policy.devices_dir, device_major=policy.device_major
    )
    view, published = None, None
    if served is None:
        daemon = running_daemon(state_dir, procfs)
        # Its processes are the daemon's own, never holders (its NVML worker holds them all).
        daemon_pids = daemon.pids if daemon is not None else frozenset()
    else:
        view, published, declined = _current(served, policy, procfs)
        if view is None or published is None:
            return ScanResult(None, declined=declined)
        daemon_pids = frozenset({view.daemon_pid, *view.worker_pids})
        why = f"built on the holder view of the daemon (pid {view.daemon_pid})"
    client = NvmlClient(policy.nvml_timeout) if nvml is None else nvml
    client.timeout = policy.nvml_timeout
    source: NvmlSource = client if published is None else published
    try:
        snapshot, collector = _collect(
            policy, state_dir, procfs, source, daemon_pids=daemon_pids, view=view
        )
    except WalkDue as due:  # only where a view is used: the daemon walks nothing for a command
        return ScanResult(None, declined=f"a walk of /proc is due ({due.reason.value})")
    finally:
        if nvml is None:  # this scan's own client
            client.stop()
    plan = saved_plan(saved)
    report, verdict, unread = _judged_report(snapshot, saved, plan, policy, state_dir)
    report["daemon_view"] = _daemon_view_section(view, why, collector)
    report["nvml_reading"] = _nvml_reading_section(published, client, snapshot.wall_time)
    said = None if state_dir is None else daemon_section(state_dir, saved, plan, policy, snapshot)
    if said is not None:
        report["daemon"] = said
    reading = snapshot.nvml
    # Unavailable: still a report (its "nvml" says why, its holders are real): the JSON reader
    # gets a document and the exit code, the text reader the one line.
    error = None if reading.available else reading.error or "NVIDIA driver/NVML not available"
    return ScanResult(
        report,
        wedged=reading.wedged,
        error=error,
        permission_note=_permission_note(policy, snapshot),
        verdict=verdict,
        state_unread=unread,
    )


def _current(
    served: ServedPoll, policy: Policy, procfs: ProcFS
) -> tuple[HolderView | None, nvml_view.Published | None, str]:
    """The daemon's last poll's holder view and NVML reading when a scan may build on both
    now (docs/scan.md, "Answered by the daemon"); else None and why not."""
    view = served.view
    stale = served.stale_because(policy.proc_root, policy.devices_dir)
    if stale is not None:
        return None, None, f"walked: {stale}"
    settings = (policy.proc_root, policy.devices_dir, policy.device_major)
    why = holder_view.usable(
        view, now_wall=time.time(), boot_id=procfs.boot_id(), settings=settings
    )
    if why is not None:
        return None, None, f"the daemon's holder view is not used: {why}"
    # A holder's PID that names another process now (its start ticks differ): the view does not
    # vouch for it. Gone PIDs need no check here: the targeted scan misses them (holder_gone),
    # and the scan declines rather than walk (WalkDue).
    if any(
        (fields := procfs.read_stat(pid)) is not None and fields.starttime != ticks
        for pid, ticks in view.holder_ticks.items()
        if ticks is not None
    ):
        return None, None, "a holder in the daemon's view has exited"
    if served.reading is None:
        return view, None, "the daemon's last poll has no NVML reading"
    published = nvml_view.Published.of(served.reading)
    why = nvml_view.usable(published, now_wall=time.time(), interval=policy.interval)
    if why is not None:
        return view, None, f"the daemon's NVML reading is not used: {why}"
    return view, published, ""


def _collect(
    policy: Policy,
    state_dir: StateDir | None,
    procfs: ProcFS,
    source: NvmlSource,
    *,
    daemon_pids: frozenset[int],
    view: HolderView | None,
) -> tuple[Snapshot, Collector]:
    """One snapshot by a collector set up as the daemon's: seeded with the daemon's holder view
    when one is used (else a full walk), and told the jobs an epilog said have ended.
    :class:`WalkDue` where a view is used and the full-scan rule asks for a walk."""
    collector = Collector(
        procfs,
        source,
        namespace_check=policy.namespace_check,
        cgroup_root=cgroup2_mount(),
        full_scan_interval=holder_view.MAX_FRESH,
        detection=policy.detection,
        daemon_pids=daemon_pids,
        may_walk=view is None,
        mig_minors_file=policy.mig_minors_file,
    )
    if view is not None:
        collector.seed(
            view.holders, view.dead_listed, unknown=view.unknown, held_minors=view.held_minors
        )
    if state_dir is not None:
        clock = BootTime.read(time.time(), procfs.boot_id())
        collector.ended_by_scheduler = read_ended_jobs(
            state_dir, clock, waiting=procfs.is_running
        ).jobs
    return collector.collect(full=view is None), collector


def saved_plan(saved: SavedState) -> PlanState | str:
    """The daemon's saved plan, read once for a scan's verdict and ``daemon`` section; why
    not (the plan's error) when it cannot be read."""
    try:
        return PlanState.from_json(saved.data.get("plan"))
    except ValueError as exc:
        return str(exc)


def _judged_report(
    snapshot: Snapshot,
    saved: SavedState,
    plan: PlanState | str,
    policy: Policy,
    state_dir: StateDir | None,
) -> tuple[dict[str, object], NodeVerdict, str | None]:
    """The snapshot assessed as the daemon would (with its saved history of this boot), judged
    and reported, each finding and holder a spare covers marked so; and why the saved state
    could not be read (None: it was, or there is none), for its half-done work is not seen."""
    previous, unfinished, first_seen = AssessState(), {}, {}
    unread = saved.problem
    if saved.same_boot(snapshot.boot_id):  # an older boot's history and monotonic times lie
        with contextlib.suppress(ValueError):
            previous = AssessState.from_json(saved.data.get("assess", {}))
        try:  # a MIG recovery left half done: its GPU is dirty; read as the daemon reads it
            STATE.check(saved.data)  # the envelope's version
            if isinstance(plan, str):
                raise ValueError(plan)
            unfinished = unfinished_recoveries(plan)
            unread = unread or lost_state(plan)  # latched on a state it moved aside
            first_seen = {  # the plan's monotonic first-seen times, as wall times
                key: snapshot.wall_time - max(0.0, snapshot.monotonic - seen.first_seen)
                for key, seen in plan.seen.items()
            }
        except ValueError as exc:
            path = os.path.join(policy.state_dir, STATE_FILE)
            # The reader may name a saved key or entry, as large as the file: cut.
            unread = f"{path}: the daemon's plan cannot be read ({short(exc)})"
    assessment = assess(snapshot, previous, policy.detection, health_policy=policy.health)
    verdict = judge(snapshot, assessment, policy, unfinished=unfinished)
    spares = spares_in_force(state_dir, policy, snapshot.wall_time)
    shown = verdict if unread is None else unread_verdict(verdict, unread)
    report = snapshot_report(
        snapshot, assessment, shown, first_seen, proc_root=policy.proc_root, spares=spares
    )
    return report, verdict, unread


def _nvml_reading_section(
    published: nvml_view.Published | None, client: NvmlClient, now_wall: float
) -> dict[str, object]:
    read_at = client.last_asked_wall if published is None else published.read_at
    return {
        "source": "own" if published is None else "daemon",
        "age_s": None if read_at is None else round(max(0.0, now_wall - read_at), 3),
        "reason": "read by this scan"
        if published is None
        else f"the daemon's reading (pid {published.daemon_pid}, poll {published.polled:.3f})",
    }


def _daemon_view_section(
    view: HolderView | None, why: str, collector: Collector
) -> dict[str, object]:
    """The report's ``daemon_view``: whether the daemon's holder view was used and why, and
    who answered (the daemon: it uses its view whenever it answers)."""
    return {
        "used": view is not None,
        "reason": why,
        "polled": None if view is None else view.polled,
        "clean": None if view is None else True,
        "age": None if view is None else round(max(0.0, time.time() - view.polled), 3),
        "scan_reason": None
        if collector.last_scan_reason is None
        else collector.last_scan_reason.value,
        "answered_by": "this scan" if view is None else "daemon",
    }


def daemon_section(
    state_dir: StateDir,
    saved: SavedState,
    plan: PlanState | str,
    policy: Policy,
    snapshot: Snapshot,
) -> dict[str, object] | None:
    """The report's ``daemon`` object (docs/scan.md), what ``explain`` lists a pause and the
    kill-cap latch by: the pause file as the daemon reads it (in force until its time is up;
    an unreadable one pauses), the latch and, in the same boot, the signals of the last hour
    from the saved plan (:func:`saved_plan`; none yet: the daemon's defaults). None when no
    saved state was read (none, unreadable, untrusted); a malformed plan leaves its fields
    unknown (null)."""
    if not saved.found:
        return None
    clock = BootTime.read(snapshot.wall_time, snapshot.boot_id)
    pause = pause_in_force(state_dir, clock, max_pause=policy.limits.max_pause)
    read = plan if isinstance(plan, PlanState) else None
    if read is None and "plan" not in saved.data:
        read = PlanState()  # none saved yet: the daemon's defaults
    hour = None
    if read is not None and saved.same_boot(snapshot.boot_id):  # monotonic times of this boot
        hour = signalled_last_hour(read.signal_history, snapshot.monotonic)
    return {
        "paused": pause.reason is not None,
        "paused_reason": pause.reason or None,
        "forced_dry_run": None if read is None else read.forced_dry_run,
        "forced_reason": None if read is None else read.forced_reason,
        "signalled_last_hour": hour,
    }


def _permission_note(policy: Policy, snapshot: Snapshot) -> str | None:
    """Why the report is incomplete when processes could not be inspected for want of a
    capability; None when nothing was unreadable, or nothing is missing."""
    missing = missing_capabilities(policy.proc_root)
    if not (snapshot.holders.unreadable and missing):
        return None
    return (
        f"{len(snapshot.holders.unreadable)} processes could not be inspected (their fds/maps "
        f"are unreadable; this process lacks {', '.join(missing)}); the report is incomplete — "
        "run as root"
    )


def snapshot_report(
    snapshot: Snapshot,
    assessment: Assessment,
    verdict: NodeVerdict | None,
    first_seen: Mapping[str, float],
    *,
    proc_root: str,
    spares: Sequence[Spare] | None = None,
) -> dict[str, object]:
    """The ``scan --json`` document of one snapshot and its assessment, each finding and holder
    that ``spares`` (default: the snapshot's) cover marked so: this command's, and the report
    part of the daemon's evidence files (gpuwatchd/act/evidence.py), which explain honours."""
    report = build_report(
        snapshot,
        assessment.findings,
        assessment.roles,
        assessment.report_only,
        assessment.state.baselines,
        first_seen=first_seen,
        version=__version__,
        hostname=os.uname().nodename,
        boot_time=read_boot_time(proc_root),
        clock_ticks=os.sysconf("SC_CLK_TCK"),
        notes=assessment.notes,
        verdict=verdict,
    )
    mark_spared(report, snapshot, snapshot.spares if spares is None else spares)
    return report
