"""The GPU reset procedure: each step recorded first, so a restart can finish it.

In detail: docs/internals.md, section `gpuwatchd.act.reset`.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace
from functools import partial

from gpuwatchd.act.commands import CommandResult, run_command, run_hooks
from gpuwatchd.act.reset_target import (
    UNRECORDED,
    CommandRunner,
    Commands,
    FabricWait,
    ResetEnvironment,
    ResetOutcome,
    ResetTarget,
    fold_output,
    interpret_reset_exit,
    prepare_commands,
    quote_output,
    says_in_use,
)
from gpuwatchd.core.model import GpuInfo
from gpuwatchd.core.vocabulary import (
    EventName,
    Level,
    ResetResult,
    ResetStep,
    ResetStepStatus,
)
from gpuwatchd.decide.argv import hook_environment
from gpuwatchd.decide.mig.recovery import (
    InstanceRecovery,
    instance_changed,
    layout_missing,
    placement_taken,
)
from gpuwatchd.decide.policy import ResetPolicy

Ran = tuple[CommandResult | None, ResetResult, bool, str]  # the reset step's result and reading
# RESET_FINISHED's level by result (RESET_OUTCOME's are RESET_RESULT_LEVELS); else error
_FINISHED_LEVELS: Mapping[ResetResult, Level] = {
    ResetResult.SUCCESS: Level.INFO,
    ResetResult.DRY_RUN: Level.INFO,
    ResetResult.REFUSED: Level.WARNING,
    ResetResult.IN_USE: Level.WARNING,
}


def _finished(
    env: ResetEnvironment, target: ResetTarget, outcome: ResetOutcome, dry_run: bool, level: Level
) -> ResetOutcome:
    """``EventName.RESET_FINISHED`` said (critical when it needs a reboot); ``outcome``."""
    env.emit(
        EventName.RESET_FINISHED,
        Level.CRITICAL if outcome.needs_reboot else level,
        gpu=target.uuid,
        **outcome.fields(),
        dry_run=dry_run,
        **({} if target.recovery is None else target.recovery.fields()),
    )
    return outcome


@dataclass(eq=False)
class Procedure:
    """One run (or resume) of the procedure: the progress flags and the step helpers."""

    target: ResetTarget
    policy: ResetPolicy
    env: ResetEnvironment
    commands: Commands
    _: KW_ONLY
    dry_run: bool
    runner: CommandRunner
    drained: bool = False  # the drain hooks ran already (a health reset drains first)
    fabric_wait: FabricWait | None = None
    persistence_off: bool = False
    units_stopped: list[str] = field(default_factory=list)  # the units stop_monitors stopped
    reset_started: bool = False
    result: ResetResult | None = None
    needs_reboot: bool = False  # the result's: recorded, so a resume of the undo says it too
    commands_done: int = 0  # a MIG recovery's commands that completed (run_recovery)
    rebooted: bool = False  # the resume of another boot's reset: its records say so too
    notes: list[str] = field(default_factory=list)

    def begin(self, step: ResetStep) -> bool:
        """Record ``step`` before it runs. False if progress could not be persisted."""
        if self.dry_run:
            return True
        data: dict[str, object] = {
            # None when none was built (an old record's resume): that record is read as before
            **({"commands": self.commands.record()} if self.commands.reset else {}),
            "persistence_off": self.persistence_off,
            "units_stopped": list(self.units_stopped),
            "reset_started": self.reset_started,
            "result": self.result,
        }
        if self.target.recovery is not None:
            data["commands_done"] = self.commands_done
        if self.rebooted:  # a crash during its undo must not make it this boot's reset
            data["rebooted"] = True
        if self.needs_reboot:
            data["needs_reboot"] = True
        try:
            self.env.record_step(self.target, step, data)
        except Exception as err:  # any failure to persist is the same problem
            self.event(step, ResetStepStatus.RECORD_FAILED, detail=str(err), level=Level.ERROR)
            return False
        return True

    def event(
        self,
        step: ResetStep,
        status: ResetStepStatus,
        *,
        level: Level = Level.INFO,
        **fields: object,
    ) -> None:
        self.env.emit(
            EventName.RESET_STEP,
            level,
            gpu=self.target.uuid,
            step=step.value,
            status=status,
            dry_run=self.dry_run,
            **({} if self.target.recovery is None else self.target.recovery.fields()),
            **fields,
        )

    def ended(self, step: ResetStep, failures: Sequence[str], done: str, **fields: object) -> None:
        """The step's ``failed`` event (a warning) naming ``failures``, else its ``ok`` one."""
        self.event(
            step,
            ResetStepStatus.FAILED if failures else ResetStepStatus.OK,
            level=Level.WARNING if failures else Level.INFO,
            **fields,
            detail="; ".join(failures) or done,
        )

    def command(self, step: ResetStep, argv: tuple[str, ...]) -> CommandResult | None:
        """Run ``argv`` for ``step`` (None in dry-run) and emit the step's event."""
        if self.dry_run:
            self.event(step, ResetStepStatus.WOULD_RUN, argv=list(argv))
            return None
        result = self.runner(argv, timeout=self.policy.timeout)
        self.event(
            step,
            ResetStepStatus.OK if result.ok else ResetStepStatus.FAILED,
            level=Level.INFO if result.ok else Level.WARNING,
            argv=list(argv),
            detail=result.describe(),
            duration=round(result.duration, 3),
            output=fold_output(result.output),
        )
        return result

    def hooks(self, step: ResetStep, extra: Mapping[str, object] | None = None) -> str | None:
        """Run the hooks of ``step`` (every after hook; the drain and before hooks up to the
        first failure): the first failure's description, or None."""
        hooks, event, stop_on_failure = {
            ResetStep.DRAIN: (self.commands.drain, "reset_drain", True),
            ResetStep.BEFORE_HOOKS: (self.commands.before, "reset_before", True),
            ResetStep.AFTER_HOOKS: (self.commands.after, "reset_after", False),
        }[step]
        if not hooks:
            self.event(step, ResetStepStatus.SKIPPED, detail="no hooks configured")
            return None
        if self.dry_run:
            self.event(step, ResetStepStatus.WOULD_RUN, hooks=[list(h.argv) for h in hooks])
            return None
        instance = self.target.recovery  # a resume's too: read back from its record
        env = hook_environment(
            event,
            gpu_uuid=self.target.uuid,
            gpu_pci_bus_id=self.target.pci_bus_id,
            gpu_minor=self.target.minor,
            mig_instance=None if instance is None else instance.mig_uuid,
            mig_gi=None if instance is None else instance.gi,
            **(extra or {}),
        )
        # filled in already: the hooks recorded, or to be
        results = run_hooks(hooks, env=env, stop_on_failure=stop_on_failure, runner=self.runner)
        failures = [
            f"hook {list(r.argv)!r} failed: {r.describe()}{quote_output(r.output)}"
            for r in results
            if not r.ok
        ]
        ran = [list(r.argv) for r in results]
        self.ended(step, failures, f"{len(results)} hook(s) ran", hooks=ran)
        return failures[0] if failures else None

    def persistence_back_on(self) -> bool:
        """Persistence mode back on if this procedure turned it off (not back yet): True if so."""
        if not self.persistence_off or self.commands.persistence_on is None:
            return False
        self.begin(ResetStep.PERSISTENCE_ON)
        done = self.command(ResetStep.PERSISTENCE_ON, self.commands.persistence_on)
        if done is not None and not done.ok:
            self.notes.append(f"persistence mode could not be turned back on: {done.describe()}")
        else:
            self.persistence_off = False  # restored: a resume must not do it again
        return True

    def restore(self, result: ResetResult, reason: str) -> None:
        """Persistence mode back on (if this procedure turned it off), then the after hooks."""
        if not self.persistence_back_on():
            detail = "persistence mode not changed"
            self.event(ResetStep.PERSISTENCE_ON, ResetStepStatus.SKIPPED, detail=detail)
        _start_monitors(self)
        self.begin(ResetStep.AFTER_HOOKS)
        failure = self.hooks(ResetStep.AFTER_HOOKS, {"result": result, "reason": reason})
        if failure is not None:
            self.notes.append(failure)

    def finish(
        self,
        result: ResetResult,
        step: ResetStep,
        reason: str,
        *,
        needs_reboot: bool = False,
        command: CommandResult | None = None,
        blockers: Sequence[str] = (),
        undo: bool = False,
    ) -> ResetOutcome:
        """End with ``result``; ``undo``: recorded as the reset's result and undone first."""
        self.result, self.needs_reboot = result, needs_reboot
        if undo:
            self.restore(result, reason)
        reason = "; ".join([reason, *self.notes])
        self.begin(ResetStep.DONE)
        level = _FINISHED_LEVELS.get(ResetResult(result), Level.ERROR)
        outcome = ResetOutcome(result, step, reason, needs_reboot, command, tuple(blockers))
        return _finished(self.env, self.target, outcome, self.dry_run, level)

    def abort(self, step: ResetStep, reason: str, blockers: Sequence[str] = ()) -> ResetOutcome:
        """Stop before the reset command, undo, and report ``refused`` (or a dry run's verdict)."""
        self.restore(ResetResult.REFUSED, reason)
        result = ResetResult.DRY_RUN if self.dry_run else ResetResult.REFUSED
        reason = f"would be refused: {reason}" if self.dry_run else reason
        return self.finish(result, step, reason, blockers=blockers)

    def reread(
        self, step: ResetStep, judge: Callable[[GpuInfo | None], str | None], fine: str
    ) -> str | None:
        """The GPU read again and ``judge``d right before ``step`` acts: None when it is as the
        step needs it (said as ``fine``), else why not (unknown counts as changed)."""
        try:
            gpu = self.env.reread_gpu(self.target)
        except Exception as err:  # unknown is not as planned
            why: str | None = f"reading the GPU again failed: {err}"
        else:
            why = judge(gpu)
        self.event(
            step,
            ResetStepStatus.CHANGED if why else ResetStepStatus.AS_PLANNED,
            level=Level.WARNING if why else Level.INFO,
            detail=why or fine,
        )
        return why

    def health_check(self) -> tuple[bool, bool | None, str]:
        """(health command passed, memory back to baseline, detail); meaningless in a dry run."""
        self.begin(ResetStep.HEALTH_CHECK)
        done = self.command(ResetStep.HEALTH_CHECK, self.commands.health)
        if done is not None and not done.ok:
            return False, None, f"health check failed: {done.describe()}{quote_output(done.output)}"
        if done is not None and self.target.recovery is not None:
            return self.instance_check()
        if self.target.layout:  # a MIG GPU: its instances created again, then checked
            # Persistence mode first: a GPU the driver deinitialises loses its instances.
            self.persistence_back_on()
            self.begin(ResetStep.HEALTH_CHECK)  # a crash from here on resumes the restore
            back, detail = restore_layout(self)
            return True, back, f"health check passed; {detail}"
        if done is None:
            return True, None, "dry-run"
        try:
            memory = self.env.memory_back_to_baseline(self.target)
        except Exception as err:  # unknown, logged; never counted as good
            self.event(
                ResetStep.HEALTH_CHECK,
                ResetStepStatus.MEMORY_UNKNOWN,
                detail=str(err),
                level=Level.WARNING,
            )
            memory = None
        if memory is False:
            return True, False, "memory is not back to the baseline after the reset"
        if memory is None:
            return True, None, "health check passed; memory could not be verified"
        return True, True, "health check passed; memory back to baseline"

    def instance_check(self) -> tuple[bool, bool | None, str]:
        """After a MIG recovery: (health passed, instance back with its memory freed, detail)."""
        try:
            wrong = self.env.instance_back(self.target)
        except Exception as err:  # unknown is not back
            wrong = f"reading the GPU instance failed: {err}"
        if wrong is not None:
            self.event(ResetStep.HEALTH_CHECK, ResetStepStatus.MEMORY_UNKNOWN, detail=wrong,
                       level=Level.WARNING)  # fmt: skip
            return True, False, f"health check passed; the MIG GPU instance is not back: {wrong}"
        return True, True, "health check passed; the MIG GPU instance is back, its memory freed"


def perform_reset(
    target: ResetTarget,
    reset: ResetPolicy,
    env: ResetEnvironment,
    *,
    dry_run: bool,
    runner: CommandRunner = run_command,
    drained: bool = False,
    fabric_wait: FabricWait | None = None,
) -> ResetOutcome:
    """Run the whole procedure for ``target``; every way it ends is a :class:`ResetOutcome`,
    logged as ``EventName.RESET_FINISHED``. ``drained``: the caller ran the drain hooks already.
    ``fabric_wait``: for a ``target.fabric`` GPU (None: its reset counts as failed)."""
    prepared = prepare_commands(target, reset)
    if isinstance(prepared, str):
        outcome = ResetOutcome(ResetResult.REFUSED, ResetStep.DRAIN, prepared, False, None, ())
        return _finished(env, target, outcome, dry_run, Level.ERROR)
    proc = Procedure(
        target,
        reset,
        env,
        prepared,
        dry_run=dry_run,
        runner=runner,
        drained=drained,
        fabric_wait=fabric_wait,
    )
    return _up_to_final_scan(proc) or _reset_and_check(proc)


def _up_to_final_scan(proc: Procedure) -> ResetOutcome | None:
    """Steps drain to final_scan; an outcome when the procedure stopped (and was undone)."""
    if (stopped := _drain(proc) or _stop_nvml(proc)) is not None:
        return stopped

    if not proc.begin(ResetStep.BEFORE_HOOKS):
        return proc.abort(ResetStep.BEFORE_HOOKS, UNRECORDED)
    if (failure := proc.hooks(ResetStep.BEFORE_HOOKS)) is not None:
        return proc.abort(ResetStep.BEFORE_HOOKS, failure)

    stopped, would_stop = _stop_monitors(proc)
    if stopped is not None:
        return stopped

    if (stopped := _persistence_off(proc)) is not None:
        return stopped

    if not proc.begin(ResetStep.FINAL_SCAN):
        return proc.abort(ResetStep.FINAL_SCAN, UNRECORDED)
    try:
        # A dry run stops no monitor: those it would stop are not counted as holders.
        blockers = list(proc.env.final_blockers(proc.target, would_stop))
    except Exception as err:  # a scan that failed proves nothing: unknown blocks
        blockers = [f"the holder scan failed: {err}"]
    proc.event(
        ResetStep.FINAL_SCAN,
        ResetStepStatus.BLOCKED if blockers else ResetStepStatus.CLEAR,
        level=Level.WARNING if blockers else Level.INFO,
        blockers=blockers,
    )
    if blockers:
        reason = f"{len(blockers)} blocker(s): " + "; ".join(blockers)
        return proc.abort(ResetStep.FINAL_SCAN, reason, blockers)
    if proc.target.recovery is None and not proc.dry_run and (changed := _layout_changed(proc)):
        return proc.abort(ResetStep.FINAL_SCAN, f"the MIG layout changed since the plan: {changed}")
    return None


def _layout_changed(proc: Procedure) -> str | None:
    """A MIG GPU read again right before its reset: None when it has exactly the recorded
    layout (the reset takes down every instance, the restore creates the recorded ones), else
    what differs. Said as the final scan's reading."""
    layout = proc.target.layout

    def differs(gpu: GpuInfo | None) -> str | None:
        if not layout:  # out of MIG mode at the plan: no instance it has now is recorded
            if gpu is None:
                return "the GPU is not in the fresh NVML reading"
            mig = gpu.mig_enabled
            return None if mig is False else f"MIG mode is {'on' if mig else 'unknown'} now"
        missing = layout_missing(layout, gpu)
        found = 0 if gpu is None else len(gpu.mig_devices or ())
        if isinstance(missing, str):
            return missing
        if missing:
            return f"{len(missing)} of its {len(layout)} recorded GPU instance(s) are gone"
        if found != len(layout):  # one more, or a GPU instance split in compute instances
            return f"it has {found} compute instance(s) where {len(layout)} were recorded"
        return None

    fine = "the recorded MIG layout" if layout else "MIG mode still off"
    return proc.reread(ResetStep.FINAL_SCAN, differs, fine)


def _drain(proc: Procedure) -> ResetOutcome | None:
    """Step drain (skipped when a health reset drained already); an outcome when it stopped."""
    if not proc.begin(ResetStep.DRAIN):
        return proc.finish(ResetResult.REFUSED, ResetStep.DRAIN, UNRECORDED)
    if proc.drained and proc.commands.drain:
        proc.event(
            ResetStep.DRAIN, ResetStepStatus.SKIPPED, detail="drained already, before the wait"
        )
    elif (failure := proc.hooks(ResetStep.DRAIN)) is not None:
        return proc.abort(ResetStep.DRAIN, failure)
    return None


def _stop_nvml(proc: Procedure) -> ResetOutcome | None:
    """Step stop_nvml: our own NVML worker stopped; an outcome when it could not be."""
    step = ResetStep.STOP_NVML
    if not proc.begin(step):
        return proc.abort(step, UNRECORDED)
    if proc.dry_run:
        proc.event(step, ResetStepStatus.WOULD_RUN, detail="would stop the NVML worker")
        return None
    try:
        released = proc.env.stop_nvml()
    except Exception as err:  # an error here means "not released"
        released = False
        proc.notes.append(f"stopping NVML raised: {err}")
    proc.event(step, ResetStepStatus.OK if released else ResetStepStatus.FAILED)
    if not released:
        return proc.abort(step, "our own NVML worker still holds the device")
    return None


def _persistence_off(proc: Procedure) -> ResetOutcome | None:
    """Step persistence_off: persistence mode turned off when the policy toggles it and it
    was on (recorded first, so an undo restores it), else said skipped and why; an outcome
    when the command failed (undone)."""
    target, step = proc.target, ResetStep.PERSISTENCE_OFF
    skipped: str | None = None
    if target.recovery is not None:
        skipped = "a MIG GPU instance's re-creation leaves persistence mode as it is"
    elif not proc.policy.toggle_persistence:
        skipped = "toggle_persistence is off"
    elif target.persistence_was_on is False:
        skipped = "persistence mode was off"
    elif target.persistence_was_on is None:
        skipped = "persistence mode is unknown; left as it is"
    if skipped is not None:
        proc.event(step, ResetStepStatus.SKIPPED, detail=skipped)
        return None
    proc.persistence_off = True  # recorded before the command: undo restores it regardless
    if not proc.begin(step):
        return proc.abort(step, UNRECORDED)
    assert proc.commands.persistence_off is not None  # noqa: S101 - built by prepare_commands
    done = proc.command(step, proc.commands.persistence_off)
    if done is not None and not done.ok:
        reason = f"could not turn persistence mode off: {done.describe()}"
        return proc.abort(step, reason + quote_output(done.output))
    return None


def _reset_and_check(proc: Procedure) -> ResetOutcome:
    """Steps reset to done, once the final scan found the GPU clear."""
    target, prepared = proc.target, proc.commands
    proc.reset_started = True
    if not proc.begin(ResetStep.RESET):
        proc.reset_started = False
        return proc.abort(ResetStep.RESET, UNRECORDED)
    if proc.dry_run:
        for argv in prepared.reset:
            proc.command(ResetStep.RESET, argv)
        proc.health_check()
        if target.fabric:
            proc.event(ResetStep.HEALTH_CHECK, ResetStepStatus.WOULD_WAIT_FABRIC,
                       detail=f"would wait up to {proc.policy.fabric_timeout:g}s for the NVLink "
                       "fabric to reach COMPLETED")  # fmt: skip
        proc.restore(ResetResult.DRY_RUN, "dry-run")
        shown = " then ".join(repr(list(argv)) for argv in prepared.reset)
        what = f"reset {target.uuid}" if target.recovery is None else target.recovery.describe()
        return proc.finish(ResetResult.DRY_RUN, ResetStep.DONE, f"would {what} with {shown}")
    if target.recovery is not None:
        command, result, needs_reboot, reason = run_recovery(proc)
    else:
        command = proc.command(ResetStep.RESET, prepared.reset[0])
        assert command is not None  # noqa: S101 - not a dry run
        result, needs_reboot, reason = interpret_reset_exit(command)
    proc.result = result
    if result != ResetResult.SUCCESS:
        return proc.finish(
            result, ResetStep.RESET, reason, needs_reboot=needs_reboot, command=command, undo=True
        )
    return check_after_reset(proc, reason, command)


def check_after_reset(
    proc: Procedure, reason: str, command: CommandResult | None = None, *, resumed: bool = False
) -> ResetOutcome:
    """After the reset command succeeded, or a resume after it started: the GPU's health
    checked, then undone as after any reset. ``success`` only when it is healthy, its memory
    back (unknown will do, but not for a resume) and its NVLink fabric ready; else ``failed``
    at ``health_check`` (a resume's at ``done``)."""
    healthy, memory = True, None
    if not proc.commands.health:  # an old record's, when today's policy cannot build it
        detail = "the health check command cannot be built; GPU state unknown"
    else:
        healthy, memory, detail = proc.health_check()
    reason = f"{reason}; {detail}"
    ok = healthy and (memory is True or (memory is None and not resumed))
    if ok and proc.target.fabric:
        ok, fabric_detail = wait_for_fabric(proc)
        reason = f"{reason}; {fabric_detail}"
    result = ResetResult.SUCCESS if ok else ResetResult.FAILED
    step = ResetStep.DONE if ok or resumed else ResetStep.HEALTH_CHECK
    return proc.finish(result, step, reason, needs_reboot=not healthy, command=command, undo=True)


def wait_for_fabric(proc: Procedure) -> tuple[bool, str]:
    """The NVLink fabric after the reset: COMPLETED within ``fabric_timeout``, or the reset is
    not done. Fabric Manager is never stopped or restarted here, whatever the answer."""
    timeout = proc.policy.fabric_timeout
    proc.event(ResetStep.HEALTH_CHECK, ResetStepStatus.FABRIC_WAITING, timeout=timeout,
               detail="waiting for the NVLink fabric registration to reach COMPLETED")  # fmt: skip
    if proc.fabric_wait is None:
        completed, detail = False, "the NVLink fabric state cannot be read here"
    else:
        try:
            completed, detail = proc.fabric_wait(proc.target, timeout)
        except Exception as err:  # unknown is not completed
            completed, detail = False, f"reading the NVLink fabric failed: {err}"
    if completed:
        proc.event(ResetStep.HEALTH_CHECK, ResetStepStatus.FABRIC_COMPLETED, detail=detail)
        return True, detail
    text = (
        f"NVLink fabric not ready after the reset ({detail}): Fabric Manager must register the "
        "GPU; gpuwatchd never restarts it (without resetting every GPU that breaks NVLink "
        "SHARP for the GPUs still running)"
    )
    proc.event(ResetStep.HEALTH_CHECK, ResetStepStatus.FABRIC_STUCK, level=Level.ERROR, detail=text)
    return False, text


def _systemctl(proc: Procedure, verb: str, units: Sequence[str]) -> list[str]:
    """``systemctl stop|start UNIT`` for each unit (validated as ``NAME.service``): failures."""
    failures = []
    for unit in units:
        argv = ("systemctl", verb, unit)
        done = proc.runner(argv, timeout=proc.policy.timeout)
        if not done.ok:
            failures.append(f"{shlex.join(argv)}: {done.describe()}{quote_output(done.output)}")
    return failures


def _stop_monitors(proc: Procedure) -> tuple[ResetOutcome | None, frozenset[int]]:
    """Step ``stop_monitors``: an outcome when the procedure stopped (and was undone); in a dry
    run, the PIDs it would have stopped (the final scan does not count them)."""
    step = ResetStep.STOP_MONITORS
    if not proc.policy.monitors or proc.target.recovery is not None:
        why = "no reset.monitors" if not proc.policy.monitors else "a MIG GPU instance"
        proc.event(step, ResetStepStatus.SKIPPED, detail=why)
        return None, frozenset()
    if not proc.begin(step):
        return proc.abort(step, UNRECORDED), frozenset()
    try:
        found = proc.env.find_monitors(proc.target)
    except Exception as err:  # a scan that failed proves nothing: unknown blocks
        return proc.abort(step, f"the monitor scan failed: {err}"), frozenset()
    if not found:
        proc.event(step, ResetStepStatus.SKIPPED, detail="no listed monitor holds the GPU")
        return None, frozenset()
    units = sorted({m.entry.unit for m in found if m.entry.unit is not None})
    monitors = [m.who for m in found]
    processes = [m for m in found if m.entry.unit is None]  # no unit: stopped by SIGTERM
    if proc.dry_run:
        how = [f"systemctl stop {unit}" for unit in units] + (["SIGTERM"] if processes else [])
        detail = "would stop " + ", ".join(monitors) + " (" + "; ".join(how) + ")"
        proc.event(step, ResetStepStatus.WOULD_RUN, monitors=monitors, units=units, detail=detail)
        return None, frozenset(m.identity.pid for m in found)
    proc.units_stopped = units  # recorded before the commands: an undo starts them regardless
    if units and not proc.begin(step):
        return proc.abort(step, UNRECORDED), frozenset()
    failures = _systemctl(proc, "stop", units)
    if not failures and processes:
        failures = proc.env.stop_monitors(proc.target, processes, proc.policy.timeout)
    proc.ended(step, failures, "stopped " + ", ".join(monitors), monitors=monitors)
    if failures:
        reason = "a monitor could not be stopped: " + "; ".join(failures)
        return proc.abort(step, reason), frozenset()
    return None, frozenset()


def _start_monitors(proc: Procedure) -> None:
    """Step ``start_monitors``: the units :func:`_stop_monitors` stopped, started again."""
    step = ResetStep.START_MONITORS
    if not proc.units_stopped:
        proc.event(step, ResetStepStatus.SKIPPED, detail="no monitor unit was stopped")
        return
    proc.begin(step)
    failures = _systemctl(proc, "start", proc.units_stopped)
    proc.notes.extend(f"a monitor could not be started again: {f}" for f in failures)
    started = f"{len(proc.units_stopped)} unit(s) started"
    proc.ended(step, failures, started, units=list(proc.units_stopped))
    proc.units_stopped = []  # done: a resume must not start them again


# --- a MIG GPU instance's re-creation (its ``reset`` step) and a MIG GPU's layout restored -----


def half_done(recovery: InstanceRecovery, ran: Sequence[Sequence[str]], why: str) -> str:
    """Why a recovery is left half done, what completed, and what to do by hand."""
    done = "; ".join(shlex.join(argv) for argv in ran) or "nothing that completed"
    return (
        f"{why}; {recovery.describe()} is half done (ran: {done}): "
        "check `nvidia-smi mig -lgi` and re-create the instance by hand"
    )


def run_recovery(proc: Procedure, start: int = 0, *, resumed: bool = False) -> Ran:
    """``proc``'s recovery commands from ``start`` until one fails (docs/internals.md), never in
    a dry run: the last result (None when none ran) and its reading. ``resumed``: a destroy may
    have taken effect before the crash, so its failure proves nothing; the re-read decides."""
    recovery = proc.target.recovery
    assert recovery is not None  # noqa: S101 - called for a recovery only
    commands = proc.commands.reset
    last = len(commands) - 1
    result: CommandResult | None = None
    for number in range(start, len(commands)):
        ran = commands[:number]
        if number == 0 and not resumed:
            fine = "the planned instance"
            changed = proc.reread(ResetStep.RESET, partial(instance_changed, recovery), fine)
            if changed is not None:
                why = f"the instance changed since the plan ({changed}); nothing was run"
                return None, ResetResult.REFUSED, False, why
        if number == last and number > 0:
            fine = "its placement free for the re-create"
            taken = proc.reread(ResetStep.RESET, partial(placement_taken, recovery), fine)
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


def restore_layout(proc: Procedure) -> tuple[bool | None, str]:
    """After a MIG GPU's reset, the GPU instances a fresh reading lacks created again (MIG mode
    must be on; one command each, as prepare_commands and its reader check), each recorded
    first, then each checked back (docs/internals.md). (True, detail) when the layout is back;
    (False, why and the commands left to run by hand); (None, ...) in a dry run."""
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
    commands = "; ".join(shlex.join(restore[n]) for n in left)
    proc.event(step, ResetStepStatus.CHANGED, level=Level.ERROR, detail=why,
               remaining=[list(restore[n]) for n in left])  # fmt: skip
    return False, (
        f"the MIG layout is not restored: {why}; commands left to run by hand: "
        f"{commands or 'none; check `nvidia-smi mig -lgi`'}"
    )
