"""structlog setup: how log events are rendered and written, one event per line, for journald,
log shippers and people (never *what* is logged, nor at which level); it never raises.

In detail: docs/internals.md, section `gpuwatchd.events.logs`.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import math
import os
import re
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

import structlog

from gpuwatchd.core.escape import escape
from gpuwatchd.core.vocabulary import Level, level_of
from gpuwatchd.events.catalogue import FIELD_NAME_MAX, journal_field_name, message_id, render

if TYPE_CHECKING:
    from structlog.typing import Processor, WrappedLogger

FORMATS = ("auto", "logfmt", "json", "console")
# Names accepted for log.level (``warn`` too), and their numbers in Python's logging.
LEVELS = {level.value: level.number for level in Level} | {"warn": Level.WARNING.number}
_TRACEBACK_FRAMES = 6
JOURNAL_SOCKET = "/run/systemd/journal/socket"


def _priority(method: str) -> int:
    """The sd-daemon(3) priority of a level or method name (exception: error); info if unknown."""
    return (level_of(method) or Level.INFO).priority


def priority_prefix(level: str) -> str:
    """The sd-daemon prefix for a level or method name: ``"<4>"`` for warning; info if unknown."""
    return f"<{_priority(level)}>"


def configure_logging(
    *,
    fmt: str = "auto",
    level: str = "info",
    stream: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
    journal_socket: str | None = JOURNAL_SOCKET,
) -> None:
    """Set up structlog for the whole process; safe to call again. ``stream`` defaults to
    ``sys.stderr``, ``environ`` to ``os.environ``; ``journal_socket`` None never sends native
    journal entries. ValueError for an unknown ``fmt`` or ``level``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    min_level = LEVELS.get(level.lower())
    if min_level is None:
        choices = ", ".join(name for name in LEVELS if name != "warn")
        raise ValueError(f"unknown log level {level!r}: expected one of {choices}")
    out = sys.stderr if stream is None else stream
    env = os.environ if environ is None else environ
    journald = under_journald(out, env)
    # Native only when the variable is verified: a stream without a file cannot be checked.
    native = journal_socket is not None and _names_stream(out, env) is True
    tty = _isatty(out)
    if fmt == "auto":
        fmt = "console" if tty and not journald else "logfmt"

    prepare: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _flatten_exception,
    ]
    render: list[Processor] = []
    if not journald:
        render.append(structlog.processors.TimeStamper(fmt="iso", utc=True))
    if fmt == "json":
        render += [_leading_keys, structlog.processors.JSONRenderer(default=_json_default)]
    elif fmt == "console":
        colors = tty and not journald and "NO_COLOR" not in env
        render += [_escape_control_characters, structlog.dev.ConsoleRenderer(colors=colors)]
    else:
        render += [_compact_values, _render_logfmt]

    journal = _JournalSocket(journal_socket) if native and journal_socket is not None else None
    writer = _LineWriter(out, journal)
    structlog.configure(
        processors=[_SafeChain(tuple(prepare), tuple(render), journald, journal is not None)],
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        logger_factory=lambda *_args: writer,
        context_class=dict,
        cache_logger_on_first_use=False,
    )


def under_journald(stream: TextIO, environ: Mapping[str, str]) -> bool:
    """Whether ``stream`` is connected to journald, per ``JOURNAL_STREAM`` (systemd.exec(5)):
    the stream's own device and inode must match it where they can be read (a child whose
    stderr was redirected inherits the variable); a stream without a file trusts it."""
    return _names_stream(stream, environ) is not False


def _names_stream(stream: TextIO, environ: Mapping[str, str]) -> bool | None:
    """Whether ``JOURNAL_STREAM`` names ``stream``: None when set but not checkable."""
    value = environ.get("JOURNAL_STREAM", "")
    if not value:
        return False
    try:
        device, inode = (int(part) for part in value.split(":", 1))
        status = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None
    return (status.st_dev, status.st_ino) == (device, inode)


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


# --- processors -------------------------------------------------------------------------------


def _flatten_exception(
    _logger: WrappedLogger, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Turn ``exc_info`` into one-line ``exc`` and ``exc_trace`` fields (not "exception",
    which structlog's console renderer prints as a multi-line block)."""
    exc_info = event_dict.pop("exc_info", None)
    if not exc_info:
        return event_dict
    if isinstance(exc_info, BaseException):
        error: BaseException | None = exc_info
    elif isinstance(exc_info, tuple) and len(exc_info) == 3:
        error = exc_info[1]
    else:
        error = sys.exc_info()[1]
    if error is None:
        return event_dict
    event_dict["exc"] = f"{type(error).__name__}: {_safe_str(error)}"
    frames = traceback.extract_tb(error.__traceback__)[-_TRACEBACK_FRAMES:]
    if frames:
        event_dict["exc_trace"] = " > ".join(
            f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}" for frame in frames
        )
    return event_dict


def _escape_control_characters(
    _logger: WrappedLogger, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Escape newlines and other control characters in string values: one event, one line."""
    return {key: escape(v) if isinstance(v, str) else v for key, v in event_dict.items()}


def _leading_keys(
    _logger: WrappedLogger, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """timestamp, level and event first, so JSON lines read like the logfmt ones."""
    ordered = {key: event_dict[key] for key in ("timestamp", "level", "event") if key in event_dict}
    ordered.update((key, value) for key, value in event_dict.items() if key not in ordered)
    return ordered


def _compact_values(
    _logger: WrappedLogger, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Collections as logfmt-friendly text: ``via=fd,map`` for plain lists, JSON otherwise."""
    for key in list(event_dict):
        value = event_dict[key]
        if isinstance(value, (set, frozenset)):
            value = sorted(value, key=repr)
        if isinstance(value, (list, tuple)) and all(_plain(item) for item in value):
            event_dict[key] = ",".join(str(item) for item in value)
        elif isinstance(value, (list, tuple, dict)):
            event_dict[key] = json.dumps(value, separators=(",", ":"), default=_json_default)
    return event_dict


def _render_logfmt(
    _logger: WrappedLogger, _method: str, event_dict: MutableMapping[str, Any]
) -> str:
    """``key=value`` pairs, timestamp, level and event first; values quoted when needed
    (escaping ``\\``, ``"`` and control characters); a None or empty field is left out.
    Not structlog's LogfmtRenderer: its escaping differs between the versions we support."""
    return " ".join(
        f"{_logfmt_key(key)}={_logfmt_value(value)}"
        for key, value in _leading_keys(_logger, _method, event_dict).items()
        if value is not None and value != ""
    )


def _logfmt_key(key: object) -> str:
    safe = "".join(c if c.isprintable() and c not in ' ="' else "_" for c in str(key))
    return safe or "_"


def _logfmt_value(value: object) -> str:
    text = _scalar(value)  # never None: _render_logfmt leaves a None out
    if text and text.isprintable() and not any(c in text for c in ' ="\\'):
        return text
    escaped = escape(text.replace("\\", "\\\\").replace('"', '\\"'))
    return f'"{escaped}"'


def rounded(value: float) -> str:
    """A float as a person reads it: at most three decimals (``0.125``, ``12.5``, ``3``);
    three significant digits below a thousandth; ``nan``/``inf`` as Python writes them."""
    if not math.isfinite(value):
        return str(value)
    text = f"{value:.3f}".rstrip("0").rstrip(".")
    if text in ("0", "-0") and value != 0:
        return f"{value:.3g}"
    return "0" if text == "-0" else text


def _plain(item: object) -> bool:
    """A list item that can be shown comma-joined without ambiguity."""
    if isinstance(item, bool):
        return True
    if not isinstance(item, (str, int, float)):
        return False
    text = str(item)
    return bool(text) and not any(c in text for c in ', ="\\') and text.isprintable()


def _json_default(value: object) -> object:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return str(value)


@dataclass(frozen=True)
class _SafeChain:
    """Runs the real processors; a failure becomes a plain fallback line, never an exception.
    Under journald it adds the priority prefix; with ``native``, the prepared event also
    becomes a native journal entry, passed to the writer with that line as its fallback."""

    prepare: tuple[Processor, ...]
    render: tuple[Processor, ...]
    journald: bool
    native: bool = False

    def __call__(
        self, logger: WrappedLogger, method: str, event_dict: MutableMapping[str, Any]
    ) -> str | tuple[tuple[_JournalEntry], dict[str, Any]]:
        event = event_dict.get("event")
        entry: bytes | None = None
        try:
            result: Any = event_dict
            for processor in self.prepare:
                result = processor(logger, method, result)
            if self.native:
                entry = journal_entry(method, result)
            for processor in self.render:
                result = processor(logger, method, result)
            line = result if isinstance(result, str) else str(result)
        except structlog.DropEvent:
            raise
        except Exception as exc:  # logging must never raise (module docstring)
            line = _fallback_line(method, event, exc)
        line = line.translate(_NEWLINES)
        if self.journald:
            line = priority_prefix(method) + line
        if entry is None:
            return line
        # structlog passes a returned (args, kwargs) pair to the writer as it is.
        return ((_JournalEntry(entry, line),), {})


_NEWLINES = {ord("\n"): "\\n", ord("\r"): "\\r"}


def _fallback_line(method: str, event: object, error: Exception) -> str:
    level = str(level_of(method) or method)
    try:
        shown = json.dumps(str(event))
    except Exception:  # even str() of the event may fail
        shown = '"?"'
    return (
        f"level={level} event={shown} log_error="
        f"{json.dumps(type(error).__name__ + ': ' + _safe_str(error))}"
    )


def _safe_str(value: object) -> str:
    try:
        return str(value)
    except Exception:  # a broken __str__ must not break logging
        return "?"


# --- native journal entries -------------------------------------------------------------------

SYSLOG_IDENTIFIER = "gpuwatchd"
_NOT_FIELDS = frozenset({"event", "level", "timestamp"})  # said by MESSAGE_ID, PRIORITY, journald
_BINARY = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # control characters but tab: length form


def journal_entry(method: str, event_dict: Mapping[str, Any]) -> bytes:
    """One event in journald's native format (``NAME=value`` lines; the binary form for a
    value with a newline or another control character). ``event_dict`` is not changed."""
    event = _safe_str(event_dict.get("event"))
    rest = {key: value for key, value in event_dict.items() if key not in ("level", "timestamp")}
    logfmt = _render_logfmt(None, method, _compact_values(None, method, rest))
    fields = [
        ("MESSAGE", f"{render(event, event_dict)} {logfmt}".translate(_NEWLINES)),  # sentence first
        ("PRIORITY", str(_priority(method))),
        ("SYSLOG_IDENTIFIER", SYSLOG_IDENTIFIER),
        ("MESSAGE_ID", message_id(event)),
        ("GPUWATCHD_EVENT", event),
    ]
    used = {name for name, _ in fields}
    for key, value in event_dict.items():
        text = None if key in _NOT_FIELDS else _journal_value(value)
        if text is not None:
            fields.append((_unused(journal_field_name(key), used), text))
    out = bytearray()
    for name, text in fields:
        data = _utf8(text)
        if _BINARY.search(data):
            out += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name.encode() + b"=" + data + b"\n"
    return bytes(out)


def _journal_value(value: object) -> str | None:
    """None omitted, booleans ``true``/``false``, collections compact JSON, the rest str()."""
    if value is None:
        return None
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=_json_default)
    return _scalar(value)


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return rounded(value) if isinstance(value, float) else str(value)


def _unused(name: str, used: set[str]) -> str:
    """``name``, or ``name_2``, ``name_3``... when two event fields sanitise alike."""
    candidate, number = name, 2
    while candidate in used:
        suffix = f"_{number}"
        candidate = name[: FIELD_NAME_MAX - len(suffix)] + suffix
        number += 1
    used.add(candidate)
    return candidate


def _utf8(text: str) -> bytes:
    """The bytes a value stood for: undecodable bytes (surrogate escapes) come back as they were."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace")


@dataclass(frozen=True, slots=True)
class _JournalEntry:
    """A native journal entry, and the line to write instead if it cannot be sent."""

    payload: bytes
    line: str


class _JournalSocket:
    """Sends entries to journald's native socket (unconnected: a restarted journald is found
    by its path; a sealed memfd for an entry too big for a datagram); False instead of
    raising. A send blocks at most ``SEND_TIMEOUT``; after a timeout entries go straight to
    the fallback for ``STALL_BACKOFF`` seconds."""

    SEND_TIMEOUT = 1.0
    STALL_BACKOFF = 10.0

    def __init__(self, path: str) -> None:
        self.path = path
        self._socket: socket.socket | None = None
        self._stalled_until = 0.0

    def send(self, payload: bytes) -> bool:
        if time.monotonic() < self._stalled_until:
            return False
        try:
            if self._socket is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                seconds, fraction = divmod(self.SEND_TIMEOUT, 1)
                timeval = struct.pack("@ll", int(seconds), int(fraction * 1_000_000))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
                self._socket = sock
            try:
                self._socket.sendto(payload, self.path)
            except OSError as err:
                if err.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                    raise
                self._send_memfd(self._socket, payload)
        except OSError as err:  # no journal, EPERM, no memfd...: the caller falls back
            if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK):  # SO_SNDTIMEO: journald stalled
                self._stalled_until = time.monotonic() + self.STALL_BACKOFF
            return False
        except Exception:  # logging never raises
            return False
        return True

    def _send_memfd(self, sock: socket.socket, payload: bytes) -> None:
        fd = os.memfd_create("gpuwatchd-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            rights = array.array("i", [fd])
            sock.sendmsg([], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)], 0, self.path)
        finally:
            os.close(fd)


# --- output -----------------------------------------------------------------------------------


class _LineWriter:
    """Writes each rendered event as one line and flushes, whole across threads; write
    errors are swallowed. A native journal entry goes to the journal socket, else its
    fallback line to the stream."""

    def __init__(self, stream: TextIO, journal: _JournalSocket | None = None) -> None:
        self._stream = stream
        self._journal = journal
        self._lock = threading.Lock()

    def msg(self, message: str | _JournalEntry) -> None:
        with self._lock:
            if isinstance(message, _JournalEntry):
                if self._journal is not None and self._journal.send(message.payload):
                    return
                message = message.line
            try:
                self._stream.write(message + "\n")
                self._stream.flush()
            except (OSError, ValueError):
                pass

    log = debug = info = warn = warning = err = error = critical = exception = fatal = msg
