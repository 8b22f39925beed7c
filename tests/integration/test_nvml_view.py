"""The daemon's published NVML reading (``nvml.json``) as a served scan reads it (issue 25).

The file is hostile input: every malformed, forged or untrusted version is refused with a
reason and never raises; a valid one decodes to the same GPUs a scan's own worker reply would;
it stands for a reading taken now only while it is from the running daemon, this boot, no
older than the view the scan uses and no older than the poll interval; and the Xid events the
daemon consumed are not handed on. The daemon's publisher writes it after a good read and
removes it after a failed one.
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


def test_a_published_reading_decodes_to_what_the_worker_reply_decodes_to_less_the_xids() -> None:
    published = nvml_view.parse(_raw(_doc()))
    assert published.daemon_pid == 100
    assert published.daemon_start_ticks == 5000
    assert published.reading.available
    assert published.reading.driver_version == "550.54"
    (gpu,) = published.reading.gpus
    expected = decode_gpu(_gpu(0, health={"events": "ok", "xids": []}))
    assert gpu == expected
    assert gpu.health is not None
    assert gpu.health.xids == ()
    assert decode_gpu(_gpu(0)).health.xids != ()  # type: ignore[union-attr]  # the input had one


def _bad_documents() -> list[tuple[str, bytes]]:
    cases: list[tuple[str, Any]] = [
        ("empty", b""),
        ("a list", b"[]"),
        ("deep", b"[" * 100_000),
        ("not utf-8", b"\xff\xfe{}"),
        ("another version", _doc(version=nvml_view.VERSION + 1)),
        ("the version before the file time counted", _doc(version=1)),
        ("no boot", _doc(boot_id=None)),
        ("daemon not an object", _doc(daemon=[100, 5000])),
        ("pid zero", _doc(daemon={"pid": 0, "start_ticks": 1})),
        ("pid a bool", _doc(daemon={"pid": True, "start_ticks": 1})),
        ("read_at not finite", _doc(read_at=float("nan"))),
        ("read_at a string", _doc(read_at="now")),
        ("gpus not a list", {**_doc(), "gpus": {"0": {}}}),
        ("gpu not an object", _doc(gpus=[7])),
        ("gpu without index", _doc(gpus=[{"uuid": "GPU-x"}])),
        ("index negative", _doc(gpus=[_gpu(-1)])),
        ("minor past 255", _doc(gpus=[_gpu(0, minor=4096)])),
        ("memory negative", _doc(gpus=[_gpu(0, memory={"total": -1})])),
        ("memory past 2^64", _doc(gpus=[_gpu(0, memory={"total": 1 << 70})])),
        ("memory a list", _doc(gpus=[_gpu(0, memory=[1, 2])])),
        ("pid past 2^31", _doc(gpus=[_gpu(0, processes=[{"pid": 1 << 40}])])),
        ("pid missing", _doc(gpus=[_gpu(0, processes=[{"used_memory": 1}])])),
        ("pid text", _doc(gpus=[_gpu(0, processes=[{"pid": "x"}])])),
        ("processes not a list", _doc(gpus=[_gpu(0, processes=5)])),
        ("uuid too long", _doc(gpus=[_gpu(0, uuid="G" * 500)])),
        ("driver not text", _doc(driver_version=["550"])),
        ("too large", b" " * (nvml_view.MAX_BYTES + 1)),
    ]
    return [(name, raw if isinstance(raw, bytes) else _raw(raw)) for name, raw in cases]


@pytest.mark.parametrize(("name", "raw"), _bad_documents(), ids=[n for n, _ in _bad_documents()])
def test_a_malformed_or_forged_reading_is_refused_with_a_reason_never_an_exception(
    name: str, raw: bytes
) -> None:
    with pytest.raises(ValueError) as caught:  # noqa: PT011 - every refusal is a ValueError
        nvml_view.parse(raw)
    assert str(caught.value), name


def _usable(**over: Any) -> str | None:
    args: dict[str, Any] = {
        "now_wall": 1003.0,
        "boot_id": BOOT,
        "daemon_pid": 100,
        "daemon_start_ticks": 5000,
        "view_polled": 1000.2,
        "interval": 5.0,
    }
    args.update(over)
    return nvml_view.usable(nvml_view.parse(_raw(_doc())), **args)


def test_a_reading_stands_for_one_taken_now_only_when_fresh_and_from_the_running_daemon() -> None:
    assert _usable() is None
    assert _usable(view_polled=900.0) is None  # an unchanged view from an older poll: fine
    assert _usable(now_wall=1000.0 + 5.0 + nvml_view.READ_SLACK) is None  # the edge
    assert "old" in str(_usable(now_wall=1000.0 + 5.0 + nvml_view.READ_SLACK + 0.01))
    assert "old" in str(_usable(interval=1.0, now_wall=1002.5))  # the scan's shorter interval
    assert "future" in str(_usable(now_wall=990.0))  # the clock was set back
    assert "boot" in str(_usable(boot_id="c" * 36))
    assert "boot" in str(_usable(boot_id=None))
    assert "another process" in str(_usable(daemon_pid=101))
    assert "another process" in str(_usable(daemon_start_ticks=5001))
    assert "another process" in str(_usable(daemon_start_ticks=None))
    # The view the scan uses is from a later poll (a walk after a device event): the reading
    # may predate that open, so it is not used.
    assert "older than the daemon's holder view" in str(_usable(view_polled=1000.3))


@pytest.fixture
def state(tmp_path: Path) -> Iterator[StateDir]:
    opened = StateDir.open(str(tmp_path / "state"), create=True, euid=os.geteuid())
    try:
        yield opened
    finally:
        opened.close()


def test_the_file_is_read_through_the_trust_rule(state: StateDir) -> None:
    published, note = nvml_view.read_published(state)
    assert published is None
    assert "no NVML reading" in note
    path = Path(state.join(nvml_view.READING_FILE))
    path.write_bytes(_raw(_doc()))
    path.chmod(0o600)
    published, _ = nvml_view.read_published(state)
    assert published is not None
    path.chmod(0o666)  # anyone could have written it
    published, note = nvml_view.read_published(state)
    assert published is None
    assert "writable by group or others" in note
    path.unlink()
    os.symlink("/etc/hostname", path)  # never followed
    published, note = nvml_view.read_published(state)
    assert published is None
    assert "unusable" in note
    path.unlink()
    path.write_bytes(b"{garbage")
    path.chmod(0o600)
    published, note = nvml_view.read_published(state)
    assert published is None
    assert "not JSON" in note


def test_the_publisher_writes_after_a_good_read_and_removes_after_a_failed_one(
    state: StateDir,
) -> None:
    errors: list[str] = []
    publisher = nvml_view.ReadingPublisher(lambda: state, errors.append)
    path = Path(state.join(nvml_view.READING_FILE))
    publisher.publish(_doc())
    assert nvml_view.parse(path.read_bytes()).daemon_pid == 100
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
    asked; the poll it is from is the later of its own and that time."""
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
    published, _ = nvml_view.read_published(state)
    assert published is not None
    assert published.read_at == 1005.0
    assert published.polled == 1005.0  # confirmed at 1005.0: no later than the poll began
    assert nvml_view.parse(path.read_bytes()).read_at == 1000.0  # the text itself is as written
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
    published, _ = nvml_view.read_published(state)
    assert published is not None
    assert (published.read_at, published.polled) == (1005.0, 1005.2)


def test_a_file_touched_by_anyone_else_is_written_again_not_confirmed(state: StateDir) -> None:
    errors: list[str] = []
    publisher = nvml_view.ReadingPublisher(lambda: state, errors.append)
    path = Path(state.join(nvml_view.READING_FILE))
    publisher.publish(_doc())
    forged = _doc(daemon={"pid": 1, "start_ticks": 1})
    path.write_bytes(_raw(forged))  # in place: same inode, another size and time
    publisher.publish(_doc(read_at=1005.0, polled=1005.2))
    assert nvml_view.parse(path.read_bytes()).daemon_pid == 100  # the daemon's own again
    os.utime(path, ns=(2000 * 10**9, 2000 * 10**9))  # only its time moved
    publisher.publish(_doc(read_at=1010.0, polled=1010.2))
    published, _ = nvml_view.read_published(state)
    assert published is not None
    assert published.read_at == 1010.0  # written again: not believed as of 2000


def test_a_reading_last_confirmed_long_ago_is_old() -> None:
    raw = _raw(_doc())
    assert nvml_view.parse(raw, confirmed_at=900.0).read_at == 1000.0  # earlier: the text's
    confirmed = nvml_view.parse(raw, confirmed_at=1003.0)
    assert (confirmed.read_at, confirmed.polled) == (1003.0, 1003.0)
    args: dict[str, Any] = {"boot_id": BOOT, "daemon_pid": 100, "daemon_start_ticks": 5000,
                            "view_polled": 1000.2, "interval": 5.0}  # fmt: skip
    assert nvml_view.usable(confirmed, now_wall=1008.0, **args) is None
    assert "old" in str(nvml_view.usable(confirmed, now_wall=1010.0, **args))
    assert "older than the daemon's holder view" in str(
        nvml_view.usable(confirmed, now_wall=1004.0, **{**args, "view_polled": 1003.5})
    )
