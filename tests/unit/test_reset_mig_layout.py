"""The reset of a whole MIG GPU, against the fake ``nvidia-smi``: its layout recorded before
the reset, each GPU instance created again after it (the re-create command of
``reset.mig_recovery_commands``), then checked; a crash between the reset and the restore
goes on with the restore; a layout that cannot be restored is ``failed`` and names the
commands left. No real ``nvidia-smi`` runs: every command is tests/support/fakesmi.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpuwatchd.act.reset import perform_reset
from gpuwatchd.act.reset_resume import resume_interrupted
from gpuwatchd.act.reset_target import ResetTarget, progress_record
from gpuwatchd.core.model import GpuInfo
from gpuwatchd.core.vocabulary import ResetStep
from gpuwatchd.decide.mig.recovery import InstanceRecovery
from gpuwatchd.decide.policy import ResetPolicy
from tests.support.fakesmi import FakeSmi
from tests.support.resetrig import (
    FakeEnvironment,
    layout_gpu,
    make_policy,
    mig_recovery_commands,
    resume_fails_untouched,
    smi_commands,
)

UUID = "GPU-12345678-1234-1234-1234-123456789abc"
BUS = "00000000:1A:00.0"


def instance(gi: int, profile: int, placement: int, size: int) -> InstanceRecovery:
    return InstanceRecovery(
        uuid=UUID, pci_bus_id=BUS, gpu_index=0, gi=gi, ci=0,
        mig_uuid=f"MIG-12345678-1234-1234-1234-{gi:012x}", profile=profile,
        placement=placement, size=size,
    )  # fmt: skip


LAYOUT = (instance(2, 9, 0, 4), instance(1, 19, 6, 1))
TARGET = ResetTarget(UUID, BUS, 0, persistence_was_on=None, layout=LAYOUT)
RESET = ["--gpu-reset", "-i", UUID]
QUERY = ["-q", "-i", UUID]
CGI_A = ["mig", "-i", UUID, "-cgi", "9:0", "-C"]
CGI_B = ["mig", "-i", UUID, "-cgi", "19:6", "-C"]


@pytest.fixture
def smi(tmp_path: Path) -> FakeSmi:
    return FakeSmi(tmp_path / "bin")


def mig_policy(smi: FakeSmi) -> ResetPolicy:
    commands = mig_recovery_commands(smi)
    return make_policy(smi, allow_mig=True, mig_recovery_commands=commands)


def _resume_succeeds(smi: FakeSmi, record: dict[str, object], policy: ResetPolicy) -> None:
    """Resuming ``record`` succeeds; the GPU read after the reset has LAYOUT's first GPU
    instance and lacks the second."""
    env = FakeEnvironment(smi, rereads=[layout_gpu(LAYOUT, present={0})])
    outcome = resume_interrupted(record, policy, env)
    assert outcome is not None
    assert outcome.result == "success", outcome.reason


def test_the_layout_is_recorded_then_created_again_after_the_reset_and_checked(
    smi: FakeSmi,
) -> None:
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "success", outcome.reason
    assert smi_commands(smi) == [RESET, QUERY, CGI_A, CGI_B]
    assert env.calls == [
        "stop_nvml", "final_blockers", "reread", "reread", "instance", "instance"
    ]  # fmt: skip
    assert "its MIG layout is back (2 GPU instance(s))" in outcome.reason
    # Recorded before the reset: a restart knows what to create again.
    (at_reset,) = [r for r in env.records if r["step"] == "reset"]
    assert at_reset["mig_layout"] == [r.record() for r in LAYOUT]


def test_a_failing_create_is_failed_and_names_every_command_left(smi: FakeSmi) -> None:
    smi.set(mig={"cgi": "error255"})
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "failed"
    assert outcome.step is ResetStep.HEALTH_CHECK
    assert not outcome.needs_reboot
    assert smi_commands(smi) == [RESET, QUERY, CGI_A]  # none after the first failure
    left = f"{smi.path} mig -i {UUID} -cgi 9:0 -C; {smi.path} mig -i {UUID} -cgi 19:6 -C"
    assert f"commands left to run by hand: {left}" in outcome.reason
    _level, finished = env.finished()
    assert left in str(finished["reason"])
    (said,) = [e for e in env.step_events(ResetStep.HEALTH_CHECK) if "remaining" in e]
    assert said["remaining"] == [list(smi.argv(*CGI_A)), list(smi.argv(*CGI_B))]


def test_mig_mode_off_after_the_reset_is_failed_with_the_whole_layout_left(
    smi: FakeSmi,
) -> None:
    off = layout_gpu(LAYOUT, present=set(), mig_enabled=False)
    env = FakeEnvironment(smi, rereads=[layout_gpu(LAYOUT, present={0, 1}), off])
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "failed"
    assert "MIG mode is not confirmed after the reset" in outcome.reason
    assert "-cgi 9:0 -C" in outcome.reason
    assert "-cgi 19:6 -C" in outcome.reason
    assert smi_commands(smi) == [RESET, QUERY]


@pytest.mark.parametrize(
    ("reading", "why"),
    [
        (layout_gpu(LAYOUT, present={1}), "1 of its 2 recorded GPU instance(s) are gone"),
        (
            layout_gpu((*LAYOUT, instance(3, 19, 5, 1)), present={0, 1, 2}),
            "it has 3 compute instance(s) where 2 were recorded",
        ),
        (layout_gpu(LAYOUT, present={0, 1}, mig_enabled=False), "GPU 0 is not in MIG mode"),
        (OSError("NVML is gone"), "reading the GPU again failed: NVML is gone"),
    ],
)
def test_a_layout_changed_since_the_plan_refuses_the_reset_before_it_runs(
    smi: FakeSmi, reading: GpuInfo | Exception, why: str
) -> None:
    """The GPU is read again right before its reset: an instance destroyed or created since the
    plan (an admin, a MIG manager) would be re-created or lost by the restore, so nothing runs."""
    env = FakeEnvironment(smi, rereads=[reading])
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert (outcome.result, outcome.step) == ("refused", ResetStep.FINAL_SCAN)
    assert f"the MIG layout changed since the plan: {why}" in outcome.reason
    assert smi_commands(smi) == []  # no reset, no create
    assert ["hook", "after"] in smi.calls()  # undone
    (said,) = [e for e in env.step_events(ResetStep.FINAL_SCAN) if e["status"] == "changed"]
    assert why in str(said["detail"])
    assert all(r["reset_started"] is False for r in env.records)


@pytest.mark.parametrize(
    ("reading", "why"),
    [
        (layout_gpu(LAYOUT, present={0, 1}), "MIG mode is on now"),
        (layout_gpu(LAYOUT, present=set()), "MIG mode is on now"),
        (layout_gpu(LAYOUT, present=set(), mig_enabled=None), "MIG mode is unknown now"),
        (None, "the GPU is not in the fresh NVML reading"),
        (OSError("NVML is gone"), "reading the GPU again failed: NVML is gone"),
    ],
)
def test_a_gpu_out_of_mig_mode_at_the_plan_is_read_again_before_its_reset(
    smi: FakeSmi, reading: GpuInfo | Exception | None, why: str
) -> None:
    """A GPU planned out of MIG mode (no layout recorded) and in MIG mode at its reset (turned
    on since, by an admin or a MIG manager) had its GPU instances taken down, none recorded to
    create again, without ``allow_mig``'s gates: the reset is refused, nothing run."""
    env = FakeEnvironment(smi, rereads=[reading])
    plain = dataclasses.replace(TARGET, layout=())
    outcome = perform_reset(plain, make_policy(smi), env, dry_run=False)
    assert (outcome.result, outcome.step) == ("refused", ResetStep.FINAL_SCAN)
    assert why in outcome.reason
    assert smi_commands(smi) == []  # no reset
    assert ["hook", "after"] in smi.calls()  # undone
    (said,) = [e for e in env.step_events(ResetStep.FINAL_SCAN) if e["status"] == "changed"]
    assert why in str(said["detail"])
    assert all(r["reset_started"] is False for r in env.records)


def test_an_instance_not_back_after_its_create_is_failed(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi, instance="GPU instance 1 is back but still uses 4096 bytes")
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "failed"
    assert "still uses 4096 bytes" in outcome.reason


def test_a_crash_between_the_reset_and_the_restore_goes_on_with_the_restore(
    smi: FakeSmi,
) -> None:
    """The state file said: reset command ran (success), health check next. On restart the
    reset command is never run again; the GPU is read, and only the instance it lacks (one
    created before the crash is there) is created."""
    record = progress_record(
        TARGET, ResetStep.HEALTH_CHECK,
        {"persistence_off": False, "units_stopped": [], "reset_started": True,
         "result": "success"},
    )  # fmt: skip
    _resume_succeeds(smi, record, mig_policy(smi))
    assert smi_commands(smi) == [QUERY, CGI_B]


def test_a_reload_before_the_resume_does_not_change_the_commands_restoring_the_layout(
    smi: FakeSmi,
) -> None:
    """Issue 36: a crash right after the reset command; the policy reloaded since says another
    re-create command. The resume creates the layout with the commands recorded before the
    reset (only the instance the GPU lacks)."""
    env = FakeEnvironment(smi)
    assert perform_reset(TARGET, mig_policy(smi), env, dry_run=False).result == "success"
    record = next(r for r in env.records if r["step"] == "reset")
    smi.clear()
    reloaded = dataclasses.replace(
        mig_policy(smi),
        mig_recovery_commands=(smi.argv("mig", "-i", "{uuid}", "-cgi", "{profile}"),),
        health_command=smi.argv("-q", "-d", "MEMORY", "-i", "{uuid}"),
    )
    _resume_succeeds(smi, record, reloaded)
    assert smi_commands(smi) == [QUERY, CGI_B]


def test_a_resume_record_with_a_damaged_layout_changes_nothing(smi: FakeSmi) -> None:
    record = progress_record(
        TARGET, ResetStep.HEALTH_CHECK, {"reset_started": True, "result": "success"}
    )
    record["mig_layout"] = [LAYOUT[0].record(), {"gi": "one"}]
    resume_fails_untouched(smi, record, mig_policy(smi), "unreadable reset record")


def test_a_dry_run_says_the_creates_it_would_run(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=True)
    assert outcome.result == "dry_run"
    assert smi.calls() == []
    would = [e["argv"] for e in env.step_events(ResetStep.HEALTH_CHECK) if "argv" in e]
    assert would[-2:] == [list(smi.argv(*CGI_A)), list(smi.argv(*CGI_B))]


def test_persistence_mode_is_back_on_before_the_instances_are_created(smi: FakeSmi) -> None:
    """A GPU the driver deinitialises (no client, persistence mode off) loses its instances:
    the creates run with persistence mode on again, and the record says health_check after
    it, so a crash from there on resumes the restore rather than finishing without it."""
    target = ResetTarget(UUID, BUS, 0, persistence_was_on=True, layout=LAYOUT)
    env = FakeEnvironment(smi)
    outcome = perform_reset(target, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "success", outcome.reason
    on = ["-pm", "1", "-i", UUID]
    assert smi_commands(smi) == [["-pm", "0", "-i", UUID], RESET, QUERY, on, CGI_A, CGI_B]
    steps = [(r["step"], r["persistence_off"]) for r in env.records]
    after = steps[steps.index(("persistence_on", True)) + 1 :]
    assert after[0] == ("health_check", False)
    assert ("persistence_on", True) not in after  # not turned on twice


def test_a_crash_while_persistence_mode_was_turned_back_on_still_restores_the_layout(
    smi: FakeSmi,
) -> None:
    record = progress_record(
        dataclasses.replace(TARGET, persistence_was_on=True), ResetStep.PERSISTENCE_ON,
        {"persistence_off": True, "units_stopped": [], "reset_started": True,
         "result": "success"},
    )  # fmt: skip
    _resume_succeeds(smi, record, mig_policy(smi))
    assert smi_commands(smi) == [QUERY, ["-pm", "1", "-i", UUID], CGI_B]
