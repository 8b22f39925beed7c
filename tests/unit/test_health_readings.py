"""GPU health readings at their edges (decide/health/judge.py): which GPUs are judged, what support
an answer needs before it counts, how the Xid history is bounded, and what a saved history
must look like to be read back. Tables of readings; each row says what it pins.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuwatchd.core import model
from gpuwatchd.decide.health.judge import assess_health, recovery_name
from gpuwatchd.decide.health.state import MAX_COUNT, MAX_XID_KINDS, HealthState

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"
QUIET = model.GpuHealth(
    events=model.Support.OK, recovery_action=0, recovery_support=model.Support.OK,
    remap_pending=False, remap_failure=False, remap_support=model.Support.OK,
    pages_support=model.Support.NOT_SUPPORTED,
)  # fmt: skip


def gpu(index: int, uuid: str, health: model.GpuHealth | None) -> model.GpuInfo:
    return model.GpuInfo(index=index, uuid=uuid, minor=index, processes=(), health=health)


def judge(
    *gpus: model.GpuInfo, state: HealthState | None = None
) -> tuple[dict[str, model.FindingKind], dict[str, dict[str, object]], HealthState]:
    snapshot = model.Snapshot(
        monotonic=1000.0, wall_time=1_700_000_000.0, boot_id="b",
        nvml=model.NvmlReading(available=True, gpus=gpus), processes={},
        holders=model.HolderScan("full"),
    )  # fmt: skip
    result = assess_health(snapshot, state or HealthState(), boot_changed=False)
    kinds = {f.gpu or "": f.kind for f in result.findings}
    evidence = {f.gpu or "": dict(f.evidence) for f in result.findings}
    return kinds, evidence, result.state


def test_a_gpu_whose_health_was_not_read_does_not_hide_the_next_one() -> None:
    kinds, evidence, _ = judge(gpu(0, GPU0, None), gpu(1, GPU1, replace(QUIET, recovery_action=1)))
    assert kinds == {GPU1: model.FindingKind.RESET_REQUIRED}
    assert evidence[GPU1]["reasons"] == [
        "the driver's recovery action is GPU_RESET (1): NVIDIA: end the GPU's processes and "
        "reset it"
    ]
    assert evidence[GPU1]["recovery_action"] == "GPU_RESET (1)"


@pytest.mark.parametrize(
    ("case", "reading", "expected"),
    [
        (
            "retired pages pending, support known",
            replace(QUIET, pages_support=model.Support.OK, pages_pending=True),
            model.FindingKind.REBOOT_REQUIRED,
        ),
        (
            "retired pages pending, support unknown",
            replace(QUIET, pages_support=model.Support.UNKNOWN, pages_pending=True),
            None,
        ),
        (
            "a row remap pending, support unknown",
            replace(QUIET, remap_support=model.Support.UNKNOWN, remap_pending=True),
            None,
        ),
        (
            "recovery action GPU_RESET, support unknown",
            replace(QUIET, recovery_support=model.Support.UNKNOWN, recovery_action=1),
            None,
        ),
    ],
)
def test_a_health_answer_counts_only_where_its_support_is_known(
    case: str, reading: model.GpuHealth, expected: model.FindingKind | None
) -> None:
    kinds, _, _ = judge(gpu(0, GPU0, reading))
    assert kinds.get(GPU0) == expected, case


def test_an_xid_from_before_the_last_reset_does_not_hide_a_later_one() -> None:
    """Xid 64 came before the reset (dealt with); Xid 95 after it still asks for one."""
    _, _, seen = judge(gpu(0, GPU0, replace(QUIET, xids=(model.XidEvent(64, 10.0),))))
    history = seen.gpus[GPU0]
    state = HealthState({GPU0: replace(history, last_reset=50.0)})
    kinds, evidence, _ = judge(
        gpu(0, GPU0, replace(QUIET, xids=(model.XidEvent(95, 60.0),))), state=state
    )
    assert kinds == {GPU0: model.FindingKind.RESET_REQUIRED}
    assert evidence[GPU0]["reasons"] == [
        "Xid 95 (Uncontained memory error) seen 1 time(s) (NVIDIA: reset the GPU)"
    ]


def test_the_evidence_says_each_support_as_read_and_an_uncatalogued_xid_has_no_bucket() -> None:
    """A reset-required GPU whose remapped rows are supported, retired pages not, fabric not
    offered, and whose history holds an Xid the catalogue does not know."""
    reading = replace(
        QUIET,
        recovery_action=1,
        fabric_support=model.Support.NOT_SUPPORTED,
        xids=(model.XidEvent(1000, 5.0),),
    )
    _, evidence, _ = judge(gpu(0, GPU0, reading))
    found = evidence[GPU0]
    assert found["remapped_rows"] == {
        "support": "ok", "correctable": None, "uncorrectable": None, "pending": False,
        "failure": False,
    }  # fmt: skip
    assert found["retired_pages_support"] == "not_supported"
    assert found["fabric"] == {
        "support": "not_supported", "state": None, "status": None, "health_mask": None,
        "health_summary": None,
    }  # fmt: skip
    assert found["xids"] == {
        "1000": {"count": 1, "first": 5.0, "last": 5.0, "action": "report", "bucket": None}
    }


def test_the_xid_history_keeps_at_most_its_bound_of_kinds_and_still_counts_known_ones() -> None:
    first = 1000
    storm = [model.XidEvent(first + n, float(n)) for n in range(MAX_XID_KINDS + 6)]
    storm.append(model.XidEvent(first, 99.0))  # a known Xid after the ones that did not fit
    _, _, state = judge(gpu(0, GPU0, replace(QUIET, xids=tuple(storm))))
    xids = state.gpus[GPU0].xids
    assert len(xids) == MAX_XID_KINDS
    assert set(xids) == {first + n for n in range(MAX_XID_KINDS)}
    assert (xids[first].count, xids[first].last) == (2, 99.0)


def test_recovery_action_names() -> None:
    assert recovery_name(None) is None
    assert recovery_name(4) == "DRAIN_AND_RESET (4)"
    assert recovery_name(99) == "unknown (99)"


# --- a saved history, read back ----------------------------------------------------------------


def _xids(n: int) -> dict[str, list[float]]:
    return {str(1000 + i): [1, 1.0, 2.0] for i in range(n)}


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({GPU0: []}, f"health.{GPU0}: expected an object"),
        ({1: {}}, "health.1: expected an object"),
        ({GPU0: {"xids": []}}, "xids: expected an object of at most"),
        ({GPU0: {"xids": _xids(MAX_XID_KINDS + 1)}}, "xids: expected an object of at most"),
        ({GPU0: {"xids": {"95": [1, 1.0]}}}, "xids.95: expected [count, first, last]"),
        ({GPU0: {"xids": {"95": {"a": 1, "b": 2, "c": 3}}}}, "xids.95: expected [count"),
        ({GPU0: {"xids": {"95": [-1, 1.0, 2.0]}}}, "xids.95: expected [count"),
        # A count above what the daemon adds up to (MAX_COUNT) is none it wrote.
        ({GPU0: {"xids": {"95": [MAX_COUNT + 1, 1.0, 2.0]}}}, "xids.95: expected [count"),
        # The Xid keys are bounded as the details' and the Xid log's are (5 digits at most).
        ({GPU0: {"xids": {"123456": [1, 1.0, 2.0]}}}, "xids.123456: expected Xid numbers"),
        ({GPU0: {"xids": {"x": [1, 1.0, 2.0]}}}, "xids.x: expected Xid numbers"),
        ({GPU0: {"details": {"\u00b2": {"wall": 1.0}}}}, "details.\u00b2: expected Xid numbers"),
        # ASCII digits only: str.isdecimal() and int() take other scripts' (Arabic-Indic 13).
        (
            {GPU0: {"xids": {"\u0661\u0663": [1, 1.0, 2.0]}}},
            "xids.\u0661\u0663: expected Xid numbers",
        ),
        # A bad key is said before its bad value, in each of the three maps.
        ({GPU0: {"xids": {"x": []}}}, "xids.x: expected Xid numbers"),
        ({GPU0: {"details": {"x": []}}}, "details.x: expected Xid numbers"),
        ({GPU0: {"xid_log": {"x": []}}}, "xid_log.x: expected Xid numbers"),
        ({GPU0: {"since": []}}, "since: expected an object"),
        # JSON reads 400 digits as an int that no float holds: refused, not an OverflowError.
        ({GPU0: {"last_reset": 10**400}}, f"health.{GPU0}: expected a finite number"),
    ],
)
def test_a_saved_health_history_is_read_back_only_when_well_formed(
    data: object, error: str
) -> None:
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        HealthState.from_json(data)


def test_a_saved_health_history_at_its_bounds_is_read_back() -> None:
    state = HealthState.from_json(
        {
            GPU0: {
                "xids": {**_xids(MAX_XID_KINDS - 2), "95": [0, 1.0, 2.0], "79": [MAX_COUNT, 1, 2]},
                "since": {},
            }
        }
    )
    assert len(state.gpus[GPU0].xids) == MAX_XID_KINDS
    assert state.gpus[GPU0].xids[95].count == 0
    assert state.gpus[GPU0].xids[79].count == MAX_COUNT
