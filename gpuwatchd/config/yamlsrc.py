"""Reading YAML text into nodes that remember where they were written.

This module owns the position-tracking YAML reader shared by the policy files (``config.py``)
and the scenario files (``scenario.py``): :func:`load_document` turns text into a tree of
:class:`Map`, :class:`Seq` and :class:`Scalar` nodes, each knowing its file, 1-based line and
key path, and refuses what a hand-written file should never contain (duplicate keys, merge
keys, non-string keys, recursive aliases). It also owns :class:`ConfigError`, the located error
it raises. It has no knowledge of any schema or policy: which keys exist and what values mean
belong to its callers. Its only work is parsing the text it is given; it reads no files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import yaml

__all__ = [
    "ConfigError",
    "Map",
    "Node",
    "Scalar",
    "Seq",
    "join_key",
    "load_document",
]


class ConfigError(Exception):
    """An invalid, unreadable or unsafe configuration. The CLI exits 78 (EX_CONFIG) on it.

    Defined here because the reader raises it for YAML syntax and structure; ``config.py``
    re-exports it and raises it for every schema problem.

    ``path``, ``line`` (1-based) and ``key`` (a key path such as ``rules[0].steps[1].signal``)
    locate the first problem; ``problems`` lists every problem found (this one first).
    """

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
        """This problem alone, as ``file:line: key: message``."""
        where = ""
        if self.path is not None:
            where = self.path if self.line is None else f"{self.path}:{self.line}"
            where += ": "
        if self.key:
            where += f"{self.key}: "
        return where + self.message

    def __str__(self) -> str:
        return "\n".join(problem.located() for problem in self.problems)

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


def load_document(filename: str, text: str) -> Map:
    """Parse one YAML document whose top level must be a mapping; empty text is an empty Map.

    Raises :class:`ConfigError` (naming ``filename`` and the line) for a syntax error, a
    non-mapping top level, a duplicate key, a merge key (``<<``), a non-scalar key or a
    recursive alias.
    """
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return Map(filename, 1, "")
        if not isinstance(root, yaml.MappingNode):
            raise ConfigError(
                "the top level must be a mapping of keys", path=filename, line=_line(root)
            )
        converted = _convert(root, loader, filename, "", set())
        assert isinstance(converted, Map)  # noqa: S101 -- a MappingNode converts to a Map
        return converted
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        message = " ".join(part for part in (err.context, err.problem) if part)
        raise ConfigError(
            f"YAML syntax: {message}", path=filename, line=mark.line + 1 if mark else None
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"YAML: {err}", path=filename) from None
    finally:
        loader.dispose()


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _convert(
    node: yaml.Node, loader: yaml.SafeLoader, filename: str, path: str, active: set[int]
) -> Node:
    if id(node) in active:
        raise ConfigError("recursive YAML alias", path=filename, line=_line(node), key=path)
    if isinstance(node, yaml.ScalarNode):
        return Scalar(filename, _line(node), path, loader.construct_object(node))
    active.add(id(node))
    try:
        if isinstance(node, yaml.SequenceNode):
            items = [
                _convert(item, loader, filename, f"{path}[{i}]", active)
                for i, item in enumerate(node.value)
            ]
            return Seq(filename, _line(node), path, items)
        assert isinstance(node, yaml.MappingNode)  # noqa: S101 -- the third and last node type
        result = Map(filename, _line(node), path)
        for key_node, value_node in node.value:
            line = _line(key_node)
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise ConfigError(
                    "YAML merge keys (<<) are not supported; write the keys out",
                    path=filename,
                    line=line,
                    key=path or None,
                )
            if not isinstance(key_node, yaml.ScalarNode):
                raise ConfigError("keys must be plain strings", path=filename, line=line)
            key = str(key_node.value)
            if key in result.entries:
                raise ConfigError(
                    f"duplicate key (first at line {result.key_lines[key]})",
                    path=filename,
                    line=line,
                    key=join_key(path, key),
                )
            result.key_lines[key] = line
            result.entries[key] = _convert(
                value_node, loader, filename, join_key(path, key), active
            )
        return result
    finally:
        active.discard(id(node))
