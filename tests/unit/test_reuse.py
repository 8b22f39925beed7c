"""The steady poll's reuse of the last assessment and verdict is exact (decide/assess/reuse.py).

Each test compares the reusing path with a plain ``assess`` + ``judge`` on the same inputs:
a reuse that changed any finding, role, state, stamp or verdict would show. Every example
scenario is also played twice through ``simulate`` — once as the daemon runs (reusing), once
computing every poll afresh — and the two timelines must be the same event for event.
"""

from __future__ import annotations

import dataclasses
import pathlib
from functools import partial

import pytest

from gpuwatchd.core.model import MIB, Snapshot
from gpuwatchd.core.vocabulary import Level
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.reuse import Reuse, same_but_time
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.policy import Detection, HealthPolicy, Policy
from gpuwatchd.decide.verdict import NodeVerdict, judge
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.sim.simulation import Simulation, scenario_policy
from tests.support.snapshots import HostBuilder

SCENARIOS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "scenarios"


def _leaky_host(at: float) -> HostBuilder:
    """A GPU with memory nobody live owns (an ``unaccounted_since`` stamp is new at first)
    beside a healthy trainer and its worker."""
    return (
        HostBuilder()
        .gpu(0, allocated=900 * MIB)
        .proc(100, comm="python", holds={0}, uvm=True)
        .proc(101, ppid=100, holds={0}, uvm=True)
        .nvml(0, 100, used=300 * MIB)
        .gpu(1, allocated=5000 * MIB)
        .at(at)
    )


def _polls(snapshots: list[Snapshot]) -> list[tuple[Assessment, Assessment, bool, bool]]:
    """Each snapshot through the reusing path and the plain one, state carried along as the
    engine carries it: (reused result, plain result, reused verdict == plain verdict, hit)."""
    reuse = Reuse()
    policy = Policy()
    reused_state = plain_state = AssessState()
    out = []
    for snapshot in snapshots:
        hits = reuse.hits
        reused = reuse.assess(snapshot, reused_state, Detection(), health_policy=HealthPolicy())
        plain = assess(snapshot, plain_state, Detection(), health_policy=HealthPolicy())
        verdict_reused: NodeVerdict = reuse.judge(snapshot, reused, policy)
        verdict_plain = judge(snapshot, plain, policy)
        out.append((reused, plain, verdict_reused == verdict_plain, reuse.hits > hits))
        reused_state, plain_state = reused.state, plain.state
    return out


def test_a_quiet_node_is_assessed_once_and_every_later_poll_equals_a_fresh_assessment() -> None:
    polls = _polls([_leaky_host(10.0 + 5 * i).build() for i in range(6)])
    for reused, plain, same_verdict, _ in polls:
        assert reused == plain
        assert same_verdict
    # The first poll stamps unaccounted memory (new state): the second is computed again,
    # returns the same state, and from then on nothing is new: reused.
    assert [hit for *_, hit in polls] == [False, False, True, True, True, True]
    assert polls[-1][0].state.unaccounted_since == polls[0][1].state.unaccounted_since


def test_any_change_besides_the_time_is_assessed_afresh() -> None:
    first = _leaky_host(10.0).build()
    again = _leaky_host(15.0).build()
    changed = [
        _leaky_host(20.0).change(101, ppid=1).build(),  # the worker re-parented: orphan
        _leaky_host(25.0).kill(100).build(),  # the owner died
        _leaky_host(30.0).gpu(1, allocated=100 * MIB).build(),  # memory came back
    ]
    polls = _polls([first, again, again, *changed, changed[-1]])
    for reused, plain, same_verdict, _ in polls:
        assert reused == plain
        assert same_verdict
    hits = [hit for *_, hit in polls]
    assert hits[2] is True
    assert hits[3:6] == [False, False, False]


def test_snapshots_differing_only_in_time_are_the_same_input() -> None:
    a = _leaky_host(10.0).build()
    b = dataclasses.replace(a, monotonic=99.0, wall_time=1e9)
    assert same_but_time(a, b)
    assert not same_but_time(a, dataclasses.replace(b, pid_max=a.pid_max + 1))


def _play(path: pathlib.Path, *, fresh: bool) -> tuple[list[tuple[str, Level, str]], int]:
    scenario = load_scenario(str(path))
    policy, source = scenario_policy(scenario, None)
    sim = Simulation(scenario, policy, source)
    reuse = sim.engine.reuse
    if fresh:

        class Fresh(Reuse):
            def __init__(self) -> None:
                super().__init__()
                self.assess = partial(assess)  # the plain assessment, nothing remembered

            def judge(self, snapshot, assessment, policy, **kw):  # type: ignore[no-untyped-def]
                return judge(snapshot, assessment, policy, **kw)

        sim.engine.reuse = Fresh()
    sim.run()
    events = [(e.name, e.level, repr(sorted(e.fields.items()))) for e in sim.timeline]
    return events, reuse.hits


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_scenario_plays_the_same_with_and_without_reuse(path: pathlib.Path) -> None:
    reusing, _hits = _play(path, fresh=False)
    fresh, _ = _play(path, fresh=True)
    assert reusing == fresh


def test_the_scenarios_do_reuse() -> None:
    """The equivalence above is not vacuous: quiet stretches of the scenarios are reused."""
    hits = sum(_play(path, fresh=False)[1] for path in sorted(SCENARIOS.glob("*.yaml")))
    assert hits > 0
