"""Host process facts and the scan for holders of NVIDIA device files, read from ``/proc``.

This module owns every read of ``/proc`` (whose root is a parameter, so tests point it at a fake
tree) and the pure parsers for its formats. It never signals, never decides, and never imports
NVML: it reports what it saw, with ``None`` for what it could not see.

What is read, per process: ``stat`` (state, ppid, pgrp, session, flags, thread count, start time
in clock ticks, and ``comm``, which the kernel keeps in the same buffer as ``/proc/PID/comm``),
``status`` (effective uid, ``NSpid``), ``cmdline``, the ``exe`` link and ``cgroup``. Host-wide:
``sys/kernel/random/boot_id``, ``sys/kernel/pid_max``, ``devices`` and the ``ns`` links of
``self``. A process that vanishes mid-read is a normal outcome (``read_process`` returns None).

The holder scan looks at every fd (``/proc/PID/fd``) and every mapping (``/proc/PID/maps``) of a
process, in one of two match modes:

- **Device-number mode** (production, ``devices_dir == "/dev"``): an fd link is read with
  ``readlink`` (cheap); only a target that is a path containing ``/dev/`` or ``nvidia`` is then
  ``stat``-ed through the fd itself, and it counts when it is a character device with major
  ``device_major`` (195): minor 0-247 is that GPU, ``ctl_minor`` (255) is nvidiactl; major
  ``uvm_major`` (from ``/proc/devices``) with ``uvm_minor`` (0) is nvidia-uvm. Inside a container
  host GPU 3 can be called ``/dev/nvidia0``, which is why names are not trusted. The maps text is
  searched for ``/dev/`` or ``nvidia`` as a whole, and only matching lines are split; each
  distinct mapped file is identified by device number through ``/proc/PID/map_files/<range>``
  (needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE), else through the path under
  ``/proc/PID/root/`` when that path's inode equals the mapped inode, else by its name alone, in
  which case the PID is listed in ``HolderScan.matched_by_name`` (its minor may be a container's
  numbering). Mappings under ``/dev/shm/`` (a ``nodev`` tmpfs) and shared anonymous memory
  (``/dev/zero (deleted)``) are skipped without a ``stat``.
- **Path mode** (tests, ``devices_dir`` elsewhere, or ``match_by_path=True``): a holder is a
  process whose fd link or mapping path is exactly ``<devices_dir>/nvidiaN``, ``nvidiactl`` or
  ``nvidia-uvm``. Tests can force device-number mode with real character devices by passing
  ``match_by_path=False`` and e.g. ``device_major=1`` (``/dev/null`` is 1:3, so "GPU 3").

"Unreadable": a process whose fd directory, fd links or maps could not be read (EACCES/EPERM,
or anything else that is not "gone") is listed in ``HolderScan.unreadable``. That means
*unknown*, never "holds nothing"; whatever was read before the failure is still reported. A
process that vanished (ENOENT/ESRCH) is skipped silently. Kernel threads and the scanning
process itself are skipped. A zombie thread-group leader whose other threads still run is
scanned through one of those threads (a zombie leader's own fd table and memory are gone).

Fd targets are stat-ed once per distinct target string per process (a CUDA process holds dozens
of fds on the same node), and mapped files once per (device, inode) pair per scan.
"""

from __future__ import annotations

import errno
import functools
import os
import pwd
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

from gpuwatchd.model import CgroupInfo, DeviceHolding, HolderScan, ProcessInfo

PF_KTHREAD = 0x00200000
NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
MAX_GPU_MINOR = 247  # 248-253 unused, 254 nvidia-modeset, 255 nvidiactl
DEFAULT_PID_MAX = 4194304
# Inode numbers of the initial namespaces, fixed by the kernel (include/linux/proc_ns.h).
PROC_PID_INIT_INO = 0xEFFFFFFC
PROC_CGROUP_INIT_INO = 0xEFFFFFFB

_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ESRCH})
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC
_DEVICE_NAME = re.compile(r"nvidia(\d+)|nvidiactl|nvidia-uvm")


class _Gone(Exception):
    """The process vanished while being read."""


class _Denied(Exception):
    """The process exists but this part of it could not be read."""


def _classify_error(err: OSError) -> Exception:
    return _Gone() if err.errno in _GONE_ERRNOS else _Denied()


# --- pure parsers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StatFields:
    """The fields of ``/proc/PID/stat`` gpuwatchd uses. ``starttime`` is field 22 (ticks)."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    flags: int
    num_threads: int
    starttime: int

    @property
    def kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


def parse_stat(text: str) -> StatFields | None:
    """Parse one ``/proc/PID/stat`` line; None when it is malformed. Pure.

    ``comm`` may hold anything but NUL (``foo) Z 1 (`` included), so it is taken from the first
    ``(`` to the *last* ``)``; the numeric fields follow the last ``)``.
    """
    opening = text.find("(")
    closing = text.rfind(")")
    if opening < 0 or closing < opening:
        return None
    rest = text[closing + 1 :].split()
    if len(rest) < 20:  # fields 3..22
        return None
    try:
        return StatFields(
            pid=int(text[:opening]),
            comm=text[opening + 1 : closing],
            state=rest[0],
            ppid=int(rest[1]),
            pgrp=int(rest[2]),
            session=int(rest[3]),
            flags=int(rest[6]),
            num_threads=int(rest[17]),
            starttime=int(rest[19]),
        )
    except ValueError:
        return None


_DOCKER_SCOPE = re.compile(r"docker-([0-9a-f]{12,64})\.scope")
_CONTAINERD_SCOPE = re.compile(r"cri-containerd-([0-9a-f]{12,64})\.scope")
_CRIO_SCOPE = re.compile(r"crio-(?:conmon-)?([0-9a-f]{12,64})(?:\.scope)?")
_PODMAN_SCOPE = re.compile(r"libpod-(?:conmon-)?([0-9a-f]{12,64})(?:\.scope)?")
_BARE_ID = re.compile(r"[0-9a-f]{64}")
_POD_SLICE = re.compile(r"kubepods(?:-[a-z]+)?-pod([0-9a-fA-F_-]+)\.slice")
_POD_DIR = re.compile(r"pod([0-9a-fA-F]{8}-[0-9a-fA-F-]{27,})")
_SLURM_JOB = re.compile(r"job_(\d+)")
_SLURM_STEP = re.compile(r"step_(\w+)")
# Cheap substring checks that must hold for a path to name a job or container.
_JOB_HINTS = ("job_", "docker", "containerd", "crio-", "libpod-", "kubepods")


@functools.lru_cache(maxsize=4096)
def _classify_cgroup_path(path: str) -> CgroupInfo:
    """What one cgroup path names: container, pod, Slurm job and step, systemd unit. Pure."""
    parts = [p for p in path.split("/") if p]
    container_id: str | None = None
    runtime: str | None = None
    pod_uid: str | None = None
    slurm_job: str | None = None
    slurm_step: str | None = None
    unit: str | None = None
    in_slurm = False
    for index, part in enumerate(parts):
        if part.endswith((".service", ".scope")):
            unit = part
        if match := _POD_SLICE.fullmatch(part):
            pod_uid = match.group(1).replace("_", "-")
        elif (match := _POD_DIR.fullmatch(part)) and index > 0 and "kubepods" in parts[0]:
            pod_uid = match.group(1)
        for pattern, name in (
            (_DOCKER_SCOPE, "docker"),
            (_CONTAINERD_SCOPE, "containerd"),
            (_CRIO_SCOPE, "crio"),
            (_PODMAN_SCOPE, "podman"),
        ):
            if match := pattern.fullmatch(part):
                container_id, runtime = match.group(1), name
        if index > 0 and parts[index - 1] == "docker" and _BARE_ID.fullmatch(part):
            container_id, runtime = part, "docker"  # docker's cgroupfs driver: /docker/<id>
        elif pod_uid is not None and container_id is None and _BARE_ID.fullmatch(part):
            container_id = part  # kubelet's cgroupfs driver: /kubepods/<qos>/pod<uid>/<id>
        if part.startswith("slurm") or part.endswith("_slurmstepd.scope"):
            in_slurm = True
        elif in_slurm and slurm_job is None and (match := _SLURM_JOB.fullmatch(part)):
            slurm_job = match.group(1)
        elif slurm_job is not None and slurm_step is None and (m := _SLURM_STEP.fullmatch(part)):
            slurm_step = m.group(1)
    return CgroupInfo(
        path=path,
        container_id=container_id,
        container_runtime=runtime,
        pod_uid=pod_uid,
        slurm_job=slurm_job,
        slurm_step=slurm_step,
        systemd_unit=unit,
    )


def parse_cgroup(text: str) -> CgroupInfo | None:
    """Parse ``/proc/PID/cgroup`` (v1, v2 or hybrid) into the path that names the job. Pure.

    Each line is ``hierarchy-ID:controllers:path``. The first line whose path names a Slurm job
    or a container wins (on cgroup v1 Slurm lives only in some controllers); else the unified
    ``0::`` line, else ``name=systemd``, else the first line. None when no line parses.
    """
    entries: list[tuple[str, str, str]] = []
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) == 3 and fields[2].startswith("/"):
            entries.append((fields[0], fields[1], fields[2]))
    if not entries:
        return None
    for _, _, path in entries:
        if any(hint in path for hint in _JOB_HINTS):
            info = _classify_cgroup_path(path)
            if info.slurm_job is not None or info.container_id is not None or info.pod_uid:
                return info
    for hierarchy, controllers, path in entries:
        if hierarchy == "0" and controllers == "":
            return _classify_cgroup_path(path)
    for _, controllers, path in entries:
        if controllers == "name=systemd":
            return _classify_cgroup_path(path)
    return _classify_cgroup_path(entries[0][2])


def parse_proc_devices(text: str) -> dict[str, int]:
    """The character-device section of ``/proc/devices`` as name -> major. Pure."""
    majors: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices"):
            in_char = True
            continue
        if line.startswith("Block devices"):
            break
        fields = line.split()
        if in_char and len(fields) == 2 and fields[0].isdigit():
            majors.setdefault(fields[1], int(fields[0]))
    return majors


def _ns_inode(link: str) -> int | None:
    """The inode of a namespace link text such as ``pid:[4026531836]``."""
    start, end = link.find("["), link.rfind("]")
    if start < 0 or end < start:
        return None
    try:
        return int(link[start + 1 : end])
    except ValueError:
        return None


def _status_field(status: str, name: str) -> list[str]:
    """The values of one ``Name:`` line of ``/proc/PID/status``, found without a full split."""
    at = status.find(f"\n{name}:")
    if at < 0:
        return []
    end = status.find("\n", at + 1)
    return status[at + len(name) + 2 : None if end < 0 else end].split()


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


# --- the reader -------------------------------------------------------------------------------


class _Found:
    """What one process was seen holding, accumulated across fds and mappings."""

    __slots__ = ("by_name", "ctl", "gpu_fd", "gpu_map", "uvm")

    def __init__(self) -> None:
        self.gpu_fd: set[int] = set()
        self.gpu_map: set[int] = set()
        self.ctl = False
        self.uvm = False
        self.by_name = False

    def add(self, kind: str, minor: int, via_map: bool) -> None:
        if kind == "gpu":
            (self.gpu_map if via_map else self.gpu_fd).add(minor)
        elif kind == "ctl":
            self.ctl = True
        elif kind == "uvm":
            self.uvm = True

    def holding(self, pid: int) -> DeviceHolding | None:
        if not (self.gpu_fd or self.gpu_map or self.ctl or self.uvm):
            return None
        return DeviceHolding(
            pid, frozenset(self.gpu_fd), frozenset(self.gpu_map), self.ctl, self.uvm
        )


_Match = tuple[str, int]  # ("gpu", minor) | ("ctl", 0) | ("uvm", 0)


class ProcFS:
    """Reads process facts and device holders from a ``/proc`` tree rooted at ``root``."""

    def __init__(
        self,
        root: str = "/proc",
        *,
        devices_dir: str = "/dev",
        device_major: int = NVIDIA_MAJOR,
        uvm_major: int | None = None,
        ctl_minor: int = NVIDIACTL_MINOR,
        uvm_minor: int = 0,
        match_by_path: bool | None = None,
    ) -> None:
        self.root = root.rstrip("/") or "/"
        self.devices_dir = devices_dir
        self.device_major = device_major
        self.ctl_minor = ctl_minor
        self.uvm_minor = uvm_minor
        self.match_by_path = (devices_dir != "/dev") if match_by_path is None else match_by_path
        self._uvm_major = uvm_major
        self._uvm_major_read = uvm_major is not None
        self._users: dict[int, str | None] = {}
        self._has_children_files: bool | None = None
        self._device_prefix = os.path.realpath(devices_dir).rstrip("/") + "/"
        self._self_pid = self._read_self_pid()

    # --- host-wide facts ---

    def _read_bytes(self, path: str) -> bytes:
        """The whole file, read in chunks (``/proc`` files report size 0, so no single read)."""
        fd = os.open(path, _READ_FLAGS)
        try:
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks)

    def _read_text(self, path: str) -> str:
        return _decode(self._read_bytes(path))

    def _read_self_pid(self) -> int:
        try:
            return int(os.readlink(f"{self.root}/self"))
        except (OSError, ValueError):
            return os.getpid()

    def boot_id(self) -> str | None:
        try:
            return self._read_text(f"{self.root}/sys/kernel/random/boot_id").strip() or None
        except OSError:
            return None

    def pid_max(self) -> int:
        try:
            return int(self._read_text(f"{self.root}/sys/kernel/pid_max"))
        except (OSError, ValueError):
            return DEFAULT_PID_MAX

    def uvm_major(self) -> int | None:
        """nvidia-uvm's dynamic major from ``<root>/devices``, read once; None when absent."""
        if not self._uvm_major_read:
            try:
                majors = parse_proc_devices(self._read_text(f"{self.root}/devices"))
                self._uvm_major = majors.get("nvidia-uvm")
                self._uvm_major_read = True
            except OSError:
                return None  # try again next time
        return self._uvm_major

    def sees_host_namespaces(self) -> bool | None:
        """Whether this process is in the host's (initial) PID and cgroup namespaces.

        The kernel gives the initial namespaces fixed inode numbers, so ``<root>/self/ns/pid``
        and ``ns/cgroup`` are compared with those constants; when ``<root>/1/ns/pid`` is
        readable it must be the initial one too (a /proc mounted from a container's namespace
        shows that container's init as PID 1). None when our own links cannot be read. A kernel
        without cgroup namespaces has one cgroup view, which counts as the host's. Limits: this
        says nothing about the mount namespace (device nodes are matched by number for that
        reason), and a daemon deliberately run in a nested PID namespace (as the end-to-end
        tests do) is reported as not seeing the host, which is the safe answer.
        """
        try:
            pid_ns = _ns_inode(os.readlink(f"{self.root}/self/ns/pid"))
        except OSError:
            return None
        if pid_ns is None:
            return None
        if pid_ns != PROC_PID_INIT_INO:
            return False
        try:
            cgroup_ns = _ns_inode(os.readlink(f"{self.root}/self/ns/cgroup"))
        except FileNotFoundError:
            cgroup_ns = PROC_CGROUP_INIT_INO
        except OSError:
            return None
        if cgroup_ns != PROC_CGROUP_INIT_INO:
            return False
        try:
            init_ns = _ns_inode(os.readlink(f"{self.root}/1/ns/pid"))
        except OSError:
            return True
        return init_ns in (None, PROC_PID_INIT_INO)

    # --- processes ---

    def list_pids(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return [int(name) for name in names if name.isdigit()]

    def read_stat(self, pid: int) -> StatFields | None:
        """``/proc/PID/stat`` alone: a cheap identity and state check. None when gone."""
        try:
            return parse_stat(self._read_text(f"{self.root}/{pid}/stat"))
        except OSError:
            return None

    def _user(self, uid: int) -> str | None:
        if uid not in self._users:
            try:
                self._users[uid] = pwd.getpwuid(uid).pw_name
            except KeyError:
                self._users[uid] = None
        return self._users[uid]

    def read_process(self, pid: int) -> ProcessInfo | None:
        """Facts about one process; None when it does not exist or vanished mid-read."""
        base = f"{self.root}/{pid}"
        try:
            fields = parse_stat(self._read_text(f"{base}/stat"))
        except OSError:
            return None
        vanished = False
        uid: int | None = None
        nspid: tuple[int, ...] | None = None
        try:
            status = self._read_text(f"{base}/status")
            ids = _status_field(status, "Uid")
            uid = int(ids[1]) if len(ids) > 1 else None  # the effective uid, as ps shows
            nspid = tuple(int(n) for n in _status_field(status, "NSpid")) or None
        except ValueError:
            pass
        except OSError as err:
            vanished |= err.errno in _GONE_ERRNOS
        kernel_thread = fields is not None and fields.kernel_thread
        cmdline: tuple[str, ...] | None = ()
        exe: str | None = None
        if not kernel_thread:
            try:
                raw = self._read_bytes(f"{base}/cmdline")
                cmdline = tuple(_decode(a) for a in raw.rstrip(b"\0").split(b"\0")) if raw else ()
            except OSError as err:
                vanished |= err.errno in _GONE_ERRNOS
                cmdline = None
            try:
                exe = os.readlink(f"{base}/exe")
            except OSError as err:
                vanished |= err.errno in _GONE_ERRNOS  # also zombies; re-checked below
        cgroup: CgroupInfo | None = None
        try:
            cgroup = parse_cgroup(self._read_text(f"{base}/cgroup"))
        except OSError as err:
            vanished |= err.errno in _GONE_ERRNOS
        if vanished:  # something was missing: gone for good, or a new process on this PID?
            try:
                again = parse_stat(self._read_text(f"{base}/stat"))
            except OSError:
                return None
            if fields is not None and (again is None or again.starttime != fields.starttime):
                return None
        return ProcessInfo(
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

    def read_processes(self, pids: Iterable[int]) -> dict[int, ProcessInfo]:
        found: dict[int, ProcessInfo] = {}
        for pid in pids:
            if pid not in found and (info := self.read_process(pid)) is not None:
                found[pid] = info
        return found

    def _children_files(self, pid: int) -> bool:
        """Whether the kernel offers ``task/*/children`` (CONFIG_PROC_CHILDREN); probed once."""
        if self._has_children_files is None:
            if not os.path.isdir(f"{self.root}/{pid}/task/{pid}"):
                return False  # cannot tell from a process that is gone; probe again later
            self._has_children_files = os.path.exists(f"{self.root}/{pid}/task/{pid}/children")
        return self._has_children_files

    def children(self, pid: int) -> list[int]:
        """Direct children, from ``/proc/PID/task/*/children`` or, without it, a stat scan."""
        if not self._children_files(pid):
            return sorted(self._parents_by_scan().get(pid, []))
        task_dir = f"{self.root}/{pid}/task"
        try:
            tids = os.listdir(task_dir)
        except OSError:
            return []
        kids: set[int] = set()
        for tid in tids:
            try:
                kids.update(int(n) for n in self._read_text(f"{task_dir}/{tid}/children").split())
            except (OSError, ValueError):
                continue  # the thread ended
        return sorted(kids)

    def _parents_by_scan(self) -> dict[int, list[int]]:
        by_parent: dict[int, list[int]] = {}
        for child in self.list_pids():
            fields = self.read_stat(child)
            if fields is not None:
                by_parent.setdefault(fields.ppid, []).append(child)
        return by_parent

    def descendants(self, pids: Iterable[int]) -> set[int]:
        """Every descendant of ``pids``; a given PID is included only if it descends from
        another given PID. Without children files this costs one stat scan of /proc."""
        frontier = list(dict.fromkeys(pids))
        by_parent: dict[int, list[int]] | None = None
        if any(not self._children_files(pid) for pid in frontier):
            by_parent = self._parents_by_scan()
        seen: set[int] = set()
        while frontier:
            pid = frontier.pop()
            kids = self.children(pid) if by_parent is None else by_parent.get(pid, [])
            for kid in kids:
                if kid not in seen:
                    seen.add(kid)
                    frontier.append(kid)
        return seen

    # --- device holders ---

    def _match_rdev(self, st: os.stat_result) -> _Match | None:
        if not stat.S_ISCHR(st.st_mode):
            return None
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        if major == self.device_major and minor == self.ctl_minor:
            return ("ctl", 0)
        uvm_major = self.uvm_major()
        if uvm_major is not None and major == uvm_major and minor == self.uvm_minor:
            return ("uvm", 0)
        if major == self.device_major and minor <= MAX_GPU_MINOR:
            return ("gpu", minor)
        return None

    @staticmethod
    def _match_name(name: str) -> _Match | None:
        """``nvidia3`` / ``nvidiactl`` / ``nvidia-uvm`` (a basename) to what it stands for."""
        match = _DEVICE_NAME.fullmatch(name)
        if match is None:
            return None
        if match.group(1) is not None:
            return ("gpu", int(match.group(1)))
        return ("ctl", 0) if name == "nvidiactl" else ("uvm", 0)

    def _scan_fds(self, fd_dir: str, found: _Found) -> bool:
        """Add what the fds in ``fd_dir`` hold; False when the fd table was empty."""
        try:
            dfd = os.open(fd_dir, _DIR_FLAGS)
        except OSError as err:
            raise _classify_error(err) from None
        try:
            try:
                names = os.listdir(dfd)
            except OSError as err:
                raise _classify_error(err) from None
            try:
                # One C-level loop over the fds; the careful loop only when an fd misbehaves.
                fd_of = dict(zip(map(partial(os.readlink, dir_fd=dfd), names), names, strict=True))
            except OSError as err:
                if err.errno not in _GONE_ERRNOS or not os.path.exists(f"{fd_dir}/."):
                    raise _classify_error(err) from None
                fd_of = self._readlinks_carefully(dfd, names)
            if self.match_by_path:
                prefix = self._device_prefix
                for target in fd_of:
                    what = (
                        self._match_name(target[len(prefix) :])
                        if target.startswith(prefix)
                        else None
                    )
                    if what is not None:
                        found.add(*what, via_map=False)
                return bool(names)
            for target, name in fd_of.items():
                if target[:1] != "/" or ("/dev/" not in target and "nvidia" not in target):
                    continue
                try:
                    what = self._match_rdev(os.stat(name, dir_fd=dfd))
                except FileNotFoundError:
                    continue
                except OSError as err:
                    raise _classify_error(err) from None
                if what is not None:
                    found.add(*what, via_map=False)
            return bool(names)
        finally:
            os.close(dfd)

    @staticmethod
    def _readlinks_carefully(dfd: int, names: list[str]) -> dict[str, str]:
        fd_of: dict[str, str] = {}
        for name in names:
            try:
                fd_of[os.readlink(name, dir_fd=dfd)] = name
            except FileNotFoundError:
                continue  # closed since the listing
            except OSError as err:
                raise _classify_error(err) from None
        return fd_of

    def _scan_maps(
        self, base: str, found: _Found, by_inode: dict[tuple[bytes, bytes], _Match | None]
    ) -> bool:
        """Add what the mappings of the process at ``base`` hold; False when it has none."""
        try:
            data = self._read_bytes(f"{base}/maps")
        except OSError as err:
            raise _classify_error(err) from None
        if self.match_by_path:
            markers: tuple[bytes, ...] = (os.fsencode(self._device_prefix),)
        else:
            markers = (b"/dev/", b"nvidia")
        if not any(marker in data for marker in markers):
            return bool(data)
        for line in self._lines_containing(data, markers):
            fields = line.split(None, 5)
            if len(fields) < 6 or fields[4] == b"0":
                continue
            address, _, _, device, inode, raw_path = fields
            path = os.fsdecode(raw_path)
            if self.match_by_path:
                if path.startswith(self._device_prefix):
                    what = self._match_name(path[len(self._device_prefix) :])
                    if what is not None:
                        found.add(*what, via_map=True)
                continue
            # /dev/shm is a nodev tmpfs: a path we skip, not a temporary file we create.
            if path.startswith("/dev/shm/") or path == "/dev/zero (deleted)":  # noqa: S108
                continue
            key = (device, inode)
            if key in by_inode:
                what = by_inode[key]
            else:
                what, certain = self._identify_mapping(base, os.fsdecode(address), path, inode)
                if certain:
                    by_inode[key] = what
                elif what is not None:
                    found.by_name = True
            if what is not None:
                found.add(*what, via_map=True)
        return True

    @staticmethod
    def _lines_containing(data: bytes, markers: tuple[bytes, ...]) -> list[bytes]:
        """The distinct lines of ``data`` containing any marker, found without splitting all."""
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

    def _identify_mapping(
        self, base: str, address: str, path: str, inode: bytes
    ) -> tuple[_Match | None, bool]:
        """(what a mapped file is, whether that was proven by device number)."""
        try:
            return self._match_rdev(os.stat(f"{base}/map_files/{address}")), True
        except OSError:
            pass
        if not path.endswith(" (deleted)"):
            try:
                st = os.stat(f"{base}/root{path}")
                if str(st.st_ino).encode() == inode:
                    return self._match_rdev(st), True
            except OSError:
                pass
        if "/dev/" not in path:
            return None, False
        return self._match_name(path.rsplit("/", 1)[-1]), False

    def _scan_process(
        self, pid: int, by_inode: dict[tuple[bytes, bytes], _Match | None]
    ) -> tuple[_Found | None, bool]:
        """(what ``pid`` holds, whether part of it was unreadable); (None, False) when gone."""
        base = f"{self.root}/{pid}"
        found = _Found()
        unreadable = False
        had_fds = had_maps = True
        try:
            had_fds = self._scan_fds(f"{base}/fd", found)
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
            fields = self.read_stat(pid)
            if fields is None:
                return None, False
            if fields.kernel_thread:
                return None, False
            if fields.state == "Z" and fields.num_threads > 1 and not unreadable:
                return self._scan_live_thread(pid, by_inode)
        return found, unreadable

    def _scan_live_thread(
        self, pid: int, by_inode: dict[tuple[bytes, bytes], _Match | None]
    ) -> tuple[_Found | None, bool]:
        found = _Found()
        try:
            tids = [t for t in os.listdir(f"{self.root}/{pid}/task") if t != str(pid)]
        except OSError:
            return found, True
        for tid in tids:
            task = f"{self.root}/{pid}/task/{tid}"
            try:
                self._scan_fds(f"{task}/fd", found)
                self._scan_maps(task, found, by_inode)
            except _Gone:
                continue
            except _Denied:
                return found, True
            return found, False
        return found, False

    def scan_holders(
        self, pids: Iterable[int] | None = None, *, exclude: Iterable[int] = ()
    ) -> HolderScan:
        """Find holders of NVIDIA device files: all of /proc when ``pids`` is None ("full"),
        else exactly ``pids`` ("targeted"). Skips ourselves, ``exclude`` and kernel threads."""
        mode = "full" if pids is None else "targeted"
        candidates = self.list_pids() if pids is None else list(dict.fromkeys(pids))
        skip = {self._self_pid, *exclude}
        holdings: dict[int, DeviceHolding] = {}
        unreadable: set[int] = set()
        by_name: set[int] = set()
        by_inode: dict[tuple[bytes, bytes], _Match | None] = {}
        for pid in candidates:
            if pid in skip or pid <= 0:
                continue
            found, denied = self._scan_process(pid, by_inode)
            if found is None:
                continue
            if denied:
                unreadable.add(pid)
            if (holding := found.holding(pid)) is not None:
                holdings[pid] = holding
                if found.by_name:
                    by_name.add(pid)
        return HolderScan(
            mode=mode,
            holdings=holdings,
            unreadable=frozenset(unreadable),
            matched_by_name=frozenset(by_name),
        )
