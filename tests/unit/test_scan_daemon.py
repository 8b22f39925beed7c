"""scan's ``daemon`` object (docs/scan.md): the pause file and the saved plan's kill-cap latch
as a report carries them for ``explain``; absent when no saved state can be read. And the boot
time a scan reads from ``<proc_root>/stat``."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.cli.scan import daemon_section, read_boot_time, saved_plan
from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.core.model import HolderScan, NvmlReading, Snapshot
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import Policy
from gpuwatchd.state.directory import StateDir
from gpuwatchd.state.pause import PAUSE_FILE, set_pause
from gpuwatchd.state.saved import STATE_FILE, StateStore, read_saved_state

BOOT = "boot-1"
LATCHED = PlanState(
    forced_dry_run=True,
    forced_reason="storm",
    signal_history=(("a", time.monotonic() - 4000.0), ("b", time.monotonic() - 10.0)),
)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[StateDir]:
    with StateDir.open(str(tmp_path / "state"), create=True) as folder:
        yield folder


def _section(folder: StateDir, *, boot_id: str = BOOT) -> dict[str, object] | None:
    now = time.time()
    snapshot = Snapshot(time.monotonic(), now, boot_id, NvmlReading(True), {}, HolderScan("full"))
    saved = read_saved_state(folder)
    return daemon_section(folder, saved, saved_plan(saved), Policy(), snapshot)


def _save(folder: StateDir, data: dict[str, object]) -> None:
    StateStore(folder.path).save({"boot_id": BOOT, **data})


def test_without_a_saved_state_the_report_says_nothing(state_dir: StateDir) -> None:
    set_pause(state_dir, reason="maintenance")  # a pause alone: no daemon state to read
    assert _section(state_dir) is None


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[]", b"null", json.dumps({"plan": {}}).encode() * 2],
)
def test_a_saved_state_that_is_no_state_file_leaves_it_out(
    state_dir: StateDir, content: bytes
) -> None:
    Path(state_dir.join(STATE_FILE)).write_bytes(content)
    assert _section(state_dir) is None


def test_an_untrusted_saved_state_leaves_it_out(state_dir: StateDir, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    StateStore(str(tmp_path / "other")).save({"plan": LATCHED.to_json()})
    os.rename(tmp_path / "other" / STATE_FILE, elsewhere)
    os.symlink(elsewhere, state_dir.join(STATE_FILE))  # a link is never followed
    assert _section(state_dir) is None


def test_a_latched_plan_and_a_pause_are_both_said(state_dir: StateDir) -> None:
    _save(state_dir, {"plan": LATCHED.to_json()})
    set_pause(state_dir, reason="driver upgrade")
    assert _section(state_dir) == {
        "paused": True,
        "paused_reason": "driver upgrade",
        "forced_dry_run": True,
        "forced_reason": "storm",
        "signalled_last_hour": 1,  # the signal of 4,000 s ago is out of the hour
    }


def test_no_pause_file_is_no_pause(state_dir: StateDir) -> None:
    _save(state_dir, {})  # no plan yet: the daemon's defaults (no latch, nothing signalled)
    assert _section(state_dir) == {
        "paused": False,
        "paused_reason": None,
        "forced_dry_run": False,
        "forced_reason": None,
        "signalled_last_hour": 0,
    }


def test_a_malformed_plan_leaves_the_latch_and_the_hour_unknown(state_dir: StateDir) -> None:
    _save(state_dir, {"plan": {**LATCHED.to_json(), "forced_dry_run": "yes"}})
    section = _section(state_dir)
    assert section is not None
    assert (section["forced_dry_run"], section["forced_reason"]) == (None, None)
    assert section["signalled_last_hour"] is None
    assert section["paused"] is False


def test_another_boots_signal_times_are_not_counted(state_dir: StateDir) -> None:
    _save(state_dir, {"plan": LATCHED.to_json()})
    section = _section(state_dir, boot_id="boot-2")
    assert section is not None
    assert section["forced_dry_run"] is True  # the latch holds across boots
    assert section["signalled_last_hour"] is None


@pytest.mark.parametrize(
    ("content", "reason"),
    [(b"stop now\n", "stop now"), (b"[1]", None), (b"", None)],
)
def test_a_malformed_pause_file_pauses_as_the_daemon_reads_it(
    state_dir: StateDir, content: bytes, reason: str | None
) -> None:
    _save(state_dir, {})
    Path(state_dir.join(PAUSE_FILE)).write_bytes(content)
    section = _section(state_dir)
    assert section is not None
    assert (section["paused"], section["paused_reason"]) == (True, reason)


def test_a_pause_whose_time_is_up_is_no_pause(state_dir: StateDir) -> None:
    _save(state_dir, {})
    now = BootTime.read(time.time(), BOOT)
    assert now.seconds is not None
    earlier = BootTime(now.wall - 120.0, now.seconds - 120.0, BOOT)
    set_pause(state_dir, reason="short", clock=earlier, seconds=60)
    section = _section(state_dir)
    assert section is not None
    assert (section["paused"], section["paused_reason"]) == (False, None)
    set_pause(state_dir, reason="long", clock=earlier, seconds=600)
    assert _section(state_dir) == {**section, "paused": True, "paused_reason": "long"}


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("btime 1700000000", 1700000000),
        ("btime nan", None),
        ("btime inf", None),
        ("btime -5", None),
        ("btime 1e9", None),
        ("btime 17 00", None),
        ("btime ", None),
    ],
)
def test_the_boot_time_is_whole_ascii_digits_or_unknown(
    tmp_path: Path, line: str, found: int | None
) -> None:
    """A container's or a hostile ``/proc/stat`` never gives a NaN or infinite boot time."""
    (tmp_path / "stat").write_text(f"cpu  1 2 3\n{line}\nprocesses 9\n")
    assert read_boot_time(str(tmp_path)) == found
