"""Reading /etc/subuid for the kill cap (gpuwatchd/collect/subids.py)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from gpuwatchd.collect import subids
from gpuwatchd.collect.collector import Collector
from gpuwatchd.collect.nvml import NvmlClient
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.collect.subids import SubUidFile, parse_subuid
from gpuwatchd.core.model import SubIdRange
from tests.support.fakenvml import FakeNvml, gpu, state


def test_lines_become_ranges_with_their_owner_resolved_and_junk_skipped() -> None:
    text = (
        "# a comment\n"
        "alice:100000:65536\n"
        "1002:165536:65536\n"
        "nobody-known:231072:10\n"
        "bad line\n"
        "carol:x:5\n"
        "dave:300000:0\n"
        "erin:4294967290:100\n"
    )
    uids = {"alice": 1001}
    assert parse_subuid(text, uids.get) == (
        SubIdRange(100000, 65536, "alice", 1001),
        SubIdRange(165536, 65536, "1002", 1002),
        SubIdRange(231072, 10, "nobody-known", None),
    )


def test_a_line_with_digits_int_cannot_read_is_skipped_as_malformed() -> None:
    # "²" and "¹" are digits to str.isdigit but no decimal number to int().
    text = "bob:²00000:65536\nmallory:100000:¹\n²:100000:65536\nalice:300000:10\n"
    assert parse_subuid(text, {"alice": 1001}.get) == (
        SubIdRange(100000, 65536, "²", None),  # a name, not a uid: no such user
        SubIdRange(300000, 10, "alice", 1001),
    )


def test_only_ascii_digits_of_a_bounded_length_are_numbers() -> None:
    """``'٣'.isdecimal()`` holds and int() reads it (3), but shadow-utils reads ASCII digits
    only: such a field is no number, and an owner so written is a name. A number of thousands
    of digits, which int() refuses to read, is skipped, never an exception."""
    huge = "9" * 5000
    text = (
        "bob:\u0663\u0660\u0660\u0660\u0660\u0660:65536\n"
        "\u0661\u0660\u0660\u0662:100000:10\n"
        f"carol:{huge}:5\nerin:200000:{huge}\n{huge}:300000:10\n"
    )
    assert parse_subuid(text, lambda _name: None) == (
        SubIdRange(100000, 10, "\u0661\u0660\u0660\u0662", None),  # a name: no such user
        SubIdRange(300000, 10, huge, None),
    )


def test_the_file_is_read_again_only_when_it_changes_and_a_missing_one_is_empty(
    tmp_path: Path,
) -> None:
    path = tmp_path / "subuid"
    subuids = SubUidFile(str(path))
    assert subuids.ranges() == ()
    path.write_text("1001:100000:65536\n")
    assert subuids.ranges() == (SubIdRange(100000, 65536, "1001", 1001),)
    first = subuids.ranges()
    assert subuids.ranges() is first  # unchanged: not parsed again
    path.write_text("1001:100000:65536\n1002:200000:100\n")
    os.utime(path, ns=(1, 2))  # a new time as well as a new size
    assert len(subuids.ranges()) == 2
    assert SubUidFile(None).ranges() == ()


def test_the_collector_puts_the_ranges_of_its_subuid_file_in_each_snapshot(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    """The kill cap's input comes from the file the collector is given (injectable)."""
    path = tmp_path / "subuid"
    path.write_text("1001:100000:65536\n")
    fake_nvml.write(state([gpu(0)]))
    nvml = NvmlClient(timeout=10.0, env=fake_nvml.env())
    try:
        collector = Collector(
            ProcFS(str(fake_nvml.devices_dir)),
            nvml,
            namespace_check=False,
            subuids=SubUidFile(str(path)),
        )
        snapshot = collector.collect(full=True)
    finally:
        nvml.stop()
    assert snapshot.subuid_ranges == (SubIdRange(100000, 65536, "1001", 1001),)


def test_a_file_over_its_read_bound_is_read_up_to_its_last_whole_line(tmp_path: Path) -> None:
    """The read stops at MAX_BYTES: a line cut there is not a range (``1002:200000:65536`` cut
    after ``655`` would give uid 1002 a range 100 times too small), the whole lines before are."""
    path = tmp_path / "subuid"
    comment = "#" * (subids.MAX_BYTES - len("1001:100000:65536\n") - len("1002:200000:655") - 1)
    path.write_text(f"1001:100000:65536\n{comment}\n1002:200000:65536\n")
    assert SubUidFile(str(path)).ranges() == (SubIdRange(100000, 65536, "1001", 1001),)


def test_a_subuid_file_that_is_no_regular_file_reads_as_none_without_blocking(
    tmp_path: Path,
) -> None:
    """A FIFO there would block an open() for reading until a writer came: the poll would
    hang. It is not read (no ranges), at once."""
    path = tmp_path / "subuid"
    os.mkfifo(path)
    found: list[tuple[SubIdRange, ...]] = []
    reader = threading.Thread(target=lambda: found.append(SubUidFile(str(path)).ranges()))
    reader.start()
    reader.join(5)
    try:
        assert not reader.is_alive()
        assert found == [()]
    finally:
        if reader.is_alive():  # the old code's blocked open: give it its writer
            os.close(os.open(path, os.O_WRONLY))
            reader.join(5)
