"""Log setup: journald priority prefixes, one line per event, formats, native journal entries
with their fields (a fake journal socket), and never raising."""

from __future__ import annotations

import array
import fcntl
import io
import json
import os
import re
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from gpuwatchd.core.vocabulary import EventName, SignalOutcome
from gpuwatchd.events import logs
from gpuwatchd.events.catalogue import journal_field_name, message_id, render
from gpuwatchd.events.logs import configure_logging, priority_prefix, under_journald

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
    getattr(structlog.get_logger(), method)("test.event", **fields)
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
    {
        "debug": "<7>",
        "info": "<6>",
        "warning": "<4>",
        "warn": "<4>",
        "error": "<3>",
        "exception": "<3>",
        "critical": "<2>",
        "CRITICAL": "<2>",
        "no-such-level": "<6>",
    }.items(),
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
    assert "memory" not in fields  # unknown is left out, never an empty ``memory=``


def test_logfmt_escapes_control_characters_so_an_event_stays_one_line() -> None:
    hostile = 'evil\nlevel=critical event="forged" \\ \x1b[2J'
    (line,) = emit("info", cmdline=hostile, tab="a\tb", empty="")
    assert 'cmdline="evil\\nlevel=critical event=\\"forged\\" \\\\ \\x1b[2J"' in line
    assert "\t" not in line
    assert "\x1b" not in line
    fields = parse_logfmt(line)
    assert fields["cmdline"] == hostile
    assert fields["tab"] == "a\tb"
    assert "empty" not in fields
    assert fields["level"] == "info"


def test_exceptions_are_flattened_into_fields_on_one_line() -> None:
    stream = io.StringIO()
    configure_logging(fmt="logfmt", stream=stream, environ=JOURNAL)
    log = structlog.get_logger()
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
        structlog.get_logger().error(EventName.RESET_FAILED, exc_info=error)
    (line,) = stream.getvalue().splitlines()
    assert "RuntimeError: boom" in line


def test_level_filters_out_lower_events_and_a_reconfigure_changes_it() -> None:
    stream = io.StringIO()
    configure_logging(fmt="logfmt", level="warning", stream=stream, environ={})
    log = structlog.get_logger()
    log.info("routine")
    log.warning(EventName.ACTION_SIGNAL)
    configure_logging(fmt="logfmt", level="debug", stream=stream, environ={})
    log.debug("detail")
    events = [parse_logfmt(line)["event"] for line in stream.getvalue().splitlines()]
    assert events == [EventName.ACTION_SIGNAL, "detail"]


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
    structlog.get_logger().critical(EventName.NVML_WEDGED, gpu="GPU-1")


class BrokenPipe(io.StringIO):
    def write(self, _text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_broken_pipe_does_not_raise() -> None:
    configure_logging(fmt="json", stream=BrokenPipe(), environ={})
    structlog.get_logger().warning(EventName.ACTION_SIGNAL, pid=1)


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
    ("make_stream", "env", "expect"),
    [
        (io.StringIO, JOURNAL, "journald"),
        (Terminal, JOURNAL, "journald"),
        (Terminal, {}, "console"),
        (io.StringIO, {}, "logfmt"),
    ],
    ids=["journald", "journald-tty", "tty", "pipe"],
)
def test_auto_format_picks_journald_then_console_then_logfmt(
    make_stream: Callable[[], io.StringIO], env: dict[str, str], expect: str
) -> None:
    stream = make_stream()  # a new stream per run: a shared one keeps the last run's lines
    configure_logging(fmt="auto", stream=stream, environ=env)
    structlog.get_logger().info(EventName.DAEMON_START, interval=5)
    (line,) = stream.getvalue().splitlines()
    if expect == "journald":
        assert line == "<6>level=info event=daemon.start interval=5"
    elif expect == "console":
        assert EventName.DAEMON_START in line
        assert "event=" not in line
        assert "\x1b[" in line  # coloured on a terminal
    else:
        assert re.match(r"timestamp=\S+ level=info event=daemon\.start interval=5$", line)


def test_console_on_a_terminal_honours_no_color() -> None:
    stream = Terminal()
    configure_logging(fmt="console", stream=stream, environ={"NO_COLOR": "1"})
    structlog.get_logger().info(EventName.DAEMON_START)
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


def test_a_bound_logger_name_and_fields_go_out_with_the_event() -> None:
    configure_logging(fmt="logfmt", stream=io.StringIO(), environ={})
    with capture_logs() as logs:
        structlog.get_logger().bind(logger="gpuwatchd.act", gpu="GPU-1").warning(
            EventName.ACTION_SIGNAL, pid=5, signal="TERM"
        )
    assert logs == [
        {
            "logger": "gpuwatchd.act",
            "gpu": "GPU-1",
            "pid": 5,
            "signal": "TERM",
            "event": EventName.ACTION_SIGNAL,
            "log_level": "warning",
        }
    ]


# --- native journal fields ----------------------------------------------------------------

EVENTS_DOC = Path(__file__).resolve().parents[2] / "docs" / "events.md"
NAME = re.compile(rb"[A-Z][A-Z0-9_]{0,63}")


def documented_message_ids() -> dict[str, str]:
    """docs/events.md's MESSAGE_ID table: event name → id."""
    rows = re.findall(
        r"^\| `([a-z0-9_]+\.[a-z0-9_]+)` \| `([0-9a-f]{32})` \|", EVENTS_DOC.read_text(), re.M
    )
    return dict(rows)


class Entry(dict[str, bytes]):
    """One native entry: field → raw value, and the fields sent in the binary-length form."""

    binary: set[str]
    memfd: bool = False

    def text(self, name: str) -> str:
        return self[name].decode()


def parse_native(data: bytes) -> Entry:
    """A strict reader of journald's native format: ``NAME=value\\n`` or ``NAME\\n`` + le64
    length + value + ``\\n``; names valid for the journal, none trusted, none twice."""
    entry = Entry()
    entry.binary = set()
    pos = 0
    while pos < len(data):
        end = data.index(b"\n", pos)
        line = data[pos:end]
        if b"=" in line:
            name, _, value = line.partition(b"=")
            pos = end + 1
        else:
            name = line
            (size,) = struct.unpack("<Q", data[end + 1 : end + 9])
            value = data[end + 9 : end + 9 + size]
            assert data[end + 9 + size : end + 10 + size] == b"\n"
            pos = end + 10 + size
            entry.binary.add(name.decode())
        assert NAME.fullmatch(name), name
        assert name.decode() not in entry, f"{name!r} sent twice"
        entry[name.decode()] = value
    return entry


class FakeJournal:
    """A datagram socket standing in for /run/systemd/journal/socket, and a log file whose
    device and inode JOURNAL_STREAM names, as systemd sets it up for a service."""

    def __init__(self, folder: Path, tmp_path: Path) -> None:
        self.path = str(folder / "socket")
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(self.path)
        self.socket.settimeout(5)
        self.stream = (tmp_path / "stderr").open("w+")
        status = os.fstat(self.stream.fileno())
        self.environ = {"JOURNAL_STREAM": f"{status.st_dev}:{status.st_ino}"}

    def configure(self, *, fmt: str = "logfmt", socket_path: str | None = "") -> None:
        configure_logging(
            fmt=fmt,
            level="debug",
            stream=self.stream,
            environ=self.environ,
            journal_socket=self.path if socket_path == "" else socket_path,
        )

    def receive(self) -> Entry:
        """The next entry: a datagram, or an empty one carrying a sealed memfd."""
        data, ancillary, _flags, _addr = self.socket.recvmsg(1 << 20, socket.CMSG_SPACE(4))
        if not ancillary:
            return parse_native(data)
        assert data == b""
        ((level, kind, fd_bytes),) = ancillary
        assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
        fd = array.array("i", fd_bytes[:4])[0]
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            wanted = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
            assert seals & wanted == wanted
            with os.fdopen(os.dup(fd), "rb") as memfd:
                memfd.seek(0)
                entry = parse_native(memfd.read())
            entry.memfd = True
            return entry
        finally:
            os.close(fd)

    def nothing_received(self) -> bool:
        self.socket.setblocking(False)
        try:
            self.socket.recv(1 << 20)
        except BlockingIOError:
            return True
        finally:
            self.socket.settimeout(5)
        return False

    def lines(self) -> list[str]:
        self.stream.flush()
        return (Path(self.stream.name)).read_text().splitlines()

    def close(self) -> None:
        self.socket.close()
        self.stream.close()


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[FakeJournal]:
    # tmp_path may be longer than a socket address allows (108 bytes): bind in a short folder.
    with tempfile.TemporaryDirectory(prefix="gwj") as folder:
        fake = FakeJournal(Path(folder), tmp_path)
        yield fake
        fake.close()


SIGNAL_FIELDS: dict[str, object] = {
    "pid": 4242,
    "start_ticks": 987654,
    "signal": "SIGTERM",
    "gpu": "GPU-5a1e7e6c-0000-4000-8000-000000000001",
    "rule": "orphans",
    "step": 1,
    "dry_run": False,
    "outcome": SignalOutcome.DELIVERED,
    "detail": None,
    "comm": "python",
    "cmdline": "python train.py --epochs 3",
    "user": "alice",
}


def test_under_the_journal_an_event_is_one_native_entry_with_its_fields(
    journal: FakeJournal,
) -> None:
    journal.configure()
    structlog.get_logger().warning(EventName.ACTION_SIGNAL, **SIGNAL_FIELDS)
    entry = journal.receive()
    assert entry.text("PRIORITY") == "4"
    assert entry.text("SYSLOG_IDENTIFIER") == "gpuwatchd"
    assert entry.text("MESSAGE").startswith(
        "Sent SIGTERM to PID 4242 (python) on GPU-5a1e7e6c-0000-4000-8000-000000000001"
        " (rule orphans, step 1). event=action.signal pid=4242 "
    )
    assert entry.text("MESSAGE_ID") == documented_message_ids()[EventName.ACTION_SIGNAL]
    assert entry.text("MESSAGE_ID") == message_id(EventName.ACTION_SIGNAL)
    assert entry.text("GPUWATCHD_EVENT") == EventName.ACTION_SIGNAL
    assert entry.text("GPU_UUID") == "GPU-5a1e7e6c-0000-4000-8000-000000000001"
    assert entry.text("TARGET_PID") == "4242"
    assert entry.text("DRY_RUN") == "false"
    assert entry.text("OUTCOME") == "delivered"
    assert entry.text("SIGNAL") == "SIGTERM"
    assert entry.text("RULE") == "orphans"
    assert entry.text("GPUWATCHD_STEP") == "1"
    assert entry.text("GPUWATCHD_START_TICKS") == "987654"
    assert entry.text("GPUWATCHD_CMDLINE") == "python train.py --epochs 3"
    assert "GPUWATCHD_DETAIL" not in entry  # None is omitted
    assert not set(entry) & {"GPUWATCHD_LEVEL", "GPUWATCHD_TIMESTAMP", "LEVEL", "EVENT"}
    assert journal.lines() == []  # nothing on stderr


@pytest.mark.parametrize(
    ("method", "priority"),
    [
        ("debug", "7"),
        ("info", "6"),
        ("warning", "4"),
        ("error", "3"),
        ("exception", "3"),
        ("critical", "2"),
    ],
)
def test_native_priority_follows_the_level(
    journal: FakeJournal, method: str, priority: str
) -> None:
    journal.configure()
    getattr(structlog.get_logger(), method)("test.event")
    entry = journal.receive()
    assert entry.text("PRIORITY") == priority
    assert entry.text("MESSAGE") == "test.event. event=test.event"


def test_finding_fields_and_values_have_stable_names_and_plain_text(
    journal: FakeJournal,
) -> None:
    journal.configure()
    structlog.get_logger().bind(logger="gpuwatchd.plan").warning(
        EventName.FINDING_NEW,
        finding="orphaned:GPU-1:77@12",
        kind="orphaned",
        gpu="GPU-1",
        pid=77,
        memory=3 * 1024**3,
        reason="its parent 76 exited",
        actionable=True,
        evidence={"dead_owner": 76, "via": ["fd", "map"]},
        via=("fd", "map"),
        roles={"worker"},
        ratio=0.5,
    )
    entry = journal.receive()
    assert entry.text("MESSAGE").startswith(
        "New orphaned finding on GPU-1, PID 77: its parent 76 exited. event=finding.new "
    )
    assert entry.text("FINDING") == "orphaned:GPU-1:77@12"
    assert entry.text("FINDING_KIND") == "orphaned"
    assert entry.text("GPUWATCHD_MEMORY") == str(3 * 1024**3)
    assert entry.text("GPUWATCHD_ACTIONABLE") == "true"
    assert json.loads(entry["GPUWATCHD_EVIDENCE"]) == {"dead_owner": 76, "via": ["fd", "map"]}
    assert entry.text("GPUWATCHD_VIA") == '["fd","map"]'
    assert entry.text("GPUWATCHD_ROLES") == '["worker"]'
    assert entry.text("GPUWATCHD_RATIO") == "0.5"
    assert entry.text("GPUWATCHD_LOGGER") == "gpuwatchd.plan"
    assert entry.text("MESSAGE_ID") == documented_message_ids()[EventName.FINDING_NEW]


def test_hostile_values_arrive_intact_in_their_field_while_message_stays_one_line(
    journal: FakeJournal,
) -> None:
    journal.configure()
    hostile = "evil\nPRIORITY=0\nMESSAGE_ID=00000000000000000000000000000000\r\x1b[2J\u2028end"
    structlog.get_logger().warning(EventName.ACTION_SIGNAL, **{**SIGNAL_FIELDS, "cmdline": hostile})
    entry = journal.receive()
    assert entry["GPUWATCHD_CMDLINE"].decode() == hostile
    assert "GPUWATCHD_CMDLINE" in entry.binary  # the length form: no field can be forged
    assert entry.text("PRIORITY") == "4"
    assert entry.text("MESSAGE_ID") == message_id(EventName.ACTION_SIGNAL)
    message = entry.text("MESSAGE")
    assert message.isprintable()
    assert "MESSAGE" not in entry.binary
    assert 'cmdline="evil\\nPRIORITY=0\\n' in message


def test_an_undecodable_byte_comes_back_as_the_byte_it_was(journal: FakeJournal) -> None:
    journal.configure()
    raw = b"python \xff\xfe train.py"
    structlog.get_logger().info("test.event", cmdline=raw.decode("utf-8", "surrogateescape"))
    assert journal.receive()["GPUWATCHD_CMDLINE"] == raw


def test_field_names_are_sanitised_unique_and_never_trusted(journal: FakeJournal) -> None:
    journal.configure()
    fields: dict[str, object] = {
        "_pid": 1,
        "a-b": "dash",
        "a.b": "dot",
        "9lives": "digit",
        "caf\u00e9": "accent",
        "x" * 100: "long",
        "message": "mine",
        "priority": "mine too",
    }
    structlog.get_logger().info("test.event", **fields)
    entry = journal.receive()
    assert entry.text("GPUWATCHD__PID") == "1"
    assert {entry.text("GPUWATCHD_A_B"), entry.text("GPUWATCHD_A_B_2")} == {"dash", "dot"}
    assert entry.text("GPUWATCHD_9LIVES") == "digit"
    assert entry.text("GPUWATCHD_CAF_") == "accent"
    assert entry.text(("GPUWATCHD_" + "X" * 100)[:64]) == "long"
    assert entry.text("GPUWATCHD_MESSAGE") == "mine"
    assert entry.text("GPUWATCHD_PRIORITY") == "mine too"
    assert entry.text("PRIORITY") == "6"
    assert all(not name.startswith("_") and len(name) <= 64 for name in entry)


JOURNAL_FIELDS = {  # a log key and the journal field it is sent as
    "gpu": "GPU_UUID",
    "pid": "TARGET_PID",
    "rule": "RULE",
    "dry_run": "DRY_RUN",
    "outcome": "OUTCOME",
    "signal": "SIGNAL",
    "kind": "FINDING_KIND",
    "finding": "FINDING",
    "start_ticks": "GPUWATCHD_START_TICKS",
    "pci_bus_id": "GPUWATCHD_PCI_BUS_ID",
}


@pytest.mark.parametrize(("key", "name"), JOURNAL_FIELDS.items())
def test_journal_field_names(key: str, name: str) -> None:
    assert journal_field_name(key) == name


def test_message_ids_are_fixed_128_bit_ids_one_per_event() -> None:
    ids = {message_id(event) for event in EventName}
    assert len(ids) == len(EventName)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert message_id(EventName.ACTION_SIGNAL) == message_id("action.signal")
    assert message_id("action.signal") == "b60b3117d5645106a245dd7238df685c"  # never changes


@pytest.mark.parametrize(
    ("event", "fields", "said"),
    [
        (EventName.ACTION_SIGNAL, SIGNAL_FIELDS, "Sent SIGTERM to PID 4242 (python) on GPU-"),
        (
            EventName.ACTION_SIGNAL,
            {**SIGNAL_FIELDS, "outcome": "dry_run", "dry_run": True},
            "Dry run: would send SIGTERM to PID 4242 (python)",
        ),
        (
            EventName.ACTION_SIGNAL,
            {**SIGNAL_FIELDS, "outcome": "denied"},
            "Sending SIGTERM to PID 4242 (python) on GPU-5a1e7e6c-0000-4000-8000-000000000001"
            " was denied",
        ),
        (
            EventName.ACTION_SIGNAL,
            {**SIGNAL_FIELDS, "outcome": "gone"},
            "SIGTERM not sent: PID 4242 (python)",
        ),
        (
            EventName.HOOK_RUN,
            {"hook": "on_failure", "argv": ["/bin/drain", "GPU-1"], "returncode": 0},
            "Ran the on_failure hook /bin/drain GPU-1: exit status 0.",
        ),
        (
            EventName.HOOK_RUN,
            {"hook": "on_failure", "argv": ["/bin/drain"], "dry_run": True},
            "Dry run: would run the on_failure hook /bin/drain.",
        ),
        (EventName.RESET_OUTCOME, {"gpu": "GPU-1", "result": "success"}, "GPU-1 was reset."),
        (
            EventName.RESET_OUTCOME,
            {"gpu": "GPU-1", "result": "failed", "step": "reset", "reason": "exit 3"},
            "Reset of GPU-1 failed at step reset: exit 3.",
        ),
        (
            EventName.RESET_OUTCOME,
            {"gpu": "GPU-1", "result": "failed", "step": "reset", "needs_reboot": True},
            "GPU-1 needs a reboot",
        ),
        (
            EventName.ESCALATION_STEP_DUE,
            {"pid": 7, "gpu": "GPU-1", "rule": "orphans", "step": 2, "of": 2, "signal": "SIGKILL"},
            "Step 2 of 2 of rule orphans is due for PID 7 on GPU-1: SIGKILL.",
        ),
        (
            EventName.TARGET_STUCK,
            {"pid": 7, "gpu": "GPU-1", "why": "D state for 60s"},
            "PID 7 on GPU-1 is stuck in D state",
        ),
        (EventName.GPU_NEEDS_REBOOT, {"gpu": "GPU-1", "why": "lost"}, "GPU-1 needs a reboot"),
        (EventName.LIMITS_KILL_CAP_REACHED, {"why": "5 per hour"}, "Kill cap reached"),
        (EventName.RESET_CIRCUIT_OPEN, {"why": "2 failed"}, "No more GPU resets"),
        (EventName.DAEMON_START, {"version": "1.0", "dry_run": True}, "gpuwatchd 1.0 started in"),
        (EventName.DAEMON_STOP, {"exit_code": 0}, "gpuwatchd stopped (exit code 0)."),
        (EventName.CONFIG_RELOAD_REJECTED, {"error": "bad"}, "Reload rejected, the old policy"),
        (EventName.FINDING_RESOLVED, {"finding": "k"}, "Finding resolved: k."),
        (
            EventName.FINDING_RESOLVED,
            {"finding": "orphaned:GPU-1:77@12", "lasted": 30},
            "Finding resolved after 30s: orphaned PID 77 on GPU-1.",
        ),
        (EventName.RESET_REFUSED, {"gpu": "GPU-1", "why": "cooldown"}, "No reset of GPU-1"),
        (
            EventName.RESET_STEP,
            {"gpu": "GPU-1", "step": "final_scan", "status": "clear"},
            "Reset of GPU-1, step 6/11 final_scan: no other process holds the GPU.",
        ),
        (EventName.TARGET_EXITED, {"pid": 7}, "PID 7 exited (seen through its pidfd)."),
        ("test.event", {"reason": "x\ny"}, "test.event: x\\ny."),
    ],
)
def test_each_message_starts_with_a_sentence(
    event: str, fields: dict[str, object], said: str
) -> None:
    assert render(str(event), fields).startswith(said)


@pytest.mark.parametrize("event", list(EventName))
def test_every_event_has_a_one_line_sentence_even_without_fields(event: EventName) -> None:
    for fields in ({}, {"pid": Unprintable(), "why": "a\nb", "gpu": "\x1b[2J"}):
        said = render(str(event), fields)
        assert said
        assert said.isprintable()


def test_without_the_socket_the_event_is_the_prefixed_line_on_stderr(
    journal: FakeJournal,
) -> None:
    journal.configure(socket_path=journal.path + ".absent")
    structlog.get_logger().warning(EventName.ACTION_SIGNAL, **SIGNAL_FIELDS)
    (line,) = journal.lines()
    assert line.startswith("<4>level=warning event=action.signal ")
    assert parse_logfmt(line[3:])["pid"] == "4242"


@pytest.mark.parametrize("target", ["file", "folder", "dead"])
def test_an_unusable_socket_path_falls_back_without_raising(
    journal: FakeJournal, tmp_path: Path, target: str
) -> None:
    path = tmp_path / "not-a-socket"
    if target == "file":
        path.write_text("")
    elif target == "folder":
        path.mkdir()
    else:  # a socket nobody listens on any more, as after a journald crash
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        path = Path(os.path.dirname(journal.path)) / "dead"
        dead.bind(str(path))
        dead.close()
    journal.configure(socket_path=str(path))
    structlog.get_logger().error("test.event", n=1)
    structlog.get_logger().info("test.event", n=2)
    assert [line[:3] for line in journal.lines()] == ["<3>", "<6>"]


def test_an_entry_too_big_for_a_datagram_goes_in_a_sealed_memfd(journal: FakeJournal) -> None:
    journal.configure()
    big = "x" * (1 << 20) + "\nend"  # over any default socket send buffer
    structlog.get_logger().warning("test.event", output=big, gpu="GPU-1")
    entry = journal.receive()
    assert entry.memfd
    assert entry["GPUWATCHD_OUTPUT"].decode() == big
    assert entry.text("GPU_UUID") == "GPU-1"
    assert journal.lines() == []


def test_a_stalled_journal_costs_one_timeout_then_lines_go_to_stderr(
    journal: FakeJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logs._JournalSocket, "SEND_TIMEOUT", 0.05)
    journal.configure()
    log = structlog.get_logger()
    sent = 0
    while not journal.lines():  # nobody reads: the socket's queue fills, then a send times out
        log.info("test.event", n=sent)
        sent += 1
        assert sent < 10_000
    start = time.monotonic()
    log.warning("test.event", n="after")
    assert time.monotonic() - start < 0.05  # straight to stderr during the backoff
    assert journal.lines()[-1].startswith("<4>level=warning event=test.event n=after")


def test_native_needs_journal_stream_to_name_the_stream_itself(journal: FakeJournal) -> None:
    # No file to check (a wrapper): the variable is trusted for the prefix, not for the socket.
    stream = io.StringIO()
    configure_logging(stream=stream, environ=JOURNAL, journal_socket=journal.path)
    structlog.get_logger().info(EventName.DAEMON_START)
    assert stream.getvalue() == "<6>level=info event=daemon.start\n"
    # Inherited by a child whose stderr goes elsewhere: neither.
    other = {"JOURNAL_STREAM": journal.environ["JOURNAL_STREAM"] + "1"}
    configure_logging(stream=journal.stream, environ=other, journal_socket=journal.path)
    structlog.get_logger().info(EventName.DAEMON_START)
    assert re.match(r"timestamp=\S+ level=info event=daemon\.start$", journal.lines()[-1])
    # Turned off by the caller.
    journal.configure(socket_path=None)
    structlog.get_logger().info(EventName.DAEMON_START)
    assert journal.lines()[-1] == "<6>level=info event=daemon.start"
    assert journal.nothing_received()


@pytest.mark.parametrize("fmt", ["logfmt", "json", "console", "auto"])
def test_native_entries_do_not_depend_on_the_format_but_the_fallback_does(
    journal: FakeJournal, fmt: str
) -> None:
    journal.configure(fmt=fmt)
    structlog.get_logger().info(EventName.DAEMON_STOP, exit_code=0)
    entry = journal.receive()
    assert entry.text("MESSAGE") == "gpuwatchd stopped (exit code 0). event=daemon.stop exit_code=0"
    journal.configure(fmt=fmt, socket_path=journal.path + ".absent")
    structlog.get_logger().info(EventName.DAEMON_STOP, exit_code=0)
    (line,) = journal.lines()
    assert line.startswith("<6>")
    if fmt == "json":
        assert json.loads(line[3:]) == {
            "level": "info",
            "event": EventName.DAEMON_STOP,
            "exit_code": 0,
        }


def test_an_unrenderable_value_under_the_journal_never_raises(journal: FakeJournal) -> None:
    journal.configure()
    structlog.get_logger().error("test.event", thing=Unprintable())
    (line,) = journal.lines()
    assert line.startswith("<3>")
    assert "log_error=" in line
    # The next event is fine again.
    structlog.get_logger().info("test.event")
    assert journal.receive().text("PRIORITY") == "6"


def test_exceptions_under_the_journal_keep_their_trace_in_fields(journal: FakeJournal) -> None:
    journal.configure()
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        structlog.get_logger().exception("poll.failed")
    entry = journal.receive()
    assert entry.text("PRIORITY") == "3"
    assert entry["GPUWATCHD_EXC"] == b"ValueError: bad\nvalue"
    assert "test_logs.py:" in entry.text("GPUWATCHD_EXC_TRACE")
    assert entry.text("MESSAGE").isprintable()


def test_events_from_threads_each_arrive_whole(journal: FakeJournal) -> None:
    journal.configure()
    log = structlog.get_logger()

    def speak(n: int) -> None:
        log.info("test.event", n=n, text="y" * 5000)

    threads = [threading.Thread(target=speak, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    received = sorted(int(journal.receive().text("GPUWATCHD_N")) for _ in threads)
    for thread in threads:
        thread.join()
    assert received == list(range(8))
    assert journal.lines() == []


@pytest.mark.parametrize(
    ("value", "shown"),
    [(0.123456789, "0.123"), (12.5, "12.5"), (3.0, "3"), (0.0000123456, "1.23e-05"), (-0.0, "0")],
)
def test_floats_are_rounded_for_people(value: float, shown: str) -> None:
    (line,) = emit("info", lasted=value)
    assert parse_logfmt(line)["lasted"] == shown


def test_the_journal_message_has_no_none_no_empty_field_and_no_long_float() -> None:
    entry = logs.journal_entry(
        "warning",
        {
            "event": EventName.FINDING_RESOLVED,
            "finding": "dead_process:GPU-1:4",
            "lasted": 65.123456789,
            "memory": None,
            "cmdline": "",
            "pid": 4,
        },
    )
    message = next(line for line in entry.decode().splitlines() if line.startswith("MESSAGE="))
    tail = message.split(" event=", 1)[1]
    assert "None" not in message
    assert "memory=" not in tail
    assert "cmdline=" not in tail
    assert "lasted=65.123 " in tail + " "
    assert "65.123456789" not in entry.decode()
