"""MIG in ``gpuwatchd simulate``: the scenario format's MIG layouts and what the virtual host
makes of them (per-instance memory, contexts and capability files; the engine judges them as
the daemon does). The incident library's MIG scenarios are in tests/unit/test_scenarios.py.
"""

from __future__ import annotations

import pathlib

import pytest

from gpuwatchd.collect.mig import cap_minor
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.mig.instances import mig_layout
from gpuwatchd.sim.scenario import load_scenario, parse_scenario
from gpuwatchd.sim.scenario_spec import ScenarioError
from gpuwatchd.sim.simulation import simulate
from gpuwatchd.sim.world import World

SCENARIOS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "scenarios"

# A layout the scenario refuses, and what its error says.
MALFORMED_LAYOUTS = {
    "[{gi: 1}, {gi: 1}]": "two GPU instances have the same gi",
    "[{gi: 1, profile: 'x; rm'}]": "not a MIG profile name",
    "[{profile: 1g.10gb}]": "missing required field 'gi'",
    "[{gi: 15}]": "a GPU instance id is 0 to 14",
    "[{gi: 1, total: 1GiB, allocated: 2GiB}]": "more than total",
    "[]": "at least one instance",
}

HEAD = """\
duration: 1m
gpus:
  - index: 0
    mig:
      instances:
        - {gi: 1, profile: 1g.10gb, total: 10GiB, leaked: 3GiB}
        - {gi: 2, profile: 3g.40gb, total: 40GiB}
"""


@pytest.mark.parametrize(
    ("tail", "key", "fragment"),
    [
        (
            "processes:\n  - {name: t, holds: [0], nvml: {0: 1GiB}}\n",
            "processes[0].holds",
            "needs holds.mig",
        ),
        (
            "processes:\n  - {name: t, holds: {gpus: [0], mig: 7}}\n",
            "processes[0].holds.mig",
            "has no GPU instance 7",
        ),
        (
            "events:\n  - {at: 1s, start: {name: t, holds: [0], nvml: {0: 1GiB}}}\n",
            "events[0].start.holds",
            "needs holds.mig",
        ),
    ],
)
def test_a_context_or_capability_must_name_an_instance_of_its_gpu(
    tail: str, key: str, fragment: str
) -> None:
    """The problem names the key path in the file (it named the process: ``t.holds``)."""
    with pytest.raises(ScenarioError) as caught:
        parse_scenario("s.yaml", HEAD + tail)
    assert fragment in str(caught.value)
    assert (caught.value.line, caught.value.key) == (HEAD.count("\n") + 2, key)


@pytest.mark.parametrize(("instances", "fragment"), MALFORMED_LAYOUTS.items())
def test_malformed_mig_layouts_are_refused_with_their_line(instances: str, fragment: str) -> None:
    text = f"duration: 1m\ngpus:\n  - index: 0\n    mig:\n      instances: {instances}\n"
    with pytest.raises(ScenarioError) as caught:
        parse_scenario("s.yaml", text)
    assert fragment in str(caught.value)
    assert str(caught.value).startswith("s.yaml:")


def test_a_mig_instance_without_its_gi_is_named_by_its_whole_key_path() -> None:
    """As every other missing field is (``processes[0].name``): not a bare ``gi``."""
    text = "duration: 1m\ngpus:\n  - index: 0\n    mig:\n      instances: [{profile: 1g.10gb}]\n"
    with pytest.raises(ScenarioError) as caught:
        parse_scenario("s.yaml", text)
    assert caught.value.key == "gpus[0].mig.instances[0].gi"


def test_the_virtual_host_reads_like_a_mig_gpu() -> None:
    scenario = parse_scenario(
        "s.yaml",
        HEAD
        + "processes:\n"
        + "  - {name: t, pid: 700, holds: {gpus: [0], mig: 2}, nvml: {0: 5GiB}}\n"
        + "  - {name: p, pid: 800, holds: [0]}\n",
    )
    snapshot = World(scenario).snapshot(0.0)
    (gpu,) = snapshot.nvml.gpus
    assert gpu.mig_enabled is True
    assert gpu.mig_devices is not None
    first, second = gpu.mig_devices
    assert (first.gi, first.profile, second.gi) == (1, "1g.10gb", 2)
    assert first.memory is not None
    assert first.memory.allocated == 3 * 1024**3 + 4 * 1024**2  # leaked + idle
    assert second.processes is not None
    assert [p.pid for p in second.processes] == [700]
    assert snapshot.holders.holdings[700].cap_minors_fd == {cap_minor(0, 2), cap_minor(0, 2, 0)}
    assert snapshot.holders.holdings[800].cap_minors_fd == frozenset()
    layout = mig_layout(snapshot)
    assert layout.parent_only == {800: (gpu.uuid,)}
    assert list(layout.attributed[700].values()) == [("fd",)]


def test_a_dry_run_of_the_mig_incident_names_the_same_single_target_and_sends_nothing() -> None:
    scenario = load_scenario(str(SCENARIOS / "mig-notebook-kernel-died.yaml"))
    enforced = simulate(scenario)
    preview_text = (SCENARIOS / "mig-notebook-kernel-died.yaml").read_text()
    preview = simulate(
        parse_scenario("p.yaml", preview_text.replace("dry_run: false", "dry_run: true"))
    )
    assert [(t, n, s) for t, n, s, _ in enforced.signals()] == [(50.0, "loader-alice", "SIGTERM")]
    assert {n for _, n, _, _ in preview.signals()} == {"loader-alice"}
    assert {o for _, _, _, o in preview.signals()} == {"dry_run"}
    assert preview.signals()[0][:3] == (50.0, "loader-alice", "SIGTERM")


def test_an_xid_read_while_an_instance_is_re_created_is_judged_by_the_next_poll() -> None:
    """The recovery's check reads the whole host, which takes the Xids queued since the last
    poll (NVML's events, the kernel log's lines are read once): they are the next poll's, so a
    double-bit ECC error on another GPU logged meanwhile still asks for that GPU's reset."""
    text = (SCENARIOS / "mig-ghost-instance-recovery.yaml").read_text()
    text = text.replace("processes:\n", "  - index: 1\nprocesses:\n", 1)
    text += "events:\n  - during: health_check\n    xid: {gpu: 1, xid: 48}\n"
    result = simulate(parse_scenario("xid.yaml", text))
    assert [outcome for _, _, outcome in result.resets()] == ["success"]
    (xid,) = result.entries(EventName.HEALTH_XID)
    assert (xid.t, xid.fields["xid"]) == (125.0, 48)  # the poll after the recovery
    uuid = result.final["gpus"][1]["uuid"]  # type: ignore[index]
    assert result.final["open_findings"] == [f"reset_required:{uuid}:gpu"]
