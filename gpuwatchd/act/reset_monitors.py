"""The reset procedure's monitor steps: stop the monitors ``reset.monitors`` names, and start
their units again (docs/internals.md, section `gpuwatchd.act.reset`, steps ``stop_monitors``
and ``start_monitors``; which holders are monitors is decide/plan/monitors.py's).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from gpuwatchd.act.reset_result import quote_output
from gpuwatchd.act.reset_target import UNRECORDED, ResetOutcome, Steps
from gpuwatchd.core.vocabulary import Level, ResetStep, ResetStepStatus


def _systemctl(proc: Steps, verb: str, units: Sequence[str]) -> list[str]:
    """``systemctl stop|start UNIT`` for each unit (validated as ``NAME.service``): failures."""
    failures = []
    for unit in units:
        argv = ("systemctl", verb, unit)
        done = proc.runner(argv, timeout=proc.policy.timeout)
        if not done.ok:
            failures.append(f"{shlex.join(argv)}: {done.describe()}{quote_output(done.output)}")
    return failures


def stop_monitors(proc: Steps) -> tuple[ResetOutcome | None, frozenset[int]]:
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
    if proc.dry_run:
        how = [f"systemctl stop {unit}" for unit in units]
        how += ["SIGTERM"] if any(m.entry.unit is None for m in found) else []
        detail = "would stop " + ", ".join(monitors) + " (" + "; ".join(how) + ")"
        proc.event(step, ResetStepStatus.WOULD_RUN, monitors=monitors, units=units, detail=detail)
        return None, frozenset(m.identity.pid for m in found)
    proc.units_stopped = units  # recorded before the commands: an undo starts them regardless
    if units and not proc.begin(step):
        return proc.abort(step, UNRECORDED), frozenset()
    failures = _systemctl(proc, "stop", units)
    processes = [m for m in found if m.entry.unit is None]
    if not failures and processes:
        failures = proc.env.stop_monitors(proc.target, processes, proc.policy.timeout)
    proc.event(
        step,
        ResetStepStatus.FAILED if failures else ResetStepStatus.OK,
        level=Level.WARNING if failures else Level.INFO,
        monitors=monitors,
        detail="; ".join(failures) or "stopped " + ", ".join(monitors),
    )
    if failures:
        reason = "a monitor could not be stopped: " + "; ".join(failures)
        return proc.abort(step, reason), frozenset()
    return None, frozenset()


def start_monitors(proc: Steps) -> None:
    """Step ``start_monitors``: the units :func:`stop_monitors` stopped, started again."""
    step = ResetStep.START_MONITORS
    if not proc.units_stopped:
        proc.event(step, ResetStepStatus.SKIPPED, detail="no monitor unit was stopped")
        return
    proc.begin(step)
    failures = _systemctl(proc, "start", proc.units_stopped)
    proc.notes.extend(f"a monitor could not be started again: {f}" for f in failures)
    proc.event(
        step,
        ResetStepStatus.FAILED if failures else ResetStepStatus.OK,
        level=Level.WARNING if failures else Level.INFO,
        units=list(proc.units_stopped),
        detail="; ".join(failures) or f"{len(proc.units_stopped)} unit(s) started",
    )
    proc.units_stopped = []  # done: a resume must not start them again
