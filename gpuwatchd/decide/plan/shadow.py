"""Dry-run's shadow: the limits and history enforcement would have, so a preview is the same
decisions, once.

In detail: docs/internals.md, section `gpuwatchd.decide.plan.shadow`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar, cast

from gpuwatchd.core.checked import MAX_REASON, items, name, number, obj, opt_number, pairs, reason
from gpuwatchd.decide.policy import Limits

HOUR = 3600.0
MAX_ENTRIES = 10_000  # a saved shadow longer than this is damaged, not a preview
_T = TypeVar("_T")


@dataclass(frozen=True)
class DryShadow:
    """What enforcement would have booked during a dry run (its fields: docs/internals.md)."""

    resets: tuple[tuple[str, float], ...] = ()
    done: Mapping[str, float] = field(default_factory=dict)
    signalled: tuple[tuple[str, float], ...] = ()
    capped: str | None = None
    forced: tuple[str, ...] = ()
    scopes: Mapping[str, str] = field(default_factory=dict)
    capped_since: float | None = None
    latches: Mapping[str, tuple[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "resets": [[g, t] for g, t in self.resets],
            "done": dict(sorted(self.done.items())),
            "signalled": [[t, at] for t, at in self.signalled],
            "capped": self.capped,
            "forced": list(self.forced),
            "scopes": dict(sorted(self.scopes.items())),
            "capped_since": self.capped_since,
            "latches": {k: [why, since] for k, (why, since) in sorted(self.latches.items())},
        }

    def without_latches(self) -> DryShadow:
        """``resume --clear-latches``: the would-be latches go with the real ones."""
        return replace(self, capped=None, capped_since=None, latches={}, forced=())

    @classmethod
    def from_json(cls, data: object) -> DryShadow:
        """Rebuild :meth:`to_json`'s form; ValueError naming the bad entry otherwise."""
        if data is None:
            return cls()
        data = obj(data, "plan.shadow")
        capped = data.get("capped")
        if capped is not None and not isinstance(capped, str):
            raise ValueError("plan.shadow.capped: expected a string or null")
        forced = items(data.get("forced", []), "plan.shadow.forced", MAX_ENTRIES)
        if not all(isinstance(t, str) for t in forced):
            raise ValueError("plan.shadow.forced: expected strings")
        return cls(
            resets=pairs(data.get("resets", []), "plan.shadow.resets", MAX_ENTRIES),
            done=_entries(data, "done", number),
            signalled=pairs(data.get("signalled", []), "plan.shadow.signalled", MAX_ENTRIES),
            capped=None if capped is None else capped[:MAX_REASON],
            forced=tuple(cast(list[str], forced)),
            scopes=_entries(data, "scopes", name),
            capped_since=opt_number(data.get("capped_since"), "plan.shadow.capped_since"),
            latches=_entries(data, "latches", _latch),
        )


def cap_exceeded(
    limits: Limits,
    scope: str,
    signalled: Sequence[tuple[str, float]],
    scopes: Mapping[str, str],
    new_targets: Mapping[str, int],
) -> tuple[str, str] | None:
    """(the scope latched: ``scope`` or "node", why) when one more target of ``scope`` would pass
    a kill cap, given the targets ``signalled`` within the hour, whose ``scopes`` they were, and
    how many ``new_targets`` each scope had this poll. Enforcement's and the shadow's."""
    if len(signalled) + 1 > limits.node_max_signalled_per_hour:
        why = f"more than {limits.node_max_signalled_per_hour} processes in one hour on the node"
        return "node", why
    if new_targets.get(scope, 0) + 1 > limits.max_signalled_per_poll:
        return scope, f"more than {limits.max_signalled_per_poll} processes of {scope} in one poll"
    mine = sum(1 for t, _ in signalled if scopes.get(t) == scope)
    if mine + 1 > limits.max_signalled_per_hour:
        return scope, f"more than {limits.max_signalled_per_hour} processes of {scope} in one hour"
    return None


def _entries(
    data: Mapping[str, object], key: str, read: Callable[[object, str], _T]
) -> dict[str, _T]:
    """The saved object ``data[key]`` (at most MAX_ENTRIES entries), each value read by ``read``;
    its keys (finding keys, targets, scopes) are names events may carry."""
    what = f"plan.shadow.{key}"
    found = data.get(key, {})
    if not isinstance(found, dict) or len(found) > MAX_ENTRIES:
        raise ValueError(f"{what}: expected an object")
    return {name(k, what): read(v, f"{what}.{k}") for k, v in found.items()}


def _latch(value: object, what: str) -> tuple[str, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"{what}: expected [why, since]")
    return reason(value[0], what), number(value[1], what)


class ShadowWork:
    """The mutable copy of a :class:`DryShadow` while one ``plan`` call decides."""

    def __init__(self, shadow: DryShadow) -> None:
        self.resets = list(shadow.resets)
        self.done = dict(shadow.done)
        self.signalled = list(shadow.signalled)
        self.capped = shadow.capped
        self.capped_since = shadow.capped_since
        self.latches = dict(shadow.latches)
        self.scopes = dict(shadow.scopes)
        self.forced = set(shadow.forced)
        self.new_targets: dict[str, int] = {}  # scope -> would-be ladders started this poll

    def freeze(self) -> DryShadow:
        return DryShadow(
            resets=tuple(self.resets),
            done=self.done,
            signalled=tuple(self.signalled),
            capped=self.capped,
            forced=tuple(sorted(self.forced)),
            scopes={t: self.scopes[t] for t, _ in self.signalled if t in self.scopes},
            capped_since=self.capped_since,
            latches=self.latches,
        )

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
        """The wall clock went back by ``step`` (forward when negative): no time passed."""
        self.resets = [(g, t - step) for g, t in self.resets]
        self.done = {k: t - step for k, t in self.done.items()}
        if self.capped_since is not None:
            self.capped_since -= step
        self.latches = {k: (why, t - step) for k, (why, t) in self.latches.items()}

    def new_boot(self) -> None:
        """A reboot: process identities go; wall-time history and would-be latches stay."""
        self.signalled, self.forced, self.scopes = [], set(), {}

    def expire(self, wall: float, lasts: float) -> list[tuple[str, str, float]]:
        """The would-be latches ``limits.kill_cap_latch`` lifts by wall time ``wall``, as (scope,
        why, how long it lasted); ladders they forced stay forced."""
        ended: list[tuple[str, str, float]] = []
        if self.capped is not None:
            if self.capped_since is None:
                self.capped_since = wall
            elif wall - self.capped_since >= lasts:
                ended.append(("node", self.capped, wall - self.capped_since))
                self.capped, self.capped_since = None, None
        for scope, (why, since) in sorted(self.latches.items()):
            if wall - since >= lasts:
                ended.append((scope, why, wall - since))
                del self.latches[scope]
        return ended

    def recent_resets(self, gpu: str, wall: float, window: float) -> list[float]:
        return [t for g, t in self.resets if g == gpu and wall - t < window]

    def book_reset(self, gpu: str, finding_key: str, wall: float) -> None:
        """A would-be reset assumed to have succeeded."""
        self.resets.append((gpu, wall))
        self.done[finding_key] = wall

    def latched(self, scope: str) -> bool:
        """Whether enforcement would run ``scope``'s new ladders as forced dry runs now."""
        return self.capped is not None or scope in self.latches

    def admit(self, target: str, scope: str, limits: Limits, wall: float) -> tuple[str, str] | None:
        """A would-be ladder for ``target`` starts: (the scope latched, ``scope`` or "node", and
        why) when it would pass a cap, once, or None; after it, every new one is forced."""
        if self.latched(scope):
            self.forced.add(target)
            return None
        capped = self.engage(scope, limits, wall)
        if capped is not None:
            self.forced.add(target)
        return capped

    def engage(self, scope: str, limits: Limits, wall: float) -> tuple[str, str] | None:
        """(the scope latched, ``scope`` or "node", and why) when one more target of ``scope``
        would pass a cap: the would-be latch engages from wall time ``wall``; else None."""
        capped = cap_exceeded(limits, scope, self.signalled, self.scopes, self.new_targets)
        if capped is None:
            return None
        if capped[0] == "node":
            self.capped, self.capped_since = capped[1], wall
        else:
            self.latches[scope] = (capped[1], wall)
        return capped

    def count(self, target: str, scope: str, now: float) -> None:
        """A would-be ladder sent its first signal (as enforcement counts a real one)."""
        if target in self.forced or any(t == target for t, _ in self.signalled):
            return
        self.signalled.append((target, now))
        self.scopes[target] = scope
        self.new_targets[scope] = self.new_targets.get(scope, 0) + 1

    def holds(self, target: str, scope: str) -> bool:
        """Whether a would-be latch holds ``target``'s ladder (one enforcement ran for real)."""
        return self.latched(scope) and target not in self.forced
