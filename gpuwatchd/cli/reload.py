"""``gpuwatchd reload``: check the policy, then ask the running daemon to reread it (SIGHUP).

For a daemon systemd does not run — a Kubernetes pod, where ``kubectl exec … kill -HUP 1``
would signal the host's init under ``hostPID: true``. The daemon is found from its own
records, never by name: the PID its state file names, when that process is gpuwatchd now,
runs as this command's user, and holds the instance lock in ``state_dir`` (``/proc/locks``).
The policy has been checked by the caller (a broken one exits 78 and the daemon keeps its
own); the daemon rereads its own ``--config`` file, which should be the one checked.

Exit codes: 0 the signal was sent; 3 no running daemon found (LSB "not running"); 77 not
allowed to signal it. This module reads the state and ``/proc``; it writes nothing.
"""

from __future__ import annotations

import os
import signal
from typing import IO

from gpuwatchd.cli.status import daemon_pid, look_at_process, read_saved
from gpuwatchd.decide.policy import Policy
from gpuwatchd.state import LOCK_FILE
from gpuwatchd.vocabulary import ExitCode

NOT_RUNNING = 3


def lock_holders(proc_root: str, lock_path: str) -> frozenset[int]:
    """The PIDs ``/proc/locks`` shows holding a lock on the file ``lock_path``."""
    try:
        info = os.stat(lock_path, follow_symlinks=False)
        with open(os.path.join(proc_root, "locks"), encoding="ascii", errors="replace") as fh:
            text = fh.read(1 << 20)
    except OSError:
        return frozenset()
    wanted = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    holders = set()
    for line in text.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 812 08:01:1234 0 EOF" (a blocked waiter has "->")
        if (
            len(fields) >= 6
            and "->" not in fields[1]
            and fields[5] == wanted
            and fields[4].isdigit()
        ):
            holders.add(int(fields[4]))
    return frozenset(holders)


def _uid_of(proc_root: str, pid: int) -> int | None:
    try:
        with open(os.path.join(proc_root, str(pid), "status"), encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    return int(line.split()[2])  # the effective uid
    except (OSError, ValueError, IndexError):
        return None
    return None


def find_daemon(policy: Policy) -> tuple[int | None, str]:
    """The running daemon's PID, or None and why none was found."""
    saved, error = read_saved(policy.state_dir)
    if error is not None:
        return None, error
    pid = daemon_pid(saved)
    if pid is None:
        return None, f"no daemon state in {policy.state_dir}: is gpuwatchd running?"
    if look_at_process(policy.proc_root, pid) != "gpuwatchd":
        return None, f"the daemon that wrote {policy.state_dir} (pid {pid}) is not running"
    if _uid_of(policy.proc_root, pid) != os.geteuid():
        return None, f"pid {pid} runs as another user: not the daemon this command may signal"
    lock = os.path.join(policy.state_dir, LOCK_FILE)
    if pid not in lock_holders(policy.proc_root, lock):
        return None, f"pid {pid} does not hold {lock}: not the running daemon"
    return pid, ""


def reload_command(policy: Policy, config_path: str, *, out: IO[str], err: IO[str]) -> int:
    """Send SIGHUP to the running daemon; the policy (``config_path``) is already checked."""
    pid, why = find_daemon(policy)
    if pid is None:
        print(f"gpuwatchd: {why}", file=err)
        return NOT_RUNNING
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        print(f"gpuwatchd: the daemon (pid {pid}) has just exited", file=err)
        return NOT_RUNNING
    except PermissionError:
        print(f"gpuwatchd: not allowed to signal the daemon (pid {pid}): run as root", file=err)
        return ExitCode.NOPERM
    print(
        f"gpuwatchd: {config_path} is valid; asked the daemon (pid {pid}) to reload it "
        "(`gpuwatchd status` and the log say when it has)",
        file=out,
    )
    return ExitCode.OK
