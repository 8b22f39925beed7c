"""The event catalogue: for every event, its level, its fields and the sentence that says it.

Names are :class:`gpuwatchd.vocabulary.EventName`; this module owns what is said about each:
:data:`CATALOGUE` gives the usual level (and the others an outcome may give it), the fields it
carries and a sentence an administrator understands without the docs. :func:`render` is the one
renderer: the journal's ``MESSAGE`` (``logs.py``), ``simulate``'s timeline (``sim/timeline.py``),
``status`` and the ``on_action`` notification all word events through it. They differ only in
their :class:`Namer` (the journal says ``PID 4242 (python)`` and the GPU's UUID, the timeline
``pid 4242 (trainer)`` and ``GPU 0``). The events of one reset share one subject ("Reset of
GPU …") and number their steps, so the journal of a reset reads as one story. It also owns what
the journal calls an event: its MESSAGE_ID (:func:`message_id`) and the journal names of its
fields (:func:`journal_field_name`), which ``packaging/journal_catalog.py`` turns into the
``journalctl -x`` catalogue.

Pure: no I/O; never raises from :func:`render`. Imports only the vocabulary and the escape rule.
Long (over 600 lines) because it is a table of about 80 events, each with its level, fields and
sentence; split, an event's sentence would live apart from its level and fields.
"""

from __future__ import annotations

import datetime
import re
import shlex
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gpuwatchd.escape import escape
from gpuwatchd.vocabulary import (
    RESET_STEPS,
    ActionOutcome,
    EventName,
    HookOutcome,
    Level,
    ResetResult,
    ResetStep,
    ResetStepStatus,
    SignalOutcome,
)

__all__ = [
    "CATALOGUE",
    "HOOK_SUCCEEDED",
    "JOURNAL_FIELDS",
    "MESSAGE_ID_NAMESPACE",
    "EventSpec",
    "JournalNamer",
    "Namer",
    "finding_label",
    "hook_outcome",
    "journal_field_name",
    "message_id",
    "notification",
    "render",
]

VALUE_MAX = 160  # characters of one value inside a sentence


class Namer(Protocol):
    """How one output names processes and GPUs; the only difference between the outputs."""

    def process(self, pid: object, comm: object = None) -> str: ...

    def gpu(self, uuid: object) -> str: ...

    def moment(self, monotonic: object) -> str | None:
        """A monotonic deadline as its reader can place it, or None to leave it unsaid."""
        ...


class JournalNamer:
    """The journal's names: ``PID 4242 (python)``, and the GPU by its UUID. A monotonic
    deadline means nothing to a reader of the journal: it is left to the event's fields."""

    def process(self, pid: object, comm: object = None) -> str:
        name = f" ({_short(comm)})" if comm not in (None, "") else ""
        return f"PID {_short(pid) if pid not in (None, '') else '?'}{name}"

    def gpu(self, uuid: object) -> str:
        return _short(uuid) if uuid not in (None, "") else "the GPU"

    def moment(self, monotonic: object) -> str | None:
        del monotonic
        return None


def _short(value: object) -> str:
    """``value`` escaped for one line and cut at :data:`VALUE_MAX` characters."""
    if isinstance(value, (list, tuple)):
        value = " ".join(str(item) for item in value)
    text = escape(str(value))
    return text if len(text) <= VALUE_MAX else text[: VALUE_MAX - 3] + "..."


class _Said:
    """An event's fields as sentence pieces, named by one :class:`Namer`."""

    def __init__(self, fields: Mapping[str, object], namer: Namer) -> None:
        self.f = fields
        self.names = namer

    def __call__(self, key: str, default: str = "?") -> str:
        value = self.f.get(key)
        if value is None or value == "":
            return default
        return _short(value)

    def has(self, key: str) -> bool:
        return self.f.get(key) not in (None, "", [], ())

    def dry(self) -> bool:
        return self.f.get("dry_run") is True

    def gpu(self, key: str = "gpu") -> str:
        return self.names.gpu(self.f.get(key))

    def pid(self, key: str = "pid") -> str:
        return self.names.process(self.f.get(key))

    def process(self) -> str:
        """``PID 1234 (python)`` with what is known."""
        return self.names.process(self.f.get("pid"), self.f.get("comm"))

    def target(self) -> str:
        """The process and its GPU, or the GPU alone for a GPU-level event."""
        if self.f.get("pid") is None:
            return self.gpu()
        on = f" on {self.gpu()}" if self.has("gpu") else ""
        return f"{self.process()}{on}"

    def why(self, *keys: str) -> str:
        """``: <first of keys that is set>`` or nothing."""
        for key in keys or ("why", "reason"):
            if self.has(key):
                return f": {self(key)}"
        return ""

    def until(self, key: str) -> str:
        """`` until <when>`` where the namer can place the deadline ``key``, else nothing."""
        when = self.names.moment(self.f.get(key))
        return f" until {when}" if when else ""

    def seconds(self, key: str) -> str:
        value = self.f.get(key)
        return f"{value:g}s" if isinstance(value, (int, float)) else "?"

    def argv(self, key: str = "argv") -> str:
        value = self.f.get(key)
        if isinstance(value, (list, tuple)):
            return _short(shlex.join(str(a) for a in value))
        return self(key)

    def items(self, key: str) -> str:
        value = self.f.get(key)
        if isinstance(value, (list, tuple)):
            return _short("; ".join(str(v) for v in value))
        return self(key)

    def finding(self, key: str = "finding") -> str:
        return finding_label(self.f.get(key), self.names)


def _dry(s: _Said, text: str) -> str:
    return f"Dry run: {text}" if s.dry() else text


# --- findings and escalation ---------------------------------------------------------------------


def _finding_new(s: _Said) -> str:
    pid = f", {s.process()}" if s.f.get("pid") is not None else ""
    tag = " (report only: no rule acts on it)" if s.f.get("actionable") is False else ""
    return f"New {s('kind')} finding on {s.gpu()}{pid}{s.why('reason')}{tag}."


def _finding_changed(s: _Said) -> str:
    return f"The {s('kind')} finding of {s.target()} changed{s.why('reason')}."


def _finding_resolved(s: _Said) -> str:
    lasted = f" after {s.seconds('lasted')}" if s.has("lasted") else ""
    return f"Finding resolved{lasted}: {s.finding()}."


def _wall(s: _Said, key: str) -> str:
    """A wall-clock time field (seconds since the epoch) in UTC, or its raw value."""
    value = s.f.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            moment = datetime.datetime.fromtimestamp(value, datetime.timezone.utc)
        except (OverflowError, OSError, ValueError):
            return s(key)
        return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
    return s(key)


def _step_due(s: _Said) -> str:
    signal = s("signal", "no signal (report only)")
    wait = f", then wait {s.seconds('wait')}" if s.has("wait") else ""
    step = f"Step {s('step')} of {s('of')} of rule {s('rule')}"
    return _dry(s, f"{step} is due for {s.target()}: {signal}{wait}.")


def _kill_cap_reached(s: _Said) -> str:
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


def _zombie(s: _Said) -> str:
    parent = s.pid("parent") if s.f.get("parent") is not None else "its parent (unknown)"
    return f"{s.target()} is a zombie that still holds GPU memory: {parent} must reap it."


# --- carrying out --------------------------------------------------------------------------------


def _signal(s: _Said) -> str:
    sig, who, outcome = s("signal"), s.target(), s.f.get("outcome")
    why = f" (rule {s('rule')}, step {s('step')})" if s.has("rule") else ""
    if outcome == SignalOutcome.DELIVERED:
        return f"Sent {sig} to {who}{why}."
    if outcome == SignalOutcome.DRY_RUN:
        return f"Dry run: would send {sig} to {who}{why}."
    if outcome == SignalOutcome.DENIED:
        return f"Sending {sig} to {who} was denied (no permission)."
    if outcome == SignalOutcome.GONE:
        return f"{sig} not sent: {who} had already exited."
    if outcome == SignalOutcome.REUSED:
        return f"{sig} not sent: {s.pid()} now belongs to another process."
    if outcome == SignalOutcome.ZOMBIE:
        return f"{sig} not sent: {who} is a zombie."
    return f"Sending {sig} to {who} failed: {s('detail')}."


def hook_outcome(fields: Mapping[str, object]) -> str:
    """How one ``hook.run`` ended, worked out once (the sentence, ``status``'s recent actions
    and the metrics' result label all take it from here): ``dry_run``, ``dropped``,
    ``cancelled``, ``crashed`` (:class:`HookOutcome`), ``error`` (it could not be started),
    ``timed_out``, ``exit N`` (``exit 0``: it succeeded), or ``unknown``."""
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


def _hook(s: _Said) -> str:
    hook, argv, outcome = s("hook", "a"), s.argv(), hook_outcome(s.f)
    why = f" ({s('reason')})" if s.has("reason") else ""
    if outcome == HookOutcome.DRY_RUN:
        return f"Dry run: would run the {hook} hook {argv}{why}."
    if outcome == HookOutcome.DROPPED:
        return f"The {hook} hook was not run: {s('detail')}{why}."
    if outcome == HookOutcome.CANCELLED:
        return f"The {hook} hook was cancelled: {s('detail', 'the daemon stopped')}."
    if outcome == HookOutcome.CRASHED:
        return f"An {hook} notification crashed: {s('error')}."
    if outcome == "error":
        return f"The {hook} hook {argv} failed: {s('error')}."
    if outcome == "timed_out":
        return f"The {hook} hook {argv} timed out{why}."
    return f"Ran the {hook} hook {argv}: exit status {s('returncode')}{why}."


# --- the reset: one story ------------------------------------------------------------------------


def _reset_of(s: _Said) -> str:
    """The subject of one reset's events: the GPU's reset, or the re-creation of one of its
    MIG GPU instances (``instance``, ``gi``: reset.mig_recovery)."""
    if s.has("instance"):
        return f"Re-creation of MIG GPU instance {s('gi', '?')} of {s.gpu()}"
    return f"Reset of {s.gpu()}"


_STEP_STATUS: Mapping[str, str] = {
    ResetStepStatus.OK.value: "done",
    ResetStepStatus.CLEAR.value: "no other process holds the GPU",
    ResetStepStatus.BLOCKED.value: "blocked by",
    ResetStepStatus.SKIPPED.value: "skipped",
    ResetStepStatus.FAILED.value: "FAILED",
    ResetStepStatus.WOULD_RUN.value: "would run",
    ResetStepStatus.RECORD_FAILED.value: "could not be recorded in the state file",
    ResetStepStatus.MEMORY_UNKNOWN.value: "memory could not be read",
    ResetStepStatus.WOULD_WAIT_FABRIC.value: "would wait for the NVLink fabric",
    ResetStepStatus.FABRIC_WAITING.value: "waiting for the NVLink fabric",
    ResetStepStatus.FABRIC_COMPLETED.value: "the NVLink fabric is back",
    ResetStepStatus.FABRIC_STUCK.value: "the NVLink fabric is STUCK",
}


def _reset_step(s: _Said) -> str:
    """``Reset of GPU-…, step 4/9 persistence_off: ran nvidia-smi -pm 0 … (exit 0).``"""
    step, status = str(s.f.get("step")), str(s.f.get("status"))
    number = f"{RESET_STEPS.index(ResetStep(step)) + 1}/{len(RESET_STEPS)} " if _known(step) else ""
    head = f"{_reset_of(s)}, step {number}{_short(step)}: "
    hooks = s.f.get("hooks")
    ran = s.argv() if s.has("argv") else None
    if ran is None and isinstance(hooks, list) and hooks:
        ran = "; ".join(_short(shlex.join(map(str, h))) for h in hooks)
    if ran is not None and status in (ResetStepStatus.OK, ResetStepStatus.FAILED):
        code = f" (exit {s('returncode')})" if s.has("returncode") else ""
        said = f"{head}{'ran' if status == ResetStepStatus.OK else 'FAILED:'} {ran}{code}"
    else:
        said = head + _STEP_STATUS.get(status, _short(status))
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
    return _dry(s, said + ".")


def _known(step: str) -> bool:
    return step in {member.value for member in RESET_STEPS}


def _reset_finished(s: _Said) -> str:
    """Short: the ``reset.outcome`` line that follows gives the reason."""
    return _dry(s, f"{_reset_of(s)}: the procedure ended at step {s('step')} ({s('result')}).")


def _reset_outcome(s: _Said) -> str:
    gpu, result, step = s.gpu(), s.f.get("result"), s("step")
    if s.has("instance"):
        return _recovery_outcome(s)
    if s.f.get("needs_reboot") is True:
        return f"{gpu} needs a reboot: its reset ended {s('result')} at step {step}."
    if result == ResetResult.SUCCESS:
        return f"{gpu} was reset."
    if result == ResetResult.DRY_RUN:
        return f"Dry run: {gpu} would have been reset{s.why('reason')}."
    if result == ResetResult.REFUSED:
        return f"Reset of {gpu} refused at step {step} and undone{s.why('reason')}."
    if result == ResetResult.IN_USE:
        return f"Reset of {gpu} refused by the driver (in use){s.why('reason')}."
    if result == ResetResult.TIMEOUT:
        return f"Reset of {gpu} timed out at step {step}."
    return f"Reset of {gpu} failed at step {step}{s.why('reason')}."


def _recovery_outcome(s: _Said) -> str:
    """``reset.outcome`` of a MIG GPU instance's re-creation."""
    what, result, step = _reset_of(s), s.f.get("result"), s("step")
    instance = f"MIG GPU instance {s('gi', '?')} of {s.gpu()}"
    if result == ResetResult.SUCCESS:
        return f"{instance} was re-created; its memory is free."
    if result == ResetResult.DRY_RUN:
        return f"Dry run: {instance} would have been re-created{s.why('reason')}."
    if result in (ResetResult.REFUSED, ResetResult.IN_USE):
        return f"{what} refused at step {step}, nothing destroyed{s.why('reason')}."
    return f"{what} failed at step {step}{s.why('reason')}."


def _reset_dry_run(s: _Said) -> str:
    if str(s.f.get("assumed", "")).startswith("success"):
        return (
            f"Dry run: {_reset_of(s)} would have run; assumed to have succeeded for what"
            " follows (it counts against reset.max_resets)."
        )
    return f"Dry run: {_reset_of(s)} would have been refused."


def _drain_started(s: _Said) -> str:
    said = f"{s.gpu()} is drained for {s('kind')}"
    if s.f.get("drained_already"):
        said += " (its drain hooks ran already for this incident)"
    if s.has("blockers"):
        said += f"; the reset waits for {s.items('blockers')}, which are never signalled"
    return _dry(s, said + ".")


def _needs_reboot(s: _Said) -> str:
    return f"{s.gpu()} needs a reboot{s.why('why', 'reason', 'outcome')}."


# --- lifecycle ------------------------------------------------------------------------------------


def _started(s: _Said) -> str:
    mode = " in dry-run" if s.dry() else ""
    once = " for one run (--once)" if s.f.get("once") is True else ""
    return f"gpuwatchd {s('version')} started{mode}{once}."


def _reloaded(s: _Said) -> str:
    changed = s.f.get("changed")
    if isinstance(changed, Mapping):
        if not changed:
            return "Policy reloaded: nothing changed."
        keys = ", ".join(f"{_short(key)} ({_short(value)})" for key, value in changed.items())
        return _short_sentence(f"Policy reloaded; changed: {keys}.")
    return "Policy reloaded."


def _short_sentence(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 4] + "...."


@dataclass(frozen=True)
class EventSpec:
    """One event: its usual level, the other levels an outcome may give it, its fields, and
    its sentence (a function of the fields, named through a :class:`Namer`)."""

    level: Level
    fields: tuple[str, ...]
    say: Callable[[_Said], str]
    also: frozenset[Level] = frozenset()

    @property
    def levels(self) -> frozenset[Level]:
        return self.also | {self.level}


def _e(level: Level, fields: str, say: Callable[[_Said], str], *also: Level) -> EventSpec:
    return EventSpec(level, tuple(fields.split()), say, frozenset(also))


DEBUG, INFO, WARNING, ERROR, CRITICAL = (
    Level.DEBUG,
    Level.INFO,
    Level.WARNING,
    Level.ERROR,
    Level.CRITICAL,
)
_FINDING = "finding kind gpu pid start_ticks memory reason"
_LADDER = "target pid start_ticks finding rule gpu step dry_run"
_PROCESS = "user uid comm cmdline state ppid pgid sid cgroup job unit"
_MIG = "instance gi recovery"  # a MIG GPU instance's re-creation (reset.mig_recovery)
_RESET = f"gpu pci_bus_id finding outcome kind memory reason {_MIG}"

CATALOGUE: Mapping[EventName, EventSpec] = {
    # findings and escalation (decide/plan.py)
    EventName.FINDING_NEW: _e(WARNING, f"{_FINDING} actionable evidence", _finding_new, INFO),
    EventName.FINDING_CHANGED: _e(INFO, f"{_FINDING} actionable lasted", _finding_changed),
    EventName.FINDING_RESOLVED: _e(INFO, "finding kind gpu pid lasted", _finding_resolved),
    EventName.RULE_REPORT_ONLY: _e(
        INFO,
        f"{_FINDING} rule",
        lambda s: f"{s.target()} matches rule {s('rule')}, which only reports: nothing is sent.",
    ),
    EventName.ACTION_REFUSED: _e(
        INFO,
        f"{_FINDING} {_LADDER} why",
        lambda s: f"No action on {s.target()}{s.why()}.",
        WARNING,
        DEBUG,
    ),
    EventName.ACTION_DEFERRED: _e(
        DEBUG,
        f"{_FINDING} why until",
        lambda s: f"Action on {s.target()} deferred{s.until('until')}{s.why()}.",
    ),
    EventName.ESCALATION_CONFIRMING: _e(
        DEBUG,
        f"{_FINDING} rule due",
        lambda s: (
            f"The {s('kind')} finding of {s.target()} matches rule {s('rule')}; confirming"
            f"{s.until('due')} before anything is sent."
        ),
    ),
    EventName.ESCALATION_STEP_DUE: _e(INFO, f"{_LADDER} signal wait of", _step_due),
    EventName.ESCALATION_SIGNAL_RECORDED: _e(
        DEBUG,
        "target signal outcome step stale",
        lambda s: (
            f"The {s('signal')} of step {s('step')} to {s('target')} was booked: {s('outcome')}."
        ),
    ),
    EventName.ESCALATION_RESOLVED: _e(
        INFO,
        f"{_LADDER} why after",
        lambda s: _dry(s, f"Escalation of {s.target()} is over{s.why()}."),
    ),
    EventName.ESCALATION_ABORTED: _e(
        WARNING,
        f"{_LADDER} outcome why",
        lambda s: f"Escalation of {s.target()} aborted, nothing sent{s.why()}.",
    ),
    EventName.ESCALATION_ENDED: _e(
        ERROR,
        f"{_LADDER} {_PROCESS} why outcome",
        lambda s: _dry(s, f"Gave up on {s.target()}{s.why()}; it is never signalled again."),
        INFO,
    ),
    EventName.ESCALATION_RESTARTED: _e(
        INFO,
        f"{_LADDER} why",
        lambda s: f"The dry-run escalation of {s.target()} starts over for real{s.why()}.",
    ),
    EventName.TARGET_STUCK: _e(
        CRITICAL,
        f"{_LADDER} {_PROCESS} why",
        lambda s: f"{s.target()} is stuck in D state and is never signalled{s.why()}.",
    ),
    EventName.ZOMBIE_NEEDS_REAP: _e(WARNING, "finding pid gpu parent why", _zombie),
    EventName.LIMITS_KILL_CAP_REACHED: _e(
        CRITICAL,
        f"{_FINDING} why scope user until signalled_this_hour dry_run",
        _kill_cap_reached,
        WARNING,
    ),
    EventName.LIMITS_KILL_CAP_EXPIRED: _e(
        WARNING,
        "scope why lasted dry_run",
        lambda s: _dry(
            s,
            f"The kill-cap latch of {s('scope')} lifted after {s.seconds('lasted')}: its"
            " targets may be signalled for real again.",
        ),
        INFO,
    ),
    EventName.RESET_CONFIRMING: _e(
        DEBUG,
        f"{_FINDING} why",
        lambda s: f"{s.gpu()} may need a reset; waiting to be sure{s.why()}.",
    ),
    EventName.RESET_DUE: _e(
        INFO,
        f"{_FINDING} dry_run pci_bus_id minor lasted evidence {_MIG}",
        lambda s: _dry(s, f"{_reset_of(s)} starts ({s('kind', 'a finding')}{s.why('reason')})."),
    ),
    EventName.RESET_REFUSED: _e(
        INFO,
        f"{_FINDING} why hidden_holder outcome pci_bus_id {_MIG}",
        lambda s: f"No reset of {s.gpu()} now{s.why()}.",
        WARNING,
        DEBUG,
    ),
    EventName.RESET_LIMIT_REACHED: _e(
        WARNING,
        f"{_FINDING} why",
        lambda s: f"No reset of {s.gpu()}: the reset limit is reached{s.why()}.",
    ),
    EventName.RESET_CIRCUIT_OPEN: _e(
        CRITICAL,
        f"{_FINDING} why",
        lambda s: f"No more GPU resets until cleared by hand{s.why()}.",
    ),
    EventName.RESET_SUCCEEDED: _e(
        INFO,
        _RESET,
        lambda s: f"{_reset_of(s)} is booked as a success in the reset history.",
    ),
    EventName.RESET_FAILED: _e(
        INFO,
        f"{_RESET} failures",
        lambda s: (
            f"{_reset_of(s)} is booked as failed ({s('outcome')}, failure {s('failures')});"
            " on_failure hooks follow."
        ),
    ),
    EventName.RESET_DRY_RUN: _e(INFO, f"{_RESET} assumed", _reset_dry_run),
    EventName.RESET_REFUSAL_CLEARED: _e(
        INFO,
        "gpu finding in_use why",
        lambda s: f"A refused reset of {s.gpu()} may be tried again{s.why()}.",
    ),
    EventName.GPU_NEEDS_REBOOT: _e(CRITICAL, f"{_RESET} pid start_ticks why", _needs_reboot),
    # GPU health
    EventName.HEALTH_DRAIN_STARTED: _e(
        WARNING, f"{_FINDING} blockers timeout dry_run drained_already", _drain_started
    ),
    EventName.HEALTH_DRAIN_WAITING: _e(
        INFO,
        f"{_FINDING} blockers until",
        lambda s: (
            f"The reset of {s.gpu()} still waits for {s.items('blockers')} (never signalled)."
        ),
    ),
    EventName.HEALTH_DRAIN_TIMED_OUT: _e(
        CRITICAL,
        f"{_FINDING} why blockers",
        lambda s: f"Draining {s.gpu()} timed out{s.why()}; on_failure hooks run.",
    ),
    EventName.STATE_BOOT_CHANGED: _e(
        INFO,
        "old new dropped_ladders",
        lambda s: (
            f"The machine rebooted: {s('dropped_ladders', '0')} escalation(s) of the old boot"
            " are dropped."
        ),
    ),
    EventName.CLOCK_STEPPED_BACK: _e(
        WARNING,
        "seconds wall",
        lambda s: f"The wall clock went back {s.seconds('seconds')}: counted as no time passed.",
    ),
    # carrying out (engine.py, act/)
    EventName.ACTION_SIGNAL: _e(
        WARNING,
        f"pid start_ticks signal gpu rule step dry_run outcome detail reason {_FINDING} {_PROCESS}",
        _signal,
        ERROR,
        INFO,
    ),
    EventName.ACTION_WITHHELD: _e(
        ERROR,
        "why steps",
        lambda s: (
            f"Not done, the state cannot be saved: {s.items('steps')}; tried again next poll."
        ),
    ),
    EventName.TARGET_EXITED: _e(
        INFO,
        "pid start_ticks",
        lambda s: f"{s.process()} exited (seen through its pidfd).",
    ),
    EventName.HOOK_RUN: _e(
        WARNING,
        "hook argv dry_run returncode timed_out output reason error outcome detail leftovers",
        _hook,
        ERROR,
    ),
    EventName.RESET_STEP: _e(
        INFO,
        "gpu step status dry_run blockers argv returncode detail output hooks would_run timeout"
        f" duration {_MIG}",
        _reset_step,
        WARNING,
        ERROR,
    ),
    EventName.RESET_FINISHED: _e(
        INFO,
        f"gpu result step reason needs_reboot blockers dry_run {_MIG}",
        _reset_finished,
        WARNING,
        ERROR,
        CRITICAL,
    ),
    EventName.RESET_OUTCOME: _e(
        WARNING,
        f"gpu pci_bus_id result step reason needs_reboot blockers dry_run {_MIG}",
        _reset_outcome,
        ERROR,
        CRITICAL,
    ),
    EventName.RESET_CRASHED: _e(
        ERROR,
        "gpu error",
        lambda s: f"{_reset_of(s)} crashed (a bug), booked as failed: {s('error')}.",
    ),
    EventName.RESET_RESUME: _e(
        WARNING,
        "record",
        lambda s: "A reset was interrupted by a stop or crash: finishing or undoing it now.",
    ),
    EventName.RESET_RESUMED: _e(
        WARNING,
        "gpu result step reason needs_reboot",
        lambda s: f"The interrupted reset of {s.gpu()} ended: {s('result')}{s.why('reason')}.",
    ),
    EventName.RESET_RESUME_FAILED: _e(
        ERROR,
        "reason",
        lambda s: f"An interrupted reset could not be resumed{s.why('reason')}.",
    ),
    # admin switches and lifecycle
    EventName.DAEMON_PAUSED: _e(
        WARNING,
        "reason until",
        lambda s: (
            f"Actions paused by an admin{s.why('reason')}; nothing is done until resume"
            f"{' or ' + _wall(s, 'until') if s.has('until') else ''}."
        ),
    ),
    EventName.DAEMON_RESUMED: _e(WARNING, "reason", lambda s: f"Actions resumed{s.why('reason')}."),
    EventName.SPARE_STARTED: _e(
        WARNING,
        "target pid start_ticks job reason until by_uid",
        lambda s: f"Spared {s('target')} until {_wall(s, 'until')}{s.why('reason')}.",
    ),
    EventName.SPARE_ENDED: _e(
        WARNING,
        "target pid start_ticks job reason until by_uid why",
        lambda s: (
            f"No longer spared: {s('target')}{s.why('why')}."
            if s.has("target")
            else f"A spare file was not honoured{s.why('why')}."
        ),
    ),
    EventName.LIMITS_LATCHES_CLEARED: _e(
        WARNING,
        "",
        lambda s: "An admin cleared the latches: forced dry-run and the reset circuit breaker.",
    ),
    EventName.DAEMON_START: _e(INFO, "version dry_run once config interval", _started),
    EventName.DAEMON_STOP: _e(
        INFO, "exit_code", lambda s: f"gpuwatchd stopped (exit code {s('exit_code')})."
    ),
    EventName.DAEMON_ALREADY_RUNNING: _e(
        ERROR,
        "detail state_dir",
        lambda s: f"Another gpuwatchd already runs here{s.why('detail')}.",
    ),
    EventName.DAEMON_NO_PERMISSION: _e(
        CRITICAL,
        "path error missing detail",
        lambda s: f"Not enough privilege{s.why('error', 'detail')}.",
    ),
    EventName.DAEMON_LIMITED_PERMISSIONS: _e(
        WARNING,
        "missing dry_run",
        lambda s: (
            f"Running without {s.items('missing')}: other users' processes may be unreadable."
        ),
    ),
    EventName.DAEMON_DEVICE_WATCH_UNAVAILABLE: _e(
        WARNING,
        "reason consequence",
        lambda s: f"The device-file watch cannot be used{s.why('reason')}; {s('consequence', '')}.",
    ),
    EventName.RUN_ONCE_TIMEOUT: _e(
        WARNING,
        "pending left exit_code",
        lambda s: f"run --once timed out with work left: {s.items('left')}.",
    ),
    EventName.RUN_ONCE_DONE: _e(
        INFO,
        "waited",
        lambda s: f"run --once is done after {s.seconds('waited')}: every GPU is clean.",
    ),
    EventName.RUN_ONCE_UNRESOLVED: _e(
        WARNING,
        "left waited exit_code",
        lambda s: f"run --once gives up, waiting would not change: {s.items('left')}.",
    ),
    EventName.SCHEDULER_ENDED_JOB: _e(
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
    EventName.SCHEDULER_ENDED_JOBS_OVER_LIMIT: _e(
        WARNING,
        "waiting honoured limit",
        lambda s: (
            f"Too many ended-job hand-overs: {s('waiting')} wait, only {s('limit')} are"
            " honoured at once."
        ),
    ),
    EventName.CONFIG_RELOADED: _e(INFO, "config dry_run changed", _reloaded),
    EventName.CONFIG_RELOAD_REJECTED: _e(
        ERROR,
        "error config",
        lambda s: f"Reload rejected, the old policy stays in force{s.why('error')}.",
    ),
    EventName.CONFIG_RELOAD_PARTIAL: _e(
        WARNING,
        "needs_restart",
        lambda s: f"Reloaded, but these keys change only on restart: {s.items('needs_restart')}.",
    ),
    EventName.CONFIG_START_REJECTED: _e(
        CRITICAL,
        "error config running dry_run unusable",
        lambda s: (
            f"The policy is invalid{s.why('error')}; running with the last accepted one"
            f" ({s('running')})."
        ),
    ),
    EventName.STATE_INVALID: _e(
        ERROR,
        "error path",
        lambda s: f"The saved state {s('path')} was unusable{s.why('error')}; starting clean.",
    ),
    EventName.STATE_CORRUPT: _e(
        ERROR,
        "path why moved_to error",
        lambda s: (
            f"The state file {s('path')} is corrupt and was moved to {s('moved_to')}{s.why()}."
        ),
    ),
    EventName.STATE_NEW_BOOT: _e(
        INFO,
        "saved_boot_id boot_id",
        lambda s: "The saved state is from another boot: process-keyed state is dropped.",
    ),
    EventName.STATE_SAVE_FAILED: _e(
        ERROR,
        "error path",
        lambda s: (
            f"The state could not be saved to {s('path')}{s.why('error')}; nothing"
            " irreversible is done until it can be."
        ),
    ),
    EventName.STATE_DIR_UNUSABLE: _e(
        CRITICAL,
        "path error",
        lambda s: f"The state directory {s('path')} is unusable{s.why('error')}.",
    ),
    EventName.METRICS_WRITE_FAILED: _e(
        ERROR,
        "path error",
        lambda s: f"The metrics file {s('path')} could not be written{s.why('error')}.",
    ),
    EventName.COLLECT_KCMP_UNAVAILABLE: _e(
        WARNING,
        "reason",
        lambda s: (
            f"kcmp cannot prove inherited GPU files{s.why('reason')}; orphans are judged"
            " without that proof."
        ),
    ),
    # NVML
    EventName.NVML_RECOVERED: _e(
        WARNING,
        "was since gone_for error",
        lambda s: f"NVML answers again after {s.seconds('gone_for')} {s('was')}.",
    ),
    EventName.NVML_UNAVAILABLE: _e(
        WARNING, "reason", lambda s: f"NVML is unavailable{s.why('reason')}; retrying."
    ),
    EventName.NVML_WEDGED: _e(
        CRITICAL,
        "timeout pid",
        lambda s: (
            f"NVML is wedged (a call missed its {s('timeout')}s deadline): no destructive action."
        ),
    ),
    EventName.NVML_WORKER_STARTED: _e(DEBUG, "pid", lambda s: f"NVML worker {s.pid()} started."),
    EventName.NVML_WORKER_HUNG: _e(
        CRITICAL,
        "pid reason",
        lambda s: (
            f"The NVML worker {s.pid()} survived SIGKILL (stuck in the kernel); no new worker"
            f" while it lives{s.why('reason')}."
        ),
    ),
    EventName.NVML_HUNG_WORKER_EXITED: _e(
        INFO, "pid", lambda s: f"The hung NVML worker {s.pid()} finally exited."
    ),
    EventName.NVML_MEMORY_V1_FALLBACK: _e(
        WARNING,
        "gpu index reason consequence",
        lambda s: (
            f"{s.gpu()} answers only the old memory query{s.why('reason')}; {s('consequence', '')}."
        ),
    ),
}


def render(name: str, fields: Mapping[str, object], namer: Namer | None = None) -> str:
    """The sentence for event ``name``: one printable line, never raising. An event outside
    the catalogue (a test's, the simulator's) says its name and its ``why`` or ``reason``."""
    said = _Said(fields, namer if namer is not None else JournalNamer())
    try:
        spec = CATALOGUE.get(EventName(name)) if name in _NAMES else None
        if spec is not None:
            return spec.say(said)
        return f"{_short(name)}{said.why()}."
    except Exception:  # a sentence must never cost the event
        try:
            return f"{_short(name)}."
        except Exception:
            return "?"


_NAMES = frozenset(member.value for member in EventName)


def finding_label(key: object, namer: Namer) -> str:
    """A finding key (``kind:gpu:pid@ticks`` or ``kind:gpu:gpu``) in words: "orphaned
    PID 4252 on GPU-…" (named by ``namer``); the key itself if it has another shape."""
    text = str(key)
    kind, _, rest = text.partition(":")
    gpu, _, target = rest.rpartition(":")
    if not rest or not gpu:
        return _short(text)
    pid = target.split("@", 1)[0]
    if pid.isdigit():
        return f"{_short(kind)} {namer.process(int(pid))} on {namer.gpu(gpu)}"
    return f"{_short(kind)} {namer.gpu(gpu)}"


def notification(fields: Mapping[str, object], namer: Namer | None = None) -> str:
    """The one line of an ``on_action`` notification (``GPUWATCHD_MESSAGE``): what was done,
    to whom, and how it ended, from the hook's facts (``action``, ``outcome``, ``pid``,
    ``gpu``, ``user``, ``rule``, ``why``)."""
    s = _Said(fields, namer if namer is not None else JournalNamer())
    outcome = str(fields.get("outcome"))
    owner = f" of user {s('user')}" if s.has("user") else ""
    why = f" ({s('why')})" if s.has("why") else ""
    if fields.get("action") == "reset":
        done = "was reset" if outcome == ActionOutcome.RESET else "could not be reset"
        return f"{s.gpu()}{owner} {done}{why}."
    rule = f" by rule {s('rule')}" if s.has("rule") else ""
    said = _ENDED.get(outcome) or f"ended: {_short(outcome)}"
    return f"{s.process()}{owner} on {s.gpu()}, signalled{rule}, {said}{why}."


_ENDED: Mapping[str, str] = {
    ActionOutcome.FREED.value: "was stopped; its GPU memory is freed",
    ActionOutcome.RELEASED.value: "no longer holds the GPU",
    ActionOutcome.SURVIVED.value: "survived the last signal and is left alone",
    ActionOutcome.STUCK.value: "is stuck in D state and cannot be killed",
    ActionOutcome.FAILED.value: "could not be signalled",
}


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
_FIELD_NAME_MAX = 64  # journald drops longer names
_NOT_IN_FIELD_NAME = re.compile(r"[^A-Z0-9_]")


def message_id(event: str) -> str:
    """The journal MESSAGE_ID of an event: 32 lower-case hex digits, the same forever."""
    return uuid.uuid5(MESSAGE_ID_NAMESPACE, str(event)).hex


def journal_field_name(key: str) -> str:
    """The journal field for event field ``key``: ``gpu`` is GPU_UUID, ``foo`` GPUWATCHD_FOO.

    Always ``[A-Z0-9_]``, at most 64 characters, starting with a letter: never one of the
    trusted fields (``_PID``...) that only journald may set.
    """
    name = JOURNAL_FIELDS.get(key)
    if name is None:
        name = "GPUWATCHD_" + _NOT_IN_FIELD_NAME.sub("_", str(key).upper())
    return name[:_FIELD_NAME_MAX]
