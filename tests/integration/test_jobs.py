"""Which jobs have ended (the evidence behind ``abandoned``), over fake cgroup trees."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from gpuwatchd.collect.cgroups import classify_cgroup_path
from gpuwatchd.collect.jobs import JobEvidence, cgroup2_mount, judge_jobs, trusted_job_dir
from gpuwatchd.core.model import ProcessInfo

SCOPE = "/system.slice/slurmstepd.scope"


def make_job(root: Path, job: int, steps: dict[str, str | None]) -> Path:
    """steps: step name -> slurmstepd cgroup.procs content (None: no slurm dir)."""
    job_dir = root / SCOPE.lstrip("/") / f"job_{job}"
    for step, stepd in steps.items():
        (job_dir / step / "user" / "task_0").mkdir(parents=True)
        if stepd is not None:
            (job_dir / step / "slurm").mkdir()
            (job_dir / step / "slurm" / "cgroup.procs").write_text(stepd)
    return job_dir


def proc(pid: int, path: str, job: str | None) -> ProcessInfo:
    cgroup = classify_cgroup_path(path)
    assert cgroup.slurm_job == job
    return ProcessInfo(pid=pid, start_ticks=1, state="S", ppid=1, pgid=pid, sid=pid, cgroup=cgroup)


def ended_dirs(processes: list[ProcessInfo], root: Path | None) -> frozenset[str]:
    root_dir = None if root is None else str(root)
    return judge_jobs(processes, root_dir, lambda pid: (None, None)).ended_dirs


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ({"step_0": "4242\n"}, False),
        ({"step_0": "", "step_extern": "4100\n"}, False),
        ({"step_0": "", "step_batch": ""}, True),
        ({"step_0": None}, True),
        ({}, None),
    ],
    ids=["stepd-alive", "extern-stepd-alive", "all-stepds-gone", "no-stepd-dir", "no-steps-yet"],
)
def test_a_job_ended_only_when_no_step_has_a_live_slurmstepd(
    tmp_path: Path, steps: dict[str, str | None], expected: bool | None
) -> None:
    """expected: True ended, False a live slurmstepd serves it, None unknown (neither)."""
    job_dir = make_job(tmp_path, 42, steps)
    job_dir.mkdir(parents=True, exist_ok=True)
    processes = [proc(10, f"{SCOPE}/job_42/step_0/user/task_0", "42")]
    evidence = judge_jobs(processes, str(tmp_path), lambda pid: (pid, True))
    ended = f"{SCOPE}/job_42" in evidence.ended_dirs
    live = "slurm:42" in evidence.stepds
    assert (ended, live) == {True: (True, False), False: (False, True), None: (False, False)}[
        expected
    ]


def test_missing_job_cgroup_is_unknown_not_ended(tmp_path: Path) -> None:
    processes = [proc(10, f"{SCOPE}/job_7/step_0/user/task_0", "7")]
    evidence = judge_jobs(processes, str(tmp_path), lambda pid: (None, None))
    assert evidence == JobEvidence()


def test_judge_jobs_names_only_job_directories_known_to_have_ended(tmp_path: Path) -> None:
    make_job(tmp_path, 1, {"step_0": ""})
    make_job(tmp_path, 2, {"step_0": "99\n"})
    processes = [
        proc(10, f"{SCOPE}/job_1/step_0/user/task_0", "1"),
        proc(11, f"{SCOPE}/job_1/step_0/user/task_0", "1"),
        proc(20, f"{SCOPE}/job_2/step_0/user/task_0", "2"),
        proc(30, f"{SCOPE}/job_3/step_0/user/task_0", "3"),  # no cgroup dir: unknown
        proc(40, "/user.slice/user-1000.slice/session-4.scope", None),
        proc(50, "/slurm/uid_0/job_5/step_0/task_0", "5"),  # cgroup v1 layout: not judged
    ]
    assert ended_dirs(processes, tmp_path) == frozenset({f"{SCOPE}/job_1"})


def test_without_a_cgroup2_mount_nothing_is_judged(tmp_path: Path) -> None:
    make_job(tmp_path, 1, {"step_0": ""})
    processes = [proc(10, f"{SCOPE}/job_1/step_0/user/task_0", "1")]
    assert ended_dirs(processes, None) == frozenset()


@pytest.mark.parametrize(
    ("mountinfo", "expected"),
    [
        (
            "35 24 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
            "/sys/fs/cgroup",
        ),
        (
            "30 24 0:26 / /sys/fs/cgroup ro - tmpfs tmpfs ro,mode=755\n"
            "31 30 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
            "/sys/fs/cgroup/unified",
        ),
        ("30 24 0:26 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n", None),
    ],
    ids=["unified", "hybrid", "v1-only"],
)
def test_cgroup2_mount_is_found_in_mountinfo(
    tmp_path: Path, mountinfo: str, expected: str | None
) -> None:
    path = tmp_path / "mountinfo"
    path.write_text(mountinfo)
    assert cgroup2_mount(str(path)) == expected


def test_a_users_own_cgroup_tree_posing_as_a_slurm_job_cannot_end_the_real_job(
    tmp_path: Path,
) -> None:
    """Below ``user@UID.service`` a user may create ``…/slurmstepd.scope/job_2/step_0/slurm``
    with no slurmstepd in it. Judging job 2 from there would make every process of the real,
    running job 2 look abandoned."""
    user_tree = "/user.slice/user-1000.slice/user@1000.service/app.slice"
    make_job(tmp_path / user_tree.lstrip("/"), 2, {"step_0": ""})  # the decoy: "ended"
    make_job(tmp_path, 2, {"step_0": "99\n"})  # the real job: running
    path = f"{user_tree}{SCOPE}/job_2/step_0/user/task_0"
    decoy = ProcessInfo(
        pid=60, start_ticks=1, state="S", ppid=1, pgid=60, sid=60,
        cgroup=dataclasses.replace(
            classify_cgroup_path(path), slurm_job="2", slurm_job_dir=f"{user_tree}{SCOPE}/job_2"
        ),
    )  # as if classified so (the classifier itself ignores jobs below user@)  # fmt: skip
    processes = [decoy, proc(20, f"{SCOPE}/job_2/step_0/user/task_0", "2")]
    assert ended_dirs(processes, tmp_path) == frozenset()


@pytest.mark.parametrize(
    ("owner", "mode", "trusted"),
    [(0, 0o755, True), (1001, 0o755, False), (0, 0o775, False), (0, 0o757, False)],
    ids=["root", "a-users", "group-writable", "other-writable"],
)
def test_only_directories_root_made_and_alone_may_change_are_the_schedulers(
    tmp_path: Path, owner: int, mode: int, trusted: bool
) -> None:
    """The attack of issue 20, with cgroups a user may create outside ``user@`` (a cgroup
    delegated to them): a forged …/slurmstepd.scope/job_42 with no step. Every directory from
    the hierarchy's root down to the job's must be root's and writable by root alone."""
    if os.geteuid() != 0 and owner != os.geteuid():
        pytest.skip("needs root to give a directory to another user")
    make_job(tmp_path / "deleg.slice", 42, {"step_0": ""})
    deleg = tmp_path / "deleg.slice"
    os.chown(deleg, owner, owner)
    deleg.chmod(mode)
    job_dir = f"/deleg.slice{SCOPE}/job_42"
    assert trusted_job_dir(str(tmp_path), job_dir) is trusted
    judged = ended_dirs([proc(70, f"{job_dir}/step_0/user/task_0", "42")], tmp_path)
    assert judged == (frozenset({job_dir}) if trusted else frozenset())


def test_a_symlinked_directory_on_the_way_is_not_the_schedulers(tmp_path: Path) -> None:
    make_job(tmp_path / "real", 7, {"step_0": ""})
    (tmp_path / "link.slice").symlink_to(tmp_path / "real")
    assert not trusted_job_dir(str(tmp_path), f"/link.slice{SCOPE}/job_7")
    assert trusted_job_dir(str(tmp_path), f"/real{SCOPE}/job_7")


def test_no_directory_of_a_job_ends_while_a_slurmstepd_serves_it_in_another(
    tmp_path: Path,
) -> None:
    """Two slurmd on one host (``<node>_slurmstepd.scope``): job 42 runs under node2; a
    leftover directory of it under node1 has no step daemon. The job is running."""
    for node, stepd in (("node1", ""), ("node2", "4242\n")):
        job_dir = tmp_path / "system.slice" / f"{node}_slurmstepd.scope" / "job_42"
        (job_dir / "step_0" / "user" / "task_0").mkdir(parents=True)
        (job_dir / "step_0" / "slurm").mkdir()
        (job_dir / "step_0" / "slurm" / "cgroup.procs").write_text(stepd)
    processes = [
        proc(80, f"/system.slice/{node}_slurmstepd.scope/job_42/step_0/user/task_0", "42")
        for node in ("node1", "node2")
    ]
    evidence = judge_jobs(processes, str(tmp_path), lambda pid: (5000, True))
    assert evidence.ended_dirs == frozenset()
    assert evidence.stepds == {"slurm:42": 5000}


def test_a_process_in_a_steps_slurm_cgroup_not_running_roots_program_serves_nothing(
    tmp_path: Path,
) -> None:
    make_job(tmp_path, 9, {"step_0": "555\n"})
    processes = [proc(90, f"{SCOPE}/job_9/step_0/user/task_0", "9")]
    evidence = judge_jobs(processes, str(tmp_path), lambda pid: (100, False))
    assert evidence.stepds == {}
    assert evidence.ended_dirs == frozenset()  # still not ended: something lives there
    gone = judge_jobs(processes, str(tmp_path), lambda pid: None)
    assert gone.stepds == {}
