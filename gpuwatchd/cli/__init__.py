"""The ``gpuwatchd`` command line: argument parsing and each command (``scan`` and its report,
``status``, ``explain``, ``spare``, ...; ``simulate``'s virtual host is :mod:`gpuwatchd.sim`).
Each command reads through ``collect`` or a file, decides through ``decide``, and prints; only
``run`` (in :mod:`gpuwatchd.daemon.lifecycle`) acts.
"""

from __future__ import annotations


class CliError(Exception):
    """A failure the CLI reports as one line and an exit code (here, not in :mod:`.main`: the
    commands raise it, and main imports them)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
