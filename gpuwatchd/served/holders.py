"""The daemon's published holder view: what it knows holds the GPUs, for ``scan`` to build on.

This module owns the file ``holders.json`` in ``state_dir``: its format, writing it (the
daemon, through :class:`gpuwatchd.served.guard.ViewPublisher`, from :func:`encode`) and reading
it back as hostile input (``gpuwatchd scan``: :func:`parse`, then :func:`usable`). It decides
nothing about findings.

In detail: docs/internals.md, section `gpuwatchd.served.holders`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.core.model import HolderScan

VIEW_FILE = "holders.json"
VERSION = 1
MAX_BYTES = 4 << 20
MAX_HOLDERS = 65536
MAX_MINOR = 255
REFRESH = 30.0  # seconds between rewrites of an unchanged view
MAX_FRESH = 300.0  # no view is trusted longer than this, whatever it claims


@dataclass(frozen=True)
class HolderView:
    """A validated published view (module docstring)."""

    boot_id: str
    daemon_pid: int
    daemon_start_ticks: int
    worker_pids: frozenset[int]
    polled: float
    fresh_for: float
    settings: tuple[str, str, int]  # proc_root, devices_dir, device_major
    holders: frozenset[int]
    holder_ticks: Mapping[int, int]
    dead_listed: frozenset[int]
    # The daemon's inotify descriptor (gpuwatchd/served/guard.py asks it for queued events), and
    # whether the daemon had read no event since the walk this view reflects; a view without
    # either is never used.
    watch_fd: int | None = None
    clean: bool = False
    dirty_since: float | None = None


def encode(
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
    clean: bool = True,
) -> dict[str, object]:
    """The view as a JSON-able document (the daemon writes ``json.dumps`` of it)."""
    return {
        "watch_fd": watch_fd,
        "clean": clean,
        "version": VERSION,
        "boot_id": boot_id,
        "daemon": {"pid": daemon_pid, "start_ticks": daemon_start_ticks},
        "worker_pids": sorted(worker_pids),
        "polled": polled,
        "fresh_for": fresh_for,
        "settings": list(settings),
        "holders": [
            [pid, start_ticks.get(pid)]
            for pid in sorted(holders.holdings)
            if pid not in worker_pids and pid != daemon_pid
        ][:MAX_HOLDERS],
        "dead_listed": sorted(dead_listed)[:MAX_HOLDERS],
    }


def _int(value: object, low: int = 1, high: int = 1 << 31) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"not an integer in {low}..{high}: {value!r}")
    return value


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"not a number: {value!r}")
    return float(value)


def _list(value: object, limit: int = MAX_HOLDERS) -> list[object]:
    if not isinstance(value, list) or len(value) > limit:
        raise ValueError("not a bounded list")
    return value


def published_header(
    raw: bytes, *, max_bytes: int, version: int, what: str
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """What every file the daemon publishes for ``scan`` begins with, checked: (the document,
    its ``boot_id``, its ``daemon`` object). ValueError naming what is wrong, never another
    error: the file is hostile input (this view's, and the NVML reading's,
    :mod:`gpuwatchd.served.nvml`)."""
    if len(raw) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise ValueError(f"not JSON: {err}"[:200]) from None
    if not isinstance(data, dict) or data.get("version") != version:
        raise ValueError(f"not a version {version} {what}")
    boot_id = data.get("boot_id")
    if not isinstance(boot_id, str) or not 0 < len(boot_id) <= 64:
        raise ValueError("bad boot_id")
    daemon = data.get("daemon")
    if not isinstance(daemon, dict):
        raise ValueError("bad daemon")
    return data, boot_id, daemon


def parse(raw: bytes) -> HolderView:
    """Validate a published view; ValueError naming what is wrong."""
    data, boot_id, daemon = published_header(
        raw, max_bytes=MAX_BYTES, version=VERSION, what="holder view"
    )
    settings = _list(data.get("settings"), 3)
    if (
        len(settings) != 3
        or not isinstance(settings[0], str)
        or not isinstance(settings[1], str)
        or len(settings[0]) > 4096
        or len(settings[1]) > 4096
    ):
        raise ValueError("bad settings")
    holders: set[int] = set()
    ticks: dict[int, int] = {}
    for entry in _list(data.get("holders")):
        pair = _list(entry, 2)
        if len(pair) != 2:
            raise ValueError("bad holder entry")
        pid = _int(pair[0])
        holders.add(pid)
        if pair[1] is not None:
            ticks[pid] = _int(pair[1], 0, 1 << 62)
    return HolderView(
        boot_id=boot_id,
        daemon_pid=_int(daemon.get("pid")),
        daemon_start_ticks=_int(daemon.get("start_ticks"), 0, 1 << 62),
        worker_pids=frozenset(_int(p) for p in _list(data.get("worker_pids"), 16)),
        polled=_number(data.get("polled")),
        fresh_for=min(MAX_FRESH, max(0.0, _number(data.get("fresh_for")))),
        settings=(settings[0], settings[1], _int(settings[2], 0, 4095)),
        holders=frozenset(holders),
        holder_ticks=ticks,
        dead_listed=frozenset(_int(p) for p in _list(data.get("dead_listed"))),
        watch_fd=None if data.get("watch_fd") is None else _int(data.get("watch_fd"), 0),
        clean=data.get("clean") is True,
        dirty_since=(None if data.get("dirty_since") is None else _number(data.get("dirty_since"))),
    )


def usable(
    view: HolderView,
    *,
    now_wall: float,
    boot_id: str | None,
    settings: tuple[str, str, int],
    daemon_start_ticks: int | None,
) -> str | None:
    """Why ``view`` cannot be used now (None: it can). Pure.

    ``daemon_start_ticks``: the start ticks of ``view.daemon_pid`` read now (None: gone).
    """
    if boot_id is None or view.boot_id != boot_id:
        return "written in another boot"
    if daemon_start_ticks is None or daemon_start_ticks != view.daemon_start_ticks:
        return "the daemon that wrote it is not running"
    if view.settings != settings:
        return "the daemon watches other settings (proc_root, devices_dir, device_major)"
    age = now_wall - view.polled
    if not -5.0 <= age <= view.fresh_for:
        return f"older than {view.fresh_for:g}s"
    return None
