"""Plain, frozen data that flows from collection to decisions: the snapshot and the findings.

This module owns the vocabulary every other module speaks: what a GPU reading, a host process,
a device holder and a finding look like. It does no I/O and imports nothing from the rest of
the package. ``None`` always means *unknown*, and an unknown value never satisfies a condition
that leads to an action (docs/architecture.md).
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
    """A process as it can be told apart from a later one reusing its PID.

    ``start_ticks`` is field 22 of ``/proc/PID/stat`` (clock ticks since boot), never a float
    time, which would shift when the wall clock is stepped.
    """

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
    # systemd's delegation mark (xattr ``trusted.delegate`` / ``user.delegate``) on this cgroup
    # or one above it: True, marked (a Delegate= unit: whoever it was delegated to may place
    # processes and make cgroups below it); False, every level read and none marked; None,
    # not read (read only where the floor asks, collect/cgroups.py ``delegation_mark``).
    delegated: bool | None = None

    @property
    def job_key(self) -> str | None:
        """The job-level group this cgroup belongs to, or None when it names no job.

        The root cgroup, user slices and login-session scopes are shared by unrelated processes,
        so they never make two processes part of the same job (docs/design-notes.md §4).
        """
        if self.slurm_job is not None:
            return f"slurm:{self.slurm_job}"
        if self.pod_uid is not None:
            return f"pod:{self.pod_uid}"
        if self.container_id is not None:
            return f"container:{self.container_id}"
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
    """Facts about one host process, read from ``/proc``. Any field may be None (unknown).

    ``state`` is the one-letter state from ``/proc/PID/stat`` ("R", "S", "D", "Z", ...).
    ``cmdline`` is empty for kernel threads and zombies, None when it could not be read.
    ``exe_trusted`` says whether the running executable (``/proc/PID/exe``, resolved) is a
    regular file owned by root and writable by neither group nor others, in a directory that
    is too: something only root can have put there. It is read only for processes that go by
    an infrastructure name (``decide/floor.py``); None when not read or unreadable.
    """

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
        if not self.exe:
            return None
        return self.exe.rsplit("/", 1)[-1].removesuffix(" (deleted)") or None

    @cached_property
    def identity(self) -> ProcessIdentity | None:
        if self.start_ticks is None:
            return None
        return ProcessIdentity(self.pid, self.start_ticks)

    @property
    def is_zombie(self) -> bool:
        return self.state == "Z"

    @property
    def is_uninterruptible(self) -> bool:
        return self.state == "D"

    @cached_property
    def names(self) -> frozenset[str]:
        """Every name the process goes by: comm, the executable's and argv[0]'s basenames."""
        found: set[str] = set()
        if self.comm:
            found.add(self.comm)
        if self.exe:
            found.add(self.exe.rsplit("/", 1)[-1].removesuffix(" (deleted)"))
        if self.cmdline:
            found.add(self.cmdline[0].rsplit("/", 1)[-1])
        return frozenset(found)


# --- device holders ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MigCapability:
    """One MIG access capability: GPU instance ``gi`` of the GPU with minor ``gpu_minor``, or
    compute instance ``ci`` inside it (None: the GPU instance's own access).

    The driver names them ``gpu<minor>/gi<id>/access`` and ``gpu<minor>/gi<id>/ci<id>/access``
    in ``/proc/driver/nvidia-caps/mig-minors`` (with each one's ``nvidia-cap`` device minor),
    and as files under ``/proc/driver/nvidia/capabilities/gpu<minor>/mig/`` when the capability
    device nodes are off (docs/findings.md#mig).
    """

    gpu_minor: int
    gi: int
    ci: int | None = None

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.gpu_minor, self.gi, -1 if self.ci is None else self.ci)


@dataclass(frozen=True)
class DeviceHolding:
    """Which NVIDIA device files one process holds, and how.

    ``gpu_minors_fd`` / ``gpu_minors_map`` are the minors of ``/dev/nvidiaN`` held through an
    open fd / a memory mapping. ``ctl`` and ``uvm`` say whether ``/dev/nvidiactl`` and
    ``/dev/nvidia-uvm`` are held (by either route). MIG: ``cap_minors_fd`` / ``cap_minors_map``
    are the minors of the ``/dev/nvidia-caps/nvidia-cap<N>`` files it holds, ``cap_files`` the
    capabilities it holds as procfs files (the form without capability device nodes).
    """

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
        """How this process holds GPU ``minor``: ("fd",), ("map",) or both."""
        routes = []
        if minor in self.gpu_minors_fd:
            routes.append("fd")
        if minor in self.gpu_minors_map:
            routes.append("map")
        return tuple(routes)


@dataclass(frozen=True)
class HolderScan:
    """The result of one scan of ``/proc`` for holders of NVIDIA device files.

    ``unreadable`` lists PIDs whose fds or maps could not be read: unknown, not "holds nothing".
    ``mode`` is "targeted" (NVML's PIDs and their process trees) or "full" (all of /proc).
    ``matched_by_name`` lists holders with a mapping identified by its path alone (its device
    number could not be read), so its GPU minor may be a container's numbering, not the host's.
    ``thread_tables_unread`` lists the unreadable PIDs whose threads have more fd tables of
    their own than the scan reads of one process (``collect/holders.THREAD_TABLE_BUDGET``).
    """

    mode: str
    holdings: Mapping[int, DeviceHolding] = field(default_factory=dict)
    unreadable: frozenset[int] = frozenset()
    matched_by_name: frozenset[int] = frozenset()
    thread_tables_unread: frozenset[int] = frozenset()

    def holders_of(self, minor: int) -> tuple[DeviceHolding, ...]:
        return tuple(h for h in self.holdings.values() if minor in h.gpu_minors)


@dataclass(frozen=True)
class FileSharing:
    """Whether a holder's device files are a live context owner's own open file descriptions.

    Two processes share an open file description exactly when one inherited it from the other
    (fork, or fd passing); ``kcmp(KCMP_FILE)`` answers it. ``shared`` is True when at least one
    of ``holder``'s device fds is one of ``owner``'s, False when every pair compared differs
    (the holder opened its own files: a spawn/forkserver worker), None when it could not be
    told (no CAP_SYS_PTRACE, seccomp, an old kernel, a holder with mappings only).
    """

    holder: int
    owner: int
    shared: bool | None


# --- NVML -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuMemory:
    """Memory of one GPU in bytes.

    ``allocated`` = total - free - reserved from the v2 query (what nvidia-smi shows as used).
    With only the v1 query (``api == "v1"``) the reservation is unknown and so is ``allocated``;
    ``used_v1`` then carries v1's "used", which includes the reservation.
    """

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


@dataclass(frozen=True)
class XidEvent:
    """One Xid critical-error event NVML delivered, with the wall time the worker read it."""

    xid: int
    wall: float


@dataclass(frozen=True)
class KernelXid:
    """Xid lines of the kernel log (``collect/kernel_log.py``): one GPU, one Xid number, one
    process, read in one poll; a run of the same lines is folded into one, with its count.

    ``pci`` is the PCI address as the kernel prints it (``0000:17:00``); ``first``/``last`` the
    wall times of the first and last line folded in, ``position`` the last line's kernel
    timestamp (microseconds since boot: where a restarted daemon resumes). ``before_start``:
    the lines were logged before the daemon started. ``pid``/``process`` are what the driver
    printed (None when it printed none); ``job`` the process's job (its cgroup's job key) when
    it still lives, was started before the Xid, and goes by that name; ``text`` the rest of
    the first line, cut short.
    """

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
    """The health fields of one GPU in one poll (docs/findings.md#gpu-health).

    ``xids`` are the Xid events read since the previous poll (events are consumed once: the
    history is kept by ``decide/health/judge.py``). ``recovery_action`` is NVML's
    ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (the field from R565: 0 none, 1 GPU reset, 2 node
    reboot, 3 drain P2P; 4 drain and reset from R570; 5-7 from R595/R615). ``remap_*`` come
    from ``nvmlDeviceGetRemappedRows`` (Ampere and later, not under MIG), ``pages_pending``
    from the retired-page pending status
    (before Ampere), ``fabric_*`` from ``nvmlDeviceGetGpuFabricInfoV`` (NVSwitch systems; what
    the values mean is ``decide/health/fabric.py``'s). Each value is None unless its ``*_support``
    is
    ``Support.OK``.
    """

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
    # The NVLink fabric (NVSwitch systems; nvmlDeviceGetGpuFabricInfoV): the registration
    # state (0 not supported, 1 not started, 2 in progress, 3 completed), the probe's NVML
    # status (meaningful once completed), the health mask and, from struct v3, the summary.
    fabric_support: Support = Support.UNKNOWN
    fabric_state: int | None = None
    fabric_status: int | None = None
    fabric_health_mask: int | None = None
    fabric_health_summary: int | None = None


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a compute instance inside a GPU instance) as NVML reported it.

    ``memory`` is its GPU instance's, which the compute instances of that GPU instance share;
    ``processes`` its own process list (None: unreadable). ``profile`` is the name's profile
    part (``1g.10gb``, ``1c.3g.40gb``); ``gi_profile_id`` and ``placement`` (start, size) are
    what re-creating the GPU instance in the same place needs. Any value may be None (unknown).
    """

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
    """One GPU as NVML reported it in one poll.

    ``lost`` means the GPU stopped answering (fell off the bus, GPU_IS_LOST); its other values
    are then whatever was read before. ``processes`` is None when the list could not be read.
    ``numa_node`` is set only on coherent-memory systems (Grace Hopper/Blackwell), where pages
    stay allocated after exit by design and memory-based detection is off.
    """

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
    architecture: int | None = None  # NVML_DEVICE_ARCH_*: 5 Volta, 7 Ampere, 9 Hopper, ...
    nvlink_active: int | None = None  # active NVLink links; 0 without NVLink
    lost: bool = False
    error: str | None = None
    health: GpuHealth | None = None  # None: not read (e.g. a reading from before health)
    # With MIG on: its MIG devices (None: not read, or MIG off).
    mig_devices: tuple[MigDevice, ...] | None = None

    @property
    def coherent_memory(self) -> bool:
        return self.numa_node is not None

    @property
    def reset_needs_nvlink_peers(self) -> bool | None:
        """Whether this GPU can only be reset together with its NVLink peers (design-notes §7).

        Volta, and Ampere NVSwitch systems without Fabric Manager, reset all NVLink peers
        together; Hopper and later reset individually. Whether Fabric Manager runs is not
        visible here, so an Ampere GPU with active links counts as needing its peers (an admin
        who knows better sets ``reset.allow_nvlink_group``). None when unknown.
        """
        if self.nvlink_active is None:
            return None
        if self.nvlink_active == 0:
            return False
        if self.architecture is None:
            return None
        return self.architecture in (ARCH_VOLTA, ARCH_AMPERE)


@dataclass(frozen=True)
class NvmlReading:
    """What the NVML worker returned for one poll.

    ``available`` is False when the library or driver is missing or init failed; ``wedged`` is
    True when a call missed its deadline (the driver may be hung in the kernel).
    """

    available: bool
    wedged: bool = False
    error: str | None = None
    driver_version: str | None = None
    gpus: tuple[GpuInfo, ...] = ()


# --- the snapshot -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Spare:
    """An administrator's ``gpuwatchd spare``: leave one process, or every process of one job,
    alone until wall time ``until`` (``gpuwatchd/state/spares.py`` keeps them, ``decide/spares.py``
    says what they cover).

    ``target`` is ``pid:N`` or ``job:KEY`` (``KEY`` as ``CgroupInfo.job_key`` spells it). A
    process is named by PID *and* start ticks (``pid``, ``start_ticks``), so a later process
    reusing the PID is not spared; a job by ``job``.
    """

    target: str
    until: float
    reason: str
    pid: int | None = None
    start_ticks: int | None = None
    job: str | None = None
    since: float | None = None
    by_uid: int | None = None


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
    """Everything one poll learned about the host, frozen. Decisions read only this.

    ``processes`` holds the facts of every PID that matters this poll (NVML's PIDs, device
    holders, their parents and process-tree relatives). ``self_pids`` are the daemon's own
    processes (itself, its NVML worker), never holders or targets. ``host_namespaces`` is False
    when the daemon does not see the host PID and cgroup namespaces (then NVML's PIDs point at
    the wrong processes and everything is report-only).

    Jobs that are over (``collect/jobs.py``): ``ended_job_dirs`` are the Slurm job cgroup
    directories (as ``/proc/PID/cgroup`` spells them) judged ended at the scheduler's own,
    root-owned location; ``handovers`` maps a job key (``CgroupInfo.job_key``) the scheduler
    said has ended (``run --once --ended-job``) to when it said so, in clock ticks since boot
    (the unit of ``ProcessInfo.start_ticks``; None when unknown: it then covers no process);
    ``job_stepds`` maps a job key to the start ticks of the youngest live ``slurmstepd``
    serving it.
    """

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
    nvidia_uvm_major: int | None = None
    ended_job_dirs: frozenset[str] = frozenset()
    handovers: Mapping[str, int | None] = field(default_factory=dict)
    job_stepds: Mapping[str, int] = field(default_factory=dict)
    # Inheritance evidence (collect/inherit.py): session/process-group leaders of holders
    # looked up this poll and found not to exist, and kcmp answers for holder/owner pairs.
    absent_pids: frozenset[int] = frozenset()
    file_sharing: tuple[FileSharing, ...] = ()
    # ``gpuwatchd spare``: processes and jobs an administrator asked to leave alone for a while.
    spares: tuple[Spare, ...] = ()
    # MIG (collect/mig.py): nvidia-cap device minor → the capability it grants, from the
    # mig-minors file; None when not read (no GPU has MIG on) or unreadable (``mig_caps_error``).
    mig_caps: Mapping[int, MigCapability] | None = None
    mig_caps_error: str | None = None
    # /etc/subuid (collect/subids.py): the sub-uid ranges users own (rootless containers run
    # their users there); the kill cap counts such a process against the range's owner.
    subuid_ranges: tuple[SubIdRange, ...] = ()
    # Xids read from the kernel log this poll (collect/kernel_log.py), health.kernel_log.
    kernel_xids: tuple[KernelXid, ...] = ()

    def gpu_by_minor(self, minor: int) -> GpuInfo | None:
        for gpu in self.nvml.gpus:
            if gpu.minor == minor:
                return gpu
        return None


# --- findings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One conclusion about the host, with the evidence that justified it.

    ``gpu`` is the GPU's UUID (None only for findings that concern no single GPU); ``pid`` and
    ``start_ticks`` are None for GPU-level findings (ghost_memory, unaccounted_memory).
    ``memory`` is the GPU memory in bytes the finding is about, when known. ``evidence`` holds
    plain JSON-able values (ints, strings, lists), logged and printed as they are.
    """

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
        if self.pid is None:
            target = "gpu"
        elif self.start_ticks is None:
            target = str(self.pid)
        else:
            target = f"{self.pid}@{self.start_ticks}"
        return f"{self.kind.value}:{self.gpu}:{target}"

    @property
    def identity(self) -> ProcessIdentity | None:
        if self.pid is None or self.start_ticks is None:
            return None
        return ProcessIdentity(self.pid, self.start_ticks)
