"""`check-clean` (the prolog) and `run --once` beside the daemon, around the one verdict.

Whether a GPU is clean is decide/verdict.py's (tests/unit/test_verdict.py); here: which GPUs
``--gpu`` selects, the lines and exit code, and how the waiting epilog reads the verdict.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.cli.check_clean import (
    RUNNING_POLICY,
    SelectionError,
    answer,
    slurm_selectors,
    split_selectors,
)
from gpuwatchd.cli.main import main
from gpuwatchd.cli.once import wait_for_daemon
from gpuwatchd.cli.scan import ScanResult
from gpuwatchd.core.vocabulary import Cleanliness, LadderStatus
from gpuwatchd.decide.plan.state import Ladder, PlanState, SeenFinding
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.verdict import GpuVerdict, NodeVerdict, Reason

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"
BUS = {UUID0: "00000000:17:00.0", UUID1: "00000000:65:00.0"}


def gpu(
    index: int,
    uuid: str,
    *reasons: tuple[str, str],
    state: Cleanliness | None = None,
    blockers: tuple[str, ...] = (),
) -> GpuVerdict:
    return GpuVerdict(
        uuid=uuid,
        index=index,
        pci_bus_id=BUS[uuid],
        state=state or (Cleanliness.DIRTY if reasons else Cleanliness.CLEAN),
        reasons=tuple(Reason(kind, 42, why) for kind, why in reasons),
        reset_blockers=tuple(Reason("management", 9, text) for text in blockers),
    )


def node(gpu0: GpuVerdict | None = None, gpu1: GpuVerdict | None = None) -> NodeVerdict:
    return NodeVerdict((gpu0 or gpu(0, UUID0), gpu1 or gpu(1, UUID1)))


# --- check-clean ---------------------------------------------------------------------------


def test_clean_gpus_print_nothing_on_stdout() -> None:
    assert answer(node(), None) == (0, [], [])
    assert answer(node(), ["0", "1"]) == (0, [], [])


def test_one_line_per_gpu_that_is_not_clean_with_the_count_of_the_rest() -> None:
    dirty = gpu(0, UUID0, ("orphaned", "orphaned here"), ("ghost_memory", "1 GiB"))
    code, lines, notes = answer(node(dirty), None)
    assert code == 1
    assert lines == [f"GPU 0 {UUID0}: orphaned orphaned here (and 1 more)"]
    assert notes == []


def test_an_unknown_gpu_is_not_clean_either() -> None:
    unknown = gpu(1, UUID1, ("unreadable", "PID 7"), state=Cleanliness.UNKNOWN)
    assert answer(node(gpu1=unknown), None) == (1, [f"GPU 1 {UUID1}: unreadable PID 7"], [])


def test_what_would_block_a_reset_goes_to_stderr_and_is_no_dirt() -> None:
    monitor = ("pid 9 (gpustat): management client",)
    code, lines, notes = answer(node(gpu(0, UUID0, blockers=monitor)), ["0"])
    assert (code, lines) == (0, [])
    assert notes == [f"gpuwatchd: GPU 0 {UUID0}: clean; would block a reset: {monitor[0]}"]
    assert not any(n.startswith("GPU ") for n in notes)  # the Slurm script reads "GPU " lines


@pytest.mark.parametrize(
    "selector",
    [UUID1, UUID1.lower(), "00000000:65:00.0", "0000:65:00.0", "65:00.0", "1"],
)
def test_selection_by_uuid_bus_id_or_index(selector: str) -> None:
    dirty = node(gpu1=gpu(1, UUID1, ("orphaned", "x")))
    assert answer(dirty, [selector])[0] == 1
    # GPU 0 is clean: selecting it alone passes whatever GPU 1 holds.
    assert answer(dirty, ["0"]) == (0, [], [])
    assert answer(dirty, [UUID0, "00000000:17:00.0"]) == (0, [], [])


def test_a_gpu_is_answered_the_same_alone_and_among_all() -> None:
    verdict = node(gpu(0, UUID0, ("orphaned", "x")), gpu(1, UUID1, ("lost", "gone")))
    whole = answer(verdict, None)[1]
    assert whole == answer(verdict, ["0"])[1] + answer(verdict, ["1"])[1]


# "²" is a digit to str.isdigit but no number to int(), and int() refuses more than 4,300
# digits: either was a ValueError traceback, exit 1, which a prolog reads as a dirty GPU.
# "\u0661" (ARABIC-INDIC DIGIT ONE) is decimal to str.isdecimal and int(), but no index NVML
# or scan --json writes: it named GPU 1.
@pytest.mark.parametrize(
    "selector", ["2", "GPU-nope", "00000000:99:00.0", "gpu0", "\u00b2", "1" * 5000, "\u0661"]
)
def test_an_unknown_gpu_is_a_selection_error(selector: str) -> None:
    with pytest.raises(SelectionError, match="names no GPU"):
        answer(node(), [selector])


@pytest.mark.parametrize("selector", ["MIG-xyz", "mig-00000000-0001-4000-8000-000000000010"])
def test_a_mig_device_selector_is_refused_saying_to_name_its_gpu(selector: str) -> None:
    """Slurm may hand out MIG UUIDs; check-clean judges whole GPUs and says so."""
    with pytest.raises(SelectionError, match="is a MIG device: check-clean judges whole GPUs"):
        answer(node(gpu(0, UUID0)), [selector])


def test_hostile_reason_is_escaped() -> None:
    bad = gpu(0, UUID0, ("orphaned", "x\nGPU 1 fake: clean\u2028"))
    code, lines, _ = answer(node(bad), None)
    assert code == 1
    assert len(lines) == 1
    assert "\n" not in lines[0]
    assert "\\n" in lines[0]


def test_selectors_split_like_cuda_visible_devices() -> None:
    assert split_selectors(None) is None
    assert split_selectors(["0,1", " 3 "]) == ["0", "1", "3"]
    assert split_selectors([""]) == []  # a job without GPUs: nothing to check
    assert answer(node(gpu(0, UUID0, ("orphaned", "x"))), []) == (0, [], [])


def _report_gpus(*minors: int | None) -> list[dict[str, Any]]:
    """The report's GPU entries: index i has device minor minors[i]."""
    uuids = [UUID0, UUID1]
    return [{"index": i, "uuid": uuids[i], "minor": m} for i, m in enumerate(minors)]


def test_slurm_ids_name_gpus_by_device_file_when_minors_are_not_in_nvmls_order() -> None:
    """NVML's GPU 0 is /dev/nvidia1 and GPU 1 is /dev/nvidia0. Slurm's id 0 (File=/dev/nvidia0
    first in gres.conf) is NVML's GPU 1: a dirty GPU 1 is refused by Slurm id 0, not id 1;
    in NVML's order (AutoDetect=nvml) id 0 is NVML's GPU 0."""
    gpus = _report_gpus(1, 0)
    assert slurm_selectors(gpus, ["0"], "files") == [UUID1]
    assert slurm_selectors(gpus, ["1"], "files") == [UUID0]
    assert slurm_selectors(gpus, ["0"], "nvml") == [UUID0]
    dirty1 = node(gpu1=gpu(1, UUID1, ("ghost_memory", "2 GiB")))
    assert answer(dirty1, slurm_selectors(gpus, ["0"], "files"))[0] == 1
    assert answer(dirty1, slurm_selectors(gpus, ["1"], "files"))[0] == 0


@pytest.mark.parametrize(
    "ident", ["2", "x", "-1", "GPU-00000000-0000-0000-0000-000000000000", "\u00b2", "\u0660"]
)
def test_a_slurm_id_that_names_no_gpu_is_a_selection_error(ident: str) -> None:
    with pytest.raises(SelectionError, match="--slurm-gpus"):
        slurm_selectors(_report_gpus(0, 1), [ident], "files")


def test_slurm_ids_by_device_file_with_a_minor_unknown_are_refused_not_guessed() -> None:
    with pytest.raises(SelectionError, match="device minor is unknown"):
        slurm_selectors(_report_gpus(0, None), ["0"], "files")
    assert slurm_selectors(_report_gpus(0, None), ["1"], "nvml") == [UUID1]


# --- run --once beside the daemon ----------------------------------------------------------


def finding(kind: str, uuid: str | None, *, pid: int | None = 42) -> dict[str, Any]:
    return {
        "kind": kind,
        "gpu": uuid,
        "pid": pid,
        "reason": f"{kind} here",
        "actionable": True,
        "key": f"{kind}:{uuid}:{'gpu' if pid is None else f'{pid}@7'}",
    }


def report(*findings: dict[str, Any]) -> dict[str, Any]:
    return {"gpus": [], "findings": list(findings)}


def verdict_for(scan: dict[str, Any]) -> NodeVerdict:
    """The verdict a scan with these findings would give (each finding dirt on its GPU)."""
    gpus = []
    for index, uuid in enumerate((UUID0, UUID1)):
        mine = [(f["kind"], f["reason"]) for f in scan["findings"] if f["gpu"] == uuid]
        gpus.append(gpu(index, uuid, *mine))
    return NodeVerdict(tuple(gpus))


def daemon(
    *findings: dict[str, Any], under_way: tuple[dict[str, Any], ...] = (), pid: int = 777
) -> dict[str, Any]:
    """The daemon's state file: it has seen ``findings`` (and ``under_way``), and has a
    ladder running for each of ``under_way``."""
    ladders = {
        f"{f['pid']}@7": Ladder(
            target=f"{f['pid']}@7",
            pid=f["pid"],
            start_ticks=7,
            finding_key=f["key"],
            rule="orphans",
            gpu=f["gpu"],
            steps=(("SIGTERM", 2.0), ("SIGKILL", 1.0)),
            step=1,
            due=100.0,
            status=LadderStatus.ACTIVE,
            dry_run=False,
            started=90.0,
        )
        for f in under_way
    }
    seen = {
        f["key"]: SeenFinding(first_seen=90.0, digest="d", gpu=f["gpu"], target=None)
        for f in (*findings, *under_way)
    }
    plan = PlanState(boot_id="boot", seen=seen, ladders=ladders).to_json()
    return {"status": {"pid": pid}, "plan": plan}


class Fakes:
    def __init__(self, reports: list[dict[str, Any] | None], states: list[dict[str, Any]]):
        self.reports = reports
        self.states = states
        self.now = 0.0
        self.scans = 0
        self.out = io.StringIO()
        self.unread: str | None = None  # why the scan could not read the daemon's state

    def scan(self, policy: Policy) -> ScanResult:
        self.scans += 1
        current = self.reports[min(self.scans - 1, len(self.reports) - 1)]
        if current is None:
            return ScanResult(None, error="NVML: driver not loaded")
        return ScanResult(current, verdict=verdict_for(current), state_unread=self.unread)

    def peek(self) -> dict[str, Any]:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def sleep(self, seconds: float) -> None:
        assert 0 < seconds <= 5.0
        self.now += seconds

    def run(self, timeout: float, interval: float = 1.0) -> int | None:
        return wait_for_daemon(
            Policy(interval=interval),
            timeout,
            scan=self.scan,
            peek=self.peek,
            clock=lambda: self.now,
            sleep=self.sleep,
            out=self.out,
            running=lambda state: _as_status(state).get("pid") != GONE_PID,
        )


GONE_PID = 778
DAEMON = daemon()
ORPHAN = finding("orphaned", UUID0, pid=4242)
DEAD = finding("dead_process", UUID0, pid=4241)


def _as_status(state: Mapping[str, object]) -> Mapping[str, object]:
    status = state.get("status")
    return status if isinstance(status, dict) else {}


def test_once_exits_0_once_nothing_is_under_way_and_every_gpu_is_clean() -> None:
    # The worker is gone; the driver still lists its dead owner for a moment.
    scans: list[dict[str, Any] | None] = [
        report(ORPHAN, DEAD),
        report(ORPHAN, DEAD),
        report(DEAD),
        report(),
    ]
    states = [daemon(DEAD, under_way=(ORPHAN,)), daemon(DEAD, under_way=(ORPHAN,)), daemon(DEAD)]
    fakes = Fakes(scans, states)
    assert fakes.run(timeout=60) == 0
    assert fakes.scans == 4
    assert fakes.now == 3.0
    assert "pid 777" in fakes.out.getvalue()
    assert "clean" in fakes.out.getvalue().splitlines()[-1]


def test_once_gives_up_at_once_when_nothing_the_daemon_does_will_change_it() -> None:
    """The daemon has seen the orphan and runs no ladder for it (no rule, dry-run ended,
    paused): waiting changes nothing."""
    fakes = Fakes([report(ORPHAN)], [daemon(ORPHAN)])
    assert fakes.run(timeout=60) == 75
    assert fakes.scans == 1
    last = fakes.out.getvalue().splitlines()[-1]
    assert "nothing the daemon does will change it" in last
    assert f"GPU 0 {UUID0}: orphaned" in last


def test_once_waits_for_what_the_daemon_has_not_seen_yet() -> None:
    """A leftover that appeared since the daemon's last poll (or a job handed over, taken at
    its next poll) has no ladder yet: that is no reason to give up."""
    fakes = Fakes([report(ORPHAN)], [DAEMON, DAEMON, daemon(ORPHAN)])
    assert fakes.run(timeout=60) == 75
    assert fakes.scans == 3
    assert "not seen by the daemon" not in fakes.out.getvalue().splitlines()[-1]


def test_once_times_out_with_75_naming_what_is_left() -> None:
    fakes = Fakes([report(ORPHAN)], [daemon(under_way=(ORPHAN,))])
    assert fakes.run(timeout=12, interval=30) == 75
    assert fakes.now == 12.0  # slept at most 5 s at a time, never past the timeout
    last = fakes.out.getvalue().splitlines()[-1]
    assert "timed out" in last
    assert f"orphaned PID 4242 on {UUID0}: under way" in last


def test_once_beside_the_daemon_cannot_call_clean_what_its_state_hides() -> None:
    """Every GPU clean, nothing under way, but the scan could not read the daemon's plan (a
    daemon of another version writes it): as check-clean, 75, not 0; waiting will not tell."""
    fakes = Fakes([report()], [DAEMON])
    fakes.unread = "/state/state.json: the daemon's plan cannot be read (version 99)"
    assert fakes.run(timeout=60) == 75
    assert fakes.scans == 1
    last = fakes.out.getvalue().splitlines()[-1]
    assert f"cannot tell whether the GPUs are clean: {fakes.unread}" in last


def test_an_unreadable_daemon_state_is_waited_out() -> None:
    broken = {"status": {"pid": 777}, "plan": {"version": "?"}}
    fakes = Fakes([report(ORPHAN)], [broken])
    assert fakes.run(timeout=3) == 75
    assert "cannot be read" in fakes.out.getvalue().splitlines()[-1]


def test_once_does_not_scan_while_the_daemon_resets() -> None:
    resetting = {
        **DAEMON,
        "plan": {**DAEMON["plan"], "reset_in_flight": {"gpu": UUID0, "since": 1.0}},
    }
    fakes = Fakes([report()], [resetting, resetting, DAEMON])
    assert fakes.run(timeout=60) == 0
    assert fakes.scans == 1  # only once the reset was over

    stuck = Fakes([report()], [resetting])
    assert stuck.run(timeout=3) == 75
    assert stuck.scans == 0
    assert f"a reset of {UUID0} under way" in stuck.out.getvalue()


def test_a_reset_in_progress_is_named_by_its_gpu() -> None:
    """The state's ``reset_in_progress`` record (act/reset_target.progress_record) names its
    GPU ``uuid``; it was read as ``gpu``, so the wait said "a reset of a GPU under way"."""
    record = {"uuid": UUID0, "pci_bus_id": None, "step": "reset", "since": 1.0}
    stuck = Fakes([report()], [{**DAEMON, "reset_in_progress": record}])
    assert stuck.run(timeout=3) == 75
    assert stuck.scans == 0
    assert f"a reset of {UUID0} under way" in stuck.out.getvalue()


def test_once_exits_69_when_nvml_is_unavailable() -> None:
    fakes = Fakes([None], [DAEMON])
    assert fakes.run(timeout=60) == 69
    assert "driver not loaded" in fakes.out.getvalue()


def test_once_hands_back_to_its_caller_when_the_daemon_stops_mid_wait() -> None:
    """The caller (daemon.py) then takes the lock and goes on alone for the time left."""
    fakes = Fakes([report(ORPHAN)], [DAEMON, DAEMON, daemon(pid=GONE_PID)])
    assert fakes.run(timeout=60) is None
    assert fakes.scans == 2
    assert fakes.now == 2.0


def test_the_scripts_read_the_line_check_clean_writes_when_the_files_do_not_validate() -> None:
    """The Slurm script learns the mode of the policy the daemon runs from this line (a bad
    drop-in must not drain): one spelling in both. (The node-problem-detector plugin reads
    the running policy's mode from the daemon's metrics file instead.)"""
    repo = Path(__file__).resolve().parents[2]
    script = repo / "contrib/slurm/gpuwatchd-slurm"
    assert f'"{RUNNING_POLICY}"' in script.read_text()


def test_a_check_clean_that_fails_unexpectedly_exits_70_never_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 1 says a GPU is not clean, and Python exits 1 on an exception nobody caught: a
    bug in check-clean (a huge number in the state file made one) exits 70 instead, its first
    line (the Slurm scripts' drain reason) naming the error, the traceback after it."""

    def broken(policy: Policy, **kwargs: object) -> ScanResult:
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr("gpuwatchd.cli.scan.scan_host", broken)
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\n")
    assert main(["check-clean", "--config", str(config)]) == 70
    first, *rest = capsys.readouterr().err.splitlines()
    assert first == (
        "gpuwatchd: check-clean failed (OverflowError: int too large to convert to float): "
        "no answer; this is a bug, please report it with the lines below"
    )
    assert "Traceback" in rest[0]
