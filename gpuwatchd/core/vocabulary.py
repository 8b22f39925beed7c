"""The names gpuwatchd says things with, each defined once: events, levels, outcomes, states,
roles, exit codes and state-file versions.

In detail: docs/internals.md, section `gpuwatchd.core.vocabulary`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class _Name(str, enum.Enum):
    """A string-valued name: equal to, printed and serialised as its value."""

    def __str__(self) -> str:
        return str(self.value)


class Level(_Name):
    """Log levels, the only definition: structlog method names, with their journald priority
    (sd-daemon(3)) and their number in Python's logging."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"

    @property
    def priority(self) -> int:
        return _PRIORITY[self.value]

    @property
    def number(self) -> int:
        return _NUMBER[self.value]


_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}
_NUMBER = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
# Every structlog method name (the levels' own and the other ones) and the level it logs at.
METHOD_LEVELS: Mapping[str, Level] = {level.value: level for level in Level} | {
    "msg": Level.INFO,
    "log": Level.INFO,
    "warn": Level.WARNING,
    "err": Level.ERROR,
    "exception": Level.ERROR,
    "fatal": Level.CRITICAL,
}


def level_of(method: str) -> Level | None:
    """The level a structlog method name (``warning``, ``warn``, ``exception``...) logs at."""
    return METHOD_LEVELS.get(method.lower())


class EventName(_Name):
    """Every structured event gpuwatchd logs (documented in docs/events.md)."""

    # findings and escalation (decide/plan/decisions.py)
    FINDING_NEW = "finding.new"
    FINDING_CHANGED = "finding.changed"
    FINDING_RESOLVED = "finding.resolved"
    RULE_REPORT_ONLY = "rule.report_only"
    ACTION_REFUSED = "action.refused"
    ACTION_DEFERRED = "action.deferred"
    ESCALATION_CONFIRMING = "escalation.confirming"
    ESCALATION_STEP_DUE = "escalation.step_due"
    ESCALATION_SIGNAL_RECORDED = "escalation.signal_recorded"
    ESCALATION_RESOLVED = "escalation.resolved"
    ESCALATION_ABORTED = "escalation.aborted"
    ESCALATION_ENDED = "escalation.ended"
    ESCALATION_RESTARTED = "escalation.restarted"
    TARGET_STUCK = "target.stuck"
    ZOMBIE_NEEDS_REAP = "zombie.needs_reap"
    LIMITS_KILL_CAP_REACHED = "limits.kill_cap_reached"
    LIMITS_KILL_CAP_EXPIRED = "limits.kill_cap_expired"
    RESET_CONFIRMING = "reset.confirming"
    RESET_DUE = "reset.due"
    RESET_REFUSED = "reset.refused"
    RESET_LIMIT_REACHED = "reset.limit_reached"
    RESET_CIRCUIT_OPEN = "reset.circuit_open"
    RESET_SUCCEEDED = "reset.succeeded"
    RESET_FAILED = "reset.failed"
    RESET_DRY_RUN = "reset.dry_run"
    RESET_REFUSAL_CLEARED = "reset.refusal_cleared"
    RESET_MIG_UNFINISHED_CLEARED = "reset.mig_unfinished_cleared"
    RESET_IN_FLIGHT_CLEARED = "reset.in_flight_cleared"
    GPU_NEEDS_REBOOT = "gpu.needs_reboot"
    # GPU health (decide/plan/decisions.py over decide/health/judge.py)
    HEALTH_DRAIN_STARTED = "health.drain_started"
    HEALTH_DRAIN_WAITING = "health.drain_waiting"
    HEALTH_DRAIN_TIMED_OUT = "health.drain_timed_out"
    HEALTH_XID = "health.xid"  # decide/health/xid_sources.py
    STATE_BOOT_CHANGED = "state.boot_changed"
    CLOCK_STEPPED_BACK = "clock.stepped_back"
    CLOCK_STEPPED_FORWARD = "clock.stepped_forward"
    # carrying out (engine.py, act/)
    ACTION_SIGNAL = "action.signal"
    ACTION_WITHHELD = "action.withheld"
    TARGET_EXITED = "target.exited"
    HOOK_RUN = "hook.run"
    RESET_STEP = "reset.step"
    RESET_FINISHED = "reset.finished"
    RESET_OUTCOME = "reset.outcome"
    RESET_CRASHED = "reset.crashed"
    RESET_RESUME = "reset.resume"
    RESET_RESUMED = "reset.resumed"
    RESET_RESUME_FAILED = "reset.resume_failed"
    # admin switches and lifecycle (engine.py, daemon.py)
    DAEMON_PAUSED = "daemon.paused"
    DAEMON_RESUMED = "daemon.resumed"
    SPARE_STARTED = "spare.started"
    SPARE_ENDED = "spare.ended"
    SPARE_CUT = "spare.cut"
    LIMITS_LATCHES_CLEARED = "limits.latches_cleared"
    DAEMON_START = "daemon.start"
    DAEMON_STOP = "daemon.stop"
    DAEMON_ALREADY_RUNNING = "daemon.already_running"
    DAEMON_NO_PERMISSION = "daemon.no_permission"
    DAEMON_LIMITED_PERMISSIONS = "daemon.limited_permissions"
    DAEMON_DEVICE_WATCH_UNAVAILABLE = "daemon.device_watch_unavailable"
    DAEMON_SCAN_SOCKET_UNAVAILABLE = "daemon.scan_socket_unavailable"
    DAEMON_SCAN_REQUEST_FAILED = "daemon.scan_request_failed"
    RUN_ONCE_TIMEOUT = "run_once.timeout"
    RUN_ONCE_DONE = "run_once.done"
    RUN_ONCE_UNRESOLVED = "run_once.unresolved"
    SCHEDULER_ENDED_JOB = "scheduler.ended_job"
    SCHEDULER_ENDED_JOBS_OVER_LIMIT = "scheduler.ended_jobs_over_limit"
    CONFIG_RELOADED = "config.reloaded"
    CONFIG_RELOAD_REJECTED = "config.reload_rejected"
    CONFIG_RELOAD_PARTIAL = "config.reload_partial"
    CONFIG_START_REJECTED = "config.start_rejected"
    CONFIG_FILES_REJECTED = "config.files_rejected"
    STATE_INVALID = "state.invalid"
    STATE_CORRUPT = "state.corrupt"
    STATE_NEW_BOOT = "state.new_boot"
    STATE_SAVE_FAILED = "state.save_failed"
    STATE_DIR_UNUSABLE = "state.dir_unusable"
    EVIDENCE_UNSAVED = "evidence.unsaved"  # act/evidence.py
    METRICS_WRITE_FAILED = "metrics.write_failed"
    # inheritance evidence (collect/inherit.py)
    COLLECT_KCMP_UNAVAILABLE = "collect.kcmp_unavailable"
    COLLECT_THREAD_TABLES_UNREAD = "collect.thread_tables_unread"  # collect/holders.py budget
    COLLECT_INHERITANCE_UNREAD = "collect.inheritance_unread"  # inherit.py: a poll's budget
    # the kernel log's Xids (collect/kernel_log.py)
    KERNEL_LOG_UNAVAILABLE = "kernel_log.unavailable"
    KERNEL_LOG_DROPPED = "kernel_log.dropped"
    # NVML (collect/nvml.py)
    NVML_UNAVAILABLE = "nvml.unavailable"
    NVML_WEDGED = "nvml.wedged"
    NVML_WORKER_STARTED = "nvml.worker_started"
    NVML_WORKER_HUNG = "nvml.worker_hung"
    NVML_HUNG_WORKER_EXITED = "nvml.hung_worker_exited"
    NVML_MEMORY_V1_FALLBACK = "nvml.memory_v1_fallback"
    NVML_RECOVERED = "nvml.recovered"


class SignalOutcome(_Name):
    """What happened to one signal (act/signals.py). ``str()`` gives the log value."""

    DELIVERED = "delivered"
    GONE = "gone"  # the process had exited and been reaped
    REUSED = "reused"  # the PID belongs to another process now; nothing was sent
    DENIED = "denied"  # EPERM: no CAP_KILL for this process
    ZOMBIE = "zombie"  # exited, not yet reaped; never signalled
    DRY_RUN = "dry_run"  # every check passed; nothing was sent
    FAILED = "failed"  # anything else (no pidfd support, bad signal name, floor refusal)


SIGNAL_OUTCOME_LEVELS: Mapping[SignalOutcome, Level] = {
    SignalOutcome.DELIVERED: Level.WARNING,
    SignalOutcome.DENIED: Level.ERROR,
    SignalOutcome.FAILED: Level.ERROR,
    SignalOutcome.GONE: Level.INFO,
    SignalOutcome.REUSED: Level.INFO,
    SignalOutcome.ZOMBIE: Level.INFO,
    SignalOutcome.DRY_RUN: Level.WARNING,  # a would-be action: reviewed with -p warning
}


class ResetResult(_Name):
    """How one run of the reset procedure ended (act/reset.py, booked by plan.record_reset)."""

    SUCCESS = "success"
    FAILED = "failed"
    REFUSED = "refused"  # stopped before the reset command ran, and undone
    IN_USE = "in_use"  # the driver refused: in use by a client no scan found (a hidden holder)
    TIMEOUT = "timeout"  # the reset command missed its deadline and was killed
    DRY_RUN = "dry_run"


RESET_RESULT_LEVELS: Mapping[ResetResult, Level] = {
    ResetResult.SUCCESS: Level.WARNING,
    ResetResult.DRY_RUN: Level.WARNING,  # a would-be reset: reviewed with -p warning
    ResetResult.REFUSED: Level.WARNING,
    ResetResult.IN_USE: Level.WARNING,
    ResetResult.FAILED: Level.ERROR,
    ResetResult.TIMEOUT: Level.ERROR,
}


class ResetStep(_Name):
    """The steps of the reset procedure, in order (act/reset.py; docs/reset.md)."""

    DRAIN = "drain"
    STOP_NVML = "stop_nvml"
    BEFORE_HOOKS = "before_hooks"
    STOP_MONITORS = "stop_monitors"  # reset.monitors that hold the GPU (decide/plan/monitors.py)
    PERSISTENCE_OFF = "persistence_off"
    FINAL_SCAN = "final_scan"
    RESET = "reset"
    HEALTH_CHECK = "health_check"
    PERSISTENCE_ON = "persistence_on"
    START_MONITORS = "start_monitors"  # the units stop_monitors stopped
    AFTER_HOOKS = "after_hooks"
    DONE = "done"  # where a finished procedure stands; never a ``reset.step`` of its own


RESET_STEPS: tuple[ResetStep, ...] = tuple(step for step in ResetStep if step is not ResetStep.DONE)


class ResetStepStatus(_Name):
    """How one step of the reset procedure went (``reset.step``'s ``status``)."""

    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"
    CLEAR = "clear"  # final scan: nothing else holds the GPU
    BLOCKED = "blocked"  # final scan: something holds it
    WOULD_RUN = "would_run"  # dry run
    RECORD_FAILED = "record_failed"  # the step could not be recorded in the state file
    MEMORY_UNKNOWN = "memory_unknown"  # health check: memory could not be read
    WOULD_WAIT_FABRIC = "would_wait_fabric"
    FABRIC_WAITING = "fabric_waiting"
    FABRIC_COMPLETED = "fabric_completed"
    FABRIC_STUCK = "fabric_stuck"
    AS_PLANNED = "as_planned"  # a MIG recovery's GPU read again: as its next command needs it
    CHANGED = "changed"  # ... not: the instance changed, or its placement is not free


class LadderStatus(_Name):
    """Where one target's escalation ladder stands (decide/plan/state.py)."""

    ACTIVE = "active"  # steps are being emitted and waited on
    ENDED = "ended"  # the target survived the last step
    STUCK = "stuck"  # the target is in D state: never signalled again
    FAILED = "failed"  # a signal was denied/failed, or the target became refused


def check_ladder_transition(old: str, new: str) -> LadderStatus:
    """``new`` as a :class:`LadderStatus` if a ladder in ``old`` may move there; else
    ValueError (a bug). Only an active ladder moves: terminal ladders stay while their process
    lives, so that identity is never signalled again; they leave only by being dropped (the
    process exited, dry-run ended, a new boot)."""
    source, target = LadderStatus(old), LadderStatus(new)
    if source is not LadderStatus.ACTIVE:
        raise ValueError(f"ladder cannot go from {source} to {target}")
    return target


class HookName(_Name):
    """The lists of admin hooks the engine runs (``reset.drain``/``before``/``after`` are run
    by the reset procedure itself). Also ``GPUWATCHD_EVENT`` in a hook's environment."""

    ON_FAILURE = "on_failure"  # an action failed or cannot work: drain, page someone
    ON_ACTION = "on_action"  # a real kill ladder or reset ended: tell the owner, post a webhook
    RESET_DRAIN = "reset_drain"  # GPU health: reset.drain, once, before waiting for the GPU


class HookOutcome(_Name):
    """``hook.run``'s ``outcome`` where a hook did not simply run to its exit status
    (:func:`gpuwatchd.events.catalogue.hook_outcome` says how any ``hook.run`` ended)."""

    DRY_RUN = "dry_run"  # a would-be hook: never started
    DROPPED = "dropped"  # a notification not run: the queue was full, or the daemon stopped
    CANCELLED = "cancelled"  # still running when the daemon stopped: its process tree killed
    CRASHED = "crashed"  # the notification itself raised (a bug): not run to the end


class ActionOutcome(_Name):
    """How an action that ``on_action`` reports ended (``GPUWATCHD_OUTCOME``, ``outcome``)."""

    FREED = "freed"  # the signalled target exited
    RELEASED = "released"  # the target lives but no longer holds what the finding was about
    SURVIVED = "survived"  # alive after the ladder's last step
    STUCK = "stuck"  # in D state: cannot be killed
    FAILED = "failed"  # a signal was denied or failed
    RESET = "reset"  # the GPU was reset
    RESET_FAILED = "reset_failed"  # the reset command failed or timed out


class HolderRoleName(_Name):
    """How ``scan`` explains one holder of one GPU (decide/assess/passes.py ``HolderRole.role``)."""

    CONTEXT_OWNER = "context_owner"  # NVML lists it with a context there
    WORKER = "worker"  # of a live context owner (its tree, session or job)
    MANAGEMENT = "management"  # an NVML-only client or infrastructure
    ORPHANED = "orphaned"  # the inheritor of a dead owner's memory
    HIDDEN = "hidden"  # holds the GPU, owns no context, nothing explains it
    STUCK = "stuck"  # in D state
    UNKNOWN = "unknown"  # listed by NVML, but whether it holds the GPU cannot be told


class Cleanliness(_Name):
    """The verdict on one GPU: may it be handed to a new job? (decide/verdict.py)"""

    CLEAN = "clean"  # nothing left behind; what would block a reset is said apart
    DIRTY = "dirty"  # something is left behind, or the driver asks for a reset, reboot or drain
    UNKNOWN = "unknown"  # cannot be told (a holder unreadable or unexplained): not clean either


class LeftoverName(_Name):
    """Why a GPU is not clean, where no finding kind says it (decide/verdict.py)."""

    LOST = "lost"  # NVML reports the GPU lost
    LEFTOVER_MEMORY = "leftover_memory"  # allocated above the idle baseline, no live owner's
    UNKNOWN_HOLDER = "unknown_holder"  # a holder whose role could not be told
    UNREADABLE = "unreadable"  # a process whose fds or maps could not be read
    PROCESSES_UNKNOWN = "processes_unknown"  # NVML could not list the GPU's processes
    MIG_UNFINISHED = "mig_unfinished"  # a MIG GPU instance's re-creation stopped halfway


class ExitCode(enum.IntEnum):
    """Process exit codes (sysexits.h), for every command."""

    OK = 0
    DATAERR = 65  # a malformed scenario or snapshot
    UNAVAILABLE = 69  # NVML/driver unavailable or wedged (scan, run --once)
    IOERR = 74  # pause/resume: the switch could not be written (a full disk)
    TEMPFAIL = 75  # another instance holds the lock; run --once timed out
    NOPERM = 77  # insufficient privilege
    CONFIG = 78  # configuration error


# Format versions of the state file and its sections; a mismatch is refused, not guessed.
STATE_FILE_VERSION = 1  # the file's envelope (daemon.py)
ASSESS_STATE_VERSION = 2  # its "assess" section (decide/assess/state.py); 2 adds inheritance
ASSESS_STATE_VERSIONS_READ = (1, 2)  # version 1 is read as having no inheritance evidence
PLAN_STATE_VERSION = 1  # its "plan" section (decide/plan/state.py)


class TimelineEvent(_Name):
    """The simulator's own timeline entries (docs/simulate.md), beside the daemon's EventName:
    what the scenario made happen (``world.*``) and the simulator's own warning (``sim.*``)."""

    START = "world.start"
    EXIT = "world.exit"
    STATE = "world.state"
    REAP = "world.reap"
    MEMORY = "world.memory"
    LEAK = "world.leak"
    RESET_RESULT = "world.reset_result"
    XID = "world.xid"
    HEALTH = "world.health"
    BUSY_LOOP = "sim.busy_loop"
