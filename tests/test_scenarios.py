"""The incident library: each example scenario's timeline has the facts its header promises."""

from __future__ import annotations

import pathlib

import pytest

from gpuwatchd.scenario import load_scenario
from gpuwatchd.simulate import SimulationResult, simulate

SCENARIOS = pathlib.Path(__file__).resolve().parent.parent / "examples" / "scenarios"


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
    assert not [e for e in r.entries("finding.new") if e.t < 120.0]


def test_zombie_child_keeps_memory() -> None:
    r = run("zombie-child-keeps-memory")
    assert signals_to(r, "trainer") == []
    assert signals_to(r, "helper") == [(40.0, "SIGTERM")]
    reaps = r.entries("zombie.needs_reap")
    assert reaps
    assert reaps[0].fields["parent"] == 5100
    assert r.final["open_findings"] == []


def test_stuck_d_state() -> None:
    r = run("stuck-d-state")
    assert signals_to(r, "worker-stuck") == []
    assert [e.t for e in r.entries("target.stuck")] == [15.0]
    hooks = r.entries("hook.run")
    assert len(hooks) == 1
    assert hooks[0].fields["argv"][0] == "scontrol"  # type: ignore[index]
    assert signals_to(r, "worker-ok") == [(40.0, "SIGTERM")]
    assert r.resets() == []


def test_nohup_job() -> None:
    r = run("nohup-job")
    assert r.signals() == []
    assert r.entries("finding.new") == []
    assert r.scenario.duration == 3600.0


def test_container_no_hostpid() -> None:
    r = run("container-no-hostpid")
    assert r.signals() == []
    assert r.resets() == []
    new = r.entries("finding.new")
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
    outcome = r.entries("reset.outcome")[0]
    assert "nv-hostengine" in str(outcome.fields["blockers"])


def test_reset_blocked_hidden_holder() -> None:
    r = run("reset-blocked-hidden-holder")
    refused = [e for e in r.entries("reset.refused") if "live holder" in str(e.fields["why"])]
    assert not refused or refused[0].t >= 360.0
    assert [(t, result) for t, _, result in r.resets()] == [(480.0, "success")]
    assert r.signals() == []


def test_reset_fails_drain() -> None:
    r = run("reset-fails-drain")
    assert [result for _, _, result in r.resets()] == ["failed"]
    hooks = r.entries("hook.run")
    assert len(hooks) == 1
    assert "state=drain" in hooks[0].fields["argv"]  # type: ignore[operator]
    assert r.entries("reset.limit_reached")


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.yaml")), ids=lambda p: p.stem)
def test_example_scenario_has_a_comment_header_and_description(path: pathlib.Path) -> None:
    text = path.read_text()
    assert text.startswith("# ")
    assert load_scenario(str(path)).description
