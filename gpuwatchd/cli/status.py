"""``gpuwatchd status``: what the daemon is doing, read from its state file, changing nothing.

This module owns the ``status`` command: reading ``<state_dir>/state.json`` the way ``scan``
does (:class:`gpuwatchd.statedir.StateDir`, the one checked way in: never the lock, never a
write, a corrupt file left where it is, an untrusted directory or file not read),
deciding whether the daemon is running (the PID its ``status`` section names is alive and looks
like gpuwatchd, and it polled recently), and turning the saved state into a report — text for
people, JSON for scripts (shape and exit codes in docs/operations.md, "status") — with an
LSB-style exit code.

:func:`describe` and :func:`render_text` are pure: the saved state is a plain dict, and every
field in it is optional and may be malformed (shown as unknown, never a traceback). The I/O —
the state file, ``/proc/PID``, the boot id, the clocks — is at the edge, in
:func:`status_command`.

Times: wall times in the state (``last_poll``, resets) are shown against the caller's wall
clock. Ladder deadlines are the daemon's *monotonic* times; they are converted through the pair
the daemon wrote at one instant (``status.monotonic`` with ``status.last_poll``) when present,
else through this host's own monotonic clock when the state was written in this boot (the same
``CLOCK_MONOTONIC``, as ``scan`` converts first-seen times). Otherwise a deadline is shown as
"due" without a time rather than guessed.

It is long (about 800 lines) because every field of the saved state is read defensively, one
small checked reader each, and shown in both forms; splitting text and JSON would repeat them.
"""

from __future__ import annotations

import enum
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import IO

from gpuwatchd.checked import as_count as _count
from gpuwatchd.checked import as_flag as _bool
from gpuwatchd.checked import as_int as _int
from gpuwatchd.checked import as_list as _seq
from gpuwatchd.checked import as_map as _map
from gpuwatchd.checked import as_number as _num
from gpuwatchd.checked import as_text as _str
from gpuwatchd.cli.humantime import ago, duration, until
from gpuwatchd.decide.policy import Policy
from gpuwatchd.escape import escape
from gpuwatchd.event_catalogue import JournalNamer, finding_label
from gpuwatchd.state import SavedState, read_saved_state
from gpuwatchd.vocabulary import EventName, LadderStatus

STATUS_FORMAT = 1  # the "format" of ``status --json``
CLEAR_LATCHES = "gpuwatchd resume --clear-latches"
# The daemon rewrites ``status.last_poll`` at least once a minute even when nothing else changed
# (daemon.py, STATUS_REFRESH), so the saved time may lag a live daemon by that much plus a poll.
STATUS_REFRESH = 60.0
STALE_POLLS = 3  # stale: no sign of life for a refresh plus this many intervals (and NVML)...
STALE_MIN = 120.0  # ...and never sooner than this many seconds
MAX_ACTIONS = 20  # recent actions shown (the daemon keeps as many)
HOUR = 3600.0


class StatusCode(enum.IntEnum):
    """``gpuwatchd status`` exit codes (LSB init-script status convention, plus 1)."""

    RUNNING = 0  # running and healthy (paused or dry-run included: those are choices)
    ATTENTION = 1  # running, but a latch, the breaker, NVML, the policy or a stuck target
    NOT_RUNNING = 3  # no state, the PID is gone or not gpuwatchd, another boot, stale
    UNKNOWN = 4  # the state cannot be read (permission) or is not a state file


def daemon_pid(saved: Mapping[str, object] | None) -> int | None:
    """The PID the daemon wrote in its ``status`` section; None when absent or malformed."""
    return SavedState(saved or {}).daemon_pid


# --- the pure part ----------------------------------------------------------------------------


class _Clock:
    """Converts the daemon's monotonic times to wall time, when that can be done reliably."""

    def __init__(
        self,
        status: Mapping[str, object],
        *,
        same_boot: bool | None,
        now_wall: float,
        now_monotonic: float | None,
    ) -> None:
        self.offset: float | None = None
        self.source: str | None = None
        daemon_mono, last_poll = _num(status.get("monotonic")), _num(status.get("last_poll"))
        if daemon_mono is not None and last_poll is not None:
            self.offset, self.source = last_poll - daemon_mono, "daemon"
        elif same_boot is True and now_monotonic is not None:
            self.offset, self.source = now_wall - now_monotonic, "local"

    def wall(self, monotonic: float | None) -> float | None:
        if monotonic is None or self.offset is None:
            return None
        return monotonic + self.offset


def _stale_after(policy: Policy, interval: float, resetting: bool) -> float:
    """How old the last sign of life may be before the daemon counts as not polling."""
    limit = max(STATUS_REFRESH + STALE_POLLS * interval + policy.nvml_timeout, STALE_MIN)
    if resetting:  # a reset holds the loop: each step may take its command's or hooks' timeout
        reset = policy.reset
        hooks = sum(h.timeout for h in (*reset.drain, *reset.before, *reset.after))
        limit += reset.timeout + hooks
    return limit


def describe(
    saved: Mapping[str, object] | None,
    *,
    policy: Policy,
    now_wall: float,
    now_monotonic: float | None = None,
    boot_id: str | None = None,
    process: str | None = None,
    read_error: str | None = None,
) -> dict[str, object]:
    """The ``status --json`` document for a saved state (None: there is none).

    ``process`` is what ``/proc/PID`` of the status section's PID showed: "gpuwatchd",
    "other" (a reused PID, or this very process), "gone", "unknown" (unreadable), or None (not
    looked at); with "unknown" or None, a recent last poll alone says it is running.
    ``read_error`` says why the state could not be read (exit 4).
    """
    data = _map(saved)
    status = _map(data.get("status"))
    plan = _map(data.get("plan"))
    state_boot = _str(data.get("boot_id"))
    same_boot = None if state_boot is None or boot_id is None else state_boot == boot_id
    clock = _Clock(status, same_boot=same_boot, now_wall=now_wall, now_monotonic=now_monotonic)

    reset_record = data.get("reset_in_progress")
    in_progress = _reset_in_progress(reset_record) if isinstance(reset_record, Mapping) else None
    last_poll = _num(status.get("last_poll"))
    started = _num(status.get("started"))
    # Signs of life: the last poll, the last step of a reset, or the start (before a first poll).
    signs = [last_poll, None if in_progress is None else _num(in_progress["since"])]
    if last_poll is None:
        signs.append(started)
    last_sign = max((t for t in signs if t is not None), default=None)
    age = None if last_sign is None else now_wall - last_sign
    interval = _num(status.get("interval"))  # the daemon's own, when it wrote one
    if interval is None or interval <= 0:
        interval = policy.interval
    stale_after = _stale_after(policy, interval, in_progress is not None)
    pid = daemon_pid(data)

    why_not = read_error or _why_not_running(
        present=saved is not None,
        same_boot=same_boot,
        pid=pid,
        process=process,
        age=age,
        stale_after=stale_after,
        state_dir=policy.state_dir,
    )
    running = None if read_error is not None else why_not is None

    modes = _modes(status, plan)
    ladders = _ladders(plan, clock, now_wall)
    kill_cap = _kill_cap(plan, policy, clock, now_wall)
    breaker = _breaker(plan, policy)
    nvml = _map(status.get("nvml"))
    nvml_state = _str(nvml.get("state"))
    raw_rejected = status.get("policy_rejected")
    rejected = _map(raw_rejected) if isinstance(raw_rejected, Mapping) else None
    files = status.get("policy")
    attention = _attention(
        kill_cap=kill_cap,
        breaker=breaker,
        nvml_state=nvml_state,
        nvml_error=_str(nvml.get("error")),
        rejected=rejected,
        ladders=ladders,
    )
    if read_error is not None:
        code, health = StatusCode.UNKNOWN, "unknown"
    elif not running:
        code, health = StatusCode.NOT_RUNNING, "not-running"
    elif attention:
        code, health = StatusCode.ATTENTION, "attention"
    else:
        code, health = StatusCode.RUNNING, "ok"
    return {
        "format": STATUS_FORMAT,
        "state_dir": policy.state_dir,
        "now": now_wall,
        "exit_code": int(code),
        "health": health,
        "state": "unreadable" if read_error else ("missing" if saved is None else "present"),
        "running": running,
        "why_not_running": why_not,
        "attention": attention,
        "daemon": {
            "pid": pid,
            "process": process,
            "started": started,
            "interval": interval,
            "last_poll": last_poll,
            "last_poll_age": None if last_poll is None else now_wall - last_poll,
            "stale_after": stale_after,
            "saved_at": _num(data.get("saved_at")),
            "same_boot": same_boot,
        },
        **modes,
        "kill_cap": kill_cap,
        "circuit_breaker": breaker,
        "clear_latches": CLEAR_LATCHES if kill_cap["latched"] or breaker["open"] else None,
        "nvml": {
            "state": nvml_state if nvml_state in ("ok", "wedged", "unavailable") else None,
            "error": _str(nvml.get("error")),
            "since": _num(nvml.get("since")),
        },
        "spares": _spares(status.get("spares")),
        "gpus": _count(status.get("gpus")),
        "findings": _count(status.get("findings")),
        "verdict": _verdict(status.get("verdict")),
        "policy": {
            "files": [f for f in files if isinstance(f, str)] if isinstance(files, list) else None,
            "rejected": None
            if rejected is None
            else {
                "at": _num(rejected.get("at")),
                "error": _str(rejected.get("error")),
                "at_start": rejected.get("at_start") is True,
                "running": _str(rejected.get("running")),
            },
        },
        "clock": clock.source,
        "ladders": ladders,
        "pending": _pending(plan, ladders, clock, now_wall),
        "recent_actions": _actions(status.get("recent_actions")),
        "resets": _resets(plan, in_progress, policy, now_wall, modes),
    }


def _why_not_running(
    *,
    present: bool,
    same_boot: bool | None,
    pid: int | None,
    process: str | None,
    age: float | None,
    stale_after: float,
    state_dir: str,
) -> str | None:
    if not present:
        return f"no state in {state_dir} (never started here, or another state_dir)"
    # A boot id that differs is not proof by itself: a sandboxed daemon (ProtectKernelTunables=
    # under a container) may read another boot id than this command. A live gpuwatchd at the
    # recorded PID with a fresh poll is; otherwise the earlier boot explains the rest.
    if same_boot is False and (process != "gpuwatchd" or age is None or age > stale_after):
        return "the state was written in an earlier boot"
    if pid is None:
        return "the state names no daemon PID (no status section: not written by a daemon)"
    if process == "gone":
        return f"pid {pid} is not running"
    if process == "other":
        return f"pid {pid} is not gpuwatchd (the PID was reused)"
    if age is None:
        return "the state has no time of a poll or of the start"
    if age > stale_after:
        return f"no poll for {duration(age)} (more than {duration(stale_after)}): stale"
    return None


def _modes(status: Mapping[str, object], plan: Mapping[str, object]) -> dict[str, object]:
    dry = _bool(status.get("dry_run"))
    mode = _str(status.get("mode"))
    if mode not in ("enforcing", "dry-run"):
        mode = None if dry is None else ("dry-run" if dry else "enforcing")
    paused = _bool(plan.get("paused"))
    forced = _bool(plan.get("forced_dry_run"))
    if paused:
        effective: str | None = "paused"
    elif forced:
        effective = "forced-dry-run"
    else:
        effective = mode
    return {
        "mode": mode,
        "effective_mode": effective,
        "paused": paused,
        "paused_reason": _str(plan.get("paused_reason")) if paused else None,
        "paused_until": _num(plan.get("paused_until")) if paused else None,
    }


def _spares(raw: object) -> list[dict[str, object]]:
    """The daemon's spares in force (``gpuwatchd spare``), each checked."""
    out: list[dict[str, object]] = []
    for item in _seq(raw)[:64]:
        row = _map(item)
        target = _str(row.get("target"))
        if target is None:
            continue
        out.append(
            {"target": target, "until": _num(row.get("until")), "reason": _str(row.get("reason"))}
        )
    return out


def _kill_cap(
    plan: Mapping[str, object],
    policy: Policy,
    clock: _Clock,
    now_wall: float,
) -> dict[str, object]:
    latched = _bool(plan.get("forced_dry_run"))
    history = plan.get("signal_history")
    recent: int | None = None
    if isinstance(history, list) and clock.offset is not None:
        times = [clock.wall(_num(p[1])) for p in history if isinstance(p, list) and len(p) == 2]
        if all(t is not None for t in times):
            recent = sum(1 for t in times if t is not None and now_wall - t < HOUR)
    scopes = plan.get("scope_latches")
    users = sorted(str(k) for k in scopes) if isinstance(scopes, dict) else []
    return {
        "latched": latched,
        "reason": _str(plan.get("forced_reason")) if latched else None,
        "users_latched": users[:64],
        "signalled_last_hour": recent,
        "max_per_hour": policy.limits.node_max_signalled_per_hour,
        "max_per_user_hour": policy.limits.max_signalled_per_hour,
        "max_per_poll": policy.limits.max_signalled_per_poll,
    }


def _breaker(plan: Mapping[str, object], policy: Policy) -> dict[str, object]:
    return {
        "open": _bool(plan.get("circuit_open")),
        "failures": _count(plan.get("reset_failures")),
        "max_failures": policy.reset.max_failures,
    }


def _ladders(plan: Mapping[str, object], clock: _Clock, now_wall: float) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for target, raw in sorted(_map(plan.get("ladders")).items()):
        lad = _map(raw)
        steps = lad.get("steps")
        total = len(steps) if isinstance(steps, list) else None
        step = _count(lad.get("step"))
        nxt: str | None = None
        if isinstance(steps, list) and total is not None and step is not None and step <= total:
            if step == total:
                nxt = "end"
            else:
                pair = steps[step]
                signal = pair[0] if isinstance(pair, list) and len(pair) == 2 else 0
                nxt = signal if isinstance(signal, str) else ("report" if signal is None else None)
        state = _str(lad.get("status"))
        due = clock.wall(_num(lad.get("due")))
        out.append(
            {
                "target": target,
                "pid": _int(lad.get("pid")),
                "rule": _str(lad.get("rule")),
                "gpu": _str(lad.get("gpu")),
                "finding": _str(lad.get("finding")),
                "status": state if state in set(LadderStatus) else None,
                "dry_run": _bool(lad.get("dry_run")),
                "step": step,
                "steps": total,
                "next": nxt,
                "scheduled": _num(lad.get("due")) is not None,
                "due": due,
                "due_in": None if due is None else due - now_wall,
                "started": clock.wall(_num(lad.get("started"))),
            }
        )
    return out


def _pending(
    plan: Mapping[str, object],
    ladders: Sequence[Mapping[str, object]],
    clock: _Clock,
    now_wall: float,
) -> list[dict[str, object]]:
    """Confirmation windows and delays not already shown as a ladder's next step."""
    laddered = {lad["finding"] for lad in ladders if lad["status"] == LadderStatus.ACTIVE}
    out: list[dict[str, object]] = []
    for key, raw in sorted(_map(plan.get("waiting")).items()):
        if key in laddered:
            continue
        due = clock.wall(_num(raw))
        out.append({"finding": key, "due": due, "due_in": None if due is None else due - now_wall})
    return out


def _verdict(raw: object) -> dict[str, object] | None:
    """The daemon's last verdict on each GPU (decide/verdict.py, what ``check-clean`` says):
    ``clean`` (true, false, or null when NVML could not be asked) and each GPU's ``state``
    with its first reason. None when the daemon wrote none."""
    if not isinstance(raw, Mapping):
        return None
    whole = _map(raw)
    gpus = []
    for item in _seq(whole.get("gpus"))[:256]:
        entry = _map(item)
        reasons = [_map(r) for r in _seq(entry.get("reasons"))]
        first = reasons[0] if reasons else {}
        state = _str(entry.get("state"))
        gpus.append(
            {
                "index": _int(entry.get("index")),
                "uuid": _str(entry.get("uuid")),
                "state": state if state in ("clean", "dirty", "unknown") else None,
                "kind": _str(first.get("kind")),
                "reason": _str(first.get("reason")),
                "reasons": len(reasons),
                "reset_blockers": len(_seq(entry.get("reset_blockers"))),
            }
        )
    return {"clean": _bool(whole.get("clean")), "error": _str(whole.get("error")), "gpus": gpus}


def _actions(raw: object) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for item in _seq(raw)[-MAX_ACTIONS:]:
        entry = _map(item)
        out.append(
            {
                "at": _num(entry.get("at")),
                "event": _str(entry.get("event")),
                "gpu": _str(entry.get("gpu")),
                "pid": _int(entry.get("pid")),
                "signal": _str(entry.get("signal")),
                "hook": _str(entry.get("hook")),
                "outcome": _str(entry.get("outcome")),
                "dry_run": _bool(entry.get("dry_run")),
            }
        )
    return out


def _reset_in_progress(record: Mapping[object, object]) -> dict[str, object]:
    return {
        "gpu": _str(record.get("uuid")),
        "pci_bus_id": _str(record.get("pci_bus_id")),
        "step": _str(record.get("step")),
        "since": _num(record.get("since")),
    }


def _resets(
    plan: Mapping[str, object],
    in_progress: Mapping[str, object] | None,
    policy: Policy,
    now_wall: float,
    modes: Mapping[str, object],
) -> dict[str, object]:
    reset = policy.reset
    last = {k: t for k, v in _map(plan.get("last_reset")).items() if (t := _num(v)) is not None}
    last_dry = {
        k: t for k, v in _map(plan.get("last_dry_reset")).items() if (t := _num(v)) is not None
    }
    history: dict[str, list[float]] = {}
    for pair in _seq(plan.get("reset_history")):
        if isinstance(pair, list) and len(pair) == 2:
            gpu, at = _str(pair[0]), _num(pair[1])
            if gpu is not None and at is not None:
                history.setdefault(gpu, []).append(at)
    # As plan gates it: in dry-run (configured or forced), a dry-run reset starts a cooldown too.
    dry = modes["mode"] == "dry-run" or modes["effective_mode"] == "forced-dry-run"
    gpus = []
    for gpu in sorted(set(last) | set(last_dry) | set(history)):
        times = sorted(history.get(gpu, []))
        window = [t for t in times if now_wall - t < reset.window]
        latest = last.get(gpu)
        if dry and gpu in last_dry:
            latest = max(latest if latest is not None else -math.inf, last_dry[gpu])
        cooldown_left = None if latest is None else max(0.0, latest + reset.cooldown - now_wall)
        # The limit lifts when enough of the resets in the window have aged out of it.
        limit_left: float | None = 0.0
        if reset.max_resets < 1:
            limit_left = None  # never allowed
        elif len(window) >= reset.max_resets:
            oldest_to_leave = window[len(window) - reset.max_resets]
            limit_left = max(0.0, oldest_to_leave + reset.window - now_wall)
        gpus.append(
            {
                "gpu": gpu,
                "last": last.get(gpu),
                "last_dry_run": last_dry.get(gpu),
                "history": times,
                "in_window": len(window),
                "cooldown_left": cooldown_left,
                "limit_left": limit_left,
            }
        )
    return {
        "cooldown": reset.cooldown,
        "max_resets": reset.max_resets,
        "window": reset.window,
        "in_progress": None if in_progress is None else dict(in_progress),
        "gpus": gpus,
    }


def _attention(
    *,
    kill_cap: Mapping[str, object],
    breaker: Mapping[str, object],
    nvml_state: str | None,
    nvml_error: str | None,
    rejected: Mapping[str, object] | None,
    ladders: Sequence[Mapping[str, object]],
) -> list[str]:
    """What needs a human, from the saved state (said even when the daemon is not running)."""
    out = []
    if kill_cap["latched"]:
        why = f" ({kill_cap['reason']})" if kill_cap["reason"] else ""
        out.append(f"kill cap reached{why}: dry-run forced; clear with `{CLEAR_LATCHES}`")
    users = kill_cap.get("users_latched")
    if isinstance(users, list) and users:
        shown = ", ".join(escape(str(u)) for u in users)
        out.append(f"kill cap reached for {shown}: their targets in dry-run until it expires")
    if breaker["open"]:
        failures = breaker["failures"]
        after = f" after {failures} failed reset(s)" if failures is not None else ""
        out.append(f"reset circuit breaker open{after}; clear with `{CLEAR_LATCHES}`")
    if nvml_state == "wedged":
        out.append("NVML wedged: the driver did not answer (drain and reboot if it persists)")
    elif nvml_state == "unavailable":
        why = f": {nvml_error}" if nvml_error else ""
        out.append(f"NVML unavailable{why}: no GPU is watched")
    if rejected is not None:
        error = _str(rejected.get("error")) or "unknown error"
        if rejected.get("at_start") is True:
            running = _str(rejected.get("running")) or "another policy"
            out.append(
                f"policy rejected at start ({error}); running {running} instead: fix the "
                "policy, then `systemctl reload gpuwatchd`"
            )
        else:
            out.append(f"policy reload rejected ({error}); the previous policy stays in force")
    stuck = [lad for lad in ladders if lad["status"] == LadderStatus.STUCK]
    if stuck:
        pids = ", ".join(str(lad["pid"] if lad["pid"] is not None else "?") for lad in stuck)
        out.append(f"target(s) stuck in D state (pid {pids}): needs drain/reboot")
    return out


# --- text ---------------------------------------------------------------------------------------


def _text(value: object) -> str:
    if value is None or isinstance(value, (Mapping, list)):
        return "unknown"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _at(now: float, when: object) -> str:
    """A wall time as ``2026-01-02 03:04:05 (3m ago)``; unknown when it is not a number."""
    t = _num(when)
    if t is None:
        return "unknown"
    try:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return ago(now - t)
    return f"{stamp} ({ago(now - t)})"


def _stamp(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "?"


def _header(result: Mapping[str, object]) -> str:
    daemon = _map(result.get("daemon"))
    now = _num(result.get("now")) or 0.0
    if result.get("health") == "unknown":
        return f"gpuwatchd status unknown: {result.get('why_not_running')}"
    if not result.get("running"):
        saved = _num(daemon.get("saved_at"))
        last = f"; state last saved {ago(now - saved)}" if saved is not None else ""
        return f"gpuwatchd is not running: {result.get('why_not_running')}{last}"
    started = _num(daemon.get("started"))
    up = f", up {duration(now - started)}" if started is not None and now >= started else ""
    last_poll = _num(daemon.get("last_poll"))
    poll = f", last poll {ago(now - last_poll)}" if last_poll is not None else ""
    return f"gpuwatchd is running: pid {daemon.get('pid')}{up}{poll}"


def _mode_line(result: Mapping[str, object]) -> str:
    mode, effective = result.get("mode"), result.get("effective_mode")
    configured = f"configured: {mode}" if mode else "configured mode unknown"
    if effective == "paused":
        reason = result.get("paused_reason")
        why = f" ({reason})" if reason else ""
        ends = _num(result.get("paused_until"))
        now = _num(result.get("now"))
        lasts = (
            f"until {_stamp(ends)} ({until(ends - now)}, ends by itself) or `gpuwatchd resume`"
            if ends is not None and now is not None
            else "until `gpuwatchd resume`"
        )
        return f"mode:     paused{why}: actions hold {lasts}; {configured}"
    if effective == "forced-dry-run":
        return f"mode:     dry-run, forced by the kill-cap latch; {configured}"
    if mode == "dry-run":
        return "mode:     dry-run (policy dry_run: true, or run --dry-run): nothing is sent"
    if mode == "enforcing":
        return "mode:     enforcing"
    return "mode:     unknown"


def _ladder_line(lad: Mapping[str, object]) -> str:
    parts = [f"pid {_text(lad.get('pid'))}", f"rule {_text(lad.get('rule'))}"]
    if lad.get("gpu"):
        parts.append(str(lad["gpu"]))
    step, steps = lad.get("step"), lad.get("steps")
    parts.append(f"step {_text(step)}/{_text(steps)}")
    status = lad.get("status")
    if status != LadderStatus.ACTIVE:
        return "  " + "  ".join(parts) + f": {_text(status)}"
    nxt = lad.get("next")
    what = "ends" if nxt == "end" else f"next {_text(nxt)}"
    due_in = _num(lad.get("due_in"))
    if due_in is not None:
        when = until(due_in)
    elif lad.get("scheduled"):
        when = "due (time unknown)"
    else:
        when = "due"
    dry = " (dry-run)" if lad.get("dry_run") else ""
    return "  " + "  ".join(parts) + f": {what} {when}{dry}"


def _action_line(now: float, action: Mapping[str, object]) -> str:
    at = _num(action.get("at"))
    when = ago(now - at) if at is not None else "unknown time"
    event, gpu, pid = action.get("event"), action.get("gpu"), action.get("pid")
    on = f" on {gpu}" if gpu else ""
    outcome = _text(action.get("outcome"))
    if event == EventName.ACTION_SIGNAL:
        what = f"{_text(action.get('signal'))} to pid {_text(pid)}{on}: {outcome}"
    elif event == EventName.RESET_OUTCOME:
        what = f"reset of {_text(gpu)}: {outcome}"
    elif event == EventName.HOOK_RUN:
        hook = action.get("hook")
        what = f"hook {hook}{on}: {outcome}" if hook else f"hook{on}: {outcome}"
    else:
        what = f"{_text(event)}{on}: {outcome}"
    dry = " (dry-run)" if action.get("dry_run") else ""
    return f"  {when}: {what}{dry}"


def _reset_lines(now: float, resets: Mapping[str, object]) -> list[str]:
    lines = []
    progress = resets.get("in_progress")
    if isinstance(progress, Mapping):
        since = _num(progress.get("since"))
        when = f", since {ago(now - since)}" if since is not None else ""
        lines.append(
            f"  in progress: {_text(progress.get('gpu'))} at step "
            f"{_text(progress.get('step'))}{when}"
        )
    window = duration(resets.get("window"))
    for gpu in _seq(resets.get("gpus")):
        entry = _map(gpu)
        parts = [f"last {_at(now, entry['last'])}"] if entry.get("last") is not None else []
        if entry.get("last_dry_run") is not None:
            parts.append(f"last dry-run {_at(now, entry['last_dry_run'])}")
        parts.append(
            f"{_text(entry.get('in_window'))} of {_text(resets.get('max_resets'))} "
            f"in the last {window}"
        )
        cooldown = _num(entry.get("cooldown_left"))
        if cooldown:
            parts.append(f"cooldown ends {until(cooldown)}")
        limit = _num(entry.get("limit_left"))
        if limit:
            parts.append(f"limit lifts {until(limit)}")
        elif "limit_left" in entry and entry["limit_left"] is None:
            parts.append("max_resets is 0: never reset")
        lines.append(f"  {_text(entry.get('gpu'))}: " + "; ".join(parts))
        history = [_num(t) for t in _seq(entry.get("history"))]
        older = [t for t in history if t is not None and t != entry.get("last")]
        if older:
            lines.append("    earlier: " + ", ".join(_at(now, t) for t in older[-5:]))
    return lines


def _latch_lines(result: Mapping[str, object]) -> list[str]:
    cap = _map(result.get("kill_cap"))
    recent = cap.get("signalled_last_hour")
    count = (
        f"; {recent} of {cap.get('max_per_hour')} processes signalled in the last hour"
        if recent is not None
        else ""
    )
    latched = cap.get("latched")
    state = "LATCHED: dry-run forced" if latched else ("not latched" if latched is False else None)
    lines = [f"kill cap: {_text(state)}{count}"]
    users = cap.get("users_latched")
    if isinstance(users, list) and users:
        lines.append(f"          latched for {', '.join(escape(str(u)) for u in users)}")
    breaker = _map(result.get("circuit_breaker"))
    is_open = breaker.get("open")
    state = "OPEN: resets stopped" if is_open else ("closed" if is_open is False else None)
    failures = breaker.get("failures")
    fails = (
        f"; {failures} of {breaker.get('max_failures')} consecutive reset failures"
        if failures is not None
        else ""
    )
    lines.append(f"breaker:  {_text(state)}{fails}")
    if result.get("clear_latches"):
        lines.append(f"          clear with `{result['clear_latches']}`")
    return lines


def _health_lines(now: float, result: Mapping[str, object]) -> list[str]:
    nvml = _map(result.get("nvml"))
    error = f" ({nvml['error']})" if nvml.get("error") else ""
    since = (
        f" since {_at(now, nvml['since'])}"
        if nvml.get("state") != "ok" and nvml.get("since")
        else ""
    )
    lines = [
        f"NVML:     {_text(nvml.get('state'))}{since}{error}; {_text(result.get('gpus'))} GPUs; "
        f"{_text(result.get('findings'))} findings"
    ]
    for spare in _seq(result.get("spares")):
        row = _map(spare)
        ends = _num(row.get("until"))
        left = "" if ends is None else f" until {_stamp(ends)} ({until(ends - now)})"
        why = f": {row['reason']}" if row.get("reason") else ""
        lines.append(f"spared:   {_text(row.get('target'))}{left}{why}")
    lines.extend(_verdict_lines(result.get("verdict")))
    policy = _map(result.get("policy"))
    files = policy.get("files")
    shown = (", ".join(files) or "built-in defaults") if isinstance(files, list) else None
    lines.append(f"policy:   {_text(shown)}")
    rejected = policy.get("rejected")
    if isinstance(rejected, Mapping):
        what = "rejected at start" if rejected.get("at_start") is True else "reload rejected"
        lines.append(
            f"          {what} {_at(now, rejected.get('at'))}: {_text(rejected.get('error'))}"
        )
        if rejected.get("at_start") is True:
            lines.append(f"          running {_text(rejected.get('running'))} instead")
    return lines


def _verdict_lines(raw: object) -> list[str]:
    """``GPUs:     3 clean; not clean: GPU 1 GPU-…: orphaned <why> (and 1 more)``."""
    verdict = _map(raw)
    if not verdict:
        return []
    if verdict.get("clean") is None:
        return [f"GPUs:     not judged ({_text(verdict.get('error'))})"]
    gpus = [_map(g) for g in _seq(verdict.get("gpus"))]
    clean = sum(1 for g in gpus if g.get("state") == "clean")
    lines = [f"GPUs:     {clean} of {len(gpus)} clean for a new job (as check-clean says)"]
    for gpu in gpus:
        if gpu.get("state") == "clean":
            continue
        count = _count(gpu.get("reasons")) or 0
        more = f" (and {count - 1} more)" if count > 1 else ""
        lines.append(
            f"  not clean: GPU {_text(gpu.get('index'))} {_text(gpu.get('uuid'))}: "
            f"{_text(gpu.get('kind'))} {_text(gpu.get('reason'))}{more}"
        )
    return lines


def _work_lines(result: Mapping[str, object]) -> list[str]:
    ladders = [_map(lad) for lad in _seq(result.get("ladders"))]
    active = [lad for lad in ladders if lad.get("status") == LadderStatus.ACTIVE]
    done = [lad for lad in ladders if lad.get("status") != LadderStatus.ACTIVE]
    lines = ["ladders in progress:" + ("" if active else " none")]
    lines.extend(_ladder_line(lad) for lad in active)
    if done:
        lines.append("finished ladders (target still alive, never signalled again):")
        lines.extend(_ladder_line(lad) for lad in done)
    pending = [_map(p) for p in _seq(result.get("pending"))]
    if pending:
        lines.append("waiting (confirmation windows, post-action delays):")
        for item in pending:
            due_in = _num(item.get("due_in"))
            when = "due" if due_in is None else until(due_in)
            lines.append(f"  {finding_label(item.get('finding'), JournalNamer())}: {when}")
    return lines


def render_text(result: Mapping[str, object]) -> str:
    """The text report of a :func:`describe` document."""
    now = _num(result.get("now")) or 0.0
    lines = [_header(result)]
    if result.get("state") == "present":
        if not result.get("running"):
            lines.append("last known state:")
        lines.append(_mode_line(result))
        paused = result.get("paused")
        lines.append(f"paused:   {_text(paused)}" + (" (ladders hold)" if paused else ""))
        lines.extend(_latch_lines(result))
        lines.extend(_health_lines(now, result))
        lines.extend(_work_lines(result))
        actions = [_map(a) for a in _seq(result.get("recent_actions"))]
        lines.append("recent actions:" + ("" if actions else " none"))
        lines.extend(_action_line(now, a) for a in actions)
        resets = _map(result.get("resets"))
        reset_lines = _reset_lines(now, resets)
        cooldown = duration(resets.get("cooldown"))
        lines.append(f"resets (cooldown {cooldown}):" + ("" if reset_lines else " none"))
        lines.extend(reset_lines)
        attention = [str(a) for a in _seq(result.get("attention"))]
        if attention:
            lines.append("needs attention:")
            lines.extend(f"  - {a}" for a in attention)
    return "\n".join(escape(line) for line in lines) + "\n"


# --- the edge: files, /proc, clocks -----------------------------------------------------------


def read_saved(state_dir: str) -> tuple[dict[str, object] | None, str | None]:
    """``(state, None)``; ``(None, None)`` when there is no state file; ``(None, why)`` when it
    cannot be read, cannot be trusted or is not a state file (:func:`read_saved_state`)."""
    saved = read_saved_state(state_dir)
    return (dict(saved.data) if saved.found else None), saved.problem


def _looks_like_gpuwatchd(comm: str | None, argv: Sequence[str]) -> bool:
    if comm is not None and comm.startswith("gpuwatchd"):
        return True
    for arg in argv[:4]:  # /usr/bin/gpuwatchd run; python3 /usr/bin/gpuwatchd; python3 -m gpuwatchd
        name = os.path.basename(arg)
        if name == "gpuwatchd" or name.startswith("gpuwatchd."):
            return True
    return False


def look_at_process(proc_root: str, pid: int) -> str:
    """What PID ``pid`` is: "gpuwatchd", "other", "gone", or "unknown" (unreadable)."""
    if pid == os.getpid():
        return "other"  # this very process: the daemon's PID was reused by `status` itself
    base = os.path.join(proc_root, str(pid))
    try:
        with open(os.path.join(base, "stat"), "rb") as handle:
            stat = handle.read(4096)
    except FileNotFoundError:
        return "gone"
    except OSError:
        stat = b""
    fields = stat.rpartition(b")")[2].split()
    if fields and fields[0] in (b"Z", b"X"):
        return "gone"  # exited; its parent has not reaped it yet
    comm: str | None = None
    argv: list[str] = []
    try:
        with open(os.path.join(base, "comm"), "rb") as handle:
            comm = handle.read(64).decode("utf-8", "replace").strip()
        with open(os.path.join(base, "cmdline"), "rb") as handle:
            raw = handle.read(4096)
        argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
    except FileNotFoundError:
        return "gone"
    except OSError:
        if comm is None:
            return "unknown" if os.path.isdir(base) else "gone"
    return "gpuwatchd" if _looks_like_gpuwatchd(comm, argv) else "other"


def read_boot_id(proc_root: str) -> str | None:
    try:
        with open(os.path.join(proc_root, "sys/kernel/random/boot_id"), "rb") as handle:
            return handle.read(64).decode("ascii", "replace").strip() or None
    except OSError:
        return None


def status_command(policy: Policy, *, as_json: bool, out: IO[str]) -> int:
    """Read, describe, print; the exit code of :class:`StatusCode`."""
    saved, error = read_saved(policy.state_dir)
    pid = daemon_pid(saved)
    result = describe(
        saved,
        policy=policy,
        now_wall=time.time(),
        now_monotonic=time.monotonic(),
        boot_id=read_boot_id(policy.proc_root),
        process=None if pid is None else look_at_process(policy.proc_root, pid),
        read_error=error,
    )
    if as_json:
        json.dump(result, out, indent=2)
        out.write("\n")
    else:
        out.write(render_text(result))
    code = result["exit_code"]
    return code if isinstance(code, int) else int(StatusCode.UNKNOWN)
