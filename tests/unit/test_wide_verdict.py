"""The verdict's gates the wide mutation run found untested (decide/verdict.py).

Each reason a GPU gets is said to users (check-clean, scan, status, run --once): its kind, PID
and text are the verdict's behaviour, asserted exactly here, case by case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from gpuwatchd.core.model import MIB, Finding, FindingKind, Snapshot
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.verdict import NodeVerdict, judge
from tests.support.migsnap import Inst, mig_uuid, with_mig
from tests.support.snapshots import HostBuilder, gpu_uuid
from tests.support.verdictcases import LEAK, POLICY, ROOTS_PERSISTENCED

Said = tuple[str, int | None, str]


def judged(
    snapshot: Snapshot, *, extra: tuple[Finding, ...] = (), baselines: dict[str, int] | None = None
) -> NodeVerdict:
    state = AssessState(boot_id=snapshot.boot_id, baselines=baselines or {})
    assessment = assess(snapshot, state, POLICY.detection)
    if extra:
        assessment = replace(assessment, findings=assessment.findings + extra)
    return judge(snapshot, assessment, POLICY)


def said(verdict: NodeVerdict, index: int = 0) -> list[Said]:
    return [(r.kind, r.pid, r.text) for r in verdict.gpus[index].reasons]


def about(kind: FindingKind, gpu: int, pid: int | None, **evidence: object) -> Finding:
    start = None if pid is None else 10_000 + pid * 7
    return Finding(kind=kind, gpu=gpu_uuid(gpu), pid=pid, start_ticks=start,
                   reason=f"{kind.value} here", evidence=evidence)  # fmt: skip


def lost(error: str | None) -> Snapshot:
    snapshot = HostBuilder().gpu(0, lost=True).build()
    gpus = tuple(replace(g, error=error) for g in snapshot.nvml.gpus)
    return replace(snapshot, nvml=replace(snapshot.nvml, gpus=gpus))


DEAD = about(FindingKind.DEAD_PROCESS, 0, 77)
MINOR_UNKNOWN = "its minor number is unknown: who holds its device file cannot be told"
NOT_LISTED = "listed by NVML but holds no device file of this GPU (PID reused?)"
ABOVE = "idle baseline that no live process accounts for"


def targeted() -> HostBuilder:
    return HostBuilder(scan_mode="targeted")


def infrastructure_past_thread_cap() -> Snapshot:
    """A user's unreadable process, and root's persistenced unreadable past the thread cap: only
    what the user's may hold is unknown, and no thread cap is said of it."""
    snapshot = (
        HostBuilder()
        .gpu(0)
        .proc(700, unreadable=True)
        .proc(50, **ROOTS_PERSISTENCED, unreadable=True)
        .build()
    )
    holders = replace(snapshot.holders, thread_tables_unread=frozenset({50}))
    return replace(snapshot, holders=holders)


def unreadable_with_many_threads() -> Snapshot:
    """Two processes whose files cannot be read, one of them past the scan's thread cap."""
    snapshot = HostBuilder().gpu(0).proc(700, unreadable=True).proc(701, unreadable=True).build()
    holders = replace(snapshot.holders, thread_tables_unread=frozenset({701}))
    return replace(snapshot, holders=holders)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        # A lost GPU: said first, before what its findings say, in NVML's words or ours.
        (
            lambda: judged(lost("GPU is lost"), extra=(DEAD,)),
            [("lost", None, "GPU is lost"), ("dead_process", 77, "dead_process here")],
        ),
        (lambda: judged(lost(None)), [("lost", None, "NVML reports the GPU lost")]),
        (
            lambda: judged(HostBuilder().gpu(0, processes_readable=False).build()),
            [("processes_unknown", None, "NVML could not list its processes")],
        ),
        (
            lambda: judged(HostBuilder().gpu(0, minor=None).build()),
            [("unknown_holder", None, MINOR_UNKNOWN)],
        ),
        (
            lambda: judged(HostBuilder().gpu(0).hold(800, {0}, uvm=True).build()),
            [("unknown_holder", 800, "no process facts (exited during the scan?)")],
        ),
        (
            lambda: judged(unreadable_with_many_threads()),
            [
                (
                    "unreadable",
                    700,
                    "the fds/maps of PID(s) 700, 701 could not be read (1 with more threads' own "
                    "fd tables than a scan reads): what they hold is unknown",
                )
            ],
        ),
        (
            lambda: judged(infrastructure_past_thread_cap()),
            [
                (
                    "unreadable",
                    700,
                    "the fds/maps of PID(s) 700 could not be read: what they hold is unknown",
                )
            ],
        ),
        # Memory no live process accounts for, beside none and beside a live one.
        (
            lambda: judged(targeted().gpu(0, allocated=LEAK).build()),
            [("leftover_memory", None, f"1200 MiB allocated: 1136 MiB above its default {ABOVE}")],
        ),
        (
            lambda: judged(
                targeted().gpu(0, allocated=LEAK).build(), baselines={gpu_uuid(0): 100 * MIB}
            ),
            [("leftover_memory", None, f"1200 MiB allocated: 1100 MiB above its learned {ABOVE}")],
        ),
        (
            lambda: judged(
                HostBuilder()
                .gpu(0, allocated=3 * LEAK)
                .proc(300, holds=(), uvm=False)
                .nvml(0, 300, used=LEAK)
                .build()
            ),
            [
                (
                    "leftover_memory",
                    None,
                    "3600 MiB allocated, 1200 MiB of it live processes': 2336 MiB above its "
                    f"default {ABOVE}",
                ),
                ("unknown_holder", 300, NOT_LISTED),
            ],
        ),
    ],
    ids=[
        "lost-first",
        "lost-without-words",
        "processes-unknown",
        "minor-unknown",
        "holder-without-facts",
        "unreadable-past-thread-cap",
        "unreadable",
        "memory-no-owner",
        "memory-learned-baseline",
        "memory-beside-live-owner",
    ],
)
def test_each_reason_a_gpu_gets_is_said_exactly(
    case: Callable[[], NodeVerdict], expected: list[Said]
) -> None:
    assert said(case()) == expected


MONITOR = (
    "management client: NVML-only client (no nvidia-uvm): not a kill target, but it blocks a reset"
)
HIDDEN = (
    "holds the GPU without a context; not explained by a live context owner; nothing ties it "
    "to a dead owner"
)


def two_gpus() -> HostBuilder:
    return HostBuilder().gpu(0).gpu(1)


@pytest.mark.parametrize(
    ("snapshot", "extra", "expected"),
    [
        # A monitor's finding is excused by its holder role on the finding's GPU ...
        (
            two_gpus().proc(900, comm="gpustat", holds={0}, uvm=False).build(),
            (about(FindingKind.ORPHANED, 0, 900),),
            [("management", 900, f"pid 900 (gpustat): {MONITOR}")],
        ),
        # ... or, holding only nvidiactl, by its role on the node.
        (
            two_gpus().proc(900, comm="gpustat", holds=(), ctl=True).build(),
            (about(FindingKind.ORPHANED, 0, 900),),
            [("management", 900, f"pid 900 (gpustat): {MONITOR}")],
        ),
        # A process without a name is named "?".
        (two_gpus().proc(910, comm="", holds={0, 1}, uvm=True).build(), (), [
            ("hidden", 910, f"pid 910 (?): {HIDDEN}")
        ]),
    ],
    ids=["monitor-on-its-gpu", "monitor-on-the-node", "hidden-without-a-name"],
)  # fmt: skip
def test_an_excused_holder_is_no_dirt_and_is_named_as_a_reset_blocker(
    snapshot: Snapshot, extra: tuple[Finding, ...], expected: list[Said]
) -> None:
    verdict = judged(snapshot, extra=extra)
    assert [g.state.value for g in verdict.gpus] == ["clean", "clean"]
    assert [(b.kind, b.pid, b.text) for b in verdict.gpus[0].reset_blockers] == expected


def test_memory_beside_a_live_owner_whose_figure_nvml_does_not_know_is_not_judged() -> None:
    """One live owner's figure unknown is enough: what the others hold says nothing of the rest."""
    snapshot = (
        HostBuilder()
        .gpu(0, allocated=3 * LEAK)
        .proc(300, holds=(), uvm=False)
        .proc(301, holds=(), uvm=False)
        .nvml(0, 300, used=LEAK)
        .nvml(0, 301, used=None)
        .build()
    )
    gpu = judged(snapshot).gpus[0]
    assert "leftover_memory" not in [r.kind for r in gpu.reasons]
    assert gpu.notes == ("memory not judged: a live owner's memory figure is unknown",)
    assert gpu.to_json()["notes"] == list(gpu.notes)  # what check-clean --json and status say


def test_each_gpus_verdict_names_it_as_nvml_does() -> None:
    verdict = judged(HostBuilder().gpu(0).gpu(1, allocated=LEAK).build())
    assert [(g.index, g.uuid, g.pci_bus_id, g.state.value) for g in verdict.gpus] == [
        (0, gpu_uuid(0), "00000000:10:00.0", "clean"),
        (1, gpu_uuid(1), "00000000:11:00.0", "dirty"),
    ]


def test_only_a_finding_about_a_holder_is_dirt_on_every_gpu_its_evidence_lists() -> None:
    """A dead owner NVML lists is dirt on its own GPU, whatever GPUs its evidence names; an
    orphan is dirt on every GPU whose device file it holds."""
    both = [gpu_uuid(0), gpu_uuid(1)]
    dead = about(FindingKind.DEAD_PROCESS, 1, 77, gpus=both)
    assert [g.state.value for g in judged(two_gpus().build(), extra=(dead,)).gpus] == [
        "clean",
        "dirty",
    ]
    orphan = about(FindingKind.ORPHANED, 1, 78, gpus=both)
    assert [g.state.value for g in judged(two_gpus().build(), extra=(orphan,)).gpus] == [
        "dirty",
        "dirty",
    ]


def test_a_mig_recovery_left_half_done_is_dirt_on_its_gpu() -> None:
    snapshot = two_gpus().build()
    assessment = assess(snapshot, AssessState(boot_id=snapshot.boot_id), POLICY.detection)
    why = "GPU instance 1 destroyed, not re-created"
    verdict = judge(snapshot, assessment, POLICY, unfinished={gpu_uuid(1): why, "GPU-gone": why})
    assert [said(verdict, i) for i in (0, 1)] == [[], [("mig_unfinished", None, why)]]


# --- the reset blockers, holder by holder -------------------------------------------------------

NODE_ONLY = "holds nvidiactl/nvidia-uvm only"


def blockers(verdict: NodeVerdict) -> list[list[Said]]:
    return [[(b.kind, b.pid, b.text) for b in g.reset_blockers] for g in verdict.gpus]


def test_our_own_and_dirty_holders_block_nothing_and_the_others_are_each_said() -> None:
    """PIDs in order: ours (5), root's persistenced (50: the reset stops it), a holder that is
    dirt here (600), an excused one (700, hidden), a live context owner (900, by its role).
    Only the last two are reset blockers."""
    snapshot = (
        HostBuilder(self_pids=frozenset({5}))
        .gpu(0, allocated=LEAK)
        .proc(5, comm="gpuwatchd", holds={0}, uvm=True)
        .proc(50, **ROOTS_PERSISTENCED, holds={0})
        .proc(600, comm="stray", holds={0}, uvm=True)
        .proc(700, comm="holder", holds={0}, uvm=True)
        .proc(900, comm="trainer", holds={0}, uvm=True)
        .nvml(0, 900, used=LEAK)
        .build()
    )
    verdict = judged(snapshot, extra=(about(FindingKind.ORPHANED, 0, 600),))
    assert said(verdict) == [("orphaned", 600, "orphaned here")]
    assert blockers(verdict) == [
        [
            ("hidden", 700, f"pid 700 (holder): {HIDDEN}"),
            (
                "context_owner",
                900,
                "pid 900 (trainer): context owner (a live job): owns a context (listed by NVML)",
            ),
        ]
    ]


def test_a_holder_of_no_gpu_takes_its_excuse_on_this_gpu_else_its_first_elsewhere() -> None:
    """Holders of nvidia-uvm alone: 650 and 700 are excused on GPU 0 only (GPU 1 says the same
    of each, not of the other), 710 on both GPUs with a different excuse on each."""
    snapshot = (
        two_gpus()
        .proc(650, comm="a", holds=(), uvm=True)
        .proc(700, comm="b", holds=(), uvm=True)
        .proc(710, comm="c", holds=(), uvm=True)
        .build()
    )
    extra = (
        about(FindingKind.HIDDEN_HOLDER, 0, 650),
        about(FindingKind.HIDDEN_HOLDER, 0, 700),
        about(FindingKind.HIDDEN_HOLDER, 0, 710),
        about(FindingKind.ORPHANED, 1, 710, nvml_only=True),
    )
    hidden = [("hidden", pid, f"pid {pid} ({name}): hidden_holder here") for pid, name in (
        (650, "a"), (700, "b"), (710, "c")
    )]  # fmt: skip
    unattributed = "holds nvidiactl/nvidia-uvm but no GPU's device file: cannot be attributed"
    assert blockers(judged(snapshot, extra=extra)) == [
        hidden,
        [*hidden[:2], ("management", 710, f"pid 710 (c): management client: {unattributed}")],
    ]


def test_a_holder_without_a_role_is_said_by_what_it_holds() -> None:
    """No roles and no findings but one about GPU 1: a holder of GPU 0 and 1 (720) is not
    excused on GPU 0 by it; holders without process facts are named "?"."""
    snapshot = (
        two_gpus()
        .proc(720, comm="d", holds={0, 1}, uvm=True)
        .hold(800, {0}, uvm=True)
        .hold(810, (), uvm=True)
        .build()
    )
    assessment = assess(snapshot, AssessState(boot_id=snapshot.boot_id), POLICY.detection)
    elsewhere = about(FindingKind.HIDDEN_HOLDER, 1, 720)
    verdict = judge(snapshot, replace(assessment, roles=(), findings=(elsewhere,)), POLICY)
    assert blockers(verdict)[0] == [
        ("holder", 720, "pid 720 (d): holds its device file"),
        ("holder", 800, "pid 800 (?): holds its device file"),
        ("holder", 810, f"pid 810 (?): {NODE_ONLY}"),
    ]


def test_a_holder_of_two_instances_of_another_mig_gpu_is_said_once_there() -> None:
    """GPU 0 whole and two GPU instances of MIG GPU 1: dirt once on each GPU, not once per
    instance (the reasons are what check-clean lists and counts)."""
    snapshot = with_mig(HostBuilder().gpu(0).gpu(1).build(), gpu=1, instances=[Inst(1), Inst(2)])
    held = [gpu_uuid(0), mig_uuid(1, 1), mig_uuid(1, 2)]
    verdict = judged(snapshot, extra=(about(FindingKind.ORPHANED, 0, 42, gpus=held),))
    assert said(verdict, 0) == [("orphaned", 42, "orphaned here")]
    assert said(verdict, 1) == [("orphaned", 42, "orphaned here")]


def _listed_on_an_instance(*, holds_it: bool, gis: tuple[int, ...] = (1,)) -> NodeVerdict:
    """PID 800 listed by NVML in GPU instances ``gis`` of MIG GPU 1, holding the first's files
    or none."""
    builder = HostBuilder().gpu(0).gpu(1).proc(800, ppid=1, holds={1} if holds_it else (), uvm=True)
    caps = {800: [(gis[0], 0)]} if holds_it else {}
    instances = [Inst(gi, processes=((800, 2 * MIB),)) for gi in gis]
    return judged(with_mig(builder.build(), gpu=1, instances=instances, caps=caps))


@pytest.mark.parametrize("gis", [(1,), (1, 2)])
def test_a_holder_whose_role_on_a_mig_instance_is_unknown_leaves_its_gpu_unknown(
    gis: tuple[int, ...],
) -> None:
    gpu = _listed_on_an_instance(holds_it=False, gis=gis).gpus[1]
    assert gpu.state.value == "unknown"
    assert [(r.kind, r.pid) for r in gpu.reasons] == [("unknown_holder", 800)]  # said once


def test_a_mig_instances_context_owner_blocks_its_gpus_reset_as_a_live_job() -> None:
    gpu = _listed_on_an_instance(holds_it=True).gpus[1]
    assert gpu.clean
    assert [r.text for r in gpu.reset_blockers] == [
        "pid 800 (python3): context owner (a live job): owns a context (listed by NVML)"
    ]


def test_a_holder_is_dirt_on_its_own_gpu_and_each_gpu_named_among_those_it_holds() -> None:
    """Its GPU, then each string among the GPUs its evidence says it holds (anything else
    there names no GPU); a kind that holds no device is dirt on its own GPU alone."""
    snapshot = HostBuilder().gpu(0).gpu(1).gpu(2).build()
    held: list[object] = [["GPU-x"], None, 7, gpu_uuid(1)]
    orphan = about(FindingKind.ORPHANED, 0, 42, gpus=held)
    verdict = judged(snapshot, extra=(orphan,))
    assert [bool(said(verdict, i)) for i in range(3)] == [True, True, False]
    dead = about(FindingKind.DEAD_PROCESS, 0, 43, gpus=[gpu_uuid(2)])
    verdict = judged(snapshot, extra=(dead,))
    assert [bool(said(verdict, i)) for i in range(3)] == [True, False, False]
