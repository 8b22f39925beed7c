"""Making untrusted text safe for one line of a log or a terminal: one rule for every output.

Command lines, cgroup paths, process names and pause reasons come from users. Shown raw, a
newline, a carriage return, an ANSI escape, a C1 control (U+0085 is a "next line" to some
viewers) or a Unicode line or paragraph separator (U+2028, U+2029) could forge a log line or
repaint a terminal. :func:`escape` turns every character that is not printable into a visible
escape (``\\n``, ``\\x1b``, ``\\u2028``); printable text passes unchanged. Used by the log
renderers, the ``scan`` text view, ``explain`` and ``simulate``. Pure.
"""

from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _visible(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape(text: str) -> str:
    """``text`` with every non-printable character (controls, separators, format characters,
    unassigned code points; the plain space excepted) as a visible escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _visible(c) for c in text)
