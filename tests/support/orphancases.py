"""Hosts the orphan-evidence tests share: a launcher's family whose device files an heir
inherited (kcmp), and an heir whose session leader is gone; and one assessment run, with or
without ``detection.orphans_without_history``."""

from __future__ import annotations

import dataclasses

from gpuwatchd.core.model import MIB, Snapshot
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.policy import Detection
from tests.support.snapshots import HostBuilder

LEAK = 20 * 1024 * MIB
DEFAULT = Detection()
OPT_IN = dataclasses.replace(DEFAULT, orphans_without_history=True)


def run(
    snapshot: Snapshot, previous: AssessState | None = None, detection: Detection = DEFAULT
) -> Assessment:
    """``assess`` over ``snapshot``, from ``previous`` or a fresh state of its boot."""
    state = previous if previous is not None else AssessState(boot_id=snapshot.boot_id)
    return assess(snapshot, state, detection)


def fd_family(at: float) -> HostBuilder:
    return (
        HostBuilder(monotonic=at)
        .gpu(0, allocated=LEAK)
        .gpu(1, allocated=LEAK)
        .proc(700, ppid=1, pgid=700, sid=700)
        .proc(810, ppid=700, holds={1}, uvm=True)
        .nvml(1, 810, used=LEAK)
    )


def fd_family_before(also: dict[int, bool] | None = None) -> Snapshot:
    """``also``: kcmp's answers about other owners (790, on GPU 1; or the rank 810)."""
    builder = fd_family(1000.0)
    builder.proc(800, ppid=700, holds={0}, uvm=True).nvml(0, 800, used=LEAK)
    builder.proc(815, ppid=800).proc(820, ppid=815, holds={0}, uvm=True, via="both")
    for owner, shared in (also or {}).items():
        if owner == 790:
            builder.proc(790, ppid=700, holds={1}, uvm=True).nvml(1, 790, used=LEAK)
        builder.sharing(820, owner, shared)
    return builder.sharing(820, 800, True).build()


def heir_host(at: float, *, owners_alive: bool) -> HostBuilder:
    builder = (
        HostBuilder(monotonic=at)
        .gpu(0)
        .gpu(1, allocated=LEAK)
        .gpu(2)
        .proc(4121, ppid=1, pgid=4100, sid=4100, holds={0, 1}, uvm=True)
    )
    if owners_alive:
        for pid in (4300, 4310):
            builder.proc(pid, ppid=1, holds={2}, uvm=True).nvml(2, pid, used=LEAK)
    else:
        builder.absent(4100)
    return builder


def owner_and_worker(leak: int = LEAK) -> Snapshot:
    """Owner 800 on GPU 0 (NVML lists it) and its child 801 holding GPU 0 too; kcmp says 801
    opened its own device files (it shares none with 800)."""
    return (
        HostBuilder(monotonic=1000.0)
        .gpu(0, allocated=leak)
        .nvml(0, 800, used=leak)
        .proc(800, ppid=1, holds={0}, uvm=True)
        .proc(801, ppid=800, holds={0}, uvm=True)
        .sharing(801, 800, False)
        .build()
    )
