"""The pure decisions of `check-clean` (the prolog) and of `run --once` beside the daemon."""

from __future__ import annotations

import io
from typing import Any

import pytest

from gpuwatchd.cli.check_clean import DIRTY_KINDS, SelectionError, decide, split_selectors
from gpuwatchd.cli.once import wait_for_daemon
from gpuwatchd.cli.scan import ScanResult
from gpuwatchd.decide.policy import Policy

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"


def gpu(index: int, uuid: str, bus: str, **over: Any) -> dict[str, Any]:
    return {"index": index, "uuid": uuid, "pci_bus_id": bus, "lost": False, "error": None, **over}


def finding(
    kind: str, uuid: str | None, *, actionable: bool = False, pid: int | None = 42
) -> dict[str, Any]:
    return {
        "kind": kind,
        "gpu": uuid,
        "pid": pid,
        "reason": f"{kind} here",
        "actionable": actionable,
    }


def report(*findings: dict[str, Any], gpus: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if gpus is None:
        gpus = [gpu(0, UUID0, "00000000:17:00.0"), gpu(1, UUID1, "00000000:65:00.0")]
    return {"gpus": gpus, "findings": list(findings)}


# --- check-clean ---------------------------------------------------------------------------


def test_no_findings_is_clean() -> None:
    assert decide(report(), None) == (0, [])
    assert decide(report(), ["0", "1"]) == (0, [])


@pytest.mark.parametrize("kind", sorted(DIRTY_KINDS))
def test_each_dirty_kind_makes_its_gpu_dirty_even_when_not_actionable(kind: str) -> None:
    code, lines = decide(report(finding(kind, UUID1)), None)
    assert code == 1
    assert lines == [f"GPU 1 {UUID1}: {kind} {kind} here"]


@pytest.mark.parametrize("kind", ["dead_process", "zombie", "abandoned"])
def test_other_kinds_are_dirty_only_when_actionable(kind: str) -> None:
    assert decide(report(finding(kind, UUID0)), None) == (0, [])
    code, lines = decide(report(finding(kind, UUID0, actionable=True)), None)
    assert (code, lines) == (1, [f"GPU 0 {UUID0}: {kind} {kind} here"])


def test_one_line_per_dirty_gpu_with_the_count_of_the_rest() -> None:
    code, lines = decide(
        report(finding("orphaned", UUID0), finding("ghost_memory", UUID0, pid=None)), None
    )
    assert code == 1
    assert lines == [f"GPU 0 {UUID0}: orphaned orphaned here (and 1 more)"]


def test_a_lost_gpu_is_dirty() -> None:
    gpus = [gpu(0, UUID0, "00000000:17:00.0", lost=True, error="fell off the bus")]
    assert decide(report(gpus=gpus), None) == (1, [f"GPU 0 {UUID0}: lost fell off the bus"])


@pytest.mark.parametrize(
    "selector",
    [UUID1, UUID1.lower(), "00000000:65:00.0", "0000:65:00.0", "65:00.0", "1"],
)
def test_selection_by_uuid_bus_id_or_index(selector: str) -> None:
    dirty = report(finding("orphaned", UUID1))
    assert decide(dirty, [selector])[0] == 1
    # GPU 0 is clean: selecting it alone passes whatever GPU 1 holds.
    assert decide(dirty, ["0"]) == (0, [])
    assert decide(dirty, [UUID0, "00000000:17:00.0"]) == (0, [])


@pytest.mark.parametrize("selector", ["2", "GPU-nope", "00000000:99:00.0", "MIG-xyz", "gpu0"])
def test_an_unknown_gpu_is_a_selection_error(selector: str) -> None:
    with pytest.raises(SelectionError, match="names no GPU"):
        decide(report(), [selector])


def test_findings_on_no_known_gpu_count_only_when_every_gpu_is_checked() -> None:
    stray = report(finding("hidden_holder", None))
    assert decide(stray, None) == (1, ["GPU - -: hidden_holder hidden_holder here"])
    assert decide(stray, ["0"]) == (0, [])


def test_hostile_reason_is_escaped() -> None:
    bad = finding("orphaned", UUID0)
    bad["reason"] = "x\nGPU 1 fake: clean\u2028"
    code, lines = decide(report(bad), None)
    assert code == 1
    assert len(lines) == 1
    assert "\n" not in lines[0]
    assert "\\n" in lines[0]


def test_selectors_split_like_cuda_visible_devices() -> None:
    assert split_selectors(None) is None
    assert split_selectors(["0,1", " 3 "]) == ["0", "1", "3"]
    assert split_selectors([""]) == []  # a job without GPUs: nothing to check
    assert decide(report(finding("orphaned", UUID0)), []) == (0, [])


# --- run --once beside the daemon ----------------------------------------------------------


class Fakes:
    def __init__(self, reports: list[dict[str, Any] | None], states: list[dict[str, Any]]):
        self.reports = reports
        self.states = states
        self.now = 0.0
        self.scans = 0
        self.out = io.StringIO()

    def scan(self, policy: Policy) -> ScanResult:
        self.scans += 1
        current = self.reports[min(self.scans - 1, len(self.reports) - 1)]
        if current is None:
            return ScanResult(None, error="NVML: driver not loaded")
        return ScanResult(current)

    def peek(self) -> dict[str, Any]:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def sleep(self, seconds: float) -> None:
        assert 0 < seconds <= 5.0
        self.now += seconds

    def run(self, timeout: float, interval: float = 1.0) -> int:
        return wait_for_daemon(
            Policy(interval=interval),
            timeout,
            scan=self.scan,
            peek=self.peek,
            clock=lambda: self.now,
            sleep=self.sleep,
            out=self.out,
        )


DAEMON = {"status": {"pid": 777}, "plan": {"ladders": {}, "reset_in_flight": None}}


def test_once_exits_0_as_soon_as_nothing_is_actionable() -> None:
    dirty = report(finding("orphaned", UUID0, actionable=True))
    # Not actionable (report-only) findings do not hold the epilog.
    clean = report(finding("ghost_memory", UUID1, pid=None))
    fakes = Fakes([dirty, dirty, clean], [DAEMON])
    assert fakes.run(timeout=60) == 0
    assert fakes.scans == 3
    assert fakes.now == 2.0
    assert "pid 777" in fakes.out.getvalue()
    assert "clean" in fakes.out.getvalue()


def test_once_times_out_with_75_naming_what_is_left() -> None:
    dirty = report(finding("orphaned", UUID0, actionable=True, pid=4242))
    fakes = Fakes([dirty], [DAEMON])
    assert fakes.run(timeout=12, interval=30) == 75
    assert fakes.now == 12.0  # slept at most 5 s at a time, never past the timeout
    last = fakes.out.getvalue().splitlines()[-1]
    assert "timed out" in last
    assert f"orphaned on {UUID0} pid 4242" in last


def test_once_does_not_scan_while_the_daemon_resets() -> None:
    resetting = {
        **DAEMON,
        "plan": {"ladders": {}, "reset_in_flight": {"gpu": UUID0, "since": 1.0}},
    }
    fakes = Fakes([report()], [resetting, resetting, DAEMON])
    assert fakes.run(timeout=60) == 0
    assert fakes.scans == 1  # only once the reset was over

    stuck = Fakes([report()], [resetting])
    assert stuck.run(timeout=3) == 75
    assert stuck.scans == 0
    assert f"a reset of {UUID0} under way" in stuck.out.getvalue()


def test_once_exits_69_when_nvml_is_unavailable() -> None:
    fakes = Fakes([None], [DAEMON])
    assert fakes.run(timeout=60) == 69
    assert "driver not loaded" in fakes.out.getvalue()
