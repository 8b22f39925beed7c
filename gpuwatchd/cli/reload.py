"""``gpuwatchd reload``: check the policy, then ask the running daemon to reread it (SIGHUP).

In detail: docs/internals.md, section `gpuwatchd.cli.reload`.
"""

from __future__ import annotations

import os
import signal
import sys

from gpuwatchd.cli.process_kind import lock_holder
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.vocabulary import ExitCode
from gpuwatchd.decide.policy import Policy
from gpuwatchd.state.directory import StateDir

NOT_RUNNING = 3


def reload_command(policy: Policy, config_path: str) -> int:
    """Send SIGHUP to the running daemon; the policy (``config_path``) is already checked."""
    where, procfs = policy.state_dir, ProcFS(policy.proc_root)
    try:
        with StateDir.open(where) as state_dir:
            # The daemon this command may signal: one of its effective uid.
            daemon, why = lock_holder(state_dir, procfs, {os.geteuid()})
    except FileNotFoundError:
        daemon, why = None, f"no state folder {where}: is gpuwatchd running?"
    except PermissionError:
        daemon, why = None, f"cannot read {where}: permission denied (run as root)"
    except OSError as exc:
        daemon, why = None, f"{exc}: not used (only root may be able to write there)"
    if daemon is None:
        return _said(why, NOT_RUNNING)
    pid = daemon.pid
    try:
        pidfd = os.pidfd_open(pid)
        try:  # the PID may name another process by now: only the one judged is signalled
            now = procfs.read_stat(pid)
            if now is None or now.starttime != daemon.start_ticks:
                raise ProcessLookupError
            signal.pidfd_send_signal(pidfd, signal.SIGHUP)
        finally:
            os.close(pidfd)
    except ProcessLookupError:
        return _said(f"the daemon (pid {pid}) has just exited", NOT_RUNNING)
    except PermissionError:
        return _said(f"not allowed to signal the daemon (pid {pid}): run as root", ExitCode.NOPERM)
    except OSError as exc:  # no pidfd (Linux < 5.3): never a bare PID's kill, the reuse race
        why = f"cannot signal the daemon (pid {pid}): {exc.strerror or exc}"
        return _said(why, ExitCode.UNAVAILABLE)
    print(
        f"gpuwatchd: {config_path} is valid; asked the daemon (pid {pid}) to reload it "
        "(`gpuwatchd status` and the log say when it has)",
    )
    return ExitCode.OK


def _said(why: str, code: int) -> int:
    print(f"gpuwatchd: {why}", file=sys.stderr)
    return code
