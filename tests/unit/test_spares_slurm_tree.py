"""`spare job:ID` where Slurm tracks a job by its process tree (``proctrack/linuxproc``).

There the job's processes sit in slurmd's cgroup, so the cgroup ties none of them to the job:
a process is the job's when a ``slurmstepd`` that root runs for it is its ancestor, as Slurm
itself tracks it (decide/spares.py). Nothing a user controls can make that tie: another uid's
"slurmstepd", a root process of another name, a PID reused by a parent younger than its child.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpuwatchd.cli.main import main
from gpuwatchd.core.model import CgroupInfo, ProcessInfo, Spare
from gpuwatchd.decide.plan.decisions import plan
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.spares import job_processes, slurm_tree_job, spare_reason
from tests.support.plancases import orphan, policy, proc, signals, snap

SLURMD = CgroupInfo(path="/system.slice/slurmd.service")
STEPD = proc(
    100,
    10,
    user="root",
    uid=0,
    comm="slurmstepd",
    exe="/usr/sbin/slurmstepd",
    cmdline=("slurmstepd: [42.batch]",),
    cgroup=SLURMD,
)
SHELL = proc(110, 20, ppid=100, comm="sh", exe="/usr/bin/dash", cgroup=SLURMD)
WRAPPER = proc(120, 30, ppid=110, cgroup=SLURMD)  # a subreaper: the worker's parent now
WORKER = proc(130, 40, ppid=120, cgroup=SLURMD)  # its trainer died: an orphan
SPARE_42 = Spare(target="job:slurm:42", until=1000.0, reason="debugging", job="slurm:42")


def _tree(*changed: ProcessInfo) -> dict[int, ProcessInfo]:
    procs = {p.pid: p for p in (STEPD, SHELL, WRAPPER, WORKER)}
    procs.update({p.pid: p for p in changed})
    return procs


def test_a_process_in_a_root_slurmstepds_tree_is_the_jobs() -> None:
    assert slurm_tree_job(WORKER, _tree()) == "slurm:42"
    debian = dataclasses.replace(STEPD, exe="/usr/sbin/slurmstepd-wlm")  # Debian's package
    assert slurm_tree_job(WORKER, _tree(debian)) == "slurm:42"
    assert slurm_tree_job(STEPD, _tree()) is None  # its own job is by its title, not its tree
    assert {p.pid for p in job_processes("slurm:42", _tree())} == {100, 110, 120, 130}
    assert job_processes("slurm:43", _tree()) == []


@pytest.mark.parametrize(
    "forged",
    [
        dataclasses.replace(STEPD, uid=1000),  # a user's process calling itself slurmstepd
        dataclasses.replace(STEPD, uid=None),  # unknown owner
        dataclasses.replace(STEPD, exe="/usr/bin/python3"),  # root, but another program
        dataclasses.replace(STEPD, exe_trusted=False),  # a program a user could have written
        dataclasses.replace(STEPD, cmdline=("slurmstepd",)),  # no job in its title
        dataclasses.replace(STEPD, start_ticks=35),  # younger than its "child": a reused PID
    ],
)
def test_nothing_a_user_controls_ties_a_process_to_a_job(forged: ProcessInfo) -> None:
    assert slurm_tree_job(WORKER, _tree(forged)) is None


def test_a_job_spare_covers_its_step_tree_where_the_cgroup_says_nothing() -> None:
    """Before: a job spare matched the cgroup only, so under proctrack/linuxproc it covered
    none of the job's processes."""

    def spared(process: ProcessInfo, spare: Spare) -> str | None:
        tree = _tree(process)
        return spare_reason(process, dataclasses.replace(snap(), processes=tree, spares=(spare,)))

    assert spared(WORKER, SPARE_42) == "job slurm:42 is spared (debugging)"
    assert spared(WORKER, dataclasses.replace(SPARE_42, reason="")) == "job slurm:42 is spared"
    other = dataclasses.replace(SPARE_42, target="job:slurm:43", job="slurm:43")
    assert spared(WORKER, other) is None
    escaped = dataclasses.replace(WORKER, ppid=1)  # reparented to init: Slurm lost it too
    assert spared(escaped, SPARE_42) is None


def test_the_spared_jobs_orphan_gets_no_signal() -> None:
    snapshot = dataclasses.replace(snap(list(_tree().values())), spares=(SPARE_42,))
    result = plan([orphan(WORKER)], snapshot, PlanState(), policy(), now=0.0, wall=0.0)
    assert signals(result) == []
    unspared = snap(list(_tree().values()))
    result = plan([orphan(WORKER)], unspared, PlanState(), policy(), now=0.0, wall=0.0)
    assert [s.identity.pid for s in signals(result)] == [WORKER.pid]


def test_spare_job_refuses_a_job_with_no_process_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No cgroup, slurmstepd or tree ties any process to the job: nothing is promised."""
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path}/st\n")
    args = ["spare", "--config", str(config), "job:987654321", "--for", "1h", "--reason", "x"]
    assert main(args) == 78
    assert "no process of job slurm:987654321 found" in capsys.readouterr().err
    assert main(["spare", "--config", str(config), "--list"]) == 0
    assert "no spares" in capsys.readouterr().out
