"""MIG in the pure core (decide/mig/instances.py through assess, plan and the verdict).

Each host has GPU 0 in MIG mode with GPU instances 1 and 2 (and a plain GPU 1 beside it). A
process is attributed to an instance only by the capability files it holds; the parent node
``/dev/nvidia0``, which every MIG process holds, attributes nothing. Orphans of one instance
are found with the same evidence as on a whole GPU, and a live job in the other instance
neither explains nor blocks them, nor suffers anything.
"""

from __future__ import annotations

import dataclasses

import pytest

from gpuwatchd.core.model import MIB, Finding, FindingKind, Snapshot
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.mig.instances import busy_instances, instance_view, mig_layout, parent_of
from gpuwatchd.decide.plan.decisions import plan
from gpuwatchd.decide.plan.intents import SignalIntent
from gpuwatchd.decide.plan.resets import reset_gates
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import Policy, ResetPolicy, default_rules
from gpuwatchd.decide.verdict import judge
from tests.support.fakenvml import cap_minor
from tests.support.migcases import GI1, GI2, LEAK, leak_beside_live_job, run
from tests.support.migsnap import Inst, mig_uuid, with_mig
from tests.support.snapshots import HostBuilder, cg_slurm, gpu_uuid


def findings_of(result: Assessment, pid: int) -> list[Finding]:
    return [f for f in result.findings if f.pid == pid]


def test_an_orphan_of_one_instance_is_orphaned_there_and_the_live_job_beside_it_is_not() -> None:
    result = run(leak_beside_live_job())

    (orphan,) = findings_of(result, 601)
    assert (orphan.kind, orphan.actionable, orphan.gpu) == (FindingKind.ORPHANED, True, GI1)
    assert orphan.evidence["mig"] == {
        "gpu": gpu_uuid(0),
        "gpu_index": 0,
        "gi": 1,
        "ci": [0],
        "profile": "1g.10gb",
        "mig_uuids": [GI1],
    }
    assert "MIG GPU instance 1 (1g.10gb) of GPU 0" in orphan.reason
    assert findings_of(result, 700) == []
    assert findings_of(result, 701) == []
    roles = {(r.pid, r.gpu): r.role.value for r in result.roles}
    assert roles[(700, GI2)] == "context_owner"
    assert roles[(701, GI2)] == "worker"
    assert (601, GI2) not in roles


def test_the_same_holder_on_a_whole_gpu_with_a_live_job_is_still_judged_as_before() -> None:
    """Contrast: without MIG, the dead owner's worker on a GPU is orphaned too (the live job
    is on another GPU); what MIG changes is only which device files say which GPU."""
    snapshot = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .gpu(1, allocated=LEAK)
        .nvml(0, 600, used=LEAK)
        .proc(601, ppid=1, pgid=600, sid=600, holds={0}, uvm=True)
        .proc(700, ppid=1, pgid=700, sid=700, holds={1}, uvm=True)
        .nvml(1, 700, used=LEAK)
        .build()
    )
    (orphan,) = findings_of(run(snapshot), 601)
    assert (orphan.kind, orphan.gpu) == (FindingKind.ORPHANED, gpu_uuid(0))
    assert "mig" not in orphan.evidence


def test_a_process_holding_only_the_parent_node_is_never_attributed_to_an_instance() -> None:
    """601 holds /dev/nvidia0 and nvidia-uvm but no capability: the same ties to dead owner
    600 would make it an orphan if it held GI 1's capability; here it is reported only."""
    result = run(leak_beside_live_job(caps={700: [(2, 0)], 701: [(2, 0)]}))

    (finding,) = findings_of(result, 601)
    assert finding.kind is FindingKind.HIDDEN_HOLDER
    assert finding.actionable is False
    assert finding.gpu == gpu_uuid(0)
    assert finding.evidence["mig_parent_only"] is True
    assert "never a target" in finding.reason
    assert {r.gpu for r in result.roles if r.pid == 601} == {gpu_uuid(0)}


def test_capabilities_through_procfs_files_attribute_as_device_files_do() -> None:
    result = run(
        leak_beside_live_job(caps={700: [(2, 0)], 701: [(2, 0)]}, cap_files={601: [(1, 0)]})
    )
    (orphan,) = findings_of(result, 601)
    assert (orphan.kind, orphan.gpu, orphan.actionable) == (FindingKind.ORPHANED, GI1, True)


def test_a_capability_held_through_a_mapping_shows_as_the_map_route() -> None:
    result = run(leak_beside_live_job(via="map"))
    vias = {(r.pid, r.gpu): r.via for r in result.roles}
    assert vias[(601, GI1)] == ("map",)


def test_a_capability_naming_an_instance_nvml_does_not_list_attributes_nothing() -> None:
    """GI 5 is in the capability table but not in NVML's reading (a layout changed between
    the two): its holder is parent-only, never an orphan of some other instance."""
    result = run(leak_beside_live_job(caps={601: [(5, 0)], 700: [(2, 0)], 701: [(2, 0)]}))
    (finding,) = findings_of(result, 601)
    assert (finding.kind, finding.evidence.get("mig_parent_only")) == (
        FindingKind.HIDDEN_HOLDER,
        True,
    )


def test_without_the_capability_table_a_mig_gpu_stays_report_only_and_says_why() -> None:
    result = run(leak_beside_live_job(table=False))

    assert result.report_only[gpu_uuid(0)].startswith("MIG enabled")
    assert "mig_minors_file /x" in result.report_only[gpu_uuid(0)]
    assert all(not f.actionable for f in result.findings if f.pid is not None)
    assert all(f.gpu != GI1 for f in result.findings)


@pytest.mark.parametrize("table", [True, False])
def test_a_mig_gpu_whose_instances_cannot_be_judged_is_never_called_clean(table: bool) -> None:
    """Ghost memory in GPU instance 1, nobody listed, nobody holding it: dirty when the
    capability table is read; without it no instance (nor its memory) is judged, so the GPU is
    unknown (processes_unknown, saying why), not clean."""
    host = HostBuilder().gpu(0).build()
    snapshot = with_mig(host, instances=[Inst(1, allocated=LEAK), Inst(2)], table=table)
    (verdict,) = judge(snapshot, run(snapshot), Policy()).gpus
    if table:
        assert (verdict.state.value, [r.kind for r in verdict.reasons]) == (
            "dirty",
            ["ghost_memory"],
        )
    else:
        assert verdict.state.value == "unknown"
        ((kind, why),) = [(r.kind, r.text) for r in verdict.reasons]
        assert kind == "processes_unknown"
        assert why.startswith("its MIG instances could not be judged, nor the memory left in")
        assert why.endswith(": mig_minors_file /x: No such file or directory")


def test_an_instance_whose_process_list_is_unknown_leaves_its_holders_undecided() -> None:
    snapshot = leak_beside_live_job(
        instances=[
            Inst(1, allocated=LEAK, processes=((600, LEAK),), readable=False),
            Inst(2, allocated=LEAK, processes=((700, LEAK),)),
        ]
    )
    result = run(snapshot)
    (finding,) = findings_of(result, 601)
    assert finding.kind is FindingKind.HIDDEN_HOLDER
    assert finding.evidence.get("undecided") is True
    assert result.report_only[GI1] == "its process list could not be read"


def test_ghost_memory_in_one_instance_is_found_while_the_other_instance_is_busy() -> None:
    base = HostBuilder().gpu(0).proc(700, ppid=1, pgid=700, sid=700, holds={0}, uvm=True).build()
    snapshot = with_mig(
        base,
        instances=[Inst(1, allocated=LEAK), Inst(2, allocated=LEAK, processes=((700, LEAK),))],
        caps={700: [(2, 0)]},
    )
    result = run(snapshot)

    ghosts = [f for f in result.findings if f.kind is FindingKind.GHOST_MEMORY]
    assert [(g.gpu, g.actionable) for g in ghosts] == [(GI1, True)]
    assert ghosts[0].evidence["mig"]["gi"] == 1  # type: ignore[index]
    assert result.report_only[gpu_uuid(0)].startswith("MIG enabled: the GPU as a whole")


def test_an_instance_of_a_gpu_whose_numa_node_is_unknown_has_no_ghost_memory() -> None:
    """GPU 0's NUMA node could not be read: its memory may be coherent, in every instance too,
    so no instance's memory is judged (as on a whole GPU)."""
    base = HostBuilder().gpu(0, numa_unknown=True).build()
    result = run(with_mig(base, instances=[Inst(1, allocated=LEAK), Inst(2)]))
    assert [f.kind for f in result.findings if f.gpu == GI1] == []
    assert "whether its memory is coherent is unknown" in " ".join(result.notes[GI1])


def test_an_instance_learns_its_own_idle_baseline() -> None:
    base = HostBuilder().gpu(0).build()
    idle = with_mig(base, instances=[Inst(1, allocated=30 * MIB), Inst(2, allocated=5 * MIB)])
    state = run(idle).state
    assert state.baselines[GI1] == 30 * MIB
    assert state.baselines[GI2] == 5 * MIB
    assert gpu_uuid(0) not in state.baselines


def test_the_baseline_of_an_instance_that_is_gone_is_forgotten_unless_nvml_is_unread() -> None:
    """A re-created instance (or a layout applied after a reboot) gets a new MIG UUID: the old
    one's baseline would pile up in the state file. Whole GPUs keep theirs."""
    base = HostBuilder().gpu(0).gpu(1).build()
    idle = with_mig(base, instances=[Inst(1, allocated=30 * MIB), Inst(2, allocated=5 * MIB)])
    state = run(idle).state
    assert set(state.baselines) == {GI1, GI2, gpu_uuid(1)}
    only_gi2 = with_mig(base, instances=[Inst(2, allocated=5 * MIB)])
    later = run(only_gi2, state).state
    assert set(later.baselines) == {GI2, gpu_uuid(1)}
    unread = dataclasses.replace(
        only_gi2, nvml=dataclasses.replace(only_gi2.nvml, available=False, gpus=())
    )
    assert set(run(unread, state).state.baselines) == {GI1, GI2, gpu_uuid(1)}


def test_a_parent_only_cuda_holder_keeps_an_instance_from_being_called_ghost() -> None:
    """Which instance a CUDA process holding the parent node without capabilities uses is
    unknown: it may hold GI 1's memory, so no live holder is not known there."""
    base = HostBuilder().gpu(0).proc(800, ppid=1, holds={0}, uvm=True).build()
    snapshot = with_mig(base, instances=[Inst(1, allocated=LEAK), Inst(2)])
    result = run(snapshot)
    (memory,) = [f for f in result.findings if f.gpu == GI1]
    assert (memory.kind, memory.actionable) == (FindingKind.UNACCOUNTED_MEMORY, False)
    assert memory.evidence["parent_only_holders"] == [800]


def test_the_layout_names_each_instance_and_its_holders() -> None:
    layout = mig_layout(leak_beside_live_job())
    assert sorted(layout.instances) == sorted([GI1, GI2])
    assert layout.attributed[601] == {GI1: ("fd",)}
    assert layout.attributed[701] == {GI2: ("fd",)}
    assert layout.parent_only == {}
    assert layout.instances[GI2].profile == "3g.40gb"


def test_several_compute_instances_share_their_gpu_instance() -> None:
    """GI 2 with compute instances 0 and 1: a holder of CI 1 is attributed to GI 2."""
    snapshot = leak_beside_live_job(
        instances=[
            Inst(1, allocated=LEAK, processes=((600, LEAK),)),
            Inst(2, allocated=LEAK, processes=((700, LEAK),), cis=(0, 1), profile="1c.3g.40gb"),
        ],
        caps={601: [(1, 0)], 700: [(2, 0)], 701: [(2, 1)]},
    )
    layout = mig_layout(snapshot)
    assert layout.attributed[701] == {GI2: ("fd",)}
    assert layout.instances[GI2].cis == (0, 1)
    assert layout.instances[GI2].profile == "3g.40gb"
    assert findings_of(run(snapshot), 701) == []


# --- plan and verdict -------------------------------------------------------------------------


def policy(*, allow_mig: bool = False) -> Policy:
    return dataclasses.replace(
        Policy(dry_run=False, rules=default_rules()),
        reset=dataclasses.replace(ResetPolicy(enabled=True), allow_mig=allow_mig),
    )


def test_plan_signals_the_orphan_of_one_instance_and_never_the_live_job_beside_it() -> None:
    snapshot = leak_beside_live_job()
    result = run(snapshot)
    signalled: set[int] = set()
    state = PlanState()
    for step in range(12):
        now = snapshot.monotonic + 10.0 * step
        out = plan(result.findings, snapshot, state, policy(), now=now, wall=now,
                   report_only=result.report_only)  # fmt: skip
        state = out.state
        signalled |= {i.identity.pid for i in out.intents if isinstance(i, SignalIntent)}
    assert signalled == {601}


@pytest.mark.parametrize("entry", [gpu_uuid(0), "0000:10:00.0"])
@pytest.mark.parametrize("parent_node", [True, False])
def test_protecting_the_parent_gpu_protects_its_instances(parent_node: bool, entry: str) -> None:
    """By its UUID or PCI bus id; also when the orphan holds the instance's capability but not
    ``/dev/nvidia0``: before, only the GPUs of its device nodes were looked up, and it was
    signalled."""
    snapshot = leak_beside_live_job()
    if not parent_node:
        held = dataclasses.replace(snapshot.holders.holdings[601], gpu_minors_fd=frozenset())
        holdings = {**snapshot.holders.holdings, 601: held}
        snapshot = dataclasses.replace(
            snapshot, holders=dataclasses.replace(snapshot.holders, holdings=holdings)
        )
        assert not held.gpu_minors
    result = run(snapshot)
    protected = dataclasses.replace(
        policy(), protect=dataclasses.replace(Policy().protect, gpus=(entry,))
    )
    state = PlanState()
    for step in range(12):
        now = snapshot.monotonic + 10.0 * step
        out = plan(result.findings, snapshot, state, protected, now=now, wall=now,
                   report_only=result.report_only)  # fmt: skip
        state = out.state
        assert not [i for i in out.intents if isinstance(i, SignalIntent)]


@pytest.mark.parametrize("allow_mig", [False, True])
def test_ghost_memory_of_an_instance_never_asks_for_a_gpu_reset(allow_mig: bool) -> None:
    """Without ``reset.mig_recovery`` (off by default), whatever ``allow_mig`` says: the
    instance's recovery is tests/unit/test_mig_recovery_plan.py's."""
    base = HostBuilder().gpu(0).build()
    snapshot = with_mig(base, instances=[Inst(1, allocated=LEAK), Inst(2)])
    result = run(snapshot)
    (ghost,) = [f for f in result.findings if f.kind is FindingKind.GHOST_MEMORY]
    gates = reset_gates(
        ghost, snapshot, policy(allow_mig=allow_mig), report_only=result.report_only,
        findings=result.findings,
    )  # fmt: skip
    assert [(g.name, g.why) for g in gates] == [
        ("mig", "a MIG instance of GPU 0: no GPU reset of an instance (reset.mig_recovery is off)")
    ]


def test_an_orphan_in_a_mig_instance_makes_its_gpu_dirty_and_no_other() -> None:
    snapshot = leak_beside_live_job()
    result = run(snapshot)
    verdicts = {v.uuid: v for v in judge(snapshot, result, Policy()).gpus}
    assert [r.kind for r in verdicts[gpu_uuid(0)].reasons if r.pid == 601] == ["orphaned"]
    assert not any(r.pid == 601 for r in verdicts[gpu_uuid(1)].reasons)


@pytest.mark.parametrize(("state", "kind"), [("D", "stuck"), ("S", "abandoned")])
def test_a_stuck_or_abandoned_parent_only_holder_makes_its_gpu_dirty_and_is_no_target(
    state: str, kind: str
) -> None:
    """800 holds GPU 0's node and nvidia-uvm, no capability, and its job has ended (or it is
    in D): dirt on GPU 0 as on a whole GPU, said to be parent-only, never a target."""
    builder = HostBuilder().gpu(0).gpu(1)
    builder.proc(800, state=state, cgroup=cg_slurm("42"), holds={0}, uvm=True)
    base = dataclasses.replace(builder.build(), handovers={"slurm:42": 10**12})
    snapshot = with_mig(base, instances=[Inst(1), Inst(2)])
    result = run(snapshot)
    (finding,) = findings_of(result, 800)
    assert (finding.kind.value, finding.gpu, finding.actionable) == (kind, gpu_uuid(0), False)
    assert finding.evidence["mig_parent_only"] is True
    verdicts = {v.uuid: v for v in judge(snapshot, result, Policy()).gpus}
    assert verdicts[gpu_uuid(0)].state.value == "dirty"
    assert [r.kind for r in verdicts[gpu_uuid(0)].reasons] == [kind]
    assert verdicts[gpu_uuid(1)].state.value == "clean"


@pytest.mark.parametrize(("state", "kind"), [("D", "stuck"), ("S", "abandoned")])
def test_a_holder_of_a_plain_gpu_and_a_mig_parent_node_is_marked_on_both(
    state: str, kind: str
) -> None:
    """900 holds GPU 0's node and MIG GPU 1's with no capability of its instances: its role
    and its dirt are on both GPUs, as a holder of two whole GPUs' would be."""
    builder = HostBuilder().gpu(0).gpu(1)
    builder.proc(900, state=state, cgroup=cg_slurm("42"), holds={0, 1}, uvm=True)
    base = dataclasses.replace(builder.build(), handovers={"slurm:42": 10**12})
    snapshot = with_mig(base, gpu=1, instances=[Inst(1), Inst(2)])
    result = run(snapshot)
    assert {r.gpu for r in result.roles if r.pid == 900} == {gpu_uuid(0), gpu_uuid(1)}
    verdicts = judge(snapshot, result, Policy()).gpus
    assert [[r.kind for r in v.reasons] for v in verdicts] == [[kind], [kind]]


# --- a whole-GPU reset of a MIG GPU -----------------------------------------------------------


def _health_finding(uuid: str) -> Finding:
    return Finding(FindingKind.RESET_REQUIRED, uuid, None, None, "the driver asks for a reset")


def _gate_names(snapshot: Snapshot, allow_mig: bool) -> list[tuple[str, str]]:
    result = run(snapshot)
    finding = _health_finding(gpu_uuid(0))
    gates = reset_gates(
        finding, snapshot, policy(allow_mig=allow_mig), report_only={}, findings=result.findings
    )
    return [(g.name, g.why) for g in gates]


def test_a_whole_mig_gpu_is_reset_only_with_allow_mig_and_every_instance_idle() -> None:
    idle = with_mig(HostBuilder().gpu(0).build(), instances=[Inst(1), Inst(2)])
    assert _gate_names(idle, allow_mig=False) == [("mig", "MIG enabled")]
    assert _gate_names(idle, allow_mig=True) == []

    busy = leak_beside_live_job()
    gates = dict(_gate_names(busy, allow_mig=True))
    assert gates["mig_busy"] == (
        "MIG: GPU instance 1 is in use (PID 601); GPU instance 2 is in use (PID 700, 701)"
    )


def test_a_mig_gpu_whose_instances_cannot_be_judged_is_never_idle() -> None:
    unknown = with_mig(HostBuilder().gpu(0).build(), instances=[Inst(1)], table=False)
    gates = dict(_gate_names(unknown, allow_mig=True))
    assert gates["mig_busy"].startswith("MIG: its MIG instances cannot be told idle: ")


def test_a_gpu_whose_mig_mode_could_not_be_read_is_never_idle() -> None:
    """With allow_mig on, a GPU whose MIG mode is unknown may hold instances that a reset would
    take down and could not create again: refused as one whose instances cannot be judged."""
    busy = leak_beside_live_job()
    gpu = dataclasses.replace(busy.nvml.gpus[0], mig_enabled=None)
    unknown = dataclasses.replace(busy, nvml=dataclasses.replace(busy.nvml, gpus=(gpu,)))
    gates = dict(_gate_names(unknown, allow_mig=True))
    assert gates["mig_busy"] == (
        "MIG: its MIG instances cannot be told idle: its MIG mode could not be read"
    )
    assert dict(_gate_names(unknown, allow_mig=False))["mig"] == "MIG mode unknown"


# --- the layout, edge by edge -----------------------------------------------------------------


def two_mig_gpus(*, first: dict[str, object] | None = None) -> Snapshot:
    """GPU 0 plain, GPUs 1 and 2 in MIG mode (minors 1 and 2), each with GI 1 and GI 2."""
    base = (
        HostBuilder()
        .gpu(0)
        .gpu(1)
        .gpu(2)
        .proc(900, ppid=1, holds={0, 1}, uvm=True)  # GPU 0 and GPU 1's parent node
        .proc(901, ppid=1, holds={2}, uvm=True)
        .build()
    )
    snapshot = with_mig(base, gpu=1, instances=[Inst(1), Inst(2)], **(first or {}))  # type: ignore[arg-type]
    return with_mig(snapshot, gpu=2, instances=[Inst(1), Inst(2)], caps={901: [(2, 0)]})


def test_each_mig_gpu_is_judged_with_its_own_minor_beside_a_plain_gpu() -> None:
    snapshot = two_mig_gpus(first={"caps": {900: [(1, 0)]}})
    layout = mig_layout(snapshot)
    gpu1 = next(g for g in snapshot.nvml.gpus if g.index == 1)
    gpu2 = next(g for g in snapshot.nvml.gpus if g.index == 2)
    assert layout.judged == {gpu1.uuid, gpu2.uuid}
    assert layout.parent_minors == {1, 2}
    assert layout.attributed[900] == {mig_uuid(1, 1): ("fd",)}
    assert layout.attributed[901] == {mig_uuid(2, 2): ("fd",)}
    assert layout.parent_only == {}
    view = instance_view(snapshot, layout)
    assert [(g.index, g.uuid, g.minor) for g in view.nvml.gpus][:2] == [
        (0, gpu_uuid(0), 0),
        (1, gpu1.uuid, None),
    ]
    assert [g.uuid for g in view.nvml.gpus] == [
        gpu_uuid(0), gpu1.uuid, mig_uuid(1, 1), mig_uuid(1, 2),
        gpu2.uuid, mig_uuid(2, 1), mig_uuid(2, 2),
    ]  # fmt: skip
    parent = view.nvml.gpus[1]
    assert parent.processes == ()
    holding = view.holders.holdings[900]
    instance = layout.instances[mig_uuid(1, 1)]
    assert holding.gpu_minors_fd == {0, instance.minor}  # GPU 0 stays; GPU 1's node goes
    assert holding.gpu_minors_map == frozenset()


def test_a_snapshot_without_mig_is_judged_as_it_is() -> None:
    snapshot = HostBuilder().gpu(0).proc(5, ppid=1, holds={0}, uvm=True).build()
    layout = mig_layout(snapshot)
    assert instance_view(snapshot, layout) is snapshot
    assert (layout.judged, layout.unjudged, layout.parent_only) == (frozenset(), {}, {})


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"mig_devices": None}, "its MIG devices could not be read"),
        ({"minor": None}, "its minor number is unknown"),
    ],
)
def test_why_instances_cannot_be_judged(change: dict[str, object], why: str) -> None:
    snapshot = leak_beside_live_job()
    gpus = tuple(
        dataclasses.replace(g, **change) if g.index == 0 else g  # type: ignore[arg-type]
        for g in snapshot.nvml.gpus
    )
    broken = dataclasses.replace(snapshot, nvml=dataclasses.replace(snapshot.nvml, gpus=gpus))
    layout = mig_layout(broken)
    assert layout.unjudged == {gpu_uuid(0): why}
    assert layout.judged == frozenset()
    assert layout.parent_only == {}


def test_one_mig_device_without_its_instance_id_leaves_the_gpu_unjudged() -> None:
    snapshot = leak_beside_live_job()
    (gpu0, gpu1) = snapshot.nvml.gpus
    assert gpu0.mig_devices is not None
    devices = (gpu0.mig_devices[0], dataclasses.replace(gpu0.mig_devices[1], gi=None))
    broken = dataclasses.replace(
        snapshot,
        nvml=dataclasses.replace(
            snapshot.nvml, gpus=(dataclasses.replace(gpu0, mig_devices=devices), gpu1)
        ),
    )
    assert mig_layout(broken).unjudged == {
        gpu_uuid(0): "a MIG device's GPU instance id could not be read"
    }


def test_a_lost_mig_gpu_is_neither_judged_nor_explained_as_mig() -> None:
    snapshot = leak_beside_live_job()
    (gpu0, gpu1) = snapshot.nvml.gpus
    lost = dataclasses.replace(
        snapshot,
        nvml=dataclasses.replace(snapshot.nvml, gpus=(dataclasses.replace(gpu0, lost=True), gpu1)),
    )
    layout = mig_layout(lost)
    assert (layout.judged, layout.unjudged) == (frozenset(), {})
    assert run(lost).report_only[gpu_uuid(0)].startswith("GPU lost")


def test_capabilities_that_name_no_listed_instance_attribute_nothing_but_valid_ones_do() -> None:
    """Minor 9999 is not in the table; CI 5 of GI 1 does not exist; GI 1's procfs file does:
    unknown capabilities first, then the valid one, which alone attributes."""
    snapshot = leak_beside_live_job(caps={700: [(2, 0)], 701: [(2, 0)]}, cap_files={601: [(1, 0)]})
    holding = snapshot.holders.holdings[601]
    odd = dataclasses.replace(holding, cap_minors_fd=frozenset({9999, cap_minor(0, 1, 5)}))
    holders = dataclasses.replace(
        snapshot.holders, holdings={**snapshot.holders.holdings, 601: odd}
    )
    layout = mig_layout(dataclasses.replace(snapshot, holders=holders))
    assert layout.attributed[601] == {GI1: ("fd",)}
    only_odd = dataclasses.replace(odd, cap_files=frozenset())
    holders = dataclasses.replace(
        snapshot.holders, holdings={**snapshot.holders.holdings, 601: only_odd}
    )
    layout = mig_layout(dataclasses.replace(snapshot, holders=holders))
    assert 601 not in layout.attributed
    assert layout.parent_only[601] == (gpu_uuid(0),)


def test_a_gpu_instance_capability_alone_attributes_to_its_instance() -> None:
    snapshot = leak_beside_live_job(caps={601: [(1, None)], 700: [(2, 0)], 701: [(2, 0)]})
    assert mig_layout(snapshot).attributed[601] == {GI1: ("fd",)}


def test_parent_of_names_an_instance_by_its_uuid_or_nvml_legacy_form() -> None:
    snapshot = leak_beside_live_job()
    found = parent_of(snapshot, GI1)
    assert found is not None
    assert (found[0].uuid, found[1].gi) == (gpu_uuid(0), 1)
    assert parent_of(snapshot, gpu_uuid(0)) is None
    assert parent_of(snapshot, None) is None
    (gpu0, gpu1) = snapshot.nvml.gpus
    assert gpu0.mig_devices is not None
    nameless = tuple(
        dataclasses.replace(d, uuid=None, ci=ci)
        for d, ci in zip(gpu0.mig_devices, (1, None), strict=True)
    )
    legacy = dataclasses.replace(
        snapshot,
        nvml=dataclasses.replace(
            snapshot.nvml, gpus=(dataclasses.replace(gpu0, mig_devices=nameless), gpu1)
        ),
    )
    assert parent_of(legacy, None) is None
    one = parent_of(legacy, f"MIG-{gpu_uuid(0)}/1/1")
    two = parent_of(legacy, f"MIG-{gpu_uuid(0)}/2/0")
    assert one is not None
    assert one[1].gi == 1
    assert two is not None
    assert two[1].gi == 2
    assert parent_of(legacy, f"MIG-{gpu_uuid(0)}/1/0") is None


def test_busy_instances_name_listed_users_holders_and_unknown_lists() -> None:
    base = (
        HostBuilder()
        .gpu(0)
        .proc(700, ppid=1, holds={0}, uvm=True)
        .proc(710, ppid=1, state="Z")
        .proc(720, ppid=1, holds={0}, uvm=True)
        .build()
    )
    snapshot = with_mig(
        base,
        instances=[
            Inst(1, processes=((700, MIB),)),  # listed, holds no capability
            Inst(2, processes=((710, MIB), (711, MIB))),  # a zombie and a dead PID: idle
            Inst(3, readable=False),
            Inst(4),
        ],
        caps={720: [(4, 0)]},
    )
    snapshot = dataclasses.replace(snapshot, self_pids=frozenset({720}))
    gpu = snapshot.nvml.gpus[0]
    assert busy_instances(snapshot, gpu) == (
        "GPU instance 1 is in use (PID 700); GPU instance 3: its process list is unknown"
    )
    plain = HostBuilder().gpu(0).build()
    assert busy_instances(plain, plain.nvml.gpus[0]) is None


def test_a_parent_only_holder_keeps_ghost_only_if_it_is_a_cuda_process_not_ours() -> None:
    for holder, uvm, own in ((800, False, False), (800, True, True)):
        base = HostBuilder().gpu(0).proc(holder, ppid=1, holds={0}, uvm=uvm).build()
        snapshot = with_mig(base, instances=[Inst(1, allocated=LEAK), Inst(2)])
        if own:
            snapshot = dataclasses.replace(snapshot, self_pids=frozenset({holder}))
        kinds = [f.kind for f in run(snapshot).findings if f.gpu == GI1]
        assert kinds == [FindingKind.GHOST_MEMORY], (uvm, own)


def test_the_not_ghost_reason_names_the_parent_only_holders() -> None:
    base = HostBuilder().gpu(0).proc(800, ppid=1, holds={0}, uvm=True).build()
    snapshot = with_mig(base, instances=[Inst(1, allocated=LEAK), Inst(2)])
    (memory,) = [f for f in run(snapshot).findings if f.gpu == GI1]
    assert "not ghost: PID(s) 800 hold the GPU's node and nvidia-uvm" in memory.reason


def test_an_unjudged_mig_gpu_does_not_keep_the_next_one_from_being_judged() -> None:
    snapshot = two_mig_gpus()
    gpus = tuple(
        dataclasses.replace(g, mig_devices=None) if g.index == 1 else g for g in snapshot.nvml.gpus
    )
    mixed = dataclasses.replace(snapshot, nvml=dataclasses.replace(snapshot.nvml, gpus=gpus))
    layout = mig_layout(mixed)
    assert list(layout.unjudged) == [gpus[1].uuid]
    assert layout.judged == {gpus[2].uuid}
    assert layout.attributed[901] == {mig_uuid(2, 2): ("fd",)}
