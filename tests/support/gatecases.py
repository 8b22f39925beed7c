"""Hosts, policies and findings shared by the reset-gate and ladder-gate tests, and readers of what
a plan decided."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gpuwatchd.core.model import (
    MIB,
    Finding,
    FindingKind,
    Snapshot,
)
from gpuwatchd.decide import policy
from gpuwatchd.decide.plan.decisions import plan
from gpuwatchd.decide.plan.intents import HookIntent, PlanResult, ResetIntent, SignalIntent
from gpuwatchd.decide.plan.outcomes import record_signal
from gpuwatchd.decide.plan.state import PlanState
from tests.support.snapshots import HostBuilder, gpu_uuid

SELF = 4242  # the daemon's NVML worker
GPU0, GPU1 = gpu_uuid(0), gpu_uuid(1)
WALL = 1_700_000_000.0


def _ghost(gpu: str = GPU0) -> Finding:
    return Finding(
        kind=FindingKind.GHOST_MEMORY, gpu=gpu, pid=None, start_ticks=None,
        reason="4096 MiB allocated, no live process holds it", memory=4096 * MIB,
    )  # fmt: skip


def _policy(**changes: object) -> policy.Policy:
    base = policy.Policy(
        dry_run=False,
        rules=(
            policy.Rule(
                "orphans",
                FindingKind.ORPHANED,
                (policy.Step("SIGTERM", 30.0), policy.Step("SIGKILL", 10.0)),
            ),
        ),
        limits=policy.Limits(
            max_signalled_per_poll=4, max_signalled_per_hour=32, post_action_delay=0.0
        ),
        reset=policy.ResetPolicy(confirm_for=60.0, cooldown=600.0, max_resets=2, window=3600.0),
        health=policy.HealthPolicy(action="reset", drain_timeout=600.0),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def _plan(
    findings: Sequence[Finding],
    snapshot: Snapshot,
    state: PlanState,
    pol: policy.Policy,
    now: float,
) -> PlanResult:
    return plan(findings, snapshot, state, pol, now=now, wall=WALL + now)


def _resets(result: PlanResult) -> list[ResetIntent]:
    return [i for i in result.intents if isinstance(i, ResetIntent)]


def _signals(result: PlanResult) -> list[SignalIntent]:
    return [i for i in result.intents if isinstance(i, SignalIntent)]


def _hooks(result: PlanResult, name: str | None = None) -> list[HookIntent]:
    return [i for i in result.intents if isinstance(i, HookIntent) and name in (None, i.hook)]


def _whys(result: PlanResult, name: str) -> list[str]:
    return [str(e.fields.get("why")) for e in result.events if e.name == name]


JOB = 700


def _job_host(*, holds: frozenset[int] = frozenset({0}), **changes: object) -> HostBuilder:
    builder = HostBuilder(self_pids=frozenset({SELF})).gpu(0).gpu(1)
    builder.proc(JOB, user="bob", cmdline=("python3", "train.py"), holds=holds, uvm=True)
    if changes:
        builder.change(JOB, **changes)
    return builder


def _orphan(snapshot: Snapshot, gpu: str = GPU0) -> Finding:
    proc = snapshot.processes[JOB]
    return Finding(
        kind=FindingKind.ORPHANED, gpu=gpu, pid=JOB, start_ticks=proc.start_ticks,
        reason="inherited the GPU from dead owner PID 600", memory=512 * MIB,
        evidence={"uvm": True, "tie": "dead_owner"},
    )  # fmt: skip


def _after_sigterm(pol: policy.Policy) -> tuple[PlanState, Finding]:
    """A ladder for JOB whose SIGTERM was delivered at 0; the SIGKILL is due at 30."""
    snapshot = _job_host().build()
    finding = _orphan(snapshot)
    first = _plan([finding], snapshot, PlanState(), pol, 0.0)
    (sigterm,) = _signals(first)
    assert (sigterm.signal, sigterm.step, sigterm.dry_run) == ("SIGTERM", 1, False)
    return record_signal(first.state, sigterm, "delivered", now=0.0).state, finding


def _protect(**kw: object) -> policy.Policy:
    return _policy(protect=policy.Protect(**kw))  # type: ignore[arg-type]


RESET_DRAIN = (policy.Hook(("drain-node", "{uuid}")),)


def _health(kind: FindingKind = FindingKind.RESET_REQUIRED, gpu: str = GPU0) -> Finding:
    return Finding(
        kind=kind, gpu=gpu, pid=None, start_ticks=None,
        reason="the driver's recovery action is GPU_RESET (1)", evidence={},
    )  # fmt: skip


def _idle_host(*, job_on: int | None = None) -> Snapshot:
    builder = HostBuilder(self_pids=frozenset({SELF})).gpu(0).gpu(1)
    if job_on is not None:
        builder.proc(JOB, holds={job_on}, uvm=True).nvml(job_on, JOB)
    return builder.build()
