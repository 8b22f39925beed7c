"""Evidence before destructive steps (act/evidence.py, engine.py): one bounded file per GPU
reset, MIG instance re-creation, health drain and ``on_failure`` run (dry run too), written
0600 into the state directory, the oldest removed first under a storm, each cut down to its
size bound; ``explain`` reads it as a scan report, ``status`` lists it."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from gpuwatchd.act.evidence import (
    MAX_FILES,
    EvidenceAction,
    EvidenceKeeper,
    Kept,
    Step,
    list_evidence,
    process_trees,
)
from gpuwatchd.cli.explain import explain_file, render_explanation
from gpuwatchd.cli.report_read import SnapshotError, load_report
from gpuwatchd.cli.scan import snapshot_report
from gpuwatchd.cli.status import describe, read_evidence
from gpuwatchd.cli.status_text import render_text
from gpuwatchd.core.model import Snapshot
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.health.state import HealthState
from gpuwatchd.decide.policy import Detection
from gpuwatchd.decide.verdict import NodeVerdict
from gpuwatchd.engine.cycle import Engine, EngineState
from gpuwatchd.state.directory import StateDir
from tests.support.enginerig import (
    GPU0,
    LEAK,
    W0,
    Actuator,
    Clock,
    Reader,
    Sink,
    ghost_host,
    make_policy,
    orphan_host,
)
from tests.support.healthcases import gpu, health, snap
from tests.support.snapshots import HostBuilder

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a trusted state_dir needs root here")


def report_of(
    snapshot: Snapshot,
    assessment: Assessment,
    verdict: NodeVerdict | None,
    first_seen: Mapping[str, float],
) -> dict[str, object]:
    return snapshot_report(snapshot, assessment, verdict, first_seen, proc_root="/proc")


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[StateDir]:
    folder = StateDir.open(str(tmp_path / "state"), create=True)
    yield folder
    folder.close()


def keeper(folder: StateDir | None, **bounds: int) -> EvidenceKeeper:
    return EvidenceKeeper(lambda: folder, report_of, hostname="node1", version="t", **bounds)


def keep(k: EvidenceKeeper, snapshot: Snapshot, step: Step, wall: float = 1.7e9) -> Kept:
    assessment = assess(snapshot, AssessState(), Detection())
    return k.keep(
        step,
        snapshot=snapshot,
        assessment=assessment,
        verdict=None,
        health=HealthState(),
        first_seen={},
        wall=wall,
    )


RESET = Step(EvidenceAction.GPU_RESET, GPU0, False, "ghost memory")


# --- the file ---------------------------------------------------------------------------------


def test_a_file_holds_the_scan_report_the_health_state_and_each_holder_s_process_tree(
    state_dir: StateDir,
) -> None:
    snapshot = (
        HostBuilder(monotonic=0.0, wall_time=W0)
        .gpu(0, allocated=LEAK)
        .proc(150, ppid=1, comm="bash")
        .proc(201, ppid=150, pgid=200, sid=200, holds={0}, uvm=True)
        .proc(202, ppid=201, comm="child")
        .nvml(0, 200, used=LEAK)
        .build()
    )
    kept = keep(keeper(state_dir), snapshot, RESET)
    path = Path(str(kept.path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.name.startswith("evidence-00000001-")
    assert path.name.endswith(f"-gpu_reset-{GPU0}.json")
    doc = json.loads(path.read_text())
    assert (doc["evidence"], doc["action"], doc["gpu"], doc["dry_run"]) == (1, "gpu_reset", GPU0,
                                                                            False)  # fmt: skip
    assert doc["report"]["gpus"][0]["uuid"] == GPU0  # scan --json's own shape
    assert "orphaned" in [f["kind"] for f in doc["report"]["findings"]]
    assert doc["truncated"] == []
    trees = {t["pid"]: t for t in doc["process_trees"]}
    assert set(trees) == {200, 201}  # the dead listed trainer and the holder
    assert trees[200]["process"] == {"pid": 200, "in_snapshot": False}
    worker = trees[201]
    assert worker["ancestors"] == [
        {**worker["ancestors"][0], "pid": 150, "comm": "bash"},
        {"pid": 1, "in_snapshot": False},  # not read this poll: said, not invented
    ]
    assert [d["pid"] for d in worker["descendants"]] == [202]


def test_process_trees_are_bounded_and_stop_at_a_loop() -> None:
    snapshot = ghost_host(0.0).proc(10, ppid=11).proc(11, ppid=10).build()
    (tree,) = process_trees(snapshot, [10])
    assert tree["ancestors"][0]["pid"] == 11  # type: ignore[index]
    assert len(tree["ancestors"]) == 1  # type: ignore[arg-type]
    assert tree["descendants"] == []  # 11 is already an ancestor
    many = process_trees(ghost_host(0.0).build(), list(range(1000, 1200)))
    assert len(many) == 64


def test_a_dry_run_and_a_mig_instance_are_named_in_the_file_name(state_dir: StateDir) -> None:
    mig = "MIG-00000000-aaaa-4000-8000-000000000001"
    step = Step(EvidenceAction.MIG_INSTANCE, GPU0, True, "mig_ghost", {"gi": 1}, mig)
    kept = keep(keeper(state_dir), ghost_host(0.0).build(), step)
    name = Path(str(kept.path)).name
    assert name.endswith(f"-mig_instance-dry-{mig}.json")
    (entry,) = list_evidence(state_dir)
    assert (entry.action, entry.dry_run, entry.gpu) == ("mig_instance", True, mig)
    assert json.loads(Path(str(kept.path)).read_text())["mig_instance"] == {"gi": 1}


def test_under_a_storm_the_count_is_bounded_and_the_oldest_go_first(state_dir: StateDir) -> None:
    k = keeper(state_dir)
    snapshot = ghost_host(0.0).build()
    # The wall clock steps back halfway: the order is the sequence, not the time.
    for n in range(3 * MAX_FILES):
        wall = 1.7e9 + n if n < 30 else 1.6e9 + n
        keep(k, snapshot, replace(RESET, dry_run=n % 2 == 1), wall=wall)
    kept = list_evidence(state_dir)
    assert len(kept) == MAX_FILES
    assert [e.seq for e in kept] == list(range(2 * MAX_FILES + 1, 3 * MAX_FILES + 1))
    assert len(os.listdir(state_dir.path)) == MAX_FILES  # no temporary file left over
    far_off = keep(k, snapshot, RESET, wall=1e300)  # a clock far off is no crash
    assert "-00000000T000000Z-" in str(far_off.path)
    assert list_evidence(state_dir)[-1].seq == 3 * MAX_FILES + 1


def test_a_file_over_the_size_bound_is_cut_down_and_says_what_was_left_out(
    state_dir: StateDir,
) -> None:
    huge = ("x" * 4000,) * 50  # 200 kB of command line per holder
    host = ghost_host(0.0, allocated=LEAK).gpu(1)
    for pid in range(300, 340):
        host = host.proc(pid, ppid=1, holds={1}, uvm=True, cmdline=huge)
    k = keeper(state_dir, max_bytes=256 << 10)
    kept = keep(k, host.build(), RESET)
    data = Path(str(kept.path)).read_bytes()
    assert len(data) <= 256 << 10
    doc = json.loads(data)
    assert doc["truncated"] == ["process_trees", "report: other GPUs"]
    assert [g["uuid"] for g in doc["report"]["gpus"]] == [GPU0]  # the step's GPU kept
    tiny = keep(keeper(state_dir, max_bytes=600), host.build(), RESET)
    assert json.loads(Path(str(tiny.path)).read_text())["report"] is None


def test_an_unusable_state_dir_or_a_write_error_is_said_never_raised(state_dir: StateDir) -> None:
    missing = keep(keeper(None), ghost_host(0.0).build(), RESET)
    assert missing.path is None
    assert missing.error == "state_dir unusable"

    class Full(StateDir):
        def write(self, name: str, data: bytes, *, mode: int = 0o600, sync: bool = True) -> None:
            raise OSError(28, "No space left on device")

    full = Full(state_dir.path, state_dir.fd, state_dir.owners)
    failed = keep(keeper(full), ghost_host(0.0).build(), RESET)
    assert failed.error == "cannot write in state_dir: No space left on device"
    unsaid = keep(keeper(state_dir), ghost_host(0.0).build(), RESET, wall=float("nan"))
    assert unsaid == Kept(None, error="the evidence holds NaN or infinity")  # JSON holds neither
    assert not list_evidence(state_dir)  # nothing half written


# --- in the engine: each destructive step, dry run too -------------------------------------------


@dataclass
class HealthReader(Reader):
    """GPU 0 whose driver asks for a reset (recovery action 1), nothing holding it."""

    readings: list[Snapshot] = field(default_factory=list)

    def collect(self) -> Snapshot:
        return snap(gpu(0, GPU0, health(recovery_action=1)), t=self.clock.now)


def engine_with_evidence(
    policy_extra: str, folder: StateDir, *, dry_run: bool = False, health_gpu: bool = False
) -> tuple[Engine, Sink, Actuator]:
    clock = Clock()
    reader = (HealthReader if health_gpu else Reader)(clock, ghost_host)
    sink, actuator = Sink(), Actuator()
    engine = Engine(
        make_policy(policy_extra, dry_run=dry_run),
        reader=reader,
        actuator=actuator,
        clock=clock,
        sink=sink,
        evidence=keeper(folder),
    )
    return engine, sink, actuator


@pytest.mark.parametrize("dry_run", [False, True], ids=["enforcing", "dry-run"])
def test_a_reset_leaves_one_evidence_file_named_by_its_outcome(
    state_dir: StateDir, dry_run: bool
) -> None:
    engine, sink, actuator = engine_with_evidence(
        "reset: {confirm_for: 0s}", state_dir, dry_run=dry_run
    )
    engine.poll()
    (outcome,) = sink.named(EventName.RESET_OUTCOME)
    (entry,) = list_evidence(state_dir)
    assert outcome["evidence_file"] == state_dir.join(entry.name)
    assert (entry.action, entry.dry_run, entry.gpu) == ("gpu_reset", dry_run, GPU0)
    resets = [argv for argv, _ in actuator.commands if "--gpu-reset" in argv]
    assert len(resets) == (0 if dry_run else 1)


def test_a_reset_the_final_scan_refuses_keeps_its_evidence_too(state_dir: StateDir) -> None:
    """The evidence is kept before the procedure's first step (its drain hooks), so a reset
    refused at the final scan has its file, named by the refusal's outcome."""
    engine, sink, actuator = engine_with_evidence("reset: {confirm_for: 0s}", state_dir)
    assert isinstance(engine.reader, Reader)
    engine.reader.blockers = [4321]  # a holder appears before the final scan
    engine.poll()
    (outcome,) = sink.named(EventName.RESET_OUTCOME)
    assert outcome["result"] == "refused"
    (entry,) = list_evidence(state_dir)
    assert outcome["evidence_file"] == state_dir.join(entry.name)
    assert not [argv for argv, _ in actuator.commands if "--gpu-reset" in argv]


@pytest.mark.parametrize("dry_run", [False, True], ids=["enforcing", "dry-run"])
def test_a_health_drain_and_its_reset_each_leave_an_evidence_file(
    state_dir: StateDir, dry_run: bool
) -> None:
    extra = "reset:\n  confirm_for: 0s\n  drain:\n    - command: [drain-it, '{uuid}']"
    engine, sink, _ = engine_with_evidence(extra, state_dir, dry_run=dry_run, health_gpu=True)
    engine.poll()
    drains = [h for h in sink.named(EventName.HOOK_RUN) if h["hook"] == "reset_drain"]
    assert drains
    kept = list_evidence(state_dir)
    assert [e.action for e in kept] == ["reset_drain", "gpu_reset"]
    assert all(e.dry_run is dry_run for e in kept)
    assert {h["evidence_file"] for h in drains} == {state_dir.join(kept[0].name)}
    (outcome,) = sink.named(EventName.RESET_OUTCOME)
    assert outcome["evidence_file"] == state_dir.join(kept[1].name)
    doc = json.loads(Path(state_dir.join(kept[0].name)).read_text())
    assert doc["report"]["gpus"][0]["health"]["recovery_action"] == 1
    assert GPU0 in doc["health_state"]


def test_on_failure_hooks_leave_an_evidence_file_but_notifications_do_not(
    state_dir: StateDir,
) -> None:
    engine, sink, _ = engine_with_evidence(
        "reset: {confirm_for: 0s}\non_action:\n  - command: [notify]", state_dir
    )
    engine.actuator = Actuator(returncode=255)  # the reset fails: on_failure follows
    engine.poll()
    kept = list_evidence(state_dir)
    assert [e.action for e in kept] == ["gpu_reset", "on_failure"]
    (failure,) = [h for h in sink.named(EventName.HOOK_RUN) if h["hook"] == "on_failure"]
    assert failure["evidence_file"] == state_dir.join(kept[1].name)


def test_without_a_usable_state_dir_the_step_goes_on_and_says_so(state_dir: StateDir) -> None:
    engine, sink, actuator = engine_with_evidence("reset: {confirm_for: 0s}", state_dir)
    engine.evidence = keeper(None)
    engine.poll()
    (unsaved,) = sink.named(EventName.EVIDENCE_UNSAVED)
    assert unsaved["action"] == "gpu_reset"
    assert unsaved["gpu"] == GPU0
    assert unsaved["error"] == "state_dir unusable"
    (outcome,) = sink.named(EventName.RESET_OUTCOME)
    assert "evidence_file" not in outcome
    assert [argv for argv, _ in actuator.commands if "--gpu-reset" in argv]


def test_a_bug_in_the_report_or_the_keeper_never_stops_the_step(state_dir: StateDir) -> None:
    def broken(*_: object, **__: object) -> dict[str, object]:
        raise RuntimeError("bug")

    engine, sink, actuator = engine_with_evidence("reset: {confirm_for: 0s}", state_dir)
    engine.evidence = EvidenceKeeper(lambda: state_dir, broken)
    engine.poll()
    (entry,) = list_evidence(state_dir)  # still kept, saying why it has no report
    doc = json.loads(Path(state_dir.join(entry.name)).read_text())
    assert (doc["report"], doc["report_error"]) == (None, "RuntimeError('bug')")
    assert doc["process_trees"] == []

    class Crashing(EvidenceKeeper):
        def keep(self, *args: object, **kwargs: object) -> Kept:
            raise RuntimeError("bug")

    engine.evidence = Crashing(lambda: state_dir, broken)
    engine.state = EngineState()  # a new incident: the reset is planned again
    engine.poll()
    (unsaved,) = sink.named(EventName.EVIDENCE_UNSAVED)
    assert unsaved["error"] == "crashed (a bug): RuntimeError('bug')"
    assert len([argv for argv, _ in actuator.commands if "--gpu-reset" in argv]) == 2


# --- explain and status read them --------------------------------------------------------------


def test_explain_reads_an_evidence_file_as_the_scan_report_it_holds(state_dir: StateDir) -> None:
    kept = keep(keeper(state_dir), orphan_host(0.0).build(), replace(RESET, dry_run=True))
    path = str(kept.path)
    result = explain_file(path, make_policy())
    findings = result["findings"]
    assert isinstance(findings, list)
    assert "orphaned" in [f["kind"] for f in findings]
    assert result["evidence"]["action"] == "gpu_reset"  # type: ignore[index]
    text = render_explanation(result)
    assert f"evidence kept before gpu_reset of {GPU0} (dry run): ghost memory" in text
    assert load_report(path)["gpus"] == json.loads(Path(path).read_text())["report"]["gpus"]


def test_explain_refuses_an_evidence_file_cut_down_to_no_report(state_dir: StateDir) -> None:
    kept = keep(keeper(state_dir, max_bytes=1500), ghost_host(0.0).build(), RESET)
    with pytest.raises(SnapshotError, match="an evidence file without its scan report"):
        load_report(str(kept.path))


def test_status_lists_the_evidence_files_text_and_json(state_dir: StateDir) -> None:
    k = keeper(state_dir)
    for n in range(7):
        keep(k, ghost_host(0.0).build(), replace(RESET, dry_run=n == 6), wall=1.7e9 + n)
    listed = read_evidence(state_dir.path)
    assert listed is not None
    assert len(listed) == 7
    assert listed[-1]["dry_run"] is True
    assert listed[-1]["path"] == state_dir.join(str(listed[-1]["name"]))
    result = describe(None, policy=make_policy(), now_wall=1.7e9 + 10, evidence=listed)
    assert result["evidence"] == listed
    result["state"] = "present"
    text = render_text(result)
    assert "evidence files (7, newest last):" in text
    assert f"20231114T221326Z gpu_reset of {GPU0} (dry run): {listed[-1]['path']}" in text
    assert text.count("gpu_reset of") == 5  # the newest few; --json has them all
    assert read_evidence(str(Path(state_dir.path) / "missing")) is None
    assert json.loads(json.dumps(result))  # plain JSON
