"""What each finding kind is: one row per :class:`gpuwatchd.core.model.FindingKind` with every
property the rest of gpuwatchd asks about (words, scope, whether a rule may signal for it...).
A new kind is one row here (tests/unit/test_kinds.py checks every kind has one).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from gpuwatchd.core.model import FindingKind


class Scope(str, enum.Enum):
    """What a finding of the kind is about."""

    PROCESS = "process"
    GPU = "gpu"


@dataclass(frozen=True)
class KindProperties:
    kind: FindingKind
    words: str  # for a person: "a process that holds a GPU after its job ended"
    scope: Scope
    holds_device: bool = False  # a live process holding device files: dirt on each GPU it holds
    live_holder: bool = False  # the GPU has a live holder while it lasts
    memory: bool = False  # memory no live process accounts for
    listing: bool = False  # NVML lists a process that no longer runs
    settling: bool = False  # may go away without anyone acting
    health: bool = False  # GPU health (decide/health/judge.py); never a reason to signal a job
    why_not_signallable: str | None = None  # None: a rule may send signals for it


_K = FindingKind


_HEALTH_WHY = "a GPU that needs {} is handled under 'health'"


def _health(kind: FindingKind, words: str, why: str) -> KindProperties:
    """A GPU health kind: never a reason to signal a job (``why``)."""
    return KindProperties(kind, words, Scope.GPU, health=True, why_not_signallable=why)


KINDS: Mapping[FindingKind, KindProperties] = {
    row.kind: row
    for row in (
        KindProperties(
            _K.DEAD_PROCESS,
            "NVML lists a process that no longer exists",
            Scope.PROCESS,
            listing=True,
            settling=True,
            why_not_signallable="a dead process cannot be signalled",
        ),
        KindProperties(
            _K.ZOMBIE,
            "a zombie process still listed on the GPU",
            Scope.PROCESS,
            live_holder=True,
            listing=True,
            settling=True,
            why_not_signallable="zombies are never signalled (their parent must reap them)",
        ),
        KindProperties(
            _K.ORPHANED,
            "a process left pinning a dead job's GPU memory (a worker whose trainer died)",
            Scope.PROCESS,
            holds_device=True,
            live_holder=True,
        ),
        KindProperties(
            _K.ABANDONED,
            "a live process still holding the GPU after its job ended",
            Scope.PROCESS,
            holds_device=True,
            live_holder=True,
        ),
        KindProperties(
            _K.STUCK,
            "a process stuck in uninterruptible sleep (D) on the GPU",
            Scope.PROCESS,
            holds_device=True,
            live_holder=True,
            why_not_signallable="a process in uninterruptible sleep (D) cannot be killed; "
            "the on_failure hooks run for it",
        ),
        KindProperties(
            _K.HIDDEN_HOLDER,
            "a process holding the GPU's device file without a context of its own",
            Scope.PROCESS,
            holds_device=True,
            live_holder=True,
            why_not_signallable="hidden holders are report-only",
        ),
        KindProperties(
            _K.GHOST_MEMORY,
            "GPU memory still allocated with no live holder at all",
            Scope.GPU,
            memory=True,
            settling=True,
            why_not_signallable="ghost memory is freed by the GPU reset; tune it under 'reset'",
        ),
        KindProperties(
            _K.UNACCOUNTED_MEMORY,
            "GPU memory in use that the listed processes do not account for",
            Scope.GPU,
            memory=True,
            settling=True,
            why_not_signallable="unaccounted memory is report-only; "
            "the processes behind it are found as their own kinds",
        ),
        _health(
            _K.RESET_REQUIRED,
            "a GPU that needs a reset to be healthy",
            "GPU health is handled under 'health'; live jobs are never signalled for it",
        ),
        _health(
            _K.REBOOT_REQUIRED, "a GPU that needs the node rebooted", _HEALTH_WHY.format("a reboot")
        ),
        _health(
            _K.DRAIN_REQUIRED, "a GPU whose node needs draining", _HEALTH_WHY.format("draining")
        ),
    )
}


def words(kind: object) -> str | None:
    """The kind in words; None for a value that is no finding kind."""
    try:
        return KINDS[FindingKind(kind)].words
    except ValueError:
        return None


def _where(test: str) -> frozenset[FindingKind]:
    return frozenset(k for k, row in KINDS.items() if getattr(row, test))


HOLDING_DEVICE = _where("holds_device")
LIVE_HOLDER = _where("live_holder")
MEMORY = _where("memory")
LISTING = _where("listing")
SETTLING = _where("settling")
HEALTH = _where("health")
