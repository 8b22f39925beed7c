"""The orphan rule's evidence, case by case (decide/assess/passes.py): what ties a holder to a dead
owner, and what must keep it a worker of a live one.

Each table row is a host over one or two polls, and what ``assess`` must conclude about one
holder: orphaned (a kill target), a worker of a live owner, or a hidden holder (reported only).
Unknown is never evidence: a broken process tree or an owner whose fate was not looked up
keeps the holder out of the kill path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from gpuwatchd.core.model import FindingKind, ProcessIdentity, Snapshot
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.policy import Detection
from tests.support.orphancases import (
    DEFAULT,
    LEAK,
    OPT_IN,
    fd_family,
    fd_family_before,
    heir_host,
    owner_and_worker,
    run,
)
from tests.support.snapshots import HostBuilder, cg_slurm, gpu_uuid


def verdict(result: Assessment, pid: int) -> tuple[str, dict[str, object]]:
    """("orphaned" / "hidden_holder" / ..., evidence) of ``pid``'s finding, or its role."""
    found = [f for f in result.findings if f.pid == pid]
    if found:
        (finding,) = found
        return finding.kind.value, dict(finding.evidence)
    roles = {(r.role.value, r.owner_pid) for r in result.roles if r.pid == pid}
    (role,) = roles
    return f"{role[0]} of {role[1]}" if role[1] is not None else role[0], {}


# --- kcmp: the holder holds an owner's own files; how that owner ended decides -------------------
#
# Launcher 700 leads the session; owner 800 (GPU 0) and rank 810 (GPU 1) are its children.
# 820 was the child of 815, a child of 800 that has exited, so 820 now has ppid 1 but is still
# in session 700, and kcmp found that its device files are 800's own (fd inheritance).


def _owner_alive(b: HostBuilder) -> None:
    b.proc(800, ppid=700, holds={0}, uvm=True).nvml(0, 800, used=LEAK)


def _owner_listed_dead(b: HostBuilder) -> None:
    b.nvml(0, 800, used=LEAK)


def _owner_zombie(b: HostBuilder) -> None:
    b.proc(800, ppid=700, state="Z").nvml(0, 800, used=LEAK)


def _owner_pid_reused(b: HostBuilder) -> None:
    b.proc(800, ppid=1, pgid=800, sid=800, start=99_999)


def _owner_absent(b: HostBuilder) -> None:
    b.absent(800)


def _owner_unknown(b: HostBuilder) -> None:
    pass  # not listed, not described, not looked up


def _owner_zombie_with_threads(b: HostBuilder) -> None:
    b.proc(800, ppid=700, state="Z", holds={0}, uvm=True).nvml(0, 800, used=LEAK)


@pytest.mark.parametrize(
    ("case", "owner", "expected", "dead_status"),
    [
        ("the owner lives on", _owner_alive, "worker of 800", None),
        ("NVML lists the owner dead", _owner_listed_dead, "orphaned", "dead"),
        ("NVML lists the owner as a zombie", _owner_zombie, "orphaned", "zombie"),
        ("the owner's PID names another process now", _owner_pid_reused, "orphaned", "reused"),
        ("the owner was looked up and does not exist", _owner_absent, "orphaned", "dead"),
        ("the owner's fate is unknown", _owner_unknown, "worker of 810", None),
        ("the owner is a zombie whose threads hold the GPU", _owner_zombie_with_threads,
         "worker of 800", None),
    ],
)  # fmt: skip
def test_a_holder_of_an_owners_own_files_is_its_heir_only_once_that_owner_is_known_dead(
    case: str, owner: Callable[[HostBuilder], None], expected: str, dead_status: str | None
) -> None:
    before = run(fd_family_before())
    later = fd_family(1010.0).proc(820, ppid=1, pgid=700, sid=700, holds={0}, uvm=True)
    owner(later)
    result = run(later.build(), before.state)
    kind, evidence = verdict(result, 820)
    assert kind == expected, case
    if dead_status is not None:
        assert (evidence["tie"], evidence["dead_pid"]) == ("inherited_files", 800), case
        assert evidence["dead_status"] == dead_status, case
    assert verdict(result, 810)[0] == "context_owner", case  # the live rank is never a finding


@pytest.mark.parametrize(
    ("case", "also", "expected"),
    [
        ("kcmp: the files are not another owner's", {790: False}, "orphaned"),
        ("kcmp: the files are also a live rank's own", {810: True}, "worker of 810"),
        ("kcmp: the files are also those of an owner whose fate is unknown", {790: True},
         "worker of 810"),
    ],
)  # fmt: skip
def test_a_holder_is_the_heir_of_dead_owners_only_when_no_other_owner_shares_its_files(
    case: str, also: dict[int, bool], expected: str
) -> None:
    """The dead owner's files are the holder's; if another owner, alive or of unknown fate,
    shares them too, killing the holder frees nothing: it is nobody's heir."""
    before = run(fd_family_before(also))
    later = fd_family(1010.0).proc(820, ppid=1, pgid=700, sid=700, holds={0}, uvm=True)
    later.nvml(0, 800, used=LEAK)  # the owner died
    kind, evidence = verdict(run(later.build(), before.state), 820)
    assert kind == expected, case
    if expected == "orphaned":
        assert (evidence["tie"], evidence["dead_pid"]) == ("inherited_files", 800), case


def test_a_holder_sharing_a_session_with_one_live_owner_and_descending_from_another_is_a_worker(
) -> None:  # fmt: skip
    """The heir of a dead owner shares a session with live rank 810, which does not count, but
    it descends from live owner 830: its worker."""
    before = run(fd_family_before())
    later = fd_family(1010.0).nvml(0, 800, used=LEAK)
    later.proc(830, ppid=700, holds={1}, uvm=True).nvml(1, 830, used=LEAK)
    later.proc(820, ppid=830, pgid=700, sid=700, holds={0}, uvm=True)
    assert verdict(run(later.build(), before.state), 820)[0] == "worker of 830"


@pytest.mark.parametrize("broken", ["the heir's parent", "the live rank's parent"])
def test_an_incomplete_process_tree_keeps_the_heir_a_worker_of_the_live_owner_in_its_session(
    broken: str,
) -> None:
    """Shared files of a dead owner make a holder its heir even beside a live owner of the same
    session, but only when the process tree proves the two unrelated: with an ancestor whose
    facts are missing, descent from the live owner cannot be ruled out."""
    before = run(fd_family_before())
    later = fd_family(1010.0).nvml(0, 800, used=LEAK)  # the owner died
    if broken == "the heir's parent":
        later.proc(820, ppid=830, pgid=700, sid=700, holds={0}, uvm=True)  # 830: no facts
    else:
        later.proc(820, ppid=1, pgid=700, sid=700, holds={0}, uvm=True)
        later.change(810, ppid=831)  # the live rank's parent is not described
    result = run(later.build(), before.state)
    assert verdict(result, 820)[0] == "worker of 810", broken


# --- a dead owner listed by NVML, beside live ones ------------------------------------------------


def test_a_dead_group_leader_listed_after_a_live_unrelated_job_is_still_found() -> None:
    snapshot = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(500, ppid=1, holds={0}, uvm=True)  # an unrelated live job, listed first
        .nvml(0, 500, used=LEAK // 2)
        .nvml(0, 600, used=LEAK // 2)  # the dead owner
        .proc(601, ppid=1, pgid=600, sid=600, holds={0}, uvm=True)
        .build()
    )
    kind, evidence = verdict(run(snapshot), 601)
    assert kind == "orphaned"
    assert (evidence["tie"], evidence["dead_pid"], evidence["link"]) == (
        "dead_owner", 600, "process group"
    )  # fmt: skip


def test_a_recorded_parent_whose_pid_now_names_a_live_job_is_no_dead_owner() -> None:
    """Parent 800 died and its PID went to an unrelated job that NVML lists alive: the holder
    is not tied to a dead owner through that PID (it is reported, never killed)."""
    before = (
        HostBuilder(monotonic=1000.0)
        .gpu(0, allocated=LEAK)
        .proc(700, ppid=1, pgid=700, sid=700)
        .proc(800, ppid=700, holds={0}, uvm=True)
        .nvml(0, 800, used=LEAK)
        .proc(801, ppid=800, holds={0}, uvm=True)
        .build()
    )
    first = run(before)
    assert verdict(first, 801)[0] == "worker of 800"
    later = (
        HostBuilder(monotonic=1010.0)
        .gpu(0, allocated=LEAK)
        .proc(800, ppid=1, pgid=800, sid=800, start=99_999, holds={0}, uvm=True)
        .nvml(0, 800, used=LEAK)
        .proc(801, ppid=1, pgid=700, sid=700, holds={0}, uvm=True)
        .build()
    )
    kind, _ = verdict(run(later, first.state), 801)
    assert kind == "hidden_holder"


def _owner_800_of_gpu0(worker_sid: int | None = None) -> Snapshot:
    """A poll before: process 800 owns GPU 0's memory (with ``worker_sid``, its child 801, a
    group leader in that session, holds GPU 0 too)."""
    builder = HostBuilder(monotonic=1000.0).gpu(0, allocated=LEAK)
    builder.proc(800, ppid=1, holds={0}, uvm=True).nvml(0, 800, used=LEAK)
    if worker_sid is not None:
        builder.proc(801, ppid=800, pgid=801, sid=worker_sid, holds={0}, uvm=True)
    return builder.build()


def test_a_zombie_leader_whose_threads_hold_the_gpu_is_no_dead_owner() -> None:
    """800 is a zombie leader, but its threads still hold GPU 0 (NVML lists it): a holder
    that recorded it as its parent is not tied to a dead owner by it."""
    first = run(_owner_800_of_gpu0(worker_sid=801))
    later = (
        HostBuilder(monotonic=1010.0)
        .gpu(0, allocated=LEAK)
        .proc(800, ppid=1, state="Z", holds={0}, uvm=True)
        .nvml(0, 800, used=LEAK)
        .proc(801, ppid=1, pgid=801, sid=801, holds={0}, uvm=True)
        .build()
    )
    result = run(later, first.state)
    assert verdict(result, 801)[0] == "hidden_holder"
    assert verdict(result, 800)[0] == "zombie"  # its parent must reap it


def test_a_holder_first_seen_in_the_poll_its_memory_lost_its_owner_is_the_heir() -> None:
    """The heir must have been seen no later than the moment the memory became unowned; the
    very same poll counts (the owner was seen owning GPU 0 the poll before)."""
    first = run(_owner_800_of_gpu0())
    orphaned = (
        HostBuilder(monotonic=1010.0)
        .gpu(0, allocated=LEAK)
        .proc(801, ppid=1, pgid=800, sid=800, holds={0}, uvm=True)
        .build()
    )
    kind, evidence = verdict(run(orphaned, first.state), 801)
    assert kind == "orphaned"
    assert (evidence["tie"], evidence["former_owner"]) == ("unaccounted_memory", 800)
    assert evidence["first_seen"] == evidence["unaccounted_since"] == 1010.0


def test_a_holder_whose_recorded_parent_pid_now_names_another_process_is_no_heir() -> None:
    """Owner 800 left GPU 0's memory and exited; its PID went to a new process, whose child 801
    opened the GPU in the same poll interval: the recorded parent 800 is that new process, not
    the former owner, so nothing ties 801 to the memory (reported, never killed)."""
    first = run(_owner_800_of_gpu0())
    reused = (
        HostBuilder(monotonic=1010.0)
        .gpu(0, allocated=LEAK)
        .proc(800, ppid=1, pgid=800, sid=800, start=99_999)
        .proc(801, ppid=800, pgid=800, sid=800, start=99_999 + 3, holds={0}, uvm=True)
        .build()
    )
    kind, evidence = verdict(run(reused, first.state), 801)
    assert kind == "hidden_holder", evidence


def _leaking(b: HostBuilder) -> HostBuilder:
    return b.gpu(0, allocated=LEAK)


@pytest.mark.parametrize(
    "unknown",
    [
        pytest.param(lambda b: b.gpu(0, allocated=LEAK, processes_readable=False), id="list"),
        pytest.param(lambda b: b.gpu(0, memory_known=False), id="memory"),
        pytest.param(lambda b: HostBuilder(monotonic=b.monotonic, wedged=True), id="nvml"),
    ],
)
def test_a_poll_that_cannot_tell_the_memory_unowned_keeps_since_when_it_was(
    unknown: Callable[[HostBuilder], HostBuilder],
) -> None:
    """Owner 800 died leaving GPU 0's memory to its worker 801; 802 joined its session later,
    so it cannot be the heir. A poll that cannot tell whether the memory is still unowned (its
    process list, its memory or NVML unread) ends nothing: 802 stays a hidden holder after it."""

    def poll(at: float, gpu: Callable[[HostBuilder], HostBuilder], *pids: int) -> HostBuilder:
        host = gpu(HostBuilder(monotonic=at))
        for pid in pids:
            host.proc(pid, ppid=1, pgid=pid, sid=800, holds={0}, uvm=True)
        return host

    state = run(_owner_800_of_gpu0(worker_sid=800)).state
    for at, gpu, pids in [(1010.0, _leaking, (801,)), (1020.0, _leaking, (801, 802)),
                          (1030.0, unknown, (801, 802))]:  # fmt: skip
        state = run(poll(at, gpu, *pids).build(), state).state
    result = run(poll(1040.0, _leaking, 801, 802).build(), state)
    assert verdict(result, 801)[0] == "orphaned"
    kind, evidence = verdict(result, 802)
    assert kind == "hidden_holder", evidence


# --- the likely heir of a leak from before the daemon watched ----------------------------------
#
# 4121 lost its session leader 4100 and holds GPU 0 (idle) and GPU 1 (20 GiB nobody owns).
# kcmp compared its files with two context owners on GPU 2 while they lived (4300, 4310).


@pytest.mark.parametrize(
    ("case", "answers", "heir"),
    [
        ("kcmp never answered", {}, True),
        ("kcmp: its files are nobody's", {4300: False, 4310: False}, False),
        ("kcmp: one of them shared its files", {4300: False, 4310: True}, True),
    ],
)
@pytest.mark.parametrize("detection", [DEFAULT, OPT_IN], ids=["default", "without-history"])
def test_the_likely_heir_is_never_a_holder_that_opened_its_own_files(
    case: str, answers: dict[int, bool], heir: bool, detection: Detection
) -> None:
    builder = heir_host(1000.0, owners_alive=True)
    for owner, shared in answers.items():
        builder.sharing(4121, owner, shared)
    first = run(builder.build(), detection=detection)
    result = run(heir_host(1010.0, owners_alive=False).build(), first.state, detection)
    kind, evidence = verdict(result, 4121)
    if not heir:
        assert kind == "hidden_holder", case
        assert "likely_heir" not in evidence, case
        assert "tie" not in evidence, case
    elif detection.orphans_without_history:
        assert kind == "orphaned", case
        assert (evidence["tie"], evidence["lost_leader"]) == ("lost_leader", 4100), case
    else:
        assert (kind, evidence["likely_heir"], evidence["lost_leader"]) == (
            "hidden_holder", True, 4100
        ), case  # fmt: skip
    if heir:
        assert evidence["allocated"] == LEAK, case  # GPU 1's memory, not idle GPU 0's


@pytest.mark.parametrize(("sid", "pgid"), [(0, 0), (0, 4100)])
def test_a_session_or_group_zero_is_never_a_lost_leader(sid: int, pgid: int) -> None:
    """PID 0 is no process: even reported absent it is nobody's lost leader."""
    builder = (
        HostBuilder(monotonic=1000.0)
        .gpu(0, allocated=LEAK)
        .proc(4121, ppid=1, pgid=pgid, sid=sid, holds={0}, uvm=True)
        .absent(0)
    )
    kind, evidence = verdict(run(builder.build(), detection=OPT_IN), 4121)
    assert kind == "hidden_holder"
    assert "likely_heir" not in evidence


# --- kcmp answers about two processes that had the owner's PID ---------------------------------


def test_one_shared_answer_about_the_owners_pid_is_enough_to_make_the_heir() -> None:
    """kcmp was asked about two processes with PID 800 (the PID was reused while the holder
    lived): one of them shared its files with the holder, so the holder does not count as one
    that opened its own files, and the memory its former owner left makes it the heir."""
    alive = owner_and_worker()
    first = run(alive)
    (holder,) = [i for i in first.state.inheritance if i.pid == 801]
    ((owner, shared),) = first.state.inheritance[holder]
    assert shared is False
    earlier_owner = ProcessIdentity(800, owner.start_ticks - 5)  # PID 800 before its reuse
    state = dataclasses.replace(
        first.state, inheritance={holder: ((earlier_owner, True), (owner, False))}
    )
    dead = (
        HostBuilder(monotonic=1010.0)
        .gpu(0, allocated=LEAK)  # nothing listed: the memory has no owner now
        .proc(801, ppid=1, pgid=800, sid=800, holds={0}, uvm=True)
        .build()
    )
    kind, evidence = verdict(run(dead, state), 801)
    assert kind == "orphaned"
    assert (evidence["tie"], evidence["former_owner"]) == ("unaccounted_memory", 800)
    own = dataclasses.replace(first.state, inheritance={holder: ((owner, False),)})
    kind, evidence = verdict(run(dead, own), 801)
    assert (kind, evidence["own_files"]) == ("hidden_holder", True)


# --- memory that no live owner accounts for ----------------------------------------------------


def _unowned(gpu: Callable[[HostBuilder], HostBuilder]) -> str:
    """The verdict on 801, whose recorded parent 800 owned GPU 0 and exited, given GPU 0 as
    ``gpu`` builds it in the second poll."""
    owned = (
        HostBuilder(monotonic=1000.0)
        .gpu(0, allocated=LEAK)
        .proc(800, ppid=1, holds={0}, uvm=True)
        .nvml(0, 800, used=LEAK)
        .proc(801, ppid=800, holds={0}, uvm=True)
        .build()
    )
    first = run(owned)
    later = gpu(HostBuilder(monotonic=1010.0)).proc(801, ppid=1, pgid=800, sid=800, holds={0},
                                                    uvm=True)  # fmt: skip
    return verdict(run(later.build(), first.state), 801)[0]


MARGIN = DEFAULT.ghost_margin
BASE = DEFAULT.default_baseline


@pytest.mark.parametrize(
    ("case", "gpu", "expected"),
    [
        ("memory above baseline and margin", lambda b: b.gpu(0, allocated=LEAK), "orphaned"),
        ("memory at baseline plus margin", lambda b: b.gpu(0, allocated=BASE + MARGIN),
         "hidden_holder"),
        ("memory one byte above", lambda b: b.gpu(0, allocated=BASE + MARGIN + 1), "orphaned"),
        ("allocated memory unknown", lambda b: b.gpu(0, allocated=None), "hidden_holder"),
        ("coherent memory keeps pages by design", lambda b: b.gpu(0, allocated=LEAK, numa_node=0),
         "hidden_holder"),
        ("coherent or not is unknown", lambda b: b.gpu(0, allocated=LEAK, numa_unknown=True),
         "hidden_holder"),
    ],
)  # fmt: skip
def test_memory_without_an_owner_ties_the_heir_only_when_known_and_above_the_margin(
    case: str, gpu: Callable[[HostBuilder], HostBuilder], expected: str
) -> None:
    assert _unowned(gpu) == expected, case


# --- roles, and what makes a finding actionable ----------------------------------------------


def test_roles_of_an_owner_its_worker_a_zombie_and_a_holder_without_facts() -> None:
    snapshot = (
        HostBuilder()
        .gpu(0)
        .gpu(1)
        .proc(800, ppid=1, holds={0, 1}, uvm=True)  # owns a context on GPU 0 only
        .nvml(0, 800)
        .proc(801, ppid=800, holds={1}, uvm=True)  # its worker, on GPU 1
        .proc(900, ppid=1, state="Z", holds={0}, uvm=True)  # a listed zombie: live threads
        .nvml(0, 900)
        .proc(901, ppid=1, state="Z", holds={1}, uvm=True)  # not listed
        .hold(902, {1}, uvm=True)  # no process facts: exited during the scan?
        .build()
    )
    roles = {(r.pid, r.gpu): (r.role.value, r.note) for r in run(snapshot).roles}
    assert roles[(800, gpu_uuid(0))] == ("context_owner", "owns a context (listed by NVML)")
    assert roles[(800, gpu_uuid(1))] == (
        "context_owner", "owns a context on another GPU; CUDA opens every visible GPU"
    )  # fmt: skip
    assert roles[(801, gpu_uuid(1))][0] == "worker"
    assert roles[(900, gpu_uuid(0))][0] == "context_owner"
    assert roles[(901, gpu_uuid(1))] == (
        "unknown", "zombie that still holds device files (live threads?)"
    )  # fmt: skip
    assert roles[(902, gpu_uuid(1))] == ("unknown", "no process facts (exited during the scan?)")


def test_a_listed_owner_whose_job_ended_is_abandoned_and_still_an_owner() -> None:
    snapshot = (
        HostBuilder()
        .gpu(0)
        .proc(800, ppid=1, cgroup=cg_slurm("77"), holds={0}, uvm=True)
        .nvml(0, 800)
        .build()
    )
    # The scheduler said job 77 ended after the owner started (clock ticks since boot).
    ended = dataclasses.replace(snapshot, handovers={"slurm:77": 10**9})
    result = assess(ended, AssessState(boot_id="boot-1"), DEFAULT)
    assert verdict(result, 800)[0] == "abandoned"
    assert [r.role.value for r in result.roles if r.pid == 800] == ["context_owner"]


def test_an_orphan_that_also_holds_a_report_only_gpu_is_not_actionable() -> None:
    """A holder of GPU 0 (fine) and GPU 1 (MIG: report-only) is reported, never acted on."""

    def host(holds: set[int]) -> Snapshot:
        return (
            HostBuilder()
            .gpu(0, allocated=LEAK)
            .gpu(1, mig=True)
            .nvml(0, 600, used=LEAK)  # the dead owner
            .proc(601, ppid=1, pgid=600, sid=600, holds=holds, uvm=True)
            .build()
        )

    (finding,) = [f for f in run(host({0, 1})).findings if f.pid == 601]
    assert (finding.kind, finding.actionable) == (FindingKind.ORPHANED, False)
    (finding,) = [f for f in run(host({0})).findings if f.pid == 601]
    assert (finding.kind, finding.actionable) == (FindingKind.ORPHANED, True)
