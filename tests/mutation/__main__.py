"""``make mutate``: mutation testing of the safety gates in gpuwatchd/decide/.

Usage (from the repository root, with the project's virtual environment)::

    python -m tests.mutation                  # every target of tests/mutation/scope.py
    python -m tests.mutation floor plan       # some targets (names or files)
    python -m tests.mutation --only live_holder
    python -m tests.mutation --changed        # only functions changed since the last record
    python -m tests.mutation --record         # also record the fingerprints (make mutate)
    python -m tests.mutation --tests tests/unit/test_gates_proven.py plan_resets
                                              # judged by these test files only (a quick look;
                                              # a survivor may be killed by another file)

It prints the score per module, then every survivor that is not a recorded equivalent, as an
entry ready to paste into ``tests/mutation/equivalents.yaml`` once someone has checked that no
test can tell it apart (or, better, has written the test that does). Exit status: 0 when no
*critical* function (scope.py) has such a survivor, 1 when one has (or when the time limit
left a critical mutant unrun), 2 when the tool itself
could not do its work (collection error, a mutant that could not be installed, bad files, a
function named in scope.py that no longer exists, a test that fails when run twice).

``--changed`` (what CI runs) mutates only the functions whose fingerprint differs from the one
recorded in ``tests/mutation/fingerprints.json``: a hash of the function's syntax tree *with*
everything in decide/ it reaches (its callees, the tables it reads, the policy
defaults of the attributes it reads; tests/mutation/callees.py), so a fresh clone needs no
history to know what a change touched. ``--record`` rewrites the fingerprints of every
function that was mutated in full and has no unexplained critical survivor.

A critical mutant the time limit left unrun fails the run (exit 1) like a critical survivor:
what was not judged is not proven.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.mutation import equivalents as eq
from tests.mutation.callees import Dependencies
from tests.mutation.operators import Mutant, find_functions, mutants_of
from tests.mutation.runner import ModuleSource, MutationPlugin, Verdict, function_id
from tests.mutation.scope import (
    ALL,
    TARGETS,
    TEST_FILES,
    Target,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
EQUIVALENTS = HERE / "equivalents.yaml"
FINGERPRINTS = HERE / "fingerprints.json"
RESULTS = ROOT / "build" / "mutation" / "results.json"
DETECTED = ("killed", "timeout")


def _say(text: str) -> None:
    print(text, flush=True)


def _targets(names: Sequence[str]) -> list[Target]:
    scoped = TARGETS
    if not names:
        return list(scoped)
    chosen = []
    for name in names:
        found = [t for t in scoped if name in (t.name, t.file, Path(t.file).name)]
        if found:
            chosen.extend(found)
        elif name.endswith(".py") and (ROOT / name).is_file():
            chosen.append(Target(Path(name).stem, name, ALL, ()))
        else:
            known = ", ".join(t.name for t in scoped)
            raise SystemExit(f"unknown target {name!r}; known: {known}, or a .py file")
    return chosen


def _module_name(file: str) -> str:
    return file.removesuffix(".py").replace("/", ".")


def _load(targets: Sequence[Target]) -> tuple[list[ModuleSource], list[str]]:
    modules, missing = [], []
    for target in targets:
        tree = ast.parse((ROOT / target.file).read_text(encoding="utf-8"), target.file)
        functions = find_functions(tree)
        chosen = {q: f for q, f in functions.items() if target.selects(q)}
        if target.functions != ALL:
            missing += [function_id(target.file, q) for q in target.functions if q not in functions]
        modules.append(ModuleSource(_module_name(target.file), target.file, tree, chosen))
    return modules, missing


def _read_fingerprints() -> dict[str, str]:
    path = FINGERPRINTS
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise SystemExit(f"{path}: expected an object of strings")
    return {str(k): v for k, v in data.items()}


def _table(
    targets: Sequence[Target], verdicts: Sequence[Verdict], equivalent: set[Mutant]
) -> tuple[list[str], float | None]:
    header = (
        f"{'module':<10} {'mutants':>7} {'killed':>6} {'timeout':>7} {'survived':>8} "
        f"{'uncovered':>9} {'equivalent':>10} {'not run':>7} {'score':>7}"
    )
    rows = [header]
    totals: Counter[str] = Counter()
    for target in targets:
        mine = [v for v in verdicts if v.mutant.file == target.file]
        if not mine:
            continue
        counts = Counter(
            "equivalent" if v.mutant in equivalent and v.status == "survived" else v.status
            for v in mine
        )
        counts["mutants"] = len(mine)
        totals.update(counts)
        rows.append(_row(target.name, counts))
    if len(rows) > 2:
        rows.append(_row("total", totals))
    return rows, _score(totals)


def _score(counts: Counter[str]) -> float | None:
    judged = counts["mutants"] - counts["equivalent"] - counts["not_run"] - counts["error"]
    detected = sum(counts[s] for s in DETECTED)
    return None if judged <= 0 else 100.0 * detected / judged


def _row(name: str, counts: Counter[str]) -> str:
    score = _score(counts)
    shown = "-" if score is None else f"{score:.1f}%"
    return (
        f"{name:<10} {counts['mutants']:>7} {counts['killed']:>6} {counts['timeout']:>7} "
        f"{counts['survived']:>8} {counts['uncovered']:>9} {counts['equivalent']:>10} "
        f"{counts['not_run']:>7} {shown:>7}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.mutation", description=__doc__.split("\n")[0]
    )
    parser.add_argument("targets", nargs="*", help="target names (scope.py) or .py files")
    parser.add_argument(
        "--only", action="append", default=[], help="functions whose name contains this"
    )
    parser.add_argument(
        "--changed", action="store_true", help="only functions changed since the record"
    )
    parser.add_argument(
        "--record", action="store_true", help="record fingerprints of clean functions"
    )
    parser.add_argument(
        "--tests",
        action="append",
        default=[],
        help="judge with these test files only (default: scope's TEST_FILES)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--time-limit", type=float, default=None, help="seconds; then stop starting mutants"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    # Hypothesis examples must be the same in every child and the baseline (tests/conftest.py),
    # also under CI's profile.
    os.environ["GPUWATCHD_HYPOTHESIS_PROFILE"] = "mutate"

    targets = _targets(args.targets)
    modules, missing = _load(targets)
    try:
        equivalents = eq.load_equivalents(EQUIVALENTS)
    except eq.EquivalentsError as error:
        _say(f"error: {error}")
        return 2
    recorded = _read_fingerprints()
    dependencies = Dependencies(ROOT)
    mutants: list[Mutant] = []
    prints: dict[str, str] = {}
    for source, target in zip(modules, targets, strict=True):
        text = (ROOT / source.file).read_text(encoding="utf-8")
        for qualname, function in sorted(source.functions.items()):
            if args.only and not any(part in qualname for part in args.only):
                continue
            fid = function_id(source.file, qualname)
            prints[fid] = dependencies.fingerprint(function.node, source.file)
            if args.changed and recorded.get(fid) == prints[fid]:
                continue
            critical = target.is_critical(qualname)
            mutants += mutants_of(source.file, text, function, critical=critical)
    what = "changed functions of " if args.changed else ""
    _say(
        f"mutation testing: {len(mutants)} mutants of {what}{len(modules)} module(s), "
        f"{args.jobs} job(s){f', time limit {args.time_limit:g}s' if args.time_limit else ''}"
    )
    if missing:
        _say(
            "scope.py names functions that do not exist (renamed? update tests/mutation/scope.py):"
        )
        for name in missing:
            _say(f"  {name}")
    if not mutants:
        if args.changed:
            record = FINGERPRINTS.relative_to(ROOT)
            _say(f"nothing to mutate: every function is as {record} records")
        else:
            _say("nothing to mutate: no function of the targets matches")
        return 2 if missing else 0

    deadline = None if args.time_limit is None else started + args.time_limit
    plugin = MutationPlugin(modules, mutants, jobs=args.jobs, deadline=deadline, progress=_say)
    files = [f for f in args.tests or TEST_FILES if (ROOT / f).exists()]
    # No terminal plugin: pytest's own summary ("no tests ran") would be misleading here.
    options = ["-o", "addopts=", "--strict-markers", "--strict-config"]
    options += ["-p", "no:terminal", "-p", "no:cacheprovider"]
    code = pytest.main([*files, *options], plugins=[plugin])
    if plugin.collection_failed or code not in (0, pytest.ExitCode.OK):
        _say(f"error: the tests could not be collected or run (pytest exit {int(code)}):")
        _say(f"  run: .venv/bin/python -m pytest {' '.join(files)} --collect-only -q")
        return 2
    return _report(
        args=args, targets=targets, plugin=plugin, equivalents=equivalents, missing=missing,
        prints=prints, recorded=recorded, started=started,
    )  # fmt: skip


def _report(
    *,
    args: argparse.Namespace,
    targets: Sequence[Target],
    plugin: MutationPlugin,
    equivalents: Sequence[eq.Equivalent],
    missing: Sequence[str],
    prints: dict[str, str],
    recorded: dict[str, str],
    started: float,
) -> int:
    verdicts = plugin.verdicts
    keys = {e.key for e in equivalents}
    equivalent = {v.mutant for v in verdicts if v.mutant.key in keys}
    rows, score = _table(targets, verdicts, equivalent)
    _say("")
    for row in rows:
        _say(row)
    open_ = [
        v for v in verdicts if v.status in ("survived", "uncovered") and v.mutant not in equivalent
    ]
    critical = [v for v in open_ if v.mutant.critical]
    if open_:
        _say("")
        _say(f"{len(open_)} survivor(s) need a look ({len(critical)} in critical functions):")
        for verdict in sorted(
            open_, key=lambda v: (not v.mutant.critical, v.mutant.file, v.mutant.lineno)
        ):
            flag = "CRITICAL " if verdict.mutant.critical else ""
            _say(f"# {flag}{verdict.mutant.label}: {verdict.status}")
            _say(eq.to_yaml([verdict.mutant]).rstrip())
    errors = [v for v in verdicts if v.status == "error"]
    for verdict in errors:
        _say(f"error: {verdict.mutant.label} could not be installed: {verdict.killer}")
    stale = eq.stale(equivalents, [v.mutant for v in verdicts])
    if stale:
        _say("")
        _say(f"{len(stale)} entr(ies) of equivalents.yaml match no mutant now (update or delete):")
        for entry in stale:
            _say(f"  {entry.file} {entry.function}: {entry.key[4]!r} ({entry.key[5]})")
    gone = sorted(set(missing) | set(plugin.missing))
    if gone:
        _say("")
        _say(
            "scope.py names functions that do not exist (renamed? update tests/mutation/scope.py):"
        )
        for name in gone:
            _say(f"  {name}")
    if plugin.failed_baseline:
        _say("")
        _say("these tests failed without any mutant and judged nothing:")
        for nodeid in plugin.failed_baseline:
            _say(f"  {nodeid}")
    if plugin.unstable:
        _say("")
        _say("these tests pass alone but fail when run again in a child (they change a value")
        _say("other runs share, or depend on one); they judged nothing, fix them:")
        for nodeid in plugin.unstable:
            _say(f"  {nodeid}")
    not_run = [v for v in verdicts if v.status == "not_run"]
    unjudged = [v for v in not_run if v.mutant.critical]
    if not_run:
        _say(
            f"\nthe time limit stopped the run: {len(not_run)} mutant(s) not run, "
            f"{len(unjudged)} of them in critical functions (not proven: the run fails)"
        )
        for name in sorted({function_id(v.mutant.file, v.mutant.function) for v in unjudged}):
            _say(f"  not run: {name}")
    _write_results(verdicts, equivalent)
    if args.record and not args.tests:  # fewer tests judge less: nothing to record
        _record(verdicts, equivalent, prints, recorded, FINGERPRINTS)
    elapsed = time.monotonic() - started
    shown = "-" if score is None else f"{score:.1f}%"
    _say(
        f"\nmutation score {shown} (equivalents set aside); {len(critical)} critical survivor(s); "
        f"{elapsed:.0f}s; details in {RESULTS.relative_to(ROOT)}"
    )
    if errors or gone or plugin.unstable:
        return 2
    return 1 if critical or unjudged else 0


def _write_results(verdicts: Sequence[Verdict], equivalent: set[Mutant]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "file": v.mutant.file,
            "function": v.mutant.function,
            "lineno": v.mutant.lineno,
            "operator": v.mutant.operator,
            "context": v.mutant.context,
            "line": v.mutant.line,
            "change": v.mutant.change,
            "occurrence": v.mutant.occurrence,
            "critical": v.mutant.critical,
            "status": "equivalent" if v.mutant in equivalent else v.status,
            "killer": v.killer,
            "seconds": round(v.seconds, 3),
        }
        for v in verdicts
    ]
    RESULTS.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _record(
    verdicts: Sequence[Verdict],
    equivalent: set[Mutant],
    prints: dict[str, str],
    recorded: dict[str, str],
    path: Path,
) -> None:
    """Fingerprint every function that was judged in full, unless a critical one has an
    unexplained survivor (then CI keeps mutating it until that is fixed)."""
    by_function: dict[str, list[Verdict]] = {}
    for verdict in verdicts:
        by_function.setdefault(
            function_id(verdict.mutant.file, verdict.mutant.function), []
        ).append(verdict)
    updated = dict(recorded)
    for fid, print_ in prints.items():
        mine = by_function.get(fid, [])
        if any(v.status in ("not_run", "error") for v in mine):
            continue
        open_critical = any(
            v.mutant.critical
            and v.status in ("survived", "uncovered")
            and v.mutant not in equivalent
            for v in mine
        )
        if open_critical:
            updated.pop(fid, None)
        else:
            updated[fid] = print_
    path.write_text(json.dumps(dict(sorted(updated.items())), indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
