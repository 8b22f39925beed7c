"""Where a configuration keeps its state, read without parsing it.

This module owns one guess: the ``state_dir`` a policy's files name, taken from the last
top-level ``state_dir:`` line of the main file and its drop-ins (``conf.d/*.yaml``), when the
value is plain or simply quoted. It serves the commands that must find a running daemon's state
directory before they have read — or instead of reading — the YAML (the compiled policy,
:mod:`gpuwatchd.state.compiled_policy`; asking the daemon, :mod:`gpuwatchd.cli.entry`). A guess is
only where to look: what is found there is trusted by its own checks, never because of this.
"""

from __future__ import annotations

import os
import re

MAX_BYTES = 4 << 20  # bytes read of each file
_STATE_DIR_LINE = re.compile(r"^state_dir:[ \t]*(.*?)[ \t]*(?:#.*)?$", re.MULTILINE)
_PLAIN = re.compile(r"""'([^']*)'|"([^"\\]*)"|([^'"\s{\[][^#]*)""")


def guess_state_dir(main_file: str) -> str | None:
    """The ``state_dir`` the last top-level ``state_dir:`` line of the main file and its
    drop-ins names (a plain or simply quoted value), None when there is none or it is not
    simple. Only where to look: never believed (module docstring)."""
    found: str | None = None
    folder = os.path.join(os.path.dirname(os.path.abspath(main_file)), "conf.d")
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        names = []
    files = [main_file] + [
        os.path.join(folder, n) for n in names if n.endswith(".yaml") and not n.startswith(".")
    ]
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            text = os.read(fd, MAX_BYTES).decode("utf-8", "replace")
        except OSError:
            return None
        finally:
            os.close(fd)
        for match in _STATE_DIR_LINE.finditer(text):
            value = _PLAIN.fullmatch(match.group(1))
            found = None if value is None else next(g for g in value.groups() if g is not None)
    return found.strip() if found else None
