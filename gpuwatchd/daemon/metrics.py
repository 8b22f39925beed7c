"""Prometheus metrics, written to a file for node_exporter's textfile collector.

In detail: docs/internals.md, section `gpuwatchd.daemon.metrics`.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections import Counter as Tally
from collections.abc import Callable, Mapping
from typing import TypeVar

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Summary, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from gpuwatchd import __version__
from gpuwatchd.core.model import FindingKind, GpuInfo, Snapshot
from gpuwatchd.core.vocabulary import (
    EventName,
    HookOutcome,
    LadderStatus,
    LeftoverName,
    Level,
    ResetResult,
    SignalOutcome,
)
from gpuwatchd.decide.assess.host_view import HostView
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.mig.instances import instance_view, mig_layout
from gpuwatchd.decide.policy import SIGNAL_NAMES
from gpuwatchd.decide.verdict import NodeVerdict
from gpuwatchd.engine.edges import PollReport
from gpuwatchd.events.catalogue import HOOK_SUCCEEDED, hook_outcome
from gpuwatchd.state.directory import StateDir, open_directory

log = structlog.get_logger("gpuwatchd")

# node_exporter runs as its own user (Debian: prometheus); the unit's UMask=0077 would make
# the file unreadable to it, so the mode is set explicitly. The file holds no secret.
TEXTFILE_MODE = 0o644
# Where docs/metrics.md tells Debian users to put the file (node_exporter's textfile directory
# there); the package's prerm removes our file from it, and from the policy's path.
DEBIAN_TEXTFILE = "/var/lib/prometheus/node-exporter/gpuwatchd.prom"
OTHER = "other"  # the label value of anything outside a bounded set (a bug, or a new name)
GPU_LABELS = ("gpu", "index")
MIG_LABELS = ("gpu", "index", "gi", "instance")  # parent GPU, GPU instance id, MIG UUID
_HOOK_NAME = re.compile(r"[a-z_]{1,32}")

_SIGNALS = frozenset(SIGNAL_NAMES)
_SIGNAL_OUTCOMES = frozenset(o.value for o in SignalOutcome)
_RESET_RESULTS = frozenset(r.value for r in ResetResult)
_KINDS = frozenset(k.value for k in FindingKind)
# The hook metric's label of how a hook ended (``hook_outcome``); any other end is "failed".
_HOOK_RESULTS = {HookOutcome.DRY_RUN.value: "dry_run", HOOK_SUCCEEDED: "ok"}


def _why_not_written(path: str, err: OSError) -> str:
    """The write error, and for the two a folder made after the daemon started gives, what
    to do: a unit with ``ProtectSystem=strict`` sees a folder as writable only if it is in
    ``ReadWritePaths=`` and existed when the unit started."""
    error = err.strerror or str(err)
    folder = os.path.dirname(os.path.abspath(path))
    if err.errno == errno.EROFS:
        return (
            f"{error}: {folder} is read-only to gpuwatchd; under systemd a folder must be in "
            "the unit's ReadWritePaths= and exist when the unit starts: add it "
            "(systemctl edit gpuwatchd), or restart gpuwatchd if it was made after the start"
        )
    if err.errno == errno.ENOENT:
        return (
            f"{error}: {folder} does not exist; create it (node_exporter's textfile "
            "directory), then restart gpuwatchd so the unit's ReadWritePaths= covers it"
        )
    return error


def _label(value: object, allowed: frozenset[str]) -> str:
    text = str(value)
    return text if text in allowed else OTHER


def write_textfile(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (a fresh temporary file renamed over it, mode
    :data:`TEXTFILE_MODE`, no fsync), through the descriptor of a folder reached by a walk from
    ``/`` that follows no link. Raises OSError (StateDirError for a link on the way)."""
    directory, name = os.path.split(os.path.abspath(path))
    dir_fd = open_directory(directory, owners=None, readable=False)
    # The state directory's own atomic write, through this folder's descriptor (no owners).
    with StateDir(directory, dir_fd, owners=frozenset()) as folder:
        folder.write(name, data, mode=TEXTFILE_MODE, sync=False)


def remove_textfile(path: str) -> bool:
    """Remove ``path`` if it is a metrics file gpuwatchd wrote (a regular ``*.prom`` file,
    reached as :func:`write_textfile` reaches it, whose first MiB holds our build_info sample);
    True when it was removed. For the package's removal. Never raises."""
    directory, name = os.path.split(os.path.abspath(path))
    if not name.endswith(".prom"):
        return False
    try:
        dir_fd = open_directory(directory, owners=None, readable=False)
    except OSError:
        return False
    with StateDir(directory, dir_fd, owners=frozenset()) as folder:
        return _ours(dir_fd, name) and folder.remove(name)


def _ours(dir_fd: int, name: str) -> bool:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
        try:
            head = os.read(fd, 1 << 20) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        finally:
            os.close(fd)
    except OSError:
        return False
    return b"\ngpuwatchd_build_info{" in b"\n" + head


M = TypeVar("M", bound=MetricWrapperBase)


def _maker(
    kind: type[M], registry: CollectorRegistry, labels: tuple[str, ...] = ()
) -> Callable[..., M]:
    """``make(name, doc, extra=())``: a ``kind`` metric in ``registry`` whose labels are
    ``labels`` then ``extra`` (every metric of gpuwatchd is made this way)."""

    def make(name: str, doc: str, extra: tuple[str, ...] = ()) -> M:
        return kind(name, doc, (*labels, *extra), registry=registry)

    return make


def _accounted(host: HostView, gpu: GpuInfo) -> int | None:
    """What NVML's per-process figures of the live PIDs it lists on ``gpu`` add up to (a
    listed zombie counts as live, as in assess); None when the list or a figure is unknown."""
    if gpu.processes is None:
        return None
    figures = [row.entry.used_memory for row in host.listings[gpu.uuid] if row.status != "dead"]
    return None if None in figures else sum(f for f in figures if f is not None)


def _put(gauge: Gauge, labels: tuple[str, ...], value: float | None) -> None:
    """Set ``gauge``'s sample of ``labels`` to ``value``; unknown (None): no sample."""
    if value is not None:
        gauge.labels(*labels).set(value)


class _MigGauges:
    """Per-instance memory and findings of the node's judged MIG GPUs (docs/metrics.md#mig),
    set afresh each poll; at most seven GPU instances per GPU."""

    def __init__(self, registry: CollectorRegistry) -> None:
        gauge = _maker(Gauge, registry, MIG_LABELS)
        self.allocated = gauge(
            "gpuwatchd_mig_instance_memory_allocated_bytes",
            "Memory allocated in the MIG GPU instance (shared by its compute instances)",
        )
        self.accounted = gauge(
            "gpuwatchd_mig_instance_memory_accounted_bytes",
            "Memory NVML attributes to the live processes it lists in the GPU instance",
        )
        self.ghost = gauge(
            "gpuwatchd_mig_instance_memory_ghost_bytes",
            "Memory of a current ghost_memory finding in the GPU instance, else 0",
        )
        self.findings = gauge(
            "gpuwatchd_mig_instance_findings",
            "Current findings about the GPU instance, by kind",
            ("kind",),
        )

    def update(self, snapshot: Snapshot, assessment: Assessment) -> None:
        for gauge in (self.allocated, self.accounted, self.ghost, self.findings):
            gauge.clear()
        layout = mig_layout(snapshot)
        if not layout.instances:
            return
        host = HostView(instance_view(snapshot, layout))
        by_uuid = {gpu.uuid: gpu for gpu in host.gpus}
        for uuid, instance in sorted(layout.instances.items()):
            labels = (instance.parent.uuid, str(instance.parent.index), str(instance.gi), uuid)
            gpu = by_uuid.get(uuid)
            memory = None if gpu is None else gpu.memory
            allocated = None if memory is None else memory.allocated
            _put(self.allocated, labels, allocated)
            _put(self.accounted, labels, None if gpu is None else _accounted(host, gpu))
            mine = [f for f in assessment.findings if f.gpu == uuid]
            ghost = 0 if allocated is not None else None
            for finding in mine:
                if finding.kind is FindingKind.GHOST_MEMORY and finding.memory is not None:
                    ghost = finding.memory
            _put(self.ghost, labels, ghost)
            kinds = Tally(f.kind.value for f in mine)
            for kind in FindingKind:
                self.findings.labels(*labels, kind.value).set(kinds[kind.value])


class _GpuGauges:
    """The per-GPU gauges (labels ``gpu`` = UUID, ``index``), set afresh each poll."""

    def __init__(self, registry: CollectorRegistry) -> None:
        gauge = _maker(Gauge, registry, GPU_LABELS)
        self.allocated = gauge(
            "gpuwatchd_gpu_memory_allocated_bytes",
            "GPU memory allocated (total - free - reserved), as NVML reports it",
        )
        self.accounted = gauge(
            "gpuwatchd_gpu_memory_accounted_bytes",
            "GPU memory NVML attributes to the live processes it lists on the GPU",
        )
        self.unaccounted = gauge(
            "gpuwatchd_gpu_memory_unaccounted_bytes",
            "Allocated GPU memory that no live listed process accounts for (includes the "
            "idle baseline)",
        )
        self.ghost = gauge(
            "gpuwatchd_gpu_memory_ghost_bytes",
            "GPU memory of a current ghost_memory finding (held by no live process), else 0",
        )
        self.lost = gauge("gpuwatchd_gpu_lost", "1 when NVML reports the GPU lost")

    def update(self, snapshot: Snapshot, assessment: Assessment) -> None:
        for gauge in (self.allocated, self.accounted, self.unaccounted, self.ghost, self.lost):
            gauge.clear()  # a GPU that is gone, or a value now unknown, loses its sample
        host = HostView(snapshot)
        ghosts = {
            f.gpu: f.memory for f in assessment.findings if f.kind is FindingKind.GHOST_MEMORY
        }
        for gpu in host.gpus:
            labels = (gpu.uuid, str(gpu.index))
            self.lost.labels(*labels).set(gpu.lost)
            if gpu.lost:
                continue  # its memory figures are whatever was read before it was lost
            allocated = gpu.memory.allocated if gpu.memory is not None else None
            _put(self.allocated, labels, allocated)
            if gpu.mig_enabled or gpu.coherent_memory is not False:
                continue  # no memory-based detection there (as in assess)
            accounted = _accounted(host, gpu)
            _put(self.accounted, labels, accounted)
            if accounted is not None and allocated is not None:
                self.unaccounted.labels(*labels).set(max(allocated - accounted, 0))
            # No ghost finding is a known 0 only where allocated memory was read.
            _put(self.ghost, labels, ghosts.get(gpu.uuid, 0 if allocated is not None else None))


class _VerdictGauges:
    """Whether a new job may have each GPU, as ``check-clean`` says it (decide/verdict.py), and
    why not, by reason kind (finding kinds and leftover names: a bounded set). No sample for
    a GPU when the node could not be judged."""

    def __init__(self, registry: CollectorRegistry) -> None:
        gauge = _maker(Gauge, registry, GPU_LABELS)
        self.clean = gauge(
            "gpuwatchd_gpu_clean",
            "1 when a new job may have the GPU (check-clean's verdict), 0 when not",
        )
        self.reasons = gauge(
            "gpuwatchd_gpu_not_clean_reasons",
            "Why the GPU is not clean: the verdict's reasons, by kind",
            ("kind",),
        )

    def update(self, verdict: NodeVerdict | None) -> None:
        self.clean.clear()
        self.reasons.clear()
        if verdict is None or verdict.unavailable is not None:
            return
        for gpu in verdict.gpus:
            labels = (gpu.uuid, str(gpu.index))
            self.clean.labels(*labels).set(gpu.clean)
            for kind, count in Tally(_label(r.kind, _REASON_KINDS) for r in gpu.reasons).items():
                self.reasons.labels(*labels, kind).set(count)


_REASON_KINDS = _KINDS | frozenset(n.value for n in LeftoverName)


class _HealthGauges:
    """GPU health (docs/findings.md#gpu-health): Xids seen by number, row remapping, the
    recovery action. Unknown or not supported: no sample. Xid labels are bounded by the
    health state (at most 64 distinct Xids per GPU)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        gauge = _maker(Gauge, registry, GPU_LABELS)
        self.xids = gauge(
            "gpuwatchd_gpu_xid_events",
            "Xid events seen on the GPU since the daemon's state began (this boot), by Xid",
            ("xid",),
        )
        self.rows = gauge(
            "gpuwatchd_gpu_remapped_rows",
            "Rows remapped on the GPU, by cause (correctable, uncorrectable)",
            ("cause",),
        )
        self.pending = gauge("gpuwatchd_gpu_remap_pending", "1 when a row remap waits for a reset")
        self.failure = gauge("gpuwatchd_gpu_remap_failure", "1 when row remapping failed")
        self.action = gauge(
            "gpuwatchd_gpu_recovery_action",
            "The driver's recovery action (0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, "
            "4 drain and reset)",
        )

    def update(self, snapshot: Snapshot, assessment: Assessment) -> None:
        for gauge in (self.xids, self.rows, self.pending, self.failure, self.action):
            gauge.clear()
        history = assessment.state.health.gpus
        for gpu in snapshot.nvml.gpus:
            if not gpu.uuid:
                continue
            labels = (gpu.uuid, str(gpu.index))
            carried = history.get(gpu.uuid)
            for xid, record in sorted(carried.xids.items()) if carried else ():
                self.xids.labels(*labels, str(xid)).set(record.count)
            health = gpu.health
            if health is None or gpu.lost:
                continue
            _put(self.action, labels, health.recovery_action)
            _put(self.rows, (*labels, "correctable"), health.remap_correctable)
            _put(self.rows, (*labels, "uncorrectable"), health.remap_uncorrectable)
            _put(self.pending, labels, health.remap_pending)
            _put(self.failure, labels, health.remap_failure)


class _StateGauges:
    """Node-wide gauges: findings, ladders and the 0/1 switches and latches."""

    def __init__(self, registry: CollectorRegistry) -> None:
        gauge = _maker(Gauge, registry)
        self.findings = gauge("gpuwatchd_findings", "Current findings, by kind", ("kind",))
        self.ladders = gauge(
            "gpuwatchd_ladders",
            "Escalation ladders by status (active: in progress; stuck: target in D state)",
            ("status",),
        )
        flags = {
            "dry_run": "1 when the policy (or run --dry-run) is dry-run",
            "paused": "1 while gpuwatchd pause holds every action",
            "kill_cap_latched": "1 while the kill cap has forced dry-run (until resume "
            "--clear-latches)",
            "reset_circuit_open": "1 while the reset circuit breaker is open (no resets)",
            "nvml_wedged": "1 when an NVML call missed its deadline this poll",
            "nvml_unavailable": "1 when NVML could not be used this poll",
            "policy_rejected": "1 when the last reload, or the start, rejected the policy (an "
            "older one is in force)",
        }
        self.flags = {name: gauge(f"gpuwatchd_{name}", doc) for name, doc in flags.items()}
        self.paused_until = gauge(
            "gpuwatchd_paused_until_timestamp_seconds",
            "Unix time the current pause ends by itself (0 when not paused)",
        )

    def update(self, report: PollReport, *, dry_run: bool, policy_rejected: bool) -> None:
        state, reading = report.plan, report.snapshot.nvml
        kinds = Tally(f.kind.value for f in report.assessment.findings)
        for kind in FindingKind:
            self.findings.labels(kind.value).set(kinds[kind.value])
        statuses = Tally(str(ladder.status) for ladder in state.ladders.values())
        for status in LadderStatus:
            self.ladders.labels(status.value).set(statuses[status.value])
        flags = self.flags
        flags["dry_run"].set(dry_run)
        flags["policy_rejected"].set(policy_rejected)
        flags["paused"].set(state.paused)
        flags["kill_cap_latched"].set(state.forced_dry_run)
        flags["reset_circuit_open"].set(state.circuit_open)
        flags["nvml_wedged"].set(reading.wedged)
        flags["nvml_unavailable"].set(not reading.available)
        ends = state.paused_until if state.paused else None
        self.paused_until.set(0.0 if ends is None else ends)


class _PollGauges:
    """How the last poll went: duration, time, whether it scanned all of /proc."""

    def __init__(self, registry: CollectorRegistry) -> None:
        gauge = _maker(Gauge, registry)
        self.duration = _maker(Summary, registry)(
            "gpuwatchd_poll_duration_seconds",
            "Time one engine cycle took (collect, assess, plan, act)",
        )
        self.last_duration = gauge(
            "gpuwatchd_last_poll_duration_seconds", "Time the last engine cycle took"
        )
        self.last_success = gauge(
            "gpuwatchd_last_successful_poll_timestamp_seconds",
            "Unix time the last engine cycle completed",
        )
        self.last_full = gauge(
            "gpuwatchd_last_poll_full_scan",
            "1 when the last poll scanned all of /proc for holders, 0 when it was targeted",
        )
        self.full_scans = _maker(Counter, registry)(
            "gpuwatchd_full_scans", "Polls that scanned all of /proc for holders"
        )

    def update(self, report: PollReport) -> None:
        full = report.snapshot.holders.mode == "full"
        self.duration.observe(report.seconds)
        self.last_duration.set(report.seconds)
        self.last_success.set(report.started_wall + report.seconds)  # when it completed
        self.last_full.set(full)
        if full:
            self.full_scans.inc()


class Metrics:
    """gpuwatchd's metrics in a private registry, and the ``.prom`` file they are written to
    (``textfile``; None: kept, not written)."""

    def __init__(self, textfile: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.textfile = textfile
        registry = self.registry  # the groups are made in the order the exposition lists them
        _maker(Gauge, registry)(
            "gpuwatchd_build_info", "Always 1; the version label is gpuwatchd's", ("version",)
        ).labels(__version__).set(1)
        counter = _maker(Counter, registry)
        self._signals = counter(
            "gpuwatchd_signals",
            "Signals carried out (dry_run: would have been sent), by signal and outcome",
            ("signal", "outcome"),
        )
        self._resets = counter("gpuwatchd_resets", "GPU reset procedures, by result", ("result",))
        self._mig_recoveries = counter(
            "gpuwatchd_mig_recoveries",
            "Re-creations of one MIG GPU instance (reset.mig_recovery), by result",
            ("result",),
        )
        self._hooks = counter(
            "gpuwatchd_hooks",
            "Hooks run, by hook and result (ok: exit 0; failed; dry_run: not started)",
            ("hook", "result"),
        )
        self._findings_new = counter(
            "gpuwatchd_findings_new", "Findings that appeared, by kind", ("kind",)
        )
        for result in ResetResult:  # known from the start, so increase() sees the first one
            self._resets.labels(result.value)
            self._mig_recoveries.labels(result.value)
        for kind in FindingKind:
            self._findings_new.labels(kind.value)
        gpus, health, mig = _GpuGauges(registry), _HealthGauges(registry), _MigGauges(registry)
        self._assessed = (gpus, mig, health)  # each set from a poll's assessment, in this order
        self._state = _StateGauges(registry)
        self._verdict = _VerdictGauges(registry)
        self._poll = _PollGauges(registry)
        self._write_errors = counter(
            "gpuwatchd_textfile_write_errors",
            "Failed writes of this file (seen once a later write succeeds)",
        )
        self._written: str | None = None  # the path last written successfully
        self._last_error: str | None = None  # the failure last logged, until a write succeeds

    def observe(self, name: str, level: Level, fields: Mapping[str, object]) -> None:
        """Count one engine event (``level`` is not used; the signature is the event sink's)."""
        if name == EventName.ACTION_SIGNAL:
            signal = _label(fields.get("signal"), _SIGNALS)
            self._signals.labels(signal, _label(fields.get("outcome"), _SIGNAL_OUTCOMES)).inc()
        elif name == EventName.RESET_OUTCOME:  # also said for a resumed reset it books
            # A MIG GPU instance's re-creation is the reset procedure, but not a GPU reset.
            counter = self._mig_recoveries if fields.get("instance") else self._resets
            counter.labels(_label(fields.get("result"), _RESET_RESULTS)).inc()
        elif name == EventName.HOOK_RUN:
            hook = str(fields.get("hook"))
            hook = hook if _HOOK_NAME.fullmatch(hook) else OTHER
            self._hooks.labels(hook, _HOOK_RESULTS.get(hook_outcome(fields), "failed")).inc()
        elif name == EventName.FINDING_NEW:
            self._findings_new.labels(_label(fields.get("kind"), _KINDS)).inc()

    def after_poll(self, report: PollReport, *, dry_run: bool, policy_rejected: bool) -> str | None:
        """Set the gauges from one completed poll's report, then write the file if one is
        configured; why the write failed (also logged), or None."""
        for group in self._assessed:
            group.update(report.snapshot, report.assessment)
        self._state.update(report, dry_run=dry_run, policy_rejected=policy_rejected)
        self._verdict.update(report.verdict)
        self._poll.update(report)
        return self.write()

    def render(self) -> bytes:
        """The metrics in Prometheus' text exposition format, without the ``*_created``
        series prometheus_client adds to every counter and summary (a start time per label
        set: noise in a textfile, and twice the series): their HELP and TYPE lines and their
        samples. No metric of ours is named so on purpose."""
        kept = []
        for line in generate_latest(self.registry).split(b"\n"):
            words = line.split(b" ", 3)
            name = words[2] if line.startswith(b"# ") and len(words) > 2 else words[0]
            if not name.split(b"{", 1)[0].endswith(b"_created"):
                kept.append(line)
        return b"\n".join(kept)

    def write(self) -> str | None:
        """Write the file (if configured); why it failed, or None."""
        path = self.textfile
        if path is None:
            return None
        try:
            write_textfile(path, self.render())
        except OSError as err:
            self._write_errors.inc()
            # Without the file name: it may be the random temporary one, and a failure that
            # lasts is said once.
            error = _why_not_written(path, err)
            if error != self._last_error:
                log.error(EventName.METRICS_WRITE_FAILED, path=path, error=error)
                self._last_error = error
            return error
        self._written, self._last_error = path, None
        return None

    def set_textfile(self, path: str | None) -> None:
        """Write to ``path`` from now on; the file written before, if another, is removed so
        that node_exporter does not go on serving its stale samples (as the package removes
        it: :func:`remove_textfile`)."""
        old = self._written
        if path != self.textfile:  # a failure there is news, even in the old one's words
            self._last_error = None
        self.textfile = path
        if old is not None and old != path:
            remove_textfile(old)
            self._written = None
