"""The I/O edge that acts on processes and runs commands: signals through pidfds, hooks, argv.

This module owns the irreversible steps below the GPU reset: sending a signal to exactly the
process that was judged (DESIGN.md §3 "Act", domain-facts.md §5.1), waiting on its exit, and
running an admin-configured command (a hook, ``nvidia-smi``) without a shell, in its own
process group, under a deadline. It decides nothing: *whether* to signal or run is plan.py's
and the daemon's business. It never signals by bare PID (``os.kill``): between the judgement
and the signal a PID can be reused, and the pidfd is what closes that race.

The signal path, in order:

1. ``os.pidfd_open(pid)`` — from here on, signals reach that one process or nobody.
2. Re-read ``/proc/PID/stat`` field 22 (start time in clock ticks). A different value means
   the PID now belongs to another process: ``reused``, nothing is sent.
3. A zombie is never signalled (its parent has to reap it): ``zombie``.
4. ``signal.pidfd_send_signal``. ``ESRCH`` → ``gone``; ``EPERM`` → ``denied``.
5. The pidfd is kept, so :meth:`Signaller.wait` sees the exit within milliseconds.

Dry-run goes through the same path and sends signal 0 instead (which checks existence and
permission but delivers nothing), so a dry run reports ``denied`` where a real run would.

Hook and command environment (for admins writing hooks; also in ``docs/reset.md``): every
hook gets the daemon's environment plus ``GPUWATCHD_EVENT`` (what ran it: ``reset_drain``,
``reset_before``, ``reset_after``, ``on_failure``), and, where they apply,
``GPUWATCHD_GPU_UUID``, ``GPUWATCHD_GPU_PCI_BUS_ID``, ``GPUWATCHD_GPU_MINOR``,
``GPUWATCHD_RESULT`` (``success``, ``failed``, ``refused``, ``timeout``) and
``GPUWATCHD_REASON``. :func:`hook_environment` builds them.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import select
import selectors
import signal
import string
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpuwatchd.model import ProcessIdentity
from gpuwatchd.policy import Hook

__all__ = [
    "OUTPUT_LIMIT",
    "CommandResult",
    "SignalOutcome",
    "SignalResult",
    "Signaller",
    "format_argv",
    "hook_environment",
    "run_command",
    "run_hooks",
    "stat_start_ticks",
]

OUTPUT_LIMIT = 64 * 1024  # bytes of a command's output kept (the tail)
ARGV_PLACEHOLDERS = ("uuid", "pci_bus_id", "minor", "mode")
_DRAIN_GRACE = 0.2  # seconds to collect output after the command exits (grandchildren may hold it)
_REAP_AFTER_KILL = 5.0  # seconds to wait for a SIGKILLed command to be reaped (D state)
_TICK = 0.05  # poll interval when pidfds are unavailable


# --- /proc ------------------------------------------------------------------------------------


def stat_start_ticks(proc_root: str, pid: int) -> tuple[int, str] | None:
    """``(start ticks, state letter)`` of ``PID`` from ``<proc_root>/PID/stat``; None if unknown.

    The command name (field 2) may contain spaces and parentheses, so the fields after it are
    found from the *last* ``)``. Field 3 is the state, field 22 the start time in clock ticks.
    """
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), "rb") as stat_file:
            text = stat_file.read().decode("utf-8", "replace")
    except OSError:
        return None
    close = text.rfind(")")
    if close < 0:
        return None
    fields = text[close + 1 :].split()
    # fields[0] is field 3 (state), so field 22 is fields[19].
    if len(fields) < 20:
        return None
    try:
        return int(fields[19]), fields[0]
    except ValueError:
        return None


# --- signals ----------------------------------------------------------------------------------


class SignalOutcome(str, enum.Enum):
    """What happened to one signal. Races (gone, reused, zombie) are outcomes, not errors."""

    DELIVERED = "delivered"
    GONE = "gone"  # the process had exited and been reaped
    REUSED = "reused"  # the PID belongs to another process now; nothing was sent
    DENIED = "denied"  # EPERM: no CAP_KILL for this process
    ZOMBIE = "zombie"  # exited, not yet reaped; never signalled
    DRY_RUN = "dry_run"  # every check passed; nothing was sent
    FAILED = "failed"  # anything else (no pidfd support, bad signal name, floor refusal)

    def __str__(self) -> str:
        return self.value


# The log level of an ``action.signal`` event by outcome (anything else: info).
SIGNAL_OUTCOME_LEVELS = {"delivered": "warning", "denied": "error", "failed": "error"}


@dataclass(frozen=True)
class SignalResult:
    """The outcome of :meth:`Signaller.send`, with a sentence for the log.

    ``state`` is the process's state letter read right before the signal (``"D"`` says the
    process cannot die until it leaves uninterruptible sleep), None when unread.
    """

    outcome: SignalOutcome
    detail: str
    state: str | None = None


def _signal_number(name: str) -> int | None:
    """``"SIGTERM"``, ``"TERM"`` or ``"sigterm"`` → 15; None for anything that is no signal."""
    upper = name.strip().upper()
    if not upper.startswith("SIG"):
        upper = "SIG" + upper
    if upper.startswith("SIG_"):
        return None  # SIG_IGN / SIG_DFL are handlers, not signals
    member = signal.Signals.__members__.get(upper)
    return None if member is None else int(member)


class Signaller:
    """Sends signals through pidfds and waits on them. One per daemon; not thread-safe.

    ``proc_root`` is where ``PID/stat`` is read for the identity check. Pidfds of processes
    that were signalled (or checked in dry-run) are kept until their exit is reported by
    :meth:`wait`, or until :meth:`forget` / :meth:`close`.
    """

    def __init__(self, proc_root: str = "/proc") -> None:
        self._proc_root = proc_root
        self._kept: dict[ProcessIdentity, int] = {}

    # -- public ----------------------------------------------------------------------------

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
            current = stat_start_ticks(self._proc_root, pid)
            if current is not None and current[0] == identity.start_ticks and current[1] == "Z":
                return SignalResult(SignalOutcome.ZOMBIE, _zombie_detail(pid), "Z")
            return SignalResult(SignalOutcome.GONE, f"PID {pid} has exited")

        if kept is not None:
            pidfd = kept
        else:
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
        current = stat_start_ticks(self._proc_root, pid)
        if current is None:
            self._drop(identity, pidfd)
            return SignalResult(SignalOutcome.GONE, f"PID {pid} vanished from /proc")
        ticks, state = current
        if ticks != identity.start_ticks:
            self._drop(identity, pidfd)
            return SignalResult(
                SignalOutcome.REUSED,
                f"PID {pid} now belongs to another process (start ticks {ticks}, "
                f"expected {identity.start_ticks}); nothing sent",
                state,
            )
        if state == "Z":
            self._drop(identity, pidfd)
            return SignalResult(SignalOutcome.ZOMBIE, _zombie_detail(pid), state)
        if state in ("X", "x"):
            self._drop(identity, pidfd)
            return SignalResult(SignalOutcome.GONE, f"PID {pid} is dead", state)

        try:
            send_signal(pidfd, 0 if dry_run else number)
        except OSError as err:
            self._drop(identity, pidfd)
            if err.errno == errno.ESRCH:
                return SignalResult(SignalOutcome.GONE, f"PID {pid} exited", state)
            if err.errno == errno.EPERM:
                return SignalResult(
                    SignalOutcome.DENIED,
                    f"not permitted to signal PID {pid} (missing CAP_KILL?)",
                    state,
                )
            return SignalResult(
                SignalOutcome.FAILED,
                f"pidfd_send_signal({pid}) failed: {err.strerror or err}",
                state,
            )
        self._kept[identity] = pidfd
        name = signal.Signals(number).name
        if dry_run:
            return SignalResult(
                SignalOutcome.DRY_RUN, f"would send {name} to PID {pid} (dry-run)", state
            )
        return SignalResult(SignalOutcome.DELIVERED, f"sent {name} to PID {pid}", state)

    def wait(self, timeout: float) -> list[ProcessIdentity]:
        """Wait up to ``timeout`` seconds for any kept process to exit.

        Returns as soon as one has exited, with every identity whose process has exited by
        then (their pidfds are closed and forgotten). Returns ``[]`` at once when nothing is
        kept: there is nothing to wait for. A zombie counts as exited.
        """
        if not self._kept:
            return []
        by_fd = {fd: identity for identity, fd in self._kept.items()}
        poller = select.poll()
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            remaining = deadline - time.monotonic()
            try:
                events = poller.poll(max(0, int(remaining * 1000 + 0.999)))
            except InterruptedError:  # pragma: no cover - PEP 475 retries poll itself
                events = []
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
        """Close every kept pidfd."""
        for identity in list(self._kept):
            self.forget(identity)

    def fileno_list(self) -> list[int]:
        """The kept pidfds, for a caller that polls them in its own loop."""
        return list(self._kept.values())

    def watched(self) -> list[ProcessIdentity]:
        """The identities whose pidfds are kept."""
        return sorted(self._kept)

    def __enter__(self) -> Signaller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------

    def _drop(self, identity: ProcessIdentity, pidfd: int) -> None:
        if self._kept.get(identity) == pidfd:
            self.forget(identity)
        else:
            os.close(pidfd)


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _zombie_detail(pid: int) -> str:
    return f"PID {pid} is a zombie; not signalled (its parent has to reap it)"


# --- commands ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommandResult:
    """How one command ran.

    ``returncode`` is None when the command could not be started, or was killed at its
    deadline and could not be reaped (stuck in uninterruptible sleep); negative when a signal
    ended it. ``output`` is stdout and stderr interleaved, its last :data:`OUTPUT_LIMIT` bytes.
    ``error`` says what went wrong on our side (exec failure, unreaped after SIGKILL).
    """

    argv: tuple[str, ...]
    returncode: int | None
    output: str
    timed_out: bool
    duration: float
    error: str | None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and self.error is None

    def describe(self) -> str:
        """One line for logs and reasons: how it ended."""
        if self.error is not None and self.returncode is None and not self.timed_out:
            return self.error
        if self.timed_out:
            text = f"timed out after {self.duration:.1f}s; process group killed"
            return text if self.error is None else f"{text}; {self.error}"
        if self.returncode is not None and self.returncode < 0:
            return f"killed by signal {-self.returncode}"
        return f"exit {self.returncode}"


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
    output_limit: int = OUTPUT_LIMIT,
) -> CommandResult:
    """Run ``argv`` (no shell) in a new session and process group, under ``timeout`` seconds.

    ``env`` is the complete environment (None: inherit the daemon's). stdin is /dev/null.
    When the deadline passes the *whole process group* gets SIGKILL (a wrapper's children
    too) and the command is reaped — for at most a few seconds, since a process stuck in the
    driver cannot die; then ``returncode`` is None and ``error`` says so. Output that
    grandchildren keep writing after the command itself exited is collected only briefly.
    """
    args = tuple(argv)
    started = time.monotonic()
    if not args:
        return CommandResult(args, None, "", False, 0.0, "empty command")
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=None if env is None else dict(env),
        )
    except OSError as err:
        reason = err.strerror or str(err)
        return CommandResult(
            args, None, "", False, time.monotonic() - started, f"cannot run {args[0]}: {reason}"
        )
    tail = _Tail(output_limit)
    timed_out, error = _supervise(proc, started + timeout, tail)
    return CommandResult(
        argv=args,
        returncode=proc.returncode,
        output=tail.text(),
        timed_out=timed_out,
        duration=time.monotonic() - started,
        error=error,
    )


def _supervise(
    proc: subprocess.Popen[bytes], deadline: float, tail: _Tail
) -> tuple[bool, str | None]:
    """Collect output until ``proc`` exits or ``deadline`` passes; then kill its group.

    Returns (timed out, error). The command's exit is seen through a pidfd (at once) where
    available, else by polling every few tens of milliseconds.
    """
    assert proc.stdout is not None  # noqa: S101 - stdout=PIPE guarantees it
    pipe = proc.stdout
    timed_out = False
    error: str | None = None
    pidfd: int | None = None
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is not None:
        with contextlib.suppress(OSError):
            pidfd = pidfd_open(proc.pid)  # our unreaped child: its PID cannot be reused
    os.set_blocking(pipe.fileno(), False)
    with selectors.DefaultSelector() as selector:
        selector.register(pipe, selectors.EVENT_READ, "pipe")
        if pidfd is not None:
            selector.register(pidfd, selectors.EVENT_READ, "exit")
        pipe_open = True
        while proc.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            wait = remaining if pidfd is not None else min(remaining, _TICK)
            for key, _events in selector.select(wait):
                if key.data == "pipe" and not _read_into(pipe.fileno(), tail):
                    selector.unregister(pipe)
                    pipe_open = False
                elif key.data == "exit":
                    selector.unregister(key.fileobj)
        if timed_out:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: wrappers' children too
            try:
                proc.wait(timeout=_REAP_AFTER_KILL)
            except subprocess.TimeoutExpired:
                error = (
                    f"still running {_REAP_AFTER_KILL:.0f}s after SIGKILL "
                    "(uninterruptible sleep in the driver?)"
                )
        if pipe_open:
            _drain(pipe.fileno(), tail, _DRAIN_GRACE)
    pipe.close()
    if pidfd is not None:
        os.close(pidfd)
    return timed_out, error


def _read_into(fd: int, tail: _Tail) -> bool:
    """Read what is available; False at end of file."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        tail.add(chunk)


def _drain(fd: int, tail: _Tail, grace: float) -> None:
    """Collect remaining output until end of file or ``grace`` seconds pass."""
    deadline = time.monotonic() + grace
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        if poller.poll(int(remaining * 1000) + 1) and not _read_into(fd, tail):
            return


def format_argv(template: Sequence[str], **values: str | None) -> tuple[str, ...]:
    """Fill ``{uuid}``, ``{pci_bus_id}``, ``{minor}`` and ``{mode}`` in each argument.

    ``{{`` and ``}}`` stand for literal braces. An unknown placeholder, a format spec or
    conversion, or a placeholder whose value is missing or None (unknown) raises ValueError:
    a command is never run with a guessed argument.
    """
    for given in values:
        if given not in ARGV_PLACEHOLDERS:
            raise ValueError(f"unknown placeholder value {given!r}")
    formatter = string.Formatter()
    result = []
    for arg in template:
        pieces: list[str] = []
        try:
            parsed = list(formatter.parse(arg))
        except ValueError as err:
            raise ValueError(f"bad braces in {arg!r}: {err}") from None
        for literal, name, spec, conversion in parsed:
            pieces.append(literal)
            if name is None:
                continue
            if name not in ARGV_PLACEHOLDERS or spec or conversion:
                raise ValueError(
                    f"unknown placeholder {{{name}}} in {arg!r}; allowed: "
                    + ", ".join("{" + p + "}" for p in ARGV_PLACEHOLDERS)
                )
            value = values.get(name)
            if value is None:
                raise ValueError(f"no value for {{{name}}} in {arg!r}")
            pieces.append(value)
        result.append("".join(pieces))
    return tuple(result)


def hook_environment(event: str, **fields: object) -> dict[str, str]:
    """``GPUWATCHD_EVENT=event`` plus ``GPUWATCHD_<FIELD>`` for each field that is not None."""
    env = {"GPUWATCHD_EVENT": event}
    for name, value in fields.items():
        if value is not None:
            env[f"GPUWATCHD_{name.upper()}"] = str(value)
    return env


def run_hooks(
    hooks: Sequence[Hook],
    *,
    env: Mapping[str, str],
    values: Mapping[str, str | None] | None = None,
    stop_on_failure: bool = False,
    runner: Callable[..., CommandResult] | None = None,
) -> list[CommandResult]:
    """Run ``hooks`` one after another, each under its own timeout; return their results.

    Each hook sees the daemon's environment plus ``env`` (see :func:`hook_environment`).
    Placeholders in a hook's argv are filled from ``values`` (``uuid``, ``pci_bus_id``,
    ``minor``); one that cannot be filled makes that hook fail without running. With
    ``stop_on_failure`` the first failing hook ends the run (the reset's drain and before
    hooks: a failed drain must not be followed by a reset). ``runner`` replaces
    :func:`run_command` (``simulate`` answers commands without running them).
    """
    run = run_command if runner is None else runner
    merged = {**os.environ, **env}
    results = []
    for hook in hooks:
        try:
            argv = format_argv(hook.argv, **dict(values or {}))
        except ValueError as err:
            result = CommandResult(tuple(hook.argv), None, "", False, 0.0, f"hook not run: {err}")
        else:
            result = run(argv, timeout=hook.timeout, env=merged)
        results.append(result)
        if stop_on_failure and not result.ok:
            break
    return results
