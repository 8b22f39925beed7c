"""Hosts the orphan-evidence tests share: a launcher's family whose device files an heir
inherited (kcmp), and an heir whose session leader is gone."""

from __future__ import annotations

from gpuwatchd.core.model import MIB, Snapshot
from tests.support.snapshots import HostBuilder

LEAK = 20 * 1024 * MIB


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
