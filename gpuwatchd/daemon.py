"""The daemon loop: collect → assess → plan → act, persisted, under systemd.

This module owns the lifecycle (lock, state load/save, interrupted-reset recovery, signals,
reload, sd_notify) and the glue that turns the planner's intents into actions and the actions'
outcomes back into planner state. It decides nothing itself: findings come from ``assess``,
intents from ``plan``; it never signals or resets anything the planner did not ask for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import structlog

from gpuwatchd import __version__
from gpuwatchd.act.commands import run_hooks
from gpuwatchd.act.reset import (
    ResetStep,
    ResetTarget,
    outcome_event,
    perform_reset,
    progress_record,
    resume_interrupted,
)
from gpuwatchd.act.signals import SIGNAL_OUTCOME_LEVELS, Signaller
from gpuwatchd.cli.scan import ACT_CAPABILITIES, missing_capabilities
from gpuwatchd.collect.collector import Collector
from gpuwatchd.collect.jobs import cgroup2_mount
from gpuwatchd.collect.nvml import NvmlClient
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.config.schema import ConfigError, load_policy
from gpuwatchd.decide.assess import Assessment, AssessState, assess, back_to_baseline
from gpuwatchd.decide.floor import reset_blockers
from gpuwatchd.decide.plan import (
    Event,
    HookIntent,
    PlanResult,
    PlanState,
    ResetIntent,
    SignalIntent,
    clear_circuit,
    clear_forced_dry_run,
    next_deadline,
    pending,
    plan,
    record_exit,
    record_reset,
    record_signal,
    set_paused,
)
from gpuwatchd.decide.policy import Policy
from gpuwatchd.logs import configure_logging
from gpuwatchd.model import ProcessIdentity, Snapshot
from gpuwatchd.pause import read_pause, take_clear_latches
from gpuwatchd.state import AlreadyRunning, StateStore

log = structlog.get_logger("gpuwatchd")

STATE_VERSION = 1
EX_OK = 0
EX_TEMPFAIL = 75
EX_UNAVAILABLE = 69
EX_NOPERM = 77
EX_CONFIG = 78


class Notifier:
    """sd_notify when systemd asked for it (NOTIFY_SOCKET set); silent otherwise."""

    def __init__(self) -> None:
        self._notifier: Any = None
        if os.environ.get("NOTIFY_SOCKET"):
            import sdnotify

            self._notifier = sdnotify.SystemdNotifier()

    def notify(self, message: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(message)


class _ResetEnv:
    """The daemon's side of the reset procedure (``reset.ResetEnvironment``)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def stop_nvml(self) -> bool:
        return self.daemon.nvml.stop()

    def final_blockers(self, target: ResetTarget) -> list[str]:
        procfs = self.daemon.procfs
        holders = procfs.scan_holders(None)
        pids = set(holders.holdings) | set(holders.unreadable)
        processes = procfs.read_processes(pids)
        return reset_blockers(holders, processes, target.minor, self.daemon.self_pids())

    def memory_back_to_baseline(self, target: ResetTarget) -> bool | None:
        reading = self.daemon.nvml.read()
        detection = self.daemon.policy.detection
        for gpu in reading.gpus:
            if gpu.uuid == target.uuid:
                allocated = gpu.memory.allocated if gpu.memory else None
                return back_to_baseline(target.uuid, allocated, self.daemon.assess_state, detection)
        return None

    def record_step(self, target: ResetTarget, step: ResetStep, data: Mapping[str, object]) -> None:
        record = progress_record(target, step, data)
        record["since"] = time.time()
        if step is ResetStep.DONE:
            self.daemon.reset_in_progress = None
        else:
            self.daemon.reset_in_progress = record
        self.daemon.save_state()

    def emit(self, event: str, level: str, **fields: object) -> None:
        getattr(log, level if level in _LEVELS else "info")(event, **fields)


_LEVELS = frozenset({"debug", "info", "warning", "error", "critical"})
_EXIT_GRACE = 0.01  # seconds to watch just-signalled targets before writing the state


class Daemon:
    """One running instance. Construct, then :meth:`run`."""

    def __init__(
        self,
        policy: Policy,
        *,
        config_path: str,
        dry_run: bool = False,
        once: bool = False,
        once_timeout: float = 600.0,
        nvml_env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config_path = config_path
        self.dry_run_flag = dry_run
        self.policy = self._effective(policy)
        self.once = once
        self.once_timeout = once_timeout
        self.clock = clock
        self.wall_clock = wall_clock
        self.notifier = Notifier()
        self.store = StateStore(policy.state_dir)
        self.procfs = ProcFS(
            policy.proc_root, devices_dir=policy.devices_dir, device_major=policy.device_major
        )
        self.nvml = NvmlClient(policy.nvml_timeout, env=nvml_env)
        self.collector = Collector(
            self.procfs,
            self.nvml,
            namespace_check=policy.namespace_check,
            full_scan_interval=policy.full_scan_interval,
            cgroup_root=cgroup2_mount(),
            clock=clock,
            wall_clock=wall_clock,
        )
        self.signaller = Signaller(policy.proc_root)
        self.assess_state = AssessState()
        self.plan_state = PlanState()
        self.reset_in_progress: dict[str, object] | None = None
        self.self_ancestors = self._ancestors()
        self.last_assessment: Assessment | None = None
        self.last_snapshot: Snapshot | None = None
        self._stop = False
        self._reload = False
        self._wakeup_r, self._wakeup_w = os.pipe()
        os.set_blocking(self._wakeup_w, False)
        os.set_blocking(self._wakeup_r, False)
        self._ready_sent = False
        self._saved_key: tuple[object, ...] | None = None
        self._paused_reason: str | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def run(self) -> int:
        try:
            os.makedirs(self.policy.state_dir, mode=0o700, exist_ok=True)
        except PermissionError:
            log.critical("daemon.no_permission", path=self.policy.state_dir)
            return EX_NOPERM
        try:
            with self.store.lock():
                return self._run_locked()
        except AlreadyRunning as exc:
            log.error("daemon.already_running", detail=str(exc), state_dir=self.policy.state_dir)
            return EX_TEMPFAIL
        finally:
            self.signaller.close()
            self.nvml.close()

    def _run_locked(self) -> int:
        self._install_signal_handlers()
        self._load_state()
        log.info(
            "daemon.start",
            version=__version__,
            dry_run=self.policy.dry_run,
            once=self.once,
            config=list(self.policy.sources) or [self.config_path],
            interval=self.policy.interval,
        )
        self._resume_interrupted_reset()
        started = self.clock()
        watched: frozenset[str] | None = None
        code = EX_OK
        while not self._stop:
            if self._reload:
                self._do_reload()
            result = self.poll_once()
            if not self._ready_sent:
                self.notifier.notify("READY=1")
                self._ready_sent = True
            if self.once:
                if watched is None:
                    if not self.last_snapshot or not self.last_snapshot.nvml.available:
                        code = EX_UNAVAILABLE
                        break
                    watched = frozenset(f.key for f in self._findings())
                if not pending(self.plan_state, watched):
                    break
                if self.clock() - started >= self.once_timeout:
                    log.warning("run_once.timeout", pending=sorted(watched))
                    code = EX_TEMPFAIL
                    break
            self._wait(result)
        self.notifier.notify("STOPPING=1")
        self.save_state()
        log.info("daemon.stop", exit_code=code)
        return code

    def _install_signal_handlers(self) -> None:
        def on_stop(signum: int, frame: FrameType | None) -> None:
            self._stop = True
            self._wake()

        def on_reload(signum: int, frame: FrameType | None) -> None:
            self._reload = True
            self._wake()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_reload)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wakeup_w, b"x")

    def _effective(self, policy: Policy) -> Policy:
        if self.dry_run_flag and not policy.dry_run:
            return dataclasses.replace(policy, dry_run=True)
        return policy

    def _do_reload(self) -> None:
        self._reload = False
        self.notifier.notify(f"RELOADING=1\nMONOTONIC_USEC={int(time.monotonic() * 1e6)}")
        try:
            new = load_policy(self.config_path)
        except ConfigError as exc:
            log.error("config.reload_rejected", error=str(exc), config=self.config_path)
        else:
            fixed = ("state_dir", "devices_dir", "proc_root", "device_major")
            changed = [k for k in fixed if getattr(new, k) != getattr(self.policy, k)]
            if changed:
                log.warning("config.reload_partial", needs_restart=changed)
                new = dataclasses.replace(new, **{k: getattr(self.policy, k) for k in changed})
            self.policy = self._effective(new)
            self.nvml.timeout = self.policy.nvml_timeout
            self.collector.full_scan_interval = self.policy.full_scan_interval
            log.info("config.reloaded", config=list(self.policy.sources), dry_run=new.dry_run)
        self.notifier.notify("READY=1")

    # --- one poll -------------------------------------------------------------------------

    def poll_once(self) -> PlanResult:
        snapshot = self.collector.collect()
        self.last_snapshot = snapshot
        if snapshot.boot_id != self.assess_state.boot_id and self.assess_state.boot_id:
            log.info("state.boot_changed", old=self.assess_state.boot_id, new=snapshot.boot_id)
        assessment = assess(snapshot, self.assess_state, self.policy.detection)
        self.assess_state = assessment.state
        self.last_assessment = assessment
        self._apply_admin_switches()
        # Time is the snapshot's: a finding "was seen" when /proc and NVML were read, not when
        # a long full scan of this same poll ended (its for-window must not start late).
        result = plan(
            assessment.findings,
            snapshot,
            self.plan_state,
            self.policy,
            now=snapshot.monotonic,
            wall=snapshot.wall_time,
            report_only=assessment.report_only,
            self_ancestors=self.self_ancestors,
        )
        self._take(result)
        signalled = False
        for intent in result.intents:
            if self._stop:
                break
            self._execute(intent)
            signalled = signalled or (isinstance(intent, SignalIntent) and not intent.dry_run)
        if signalled:
            # Most targets die within milliseconds of a signal: see that before the state write
            # (whose fsyncs can take tens of ms), not after it.
            self._note_exits(self.signaller.wait(_EXIT_GRACE))
        self.save_state()
        self._notify_status(snapshot, assessment)
        return result

    def _note_exits(self, exited: list[ProcessIdentity]) -> None:
        for identity in exited:
            log.info("target.exited", pid=identity.pid, start_ticks=identity.start_ticks)
            self._take(record_exit(self.plan_state, identity, now=self.clock()))

    def _apply_admin_switches(self) -> None:
        reason = read_pause(self.policy.state_dir)
        if reason != self._paused_reason:
            self._paused_reason = reason
            self.plan_state = set_paused(
                self.plan_state, reason is not None, reason=reason or "admin"
            )
            log.warning("daemon.paused" if reason is not None else "daemon.resumed", reason=reason)
        if take_clear_latches(self.policy.state_dir):
            self.plan_state = clear_circuit(clear_forced_dry_run(self.plan_state))
            log.warning("limits.latches_cleared")

    def _take(self, result: PlanResult) -> tuple[SignalIntent | ResetIntent | HookIntent, ...]:
        """Adopt the planner's new state, log its events, return its follow-up intents."""
        self.plan_state = result.state
        for event in result.events:
            _log_event(event)
        return tuple(result.intents)

    def _execute(self, intent: SignalIntent | ResetIntent | HookIntent) -> None:
        if isinstance(intent, SignalIntent):
            outcome = self.signaller.send(intent.identity, intent.signal, dry_run=intent.dry_run)
            level = SIGNAL_OUTCOME_LEVELS.get(outcome.outcome.value, "info")
            fields: dict[str, object] = dict(intent.facts)
            fields.update(
                pid=intent.identity.pid,
                start_ticks=intent.identity.start_ticks,
                signal=intent.signal,
                gpu=intent.gpu,
                rule=intent.rule,
                step=intent.step,
                dry_run=intent.dry_run,
                outcome=outcome.outcome.value,
                detail=outcome.detail,
                reason=intent.reason,
            )
            getattr(log, level)("action.signal", **fields)
            follow_up = self._take(
                record_signal(self.plan_state, intent, outcome.outcome.value, now=self.clock())
            )
            for next_intent in follow_up:
                self._execute(next_intent)
        elif isinstance(intent, ResetIntent):
            self._execute_reset(intent)
        elif intent.dry_run:
            for hook in self.policy.on_failure:
                log.info(
                    "hook.run",
                    hook=intent.hook,
                    argv=list(hook.argv),
                    dry_run=True,
                    outcome="dry_run",
                    reason=intent.reason,
                )
        else:
            results = run_hooks(
                self.policy.on_failure,
                env={"GPUWATCHD_EVENT": intent.hook, "GPUWATCHD_REASON": intent.reason},
            )
            for res in results:
                log.warning(
                    "hook.run",
                    hook=intent.hook,
                    dry_run=False,
                    argv=list(res.argv),
                    returncode=res.returncode,
                    timed_out=res.timed_out,
                    output=res.output[-2000:],
                    reason=intent.reason,
                )

    def _execute_reset(self, intent: ResetIntent) -> None:
        gpu = _gpu(self.last_snapshot, intent.gpu)
        target = ResetTarget(
            uuid=intent.gpu,
            pci_bus_id=intent.pci_bus_id,
            minor=intent.minor,
            persistence_was_on=gpu.persistence_mode if gpu else None,
        )
        env = _ResetEnv(self)
        outcome_box: list[Any] = []

        def work() -> None:
            outcome_box.append(
                perform_reset(
                    target,
                    self.policy.reset,
                    env,
                    dry_run=intent.dry_run,
                    hook_env={"GPUWATCHD_GPU_UUID": intent.gpu},
                )
            )

        thread = threading.Thread(target=work, name="gpu-reset", daemon=True)
        thread.start()
        # Keep feeding the watchdog while the reset child is within its deadline.
        while thread.is_alive():
            thread.join(timeout=1.0)
            self.notifier.notify(f"WATCHDOG=1\nSTATUS=resetting GPU {intent.gpu}")
        if not outcome_box:
            log.error("reset.crashed", gpu=intent.gpu)
            return
        outcome = outcome_box[0]
        level, fields = outcome_event(
            outcome, gpu=intent.gpu, pci_bus_id=intent.pci_bus_id, dry_run=intent.dry_run
        )
        getattr(log, level)("reset.outcome", **fields)
        follow_up = self._take(
            record_reset(
                self.plan_state,
                intent,
                outcome.result,
                now=self.clock(),
                wall=self.wall_clock(),
                needs_reboot=outcome.needs_reboot,
            )
        )
        for next_intent in follow_up:
            self._execute(next_intent)

    def _wait(self, result: PlanResult) -> None:
        """Sleep until the next poll or deadline, waking at once for exits and signals."""
        now = self.clock()
        until = now + self.policy.interval
        due = next_deadline(self.plan_state)
        if due is not None:
            until = min(until, max(now, due))
        while not self._stop and not self._reload:
            remaining = until - self.clock()
            if remaining <= 0:
                return
            poller = select.poll()
            poller.register(self._wakeup_r, select.POLLIN)
            for fd in self.signaller.fileno_list():
                poller.register(fd, select.POLLIN)
            slice_s = min(remaining, max(1.0, self._watchdog_slice()))
            try:
                ready = poller.poll(slice_s * 1000)
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                ready = []
            self.notifier.notify("WATCHDOG=1")
            if any(fd == self._wakeup_r for fd, _ in ready):
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wakeup_r, 4096)
            exited = self.signaller.wait(0)
            self._note_exits(exited)
            if exited:
                self.save_state()
                return

    @staticmethod
    def _watchdog_slice() -> float:
        usec = os.environ.get("WATCHDOG_USEC")
        if usec and usec.isdigit():
            return int(usec) / 1e6 / 3
        return 5.0

    def _notify_status(self, snapshot: Snapshot, assessment: Assessment) -> None:
        status = describe_status(snapshot, assessment, self.plan_state, self.policy.dry_run)
        self.notifier.notify(f"STATUS={status}\nWATCHDOG=1")

    def _findings(self) -> tuple[Any, ...]:
        return self.last_assessment.findings if self.last_assessment else ()

    # --- state ----------------------------------------------------------------------------

    def self_pids(self) -> frozenset[int]:
        return frozenset({os.getpid()}) | self.nvml.worker_pids

    def _ancestors(self) -> frozenset[int]:
        found: set[int] = set()
        pid = os.getppid()
        for _ in range(64):
            if pid <= 1 or pid in found:
                break
            found.add(pid)
            info = self.procfs.read_process(pid)
            if info is None or info.ppid is None:
                break
            pid = info.ppid
        return frozenset(found)

    def _load_state(self) -> None:
        data = self.store.load()
        boot_id = self.procfs.boot_id()
        if not data:
            return
        try:
            if data.get("version") != STATE_VERSION:
                raise ValueError(f"unsupported state version {data.get('version')!r}")
            self.assess_state = AssessState.from_json(data.get("assess"))
            self.plan_state = PlanState.from_json(data.get("plan"))
            record = data.get("reset_in_progress")
            self.reset_in_progress = dict(record) if isinstance(record, dict) else None
        except ValueError as exc:
            log.error("state.invalid", error=str(exc), path=self.policy.state_dir)
            self.assess_state, self.plan_state = AssessState(), PlanState()
            self.reset_in_progress = None
        if data and data.get("boot_id") != boot_id:
            log.info("state.new_boot", saved_boot_id=data.get("boot_id"), boot_id=boot_id)

    def save_state(self) -> None:
        """Write the state when it changed (a quiet poll costs no write and no fsync)."""
        boot_id = self.procfs.boot_id()
        # last_wall moves every poll; an older one on disk only hides no backward clock step.
        key = (
            boot_id,
            self.assess_state,
            dataclasses.replace(self.plan_state, last_wall=None),
            self.reset_in_progress,
        )
        if key == self._saved_key:
            return
        data = {
            "version": STATE_VERSION,
            "boot_id": boot_id,
            "saved_at": self.wall_clock(),
            "assess": self.assess_state.to_json(),
            "plan": self.plan_state.to_json(),
            "reset_in_progress": self.reset_in_progress,
        }
        try:
            self.store.save(data)
        except OSError as exc:
            log.error("state.save_failed", error=str(exc), path=self.policy.state_dir)
            return
        self._saved_key = key

    def _resume_interrupted_reset(self) -> None:
        record = self.reset_in_progress
        if not record:
            return
        log.warning("reset.resume", record=record)
        outcome = resume_interrupted(record, self.policy.reset, _ResetEnv(self))
        self.reset_in_progress = None
        self.save_state()
        if outcome is not None:
            log.warning(
                "reset.resumed",
                gpu=record.get("uuid"),
                result=outcome.result,
                step=outcome.step.value,
                reason=outcome.reason,
                needs_reboot=outcome.needs_reboot,
            )


def _gpu(snapshot: Snapshot | None, uuid: str) -> Any:
    if snapshot is None:
        return None
    for gpu in snapshot.nvml.gpus:
        if gpu.uuid == uuid:
            return gpu
    return None


def _log_event(event: Event) -> None:
    level = event.level if event.level in _LEVELS else "info"
    getattr(log, level)(event.name, **dict(event.fields))


def describe_status(
    snapshot: Snapshot, assessment: Assessment, state: PlanState, dry_run: bool
) -> str:
    """The one-line ``systemctl status`` text."""
    reading = snapshot.nvml
    if not reading.available:
        return f"NVML unavailable: {reading.error or 'unknown error'} (retrying)"
    parts = [f"{len(reading.gpus)} GPUs watched"]
    if reading.wedged:
        parts.insert(0, "driver wedged")
    lost = [g for g in reading.gpus if g.lost]
    if lost:
        parts.append(f"{len(lost)} lost (needs reboot)")
    count = len(assessment.findings)
    parts.append(f"{count} finding{'s' if count != 1 else ''}")
    ladders = list(state.ladders.values())
    active = sum(1 for lad in ladders if lad.status == "active")
    parts.append(f"{active} action{'s' if active != 1 else ''} under way")
    stuck = sum(1 for lad in ladders if lad.status == "stuck")
    if stuck:
        parts.append(f"{stuck} stuck in D state (needs drain/reboot)")
    if state.paused:
        parts.append("paused")
    if state.forced_dry_run:
        parts.append("kill cap reached: forced dry-run")
    elif dry_run:
        parts.append("dry-run")
    if state.circuit_open:
        parts.append("resets stopped (circuit breaker)")
    return ", ".join(parts)


def run_daemon(
    policy: Policy,
    *,
    config_path: str,
    dry_run: bool,
    once: bool,
    once_timeout: float,
) -> int:
    interactive = sys.stderr.isatty() and not os.environ.get("JOURNAL_STREAM")
    configure_logging(fmt="console" if interactive else policy.log_format)
    missing = missing_capabilities(policy.proc_root, ACT_CAPABILITIES)
    if missing:
        effective_dry_run = dry_run or policy.dry_run
        if not effective_dry_run:
            log.critical(
                "daemon.no_permission",
                missing=missing,
                detail="enforcing needs these capabilities (run as root); refusing to start",
            )
            return EX_NOPERM
        log.warning("daemon.limited_permissions", missing=missing, dry_run=True)
    daemon = Daemon(
        policy,
        config_path=config_path,
        dry_run=dry_run,
        once=once,
        once_timeout=once_timeout,
    )
    try:
        return daemon.run()
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            log.critical("daemon.no_permission", error=str(exc))
            return EX_NOPERM
        raise
