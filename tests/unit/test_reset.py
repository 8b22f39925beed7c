"""The GPU reset procedure against a fake environment and a fake ``nvidia-smi`` script.

No real ``nvidia-smi`` ever runs: every command and hook is ``tests/support/fakesmi.py``'s
script, which logs its argv, so the tests assert exactly what would have been run, in order.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwatchd.act.commands import CommandResult
from gpuwatchd.act.reset import perform_reset
from gpuwatchd.act.reset_resume import resume_interrupted
from gpuwatchd.act.reset_target import ResetTarget, interpret_reset_exit
from gpuwatchd.act.signals import stat_start_ticks
from gpuwatchd.core.vocabulary import EventName, ResetStep
from gpuwatchd.decide.policy import Hook, ResetPolicy
from tests.support.fakesmi import FakeSmi
from tests.support.resetrig import (
    FakeEnvironment,
    make_policy,
    resume_fails_untouched,
    smi_commands,
)

UUID = "GPU-12345678-1234-1234-1234-123456789abc"
BUS = "00000000:1A:00.0"
TARGET = ResetTarget(uuid=UUID, pci_bus_id=BUS, minor=0, persistence_was_on=True)
S = ResetStep

DRAIN = ["hook", "drain"]
BEFORE = ["hook", "before"]
AFTER = ["hook", "after"]
PM_OFF = ["-pm", "0", "-i", UUID]
RESET = ["--gpu-reset", "-i", UUID]
QUERY = ["-q", "-i", UUID]
PM_ON = ["-pm", "1", "-i", UUID]

ALL_STEPS = [
    S.DRAIN,
    S.STOP_NVML,
    S.BEFORE_HOOKS,
    S.PERSISTENCE_OFF,
    S.FINAL_SCAN,
    S.RESET,
    S.HEALTH_CHECK,
    S.PERSISTENCE_ON,
    S.AFTER_HOOKS,
    S.DONE,
]


@pytest.fixture
def smi(tmp_path: Path) -> FakeSmi:
    return FakeSmi(tmp_path / "bin")


def is_dead(pid: int) -> bool:
    stat = stat_start_ticks("/proc", pid)
    return stat is None or stat[1] == "Z"


# --- the full procedure -----------------------------------------------------------------------


def test_a_clear_gpu_is_reset_with_every_step_in_the_design_order(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, make_policy(smi), env, dry_run=False)

    assert outcome.result == "success", outcome.reason
    assert outcome.step is S.DONE
    assert not outcome.needs_reboot
    assert outcome.blockers == ()
    assert outcome.command is not None
    assert outcome.command.returncode == 0
    assert env.steps == ALL_STEPS
    assert smi.calls() == [DRAIN, BEFORE, PM_OFF, RESET, QUERY, PM_ON, AFTER]
    assert env.calls == ["stop_nvml", "final_blockers", "reread", "memory"]
    # NVML is stopped after the drain and before anything else; the scan comes right before.
    assert env.commands_seen_at["stop_nvml"] == [DRAIN]
    assert env.commands_seen_at["final_blockers"] == [DRAIN, BEFORE, PM_OFF]
    assert [e["event"] for e in smi.entries() if e["argv"][0] == "hook"] == [
        "reset_drain",
        "reset_before",
        "reset_after",
    ]
    after_env = smi.entries()[-1]["env"]
    assert after_env["GPUWATCHD_GPU_UUID"] == UUID
    assert after_env["GPUWATCHD_GPU_PCI_BUS_ID"] == BUS
    assert after_env["GPUWATCHD_GPU_MINOR"] == "0"
    assert after_env["GPUWATCHD_RESULT"] == "success"
    level, fields = env.finished()
    assert level == "info"
    assert fields["result"] == "success"
    assert "successfully reset" in str(fields["reason"])
    assert env.records[-1]["step"] == "done"
    assert env.records[-1]["result"] == "success"


def test_each_step_is_recorded_before_it_runs(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi)
    perform_reset(TARGET, make_policy(smi), env, dry_run=False)
    by_step = {record["step"]: record for record in env.records}
    assert by_step["persistence_off"]["persistence_off"] is True
    assert by_step["final_scan"]["reset_started"] is False
    assert by_step["reset"]["reset_started"] is True
    assert by_step["reset"]["result"] is None, "recorded before the reset command ran"
    assert by_step["health_check"]["result"] == "success"
    assert by_step["after_hooks"]["persistence_off"] is False, "persistence was restored"
    assert by_step["drain"]["uuid"] == UUID
    assert by_step["drain"]["persistence_was_on"] is True


# --- refusals and undo ------------------------------------------------------------------------


def test_blockers_refuse_the_reset_and_undo_persistence_and_run_after_hooks(smi: FakeSmi) -> None:
    blockers = ["PID 4242 (python) holds /dev/nvidia0 (fd)", "PID 77 unreadable"]
    env = FakeEnvironment(smi, blockers=blockers)
    outcome = perform_reset(TARGET, make_policy(smi), env, dry_run=False)

    assert outcome.result == "refused"
    assert outcome.step is S.FINAL_SCAN
    assert outcome.blockers == tuple(blockers)
    assert outcome.command is None
    assert "PID 4242" in outcome.reason
    assert RESET not in smi.calls()
    assert smi.calls() == [DRAIN, BEFORE, PM_OFF, PM_ON, AFTER]
    assert env.steps == [*ALL_STEPS[:5], S.PERSISTENCE_ON, S.AFTER_HOOKS, S.DONE]
    assert smi.entries()[-1]["env"]["GPUWATCHD_RESULT"] == "refused"
    level, fields = env.finished()
    assert level == "warning"
    assert fields["blockers"] == blockers


def test_a_failing_holder_scan_blocks_the_reset(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi, scan_raises=True)
    outcome = perform_reset(TARGET, make_policy(smi), env, dry_run=False)
    assert outcome.result == "refused"
    assert "holder scan failed" in outcome.blockers[0]
    assert RESET not in smi.calls()


def test_nvml_still_held_refuses_before_any_command(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi, released=False)
    outcome = perform_reset(TARGET, make_policy(smi), env, dry_run=False)
    assert outcome.result == "refused"
    assert outcome.step is S.STOP_NVML
    assert "NVML" in outcome.reason
    assert smi_commands(smi) == [], "no nvidia-smi command may run while we hold the GPU"
    assert smi.calls() == [DRAIN, AFTER]
    assert "final_blockers" not in env.calls


@pytest.mark.parametrize(
    ("failing", "step", "expected_calls"),
    [
        ("drain", S.DRAIN, [DRAIN, AFTER]),
        ("before", S.BEFORE_HOOKS, [DRAIN, BEFORE, AFTER]),
    ],
)
def test_a_failing_drain_or_before_hook_aborts_with_undo(
    smi: FakeSmi, failing: str, step: ResetStep, expected_calls: list[list[str]]
) -> None:
    smi.set(hooks={failing: "exit:7"})
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, make_policy(smi), env, dry_run=False)
    assert outcome.result == "refused"
    assert outcome.step is step
    assert "exit 7" in outcome.reason
    assert smi.calls() == expected_calls
    assert "final_blockers" not in env.calls


def test_a_reset_after_a_health_drain_does_not_run_the_drain_hooks_again(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, make_policy(smi), env, dry_run=False, drained=True)
    assert outcome.result == "success", outcome.reason
    assert smi.calls() == [BEFORE, PM_OFF, RESET, QUERY, PM_ON, AFTER]
    assert env.steps == ALL_STEPS  # the drain step is still recorded (as skipped)


def test_a_failing_after_hook_is_reported_but_does_not_undo_a_success(smi: FakeSmi) -> None:
    smi.set(hooks={"after": "exit:3"})
    outcome = perform_reset(TARGET, make_policy(smi), FakeEnvironment(smi), dry_run=False)
    assert outcome.result == "success"
    assert "hook" in outcome.reason
    assert "exit 3" in outcome.reason


def test_persistence_off_failing_refuses_and_tries_to_restore_it(smi: FakeSmi) -> None:
    smi.set(persistence="exit:4")
    outcome = perform_reset(TARGET, make_policy(smi), FakeEnvironment(smi), dry_run=False)
    assert outcome.result == "refused"
    assert outcome.step is S.PERSISTENCE_OFF
    assert smi.calls() == [DRAIN, BEFORE, PM_OFF, PM_ON, AFTER]
    assert "persistence mode could not be turned back on" in outcome.reason


@pytest.mark.parametrize(
    ("was_on", "toggle", "why"),
    [
        (False, True, "persistence mode was off"),
        (None, True, "unknown"),
        (True, False, "toggle_persistence is off"),
    ],
)
def test_persistence_is_left_alone_unless_known_on_and_toggling(
    smi: FakeSmi, was_on: bool | None, toggle: bool, why: str
) -> None:
    env = FakeEnvironment(smi)
    target = replace(TARGET, persistence_was_on=was_on)
    outcome = perform_reset(target, make_policy(smi, toggle_persistence=toggle), env, dry_run=False)
    assert outcome.result == "success"
    assert smi.calls() == [DRAIN, BEFORE, RESET, QUERY, AFTER]
    assert S.PERSISTENCE_OFF not in env.steps
    assert S.PERSISTENCE_ON not in env.steps
    [skipped] = env.step_events(S.PERSISTENCE_OFF)
    assert why in str(skipped["detail"])


@pytest.mark.parametrize(
    ("command", "target", "message"),
    [
        (("true",), TARGET, "does not name GPU"),
        (("nvidia-smi", "--gpu-reset"), TARGET, "does not name GPU"),
        (("x", "--bus", "{pci_bus_id}"), replace(TARGET, pci_bus_id=None), "no value"),
        (("x", "{index}"), TARGET, "unknown placeholder"),
    ],
)
def test_a_reset_command_that_does_not_name_this_gpu_is_refused_before_anything_runs(
    smi: FakeSmi, command: tuple[str, ...], target: ResetTarget, message: str
) -> None:
    env = FakeEnvironment(smi)
    outcome = perform_reset(target, make_policy(smi, command=command), env, dry_run=False)
    assert outcome.result == "refused"
    assert message in outcome.reason
    assert smi.calls() == []
    assert env.steps == []
    assert env.calls == []


def test_a_state_file_that_cannot_be_written_stops_the_reset_before_it_starts(
    smi: FakeSmi,
) -> None:
    env = FakeEnvironment(smi, record_fails=True)
    outcome = perform_reset(TARGET, make_policy(smi), env, dry_run=False)
    assert outcome.result == "refused"
    assert "could not record" in outcome.reason
    assert smi.calls() == []
    assert env.calls == []


# --- the reset command's result ---------------------------------------------------------------


def test_in_use_by_another_client_is_a_hidden_holder_refused_not_failed(smi: FakeSmi) -> None:
    """nvidia-smi exit 255 "In use by another client" after a clear final scan: the driver's
    proof of a holder no scan saw. Refused (``in_use``), never ``failed``: nothing was reset,
    the reason names the gap, and everything is restored."""
    smi.set(reset="in_use")
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, make_policy(smi), env, dry_run=False)
    assert outcome.result == "in_use"
    assert "unix-socket message" in outcome.reason
    assert env.finished()[0] == "warning"
    assert outcome.step is S.RESET
    assert not outcome.needs_reboot
    assert "in use by another client" in outcome.reason
    assert f"GPU {BUS}: In use by another client" in outcome.reason, "raw output is kept"
    assert outcome.command is not None
    assert outcome.command.returncode == 255
    assert smi.calls() == [DRAIN, BEFORE, PM_OFF, RESET, PM_ON, AFTER], "no health check"
    assert "memory" not in env.calls
    assert smi.entries()[-1]["env"]["GPUWATCHD_RESULT"] == "in_use"


def test_a_gpu_that_fell_off_the_bus_needs_a_reboot(smi: FakeSmi) -> None:
    smi.set(reset="fell_off_bus")
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, make_policy(smi), env, dry_run=False)
    assert outcome.result == "failed"
    assert outcome.needs_reboot
    assert "fallen off the bus" in outcome.reason
    level, fields = env.finished()
    assert level == "critical"
    assert fields["needs_reboot"] is True


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        ("not_supported", "not supported"),
        ("no_permission", "no permission"),
        ("error255", "nvidia-smi reported an error"),
        ("exit:2", "invalid argument"),
        ("exit:42", "unexpected exit code"),
    ],
)
def test_other_reset_exit_codes_fail_with_their_meaning(
    smi: FakeSmi, behaviour: str, message: str
) -> None:
    smi.set(reset=behaviour)
    outcome = perform_reset(TARGET, make_policy(smi), FakeEnvironment(smi), dry_run=False)
    assert outcome.result == "failed"
    assert message in outcome.reason
    assert not outcome.needs_reboot


def test_a_hanging_reset_is_killed_with_its_group_at_the_timeout(smi: FakeSmi) -> None:
    smi.set(reset="hang")
    env = FakeEnvironment(smi)
    started = time.monotonic()
    outcome = perform_reset(TARGET, make_policy(smi, timeout=1.0), env, dry_run=False)
    elapsed = time.monotonic() - started
    assert outcome.result == "timeout"
    assert outcome.step is S.RESET
    assert outcome.command is not None
    assert outcome.command.timed_out
    assert 1.0 <= outcome.command.duration < 5.0
    assert elapsed < 10.0
    assert not outcome.needs_reboot, "the command could be killed"
    pids = smi.hang_pids()
    assert pids is not None
    deadline = time.monotonic() + 5
    while not all(is_dead(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(is_dead(pid) for pid in pids), "the reset command's whole group is killed"
    assert smi.calls()[-2:] == [PM_ON, AFTER], "persistence restored, after hooks run"


def test_an_unhealthy_gpu_after_the_reset_needs_a_reboot(smi: FakeSmi) -> None:
    smi.set(query="exit:1")
    outcome = perform_reset(TARGET, make_policy(smi), FakeEnvironment(smi), dry_run=False)
    assert outcome.result == "failed"
    assert outcome.step is S.HEALTH_CHECK
    assert outcome.needs_reboot
    assert "health check failed" in outcome.reason
    assert smi.calls()[-2:] == [PM_ON, AFTER]


@pytest.mark.parametrize(
    ("memory", "result", "message"),
    [
        (True, "success", "memory back to baseline"),
        (None, "success", "memory could not be verified"),
        (False, "failed", "not back to the baseline"),
    ],
)
def test_memory_after_the_reset_decides_between_success_and_failure(
    smi: FakeSmi, memory: bool | None, result: str, message: str
) -> None:
    env = FakeEnvironment(smi, memory=memory)
    outcome = perform_reset(TARGET, make_policy(smi), env, dry_run=False)
    assert outcome.result == result
    assert message in outcome.reason
    assert not outcome.needs_reboot


# --- dry-run ----------------------------------------------------------------------------------


def test_dry_run_runs_no_command_and_no_hook_and_records_nothing(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, make_policy(smi), env, dry_run=True)
    assert outcome.result == "dry_run"
    assert outcome.step is S.DONE
    assert outcome.command is None
    assert smi.calls() == []
    assert env.steps == []
    assert env.calls == ["final_blockers"], "only the read-only scan runs"
    [reset_event] = env.step_events(S.RESET)
    assert reset_event["status"] == "would_run"
    assert reset_event["argv"] == [str(smi.path), *RESET]
    assert reset_event["dry_run"] is True
    would = {
        f["step"]
        for e, _l, f in env.events
        if e == EventName.RESET_STEP and f["status"] == "would_run"
    }
    assert would == {
        "drain",
        "stop_nvml",
        "before_hooks",
        "persistence_off",
        "reset",
        "health_check",
        "persistence_on",
        "after_hooks",
    }


def test_dry_run_shows_that_a_real_reset_would_be_refused(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi, blockers=["PID 9 holds /dev/nvidia0"])
    outcome = perform_reset(TARGET, make_policy(smi), env, dry_run=True)
    assert outcome.result == "dry_run"
    assert outcome.step is S.FINAL_SCAN
    assert outcome.blockers == ("PID 9 holds /dev/nvidia0",)
    assert outcome.reason.startswith("would be refused")
    assert smi.calls() == []
    assert env.step_events(S.RESET) == []


# --- interpreting exits (pure) ----------------------------------------------------------------


def result_of(
    returncode: int | None,
    output: str = "",
    *,
    timed_out: bool = False,
    error: str | None = None,
) -> CommandResult:
    return CommandResult(("nvidia-smi",), returncode, output, timed_out, 1.0, error)


@pytest.mark.parametrize(
    ("command", "result", "needs_reboot", "message"),
    [
        (result_of(0, "GPU x was successfully reset."), "success", False, "successfully reset"),
        (result_of(255, "GPU x: In use by another client"), "in_use", False, "in use"),
        (
            result_of(255, "GPU x is currently in use by another process."),
            "in_use",
            False,
            "in use",
        ),
        (result_of(255, "Unknown Error"), "failed", False, "Unknown Error"),
        (result_of(15), "failed", True, "fallen off the bus"),
        (result_of(3), "failed", False, "not supported"),
        (result_of(4), "failed", False, "no permission"),
        (result_of(2), "failed", False, "invalid argument"),
        (result_of(-9), "failed", False, "signal 9"),
        (result_of(-9, timed_out=True), "timeout", False, "did not finish"),
        (result_of(None, timed_out=True, error="still running"), "timeout", True, "wedged"),
        (  # a script whose child is stuck in the driver: the script died, the tree did not
            replace(result_of(-9, timed_out=True, error="1 still running"), unkillable=1),
            "timeout",
            True,
            "1 still running: the GPU is probably wedged",
        ),
        (result_of(None, error="cannot run nvidia-smi: No such file"), "failed", False, "No such"),
    ],
)
def test_interpret_reset_exit(
    command: CommandResult, result: str, needs_reboot: bool, message: str
) -> None:
    assert interpret_reset_exit(command)[:2] == (result, needs_reboot)
    assert message in interpret_reset_exit(command)[2]


def test_a_long_output_is_bounded_in_the_reason() -> None:
    reason = interpret_reset_exit(result_of(255, "x" * 100_000 + " tail"))[2]
    assert len(reason) < 2200
    assert reason.endswith("tail'")


# --- resuming after a crash -------------------------------------------------------------------


def records_of(smi: FakeSmi, **env_options: object) -> dict[str, dict[str, object]]:
    """The record kept before each step of a real run, by step name; the fake's log cleared."""
    env = FakeEnvironment(smi, **env_options)  # type: ignore[arg-type]
    perform_reset(TARGET, make_policy(smi), env, dry_run=False)
    smi.clear()
    return {str(record["step"]): record for record in env.records}


def reloaded_policy(smi: FakeSmi) -> ResetPolicy:
    """The policy after a reload: every command and hook written differently."""
    return make_policy(
        smi,
        command=smi.argv("--gpu-reset", "--id={uuid}"),
        persistence_command=smi.argv("--persistence-mode={mode}", "-i", "{uuid}"),
        health_command=smi.argv("-q", "-d", "MEMORY", "-i", "{uuid}"),
        after=(Hook(smi.hook("reloaded-after"), timeout=5),),
    )


@pytest.mark.parametrize("reloaded", [False, True], ids=["same_policy", "reloaded_policy"])
@pytest.mark.parametrize(
    ("step", "result", "expected_calls"),
    [
        ("drain", "refused", [AFTER]),
        ("stop_nvml", "refused", [AFTER]),
        ("before_hooks", "refused", [AFTER]),
        ("persistence_off", "refused", [PM_ON, AFTER]),
        ("final_scan", "refused", [PM_ON, AFTER]),
        ("reset", "success", [QUERY, PM_ON, AFTER]),
        ("health_check", "success", [QUERY, PM_ON, AFTER]),
        ("persistence_on", "success", [PM_ON, AFTER]),
        ("after_hooks", "success", [AFTER]),
    ],
)
def test_resume_finishes_or_undoes_from_each_step_and_never_resets_again(
    smi: FakeSmi, step: str, result: str, expected_calls: list[list[str]], reloaded: bool
) -> None:
    """The resume runs the commands and hooks the reset recorded when it started: a reload
    between the crash and the resume (the policy at resume written differently) changes
    none of them (issue 36)."""
    record = records_of(smi)[step]
    env = FakeEnvironment(smi)
    policy = reloaded_policy(smi) if reloaded else make_policy(smi)
    outcome = resume_interrupted(record, policy, env)
    assert outcome is not None
    assert outcome.result == result, outcome.reason
    assert smi.calls() == expected_calls
    assert RESET not in smi.calls()
    assert "interrupted" in outcome.reason
    assert env.records[-1]["step"] == "done"
    assert "stop_nvml" not in env.calls
    assert "final_blockers" not in env.calls


@pytest.mark.parametrize(
    ("step", "expected_calls"),
    [("persistence_on", [PM_ON, AFTER]), ("after_hooks", [AFTER])],
)
def test_resume_finishes_an_undo_that_was_interrupted(
    smi: FakeSmi, step: str, expected_calls: list[list[str]]
) -> None:
    record = records_of(smi, blockers=["PID 5 holds /dev/nvidia0"])[step]
    outcome = resume_interrupted(record, make_policy(smi), FakeEnvironment(smi))
    assert outcome is not None
    assert outcome.result == "refused"
    assert smi.calls() == expected_calls


@pytest.mark.parametrize(
    ("step", "result"),
    [
        ("drain", "refused"),
        ("persistence_off", "refused"),
        ("final_scan", "refused"),
        ("reset", "failed"),  # not checked: never a success
        ("health_check", "failed"),
        ("persistence_on", "success"),  # the recorded result
        ("after_hooks", "success"),
    ],
)
def test_a_record_of_another_boot_runs_no_gpu_command_only_the_after_hooks(
    smi: FakeSmi, step: str, result: str
) -> None:
    """The reboot reset the GPU and set its persistence mode afresh: a record the last boot
    left is undone outside the GPU only (no health check, no persistence mode), and says so."""
    record = {**records_of(smi)[step], "rebooted": True}  # as the start marks it
    env = FakeEnvironment(smi)
    outcome = resume_interrupted(record, make_policy(smi), env)
    assert outcome is not None
    assert outcome.result == result
    assert smi.calls() == [AFTER]
    assert "the node rebooted since: no GPU command was run" in outcome.reason
    assert env.records[-1]["step"] == "done"


def test_resume_after_the_reset_with_an_unhealthy_gpu_fails_and_needs_a_reboot(
    smi: FakeSmi,
) -> None:
    record = records_of(smi)["reset"]
    smi.set(query="exit:1")
    outcome = resume_interrupted(record, make_policy(smi), FakeEnvironment(smi))
    assert outcome is not None
    assert outcome.result == "failed"
    assert outcome.needs_reboot
    assert RESET not in smi.calls()


@pytest.mark.parametrize("step", ["persistence_on", "after_hooks"])
@pytest.mark.parametrize(("reset", "query"), [("fell_off_bus", "ok"), ("ok", "exit:1")])
def test_a_reset_that_needs_a_reboot_still_does_after_a_crash_during_its_undo(
    smi: FakeSmi, reset: str, query: str, step: str
) -> None:
    """The recorded result of a reset whose GPU needs a reboot (exit 15, unhealthy after it)
    keeps saying so: a crash while persistence mode or the after hooks ran does not turn it
    into a plain failure (no ``EventName.GPU_NEEDS_REBOOT``)."""
    smi.set(reset=reset, query=query)
    record = records_of(smi)[step]
    env = FakeEnvironment(smi)
    outcome = resume_interrupted(record, make_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "failed"
    assert outcome.needs_reboot
    assert env.finished()[0] == "critical"
    assert RESET not in smi.calls()
    another_boot = resume_interrupted({**record, "rebooted": True}, make_policy(smi), env)
    assert another_boot is not None
    assert not another_boot.needs_reboot, "the reboot happened since"


def test_resume_after_the_reset_with_unknown_memory_counts_as_failed(smi: FakeSmi) -> None:
    record = records_of(smi)["reset"]
    outcome = resume_interrupted(record, make_policy(smi), FakeEnvironment(smi, memory=None))
    assert outcome is not None
    assert outcome.result == "failed"
    assert not outcome.needs_reboot


def test_resume_of_a_finished_reset_does_nothing(smi: FakeSmi) -> None:
    record = records_of(smi)["done"]
    env = FakeEnvironment(smi)
    assert resume_interrupted(record, make_policy(smi), env) is None
    assert smi.calls() == []
    assert env.events == []


@pytest.mark.parametrize(
    "record",
    [
        {"step": "reset"},
        {"uuid": UUID, "step": "bogus"},
        {"uuid": 7, "step": "reset"},
        {},
    ],
)
def test_resume_of_an_unreadable_record_changes_nothing(
    smi: FakeSmi, record: dict[str, object]
) -> None:
    resume_fails_untouched(smi, record, make_policy(smi), "unreadable")


# --- an injected command runner ---------------------------------------------------------------


class RecordingRunner:
    """A :class:`gpuwatchd.act.reset.CommandRunner` that runs nothing: it records each call and
    answers from ``answers`` (by argv[1], e.g. ``--gpu-reset``), exit 0 otherwise."""

    def __init__(self, answers: Mapping[str, CommandResult] | None = None) -> None:
        self.answers = dict(answers or {})
        self.calls: list[tuple[tuple[str, ...], float, dict[str, str] | None]] = []

    def __call__(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        args = tuple(argv)
        self.calls.append((args, timeout, None if env is None else dict(env)))
        answer = self.answers.get(args[1] if len(args) > 1 else "")
        if answer is not None:
            return replace(answer, argv=args)
        return CommandResult(args, 0, "", False, 0.0, None)

    def argvs(self) -> list[list[str]]:
        return [list(argv) for argv, _timeout, _env in self.calls]


def symbolic_policy(**changes: object) -> ResetPolicy:
    """Commands and hooks that name no real program: only an injected runner ever sees them."""
    policy = ResetPolicy(
        command=("nvidia-smi", "--gpu-reset", "-i", "{uuid}"),
        persistence_command=("nvidia-smi", "-pm", "{mode}", "-i", "{uuid}"),
        health_command=("nvidia-smi", "-q", "-i", "{uuid}"),
        drain=(Hook(("drain-hook", "{pci_bus_id}"), timeout=7),),
        before=(Hook(("before-hook",), timeout=8),),
        after=(Hook(("after-hook", "{minor}"), timeout=9),),
        timeout=30.0,
    )
    return replace(policy, **changes)  # type: ignore[arg-type]


def test_an_injected_runner_runs_every_command_and_hook_in_order_and_nothing_else_runs(
    smi: FakeSmi,
) -> None:
    runner = RecordingRunner()
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, symbolic_policy(), env, dry_run=False, runner=runner)

    assert outcome.result == "success", outcome.reason
    assert runner.argvs() == [
        ["drain-hook", BUS],
        ["before-hook"],
        ["nvidia-smi", *PM_OFF],
        ["nvidia-smi", *RESET],
        ["nvidia-smi", *QUERY],
        ["nvidia-smi", *PM_ON],
        ["after-hook", "0"],
    ]
    assert [timeout for _argv, timeout, _env in runner.calls] == [7, 8, 30, 30, 30, 30, 9]
    hook_events = [e["GPUWATCHD_EVENT"] for _a, _t, e in runner.calls if e is not None]
    assert hook_events == ["reset_drain", "reset_before", "reset_after"]
    assert [e for argv, _t, e in runner.calls if argv[0] == "nvidia-smi"] == [None] * 4
    assert env.steps == ALL_STEPS
    assert smi.calls() == [], "no process was started"


def test_an_injected_runners_results_are_read_like_real_ones(smi: FakeSmi) -> None:
    in_use = CommandResult((), 255, "GPU x: In use by another client", False, 0.1, None)
    runner = RecordingRunner({"--gpu-reset": in_use})
    outcome = perform_reset(
        TARGET, symbolic_policy(), FakeEnvironment(smi), dry_run=False, runner=runner
    )
    assert outcome.result == "in_use"
    assert "in use by another client" in outcome.reason
    assert runner.argvs()[-2:] == [["nvidia-smi", *PM_ON], ["after-hook", "0"]]

    hung = CommandResult((), -9, "", True, 30.0, None)
    runner = RecordingRunner({"--gpu-reset": hung})
    outcome = perform_reset(
        TARGET, symbolic_policy(), FakeEnvironment(smi), dry_run=False, runner=runner
    )
    assert outcome.result == "timeout"
    assert ["nvidia-smi", *QUERY] not in runner.argvs(), "no health check after a timeout"


def test_a_hook_whose_placeholder_cannot_be_filled_never_reaches_the_runner(
    smi: FakeSmi,
) -> None:
    runner = RecordingRunner()
    target = replace(TARGET, minor=None)
    policy = symbolic_policy(before=(Hook(("before-hook", "{minor}"), timeout=8),))
    outcome = perform_reset(target, policy, FakeEnvironment(smi), dry_run=False, runner=runner)
    assert outcome.result == "refused"
    assert outcome.step is S.BEFORE_HOOKS
    assert "hook not run" in outcome.reason
    assert ["before-hook", "{minor}"] not in runner.argvs()
    assert runner.argvs()[0] == ["drain-hook", BUS]


def test_a_failing_hook_from_the_runner_aborts_like_a_real_one(smi: FakeSmi) -> None:
    failed = CommandResult((), 1, "scheduler down", False, 0.1, None)
    runner = RecordingRunner({"x": failed})
    policy = symbolic_policy(drain=(Hook(("drain-hook", "x"), timeout=7),))
    outcome = perform_reset(TARGET, policy, FakeEnvironment(smi), dry_run=False, runner=runner)
    assert outcome.result == "refused"
    assert outcome.step is S.DRAIN
    assert "scheduler down" in outcome.reason
    assert runner.argvs() == [["drain-hook", "x"], ["after-hook", "0"]]


def test_an_old_record_without_commands_resumes_with_todays_through_the_injected_runner(
    smi: FakeSmi,
) -> None:
    """A record written before the commands were recorded: they are built from the policy
    of the new start, as that version did."""
    record = records_of(smi)["reset"]
    del record["commands"]
    runner = RecordingRunner()
    outcome = resume_interrupted(record, symbolic_policy(), FakeEnvironment(smi), runner=runner)
    assert outcome is not None
    assert outcome.result == "success", outcome.reason
    assert runner.argvs() == [["nvidia-smi", *QUERY], ["nvidia-smi", *PM_ON], ["after-hook", "0"]]
    assert smi.calls() == []


# --- NVSwitch systems: the NVLink fabric after the reset -------------------------------------


class FabricWaiter:
    """Answers the procedure's fabric wait; records when it was asked (after which commands)."""

    def __init__(self, smi: FakeSmi, answer: tuple[bool, str]) -> None:
        self.smi = smi
        self.answer = answer
        self.asked: list[tuple[str, float, list[list[str]]]] = []

    def __call__(self, target: ResetTarget, timeout: float) -> tuple[bool, str]:
        self.asked.append((target.uuid, timeout, self.smi.calls()))
        return self.answer


FABRIC_TARGET = replace(TARGET, fabric=True)


def test_on_an_nvswitch_system_the_after_hooks_wait_for_the_fabric(smi: FakeSmi) -> None:
    env = FakeEnvironment(smi)
    waiter = FabricWaiter(smi, (True, "fabric registration COMPLETED"))
    policy = make_policy(smi, fabric_timeout=45.0)
    outcome = perform_reset(FABRIC_TARGET, policy, env, dry_run=False, fabric_wait=waiter)
    assert outcome.result == "success"
    ((uuid, timeout, before),) = waiter.asked
    assert (uuid, timeout) == (UUID, 45.0)
    # Asked after the reset and its health query, before persistence on and the after hooks.
    assert before[-2:] == [RESET, QUERY]
    assert smi.calls()[-2:] == [PM_ON, AFTER]
    statuses = [f["status"] for f in env.step_events(S.HEALTH_CHECK)]
    assert statuses[-2:] == ["fabric_waiting", "fabric_completed"]
    assert "fabric registration COMPLETED" in outcome.reason


@pytest.mark.parametrize(
    "waiter_answer",
    [(False, "fabric registration IN_PROGRESS after 45s"), None],
    ids=["stuck", "no-way-to-read-it"],
)
def test_a_fabric_that_does_not_complete_fails_the_reset_and_never_restarts_fabric_manager(
    smi: FakeSmi, waiter_answer: tuple[bool, str] | None
) -> None:
    env = FakeEnvironment(smi)
    waiter = None if waiter_answer is None else FabricWaiter(smi, waiter_answer)
    outcome = perform_reset(FABRIC_TARGET, make_policy(smi), env, dry_run=False, fabric_wait=waiter)
    assert outcome.result == "failed"
    assert not outcome.needs_reboot
    assert "Fabric Manager must register the GPU; gpuwatchd never restarts it" in outcome.reason
    # The after hooks still run (they learn result=failed); nothing touched Fabric Manager.
    assert smi.calls()[-1] == AFTER
    assert not any("fabric" in " ".join(call).lower() for call in smi.calls())
    stuck = [f for f in env.step_events(S.HEALTH_CHECK) if f["status"] == "fabric_stuck"]
    assert len(stuck) == 1


@pytest.mark.parametrize(
    ("answer", "result"),
    [
        ((True, "fabric registration COMPLETED"), "success"),
        ((False, "fabric registration IN_PROGRESS after 45s"), "failed"),
    ],
)
def test_a_resumed_reset_of_an_nvswitch_gpu_waits_for_the_fabric(
    smi: FakeSmi, answer: tuple[bool, str], result: str
) -> None:
    """The record keeps that the GPU's reset waits for its NVLink fabric: one interrupted after
    its command ran succeeds only once the fabric registered, as one not interrupted does."""
    env = FakeEnvironment(smi)
    started = FabricWaiter(smi, (True, "fabric registration COMPLETED"))
    perform_reset(FABRIC_TARGET, make_policy(smi), env, dry_run=False, fabric_wait=started)
    record = {str(r["step"]): r for r in env.records}["reset"]
    assert record["fabric"] is True
    smi.clear()
    waiter = FabricWaiter(smi, answer)
    outcome = resume_interrupted(record, make_policy(smi), FakeEnvironment(smi), fabric_wait=waiter)
    assert outcome is not None
    assert (outcome.result, len(waiter.asked)) == (result, 1), outcome.reason
    assert answer[1] in outcome.reason


def test_a_gpu_without_a_fabric_and_a_dry_run_never_wait(smi: FakeSmi) -> None:
    waiter = FabricWaiter(smi, (False, "never asked"))
    plain = perform_reset(TARGET, make_policy(smi), FakeEnvironment(smi), dry_run=False,
                          fabric_wait=waiter)  # fmt: skip
    assert plain.result == "success"
    env = FakeEnvironment(smi)
    dry = perform_reset(FABRIC_TARGET, make_policy(smi), env, dry_run=True, fabric_wait=waiter)
    assert dry.result == "dry_run"
    assert waiter.asked == []
    statuses = [f["status"] for f in env.step_events(S.HEALTH_CHECK)]
    assert "would_wait_fabric" in statuses


def test_a_dry_runs_hooks_are_shown_filled_in(smi: FakeSmi) -> None:
    policy = make_policy(smi, after=(Hook(("/usr/local/sbin/undrain", "{pci_bus_id}", "{minor}")),))
    env = FakeEnvironment(smi)
    perform_reset(TARGET, policy, env, dry_run=True)
    (after,) = [f for f in env.step_events(S.AFTER_HOOKS) if f["status"] == "would_run"]
    assert after["hooks"] == [["/usr/local/sbin/undrain", BUS, "0"]]
    assert smi.calls() == []
