"""explain: a scan --json report read back, each finding's rule, next step and what stops it."""

from __future__ import annotations

import json
import pathlib

import pytest

from gpuwatchd.cli.explain import SnapshotError, explain_report, rebuild
from gpuwatchd.cli.main import main
from gpuwatchd.cli.report import build_report
from gpuwatchd.cli.scenario import load_scenario
from gpuwatchd.cli.simulate import Simulation, scenario_policy
from gpuwatchd.config.schema import parse_policy_documents
from gpuwatchd.decide.assess import assess
from gpuwatchd.decide.assess_state import AssessState

SCENARIOS = pathlib.Path(__file__).resolve().parent.parent / "examples" / "scenarios"


def report_at(name: str, t: float, first_seen: dict[str, float] | None = None) -> dict[str, object]:
    scenario = load_scenario(str(SCENARIOS / f"{name}.yaml"))
    policy, source = scenario_policy(scenario, None)
    sim = Simulation(scenario, policy, source)
    sim.advance(t)
    snap = sim.world.snapshot(t)
    a = assess(snap, AssessState(), policy.detection)
    return build_report(
        snap, a.findings, a.roles, a.report_only, a.state.baselines,
        first_seen=first_seen, now_wall=snap.wall_time, version="test", notes=a.notes,
    )  # fmt: skip


def orphan(result: dict[str, object], pid: int) -> dict[str, object]:
    items = result["findings"]
    assert isinstance(items, list)
    return next(i for i in items if i["kind"] == "orphaned" and i["pid"] == pid)


RULE = "  - {name: orphans, kind: orphaned, for: 30s, steps: [{signal: SIGTERM, wait: 30s}]}\n"
POLICY = parse_policy_documents([("p.yaml", "dry_run: false\nrules:\n" + RULE)])


def test_without_first_seen_the_window_counts_from_now() -> None:
    item = orphan(explain_report(report_at("dataloader-orphans", 25.0), POLICY), 4250)
    assert item["rule"] == "orphans"
    assert item["next"]["action"] == "SIGTERM"  # type: ignore[index]
    assert item["next"]["in"] == 30.0  # type: ignore[index]


def test_first_seen_from_the_daemon_state_says_when() -> None:
    report = report_at("dataloader-orphans", 25.0)
    key = next(f["key"] for f in report["findings"] if f["pid"] == 4250)  # type: ignore[attr-defined]
    report = report_at("dataloader-orphans", 25.0, {key: float(report["time"]) - 20.0})  # type: ignore[arg-type]
    item = orphan(explain_report(report, POLICY), 4250)
    assert item["next"]["in"] == 10.0  # type: ignore[index]
    assert item["next"]["basis"] == "first_seen"  # type: ignore[index]


def test_protect_and_dry_run_are_named_as_what_would_stop_it() -> None:
    policy = parse_policy_documents([("p.yaml", "dry_run: true\nprotect: {users: [alice]}\n")])
    item = orphan(explain_report(report_at("dataloader-orphans", 25.0), policy), 4250)
    stops = " | ".join(item["stopped_by"])  # type: ignore[arg-type]
    assert "protect: user alice" in stops
    assert "dry_run" in stops


def test_a_rule_whose_filters_do_not_match_says_why() -> None:
    policy = parse_policy_documents([("p.yaml", "rules:\n" + (
        "  - {name: bob, kind: orphaned, users: [bob], steps: [{signal: SIGTERM, wait: 1s}]}\n"
    ))])  # fmt: skip
    item = orphan(explain_report(report_at("dataloader-orphans", 25.0), policy), 4250)
    assert item["rule"] is None
    assert "rule bob: its filters do not match" in item["no_rule_because"][0]  # type: ignore[index]


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"gpus": [], "findings": []}, "snapshot.time"),
        ({"time": 1.0, "gpus": {}, "findings": []}, "snapshot.gpus"),
        ({"time": 1.0, "gpus": [], "findings": [{"kind": "nope"}]}, "findings[0].kind"),
        ({"time": 1.0, "gpus": [{"index": 0}], "findings": []}, "gpus[0].uuid"),
    ],
)
def test_malformed_snapshot_names_the_field(doc: dict[str, object], field: str) -> None:
    with pytest.raises(SnapshotError, match=field.replace("[", r"\[").replace("]", r"\]")):
        rebuild(doc)


def test_cli_exits_65_on_a_malformed_snapshot(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "snap.json"
    path.write_text(json.dumps({"time": 1.0, "gpus": [], "findings": [{"kind": 3}]}))
    assert main(["--config", "/nonexistent-ok", "explain", str(path)]) in (65, 78)
    path.write_text("{not json")
    assert main(["explain", str(path)]) == 65
    assert f"{path}:1: not JSON" in capsys.readouterr().err


def _ghost_report() -> dict[str, object]:
    report = report_at("xid-leaked-context", 400.0)
    kinds = {f["kind"] for f in report["findings"]}  # type: ignore[attr-defined]
    assert "ghost_memory" in kinds, kinds
    return report


def test_explain_names_the_nvlink_gate_plan_uses() -> None:
    """explain had its own copy of the reset gates, without NVLink; it now asks plan."""
    report = _ghost_report()
    gpu = report["gpus"][0]  # type: ignore[index]
    gpu.update(architecture=7, nvlink_active=4)  # an Ampere with active NVLinks
    item = next(
        i
        for i in explain_report(report, POLICY)["findings"]  # type: ignore[attr-defined]
        if i["kind"] == "ghost_memory"
    )
    assert any("NVLink peers must be reset together" in s for s in item["stopped_by"])


def test_a_field_of_the_wrong_type_is_a_snapshot_error_not_a_traceback() -> None:
    report = _ghost_report()
    report["gpus"][0]["processes"] = 1  # type: ignore[index]
    with pytest.raises(SnapshotError, match=r"gpus\[0\]\.processes: expected a list"):
        rebuild(report)
