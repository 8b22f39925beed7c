"""The last assessment and verdict, reused when a poll's inputs equal the previous poll's.

Exact, not a heuristic (docs/performance.md): each reuse is a case where recomputing is
proven to give an equal result (docs/internals.md, section `gpuwatchd.decide.assess.reuse`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import partial
from typing import Generic, TypeVar

from gpuwatchd.core.model import Snapshot
from gpuwatchd.decide.assess.passes import Refused, assess, assess_processes
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.policy import Detection, Policy
from gpuwatchd.decide.verdict import NodeVerdict, judge

_TIMES = frozenset({"monotonic", "wall_time"})
_SNAPSHOT_FIELDS = tuple(f.name for f in fields(Snapshot) if f.name not in _TIMES)
_STATE_FIELDS = tuple(f.name for f in fields(AssessState) if f.name != "health")
_R = TypeVar("_R")


def same_but_time(a: Snapshot, b: Snapshot) -> bool:
    """Whether two snapshots are equal in every field but ``monotonic`` and ``wall_time``."""
    return a is b or all(getattr(a, name) == getattr(b, name) for name in _SNAPSHOT_FIELDS)


def _without_health(state: AssessState) -> tuple[object, ...]:
    return tuple(getattr(state, name) for name in _STATE_FIELDS)


@dataclass(frozen=True)
class _Last(Generic[_R]):
    """One call's inputs (the snapshot apart: compared but for its time) and its result."""

    snapshot: Snapshot
    inputs: tuple[object, ...]
    result: _R

    def answers(self, snapshot: Snapshot, inputs: tuple[object, ...]) -> bool:
        return self.inputs == inputs and same_but_time(self.snapshot, snapshot)


class Reuse:
    """:func:`assess` and :func:`judge` for one daemon, remembering the last poll's. ``hits``
    counts the assessments reused."""

    def __init__(self) -> None:
        self._assessed: _Last[Assessment] | None = None
        self._judged: _Last[NodeVerdict] | None = None
        self.hits = 0
        # assess's own signature (mypy checks calls through a partial), passes remembered.
        self.assess = partial(assess, processes=self._processes)

    def _processes(
        self, snapshot: Snapshot, previous: AssessState, detection: Detection, refused: Refused
    ) -> Assessment:
        """:func:`assess_processes`, or its last result when proven equal (docs/internals.md)."""
        given = _without_health(previous)
        inputs = (detection, dict(refused), given)
        last = self._assessed
        if last is not None and last.answers(snapshot, inputs):
            self.hits += 1
            return last.result
        result = assess_processes(snapshot, previous, detection, refused)
        stable = _without_health(result.state) == given
        self._assessed = _Last(snapshot, inputs, result) if stable else None
        return result

    def judge(
        self,
        snapshot: Snapshot,
        assessment: Assessment,
        policy: Policy,
        *,
        unfinished: Mapping[str, str] | None = None,
    ) -> NodeVerdict:
        left = dict(unfinished or {})
        part = (assessment.findings, assessment.roles, assessment.state.baselines)  # judge's
        inputs = (policy, part, left)
        last = self._judged
        if last is not None and last.answers(snapshot, inputs):
            return last.result
        verdict = judge(snapshot, assessment, policy, unfinished=left)
        self._judged = _Last(snapshot, inputs, verdict)
        return verdict
