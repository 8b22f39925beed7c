"""The plain ``gpuwatchd scan`` view: a report's data (``report.py``) as aligned text. The data
may come from a file or another version: every value is checked, an unknown one is ``?``. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuwatchd.cli.humantime import counted, shown
from gpuwatchd.cli.spare import spared_lines
from gpuwatchd.core.checked import as_list, as_map, as_number, as_text
from gpuwatchd.core.escape import escape
from gpuwatchd.core.model import MIB, as_int

GIB = 1024 * MIB
COMMAND_WIDTH = 60  # characters of a command line shown in the text view

_ROLE_LABELS = {
    "context_owner": "context owner",
    "management": "management client",
    "self": "gpuwatchd",
    "hidden": "hidden holder",
    "stuck": "stuck (D state)",
    "unknown": "unknown",
}
_ALARM_ROLES = frozenset({"orphaned", "stuck"})
_OWNED_ROLES = {"worker": "worker of", "orphaned": "orphaned from"}  # and the owner's PID

_BOLD, _RED, _YELLOW, _DIM = "1", "31", "33", "2"
# Ghost memory means no holder *that /proc shows*: what no walk can see.
_UNSEEN = (
    "  nobody that /proc shows holds it: a file descriptor in flight in a unix-socket",
    "    message (SCM_RIGHTS) or a holder in another PID namespace is invisible to any walk;",
    "    the driver would refuse the reset then (docs/scan.md, what a walk cannot see)",
)


def render_text(report: Mapping[str, object], *, color: bool = False) -> str:
    """The human view of a ``build_report`` document (each GPU, then the node), ending with a
    newline. Colours only when ``color``; unknown values print as ``?``, absent ones as ``-``."""
    findings = [as_map(f) for f in as_list(report.get("findings"))]
    view = _View(as_number(report.get("time")), findings, color)
    lines = [_title_line(report)]
    gpu_uuids: set[str] = set()  # each GPU's and MIG instance's: findings about them are no node's
    for gpu in (as_map(g) for g in as_list(report.get("gpus"))):
        instances = (as_map(i).get("uuid") for i in as_list(gpu.get("mig_instances")))
        gpu_uuids.update(u for u in (gpu.get("uuid"), *instances) if isinstance(u, str))
        lines.extend(["", *view.gpu_lines(gpu)])
    node_findings = [f for f in findings if as_text(f.get("gpu")) not in gpu_uuids]
    notes = _node_notes(report, gpu_uuids)
    holders = [as_map(h) for h in as_list(report.get("node_holders"))]
    if notes or node_findings or holders:
        lines.extend(["", view.paint("node", _BOLD)])
        lines.extend(f"  {view.paint(note, _YELLOW)}" for note in notes)
        if holders:
            lines.append("  holding NVIDIA device files of no listed GPU:")
            lines.extend(view.node_holder_lines(holders))
        lines.extend(view.finding_lines(node_findings))
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class _View:
    """What every part of the text is drawn with: the report's time, its findings, colours."""

    now: float | None
    findings: Sequence[Mapping[str, object]]
    color: bool

    def paint(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color and text else text

    def about(self, uuid: object) -> list[Mapping[str, object]]:
        return [f for f in self.findings if uuid is not None and f.get("gpu") == uuid]

    def gpu_lines(self, gpu: Mapping[str, object]) -> list[str]:
        """One GPU's text: its header (index, name, UUID, PCI bus id), memory and flags, its
        holders' table, its findings, its verdict and its MIG instances."""
        uuid = as_text(gpu.get("uuid"))
        header = "  ".join(
            map(shown, (gpu.get("index"), gpu.get("name"), uuid, gpu.get("pci_bus_id")))
        )
        lines = [self.paint(f"GPU {header}", _BOLD), _memory_line(gpu, full=True)]
        flags = _gpu_flags(gpu)
        if flags:
            lines.append("  " + self.paint("; ".join(flags), _YELLOW))
        # MIG instances judged one by one: the GPU's own rows are only the holders it explains
        # itself (parent-only); NVML's aggregate list and the instances' holders are theirs.
        judged_mig = any(as_map(i).get("judged") is True for i in as_list(gpu.get("mig_instances")))
        kept = [h for h in as_list(gpu.get("holders")) if as_map(h).get("role") is not None]
        table = self.holder_table({**gpu, "processes": [], "holders": kept} if judged_mig else gpu)
        lines.extend(table)
        if judged_mig:
            lines.append("  processes and holders: by MIG instance, below")
        elif not table:
            lines.append(_no_rows_line(gpu))
        lines.extend(self.gpu_finding_lines(gpu))
        lines.extend(self.verdict_lines(as_map(gpu.get("verdict"))))
        lines.extend(self.mig_instance_lines(gpu))
        return lines

    def mig_instance_lines(self, gpu: Mapping[str, object]) -> list[str]:
        lines: list[str] = []
        for raw in as_list(gpu.get("mig_instances")):
            if not isinstance(raw, Mapping):
                continue
            cis = raw.get("ci")
            ci_text = ", ".join(escape(str(c)) for c in cis) if isinstance(cis, list) else "?"
            lines.append(
                f"  MIG GPU instance {escape(str(raw.get('gi')))} (CI {ci_text})  "
                f"{escape(str(raw.get('profile') or '?'))}  {escape(str(raw.get('uuid') or '?'))}"
            )
            if raw.get("judged") is not True:
                lines.append("    not judged (see the GPU's report-only reason)")
                continue
            lines.append("  " + _memory_line(raw))
            if reason := as_text(raw.get("report_only")):
                lines.append(f"    report-only: {escape(reason)}")
            lines.extend(f"    note: {escape(str(note))}" for note in as_list(raw.get("notes")))
            rows = ["  " + line for line in self.holder_table(raw)]
            lines.extend(rows or ["    no process holds this instance"])
            lines.extend("  " + line for line in self.finding_lines(self.about(raw.get("uuid"))))
        return lines

    def gpu_finding_lines(self, gpu: Mapping[str, object]) -> list[str]:
        """The spared holders no finding already names, the GPU's findings, and who would make
        the driver refuse a reset while there are findings."""
        own = self.about(as_text(gpu.get("uuid")))
        noted = {f.get("pid") for f in own}  # a spared finding says so itself
        holders = [h for h in map(as_map, as_list(gpu.get("holders"))) if h.get("pid") not in noted]
        lines = [f"  holder {line}" for line in spared_lines(holders, self.now)]
        lines.extend(self.finding_lines(own))
        refusers = [p for p in as_list(gpu.get("reset_refused_by")) if isinstance(p, int)]
        if own and refusers:
            lines.append(
                f"  a reset now would be refused by the driver while PID "
                f"{', '.join(str(p) for p in refusers)} hold(s) its device file (without device "
                "isolation every CUDA process opens every GPU)"
            )
        return lines

    def holder_table(self, gpu: Mapping[str, object]) -> list[str]:
        rows, alarms = _holder_rows(gpu, self.now)
        if not rows:
            return []
        header_row = ["PID", "USER", "S", "ROLE", "MEMORY", "VIA", "JOB", "AGE", "COMMAND"]
        table = _table([header_row, *rows])
        return ["  " + self.paint(table[0], _DIM)] + [
            "  " + (self.paint(line, _RED) if alarm else line)
            for line, alarm in zip(table[1:], alarms, strict=True)
        ]

    def verdict_lines(self, verdict: Mapping[str, object]) -> list[str]:
        """``verdict  clean`` or ``verdict  NOT CLEAN (dirty): <kind> <why>``, then what would
        block a reset (decide/verdict.py)."""
        state = as_text(verdict.get("state"))
        if state is None:
            return []
        reasons = [as_map(r) for r in as_list(verdict.get("reasons"))]
        if state == "clean":
            lines = ["  verdict  clean: a new job may have it"]
        else:
            lines = [self.paint(f"  verdict  NOT CLEAN ({escape(state)})", _RED)]
            lines.extend(
                f"    {shown(r.get('kind'))} {shown(r.get('reason'))}".rstrip() for r in reasons
            )
        blockers = [as_map(r) for r in as_list(verdict.get("reset_blockers"))]
        if blockers:
            lines.append("  would block a reset (not dirt):")
            lines.extend(f"    {shown(b.get('reason'))}" for b in blockers)
        return lines

    def node_holder_lines(self, holders: Sequence[Mapping[str, object]]) -> list[str]:
        rows = []
        for holder in holders:
            role = _role_label(as_text(holder.get("role")), holder.get("owner_pid"))
            row = _row({**holder, "via": holder.get("devices")}, role, "-", self.now)
            rows.append(row[:4] + row[5:])  # no memory column: nothing here is charged to a GPU
        header = ["PID", "USER", "S", "ROLE", "HOLDS", "JOB", "AGE", "COMMAND"]
        table = _table([header, *rows])
        return ["    " + self.paint(table[0], _DIM), *("    " + line for line in table[1:])]

    def finding_lines(self, findings: Sequence[Mapping[str, object]]) -> list[str]:
        if not findings:
            return []
        rows: list[list[str]] = []
        for finding in findings:
            pid = as_int(finding.get("pid"))
            since = _age(self.now, as_number(finding.get("first_seen")), unknown="")
            status = "actionable" if finding.get("actionable") is True else "report only"
            rows.append(
                [
                    shown(finding.get("kind")),
                    f"pid {pid}" if pid is not None else "gpu",
                    _bytes(finding.get("memory"), unknown="-"),
                    f"{status}, for {since}" if since else status,
                    shown(finding.get("reason")),
                ]
            )
        lines = ["  findings"] + [
            "    " + (self.paint(line, _RED) if finding.get("actionable") is True else line)
            for line, finding in zip(_table(rows), findings, strict=True)
        ]
        lines.extend(f"    {line}" for line in spared_lines(findings, self.now))  # gpuwatchd spare
        lines.extend(self.likely_heir_advice(findings))
        if any(as_text(f.get("kind")) == "ghost_memory" for f in findings):
            lines.extend(_UNSEEN)
        return lines

    def likely_heir_advice(self, findings: Sequence[Mapping[str, object]]) -> list[str]:
        """What to do about a leak from before gpuwatchd watched (docs/policy.md)."""
        heirs = [
            as_int(f.get("pid"))
            for f in findings
            if as_map(f.get("evidence")).get("likely_heir") is True
        ]
        pids = ", ".join(str(pid) for pid in heirs if pid is not None)
        if not pids:
            return []
        advice = f"  likely heir(s) of memory leaked before gpuwatchd watched: PID {pids}"
        listed = pids.replace(", ", ",")
        return [
            self.paint(advice, _YELLOW),
            f"    check with `ps -o pid,lstart,args -p {listed}`; kill it by hand,",
            "    or set detection.orphans_without_history: true and run `gpuwatchd run --once`",
        ]


def _title_line(report: Mapping[str, object]) -> str:
    host = as_map(report.get("host"))
    nvml = as_map(report.get("nvml"))
    parts = [
        f"gpuwatchd {shown(report.get('version'))} scan",
        f"host {shown(host.get('hostname'))}",
        f"driver {shown(nvml.get('driver_version'))}",
        counted(len(as_list(report.get("gpus"))), "GPU"),
        counted(len(as_list(report.get("findings"))), "finding"),
        f"{shown(report.get('scan_mode'))} holder scan",
    ]
    view = as_map(report.get("daemon_view"))
    reading = as_map(report.get("nvml_reading"))
    for used, what, age in (
        (view.get("used") is True, "on the daemon's holder view", view.get("age")),
        (reading.get("source") == "daemon", "NVML: the daemon's reading", reading.get("age_s")),
    ):
        if used:
            parts.append(what + (f", {age:.1f}s old" if isinstance(age, (int, float)) else ""))
    if view.get("answered_by") == "daemon":
        parts.append("answered by the daemon")
    return "  ".join(parts)


def _memory_line(gpu: Mapping[str, object], *, full: bool = False) -> str:
    """A GPU's memory line; ``full`` (not for a MIG instance): with the v1 query and reservation."""
    memory = as_map(gpu.get("memory"))
    allocated = f"allocated {_bytes(memory.get('used'))}"
    if full and memory.get("api") == "v1":
        allocated += f" (v1 query: used {_bytes(memory.get('used_v1'))} incl. reservation)"
    reserved = [f"reserved {_bytes(memory.get('reserved'))}"] if full else []
    baseline = f"baseline {_bytes(memory.get('baseline'), unknown='not learned')}"
    return "  memory  " + "  ".join(
        [f"total {_bytes(memory.get('total'))}", allocated, *reserved, baseline]
    )


def _no_rows_line(gpu: Mapping[str, object]) -> str:
    if gpu.get("lost") is True:
        return "  processes: ? (the GPU is lost)"
    if gpu.get("processes_known") is False:
        return "  processes: ? (NVML could not list them)"
    if as_int(gpu.get("minor")) is None:
        return "  no process listed by NVML; device-file holders ? (minor number unknown)"
    return "  no process holds this GPU"


def _gpu_flags(gpu: Mapping[str, object]) -> list[str]:
    flags: list[str] = []
    if gpu.get("lost") is True:
        flags.append("LOST: the GPU stopped answering")
    if error := as_text(gpu.get("error")):
        flags.append(f"error: {escape(error)}")
    if gpu.get("mig_enabled") is True:
        flags.append("MIG enabled")
    if gpu.get("coherent_memory") is True:
        flags.append("coherent memory (memory-based detection off)")
    if isinstance(persistence := gpu.get("persistence_mode"), bool):
        flags.append(f"persistence mode {'on' if persistence else 'off'}")
    health = as_map(gpu.get("health"))
    action = health.get("recovery_action")
    if isinstance(action, int) and not isinstance(action, bool) and action != 0:
        flags.append(f"recovery action {action} (the driver asks for recovery)")
    support = health.get("recovery_action_support")
    if support == "not_supported":
        flags.append("recovery action unknown (this driver has no such field)")
    elif support == "unknown":
        flags.append("recovery action unknown (could not be read)")
    fabric = as_map(health.get("fabric"))
    state = fabric.get("state")
    if fabric.get("support") == "ok" and state in (1, 2):
        flags.append(f"NVLink fabric {'NOT_STARTED' if state == 1 else 'IN_PROGRESS'}")
    rows = as_map(health.get("remapped_rows"))
    if rows.get("pending") is True:
        flags.append("row remap pending (a reset applies it)")
    if rows.get("failure") is True:
        flags.append("row remapping failed")
    if reason := as_text(gpu.get("report_only")):
        flags.append(f"report-only: {escape(reason)}")
    flags.extend(f"note: {shown(note)}" for note in as_list(gpu.get("notes")))
    return flags


def _holder_rows(
    gpu: Mapping[str, object], now: float | None
) -> tuple[list[list[str]], list[bool]]:
    """One row per holder, then one per NVML-listed process that holds nothing (dead ones)."""
    holders = [as_map(h) for h in as_list(gpu.get("holders"))]
    holder_pids = {as_int(h.get("pid")) for h in holders}
    listed = [as_map(p) for p in as_list(gpu.get("processes"))]
    rows: list[tuple[int, list[str], bool]] = []
    for holder in holders:
        role = as_text(holder.get("role"))
        memory = _bytes(holder.get("used_memory")) if holder.get("nvml_listed") is True else "-"
        row = _row(holder, _role_label(role, holder.get("owner_pid")), memory, now)
        rows.append((as_int(holder.get("pid")) or 0, row, role in _ALARM_ROLES))
    for process in listed:
        pid = as_int(process.get("pid"))
        if pid in holder_pids:
            continue
        label = _role_label(as_text(process.get("role")), None)
        if process.get("role") is None:
            label = "listed by NVML"
            if process.get("alive") is False:
                label = "zombie (NVML)" if process.get("state") == "Z" else "dead (NVML)"
        row = _row(process, label, _bytes(process.get("used_memory")), now)
        rows.append((pid or 0, row, process.get("alive") is False))
    rows.sort(key=lambda row: row[0])
    return [row for _, row, _ in rows], [alarm for _, _, alarm in rows]


def _row(entry: Mapping[str, object], role: str, memory: str, now: float | None) -> list[str]:
    """A process's table row, its command cut to :data:`COMMAND_WIDTH`."""
    via = [v for v in as_list(entry.get("via")) if isinstance(v, str)]
    gone = entry.get("alive") is False and entry.get("state") is None
    command = _command(entry)
    if len(command) > COMMAND_WIDTH:
        command = command[: COMMAND_WIDTH - 3] + "..."
    return [
        shown(entry.get("pid")),
        "-" if gone else _user(entry),
        "-" if gone else shown(entry.get("state")),
        role,
        memory,
        escape(",".join(via)) or "-",
        _job(entry.get("cgroup"), known=not gone),
        "-" if gone else _age(now, as_number(entry.get("started"))),
        command,
    ]


def _role_label(role: str | None, owner: object) -> str:
    owner_pid = as_int(owner)
    if role is None:
        return "-"
    if role in _OWNED_ROLES:  # "worker of 1000", "orphaned from 1999"
        return role if owner_pid is None else f"{_OWNED_ROLES[role]} {owner_pid}"
    return _ROLE_LABELS.get(role, escape(role.replace("_", " ")))


def _user(entry: Mapping[str, object]) -> str:
    if user := as_text(entry.get("user")):
        return escape(user)
    uid = as_int(entry.get("uid"))
    return str(uid) if uid is not None else "?"


def _job(cgroup: object, *, known: bool) -> str:
    """A short name for the job a process belongs to; "-" when its cgroup names none."""
    if not isinstance(cgroup, Mapping):
        return "?" if known else "-"
    if slurm := as_text(cgroup.get("slurm_job")):
        return escape(f"slurm:{slurm}")
    if pod := as_text(cgroup.get("pod_uid")):
        return escape(f"pod:{pod[:8]}")
    if container := as_text(cgroup.get("container_id")):
        runtime = as_text(cgroup.get("container_runtime")) or "container"
        return escape(f"{runtime}:{container[:12]}")
    unit = as_text(cgroup.get("systemd_unit"))
    return escape(unit) if unit else "-"


def _command(entry: Mapping[str, object]) -> str:
    cmdline = entry.get("cmdline")
    if isinstance(cmdline, list) and cmdline:
        return escape(" ".join(str(arg) for arg in cmdline))
    if comm := as_text(entry.get("comm")):
        return escape(f"[{comm}]")
    return "-" if entry.get("alive") is False else "?"


def _node_notes(report: Mapping[str, object], gpu_uuids: set[str]) -> list[str]:
    notes: list[str] = []
    nvml = as_map(report.get("nvml"))
    if nvml.get("available") is False:
        notes.append(f"NVML unavailable: {shown(nvml.get('error'))}")
    if nvml.get("wedged") is True:
        notes.append(
            "driver wedged: an NVML call missed its deadline "
            f"({shown(nvml.get('error'))}); no destructive action until it answers again"
        )
    reasons = as_map(report.get("report_only"))
    node_reasons = sorted(key for key in reasons if key not in gpu_uuids)
    notes.extend(f"report-only ({escape(key)}): {shown(reasons[key])}" for key in node_reasons)
    host = as_map(report.get("host"))
    if host.get("host_namespaces") is False and not node_reasons:
        notes.append("report-only: gpuwatchd does not see the host PID and cgroup namespaces")
    if host.get("mps_server_running") is True and not node_reasons:
        notes.append("an MPS server is running: its clients' GPUs are report-only")
    for key, values in sorted(as_map(report.get("notes")).items()):
        if key not in gpu_uuids:
            notes.extend(f"note ({escape(key)}): {shown(value)}" for value in as_list(values))
    unreadable = [p for p in as_list(report.get("unreadable_pids")) if isinstance(p, int)]
    if unreadable:
        first = ", ".join(str(pid) for pid in unreadable[:10])
        more = f" and {len(unreadable) - 10} more" if len(unreadable) > 10 else ""
        notes.append(
            f"{len(unreadable)} processes could not be inspected (fds/maps unreadable: "
            f"{first}{more}); what they hold is unknown"
        )
    unread = [p for p in as_list(report.get("thread_tables_unread_pids")) if isinstance(p, int)]
    if unread:
        notes.append(
            f"{len(unread)} of them ({', '.join(str(pid) for pid in unread[:10])}) have more "
            "threads with fd tables of their own than a scan reads"
        )
    return notes


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows (at least one) as left-aligned columns two spaces apart; the last is not padded."""
    widths = [0] * max(len(row) for row in rows)
    for row in rows:
        for column, cell in enumerate(row[:-1]):
            widths[column] = max(widths[column], len(cell))
    return [
        "  ".join(cell.ljust(widths[column]) for column, cell in enumerate(row)).rstrip()
        for row in rows
    ]


def _bytes(value: object, *, unknown: str = "?") -> str:
    amount = as_int(value)
    if amount is None:
        return unknown
    if abs(amount) >= GIB:
        return f"{amount / GIB:.1f} GiB"
    return f"{round(amount / MIB)} MiB"


def _age(now: float | None, then: float | None, *, unknown: str = "?") -> str:
    """Elapsed time as a compact, ps-like string: 45s, 12m, 3h04m, 2d03h."""
    if now is None or then is None:
        return unknown
    seconds = max(0, int(now - then))
    days, rest = divmod(seconds, 86400)
    hours, minutes = divmod(rest // 60, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m" if minutes else f"{seconds}s"
