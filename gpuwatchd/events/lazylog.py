"""Loggers that load structlog only when an event is actually emitted.

In detail: docs/internals.md, section `gpuwatchd.events.lazylog`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuwatchd.core.vocabulary import METHOD_LEVELS


class _Deferred:
    """The process-wide deferral: the level floor and the set-up still to run."""

    floor = 0
    setup: Callable[[], None] | None = None


def defer_setup(setup: Callable[[], None], *, floor: str) -> None:
    """Run ``setup`` (configure structlog) before the first event at ``floor`` or above is
    emitted; drop events below ``floor`` without loading structlog."""
    _Deferred.floor = METHOD_LEVELS[floor].number
    _Deferred.setup = setup


def reset() -> None:
    """Forget a deferred set-up and its floor (the end of a command run in-process)."""
    _Deferred.floor, _Deferred.setup = 0, None


def _drop(*_args: Any, **_kwargs: Any) -> None:
    return None


class _LazyLogger:
    __slots__ = ("_args", "_real")

    def __init__(self, args: tuple[Any, ...]) -> None:
        self._args = args
        self._real: Any = None

    def __getattr__(self, name: str) -> Any:
        level = METHOD_LEVELS.get(name)
        if level is not None and level.number < _Deferred.floor:
            return _drop
        if self._real is None:
            setup, _Deferred.setup = _Deferred.setup, None
            if setup is not None:
                setup()
            import structlog

            self._real = structlog.get_logger(*self._args)
        return getattr(self._real, name)


def get_logger(*args: Any) -> Any:
    return _LazyLogger(args)
