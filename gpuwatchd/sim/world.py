"""The virtual host of ``gpuwatchd simulate``: GPUs, processes, contexts, and what NVML and
``/proc`` would say about them.

In detail: docs/internals.md, section `gpuwatchd.sim.world`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from gpuwatchd.collect.cgroups import parse_cgroup
from gpuwatchd.collect.mig import cap_minor
from gpuwatchd.core.escape import escape
from gpuwatchd.core.model import (
    MIB,
    DeviceHolding,
    FileSharing,
    GpuHealth,
    GpuInfo,
    GpuMemory,
    HolderScan,
    MigCapability,
    MigDevice,
    NvmlProcess,
    NvmlReading,
    ProcessInfo,
    Snapshot,
    Spare,
    Support,
    XidEvent,
)
from gpuwatchd.decide.floor import mps_server
from gpuwatchd.decide.health.fabric import FabricState
from gpuwatchd.sim.scenario_spec import EventSpec, GpuSpec, HealthSpec, ProcessSpec, Scenario

WALL0 = 1_700_000_000.0  # the virtual wall clock at +0s
SAID_AT = 10**9  # boot ticks of +0s: when `host.ended_jobs` is said (after the first processes)
BOOT_ID = "00000000-0000-4000-8000-5100a7ed0000"
ARCH_HOPPER = 9  # NVML_DEVICE_ARCH_HOPPER: every virtual GPU


# NVML's GPU instance profile ids of the H100 and H200 profiles (``nvidia-smi mig -lgip``): what
# re-creating an instance with ``-cgi`` needs. A profile not listed has an unknown id.
GI_PROFILE_IDS = {
    "1g.10gb": 19, "1g.20gb": 15, "2g.20gb": 14, "3g.40gb": 9, "4g.40gb": 5, "7g.80gb": 0,
    "1g.18gb": 19, "1g.35gb": 15, "2g.35gb": 14, "3g.71gb": 9, "4g.71gb": 5, "7g.141gb": 0,
}  # fmt: skip


def mig_uuid(gpu: int, gi: int) -> str:
    """A virtual MIG device's UUID (compute instance 0 of GPU instance ``gi``)."""
    return f"MIG-{gpu:08x}-{gi:04x}-4000-8000-{gi:012x}"


class SimulationError(Exception):
    """The scenario cannot be played (its inline policy is invalid, say). Exit 65."""


def size_text(value: object) -> str:
    """A byte count for people: "4 GiB", "1.5 GiB", "512 MiB"."""
    if not isinstance(value, int) or isinstance(value, bool):
        return "an unknown amount"
    if value >= 1024 * MIB and value % (1024 * MIB) == 0:
        return f"{value // (1024 * MIB)} GiB"
    if value >= 1024 * MIB:
        return f"{value / (1024 * MIB):.1f} GiB"
    return f"{value // MIB} MiB"


@dataclass
class WorldProc:
    spec: ProcessSpec
    start_ticks: int
    ppid: int
    state: str
    minors: frozenset[int]
    ctl: bool
    uvm: bool
    alive: bool = True  # False once exited (a zombie is not alive but still present)
    present: bool = True  # in the process table (alive or zombie)
    exited_at: float | None = None
    exit_why: str | None = None
    signals: list[tuple[float, str, str]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.spec.pid

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def status(self) -> str:
        """alive, stuck (D), zombie or exited: as the final state says it."""
        if self.alive:
            return "stuck (D)" if self.state == "D" else "alive"
        return "zombie" if self.present else "exited"


@dataclass
class _Context:
    """GPU memory charged to one process on one GPU; it outlives the process while heirs hold
    the device (status "dead"), or for good when leaked (status "leaked", NVML lists nothing)."""

    pid: int
    owner: str
    gpu: int
    size: int | None
    status: str = "live"  # live, dead, leaked, freed
    heirs: set[int] = field(default_factory=set)
    gi: int | None = None  # on a MIG GPU: the GPU instance it lives in


@dataclass
class WorldGpu:
    spec: GpuSpec
    base: int  # allocated memory that no context accounts for (idle, or set_memory)
    lost: bool
    persistence: bool
    health: HealthSpec = field(default_factory=HealthSpec)
    xids: list[tuple[int, float]] = field(default_factory=list)  # queued until the next read
    fabric_ready_at: float | None = None  # after a reset: when the fabric is COMPLETED again
    # MIG: GPU instance id -> allocated memory no context accounts for (idle + leaked)
    instance_base: dict[int, int] = field(default_factory=dict)
    destroyed: set[int] = field(default_factory=set)  # GPU instances destroyed, not re-created


class World:
    """The virtual host. Mutated only by the scenario's events and by the daemon's intents."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.gpus = {
            g.index: WorldGpu(
                g,
                g.allocated + g.leaked,
                g.lost,
                g.persistence,
                g.health,
                instance_base={i.gi: i.allocated + i.leaked for i in g.mig_instances},
            )
            for g in scenario.gpus
        }
        self.by_minor = {g.spec.minor: g for g in self.gpus.values()}
        self.procs: dict[int, WorldProc] = {}  # the process table: the present ones by PID
        self.history: dict[str, WorldProc] = {}  # every process started, by its (unique) name
        self.contexts: list[_Context] = []
        self.leak_on_exit: set[str] = set()
        self.reset_results: list[str] = []
        # Start ticks: the scenario's first processes get pid * 100 (below 4.2e8); processes
        # started by events come after SAID_AT, when the scenario's `host.ended_jobs` was said.
        self.ticks = itertools.count(SAID_AT, 100)
        for spec in scenario.processes:
            self.start(spec, at=0.0, initial=True)

    # -- processes --

    def start(self, spec: ProcessSpec, *, at: float, initial: bool = False) -> WorldProc:
        if (old := self.procs.get(spec.pid)) is not None:
            raise SimulationError(
                f"{self.scenario.path}:{spec.line}: pid {spec.pid} ({escape(spec.name)}) is still "
                f"in use by {escape(old.name)} at +{at:g}s"
            )
        proc = WorldProc(
            spec=spec,
            start_ticks=spec.pid * 100 if initial else next(self.ticks) + int(at * 100),
            ppid=spec.ppid,
            state=spec.state,
            minors=frozenset(self.gpus[i].spec.minor for i in spec.holds.gpus),
            ctl=spec.holds.ctl,
            uvm=spec.holds.uvm,
            alive=spec.state != "Z",
        )
        self.procs[spec.pid] = proc
        self.history[spec.name] = proc
        for index, size in spec.nvml.items():
            gi = spec.holds.mig if self.gpus[index].spec.mig_instances else None
            self.contexts.append(_Context(spec.pid, spec.name, index, size, gi=gi))
        return proc

    def spare(self, event: EventSpec, wall: float) -> Spare | None:
        """The spare a ``spare`` event gives at wall time ``wall``: the named process (by PID
        and start ticks, as ``gpuwatchd spare PID`` reads them) or the job; None when the
        process has exited."""
        until, reason = wall + (event.lasts or 0.0), event.value or ""
        if event.job is not None:
            return Spare(f"job:{event.job}", until, reason, job=event.job, since=wall, by_uid=0)
        proc = None if event.target is None else self.history.get(event.target)
        if proc is None or not proc.alive:
            return None
        return Spare(f"pid:{proc.pid}", until, reason, pid=proc.pid,
                     start_ticks=proc.start_ticks, since=wall, by_uid=0)  # fmt: skip

    def exit(self, proc: WorldProc, at: float, why: str) -> list[str]:
        """A live process exits: children reparented, device files closed, contexts settled."""
        notes: list[str] = []
        proc.alive, proc.exited_at, proc.exit_why = False, at, why
        live = [c for c in self.contexts if c.pid == proc.pid and c.status == "live"]
        heirs_of = [self._heirs(proc, ctx) for ctx in live]
        reaper = self._reaper(proc)
        for child in list(self.procs.values()):
            if child.ppid == proc.pid and child is not proc:
                child.ppid = reaper
                if reaper == 1 and not child.alive:  # init reaps an orphaned zombie at once
                    self.reap(child)
                    notes.append(f"init reaps its zombie child {child.name} (pid {child.pid})")
        proc.minors, proc.ctl, proc.uvm = frozenset(), False, False
        if proc.spec.on_exit == "zombie":
            proc.state = "Z"
            notes.append("left a zombie (its parent does not reap it)")
        else:
            self.reap(proc)
        leak = proc.spec.on_exit == "leak" or proc.name in self.leak_on_exit
        for ctx, heirs in zip(live, heirs_of, strict=True):
            if leak:
                ctx.status = "leaked"
                notes.append(f"its {size_text(ctx.size)} on GPU {ctx.gpu} stays allocated (leaked)")
            elif heirs:
                ctx.status, ctx.heirs = "dead", heirs
                names = ", ".join(f"{self.procs[pid].name} (pid {pid})" for pid in sorted(heirs))
                notes.append(f"its {size_text(ctx.size)} on GPU {ctx.gpu} stays pinned by {names}")
            else:
                ctx.status = "freed"
        for ctx in self.contexts:
            if ctx.status == "dead" and proc.pid in ctx.heirs:
                ctx.heirs.discard(proc.pid)
                if not ctx.heirs:
                    ctx.status = "leaked" if ctx.owner in self.leak_on_exit else "freed"
                    if ctx.status == "freed":
                        notes.append(
                            f"last holder gone: {ctx.owner}'s {size_text(ctx.size)} on GPU "
                            f"{ctx.gpu} is freed"
                        )
        return notes

    def reap(self, proc: WorldProc) -> None:
        proc.present = False
        del self.procs[proc.pid]

    def _ancestors(self, proc: WorldProc) -> Iterator[int]:
        """The PIDs above ``proc``, its parent first, up to init, a loop or a PID not listed."""
        current, seen = proc.ppid, set()
        while current > 1 and current not in seen:
            yield current
            seen.add(current)
            if (parent := self.procs.get(current)) is None:
                return
            current = parent.ppid

    def _heirs(self, owner: WorldProc, ctx: _Context) -> set[int]:
        """Live processes that inherited ``owner``'s device files: its descendants or process
        group members that hold the context's GPU (on a MIG GPU, its GPU instance's
        capabilities), own no context there and not ``files: own``."""
        minor = self.gpus[ctx.gpu].spec.minor
        found = set()
        for proc in self.procs.values():
            if proc is owner or not proc.alive or minor not in proc.minors:
                continue
            if proc.spec.files == "own" or ctx.gi not in (None, proc.spec.holds.mig):
                continue
            if any(c.pid == proc.pid and c.status == "live" for c in self.contexts):
                continue
            if owner.pid in self._ancestors(proc) or proc.spec.pgid == owner.spec.pgid:
                found.add(proc.pid)
        return found

    def _reaper(self, proc: WorldProc) -> int:
        for pid in self._ancestors(proc):
            parent = self.procs.get(pid)
            if parent is not None and parent.spec.subreaper and parent.alive:
                return pid
        return 1

    # -- GPUs --

    def allocated(self, gpu: WorldGpu, gi: int | None = None) -> int:
        """Allocated memory of ``gpu``, or of its GPU instance ``gi``; a MIG GPU's own figure
        is the aggregate of its instances' (as NVML gives a privileged caller)."""
        charged = sum(c.size or 0 for c in self._on(gpu.spec.index, gi, "live", "dead", "leaked"))
        if gi is not None:
            instance = next(i for i in gpu.spec.mig_instances if i.gi == gi)
            return min(gpu.instance_base.get(gi, 0) + charged, instance.total)
        base = gpu.base + sum(gpu.instance_base.values())
        return min(base + charged, gpu.spec.total - gpu.spec.reserved)

    def instance_users(self, gpu: WorldGpu, gi: int) -> list[str]:
        """The processes that hold GPU instance ``gi`` of ``gpu`` (its capability files)."""
        return [
            proc.name
            for proc in self.procs.values()
            if proc.spec.holds.mig == gi and gpu.spec.minor in proc.minors
        ]

    def recreate_instance(self, gpu: WorldGpu, gi: int) -> None:
        """GPU instance ``gi`` destroyed and created again: its dead and leaked contexts are
        gone, its memory back to idle; the other instances are untouched."""
        instance = next(i for i in gpu.spec.mig_instances if i.gi == gi)
        gpu.destroyed.discard(gi)
        gpu.instance_base[gi] = instance.allocated
        self._free(gpu, gi)

    def _on(self, index: int, gi: int | None, *statuses: str) -> list[_Context]:
        return [
            c
            for c in self.contexts
            if c.gpu == index and (gi is None or c.gi == gi) and c.status in statuses
        ]

    def _free(self, gpu: WorldGpu, gi: int | None = None) -> None:
        """The dead and leaked contexts on ``gpu`` (in its GPU instance ``gi``) are gone."""
        for ctx in self._on(gpu.spec.index, gi, "dead", "leaked"):
            ctx.status = "freed"
            ctx.heirs.clear()

    def restore(self, gpu: WorldGpu, now: float) -> None:
        """A successful reset at ``now``: the GPU's contexts gone, memory back to idle, a
        pending row remap and a reset-asking recovery action cleared, an NVLink fabric
        registering again, a MIG GPU's GPU instances all destroyed."""
        gpu.base = gpu.spec.allocated
        gpu.destroyed = {i.gi for i in gpu.spec.mig_instances}
        gpu.instance_base = {i.gi: i.allocated for i in gpu.spec.mig_instances}
        action = gpu.health.recovery_action
        gpu.health = replace(
            gpu.health,
            remap_pending=False,
            recovery_action=0 if action in (1, 4) else action,  # GPU_RESET, DRAIN_AND_RESET
        )
        if gpu.health.fabric not in (None, FabricState.NOT_SUPPORTED):
            gpu.health = replace(gpu.health, fabric=FabricState.IN_PROGRESS.value)
            settle = gpu.health.fabric_after_reset
            gpu.fabric_ready_at = None if settle is None else now + settle
        self._free(gpu)

    # -- what the daemon would read --

    def process_info(self, proc: WorldProc) -> ProcessInfo:
        spec = proc.spec
        zombie = proc.state == "Z"
        cgroup = parse_cgroup(f"0::{spec.cgroup}\n")
        return ProcessInfo(
            pid=spec.pid,
            start_ticks=proc.start_ticks,
            state=proc.state,
            ppid=proc.ppid,
            pgid=spec.pgid,
            sid=spec.sid,
            uid=spec.uid,
            user=spec.user,
            comm=spec.comm,
            exe=None if zombie else spec.exe or spec.command[0],
            cmdline=() if zombie else spec.command,
            # The simulated host's cgroups carry no systemd delegation mark (read, and absent).
            cgroup=None if cgroup is None else replace(cgroup, delegated=False),
            exe_trusted=None if zombie else spec.exe_trusted,
        )

    def processes(self) -> dict[int, ProcessInfo]:
        return {pid: self.process_info(p) for pid, p in self.procs.items() if p.spec.visible}

    def holders(self) -> HolderScan:
        holdings: dict[int, DeviceHolding] = {}
        for pid, proc in self.procs.items():
            if not proc.spec.visible or not (proc.minors or proc.ctl or proc.uvm):
                continue
            via = proc.spec.holds.via
            holdings[pid] = DeviceHolding(
                pid=pid,
                gpu_minors_fd=proc.minors if via in ("fd", "both") else frozenset(),
                gpu_minors_map=proc.minors if via in ("map", "both") else frozenset(),
                ctl=proc.ctl,
                uvm=proc.uvm,
                cap_minors_fd=self._capabilities(proc),  # the driver keeps the fd in the fd table
            )
        return HolderScan(mode="full", holdings=holdings)

    def _capabilities(self, proc: WorldProc) -> frozenset[int]:
        """The nvidia-cap minors of the GPU instance (and its compute instance 0) that
        ``proc`` holds on each MIG GPU it holds."""
        gi = proc.spec.holds.mig
        if gi is None:
            return frozenset()
        found: set[int] = set()
        for gpu in self.gpus.values():
            if gpu.spec.minor in proc.minors and gpu.spec.mig_instances:
                found |= {cap_minor(gpu.spec.minor, gi), cap_minor(gpu.spec.minor, gi, 0)}
        return frozenset(found)

    def mig_caps(self) -> dict[int, MigCapability] | None:
        """The mig-minors table of the MIG GPUs (None when there is none)."""
        minors = [g.spec.minor for g in self.gpus.values() if g.spec.mig_instances]
        cis = (None, *range(8))  # the GPU instance's own capability, then its compute instances
        return {
            cap_minor(minor, gi, ci): MigCapability(minor, gi, ci)
            for minor in minors
            for gi in range(15)
            for ci in cis
        } or None

    def mig_devices(self, gpu: WorldGpu) -> tuple[MigDevice, ...] | None:
        """What NVML's MIG device handles say: one compute instance (0) per GPU instance."""
        if not gpu.spec.mig_instances:
            return None
        devices = []
        for position, instance in enumerate(gpu.spec.mig_instances):
            if instance.gi in gpu.destroyed:
                continue  # NVML lists no MIG device for it until it is created again
            allocated = self.allocated(gpu, instance.gi)
            devices.append(
                MigDevice(
                    index=position,
                    uuid=mig_uuid(gpu.spec.index, instance.gi),
                    gi=instance.gi,
                    ci=0,
                    name=f"{gpu.spec.name} MIG {instance.profile}",
                    profile=instance.profile,
                    gi_profile_id=GI_PROFILE_IDS.get(instance.profile),
                    placement=(instance.gi, 1),
                    memory=GpuMemory(
                        total=instance.total,
                        free=instance.total - allocated,
                        reserved=0,
                        allocated=allocated,
                    ),
                    processes=self._listed(gpu.spec.index, instance.gi),
                )
            )
        return tuple(devices)

    def _listed(self, index: int, gi: int | None = None) -> tuple[NvmlProcess, ...]:
        """What NVML lists on GPU ``index`` (in GPU instance ``gi``): live and dead contexts."""
        listed = sorted(self._on(index, gi, "live", "dead"), key=lambda c: c.pid)
        return tuple(NvmlProcess(c.pid, c.size, "compute") for c in listed)

    def health(self, gpu: WorldGpu, *, take_events: bool) -> GpuHealth:
        """What NVML would say about the GPU's health; Xid events are read once."""
        spec = gpu.health
        xids = tuple(XidEvent(xid, WALL0 + at) for xid, at in gpu.xids) if take_events else ()
        if take_events:
            gpu.xids.clear()
        pages, fabric = spec.retired_pages_pending, spec.fabric
        return GpuHealth(
            events=Support.OK,
            xids=xids,
            recovery_action=spec.recovery_action,
            recovery_support=Support.NOT_SUPPORTED if spec.recovery_action is None else Support.OK,
            remap_correctable=0,
            remap_uncorrectable=1 if spec.remap_pending or spec.remap_failure else 0,
            remap_pending=spec.remap_pending,
            remap_failure=spec.remap_failure,
            remap_support=Support.OK,
            pages_pending=pages,
            pages_support=Support.NOT_SUPPORTED if pages is None else Support.OK,
            fabric_support=Support.NOT_SUPPORTED if fabric is None else Support.OK,
            fabric_state=fabric,
            fabric_status=None if fabric is None else 0,
            fabric_health_mask=None if fabric is None else 0,
            fabric_health_summary=None if fabric is None else 1,  # HEALTHY
        )

    def settle(self, now: float) -> None:
        """NVLink fabrics whose registration after a reset is done by ``now`` are COMPLETED."""
        for gpu in self.gpus.values():
            if gpu.fabric_ready_at is not None and gpu.fabric_ready_at <= now:
                gpu.fabric_ready_at = None
                gpu.health = replace(gpu.health, fabric=FabricState.COMPLETED.value)

    def nvml(self, *, take_events: bool = False) -> NvmlReading:
        infos = []
        for index, gpu in sorted(self.gpus.items()):
            spec, allocated = gpu.spec, self.allocated(gpu)
            infos.append(
                GpuInfo(
                    index=index,
                    uuid=spec.uuid,
                    name=spec.name,
                    pci_bus_id=spec.pci_bus_id,
                    minor=spec.minor,
                    memory=GpuMemory(
                        total=spec.total,
                        free=spec.total - spec.reserved - allocated,
                        reserved=spec.reserved,
                        allocated=allocated,
                    ),
                    processes=self._listed(index),
                    mig_enabled=spec.mig,
                    persistence_mode=gpu.persistence,
                    numa_node=1 if spec.coherent else None,
                    architecture=ARCH_HOPPER,
                    nvlink_active=0,  # each virtual GPU resets alone
                    lost=gpu.lost,
                    error="GPU is lost" if gpu.lost else None,
                    health=self.health(gpu, take_events=take_events),
                    mig_devices=self.mig_devices(gpu),
                )
            )
        return NvmlReading(available=True, driver_version="550.54.15", gpus=tuple(infos))

    def file_sharing(self) -> tuple[FileSharing, ...]:
        """kcmp's answers (collect/inherit.py): each holder whose scenario says ``files``,
        against the live context owners above it in the process tree."""
        owners = {c.pid for c in self.contexts if c.status == "live"}
        found: list[FileSharing] = []
        for pid, proc in sorted(self.procs.items()):
            if proc.spec.files is None or not proc.alive or not proc.spec.visible:
                continue
            for above in self._ancestors(proc):
                if above in owners and above in self.procs and self.procs[above].alive:
                    shared = proc.spec.files == "inherited"
                    found.append(FileSharing(holder=pid, owner=above, shared=shared))
        return tuple(found)

    def absent_pids(self) -> frozenset[int]:
        """Session and process-group leaders of holders that are not in the process table."""
        return frozenset(
            leader
            for proc in self.procs.values()
            if proc.minors or proc.ctl or proc.uvm
            for leader in (proc.spec.sid, proc.spec.pgid)
            if leader > 1 and leader not in self.procs
        )

    def snapshot(self, now: float) -> Snapshot:
        host, processes = self.scenario.host, self.processes()
        return Snapshot(
            monotonic=now,
            wall_time=WALL0 + now,
            boot_id=BOOT_ID,
            nvml=self.nvml(take_events=True),
            processes=processes,
            holders=self.holders(),
            pid_max=host.pid_max,
            host_namespaces=host.host_namespaces,
            # As the collector reads it: a trusted MPS server in the process table runs.
            mps_server_running=host.mps_server_running or any(map(mps_server, processes.values())),
            handovers=dict.fromkeys(sorted(host.ended_jobs), SAID_AT),
            absent_pids=self.absent_pids(),
            file_sharing=self.file_sharing(),
            mig_caps=self.mig_caps(),
        )
