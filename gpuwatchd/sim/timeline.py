"""The simulation's timeline: its entries, the result of a run, and the text people read.

This module owns how ``gpuwatchd simulate`` shows what happened: one :class:`Entry` per event
(the daemon's own event names and fields, plus ``world.*`` entries for what the scenario made
happen), the names its human lines use (:class:`TimelineNamer`), the summary of the final
state, and the JSON form. It decides nothing. Output formats are documented in ``docs/simulate.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from gpuwatchd.core.checked import as_number
from gpuwatchd.core.escape import escape
from gpuwatchd.core.model import MIB
from gpuwatchd.core.vocabulary import EventName, Level
from gpuwatchd.decide.policy import Policy
from gpuwatchd.events import words
from gpuwatchd.sim.scenario_spec import Scenario
from gpuwatchd.sim.world import size_text


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
    level: Level
    text: str
    fields: Mapping[str, object]

    def to_json(self) -> dict[str, object]:
        return {
            "t": round(self.t, 3),
            "event": self.name,
            "level": self.level,
            "text": self.text,
            "fields": _jsonable(self.fields),
        }


@dataclass
class SimulationResult:
    """The timeline and the final state of one run, and the run's names for the summary."""

    scenario: Scenario
    policy: Policy
    policy_source: str
    timeline: list[Entry]
    final: dict[str, object]
    polls: int
    names: Names

    def entries(self, name: str) -> list[Entry]:
        return [e for e in self.timeline if e.name == name]

    def signals(self) -> list[tuple[float, str, str, str]]:
        """(t, process name, signal, outcome) for every signal the daemon sent or would send."""
        return [
            (e.t, str(e.fields.get("process")), str(e.fields["signal"]), str(e.fields["outcome"]))
            for e in self.entries(EventName.ACTION_SIGNAL)
        ]

    def resets(self) -> list[tuple[float, str, str]]:
        """(t, GPU UUID, result) for every reset attempt the daemon made."""
        return [
            (e.t, str(e.fields["gpu"]), str(e.fields["result"]))
            for e in self.entries(EventName.RESET_OUTCOME)
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


def _fmt_t(seconds: float) -> str:
    return f"+{seconds:.1f}s"


class TimelineNamer:
    """The event catalogue's :class:`~gpuwatchd.events.catalogue.Namer` over a timeline's
    names: "pid 4242 (trainer)" and "GPU 0"."""

    def __init__(self, names: Names) -> None:
        self.names = names

    def process(self, pid: object, comm: object = None) -> str:
        del comm  # the scenario's own name for the process says more
        return self.names.pname(pid)

    def gpu(self, uuid: object) -> str:
        return self.names.gname(uuid)

    def moment(self, monotonic: object) -> str | None:
        """The timeline's clock is the monotonic one: ``+50.0s``."""
        seconds = as_number(monotonic)
        return None if seconds is None else _fmt_t(seconds)


# RESET_FINISHED says what the RESET_OUTCOME line after it says again.
_QUIET = frozenset({EventName.ESCALATION_SIGNAL_RECORDED, EventName.RESET_FINISHED})
_COLUMN = {
    **{word: word for word in ("finding", "action", "target", "reset", "hook", "health", "world")},
    **dict.fromkeys(("escalation", "rule", "zombie"), "plan"),
    "limits": "LIMIT",
    "gpu": "GPU",
    "daemon": "admin",
}


def _same_unit(value: object) -> str:
    """``value`` in MiB at any size: the summary never mixes "2.0 GiB" with "4 MiB"."""
    return f"{value // MIB:,} MiB" if isinstance(value, int) else size_text(value)


def render_text(result: SimulationResult) -> str:
    """The timeline for people: a header, one line per entry, the final state."""
    scenario, policy = result.scenario, result.policy
    names = TimelineNamer(result.names)
    lines = [
        f"simulate {scenario.path}: {len(scenario.gpus)} GPU(s), "
        f"{len(scenario.processes)} process(es), {scenario.duration:g}s, "
        f"interval {policy.interval:g}s, "
        f"{'dry-run' if policy.dry_run else 'enforcing'}; policy: {result.policy_source}",
    ]
    if scenario.description.strip():
        lines.append(f"  {scenario.description.strip().splitlines()[0]}")
    lines.append("")
    for entry in result.timeline:
        if entry.name in _QUIET:
            continue
        column = _COLUMN.get(entry.name.split(".", 1)[0], "sim")
        lines.append(f"{_fmt_t(entry.t):>9}  {column:<8} {entry.text}")
    final = result.final
    lines += ["", f"final state at {_fmt_t(float(final['t']))} ({result.polls} polls):"]  # type: ignore[arg-type]
    for gpu in final["gpus"]:  # type: ignore[attr-defined]
        lost = ", LOST" if gpu["lost"] else ""
        lines.append(
            f"  GPU {gpu['index']}: {_same_unit(gpu['allocated'])} allocated "
            f"(idle {_same_unit(gpu['idle'])}){lost}"
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
    found = [words.finding_label(k, names) for k in final["open_findings"]]  # type: ignore[attr-defined]
    lines.append("  open findings: " + (", ".join(found) or "none"))
    return "\n".join(escape(line) for line in lines) + "\n"  # the scenario's names and words


def _jsonable(value: object) -> object:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
