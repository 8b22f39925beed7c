"""What a mutated function's behaviour rests on besides its own body, for ``--changed``.

This module owns the fingerprint CI compares (``tests/mutation/fingerprints.json``): a hash of
the function's syntax tree *and* of everything in ``gpuwatchd/decide/`` (and ``model.py``) it
reaches: the functions it calls, transitively, the module-level tables it reads (and what
they are computed from), the policy defaults of the fields it reads. A plain name is followed
as its module binds it; ``module.f()`` to that module's ``f``; a method call to every function
so named, unless on a local that only holds a builtin container. It may re-mutate more than
needed, never less, and never runs anything (docs/architecture.md, "Mutation testing").
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
DEPENDENCY_FILES = ("gpuwatchd/decide/**/*.py", "gpuwatchd/core/model.py")


@dataclass(frozen=True)
class _Entry:
    where: str  # "file::qualname" or "file::NAME"
    dump: str
    names: frozenset[str] = frozenset()  # a function's: the names it reads (calls included)
    # A function's calls of an attribute: (the receiver's name, or "" when not a plain name;
    # the attribute), ``x.name(...)``.
    calls: frozenset[tuple[str, str]] = frozenset()
    attributes: frozenset[str] = frozenset()  # a function's: the attributes it reads

    @property
    def file(self) -> str:
        return self.where.partition("::")[0]


# A local made only by these (or by a literal or comprehension) is a builtin container, whose
# methods (``seen.add``) are none of ours.
_CONTAINERS = frozenset({"set", "frozenset", "dict", "list", "tuple", "sorted"})
_CONTAINER_NODES = (ast.Set, ast.Dict, ast.List, ast.Tuple, ast.SetComp, ast.DictComp, ast.ListComp)
BUILTIN = "()"  # the receiver of a call on such a local


def _container(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
        return value.func.id in _CONTAINERS
    return isinstance(value, _CONTAINER_NODES)


def _containers(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The locals that every binding makes a builtin container: plain assignments of one
    (``|=``, ``+=`` keep it one), never a parameter, a loop's or an unpacking's target, nor a
    name declared ``global`` or ``nonlocal``."""
    made: dict[str, bool] = {}
    whole: set[int] = set()  # the Name nodes that are an assignment's whole target
    for inner in ast.walk(node):
        if isinstance(inner, ast.Assign | ast.AnnAssign):
            targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    whole.add(id(target))
                    made[target.id] = made.get(target.id, True) and _container(inner.value)
        elif isinstance(inner, ast.AugAssign) and isinstance(inner.target, ast.Name):
            whole.add(id(inner.target))
    for inner in ast.walk(node):
        if isinstance(inner, ast.arg):
            made[inner.arg] = False
        elif isinstance(inner, ast.Global | ast.Nonlocal):  # another scope may rebind it
            made.update(dict.fromkeys(inner.names, False))
        elif (
            isinstance(inner, ast.Name)
            and isinstance(inner.ctx, ast.Store)
            and id(inner) not in whole
        ):
            made[inner.id] = False
    return {name for name, container in made.items() if container}


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
            on = inner.func.value
            calls.add((on.id if isinstance(on, ast.Name) else "", inner.func.attr))
    containers = _containers(node)

    def receiver(name: str) -> str:
        return BUILTIN if name in containers else "" if name in local else name

    # A local variable that shares a module function's name reaches nothing.
    return _Entry(
        where,
        _dump(node),
        frozenset(names - local),
        frozenset((receiver(r), a) for r, a in calls),
        frozenset(attributes),
    )


def _table(where: str, value: ast.expr) -> _Entry:
    """A module-level value, with the names it is computed from (``LISTING = _where(...)``
    rests on ``_where`` and the table that reads)."""
    read = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
    bound = {
        n.id for n in ast.walk(value) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    return _Entry(where, _dump(value), names=frozenset(read - bound))


@dataclass
class _Module:
    """What one file binds at its top level: its functions and tables, and its imports
    (alias -> (module, name), name None for ``import module``)."""

    defined: dict[str, list[_Entry]]
    imports: dict[str, tuple[str, str | None]]
    bound: set[str]


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
    defaults of the policy's fields (what an attribute read reaches); each file's top-level
    bindings and imports, to follow a plain name as Python does."""

    def __init__(
        self,
        root: Path,
        patterns: Iterable[str] = DEPENDENCY_FILES,
        policy_file: str = "gpuwatchd/decide/policy.py",
    ) -> None:
        self.functions: dict[str, list[_Entry]] = {}
        self.tables: dict[str, list[_Entry]] = {}
        self.defaults: dict[str, list[_Entry]] = {}
        self.modules: dict[str, _Module] = {}  # by file
        self.files: dict[str, str] = {}  # dotted module name -> file
        for pattern in patterns:
            for path in sorted(root.glob(pattern)):
                file = path.relative_to(root).as_posix()
                tree = ast.parse(path.read_text(encoding="utf-8"), file)
                self._add(file, tree, defaults=file == policy_file)
                dotted = file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                self.files[dotted] = file

    def _add(self, file: str, tree: ast.Module, *, defaults: bool) -> None:
        module = self.modules[file] = _Module({}, {}, set())

        def put(index: dict[str, list[_Entry]], name: str, entry: _Entry) -> None:
            index.setdefault(name, []).append(entry)
            module.defined.setdefault(name, []).append(entry)

        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                put(self.functions, node.name, _function(f"{file}::{node.name}", node))
            elif isinstance(node, ast.ClassDef):
                for inner in node.body:
                    where = f"{file}::{node.name}.{getattr(inner, 'name', '')}"
                    if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                        entry = _function(where, inner)
                        self.functions.setdefault(inner.name, []).append(entry)
                    elif (
                        defaults
                        and isinstance(inner, ast.AnnAssign)
                        and isinstance(inner.target, ast.Name)
                        and inner.value is not None
                    ):  # a policy field's default
                        name = inner.target.id
                        entry = _Entry(f"{where}{name}", _dump(inner.value))
                        self.defaults.setdefault(name, []).append(entry)
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        put(self.tables, target.id, _table(f"{file}::{target.id}", node.value))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    module.imports[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    bound = alias.asname or alias.name.partition(".")[0]
                    module.imports[bound] = (alias.name if alias.asname else bound, None)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                module.bound.add(node.name)
            else:  # an assignment, or a name a top-level loop or with binds
                stored = (n for n in ast.walk(node) if isinstance(n, ast.Name))
                module.bound.update(n.id for n in stored if isinstance(n.ctx, ast.Store))

    def _name(self, file: str, name: str, depth: int = 0) -> list[_Entry]:
        """What the plain ``name`` read in ``file`` is bound to: its own definition, the one an
        import names, nothing (a class, a module, a name from outside the index), or, when the
        file binds no such name (a builtin, or a file outside the index), every definition so
        named."""
        module = self.modules.get(file)
        if module is None or depth > 8:
            return [*self.functions.get(name, ()), *self.tables.get(name, ())]
        if name in module.defined:
            return module.defined[name]
        if name in module.imports:
            source, member = module.imports[name]
            target = self.files.get(source)
            if member is None or target is None or f"{source}.{member}" in self.files:
                return []  # a module, or a definition outside the index
            return self._name(target, member, depth + 1)
        if name in module.bound:
            return []  # a class, or a name bound otherwise (a loop's, say)
        return [*self.functions.get(name, ()), *self.tables.get(name, ())]

    def _called(self, file: str, receiver: str, attribute: str) -> list[_Entry]:
        """What ``receiver.attribute(...)`` in ``file`` reaches: the imported module's function
        when ``receiver`` names a module of the index, else every function so named."""
        module = self.modules.get(file)
        if receiver == BUILTIN and module is not None and not module.bound & _CONTAINERS:
            return []  # ``seen.add(...)`` of a local set: a method of no definition of ours
        if module is not None and receiver and receiver not in module.defined:
            source, member = module.imports.get(receiver, ("", ""))
            dotted = source if member is None else f"{source}.{member}"
            if dotted in self.files:
                return self._name(self.files[dotted], attribute)
        return self.functions.get(attribute, [])

    def reached(self, node: ast.FunctionDef | ast.AsyncFunctionDef, file: str = "") -> list[_Entry]:
        """Every definition ``node`` (of ``file``; "" when unknown) reaches, transitively
        through the functions it calls, in a fixed order (``node`` itself left out)."""
        start = _function(f"{file}::", node)
        seen: dict[str, _Entry] = {}
        todo = [start]
        while todo:
            entry = todo.pop()
            found = [
                *(d for name in entry.names for d in self._name(entry.file, name)),
                *(
                    f
                    for receiver, name in entry.calls
                    for f in self._called(entry.file, receiver, name)
                ),
            ]
            for definition in found:  # a table reaches nothing further: it has no names
                if definition.where not in seen:
                    seen[definition.where] = definition
                    todo.append(definition)
            for name in entry.attributes:
                seen.update((d.where, d) for d in self.defaults.get(name, ()))
        return [seen[where] for where in sorted(seen)]

    def fingerprint(self, node: ast.FunctionDef | ast.AsyncFunctionDef, file: str = "") -> str:
        """A hash of ``node``'s syntax tree (of ``file``) and of every definition it reaches:
        comments, docstrings, formatting and position do not count."""
        digest = hashlib.sha256(_dump(node).encode())
        # By qualified name, not file: moving a definition to another file changes no print.
        reached = sorted((e.where.partition("::")[2], e.dump) for e in self.reached(node, file))
        for where, dump in reached:
            if dump != _dump(node):
                digest.update(b"\0" + where.encode() + b"\0" + dump.encode())
        return digest.hexdigest()[:16]
