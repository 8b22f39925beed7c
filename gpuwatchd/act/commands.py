"""Running admin-configured commands (hooks, ``nvidia-smi``): argv only, no shell, a session of
their own, a deadline, the output's tail kept, and a keeper (:mod:`gpuwatchd.act.reaper`) that
ends everything a command started when it ends.

In detail: docs/internals.md, section `gpuwatchd.act.commands`.
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuwatchd.act.signals import read_stat
from gpuwatchd.core.checked import as_count
from gpuwatchd.core.codec import decode_json_object
from gpuwatchd.core.model import as_int
from gpuwatchd.decide.argv import format_argv
from gpuwatchd.decide.policy import Hook

COMMAND_ID_VARIABLE = "GPUWATCHD_COMMAND_ID"  # marks a command and its descendants
# systemd's notification socket and watchdog, given to the daemon alone (sd_notify(3)): a
# command's sd_notify would speak for the daemon, or be refused and logged (NotifyAccess=main).
_DAEMONS_OWN = frozenset({"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"})
OUTPUT_LIMIT = 64 * 1024  # bytes of a command's output kept (the tail)
KEEPER_FILE = str(Path(__file__).resolve().with_name("reaper.py"))
_TICK = 0.05  # poll interval when pidfds are unavailable
_DRAIN_GRACE = 0.2  # seconds to collect output after the command exits (grandchildren may hold it)
_REAP_AFTER_KILL = 5.0  # seconds to wait for a SIGKILLed keeper to be reaped
_ENVIRON_BYTES = 6 << 20  # exec's most for arguments and environment (3/4 of _STK_LIM, 8 MiB)
_KEEPER_MARGIN = 8.0  # seconds past the timeout a keeper may take to end its tree (reaper.py)


@dataclass(frozen=True)
class CommandResult:
    """How one command ran. ``returncode``: None when it could not start or be reaped (stuck
    in the kernel), negative for a signal. ``output``: stdout and stderr, the last
    :data:`OUTPUT_LIMIT` bytes. ``error``: what went wrong on our side. ``cancelled``: the
    daemon stopped while it ran. ``leftovers``: processes it left running (killed at its
    deadline, or when the daemon stops). ``unkillable``: processes of its tree still there
    after SIGKILL (stuck in the kernel; ``error`` says so)."""

    argv: tuple[str, ...]
    returncode: int | None
    output: str
    timed_out: bool
    duration: float
    error: str | None
    cancelled: bool = False
    leftovers: int = 0
    unkillable: int = 0

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and self.error is None

    def describe(self) -> str:
        """One line for logs and reasons: how it ended."""
        if self.error is not None and self.returncode is None and not self.timed_out:
            text = self.error
        elif self.cancelled:
            text = "cancelled: the daemon stopped; its processes were killed"
        elif self.timed_out:
            text = f"timed out after {self.duration:.1f}s; its processes were killed"
            text = text if self.error is None else f"{text}; {self.error}"
        elif self.returncode is not None and self.returncode < 0:
            text = f"killed by signal {-self.returncode}"
        else:
            text = f"exit {self.returncode}"
        if self.leftovers and not (self.timed_out or self.cancelled):
            text += f"; it left {self.leftovers} process(es) running (killed at its deadline)"
        return text


class CommandScope:
    """The commands of one daemon, for ending them all when it stops: :meth:`cancel` ends
    every running command (their keepers watch :meth:`fileno`), every lingering keeper
    (:meth:`adopt`) and every later command. Thread-safe: hooks run on another thread."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self.cancelled = False
        self._lingering: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self._read

    def close(self) -> None:
        """Close the scope's pipe; only for a scope that never runs a command."""
        os.close(self._read)
        os.close(self._write)

    def adopt(self, keeper: subprocess.Popen[bytes]) -> None:
        """Keep ``keeper``, whose command exited leaving processes that run on."""
        with self._lock:
            self._lingering = [p for p in self._lingering if p.poll() is None] + [keeper]
            if self.cancelled:
                _stop_keeper(keeper)

    @property
    def lingering(self) -> int:
        """How many finished commands still have processes running (before their deadline)."""
        with self._lock:
            self._lingering = [p for p in self._lingering if p.poll() is None]
            return len(self._lingering)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for what commands left running; True: none left."""
        until = time.monotonic() + timeout
        while self.lingering:
            if time.monotonic() >= until:
                return False
            time.sleep(_TICK)
        return True

    def cancel(self) -> int:
        """End every command of this scope, now and from now on: running ones and what
        finished ones left running (their process trees get SIGKILL). Waits up to
        ``_KEEPER_MARGIN`` seconds for the lingering keepers; returns how many processes' trees
        it ended that finished commands had left running."""
        with self._lock:
            self.cancelled = True
            with contextlib.suppress(OSError):
                os.write(self._write, b"x")
            keepers = [p for p in self._lingering if p.poll() is None]
            for keeper in keepers:
                _stop_keeper(keeper)
        until = time.monotonic() + _KEEPER_MARGIN
        for keeper in keepers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                keeper.wait(max(0.0, until - time.monotonic()))
        return len(keepers)


def _stop_keeper(keeper: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        keeper.send_signal(signal.SIGTERM)  # an unreaped child of ours: no reused PID


class _Tail:
    """Keeps the last ``limit`` bytes written to it and counts what it dropped."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        self._data += chunk
        excess = len(self._data) - self._limit
        if excess > 0:
            del self._data[:excess]
            self.dropped += excess

    def text(self) -> str:
        body = self._data.decode("utf-8", "replace")
        if self.dropped:
            return f"[... {self.dropped} bytes dropped ...]\n{body}"
        return body


def run_command(
    argv: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    scope: CommandScope | None = None,
) -> CommandResult:
    """Run ``argv`` (no shell) under a keeper within ``timeout`` seconds (docs/internals.md);
    ``env``: the complete environment (None: the daemon's)."""
    args = tuple(argv)
    started = time.monotonic()
    if not args:
        return CommandResult(args, None, "", False, 0.0, "empty command")
    if scope is not None and scope.cancelled:
        return CommandResult(args, None, "", False, 0.0, "not run: the daemon is stopping", True)
    marker = f"{COMMAND_ID_VARIABLE}={uuid.uuid4().hex}"
    # A hook written in Python must not import code from wherever the daemon was started.
    child_env = {
        k: v
        for k, v in (os.environ if env is None else env).items()
        if not k.startswith("PYTHON") and k not in _DAEMONS_OWN
    }
    child_env[COMMAND_ID_VARIABLE] = marker.partition("=")[2]
    status_read, status_write = os.pipe()
    keeper_argv = [sys.executable, "-I", "-S", KEEPER_FILE, str(status_write), repr(timeout), "--"]
    try:
        proc = subprocess.Popen(
            [*keeper_argv, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            pass_fds=(status_write,),
            cwd="/",  # never the caller's folder, which may be anyone's
            env=child_env,
        )
    except (OSError, ValueError) as err:  # ValueError: an argument no exec call can take
        os.close(status_read)
        reason = (err.strerror if isinstance(err, OSError) else None) or str(err)
        return CommandResult(
            args, None, "", False, time.monotonic() - started, f"cannot run {args[0]}: {reason}"
        )
    finally:
        os.close(status_write)
    deadline = started + timeout + _KEEPER_MARGIN
    try:
        keeper = _Keeper(proc, _Tail(OUTPUT_LIMIT), status_read)
        report, keeper_error = _supervise(keeper, deadline, marker.encode("ascii"), scope)
    finally:
        os.close(status_read)
    return _result(args, report, keeper_error, keeper.tail, time.monotonic() - started)


def _result(
    args: tuple[str, ...],
    report: Mapping[str, object],
    keeper_error: str | None,
    tail: _Tail,
    duration: float,
) -> CommandResult:
    """The keeper's report as a CommandResult (a report that is not one counts as unknown)."""
    error = report.get("error")
    errors = [error] if isinstance(error, str) and error else []
    stuck = as_count(report.get("unkillable")) or 0
    if stuck:
        errors.append(
            f"{stuck} process(es) still running after SIGKILL "
            "(uninterruptible sleep in the driver?)"
        )
    if keeper_error is not None:
        errors.append(keeper_error)
    return CommandResult(
        argv=args,
        returncode=as_int(report.get("returncode")),
        output=tail.text(),
        timed_out=report.get("timed_out") is True,
        duration=duration,
        error="; ".join(errors) or None,
        cancelled=report.get("cancelled") is True,
        leftovers=as_count(report.get("leftovers")) or 0,
        unkillable=stuck,
    )


class _Keeper:
    """The daemon's side of one command's keeper: its output, its report, its exit."""

    def __init__(self, proc: subprocess.Popen[bytes], tail: _Tail, status_fd: int) -> None:
        assert proc.stdout is not None  # noqa: S101 - stdout=PIPE guarantees it
        self.proc = proc
        self.pipe = proc.stdout
        self.tail = tail
        self.status_fd = status_fd
        self.status = bytearray()
        self.pipe_open = True
        self.reported = False

    def handle(self, key: selectors.SelectorKey, selector: selectors.BaseSelector) -> None:
        what, fileobj = key.data, key.fileobj
        if what == "pipe" and not _read_available(self.pipe.fileno(), self.tail.add):
            selector.unregister(fileobj)
            self.pipe_open = False
        elif what == "status" and not _read_status(self.status_fd, self.status):
            selector.unregister(fileobj)
            self.reported = True  # the keeper closed it: the command has ended
        elif what == "cancel":  # once: unregistered here
            selector.unregister(fileobj)
            _stop_keeper(self.proc)  # the keeper kills the tree
        elif what == "exit":
            selector.unregister(fileobj)


def _supervise(
    keeper: _Keeper, deadline: float, marker: bytes, scope: CommandScope | None
) -> tuple[Mapping[str, object], str | None]:
    """Collect output and the keeper's report until the keeper exits, cancel it when asked:
    (the report, an error of our own). A keeper still there ``_KEEPER_MARGIN`` seconds after
    the deadline, or without a report, is ended here (:func:`_kill_keeper`)."""
    proc, status_fd = keeper.proc, keeper.status_fd
    error: str | None = None
    pidfd: int | None = None
    with contextlib.suppress(OSError):
        pidfd = os.pidfd_open(proc.pid)  # our unreaped child: its PID cannot be reused
    os.set_blocking(keeper.pipe.fileno(), False)
    os.set_blocking(status_fd, False)
    with selectors.DefaultSelector() as selector:
        selector.register(keeper.pipe, selectors.EVENT_READ, "pipe")
        selector.register(status_fd, selectors.EVENT_READ, "status")
        if pidfd is not None:
            selector.register(pidfd, selectors.EVENT_READ, "exit")
        if scope is not None:
            selector.register(scope.fileno(), selectors.EVENT_READ, "cancel")
        while proc.poll() is None and not keeper.reported:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                error = "its keeper did not end it in time; process group killed"
                _kill_keeper(proc, marker)
                break
            wait = remaining if pidfd is not None else min(remaining, _TICK)
            for key, _events in selector.select(wait):
                keeper.handle(key, selector)
        if keeper.pipe_open:
            _drain(keeper.pipe.fileno(), keeper.tail, _DRAIN_GRACE)
    _read_status(status_fd, keeper.status)
    keeper.pipe.close()
    if pidfd is not None:
        os.close(pidfd)
    return _settle(keeper, error, deadline, marker, scope)


def _settle(
    keeper: _Keeper, error: str | None, deadline: float, marker: bytes, scope: CommandScope | None
) -> tuple[Mapping[str, object], str | None]:
    """The keeper's report once its command exited: a keeper that keeps what the command left
    running goes to ``scope``; one that sent its last report is waited for (``_supervise``)."""
    proc = keeper.proc
    try:
        report: Mapping[str, object] = decode_json_object(bytes(keeper.status))
    except ValueError:
        if error is None:
            error = f"its keeper failed (exit {proc.returncode}); process group killed"
            _kill_keeper(proc, marker)
        report = {}
    if error is None and proc.poll() is None:
        if report.get("keeps") is True:
            # The command exited; what it left running may run until the deadline, its
            # keeper with it (the scope ends them when the daemon stops).
            if scope is not None:
                scope.adopt(proc)
        else:
            # Its last report: the tree is ended and the keeper only has to exit (a while,
            # under load). Adopted, it would be counted as a command that left processes.
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_keeper(proc, marker)  # not exited by the deadline: ended here
    return report, error


def _kill_keeper(proc: subprocess.Popen[bytes], marker: bytes) -> None:
    """The fallback when the keeper failed: SIGKILL to the keeper's session (the command, in a
    process group of its own) and to every process that carries its marker (a setsid child
    that kept its environment)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    kill_marked(marker, session=proc.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=_REAP_AFTER_KILL)


def _read_status(fd: int, into: bytearray) -> bool:
    """Read what the keeper wrote (4 KiB at most); False at end of file."""
    return _read_available(fd, into.extend, 4096, full=lambda: len(into) >= 4096)


def _carries(pid: int, marker: bytes) -> bool:
    """Whether ``pid``'s environment holds the entry ``marker``, in its first
    :data:`_ENVIRON_BYTES`: all an exec gives, where any process may widen its own to
    gigabytes (prctl PR_SET_MM_MAP), which read whole would exhaust the daemon's memory."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return b"\0" + marker + b"\0" in b"\0" + handle.read(_ENVIRON_BYTES)
    except OSError:
        return False


def kill_marked(marker: bytes, *, session: int | None = None) -> None:
    """SIGKILL every process whose environment carries ``marker`` (``NAME=value``) or that is in
    ``session``, read once its pidfd is open: the signal goes through that pidfd, so a PID
    reused meanwhile is never hit."""
    for name in os.listdir("/proc"):
        if not name.isascii() or not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            pidfd = os.pidfd_open(int(name))
        except OSError:
            continue
        try:
            stat = None if session is None else read_stat("/proc", int(name))
            if (stat is not None and stat.session == session) or _carries(int(name), marker):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)


def _read_available(
    fd: int,
    take: Callable[[bytes], object],
    size: int = 65536,
    full: Callable[[], bool] = lambda: False,
) -> bool:
    """Read what the non-blocking ``fd`` holds now into ``take``: True while more may come,
    False at end of file, on an error, or once ``full``."""
    while not full():
        try:
            chunk = os.read(fd, size)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        take(chunk)
    return False


def _drain(fd: int, tail: _Tail, grace: float) -> None:
    """Collect remaining output until end of file or ``grace`` seconds pass."""
    deadline = time.monotonic() + grace
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while (remaining := deadline - time.monotonic()) > 0:
        if poller.poll(int(remaining * 1000) + 1) and not _read_available(fd, tail.add):
            return


@dataclass(frozen=True)
class PreparedHook:
    """A hook with its placeholders filled in; when one cannot be, ``error`` says why (the
    hook then fails without running) and ``argv`` is its template."""

    argv: tuple[str, ...]
    timeout: float
    error: str | None = None


def fill_hooks(hooks: Sequence[Hook], values: Mapping[str, str | None]) -> tuple[PreparedHook, ...]:
    """``hooks`` with their placeholders filled from ``values``, each that cannot be saying why."""
    prepared = []
    for hook in hooks:
        try:
            prepared.append(PreparedHook(format_argv(hook.argv, **values), hook.timeout))
        except ValueError as err:  # this hook fails without running, when its turn comes
            prepared.append(PreparedHook(tuple(hook.argv), hook.timeout, str(err)))
    return tuple(prepared)


def run_hooks(
    hooks: Sequence[PreparedHook],
    *,
    env: Mapping[str, str],
    stop_on_failure: bool = False,
    runner: Callable[..., CommandResult] = run_command,
) -> list[CommandResult]:
    """Run ``hooks`` in turn, each under its timeout, with the daemon's environment plus
    ``env`` (a hook that could not be filled fails without running); ``stop_on_failure``: up
    to the first failure. ``runner`` replaces :func:`run_command` (the reset's, ``simulate``'s)."""
    merged = {**os.environ, **env}
    results = []
    for hook in hooks:
        if hook.error is not None:
            result = CommandResult(hook.argv, None, "", False, 0.0, f"hook not run: {hook.error}")
        else:
            result = runner(hook.argv, timeout=hook.timeout, env=merged)
        results.append(result)
        if stop_on_failure and not result.ok:
            break
    return results
