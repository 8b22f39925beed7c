"""End to end: what the scheduler's commands say about a node (issue 21).

One verdict for "is this GPU clean for a new job?" (decide/verdict.py): ``scan``,
``check-clean`` (a prolog) and ``run --once`` (an epilog) agree, for every GPU alone and for
the whole node, with or without a running daemon; ``run --once`` returns only once the driver
has let go; an epilog's hand-over is taken for its own job and wait alone. Like
tests/system/test_e2e_run.py, each ``host_*`` function runs as PID 1 of its own PID namespace
(tests/support/simhost.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support.daemonrun import (
    ORPHAN_RULE,
    SLURM_SCOPE,
    Run,
    orphan_host,
)
from tests.support.fakenvml import gpu
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)

pytestmark = [needs_pid_namespace(), pytest.mark.slow]

SELECTIONS = {"all": [], "gpu0": ["--gpu", "0"], "gpu1": ["--gpu", "1"], "both": ["--gpu", "1,0"]}


def _checks(host: SimHost, config: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, args in SELECTIONS.items():
        result = host.gpuwatchd("check-clean", "--config", str(config), *args)
        out[name] = {"code": result.returncode, "out": result.stdout, "err": result.stderr}
    return out


def host_monitor_client(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """A monitor (gpustat, ``nvidia-smi -l``, an exporter) holds nvidiactl and both GPUs'
    nodes, no nvidia-uvm and no memory: judged alone, with ``protect``, and beside a daemon."""
    with SimHost(root, gpus=2) as host:
        host.spawn(
            "monitor",
            [{"comm": "gpustat"}, {"open": host.dev("nvidiactl", "nvidia0", "nvidia1")},
             {"sleep": 3600}],
        )  # fmt: skip
        pids = host.wait_ready("monitor")
        host.nvml([gpu(0), gpu(1)])
        plain = host.config(rules=[ORPHAN_RULE])
        scan = host.scan_json(plain)
        alone = _checks(host, plain)
        protected = _checks(
            host, host.config(rules=[ORPHAN_RULE], protect={"commands": ["^gpustat"]})
        )
        run = Run(host)
        run.start()
        assert run.wait_for(lambda: run.saw(EventName.DAEMON_START)), "the daemon did not start"
        assert run.wait_for((host.state_dir / "holders.json").exists, timeout=10)
        beside = _checks(host, run.config)
        beside_scan = host.scan_json(run.config)
        run.stop()
        return {
            "monitor": pids["monitor"],
            "scan": scan,
            "beside_scan": beside_scan,
            "alone": alone,
            "protected": protected,
            "beside": beside,
            "monitor_alive": host.alive(pids["monitor"]),
        }


def test_a_monitor_client_makes_no_gpu_dirty_alone_protected_or_beside_a_daemon(
    tmp_path: Path,
) -> None:
    result = run_in_pid_namespace(f"{__name__}:host_monitor_client", {}, root=tmp_path)
    monitor = result["monitor"]
    for scan in (result["scan"], result["beside_scan"]):
        assert scan["verdict"]["clean"] is True
        for entry in scan["gpus"]:
            roles = [h["role"] for h in entry["holders"] if h["pid"] == monitor]
            assert roles == ["management"], entry
            assert entry["verdict"]["state"] == "clean"
            assert [b["pid"] for b in entry["verdict"]["reset_blockers"]] == [monitor]
    for case in ("alone", "protected", "beside"):
        for selection, check in result[case].items():
            assert check["code"] == 0, (case, selection, check)
            assert check["out"] == "", (case, selection, check)
            # said apart, on stderr: what would block a reset of each GPU asked about
            notes = check["err"].splitlines()
            assert len(notes) == (2 if selection in ("all", "both") else 1), check
            assert all(f"clean; would block a reset: pid {monitor}" in n for n in notes)
    assert result["monitor_alive"] is True


TEARDOWN = 1.5  # seconds the fake driver takes to drop a dead context (a real one: ~1-2 s)


def host_epilog_waits_for_the_driver(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """A crashed job's forked worker pins GPU 0 (NVML lists the dead trainer). The epilog's
    ``run --once`` frees it — alone, or beside a running daemon — and the driver takes
    :data:`TEARDOWN` seconds to tear the context down, NVML listing the dead trainer with its
    memory meanwhile. Then the epilog's ``check-clean``, at once."""
    with SimHost(root) as host:
        orphan_host(host)
        host.free_when_gone(["worker"], [gpu(0)], delay=TEARDOWN)
        run = None
        if arg["daemon"]:
            run = Run(host)
            run.start()
            assert run.wait_for(lambda: run.saw(EventName.DAEMON_START)), "the daemon did not start"
            config = run.config
        else:
            config = host.config(
                dry_run=False,
                rules=[ORPHAN_RULE],
                limits={"post_action_delay": "0s"},
                log={"format": "json"},
            )
        started = time.monotonic()
        once = host.gpuwatchd("run", "--once", "--timeout", "30s", "--config", str(config))
        took = time.monotonic() - started
        check = host.gpuwatchd("check-clean", "--config", str(config), "--gpu", "0")
        if run is not None:
            run.stop()
        return {
            "once_code": once.returncode,
            "once_output": once.stdout + once.stderr,
            "took": took,
            "check": {"code": check.returncode, "out": check.stdout, "err": check.stderr},
            "worker_alive": host.alive(host.pids["worker"]),
        }


@pytest.mark.parametrize("daemon", [False, True], ids=["alone", "beside-the-daemon"])
def test_run_once_returns_only_when_the_driver_has_let_go_so_the_epilog_never_drains(
    tmp_path: Path, daemon: bool
) -> None:
    result = run_in_pid_namespace(
        f"{__name__}:host_epilog_waits_for_the_driver", {"daemon": daemon}, root=tmp_path
    )
    assert result["worker_alive"] is False
    assert result["once_code"] == 0, result["once_output"]
    assert result["took"] >= TEARDOWN, result["once_output"]
    assert result["check"] == {"code": 0, "out": "", "err": ""}, result["once_output"]


ENDED_JOBS_RULE = {
    "name": "ended-jobs",
    "kind": "abandoned",
    "for": "0s",
    "steps": [{"signal": "SIGTERM", "wait": "2s"}, {"signal": "SIGKILL", "wait": "1s"}],
}


def host_hand_over_is_for_its_epilog_only(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """Job 42's epilog hands its job to a running (dry-run) daemon and is killed mid-wait, as
    slurmd kills an epilog past its time: its hand-over stays on disk. The daemon stops. Job
    42 runs again on this node (requeued: the same id; its task holds GPU 1). Then job 43's
    epilog runs with no daemon: it must not take job 42's hand-over for its own."""
    base = Path(arg["cgroup_base"])
    dirs = {}
    for sub in ("slurm", "user/task_0"):
        path = base / SLURM_SCOPE / "job_42" / "step_0" / sub
        path.mkdir(parents=True, exist_ok=True)
        dirs[sub] = str(path)
    with SimHost(root, gpus=2) as host:
        host.spawn("stepd42", [{"cgroup": dirs["slurm"]}, {"sleep": 3600}])
        host.spawn(
            "task42",
            [{"setsid": True}, {"cgroup": dirs["user/task_0"]}, {"open": host.cuda(1)},
             {"sleep": 3600}],
        )  # fmt: skip
        pids = host.wait_ready("stepd42", "task42")
        host.nvml([gpu(0), gpu(1)])
        daemon = Run(host, dry_run=True, rules=[ENDED_JOBS_RULE])
        daemon.start()
        assert daemon.wait_for(lambda: daemon.saw(EventName.DAEMON_START)), (
            "the daemon did not start"
        )
        argv = ["run", "--once", "--ended-job", "slurm:42", "--timeout", "60s"]
        epilog42 = subprocess.Popen(
            [sys.executable, "-m", "gpuwatchd", *argv, "--config", str(daemon.config)],
            env=host.env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        taken = daemon.wait_for(lambda: daemon.saw(EventName.SCHEDULER_ENDED_JOB, job="slurm:42"))
        epilog42.kill()
        epilog42.wait()
        left_behind = sorted(p.name for p in host.state_dir.glob("ended-job-*"))
        daemon.stop()
        enforcing = host.config(
            dry_run=False,
            rules=[ENDED_JOBS_RULE],
            limits={"post_action_delay": "0s"},
            log={"format": "json"},
        )
        once43 = host.gpuwatchd(
            "run", "--once", "--ended-job", "slurm:43", "--timeout", "10s", "--config",
            str(enforcing),
        )  # fmt: skip
        return {
            "taken_by_daemon": taken,
            "left_behind": left_behind,
            "once43_code": once43.returncode,
            "once43_output": once43.stdout + once43.stderr,
            "task42_alive": host.alive(pids["task42"]),
            "files_after": sorted(p.name for p in host.state_dir.glob("ended-job-*")),
        }


def test_a_hand_over_is_taken_only_for_the_job_and_the_epilog_it_names(
    tmp_path: Path,
    cgroup_base: Path,
) -> None:
    result = run_in_pid_namespace(
        f"{__name__}:host_hand_over_is_for_its_epilog_only",
        {"cgroup_base": str(cgroup_base)},
        root=tmp_path,
        timeout=120,
    )
    assert result["taken_by_daemon"] is True
    assert len(result["left_behind"]) == 1  # a killed epilog cannot withdraw it
    output = result["once43_output"]
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    taken = [e.get("job") for e in events if e.get("event") == EventName.SCHEDULER_ENDED_JOB]
    assert taken == [], output  # job 42's hand-over is not job 43's
    assert not [e for e in events if e.get("event") == EventName.ACTION_SIGNAL], output
    assert result["task42_alive"] is True  # the requeued job 42 runs on
    assert result["once43_code"] == 0, output
    assert result["files_after"] == []  # job 43's run found job 42's epilog gone: removed


def host_epilog_goes_on_when_the_daemon_stops(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """The epilog waits beside the daemon, whose rule is still in its 10 s confirmation window
    (long enough for the epilog's start on a loaded machine), and the daemon is stopped
    meanwhile (an upgrade, an admin): the epilog must not wait for nobody — it takes the lock
    and finishes the job itself."""
    with SimHost(root) as host:
        orphan_host(host)
        host.free_when_gone(["worker"], [gpu(0)], delay=0.5)
        run = Run(host, rules=[{**ORPHAN_RULE, "for": "10s"}])
        run.start()
        assert run.wait_for(lambda: run.saw(EventName.FINDING_NEW, kind="orphaned")), "no finding"
        said = root / "epilog.out"
        with said.open("w") as out:
            epilog = subprocess.Popen(
                [sys.executable, "-m", "gpuwatchd", "run", "--once", "--timeout", "30s",
                 "--config", str(run.config)],
                env=host.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        # The daemon is stopped once the epilog waits beside it (not after a guessed second).
        assert run.wait_for(lambda: "is running; waiting" in said.read_text()), said.read_text()
        stopped = run.stop()
        epilog.wait(timeout=60)
        output = said.read_text()
        daemon_signalled = run.saw(EventName.ACTION_SIGNAL)
        return {
            "stopped": stopped,
            "code": epilog.returncode,
            "output": output,
            "daemon_signalled": daemon_signalled,
            "worker_alive": host.alive(host.pids["worker"]),
        }


def test_an_epilog_beside_a_daemon_that_stops_goes_on_alone(tmp_path: Path) -> None:
    result = run_in_pid_namespace(
        f"{__name__}:host_epilog_goes_on_when_the_daemon_stops", {}, root=tmp_path
    )
    assert result["stopped"] == 0
    assert result["daemon_signalled"] is False  # the daemon stopped before its window ended
    assert "is running; waiting" in result["output"]
    assert "going on alone" in result["output"]
    assert result["code"] == 0, result["output"]
    assert result["worker_alive"] is False
