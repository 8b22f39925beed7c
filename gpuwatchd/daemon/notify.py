"""systemd's notification protocol: READY/RELOADING/STOPPING, the watchdog, the STATUS line.

This module owns what the daemon tells systemd (``sd_notify``, only when ``NOTIFY_SOCKET`` asks
for it): the watchdog's period, feeding it while slow or long work runs, and the one-line
``systemctl status`` text. It decides nothing and reads no file.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gpuwatchd.core.checked import decimal
from gpuwatchd.core.vocabulary import LadderStatus
from gpuwatchd.decide.verdict import UNREADABLE
from gpuwatchd.engine.edges import PollReport
from gpuwatchd.events.words import short

T = TypeVar("T")
FEED_EVERY = 1.0  # seconds between watchdog pings while slow work runs
START_EXTENSION = 60.0  # seconds each ping of slow work before READY=1 adds to the start timeout


class Notifier:
    """sd_notify when systemd asked for it (NOTIFY_SOCKET set); silent otherwise."""

    def __init__(self) -> None:
        self._notifier: Any = None
        if os.environ.get("NOTIFY_SOCKET"):
            import sdnotify

            self._notifier = sdnotify.SystemdNotifier()

    def notify(self, message: str) -> None:
        if self._notifier is not None:
            # sdnotify sends the text as Latin-1 and drops it whole on any character past it;
            # systemd reads UTF-8: the UTF-8 bytes are handed over as the Latin-1 they spell
            # (a lone surrogate, from a file name that is not UTF-8, as its escape).
            self._notifier.notify(message.encode(errors="backslashreplace").decode("latin-1"))


def watchdog_slice() -> float:
    """How often the watchdog wants feeding: a third of ``WATCHDOG_USEC``; 5 s without one (or
    with one that is not 1 to 20 ASCII digits, or 0)."""
    usec = decimal(os.environ.get("WATCHDOG_USEC", ""))
    return usec / 1e6 / 3 if usec else 5.0


class WatchdogPinger:
    """Feeds the watchdog from work that reports its own progress (the holder scan calls it
    after each process): ``WATCHDOG=1`` at most every ``every`` seconds, and only from the
    process that made it (a forked scan worker's ping would be refused: ``NotifyAccess=main``).
    No thread: work stuck in one call pings nothing, so systemd still sees a hung loop."""

    def __init__(
        self,
        ping: Callable[[], None],
        every: float = FEED_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ping = ping  # sends WATCHDOG=1
        self.every = every
        self.clock = clock
        self.pid = os.getpid()
        self.last = clock()

    def __call__(self) -> None:
        now = self.clock()
        if now - self.last >= self.every and os.getpid() == self.pid:
            self.last = now
            self.ping()


def keep_watchdog_fed(
    notifier: Notifier, work: Callable[[], T], every: float = FEED_EVERY, *, starting: bool = False
) -> T:
    """Run slow work (a reset, hooks) right here, on the loop's own thread, while a helper
    thread only feeds the watchdog: the work calls back into nothing from another thread.
    ``starting``: before READY=1, when the unit's start timeout runs (a reset resumed at start
    or begun by the first poll outlasts it): each ping, and the last, extends it by
    :data:`START_EXTENSION`, time for the rest of the first poll."""
    ping = (
        f"WATCHDOG=1\nEXTEND_TIMEOUT_USEC={START_EXTENSION * 1e6:.0f}" if starting else "WATCHDOG=1"
    )
    done = threading.Event()

    def feed() -> None:
        while not done.wait(every):
            notifier.notify(ping)

    feeder = threading.Thread(target=feed, name="gpuwatchd-watchdog", daemon=True)
    feeder.start()
    try:
        return work()
    finally:
        done.set()
        feeder.join()
        notifier.notify(ping)


def describe_status(report: PollReport, dry_run: bool) -> str:
    """The one-line ``systemctl status`` text, from one poll's report."""
    reading, state, verdict = report.snapshot.nvml, report.plan, report.verdict
    if not reading.available:  # the error is the worker's text: escaped, cut, one line
        return f"NVML unavailable: {short(reading.error or 'unknown error')} (retrying)"
    parts = [f"{_counted(len(reading.gpus), 'GPU')} watched"]
    if reading.wedged:
        parts.insert(0, "driver wedged")
    if lost := sum(1 for g in reading.gpus if g.lost):
        parts.append(f"{lost} lost (needs reboot)")
    if verdict is not None and verdict.unavailable is None:
        dirty = sum(1 for g in verdict.gpus if not g.clean)
        parts.append(f"{dirty} not clean" if dirty else "all clean")
    parts.append(_counted(len(report.assessment.findings), "finding"))
    statuses = [lad.status for lad in state.ladders.values()]
    parts.append(f"{_counted(statuses.count(LadderStatus.ACTIVE), 'action')} under way")
    if stuck := statuses.count(LadderStatus.STUCK):
        parts.append(f"{stuck} stuck in D state (needs drain/reboot)")
    if state.paused:
        parts.append("paused")
    if state.forced_dry_run:
        unreadable = (state.forced_reason or "").startswith(UNREADABLE)
        parts.append(
            f"{'saved state unreadable' if unreadable else 'kill cap reached'}: forced dry-run"
        )
    elif dry_run:
        parts.append("dry-run")
    if state.circuit_open:
        parts.append("resets stopped (circuit breaker)")
    return ", ".join(parts)


def _counted(count: int, thing: str) -> str:
    return f"{count} {thing}{'s' if count != 1 else ''}"
