"""The daemon answers ``scan`` from a view that is never stale for an open of a watched device
file (issue 25).

The guard (gpuwatchd/served/guard.py): the daemon's watch reads no event before the published view
says dirty, and before it answers from its last poll's view the daemon asks its own inotify
queue (``FIONREAD``) and that the watch covers every device file; where its full-scan rule
asks for a walk, it declines rather than walk. In-process: the watch, the publisher and the
check against this test's own inotify descriptor. End to end (hundreds of
opens, each asked about at once): tests/system/test_scan_answered.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.cli_scan import scan_pids
from gpuwatchd.cli.scan import ScanResult, scan_host
from gpuwatchd.core.model import HolderScan
from gpuwatchd.decide.policy import Policy
from gpuwatchd.served import holders as holder_view
from gpuwatchd.served import nvml as nvml_view
from gpuwatchd.served.guard import (
    EARLY_GAP,
    GuardedWatch,
    ServedPoll,
    ViewPublisher,
    early_poll_at,
    queued_bytes,
)
from gpuwatchd.state.directory import StateDir
from tests.support.children import Spawn, hold

DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1")


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[Path, StateDir]]:
    devices = tmp_path / "dev"
    devices.mkdir()
    for name in DEVICES:
        (devices / name).write_bytes(b"")
    state = StateDir.open(str(tmp_path / "state"), create=True, euid=os.geteuid())
    try:
        yield devices, state
    finally:
        state.close()


def _holder_view(watch: GuardedWatch | None, fd: int | None = None) -> holder_view.HolderView:
    return holder_view.HolderView.of(
        boot_id="b" * 36,
        daemon_pid=os.getpid(),
        daemon_start_ticks=1,
        worker_pids=frozenset(),
        polled=time.time(),
        fresh_for=60.0,
        settings=("/proc", "/dev", 195),
        holders=HolderScan("full"),
        start_ticks={},
        dead_listed=frozenset(),
        watch_fd=fd if watch is None else watch.fileno(),
    )


def _view(watch: GuardedWatch | None) -> dict[str, object]:
    return _holder_view(watch).document()


def _on_disk(state: StateDir) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(state.read(holder_view.VIEW_FILE, 1 << 20))
    return doc


@contextlib.contextmanager
def _served_clean(
    devices: Path, state: StateDir
) -> Iterator[tuple[ViewPublisher, GuardedWatch, ServedPoll]]:
    """A started watch of ``devices`` marking the view dirty, a clean view published, and the
    daemon's served poll of it, which finds nothing stale; the watch is closed on leaving."""
    publisher = ViewPublisher(lambda: state, lambda error: None)
    watch = GuardedWatch(str(devices), publisher.mark_dirty)
    assert watch.start()
    try:
        publisher.publish(_view(watch))
        served = ServedPoll(_holder_view(watch), None, watch, publisher)
        assert served.stale_because("/proc", str(devices)) is None
        yield publisher, watch, served
    finally:
        watch.close()


def test_the_watch_reads_no_event_before_the_view_on_disk_says_dirty(
    host: tuple[Path, StateDir],
) -> None:
    devices, state = host
    seen: list[object] = []
    publisher = ViewPublisher(lambda: state, seen.append)

    def mark() -> bool:
        # Called with the event still queued: the view on disk is clean until this returns.
        assert queued_bytes(watch.fileno() or -1) > 0
        assert _on_disk(state)["clean"] is True
        done = publisher.mark_dirty()
        assert _on_disk(state)["clean"] is False
        return done

    watch = GuardedWatch(str(devices), mark)
    assert watch.start()
    try:
        publisher.publish(_view(watch))
        assert watch.drain().changed is False  # nothing queued: nothing read, nothing marked
        assert _on_disk(state)["clean"] is True
        os.close(os.open(devices / "nvidia1", os.O_RDONLY))
        news = watch.drain()
        assert news.changed
        assert news.opened == 1
        assert _on_disk(state)["clean"] is False
        assert isinstance(_on_disk(state)["dirty_since"], float)
        publisher.publish(_view(watch))  # the poll that walked publishes a clean view again
        assert _on_disk(state)["clean"] is True
        assert seen == []
    finally:
        watch.close()


def test_publishing_the_view_never_waits_for_the_disk(
    host: tuple[Path, StateDir], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The view (clean or dirty) is for this daemon's lifetime only: no fsync on the poll path,
    where a slow disk would hold up the poll and the watchdog."""
    state = host[1]
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    publisher = ViewPublisher(lambda: state, lambda error: None)
    assert publisher.publish(_view(None))
    assert publisher.mark_dirty()
    assert publisher.publish(_view(None))
    assert _on_disk(state)["clean"] is True
    assert synced == []


def test_an_unchanged_view_is_rewritten_every_refresh_also_after_the_clock_was_set_back(
    host: tuple[Path, StateDir],
) -> None:
    """At least every REFRESH seconds of its polls' wall times: a poll dated before the view on
    disk (the clock set back) rewrites it at once, never only once the clock is past it again."""
    state = host[1]
    publisher = ViewPublisher(lambda: state, lambda error: None)

    def published(polled: float) -> bool:
        return publisher.publish({**_view(None), "polled": polled})

    assert published(1000.0)
    assert not published(1000.0 + holder_view.REFRESH - 1)
    assert published(1000.0 + holder_view.REFRESH)
    assert published(400.0)  # set back ten minutes
    assert _on_disk(state)["polled"] == 400.0
    assert not published(410.0)


def test_a_view_that_cannot_be_marked_dirty_stops_the_watch(
    host: tuple[Path, StateDir],
) -> None:
    """Neither the dirty view written nor the clean one removed: the watch closes, so no reader
    can find an empty queue behind a stale clean view (and the daemon walks periodically)."""
    devices, _state = host
    watch = GuardedWatch(str(devices), lambda: False)
    assert watch.start()
    os.close(os.open(devices / "nvidia0", os.O_RDONLY))
    news = watch.drain()
    assert news.available is False
    assert news.changed is True
    assert watch.fileno() is None
    assert watch.error is not None
    assert "stale" in watch.error


def test_the_daemon_sees_an_open_queued_in_its_watch_before_it_serves_its_view(
    host: tuple[Path, StateDir],
) -> None:
    devices, state = host
    with _served_clean(devices, state) as (publisher, watch, served):
        os.close(os.open(devices / "nvidia0", os.O_RDONLY))
        queued = served.stale_because("/proc", str(devices))
        assert "opened since the daemon's last walk" in str(queued)
        watch.drain()  # marks the view dirty, then reads
        assert "is dirty" in str(served.stale_because("/proc", str(devices)))
        publisher.publish(_view(watch))  # the poll that walked publishes a clean view again
        assert served.stale_because("/proc", str(devices)) is None
    assert "not working" in str(served.stale_because("/proc", str(devices)))


def test_the_daemon_serves_no_view_its_watch_does_not_wholly_cover(
    host: tuple[Path, StateDir],
) -> None:
    devices, state = host
    read_end, write_end = os.pipe()
    try:
        with _served_clean(devices, state) as (publisher, watch, served):
            # A device file the watch does not cover (created after it last looked).
            (devices / "nvidia2").write_bytes(b"")
            assert "does not cover" in str(served.stale_because("/proc", str(devices)))
            (devices / "nvidia2").unlink()
            watch.drain()
            # A MIG capability file the watch has not looked at yet: not covered either,
            # until the watch has (its next drain).
            (devices / "nvidia-caps").mkdir()
            (devices / "nvidia-caps" / "nvidia-cap7").write_bytes(b"")
            assert "does not cover" in str(served.stale_because("/proc", str(devices)))
            watch.drain()
            publisher.publish(_view(watch))
            assert served.stale_because("/proc", str(devices)) is None
            # A descriptor that is no inotify at all, or none.
            for fd in (read_end, None):
                other = ServedPoll(_holder_view(None, fd), None, watch, publisher)
                assert other.stale_because("/proc", str(devices)) is not None
    finally:
        os.close(read_end)
        os.close(write_end)


def test_an_open_wakes_the_daemon_for_a_walk_no_sooner_than_the_gap() -> None:
    assert early_poll_at(None, 50.0, 5.0) == 50.0
    assert early_poll_at(49.8, 50.0, 5.0) == 49.8 + EARLY_GAP
    assert early_poll_at(10.0, 50.0, 5.0) == 50.0
    assert early_poll_at(49.9, 50.0, 0.2) == pytest.approx(50.1)


def _serving(
    devices: Path, state: StateDir
) -> tuple[str, Policy, ViewPublisher, GuardedWatch, holder_view.HolderView]:
    """What a daemon serving scans has: this boot's id, the policy, the view's publisher, a
    started watch of ``devices`` and a clean view of this boot and settings."""
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
        boot = handle.read().strip()
    policy = dataclasses.replace(Policy(), devices_dir=str(devices), state_dir=state.path)
    publisher = ViewPublisher(lambda: state, lambda error: None)
    watch = GuardedWatch(str(devices), publisher.mark_dirty)
    assert watch.start()
    settings = (policy.proc_root, str(devices), policy.device_major)
    return (
        boot,
        policy,
        publisher,
        watch,
        dataclasses.replace(_holder_view(watch), boot_id=boot, settings=settings),
    )


def test_the_daemon_answers_only_from_a_current_view_and_reading(
    host: tuple[Path, StateDir],
) -> None:
    """The daemon's served scan (cli/scan.py, handed its last poll) answers only from a current
    view and reading; otherwise it gives no report, only why (and the command walks)."""
    devices, state = host
    boot, policy, publisher, watch, view = _serving(devices, state)

    def reading(age: float) -> dict[str, object]:
        return nvml_view.encode(
            boot_id=boot, daemon_pid=os.getpid(), daemon_start_ticks=1,
            read_at=time.time() - age, polled=time.time(), interval=policy.interval,
            reply={"driver_version": "550.54", "gpus": []},
        )  # fmt: skip

    def served(view: holder_view.HolderView, reading: Any) -> ScanResult:
        result = scan_host(policy, served=ServedPoll(view, reading, watch, publisher))
        assert (result.report is None) == (result.declined is not None)
        return result

    try:
        publisher.publish(_view(watch))
        report = served(view, reading(0.0)).report
        assert report is not None
        assert report["daemon_view"]["used"] is True  # type: ignore[index]
        assert report["daemon_view"]["answered_by"] == "daemon"  # type: ignore[index]
        assert report["nvml_reading"]["source"] == "daemon"  # type: ignore[index]
        assert "NVML reading is not used" in str(served(view, reading(60.0)).declined)
        assert "no NVML reading" in str(served(view, None).declined)
        other = dataclasses.replace(view, boot_id="c" * 36)
        assert "another boot" in str(served(other, reading(0.0)).declined)
        os.close(os.open(devices / "nvidia0", os.O_RDONLY))
        assert "opened since the daemon's last walk" in str(served(view, reading(0.0)).declined)
    finally:
        watch.close()


def test_the_daemon_declines_a_scan_its_rule_would_walk_for_and_answers_a_held_gpus(
    host: tuple[Path, StateDir], spawn: Spawn
) -> None:
    """10 GiB allocated on GPU 0, no process listed: a walk is due (``unowned_memory``), which
    the daemon does not do for a command (it would run in its loop, unseen by the watchdog): it
    declines. While a holder of the view holds the GPU with nvidia-uvm (its held minors, as the
    daemon's own rule exempts it), the scan is targeted and answered; once that holder is gone
    the walk is due again (``holder_gone``): it declines."""
    devices, state = host
    holder = spawn(hold([str(devices / "nvidia0"), str(devices / "nvidia-uvm")]))  # unwatched
    boot, policy, publisher, watch, view = _serving(devices, state)
    memory = {"total": 80 << 30, "free": 70 << 30, "reserved": 0, "allocated": 10 << 30}
    reading = nvml_view.encode(
        boot_id=boot, daemon_pid=os.getpid(), daemon_start_ticks=1, read_at=time.time(),
        polled=time.time(), interval=policy.interval,
        reply={"driver_version": "550.54",
               "gpus": [{"index": 0, "uuid": "GPU-0", "minor": 0, "memory": memory,
                         "processes": []}]},
    )  # fmt: skip

    def served(view: holder_view.HolderView) -> ScanResult:
        return scan_host(policy, served=ServedPoll(view, reading, watch, publisher))

    try:
        publisher.publish(_view(watch))
        assert served(view).declined == "a walk of /proc is due (unowned_memory)"
        held = dataclasses.replace(
            view,
            holders=frozenset({holder.pid}),
            holder_ticks={holder.pid: None},
            held_minors=frozenset({0}),
        )
        report = served(held).report
        assert report is not None
        assert report["daemon_view"]["scan_reason"] is None  # type: ignore[index]
        assert holder.pid in scan_pids(report)
        holder.kill()
        holder.wait(timeout=10)
        assert served(held).declined == "a walk of /proc is due (holder_gone)"
    finally:
        watch.close()
