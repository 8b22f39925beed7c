"""The event catalogue: for every event, its level, its fields and the sentence that says it.

One table of every event (mostly data: template lines), hence its length.
In detail: docs/internals.md, section `gpuwatchd.events.catalogue`.
"""

from __future__ import annotations

import datetime
import re
import shlex
import uuid
from collections.abc import Mapping

from gpuwatchd.core.vocabulary import (
    RESET_STEPS,
    ActionOutcome,
    EventName,
    HookOutcome,
    ResetResult,
    ResetStepStatus,
    SignalOutcome,
)
from gpuwatchd.events.words import (
    CRITICAL,
    DEBUG,
    ERROR,
    INFO,
    WARNING,
    EventSpec,
    JournalNamer,
    Namer,
    Said,
    dry,
    outcome_table,
    short,
    spec,
    spec_table,
)

# --- findings and escalation ---------------------------------------------------------------------


def _finding_new(s: Said) -> str:
    pid = f", {s.process()}" if s.f.get("pid") is not None else ""
    tag = " (report only: no rule acts on it)" if s.f.get("actionable") is False else ""
    return f"New {s('kind')} finding on {s.gpu()}{pid}{s.why('reason')}{tag}."


def _finding_resolved(s: Said) -> str:
    lasted = f" after {s.seconds('lasted')}" if s.has("lasted") else ""
    return f"Finding resolved{lasted}: {s.finding()}."


def _wall(s: Said, key: str) -> str:
    """A wall-clock time field (seconds since the epoch) in UTC, or its raw value."""
    value = s.f.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            moment = datetime.datetime.fromtimestamp(value, datetime.timezone.utc)
        except (OverflowError, OSError, ValueError):
            return s(key)
        return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
    return s(key)


def _step_due(s: Said) -> str:
    signal = s("signal", "no signal (report only)")
    wait = f", then wait {s.seconds('wait')}" if s.has("wait") else ""
    step = f"Step {s('step')} of {s('of')} of rule {s('rule')}"
    return dry(s, f"{step} is due for {s.target()}: {signal}{wait}.")


def _kill_cap_reached(s: Said) -> str:
    scope = s("scope", "node")
    who = "the whole node" if scope == "node" else scope
    if s.dry():
        return (
            f"Dry run: the kill cap would be reached ({s('why')}): enforcement would switch"
            f" {who} to dry-run here."
        )
    return (
        f"Kill cap reached ({s('why')}): dry-run is forced for {who} until"
        " 'gpuwatchd resume --clear-latches' or the latch expires."
    )


def _zombie(s: Said) -> str:
    parent = s.pid("parent") if s.f.get("parent") is not None else "its parent (unknown)"
    return f"{s.target()} is a zombie that still holds GPU memory: {parent} must reap it."


# --- carrying out --------------------------------------------------------------------------------


_SIGNAL = outcome_table(
    SignalOutcome,
    """
    delivered Sent {signal} to {target}{why}.
    dry_run   Dry run: would send {signal} to {target}{why}.
    denied    Sending {signal} to {target} was denied (no permission).
    gone      {signal} not sent: {target} had already exited.
    reused    {signal} not sent: {pid} now belongs to another process.
    zombie    {signal} not sent: {target} is a zombie.
    *         Sending {signal} to {target} failed: {detail}.
    """,
)


def _signal(s: Said) -> str:
    why = f" (rule {s('rule')}, step {s('step')})" if s.has("rule") else ""
    return s.by_outcome(_SIGNAL, s.f.get("outcome"), why=why)


def hook_outcome(fields: Mapping[str, object]) -> str:
    """How one ``EventName.HOOK_RUN`` ended (for its sentence, ``status`` and the metrics): a
    :class:`HookOutcome`, ``error`` (not started), ``timed_out``, ``exit N`` or ``unknown``."""
    outcome = fields.get("outcome")
    if fields.get("dry_run") is True:
        return HookOutcome.DRY_RUN.value
    if isinstance(outcome, str) and outcome in _HOOK_OUTCOMES:
        return outcome
    if fields.get("error"):
        return "error"
    if fields.get("timed_out") is True:
        return "timed_out"
    code = fields.get("returncode")
    return f"exit {code}" if isinstance(code, int) else "unknown"


HOOK_SUCCEEDED = "exit 0"
_HOOK_OUTCOMES = frozenset(member.value for member in HookOutcome)


_HOOK = outcome_table(
    HookOutcome,
    """
    dry_run   Dry run: would run the {hook} hook {argv}{why}.
    dropped   The {hook} hook was not run: {detail}{why}.
    cancelled The {hook} hook was cancelled: {stopped}.
    crashed   An {hook} notification crashed: {error}.
    error     The {hook} hook {argv} failed: {error}.
    timed_out The {hook} hook {argv} timed out{why}.
    *         Ran the {hook} hook {argv}: exit status {returncode}{why}.
    """,
    "error",
    "timed_out",
)


def _hook(s: Said) -> str:
    return s.by_outcome(
        _HOOK,
        hook_outcome(s.f),
        hook=s("hook", "a"),
        argv=s.argv(),
        why=f" ({s('reason')})" if s.has("reason") else "",
        stopped=s("detail", "the daemon stopped"),
    )


# --- lifecycle ------------------------------------------------------------------------------------


def _started(s: Said) -> str:
    mode = " in dry-run" if s.dry() else ""
    once = " for one run (--once)" if s.f.get("once") is True else ""
    return f"gpuwatchd {s('version')} started{mode}{once}."


def _reloaded(s: Said) -> str:
    changed = s.f.get("changed")
    ended = s.f.get("rejection_ended") is not None
    head = "Policy reloaded: the files validate again" if ended else "Policy reloaded"
    if isinstance(changed, Mapping):
        if not changed:
            return f"{head}; nothing else changed." if ended else f"{head}: nothing changed."
        keys = ", ".join(f"{short(key)} ({short(value)})" for key, value in changed.items())
        said = f"{head}; changed: {keys}."
        return said if len(said) <= 400 else said[:396] + "...."  # one sentence of 400 at most
    return f"{head}."


# --- GPU resets (a MIG GPU instance's re-creation too) and the health drain around them -----------


_STEP_STATUS = outcome_table(
    ResetStepStatus,
    """
    ok                done
    clear             no other process holds the GPU
    blocked           blocked by
    skipped           skipped
    failed            FAILED
    would_run         would run
    record_failed     could not be recorded in the state file
    memory_unknown    memory could not be read
    would_wait_fabric would wait for the NVLink fabric
    fabric_waiting    waiting for the NVLink fabric
    fabric_completed  the NVLink fabric is back
    fabric_stuck      the NVLink fabric is STUCK
    as_planned        the GPU read again is as planned
    changed           the GPU read again is NOT as planned
    """,
)


def _reset_step(s: Said) -> str:
    """``Reset of GPU-…, step 5/11 persistence_off: ran nvidia-smi -pm 0 … (exit 0).``"""
    step, status = str(s.f.get("step")), str(s.f.get("status"))
    number = f"{_STEP_NUMBER[step]}/{len(RESET_STEPS)} " if step in _STEP_NUMBER else ""
    head = f"{s.subject()}, step {number}{short(step)}: "
    hooks = s.f.get("hooks")
    ran = s.argv() if s.has("argv") else None
    if ran is None and isinstance(hooks, list) and hooks:
        ran = "; ".join(short(shlex.join(map(str, h))) for h in hooks)
    if ran is not None and status in (ResetStepStatus.OK, ResetStepStatus.FAILED):
        code = f" (exit {s('returncode')})" if s.has("returncode") else ""
        said = f"{head}{'ran' if status == ResetStepStatus.OK else 'FAILED:'} {ran}{code}"
    else:
        said = head + _STEP_STATUS.get(status, short(status))
        if status == ResetStepStatus.CLEAR and s.has("instance"):
            said = head + "no process holds the GPU instance"
        if s.has("blockers"):
            said += f" {s.items('blockers')}"
        elif ran is not None:
            said += f" {ran}"
        elif s.has("would_run"):
            said += f" {s.items('would_run')}"
    if s.has("detail"):
        said += f" ({s('detail')})"
    return dry(s, said + ".")


_STEP_NUMBER = {step.value: number for number, step in enumerate(RESET_STEPS, 1)}


_RESET_OUTCOME = outcome_table(
    ResetResult,
    """
    success {gpu} was reset.
    dry_run Dry run: {gpu} would have been reset{reason:why}.
    refused Reset of {gpu} refused at step {step} and undone{reason:why}.
    in_use  Reset of {gpu} refused by the driver (in use){reason:why}.
    timeout Reset of {gpu} timed out at step {step}.
    *       Reset of {gpu} failed at step {step}{reason:why}.
    """,
)
# ``EventName.RESET_OUTCOME`` of a MIG GPU instance's re-creation (``instance`` is set).
_RECOVERY_OUTCOME = outcome_table(
    ResetResult,
    """
    success {instance} was re-created; its memory is free.
    dry_run Dry run: {instance} would have been re-created{reason:why}.
    refused {what} refused at step {step}, nothing destroyed{reason:why}.
    in_use  {what} refused at step {step}, nothing destroyed{reason:why}.
    *       {what} failed at step {step}{reason:why}.
    """,
)


def _reset_outcome(s: Said) -> str:
    recovery = s.has("instance")
    if not recovery and s.f.get("needs_reboot") is True:
        return f"{s.gpu()} needs a reboot: its reset ended {s('result')} at step {s('step')}."
    return s.by_outcome(
        _RECOVERY_OUTCOME if recovery else _RESET_OUTCOME,
        s.f.get("result"),
        instance=f"MIG GPU instance {s('gi', '?')} of {s.gpu()}",
        what=s.subject(),
    )


def _reset_dry_run(s: Said) -> str:
    if str(s.f.get("assumed", "")).startswith("success"):
        return (
            f"Dry run: {s.subject()} would have run; assumed to have succeeded for what"
            " follows (it counts against reset.max_resets)."
        )
    return f"Dry run: {s.subject()} would have been refused."


def _drain_started(s: Said) -> str:
    said = f"{s.gpu()} is drained for {s('kind')}"
    if s.f.get("drained_already"):
        said += " (its drain hooks ran already for this incident)"
    if s.has("blockers"):
        said += f"; the reset waits for {s.items('blockers')}, which are never signalled"
    return dry(s, said + ".")


CATALOGUE: Mapping[EventName, EventSpec] = {
    **spec_table(
        """
FINDING_CHANGED INFO: FINDING actionable lasted
    The {kind} finding of {target} changed{reason:why}.
ACTION_DEFERRED DEBUG: FINDING why until
    Action on {target} deferred{until:until}{why}.
ESCALATION_CONFIRMING DEBUG: FINDING rule due
    The {kind} finding of {target} matches rule {rule}; confirming{due:until} before anything
    is sent.
ESCALATION_RESOLVED INFO: LADDER why after
    {dry}Escalation of {target} is over{why}.
ESCALATION_ENDED ERROR INFO: LADDER PROCESS why outcome
    {dry}Gave up on {target}{why}; it is never signalled again.
LIMITS_KILL_CAP_EXPIRED WARNING INFO: scope why lasted dry_run
    {dry}The kill-cap latch of {scope} lifted after {lasted:seconds}: its targets may be
    signalled for real again.
RULE_REPORT_ONLY INFO: FINDING rule
    {target} matches rule {rule}, which only reports: nothing is sent.
ACTION_REFUSED INFO WARNING DEBUG: FINDING LADDER why
    No action on {target}{why}.
ESCALATION_ABORTED WARNING: LADDER outcome why
    Escalation of {target} aborted, nothing sent{why}.
ESCALATION_RESTARTED INFO: LADDER why
    The dry-run escalation of {target} starts over for real{why}.
TARGET_STUCK CRITICAL: LADDER PROCESS why
    {target} is stuck in D state and is never signalled{why}.
CLOCK_STEPPED_BACK WARNING: seconds wall
    The wall clock went back {seconds:seconds}: counted as no time passed.
CLOCK_STEPPED_FORWARD WARNING: seconds wall
    The wall clock went {seconds:seconds} ahead of the monotonic clock: counted as no time passed.
ACTION_WITHHELD ERROR: why steps
    Not done, the state cannot be saved: {steps:items}; tried again next poll.
TARGET_EXITED INFO: pid start_ticks
    {process} exited (seen through its pidfd).
DAEMON_RESUMED WARNING: reason
    Actions resumed{reason:why}.
DAEMON_STOP INFO: exit_code
    gpuwatchd stopped (exit code {exit_code}).
DAEMON_ALREADY_RUNNING ERROR: detail state_dir
    Another gpuwatchd already runs here{detail:why}.
DAEMON_NO_PERMISSION CRITICAL: path error missing detail
    Not enough privilege{error|detail:why}.
DAEMON_LIMITED_PERMISSIONS WARNING: missing dry_run
    Running without {missing:items}: other users' processes may be unreadable.
RUN_ONCE_TIMEOUT WARNING: pending left exit_code
    run --once timed out with work left: {left:items}.
RUN_ONCE_DONE INFO: waited
    run --once is done after {waited:seconds}: every GPU is clean.
RUN_ONCE_UNRESOLVED WARNING: left waited exit_code
    run --once gives up, waiting would not change: {left:items}.
SCHEDULER_ENDED_JOBS_OVER_LIMIT WARNING: waiting honoured limit
    Too many ended-job hand-overs: {waiting} wait, only {limit} are honoured at once.
CONFIG_RELOAD_REJECTED ERROR: error config
    Reload rejected, the old policy stays in force{error:why}.
CONFIG_RELOAD_PARTIAL WARNING: needs_restart
    Reloaded, but these keys change only on restart: {needs_restart:items}.
CONFIG_FILES_REJECTED ERROR: error config
    The policy files changed and do not validate{error:why}; the running policy stays in force.
CONFIG_START_REJECTED CRITICAL: error config running dry_run unusable
    The policy is invalid{error:why}; running with the last accepted one ({running}).
STATE_INVALID ERROR: error path
    The saved state {path} was unusable{error:why}; starting clean.
STATE_CORRUPT ERROR: path why moved_to error
    The state file {path} is corrupt and was moved to {moved_to}{why}.
STATE_NEW_BOOT INFO: saved_boot_id boot_id
    The saved state is from another boot: process-keyed state is dropped.
STATE_SAVE_FAILED ERROR: error path
    The state could not be saved to {path}{error:why}; nothing irreversible is done until it can be.
STATE_DIR_UNUSABLE CRITICAL: path error
    The state directory {path} is unusable{error:why}.
METRICS_WRITE_FAILED ERROR: path error
    The metrics file {path} could not be written{error:why}.
COLLECT_KCMP_UNAVAILABLE WARNING: reason
    kcmp cannot prove inherited GPU files{reason:why}; orphans are judged without that proof.
COLLECT_THREAD_TABLES_UNREAD WARNING: pid comm budget
    {process} has more threads with file tables of their own than a scan reads ({budget}
    descriptors): what it holds is unknown, so it blocks resets and is never a target.
COLLECT_INHERITANCE_UNREAD WARNING: pid comm budget
    The inheritance check stopped reading the file descriptors of {process} (a poll reads
    {budget}): whether it holds a context owner's own GPU files is unknown for now.
STATE_BOOT_CHANGED INFO: old new dropped_ladders
    The machine rebooted: {dropped_ladders:=0} escalation(s) of the old boot are dropped.
DAEMON_DEVICE_WATCH_UNAVAILABLE WARNING: reason consequence
    The device-file watch cannot be used{reason:why}; {consequence:=}.
DAEMON_SCAN_SOCKET_UNAVAILABLE WARNING: reason consequence
    The socket on which scan asks this daemon cannot be used{reason:why}; {consequence:=}.
DAEMON_SCAN_REQUEST_FAILED INFO: problem
    A scan that asked this daemon scans by itself: {problem:=unknown}.
NVML_MEMORY_V1_FALLBACK WARNING: gpu index reason consequence
    {gpu} answers only the old memory query{reason:why}; {consequence:=}.
NVML_RECOVERED WARNING: was since gone_for error
    NVML answers again after {gone_for:seconds} {was}.
NVML_UNAVAILABLE WARNING: reason
    NVML is unavailable{reason:why}; retrying.
NVML_WEDGED CRITICAL: timeout pid
    NVML is wedged (a call missed its {timeout}s deadline): no destructive action.
NVML_WORKER_STARTED DEBUG: pid
    NVML worker {pid} started.
NVML_WORKER_HUNG CRITICAL: pid reason
    The NVML worker {pid} survived SIGKILL (stuck in the kernel); no new worker while it
    lives{reason:why}.
NVML_HUNG_WORKER_EXITED INFO: pid
    The hung NVML worker {pid} finally exited.
RESET_CONFIRMING DEBUG: FINDING why
    {gpu} may need a reset; waiting to be sure{why}.
RESET_REFUSED INFO WARNING DEBUG: FINDING why hidden_holder outcome pci_bus_id MIG
    No reset of {gpu} now{why}.
RESET_LIMIT_REACHED WARNING: FINDING why
    No reset of {gpu}: the reset limit is reached{why}.
RESET_CIRCUIT_OPEN CRITICAL: FINDING why
    No more GPU resets until cleared by hand{why}.
RESET_REFUSAL_CLEARED INFO: gpu finding in_use why
    A refused reset of {gpu} may be tried again{why}.
RESET_MIG_UNFINISHED_CLEARED INFO: gpu instance gi why
    MIG GPU instance {gi} of {gpu} is no longer half done{why}.
RESET_IN_FLIGHT_CLEARED WARNING: gpu finding dry_run why
    The reset of {gpu} handed over has no outcome to book{why}; it is no longer in flight.
HEALTH_DRAIN_WAITING INFO: FINDING blockers until
    The reset of {gpu} still waits for {blockers:items} (never signalled).
HEALTH_DRAIN_TIMED_OUT CRITICAL: FINDING why blockers
    Draining {gpu} timed out{why}; on_failure hooks run.
RESET_RESUME WARNING: record
    A reset was interrupted by a stop or crash: finishing or undoing it now.
RESET_RESUME_FAILED ERROR: reason
    An interrupted reset could not be resumed{reason:why}.
RESET_DUE INFO: FINDING dry_run pci_bus_id minor lasted evidence mig_layout MIG
    {dry}{subject} starts ({kind:=a finding}{reason:why}).
RESET_SUCCEEDED INFO: RESET
    {subject} is booked as a success in the reset history.
RESET_FAILED INFO: RESET failures
    {subject} is booked as failed ({outcome}, failure {failures}); on_failure hooks follow.
RESET_FINISHED INFO WARNING ERROR CRITICAL: gpu result step reason needs_reboot blockers dry_run MIG
    {dry}{subject}: the procedure ended at step {step} ({result}).
GPU_NEEDS_REBOOT CRITICAL: RESET pid start_ticks why
    {gpu} needs a reboot{why|reason|outcome:why}.
RESET_CRASHED ERROR: gpu error
    {subject} crashed (a bug), booked as failed: {error}.
KERNEL_LOG_UNAVAILABLE WARNING: source why retry_in
    The kernel log ({source}) cannot be read{why}; Xids come from NVML alone until it can (tried
    again in {retry_in:seconds}).
KERNEL_LOG_DROPPED WARNING: lines kept
    The kernel log had {lines} Xid line(s) that were not counted: more distinct Xids, GPUs and
    processes in one poll than are kept ({kept}).
"""
    ),
    # findings and escalation (decide/plan/decisions.py)
    EventName.FINDING_NEW: spec(WARNING, "FINDING actionable evidence", _finding_new, INFO),
    EventName.FINDING_RESOLVED: spec(INFO, "finding kind gpu pid lasted", _finding_resolved),
    EventName.ESCALATION_STEP_DUE: spec(INFO, "LADDER signal wait of", _step_due),
    EventName.ESCALATION_SIGNAL_RECORDED: spec(
        DEBUG,
        "target signal outcome step stale",
        lambda s: (
            f"The {s('signal')} of step {s('step')} to {s('target')} was booked: {s('outcome')}."
        ),
    ),
    EventName.ZOMBIE_NEEDS_REAP: spec(WARNING, "finding pid gpu parent why", _zombie),
    EventName.LIMITS_KILL_CAP_REACHED: spec(
        CRITICAL,
        "FINDING why scope user until signalled_this_hour dry_run",
        _kill_cap_reached,
        WARNING,
    ),
    # carrying out (engine.py, act/)
    EventName.ACTION_SIGNAL: spec(
        WARNING,
        "pid start_ticks signal gpu rule step dry_run outcome detail reason FINDING PROCESS",
        _signal,
        ERROR,
        INFO,
    ),
    EventName.HOOK_RUN: spec(
        WARNING,
        "hook argv dry_run returncode timed_out output reason error outcome detail leftovers"
        " evidence_file",
        _hook,
        ERROR,
    ),
    # admin switches and lifecycle
    EventName.DAEMON_PAUSED: spec(
        WARNING,
        "reason until",
        lambda s: (
            f"Actions paused by an admin{s.why('reason')}; nothing is done until resume"
            f"{' or ' + _wall(s, 'until') if s.has('until') else ''}."
        ),
    ),
    EventName.SPARE_STARTED: spec(
        WARNING,
        "target pid start_ticks job reason until by_uid",
        lambda s: f"Spared {s('target')} until {_wall(s, 'until')}{s.why('reason')}.",
    ),
    EventName.SPARE_ENDED: spec(
        WARNING,
        "target pid start_ticks job reason until by_uid why",
        lambda s: (
            f"No longer spared: {s('target')}{s.why('why')}."
            if s.has("target")
            else f"A spare file was not honoured{s.why('why')}."
        ),
    ),
    EventName.SPARE_CUT: spec(
        WARNING,
        "target until was_until max_spare",
        lambda s: (
            f"Spare of {s('target')} cut to limits.max_spare: it ends {_wall(s, 'until')},"
            f" not {_wall(s, 'was_until')}."
        ),
    ),
    EventName.LIMITS_LATCHES_CLEARED: spec(
        WARNING,
        "kept",
        lambda s: (
            "An admin cleared the latches: forced dry-run and the reset circuit breaker"
            + (f"; kept, set after the request: {s.items('kept')}." if s.has("kept") else ".")
        ),
    ),
    EventName.DAEMON_START: spec(INFO, "version dry_run once config interval", _started),
    EventName.SCHEDULER_ENDED_JOB: spec(
        INFO,
        "job said_at_ticks error ignored",
        lambda s: (
            f"Hand-over of ended job {s('job')} ignored: {s('error')}."
            if s.has("error")
            else f"Job {s('job')} has ended (said by its epilog): its leftover processes are"
            " treated as abandoned."
        ),
        WARNING,
    ),
    EventName.CONFIG_RELOADED: spec(INFO, "config dry_run changed rejection_ended", _reloaded),
    # GPU resets and health
    EventName.RESET_DRY_RUN: spec(INFO, "RESET assumed", _reset_dry_run),
    EventName.HEALTH_DRAIN_STARTED: spec(
        WARNING, "FINDING blockers timeout dry_run drained_already", _drain_started
    ),
    EventName.RESET_RESUMED: spec(  # said as the resume begins (no result), and as it ends
        WARNING,
        "gpu result step reason needs_reboot reset_started persistence_off",
        lambda s: (
            f"The interrupted reset of {s.gpu()} ended: {s('result')}{s.why('reason')}."
            if s.has("result")
            else f"Resuming the interrupted reset of {s.gpu()} from step {s('step')}."
        ),
    ),
    EventName.RESET_STEP: spec(
        INFO,
        "gpu step status dry_run blockers argv returncode detail output hooks would_run timeout"
        " duration monitors units remaining MIG",
        _reset_step,
        WARNING,
        ERROR,
    ),
    EventName.RESET_OUTCOME: spec(
        WARNING,
        "gpu pci_bus_id result step reason needs_reboot blockers dry_run MIG evidence_file",
        _reset_outcome,
        ERROR,
        CRITICAL,
    ),
    # kept before a reset, a re-creation, a drain or on_failure hooks (act/evidence.py)
    EventName.EVIDENCE_UNSAVED: spec(
        ERROR,
        "action gpu dry_run error",
        lambda s: (
            f"No evidence file was kept before {s('action')}"
            f"{' on ' + s.gpu() if s.has('gpu') else ''}{s.why('error')}; the step goes on,"
            " its reasons are in the journal."
        ),
    ),
    # the kernel log's Xids (collect/kernel_log.py, decide/health/xid_sources.py)
    EventName.HEALTH_XID: spec(
        INFO,
        "gpu xid xid_name xid_action count first last sources repeated before_start pid process"
        " job driver_text",
        lambda s: (
            f"Xid {s('xid')} ({s('xid_name')}) on {s.gpu()}, {s('count')} time(s)"
            + (" since it was last said" if s.f.get("repeated") is True else "")
            + (", logged before the daemon started" if s.f.get("before_start") is True else "")
            + (
                f", triggered by {s.names.process(s.f.get('pid'), s.f.get('process'))}"
                if s.has("pid")
                else ""
            )
            + (f" of job {s('job')}" if s.has("job") else "")
            + f": {s('xid_action')}."
        ),
        WARNING,
    ),
}


def render(name: str, fields: Mapping[str, object], namer: Namer | None = None) -> str:
    """The sentence for event ``name``: one printable line, never raising. An event outside
    the catalogue (a test's, the simulator's) says its name and its ``why`` or ``reason``."""
    said = Said(fields, namer if namer is not None else JournalNamer())
    try:
        spec = CATALOGUE.get(EventName(name)) if name in _NAMES else None
        if spec is not None:
            return spec.say(said)
        return f"{short(name)}{said.why()}."
    except Exception:  # a sentence must never cost the event
        try:
            return f"{short(name)}."
        except Exception:
            return "?"


_NAMES = frozenset(member.value for member in EventName)


def notification(fields: Mapping[str, object]) -> str:
    """The one line of an ``on_action`` notification (``GPUWATCHD_MESSAGE``): what was done,
    to whom, and how it ended."""
    s = Said(fields, JournalNamer())
    outcome = str(fields.get("outcome"))
    owner = f" of user {s('user')}" if s.has("user") else ""
    why = f" ({s('why')})" if s.has("why") else ""
    if fields.get("action") == "reset":
        done = "was reset" if outcome == ActionOutcome.RESET else "could not be reset"
        return f"{s.gpu()}{owner} {done}{why}."
    if fields.get("action") == "mig_recovery":  # one MIG GPU instance re-created
        done = "was re-created" if outcome == ActionOutcome.RESET else "could not be re-created"
        return f"MIG GPU instance {s('gi')} of {s.gpu()}{owner} {done}{why}."
    rule = f" by rule {s('rule')}" if s.has("rule") else ""
    said = _ENDED.get(outcome) or f"ended: {short(outcome)}"
    return f"{s.process()}{owner} on {s.gpu()}, signalled{rule}, {said}{why}."


_ENDED = outcome_table(
    ActionOutcome,
    """
    freed    was stopped; its GPU memory is freed
    released no longer holds the GPU
    survived survived the last signal and is left alone
    stuck    is stuck in D state and cannot be killed
    failed   could not be signalled
    """,
)


# --- what the journal calls an event ------------------------------------------------------------

# Fixed for good: every MESSAGE_ID is derived from it and the event name (docs/events.md).
MESSAGE_ID_NAMESPACE = uuid.UUID("691e00fc-97cc-49ac-bf26-5f292abf0526")
# Event fields with a name of their own in the journal; any other ``foo`` is GPUWATCHD_FOO.
JOURNAL_FIELDS: Mapping[str, str] = {
    "gpu": "GPU_UUID",
    "pid": "TARGET_PID",
    "rule": "RULE",
    "dry_run": "DRY_RUN",
    "outcome": "OUTCOME",
    "signal": "SIGNAL",
    "kind": "FINDING_KIND",
    "finding": "FINDING",
}
FIELD_NAME_MAX = 64  # journald drops longer names
_NOT_IN_FIELD_NAME = re.compile(r"[^A-Z0-9_]")


def message_id(event: str) -> str:
    """The journal MESSAGE_ID of an event: 32 lower-case hex digits, the same forever."""
    return uuid.uuid5(MESSAGE_ID_NAMESPACE, str(event)).hex


def journal_field_name(key: str) -> str:
    """The journal field for event field ``key``: ``gpu`` is GPU_UUID, ``foo`` GPUWATCHD_FOO;
    always ``[A-Z0-9_]``, at most 64 characters, starting with a letter: never one of the
    trusted fields (``_PID``...) that only journald may set."""
    name = JOURNAL_FIELDS.get(key) or "GPUWATCHD_" + _NOT_IN_FIELD_NAME.sub("_", str(key).upper())
    return name[:FIELD_NAME_MAX]
