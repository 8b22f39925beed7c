"""The recovery of one MIG GPU instance (destroyed and created again in place, the other
instances untouched): what it needs, its commands, and a whole MIG GPU's layout.

In detail: docs/internals.md, section `gpuwatchd.decide.mig.recovery`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from gpuwatchd.core.checked import as_count
from gpuwatchd.core.model import GpuInfo, HolderScan, MigDevice, ProcessInfo, Snapshot
from gpuwatchd.decide.argv import format_argv
from gpuwatchd.decide.floor import is_infrastructure
from gpuwatchd.decide.mig.instances import instance_users, mig_layout, shown_pids


@dataclass(frozen=True)
class InstanceRecovery:
    """One GPU instance to re-create in place: ``uuid`` its parent GPU's, ``mig_uuid`` the
    instance's (as findings name it), ``profile`` the GI profile id, ``placement`` the start
    slice of its placement and ``size`` its number of slices."""

    uuid: str
    pci_bus_id: str | None
    gpu_index: int
    gi: int
    ci: int
    mig_uuid: str
    profile: int
    placement: int
    size: int

    def values(self) -> dict[str, str | None]:
        """The placeholder values of its commands (checked when filled in)."""
        return {
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
            "gi": str(self.gi),
            "ci": str(self.ci),
            "mig_uuid": self.mig_uuid,
            "profile": str(self.profile),
            "placement": str(self.placement),
        }

    def fits(self, device: MigDevice) -> bool:
        """``device`` has its GI profile and placement (its ids may be new)."""
        planned = (self.profile, (self.placement, self.size))
        return (device.gi_profile_id, device.placement) == planned

    def describe(self) -> str:
        return (
            f"re-create MIG GPU instance {self.gi} of GPU {self.gpu_index} "
            f"(GI profile {self.profile}, placement {self.placement}:{self.size})"
        )

    def fields(self) -> dict[str, object]:
        """What the reset events of its recovery say about it, besides the parent GPU."""
        return {"instance": self.mig_uuid, "gi": self.gi, "recovery": self.describe()}

    def record(self) -> dict[str, object]:
        """The JSON-able form the state file keeps while it runs (:func:`from_record`)."""
        return asdict(self)


def from_record(record: object) -> InstanceRecovery | None:
    """The recovery a state file's record names, or None when a field is missing or wrong."""
    if not isinstance(record, dict):
        return None
    names = ("gpu_index", "gi", "ci", "profile", "placement", "size")
    ints = {name: found for name in names if (found := as_count(record.get(name))) is not None}
    if len(ints) < len(names) or ints["size"] == 0:  # no GI profile holds no memory slice
        return None
    uuid, mig_uuid, pci = record.get("uuid"), record.get("mig_uuid"), record.get("pci_bus_id")
    if not isinstance(uuid, str) or not isinstance(mig_uuid, str) or not uuid or not mig_uuid:
        return None
    pci = pci if isinstance(pci, str) else None
    return InstanceRecovery(uuid=uuid, pci_bus_id=pci, mig_uuid=mig_uuid, **ints)


def recovery_of(snapshot: Snapshot, instance_uuid: str | None) -> InstanceRecovery | str:
    """The recovery of GPU instance ``instance_uuid``, or why it cannot be re-created in place."""
    instance = mig_layout(snapshot).instance_of(instance_uuid)
    if instance is None:
        return "not a judged MIG GPU instance in this snapshot"
    if len(instance.devices) != 1:
        return (
            f"GPU instance {instance.gi} has {len(instance.devices)} compute instances: "
            "re-creating it would not restore them; recover it by hand"
        )
    device = instance.devices[0]
    if device.ci is None:
        return f"GPU instance {instance.gi}: its compute instance id is unknown"
    if device.gi_profile_id is None:
        return f"GPU instance {instance.gi}: its GI profile id is unknown"
    placement = _placement(device)
    if placement is None:
        return f"GPU instance {instance.gi}: its placement is unknown"
    if device.uuid is None:
        return f"GPU instance {instance.gi}: its MIG UUID is unknown"
    if device.profile is None:
        return f"GPU instance {instance.gi}: its compute instance's profile is unknown"
    if device.profile.count(".") == 2:  # "1c.3g.40gb": a compute instance of part of it
        return (
            f"GPU instance {instance.gi}: its compute instance ({device.profile}) is a part of "
            "it, which -C would not bring back; recover it by hand"
        )
    start, size = placement
    return InstanceRecovery(
        uuid=instance.parent.uuid,
        pci_bus_id=instance.parent.pci_bus_id,
        gpu_index=instance.parent.index,
        gi=instance.gi,
        ci=device.ci,
        mig_uuid=device.uuid,
        profile=device.gi_profile_id,
        placement=start,
        size=size,
    )


def _placement(device: MigDevice) -> tuple[int, int] | None:
    """``device``'s placement (start slice, slices); None when unknown or of no slice, which
    no GI profile has (a reading that says so is wrong)."""
    found = device.placement
    return found if found is not None and found[1] > 0 else None


def instance_blockers(snapshot: Snapshot, instance_uuid: str) -> list[str]:
    """Why GPU instance ``instance_uuid`` may be in use in ``snapshot`` (docs/internals.md)."""
    layout = mig_layout(snapshot)
    instance = layout.instance_of(instance_uuid)
    if instance is None:
        return ["not a judged MIG GPU instance in this snapshot"]
    listed, holders, why = instance_users(snapshot, layout, instance)
    unsure = {
        pid
        for pid, parents in layout.parent_only.items()
        if instance.parent.uuid in parents
        and pid not in snapshot.self_pids
        and not ((proc := snapshot.processes.get(pid)) is not None and is_infrastructure(proc))
    }
    for pids, what in (
        (listed, "listed by NVML in it"),
        (holders, "holding its capability files"),
        (unsure - holders, "holding its GPU's device node, instance unknown"),
    ):
        if pids:
            why.append(f"GPU instance {instance.gi}: PID {shown_pids(pids)} {what}")
    return why


def recovery_blockers(
    last: Snapshot,
    holders: HolderScan,
    processes: Mapping[int, ProcessInfo],
    self_pids: frozenset[int],
    instance_uuid: str,
) -> list[str]:
    """The final scan of a recovery (docs/internals.md); an unreadable process blocks."""
    fresh = replace(
        last, holders=holders, processes={**last.processes, **processes}, self_pids=self_pids
    )
    return instance_blockers(fresh, instance_uuid) + [
        f"pid {pid}: fds/maps unreadable (unknown is not none)"
        for pid in sorted(holders.unreadable)
        if pid not in self_pids
    ]


def recovery_argvs(
    recovery: InstanceRecovery, commands: Sequence[Sequence[str]]
) -> tuple[tuple[str, ...], ...]:
    """Each command line of ``recovery``, filled in; ValueError for a malformed value."""
    return tuple(format_argv(argv, **recovery.values()) for argv in commands)


def recovered(recovery: InstanceRecovery, snapshot: Snapshot, *, max_used: int) -> str | None:
    """None when ``snapshot`` shows the instance back with at most ``max_used`` bytes used,
    else what is wrong."""
    layout = mig_layout(snapshot)
    if recovery.uuid not in layout.judged:
        why = layout.unjudged.get(recovery.uuid, "the GPU is not in MIG mode in this snapshot")
        return f"GPU {recovery.gpu_index}: {why}"
    for instance in layout.instances_of(recovery.uuid):
        device = instance.memory_device
        if not recovery.fits(device):
            continue
        memory = device.memory
        used = None if memory is None else memory.allocated
        if used is None:
            return f"GPU instance {instance.gi} is back; its memory use is unknown"
        if used > max_used:
            return f"GPU instance {instance.gi} is back but still uses {used} bytes"
        table = (snapshot.mig_caps or {}).values()
        minor = instance.parent.minor
        if not any(c.gpu_minor == minor and c.gi == instance.gi and c.ci is None for c in table):
            return f"GPU instance {instance.gi} is back but mig-minors does not list it"
        return None
    return f"no GPU instance with GI profile {recovery.profile} at placement {recovery.placement}"


# --- a fresh reading of the parent GPU, right before (and between) the commands ---------------


def _devices(recovery: InstanceRecovery, gpu: GpuInfo | None) -> tuple[MigDevice, ...] | str:
    """The MIG devices of a fresh reading of ``recovery``'s GPU, or why they are unknown."""
    where = f"GPU {recovery.gpu_index}"
    if gpu is None or gpu.uuid != recovery.uuid:
        return f"{where} is not in the fresh NVML reading"
    if gpu.lost:
        return f"{where} is lost"
    if gpu.mig_enabled is not True:
        return f"{where} is not in MIG mode in the fresh NVML reading"
    if gpu.mig_devices is None:
        return f"{where}: its MIG devices could not be read"
    return gpu.mig_devices


def instance_changed(recovery: InstanceRecovery, gpu: GpuInfo | None) -> str | None:
    """None when the fresh reading ``gpu`` still shows the planned instance (ids, MIG UUID, GI
    profile and placement); else what changed (unknown counts as changed). Pure."""
    devices = _devices(recovery, gpu)
    if isinstance(devices, str):
        return devices
    gi = recovery.gi
    same = [d for d in devices if d.gi == gi]
    if not same:
        return f"GPU instance {gi} is no longer listed"
    if len(same) != 1:
        return f"GPU instance {gi} now has {len(same)} compute instances"
    device = same[0]
    wrong = [
        f"{what} {now} (planned {then})"
        for what, now, then in (
            ("MIG UUID", device.uuid, recovery.mig_uuid),
            ("compute instance", device.ci, recovery.ci),
            ("GI profile", device.gi_profile_id, recovery.profile),
            ("placement", device.placement, (recovery.placement, recovery.size)),
        )
        if now != then
    ]
    if wrong:
        return f"GPU instance {gi} is not the planned one any more: " + ", ".join(wrong)
    return None


def placement_taken(recovery: InstanceRecovery, gpu: GpuInfo | None) -> str | None:
    """None when the fresh reading ``gpu`` leaves the planned placement free; else why not."""
    devices = _devices(recovery, gpu)
    if isinstance(devices, str):
        return devices
    start, end = recovery.placement, recovery.placement + recovery.size
    for device in devices:
        if device.gi == recovery.gi:
            return f"GPU instance {recovery.gi} is still listed ({device.uuid})"
        placement = _placement(device)
        if placement is None:
            return f"GPU instance {device.gi}: its placement is unknown"
        first, size = placement
        if first < end and start < first + size:
            return f"GPU instance {device.gi} ({device.uuid}) occupies placement {first}:{size}"
    return None


def resume_point(
    recovery: InstanceRecovery, gpu: GpuInfo | None, done: int | None, total: int
) -> int | str:
    """The first of its ``total`` commands an interrupted recovery runs again (``total``: none;
    ``done``: the state file's count, None: not counted), or why it cannot go on. Pure."""
    devices = _devices(recovery, gpu)
    if isinstance(devices, str):
        return devices
    if any(recovery.fits(d) and d.uuid != recovery.mig_uuid for d in devices):
        return total  # an instance where it was planned, with a new MIG UUID: re-created
    taken = placement_taken(recovery, gpu)
    if taken is not None:
        return taken
    if done is None or not 0 <= done < total:
        return total - 1  # the re-create alone: safe, as nothing occupies its placement
    return done


# --- a whole MIG GPU's reset: its layout, recorded before and created again after ------------

Layout = tuple[InstanceRecovery, ...]


def layout_of(snapshot: Snapshot, gpu_uuid: str) -> Layout | str:
    """The re-creation of each GPU instance of ``gpu_uuid`` by placement, or why none. Pure."""
    layout = mig_layout(snapshot)
    if gpu_uuid not in layout.judged:
        return layout.unjudged.get(gpu_uuid, "its MIG instances are not judged")
    found: list[InstanceRecovery] = []
    for instance in layout.instances_of(gpu_uuid):
        recovery = recovery_of(snapshot, instance.uuid)
        if isinstance(recovery, str):
            return recovery
        found.append(recovery)
    if not found:
        return "it has no GPU instance to record"
    return tuple(sorted(found, key=lambda r: (r.placement, r.gi)))


def layout_argvs(layout: Layout, commands: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """The re-create (the last of ``commands``) of each GPU instance of ``layout``, filled in."""
    if not commands:
        return ()
    return tuple(format_argv(commands[-1], **r.values()) for r in layout)


def layout_missing(layout: Layout, gpu: GpuInfo | None) -> list[int] | str:
    """The positions in ``layout`` of the instances the fresh reading ``gpu`` lacks. Pure."""
    if not layout:
        return []
    devices = _devices(layout[0], gpu)
    if isinstance(devices, str):
        return devices
    return [n for n, r in enumerate(layout) if not any(r.fits(d) for d in devices)]
