"""What a mutated function's behaviour rests on besides its own body, for ``--changed``.

This module owns the fingerprint CI compares (``tests/mutation/fingerprints.json``): a hash of
the function's syntax tree *and* of everything in ``gpuwatchd/decide/`` (and ``model.py``) it
reaches by name: the functions and methods it calls, transitively, the module-level tables it
reads, and the policy defaults (``decide/policy.py``'s dataclass fields) of the attributes it
reads. A change to a callee or to a default therefore re-mutates the gate that depends on it;
a function's own fingerprint alone would not. Reaching is by name (``x.confirm_for`` reaches
every field and method called ``confirm_for``): it may re-mutate more than needed, never less.
It never runs anything.
"""

from __future__ import annotations

import ast
import copy as copy_module
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEPENDENCY_FILES", "Dependencies"]

# Where a gate's callees, tables and defaults live (decide/ imports nothing else of ours but
# model.py and vocabulary.py, whose names are data).
DEPENDENCY_FILES = (
    "gpuwatchd/decide/**/*.py",
    "gpuwatchd/core/model.py",
    "gpuwatchd/core/model.py",
)


@dataclass(frozen=True)
class _Entry:
    where: str  # "file::qualname" or "file::NAME"
    dump: str
    names: frozenset[str] = frozenset()  # a function's: the names it reads (calls included)
    calls: frozenset[str] = frozenset()  # a function's: the methods it calls (``x.name(...)``)
    attributes: frozenset[str] = frozenset()  # a function's: the attributes it reads


def _function(where: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> _Entry:
    names, calls, attributes, local = set(), set(), set(), set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.arg):
            local.add(inner.arg)
        elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
            local.add(inner.id)
        elif isinstance(inner, ast.Name):
            names.add(inner.id)
        elif isinstance(inner, ast.Attribute):
            attributes.add(inner.attr)
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute):
            calls.add(inner.func.attr)
    # A local variable that shares a module function's name reaches nothing.
    return _Entry(
        where, _dump(node), frozenset(names - local), frozenset(calls), frozenset(attributes)
    )


def _dump(node: ast.AST) -> str:
    """``node``'s syntax tree as text, docstrings left out: no mutant touches a docstring, so
    rewording one re-mutates nothing."""
    return ast.dump(_without_docstrings(node), annotate_fields=True, include_attributes=False)


_Body = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def _without_docstrings(node: ast.AST) -> ast.AST:
    if not any(_docstring(n) for n in ast.walk(node)):
        return node
    copy = copy_module.deepcopy(node)
    for inner in ast.walk(copy):
        if isinstance(inner, _Body) and _docstring(inner):
            inner.body = inner.body[1:] or [ast.Pass()]
    return copy


def _docstring(node: ast.AST) -> bool:
    if not isinstance(node, _Body) or not node.body:
        return False
    first = node.body[0]
    return (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )


class Dependencies:
    """The definitions of :data:`DEPENDENCY_FILES` under ``root``: functions and methods (what
    a call reaches), module-level tables (what a name reads) and, in ``policy_file``, the
    defaults of the policy's fields (what an attribute read reaches), each by simple name."""

    def __init__(
        self,
        root: Path,
        patterns: Iterable[str] = DEPENDENCY_FILES,
        policy_file: str = "gpuwatchd/decide/policy.py",
    ) -> None:
        self.functions: dict[str, list[_Entry]] = {}
        self.tables: dict[str, list[_Entry]] = {}
        self.defaults: dict[str, list[_Entry]] = {}
        for pattern in patterns:
            for path in sorted(root.glob(pattern)):
                file = path.relative_to(root).as_posix()
                tree = ast.parse(path.read_text(encoding="utf-8"), file)
                self._add(file, tree, defaults=file == policy_file)

    def _add(self, file: str, tree: ast.Module, *, defaults: bool) -> None:
        def put(index: dict[str, list[_Entry]], name: str, entry: _Entry) -> None:
            index.setdefault(name, []).append(entry)

        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                put(self.functions, node.name, _function(f"{file}::{node.name}", node))
            elif isinstance(node, ast.ClassDef):
                for inner in node.body:
                    where = f"{file}::{node.name}.{getattr(inner, 'name', '')}"
                    if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                        put(self.functions, inner.name, _function(where, inner))
                    elif (
                        defaults
                        and isinstance(inner, ast.AnnAssign)
                        and isinstance(inner.target, ast.Name)
                        and inner.value is not None
                    ):  # a policy field's default
                        name = inner.target.id
                        put(self.defaults, name, _Entry(f"{where}{name}", _dump(inner.value)))
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        entry = _Entry(f"{file}::{target.id}", _dump(node.value))
                        put(self.tables, target.id, entry)

    def reached(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[_Entry]:
        """Every definition ``node`` reaches, transitively through the functions it calls, in
        a fixed order (``node`` itself left out)."""
        start = _function("", node)
        seen: dict[str, _Entry] = {}
        todo = [start]
        while todo:
            entry = todo.pop()
            found = [
                *(f for name in entry.names for f in self.functions.get(name, ())),
                *(f for name in entry.calls for f in self.functions.get(name, ())),
            ]
            for function in found:
                if function.where not in seen:
                    seen[function.where] = function
                    todo.append(function)
            for name in entry.names:
                seen.update((t.where, t) for t in self.tables.get(name, ()))
            for name in entry.attributes:
                seen.update((d.where, d) for d in self.defaults.get(name, ()))
        return [seen[where] for where in sorted(seen)]

    def fingerprint(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
        """A hash of ``node``'s syntax tree and of every definition it reaches: comments,
        docstrings, formatting and position do not count."""
        digest = hashlib.sha256(_dump(node).encode())
        # By qualified name, not file: moving a definition to another file changes no print.
        reached = sorted((e.where.partition("::")[2], e.dump) for e in self.reached(node))
        for where, dump in reached:
            if dump != _dump(node):
                digest.update(b"\0" + where.encode() + b"\0" + dump.encode())
        return digest.hexdigest()[:16]
