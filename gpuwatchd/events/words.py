"""The words of the event catalogue: how an event's fields become a sentence (namers, fields as
sentence pieces, templates, outcome tables) and the shape of one entry. Pure: no I/O.

In detail: docs/internals.md, section `gpuwatchd.events.catalogue`.
"""

from __future__ import annotations

import enum
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gpuwatchd.core.checked import as_number, decimal
from gpuwatchd.core.escape import escape
from gpuwatchd.core.vocabulary import EventName, Level

VALUE_MAX = 160  # characters of one value inside a sentence


class Namer(Protocol):
    """How one output names processes and GPUs; the only difference between the outputs."""

    def process(self, pid: object, comm: object = None) -> str: ...

    def gpu(self, uuid: object) -> str: ...

    def moment(self, monotonic: object) -> str | None: ...


class JournalNamer:
    """The journal's names: ``PID 4242 (python)``, the GPU by its UUID, no deadline."""

    def process(self, pid: object, comm: object = None) -> str:
        name = f" ({short(comm)})" if comm not in (None, "") else ""
        return f"PID {short(pid) if pid not in (None, '') else '?'}{name}"

    def gpu(self, uuid: object) -> str:
        return short(uuid) if uuid not in (None, "") else "the GPU"

    def moment(self, monotonic: object) -> str | None:
        del monotonic
        return None


def short(value: object) -> str:
    """``value`` escaped for one line and cut at :data:`VALUE_MAX` characters."""
    if isinstance(value, (list, tuple)):
        value = " ".join(str(item) for item in value)
    text = escape(str(value))
    return text if len(text) <= VALUE_MAX else text[: VALUE_MAX - 3] + "..."


class Said:
    """An event's fields as sentence pieces, named by one :class:`Namer`."""

    def __init__(self, fields: Mapping[str, object], namer: Namer) -> None:
        self.f = fields
        self.names = namer

    def __call__(self, key: str, default: str = "?") -> str:
        value = self.f.get(key)
        if value is None or value == "":
            return default
        return short(value)

    def has(self, key: str) -> bool:
        return self.f.get(key) not in (None, "", [], ())

    def dry(self) -> bool:
        return self.f.get("dry_run") is True

    def gpu(self, key: str = "gpu") -> str:
        return self.names.gpu(self.f.get(key))

    def pid(self, key: str = "pid") -> str:
        return self.names.process(self.f.get(key))

    def process(self) -> str:
        """``PID 1234 (python)`` with what is known."""
        return self.names.process(self.f.get("pid"), self.f.get("comm"))

    def target(self) -> str:
        """The process and its GPU, or the GPU alone for a GPU-level event."""
        if self.f.get("pid") is None:
            return self.gpu()
        on = f" on {self.gpu()}" if self.has("gpu") else ""
        return f"{self.process()}{on}"

    def subject(self) -> str:
        """The subject of one reset's events: the GPU's reset, or the re-creation of one of
        its MIG GPU instances (``instance``, ``gi``: reset.mig_recovery)."""
        if self.has("instance"):
            return f"Re-creation of MIG GPU instance {self('gi', '?')} of {self.gpu()}"
        return f"Reset of {self.gpu()}"

    def why(self, *keys: str) -> str:
        """``: <first of keys that is set>`` or nothing."""
        for key in keys or ("why", "reason"):
            if self.has(key):
                return f": {self(key)}"
        return ""

    def until(self, key: str) -> str:
        """`` until <when>`` where the namer can place the deadline ``key``, else nothing."""
        when = self.names.moment(self.f.get(key))
        return f" until {when}" if when else ""

    def seconds(self, key: str) -> str:
        value = as_number(self.f.get(key))  # None for a bool, NaN or more than a float holds
        return "?" if value is None else f"{value:g}s"

    def argv(self, key: str = "argv") -> str:
        value = self.f.get(key)
        if isinstance(value, (list, tuple)):
            return short(shlex.join(str(a) for a in value))
        return self(key)

    def items(self, key: str) -> str:
        value = self.f.get(key)
        if isinstance(value, (list, tuple)):
            return short("; ".join(str(v) for v in value))
        return self(key)

    def finding(self) -> str:
        return finding_label(self.f.get("finding"), self.names)

    def fill(self, template: str, **pieces: str) -> str:
        """``template`` with each ``{piece}`` filled in: one of ``pieces``, a name a method
        says (``{gpu}``, ``{target}``...), else the field (``{error:why}``: said by
        :meth:`why`; docs/internals.md, `gpuwatchd.events.catalogue`)."""
        return template.format_map(_Pieces(self, pieces))

    def by_outcome(self, templates: Mapping[str, str], outcome: object, **pieces: str) -> str:
        """:meth:`fill` with ``outcome``'s template (the ``""`` one for any other)."""
        key = outcome.value if isinstance(outcome, enum.Enum) else outcome
        template = templates.get(key, templates[""]) if isinstance(key, str) else templates[""]
        return self.fill(template, **pieces)


def outcome_table(kind: type[enum.Enum], text: str, *others: str) -> Mapping[str, str]:
    """An outcome -> sentence table written as ``text``: a line an outcome (of ``kind``, one
    of ``others``, or ``*``: any other, kept under ``""``) and its sentence. A line that
    names no such outcome, repeats one or says nothing raises ValueError."""
    known = {str(member.value) for member in kind}.union(others)
    table: dict[str, str] = {}
    for line in text.strip().splitlines():
        key, _, said = line.strip().partition(" ")
        key = "" if key == "*" else key
        if (key and key not in known) or key in table or not said.strip():
            raise ValueError(f"{kind.__name__} table: not an outcome, or again: {line!r}")
        table[key] = said.strip()
    return table


_NAMED = frozenset({"gpu", "pid", "process", "target", "why", "finding", "subject"})
_SAID_AS = frozenset({"why", "items", "seconds", "until"})


class _Pieces(dict[str, object]):
    """A template's pieces: those given, ``{dry}`` ("Dry run: " for a dry run), else a name
    :class:`Said` gives, else a field."""

    def __init__(self, said: Said, pieces: Mapping[str, str]) -> None:
        super().__init__(pieces)
        self.said = said

    def __missing__(self, key: str) -> object:
        if key == "dry":
            return "Dry run: " if self.said.dry() else ""
        return getattr(self.said, key)() if key in _NAMED else _Field(self.said, key)


@dataclass(frozen=True)
class _Field:
    """A field in a template: ``{key}``, or ``{key:why}`` (``items``, ``seconds``, ``until``;
    ``{a|b:why}``: the first of a, b that is set), or ``{key:=text}`` (``text`` where unset)."""

    said: Said
    key: str

    def __format__(self, how: str) -> str:
        if how.startswith("="):
            return self.said(self.key, how[1:])
        if how and how not in _SAID_AS:
            raise ValueError(f"no way to say a field called {how!r}")
        return str(getattr(self.said, how)(*self.key.split("|"))) if how else self.said(self.key)


def dry(s: Said, text: str) -> str:
    return f"Dry run: {text}" if s.dry() else text


@dataclass(frozen=True)
class EventSpec:
    """One event: its usual level, the other levels an outcome may give it, its fields, and
    its sentence (a function of the fields, named through a :class:`Namer`)."""

    level: Level
    fields: tuple[str, ...]
    say: Callable[[Said], str]
    also: frozenset[Level] = frozenset()

    @property
    def levels(self) -> frozenset[Level]:
        return self.also | {self.level}


def spec(level: Level, fields: str, say: Callable[[Said], str] | str, *also: Level) -> EventSpec:
    """One catalogue entry; its sentence a function, or a template :meth:`Said.fill` fills.
    An upper-case word in ``fields`` is a group of fields several entries share."""
    if isinstance(say, str):
        template = say
        return spec(level, fields, lambda s: s.fill(template), *also)
    names = tuple(name for word in fields.split() for name in _GROUPS.get(word, word).split())
    return EventSpec(level, names, say, frozenset(also))


def spec_table(text: str) -> dict[EventName, EventSpec]:
    """Catalogue entries written as ``text``: per entry a line ``MEMBER LEVEL [OTHER LEVELS]:
    fields`` (the :class:`EventName` member's name: the event's own name is spelled only in the
    vocabulary), then its template on indented lines (joined by spaces). An event again, or one
    without a template, raises ValueError."""
    table: dict[EventName, EventSpec] = {}
    for entry in re.split(r"\n(?=\S)", text.strip()):
        head, *said = entry.splitlines()
        names, _, fields = head.partition(":")
        event, *levels = names.split()
        if EventName[event] in table or not said:
            raise ValueError(f"event table: again, or no sentence: {head!r}")
        level, *also = (Level[name] for name in levels)
        table[EventName[event]] = spec(level, fields, " ".join(s.strip() for s in said), *also)
    return table


DEBUG, INFO, WARNING, ERROR, CRITICAL = Level  # its members, in order
_MIG = "instance gi recovery"  # a MIG GPU instance's re-creation (reset.mig_recovery)
_GROUPS = {
    "FINDING": "finding kind gpu pid start_ticks memory reason",
    "LADDER": "target pid start_ticks finding rule gpu step dry_run",
    "PROCESS": "user uid comm cmdline state ppid pgid sid cgroup job unit",
    "MIG": _MIG,
    "RESET": f"gpu pci_bus_id finding outcome kind memory reason {_MIG}",
}


def finding_label(key: object, namer: Namer) -> str:
    """A finding key (``kind:gpu:pid@ticks`` or ``kind:gpu:gpu``) in words ("orphaned PID
    4252 on GPU-…"); the key itself if it has another shape."""
    text = str(key)
    kind, _, rest = text.partition(":")
    gpu, _, target = rest.rpartition(":")
    if not rest or not gpu:
        return short(text)
    pid = decimal(target.split("@", 1)[0])
    if pid is not None:
        return f"{short(kind)} {namer.process(pid)} on {namer.gpu(gpu)}"
    return f"{short(kind)} {namer.gpu(gpu)}"
