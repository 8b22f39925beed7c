"""The ``reset`` step of a MIG GPU instance's re-creation: its commands, one recorded at a time.

In detail: docs/internals.md, section `gpuwatchd.act.reset_mig`.
"""

from __future__ import annotations

import shlex
from dataclasses import replace

from gpuwatchd.act.commands import CommandResult
from gpuwatchd.act.reset_target import (
    UNRECORDED,
    Steps,
    interpret_reset_exit,
    quote_output,
    says_in_use,
)
from gpuwatchd.core.vocabulary import Level, ResetResult, ResetStep, ResetStepStatus
from gpuwatchd.decide.mig.recovery import (
    InstanceRecovery,
    instance_changed,
    layout_missing,
    placement_taken,
)

Ran = tuple[CommandResult | None, ResetResult, bool, str]


HALF_DONE = "is half done"  # in every reason that leaves the instance for an administrator


def half_done(recovery: InstanceRecovery, ran: str, why: str) -> str:
    """The reason of a recovery left half done: what ran, and what to do by hand."""
    return (
        f"{why}; {recovery.describe()} {HALF_DONE} (ran: {ran or 'nothing that completed'}): "
        "check `nvidia-smi mig -lgi` and re-create the instance by hand"
    )


def _check(proc: Steps, recovery: InstanceRecovery, *, before_first: bool) -> str | None:
    """Read the parent GPU again: None when it is as the next command needs it (the plan's
    instance before the first; a free placement before the re-create), else why not."""
    try:
        gpu = proc.env.reread_gpu(proc.target)
    except Exception as err:  # unknown is not as planned
        why: str | None = f"reading the GPU again failed: {err}"
    else:
        why = instance_changed(recovery, gpu) if before_first else placement_taken(recovery, gpu)
    what = "the planned instance" if before_first else "its placement free for the re-create"
    proc.event(
        ResetStep.RESET,
        ResetStepStatus.CHANGED if why else ResetStepStatus.AS_PLANNED,
        level=Level.WARNING if why else Level.INFO,
        detail=why or what,
    )
    return why


def run_recovery(proc: Steps, start: int = 0, *, resumed: bool = False) -> Ran:
    """Run ``proc``'s recovery commands from ``start`` until one fails: (the last result, None
    when none ran or in a dry run; its reading). Only the first command of a fresh run may end
    ``in_use`` (nothing changed then). ``resumed``: a crash interrupted them, and a destroy
    command may already have taken effect, so its failure is no proof of anything; the reading
    before the re-create decides."""
    recovery = proc.target.recovery
    assert recovery is not None  # noqa: S101 - called for a recovery only
    commands = proc.commands.reset
    last = len(commands) - 1
    if proc.dry_run:
        for argv in commands:
            proc.command(ResetStep.RESET, argv)
        return None, ResetResult.DRY_RUN, False, "dry-run"
    result: CommandResult | None = None
    for number in range(start, len(commands)):
        ran = "; ".join(shlex.join(c) for c in commands[:number])
        if number == 0 and not resumed:
            changed = _check(proc, recovery, before_first=True)
            if changed is not None:
                why = f"the instance changed since the plan ({changed}); nothing was run"
                return None, ResetResult.REFUSED, False, why
        if number == last and number > 0:
            taken = _check(proc, recovery, before_first=False)
            if taken is not None:
                why = f"the destroy commands did not free its placement ({taken})"
                return result, ResetResult.FAILED, False, half_done(recovery, ran, why)
        proc.commands_done = number
        if number > start and not proc.begin(ResetStep.RESET):
            return result, ResetResult.FAILED, False, half_done(recovery, ran, UNRECORDED)
        result = proc.command(ResetStep.RESET, commands[number])
        assert result is not None  # noqa: S101 - not a dry run
        verdict, needs_reboot, reason = interpret_reset_exit(result)
        if verdict is ResetResult.SUCCESS:
            continue
        if number == 0 and not resumed and says_in_use(result):
            # Nothing was destroyed: the driver refuses while anything uses the instance.
            what = recovery.describe().removeprefix("re-create ")
            reason = (
                f"the driver says {what} is in use by another client, which the final holder "
                f"scan did not see{quote_output(result.output)}"
            )
            return result, ResetResult.IN_USE, needs_reboot, reason
        if resumed and number < last:
            proc.notes.append(f"resumed: {shlex.join(commands[number])} failed ({reason})")
            continue  # it may have taken effect before the crash; the next reading tells
        if number > 0 or resumed:
            verdict = ResetResult.TIMEOUT if verdict is ResetResult.TIMEOUT else ResetResult.FAILED
            reason = half_done(recovery, ran, reason)
        return result, verdict, needs_reboot, reason
    proc.commands_done = len(commands)
    output = "" if result is None else quote_output(result.output)
    return result, ResetResult.SUCCESS, False, f"{recovery.describe()}: done{output}"


def restore_layout(proc: Steps) -> tuple[bool | None, str]:
    """After a MIG GPU's reset (``proc.target.layout``): the GPU read again (MIG mode must be
    on), each GPU instance it lacks created again by its command (``proc.commands.restore``),
    progress recorded before each, then each instance checked back (GI profile, placement,
    listed in mig-minors, memory at its baseline). (True, detail) when the layout is back;
    (False, why, naming the commands left to run by hand); (None, ...) in a dry run. Run
    again after a crash, it creates only what a fresh reading still lacks."""
    layout, restore, step = proc.target.layout, proc.commands.restore, ResetStep.HEALTH_CHECK
    if proc.dry_run:
        for argv in restore:
            proc.command(step, argv)
        return None, "dry-run"
    left = list(range(len(layout)))
    why: str | None = None
    try:
        missing = layout_missing(layout, proc.env.reread_gpu(proc.target))
    except Exception as err:  # unknown is not restored
        missing = f"reading the GPU again failed: {err}"
    if isinstance(missing, str):
        why = f"MIG mode is not confirmed after the reset: {missing}"
    elif len(restore) != len(layout):
        why = "the commands creating its GPU instances cannot be built from the configuration"
    else:
        left = list(missing)
        todo = f"MIG mode on; {len(left)} of {len(layout)} GPU instance(s) to create"
        proc.event(step, ResetStepStatus.AS_PLANNED, detail=todo)
        for number in missing:
            if not proc.begin(step):
                why = UNRECORDED
                break
            result = proc.command(step, restore[number])
            if result is not None and not result.ok:
                why = f"{shlex.join(restore[number])} failed: {result.describe()}"
                why += quote_output(result.output)
                break
            left.remove(number)
    if why is None:
        for instance in layout:
            try:
                wrong = proc.env.instance_back(replace(proc.target, recovery=instance, layout=()))
            except Exception as err:  # unknown is not back
                wrong = f"reading it failed: {err}"
            if wrong is not None:
                why = f"{instance.describe().removeprefix('re-create ')} is not back: {wrong}"
                break
    if why is None:
        return True, f"its MIG layout is back ({len(layout)} GPU instance(s))"
    commands = "; ".join(shlex.join(restore[n]) for n in left if n < len(restore))
    proc.event(step, ResetStepStatus.CHANGED, level=Level.ERROR, detail=why,
               remaining=[list(restore[n]) for n in left if n < len(restore)])  # fmt: skip
    return False, (
        f"the MIG layout is not restored: {why}; commands left to run by hand: "
        f"{commands or 'none; check `nvidia-smi mig -lgi`'}"
    )
