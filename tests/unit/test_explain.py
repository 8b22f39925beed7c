"""explain: a scan --json report read back, each finding's rule, next step and what stops it."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from gpuwatchd.cli.explain import explain_report, render_explanation
from gpuwatchd.cli.main import main
from gpuwatchd.cli.report_read import SnapshotError, rebuild
from gpuwatchd.config.schema import parse_policy_documents
from gpuwatchd.decide.policy import Policy
from tests.support.explainrig import report_at


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


@pytest.mark.parametrize("kind", [1, None, ["compute"]])
def test_a_process_type_not_a_string_is_a_snapshot_error_naming_it(kind: object) -> None:
    """NVML's process list came back through str(): a type 1 was the process type "1", a
    missing one "None"; the type is checked as the report's other fields are."""
    report = report_at("dataloader-orphans", 25.0)
    report["gpus"][0]["processes"][0]["type"] = kind  # type: ignore[index]
    with pytest.raises(SnapshotError, match=r"gpus\[0\]\.processes\[0\]\.type: expected str"):
        rebuild(report)


@pytest.mark.parametrize("mode", [1, None, ["full"], "fully"])
def test_a_scan_mode_not_full_or_targeted_is_a_snapshot_error_naming_it(mode: object) -> None:
    """The scan mode came back through str(): a mode 1 or ["full"] was read as a targeted
    scan; it is checked as the report's other fields are."""
    report = report_at("dataloader-orphans", 25.0)
    report["scan_mode"] = mode
    with pytest.raises(SnapshotError, match=r"snapshot\.scan_mode: expected full or targeted"):
        rebuild(report)


@pytest.mark.parametrize("cmdline", [["python", 1], ["python", None], [["train.py"]]])
def test_a_command_line_of_other_than_strings_is_unknown_as_other_malformed_facts(
    cmdline: list[object],
) -> None:
    """A process's command line came back through str(): an argument 1 was the text "1"; a
    malformed one is unknown (None), as the process's other facts read leniently are."""
    report = report_at("dataloader-orphans", 25.0)
    report["gpus"][0]["holders"][0]["cmdline"] = cmdline  # type: ignore[index]
    snapshot = rebuild(report)[0]
    assert snapshot.processes[4250].cmdline is None
    assert snapshot.processes[4251].cmdline == ("python", "train.py", "--epochs", "90")


# --- only what applies, in human times --------------------------------------------------------


def _stops(result: dict[str, object], pid: int) -> str:
    return " | ".join(orphan(result, pid)["stopped_by"])  # type: ignore[arg-type]


def test_pause_and_kill_caps_are_not_listed_when_they_do_not_apply() -> None:
    result = explain_report(report_at("dataloader-orphans", 25.0), POLICY)
    for item in result["findings"]:  # type: ignore[attr-defined]
        stops = " | ".join(item["stopped_by"])
        assert "pause" not in stops
        assert "kill cap" not in stops
        assert "per hour" not in stops


def test_pause_is_listed_only_when_the_report_says_the_daemon_is_paused() -> None:
    report = report_at("dataloader-orphans", 25.0)
    report["daemon"] = {"paused": True, "paused_reason": "driver upgrade"}
    result = explain_report(report, POLICY)
    assert all(
        "pause: the daemon is paused (driver upgrade); `gpuwatchd resume` lifts it"
        in item["stopped_by"]
        for item in result["findings"]  # type: ignore[attr-defined]
    )
    for daemon in ({"paused": False}, {"paused": "yes"}, "paused", None):
        report["daemon"] = daemon
        assert "pause" not in _stops(explain_report(report, POLICY), 4250)


def _limits(text: str) -> Policy:
    return parse_policy_documents([("p.yaml", "dry_run: false\nrules:\n" + RULE + text)])


def test_the_kill_cap_is_listed_when_this_report_alone_would_exceed_it() -> None:
    policy = _limits("limits: {max_signalled_per_poll: 2}\n")
    stops = _stops(explain_report(report_at("dataloader-orphans", 25.0), policy), 4250)
    assert "kill cap: 3 findings of one user here would be signalled" in stops
    assert "max_signalled_per_poll (2)" in stops
    near = _limits("limits: {max_signalled_per_poll: 3}\n")
    stops = _stops(explain_report(report_at("dataloader-orphans", 25.0), near), 4250)
    assert "kill cap near: 3 findings of one user here would be signalled" in stops


def test_the_kill_cap_is_listed_when_the_daemon_says_it_is_reached_or_near() -> None:
    report = report_at("dataloader-orphans", 25.0)
    report["daemon"] = {"forced_dry_run": True, "forced_reason": "more than 64 in one hour"}
    stops = _stops(explain_report(report, POLICY), 4250)
    assert "kill cap: reached (more than 64 in one hour); the daemon forced dry-run" in stops
    assert "`gpuwatchd resume --clear-latches` lifts it" in stops
    # The daemon's count of the last hour is the node's: judged against the node's cap (256).
    report["daemon"] = {"signalled_last_hour": 254}
    assert "kill cap: 254 processes signalled in the last hour plus 3" in _stops(
        explain_report(report, POLICY), 4250
    )
    report["daemon"] = {"signalled_last_hour": 210}
    assert "kill cap near: 210 processes" in _stops(explain_report(report, POLICY), 4250)
    report["daemon"] = {"signalled_last_hour": 62}
    assert "kill cap" not in _stops(explain_report(report, POLICY), 4250)


def test_in_dry_run_the_kill_cap_is_never_listed() -> None:
    policy = parse_policy_documents(
        [("p.yaml", "dry_run: true\nlimits: {max_signalled_per_poll: 1}\nrules:\n" + RULE)]
    )
    report = report_at("dataloader-orphans", 25.0)
    report["daemon"] = {"signalled_last_hour": 64}
    assert "kill cap" not in _stops(explain_report(report, policy), 4250)


def test_the_post_action_delay_is_listed_when_other_findings_share_the_gpu() -> None:
    stops = _stops(explain_report(report_at("dataloader-orphans", 25.0), POLICY), 4250)
    assert "post_action_delay: its first step waits until 15s after the last action" in stops
    assert "2 other finding(s) here would be signalled" in stops


def test_text_times_are_human() -> None:
    report = report_at("xid-leaked-context", 400.0)
    findings: list[dict[str, object]] = report["findings"]  # type: ignore[assignment]
    for finding in findings:
        if finding["kind"] == "ghost_memory":
            finding["first_seen"] = float(report["time"]) - 6.595  # type: ignore[arg-type]
    result = explain_report(report, POLICY)
    items: list[dict[str, Any]] = result["findings"]  # type: ignore[assignment]
    item = next(i for i in items if i["kind"] == "ghost_memory")
    assert item["next"]["in"] == pytest.approx(593.405)  # JSON keeps seconds
    assert item["then"] == ["cooldown 1h; at most 1 per 1d"]
    result["snapshot"] = "snap.json"
    text = render_explanation(result)
    assert "next: GPU reset in 9m53s (from first_seen)" in text
    assert "593.405" not in text


def test_each_wait_is_the_one_before_the_next_step() -> None:
    rule = (
        "  - {name: orphans, kind: orphaned, for: 10m, steps: [{signal: SIGTERM, wait: 90s}, "
        "{signal: SIGINT, wait: 2m}, {signal: SIGKILL, wait: 1h}]}\n"
    )
    policy = parse_policy_documents([("p.yaml", "dry_run: false\nrules:\n" + rule)])
    result = explain_report(report_at("dataloader-orphans", 25.0), policy)
    assert orphan(result, 4250)["then"] == [
        "wait 1m30s, then SIGINT",
        "wait 2m, then SIGKILL",
        "wait 1h, then the ladder ends",
    ]
    result["snapshot"] = "snap.json"
    assert "next: SIGTERM in 10m (from now" in render_explanation(result)


def test_the_json_keeps_its_keys() -> None:
    report = report_at("dataloader-orphans", 25.0)
    report["daemon"] = {"paused": True}
    result = explain_report(report, POLICY)
    assert set(result) == {"time", "policy", "dry_run", "findings"}
    assert set(orphan(result, 4250)) == {
        "key", "kind", "gpu", "pid", "reason", "first_seen", "rule", "no_rule_because",
        "next", "then", "stopped_by", "spared",
    }  # fmt: skip
    nxt = orphan(result, 4250)["next"]
    assert isinstance(nxt, dict)
    assert set(nxt) == {"action", "at", "in", "basis"}


def test_health_finding_is_explained_as_drain_then_reset_with_its_blockers() -> None:
    report = report_at("pending-row-remap-unisolated", 10.0)
    gpus = report["gpus"]
    assert isinstance(gpus, list)
    assert gpus[0]["health"]["remapped_rows"]["pending"] is True
    result = explain_report(json.loads(json.dumps(report)), POLICY)
    items = result["findings"]
    assert isinstance(items, list)
    (item,) = [i for i in items if i["kind"] == "reset_required"]
    assert item["rule"] == "health"
    assert "drain" in str(item["next"])
    assert any("no device isolation" in stop for stop in item["stopped_by"])
    assert "reset_required" in render_explanation(result)


def test_a_health_finding_gpuwatchd_may_not_act_on_is_explained_as_reported_only() -> None:
    report = report_at("recovery-action-unknown", 40.0)
    result = explain_report(json.loads(json.dumps(report)), POLICY)
    items = result["findings"]
    assert isinstance(items, list)
    (item,) = [i for i in items if i["kind"] == "drain_required"]
    assert item["next"] is None
    assert any("not actionable" in stop for stop in item["stopped_by"])
