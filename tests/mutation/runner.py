"""Running the mutants: a pytest plugin that takes over pytest's test loop.

This module owns *how* mutants are judged. Once pytest has collected the test files:

1. **Baseline.** Every test runs once, unmutated, while a profiler records which target
   functions it calls (nested functions and comprehensions count for the function around
   them). A test that fails or is skipped here judges nothing; nor does one that fails when
   the passing tests run once more, unmutated, in a child as the mutants will (it depends on
   a value an earlier test changed, and would seem to kill every mutant).
2. **Mutants.** Each mutant runs in a forked child: the mutated module is compiled, the one
   function's ``__code__`` is swapped for the mutated one (every reference to the function,
   ``from x import f`` included, sees the change), and only the tests that called that
   function run, fastest first, stopping at the first failure. The child's own alarm bounds
   it (a mutant that loops forever is killed by the timeout, which counts as detected).

A target module's ``functools`` caches are emptied before every test (baseline, rerun and
mutant alike): a result cached by an earlier test would otherwise hide a call to a cached
function (from the recording) and a mutant of it (from the tests).

Verdicts: ``killed`` (a test failed), ``timeout`` (detected too), ``survived`` (every test
passed), ``uncovered`` (no test calls the function: a survivor by another name), ``error``
(the mutant could not be installed: a bug of this tool), ``not_run`` (the time limit came
first). Nothing here writes files; the caller reports.
"""

from __future__ import annotations

import ast
import gc
import importlib
import math
import os
import signal
import sys
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from _pytest.runner import runtestprotocol

from tests.mutation.operators import FunctionSource, Mutant, apply

__all__ = ["MutationPlugin", "Verdict", "function_code"]

_SURVIVED, _KILLED, _ERROR = 0, 1, 3
_POLL = 0.01


@dataclass
class Verdict:
    mutant: Mutant
    status: str
    killer: str | None = None
    seconds: float = 0.0


@dataclass
class _Baseline:
    passed: bool
    seconds: float
    called: set[str] = field(default_factory=set)  # "file::qualname"


@dataclass(frozen=True)
class ModuleSource:
    """A target module as parsed once: its import name, file, tree and chosen functions."""

    module: str
    file: str
    tree: ast.Module
    functions: dict[str, FunctionSource]


def function_id(file: str, qualname: str) -> str:
    return f"{file}::{qualname}"


def _resolve(module: str, qualname: str) -> types.FunctionType:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = vars(obj)[part] if isinstance(obj, type) else getattr(obj, part)
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    obj = getattr(obj, "__wrapped__", obj)  # functools.lru_cache wraps the function itself
    if not isinstance(obj, types.FunctionType):
        raise TypeError(f"{module}.{qualname} is not a plain function")
    return obj


def function_code(code: types.CodeType, path: Sequence[str], first_line: int) -> types.CodeType:
    """The code object of the function at ``path`` (class names, then the function's name)
    inside a compiled module, the last one chosen by the line it starts on."""
    current = code
    for depth, name in enumerate(path):
        last = depth == len(path) - 1
        candidates = [
            c
            for c in current.co_consts
            if isinstance(c, types.CodeType)
            and c.co_name == name
            and (not last or c.co_firstlineno == first_line)
        ]
        if len(candidates) != 1:
            raise LookupError(f"no single code object for {'.'.join(path)}")
        current = candidates[0]
    return current


def _recorder(
    codes: Mapping[types.CodeType, str], called: set[str]
) -> Callable[[types.FrameType, str, object], None]:
    """A profile function that adds to ``called`` the target of every code object it enters."""

    def profile(frame: types.FrameType, event: str, _arg: object) -> None:
        if event == "call":
            target = codes.get(frame.f_code)
            if target is not None:
                called.add(target)

    return profile


def _nested_codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested_codes(const)


class MutationPlugin:
    """Takes over ``pytest_runtestloop``: the baseline run, then every mutant in a child."""

    def __init__(
        self,
        modules: Sequence[ModuleSource],
        mutants: Sequence[Mutant],
        *,
        jobs: int,
        deadline: float | None,
        progress: Callable[[str], None],
    ) -> None:
        self.modules = {m.file: m for m in modules}
        self.mutants = list(mutants)
        self.jobs = max(1, jobs)
        self.deadline = deadline
        self.progress = progress
        self.verdicts: list[Verdict] = []
        self.baseline: dict[str, _Baseline] = {}
        self.failed_baseline: list[str] = []
        self.unstable: list[str] = []  # passed alone, failed when run again in a child
        self.missing: list[str] = []  # functions that could not be found at run time
        self.collection_failed = False

    # -- pytest hooks --

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        if session.testsfailed:
            self.collection_failed = True
            return True
        items = list(session.items)
        self._run_baseline(items)
        self._check_rerun(items)
        self._run_mutants(items)
        return True

    def _clear_caches(self) -> None:
        for source in self.modules.values():
            module = sys.modules.get(source.module)
            for value in vars(module).values() if module is not None else ():
                clear = getattr(value, "cache_clear", None)
                if callable(clear):
                    clear()

    # -- baseline --

    def _code_map(self) -> dict[types.CodeType, str]:
        codes: dict[types.CodeType, str] = {}
        for source in self.modules.values():
            for qualname in source.functions:
                try:
                    function = _resolve(source.module, qualname)
                except (AttributeError, KeyError, TypeError):
                    self.missing.append(function_id(source.file, qualname))
                    continue
                for code in _nested_codes(function.__code__):
                    codes[code] = function_id(source.file, qualname)
        return codes

    def _run_baseline(self, items: Sequence[pytest.Item]) -> None:
        codes = self._code_map()
        self.progress(f"baseline: {len(items)} tests, recording which functions each calls")
        for item in items:
            called: set[str] = set()
            self._clear_caches()
            started = time.monotonic()
            sys.setprofile(_recorder(codes, called))
            try:
                reports = runtestprotocol(item, nextitem=None, log=False)
            finally:
                sys.setprofile(None)
            passed = all(r.passed for r in reports)
            self.baseline[item.nodeid] = _Baseline(passed, time.monotonic() - started, called)
            if not passed and not any(r.skipped for r in reports):
                self.failed_baseline.append(item.nodeid)

    def _check_rerun(self, items: Sequence[pytest.Item]) -> None:
        """Run the passing tests again, unmutated, in one child as a mutant would run them: a
        test that fails there depends on what an earlier test left behind (a shared value it
        changed) and would "kill" every mutant. It is set aside and reported."""
        passing = [item for item in items if self.baseline[item.nodeid].passed]
        spent = sum(self.baseline[item.nodeid].seconds for item in passing)
        self.progress(f"rerun: {len(passing)} tests once more, unmutated, in a child")
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            os.close(read_end)
            self._rerun_child(passing, 30.0 + 3.0 * spent, write_end)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            failed = pipe.read().decode(errors="replace").split()
        _pid, status = os.waitpid(pid, 0)
        if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != _SURVIVED:
            raise RuntimeError("the unmutated rerun of the tests did not finish")
        for nodeid in failed:
            self.unstable.append(nodeid)
            self.baseline[nodeid].passed = False

    def _rerun_child(self, tests: Sequence[pytest.Item], timeout: float, pipe: int) -> None:
        code = _ERROR
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(max(1, math.ceil(timeout)))
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            for item in tests:
                self._clear_caches()
                reports = runtestprotocol(item, nextitem=None, log=False)
                if any(r.failed for r in reports):
                    os.write(pipe, item.nodeid.encode() + b"\n")
            code = _SURVIVED
        finally:
            os._exit(code)

    # -- mutants --

    def _tests_for(self, items: Sequence[pytest.Item], mutant: Mutant) -> list[pytest.Item]:
        wanted = function_id(mutant.file, mutant.function)
        chosen = [
            item
            for item in items
            if self.baseline[item.nodeid].passed and wanted in self.baseline[item.nodeid].called
        ]
        return sorted(chosen, key=lambda item: self.baseline[item.nodeid].seconds)

    def _timeout(self, tests: Sequence[pytest.Item]) -> float:
        spent = sum(self.baseline[item.nodeid].seconds for item in tests)
        return 10.0 + 5.0 * spent

    def _run_mutants(self, items: Sequence[pytest.Item]) -> None:
        todo = list(self.mutants)
        total = len(todo)
        running: dict[int, tuple[Mutant, float, float, int]] = {}
        gc.collect()
        gc.freeze()  # the children share the parent's pages instead of copying them
        last_note = time.monotonic()
        while todo or running:
            now = time.monotonic()
            out_of_time = self.deadline is not None and now >= self.deadline
            while todo and len(running) < self.jobs and not out_of_time:
                mutant = todo.pop(0)
                tests = self._tests_for(items, mutant)
                if not tests:
                    self.verdicts.append(Verdict(mutant, "uncovered"))
                    continue
                timeout = self._timeout(tests)
                read_end, write_end = os.pipe()
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the child never returns
                    os.close(read_end)
                    self._child(mutant, tests, timeout, write_end)
                os.close(write_end)
                running[pid] = (mutant, now, timeout, read_end)
            if out_of_time and not running:
                self.verdicts.extend(Verdict(m, "not_run") for m in todo)
                todo = []
                break
            self._reap(running)
            if time.monotonic() - last_note > 15.0:
                last_note = time.monotonic()
                self.progress(f"{len(self.verdicts)}/{total} mutants judged")

    def _reap(self, running: dict[int, tuple[Mutant, float, float, int]]) -> None:
        if not running:
            return
        pid, status = os.waitpid(-1, os.WNOHANG)
        now = time.monotonic()
        if pid == 0:
            for child, (_mutant, started, timeout, _fd) in running.items():
                if now - started > timeout + 10.0:  # the child's own alarm did not work
                    os.kill(child, signal.SIGKILL)
            time.sleep(_POLL)
            return
        if pid not in running:  # a child a baseline test left running (a command's keeper)
            return
        mutant, started, _timeout, read_end = running.pop(pid)
        with os.fdopen(read_end, "rb") as pipe:
            killer = pipe.read().decode(errors="replace") or None
        seconds = now - started
        if os.WIFSIGNALED(status):
            verdict = "timeout" if os.WTERMSIG(status) in (signal.SIGALRM, signal.SIGKILL) else None
            self.verdicts.append(Verdict(mutant, verdict or "killed", killer, seconds))
            return
        code = os.WEXITSTATUS(status)
        verdict = {_SURVIVED: "survived", _KILLED: "killed"}.get(code, "error")
        self.verdicts.append(Verdict(mutant, verdict, killer, seconds))

    def _child(
        self, mutant: Mutant, tests: Sequence[pytest.Item], timeout: float, pipe: int
    ) -> None:
        code = _ERROR
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(max(1, math.ceil(timeout)))
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            self._install(mutant)
            code = _SURVIVED
            for item in tests:
                self._clear_caches()
                reports = runtestprotocol(item, nextitem=None, log=False)
                if any(r.failed for r in reports):
                    os.write(pipe, item.nodeid.encode())
                    code = _KILLED
                    break
        except BaseException as error:
            if code == _ERROR:
                os.write(pipe, f"{type(error).__name__}: {error}".encode()[:4000])
        finally:
            os._exit(code)

    def _install(self, mutant: Mutant) -> None:
        source = self.modules[mutant.file]
        function = source.functions[mutant.function]
        tree = apply(source.tree, mutant)
        compiled = compile(tree, os.path.abspath(mutant.file), "exec", dont_inherit=True)
        new = function_code(compiled, mutant.function.split("."), function.first_line)
        target = _resolve(source.module, mutant.function)
        if target.__code__.co_freevars != new.co_freevars:
            raise RuntimeError("the mutated function's closure differs")
        target.__code__ = new
