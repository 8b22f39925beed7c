"""What a PID is to the commands that look for the running daemon: gpuwatchd, another
process, gone, or unknown (one look at ``/proc/PID``); and which process is the daemon (the
lock holder). Apart from :mod:`gpuwatchd.cli.status` so that ``scan`` does not import the
status document (~7 ms of its start)."""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import TYPE_CHECKING

from gpuwatchd.collect.procfs import read_ids

if TYPE_CHECKING:
    from gpuwatchd.collect.procfs import ProcFS
    from gpuwatchd.core.model import ProcessInfo
    from gpuwatchd.state.directory import StateDir


def look_at_process(proc_root: str, pid: int) -> str:
    """What PID ``pid`` is: "gpuwatchd", "other", "gone", or "unknown" (unreadable).
    gpuwatchd by its name or command line, which any user may set (prctl, ``exec -a``), run
    by root or this user (its real uid, which no user can set), as ``state_dir`` is owned."""
    if pid == os.getpid():
        return "other"  # this very process: the daemon's PID was reused by `status` itself
    base = os.path.join(proc_root, str(pid))
    try:
        with open(os.path.join(base, "stat"), "rb") as handle:
            stat = handle.read(4096)
    except FileNotFoundError:
        return "gone"
    except OSError:
        stat = b""
    fields = stat.rpartition(b")")[2].split()
    if fields and fields[0] in (b"Z", b"X"):
        return "gone"  # exited; its parent has not reaped it yet
    comm: str | None = None
    argv: list[str] = []
    uid: int | None = None
    try:
        with open(os.path.join(base, "comm"), "rb") as handle:
            comm = handle.read(64).decode("utf-8", "replace").strip()
        with open(os.path.join(base, "cmdline"), "rb") as handle:
            raw = handle.read(4096)
        argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
        uid, _nspid, gone = read_ids(base)
        if gone:
            return "gone"
    except FileNotFoundError:
        return "gone"
    except OSError:
        if comm is None:
            return "unknown" if os.path.isdir(base) else "gone"
    # /usr/bin/gpuwatchd run; python3 /usr/bin/gpuwatchd; python3 -m gpuwatchd
    names = [os.path.basename(arg) for arg in argv[:4]]
    named = any(name == "gpuwatchd" or name.startswith("gpuwatchd.") for name in names)
    if not (named or (comm or "").startswith("gpuwatchd")):
        return "other"
    if uid is None:
        return "unknown"
    return "gpuwatchd" if uid in (0, os.geteuid()) else "other"


def lock_holder(
    state_dir: StateDir, procfs: ProcFS, users: Collection[int]
) -> tuple[ProcessInfo | None, str]:
    """The daemon: the process the kernel says holds the instance lock in ``state_dir``, if it
    is gpuwatchd run by one of ``users``; else None and why not (no file's word is taken)."""
    where = state_dir.path
    pid = state_dir.lock_holder(procfs.root)
    if pid is None:
        return None, f"nobody holds the instance lock in {where}: is gpuwatchd running?"
    if look_at_process(procfs.root, pid) != "gpuwatchd":
        return None, f"pid {pid} holds the lock in {where} but is not gpuwatchd"
    daemon = procfs.read_process(pid)
    if daemon is None or daemon.uid not in users:
        return None, f"pid {pid} runs as another user: not the daemon this command may signal"
    return daemon, ""
