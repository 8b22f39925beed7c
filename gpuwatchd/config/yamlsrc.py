"""Reading YAML text into nodes that remember where they were written.

In detail: docs/internals.md, section `gpuwatchd.config.yamlsrc`.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field

import yaml

from gpuwatchd.core import checked
from gpuwatchd.core.escape import escape

# A policy file is a few kilobytes and a few hundred YAML nodes. PyYAML is pure Python here
# (for its line marks): about 0.4 s per MiB of text and 25 us per node. The limits keep a
# whole policy (main file and every drop-in, read on a reload too) to a few seconds, well
# under the unit's WatchdogSec=30s.
MAX_DOCUMENT_BYTES = 1024 * 1024  # one file
MAX_TOTAL_BYTES = 4 * 1024 * 1024  # all the files of one policy (or one scenario) together
MAX_NODES = 50_000  # scalars, lists and mappings, keys included, of all of them together
# The deepest place a policy uses is 5 levels down (reset.before[0].command[0]); a scenario
# file a few more. 32 is far from both and far from Python's recursion limit.
MAX_DEPTH = 32
# Problems a ConfigError's text lists: it is logged, and kept in the state file, whole.
MAX_LISTED = 100
# What YAML itself allows in a stream (YAML 1.1 c-printable, as PyYAML's reader checks), so no
# control character reaches PyYAML, whose reader would fail without a line number.
_NOT_PRINTABLE = re.compile("[^\t\n\r\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_LINE_BREAK = re.compile("\r\n|[\n\r\x85\u2028\u2029]")
# What a double-quoted "\ud800" gives: half of a UTF-16 pair, which no UTF-8 text can hold.
_SURROGATE = re.compile("[\ud800-\udfff]")


class ConfigError(Exception):
    """An invalid, unreadable or unsafe configuration (the CLI exits 78, EX_CONFIG). ``path``,
    ``line`` (1-based) and ``key`` (``rules[0].steps[1].signal``) locate the first problem;
    ``problems`` lists every problem found (this one first); its text, the first MAX_LISTED."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        key: str | None = None,
        problems: Sequence[ConfigError] = (),
    ) -> None:
        self.message = message
        self.path = path
        self.line = line
        self.key = key
        self.problems: tuple[ConfigError, ...] = tuple(problems) or (self,)
        super().__init__(message)

    def located(self) -> str:
        """This problem alone, as ``file:line: key: message`` (the file's name escaped: a drop-in's
        name may hold a newline or an escape sequence)."""
        where = ""
        if self.path is not None:
            where = escape(self.path) if self.line is None else f"{escape(self.path)}:{self.line}"
            where += ": "
        if self.key:
            where += f"{self.key}: "
        return where + self.message

    def __str__(self) -> str:
        """The first :data:`MAX_LISTED` problems, a line each, and how many more there are."""
        lines = [problem.located() for problem in self.problems[:MAX_LISTED]]
        if len(self.problems) > MAX_LISTED:
            lines.append(f"(and {len(self.problems) - MAX_LISTED} more problems)")
        return "\n".join(lines)

    @classmethod
    def combine(cls, problems: Sequence[ConfigError]) -> ConfigError:
        first = problems[0]
        return cls(
            first.message, path=first.path, line=first.line, key=first.key, problems=problems
        )


@dataclass
class Node:
    """A YAML value with where it was written: file, 1-based line, key path."""

    file: str
    line: int
    path: str

    def error(self, message: str, key: str | None = None) -> ConfigError:
        return ConfigError(message, path=self.file, line=self.line, key=key or self.path or None)


@dataclass
class Scalar(Node):
    value: object = None


@dataclass
class Seq(Node):
    items: list[Node] = field(default_factory=list)


@dataclass
class Map(Node):
    entries: dict[str, Node] = field(default_factory=dict)
    key_lines: dict[str, int] = field(default_factory=dict)


def join_key(path: str, key: str) -> str:
    """The key path of ``key`` inside ``path`` (``a.b``; just ``key`` at the top level)."""
    return f"{path}.{key}" if path else key


def describe_value(value: object) -> str:
    """A YAML value as an error message names it: ``null``, ``boolean true``, ``a list``..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return f"{type(value).__name__} {shown(value)}"


def shown(value: object) -> str:
    """``repr(value)`` cut short for a message: a hostile value may be a megabyte long."""
    return checked.shown(value, 60)


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``word``, or an empty string."""
    close = [choice for choice in choices if choice.lower() == word.lower()]
    if not close:
        import difflib  # only for this message: a policy without a typo never loads it

        close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass
class Budget:
    """The characters and YAML nodes one policy's files (main and drop-ins) may still spend."""

    chars: int = MAX_TOTAL_BYTES
    nodes: int = MAX_NODES


def load_document(filename: str, text: str, budget: Budget | None = None) -> Map:
    """Parse one YAML document whose top level must be a mapping (empty text: an empty Map),
    bounded (docs/internals.md) within ``budget``, which it spends. Raises only
    :class:`ConfigError`, naming ``filename`` and the line."""
    budget = Budget() if budget is None else budget
    _check_text(filename, text, budget)
    try:
        loader = _BoundedLoader(filename, text, budget)  # its reader checks what _check_text did
        try:
            root = loader.get_single_node()
            if root is None:
                return Map(filename, 1, "")
            if not isinstance(root, yaml.MappingNode):
                raise ConfigError(
                    "the top level must be a mapping of keys", path=filename, line=_line(root)
                )
            converted = _convert(root, loader, filename, "")
            assert isinstance(converted, Map)  # noqa: S101 -- a MappingNode converts to a Map
            return converted
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        message = " ".join(part for part in (err.context, err.problem) if part)
        raise ConfigError(
            f"YAML syntax: {message}", path=filename, line=mark.line + 1 if mark else None
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"YAML: {err}", path=filename) from None


def _check_text(filename: str, text: str, budget: Budget) -> None:
    if len(text) > MAX_DOCUMENT_BYTES:
        raise ConfigError("larger than the 1 MiB limit of a configuration file", path=filename)
    budget.chars -= len(text)
    if budget.chars < 0:
        raise ConfigError(
            "the configuration files together are larger than their 4 MiB limit", path=filename
        )
    if (bad := _NOT_PRINTABLE.search(text)) is not None:
        char = bad.group()
        unnamed = "unassigned" if ord(char) > 0x7F else "control"
        name = "NUL" if char == "\0" else unicodedata.name(char, unnamed)
        raise ConfigError(
            f"control character U+{ord(char):04X} ({name}) in the text; "
            "write it as an escape in a double-quoted string if it is meant",
            path=filename,
            line=line_of(text, bad.start()),
        )


def line_of(text: str, index: int) -> int:
    """The 1-based line of ``text[index]``, counting line breaks as YAML does."""
    return len(_LINE_BREAK.findall(text, 0, index)) + 1


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing anchors, aliases, nesting deeper than MAX_DEPTH and
    more nodes than the budget holds, each node as it starts to be composed."""

    def __init__(self, filename: str, text: str, budget: Budget) -> None:
        super().__init__(text)
        self._filename = filename
        self._depth = 0
        self._budget = budget

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]  # untyped in the stubs
        refused = None
        if isinstance(event, yaml.AliasEvent):
            refused = "YAML aliases (*name) are not supported; write the value out"
        elif getattr(event, "anchor", None) is not None:
            refused = "YAML anchors (&name) are not supported; write the value out where it is used"
        elif self._depth >= MAX_DEPTH:
            refused = f"nested deeper than {MAX_DEPTH} levels"
        else:
            self._budget.nodes -= 1
            if self._budget.nodes < 0:
                refused = f"more than {MAX_NODES} YAML values in the configuration files together"
        if refused is not None:
            raise ConfigError(refused, path=self._filename, line=int(event.start_mark.line) + 1)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _construct_scalar(node: yaml.ScalarNode, loader: yaml.SafeLoader, filename: str) -> object:
    try:
        value = loader.construct_object(node)
    except yaml.YAMLError:
        raise
    # PyYAML's scalar constructors raise what their conversions raise: ValueError for
    # '2023-02-30' or '!!int abc', KeyError for '!!bool maybe', AttributeError for
    # '!!timestamp x', ValueError past Python's int digit limit. Each is a bad value here.
    except Exception as err:
        raise ConfigError(
            f"YAML cannot read the value {shown(node.value)} as {node.tag.rsplit(':', 1)[-1]}",
            path=filename,
            line=_line(node),
        ) from err
    if isinstance(value, str) and (half := _SURROGATE.search(value)) is not None:
        raise ConfigError(
            f"the value {shown(value)} holds U+{ord(half.group()):04X}, a surrogate escape "
            "that no UTF-8 text can hold",
            path=filename,
            line=_line(node),
        )
    return value


def _convert(node: yaml.Node, loader: yaml.SafeLoader, filename: str, path: str) -> Node:
    if isinstance(node, yaml.ScalarNode):
        return Scalar(filename, _line(node), path, _construct_scalar(node, loader, filename))
    if isinstance(node, yaml.SequenceNode):
        items = [
            _convert(item, loader, filename, f"{path}[{i}]") for i, item in enumerate(node.value)
        ]
        return Seq(filename, _line(node), path, items)
    assert isinstance(node, yaml.MappingNode)  # noqa: S101 -- the third and last node type
    result = Map(filename, _line(node), path)
    for key_node, value_node in node.value:
        line = _line(key_node)
        where = path or None
        if key_node.tag == "tag:yaml.org,2002:merge":
            problem = "YAML merge keys (<<) are not supported; write the keys out"
        elif not isinstance(key_node, yaml.ScalarNode):
            problem, where = "keys must be plain strings", None
        elif not (key := str(key_node.value)).isprintable():
            problem = f"keys must be plain strings, got {shown(key)}"
        elif key in result.entries:
            problem = f"duplicate key (first at line {result.key_lines[key]})"
            where = join_key(path, key)
        else:
            result.key_lines[key] = line
            result.entries[key] = _convert(value_node, loader, filename, join_key(path, key))
            continue
        raise ConfigError(problem, path=filename, line=line, key=where)
    return result
