"""The boot clock: how long something that protects someone lasts (a spare, a timed pause).

The wall clock steps; ``CLOCK_BOOTTIME`` does not, and restarts at each boot (the boot id). So
a file stamps its start and end on both (:meth:`BootTime.stamp`): ``since_boot`` /
``until_boot`` with the ``boot_id`` measure it; the wall ``since`` / ``until`` show it and
stand in for another boot's file. In detail: docs/internals.md, `gpuwatchd.collect.boottime`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from gpuwatchd.core.checked import as_number

BOOT_SLACK = 60.0  # seconds: clock adjustments between two readings of the boot's wall time


@dataclass(frozen=True)
class BootTime:
    """One reading of both clocks: wall time, ``CLOCK_BOOTTIME`` seconds (None when unknown)
    and this boot's id (None when unknown)."""

    wall: float
    seconds: float | None
    boot_id: str | None

    @classmethod
    def read(cls, wall: float, boot_id: str | None) -> BootTime:
        """The boot clock now, beside ``wall`` (the caller's wall clock, injectable)."""
        try:
            seconds: float | None = time.clock_gettime(time.CLOCK_BOOTTIME)
        except (AttributeError, OSError):
            seconds = None
        return cls(wall, seconds, boot_id)

    @property
    def booted_at(self) -> float | None:
        """This boot's start in wall time (moves when the wall clock steps), or None."""
        return None if self.seconds is None else self.wall - self.seconds

    def stamp(self, seconds: float) -> dict[str, object]:
        """A file's fields for something that starts now and lasts ``seconds``."""
        return {
            "since": self.wall,
            "until": self.wall + seconds,
            "boot_id": self.boot_id,
            "since_boot": self.seconds,
            "until_boot": None if self.seconds is None else self.seconds + seconds,
        }

    def same_boot(self, data: Mapping[str, object]) -> bool:
        """Whether a stamp (:meth:`stamp`'s fields) was written in this boot: the same boot id;
        where the ids differ or one is unknown, a wall start not before this boot's start."""
        if self.boot_id is not None and data.get("boot_id") == self.boot_id:
            return True
        since, booted = as_number(data.get("since")), self.booted_at
        return since is not None and booted is not None and since >= booted - BOOT_SLACK

    def left(self, data: Mapping[str, object]) -> float | None:
        """Seconds left of a stamp now: on the boot clock when it was written in this boot,
        else by its wall ``until``; None when it names no end."""
        until_boot = as_number(data.get("until_boot"))
        if self.seconds is not None and until_boot is not None and self.same_boot(data):
            return until_boot - self.seconds
        until = as_number(data.get("until"))
        return None if until is None else until - self.wall
