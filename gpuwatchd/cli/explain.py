"""``gpuwatchd explain``: what the policy would do with each finding of a ``scan --json`` report.

In detail: docs/internals.md, section `gpuwatchd.cli.explain`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

from gpuwatchd.cli.humantime import duration, until
from gpuwatchd.cli.report_read import SnapshotError, load_report, rebuild
from gpuwatchd.cli.spare import spare_stops
from gpuwatchd.core.checked import as_count, as_flag, as_map, as_text
from gpuwatchd.core.codec import pick
from gpuwatchd.core.escape import escape
from gpuwatchd.core.model import (
    Finding,
    FindingKind,
    ProcessInfo,
    Snapshot,
    fields_of,
)
from gpuwatchd.decide import kinds
from gpuwatchd.decide.health.judge import drain_blockers
from gpuwatchd.decide.plan.intents import kill_cap_scope
from gpuwatchd.decide.plan.resets import instance_recovery, reset_gates
from gpuwatchd.decide.policy import Limits, Policy
from gpuwatchd.decide.targets import refusal, rule_for


def _when(now: float, since: float | None, window: float) -> dict[str, object]:
    start = since if since is not None else now
    due = start + window
    return {
        "at": due,
        "in": max(0.0, due - now),
        "basis": "first_seen" if since is not None else "now (first-seen time unknown)",
    }


def _no_rule(finding: Finding, proc: ProcessInfo | None, policy: Policy) -> list[str]:
    same = [r for r in policy.rules if r.kind == finding.kind]
    if not same:
        return [f"no rule selects kind {finding.kind.value}"]
    reasons = []
    for rule in same:
        if rule.min_memory is not None and (
            finding.memory is None or finding.memory < rule.min_memory
        ):
            reasons.append(f"rule {rule.name}: memory {finding.memory} below min_memory")
            continue
        bare = dataclasses.replace(rule, for_=0.0, min_memory=None)
        only = dataclasses.replace(policy, rules=(bare,))
        if rule_for(finding, proc, only, lasted=math.inf) is None:
            facts = "unknown process"
            if proc is not None:
                cmdline, cgroup = " ".join(proc.cmdline or ()), proc.cgroup
                facts = f"user={proc.user}, cmdline={cmdline!r}, cgroup={cgroup and cgroup.path}"
            reasons.append(f"rule {rule.name}: its filters do not match ({facts})")
    return reasons


KILL_CAP_NEAR = 0.8  # the kill-cap line appears from this share of a cap on
# What a report says about the daemon's state, when ``scan`` could read it (the report's
# optional ``daemon`` object), each value checked. None: the report does not say.
_DAEMON = {
    "paused": as_flag,
    "paused_reason": as_text,
    "forced_dry_run": as_flag,
    "forced_reason": as_text,
    "signalled_last_hour": as_count,
}


def kill_cap_note(
    would_signal: int, daemon: Mapping[str, Any], limits: Limits, *, node_total: int | None = None
) -> str | None:
    """The kill-cap line when a cap is reached or near; None when not, or unknown.
    ``would_signal``: the findings a rule would signal for the user with the most of them;
    ``node_total``: for everyone (default: the same). Only the node's hourly cap is judged
    (the daemon's count of the last hour is node-wide)."""
    hint = "`gpuwatchd resume --clear-latches` lifts it"
    if daemon["forced_dry_run"]:
        why = f" ({daemon['forced_reason']})" if daemon["forced_reason"] else ""
        return f"kill cap: reached{why}; the daemon forced dry-run, nothing is sent; {hint}"
    total_here = would_signal if node_total is None else node_total
    per_poll, per_hour = limits.max_signalled_per_poll, limits.node_max_signalled_per_hour
    hour = daemon["signalled_last_hour"]
    total = None if hour is None else hour + total_here
    if would_signal > per_poll:
        return (
            f"kill cap: {would_signal} findings of one user here would be signalled; more "
            f"than max_signalled_per_poll ({per_poll}) in one poll forces dry-run for that user"
        )
    if total is not None and total > per_hour:
        return (
            f"kill cap: {hour} processes signalled in the last hour plus {total_here} here "
            f"is more than node_max_signalled_per_hour ({per_hour}): dry-run would be forced"
        )
    if would_signal >= KILL_CAP_NEAR * per_poll:
        return (
            f"kill cap near: {would_signal} findings of one user here would be signalled; "
            f"max_signalled_per_poll is {per_poll}"
        )
    if total is not None and total >= KILL_CAP_NEAR * per_hour:
        return (
            f"kill cap near: {hour} processes signalled in the last hour plus {total_here} "
            f"here; node_max_signalled_per_hour is {per_hour}"
        )
    return None


def explain_report(report: Mapping[str, object], policy: Policy) -> dict[str, object]:
    """For each finding: the matching rule, the next step and when, and what would stop it."""
    snapshot, findings, first_seen = rebuild(report)
    report_only = as_map(report.get("report_only"))
    daemon = pick(report.get("daemon"), _DAEMON)  # a malformed field: unknown
    items: list[dict[str, object]] = []
    signalled: list[tuple[list[str], Finding]] = []  # what a rule would signal, and its stops
    for finding in findings:
        since = first_seen.get(finding.key)
        proc = None if finding.pid is None else snapshot.processes.get(finding.pid)
        stops: list[str] = []
        item: dict[str, object] = {  # what it is; nothing decided before a rule is looked at
            **fields_of(finding, ("key", "kind", "gpu", "pid", "reason")),
            "kind": finding.kind.value,
            "first_seen": since,
            "rule": None,
            "no_rule_because": [],
            "next": None,
            "then": [],
            "stopped_by": stops,
            "spared": None,
        }
        if not finding.actionable:
            why = report_only.get(finding.gpu or "") or report_only.get("node")
            stops.append(f"report only: {why or 'the assessment marked it not actionable'}")
        case = _Case(item, stops, finding, findings, proc, snapshot, policy, since)
        if finding.kind == FindingKind.GHOST_MEMORY:
            _explain_reset(case)
            latch = kill_cap_note(0, daemon, policy.limits) if daemon["forced_dry_run"] else None
            if latch is not None and policy.reset.enabled and not policy.dry_run:
                stops.append(latch)  # the latch makes every intent a dry run, resets too
        elif finding.kind in kinds.HEALTH:
            _explain_health(case)
        elif finding.kind in kinds.LISTING:
            stops.append(
                "never signalled: a zombie's parent must reap it"
                if finding.kind == FindingKind.ZOMBIE
                else "nothing to signal: the process no longer exists"
            )
        elif _explain_process(case):
            signalled.append((stops, finding))
        if daemon["paused"]:
            reason = f" ({daemon['paused_reason']})" if daemon["paused_reason"] else ""
            stops.append(f"pause: the daemon is paused{reason}; `gpuwatchd resume` lifts it")
        items.append(item)
    _note_limits(signalled, daemon, policy, snapshot)
    return {
        "time": snapshot.wall_time,
        "policy": list(policy.sources) or ["built-in defaults"],
        "dry_run": policy.dry_run,
        "findings": items,
    }


@dataclasses.dataclass(frozen=True)
class _Case:
    """One finding being explained: where its answer goes (``item``, ``stops``) and what it
    is judged with."""

    item: dict[str, object]
    stops: list[str]
    finding: Finding
    findings: list[Finding]
    proc: ProcessInfo | None
    snapshot: Snapshot
    policy: Policy
    since: float | None


def _explain_process(case: _Case) -> bool:
    """A process finding's matching rule, its ladder and what would stop it; True when the
    rule's first step would signal it (the kill cap and the post-action delay then apply)."""
    item, stops, finding, proc = case.item, case.stops, case.finding, case.proc
    snapshot, policy, since = case.snapshot, case.policy, case.since
    rule = rule_for(finding, proc, policy, lasted=math.inf)
    if rule is None:
        item["no_rule_because"] = _no_rule(finding, proc, policy)
    else:
        item["rule"] = rule.name
        action = rule.steps[0].signal or (
            "on_failure hooks (stuck: never signalled)"
            if finding.kind == FindingKind.STUCK
            else "report"
        )
        item["next"] = {"action": action, **_when(snapshot.wall_time, since, rule.for_)}
        # Each step's wait comes before the step after it; the last one's, before the end.
        item["then"] = [
            f"wait {duration(before.wait)}, then {step.signal or 'report'}"
            for before, step in zip(rule.steps[:-1], rule.steps[1:], strict=True)
        ] + [f"wait {duration(rule.steps[-1].wait)}, then the ladder ends"]
    why = refusal(proc, finding, snapshot, policy, frozenset())
    item["spared"], said = spare_stops(proc, snapshot, why)
    stops.extend(said)
    if policy.dry_run:
        stops.append("dry_run: true — the step is logged, nothing is sent")
    return not said and rule is not None and rule.steps[0].signal is not None and finding.actionable


def _note_limits(
    signalled: list[tuple[list[str], Finding]],
    daemon: Mapping[str, Any],
    policy: Policy,
    snapshot: Snapshot,
) -> None:
    """Add the kill-cap line (when near or reached) and the post-action delay (when another
    finding on the same GPU would be signalled too) to the findings a rule would signal. In
    dry-run the caps count nothing (nothing is sent); the delay still spaces the logged steps."""
    owners = [snapshot.processes.get(f.pid) if f.pid is not None else None for _, f in signalled]
    per_user = Counter(kill_cap_scope(owner, snapshot.subuid_ranges) for owner in owners)
    most, total = max(per_user.values(), default=0), len(signalled)
    note = None if policy.dry_run else kill_cap_note(most, daemon, policy.limits, node_total=total)
    per_gpu = Counter(finding.gpu for _, finding in signalled)
    delay = policy.limits.post_action_delay
    for stops, finding in signalled:
        if note is not None:
            stops.append(note)
        others = per_gpu[finding.gpu] - 1
        if finding.gpu is not None and others > 0 and delay > 0:
            stops.append(
                f"post_action_delay: its first step waits until {duration(delay)} after the "
                f"last action on this GPU ({others} other finding(s) here would be signalled)"
            )


def _explain_reset(case: _Case) -> None:
    """What the ``reset`` policy does with a ghost_memory finding."""
    item, stops, snapshot, policy = case.item, case.stops, case.snapshot, case.policy
    reset = policy.reset
    if not reset.enabled:
        stops.append("reset.enabled is false")
        return
    item["rule"] = "reset"
    action = "GPU reset"
    instance = instance_recovery(snapshot, case.finding) if reset.mig_recovery else None
    if instance is not None:  # a MIG GPU instance: re-created in place, never a GPU reset
        action = instance.describe().replace("re-create", "re-creation of", 1)
    item["next"] = {"action": action, **_when(snapshot.wall_time, case.since, reset.confirm_for)}
    item["then"] = [_reset_limits(policy) + (" (the parent GPU's)" if instance is not None else "")]
    _gate_stops(case)
    if policy.dry_run:
        stops.append("dry_run: true — the reset is logged, not run")
    stops.append(
        "cooldown, reset limits and the circuit breaker depend on the daemon's reset history, "
        "which a scan report does not include"
    )
    stops.append("the final holder scan right before the reset (any holder aborts it)")


def _explain_health(case: _Case) -> None:
    """What the ``health`` policy does with a health finding (docs/policy.md#health)."""
    item, stops, finding, snapshot = case.item, case.stops, case.finding, case.snapshot
    policy, health = case.policy, case.policy.health
    item["rule"] = "health"
    now_ = _when(snapshot.wall_time, None, 0.0)  # no confirmation window: at once
    if not health.enabled:
        stops.append("health.enabled is false")
        return
    if health.action == "report":
        stops.append("health.action is report: logged only")
        return
    if not finding.actionable:
        stops.append("not actionable (e.g. a recovery action gpuwatchd does not know): reported")
        return
    if finding.kind == FindingKind.REBOOT_REQUIRED:
        item["next"] = {"action": "on_failure and reset.drain hooks, once; never a reset", **now_}
        return
    resetting = health.action == "reset" and policy.reset.enabled
    if finding.kind == FindingKind.DRAIN_REQUIRED or not resetting:
        item["next"] = {"action": "reset.drain hooks, once", **now_}
        return
    item["next"] = {"action": "reset.drain hooks, then the GPU reset once nothing holds it", **now_}
    item["then"] = [
        f"wait at most {duration(health.drain_timeout)} for the GPU's users (never signalled), "
        "then on_failure once",
        _reset_limits(policy),
    ]
    _gate_stops(case)
    gpu = next((g for g in snapshot.nvml.gpus if g.uuid == finding.gpu), None)
    if gpu is not None:
        blockers = drain_blockers(gpu, snapshot, device_isolation=health.device_isolation)
        stops.extend(f"waits for {blocker}" for blocker in blockers)
    if policy.dry_run:
        stops.append("dry_run: true — the drain and the reset are logged, not run")


def _reset_limits(policy: Policy) -> str:
    reset = policy.reset
    return (
        f"cooldown {duration(reset.cooldown)}; "
        f"at most {reset.max_resets} per {duration(reset.window)}"
    )


def _gate_stops(case: _Case) -> None:
    """plan's own reset gates (those a snapshot can answer); report-only is said already."""
    gates = reset_gates(
        case.finding, case.snapshot, case.policy, report_only={}, findings=case.findings
    )
    case.stops.extend(g.why for g in gates if g.name not in ("not_actionable", "report_only"))


def explain_file(path: str, policy: Policy) -> dict[str, object]:
    report = load_report(path)
    try:
        result = explain_report(report, policy)
    except SnapshotError as err:
        raise SnapshotError(f"{path}: {err}") from None
    result["snapshot"] = path
    if "evidence" in report:  # an evidence file: the step it was kept for
        result["evidence"] = report["evidence"]
    return result


def render_explanation(result: Mapping[str, object]) -> str:
    dry_run = " (dry-run)" if result.get("dry_run") else ""
    policy = ", ".join(result["policy"])  # type: ignore[arg-type]
    lines = [f"explain {result.get('snapshot')}: policy {policy}{dry_run}"]
    evidence = result.get("evidence")
    if isinstance(evidence, Mapping):
        dry = " (dry run)" if evidence.get("dry_run") else ""
        lines.append(
            f"evidence kept before {evidence.get('action')} of {evidence.get('gpu') or 'the node'}"
            f"{dry}: {evidence.get('reason')}"
        )
    items = result.get("findings") or []
    if not items:
        lines.append("no findings: nothing would be done")
    for item in items:  # type: ignore[attr-defined]
        lines.append("")
        lines.append(
            f"{item['kind']} {'pid ' + str(item['pid']) if item['pid'] else 'gpu'} "
            f"on {item['gpu']}: {item['reason']}"
        )
        if item["rule"] is None:
            because = "; ".join(item["no_rule_because"]) or "nothing to do for this kind"
            lines.append(f"  rule: none ({because})")
        else:
            lines.append(f"  rule: {item['rule']}")
        nxt = item["next"]
        if nxt is not None:
            lines.append(f"  next: {nxt['action']} {until(nxt['in'])} (from {nxt['basis']})")
            lines.extend(f"        {then}" for then in item["then"])
        lines.extend(f"  stopped by: {stop}" for stop in item["stopped_by"])
    return "\n".join(escape(line) for line in lines) + "\n"
