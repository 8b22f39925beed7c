"""The test suite's layout (tests/README.md): every test module sits in tests/unit,
tests/integration or tests/system, and no test module imports another one (shared helpers live
in tests/support, shared fixtures are registered in tests/conftest.py)."""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("unit", "integration", "system")


def _test_modules() -> list[pathlib.Path]:
    return sorted(p for kind in KINDS for p in (TESTS / kind).glob("test_*.py"))


def _is_test_module(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("test_") and name.startswith("tests.")


def test_no_test_module_sits_in_the_tests_root() -> None:
    stray = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert stray == [], f"move these into tests/unit, tests/integration or tests/system: {stray}"


def test_each_kind_folder_holds_tests_and_is_a_package() -> None:
    for kind in KINDS:
        assert (TESTS / kind / "__init__.py").is_file(), kind
        assert list((TESTS / kind).glob("test_*.py")), f"tests/{kind} holds no test module"


def test_no_test_module_imports_another_test_module() -> None:
    found = []
    for path in _test_modules() + sorted((TESTS / "support").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            found += [f"{path.relative_to(TESTS)}: {n}" for n in names if _is_test_module(n)]
    assert found == [], "import shared helpers from tests/support instead: " + "; ".join(found)


def test_the_guard_sees_an_import_of_a_test_module() -> None:
    assert _is_test_module("tests.unit.test_plan")
    assert _is_test_module("tests.test_e2e_run")
    assert not _is_test_module("tests.support.plancases")
    assert not _is_test_module("gpuwatchd.decide.plan.decisions")
