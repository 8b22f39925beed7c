"""Loggers that load structlog only when an event is actually emitted.

This module owns one thing: letting modules on the path of a short read-only command
(``gpuwatchd scan``, ``check-clean``) hold a logger without importing structlog, which costs
tens of milliseconds at start-up (structlog loads asyncio through its stdlib integration).
:func:`get_logger` returns a stand-in with structlog's method names; the first call that is
not dropped imports structlog, runs the set-up deferred with :func:`defer_setup` (if any) and
forwards to ``structlog.get_logger(*args)`` from then on — the same lazy proxy a module-level
``structlog.get_logger()`` would have given, so ``structlog.testing.capture_logs`` and
reconfiguration behave as before.

A command that logs only from a level up calls :func:`defer_setup` with that level: events
below it are dropped at once, without loading anything; :func:`reset` (in a ``finally``) undoes
it, so a command run in-process (tests) leaves no floor behind. The daemon never defers: its
logging is configured before the first poll, and every event reaches structlog's own filter.

It imports only the vocabulary (for the levels) from gpuwatchd and does no I/O itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuwatchd.core.vocabulary import LEVEL_ALIASES, Level

__all__ = ["defer_setup", "get_logger", "reset"]

# structlog method names and the numbers of their levels (the vocabulary's, aliases included).
_LEVELS = {level.value: level.number for level in Level} | {
    alias: level.number for alias, level in LEVEL_ALIASES.items()
}


class _Deferred:
    """The process-wide deferral: the level floor and the set-up still to run."""

    floor = 0
    setup: Callable[[], None] | None = None


def defer_setup(setup: Callable[[], None], *, floor: str) -> None:
    """Run ``setup`` (configure structlog) before the first event at ``floor`` or above is
    emitted; drop events below ``floor`` without loading structlog."""
    _Deferred.floor = _LEVELS[floor]
    _Deferred.setup = setup


def reset() -> None:
    """Forget a deferred set-up and its floor (the end of a command run in-process)."""
    _Deferred.floor, _Deferred.setup = 0, None


def _drop(*_args: Any, **_kwargs: Any) -> None:
    return None


class _LazyLogger:
    """A structlog logger stand-in; see the module docstring."""

    __slots__ = ("_args", "_real")

    def __init__(self, args: tuple[Any, ...]) -> None:
        self._args = args
        self._real: Any = None

    def __getattr__(self, name: str) -> Any:
        level = _LEVELS.get(name)
        if level is not None and level < _Deferred.floor:
            return _drop
        if self._real is None:
            self._real = _load(self._args)
        return getattr(self._real, name)


def _load(args: tuple[Any, ...]) -> Any:
    setup, _Deferred.setup = _Deferred.setup, None
    if setup is not None:
        setup()
    import structlog

    return structlog.get_logger(*args)


def get_logger(*args: Any) -> Any:
    """A logger that imports structlog on its first emitted event (module docstring)."""
    return _LazyLogger(args)
