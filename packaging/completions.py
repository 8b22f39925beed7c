"""Write gpuwatchd's bash and zsh completion scripts, generated from the real argparse parser.

    python3 packaging/completions.py BASH_FILE ZSH_FILE

Run at package build time (packaging/debian/rules), so the completions always match the
commands and flags of the version they ship with. The generating is done by shtab (Debian 12:
python3-shtab; pip: shtab), a small, maintained library that walks an argparse parser: a
generator of our own would be a second description of the command line to keep in step.

Two things are added here. Arguments that name a file (``--config FILE``, ``check-config FILE``,
``simulate SCENARIO``, ``explain SNAPSHOT``) are marked to complete file names. And the bash
script of shtab 1.5 (Debian 12's) offers only the first of a list of choices — ``gpuwatchd
<Tab>`` gave ``scan`` alone — and splits the choices at newlines only: :func:`fix_bash` rewrites
those two spots as later shtab releases write them, and leaves a script without them as it is.
tests/system/test_packaging.py runs the result in bash, with the system's shtab where it has one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The metavars of arguments that are file names (gpuwatchd/cli/main.py).
FILE_METAVARS = frozenset({"FILE", "SCENARIO", "SNAPSHOT"})

_CHOICES_FIRST_ONLY = (
    '  local current_action_choices_var="${current_action}_choices"\n'
    '  current_action_choices="${!current_action_choices_var}"\n'
)
_CHOICES_ALL = (
    '  local current_action_choices_var="${current_action}_choices[@]"\n'
    '  current_action_choices="${!current_action_choices_var}"\n'
)
_REPLY_SPLIT_AT_NEWLINES = (
    "    local IFS=$'\\n'\n"
    '    COMPREPLY=( $(compgen -W "${current_action_choices}" -- "${completing_word}") \\\n'
    '                $([ -n "${current_action_compgen}" ] \\\n'
    '                  && "${current_action_compgen}" "${completing_word}") )\n'
)
_REPLY_CHOICES_THEN_FILES = (
    '    COMPREPLY=( $(compgen -W "${current_action_choices}" -- "${completing_word}") )\n'
    "    local IFS=$'\\n'  # one file name a line: names may hold spaces\n"
    '    COMPREPLY+=( $([ -n "${current_action_compgen}" ] \\\n'
    '                   && "${current_action_compgen}" "${completing_word}") )\n'
)


def mark_file_arguments(parser: argparse.ArgumentParser, complete_file: object) -> None:
    """Give every argument named FILE, SCENARIO or SNAPSHOT shtab's file completion."""
    for action in parser._actions:
        if action.metavar in FILE_METAVARS:
            action.complete = complete_file  # type: ignore[attr-defined]
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                mark_file_arguments(sub, complete_file)


def fix_bash(script: str) -> str:
    """shtab 1.5's bash script with every choice offered; any other script unchanged."""
    return script.replace(_CHOICES_FIRST_ONLY, _CHOICES_ALL).replace(
        _REPLY_SPLIT_AT_NEWLINES, _REPLY_CHOICES_THEN_FILES
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: completions.py BASH_FILE ZSH_FILE", file=sys.stderr)
        return 2
    import shtab

    from gpuwatchd.cli.main import build_parser

    parser = build_parser()
    mark_file_arguments(parser, shtab.FILE)
    for shell, target in zip(("bash", "zsh"), argv, strict=True):
        path = Path(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = shtab.complete(parser, shell=shell)
        path.write_text(fix_bash(text) if shell == "bash" else text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
