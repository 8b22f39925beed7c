"""Rendering an ``explain`` report for a hand-built host at a given time."""

from __future__ import annotations

import pathlib

from gpuwatchd.cli.report import build_report
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.sim.simulation import Simulation, scenario_policy

SCENARIOS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "scenarios"


def report_at(name: str, t: float, first_seen: dict[str, float] | None = None) -> dict[str, object]:
    scenario = load_scenario(str(SCENARIOS / f"{name}.yaml"))
    policy, source = scenario_policy(scenario, None)
    sim = Simulation(scenario, policy, source)
    sim.advance(t)
    snap = sim.world.snapshot(t)
    a = assess(snap, AssessState(), policy.detection)
    return build_report(
        snap, a.findings, a.roles, a.report_only, a.state.baselines,
        first_seen=first_seen, version="test", notes=a.notes,
    )  # fmt: skip
