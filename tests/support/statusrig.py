"""A saved state directory and the ``status`` document rendered from it, for the status and verdict
tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuwatchd.cli.status import (
    describe,
)
from gpuwatchd.config.schema import parse_policy_documents
from gpuwatchd.core.vocabulary import EventName, LadderStatus
from gpuwatchd.decide.plan.state import Ladder, PlanState
from gpuwatchd.decide.policy import Policy
from gpuwatchd.state.status_document import build_document

NOW = 1_800_000_000.0  # wall
MONO = 50_000.0  # the same instant on the monotonic clock
BOOT = "0f8d3c1e-boot"
PID = 4242
POLICY = parse_policy_documents([("p.yaml", "interval: 5s\nstate_dir: /nonexistent-state\n")])
LADDER = Ladder(
    target="4250@900",
    pid=4250,
    start_ticks=900,
    finding_key="orphaned:GPU-1:4250@900",
    rule="orphans",
    gpu="GPU-1",
    steps=(("SIGTERM", 30.0), ("SIGKILL", 30.0)),
    step=1,
    due=MONO + 25.0,
    status=LadderStatus.ACTIVE,
    dry_run=False,
    started=MONO - 5.0,
)


def with_document(
    state: Mapping[str, object], *, policy: Policy, wall: float, monotonic: float | None
) -> dict[str, object]:
    """``state`` with its ``status.document`` worked out (:func:`build_document`), as the
    daemon writes it (``Daemon.save_state``); a state with no status section is returned as
    it is."""
    out = dict(state)
    status = state.get("status")
    if isinstance(status, Mapping):
        doc = build_document(state, policy=policy, wall=wall, monotonic=monotonic)
        out["status"] = {**status, "document": doc}
    return out


def plan_json(**changes: object) -> dict[str, object]:
    plan = PlanState(boot_id=BOOT, ladders={LADDER.target: LADDER}, last_wall=NOW - 2)
    data = plan.to_json()
    data.update(changes)
    return data


def saved(*, plan: dict[str, object] | None = None, **status: object) -> dict[str, object]:
    """A state file as the daemon writes it, polled 2 s before NOW; ``status`` overrides."""
    section: dict[str, object] = {
        "pid": PID,
        "started": NOW - 90_000,
        "last_poll": NOW - 2,
        "dry_run": False,
        "mode": "enforcing",
        "nvml": {"state": "ok", "error": None},
        "gpus": 8,
        "findings": 1,
        "policy": ["/etc/gpuwatchd/gpuwatchd.yaml"],
        "policy_rejected": None,
        "recent_actions": [
            {
                "at": NOW - 5,
                "event": EventName.ACTION_SIGNAL,
                "gpu": "GPU-1",
                "pid": 4250,
                "signal": "SIGTERM",
                "outcome": "delivered",
                "dry_run": False,
            }
        ],
    }
    section.update(status)
    return {
        "version": 1,
        "boot_id": BOOT,
        "saved_at": NOW - 2,
        "assess": {},
        "plan": plan_json() if plan is None else plan,
        "reset_in_progress": None,
        "status": section,
    }


Clock = tuple[float, float | None]


def run_describe(
    state: dict[str, object] | None,
    *,
    process: str | None = "gpuwatchd",
    written: Clock | None = (NOW, MONO),
    **kw: Any,
) -> dict[str, Any]:
    """``describe`` at NOW in the state's boot, its status document written by the daemon at
    ``written`` (its wall and monotonic clocks then; None: the state is taken as it is);
    ``kw`` overrides describe's arguments."""
    if state is not None and written is not None:
        state = with_document(state, policy=POLICY, wall=written[0], monotonic=written[1])
    args: dict[str, Any] = {
        "policy": POLICY,
        "now_wall": NOW,
        "now_monotonic": MONO,
        "boot_id": BOOT,
        "process": process,
    }
    args.update(kw)
    return describe(state, **args)
