"""A builder for fake ``/proc`` trees in temporary folders, for tests of
``gpuwatchd.collect.procfs``.

It writes the files ``ProcFS`` reads (``stat``, ``status``, ``cmdline``, ``cgroup``, ``maps``,
``fd/N`` links, ``task/*/children``, host-wide files) with the kernel's formats, so tests can
describe hosts that are hard to produce for real: PID reuse, hostile ``comm`` values, kernel
threads, containers. It never touches the real ``/proc`` and starts no processes.

Fd entries are symlinks, so in path mode they point at files in a fake devices folder, and in
device-number mode they can point at real character devices (``/dev/null`` is 1:3).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

STAT_FIELDS = 52
PF_KTHREAD = 0x00200000
DEFAULT_CGROUP = "0::/user.slice/user-1000.slice/session-1.scope\n"


def format_stat(
    pid: int,
    comm: str,
    *,
    state: str = "S",
    ppid: int = 1,
    pgrp: int | None = None,
    session: int | None = None,
    flags: int = 0,
    num_threads: int = 1,
    starttime: int = 1000,
) -> str:
    """A ``/proc/PID/stat`` line with the given fields and zeros elsewhere."""
    rest = ["0"] * (STAT_FIELDS - 2)  # fields 3..52
    rest[0] = state
    rest[1] = str(ppid)
    rest[2] = str(pid if pgrp is None else pgrp)
    rest[3] = str(pid if session is None else session)
    rest[6] = str(flags)
    rest[17] = str(num_threads)
    rest[19] = str(starttime)
    return f"{pid} ({comm}) {' '.join(rest)}\n"


def make_devices(
    folder: Path, minors: Iterable[int] = (0,), *, ctl: bool = True, uvm: bool = True
) -> Path:
    """Stand-in device files (4 KiB regular files, so real children can mmap them)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"nvidia{m}" for m in minors]
    names += ["nvidiactl"] * ctl + ["nvidia-uvm"] * uvm
    for name in names:
        (folder / name).write_bytes(b"\0" * 4096)
    return folder


class FakeProc:
    """A fake ``/proc`` under ``root``. ``children_files=False`` models a kernel without
    CONFIG_PROC_CHILDREN (then ``task/*/children`` is absent)."""

    def __init__(self, root: Path, *, children_files: bool = True) -> None:
        self.root = root
        self.children_files = children_files
        self._parents: dict[int, int] = {}
        self._next_map = 0x7F0000000000
        root.mkdir(parents=True, exist_ok=True)
        self.write("sys/kernel/random/boot_id", "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n")
        self.write("sys/kernel/pid_max", "4194304\n")
        self.write("devices", "Character devices:\n  1 mem\n195 nvidia-frontend\n")

    def write(self, relative: str, text: str) -> Path:
        """Write any file under the fake root (``devices``, ``sys/...``)."""
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def add(
        self,
        pid: int,
        *,
        comm: str = "python3",
        state: str = "S",
        ppid: int = 1,
        pgrp: int | None = None,
        session: int | None = None,
        starttime: int = 1000,
        flags: int = 0,
        num_threads: int = 1,
        uid: int = 1000,
        cmdline: Iterable[str] | None = None,
        exe: str | None = "/usr/bin/python3",
        cgroup: str = DEFAULT_CGROUP,
        nspid: Iterable[int] | None = None,
        fds: dict[int, str] | None = None,
        maps: Iterable[str] = (),
    ) -> Path:
        """Create (or replace, as PID reuse does) process ``pid``; returns its folder."""
        self.remove(pid)
        base = self.root / str(pid)
        (base / "fd").mkdir(parents=True)
        (base / "task" / str(pid)).mkdir(parents=True)
        stat = format_stat(
            pid,
            comm,
            state=state,
            ppid=ppid,
            pgrp=pgrp,
            session=session,
            flags=flags,
            num_threads=num_threads,
            starttime=starttime,
        )
        (base / "stat").write_text(stat)
        ns = " ".join(str(n) for n in (nspid or (pid,)))
        status = (
            f"Name:\t{comm[:15]}\nState:\t{state}\nTgid:\t{pid}\nPid:\t{pid}\nPPid:\t{ppid}\n"
            f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
            f"NStgid:\t{ns}\nNSpid:\t{ns}\nThreads:\t{num_threads}\n"
        )
        (base / "status").write_text(status)
        args = [comm] if cmdline is None else list(cmdline)
        (base / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in args))
        (base / "comm").write_text(comm[:15] + "\n")
        (base / "cgroup").write_text(cgroup)
        (base / "maps").write_text("".join(line.rstrip("\n") + "\n" for line in maps))
        if exe is not None:
            (base / "exe").symlink_to(exe)
        for fd, target in (fds or {}).items():
            self.open_fd(pid, fd, target)
        self._parents[pid] = ppid
        self._write_children(ppid)
        self._write_children(pid)
        return base

    def add_kernel_thread(self, pid: int, comm: str = "kworker/0:1") -> Path:
        return self.add(
            pid, comm=comm, ppid=2, flags=PF_KTHREAD, cmdline=(), exe=None, cgroup="0::/\n"
        )

    def remove(self, pid: int) -> None:
        base = self.root / str(pid)
        if not base.exists():
            return
        for path in sorted(base.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if path.is_symlink() or path.is_file():
                path.unlink()
            else:
                path.chmod(0o755)
                path.rmdir()
        base.rmdir()
        parent = self._parents.pop(pid, None)
        if parent is not None:
            self._write_children(parent)

    def open_fd(self, pid: int, fd: int, target: str) -> None:
        """``/proc/PID/fd/<fd>`` as a link to ``target`` (a path, or e.g. ``pipe:[123]``)."""
        os.symlink(target, self.root / str(pid) / "fd" / str(fd))

    def add_mapping(
        self,
        pid: int,
        path: str,
        *,
        inode: int = 123,
        device: str = "00:05",
        map_file: str | None = None,
    ) -> str:
        """Append a 4 KiB shared mapping of ``path`` to ``/proc/PID/maps``; returns its range.

        ``map_file`` makes ``/proc/PID/map_files/<range>`` a link to that path (e.g. a real
        character device), as the kernel offers to CAP_SYS_ADMIN.
        """
        start = self._next_map
        self._next_map += 0x10000
        address = f"{start:x}-{start + 0x1000:x}"
        line = f"{address} rw-s 00000000 {device} {inode}                      {path}\n"
        with (self.root / str(pid) / "maps").open("a") as maps:
            maps.write(line)
        if map_file is not None:
            folder = self.root / str(pid) / "map_files"
            folder.mkdir(exist_ok=True)
            (folder / address).symlink_to(map_file)
        return address

    def set_root_link(self, pid: int, target: str = "/") -> None:
        """``/proc/PID/root``: the process's root directory, for the mapping fallback."""
        (self.root / str(pid) / "root").symlink_to(target)

    def set_self(self, pid: int, *, pid_ns: int, cgroup_ns: int | None) -> None:
        """``self`` and its namespace links (``pid:[inode]``)."""
        (self.root / "self").unlink(missing_ok=True)
        (self.root / "self").symlink_to(str(pid))
        ns = self.root / str(pid) / "ns"
        ns.mkdir(parents=True, exist_ok=True)
        (ns / "pid").symlink_to(f"pid:[{pid_ns}]")
        if cgroup_ns is not None:
            (ns / "cgroup").symlink_to(f"cgroup:[{cgroup_ns}]")

    def _write_children(self, pid: int) -> None:
        task = self.root / str(pid) / "task" / str(pid)
        if not self.children_files or not task.is_dir():
            return
        kids = sorted(child for child, parent in self._parents.items() if parent == pid)
        (task / "children").write_text("".join(f"{k} " for k in kids))
