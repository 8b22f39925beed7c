"""Issue #15: leaks from before the daemon watched, kcmp proof of inheritance, reset blockers.

Real kcmp on the test's own forked children (collect/inherit.py), and decision tables over
hand-built snapshots (decide/assess/passes.py, decide/floor.py).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from gpuwatchd.collect.inherit import InheritanceProbe, absent_leaders
from gpuwatchd.collect.jobs import scheduler_ended_job
from gpuwatchd.collect.kcmp import Kcmp
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.model import MIB, FindingKind, HolderScan, ProcessIdentity, Snapshot
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.floor import driver_refusers, reset_blockers
from tests.support.children import Spawn
from tests.support.collecting import fake_collector
from tests.support.fakenvml import FakeNvml, gpu, process, state
from tests.support.fakeproc import FakeProc
from tests.support.orphancases import DEFAULT, LEAK, OPT_IN, run
from tests.support.snapshots import HostBuilder, cg_session, cg_unit, gpu_uuid


def findings_of(result: Assessment, pid: int) -> list[tuple[FindingKind, dict[str, object]]]:
    return [(f.kind, dict(f.evidence)) for f in result.findings if f.pid == pid]


# --- real kcmp on our own children -------------------------------------------------------------


@pytest.fixture
def devices(tmp_path: pathlib.Path) -> pathlib.Path:
    for name in ("nvidia0", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).write_bytes(b"")
    return tmp_path


_FAMILY = """
import os, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_RDONLY)          # the owner's own open file description
kids = []
ready_r, ready_w = os.pipe()
for inherit in (True, False):
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        if not inherit:                   # like spawn/forkserver: nothing of the owner's kept
            os.close(fd)
            os.open(path, os.O_RDONLY)
        os.write(ready_w, b"x")           # set up: only now may the test look
        os.close(ready_w)
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
os.close(ready_w)
assert len(os.read(ready_r, 1) + os.read(ready_r, 1)) == 2
print(os.getpid(), fd, *kids, flush=True)
time.sleep(60)
"""


@pytest.fixture
def family(devices: pathlib.Path) -> Iterator[tuple[int, int, int, int]]:
    """(owner, its fd, a child that inherited it, a child that opened the file itself)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _FAMILY, str(devices / "nvidia0")],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        owner, fd, inherited, own = (int(v) for v in proc.stdout.readline().split())
        yield owner, fd, inherited, own
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the session we created: only our processes
        proc.wait()


def _kcmp_or_skip() -> Kcmp:
    kcmp = Kcmp()
    probe_fd = os.open("/dev/null", os.O_RDONLY)
    try:
        answer = kcmp.same_file(os.getpid(), probe_fd, os.getpid(), probe_fd)
    finally:
        os.close(probe_fd)
    if answer is not True:
        pytest.skip(f"kcmp(KCMP_FILE) unavailable here: {kcmp.unavailable or 'no answer'}")
    return kcmp


def test_kcmp_tells_a_fork_inherited_fd_from_an_independently_opened_one(
    family: tuple[int, int, int, int], devices: pathlib.Path
) -> None:
    kcmp = _kcmp_or_skip()
    owner, fd, inherited, own = family
    assert kcmp.same_file(inherited, fd, owner, fd) is True
    own_fds = InheritanceProbe(ProcFS(devices_dir=str(devices)).holders, "/proc").device_fds(own)
    assert own_fds
    assert all(kcmp.same_file(own, o, owner, fd) is False for o in own_fds)


def test_probe_compares_holders_with_the_live_owner_above_them(
    family: tuple[int, int, int, int], devices: pathlib.Path
) -> None:
    _kcmp_or_skip()
    owner, _, inherited, own = family
    procfs = ProcFS(devices_dir=str(devices))
    scan = procfs.holders.scan([owner, inherited, own])
    assert {owner, inherited, own} <= set(scan.holdings)
    processes = procfs.read_processes([owner, inherited, own])
    probe = InheritanceProbe(procfs.holders, "/proc")
    answers = {a.holder: a.shared for a in probe.compare(processes, scan, [owner], {})}
    assert answers == {inherited: True, own: False}
    again = {a.holder: a.shared for a in probe.compare(processes, scan, [owner], {})}
    assert again == answers  # cached per identity pair


def test_a_process_s_fds_are_read_once_per_comparison_whatever_its_pairs(
    family: tuple[int, int, int, int], devices: pathlib.Path
) -> None:
    """An owner's fd table is read for each holder below it, and any user may open half a
    million fds (about a second and 60 MB to list): one comparison reads each process once."""
    _kcmp_or_skip()
    owner, _, inherited, own = family
    procfs = ProcFS(devices_dir=str(devices))
    scan = procfs.holders.scan([owner, inherited, own])
    processes = procfs.read_processes([owner, inherited, own])
    probe = InheritanceProbe(procfs.holders, "/proc")
    reads: list[int] = []
    device_fds = probe.device_fds

    def counted(pid: int) -> list[int] | None:
        reads.append(pid)
        return device_fds(pid)

    probe.device_fds = counted  # type: ignore[method-assign]
    answers = {a.holder: a.shared for a in probe.compare(processes, scan, [owner], {})}
    assert answers == {inherited: True, own: False}
    assert sorted(reads) == sorted([owner, inherited, own])


def test_a_table_of_many_fds_is_listed_an_entry_at_a_time_and_its_device_fds_capped(
    fake: FakeProc, devices: pathlib.Path
) -> None:
    """Any user may open half a million fds: listed whole, their names alone are 30 MB held for
    each new pair a poll compares. An entry at a time, the memory held does not grow with the
    table; at most _MAX_DEVICE_FDS device fds are kept whatever their number."""
    fake.add(740)
    for fd in range(3, 10_003):
        fake.open_fd(740, fd, "/home/u/f")
    fake.add(741, fds={fd: str(devices / "nvidia0") for fd in range(3, 203)})
    procfs = ProcFS(str(fake.root), devices_dir=str(devices))
    probe = InheritanceProbe(procfs.holders, str(fake.root))
    tracemalloc.start()
    try:
        assert probe.device_fds(740) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, f"{peak >> 10} KiB held to list 10,000 fds"
    capped = probe.device_fds(741)
    assert capped is not None
    assert len(capped) == 64
    assert set(capped) <= set(range(3, 203))
    assert capped == sorted(capped)
    assert probe.device_fds(742) is None  # no such process: unreadable


class _OwnFiles(Kcmp):
    """kcmp as it answers for a spawn/forkserver worker: no fd is the owner's."""

    def same_file(self, pid1: int, fd1: int, pid2: int, fd2: int) -> bool | None:
        return False


def test_a_poll_reads_a_bounded_number_of_fds_and_a_table_cut_short_is_unknown(
    fake: FakeProc, devices: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any user may open half a million fds in each of many holders below a live owner, and
    each new pair read them all (a readlink each, a stat for each /dev/ link). A poll now reads
    the holder scan's thread-table budget of fd entries in all: a table cut short is no "only
    its own files" (kcmp False on the fds read) but unknown, said once however often it is
    asked again; the pairs after it wait for the next poll, which reads them."""
    node = str(devices / "nvidia0")
    fake.add(750, fds={3: node, 4: node})  # the live context owner
    fake.add(751, ppid=750, fds={3: node})  # a flood below it: its device fd, then 5,000 more
    for fd in range(4, 5004):
        fake.open_fd(751, fd, "/dev/null")
    fake.add(752, ppid=750, fds={3: node, 4: "/home/u/f"})  # a worker, after it
    procfs = ProcFS(str(fake.root), devices_dir=str(devices))
    procfs.holders.thread_table_budget = 1000
    scan = procfs.holders.scan([750, 751, 752])
    processes = procfs.read_processes([750, 751, 752])
    probe = InheritanceProbe(procfs.holders, str(fake.root), _OwnFiles())
    reads: list[str] = []
    readlink = os.readlink

    def counted(path: str, *args: object, **kwargs: object) -> str:
        reads.append(path)
        return readlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "readlink", counted)
    polls: list[dict[int, bool | None]] = []
    cuts: list[list[int]] = []
    walked: list[int] = []
    with capture_logs() as logs:
        for _ in range(13):  # the 13th asks the unknown pair again
            reads.clear()
            answers = probe.compare(processes, scan, [750], {})
            polls.append({a.holder: a.shared for a in answers})
            cuts.append([a.holder for a in answers if a.cut])
            walked.append(len(reads))
    assert polls[0] == {751: None, 752: None}  # cut short: unknown; 752 waits
    assert cuts == [[751]] + [[]] * 11 + [[751]]  # marked when asked and cut, not while waiting
    assert all(answers == {751: None, 752: False} for answers in polls[1:]), polls
    assert max(walked) <= 1000, walked
    assert walked[12] > 900, walked  # read again, cut short again, not said again
    said = [e for e in logs if e["event"] == EventName.COLLECT_INHERITANCE_UNREAD]
    assert [(e["pid"], e["budget"], e["log_level"]) for e in said] == [(751, 1000, "warning")]


def test_unknown_when_kcmp_is_refused() -> None:
    refused = Kcmp(number=-1)  # no such syscall: ENOSYS, as under a seccomp filter
    assert refused.same_file(os.getpid(), 0, os.getpid(), 0) is None
    assert refused.unavailable is not None


def test_absent_leaders_are_only_pids_without_a_proc_directory() -> None:
    builder = HostBuilder().proc(os.getpid(), ppid=1, pgid=os.getpid(), sid=os.getppid())
    builder.proc(4_000_000, ppid=1, pgid=4_000_001, sid=os.getpid())
    snapshot = builder.build()
    gone = absent_leaders("/proc", snapshot.processes, [os.getpid(), 4_000_000])
    assert gone == frozenset({4_000_001})  # os.getppid() exists; our own pid is a holder
    # A look-up that fails otherwise (ENAMETOOLONG here, ENOMEM under memory pressure) is no
    # evidence that the leader is gone.
    assert absent_leaders("/" + "p" * 4096, snapshot.processes, [4_000_000]) == frozenset()


# --- item 2: leaks from before the daemon watched ------------------------------------------------


def before_watch(*, leader_gone: bool = True, notebook: bool = True) -> HostBuilder:
    """GPU 0 pins 20 GiB, no owner listed; a worker whose session leader (4100) may be gone; an
    idle notebook kernel that leads its own session."""
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(4121, ppid=1, pgid=4100, sid=4100, holds={0}, uvm=True, via="both")
    )
    if notebook:
        builder.proc(5200, ppid=1, pgid=5200, sid=5200, cgroup=cg_session(2), holds={0}, uvm=True)
    if leader_gone:
        builder.absent(4100)
    return builder


def test_likely_heir_is_reported_with_the_lost_leader_by_default() -> None:
    result = run(before_watch().build())
    ((kind, evidence),) = findings_of(result, 4121)
    assert kind is FindingKind.HIDDEN_HOLDER
    assert evidence["likely_heir"] is True
    assert (evidence["lost_leader"], evidence["link"]) == (4100, "session")
    assert "tie" not in evidence
    ((kind, evidence),) = findings_of(result, 5200)
    assert kind is FindingKind.HIDDEN_HOLDER
    assert "likely_heir" not in evidence


def test_with_the_key_the_likely_heir_is_orphaned_with_a_tie_of_its_own() -> None:
    result = run(before_watch().build(), detection=OPT_IN)
    ((kind, evidence),) = findings_of(result, 4121)
    assert kind is FindingKind.ORPHANED
    assert evidence["tie"] == "lost_leader"
    assert next(f for f in result.findings if f.pid == 4121).actionable
    ((kind, _),) = findings_of(result, 5200)
    assert kind is FindingKind.HIDDEN_HOLDER  # leads its own session: never qualifies


@pytest.mark.parametrize(
    ("case", "builder"),
    [
        ("leader exists (not looked up as absent)", before_watch(leader_gone=False)),
        ("a live owner on the GPU", before_watch().proc(300, holds={0}, uvm=True).nvml(0, 300)),
        ("memory at baseline", HostBuilder().gpu(0).proc(4121, ppid=1, pgid=4100, sid=4100,
                                                          holds={0}, uvm=True).absent(4100)),
        ("no nvidia-uvm", HostBuilder().gpu(0, allocated=LEAK).proc(
            4121, ppid=1, pgid=4100, sid=4100, holds={0}).absent(4100)),
        ("session unknown", HostBuilder().gpu(0, allocated=LEAK).proc(
            4121, ppid=1, pgid=4100, sid=None, holds={0}, uvm=True).absent(4100)),
    ],
)  # fmt: skip
def test_no_likely_heir_when_any_condition_fails(case: str, builder: HostBuilder) -> None:
    for detection in (DEFAULT, OPT_IN):
        result = run(builder.build(), detection=detection)
        for kind, evidence in findings_of(result, 4121):
            assert kind is not FindingKind.ORPHANED, case
            assert "likely_heir" not in evidence, case


def test_a_holder_that_arrived_after_the_memory_was_unowned_is_not_the_heir() -> None:
    early = run(before_watch(notebook=False).proc(4200, ppid=1, pgid=4100, sid=4100).build())
    later = (
        before_watch(notebook=False)
        .proc(4300, ppid=1, pgid=4100, sid=4100, holds={0}, uvm=True)
        .at(1010.0)
        .build()
    )
    result = run(later, early.state, OPT_IN)
    assert [k for k, _ in findings_of(result, 4121)] == [FindingKind.ORPHANED]
    assert [k for k, _ in findings_of(result, 4300)] == [FindingKind.HIDDEN_HOLDER]


# --- item 1: kcmp evidence in decisions ----------------------------------------------------------


def torchrun(*, rank0_alive: bool, sharing: bool | None) -> HostBuilder:
    """Agent 7000; ranks 7010 (GPU 0) and 7011 (GPU 1) in its session; 7020 is rank 0's forked
    DataLoader worker, in the same session (pgid/sid 7000)."""
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .gpu(1, allocated=LEAK)
        .proc(7000, ppid=1, pgid=7000, sid=7000)
        .proc(7011, ppid=7000, holds={0, 1}, uvm=True)
        .nvml(1, 7011, used=LEAK)
        .nvml(0, 7010, used=LEAK)  # listed dead once rank 0 is gone
    )
    if rank0_alive:
        builder.proc(7010, ppid=7000, holds={0, 1}, uvm=True)
        builder.proc(7020, ppid=7010, holds={0}, uvm=True, via="both")
        if sharing is not None:
            builder.sharing(7020, 7010, sharing)
    else:
        builder.proc(7020, ppid=1, pgid=7000, sid=7000, holds={0}, uvm=True, via="both")
    return builder


@pytest.mark.parametrize(
    ("sharing", "expected"),
    [(True, FindingKind.ORPHANED), (False, None), (None, None)],
    ids=["kcmp-shared", "kcmp-own-files", "kcmp-unknown"],
)
def test_dead_ranks_worker_sharing_a_session_with_live_ranks(
    sharing: bool | None, expected: FindingKind | None
) -> None:
    alive = run(torchrun(rank0_alive=True, sharing=sharing).at(1000.0).build())
    assert findings_of(alive, 7020) == []
    result = run(torchrun(rank0_alive=False, sharing=None).at(1010.0).build(), alive.state)
    found = findings_of(result, 7020)
    if expected is None:
        assert found == []  # today's rule: a session with a live owner protects it
        assert any(r.pid == 7020 and r.role == "worker" for r in result.roles)
    else:
        ((kind, evidence),) = found
        assert kind is expected
        assert (evidence["tie"], evidence["dead_pid"]) == ("inherited_files", 7010)
    assert findings_of(result, 7011) == []  # the live rank is never a finding
    restored = AssessState.from_json(alive.state.to_json())
    assert restored == alive.state  # the evidence survives a restart


def test_a_tree_link_to_a_live_owner_still_makes_a_worker() -> None:
    """Shared files of a dead owner do not override descent from a live one."""
    alive = run(torchrun(rank0_alive=True, sharing=True).build())
    later = torchrun(rank0_alive=False, sharing=None).change(7020, ppid=7011).at(1010.0).build()
    result = run(later, alive.state)
    assert findings_of(result, 7020) == []


def spawn_host(*, owner_alive: bool, sharing: bool | None) -> HostBuilder:
    """Owner 800 on GPU 0; 801 is a spawn worker (fork + exec) that initialised CUDA itself."""
    builder = HostBuilder().gpu(0, allocated=LEAK).nvml(0, 800, used=LEAK)
    if owner_alive:
        builder.proc(800, ppid=1, holds={0}, uvm=True)
        builder.proc(801, ppid=800, holds={0}, uvm=True)
        if sharing is not None:
            builder.sharing(801, 800, sharing)
    else:
        builder.proc(801, ppid=1, pgid=800, sid=800, holds={0}, uvm=True)
    return builder


@pytest.mark.parametrize(
    ("sharing", "expected"),
    [
        (False, FindingKind.HIDDEN_HOLDER),
        (True, FindingKind.ORPHANED),
        (None, FindingKind.ORPHANED),
    ],
    ids=["kcmp-own-files", "kcmp-shared", "kcmp-unknown-falls-back"],
)
def test_spawn_worker_of_a_dead_owner_is_never_its_heir(
    sharing: bool | None, expected: FindingKind
) -> None:
    alive = run(spawn_host(owner_alive=True, sharing=sharing).at(1000.0).build())
    result = run(spawn_host(owner_alive=False, sharing=None).at(1010.0).build(), alive.state)
    ((kind, evidence),) = findings_of(result, 801)
    assert kind is expected
    if sharing is False:
        assert (evidence["own_files"], evidence["owner"]) == (True, 800)


@pytest.mark.parametrize(
    ("later", "expected"),
    [(None, None), (False, FindingKind.HIDDEN_HOLDER), (True, FindingKind.ORPHANED)],
    ids=["never-answered", "then-own-files", "then-shared"],
)
def test_a_holder_whose_answer_the_fd_budget_cut_short_is_undecided_until_answered(
    later: bool | None, expected: FindingKind | None
) -> None:
    """A poll's fd budget ran out comparing spawn worker 801 with its live owner 800: the
    full read could have said "its own files" (never a target), so once 800 is dead its tie
    makes 801 no orphan but an undecided holder, across a restart too; a later definite
    answer replaces the cut one and decides as it always did."""
    cut = spawn_host(owner_alive=True, sharing=None).sharing(801, 800, None, cut=True)
    state = run(cut.at(1000.0).build()).state
    owner = ProcessIdentity(800, 10_000 + 800 * 7)
    assert state.to_json()["inheritance"] == [
        {"pid": 801, "start_ticks": 10_000 + 801 * 7, "owners": [[800, owner.start_ticks, None]]}
    ]
    state = AssessState.from_json(state.to_json())  # a restart keeps the cut answer
    again = spawn_host(owner_alive=True, sharing=later).at(1005.0)
    if later is None:
        again.sharing(801, 800, None)  # unknown but not cut (mappings only): keeps the mark
    state = run(again.build(), state).state
    result = run(spawn_host(owner_alive=False, sharing=None).at(1010.0).build(), state)
    ((kind, evidence),) = findings_of(result, 801)
    if expected is None:
        (finding,) = [f for f in result.findings if f.pid == 801]
        assert (kind, evidence["undecided"]) == (FindingKind.HIDDEN_HOLDER, True)
        assert "PID 800's: it or that owner had more fd entries than a poll reads" in finding.reason
    else:
        assert kind is expected
        assert state.inheritance[next(iter(state.inheritance))] == ((owner, later),)


def test_inheritance_state_is_bounded_and_dropped_with_its_lineage() -> None:
    alive = run(spawn_host(owner_alive=True, sharing=False).build())
    ident = next(iter(alive.state.inheritance))
    assert ident.pid == 801
    assert alive.state.inheritance[ident] == ((ProcessIdentity(800, 10_000 + 800 * 7), False),)
    gone = run(HostBuilder().gpu(0).at(1010.0).build(), alive.state)
    assert gone.state.inheritance == {}
    old = {**alive.state.to_json(), "version": 1}
    del old["inheritance"]
    assert AssessState.from_json(old).inheritance == {}  # version 1 reads as "no evidence"


# --- item 4: reset blockers that match the driver ----------------------------------------------


def one_gpu_node(*, ctl_holder: str) -> Snapshot:
    builder = HostBuilder().gpu(0)
    if ctl_holder == "persistenced":
        builder.proc(
            900,
            comm="nvidia-persiste",
            uid=0,
            cgroup=cg_unit("nvidia-persistenced.service"),
            ctl=True,
        )
    else:
        builder.proc(900, comm="python3", ctl=True)
    return builder.build()


def test_persistenced_holding_only_nvidiactl_does_not_block_a_reset() -> None:
    snapshot = one_gpu_node(ctl_holder="persistenced")
    assert reset_blockers(snapshot.holders, snapshot.processes, 0, frozenset()) == []


def test_a_user_process_holding_only_nvidiactl_still_blocks() -> None:
    snapshot = one_gpu_node(ctl_holder="user")
    (why,) = reset_blockers(snapshot.holders, snapshot.processes, 0, frozenset())
    assert "cannot be attributed" in why


def test_driver_refusers_include_jobs_of_other_gpus_and_infrastructure() -> None:
    snapshot = (
        HostBuilder()
        .gpu(0)
        .gpu(1)
        .proc(300, holds={0, 1}, uvm=True)  # a job on GPU 1 that opened every GPU
        .nvml(1, 300)
        .proc(900, comm="nv-hostengine", holds={0})
        .proc(950, comm="nvidia-persiste", ctl=True, uid=0, exe_trusted=True)
        .build()
    )
    assert driver_refusers(snapshot.holders, 0, frozenset()) == [300, 900]
    assert driver_refusers(snapshot.holders, 0, frozenset({300})) == [900]
    assert (
        driver_refusers(HolderScan(mode="full", unreadable=frozenset({5})), 0, frozenset()) is None
    )
    reasons = reset_blockers(snapshot.holders, snapshot.processes, 0, frozenset())
    assert [r.split()[1] for r in reasons] == ["300", "900"]
    assert all("holds the GPU's device file" in r for r in reasons)
    assert gpu_uuid(0)  # the GPU the report names


# --- item 3: the scheduler's word -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "environ", "expected"),
    [
        ("slurm:42", {}, "slurm:42"),
        ("slurm", {"SLURM_JOB_ID": "4242"}, "slurm:4242"),
        (
            "pod:0a1b2c3d-aaaa-bbbb-cccc-0123456789ab",
            {},
            "pod:0a1b2c3d-aaaa-bbbb-cccc-0123456789ab",
        ),
        ("container:3f2a9c", {}, "container:3f2a9c"),
        ("unit:train@1.service", {}, "unit:train@1.service"),
    ],
)
def test_ended_job_names_a_job_key(spec: str, environ: dict[str, str], expected: str) -> None:
    assert scheduler_ended_job(spec, environ) == expected


@pytest.mark.parametrize(
    ("spec", "environ", "message"),
    [
        ("slurm:4x2", {}, "'4x2' is not a valid slurm id"),
        ("slurm", {}, "SLURM_JOB_ID is not set"),
        ("slurm", {"SLURM_JOB_ID": "$(rm -rf /)"}, "is not a valid slurm id"),
        ("pbs:42", {}, "KIND one of slurm, pod, container, unit"),
        ("pod", {}, "pod needs an id"),
        ("unit:sshd", {}, "not a valid unit id"),
        ("slurm:" + "1" * 30, {}, "not a valid slurm id"),
    ],
)
def test_ended_job_rejects_what_names_no_job(
    spec: str, environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        scheduler_ended_job(spec, environ)


def test_ended_job_needs_once_and_a_valid_value(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(f"state_dir: {tmp_path}\n")
    base = [sys.executable, "-m", "gpuwatchd", "run", "--config", str(config)]
    for extra, message in (
        (["--ended-job", "slurm:42"], "--ended-job needs --once"),
        (["--once", "--ended-job", "slurm:x"], "'x' is not a valid slurm id"),
    ):
        done = subprocess.run(base + extra, capture_output=True, text=True, check=False, timeout=60)
        assert done.returncode == 78, done.stderr
        assert message in done.stderr


def test_kcmp_unavailable_is_logged_once_and_answers_stay_unknown() -> None:
    from structlog.testing import capture_logs

    kcmp = Kcmp(number=-1)  # no such syscall: ENOSYS, as a seccomp filter answers
    assert kcmp.same_file(os.getpid(), 0, os.getpid(), 0) is None
    snapshot = (
        HostBuilder()
        .gpu(0)
        .proc(800, ppid=1, holds={0}, uvm=True)
        .proc(801, ppid=800, holds={0}, uvm=True)
        .build()
    )
    probe = InheritanceProbe(ProcFS().holders, "/proc", kcmp)
    with capture_logs() as logs:
        first = probe.compare(snapshot.processes, snapshot.holders, [800], {})
        probe.compare(snapshot.processes, snapshot.holders, [800], {})
    assert [a.shared for a in first] == [None]
    events = [e for e in logs if e["event"] == EventName.COLLECT_KCMP_UNAVAILABLE]
    assert len(events) == 1
    assert events[0]["log_level"] == "warning"


_FORK_THEN_EXEC = """
import os, signal, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_RDONLY)          # the owner's, inherited by the child below
own = "import os, sys, time; os.open(sys.argv[1], os.O_RDONLY); print('ready', flush=True); " \\
    "time.sleep(60)"
ready_r, ready_w = os.pipe()
child = os.fork()
if child == 0:
    argv = [sys.executable, "-c", own, path]
    signal.signal(signal.SIGUSR1, lambda *_: os.execv(sys.executable, argv))
    os.write(ready_w, b"x")
    while True:
        time.sleep(60)
os.read(ready_r, 1)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_holder_that_execs_is_compared_with_its_owner_again(
    fake_nvml: FakeNvml, spawn: Spawn
) -> None:
    """kcmp's answer for a (holder, owner) pair is remembered, but an exec closes the owner's
    files the holder inherited (CUDA opens them close-on-exec) while its PID and start time
    stay: a holder that execs a program opening the device file itself is asked again, so it
    is no longer said to hold its owner's files (the proof an orphan's ladder may rest on)."""
    _kcmp_or_skip()
    node = fake_nvml.devices_dir / "nvidia0"
    node.touch()
    owner = spawn(_FORK_THEN_EXEC.replace("sys.argv[1]", repr(str(node)), 1))
    children = pathlib.Path(f"/proc/{owner.pid}/task/{owner.pid}/children").read_text()
    child = int(children.split()[0])
    fake_nvml.write(state([gpu(0, allocated=600 * MIB, processes=[process(owner.pid)])]))
    with fake_collector(fake_nvml) as collector:
        before = collector.collect(full=True).file_sharing
        assert (child, owner.pid, True) in {(s.holder, s.owner, s.shared) for s in before}
        os.kill(child, signal.SIGUSR1)
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "ready"  # the new program holds its own
        after = collector.collect().file_sharing
    assert {(s.holder, s.owner, s.shared) for s in after} == {(child, owner.pid, False)}
