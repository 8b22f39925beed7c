"""Each GPU's idle memory (docs/design-notes.md, section 6): which figure to compare (v2
allocated memory, or v1 "used" under its own key), learning it, and "back to baseline". Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuwatchd.core.model import MIB, GpuInfo
from gpuwatchd.decide.assess.host_view import HostView
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.policy import Detection

V1_BASELINE_SUFFIX = "@v1"  # baselines of v1 "used" memory (reservation included) live apart
V1_MAX_RESERVATION = 1024 * MIB  # the most v1 "used" may include for the driver's reservation


def memory_figure(gpu: GpuInfo) -> tuple[str, int] | None:
    """The baseline key and current memory figure to learn from or compare, if any."""
    memory = gpu.memory
    if memory is None:
        return None
    if memory.allocated is not None:
        return gpu.uuid, memory.allocated
    if memory.api == "v1" and memory.used_v1 is not None:
        return gpu.uuid + V1_BASELINE_SUFFIX, memory.used_v1
    return None


def compared_figure(
    gpu: GpuInfo, baselines: Mapping[str, int], default: int
) -> tuple[int, int, bool] | str:
    """(memory figure, the baseline it is judged against, whether that was learned) for ghost
    memory and the verdict alike; else why there is none (v1 "used" includes the reservation:
    only a learned baseline will do)."""
    figure = memory_figure(gpu)
    if figure is None:
        return "allocated memory unknown"
    key, value = figure
    if key in baselines:
        return value, baselines[key], True
    if key.endswith(V1_BASELINE_SUFFIX):
        return "v1 memory API and no idle baseline learned yet"
    return value, default, False


def learn_baselines(
    host: HostView, previous: Mapping[str, int], detection: Detection
) -> dict[str, int]:
    """Each GPU's idle memory, learned as docs/design-notes.md §6 says: a first figure above the
    default baseline plus the ghost margin (v1: plus the reservation) is never learned."""
    learned = dict(previous)
    if not host.full_scan or host.unreadable_suspects():
        return learned
    for gpu in host.gpus:
        if gpu.lost or gpu.mig_enabled or gpu.coherent_memory is not False or gpu.minor is None:
            continue
        if gpu.processes is None or gpu.processes:
            continue
        if any(h.uvm or not host.is_floor(h.pid) for h in host.holders_of(gpu)):
            continue
        figure = memory_figure(gpu)
        if figure is None:
            continue
        key, value = figure
        ceiling = detection.default_baseline + detection.ghost_margin
        if key.endswith(V1_BASELINE_SUFFIX):
            ceiling += V1_MAX_RESERVATION
        if key not in learned and value > ceiling:
            continue
        learned[key] = min(value, learned.get(key, value))
    return _without_gone_instances(learned, host)


def _without_gone_instances(learned: dict[str, int], host: HostView) -> dict[str, int]:
    """``learned`` less the baselines of MIG GPU instances NVML no longer shows (a re-created
    instance has a new name, so they would pile up). Nothing is dropped while NVML cannot be
    read."""
    if not host.snapshot.nvml.answered:
        return learned
    present = {gpu.uuid for gpu in host.gpus}
    return {
        key: value
        for key, value in learned.items()
        if not key.startswith("MIG-") or key.removesuffix(V1_BASELINE_SUFFIX) in present
    }


def back_to_baseline(
    uuid: str, allocated: int | None, state: AssessState, detection: Detection
) -> bool | None:
    """After a reset: is this GPU's allocated memory back within the margin of its (learned,
    else default) idle baseline? None when the memory is unknown."""
    if allocated is None:
        return None
    baseline = state.baselines.get(uuid, detection.default_baseline)
    return allocated <= baseline + detection.ghost_margin
