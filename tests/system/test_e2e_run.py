"""End to end: the real ``gpuwatchd run`` daemon acting on real processes, in a PID namespace.

Each ``host_*`` function runs as PID 1 of its own PID namespace (tests/support/simhost.py), so
the daemon under test can only ever see and signal processes this test started. Resets go to a
fake reset script that records its argv and restores the fake GPU's memory; nothing here can
run a real reset. The daemon logs JSON lines to a file, which the scenario returns for the
assertions outside.
"""

from __future__ import annotations

import json
import os
import signal
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
    _epoch,
    _signals,
    evidence_files,
    fake_smi,
    orphan_host,
    smi_calls,
    stuck_host,
)
from tests.support.fakenvml import GiB, MiB, gpu, process
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)

pytestmark = [needs_pid_namespace(), pytest.mark.slow]


# --- scenarios, run inside the namespace ---------------------------------------------------


def host_orphan_exits_on_sigterm(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        orphan_host(host)
        run = Run(host)
        run.start()
        gone = run.wait_for(lambda: host.state_of(host.pids["worker"]) is None)
        run.wait_for(lambda: run.saw(EventName.ESCALATION_RESOLVED), timeout=5)
        code = run.stop()
        return {"gone": gone, "signals": _signals(run), "code": code, "pids": host.pids}


def host_orphan_ignores_sigterm(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        orphan_host(host, ignore_term=True)
        run = Run(host)
        run.start()
        gone = run.wait_for(lambda: host.state_of(host.pids["worker"]) is None, timeout=30)
        died_at = time.time()
        run.stop()
        return {"gone": gone, "died_at": died_at, "signals": _signals(run), "pids": host.pids}


def host_protected_is_never_signalled(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """Two inheritors of a dead job: one named nv-hostengine (the floor), one protected."""
    with SimHost(root) as host:
        engine = host.script("engine", [{"comm": "nv-hostengine"}, {"sleep": 3600}])
        keep = host.script("keepme", [{"sleep": 3600}])
        host.spawn(
            "trainer",
            [
                {"setsid": True},
                {"open": host.cuda(0)},
                {"fork": engine},
                {"fork": keep},
                {"exit": 0},
            ],
        )
        pids = host.wait_ready("trainer", "engine", "keepme")
        host.wait_gone("trainer")
        host.nvml([gpu(0, allocated=GiB, processes=[process(pids["trainer"], GiB)])])
        run = Run(host, protect={"commands": ['"name": "keepme"']})
        run.start()
        run.wait_for(lambda: run.saw(EventName.ACTION_REFUSED, pid=pids["keepme"]), timeout=10)
        time.sleep(3)  # longer than the whole ladder
        alive = {name: host.alive(pids[name]) for name in ("engine", "keepme")}
        run.stop()
        refused = [e for e in run.events() if e.get("event") == EventName.ACTION_REFUSED]
        report = host.scan_json(run.config)
        roles = {h["pid"]: h["role"] for h in report["gpus"][0]["holders"]}
        return {
            "alive": alive,
            "signals": _signals(run),
            "refused": refused,
            "pids": pids,
            "engine_role": roles.get(pids["engine"]),
        }


def host_pid_reuse(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """The target exits after SIGTERM and an unrelated process takes its PID."""
    with SimHost(root) as host:
        orphan_host(host, ignore_term=True)
        worker = host.pids["worker"]
        run = Run(
            host,
            rules=[
                {
                    **ORPHAN_RULE,
                    "steps": [
                        {"signal": "SIGTERM", "wait": "3s"},
                        {"signal": "SIGKILL", "wait": "1s"},
                    ],
                }
            ],
        )
        run.start()
        run.wait_for(lambda: run.saw(EventName.ACTION_SIGNAL, pid=worker, signal="SIGTERM"))
        os.kill(worker, signal.SIGKILL)  # our own child: it "exits" on its own
        run.wait_for(lambda: host.state_of(worker) is None)
        # Make the next fork take the same PID (ns_last_pid = pid - 1) and start a bystander.
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(worker - 1))
        host.spawn("bystander", [{"sleep": 3600}])
        host.wait_ready("bystander")
        time.sleep(5)  # past the old ladder's SIGKILL deadline
        run.stop()
        return {
            "worker": worker,
            "bystander": host.pids["bystander"],
            "bystander_alive": host.alive(host.pids["bystander"]),
            "signals": _signals(run),
        }


def host_ghost_reset(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=2) as host:
        host.nvml([gpu(0, allocated=3 * GiB), gpu(1)])
        run = Run(host, reset=fake_smi(host))
        run.start()
        run.wait_for(lambda: run.saw(EventName.RESET_OUTCOME), timeout=30)
        time.sleep(3)  # several more polls, within the cooldown
        run.stop()
        memory = json.loads(host.fake.state_path.read_text())["gpus"][0]["memory"]["used"]
        outcomes = [e for e in run.events() if e.get("event") == EventName.RESET_OUTCOME]
        return {
            "calls": smi_calls(host),
            "memory": memory,
            "outcomes": outcomes,
            "evidence": evidence_files(host, run.config),
        }


def host_reset_blocked_by_hidden_holder(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """A `before` hook starts a process that holds the GPU: the final scan must refuse."""
    with SimHost(root) as host:
        host.nvml([gpu(0, allocated=3 * GiB)])
        reset = fake_smi(host)
        holder = host.root / "holder.sh"
        holder.write_text(
            f"#!/bin/sh\nexec 3<>{host.devices_dir / 'nvidia0'}\n"
            f"setsid sleep 1000 <&3 >/dev/null 2>&1 &\necho $! > {host.root / 'holder.pid'}\n"
        )
        holder.chmod(0o755)
        reset["before"] = [[str(holder)]]
        run = Run(host, reset=reset)
        run.start()
        run.wait_for(lambda: run.saw(EventName.RESET_OUTCOME), timeout=30)
        run.stop()
        outcomes = [e for e in run.events() if e.get("event") == EventName.RESET_OUTCOME]
        return {"calls": smi_calls(host), "outcomes": outcomes}


def host_reset_hangs(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        host.nvml([gpu(0, allocated=3 * GiB)])
        reset = fake_smi(host)
        (host.root / "reset.behaviour").write_text("hang\n")
        marker = host.root / "on_failure.ran"
        run = Run(host, reset=reset, on_failure=[["touch", str(marker)]])
        run.start()
        run.wait_for(lambda: run.saw(EventName.RESET_OUTCOME), timeout=30)
        run.wait_for(marker.exists, timeout=10)
        run.stop()
        hang_pid = int((host.root / "hang.pid").read_text())
        outcomes = [e for e in run.events() if e.get("event") == EventName.RESET_OUTCOME]
        return {
            "outcomes": outcomes,
            "on_failure_ran": marker.exists(),
            "grandchild_alive": host.alive(hang_pid),
            "hooks": [e for e in run.events() if e.get("event") == EventName.HOOK_RUN],
            "evidence": evidence_files(host, run.config),
        }


def host_restart_mid_escalation(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        orphan_host(host, ignore_term=True)
        worker = host.pids["worker"]
        rule = {
            **ORPHAN_RULE,
            "steps": [{"signal": "SIGTERM", "wait": "4s"}, {"signal": "SIGKILL", "wait": "1s"}],
        }
        first = Run(host, rules=[rule])
        first.start()
        first.wait_for(lambda: first.saw(EventName.ACTION_SIGNAL, pid=worker, signal="SIGTERM"))
        first.stop()
        second = Run(host, rules=[rule])
        second.log = host.root / "daemon2.log"
        second.start()
        gone = second.wait_for(lambda: host.state_of(worker) is None, timeout=20)
        second.stop()
        return {"first": _signals(first), "second": _signals(second), "gone": gone}


def host_killed_mid_reset(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        host.nvml([gpu(0, allocated=3 * GiB)])
        reset = fake_smi(host)
        reset["timeout"] = "60s"
        after = host.root / "after.ran"
        reset["after"] = [["touch", str(after)]]
        (host.root / "reset.behaviour").write_text("hang\n")
        first = Run(host, reset=reset)
        first.start()
        first.wait_for((host.root / "hang.pid").exists, timeout=30)
        first.stop(signal.SIGKILL)  # a crash in the middle of the reset
        hang_pid = int((host.root / "hang.pid").read_text())
        os.kill(hang_pid, signal.SIGKILL)  # the orphaned reset command ends on its own
        (host.root / "reset.behaviour").write_text("ok\n")
        second = Run(host, reset=reset)
        second.log = host.root / "daemon2.log"
        second.start()
        second.wait_for(lambda: second.saw(EventName.RESET_RESUMED), timeout=20)
        time.sleep(1)
        second.stop()
        return {
            "calls": smi_calls(host),
            "after_ran": after.exists(),
            "second": [e.get("event") for e in second.events()],
        }


def host_stuck_orphan(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """An inheritor stuck in D state: reported, on_failure once, never a SIGKILL loop."""
    with SimHost(root) as host:
        pids = stuck_host(host)
        marker = host.root / "on_failure.log"
        hook = host.root / "on_failure.sh"
        hook.write_text(f'#!/bin/sh\necho "$GPUWATCHD_EVENT" >> {marker}\n')
        hook.chmod(0o755)
        run = Run(
            host,
            on_failure=[[str(hook)]],
            rules=[ORPHAN_RULE, {"name": "stuck", "kind": "stuck", "steps": [{"signal": None}]}],
        )
        run.start()
        run.wait_for(lambda: run.saw(EventName.TARGET_STUCK), timeout=15)
        time.sleep(3)  # many polls: the hook must not run again
        run.stop()
        stuck_events = [e for e in run.events() if e.get("event") == EventName.TARGET_STUCK]
        return {
            "signals": _signals(run),
            "stuck_events": stuck_events,
            "hook_runs": marker.read_text().splitlines() if marker.exists() else [],
            "still_there": host.state_of(pids["stuck"]),
        }


def _slurm_step_dirs(base: Path) -> dict[tuple[int, str], str]:
    """Step 0 of Slurm jobs 41 and 42 below ``base``: its slurmstepd's and its task's cgroup
    folders, made."""
    dirs = {}
    for job in (41, 42):
        for sub in ("slurm", "user/task_0"):
            path = base / SLURM_SCOPE / f"job_{job}" / "step_0" / sub
            path.mkdir(parents=True, exist_ok=True)
            dirs[(job, sub)] = str(path)
    return dirs


def host_abandoned_slurm_job(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """Job 41 runs (its slurmstepd lives); job 42 ended but a task still holds GPU 1."""
    dirs = _slurm_step_dirs(Path(arg["cgroup_base"]))
    with SimHost(root, gpus=2) as host:
        host.spawn("stepd41", [{"cgroup": dirs[(41, "slurm")]}, {"sleep": 3600}])
        # slurmstepd starts each task in a session of its own.
        for job, minor in ((41, 0), (42, 1)):
            host.spawn(
                f"task{job}",
                [
                    {"setsid": True},
                    {"cgroup": dirs[(job, "user/task_0")]},
                    {"open": host.cuda(minor)},
                ],
            )
        pids = host.wait_ready("stepd41", "task41", "task42")
        host.nvml(
            [
                gpu(0, allocated=GiB, processes=[process(pids["task41"], GiB)]),
                gpu(1, allocated=GiB),
            ]
        )
        rule = {
            "name": "ended-jobs",
            "kind": "abandoned",
            "for": "0s",
            "steps": [{"signal": "SIGTERM", "wait": "2s"}, {"signal": "SIGKILL", "wait": "1s"}],
        }
        run = Run(host, rules=[rule])
        run.start()
        gone = run.wait_for(lambda: host.state_of(pids["task42"]) is None, timeout=20)
        run.stop()
        signalled = [
            (e.get("pid"), e.get("kind"), e.get("signal"))
            for e in run.events()
            if e.get("event") == EventName.ACTION_SIGNAL
        ]
        return {
            "pids": pids,
            "gone": gone,
            "signalled": signalled,
            "task41_alive": host.alive(pids["task41"]),
        }


def host_kill_cap(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        names = []
        listed = []
        for i in range(5):
            worker = host.script(f"w{i}", [{"sleep": 3600}])
            host.spawn(
                f"t{i}", [{"setsid": True}, {"open": host.cuda(0)}, {"fork": worker}, {"exit": 0}]
            )
            names += [f"t{i}", f"w{i}"]
        pids = host.wait_ready(*names)
        host.wait_gone(*(f"t{i}" for i in range(5)))
        listed = [process(pids[f"t{i}"], 500 * MiB) for i in range(5)]
        host.nvml([gpu(0, allocated=2500 * MiB, processes=listed)])
        run = Run(
            host,
            limits={
                "post_action_delay": "0s",
                "max_signalled_per_poll": 2,
                "max_signalled_per_hour": 32,
            },
        )
        run.start()
        run.wait_for(lambda: run.saw(EventName.LIMITS_KILL_CAP_REACHED), timeout=20)
        time.sleep(2)
        run.stop()
        alive = sum(host.alive(pids[f"w{i}"]) for i in range(5))
        caps = [e for e in run.events() if e.get("event") == EventName.LIMITS_KILL_CAP_REACHED]
        return {"signals": _signals(run), "alive": alive, "caps": caps}


def host_dry_run(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=2) as host:
        orphan_host(host)
        host.nvml(
            [
                gpu(0, allocated=700 * MiB, processes=[process(host.pids["trainer"], 700 * MiB)]),
                gpu(1, allocated=3 * GiB),
            ]
        )
        run = Run(host, dry_run=True, reset=fake_smi(host))
        run.start()
        run.wait_for(lambda: run.saw(EventName.RESET_OUTCOME), timeout=30)
        time.sleep(3)
        run.stop()
        report = host.scan_json(run.config)  # reads the stopped daemon's state
        return {
            "first_seen": {f["kind"]: f["first_seen"] for f in report["findings"]},
            "evidence": evidence_files(host, run.config),
            "resets": [e for e in run.events() if e.get("event") == EventName.RESET_OUTCOME],
            "scanned_at": time.time(),
            "alive": host.alive(host.pids["worker"]),
            "signals": _signals(run),
            "calls": smi_calls(host),
            "events": sorted({str(e.get("event")) for e in run.events()}),
        }


# --- tests ---------------------------------------------------------------------------------

GPU0 = "GPU-00000000-face-4000-8000-000000000000"
GPU1 = "GPU-00000001-face-4000-8000-000000000001"


def run_scenario(name: str, tmp_path: Path, timeout: float = 120.0) -> dict[str, Any]:
    return run_in_pid_namespace(f"{__name__}:{name}", {}, root=tmp_path, timeout=timeout)


def test_orphan_that_exits_on_sigterm_gets_no_sigkill(tmp_path: Path) -> None:
    result = run_scenario("host_orphan_exits_on_sigterm", tmp_path)
    worker = result["pids"]["worker"]
    assert result["gone"] is True
    sent = [(s["pid"], s["signal"], s["outcome"]) for s in result["signals"]]
    assert sent == [(worker, "SIGTERM", "delivered")]
    assert result["code"] == 0


def test_orphan_ignoring_sigterm_dies_to_sigkill_when_the_wait_ends(tmp_path: Path) -> None:
    result = run_scenario("host_orphan_ignores_sigterm", tmp_path)
    worker = result["pids"]["worker"]
    assert result["gone"] is True
    sent = [(s["pid"], s["signal"], s["outcome"]) for s in result["signals"]]
    assert sent == [(worker, "SIGTERM", "delivered"), (worker, "SIGKILL", "delivered")]
    term, kill = (_epoch(s["timestamp"]) for s in result["signals"])
    assert 2.0 - 0.5 <= kill - term <= 2.0 + 0.5, kill - term


def test_protected_infrastructure_matching_a_rule_is_never_signalled(tmp_path: Path) -> None:
    result = run_scenario("host_protected_is_never_signalled", tmp_path)
    assert result["alive"] == {"engine": True, "keepme": True}
    assert result["signals"] == []
    keep = result["pids"]["keepme"]
    assert [e["pid"] for e in result["refused"] if e["pid"] == keep]
    assert all("protect" in json.dumps(e) for e in result["refused"] if e["pid"] == keep)
    # Infrastructure on the floor is never even a target: the scan lists it as management.
    assert result["engine_role"] == "management"


def test_pid_reused_before_the_next_step_is_not_signalled(tmp_path: Path) -> None:
    result = run_scenario("host_pid_reuse", tmp_path)
    assert result["bystander"] == result["worker"], "the PID was not reused as arranged"
    assert result["bystander_alive"] is True
    kills = [s for s in result["signals"] if s["signal"] == "SIGKILL"]
    assert all(s["outcome"] != "delivered" for s in kills)


def test_ghost_memory_gets_exactly_one_reset_then_cooldown(tmp_path: Path) -> None:
    result = run_scenario("host_ghost_reset", tmp_path)
    resets = [c for c in result["calls"] if "--gpu-reset" in c]
    assert len(resets) == 1
    assert resets[0].endswith("-i GPU-00000000-face-4000-8000-000000000000")
    assert result["memory"] == 2 * MiB
    assert [o["result"] for o in result["outcomes"]] == ["success"]
    # Before the procedure's first step: one evidence file, named by the outcome's event.
    (kept,) = result["evidence"]["files"]
    assert kept["path"] == result["outcomes"][0]["evidence_file"]
    assert (kept["action"], kept["gpu"], kept["dry_run"]) == ("gpu_reset", GPU0, False)
    assert kept["mode"] == 0o600
    assert kept["report_gpus"] == [GPU0, GPU1]  # the scan --json report of the deciding poll
    assert kept["truncated"] == []
    assert kept["report_spares"] == []  # marked as scan marks them
    explained = result["evidence"]["explain"]
    assert explained["code"] == 0, explained["stderr"]
    assert explained["evidence"]["action"] == "gpu_reset"
    assert [f["kind"] for f in explained["findings"]] == ["ghost_memory"]
    (listed,) = result["evidence"]["status"]
    assert listed["path"] == kept["path"]


def test_reset_refused_when_a_holder_appears_before_the_final_scan(tmp_path: Path) -> None:
    result = run_scenario("host_reset_blocked_by_hidden_holder", tmp_path)
    assert not [c for c in result["calls"] if "--gpu-reset" in c]
    assert result["outcomes"][0]["result"] == "refused"
    assert "holds" in json.dumps(result["outcomes"][0]["blockers"])


def test_hanging_reset_is_killed_at_the_timeout_and_on_failure_runs(tmp_path: Path) -> None:
    result = run_scenario("host_reset_hangs", tmp_path)
    assert result["outcomes"][0]["result"] == "timeout"
    assert result["on_failure_ran"] is True
    assert result["grandchild_alive"] is False
    # Evidence before the reset, and again before the on_failure hooks that followed it.
    reset, failure = result["evidence"]["files"]
    assert [reset["action"], failure["action"]] == ["gpu_reset", "on_failure"]
    assert result["outcomes"][0]["evidence_file"] == reset["path"]
    # One EventName.HOOK_RUN: the on_failure hook's. No other (a stop that counted a finished
    # command's keeper, still exiting under load, as one that had left processes running said
    # one).
    hooks = result["hooks"]
    assert len(hooks) == 1, json.dumps(hooks, indent=1)
    assert (hooks[0]["hook"], hooks[0]["evidence_file"]) == ("on_failure", failure["path"])


def test_restart_mid_escalation_continues_the_ladder(tmp_path: Path) -> None:
    result = run_scenario("host_restart_mid_escalation", tmp_path)
    assert [s["signal"] for s in result["first"]] == ["SIGTERM"]
    assert [s["signal"] for s in result["second"]] == ["SIGKILL"]
    assert result["gone"] is True


def test_daemon_killed_mid_reset_finishes_it_at_next_start_without_resetting_again(
    tmp_path: Path,
) -> None:
    result = run_scenario("host_killed_mid_reset", tmp_path)
    resets = [c for c in result["calls"] if "--gpu-reset" in c]
    assert len(resets) == 1
    assert result["after_ran"] is True
    assert any(c.startswith("-pm 1") for c in result["calls"])
    assert EventName.RESET_RESUMED in result["second"]


def test_stuck_target_is_reported_once_and_never_put_through_sigkill(tmp_path: Path) -> None:
    result = run_scenario("host_stuck_orphan", tmp_path)
    assert [s for s in result["signals"] if s["signal"] == "SIGKILL"] == []
    assert result["stuck_events"]
    assert result["stuck_events"][0]["level"] == "critical"
    assert len(result["hook_runs"]) == 1
    assert result["still_there"] == "D"


def test_process_left_behind_by_an_ended_slurm_job_is_abandoned_and_signalled(
    tmp_path: Path, cgroup_base: Path
) -> None:
    result = run_in_pid_namespace(
        f"{__name__}:host_abandoned_slurm_job",
        {"cgroup_base": str(cgroup_base)},
        root=tmp_path,
        timeout=120,
    )
    task42 = result["pids"]["task42"]
    assert result["gone"] is True
    assert (task42, "abandoned", "SIGTERM") in [tuple(s) for s in result["signalled"]]
    assert all(s[0] == task42 for s in result["signalled"])
    assert result["task41_alive"] is True


def test_kill_cap_honoured_with_dry_run_engaged_and_a_critical_event(tmp_path: Path) -> None:
    result = run_scenario("host_kill_cap", tmp_path)
    delivered = {s["pid"] for s in result["signals"] if s["outcome"] == "delivered"}
    assert len(delivered) <= 2
    assert result["alive"] >= 3
    assert result["caps"]
    assert result["caps"][0]["level"] == "critical"


def test_dry_run_logs_the_same_decisions_and_touches_nothing(tmp_path: Path) -> None:
    result = run_scenario("host_dry_run", tmp_path)
    assert result["alive"] is True
    assert result["signals"]
    assert all(s["dry_run"] is True and s["outcome"] == "dry_run" for s in result["signals"])
    assert not [c for c in result["calls"] if "--gpu-reset" in c or "-pm" in c]
    assert EventName.RESET_OUTCOME in result["events"]
    # scan shows since when the daemon has seen each finding (explain uses it).
    seen = result["first_seen"]
    assert {"orphaned", "ghost_memory"} <= set(seen)
    assert all(t is not None and t < result["scanned_at"] - 3 for t in seen.values()), seen
    # The would-be reset leaves the evidence file enforcement would, marked a dry run's.
    (outcome,) = result["resets"]
    (kept,) = result["evidence"]["files"]
    assert outcome["evidence_file"] == kept["path"]
    assert (kept["action"], kept["gpu"], kept["dry_run"]) == ("gpu_reset", GPU1, True)
    assert kept["path"].endswith(f"-gpu_reset-dry-{GPU1}.json")


# --- issue 15: leaks from before the daemon watched; the scheduler's word ------------------------


def host_leak_before_watch(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """A trainer (session leader) forked a worker and died before any gpuwatchd ran; NVML lists
    nothing but 20 GiB stay allocated. An idle notebook kernel leads its own session."""
    with SimHost(root) as host:
        worker = host.script("worker", [{"sleep": 3600}])
        host.spawn(
            "trainer", [{"setsid": True}, {"open": host.cuda(0)}, {"fork": worker}, {"exit": 0}]
        )
        host.spawn("notebook", [{"setsid": True}, {"open": host.cuda(0)}, {"sleep": 3600}])
        pids = host.wait_ready("trainer", "worker", "notebook")
        host.wait_gone("trainer")
        host.nvml([gpu(0, allocated=20 * GiB)])
        rules = [ORPHAN_RULE]
        limits = {"post_action_delay": "0s"}
        default = host.config(dry_run=False, rules=rules, limits=limits)
        scan = host.gpuwatchd("scan", "--config", str(default))
        opt_in = host.config(
            dry_run=False,
            rules=rules,
            limits=limits,
            detection={"orphans_without_history": True},
            log={"format": "json"},
        )
        # As the driver does: the memory comes back a moment after its last holder is gone.
        host.free_when_gone(["worker"], [gpu(0)], delay=1.0)
        once = host.gpuwatchd("run", "--once", "--timeout", "30s", "--config", str(opt_in))
        host.reap()
        return {
            "pids": pids,
            "scan": scan.stdout,
            "scan_code": scan.returncode,
            "once_code": once.returncode,
            "once_output": once.stdout + once.stderr,
            "worker_alive": host.alive(pids["worker"]),
            "notebook_alive": host.alive(pids["notebook"]),
        }


def test_leak_from_before_the_daemon_scan_shows_the_heir_and_once_frees_it_with_the_key(
    tmp_path: Path,
) -> None:
    result = run_scenario("host_leak_before_watch", tmp_path)
    worker, trainer = result["pids"]["worker"], result["pids"]["trainer"]
    assert result["scan_code"] == 0, result["scan"]
    assert f"its session leader PID {trainer} is gone" in result["scan"]
    assert (
        f"likely heir(s) of memory leaked before gpuwatchd watched: PID {worker}" in result["scan"]
    )
    assert result["once_code"] == 0, result["once_output"]
    assert result["worker_alive"] is False, result["once_output"]
    assert result["notebook_alive"] is True
    signalled = [
        json.loads(line)
        for line in result["once_output"].splitlines()
        if line.startswith("{") and f'"{EventName.ACTION_SIGNAL}"' in line
    ]
    assert {(e["pid"], e["kind"]) for e in signalled} == {(worker, "orphaned")}


def host_epilog_names_ended_job(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """Job 42's slurmstepd still lives (so the cgroup alone says "running"), but the epilog says
    the job ended: its task is abandoned for that run; job 41's task is untouched."""
    dirs = _slurm_step_dirs(Path(arg["cgroup_base"]))
    with SimHost(root, gpus=2) as host:
        for job, minor in ((41, 0), (42, 1)):
            host.spawn(f"stepd{job}", [{"cgroup": dirs[(job, "slurm")]}, {"sleep": 3600}])
            host.spawn(
                f"task{job}",
                [
                    {"setsid": True},
                    {"cgroup": dirs[(job, "user/task_0")]},
                    {"open": host.cuda(minor)},
                ],
            )
        pids = host.wait_ready("stepd41", "stepd42", "task41", "task42")
        job41 = gpu(0, allocated=GiB, processes=[process(pids["task41"], GiB)])
        host.nvml([job41, gpu(1, allocated=GiB)])
        # As the driver does: GPU 1's memory comes back a moment after task 42 is gone.
        host.free_when_gone(["task42"], [job41, gpu(1)], delay=0.5)
        rule = {
            "name": "ended-jobs",
            "kind": "abandoned",
            "for": "0s",
            "steps": [{"signal": "SIGTERM", "wait": "2s"}, {"signal": "SIGKILL", "wait": "1s"}],
        }
        config = host.config(dry_run=False, rules=[rule], log={"format": "json"})
        daemon = None
        if arg.get("daemon"):
            # The daemon runs (as under systemd): the epilog hands the job over and waits.
            daemon = Run(host, rules=[rule], limits={"post_action_delay": "0s"})
            config = daemon.config
            daemon.start()
            daemon.wait_for(lambda: daemon.saw(EventName.DAEMON_START), timeout=30)
            time.sleep(1)  # polls without the hand-over: job 42's task is left alone
        bad = host.gpuwatchd("run", "--once", "--ended-job", "slurm:4x2", "--config", str(config))
        env = {**host.env(), "SLURM_JOB_ID": "42"}
        argv = ["run", "--once", "--ended-job", "slurm", "--timeout", "30s"]
        once = subprocess.run(
            [sys.executable, "-m", "gpuwatchd", *argv, "--config", str(config)],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        host.reap()
        daemon_events = []
        if daemon is not None:
            daemon.stop()
            daemon_events = daemon.events()
        return {
            "pids": pids,
            "daemon_events": daemon_events,
            "handed_over": [p.name for p in host.state_dir.glob("ended-job-*")],
            "bad_code": bad.returncode,
            "bad_err": bad.stderr,
            "once_code": once.returncode,
            "once_output": once.stdout + once.stderr,
            "task42_alive": host.alive(pids["task42"]),
            "task41_alive": host.alive(pids["task41"]),
        }


@pytest.mark.parametrize("daemon", [False, True], ids=["alone", "beside-the-daemon"])
def test_epilog_ended_job_makes_its_holders_abandoned_for_that_run(
    tmp_path: Path, cgroup_base: Path, daemon: bool
) -> None:
    result = run_in_pid_namespace(
        f"{__name__}:host_epilog_names_ended_job",
        {"cgroup_base": str(cgroup_base), "daemon": daemon},
        root=tmp_path,
        timeout=120,
    )
    if daemon:
        events = result["daemon_events"]
        assert "handed to the running daemon: slurm:42 ended" in result["once_output"]
        taken = [e for e in events if e.get("event") == EventName.SCHEDULER_ENDED_JOB]
        assert [e.get("job") for e in taken] == ["slurm:42"]
        signalled = {e["pid"] for e in events if e.get("event") == EventName.ACTION_SIGNAL}
        assert signalled == {result["pids"]["task42"]}
        names = [e.get("event") for e in events]
        assert names.index(EventName.SCHEDULER_ENDED_JOB) < names.index(EventName.ACTION_SIGNAL)
        assert result["handed_over"] == []  # withdrawn when the epilog's wait ended
    assert result["bad_code"] == 78
    assert "'4x2' is not a valid slurm id" in result["bad_err"]
    assert result["once_code"] == 0, result["once_output"]
    assert result["task42_alive"] is False, result["once_output"]
    assert result["task41_alive"] is True
