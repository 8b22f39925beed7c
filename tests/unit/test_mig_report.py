"""MIG on screen: ``scan`` (JSON and text), the metrics and ``explain`` of a MIG host.

The host is tests/unit/test_mig_assess.py's: GPU 0 in MIG mode, an orphan (601) of a dead trainer
in GPU instance 1 beside a live job (700, worker 701) in GPU instance 2, and a plain GPU 1.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.cli.explain import explain_report
from gpuwatchd.cli.report import build_report
from gpuwatchd.cli.report_read import rebuild
from gpuwatchd.cli.report_text import render_text
from gpuwatchd.config.schema import parse_policy_documents
from gpuwatchd.core.model import Snapshot
from gpuwatchd.daemon.metrics import Metrics
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.verdict import judge
from gpuwatchd.engine.edges import PollReport
from tests.support.migcases import GI1, GI2, LEAK, leak_beside_live_job, run
from tests.support.migsnap import Inst, with_mig
from tests.support.snapshots import HostBuilder, gpu_uuid


def samples_of(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, key(sample.labels)): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }


def key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def report_of(snapshot: Snapshot, result: Assessment) -> dict[str, Any]:
    built = build_report(
        snapshot, result.findings, result.roles, result.report_only, result.state.baselines,
        version="test", notes=result.notes, verdict=judge(snapshot, result, Policy()),
    )  # fmt: skip
    return json.loads(json.dumps(built))  # type: ignore[no-any-return]


def test_scan_json_lists_each_instance_under_its_gpu_with_its_own_holders() -> None:
    snapshot = leak_beside_live_job()
    report = report_of(snapshot, run(snapshot))

    mig_gpu, plain = report["gpus"]
    assert plain["mig_instances"] is None
    first, second = mig_gpu["mig_instances"]
    assert (first["gi"], first["ci"], first["uuid"], first["profile"]) == (1, [0], GI1, "1g.10gb")
    assert first["judged"] is True
    assert first["placement"] == [1, 1]
    assert first["memory"]["used"] == LEAK
    assert [(h["pid"], h["role"], h["via"]) for h in first["holders"]] == [
        (601, "orphaned", ["fd"])
    ]
    assert [p["pid"] for p in first["processes"]] == [600]
    assert [(h["pid"], h["role"]) for h in second["holders"]] == [
        (700, "context_owner"),
        (701, "worker"),
    ]
    assert report["node_holders"] == []
    orphan = next(f for f in report["findings"] if f["pid"] == 601)
    assert orphan["gpu"] == GI1
    assert orphan["evidence"]["mig"]["gi"] == 1
    # The GPU entry itself keeps every field it had (fields are only added).
    assert mig_gpu["mig_enabled"] is True
    assert mig_gpu["minor"] == 0


def test_scan_text_shows_the_orphan_under_its_instance_and_no_node_section() -> None:
    snapshot = leak_beside_live_job()
    text = render_text(report_of(snapshot, run(snapshot)))

    assert "processes and holders: by MIG instance, below" in text
    first = text.index("MIG GPU instance 1 (CI 0)  1g.10gb")
    second = text.index("MIG GPU instance 2 (CI 0)  3g.40gb")
    orphan_line = next(
        i
        for i, line in enumerate(text.splitlines())
        if line.strip().startswith("orphaned") and "pid 601" in line
    )
    offset = sum(len(line) + 1 for line in text.splitlines()[:orphan_line])
    assert first < offset < second
    assert "\nnode\n" not in text


def test_an_instance_s_text_escapes_what_a_report_file_says() -> None:
    """``explain`` renders a saved report, which anyone may have written: an instance's ids,
    profile, UUID, report-only reason and notes reach the terminal escaped, like every other
    field (a terminal control sequence in them is shown, not obeyed)."""
    snapshot = leak_beside_live_job()
    report = report_of(snapshot, run(snapshot))
    bad = "\x1b]0;owned\x07"
    instance = report["gpus"][0]["mig_instances"][0]
    instance.update(gi=bad, ci=[bad], profile=bad, uuid=bad, notes=[bad])
    report["gpus"][0]["mig_instances"].append(
        {**instance, "judged": True, "report_only": bad, "notes": bad}
    )
    text = render_text(report)
    assert "\x1b" not in text
    assert "\x07" not in text
    shown = "\\x1b]0;owned\\x07"
    assert f"MIG GPU instance {shown} (CI {shown})  {shown}  {shown}" in text
    assert f"    note: {shown}" in text
    assert f"    report-only: {shown}" in text


def test_a_parent_only_holder_shows_under_the_gpu_itself() -> None:
    snapshot = leak_beside_live_job(caps={700: [(2, 0)], 701: [(2, 0)]})
    report = report_of(snapshot, run(snapshot))
    holders = {h["pid"]: h for h in report["gpus"][0]["holders"]}
    assert holders[601]["role"] == "hidden"
    text = render_text(report)
    assert "hidden_holder" in text
    assert "never a target" in text


def test_metrics_have_a_sample_set_per_instance() -> None:
    base = HostBuilder().gpu(0).proc(700, ppid=1, holds={0}, uvm=True).build()
    snapshot = with_mig(
        base,
        instances=[Inst(1, allocated=LEAK), Inst(2, allocated=LEAK, processes=((700, LEAK),))],
        caps={700: [(2, 0)]},
    )
    result = run(snapshot)
    metrics = Metrics(None)
    metrics.after_poll(PollReport(snapshot, result, PlanState(), seconds=0.1), dry_run=True,
                       policy_rejected=False)  # fmt: skip
    samples = samples_of(metrics)
    one = {"gpu": gpu_uuid(0), "index": "0", "gi": "1", "instance": GI1}
    two = {"gpu": gpu_uuid(0), "index": "0", "gi": "2", "instance": GI2}
    assert samples[("gpuwatchd_mig_instance_memory_allocated_bytes", key(one))] == LEAK
    assert samples[("gpuwatchd_mig_instance_memory_ghost_bytes", key(one))] == LEAK - 64 * 2**20
    assert samples[("gpuwatchd_mig_instance_memory_ghost_bytes", key(two))] == 0
    assert samples[("gpuwatchd_mig_instance_memory_accounted_bytes", key(two))] == LEAK
    ghosts = key({**one, "kind": "ghost_memory"})
    assert samples[("gpuwatchd_mig_instance_findings", ghosts)] == 1
    plain = Metrics(None)
    plain_snapshot = HostBuilder().gpu(0).build()
    plain.after_poll(PollReport(plain_snapshot, run(plain_snapshot), PlanState(), seconds=0.1),
                     dry_run=True, policy_rejected=False)  # fmt: skip
    assert "gpuwatchd_mig_instance_memory_allocated_bytes{" not in plain.render().decode()


POLICY = parse_policy_documents(
    [("p.yaml", "dry_run: false\nreset: {enabled: true}\nrules:\n"
      "  - {name: orphans, kind: orphaned, for: 30s, steps: [{signal: SIGTERM, wait: 30s}]}\n")]
)  # fmt: skip


def test_explain_reads_instances_back_and_says_the_orphan_rule_applies() -> None:
    snapshot = leak_beside_live_job()
    report = report_of(snapshot, run(snapshot))
    rebuilt, _findings, _ = rebuild(report)
    (parent, _plain) = rebuilt.nvml.gpus
    assert parent.mig_devices is not None
    assert {d.uuid for d in parent.mig_devices} == {GI1, GI2}
    assert 701 in rebuilt.processes
    result: dict[str, Any] = json.loads(json.dumps(explain_report(report, POLICY)))
    item = next(i for i in result["findings"] if i["pid"] == 601)
    assert item["rule"] == "orphans"
    assert item["next"]["action"] == "SIGTERM"


def test_an_instance_process_whose_type_is_not_a_string_is_skipped_as_other_malformed_ones() -> (
    None
):
    """A MIG instance's process list is read leniently (a malformed entry skipped); its type
    went through str(), so a type 1 was a process of type "1"."""
    snapshot = leak_beside_live_job()
    report = report_of(snapshot, run(snapshot))
    report["gpus"][0]["mig_instances"][1]["processes"][0]["type"] = 1
    parent = rebuild(report)[0].nvml.gpus[0]
    assert parent.mig_devices is not None
    assert [[p.kind for p in d.processes or ()] for d in parent.mig_devices] == [["compute"], []]


def test_explain_says_an_instance_has_no_gpu_reset() -> None:
    base = HostBuilder().gpu(0).build()
    snapshot = with_mig(base, instances=[Inst(1, allocated=LEAK), Inst(2)])
    report = report_of(snapshot, run(snapshot))
    result = explain_report(report, POLICY)
    text = json.dumps(result)
    assert "no GPU reset of an instance" in text


def test_explain_with_mig_recovery_says_the_instance_is_recreated_not_the_gpu_reset() -> None:
    base = HostBuilder().gpu(0).build()
    snapshot = with_mig(base, instances=[Inst(1, allocated=LEAK), Inst(2)])
    report = report_of(snapshot, run(snapshot))
    recovering = parse_policy_documents(
        [("p.yaml", "dry_run: false\nreset: {enabled: true, mig_recovery: true}\n")]
    )
    result: dict[str, Any] = json.loads(json.dumps(explain_report(report, recovering)))
    (item,) = [i for i in result["findings"] if i["kind"] == "ghost_memory"]
    assert item["next"]["action"] == (
        "re-creation of MIG GPU instance 1 of GPU 0 (GI profile 19, placement 1:1)"
    )
    assert "no GPU reset of an instance" not in json.dumps(result)
    assert "(the parent GPU's)" in item["then"][0]


def test_instances_of_a_gpu_that_cannot_be_judged_are_listed_from_nvml_alone() -> None:
    snapshot = leak_beside_live_job(table=False)
    report = report_of(snapshot, run(snapshot))
    instances = report["gpus"][0]["mig_instances"]
    assert [(i["gi"], i["judged"]) for i in instances] == [(1, False), (2, False)]
    assert "holders" not in instances[0]
    text = render_text(report)
    assert "not judged (see the GPU's report-only reason)" in text
    assert "mig_minors_file /x" in text
