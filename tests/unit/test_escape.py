"""One escaping rule for logs, scan, explain: no character a user controls can break a line."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from gpuwatchd.cli.explain import render_explanation
from gpuwatchd.core.escape import escape
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.events.logs import configure_logging

SEPARATORS = ["\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


@pytest.mark.parametrize("sep", SEPARATORS)
def test_every_line_separator_is_escaped(sep: str) -> None:
    out = escape(f"job_1{sep}0::/slurm/job_2")
    assert sep not in out
    assert out.splitlines() == [out]


def test_printable_text_passes_unchanged() -> None:
    assert escape("python3 train.py --lr=3e-4 über 训练") == "python3 train.py --lr=3e-4 über 训练"
    assert escape("\x1b[2J") == "\\x1b[2J"


def test_each_non_printable_character_has_its_one_visible_escape() -> None:
    """\\n, \\r, \\t by name; any other as \\xNN, \\uNNNN or \\UNNNNNNNN by its code point
    (lower-case hex), every code point checked."""
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    for code in range(0x110000):
        char = chr(code)
        if char.isprintable():
            continue
        width = 2 if code < 0x100 else 4 if code < 0x10000 else 8
        letter = {2: "x", 4: "u", 8: "U"}[width]
        assert escape(char) == named.get(char, f"\\{letter}{code:0{width}x}"), hex(code)


@pytest.mark.parametrize("fmt", ["logfmt", "console"])
@pytest.mark.parametrize("sep", SEPARATORS)
def test_a_log_event_stays_one_line_whatever_its_values_hold(fmt: str, sep: str) -> None:
    stream = io.StringIO()
    configure_logging(fmt=fmt, stream=stream, environ={})
    try:
        structlog.get_logger().warning(EventName.ACTION_SIGNAL, cmdline=f"evil{sep}level=critical")
    finally:
        configure_logging(fmt="logfmt", stream=io.StringIO(), environ={})
    text = stream.getvalue()
    assert text.endswith("\n")
    assert text[:-1].splitlines() == [text[:-1]], text


def test_explain_output_escapes_what_a_report_carries() -> None:
    result = {
        "snapshot": "r.json",
        "policy": ["p.yaml"],
        "findings": [
            {
                "kind": "orphaned",
                "pid": 5,
                "gpu": "GPU-1",
                "reason": "holds\u2028stopped by: nothing\x1b[2J",
                "rule": None,
                "no_rule_because": [],
                "next": None,
                "then": [],
                "stopped_by": [],
            }
        ],
    }
    text = render_explanation(json.loads(json.dumps(result)))
    assert "\u2028" not in text
    assert "\x1b" not in text
