"""Host process facts, read from ``/proc``: who a process is, where it sits, what it runs.

This module owns the reads of ``/proc`` (its root a parameter) that describe processes and the
host, and their pure parsers. It never signals, decides or imports NVML: ``None`` is what it
could not see. In detail: docs/internals.md, section `gpuwatchd.collect.procfs`.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import pwd
import stat
from collections.abc import Callable, Iterable
from typing import Any, Literal

from gpuwatchd.collect.capabilities import missing_capabilities
from gpuwatchd.collect.cgroups import (
    delegation_mark,
    kernel_lines,
    parse_cgroup,
    parse_systemd_mount,
)
from gpuwatchd.collect.statfiles import GONE_ERRNOS, is_procfs, read_proc_file, stat_cached
from gpuwatchd.core.checked import decimal
from gpuwatchd.core.model import CgroupInfo, ProcessInfo
from gpuwatchd.core.procstat import StatFields, parse_stat
from gpuwatchd.decide.floor import claims_infrastructure, names_infrastructure_unit
from gpuwatchd.decide.patterns import MAX_COMMAND_TEXT

_CAP_SYS_ADMIN = 21  # reads trusted.* extended attributes (the delegation mark)
DEFAULT_PID_MAX = 4194304
# Inode numbers of the initial namespaces, fixed by the kernel (include/linux/proc_ns.h).
PROC_PID_INIT_INO = 0xEFFFFFFC
PROC_CGROUP_INIT_INO = 0xEFFFFFFB
# A command line's bytes read: what patterns and events see (MAX_COMMAND_TEXT characters, four
# bytes each at most) and that there is more; a user's arguments may be megabytes.
_COMMAND_BYTES = 4 * MAX_COMMAND_TEXT + 4


def parse_proc_devices(text: str) -> dict[str, int]:
    """The character-device section of ``/proc/devices`` as name -> major. Pure."""
    majors: dict[str, int] = {}
    in_char = False
    for line in kernel_lines(text):
        if line.startswith("Character devices"):
            in_char = True
            continue
        if line.startswith("Block devices"):
            break
        fields = line.split()
        if in_char and len(fields) == 2 and (major := decimal(fields[0])) is not None:
            majors.setdefault(fields[1], major)
    return majors


def _ns_link(path: str) -> int | OSError | None:
    """The inode of the namespace link at ``path`` (``pid:[4026531836]``), None when its text
    is not one, or the error that kept it unread."""
    try:
        link = os.readlink(path)
    except OSError as error:
        return error
    start, end = link.find("["), link.rfind("]")
    if start < 0 or end < start:
        return None
    try:
        return int(link[start + 1 : end])
    except ValueError:
        return None


def _status_field(status: str, name: str) -> list[str]:
    """The values of one ``Name:`` line of ``/proc/PID/status``, found without a full split;
    only ``\\n`` starts a line, so the ``Name:`` line (a ``comm``) cannot fake a later field."""
    at = status.find(f"\n{name}:")
    if at < 0:
        return []
    end = status.find("\n", at + 1)
    return status[at + len(name) + 2 : None if end < 0 else end].split()


def root_only(st: os.stat_result) -> bool:
    return st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _read_text(path: str) -> str:
    return read_proc_file(path).decode("utf-8", "replace")


class ProcFS:
    """Reads process and host facts from a ``/proc`` tree rooted at ``root``; ``devices`` are
    the settings (:class:`~gpuwatchd.collect.holders.DeviceFiles`) of :attr:`holders`, the
    device-holder scanner over the same tree."""

    def __init__(self, root: str = "/proc", **devices: Any) -> None:
        from gpuwatchd.collect import holders  # holders builds on this module, not the reverse

        self.root = root.rstrip("/") or "/"
        self._users: dict[int, str | None] = {}
        self._has_children_files: bool | None = None
        self._boot_id: str | None = None
        self._real_proc = is_procfs(self.root)  # its boot_id is read once
        try:
            self.self_pid = int(os.readlink(f"{self.root}/self"))
        except (OSError, ValueError):
            self.self_pid = os.getpid()
        self.holders = holders.HolderScanner(self, holders.DeviceFiles(self, **devices))

    def boot_id(self) -> str | None:
        """This boot's ID, read once from a real ``proc`` (fixed while this process runs)."""
        try:
            found = self._boot_id or _read_text(f"{self.root}/sys/kernel/random/boot_id")
        except OSError:
            return None
        self._boot_id = (found.strip() or None) if self._real_proc else None
        return found.strip() or None

    def pid_max(self) -> int:
        try:
            return int(_read_text(f"{self.root}/sys/kernel/pid_max"))
        except (OSError, ValueError):
            return DEFAULT_PID_MAX

    def char_device_majors(self) -> dict[str, int] | None:
        try:
            return parse_proc_devices(_read_text(f"{self.root}/devices"))
        except OSError:
            return None

    def sees_host_namespaces(self) -> bool | None:
        """Whether this process is in the host's (initial) PID and cgroup namespaces, and so is
        ``<root>/1`` where readable (docs/internals.md); None when our own links are unreadable."""
        pids = self.sees_host_pids()
        if pids is not True:
            return pids
        cgroup_ns = _ns_link(f"{self.root}/self/ns/cgroup")
        if isinstance(cgroup_ns, FileNotFoundError):  # a kernel without cgroup namespaces
            return True
        return None if isinstance(cgroup_ns, OSError) else cgroup_ns == PROC_CGROUP_INIT_INO

    def sees_host_pids(self) -> bool | None:
        """Whether this process, and ``<root>/1`` where readable, are in the host's (initial)
        PID namespace: a PID read here is the host's; None when our own link is unreadable."""
        pid_ns = _ns_link(f"{self.root}/self/ns/pid")
        if pid_ns is None or isinstance(pid_ns, OSError):
            return None
        if pid_ns != PROC_PID_INIT_INO:
            return False
        init_ns = _ns_link(f"{self.root}/1/ns/pid")
        return isinstance(init_ns, OSError) or init_ns in (None, PROC_PID_INIT_INO)

    def list_pids(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return [int(name) for name in names if name.isascii() and name.isdigit()]

    def kernel_threads(self) -> frozenset[int]:
        """Kernel threads, found without scanning them: kthreadd (PID 2) and its children
        without an ``exe`` link whose ``stat`` flags carry PF_KTHREAD (docs/internals.md); empty
        without ``children`` files."""
        try:
            kids = _read_text(f"{self.root}/2/task/2/children").split()
        except OSError:
            return frozenset()
        found: set[int] = set()
        for pid in (2, *(int(kid) for kid in kids if kid.isascii() and kid.isdigit())):
            try:
                os.readlink(f"{self.root}/{pid}/exe")
                continue  # a user-space program
            except OSError as err:
                if err.errno != errno.ENOENT:
                    continue  # unreadable (no ptrace access): let the scan say so
            fields = self.read_stat(pid)
            if fields is not None and fields.kernel_thread:
                found.add(pid)
        return frozenset(found)

    def read_stat(self, pid: int) -> StatFields | None:
        """``/proc/PID/stat`` alone: a cheap identity and state check. None when gone, or
        unknown (:meth:`stat_unless_gone` tells which)."""
        return self.stat_unless_gone(pid) or None

    def stat_unless_gone(self, pid: int) -> StatFields | Literal[False] | None:
        """``/proc/PID/stat`` parsed; False when the process is gone (ENOENT, ESRCH), None when
        the file could not be read otherwise (EACCES, EMFILE, EIO) or parsed: unknown."""
        try:
            return parse_stat(_read_text(f"{self.root}/{pid}/stat"))
        except OSError as err:
            return False if err.errno in GONE_ERRNOS else None

    def thread_group(self, pid: int) -> int | None:
        """The process ``pid`` belongs to (``Tgid`` of ``/proc/PID/status``): ``pid`` itself
        for a process, another for a thread, whose ``/proc/TID`` exists though ``/proc`` does
        not list it; None when unreadable."""
        try:
            found = _status_field(_read_text(f"{self.root}/{pid}/status"), "Tgid")
            return int(found[0]) if len(found) == 1 else None
        except (OSError, ValueError):
            return None

    def is_running(self, pid: int, start_ticks: int) -> bool | None:
        """Whether ``pid`` is still the process started at ``start_ticks``, not exited (nor a
        zombie); None when its ``stat`` cannot be read (:meth:`stat_unless_gone`): unknown."""
        fields = self.stat_unless_gone(pid)
        if fields is None or fields is False:
            return fields  # None: unknown; False: gone
        return fields.starttime == start_ticks and fields.state not in ("Z", "X")

    def _user(self, uid: int) -> str | None:
        if uid not in self._users:
            try:
                self._users[uid] = pwd.getpwuid(uid).pw_name
            except KeyError:
                self._users[uid] = None
        return self._users[uid]

    def read_process(self, pid: int) -> ProcessInfo | None:
        """Facts about one process; None when it does not exist or vanished mid-read. A
        ``stat`` unknown (:meth:`stat_unless_gone`) leaves its facts None: never taken for gone."""
        base = f"{self.root}/{pid}"
        fields = self.stat_unless_gone(pid)
        if fields is False:
            return None
        uid, nspid, vanished = read_ids(base)
        kernel_thread = fields is not None and fields.kernel_thread
        cmdline, exe, gone = ((), None, False) if kernel_thread else _read_command(base)
        vanished |= gone
        cgroup: CgroupInfo | None = None
        try:
            cgroup = parse_cgroup(_read_text(f"{base}/cgroup"))
        except OSError as err:
            vanished |= err.errno in GONE_ERRNOS
        if vanished:  # something was missing: gone for good, or a new process on this PID?
            again = self.stat_unless_gone(pid)
            if again is False or (again and fields and again.starttime != fields.starttime):
                return None
        if not kernel_thread and cgroup is not None and names_infrastructure_unit(cgroup):
            cgroup = dataclasses.replace(cgroup, delegated=self.delegated(cgroup.path))
        info = ProcessInfo(
            pid=pid,
            start_ticks=fields.starttime if fields else None,
            state=fields.state if fields else None,
            ppid=fields.ppid if fields else None,
            pgid=fields.pgrp if fields else None,
            sid=fields.session if fields else None,
            uid=uid,
            user=self._user(uid) if uid is not None else None,
            comm=fields.comm if fields else None,
            exe=exe,
            cmdline=cmdline,
            cgroup=cgroup,
            nspid=nspid,
            kernel_thread=kernel_thread,
        )
        if not kernel_thread and claims_infrastructure(info.names):
            info = dataclasses.replace(info, exe_trusted=self.exe_trusted(pid, exe))
        return info

    def delegated(self, path: str) -> bool | None:
        """Whether systemd marked cgroup ``path`` or one above it as delegated, in the hierarchy
        ``self/mountinfo`` says systemd keeps; None when unreadable, or without CAP_SYS_ADMIN
        (the kernel then hides ``trusted.delegate``)."""
        return None if self._systemd_mount is None else delegation_mark(self._systemd_mount, path)

    @functools.cached_property
    def _systemd_mount(self) -> str | None:
        try:
            mountinfo = _read_text(f"{self.root}/self/mountinfo")
        except OSError:
            mountinfo = ""
        blind = missing_capabilities(self.root, {"CAP_SYS_ADMIN": _CAP_SYS_ADMIN})
        return None if blind else parse_systemd_mount(mountinfo)

    def exe_trusted(self, pid: int, exe: str | None) -> bool | None:
        """Whether the program ``pid`` runs is one only root can have put where it is: the
        running file (``/proc/PID/exe`` followed) and its directory in the process's own root
        are root's and writable by neither group nor others. False when deleted; None when
        unreadable (gone, or no privilege; docs/internals.md)."""
        if exe is None:
            return None
        if exe.endswith(" (deleted)") or not exe.startswith("/"):
            return False
        try:
            program = stat_cached(f"{self.root}/{pid}/exe")
            folder = stat_cached(f"{self.root}/{pid}/root{os.path.dirname(exe)}")
        except OSError:
            return None
        return (
            stat.S_ISREG(program.st_mode)
            and root_only(program)
            and stat.S_ISDIR(folder.st_mode)
            and root_only(folder)
        )

    def read_processes(self, pids: Iterable[int]) -> dict[int, ProcessInfo]:
        found: dict[int, ProcessInfo] = {}
        for pid in pids:
            if pid not in found and (info := self.read_process(pid)) is not None:
                found[pid] = info
        return found

    def _children_files(self, pid: int) -> bool | None:
        """Whether the kernel offers ``task/*/children`` (CONFIG_PROC_CHILDREN); probed once,
        on a live process: None (cannot tell yet) from one that is gone."""
        if self._has_children_files is None:
            if not os.path.isdir(f"{self.root}/{pid}/task/{pid}"):
                return None  # probe again later, on a live one
            self._has_children_files = os.path.exists(f"{self.root}/{pid}/task/{pid}/children")
        return self._has_children_files

    def children(self, pid: int) -> list[int]:
        """Direct children, from ``/proc/PID/task/*/children`` or, without it, a stat scan."""
        if self._children_files(pid) is False:
            return sorted(self._parents_by_scan().get(pid, []))
        task_dir = f"{self.root}/{pid}/task"
        try:
            tids = os.listdir(task_dir)
        except OSError:
            return []
        kids: set[int] = set()
        for tid in tids:
            try:
                found = _read_text(f"{task_dir}/{tid}/children").split()
            except OSError:
                continue  # the thread ended
            kids.update(int(n) for n in found if n.isascii() and n.isdigit())
        return sorted(kids)

    def _parents_by_scan(self) -> dict[int, list[int]]:
        by_parent: dict[int, list[int]] = {}
        for child in self.list_pids():
            fields = self.read_stat(child)
            if fields is not None:
                by_parent.setdefault(fields.ppid, []).append(child)
        return by_parent

    def descendants(
        self, pids: Iterable[int], children: Callable[[int], list[int] | None] | None = None
    ) -> set[int]:
        """Every descendant of ``pids`` (a given PID only if it descends from another); one stat
        scan of /proc without children files. ``children``: a cheaper source where it knows."""
        frontier = list(dict.fromkeys(pids))
        by_parent: dict[int, list[int]] | None = None
        if any(self._children_files(pid) is False for pid in frontier):
            by_parent = self._parents_by_scan()
        seen: set[int] = set()
        while frontier:
            pid = frontier.pop()
            if by_parent is not None:
                kids = by_parent.get(pid, [])
            else:
                known = None if children is None else children(pid)
                kids = self.children(pid) if known is None else known
            for kid in kids:
                if kid not in seen:
                    seen.add(kid)
                    frontier.append(kid)
        return seen


def read_ids(base: str) -> tuple[int | None, tuple[int, ...] | None, bool]:
    """The real uid and ``NSpid`` from the ``status`` of the process at ``base`` (None each
    when unreadable; a uid read before a malformed ``NSpid`` stands), and whether it read as
    gone. The real uid: a user running root's set-user-ID program (``passwd``) has the
    effective uid 0, not root's word. Also how the CLI tells the daemon's user."""
    uid: int | None = None
    nspid: tuple[int, ...] | None = None
    vanished = False
    try:
        status = _read_text(f"{base}/status")
        ids = _status_field(status, "Uid")
        uid = int(ids[0]) if ids else None
        nspid = tuple(int(n) for n in _status_field(status, "NSpid")) or None
    except ValueError:
        pass
    except OSError as err:
        vanished = err.errno in GONE_ERRNOS
    return uid, nspid, vanished


def _read_command(base: str) -> tuple[tuple[str, ...] | None, str | None, bool]:
    """A (user) process's command line (None: unreadable) and ``exe`` link (None: unreadable,
    as a zombie's), and whether either read as gone."""
    vanished = False
    try:
        raw = read_proc_file(f"{base}/cmdline", _COMMAND_BYTES + 1)
        # Its final NULs go only when it was read whole: cut, it goes on.
        args = raw[:_COMMAND_BYTES] if len(raw) > _COMMAND_BYTES else raw.rstrip(b"\0")
        cmdline: tuple[str, ...] | None = (
            tuple(a.decode("utf-8", "replace") for a in args.split(b"\0")) if raw else ()
        )
    except OSError as err:
        vanished |= err.errno in GONE_ERRNOS
        cmdline = None
    exe: str | None = None
    try:
        exe = os.readlink(f"{base}/exe")
    except OSError as err:
        vanished |= err.errno in GONE_ERRNOS  # also zombies; re-checked below
    return cmdline, exe, vanished
