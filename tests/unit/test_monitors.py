"""Monitors (decide/plan/monitors.py): an NVML-only client never keeps leaked memory from being
ghost_memory; it blocks the reset with a reason that names it unless ``reset.monitors`` names it,
and then the reset procedure stops it and brings it back (act/reset.py).

Pinned here: the reset gate a snapshot decides (assess + ``reset_gates``), which holders the
procedure stops, and the procedure's two steps with a recording runner (nothing runs). The
refusal a monitor that came during the procedure caused is lifted when it lets go
(tests/unit/test_scenarios.py, ``reset-blocked-hidden-holder``); the daemon stopping a real
process and the process coming back: tests/system/test_e2e_monitors.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwatchd.act.commands import CommandResult
from gpuwatchd.act.reset import perform_reset
from gpuwatchd.act.reset_resume import resume_interrupted
from gpuwatchd.act.reset_target import ResetOutcome, ResetTarget
from gpuwatchd.core.model import MIB, CgroupInfo, FindingKind, ProcessIdentity, Snapshot, Spare
from gpuwatchd.core.vocabulary import ResetStep
from gpuwatchd.decide.assess.passes import assess
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.plan.monitors import StoppableMonitor, monitors_to_stop
from gpuwatchd.decide.plan.resets import reset_gates
from gpuwatchd.decide.policy import Detection, Monitor, Policy, Protect, ResetPolicy
from tests.support.fakesmi import FakeSmi
from tests.support.resetrig import FakeEnvironment
from tests.support.snapshots import HostBuilder, cg_session, cg_slurm, cg_unit, gpu_uuid

LEAK = 1200 * MIB
MONITOR = 4100
GPUSTAT = ("/usr/bin/python3", "/usr/local/bin/gpustat", "--watch")
BY_COMMAND = Monitor(command=re.compile(r"/gpustat\b"))
BY_UNIT = Monitor(unit="gpustat.service")
USER_UNIT = "/user.slice/user-1000.slice/user@1000.service/app.slice/gpustat.service"


def _host(*, uvm: bool = False, **proc: object) -> HostBuilder:
    """GPU 0 with memory a dead job left, and a monitor holding nvidiactl + /dev/nvidia0."""
    settings: dict[str, object] = {"comm": "gpustat", "cmdline": GPUSTAT, "cgroup": cg_session()}
    settings.update(proc)
    builder = HostBuilder().gpu(0, allocated=LEAK)
    return builder.proc(MONITOR, holds={0}, uvm=uvm, **settings)  # type: ignore[arg-type]


def _live_holder_gate(snapshot: Snapshot, *monitors: Monitor) -> list[str]:
    """The reset gates of the GPU's ghost_memory that name a live holder (no ghost: none)."""
    assessed = assess(snapshot, AssessState(boot_id=snapshot.boot_id), Detection())
    ghosts = [f for f in assessed.findings if f.kind is FindingKind.GHOST_MEMORY]
    if not ghosts:
        return ["no ghost_memory"]
    policy = Policy(reset=ResetPolicy(monitors=monitors))
    gates = reset_gates(ghosts[0], snapshot, policy, report_only={}, findings=assessed.findings)
    return [g.why for g in gates if g.name == "live_holder"]


def test_an_unlisted_monitor_blocks_the_reset_naming_pid_name_and_unit() -> None:
    [why] = _live_holder_gate(_host().build())
    assert why.startswith(f"live holder: monitor pid {MONITOR} (gpustat, unit session-1.scope)")
    assert "reset.monitors" in why


@pytest.mark.parametrize(
    ("entry", "cgroup"),
    [
        (BY_COMMAND, cg_session()),
        (BY_UNIT, cg_unit("gpustat.service")),
    ],
)
def test_a_listed_monitor_leaves_the_gate_open(entry: Monitor, cgroup: object) -> None:
    assert _live_holder_gate(_host(cgroup=cgroup).build(), entry) == []


@pytest.mark.parametrize(
    ("case", "host", "entry"),
    [
        # A user's own "gpustat.service" is not the system service the entry names.
        (
            "user unit",
            _host(cgroup=CgroupInfo(USER_UNIT, systemd_unit="gpustat.service")),
            BY_UNIT,
        ),
        ("other command", _host(cmdline=("/usr/bin/nvtop",)), BY_COMMAND),
        ("a Slurm job's", _host(cgroup=cg_slurm("77")), BY_COMMAND),
        ("cgroup unknown", _host(cgroup=None), BY_COMMAND),
        ("command line unknown", _host(cmdline=None), BY_COMMAND),
    ],
)  # fmt: skip
def test_a_monitor_no_entry_names_still_blocks(
    case: str, host: HostBuilder, entry: Monitor
) -> None:
    [why] = _live_holder_gate(host.build(), entry)
    assert f"monitor pid {MONITOR}" in why, case


def test_a_holder_with_nvidia_uvm_is_no_monitor_whatever_the_entry_says() -> None:
    """It could own the memory: no ghost_memory at all, so no reset to open a gate for."""
    assert _live_holder_gate(_host(uvm=True).build(), BY_COMMAND) == ["no ghost_memory"]


def test_a_listed_monitor_beside_an_unlisted_one_leaves_that_one_blocking() -> None:
    snapshot = _host().proc(4200, comm="nvtop", cmdline=("nvtop",), holds={0}).build()
    [why] = _live_holder_gate(snapshot, BY_COMMAND)
    assert why.startswith("live holder: monitor pid 4200 (nvtop")


# --- which holders the procedure stops ------------------------------------------------------


def _stoppable(
    builder: HostBuilder,
    *,
    owners: Sequence[int] = (),
    spared: bool = False,
    policy: Policy | None = None,
) -> list[int]:
    snapshot = builder.build()
    if spared:  # the last poll's spare of the monitor itself
        ticks = snapshot.processes[MONITOR].start_ticks
        spare = Spare(f"pid:{MONITOR}", snapshot.wall_time + 60.0, "debugging", pid=MONITOR,
                      start_ticks=ticks)  # fmt: skip
        snapshot = replace(snapshot, spares=(spare,))
    found = monitors_to_stop(
        snapshot.holders,
        snapshot.processes,
        0,
        self_pids=frozenset(),
        context_owners=frozenset(owners),
        monitors=(BY_COMMAND,),
        last=snapshot,
        policy=policy or Policy(),
    )
    return [m.identity.pid for m in found]


@pytest.mark.parametrize(
    ("case", "builder", "owners", "expected"),
    [
        ("a monitor", _host(), (), [MONITOR]),
        ("holds nvidia-uvm", _host(uvm=True), (), []),
        ("owns a context (NVML lists it)", _host(), (MONITOR,), []),
        ("start time unknown", _host(start=None), (), []),
        ("a zombie", _host(state="Z"), (), []),
        ("in D state", _host(state="D"), (), []),
        (
            "infrastructure",
            _host(comm="nvidia-smi", exe="/usr/bin/nvidia-smi", uid=0, exe_trusted=True,
                  cmdline=("/usr/bin/nvidia-smi", "-l", "/usr/local/bin/gpustat")),
            (),
            [],
        ),
    ],
)  # fmt: skip
def test_only_a_listed_nvml_only_holder_of_known_identity_is_stopped(
    case: str, builder: HostBuilder, owners: tuple[int, ...], expected: list[int]
) -> None:
    assert _stoppable(builder, owners=owners) == expected, case


@pytest.mark.parametrize(
    ("case", "builder", "spared", "protect"),
    [
        ("spared", _host(), True, Protect()),
        ("protect.commands names it", _host(), False, Protect(commands=(re.compile("gpustat"),))),
        ("protect.users names it", _host(user="alice"), False, Protect(users=("alice",))),
        ("protect.users and its user unknown", _host(user=None), False, Protect(users=("x",))),
        (
            "claims to be nvidia-smi, unverified",
            _host(comm="nvidia-smi", exe="/usr/bin/nvidia-smi", uid=0, exe_trusted=None,
                  cmdline=("/usr/bin/nvidia-smi", "-l", "/usr/local/bin/gpustat")),
            False,
            Protect(),
        ),
    ],
)  # fmt: skip
def test_a_monitor_a_kill_target_would_be_refused_for_is_never_stopped(
    case: str, builder: HostBuilder, spared: bool, protect: Protect
) -> None:
    """The floor, a spare and ``protect`` keep the reset from signalling a monitor as they keep
    a ladder from signalling a target: it stays, and the final scan refuses the reset."""
    assert _stoppable(builder, spared=spared, policy=Policy(protect=protect)) == [], case


# --- the procedure's steps ------------------------------------------------------------------

TARGET = ResetTarget(uuid=gpu_uuid(0), pci_bus_id=None, minor=0, persistence_was_on=False)
POLICY = ResetPolicy(
    command=("nvidia-smi", "--gpu-reset", "-i", "{uuid}"),
    monitors=(BY_UNIT, BY_COMMAND),
    timeout=7.0,
)
IN_UNIT = StoppableMonitor(ProcessIdentity(4100, 1), BY_UNIT, "pid 4100 (gpustat)")
SIGNALLED = StoppableMonitor(ProcessIdentity(4300, 1), BY_COMMAND, "pid 4300 (exporter)")


class Runner:
    """Runs nothing: records each argv, fails those whose ``argv[1:]`` is in ``failing``."""

    def __init__(self, failing: Sequence[tuple[str, ...]] = ()) -> None:
        self.failing = set(failing)
        self.argvs: list[tuple[str, ...]] = []

    def __call__(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        self.argvs.append(tuple(argv))
        code = 1 if tuple(argv[1:]) in self.failing else 0
        return CommandResult(tuple(argv), code, "", False, 0.0, None)


def _env(tmp_path: Path, **kw: object) -> FakeEnvironment:
    return FakeEnvironment(FakeSmi(tmp_path), **kw)  # type: ignore[arg-type]


def _reset_beside_two_monitors(
    tmp_path: Path, *, dry_run: bool = False, failing: Sequence[tuple[str, ...]] = (), **kw: object
) -> tuple[FakeEnvironment, Runner, ResetOutcome]:
    """A reset of GPU 0 with one monitor in gpustat.service and one to signal."""
    env = _env(tmp_path, monitors=[IN_UNIT, SIGNALLED], **kw)
    runner = Runner(failing)
    return env, runner, perform_reset(TARGET, POLICY, env, dry_run=dry_run, runner=runner)


def test_the_reset_stops_each_monitor_before_the_final_scan_and_starts_its_unit_after(
    tmp_path: Path,
) -> None:
    env, runner, outcome = _reset_beside_two_monitors(tmp_path)
    assert outcome.result == "success"
    assert runner.argvs == [
        ("systemctl", "stop", "gpustat.service"),
        ("nvidia-smi", "--gpu-reset", "-i", gpu_uuid(0)),
        ("nvidia-smi", "-q", "-i", gpu_uuid(0)),
        ("systemctl", "start", "gpustat.service"),
    ]
    assert env.calls[1:4] == ["find_monitors", "stop_monitors 4300", "final_blockers"]
    first, second = [r for r in env.records if r["step"] == "stop_monitors"]
    assert (first["units_stopped"], second["units_stopped"]) == ([], ["gpustat.service"])
    [step] = env.step_events(ResetStep.STOP_MONITORS)
    assert step["monitors"] == ["pid 4100 (gpustat)", "pid 4300 (exporter)"]


@pytest.mark.parametrize(
    ("failing", "left"),
    [
        ([("stop", "gpustat.service")], []),
        ([], ["pid 4300 (exporter) still holds the GPU after 7s"]),
    ],
)
def test_a_monitor_that_cannot_be_stopped_refuses_the_reset_and_its_unit_is_started_again(
    tmp_path: Path, failing: list[tuple[str, ...]], left: list[str]
) -> None:
    _, runner, outcome = _reset_beside_two_monitors(tmp_path, failing=failing, monitors_left=left)
    assert (outcome.result, outcome.step) == ("refused", ResetStep.STOP_MONITORS)
    assert "a monitor could not be stopped" in outcome.reason
    assert ("nvidia-smi", "--gpu-reset", "-i", gpu_uuid(0)) not in runner.argvs
    assert runner.argvs[-1] == ("systemctl", "start", "gpustat.service")


def test_a_dry_run_stops_nothing_and_its_final_scan_does_not_count_the_monitors(
    tmp_path: Path,
) -> None:
    env, runner, outcome = _reset_beside_two_monitors(tmp_path, dry_run=True)
    assert outcome.result == "dry_run"
    assert runner.argvs == []
    assert "stop_monitors" not in " ".join(env.calls)
    assert env.ignored == [frozenset({4100, 4300})]
    [step] = env.step_events(ResetStep.STOP_MONITORS)
    assert step["status"] == "would_run"
    assert "systemctl stop gpustat.service" in str(step["detail"])


def test_without_reset_monitors_nothing_is_looked_for(tmp_path: Path) -> None:
    env = _env(tmp_path, monitors=[IN_UNIT])
    runner = Runner()
    policy = ResetPolicy(command=POLICY.command, timeout=7.0)
    assert perform_reset(TARGET, policy, env, dry_run=False, runner=runner).result == "success"
    assert "find_monitors" not in env.calls
    assert not [a for a in runner.argvs if a[0] == "systemctl"]


def test_a_restart_after_a_crash_starts_the_units_the_record_says_were_stopped(
    tmp_path: Path,
) -> None:
    record = {
        "uuid": gpu_uuid(0),
        "pci_bus_id": None,
        "minor": 0,
        "persistence_was_on": False,
        "step": "final_scan",
        "persistence_off": False,
        # Only names check-config accepts for a monitor's unit are started again.
        "units_stopped": [
            "gpustat.service",
            "-bad.service",
            7,
            "a b.service",
            "../x.service",
            "x" * 300 + ".service",
        ],
        "reset_started": False,
        "result": None,
    }
    runner = Runner()
    outcome = resume_interrupted(record, POLICY, _env(tmp_path), runner=runner)
    assert outcome is not None
    assert outcome.result == "refused"
    assert runner.argvs == [("systemctl", "start", "gpustat.service")]
