"""Which rule matches a finding, and why a target may never be touched: the floor, then ``protect``.

In detail: docs/internals.md, section `gpuwatchd.decide.targets`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence

from gpuwatchd.core.model import Finding, GpuInfo, ProcessInfo, Snapshot, fields_of
from gpuwatchd.decide.floor import infrastructure, unverified_infrastructure
from gpuwatchd.decide.gpu_ids import same_pci_bus_id
from gpuwatchd.decide.mig.instances import parent_of
from gpuwatchd.decide.patterns import MAX_COMMAND_TEXT, command_search, command_text
from gpuwatchd.decide.policy import Policy, Rule
from gpuwatchd.decide.spares import spare_reason


def _glob_any(value: str | None, patterns: Sequence[str]) -> bool:
    return value is not None and any(fnmatch.fnmatchcase(value, p) for p in patterns)


def rule_for(
    finding: Finding, process: ProcessInfo | None, policy: Policy, *, lasted: float
) -> Rule | None:
    """The first rule (in policy order) that selects ``finding``, or None; a filter that is
    set never matches an unknown value."""
    for rule in policy.rules:
        if rule.kind != finding.kind or lasted < rule.for_:
            continue
        if rule.min_memory is not None and (
            finding.memory is None or finding.memory < rule.min_memory
        ):
            continue
        if _filters_match(rule, process):
            return rule
    return None


def _filters_match(rule: Rule, process: ProcessInfo | None) -> bool:
    if not (rule.users or rule.commands or rule.cgroups or rule.units or rule.jobs):
        return True
    if process is None:
        return False
    if rule.commands:
        if process.cmdline is None:
            return False
        joined = " ".join(process.cmdline)
        # Unknown (a line longer than the searched part) selects nothing.
        if not any(command_search(p, joined) for p in rule.commands):
            return False
    cgroup = process.cgroup
    globbed = (
        (rule.users, process.user),
        (rule.cgroups, None if cgroup is None else cgroup.path),
        (rule.units, None if cgroup is None else cgroup.systemd_unit),
        (rule.jobs, None if cgroup is None else cgroup.job_key),
    )
    return all(_glob_any(value, globs) for globs, value in globbed if globs)


def gpu_protected(gpu_uuid: str | None, gpu: GpuInfo | None, policy: Policy) -> str | None:
    """Which ``protect.gpus`` entry names this GPU (by UUID or PCI bus id), or None."""
    for entry in policy.protect.gpus:
        if gpu_uuid is not None and entry.lower() == gpu_uuid.lower():
            return entry
        bus_id = None if gpu is None else gpu.pci_bus_id
        if bus_id is not None and same_pci_bus_id(entry, bus_id):
            return entry
    return None


def gpu_by_uuid(snapshot: Snapshot, uuid: str | None) -> GpuInfo | None:
    return next((gpu for gpu in snapshot.nvml.gpus if gpu.uuid == uuid), None)


def _floor_reason(
    process: ProcessInfo, finding: Finding, snapshot: Snapshot, self_ancestors: frozenset[int]
) -> str | None:
    if process.pid in snapshot.self_pids:
        return "the daemon itself"
    if process.pid in self_ancestors:
        return "an ancestor of the daemon"
    # An unverified claim too: unknown never leads to a kill.
    floor = infrastructure(process) or unverified_infrastructure(process)
    if floor is not None:
        return floor
    holding = snapshot.holders.holdings.get(process.pid)
    uvm = finding.evidence.get("uvm")
    if uvm is False or (holding is not None and not holding.uvm):
        return "NVML-only client (does not hold nvidia-uvm)"
    if uvm is not True and (holding is None or not holding.uvm):
        return "nvidia-uvm holding unknown (could be an NVML-only client)"
    return None


def _process_protect_checks(process: ProcessInfo, policy: Policy) -> Iterator[tuple[bool, str]]:
    """Each ``protect`` entry that speaks about ``process`` (commands, users, units, cgroups), in
    order: (True, what matched) or (False, the fact that is unknown)."""
    protect = policy.protect
    if protect.commands:
        if process.cmdline is None:
            yield False, "command line unknown"
        else:
            joined = " ".join(process.cmdline)
            for pattern in protect.commands:
                found = command_search(pattern, joined)
                if found:
                    yield True, f"command matches {pattern.pattern!r}"
                elif found is None:  # unknown: refuses a target, excuses no dirt
                    yield (
                        False,
                        f"command line longer than the {MAX_COMMAND_TEXT} characters "
                        f"{pattern.pattern!r} is searched in",
                    )
    if protect.users:
        if process.user is None:
            yield False, "user unknown"
        else:
            for glob in protect.users:
                if fnmatch.fnmatchcase(process.user, glob):
                    yield True, f"user {process.user} matches {glob!r}"
    cgroup = process.cgroup
    if protect.units or protect.cgroups:
        if cgroup is None:
            yield False, "cgroup unknown"
            return
        unit = cgroup.systemd_unit
        for glob in protect.units:
            if unit is not None and fnmatch.fnmatchcase(unit, glob):
                yield True, f"unit {unit} matches {glob!r}"
        for glob in protect.cgroups:
            if fnmatch.fnmatchcase(cgroup.path, glob):
                yield True, f"cgroup {cgroup.path} matches {glob!r}"


def protect_match(process: ProcessInfo, policy: Policy) -> str | None:
    """What in ``protect`` (commands, users, units, cgroups) names ``process``, or None: only a
    positive match (an unknown fact excuses no dirt; :func:`refusal` refuses for it)."""
    return next((why for matched, why in _process_protect_checks(process, policy) if matched), None)


def protect_refusal(process: ProcessInfo, policy: Policy) -> str | None:
    """What in ``protect`` (commands, users, units, cgroups) names ``process``, or the fact it
    needs that is unknown: either refuses it, as :func:`refusal` does; None otherwise."""
    return next((why for _matched, why in _process_protect_checks(process, policy)), None)


def _protect_reason(
    process: ProcessInfo, finding: Finding, snapshot: Snapshot, policy: Policy
) -> str | None:
    if (refused := protect_refusal(process, policy)) is not None:  # a match, or unknown
        return refused
    if policy.protect.gpus:
        uuids: list[str | None] = [finding.gpu]
        holding = snapshot.holders.holdings.get(process.pid)
        if holding is not None:
            uuids += [g.uuid for m in holding.gpu_minors if (g := snapshot.gpu_by_minor(m))]
        for uuid in uuids:
            mig = parent_of(snapshot, uuid)  # naming a MIG GPU protects its instances
            entry = gpu_protected(uuid, gpu_by_uuid(snapshot, uuid), policy) or (
                None if mig is None else gpu_protected(mig[0].uuid, mig[0], policy)
            )
            if entry is not None:
                return f"GPU {uuid} is protected ({entry})"
    return None


def refusal(
    process: ProcessInfo | None,
    finding: Finding,
    snapshot: Snapshot,
    policy: Policy,
    self_ancestors: frozenset[int],
) -> str | None:
    """Why this target may not be signalled, in this order: "floor: …" (no configuration
    lowers it), "spare: …", "protect: …" or "identity: …"; None when it may."""
    if process is None:
        return "identity: process not in the snapshot"
    if (floor := _floor_reason(process, finding, snapshot, self_ancestors)) is not None:
        return f"floor: {floor}"
    if (spared := spare_reason(process, snapshot)) is not None:
        return f"spare: {spared}"
    if (protect := _protect_reason(process, finding, snapshot, policy)) is not None:
        return f"protect: {protect}"
    if process.start_ticks is None or finding.start_ticks is None:
        return "identity: start time unknown"
    if finding.pid != process.pid or finding.start_ticks != process.start_ticks:
        return "identity: the PID now belongs to another process"
    return None


def process_facts(process: ProcessInfo | None) -> dict[str, object]:
    """The facts about a target that go into its intents and log events."""
    if process is None:
        return {}
    cgroup = process.cgroup
    return {
        **fields_of(process, ("user", "uid", "comm")),
        "cmdline": None if process.cmdline is None else command_text(process.cmdline),
        **fields_of(process, ("state", "ppid", "pgid", "sid")),
        "cgroup": None if cgroup is None else cgroup.path,
        "job": None if cgroup is None else cgroup.job_key,
        "unit": None if cgroup is None else cgroup.systemd_unit,
    }
