"""The daemon's published NVML reading: what NVML said at its last poll, for ``scan`` to reuse.

This module owns the file ``nvml.json`` in ``state_dir``: its format, writing it (the daemon,
after every poll in which it serves its holder view: :class:`ReadingPublisher`, from
:func:`encode`), reading it back as hostile input (``gpuwatchd scan``: :func:`read_published`,
through :mod:`gpuwatchd.state.directory`'s trust rule, then :func:`parse` and :func:`usable`), and
:class:`DaemonReading`, the NVML source a served scan's collector reads instead of starting an
NVML worker of its own. It decides nothing about findings.

In detail: docs/internals.md, section `gpuwatchd.served.nvml`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.collect.nvml import decode_gpu
from gpuwatchd.core.model import GpuInfo, NvmlReading
from gpuwatchd.served.holders import published_header
from gpuwatchd.state.directory import StateDir

READING_FILE = "nvml.json"
VERSION = 2  # 2: the file's modification time confirms an unchanged reading
MAX_BYTES = 4 << 20
MAX_GPUS = 1024
MAX_PROCESSES = 65536  # per GPU
MAX_PID = 1 << 31
MAX_BYTES_VALUE = 1 << 64  # memory figures are unsigned 64-bit in NVML
MAX_MINOR = 255
MAX_UUID = 96
READ_SLACK = 1.0  # seconds: a poll's own duration, beyond the interval between polls


@dataclass(frozen=True)
class Published:
    """A validated published reading (module docstring)."""

    boot_id: str
    daemon_pid: int
    daemon_start_ticks: int
    read_at: float
    polled: float
    interval: float
    reading: NvmlReading


def encode(
    *,
    boot_id: str,
    daemon_pid: int,
    daemon_start_ticks: int,
    read_at: float,
    polled: float,
    interval: float,
    reply: Mapping[str, Any],
) -> dict[str, object]:
    """The document the daemon writes: ``reply`` is the worker's last successful reply
    (:attr:`gpuwatchd.collect.nvml.NvmlClient.last_reply`), its Xid events left out."""
    gpus = []
    for entry in reply.get("gpus") or ():
        health = entry.get("health") if isinstance(entry, Mapping) else None
        if isinstance(health, Mapping) and health.get("xids"):
            entry = {**entry, "health": {**health, "xids": []}}  # noqa: PLW2901 - a copy
        gpus.append(entry)
    return {
        "version": VERSION,
        "boot_id": boot_id,
        "daemon": {"pid": daemon_pid, "start_ticks": daemon_start_ticks},
        "read_at": read_at,
        "polled": polled,
        "interval": interval,
        "driver_version": reply.get("driver_version"),
        "gpus": gpus,
    }


def _int(value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"not an integer in {low}..{high}: {value!r}")
    return value


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"not a number: {value!r}")
    return float(value)


def _check_bytes(value: int | None, what: str) -> None:
    if value is not None and not 0 <= value < MAX_BYTES_VALUE:
        raise ValueError(f"{what} out of range: {value}")


def _checked_gpu(raw: object) -> GpuInfo:
    """One GPU entry decoded as a scan's own worker reply is, then bounded."""
    if not isinstance(raw, Mapping):
        raise ValueError("a GPU entry is not an object")
    try:
        gpu = decode_gpu(raw)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
        raise ValueError(f"a GPU entry is malformed: {err!r}"[:200]) from None
    _int(gpu.index, 0, MAX_GPUS)
    if gpu.minor is not None:
        _int(gpu.minor, 0, MAX_MINOR)
    if len(gpu.uuid) > MAX_UUID:
        raise ValueError("a GPU's uuid is too long")
    if gpu.memory is not None:
        for what in ("total", "free", "reserved", "allocated", "used_v1"):
            _check_bytes(getattr(gpu.memory, what), f"memory.{what}")
    for processes in (
        gpu.processes,
        *(device.processes for device in gpu.mig_devices or ()),
    ):
        if processes is None:
            continue
        if len(processes) > MAX_PROCESSES:
            raise ValueError("too many processes on a GPU")
        for process in processes:
            _int(process.pid, 0, MAX_PID)
            _check_bytes(process.used_memory, "used_memory")
    return gpu


def parse(raw: bytes, *, confirmed_at: float | None = None) -> Published:
    """Validate a published reading; ValueError naming what is wrong (never another error).
    ``confirmed_at``: the file's modification time; when later than ``read_at``, a later poll
    of the daemon got the same reading then (module docstring)."""
    data, boot_id, daemon = published_header(
        raw, max_bytes=MAX_BYTES, version=VERSION, what="NVML reading"
    )
    driver = data.get("driver_version")
    if driver is not None and (not isinstance(driver, str) or len(driver) > 64):
        raise ValueError("bad driver_version")
    gpus = data.get("gpus")
    if not isinstance(gpus, list) or len(gpus) > MAX_GPUS:
        raise ValueError("bad gpus")
    read_at, polled = _number(data.get("read_at")), _number(data.get("polled"))
    if confirmed_at is not None and math.isfinite(confirmed_at) and confirmed_at > read_at:
        read_at, polled = confirmed_at, max(polled, confirmed_at)
    return Published(
        boot_id=boot_id,
        daemon_pid=_int(daemon.get("pid"), 1, MAX_PID),
        daemon_start_ticks=_int(daemon.get("start_ticks"), 0, 1 << 62),
        read_at=read_at,
        polled=polled,
        interval=max(0.0, _number(data.get("interval"))),
        reading=NvmlReading(
            available=True,
            driver_version=driver,
            gpus=tuple(_checked_gpu(entry) for entry in gpus),
        ),
    )


def usable(
    published: Published,
    *,
    now_wall: float,
    boot_id: str | None,
    daemon_pid: int,
    daemon_start_ticks: int | None,
    view_polled: float,
    interval: float,
) -> str | None:
    """Why ``published`` cannot stand for a reading taken now (None: it can). Pure.

    ``daemon_pid``, ``daemon_start_ticks``: the daemon that holds the instance lock now, its
    start ticks read now; ``view_polled``: the poll of the holder view this scan uses;
    ``interval``: this scan's own policy's.
    """
    if boot_id is None or published.boot_id != boot_id:
        return "written in another boot"
    if (
        published.daemon_pid != daemon_pid
        or daemon_start_ticks is None
        or published.daemon_start_ticks != daemon_start_ticks
    ):
        return "written by another process than the running daemon"
    if published.polled < view_polled:
        return "older than the daemon's holder view"
    age = now_wall - published.read_at
    limit = min(published.interval, interval) + READ_SLACK
    if age < -READ_SLACK:
        return "dated in the future (the clock was set back)"
    if age > limit:
        return f"{age:.1f}s old (older than {limit:g}s)"
    return None


def read_published(state_dir: StateDir) -> tuple[Published | None, str]:
    """The published reading read through the trust rule and validated, else None; and, either
    way, what was found (shown in the report when the scan reads NVML itself)."""
    try:
        raw, st = state_dir.read_with_stat(READING_FILE, MAX_BYTES + 1)
    except FileNotFoundError:
        return None, "the daemon published no NVML reading"
    except OSError as err:
        return None, f"the daemon's NVML reading is unusable: {err.strerror or err}"
    try:
        return parse(raw, confirmed_at=st.st_mtime), "the daemon's NVML reading"
    except ValueError as err:
        return None, f"the daemon's NVML reading is unusable: {err}"


class DaemonReading:
    """An NVML source (:class:`gpuwatchd.collect.nvml.NvmlSource`) that answers with the
    daemon's published reading and starts no worker."""

    worker_pids: frozenset[int] = frozenset()

    def __init__(self, published: Published) -> None:
        self.published = published

    def read(self) -> NvmlReading:
        return self.published.reading


class ReadingPublisher:
    """Writes ``nvml.json`` for the daemon after each served poll, or removes it when the
    poll's NVML read failed (module docstring)."""

    def __init__(
        self, state_dir: Callable[[], StateDir | None], on_error: Callable[[str], None]
    ) -> None:
        self._state_dir = state_dir
        self._on_error = on_error
        self._present = True  # unknown at start: a failed first read removes a leftover
        self._error: str | None = None  # the last error said (each poll would repeat it)
        self._content: dict[str, object] | None = None  # the doc last written, less its times
        self._left: tuple[int, int, int, int] | None = None  # its dev, inode, size, mtime (ns)

    def publish(self, doc: Mapping[str, object] | None, *, rewrite: bool = False) -> None:
        """Write ``doc`` (from :func:`encode`), or only confirm the file when it says the same
        but for its times (module docstring); remove the file when None. ``rewrite``: write
        it in any case (the holder view was written this poll: the reading's own ``polled``
        must then be this poll's, not the time it is confirmed at, which comes before)."""
        if doc is None and not self._present:
            return
        state_dir = self._state_dir()
        if state_dir is None:
            return
        try:
            if doc is None:
                self._content = self._left = None
                state_dir.discard(READING_FILE)
            else:
                read_at = doc.get("read_at")
                stamp = int(read_at * 1e9) if isinstance(read_at, (int, float)) else None
                content = {k: v for k, v in doc.items() if k not in ("read_at", "polled")}
                if (
                    rewrite
                    or stamp is None
                    or content != self._content
                    or not self._confirm(state_dir, stamp)
                ):
                    self._content = self._left = None
                    # No fsync: only running scans read it, and after a crash its daemon is gone.
                    state_dir.write(READING_FILE, json.dumps(doc).encode(), sync=False)
                    if stamp is not None:
                        self._left = self._stamp(state_dir, stamp, None)
                        self._content = content
        except OSError as exc:
            self._content = self._left = None  # the next poll writes the file afresh
            why = exc.strerror or str(exc)  # not the temporary file's name: new each time
            if why != self._error:
                self._error = why
                self._on_error(why)
            return
        self._present, self._error = doc is not None, None

    def _confirm(self, state_dir: StateDir, stamp: int) -> bool:
        """Move the file's time to ``stamp`` (ns) if it is still the one left here."""
        try:
            self._left = self._stamp(state_dir, stamp, self._left)
        except FileNotFoundError:
            self._left = None
        return self._left is not None

    @staticmethod
    def _stamp(
        state_dir: StateDir, stamp: int, expected: tuple[int, int, int, int] | None
    ) -> tuple[int, int, int, int] | None:
        """Set the file's times to ``stamp`` (ns) and return what it is left as; None (and
        nothing set) when ``expected`` is given and the file is not as it was left."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(READING_FILE, flags, dir_fd=state_dir.fd)
        try:
            st = os.fstat(fd)
            if expected is not None and expected != (
                st.st_dev,
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
            ):
                return None
            os.utime(fd, ns=(stamp, stamp))
            return (st.st_dev, st.st_ino, st.st_size, stamp)
        finally:
            os.close(fd)
