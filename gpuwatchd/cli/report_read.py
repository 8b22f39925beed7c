"""Reading a ``scan --json`` report back, strictly, as the snapshot and findings it describes.

In detail: docs/internals.md, section `gpuwatchd.cli.report_read`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from gpuwatchd.cli.report import CGROUP_FIELDS, FINDING_FIELDS, GPU_FIELDS, PROCESS_COPIED
from gpuwatchd.cli.spare import spares_from_report
from gpuwatchd.collect.mig import cap_minor
from gpuwatchd.config.files import FileTooLarge, NotARegularFile, read_regular_file
from gpuwatchd.core import model
from gpuwatchd.core.checked import as_count, as_flag, as_list, as_map, as_text
from gpuwatchd.core.codec import pick
from gpuwatchd.core.escape import escape
from gpuwatchd.core.model import (
    CgroupInfo,
    DeviceHolding,
    Finding,
    FindingKind,
    GpuInfo,
    GpuMemory,
    HolderScan,
    NvmlProcess,
    NvmlReading,
    ProcessInfo,
    Snapshot,
    as_int,
)


class SnapshotError(Exception):
    """A report that is not a ``scan --json`` document: ``file: field: message``, one line (the
    report's own text in it, a key or what an evidence file cut, shown escaped)."""

    def __str__(self) -> str:
        return escape(super().__str__())


T = TypeVar("T")


def _need(data: Mapping[str, object], key: str, types: tuple[type[T], ...], where: str) -> T:
    if key not in data:
        raise SnapshotError(f"{where}.{key}: missing")
    value = data[key]
    names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
    if isinstance(value, bool) and bool not in types:
        raise SnapshotError(f"{where}.{key}: expected {names}, got {value!r}")
    if not isinstance(value, types):
        raise SnapshotError(f"{where}.{key}: expected {names}, got {type(value).__name__}")
    return value


def _process(entry: Mapping[str, object]) -> ProcessInfo | None:
    pid = as_int(entry.get("pid"))
    if pid is None or (entry.get("alive") is None and entry.get("state") is None):
        return None
    cg = entry.get("cgroup")
    cgroup = None
    if isinstance(cg, dict) and isinstance(cg.get("path"), str):
        cgroup = CgroupInfo(**pick(cg, CGROUP_FIELDS))
    cmdline = entry.get("cmdline")
    if not isinstance(cmdline, list) or not all(isinstance(a, str) for a in cmdline):
        cmdline = None  # unknown, as a malformed fact beside it is
    return ProcessInfo(
        pid=pid,
        **pick(entry, PROCESS_COPIED),
        cmdline=None if cmdline is None else tuple(cmdline),
        cgroup=cgroup,
    )


MAX_REPORT_BYTES = 64 << 20  # a scan of a very large host is a few MiB
# Bounded by shape as well as bytes: 64 MiB of `[[],[],...` is 20 million lists (1.5 GB parsed).
# A report of 8,000 processes has a few hundred thousand values and nests 7 deep.
MAX_REPORT_VALUES = 1_000_000
MAX_REPORT_DEPTH = 32
# A string left open runs to the end, never fails: a failed match was tried again from each
# escaped quote in it, each try reading on to the end (hours for a few hundred KB).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_BRACKET = re.compile(rb"[\[{\]}]")


def _shape_problem(raw: bytes) -> str | None:
    """Why ``raw`` cannot be a report by its shape alone (too many values, nested too deep), before
    it is parsed: with strings set aside, commas and opening brackets bound the values."""
    bare = _JSON_STRING.sub(b'""', raw) if b'"' in raw else raw  # no copy where no string
    values = bare.count(b",") + bare.count(b"[") + bare.count(b"{") + 1
    if values > MAX_REPORT_VALUES:
        return f"more than {MAX_REPORT_VALUES} values"
    depth = 0
    for bracket in _BRACKET.finditer(bare):
        depth += 1 if bracket.group() in (b"[", b"{") else -1
        if depth > MAX_REPORT_DEPTH:
            return f"nested more than {MAX_REPORT_DEPTH} deep"
    return None


def load_report(path: str) -> Mapping[str, object]:
    """The saved ``scan --json`` report at ``path``, bounded as docs/internals.md says;
    SnapshotError naming the file (and the field) otherwise. An evidence file gives its
    ``report``, with what it says of its step as ``evidence``."""
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
    problem = _shape_problem(raw)
    if problem is not None:
        raise SnapshotError(f"{path}: {problem}: not a report")
    try:
        data = json.loads(
            raw.decode("utf-8"),
            parse_int=_bounded_int,
            parse_float=_finite_float,
            parse_constant=_no_constant,
        )
        where = _first_huge_number(data, "")
    except UnicodeDecodeError as err:
        raise SnapshotError(f"{path}: cannot read: {err}") from None
    except json.JSONDecodeError as err:
        raise SnapshotError(f"{path}:{err.lineno}: not JSON: {err.msg}") from None
    except RecursionError:  # in the parser, or in the walk for over-long numbers
        raise SnapshotError(f"{path}: nested too deeply: not a report") from None
    except ValueError as err:
        raise SnapshotError(f"{path}: not JSON: {err}") from None
    if not isinstance(data, dict):
        raise SnapshotError(f"{path}: expected the object `gpuwatchd scan --json` prints")
    if where is not None:
        raise SnapshotError(
            f"{path}: {where}: a number of more than {MAX_DIGITS} digits is no value of a report"
        )
    if "evidence" in data:  # an evidence file (gpuwatchd/act/evidence.py): its report part
        report = data.get("report")
        if not isinstance(report, dict):
            cut = data.get("truncated")
            why = f" (cut to fit: {', '.join(map(str, cut))})" if isinstance(cut, list) else ""
            raise SnapshotError(f"{path}: an evidence file without its scan report{why}")
        # What it says of its step, each value checked: a malformed one is null.
        written = data.get("written")
        plain = isinstance(written, (int, float)) and not isinstance(written, bool)
        fields = {"action": as_text, "gpu": as_text, "dry_run": as_flag, "reason": as_text}
        header = {**pick(data, fields), "written": written if plain else None}
        return {**report, "evidence": header}
    return data


MAX_DIGITS = 40  # no count, size, PID or time in a report has more digits


class _HugeNumber(str):
    """An integer in the report with more than :data:`MAX_DIGITS` digits, kept as its text so
    the field can be named (Python refuses to convert more than a few thousand digits)."""


def _bounded_int(text: str) -> int | _HugeNumber:
    return int(text) if len(text.lstrip("-")) <= MAX_DIGITS else _HugeNumber(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is no finite number: no value of a report")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is no value of a report")


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


_GPU = {key: read for key, read in GPU_FIELDS.items() if read is not None}
_FINDING = {key: types for key, types in FINDING_FIELDS.items() if types is not None}


def _gpu(raw: Mapping[str, object], where: str) -> GpuInfo:
    return GpuInfo(
        uuid=_need(raw, "uuid", (str,), where),
        index=_need(raw, "index", (int,), where),
        **pick(raw, _GPU),
        lost=raw.get("lost") is True,
        mig_devices=_mig_devices(raw),
        # NVML's process list as the report gives it (checked by _read_gpus): a health reset
        # waits for these.
        processes=tuple(
            NvmlProcess(
                pid,
                as_int(entry.get("used_memory")),
                _need(entry, "type", (str,), f"{where}.processes[{j}]"),
            )
            for j, entry in enumerate(as_list(raw.get("processes")))
            if isinstance(entry, dict) and (pid := as_int(entry.get("pid"))) is not None
        ),
    )


def _list_field(container: Mapping[str, object], key: str, where: str) -> list[object]:
    value = container.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise SnapshotError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def rebuild(report: Mapping[str, object]) -> tuple[Snapshot, list[Finding], dict[str, float]]:
    """The snapshot, findings and first-seen times (wall) a report describes. SnapshotError
    (without the file name) names the first malformed field."""
    now = float(_need(report, "time", (int, float), "snapshot"))
    gpus_raw = _need(report, "gpus", (list,), "snapshot")
    findings_raw = _need(report, "findings", (list,), "snapshot")
    host, nvml = as_map(report.get("host")), as_map(report.get("nvml"))
    gpus, processes, holdings = _read_gpus(gpus_raw)
    caps = _mig_capabilities(holdings, gpus, gpus_raw)  # MIG: which instance each holds
    for entry in _list_field(report, "node_holders", "node_holders"):  # nvidiactl, uvm only
        if isinstance(entry, dict) and (proc := _process(entry)) is not None:
            processes.setdefault(proc.pid, proc)
    findings, first_seen = _read_findings(findings_raw)
    mode = report.get("scan_mode", "full")  # never guessed: a targeted scan may miss a holder
    if not isinstance(mode, str) or mode not in ("full", "targeted"):
        raise SnapshotError("snapshot.scan_mode: expected full or targeted")
    snapshot = Snapshot(
        monotonic=now,
        wall_time=now,
        boot_id=as_text(host.get("boot_id")),
        nvml=NvmlReading(
            available=nvml.get("available", True) is True,
            wedged=nvml.get("wedged") is True,
            gpus=tuple(gpus),
        ),
        processes=processes,
        holders=HolderScan(mode=mode, holdings=holdings),
        host_namespaces=host.get("host_namespaces", True),  # type: ignore[arg-type]  # passed on as saved
        spares=spares_from_report(report),
        mig_caps=caps or None,
    )
    return snapshot, findings, first_seen


def _read_gpus(
    gpus_raw: list[object],
) -> tuple[list[GpuInfo], dict[int, ProcessInfo], dict[int, DeviceHolding]]:
    """The report's GPUs, the processes listed or holding on them (the first entry of a PID
    wins) and their device holdings. SnapshotError names the first malformed entry."""
    gpus: list[GpuInfo] = []
    processes: dict[int, ProcessInfo] = {}
    holdings: dict[int, DeviceHolding] = {}
    for i, raw in enumerate(gpus_raw):
        where = f"gpus[{i}]"
        if not isinstance(raw, dict):
            raise SnapshotError(f"{where}: expected an object")
        gpu = _gpu(raw, where)
        gpus.append(gpu)
        for item in as_list(raw.get("mig_instances")):  # MIG: who is in each instance
            for key in ("processes", "holders"):
                for listed in as_list(as_map(item).get(key)):
                    if isinstance(listed, Mapping) and (proc := _process(listed)) is not None:
                        processes.setdefault(proc.pid, proc)
        for key in ("processes", "holders"):
            for j, entry in enumerate(_list_field(raw, key, f"{where}.{key}")):
                if not isinstance(entry, dict):
                    raise SnapshotError(f"{where}.{key}[{j}]: expected an object")
                if (proc := _process(entry)) is None:
                    continue
                processes.setdefault(proc.pid, proc)
                if key == "holders" and gpu.minor is not None:
                    _add_holding(holdings, proc.pid, entry, gpu.minor)
    return gpus, processes, holdings


def _add_holding(
    holdings: dict[int, DeviceHolding], pid: int, entry: Mapping[str, object], minor: int
) -> None:
    via = as_list(entry.get("via"))
    old = holdings.get(pid, DeviceHolding(pid))
    holdings[pid] = DeviceHolding(
        pid,
        old.gpu_minors_fd | ({minor} if "fd" in via else set()),
        old.gpu_minors_map | ({minor} if "map" in via else set()),
        ctl=old.ctl or entry.get("ctl") is True,
        uvm=old.uvm or entry.get("uvm") is True,
    )


def _read_findings(findings_raw: list[object]) -> tuple[list[Finding], dict[str, float]]:
    """The report's findings, each field checked, and their first-seen times (wall) where
    given. SnapshotError names the first malformed field."""
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
        checked: dict[str, Any] = {k: _need(raw, k, types, where) for k, types in _FINDING.items()}
        finding = Finding(kind=FindingKind(kind), evidence=evidence, **checked)
        seen = raw.get("first_seen")
        if isinstance(seen, (int, float)) and not isinstance(seen, bool):
            first_seen[finding.key] = float(seen)
        findings.append(finding)
    return findings, first_seen


# --- MIG instances read back ------------------------------------------------------------------


def _mig_devices(raw: Mapping[str, object]) -> tuple[model.MigDevice, ...] | None:
    """A saved GPU entry's ``mig_instances`` back as MIG devices (``explain``), so that a
    finding naming an instance is known to be about this GPU. Malformed entries are skipped;
    None when the entry has none."""
    instances = raw.get("mig_instances")
    if not isinstance(instances, list):
        return None
    devices: list[model.MigDevice] = []
    for item in map(as_map, instances[:16]):
        gi = as_int(item.get("gi"))
        if gi is None:
            continue
        ids = [c for c in as_list(item.get("ci")) if isinstance(c, int) and not isinstance(c, bool)]
        names = [u if isinstance(u, str) else None for u in as_list(item.get("mig_uuids"))]
        place = [p for p in (as_int(p) for p in as_list(item.get("placement"))) if p is not None]
        placement = (place[0], place[1]) if len(place) == 2 else None
        memory = as_map(item.get("memory"))
        used, total = as_int(memory.get("used")), as_int(memory.get("total"))
        listed = tuple(
            NvmlProcess(pid, as_int(e.get("used_memory")), kind)
            for e in as_list(item.get("processes"))
            if isinstance(e, Mapping)
            and (pid := as_int(e.get("pid"))) is not None
            and isinstance(kind := e.get("type") or "compute", str)
        )
        for position, ci in enumerate(ids or [0]):
            devices.append(
                model.MigDevice(
                    index=len(devices),
                    uuid=names[position] if position < len(names) else None,
                    gi=gi,
                    ci=ci,
                    profile=as_text(item.get("profile")),
                    gi_profile_id=as_count(item.get("gi_profile_id")),
                    placement=placement,
                    memory=None if used is None else GpuMemory(total, None, 0, used),
                    # a saved report lists an instance's processes once, for all its CIs
                    processes=listed if position == 0 and item.get("processes_known") else (),
                )
            )
    return tuple(devices)


def _mig_capabilities(
    holdings: dict[int, DeviceHolding], gpus: Sequence[GpuInfo], gpus_raw: Sequence[object]
) -> dict[int, model.MigCapability]:
    """The capability table of a saved report's judged MIG instances (``explain``), each
    instance holder's capability minors (by fd, by mapping) added to ``holdings``: so each
    holder is placed in its instance as the daemon placed it."""
    table: dict[int, model.MigCapability] = {}
    for gpu, raw in zip(gpus, gpus_raw, strict=True):
        minor = gpu.minor
        if minor is None or not isinstance(raw, Mapping):
            continue
        for item in map(as_map, as_list(raw.get("mig_instances"))):
            gi = as_int(item.get("gi"))
            if gi is None or item.get("judged") is not True:
                continue
            cis = [c for c in (as_int(c) for c in as_list(item.get("ci"))) if c is not None]
            minors = {cap_minor(minor, gi): model.MigCapability(minor, gi)}
            minors.update({cap_minor(minor, gi, c): model.MigCapability(minor, gi, c) for c in cis})
            table.update(minors)
            for entry in map(as_map, as_list(item.get("holders"))):
                pid = as_int(entry.get("pid"))
                if pid is None:
                    continue
                via = as_list(entry.get("via"))
                by_fd = "fd" in via or not via
                old = holdings.get(pid, DeviceHolding(pid))
                holdings[pid] = dataclasses.replace(
                    old,
                    cap_minors_fd=old.cap_minors_fd | (set(minors) if by_fd else set()),
                    cap_minors_map=old.cap_minors_map
                    | (set(minors) if not by_fd or "map" in via else set()),
                )
    return table
