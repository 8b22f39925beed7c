"""One floor and one "who holds this GPU" for assess, plan and the final scan (decide/floor.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpuwatchd.config.schema import default_policy
from gpuwatchd.decide.assess import assess
from gpuwatchd.decide.assess_state import AssessState
from gpuwatchd.decide.floor import (
    infrastructure,
    live_holder,
    mps_server,
    reset_blockers,
    system_cgroup,
    unverified_infrastructure,
)
from gpuwatchd.decide.plan import PlanState, ResetIntent, plan
from gpuwatchd.decide.targets import refusal
from gpuwatchd.model import MIB, CgroupInfo, Finding, FindingKind, ProcessInfo
from tests.support.snapshots import HostBuilder, cg_container, cg_session, cg_unit

ROOT_EXE = {"uid": 0, "exe_trusted": True}


def _proc(pid: int, **fields: Any) -> ProcessInfo:
    return ProcessInfo(pid, 1, "S", 1, pid, pid, **fields)


@pytest.mark.parametrize(
    ("proc", "why"),
    [
        (ProcessInfo(1, 1, "S", 0, 1, 1, comm="systemd"), "pid 1 is init or kthreadd"),
        (ProcessInfo(2, 1, "S", 0, 0, 0, comm="kthreadd"), "pid 2 is init or kthreadd"),
        (ProcessInfo(9, 1, "S", 2, 0, 0, comm="kworker/0:1", kernel_thread=True), "kernel thread"),
        (
            _proc(70, comm="nvidia-persiste", exe="/usr/bin/nvidia-persistenced", **ROOT_EXE),
            "nvidia-persistenced",
        ),
        (_proc(71, comm="x", exe="/usr/bin/nv-hostengine", **ROOT_EXE), "nv-hostengine"),
        # Root's own names count (root needs no disguise), a 15-character cut included.
        (_proc(73, comm="nvidia-persiste", exe="/usr/bin/python3", **ROOT_EXE), "nvidia-persiste"),
        # nvidia-persistenced drops to its own user; its system service cgroup vouches for it.
        (
            _proc(
                74,
                comm="nvidia-persiste",
                exe="/usr/bin/nvidia-persistenced",
                uid=117,
                exe_trusted=True,
                cgroup=CgroupInfo("/system.slice/foo.service", systemd_unit="foo.service"),
            ),
            "nvidia-persistenced",
        ),
        (
            _proc(72, comm="worker", uid=1000, cgroup=cg_unit("nvidia-dcgm.service")),
            "infrastructure unit nvidia-dcgm.service",
        ),
    ],
)
def test_infrastructure_by_pid_kind_trusted_identity_and_system_unit(
    proc: ProcessInfo, why: str
) -> None:
    proc = dataclasses.replace(proc)  # a fresh object: the floor keeps its answer on each one
    reason = infrastructure(proc)
    assert reason is not None
    assert why in reason
    assert infrastructure(proc) == reason  # asked again (the kept answer), the same


USER_DCGM = CgroupInfo(
    "/user.slice/user-1001.slice/user@1001.service/app.slice/nvidia-dcgm.service",
    systemd_unit="nvidia-dcgm.service",
)
SESSION = cg_session(uid=1001)


@pytest.mark.parametrize(
    "proc",
    [
        # argv[0] and comm say MPS server; the program is the user's python.
        _proc(
            80,
            comm="nvidia-cuda-mp",
            exe="/usr/bin/python3",
            cmdline=("nvidia-cuda-mps-server",),
            uid=1001,
            exe_trusted=False,
            cgroup=SESSION,
        ),
        # A copy of the program in the user's home: owned by the user.
        _proc(81, exe="/home/u/bin/nv-hostengine", uid=1001, exe_trusted=False, cgroup=SESSION),
        # The genuine program, run by the user: root's file, the user's process.
        _proc(82, exe="/usr/bin/nv-hostengine", uid=1001, exe_trusted=True, cgroup=SESSION),
        # A service account renaming itself: only the executable's name counts for it.
        _proc(
            83,
            comm="nvidia-persiste",
            exe="/usr/sbin/apache2",
            uid=33,
            exe_trusted=True,
            cgroup=cg_unit("apache2.service"),
        ),
        # The user's own systemd manager may start a unit of any name.
        _proc(84, comm="worker", uid=1001, exe_trusted=False, cgroup=USER_DCGM),
        _proc(85, comm="worker", uid=0, exe_trusted=True, cgroup=USER_DCGM),
        # Root's program deleted and replaced: no longer the file that was installed.
        _proc(86, exe="/usr/bin/nv-hostengine (deleted)", uid=0, exe_trusted=False),
        # A container is not the system's cgroup, and its files are its image's.
        _proc(
            87,
            exe="/usr/bin/nv-hostengine",
            uid=1001,
            exe_trusted=True,
            cgroup=cg_container("ab" * 32),
        ),
        # Not root's program: a look-alike, even with its owner and cgroup unread.
        _proc(88, comm="nv-hostengine", exe="/tmp/nv-hostengine", exe_trusted=False, uid=None),
    ],
    ids=[
        "argv0-and-comm",
        "user-owned-copy",
        "genuine-program-run-by-a-user",
        "service-account-renamed",
        "user-manager-unit",
        "user-manager-unit-as-root",
        "deleted-program",
        "container",
        "untrusted-program-owner-unread",
    ],
)
def test_a_look_alike_is_an_ordinary_process(proc: ProcessInfo) -> None:
    proc = dataclasses.replace(proc)  # a fresh object: the floor keeps its answer on each one
    assert infrastructure(proc) is None
    assert not mps_server(proc)
    assert unverified_infrastructure(proc) is None  # known not to be it: may be a target


@pytest.mark.parametrize(
    "proc",
    [
        _proc(90, comm="nvidia-cuda-mp", exe="/usr/bin/nvidia-cuda-mps-server", uid=0),
        _proc(91, comm="nv-hostengine", uid=None, exe_trusted=True, cgroup=None),
        _proc(92, comm="nv-hostengine", exe=None, uid=0, exe_trusted=None),
    ],
    ids=["exe-owner-unread", "uid-and-cgroup-unread", "no-exe-link"],
)
def test_an_unverifiable_claim_is_never_signalled_and_grants_nothing(proc: ProcessInfo) -> None:
    """Unknown is never a kill; but neither does an unread identity make the process
    infrastructure (no reset immunity) or an MPS server (no report-only node)."""
    proc = dataclasses.replace(proc)  # a fresh object: the floor keeps its answer on each one
    assert infrastructure(proc) is None
    assert not mps_server(proc)
    assert unverified_infrastructure(proc) is not None
    finding = Finding(FindingKind.ORPHANED, "gpu", proc.pid, 1, "orphaned")
    snapshot = HostBuilder().build()
    why = refusal(proc, finding, snapshot, default_policy(), frozenset())
    assert why is not None
    assert why.startswith("floor: goes by")


def test_a_trusted_mps_server_makes_the_node_report_only_and_a_users_does_not() -> None:
    real = _proc(
        95,
        comm="nvidia-cuda-mps",
        exe="/usr/bin/nvidia-cuda-mps-server",
        uid=0,
        exe_trusted=True,
        cgroup=cg_unit("nvidia-mps.service"),
    )
    fake = dataclasses.replace(
        real, exe="/usr/bin/python3", uid=1001, cgroup=SESSION, exe_trusted=False
    )
    assert mps_server(real)
    assert not mps_server(fake)
    # Asked again (the answer kept on each object), the same.
    assert mps_server(real)
    assert not mps_server(fake)


def test_system_cgroup_is_below_system_slice_and_never_a_users_or_a_containers() -> None:
    assert system_cgroup(cg_unit("nvidia-dcgm.service")) is True
    assert system_cgroup(CgroupInfo("/init.scope")) is True
    assert system_cgroup(USER_DCGM) is False
    assert system_cgroup(SESSION) is False
    assert system_cgroup(cg_container("ab" * 32)) is False
    assert system_cgroup(CgroupInfo("/")) is False
    assert system_cgroup(None) is None
    user_below_system = CgroupInfo("/system.slice/user-1001.slice/x.service")
    assert system_cgroup(user_below_system) is False


def test_pid_3_is_judged_by_what_it_is_not_by_its_number() -> None:
    """Only PIDs 1 and 2 (init, kthreadd) are infrastructure by number."""
    assert infrastructure(_proc(3, comm="python", uid=1001, exe_trusted=False)) is None


def test_a_job_process_is_not_infrastructure() -> None:
    proc = ProcessInfo(500, 1, "S", 1, 500, 500, comm="python3", cgroup=cg_session())
    assert infrastructure(proc) is None
    # A 15-character comm that is no floor name's cut is not infrastructure either.
    other = _proc(501, comm="nvidia-persistX", uid=0, exe_trusted=True)
    assert infrastructure(other) is None


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
