"""Who holds a GPU against its reset, and a whole MIG GPU's layout (decide/plan/resets.py).

Gates a mutation run found untested, one behaviour each: an NVML-only client (a monitor) of
another GPU never holds this GPU's reset, one whose ``gpus`` names this GPU does (unless
``reset.monitors`` lists it); a MIG GPU instance's own hidden holder (the driver refused to
re-create it, in use) holds its parent's reset, other findings about an instance and findings
about another GPU do not, and none of them hides a holder of this GPU that sorts after it; a
MIG GPU whose layout cannot be created again is never reset; only the reset of a whole MIG
GPU carries its layout, never an instance's recovery.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from gpuwatchd.core.model import MIB, Finding, FindingKind, Snapshot
from gpuwatchd.core.vocabulary import Level
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.plan.decisions import plan
from gpuwatchd.decide.plan.intents import ResetIntent
from gpuwatchd.decide.plan.resets import reset_gates
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import Detection, Monitor, Policy, ResetPolicy, default_rules
from tests.support.migcases import GI1, LEAK, run
from tests.support.migsnap import Inst, with_mig
from tests.support.snapshots import HostBuilder, cg_session, gpu_uuid

GPU0, GPU1 = gpu_uuid(0), gpu_uuid(1)
GPUSTAT = ("/usr/bin/python3", "/usr/local/bin/gpustat", "--watch")
LISTED = Monitor(command=re.compile(r"/gpustat\b"))

# --- NVML-only clients (monitors): which GPUs they hold ----------------------------------------


def _monitors(*held: tuple[int, frozenset[int]]) -> Snapshot:
    """GPU 1 with memory a dead job left; each (pid, GPUs) a gpustat holding those GPUs'
    device files and nvidiactl, without nvidia-uvm (an NVML-only client)."""
    builder = HostBuilder().gpu(0).gpu(1, allocated=1200 * MIB)
    for pid, gpus in held:
        builder = builder.proc(
            pid, holds=gpus, comm="gpustat", cmdline=GPUSTAT, cgroup=cg_session()
        )
    return builder.build()


def _gpu1_live_holder(snapshot: Snapshot, *monitors: Monitor) -> list[str]:
    assessed = assess(snapshot, AssessState(boot_id=snapshot.boot_id), Detection())
    (ghost,) = [f for f in assessed.findings if f.kind is FindingKind.GHOST_MEMORY]
    assert ghost.gpu == GPU1
    chosen = Policy(reset=ResetPolicy(monitors=monitors))
    gates = reset_gates(ghost, snapshot, chosen, report_only={}, findings=assessed.findings)
    return [g.why for g in gates if g.name == "live_holder"]


@pytest.mark.parametrize(
    ("case", "held", "listed", "blocks"),
    [
        ("a monitor of GPU 0 only", [(4100, {0})], False, None),
        ("a monitor of GPUs 0 and 1, its finding on GPU 0", [(4100, {0, 1})], False, 4100),
        ("the same monitor listed in reset.monitors", [(4100, {0, 1})], True, None),
        ("a monitor of GPU 1", [(4100, {1})], False, 4100),
        # The other GPU's monitor sorts first: the look at GPU 1's own goes on past it.
        ("GPU 0's monitor beside GPU 1's, unlisted", [(4000, {0}), (4100, {1})], False, 4100),
        ("GPU 0's monitor beside GPU 1's, listed", [(4000, {0}), (4100, {1})], True, None),
    ],
)  # fmt: skip
def test_a_monitor_holds_the_reset_of_the_gpus_it_names_and_of_no_other(
    case: str, held: list[tuple[int, set[int]]], listed: bool, blocks: int | None
) -> None:
    snapshot = _monitors(*((pid, frozenset(gpus)) for pid, gpus in held))
    whys = _gpu1_live_holder(snapshot, *((LISTED,) if listed else ()))
    if blocks is None:
        assert whys == [], case
    else:
        (why,) = whys
        assert why.startswith(f"live holder: monitor pid {blocks} (gpustat"), case
        assert "reset.monitors may name it" in why, case


# --- holder findings: an instance's hidden holder, another GPU's, a process on an instance ----

PARENT_REFUSED = (
    "live holder: hidden_holder: the driver refused the last reset, in use by another client"
)
GI1_REFUSED = f"live holder: hidden_holder: the driver refused to re-create {GI1}, in use"


def _about(kind: FindingKind, gpu: str, pid: int | None = None) -> Finding:
    return Finding(kind, gpu, pid, None if pid is None else 5000, "held", actionable=False)


def _idle_mig_gpu0() -> Snapshot:
    """GPU 0 in MIG mode, GI 1 and GI 2 idle, nothing holding any device file; GPU 1 plain."""
    return with_mig(HostBuilder().gpu(0).gpu(1).build(), instances=[Inst(1), Inst(2)])


@pytest.mark.parametrize(
    ("case", "findings", "expected"),
    [
        ("GI 1's hidden holder", [_about(FindingKind.HIDDEN_HOLDER, GI1)], [GI1_REFUSED]),
        ("another kind about GI 1", [_about(FindingKind.ABANDONED, GI1)], []),
        ("a process on GI 1 (mig_busy's)", [_about(FindingKind.ABANDONED, GI1, 700)], []),
        ("GPU 1's holder", [_about(FindingKind.ABANDONED, GPU1, 800)], []),
        # Each sorts before GPU 0's own hidden holder, which still holds the reset.
        (
            "another kind about GI 1, then GPU 0's refusal",
            [_about(FindingKind.ABANDONED, GI1), _about(FindingKind.HIDDEN_HOLDER, GPU0)],
            [PARENT_REFUSED],
        ),
        (
            "a process on GI 1, then GPU 0's refusal",
            [_about(FindingKind.ABANDONED, GI1, 700), _about(FindingKind.HIDDEN_HOLDER, GPU0)],
            [PARENT_REFUSED],
        ),
        (
            "GPU 1's holder, then GPU 0's refusal",
            [_about(FindingKind.ABANDONED, GPU1, 800), _about(FindingKind.HIDDEN_HOLDER, GPU0)],
            [PARENT_REFUSED],
        ),
    ],
)  # fmt: skip
def test_only_this_gpu_s_holders_and_its_instances_hidden_holders_hold_its_reset(
    case: str, findings: list[Finding], expected: list[str]
) -> None:
    snapshot = _idle_mig_gpu0()
    reset = Finding(FindingKind.RESET_REQUIRED, GPU0, None, None, "GPU_RESET")
    chosen = Policy(reset=ResetPolicy(enabled=True, allow_mig=True))
    gates = reset_gates(reset, snapshot, chosen, report_only={}, findings=findings)
    assert [g.why for g in gates if g.name == "live_holder"] == expected, case


# --- a whole MIG GPU's layout -----------------------------------------------------------------


def test_a_mig_gpu_whose_layout_cannot_be_created_again_is_refused_its_reset() -> None:
    """GI 1 has two compute instances: ``-cgi ... -C`` would bring back one."""
    reset = Finding(FindingKind.RESET_REQUIRED, GPU0, None, None, "GPU_RESET")
    chosen = Policy(reset=ResetPolicy(enabled=True, allow_mig=True))
    for cis, refused in (((0,), False), ((0, 1), True)):
        snapshot = with_mig(HostBuilder().gpu(0).build(), instances=[Inst(1, cis=cis), Inst(2)])
        gates = reset_gates(reset, snapshot, chosen, report_only={}, findings=[])
        layout = [(g.why, g.level) for g in gates if g.name == "mig_layout"]
        if not refused:
            assert layout == []
            continue
        ((why, level),) = layout
        assert why.startswith("MIG layout cannot be restored after a reset: GPU instance 1 has 2")
        assert level is Level.WARNING


def test_an_instance_recovery_carries_no_layout_of_the_whole_gpu() -> None:
    """The recovery re-creates GI 1 alone; a layout would have its reset.due event (and a dry
    run) say every instance of GPU 0 is created again."""
    base = HostBuilder().gpu(0).proc(700, ppid=1, holds={0}, uvm=True).build()
    snapshot = with_mig(
        base,
        instances=[Inst(1, allocated=LEAK), Inst(2, allocated=LEAK, processes=((700, LEAK),))],
        caps={700: [(2, 0)]},
    )
    chosen = dataclasses.replace(
        Policy(dry_run=False, rules=default_rules()),
        reset=ResetPolicy(enabled=True, mig_recovery=True, confirm_for=0.0),
    )
    result = run(snapshot)
    state = PlanState()
    asked: list[ResetIntent] = []
    for step in range(4):
        now = snapshot.monotonic + 10.0 * step
        out = plan(result.findings, snapshot, state, chosen, now=now, wall=now,
                   report_only=result.report_only)  # fmt: skip
        state = out.state
        asked += [i for i in out.intents if isinstance(i, ResetIntent)]
    (intent,) = asked
    assert intent.instance is not None
    assert intent.instance.gi == 1
    assert (intent.layout, "mig_layout" in intent.facts) == ((), False)
