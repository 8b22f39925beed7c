"""End to end, GPU health: the real daemon, the fake NVML's Xid events and health fields, in a
PID namespace; its decisions are the ones ``simulate`` makes for the matching example scenario.

Each ``host_*`` function runs as PID 1 of its own PID namespace (tests/support/simhost.py). The
reset command is the fake ``nvidia-smi`` of tests/support/daemonrun.py, which restores the fake GPU
(here: with the health the driver would report after the reset); nothing can reach a real
reset, and the only process ever at stake is the test's own job, which the daemon must never
signal.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.sim.simulation import simulate
from tests.support.daemonrun import Run, _epoch, evidence_files, fake_smi, smi_calls
from tests.support.fakenvml import MiB, gpu, process
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)

pytestmark = [needs_pid_namespace(), pytest.mark.slow]

SCENARIOS = Path(__file__).resolve().parents[2] / "examples" / "scenarios"
HEALTH_KINDS = ("reset_required", "reboot_required", "drain_required")
# The decisions compared between the daemon and simulate, in order.
DECISIONS = (
    EventName.FINDING_NEW,
    EventName.HEALTH_DRAIN_STARTED,
    EventName.HEALTH_DRAIN_WAITING,
    EventName.HEALTH_DRAIN_TIMED_OUT,
    EventName.RESET_DUE,
    EventName.RESET_OUTCOME,
    EventName.GPU_NEEDS_REBOOT,
    EventName.FINDING_RESOLVED,
    EventName.ACTION_SIGNAL,
)


def decisions(events: list[dict[str, Any]]) -> list[tuple[str, object]]:
    """The health decisions in order: (event, finding kind or reset result)."""
    found: list[tuple[str, object]] = []
    for e in events:
        name = e.get("event")
        if name not in DECISIONS:
            continue
        finding = str(e.get("finding") or "")
        findings = (EventName.FINDING_NEW, EventName.FINDING_RESOLVED)
        if name in findings and not finding.startswith(HEALTH_KINDS):
            continue
        detail = (
            e.get("result")
            if name == EventName.RESET_OUTCOME
            else finding.split(":", maxsplit=1)[0] or None
        )
        if name == EventName.HEALTH_DRAIN_WAITING and found and found[-1] == (name, detail):
            # Said again when the blockers change: on a real host the job's exit and NVML's
            # listing change a poll apart, in a scenario at the same instant.
            continue
        found.append((str(name), detail))
    return found


def simulated(name: str) -> list[tuple[str, object]]:
    result = simulate(load_scenario(str(SCENARIOS / f"{name}.yaml")))
    return decisions([{"event": e.name, **e.fields} for e in result.timeline])


def restore_to(host: SimHost, state: dict[str, Any]) -> None:
    """What the fake reset writes back: the driver's view after a successful reset."""
    (host.root / "restored.json").write_text(json.dumps(state))


def job_on_gpu0(host: SimHost) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """A job holding GPU 0 (900 MiB; no recovery action asked) and the fake reset, which
    restores GPU 0 idle with none asked: the job's pid, GPU 0 as NVML lists it, the reset."""
    host.spawn("job", [{"open": host.cuda(0)}, {"sleep": 3600}])
    job = host.wait_ready("job")["job"]
    busy = gpu(0, allocated=900 * MiB, processes=[process(job, 900 * MiB)], recovery_action=0)
    host.nvml([busy])
    reset = fake_smi(host)
    restore_to(host, {**json.loads(host.fake.state_path.read_text()),
                      "gpus": [gpu(0, recovery_action=0)]})  # fmt: skip
    return job, busy, reset


def start_then_xid(
    run: Run, host: SimHost, gpus: list[dict[str, Any]], *, on: int, xid: int, name: str = ""
) -> None:
    """Start the daemon and let it poll a second; then NVML lists ``gpus`` and reports Xid
    ``xid`` on GPU ``on`` (its event id ``name``, else ``x<xid>``)."""
    run.start()
    run.wait_for(lambda: run.saw(EventName.DAEMON_START), timeout=30)
    time.sleep(1)
    host.nvml(gpus, events=[{"id": name or f"x{xid}", "gpu": on, "type": 8, "data": xid}])


def resolved_then_stop(run: Run) -> None:
    """Wait for the finding to be resolved, let five more polls pass, stop the daemon."""
    run.wait_for(lambda: run.saw(EventName.FINDING_RESOLVED), timeout=30)
    time.sleep(1)
    run.stop()


def job_ends(host: SimHost, job: int, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    """The job (alive, and the fake nvidia-smi's calls, returned) ends on its own terms (ours:
    we started it); then NVML lists ``gpus``."""
    during = {"alive": host.alive(job), "calls": smi_calls(host)}
    os.kill(job, signal.SIGTERM)
    host.wait_gone("job")
    host.nvml(gpus)
    return during


def drain_waits_for_the_job(
    run: Run, host: SimHost, job: int, gpus: list[dict[str, Any]]
) -> dict[str, Any]:
    """The daemon waits for the job to drain; ten polls later the job ends (``job_ends``, NVML
    then listing ``gpus``) and the finding is resolved: whether it waited, what held before the
    job's exit, the fake nvidia-smi's calls and the daemon's events."""
    waited = run.wait_for(lambda: run.saw(EventName.HEALTH_DRAIN_WAITING), timeout=30)
    time.sleep(2)  # ten polls: nothing may happen to the job (never signalled), and no reset
    before_exit = job_ends(host, job, gpus)
    resolved_then_stop(run)
    return {
        "waited": waited,
        "before_exit": before_exit,
        "calls": smi_calls(host),
        "events": run.events(),
    }


def resets(calls: list[str]) -> list[str]:
    return [c for c in calls if "--gpu-reset" in c]


def signalled(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == EventName.ACTION_SIGNAL]


def waited_for_the_job_then_reset_once(result: dict[str, Any], waited: str, during: str) -> None:
    """``waited`` came true, the job was alive and no reset ran ``during`` the wait; the job
    was never signalled; one reset ran in all."""
    assert result[waited] is True
    assert result[during]["alive"] is True
    assert resets(result[during]["calls"]) == []
    assert signalled(result["events"]) == []
    assert len(resets(result["calls"])) == 1


def host_xid_reset(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """Xid ``arg["xid"]`` on idle GPU 0 of two; the reset it asks for, then five more polls (no
    second reset). An R535/R550 driver: no recovery-action field (the fake's default), so the
    Xid decides."""
    with SimHost(root, gpus=2) as host:
        host.nvml([gpu(0), gpu(1)])
        reset = fake_smi(host)
        run = Run(host, reset={**reset, "cooldown": "0s"})
        start_then_xid(run, host, [gpu(0), gpu(1)], on=0, xid=arg["xid"])
        resolved_then_stop(run)
        return {"calls": smi_calls(host), "events": run.events()}


def host_row_remap_live_job(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=2) as host:
        host.spawn("job", [{"open": host.cuda(1)}, {"sleep": 3600}])
        job = host.wait_ready("job")["job"]
        pending = {"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False}
        applied = {**pending, "pending": False}
        busy = [gpu(0, remapped_rows=pending),
                gpu(1, allocated=900 * MiB, processes=[process(job, 900 * MiB)])]  # fmt: skip
        host.nvml(busy)
        reset = fake_smi(host)
        restore_to(host, json.loads(json.dumps({**json.loads(host.fake.state_path.read_text()),
                   "gpus": [gpu(0, remapped_rows=applied), gpu(1)]})))  # fmt: skip
        run = Run(host, reset={**reset, "cooldown": "0s"}, health={"drain_timeout": "10m"})
        run.start()
        return drain_waits_for_the_job(run, host, job, [gpu(0, remapped_rows=pending), gpu(1)])


def run_host(name: str, tmp_path: Path, **arg: Any) -> dict[str, Any]:
    return run_in_pid_namespace(f"{__name__}:{name}", arg, root=tmp_path, timeout=120.0)


def test_xid_95_through_the_daemon_is_one_reset_as_simulate_says(tmp_path: Path) -> None:
    result = run_host("host_xid_reset", tmp_path, xid=95)
    ran = resets(result["calls"])
    assert len(ran) == 1
    assert ran[0].endswith("-i GPU-00000000-face-4000-8000-000000000000")
    assert decisions(result["events"]) == simulated("xid-95-reset")


def test_pending_row_remap_waits_for_the_live_job_then_resets_as_simulate_says(
    tmp_path: Path,
) -> None:
    result = run_host("host_row_remap_live_job", tmp_path)
    waited_for_the_job_then_reset_once(result, "waited", "before_exit")
    assert decisions(result["events"]) == simulated("pending-row-remap-unisolated")


def marker_hook(host: SimHost, name: str) -> tuple[list[str], Path]:
    """A hook that appends a line to ``<root>/<name>.log`` each time it runs."""
    log = host.root / f"{name}.log"
    script = host.root / f"{name}.sh"
    script.write_text(f'#!/bin/sh\necho "$GPUWATCHD_EVENT" >> {log}\n')
    script.chmod(0o755)
    return [str(script)], log


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def host_xid_79_reboot(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=2) as host:
        host.nvml([gpu(0), gpu(1)])
        reset = fake_smi(host)
        drain, drained = marker_hook(host, "drain")
        page, paged = marker_hook(host, "page")
        run = Run(host, reset={**reset, "drain": [drain]}, on_failure=[page])
        start_then_xid(run, host, [gpu(0), gpu(1)], on=1, xid=79)
        run.wait_for(lambda: run.saw(EventName.GPU_NEEDS_REBOOT), timeout=30)
        time.sleep(2)  # ten polls: nothing may repeat, nothing may be reset
        run.stop()
        return {
            "calls": smi_calls(host),
            "events": run.events(),
            "drained": lines(drained),
            "paged": lines(paged),
        }


def host_xid_154_drain_and_reset(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=1) as host:
        job, busy, reset = job_on_gpu0(host)
        drain, drained = marker_hook(host, "drain")
        run = Run(host, reset={**reset, "cooldown": "0s", "drain": [drain]},
                  health={"drain_timeout": "10m"})  # fmt: skip
        asks = {**busy, "recovery_action": 4}  # DRAIN_AND_RESET, announced by Xid 154
        start_then_xid(run, host, [asks], on=0, xid=154)
        return {
            **drain_waits_for_the_job(run, host, job, [gpu(0, recovery_action=4)]),
            "drained": lines(drained),
            "evidence": evidence_files(host, run.config),
        }


def host_xid_13_application(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=1) as host:
        host.nvml([gpu(0)])
        reset = fake_smi(host)
        metrics = host.root / "gpuwatchd.prom"
        page, paged = marker_hook(host, "page")
        run = Run(host, reset=reset, on_failure=[page], metrics={"textfile": str(metrics)})
        start_then_xid(run, host, [gpu(0)], on=0, xid=13)

        def counted() -> bool:
            text = metrics.read_text() if metrics.exists() else ""
            return any(
                line.startswith("gpuwatchd_gpu_xid_events{") and 'xid="13"' in line
                and line.endswith(" 1.0")
                for line in text.splitlines()
            )  # fmt: skip

        seen = run.wait_for(counted, timeout=30)
        time.sleep(1)
        run.stop()
        return {"seen": seen, "calls": smi_calls(host), "events": run.events(),
                "paged": lines(paged)}  # fmt: skip


def test_xid_79_needs_a_reboot_hooks_once_and_never_a_reset_as_simulate_says(
    tmp_path: Path,
) -> None:
    result = run_host("host_xid_79_reboot", tmp_path)
    assert resets(result["calls"]) == []
    assert signalled(result["events"]) == []
    assert len(result["drained"]) == 1
    assert len(result["paged"]) == 1
    assert decisions(result["events"]) == simulated("xid-79-reboot")


def test_xid_154_drain_and_reset_waits_for_the_job_then_resets_once_as_simulate_says(
    tmp_path: Path,
) -> None:
    result = run_host("host_xid_154_drain_and_reset", tmp_path)
    assert len(result["drained"]) == 1  # before the wait; the reset itself does not drain again
    waited_for_the_job_then_reset_once(result, "waited", "before_exit")
    assert decisions(result["events"]) == simulated("xid-154-drain-and-reset")
    # Evidence before the drain (its job still running) and before the reset, each named by
    # its step's event.
    drain, reset = result["evidence"]["files"]
    assert [drain["action"], reset["action"]] == ["reset_drain", "gpu_reset"]
    (hook,) = [e for e in result["events"] if e.get("event") == EventName.HOOK_RUN]
    assert hook["evidence_file"] == drain["path"]
    (outcome,) = [e for e in result["events"] if e.get("event") == EventName.RESET_OUTCOME]
    assert outcome["evidence_file"] == reset["path"]
    assert drain["trees"], "the drain's evidence names the job holding the GPU"


def test_an_application_xid_is_counted_and_nothing_else_happens_as_simulate_says(
    tmp_path: Path,
) -> None:
    result = run_host("host_xid_13_application", tmp_path)
    assert result["seen"] is True  # the daemon read the event: the metric counts it
    assert resets(result["calls"]) == []
    assert result["paged"] == []
    assert decisions(result["events"]) == simulated("xid-13-application") == []


# --- NVIDIA's catalogue, recovery actions and the fabric, through the daemon ------------------


def test_a_solo_xid_48_through_the_daemon_is_one_reset_as_simulate_says(tmp_path: Path) -> None:
    result = run_host("host_xid_reset", tmp_path, xid=48)
    ran = resets(result["calls"])
    assert len(ran) == 1
    assert ran[0].endswith("-i GPU-00000000-face-4000-8000-000000000000")
    (new,) = [e for e in result["events"] if e.get("event") == EventName.FINDING_NEW]
    assert "solo: NVIDIA: reset the GPU" in new["reason"]
    assert new["evidence"]["recovery_action"].startswith("unknown (not_supported")
    assert decisions(result["events"]) == simulated("xid-48-solo-idle")


def xid_counted(metrics: Path, xid: int) -> Callable[[], bool]:
    def counted() -> bool:
        text = metrics.read_text() if metrics.exists() else ""
        return any(
            line.startswith("gpuwatchd_gpu_xid_events{") and f'xid="{xid}"' in line
            and line.endswith(" 1.0")
            for line in text.splitlines()
        )  # fmt: skip

    return counted


def host_xid_94_two_jobs(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=2) as host:
        host.spawn("train", [{"open": host.cuda(0)}, {"sleep": 3600}])
        host.spawn("serve", [{"open": host.cuda(1)}, {"sleep": 3600}])
        pids = host.wait_ready("train", "serve")
        busy = [
            gpu(0, allocated=900 * MiB, processes=[process(pids["train"], 900 * MiB)]),
            gpu(1, allocated=500 * MiB, processes=[process(pids["serve"], 500 * MiB)]),
        ]
        host.nvml(busy)
        reset = fake_smi(host)
        metrics = host.root / "gpuwatchd.prom"
        drain, drained = marker_hook(host, "drain")
        run = Run(host, reset={**reset, "cooldown": "0s", "drain": [drain]},
                  metrics={"textfile": str(metrics)})  # fmt: skip
        start_then_xid(run, host, busy, on=0, xid=94)
        seen = run.wait_for(xid_counted(metrics, 94), timeout=30)
        time.sleep(2)  # ten polls: nothing may happen
        alive = {name: host.alive(pid) for name, pid in pids.items()}
        run.stop()
        return {"seen": seen, "alive": alive, "calls": smi_calls(host), "events": run.events(),
                "drained": lines(drained)}  # fmt: skip


def test_xid_94_under_two_jobs_is_counted_and_never_resets_as_simulate_says(
    tmp_path: Path,
) -> None:
    result = run_host("host_xid_94_two_jobs", tmp_path)
    assert result["seen"] is True
    assert result["alive"] == {"train": True, "serve": True}
    assert resets(result["calls"]) == []
    assert signalled(result["events"]) == []
    assert result["drained"] == []
    assert decisions(result["events"]) == simulated("xid-94-two-jobs") == []


def host_drain_p2p(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=1) as host:
        job, busy, reset = job_on_gpu0(host)
        run = Run(host, reset={**reset, "cooldown": "0s"}, health={"drain_timeout": "10m"})
        start_then_xid(run, host, [{**busy, "recovery_action": 3}], on=0, xid=154, name="x154a")
        drained = run.wait_for(lambda: run.saw(EventName.HEALTH_DRAIN_STARTED), timeout=30)
        time.sleep(2)  # ten polls of DRAIN_P2P: no reset, the job runs on
        during = job_ends(host, job, [gpu(0, recovery_action=3)])
        time.sleep(1)
        # The driver settles on GPU_RESET, with no Xid 154 to say so: only re-reading sees it.
        host.nvml([gpu(0, recovery_action=1)])
        run.wait_for(lambda: run.saw(EventName.RESET_OUTCOME), timeout=30)
        run.wait_for(
            lambda: run.saw(EventName.FINDING_RESOLVED, finding="reset_required:"
                            "GPU-00000000-face-4000-8000-000000000000:gpu"),
            timeout=30,
        )  # fmt: skip
        run.stop()
        return {"drained": drained, "during": during, "calls": smi_calls(host),
                "events": run.events()}  # fmt: skip


def test_drain_p2p_is_re_read_until_it_settles_then_one_reset_as_simulate_says(
    tmp_path: Path,
) -> None:
    result = run_host("host_drain_p2p", tmp_path)
    waited_for_the_job_then_reset_once(result, "drained", "during")
    kinds = [e["kind"] for e in result["events"] if e.get("event") == EventName.FINDING_NEW]
    assert [k for k in kinds if k in HEALTH_KINDS] == ["drain_required", "reset_required"]
    assert decisions(result["events"]) == simulated("drain-p2p-settles-to-reset")


def host_fabric_in_progress(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=2) as host:
        completed = {"state": 3, "status": 0, "health_mask": 0, "health_summary": 1}
        host.nvml([gpu(0, fabric=completed), gpu(1, fabric=completed)])
        reset = fake_smi(host)
        # After the reset Fabric Manager has not registered the GPU again yet.
        registering = {**completed, "state": 2}
        restored = json.loads(host.fake.state_path.read_text())
        restored["gpus"] = [gpu(0, fabric=registering), gpu(1, fabric=completed)]
        restore_to(host, restored)
        after, undrained = marker_hook(host, "after")
        run = Run(host, reset={**reset, "cooldown": "0s", "after": [after],
                               "fabric_timeout": "60s"})  # fmt: skip
        start_then_xid(
            run, host, [gpu(0, fabric=completed), gpu(1, fabric=completed)], on=0, xid=95
        )
        waiting = run.wait_for(
            lambda: run.saw(EventName.RESET_STEP, status="fabric_waiting"), timeout=30
        )
        time.sleep(3)  # three reads a second apart: still IN_PROGRESS
        held = {"after": lines(undrained), "outcome": run.saw(EventName.RESET_OUTCOME)}
        completed_at = time.time()
        host.nvml([gpu(0, fabric=completed), gpu(1, fabric=completed)])
        run.wait_for(lambda: run.saw(EventName.RESET_OUTCOME), timeout=30)
        run.wait_for(lambda: run.saw(EventName.FINDING_RESOLVED), timeout=30)
        run.stop()
        return {
            "waiting": waiting,
            "held": held,
            "completed_at": completed_at,
            "after": lines(undrained),
            "calls": smi_calls(host),
            "events": run.events(),
        }


def test_a_reset_waits_for_the_nvlink_fabric_before_it_counts_and_undrains(
    tmp_path: Path,
) -> None:
    result = run_host("host_fabric_in_progress", tmp_path)
    assert result["waiting"] is True
    assert result["held"] == {"after": [], "outcome": False}
    assert result["after"] == ["reset_after"]
    (outcome,) = [e for e in result["events"] if e.get("event") == EventName.RESET_OUTCOME]
    assert outcome["result"] == "success"
    assert "fabric registration COMPLETED" in outcome["reason"]
    (done,) = [
        e
        for e in result["events"]
        if e.get("event") == EventName.RESET_STEP and e.get("status") == "fabric_completed"
    ]
    assert _epoch(done["timestamp"]) >= result["completed_at"] - 0.01
    assert len(resets(result["calls"])) == 1
    # Fabric Manager was never touched: the only commands were the reset procedure's own.
    assert all(c.split()[0] in ("--gpu-reset", "-pm", "-q") for c in result["calls"])


def host_xid_48_dry_run(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=2) as host:
        host.nvml([gpu(0), gpu(1)])
        reset = fake_smi(host)
        drain, drained = marker_hook(host, "drain")
        # No cooldown and room for five resets: only the dry-run shadow keeps the preview to
        # the one reset enforcement would make.
        run = Run(host, dry_run=True,
                  reset={**reset, "cooldown": "0s", "max_resets": 5,
                         "drain": [[*drain, "{uuid}", "{pci_bus_id}"]]})  # fmt: skip
        start_then_xid(run, host, [gpu(0), gpu(1)], on=0, xid=48)
        run.wait_for(lambda: run.saw(EventName.FINDING_RESOLVED), timeout=30)
        time.sleep(2)  # ten more polls
        run.stop()
        return {"calls": smi_calls(host), "events": run.events(), "drained": lines(drained)}


def test_the_journal_of_a_dry_run_daemon_previews_one_reset_with_hooks_filled_in(
    tmp_path: Path,
) -> None:
    result = run_host("host_xid_48_dry_run", tmp_path)
    assert result["calls"] == []  # nothing ran: no reset, no persistence, no health query
    assert result["drained"] == []  # the hook was never started
    outcomes = [e for e in result["events"] if e.get("event") == EventName.RESET_OUTCOME]
    assert [(e["result"], e["dry_run"]) for e in outcomes] == [("dry_run", True)]
    (booked,) = [e for e in result["events"] if e.get("event") == EventName.RESET_DRY_RUN]
    assert booked["assumed"].startswith("success")
    (hook,) = [e for e in result["events"] if e.get("event") == EventName.HOOK_RUN]
    assert hook["dry_run"] is True
    uuid, bus = hook["argv"][-2:]
    assert uuid == "GPU-00000000-face-4000-8000-000000000000"
    assert bus == outcomes[0]["pci_bus_id"]
    assert "detail" not in hook  # it would run: every placeholder has its value
    # The same decisions as the enforcing daemon and simulate, marked would-be.
    assert decisions(result["events"]) == [
        (name, "dry_run" if result_ == "success" else result_)
        for name, result_ in simulated("xid-48-solo-idle")
    ]
