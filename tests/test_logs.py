"""Log setup: journald priority prefixes, one line per event, formats, and never raising."""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from gpuwatchd.logs import configure_logging, get_logger, priority_prefix, under_journald

JOURNAL = {"JOURNAL_STREAM": "8:12345"}


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def emit(
    method: str, *, fmt: str = "logfmt", env: dict[str, str] | None = None, **fields: object
) -> list[str]:
    stream = io.StringIO()
    configure_logging(fmt=fmt, level="debug", stream=stream, environ=env or {})
    getattr(get_logger(), method)("test.event", **fields)
    return stream.getvalue().splitlines()


_PAIR = re.compile(r'([^\s=]+)=("(?:[^"\\]|\\.)*"|\S*)')
_UNESCAPE = {"n": "\n", "r": "\r", "t": "\t", '"': '"', "\\": "\\"}


def parse_logfmt(line: str) -> dict[str, str | None]:
    """A strict reader for the logfmt we write: quoted values unescaped, empty means None."""
    fields: dict[str, str | None] = {}
    for key, raw in _PAIR.findall(line):
        if raw.startswith('"'):
            fields[key] = re.sub(
                r"\\(x[0-9a-f]{2}|.)",
                lambda m: _UNESCAPE.get(m.group(1)) or chr(int(m.group(1)[1:], 16)),
                raw[1:-1],
            )
        else:
            fields[key] = raw or None
    return fields


@pytest.mark.parametrize(
    ("method", "prefix"),
    [
        ("debug", "<7>"),
        ("info", "<6>"),
        ("warning", "<4>"),
        ("error", "<3>"),
        ("critical", "<2>"),
    ],
)
@pytest.mark.parametrize("fmt", ["logfmt", "json", "console", "auto"])
def test_under_journald_each_event_is_one_line_with_its_priority_prefix(
    method: str, prefix: str, fmt: str
) -> None:
    (line,) = emit(method, fmt=fmt, env=JOURNAL, note="two\nlines", cmd=["a", "b\nc"])
    assert line.startswith(prefix)
    assert not re.match(r"<\d>.*<\d>", line)
    assert "timestamp" not in line  # journald stamps entries itself


@pytest.mark.parametrize(
    ("level", "prefix"),
    [
        ("debug", "<7>"),
        ("info", "<6>"),
        ("warning", "<4>"),
        ("warn", "<4>"),
        ("error", "<3>"),
        ("exception", "<3>"),
        ("critical", "<2>"),
        ("CRITICAL", "<2>"),
        ("no-such-level", "<6>"),
    ],
)
def test_priority_prefix_maps_levels_to_sd_daemon_priorities(level: str, prefix: str) -> None:
    assert priority_prefix(level) == prefix


def test_journald_json_body_parses_after_the_prefix() -> None:
    (line,) = emit("warning", fmt="json", env=JOURNAL, gpu="GPU-1", pid=42)
    assert line.startswith("<4>{")
    body = json.loads(line[3:])
    assert body == {"level": "warning", "event": "test.event", "gpu": "GPU-1", "pid": 42}


def test_json_lines_carry_an_iso8601_utc_timestamp_outside_journald() -> None:
    (line,) = emit("info", fmt="json", pid=7, dry_run=True, memory=None, via=("fd", "map"))
    body = json.loads(line)
    assert list(body)[:3] == ["timestamp", "level", "event"]
    assert body["pid"] == 7
    assert body["dry_run"] is True
    assert body["memory"] is None
    assert body["via"] == ["fd", "map"]
    stamp = body["timestamp"]
    assert stamp.endswith("Z")
    assert datetime.fromisoformat(stamp[:-1]).year >= 2024


def test_logfmt_has_key_value_fields_in_a_stable_order() -> None:
    (line,) = emit(
        "warning",
        gpu="GPU-1",
        pid=12,
        dry_run=False,
        via=("fd", "map"),
        cmdline="python train.py",
        evidence={"dead_owner": 9},
        memory=None,
    )
    assert re.match(r"timestamp=\S+Z level=warning event=test\.event ", line)
    fields = parse_logfmt(line)
    assert fields["gpu"] == "GPU-1"
    assert fields["pid"] == "12"
    assert fields["dry_run"] == "false"
    assert fields["via"] == "fd,map"
    assert 'cmdline="python train.py"' in line
    assert fields["cmdline"] == "python train.py"
    assert json.loads(fields["evidence"] or "") == {"dead_owner": 9}
    assert fields["memory"] is None


def test_logfmt_escapes_control_characters_so_an_event_stays_one_line() -> None:
    hostile = 'evil\nlevel=critical event="forged" \\ \x1b[2J'
    (line,) = emit("info", cmdline=hostile, tab="a\tb", empty="")
    assert 'cmdline="evil\\nlevel=critical event=\\"forged\\" \\\\ \\x1b[2J"' in line
    assert "\t" not in line
    assert "\x1b" not in line
    fields = parse_logfmt(line)
    assert fields["cmdline"] == hostile
    assert fields["tab"] == "a\tb"
    assert fields["empty"] == ""
    assert fields["level"] == "info"


def test_exceptions_are_flattened_into_fields_on_one_line() -> None:
    stream = io.StringIO()
    configure_logging(fmt="logfmt", stream=stream, environ=JOURNAL)
    log = get_logger()
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        log.exception("poll.failed")
    (line,) = stream.getvalue().splitlines()
    assert line.startswith("<3>")
    fields = parse_logfmt(line[3:])
    assert fields["exc"] == "ValueError: bad\nvalue"
    assert "test_logs.py:" in (fields["exc_trace"] or "")


def test_console_format_with_exception_stays_on_one_line() -> None:
    stream = io.StringIO()
    configure_logging(fmt="console", stream=stream, environ={})
    try:
        raise RuntimeError("boom")
    except RuntimeError as error:
        get_logger().error("reset.failed", exc_info=error)
    (line,) = stream.getvalue().splitlines()
    assert "RuntimeError: boom" in line


def test_level_filters_out_lower_events_and_a_reconfigure_changes_it() -> None:
    stream = io.StringIO()
    configure_logging(fmt="logfmt", level="warning", stream=stream, environ={})
    log = get_logger()
    log.info("routine")
    log.warning("action.signal")
    configure_logging(fmt="logfmt", level="debug", stream=stream, environ={})
    log.debug("detail")
    events = [parse_logfmt(line)["event"] for line in stream.getvalue().splitlines()]
    assert events == ["action.signal", "detail"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"fmt": "xml"}, "unknown log format"), ({"level": "loud"}, "unknown log level")],
)
def test_unknown_format_or_level_is_a_value_error(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        configure_logging(
            fmt=kwargs.get("fmt", "auto"), level=kwargs.get("level", "info"), stream=io.StringIO()
        )


def test_a_closed_stream_does_not_raise() -> None:
    stream = io.StringIO()
    configure_logging(fmt="logfmt", stream=stream, environ={})
    stream.close()
    get_logger().critical("nvml.wedged", gpu="GPU-1")


class BrokenPipe(io.StringIO):
    def write(self, _text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_broken_pipe_does_not_raise() -> None:
    configure_logging(fmt="json", stream=BrokenPipe(), environ={})
    get_logger().warning("action.signal", pid=1)


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no str for you")

    __repr__ = __str__


@pytest.mark.parametrize("fmt", ["logfmt", "json", "console"])
def test_a_value_that_cannot_be_rendered_gives_a_fallback_line_not_an_exception(
    fmt: str,
) -> None:
    (line,) = emit("error", fmt=fmt, env=JOURNAL, thing=Unprintable())
    assert line.startswith("<3>")
    assert 'event="test.event"' in line
    assert "log_error=" in line


@pytest.mark.parametrize(
    ("stream", "env", "expect"),
    [
        (io.StringIO(), JOURNAL, "journald"),
        (Terminal(), JOURNAL, "journald"),
        (Terminal(), {}, "console"),
        (io.StringIO(), {}, "logfmt"),
    ],
    ids=["journald", "journald-tty", "tty", "pipe"],
)
def test_auto_format_picks_journald_then_console_then_logfmt(
    stream: io.StringIO, env: dict[str, str], expect: str
) -> None:
    configure_logging(fmt="auto", stream=stream, environ=env)
    get_logger().info("daemon.start", interval=5)
    (line,) = stream.getvalue().splitlines()
    if expect == "journald":
        assert line == "<6>level=info event=daemon.start interval=5"
    elif expect == "console":
        assert "daemon.start" in line
        assert "event=" not in line
        assert "\x1b[" in line  # coloured on a terminal
    else:
        assert re.match(r"timestamp=\S+ level=info event=daemon\.start interval=5$", line)


def test_console_on_a_terminal_honours_no_color() -> None:
    stream = Terminal()
    configure_logging(fmt="console", stream=stream, environ={"NO_COLOR": "1"})
    get_logger().info("daemon.start")
    assert "\x1b[" not in stream.getvalue()


def test_journal_stream_must_match_the_stream_when_it_has_a_file(tmp_path: Path) -> None:
    with (tmp_path / "log").open("w") as stream:
        status = os.fstat(stream.fileno())
        matching = {"JOURNAL_STREAM": f"{status.st_dev}:{status.st_ino}"}
        other = {"JOURNAL_STREAM": f"{status.st_dev}:{status.st_ino + 1}"}
        assert under_journald(stream, matching)
        assert not under_journald(stream, other)  # inherited by a redirected child
        assert not under_journald(stream, {})
        assert not under_journald(stream, {"JOURNAL_STREAM": ""})


def test_get_logger_binds_its_name_and_fields() -> None:
    configure_logging(fmt="logfmt", stream=io.StringIO(), environ={})
    with capture_logs() as logs:
        get_logger("gpuwatchd.act", gpu="GPU-1").warning("action.signal", pid=5, signal="TERM")
    assert logs == [
        {
            "logger": "gpuwatchd.act",
            "gpu": "GPU-1",
            "pid": 5,
            "signal": "TERM",
            "event": "action.signal",
            "log_level": "warning",
        }
    ]
