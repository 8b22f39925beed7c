"""Finishing or undoing a reset that a crash or stop interrupted, from the state file's record.

This module owns :func:`resume_interrupted`: called once at start with the record
:func:`gpuwatchd.act.reset.progress_record` left, it reads the record back strictly (a damaged
one changes nothing), never runs the reset command (or a MIG recovery's commands) again, and
finishes or undoes what the record says was done, with the same steps and events as the
procedure in :mod:`gpuwatchd.act.reset`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from gpuwatchd.act.commands import run_command
from gpuwatchd.act.reset import (
    EMPTY_ENV,
    CommandRunner,
    Commands,
    Procedure,
    ResetEnvironment,
    ResetOutcome,
    ResetTarget,
    prepare_commands,
)
from gpuwatchd.decide.mig_recovery import from_record
from gpuwatchd.decide.policy import ResetPolicy
from gpuwatchd.vocabulary import EventName, Level, ResetResult, ResetStep

__all__ = ["resume_interrupted"]


def _target_from(record: Mapping[str, object]) -> ResetTarget | None:
    uuid = record.get("uuid")
    pci = record.get("pci_bus_id")
    minor = record.get("minor")
    was_on = record.get("persistence_was_on")
    if not isinstance(uuid, str) or not uuid:
        return None
    recovery = None
    if "recovery" in record:  # a MIG recovery's: never resumed as a whole GPU's reset
        recovery = from_record(record["recovery"])
        if recovery is None or recovery.uuid != uuid:
            return None
    return ResetTarget(
        uuid=uuid,
        pci_bus_id=pci if isinstance(pci, str) else None,
        minor=minor if isinstance(minor, int) and not isinstance(minor, bool) else None,
        persistence_was_on=was_on if isinstance(was_on, bool) else None,
        recovery=recovery,
    )


def resume_interrupted(
    record: Mapping[str, object],
    reset: ResetPolicy,
    env: ResetEnvironment,
    *,
    runner: CommandRunner = run_command,
    hostname: str | None = None,
) -> ResetOutcome | None:
    """Finish or undo a reset that a crash or stop interrupted; None if nothing is left to do.

    Call it at start, before anything else, with the record the state kept (the shape of
    :func:`progress_record`). The reset command is **never** run again: it may have run.

    =========================================  ==============================  ================
    last recorded step                         what happens now                result
    =========================================  ==============================  ================
    ``done``                                   nothing (returns None)          —
    ``drain`` … ``stop_monitors``              ``after`` hooks                 ``refused``
    ``persistence_off``, ``final_scan``        persistence on if it was        ``refused``
                                               turned off, ``after`` hooks
    ``persistence_on``/``after_hooks`` before  finish that undo                ``refused``
    the reset started (an undo in progress)
    ``reset``, ``health_check``                health check, persistence on,   ``success`` only
                                               ``after`` hooks                 if healthy and
                                                                               memory is back;
                                                                               else ``failed``
    ``persistence_on`` after the reset         persistence on, ``after`` hooks  recorded result
    ``after_hooks`` after the reset            ``after`` hooks                 recorded result
    =========================================  ==============================  ================

    Persistence mode is restored from the record (``persistence_off``), and the monitors'
    units it stopped are started (``units_stopped``), not from today's policy. A record
    that cannot be read (no GPU UUID, unknown step) changes nothing and returns ``failed``
    with the reason, so the daemon can log it and drop the record. The caller starts its NVML
    worker afterwards, as after :func:`perform_reset`. Hooks may run a second time after a
    crash inside them, so ``after`` hooks should be idempotent.
    ``runner`` runs the commands and hooks, as for :func:`perform_reset`; ``hostname`` fills
    ``{hostname}`` in them (it is not part of the record).
    """
    step_value = record.get("step")
    try:
        step = ResetStep(step_value)
    except ValueError:
        step = None
    target = _target_from(record)
    if target is not None:
        target = dataclasses.replace(target, hostname=hostname)
    if step is ResetStep.DONE:
        return None
    if step is None or target is None:
        reason = f"unreadable reset record {dict(record)!r}; nothing was changed"
        env.emit(EventName.RESET_RESUME_FAILED, Level.ERROR, reason=reason)
        return ResetOutcome(ResetResult.FAILED, ResetStep.DONE, reason, False, None, ())

    prepared = prepare_commands(target, reset)
    if isinstance(prepared, str):
        # Today's policy cannot build the commands; still run the after hooks, and say so.
        prepared = Commands((), (), None, None)
    proc = Procedure(target, reset, env, prepared, dry_run=False, hook_env=EMPTY_ENV, runner=runner)
    proc.persistence_off = record.get("persistence_off") is True
    units = record.get("units_stopped")
    if isinstance(units, list):  # the monitors' units stop_monitors stopped: started again
        proc.units_stopped = [
            u for u in units if isinstance(u, str) and u.endswith(".service") and u[:1] != "-"
        ]
    proc.reset_started = record.get("reset_started") is True
    recorded = record.get("result")
    # An unknown recorded result is no result: the GPU is checked again below.
    known = isinstance(recorded, str) and recorded in {r.value for r in ResetResult}
    proc.result = ResetResult(recorded) if known else None
    env.emit(
        EventName.RESET_RESUMED,
        Level.WARNING,
        gpu=target.uuid,
        step=step.value,
        reset_started=proc.reset_started,
        persistence_off=proc.persistence_off,
    )
    if proc.persistence_off and prepared.persistence_on is None:
        proc.notes.append("persistence mode could not be restored: the command cannot be built")

    if not proc.reset_started:
        reason = f"interrupted at step {step.value} before the reset command ran; undone"
        proc.restore(ResetResult.REFUSED, reason)
        return proc.finish(ResetResult.REFUSED, step, reason)

    if step in (ResetStep.RESET, ResetStep.HEALTH_CHECK) or proc.result is None:
        unhealthy = False
        if not prepared.health:
            memory: bool | None = None
            detail = "the health check command cannot be built; GPU state unknown"
        else:
            healthy, memory, detail = proc.health_check()
            unhealthy = not healthy
        result = ResetResult.SUCCESS if not unhealthy and memory is True else ResetResult.FAILED
        reason = f"interrupted at step {step.value} after the reset command started; {detail}"
        proc.result = result
        proc.restore(result, reason)
        return proc.finish(result, ResetStep.DONE, reason, needs_reboot=unhealthy)

    reason = f"interrupted at step {step.value}; reset result was {proc.result}; finished"
    proc.restore(proc.result, reason)
    return proc.finish(proc.result, ResetStep.DONE, reason)
