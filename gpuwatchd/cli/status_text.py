"""``gpuwatchd status`` as text: the checked result of :func:`gpuwatchd.cli.status.describe`
in lines for people. Every value comes from it; nothing is read or worked out here. Pure."""

from __future__ import annotations

import functools
from collections.abc import Mapping

from gpuwatchd.cli.humantime import ago, counted, duration, shown, stamp, until
from gpuwatchd.core.checked import as_count, as_list, as_map, as_number
from gpuwatchd.core.escape import escape
from gpuwatchd.core.vocabulary import LadderStatus

_text = functools.partial(shown, unknown="unknown")  # every line is escaped as a whole


def _at(now: float, when: object) -> str:
    """A wall time as ``2026-01-02 03:04:05 (3m ago)``; unknown when it is not a number."""
    t = as_number(when)
    if t is None:
        return "unknown"
    shown = stamp(t)
    return ago(now - t) if shown == "?" else f"{shown} ({ago(now - t)})"


def _header(now: float, result: Mapping[str, object]) -> str:
    daemon = as_map(result.get("daemon"))
    if result.get("health") == "unknown":
        return f"gpuwatchd status unknown: {result.get('why_not_running')}"
    if not result.get("running"):
        saved = as_number(daemon.get("saved_at"))
        last = f"; state last saved {ago(now - saved)}" if saved is not None else ""
        return f"gpuwatchd is not running: {result.get('why_not_running')}{last}"
    started = as_number(daemon.get("started"))
    up = f", up {duration(now - started)}" if started is not None and now >= started else ""
    last_poll = as_number(daemon.get("last_poll"))
    poll = f", last poll {ago(now - last_poll)}" if last_poll is not None else ""
    return f"gpuwatchd is running: pid {daemon.get('pid')}{up}{poll}"


def _mode_line(now: float, result: Mapping[str, object]) -> str:
    mode, effective = result.get("mode"), result.get("effective_mode")
    configured = f"configured: {mode}" if mode else "configured mode unknown"
    if effective == "paused":
        reason = result.get("paused_reason")
        why = f" ({reason})" if reason else ""
        ends = as_number(result.get("paused_until"))
        lasts = (
            f"until {stamp(ends)} ({until(ends - now)}, ends by itself) or `gpuwatchd resume`"
            if ends is not None
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
    parts.append(f"step {_text(lad.get('step'))}/{_text(lad.get('steps'))}")
    status = lad.get("status")
    if status != LadderStatus.ACTIVE:
        return "  " + "  ".join(parts) + f": {_text(status)}"
    nxt = lad.get("next")
    what = "ends" if nxt == "end" else f"next {_text(nxt)}"
    due = "due (time unknown)" if lad.get("scheduled") else "due"
    when = due if lad.get("due_in") is None else until(lad["due_in"])  # seconds (describe)
    dry = " (dry-run)" if lad.get("dry_run") else ""
    return "  " + "  ".join(parts) + f": {what} {when}{dry}"


def _action_line(now: float, action: Mapping[str, object]) -> str:
    """``  5s ago: Sent SIGTERM to PID 4250 on GPU-1.`` (the catalogue's sentence)."""
    at = as_number(action.get("at"))
    when = ago(now - at) if at is not None else "unknown time"
    sentence = action.get("sentence")
    what = sentence if isinstance(sentence, str) else f"{_text(action.get('event'))}: unknown"
    return f"  {when}: {what}"


def _reset_lines(now: float, resets: Mapping[str, object]) -> list[str]:
    lines = []
    progress = resets.get("in_progress")
    if isinstance(progress, Mapping):
        since = as_number(progress.get("since"))
        when = f", since {ago(now - since)}" if since is not None else ""
        what = _text(progress.get("gpu"))
        if progress.get("instance") is not None:  # a MIG GPU instance's re-creation
            what = f"re-creation of MIG GPU instance {_text(progress.get('gi'))} of {what}"
        lines.append(f"  in progress: {what} at step {_text(progress.get('step'))}{when}")
    window = duration(resets.get("window"))
    for gpu in as_list(resets.get("gpus")):
        entry = as_map(gpu)
        parts = [f"last {_at(now, entry['last'])}"] if entry.get("last") is not None else []
        if entry.get("last_dry_run") is not None:
            parts.append(f"last dry-run {_at(now, entry['last_dry_run'])}")
        parts.append(
            f"{_text(entry.get('in_window'))} of {_text(resets.get('max_resets'))} "
            f"in the last {window}"
        )
        if entry.get("cooldown_left"):  # seconds, as describe worked them out
            parts.append(f"cooldown ends {until(entry['cooldown_left'])}")
        if entry.get("limit_left"):
            parts.append(f"limit lifts {until(entry['limit_left'])}")
        elif "limit_left" in entry and entry["limit_left"] is None:
            parts.append("max_resets is 0: never reset")
        lines.append(f"  {_text(entry.get('gpu'))}: " + "; ".join(parts))
        older = [t for t in as_list(entry.get("history")) if t != entry.get("last")]  # numbers
        if older:
            lines.append("    earlier: " + ", ".join(_at(now, t) for t in older[-5:]))
    return lines


def _latch_lines(result: Mapping[str, object]) -> list[str]:
    cap = as_map(result.get("kill_cap"))
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
        lines.append(f"          latched for {', '.join(map(str, users))}")
    breaker = as_map(result.get("circuit_breaker"))
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
    nvml = as_map(result.get("nvml"))
    error = f" ({nvml['error']})" if nvml.get("error") else ""
    since = (
        f" since {_at(now, nvml['since'])}"
        if nvml.get("state") != "ok" and nvml.get("since")
        else ""
    )
    lines = [
        f"NVML:     {_text(nvml.get('state'))}{since}{error}; "
        f"{counted(result.get('gpus'), 'GPU', 'unknown')}; "
        f"{counted(result.get('findings'), 'finding', 'unknown')}"
    ]
    for spare in as_list(result.get("spares")):
        row = as_map(spare)
        ends = as_number(row.get("until"))
        left = "" if ends is None else f" until {stamp(ends)} ({until(ends - now)})"
        why = f": {row['reason']}" if row.get("reason") else ""
        lines.append(f"spared:   {_text(row.get('target'))}{left}{why}")
    lines.extend(_verdict_lines(result.get("verdict")))
    policy = as_map(result.get("policy"))
    files = policy.get("files")
    shown = (", ".join(files) or "built-in defaults") if isinstance(files, list) else None
    lines.append(f"policy:   {_text(shown)}")
    rejected = policy.get("rejected")
    if isinstance(rejected, Mapping):
        what = "rejected at start" if rejected.get("at_start") is True else "files rejected"
        lines.append(
            f"          {what} {_at(now, rejected.get('at'))}: {_text(rejected.get('error'))}"
        )
        if rejected.get("at_start") is True:
            lines.append(f"          running {_text(rejected.get('running'))} instead")
    return lines


def _verdict_lines(raw: object) -> list[str]:
    """``GPUs:     3 clean; not clean: GPU 1 GPU-…: orphaned <why> (and 1 more)``."""
    verdict = as_map(raw)
    if not verdict:
        return []
    if verdict.get("clean") is None:
        return [f"GPUs:     not judged ({_text(verdict.get('error'))})"]
    gpus = [as_map(g) for g in as_list(verdict.get("gpus"))]
    clean = sum(1 for g in gpus if g.get("state") == "clean")
    lines = [f"GPUs:     {clean} of {len(gpus)} clean for a new job (as check-clean says)"]
    for gpu in gpus:
        if gpu.get("state") == "clean":
            continue
        count = as_count(gpu.get("reasons")) or 0
        more = f" (and {count - 1} more)" if count > 1 else ""
        lines.append(
            f"  not clean: GPU {_text(gpu.get('index'))} {_text(gpu.get('uuid'))}: "
            f"{_text(gpu.get('kind'))} {_text(gpu.get('reason'))}{more}"
        )
    return lines


def _work_lines(result: Mapping[str, object]) -> list[str]:
    ladders = [as_map(lad) for lad in as_list(result.get("ladders"))]
    active = [lad for lad in ladders if lad.get("status") == LadderStatus.ACTIVE]
    done = [lad for lad in ladders if lad.get("status") != LadderStatus.ACTIVE]
    lines = ["ladders in progress:" + ("" if active else " none")]
    lines.extend(_ladder_line(lad) for lad in active)
    if done:
        lines.append("finished ladders (target still alive, never signalled again):")
        lines.extend(_ladder_line(lad) for lad in done)
    pending = [as_map(p) for p in as_list(result.get("pending"))]
    if pending:
        lines.append("waiting (confirmation windows, post-action delays):")
        for item in pending:
            when = "due" if item.get("due_in") is None else until(item["due_in"])
            lines.append(f"  {_text(item.get('label') or item.get('finding'))}: {when}")
    return lines


EVIDENCE_SHOWN = 5  # the newest evidence files the text names (--json lists them all)


def _evidence_lines(raw: object) -> list[str]:
    """``evidence files (3, newest last):`` and the newest few: when, what, where."""
    if raw is None:
        return ["evidence files: unknown (state_dir not readable)"]
    files = [as_map(f) for f in as_list(raw)]
    lines = [f"evidence files ({len(files)}, newest last):" if files else "evidence files: none"]
    for entry in files[-EVIDENCE_SHOWN:]:
        gpu = f" of {_text(entry.get('gpu'))}" if entry.get("gpu") else ""
        dry = " (dry run)" if entry.get("dry_run") else ""
        lines.append(
            f"  {_text(entry.get('written'))} {_text(entry.get('action'))}{gpu}{dry}: "
            f"{_text(entry.get('path'))}"
        )
    return lines


def render_text(result: Mapping[str, object]) -> str:
    now = as_number(result.get("now")) or 0.0
    lines = [_header(now, result)]
    if result.get("state") == "present":
        if not result.get("running"):
            lines.append("last known state:")
        lines.append(_mode_line(now, result))
        paused = result.get("paused")
        lines.append(f"paused:   {_text(paused)}" + (" (ladders hold)" if paused else ""))
        lines.extend(_latch_lines(result))
        lines.extend(_health_lines(now, result))
        lines.extend(_work_lines(result))
        actions = [as_map(a) for a in as_list(result.get("recent_actions"))]
        lines.append("recent actions:" + ("" if actions else " none"))
        lines.extend(_action_line(now, a) for a in actions)
        resets = as_map(result.get("resets"))
        reset_lines = _reset_lines(now, resets)
        cooldown = duration(resets.get("cooldown"))
        lines.append(f"resets (cooldown {cooldown}):" + ("" if reset_lines else " none"))
        lines.extend(reset_lines)
        lines.extend(_evidence_lines(result.get("evidence")))
        attention = [str(a) for a in as_list(result.get("attention"))]
        if attention:
            lines.append("needs attention:")
            lines.extend(f"  - {a}" for a in attention)
    return "\n".join(escape(line) for line in lines) + "\n"
