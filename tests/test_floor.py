"""One floor and one "who holds this GPU" for assess, plan and the final scan (decide/floor.py)."""

from __future__ import annotations

import dataclasses

import pytest

from gpuwatchd.config.schema import default_policy
from gpuwatchd.decide.assess import assess
from gpuwatchd.decide.assess_state import AssessState
from gpuwatchd.decide.floor import infrastructure, live_holder, reset_blockers
from gpuwatchd.decide.plan import PlanState, ResetIntent, plan
from gpuwatchd.model import MIB, FindingKind, ProcessInfo
from tests.support.snapshots import HostBuilder, cg_session, cg_unit


@pytest.mark.parametrize(
    ("proc", "why"),
    [
        (ProcessInfo(1, 1, "S", 0, 1, 1, comm="systemd"), "pid 1 is init or kthreadd"),
        (ProcessInfo(9, 1, "S", 2, 0, 0, comm="kworker/0:1", kernel_thread=True), "kernel thread"),
        (ProcessInfo(70, 1, "S", 1, 70, 70, comm="nvidia-persiste"), "nvidia-persiste"),
        (
            ProcessInfo(71, 1, "S", 1, 71, 71, comm="x", exe="/usr/bin/nv-hostengine"),
            "nv-hostengine",
        ),
        (
            ProcessInfo(
                72, 1, "S", 1, 72, 72, comm="worker", cgroup=cg_unit("nvidia-dcgm.service")
            ),
            "infrastructure unit nvidia-dcgm.service",
        ),
    ],
)
def test_infrastructure_by_pid_kind_name_and_unit(proc: ProcessInfo, why: str) -> None:
    reason = infrastructure(proc)
    assert reason is not None
    assert why in reason


def test_a_job_process_is_not_infrastructure() -> None:
    proc = ProcessInfo(500, 1, "S", 1, 500, 500, comm="python3", cgroup=cg_session())
    assert infrastructure(proc) is None
    # A 15-character comm that is no floor name's cut is not infrastructure either.
    assert infrastructure(ProcessInfo(501, 1, "S", 1, 501, 501, comm="nvidia-persistX")) is None


def _dcgm_worker_host(monotonic: float) -> HostBuilder:
    # GPU 0 has 4 GiB allocated and its only holder is a process named "worker" that runs
    # inside nvidia-dcgm.service: infrastructure by unit, not by name.
    return (
        HostBuilder(monotonic=monotonic, wall_time=1_700_000_000.0 + monotonic)
        .gpu(0, allocated=4096 * MIB)
        .proc(600, comm="worker", cgroup=cg_unit("nvidia-dcgm.service"), holds={0}, uvm=True)
    )


def test_assess_and_plan_agree_that_an_infrastructure_unit_is_no_live_holder() -> None:
    """Before: assess said "no live process holds it" (ghost memory) while plan refused the
    reset with "live holder: pid 600 holds the GPU". Now plan goes on to the reset (whose final
    scan still refuses while DCGM holds the GPU: see the next test)."""
    pol = dataclasses.replace(default_policy(), dry_run=False)
    state, pstate = AssessState(), PlanState()
    intents: list[object] = []
    for now in (0.0, pol.reset.confirm_for + 1.0):
        snapshot = _dcgm_worker_host(now).build()
        assessment = assess(snapshot, state, pol.detection)
        state = assessment.state
        kinds = {f.kind for f in assessment.findings}
        assert kinds == {FindingKind.GHOST_MEMORY}
        result = plan(
            assessment.findings,
            snapshot,
            pstate,
            pol,
            now=now,
            wall=snapshot.wall_time,
            report_only=assessment.report_only,
            self_ancestors=frozenset(),
        )
        pstate = result.state
        refused = [e for e in result.events if e.name == "reset.refused"]
        assert not any("live holder" in str(e.fields.get("why")) for e in refused)
        intents.extend(result.intents)
    assert [type(i) for i in intents] == [ResetIntent]


def test_the_final_scan_still_refuses_while_infrastructure_holds_the_gpu() -> None:
    snapshot = _dcgm_worker_host(0.0).build()
    holders, procs = snapshot.holders, snapshot.processes
    assert live_holder(holders, procs, 0, frozenset()) is None
    (why,) = reset_blockers(holders, procs, 0, frozenset())
    assert "pid 600 (worker) holds the GPU's device file" in why


def test_a_job_holder_is_a_live_holder_and_a_blocker() -> None:
    snapshot = HostBuilder().gpu(0).proc(700, holds={0}, uvm=True).build()
    holders, procs = snapshot.holders, snapshot.processes
    assert live_holder(holders, procs, 0, frozenset()) == "pid 700 holds the GPU"
    assert live_holder(holders, procs, 0, frozenset({700})) is None  # ourselves
    assert reset_blockers(holders, procs, 0, frozenset())
    assert live_holder(holders, procs, None, frozenset()) is not None  # unknown is not none
