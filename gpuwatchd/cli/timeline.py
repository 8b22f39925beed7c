"""The simulation's timeline: its entries, the result of a run, and the text people read.

This module owns how ``gpuwatchd simulate`` shows what happened: one :class:`Entry` per event
(the daemon's own event names and fields, plus ``world.*`` entries for what the scenario made
happen), one human line per event (:func:`describe_event`), the summary of the final state, and
the JSON form. It decides nothing. Output formats are documented in ``docs/simulate.md``.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gpuwatchd.cli.scenario import Scenario
from gpuwatchd.cli.world import size_text
from gpuwatchd.decide.policy import Policy
from gpuwatchd.model import MIB


class Names(Protocol):
    """How a timeline names processes and GPUs ("pid 4242 (trainer)", "GPU 0")."""

    def pname(self, pid: object) -> str: ...

    def gname(self, uuid: object) -> str: ...


@dataclass(frozen=True)
class Entry:
    """One line of the timeline. ``name`` is the daemon's event name (docs/events.md) or a
    ``world.*`` name for what the scenario made happen; ``t`` is seconds since the start."""

    t: float
    name: str
    level: str
    text: str
    fields: Mapping[str, object]

    def to_json(self) -> dict[str, object]:
        return {
            "t": round(self.t, 3),
            "event": self.name,
            "level": self.level,
            "text": self.text,
            "fields": _jsonable(dict(self.fields)),
        }


@dataclass
class SimulationResult:
    """The timeline and the final state of one run."""

    scenario: Scenario
    policy: Policy
    policy_source: str
    timeline: list[Entry]
    final: dict[str, object]
    polls: int

    def entries(self, name: str) -> list[Entry]:
        return [e for e in self.timeline if e.name == name]

    def signals(self) -> list[tuple[float, str, str, str]]:
        """(t, process name, signal, outcome) for every signal the daemon sent or would send."""
        return [
            (e.t, str(e.fields.get("process")), str(e.fields["signal"]), str(e.fields["outcome"]))
            for e in self.entries("action.signal")
        ]

    def resets(self) -> list[tuple[float, str, str]]:
        """(t, GPU UUID, result) for every reset attempt the daemon made."""
        return [
            (e.t, str(e.fields["gpu"]), str(e.fields["result"]))
            for e in self.entries("reset.outcome")
        ]

    def to_json(self) -> dict[str, object]:
        return {
            "scenario": self.scenario.path,
            "description": self.scenario.description,
            "duration": self.scenario.duration,
            "interval": self.policy.interval,
            "policy": self.policy_source,
            "dry_run": self.policy.dry_run,
            "polls": self.polls,
            "timeline": [e.to_json() for e in self.timeline],
            "final": _jsonable(self.final),
        }


def _num(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _fmt_t(seconds: float) -> str:
    return f"+{seconds:.1f}s"


def _target(fields: Mapping[str, object], sim: Names) -> str:
    pid = fields.get("pid")
    return sim.pname(pid) if isinstance(pid, int) else sim.gname(fields.get("gpu"))


def _describe_finding_new(f: Mapping[str, object], sim: Names) -> str:
    tag = "" if f.get("actionable") else " [report only]"
    where = f" on {sim.gname(f.get('gpu'))}" if isinstance(f.get("pid"), int) else ""
    return f"{f.get('kind')} {_target(f, sim)}{where}{tag}: {f.get('reason')}"


def finding_label(key: object, sim: Names) -> str:
    """A finding key (``kind:gpu:pid@ticks`` or ``kind:gpu:gpu``) as people read it:
    "orphaned pid 4252 (worker-2) on GPU 0", "ghost_memory GPU 1"."""
    kind, _, rest = str(key).partition(":")
    gpu, _, target = rest.rpartition(":")
    pid = target.split("@", 1)[0]
    if pid.isdigit():
        return f"{kind} {sim.pname(int(pid))} on {sim.gname(gpu)}"
    return f"{kind} {sim.gname(gpu)}"


def _describe_resolved(f: Mapping[str, object], sim: Names) -> str:
    who = finding_label(f.get("finding"), sim)
    lasted = f.get("lasted")
    after = f"{lasted:g}s" if isinstance(lasted, (int, float)) else "?"
    return f"{who} resolved after {after}"


def _argv(value: object) -> str:
    return shlex.join(str(a) for a in value) if isinstance(value, (list, tuple)) else "?"


def _describe_reset_step(f: Mapping[str, object], sim: Names) -> str:
    """One line per ``reset.step`` event: the step, how it went, what ran or blocked it."""
    status = str(f.get("status"))
    line = f"reset {sim.gname(f.get('gpu'))}: {f.get('step')} {status}"
    blockers, hooks, argv = f.get("blockers"), f.get("hooks"), f.get("argv")
    detail = f.get("detail")
    if isinstance(blockers, list) and blockers:
        return f"{line}: " + "; ".join(str(b) for b in blockers)
    if status == "failed" and isinstance(hooks, list):
        return f"{line}: {detail}"
    if isinstance(hooks, list):
        return f"{line}: " + "; ".join(_argv(h) for h in hooks)
    if argv is not None:
        line += f": {_argv(argv)}"
        if detail is not None:
            line += f" → {detail}"
        output = f.get("output")
        if output and status == "failed":
            line += f" ({output})"
        return line
    detail = detail or _STEP_NOTES.get((str(f.get("step")), status))
    return f"{line} ({detail})" if detail else line


def _describe_hook(f: Mapping[str, object], sim: Names) -> str:
    """One line per ``hook.run`` event: ran (with its exit status) or would have run."""
    if f.get("dry_run"):
        return (
            f"{f.get('hook')} hook would run: {_argv(f.get('argv'))} ({f.get('reason')}) [dry-run]"
        )
    if f.get("outcome") == "dropped":
        return f"{f.get('hook')} hook not run: {f.get('detail')} ({f.get('reason')})"
    if f.get("error"):
        return f"{f.get('hook')} hook failed: {_argv(f.get('argv'))}: {f.get('error')}"
    status = "timed out" if f.get("timed_out") else f"exit {f.get('returncode')}"
    return f"{f.get('hook')} hook ran: {_argv(f.get('argv'))} → {status} ({f.get('reason')})"


_STEP_NOTES = {
    ("stop_nvml", "ok"): "the daemon's NVML worker stopped",
    ("final_scan", "clear"): "no other process holds the GPU",
}


def _join(items: object) -> str:
    return "; ".join(str(i) for i in items) if isinstance(items, list) else str(items)


_DESCRIBERS: dict[str, Callable[[Mapping[str, object], Names], str]] = {
    "finding.new": _describe_finding_new,
    "finding.changed": lambda f, s: f"{f.get('kind')} {_target(f, s)} changed: {f.get('reason')}",
    "finding.resolved": _describe_resolved,
    "escalation.confirming": lambda f, s: (
        f"{f.get('kind')} {_target(f, s)} matches rule "
        f"{f.get('rule')}; confirming until {_fmt_t(_num(f.get('due')))}"
    ),
    "escalation.step_due": lambda f, s: (
        f"rule {f.get('rule')} step {f.get('step')}/{f.get('of')}: "
        f"{f.get('signal') or 'report'} {_target(f, s)}, then wait {_num(f.get('wait')):g}s"
        + (" [dry-run]" if f.get("dry_run") else "")
    ),
    "escalation.resolved": lambda f, s: f"escalation of {_target(f, s)} resolved: {f.get('why')}",
    "escalation.ended": lambda f, s: f"escalation of {_target(f, s)} ended: {f.get('why')}",
    "escalation.aborted": lambda f, s: f"escalation of {_target(f, s)} aborted: {f.get('why')}",
    "escalation.restarted": lambda f, s: f"escalation of {_target(f, s)} restarted: {f.get('why')}",
    "action.refused": lambda f, s: f"no action on {_target(f, s)}: {f.get('why')}",
    "action.deferred": lambda f, s: (
        f"{_target(f, s)} deferred: {f.get('why')} until {_fmt_t(_num(f.get('until')))}"
    ),
    "rule.report_only": lambda f, s: (
        f"{f.get('kind')} {_target(f, s)} matches report-only rule {f.get('rule')}"
    ),
    "target.stuck": lambda f, s: f"{_target(f, s)} is stuck: {f.get('why')}",
    "zombie.needs_reap": lambda f, s: (
        f"{_target(f, s)} is a zombie; its parent "
        f"{s.pname(f.get('parent')) if f.get('parent') else '(unknown)'} must reap it"
    ),
    "limits.kill_cap_reached": lambda f, s: (
        (
            f"kill cap would be reached ({f.get('why')}): enforcement would switch to dry-run "
            "here for "
            if f.get("dry_run")
            else f"kill cap reached ({f.get('why')}): dry-run engaged for "
        )
        + ("the whole node" if f.get("scope") in ("node", None) else str(f.get("scope")))
    ),
    "limits.kill_cap_expired": lambda f, s: (
        f"{'would-be ' if f.get('dry_run') else ''}kill cap latch of {f.get('scope')} expired "
        f"after {_num(f.get('lasted')):g}s"
    ),
    "reset.refusal_cleared": lambda f, s: (
        f"{s.gname(f.get('gpu'))}: a refused reset may be tried again: {f.get('why')}"
    ),
    "reset.confirming": lambda f, s: f"{s.gname(f.get('gpu'))}: ghost memory, {f.get('why')}",
    "reset.due": lambda f, s: (
        f"{s.gname(f.get('gpu'))}: reset due" + (" [dry-run]" if f.get("dry_run") else "")
    ),
    "reset.refused": lambda f, s: f"{s.gname(f.get('gpu'))}: no reset: {f.get('why')}",
    "reset.limit_reached": lambda f, s: f"{s.gname(f.get('gpu'))}: reset limit: {f.get('why')}",
    "reset.circuit_open": lambda f, s: f"resets stopped: {f.get('why')}",
    "reset.succeeded": lambda f, s: f"{s.gname(f.get('gpu'))}: reset succeeded",
    "reset.failed": lambda f, s: (
        f"{s.gname(f.get('gpu'))}: reset {f.get('outcome')} (failure {f.get('failures')})"
    ),
    "reset.dry_run": lambda f, s: (
        f"{s.gname(f.get('gpu'))}: reset would have run (dry-run); assumed to have succeeded "
        "for what follows (it counts against reset.max_resets)"
        if str(f.get("assumed", "")).startswith("success")
        else f"{s.gname(f.get('gpu'))}: reset would have been refused (dry-run)"
    ),
    "gpu.needs_reboot": lambda f, s: (
        f"{s.gname(f.get('gpu'))} needs a reboot"
        + (f": {f.get('why')}" if f.get("kind") == "reboot_required" else "")
    ),
    "health.drain_started": lambda f, s: (
        f"{s.gname(f.get('gpu'))}: drain for {f.get('kind')}"
        + (" (drained already for this incident)" if f.get("drained_already") else "")
        + (f"; waiting for {_join(f.get('blockers'))}" if f.get("blockers") else "")
        + (" (dry-run)" if f.get("dry_run") else "")
    ),
    "health.drain_waiting": lambda f, s: (
        f"{s.gname(f.get('gpu'))}: reset waits for {_join(f.get('blockers'))} (never signalled)"
    ),
    "health.drain_timed_out": lambda f, s: (
        f"{s.gname(f.get('gpu'))}: drain timed out: {f.get('why')}"
    ),
    "reset.step": _describe_reset_step,
    "action.signal": lambda f, s: (
        f"{f.get('signal')} → {s.pname(f.get('pid'))}: {f.get('outcome')}"
        + (" (dry-run: nothing sent)" if f.get("outcome") == "dry_run" else "")
    ),
    "target.exited": lambda f, s: f"{s.pname(f.get('pid'))} exited (seen through its pidfd)",
    "hook.run": _describe_hook,
    "reset.outcome": lambda f, s: (
        f"reset {s.gname(f.get('gpu'))}: {f.get('result')} — {f.get('reason')}"
    ),
    "daemon.paused": lambda f, s: f"an administrator ran gpuwatchd pause ({f.get('reason')})",
    "daemon.resumed": lambda f, s: "an administrator ran gpuwatchd resume",
    "reset.finished": lambda f, s: (
        f"reset {s.gname(f.get('gpu'))} finished at {f.get('step')}: {f.get('result')} "
        f"— {f.get('reason')}"
    ),
}


def describe_event(name: str, fields: Mapping[str, object], sim: Names) -> str:
    """One human line for a planner event."""
    describer = _DESCRIBERS.get(name)
    if describer is not None:
        return describer(fields, sim)
    return ", ".join(f"{k}={v}" for k, v in fields.items() if v is not None)


# reset.finished says what the reset.outcome line after it says again.
_QUIET = frozenset({"escalation.signal_recorded", "reset.finished"})
_COLUMN = {
    "finding": "finding",
    "escalation": "plan",
    "action": "action",
    "rule": "plan",
    "target": "target",
    "zombie": "plan",
    "limits": "LIMIT",
    "reset": "reset",
    "gpu": "GPU",
    "hook": "hook",
    "health": "health",
    "world": "world",
    "daemon": "admin",
}


class _ScenarioNames:
    """Names for the final summary, from the scenario itself (the run's world is gone)."""

    def __init__(self, scenario: Scenario) -> None:
        self.procs = {p.pid: p.name for p in scenario.processes}
        for event in scenario.events:
            if event.process is not None:
                self.procs.setdefault(event.process.pid, event.process.name)
        self.gpus = {g.uuid: f"GPU {g.index}" for g in scenario.gpus}

    def pname(self, pid: object) -> str:
        name = self.procs.get(pid) if isinstance(pid, int) else None
        return f"pid {pid} ({name})" if name else f"pid {pid}"

    def gname(self, uuid: object) -> str:
        return self.gpus.get(str(uuid), str(uuid))


def _same_unit(value: object, other: object, suffix: str = "") -> str:
    """``value`` in MiB whatever its size, so the summary line never mixes "2.0 GiB" with
    "4 MiB" (``other`` is the value it is compared with on that line)."""
    del other
    text = f"{value // MIB:,} MiB" if isinstance(value, int) else size_text(value)
    return f"{text} {suffix}" if suffix else text


def render_text(result: SimulationResult) -> str:
    """The timeline for people: a header, one line per entry, the final state."""
    scenario, policy = result.scenario, result.policy
    names = _ScenarioNames(scenario)
    lines = [
        f"simulate {scenario.path}: {len(scenario.gpus)} GPU(s), "
        f"{len(scenario.processes)} process(es), {scenario.duration:g}s, "
        f"interval {scenario.interval or policy.interval:g}s, "
        f"{'dry-run' if policy.dry_run else 'enforcing'}; policy: {result.policy_source}",
    ]
    if scenario.description:
        lines.append(f"  {scenario.description.strip().splitlines()[0]}")
    lines.append("")
    for entry in result.timeline:
        if entry.name in _QUIET:
            continue
        column = _COLUMN.get(entry.name.split(".", 1)[0], "sim")
        lines.append(f"{_fmt_t(entry.t):>9}  {column:<8} {entry.text}")
    final = result.final
    lines.append("")
    lines.append(f"final state at {_fmt_t(float(final['t']))} ({result.polls} polls):")  # type: ignore[arg-type]
    for gpu in final["gpus"]:  # type: ignore[attr-defined]
        lost = ", LOST" if gpu["lost"] else ""
        lines.append(
            f"  GPU {gpu['index']}: {_same_unit(gpu['allocated'], gpu['idle'], 'allocated')} "
            f"(idle {_same_unit(gpu['idle'], gpu['allocated'])}){lost}"
        )
    for proc in final["processes"]:  # type: ignore[attr-defined]
        signals = ", ".join(f"{s['signal']} at {_fmt_t(s['t'])}" for s in proc["signals"])
        ended = ""
        if proc["exited_at"] is not None:
            ended = f" at {_fmt_t(proc['exited_at'])} ({proc['exit_why']})"
        lines.append(
            f"  {proc['name']} (pid {proc['pid']}): {proc['status']}{ended}"
            + (f"; signalled: {signals}" if signals else "; never signalled")
        )
    resets = final["resets"]
    lines.append(
        f"  signals delivered: {final['signals_delivered']}; resets: "
        + (", ".join(f"{r['result']} at {_fmt_t(r['t'])}" for r in resets) or "none")  # type: ignore[attr-defined]
        + f"; hooks run: {final['hooks_run']}"
    )
    open_findings = final["open_findings"]
    lines.append(
        "  open findings: " + (", ".join(finding_label(k, names) for k in open_findings) or "none")  # type: ignore[attr-defined]
    )
    return "\n".join(lines) + "\n"


def _jsonable(value: object) -> object:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
