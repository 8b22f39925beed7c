"""The orphan rule's evidence, case by case (decide/assess.py): what ties a holder to a dead
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

from gpuwatchd.decide.assess import Assessment, assess
from gpuwatchd.decide.assess_state import AssessState
from gpuwatchd.decide.policy import Detection
from gpuwatchd.model import MIB, ProcessIdentity, Snapshot
from tests.support.snapshots import HostBuilder

LEAK = 20 * 1024 * MIB
DEFAULT = Detection()
OPT_IN = dataclasses.replace(DEFAULT, orphans_without_history=True)


def run(
    snapshot: Snapshot, previous: AssessState | None = None, detection: Detection = DEFAULT
) -> Assessment:
    state = previous if previous is not None else AssessState(boot_id=snapshot.boot_id)
    return assess(snapshot, state, detection)


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


def fd_family(at: float) -> HostBuilder:
    return (
        HostBuilder(monotonic=at)
        .gpu(0, allocated=LEAK)
        .gpu(1, allocated=LEAK)
        .proc(700, ppid=1, pgid=700, sid=700)
        .proc(810, ppid=700, holds={1}, uvm=True)
        .nvml(1, 810, used=LEAK)
    )


def fd_family_before() -> Snapshot:
    builder = fd_family(1000.0)
    builder.proc(800, ppid=700, holds={0}, uvm=True).nvml(0, 800, used=LEAK)
    builder.proc(815, ppid=800).proc(820, ppid=815, holds={0}, uvm=True, via="both")
    return builder.sharing(820, 800, True).build()


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


@pytest.mark.parametrize(
    ("case", "owner", "expected", "dead_status"),
    [
        ("the owner lives on", _owner_alive, "worker of 800", None),
        ("NVML lists the owner dead", _owner_listed_dead, "orphaned", "dead"),
        ("NVML lists the owner as a zombie", _owner_zombie, "orphaned", "zombie"),
        ("the owner's PID names another process now", _owner_pid_reused, "orphaned", "reused"),
        ("the owner was looked up and does not exist", _owner_absent, "orphaned", "dead"),
        ("the owner's fate is unknown", _owner_unknown, "worker of 810", None),
    ],
)
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


def test_a_holder_first_seen_in_the_poll_its_memory_lost_its_owner_is_the_heir() -> None:
    """The heir must have been seen no later than the moment the memory became unowned; the
    very same poll counts (the owner was seen owning GPU 0 the poll before)."""
    owned = (
        HostBuilder(monotonic=1000.0)
        .gpu(0, allocated=LEAK)
        .proc(800, ppid=1, holds={0}, uvm=True)
        .nvml(0, 800, used=LEAK)
        .build()
    )
    first = run(owned)
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


# --- the likely heir of a leak from before the daemon watched ----------------------------------
#
# 4121 lost its session leader 4100 and holds GPU 0 (idle) and GPU 1 (20 GiB nobody owns).
# kcmp compared its files with two context owners on GPU 2 while they lived (4300, 4310).


def heir_host(at: float, *, owners_alive: bool) -> HostBuilder:
    builder = (
        HostBuilder(monotonic=at)
        .gpu(0)
        .gpu(1, allocated=LEAK)
        .gpu(2)
        .proc(4121, ppid=1, pgid=4100, sid=4100, holds={0, 1}, uvm=True)
    )
    if owners_alive:
        for pid in (4300, 4310):
            builder.proc(pid, ppid=1, holds={2}, uvm=True).nvml(2, pid, used=LEAK)
    else:
        builder.absent(4100)
    return builder


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
    that opened its own files, and the dead owner's tie makes it the heir."""
    alive = (
        HostBuilder(monotonic=1000.0)
        .gpu(0, allocated=LEAK)
        .nvml(0, 800, used=LEAK)
        .proc(800, ppid=1, holds={0}, uvm=True)
        .proc(801, ppid=800, holds={0}, uvm=True)
        .sharing(801, 800, False)
        .build()
    )
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
        .gpu(0, allocated=LEAK)
        .nvml(0, 800, used=LEAK)
        .proc(801, ppid=1, pgid=800, sid=800, holds={0}, uvm=True)
        .build()
    )
    kind, evidence = verdict(run(dead, state), 801)
    assert kind == "orphaned"
    assert "own_files" not in evidence
