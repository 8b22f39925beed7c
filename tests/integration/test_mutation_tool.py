"""The mutation tool itself (tests/mutation): which mutants it makes, that their names survive
unrelated edits, that a mutant really changes the running function, and that the checked-in
equivalents and scope are well-formed, and that a fingerprint sees what a gate rests on.
``make mutate`` is the tool's real run."""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tests.mutation.__main__ as mutation_main
from tests.mutation.callees import Dependencies
from tests.mutation.equivalents import EquivalentsError, load_equivalents, stale, to_yaml
from tests.mutation.operators import (
    OPERATORS,
    Mutant,
    apply,
    find_functions,
    mutants_of,
)
from tests.mutation.runner import ModuleSource, MutationPlugin, Verdict, _resolve, function_code
from tests.mutation.scope import ALL, TARGETS, TEST_FILES, Target

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
    # A statement at the top of the body may be deleted, but a return there is the return
    # operator's.
    assert ("gate", "delete", "for pid in pids:", "delete") in found


NEW_OPERATORS = textwrap.dedent(
    """
    def gate(snapshot, pids, policy, extra):
        seen = [p for p in pids if p > 2 if p != 7]
        seen += extra
        held = policy.get("gpu", 0)
        if check(held, strict=True):
            return seen
        return sorted(seen) if held else None
    """
)


def test_the_operators_a_mutation_review_found_missing() -> None:
    """An argument replaced by None or dropped, ``x = None``, ``+=`` → ``=``, a top-level
    statement deleted, a comprehension filter removed, a condition forced."""
    found = _mutants(NEW_OPERATORS)
    changes = {(op, change) for _, op, _, change in found}
    assert changes >= {
        ("argument", "policy.get: argument 1 `'gpu'` → None"),
        ("argument", "policy.get: drop argument 2 `0`"),
        ("argument", "check: argument 2 `strict=True` → None"),
        ("argument", "check: drop argument 2 `strict=True`"),
        ("none", "policy.get('gpu', 0) → None"),
        ("augassign", "seen += extra → seen = extra"),
        ("filter", "drop `if p > 2`"),
        ("filter", "drop `if p != 7`"),
        ("condition", "check(held, strict=True) → True"),
        ("condition", "check(held, strict=True) → False"),
        ("condition", "held → True"),
        ("condition", "held → False"),
    }
    filtered = {line for _, op, line, _ in found if op == "filter"}
    assert filtered == {"seen = [p for p in pids if p > 2 if p != 7]"}  # its line, not the def's
    deleted = {line for _, op, line, _ in found if op == "delete"}
    assert deleted == {
        "seen = [p for p in pids if p > 2 if p != 7]",
        "seen += extra",
        'held = policy.get("gpu", 0)',
        "if check(held, strict=True):",
        "return seen",  # in a branch
    }


def test_a_calls_positional_arguments_are_mutated() -> None:
    """The ``args`` field of a call is mutated, but a nested function's signature and defaults
    are not."""
    source = textwrap.dedent(
        """
        def gate(pids, limit):
            def inner(a, b=limit + 1):
                return a
            return inner(len(pids) > limit, pids[0] == 1)
        """
    )
    changes = {change for _, _, _, change in _mutants(source)}
    assert "len(pids) > limit → len(pids) >= limit" in changes
    assert "pids[0] == 1 → pids[0] != 1" in changes
    assert not any("limit + 1" in change for change in changes)


def test_a_statement_calling_super_is_never_deleted() -> None:
    """Deleting it would drop the method's __class__ cell: a mutant that cannot be installed."""
    source = (
        "class E(ValueError):\n"
        "    def __init__(self, m):\n"
        "        super().__init__(m)\n"
        "        self.m = m\n"
    )
    found = _mutants(source)
    assert ("E.__init__", "delete", "self.m = m", "delete") in found
    assert not any(op == "delete" and "super" in line for _, op, line, _ in found)


def test_every_mutant_of_the_new_operators_compiles_and_runs(tmp_path: Path) -> None:
    (tmp_path / "mutnew.py").write_text(NEW_OPERATORS)
    tree = ast.parse(NEW_OPERATORS)
    function = find_functions(tree)["gate"]
    mutants = mutants_of("mutnew.py", NEW_OPERATORS, function)
    for mutant in mutants:
        mutated = compile(apply(tree, mutant), str(tmp_path / "mutnew.py"), "exec")
        function_code(mutated, ["gate"], function.first_line)


def test_a_mutants_name_survives_an_unrelated_edit_and_a_new_comment() -> None:
    tree = ast.parse(SAMPLE)
    before = {m.key for m in mutants_of("s.py", SAMPLE, find_functions(tree)["gate"])}
    edited = SAMPLE.replace('"""A sample module."""', '"""A sample module."""\n\nX = 1\n\n')
    edited = edited.replace("# ourselves", "# the daemon's own processes")
    tree = ast.parse(edited)
    function = find_functions(tree)["gate"]
    after = {m.key for m in mutants_of("s.py", edited, function)}
    assert before == after


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


def test_a_child_a_baseline_test_left_running_is_not_taken_for_a_mutant() -> None:
    """A command's keeper that a test of act/ left running ends while the mutants run: the
    plugin reaps it and goes on waiting for its own child."""
    plugin = MutationPlugin([], [], jobs=1, deadline=None, progress=lambda _: None)
    stray = os.fork()
    if stray == 0:  # pragma: no cover - the child exits at once
        os._exit(0)
    os.waitid(os.P_PID, stray, os.WEXITED | os.WNOWAIT)  # exited, not reaped yet
    mutant = _mutant_of_sample()
    running = {2**22 + 1: (mutant, time.monotonic(), 60.0, -1)}  # past pid_max: never a child
    plugin._reap(running)
    assert list(running) == [2**22 + 1]
    assert plugin.verdicts == []
    with pytest.raises(ChildProcessError):
        os.waitpid(stray, os.WNOHANG)  # reaped


def _mutant_of_sample() -> Mutant:
    function = find_functions(ast.parse(SAMPLE))["gate"]
    return mutants_of("sample.py", SAMPLE, function)[0]


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


# --- a time-out with critical mutants left fails; a gate's callees and defaults count --------


def _report_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, statuses: list[str]) -> int:
    """The exit status of a run whose critical mutants ended with ``statuses``."""
    monkeypatch.setattr(mutation_main, "RESULTS", tmp_path / "build" / "results.json")
    monkeypatch.setattr(mutation_main, "ROOT", tmp_path)
    tree = ast.parse(SAMPLE)
    function = find_functions(tree)["gate"]
    mutants = mutants_of("sample.py", SAMPLE, function, critical=True)[: len(statuses)]
    plugin = MutationPlugin(
        [ModuleSource("sample", "sample.py", tree, {"gate": function})], mutants,
        jobs=1, deadline=None, progress=lambda _: None,
    )  # fmt: skip
    plugin.verdicts = [Verdict(m, s) for m, s in zip(mutants, statuses, strict=True)]
    target = Target("sample", "sample.py", ALL, ALL)
    return mutation_main._report(
        args=argparse.Namespace(record=False, tests=[]), targets=[target],
        plugin=plugin, equivalents=[], missing=[], prints={}, recorded={}, started=0.0,
    )  # fmt: skip


def test_a_run_whose_time_limit_left_critical_mutants_unrun_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """CI's ``make mutate-changed`` passed on a time-out before."""
    assert _report_of(tmp_path, monkeypatch, ["killed", "killed"]) == 0
    assert _report_of(tmp_path, monkeypatch, ["killed", "not_run"]) == 1
    out = capsys.readouterr().out
    assert "1 mutant(s) not run, 1 of them in critical functions" in out
    assert "not run: sample.py::gate" in out
    assert _report_of(tmp_path, monkeypatch, ["killed", "survived"]) == 1


def test_no_record_means_every_function_is_mutated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mutation_main, "FINGERPRINTS", tmp_path / "fingerprints.json")
    assert mutation_main._read_fingerprints() == {}  # absent: --changed mutates all


GATES = textwrap.dedent(
    """
    from policy import Limits

    _KINDS = ("a", "b")


    def gate(policy, kind, evidence):
        evidence = helper(kind)
        return kind in _KINDS and policy.limits.max_kills > evidence


    def helper(kind):
        return deeper(kind) + 1


    def deeper(kind):
        return len(kind)


    def unrelated():
        return 3


    def evidence():
        return 4
    """
)
POLICY = textwrap.dedent(
    """
    class Limits:
        max_kills: int = 4
        window: float = 3600.0
    """
)


def _gate_print(tmp_path: Path, gates: str = GATES, policy: str = POLICY) -> str:
    decide = tmp_path / "gpuwatchd" / "decide"
    decide.mkdir(parents=True, exist_ok=True)
    (decide / "gates.py").write_text(gates)
    (decide / "policy.py").write_text(policy)
    dependencies = Dependencies(tmp_path)
    gate = find_functions(ast.parse(gates))["gate"].node
    return dependencies.fingerprint(gate, "gpuwatchd/decide/gates.py")


def test_changed_sees_a_change_to_a_callee_a_table_or_a_policy_default(
    tmp_path: Path,
) -> None:
    """``--changed`` compares these fingerprints: a change to what the gate calls (at any
    depth), the table it reads or the default of a policy field it reads re-mutates it; a change
    to an unrelated function, another default or a function named like one of its locals
    does not."""
    before = _gate_print(tmp_path)
    assert _gate_print(tmp_path, GATES.replace("len(kind)", "len(kind) * 2")) != before
    assert _gate_print(tmp_path, GATES.replace("+ 1", "+ 2")) != before
    assert _gate_print(tmp_path, GATES.replace('("a", "b")', '("a",)')) != before
    assert _gate_print(tmp_path, policy=POLICY.replace("= 4", "= 5")) != before
    assert _gate_print(tmp_path, policy=POLICY.replace("3600.0", "60.0")) == before
    assert _gate_print(tmp_path, GATES.replace("return 3", "return 30")) == before
    assert _gate_print(tmp_path, GATES.replace("return 4", "return 40")) == before
    assert (
        _gate_print(
            tmp_path, GATES.replace("\n\n\ndef unrelated", "  # a comment\n\n\ndef unrelated")
        )
        == before
    )
    # No mutant touches a docstring: rewording one (the gate's or a callee's) re-mutates
    # nothing, while a string the code uses still counts.
    documented = GATES.replace("def helper(kind):\n", 'def helper(kind):\n    """Why."""\n')
    assert documented != GATES
    assert _gate_print(tmp_path, documented) == before
    assert _gate_print(tmp_path, documented.replace('"""Why."""', '"""Why not."""')) == before
    assert _gate_print(tmp_path, GATES.replace('("a", "b")', '("a", "c")')) != before


def test_a_callee_moved_to_another_file_of_decide_keeps_the_print(tmp_path: Path) -> None:
    """Reshaping decide/ into folders moves definitions between files: the print hashes what
    a gate reaches by qualified name, so a move alone re-mutates nothing, an edit still does."""
    before = _gate_print(tmp_path)
    helpers = "\n\ndef deeper(kind):\n    return len(kind)\n"
    moved = GATES.replace("\n\ndef deeper(kind):\n    return len(kind)\n", "")
    (tmp_path / "gpuwatchd" / "decide" / "sub").mkdir(parents=True)
    (tmp_path / "gpuwatchd" / "decide" / "sub" / "deep.py").write_text(helpers)
    assert moved != GATES
    assert _gate_print(tmp_path, moved) == before
    (tmp_path / "gpuwatchd" / "decide" / "sub" / "deep.py").write_text(
        helpers.replace("len(kind)", "len(kind) * 2")
    )
    assert _gate_print(tmp_path, moved) != before


def test_a_name_is_followed_where_its_module_binds_it(tmp_path: Path) -> None:
    """A plain name reaches the definition its own module binds (its own, or the one it
    imports), not every function of decide/ so named; ``module.f(...)`` reaches that module's
    ``f``. A same-named private helper elsewhere re-mutates nothing; the one called still does."""
    decide = tmp_path / "gpuwatchd" / "decide"
    (decide / "sub").mkdir(parents=True)
    (decide / "sub" / "__init__.py").write_text("")
    other = "def _close(kind):\n    return 1\n\n\ndef limit(kind):\n    return 2\n"
    (decide / "other.py").write_text(other)
    shared = "def limit(kind):\n    return 3\n"
    (decide / "sub" / "shared.py").write_text(shared)
    gates = textwrap.dedent(
        """
        from gpuwatchd.decide.sub import shared
        from gpuwatchd.decide.other import _close as closed


        def gate(kind):
            return _close(kind) + shared.limit(kind) + closed(kind)


        def _close(kind):
            return 4
        """
    )
    before = _gate_print(tmp_path, gates)
    (decide / "sub" / "shared.py").write_text(shared.replace("3", "30"))
    assert _gate_print(tmp_path, gates) != before  # the module's function it calls
    (decide / "sub" / "shared.py").write_text(shared)
    assert _gate_print(tmp_path, gates) == before
    (decide / "other.py").write_text(other.replace("return 2", "return 20"))
    assert _gate_print(tmp_path, gates) == before  # another module's limit: not called
    (decide / "other.py").write_text(other.replace("return 1", "return 10"))
    assert _gate_print(tmp_path, gates) != before  # imported under another name
    (decide / "other.py").write_text(other)
    assert _gate_print(tmp_path, gates.replace("return 4", "return 40")) != before
    unimported = gates.replace("from gpuwatchd.decide.other import _close as closed\n", "")
    unimported = unimported.replace(" + closed(kind)", "")
    alone = _gate_print(tmp_path, unimported)
    (decide / "other.py").write_text(other.replace("return 1", "return 10"))
    assert _gate_print(tmp_path, unimported) == alone  # other.py's _close is another function


def test_a_method_call_on_a_local_set_reaches_no_method_of_ours(tmp_path: Path) -> None:
    """``seen.add(x)`` on a local every assignment makes a set (or dict, list, tuple) is the
    builtin's method; ``state.add(x)`` on a parameter may be any class's ``add``, ours too."""
    decide = tmp_path / "gpuwatchd" / "decide"
    decide.mkdir(parents=True)
    state = "class State:\n    def add(self, kind):\n        return 1\n"
    (decide / "state.py").write_text(state)
    gates = textwrap.dedent(
        """
        def gate(kind, state):
            seen = set()
            seen.add(kind)
            found = {kind}
            found |= {kind}
            found.add(kind)
            return OTHER


        OTHER = 1
        """
    )
    before = _gate_print(tmp_path, gates)
    (decide / "state.py").write_text(state.replace("return 1", "return 10"))
    assert _gate_print(tmp_path, gates) == before
    rebinds = ("seen = load()", "for seen in kind: pass", "seen, other = kind", "global seen")
    for rebound in rebinds:
        mixed = gates.replace("return OTHER", f"{rebound}\n    return OTHER")
        (decide / "state.py").write_text(state)
        mixed_before = _gate_print(tmp_path, mixed)
        (decide / "state.py").write_text(state.replace("return 1", "return 10"))
        assert _gate_print(tmp_path, mixed) != mixed_before, rebound
    on_parameter = gates.replace("return OTHER", "state.add(kind)\n    return OTHER")
    (decide / "state.py").write_text(state)
    parameter_before = _gate_print(tmp_path, on_parameter)
    (decide / "state.py").write_text(state.replace("return 1", "return 10"))
    assert _gate_print(tmp_path, on_parameter) != parameter_before


def test_a_table_computed_from_another_rests_on_it(tmp_path: Path) -> None:
    """``LISTING = _where("listing")`` is what ``_where`` makes of ``KINDS``: a gate reading
    ``LISTING`` is re-mutated when either changes, not only when that line does."""
    gates = textwrap.dedent(
        """
        KINDS = {"a": "listing", "b": "memory"}
        LISTING = _where("listing")


        def _where(what):
            return frozenset(k for k, v in KINDS.items() if v == what)


        def gate(kind):
            return kind in LISTING
        """
    )
    before = _gate_print(tmp_path, gates)
    assert _gate_print(tmp_path, gates.replace('"b": "memory"', '"b": "listing"')) != before
    assert _gate_print(tmp_path, gates.replace("v == what", "v != what")) != before
