"""The kernel log's Xid lines: the parser (table-driven, hostile lines), the folding of a flood
into one record, and the reader following a file in /dev/kmsg's format without blocking."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwatchd.collect.kernel_log import (
    MAX_LINE,
    KernelLog,
    XidLine,
    fold,
    parse_journal_record,
    parse_kmsg_record,
    parse_xid,
)
from gpuwatchd.core.model import CgroupInfo, ProcessInfo


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            "NVRM: Xid (PCI:0000:17:00): 79, pid=1234, name=python3, GPU has fallen off the bus.",
            XidLine("0000:17:00", 79, 1234, "python3", "GPU has fallen off the bus."),
        ),
        (
            "NVRM: Xid (PCI:0000:3b:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception",
            XidLine("0000:3b:00", 13, None, None, "Graphics Exception"),
        ),
        (
            "NVRM: Xid (PCI:0000:3B:00): 31, pid=77, name=train.py, Ch 00000010, MMU Fault",
            XidLine("0000:3b:00", 31, 77, "train.py", "Ch 00000010, MMU Fault"),
        ),
        (
            "NVRM: Xid (PCI:0000:17:00): 79, GPU has fallen off the bus.",
            XidLine("0000:17:00", 79, None, None, "GPU has fallen off the bus."),
        ),
        ("NVRM: Xid (PCI:0000:17:00): 48", XidLine("0000:17:00", 48, None, None, "")),
        (
            "NVRM: Xid (PCI:00000001:17:00.0): 95, pid=9, name=a, x",
            XidLine("00000001:17:00", 95, 9, "a", "x"),
        ),
        (
            "NVRM: Xid (PCI:0000:17:00): 13, pid=8, name=Web Content, SM",
            XidLine("0000:17:00", 13, 8, "Web Content", "SM"),
        ),
        # A MIG GPU's Xid is attributed to its GPU (and compute) instance (NVIDIA's A100 GPU
        # memory error management guide; the driver's krcReportXid): the GPU's all the same.
        (
            "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9)",
            XidLine("0000:01:00", 94, 7194, None, "Contained: CE User Channel (0x9)"),
        ),
        (
            "NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 13, pid=9, name=a, Graphics Exception",
            XidLine("0000:3b:00", 13, 9, "a", "Graphics Exception"),
        ),
        ("NVRM: Xid (PCI:0000:3b:00 GPU-CI:02): 13, x", None),  # a compute instance alone
        ("NVRM: Xid (PCI:0000:3b:00 GPU-I:): 13, x", None),
        ("NVRM: Xid (PCI:0000:3b:00 GPU-I:1 x): 13, x", None),
        ("NVRM: Xid (PCI:0000:17:00): 13, pid=8, name=, SM", None),
        ("NVRM: Xid (PCI:0000:17:00): 13, pid=8, name=" + "n" * 65 + ", SM", None),
        ("NVRM: Xid (PCI:0000:17:00): 95, pid=12x, name=a, x", None),  # malformed pid
        ("NVRM: Xid (PCI:0000:17:00): 95, pid=0, name=a, x", None),  # no such process
        ("NVRM: Xid (PCI:0000:17:00): 95, pid=99999999, name=a, x", None),  # past pid_max
        ("NVRM: Xid (PCI:0000:17:00): 123456, text", None),  # Xid too long
        ("NVRM: Xid (PCI:0000:17:00): -1, text", None),
        ("NVRM: Xid (PCI:zz:17:00): 79, text", None),
        ("NVRM: Xid (PCI:0000:17): 79, text", None),
        ("xNVRM: Xid (PCI:0000:17:00): 79, text", None),  # not at the start
        ("NVRM: GPU at PCI:0000:17:00: GPU-1234", None),  # another NVRM line
        ("NVRM: Xid (PCI:0000:17:00): 79" + ", " + "a" * MAX_LINE, None),  # over-long
        ("NVRM: Xid (PCI:0000:17:00): 13, pid=5, name=\x1b[31mred, x", None),  # control chars
    ],
)
def test_xid_lines_are_parsed_strictly(message: str, expected: XidLine | None) -> None:
    assert parse_xid(message) == expected


def test_the_driver_text_is_cut_and_made_printable() -> None:
    line = parse_xid("NVRM: Xid (PCI:0000:17:00): 13, pid=5, name=p, " + "\x07" + "y" * 500)
    assert line is not None
    assert line.text.startswith("?y")
    assert len(line.text) == 160


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ("3,1234,5000000,-;NVRM: Xid x", (5_000_000, "NVRM: Xid x")),
        ("4,1,7,c,caller=T1;msg", (7, "msg")),
        ("12,1,7,-;NVRM: Xid (PCI:0000:17:00): 79", None),  # facility user: written from user space
        ("3,1,-7,-;msg", None),
        ("3,1,7;msg", None),
        (" SUBSYSTEM=pci", None),  # a continuation line
        ("garbage", None),
    ],
)
def test_kmsg_records_must_be_well_formed_kernel_records(
    record: str, expected: tuple[int, str] | None
) -> None:
    assert parse_kmsg_record(record) == expected


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ("[   12.500000] node7 kernel: NVRM: Xid y", (12_500_000, "NVRM: Xid y")),
        ("[12.5] node7 kernel: NVRM: Xid y", None),
        ("[   12.500000] node7 sudo[12]: NVRM: Xid y", None),  # not the kernel
        ("-- Boot 1234 --", None),
    ],
)
def test_journal_lines_must_be_the_kernel_s(record: str, expected: tuple[int, str] | None) -> None:
    assert parse_journal_record(record) == expected


def test_a_flood_is_folded_into_one_record_with_its_count() -> None:
    line = XidLine("0000:17:00", 95, None, None, "Uncontained")
    other = XidLine("0000:17:00", 13, 42, "python3", "Graphics")
    records = [(1_000_000 + i, line) for i in range(100_000)] + [(3_000_000, other)]
    runs, dropped = fold(records, to_wall=lambda usec: usec / 1e6, started_usec=2_000_000)
    assert dropped == 0
    assert [(r.xid, r.count, r.before_start) for r in runs] == [(95, 100_000, True), (13, 1, False)]
    flood = runs[0]
    assert (flood.first, flood.last, flood.position) == (1.0, 1.099999, 1_099_999)


def test_more_distinct_runs_than_kept_are_dropped_and_counted() -> None:
    records = [(i, XidLine("0000:17:00", 13, i + 1, "p", "")) for i in range(300)]
    runs, dropped = fold(records, to_wall=float, started_usec=0)
    assert (len(runs), dropped) == (256, 44)


def _kmsg(path: Path, usec: int, message: str, prio: int = 3) -> None:
    with path.open("a") as f:
        f.write(f"{prio},1,{usec},-;{message}\n")


def test_the_reader_reads_the_boot_then_follows_and_names_a_living_process_s_job(
    tmp_path: Path,
) -> None:
    log = tmp_path / "kmsg"
    boot_now = int(KernelLog._boot_clock() * 1e6)
    _kmsg(log, boot_now - 50_000_000, "NVRM: Xid (PCI:0000:17:00): 79, GPU has fallen off the bus.")
    _kmsg(log, boot_now - 40_000_000, "NVRM: Xid (PCI:0000:17:00): 79, pid=5, name=user, x", 12)
    job = ProcessInfo(
        pid=42, start_ticks=1, state="S", ppid=1, pgid=42, sid=42, comm="python3",
        cgroup=CgroupInfo("/slurm/job_7", slurm_job="7"),
    )  # fmt: skip
    reader = KernelLog(str(log), read_process={42: job}.get, wall_clock=lambda: 1_000_000.0)
    first = reader.read()
    assert [(r.xid, r.before_start, r.count) for r in first] == [(79, True, 1)]
    assert 999_940.0 < first[0].first < 999_960.0
    assert reader.read() == ()  # nothing new: returns at once
    _kmsg(log, boot_now + 5_000_000, "NVRM: Xid (PCI:0000:17:00): 13, pid=42, name=python3, SM")
    _kmsg(log, boot_now + 5_000_001, "NVRM: Xid (PCI:0000:17:00): 13, pid=43, name=python3, SM")
    later = reader.read()
    assert [(r.pid, r.job, r.before_start) for r in later] == [
        (42, "slurm:7", False),
        (43, None, False),  # gone: no job named
    ]
    reader.close()


def test_a_reused_pid_or_another_name_names_no_job(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    _kmsg(log, 1_000_000, "NVRM: Xid (PCI:0000:17:00): 13, pid=42, name=python3, SM")
    _kmsg(log, 1_000_000, "NVRM: Xid (PCI:0000:17:00): 13, pid=43, name=python3, SM")
    tick = os.sysconf("SC_CLK_TCK")
    cgroup = CgroupInfo("/slurm/job_7", slurm_job="7")
    young = ProcessInfo(42, 5 * tick, "S", 1, 42, 42, comm="python3", cgroup=cgroup)
    renamed = ProcessInfo(43, 0, "S", 1, 43, 43, comm="bash", cgroup=cgroup)
    reader = KernelLog(str(log), read_process={42: young, 43: renamed}.get, suspended=lambda: 0.0)
    assert [r.job for r in reader.read()] == [None, None]
    reader.close()


def test_a_process_started_after_a_suspend_before_the_xid_names_its_job(tmp_path: Path) -> None:
    """/proc's start times count the time the node was suspended (CLOCK_BOOTTIME), the kernel
    log's do not (CLOCK_MONOTONIC): the start is compared on the kernel log's clock."""
    log = tmp_path / "kmsg"
    _kmsg(log, 10_000_000, "NVRM: Xid (PCI:0000:17:00): 13, pid=42, name=python3, SM")
    tick = os.sysconf("SC_CLK_TCK")
    cgroup = CgroupInfo("/slurm/job_7", slurm_job="7")
    job = ProcessInfo(42, 3605 * tick, "S", 1, 42, 42, comm="python3", cgroup=cgroup)
    reader = KernelLog(str(log), read_process={42: job}.get, suspended=lambda: 3600.0)
    assert [r.job for r in reader.read()] == ["slurm:7"]  # started 5s, the Xid at 10s
    reader.close()


def test_over_long_lines_are_skipped_whole(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    _kmsg(log, 1, "NVRM: Xid (PCI:0000:17:00): 79, " + "x" * 100_000)
    _kmsg(log, 2, "NVRM: Xid (PCI:0000:17:00): 48, DBE")
    runs = KernelLog(str(log)).read()
    assert [r.xid for r in runs] == [48]


def test_an_unreadable_source_is_said_once_and_reads_nothing(tmp_path: Path) -> None:
    reader = KernelLog(str(tmp_path / "missing"))
    assert reader.read() == ()
    assert reader.read() == ()


def test_off_reads_nothing() -> None:
    assert KernelLog("off").read() == ()


XID_PREFIX = "NVRM: Xid (PCI:0000:17:00): "


@given(st.text(max_size=300), st.sampled_from(["", XID_PREFIX, XID_PREFIX + "13, pid="]))
def test_no_line_makes_the_parsers_raise(text: str, prefix: str) -> None:
    line = parse_xid(prefix + text)
    if line is not None:
        assert 0 <= line.xid <= 99999
        assert line.pid is None or 0 < line.pid <= 4194304
        assert line.process is None or (line.process.isprintable() and len(line.process) <= 64)
        assert line.text.isprintable()
    parse_kmsg_record(prefix + text)
    parse_journal_record(prefix + text)
