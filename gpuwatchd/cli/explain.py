"""``gpuwatchd explain``: what the policy would do with each finding of a ``scan --json`` report.

This module owns reading a saved report back (strictly: a malformed one is a
:class:`SnapshotError` naming the file and field; the CLI exits 65) and explaining, per finding,
which rule matches (or why none does), which step would come next and when, and what would stop
it. It rebuilds the facts ``plan`` needs from the JSON and asks plan's own pure helpers
(``rule_for``, ``refusal``, ``gpu_protected``), so its answers are the daemon's. It is pure
apart from reading the one file, and it never acts. Output is documented in docs/simulate.md.

This module is long (about 670 lines) because reading the report back field by field, strictly,
and explaining every kind of finding (ladders, kill caps, reset gates, health) against it go
together: the explanation asks for exactly the facts the reader rebuilt.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping

from gpuwatchd.cli.humantime import duration, until
from gpuwatchd.cli.mig_report import (
    capabilities_from_report,
    instance_process_entries,
    mig_devices_from_report,
)
from gpuwatchd.cli.spared import spare_stops, spares_from_report
from gpuwatchd.config.files import FileTooLarge, NotARegularFile, read_regular_file
from gpuwatchd.decide import kinds
from gpuwatchd.decide.health import HEALTH_KINDS, drain_blockers
from gpuwatchd.decide.plan import kill_cap_scope, reset_gates
from gpuwatchd.decide.plan_resets import instance_recovery
from gpuwatchd.decide.policy import Limits, Policy
from gpuwatchd.decide.targets import refusal, rule_for
from gpuwatchd.escape import escape
from gpuwatchd.model import (
    CgroupInfo,
    DeviceHolding,
    Finding,
    FindingKind,
    GpuInfo,
    HolderScan,
    MigCapability,
    NvmlProcess,
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
        exe_trusted=trusted if isinstance(trusted := entry.get("exe_trusted"), bool) else None,
    )


MAX_REPORT_BYTES = 64 << 20  # a scan of a very large host is a few MiB


def load_report(path: str) -> Mapping[str, object]:
    """The saved ``scan --json`` report at ``path``: a regular file of at most
    :data:`MAX_REPORT_BYTES` (never a FIFO or a device), JSON whose numbers have at most
    :data:`MAX_DIGITS` digits; SnapshotError naming the file (and the field) otherwise."""
    try:
        raw = read_regular_file(path, MAX_REPORT_BYTES)
    except FileNotFoundError:
        raise SnapshotError(f"{path}: file not found") from None
    except NotARegularFile as err:
        raise SnapshotError(f"{path}: {err}: a report is a regular file") from None
    except FileTooLarge:
        raise SnapshotError(
            f"{path}: larger than {MAX_REPORT_BYTES >> 20} MiB: not a report"
        ) from None
    except OSError as err:
        raise SnapshotError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        data = json.loads(raw.decode("utf-8"), parse_int=_bounded_int)
    except UnicodeDecodeError as err:
        raise SnapshotError(f"{path}: cannot read: {err}") from None
    except json.JSONDecodeError as err:
        raise SnapshotError(f"{path}:{err.lineno}: not JSON: {err.msg}") from None
    except RecursionError:
        raise SnapshotError(f"{path}: nested too deeply: not a report") from None
    except ValueError as err:
        raise SnapshotError(f"{path}: not JSON: {err}") from None
    if not isinstance(data, dict):
        raise SnapshotError(f"{path}: expected the object `gpuwatchd scan --json` prints")
    try:
        where = _first_huge_number(data, "")
    except RecursionError:
        raise SnapshotError(f"{path}: nested too deeply: not a report") from None
    if where is not None:
        raise SnapshotError(
            f"{path}: {where}: a number of more than {MAX_DIGITS} digits is no value of a report"
        )
    return data


MAX_DIGITS = 40  # no count, size, PID or time in a report has more digits


class _HugeNumber(str):
    """An integer in the report with more than :data:`MAX_DIGITS` digits, kept as its text so
    the field can be named (Python refuses to convert more than a few thousand digits)."""


def _bounded_int(text: str) -> int | _HugeNumber:
    return int(text) if len(text.lstrip("-")) <= MAX_DIGITS else _HugeNumber(text)


def _first_huge_number(value: object, where: str) -> str | None:
    """The path (``gpus[0].memory.total``) of the first over-long integer in ``value``."""
    if isinstance(value, _HugeNumber):
        return where or "(top)"
    if isinstance(value, dict):
        for key, item in value.items():
            found = _first_huge_number(item, f"{where}.{key}" if where else str(key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _first_huge_number(item, f"{where}[{index}]")
            if found is not None:
                return found
    return None


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


def _list_field(container: Mapping[str, object], key: str, where: str) -> list[object]:
    """``container[key]`` if it is a list, ``[]`` if absent or null; else SnapshotError."""
    value = container.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise SnapshotError(f"{where}: expected a list, got {type(value).__name__}")
    return value


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
        gpu = dataclasses.replace(_gpu(raw, where), mig_devices=mig_devices_from_report(raw))
        minor = gpu.minor
        gpus.append(gpu)
        for listed in instance_process_entries(raw):  # MIG: who is in each instance
            if (proc := _process(listed)) is not None:
                processes.setdefault(proc.pid, proc)
        for key in ("processes", "holders"):
            for j, entry in enumerate(_list_field(raw, key, f"{where}.{key}")):
                if not isinstance(entry, dict):
                    raise SnapshotError(f"{where}.{key}[{j}]: expected an object")
                proc = _process(entry)
                if proc is not None:
                    processes.setdefault(proc.pid, proc)
                if key == "holders" and proc is not None and minor is not None:
                    via = entry.get("via")
                    via = via if isinstance(via, list) else []
                    old = holdings.get(proc.pid, DeviceHolding(proc.pid))
                    holdings[proc.pid] = DeviceHolding(
                        proc.pid,
                        old.gpu_minors_fd | ({minor} if "fd" in via else set()),
                        old.gpu_minors_map | ({minor} if "map" in via else set()),
                        ctl=old.ctl or entry.get("ctl") is True,
                        uvm=old.uvm or entry.get("uvm") is True,
                    )
    caps = _with_capabilities(holdings, gpus, gpus_raw)  # MIG: which instance each holds
    gpus = [_with_listed(gpu, raw) for gpu, raw in zip(gpus, gpus_raw, strict=True)]
    _add_node_holders(report, processes)
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
        spares=spares_from_report(report),
        mig_caps=caps or None,
    )
    return snapshot, findings, first_seen


def _add_node_holders(report: Mapping[str, object], processes: dict[int, ProcessInfo]) -> None:
    """The processes of the report's node holders (nvidiactl, nvidia-uvm only) not known yet."""
    for entry in _list_field(report, "node_holders", "node_holders"):
        if isinstance(entry, dict) and (proc := _process(entry)) is not None:
            processes.setdefault(proc.pid, proc)


def _with_capabilities(
    holdings: dict[int, DeviceHolding], gpus: list[GpuInfo], gpus_raw: list[object]
) -> dict[int, MigCapability]:
    """The capability table of the report's judged MIG GPUs; each instance holder's
    capabilities added to ``holdings``, so the instances are judged as the daemon judged them."""
    table: dict[int, MigCapability] = {}
    for gpu, raw in zip(gpus, gpus_raw, strict=True):
        if not isinstance(raw, dict):
            continue
        caps, held = capabilities_from_report(raw, gpu.minor)
        table.update(caps)
        for pid, (fd, mapped) in held.items():
            holding = holdings.get(pid, DeviceHolding(pid))
            holdings[pid] = dataclasses.replace(
                holding,
                cap_minors_fd=holding.cap_minors_fd | fd,
                cap_minors_map=holding.cap_minors_map | mapped,
            )
    return table


def _with_listed(gpu: GpuInfo, raw: Mapping[str, object]) -> GpuInfo:
    """``gpu`` with NVML's process list as the report gives it (validated by ``rebuild``): a
    health reset waits for these."""
    entries = raw.get("processes")
    listed = [
        NvmlProcess(pid, as_int(entry.get("used_memory")), str(entry.get("type")))
        for entry in (entries if isinstance(entries, list) else [])
        if isinstance(entry, dict) and (pid := as_int(entry.get("pid"))) is not None
    ]
    return dataclasses.replace(gpu, processes=tuple(listed))


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


KILL_CAP_NEAR = 0.8  # the kill-cap line appears from this share of a cap on


@dataclasses.dataclass(frozen=True)
class DaemonView:
    """What a report says about the daemon's state, when ``scan`` could read it (the report's
    optional ``daemon`` object). None: the report does not say."""

    paused: bool | None = None
    paused_reason: str | None = None
    forced_dry_run: bool | None = None
    forced_reason: str | None = None
    signalled_last_hour: int | None = None


def daemon_view(report: Mapping[str, object]) -> DaemonView:
    """The report's ``daemon`` object, each field checked: a malformed one is unknown."""
    raw = report.get("daemon")
    if not isinstance(raw, dict):
        return DaemonView()

    def flag(key: str) -> bool | None:
        value = raw.get(key)
        return value if isinstance(value, bool) else None

    count = as_int(raw.get("signalled_last_hour"))
    return DaemonView(
        paused=flag("paused"),
        paused_reason=_opt_str(raw, "paused_reason"),
        forced_dry_run=flag("forced_dry_run"),
        forced_reason=_opt_str(raw, "forced_reason"),
        signalled_last_hour=count if count is not None and count >= 0 else None,
    )


def kill_cap_note(
    would_signal: int, daemon: DaemonView, limits: Limits, *, node_total: int | None = None
) -> str | None:
    """The kill-cap line, only when a cap is reached or near; None when it is not, or unknown.

    ``would_signal`` is how many findings of the report a rule would signal for the one user
    with the most of them (the per-user caps count one user's processes); ``node_total`` how
    many for everyone (default: the same). The per-poll cap is judged from them alone; the
    hourly ones need the daemon's count of the last hour, which is node-wide, so only the
    node's hourly cap is judged from it.
    """
    hint = "`gpuwatchd resume --clear-latches` lifts it"
    if daemon.forced_dry_run:
        why = f" ({daemon.forced_reason})" if daemon.forced_reason else ""
        return f"kill cap: reached{why}; the daemon forced dry-run, nothing is sent; {hint}"
    total_here = would_signal if node_total is None else node_total
    per_poll, per_hour = limits.max_signalled_per_poll, limits.node_max_signalled_per_hour
    hour = daemon.signalled_last_hour
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
    now = snapshot.wall_time
    report_only = report.get("report_only") if isinstance(report.get("report_only"), dict) else {}
    assert isinstance(report_only, dict)  # noqa: S101
    daemon = daemon_view(report)
    items: list[dict[str, object]] = []
    signalled: list[tuple[dict[str, object], Finding]] = []  # what a rule would signal
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
            "spared": None,
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
            latch = kill_cap_note(0, daemon, policy.limits) if daemon.forced_dry_run else None
            if latch is not None and policy.reset.enabled and not policy.dry_run:
                stops.append(latch)  # the latch makes every intent a dry run, resets too
        elif finding.kind in HEALTH_KINDS:
            _explain_health(item=item, stops=stops, finding=finding, findings=findings,
                            snapshot=snapshot, policy=policy)  # fmt: skip
        elif finding.kind in kinds.LISTING:
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
                # Each step's wait comes before the step after it; the last one's, before the end.
                item["then"] = [
                    f"wait {duration(before.wait)}, then {step.signal or 'report'}"
                    for before, step in zip(rule.steps[:-1], rest, strict=True)
                ] + [f"wait {duration(rule.steps[-1].wait)}, then the ladder ends"]
            why = refusal(proc, finding, snapshot, policy, frozenset())
            item["spared"], said = spare_stops(proc, snapshot, why)
            stops.extend(said)
            if (
                not said
                and rule is not None
                and rule.steps[0].signal is not None
                and finding.actionable
            ):
                signalled.append((item, finding))
            if policy.dry_run:
                stops.append("dry_run: true — the step is logged, nothing is sent")
        if daemon.paused:
            reason = f" ({daemon.paused_reason})" if daemon.paused_reason else ""
            stops.append(f"pause: the daemon is paused{reason}; `gpuwatchd resume` lifts it")
        item["stopped_by"] = stops
        items.append(item)
    _note_limits(signalled, daemon, policy, snapshot)
    return {
        "time": now,
        "policy": list(policy.sources) or ["built-in defaults"],
        "dry_run": policy.dry_run,
        "findings": items,
    }


def _note_limits(
    signalled: list[tuple[dict[str, object], Finding]],
    daemon: DaemonView,
    policy: Policy,
    snapshot: Snapshot,
) -> None:
    """Add the kill-cap line (when near or reached) and the post-action delay (when another
    finding on the same GPU would be signalled too) to the findings a rule would signal. In
    dry-run the caps count nothing (nothing is sent); the delay still spaces the logged steps."""
    per_user: dict[str, int] = {}
    for _, finding in signalled:
        owner = snapshot.processes.get(finding.pid) if finding.pid is not None else None
        scope = kill_cap_scope(owner)
        per_user[scope] = per_user.get(scope, 0) + 1
    note = (
        None
        if policy.dry_run
        else kill_cap_note(
            max(per_user.values(), default=0),
            daemon,
            policy.limits,
            node_total=len(signalled),
        )
    )
    per_gpu: dict[str | None, int] = {}
    for _, finding in signalled:
        per_gpu[finding.gpu] = per_gpu.get(finding.gpu, 0) + 1
    delay = policy.limits.post_action_delay
    for item, finding in signalled:
        stops = item["stopped_by"]
        assert isinstance(stops, list)  # noqa: S101 - built above
        if note is not None:
            stops.append(note)
        others = per_gpu[finding.gpu] - 1
        if finding.gpu is not None and others > 0 and delay > 0:
            stops.append(
                f"post_action_delay: its first step waits until {duration(delay)} after the "
                f"last action on this GPU ({others} other finding(s) here would be signalled)"
            )


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
    action = "GPU reset"
    instance = instance_recovery(snapshot, finding) if reset.mig_recovery else None
    if instance is not None:  # a MIG GPU instance: re-created in place, never a GPU reset
        action = instance.describe().replace("re-create", "re-creation of", 1)
    item["next"] = {"action": action, **_when(now, since, reset.confirm_for)}
    item["then"] = [
        f"cooldown {duration(reset.cooldown)}; "
        f"at most {reset.max_resets} per {duration(reset.window)}"
        + (" (the parent GPU's)" if instance is not None else "")
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


def _explain_health(
    *,
    item: dict[str, object],
    stops: list[str],
    finding: Finding,
    findings: list[Finding],
    snapshot: Snapshot,
    policy: Policy,
) -> None:
    """What the ``health`` policy does with a health finding (docs/policy.md#health)."""
    health = policy.health
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
        f"cooldown {duration(policy.reset.cooldown)}; "
        f"at most {policy.reset.max_resets} per {duration(policy.reset.window)}",
    ]
    gates = reset_gates(finding, snapshot, policy, report_only={}, findings=findings)
    stops.extend(g.why for g in gates if g.name not in ("not_actionable", "report_only"))
    gpu = next((g for g in snapshot.nvml.gpus if g.uuid == finding.gpu), None)
    if gpu is not None:
        blockers = drain_blockers(gpu, snapshot, device_isolation=health.device_isolation)
        stops.extend(f"waits for {blocker}" for blocker in blockers)
    if policy.dry_run:
        stops.append("dry_run: true — the drain and the reset are logged, not run")


def explain_file(path: str, policy: Policy) -> dict[str, object]:
    report = load_report(path)
    try:
        result = explain_report(report, policy)
    except SnapshotError as err:
        raise SnapshotError(f"{path}: {err}") from None
    result["snapshot"] = path
    return result


def _fmt_in(seconds: object) -> str:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
        return "now"
    return until(seconds)


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
