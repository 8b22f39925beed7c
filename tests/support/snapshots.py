"""Builders for hand-made Snapshots, for tests of the pure core (assess, plan, simulate).

This module owns a small fluent builder that reads like the host it describes::

    snap = (
        HostBuilder()
        .gpu(0, allocated=900 * MIB)
        .proc(100, comm="python", holds={0}, uvm=True)  # the trainer
        .proc(101, ppid=100, holds={0}, uvm=True)  # its DataLoader worker
        .nvml(0, 100, used=800 * MIB)
        .build()
    )

Children inherit their parent's process group, session and cgroup unless told otherwise, so a
worker is one line. Every column can be forced to ``None`` (unknown). It does no I/O and reads
no clock: every time comes from the builder's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Final

from gpuwatchd.core.model import (
    MIB,
    CgroupInfo,
    DeviceHolding,
    FileSharing,
    GpuInfo,
    GpuMemory,
    HolderScan,
    NvmlProcess,
    NvmlReading,
    ProcessInfo,
    Snapshot,
)

GIB = 1024 * MIB
DEFAULT_TOTAL = 80 * GIB
DEFAULT_RESERVED = 512 * MIB


class _Inherit:
    """Sentinel: take the value from the parent process (or a sensible default)."""

    def __repr__(self) -> str:
        return "INHERIT"


INHERIT: Final = _Inherit()


def gpu_uuid(index: int) -> str:
    """The UUID the builder gives GPU ``index``."""
    return f"GPU-{index:08d}-aaaa-bbbb-cccc-{index:012d}"


# --- cgroups, as collection would map them ----------------------------------------------------


def cg_slurm(
    job: str, step: str = "batch", scope: str = "/system.slice/slurmstepd.scope"
) -> CgroupInfo:
    return CgroupInfo(
        path=f"{scope}/job_{job}/step_{step}/user/task_0",
        slurm_job=job,
        slurm_step=step,
        slurm_job_dir=f"{scope}/job_{job}",
    )


def cg_pod(uid: str, container: str = "c0ffee") -> CgroupInfo:
    return CgroupInfo(
        path=f"/kubepods.slice/kubepods-pod{uid}.slice/cri-containerd-{container}.scope",
        container_id=container,
        container_runtime="containerd",
        pod_uid=uid,
    )


def cg_container(cid: str) -> CgroupInfo:
    return CgroupInfo(
        path=f"/system.slice/docker-{cid}.scope", container_id=cid, container_runtime="docker"
    )


def cg_unit(unit: str, *, delegated: bool | None = False) -> CgroupInfo:
    """A system service's cgroup; by default read, and without systemd's delegation mark."""
    return CgroupInfo(path=f"/system.slice/{unit}", systemd_unit=unit, delegated=delegated)


def cg_session(number: int = 1, uid: int = 1000) -> CgroupInfo:
    """A login session scope: shared by unrelated processes, so it names no job."""
    return CgroupInfo(
        path=f"/user.slice/user-{uid}.slice/session-{number}.scope",
        systemd_unit=f"session-{number}.scope",
    )


def cg_root() -> CgroupInfo:
    return CgroupInfo(path="/")


# --- the builder ------------------------------------------------------------------------------


@dataclass
class _Gpu:
    info: GpuInfo
    processes: list[NvmlProcess] = field(default_factory=list)
    processes_readable: bool = True


class HostBuilder:
    """Builds a :class:`Snapshot` step by step; every method returns the builder."""

    def __init__(
        self,
        *,
        monotonic: float = 1000.0,
        wall_time: float = 1_700_000_000.0,
        boot_id: str | None = "boot-1",
        scan_mode: str = "full",
        pid_max: int = 4194304,
        self_pids: frozenset[int] = frozenset(),
        host_namespaces: bool | None = True,
        mps_server_running: bool = False,
        wedged: bool = False,
    ) -> None:
        self.monotonic = monotonic
        self.wall_time = wall_time
        self.boot_id = boot_id
        self.scan_mode = scan_mode
        self.pid_max = pid_max
        self.self_pids = self_pids
        self.host_namespaces = host_namespaces
        self.mps_server_running = mps_server_running
        self.wedged = wedged
        self._gpus: dict[int, _Gpu] = {}
        self._procs: dict[int, ProcessInfo] = {}
        self._holdings: dict[int, DeviceHolding] = {}
        self._unreadable: set[int] = set()
        self._absent: set[int] = set()
        self._sharing: list[FileSharing] = []

    # -- GPUs --

    def gpu(
        self,
        index: int,
        *,
        allocated: int | None = 2 * MIB,
        total: int = DEFAULT_TOTAL,
        reserved: int | None = DEFAULT_RESERVED,
        api: str = "v2",
        used_v1: int | None = None,
        minor: int | _Inherit | None = INHERIT,
        uuid: str | None = None,
        mig: bool | None = False,
        numa_node: int | None = None,
        numa_unknown: bool = False,
        lost: bool = False,
        processes_readable: bool = True,
        memory_known: bool = True,
        name: str = "NVIDIA H100 80GB HBM3",
    ) -> HostBuilder:
        """Add GPU ``index`` (minor = index unless given). ``api="v1"``: allocated unknown."""
        memory: GpuMemory | None = None
        if memory_known:
            if api == "v1":
                used = used_v1 if used_v1 is not None else (allocated or 0) + DEFAULT_RESERVED
                memory = GpuMemory(
                    total=total, free=total - used, reserved=None, allocated=None, api="v1",
                    used_v1=used,
                )  # fmt: skip
            else:
                free = None
                if allocated is not None and reserved is not None:
                    free = total - reserved - allocated
                memory = GpuMemory(total=total, free=free, reserved=reserved, allocated=allocated)
        self._gpus[index] = _Gpu(
            GpuInfo(
                index=index,
                uuid=uuid or gpu_uuid(index),
                name=name,
                pci_bus_id=f"00000000:{0x10 + index:02X}:00.0",
                minor=index if isinstance(minor, _Inherit) else minor,
                memory=memory,
                mig_enabled=mig,
                numa_node=numa_node,
                numa_node_unknown=numa_unknown,
                lost=lost,
                error="GPU is lost" if lost else None,
            ),
            processes_readable=processes_readable,
        )
        return self

    def nvml(
        self, gpu: int, pid: int, *, used: int | None = 500 * MIB, kind: str = "compute"
    ) -> HostBuilder:
        """NVML lists ``pid`` on GPU ``gpu``. A pid without :meth:`proc` is a dead process."""
        self._gpus[gpu].processes.append(NvmlProcess(pid=pid, used_memory=used, kind=kind))
        return self

    # -- processes --

    def proc(
        self,
        pid: int,
        *,
        ppid: int | None = 1,
        pgid: int | _Inherit | None = INHERIT,
        sid: int | _Inherit | None = INHERIT,
        cgroup: CgroupInfo | _Inherit | None = INHERIT,
        state: str | None = "S",
        start: int | _Inherit | None = INHERIT,
        comm: str | None = "python3",
        exe: str | None = None,
        cmdline: tuple[str, ...] | _Inherit | None = INHERIT,
        uid: int | None = 1000,
        user: str | None = "alice",
        kernel_thread: bool = False,
        exe_trusted: bool | None = None,
        holds: frozenset[int] | set[int] | tuple[int, ...] = (),
        via: str = "fd",
        uvm: bool = False,
        ctl: bool | None = None,
        unreadable: bool = False,
    ) -> HostBuilder:
        """Add a live process, and what it holds.

        ``pgid``/``sid``/``cgroup`` default to the parent's when the parent was added before,
        else to the pid itself (a leader) and a login-session cgroup. ``start`` defaults to a
        value derived from the pid. ``holds`` are GPU minors, held through ``via`` ("fd",
        "map" or "both"); ``ctl`` defaults to True when anything is held. ``unreadable``
        records the pid as one whose fds/maps could not be read (and then it holds nothing
        known).
        """
        parent = self._procs.get(ppid) if ppid is not None else None
        if isinstance(pgid, _Inherit):
            pgid = parent.pgid if parent is not None else pid
        if isinstance(sid, _Inherit):
            sid = parent.sid if parent is not None else pid
        if isinstance(cgroup, _Inherit):
            cgroup = parent.cgroup if parent is not None else cg_session()
        if isinstance(start, _Inherit):
            start = 10_000 + pid * 7
        if isinstance(cmdline, _Inherit):
            cmdline = (comm or "?", f"job-{pid}.py")
        self._procs[pid] = ProcessInfo(
            pid=pid,
            start_ticks=start,
            state=state,
            ppid=ppid,
            pgid=pgid,
            sid=sid,
            uid=uid,
            user=user,
            comm=comm,
            exe=exe,
            cmdline=cmdline,
            cgroup=cgroup,
            kernel_thread=kernel_thread,
            exe_trusted=exe_trusted,
        )
        if unreadable:
            self._unreadable.add(pid)
        else:
            self.hold(pid, holds, via=via, uvm=uvm, ctl=ctl)
        return self

    def hold(
        self,
        pid: int,
        minors: frozenset[int] | set[int] | tuple[int, ...],
        *,
        via: str = "fd",
        uvm: bool = False,
        ctl: bool | None = None,
    ) -> HostBuilder:
        """Record that ``pid`` holds device files (also for a pid without process facts)."""
        minors = frozenset(minors)
        if ctl is None:
            ctl = bool(minors) or uvm
        if not (minors or ctl or uvm):
            self._holdings.pop(pid, None)
            return self
        self._holdings[pid] = DeviceHolding(
            pid=pid,
            gpu_minors_fd=minors if via in ("fd", "both") else frozenset(),
            gpu_minors_map=minors if via in ("map", "both") else frozenset(),
            ctl=ctl,
            uvm=uvm,
        )
        return self

    def change(self, pid: int, **changes: Any) -> HostBuilder:
        """Replace fields of an existing process (e.g. ``ppid=1`` after its parent died)."""
        self._procs[pid] = replace(self._procs[pid], **changes)
        return self

    def kill(self, pid: int) -> HostBuilder:
        """Remove a process and its holdings (NVML may still list it)."""
        self._procs.pop(pid, None)
        self._holdings.pop(pid, None)
        self._unreadable.discard(pid)
        return self

    def unreadable(self, pid: int) -> HostBuilder:
        self._unreadable.add(pid)
        self._holdings.pop(pid, None)
        return self

    def absent(self, *pids: int) -> HostBuilder:
        """These PIDs were looked up (as session/group leaders) and do not exist."""
        self._absent.update(pids)
        return self

    def sharing(
        self, holder: int, owner: int, shared: bool | None, *, cut: bool = False
    ) -> HostBuilder:
        """kcmp's answer: whether ``holder``'s device files are ``owner``'s own (``cut``: a
        poll's fd budget ran out first)."""
        self._sharing.append(FileSharing(holder, owner, shared, cut))
        return self

    def at(self, monotonic: float) -> HostBuilder:
        self.monotonic = monotonic
        return self

    # -- result --

    def build(self) -> Snapshot:
        gpus = tuple(
            replace(
                g.info,
                processes=tuple(g.processes) if g.processes_readable else None,
            )
            for _, g in sorted(self._gpus.items())
        )
        return Snapshot(
            monotonic=self.monotonic,
            wall_time=self.wall_time,
            boot_id=self.boot_id,
            nvml=NvmlReading(available=True, wedged=self.wedged, gpus=gpus),
            processes=dict(self._procs),
            holders=HolderScan(
                mode=self.scan_mode,
                holdings=dict(self._holdings),
                unreadable=frozenset(self._unreadable),
            ),
            self_pids=self.self_pids,
            pid_max=self.pid_max,
            host_namespaces=self.host_namespaces,
            mps_server_running=self.mps_server_running,
            absent_pids=frozenset(self._absent),
            file_sharing=tuple(self._sharing),
        )
