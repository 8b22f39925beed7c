"""One floor and one "who holds this GPU" for assess, plan and the final scan (decide/floor.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpuwatchd.collect.cgroups import classify_cgroup_path
from gpuwatchd.config.schema import default_policy
from gpuwatchd.core.model import MIB, CgroupInfo, Finding, FindingKind, ProcessInfo
from gpuwatchd.core.paths import NVML_LAUNCHER_FILE, NVML_WORKER_FILE
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.floor import (
    infrastructure,
    live_holder,
    mps_server,
    reset_blockers,
    system_cgroup,
    unverified_infrastructure,
)
from gpuwatchd.decide.plan.decisions import plan
from gpuwatchd.decide.plan.intents import ResetIntent
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.targets import refusal
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
        # nvidia-persistenced drops to its own user; its own unit vouches for it.
        (_proc(74, comm="nvidia-persiste", exe="/usr/bin/nvidia-persistenced", uid=117,
               exe_trusted=True, cgroup=cg_unit("nvidia-persistenced.service")),
         "nvidia-persistenced"),
        (
            _proc(72, comm="worker", uid=0, cgroup=cg_unit("nvidia-dcgm.service")),
            "infrastructure unit nvidia-dcgm.service",
        ),
    ],
)  # fmt: skip
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
        _proc(80, comm="nvidia-cuda-mp", exe="/usr/bin/python3",
              cmdline=("nvidia-cuda-mps-server",), uid=1001, exe_trusted=False, cgroup=SESSION),
        # A copy of the program in the user's home: owned by the user.
        _proc(81, exe="/home/u/bin/nv-hostengine", uid=1001, exe_trusted=False, cgroup=SESSION),
        # The genuine program, run by the user: root's file, the user's process.
        _proc(82, exe="/usr/bin/nv-hostengine", uid=1001, exe_trusted=True, cgroup=SESSION),
        # A service account renaming itself: only the executable's name counts for it.
        _proc(83, comm="nvidia-persiste", exe="/usr/sbin/apache2", uid=33, exe_trusted=True,
              cgroup=cg_unit("apache2.service")),
        # The user's own systemd manager may start a unit of any name.
        _proc(84, comm="worker", uid=1001, exe_trusted=False, cgroup=USER_DCGM),
        _proc(85, comm="worker", uid=0, exe_trusted=True, cgroup=USER_DCGM),
        # Root's program deleted and replaced: no longer the file that was installed.
        _proc(86, exe="/usr/bin/nv-hostengine (deleted)", uid=0, exe_trusted=False),
        # A container is not the system's cgroup, and its files are its image's.
        _proc(87, exe="/usr/bin/nv-hostengine", uid=1001, exe_trusted=True,
              cgroup=cg_container("ab" * 32)),
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
)  # fmt: skip
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
    assert system_cgroup(CgroupInfo("/init.scope", delegated=False)) is True
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
        .proc(600, comm="worker", uid=0, cgroup=cg_unit("nvidia-dcgm.service"), holds={0}, uvm=True)
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
        refused = [e for e in result.events if e.name == EventName.RESET_REFUSED]
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


# --- issue 34, finding 3: below system.slice is not yet root's placement --------------------


def _placed(path: str, *, delegated: bool | None = False) -> CgroupInfo:
    """``path`` as collection reads it: the parser's reading, and the delegation mark."""
    return dataclasses.replace(classify_cgroup_path(path), delegated=delegated)


SLURM_TASK = "/system.slice/slurmstepd.scope/job_42/step_0/user/task_0"
USERS_PROGRAM = {"uid": 1001, "exe_trusted": True}  # root's genuine program, run by a user


@pytest.mark.parametrize(
    ("exe", "cgroup"),
    [
        ("/usr/bin/nvidia-smi", _placed(SLURM_TASK)),
        ("/usr/bin/nvidia-cuda-mps-control", _placed(SLURM_TASK)),
        ("/usr/bin/nvidia-cuda-mps-server", _placed(SLURM_TASK)),
        # Several slurmd per host name their scope <node>_slurmstepd.scope.
        ("/usr/bin/nvidia-smi", _placed("/system.slice/n1_slurmstepd.scope/job_7/step_0")),
        # Slurm's own processes of the scope, where the parser names no job.
        ("/usr/bin/nvidia-smi", _placed("/system.slice/slurmstepd.scope/system")),
        # cgroup v1: slurm/uid_<UID>/job_<ID>.
        ("/usr/bin/nv-hostengine", _placed("/slurm/uid_1001/job_7/step_0/task_0")),
        # A crontab job where cron's PAM stack has no pam_systemd.
        ("/usr/bin/nvidia-smi", _placed("/system.slice/cron.service")),
        ("/usr/bin/nvidia-cuda-mps-control", _placed("/system.slice/cron.service")),
        # An ssh session without pam_systemd; a JupyterHub kernel in the hub's unit.
        ("/usr/bin/nvidia-persistenced", _placed("/system.slice/ssh.service")),
        ("/usr/bin/nv-hostengine", _placed("/system.slice/jupyterhub.service")),
        # A Delegate= unit (systemd's mark): its manager places users' work below it.
        ("/usr/bin/nvidia-smi", _placed("/system.slice/batch.service/w1", delegated=True)),
        # The program's own unit, but delegated: not root's placement any more.
        (
            "/usr/bin/nvidia-persistenced",
            _placed("/system.slice/nvidia-persistenced.service", delegated=True),
        ),
        # The program's own unit name below another unit: the unit's own sub-cgroup.
        ("/usr/bin/nv-hostengine", _placed("/system.slice/batch.service/nvidia-dcgm.service")),
    ],
    ids=[
        "slurm-job-nvidia-smi",
        "slurm-job-mps-control",
        "slurm-job-mps-server",
        "slurm-job-several-slurmd",
        "slurmstepd-scope-without-job",
        "slurm-v1-job",
        "cron-without-pam-systemd",
        "cron-mps-control",
        "sshd-without-pam-systemd",
        "jupyterhub-kernel",
        "delegated-unit",
        "own-unit-delegated",
        "own-unit-name-below-another-unit",
    ],
)
def test_a_users_run_of_roots_program_below_system_slice_is_an_ordinary_process(
    exe: str, cgroup: CgroupInfo
) -> None:
    """Before: below system.slice was "a system service's cgroup", so root's program run by a
    user there (a Slurm job, a crontab, an ssh session) was infrastructure: never a finding,
    no live holder, and an MPS daemon started there made the whole node report-only."""
    name = exe.rsplit("/", 1)[1]
    proc = _proc(600, comm=name[:15], exe=exe, cmdline=(exe,), cgroup=cgroup, **USERS_PROGRAM)
    assert infrastructure(proc) is None
    assert not mps_server(proc)
    assert unverified_infrastructure(proc) is None  # known: an ordinary process


@pytest.mark.parametrize(
    "proc",
    [
        # A user's process in a display manager's unit (a session without pam_systemd).
        _proc(610, comm="python3", uid=1001, cgroup=cg_unit("lightdm.service")),
        # A user's process in an NVIDIA unit: only root's processes count there by the unit.
        _proc(611, comm="worker", uid=1001, cgroup=cg_unit("nvidia-dcgm.service")),
        # Root's process in a delegated NVIDIA unit.
        _proc(612, comm="worker", uid=0, cgroup=cg_unit("nvidia-dcgm.service", delegated=True)),
    ],
    ids=["display-manager-session", "users-process-in-dcgm-unit", "delegated-dcgm-unit"],
)
def test_a_process_in_an_infrastructure_unit_counts_only_as_roots_placed_by_root(
    proc: ProcessInfo,
) -> None:
    assert infrastructure(proc) is None
    assert unverified_infrastructure(proc) is None


@pytest.mark.parametrize(
    "proc",
    [
        # Root's process in the DCGM unit, the unit's delegation mark unread.
        _proc(620, comm="worker", uid=0, cgroup=cg_unit("nvidia-dcgm.service", delegated=None)),
        # The mark read, the owner not.
        _proc(621, comm="worker", uid=None, cgroup=cg_unit("nvidia-dcgm.service")),
        # nvidia-persistenced as its service account, its unit's mark unread.
        _proc(
            622,
            comm="nvidia-persiste",
            exe="/usr/bin/nvidia-persistenced",
            uid=117,
            exe_trusted=True,
            cgroup=cg_unit("nvidia-persistenced.service", delegated=None),
        ),
    ],
    ids=["unit-mark-unread", "unit-owner-unread", "own-unit-mark-unread"],
)
def test_an_infrastructure_claim_whose_placement_is_unknown_is_never_signalled_nor_trusted(
    proc: ProcessInfo,
) -> None:
    assert infrastructure(proc) is None
    assert not mps_server(proc)
    assert unverified_infrastructure(proc) is not None
    finding = Finding(FindingKind.ORPHANED, "gpu", proc.pid, 1, "orphaned")
    why = refusal(proc, finding, HostBuilder().build(), default_policy(), frozenset())
    assert why is not None
    assert why.startswith("floor: ")


SERVICE_ACCOUNT = {"uid": 117, "exe_trusted": True}


@pytest.mark.parametrize(
    ("proc", "why"),
    [
        (
            _proc(
                630,
                exe="/usr/bin/nvidia-persistenced",
                cgroup=cg_unit("nvidia-persistenced.service"),
                **ROOT_EXE,
            ),
            "infrastructure process nvidia-persistenced",
        ),
        (
            _proc(
                631,
                exe="/usr/bin/nvidia-persistenced",
                cgroup=cg_unit("nvidia-persistenced.service"),
                **SERVICE_ACCOUNT,
            ),
            "infrastructure process nvidia-persistenced",
        ),
        (
            _proc(
                632, exe="/usr/bin/nv-hostengine", cgroup=cg_unit("nvidia-dcgm.service"), **ROOT_EXE
            ),
            "infrastructure process nv-hostengine",
        ),
        (
            _proc(
                633,
                exe="/usr/bin/nv-hostengine",
                cgroup=cg_unit("nvidia-dcgm.service"),
                **SERVICE_ACCOUNT,
            ),
            "infrastructure process nv-hostengine",
        ),
        (
            _proc(634, comm="worker", uid=0, cgroup=cg_unit("nvidia-dcgm.service")),
            "infrastructure unit nvidia-dcgm.service",
        ),
        (
            _proc(
                635,
                exe="/usr/bin/nvidia-cuda-mps-control",
                cgroup=cg_unit("nvidia-mps.service"),
                **ROOT_EXE,
            ),
            "infrastructure process nvidia-cuda-mps-control",
        ),
        # Root's program as root needs no unit at all (a DaemonSet's container, an admin).
        (
            _proc(636, exe="/usr/bin/nvidia-cuda-mps-control", cgroup=None, **ROOT_EXE),
            "infrastructure process nvidia-cuda-mps-control",
        ),
    ],
    ids=[
        "root-persistenced",
        "persistenced-service-account",
        "root-hostengine",
        "hostengine-service-account",
        "root-worker-in-dcgm-unit",
        "root-mps-daemon-in-its-unit",
        "root-mps-daemon-anywhere",
    ],
)
def test_real_infrastructure_is_still_recognised(proc: ProcessInfo, why: str) -> None:
    assert why in str(infrastructure(proc))
    assert mps_server(proc) == ("mps" in why)


def test_an_mps_daemon_a_user_starts_inside_a_job_leaves_the_node_watched() -> None:
    """Before: `nvidia-cuda-mps-control -d` from a Slurm job under cgroup v2 was trusted (root's
    program below system.slice), and the whole node went report-only."""
    mps = _proc(
        640,
        comm="nvidia-cuda-mps",
        exe="/usr/bin/nvidia-cuda-mps-control",
        cmdline=("nvidia-cuda-mps-control", "-d"),
        cgroup=_placed(SLURM_TASK),
        **USERS_PROGRAM,
    )
    snapshot = dataclasses.replace(HostBuilder().gpu(0).build(), mps_server_running=mps_server(mps))
    assessment = assess(snapshot, AssessState(), default_policy().detection)
    assert not snapshot.mps_server_running
    assert not assessment.report_only


def test_system_cgroup_needs_the_delegation_mark_read_and_absent() -> None:
    assert system_cgroup(cg_unit("nvidia-dcgm.service")) is True
    assert system_cgroup(cg_unit("nvidia-dcgm.service", delegated=True)) is False
    assert system_cgroup(cg_unit("nvidia-dcgm.service", delegated=None)) is None
    # Whatever the mark says, a Slurm job's or a user's cgroup is never root's placement.
    assert system_cgroup(_placed(SLURM_TASK, delegated=None)) is False
    assert (
        system_cgroup(_placed("/system.slice/user-1001.slice/x.service", delegated=None)) is False
    )


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/system.slice/nvidia-dcgm.service", True),
        ("/system.slice/system-nvidia.slice/nvidia-imex@0.service", True),
        ("/init.scope", True),
        ("/system.slice/slurmstepd.scope/system", False),
        ("/system.slice/n1_slurmstepd.scope/system", False),
        ("/system.slice/slurm/uid_1001/job_7/step_0", False),  # v1's form, wherever it sits
        ("/system.slice/user.slice/x.service", False),
        ("/system.slice/user@1001.service/app.slice/x.service", False),
        ("/system.slice/user-1001.slice/x.service", False),
        (f"/system.slice/docker-{'ab' * 32}.scope", False),
        ("/user.slice/user-1001.slice/session-3.scope", False),
        ("/", False),
    ],
)
def test_system_cgroup_table(path: str, expected: bool) -> None:
    """Read with no delegation mark: only the placement in the path decides."""
    assert system_cgroup(_placed(path)) is expected


# --- another gpuwatchd command's NVML worker ------------------------------------------------

WORKER_ARGV = ("/usr/bin/python3", "-I", NVML_LAUNCHER_FILE, NVML_WORKER_FILE, "/usr/lib/x")


@pytest.mark.parametrize(
    ("uid", "cmdline", "floor"),
    [
        (0, WORKER_ARGV, True),  # check-clean in a prolog, run --once in an epilog
        (1000, WORKER_ARGV, False),  # a user's copy of the command line is a user's process
        (None, WORKER_ARGV, False),  # unknown uid grants nothing
        (0, ("/usr/bin/python3", "-I", "/tmp/nvml_launch.py", NVML_WORKER_FILE), False),
        (0, ("/usr/bin/python3", NVML_LAUNCHER_FILE, NVML_WORKER_FILE), False),
        (0, None, False),
    ],
)
def test_a_gpuwatchd_commands_nvml_worker_run_as_root_is_floor(
    uid: int | None, cmdline: tuple[str, ...] | None, floor: bool
) -> None:
    proc = _proc(80, comm="python3", exe="/usr/bin/python3.11", uid=uid, cmdline=cmdline)
    assert (infrastructure(proc) is not None) is floor


def test_a_prologs_check_clean_is_no_hidden_holder_and_leaves_ghost_memory_ghost() -> None:
    """Each check-clean or run --once beside the daemon held the GPUs through its NVML worker
    for a moment: a hidden_holder appeared and resolved, and ghost memory stopped being ghost
    while the command ran (a finding that flapped while the epilog waited)."""
    snapshot = (
        HostBuilder()
        .gpu(0, allocated=4096 * MIB)
        .proc(90, comm="python3", uid=0, cmdline=WORKER_ARGV, holds={0})
        .build()
    )
    assessment = assess(snapshot, AssessState(), default_policy().detection)
    assert {f.kind for f in assessment.findings} == {FindingKind.GHOST_MEMORY}
