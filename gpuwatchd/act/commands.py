"""Running admin-configured commands (hooks, ``nvidia-smi``): argv only, no shell, own
process group, a deadline, the output's tail kept.

Hook and command environment (for admins writing hooks; also in ``docs/reset.md``): every
hook gets the daemon's environment plus ``GPUWATCHD_EVENT`` (what ran it: ``reset_drain``,
``reset_before``, ``reset_after``, ``on_failure``), and, where they apply,
``GPUWATCHD_GPU_UUID``, ``GPUWATCHD_GPU_PCI_BUS_ID``, ``GPUWATCHD_GPU_MINOR``,
``GPUWATCHD_RESULT`` (``success``, ``failed``, ``refused``, ``timeout``) and
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpuwatchd.decide.argv import format_argv
from gpuwatchd.decide.policy import Hook

COMMAND_ID_VARIABLE = "GPUWATCHD_COMMAND_ID"  # marks a command and its descendants
OUTPUT_LIMIT = 64 * 1024  # bytes of a command's output kept (the tail)
_TICK = 0.05  # poll interval when pidfds are unavailable
_DRAIN_GRACE = 0.2  # seconds to collect output after the command exits (grandchildren may hold it)
_REAP_AFTER_KILL = 5.0  # seconds to wait for a SIGKILLed command to be reaped (D state)


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

    ``env`` is the complete environment (None: inherit the daemon's), plus
    ``GPUWATCHD_COMMAND_ID``, a fresh marker every descendant inherits, less every ``PYTHON*``
    variable. It runs in ``/``, with stdin from /dev/null.
    When the deadline passes the *whole process group* gets SIGKILL (a wrapper's children
    too), and so does every process that still carries the marker: a child that left the
    group with ``setsid`` or a double fork is ended with the command. The command is reaped
    for at most a few seconds, since a process stuck in the driver cannot die; then
    ``returncode`` is None and ``error`` says so. Output that grandchildren keep writing after
    the command itself exited is collected only briefly.
    """
    args = tuple(argv)
    started = time.monotonic()
    if not args:
        return CommandResult(args, None, "", False, 0.0, "empty command")
    marker = f"{COMMAND_ID_VARIABLE}={uuid.uuid4().hex}"
    # The caller's Python settings (PYTHONPATH, PYTHONHOME, PYTHONSTARTUP...) never reach a
    # command: a hook written in Python must not import code from wherever the daemon was
    # started.
    child_env = {
        k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("PYTHON")
    }
    child_env[COMMAND_ID_VARIABLE] = marker.partition("=")[2]
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            cwd="/",  # never the caller's folder, which may be anyone's
            env=child_env,
        )
    except OSError as err:
        reason = err.strerror or str(err)
        return CommandResult(
            args, None, "", False, time.monotonic() - started, f"cannot run {args[0]}: {reason}"
        )
    tail = _Tail(output_limit)
    timed_out, error = _supervise(proc, started + timeout, tail, marker.encode("ascii"))
    return CommandResult(
        argv=args,
        returncode=proc.returncode,
        output=tail.text(),
        timed_out=timed_out,
        duration=time.monotonic() - started,
        error=error,
    )


def _supervise(
    proc: subprocess.Popen[bytes], deadline: float, tail: _Tail, marker: bytes
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
            kill_marked(marker)  # and those that left the group (setsid, double fork)
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


def _carries(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return marker in handle.read().split(b"\0")
    except OSError:
        return False


def kill_marked(marker: bytes) -> int:
    """SIGKILL every process whose environment carries ``marker`` (``NAME=value``); how many.

    Each is opened as a pidfd and checked again before the signal, so a PID reused in between
    is never hit. Our own process never carries a command's marker.
    """
    killed = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid() or not _carries(int(name), marker):
            continue
        try:
            pidfd = os.pidfd_open(int(name))
        except OSError:
            continue
        try:
            if _carries(int(name), marker):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                killed += 1
        except OSError:
            pass
        finally:
            os.close(pidfd)
    return killed


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
