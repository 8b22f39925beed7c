"""MIG for hand-built snapshots: turn one GPU of a ``HostBuilder`` snapshot into a MIG GPU.

Owns a small description of GPU instances (:class:`Inst`) and :func:`with_mig`, which gives
the GPU its MIG devices, the aggregate process list NVML gives the parent, the capability
table the driver writes (mig-minors numbering, ``tests.support.fakenvml.cap_minor``) and the
capability files each process holds. Pure; no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuwatchd.core.model import (
    MIB,
    DeviceHolding,
    GpuMemory,
    HolderScan,
    MigCapability,
    MigDevice,
    NvmlProcess,
    NvmlReading,
    Snapshot,
)
from tests.support.fakenvml import cap_minor

GIB = 1024 * MIB


@dataclass(frozen=True)
class Inst:
    """One GPU instance: its compute instances, memory and listed processes (pid, used)."""

    gi: int
    allocated: int | None = 2 * MIB
    processes: tuple[tuple[int, int | None], ...] = ()
    cis: tuple[int, ...] = (0,)
    profile: str = "1g.10gb"
    total: int = 10 * GIB
    readable: bool = True


def mig_uuid(gpu: int, gi: int, ci: int = 0) -> str:
    """The MIG UUID :func:`with_mig` gives compute instance ``ci`` of GPU instance ``gi``."""
    return f"MIG-{gpu:08x}-{gi:04x}-4{ci:03x}-8000-{gi * 16 + ci:012x}"


def caps_table(gpu_minors: Iterable[int]) -> dict[int, MigCapability]:
    """The whole mig-minors table for GPUs with these minors."""
    table: dict[int, MigCapability] = {}
    for minor in gpu_minors:
        for gi in range(15):
            table[cap_minor(minor, gi)] = MigCapability(minor, gi)
            for ci in range(8):
                table[cap_minor(minor, gi, ci)] = MigCapability(minor, gi, ci)
    return table


def with_mig(
    snapshot: Snapshot,
    *,
    gpu: int = 0,
    instances: Iterable[Inst] = (),
    caps: Mapping[int, Iterable[tuple[int, int | None]]] | None = None,
    cap_files: Mapping[int, Iterable[tuple[int, int | None]]] | None = None,
    via: str = "fd",
    table: bool = True,
) -> Snapshot:
    """``snapshot`` with GPU ``gpu`` in MIG mode holding ``instances``.

    ``caps`` maps a PID to the (gi, ci) pairs whose capability device files it holds (ci None:
    the GPU instance's alone; each (gi, ci) pair also holds the GI's), by ``via`` ("fd" or
    "map"); ``cap_files`` the same for the procfs form. ``table=False``: the mig-minors file
    could not be read.
    """
    devices: list[MigDevice] = []
    aggregate: list[NvmlProcess] = []
    parent = next(g for g in snapshot.nvml.gpus if g.index == gpu)
    minor = parent.minor if parent.minor is not None else gpu
    for inst in instances:
        memory = GpuMemory(
            total=inst.total,
            free=None if inst.allocated is None else inst.total - inst.allocated,
            reserved=0,
            allocated=inst.allocated,
        )
        for position, ci in enumerate(inst.cis):
            listed = tuple(NvmlProcess(pid, used, "compute") for pid, used in inst.processes)
            own = listed if position == 0 else ()
            aggregate += own
            devices.append(
                MigDevice(
                    index=len(devices),
                    uuid=mig_uuid(gpu, inst.gi, ci),
                    gi=inst.gi,
                    ci=ci,
                    name=f"NVIDIA H100 80GB HBM3 MIG {inst.profile}",
                    profile=inst.profile,
                    gi_profile_id=19,
                    placement=(inst.gi, 1),
                    memory=memory,
                    processes=own if inst.readable else None,
                )
            )
    gpus = tuple(
        dataclasses.replace(
            g, mig_enabled=True, mig_devices=tuple(devices), processes=tuple(aggregate)
        )
        if g.index == gpu
        else g
        for g in snapshot.nvml.gpus
    )
    holdings = dict(snapshot.holders.holdings)
    for pid, pairs in (caps or {}).items():
        minors: set[int] = set()
        for gi, held_ci in pairs:
            minors.add(cap_minor(minor, gi))
            if held_ci is not None:
                minors.add(cap_minor(minor, gi, held_ci))
        held = holdings.get(pid, DeviceHolding(pid))
        if via == "map":
            held = dataclasses.replace(held, cap_minors_map=held.cap_minors_map | minors)
        else:
            held = dataclasses.replace(held, cap_minors_fd=held.cap_minors_fd | minors)
        holdings[pid] = held
    for pid, pairs in (cap_files or {}).items():
        files = {MigCapability(minor, gi, file_ci) for gi, file_ci in pairs}
        files |= {MigCapability(minor, gi) for gi, _ in pairs}
        held = holdings.get(pid, DeviceHolding(pid))
        holdings[pid] = dataclasses.replace(held, cap_files=held.cap_files | files)
    nvml = NvmlReading(
        available=snapshot.nvml.available,
        wedged=snapshot.nvml.wedged,
        error=snapshot.nvml.error,
        driver_version=snapshot.nvml.driver_version,
        gpus=gpus,
    )
    minors_known = [g.minor for g in gpus if g.minor is not None]
    return dataclasses.replace(
        snapshot,
        nvml=nvml,
        holders=HolderScan(
            mode=snapshot.holders.mode,
            holdings=holdings,
            unreadable=snapshot.holders.unreadable,
            matched_by_name=snapshot.holders.matched_by_name,
        ),
        mig_caps=caps_table(minors_known) if table else None,
        mig_caps_error=None if table else "mig_minors_file /x: No such file or directory",
    )
