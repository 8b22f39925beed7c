"""The checked-in list of equivalent mutants (``equivalents.yaml``) and matching against it.

An equivalent mutant changes the code but not what it does (or only what it says): no test
can kill it, so ``make mutate`` sets it aside and shows only what needs a look. Each entry
names its mutant by text, exactly as the report prints a survivor (file, function, operator,
context, line, change, occurrence), and says why it is equivalent. Entries that match no
mutant any more (the code changed) are reported as stale, to be deleted or updated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.mutation.operators import OPERATORS, Mutant

__all__ = ["Equivalent", "EquivalentsError", "load_equivalents", "stale", "to_yaml"]

_KEYS = ("file", "function", "operator", "context", "line", "change", "occurrence", "reason")
_TEXT_KEYS = ("file", "function", "operator", "context", "line", "change")


class EquivalentsError(ValueError):
    """The equivalents file is malformed; the message names the entry and the key."""


@dataclass(frozen=True)
class Equivalent:
    key: tuple[str, str, str, str, str, str, int]
    reason: str

    @property
    def file(self) -> str:
        return self.key[0]

    @property
    def function(self) -> str:
        return self.key[1]


def load_equivalents(path: Path) -> list[Equivalent]:
    """Read and check ``path``; a missing file is an empty list."""
    if not path.exists():
        return []
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if data is None:
        return []
    if not isinstance(data, list):
        raise EquivalentsError(f"{path}: expected a list of entries")
    entries: list[Equivalent] = []
    seen: set[tuple[str, str, str, str, str, str, int]] = set()
    for number, entry in enumerate(data, start=1):
        where = f"{path}: entry {number}"
        if not isinstance(entry, dict):
            raise EquivalentsError(f"{where}: expected a mapping")
        unknown = sorted(set(entry) - set(_KEYS))
        if unknown:
            raise EquivalentsError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}")
        for key in (*_TEXT_KEYS, "reason"):
            value = entry.get(key)
            if not isinstance(value, str) or not value.strip():
                raise EquivalentsError(f"{where}: {key!r} must be a non-empty string")
        if entry["operator"] not in OPERATORS:
            raise EquivalentsError(f"{where}: unknown operator {entry['operator']!r}")
        if entry["reason"].strip().upper().startswith("TODO"):
            raise EquivalentsError(f"{where}: the reason is still TODO")
        occurrence = entry.get("occurrence", 1)
        if isinstance(occurrence, bool) or not isinstance(occurrence, int) or occurrence < 1:
            raise EquivalentsError(f"{where}: 'occurrence' must be a positive integer")
        text = [str(entry[k]) for k in _TEXT_KEYS]
        full = (text[0], text[1], text[2], text[3], text[4], text[5], occurrence)
        if full in seen:
            raise EquivalentsError(f"{where}: the same mutant is listed twice")
        seen.add(full)
        entries.append(Equivalent(full, entry["reason"].strip()))
    return entries


def to_yaml(mutants: Sequence[Mutant], reason: str = "TODO: why no test can tell") -> str:
    """Survivors as entries ready to paste into the equivalents file (after checking each)."""
    entries = []
    for mutant in mutants:
        entry: dict[str, object] = {
            "file": mutant.file,
            "function": mutant.function,
            "operator": mutant.operator,
            "context": mutant.context,
            "line": mutant.line,
            "change": mutant.change,
        }
        if mutant.occurrence != 1:
            entry["occurrence"] = mutant.occurrence
        entry["reason"] = reason
        entries.append(entry)
    return yaml.safe_dump(entries, sort_keys=False, allow_unicode=True, width=100)


def stale(entries: Iterable[Equivalent], mutants: Iterable[Mutant]) -> list[Equivalent]:
    """The entries that match none of ``mutants`` (only for functions that were mutated)."""
    keys = {m.key for m in mutants}
    functions = {(m.file, m.function) for m in mutants}
    return [e for e in entries if (e.file, e.function) in functions and e.key not in keys]
