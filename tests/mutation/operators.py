"""The mutants of chosen functions: each a small change to one node of the function's syntax tree.

This module owns the mutation operators and how a mutant is named. It never runs anything.

Operators (no string mutations: a changed message is not a changed decision):

========== =====================================================================================
compare    ``==``/``!=``, ``<``/``<=``, ``>``/``>=``, ``is``/``is not``, ``in``/``not in`` swapped
boolop     ``and`` and ``or`` swapped
not        ``not x`` becomes ``x``
arith      ``+``/``-``, ``*``/``/``, ``//`` → ``*``, ``%`` → ``//``, ``|``/``&`` (sets) swapped
augassign  ``+=`` and ``-=`` swapped; any ``x op= y`` also becomes ``x = y``
number     an int or float literal ``n`` becomes ``n + 1``
bool       ``True`` and ``False`` swapped
loop       ``break`` and ``continue`` swapped
minmax     ``min(...)`` and ``max(...)``, ``any(...)`` and ``all(...)`` swapped
return     ``return x`` becomes ``return None``
delete     a statement in a branch (the body of an ``if``/``else``, loop, ``try``, ``with`` or
           ``case``) or at the top of the function's body becomes ``pass``
argument   one argument of a call (positional or keyword) becomes ``None``, or is dropped
none       the value of an assignment becomes ``None`` (``x = f()`` → ``x = None``)
filter     one ``if`` of a comprehension is removed
condition  the test of an ``if`` (statement or expression) becomes ``True``, or ``False``
========== =====================================================================================

Nothing inside an f-string, a docstring, an annotation or a default value is mutated, nor
calls that only describe a decision (``LOG_CALLS``: ``w.event(...)``, ``Event(...)``,
``self.note(...)``), their arguments or the statements they stand in: what an event says is
checked by the docs and log tests, and a mutant there changes text, never an action.

A mutant is named by text, never by line number, so that an edit elsewhere in the file leaves
its name alone: the file, the function's qualified name, the operator, the stripped source line
the change starts on, the change itself (``a == b → a != b``), and an occurrence number that
tells apart identical changes of identical lines in one function.
"""

from __future__ import annotations

import ast
import copy
import io
import tokenize
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

__all__ = [
    "LOG_CALLS",
    "OPERATORS",
    "FunctionSource",
    "Mutant",
    "apply",
    "find_functions",
    "mutants_of",
]

OPERATORS = (
    "compare",
    "boolop",
    "not",
    "arith",
    "augassign",
    "number",
    "bool",
    "loop",
    "minmax",
    "return",
    "delete",
    "argument",
    "none",
    "filter",
    "condition",
)

# Calls whose arguments only describe a decision (events and notes).
LOG_CALLS = frozenset({"event", "Event", "note"})

_COMPARE: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_ARITH: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.BitOr: ast.BitAnd,
    ast.BitAnd: ast.BitOr,
}
_AUG: dict[type[ast.operator], type[ast.operator]] = {ast.Add: ast.Sub, ast.Sub: ast.Add}
_SWAP_NAMES = {"min": "max", "max": "min", "any": "all", "all": "any"}
_BRANCHES: dict[type[ast.AST], tuple[str, ...]] = {
    ast.If: ("body", "orelse"),
    ast.For: ("body", "orelse"),
    ast.AsyncFor: ("body", "orelse"),
    ast.While: ("body", "orelse"),
    ast.Try: ("body", "orelse", "finalbody"),
    ast.ExceptHandler: ("body",),
    ast.With: ("body",),
    ast.AsyncWith: ("body",),
    ast.match_case: ("body",),
}
_BLOCK_FIELDS = frozenset({"body", "orelse", "finalbody", "handlers", "cases"})
# Fields that are never mutated: type annotations and decorators. A function's signature
# (its ``args``) is never reached: a nested function or lambda is entered at its body only, so
# ``args`` here is a call's positional arguments, which are mutated like any other expression.
_SKIP_FIELDS = frozenset({"returns", "decorator_list", "annotation", "type_comment"})


@dataclass(frozen=True)
class FunctionSource:
    """One function (or method) of a module, as parsed: its qualified name and its node."""

    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    first_line: int  # where its code object starts (its first decorator, if any)


@dataclass(frozen=True)
class Mutant:
    """One mutant. ``key`` is its stable name; ``site`` and ``alternative`` rebuild it."""

    file: str
    function: str
    operator: str
    context: str
    line: str
    change: str
    occurrence: int
    lineno: int  # for people reading a report; never part of the key
    site: int
    alternative: int
    critical: bool = field(default=False, compare=False)

    @property
    def key(self) -> tuple[str, str, str, str, str, str, int]:
        return (
            self.file,
            self.function,
            self.operator,
            self.context,
            self.line,
            self.change,
            self.occurrence,
        )

    @property
    def label(self) -> str:
        return f"{self.file}:{self.lineno} {self.function} [{self.operator}]"


def find_functions(tree: ast.Module) -> dict[str, FunctionSource]:
    """Module-level functions and the methods of module-level classes, by qualified name."""
    found: dict[str, FunctionSource] = {}

    def add(node: ast.FunctionDef | ast.AsyncFunctionDef, qualname: str) -> None:
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        found[qualname] = FunctionSource(qualname, node, first)

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            add(node, node.name)
        elif isinstance(node, ast.ClassDef):
            for inner in node.body:
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    add(inner, f"{node.name}.{inner.name}")
    return found


# --- sites ------------------------------------------------------------------------------------


@dataclass
class _Site:
    node: ast.AST
    parent: ast.AST
    field: str
    index: int | None
    alternatives: list[tuple[str, Callable[[ast.AST], ast.AST]]]
    context: int  # the line of the compound statement whose block holds this site


def _is_log_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in LOG_CALLS


def _is_docstring(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _swap_compare(index: int) -> Callable[[ast.AST], ast.AST]:
    def build(node: ast.AST) -> ast.AST:
        assert isinstance(node, ast.Compare)
        new = copy.deepcopy(node)
        new.ops[index] = _COMPARE[type(node.ops[index])]()
        return new

    return build


def _alternatives(node: ast.AST) -> list[tuple[str, Callable[[ast.AST], ast.AST]]]:
    """The mutations of ``node`` itself, as (operator, builder of the replacement)."""
    found: list[tuple[str, Callable[[ast.AST], ast.AST]]] = []
    if isinstance(node, ast.Compare):
        for index, op in enumerate(node.ops):
            if type(op) in _COMPARE:
                found.append(("compare", _swap_compare(index)))
    elif isinstance(node, ast.BoolOp):

        def swap_bool(n: ast.AST) -> ast.AST:
            assert isinstance(n, ast.BoolOp)
            other = ast.Or() if isinstance(n.op, ast.And) else ast.And()
            return ast.BoolOp(op=other, values=copy.deepcopy(n.values))

        found.append(("boolop", swap_bool))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        found.append(("not", lambda n: copy.deepcopy(n.operand)))  # type: ignore[attr-defined]
    elif isinstance(node, ast.BinOp) and type(node.op) in _ARITH:

        def swap_arith(n: ast.AST) -> ast.AST:
            assert isinstance(n, ast.BinOp)
            new = copy.deepcopy(n)
            new.op = _ARITH[type(n.op)]()
            return new

        found.append(("arith", swap_arith))
    elif isinstance(node, ast.AugAssign) and type(node.op) in _AUG:

        def swap_aug(n: ast.AST) -> ast.AST:
            assert isinstance(n, ast.AugAssign)
            new = copy.deepcopy(n)
            new.op = _AUG[type(n.op)]()
            return new

        found.append(("augassign", swap_aug))
    if isinstance(node, ast.AugAssign):
        found.append(("augassign", _plain_assignment))
    elif isinstance(node, ast.Constant):
        constant = node.value
        if isinstance(constant, bool):
            flipped = not constant
            found.append(("bool", lambda n: ast.Constant(flipped)))
        elif isinstance(constant, (int, float)):
            bumped = constant + 1
            found.append(("number", lambda n: ast.Constant(bumped)))
    elif isinstance(node, ast.Break):
        found.append(("loop", lambda n: ast.Continue()))
    elif isinstance(node, ast.Continue):
        found.append(("loop", lambda n: ast.Break()))
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _SWAP_NAMES
    ):

        def swap_name(n: ast.AST) -> ast.AST:
            assert isinstance(n, ast.Call)
            assert isinstance(n.func, ast.Name)
            new = copy.deepcopy(n)
            new.func = ast.Name(id=_SWAP_NAMES[n.func.id], ctx=ast.Load())
            return new

        found.append(("minmax", swap_name))
    elif isinstance(node, ast.Return) and node.value is not None:
        if not _is_none(node.value):
            found.append(("return", lambda n: ast.Return(value=ast.Constant(None))))
    elif isinstance(node, ast.comprehension):
        found += [("filter", _without_filter(i)) for i in range(len(node.ifs))]
    if isinstance(node, ast.Call):
        found += _argument_alternatives(node)
    return found


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _plain_assignment(node: ast.AST) -> ast.AST:
    assert isinstance(node, ast.AugAssign)
    plain = ast.Assign(targets=[copy.deepcopy(node.target)], value=copy.deepcopy(node.value))
    return ast.copy_location(plain, node)


def _without_filter(index: int) -> Callable[[ast.AST], ast.AST]:
    def build(node: ast.AST) -> ast.AST:
        assert isinstance(node, ast.comprehension)
        new = copy.deepcopy(node)
        del new.ifs[index]
        return new

    return build


def _argument_alternatives(call: ast.Call) -> list[tuple[str, Callable[[ast.AST], ast.AST]]]:
    """Each argument of ``call`` as None, and dropped (``*args`` and ``**kw`` only dropped)."""
    found: list[tuple[str, Callable[[ast.AST], ast.AST]]] = []

    def change(field: str, index: int, *, drop: bool) -> Callable[[ast.AST], ast.AST]:
        def build(node: ast.AST) -> ast.AST:
            assert isinstance(node, ast.Call)
            new = copy.deepcopy(node)
            items = getattr(new, field)
            if drop:
                del items[index]
            elif field == "args":
                items[index] = ast.Constant(None)
            else:
                items[index].value = ast.Constant(None)
            return new

        return build

    for index, arg in enumerate(call.args):
        if not isinstance(arg, ast.Starred) and not _is_none(arg):
            found.append(("argument", change("args", index, drop=False)))
        found.append(("argument", change("args", index, drop=True)))
    for index, keyword in enumerate(call.keywords):
        if keyword.arg is not None and not _is_none(keyword.value):
            found.append(("argument", change("keywords", index, drop=False)))
        found.append(("argument", change("keywords", index, drop=True)))
    return found


def _in_context(
    parent: ast.AST, name: str, child: ast.AST
) -> list[tuple[str, Callable[[ast.AST], ast.AST]]]:
    """The mutations of ``child`` that depend on where it is: an assignment's value becomes
    None, an ``if``'s test is forced."""
    if name == "value" and isinstance(parent, ast.Assign | ast.AnnAssign) and not _is_none(child):
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        if not any(isinstance(t, ast.Tuple | ast.List) for t in targets):  # unpacking None: a crash
            return [("none", lambda n: ast.Constant(None))]
        return []
    if name == "test" and isinstance(parent, (ast.If, ast.IfExp)):
        return [
            ("condition", lambda n: ast.Constant(True)),
            ("condition", lambda n: ast.Constant(False)),
        ]
    return []


def _sites(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[_Site]:
    """Every mutable node of ``function``'s body, in a fixed order (the same for every copy).

    Each site also gets its context: the first line of the compound statement (``if``, loop,
    ``try``, ``with``, nested ``def``) whose block holds it, or of the function itself.
    """

    def visit(node: ast.AST, context: int) -> Iterator[_Site]:
        compound = isinstance(node, ast.stmt) and any(
            isinstance(getattr(node, name, None), list) and name in _BLOCK_FIELDS
            for name in node._fields
        )
        for name, value in ast.iter_fields(node):
            if name in _SKIP_FIELDS:
                continue
            inner = (
                getattr(node, "lineno", context) if compound and name in _BLOCK_FIELDS else context
            )
            if isinstance(node, (ast.ExceptHandler, ast.match_case)):
                inner = getattr(node, "lineno", None) or getattr(
                    getattr(node, "pattern", None), "lineno", context
                )
            branch = name in _BRANCHES.get(type(node), ())
            children = value if isinstance(value, list) else [value]
            for index, child in enumerate(children):
                if isinstance(child, ast.AST):
                    position = index if isinstance(value, list) else None
                    yield from visit_child(
                        child, node, name, position, branch=branch, context=inner
                    )

    def visit_child(
        child: ast.AST,
        parent: ast.AST,
        name: str,
        index: int | None,
        *,
        branch: bool,
        context: int,
    ) -> Iterator[_Site]:
        if isinstance(child, ast.JoinedStr) or _is_log_call(child) or _is_docstring(child):
            return
        if isinstance(child, ast.Expr) and _is_log_call(child.value):
            return  # an event or note on its own line: what it says, not what is done
        # A nested function or lambda: its body, not its signature or defaults.
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for position, statement in enumerate(child.body):
                yield from visit_child(
                    statement, child, "body", position, branch=False, context=child.lineno
                )
            return
        if isinstance(child, ast.Lambda):
            yield from visit_child(child.body, child, "body", None, branch=False, context=context)
            return
        if isinstance(child, ast.ClassDef):
            return
        alternatives = _alternatives(child) + _in_context(parent, name, child)
        # Deleting the only ``super()`` would change the function's closure (its __class__
        # cell), and such a mutant cannot replace the function's code: not made.
        deletable = (
            branch
            and isinstance(child, ast.stmt)
            and not isinstance(child, ast.Pass)
            and not any(isinstance(n, ast.Name) and n.id == "super" for n in ast.walk(child))
        )
        if deletable and not (parent is function and isinstance(child, ast.Return)):
            alternatives.append(("delete", lambda n: ast.Pass()))
        if alternatives:
            yield _Site(child, parent, name, index, alternatives, context)
        yield from visit(child, context)

    # A statement at the top of the function's body may be deleted too (not its docstring, a
    # nested function, nor a lone ``return``: that is the return operator's).
    for position, statement in enumerate(function.body):
        yield from visit_child(
            statement, function, "body", position, branch=True, context=function.lineno
        )


def _code_only(line: str) -> str:
    """``line`` stripped, without its comment: a reworded comment renames no mutant."""
    cut = len(line)
    try:
        for token in tokenize.generate_tokens(io.StringIO(line).readline):
            if token.type == tokenize.COMMENT:
                cut = token.start[1]
                break
    except (tokenize.TokenError, SyntaxError):
        pass  # a line of a longer statement: a comment, if any, was seen before the error
    return line[:cut].strip()


def _describe(operator: str, old: ast.AST, new: ast.AST) -> str:
    if operator == "delete":
        return "delete"
    if isinstance(old, ast.Call) and isinstance(new, ast.Call) and operator == "argument":
        return _describe_argument(old, new)
    if isinstance(old, ast.comprehension) and isinstance(new, ast.comprehension):
        index = _first_difference(old.ifs, new.ifs)
        return f"drop `if {_one_line(old.ifs[index])}`"
    return f"{_one_line(old)} → {_one_line(new)}"


def _describe_argument(old: ast.Call, new: ast.Call) -> str:
    """``f: argument 2 `b` → None`` or ``f: drop argument 2 `b```: the callee and the argument,
    not the whole call."""
    before: list[ast.AST] = [*old.args, *old.keywords]
    after: list[ast.AST] = [*new.args, *new.keywords]
    index = _first_difference(before, after)
    what = f"argument {index + 1} `{_one_line(before[index])}`"
    dropped = len(after) < len(before)
    return f"{_one_line(old.func)}: {'drop ' + what if dropped else what + ' → None'}"


def _first_difference(before: Sequence[ast.AST], after: Sequence[ast.AST]) -> int:
    """The index of the first node of ``before`` that ``after`` changed or dropped."""
    for index, node in enumerate(before):
        if index >= len(after) or ast.dump(node) != ast.dump(after[index]):
            return index
    raise ValueError("no difference")


def _one_line(node: ast.AST) -> str:
    return " ".join(ast.unparse(node).split())


def mutants_of(
    file: str, source: str, function: FunctionSource, *, critical: bool = False
) -> list[Mutant]:
    """Every mutant of ``function`` (parsed from ``source``, the text of ``file``)."""
    lines = source.splitlines()
    mutants: list[Mutant] = []
    seen: dict[tuple[str, str, str, str, str, str], int] = {}

    def text(lineno: int) -> str:
        return _code_only(lines[lineno - 1]) if 0 < lineno <= len(lines) else ""

    for site_number, site in enumerate(_sites(function.node)):
        where = site.node.target if isinstance(site.node, ast.comprehension) else site.node
        lineno = getattr(where, "lineno", function.node.lineno)  # a comprehension has none
        line, context = text(lineno), text(site.context)
        for alt_number, (operator, build) in enumerate(site.alternatives):
            change = _describe(operator, site.node, build(site.node))
            base = (file, function.qualname, operator, context, line, change)
            seen[base] = seen.get(base, 0) + 1
            mutants.append(
                Mutant(
                    file=file,
                    function=function.qualname,
                    operator=operator,
                    context=context,
                    line=line,
                    change=change,
                    occurrence=seen[base],
                    lineno=lineno,
                    site=site_number,
                    alternative=alt_number,
                    critical=critical,
                )
            )
    return mutants


def apply(tree: ast.Module, mutant: Mutant) -> ast.Module:
    """A copy of ``tree`` with ``mutant`` applied (``tree`` is left alone)."""
    mutated = copy.deepcopy(tree)
    function = find_functions(mutated)[mutant.function]
    for number, site in enumerate(_sites(function.node)):
        if number != mutant.site:
            continue
        _operator, build = site.alternatives[mutant.alternative]
        replacement = ast.copy_location(build(site.node), site.node)
        ast.fix_missing_locations(replacement)
        if site.index is None:
            setattr(site.parent, site.field, replacement)
        else:
            getattr(site.parent, site.field)[site.index] = replacement
        ast.fix_missing_locations(mutated)
        return mutated
    raise LookupError(f"{mutant.label}: site {mutant.site} not found")
