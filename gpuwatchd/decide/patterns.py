"""Admin regexes against user text, matched in linear time: ``protect.commands`` and
``rules[].commands`` searched in a process's command line.

In detail: docs/internals.md, section `gpuwatchd.decide.patterns`.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

try:  # the parser ``re`` itself uses: Python 3.11+, then 3.10's name
    _sre_parse = importlib.import_module("re._parser")
except ImportError:  # pragma: no cover - Python 3.10
    _sre_parse = importlib.import_module("sre_parse")
_MAXREPEAT: int = _sre_parse.MAXREPEAT

MAX_COMMAND_TEXT = 4096  # characters of a command line a pattern sees


def command_text(cmdline: Sequence[str]) -> str:
    """A command line as events and findings carry it: its first MAX_COMMAND_TEXT characters
    (what a pattern sees), and how many more were cut (a user's arguments may be megabytes)."""
    joined = " ".join(cmdline)
    cut = len(joined) - MAX_COMMAND_TEXT
    return joined if cut <= 0 else f"{joined[:MAX_COMMAND_TEXT]} [... {cut} characters cut]"


MAX_STATES = 20_000  # automaton size; only counted repeats ({1000}) come near it
# Copies the counted repeats of one pattern make in all (nested ones multiply): each copy can
# be a live state on every character of every command line ([^/]{1,4000}: 2-3 s a 4 KiB line).
MAX_REPEAT = 64

_FLAG_MASK = re.IGNORECASE | re.DOTALL | re.ASCII | re.UNICODE
_CATEGORIES = {
    "CATEGORY_DIGIT": r"\d",
    "CATEGORY_NOT_DIGIT": r"\D",
    "CATEGORY_SPACE": r"\s",
    "CATEGORY_NOT_SPACE": r"\S",
    "CATEGORY_WORD": r"\w",
    "CATEGORY_NOT_WORD": r"\W",
}
# \B on an empty string: no match before Python 3.14, a match since (gh-124130); ask re.
_NON_BOUNDARY_ON_EMPTY = re.search(r"\B", "") is not None
_UNSUPPORTED = {
    "GROUPREF": "a backreference",
    "GROUPREF_EXISTS": "a conditional (?(...)...)",
    "ASSERT": "a lookahead or lookbehind",
    "ASSERT_NOT": "a negative lookahead or lookbehind",
    "ATOMIC_GROUP": "an atomic group (?>...)",
    "POSSESSIVE_REPEAT": "a possessive repeat (*+, ++, ?+)",
}


class NotLinear(ValueError):
    """The pattern uses something that cannot be matched in linear time (the message says what)."""


class TooCostly(NotLinear):
    """Linear, but with a factor too large to pay on every command line: a counted repeat."""


# --- the automaton ----------------------------------------------------------------------------

_CHAR, _SPLIT, _ASSERT, _MATCH = 0, 1, 2, 3


@dataclass
class _State:
    kind: int
    out: int = -1
    alt: int = -1  # _SPLIT only
    test: Callable[[str], bool] | None = None  # _CHAR only
    where: str = ""  # _ASSERT only: "bol", "bos", "eol", "eos", "end", "b", "B"
    word: Callable[[str], bool] | None = None  # _ASSERT "b"/"B": what a word character is


def _one_char(source: str, flags: int) -> Callable[[str], bool]:
    """``re``'s own answer for one character against one atom, remembered per character."""
    compiled = re.compile(source, flags & _FLAG_MASK)
    seen: dict[str, bool] = {}

    def test(ch: str) -> bool:
        found = seen.get(ch)
        if found is None:
            found = compiled.fullmatch(ch) is not None
            if len(seen) < 4096:
                seen[ch] = found
        return found

    return test


def _escape(code: int) -> str:
    return f"\\U{code:08x}"


def _class_source(items: list[tuple[object, object]]) -> str:
    parts: list[str] = []
    negate = False
    for op, av in items:
        name = str(op)
        if name == "NEGATE":
            negate = True
        elif name == "LITERAL" and isinstance(av, int):
            parts.append(_escape(av))
        elif name == "RANGE" and isinstance(av, tuple):
            parts.append(f"{_escape(av[0])}-{_escape(av[1])}")
        elif name == "CATEGORY" and str(av) in _CATEGORIES:
            parts.append(_CATEGORIES[str(av)])
        else:
            raise NotLinear(f"unsupported character class item {name}")
    return "[" + ("^" if negate else "") + "".join(parts) + "]"


class _Builder:
    """Thompson construction, built back to front: each piece is compiled knowing its successor."""

    def __init__(self) -> None:
        self.states: list[_State] = [_State(_MATCH)]
        self.copies = 0  # copies made by counted repeats so far (each build of a body counted)

    def new(self, state: _State) -> int:
        if len(self.states) >= MAX_STATES:
            raise NotLinear(
                f"its automaton would need more than {MAX_STATES} states "
                "(counted repeats too large)"
            )
        self.states.append(state)
        return len(self.states) - 1

    def sequence(self, items: list[tuple[object, object]], out: int, flags: int) -> int:
        for op, av in reversed(items):
            out = self.item(op, av, out, flags)
        return out

    def item(self, op: object, av: object, out: int, flags: int) -> int:
        name = str(op)
        if name in _UNSUPPORTED:
            raise NotLinear(_UNSUPPORTED[name])
        if name == "LITERAL" and isinstance(av, int):
            return self.char(_escape(av), out, flags)
        if name == "NOT_LITERAL" and isinstance(av, int):
            return self.char(f"[^{_escape(av)}]", out, flags)
        if name == "ANY":
            return self.char(".", out, flags)
        if name == "IN" and isinstance(av, list):
            return self.char(_class_source(av), out, flags)
        if name == "AT":
            return self.anchor(str(av), out, flags)
        if name == "BRANCH" and isinstance(av, tuple):
            starts = [self.sequence(list(alt), out, flags) for alt in av[1]]
            start = starts[-1]
            for other in reversed(starts[:-1]):
                start = self.new(_State(_SPLIT, out=other, alt=start))
            return start
        if name == "SUBPATTERN" and isinstance(av, tuple):
            _group, add, remove, body = av
            return self.sequence(list(body), out, (flags | add) & ~remove)
        if name in ("MAX_REPEAT", "MIN_REPEAT") and isinstance(av, tuple):
            low, high, body = av
            return self.repeat(list(body), low, high, out, flags)
        raise NotLinear(f"unsupported regular expression construct {name}")

    def char(self, source: str, out: int, flags: int) -> int:
        return self.new(_State(_CHAR, out=out, test=_one_char(source, flags)))

    def anchor(self, at: str, out: int, flags: int) -> int:
        multiline = bool(flags & re.MULTILINE)
        where = {
            "AT_BEGINNING": "bol" if multiline else "bos",
            "AT_BEGINNING_STRING": "bos",
            "AT_END": "eol" if multiline else "end",
            "AT_END_STRING": "eos",
            "AT_BOUNDARY": "b",
            "AT_NON_BOUNDARY": "B",
        }.get(at)
        if where is None:
            raise NotLinear(f"unsupported anchor {at}")
        word = _one_char(r"\w", flags) if where in ("b", "B") else None
        return self.new(_State(_ASSERT, out=out, where=where, word=word))

    def repeat(
        self, body: list[tuple[object, object]], low: int, high: int, out: int, flags: int
    ) -> int:
        unbounded = high == _MAXREPEAT
        if low > 1 or not (unbounded or high <= 1):  # a count, not *, +, ?
            self.copies += low if unbounded else high
        if self.copies > MAX_REPEAT:
            shown = (
                f"{{{low},}}" if unbounded else f"{{{low},{high}}}" if low != high else f"{{{low}}}"
            )
            raise TooCostly(
                f"its counted repeats ({shown} here) make more than {MAX_REPEAT} copies in all: "
                "each copy costs time on every character of every command line; use * or + "
                "where the count does not matter"
            )
        if unbounded:
            loop = self.new(_State(_SPLIT, alt=out))
            self.states[loop].out = self.sequence(body, loop, flags)
            tail = loop
        else:
            tail = out
            for _ in range(high - low):  # each optional copy may skip to the end
                tail = self.new(_State(_SPLIT, out=self.sequence(body, tail, flags), alt=out))
        for _ in range(low):
            tail = self.sequence(body, tail, flags)
        return tail


def _holds(state: _State, text: str, pos: int) -> bool:
    where = state.where
    if where == "bos":
        return pos == 0
    if where == "bol":
        return pos == 0 or text[pos - 1] == "\n"
    if where == "eos":
        return pos == len(text)
    if where == "end":
        return pos == len(text) or (pos == len(text) - 1 and text[pos] == "\n")
    if where == "eol":
        return pos == len(text) or text[pos] == "\n"
    word = state.word
    assert word is not None  # noqa: S101 - set for "b" and "B"
    if not text:
        return where == "B" and _NON_BOUNDARY_ON_EMPTY
    before = pos > 0 and word(text[pos - 1])
    after = pos < len(text) and word(text[pos])
    return (before != after) == (where == "b")


def _close(
    states: tuple[_State, ...], seeds: list[int], text: str, pos: int
) -> tuple[list[int], bool]:
    """The character states reachable from ``seeds`` without consuming, and whether MATCH is."""
    found: list[int] = []
    seen: set[int] = set()
    stack = list(reversed(seeds))
    matched = False
    while stack:
        index = stack.pop()
        if index in seen:
            continue
        seen.add(index)
        state = states[index]
        if state.kind == _CHAR:
            found.append(index)
        elif state.kind == _SPLIT:
            stack += (state.alt, state.out)
        elif state.kind == _ASSERT:
            if _holds(state, text, pos):
                stack.append(state.out)
        else:
            matched = True
    return found, matched


@functools.lru_cache(maxsize=256)
def _program(pattern: str, flags: int) -> tuple[tuple[_State, ...], int]:
    """The automaton's states, and the one it starts in."""
    try:
        parsed = _sre_parse.parse(pattern, flags)
    except (re.error, RecursionError, OverflowError) as err:
        raise NotLinear(f"invalid regular expression: {err}") from None
    builder = _Builder()
    try:  # ``flags``: a compiled pattern's, so its inline (?i) and the like are in them
        start = builder.sequence(list(parsed), 0, flags)
    except RecursionError:
        raise NotLinear("nested too deeply") from None
    return tuple(builder.states), start


def check_linear(pattern: re.Pattern[str]) -> None:
    """Raise :class:`NotLinear` (saying what) unless ``pattern`` can be matched in linear time."""
    _program(pattern.pattern, pattern.flags)


@functools.lru_cache(maxsize=1024)
def _search(pattern: str, flags: int, text: str) -> bool:
    """A match ending in the first MAX_COMMAND_TEXT characters; the (at most two) characters
    after them are there for the anchors at the cut (``$``, ``\\b``), which is no end."""
    states, start = _program(pattern, flags)
    current: list[int] = []
    end = min(len(text), MAX_COMMAND_TEXT)
    for pos in range(end + 1):
        current, matched = _close(states, [*current, start], text, pos)
        if matched:
            return True
        if pos == end:
            break
        ch = text[pos]
        current = [
            states[index].out
            for index in current
            if (test := states[index].test) is not None and test(ch)
        ]
    return False


def command_search(pattern: re.Pattern[str], text: str) -> bool | None:
    """Whether ``pattern`` is found in ``text`` (``re.search``'s answer), in linear time; None
    (unknown) for no match in a longer text's searched part, or a pattern not linear."""
    try:
        if _search(pattern.pattern, pattern.flags, text[: MAX_COMMAND_TEXT + 2]):
            return True
    except NotLinear:
        return None
    return None if len(text) > MAX_COMMAND_TEXT else False
