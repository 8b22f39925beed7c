"""The daemon's holder view (what it knows holds the GPUs, as of its last poll) and the file
``holders.json`` it publishes from it. It decides nothing about findings.

In detail: docs/internals.md, section `gpuwatchd.served.holders`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuwatchd.core.model import HolderScan

VIEW_FILE = "holders.json"
VERSION = 1
MAX_HOLDERS = 65536
REFRESH = 30.0  # seconds between rewrites of an unchanged view
MAX_FRESH = 300.0  # no view is trusted longer than this, whatever it claims


@dataclass(frozen=True)
class HolderView:
    """One poll's view (module docstring): the daemon's own processes are no holders in it."""

    boot_id: str
    daemon_pid: int
    daemon_start_ticks: int
    worker_pids: frozenset[int]
    polled: float
    fresh_for: float
    settings: tuple[str, str, int]  # proc_root, devices_dir, device_major
    holders: frozenset[int]
    holder_ticks: Mapping[int, int | None]
    dead_listed: frozenset[int]
    watch_fd: int | None = None  # the daemon's inotify descriptor (guard.py asks it)
    # Kept in memory only (not in the document): the PIDs the poll could not read, and the
    # GPU minors its holders own for the full-scan rule (Collector.held_minors).
    unknown: frozenset[int] = frozenset()
    held_minors: frozenset[int] = frozenset()
    cut: bool = False  # more holders or dead PIDs than MAX_HOLDERS: the lists are incomplete

    @classmethod
    def of(
        cls,
        *,
        boot_id: str,
        daemon_pid: int,
        daemon_start_ticks: int,
        worker_pids: frozenset[int],
        polled: float,
        fresh_for: float,
        settings: tuple[str, str, int],
        holders: HolderScan,
        start_ticks: Mapping[int, int | None],
        dead_listed: frozenset[int],
        watch_fd: int | None = None,
        held_minors: frozenset[int] = frozenset(),
    ) -> HolderView:
        """The view of a poll: its ``holders`` less the daemon's own processes, with their
        ``start_ticks``, and the processes it could not read; ``cut`` when a list is longer
        than ``MAX_HOLDERS`` (it keeps the first)."""
        own = {daemon_pid, *worker_pids}
        found = sorted(pid for pid in holders.holdings if pid not in own)
        listed = found[:MAX_HOLDERS]
        return cls(
            boot_id, daemon_pid, daemon_start_ticks, worker_pids, polled, fresh_for, settings,
            frozenset(listed), {pid: start_ticks.get(pid) for pid in listed},
            frozenset(sorted(dead_listed)[:MAX_HOLDERS]), watch_fd, holders.unreadable - own,
            held_minors, max(len(found), len(dead_listed)) > MAX_HOLDERS,
        )  # fmt: skip

    def document(self) -> dict[str, object]:
        return {
            "watch_fd": self.watch_fd,
            "clean": True,
            "cut": self.cut,
            "version": VERSION,
            "boot_id": self.boot_id,
            "daemon": {"pid": self.daemon_pid, "start_ticks": self.daemon_start_ticks},
            "worker_pids": sorted(self.worker_pids),
            "polled": self.polled,
            "fresh_for": self.fresh_for,
            "settings": list(self.settings),
            "holders": [[pid, self.holder_ticks.get(pid)] for pid in sorted(self.holders)],
            "dead_listed": sorted(self.dead_listed),
        }


def usable(
    view: HolderView, *, now_wall: float, boot_id: str | None, settings: tuple[str, str, int]
) -> str | None:
    """Why ``view`` cannot be used now (None: it can). Pure."""
    if view.cut:  # a holder it does not list would be taken for no holder
        return f"cut at {MAX_HOLDERS} holders or dead PIDs"
    if boot_id is None or view.boot_id != boot_id:
        return "written in another boot"
    if view.settings != settings:
        return "the daemon watches other settings (proc_root, devices_dir, device_major)"
    limit = min(MAX_FRESH, max(0.0, view.fresh_for))
    if not -5.0 <= now_wall - view.polled <= limit:
        return f"older than {limit:g}s"
    return None
