"""The GPU reset gates and the start of a reset.

This module owns whether a GPU may be reset now (``reset_gates``: the snapshot's gates, then
the history gates of ``history_blocker``) and the ``ResetIntent`` that starts one. Ghost memory
inside a MIG GPU instance passes the instance's own gates and its parent GPU's history gates;
its intent re-creates the instance (decide/mig/recovery.py).

In detail: docs/internals.md, section `gpuwatchd.decide.plan.resets`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from gpuwatchd.core.model import Finding, FindingKind, GpuInfo, Snapshot, fields_of
from gpuwatchd.core.vocabulary import EventName, LadderStatus, Level
from gpuwatchd.decide.floor import live_holder
from gpuwatchd.decide.kinds import LIVE_HOLDER
from gpuwatchd.decide.mig.instances import WHOLE_GPU, busy_instances, parent_of
from gpuwatchd.decide.mig.recovery import (
    InstanceRecovery,
    instance_blockers,
    layout_of,
    recovery_of,
)
from gpuwatchd.decide.plan.intents import (
    Ctx,
    ResetIntent,
    Work,
    finding_fields,
    hold_reason,
    is_dry_run,
)
from gpuwatchd.decide.plan.monitors import describe_monitor, monitor_entry
from gpuwatchd.decide.plan.state import ResetInFlight
from gpuwatchd.decide.policy import Monitor, Policy
from gpuwatchd.decide.targets import gpu_by_uuid, gpu_protected


def node_block(snapshot: Snapshot) -> str | None:
    """Why no action may be taken on this node this poll (NVML, namespaces); None: none."""
    reading = snapshot.nvml
    if not reading.available:
        return "NVML unavailable"
    if reading.wedged:
        return "NVML is wedged (a call missed its deadline)"
    if snapshot.host_namespaces is not True:
        return "host PID/cgroup namespaces not visible"
    return None


REFUSAL_MEMORY_CHANGE = 64 * 1024 * 1024  # bytes of allocated memory that count as a change


def review_refusals(w: Work, ctx: Ctx) -> None:
    """Forget a refused incident, or a MIG recovery left half done, once something changed
    (docs/internals.md)."""
    _review_unfinished(w, ctx)
    for uuid, held in sorted(w.reset_refusals.items()):
        allocated = _refused_memory(ctx, uuid, held.finding_key)
        why = None
        if held.finding_key not in ctx.findings:
            why = "the incident is over (its finding resolved)"
        elif allocated is not None and held.allocated is None:
            w.reset_refusals[uuid] = replace(held, allocated=allocated)
        elif (
            allocated is not None
            and held.allocated is not None
            and abs(allocated - held.allocated) >= REFUSAL_MEMORY_CHANGE
        ):
            why = f"its allocated memory changed ({held.allocated} -> {allocated} bytes)"
        if why is None and not held.in_use:
            why = _holder_let_go(w, ctx, uuid)
        if why is not None:
            del w.reset_refusals[uuid]
            w.event(EventName.RESET_REFUSAL_CLEARED, Level.INFO, gpu=uuid,
                    finding=held.finding_key, in_use=held.in_use, why=why)  # fmt: skip


def _review_unfinished(w: Work, ctx: Ctx) -> None:
    """A MIG recovery left half done is over once its instance is back (docs/internals.md)."""
    left = dict(w.state.mig_unfinished)
    for mig, u in sorted(left.items()):
        gpu = gpu_by_uuid(ctx.snapshot, u.gpu)
        devices = () if gpu is None else gpu.mig_devices or ()
        planned = (u.placement, u.size)
        if not any(d.gi_profile_id == u.profile and d.placement == planned for d in devices):
            continue
        del left[mig]
        why = f"an instance of GI profile {u.profile} is at placement {u.placement} again"
        w.event(EventName.RESET_MIG_UNFINISHED_CLEARED, Level.INFO, gpu=u.gpu, instance=mig,
                gi=u.gi, why=why)  # fmt: skip
    if len(left) != len(w.state.mig_unfinished):
        w.state = replace(w.state, mig_unfinished=left)


def _holder_let_go(w: Work, ctx: Ctx, uuid: str) -> str | None:
    """Why a refused reset may be tried again: a holder let go (docs/internals.md); or None."""
    held, gpu = w.reset_refusals[uuid], gpu_by_uuid(ctx.snapshot, uuid)
    if gpu is None or gpu.mig_enabled is not False:
        return None  # a MIG GPU: the other instances' users come and go and say nothing
    holder = _live_holder(gpu, ctx.snapshot, ctx.findings.values(), ctx.policy.reset.monitors)
    if holder is not None and not held.held:
        w.reset_refusals[uuid] = replace(held, held=True)
    elif holder is None and held.held:
        return "what held the GPU since the refusal has let go"
    return None


def _refused_memory(ctx: Ctx, uuid: str, finding_key: str) -> int | None:
    """The allocated memory a refused reset of ``uuid`` watches (docs/internals.md)."""
    finding = ctx.findings.get(finding_key)
    mig = parent_of(ctx.snapshot, finding.gpu) if finding is not None else None
    if mig is not None:
        memory = mig[1].memory
    else:
        gpu = gpu_by_uuid(ctx.snapshot, uuid)
        memory = None if gpu is None else gpu.memory
    return None if memory is None else memory.allocated


def say_once(w: Work, finding: Finding, said: tuple[str, Level, str]) -> None:
    """Log a reset decision (event name, level, why) once per finding until it changes."""
    name, level, why = said
    # The circuit breaker is node-wide: said once, not once per GPU.
    key = "node:circuit" if name == EventName.RESET_CIRCUIT_OPEN else finding.key
    if w.noted(key, f"{name}:{why}"):
        w.event(name, level, why=why, **finding_fields(finding))


@dataclass(frozen=True)
class ResetGate:
    """One reason, known from a snapshot alone, that a GPU may not be reset now."""

    name: str
    why: str
    level: Level


def _live_holder(
    gpu: GpuInfo, snapshot: Snapshot, findings: Iterable[Finding], monitors: Sequence[Monitor]
) -> str | None:
    ordered = sorted(findings, key=lambda f: f.key)
    seen: set[int] = set()  # monitors (decide/plan/monitors.py): said last, they may be stoppable
    blocking: list[str] = []
    for other in ordered:
        held = other.evidence.get("gpus")
        if other.pid is None or other.evidence.get("nvml_only") is not True:
            continue
        if gpu.uuid != other.gpu and not (isinstance(held, list) and gpu.uuid in held):
            continue
        seen.add(other.pid)
        proc = snapshot.processes.get(other.pid)
        if proc is None or monitor_entry(proc, monitors) is None:
            blocking.append(
                f"monitor {describe_monitor(other.pid, proc)} holds the GPU: an NVML-only "
                "client (no context, no memory, no nvidia-uvm); reset.monitors may name it "
                "for the reset to stop it and bring it back"
            )
    for other in ordered:
        if other.kind not in LIVE_HOLDER or other.gpu is None or other.pid in seen:
            continue
        if other.gpu != gpu.uuid:
            # One of its MIG GPU instances' own: the driver refused that instance's recovery
            # "in use" (a hidden holder), which never turns into a reset of the whole GPU.
            mig = parent_of(snapshot, other.gpu)
            if mig is None or mig[0].uuid != gpu.uuid or other.pid is not None:
                continue  # another GPU's; a process on an instance is mig_busy's
            if other.kind is not FindingKind.HIDDEN_HOLDER:
                continue
            return f"hidden_holder: the driver refused to re-create {other.gpu}, in use"
        if other.pid is not None:
            return f"{other.kind.value} pid {other.pid} holds the GPU"
        if other.kind == FindingKind.HIDDEN_HOLDER:  # the driver said so (act/reset.py)
            return "hidden_holder: the driver refused the last reset, in use by another client"
    other_holder = live_holder(
        snapshot.holders, snapshot.processes, gpu.minor, snapshot.self_pids | seen
    )
    return other_holder or (blocking[0] if blocking else None)


def reset_gates(
    finding: Finding,
    snapshot: Snapshot,
    policy: Policy,
    *,
    report_only: Mapping[str, str],
    findings: Iterable[Finding],
) -> list[ResetGate]:
    """Every gate that holds the reset of ``finding``'s GPU in this snapshot, in plan's order:
    those that need no history (``explain`` lists them all for a saved report). Pure."""
    reset = policy.reset
    gates: list[ResetGate] = []

    def gate(name: str, why: str, level: Level = Level.INFO) -> None:
        gates.append(ResetGate(name, why, level))

    uuid = finding.gpu or ""
    gpu = gpu_by_uuid(snapshot, finding.gpu)
    blocked = node_block(snapshot)
    if not finding.actionable:
        gate("not_actionable", "not_actionable")
    if uuid in report_only and not _mig_reset_asked(finding, report_only[uuid], policy):
        gate("report_only", f"report_only: {report_only[uuid]}")
    if blocked is not None:
        gate("blocked", f"blocked: {blocked}", Level.WARNING)
    if gpu is None and (mig := parent_of(snapshot, finding.gpu)) is not None:
        _instance_gates(gate, finding, snapshot, policy, parent=mig[0], findings=findings)
        return gates
    if gpu is None or gpu.lost:
        why = "GPU not in this snapshot" if gpu is None else "GPU is lost (needs reboot)"
        gate("gpu", why, Level.WARNING)
        return gates
    entry = gpu_protected(uuid, gpu, policy)
    if entry is not None:
        gate("protect", f"protect: gpus {entry}")
    if gpu.mig_enabled is not False and not reset.allow_mig:
        gate("mig", "MIG enabled" if gpu.mig_enabled else "MIG mode unknown")
    elif (busy := busy_instances(snapshot, gpu)) is not None:
        gate("mig_busy", f"MIG: {busy}")  # a whole-GPU reset takes every instance down
    elif gpu.mig_enabled and isinstance(lost := layout_of(snapshot, gpu.uuid), str):
        # The reset destroys every instance: one that could not be created again is refused.
        gate("mig_layout", f"MIG layout cannot be restored after a reset: {lost}", Level.WARNING)
    # Unknown topology is no blocker: nvidia-smi itself refuses (resetting nothing) when the
    # GPU's NVLink peers would have to be named too; this only spares a futile attempt.
    if gpu.reset_needs_nvlink_peers and not reset.allow_nvlink_group:
        gate("nvlink", "NVLink peers must be reset together (Volta, or Ampere with links)")
    holder = _live_holder(gpu, snapshot, findings, reset.monitors)
    if holder is not None:
        gate("live_holder", f"live holder: {holder}")
    return gates


def _mig_reset_asked(finding: Finding, why: str, policy: Policy) -> bool:
    """A judged MIG GPU is report-only as a whole, except for a health finding asking for its
    reset with ``reset.allow_mig`` on: the MIG gates decide that one."""
    return (
        why == WHOLE_GPU and policy.reset.allow_mig and finding.kind is FindingKind.RESET_REQUIRED
    )


def _instance_gates(
    gate: Callable[..., None],
    finding: Finding,
    snapshot: Snapshot,
    policy: Policy,
    *,
    parent: GpuInfo,
    findings: Iterable[Finding],
) -> None:
    """The gates of re-creating the MIG GPU instance ``finding`` is about, on GPU ``parent``."""
    where = f"a MIG instance of GPU {parent.index}"
    if not policy.reset.mig_recovery:
        gate("mig", f"{where}: no GPU reset of an instance (reset.mig_recovery is off)")
        return
    if parent.lost:
        gate("gpu", "GPU is lost (needs reboot)", Level.WARNING)
        return
    entry = gpu_protected(parent.uuid, parent, policy) or gpu_protected(finding.gpu, None, policy)
    if entry is not None:
        gate("protect", f"protect: gpus {entry}")
    recovery = recovery_of(snapshot, finding.gpu)
    if isinstance(recovery, str):
        gate("mig_recovery", f"{where} cannot be re-created in place: {recovery}", Level.WARNING)
        return
    for other in sorted(findings, key=lambda f: f.key):
        if other.gpu == finding.gpu and other.kind in LIVE_HOLDER and other.pid is not None:
            gate("live_holder", f"live holder: {other.kind.value} pid {other.pid} holds it")
    for why in instance_blockers(snapshot, recovery.mig_uuid):
        gate("live_holder", f"live holder: {why}")


def instance_recovery(snapshot: Snapshot, finding: Finding) -> InstanceRecovery | None:
    """The re-creation ``finding``'s MIG GPU instance needs, when it names one that can be."""
    recovery = recovery_of(snapshot, finding.gpu) if finding.gpu is not None else None
    return recovery if isinstance(recovery, InstanceRecovery) else None


def _reset_blocker(
    w: Work, ctx: Ctx, finding: Finding, gpu: GpuInfo | None
) -> tuple[str, Level, str] | None:
    """Why this ghost_memory finding may not lead to a reset now: (event, level, why)."""
    reset = ctx.policy.reset
    refused = EventName.RESET_REFUSED
    refusal, holders = snapshot_gates(ctx, finding)
    if refusal is not None:
        return refusal
    if gpu is None:
        return refused, Level.WARNING, "GPU not in this snapshot"  # for the type checker
    first_seen = w.seen[finding.key].first_seen
    if ctx.now - first_seen < reset.confirm_for:
        w.waiting[finding.key] = first_seen + reset.confirm_for
        return EventName.RESET_CONFIRMING, Level.DEBUG, f"confirming for {reset.confirm_for:g}s"
    if holders:
        return refused, Level.INFO, holders[0]
    if escalating(w, finding.gpu or gpu.uuid):  # an instance: its own ladders only
        return refused, Level.INFO, f"live holder: {ESCALATING}"
    return history_blocker(w, ctx, finding, gpu)


ESCALATING = "an escalation on this GPU is in progress"


def snapshot_gates(ctx: Ctx, finding: Finding) -> tuple[tuple[str, Level, str] | None, list[str]]:
    """The reset gates of ``finding`` (:func:`reset_gates`, shared with ``explain``): the first
    refusal that is not a live holder as (event, level, why), and the live holders' reasons."""
    gates = reset_gates(
        finding, ctx.snapshot, ctx.policy, report_only=ctx.report_only,
        findings=ctx.findings.values(),
    )  # fmt: skip
    # A user of a MIG GPU's instance holds it as a live holder does: a health reset drains
    # and waits for it (never signalled); a ghost's reset is refused after its window.
    holding = ("live_holder", "mig_busy")
    before = [g for g in gates if g.name not in holding]
    refusal = (EventName.RESET_REFUSED, before[0].level, before[0].why) if before else None
    return refusal, [g.why for g in gates if g.name in holding]


def escalating(w: Work, uuid: str) -> bool:
    """A kill ladder is under way on this GPU: a reset must wait for it."""
    return any(lad.gpu == uuid and lad.status is LadderStatus.ACTIVE for lad in w.ladders.values())


def history_blocker(
    w: Work, ctx: Ctx, finding: Finding, gpu: GpuInfo
) -> tuple[str, Level, str] | None:
    """The reset gates that need history, for ghost-memory and health resets alike: (event,
    level, why) of the first that holds, or None."""
    reset = ctx.policy.reset
    refused = EventName.RESET_REFUSED
    uuid = gpu.uuid
    # Kept per target: a MIG GPU instance's own (a state file written before refusals were
    # kept per instance has it under the parent GPU; the incident's key still tells it).
    for key in dict.fromkeys((finding.gpu or uuid, uuid)):
        held = w.reset_refusals.get(key)
        if held is not None and held.finding_key == finding.key:
            would = "would have been refused" if held.dry_run else "was refused"
            why = (
                f"a reset for this incident {would} ({held.reason}); tried again when its "
                "memory changes, the finding resolves, the configuration is reloaded or "
                "`gpuwatchd resume --clear-latches` is run"
            )
            return refused, Level.INFO, why
    if w.state.reset_failures >= reset.max_failures and not w.state.circuit_open:
        w.state = replace(w.state, circuit_open=True)
    if w.state.circuit_open:
        why = f"circuit open after {w.state.reset_failures} failed reset(s); clear it by hand"
        return EventName.RESET_CIRCUIT_OPEN, Level.CRITICAL, why
    recent = [t for g, t in w.reset_history if g == uuid and ctx.wall - t < reset.window]
    if is_dry_run(w, ctx):
        if finding.key in w.shadow.done:
            why = "dry run: a would-be reset is assumed to have dealt with it already"
            return refused, Level.INFO, why
        recent += w.shadow.recent_resets(uuid, ctx.wall, reset.window)  # would-be resets
    if len(recent) >= reset.max_resets:
        why = f"{len(recent)} reset(s) of this GPU within {reset.window:g}s"
        return EventName.RESET_LIMIT_REACHED, Level.WARNING, why
    last = w.last_reset.get(gpu.uuid)
    if is_dry_run(w, ctx) and gpu.uuid in w.last_dry_reset:
        last = max(last if last is not None else -math.inf, w.last_dry_reset[gpu.uuid])
    if last is not None and ctx.wall - last < reset.cooldown:
        return refused, Level.DEBUG, "cooldown"
    if w.state.reset_in_flight is not None:
        return refused, Level.INFO, "another reset is in flight"
    hold = hold_reason(w, ctx)
    if hold is not None:
        return refused, Level.INFO, hold
    for quiet in dict.fromkeys((gpu.uuid, finding.gpu)):  # an instance's, and its GPU's
        if quiet is not None and quiet in ctx.quiet_before:
            w.waiting[finding.key] = ctx.quiet_before[quiet]
            return EventName.ACTION_DEFERRED, Level.DEBUG, "post_action_delay"
    return None


def consider_reset(w: Work, ctx: Ctx, finding: Finding) -> None:
    """Whether a ghost-memory finding starts a reset now: the gates, then the reset."""
    if not ctx.policy.reset.enabled or finding.gpu is None:
        return
    gpu = gpu_by_uuid(ctx.snapshot, finding.gpu)
    if gpu is None and (mig := parent_of(ctx.snapshot, finding.gpu)) is not None:
        gpu = mig[0]  # a MIG GPU instance: its parent's limits, cooldown and history
    blocker = _reset_blocker(w, ctx, finding, gpu)
    if blocker is not None:
        say_once(w, finding, blocker)
        return
    if gpu is None:
        return  # _reset_blocker refused it already; this is for the type checker
    why = f"ghost memory confirmed for {ctx.now - w.seen[finding.key].first_seen:.0f}s"
    instance = None
    if gpu.uuid != finding.gpu:
        instance = instance_recovery(ctx.snapshot, finding)
        if instance is None:
            return  # the gates refused it already; this is for the type checker
    start_reset(w, ctx, finding, gpu, why, instance=instance)


def start_reset(
    w: Work,
    ctx: Ctx,
    finding: Finding,
    gpu: GpuInfo,
    why: str,
    *,
    drained: bool = False,
    instance: InstanceRecovery | None = None,
) -> None:
    """Hand one GPU's reset (or its MIG GPU ``instance``'s re-creation) to act: the one reset
    path (``drained``: a health reset's drain hooks ran already)."""
    dry = is_dry_run(w, ctx)
    facts = {
        **finding_fields(finding),
        **fields_of(gpu, ("gpu=uuid", "pci_bus_id", "minor")),
        "lasted": ctx.now - w.seen[finding.key].first_seen,
        "evidence": dict(finding.evidence),
    }
    if instance is not None:
        facts.update(instance.fields())
    restored = layout_of(ctx.snapshot, gpu.uuid) if gpu.mig_enabled and instance is None else ()
    layout = restored if isinstance(restored, tuple) else ()  # a gate refused any other
    if layout:
        facts["mig_layout"] = [r.describe().removeprefix("re-create ") for r in layout]
    delay = ctx.policy.limits.post_action_delay
    flight = ResetInFlight(gpu.uuid, finding.key, dry, ctx.now, delay)
    w.state = replace(w.state, reset_in_flight=flight)
    w.quiet_until[gpu.uuid] = ctx.now + delay
    w.event(EventName.RESET_DUE, Level.INFO, dry_run=dry, **facts)  # RESET_OUTCOME is the warning
    w.intents.append(
        ResetIntent(
            gpu=gpu.uuid,
            pci_bus_id=gpu.pci_bus_id,
            minor=gpu.minor,
            finding_key=finding.key,
            dry_run=dry,
            reason=f"{why}: {finding.reason}",
            facts=facts,
            drained=drained,
            instance=instance,
            layout=layout,
        )
    )
