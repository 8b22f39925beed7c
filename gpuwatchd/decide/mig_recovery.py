"""The recovery of one MIG GPU instance: what re-creating it in place needs, and its commands.

A leak inside a GPU instance (memory a dead process left behind) is freed by destroying the
instance and creating it again with the same profile at the same placement, which leaves every
other instance of the GPU, and the jobs in them, untouched. A compute instance alone cannot
give the memory back: the compute instances of a GPU instance share its memory, so the unit
recovered is the GPU instance (docs/findings.md#mig has the sources).

This module owns, purely (no I/O, no clock):

- :func:`recovery_of`: the :class:`InstanceRecovery` of a finding's instance (its parent GPU,
  GPU instance id, its compute instance, GI profile id and placement), or why it cannot be
  re-created in place (any of those unknown; several compute instances, which ``-C`` would
  not bring back as they were).
- :data:`DEFAULT_COMMANDS`: the ``nvidia-smi mig`` command lines of a recovery, and
  :func:`recovery_argvs`, which fills them in through :func:`~gpuwatchd.decide.argv.format_argv`
  (so every value is checked against its documented format before anything runs).
- :func:`instance_blockers`: who may still use the instance (a live process NVML lists in it,
  a holder of its capability files, a holder of the parent node whose instance is unknown, an
  unreadable process list): the recovery's own live-holder gate, the other instances' users
  never among them.
- :func:`recovered`: whether a later snapshot shows the instance back (same profile and
  placement) with its memory freed.

The gates around it (confirmation window, live holders, limits, dry-run) are the GPU reset's;
this module only says what the action is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuwatchd.decide.argv import format_argv
from gpuwatchd.decide.mig import mig_layout
from gpuwatchd.model import Snapshot

__all__ = [
    "DEFAULT_COMMANDS",
    "MIG_PLACEHOLDERS",
    "InstanceRecovery",
    "instance_blockers",
    "recovered",
    "recovery_argvs",
    "recovery_of",
]

# What a recovery command may name: the parent GPU by its stable names, and the instance.
MIG_PLACEHOLDERS = ("uuid", "pci_bus_id", "gi", "ci", "mig_uuid", "profile", "placement")

# Destroy the GPU instance's compute instances, then the GPU instance, then create it again
# with the same GI profile at the same placement start, with its default compute instance
# (-C). nvidia-smi names the GPU by its UUID: an index may change across the re-creation.
DEFAULT_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("nvidia-smi", "mig", "-i", "{uuid}", "-gi", "{gi}", "-ci", "{ci}", "-dci"),
    ("nvidia-smi", "mig", "-i", "{uuid}", "-gi", "{gi}", "-dgi"),
    ("nvidia-smi", "mig", "-i", "{uuid}", "-cgi", "{profile}:{placement}", "-C"),
)


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

    def describe(self) -> str:
        return (
            f"re-create MIG GPU instance {self.gi} of GPU {self.gpu_index} "
            f"(GI profile {self.profile}, placement {self.placement}:{self.size})"
        )


def recovery_of(snapshot: Snapshot, instance_uuid: str | None) -> InstanceRecovery | str:
    """The recovery of the judged GPU instance named ``instance_uuid`` in ``snapshot``, or why
    it cannot be re-created in place. Unknown never counts as known: a missing profile id,
    placement or compute instance id refuses."""
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
    if device.placement is None:
        return f"GPU instance {instance.gi}: its placement is unknown"
    if device.uuid is None:
        return f"GPU instance {instance.gi}: its MIG UUID is unknown"
    start, size = device.placement
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


def instance_blockers(snapshot: Snapshot, instance_uuid: str) -> list[str]:
    """Why GPU instance ``instance_uuid`` may be in use in ``snapshot``; empty when nothing
    is known to hold it. Unknown counts as in use: an instance not judged, an unreadable
    process list, a holder of the parent node with no capability of any instance (it may use
    this one). The daemon's own PIDs are left out; users of the other instances never count."""
    layout = mig_layout(snapshot)
    instance = layout.instance_of(instance_uuid)
    if instance is None:
        return ["not a judged MIG GPU instance in this snapshot"]
    own = set(snapshot.self_pids)
    why: list[str] = []
    listed: set[int] = set()
    for device in instance.devices:
        if device.processes is None:
            why.append(f"GPU instance {instance.gi}: its process list is unknown")
        for entry in device.processes or ():
            proc = snapshot.processes.get(entry.pid)
            if proc is not None and not proc.is_zombie:
                listed.add(entry.pid)
    holders = {pid for pid, named in layout.attributed.items() if instance_uuid in named}
    unsure = {pid for pid, parents in layout.parent_only.items() if instance.parent.uuid in parents}
    for pids, what in (
        (listed - own, "listed by NVML in it"),
        (holders - own, "holding its capability files"),
        (unsure - holders - own, "holding its GPU's device node, instance unknown"),
    ):
        if pids:
            shown = ", ".join(str(pid) for pid in sorted(pids)[:5])
            why.append(f"GPU instance {instance.gi}: PID {shown} {what}")
    return why


def recovery_argvs(
    recovery: InstanceRecovery, commands: Sequence[Sequence[str]] = DEFAULT_COMMANDS
) -> tuple[tuple[str, ...], ...]:
    """Each command line of ``recovery``, filled in. ValueError when a value is not in its
    placeholder's documented format: nothing of the recovery is run then."""
    return tuple(format_argv(argv, **recovery.values()) for argv in commands)


def recovered(recovery: InstanceRecovery, snapshot: Snapshot, *, max_used: int) -> str | None:
    """None when ``snapshot`` shows a GPU instance of the same GPU with the same profile at the
    same placement using at most ``max_used`` bytes; else what is still wrong. Its GPU
    instance id and MIG UUID may be new: the driver chooses them."""
    layout = mig_layout(snapshot)
    if recovery.uuid not in layout.judged:
        why = layout.unjudged.get(recovery.uuid, "the GPU is not in MIG mode in this snapshot")
        return f"GPU {recovery.gpu_index}: {why}"
    for instance in layout.instances_of(recovery.uuid):
        device = instance.memory_device
        if device.gi_profile_id != recovery.profile or device.placement != (
            recovery.placement,
            recovery.size,
        ):
            continue
        memory = device.memory
        used = None if memory is None else memory.allocated
        if used is None:
            return f"GPU instance {instance.gi} is back; its memory use is unknown"
        if used > max_used:
            return f"GPU instance {instance.gi} is back but still uses {used} bytes"
        return None
    return f"no GPU instance with GI profile {recovery.profile} at placement {recovery.placement}"
