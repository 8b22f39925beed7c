"""Which jobs have ended (the evidence behind ``abandoned``), over fake cgroup trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatchd.collect.jobs import cgroup2_mount, ended_jobs, slurm_job_ended
from gpuwatchd.model import CgroupInfo, ProcessInfo

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
    return ProcessInfo(
        pid=pid,
        start_ticks=1,
        state="S",
        ppid=1,
        pgid=pid,
        sid=pid,
        cgroup=CgroupInfo(path=path, slurm_job=job),
    )


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
def test_slurm_job_ended_only_when_no_step_has_a_live_slurmstepd(
    tmp_path: Path, steps: dict[str, str | None], expected: bool | None
) -> None:
    job_dir = make_job(tmp_path, 42, steps)
    job_dir.mkdir(parents=True, exist_ok=True)
    assert slurm_job_ended(str(job_dir)) is expected


def test_missing_job_cgroup_is_unknown_not_ended(tmp_path: Path) -> None:
    assert slurm_job_ended(str(tmp_path / "job_7")) is None


def test_ended_jobs_names_only_jobs_known_to_have_ended(tmp_path: Path) -> None:
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
    assert ended_jobs(processes, str(tmp_path)) == frozenset({"slurm:1"})


def test_without_a_cgroup2_mount_nothing_is_judged(tmp_path: Path) -> None:
    make_job(tmp_path, 1, {"step_0": ""})
    processes = [proc(10, f"{SCOPE}/job_1/step_0/user/task_0", "1")]
    assert ended_jobs(processes, None) == frozenset()


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
    processes = [
        proc(60, f"{user_tree}{SCOPE}/job_2/step_0/user/task_0", "2"),  # as if classified so
        proc(20, f"{SCOPE}/job_2/step_0/user/task_0", "2"),
    ]
    assert ended_jobs(processes, str(tmp_path)) == frozenset()
