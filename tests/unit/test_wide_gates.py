"""The gates the wide mutation run found untested in decide/targets.py, decide/floor.py and
decide/assess/shared.py: a rule filter or ``protect`` entry against a fact that is unknown or
absent, what a target's facts say, the floor's answer kept per process, and PID trust.

Everything goes through the public functions (``rule_for``, ``refusal``, ``protect_match``,
``process_facts``, ``infrastructure``, ``mps_server``, ``system_cgroup``,
``unverified_infrastructure``, ``assess``).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from gpuwatchd.core.model import MIB, CgroupInfo, Finding, FindingKind, ProcessInfo, Spare
from gpuwatchd.decide import floor
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import NODE, Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.floor import (
    infrastructure,
    mps_server,
    reset_blockers,
    unverified_infrastructure,
)
from gpuwatchd.decide.policy import Detection, Protect, Rule, Step
from gpuwatchd.decide.targets import (
    gpu_protected,
    process_facts,
    protect_match,
    refusal,
    rule_for,
)
from tests.support.gatecases import (
    GPU0,
    GPU1,
    JOB,
    WALL,
    _job_host,
    _orphan,
    _policy,
    _protect,
)
from tests.support.snapshots import HostBuilder, cg_session, cg_slurm

KILL = (Step("SIGKILL", 1.0),)

# --- targets: a filter or protect entry against an unknown fact -------------------------------


def _finding() -> Finding:
    return Finding(
        kind=FindingKind.ORPHANED, gpu=GPU0, pid=JOB, start_ticks=1, reason="orphaned",
        memory=512 * MIB, evidence={"uvm": True},
    )  # fmt: skip


@pytest.mark.parametrize("field", ["cgroups", "units", "jobs"])
def test_a_cgroup_filter_never_selects_a_process_whose_cgroup_is_unknown(field: str) -> None:
    proc = _job_host(cgroup=None).build().processes[JOB]
    rule = Rule("any", FindingKind.ORPHANED, KILL, **{field: ("*",)})  # type: ignore[arg-type]
    assert rule_for(_finding(), proc, _policy(rules=(rule,)), lasted=100.0) is None


@pytest.mark.parametrize(
    ("unknown", "protect", "why"),
    [
        # Nothing in protect speaks about the unknown fact: the target is not refused.
        ({"cmdline": None}, Protect(), None),
        ({"user": None}, Protect(), None),
        ({"cgroup": None}, Protect(), None),
        ({"cmdline": None, "user": None, "cgroup": None}, Protect(gpus=(GPU1,)), None),
        # An entry that needs the unknown fact refuses (unknown never leads to a kill).
        ({"cmdline": None}, Protect(commands=(re.compile("x"),)), "protect: command line unknown"),
        ({"user": None}, Protect(users=("x",)), "protect: user unknown"),
        ({"cgroup": None}, Protect(units=("x",)), "protect: cgroup unknown"),
        ({"cgroup": None}, Protect(cgroups=("x",)), "protect: cgroup unknown"),
        # A cgroup glob that names another cgroup protects nothing.
        ({}, Protect(cgroups=("/kubepods/*",)), None),
        ({}, Protect(units=("trainer.*",)), None),
    ],
)
def test_protect_refuses_on_an_unknown_fact_only_where_an_entry_needs_it(
    unknown: dict[str, object], protect: Protect, why: str | None
) -> None:
    snapshot = _job_host().change(JOB, **unknown).build()
    proc = snapshot.processes[JOB]
    policy = _policy(protect=protect)
    assert refusal(proc, _orphan(snapshot), snapshot, policy, frozenset()) == why
    assert protect_match(proc, policy) is None


@pytest.mark.parametrize(
    ("entry", "why"),
    [(GPU1, None), (GPU0, f"protect: GPU {GPU0} is protected ({GPU0})")],
)
def test_protect_gpus_for_an_nvml_listed_target_that_holds_no_device_file(
    entry: str, why: str | None
) -> None:
    """NVML lists it with nvidia-uvm held (the finding's evidence), /proc shows no device file:
    only the finding's own GPU can be protected."""
    builder = _job_host(holds=frozenset())
    builder.hold(JOB, (), uvm=False, ctl=False)
    snapshot = builder.build()
    assert JOB not in snapshot.holders.holdings
    proc = snapshot.processes[JOB]
    assert refusal(proc, _orphan(snapshot), snapshot, _protect(gpus=(entry,)), frozenset()) == why


def test_protect_gpus_never_names_a_gpu_the_snapshot_does_not_describe() -> None:
    """No GpuInfo (the finding's GPU gone, or none): only a UUID entry can name it."""
    policy = _protect(gpus=(GPU1, "00000000:11:00.0"))
    assert gpu_protected(GPU0, None, policy) is None
    assert gpu_protected(None, None, policy) is None
    assert gpu_protected(GPU1.lower(), None, policy) == GPU1


def _stepd_host() -> HostBuilder:
    """JOB in a login session's cgroup (no job there), below root's slurmstepd of job 42."""
    builder = HostBuilder(self_pids=frozenset({4242})).gpu(0).gpu(1)
    builder.proc(
        600, comm="slurmstepd", exe="/usr/sbin/slurmstepd", cmdline=("slurmstepd: [42.batch]",),
        uid=0, user="root", exe_trusted=True, start=100,
    )  # fmt: skip
    builder.proc(JOB, ppid=600, user="bob", cmdline=("python3", "train.py"), holds={0}, uvm=True)
    return builder.change(JOB, cgroup=cg_session())


@pytest.mark.parametrize(
    ("spare", "why"),
    [
        (
            Spare("pid:700", WALL + 60, "debugging", pid=JOB, start_ticks=10_000 + JOB * 7),
            "spare: pid 700 (start ticks 14900) is spared (debugging)",
        ),
        (
            Spare("job:slurm:42", WALL + 60, "debugging", job="slurm:42"),
            "spare: job slurm:42 is spared (debugging)",
        ),
        (Spare("job:slurm:42", WALL - 1, "expired", job="slurm:42"), None),
        (Spare("job:slurm:43", WALL + 60, "another job", job="slurm:43"), None),
    ],
)
def test_a_spare_in_force_refuses_its_process_or_its_slurm_jobs_process_tree(
    spare: Spare, why: str | None
) -> None:
    snapshot = replace(_stepd_host().build(), spares=(spare,))
    assert snapshot.wall_time == WALL
    proc = snapshot.processes[JOB]
    assert refusal(proc, _orphan(snapshot), snapshot, _policy(), frozenset()) == why


def test_a_targets_facts_name_its_command_line_and_cgroup() -> None:
    proc = ProcessInfo(
        JOB, 14_900, "S", 1, JOB, 650, uid=1001, user="bob", comm="python3",
        cmdline=("python3", "train.py", "--epochs=3"), cgroup=cg_slurm("77"),
    )  # fmt: skip
    assert process_facts(proc) == {
        "user": "bob",
        "uid": 1001,
        "comm": "python3",
        "cmdline": "python3 train.py --epochs=3",
        "state": "S",
        "ppid": 1,
        "pgid": JOB,
        "sid": 650,
        "cgroup": "/system.slice/slurmstepd.scope/job_77/step_batch/user/task_0",
        "job": "slurm:77",
        "unit": None,
    }
    unit = ProcessInfo(
        JOB, 14_900, "S", 1, JOB, JOB,
        cgroup=CgroupInfo("/system.slice/trainer.service", systemd_unit="trainer.service"),
    )  # fmt: skip
    facts = process_facts(unit)
    assert (facts["cgroup"], facts["job"], facts["unit"]) == (
        "/system.slice/trainer.service",
        "unit:trainer.service",
        "trainer.service",
    )


def test_a_target_whose_command_line_and_cgroup_are_unknown_says_so() -> None:
    facts = process_facts(ProcessInfo(JOB, 14_900, "S", 1, JOB, JOB))
    assert facts == {
        "user": None,
        "uid": None,
        "comm": None,
        "cmdline": None,
        "state": "S",
        "ppid": 1,
        "pgid": JOB,
        "sid": JOB,
        "cgroup": None,
        "job": None,
        "unit": None,
    }


# --- assess: whether NVML's PIDs can be trusted --------------------------------------------------

DETECTION = Detection()
LEAK = 1200 * MIB
RANKS = (3001, 3002, 3003)  # pid_trust_min_unresolved dead PIDs
POLL = 1000.0


def _assess(builder: HostBuilder, previous: AssessState | None = None) -> Assessment:
    snapshot = builder.build()
    return assess(snapshot, previous or AssessState(boot_id=snapshot.boot_id), DETECTION)


def _dead_ranks(builder: HostBuilder, ranks: tuple[int, ...] = RANKS) -> HostBuilder:
    for rank in ranks:
        builder.nvml(0, rank)
    return builder


def test_dead_pids_lose_trust_beside_a_live_job_that_explains_none_of_them() -> None:
    """A live holder we track (its lineage recorded) is nobody's parent, group or session:
    nine unexplained dead PIDs, the first eight shown."""
    ranks = tuple(range(3001, 3010))
    builder = HostBuilder().gpu(0, allocated=LEAK).proc(200, holds={0}, uvm=True).nvml(0, 200)
    result = _assess(_dead_ranks(builder, ranks))
    assert result.report_only[NODE] == (
        "9 PIDs listed by NVML do not resolve and nothing explains them "
        "(3001, 3002, 3003, 3004, 3005, 3006, 3007, 3008); process lists are not trusted"
    )
    assert not any(f.actionable for f in result.findings)


@pytest.mark.parametrize("link", ["ppid", "pgid", "sid"])
def test_a_dead_pid_is_explained_by_a_live_process_it_is_parent_group_or_session_of(
    link: str,
) -> None:
    """The relatives hold nothing and NVML does not list them: we keep no lineage of theirs,
    the live facts alone explain the dead PIDs."""
    builder = _dead_ranks(HostBuilder().gpu(0, allocated=LEAK))
    for rank in RANKS:
        links = {"ppid": 1, "pgid": rank + 100, "sid": rank + 100} | {link: rank}
        builder.proc(rank + 100, ppid=links["ppid"], pgid=links["pgid"], sid=links["sid"])
    assert NODE not in _assess(builder).report_only


def test_a_dead_pid_is_explained_by_the_recorded_parent_of_a_reparented_worker() -> None:
    """Seen first as the parents of GPU workers (never listed, holding nothing), the ranks died
    and their workers were reparented to init: only the recorded lineage ties them."""
    builder = HostBuilder().gpu(0, allocated=LEAK)
    for rank in RANKS:
        builder.proc(rank, ppid=1)
        builder.proc(rank + 100, ppid=rank, pgid=rank + 100, sid=rank + 100, holds={0}, uvm=True)
    first = _assess(builder)
    assert NODE not in first.report_only
    for rank in RANKS:
        builder.kill(rank).change(rank + 100, ppid=1)
    second = _assess(_dead_ranks(builder.at(POLL + 5.0)), first.state)
    assert NODE not in second.report_only
    # Without that poll's record, nothing explains them.
    assert "do not resolve" in _assess(builder).report_only[NODE]


def test_live_listed_pids_whose_start_time_is_unknown_are_no_dead_pids() -> None:
    """No identity, so no lineage; nobody's relative: still alive, so nothing to explain."""
    builder = HostBuilder().gpu(0, allocated=LEAK)
    for rank in RANKS:
        builder.proc(rank, pgid=1, sid=1, start=None, holds={0}, uvm=True).nvml(0, rank)
    assert NODE not in _assess(builder).report_only


def test_impossible_pids_are_shown_five_at_most() -> None:
    builder = HostBuilder(pid_max=32768).gpu(0, allocated=LEAK)
    for pid in range(40001, 40007):
        builder.nvml(0, pid)
    shown = ", ".join(f"{pid} on {GPU0}" for pid in range(40001, 40006))
    assert _assess(builder).report_only[NODE] == (
        f"NVML listed impossible PIDs ({shown}); process lists are not trusted"
    )


def test_a_listed_zombie_that_still_holds_the_gpu_owns_its_memory() -> None:
    """Its live threads keep the context: the GPU's memory has an owner, never unaccounted."""
    builder = HostBuilder().gpu(0, allocated=LEAK)
    builder.proc(200, state="Z", holds={0}, uvm=True).nvml(0, 200)
    result = _assess(builder)
    assert result.state.unaccounted_since == {}
    assert not any(f.kind is FindingKind.UNACCOUNTED_MEMORY for f in result.findings)


# --- floor: the answer kept per process, and what a claim names -------------------------------


def test_the_floor_and_the_mps_test_read_a_process_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A steady poll hands back the same ProcessInfo: its identity is checked once for the
    floor and once for MPS, however often either is asked."""
    checked: list[int] = []
    real = floor.trusted_identity

    def counting(proc: ProcessInfo) -> bool | None:
        checked.append(proc.pid)
        return real(proc)

    monkeypatch.setattr(floor, "trusted_identity", counting)
    mps = ProcessInfo(
        90, 1, "S", 1, 90, 90, comm="nvidia-cuda-mps", exe="/usr/bin/nvidia-cuda-mps-control",
        uid=0, exe_trusted=True,
    )  # fmt: skip
    for _ in range(3):
        assert infrastructure(mps) == (
            "infrastructure process nvidia-cuda-mps-control "
            "(root-owned /usr/bin/nvidia-cuda-mps-control)"
        )
        assert mps_server(mps) is True
    assert checked == [90, 90]


def test_an_unverifiable_claim_names_the_infrastructure_name_it_goes_by() -> None:
    """Its argv[0] sorts first, but only the claimed name says why it is never signalled."""
    proc = ProcessInfo(
        91, 1, "S", 1, 91, 91, comm="Xorg", cmdline=("/opt/Alpha", "--serve"), uid=None,
    )  # fmt: skip
    assert unverified_infrastructure(proc) == (
        "goes by 'Xorg', but whether it is that program cannot be read"
    )


def test_a_service_account_that_renames_itself_an_mps_daemon_is_none() -> None:
    """nvidia-persistenced, trusted in its own unit as its service account, goes by an MPS
    name: only root's comm and argv[0] count, so the node is not made report-only."""
    proc = ProcessInfo(
        92, 1, "S", 1, 92, 92, comm="nvidia-cuda-mps", exe="/usr/bin/nvidia-persistenced",
        cmdline=("nvidia-cuda-mps-control", "-d"), uid=117, exe_trusted=True,
        cgroup=CgroupInfo(
            "/system.slice/nvidia-persistenced.service",
            systemd_unit="nvidia-persistenced.service", delegated=False,
        ),
    )  # fmt: skip
    assert infrastructure(proc) == (
        "infrastructure process nvidia-persistenced (root-owned /usr/bin/nvidia-persistenced)"
    )
    assert mps_server(proc) is False


@pytest.mark.parametrize(("ctl", "uvm"), [(True, False), (False, True)])
def test_a_job_holding_either_nvidiactl_or_nvidia_uvm_alone_blocks_the_final_scan(
    ctl: bool, uvm: bool
) -> None:
    snapshot = HostBuilder().gpu(0).proc(800, holds=(), ctl=ctl, uvm=uvm).build()
    assert reset_blockers(snapshot.holders, snapshot.processes, 0, frozenset()) == [
        "pid 800 (python3) holds nvidiactl/nvidia-uvm without a GPU node (cannot be attributed)"
    ]
