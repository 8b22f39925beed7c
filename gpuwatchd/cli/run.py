"""``gpuwatchd run``: logging, the capability check and a policy rejected at start, then
:class:`gpuwatchd.daemon.lifecycle.Daemon`; ``run --once`` beside a running instance hands its
ended jobs over and waits on its progress (:mod:`gpuwatchd.cli.once`) before going on alone."""

from __future__ import annotations

import errno
import functools
import os
import sys
import time
from collections.abc import Callable

import structlog

from gpuwatchd.cli.once import wait_for_daemon
from gpuwatchd.cli.scan import answer_served, snapshot_report
from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.collect.capabilities import ACT_CAPABILITIES, missing_capabilities
from gpuwatchd.core.vocabulary import EventName, ExitCode
from gpuwatchd.daemon.lifecycle import Daemon
from gpuwatchd.decide.policy import Policy
from gpuwatchd.events.logs import configure_logging
from gpuwatchd.state.accepted import Fallback
from gpuwatchd.state.directory import AlreadyRunning, StateDir
from gpuwatchd.state.pause import MAX_HAND_OVER, hand_over_ended_jobs, withdraw_ended_jobs

log = structlog.get_logger("gpuwatchd")
ENDED_JOB_GRACE = 60.0  # seconds past --timeout a hand-over may claim (its waiter bounds it)


def run_daemon(
    policy: Policy,
    *,
    config_path: str,
    dry_run: bool,
    once: bool,
    once_timeout: float,
    ended_jobs: frozenset[str] = frozenset(),
    rejected: tuple[str, Fallback] | None = None,
) -> int:
    """Run the daemon (or ``run --once``). ``rejected``: the configured policy's error when it
    was rejected, ``policy`` then being the fallback (gpuwatchd/state/accepted.py)."""
    interactive = sys.stderr.isatty() and not os.environ.get("JOURNAL_STREAM")
    configure_logging(fmt="console" if interactive else policy.log_format)
    rejected_at_start = _rejected_at_start(
        rejected, policy, config_path=config_path, dry_run=dry_run
    )
    if not _permitted(policy, dry_run=dry_run):
        return ExitCode.NOPERM
    # What this instance and, for `run --once`, any successor are made with.
    daemon_for = functools.partial(
        Daemon,
        policy,
        config_path=config_path,
        dry_run=dry_run,
        once=once,
        ended_jobs=ended_jobs,
        evidence_report=functools.partial(snapshot_report, proc_root=policy.proc_root),
    )
    daemon = daemon_for(
        once_timeout=once_timeout, rejected_at_start=rejected_at_start, scan_answer=answer_served
    )
    try:
        try:
            return daemon.run()
        except AlreadyRunning:  # only ever raised for `run --once`
            pass
        # `run --once` beside the daemon (a Slurm epilog): two actors would race, so this one
        # only watches the daemon's progress until nothing is left to act on.
        return _once_beside_the_daemon(
            daemon, daemon_for, once_timeout=once_timeout, ended_jobs=ended_jobs
        )
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            log.critical(EventName.DAEMON_NO_PERMISSION, error=str(exc))
            return ExitCode.NOPERM
        raise


def _rejected_at_start(
    rejected: tuple[str, Fallback] | None, policy: Policy, *, config_path: str, dry_run: bool
) -> dict[str, object] | None:
    """A policy rejected at start, logged (critical) with the fallback that runs instead, and
    the record the daemon keeps of it; None when the configured policy was accepted."""
    if rejected is None:
        return None
    error, fallback = rejected
    log.critical(
        EventName.CONFIG_START_REJECTED,
        error=error,
        config=config_path,
        running=fallback.describe(),
        dry_run=policy.dry_run or dry_run,
        unusable=list(fallback.problems),
    )
    return {
        "at": time.time(),
        "error": error,
        "at_start": True,
        "running": fallback.describe(),
    }


def _permitted(policy: Policy, *, dry_run: bool) -> bool:
    """Whether the daemon may start with the capabilities it has: without those acting
    needs, only in dry-run (a warning); enforcing is refused (critical) and False."""
    missing = missing_capabilities(policy.proc_root, ACT_CAPABILITIES)
    if missing:
        if not (dry_run or policy.dry_run):
            log.critical(
                EventName.DAEMON_NO_PERMISSION,
                missing=missing,
                detail="enforcing needs these capabilities (run as root); refusing to start",
            )
            return False
        log.warning(EventName.DAEMON_LIMITED_PERMISSIONS, missing=missing, dry_run=True)
    return True


def _once_beside_the_daemon(
    refused: Daemon,
    daemon_for: Callable[..., Daemon],
    *,
    once_timeout: float,
    ended_jobs: frozenset[str],
) -> int:
    """``run --once`` while another instance holds the lock: hand the ended jobs over, wait for
    its progress (:mod:`gpuwatchd.cli.once`); should it stop meanwhile (a daemon stopped, or
    another epilog's ``run --once`` done), take the lock and go on alone for the time left."""
    deadline = time.monotonic() + once_timeout
    own = refused.procfs.read_stat(os.getpid())  # a hand-over names its waiter (PID, ticks)
    waiter = None if own is None else (os.getpid(), own.starttime)
    handed = _hand_over(refused, ended_jobs, waiter, once_timeout) if ended_jobs else None
    try:
        while True:
            code = wait_for_daemon(refused.policy, max(0.0, deadline - time.monotonic()))
            if code is not None:
                return code
            print(
                "gpuwatchd: the instance that held the lock has stopped; going on alone",
                file=sys.stderr,
            )
            successor = daemon_for(
                once_timeout=max(0.0, deadline - time.monotonic()),
                # The scheduler said it when this epilog started, not now: the successor's
                # word covers the same processes (only those older than it).
                ended_jobs_said=refused.own_ended_jobs,
            )
            try:
                return successor.run()
            except AlreadyRunning:
                # Another instance took the lock first: wait for it in turn.
                time.sleep(min(refused.policy.interval, 1.0, max(0.0, deadline - time.monotonic())))
    finally:
        if handed is not None and waiter is not None:
            withdraw_ended_jobs(handed, ended_jobs, waiter=waiter)


def _hand_over(
    refused: Daemon,
    ended_jobs: frozenset[str],
    waiter: tuple[int, int] | None,
    once_timeout: float,
) -> StateDir | None:
    """The ended jobs handed to the running daemon (said on stderr either way): the state
    folder they were written to, to withdraw them from when done; None when they could not be."""
    # The running daemon takes the scheduler's word from the state folder at its next
    # poll (and so does the waiter's scan) while this process waits, and no longer; the
    # word covers only processes older than when it was said (this process's start). A reader
    # takes an expiry at most a day ahead (MAX_HAND_OVER).
    seconds = min(once_timeout + ENDED_JOB_GRACE, MAX_HAND_OVER)
    said = min((t for t in refused.own_ended_jobs.values() if t is not None), default=None)
    try:
        if waiter is None:
            raise OSError("this process's own start time cannot be read")
        state_dir = refused.store.directory()
        hand_over_ended_jobs(
            state_dir,
            ended_jobs,
            clock=BootTime.read(time.time(), refused.procfs.boot_id()),
            seconds=seconds,
            waiter=waiter,
            said_at=said,
        )
    except OSError as exc:
        print(
            f"gpuwatchd: cannot hand --ended-job to the running daemon: {exc}",
            file=sys.stderr,
        )
        return None
    print(
        f"gpuwatchd: handed to the running daemon: {', '.join(sorted(ended_jobs))} ended",
        file=sys.stderr,
    )
    return state_dir
