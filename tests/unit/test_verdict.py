"""The one verdict (decide/verdict.py): may each GPU be handed to a new job?

Tables over hand-built snapshots, judged through the real assessment: every kind of thing a
GPU can hold, and whether it is dirt, unknown, or only something that would block a reset.
Then ``run --once``'s reading of it (:func:`once_progress`), and a layers-style check that the
commands answering "clean?" ask the verdict instead of looking at findings themselves.
"""

from __future__ import annotations

import ast
import pathlib
import re
from dataclasses import replace
from typing import Any

import pytest

from gpuwatchd.core.model import MIB, Finding, FindingKind, NvmlReading, Snapshot
from gpuwatchd.core.vocabulary import Cleanliness
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import Detection, Policy, Protect
from gpuwatchd.decide.verdict import (
    SETTLING,
    STATE_UNREAD,
    UNREADABLE,
    GpuVerdict,
    NodeVerdict,
    OnceStep,
    Reason,
    cannot_tell,
    judge,
    lost_state,
    once_progress,
    unread_verdict,
)
from tests.support.migsnap import Inst, with_mig
from tests.support.snapshots import HostBuilder, cg_slurm, cg_unit, gpu_uuid
from tests.support.verdictcases import LEAK, POLICY, ROOTS_PERSISTENCED


def verdict_of(
    snapshot: Snapshot,
    policy: Policy = POLICY,
    *,
    ended: frozenset[str] = frozenset(),
    extra: tuple[Finding, ...] = (),
) -> NodeVerdict:
    if ended:  # the scheduler said these jobs ended, after every process here started
        snapshot = replace(snapshot, handovers=dict.fromkeys(ended, 10**12))
    assessment = assess(snapshot, AssessState(boot_id=snapshot.boot_id), policy.detection)
    if extra:
        assessment = replace(assessment, findings=assessment.findings + extra)
    return judge(snapshot, assessment, policy)


def states(verdict: NodeVerdict) -> list[str]:
    return [g.state.value for g in verdict.gpus]


def kinds(gpu: GpuVerdict) -> list[str]:
    return [r.kind for r in gpu.reasons]


def blockers(gpu: GpuVerdict) -> list[int | None]:
    return [b.pid for b in gpu.reset_blockers]


def two_gpus() -> HostBuilder:
    return HostBuilder().gpu(0).gpu(1)


def orphaned_worker() -> HostBuilder:
    """The trainer (200) died, NVML still lists it; its forked worker (201) holds GPU 0."""
    return (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .gpu(1)
        .proc(201, ppid=200, pgid=200, sid=200, holds={0}, uvm=True)
        .nvml(0, 200, used=LEAK)
    )


# --- what is never dirt -------------------------------------------------------------------------


def test_idle_gpus_are_clean_with_nothing_to_say() -> None:
    verdict = verdict_of(two_gpus().build())
    assert states(verdict) == ["clean", "clean"]
    assert verdict.clean is True
    assert all(not g.reasons and not g.reset_blockers for g in verdict.gpus)


@pytest.mark.parametrize("via", ["fd", "map", "both"])
def test_a_monitor_on_every_gpu_makes_none_dirty_and_blocks_each_ones_reset(via: str) -> None:
    """gpustat, `nvidia-smi -l`, an exporter: nvidiactl and every GPU node, no nvidia-uvm, no
    memory. Assess keeps a hidden_holder finding on its first GPU; the verdict is per GPU."""
    snapshot = two_gpus().proc(900, comm="gpustat", holds={0, 1}, via=via, uvm=False).build()
    verdict = verdict_of(snapshot)
    assert states(verdict) == ["clean", "clean"]
    for gpu in verdict.gpus:
        assert blockers(gpu) == [900]
        assert "management client" in gpu.reset_blockers[0].text
        assert gpu.reset_blockers[0].kind == "management"


def test_a_monitor_holding_only_nvidiactl_blocks_every_reset_and_dirties_nothing() -> None:
    snapshot = two_gpus().proc(900, comm="gpustat", holds=set(), ctl=True).build()
    verdict = verdict_of(snapshot)
    assert states(verdict) == ["clean", "clean"]
    assert [blockers(g) for g in verdict.gpus] == [[900], [900]]


def test_infrastructure_is_neither_dirt_nor_a_reset_blocker_here() -> None:
    """The reset procedure stops infrastructure itself (persistence mode off, before hooks)."""
    snapshot = (
        two_gpus()
        .proc(50, **ROOTS_PERSISTENCED, holds={0, 1}, uvm=False)
        .proc(51, comm="nv-hostengine", uid=0, cgroup=cg_unit("nvidia-dcgm.service"), holds={0, 1})
        .build()
    )
    verdict = verdict_of(snapshot)
    assert states(verdict) == ["clean", "clean"]
    assert [blockers(g) for g in verdict.gpus] == [[], []]


def test_a_users_look_alike_of_infrastructure_is_judged_as_any_process() -> None:
    """Infrastructure only from facts a user cannot forge (floor.py): a user's program named
    nvidia-persistenced is a management client here — no dirt, but it would block a reset."""
    snapshot = (
        two_gpus()
        .proc(52, comm="nvidia-persistenced", exe="/home/u/nvidia-persistenced",
              exe_trusted=False, holds={0}, uvm=False)
        .build()
    )  # fmt: skip
    verdict = verdict_of(snapshot)
    assert states(verdict) == ["clean", "clean"]
    assert [blockers(g) for g in verdict.gpus] == [[52], []]


def test_a_live_job_is_no_dirt_but_would_block_a_reset() -> None:
    snapshot = (
        HostBuilder()
        .gpu(0)
        .gpu(1, allocated=LEAK + 2 * MIB)
        .proc(300, holds={0, 1}, uvm=True, cgroup=cg_slurm("7"))
        .proc(301, ppid=300, holds={0, 1}, uvm=True)
        .nvml(1, 300, used=LEAK)
        .build()
    )
    verdict = verdict_of(snapshot)
    assert states(verdict) == ["clean", "clean"]
    assert [blockers(g) for g in verdict.gpus] == [[300, 301], [300, 301]]
    assert "worker of PID 300" in verdict.gpus[1].reset_blockers[1].text


def test_roots_program_run_by_a_user_in_a_slurm_job_is_that_jobs_process() -> None:
    """Issue 34, finding 3. Before: `/usr/bin/nvidia-smi` (CUDA code under it with LD_PRELOAD)
    run by a user in `system.slice/slurmstepd.scope/job_*` was infrastructure: no blocker,
    and the memory its context holds no live holder's."""
    snapshot = (
        HostBuilder()
        .gpu(0, allocated=LEAK + 2 * MIB)
        .proc(300, comm="nvidia-smi", exe="/usr/bin/nvidia-smi", exe_trusted=True,
              uid=1001, holds={0}, uvm=True, cgroup=cg_slurm("7"))
        .nvml(0, 300, used=LEAK)
        .build()
    )  # fmt: skip
    verdict = verdict_of(snapshot)
    assert [blockers(g) for g in verdict.gpus] == [[300]]
    assert verdict.gpus[0].reset_blockers[0].kind != "management"


JUPYTER = "jupyter@bob.service"


def leftover_kernel() -> HostBuilder:
    """A notebook kernel whose unit has ended (the scheduler said so) while it still holds
    both GPUs with CUDA: ``abandoned``, dirt on both."""
    return two_gpus().proc(
        910,
        comm="notebook",
        cmdline=("notebook", "--port", "8888"),
        user="bob",
        cgroup=cg_unit(JUPYTER),
        holds={0, 1},
        uvm=True,
    )


@pytest.mark.parametrize(
    "protect",
    [
        Protect(commands=(re.compile(r"^notebook"),)),
        Protect(users=("bob",)),
        Protect(units=("jupyter*.service",)),
        Protect(cgroups=("/system.slice/jupyter*",)),
    ],
)
def test_a_process_protect_names_never_makes_a_gpu_dirty(protect: Protect) -> None:
    ended = frozenset({f"unit:{JUPYTER}"})
    plain = verdict_of(leftover_kernel().build(), ended=ended)
    assert states(plain) == ["dirty", "dirty"]
    assert [kinds(g) for g in plain.gpus] == [["abandoned"], ["abandoned"]]
    protected = verdict_of(leftover_kernel().build(), replace(POLICY, protect=protect), ended=ended)
    assert states(protected) == ["clean", "clean"]
    for gpu in protected.gpus:
        assert blockers(gpu) == [910]
        assert gpu.reset_blockers[0].kind == "protected"
        assert "abandoned" in gpu.reset_blockers[0].text


def test_an_unknown_fact_never_counts_as_protected() -> None:
    builder = leftover_kernel().change(910, cmdline=None)
    policy = replace(POLICY, protect=Protect(commands=(re.compile("notebook"),)))
    ended = frozenset({f"unit:{JUPYTER}"})
    assert states(verdict_of(builder.build(), policy, ended=ended)) == ["dirty", "dirty"]


def test_a_process_that_only_initialised_cuda_blocks_a_reset_and_is_no_dirt() -> None:
    """A hidden holder (nvidia-uvm, the GPUs' nodes, no context) that nothing ties to memory
    left behind: a notebook that asked for the device count. Memory left behind would be dirt
    of its own (the next test)."""
    verdict = verdict_of(leftover_kernel().build())
    assert states(verdict) == ["clean", "clean"]
    for gpu in verdict.gpus:
        assert [(b.kind, b.pid) for b in gpu.reset_blockers] == [("hidden", 910)]


def test_memory_no_live_process_accounts_for_is_dirt_even_beside_a_hidden_holder() -> None:
    verdict = verdict_of(leftover_kernel().gpu(0, allocated=LEAK).build())
    assert states(verdict)[0] == "dirty"
    assert "unaccounted_memory" in kinds(verdict.gpus[0])


def test_the_likely_heir_of_a_leak_from_before_gpuwatchd_watched_is_dirt() -> None:
    heir = Finding(
        kind=FindingKind.HIDDEN_HOLDER,
        gpu=gpu_uuid(0),
        pid=910,
        start_ticks=10_000 + 910 * 7,
        reason="likely heir of the memory",
        actionable=False,
        evidence={"likely_heir": True, "gpus": [gpu_uuid(0)]},
    )
    verdict = verdict_of(two_gpus().proc(910, holds={0}, uvm=True).build(), extra=(heir,))
    assert states(verdict) == ["dirty", "clean"]
    assert "hidden_holder" in kinds(verdict.gpus[0])


def test_a_holder_the_orphan_rule_cannot_decide_is_unknown() -> None:
    """Its relation to the live owner is unknown (a session column unreadable)."""
    snapshot = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(300, holds={0}, uvm=True, cgroup=None)
        .nvml(0, 300, used=LEAK)
        .proc(920, ppid=None, pgid=None, sid=None, cgroup=None, holds={0}, uvm=True)
        .build()
    )
    gpu = verdict_of(snapshot).gpus[0]
    assert gpu.state is Cleanliness.UNKNOWN
    assert [(r.kind, r.pid) for r in gpu.reasons] == [("unknown_holder", 920)]


def test_protect_gpus_is_not_a_verdict_on_what_holds_them() -> None:
    """``protect.gpus`` means "never act here", not "what is left here is fine"."""
    policy = replace(POLICY, protect=Protect(gpus=(gpu_uuid(0),)))
    assert states(verdict_of(orphaned_worker().build(), policy))[0] == "dirty"


# --- what is dirt -------------------------------------------------------------------------------


def test_an_orphan_and_its_dead_owner_listed_make_its_gpu_dirty_and_only_that_one() -> None:
    verdict = verdict_of(orphaned_worker().build())
    assert states(verdict) == ["dirty", "clean"]
    assert kinds(verdict.gpus[0]) == ["dead_process", "orphaned", "unaccounted_memory"]
    assert [r.pid for r in verdict.gpus[0].reasons] == [200, 201, None]


def test_a_dead_owner_still_listed_is_dirt_until_the_driver_drops_it() -> None:
    """The driver tears a context down a moment after its last holder exits: until then NVML
    lists the dead PID with its memory. The GPU is not clean, and that settles by itself."""
    snapshot = HostBuilder().gpu(0, allocated=LEAK).nvml(0, 200, used=LEAK).build()
    verdict = verdict_of(snapshot)
    assert kinds(verdict.gpus[0]) == ["dead_process", "ghost_memory"]
    assert {"dead_process", "ghost_memory"} <= SETTLING
    torn_down = verdict_of(HostBuilder().gpu(0).build())
    assert torn_down.clean is True


def test_ghost_memory_is_dirt() -> None:
    verdict = verdict_of(HostBuilder().gpu(0, allocated=LEAK).gpu(1).build())
    assert states(verdict) == ["dirty", "clean"]
    assert kinds(verdict.gpus[0]) == ["ghost_memory"]


def test_ghost_memory_beside_a_monitor_is_dirt_a_reset_frees_and_the_monitor_blocks() -> None:
    """A monitor (gpustat: the GPU's node, no nvidia-uvm, no context) holds no memory: what
    no live process owns is ghost_memory beside it, as beside dcgm-exporter (dirty, and a
    reset frees it); the monitor is named as what would block that reset, never as dirt."""
    snapshot = (
        HostBuilder()
        .gpu(0, allocated=600 * MIB)
        .proc(900, comm="gpustat", holds={0}, uvm=False)
        .build()
    )
    verdict = verdict_of(snapshot)
    assert kinds(verdict.gpus[0]) == ["ghost_memory"]
    assert "600 MiB allocated" in verdict.gpus[0].reasons[0].text
    assert blockers(verdict.gpus[0]) == [900]


def test_memory_not_back_is_dirt_even_when_a_targeted_scan_keeps_it_from_ghost_detection() -> None:
    """A targeted holder scan keeps assess from calling leftover memory ghost_memory; the
    memory is still not back."""
    builder = HostBuilder().gpu(0, allocated=600 * MIB)
    builder.scan_mode = "targeted"
    verdict = verdict_of(builder.build())
    assert kinds(verdict.gpus[0]) == ["leftover_memory"]
    assert "600 MiB allocated" in verdict.gpus[0].reasons[0].text


def test_memory_within_the_margin_of_the_baseline_is_clean() -> None:
    margin = Detection().default_baseline + Detection().ghost_margin
    assert verdict_of(HostBuilder().gpu(0, allocated=margin).build()).clean is True
    assert verdict_of(HostBuilder().gpu(0, allocated=margin + MIB).build()).clean is False


def test_a_live_jobs_memory_is_its_own() -> None:
    snapshot = (
        HostBuilder().gpu(0, allocated=LEAK).proc(300, holds={0}, uvm=True).nvml(0, 300).build()
    )
    snapshot_used = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(300, holds={0}, uvm=True)
        .nvml(0, 300, used=LEAK)
        .build()
    )
    assert verdict_of(snapshot_used).clean is True
    # 500 MiB charged, 1.2 GiB allocated: within the unaccounted margin of a live job.
    assert verdict_of(snapshot).clean is True


@pytest.mark.parametrize(
    ("gpu", "note"),
    [
        ({"api": "v1", "allocated": LEAK}, "v1 memory API"),
        ({"numa_node": 1, "allocated": LEAK}, "coherent memory"),
        ({"numa_unknown": True, "allocated": LEAK}, "coherent memory unknown"),
        ({"mig": True, "allocated": LEAK}, "MIG enabled"),
    ],
)
def test_memory_that_cannot_be_judged_is_noted_not_dirt(gpu: dict[str, object], note: str) -> None:
    snapshot = HostBuilder().gpu(0, **gpu).build()  # type: ignore[arg-type]
    if gpu.get("mig"):
        snapshot = with_mig(snapshot)  # its MIG instances read: none (unread is not clean)
    verdict = verdict_of(snapshot)
    assert verdict.clean is True
    assert any(note in n for n in verdict.gpus[0].notes)


def test_a_leftover_of_an_ended_job_is_dirt_on_every_gpu_it_holds() -> None:
    snapshot = two_gpus().proc(400, cgroup=cg_slurm("42"), holds={0, 1}, uvm=True).build()
    verdict = verdict_of(snapshot, ended=frozenset({"slurm:42"}))
    assert states(verdict) == ["dirty", "dirty"]
    assert [kinds(g) for g in verdict.gpus] == [["abandoned"], ["abandoned"]]


def test_a_stuck_holder_is_dirt_where_it_holds() -> None:
    snapshot = two_gpus().proc(500, state="D", holds={1}, uvm=True).build()
    verdict = verdict_of(snapshot)
    assert states(verdict) == ["clean", "dirty"]
    assert "stuck" in kinds(verdict.gpus[1])


def test_a_zombie_nvml_lists_is_dirt() -> None:
    snapshot = (
        HostBuilder().gpu(0, allocated=LEAK).proc(600, state="Z").nvml(0, 600, used=LEAK).build()
    )
    assert kinds(verdict_of(snapshot).gpus[0])[0] == "zombie"


@pytest.mark.parametrize(
    "kind", [FindingKind.RESET_REQUIRED, FindingKind.REBOOT_REQUIRED, FindingKind.DRAIN_REQUIRED]
)
def test_the_driver_asking_for_a_reset_reboot_or_drain_is_dirt(kind: FindingKind) -> None:
    health = Finding(kind=kind, gpu=gpu_uuid(1), pid=None, start_ticks=None, reason="Xid 95")
    verdict = verdict_of(two_gpus().build(), extra=(health,))
    assert states(verdict) == ["clean", "dirty"]
    assert kinds(verdict.gpus[1]) == [kind.value]


def test_a_lost_gpu_is_dirty() -> None:
    verdict = verdict_of(HostBuilder().gpu(0, lost=True).gpu(1).build())
    assert states(verdict) == ["dirty", "clean"]
    assert kinds(verdict.gpus[0])[0] == "lost"


# --- what is unknown (not clean either) -------------------------------------------------------


def test_an_unreadable_process_makes_every_gpu_unknown() -> None:
    snapshot = two_gpus().proc(700, unreadable=True).build()
    verdict = verdict_of(snapshot)
    assert states(verdict) == ["unknown", "unknown"]
    assert [kinds(g) for g in verdict.gpus] == [["unreadable"], ["unreadable"]]
    assert verdict.clean is False


def test_an_unreadable_infrastructure_process_is_no_unknown() -> None:
    snapshot = two_gpus().proc(700, **ROOTS_PERSISTENCED, unreadable=True).build()
    assert verdict_of(snapshot).clean is True


def test_an_unreadable_look_alike_of_infrastructure_is_unknown() -> None:
    """Only root's own program is excused: a user's process of that name whose files cannot
    be read may hold any GPU."""
    snapshot = two_gpus().proc(701, comm="nvidia-persistenced", unreadable=True).build()
    assert states(verdict_of(snapshot)) == ["unknown", "unknown"]


def test_a_holder_whose_role_is_unknown_is_not_clean() -> None:
    """A holder without process facts (it exited during the scan, or could not be read)."""
    snapshot = two_gpus().hold(800, {1}, uvm=True).build()
    verdict = verdict_of(snapshot)
    assert states(verdict) == ["clean", "unknown"]
    assert kinds(verdict.gpus[1]) == ["unknown_holder"]


def test_a_gpu_whose_processes_nvml_cannot_list_is_not_clean() -> None:
    verdict = verdict_of(HostBuilder().gpu(0, processes_readable=False).build())
    assert kinds(verdict.gpus[0]) == ["processes_unknown"]
    assert verdict.gpus[0].state is Cleanliness.UNKNOWN


def test_a_gpu_whose_mig_mode_cannot_be_read_is_not_clean() -> None:
    """Its processes may live in MIG instances the reading does not show: unknown, as a GPU
    whose process list could not be read, never clean beside instances still in use."""
    verdict = verdict_of(HostBuilder().gpu(0, mig=None).gpu(1).build())
    assert states(verdict) == ["unknown", "clean"]
    assert kinds(verdict.gpus[0]) == ["processes_unknown"]
    assert "MIG mode could not be read" in verdict.gpus[0].reasons[0].text


def _mig_unread(part: str) -> Snapshot:
    """MIG GPU 1 with two GPU instances, ``part`` of which could not be read."""
    snapshot = with_mig(two_gpus().build(), gpu=1, instances=[Inst(1), Inst(2, readable=False)])
    gpu = snapshot.nvml.gpus[1]
    devices = gpu.mig_devices or ()
    broken = {
        "processes": devices,
        "devices": None,
        "gi": (devices[0], replace(devices[1], gi=None, processes=())),
    }[part]
    if part != "processes":
        gpu = replace(gpu, mig_devices=broken)
    return replace(snapshot, nvml=replace(snapshot.nvml, gpus=(snapshot.nvml.gpus[0], gpu)))


@pytest.mark.parametrize("part", ["processes", "devices", "gi"])
def test_a_mig_gpu_whose_instances_cannot_all_be_read_is_not_clean(part: str) -> None:
    """An instance's process list, the MIG device list or a GPU instance id unread: processes
    may live in an instance not listed (the parent's list is empty to the unprivileged)."""
    verdict = verdict_of(_mig_unread(part))
    assert states(verdict) == ["clean", "unknown"]
    assert [(r.kind, r.pid) for r in verdict.gpus[1].reasons] == [("processes_unknown", None)]
    assert "MIG instances could not all be read" in verdict.gpus[1].reasons[0].text


def test_dirt_outranks_unknown() -> None:
    snapshot = orphaned_worker().proc(700, unreadable=True).build()
    gpu = verdict_of(snapshot).gpus[0]
    assert gpu.state is Cleanliness.DIRTY
    assert kinds(gpu)[-1] == "unreadable"


@pytest.mark.parametrize("namespaces", [False, None])
def test_memory_no_visible_process_holds_is_unknown_while_the_hosts_processes_are_unseen(
    namespaces: bool | None,
) -> None:
    """Outside the host PID namespace (False), or unable to tell (None), the scan does not see
    the host's processes and NVML's PIDs point elsewhere: memory no visible process holds, and
    a listed PID missing from /proc, prove no holder dead. Not dirty, not clean: unknown, and
    that is said first. An idle GPU is still clean, a lost one still dirty."""
    builder = HostBuilder(host_namespaces=namespaces).gpu(0, allocated=LEAK).nvml(0, 4242)
    verdict = verdict_of(builder.gpu(1).gpu(2, lost=True).build())
    assert states(verdict) == ["unknown", "clean", "dirty"]
    assert verdict.clean is False
    unseen = verdict.gpus[0]
    assert kinds(unseen) == ["unknown_holder", "dead_process", "ghost_memory"]
    assert unseen.reasons[0].pid is None
    assert "host PID/cgroup namespaces" in unseen.reasons[0].text
    assert kinds(verdict.gpus[2]) == ["lost"]


@pytest.mark.parametrize("namespaces", [False, None])
def test_while_the_hosts_processes_are_unseen_only_what_the_gpu_itself_says_is_dirt(
    namespaces: bool | None,
) -> None:
    """An orphan's owner missing from /proc may live on the host: unknown. The driver asking
    for a reset, or a MIG recovery left half done, is dirt whatever can be seen."""
    snapshot = replace(orphaned_worker().gpu(2).build(), host_namespaces=namespaces)
    assessment = assess(snapshot, AssessState(boot_id=snapshot.boot_id), POLICY.detection)
    health = _about(FindingKind.RESET_REQUIRED, gpu_uuid(0), None)
    assessment = replace(assessment, findings=(*assessment.findings, health))
    verdict = judge(snapshot, assessment, POLICY, unfinished={gpu_uuid(1): "half done"})
    assert states(verdict) == ["dirty", "dirty", "clean"]
    assert kinds(verdict.gpus[0]) == [
        "reset_required", "unknown_holder", "dead_process", "orphaned", "unaccounted_memory"
    ]  # fmt: skip
    assert kinds(verdict.gpus[1]) == ["mig_unfinished"]
    alone = verdict_of(snapshot)
    assert states(alone) == ["unknown", "clean", "clean"]


@pytest.mark.parametrize(
    ("reading", "why"),
    [
        (NvmlReading(available=False, error="driver not loaded"), "driver not loaded"),
        (NvmlReading(available=True, wedged=True), "did not answer"),
    ],
)
def test_without_nvml_nothing_can_be_judged(reading: NvmlReading, why: str) -> None:
    snapshot = replace(two_gpus().build(), nvml=reading)
    verdict = verdict_of(snapshot)
    assert verdict.gpus == ()
    assert verdict.clean is None
    assert why in (verdict.unavailable or "")
    assert verdict.to_json()["checked"] is False


def test_the_verdict_of_a_gpu_depends_on_that_gpu_alone() -> None:
    """A GPU's verdict is the same whatever else the node holds, so `check-clean --gpu N`
    answers GPU N as `check-clean` does."""
    quiet = verdict_of(two_gpus().proc(900, comm="gpustat", holds={0, 1}).build())
    busy = verdict_of(
        two_gpus()
        .proc(900, comm="gpustat", holds={0, 1})
        .proc(201, ppid=200, pgid=200, sid=200, holds={0}, uvm=True)
        .nvml(0, 200, used=LEAK)
        .gpu(0, allocated=LEAK)
        .build()
    )
    assert busy.gpus[0].state is Cleanliness.DIRTY
    assert busy.gpus[1] == quiet.gpus[1]


def test_the_json_form_says_state_reasons_and_blockers() -> None:
    verdict = verdict_of(orphaned_worker().proc(900, comm="gpustat", holds={1}).build())
    whole = verdict.to_json()
    assert whole["checked"] is True
    assert whole["clean"] is False
    gpus = whole["gpus"]
    assert isinstance(gpus, list)
    assert gpus[0]["state"] == "dirty"
    assert gpus[0]["uuid"] == gpu_uuid(0)
    assert gpus[1]["reset_blockers"][0]["pid"] == 900


# --- run --once ----------------------------------------------------------------------------------


def gpu_verdict(index: int, *reasons: str) -> GpuVerdict:
    return GpuVerdict(
        uuid=gpu_uuid(index),
        index=index,
        pci_bus_id=None,
        state=Cleanliness.DIRTY if reasons else Cleanliness.CLEAN,
        reasons=tuple(Reason(kind, 42, "why") for kind in reasons),
    )


@pytest.mark.parametrize(
    ("gpus", "busy", "step"),
    [
        ([gpu_verdict(0), gpu_verdict(1)], [], OnceStep.DONE),
        ([gpu_verdict(0), gpu_verdict(1)], ["orphaned:x: under way"], OnceStep.WAIT),
        # the driver still tears the dead context down
        ([gpu_verdict(0, "dead_process"), gpu_verdict(1)], [], OnceStep.WAIT),
        ([gpu_verdict(0, "ghost_memory")], [], OnceStep.WAIT),
        ([gpu_verdict(0, "leftover_memory")], [], OnceStep.WAIT),
        # a leftover nobody acts on keeps its dead owner listed: waiting changes nothing
        ([gpu_verdict(0, "dead_process", "orphaned")], [], OnceStep.STUCK),
        ([gpu_verdict(0, "hidden_holder"), gpu_verdict(1, "dead_process")], [], OnceStep.WAIT),
        ([gpu_verdict(0, "hidden_holder"), gpu_verdict(1, "lost")], [], OnceStep.STUCK),
        ([gpu_verdict(0, "reset_required")], ["ghost: under way"], OnceStep.WAIT),
    ],
)
def test_once_is_done_only_when_nothing_is_under_way_and_every_gpu_is_clean(
    gpus: list[GpuVerdict], busy: list[str], step: OnceStep
) -> None:
    got, left = once_progress(NodeVerdict(tuple(gpus)), busy)
    assert got is step
    assert left[: len(busy)] == busy
    assert len(left) == len(busy) + sum(1 for g in gpus if not g.clean)


# --- every caller asks the verdict --------------------------------------------------------------

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "gpuwatchd"
# The commands that answer "is this GPU clean?", and how each gets the verdict.
CALLERS = {
    "cli/check_clean.py": "verdict",  # ScanResult.verdict
    "cli/once.py": "once_progress",
    "daemon/lifecycle.py": "once_progress",  # run --once holding the lock; status via last_verdict
    "cli/scan.py": "judge",
    "engine/cycle.py": "judge",
}


def _names(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_callers_ask_the_verdict_and_do_not_weigh_finding_kinds(caller: str) -> None:
    names = _names(PACKAGE / caller)
    assert CALLERS[caller] in names
    assert "FindingKind" not in names, f"{caller} weighs finding kinds itself"


def test_no_module_but_the_verdict_keeps_its_own_list_of_dirty_kinds() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "verdict.py":
            continue
        if re.search(r"\bDIRTY_KINDS\b|def _dirty\b", path.read_text()):
            offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []


def test_status_shows_the_daemons_verdict_and_computes_none() -> None:
    names = _names(PACKAGE / "cli/status.py")
    assert "judge" not in names
    assert "FindingKind" not in names
    assert "verdict" in (PACKAGE / "cli/status.py").read_text()


def test_the_verdict_is_built_from_the_assessment_scan_shows() -> None:
    """judge takes the assessment (findings and holder roles) that ``scan`` prints."""
    import inspect

    assert list(inspect.signature(judge).parameters)[:3] == ["snapshot", "assessment", "policy"]
    assert inspect.signature(judge).parameters["assessment"].annotation in (
        "Assessment",
        Assessment,
    )


# --- the verdict as scan and status show it -------------------------------------------------------


def test_status_shows_the_verdict_the_daemon_published() -> None:
    from gpuwatchd.cli.status_text import render_text
    from tests.support.statusrig import run_describe, saved

    verdict = verdict_of(orphaned_worker().proc(900, comm="gpustat", holds={1}).build())
    result = run_describe(saved(verdict=verdict.to_json()))
    shown = result["verdict"]
    assert shown["clean"] is False
    assert [(g["index"], g["state"], g["kind"]) for g in shown["gpus"]] == [
        (0, "dirty", "dead_process"),
        (1, "clean", None),
    ]
    text = render_text(result)
    assert "GPUs:     1 of 2 clean for a new job" in text
    assert f"not clean: GPU 0 {gpu_uuid(0)}: dead_process" in text
    assert result["exit_code"] == 0  # a dirty GPU is the daemon's work, not a daemon problem
    assert run_describe(saved())["verdict"] is None  # a daemon that wrote none


def test_scan_reports_each_gpus_verdict_in_json_and_text() -> None:
    from gpuwatchd.cli.report import build_report
    from gpuwatchd.cli.report_text import render_text

    snapshot = orphaned_worker().proc(900, comm="gpustat", holds={1}).build()
    assessment = assess(snapshot, AssessState(boot_id=snapshot.boot_id), POLICY.detection)
    verdict = judge(snapshot, assessment, POLICY)
    report = build_report(
        snapshot,
        assessment.findings,
        assessment.roles,
        assessment.report_only,
        {},
        version="test",
        verdict=verdict,
    )
    assert report["verdict"] == {
        "checked": True,
        "error": None,
        "clean": False,
        "not_clean": [gpu_uuid(0)],
    }
    gpus = report["gpus"]
    assert isinstance(gpus, list)
    assert [g["verdict"]["state"] for g in gpus] == ["dirty", "clean"]
    text = render_text(report)
    assert "verdict  NOT CLEAN (dirty)" in text
    assert "verdict  clean: a new job may have it" in text
    assert "pid 900 (gpustat): management client" in text


def test_a_reset_the_driver_refused_as_in_use_leaves_the_gpu_dirty_and_run_once_stuck() -> None:
    """The driver's "in use" with no holder any scan found is a GPU-level ``hidden_holder``
    (assess, from plan's refusal): positive evidence that something still holds the GPU where
    no walk of /proc looks. That is dirt on that GPU alone, never excused as a mere reset
    blocker (there is no process to name), and since its reset is not tried again until
    something changes, ``run --once`` with nothing under way stops at once (exit 75)."""
    snapshot = HostBuilder().gpu(0, allocated=LEAK).gpu(1).build()
    refused = {gpu_uuid(0): {"gap": "driver_in_use", "incident": "ghost_memory:x"}}
    assessment = assess(
        snapshot, AssessState(boot_id=snapshot.boot_id), POLICY.detection, driver_refused=refused
    )
    verdict = judge(snapshot, assessment, POLICY)
    assert states(verdict) == ["dirty", "clean"]
    hidden = [r for r in verdict.gpus[0].reasons if r.kind == "hidden_holder"]
    assert [r.pid for r in hidden] == [None]
    assert "driver refused" in hidden[0].text
    assert [blockers(g) for g in verdict.gpus] == [[], []]
    step, left = once_progress(verdict, [])
    assert step is OnceStep.STUCK
    assert "hidden_holder" in left[0]


# --- the verdict's edges (each a gate make mutate found untested) ---------------------------


def test_memory_one_mib_past_the_margin_beside_a_holder_is_dirt_and_at_it_is_not() -> None:
    """Beside a targeted holder scan no idle baseline is learned (and no ghost_memory
    judged): the default baseline counts, and the margin itself is still clean."""
    at = Detection().default_baseline + Detection().ghost_margin
    beside = HostBuilder()
    beside.scan_mode = "targeted"
    assert verdict_of(beside.gpu(0, allocated=at).build()).clean is True
    over = verdict_of(beside.gpu(0, allocated=at + MIB).build())
    assert kinds(over.gpus[0]) == ["leftover_memory"]
    assert "above its default idle baseline" in over.gpus[0].reasons[0].text


@pytest.mark.parametrize(
    ("builder", "note"),
    [
        (
            HostBuilder().gpu(0, allocated=None).proc(900, comm="gpustat", holds={0}, uvm=False),
            "allocated memory unknown",
        ),
        (
            HostBuilder().gpu(0, allocated=3 * LEAK).proc(300, holds={0}, uvm=True)
            .nvml(0, 300, used=None),
            "a live owner's memory figure is unknown",
        ),
    ],
)  # fmt: skip
def test_memory_with_an_unknown_figure_is_noted_never_judged(
    builder: HostBuilder, note: str
) -> None:
    verdict = verdict_of(builder.build())
    assert verdict.clean is True
    assert any(note in n for n in verdict.gpus[0].notes)


def test_our_own_nvml_worker_listed_by_nvml_accounts_for_no_memory() -> None:
    builder = HostBuilder(self_pids=frozenset({4242}))
    builder.scan_mode = "targeted"  # no ghost_memory judged: the verdict's own memory check
    snapshot = builder.gpu(0, allocated=600 * MIB).nvml(0, 4242, used=600 * MIB).build()
    assert kinds(verdict_of(snapshot).gpus[0]) == ["leftover_memory"]


def test_a_lost_gpu_says_only_that_and_the_next_gpu_is_still_judged() -> None:
    verdict = verdict_of(HostBuilder().gpu(0, lost=True).gpu(1, processes_readable=False).build())
    assert [kinds(g) for g in verdict.gpus] == [["lost"], ["processes_unknown"]]
    assert states(verdict) == ["dirty", "unknown"]
    # Nothing else is said about a lost GPU, not even what unreadable processes may hold.
    unread = verdict_of(HostBuilder().gpu(0, lost=True).gpu(1).proc(700, unreadable=True).build())
    assert [kinds(g) for g in unread.gpus] == [["lost"], ["unreadable"]]


def test_a_gpu_whose_minor_number_is_unknown_is_unknown() -> None:
    verdict = verdict_of(HostBuilder().gpu(0, minor=None).build())
    assert kinds(verdict.gpus[0]) == ["unknown_holder"]
    assert verdict.gpus[0].state is Cleanliness.UNKNOWN


@pytest.mark.parametrize(("count", "more"), [(8, ""), (9, " and 1 more")])
def test_unreadable_processes_are_named_eight_at_most(count: int, more: str) -> None:
    builder = HostBuilder().gpu(0)
    for pid in range(700, 700 + count):
        builder.proc(pid, unreadable=True)
    (reason,) = verdict_of(builder.build()).gpus[0].reasons
    shown = ", ".join(str(pid) for pid in range(700, 708))
    assert reason.text.startswith(f"the fds/maps of PID(s) {shown}{more} could not be read")


def test_a_holder_whose_start_time_or_context_cannot_be_told_is_unknown_not_excused() -> None:
    """The orphan rule cannot decide for a holder whose start time is unknown, or while a GPU
    could not say who owns a context there: unknown, never a mere reset blocker."""
    no_start = verdict_of(two_gpus().proc(910, start=None, holds={0}, uvm=True).build())
    assert states(no_start) == ["unknown", "clean"]
    assert kinds(no_start.gpus[0]) == ["unknown_holder"]
    unseen = verdict_of(
        HostBuilder().gpu(0).gpu(1, processes_readable=False).proc(910, holds={0}, uvm=True).build()
    )
    assert states(unseen) == ["unknown", "unknown"]
    assert kinds(unseen.gpus[0]) == ["unknown_holder"]


def _about(kind: FindingKind, gpu: str | None, pid: int | None, **evidence: object) -> Finding:
    start = None if pid is None else 10_000 + pid * 7
    return Finding(kind=kind, gpu=gpu, pid=pid, start_ticks=start, reason=f"{kind.value} here",
                   evidence=evidence)  # fmt: skip


def test_a_leftover_holding_no_gpus_node_is_no_dirt_but_blocks_every_reset() -> None:
    """A finding about a process that holds only nvidiactl/nvidia-uvm names no GPU: it dirties
    none (the findings after it are still judged) and would block each one's reset."""
    builder = two_gpus().proc(400, holds=(), ctl=True, uvm=True)
    extra = (
        _about(FindingKind.ABANDONED, None, 400),
        _about(FindingKind.DEAD_PROCESS, gpu_uuid(1), 77),
    )
    verdict = verdict_of(builder.build(), extra=extra)
    assert states(verdict) == ["clean", "dirty"]
    assert kinds(verdict.gpus[1]) == ["dead_process"]
    assert blockers(verdict.gpus[0]) == [400]


def test_a_finding_about_a_gpu_this_poll_does_not_know_leaves_no_gpu_clean() -> None:
    verdict = verdict_of(two_gpus().build(), extra=(_about(FindingKind.ZOMBIE, "GPU-gone", 88),))
    assert states(verdict) == ["dirty", "dirty"]
    assert [kinds(g) for g in verdict.gpus] == [["zombie"], ["zombie"]]


def test_an_nvml_only_client_or_infrastructure_is_never_dirt_whatever_the_finding() -> None:
    """The excuse does not depend on the finding's kind: a process whose finding says it is an
    NVML-only client (even without a holder role), or root's own infrastructure."""
    # Root's persistenced holding no GPU node here, so it has no holder role to excuse it.
    builder = two_gpus().proc(901, holds={0}, uvm=False).proc(50, **ROOTS_PERSISTENCED)
    extra = (
        _about(FindingKind.ORPHANED, gpu_uuid(0), 99, nvml_only=True),
        _about(FindingKind.ORPHANED, gpu_uuid(1), 50),
    )
    verdict = verdict_of(builder.build(), extra=extra)
    assert states(verdict) == ["clean", "clean"]


@pytest.mark.parametrize(
    ("protect", "change"),
    [
        (Protect(users=("bob",)), {"user": None}),
        (Protect(units=("jupyter*.service",)), {"cgroup": None}),
        (Protect(cgroups=("/system.slice/jupyter*",)), {"cgroup": None}),
        (Protect(commands=(re.compile("--port"),)), {"cmdline": ("notebook", "x" * 5000)}),
    ],
    ids=["user-unknown", "unit-unknown", "cgroup-unknown", "command-longer-than-searched"],
)
def test_a_protect_entry_that_cannot_be_checked_excuses_no_dirt(
    protect: Protect, change: dict[str, Any]
) -> None:
    """Unknown refuses a target (targets.refusal) but names nothing protected: the leftover
    stays dirt."""
    ended = frozenset({f"unit:{JUPYTER}"})
    builder = leftover_kernel().change(910, **change)
    snapshot = replace(builder.build(), handovers=dict.fromkeys(ended, 10**12))
    if change.get("cgroup", True) is None:
        abandoned = _about(FindingKind.ABANDONED, gpu_uuid(0), 910, gpus=[gpu_uuid(0)])
        verdict = verdict_of(snapshot, replace(POLICY, protect=protect), extra=(abandoned,))
        assert states(verdict)[0] == "dirty"
        return
    verdict = verdict_of(snapshot, replace(POLICY, protect=protect))
    assert states(verdict) == ["dirty", "dirty"]


@pytest.mark.parametrize(
    ("forced", "reason", "lost"),
    [
        (True, f"{UNREADABLE} (moved to x)", f"{UNREADABLE} (moved to x)"),
        (False, f"{UNREADABLE} (moved to x)", None),  # the latch lifted: the reason stays
        (True, "kill cap reached", None),
        (True, None, None),
        (True, f"why: {UNREADABLE}", None),  # only a reason that begins so
    ],
)
def test_only_a_latch_on_a_saved_state_moved_aside_leaves_it_unknown(
    forced: bool, reason: str | None, lost: str | None
) -> None:
    assert lost_state(PlanState(forced_dry_run=forced, forced_reason=reason)) == lost


def test_while_the_saved_state_is_unknown_only_a_clean_gpu_becomes_unknown() -> None:
    dirt = Reason("orphaned", 7, "worker of a dead job")
    clean = GpuVerdict("GPU-a", 0, "0000:01:00.0", Cleanliness.CLEAN, notes=("n",))
    dirty = GpuVerdict("GPU-b", 1, None, Cleanliness.DIRTY, reasons=(dirt,))
    shown = unread_verdict(NodeVerdict((clean, dirty), unavailable="u"), "it is gone")
    assert shown.unavailable == "u"
    why = Reason(STATE_UNREAD, None, cannot_tell("it is gone"))
    assert shown.gpus == (replace(clean, state=Cleanliness.UNKNOWN, reasons=(why,)), dirty)
    assert cannot_tell("it is gone") == (
        "cannot tell whether the GPUs are clean: it is gone (a MIG recovery or reset the daemon "
        "left half done would not be seen)"
    )
