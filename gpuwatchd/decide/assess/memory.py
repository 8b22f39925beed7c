"""The GPU-level pass: ``ghost_memory`` (with every reason memory above the idle baseline is
not judged one), ``unaccounted_memory``, and the hidden holder a refused reset reveals.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuwatchd.core.model import FindingKind, GpuInfo
from gpuwatchd.core.vocabulary import HolderRoleName
from gpuwatchd.decide.assess.baselines import compared_figure
from gpuwatchd.decide.assess.shared import AssessorState, mib


class MemoryPass(AssessorState):
    """GPU-level memory findings."""

    def assess_memory(self) -> None:
        for gpu in self.host.gpus:
            if gpu.lost:
                continue
            if gpu.coherent_memory:
                self.note(gpu, "coherent memory (NUMA node set): memory-based detection is off")
                continue
            if gpu.coherent_memory is None:
                self.note(
                    gpu,
                    "whether its memory is coherent is unknown (its NUMA node could not be "
                    "read): memory-based detection is off",
                )
                continue
            if gpu.mig_enabled:
                self.note(gpu, "MIG enabled: memory-based detection is off")
                continue
            self.check_ghost(gpu)
            self.check_unaccounted(gpu)

    def check_ghost(self, gpu: GpuInfo) -> None:
        host, detection = self.host, self.detection
        compared = compared_figure(gpu, self.baselines, detection.default_baseline)
        if isinstance(compared, str):
            memory = gpu.memory
            if memory is not None and memory.api == "v1":
                self.note(
                    gpu, "v1 memory API: no ghost detection until an idle baseline is learned"
                )
            elif memory is None or memory.allocated is None:
                self.note(gpu, "allocated memory unknown: no ghost detection")
            return
        figure, baseline, learned = compared
        if figure <= baseline + detection.ghost_margin:
            return
        excess = figure - baseline
        why_not: list[str] = []
        if gpu.minor is None:
            why_not.append("its minor number is unknown, so its holders cannot be found")
        if gpu.processes is None:
            why_not.append("its process list could not be read")
        live = [row.entry.pid for row in host.listings[gpu.uuid] if row.status != "dead"]
        if live:
            why_not.append(f"NVML lists live PID(s) {_pids(live)}")
        monitors = self.monitors(gpu)
        holders = self.holders(gpu, monitors)
        if holders:
            why_not.append(f"held by PID(s) {_pids(holders)}")
        if not host.full_scan:
            why_not.append("the holder scan was targeted, not full")
        suspects = host.unreadable_suspects()
        if suspects:
            why_not.append(f"PID(s) {_pids(suspects)} could not be read (unknown is not none)")
        if why_not:
            self.note(gpu, f"{mib(excess)} above baseline but not ghost: " + "; ".join(why_not))
            return
        dead = [row.entry.pid for row in host.listings[gpu.uuid]]
        self.add(
            FindingKind.GHOST_MEMORY,
            gpu,
            None,
            None,
            f"GPU {gpu.index} has {mib(figure)} allocated, {mib(excess)} above its "
            f"{'learned' if learned else 'default'} idle baseline, and no live process holds it",
            memory=excess,
            evidence={
                "allocated": figure,
                "baseline": baseline,
                "baseline_learned": learned,
                "margin": detection.ghost_margin,
                "memory_api": gpu.memory.api if gpu.memory is not None else None,
                "dead_pids": dead,
                # NVML-only clients holding it: they block its reset, not this finding
                "monitors": sorted(monitors),
            },
        )

    def check_unaccounted(self, gpu: GpuInfo) -> None:
        host = self.host
        memory = gpu.memory
        if memory is None or memory.allocated is None or gpu.processes is None:
            return
        holders = self.holders(gpu, self.monitors(gpu))
        if not holders:
            return
        baseline = self.baselines.get(gpu.uuid, self.detection.default_baseline)
        live = [row for row in host.listings[gpu.uuid] if row.status != "dead"]
        figures = [row.entry.used_memory for row in live]
        if any(value is None for value in figures):
            self.note(gpu, "a live owner's memory figure is unknown: unaccounted memory unchecked")
            return
        accounted = sum(value for value in figures if value is not None)
        excess = memory.allocated - accounted - baseline
        if excess <= self.detection.unaccounted_margin:
            return
        self.add(
            FindingKind.UNACCOUNTED_MEMORY,
            gpu,
            None,
            None,
            f"GPU {gpu.index} has {mib(memory.allocated)} allocated but its live context owners "
            f"account for {mib(accounted)}; {mib(excess)} is unexplained",
            memory=excess,
            informational=True,
            evidence={
                "allocated": memory.allocated,
                "accounted": accounted,
                "baseline": baseline,
                "margin": self.detection.unaccounted_margin,
                "live_owners": [row.entry.pid for row in live],
                "holders": holders,
            },
        )

    def monitors(self, gpu: GpuInfo) -> set[int]:
        """The NVML-only clients holding ``gpu`` (not infrastructure): they hold no memory
        (docs/internals.md, ``gpuwatchd.decide.plan.monitors``)."""
        return {
            role.pid
            for role in self.roles
            if role.gpu == gpu.uuid
            and role.role is HolderRoleName.MANAGEMENT
            and not self.host.is_floor(role.pid)
        }

    def holders(self, gpu: GpuInfo, monitors: set[int]) -> list[int]:
        """The PIDs holding ``gpu``, infrastructure and ``monitors`` aside."""
        host = self.host
        return [
            h.pid
            for h in host.holders_of(gpu)
            if not host.is_floor(h.pid) and h.pid not in monitors
        ]

    def assess_driver_refusals(self, refused: Mapping[str, Mapping[str, object]]) -> None:
        """A GPU whose reset the driver refused as in use while no scan saw a holder has a
        hidden holder."""
        for gpu in self.host.gpus:
            evidence = refused.get(gpu.uuid)
            if evidence is None:
                continue
            self.add(
                FindingKind.HIDDEN_HOLDER,
                gpu,
                None,
                None,
                f"the driver refused to reset GPU {gpu.index}: in use by another client, yet no "
                "holder scan found one. Something holds the GPU where no walk of /proc looks: a "
                "file descriptor in flight in a unix-socket message (SCM_RIGHTS), a holder in "
                "another PID namespace or a VM, or a thread whose files could not be read. No "
                "reset of this GPU until its memory changes, the incident ends, the "
                "configuration is reloaded or `gpuwatchd resume --clear-latches` is run",
                informational=True,
                evidence=dict(evidence),
            )


def _pids(pids: Iterable[int]) -> str:
    return ", ".join(str(pid) for pid in pids)
