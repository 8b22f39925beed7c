"""The bytes each writer puts in ``state_dir``, pinned: the codec (gpuwatchd/core/codec.py)
writes every file as the hand-written encoders did (key order, JSON layout, final newline,
version), so files written before and after it read the same. The compiled policy's:
tests/integration/test_compiled_policy.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.state.directory import StateDir
from gpuwatchd.state.pause import hand_over_ended_jobs, note_resume, set_pause
from gpuwatchd.state.saved import STATE, StateStore
from gpuwatchd.state.spares import write_spare

NOW = 1_800_000_000.0
CLOCK = BootTime(NOW, 100.0, "b1")
UID = os.getuid()


@pytest.fixture
def state(tmp_path: Path) -> Iterator[StateDir]:
    with StateDir.open(str(tmp_path)) as directory:
        yield directory


def _only(tmp_path: Path, prefix: str) -> bytes:
    (path,) = (p for p in tmp_path.iterdir() if p.name.startswith(prefix))
    return path.read_bytes()


def test_the_pause_file(state: StateDir, tmp_path: Path) -> None:
    set_pause(state, reason="maint", clock=CLOCK, seconds=60)
    assert (tmp_path / "paused").read_bytes() == (
        f'{{"reason": "maint", "since": {NOW}, "until": {NOW + 60}, "boot_id": "b1", '
        f'"since_boot": 100.0, "until_boot": 160.0, "by_uid": {UID}}}\n'
    ).encode()


def test_the_resume_note(state: StateDir, tmp_path: Path) -> None:
    note_resume(state, "done")
    raw = (tmp_path / "resumed").read_bytes()
    data = json.loads(raw)
    assert list(data) == ["reason", "at", "by_uid"]
    assert raw == (json.dumps(data) + "\n").encode()


def test_an_ended_job_hand_over(state: StateDir, tmp_path: Path) -> None:
    hand_over_ended_jobs(state, ["slurm:7"], clock=CLOCK, seconds=60, waiter=(42, 9), said_at=5)
    assert (
        _only(tmp_path, "ended-job-")
        == (
            f'{{"job": "slurm:7", "until": {NOW + 60}, "by_uid": {UID}, "waiter": [42, 9], '
            '"said_at_ticks": 5, "boot_id": "b1", "until_boot": 160.0}\n'
        ).encode()
    )


def test_a_spare(state: StateDir, tmp_path: Path) -> None:
    write_spare(state, "pid:42", clock=CLOCK, seconds=60, reason="r", pid=42, start_ticks=9)
    assert (
        _only(tmp_path, "spare-")
        == (
            f'{{"target": "pid:42", "pid": 42, "start_ticks": 9, "job": null, "since": {NOW}, '
            f'"until": {NOW + 60}, "boot_id": "b1", "since_boot": 100.0, "until_boot": 160.0, '
            f'"reason": "r", "by_uid": {UID}}}\n'
        ).encode()
    )


def test_the_state_file(tmp_path: Path) -> None:
    doc = STATE.envelope(
        {"boot_id": "b1", "saved_at": NOW, "assess": {}, "plan": {"z": 1},
         "reset_in_progress": None, "status": {}}
    )  # fmt: skip
    StateStore(str(tmp_path)).save(doc)
    assert (tmp_path / "state.json").read_bytes() == (
        f'{{"assess":{{}},"boot_id":"b1","plan":{{"z":1}},"reset_in_progress":null,'
        f'"saved_at":{NOW},"status":{{}},"version":1}}'
    ).encode()
