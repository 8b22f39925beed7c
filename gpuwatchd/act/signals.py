"""Signals through pidfds to exactly the process that was judged, and waiting on its exit.

It decides nothing, and never signals by bare PID (``os.kill``): between the judgement and the
signal a PID can be reused, and the pidfd is what closes that race.

In detail: docs/internals.md, section `gpuwatchd.act.signals`.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuwatchd.core.model import ProcessIdentity
from gpuwatchd.core.procstat import StatFields, parse_stat
from gpuwatchd.core.vocabulary import SignalOutcome


def read_stat(proc_root: str, pid: int) -> StatFields | None:
    """``<proc_root>/PID/stat`` parsed; None if unknown."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), "rb") as stat_file:
            return parse_stat(stat_file.read().decode("utf-8", "replace"))
    except OSError:
        return None


def stat_start_ticks(proc_root: str, pid: int) -> tuple[int, str] | None:
    """``(start ticks, state letter)`` of ``PID`` from ``<proc_root>/PID/stat``; None if unknown."""
    fields = read_stat(proc_root, pid)
    return None if fields is None else (fields.starttime, fields.state)


@dataclass(frozen=True)
class SignalResult:
    """The outcome of :meth:`Signaller.send`, a sentence for the log, and the state letter
    read right before the signal (``"D"``: it cannot die yet; None: unread)."""

    outcome: SignalOutcome
    detail: str
    state: str | None = None


def _signal_number(name: str) -> int | None:
    """``"SIGTERM"``, ``"TERM"`` or ``"sigterm"`` → 15; None for anything that is no signal."""
    upper = "SIG" + name.strip().upper().removeprefix("SIG")
    if upper.startswith("SIG_"):
        return None  # SIG_IGN / SIG_DFL are handlers, not signals
    member = signal.Signals.__members__.get(upper)
    return None if member is None else int(member)


class Signaller:
    """Sends signals through pidfds and waits on them; one per daemon, not thread-safe. A pidfd
    is kept until :meth:`wait` reports its exit, or :meth:`forget` / :meth:`close`.
    ``as_judged``: :meth:`gpuwatchd.collect.collector.Collector.as_judged` (docs/internals.md)."""

    def __init__(
        self,
        proc_root: str = "/proc",
        *,
        as_judged: Callable[[ProcessIdentity], str | None] | None = None,
    ) -> None:
        self._proc_root = proc_root
        self._as_judged = as_judged
        self._kept: dict[ProcessIdentity, int] = {}

    def send(self, identity: ProcessIdentity, signal_name: str, *, dry_run: bool) -> SignalResult:
        """Send ``signal_name`` to exactly the process ``identity`` names, or say why not."""
        pid = identity.pid
        if pid <= 2 or pid == os.getpid():
            return SignalResult(
                SignalOutcome.FAILED, f"refused: PID {pid} is below the safety floor"
            )
        number = _signal_number(signal_name)
        if number is None:
            return SignalResult(SignalOutcome.FAILED, f"unknown signal {signal_name!r}")
        pidfd_open = getattr(os, "pidfd_open", None)
        send_signal = getattr(signal, "pidfd_send_signal", None)
        if pidfd_open is None or send_signal is None:
            # Never fall back to os.kill(pid): that is exactly the PID-reuse race.
            return SignalResult(
                SignalOutcome.FAILED,
                "this Python/kernel has no pidfd support (needs Linux >= 5.3, Python >= 3.9); "
                "refusing to signal by bare PID",
            )

        kept = self._kept.get(identity)
        if kept is not None and _readable(kept):
            # Our pidfd says it has exited. The PID may already be reused, so /proc is only
            # consulted to tell a zombie from a reaped process.
            self.forget(identity)
            if stat_start_ticks(self._proc_root, pid) == (identity.start_ticks, "Z"):
                return SignalResult(SignalOutcome.ZOMBIE, _zombie_detail(pid), "Z")
            return SignalResult(SignalOutcome.GONE, f"PID {pid} has exited")

        pidfd = kept
        if pidfd is None:
            try:
                pidfd = pidfd_open(pid)
            except OSError as err:
                if err.errno == errno.ESRCH:
                    return SignalResult(SignalOutcome.GONE, f"PID {pid} does not exist")
                return SignalResult(
                    SignalOutcome.FAILED, f"pidfd_open({pid}) failed: {err.strerror or err}"
                )

        # The pidfd is open: the process it names cannot change any more. Now check that it
        # is the one that was judged.
        state = self._recheck(identity, pidfd)
        if isinstance(state, SignalResult):
            self._drop(identity, pidfd)
            return state

        try:
            send_signal(pidfd, 0 if dry_run else number)
        except OSError as err:
            self._drop(identity, pidfd)
            return _send_failed(pid, err, state)
        self._kept[identity] = pidfd
        what = f"{signal.Signals(number).name} to PID {pid}"
        if dry_run:
            return SignalResult(SignalOutcome.DRY_RUN, f"would send {what} (dry-run)", state)
        return SignalResult(SignalOutcome.DELIVERED, f"sent {what}", state)

    def wait(self, timeout: float) -> list[ProcessIdentity]:
        """Wait up to ``timeout`` seconds for any kept process to exit (a zombie has): every
        identity exited by then, forgotten; ``[]`` at once when nothing is kept."""
        if not self._kept:
            return []
        by_fd = {fd: identity for identity, fd in self._kept.items()}
        poller = select.poll()
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            remaining = deadline - time.monotonic()
            events = poller.poll(max(0, int(remaining * 1000 + 0.999)))  # PEP 475: no EINTR
            if events or remaining <= 0:
                break
        exited = [by_fd[fd] for fd, _mask in events if fd in by_fd]
        for identity in exited:
            self.forget(identity)
        return sorted(exited)

    def forget(self, identity: ProcessIdentity) -> None:
        """Stop watching ``identity`` (closes its pidfd, if one is kept)."""
        fd = self._kept.pop(identity, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for identity in list(self._kept):
            self.forget(identity)

    def fileno_list(self) -> list[int]:
        """The kept pidfds, for a caller that polls them in its own loop."""
        return list(self._kept.values())

    def __enter__(self) -> Signaller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recheck(self, identity: ProcessIdentity, pidfd: int) -> SignalResult | str:
        """Whether the process ``pidfd`` names is the one ``identity`` names, alive and as it
        was judged: its state letter when it is; else why not (the caller drops its pidfd)."""
        pid = identity.pid
        current = stat_start_ticks(self._proc_root, pid)
        if current is None:
            if _readable(pidfd):  # the pidfd, not an unread stat, says whether it lives
                return SignalResult(SignalOutcome.GONE, f"PID {pid} vanished from /proc")
            return SignalResult(
                SignalOutcome.FAILED, f"PID {pid}: its /proc stat is unreadable; nothing sent"
            )
        ticks, state = current
        if ticks != identity.start_ticks:
            return SignalResult(
                SignalOutcome.REUSED,
                f"PID {pid} now belongs to another process (start ticks {ticks}, "
                f"expected {identity.start_ticks}); nothing sent",
                state,
            )
        if state == "Z":
            return SignalResult(SignalOutcome.ZOMBIE, _zombie_detail(pid), state)
        if state in ("X", "x"):
            return SignalResult(SignalOutcome.GONE, f"PID {pid} is dead", state)
        changed = None if self._as_judged is None else self._as_judged(identity)
        if changed is not None:
            return SignalResult(
                SignalOutcome.REUSED,
                f"PID {pid} is no longer as it was judged ({changed} changed); nothing sent, "
                "it is judged again next poll",
                state,
            )
        return state

    def _drop(self, identity: ProcessIdentity, pidfd: int) -> None:
        if self._kept.get(identity) == pidfd:
            self.forget(identity)
        else:
            os.close(pidfd)


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _send_failed(pid: int, err: OSError, state: str) -> SignalResult:
    """What a failed ``pidfd_send_signal`` means: gone (ESRCH), denied (EPERM), else failed."""
    if err.errno == errno.ESRCH:
        return SignalResult(SignalOutcome.GONE, f"PID {pid} exited", state)
    if err.errno == errno.EPERM:
        denied = f"not permitted to signal PID {pid} (missing CAP_KILL?)"
        return SignalResult(SignalOutcome.DENIED, denied, state)
    failed = f"pidfd_send_signal({pid}) failed: {err.strerror or err}"
    return SignalResult(SignalOutcome.FAILED, failed, state)


def _zombie_detail(pid: int) -> str:
    return f"PID {pid} is a zombie; not signalled (its parent has to reap it)"
