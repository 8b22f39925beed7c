"""What the holder pass tells an admin about each holder (decide/assess/holders.py), word for word.

Each row is a host over one or two polls and what ``assess`` must say about one holder: its
role, the note (which is also its finding's reason, as ``explain`` and the events show it), and
the findings it gets, on which GPU. A reason is what an admin acts on, so it is pinned exactly.
Also :func:`relation` of decide/assess/host_view.py, the orphan rule's "worker of a live owner".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from gpuwatchd.core.model import MIB, FindingKind, Snapshot
from gpuwatchd.decide.assess.host_view import HostView, relation
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.policy import Detection
from tests.support.orphancases import fd_family, fd_family_before, heir_host
from tests.support.snapshots import HostBuilder, cg_slurm, gpu_uuid

LEAK = 20 * 1024 * MIB
DEFAULT = Detection()
OPT_IN = dataclasses.replace(DEFAULT, orphans_without_history=True)
HIDDEN = "holds the GPU without a context; not explained by a live context owner"
NVML_ONLY = "NVML-only client (no nvidia-uvm): not a kill target, but it blocks a reset"


def run(
    snapshot: Snapshot, previous: AssessState | None = None, detection: Detection = DEFAULT
) -> Assessment:
    state = previous if previous is not None else AssessState(boot_id=snapshot.boot_id)
    return assess(snapshot, state, detection)


def told(result: Assessment, pid: int) -> tuple[str, str, list[tuple[str, int | None]]]:
    """(role, note, [(finding kind, GPU index)]) of ``pid``: its last role and its findings,
    each of whose reasons is that note (but a stuck or zombie process's own finding's)."""
    *_, role = [r for r in result.roles if r.pid == pid]  # the holder pass's, the last one
    findings = [f for f in result.findings if f.pid == pid]
    for finding in findings:
        if finding.kind not in (FindingKind.STUCK, FindingKind.ZOMBIE):
            assert finding.reason == role.note
    return role.role.value, role.note, [(f.kind.value, _index(f.gpu)) for f in findings]


def _index(uuid: str | None) -> int | None:
    """The index of the GPU that :func:`gpu_uuid` named ``uuid``."""
    return None if uuid is None else int(uuid.split("-")[1])


def two_polls(before: Snapshot, later: Snapshot, detection: Detection = DEFAULT) -> Assessment:
    return run(later, run(before, detection=detection).state, detection)


# --- one poll --------------------------------------------------------------------------------


def _infrastructure() -> Assessment:
    return run(
        HostBuilder()
        .gpu(0)
        .proc(960, comm="nvidia-persistenced", holds={0}, uid=0, user="root", exe_trusted=True)
        .build()
    )


def _zombie_leader() -> Assessment:
    return run(HostBuilder().gpu(0).proc(960, state="Z", holds={0}, uvm=True).nvml(0, 960).build())


def _uninterruptible() -> Assessment:
    return run(HostBuilder().gpu(0).proc(960, state="D", holds={0}, uvm=True).build())


def _ended_job() -> Assessment:
    snapshot = HostBuilder().gpu(0).proc(960, cgroup=cg_slurm("77"), holds={0}, uvm=True).build()
    return run(dataclasses.replace(snapshot, handovers={"slurm:77": 10**9}))


def _worker() -> Assessment:
    builder = HostBuilder().gpu(0).proc(800, holds={0}, uvm=True).nvml(0, 800)
    return run(builder.proc(960, ppid=800, holds={0}, uvm=True).build())


def _nvml_only(holds: set[int]) -> Callable[[], Assessment]:
    return lambda: run(HostBuilder().gpu(0).proc(960, holds=holds, ctl=True).build())


def _unattributed() -> Assessment:
    return run(HostBuilder().gpu(0).proc(960, uvm=True).build())


def _relation_unknown() -> Assessment:
    builder = HostBuilder().gpu(0).gpu(1).proc(800, holds={0}, uvm=True).nvml(0, 800)
    return run(builder.proc(960, sid=None, holds={1}, uvm=True).build())


def _start_unknown() -> Assessment:
    return run(HostBuilder().gpu(0).proc(960, start=None, holds={0}, uvm=True).build())


def _unseen_gpu() -> Assessment:
    builder = HostBuilder().gpu(0).gpu(1, processes_readable=False).gpu(2, lost=True)
    return run(builder.proc(960, holds={0}, uvm=True).build())


def _nothing_ties() -> Assessment:
    return run(HostBuilder().gpu(0).proc(960, holds={0}, uvm=True).build())


def _dead_group_leader() -> Assessment:
    builder = HostBuilder().gpu(0).gpu(1, allocated=LEAK).nvml(1, 600, used=LEAK)
    return run(builder.proc(960, pgid=600, sid=600, holds={0, 1}, uvm=True).build())


# --- two polls -------------------------------------------------------------------------------


def _unaccounted() -> Assessment:
    """960's parent 800 owned GPU 1 and exited; NVML lists nothing there now."""
    before = HostBuilder(monotonic=1000.0).gpu(0).gpu(1, allocated=LEAK)
    before.proc(800, holds={1}, uvm=True).nvml(1, 800, used=LEAK)
    before.proc(960, ppid=800, holds={0, 1}, uvm=True)
    later = HostBuilder(monotonic=1010.0).gpu(0).gpu(1, allocated=LEAK)
    later.proc(960, pgid=800, sid=800, holds={0, 1}, uvm=True)
    return two_polls(before.build(), later.build())


def _kcmp_heir(also: dict[int, bool] | None = None) -> Callable[[], Assessment]:
    """820 holds owner 800's own files (kcmp); 800 died (and 790 too, when kcmp said so)."""

    def assessed() -> Assessment:
        later = fd_family(1010.0).proc(820, ppid=1, pgid=700, sid=700, holds={0}, uvm=True)
        later.nvml(0, 800, used=LEAK).absent(790)
        return two_polls(fd_family_before(also), later.build())

    return assessed


def _own_files() -> Assessment:
    """960 holds GPU 0 (idle) and GPU 1, whose dead owner 800 was its parent; kcmp said its
    files were never 800's: a spawn worker, whose death frees none of 800's memory."""
    before = HostBuilder(monotonic=1000.0).gpu(0).gpu(1, allocated=LEAK)
    before.proc(800, holds={1}, uvm=True).nvml(1, 800, used=LEAK)
    before.proc(960, ppid=800, holds={0, 1}, uvm=True).sharing(960, 800, False)
    later = HostBuilder(monotonic=1010.0).gpu(0).gpu(1, allocated=LEAK).nvml(1, 800, used=LEAK)
    later.proc(960, pgid=800, sid=800, holds={0, 1}, uvm=True)
    return two_polls(before.build(), later.build())


def _likely_heir(detection: Detection) -> Callable[[], Assessment]:
    """4121 lost its session leader 4100; it holds GPU 0 (idle) and GPU 1 (a leak nobody owns)."""

    def assessed() -> Assessment:
        before = heir_host(1000.0, owners_alive=True).build()
        return two_polls(before, heir_host(1010.0, owners_alive=False).build(), detection)

    return assessed


_HEIR = "likely heir of the 20480 MiB allocated on GPU 1 that no live context owner accounts for"


@pytest.mark.parametrize(
    ("case", "pid", "role", "note", "findings"),
    [
        (_infrastructure, 960, "management", "infrastructure (never a target)", []),
        (_zombie_leader, 960, "context_owner", "zombie leader; live threads", [("zombie", 0)]),
        (_uninterruptible, 960, "stuck", "uninterruptible sleep (D)", [("stuck", 0)]),
        (_ended_job, 960, "hidden",
         "its job slurm:77 has ended while it still holds the GPU (the scheduler said so after "
         "it started)", [("abandoned", 0)]),
        (_worker, 960, "worker", "worker of PID 800 (same sid 800)", []),
        (_nvml_only({0}), 960, "management", NVML_ONLY, [("hidden_holder", 0)]),
        (_nvml_only(set()), 960, "management", NVML_ONLY, []),
        (_unattributed, 960, "hidden",
         "holds nvidiactl/nvidia-uvm but no GPU's device file: cannot be attributed",
         [("hidden_holder", None)]),
        (_relation_unknown, 960, "hidden",
         f"{HIDDEN}; its relation to live owners is unknown (PID 800: unknown sid)",
         [("hidden_holder", 1)]),
        (_start_unknown, 960, "hidden", f"{HIDDEN}; its start time is unknown",
         [("hidden_holder", 0)]),
        (_unseen_gpu, 960, "hidden",
         f"{HIDDEN}; GPU(s) 1, 2 could not say whether it owns a context there",
         [("hidden_holder", 0)]),
        (_nothing_ties, 960, "hidden", f"{HIDDEN}; nothing ties it to a dead owner",
         [("hidden_holder", 0)]),
        (_dead_group_leader, 960, "orphaned",
         "inherited GPU 1 from dead owner PID 600 (process group); owns no context and no live "
         "owner explains it", [("orphaned", 1)]),
        (_unaccounted, 960, "orphaned",
         "holds GPU 1, whose 20480 MiB allocated no live context owner accounts for; owns no "
         "context anywhere", [("orphaned", 1)]),
        (_kcmp_heir(), 820, "orphaned",
         "holds GPU 0 through open files of dead owner PID 800 (kcmp, recorded while it lived); "
         "owns no context anywhere and no live context owner is its ancestor or descendant",
         [("orphaned", 0)]),
        (_kcmp_heir({790: True}), 820, "orphaned",
         "holds GPU 0 through open files of dead owner PID 790 (kcmp, recorded while it lived); "
         "owns no context anywhere and no live context owner is its ancestor or descendant",
         [("orphaned", 0)]),
        (_own_files, 960, "hidden",
         "holds GPU 1 only through files it opened itself (kcmp: none is PID 800's, a "
         "spawn/forkserver worker): killing it frees none of that owner's memory",
         [("hidden_holder", 1)]),
        (_likely_heir(DEFAULT), 4121, "hidden",
         f"{_HEIR}: its session leader PID 4100 is gone, but gpuwatchd never saw that owner "
         "alive (a leak from before it watched); check it and kill PID 4121 by hand, or set "
         "detection.orphans_without_history: true", [("hidden_holder", 1)]),
        (_likely_heir(OPT_IN), 4121, "orphaned",
         f"{_HEIR}: its session leader PID 4100 is gone and it owns no context anywhere "
         "(detection.orphans_without_history)", [("orphaned", 1)]),
    ],
)  # fmt: skip
def test_each_holder_is_told_its_role_and_the_exact_reason_on_the_gpu_it_concerns(
    case: Callable[[], Assessment],
    pid: int,
    role: str,
    note: str,
    findings: list[tuple[str, int | None]],
) -> None:
    assert told(case(), pid) == (role, note, findings)


# --- relation: whether two processes belong together -------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (960, 960, (True, "same process")),  # even with every column of it unknown
        (960, 970, (None, "unknown sid, pgid, cgroup, process tree")),
        (980, 990, (False, "unrelated")),
        (990, 991, (True, "same sid 990")),
    ],
)
def test_relation_of_a_process_to_itself_needs_no_column(
    a: int, b: int, expected: tuple[bool | None, str]
) -> None:
    builder = HostBuilder().proc(960, ppid=None, pgid=None, sid=None, cgroup=None)
    builder.proc(970, ppid=None, pgid=None, sid=None, cgroup=None)
    builder.proc(980).proc(990).proc(991, ppid=990)
    host = HostView(builder.build())
    assert relation(host, host.procs[a], host.procs[b]) == expected


# --- memory: ghost and unaccounted (decide/assess/memory.py) ----------------------------------

BASE = DEFAULT.default_baseline
MARGIN = DEFAULT.ghost_margin


def memory_told(result: Assessment) -> tuple[list[str], list[tuple[str, str, int | None]]]:
    """GPU 0's notes, and its GPU-level findings as (kind, reason, memory)."""
    findings = [(f.kind.value, f.reason, f.memory) for f in result.findings if f.pid is None]
    return list(result.notes.get(gpu_uuid(0), ())), findings


def test_ghost_memory_names_its_figures_and_the_dead_pids_nvml_still_lists() -> None:
    result = run(HostBuilder().gpu(0, allocated=LEAK).nvml(0, 1900).nvml(0, 1901).build())
    reason = (
        "GPU 0 has 20480 MiB allocated, 20416 MiB above its default idle baseline, and no live "
        "process holds it"
    )
    assert memory_told(result) == ([], [("ghost_memory", reason, LEAK - BASE)])
    (ghost,) = [f for f in result.findings if f.kind is FindingKind.GHOST_MEMORY]
    assert ghost.evidence == {
        "allocated": LEAK,
        "baseline": BASE,
        "baseline_learned": False,
        "margin": MARGIN,
        "memory_api": "v2",
        "dead_pids": [1900, 1901],
        "monitors": [],
    }


@pytest.mark.parametrize(
    ("gpu", "notes", "ghost"),
    [
        ({"allocated": BASE + MARGIN}, [], False),  # a dead PID listed: no baseline is learned
        ({"allocated": BASE + MARGIN + 1}, [], True),
        ({"allocated": LEAK, "minor": None},
         ["20416 MiB above baseline but not ghost: its minor number is unknown, so its holders "
          "cannot be found"], False),
        ({"allocated": LEAK, "processes_readable": False},
         ["20416 MiB above baseline but not ghost: its process list could not be read"], False),
    ],
)  # fmt: skip
def test_ghost_memory_needs_more_than_the_margin_and_a_gpu_whose_holders_can_be_known(
    gpu: dict[str, object], notes: list[str], ghost: bool
) -> None:
    builder = HostBuilder().gpu(0, **gpu)  # type: ignore[arg-type]
    told_notes, findings = memory_told(run(builder.nvml(0, 1900).build()))
    assert (told_notes, [kind for kind, _, _ in findings]) == (notes, ["ghost_memory"] * ghost)


@pytest.mark.parametrize("over", [0, 1])
def test_unaccounted_memory_is_what_live_owners_and_the_learned_baseline_leave_over_the_margin(
    over: int,
) -> None:
    """GPU 0 idled at 4 MiB (learned); then owner 2300 accounts for 500 MiB of its memory."""
    idle = run(HostBuilder().gpu(0, allocated=4 * MIB).build())
    margin = DEFAULT.unaccounted_margin
    allocated = 504 * MIB + margin + over
    builder = HostBuilder().gpu(0, allocated=allocated).proc(2300, holds={0}, uvm=True)
    result = run(builder.nvml(0, 2300, used=500 * MIB).build(), idle.state)
    unaccounted = [f for f in result.findings if f.kind is FindingKind.UNACCOUNTED_MEMORY]
    if not over:
        assert unaccounted == []
        return
    (finding,) = unaccounted
    assert (finding.reason, finding.memory) == (
        "GPU 0 has 1528 MiB allocated but its live context owners account for 500 MiB; 1024 MiB "
        "is unexplained",
        margin + 1,
    )
    assert finding.evidence == {
        "allocated": allocated,
        "accounted": 500 * MIB,
        "baseline": 4 * MIB,
        "margin": margin,
        "live_owners": [2300],
        "holders": [2300],
    }


@pytest.mark.parametrize(
    ("case", "pid", "evidence"),
    [
        (_ended_job, 960,
         {"job": "slurm:77", "ended_by": "the scheduler said so after it started"}),
        (_nvml_only({0}), 960, {"nvml_only": True, "undecided": None}),
        (_unattributed, 960, {"unattributed": True}),
        (_relation_unknown, 960, {"undecided": True}),
        (_start_unknown, 960, {"undecided": True}),
        (_unseen_gpu, 960, {"undecided": True}),
        (_nothing_ties, 960, {"undecided": None, "tie": None}),
        (_dead_group_leader, 960,
         {"tie": "dead_owner", "dead_pid": 600, "dead_status": "dead", "link": "process group",
          "memory": LEAK}),
        (_unaccounted, 960,
         {"tie": "unaccounted_memory", "former_owner": 800, "link": "recorded parent",
          "first_seen": 1000.0, "unaccounted_since": 1010.0, "allocated": LEAK}),
        (_kcmp_heir(), 820,
         {"tie": "inherited_files", "dead_pid": 800, "dead_status": "dead", "link": "kcmp"}),
        (_kcmp_heir({790: True}), 820,
         {"tie": "inherited_files", "dead_pid": 790, "dead_status": "dead", "link": "kcmp"}),
        (_own_files, 960, {"own_files": True, "owner": 800, "tie": None}),
        (_likely_heir(DEFAULT), 4121,
         {"tie": None, "likely_heir": True, "lost_leader": 4100, "link": "session",
          "allocated": LEAK, "unaccounted_since": 1000.0, "first_seen": 1000.0}),
        (_likely_heir(OPT_IN), 4121,
         {"tie": "lost_leader", "likely_heir": None, "lost_leader": 4100, "link": "session",
          "allocated": LEAK, "unaccounted_since": 1000.0, "first_seen": 1000.0}),
    ],
)  # fmt: skip
def test_each_holders_finding_carries_the_evidence_that_decided_it(
    case: Callable[[], Assessment], pid: int, evidence: dict[str, object]
) -> None:
    """``None``: the key is absent."""
    (finding,) = [f for f in case().findings if f.pid == pid]
    assert {key: finding.evidence.get(key) for key in evidence} == evidence


def test_a_reset_the_driver_refused_reports_a_hidden_holder_no_walk_of_proc_can_see() -> None:
    snapshot = HostBuilder().gpu(0).gpu(1).build()
    refused = {gpu_uuid(1): {"gap": "driver_in_use"}}
    state = AssessState(boot_id=snapshot.boot_id)
    result = assess(snapshot, state, DEFAULT, driver_refused=refused)
    (finding,) = result.findings
    assert (finding.kind, finding.gpu, finding.pid, finding.actionable, finding.evidence) == (
        FindingKind.HIDDEN_HOLDER, gpu_uuid(1), None, False, {"gap": "driver_in_use"}
    )  # fmt: skip
    assert finding.reason == (
        "the driver refused to reset GPU 1: in use by another client, yet no holder scan found "
        "one. Something holds the GPU where no walk of /proc looks: a file descriptor in flight "
        "in a unix-socket message (SCM_RIGHTS), a holder in another PID namespace or a VM, or a "
        "thread whose files could not be read. No reset of this GPU until its memory changes, "
        "the incident ends, the configuration is reloaded or `gpuwatchd resume "
        "--clear-latches` is run"
    )
