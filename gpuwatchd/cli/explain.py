"""``gpuwatchd explain``: what the policy would do with each finding of a ``scan --json`` report.

This module owns reading a saved report back (strictly: a malformed one is a
:class:`SnapshotError` naming the file and field; the CLI exits 65) and explaining, per finding,
which rule matches (or why none does), which step would come next and when, and what would stop
it. It rebuilds the facts ``plan`` needs from the JSON and asks plan's own pure helpers
(``rule_for``, ``refusal``, ``gpu_protected``), so its answers are the daemon's. It is pure
apart from reading the one file, and it never acts. Output is documented in docs/simulate.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping

from gpuwatchd.decide.plan import reset_gates
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.targets import refusal, rule_for
from gpuwatchd.escape import escape
from gpuwatchd.model import (
    CgroupInfo,
    DeviceHolding,
    Finding,
    FindingKind,
    GpuInfo,
    HolderScan,
    NvmlReading,
    ProcessInfo,
    Snapshot,
    as_int,
)


class SnapshotError(Exception):
    """A report that is not a ``scan --json`` document: ``file: field: message``."""


def _need(data: Mapping[str, object], key: str, types: tuple[type, ...], where: str) -> object:
    if key not in data:
        raise SnapshotError(f"{where}.{key}: missing")
    value = data[key]
    if value is None and type(None) in types:
        return None
    if isinstance(value, bool) and bool not in types:
        raise SnapshotError(f"{where}.{key}: expected {_names(types)}, got {value!r}")
    if not isinstance(value, types):
        raise SnapshotError(f"{where}.{key}: expected {_names(types)}, got {type(value).__name__}")
    return value


def _names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def _opt_int(data: Mapping[str, object], key: str) -> int | None:
    return as_int(data.get(key))


def _opt_str(data: Mapping[str, object], key: str) -> str | None:
    value = data.get(key)
    return value if isinstance(value, str) else None


def _process(entry: Mapping[str, object]) -> ProcessInfo | None:
    pid = _opt_int(entry, "pid")
    if pid is None or (entry.get("alive") is None and entry.get("state") is None):
        return None
    cg = entry.get("cgroup")
    cgroup = None
    if isinstance(cg, dict) and isinstance(cg.get("path"), str):
        cgroup = CgroupInfo(
            path=cg["path"],
            container_id=_opt_str(cg, "container_id"),
            container_runtime=_opt_str(cg, "container_runtime"),
            pod_uid=_opt_str(cg, "pod_uid"),
            slurm_job=_opt_str(cg, "slurm_job"),
            slurm_step=_opt_str(cg, "slurm_step"),
            systemd_unit=_opt_str(cg, "systemd_unit"),
        )
    cmdline = entry.get("cmdline")
    return ProcessInfo(
        pid=pid,
        start_ticks=_opt_int(entry, "start_ticks"),
        state=_opt_str(entry, "state"),
        ppid=_opt_int(entry, "ppid"),
        pgid=_opt_int(entry, "pgid"),
        sid=_opt_int(entry, "sid"),
        uid=_opt_int(entry, "uid"),
        user=_opt_str(entry, "user"),
        comm=_opt_str(entry, "comm"),
        exe=_opt_str(entry, "exe"),
        cmdline=tuple(str(a) for a in cmdline) if isinstance(cmdline, list) else None,
        cgroup=cgroup,
    )


MAX_REPORT_BYTES = 64 << 20  # a scan of a very large host is a few MiB


def load_report(path: str) -> Mapping[str, object]:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_REPORT_BYTES + 1)
        if len(raw) > MAX_REPORT_BYTES:
            raise SnapshotError(f"{path}: larger than {MAX_REPORT_BYTES >> 20} MiB: not a report")
        data = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise SnapshotError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SnapshotError(f"{path}: cannot read: {err}") from None
    except json.JSONDecodeError as err:
        raise SnapshotError(f"{path}:{err.lineno}: not JSON: {err.msg}") from None
    except RecursionError:
        raise SnapshotError(f"{path}: nested too deeply: not a report") from None
    if not isinstance(data, dict):
        raise SnapshotError(f"{path}: expected the object `gpuwatchd scan --json` prints")
    return data


def _gpu(raw: Mapping[str, object], where: str) -> GpuInfo:
    uuid = _need(raw, "uuid", (str,), where)
    index = _need(raw, "index", (int,), where)
    assert isinstance(uuid, str)  # noqa: S101 - checked by _need
    assert isinstance(index, int)  # noqa: S101 - checked by _need
    mig = raw.get("mig_enabled")
    return GpuInfo(
        index=index,
        uuid=uuid,
        name=_opt_str(raw, "name"),
        pci_bus_id=_opt_str(raw, "pci_bus_id"),
        minor=_opt_int(raw, "minor"),
        mig_enabled=mig if isinstance(mig, bool) else None,
        persistence_mode=None,
        architecture=_opt_int(raw, "architecture"),
        nvlink_active=_opt_int(raw, "nvlink_active"),
        lost=raw.get("lost") is True,
    )


def rebuild(report: Mapping[str, object]) -> tuple[Snapshot, list[Finding], dict[str, float]]:
    """The snapshot, findings and first-seen times (wall) a report describes. SnapshotError
    (without the file name) names the first malformed field."""
    now = _need(report, "time", (int, float), "snapshot")
    gpus_raw = _need(report, "gpus", (list,), "snapshot")
    findings_raw = _need(report, "findings", (list,), "snapshot")
    host = report.get("host") if isinstance(report.get("host"), dict) else {}
    nvml = report.get("nvml") if isinstance(report.get("nvml"), dict) else {}
    assert isinstance(gpus_raw, list)  # noqa: S101 - checked by _need
    assert isinstance(findings_raw, list)  # noqa: S101 - checked by _need
    assert isinstance(host, dict)  # noqa: S101 - chosen above
    assert isinstance(nvml, dict)  # noqa: S101 - chosen above
    gpus: list[GpuInfo] = []
    processes: dict[int, ProcessInfo] = {}
    holdings: dict[int, DeviceHolding] = {}
    for i, raw in enumerate(gpus_raw):
        where = f"gpus[{i}]"
        if not isinstance(raw, dict):
            raise SnapshotError(f"{where}: expected an object")
        gpu = _gpu(raw, where)
        minor = gpu.minor
        gpus.append(gpu)
        for key in ("processes", "holders"):
            entries = raw.get(key)
            if entries is not None and not isinstance(entries, list):
                raise SnapshotError(f"{where}.{key}: expected a list, got {type(entries).__name__}")
            for j, entry in enumerate(entries or []):
                if not isinstance(entry, dict):
                    raise SnapshotError(f"{where}.{key}[{j}]: expected an object")
                proc = _process(entry)
                if proc is not None:
                    processes.setdefault(proc.pid, proc)
                if key == "holders" and proc is not None and minor is not None:
                    via = entry.get("via") or []
                    old = holdings.get(proc.pid, DeviceHolding(proc.pid))
                    holdings[proc.pid] = DeviceHolding(
                        proc.pid,
                        old.gpu_minors_fd | ({minor} if "fd" in via else set()),
                        old.gpu_minors_map | ({minor} if "map" in via else set()),
                        ctl=old.ctl or entry.get("ctl") is True,
                        uvm=old.uvm or entry.get("uvm") is True,
                    )
    for entry in report.get("node_holders") or []:  # type: ignore[attr-defined]
        if isinstance(entry, dict) and (proc := _process(entry)) is not None:
            processes.setdefault(proc.pid, proc)
    findings: list[Finding] = []
    first_seen: dict[str, float] = {}
    kinds = {k.value for k in FindingKind}
    for i, raw in enumerate(findings_raw):
        where = f"findings[{i}]"
        if not isinstance(raw, dict):
            raise SnapshotError(f"{where}: expected an object")
        kind = _need(raw, "kind", (str,), where)
        if kind not in kinds:
            raise SnapshotError(f"{where}.kind: unknown finding kind {kind!r}")
        evidence = _need(raw, "evidence", (dict,), where)
        finding = Finding(
            kind=FindingKind(kind),
            gpu=_need(raw, "gpu", (str, type(None)), where),  # type: ignore[arg-type]
            pid=_need(raw, "pid", (int, type(None)), where),  # type: ignore[arg-type]
            start_ticks=_need(raw, "start_ticks", (int, type(None)), where),  # type: ignore[arg-type]
            reason=str(_need(raw, "reason", (str,), where)),
            memory=_need(raw, "memory", (int, type(None)), where),  # type: ignore[arg-type]
            actionable=bool(_need(raw, "actionable", (bool,), where)),
            evidence=evidence,  # type: ignore[arg-type]
        )
        seen = raw.get("first_seen")
        if isinstance(seen, (int, float)) and not isinstance(seen, bool):
            first_seen[finding.key] = float(seen)
        findings.append(finding)
    snapshot = Snapshot(
        monotonic=float(now),  # type: ignore[arg-type]
        wall_time=float(now),  # type: ignore[arg-type]
        boot_id=_opt_str(host, "boot_id"),
        nvml=NvmlReading(
            available=nvml.get("available", True) is True,
            wedged=nvml.get("wedged") is True,
            gpus=tuple(gpus),
        ),
        processes=processes,
        holders=HolderScan(mode=str(report.get("scan_mode") or "full"), holdings=holdings),
        host_namespaces=host.get("host_namespaces", True),
    )
    return snapshot, findings, first_seen


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
            facts = (
                "unknown process"
                if proc is None
                else (
                    f"user={proc.user}, cmdline={' '.join(proc.cmdline or ())!r}, "
                    f"cgroup={proc.cgroup.path if proc.cgroup else None}"
                )
            )
            reasons.append(f"rule {rule.name}: its filters do not match ({facts})")
    return reasons


def explain_report(report: Mapping[str, object], policy: Policy) -> dict[str, object]:
    """For each finding: the matching rule, the next step and when, and what would stop it."""
    snapshot, findings, first_seen = rebuild(report)
    now = snapshot.wall_time
    report_only = report.get("report_only") if isinstance(report.get("report_only"), dict) else {}
    assert isinstance(report_only, dict)  # noqa: S101
    items: list[dict[str, object]] = []
    for finding in findings:
        since = first_seen.get(finding.key)
        proc = None if finding.pid is None else snapshot.processes.get(finding.pid)
        item: dict[str, object] = {
            "key": finding.key,
            "kind": finding.kind.value,
            "gpu": finding.gpu,
            "pid": finding.pid,
            "reason": finding.reason,
            "first_seen": since,
            "rule": None,
            "no_rule_because": [],
            "next": None,
            "then": [],
            "stopped_by": [],
        }
        stops: list[str] = []
        if not finding.actionable:
            why = report_only.get(finding.gpu or "") or report_only.get("node")
            stops.append(f"report only: {why or 'the assessment marked it not actionable'}")
        if finding.kind == FindingKind.GHOST_MEMORY:
            _explain_reset(
                item=item,
                stops=stops,
                finding=finding,
                findings=findings,
                snapshot=snapshot,
                policy=policy,
                now=now,
                since=since,
            )
        elif finding.kind in (FindingKind.ZOMBIE, FindingKind.DEAD_PROCESS):
            stops.append(
                "never signalled: a zombie's parent must reap it"
                if finding.kind == FindingKind.ZOMBIE
                else "nothing to signal: the process no longer exists"
            )
        else:
            rule = rule_for(finding, proc, policy, lasted=math.inf)
            if rule is None:
                item["no_rule_because"] = _no_rule(finding, proc, policy)
            else:
                item["rule"] = rule.name
                first, rest = rule.steps[0], rule.steps[1:]
                action = first.signal or (
                    "on_failure hooks (stuck: never signalled)"
                    if finding.kind == FindingKind.STUCK
                    else "report"
                )
                item["next"] = {"action": action, **_when(now, since, rule.for_)}
                item["then"] = [
                    f"wait {first.wait:g}s, then {s.signal or 'report'}" for s in rest
                ] + [f"wait {rule.steps[-1].wait:g}s, then the ladder ends"]
            why = refusal(proc, finding, snapshot, policy, frozenset())
            if why is not None:
                stops.append(why)
            if policy.dry_run:
                stops.append("dry_run: true — the step is logged, nothing is sent")
            limits = policy.limits
            stops.append(
                f"limits: at most {limits.max_signalled_per_poll} processes per poll and "
                f"{limits.max_signalled_per_hour} per hour, then dry-run is forced; "
                f"{limits.post_action_delay:g}s post-action delay per GPU"
            )
        stops.append("pause: `gpuwatchd pause` holds every action")
        item["stopped_by"] = stops
        items.append(item)
    return {
        "time": now,
        "policy": list(policy.sources) or ["built-in defaults"],
        "dry_run": policy.dry_run,
        "findings": items,
    }


def _explain_reset(
    *,
    item: dict[str, object],
    stops: list[str],
    finding: Finding,
    findings: list[Finding],
    snapshot: Snapshot,
    policy: Policy,
    now: float,
    since: float | None,
) -> None:
    reset = policy.reset
    if not reset.enabled:
        stops.append("reset.enabled is false")
        return
    item["rule"] = "reset"
    item["next"] = {"action": "GPU reset", **_when(now, since, reset.confirm_for)}
    item["then"] = [
        f"cooldown {reset.cooldown:g}s; at most {reset.max_resets} per {reset.window:g}s"
    ]
    # plan's own gates (the ones a snapshot can answer); report-only is said above.
    gates = reset_gates(finding, snapshot, policy, report_only={}, findings=findings)
    stops.extend(g.why for g in gates if g.name not in ("not_actionable", "report_only"))
    if policy.dry_run:
        stops.append("dry_run: true — the reset is logged, not run")
    stops.append(
        "cooldown, reset limits and the circuit breaker depend on the daemon's reset history, "
        "which a scan report does not include"
    )
    stops.append("the final holder scan right before the reset (any holder aborts it)")


def explain_file(path: str, policy: Policy) -> dict[str, object]:
    report = load_report(path)
    try:
        result = explain_report(report, policy)
    except SnapshotError as err:
        raise SnapshotError(f"{path}: {err}") from None
    result["snapshot"] = path
    return result


def _fmt_in(seconds: object) -> str:
    if not isinstance(seconds, (int, float)) or seconds <= 0:
        return "now"
    return f"in {seconds:g}s"


def render_explanation(result: Mapping[str, object]) -> str:
    lines = [
        f"explain {result.get('snapshot')}: policy {', '.join(result['policy'])}"  # type: ignore[arg-type]
        + (" (dry-run)" if result.get("dry_run") else ""),
    ]
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
            lines.append(f"  next: {nxt['action']} {_fmt_in(nxt['in'])} (from {nxt['basis']})")
            for then in item["then"]:
                lines.append(f"        {then}")
        for stop in item["stopped_by"]:
            lines.append(f"  stopped by: {stop}")
    return "\n".join(escape(line) for line in lines) + "\n"
