"""Dry-run's shadow: the limits and history enforcement would have, so a preview is the same
decisions, once.

A dry run previews what enforcement would do, and an admin decides from it whether to enforce.
So a would-be action must count as the real one would: a would-be reset against
``reset.max_resets`` within ``reset.window`` (the cooldown already counts it), and — assumed to
have succeeded — it deals with its finding, so the preview does not repeat it every cooldown; a
would-be ladder against the node-wide kill cap, whose would-be latch then holds the ladders
enforcement would have held. This module owns that bookkeeping (:class:`DryShadow`, kept in
the plan state, with its checked JSON form) and the small questions ``plan.py`` asks of it.

The shadow is only a preview's: it is dropped the moment the daemon acts for real, so what
dry-run would have done never blocks the real thing; and the kill-cap part applies only to a
policy's dry run, not to the dry run the real kill cap forced (enforcement is already there).
The assumed success of a would-be reset on GPU health is ``health.py``'s (``note_reset`` with
``assumed_from``). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuwatchd.decide.policy import Limits

__all__ = ["HOUR", "DryShadow", "ShadowWork"]

HOUR = 3600.0
MAX_ENTRIES = 10_000  # a saved shadow longer than this is damaged, not a preview


@dataclass(frozen=True)
class DryShadow:
    """What enforcement would have booked during a dry run.

    ``resets``: (GPU UUID, wall time) of would-be resets assumed to have succeeded (they count
    against ``max_resets``); ``done``: finding key → wall time of the would-be reset assumed to
    have dealt with it (kept while the finding lasts); ``signalled``: (target, monotonic time)
    of would-be ladders within the hour (the kill cap); ``capped``: why enforcement would have
    reached the kill cap (a would-be latch, cleared with the real one); ``forced``: targets
    whose ladders enforcement would have run as forced dry runs (started after the cap).
    """

    resets: tuple[tuple[str, float], ...] = ()
    done: Mapping[str, float] = field(default_factory=dict)
    signalled: tuple[tuple[str, float], ...] = ()
    capped: str | None = None
    forced: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "resets": [[g, t] for g, t in self.resets],
            "done": dict(sorted(self.done.items())),
            "signalled": [[t, at] for t, at in self.signalled],
            "capped": self.capped,
            "forced": list(self.forced),
        }

    @classmethod
    def from_json(cls, data: object) -> DryShadow:
        """Rebuild :meth:`to_json`'s form; ValueError naming the bad entry otherwise."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError("plan.shadow: expected an object")
        done = data.get("done", {})
        if not isinstance(done, dict) or len(done) > MAX_ENTRIES:
            raise ValueError("plan.shadow.done: expected an object")
        capped = data.get("capped")
        if capped is not None and not isinstance(capped, str):
            raise ValueError("plan.shadow.capped: expected a string or null")
        forced = data.get("forced", [])
        if not isinstance(forced, list) or len(forced) > MAX_ENTRIES:
            raise ValueError("plan.shadow.forced: expected a list")
        if not all(isinstance(t, str) for t in forced):
            raise ValueError("plan.shadow.forced: expected strings")
        return cls(
            resets=_pairs(data.get("resets", []), "plan.shadow.resets"),
            done={
                _str(k, "plan.shadow.done"): _time(v, f"plan.shadow.done.{k}")
                for k, v in done.items()
            },
            signalled=_pairs(data.get("signalled", []), "plan.shadow.signalled"),
            capped=capped,
            forced=tuple(forced),
        )


def _str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what}: expected a string")
    return value


def _time(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what}: expected a finite number")
    return float(value)


def _pairs(value: object, what: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, list) or len(value) > MAX_ENTRIES:
        raise ValueError(f"{what}: expected a list")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, list) or len(item) != 2:
            raise ValueError(f"{what}[{i}]: expected [name, time]")
        out.append((_str(item[0], f"{what}[{i}]"), _time(item[1], f"{what}[{i}]")))
    return tuple(out)


class ShadowWork:
    """The mutable copy of a :class:`DryShadow` while one ``plan`` call decides."""

    def __init__(self, shadow: DryShadow) -> None:
        self.resets = list(shadow.resets)
        self.done = dict(shadow.done)
        self.signalled = list(shadow.signalled)
        self.capped = shadow.capped
        self.forced = set(shadow.forced)
        self.new_targets = 0  # would-be ladders started this poll (the per-poll cap)

    def freeze(self) -> DryShadow:
        return DryShadow(
            resets=tuple(self.resets),
            done=self.done,
            signalled=tuple(self.signalled),
            capped=self.capped,
            forced=tuple(sorted(self.forced)),
        )

    # -- keeping it current --

    def drop(self) -> None:
        """Not a dry run any more: the shadow never blocks the real thing."""
        self.resets, self.done, self.signalled = [], {}, []
        self.capped, self.forced, self.new_targets = None, set(), 0

    def prune(
        self,
        *,
        now: float,
        wall: float,
        window: float,
        findings: Iterable[str],
        ladders: Iterable[str],
    ) -> None:
        """Forget what enforcement would have forgotten by now, and what is gone."""
        current, live = set(findings), set(ladders)
        self.resets = [(g, t) for g, t in self.resets if wall - t < window]
        self.done = {k: t for k, t in self.done.items() if k in current}
        self.signalled = [(t, at) for t, at in self.signalled if now - at < HOUR]
        self.forced &= live

    def shift(self, step: float) -> None:
        """The wall clock went back by ``step``: that counts as no time passed."""
        self.resets = [(g, t - step) for g, t in self.resets]
        self.done = {k: t - step for k, t in self.done.items()}

    def new_boot(self) -> None:
        """Process identities mean nothing after a reboot; wall-time reset history stays."""
        self.signalled, self.forced, self.capped = [], set(), None

    # -- resets --

    def recent_resets(self, gpu: str, wall: float, window: float) -> list[float]:
        return [t for g, t in self.resets if g == gpu and wall - t < window]

    def book_reset(self, gpu: str, finding_key: str, wall: float) -> None:
        """A would-be reset assumed to have succeeded."""
        self.resets.append((gpu, wall))
        self.done[finding_key] = wall

    # -- the kill cap --

    def admit(self, target: str, limits: Limits) -> str | None:
        """A would-be ladder for ``target`` starts: the reason the kill cap would be reached
        by it (said once, when the would-be latch engages), or None. After the latch every
        new ladder is one enforcement would have run as a forced dry run."""
        if self.capped is not None:
            self.forced.add(target)
            return None
        if self.new_targets + 1 > limits.max_signalled_per_poll:
            why = f"more than {limits.max_signalled_per_poll} processes in one poll"
        elif len(self.signalled) + 1 > limits.max_signalled_per_hour:
            why = f"more than {limits.max_signalled_per_hour} processes in one hour"
        else:
            return None
        self.capped = why
        self.forced.add(target)
        return why

    def count(self, target: str, now: float) -> None:
        """A would-be ladder sent its first signal (as enforcement counts a real one)."""
        if target in self.forced or any(t == target for t, _ in self.signalled):
            return
        self.signalled.append((target, now))
        self.new_targets += 1

    def holds(self, target: str) -> bool:
        """After the would-be latch, the ladders enforcement ran for real would be held."""
        return self.capped is not None and target not in self.forced
