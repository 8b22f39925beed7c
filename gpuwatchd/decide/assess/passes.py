"""Findings: what one snapshot, plus what earlier polls remembered, says about the host.

This module owns ``assess`` (``assess_processes``, then GPU health) and the order of its
passes over one shared state (``shared.py``): the NVML listings, the holders and the orphan
rule, GPU-level memory and the driver's refused resets; MIG instances are judged as GPUs of
their own. In detail: docs/internals.md, section `gpuwatchd.decide.assess.passes`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from gpuwatchd.core.model import Snapshot
from gpuwatchd.decide.assess.holders import HolderPass
from gpuwatchd.decide.assess.listing import ListingPass
from gpuwatchd.decide.assess.memory import MemoryPass
from gpuwatchd.decide.assess.shared import NODE, Assessment, HolderRole
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.health.judge import assess_health
from gpuwatchd.decide.mig.instances import (
    MigLayout,
    annotate_findings,
    annotate_report_only,
    instance_view,
    mig_layout,
)
from gpuwatchd.decide.policy import Detection, HealthPolicy


class _Assessor(ListingPass, HolderPass, MemoryPass):
    """One assessment: the listing, holder and memory passes over one shared state."""


Refused = Mapping[str, Mapping[str, object]]  # GPU UUID -> a refused reset's evidence


def assess(
    snapshot: Snapshot,
    previous: AssessState,
    detection: Detection,
    *,
    driver_refused: Refused | None = None,
    health_policy: HealthPolicy | None = None,
    processes: Callable[[Snapshot, AssessState, Detection, Refused], Assessment] | None = None,
) -> Assessment:
    """Judge one snapshot: findings with evidence, each holder's role, and the new state. Pure.
    ``driver_refused``: per GPU UUID, a reset the driver refused as in use while no scan saw a
    holder (``plan.hidden_holders``); ``processes``: ``Reuse``'s :func:`assess_processes`."""
    passes = processes or assess_processes
    result = passes(snapshot, previous, detection, driver_refused or {})
    boot_id = previous.boot_id if snapshot.boot_id is None else snapshot.boot_id
    boot_changed = previous.boot_id not in (None, boot_id)
    health = assess_health(
        snapshot, previous.health, boot_changed=boot_changed, policy=health_policy
    )
    return replace(
        result,
        findings=result.findings + health.findings,
        state=replace(result.state, health=health.state, boot_id=boot_id),
        xid_notices=health.xid_notices,
    )


def assess_processes(
    snapshot: Snapshot, previous: AssessState, detection: Detection, driver_refused: Refused
) -> Assessment:
    """:func:`assess` without GPU health (the state's ``health`` is the default). Pure; the
    clock enters only as ``snapshot.monotonic`` stamped on state entries that are new."""
    layout = mig_layout(snapshot)
    assessor = _Assessor(instance_view(snapshot, layout), previous, detection)
    assessor.assess_listings()
    assessor.assess_holders()
    assessor.assess_memory()
    assessor.assess_driver_refusals(driver_refused)
    return _with_mig(assessor.result(), layout, snapshot)


def _with_mig(result: Assessment, layout: MigLayout, snapshot: Snapshot) -> Assessment:
    """Findings about a MIG instance name it; a parent-only holder is said to be one, and its
    role is on each judged parent it holds (moved there from NODE: it holds no GPU of the view)."""
    if not layout.judged and not layout.unjudged:
        return result
    roles: list[HolderRole] = []
    marked: set[tuple[str, int]] = set()
    for role in result.roles:
        parents = layout.parent_only.get(role.pid, ())
        if role.gpu != NODE or not parents:
            roles.append(role)
        for uuid in parents:
            if (uuid, role.pid) not in marked:
                marked.add((uuid, role.pid))
                roles.append(replace(role, gpu=uuid))
    return replace(
        result,
        findings=tuple(annotate_findings(result.findings, layout, snapshot)),
        roles=tuple(roles),
        report_only=annotate_report_only(result.report_only, layout),
    )
