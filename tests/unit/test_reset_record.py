"""A reset's commands, worked out once: recorded with its progress, read back strictly on resume.

Every command and hook the procedure may run is filled in before its first step and kept in
each progress record (``commands``); a resume runs those, whatever the policy says by then
(tests/unit/test_reset.py and test_reset_mig*.py resume after a reload). The record is hostile
input: a damaged command list changes nothing and is ``failed``. No real ``nvidia-smi`` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpuwatchd.act.reset import perform_reset
from gpuwatchd.act.reset_resume import resume_interrupted
from gpuwatchd.act.reset_target import ResetTarget
from gpuwatchd.core.vocabulary import EventName, ResetStep
from gpuwatchd.decide.argv import MAX_ARGS as MAX_RECORDED_ARGS
from gpuwatchd.decide.argv import MAX_COMMANDS as MAX_RECORDED_COMMANDS
from gpuwatchd.decide.argv import MAX_FILLED_CHARS as MAX_RECORDED_CHARS
from gpuwatchd.decide.policy import Hook
from tests.support.fakesmi import FakeSmi
from tests.support.resetrig import FakeEnvironment, make_policy, resume_fails_untouched

UUID = "GPU-12345678-1234-1234-1234-123456789abc"
OTHER = "GPU-87654321-1234-1234-1234-123456789abc"
BUS = "00000000:1A:00.0"
TARGET = ResetTarget(uuid=UUID, pci_bus_id=BUS, minor=0, persistence_was_on=True)

Record = dict[str, object]
TOO_MANY_HOOKS = [{"argv": ["x"], "timeout": 1}] * (MAX_RECORDED_COMMANDS + 1)


@pytest.fixture
def smi(tmp_path: Path) -> FakeSmi:
    return FakeSmi(tmp_path / "bin")


def run_records(smi: FakeSmi) -> list[Record]:
    env = FakeEnvironment(smi)
    assert perform_reset(TARGET, make_policy(smi), env, dry_run=False).result == "success"
    smi.clear()
    return env.records


def test_every_record_holds_the_commands_filled_in_before_the_first_step(smi: FakeSmi) -> None:
    records = run_records(smi)
    hook = {"timeout": 10.0}
    assert records[0]["commands"] == {
        "reset": [list(smi.argv("--gpu-reset", "-i", UUID))],
        "health": list(smi.argv("-q", "-i", UUID)),
        "persistence_off": list(smi.argv("-pm", "0", "-i", UUID)),
        "persistence_on": list(smi.argv("-pm", "1", "-i", UUID)),
        "restore": [],
        "drain": [{"argv": list(smi.hook("drain")), **hook}],
        "before": [{"argv": list(smi.hook("before")), **hook}],
        "after": [{"argv": list(smi.hook("after")), **hook}],
    }
    assert all(r["commands"] == records[0]["commands"] for r in records)


def test_a_hook_that_could_not_be_filled_in_is_recorded_and_fails_again_on_resume(
    smi: FakeSmi,
) -> None:
    """Its placeholder had no value when the reset started: the resume does not fill it from
    what it knows then; the hook fails without running, as it would have."""
    policy = make_policy(smi, after=(Hook(smi.argv("hook", "after", "{pci_bus_id}"), 10),))
    target = ResetTarget(uuid=UUID, pci_bus_id=None, minor=0, persistence_was_on=False)
    env = FakeEnvironment(smi)
    perform_reset(target, policy, env, dry_run=False)
    (after,) = env.records[0]["commands"]["after"]  # type: ignore[index]
    assert after["error"] == "no value for {pci_bus_id} in '{pci_bus_id}'"
    record = next(r for r in env.records if r["step"] == "health_check")
    smi.clear()
    outcome = resume_interrupted(record, make_policy(smi), FakeEnvironment(smi))
    assert outcome is not None
    assert "hook not run: no value for {pci_bus_id}" in outcome.reason
    assert ["hook", "after"] not in smi.calls()


def _set(path: str, value: object) -> Callable[[Record], None]:
    """Damage the recorded commands: ``path`` (``after.0.timeout``) set to ``value``."""

    def damage(commands: Record) -> None:
        *parents, last = path.split(".")
        node: object = commands
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]  # type: ignore[index]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value  # type: ignore[index]

    return damage


def _drop(key: str) -> Callable[[Record], None]:
    def damage(commands: Record) -> None:
        del commands[key]

    return damage


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (_drop("after"), "not an object with the keys"),
        (_set("extra", []), "not an object with the keys"),
        (_set("health", "nvidia-smi -q -i " + UUID), "health: not a command"),
        (_set("health", []), "health: not a command"),
        (_set("persistence_on", None), "persistence_on: not a command"),
        (_set("health", ["", "-q", "-i", UUID]), "health: the program is empty"),
        (_set("health.1", 7), "health: an argument is not a string"),
        (_set("health.1", "-q\0"), "health: an argument is not a string"),
        (_set("health.1", "x" * (MAX_RECORDED_CHARS + 1)), "health: an argument"),
        (_set("health", ["x"] * (MAX_RECORDED_ARGS + 1)), "health: not a command of 1 to"),
        (_set("reset", "--gpu-reset"), "reset: not a list"),
        (_set("reset", [["nvidia-smi", "--gpu-reset", "-i", OTHER]]), "does not name GPU"),
        (_set("reset", []), "is empty; refusing"),
        (_set("restore", [["nvidia-smi", "mig", "-i", UUID, "-cgi", "9:0"]]), "layout"),
        (_set("after", TOO_MANY_HOOKS), "after: not a list of at most"),
        (_set("after.0", ["hook", "after"]), "after[0]: not an object with argv, timeout"),
        (_set("after.0.timeout", "10"), "after[0]: the timeout"),
        (_set("after.0.timeout", True), "after[0]: the timeout"),
        (_set("after.0.timeout", 0), "after[0]: the timeout"),
        (_set("after.0.timeout", float("nan")), "after[0]: the timeout"),
        (_set("after.0.timeout", 1e9), "after[0]: the timeout"),
        (_set("after.0.error", ""), "after[0]: the error"),
        (_set("after.0.argv", []), "after[0]: not a command"),
        (_set("after.0.shell", "rm -rf /"), "after[0]: not an object with argv, timeout"),
    ],
)
def test_a_damaged_recorded_command_list_changes_nothing_and_is_failed(
    smi: FakeSmi, damage: Callable[[Record], None], said: str
) -> None:
    record = next(r for r in run_records(smi) if r["step"] == "health_check")
    commands = record["commands"]
    assert isinstance(commands, dict)
    damage(commands)
    env = FakeEnvironment(smi)
    outcome = resume_interrupted(record, make_policy(smi), env)
    assert outcome is not None
    assert outcome.result == "failed"
    assert f"unreadable reset record of {UUID}: its recorded commands: " in outcome.reason
    assert said in outcome.reason
    assert smi.calls() == [], "nothing is run, not even the after hooks"
    assert [e for e, _l, _f in env.events] == [EventName.RESET_RESUME_FAILED]


@pytest.mark.parametrize(
    ("uuid", "bus", "reset", "why"),
    [
        ("i", None, ["mig", "-dgi"], "unreadable"),  # every GPU instance of every GPU
        ("reset", None, ["--gpu-reset"], "unreadable"),  # every GPU
        (UUID, "0", ["--gpu-reset", "-i", "0"], "does not name GPU"),  # GPU index 0
        (UUID[:13], None, ["--gpu-reset", "-i", UUID[:13]], "unreadable"),
    ],
    ids=["one-letter-uuid", "a-word", "an-index-for-bus-id", "a-uuid-prefix"],
)
def test_a_record_whose_gpu_names_are_not_a_gpus_never_names_its_gpu(
    smi: FakeSmi, uuid: str, bus: str | None, reset: list[str], why: str
) -> None:
    """The record's own UUID and bus id are hostile too: one not in NVML's format names no
    GPU, however the reset command contains it (a substring test let ``-dgi`` through for a
    UUID ``i``), and a record whose UUID is not one is unreadable."""
    record = next(r for r in run_records(smi) if r["step"] == "reset")
    commands = record["commands"]
    assert isinstance(commands, dict)
    commands["reset"] = [[smi.argv()[0], *reset]]  # the fake nvidia-smi: nothing real, ever
    record.update(uuid=uuid, pci_bus_id=bus)
    resume_fails_untouched(smi, record, make_policy(smi), why)


@pytest.mark.parametrize(
    "reset",
    [["--id=" + UUID], ["-i" + UUID], ["-i", BUS], ["--gpu=pci:" + BUS]],
    ids=["--id=", "-i-joined", "bus-id", "inside-an-argument"],
)
def test_a_gpu_name_in_its_format_is_found_in_any_spelling_check_config_accepts(
    smi: FakeSmi, reset: list[str]
) -> None:
    record = next(r for r in run_records(smi) if r["step"] == "reset")
    commands = record["commands"]
    assert isinstance(commands, dict)
    commands["reset"] = [[smi.argv()[0], "--gpu-reset", *reset]]
    outcome = resume_interrupted(record, make_policy(smi), FakeEnvironment(smi))
    assert outcome is not None
    assert "does not name GPU" not in outcome.reason
    assert outcome.result == "success", outcome.reason


@pytest.mark.parametrize("commands", [None, [], "x", {}])
def test_recorded_commands_that_are_not_an_object_are_damaged(
    smi: FakeSmi, commands: object
) -> None:
    record = next(r for r in run_records(smi) if r["step"] == "reset")
    record["commands"] = commands
    resume_fails_untouched(smi, record, make_policy(smi), "its recorded commands: not an object")


def test_commands_the_record_could_not_hold_refuse_the_reset_before_its_first_step(
    smi: FakeSmi,
) -> None:
    """What is recorded must read back: more hooks than a record holds are refused up front."""
    many = (Hook(smi.hook("after"), 10),) * (MAX_RECORDED_COMMANDS + 1)
    env = FakeEnvironment(smi)
    outcome = perform_reset(TARGET, make_policy(smi, after=many), env, dry_run=False)
    assert outcome.result == "refused"
    assert outcome.step is ResetStep.DRAIN
    assert "cannot record the commands: after: not a list of at most" in outcome.reason
    assert smi.calls() == []
    assert env.records == []
