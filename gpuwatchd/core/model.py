"""Plain, frozen data that flows from collection to decisions: the snapshot and the findings.

What a GPU reading, a host process, a device holder and a finding look like. No I/O, no
imports from the package. ``None`` always means *unknown* (docs/internals.md, section
`gpuwatchd.core.model`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

MIB = 1024 * 1024


def as_int(value: object) -> int | None:
    """``value`` if it is an integer (not a bool), else None: unknown stays unknown, never 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def fields_of(record: object, names: tuple[str, ...]) -> dict[str, object]:
    """``{name: record.name}`` in the order of ``names``, for an event's or a file's fields;
    ``"key=attribute"`` names the field ``key`` after ``record.attribute``."""
    pairs = (name.partition("=") for name in names)
    return {key: getattr(record, attribute or key) for key, _, attribute in pairs}


ARCH_VOLTA = 5  # NVML_DEVICE_ARCH_VOLTA
ARCH_AMPERE = 7  # NVML_DEVICE_ARCH_AMPERE


class FindingKind(str, enum.Enum):
    """The stable names of findings, used in logs, JSON and policy rules (docs/findings.md)."""

    DEAD_PROCESS = "dead_process"
    ZOMBIE = "zombie"
    ORPHANED = "orphaned"
    ABANDONED = "abandoned"
    STUCK = "stuck"
    HIDDEN_HOLDER = "hidden_holder"
    GHOST_MEMORY = "ghost_memory"
    UNACCOUNTED_MEMORY = "unaccounted_memory"
    # GPU health (docs/findings.md#gpu-health): GPU-level, never about a process.
    RESET_REQUIRED = "reset_required"
    REBOOT_REQUIRED = "reboot_required"
    DRAIN_REQUIRED = "drain_required"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, order=True)
class ProcessIdentity:
    """A process as it can be told apart from a later one reusing its PID (``start_ticks``:
    field 22 of ``/proc/PID/stat``, clock ticks since boot)."""

    pid: int
    start_ticks: int


# --- host processes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupInfo:
    """A process's cgroup (v2 path, or the v1 path that names the job) and what it means."""

    path: str
    container_id: str | None = None
    container_runtime: str | None = None  # "docker", "containerd", "crio", "podman"
    pod_uid: str | None = None
    slurm_job: str | None = None
    slurm_step: str | None = None
    systemd_unit: str | None = None
    slurm_job_dir: str | None = None  # the ``…/job_<ID>`` part of ``path`` (collect/cgroups.py)
    # systemd's delegation mark on this cgroup or one above it; None: not read.
    delegated: bool | None = None

    @property
    def job_key(self) -> str | None:
        """The job-level group this cgroup belongs to, or None (never a shared slice or a login
        session: docs/design-notes.md §4)."""
        jobs = (("slurm", self.slurm_job), ("pod", self.pod_uid), ("container", self.container_id))
        for prefix, key in jobs:
            if key is not None:
                return f"{prefix}:{key}"
        unit = self.systemd_unit
        if (
            unit is not None
            and not unit.startswith(("session-", "user@"))
            and unit.endswith((".service", ".scope"))
        ):
            return f"unit:{unit}"
        return None


@dataclass(frozen=True)
class ProcessInfo:
    """Facts about one host process, read from ``/proc``. Any field may be None (unknown;
    ``exe_trusted``: docs/internals.md, section `gpuwatchd.core.model`)."""

    pid: int
    start_ticks: int | None
    state: str | None
    ppid: int | None
    pgid: int | None
    sid: int | None
    uid: int | None = None
    user: str | None = None
    comm: str | None = None
    exe: str | None = None
    cmdline: tuple[str, ...] | None = None
    cgroup: CgroupInfo | None = None
    nspid: tuple[int, ...] | None = None
    kernel_thread: bool = False
    exe_trusted: bool | None = None

    @property
    def exe_name(self) -> str | None:
        """The executable's basename, as the kernel resolved it (not what argv[0] claims)."""
        return (self.exe or "").rsplit("/", 1)[-1].removesuffix(" (deleted)") or None

    @cached_property
    def identity(self) -> ProcessIdentity | None:
        return None if self.start_ticks is None else ProcessIdentity(self.pid, self.start_ticks)

    @property
    def is_zombie(self) -> bool:
        return self.state == "Z"

    @property
    def is_uninterruptible(self) -> bool:
        return self.state == "D"

    @cached_property
    def names(self) -> frozenset[str]:
        """Every name the process goes by: comm, the executable's and argv[0]'s basenames."""
        argv0 = self.cmdline[0].rsplit("/", 1)[-1] if self.cmdline else None
        return frozenset(name for name in (self.comm, self.exe_name, argv0) if name)


# --- device holders ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MigCapability:
    """One MIG access capability: GPU instance ``gi`` of the GPU with minor ``gpu_minor``, or
    compute instance ``ci`` inside it (None: the GPU instance's own; docs/findings.md#mig)."""

    gpu_minor: int
    gi: int
    ci: int | None = None

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.gpu_minor, self.gi, -1 if self.ci is None else self.ci)


@dataclass(frozen=True)
class DeviceHolding:
    """Which NVIDIA device files one process holds, through an fd or a mapping: the minors of
    ``/dev/nvidiaN`` and of ``/dev/nvidia-caps/nvidia-cap<N>``, ``nvidiactl``/``nvidia-uvm``,
    and MIG capabilities held as procfs files (``cap_files``)."""

    pid: int
    gpu_minors_fd: frozenset[int] = frozenset()
    gpu_minors_map: frozenset[int] = frozenset()
    ctl: bool = False
    uvm: bool = False
    cap_minors_fd: frozenset[int] = frozenset()
    cap_minors_map: frozenset[int] = frozenset()
    cap_files: frozenset[MigCapability] = frozenset()

    @cached_property
    def gpu_minors(self) -> frozenset[int]:
        return self.gpu_minors_fd | self.gpu_minors_map

    def via(self, minor: int) -> tuple[str, ...]:
        routes = (("fd", self.gpu_minors_fd), ("map", self.gpu_minors_map))
        return tuple(route for route, minors in routes if minor in minors)


@dataclass(frozen=True)
class HolderScan:
    """One scan of ``/proc`` for holders of NVIDIA device files, ``mode`` "targeted" or "full".
    ``unreadable``: PIDs whose fds or maps could not be read (unknown, not "holds nothing");
    the other sets: docs/internals.md, section `gpuwatchd.core.model`."""

    mode: str
    holdings: Mapping[int, DeviceHolding] = field(default_factory=dict)
    unreadable: frozenset[int] = frozenset()
    matched_by_name: frozenset[int] = frozenset()
    thread_tables_unread: frozenset[int] = frozenset()

    def holders_of(self, minor: int) -> tuple[DeviceHolding, ...]:
        return tuple(h for h in self.holdings.values() if minor in h.gpu_minors)


@dataclass(frozen=True)
class FileSharing:
    """Whether a holder's device fds are a live context owner's own open file descriptions
    (``kcmp(KCMP_FILE)``: inherited by fork or fd passing); None when it could not be told.
    ``cut``: unknown because a poll's fd budget ran out reading either process's fds."""

    holder: int
    owner: int
    shared: bool | None
    cut: bool = False


# --- NVML -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuMemory:
    """Memory of one GPU in bytes: ``allocated`` = total - free - reserved (v2 query); with
    only the v1 query it is unknown and ``used_v1`` carries v1's "used"."""

    total: int | None
    free: int | None
    reserved: int | None
    allocated: int | None
    api: str = "v2"
    used_v1: int | None = None


@dataclass(frozen=True)
class NvmlProcess:
    """One entry of an NVML process list. ``used_memory`` is None when NVML has no figure."""

    pid: int
    used_memory: int | None
    kind: str  # "compute", "graphics" or "mps"


# --- GPU health (NVML events and health fields) -------------------------------------------------


class Support(str, enum.Enum):
    """Whether a health value could be read: "not supported" is an answer, "unknown" is not."""

    OK = "ok"
    NOT_SUPPORTED = "not_supported"  # the driver or GPU does not offer it (old driver, MIG...)
    UNKNOWN = "unknown"  # the call failed otherwise: nothing may be concluded from it

    def __str__(self) -> str:
        return self.value


MAX_XID = 0xFFFF  # Xid numbers are small (under 200 today); anything past this is garbage


@dataclass(frozen=True)
class XidEvent:
    """One Xid critical-error event NVML delivered, with the wall time the worker read it."""

    xid: int
    wall: float


@dataclass(frozen=True)
class KernelXid:
    """Xid lines of the kernel log (``collect/kernel_log.py``) for one GPU, Xid number and
    process in one poll, a run folded into one with its count (fields: docs/internals.md,
    section `gpuwatchd.core.model`)."""

    pci: str
    xid: int
    first: float
    last: float
    position: int
    count: int = 1
    before_start: bool = False
    pid: int | None = None
    process: str | None = None
    job: str | None = None
    text: str = ""


@dataclass(frozen=True)
class GpuHealth:
    """The health fields of one GPU in one poll (docs/findings.md#gpu-health): each value is
    None unless its ``*_support`` is ``Support.OK`` (sources: docs/internals.md, section
    `gpuwatchd.core.model`)."""

    events: Support = Support.UNKNOWN
    xids: tuple[XidEvent, ...] = ()
    recovery_action: int | None = None
    recovery_support: Support = Support.UNKNOWN
    remap_correctable: int | None = None
    remap_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    remap_support: Support = Support.UNKNOWN
    pages_pending: bool | None = None
    pages_single_bit: int | None = None
    pages_double_bit: int | None = None
    pages_support: Support = Support.UNKNOWN
    fabric_support: Support = Support.UNKNOWN
    fabric_state: int | None = None
    fabric_status: int | None = None
    fabric_health_mask: int | None = None
    fabric_health_summary: int | None = None


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a compute instance inside a GPU instance) as NVML reported it; ``memory``
    is its GPU instance's, shared by its compute instances. Any value may be None (unknown)."""

    index: int
    uuid: str | None
    gi: int | None
    ci: int | None
    name: str | None = None
    profile: str | None = None
    gi_profile_id: int | None = None
    placement: tuple[int, int] | None = None
    memory: GpuMemory | None = None
    processes: tuple[NvmlProcess, ...] | None = ()
    error: str | None = None


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reported it in one poll. ``lost``: it stopped answering (its other
    values are what was read before); ``numa_node*``: docs/internals.md."""

    index: int
    uuid: str
    name: str | None = None
    pci_bus_id: str | None = None
    minor: int | None = None
    memory: GpuMemory | None = None
    processes: tuple[NvmlProcess, ...] | None = ()
    mig_enabled: bool | None = None
    persistence_mode: bool | None = None
    numa_node: int | None = None
    numa_node_unknown: bool = False
    architecture: int | None = None  # NVML_DEVICE_ARCH_*: 5 Volta, 7 Ampere, 9 Hopper, ...
    nvlink_active: int | None = None  # active NVLink links; 0 without NVLink
    lost: bool = False
    error: str | None = None
    health: GpuHealth | None = None  # None: not read (e.g. a reading from before health)
    # With MIG on: its MIG devices (None: not read, or MIG off).
    mig_devices: tuple[MigDevice, ...] | None = None

    @property
    def coherent_memory(self) -> bool | None:
        """Whether its memory is coherent (Grace Hopper/Blackwell); None when unknown."""
        if self.numa_node is not None:
            return True
        return None if self.numa_node_unknown else False

    @property
    def reset_needs_nvlink_peers(self) -> bool | None:
        """Whether it resets only with its NVLink peers (docs/design-notes.md §7); None: unknown."""
        if self.nvlink_active == 0:
            return False
        if self.nvlink_active is None or self.architecture is None:
            return None
        return self.architecture in (ARCH_VOLTA, ARCH_AMPERE)


@dataclass(frozen=True)
class NvmlReading:
    """What the NVML worker returned for one poll: ``available`` False when the library or
    driver is missing or init failed; ``wedged`` when a call missed its deadline."""

    available: bool
    wedged: bool = False
    error: str | None = None
    driver_version: str | None = None
    gpus: tuple[GpuInfo, ...] = ()

    @property
    def answered(self) -> bool:
        """NVML was there and answered in time: what it says of the GPUs can be believed."""
        return self.available and not self.wedged


# --- the snapshot -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Spare:
    """An administrator's ``gpuwatchd spare`` of ``target``, ``pid:N`` (by PID and start ticks)
    or ``job:KEY``, until wall time ``until`` (docs/internals.md, `gpuwatchd.decide.spares`)."""

    target: str
    until: float
    reason: str
    pid: int | None = None
    start_ticks: int | None = None
    job: str | None = None
    since: float | None = None
    by_uid: int | None = None


@dataclass(frozen=True)
class Pause:
    """The admin pause switch (``gpuwatchd pause``) as read at one poll: paused for ``reason``
    until wall time ``until`` (None: no end), or not paused (``reason`` None; ``resumed`` says
    why a pause has just ended)."""

    reason: str | None
    until: float | None = None
    resumed: str | None = None


@dataclass(frozen=True)
class SubIdRange:
    """``count`` uids from ``first`` that ``/etc/subuid`` gives to a user: ``owner_uid`` (None
    when the name there resolves to no uid; ``owner`` is the name as written)."""

    first: int
    count: int
    owner: str
    owner_uid: int | None

    def holds(self, uid: int) -> bool:
        return self.first <= uid < self.first + self.count


@dataclass(frozen=True)
class Snapshot:
    """Everything one poll learned about the host, frozen. Decisions read only this (its
    fields: docs/internals.md, section `gpuwatchd.core.model`)."""

    monotonic: float
    wall_time: float
    boot_id: str | None
    nvml: NvmlReading
    processes: Mapping[int, ProcessInfo]
    holders: HolderScan
    self_pids: frozenset[int] = frozenset()
    pid_max: int = 4194304
    host_namespaces: bool | None = True
    mps_server_running: bool = False
    ended_job_dirs: frozenset[str] = frozenset()
    handovers: Mapping[str, int | None] = field(default_factory=dict)
    job_stepds: Mapping[str, int] = field(default_factory=dict)
    absent_pids: frozenset[int] = frozenset()
    file_sharing: tuple[FileSharing, ...] = ()
    spares: tuple[Spare, ...] = ()
    mig_caps: Mapping[int, MigCapability] | None = None
    mig_caps_error: str | None = None
    subuid_ranges: tuple[SubIdRange, ...] = ()
    kernel_xids: tuple[KernelXid, ...] = ()

    def gpu_by_minor(self, minor: int) -> GpuInfo | None:
        return next((gpu for gpu in self.nvml.gpus if gpu.minor == minor), None)


# --- findings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One conclusion about the host, with its evidence (plain JSON-able values). ``pid`` and
    ``start_ticks`` are None for GPU-level findings; ``gpu`` only for none about one GPU."""

    kind: FindingKind
    gpu: str | None
    pid: int | None
    start_ticks: int | None
    reason: str
    memory: int | None = None
    actionable: bool = True
    evidence: Mapping[str, object] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """A stable key: the same problem in the next poll has the same key (``@start_ticks``
        left out when the start time is unknown, as for a dead process)."""
        ticks = "" if self.start_ticks is None else f"@{self.start_ticks}"
        target = "gpu" if self.pid is None else f"{self.pid}{ticks}"
        return f"{self.kind.value}:{self.gpu}:{target}"

    @property
    def identity(self) -> ProcessIdentity | None:
        if self.pid is None or self.start_ticks is None:
            return None
        return ProcessIdentity(self.pid, self.start_ticks)
