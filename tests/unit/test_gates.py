"""The safety gates, each with a test that fails when the gate breaks (tests/mutation finds the
gaps): who holds a GPU when many processes hold it, in every order; a ladder whose target
became untouchable; pause for every kind of reset; a reset waiting for a kill ladder;
``protect.gpus`` beside the finding's own GPU; which rule selects a finding. The reset gates
that need history, and the drain wait, are in tests/unit/test_reset_gates.py.

Everything goes through the public functions (``live_holder``, ``reset_blockers``,
``driver_refusers``, ``reset_gates``, ``plan``, ``record_*``, ``rule_for``, ``refusal``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import replace

import pytest

from gpuwatchd.core import model
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.floor import driver_refusers, infrastructure, live_holder, reset_blockers
from gpuwatchd.decide.plan.decisions import set_paused
from gpuwatchd.decide.plan.outcomes import record_exit
from gpuwatchd.decide.plan.resets import reset_gates
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import (
    HealthPolicy,
    Policy,
    Rule,
    Step,
)
from gpuwatchd.decide.targets import process_facts, refusal, rule_for
from tests.support.gatecases import (
    GPU0,
    GPU1,
    JOB,
    RESET_DRAIN,
    SELF,
    _after_sigterm,
    _ghost,
    _health,
    _hooks,
    _idle_host,
    _job_host,
    _orphan,
    _plan,
    _policy,
    _protect,
    _resets,
    _signals,
    _whys,
)
from tests.support.snapshots import HostBuilder, cg_unit

# --- who holds the GPU: several holders, in every order ---------------------------------------

# Each role: how to add it to a builder holding GPU 0 (pid chosen by the test).
ROLES = ("persistenced", "dcgm", "self", "job")


def _persistenced(builder: HostBuilder, pid: int, minors: Sequence[int], ctl: bool | None) -> None:
    """Root's own nvidia-persistenced: infrastructure only from facts a user cannot forge
    (floor.py: root's executable in root's folder, run by root)."""
    builder.proc(
        pid, comm="nvidia-persiste", exe="/usr/bin/nvidia-persistenced", uid=0, user="root",
        exe_trusted=True, holds=tuple(minors), ctl=ctl,
    )  # fmt: skip


def _add(builder: HostBuilder, role: str, pid: int, minors: frozenset[int]) -> None:
    if role == "persistenced":
        _persistenced(builder, pid, sorted(minors), ctl=None)
    elif role == "dcgm":
        # infrastructure by its unit, not by its name: root's process in root's unit
        builder.proc(
            pid, comm="exporter", uid=0, cgroup=cg_unit("nvidia-dcgm.service"), holds=minors
        )
    elif role == "self":
        builder.hold(pid, minors)  # the daemon's own processes are in no snapshot's processes
    else:
        builder.proc(pid, comm="python3", holds=minors, uvm=True)


def _orders() -> list[tuple[tuple[str, ...], bool]]:
    """Every order of the four roles, with PIDs rising along it and falling along it (the plan
    gate walks holders in listing order, the final scan in PID order)."""
    return [(order, rising) for order in itertools.permutations(ROLES) for rising in (True, False)]


def _holders(
    order: Sequence[str], rising: bool, *, without: str = ""
) -> tuple[model.Snapshot, dict[str, int]]:
    """GPU 0 held by the roles in ``order``; ``pids["self"]`` is the daemon's worker."""
    pids = {
        role: 100 + 10 * (position if rising else 10 - position)
        for position, role in enumerate(order)
    }
    builder = HostBuilder(self_pids=frozenset({pids["self"]})).gpu(0).gpu(1)
    for role in order:
        if role != without:
            _add(builder, role, pids[role], frozenset({0}))
    return builder.build(), pids


def _id(case: tuple[tuple[str, ...], bool]) -> str:
    order, rising = case
    return ">".join(order) + (" pids rising" if rising else " pids falling")


@pytest.mark.parametrize("case", _orders(), ids=[_id(c) for c in _orders()])
def test_a_job_beside_infrastructure_and_our_worker_blocks_the_reset_in_any_order(
    case: tuple[tuple[str, ...], bool],
) -> None:
    """Persistenced, DCGM and our NVML worker listed before (or after) a job on the same GPU:
    the job is seen by plan's gate and by the final scan; infrastructure blocks only the final
    scan; our own worker blocks neither."""
    snapshot, pids = _holders(*case)
    holders, procs, job, ours = (
        snapshot.holders,
        snapshot.processes,
        pids["job"],
        snapshot.self_pids,
    )
    assert live_holder(holders, procs, 0, ours) == f"pid {job} holds the GPU"
    blockers = reset_blockers(holders, procs, 0, ours)
    assert sorted(int(b.split()[1]) for b in blockers) == sorted(
        [pids["persistenced"], pids["dcgm"], job]
    )
    assert driver_refusers(holders, 0, ours) == sorted([pids["persistenced"], pids["dcgm"], job])
    gates = reset_gates(_ghost(), snapshot, _policy(), report_only={}, findings=[_ghost()])
    assert [(g.name, g.why) for g in gates] == [
        ("live_holder", f"live holder: pid {job} holds the GPU")
    ]


@pytest.mark.parametrize("case", _orders()[::4], ids=[_id(c) for c in _orders()[::4]])
def test_infrastructure_and_our_worker_alone_leave_plans_gate_open(
    case: tuple[tuple[str, ...], bool],
) -> None:
    snapshot, pids = _holders(*case, without="job")
    holders, procs = snapshot.holders, snapshot.processes
    assert live_holder(holders, procs, 0, snapshot.self_pids) is None
    blockers = reset_blockers(holders, procs, 0, snapshot.self_pids)
    assert sorted(int(b.split()[1]) for b in blockers) == sorted(
        [pids["persistenced"], pids["dcgm"]]
    )
    assert reset_gates(_ghost(), snapshot, _policy(), report_only={}, findings=[]) == []


@pytest.mark.parametrize("first", ["persistenced", "self"])
@pytest.mark.parametrize(
    ("case", "holder", "plan_gate", "final_scan"),
    [
        (
            "a holder whose process facts are unknown",
            lambda b: b.hold(900, {0}, uvm=True),
            "pid 900 holds the GPU (process unknown)",
            "pid 900 (?) holds the GPU's device file via fd",
        ),
        (
            "a holder whose comm is unknown",
            lambda b: b.proc(900, comm=None, holds={0}, uvm=True),
            "pid 900 holds the GPU",
            "pid 900 (?) holds the GPU's device file via fd",
        ),
        (
            "a process whose fds and maps could not be read",
            lambda b: b.proc(900, unreadable=True),
            "fds/maps of 1 process(es) unreadable",
            "pid 900: fds/maps unreadable (unknown is not none)",
        ),
        (
            "a job mapping the GPU without an fd",
            lambda b: b.proc(900, holds={0}, via="map", uvm=True),
            "pid 900 holds the GPU",
            "pid 900 (python3) holds the GPU's device file via map",
        ),
    ],
)
def test_an_unknown_holder_after_a_holder_that_does_not_count_still_blocks(
    first: str,
    case: str,
    holder: object,
    plan_gate: str,
    final_scan: str,
) -> None:
    ours = frozenset({50}) if first == "self" else frozenset({SELF})
    builder = HostBuilder(self_pids=ours).gpu(0)
    _add(builder, first, 50, frozenset({0}))  # listed first, and the lowest PID
    holder(builder)  # type: ignore[operator]
    snapshot = builder.build()
    holders, procs = snapshot.holders, snapshot.processes
    assert live_holder(holders, procs, 0, ours) == plan_gate, case
    assert final_scan in reset_blockers(holders, procs, 0, ours), case


def test_our_own_unreadable_worker_blocks_nothing_but_another_unreadable_process_does() -> None:
    builder = HostBuilder(self_pids=frozenset({SELF})).gpu(0)
    builder.unreadable(SELF)
    snapshot = builder.build()
    holders, procs = snapshot.holders, snapshot.processes
    assert live_holder(holders, procs, 0, frozenset({SELF})) is None
    assert reset_blockers(holders, procs, 0, frozenset({SELF})) == []
    assert driver_refusers(holders, 0, frozenset({SELF})) == []
    builder.proc(901, unreadable=True)
    snapshot = builder.build()
    assert live_holder(snapshot.holders, snapshot.processes, 0, frozenset({SELF})) == (
        "fds/maps of 1 process(es) unreadable"
    )
    assert driver_refusers(snapshot.holders, 0, frozenset({SELF})) is None


def test_an_unknown_minor_blocks_every_gate() -> None:
    snapshot = HostBuilder().gpu(0).build()
    holders, procs = snapshot.holders, snapshot.processes
    assert live_holder(holders, procs, None, frozenset()) == (
        "GPU minor number unknown, holders cannot be checked"
    )
    assert reset_blockers(holders, procs, None, frozenset()) == [
        "GPU minor number unknown: cannot tell who holds its device file"
    ]
    assert driver_refusers(holders, None, frozenset()) is None


@pytest.mark.parametrize("first", ["persistenced", "self", "dcgm"])
@pytest.mark.parametrize("rising", [True, False])
def test_a_job_holding_only_nvidiactl_after_infrastructure_blocks_the_final_scan(
    first: str, rising: bool
) -> None:
    """nvidiactl/nvidia-uvm without a GPU node cannot be attributed: a non-floor holder of them
    blocks; persistenced (which keeps nvidiactl open) and ourselves do not, in either order."""
    job = 700 if rising else 30
    other = 50 if rising else 800
    builder = HostBuilder(self_pids=frozenset({other})).gpu(0).gpu(1)
    if first == "self":
        builder.hold(other, (), ctl=True)
    elif first == "persistenced":
        _persistenced(builder, other, (), ctl=True)
    else:
        builder.proc(
            other, comm="x", uid=0, cgroup=cg_unit("nvidia-dcgm.service"), holds=(), ctl=True
        )
    builder.proc(job, holds=(), uvm=True)
    builder.proc(1000, holds={1}, uvm=True)  # a job on the other GPU only: no blocker here
    snapshot = builder.build()
    ours = frozenset({other}) if first == "self" else frozenset()
    blockers = reset_blockers(snapshot.holders, snapshot.processes, 0, ours)
    assert blockers == [
        f"pid {job} (python3) holds nvidiactl/nvidia-uvm without a GPU node (cannot be attributed)"
    ]


# --- plan's reset gate over the same holders --------------------------------------------------


@pytest.mark.parametrize("case", _orders()[::3], ids=[_id(c) for c in _orders()[::3]])
def test_plan_never_resets_a_gpu_a_job_holds_beside_infrastructure(
    case: tuple[tuple[str, ...], bool],
) -> None:
    snapshot, pids = _holders(*case)
    pol = _policy()
    state = _plan([_ghost()], snapshot, PlanState(), pol, 0.0).state
    result = _plan([_ghost()], snapshot, state, pol, 61.0)
    assert _resets(result) == []
    assert f"live holder: pid {pids['job']} holds the GPU" in _whys(result, EventName.RESET_REFUSED)
    # Without the job the same holders let the reset go ahead (the final scan deals with them).
    snapshot, _ = _holders(*case, without="job")
    state = _plan([_ghost()], snapshot, PlanState(), pol, 0.0).state
    assert len(_resets(_plan([_ghost()], snapshot, state, pol, 61.0))) == 1


# --- a ladder whose target became untouchable sends nothing more -------------------------------


@pytest.mark.parametrize(
    ("case", "later", "pol", "why"),
    [
        ("a reload protects its user", _job_host(), _protect(users=("b*",)), "protect: user bob"),
        (
            "a reload protects its command",
            _job_host(),
            _protect(commands=(re.compile(r"train\.py"),)),
            "protect: command matches",
        ),
        ("a reload protects its GPU", _job_host(), _protect(gpus=(GPU0,)), "protect: GPU"),
        (
            "a reload protects another GPU it holds",
            _job_host(holds=frozenset({0, 1})),
            _protect(gpus=(GPU1,)),
            f"protect: GPU {GPU1} is protected",
        ),
        (
            "it exec'd into root's nvidia-persistenced",
            _job_host(
                comm="nvidia-persiste",
                exe="/usr/bin/nvidia-persistenced",
                uid=0,
                user="root",
                exe_trusted=True,
            ),
            _policy(),
            "floor: infrastructure process",
        ),
        (
            "it moved into the DCGM unit",
            _job_host(cgroup=cg_unit("nvidia-dcgm.service"), uid=0, user="root"),
            _policy(),
            "floor: infrastructure unit",
        ),
        (
            "it dropped nvidia-uvm",
            _job_host().hold(JOB, {0}, uvm=False),
            _policy(),
            "floor: NVML-only client",
        ),
        (
            "it now runs under a protected unit",
            _job_host(cgroup=cg_unit("trainer.service")),
            _protect(units=("trainer.*",)),
            "protect: unit trainer.service",
        ),
    ],
)
def test_a_ladder_whose_target_became_protected_sends_no_further_signal(
    case: str, later: HostBuilder, pol: Policy, why: str
) -> None:
    state, finding = _after_sigterm(_policy())
    snapshot = later.build()
    result = _plan([finding], snapshot, state, pol, 30.0)
    assert _signals(result) == [], case
    refused = [e for e in result.events if e.name == EventName.ACTION_REFUSED]
    assert [e.level for e in refused] == ["warning"], case
    assert str(refused[0].fields["why"]).startswith(why), (case, refused[0].fields["why"])
    # The SIGTERM was real: the owner is told the action failed, once.
    (told,) = _hooks(result, "on_action")
    assert told.facts["outcome"] == "failed", case
    # Never again, even once the protection is gone.
    again = _plan([finding], _job_host().build(), result.state, _policy(), 100.0)
    assert _signals(again) == [], case


def test_a_ladder_still_unprotected_at_its_next_step_sends_the_sigkill() -> None:
    """The other side of the table above: nothing changed, so the SIGKILL goes out."""
    state, finding = _after_sigterm(_policy())
    result = _plan([finding], _job_host().build(), state, _policy(), 30.0)
    assert [(s.signal, s.step) for s in _signals(result)] == [("SIGKILL", 2)]


# --- pause: no reset of any kind ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "finding"),
    [("ghost memory", _ghost()), ("GPU health", _health())],
)
def test_paused_no_reset_of_any_kind_until_resumed(case: str, finding: model.Finding) -> None:
    pol = _policy(reset=replace(_policy().reset, drain=RESET_DRAIN, confirm_for=60.0))
    snapshot = _idle_host()
    state = set_paused(PlanState(), True, reason="maintenance")
    said: list[str] = []
    for now in (0.0, 61.0, 3600.0):
        result = _plan([finding], snapshot, state, pol, now)
        state = result.state
        assert _resets(result) == [], (case, now)
        assert _hooks(result, "reset_drain") == [], (case, now)
        said += _whys(result, EventName.RESET_REFUSED)
    assert "paused (maintenance)" in said, (case, said)
    result = _plan([finding], snapshot, set_paused(state, False, reason=""), pol, 3601.0)
    (intent,) = _resets(result)
    assert intent.gpu == GPU0, case


@pytest.mark.parametrize(
    ("case", "finding"),
    [("ghost memory", _ghost()), ("GPU health", _health())],
)
def test_a_pause_that_comes_while_a_reset_waits_stops_it(case: str, finding: model.Finding) -> None:
    """The reset was waiting (confirmation window; health: for a job to leave): paused before
    it is due, the reset never comes while paused."""
    pol = _policy(reset=replace(_policy().reset, drain=RESET_DRAIN, confirm_for=60.0))
    busy = _idle_host(job_on=1)  # health, without device isolation: a job anywhere waits
    result = _plan([finding], busy, PlanState(), pol, 0.0)
    assert _resets(result) == [], case
    state = set_paused(result.state, True, reason="maintenance")
    result = _plan([finding], _idle_host(), state, pol, 61.0)
    assert _resets(result) == [], case
    assert any(w.startswith("paused (maintenance)") for w in _whys(result, EventName.RESET_REFUSED))
    result = _plan([finding], _idle_host(), set_paused(result.state, False, reason=""), pol, 62.0)
    assert len(_resets(result)) == 1, case


@pytest.mark.parametrize(
    "kind",
    [
        model.FindingKind.DRAIN_REQUIRED,
        model.FindingKind.REBOOT_REQUIRED,
        model.FindingKind.RESET_REQUIRED,
    ],
)
def test_paused_health_runs_no_drain_hooks(kind: model.FindingKind) -> None:
    pol = _policy(reset=replace(_policy().reset, drain=RESET_DRAIN))
    state = set_paused(PlanState(), True, reason="maintenance")
    result = _plan([_health(kind)], _idle_host(), state, pol, 0.0)
    assert _hooks(result, "reset_drain") == []
    assert _resets(result) == []
    # Resumed, the drain hooks run (a reboot still only says so and drains).
    result = _plan([_health(kind)], _idle_host(), PlanState(), pol, 0.0)
    assert len(_hooks(result, "reset_drain")) == 1


# --- a reset waits for a kill ladder on the same GPU --------------------------------------------


@pytest.mark.parametrize(
    ("case", "finding"),
    [("ghost memory", _ghost()), ("GPU health", _health())],
)
def test_a_reset_waits_for_a_kill_ladder_under_way_on_its_gpu(
    case: str, finding: model.Finding
) -> None:
    """The orphan got its SIGTERM on GPU 0 and let go of GPU 0, but still holds GPU 1 (its
    ladder follows it there): GPU 0 is not reset while that ladder runs, and is once it ends."""
    pol = _policy(
        health=HealthPolicy(action="reset", device_isolation=True),
        reset=replace(_policy().reset, confirm_for=10.0),
    )
    state, _ = _after_sigterm(pol)
    moved = _job_host(holds=frozenset({1})).build()
    elsewhere = _orphan(moved, gpu=GPU1)
    said: list[str] = []
    for now in (0.5, 11.0):
        result = _plan([elsewhere, finding], moved, state, pol, now)
        state = result.state
        assert _resets(result) == [], (case, now)
        assert _signals(result) == [], (case, now)  # the SIGKILL is due at 30 s only
        said += _whys(result, EventName.RESET_REFUSED)
        said += [str(b) for e in result.events for b in _listed(e.fields.get("blockers"))]
    assert any("an escalation on this GPU is in progress" in w for w in said), (case, said)
    ended = record_exit(
        result.state, model.ProcessIdentity(JOB, elsewhere.start_ticks or 0), now=62.0
    )
    gone = _idle_host()
    result = _plan([finding], gone, ended.state, pol, 63.0)
    (intent,) = _resets(result)
    assert intent.gpu == GPU0, case


def _listed(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []


# --- protect.gpus beside the finding's GPU, PCI domains with a-f ---------------------------------

BUS = {0: "0000000A:3B:00.0", 1: "0000000B:3C:00.0"}


def _with_bus_ids(snapshot: model.Snapshot) -> model.Snapshot:
    gpus = tuple(replace(g, pci_bus_id=BUS[g.index]) for g in snapshot.nvml.gpus)
    return replace(snapshot, nvml=replace(snapshot.nvml, gpus=gpus))


@pytest.mark.parametrize(
    ("entry", "protected"),
    [
        ("000b:3c:00.0", True),  # short domain, lower case
        ("0000000B:3C:00.0", True),  # as NVML writes it
        ("0000000b:3c:00.0", True),
        (GPU1.lower(), True),
        ("000c:3c:00.0", False),  # another domain
        ("000b:3d:00.0", False),  # another bus
    ],
)
def test_a_protected_gpu_held_beside_the_findings_gpu_refuses_the_signal(
    entry: str, protected: bool
) -> None:
    snapshot = _with_bus_ids(_job_host(holds=frozenset({0, 1})).build())
    finding = _orphan(snapshot)
    result = _plan([finding], snapshot, PlanState(), _protect(gpus=(entry,)), 0.0)
    if protected:
        assert _signals(result) == []
        assert _whys(result, EventName.ACTION_REFUSED) == [
            f"protect: GPU {GPU1} is protected ({entry})"
        ]
    else:
        assert [s.signal for s in _signals(result)] == ["SIGTERM"]


@pytest.mark.parametrize(
    ("entry", "protected"),
    [("000a:3b:00.0", True), ("0000000a:3b:00.0", True), ("000a:3c:00.0", False)],
)
def test_a_gpu_protected_by_a_pci_bus_id_with_a_hex_domain_is_never_reset(
    entry: str, protected: bool
) -> None:
    snapshot = _with_bus_ids(_idle_host())
    gates = reset_gates(_ghost(), snapshot, _protect(gpus=(entry,)), report_only={}, findings=[])
    assert [(g.name, g.why) for g in gates] == (
        [("protect", f"protect: gpus {entry}")] if protected else []
    )


# --- which rule selects a finding; what may never be signalled ---------------------------------


@pytest.mark.parametrize(
    ("path", "why"),
    [
        (
            "/system.slice/nvidia-persistenced.service",
            "infrastructure unit nvidia-persistenced.service",
        ),
        ("/", None),
        ("/system.slice/other.scope", None),
        (
            "/user.slice/user-1001.slice/user@1001.service/app.slice/nvidia-persistenced.service",
            None,
        ),
    ],
)
def test_an_nvidia_unit_is_infrastructure_only_where_its_cgroup_path_is_a_system_service(
    path: str, why: str | None
) -> None:
    """The path, which only root can place a process in, names the unit; a unit name recorded
    beside another path (a report, a user's own ``user@`` unit of that name) grants nothing."""
    proc = model.ProcessInfo(
        900, 1, "S", 1, 900, 900, comm="worker", uid=0,
        cgroup=model.CgroupInfo(path=path, systemd_unit="nvidia-persistenced.service",
                                delegated=False),
    )  # fmt: skip
    assert infrastructure(proc) == why


def _finding(
    memory: int | None = 512 * model.MIB, start_ticks: int | None = 14_900
) -> model.Finding:
    return model.Finding(
        kind=model.FindingKind.ORPHANED, gpu=GPU0, pid=JOB, start_ticks=start_ticks,
        reason="orphaned", memory=memory, evidence={"uvm": True},
    )  # fmt: skip


def _rules(*rules: Rule) -> Policy:
    return _policy(rules=rules)


KILL = (Step("SIGKILL", 1.0),)


@pytest.mark.parametrize(
    ("case", "rules", "chosen"),
    [
        (
            "the first rule asks for more memory: the second one is next",
            (Rule("big", model.FindingKind.ORPHANED, KILL, min_memory=1024 * model.MIB),
             Rule("any", model.FindingKind.ORPHANED, KILL)),
            "any",
        ),
        (
            "one of two command patterns matches",
            (Rule("cmd", model.FindingKind.ORPHANED, KILL,
                  commands=(re.compile("serve"), re.compile(r"train\.py"))),),
            "cmd",
        ),
        (
            "one of two user globs matches",
            (Rule("users", model.FindingKind.ORPHANED, KILL, users=("alice", "b*")),),
            "users",
        ),
        (
            "one of two cgroup globs matches",
            (Rule("cg", model.FindingKind.ORPHANED, KILL,
                  cgroups=("/kubepods/*", "/user.slice/*")),),
            "cg",
        ),
        (
            "no command pattern matches",
            (Rule("cmd", model.FindingKind.ORPHANED, KILL, commands=(re.compile("serve"),)),),
            None,
        ),
    ],
)  # fmt: skip
def test_rule_for_takes_the_first_rule_whose_every_filter_matches(
    case: str, rules: tuple[Rule, ...], chosen: str | None
) -> None:
    proc = _job_host().build().processes[JOB]
    rule = rule_for(_finding(), proc, _rules(*rules), lasted=100.0)
    assert (rule.name if rule is not None else None) == chosen, case


def test_a_rule_without_filters_selects_a_finding_whose_process_is_not_described() -> None:
    """...and the identity refusal then says why nothing is sent (it is not silently dropped);
    a rule with a filter does not select it: unknown never matches a filter."""
    open_rule = Rule("any", model.FindingKind.ORPHANED, KILL)
    assert rule_for(_finding(), None, _rules(open_rule), lasted=0.0) == open_rule
    filtered = Rule("bob", model.FindingKind.ORPHANED, KILL, users=("bob",))
    assert rule_for(_finding(), None, _rules(filtered), lasted=0.0) is None
    empty = HostBuilder().gpu(0).build()
    result = _plan([_finding()], empty, PlanState(), _rules(open_rule), 0.0)
    assert _signals(result) == []
    assert _whys(result, EventName.ACTION_REFUSED) == ["identity: process not in the snapshot"]


@pytest.mark.parametrize(("process_ticks", "finding_ticks"), [(None, 14_900), (14_900, None)])
def test_an_unknown_start_time_is_refused_as_unknown(
    process_ticks: int | None, finding_ticks: int | None
) -> None:
    snapshot = _job_host(start_ticks=process_ticks).build()
    why = refusal(
        snapshot.processes[JOB], _finding(start_ticks=finding_ticks), snapshot, _policy(),
        frozenset(),
    )  # fmt: skip
    assert why == "identity: start time unknown"


def test_an_unknown_process_has_no_facts() -> None:
    assert process_facts(None) == {}
