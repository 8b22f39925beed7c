"""Finishing or undoing a reset that a crash or stop interrupted, from the state file's record.

In detail: docs/internals.md, section `gpuwatchd.act.reset_resume`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

from gpuwatchd.act.commands import run_command
from gpuwatchd.act.reset import Procedure, check_after_reset, half_done, run_recovery
from gpuwatchd.act.reset_target import (
    UNRECORDED,
    CommandRunner,
    Commands,
    ResetEnvironment,
    ResetOutcome,
    ResetTarget,
    commands_from_record,
    is_a,
    prepare_commands,
    prepare_hooks,
)
from gpuwatchd.core.checked import as_flag, as_list, as_one_of, as_text
from gpuwatchd.core.model import as_int, fields_of
from gpuwatchd.core.vocabulary import EventName, Level, ResetResult, ResetStep
from gpuwatchd.decide.mig.recovery import (
    InstanceRecovery,
    from_record,
    instance_changed,
    resume_point,
)
from gpuwatchd.decide.plan.monitors import UNIT_NAME
from gpuwatchd.decide.policy import ResetPolicy
from gpuwatchd.events.words import short

REBOOTED = (
    "the node rebooted since: no GPU command was run, only the monitors' units started "
    "and the after hooks"
)
MAX_SHOWN = 20  # entries of a record events show (a reset writes at most 16)


def shown_record(record: Mapping[str, object]) -> dict[str, str]:
    """A record read back (hostile: as large as the state file) as events show it: its first
    entries, each key and value as text cut as an event's values are."""
    return {short(key): short(value) for key, value in itertools.islice(record.items(), MAX_SHOWN)}


def of_another_boot(record: Mapping[str, object]) -> bool:
    """Whether the reset ``record`` is of ran in another boot: the start that read it from a
    state file of another boot marks it (``"rebooted": true``) before it saves the state as
    this boot's, and its resume keeps the mark in the records it writes."""
    return record.get("rebooted") is True


def _target_from(record: Mapping[str, object], hostname: str | None) -> ResetTarget | None:
    uuid = record.get("uuid")
    if not isinstance(uuid, str) or not is_a("uuid", uuid):  # hostile: shown in every event
        return None
    recovery = None
    if "recovery" in record:  # a MIG recovery's: never resumed as a whole GPU's reset
        recovery = from_record(record["recovery"])
        if recovery is None or recovery.uuid != uuid:
            return None
    layout = record.get("mig_layout", [])
    restored = [from_record(r) for r in layout] if isinstance(layout, list) else [None]
    if any(r is None or r.uuid != uuid for r in restored):
        return None  # a layout half read back would create the wrong instances
    return ResetTarget(
        layout=tuple(r for r in restored if r is not None),
        uuid=uuid,
        pci_bus_id=as_text(record.get("pci_bus_id")),
        minor=as_int(record.get("minor")),
        persistence_was_on=as_flag(record.get("persistence_was_on")),
        hostname=hostname,
        fabric=record.get("fabric") is True,
        recovery=recovery,
    )


def _read_back(
    record: Mapping[str, object], reset: ResetPolicy, hostname: str | None
) -> tuple[ResetStep, ResetTarget, Commands] | str | None:
    """The record's last step, target and commands (those the reset worked out when it
    started); None when done; else why it is unreadable."""
    name = as_one_of(*ResetStep)(record.get("step"))
    step = None if name is None else ResetStep(name)
    target = _target_from(record, hostname)
    if step is ResetStep.DONE:
        return None
    if step is None or target is None:
        return f"unreadable reset record {shown_record(record)!r}; nothing was changed"
    if "commands" in record:
        commands = commands_from_record(record["commands"], target)
        if isinstance(commands, str):
            return (f"unreadable reset record of {target.uuid}: its recorded commands: "
                    f"{commands}; nothing was changed")  # fmt: skip
        return step, target, commands
    # A record from before the commands were recorded: today's policy's (none when it cannot
    # build them; its after hooks still run).
    rebuilt = prepare_commands(target, reset)
    if isinstance(rebuilt, str):
        rebuilt = Commands((), (), None, None, after=prepare_hooks(reset.after, target))
    return step, target, rebuilt


def resume_interrupted(
    record: Mapping[str, object],
    reset: ResetPolicy,
    env: ResetEnvironment,
    *,
    runner: CommandRunner = run_command,
    hostname: str | None = None,
    fabric_wait: Callable[[ResetTarget, float], tuple[bool, str]] | None = None,
) -> ResetOutcome | None:
    """Finish or undo a reset that a crash or stop interrupted (the record's commands, never
    the reset command again); None if nothing is left to do. ``hostname`` fills
    ``{hostname}`` in an old record's commands; ``fabric_wait``: as :func:`perform_reset`'s.
    A record of another boot (:func:`of_another_boot`) runs no GPU command."""
    read = _read_back(record, reset, hostname)
    if read is None:
        return None
    if isinstance(read, str):
        env.emit(EventName.RESET_RESUME_FAILED, Level.ERROR, reason=read)
        return ResetOutcome(ResetResult.FAILED, ResetStep.DONE, read, False, None, ())
    step, target, commands = read

    proc = Procedure(target, reset, env, commands, dry_run=False, runner=runner)
    _progress_from(proc, record)
    proc.fabric_wait = fabric_wait
    env.emit(
        EventName.RESET_RESUMED,
        Level.WARNING,
        gpu=target.uuid,
        step=step.value,
        **fields_of(proc, ("reset_started", "persistence_off")),
    )
    if of_another_boot(record):
        return _after_reboot(proc, step)
    if proc.persistence_off and commands.persistence_on is None:
        proc.notes.append("persistence mode could not be restored: the command cannot be built")

    if not proc.reset_started:
        reason = f"interrupted at step {step.value} before the reset command ran; undone"
        return proc.abort(step, reason)

    if target.recovery is not None and step is ResetStep.RESET and proc.result is None:
        return _resume_recovery(proc, target.recovery, as_int(record.get("commands_done")))

    if proc.result is None or _to_check(proc, step):
        interrupted = f"interrupted at step {step.value} after the reset command started"
        return check_after_reset(proc, interrupted, resumed=True)

    reason = f"interrupted at step {step.value}; reset result was {proc.result}; finished"
    return proc.finish(
        proc.result, ResetStep.DONE, reason, needs_reboot=proc.needs_reboot, undo=True
    )


def _to_check(proc: Procedure, step: ResetStep) -> bool:
    """Whether a reset interrupted after its command started, with a result recorded, had its
    GPU still to check: the result is the reset command's, not the check's, or a MIG GPU's
    layout was left to create again."""
    # A MIG GPU's layout is created again after persistence mode is back on: a crash while it
    # was turned on left the restore to do (it creates only what the GPU lacks).
    restoring = bool(proc.target.layout) and step is ResetStep.PERSISTENCE_ON
    return step in (ResetStep.RESET, ResetStep.HEALTH_CHECK) or (
        restoring and proc.result is ResetResult.SUCCESS
    )


def _after_reboot(proc: Procedure, step: ResetStep) -> ResetOutcome:
    """A record of another boot (docs/internals.md): the reboot reset the GPU, set its
    persistence mode afresh and took every MIG instance down, so no GPU command is run; only
    the monitors' units are started and the after hooks run, with the recorded result."""
    proc.persistence_off, proc.rebooted = False, True  # its own records stay another boot's
    if not proc.reset_started:
        result = ResetResult.REFUSED
    elif proc.result is None or _to_check(proc, step):
        result = ResetResult.FAILED
    else:
        result = proc.result
    reason = f"interrupted at step {step.value} in another boot; {REBOOTED}"
    return proc.finish(result, ResetStep.DONE, reason, undo=True)


def _progress_from(proc: Procedure, record: Mapping[str, object]) -> None:
    """The interrupted reset's progress, as :meth:`Procedure.begin` recorded it."""
    proc.persistence_off = record.get("persistence_off") is True
    units = as_list(record.get("units_stopped"))  # the monitors' units: started again
    proc.units_stopped = [u for u in units if isinstance(u, str) and UNIT_NAME.fullmatch(u)]
    proc.reset_started = record.get("reset_started") is True
    # An unknown recorded result is no result: the GPU is checked again below.
    result = as_one_of(*ResetResult)(record.get("result"))
    proc.result = None if result is None else ResetResult(result)
    proc.needs_reboot = record.get("needs_reboot") is True  # once the result needed one


def _resume_recovery(proc: Procedure, recovery: InstanceRecovery, done: int | None) -> ResetOutcome:
    """Go on with a MIG recovery interrupted during its commands, ``done`` of them completed
    (None: not counted), after reading the GPU again (docs/internals.md)."""
    commands = proc.commands.reset
    total = len(commands)
    if done is not None and not 0 <= done <= total:
        done = None  # a count no run writes: not counted
    counted = "an unknown number" if done is None else str(done)
    interrupted = f"interrupted during the recovery's commands ({counted} of {total} done)"
    ran = commands[: done or 0]
    point: int | str
    try:
        gpu = proc.env.reread_gpu(proc.target)
    except Exception as err:  # unknown: nothing is run
        point = f"reading the GPU again failed: {err}"
    else:
        changed = instance_changed(recovery, gpu)
        if changed is None and not done:
            reason = f"{interrupted}; the instance is as planned: none took effect; undone"
            return proc.abort(ResetStep.RESET, reason)
        if changed is None:
            point = f"the instance is still listed as planned after {done} command(s)"
        elif not commands:
            point = "its commands cannot be built from today's configuration"
        else:
            point = resume_point(recovery, gpu, done, total)
    if isinstance(point, str):
        reason = half_done(recovery, ran, f"{interrupted}; {point}")
        return proc.finish(ResetResult.FAILED, ResetStep.DONE, reason, undo=True)
    if point < total:
        proc.commands_done = point
        if not proc.begin(ResetStep.RESET):
            reason = half_done(recovery, ran, UNRECORDED)
            return proc.finish(ResetResult.FAILED, ResetStep.DONE, reason, undo=True)
        command, result, reboot, why = run_recovery(proc, point, resumed=True)
        if result is not ResetResult.SUCCESS:
            reason = f"{interrupted}; {why}"
            return proc.finish(
                result, ResetStep.RESET, reason, needs_reboot=reboot, command=command, undo=True
            )
    went_on = f"went on at command {point + 1}" if point < total else "re-created already"
    return check_after_reset(proc, f"{interrupted}; {went_on}", resumed=True)
