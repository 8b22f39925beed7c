"""Prometheus gauges for MIG instances: one sample set per GPU instance of a judged MIG GPU.

This module owns the ``gpuwatchd_mig_instance_*`` metrics (docs/metrics.md#mig): labels
``gpu`` (the parent's UUID), ``index`` (the parent's index), ``gi`` (the GPU instance id) and
``instance`` (the instance's MIG UUID), all bounded by the node's hardware (at most seven GPU
instances per GPU). Set afresh from each poll's snapshot and assessment, as the per-GPU gauges
are (``metrics.py``); unknown values have no sample. It decides nothing. :func:`maker` is
how every gpuwatchd metric, here and in ``metrics.py``, is made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.metrics import MetricWrapperBase

from gpuwatchd.core.model import FindingKind, GpuInfo, Snapshot
from gpuwatchd.decide.assess.host_view import HostView
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.mig.instances import instance_view, mig_layout

MIG_LABELS = ("gpu", "index", "gi", "instance")

M = TypeVar("M", bound=MetricWrapperBase)


def maker(
    kind: type[M], registry: CollectorRegistry, labels: tuple[str, ...] = ()
) -> Callable[..., M]:
    """``make(name, doc, extra=())``: a ``kind`` metric in ``registry`` whose labels are
    ``labels`` then ``extra`` (every metric of gpuwatchd is made this way)."""

    def make(name: str, doc: str, extra: tuple[str, ...] = ()) -> M:
        return kind(name, doc, (*labels, *extra), registry=registry)

    return make


def accounted_memory(host: HostView, gpu: GpuInfo) -> int | None:
    """What NVML's per-process figures of the live PIDs it lists on ``gpu`` add up to (a
    listed zombie counts as live, as in assess); None when the list or a figure is unknown."""
    if gpu.processes is None:
        return None
    figures = [row.entry.used_memory for row in host.listings[gpu.uuid] if row.status != "dead"]
    return None if None in figures else sum(f for f in figures if f is not None)


class MigGauges:
    """Per-instance memory and findings of the node's judged MIG GPUs."""

    def __init__(self, registry: CollectorRegistry) -> None:
        gauge = maker(Gauge, registry, MIG_LABELS)
        self.allocated = gauge(
            "gpuwatchd_mig_instance_memory_allocated_bytes",
            "Memory allocated in the MIG GPU instance (shared by its compute instances)",
        )
        self.accounted = gauge(
            "gpuwatchd_mig_instance_memory_accounted_bytes",
            "Memory NVML attributes to the live processes it lists in the GPU instance",
        )
        self.ghost = gauge(
            "gpuwatchd_mig_instance_memory_ghost_bytes",
            "Memory of a current ghost_memory finding in the GPU instance, else 0",
        )
        self.findings = gauge(
            "gpuwatchd_mig_instance_findings",
            "Current findings about the GPU instance, by kind",
            ("kind",),
        )

    def update(self, snapshot: Snapshot, assessment: Assessment) -> None:
        for gauge in (self.allocated, self.accounted, self.ghost, self.findings):
            gauge.clear()
        layout = mig_layout(snapshot)
        if not layout.instances:
            return
        host = HostView(instance_view(snapshot, layout))
        by_uuid = {gpu.uuid: gpu for gpu in host.gpus}
        for uuid, instance in sorted(layout.instances.items()):
            labels = (instance.parent.uuid, str(instance.parent.index), str(instance.gi), uuid)
            gpu = by_uuid.get(uuid)
            memory = None if gpu is None else gpu.memory
            allocated = None if memory is None else memory.allocated
            if allocated is not None:
                self.allocated.labels(*labels).set(allocated)
            accounted = None if gpu is None else accounted_memory(host, gpu)
            if accounted is not None:
                self.accounted.labels(*labels).set(accounted)
            kinds: dict[str, int] = {}
            ghost = 0 if allocated is not None else None
            for finding in assessment.findings:
                if finding.gpu != uuid:
                    continue
                kinds[finding.kind.value] = kinds.get(finding.kind.value, 0) + 1
                if finding.kind is FindingKind.GHOST_MEMORY and finding.memory is not None:
                    ghost = finding.memory
            if ghost is not None:
                self.ghost.labels(*labels).set(ghost)
            for kind in FindingKind:
                self.findings.labels(*labels, kind.value).set(kinds.get(kind.value, 0))
