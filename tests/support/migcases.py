"""Hand-built MIG hosts shared by the MIG assessment and report tests: two GPU instances, a leak
beside a live job, and one assessment run."""

from __future__ import annotations

from gpuwatchd.core.model import MIB, Snapshot
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.policy import Detection
from tests.support.migsnap import Inst, mig_uuid, with_mig
from tests.support.snapshots import HostBuilder

LEAK = 4 * 1024 * MIB
GI1 = mig_uuid(0, 1)
GI2 = mig_uuid(0, 2)


def run(snapshot: Snapshot, previous: AssessState | None = None) -> Assessment:
    state = previous if previous is not None else AssessState(boot_id=snapshot.boot_id)
    return assess(snapshot, state, Detection())


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
