"""The ``gpuwatchd`` command's entry point: a running daemon is asked for a ``scan`` first.

Before the rest of the command line is imported (a served ``scan`` costs mostly Python's
start), a plain ``scan`` asks the daemon over its socket (:mod:`gpuwatchd.served.scan_socket`);
its answer is printed, else :func:`gpuwatchd.cli.main.main` runs, told why it declined.

In detail: docs/internals.md, section `gpuwatchd.cli.entry`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpuwatchd.core.paths import DEFAULT_CONFIG_PATH, DEFAULT_STATE_DIR

if TYPE_CHECKING:
    from gpuwatchd.served.scan_socket import ScanAnswer

ASK_TIMEOUT = 2.0  # seconds the daemon may take to answer before this command scans itself
SKIP_VARIABLE = "GPUWATCHD_ASK_DAEMON"
_COLORS = ("auto", "always", "never")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    answer = answered_by_daemon(args)
    if answer is not None and answer.answered:
        return _print(answer)
    from gpuwatchd.cli.main import main as full_main

    return full_main(args, declined=None if answer is None else answer.reason)


def scan_arguments(argv: Sequence[str]) -> tuple[str | None, bool, str] | None:
    """(``--config`` or None, ``--json``, ``--color``) when ``argv`` is a plain ``scan`` that
    argparse would read the same way, else None (any other word, a repeated option, ``--full``,
    an abbreviation: the full command line reads it)."""
    given: dict[str, str] = {}  # each option at most once, by its full name
    seen_scan = False
    words = list(argv)
    while words:
        word = words.pop(0)
        if word == "scan" and not seen_scan:
            seen_scan = True
            continue
        name, eq, value = word.partition("=")
        if name == "--json" and seen_scan and not eq and name not in given:
            given[name] = ""
            continue
        if name not in ("--config", "--color") or name in given:
            return None
        if name == "--color" and not seen_scan:
            return None
        if not eq:
            if not words or words[0].startswith("-"):
                return None
            value = words.pop(0)
        if (name == "--config" and not value) or (name == "--color" and value not in _COLORS):
            return None
        given[name] = value
    if not seen_scan:
        return None
    return given.get("--config"), "--json" in given, given.get("--color", "auto")


def answered_by_daemon(argv: Sequence[str]) -> ScanAnswer | None:
    """The running daemon's answer to the ``scan`` in ``argv``, or its refusal; None when it
    was not asked (module docstring)."""
    parsed = scan_arguments(argv)
    if parsed is None or os.environ.get(SKIP_VARIABLE) == "0":
        return None
    config, as_json, color = parsed
    from gpuwatchd.config.peek import guess_state_dir
    from gpuwatchd.served.scan_socket import ScanRequest, ask

    main_file = os.path.abspath(config or DEFAULT_CONFIG_PATH)
    guessed = guess_state_dir(main_file)
    folders = [f for f in dict.fromkeys((guessed, DEFAULT_STATE_DIR)) if f and os.path.isabs(f)]
    colored = color == "always" or (color == "auto" and sys.stdout.isatty())
    return ask(folders, ScanRequest(main_file, as_json, colored), ASK_TIMEOUT)


def _print(answer: ScanAnswer) -> int:
    try:
        sys.stdout.write(answer.stdout)
        sys.stdout.flush()
    except BrokenPipeError:
        from gpuwatchd.cli.main import reader_left

        return reader_left()
    for line in answer.stderr:
        print(line, file=sys.stderr)
    return answer.exit_code
