"""``gpuwatchd status``: what the daemon is doing, read from its state file, changing nothing.

In detail: docs/internals.md, section `gpuwatchd.cli.status`.
"""

from __future__ import annotations

import enum
import json
import sys
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from gpuwatchd.act.evidence import list_evidence
from gpuwatchd.cli.humantime import duration
from gpuwatchd.cli.process_kind import look_at_process
from gpuwatchd.cli.status_text import render_text
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.checked import as_count, as_flag, as_list, as_map, as_number, as_one_of, as_text
from gpuwatchd.core.codec import pick
from gpuwatchd.core.model import as_int
from gpuwatchd.decide.policy import Policy
from gpuwatchd.state.directory import StateDir
from gpuwatchd.state.saved import SavedState, read_saved_state
from gpuwatchd.state.status_document import (
    ACTION,
    CLEAR_LATCHES,
    DOCUMENT_FORMAT,
    GPU,
    LADDER_OF,
    LADDER_STATE,
    MAX_ACTIONS,
    NVML,
    REASON,
    REJECTED,
    SPARE,
    VERDICT,
    build_document,
    optional,
)

STATUS_FORMAT = 1  # the "format" of ``status --json``
# The daemon rewrites ``status.last_poll`` at least once a minute even when nothing else changed
# (daemon.py, STATUS_REFRESH), so the saved time may lag a live daemon by that much plus a poll.
STATUS_REFRESH = 60.0
STALE_POLLS = 3  # stale: no sign of life for a refresh plus this many intervals (and NVML)...
STALE_MIN = 120.0  # ...and never sooner than this many seconds
MAX_INTERVAL = 3600.0  # the most ``interval`` config/keys.py allows: a larger one is no daemon's
MAX_LISTED = 64  # evidence files listed (the daemon keeps 20: act/evidence.py)


class StatusCode(enum.IntEnum):
    """``gpuwatchd status`` exit codes (LSB init-script status convention, plus 1)."""

    RUNNING = 0  # running and healthy (paused or dry-run included: those are choices)
    ATTENTION = 1  # running, but a latch, the breaker, NVML, the policy or a stuck target
    NOT_RUNNING = 3  # no state, the PID is gone or not gpuwatchd, another boot, stale
    UNKNOWN = 4  # the state cannot be read (permission) or is not a state file


def describe(
    saved: Mapping[str, object] | None,
    *,
    policy: Policy,
    now_wall: float,
    now_monotonic: float | None = None,
    boot_id: str | None = None,
    process: str | None = None,
    read_error: str | None = None,
    evidence: list[dict[str, object]] | None = None,
) -> dict[str, object]:
    """The ``status --json`` document for a saved state (None: there is none) at ``now_wall``
    (module docstring). ``process``: what ``/proc/PID`` showed of the status section's
    PID (:func:`look_at_process`; "unknown" or None: a recent poll alone says it runs).
    ``read_error``: why the state could not be read (exit 4). ``now_monotonic`` places the
    deadlines of a state older than the document (:func:`_older_state`). ``evidence``: the
    evidence files, oldest first (None: they could not be listed)."""
    data = as_map(saved)
    status = as_map(data.get("status"))
    state_boot = as_text(data.get("boot_id"))
    same_boot = None if state_boot is None or boot_id is None else state_boot == boot_id
    doc: Mapping[str, object] = as_map(status.get("document"))
    clock: str | None = "daemon"
    if as_int(doc.get("format")) != DOCUMENT_FORMAT:
        doc, clock = _older_state(saved, policy, now_wall, now_monotonic, same_boot=same_boot)

    life = _signs_of_life(data, status, policy, now_wall)
    pid = SavedState(data).daemon_pid
    why_not = read_error or _why_not_running(
        saved is not None, same_boot, pid, process, life, state_dir=policy.state_dir
    )
    running = None if read_error is not None else why_not is None
    attention = _texts(doc.get("attention"))
    code, health = _health(read_error, running, attention)
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
            "started": life.started,
            "interval": life.interval,
            "last_poll": life.last_poll,
            "last_poll_age": None if life.last_poll is None else now_wall - life.last_poll,
            "stale_after": life.stale_after,
            "saved_at": as_number(data.get("saved_at")),
            "same_boot": same_boot,
        },
        **_document_sections(doc, clock, now_wall),
        "evidence": evidence,
    }


class _Life(NamedTuple):
    """When the saved state last showed the daemon alive, and how old that may be."""

    last_poll: float | None
    started: float | None
    interval: float
    stale_after: float
    age: float | None  # since the last sign of life; None: there is none


def _signs_of_life(
    data: Mapping[str, object],
    status: Mapping[str, object],
    policy: Policy,
    now_wall: float,
) -> _Life:
    """The saved state's last sign of life (the last poll, the last step of a reset, or the
    start before a first poll) and how old it may be before the daemon counts as stale."""
    record = data.get("reset_in_progress")
    reset_since = as_number(as_map(record).get("since")) if isinstance(record, Mapping) else None
    last_poll = as_number(status.get("last_poll"))
    started = as_number(status.get("started"))
    signs = [last_poll, reset_since, started if last_poll is None else None]
    last_sign = max((t for t in signs if t is not None), default=None)
    age = None if last_sign is None else now_wall - last_sign
    interval = as_number(status.get("interval"))  # the daemon's own, when it wrote one
    if interval is None or not 0 < interval <= MAX_INTERVAL:
        interval = policy.interval
    stale_after = max(STATUS_REFRESH + STALE_POLLS * interval + policy.nvml_timeout, STALE_MIN)
    if isinstance(record, Mapping):  # a reset holds the loop: each step may take its timeout
        reset = policy.reset
        hooks = sum(h.timeout for h in (*reset.drain, *reset.before, *reset.after))
        stale_after += reset.timeout + hooks
    return _Life(last_poll, started, interval, stale_after, age)


def _health(
    read_error: str | None, running: bool | None, attention: list[str]
) -> tuple[StatusCode, str]:
    if read_error is not None:
        return StatusCode.UNKNOWN, "unknown"
    if not running:
        return StatusCode.NOT_RUNNING, "not-running"
    if attention:
        return StatusCode.ATTENTION, "attention"
    return StatusCode.RUNNING, "ok"


def _document_sections(
    doc: Mapping[str, object], clock: str | None, now_wall: float
) -> dict[str, object]:
    """The status document's sections as ``status --json`` shows them, each value checked, its
    due times placed from ``now_wall``."""
    kill_cap = pick(doc.get("kill_cap"), _KILL_CAP)
    breaker = pick(doc.get("circuit_breaker"), _BREAKER)
    return {
        **pick(doc, _MODES),
        "kill_cap": kill_cap,
        "circuit_breaker": breaker,
        "clear_latches": CLEAR_LATCHES if kill_cap["latched"] or breaker["open"] else None,
        "nvml": pick(doc.get("nvml"), NVML),
        "spares": [s for s in _rows(doc.get("spares"), SPARE, 64) if s["target"] is not None],
        "gpus": as_count(doc.get("gpus")),
        "findings": as_count(doc.get("findings")),
        "verdict": optional(doc.get("verdict"), _VERDICT),
        "policy": pick(doc.get("policy"), _POLICY),
        "clock": clock,
        "document": as_number(doc.get("written_at")),
        "ladders": [_due_in(lad, now_wall) for lad in _rows(doc.get("ladders"), _LADDER, 1024)],
        "pending": [_due_in(p, now_wall) for p in _rows(doc.get("pending"), _PENDING, 1024)],
        "recent_actions": _rows(doc.get("recent_actions"), ACTION, MAX_ACTIONS, newest=True),
        "resets": _resets(doc.get("resets"), now_wall),
    }


def _older_state(
    saved: Mapping[str, object] | None,
    policy: Policy,
    now_wall: float,
    now_monotonic: float | None,
    *,
    same_boot: bool | None,
) -> tuple[Mapping[str, object], str | None]:
    """The status document of a state written before this reader's (a daemon not restarted
    after an upgrade), by the daemon's own :func:`build_document`; its monotonic times placed
    by the daemon's clock pair (``status.monotonic``, ``status.last_poll``) when it wrote one,
    else by this host's clock in the same boot, else not at all."""
    if saved is None:
        return {}, None
    status = as_map(saved.get("status"))
    daemon_mono, last_poll = as_number(status.get("monotonic")), as_number(status.get("last_poll"))
    monotonic: float | None = None
    clock: str | None = None
    if daemon_mono is not None and last_poll is not None:
        monotonic, clock = daemon_mono + (now_wall - last_poll), "daemon"
    elif same_boot is True and now_monotonic is not None:
        monotonic, clock = now_monotonic, "local"
    doc = build_document(saved, policy=policy, wall=now_wall, monotonic=monotonic)
    return {**doc, "written_at": None}, clock  # no document was written


def _why_not_running(
    present: bool,
    same_boot: bool | None,
    pid: int | None,
    process: str | None,
    life: _Life,
    *,
    state_dir: str,
) -> str | None:
    age, stale_after = life.age, life.stale_after
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


# --- the document's values, each checked: a malformed one is unknown ---------------------------

_Check = Callable[[object], object]


def _texts(value: object) -> list[str]:
    return [v for v in as_list(value)[:64] if isinstance(v, str)]


def _rows(
    raw: object, spec: Mapping[str, _Check], limit: int, *, newest: bool = False
) -> list[dict[str, object]]:
    items = as_list(raw)
    chosen = items[-limit:] if newest else items[:limit]
    return [pick(item, spec) for item in chosen]


_MODES: Mapping[str, _Check] = {
    "mode": as_one_of("enforcing", "dry-run"),
    "effective_mode": as_one_of("enforcing", "dry-run", "paused", "forced-dry-run"),
    "paused": as_flag,
    "paused_reason": as_text,
    "paused_until": as_number,
}
_KILL_CAP: Mapping[str, _Check] = {
    "latched": as_flag,
    "reason": as_text,
    "users_latched": _texts,
    "signalled_last_hour": as_count,
    "max_per_hour": as_count,
    "max_per_user_hour": as_count,
    "max_per_poll": as_count,
}
_BREAKER: Mapping[str, _Check] = {"open": as_flag, "failures": as_count, "max_failures": as_count}
_GPU: Mapping[str, _Check] = {**GPU, **REASON, "reasons": as_count, "reset_blockers": as_count}
_LADDER: Mapping[str, _Check] = {
    "target": as_text,
    **LADDER_OF,
    "label": as_text,
    **LADDER_STATE,
    "step": as_count,
    "steps": as_count,
    "next": as_text,
    "scheduled": as_flag,
    "due": as_number,
    "started": as_number,
}
_PENDING: Mapping[str, _Check] = {"finding": as_text, "label": as_text, "due": as_number}
_IN_PROGRESS: Mapping[str, _Check] = {
    "gpu": as_text, "pci_bus_id": as_text, "step": as_text, "since": as_number,
    "instance": as_text, "gi": as_int,
}  # fmt: skip
_RESET_GPU: Mapping[str, _Check] = {
    "gpu": as_text,
    "last": as_number,
    "last_dry_run": as_number,
    "history": lambda raw: [n for v in as_list(raw)[:256] if (n := as_number(v)) is not None],
    "in_window": as_count,
    "cooldown_ends": as_number,
    "limit_lifts": as_number,
    "never": as_flag,
}
# Each GPU clean for a new job, as the daemon judged it (decide/verdict.py).
_VERDICT: Mapping[str, _Check] = {**VERDICT, "gpus": lambda raw: _rows(raw, _GPU, 256)}
_POLICY: Mapping[str, _Check] = {
    "files": lambda raw: _texts(raw) if isinstance(raw, list) else None,
    "rejected": lambda raw: optional(raw, REJECTED),
}
_RESETS: Mapping[str, _Check] = {
    "cooldown": as_number,
    "max_resets": as_count,
    "window": as_number,
    "in_progress": lambda raw: optional(raw, _IN_PROGRESS),
    "gpus": lambda raw: _rows(raw, _RESET_GPU, 256),
}


def _due_in(row: dict[str, object], now_wall: float) -> dict[str, object]:
    due = as_number(row.get("due"))
    row["due_in"] = None if due is None else due - now_wall
    return row


def _resets(raw: object, now_wall: float) -> dict[str, object]:
    resets = pick(raw, _RESETS)
    for row in resets["gpus"]:
        ends, lifts = as_number(row["cooldown_ends"]), as_number(row["limit_lifts"])
        row["cooldown_left"] = None if ends is None else max(0.0, ends - now_wall)
        limit_left = 0.0 if lifts is None else max(0.0, lifts - now_wall)
        row["limit_left"] = None if row["never"] else limit_left
    return resets


# --- the edge: files, /proc, clocks -----------------------------------------------------------


def read_evidence(state_dir: str) -> list[dict[str, object]] | None:
    """The evidence files the daemon kept in ``state_dir``, oldest first, each as its name
    tells it, with its path; None when the folder cannot be listed (or is not trusted)."""
    try:
        with StateDir.open(state_dir) as folder:
            return [
                {**entry.to_json(), "path": folder.join(entry.name)}
                for entry in list_evidence(folder)[-MAX_LISTED:]
            ]
    except OSError:
        return None


def status_command(policy: Policy, *, as_json: bool) -> int:
    saved = read_saved_state(policy.state_dir)  # the problem: why it cannot be read (exit 4)
    pid = saved.daemon_pid
    result = describe(
        dict(saved.data) if saved.found else None,
        policy=policy,
        now_wall=time.time(),
        now_monotonic=time.monotonic(),
        boot_id=ProcFS(policy.proc_root).boot_id(),
        process=None if pid is None else look_at_process(policy.proc_root, pid),
        read_error=saved.problem,
        evidence=read_evidence(policy.state_dir),
    )
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        sys.stdout.write(render_text(result))
    code = result["exit_code"]
    return code if isinstance(code, int) else int(StatusCode.UNKNOWN)
