"""``run --once`` beside a running daemon: wait for the daemon's progress, never act.

In detail: docs/internals.md, section `gpuwatchd.cli.once`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from gpuwatchd.cli.humantime import duration as format_duration
from gpuwatchd.cli.process_kind import look_at_process
from gpuwatchd.cli.scan import ScanResult, scan_host
from gpuwatchd.core.checked import as_list, as_map
from gpuwatchd.core.escape import escape
from gpuwatchd.core.vocabulary import ExitCode
from gpuwatchd.decide.plan.decisions import pending_keys
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.verdict import NodeVerdict, OnceStep, once_progress
from gpuwatchd.events.words import JournalNamer, finding_label
from gpuwatchd.state.saved import SavedState, read_saved_state

MAX_PAUSE = 5.0  # seconds between two looks, whatever the policy's interval


def daemon_busy(
    state: Mapping[str, object], report: Mapping[str, object], verdict: NodeVerdict
) -> list[str]:
    """What the daemon, by its state file, still has to do about ``report``'s findings on the GPUs
    not clean by ``verdict``: one it has not seen yet, or one with a ladder, a window or a reset
    under way (:func:`pending_keys`). Empty: nothing it does will change those GPUs."""
    try:
        plan = PlanState.from_json(state.get("plan"))
    except ValueError:
        return ["the daemon's state cannot be read (yet)"]
    dirty = {g.uuid for g in verdict.gpus if not g.clean}
    keyed = {
        str(f.get("key")): f
        for f in map(as_map, as_list(report.get("findings")))
        if f.get("gpu") in dirty and isinstance(f.get("key"), str)
    }
    names = JournalNamer()  # as the daemon's own run --once says them
    return [
        f"{finding_label(key, names)}: not seen by the daemon yet"
        for key in sorted(set(keyed) - set(plan.seen))
    ] + [f"{finding_label(key, names)}: under way" for key in pending_keys(plan, keyed)]


def reset_under_way(state: Mapping[str, object]) -> str | None:
    """The GPU of a reset the daemon is running (its progress record names it ``uuid``) or
    has decided on (``gpu``), from its state file."""
    progress = as_map(state.get("reset_in_progress"))
    flight = as_map(as_map(state.get("plan")).get("reset_in_flight"))
    for record, key in ((progress, "uuid"), (flight, "gpu")):
        if record:
            return str(record.get(key) or "a GPU")
    return None


def active_ladders(state: Mapping[str, object]) -> int:
    ladders = as_map(as_map(state.get("plan")).get("ladders"))
    return sum(1 for lad in ladders.values() if as_map(lad).get("status") == "active")


def _still_running(policy: Policy, state: Mapping[str, object]) -> bool:
    """Whether the PID the state names is gpuwatchd now; unknown (no PID, unreadable) counts
    as running: only a PID known gone or reused lets the waiter go on alone."""
    pid = SavedState(state).daemon_pid
    return pid is None or look_at_process(policy.proc_root, pid) in ("gpuwatchd", "unknown")


def wait_for_daemon(
    policy: Policy,
    timeout: float,
    *,
    scan: Callable[[Policy], ScanResult] = scan_host,
    peek: Callable[[], Mapping[str, object]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    out: TextIO = sys.stderr,
    running: Callable[[Mapping[str, object]], bool] | None = None,
) -> int | None:
    """Exit 0 as soon as the daemon has nothing left under way (:func:`daemon_busy`) and every
    GPU is clean; 75 naming what is left when that will not change, or at the timeout; 69 when
    NVML is unavailable; None when the daemon has stopped meanwhile (the caller may go on alone).
    Never signals, resets or writes anything. ``running(state)`` says whether the instance
    that wrote ``state`` still runs (default: its PID is gpuwatchd now)."""
    read_state = peek or (lambda: read_saved_state(policy.state_dir).data)
    still_running = running or (lambda saved: _still_running(policy, saved))
    started = clock()
    state = read_state()
    out.write(
        f"gpuwatchd: the daemon (pid {SavedState(state).daemon_pid or '?'}) is running; "
        f"waiting up to {format_duration(timeout)} for it to clean this node\n"
    )
    left: list[str] = []
    while True:
        resetting = reset_under_way(state)
        if resetting is not None:
            left = [f"a reset of {resetting} under way"]
        else:
            result = scan(policy)
            verdict = result.verdict
            if result.report is None or result.error is not None:
                out.write(f"gpuwatchd: {result.error or 'NVIDIA driver/NVML not available'}\n")
                return ExitCode.UNAVAILABLE
            if result.wedged or verdict is None or verdict.unavailable is not None:
                why = verdict.unavailable if verdict is not None else None
                out.write(f"gpuwatchd: {why or 'NVML did not answer within nvml_timeout'}\n")
                return ExitCode.UNAVAILABLE
            busy = daemon_busy(state, result.report, verdict)
            step, left = once_progress(verdict, busy, result.state_unread)
            waited = format_duration(max(0.0, clock() - started))
            if step is OnceStep.DONE:
                out.write(f"gpuwatchd: clean: every GPU, nothing left to act on (after {waited})\n")
                return ExitCode.OK
            if step is OnceStep.STUCK:
                out.write(
                    f"gpuwatchd: not clean, and nothing the daemon does will change it "
                    f"(after {waited}): {escape('; '.join(left))}\n"
                )
                return ExitCode.TEMPFAIL
        remaining = started + timeout - clock()
        if remaining <= 0:
            break
        sleep(min(policy.interval, MAX_PAUSE, remaining))
        state = read_state()
        if not still_running(state):
            return None
    ladders = active_ladders(state)
    out.write(
        f"gpuwatchd: timed out after {format_duration(timeout)}: {escape('; '.join(left))} "
        f"(daemon pid {SavedState(state).daemon_pid or '?'}, {ladders} ladder(s) active)\n"
    )
    return ExitCode.TEMPFAIL
