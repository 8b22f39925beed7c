"""The kernel log's Xid lines (the setting ``health.kernel_log``) → :class:`KernelXid` values.

In detail: docs/findings.md#kernel-log and docs/internals.md, `gpuwatchd.collect.kernel_log`.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, asdict, dataclass, field, replace

from gpuwatchd.core.model import KernelXid, ProcessInfo
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.events import lazylog

log = lazylog.get_logger()

KERNEL_LOG_JOURNAL = "journal"
KERNEL_LOG_OFF = "off"
# The kernel's messages of this boot, then every new one; the monotonic time (seconds since
# boot, the kernel's own clock) is where a restarted daemon resumes.
JOURNAL_ARGV = (
    "journalctl",
    "--dmesg",
    "--boot",
    "--follow",
    "--lines=all",
    "--quiet",
    "--no-pager",
    "--output=short-monotonic",
)
MAX_LINE = 4096  # bytes; the driver's Xid lines are under 300
MAX_BYTES_PER_POLL = 4 << 20
MAX_RUNS_PER_POLL = 256  # distinct (GPU, Xid, process) runs kept per poll; more are dropped
MAX_TEXT = 160
MAX_PID = 4194304  # the kernel's PID_MAX_LIMIT
RESTART_AFTER = 60.0  # seconds before a journalctl that ended is started again
_READ = 65536

# "NVRM: Xid (PCI:0000:17:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
# The PCI address: domain, bus, device (the driver prints no function; some print ".0"), then
# on a MIG GPU the instance the driver attributes it to ("PCI:0000:17:00 GPU-I:05 GPU-CI:00").
_XID = re.compile(
    r"NVRM: Xid \(PCI:(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?"
    r"(?: GPU-I:[0-9]{1,5}(?: GPU-CI:[0-9]{1,5})?)?\): "
    r"(?P<xid>[0-9]{1,5})(?:, (?P<rest>.*))?"
)
_PID = re.compile(r"pid=(?:(?P<pid>[0-9]{1,7})|'?<unknown>'?)")
# A comm may hold spaces ("Web Content") or commas: up to the next ", ", printable, short.
_NAME = re.compile(r"name=(?P<name>.{1,64})")
# /dev/kmsg: "prio,seq,usec,flags[,more];message" (Documentation/ABI/testing/dev-kmsg).
_KMSG = re.compile(r"(?P<prio>[0-9]{1,4}),[0-9]{1,20},(?P<usec>[0-9]{1,20}),[^;]{0,64};(?P<m>.*)")
# journalctl -o short-monotonic: "[  123.456789] host kernel: message".
_JOURNAL = re.compile(r"\[ *(?P<s>[0-9]{1,10})\.(?P<us>[0-9]{6})\] \S{1,255} kernel: (?P<m>.*)")


@dataclass(frozen=True)
class XidLine:
    """One parsed Xid line: the PCI address as printed, the Xid, the process if printed."""

    pci: str
    xid: int
    pid: int | None
    process: str | None
    text: str


def parse_xid(message: str) -> XidLine | None:
    if len(message) > MAX_LINE or not message.startswith("NVRM: Xid ("):
        return None
    match = _XID.fullmatch(message)
    if match is None:
        return None
    rest = match.group("rest") or ""
    pid: int | None = None
    process: str | None = None
    if rest.startswith("pid="):
        head, _, rest = rest.partition(", ")
        found = _PID.fullmatch(head)
        if found is None:
            return None
        if found.group("pid") is not None:
            pid = int(found.group("pid"))
            if not 0 < pid <= MAX_PID:
                return None
        if rest.startswith("name="):
            head, _, rest = rest.partition(", ")
            named = _NAME.fullmatch(head)
            if named is None or not named.group("name").isprintable():
                return None
            process = None if named.group("name") == "<unknown>" else named.group("name")
    text = "".join(c if c.isprintable() else "?" for c in rest[:MAX_TEXT])
    return XidLine(match.group("pci").lower(), int(match.group("xid")), pid, process, text)


def parse_kmsg_record(line: str) -> tuple[int, str] | None:
    """(microseconds since boot, message) of a kernel record in ``/dev/kmsg``'s format; None
    for a malformed one or one written from user space (its facility is not the kernel's)."""
    match = _KMSG.fullmatch(line)
    if match is None or int(match.group("prio")) >> 3 != 0:
        return None
    return int(match.group("usec")), match.group("m")


def parse_journal_record(line: str) -> tuple[int, str] | None:
    """(microseconds since boot, message) of a ``journalctl -o short-monotonic`` kernel line."""
    match = _JOURNAL.fullmatch(line)
    if match is None:
        return None
    return int(match.group("s")) * 1_000_000 + int(match.group("us")), match.group("m")


def fold(
    records: Iterable[tuple[int, XidLine]],
    *,
    to_wall: Callable[[int], float],
    started_usec: int,
) -> tuple[list[KernelXid], int]:
    """One :class:`KernelXid` with a count per (GPU, Xid, process, before start) run, and how
    many lines were dropped past :data:`MAX_RUNS_PER_POLL` distinct runs."""
    runs: dict[tuple[str, int, int | None, str | None, bool], KernelXid] = {}
    dropped = 0
    for usec, line in records:
        before = usec < started_usec
        key = (line.pci, line.xid, line.pid, line.process, before)
        run = runs.get(key)
        wall = to_wall(usec)
        if run is not None:
            runs[key] = replace(
                run,
                count=run.count + 1,
                first=min(run.first, wall),
                last=max(run.last, wall),
                position=max(run.position, usec),
            )
        elif len(runs) >= MAX_RUNS_PER_POLL:
            dropped += 1
        else:
            runs[key] = KernelXid(
                **asdict(line), first=wall, last=wall, position=usec, before_start=before
            )
    return sorted(runs.values(), key=lambda r: (r.position, r.pci, r.xid)), dropped


class _Lines:
    """Complete lines from a non-blocking descriptor, at most ``budget`` bytes a call; a line
    longer than :data:`MAX_LINE` is skipped whole."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._partial = b""
        self._skipping = False
        self.ended = False

    def read(self, budget: int) -> list[str]:
        lines: list[str] = []
        while budget > 0:
            try:
                chunk = os.read(self.fd, _READ)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno in (errno.EPIPE, errno.EINTR):  # EPIPE: /dev/kmsg records overwritten
                    continue
                chunk = b""  # any other error ends the source, as its end does
            if not chunk:
                self.ended = True
                break
            budget -= len(chunk)
            parts = (self._partial + chunk).split(b"\n")
            self._partial = parts.pop()
            for part in parts:
                if self._skipping:
                    self._skipping = False
                elif len(part) <= MAX_LINE:
                    lines.append(part.decode("utf-8", "replace"))
            if len(self._partial) > MAX_LINE:
                self._partial, self._skipping = b"", True
        return lines


@dataclass(eq=False)
class KernelLog:
    """The kernel log's Xids, read a bounded slice per :meth:`read` call. ``source``:
    ``journal``, ``off`` or the path of a file in ``/dev/kmsg``'s format. ``read_process``:
    facts about a live process, to name the job of the process an Xid names (:meth:`_with_job`)."""

    source: str
    _: KW_ONLY
    read_process: Callable[[int], ProcessInfo | None] | None = None
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    # Seconds the node was suspended since boot: /proc's start times count them, the log's not.
    suspended: Callable[[], float] = lambda: (
        time.clock_gettime(time.CLOCK_BOOTTIME) - time.clock_gettime(time.CLOCK_MONOTONIC)
    )
    _child: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _lines: _Lines | None = field(default=None, init=False)
    _file: int | None = field(default=None, init=False)
    _retry_at: float | None = field(default=None, init=False)
    _said_unavailable: bool = field(default=False, init=False)
    _tick: int = field(default_factory=lambda: os.sysconf("SC_CLK_TCK"), init=False)
    started_usec: int = field(init=False)

    def __post_init__(self) -> None:
        self.started_usec = int(self._boot_clock() * 1_000_000)

    @staticmethod
    def _boot_clock() -> float:
        """The kernel log's clock: seconds since boot, not counting suspend."""
        return time.clock_gettime(time.CLOCK_MONOTONIC)

    def _open(self) -> None:
        if self._retry_at is not None and self.clock() < self._retry_at:
            return
        self._retry_at = None
        try:
            if self.source == KERNEL_LOG_JOURNAL:
                self._child = subprocess.Popen(
                    JOURNAL_ARGV,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    close_fds=True,
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"},
                )
                assert self._child.stdout is not None  # noqa: S101 - stdout=PIPE
                fd = self._child.stdout.fileno()
                os.set_blocking(fd, False)
            else:
                fd = os.open(self.source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                self._file = fd
            self._lines = _Lines(fd)
        except OSError as err:
            self._unavailable(f"{type(err).__name__}: {err.strerror or err}")

    def _unavailable(self, why: str) -> None:
        self.close()
        self._retry_at = self.clock() + RESTART_AFTER
        if not self._said_unavailable:
            self._said_unavailable = True
            log.warning(
                EventName.KERNEL_LOG_UNAVAILABLE,
                source=self.source,
                why=why,
                retry_in=RESTART_AFTER,
            )

    def read(self) -> tuple[KernelXid, ...]:
        """The Xid lines logged since the last call (on the first, the boot's so far)."""
        if self.source == KERNEL_LOG_OFF:
            return ()
        if self._lines is None:
            self._open()
            if self._lines is None:
                return ()
        lines = self._lines.read(MAX_BYTES_PER_POLL)
        if self._lines.ended and self.source == KERNEL_LOG_JOURNAL:
            self._unavailable("journalctl ended")  # a new one re-reads the boot (deduplicated)
        parse = parse_journal_record if self.source == KERNEL_LOG_JOURNAL else parse_kmsg_record
        parsed = (record for text in lines if (record := parse(text)) is not None)
        records = [(usec, xid) for usec, message in parsed if (xid := parse_xid(message))]
        if not records:
            return ()
        wall, boot = self.wall_clock(), self._boot_clock()
        runs, dropped = fold(
            records,
            to_wall=lambda usec: wall - (boot - usec / 1_000_000),
            started_usec=self.started_usec,
        )
        if dropped:
            log.warning(EventName.KERNEL_LOG_DROPPED, lines=dropped, kept=len(runs))
        return tuple(self._with_job(run) for run in runs)

    def _with_job(self, run: KernelXid) -> KernelXid:
        """Name the job of the process the Xid names, when it is still that process: alive,
        started before the Xid (on the log's clock), going by the printed name (else reused)."""
        if run.pid is None or run.process is None or self.read_process is None:
            return run
        info = self.read_process(run.pid)
        if info is None or info.start_ticks is None or info.comm != run.process[:15]:
            return run
        if info.start_ticks / self._tick - self.suspended() > run.position / 1_000_000:
            return run
        job = info.cgroup.job_key if info.cgroup is not None else None
        return run if job is None else replace(run, job=job)

    def close(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()
            if child.stdout is not None:
                child.stdout.close()
        fd, self._file = self._file, None
        if fd is not None:
            os.close(fd)
        self._lines = None
