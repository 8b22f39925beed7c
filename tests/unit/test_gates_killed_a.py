"""Safety gates a mutation run found untested (tests/mutation), one behaviour each.

Which processes the collector reads systemd's delegation mark for (only those in an
infrastructure unit: then root's worker there is infrastructure, never signalled, and where the
mark cannot be read it is never signalled either); that known infrastructure is never reported
as "unverified"; and that processes whose owner cannot be read share one kill cap,
``uid:unknown``, so a storm of them latches that scope and nobody else's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.floor import infrastructure, unverified_infrastructure
from gpuwatchd.decide.plan.decisions import plan
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import Limits
from tests.support.fakeproc import FakeProc
from tests.support.plancases import orphan, policy, proc, signals, snap

# --- the delegation mark: read for infrastructure units only -----------------------------------

_UNMARKED = "unmarked"  # the unit's cgroup exists and carries no delegation mark
_GONE = "gone"  # no such cgroup: the mark cannot be read


@pytest.mark.parametrize(
    ("cgroup", "where", "delegated", "infra", "unverified"),
    [
        # Root's worker in an NVIDIA unit: the mark is read (none), so it is infrastructure.
        ("/system.slice/nvidia-dcgm.service", _UNMARKED, False,
         "infrastructure unit nvidia-dcgm.service", None),
        # An infrastructure program's own unit is read too (FLOOR_NAME_UNITS): there the mark
        # vouches for the program by name only, not for a worker of another name.
        ("/system.slice/nvidia-mps.service", _UNMARKED, False, None, None),
        # The unit's cgroup is gone: the mark is unknown, so it is never signalled.
        ("/system.slice/nvidia-imex.service", _GONE, None, None, "runs in nvidia-imex.service"),
        # No infrastructure unit: the mark is not read at all (unknown), and it is no floor.
        ("/system.slice/cron.service", _UNMARKED, None, None, None),
        ("/user.slice/user-1000.slice/session-4.scope", _UNMARKED, None, None, None),
    ],
    ids=["dcgm", "mps-own-unit", "imex-gone", "cron", "session"],
)  # fmt: skip
def test_the_collector_reads_the_delegation_mark_only_in_infrastructure_units(
    tmp_path: Path,
    *,
    cgroup: str,
    where: str,
    delegated: bool | None,
    infra: str | None,
    unverified: str | None,
) -> None:
    """A root process named ``worker`` (no infrastructure name) in ``cgroup``, read through a
    fake ``/proc`` whose mountinfo names a scratch folder as systemd's hierarchy (an unmarked
    folder reads as "no mark"). The infrastructure unit's answer rests on the mark; a process
    in any other unit is not asked, and known infrastructure is never "unverified"."""
    hierarchy = tmp_path / "cgroup"
    if where == _UNMARKED:
        (hierarchy / cgroup.strip("/")).mkdir(parents=True)
    fake = FakeProc(tmp_path / "proc")
    fake.write("self/mountinfo", f"41 31 0:38 / {hierarchy} rw,relatime - cgroup2 cgroup2 rw\n")
    fake.write("self/status", "CapEff:\t000001ffffffffff\n")  # CAP_SYS_ADMIN: marks readable
    fake.add(300, comm="worker", uid=0, cgroup=f"0::{cgroup}\n")
    info = ProcFS(str(fake.root)).read_process(300)
    assert info is not None
    assert info.cgroup is not None
    assert info.cgroup.delegated is delegated
    assert infrastructure(info) == infra
    why = unverified_infrastructure(info)
    assert (why if why is None else why[: len(unverified or "")]) == unverified


WALL = 1_700_000_000.0


# --- the kill cap of processes whose owner cannot be read --------------------------------------


def test_orphans_whose_owner_cannot_be_read_share_one_kill_cap_scope_uid_unknown() -> None:
    """Four orphans whose uid is unknown, a cap of two per poll: two are signalled, two start
    as dry runs, and the latch (kept in the state file) and its critical event name the one
    shared scope ``uid:unknown`` (docs/escalation.md); a known user's orphan in the same poll
    is still acted on."""
    pol = policy(limits=Limits(max_signalled_per_poll=2, max_signalled_per_hour=100))
    unknown = [proc(1000 + i, uid=None, user=None) for i in range(4)]
    known = proc(2000, uid=1002, user="olivia")
    everyone = [*unknown, known]
    r = plan([orphan(p) for p in everyone], snap(everyone), PlanState(), pol, now=0.0, wall=WALL)
    real = {s.identity.pid for s in signals(r) if not s.dry_run}
    assert len(real & {p.pid for p in unknown}) == 2
    assert known.pid in real
    reached = [e for e in r.events if e.name == EventName.LIMITS_KILL_CAP_REACHED]
    assert [e.fields["scope"] for e in reached] == ["uid:unknown"]
    assert set(r.state.scope_latches) == {"uid:unknown"}
    assert not r.state.forced_dry_run
