"""The reset procedure re-creating one MIG GPU instance, against the fake ``nvidia-smi``.

The same procedure as a GPU reset (drain, stop NVML, before hooks, final scan, the commands,
health check, after hooks), with the instance's commands (destroy its compute instance, then
the GPU instance, then create it again at the same placement) in place of ``--gpu-reset``,
persistence mode left alone, and the instance (not the GPU's memory) checked after. No real
``nvidia-smi`` runs: every command is tests/support/fakesmi.py's script.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpuwatchd.act.reset import perform_reset
from gpuwatchd.act.reset_resume import resume_interrupted
from gpuwatchd.act.reset_target import ResetTarget
from gpuwatchd.core.model import GpuInfo
from gpuwatchd.core.vocabulary import ResetStep
from gpuwatchd.decide.mig.recovery import InstanceRecovery
from gpuwatchd.decide.policy import Hook, ResetPolicy
from tests.support.fakesmi import FakeSmi
from tests.support.resetrig import (
    FakeEnvironment,
    instance_gpu,
    make_policy,
    mig_recovery_commands,
    resume_fails_untouched,
    smi_commands,
)

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
    commands = mig_recovery_commands(smi)
    return make_policy(smi, mig_recovery=True, mig_recovery_commands=commands, **changes)


def test_a_clear_instance_is_recreated_in_order_and_checked_and_the_gpu_is_never_reset(
    smi: FakeSmi,
) -> None:
    """Its compute instance destroyed, then the GPU instance, created again at its placement,
    then checked; persistence mode is left as it is."""
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "success", outcome.reason
    assert smi_commands(smi) == [DCI, DGI, CGI, QUERY]
    assert not [c for c in smi.calls() if "--gpu-reset" in c or "-pm" in c]
    assert env.calls == ["stop_nvml", "final_blockers", "reread", "reread", "instance"]
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
    assert env.calls == ["stop_nvml", "final_blockers", "reread"]


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


def test_a_recovery_record_from_before_commands_were_counted_re_creates_into_a_free_placement(
    smi: FakeSmi,
) -> None:
    """A state file written when a recovery was one recorded step (no ``commands_done``): the
    instance is gone and nothing occupies its placement, so only the re-create runs (safe to
    run again), then the check."""
    env = FakeEnvironment(smi, rereads=[instance_gpu(RECOVERY, present=False)],
                          instance="no GPU instance with GI profile 19 at placement 6")  # fmt: skip
    record = {
        "uuid": UUID, "pci_bus_id": BUS, "minor": 0, "persistence_was_on": None,
        "step": "reset", "persistence_off": False, "reset_started": True, "result": None,
        "recovery": RECOVERY.record(),
    }  # fmt: skip
    outcome = resume_interrupted(record, mig_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "failed"
    assert "no GPU instance with GI profile 19 at placement 6" in outcome.reason
    assert smi_commands(smi) == [CGI, QUERY]  # never a destroy again
    assert env.calls == ["reread", "reread", "instance"]


def test_a_resume_record_with_a_damaged_recovery_changes_nothing(smi: FakeSmi) -> None:
    record = {"uuid": UUID, "step": "reset", "reset_started": True,
              "recovery": {**RECOVERY.record(), "gi": "1; rm -rf /"}}  # fmt: skip
    resume_fails_untouched(smi, record, mig_policy(smi), "unreadable reset record")


# --- recorded command by command, read again, resumed (issue 34, findings 5 and 6) ------------
# A crash is the state file as the procedure left it: the progress record written right before
# the command that never completed (``commands_done``), taken from a real run against the fake
# ``nvidia-smi``; the next start resumes from it with the fresh reading (``reread_gpu``) each
# test sets.

FREE = instance_gpu(RECOVERY, present=False)
OTHER_UUID = "MIG-12345678-1234-1234-1234-1234567890ff"


def crashed_before(command: int, smi: FakeSmi) -> dict[str, object]:
    """The state file's record when the daemon died right before the recovery's command
    ``command`` (0-based) completed: the last record a full run against ``smi`` wrote before
    running it (its calls then forgotten)."""
    env = FakeEnvironment(smi)
    assert perform_reset(TARGET, mig_policy(smi), env, dry_run=False).result == "success"
    smi.clear()
    records = [r for r in env.records if r["step"] == "reset" and r["commands_done"] == command]
    assert len(records) == 1, env.records
    return records[0]


def test_each_command_is_recorded_before_it_runs_with_the_commands_done(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi)
    perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    done = [r["commands_done"] for r in env.records if r["step"] == "reset"]
    assert done == [0, 1, 2]
    (health,) = [r for r in env.records if r["step"] == "health_check"]
    assert health["commands_done"] == 3


def test_a_crash_between_dgi_and_cgi_re_creates_the_instance_on_resume(smi: FakeSmi) -> None:
    """Finding 5: the GPU instance was destroyed, the daemon died before ``-cgi``. Resume
    re-creates it (its placement is free) and checks it; before, it reported ``failed`` and
    left the instance gone."""
    record = crashed_before(2, smi)
    env = FakeEnvironment(smi, rereads=[FREE])
    outcome = resume_interrupted(record, mig_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "success", outcome.reason
    assert smi_commands(smi) == [CGI, QUERY]
    assert "went on at command 3" in outcome.reason


def test_a_crash_between_dgi_and_cgi_in_another_boot_re_creates_nothing(smi: FakeSmi) -> None:
    """The reboot took every MIG instance down: the last boot's half-done recovery is not
    finished (no ``-cgi``, no health check), only its after hooks run."""
    record = {**crashed_before(2, smi), "rebooted": True}  # as the start marks it
    env = FakeEnvironment(smi, rereads=[FREE])
    outcome = resume_interrupted(record, mig_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "failed"
    assert smi_commands(smi) == []
    assert "reread_gpu" not in env.calls
    assert "the node rebooted since" in outcome.reason


def test_a_reload_between_the_crash_and_the_resume_changes_none_of_its_commands(
    smi: FakeSmi,
) -> None:
    """Issue 36: the resume runs the re-create, the health check and the after hooks the
    recovery recorded when it started, not those the reloaded policy would build."""
    record = crashed_before(2, smi)
    reloaded = replace(
        mig_policy(smi),
        mig_recovery_commands=(
            smi.argv("mig", "-i", "{uuid}", "-gi", "{gi}", "-dgi"),
            smi.argv("mig", "-i", "{uuid}", "-cgi", "{profile}", "-C"),
        ),
        health_command=smi.argv("-q", "-d", "MEMORY", "-i", "{uuid}"),
        after=(Hook(smi.hook("reloaded-after"), timeout=5),),
    )
    env = FakeEnvironment(smi, rereads=[FREE])
    outcome = resume_interrupted(record, reloaded, env)
    assert outcome is not None
    assert outcome.result == "success", outcome.reason
    assert smi.calls() == [CGI, QUERY, ["hook", "after"]]
    assert "went on at command 3" in outcome.reason


def test_every_hook_says_which_instance_in_a_fresh_run_and_in_a_resumed_one(
    smi: FakeSmi, tmp_path: Path
) -> None:
    """docs/reset.md: the drain, before and after hooks of a recovery get the instance's MIG
    UUID and GI id, so a hook can tell it from a reset of the whole GPU. A resume read the
    instance back from its record, but its after hooks got neither."""
    fresh = FakeSmi(tmp_path / "fresh")
    perform_reset(TARGET, mig_policy(fresh), FakeEnvironment(fresh), dry_run=False)
    record = crashed_before(2, smi)
    resume_interrupted(record, mig_policy(smi), FakeEnvironment(smi, rereads=[FREE]))
    hooks = [e for e in fresh.entries() + smi.entries() if e["argv"][:1] == ["hook"]]
    assert [h["argv"][1] for h in hooks] == ["drain", "before", "after", "after"]
    for hook in hooks:
        assert hook["env"]["GPUWATCHD_MIG_INSTANCE"] == MIG_UUID
        assert hook["env"]["GPUWATCHD_MIG_GI"] == "1"


def test_a_crash_during_dgi_runs_it_again_then_re_creates(smi: FakeSmi) -> None:
    record = crashed_before(1, smi)
    smi.set(mig={"dgi": "exit:6"})  # it took effect before the crash: nothing to destroy now
    env = FakeEnvironment(smi, rereads=[FREE])
    outcome = resume_interrupted(record, mig_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "success", outcome.reason
    assert smi_commands(smi) == [DGI, CGI, QUERY]
    assert "resumed: " in outcome.reason
    assert "-dgi failed" in outcome.reason


def test_the_re_create_is_never_run_into_an_occupied_placement(smi: FakeSmi) -> None:
    """Someone created another instance where the destroyed one was: nothing is run, the
    recovery is half done, for an administrator."""
    record = crashed_before(2, smi)
    theirs = instance_gpu(RECOVERY, gi=3, uuid=OTHER_UUID, gi_profile_id=14, placement=(4, 4))
    env = FakeEnvironment(smi, rereads=[theirs])
    outcome = resume_interrupted(record, mig_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "failed"
    assert "is half done" in outcome.reason
    assert "occupies placement 4:4" in outcome.reason
    assert smi_commands(smi) == []


def test_an_instance_re_created_already_is_only_checked(smi: FakeSmi) -> None:
    """The re-create ran and the daemon died before recording it: the instance is back under a
    new MIG UUID at its placement; no command runs again."""
    record = crashed_before(2, smi)
    env = FakeEnvironment(smi, rereads=[instance_gpu(RECOVERY, uuid=OTHER_UUID)])
    outcome = resume_interrupted(record, mig_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "success", outcome.reason
    assert smi_commands(smi) == [QUERY]


def test_a_crash_before_any_command_took_effect_is_undone(smi: FakeSmi) -> None:
    record = crashed_before(0, smi)
    env = FakeEnvironment(smi, rereads=[instance_gpu(RECOVERY)])
    outcome = resume_interrupted(record, mig_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "refused"
    assert smi_commands(smi) == []
    assert [c[:2] for c in smi.calls()] == [["hook", "after"]]


@pytest.mark.parametrize("damaged", [-1, 7])
def test_a_recorded_count_out_of_range_is_read_as_not_counted(smi: FakeSmi, damaged: int) -> None:
    """A count no run writes (negative, or past the 3 commands) is no count: as a record from
    before they were counted, never ``ran: ...`` naming commands that did not run."""
    record = {**crashed_before(0, smi), "commands_done": damaged}
    env = FakeEnvironment(smi, rereads=[instance_gpu(RECOVERY)])
    outcome = resume_interrupted(record, mig_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "refused"
    assert "(an unknown number of 3 done)" in outcome.reason
    assert smi_commands(smi) == []


def test_the_gi_id_now_naming_another_instance_is_never_destroyed_on_resume(smi: FakeSmi) -> None:
    record = crashed_before(1, smi)
    reused = instance_gpu(RECOVERY, uuid=OTHER_UUID, placement=(0, 1))
    env = FakeEnvironment(smi, rereads=[reused])
    outcome = resume_interrupted(record, mig_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "failed"
    assert "GPU instance 1 is still listed" in outcome.reason
    assert smi_commands(smi) == []


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        (instance_gpu(RECOVERY, uuid=OTHER_UUID), f"MIG UUID {OTHER_UUID} (planned {MIG_UUID})"),
        (instance_gpu(RECOVERY, gi_profile_id=9), "GI profile 9 (planned 19)"),
        (instance_gpu(RECOVERY, placement=(4, 2)), "placement (4, 2) (planned (6, 1))"),
        (FREE, "GPU instance 1 is no longer listed"),
        (None, "GPU 0 is not in the fresh NVML reading"),
    ],
)
def test_an_instance_changed_since_the_plan_is_refused_before_its_first_command(
    smi: FakeSmi, changed: GpuInfo | None, said: str
) -> None:
    """Finding 6: an administrator or a MIG manager re-created the instance between the plan
    and ``-dci`` (the ids are reused): nothing is destroyed, the recovery is refused."""
    env = FakeEnvironment(smi, rereads=[changed])
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "refused"
    assert said in outcome.reason
    assert smi_commands(smi) == []
    (blocked,) = [e for e in env.step_events(ResetStep.RESET) if e["status"] == "changed"]
    assert said in str(blocked["detail"])


def test_the_destroys_are_confirmed_before_the_re_create(smi: FakeSmi) -> None:
    """After ``-dgi`` the GPU is listed again: the instance still there, nothing is created."""
    env = FakeEnvironment(smi, rereads=[instance_gpu(RECOVERY)])
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "failed"
    assert "the destroy commands did not free its placement" in outcome.reason
    assert "is half done" in outcome.reason
    assert smi_commands(smi) == [DCI, DGI]


def test_a_gpu_that_cannot_be_read_again_is_never_touched(smi: FakeSmi) -> None:
    """Unknown is not as planned: the NVML worker could not be stopped again after the
    reading (or the reading failed), so nothing is destroyed."""
    env = FakeEnvironment(smi, rereads=[OSError("our own NVML worker still holds the device")])
    outcome = perform_reset(TARGET, mig_policy(smi), env, dry_run=False)
    assert outcome.result == "refused"
    assert "reading the GPU again failed: our own NVML worker" in outcome.reason
    assert smi_commands(smi) == []
