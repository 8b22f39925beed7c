"""The mutation tool itself (tests/mutation): which mutants it makes, that their names survive
unrelated edits, that a mutant really changes the running function, and that the checked-in
equivalents and scope are well-formed. ``make mutate`` is the tool's real run."""

from __future__ import annotations

import ast
import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from tests.mutation.equivalents import EquivalentsError, load_equivalents, stale, to_yaml
from tests.mutation.operators import OPERATORS, apply, find_functions, fingerprint, mutants_of
from tests.mutation.runner import ModuleSource, MutationPlugin, _resolve, function_code
from tests.mutation.scope import ALL, TARGETS, TEST_FILES

ROOT = Path(__file__).resolve().parents[2]

SAMPLE = textwrap.dedent(
    '''
    """A sample module."""


    def gate(pids, self_pids, w):
        """Docstring: never mutated."""
        for pid in pids:
            if pid in self_pids:
                continue  # ourselves
            w.event("x.y", "info", why=f"pid {pid + 1}", n=pid > 0)
            if pid > 2 and not w.paused:
                return "holder " + str(pid)
        return None


    class Box:
        def size(self, items):
            return max(len(items) - 1, 0)
    '''
)


def _mutants(source: str = SAMPLE) -> list[tuple[str, str, str, str]]:
    tree = ast.parse(source)
    found = []
    for function in find_functions(tree).values():
        for m in mutants_of("sample.py", source, function):
            found.append((m.function, m.operator, m.line, m.change))
    return found


def test_the_operators_and_where_they_apply() -> None:
    found = _mutants()
    operators = {op for _, op, _, _ in found}
    assert operators <= set(OPERATORS)
    assert (
        "gate",
        "compare",
        "if pid in self_pids:",
        "pid in self_pids → pid not in self_pids",
    ) in (found)
    assert ("gate", "loop", "continue", "continue → break") in found
    assert ("gate", "delete", "continue", "delete") in found
    assert ("gate", "boolop", "if pid > 2 and not w.paused:", (
        "pid > 2 and (not w.paused) → pid > 2 or not w.paused"
    )) in found  # fmt: skip
    assert ("gate", "not", "if pid > 2 and not w.paused:", "not w.paused → w.paused") in found
    assert ("gate", "return", "return \"holder \" + str(pid)", (
        "return 'holder ' + str(pid) → return None"
    )) in found  # fmt: skip
    assert ("Box.size", "minmax", "return max(len(items) - 1, 0)", (
        "max(len(items) - 1, 0) → min(len(items) - 1, 0)"
    )) in found  # fmt: skip
    # No string mutation; nothing inside an event's arguments or an f-string; no docstring
    # deleted; `return None` is not turned into itself; a statement outside a branch is kept.
    assert not any("'info'" in change or "pid + 1" in change for _, _, _, change in found)
    assert not any(line.startswith("w.event") for _, _, line, _ in found)
    assert not any(line.startswith('"""') for _, _, line, _ in found)
    assert not any(line == "return None" for _, _, line, _ in found)
    assert not any(op == "delete" and line.startswith("for pid") for _, op, line, _ in found)


def test_a_mutants_name_survives_an_unrelated_edit_and_a_new_comment() -> None:
    tree = ast.parse(SAMPLE)
    before = {m.key for m in mutants_of("s.py", SAMPLE, find_functions(tree)["gate"])}
    edited = SAMPLE.replace('"""A sample module."""', '"""A sample module."""\n\nX = 1\n\n')
    edited = edited.replace("# ourselves", "# the daemon's own processes")
    tree = ast.parse(edited)
    function = find_functions(tree)["gate"]
    after = {m.key for m in mutants_of("s.py", edited, function)}
    assert before == after
    assert fingerprint(function) == fingerprint(find_functions(ast.parse(SAMPLE))["gate"])
    changed = find_functions(ast.parse(edited.replace("pid > 2", "pid > 3")))["gate"]
    assert fingerprint(changed) != fingerprint(function)


def test_identical_changes_in_one_function_are_told_apart_by_occurrence() -> None:
    source = "def f(a):\n    if a:\n        return 1\n    if a:\n        return 1\n    return 2\n"
    tree = ast.parse(source)
    keys = [m.key for m in mutants_of("f.py", source, find_functions(tree)["f"])]
    assert len(keys) == len(set(keys))


def test_an_installed_mutant_changes_what_the_running_function_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mutsample.py").write_text(SAMPLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("mutsample")
    tree = ast.parse(SAMPLE)
    functions = find_functions(tree)

    class W:
        paused = False

        def event(self, *args: object, **kw: object) -> None:
            pass

    assert module.gate([1, 5], {5}, W()) is None
    mutant = next(
        m for m in mutants_of("mutsample.py", SAMPLE, functions["gate"]) if m.operator == "loop"
    )
    mutated = compile(apply(tree, mutant), str(tmp_path / "mutsample.py"), "exec")
    code = function_code(mutated, ["gate"], functions["gate"].first_line)
    original = module.gate.__code__
    try:
        module.gate.__code__ = code  # what a forked child does
        assert module.gate([5, 7], {5}, W()) is None  # `break` at ourselves: 7 is never seen
    finally:
        module.gate.__code__ = original
    assert module.gate([5, 7], {5}, W()) == "holder 7"
    assert ModuleSource("mutsample", "mutsample.py", tree, functions).functions == functions
    sys.modules.pop("mutsample", None)


CACHED = textwrap.dedent(
    """
    import functools


    @functools.lru_cache(maxsize=8)
    def doubled(n):
        return n * 2
    """
)


def test_a_cached_function_is_found_and_its_mutant_not_hidden_by_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An lru_cache'd target (patterns.py's matcher) resolves to the function it wraps, and the
    plugin empties the module's caches, so a result cached unmutated hides no mutant."""
    (tmp_path / "mutcached.py").write_text(CACHED)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("mutcached")
    assert module.doubled(3) == 6  # cached now
    tree = ast.parse(CACHED)
    functions = find_functions(tree)
    plugin = MutationPlugin(
        [ModuleSource("mutcached", "mutcached.py", tree, functions)], [],
        jobs=1, deadline=None, progress=lambda _: None,
    )  # fmt: skip
    function = _resolve("mutcached", "doubled")
    original = function.__code__
    try:
        function.__code__ = compile("def doubled(n):\n    return n * 3\n", "x", "exec").co_consts[0]
        assert module.doubled(3) == 6  # the cache still answers
        plugin._clear_caches()
        assert module.doubled(3) == 9  # the mutant runs
    finally:
        function.__code__ = original
        sys.modules.pop("mutcached", None)


# --- the checked-in files ------------------------------------------------------------------------


def test_the_equivalents_file_is_well_formed_and_names_scoped_files() -> None:
    entries = load_equivalents(ROOT / "tests" / "mutation" / "equivalents.yaml")
    files = {t.file for t in TARGETS}
    assert all(e.file in files for e in entries)
    assert all(len(e.reason) > 10 for e in entries)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{}", "expected a list"),
        ("- [a]", "entry 1: expected a mapping"),
        ("- {file: a.py}", "'function' must be a non-empty string"),
        (
            "- {file: a, function: f, operator: strings, context: c, line: l, change: c,"
            " reason: r}",
            "unknown operator 'strings'",
        ),
        (
            "- {file: a, function: f, operator: loop, context: c, line: l, change: c,"
            " reason: 'TODO: why'}",
            "the reason is still TODO",
        ),
        (
            "- {file: a, function: f, operator: loop, context: c, line: l, change: c, reason: r,"
            " colour: red}",
            "unknown key(s) colour",
        ),
    ],
)
def test_a_malformed_equivalents_file_is_refused_naming_the_entry(
    tmp_path: Path, text: str, error: str
) -> None:
    path = tmp_path / "equivalents.yaml"
    path.write_text(text)
    with pytest.raises(EquivalentsError, match=error.replace("(", r"\(").replace(")", r"\)")):
        load_equivalents(path)


def test_a_survivor_pasted_from_the_report_with_a_reason_is_an_equivalent(tmp_path: Path) -> None:
    tree = ast.parse(SAMPLE)
    mutants = mutants_of("sample.py", SAMPLE, find_functions(tree)["gate"])
    path = tmp_path / "equivalents.yaml"
    path.write_text(to_yaml(mutants[:2], reason="only the log text differs"))
    entries = load_equivalents(path)
    assert [e.key for e in entries] == [m.key for m in mutants[:2]]
    assert stale(entries, mutants) == []
    assert stale(entries, mutants[2:]) == entries


def test_the_scope_names_files_that_exist_and_test_files_that_exist() -> None:
    for target in TARGETS:
        assert (ROOT / target.file).is_file(), target.file
        assert (
            target.critical == ALL
            or set(target.critical) <= set(target.functions)
            or (target.functions == ALL)
        ), target.name
    assert all((ROOT / f).is_file() for f in TEST_FILES)
