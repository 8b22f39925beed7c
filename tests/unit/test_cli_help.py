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


def test_each_exit_status_of_the_man_page_that_names_commands_names_every_one_using_it() -> None:
    """The man page's 74 named pause and resume, not spare, whose --help lists it."""
    man = Path(__file__).resolve().parents[2] / "docs" / "man" / "gpuwatchd.8"
    section = man.read_text().split(".SH EXIT STATUS", 1)[1].split("\n.SH ", 1)[0]
    entries = {int(b.split()[1]): b.replace("\\-", "-") for b in section.split("\n.TP\n")[1:]}
    missing = []
    for code, text in entries.items():
        named = [name for name in _commands() if re.search(rf"\b{name}\b", text)]
        users = [name for name in _commands() if code in _help_codes(name)]
        if named and code not in (0, 2, 77, 78):  # those every command shares
            missing += [f"{code}: {name}" for name in users if name not in named]
    assert missing == []
