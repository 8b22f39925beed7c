"""Evidence kept before a destructive step: one bounded file in the state directory.

In detail: docs/internals.md, section `gpuwatchd.act.evidence`.
"""

from __future__ import annotations

import enum
import json
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol

from gpuwatchd.core.model import ProcessInfo, Snapshot, fields_of
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.health.state import HealthState
from gpuwatchd.decide.verdict import NodeVerdict

FORMAT = 1  # the "evidence" value of the document
MAX_FILES = 20  # evidence files kept; the oldest go first
MAX_BYTES = 1 << 20  # bytes one evidence file may have
PREFIX = "evidence-"
MAX_TREES = 64  # holders whose process tree is kept
MAX_ANCESTORS = 32
MAX_CHILDREN = 64  # descendants kept per holder
_NAME = re.compile(
    r"^evidence-(?P<seq>\d{1,12})-(?P<stamp>\d{8}T\d{6}Z)-(?P<action>[a-z_]{1,24})"
    r"(?P<dry>-dry)?(?:-(?P<gpu>(?:GPU|MIG)-[A-Za-z0-9-]{1,96}))?\.json$"
)
_GPU_IN_NAME = re.compile(r"^(?:GPU|MIG)-[A-Za-z0-9-]{1,96}$")


class EvidenceAction(str, enum.Enum):
    """The destructive step an evidence file was kept for."""

    GPU_RESET = "gpu_reset"
    MIG_INSTANCE = "mig_instance"  # one MIG GPU instance destroyed and created again
    DRAIN = "reset_drain"  # a health drain's ``reset.drain`` hooks
    ON_FAILURE = "on_failure"

    def __str__(self) -> str:
        return str(self.value)


class EvidenceFolder(Protocol):
    """Where the files go: :class:`gpuwatchd.state.directory.StateDir` is one."""

    def write(self, name: str, data: bytes, *, mode: int = 0o600, sync: bool = True) -> None: ...
    def names(self, prefix: str = "") -> list[str]: ...
    def remove(self, name: str) -> bool: ...
    def join(self, name: str) -> str: ...


# The ``scan --json`` document of one poll: (snapshot, assessment, verdict, first_seen) -> doc
# (the command line's encoder, handed in).
ReportBuilder = Callable[
    [Snapshot, Assessment, NodeVerdict | None, Mapping[str, float]], dict[str, object]
]


@dataclass(frozen=True)
class Step:
    """The step about to be taken: what, on which GPU (None: the node), dry run or not."""

    action: EvidenceAction
    gpu: str | None
    dry_run: bool
    reason: str
    instance: Mapping[str, object] = field(default_factory=dict)  # a MIG instance's fields
    instance_uuid: str | None = None


@dataclass(frozen=True)
class Kept:
    """The file written (its path), or why none was written."""

    path: str | None
    error: str | None = None


@dataclass(frozen=True)
class EvidenceEntry:
    """One evidence file, as its name tells it (``status`` lists these)."""

    name: str
    seq: int
    written: str  # UTC, as ``20261206T022208Z``
    action: str
    dry_run: bool
    gpu: str | None

    def to_json(self) -> dict[str, object]:
        return fields_of(self, ("name", "written", "action", "dry_run", "gpu"))


def list_evidence(folder: EvidenceFolder) -> list[EvidenceEntry]:
    """The evidence files in ``folder``, oldest first (by their sequence number, not the
    wall clock, which may have been stepped back); other names are not looked at."""
    named = [(name, m) for name in folder.names(PREFIX) if (m := _NAME.match(name)) is not None]
    entries = [
        EvidenceEntry(name, int(m["seq"]), m["stamp"], m["action"], m["dry"] is not None, m["gpu"])
        for name, m in named
    ]
    return sorted(entries, key=lambda e: (e.seq, e.name))


def _name(seq: int, wall: float, step: Step) -> str:
    try:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(max(0.0, wall)))
    except (OverflowError, OSError, ValueError):  # a wall clock far off: the sequence orders
        stamp = "00000000T000000Z"
    gpu = step.instance_uuid or step.gpu
    tail = f"-{gpu}" if gpu is not None and _GPU_IN_NAME.match(gpu) else ""
    return f"{PREFIX}{seq:08d}-{stamp}-{step.action}{'-dry' if step.dry_run else ''}{tail}.json"


def _node(info: ProcessInfo) -> dict[str, object]:
    return {
        **fields_of(info, ("pid", "ppid", "start_ticks", "state", "user", "comm", "exe")),
        "cmdline": None if info.cmdline is None else list(info.cmdline),
        "job": None if info.cgroup is None else info.cgroup.job_key,
    }


def _absent(pid: int) -> dict[str, object]:
    return {"pid": pid, "in_snapshot": False}


def process_trees(snapshot: Snapshot, pids: list[int]) -> list[dict[str, object]]:
    """Each of ``pids`` with its ancestors (parent first) and descendants, as far as the
    snapshot's process table knows them (a relative it did not read is ``in_snapshot:
    false``), at most :data:`MAX_TREES` of them. Pure."""
    table = snapshot.processes
    children: dict[int, list[int]] = {}
    for entry in table.values():
        if entry.ppid is not None:
            children.setdefault(entry.ppid, []).append(entry.pid)
    trees: list[dict[str, object]] = []
    for pid in sorted(set(pids))[:MAX_TREES]:
        info = table.get(pid)
        ancestors: list[dict[str, object]] = []
        seen = {pid}
        parent = None if info is None else info.ppid
        while parent is not None and 0 < parent not in seen and len(ancestors) < MAX_ANCESTORS:
            seen.add(parent)
            up = table.get(parent)
            ancestors.append(_absent(parent) if up is None else _node(up))
            parent = None if up is None else up.ppid
        below: list[dict[str, object]] = []
        queue = sorted(children.get(pid, ()))
        while queue and len(below) < MAX_CHILDREN:
            child = queue.pop(0)
            if child in seen:
                continue
            seen.add(child)
            below.append(_node(table[child]))
            queue.extend(sorted(children.get(child, ())))
        process = _absent(pid) if info is None else _node(info)
        trees.append({"pid": pid, "process": process, "ancestors": ancestors, "descendants": below})
    return trees


def _pids_of_step(snapshot: Snapshot, assessment: Assessment, step: Step) -> list[int]:
    """The holders, NVML-listed processes and finding targets of the step's GPU (all of them
    for a step on the node), the daemon's own processes left out."""
    gpus = {g.uuid: g for g in snapshot.nvml.gpus}
    scope = {u for u in (step.gpu, step.instance_uuid) if u is not None}
    pids: set[int] = set()
    for uuid, gpu in gpus.items():
        if scope and uuid not in scope:
            continue
        if gpu.minor is not None:
            pids.update(h.pid for h in snapshot.holders.holders_of(gpu.minor))
        pids.update(p.pid for p in gpu.processes or ())
    if not scope:
        pids.update(snapshot.holders.holdings)
    pids.update(
        f.pid
        for f in assessment.findings
        if f.pid is not None and (not scope or f.gpu in scope or f.gpu is None)
    )
    return sorted(pids - set(snapshot.self_pids))


def _target_only(report: object, step: Step) -> object:
    """The report with only the step's GPU, and the findings on it."""
    if not isinstance(report, dict) or step.gpu is None:
        return report
    scope = {u for u in (step.gpu, step.instance_uuid) if u is not None}
    kept = dict(report)
    for key, name in (("gpus", "uuid"), ("findings", "gpu")):
        entries = kept[key] = report.get(key)
        if isinstance(entries, list):
            kept[key] = [e for e in entries if isinstance(e, dict) and e.get(name) in scope]
    return {**kept, "node_holders": []}


def _cut_down(doc: dict[str, object], step: Step) -> Iterator[dict[str, object]]:
    """The document whole, then with ever more left out, each cut said in ``truncated``."""
    yield doc
    doc = {**doc, "process_trees": None, "truncated": ["process_trees"]}
    yield doc
    doc = {
        **doc,
        "report": _target_only(doc["report"], step),
        "truncated": ["process_trees", "report: other GPUs"],
    }
    yield doc
    yield {**doc, "report": None, "truncated": ["process_trees", "report"]}
    yield {**doc, "report": None, "health_state": None, "truncated": ["all but the step"]}


def _encode(doc: Mapping[str, object]) -> bytes | None:
    try:
        text = json.dumps(doc, separators=(",", ":"), allow_nan=False, default=str)
    except (TypeError, ValueError, RecursionError):
        return None
    return text.encode("utf-8")


@dataclass(eq=False)
class EvidenceKeeper:
    """Writes one daemon's evidence files: ``folder`` gives the open state directory (None when
    unusable); ``report`` builds the ``scan --json`` document (None: the file says it has none)."""

    folder: Callable[[], EvidenceFolder | None]
    report: ReportBuilder | None
    _: KW_ONLY
    hostname: str | None = None
    version: str = ""
    max_bytes: int = MAX_BYTES

    def keep(
        self,
        step: Step,
        *,
        snapshot: Snapshot,
        assessment: Assessment,
        verdict: NodeVerdict | None,
        health: HealthState,
        first_seen: Mapping[str, float],
        wall: float,
    ) -> Kept:
        """Write the evidence of ``step``, remove the oldest past the count; never raises."""
        try:
            folder = self.folder()
        except OSError as err:
            return Kept(None, error=f"state_dir unusable: {err}")
        if folder is None:
            return Kept(None, error="state_dir unusable")
        report: object = None
        report_error: str | None = "no report builder"
        if self.report is not None:
            try:
                report, report_error = self.report(snapshot, assessment, verdict, first_seen), None
            except Exception as err:  # a bug in the report must not stop the step's evidence
                report_error = repr(err)
        doc: dict[str, object] = {
            "evidence": FORMAT,
            "action": str(step.action),
            "gpu": step.gpu,
            **({"mig_instance": dict(step.instance)} if step.instance else {}),
            "dry_run": step.dry_run,
            "reason": step.reason,
            "written": wall,
            "hostname": self.hostname,
            "version": self.version,
            "report": report,
            "report_error": report_error,
            "health_state": {
                uuid: entry
                for uuid, entry in health.to_json().items()
                if step.gpu is None or uuid == step.gpu
            },
            "process_trees": process_trees(snapshot, _pids_of_step(snapshot, assessment, step)),
            "truncated": [],
        }
        data = b""
        for smaller in _cut_down(doc, step):
            data = _encode(smaller) or b""
            if data and len(data) <= self.max_bytes:
                break
        if not data or len(data) > self.max_bytes:  # no data: the step's own part cannot be JSON
            why = f"does not fit in {self.max_bytes} bytes" if data else "holds NaN or infinity"
            return Kept(None, error=f"the evidence {why}")
        try:
            kept = list_evidence(folder)
            name = _name((kept[-1].seq if kept else 0) + 1, wall, step)
            folder.write(name, data, mode=0o600)
        except OSError as err:
            return Kept(None, error=f"cannot write in state_dir: {err.strerror or err}")
        self._rotate(folder)
        return Kept(folder.join(name))

    def _rotate(self, folder: EvidenceFolder) -> None:
        """The oldest evidence files past :data:`MAX_FILES` removed."""
        try:
            kept = list_evidence(folder)
        except OSError:
            return  # the next file removes them
        for old in kept[: max(0, len(kept) - MAX_FILES)]:
            folder.remove(old.name)
