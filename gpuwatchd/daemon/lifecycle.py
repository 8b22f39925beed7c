"""The daemon's lifecycle around the engine: lock, state file, signals, reload, sd_notify.

In detail: docs/internals.md, section `gpuwatchd.daemon.lifecycle`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import os
import select
import signal
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TypeVar

import structlog

from gpuwatchd import __version__
from gpuwatchd.act.evidence import EvidenceKeeper, ReportBuilder
from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.collect.capabilities import missing_capabilities
from gpuwatchd.collect.jobs import boot_ticks_now
from gpuwatchd.config.changes import policy_changes
from gpuwatchd.config.files import policy_files_key
from gpuwatchd.config.schema import load_policy
from gpuwatchd.config.yamlsrc import ConfigError
from gpuwatchd.core.checked import obj
from gpuwatchd.core.model import fields_of
from gpuwatchd.core.vocabulary import Cleanliness, EventName, ExitCode, HookOutcome, Level
from gpuwatchd.daemon.host import LogSink, SystemClock, build_real_host, node_name
from gpuwatchd.daemon.metrics import Metrics
from gpuwatchd.daemon.notify import (
    Notifier,
    WatchdogPinger,
    describe_status,
    keep_watchdog_fed,
    watchdog_slice,
)
from gpuwatchd.daemon.serving import ScanServing
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.health.state import HealthState
from gpuwatchd.decide.plan.decisions import another_boots, pending_keys
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.verdict import (
    UNREADABLE,
    OnceStep,
    lost_state,
    once_progress,
)
from gpuwatchd.engine.cycle import Engine, EngineState
from gpuwatchd.engine.edges import Pause, PollInputs, PollReport, Standing, TakenXids
from gpuwatchd.events.catalogue import hook_outcome
from gpuwatchd.events.words import JournalNamer, finding_label, short
from gpuwatchd.served.guard import ServedPoll, early_poll_at
from gpuwatchd.served.scan_socket import ScanAnswer, ScanRequest
from gpuwatchd.state.accepted import render_accepted, save_accepted
from gpuwatchd.state.compiled_policy import COMPILED_FILE, save_compiled
from gpuwatchd.state.directory import AlreadyRunning, StateDir, StateDirError, UntrustedFile
from gpuwatchd.state.pause import (
    MAX_ENDED_JOBS,
    pause_in_force,
    poll_pause,
    read_ended_jobs,
    take_clear_latches,
)
from gpuwatchd.state.saved import STATE, StateStore
from gpuwatchd.state.spares import read_spares
from gpuwatchd.state.status_document import action_sentence, build_document

log = structlog.get_logger("gpuwatchd")


T = TypeVar("T")
# What answers a `scan` that asked: (request, the daemon's main file, its state_dir, its last
# poll); it is the command line's (cli/scan.py: answer_served), handed in by cli/run.py.
ScanAnswerer = Callable[[ScanRequest, str, str, ServedPoll | None], ScanAnswer]
RECENT_ACTIONS = 20  # actions remembered for `gpuwatchd status`
NOTIFY_STOP_GRACE = 20.0  # seconds queued on_action hooks get when the daemon stops
NOTIFY_CANCEL_WAIT = 10.0  # seconds a cancelled on_action hook gets to end its process tree
STATUS_REFRESH = 60.0  # seconds between state writes that only refresh status.last_poll
FIXED_SETTINGS = ("state_dir", "devices_dir", "proc_root", "device_major", "mig_minors_file")
_ACTION_EVENTS = frozenset({EventName.ACTION_SIGNAL, EventName.RESET_OUTCOME, EventName.HOOK_RUN})


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
        ended_jobs: frozenset[str] = frozenset(),
        ended_jobs_said: Mapping[str, int | None] | None = None,
        nvml_env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rejected_at_start: Mapping[str, object] | None = None,
        scan_answer: ScanAnswerer | None = None,
        evidence_report: ReportBuilder | None = None,
    ) -> None:
        self.config_path = config_path
        self.dry_run_flag = dry_run
        self._loaded = policy  # as read, without --dry-run: what is saved as accepted
        self._accepted_text: str | None = None
        self.policy = policy = self._effective(policy)  # in force, as the engine has it
        self.once = once
        self.once_timeout = once_timeout
        self.clock = clock
        self.wall_clock = wall_clock
        self.notifier = Notifier()
        self.store = StateStore(policy.state_dir)
        # run --once --ended-job: the scheduler's word, said now (it covers processes older),
        # or when an earlier instance of this run --once heard it (``ended_jobs_said``).
        said = boot_ticks_now()
        self.own_ended_jobs: dict[str, int | None] = {
            job: (said if ended_jobs_said is None else ended_jobs_said.get(job))
            for job in sorted(ended_jobs)
        }
        # What this daemon serves to `scan` (docs/scan.md); no answers as run --once.
        self._serving = ScanServing(
            self._state_dir,
            wall_clock,
            None
            if scan_answer is None or once
            else lambda request, served: scan_answer(
                request, self.config_path, self.policy.state_dir, served
            ),
        )
        self._wire_host(policy, nvml_env)
        self.metrics = Metrics(policy.metrics.textfile)  # the sink counts events into it
        self._stop = False
        self._reload = False
        self._state_dir_error: str | None = None
        self.notify_stop_grace = NOTIFY_STOP_GRACE
        self._handed_jobs: frozenset[str] = frozenset()
        self._handed_over_limit = 0
        self.engine = self._make_engine(policy, evidence_report)
        self.collector.watched = lambda: [
            lad.pid for lad in self.engine.standing().plan.ladders.values()
        ]
        self.hook_queue.on_crash = self.engine.background_crashed  # said by the main loop
        self._init_loop_state(rejected_at_start)

    def _wire_host(self, policy: Policy, nvml_env: Mapping[str, str] | None) -> None:
        """The real host's edges (daemon/host.py); a long holder scan feeds the watchdog."""
        host = self.host = build_real_host(
            policy,
            on_device_event=self._serving.view.mark_dirty,
            nvml_env=nvml_env,
            clock=self.clock,
            wall_clock=self.wall_clock,
            ended_by_scheduler=self.own_ended_jobs,
            kernel_log=not self.once,
        )
        self.procfs, self.nvml, self.collector = host.procfs, host.nvml, host.collector
        self.procfs.holders.progress = WatchdogPinger(lambda: self.notifier.notify("WATCHDOG=1"))
        # The device watch starts in _run_locked, by the lock holder.
        self.device_watch, self.signaller = host.device_watch, host.signaller
        self.hook_queue, self.actuator = host.hook_queue, host.actuator

    def _make_engine(self, policy: Policy, evidence_report: ReportBuilder | None) -> Engine:
        """The poll cycle wired to this daemon's host, sink, checkpoint, watchdog and hooks."""
        return Engine(
            policy,
            reader=self.host.reader,
            actuator=self.actuator,
            clock=SystemClock(self.clock, self.wall_clock),
            sink=self,
            self_ancestors=self._ancestors(),
            checkpoint=self.save_state,
            slow=self._fed,
            background=self.hook_queue,
            hostname=node_name(),
            stopping=lambda: self._stop,
            # The evidence report is the command line's scan --json, handed in by cli/run.py.
            evidence=EvidenceKeeper(
                self._state_dir, evidence_report, hostname=node_name(), version=__version__
            ),
        )

    def _init_loop_state(self, rejected_at_start: Mapping[str, object] | None) -> None:
        self._wakeup_r, self._wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ready_sent = False
        self._saved_key: tuple[object, ...] | None = None
        self._saved_poll_bucket = -1
        self.started_wall = self.wall_clock()
        self.last_poll_wall: float | None = None
        self.last_poll_monotonic: float | None = None
        self.recent_actions: collections.deque[dict[str, object]] = collections.deque(
            maxlen=RECENT_ACTIONS
        )
        self.actions_seen = 0
        self.last_action: float | None = None  # monotonic: the last action or target exit
        # A rejected policy: at start ({at, error, at_start: true, running}: the daemon runs
        # the last accepted one) or at a reload ({at, error}).
        self.policy_rejected: dict[str, object] | None = (
            dict(rejected_at_start) if rejected_at_start is not None else None
        )
        self._files_key: tuple[object, ...] | None = None  # the files as last read
        self.report: PollReport | None = None  # what the last poll saw, decided and did
        self._spares_over: frozenset[str] = frozenset()  # spares past MAX_SPARES, said

    # --- lifecycle ------------------------------------------------------------------------

    def run(self) -> int:
        state_dir = self.policy.state_dir
        try:
            self.store.directory()  # the walk from / and the trust rule
        except PermissionError:
            log.critical(EventName.DAEMON_NO_PERMISSION, path=state_dir)
            return ExitCode.NOPERM
        except (StateDirError, OSError) as exc:
            log.critical(EventName.STATE_DIR_UNUSABLE, path=state_dir, error=_os_error(exc))
            return ExitCode.CONFIG
        held = contextlib.ExitStack()
        try:
            try:
                held.enter_context(self.store.directory().lock())
            except AlreadyRunning as exc:
                if self.once:
                    # run_daemon waits for the running daemon instead (cli/once.py), making a
                    # successor each time the lock's holder stops: this one's pipes go unused.
                    self.actuator.commands.close()
                    os.close(self._wakeup_r)
                    os.close(self._wakeup_w)
                    raise
                log.error(EventName.DAEMON_ALREADY_RUNNING, detail=str(exc), state_dir=state_dir)
                return ExitCode.TEMPFAIL
            except OSError as exc:
                # A lock file that fails the trust rule says EPERM too: that is state_dir's.
                if exc.errno in (errno.EACCES, errno.EPERM) and not isinstance(exc, UntrustedFile):
                    raise  # run_daemon: exit 77
                # The lock file is a link, a directory, untrusted, or the disk refuses it.
                log.critical(EventName.STATE_DIR_UNUSABLE, path=state_dir, error=_os_error(exc))
                return ExitCode.CONFIG
            try:
                return self._run_locked()
            except OSError as exc:
                # Not the state folder's fault, nor a person's to fix (exit 77 and 78 are
                # never restarted): exit 1 with the traceback, and systemd restarts it.
                raise RuntimeError(f"the poll loop failed: {_os_error(exc)}") from exc
        finally:
            # The host first: a scan beside the daemon knows its NVML worker only as a child
            # of the lock's holder (cli/scan.py), so the worker ends while the lock is held.
            self._serving.close()
            self.host.close()
            try:
                held.close()  # the loop has ended: a failed unlock does not change its answer
            except OSError as exc:
                log.critical(EventName.STATE_DIR_UNUSABLE, path=state_dir, error=_os_error(exc))
            self.store.close()

    def _start_device_watch(self) -> None:
        """Watch the device files for opens; without the watch, walk on the plain interval."""
        if self.device_watch.start():
            self.collector.watch = self.device_watch
            return
        log.warning(
            EventName.DAEMON_DEVICE_WATCH_UNAVAILABLE,
            reason=self.device_watch.error,
            consequence=f"all of /proc is walked every {self.policy.full_scan_interval:g}s",
        )

    def _run_locked(self) -> int:
        self._install_signal_handlers()
        self._load_state()
        # Say who runs before the NVML worker opens any device file: a scan or check-clean
        # beside this daemon knows the worker as the daemon's (cli/scan.py) only through the
        # PID in the state file, and a prolog at this moment must not see a dirty GPU.
        self.save_state()
        self._files_key = policy_files_key(self.config_path)  # read just before this start
        if self.policy_rejected is None:
            self._save_accepted(self._loaded)
        log.info(
            EventName.DAEMON_START,
            version=__version__,
            dry_run=self.policy.dry_run,
            once=self.once,
            config=list(self.policy.sources) or [self.config_path],
            interval=self.policy.interval,
        )
        self._start_device_watch()
        self._fed(lambda: self.engine.resume_interrupted_reset(self._read_pause()))
        started = self.clock()
        watched: frozenset[str] | None = None
        code = ExitCode.OK
        while not self._stop:
            if self._reload:
                self._do_reload()
            elif not self.once:
                self._check_files()
            report = self.poll_once()
            if not self._ready_sent:
                self.notifier.notify("READY=1")
                self._ready_sent = True
                self._serving.listen()
            if self.once:
                if watched is None:
                    if not report.snapshot.nvml.available:
                        code = ExitCode.UNAVAILABLE
                        break
                    watched = frozenset(f.key for f in report.assessment.findings)
                if (once := self._once_progress(report, watched, started)) is not None:
                    code = once
                    break
            self._wait()
        self.notifier.notify("STOPPING=1")
        self._finish_notifications()
        self._saved_key = None  # always written: the last poll's last_wall is in no key
        self.save_state()
        log.info(EventName.DAEMON_STOP, exit_code=code)
        return code

    def _once_progress(
        self, report: PollReport, watched: frozenset[str], started: float
    ) -> ExitCode | None:
        """``run --once``'s exit code when it is done (0: nothing under way and every GPU
        clean; 75: what is left will not change, or ``--timeout``), else None (poll again)."""
        waited = self.clock() - started
        verdict = report.verdict
        # Under way: what was seen at the start, and whatever is being done about a GPU that
        # is not clean now (a job another epilog handed over since, say).
        dirty = set() if verdict is None else {g.uuid for g in verdict.gpus if not g.clean}
        keys = watched | {f.key for f in report.assessment.findings if f.gpu in dirty}
        pending, names = pending_keys(report.plan, keys), JournalNamer()  # findings in words
        busy = [f"{finding_label(key, names)}: under way" for key in pending]
        acted = self.last_action
        if acted is not None and acted >= report.snapshot.monotonic:
            busy.append("acted since the GPUs were last read: looking again")
        if verdict is None or verdict.unavailable is not None:
            why = verdict.unavailable if verdict is not None else None
            step, left = OnceStep.WAIT, [*busy, why or "no GPU reading"]
        else:
            # While latched on a saved state it moved aside, as check-clean, it cannot tell.
            step, left = once_progress(verdict, busy, lost_state(report.plan))
        if step is OnceStep.DONE:
            log.info(EventName.RUN_ONCE_DONE, waited=round(waited, 3))
            return ExitCode.OK
        code = ExitCode.TEMPFAIL
        states = set() if verdict is None else {g.state for g in verdict.gpus}
        unknown = Cleanliness.UNKNOWN in states and Cleanliness.DIRTY not in states
        if unknown and missing_capabilities(self.policy.proc_root):
            code = ExitCode.NOPERM  # as check-clean: nothing dirty, but nothing proven clean
        if step is OnceStep.STUCK:
            log.warning(
                EventName.RUN_ONCE_UNRESOLVED, left=left, waited=round(waited, 3), exit_code=code
            )
            return code
        if waited >= self.once_timeout:
            log.warning(EventName.RUN_ONCE_TIMEOUT, pending=pending, left=left, exit_code=code)
            return code
        return None

    def _take_ended_jobs(self) -> None:
        """Jobs an epilog's ``run --once --ended-job`` handed over while this daemon ran."""
        state_dir = self._state_dir()
        if state_dir is None:
            return
        clock = BootTime.read(self.wall_clock(), self.procfs.boot_id())
        found = read_ended_jobs(state_dir, clock, waiting=self.procfs.is_running, remove_stale=True)
        for problem in found.problems:
            log.warning(EventName.SCHEDULER_ENDED_JOB, error=problem, ignored=True)
        for job in sorted(found.jobs.keys() - self._handed_jobs):
            log.info(EventName.SCHEDULER_ENDED_JOB, job=job, said_at_ticks=found.jobs[job])
        if found.over_limit != self._handed_over_limit:
            log.warning(  # said when the number changes; the files are kept
                EventName.SCHEDULER_ENDED_JOBS_OVER_LIMIT,
                waiting=found.over_limit,
                honoured=len(found.jobs),
                limit=MAX_ENDED_JOBS,
            )
            self._handed_over_limit = found.over_limit
        self._handed_jobs = frozenset(found.jobs)
        self.collector.ended_by_scheduler = {**found.jobs, **self.own_ended_jobs}

    def _finish_notifications(self) -> None:
        """Give ``on_action`` hooks and what finished commands left running a bounded time,
        then cancel what still runs and drop hooks never started (each said): nothing a
        command started outlives the daemon."""
        grace = min(
            self.notify_stop_grace, max((h.timeout for h in self.policy.on_action), default=0)
        )
        until = time.monotonic() + grace
        dropped = self.hook_queue.close(grace)
        self.actuator.commands.wait(max(0.0, until - time.monotonic()))
        running = self.hook_queue.busy
        ended = self.actuator.commands.cancel()  # every tree killed, now and from now on
        if running and not self.hook_queue.wait(NOTIFY_CANCEL_WAIT):
            self.engine.hooks_not_run(
                HookOutcome.CANCELLED,
                f"a notification did not end {NOTIFY_CANCEL_WAIT:g}s after it was "
                "cancelled (its processes are stuck?)",
                level=Level.ERROR,
            )
        self.engine.report_background_hooks()
        if ended:
            self.engine.hooks_not_run(
                HookOutcome.CANCELLED,
                f"{ended} finished command(s) had left processes running before their "
                "deadline; they were killed: the daemon stopped",
                hook=None,
            )
        if dropped:
            self.engine.hooks_not_run(
                HookOutcome.DROPPED, f"{dropped} notification(s) not sent: the daemon stopped"
            )

    def _install_signal_handlers(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            if signum == signal.SIGHUP:
                self._reload = True
            else:
                self._stop = True
            with contextlib.suppress(OSError):
                os.write(self._wakeup_w, b"x")

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, on_signal)

    def _effective(self, policy: Policy) -> Policy:
        forced = self.dry_run_flag and not policy.dry_run
        return dataclasses.replace(policy, dry_run=True) if forced else policy

    def _check_files(self) -> None:
        """Validate the policy files again when they changed on disk, applying nothing: files
        that do not validate are said at once (journal, STATUS, ``status``, metrics), files
        that validate again clear it. A policy rejected at start stays said until a reload."""
        key = policy_files_key(self.config_path)
        if key == self._files_key:
            return
        self._files_key = key
        rejected = self.policy_rejected
        if rejected is not None and rejected.get("at_start"):
            return
        try:
            self._fed(lambda: load_policy(self.config_path))
        except ConfigError as exc:
            if rejected is None or rejected.get("error") != str(exc):
                log.error(EventName.CONFIG_FILES_REJECTED, error=str(exc), config=self.config_path)
                self.policy_rejected = {"at": self.wall_clock(), "error": str(exc)}
        else:
            self.policy_rejected = None

    def _do_reload(self) -> None:
        self._reload = False
        ready = self._ready_sent  # else the start's own READY=1, after the first poll, is due
        if ready:
            self.notifier.notify(f"RELOADING=1\nMONOTONIC_USEC={int(time.monotonic() * 1e6)}")
        self._files_key = policy_files_key(self.config_path)  # before reading them
        try:
            new = self._fed(lambda: load_policy(self.config_path))
        except ConfigError as exc:
            log.error(EventName.CONFIG_RELOAD_REJECTED, error=str(exc), config=self.config_path)
            # Said until a good policy loads; one rejected at start stays so.
            self.policy_rejected = {
                **(self.policy_rejected or {}),
                "at": self.wall_clock(),
                "error": str(exc),
            }
        else:
            ended = self.policy_rejected
            self.policy_rejected = None
            kept = {k: getattr(self.policy, k) for k in FIXED_SETTINGS}
            changed = [k for k in FIXED_SETTINGS if getattr(new, k) != kept[k]]
            kernel_log = self.policy.health.kernel_log  # opened at start (collect/kernel_log.py)
            if new.health.kernel_log != kernel_log:
                changed.append("health.kernel_log")
            if new.log_format != self.policy.log_format:  # logging is set up at start
                changed.append("log.format")
            if changed:
                log.warning(EventName.CONFIG_RELOAD_PARTIAL, needs_restart=changed)
            health = dataclasses.replace(new.health, kernel_log=kernel_log)
            new = dataclasses.replace(new, health=health, log_format=self.policy.log_format, **kept)
            self._save_accepted(new)
            before = self.policy
            self.policy = self._effective(new)
            self.engine.reload(self.policy, hostname=node_name())
            self.host.apply(self.policy)
            self.metrics.set_textfile(self.policy.metrics.textfile)
            log.info(
                EventName.CONFIG_RELOADED,
                config=list(self.policy.sources),
                dry_run=self.policy.dry_run,  # in force: `run --dry-run` stays one
                changed=policy_changes(before, self.policy),  # what changed, not the policy
                # The rejection (at start: the fallback ran) this reload ends, if any.
                rejection_ended=None if ended is None else str(ended.get("error") or "?"),
            )
        if ready:
            self.notifier.notify("READY=1")

    def _save_accepted(self, policy: Policy) -> None:
        """Keep ``policy`` as the last accepted one (the fallback at a rejected start), when it
        changed, and for ``scan`` the policy the files say now, compiled. Not as ``run --once``."""
        if self.once:
            return
        state_dir = self._state_dir()
        if state_dir is None:
            return  # said as EventName.STATE_DIR_UNUSABLE
        try:
            save_compiled(state_dir, self.config_path, load_policy, strict=os.geteuid() == 0)
        except OSError as exc:
            log.error(EventName.STATE_SAVE_FAILED, path=COMPILED_FILE, error=_os_error(exc))
        text = render_accepted(policy)
        if text == self._accepted_text:
            return
        try:
            save_accepted(state_dir, policy)
        except OSError as exc:
            log.error(EventName.STATE_SAVE_FAILED, path=policy.state_dir, error=_os_error(exc))
            return
        self._accepted_text = text

    # --- one poll -------------------------------------------------------------------------

    def _state_dir(self) -> StateDir | None:
        """The state directory; None when it cannot be used (said once per distinct error, and
        again after it worked in between) or was replaced: a pause written there goes unseen."""
        try:
            directory = self.store.directory()
            if not os.path.samestat(os.stat(directory.path), os.fstat(directory.fd)):
                raise StateDirError(f"{directory.path}: replaced since the start; restart")
            self._state_dir_error = None  # a later outage is news again
            return directory
        except OSError as exc:
            error = _os_error(exc)
            if error != self._state_dir_error:
                log.critical(EventName.STATE_DIR_UNUSABLE, path=self.policy.state_dir, error=error)
                self._state_dir_error = error
            return None

    def poll_once(self) -> PollReport:
        """The admin switches, one engine cycle, then the metrics, the STATUS line and the
        served view from the poll's report."""
        switches = self._read_switches()
        self._take_ended_jobs()
        # The poll's start is its time in the status section (written by the poll's checkpoint).
        self.last_poll_monotonic = self.clock()
        self.last_poll_wall = self.wall_clock()
        self.report = report = self.engine.poll(
            dataclasses.replace(
                switches, started=self.last_poll_monotonic, started_wall=self.last_poll_wall
            )
        )
        # Gauges only feed the textfile (event counters are kept regardless, by the sink),
        # which only the daemon writes: run --once's last-poll time would hide a dead daemon.
        if self.metrics.textfile is not None and not self.once:
            self.metrics.after_poll(
                report,
                dry_run=self.policy.dry_run,
                policy_rejected=self.policy_rejected is not None,
            )
        self._notify_status(report)
        self._serving.publish(report, self.policy, self.host)
        return report

    def _read_pause(self) -> Pause:
        """The pause switch, read only (the first poll consumes a resume note, a time up)."""
        state_dir = self._state_dir()
        if state_dir is None:
            return Pause("state_dir unusable")  # fail safe: nothing read
        clock = BootTime.read(self.wall_clock(), self.procfs.boot_id())
        return pause_in_force(state_dir, clock, max_pause=self.policy.limits.max_pause)

    def _read_switches(self) -> PollInputs:
        """The admin switch files, as the next poll's inputs (their problems said here)."""
        state_dir = self._state_dir()
        if state_dir is None:
            return PollInputs(pause=Pause("state_dir unusable"))  # fail safe: nothing read
        # Spares and pauses last on the boot clock, not the wall clock (collect/boottime.py).
        clock = BootTime.read(self.wall_clock(), self.procfs.boot_id())
        switch = poll_pause(state_dir, clock, max_pause=self.policy.limits.max_pause)
        spares = read_spares(
            state_dir, clock, max_spare=self.policy.limits.max_spare, remove_stale=True
        )
        # Spares past MAX_SPARES are said once, not each poll.
        for problem in (*spares.problems, *sorted(set(spares.over) - self._spares_over)):
            log.warning(EventName.SPARE_ENDED, why=f"ignored: {problem}")
        self._spares_over = frozenset(spares.over)
        for spare, was in spares.cut:
            log.warning(
                EventName.SPARE_CUT,
                target=spare.target,
                until=spare.until,
                was_until=was,
                max_spare=self.policy.limits.max_spare,
            )
        return PollInputs(
            pause=switch,
            spares=spares.spares,
            spares_read_at=clock.wall,
            clear_latches=take_clear_latches(state_dir),
        )

    def _fed(self, work: Callable[[], T]) -> T:
        """Run slow work (a reset, hooks, reading a policy) with the watchdog fed meanwhile, and
        before READY=1 the unit's start timeout extended."""
        return keep_watchdog_fed(self.notifier, work, starting=not self._ready_sent)

    def _wait(self) -> None:
        """Sleep until the next poll or deadline, waking at once for exits and signals."""
        until = self.clock() if self.report is None else self.report.wake_at
        watch_fd, serving = self.device_watch.fileno(), True
        while not self._stop and not self._reload:
            remaining = until - self.clock()
            if remaining <= 0:
                return
            poller = select.poll()
            server_fd = self._serving.fileno() if serving else None  # a scan asks
            for fd in (self._wakeup_r, *self.signaller.fileno_list(), watch_fd, server_fd):
                if fd is not None:
                    poller.register(fd, select.POLLIN)
            slice_s = min(remaining, max(1.0, watchdog_slice()))
            ready = poller.poll(slice_s * 1000)  # EINTR is retried (PEP 475)
            self.notifier.notify("WATCHDOG=1")
            readable = {fd for fd, _ in ready}
            if self._wakeup_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wakeup_r, 4096)
            if watch_fd is not None and watch_fd in readable:  # a device opened: walk soon
                self.device_watch.mark_if_pending()
                early = early_poll_at(self.last_poll_monotonic, self.clock(), self.policy.interval)
                until, watch_fd = min(until, early), None  # read at the poll, not here
            if server_fd is not None and server_fd in readable:
                serving = self._serving.answer()  # after the watch: an open just seen declines it
            exited = self.signaller.wait(0)
            self.engine.note_exits(exited)
            if exited:
                self.save_state()
                return

    def _notify_status(self, report: PollReport) -> None:
        status = describe_status(report, self.policy.dry_run)
        rejected = self.policy_rejected
        if rejected is not None and rejected.get("at_start"):
            status = f"policy rejected at start, running {rejected.get('running')}; {status}"
        elif rejected is not None:
            status = f"policy rejected, running the previous one ({self.config_path}); {status}"
        self.notifier.notify(f"STATUS={status}\nWATCHDOG=1")

    def emit(self, name: str, level: Level, fields: Mapping[str, object]) -> None:
        """The engine's event sink: every event to the log and the metrics, and the actions
        remembered for ``gpuwatchd status`` (the newest :data:`RECENT_ACTIONS`)."""
        LogSink().emit(name, level, fields)
        self.metrics.observe(name, level, fields)
        if name in _ACTION_EVENTS or name == EventName.TARGET_EXITED:
            self.last_action = self.clock()
        if name in _ACTION_EVENTS:
            pid = fields.get("pid")
            outcome = fields.get("outcome") or fields.get("result")
            if name == EventName.HOOK_RUN:
                outcome = hook_outcome(fields)
            self.actions_seen += 1
            self.recent_actions.append(
                {
                    "at": self.wall_clock(),
                    "event": str(name),
                    "gpu": fields.get("gpu"),
                    "pid": pid if isinstance(pid, int) else None,
                    "signal": fields.get("signal"),
                    "hook": fields.get("hook"),
                    "outcome": outcome,
                    "dry_run": fields.get("dry_run") is True,
                    "sentence": action_sentence(name, fields),
                }
            )

    # --- state ----------------------------------------------------------------------------

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
        """Carry on from the saved state; one that cannot be used is kept aside and the daemon
        starts latched in dry run: what it held (ladders half way, a reset or MIG recovery half
        done, the last hour's signals, a latch) is unknown: no step may be repeated or skipped."""
        data = self.store.load()
        lost = self.store.discarded
        if data:
            boot_id = self.procfs.boot_id()
            rebooted = data.get("boot_id") != boot_id  # one unknown: another boot's, as said
            try:
                STATE.check(data)  # the version this code writes
                raw = data.get("reset_in_progress")
                record = None if raw is None else dict(obj(raw, "reset_in_progress"))
                if record is not None and (rebooted or boot_id is None):
                    # Marked before the next save writes this boot's id (a crash before the
                    # resume must not make it this boot's); both ids unknown prove no same boot.
                    record["rebooted"] = True
                assess = AssessState.from_json(data.get("assess"))
                if rebooted and assess.boot_id is None:
                    # Another boot's Xids (a poll keeps a history of a boot it cannot tell).
                    assess = dataclasses.replace(assess, health=HealthState())
                plan = PlanState.from_json(data.get("plan"))
                if boot_id is None or (rebooted and plan.boot_id is None):  # its monotonic
                    # times too (an unreadable id proves no same boot); the in-flight reset is
                    # the resume's to clear, saying so (Engine.resume_interrupted_reset)
                    flight = plan.reset_in_flight
                    plan = another_boots(plan, rebooted=boot_id is not None)
                    plan = dataclasses.replace(plan, reset_in_flight=flight)
                taken = TakenXids.from_json(data.get("taken_xids", {}))
                self.engine.restore(
                    EngineState(
                        assess=assess,
                        plan=plan,
                        reset_in_progress=record,
                        taken=TakenXids() if rebooted else taken,  # a reboot re-initialises GPUs
                    )
                )
            except ValueError as exc:  # it may echo a saved key or entry: cut as values are
                log.error(EventName.STATE_INVALID, error=short(exc), path=self.policy.state_dir)
                lost = self.store.discard_corrupt(short(exc))
            if rebooted or boot_id is None:
                saved = data.get("boot_id")  # the file's: any value, as large as the file
                shown = None if saved is None else short(saved)
                log.info(EventName.STATE_NEW_BOOT, saved_boot_id=shown, boot_id=boot_id)
        if lost is not None:
            why = f"{UNREADABLE} ({lost}): what it held is unknown"
            latched = PlanState(
                forced_dry_run=True, forced_reason=why, forced_since=self.wall_clock()
            )
            self.engine.restore(EngineState(plan=latched))

    def save_state(self) -> bool:
        """Write the state when it changed; True when what is on disk is the current state,
        False when it could not be written (logged: the engine then takes no irreversible step)."""
        boot_id = self.procfs.boot_id()
        state = self.engine.standing()
        # last_wall moves every poll: the one on disk may be a minute old (STATUS_REFRESH), and
        # the next start misses a backward clock step smaller than its age; a stop writes it.
        verdict = state.verdict
        key = (
            boot_id,
            state.assess,
            dataclasses.replace(state.plan, last_wall=None, last_monotonic=None),
            state.reset_in_progress,
            state.taken_xids,
            self.actions_seen,
            self.policy,  # a reload (the same object is compared by identity: cheap)
            self.policy_rejected,
            state.spares,
            # NVML lost or back is news for `status` at once, not at the next minute's write.
            state.nvml.state,
            # A GPU turning clean or not is news for `status` (its wording alone is not).
            None if verdict is None else tuple((g.uuid, g.state) for g in verdict.gpus),
        )
        # last_poll proves the daemon alive: refreshed once a minute on a quiet node.
        bucket = int(self.last_poll_wall // STATUS_REFRESH) if self.last_poll_wall else 0
        if key == self._saved_key and bucket == self._saved_poll_bucket:
            return True
        status = self.status_section(state)
        data = STATE.envelope(
            {
                "boot_id": boot_id,
                "saved_at": self.wall_clock(),
                "assess": state.assess.to_json(),
                "plan": state.plan.to_json(),
                "reset_in_progress": state.reset_in_progress,
                "taken_xids": state.taken_xids.to_json(),
                "status": status,
            }
        )
        # Everything `status` shows, worked out here: it only renders (status_document.py).
        status["document"] = build_document(
            data, policy=self.policy, wall=self.wall_clock(), monotonic=self.clock()
        )
        try:
            self.store.save(data)
        except (OSError, ValueError) as exc:  # ValueError: a value JSON cannot hold (a NaN)
            log.error(EventName.STATE_SAVE_FAILED, error=_os_error(exc), path=self.policy.state_dir)
            return False
        self._saved_key, self._saved_poll_bucket = key, bucket
        return True

    def status_section(self, standing: Standing | None = None) -> dict[str, object]:
        """What ``gpuwatchd status`` reads besides the plan (docs/operations.md), from where
        the engine stands now unless given."""
        standing = standing or self.engine.standing()
        snapshot, assessment, verdict = standing.snapshot, standing.assessment, standing.verdict
        return {
            "pid": os.getpid(),
            "started": self.started_wall,
            "last_poll": self.last_poll_wall,
            "monotonic": self.last_poll_monotonic,  # the same instant on the plan's clock
            "interval": self.policy.interval,
            "dry_run": self.policy.dry_run,
            "mode": "dry-run" if self.policy.dry_run else "enforcing",
            "nvml": standing.nvml.to_json(),
            "gpus": len(snapshot.nvml.gpus) if snapshot is not None else None,
            "findings": len(assessment.findings) if assessment is not None else None,
            "verdict": None if verdict is None else verdict.to_json(),
            "policy": list(self.policy.sources) or [self.config_path],
            "policy_rejected": self.policy_rejected,
            "recent_actions": list(self.recent_actions),
            "spares": [fields_of(s, ("target", "until", "reason")) for s in standing.spares],
        }


def _os_error(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}"
    return str(exc)
