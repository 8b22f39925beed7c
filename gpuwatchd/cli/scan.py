"""The read-only ``gpuwatchd scan``: one full collection, assessed, turned into a report.

This module owns the wiring of the one-shot scan (never any action, never a state write). It
reads the daemon's state file when it can, so the report shows learned baselines and since when
each finding has been seen.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from gpuwatchd import __version__, holder_view
from gpuwatchd.cli.report import build_report
from gpuwatchd.collect.collector import Collector
from gpuwatchd.collect.jobs import cgroup2_mount
from gpuwatchd.collect.nvml import NvmlClient
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.decide.assess import assess
from gpuwatchd.decide.assess_state import AssessState
from gpuwatchd.decide.policy import Policy
from gpuwatchd.holder_view import HolderView
from gpuwatchd.pause import read_ended_jobs
from gpuwatchd.state import StateStore, read_small


@dataclass(frozen=True)
class ScanResult:
    report: dict[str, object] | None
    error: str | None = None
    permission_note: str | None = None
    wedged: bool = False


def procfs_for(policy: Policy) -> ProcFS:
    return ProcFS(
        policy.proc_root, devices_dir=policy.devices_dir, device_major=policy.device_major
    )


# Capabilities needed to read other users' /proc/PID/fd and maps (docs/design-notes.md §9).
_INSPECT_CAPABILITIES = {"CAP_DAC_READ_SEARCH": 2, "CAP_SYS_PTRACE": 19}
# ... and to signal them.
ACT_CAPABILITIES = {**_INSPECT_CAPABILITIES, "CAP_KILL": 5}


def missing_capabilities(
    proc_root: str, wanted: dict[str, int] = _INSPECT_CAPABILITIES
) -> list[str]:
    """Which of the ``wanted`` capabilities this process lacks (from CapEff)."""
    try:
        with open(os.path.join(proc_root, "self", "status"), encoding="ascii") as handle:
            for line in handle:
                if line.startswith("CapEff:"):
                    effective = int(line.split()[1], 16)
                    return [name for name, bit in wanted.items() if not effective & (1 << bit)]
    except (OSError, ValueError, IndexError):
        pass
    return [] if os.geteuid() == 0 else list(wanted)


def read_boot_time(proc_root: str) -> float | None:
    """``btime`` from ``<proc_root>/stat``: the boot time in wall seconds, None when unknown."""
    try:
        with open(os.path.join(proc_root, "stat"), encoding="ascii") as handle:
            for line in handle:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def running_daemon_pids(
    policy: Policy, saved: Mapping[str, object], procfs: ProcFS
) -> frozenset[int]:
    """The daemon that wrote ``saved`` and its NVML workers, when it runs now; else empty.

    The daemon counts its own NVML worker as itself, never as a holder; a scan beside it must
    too, or every GPU would show a ``hidden_holder`` (an NVML-only client) whenever the daemon
    runs outside its systemd unit, in a Kubernetes pod say. Only a PID that is gpuwatchd now
    (the test of ``status``) and runs as the user this command runs as (root, in production:
    nobody else can start such a process), and its direct children of that user running the
    worker file, qualify: a reused PID, or a look-alike started by another user, hides nothing.
    """
    from gpuwatchd.cli.status import daemon_pid, look_at_process
    from gpuwatchd.collect.nvml import WORKER_FILE

    pid = daemon_pid(saved)
    if pid is None or look_at_process(policy.proc_root, pid) != "gpuwatchd":
        return frozenset()
    me = os.geteuid()
    daemon = procfs.read_process(pid)
    if daemon is None or daemon.uid != me:
        return frozenset()
    workers = {
        child
        for child, info in procfs.read_processes(procfs.descendants([pid])).items()
        if info.ppid == pid and info.uid == me and WORKER_FILE in (info.cmdline or ())
    }
    return frozenset({pid, *workers})


def daemon_view(policy: Policy, procfs: ProcFS) -> tuple[HolderView | None, str]:
    """The running daemon's published holder view if ``scan`` may build on it, else None;
    and, either way, a short reason (shown in the report)."""
    try:
        raw = read_small(policy.state_dir, holder_view.VIEW_FILE, holder_view.MAX_BYTES + 1)
    except OSError:
        return None, "no holder view published by a running daemon"
    try:
        view = holder_view.parse(raw)
    except ValueError as err:
        return None, f"the daemon's holder view is unusable: {err}"
    fields = procfs.read_stat(view.daemon_pid)
    why = holder_view.usable(
        view,
        now_wall=time.time(),
        boot_id=procfs.boot_id(),
        settings=(policy.proc_root, policy.devices_dir, policy.device_major),
        daemon_start_ticks=None if fields is None else fields.starttime,
    )
    if why is not None:
        return None, f"the daemon's holder view is not used: {why}"
    return view, f"built on the holder view of the daemon (pid {view.daemon_pid})"


def scan_host(
    policy: Policy,
    *,
    nvml_env: Mapping[str, str] | None = None,
    nvml: NvmlClient | None = None,
    full: bool = True,
) -> ScanResult:
    """One collection, assessed and reported. ``nvml``: a client the caller started ahead
    (:meth:`NvmlClient.prefetch`) and closes itself; else one is made and closed here.

    ``full=False`` builds on a running daemon's published holder view when there is a usable
    one (:mod:`gpuwatchd.holder_view`): a targeted scan of its holders, NVML's processes and
    their descendants, or a full walk whenever the daemon's own rule would walk; without a
    usable view it walks all of ``/proc`` as ``full=True`` always does.
    """
    own = nvml is None
    client = NvmlClient(policy.nvml_timeout, env=nvml_env) if nvml is None else nvml
    client.timeout = policy.nvml_timeout
    saved = StateStore(policy.state_dir).peek()
    procfs = procfs_for(policy)
    daemon_pids = running_daemon_pids(policy, saved, procfs)
    view, view_note = daemon_view(policy, procfs)
    if view is not None:
        # Its processes are the daemon's own, never holders (its NVML worker holds them all).
        daemon_pids |= view.worker_pids | {view.daemon_pid}
    if full:
        view, view_note = None, "--full"
    try:
        collector = Collector(
            procfs,
            client,
            namespace_check=policy.namespace_check,
            cgroup_root=cgroup2_mount(),
            full_scan_interval=holder_view.MAX_FRESH,
            detection=policy.detection,
            daemon_pids=daemon_pids,
        )
        if view is not None and _holder_replaced(procfs, view):
            view, view_note = None, "a holder in the daemon's view has exited"
        if view is not None:
            collector.seed(view.holders, view.dead_listed)
        # What an epilog told the running daemon (run --once --ended-job): this scan judges
        # those jobs as the daemon does.
        collector.ended_by_scheduler = read_ended_jobs(policy.state_dir, time.time())[0]
        snapshot = collector.collect(full=view is None)
    finally:
        if own:
            client.close()
    error = None
    if not snapshot.nvml.available:
        # Still a report (its "nvml" says why, its holders are real): the JSON reader gets a
        # document and the exit code, the text reader the one line.
        error = snapshot.nvml.error or "NVIDIA driver/NVML not available"

    previous = AssessState()
    if saved.get("boot_id") == snapshot.boot_id:
        try:
            previous = AssessState.from_json(saved.get("assess", {}))
        except ValueError:
            previous = AssessState()
    assessment = assess(snapshot, previous, policy.detection, health_policy=policy.health)
    report = build_report(
        snapshot,
        assessment.findings,
        assessment.roles,
        assessment.report_only,
        assessment.state.baselines,
        first_seen=(
            _first_seen_wall(saved, snapshot.monotonic, snapshot.wall_time)
            if saved.get("boot_id") == snapshot.boot_id  # monotonic times of an older boot lie
            else {}
        ),
        now_wall=snapshot.wall_time,
        version=__version__,
        hostname=os.uname().nodename,
        boot_time=read_boot_time(policy.proc_root),
        clock_ticks=os.sysconf("SC_CLK_TCK"),
        notes=assessment.notes,
    )
    report["daemon_view"] = {
        "used": view is not None,
        "reason": view_note,
        "polled": None if view is None else view.polled,
        "scan_reason": None
        if collector.last_scan_reason is None
        else collector.last_scan_reason.value,
    }
    note = None
    missing = missing_capabilities(policy.proc_root)
    if snapshot.holders.unreadable and missing:
        count = len(snapshot.holders.unreadable)
        note = (
            f"{count} processes could not be inspected (their fds/maps are unreadable; "
            f"this process lacks {', '.join(missing)}); the report is incomplete — run as root"
        )
    return ScanResult(report, error=error, permission_note=note, wedged=snapshot.nvml.wedged)


def _holder_replaced(procfs: ProcFS, view: HolderView) -> bool:
    """Whether a PID the view lists as a holder now names another process (its start ticks
    differ): that holder is gone, and the PID's new process is not one the view vouches
    for. Gone PIDs need no check here: the targeted scan misses them and walks."""
    for pid, ticks in view.holder_ticks.items():
        fields = procfs.read_stat(pid)
        if fields is not None and fields.starttime != ticks:
            return True
    return False


def _first_seen_wall(
    saved: Mapping[str, object], now_monotonic: float, now_wall: float
) -> dict[str, float]:
    """First-seen times from the daemon's plan state, converted from monotonic to wall time."""
    plan = saved.get("plan")
    seen = plan.get("seen") if isinstance(plan, dict) else None
    if not isinstance(seen, dict):
        return {}
    result: dict[str, float] = {}
    for key, entry in seen.items():
        mono = entry.get("first_seen") if isinstance(entry, dict) else None
        if isinstance(key, str) and isinstance(mono, (int, float)):
            result[key] = now_wall - max(0.0, now_monotonic - float(mono))
    return result
