"""Xids from NVML and the kernel log, counted once; floods said once per window; kernel-log Xids
judged by the same catalogue as NVML's (decide/health/xid_sources.py, decide/health/judge.py).
Pure."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuwatchd.core.model import FindingKind, KernelXid, XidEvent
from gpuwatchd.decide.health.judge import assess_health
from gpuwatchd.decide.health.state import MAX_COUNT, HealthState, XidLog
from gpuwatchd.decide.health.xid_sources import (
    DEDUP_WINDOW,
    LOG_WINDOW,
    Merged,
    merge_sources,
    notices,
)
from tests.support.healthcases import GPU0, GPU1, gpu, health, snap

T = 1_700_001_000.0  # the wall time of healthcases.snap(t=1000)


def kx(
    xid: int, wall: float, count: int = 1, position: int | None = None, **over: object
) -> KernelXid:
    record = KernelXid(
        pci="0000:10:00",  # GPU 0 of healthcases: NVML's 00000000:10:00.0
        xid=xid,
        first=wall,
        last=wall,
        position=int(wall * 1e6) if position is None else position,
        count=count,
    )
    return replace(record, **over)  # type: ignore[arg-type]


def merge(nvml: list[XidEvent], kernel: list[KernelXid], **over: object) -> Merged:
    args: dict[str, object] = {"sightings": (), "klog_pos": None, "details": {}, "wall": T}
    args.update(over)
    return merge_sources(nvml, kernel, **args)  # type: ignore[arg-type]


def counted(merged: Merged) -> int:
    return sum(o.count for o in merged.occurrences)


@pytest.mark.parametrize(
    ("nvml_at", "kernel_at", "expected"),
    [
        (T, T - 2, 1),  # the same Xid, both sources: once
        (T, T - DEDUP_WINDOW + 1, 1),
        (T, T - DEDUP_WINDOW - 1, 2),  # too far apart: two Xids
    ],
)
def test_one_xid_seen_by_both_sources_in_one_poll_counts_once(
    nvml_at: float, kernel_at: float, expected: int
) -> None:
    merged = merge([XidEvent(79, nvml_at)], [kx(79, kernel_at)])
    assert counted(merged) == expected
    assert merged.sources[79] == ("kernel", "nvml")


def test_a_different_xid_or_a_second_event_is_not_a_duplicate() -> None:
    merged = merge([XidEvent(79, T), XidEvent(79, T), XidEvent(48, T)], [kx(79, T)])
    assert counted(merged) == 3  # one 79 matched, the second 79 and the 48 counted


def test_sources_read_a_poll_apart_still_count_once() -> None:
    first = merge([XidEvent(13, T)], [])
    assert counted(first) == 1
    second = merge([], [kx(13, T - 1)], sightings=first.sightings, wall=T + 5)
    assert counted(second) == 0
    # and the other way round
    third = merge([], [kx(31, T)])
    fourth = merge([XidEvent(31, T + 5)], [], sightings=third.sightings, wall=T + 5)
    assert counted(third) + counted(fourth) == 1


def test_a_flood_counts_every_line_and_matches_each_nvml_event_once() -> None:
    flood = kx(95, T - 10, count=800_000, last=T)
    merged = merge([XidEvent(95, T)] * 29, [flood])
    assert counted(merged) == 800_000
    assert len(merged.sightings) <= 64  # bounded, whatever the flood


def test_records_counted_before_a_restart_are_skipped() -> None:
    merged = merge([], [kx(79, T, position=500), kx(48, T, position=900)], klog_pos=500)
    assert [o.xid for o in merged.occurrences] == [48]
    assert merged.klog_pos == 900


def test_a_flood_is_said_once_per_window_with_its_count() -> None:
    logs: dict[int, XidLog] = {}
    said_counts: list[tuple[float, int, bool]] = []
    for i in range(10):  # one poll every 10 s, 1000 lines each
        wall = T + 10 * i
        merged = merge([], [kx(95, wall, count=1000, position=i)], wall=wall)
        said, logs = notices(GPU0, merged, logs, wall)
        said_counts.extend((wall - T, n.count, n.repeated) for n in said)
    # said at once, then once the minute has passed, with everything held since
    assert said_counts == [(0.0, 1000, False), (60.0, 6000, False)]
    # quiet afterwards: the held count is said once the window has passed, then nothing
    wall = T + 90 + LOG_WINDOW
    said, logs = notices(GPU0, merge([], [], wall=wall), logs, wall)
    assert [(n.count, n.repeated) for n in said] == [(3000, True)]
    # what was held was seen in earlier polls: no source and no kernel-log line of this poll
    held = said[0].fields()
    assert (held["sources"], held["before_start"], held["driver_text"]) == ([], None, None)
    said, logs = notices(GPU0, merge([], [], wall=wall + LOG_WINDOW), logs, wall + LOG_WINDOW)
    assert said == ()
    assert logs == {}


def test_a_held_count_is_bounded_as_the_history_is() -> None:
    held = {95: XidLog(T - 10, MAX_COUNT, T - 10, T - 5)}
    said, logs = notices(GPU0, merge([], [kx(95, T, count=1000)]), held, T)
    assert said == ()
    assert logs[95].held == MAX_COUNT


def test_an_application_xid_names_its_process_and_job() -> None:
    record = kx(13, T, pid=4242, process="python3", job="slurm:7", text="Graphics SM")
    merged = merge([XidEvent(13, T)], [record])
    (notice,), _ = notices(GPU0, merged, {}, T)
    fields = notice.fields()
    assert (fields["pid"], fields["process"], fields["job"]) == (4242, "python3", "slurm:7")
    assert fields["sources"] == ["kernel", "nvml"]
    assert fields["count"] == 1
    assert fields["before_start"] is False


def test_kernel_log_xids_are_judged_by_the_catalogue_and_marked_before_start() -> None:
    snapshot = replace(
        snap(gpu(0, GPU0, health()), gpu(1, GPU1, health())),
        kernel_xids=(kx(79, T - 500, before_start=True), kx(13, T - 400, pid=7, process="p")),
    )
    result = assess_health(snapshot, HealthState(), boot_changed=False)
    (finding,) = result.findings
    assert (finding.kind, finding.gpu) == (FindingKind.REBOOT_REQUIRED, GPU0)
    xids = finding.evidence["xids"]
    assert isinstance(xids, dict)
    assert xids["79"]["kernel_log"]["before_start"] is True
    assert xids["13"]["kernel_log"]["pid"] == 7
    assert {n.xid for n in result.xid_notices} == {79, 13}
    # carried across a restart: the same records read again are not counted again
    again = assess_health(
        replace(snapshot, wall_time=T + 1),
        HealthState.from_json(result.state.to_json()),
        boot_changed=False,
    )
    assert again.state.gpus[GPU0].xids[79].count == 1
    assert again.xid_notices == ()


def test_a_job_of_the_longest_unit_name_is_read_back_from_the_saved_history() -> None:
    """A job key is one cgroup path component (at most 255 bytes) after its kind: a unit named
    at that length is saved and read back, not refused with the whole saved state; a longer
    one, which no cgroup names, is not kept."""
    longest = "unit:" + "u" * 249 + ".scope"
    runs = (kx(13, T, pid=7, process="p", job=longest), kx(31, T, pid=7, job="unit:" + "u" * 400))
    result = assess_health(replace(snap(gpu(0, GPU0, health())), kernel_xids=runs),
                           HealthState(), boot_changed=False)  # fmt: skip
    details = HealthState.from_json(result.state.to_json()).gpus[GPU0].details
    assert (details[13].job, details[31].job) == (longest, None)


def test_what_each_source_saw_and_said_is_carried_from_poll_to_poll() -> None:
    """The kernel log reports Xid 79 first; NVML's event for it, read the next poll, is the same
    Xid (counted once) and the kernel log's detail stays in the evidence; a new 79 within the
    window is counted but not said again."""
    poll = replace(snap(gpu(0, GPU0, health())), kernel_xids=(kx(79, T, pid=7, process="p"),))
    first = assess_health(poll, HealthState(), boot_changed=False)
    assert [(n.gpu, n.xid) for n in first.xid_notices] == [(GPU0, 79)]
    nvml = snap(gpu(0, GPU0, health(xids=(XidEvent(79, T),))), t=1005.0)
    second = assess_health(nvml, first.state, boot_changed=False)
    (finding,) = second.findings
    xids = finding.evidence["xids"]
    assert isinstance(xids, dict)
    assert (xids["79"]["count"], xids["79"]["kernel_log"]["pid"]) == (1, 7)
    again = snap(gpu(0, GPU0, health(xids=(XidEvent(79, T + 10),))), t=1010.0)
    third = assess_health(again, second.state, boot_changed=False)
    assert third.state.gpus[GPU0].xids[79].count == 2
    assert third.xid_notices == ()


def test_a_kernel_xid_of_a_gpu_nvml_does_not_report_is_not_counted() -> None:
    snapshot = replace(
        snap(gpu(0, GPU0, health())), kernel_xids=(replace(kx(79, T), pci="0000:99:00"),)
    )
    result = assess_health(snapshot, HealthState(), boot_changed=False)
    assert result.findings == ()
    assert result.state.gpus[GPU0].xids == {}


def test_a_kernel_xid_goes_only_to_a_gpu_nvml_names_by_bus_id_and_uuid() -> None:
    """A GPU with no bus id, or with no UUID (a hostile reading: here after GPU 1, on its bus
    id), takes no kernel-log Xid: neither one whose bus id is not one, nor GPU 1's."""
    gpus = (
        replace(gpu(0, GPU0, health()), pci_bus_id=None),
        gpu(1, GPU1, health()),
        replace(gpu(1, "", health()), index=2),
    )
    records = replace(kx(79, T), pci="zz:zz"), replace(kx(79, T), pci="0000:11:00")
    result = assess_health(replace(snap(*gpus), kernel_xids=records), HealthState(),
                           boot_changed=False)  # fmt: skip
    assert (result.state.gpus[GPU0].xids, list(result.state.gpus[GPU1].xids)) == ({}, [79])


def test_nvml_only_xids_are_judged_as_before() -> None:
    """No kernel log: the same finding, the same counts as before the kernel log existed."""
    h = health(xids=(XidEvent(79, T), XidEvent(79, T)))
    result = assess_health(snap(gpu(0, GPU0, h)), HealthState(), boot_changed=False)
    (finding,) = result.findings
    assert finding.kind is FindingKind.REBOOT_REQUIRED
    assert result.state.gpus[GPU0].xids[79].count == 2
    xids = finding.evidence["xids"]
    assert isinstance(xids, dict)
    assert "kernel_log" not in xids["79"]


@pytest.mark.parametrize(
    "garbage",
    [
        {"klog_pos": -1},
        {"klog_pos": "1"},
        {"sightings": [[79, 1.0, "dmesg"]]},
        {"sightings": [[79, 1.0]]},
        {"sightings": [[-1, 1.0, "nvml"]]},  # an Xid as the Xid-keyed parts take one:
        {"sightings": [[100_000, 1.0, "kernel"]]},  # 0 to 5 digits, as the kernel log's
        {"details": {"79": {"pid": "x", "wall": 1.0}}},
        {"details": {"x": {"wall": 1.0}}},
        {"details": {"79": {"process": "p" * 65, "wall": 1.0}}},
        {"xid_log": {"79": [1.0, -1, 1.0, 1.0]}},
        {"xid_log": {"79": [1.0, MAX_COUNT + 1, 1.0, 1.0]}},  # more than notices holds
    ],
)
def test_damaged_kernel_log_state_is_rejected(garbage: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="health"):
        HealthState.from_json({GPU0: {"xids": {}, **garbage}})
