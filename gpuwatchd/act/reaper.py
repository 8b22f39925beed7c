"""The keeper of one command's process tree: nothing a command starts outlives it.

Run as a script (``python -I -S reaper.py STATUS_FD TIMEOUT -- ARGV...``) by
:func:`gpuwatchd.act.commands.run_command`; it imports only the standard library.

In detail: docs/internals.md, section `gpuwatchd.act.reaper`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
KILL_FOR = 5.0  # seconds of SIGKILL sweeps before giving up on processes stuck in the kernel
_SWEEP_PAUSE = 0.01


class _Stop(Exception):
    """The deadline passed or the daemon cancels the command: ``args[0]`` is the report key."""


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start ticks) of ``pid``, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read(4096).rpartition(b")")[2].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> dict[int, int]:
    """Every descendant of ``root`` now, with its start ticks: one walk of ``/proc``."""
    parents: dict[int, list[tuple[int, int]]] = {}
    for name in os.listdir("/proc"):
        if not (name.isascii() and name.isdigit()):
            continue
        found = _stat(int(name))
        if found is not None:
            parents.setdefault(found[0], []).append((int(name), found[1]))
    result: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, ticks in parents.get(todo.pop(), ()):
            if pid not in result:
                result[pid] = ticks
                todo.append(pid)
    return result


def _signal(pid: int, ticks: int, sig: int) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return  # gone
    try:
        found = _stat(pid)
        if found is not None and found[1] == ticks:  # still the process that was listed
            signal.pidfd_send_signal(pidfd, sig)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def _reap() -> bool:
    """Reap every exited child; False when no child is left at all."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def end_tree() -> tuple[frozenset[int], int]:
    """SIGKILL every descendant of this process until none is left: (the PIDs there were, how
    many would not die within :data:`KILL_FOR` seconds)."""
    me = os.getpid()
    if not _reap():
        return frozenset(), 0
    first = descendants(me)
    until = time.monotonic() + KILL_FOR
    stuck = 0
    while _reap():
        left = descendants(me)
        if not left:
            break
        if time.monotonic() > until:
            stuck = len(left)
            break
        for pid, ticks in left.items():
            _signal(pid, ticks, signal.SIGKILL)
        time.sleep(_SWEEP_PAUSE)
    return frozenset(first), stuck


def _become_subreaper() -> str | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as err:
        return str(err)
    return None


def main(argv: list[str]) -> int:
    status_fd, timeout, command = int(argv[1]), float(argv[2]), argv[4:]
    os.set_inheritable(status_fd, False)  # the command never sees it
    report: dict[str, object] = {"returncode": None, "error": None, "timed_out": False,
                                 "cancelled": False, "leftovers": 0, "unkillable": 0}  # fmt: skip
    armed = [True]

    def stop(signum: int, frame: object) -> None:
        if armed[0]:
            armed[0] = False
            raise _Stop("cancelled" if signum == signal.SIGTERM else "timed_out")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(timeout, 0.001))
    problem = _become_subreaper()
    child: int | None = None
    try:
        try:
            child = os.posix_spawnp(command[0], command, dict(os.environ), setpgroup=0)
        except OSError as err:
            report["error"] = f"cannot run {command[0]}: {err.strerror or err}"
        else:
            while True:
                pid, status = os.waitpid(-1, 0)
                if pid == child:
                    report["returncode"] = os.waitstatus_to_exitcode(status)
                    break
            if _reap():
                # The command exited and left processes running: the caller learns how it
                # ended now; they may go on until the deadline, and no longer.
                report["leftovers"] = len(descendants(os.getpid()))
                report["keeps"] = True  # the keeper runs on; no other report follows
                if problem is not None:
                    report["error"] = f"not a subreaper ({problem}): some may escape"
                _send(status_fd, report)
                status_fd = -1
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 1)  # the command's output pipe closes once they close it too
                os.dup2(null, 2)
                # Reap what it left running as it ends by itself, until the deadline or the
                # daemon's SIGTERM ends the wait with a _Stop.
                with contextlib.suppress(ChildProcessError):
                    while True:
                        os.waitpid(-1, 0)
    except _Stop as stopped:
        if status_fd >= 0:
            report[stopped.args[0]] = True
    armed[0] = False  # from here on the tree is ended, whatever signal comes
    signal.setitimer(signal.ITIMER_REAL, 0)
    finished = report["returncode"] is not None
    killed, stuck = end_tree()
    if status_fd >= 0:  # stopped before the command exited (or it could not start)
        report["leftovers"] = len(killed - {child})
        report["unkillable"] = stuck
        if not finished and child is not None and child in killed:
            # Ended by the sweep; unknown (None) if it is stuck in the kernel still.
            report["returncode"] = None if _stat(child) is not None else -signal.SIGKILL
        _send(status_fd, report)  # (a signal may have cut the first send short)
    return 0


def _send(status_fd: int, report: dict[str, object]) -> None:
    """Write the report and close ``status_fd``; a daemon gone (no reader: EPIPE) is no
    error, the keeper ends what it keeps all the same."""
    with contextlib.suppress(OSError), os.fdopen(status_fd, "w") as out:
        out.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
