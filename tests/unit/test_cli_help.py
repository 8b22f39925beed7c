"""Every command's ``--help`` says what the command does and lists its exit codes."""

from __future__ import annotations

import argparse

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
