"""The reset procedure re-creating one MIG GPU instance, against the fake ``nvidia-smi``.

The same procedure as a GPU reset (drain, stop NVML, before hooks, final scan, the commands,
health check, after hooks), with the instance's commands (destroy its compute instance, then
the GPU instance, then create it again at the same placement) in place of ``--gpu-reset``,
persistence mode left alone, and the instance (not the GPU's memory) checked after. No real
``nvidia-smi`` runs: every command is tests/support/fakesmi.py's script.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatchd.act.reset import ResetStep, ResetTarget, perform_reset
from gpuwatchd.act.reset_resume import resume_interrupted
from gpuwatchd.decide.mig_recovery import InstanceRecovery
from gpuwatchd.decide.policy import ResetPolicy
from tests.support.fakesmi import FakeSmi
from tests.support.resetrig import FakeEnvironment, make_policy, smi_commands

UUID = "GPU-12345678-1234-1234-1234-123456789abc"
MIG_UUID = "MIG-12345678-1234-1234-1234-123456789abd"
BUS = "00000000:1A:00.0"
RECOVERY = InstanceRecovery(
    uuid=UUID, pci_bus_id=BUS, gpu_index=0, gi=1, ci=0, mig_uuid=MIG_UUID, profile=19,
    placement=6, size=1,
)  # fmt: skip
TARGET = ResetTarget(UUID, BUS, 0, persistence_was_on=None, recovery=RECOVERY)
DCI = ["mig", "-i", UUID, "-gi", "1", "-ci", "0", "-dci"]
DGI = ["mig", "-i", UUID, "-gi", "1", "-dgi"]
CGI = ["mig", "-i", UUID, "-cgi", "19:6", "-C"]
QUERY = ["-q", "-i", UUID]


@pytest.fixture
def smi(tmp_path: Path) -> FakeSmi:
    return FakeSmi(tmp_path / "bin")


def mig_policy(smi: FakeSmi, **changes: object) -> ResetPolicy:
    commands = tuple(
        smi.argv(*argv[1:])
        for argv in (
            ("nvidia-smi", "mig", "-i", "{uuid}", "-gi", "{gi}", "-ci", "{ci}", "-dci"),
            ("nvidia-smi", "mig", "-i", "{uuid}", "-gi", "{gi}", "-dgi"),
            ("nvidia-smi", "mig", "-i", "{uuid}", "-cgi", "{profile}:{placement}", "-C"),
        )
    )
    return make_policy(smi, mig_recovery=True, mig_recovery_commands=commands, **changes)


def test_a_clear_instance_is_recreated_in_order_and_checked_and_the_gpu_is_never_reset(
    smi: FakeSmi,
) -> None:
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "success", outcome.reason
    assert smi_commands(smi) == [DCI, DGI, CGI, QUERY]
    assert not [c for c in smi.calls() if "--gpu-reset" in c or "-pm" in c]
    assert env.calls == ["stop_nvml", "final_blockers", "instance"]
    assert "re-create MIG GPU instance 1 of GPU 0 (GI profile 19, placement 6:1)" in outcome.reason
    (skipped,) = env.step_events(ResetStep.PERSISTENCE_OFF)
    assert "leaves persistence mode as it is" in str(skipped["detail"])
    assert env.records[0]["recovery"] == RECOVERY.record()


def test_a_holder_found_by_the_final_scan_stops_it_before_any_command(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi, blockers=["GPU instance 1: PID 800 holding its capability files"])
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "refused"
    assert smi_commands(smi) == []
    assert [c[:2] for c in smi.calls()] == [
        ["hook", "drain"],
        ["hook", "before"],
        ["hook", "after"],
    ]


def test_the_driver_refusing_the_first_command_as_in_use_changes_nothing(smi: FakeSmi) -> None:
    smi.set(mig={"dci": "in_use"})
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "in_use"
    assert "MIG GPU instance 1 of GPU 0" in outcome.reason
    assert smi_commands(smi) == [DCI]  # nothing after it, no health check
    assert env.calls == ["stop_nvml", "final_blockers"]


@pytest.mark.parametrize("failing", ["dgi", "cgi"])
def test_a_later_command_failing_is_a_failure_that_says_the_instance_is_half_done(
    smi: FakeSmi, failing: str
) -> None:
    smi.set(mig={failing: "in_use"})
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "failed"
    assert "is half done" in outcome.reason
    assert "re-create the instance by hand" in outcome.reason
    ran = [DCI, DGI] if failing == "dgi" else [DCI, DGI, CGI]
    assert smi_commands(smi) == ran


def test_an_instance_not_back_after_the_commands_is_a_failure(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi, instance="GPU instance 1 is back but still uses 4294967296 bytes")
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "failed"
    assert "still uses 4294967296 bytes" in outcome.reason
    assert not outcome.needs_reboot


def test_a_dry_run_runs_nothing_and_says_each_command_it_would_run(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=True)
    assert outcome.result == "dry_run"
    assert smi.calls() == []
    would = [e["argv"] for e in env.step_events(ResetStep.RESET)]
    assert [list(a)[1:] for a in would] == [DCI, DGI, CGI]  # type: ignore[call-overload]
    assert "would re-create MIG GPU instance 1 of GPU 0" in outcome.reason


def test_a_command_that_does_not_name_the_gpu_is_refused_before_anything_runs(
    smi: FakeSmi,
) -> None:
    policy = make_policy(
        smi, mig_recovery=True, mig_recovery_commands=(smi.argv("mig", "-gi", "{gi}", "-dgi"),)
    )
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, policy, env, dry_run=False)
    assert outcome.result == "refused"
    assert "reset.mig_recovery_commands" in outcome.reason
    assert smi.calls() == []


def test_a_recovery_interrupted_after_its_commands_started_is_checked_never_rerun(
    smi: FakeSmi,
) -> None:
    env = FakeEnvironment(smi, instance="no GPU instance with GI profile 19 at placement 6")
    record = {
        "uuid": UUID, "pci_bus_id": BUS, "minor": 0, "persistence_was_on": None,
        "step": "reset", "persistence_off": False, "reset_started": True, "result": None,
        "recovery": RECOVERY.record(),
    }  # fmt: skip
    outcome = resume_interrupted(record, mig_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "failed"
    assert "no GPU instance with GI profile 19 at placement 6" in outcome.reason
    assert smi_commands(smi) == [QUERY]  # the health check only: no mig command again
    assert env.calls == ["instance"]


def test_a_resume_record_with_a_damaged_recovery_changes_nothing(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi)
    record = {"uuid": UUID, "step": "reset", "reset_started": True,
              "recovery": {**RECOVERY.record(), "gi": "1; rm -rf /"}}  # fmt: skip
    outcome = resume_interrupted(record, mig_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "failed"
    assert "unreadable reset record" in outcome.reason
    assert smi.calls() == []
