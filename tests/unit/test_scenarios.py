"""The incident library: each example scenario's timeline has the facts its header promises."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from pathlib import Path

import pytest

from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.sim.simulation import simulate
from gpuwatchd.sim.timeline import SimulationResult, render_text

SCENARIOS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "scenarios"


def run(name: str) -> SimulationResult:
    return simulate(load_scenario(str(SCENARIOS / f"{name}.yaml")))


def signals_to(result: SimulationResult, process: str) -> list[tuple[float, str]]:
    return [(t, sig) for t, name, sig, outcome in result.signals() if name == process]


def test_every_example_scenario_has_a_test_here() -> None:
    names = {p.stem for p in SCENARIOS.glob("*.yaml")}
    tested = {n.removeprefix("test_").replace("_", "-") for n in globals() if n.startswith("test_")}
    assert names <= tested, names - tested


def test_dataloader_orphans() -> None:
    r = run("dataloader-orphans")
    assert signals_to(r, "worker-0") == [(50.0, "SIGTERM")]
    assert signals_to(r, "worker-2") == [(50.0, "SIGTERM"), (80.0, "SIGKILL")]
    assert signals_to(r, "trainer") == []
    assert r.final["open_findings"] == []
    assert r.final["gpus"][0]["allocated"] == r.final["gpus"][0]["idle"]  # type: ignore[index]
    assert r.resets() == []


def test_torchrun_agent_died() -> None:
    r = run("torchrun-agent-died")
    signalled = {name for _, name, _, _ in r.signals()}
    assert signalled == {"rank-1-loader"}
    assert signals_to(r, "rank-1-loader") == [(150.0, "SIGTERM")]
    assert not [e for e in r.entries(EventName.FINDING_NEW) if e.t < 120.0]


def test_zombie_child_keeps_memory() -> None:
    r = run("zombie-child-keeps-memory")
    assert signals_to(r, "trainer") == []
    assert signals_to(r, "helper") == [(40.0, "SIGTERM")]
    reaps = r.entries(EventName.ZOMBIE_NEEDS_REAP)
    assert reaps
    assert reaps[0].fields["parent"] == 5100
    assert r.final["open_findings"] == []


def test_stuck_d_state() -> None:
    r = run("stuck-d-state")
    assert signals_to(r, "worker-stuck") == []
    assert [e.t for e in r.entries(EventName.TARGET_STUCK)] == [15.0]
    hooks = r.entries(EventName.HOOK_RUN)
    assert len(hooks) == 1
    assert hooks[0].fields["argv"][0] == "scontrol"  # type: ignore[index]
    assert signals_to(r, "worker-ok") == [(40.0, "SIGTERM")]
    assert r.resets() == []


def test_nohup_job() -> None:
    r = run("nohup-job")
    assert r.signals() == []
    assert r.entries(EventName.FINDING_NEW) == []
    assert r.scenario.duration == 3600.0


def test_container_no_hostpid() -> None:
    r = run("container-no-hostpid")
    assert r.signals() == []
    assert r.resets() == []
    new = r.entries(EventName.FINDING_NEW)
    assert new
    assert all(e.fields["actionable"] is False for e in new)


def test_xid_leaked_context() -> None:
    r = run("xid-leaked-context")
    assert [(t, result) for t, _, result in r.resets()] == [(150.0, "success")]
    assert r.signals() == []
    assert r.final["open_findings"] == []


def test_protected_dcgm() -> None:
    r = run("protected-dcgm")
    assert signals_to(r, "nv-hostengine") == []
    assert [result for _, _, result in r.resets()] == ["refused"]
    outcome = r.entries(EventName.RESET_OUTCOME)[0]
    assert "nv-hostengine" in str(outcome.fields["blockers"])


def test_reset_blocked_hidden_holder() -> None:
    r = run("reset-blocked-hidden-holder")
    # Ghost memory is confirmed while nothing holds the GPU, and the reset starts. The probe
    # (a monitor: no context, no memory) never makes it anything but ghost memory.
    ghost = [e.t for e in r.entries(EventName.FINDING_NEW) if e.fields["kind"] == "ghost_memory"]
    assert ghost == [0.0]
    assert [e.t for e in r.entries(EventName.RESET_DUE)] == [120.0, 720.0]
    # The probe starts during the drain step, and the final scan refuses, naming it.
    [start] = r.entries("world.start")
    assert (start.t, start.fields["process"], start.fields["during"]) == (
        120.0,
        "gpu-probe",
        "drain",
    )
    first = [e for e in r.entries(EventName.RESET_STEP) if e.t == 120.0]
    assert [(e.fields["step"], e.fields["status"]) for e in first] == [
        ("drain", "ok"),
        ("stop_nvml", "ok"),
        ("before_hooks", "skipped"),
        ("stop_monitors", "skipped"),  # no reset.monitors
        ("persistence_off", "ok"),
        ("final_scan", "blocked"),
        ("persistence_on", "ok"),  # the undo: persistence mode back on...
        ("start_monitors", "skipped"),
        ("after_hooks", "ok"),  # ...then the after hook, which resumes the node
    ]
    blocker = "pid 2600 (python) holds the GPU's device file via fd+map"
    assert first[5].fields["blockers"] == [blocker]
    assert first[6].fields["argv"][:3] == ["nvidia-smi", "-pm", "1"]  # type: ignore[index]
    assert "state=resume" in first[8].fields["hooks"][0]  # type: ignore[index]
    refused = r.entries(EventName.RESET_OUTCOME)[0]
    assert (refused.fields["result"], refused.fields["step"]) == ("refused", "final_scan")
    assert refused.fields["blockers"] == [blocker]
    # While the probe holds the GPU the reset waits for it, naming it; its exit at +5m lifts
    # the refusal, and the cooldown (10m) the refusal started holds the second attempt until
    # +12m, which resets the GPU.
    waits = [
        e for e in r.entries(EventName.RESET_REFUSED) if "monitor pid 2600" in str(e.fields["why"])
    ]
    assert [e.t for e in waits] == [125.0]
    cleared = r.entries(EventName.RESET_REFUSAL_CLEARED)
    assert [(e.t, e.fields["why"]) for e in cleared] == [
        (300.0, "what held the GPU since the refusal has let go")
    ]
    assert [e.t for e in r.entries(EventName.RESET_REFUSED) if e.fields["why"] == "cooldown"] == [
        300.0
    ]
    assert [(t, result) for t, _, result in r.resets()] == [(120.0, "refused"), (720.0, "success")]
    assert r.signals() == []
    assert r.final["open_findings"] == []
    assert r.final["gpus"][0]["allocated"] == r.final["gpus"][0]["idle"]  # type: ignore[index]


def test_monitor_beside_ghost() -> None:
    """A monitor never keeps leaked memory from being ghost memory; reset.monitors names it,
    so the reset stops it (SIGTERM, and the wait until it let go) and resets the GPU."""
    r = run("monitor-beside-ghost")
    found = [(e.t, e.fields["kind"]) for e in r.entries(EventName.FINDING_NEW)]
    assert found == [(0.0, "ghost_memory"), (0.0, "hidden_holder")]
    stop = [e for e in r.entries(EventName.RESET_STEP) if e.fields["step"] == "stop_monitors"]
    assert [(e.fields["status"], e.fields["monitors"]) for e in stop] == [
        ("ok", ["pid 4100 (python3, unit session-2.scope)"])
    ]
    assert [result for _t, _gpu, result in r.resets()] == ["success"]
    assert r.signals() == [], "no kill ladder: a monitor is never a target"
    assert r.final["open_findings"] == []
    assert r.final["gpus"][0]["allocated"] == r.final["gpus"][0]["idle"]  # type: ignore[index]


def test_reset_refused_in_use() -> None:
    """The driver's "in use" is a hidden holder: refused, not failed; a finding names the gap;
    the drain hook is not run again for the incident until the memory changes."""
    r = run("reset-refused-in-use")
    assert [(t, result) for t, _, result in r.resets()] == [(60.0, "in_use"), (660.0, "success")]
    assert r.entries(EventName.RESET_FAILED) == []
    assert r.entries(EventName.HOOK_RUN) == []  # no on_failure: nothing failed
    hidden = [e for e in r.entries(EventName.FINDING_NEW) if e.fields["kind"] == "hidden_holder"]
    assert [(e.t, e.fields["pid"], e.fields["actionable"]) for e in hidden] == [(65.0, None, False)]
    assert "unix-socket message" in str(hidden[0].fields["reason"])
    drains = [e.t for e in r.entries(EventName.RESET_STEP) if e.fields["step"] == "drain"]
    assert drains == [60.0, 660.0]  # once for the refused attempt, once after the change
    [cleared] = r.entries(EventName.RESET_REFUSAL_CLEARED)
    assert cleared.t == 480.0
    assert "allocated memory changed" in str(cleared.fields["why"])
    assert r.final["open_findings"] == []


def test_reset_fails_drain() -> None:
    r = run("reset-fails-drain")
    assert [result for _, _, result in r.resets()] == ["failed"]
    hooks = r.entries(EventName.HOOK_RUN)
    assert len(hooks) == 1
    assert "state=drain" in hooks[0].fields["argv"]  # type: ignore[operator]
    assert r.entries(EventName.RESET_LIMIT_REACHED)


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.yaml")), ids=lambda p: p.stem)
def test_example_scenario_has_a_comment_header_and_description(path: pathlib.Path) -> None:
    text = path.read_text()
    assert text.startswith("# ")
    assert load_scenario(str(path)).description


def test_stuck_d_state_in_dry_run_runs_no_hook_and_says_it_would() -> None:
    """simulate used to print 'on_failure hook ran' and 'hooks run: 1' in dry-run, where the
    daemon runs nothing: now both log the hook with outcome=dry_run."""
    path = SCENARIOS / "stuck-d-state.yaml"
    scenario = load_scenario(str(path))
    assert scenario.policy is not None
    source, text = scenario.policy
    dry = dataclasses.replace(
        scenario, policy=(source, text.replace("dry_run: false", "dry_run: true"))
    )
    r = simulate(dry)
    hooks = r.entries(EventName.HOOK_RUN)
    assert hooks
    assert all(h.fields["outcome"] == "dry_run" and h.fields["dry_run"] for h in hooks)
    assert all("would run" in h.text for h in hooks)
    assert r.final["hooks_run"] == 0
    assert "hooks run: 0" in render_text(r)
    assert all(outcome == "dry_run" for _, _, _, outcome in r.signals())


def test_leak_before_watch() -> None:
    """Default policy: the likely heir is reported (lost leader named), nobody is signalled."""
    r = run("leak-before-watch")
    assert r.signals() == []
    new = {(e.fields["kind"], e.fields["pid"]): e for e in r.entries(EventName.FINDING_NEW)}
    heir = new[("hidden_holder", 4121)].fields
    assert heir["evidence"]["likely_heir"] is True  # type: ignore[index]
    assert heir["evidence"]["lost_leader"] == 4100  # type: ignore[index]
    assert "orphans_without_history" in str(heir["reason"])
    notebook = new[("hidden_holder", 5200)].fields
    assert "likely_heir" not in notebook["evidence"]  # type: ignore[operator]


def test_leak_before_watch_opt_in() -> None:
    """With the key, the heir is orphaned (tie lost_leader) and freed; the notebook is not."""
    r = run("leak-before-watch-opt-in")
    assert signals_to(r, "loader") == [(30.0, "SIGTERM")]
    assert signals_to(r, "notebook") == []
    orphan = [e for e in r.entries(EventName.FINDING_NEW) if e.fields["kind"] == "orphaned"]
    assert [e.fields["evidence"]["tie"] for e in orphan] == ["lost_leader"]  # type: ignore[index]
    assert r.final["gpus"][0]["allocated"] == r.final["gpus"][0]["idle"]  # type: ignore[index]


def test_epilog_ended_job() -> None:
    """The scheduler's word makes the ended job's leftover abandoned; the other job is untouched."""
    r = run("epilog-ended-job")
    assert signals_to(r, "helper") == [(10.0, "SIGTERM")]
    assert signals_to(r, "other-trainer") == []
    (found,) = r.entries(EventName.FINDING_NEW)
    assert (found.fields["kind"], found.fields["evidence"]["job"]) == (  # type: ignore[index]
        "abandoned",
        "slurm:4242",
    )


def test_spawn_worker_dead_owner() -> None:
    """kcmp: the fork worker is the heir and is freed; the spawn worker is never signalled."""
    r = run("spawn-worker-dead-owner")
    assert signals_to(r, "fork-worker") == [(50.0, "SIGTERM")]
    assert signals_to(r, "spawn-worker") == []
    spawn = [e for e in r.entries(EventName.FINDING_NEW) if e.fields["pid"] == 8120]
    assert [e.fields["kind"] for e in spawn] == ["hidden_holder"]
    assert spawn[0].fields["evidence"]["own_files"] is True  # type: ignore[index]
    assert r.final["gpus"][0]["allocated"] == r.final["gpus"][0]["idle"]  # type: ignore[index]


def test_torchrun_rank_crash_shared_session() -> None:
    """Only the dead rank's worker is signalled (kcmp proof); without the proof, nobody is."""
    r = run("torchrun-rank-crash-shared-session")
    assert {name for _, name, _, _ in r.signals()} == {"rank-0-loader"}
    assert signals_to(r, "rank-0-loader") == [(50.0, "SIGTERM")]
    orphan = [e for e in r.entries(EventName.FINDING_NEW) if e.fields["kind"] == "orphaned"]
    assert [e.fields["evidence"]["tie"] for e in orphan] == ["inherited_files"]  # type: ignore[index]
    assert r.final["gpus"][0]["allocated"] == r.final["gpus"][0]["idle"]  # type: ignore[index]
    scenario = r.scenario
    unknown = dataclasses.replace(
        scenario,
        processes=tuple(dataclasses.replace(p, files=None) for p in scenario.processes),
    )
    assert simulate(unknown).signals() == []


def test_persistenced_one_gpu() -> None:
    """persistenced holding only nvidiactl does not block the reset of a one-GPU node."""
    r = run("persistenced-one-gpu")
    assert [(t, result) for t, _, result in r.resets()] == [(150.0, "success")]
    assert r.signals() == []
    assert r.final["open_findings"] == []


# --- GPU health (docs/findings.md#gpu-health) -------------------------------------------------


def hook_names(result: SimulationResult) -> list[tuple[float, object]]:
    return [(e.t, e.fields.get("hook")) for e in result.entries(EventName.HOOK_RUN)]


def assert_reset_once_after_its_drain(r: SimulationResult, *, at: float) -> None:
    """One successful reset at ``at``, after the reset_drain hook; nothing signalled, nothing
    left open."""
    assert [(t, result) for t, _, result in r.resets()] == [(at, "success")]
    assert hook_names(r) == [(at, "reset_drain")]
    assert r.signals() == []
    assert r.final["open_findings"] == []


def test_xid_95_reset() -> None:
    r = run("xid-95-reset")
    assert [e.fields["kind"] for e in r.entries(EventName.FINDING_NEW)] == ["reset_required"]
    assert_reset_once_after_its_drain(r, at=30.0)


def test_xid_79_reboot() -> None:
    r = run("xid-79-reboot")
    assert r.resets() == []
    assert r.signals() == []
    assert [e.t for e in r.entries(EventName.GPU_NEEDS_REBOOT)] == [20.0]
    assert hook_names(r) == [(20.0, "on_failure"), (20.0, "reset_drain")]
    assert r.final["open_findings"] == [
        "reboot_required:GPU-00000001-0000-4000-8000-000000000001:gpu"
    ]


def test_xid_154_drain_and_reset() -> None:
    r = run("xid-154-drain-and-reset")
    assert signals_to(r, "job") == []
    (started,) = r.entries(EventName.HEALTH_DRAIN_STARTED)
    assert started.t == 60.0
    assert hook_names(r) == [(60.0, "reset_drain")]
    assert [(t, result) for t, _, result in r.resets()] == [(300.0, "success")]
    assert r.final["open_findings"] == []


def test_pending_row_remap_unisolated() -> None:
    r = run("pending-row-remap-unisolated")
    assert signals_to(r, "job") == []
    waiting = r.entries(EventName.HEALTH_DRAIN_WAITING)
    assert waiting
    assert "no device isolation" in str(waiting[0].fields["blockers"])
    assert [(t, result) for t, _, result in r.resets()] == [(1200.0, "success")]
    assert hook_names(r) == [(0.0, "reset_drain")]
    assert r.final["open_findings"] == []


def test_pending_row_remap_with_device_isolation_resets_at_once() -> None:
    scenario = load_scenario(str(SCENARIOS / "pending-row-remap-unisolated.yaml"))
    policy_file, text = scenario.policy or ("", "")
    isolated = dataclasses.replace(
        scenario,
        policy=(policy_file, text.replace("device_isolation: false", "device_isolation: true")),
    )
    r = simulate(isolated)
    assert [(t, result) for t, _, result in r.resets()] == [(0.0, "success")]
    assert signals_to(r, "job") == []


def test_xid_13_application() -> None:
    r = run("xid-13-application")
    assert r.entries(EventName.FINDING_NEW) == []
    assert r.entries(EventName.HOOK_RUN) == []
    assert r.resets() == []
    assert r.signals() == []


def test_xid_48_solo_idle() -> None:
    r = run("xid-48-solo-idle")
    (new,) = r.entries(EventName.FINDING_NEW)
    assert new.fields["kind"] == "reset_required"
    assert "solo: NVIDIA: reset the GPU" in str(new.fields["reason"])
    assert new.fields["evidence"]["recovery_action_support"] == "not_supported"  # type: ignore[index]
    assert_reset_once_after_its_drain(r, at=30.0)


def test_xid_94_two_jobs() -> None:
    r = run("xid-94-two-jobs")
    assert [e.t for e in r.entries("world.xid")] == [60.0]
    assert r.entries(EventName.FINDING_NEW) == []
    assert r.entries(EventName.HOOK_RUN) == []
    assert r.resets() == []
    assert r.signals() == []
    statuses = {p["name"]: p["status"] for p in r.final["processes"]}  # type: ignore[attr-defined]
    assert statuses == {"train": "alive", "serve": "alive"}


def test_xid_94_two_jobs_with_the_stricter_peer_choice_drains_only() -> None:
    scenario = load_scenario(str(SCENARIOS / "xid-94-two-jobs.yaml"))
    policy_file, text = scenario.policy or ("", "")
    strict = dataclasses.replace(
        scenario, policy=(policy_file, text + "  health: {xid_94: drain}\n")
    )
    r = simulate(strict)
    assert [e.fields["kind"] for e in r.entries(EventName.FINDING_NEW)] == ["drain_required"]
    assert hook_names(r) == [(60.0, "reset_drain")]
    assert r.resets() == []
    assert r.signals() == []


def test_drain_p2p_settles_to_reset() -> None:
    r = run("drain-p2p-settles-to-reset")
    kinds = [(e.t, e.fields["kind"]) for e in r.entries(EventName.FINDING_NEW)]
    assert kinds == [(60.0, "drain_required"), (240.0, "reset_required")]
    assert "read the field again" in str(r.entries(EventName.FINDING_NEW)[0].fields["reason"])
    assert signals_to(r, "job") == []
    assert [(t, result) for t, _, result in r.resets()] == [(240.0, "success")]
    assert r.final["open_findings"] == []
    # One incident, one drain: the reset that follows finds the node drained already.
    assert hook_names(r) == [(60.0, "reset_drain")]


def test_fabric_stuck_after_reset() -> None:
    r = run("fabric-stuck-after-reset")
    steps = [(e.t, e.fields["status"]) for e in r.entries(EventName.RESET_STEP)
             if str(e.fields["status"]).startswith("fabric")]  # fmt: skip
    assert steps == [(30.0, "fabric_waiting"), (150.0, "fabric_stuck")]
    ((t, _, result),) = r.resets()
    assert (t, result) == (150.0, "failed")
    (outcome,) = r.entries(EventName.RESET_OUTCOME)
    assert "Fabric Manager" in str(outcome.fields["reason"])
    assert "never restarts it" in str(outcome.fields["reason"])
    # The after hook (the undrain) ran only once the wait was over, and learned the failure.
    after = [e for e in r.entries(EventName.RESET_STEP) if e.fields["step"] == "after_hooks"]
    assert [e.t for e in after] == [150.0]
    assert hook_names(r) == [(30.0, "reset_drain"), (150.0, "on_failure")]
    assert r.entries(EventName.RESET_LIMIT_REACHED)  # one reset a day: never a second attempt
    assert r.final["open_findings"] == [
        "reset_required:GPU-00000000-0000-4000-8000-000000000000:gpu"
    ]


def test_fabric_that_settles_lets_the_reset_succeed_after_the_wait() -> None:
    scenario = load_scenario(str(SCENARIOS / "fabric-stuck-after-reset.yaml"))
    gpu0 = scenario.gpus[0]
    settles = dataclasses.replace(gpu0.health, fabric_after_reset=20.0)
    healthy = dataclasses.replace(
        scenario, gpus=(dataclasses.replace(gpu0, health=settles), *scenario.gpus[1:])
    )
    r = simulate(healthy)
    steps = [(e.t, e.fields["status"]) for e in r.entries(EventName.RESET_STEP)
             if str(e.fields["status"]).startswith("fabric")]  # fmt: skip
    assert steps == [(30.0, "fabric_waiting"), (50.0, "fabric_completed")]
    assert [(t, result) for t, _, result in r.resets()] == [(50.0, "success")]
    assert r.final["open_findings"] == []


def test_recovery_action_unknown() -> None:
    r = run("recovery-action-unknown")
    (new,) = r.entries(EventName.FINDING_NEW)
    assert new.fields["kind"] == "drain_required"
    assert new.fields["actionable"] is False
    assert "unknown (9)" in str(new.fields["reason"])
    (said,) = r.entries(EventName.ACTION_REFUSED)
    assert said.level == "warning"
    assert r.entries(EventName.HOOK_RUN) == []
    assert r.resets() == []
    assert r.final["open_findings"] == [
        "drain_required:GPU-00000000-0000-4000-8000-000000000000:gpu"
    ]


def test_mig_notebook_kernel_died() -> None:
    r = run("mig-notebook-kernel-died")
    assert signals_to(r, "loader-alice") == [(50.0, "SIGTERM")]
    assert {name for _, name, _, _ in r.signals()} == {"loader-alice"}
    orphans = [e for e in r.entries(EventName.FINDING_NEW) if e.fields.get("kind") == "orphaned"]
    assert [e.fields.get("gpu") for e in orphans] == ["MIG-00000000-0001-4000-8000-000000000001"]
    assert r.final["open_findings"] == []
    assert r.resets() == []


def test_mig_leak_beside_live_job() -> None:
    r = run("mig-leak-beside-live-job")
    assert signals_to(r, "loader-carol-0") == [(60.0, "SIGTERM")]
    assert signals_to(r, "loader-carol-1") == [(60.0, "SIGTERM"), (90.0, "SIGKILL")]
    assert {name for _, name, _, _ in r.signals()} == {"loader-carol-0", "loader-carol-1"}
    assert r.resets() == []
    parent_only = [e for e in r.entries(EventName.FINDING_NEW) if e.fields.get("pid") == 5190]
    assert [(e.fields.get("kind"), e.fields.get("actionable")) for e in parent_only] == [
        ("hidden_holder", False)
    ]


def test_mig_ghost_instance_recovery() -> None:
    r = run("mig-ghost-instance-recovery")
    gpu = "GPU-00000000-0000-4000-8000-000000000000"
    assert r.resets() == [(120.0, gpu, "success")]  # after confirm_for, once
    (outcome,) = r.entries(EventName.RESET_OUTCOME)
    assert outcome.fields["instance"] == "MIG-00000000-0001-4000-8000-000000000001"
    assert outcome.fields["gi"] == 1
    steps = [e.fields for e in r.entries(EventName.RESET_STEP) if e.fields["step"] == "reset"]
    commands = [f["argv"] for f in steps if "argv" in f]
    assert [f["status"] for f in steps if "argv" not in f] == ["as_planned", "as_planned"]
    assert [c[4:] for c in commands] == [  # type: ignore[index]
        ["-gi", "1", "-ci", "0", "-dci"],
        ["-gi", "1", "-dgi"],
        ["-cgi", "19:1", "-C"],
    ]
    assert not [c for c in commands if "--gpu-reset" in c]  # type: ignore[operator]
    assert r.signals() == []
    assert r.final["open_findings"] == []
    memory = {g["index"]: g for g in r.final["gpus"]}  # type: ignore[attr-defined]
    assert memory[0]["allocated"] < 21 * 1024**3  # the 6 GiB are gone; erin's 20 GiB stay


def test_mig_ghost_instance_is_only_reported_without_mig_recovery(tmp_path: Path) -> None:
    """The same scenario under a policy without ``reset.mig_recovery``: no command runs."""
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text("dry_run: false\nreset:\n  enabled: true\n  confirm_for: 2m\n")
    scenario = load_scenario(str(SCENARIOS / "mig-ghost-instance-recovery.yaml"))
    r = simulate(scenario, str(config))
    assert r.resets() == []
    refused = [e.fields["why"] for e in r.entries(EventName.RESET_REFUSED)]
    assert refused == [
        "a MIG instance of GPU 0: no GPU reset of an instance (reset.mig_recovery is off)"
    ]


def test_spared_orphan_debugging() -> None:
    r = run("spared-orphan-debugging")
    assert signals_to(r, "worker") == [(130.0, "SIGTERM")]  # not before its spare ends
    assert [e.t for e in r.entries(EventName.SPARE_STARTED)] == [10.0]
    assert [(e.t, e.fields.get("why")) for e in r.entries(EventName.SPARE_ENDED)] == [
        (130.0, "its time was up")
    ]
    assert r.final["open_findings"] == []


def test_mig_gpu_reset_layout() -> None:
    """Issue 37: GPU_RESET on a MIG GPU: drained and waited on while instance 2 is in use
    (never signalled), reset once when idle, each GPU instance created again at its GI profile
    and placement, and the finding resolved."""
    r = run("mig-gpu-reset-layout")
    gpu = "GPU-00000000-0000-4000-8000-000000000000"
    assert r.resets() == [(300.0, gpu, "success")]
    assert r.signals() == []
    checks = [
        e.fields for e in r.entries(EventName.RESET_STEP) if e.fields["step"] == "health_check"
    ]
    created = [f["argv"][4:] for f in checks if "-cgi" in f.get("argv", [])]  # type: ignore[index,operator]
    assert created == [["-cgi", "19:1", "-C"], ["-cgi", "9:2", "-C"]]
    (due,) = r.entries(EventName.RESET_DUE)
    assert due.fields["mig_layout"] == [
        "MIG GPU instance 1 of GPU 0 (GI profile 19, placement 1:1)",
        "MIG GPU instance 2 of GPU 0 (GI profile 9, placement 2:1)",
    ]
    assert r.final["open_findings"] == []


def test_mig_gpu_reset_layout_is_only_reported_without_allow_mig(tmp_path: Path) -> None:
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text("dry_run: false\nreset:\n  enabled: true\n")
    r = simulate(load_scenario(str(SCENARIOS / "mig-gpu-reset-layout.yaml")), str(config))
    assert r.resets() == []
    assert r.signals() == []


def test_every_timeline_name_is_a_daemon_event_or_a_timeline_event_written_as_its_value() -> None:
    """The simulator's own names (world.*, sim.*) are one enum beside EventName; the JSON
    carries the plain name, as docs/simulate.md says."""
    from gpuwatchd.core.vocabulary import EventName, TimelineEvent

    r = run("mig-notebook-kernel-died")
    names = {e.name for e in r.timeline}
    assert all(isinstance(n, EventName | TimelineEvent) for n in names), names
    assert TimelineEvent.EXIT in names
    printed = json.loads(json.dumps(r.to_json()))
    events = {entry["event"] for entry in printed["timeline"]}
    assert "world.exit" in events
    assert f"{TimelineEvent.XID}" == str(TimelineEvent.XID) == "world.xid"
