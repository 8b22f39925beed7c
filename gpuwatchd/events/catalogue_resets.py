"""The event catalogue's GPU reset and health entries: their levels, fields and sentences.

A GPU's reset (and a MIG GPU instance's re-creation, the same events naming the instance), the
health drain around it, ``EventName.GPU_NEEDS_REBOOT``, ``EventName.EVIDENCE_UNSAVED``, and the
Xids the health findings are made of (``EventName.HEALTH_XID``, the kernel log's). Pure: no I/O.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from gpuwatchd.core.vocabulary import (
    RESET_STEPS,
    EventName,
    ResetResult,
    ResetStep,
    ResetStepStatus,
)
from gpuwatchd.events.words import (
    CRITICAL,
    ERROR,
    INFO,
    WARNING,
    EventSpec,
    Said,
    dry,
    outcome_table,
    short,
    spec,
    spec_table,
)

_STEP_STATUS = outcome_table(
    ResetStepStatus,
    """
    ok                done
    clear             no other process holds the GPU
    blocked           blocked by
    skipped           skipped
    failed            FAILED
    would_run         would run
    record_failed     could not be recorded in the state file
    memory_unknown    memory could not be read
    would_wait_fabric would wait for the NVLink fabric
    fabric_waiting    waiting for the NVLink fabric
    fabric_completed  the NVLink fabric is back
    fabric_stuck      the NVLink fabric is STUCK
    as_planned        the GPU read again is as planned
    changed           the GPU read again is NOT as planned
    """,
)


def _reset_step(s: Said) -> str:
    """``Reset of GPU-…, step 5/11 persistence_off: ran nvidia-smi -pm 0 … (exit 0).``"""
    step, status = str(s.f.get("step")), str(s.f.get("status"))
    number = f"{RESET_STEPS.index(ResetStep(step)) + 1}/{len(RESET_STEPS)} " if _known(step) else ""
    head = f"{s.subject()}, step {number}{short(step)}: "
    hooks = s.f.get("hooks")
    ran = s.argv() if s.has("argv") else None
    if ran is None and isinstance(hooks, list) and hooks:
        ran = "; ".join(short(shlex.join(map(str, h))) for h in hooks)
    if ran is not None and status in (ResetStepStatus.OK, ResetStepStatus.FAILED):
        code = f" (exit {s('returncode')})" if s.has("returncode") else ""
        said = f"{head}{'ran' if status == ResetStepStatus.OK else 'FAILED:'} {ran}{code}"
    else:
        said = head + _STEP_STATUS.get(status, short(status))
        if status == ResetStepStatus.CLEAR and s.has("instance"):
            said = head + "no process holds the GPU instance"
        if s.has("blockers"):
            said += f" {s.items('blockers')}"
        elif ran is not None:
            said += f" {ran}"
        elif s.has("would_run"):
            said += f" {s.items('would_run')}"
    if s.has("detail"):
        said += f" ({s('detail')})"
    return dry(s, said + ".")


def _known(step: str) -> bool:
    return step in {member.value for member in RESET_STEPS}


_RESET_OUTCOME = outcome_table(
    ResetResult,
    """
    success {gpu} was reset.
    dry_run Dry run: {gpu} would have been reset{reason:why}.
    refused Reset of {gpu} refused at step {step} and undone{reason:why}.
    in_use  Reset of {gpu} refused by the driver (in use){reason:why}.
    timeout Reset of {gpu} timed out at step {step}.
    *       Reset of {gpu} failed at step {step}{reason:why}.
    """,
)
# ``EventName.RESET_OUTCOME`` of a MIG GPU instance's re-creation (``instance`` is set).
_RECOVERY_OUTCOME = outcome_table(
    ResetResult,
    """
    success {instance} was re-created; its memory is free.
    dry_run Dry run: {instance} would have been re-created{reason:why}.
    refused {what} refused at step {step}, nothing destroyed{reason:why}.
    in_use  {what} refused at step {step}, nothing destroyed{reason:why}.
    *       {what} failed at step {step}{reason:why}.
    """,
)


def _reset_outcome(s: Said) -> str:
    recovery = s.has("instance")
    if not recovery and s.f.get("needs_reboot") is True:
        return f"{s.gpu()} needs a reboot: its reset ended {s('result')} at step {s('step')}."
    return s.by_outcome(
        _RECOVERY_OUTCOME if recovery else _RESET_OUTCOME,
        s.f.get("result"),
        instance=f"MIG GPU instance {s('gi', '?')} of {s.gpu()}",
        what=s.subject(),
    )


def _reset_dry_run(s: Said) -> str:
    if str(s.f.get("assumed", "")).startswith("success"):
        return (
            f"Dry run: {s.subject()} would have run; assumed to have succeeded for what"
            " follows (it counts against reset.max_resets)."
        )
    return f"Dry run: {s.subject()} would have been refused."


def _drain_started(s: Said) -> str:
    said = f"{s.gpu()} is drained for {s('kind')}"
    if s.f.get("drained_already"):
        said += " (its drain hooks ran already for this incident)"
    if s.has("blockers"):
        said += f"; the reset waits for {s.items('blockers')}, which are never signalled"
    return dry(s, said + ".")


def _needs_reboot(s: Said) -> str:
    return f"{s.gpu()} needs a reboot{s.why('why', 'reason', 'outcome')}."


RESET_EVENTS: Mapping[EventName, EventSpec] = {
    **spec_table(
        """
RESET_CONFIRMING DEBUG: FINDING why
    {gpu} may need a reset; waiting to be sure{why}.
RESET_REFUSED INFO WARNING DEBUG: FINDING why hidden_holder outcome pci_bus_id MIG
    No reset of {gpu} now{why}.
RESET_LIMIT_REACHED WARNING: FINDING why
    No reset of {gpu}: the reset limit is reached{why}.
RESET_CIRCUIT_OPEN CRITICAL: FINDING why
    No more GPU resets until cleared by hand{why}.
RESET_REFUSAL_CLEARED INFO: gpu finding in_use why
    A refused reset of {gpu} may be tried again{why}.
RESET_MIG_UNFINISHED_CLEARED INFO: gpu instance gi why
    MIG GPU instance {gi} of {gpu} is no longer half done{why}.
HEALTH_DRAIN_WAITING INFO: FINDING blockers until
    The reset of {gpu} still waits for {blockers:items} (never signalled).
HEALTH_DRAIN_TIMED_OUT CRITICAL: FINDING why blockers
    Draining {gpu} timed out{why}; on_failure hooks run.
RESET_RESUME WARNING: record
    A reset was interrupted by a stop or crash: finishing or undoing it now.
RESET_RESUMED WARNING: gpu result step reason needs_reboot
    The interrupted reset of {gpu} ended: {result}{reason:why}.
RESET_RESUME_FAILED ERROR: reason
    An interrupted reset could not be resumed{reason:why}.
RESET_DUE INFO: FINDING dry_run pci_bus_id minor lasted evidence mig_layout MIG
    {dry}{subject} starts ({kind:=a finding}{reason:why}).
RESET_SUCCEEDED INFO: RESET
    {subject} is booked as a success in the reset history.
RESET_FAILED INFO: RESET failures
    {subject} is booked as failed ({outcome}, failure {failures}); on_failure hooks follow.
RESET_FINISHED INFO WARNING ERROR CRITICAL: gpu result step reason needs_reboot blockers dry_run MIG
    {dry}{subject}: the procedure ended at step {step} ({result}).
RESET_CRASHED ERROR: gpu error
    {subject} crashed (a bug), booked as failed: {error}.
KERNEL_LOG_UNAVAILABLE WARNING: source why retry_in
    The kernel log ({source}) cannot be read{why}; Xids come from NVML alone until it can (tried
    again in {retry_in:seconds}).
KERNEL_LOG_DROPPED WARNING: lines kept
    The kernel log had {lines} Xid line(s) that were not counted: more distinct Xids, GPUs and
    processes in one poll than are kept ({kept}).
"""
    ),
    EventName.RESET_DRY_RUN: spec(INFO, "RESET assumed", _reset_dry_run),
    EventName.GPU_NEEDS_REBOOT: spec(CRITICAL, "RESET pid start_ticks why", _needs_reboot),
    # GPU health
    EventName.HEALTH_DRAIN_STARTED: spec(
        WARNING, "FINDING blockers timeout dry_run drained_already", _drain_started
    ),
    EventName.RESET_STEP: spec(
        INFO,
        "gpu step status dry_run blockers argv returncode detail output hooks would_run timeout"
        " duration monitors units remaining MIG",
        _reset_step,
        WARNING,
        ERROR,
    ),
    EventName.RESET_OUTCOME: spec(
        WARNING,
        "gpu pci_bus_id result step reason needs_reboot blockers dry_run MIG evidence_file",
        _reset_outcome,
        ERROR,
        CRITICAL,
    ),
    # kept before a reset, a re-creation, a drain or on_failure hooks (act/evidence.py)
    EventName.EVIDENCE_UNSAVED: spec(
        ERROR,
        "action gpu dry_run error",
        lambda s: (
            f"No evidence file was kept before {s('action')}"
            f"{' on ' + s.gpu() if s.has('gpu') else ''}{s.why('error')}; the step goes on,"
            " its reasons are in the journal."
        ),
    ),
    # the kernel log's Xids (collect/kernel_log.py, decide/health/xid_sources.py)
    EventName.HEALTH_XID: spec(
        INFO,
        "gpu xid xid_name xid_action count first last sources repeated before_start pid process"
        " job driver_text",
        lambda s: (
            f"Xid {s('xid')} ({s('xid_name')}) on {s.gpu()}, {s('count')} time(s)"
            + (" since it was last said" if s.f.get("repeated") is True else "")
            + (", logged before the daemon started" if s.f.get("before_start") is True else "")
            + (
                f", triggered by {s.names.process(s.f.get('pid'), s.f.get('process'))}"
                if s.has("pid")
                else ""
            )
            + (f" of job {s('job')}" if s.has("job") else "")
            + f": {s('xid_action')}."
        ),
        WARNING,
    ),
}
