"""Making untrusted text safe for one line of a log or a terminal: one rule for every output.

Users' text (command lines, cgroup paths, names, reasons) shown raw could forge a log line or
repaint a terminal with a newline, an ANSI escape, a C1 control or U+2028: :func:`escape` shows
every character that is not printable as a visible escape; :func:`unescape_mount_path` undoes
the kernel's octal escapes of a mountinfo path. Pure.
"""

from __future__ import annotations

import re

_MOUNT_ESCAPE = re.compile(r"\\([0-7]{3})")


def escape(text: str) -> str:
    """``text`` with every non-printable character (controls, separators, format characters,
    unassigned code points; the plain space excepted) as a visible escape."""
    if text.isprintable():
        return text
    # ascii() of one character: \n, \r, \t, else \xNN, \uNNNN or \UNNNNNNNN.
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def unescape_mount_path(field: str) -> str:
    """A mountinfo path field with the kernel's octal escapes (``\\040`` for a space) undone."""
    return _MOUNT_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)
