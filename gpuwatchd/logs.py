"""structlog setup: one event per line, for journald, for log shippers and for people.

This module owns how log events are rendered and written. It decides nothing about *what* is
logged or at which level: callers choose both. It must never raise into its caller — a closed
or broken stdout/stderr (``gpuwatchd scan | head``, a journald restart) must not take the
daemon down — and it must keep working with structlog 22.1 (Debian's) up to 26.x, so it uses
only APIs that 22.1 already had.

Formats (``configure_logging(fmt=...)``):

- ``logfmt``: ``timestamp=… level=warning event=action.signal gpu=GPU-… pid=1234 …``
- ``json``: one JSON object per line.
- ``console``: structlog's aligned console view, coloured on a terminal (``NO_COLOR`` honoured).
- ``auto``: logfmt under journald, console on a terminal, logfmt otherwise.

Under journald (``JOURNAL_STREAM`` set and naming our stream) every line starts with the
sd-daemon priority prefix ``<N>`` — ``<7>`` debug, ``<6>`` info, ``<4>`` warning, ``<3>`` error,
``<2>`` critical — which journald turns into the entry's PRIORITY, and no timestamp is written
(journald records its own). Elsewhere timestamps are ISO-8601 UTC. Every event is exactly one
line: exceptions are flattened into ``exception`` and ``traceback`` fields, and control
characters in values (a hostile command line) are escaped.

Event names form one catalogue, ``area.what``, lower case with underscores inside a part::

    daemon.start, daemon.stop, daemon.ready         config.loaded, config.rejected
    poll.done, poll.slow                            nvml.unavailable, nvml.wedged, nvml.recovered
    finding.new, finding.changed, finding.resolved  action.signal, action.skipped, action.failed
    reset.step, reset.done, reset.failed            hook.run, hook.failed
    limit.kill_cap                                  state.saved, state.corrupt

The area says which part of gpuwatchd speaks; the name after the dot says what happened. The
fields carry the inputs that justified a decision, with the same names everywhere: ``gpu``
(UUID), ``pid``, ``start_ticks``, ``user``, ``cmdline``, ``job``, ``memory`` (bytes), ``kind``,
``rule``, ``step``, ``dry_run``, ``outcome``, ``reason``. Levels follow docs/events.md: actions are
warning, failed actions error, a wedged driver or "needs reboot" critical, routine info/debug.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import traceback
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

import structlog

from gpuwatchd.escape import escape

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger, Processor, WrappedLogger

FORMATS = ("auto", "logfmt", "json", "console")
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
# sd-daemon(3) priorities, keyed by structlog method name (exception logs at error).
_PRIORITIES = {
    "debug": 7,
    "info": 6,
    "msg": 6,
    "log": 6,
    "warning": 4,
    "warn": 4,
    "error": 3,
    "err": 3,
    "exception": 3,
    "critical": 2,
    "fatal": 2,
}
_TRACEBACK_FRAMES = 6


def priority_prefix(level: str) -> str:
    """The sd-daemon prefix for a level or method name: ``"<4>"`` for warning; info if unknown."""
    return f"<{_PRIORITIES.get(level.lower(), 6)}>"


def configure_logging(
    *,
    fmt: str = "auto",
    level: str = "info",
    stream: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Set up structlog for the whole process. Safe to call again (a reload changes the level).

    ``stream`` defaults to ``sys.stderr`` (where systemd connects journald); ``environ``
    defaults to ``os.environ``. Raises ValueError for an unknown ``fmt`` or ``level`` — a
    configuration error, reported before anything runs.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    min_level = LEVELS.get(level.lower())
    if min_level is None:
        choices = ", ".join(name for name in LEVELS if name != "warn")
        raise ValueError(f"unknown log level {level!r}: expected one of {choices}")
    out = sys.stderr if stream is None else stream
    env = os.environ if environ is None else environ
    journald = under_journald(out, env)
    tty = _isatty(out)
    if fmt == "auto":
        fmt = "console" if tty and not journald else "logfmt"

    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _flatten_exception,
    ]
    if not journald:
        processors.append(structlog.processors.TimeStamper(fmt="iso", utc=True))
    renderer: Processor
    if fmt == "json":
        processors.append(_leading_keys)
        renderer = structlog.processors.JSONRenderer(default=_json_default)
    elif fmt == "console":
        colors = tty and not journald and "NO_COLOR" not in env
        processors.append(_escape_control_characters)
        renderer = structlog.dev.ConsoleRenderer(colors=colors)
    else:
        processors.append(_compact_values)
        renderer = _render_logfmt
    processors.append(renderer)

    structlog.configure(
        processors=[_SafeChain(processors, journald=journald)],
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        logger_factory=_LineWriterFactory(out),
        context_class=dict,
        cache_logger_on_first_use=False,
    )


def get_logger(name: str | None = None, **initial: object) -> FilteringBoundLogger:
    """A logger bound to ``name`` (as the ``logger`` field) and any initial fields."""
    logger: FilteringBoundLogger = structlog.get_logger()
    if name is not None:
        initial = {"logger": name, **initial}
    return logger.bind(**initial) if initial else logger


def under_journald(stream: TextIO, environ: Mapping[str, str]) -> bool:
    """Whether ``stream`` is connected to journald, per ``JOURNAL_STREAM`` (systemd.exec(5)).

    The variable names the device and inode of the journal stream; a child whose stderr was
    redirected inherits it, so when the stream's own numbers can be read they must match.
    A stream without a file descriptor (tests, wrappers) trusts the variable.
    """
    value = environ.get("JOURNAL_STREAM", "")
    if not value:
        return False
    try:
        device, inode = (int(part) for part in value.split(":", 1))
        status = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return True
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
    """Turn ``exc_info`` into one-line ``exc`` and ``exc_trace`` fields.

    Not "exception": structlog's console renderer prints that key as a multi-line block.
    """
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
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = escape(value)
    return event_dict


def _leading_keys(
    _logger: WrappedLogger, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """timestamp, level and event first, so JSON lines read like the logfmt ones."""
    ordered = {key: event_dict[key] for key in _LEADING if key in event_dict}
    ordered.update((key, value) for key, value in event_dict.items() if key not in ordered)
    return ordered


_LEADING = ("timestamp", "level", "event")


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
    """``key=value`` pairs, timestamp, level and event first; values quoted when needed.

    Our own renderer rather than structlog's LogfmtRenderer, whose escaping differs between
    the versions we support (22.1 leaves newlines raw, which splits an event over lines; 26.x
    doubles backslashes only inside quotes): the format must not depend on the installed
    structlog. Quoted values escape ``\\``, ``"`` and control characters; None is empty.
    """
    keys = [key for key in _LEADING if key in event_dict]
    keys.extend(key for key in event_dict if key not in _LEADING)
    return " ".join(f"{_logfmt_key(key)}={_logfmt_value(event_dict[key])}" for key in keys)


def _logfmt_key(key: object) -> str:
    text = str(key)
    safe = "".join(c if c.isprintable() and c not in ' ="' else "_" for c in text)
    return safe or "_"


def _logfmt_value(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' ="\\'):
        return text
    escaped = escape(text.replace("\\", "\\\\").replace('"', '\\"'))
    return f'"{escaped}"'


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


class _SafeChain:
    """Runs the real processors; a failure becomes a plain fallback line, never an exception.

    Wrapping the chain in one processor keeps the guarantee independent of which processor
    failed (an unserialisable value, a broken ``__str__``). Under journald it also adds the
    priority prefix to whatever was rendered.
    """

    def __init__(self, processors: Sequence[Processor], *, journald: bool) -> None:
        self._processors = tuple(processors)
        self._journald = journald

    def __call__(
        self, logger: WrappedLogger, method: str, event_dict: MutableMapping[str, Any]
    ) -> str:
        event = event_dict.get("event")
        try:
            result: Any = event_dict
            for processor in self._processors:
                result = processor(logger, method, result)
            line = result if isinstance(result, str) else str(result)
        except structlog.DropEvent:
            raise
        except Exception as exc:  # logging must never raise (module docstring)
            line = _fallback_line(method, event, exc)
        line = line.translate(_NEWLINES)
        return priority_prefix(method) + line if self._journald else line


_NEWLINES = {ord("\n"): "\\n", ord("\r"): "\\r"}


def _fallback_line(method: str, event: object, error: Exception) -> str:
    level = {"warn": "warning", "exception": "error", "err": "error", "fatal": "critical"}.get(
        method, method
    )
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


# --- output -----------------------------------------------------------------------------------


class _LineWriter:
    """Writes each rendered event as one line and flushes; write errors are swallowed.

    A closed stream or a broken pipe loses log lines, which is better than losing the
    daemon. The lock keeps lines from threads whole.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def msg(self, message: str) -> None:
        with self._lock:
            try:
                self._stream.write(message + "\n")
                self._stream.flush()
            except (OSError, ValueError):
                pass

    log = debug = info = warn = warning = err = error = critical = exception = fatal = msg


class _LineWriterFactory:
    def __init__(self, stream: TextIO) -> None:
        self._writer = _LineWriter(stream)

    def __call__(self, *_args: Any) -> _LineWriter:
        return self._writer
