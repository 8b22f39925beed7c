"""Whether a process this test started is gone (dead or a zombie)."""

from __future__ import annotations

from gpuwatchd.act.signals import stat_start_ticks


def is_dead(pid: int) -> bool:
    """Gone from /proc or a zombie (PID 1 in some containers never reaps)."""
    stat = stat_start_ticks("/proc", pid)
    return stat is None or stat[1] == "Z"
