"""The daemon's NVML reading (``nvml.json``, and what it answers ``scan`` from) (issue 25).

Decoded, the reading is the same GPUs a scan's own worker reply decodes to, less the Xid events
the daemon consumed; it stands for a reading taken now only while it is no older than the poll
interval. The daemon's publisher writes it after a good read and removes it after a failed one,
and confirms an unchanged reading by the file's time instead of writing it again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.collect.nvml import decode_gpu
from gpuwatchd.served import nvml as nvml_view
from gpuwatchd.state.directory import StateDir

BOOT = "b" * 36


def _gpu(index: int = 0, **over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "index": index,
        "uuid": f"GPU-{index:08d}",
        "name": "Fake H100",
        "pci_bus_id": f"00000000:{index + 1:02X}:00.0",
        "minor": index,
        "memory": {
            "total": 80 << 30,
            "free": 79 << 30,
            "reserved": 1 << 20,
            "allocated": 600 << 20,
            "api": "v2",
        },
        "processes": [{"pid": 4242, "used_memory": 600 << 20, "kind": "compute"}],
        "mig_mode": False,
        "persistence_mode": True,
        "health": {"events": "ok", "xids": [{"xid": 79, "wall": 1000.0}]},
    }
    raw.update(over)
    return raw


def _doc(gpus: Any = None, **over: Any) -> dict[str, Any]:
    doc = nvml_view.encode(
        boot_id=BOOT,
        daemon_pid=100,
        daemon_start_ticks=5000,
        read_at=1000.0,
        polled=1000.2,
        interval=5.0,
        reply={
            "available": True,
            "driver_version": "550.54",
            "gpus": [_gpu(0)] if gpus is None else gpus,
        },
    )
    doc.update(over)
    return doc


def _raw(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


def _json(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_bytes())
    return doc


def test_a_published_reading_decodes_to_what_the_worker_reply_decodes_to_less_the_xids() -> None:
    published = nvml_view.Published.of(_doc())
    assert published.daemon_pid == 100
    assert (published.read_at, published.polled, published.interval) == (1000.0, 1000.2, 5.0)
    assert published.reading.available
    assert published.reading.driver_version == "550.54"
    (gpu,) = published.reading.gpus
    expected = decode_gpu(_gpu(0, health={"events": "ok", "xids": []}))
    assert gpu == expected
    assert gpu.health is not None
    assert gpu.health.xids == ()
    assert decode_gpu(_gpu(0)).health.xids != ()  # type: ignore[union-attr]  # the input had one
    # What the file holds decodes the same (a JSON round trip changes nothing).
    assert nvml_view.Published.of(json.loads(_raw(_doc()))) == published


@pytest.mark.parametrize("version", [550, ["550.54"], b"550.54"])
def test_a_driver_version_not_a_string_is_malformed_as_a_scans_own_reply_says(
    version: object,
) -> None:
    """A scan's own worker reply with a driver version of another type reads as malformed
    (collect/nvml.py); the daemon's reading, decoded by the same converters, passed it through
    as the reading's driver version (an int where a string is promised)."""
    with pytest.raises(ValueError, match="driver_version: expected a string"):
        nvml_view.Published.of(_doc(driver_version=version))
    assert nvml_view.Published.of(_doc(driver_version=None)).reading.driver_version is None


def _usable(**over: Any) -> str | None:
    args: dict[str, Any] = {"now_wall": 1003.0, "interval": 5.0}
    args.update(over)
    return nvml_view.usable(nvml_view.Published.of(_doc()), **args)


def test_a_reading_stands_for_one_taken_now_only_while_fresh() -> None:
    assert _usable() is None
    assert _usable(now_wall=1000.0 + 5.0 + nvml_view.READ_SLACK) is None  # the edge
    assert "old" in str(_usable(now_wall=1000.0 + 5.0 + nvml_view.READ_SLACK + 0.01))
    assert "old" in str(_usable(interval=1.0, now_wall=1002.5))  # the scan's shorter interval
    assert "future" in str(_usable(now_wall=990.0))  # the clock was set back


@pytest.fixture
def state(tmp_path: Path) -> Iterator[StateDir]:
    opened = StateDir.open(str(tmp_path / "state"), create=True, euid=os.geteuid())
    try:
        yield opened
    finally:
        opened.close()


def test_the_publisher_writes_after_a_good_read_and_removes_after_a_failed_one(
    state: StateDir,
) -> None:
    errors: list[str] = []
    publisher = nvml_view.ReadingPublisher(lambda: state, errors.append)
    path = Path(state.join(nvml_view.READING_FILE))
    publisher.publish(_doc())
    assert _json(path)["daemon"]["pid"] == 100
    assert path.stat().st_mode & 0o077 == 0
    publisher.publish(None)
    assert not path.exists()
    publisher.publish(None)  # nothing to remove: no error
    assert errors == []


def test_a_write_that_keeps_failing_is_said_once_until_it_works_again(state: StateDir) -> None:
    errors: list[str] = []
    broken = StateDir(state.path, -1, state.owners)  # a closed descriptor: every write fails
    current = [broken]
    publisher = nvml_view.ReadingPublisher(lambda: current[0], errors.append)
    for _ in range(3):
        publisher.publish(_doc())
    assert len(errors) == 1  # once a poll would flood the journal
    current[0] = state
    publisher.publish(_doc())
    assert (Path(state.path) / nvml_view.READING_FILE).exists()
    current[0] = broken
    publisher.publish(_doc())
    assert len(errors) == 2  # failing again after it worked is said again


# --- a reading confirmed, not written again ---------------------------------------------------


def _times(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def test_an_unchanged_reading_is_confirmed_by_its_time_not_written_again(
    state: StateDir,
) -> None:
    """A quiet poll's reply equals the last but for its times: the file stays (same inode) and
    only its time moves to the new poll's read_at, which a reader takes as when NVML was
    asked (docs/internals.md, `gpuwatchd.served.nvml`)."""
    errors: list[str] = []
    publisher = nvml_view.ReadingPublisher(lambda: state, errors.append)
    path = Path(state.join(nvml_view.READING_FILE))
    publisher.publish(_doc())
    first_inode, first_time = _times(path)
    assert first_time == 1000 * 10**9  # the time says read_at from the first write
    publisher.publish(_doc(read_at=1005.0, polled=1005.2))
    inode, mtime = _times(path)
    assert inode == first_inode
    assert mtime == 1005 * 10**9
    assert _json(path)["read_at"] == 1000.0  # the text itself is as written
    assert errors == []


@pytest.mark.parametrize(
    "change",
    [
        {"rewrite": True},  # the holder view was written this poll
        {"driver_version": "555.1"},  # the reply changed
    ],
)
def test_a_changed_reading_or_a_rewritten_view_writes_the_file_afresh(
    state: StateDir, change: dict[str, Any]
) -> None:
    errors: list[str] = []
    publisher = nvml_view.ReadingPublisher(lambda: state, errors.append)
    path = Path(state.join(nvml_view.READING_FILE))
    publisher.publish(_doc())
    first_inode, _ = _times(path)
    rewrite = bool(change.pop("rewrite", False))
    publisher.publish(_doc(read_at=1005.0, polled=1005.2, **change), rewrite=rewrite)
    inode, mtime = _times(path)
    assert inode != first_inode
    assert mtime == 1005 * 10**9
    assert (_json(path)["read_at"], _json(path)["polled"]) == (1005.0, 1005.2)


def test_a_file_touched_by_anyone_else_is_written_again_not_confirmed(state: StateDir) -> None:
    errors: list[str] = []
    publisher = nvml_view.ReadingPublisher(lambda: state, errors.append)
    path = Path(state.join(nvml_view.READING_FILE))
    publisher.publish(_doc())
    forged = _doc(daemon={"pid": 1, "start_ticks": 1})
    path.write_bytes(_raw(forged))  # in place: same inode, another size and time
    publisher.publish(_doc(read_at=1005.0, polled=1005.2))
    assert _json(path)["daemon"]["pid"] == 100  # the daemon's own again
    os.utime(path, ns=(2000 * 10**9, 2000 * 10**9))  # only its time moved
    publisher.publish(_doc(read_at=1010.0, polled=1010.2))
    assert _json(path)["read_at"] == 1010.0  # written again, not confirmed as of 2000
    assert path.stat().st_mtime_ns == 1010 * 10**9
