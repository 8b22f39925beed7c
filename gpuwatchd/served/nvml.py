"""The daemon's NVML reading of its last poll, for ``scan`` to reuse: its document, the file
``nvml.json`` it is published in, and the NVML source a served scan reads it through.

In detail: docs/internals.md, section `gpuwatchd.served.nvml`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from gpuwatchd.collect.nvml import decode_gpu
from gpuwatchd.core.checked import opt_text
from gpuwatchd.core.model import NvmlReading
from gpuwatchd.state.directory import StateDir

READING_FILE = "nvml.json"
VERSION = 2  # 2: the file's modification time confirms an unchanged reading
READ_SLACK = 1.0  # seconds: a poll's own duration, beyond the interval between polls


@dataclass(frozen=True)
class Published:
    """A reading the daemon published (module docstring), decoded; an NVML source
    (:class:`gpuwatchd.collect.nvml.NvmlSource`) that answers with it and starts no worker."""

    worker_pids: ClassVar[frozenset[int]] = frozenset()
    daemon_pid: int
    read_at: float
    polled: float
    interval: float
    reading: NvmlReading

    def read(self) -> NvmlReading:
        return self.reading

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> Published:
        """The reading ``doc`` (from :func:`encode`) says, its GPUs and driver version decoded
        as a scan's own worker reply is (ValueError naming a malformed one)."""
        gpus = tuple(decode_gpu(entry) for entry in doc["gpus"])
        driver = opt_text(doc["driver_version"], "driver_version")
        return cls(
            doc["daemon"]["pid"], doc["read_at"], doc["polled"], doc["interval"],
            NvmlReading(available=True, driver_version=driver, gpus=gpus),
        )  # fmt: skip


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


def usable(published: Published, *, now_wall: float, interval: float) -> str | None:
    """Why ``published`` cannot stand for a reading taken now (None: it can): too old, or dated
    in the future (docs/internals.md, section ``gpuwatchd.served.nvml``). Pure."""
    age = now_wall - published.read_at
    limit = min(published.interval, interval) + READ_SLACK
    if age < -READ_SLACK:
        return "dated in the future (the clock was set back)"
    if age > limit:
        return f"{age:.1f}s old (older than {limit:g}s)"
    return None


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
        but for its times; remove the file when None. ``rewrite``: write it in any case."""
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
            left = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if expected is not None and expected != left:
                return None
            os.utime(fd, ns=(stamp, stamp))
            return (st.st_dev, st.st_ino, st.st_size, stamp)
        finally:
            os.close(fd)
