"""MIG conditions the wide mutation run found unpinned (decide/mig/instances.py,
decide/mig/recovery.py).

Each test pins one condition of the per-instance view or of an instance's recovery through the
modules' public functions: which fields a recovery carries, which records are believed, who may
still use an instance (the final scan's fresh holders included), and what counts as back.
GPU 0 is in MIG mode with GPU instances 1 and 2 (tests/support/migsnap.py: GI profile 19,
placement ``(gi, 1)``).
"""

from __future__ import annotations

import dataclasses

import pytest

from gpuwatchd.core import model
from gpuwatchd.core.model import MIB, Finding, FindingKind, HolderScan, Snapshot
from gpuwatchd.decide.mig import recovery as mig_recovery
from gpuwatchd.decide.mig.instances import (
    NOT_JUDGED,
    MigInstance,
    annotate_findings,
    annotate_report_only,
    busy_instances,
    instance_gpu,
    instance_view,
    mig_layout,
)
from tests.support.migsnap import Inst, mig_uuid, with_mig
from tests.support.snapshots import HostBuilder, gpu_uuid

LEAK = 4 * 1024 * MIB
GI1 = mig_uuid(0, 1)
BACK = 64 * MIB


def host(*instances: Inst, builder: HostBuilder | None = None, **mig: object) -> Snapshot:
    """GPU 0 (MIG) and a plain GPU 1; trainer 700 lives in GPU instance 2."""
    base = (builder or HostBuilder()).gpu(0).gpu(1).proc(700, ppid=1, holds={0}, uvm=True).build()
    options: dict[str, object] = {"instances": list(instances), "caps": {700: [(2, 0)]}}
    options.update(mig)
    return with_mig(base, **options)  # type: ignore[arg-type]


def leaky(builder: HostBuilder | None = None, **mig: object) -> Snapshot:
    listed = Inst(2, allocated=LEAK, processes=((700, LEAK),))
    return host(Inst(1, allocated=LEAK), listed, builder=builder, **mig)


def planned() -> mig_recovery.InstanceRecovery:
    recovery = mig_recovery.recovery_of(leaky(), GI1)
    assert isinstance(recovery, mig_recovery.InstanceRecovery)
    return recovery


# --- what a recovery carries, and which records of it are believed ------------------------------


def test_a_recovery_carries_its_parent_gpus_bus_id_and_index() -> None:
    base = HostBuilder().gpu(0).gpu(1).build()
    snapshot = with_mig(base, gpu=1, instances=[Inst(3, allocated=LEAK)])
    assert mig_recovery.recovery_of(snapshot, mig_uuid(1, 3)) == mig_recovery.InstanceRecovery(
        uuid=gpu_uuid(1),
        pci_bus_id="00000000:11:00.0",
        gpu_index=1,
        gi=3,
        ci=0,
        mig_uuid=mig_uuid(1, 3),
        profile=19,
        placement=3,
        size=1,
    )


@pytest.mark.parametrize("pci", [5, None, ["00000000:10:00.0"]])
def test_a_recorded_bus_id_that_is_no_string_is_read_back_as_unknown(pci: object) -> None:
    record = {**planned().record(), "pci_bus_id": pci}
    assert mig_recovery.from_record(record) == dataclasses.replace(planned(), pci_bus_id=None)


# --- who may still use the instance -------------------------------------------------------------


def test_at_most_five_pids_are_named_per_reason() -> None:
    pids = tuple(range(801, 808))
    builder = HostBuilder()
    for pid in pids:
        builder = builder.proc(pid, ppid=1, holds={0}, uvm=True)
    listed = Inst(1, allocated=LEAK, processes=tuple((p, 1) for p in pids))
    caps = {700: [(2, 0)], **{p: [(1, 0)] for p in pids}}
    snapshot = host(listed, Inst(2), builder=builder, caps=caps)
    assert mig_recovery.instance_blockers(snapshot, GI1) == [
        "GPU instance 1: PID 801, 802, 803, 804, 805 listed by NVML in it",
        "GPU instance 1: PID 801, 802, 803, 804, 805 holding its capability files",
    ]


def test_the_daemons_own_pids_never_block_its_instance() -> None:
    """900 is listed in the instance and holds its capabilities, 901 only the parent node."""
    ours = (
        HostBuilder(self_pids=frozenset({900, 901}))
        .proc(900, ppid=1, holds={0}, uvm=True)
        .proc(901, ppid=1, holds={0}, uvm=True)
    )
    snapshot = host(
        Inst(1, allocated=LEAK, processes=((900, 1),)),
        Inst(2),
        builder=ours,
        caps={700: [(2, 0)], 900: [(1, 0)]},
    )
    assert mig_recovery.instance_blockers(snapshot, GI1) == []


def test_a_parent_only_holder_of_another_mig_gpu_does_not_block() -> None:
    """650 holds GPU 1's node and no capability: unknown for GPU 1's instances, not GPU 0's."""
    builder = HostBuilder().proc(650, ppid=1, holds={1}, uvm=True)
    snapshot = with_mig(leaky(builder), gpu=1, instances=[Inst(3, allocated=LEAK)])
    assert mig_recovery.instance_blockers(snapshot, GI1) == []
    assert mig_recovery.instance_blockers(snapshot, mig_uuid(1, 3)) == [
        "GPU instance 3: PID 650 holding its GPU's device node, instance unknown"
    ]


# --- the final scan: the fresh holder scan, its processes and the daemon's own PIDs ---------------


def fresh_scan(**caps: list[tuple[int, int | None]]) -> tuple[HolderScan, Snapshot]:
    """A fresh full scan where PID 800 (alive now, gone at the last poll) holds ``caps``."""
    now = leaky(
        HostBuilder().proc(800, ppid=1, holds={0}, uvm=True),
        caps={700: [(2, 0)], 800: caps.get("of_800", [])},
    )
    return now.holders, now


def test_the_final_scan_judges_the_fresh_holders_and_processes() -> None:
    holders, now = fresh_scan(of_800=[(1, 0)])
    last = leaky()
    assert 800 not in last.processes
    why = mig_recovery.recovery_blockers(last, holders, {800: now.processes[800]}, frozenset(), GI1)
    assert why == ["GPU instance 1: PID 800 holding its capability files"]


def test_the_final_scan_reads_a_listed_pid_in_its_fresh_processes() -> None:
    """NVML listed 800 in the instance at the last poll, when 800 could not be read: the fresh
    process table says it lives."""
    holders, now = fresh_scan()
    last = host(Inst(1, allocated=LEAK, processes=((800, LEAK),)), Inst(2))
    why = mig_recovery.recovery_blockers(last, holders, {800: now.processes[800]}, frozenset(), GI1)
    assert why[0] == "GPU instance 1: PID 800 listed by NVML in it"


def test_the_final_scan_leaves_out_the_daemons_own_pids_as_they_are_now() -> None:
    holders, now = fresh_scan(of_800=[(1, 0)])
    why = mig_recovery.recovery_blockers(
        leaky(), holders, {800: now.processes[800]}, frozenset({800}), GI1
    )
    assert why == []


def test_the_final_scan_names_the_instance_users_and_the_unreadable_processes() -> None:
    holders, now = fresh_scan(of_800=[(1, 0)])
    unreadable = dataclasses.replace(holders, unreadable=frozenset({12}))
    why = mig_recovery.recovery_blockers(
        leaky(), unreadable, {800: now.processes[800]}, frozenset(), GI1
    )
    assert why == [
        "GPU instance 1: PID 800 holding its capability files",
        "pid 12: fds/maps unreadable (unknown is not none)",
    ]


# --- back after the re-creation ------------------------------------------------------------------


def test_a_leaky_instance_at_another_placement_is_not_the_recreated_one() -> None:
    """GPU instance 0 (placement 0, the same GI profile) still leaks; GPU instance 1 is back."""
    after = host(Inst(0, allocated=LEAK), Inst(1), Inst(2))
    assert mig_recovery.recovered(planned(), after, max_used=BACK) is None


def test_an_instance_whose_memory_could_not_be_read_is_not_back() -> None:
    after = host(Inst(1), Inst(2))
    gpu = after.nvml.gpus[0]
    devices = tuple(dataclasses.replace(d, memory=None) for d in gpu.mig_devices or ())
    gpus = (dataclasses.replace(gpu, mig_devices=devices), *after.nvml.gpus[1:])
    unread = dataclasses.replace(after, nvml=dataclasses.replace(after.nvml, gpus=gpus))
    assert mig_recovery.recovered(planned(), unread, max_used=BACK) == (
        "GPU instance 1 is back; its memory use is unknown"
    )


def test_a_gpu_whose_instances_cannot_be_judged_says_why_it_is_not_back() -> None:
    unjudged = host(Inst(1), Inst(2), table=False)
    assert mig_recovery.recovered(planned(), unjudged, max_used=BACK) == (
        "GPU 0: mig_minors_file /x: No such file or directory"
    )


# --- the per-instance view: who holds which instance, by which route; nothing else changes -------


def test_an_instance_held_by_fd_and_by_mapping_keeps_both_routes() -> None:
    snapshot = leaky(
        HostBuilder().proc(800, ppid=1, holds={0}, uvm=True), caps={700: [(2, 0)], 800: [(1, 0)]}
    )
    both = dataclasses.replace(
        snapshot.holders.holdings[800],
        cap_minors_map=frozenset(snapshot.holders.holdings[800].cap_minors_fd),
    )
    holders = dataclasses.replace(
        snapshot.holders, holdings={**snapshot.holders.holdings, 800: both}
    )
    layout = mig_layout(dataclasses.replace(snapshot, holders=holders))
    assert layout.attributed[800] == {GI1: ("fd", "map")}


def test_the_view_keeps_the_mappings_of_a_plain_gpus_node() -> None:
    """902 maps plain GPU 0's node and GPU 1's, and GPU instance 3 of GPU 1 by its capability."""
    base = HostBuilder().gpu(0).gpu(1).proc(902, ppid=1, holds={0, 1}, via="map", uvm=True)
    snapshot = with_mig(base.build(), gpu=1, instances=[Inst(3)], caps={902: [(3, 0)]}, via="map")
    layout = mig_layout(snapshot)
    held = instance_view(snapshot, layout).holders.holdings[902]
    assert (held.gpu_minors_fd, held.gpu_minors_map) == (
        frozenset(),
        frozenset({0, layout.instances[mig_uuid(1, 3)].minor}),
    )


def test_the_view_keeps_everything_the_readings_say_besides_gpus_and_holdings() -> None:
    snapshot = leaky()
    said = dataclasses.replace(
        snapshot,
        nvml=dataclasses.replace(snapshot.nvml, wedged=True, error="late", driver_version="550"),
        holders=dataclasses.replace(
            snapshot.holders,
            unreadable=frozenset({5}),
            matched_by_name=frozenset({6}),
            thread_tables_unread=frozenset({5}),
        ),
    )
    view = instance_view(said, mig_layout(said))
    nvml, holders = view.nvml, view.holders
    assert (nvml.available, nvml.wedged, nvml.error, nvml.driver_version) == (
        True,
        True,
        "late",
        "550",
    )
    assert (
        holders.mode,
        holders.unreadable,
        holders.matched_by_name,
        holders.thread_tables_unread,
    ) == (said.holders.mode, frozenset({5}), frozenset({6}), frozenset({5}))


# --- the assessment, readable again -------------------------------------------------------------


def test_only_ghost_memory_of_an_instance_with_a_parent_only_cuda_holder_is_not_ghost() -> None:
    """800 holds GPU 0's node and nvidia-uvm, no capability: GPU instance 1's ghost memory is
    unaccounted; an orphan there stays one; a finding about plain GPU 1 passes unchanged."""
    snapshot = leaky(HostBuilder().proc(800, ppid=1, holds={0}, uvm=True))
    ghost = Finding(FindingKind.GHOST_MEMORY, GI1, None, None, "ghost", memory=LEAK)
    orphan = Finding(FindingKind.ORPHANED, GI1, 601, 1, "orphan")
    plain = Finding(FindingKind.ORPHANED, gpu_uuid(1), 602, 1, "orphan")
    (unaccounted, still, same) = annotate_findings(
        [ghost, orphan, plain], mig_layout(snapshot), snapshot
    )
    where = " [MIG GPU instance 1 (1g.10gb) of GPU 0]"
    assert (unaccounted.kind, unaccounted.actionable, unaccounted.reason) == (
        FindingKind.UNACCOUNTED_MEMORY,
        False,
        f"ghost{where}; not ghost: PID(s) 800 hold the GPU's node and nvidia-uvm with no "
        "instance capability (which instance they use cannot be told)",
    )
    assert (still.kind, still.actionable, still.reason) == (
        FindingKind.ORPHANED,
        True,
        f"orphan{where}",
    )
    assert "parent_only_holders" not in still.evidence
    assert same is plain


def test_every_finding_about_no_gpu_of_a_parent_only_holder_is_said_to_hold_a_mig_parent() -> None:
    """800 holds GPU 0's node and no capability: each of its findings about no GPU (an
    unattributed hidden holder, a stuck or abandoned one) is about GPU 0, never a target; a
    stuck or abandoned one keeps its own reason first. Another PID's passes unchanged."""
    snapshot = leaky(HostBuilder().proc(800, ppid=1, holds={0}))
    layout = mig_layout(snapshot)
    unattributed = {"unattributed": True}
    other = Finding(FindingKind.HIDDEN_HOLDER, None, 900, 1, "hidden", evidence=unattributed)
    stuck = Finding(FindingKind.STUCK, None, 800, 1, "stuck", actionable=True)
    lonely = Finding(FindingKind.HIDDEN_HOLDER, None, 800, 1, "hidden", evidence=unattributed)
    (same, dirt, said) = annotate_findings([other, stuck, lonely], layout, snapshot)
    assert same is other
    for finding in (dirt, said):
        assert (finding.gpu, finding.actionable, finding.evidence["mig_parent_only"]) == (
            gpu_uuid(0),
            False,
            True,
        )
        assert finding.evidence["gpus"] == [gpu_uuid(0)]
    assert dirt.kind is FindingKind.STUCK
    assert dirt.reason.startswith("stuck; holds the device node of MIG GPU(s) 0 but")
    assert said.reason.startswith("holds the device node of MIG GPU(s) 0 but")


def test_an_unjudged_mig_gpu_is_said_so_where_it_is_report_only_and_its_devices_were_read() -> None:
    layout = mig_layout(leaky())
    unjudged = dataclasses.replace(
        layout,
        judged=frozenset(),
        unjudged={"A": "no minor", "B": "its MIG devices could not be read"},
    )
    said = annotate_report_only({"B": "MIG enabled", "C": "other"}, unjudged)
    assert said == {"B": "MIG enabled", "C": "other"}  # A is not report-only; B's devices unread
    said = annotate_report_only({"A": "MIG enabled"}, unjudged)
    assert said == {"A": f"{NOT_JUDGED}; its instances cannot be judged: no minor"}


# --- a whole MIG GPU's reset: every instance idle -------------------------------------------------


def test_at_most_five_users_are_named_per_busy_instance() -> None:
    pids = tuple(range(811, 817))
    builder = HostBuilder().gpu(0)
    for pid in pids:
        builder = builder.proc(pid, ppid=1, holds={0}, uvm=True)
    snapshot = with_mig(builder.build(), instances=[Inst(1, processes=tuple((p, 1) for p in pids))])
    assert busy_instances(snapshot, snapshot.nvml.gpus[0]) == (
        "GPU instance 1 is in use (PID 811, 812, 813, 814, 815)"
    )


def test_a_gpu_given_as_not_in_mig_mode_has_no_busy_instances() -> None:
    busy = leaky()
    gpu = dataclasses.replace(busy.nvml.gpus[0], mig_enabled=False)
    assert busy_instances(busy, gpu) is None
    unknown = dataclasses.replace(gpu, mig_enabled=None)  # unknown is never idle
    assert busy_instances(busy, unknown) == (
        "its MIG instances cannot be told idle: its MIG mode could not be read"
    )
    assert busy_instances(busy, busy.nvml.gpus[0]) == "GPU instance 2 is in use (PID 700)"


def test_an_instance_stands_in_as_a_gpu_with_its_parents_facts_and_its_own() -> None:
    """The parent's index, bus id and topology; its first MIG device's name and memory; each
    PID's first entry of its devices' lists (None when one list is unknown); their errors."""
    parent = model.GpuInfo(index=3, uuid="GPU-p", name="H100", pci_bus_id="00000000:17:00.0",
                           minor=2, mig_enabled=True, persistence_mode=True, numa_node=1,
                           architecture=9, nvlink_active=18, error="the parent's own")  # fmt: skip
    memory = model.GpuMemory(total=20 * MIB, free=15 * MIB, reserved=MIB, allocated=4 * MIB)
    a, b, b2, c = (
        model.NvmlProcess(pid, MIB * n, "compute")
        for pid, n in ((10, 1), (11, 2), (11, 3), (12, 4))
    )
    devices = (
        model.MigDevice(0, "MIG-a", 1, 0, name="H100 MIG 1c.2g.20gb", memory=memory,
                        processes=(a, b), error="ci 0: no memory"),
        model.MigDevice(1, "MIG-b", 1, 1, name="other", processes=(b2, c)),
        model.MigDevice(2, "MIG-c", 1, 2, error="ci 2: no name"),
    )  # fmt: skip
    instance = MigInstance(parent, 1, "MIG-a", devices, minor=77)
    assert instance_gpu(instance) == model.GpuInfo(
        index=3, uuid="MIG-a", name="H100 MIG 1c.2g.20gb", pci_bus_id="00000000:17:00.0",
        minor=77, memory=memory, processes=(a, b, c), mig_enabled=False, persistence_mode=True,
        numa_node=1, architecture=9, nvlink_active=18, error="ci 0: no memory; ci 2: no name",
    )  # fmt: skip
    unknown = dataclasses.replace(devices[1], processes=None)
    assert (
        instance_gpu(dataclasses.replace(instance, devices=(devices[0], unknown))).processes is None
    )
    assert instance_gpu(dataclasses.replace(instance, devices=devices[1:2])).error is None
