"""End to end, Xids from the kernel log: the real daemon reads a file in /dev/kmsg's format
(SimHost.kmsg) beside the fake NVML's Xid events, in its own PID namespace.

One daemon run (module fixture) plays four things the tests then check one each: an Xid the
kernel logged before the daemon started, a flood of one Xid, an application Xid naming the
test's own process, and one Xid seen by both NVML and the kernel log. Nothing is reset (the
reset command is the refusing fake) and the test's process is never signalled.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.vocabulary import EventName
from tests.support.daemonrun import SLURM_SCOPE, Run
from tests.support.fakenvml import gpu
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)

pytestmark = [needs_pid_namespace(), pytest.mark.slow]

FLOOD = 20_000


def host_kernel_xids(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=2) as host:
        host.nvml([gpu(0), gpu(1)])
        # Logged 100 s before the daemon starts: a GPU fallen off the bus.
        host.kernel_xid(1, 79, "GPU has fallen off the bus.", ago=100.0)
        steps: list[dict[str, Any]] = [{"sleep": 3600}]
        if "cgroup_base" in arg:  # a Slurm job's task cgroup, so the job can be named
            task = Path(arg["cgroup_base"]) / SLURM_SCOPE / "job_7" / "step_0" / "user/task_0"
            task.mkdir(parents=True)
            steps.insert(0, {"cgroup": str(task)})
        host.spawn("job", steps)
        job = host.wait_ready("job")["job"]
        run = Run(host)
        run.start()
        run.wait_for(lambda: run.saw(EventName.GPU_NEEDS_REBOOT), timeout=30)
        # A flood of one Xid (94: counted, no finding), then more of it within the minute.
        host.kernel_xid(0, 94, "pid=1, name=init, Contained", count=FLOOD)
        run.wait_for(lambda: run.saw(EventName.HEALTH_XID, xid=94), timeout=30)
        host.kernel_xid(0, 94, "pid=1, name=init, Contained", count=FLOOD)
        # An application Xid naming the test's own process.
        comm = Path(f"/proc/{job}/comm").read_text().strip()
        host.kernel_xid(0, 13, f"pid={job}, name={comm}, Graphics SM Warp Exception")
        run.wait_for(lambda: run.saw(EventName.HEALTH_XID, xid=13), timeout=30)
        # One Xid (31) seen by both sources.
        host.nvml([gpu(0), gpu(1)], events=[{"id": "x31", "gpu": 0, "type": 8, "data": 31}])
        host.kernel_xid(0, 31, f"pid={job}, name={comm}, MMU Fault")
        run.wait_for(lambda: run.saw(EventName.HEALTH_XID, xid=31), timeout=30)
        time.sleep(2)  # ten polls: a late duplicate would be counted by now
        # A reload cannot switch the kernel log off: it is opened at start.
        run.reload_with("50-kernel-log.yaml", "health:\n  kernel_log: 'off'\n")
        run.wait_for(lambda: run.saw(EventName.CONFIG_RELOAD_PARTIAL), timeout=30)
        host.kernel_xid(0, 43, "after the reload")
        run.wait_for(lambda: run.saw(EventName.HEALTH_XID, xid=43), timeout=30)
        info = ProcFS("/proc").read_process(job)
        alive = host.alive(job)
        os.kill(job, signal.SIGTERM)  # ours: the test started it
        run.stop()
        state = json.loads((host.state_dir / "state.json").read_text())
        return {
            "events": run.events(),
            "health": state["assess"]["health"],
            "job": job,
            "comm": comm,
            "job_key": None if info is None or info.cgroup is None else info.cgroup.job_key,
            "alive": alive,
        }


@pytest.fixture(scope="module")
def played(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("kernel-xids")
    return run_in_pid_namespace(f"{__name__}:host_kernel_xids", {}, root=root, timeout=120.0)


def xid_events(played: dict[str, Any], xid: int) -> list[dict[str, Any]]:
    return [
        e for e in played["events"] if e.get("event") == EventName.HEALTH_XID and e["xid"] == xid
    ]


def test_an_xid_logged_before_the_daemon_started_is_judged_and_marked(
    played: dict[str, Any],
) -> None:
    (said,) = xid_events(played, 79)
    assert said["before_start"] is True
    assert said["sources"] == ["kernel"]
    new = [e for e in played["events"] if e.get("event") == EventName.FINDING_NEW
           and str(e.get("finding", "")).startswith("reboot_required")]  # fmt: skip
    assert len(new) == 1
    assert new[0]["gpu"] == said["gpu"]
    assert new[0]["evidence"]["xids"]["79"]["kernel_log"]["before_start"] is True


def test_a_flood_of_one_xid_is_counted_and_said_once_per_window(played: dict[str, Any]) -> None:
    said = xid_events(played, 94)
    assert [e["count"] for e in said] == [FLOOD]  # the second flood is held: within the minute
    (gpu_state,) = [g for g in played["health"].values() if "94" in g["xids"]]
    assert gpu_state["xids"]["94"][0] == 2 * FLOOD
    assert gpu_state["xid_log"]["94"][1] == FLOOD  # held, to be said once the minute is over


def test_an_application_xid_names_its_process(played: dict[str, Any]) -> None:
    (said,) = xid_events(played, 13)
    assert (said["pid"], said["process"]) == (played["job"], played["comm"])
    assert said["job"] == played["job_key"]
    assert played["alive"] is True  # evidence only: never signalled
    assert [e for e in played["events"] if e.get("event") == EventName.ACTION_SIGNAL] == []


def test_an_application_xid_names_its_slurm_job(cgroup_base: Path, tmp_path: Path) -> None:
    played = run_in_pid_namespace(
        f"{__name__}:host_kernel_xids",
        {"cgroup_base": str(cgroup_base)},
        root=tmp_path,
        timeout=120.0,
    )
    assert played["job_key"] == "slurm:7"
    (said,) = xid_events(played, 13)
    assert (said["pid"], said["job"]) == (played["job"], "slurm:7")
    assert played["alive"] is True


def test_an_xid_seen_by_nvml_and_the_kernel_log_counts_once(played: dict[str, Any]) -> None:
    said = xid_events(played, 31)
    assert sum(e["count"] for e in said) == 1
    (gpu_state,) = [g for g in played["health"].values() if "31" in g["xids"]]
    assert gpu_state["xids"]["31"][0] == 1


def test_a_reload_keeps_the_kernel_log_the_daemon_started_with(played: dict[str, Any]) -> None:
    partial = [e for e in played["events"] if e.get("event") == EventName.CONFIG_RELOAD_PARTIAL]
    assert [e["needs_restart"] for e in partial] == [["health.kernel_log"]]
    assert len(xid_events(played, 43)) == 1  # still read after the reload
