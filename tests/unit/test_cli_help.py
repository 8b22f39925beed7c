"""Every command's ``--help`` says what the command does and lists its exit codes."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from gpuwatchd.cli.main import build_parser


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", sorted(_commands()))
def test_a_command_help_has_a_description_and_its_exit_codes(name: str) -> None:
    text = _commands()[name].format_help()
    usage, _, rest = text.partition("\n\n")
    assert usage.startswith(f"usage: gpuwatchd {name}")
    assert not rest.startswith("options:"), f"{name} --help has no description"
    codes = text.split("exit codes:\n", 1)[1].splitlines()
    assert codes[0].split()[:1] == ["0"]
    assert any(line.split()[:1] == ["78"] for line in codes)


def test_check_clean_help_names_the_dirty_exit_code() -> None:
    text = _commands()["check-clean"].format_help()
    assert "   1  one is not" in text


def _help_codes(name: str) -> set[int]:
    codes = _commands()[name].format_help().split("exit codes:\n", 1)[1]
    return {int(line.split()[0]) for line in codes.splitlines() if line.split()}


def test_each_command_help_lists_every_exit_code_the_operations_table_gives_it() -> None:
    """``reload --help`` left out 69 (no pidfd) and ``scan --help`` 75 (the saved state cannot
    be read), both in docs/operations.md's exit codes and the man page."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
    table = docs.read_text().split("## 8. Exit codes", 1)[1].split("\n## ", 1)[0]
    missing = []
    rows = (re.match(r"\| *(\d+) *\|", row) for row in table.splitlines())
    for row in (found for found in rows if found is not None):
        for name in _commands():
            named = re.search(rf"`{re.escape(name)}[ `/]", row.string)
            if named and int(row.group(1)) not in _help_codes(name):
                missing.append(f"{name}: {row.group(1)}")
    assert missing == []
