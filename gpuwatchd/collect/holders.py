"""The scan for holders of NVIDIA device files: every fd and every mapping, by device number.

This module owns which fd links and mapped files count as holding ``/dev/nvidia*``, how they
are identified, and what is reported when a process cannot be read; process facts come from the
:class:`ProcessTable` it is given. It never signals, decides or imports NVML.
In detail: docs/internals.md, section `gpuwatchd.collect.holders`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gpuwatchd.collect import spread
from gpuwatchd.collect.kcmp import Kcmp
from gpuwatchd.collect.mig import CAPABILITIES_DIR, match_cap_file
from gpuwatchd.collect.statfiles import GONE_ERRNOS, read_proc_blocks, stat_cached
from gpuwatchd.core.model import DeviceHolding, HolderScan, MigCapability
from gpuwatchd.core.procstat import StatFields

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
MAX_GPU_MINOR = 247  # 248-253 unused, 254 nvidia-modeset, 255 nvidiactl
THREAD_TABLE_BUDGET = 65_536  # fd entries of one process's threads' own tables (docs/internals.md)
FD_BATCH = 1024  # fds whose link texts (4 KiB at most) one scan holds at once

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_DEVICE_NAME = re.compile(r"nvidia(\d+)|nvidiactl|nvidia-uvm|(?:nvidia-caps/)?nvidia-cap(\d+)")

# ("gpu", minor) | ("ctl", 0) | ("uvm", 0) | ("cap", minor)
_Match = tuple[str, int]
_ByInode = dict[tuple[bytes, bytes], _Match | None]  # a mapped file's (device, inode) -> match


class ProcessTable(Protocol):
    """What the scan reads about processes: :class:`gpuwatchd.collect.procfs.ProcFS` is one."""

    root: str
    self_pid: int

    def char_device_majors(self) -> dict[str, int] | None: ...
    def list_pids(self) -> list[int]: ...
    def kernel_threads(self) -> frozenset[int]: ...
    def read_stat(self, pid: int) -> StatFields | None: ...
    def stat_unless_gone(self, pid: int) -> StatFields | Literal[False] | None: ...


class _Gone(Exception):
    """The process vanished while being read."""


class _Denied(Exception):
    """The process exists but this part of it could not be read."""


def _classify_error(err: OSError) -> Exception:
    return _Gone() if err.errno in GONE_ERRNOS else _Denied()


def match_device_name(name: str) -> _Match | None:
    """``nvidia3`` / ``nvidiactl`` / ``nvidia-uvm`` (a basename) to what it stands for. Pure."""
    match = _DEVICE_NAME.fullmatch(name)
    if match is None:
        return None
    if match.group(1) is not None:
        return ("gpu", int(match.group(1)))
    if match.group(2) is not None:
        return ("cap", int(match.group(2)))
    return ("ctl", 0) if name == "nvidiactl" else ("uvm", 0)


def lines_containing(data: bytes, markers: tuple[bytes, ...]) -> list[bytes]:
    """The distinct ``\\n``-separated lines of ``data`` containing any marker, found without
    splitting all of it (a process can have tens of thousands of mappings). Pure."""
    starts: set[int] = set()
    for marker in markers:
        at = data.find(marker)
        while at >= 0:
            line_start = data.rfind(b"\n", 0, at) + 1
            starts.add(line_start)
            line_end = data.find(b"\n", at)
            if line_end < 0:
                break
            at = data.find(marker, line_end)
    lines = []
    for start in sorted(starts):
        end = data.find(b"\n", start)
        lines.append(data[start:] if end < 0 else data[start:end])
    return lines


@dataclass(slots=True)
class _Found:
    """What one process was seen holding, accumulated across fds and mappings."""

    gpu_fd: set[int] = field(default_factory=set)
    gpu_map: set[int] = field(default_factory=set)
    caps_fd: set[int] = field(default_factory=set)  # nvidia-cap minors
    caps_map: set[int] = field(default_factory=set)
    cap_files: set[spread.CapFile] = field(default_factory=set)
    ctl: bool = False
    uvm: bool = False
    by_name: bool = False
    capped: bool = False  # threads' own fd tables left unread: the budget ran out

    def add(self, kind: str, minor: int, via_map: bool) -> None:
        if kind == "gpu":
            (self.gpu_map if via_map else self.gpu_fd).add(minor)
        elif kind == "cap":
            (self.caps_map if via_map else self.caps_fd).add(minor)
        else:  # "ctl", "uvm"
            setattr(self, kind, True)

    def holds(self) -> bool:
        held = (self.gpu_fd, self.gpu_map, self.caps_fd, self.caps_map, self.cap_files)
        return any(held) or self.ctl or self.uvm

    def row(self, pid: int, denied: bool) -> spread.Row:
        """What was found, as a plain row (``by_name`` said only of a holder)."""
        minors = (self.gpu_fd, self.gpu_map, self.caps_fd, self.caps_map)
        gpu_fd, gpu_map, caps_fd, caps_map = (tuple(sorted(found)) for found in minors)
        holds, files = self.holds(), tuple(self.cap_files)
        flags = (self.ctl, self.uvm, self.by_name and holds, denied, self.capped)
        return (pid, gpu_fd, gpu_map, *flags, caps_fd, caps_map, files)


def _place_table(kcmp: Kcmp, tid: int, tables: list[int]) -> tuple[int, bool] | None:
    """(where ``tid``'s fd table sorts among the threads ``tables``, kept in kcmp's order;
    whether it is one of theirs); None when kcmp cannot order it (a binary search)."""
    low, high = 0, len(tables)
    while low < high:
        middle = (low + high) // 2
        order = kcmp.order_files(tid, tables[middle])
        if order is None:
            return None
        if order == 0:
            return middle, True
        if order < 0:
            high = middle
        else:
            low = middle + 1
    return low, False


class DeviceFiles:
    """What counts as an NVIDIA device file: by device number (the nvidia major, and the
    dynamic ``nvidia-uvm``/``nvidia-caps`` majors of ``/proc/devices``), or in path mode (tests)
    by name under ``devices_dir``; and the markers the scan's prefilters look for."""

    def __init__(
        self,
        procfs: ProcessTable,
        *,
        devices_dir: str = "/dev",
        device_major: int = NVIDIA_MAJOR,
        uvm_major: int | None = None,
        ctl_minor: int = NVIDIACTL_MINOR,
        uvm_minor: int = 0,
        match_by_path: bool | None = None,
        caps_major: int | None = None,
    ) -> None:
        self.procfs = procfs
        self.device_major = device_major
        self.ctl_minor = ctl_minor
        self.uvm_minor = uvm_minor
        self.match_by_path = (devices_dir != "/dev") if match_by_path is None else match_by_path
        # Dynamic majors by driver name, from /proc/devices once (None: that driver is absent)
        given = {"nvidia-uvm": uvm_major, "nvidia-caps": caps_major}
        self._majors: dict[str, int | None] = {k: v for k, v in given.items() if v is not None}
        self.prefix = os.path.realpath(devices_dir).rstrip("/") + "/"
        self.capabilities_dir = (
            self.prefix + "driver/nvidia/capabilities" if self.match_by_path else CAPABILITIES_DIR
        )
        self.map_markers: tuple[bytes, ...] = (
            (os.fsencode(self.prefix),) if self.match_by_path else (b"/dev/", b"nvidia")
        )

    def major(self, name: str) -> int | None:
        """A driver's (``nvidia-uvm``, ``nvidia-caps``) dynamic major from ``/proc/devices``,
        read once; None when absent (looked up again after :meth:`forget_absent`)."""
        if name not in self._majors:
            majors = self.procfs.char_device_majors()
            if majors is None:
                return None  # try again next time
            self._majors[name] = majors.get(name)
        return self._majors[name]

    def forget_absent(self) -> None:
        """Forget the drivers found absent: nvidia-uvm is loaded on demand (by the first CUDA
        program's nvidia-modprobe), maybe after the daemon started; each scan looks again."""
        self._majors = {name: found for name, found in self._majors.items() if found is not None}

    def match_rdev(self, st: os.stat_result) -> _Match | None:
        if not stat.S_ISCHR(st.st_mode):
            return None
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        if major == self.device_major and minor == self.ctl_minor:
            return ("ctl", 0)
        uvm_major = self.major("nvidia-uvm")
        if uvm_major is not None and major == uvm_major and minor == self.uvm_minor:
            return ("uvm", 0)
        if major == self.device_major and minor <= MAX_GPU_MINOR:
            return ("gpu", minor)
        caps_major = self.major("nvidia-caps")
        if caps_major is not None and major == caps_major and major != self.device_major:
            return ("cap", minor)
        return None

    def match_path(self, path: str) -> _Match | None:
        """What ``path`` names in path mode: a device file under ``devices_dir``, or None."""
        prefix = self.prefix
        return match_device_name(path[len(prefix) :]) if path.startswith(prefix) else None

    def may_hold(self, targets: list[str]) -> bool:
        """The prefilter: whether any fd target could be a device file, by one C-level search
        of all of them joined. It cannot miss a holder: each exact test below looks only at a
        target containing the same marker (the device prefix in path mode; ``/dev/`` or
        ``nvidia`` in device-number mode), and a target containing it leaves it in the joined
        text (no marker holds the separator, so joining creates hits but never hides one)."""
        joined = "\n".join(targets)
        if self.match_by_path:
            return self.prefix in joined or self.capabilities_dir in joined
        return "/dev/" in joined or "nvidia" in joined

    def identify_mapping(
        self, base: str, address: str, path: str, inode: bytes
    ) -> tuple[_Match | None, bool]:
        """(what a mapped file is, whether that was proven by device number)."""
        with contextlib.suppress(OSError):
            return self.match_rdev(stat_cached(f"{base}/map_files/{address}")), True
        if not path.endswith(" (deleted)"):
            with contextlib.suppress(OSError):
                st = stat_cached(f"{base}/root{path}")
                if str(st.st_ino).encode() == inode:
                    return self.match_rdev(st), True
        if "/dev/" not in path:
            return None, False
        return match_device_name(path.rsplit("/", 1)[-1]), False


class HolderScanner:
    """The holders of NVIDIA device files (``devices`` says which) among ``procfs``'s processes."""

    def __init__(
        self, procfs: ProcessTable, devices: DeviceFiles, *, workers: int | None = None
    ) -> None:
        self.procfs = procfs
        self.devices = devices
        self.workers = workers  # None: as many as idle CPUs allow (collect/spread.py)
        self.min_slice = spread.MIN_SLICE
        self._kcmp: Kcmp | None = None  # made on first use (in each forked scan worker)
        self.thread_table_budget = THREAD_TABLE_BUDGET
        self.fd_batch = FD_BATCH
        # Called after each process scanned here, never in a forked worker (the daemon's watchdog)
        self.progress: Callable[[], None] | None = None
        self._every_fd = False  # a full scan's: every fd a device, not one per link text

    def scan(self, pids: Iterable[int] | None = None, *, exclude: Iterable[int] = ()) -> HolderScan:
        """Find holders of NVIDIA device files: all of /proc when ``pids`` is None ("full"),
        else exactly ``pids`` ("targeted"). Skips ourselves, ``exclude`` and kernel threads."""
        candidates = self.procfs.list_pids() if pids is None else list(dict.fromkeys(pids))
        skip = {self.procfs.self_pid, *exclude}
        self.devices.forget_absent()
        if pids is None:
            skip |= self.procfs.kernel_threads()
        todo = [pid for pid in candidates if pid not in skip and pid > 0]
        self._every_fd = pids is None
        rows = spread.scan_spread(
            self._scan_chunk,
            todo,
            workers=self.workers,
            min_slice=self.min_slice,
            progress=self.progress,
        )
        return HolderScan(
            mode="full" if pids is None else "targeted",
            holdings={
                pid: DeviceHolding(
                    pid,
                    frozenset(gpu_fd),
                    frozenset(gpu_map),
                    ctl,
                    uvm,
                    frozenset(caps_fd),
                    frozenset(caps_map),
                    frozenset(MigCapability(*cap) for cap in files),
                )
                for pid, gpu_fd, gpu_map, ctl, uvm, _, _, _, caps_fd, caps_map, files in rows
                if gpu_fd or gpu_map or ctl or uvm or caps_fd or caps_map or files
            },
            unreadable=frozenset(row[0] for row in rows if row[6]),
            matched_by_name=frozenset(row[0] for row in rows if row[5]),  # only holders'
            thread_tables_unread=frozenset(row[0] for row in rows if row[7]),
        )

    def _scan_chunk(self, pids: Sequence[int], tick: spread.Tick) -> list[spread.Row]:
        """What each of ``pids`` holds, as plain rows (processes that hold nothing and were
        fully read are left out); ``tick`` is called after each. Runs in a forked worker or
        here; see :mod:`.spread`."""
        rows: list[spread.Row] = []
        by_inode: _ByInode = {}
        for pid in pids:
            found, denied = self._scan_process(pid, by_inode)
            if tick is not None:
                tick()
            if found is not None and (denied or found.holds()):
                rows.append(found.row(pid, denied))
        return rows

    def _scan_fds(self, fd_dir: str, found: _Found) -> int:
        """Add what the fds in ``fd_dir`` hold, :attr:`fd_batch` at a time (a table may have a
        million fds, each a 4 KiB link text); how many fds the table had (0: empty)."""
        try:
            dfd = os.open(fd_dir, _DIR_FLAGS)
        except OSError as err:
            raise _classify_error(err) from None
        count = 0
        try:
            with os.scandir(dfd) as entries:
                while names := [entry.name for entry in itertools.islice(entries, self.fd_batch)]:
                    count += self._scan_fd_batch(fd_dir, dfd, names, found)
        except OSError as err:
            raise _classify_error(err) from None
        finally:
            os.close(dfd)
        return count

    def _scan_fd_batch(self, fd_dir: str, dfd: int, names: list[str], found: _Found) -> int:
        """Add what the fds ``names`` of ``fd_dir`` (open as ``dfd``) hold; how many are open."""
        readlink, devices = os.readlink, self.devices
        try:
            # All the fds at once; the careful loop only when an fd misbehaves.
            targets = [readlink(name, dir_fd=dfd) for name in names]
        except OSError as err:
            if err.errno not in GONE_ERRNOS or not os.path.exists(f"{fd_dir}/."):
                raise _classify_error(err) from None
            names, targets = self._readlinks_carefully(dfd, names)
        if not devices.may_hold(targets):
            return len(names)
        for target in set(targets):
            if "/capabilities/" in target:
                cap = match_cap_file(target, devices.capabilities_dir)
                if cap is not None:
                    found.cap_files.add((cap.gpu_minor, cap.gi, cap.ci))
        # A link is the path as this reader resolves it: files of two mount namespaces (a
        # host's and a container's /dev/nvidia0) can read the same. A full scan (the reset's
        # final one) looks at each fd in device-number mode; a targeted scan, every poll, at
        # one fd per text (a CUDA process holds dozens of a few texts).
        fds = zip(targets, names, strict=True)
        every_fd = self._every_fd and not devices.match_by_path
        for target, name in fds if every_fd else dict(fds).items():
            if devices.match_by_path:
                what = devices.match_path(target)
            elif target[:1] != "/" or ("/dev/" not in target and "nvidia" not in target):
                continue
            else:
                try:
                    what = devices.match_rdev(stat_cached(name, dir_fd=dfd))
                except FileNotFoundError:
                    continue
                except OSError as err:
                    raise _classify_error(err) from None
            if what is not None:
                found.add(*what, via_map=False)
        return len(names)

    @staticmethod
    def _readlinks_carefully(dfd: int, names: list[str]) -> tuple[list[str], list[str]]:
        """(names, targets) of the fds still open, read one by one."""
        kept: list[str] = []
        targets: list[str] = []
        for name in names:
            try:
                targets.append(os.readlink(name, dir_fd=dfd))
            except FileNotFoundError:
                continue  # closed since the listing
            except OSError as err:
                raise _classify_error(err) from None
            kept.append(name)
        return kept, targets

    def _scan_maps(self, base: str, found: _Found, by_inode: _ByInode) -> bool:
        """Add what the mappings of the process at ``base`` hold, read a block at a time (any
        user can make them hundreds of megabytes); False when it has none."""
        markers = self.devices.map_markers
        mapped = False
        try:
            for data in read_proc_blocks(f"{base}/maps"):
                mapped = True
                if any(map(data.__contains__, markers)):
                    for line in lines_containing(data, markers):
                        self._add_mapping(base, line, found, by_inode)
        except OSError as err:
            raise _classify_error(err) from None
        return mapped

    def _add_mapping(self, base: str, line: bytes, found: _Found, by_inode: _ByInode) -> None:
        """Add what one maps line of the process at ``base`` holds, if anything."""
        devices = self.devices
        fields = line.split(None, 5)
        if len(fields) < 6 or fields[4] == b"0":
            return
        address, _, _, device, inode, raw_path = fields
        path = os.fsdecode(raw_path)
        if devices.match_by_path:
            if (what := devices.match_path(path)) is not None:
                found.add(*what, via_map=True)
            return
        # /dev/shm is a nodev tmpfs: a path we skip, not a temporary file we create.
        if path.startswith("/dev/shm/") or path == "/dev/zero (deleted)":  # noqa: S108
            return
        key = (device, inode)
        if key in by_inode:
            what = by_inode[key]
        else:
            what, certain = devices.identify_mapping(base, os.fsdecode(address), path, inode)
            if certain:
                by_inode[key] = what
            elif what is not None:
                found.by_name = True
        if what is not None:
            found.add(*what, via_map=True)

    def _scan_process(self, pid: int, by_inode: _ByInode) -> tuple[_Found | None, bool]:
        """(what ``pid`` holds, whether part of it was unreadable); (None, False) when gone."""
        base = f"{self.procfs.root}/{pid}"
        found = _Found()
        unreadable = False
        had_fds = had_maps = True
        try:
            had_fds = self._scan_fds(f"{base}/fd", found) > 0
            unreadable = not self._scan_thread_tables(pid, base, found)
        except _Gone:
            return None, False
        except _Denied:
            unreadable = True
        try:
            had_maps = self._scan_maps(base, found, by_inode)
        except _Gone:
            return None, False
        except _Denied:
            unreadable = True
        if unreadable or not (had_fds or had_maps):
            # Kernel threads hold nothing (and deny /fd to non-root); a zombie leader may have
            # live threads still holding the shared fd table and memory.
            fields = self.procfs.stat_unless_gone(pid)
            if fields is None:  # alive, but not known to be a kernel thread or a zombie
                return found, True
            if fields is False or fields.kernel_thread:
                return None, False
            if fields.state == "Z" and fields.num_threads > 1 and not unreadable:
                return self._scan_live_thread(pid, found, by_inode)
        return found, unreadable

    def _scan_thread_tables(self, pid: int, base: str, found: _Found) -> bool:
        """Add what threads with fd tables of their own hold (docs/internals.md); False when one
        could not be read, or :attr:`thread_table_budget` ran out first (``found.capped``)."""
        try:
            if os.stat(f"{base}/task").st_nlink - 2 <= 1:  # 2 + threads: one thread
                return True
            tids = [int(n) for n in os.listdir(f"{base}/task") if n.isascii() and n.isdigit()]
        except OSError as err:
            raise _classify_error(err) from None
        if self._kcmp is None:
            self._kcmp = Kcmp()
        kcmp = self._kcmp
        tables: list[int] = []  # one thread per distinct table read, in kcmp's order
        spent = 0
        complete = True
        for tid in tids:
            if tid == pid or kcmp.order_files(tid, pid) == 0:  # the leader's table
                continue
            place = _place_table(kcmp, tid, tables)
            if place is not None and place[1]:
                continue  # a table already read
            if spent >= self.thread_table_budget:
                found.capped = True
                return False
            try:
                spent += 1 + self._scan_fds(f"{base}/task/{tid}/fd", found)
            except _Gone:
                continue  # the thread ended
            except _Denied:
                complete = False
                continue
            if place is not None:
                tables.insert(place[0], tid)
        return complete

    def _scan_live_thread(
        self, pid: int, found: _Found, by_inode: _ByInode
    ) -> tuple[_Found | None, bool]:
        """Add what a live thread of the zombie leader ``pid`` holds (the shared fd table and
        the memory) to ``found``, which keeps what the threads' own tables held."""
        try:
            tids = [t for t in os.listdir(f"{self.procfs.root}/{pid}/task") if t != str(pid)]
        except OSError:
            return found, True
        for tid in tids:
            task = f"{self.procfs.root}/{pid}/task/{tid}"
            try:
                self._scan_fds(f"{task}/fd", found)
                self._scan_maps(task, found, by_inode)
            except _Gone:
                continue
            except _Denied:
                return found, True
            return found, False
        return found, False
