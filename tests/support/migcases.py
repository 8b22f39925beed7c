"""Hand-built MIG hosts shared by the MIG assessment, plan and report tests: two GPU instances, a
leak beside a live job, one assessment run, and the plan polled over one snapshot."""

from __future__ import annotations

from collections.abc import Iterator

from gpuwatchd.core.model import MIB, Snapshot
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.plan.decisions import plan
from gpuwatchd.decide.plan.intents import PlanResult, ResetIntent
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import Detection, Policy
from tests.support.migsnap import Inst, mig_uuid, with_mig
from tests.support.snapshots import HostBuilder

LEAK = 4 * 1024 * MIB
GI1 = mig_uuid(0, 1)
GI2 = mig_uuid(0, 2)


def run(snapshot: Snapshot, previous: AssessState | None = None) -> Assessment:
    state = previous if previous is not None else AssessState(boot_id=snapshot.boot_id)
    return assess(snapshot, state, Detection())


def polls(snapshot: Snapshot, chosen: Policy, steps: int) -> Iterator[tuple[float, PlanResult]]:
    """Plan the same snapshot every 10 s, ``steps`` times, from an empty plan state: each poll's
    time and result."""
    result = run(snapshot)
    state = PlanState()
    for step in range(steps):
        now = snapshot.monotonic + 10.0 * step
        out = plan(result.findings, snapshot, state, chosen, now=now, wall=now,
                   report_only=result.report_only)  # fmt: skip
        state = out.state
        yield now, out


def play(snapshot: Snapshot, chosen: Policy, steps: int = 12) -> list[ResetIntent]:
    """The reset intents ``polls`` asked for."""
    return [i for _, out in polls(snapshot, chosen, steps) for i in out.intents
            if isinstance(i, ResetIntent)]  # fmt: skip


def first_reset(snapshot: Snapshot, chosen: Policy) -> tuple[ResetIntent, PlanState, float]:
    """The first reset intent of 12 ``polls``, with the plan state and time of its poll."""
    for now, out in polls(snapshot, chosen, 12):
        asked = [i for i in out.intents if isinstance(i, ResetIntent)]
        if asked:
            return asked[0], out.state, now
    raise AssertionError("no reset intent in 12 polls")


def leak_beside_live_job(**mig: object) -> Snapshot:
    """GI 1: its trainer 600 died (NVML still lists it), its worker 601 (session 600) holds
    GI 1's capabilities. GI 2: a live trainer 700 with its worker 701. All hold /dev/nvidia0."""
    base = (
        HostBuilder()
        .gpu(0)
        .gpu(1)
        .proc(601, ppid=1, pgid=600, sid=600, holds={0}, uvm=True)
        .proc(700, ppid=1, pgid=700, sid=700, holds={0}, uvm=True)
        .proc(701, ppid=700, holds={0}, uvm=True)
        .build()
    )
    options: dict[str, object] = {
        "instances": [
            Inst(1, allocated=LEAK, processes=((600, LEAK),)),
            Inst(2, allocated=LEAK, processes=((700, LEAK),), profile="3g.40gb"),
        ],
        "caps": {601: [(1, 0)], 700: [(2, 0)], 701: [(2, 0)]},
    }
    options.update(mig)
    return with_mig(base, **options)  # type: ignore[arg-type]
