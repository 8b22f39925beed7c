"""Findings over hand-built snapshots: the orphan rule, PID trust, memory and report-only cases.

The safety core: a healthy job must never be called ``orphaned``. Each test builds a small host
with :class:`HostBuilder` and asserts the findings and the holders' roles.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatchd.core.model import (
    MIB,
    CgroupInfo,
    Finding,
    FindingKind,
    ProcessIdentity,
    ProcessInfo,
    Snapshot,
)
from gpuwatchd.decide.assess.holders import job_ended
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import NODE, Assessment
from gpuwatchd.decide.assess.state import AssessState, Lineage
from gpuwatchd.decide.floor import is_infrastructure
from gpuwatchd.decide.policy import Detection
from tests.support.snapshots import (
    HostBuilder,
    cg_container,
    cg_pod,
    cg_root,
    cg_session,
    cg_slurm,
    cg_unit,
    gpu_uuid,
)

DETECTION = Detection()
LEAK = 1200 * MIB  # what a dead job left behind: far above baseline + margin
EMPTY = AssessState()


def run(
    snapshot: Snapshot,
    previous: AssessState = EMPTY,
    handovers: Mapping[str, int | None] | None = None,
) -> Assessment:
    if previous is EMPTY:
        previous = AssessState(boot_id=snapshot.boot_id)
    if handovers is not None:
        snapshot = dataclasses.replace(snapshot, handovers=handovers)
    return assess(snapshot, previous, DETECTION)


def kinds(result: Assessment) -> list[tuple[str, int | None]]:
    return sorted((f.kind.value, f.pid) for f in result.findings)


def only(result: Assessment, kind: FindingKind) -> Finding:
    found = [f for f in result.findings if f.kind is kind]
    assert len(found) == 1, result.findings
    return found[0]


def role_of(result: Assessment, pid: int, gpu: int = 0) -> tuple[str, int | None]:
    for role in result.roles:
        if role.pid == pid and role.gpu == gpu_uuid(gpu):
            return role.role, role.owner_pid
    raise AssertionError(f"no role for {pid} on GPU {gpu}: {result.roles}")


def orphan_host(allocated: int = LEAK) -> HostBuilder:
    """A trainer (200) with a forked DataLoader worker (201) holding GPU 0 and uvm."""
    return (
        HostBuilder()
        .gpu(0, allocated=allocated)
        .proc(200, holds={0}, uvm=True)
        .proc(201, ppid=200, holds={0}, uvm=True)
        .nvml(0, 200, used=LEAK)
    )


def after_parent_died(builder: HostBuilder) -> HostBuilder:
    return builder.kill(200).change(201, ppid=1)


# --- the orphan rule --------------------------------------------------------------------------


def test_worker_of_dead_listed_parent_is_orphaned_via_recorded_parent() -> None:
    first = run(orphan_host().build())
    assert kinds(first) == []
    result = run(after_parent_died(orphan_host()).at(1005.0).build(), first.state)
    orphan = only(result, FindingKind.ORPHANED)
    assert (orphan.pid, orphan.gpu, orphan.actionable) == (201, gpu_uuid(0), True)
    assert orphan.evidence["dead_pid"] == 200
    assert orphan.evidence["recorded_ppid"] == 200
    assert orphan.memory == LEAK
    assert orphan.key == f"orphaned:{gpu_uuid(0)}:201@{orphan.start_ticks}"
    dead = only(result, FindingKind.DEAD_PROCESS)
    assert (dead.pid, dead.start_ticks, dead.evidence["heirs"]) == (200, None, [201])
    assert role_of(result, 201) == ("orphaned", None)


@pytest.mark.parametrize("link", ["pgid", "sid"])
def test_worker_tied_by_group_or_session_of_dead_owner_is_orphaned_without_history(
    link: str,
) -> None:
    """Seen for the first time after its parent died: its group/session leader is the dead PID."""
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(201, ppid=1, pgid=200 if link == "pgid" else 201, sid=200 if link == "sid" else 201)
        .hold(201, {0}, uvm=True)
        .nvml(0, 200)
    )
    result = run(builder.build())
    assert only(result, FindingKind.ORPHANED).evidence["link"] == (
        "process group" if link == "pgid" else "session"
    )


def test_same_worker_with_live_parent_is_a_worker_not_a_finding() -> None:
    result = run(orphan_host().build())
    assert kinds(result) == []
    assert role_of(result, 200) == ("context_owner", None)
    assert role_of(result, 201) == ("worker", 200)


def test_healthy_nohup_job_that_lost_parent_session_and_group_leaders_is_quiet() -> None:
    """``nohup python train.py &`` from a script that exited: ppid 1, leaders gone, healthy."""
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(300, ppid=1, pgid=290, sid=280, holds={0}, uvm=True)
        .proc(301, ppid=300, holds={0}, uvm=True)
        .proc(302, ppid=300, holds={0}, uvm=True, via="map")
        .nvml(0, 300, used=LEAK)
    )
    result = run(builder.build())
    assert kinds(result) == []
    assert [role_of(result, pid) for pid in (300, 301, 302)] == [
        ("context_owner", None),
        ("worker", 300),
        ("worker", 300),
    ]


def test_daemon_with_ppid_1_owning_a_context_is_not_a_finding() -> None:
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(400, ppid=1, cgroup=cg_unit("inference.service"), holds={0}, uvm=True)
        .nvml(0, 400, used=LEAK)
    )
    assert kinds(run(builder.build())) == []


@pytest.mark.parametrize("workers", [1, 4, 8])
@pytest.mark.parametrize("via", ["fd", "map", "both"])
def test_dataloader_workers_of_a_live_trainer_are_workers(workers: int, via: str) -> None:
    builder = HostBuilder().gpu(0, allocated=LEAK).proc(500, holds={0}, uvm=True).nvml(0, 500)
    for n in range(workers):
        builder.proc(501 + n, ppid=500, holds={0}, uvm=True, via=via)
    result = run(builder.build())
    assert kinds(result) == []
    assert {role_of(result, 501 + n) for n in range(workers)} == {("worker", 500)}


@pytest.mark.parametrize(
    ("name", "columns"),
    [
        ("same session", {"ppid": 1, "pgid": 610, "sid": 600}),
        ("same process group", {"ppid": 1, "pgid": 600, "sid": 610}),
        ("same job cgroup", {"ppid": 1, "pgid": 610, "sid": 610, "cgroup": cg_slurm("77")}),
        ("ancestor of the owner", {"ppid": 1, "pgid": 610, "sid": 610, "holder_is_parent": True}),
    ],
)
def test_holder_related_to_live_owner_by_any_link_is_a_worker(
    name: str, columns: dict[str, object]
) -> None:
    # Read, never pop: the parameter dict is shared by every run of this case in one process.
    parent_of_owner = bool(columns.get("holder_is_parent", False))
    builder = HostBuilder().gpu(0, allocated=LEAK)
    builder.proc(
        611,
        ppid=1,
        pgid=columns["pgid"],  # type: ignore[arg-type]
        sid=columns["sid"],  # type: ignore[arg-type]
        cgroup=columns.get("cgroup", cg_session(3)),  # type: ignore[arg-type]
        holds={0},
        uvm=True,
    )
    builder.proc(
        600,
        ppid=611 if parent_of_owner else 1,
        pgid=600,
        sid=600,
        cgroup=cg_slurm("77") if "cgroup" in columns else cg_session(4),
        holds={0},
        uvm=True,
    )
    builder.nvml(0, 600).nvml(0, 599)  # 599: a dead PID, so a dead owner is around too
    builder.change(611, sid=600 if name == "same session" else columns["sid"])
    result = run(builder.build())
    assert role_of(result, 611) == ("worker", 600), name
    assert FindingKind.ORPHANED not in {f.kind for f in result.findings}


def test_live_job_on_gpus_0_to_6_is_not_orphaned_on_gpu_7_with_unaccounted_memory() -> None:
    builder = HostBuilder()
    for index in range(8):
        builder.gpu(index, allocated=LEAK if index == 7 else 4 * LEAK)
    for rank in range(7):
        pid = 700 + rank
        builder.proc(pid, ppid=690, pgid=690, sid=690, holds=set(range(8)), uvm=True)
        builder.proc(800 + rank, ppid=pid, holds=set(range(8)), uvm=True)
        builder.nvml(rank, pid, used=4 * LEAK)
    builder.proc(690, ppid=1, holds=set(), comm="torchrun")
    result = run(builder.build())
    assert FindingKind.ORPHANED not in {f.kind for f in result.findings}
    assert role_of(result, 700, gpu=7)[0] == "context_owner"
    assert role_of(result, 800, gpu=7) == ("worker", 700)
    unaccounted = only(result, FindingKind.UNACCOUNTED_MEMORY)
    assert (unaccounted.gpu, unaccounted.actionable) == (gpu_uuid(7), False)


def test_unrelated_cuda_holder_on_gpu_with_unaccounted_memory_and_no_owner_is_only_hidden() -> None:
    """A process that merely initialised CUDA (a notebook that asked for the device count) holds
    the device files and uvm without a context; unowned memory alone never makes it an orphan."""
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(900, ppid=1, cgroup=cg_root(), holds={0}, uvm=True)
    )
    first = run(builder.at(10.0).build())
    later = run(builder.at(20.0).build(), first.state)
    for result in (first, later):
        assert FindingKind.ORPHANED not in {f.kind for f in result.findings}
        assert "nothing ties it" in only(result, FindingKind.HIDDEN_HOLDER).reason


def test_worker_of_a_context_owner_seen_earlier_inherits_memory_nvml_no_longer_lists() -> None:
    """The trainer was seen owning a context; it died and the driver dropped its PID from the
    list, but its worker keeps the memory: the recorded lineage ties the worker to it."""
    alive = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(800, holds={0}, uvm=True)
        .proc(801, ppid=800, pgid=800, sid=800, holds={0}, uvm=True)
        .nvml(0, 800, used=LEAK)
    )
    first = run(alive.at(10.0).build())
    assert role_of(first, 801) == ("worker", 800)
    assert any(o.pid == 800 for o in first.state.owners)
    dead = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(801, ppid=1, pgid=800, sid=800, holds={0}, uvm=True)
    )
    result = run(dead.at(20.0).build(), first.state)
    orphan = only(result, FindingKind.ORPHANED)
    assert orphan.pid == 801
    assert orphan.evidence["tie"] == "unaccounted_memory"
    assert orphan.evidence["former_owner"] == 800
    assert orphan.memory == LEAK - DETECTION.default_baseline
    assert AssessState.from_json(result.state.to_json()) == result.state


def test_former_owners_are_forgotten_once_nothing_names_them() -> None:
    alive = HostBuilder().gpu(0, allocated=LEAK).proc(800, holds={0}, uvm=True).nvml(0, 800)
    first = run(alive.at(10.0).build())
    gone = run(HostBuilder().gpu(0).at(20.0).build(), first.state)
    assert gone.state.owners == frozenset()


@pytest.mark.parametrize("via", ["fd", "map"])
def test_nvml_only_client_without_uvm_is_never_orphaned(via: str) -> None:
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(950, ppid=1, comm="gpu_exporter", holds={0}, via=via, uvm=False)
        .nvml(0, 949)  # a dead owner...
        .change(950, sid=949)  # ...that was even its session leader
    )
    result = run(builder.build())
    hidden = only(result, FindingKind.HIDDEN_HOLDER)
    assert (hidden.pid, hidden.actionable, hidden.evidence["nvml_only"]) == (950, False, True)
    assert role_of(result, 950)[0] == "management"
    assert FindingKind.ORPHANED not in {f.kind for f in result.findings}


def _holder_of_a_dead_owners_gpu(**process: Any) -> Snapshot:
    """Process 960 holding GPU 0's files in the session of 959, whom NVML lists (and who is
    gone); ``process`` says the rest of it."""
    builder = HostBuilder().gpu(0, allocated=LEAK).proc(960, ppid=1, holds={0}, **process)
    return builder.nvml(0, 959).change(960, sid=959).build()


@pytest.mark.parametrize(
    ("comm", "exe", "argv0"),
    [
        ("nvidia-persiste", None, None),  # comm cut to 15 characters by the kernel
        ("nvidia-persistenced", None, None),
        ("python3", "/usr/bin/nv-hostengine", None),
        ("exporter", None, "/usr/bin/dcgm-exporter"),
        ("nvidia-smi", None, None),
    ],
)
@pytest.mark.parametrize("uvm", [False, True])
def test_floor_processes_are_never_findings(
    comm: str, exe: str | None, argv0: str | None, uvm: bool
) -> None:
    # root's, running a program only root can have installed
    result = run(_holder_of_a_dead_owners_gpu(
        comm=comm, exe=exe, cmdline=(argv0,) if argv0 else None, uvm=uvm,
        state="D" if uvm else "S", uid=0, user="root", exe_trusted=True,
    ))  # fmt: skip
    assert all(f.pid != 960 for f in result.findings)
    assert role_of(result, 960)[0] == "management"


@pytest.mark.parametrize(
    ("comm", "exe", "argv0"),
    [
        ("nvidia-persiste", "/usr/bin/python3", None),
        ("python3", "/home/mallory/nv-hostengine", None),
        ("python3", "/usr/bin/python3", "nvidia-cuda-mps-server"),
    ],
)
def test_a_users_look_alike_of_infrastructure_is_judged_like_any_process(
    comm: str, exe: str, argv0: str | None
) -> None:
    """The look-alike holds a dead owner's GPU files (its session leader was listed): it is an
    orphan like any other, and the floor does not shield it."""
    result = run(_holder_of_a_dead_owners_gpu(
        comm=comm, exe=exe, cmdline=(argv0 or comm, "x"), uvm=True, uid=1001, user="mallory",
        exe_trusted=False,
    ))  # fmt: skip
    orphan = only(result, FindingKind.ORPHANED)
    assert (orphan.pid, orphan.actionable) == (960, True)


def test_floor_unit_process_is_floor_even_with_an_unknown_name() -> None:
    proc = ProcessInfo(
        pid=970,
        start_ticks=1,
        state="S",
        ppid=1,
        pgid=970,
        sid=970,
        comm="worker",
        uid=0,
        cgroup=cg_unit("nvidia-dcgm.service"),
    )
    assert is_infrastructure(proc)
    assert not is_infrastructure(ProcessInfo(971, 1, "S", 1, 971, 971, comm="nvidia-persist"))


def test_orphan_in_unrelated_holders_job_with_live_owner_in_another_job_is_orphaned() -> None:
    """Cgroups of different jobs do not shield; same-session user slices never group."""
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .gpu(1, allocated=LEAK)
        .proc(1000, ppid=1, cgroup=cg_container("live"), holds={0, 1}, uvm=True)
        .nvml(0, 1000, used=LEAK)
        .proc(1101, ppid=1, pgid=1100, sid=1100, cgroup=cg_container("dead"), holds={0, 1})
        .hold(1101, {0, 1}, uvm=True)
        .nvml(1, 1100, used=LEAK)
    )
    orphan = only(run(builder.build()), FindingKind.ORPHANED)
    assert (orphan.pid, orphan.gpu) == (1101, gpu_uuid(1))
    assert orphan.evidence["gpus"] == [gpu_uuid(0), gpu_uuid(1)]


# --- unknown columns never create an orphan ---------------------------------------------------


@pytest.mark.parametrize(
    "unknown",
    ["ppid", "pgid", "sid", "cgroup", "start", "owner_sid", "owner_cgroup", "owner_parent"],
)
def test_unknown_column_turns_an_orphan_into_a_hidden_holder(unknown: str) -> None:
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .gpu(1, allocated=LEAK)
        .proc(1200, ppid=1, pgid=1200, sid=1200, cgroup=cg_slurm("5"), holds={1}, uvm=True)
        .nvml(1, 1200, used=LEAK)
        .proc(1301, ppid=1, pgid=1300, sid=1300, cgroup=cg_slurm("6"), holds={0}, uvm=True)
        .nvml(0, 1300, used=LEAK)
    )
    assert only(run(builder.build()), FindingKind.ORPHANED).pid == 1301  # the control case
    changes: dict[str, tuple[int, dict[str, object]]] = {
        "ppid": (1301, {"ppid": None}),
        "pgid": (1301, {"pgid": None}),
        "sid": (1301, {"sid": None}),
        "cgroup": (1301, {"cgroup": None}),
        "start": (1301, {"start_ticks": None}),
        "owner_sid": (1200, {"sid": None}),
        "owner_cgroup": (1200, {"cgroup": None}),
        "owner_parent": (1200, {"ppid": 4242}),  # a parent we have no facts about
    }
    pid, fields = changes[unknown]
    builder.change(pid, **fields)
    result = run(builder.build())
    assert FindingKind.ORPHANED not in {f.kind for f in result.findings}, unknown
    hidden = [f for f in result.findings if f.kind is FindingKind.HIDDEN_HOLDER]
    assert [f.pid for f in hidden] == [1301]
    assert not hidden[0].actionable


def test_unreadable_process_list_on_another_gpu_stops_the_orphan() -> None:
    builder = orphan_host().gpu(1, processes_readable=False)
    first = run(builder.build())
    result = run(after_parent_died(builder).build(), first.state)
    assert FindingKind.ORPHANED not in {f.kind for f in result.findings}
    assert (
        "could not say whether it owns a context" in only(result, FindingKind.HIDDEN_HOLDER).reason
    )
    assert result.report_only[gpu_uuid(1)] == "its process list could not be read"


def test_a_gpu_whose_mig_mode_is_unknown_is_report_only() -> None:
    """Its processes may live in MIG instances the reading does not show: what dies on it is
    found and reported, never acted on, as the reset already refuses that GPU."""

    def host(mig: bool | None) -> HostBuilder:
        return (
            HostBuilder()
            .gpu(0, allocated=LEAK, mig=mig)
            .proc(200, holds={0}, uvm=True)
            .proc(201, ppid=200, holds={0}, uvm=True)
            .nvml(0, 200, used=LEAK)
        )

    for mig in (False, None):
        first = run(host(mig).build())
        result = run(after_parent_died(host(mig)).at(1005.0).build(), first.state)
        acted = [(f.kind, f.pid, f.actionable) for f in result.findings if f.pid is not None]
        known = mig is False
        assert acted == [
            (FindingKind.DEAD_PROCESS, 200, known),
            (FindingKind.ORPHANED, 201, known),
        ], mig
    assert result.report_only[gpu_uuid(0)] == (
        "its MIG mode could not be read: processes may live in MIG instances"
    )


def test_holder_that_owns_a_context_on_another_gpu_is_not_orphaned() -> None:
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .gpu(1, allocated=LEAK)
        .proc(1401, ppid=1, pgid=1400, sid=1400, holds={0, 1}, uvm=True)
        .nvml(0, 1400)
        .nvml(1, 1401)
    )
    result = run(builder.build())
    assert kinds(result) == [("dead_process", 1400), ("unaccounted_memory", None)]
    assert role_of(result, 1401, gpu=0)[0] == "context_owner"


def test_zombie_listed_with_live_threads_is_a_live_owner_for_its_workers() -> None:
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(1500, state="Z", holds={0}, uvm=True)
        .proc(1501, ppid=1500, holds={0}, uvm=True)
        .nvml(0, 1500)
    )
    result = run(builder.build())
    assert kinds(result) == [("zombie", 1500)]
    assert role_of(result, 1501) == ("worker", 1500)


# --- zombie, stuck, dead ----------------------------------------------------------------------


def test_listed_zombie_names_the_parent_that_must_reap_it() -> None:
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(1600, comm="bash", cmdline=("bash", "run.sh"))
        .proc(1601, ppid=1600, state="Z", cmdline=())
        .proc(1602, ppid=1, pgid=1600, sid=1600, holds={0}, uvm=True)
        .nvml(0, 1601)
    )
    first = run(builder.build())
    zombie = only(first, FindingKind.ZOMBIE)
    assert (zombie.pid, zombie.evidence["ppid"]) == (1601, 1600)
    assert zombie.evidence["parent_cmdline"] == "bash run.sh"
    assert "parent 1600 must reap it" in zombie.reason


def test_a_command_line_in_a_findings_evidence_is_cut_as_events_cut_it() -> None:
    """A user's arguments may be megabytes: evidence (saved, logged, served) keeps the first
    4,096 characters, what a pattern sees, and says how many more there were."""
    long = "x" * 100_000
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(1600, comm="bash", cmdline=("bash", long))
        .proc(1601, ppid=1600, state="Z", cmdline=())
        .proc(1602, ppid=1, pgid=1600, sid=1600, holds={0}, uvm=True, cmdline=("python", long))
        .nvml(0, 1601)
    )
    found = run(builder.build())

    def cut(text: str) -> str:
        return f"{text[:4096]} [... {len(text) - 4096} characters cut]"

    assert only(found, FindingKind.ZOMBIE).evidence["parent_cmdline"] == cut(f"bash {long}")
    orphan = next(f for f in found.findings if f.pid == 1602)
    assert orphan.evidence["cmdline"] == cut(f"python {long}")


def test_worker_whose_recorded_parent_is_a_listed_zombie_is_orphaned() -> None:
    first = run(orphan_host().build())
    zombie_parent = orphan_host().change(200, state="Z").change(201, ppid=1)
    zombie_parent.hold(200, ())  # a zombie holds nothing (fds released at exit)
    result = run(zombie_parent.build(), first.state)
    orphan = only(result, FindingKind.ORPHANED)
    assert (orphan.evidence["dead_pid"], orphan.evidence["dead_status"]) == (200, "zombie")


@pytest.mark.parametrize("listed", [True, False])
def test_process_in_d_state_is_stuck_and_never_orphaned(listed: bool) -> None:
    builder = HostBuilder().gpu(0, allocated=LEAK).proc(1700, state="D", holds={0}, uvm=True)
    builder.nvml(0, 1700 if listed else 1699)
    result = run(builder.build())
    stuck = only(result, FindingKind.STUCK)
    assert (stuck.pid, stuck.gpu, stuck.evidence["state"]) == (1700, gpu_uuid(0), "D")
    assert FindingKind.ORPHANED not in {f.kind for f in result.findings}


def test_dead_listed_pid_is_a_dead_process_with_its_memory() -> None:
    result = run(HostBuilder().gpu(0, allocated=LEAK).nvml(0, 1800, used=LEAK).build())
    dead = only(result, FindingKind.DEAD_PROCESS)
    assert (dead.pid, dead.start_ticks, dead.memory, dead.actionable) == (1800, None, LEAK, True)
    assert dead.key == f"dead_process:{gpu_uuid(0)}:1800"


# --- ghost memory and baselines ---------------------------------------------------------------


def test_memory_above_default_baseline_with_no_holder_is_ghost() -> None:
    result = run(HostBuilder().gpu(0, allocated=LEAK).nvml(0, 1900).build())
    ghost = only(result, FindingKind.GHOST_MEMORY)
    assert (ghost.pid, ghost.actionable) == (None, True)
    assert ghost.evidence["baseline"] == DETECTION.default_baseline
    assert ghost.evidence["baseline_learned"] is False
    assert ghost.memory == LEAK - DETECTION.default_baseline
    assert ghost.key == f"ghost_memory:{gpu_uuid(0)}:gpu"


@pytest.mark.parametrize(
    ("allocated", "expect_ghost"),
    [
        (DETECTION.default_baseline + DETECTION.ghost_margin, False),
        (DETECTION.default_baseline + DETECTION.ghost_margin + 1, True),
    ],
)
def test_ghost_needs_more_than_baseline_plus_margin(allocated: int, expect_ghost: bool) -> None:
    result = run(HostBuilder().gpu(0, allocated=allocated).build())
    assert (FindingKind.GHOST_MEMORY in {f.kind for f in result.findings}) is expect_ghost


def test_a_holder_with_nvidia_uvm_blocks_ghost() -> None:
    builder = HostBuilder().gpu(0, allocated=LEAK).proc(2000, ppid=1, holds={0}, uvm=True)
    result = run(builder.build())
    assert FindingKind.GHOST_MEMORY not in {f.kind for f in result.findings}
    assert "held by PID(s) 2000" in result.notes[gpu_uuid(0)][0]


@pytest.mark.parametrize(
    ("comm", "cmdline", "via"),
    [
        ("gpustat", ("/usr/bin/python3", "/usr/local/bin/gpustat", "--watch"), "fd"),
        ("nvidia-smi", ("nvidia-smi", "-l", "5"), "fd"),  # a user's: not the floor's
        ("exporter", ("/opt/exporter/bin/exporter", "--port=9400"), "map"),
    ],
)
def test_a_monitor_beside_leaked_memory_leaves_it_ghost_memory(
    comm: str, cmdline: tuple[str, ...], via: str
) -> None:
    """An NVML-only client (the GPU's node and nvidiactl, no nvidia-uvm, no context, no
    memory) does not turn memory no live process owns into unaccounted_memory: it is
    ghost_memory, the monitor a report-only hidden_holder that names it (the reset gate)."""
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(2000, ppid=1, uid=1000, comm=comm, cmdline=cmdline, holds={0}, via=via, uvm=False)
    )
    result = run(builder.build())
    assert kinds(result) == [("ghost_memory", None), ("hidden_holder", 2000)]
    ghost = only(result, FindingKind.GHOST_MEMORY)
    assert ghost.actionable
    assert ghost.evidence["monitors"] == [2000]
    monitor = only(result, FindingKind.HIDDEN_HOLDER)
    assert (monitor.actionable, monitor.evidence["nvml_only"]) == (False, True)


@pytest.mark.parametrize(
    ("setup", "why"),
    [
        (lambda b: b.proc(2100, ppid=1, unreadable=True), "2100 could not be read"),
        (lambda b: b.proc(2101, ppid=1, holds={0}, uvm=True, comm="top"), "held by PID(s) 2101"),
        (lambda b: setattr(b, "scan_mode", "targeted"), "targeted"),
        (lambda b: b.proc(2102, ppid=1).nvml(0, 2102), "NVML lists live PID(s) 2102"),
    ],
)
def test_no_ghost_when_a_holder_may_exist_and_the_note_says_why(setup: object, why: str) -> None:
    builder = HostBuilder().gpu(0, allocated=LEAK)
    setup(builder)  # type: ignore[operator]
    result = run(builder.build())
    assert FindingKind.GHOST_MEMORY not in {f.kind for f in result.findings}
    assert why in " ".join(result.notes[gpu_uuid(0)])


def test_unreadable_floor_process_does_not_block_ghost() -> None:
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(2150, comm="nv-hostengine", unreadable=True, uid=0, exe_trusted=True)
    )
    assert only(run(builder.build()), FindingKind.GHOST_MEMORY)


def test_floor_holder_does_not_block_ghost() -> None:
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(2160, comm="nvidia-persiste", holds={0}, uid=0, exe_trusted=True)
    )
    assert only(run(builder.build()), FindingKind.GHOST_MEMORY)


@pytest.mark.parametrize(
    ("gpu_kwargs", "note"),
    [
        ({"numa_node": 1}, "coherent memory"),
        # Its NUMA node could not be read: the memory may be coherent (kept by design).
        ({"numa_unknown": True, "allocated": LEAK}, "whether its memory is coherent is unknown"),
        ({"api": "v1", "used_v1": 4 * LEAK}, "v1 memory API"),  # too much to be idle
        ({"allocated": None}, "allocated memory unknown"),
        ({"memory_known": False}, "allocated memory unknown"),  # not read at all
    ],
)
def test_no_ghost_without_trustworthy_memory_figures(
    gpu_kwargs: dict[str, object], note: str
) -> None:
    result = run(HostBuilder().gpu(0, **gpu_kwargs).build())  # type: ignore[arg-type]
    assert FindingKind.GHOST_MEMORY not in {f.kind for f in result.findings}
    assert note in " ".join(result.notes[gpu_uuid(0)])


def test_v1_ghost_detection_starts_once_an_idle_baseline_is_learned() -> None:
    idle = run(HostBuilder().gpu(0, api="v1", used_v1=600 * MIB).build())
    assert idle.state.baselines == {gpu_uuid(0) + "@v1": 600 * MIB}
    leaked = run(HostBuilder().gpu(0, api="v1", used_v1=600 * MIB + LEAK).build(), idle.state)
    ghost = only(leaked, FindingKind.GHOST_MEMORY)
    assert (ghost.memory, ghost.evidence["baseline_learned"]) == (LEAK, True)


def test_baseline_keeps_the_minimum_and_learns_only_when_idle() -> None:
    state = AssessState(boot_id="boot-1")
    for allocated in (9 * MIB, 4 * MIB, 7 * MIB):
        state = run(HostBuilder().gpu(0, allocated=allocated).build(), state).state
    assert state.baselines == {gpu_uuid(0): 4 * MIB}
    not_idle = [
        HostBuilder().gpu(0, allocated=MIB).proc(2200, holds={0}, uvm=True, ppid=1),
        HostBuilder().gpu(0, allocated=MIB).nvml(0, 2201),
        HostBuilder(scan_mode="targeted").gpu(0, allocated=MIB),
        HostBuilder().gpu(0, allocated=MIB).proc(2202, ppid=1, unreadable=True),
        HostBuilder().gpu(0, allocated=MIB, processes_readable=False),
        HostBuilder().gpu(0, allocated=MIB, numa_node=0),
        HostBuilder().gpu(0, allocated=MIB, numa_unknown=True),
    ]
    for builder in not_idle:
        assert run(builder.build(), state).state.baselines == {gpu_uuid(0): 4 * MIB}
    with_floor = (
        HostBuilder()
        .gpu(0, allocated=3 * MIB)
        .proc(2203, comm="nvidia-persiste", holds={0}, uid=0, exe_trusted=True)
    )
    assert run(with_floor.build(), state).state.baselines == {gpu_uuid(0): 3 * MIB}


def test_learned_baseline_raises_the_ghost_threshold() -> None:
    state = AssessState(baselines={gpu_uuid(0): LEAK}, boot_id="boot-1")
    result = run(HostBuilder().gpu(0, allocated=LEAK + MIB).build(), state)
    assert kinds(result) == []


# --- unaccounted memory -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("used", "expected"),
    [(500 * MIB, True), (5 * LEAK, False), (None, False)],
)
def test_unaccounted_memory_compares_allocated_with_live_owners(
    used: int | None, expected: bool
) -> None:
    builder = (
        HostBuilder()
        .gpu(0, allocated=4 * LEAK)
        .proc(2300, holds={0}, uvm=True)
        .nvml(0, 2300, used=used)
    )
    result = run(builder.build())
    found = [f for f in result.findings if f.kind is FindingKind.UNACCOUNTED_MEMORY]
    assert bool(found) is expected
    if found:
        assert found[0].actionable is False
        assert found[0].evidence["accounted"] == used


# --- PID trust and report-only conditions -----------------------------------------------------


@pytest.mark.parametrize("garbage", [[0], [4294967295], [0, 4294967295]])
def test_impossible_pids_lose_pid_trust_and_nothing_is_actionable(garbage: list[int]) -> None:
    builder = orphan_host()
    for pid in garbage:
        builder.nvml(0, pid)
    first = run(builder.build())
    result = run(after_parent_died(builder).build(), first.state)
    assert "impossible PIDs" in result.report_only[NODE]
    assert result.findings
    assert not any(f.actionable for f in result.findings)
    assert only(result, FindingKind.ORPHANED)  # still reported, with the reason


def test_many_unexplained_dead_pids_lose_trust_but_explained_ones_do_not() -> None:
    builder = HostBuilder().gpu(0, allocated=LEAK)
    for pid in (3001, 3002, 3003):
        builder.nvml(0, pid)
    assert "do not resolve" in run(builder.build()).report_only[NODE]
    two = HostBuilder().gpu(0, allocated=LEAK).nvml(0, 3001).nvml(0, 3002)
    assert NODE not in run(two.build()).report_only
    # three dead ranks whose workers we can still see: a crash, not garbage
    crashed = HostBuilder().gpu(0, allocated=LEAK)
    for rank in (3001, 3002, 3003):
        crashed.nvml(0, rank).proc(rank + 100, ppid=1, pgid=rank, sid=rank, holds={0}, uvm=True)
    result = run(crashed.build())
    assert NODE not in result.report_only
    assert sorted(f.pid or 0 for f in result.findings if f.kind is FindingKind.ORPHANED) == [
        3101,
        3102,
        3103,
    ]


def test_dead_pids_seen_alive_before_do_not_lose_trust() -> None:
    builder = HostBuilder().gpu(0, allocated=LEAK)
    for pid in (3201, 3202, 3203):
        builder.proc(pid, ppid=1, holds={0}, uvm=True).nvml(0, pid)
    first = run(builder.build())
    for pid in (3201, 3202, 3203):
        builder.kill(pid)
    result = run(builder.build(), first.state)
    assert NODE not in result.report_only
    assert all(f.actionable for f in result.findings)
    assert [f.kind for f in result.findings] == [FindingKind.DEAD_PROCESS] * 3 + [
        FindingKind.GHOST_MEMORY
    ]


@pytest.mark.parametrize(
    ("builder_kwargs", "key", "text"),
    [
        ({"mps_server_running": True}, NODE, "MPS"),
        ({"host_namespaces": False}, NODE, "host PID"),
        ({"host_namespaces": None}, NODE, "cannot tell"),
        ({"wedged": True}, NODE, "wedged"),
    ],
)
@pytest.mark.parametrize("scenario", ["orphan", "ghost"])
def test_node_wide_report_only_conditions_make_nothing_actionable(
    builder_kwargs: dict[str, object], key: str, text: str, scenario: str
) -> None:
    def host() -> HostBuilder:
        builder = HostBuilder(**builder_kwargs)  # type: ignore[arg-type]
        if scenario == "ghost":
            return builder.gpu(0, allocated=LEAK)
        return (
            builder.gpu(0, allocated=LEAK)
            .proc(200, holds={0}, uvm=True)
            .proc(201, ppid=200, holds={0}, uvm=True)
            .nvml(0, 200)
        )

    first = run(host().build())
    result = run(
        after_parent_died(host()).build() if scenario == "orphan" else host().build(), first.state
    )
    assert text in result.report_only[key]
    assert result.findings
    assert not any(f.actionable for f in result.findings)


@pytest.mark.parametrize(
    ("error", "said"),
    [("libnvidia-ml.so.1 not found", "libnvidia-ml.so.1 not found"), (None, "no driver")],
)
def test_a_node_without_nvml_is_report_only_and_says_why(error: str | None, said: str) -> None:
    """No NVML reading: a holder of the device files is still reported, never acted on."""
    snapshot = orphan_host().build()
    nvml = dataclasses.replace(snapshot.nvml, available=False, error=error, gpus=())
    result = run(dataclasses.replace(snapshot, nvml=nvml))
    assert result.report_only[NODE] == f"NVML unavailable: {said}"
    assert not any(f.actionable for f in result.findings)


@pytest.mark.parametrize(
    ("gpu_kwargs", "text"),
    [({"mig": True}, "MIG"), ({"lost": True}, "GPU lost")],
)
def test_gpu_report_only_conditions_make_that_gpus_findings_not_actionable(
    gpu_kwargs: dict[str, object], text: str
) -> None:
    def host() -> HostBuilder:
        return (
            HostBuilder()
            .gpu(0, allocated=LEAK, **gpu_kwargs)  # type: ignore[arg-type]
            .gpu(1, allocated=LEAK)
            .proc(200, holds={0}, uvm=True)
            .proc(201, ppid=200, holds={0}, uvm=True)
            .nvml(0, 200)
            .nvml(1, 2400)
        )

    first = run(host().build())
    result = run(after_parent_died(host()).build(), first.state)
    assert text in result.report_only[gpu_uuid(0)]
    assert NODE not in result.report_only
    for finding in result.findings:
        assert finding.actionable is (finding.gpu == gpu_uuid(1)), finding
    assert {f.kind for f in result.findings if f.gpu == gpu_uuid(1)} == {
        FindingKind.DEAD_PROCESS,
        FindingKind.GHOST_MEMORY,
    }


# --- self, lineage, PID reuse, abandoned ------------------------------------------------------


def test_own_processes_are_never_listed() -> None:
    builder = HostBuilder(self_pids=frozenset({2500, 2501}))
    builder.gpu(0, allocated=LEAK).nvml(0, 2501)
    builder.proc(2500, ppid=1, comm="gpuwatchd", holds={0})
    builder.proc(2501, ppid=2500, comm="python3", holds={0}, uvm=True)
    result = run(builder.build())
    assert all(r.pid not in {2500, 2501} for r in result.roles)
    assert all(f.pid not in {2500, 2501} for f in result.findings)
    assert all(i.pid not in {2500, 2501} for i in result.state.lineage)
    assert [f.kind for f in result.findings] == [FindingKind.GHOST_MEMORY]


def test_lineage_is_keyed_by_identity_so_a_reused_pid_starts_fresh() -> None:
    """Memory is low here, so only the recorded parent could make 201 an orphan."""
    first = run(orphan_host(allocated=2 * MIB).build())
    worker = ProcessIdentity(201, orphan_host().build().processes[201].start_ticks or 0)
    assert first.state.lineage[worker].ppid == 200
    control = run(after_parent_died(orphan_host(allocated=2 * MIB)).build(), first.state)
    assert only(control, FindingKind.ORPHANED).evidence["link"] == "recorded parent"
    # 201 exits; an unrelated process gets PID 201 with another start time and ppid 1
    reused = after_parent_died(orphan_host(allocated=2 * MIB))
    reused.change(201, start_ticks=99_999, sid=201, pgid=201)
    result = run(reused.build(), first.state)
    assert worker not in result.state.lineage
    assert result.state.lineage[ProcessIdentity(201, 99_999)].ppid == 1
    assert kinds(result) == [("dead_process", 200), ("hidden_holder", 201)]


def test_process_that_arrives_after_memory_became_unowned_is_not_its_heir() -> None:
    """A new job's process that opened every GPU but has no context yet is not an orphan."""
    leaked = HostBuilder().gpu(0, allocated=LEAK).nvml(0, 200)
    first = run(leaked.at(1000.0).build())
    assert first.state.unaccounted_since == {gpu_uuid(0): 1000.0}
    newcomer = leaked.proc(3300, ppid=1, holds={0}, uvm=True).at(1005.0)
    result = run(newcomer.build(), first.state)
    assert FindingKind.ORPHANED not in {f.kind for f in result.findings}
    assert "nothing ties it" in only(result, FindingKind.HIDDEN_HOLDER).reason
    assert result.state.unaccounted_since == {gpu_uuid(0): 1000.0}


def test_lineage_keeps_first_seen_and_survives_until_the_process_is_gone() -> None:
    first = run(orphan_host().at(10.0).build())
    second = run(after_parent_died(orphan_host()).at(20.0).build(), first.state)
    ident = next(i for i in second.state.lineage if i.pid == 201)
    assert second.state.lineage[ident] == Lineage(200, 201 and 200, 200, None, 10.0)
    assert any(i.pid == 200 for i in second.state.lineage)  # NVML still lists it dead
    gone = HostBuilder().gpu(0).at(30.0).build()
    assert run(gone, second.state).state.lineage == {}
    targeted = HostBuilder(scan_mode="targeted").gpu(0).at(30.0).build()
    assert run(targeted, second.state).state.lineage == second.state.lineage


@pytest.mark.parametrize("boot_id", ["boot-2", None])
def test_lineage_resets_when_the_boot_id_changes(boot_id: str | None) -> None:
    first = run(orphan_host(allocated=2 * MIB).build())
    rebooted = after_parent_died(orphan_host(allocated=2 * MIB)).at(2000.0)
    rebooted.change(201, pgid=201, sid=201)  # only the recorded parent ties it
    rebooted.boot_id = boot_id
    result = assess(rebooted.build(), first.state, DETECTION)
    assert all(lin.first_seen == rebooted.monotonic for lin in result.state.lineage.values())
    assert kinds(result) == [("dead_process", 200), ("hidden_holder", 201)]


@pytest.mark.parametrize("cgroup", [cg_slurm("42"), cg_pod("p-1"), cg_container("c1")])
def test_holder_of_an_ended_job_is_abandoned_only_when_told(cgroup: object) -> None:
    builder = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(2600, ppid=1, cgroup=cgroup, holds={0}, uvm=True)  # type: ignore[arg-type]
        .nvml(0, 2600)
    )
    job = builder.build().processes[2600].cgroup.job_key  # type: ignore[union-attr]
    assert job is not None
    assert kinds(run(builder.build())) == []
    said = 10**9  # the scheduler's word, after the process started
    abandoned = only(run(builder.build(), handovers={job: said}), FindingKind.ABANDONED)
    assert (abandoned.pid, abandoned.evidence["job"]) == (2600, job)


def _job_holder(start: int, cgroup: CgroupInfo) -> HostBuilder:
    return (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(2600, ppid=1, cgroup=cgroup, holds={0}, uvm=True, start=start)
        .nvml(0, 2600)
    )


@pytest.mark.parametrize(
    ("start", "said", "stepd", "abandoned"),
    [
        (5_000, 9_000, None, True),  # older than the word: covered
        (9_000, 9_000, None, False),  # started as the word was said: not older
        (9_500, 9_000, None, False),  # a requeued job's process, younger than the word
        (5_000, None, None, False),  # when it was said is unknown: covers nothing
        (5_000, 9_000, 4_000, True),  # the ended job's own slurmstepd, still around
        (5_000, 9_000, 9_100, False),  # a slurmstepd started after the word: requeued
        (5_000, 9_000, 9_000, False),  # ... or in the same tick: not known to be older
    ],
)
def test_the_schedulers_word_covers_only_processes_older_than_it_and_no_requeued_job(
    start: int, said: int | None, stepd: int | None, abandoned: bool
) -> None:
    snapshot = _job_holder(start, cg_slurm("42")).build()
    stepds = {} if stepd is None else {"slurm:42": stepd}
    snapshot = dataclasses.replace(snapshot, handovers={"slurm:42": said}, job_stepds=stepds)
    result = assess(snapshot, AssessState(boot_id=snapshot.boot_id), DETECTION)
    assert (FindingKind.ABANDONED in {f.kind for f in result.findings}) is abandoned
    if stepd is not None and not abandoned:
        assert job_ended(snapshot.processes[2600], snapshot) is None


def test_a_job_directory_judged_ended_ends_that_directory_only() -> None:
    """The attack of issue 20: a forged …/slurmstepd.scope/job_42 with no step marked the real,
    running job 42 abandoned, because the job was judged once per id. Now a directory judged
    ended (collect/jobs.py does so only at root's own location) ends its own processes."""
    forged = cg_slurm("42", scope="/deleg.slice/forged/slurmstepd.scope")
    real = cg_slurm("42")
    snapshot = (
        HostBuilder()
        .gpu(0, allocated=LEAK)
        .proc(2600, ppid=1, cgroup=real, holds={0}, uvm=True)
        .proc(2601, ppid=1, cgroup=forged, holds={0}, uvm=True)
        .build()
    )
    assert real.slurm_job_dir is not None
    assert forged.slurm_job_dir is not None
    ended = dataclasses.replace(snapshot, ended_job_dirs=frozenset({forged.slurm_job_dir}))
    result = assess(ended, AssessState(boot_id=snapshot.boot_id), DETECTION)
    assert [f.pid for f in result.findings if f.kind is FindingKind.ABANDONED] == [2601]
    really = dataclasses.replace(snapshot, ended_job_dirs=frozenset({real.slurm_job_dir}))
    result = assess(really, AssessState(boot_id=snapshot.boot_id), DETECTION)
    assert [f.pid for f in result.findings if f.kind is FindingKind.ABANDONED] == [2600]


def test_holder_of_ctl_and_uvm_only_is_an_unattributed_hidden_holder() -> None:
    builder = HostBuilder().gpu(0).proc(2700, ppid=1, holds=(), uvm=True)
    result = run(builder.build())
    hidden = only(result, FindingKind.HIDDEN_HOLDER)
    assert (hidden.gpu, hidden.evidence["unattributed"]) == (None, True)
    assert [(r.pid, r.gpu, r.role) for r in result.roles] == [(2700, NODE, "hidden")]


# --- state round trip -------------------------------------------------------------------------


def test_state_round_trips_through_json() -> None:
    state = run(after_parent_died(orphan_host()).build(), run(orphan_host().build()).state).state
    assert AssessState.from_json(state.to_json()) == state


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        {"version": 3},
        {"version": True},
        {"version": 2.0},
        {"version": 1, "boot_id": 3},
        {"version": 2, "inheritance": {}},
        {"version": 2, "inheritance": [{"pid": 1, "start_ticks": 2}]},
        {"version": 2, "inheritance": [{"pid": 1, "start_ticks": 2, "owners": [[3, 4, 1]]}]},
        {"version": 2, "inheritance": [{"pid": 1, "start_ticks": 2, "owners": [[3, 4, "cut"]]}]},
        {"version": 2, "inheritance": [{"pid": 1, "start_ticks": 2, "owners": [[3, 4]]}]},
        {"version": 2, "inheritance": [{"pid": 1, "start_ticks": 2, "owners": [[3, 4, True]] * 9}]},
        {"version": 1, "baselines": {"GPU-1": -1}},
        {"version": 1, "baselines": {"GPU-1": True}},
        {"version": 1, "lineage": {}},
        {"version": 1, "lineage": [{"pid": 1}]},
        {"version": 1, "lineage": [{"pid": 1, "start_ticks": 2, "first_seen": "x"}]},
        {"version": 1, "lineage": [{"pid": 1, "start_ticks": 2, "first_seen": 1, "ppid": "1"}]},
    ],
)
def test_malformed_state_raises_value_error(data: object) -> None:
    with pytest.raises(ValueError, match=r"."):
        AssessState.from_json(data)


@pytest.mark.parametrize(
    ("part", "value", "message"),
    [
        ("baselines", [], "baselines must be an object"),
        ("unaccounted_since", [], "unaccounted_since must be an object"),
        ("unaccounted_since", {"GPU-1": True}, "bad unaccounted_since entry: 'GPU-1': True"),
        ("unaccounted_since", {"GPU-1": "1"}, "bad unaccounted_since entry: 'GPU-1': '1'"),
        ("lineage", {}, "lineage must be a list"),
        ("owners", {}, "owners must be a list"),
        ("inheritance", {}, "inheritance must be a list"),
        ("lineage", [{"pid": 1, "start_ticks": 2, "first_seen": True}], "a numeric first_seen"),
    ],
)
def test_a_damaged_state_part_is_named_in_the_error(part: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        AssessState.from_json({"version": 2, part: value})


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_saved_time_that_is_not_finite_is_refused(value: str) -> None:
    # json.loads reads NaN and Infinity; the state is written with allow_nan=False, so a
    # non-finite time kept from the file would make every later save of the state fail.
    since = json.loads(f'{{"version": 2, "unaccounted_since": {{"GPU-1": {value}}}}}')
    with pytest.raises(ValueError, match="bad unaccounted_since entry: 'GPU-1'"):
        AssessState.from_json(since)
    entry = f'{{"pid": 5, "start_ticks": 50, "first_seen": {value}}}'
    with pytest.raises(ValueError, match="lineage entry needs a numeric first_seen"):
        AssessState.from_json(json.loads(f'{{"version": 2, "lineage": [{entry}]}}'))


def test_the_saved_lineage_keeps_its_keys_in_order() -> None:
    state = AssessState(lineage={ProcessIdentity(5, 50): Lineage(1, 2, 3, "job", 9.5)})
    assert json.dumps(state.to_json()["lineage"]) == json.dumps(
        [{"pid": 5, "start_ticks": 50, "ppid": 1, "pgid": 2, "sid": 3, "job": "job",
          "first_seen": 9.5}]
    )  # fmt: skip


# --- property: holders in a live owner's tree are never orphaned -------------------------------


@st.composite
def healthy_hosts(draw: st.DrawFn) -> Snapshot:
    """Random hosts where every holder descends from a live context owner.

    Adversarial extras: dead listed PIDs that are the holders' process groups or sessions,
    leaked memory everywhere, lost parents, unknown columns and NVML-only clients.
    """
    gpus = draw(st.integers(1, 4))
    builder = HostBuilder(scan_mode=draw(st.sampled_from(["full", "targeted"])))
    for index in range(gpus):
        builder.gpu(index, allocated=draw(st.sampled_from([2 * MIB, LEAK, 8 * LEAK])))
    next_pid = 1000
    dead_pids = iter(range(100_000, 100_100))
    for _owner in range(draw(st.integers(1, 3))):
        owner = next_pid
        next_pid += 1
        minors = draw(st.frozensets(st.integers(0, gpus - 1), min_size=1))
        dead = next(dead_pids)
        builder.proc(
            owner,
            ppid=1,
            pgid=draw(st.sampled_from([owner, dead, None])),
            sid=draw(st.sampled_from([owner, dead, None])),
            cgroup=draw(st.sampled_from([cg_session(), cg_root(), cg_slurm("9"), None])),
            holds=minors,
            uvm=True,
        )
        builder.nvml(min(minors), owner, used=draw(st.sampled_from([None, MIB, LEAK])))
        if draw(st.booleans()):
            builder.nvml(draw(st.integers(0, gpus - 1)), dead)
        frontier = [owner]
        for _child in range(draw(st.integers(0, 6))):
            child = next_pid
            next_pid += 1
            parent = draw(st.sampled_from(frontier))
            builder.proc(
                child,
                ppid=parent,
                pgid=draw(st.sampled_from([child, dead, None, parent])),
                sid=draw(st.sampled_from([child, dead, None, parent])),
                cgroup=draw(st.sampled_from([cg_session(), cg_root(), cg_container("x"), None])),
                state=draw(st.sampled_from(["S", "R", "D"])),
                holds=draw(st.frozensets(st.integers(0, gpus - 1))),
                uvm=draw(st.booleans()),
                via=draw(st.sampled_from(["fd", "map", "both"])),
            )
            frontier.append(child)
    return builder.build()


@settings(max_examples=150, deadline=None)
@given(snapshot=healthy_hosts(), seen_before=st.booleans())
def test_property_holders_in_a_live_owners_tree_are_never_orphaned(
    snapshot: Snapshot, seen_before: bool
) -> None:
    previous = AssessState(boot_id=snapshot.boot_id)
    if seen_before:
        previous = assess(snapshot, previous, DETECTION).state
    result = assess(snapshot, previous, DETECTION)
    assert FindingKind.ORPHANED not in {f.kind for f in result.findings}
    assert all(r.role != "orphaned" for r in result.roles)


def test_a_reset_the_driver_refused_is_a_hidden_holder_on_that_gpu_only() -> None:
    snapshot = HostBuilder().gpu(0).gpu(1).gpu(2).build()
    refused = {gpu_uuid(1): {"gap": "driver_in_use", "incident": "ghost_memory:x"}}
    result = assess(snapshot, AssessState(boot_id=snapshot.boot_id), DETECTION,
                    driver_refused=refused)  # fmt: skip
    hidden = [(f.gpu, f.pid, f.evidence.get("gap")) for f in result.findings
              if f.kind is FindingKind.HIDDEN_HOLDER]  # fmt: skip
    assert hidden == [(gpu_uuid(1), None, "driver_in_use")]
