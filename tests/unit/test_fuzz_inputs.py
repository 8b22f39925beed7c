"""Fuzz: scenarios and saved reports end in a result or their documented error, never a crash.

A scenario is a file an admin (or anyone who mails them one) hands to ``simulate``; a report
is the JSON ``explain`` reads back. Whatever they hold, the answer is a value or
ScenarioError / SimulationError / SnapshotError (exit 65), never another exception.
The policy side has its own fuzz test in tests/integration/test_config_hostile.py.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd.cli.explain import explain_report
from gpuwatchd.cli.main import main
from gpuwatchd.cli.report_read import SnapshotError, load_report
from gpuwatchd.config.schema import default_policy
from gpuwatchd.sim.scenario import parse_scenario
from gpuwatchd.sim.scenario_spec import ScenarioError
from gpuwatchd.sim.simulation import scenario_policy, simulate
from gpuwatchd.sim.world import SimulationError
from tests.support.explainrig import report_at

CI = os.environ.get("GPUWATCHD_HYPOTHESIS_PROFILE") == "ci"
FUZZ = settings(
    max_examples=1000 if CI else 150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SCENARIOS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "scenarios"

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["5s", "1e400", "-1s", "4GiB", "GPU-0", "exit", "D", "trainer", "0", "∞"]),
)
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(
                ["duration", "gpus", "processes", "events", "policy", "index", "name", "pid",
                 "ppid", "holds", "nvml", "at", "exit", "start", "state", "memory", "interval",
                 "uuid", "minor", "processes", "holders", "findings", "time", "kind", "gpu"]
            ),
            inner,
            max_size=5,
        ),
    ),
    max_leaves=25,
)  # fmt: skip


def _scenario_or_error(text: str) -> None:
    try:
        scenario = parse_scenario("fuzz.yaml", text)
    except ScenarioError as err:
        assert str(err)  # noqa: PT017 - a result or this error, whichever comes
        return
    try:
        simulate(scenario)
    except (ScenarioError, SimulationError) as err:
        assert str(err)  # noqa: PT017 - a result or this error, whichever comes


@FUZZ
@given(st.text(max_size=300))
def test_any_text_is_a_scenario_or_a_scenario_error(text: str) -> None:
    _scenario_or_error(text)


@FUZZ
@given(documents)
def test_any_yaml_document_is_a_scenario_or_a_scenario_error(doc: object) -> None:
    _scenario_or_error(yaml.safe_dump(doc))


@FUZZ
@given(st.data())
def test_an_example_scenario_with_one_value_changed_plays_or_says_why(data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(sorted(SCENARIOS.glob("*.yaml"))))
    doc = yaml.safe_load(path.read_text())
    _mutate(doc, data)
    _scenario_or_error(yaml.safe_dump(doc))


def _mutate(doc: Any, data: st.DataObject) -> None:
    """Replace one value somewhere in ``doc`` (a dict or list) with a random one."""
    node = doc
    for _ in range(data.draw(st.integers(min_value=0, max_value=4))):
        children = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        children = [(k, v) for k, v in children if isinstance(v, (dict, list)) and v]
        if not children:
            break
        node = data.draw(st.sampled_from(children))[1]
    keys = list(node.keys()) if isinstance(node, dict) else list(range(len(node)))
    if keys:
        node[data.draw(st.sampled_from(keys))] = data.draw(documents)


def test_a_scenario_that_would_poll_forever_is_refused_up_front() -> None:
    text = "duration: 100000d\ninterval: 100ms\ngpus: [{index: 0}]\n"
    scenario = parse_scenario("long.yaml", text)
    with pytest.raises(SimulationError, match="polls"):
        simulate(scenario)


# --- saved reports ------------------------------------------------------------------------------

_REPORT = report_at("dataloader-orphans", 25.0)
_POLICY, _ = scenario_policy(parse_scenario("p.yaml", "duration: 1m\ngpus: [{index: 0}]\n"), None)


def _explained_or_error(report: object) -> None:
    try:
        if not isinstance(report, dict):
            raise SnapshotError("expected the object `gpuwatchd scan --json` prints")
        explain_report(report, _POLICY)
    except SnapshotError as err:
        assert str(err)  # noqa: PT017 - a result or this error, whichever comes


@FUZZ
@given(st.data())
def test_a_report_with_one_value_changed_is_explained_or_a_snapshot_error(
    data: st.DataObject,
) -> None:
    report = copy.deepcopy(_REPORT)
    _mutate(report, data)
    _explained_or_error(report)


@FUZZ
@given(documents)
def test_any_json_document_is_explained_or_a_snapshot_error(doc: object) -> None:
    _explained_or_error(json.loads(json.dumps(doc, default=str)))


@pytest.mark.parametrize(
    "content",
    [
        "[" * 100_000,
        '{"time": 1, "gpus": [], "findings": [' + "[" * 50_000,
        "\x00\x01",
        "",
        # Python's JSON reader takes these, and explain --json printed them back: no JSON.
        '{"time": NaN, "gpus": [], "findings": []}',
        '{"time": 1e999, "gpus": [], "findings": []}',
    ],
)
def test_a_hostile_report_file_is_exit_65_in_one_line(
    tmp_path: pathlib.Path, content: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "report.json"
    path.write_text(content)
    with pytest.raises(SnapshotError):
        load_report(str(path))
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text("dry_run: true\n")
    code = main(["--config", str(config), "explain", str(path)])
    err = capsys.readouterr().err
    assert code == 65
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_the_default_policy_is_what_explain_fuzzing_uses() -> None:
    assert _POLICY.rules == default_policy().rules
