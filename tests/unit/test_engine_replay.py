"""simulate's timeline is the daemon's log: one recorded run, replayed through the daemon's sink.

A scenario is played by ``simulate``. Every answer its edges give the engine (snapshots, final
scans, signal and command results, exits, clock readings) and every call its loop makes into
the engine (poll, note_exits, pause, spares) is recorded. The same sequence is then replayed into a
fresh engine whose sink is the daemon's (:class:`gpuwatchd.daemon.host.LogSink`, structlog), and the
two event streams must be the same: same names, levels, fields, in the same order. A decision
that only one of them made would show up here.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.daemon.host import LogSink
from gpuwatchd.engine.cycle import Engine
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.sim.simulation import Simulation, scenario_policy

SCENARIOS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "scenarios"


class Recorder:
    """Wraps one edge; records each call's method name and result, in order."""

    def __init__(self, inner: object, log: list[tuple[str, str, object]], edge: str) -> None:
        self._inner = inner
        self._log = log
        self._edge = edge

    def __getattr__(self, name: str) -> Callable[..., object]:
        method = getattr(self._inner, name)

        def call(*args: object, **kwargs: object) -> object:
            result = method(*args, **kwargs)
            self._log.append((self._edge, name, result))
            return result

        return call


class Replayer:
    """Answers one edge's calls from the recording, checking they come in the same order."""

    def __init__(self, log: list[tuple[str, str, object]], edge: str) -> None:
        self._answers = [(name, result) for e, name, result in log if e == edge]
        self._edge = edge

    def __getattr__(self, name: str) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            assert self._answers, f"{self._edge}.{name}: more calls than recorded"
            recorded, result = self._answers.pop(0)
            assert recorded == name, f"{self._edge}: {name} called where {recorded} was"
            return result

        return call

    def exhausted(self) -> bool:
        return not self._answers


def _record(path: pathlib.Path) -> tuple[Simulation, list[tuple[str, str, object]], list[Any]]:
    scenario = load_scenario(str(path))
    policy, source = scenario_policy(scenario, None)
    sim = Simulation(scenario, policy, source)
    edges: list[tuple[str, str, object]] = []
    engine = sim.engine
    engine.reader = Recorder(engine.reader, edges, "reader")  # type: ignore[assignment]
    engine.actuator = Recorder(engine.actuator, edges, "actuator")  # type: ignore[assignment]
    engine.clock = Recorder(engine.clock, edges, "clock")  # type: ignore[assignment]
    calls: list[Any] = []  # the loop's calls into the engine, with their arguments
    depth = [0]  # the engine calls note_exits itself inside poll: only the loop's count
    for name in ("poll", "note_exits", "set_paused", "set_spares", "wake_at"):
        inner = getattr(engine, name)

        def call(*args: object, _name: str = name, _inner: Any = inner, **kw: object) -> object:
            if depth[0] == 0:
                calls.append((_name, args, kw))
            depth[0] += 1
            try:
                return _inner(*args, **kw)
            finally:
                depth[0] -= 1

        setattr(engine, name, call)
    sim.run()
    return sim, edges, calls


def _timeline_events(sim: Simulation) -> list[tuple[str, str, dict[str, object]]]:
    events = []
    for entry in sim.timeline:
        if entry.name.startswith(("world.", "sim.")):
            continue
        fields = dict(entry.fields)
        if entry.name == EventName.ACTION_SIGNAL:
            fields.pop("process", None)  # the timeline names the scenario's process
        fields.pop("during", None)
        events.append((entry.name, str(entry.level), fields))
    return events


def _replay(
    sim: Simulation, edges: list[tuple[str, str, object]], calls: list[Any]
) -> list[tuple[str, str, dict[str, object]]]:
    readers = {edge: Replayer(edges, edge) for edge in ("reader", "actuator", "clock")}
    engine = Engine(
        sim.engine.policy,
        reader=readers["reader"],  # type: ignore[arg-type]
        actuator=readers["actuator"],  # type: ignore[arg-type]
        clock=readers["clock"],  # type: ignore[arg-type]
        sink=LogSink(),
    )
    with capture_logs() as logs:
        for name, args, kw in calls:
            getattr(engine, name)(*args, **kw)
    assert all(r.exhausted() for r in readers.values()), "the replay asked for less"
    events = []
    for entry in logs:
        fields: Mapping[str, object] = {
            k: v for k, v in entry.items() if k not in ("event", "log_level")
        }
        events.append((str(entry["event"]), str(entry["log_level"]), dict(fields)))
    return events


@pytest.mark.parametrize(
    "name",
    [
        "dataloader-orphans",
        "stuck-d-state",
        "reset-fails-drain",
        "zombie-child-keeps-memory",
        "reset-blocked-hidden-holder",
    ],
)
def test_simulate_and_the_daemon_sink_see_the_same_decisions(name: str) -> None:
    path = SCENARIOS / f"{name}.yaml"
    if not path.exists():
        pytest.fail(f"example scenario {path} is missing")
    sim, edges, calls = _record(path)
    simulated = _timeline_events(sim)
    assert simulated, "the scenario produced no events"
    assert _replay(sim, edges, calls) == simulated
