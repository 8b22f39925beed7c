"""MIG in ``scan``: each MIG GPU's instances, under their GPU, in the JSON document and the text.

An instance entry is built as a GPU's is (``report.py`` passes its builder, run over
:func:`gpuwatchd.decide.mig.instances.instance_view`), then given its MIG facts. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from gpuwatchd.collect.mig import cap_minor
from gpuwatchd.core.checked import as_list, as_map, as_text
from gpuwatchd.core.model import (
    DeviceHolding,
    GpuInfo,
    GpuMemory,
    MigCapability,
    MigDevice,
    NvmlProcess,
    as_int,
)
from gpuwatchd.decide.mig.instances import MigLayout, instance_gpu

# The parts of a GPU entry an instance entry keeps (the rest is the parent's to say).
_KEPT = ("memory", "report_only", "notes", "processes_known", "processes", "holders", "verdict")


def mig_instances_json(
    gpu: GpuInfo,
    layout: MigLayout,
    entry_for: Callable[[GpuInfo], dict[str, object]],
) -> list[dict[str, object]] | None:
    """The ``mig_instances`` of ``gpu``'s entry: None unless MIG is on and its devices read; a GPU
    whose instances are not judged lists them from NVML alone (``judged`` false, no holders)."""
    if gpu.mig_enabled is not True or gpu.mig_devices is None:
        return None
    if gpu.uuid not in layout.judged:
        return [
            {
                "gi": d.gi,
                "ci": [] if d.ci is None else [d.ci],
                "uuid": d.uuid,
                "mig_uuids": [d.uuid],
                "profile": d.profile,
                **_placed(d),
                "judged": False,
            }
            for d in gpu.mig_devices
        ]
    found: list[dict[str, object]] = []
    for instance in layout.instances_of(gpu.uuid):
        whole = entry_for(instance_gpu(instance))
        found.append(
            {
                "gi": instance.gi,
                "ci": list(instance.cis),
                "uuid": instance.uuid,
                "mig_uuids": [d.uuid for d in instance.devices],
                "profile": instance.profile,
                **_placed(instance.memory_device),
                **{key: whole.get(key) for key in _KEPT if key in whole},
                "judged": True,
            }
        )
    return found


def _placed(device: MigDevice) -> dict[str, object]:
    placement = None if device.placement is None else list(device.placement)
    return {"gi_profile_id": device.gi_profile_id, "placement": placement}


def mig_judged(gpu: Mapping[str, object]) -> bool:
    """Whether a GPU entry's instances are judged one by one (its rows are theirs)."""
    return any(as_map(i).get("judged") is True for i in as_list(gpu.get("mig_instances")))


def parent_rows(gpu: Mapping[str, object]) -> dict[str, object]:
    """A judged MIG GPU's own rows: only holders it explains itself (parent-only holders);
    NVML's aggregate list and the instances' holders are shown under the instances."""
    kept = [h for h in as_list(gpu.get("holders")) if as_map(h).get("role") is not None]
    return {**gpu, "processes": [], "holders": kept}


def instance_uuids(report: Mapping[str, object]) -> set[str]:
    """Every judged instance UUID of a report: findings about them are no node findings."""
    return {
        uuid
        for gpu in as_list(report.get("gpus"))
        for raw in as_list(as_map(gpu).get("mig_instances"))
        if (uuid := as_text(as_map(raw).get("uuid"))) is not None
    }


def mig_devices_from_report(raw: Mapping[str, object]) -> tuple[MigDevice, ...] | None:
    """A saved GPU entry's ``mig_instances`` back as MIG devices (``explain``), so that a
    finding naming an instance is known to be about this GPU. Malformed entries are skipped;
    None when the entry has none."""
    instances = raw.get("mig_instances")
    if not isinstance(instances, list):
        return None
    devices: list[MigDevice] = []
    for item in instances[:16]:
        if not isinstance(item, Mapping):
            continue
        gi = as_int(item.get("gi"))
        if gi is None:
            continue
        ids = [c for c in as_list(item.get("ci")) if isinstance(c, int) and not isinstance(c, bool)]
        names = [u if isinstance(u, str) else None for u in as_list(item.get("mig_uuids"))]
        profile = item.get("profile")
        profile_id = as_int(item.get("gi_profile_id"))
        place = [p for p in (as_int(p) for p in as_list(item.get("placement"))) if p is not None]
        placement = (place[0], place[1]) if len(place) == 2 else None
        memory = as_map(item.get("memory"))
        used, total = as_int(memory.get("used")), as_int(memory.get("total"))
        listed = tuple(
            NvmlProcess(pid, as_int(e.get("used_memory")), str(e.get("type") or "compute"))
            for e in as_list(item.get("processes"))
            if isinstance(e, Mapping) and (pid := as_int(e.get("pid"))) is not None
        )
        for position, ci in enumerate(ids or [0]):
            devices.append(
                MigDevice(
                    index=len(devices),
                    uuid=names[position] if position < len(names) else None,
                    gi=gi,
                    ci=ci,
                    profile=profile if isinstance(profile, str) else None,
                    gi_profile_id=profile_id if profile_id is None or profile_id >= 0 else None,
                    placement=placement,
                    memory=None if used is None else GpuMemory(total, None, 0, used),
                    # a saved report lists an instance's processes once, for all its CIs
                    processes=listed if position == 0 and item.get("processes_known") else (),
                )
            )
    return tuple(devices)


def mig_capabilities(
    holdings: dict[int, DeviceHolding], gpus: Sequence[GpuInfo], gpus_raw: Sequence[object]
) -> dict[int, MigCapability]:
    """The capability table of a saved report's judged MIG instances (``explain``), each
    instance holder's capability minors (by fd, by mapping) added to ``holdings``: so each
    holder is placed in its instance as the daemon placed it."""
    table: dict[int, MigCapability] = {}
    for gpu, raw in zip(gpus, gpus_raw, strict=True):
        minor = gpu.minor
        if minor is None or not isinstance(raw, Mapping):
            continue
        for item in map(as_map, as_list(raw.get("mig_instances"))):
            gi = as_int(item.get("gi"))
            if gi is None or item.get("judged") is not True:
                continue
            cis = [c for c in (as_int(c) for c in as_list(item.get("ci"))) if c is not None]
            minors = {cap_minor(minor, gi): MigCapability(minor, gi)}
            minors.update({cap_minor(minor, gi, c): MigCapability(minor, gi, c) for c in cis})
            table.update(minors)
            for entry in map(as_map, as_list(item.get("holders"))):
                pid = as_int(entry.get("pid"))
                if pid is None:
                    continue
                via = as_list(entry.get("via"))
                by_fd = "fd" in via or not via
                old = holdings.get(pid, DeviceHolding(pid))
                holdings[pid] = dataclasses.replace(
                    old,
                    cap_minors_fd=old.cap_minors_fd | (set(minors) if by_fd else set()),
                    cap_minors_map=old.cap_minors_map
                    | (set(minors) if not by_fd or "map" in via else set()),
                )
    return table


def instance_process_entries(raw: Mapping[str, object]) -> list[Mapping[str, object]]:
    """The process and holder entries of a saved GPU entry's instances (``explain``)."""
    return [
        entry
        for item in as_list(raw.get("mig_instances"))
        for key in ("processes", "holders")
        for entry in as_list(as_map(item).get(key))
        if isinstance(entry, Mapping)
    ]
