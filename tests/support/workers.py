"""How ``make test`` spreads the tests over pytest-xdist's workers (tests/conftest.py).

Test by test, except that the tests of a module defining a module-scoped fixture (a booted
container, one daemon run, a built package) go to one worker together, so the fixture is built
once. xdist's own ``loadgroup`` cannot say so on pytest 9.2, which no longer lets a plugin
rename a test (pytest-xdist issue 1386); the controller reads the modules' source instead.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

_MODULE_FIXTURE = re.compile(r"@pytest\.fixture\(\s*scope\s*=\s*[\"']module[\"']")


@cache
def _shares_a_module_fixture(path: Path) -> bool:
    try:
        return _MODULE_FIXTURE.search(path.read_text(encoding="utf-8")) is not None
    except OSError:
        return False


class ModuleFixtureScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """One work unit per test, or per module where the module shares a fixture."""

    def __init__(self, config: pytest.Config, log: object = None) -> None:
        super().__init__(config, log)
        self._root = config.rootpath

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return module if _shares_a_module_fixture(self._root / module) else nodeid
