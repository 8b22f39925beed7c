"""Safety gates that a mutation run found untested, one behaviour each (tests/mutation).

Each test pins what a user or an admin would see go wrong if the gate broke: a process signalled
on a protected GPU, a protected MIG parent's instance re-created, a recovery's final scan that
ignores what it read, an instance re-created while a kill ladder on it runs, a leak judged clean
against the wrong idle baseline, ``check-clean --gpu <bus id>`` that finds no GPU, a live job's
helper signalled, and kcmp's answers about another process taken as the owner's.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from gpuwatchd.cli.check_clean import answer
from gpuwatchd.core.model import (
    MIB,
    Finding,
    FindingKind,
    ProcessIdentity,
    Snapshot,
)
from gpuwatchd.core.vocabulary import Cleanliness, EventName, LadderStatus
from gpuwatchd.decide import patterns
from gpuwatchd.decide.argv import ArgvError, check_hook_command
from gpuwatchd.decide.assess.baselines import V1_BASELINE_SUFFIX
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.shared import NODE
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.gpu_ids import nvml_bus_id, pci_bus_key, same_pci_bus_id
from gpuwatchd.decide.mig.recovery import recovery_blockers
from gpuwatchd.decide.patterns import command_search
from gpuwatchd.decide.plan.decisions import plan
from gpuwatchd.decide.plan.intents import ResetIntent
from gpuwatchd.decide.plan.resets import reset_gates
from gpuwatchd.decide.plan.state import Ladder, PlanState
from gpuwatchd.decide.policy import Detection, Policy, Protect, ResetPolicy, default_rules
from gpuwatchd.decide.verdict import NodeVerdict, judge
from tests.support.gatecases import (
    GPU0,
    _job_host,
    _orphan,
    _plan,
    _protect,
    _signals,
    _whys,
)
from tests.support.migcases import GI1, LEAK, run
from tests.support.migsnap import Inst, with_mig
from tests.support.orphancases import owner_and_worker
from tests.support.snapshots import HostBuilder, gpu_uuid

# --- protect.gpus: the finding's own GPU counts, whatever else the process holds ---------------


def test_a_process_found_on_a_protected_gpu_is_never_signalled_whatever_files_it_holds() -> None:
    """NVML lists the orphan on GPU 0, which is protected; its open device files name only
    GPU 1. The GPU of the finding is protected, so nothing is sent."""
    snapshot = _job_host(holds=frozenset({1})).build()
    result = _plan([_orphan(snapshot, gpu=GPU0)], snapshot, PlanState(), _protect(gpus=(GPU0,)), 0)
    assert _signals(result) == []
    assert _whys(result, EventName.ACTION_REFUSED) == [f"protect: GPU {GPU0} is protected ({GPU0})"]


# --- a MIG instance: its parent's protection, its final scan, a ladder on it --------------------


def _ghost_in_gi1() -> Finding:
    return Finding(FindingKind.GHOST_MEMORY, GI1, None, None, "ghost", memory=LEAK)


def _idle_mig_host(builder: HostBuilder | None = None, **mig: object) -> Snapshot:
    """GPU 0 in MIG mode: GI 1 holds 4 GiB nothing uses; GI 2 runs trainer 700."""
    base = (builder or HostBuilder()).gpu(0).proc(700, ppid=1, holds={0}, uvm=True).build()
    options: dict[str, object] = {
        "instances": [Inst(1, allocated=LEAK), Inst(2, allocated=LEAK, processes=((700, LEAK),))],
        "caps": {700: [(2, 0)]},
    }
    options.update(mig)
    return with_mig(base, **options)  # type: ignore[arg-type]


def _recovering(**changes: object) -> Policy:
    chosen = dataclasses.replace(
        Policy(dry_run=False),
        reset=ResetPolicy(enabled=True, mig_recovery=True, confirm_for=0.0, cooldown=0.0),
    )
    return dataclasses.replace(chosen, **changes)  # type: ignore[arg-type]


def test_a_mig_gpu_protected_by_its_pci_bus_id_has_no_instance_recreated() -> None:
    snapshot = _idle_mig_host()
    parent = snapshot.nvml.gpus[0]
    assert parent.pci_bus_id is not None
    for entry in (parent.pci_bus_id, parent.pci_bus_id.lower()[4:]):  # NVML's and the short form
        chosen = _recovering(protect=Protect(gpus=(entry,)))
        gates = reset_gates(_ghost_in_gi1(), snapshot, chosen, report_only={}, findings=[])
        assert ("protect", f"protect: gpus {entry}") in [(g.name, g.why) for g in gates]


def test_the_final_scan_before_a_recovery_judges_the_fresh_holders_not_the_last_polls() -> None:
    """Between the plan and the destroy, process 900 (unknown to the last poll) opened GI 1's
    capability: the fresh scan sees it and refuses. Trainer 700 held GI 1 at the last poll and
    has let go since: the fresh scan says so, and it refuses nothing."""
    last = _idle_mig_host(caps={700: [(1, 0), (2, 0)]})
    opener = HostBuilder().proc(900, ppid=1, holds={0})
    now = _idle_mig_host(opener, caps={700: [(2, 0)], 900: [(1, 0)]})
    why = recovery_blockers(last, now.holders, now.processes, frozenset(), GI1)
    assert [w for w in why if "PID 900" in w] == why != []
    let_go = _idle_mig_host()
    assert recovery_blockers(last, let_go.holders, let_go.processes, frozenset(), GI1) == []
    assert recovery_blockers(last, last.holders, last.processes, frozenset(), GI1) != []


ROOTS_PERSISTENCED: dict[str, object] = {
    "comm": "nvidia-persistenced",
    "exe": "/usr/bin/nvidia-persistenced",
    "uid": 0,
    "user": "root",
    "exe_trusted": True,
}


def test_the_final_scan_judges_a_reused_pid_by_what_it_is_now() -> None:
    """At the last poll PID 900 was root's nvidia-persistenced (it holds every GPU's node and
    uses no instance); by the final scan it exited and a user's process got PID 900 and opened
    GPU 0's node: that process may use GI 1, so the recovery is refused."""
    daemon = HostBuilder().proc(900, ppid=1, holds={0}, **ROOTS_PERSISTENCED)  # type: ignore[arg-type]
    last = _idle_mig_host(daemon)
    assert recovery_blockers(last, last.holders, {}, frozenset(), GI1) == []
    user = HostBuilder().proc(900, ppid=1, start=99_999, holds={0})
    now = _idle_mig_host(user)
    why = recovery_blockers(last, now.holders, {900: now.processes[900]}, frozenset(), GI1)
    assert why == ["GPU instance 1: PID 900 holding its GPU's device node, instance unknown"]


def test_an_instance_is_not_recreated_while_a_kill_ladder_on_it_runs() -> None:
    """Orphan 700 got its SIGTERM on GI 1 and let go of it, but still lives, found on GPU 1
    now (its ladder follows it there): GI 1 is not re-created while that ladder runs."""
    base = HostBuilder().gpu(0).gpu(1).proc(700, ppid=1, holds={0, 1}, uvm=True).build()
    snapshot = with_mig(
        base, instances=[Inst(1, allocated=LEAK), Inst(2)], caps={700: [(2, 0)]}
    )  # fmt: skip
    start = snapshot.processes[700].start_ticks or 0
    ladder = Ladder(
        target=f"700@{start}", pid=700, start_ticks=start,
        finding_key=f"orphaned:{GI1}:700@{start}", rule="orphans", gpu=GI1,
        steps=(("SIGTERM", 600.0), ("SIGKILL", 600.0)), step=1, due=snapshot.monotonic + 600.0,
        status=LadderStatus.ACTIVE, dry_run=False, started=snapshot.monotonic,
    )  # fmt: skip
    elsewhere = Finding(
        FindingKind.ORPHANED, gpu_uuid(1), 700, start, "inherited GPU 1 from dead owner PID 600",
        memory=512 * MIB, evidence={"uvm": True, "tie": "dead_owner"},
    )  # fmt: skip
    ghosts = [f for f in run(snapshot).findings if f.kind is FindingKind.GHOST_MEMORY]
    assert [f.gpu for f in ghosts] == [GI1]
    now = snapshot.monotonic + 1.0
    out = plan(
        [*ghosts, elsewhere], snapshot, PlanState(ladders={ladder.target: ladder}),
        _recovering(rules=default_rules()), now=now, wall=now,
    )  # fmt: skip
    assert [i for i in out.intents if isinstance(i, ResetIntent)] == []
    said = [str(e.fields.get("why")) for e in out.events if e.name == EventName.RESET_REFUSED]
    assert any("an escalation on this GPU is in progress" in w for w in said), said


# --- the verdict: the learned idle baseline, the GPU's bus id -----------------------------------


def _verdict(snapshot: Snapshot, baselines: dict[str, int]) -> NodeVerdict:
    state = AssessState(boot_id=snapshot.boot_id, baselines=baselines)
    return judge(snapshot, assess(snapshot, state, Detection()), Policy())


def test_leftover_memory_is_judged_against_the_learned_idle_baseline() -> None:
    """A targeted scan (no ghost_memory finding is made on one) leaves GPU 0's memory to the
    verdict. GPU 0 idles at 16 MiB (learned); the margin + 32 MiB allocated is a leak the
    default baseline (64 MiB) would hide. Learned for v1 "used" memory too, which has its own
    baseline."""
    detection = Detection()
    learned = 16 * MIB
    leaked = learned + detection.ghost_margin + 16 * MIB
    assert leaked <= detection.default_baseline + detection.ghost_margin  # hidden by the default
    monitor = HostBuilder().proc(900, comm="gpustat", holds={0}, uvm=False)
    monitor.scan_mode = "targeted"
    snapshot = monitor.gpu(0, allocated=leaked).build()
    (gpu,) = _verdict(snapshot, {gpu_uuid(0): learned}).gpus
    assert gpu.state is Cleanliness.DIRTY
    assert [r.kind for r in gpu.reasons] == ["leftover_memory"]
    assert "above its learned idle baseline" in gpu.reasons[0].text
    assert _verdict(snapshot, {}).gpus[0].state is Cleanliness.CLEAN  # the default hides it
    monitor = HostBuilder().proc(900, comm="gpustat", holds={0}, uvm=False)
    monitor.scan_mode = "targeted"
    v1 = monitor.gpu(0, allocated=None, api="v1", used_v1=leaked).build()
    (gpu,) = _verdict(v1, {gpu_uuid(0) + V1_BASELINE_SUFFIX: learned}).gpus
    assert gpu.state is Cleanliness.DIRTY


def test_check_clean_selects_a_dirty_gpu_by_its_pci_bus_id() -> None:
    snapshot = (
        HostBuilder()
        .gpu(0)
        .gpu(1, allocated=LEAK)
        .proc(201, ppid=200, pgid=200, sid=200, holds={1}, uvm=True)
        .nvml(1, 200, used=LEAK)
        .build()
    )
    verdict = _verdict(snapshot, {})
    bus = {g.uuid: g.pci_bus_id for g in snapshot.nvml.gpus}
    assert [g.pci_bus_id for g in verdict.gpus] == [bus[gpu_uuid(0)], bus[gpu_uuid(1)]]
    shown = verdict.to_json()["gpus"]
    assert isinstance(shown, list)
    assert [g["pci_bus_id"] for g in shown] == [bus[gpu_uuid(0)], bus[gpu_uuid(1)]]
    assert answer(verdict, [str(bus[gpu_uuid(1)])])[0] == 1
    assert answer(verdict, [str(bus[gpu_uuid(0)])])[0] == 0


# --- the orphan rule: a live owner's helper, kcmp answers about other processes --------------


def _verdict_on(result_findings: tuple[Finding, ...], pid: int) -> str:
    return next((f.kind.value for f in result_findings if f.pid == pid), "no finding")


def test_a_live_owners_reparented_helper_is_no_heir_of_unowned_memory() -> None:
    """Trainer 800 owns a context on GPU 1 and lives; its helper 801 (reparented to init, its
    own session) holds GPU 0, whose memory no live owner accounts for. 800 lives, so 801 is
    not the heir of GPU 0's memory: it is reported, never signalled."""

    def host(at: float, parent: int, group: int) -> Snapshot:
        return (
            HostBuilder(monotonic=at)
            .gpu(0, allocated=LEAK)
            .gpu(1, allocated=LEAK)
            .proc(800, ppid=1, pgid=800, sid=800, holds={1}, uvm=True)
            .nvml(1, 800, used=LEAK)
            .proc(801, ppid=parent, pgid=group, sid=group, holds={0}, uvm=True)
            .build()
        )

    first = host(1000.0, parent=800, group=800)
    before = assess(first, AssessState(boot_id=first.boot_id), Detection())
    later = host(1010.0, parent=1, group=801)
    result = assess(later, before.state, Detection())
    assert _verdict_on(result.findings, 801) != "orphaned"


def test_kcmp_answers_about_another_owner_do_not_excuse_files_the_holder_opened_itself() -> None:
    """kcmp found that none of 801's device files are its former owner 800's (it opened its
    own, a spawn worker), and that it shares files with an unrelated process 790: killing 801
    frees none of 800's memory, so it stays a hidden holder."""
    alive = owner_and_worker(LEAK)
    first = assess(alive, AssessState(boot_id=alive.boot_id), Detection())
    (holder,) = [i for i in first.state.inheritance if i.pid == 801]
    ((owner, shared),) = first.state.inheritance[holder]
    assert (owner.pid, shared) == (800, False)
    other = ProcessIdentity(790, 12345)
    state = dataclasses.replace(first.state, inheritance={holder: ((owner, False), (other, True))})
    dead = (
        HostBuilder(monotonic=1010.0)
        .gpu(0, allocated=LEAK)  # nothing listed: the memory has no owner now
        .proc(801, ppid=1, pgid=800, sid=800, holds={0}, uvm=True)
        .build()
    )
    result = assess(dead, state, Detection())
    (finding,) = [f for f in result.findings if f.pid == 801]
    assert finding.kind is FindingKind.HIDDEN_HOLDER
    assert finding.evidence["own_files"] is True


# --- what was recorded as equivalent and is not -----------------------------------------------


def test_after_double_dash_a_program_named_like_an_inline_flag_is_a_program() -> None:
    """``python3 -- -c`` runs the script file ``-c``, not inline code (``--`` ends the
    interpreter's options): accepted. ``python3 -c`` is refused, saying which flag."""
    check_hook_command(["python3", "--", "-c"])
    check_hook_command(["sudo", "--", "-s"])
    with pytest.raises(ArgvError, match="'python3 -c' runs a shell string or inline code"):
        check_hook_command(["python3", "-c", "x"])


@pytest.mark.parametrize("boundary_on_empty", [False, True])
def test_an_empty_command_line_meets_a_word_boundary_as_this_pythons_re_says(
    boundary_on_empty: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``re`` finds no ``\\B`` in "" before Python 3.14 and finds one from 3.14 on; the linear
    matcher answers as the running Python's ``re`` does, both ways (the other one forced)."""
    monkeypatch.setattr(patterns, "_NON_BOUNDARY_ON_EMPTY", boundary_on_empty)
    patterns._search.cache_clear()  # answers are cached per (pattern, text)
    assert command_search(re.compile(r"\B"), "") is boundary_on_empty
    assert command_search(re.compile(r"\b"), "") is False
    patterns._search.cache_clear()


# --- how a GPU is named ---------------------------------------------------------------------


def test_a_pci_domain_of_two_hex_digits_is_read_as_hex() -> None:
    """``001a:3b:00.0`` is domain 0x1a (NVML: ``0000001A:3B:00.0``), not another domain."""
    assert pci_bus_key("001a:3b:1f.7") == (0x1A, 0x3B, 0x1F, 7)
    assert nvml_bus_id((0x1A, 0x3B, 0x1F, 7)) == "0000001A:3B:1F.7"
    assert same_pci_bus_id("001a:3b:00.0", "0000001A:3B:00.0")
    assert not same_pci_bus_id("001a:3b:00.0", "001b:3b:00.0")


# --- PID trust: what explains a dead PID that NVML lists ---------------------------------------


def _dead_ranks(builder: HostBuilder) -> HostBuilder:
    for rank in (3001, 3002, 3003):
        builder.nvml(0, rank)
    return builder


def test_dead_listed_pids_are_explained_only_by_a_process_descending_from_them() -> None:
    """Three dead PIDs NVML lists lose trust (the node turns report-only) unless a live process
    descends from them, now (its parent) or as first seen (its recorded parent): a live
    process unrelated to them explains nothing."""
    unrelated = _dead_ranks(HostBuilder().gpu(0, allocated=LEAK))
    unrelated.proc(4000, ppid=1, pgid=4000, sid=4000)
    result = assess(unrelated.build(), AssessState(boot_id="b"), Detection())
    assert "do not resolve" in result.report_only[NODE]
    children = _dead_ranks(HostBuilder().gpu(0, allocated=LEAK))
    for rank in (3001, 3002, 3003):
        children.proc(rank + 100, ppid=rank, pgid=rank + 100, sid=rank + 100)
    result = assess(children.build(), AssessState(boot_id="b"), Detection())
    assert NODE not in result.report_only
    # Holders first seen as the ranks' children (the ranks never listed, never seen); now
    # reparented.
    before = HostBuilder(monotonic=1000.0).gpu(0)
    for rank in (3001, 3002, 3003):
        before.proc(rank + 100, ppid=rank, pgid=rank + 100, sid=rank + 100, holds={0}, uvm=True)
    first = before.build()
    state = assess(first, AssessState(boot_id=first.boot_id), Detection()).state
    later = _dead_ranks(HostBuilder(monotonic=1010.0).gpu(0, allocated=LEAK))
    for rank in (3001, 3002, 3003):
        later.proc(rank + 100, ppid=1, pgid=rank + 100, sid=rank + 100, holds={0}, uvm=True)
    assert NODE not in assess(later.build(), state, Detection()).report_only
