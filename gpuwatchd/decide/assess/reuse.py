"""The last assessment and verdict, reused when a poll's inputs equal the previous poll's.

Exact, not a heuristic (docs/performance.md): each reuse is a case where recomputing is
proven to give an equal result (docs/internals.md, section `gpuwatchd.decide.assess.reuse`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import partial

from gpuwatchd.core.model import Snapshot
from gpuwatchd.decide.assess.passes import Refused, assess, assess_processes
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.policy import Detection, Policy
from gpuwatchd.decide.verdict import NodeVerdict, judge

_TIMES = frozenset({"monotonic", "wall_time"})
_SNAPSHOT_FIELDS = tuple(f.name for f in fields(Snapshot) if f.name not in _TIMES)
_STATE_FIELDS = tuple(f.name for f in fields(AssessState) if f.name != "health")


def same_but_time(a: Snapshot, b: Snapshot) -> bool:
    """Whether two snapshots are equal in every field but ``monotonic`` and ``wall_time``."""
    return a is b or all(getattr(a, name) == getattr(b, name) for name in _SNAPSHOT_FIELDS)


def _without_health(state: AssessState) -> tuple[object, ...]:
    return tuple(getattr(state, name) for name in _STATE_FIELDS)


@dataclass(frozen=True)
class _Assessed:
    snapshot: Snapshot
    given: tuple[object, ...]  # the state it was given, health aside
    detection: Detection
    driver_refused: Refused
    result: Assessment
    stable: bool  # it returned the state it was given (health aside)


@dataclass(frozen=True)
class _Judged:
    snapshot: Snapshot
    assessment: tuple[object, ...]
    policy: Policy
    unfinished: Mapping[str, str]
    verdict: NodeVerdict


class Reuse:
    """:func:`assess` and :func:`judge` for one daemon, remembering the last poll's. ``hits``
    counts the assessments reused."""

    def __init__(self) -> None:
        self._assessed: _Assessed | None = None
        self._judged: _Judged | None = None
        self.hits = 0
        # assess's own signature (mypy checks calls through a partial), passes remembered.
        self.assess = partial(assess, processes=self._processes)

    def _processes(
        self, snapshot: Snapshot, previous: AssessState, detection: Detection, refused: Refused
    ) -> Assessment:
        """:func:`assess_processes`, or its last result when its inputs are the same."""
        given = _without_health(previous)
        last = self._assessed
        if (
            last is not None
            and last.stable
            and last.detection == detection
            and last.driver_refused == refused
            and last.given == given
            and same_but_time(last.snapshot, snapshot)
        ):
            self.hits += 1
            return last.result
        result = assess_processes(snapshot, previous, detection, refused)
        stable = _without_health(result.state) == given
        self._assessed = _Assessed(snapshot, given, detection, dict(refused), result, stable)
        return result

    def judge(
        self,
        snapshot: Snapshot,
        assessment: Assessment,
        policy: Policy,
        *,
        unfinished: Mapping[str, str] | None = None,
    ) -> NodeVerdict:
        last = self._judged
        part = (assessment.findings, assessment.roles, assessment.state.baselines)  # judge's
        left = dict(unfinished or {})
        if (
            last is not None
            and last.policy == policy
            and last.assessment == part
            and last.unfinished == left
            and same_but_time(last.snapshot, snapshot)
        ):
            return last.verdict
        verdict = judge(snapshot, assessment, policy, unfinished=left)
        self._judged = _Judged(snapshot, part, policy, left, verdict)
        return verdict
