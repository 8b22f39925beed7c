"""What a reset is about and what it reports: the target, the outcome, the edges it needs.

This module owns the reset procedure's data and contracts, apart from its steps
(:mod:`gpuwatchd.act.reset`): :class:`ResetTarget` (the GPU, or one of its MIG GPU instances to
re-create), :class:`ResetOutcome`, the :class:`ResetEnvironment` the daemon (or a test, or
``simulate``) provides, the :class:`CommandRunner` and :class:`FabricWait` it calls,
:func:`progress_record` (what the state file keeps while a reset runs, read back by
:mod:`gpuwatchd.act.reset_resume`) and :func:`outcome_event` (the ``reset.outcome`` event).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpuwatchd.act.commands import CommandResult
from gpuwatchd.decide.mig_recovery import InstanceRecovery
from gpuwatchd.decide.monitors import StoppableMonitor
from gpuwatchd.model import GpuInfo
from gpuwatchd.vocabulary import RESET_RESULT_LEVELS, Level, ResetResult, ResetStep

__all__ = [
    "UNRECORDED",
    "CommandRunner",
    "FabricWait",
    "ResetEnvironment",
    "ResetOutcome",
    "ResetTarget",
    "outcome_event",
    "progress_record",
]


UNRECORDED = "could not record reset progress in the state file"  # why a step was not run


@dataclass(frozen=True)
class ResetTarget:
    """The GPU to reset. ``persistence_was_on`` None (unknown) means it is not toggled."""

    uuid: str
    pci_bus_id: str | None
    minor: int | None
    persistence_was_on: bool | None
    hostname: str | None = None  # {hostname} in the drain/before/after hooks
    fabric: bool = False  # an NVSwitch system's GPU: the reset waits for its NVLink fabric
    # Re-create this MIG GPU instance of the GPU in place instead of resetting the GPU.
    recovery: InstanceRecovery | None = None
    # A MIG GPU's reset: its GPU instances, created again after it (act/reset_mig.py).
    layout: tuple[InstanceRecovery, ...] = ()


@dataclass(frozen=True)
class ResetOutcome:
    """How a reset ended.

    ``result`` is ``success``, ``failed``, ``refused`` (stopped before the reset command ran,
    and undone), ``in_use`` (the driver refused: a holder no scan found), ``timeout`` (the
    reset command missed its deadline) or ``dry_run``. ``step``
    is where it ended (``done`` when it went all the way). ``blockers`` are the final scan's
    reasons. ``command`` is the reset command's result when it ran.
    """

    result: ResetResult
    step: ResetStep
    reason: str
    needs_reboot: bool
    command: CommandResult | None
    blockers: tuple[str, ...]


class ResetEnvironment(Protocol):
    """What the reset needs from the daemon. Tests pass a fake."""

    def stop_nvml(self) -> bool:
        """Stop the NVML worker; True when no NVML handle of ours remains."""

    def final_blockers(self, target: ResetTarget, ignore: frozenset[int]) -> list[str]:
        """A fresh full holder scan: one human-readable reason per blocker; empty = clear.
        ``ignore``: PIDs a dry run would have stopped (monitors), not counted."""

    def find_monitors(self, target: ResetTarget) -> list[StoppableMonitor]:
        """A fresh holder scan: the holders of the target's GPU that ``reset.monitors`` lets
        the procedure stop (:func:`gpuwatchd.decide.monitors.monitors_to_stop`)."""

    def stop_monitors(
        self, target: ResetTarget, monitors: Sequence[StoppableMonitor], timeout: float
    ) -> list[str]:
        """Send each monitor process SIGTERM (its identity re-verified), then wait up to
        ``timeout`` seconds until none holds the GPU: one reason per one that still does."""

    def memory_back_to_baseline(self, target: ResetTarget) -> bool | None:
        """After the reset: restart NVML and read memory. None = unknown."""

    def instance_back(self, target: ResetTarget) -> str | None:
        """After a MIG recovery (``target.recovery``): restart NVML and read the GPU and the
        mig-minors table. None when the instance is back, listed, and its memory freed; else
        what is not (unknown is not back)."""

    def reread_gpu(self, target: ResetTarget) -> GpuInfo | None:
        """A MIG recovery, right before its first command and before its re-create: a fresh
        NVML reading of ``target``'s GPU (its MIG devices), through the NVML worker, which is
        stopped again before this returns (raises when it cannot be): nothing of ours holds
        the GPU when the next command runs. None when the GPU is not in the reading."""

    def record_step(self, target: ResetTarget, step: ResetStep, data: Mapping[str, object]) -> None:
        """Persist progress before ``step`` runs (see :func:`progress_record`)."""

    def emit(self, event: str, level: Level, **fields: object) -> None:
        """Log one structured event."""


class FabricWait(Protocol):
    """After a reset on an NVSwitch system: wait (bounded by ``timeout`` seconds) until the
    GPU's NVLink fabric registration is COMPLETED. True when it is, False when it failed or
    did not complete in time; with a detail saying which (the last state read)."""

    def __call__(self, target: ResetTarget, timeout: float) -> tuple[bool, str]: ...


class CommandRunner(Protocol):
    """Runs one command with :func:`gpuwatchd.act.commands.run_command`'s contract: ``argv``
    (no shell), a deadline of ``timeout`` seconds, ``env`` the complete environment (None:
    inherit), and a :class:`~gpuwatchd.act.commands.CommandResult` back, never an exception for
    a failing command.

    The reset command, the persistence and health commands and every hook go through it (a
    hook gets its ``GPUWATCHD_*`` variables in ``env``; the commands get no ``env``).
    """

    def __call__(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult: ...


def progress_record(
    target: ResetTarget, step: ResetStep, data: Mapping[str, object]
) -> dict[str, object]:
    """The JSON-able record the state file keeps for a reset in progress.

    ``data`` is what :func:`perform_reset` passes to ``record_step``: ``persistence_off``
    (this procedure turned persistence mode off, or was about to), ``units_stopped`` (the
    monitors' units it stopped, or was about to), ``reset_started`` (the
    reset command was about to run or ran) and ``result`` (the reset command's result once
    known); a MIG recovery's also ``commands_done`` (how many of its commands completed: the
    one after them was about to run or ran); a MIG GPU's reset also ``mig_layout`` (its GPU
    instances, created again after the reset). :func:`resume_interrupted` reads exactly this
    shape back.
    """
    record: dict[str, object] = {
        "uuid": target.uuid,
        "pci_bus_id": target.pci_bus_id,
        "minor": target.minor,
        "persistence_was_on": target.persistence_was_on,
        "step": step.value,
        **data,
    }
    if target.recovery is not None:
        record["recovery"] = target.recovery.record()
    if target.layout:
        record["mig_layout"] = [r.record() for r in target.layout]
    return record


def outcome_event(
    outcome: ResetOutcome, *, gpu: str, pci_bus_id: str | None, dry_run: bool
) -> tuple[Level, dict[str, object]]:
    """The level and fields of the ``reset.outcome`` event (the daemon's and simulate's)."""
    result = ResetResult(outcome.result)
    level = Level.CRITICAL if outcome.needs_reboot else RESET_RESULT_LEVELS[result]
    return level, {
        "gpu": gpu,
        "pci_bus_id": pci_bus_id,
        "result": outcome.result,
        "step": outcome.step.value,
        "reason": outcome.reason,
        "needs_reboot": outcome.needs_reboot,
        "blockers": list(outcome.blockers),
        "dry_run": dry_run,
    }
