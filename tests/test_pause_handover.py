"""The ended-job hand-over files in ``state_dir`` (gpuwatchd/pause.py): an epilog's
``run --once --ended-job`` beside a running daemon. Read by the daemon and every scan;
hostile until validated."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gpuwatchd.config.schema import default_policy
from gpuwatchd.daemon import Daemon
from gpuwatchd.pause import (
    ENDED_JOB_PREFIX,
    MAX_ENDED_JOBS,
    HandOvers,
    hand_over_ended_jobs,
    read_ended_jobs,
)
from gpuwatchd.statedir import StateDir

NOW = 1_800_000_000.0


@pytest.fixture
def state(tmp_path: Path) -> Iterator[StateDir]:
    with StateDir.open(str(tmp_path)) as directory:
        yield directory


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(ENDED_JOB_PREFIX))


def test_a_hand_over_is_read_until_it_expires_and_then_removed_by_the_daemon(
    tmp_path: Path, state: StateDir
) -> None:
    hand_over_ended_jobs(state, ["slurm:42", "pod:abc-1"], until=NOW + 60)
    assert len(files(tmp_path)) == 2
    found = read_ended_jobs(state, NOW)
    assert found == HandOvers({"slurm:42": None, "pod:abc-1": None}, (), 0)
    # A scan only reads; the daemon removes what expired.
    assert not read_ended_jobs(state, NOW + 61).jobs
    assert len(files(tmp_path)) == 2
    assert not read_ended_jobs(state, NOW + 61, remove_stale=True).jobs
    assert files(tmp_path) == []


def test_two_epilogs_never_overwrite_each_other_and_a_second_hand_over_extends(
    tmp_path: Path, state: StateDir
) -> None:
    hand_over_ended_jobs(state, ["slurm:1"], until=NOW + 10)
    hand_over_ended_jobs(state, ["slurm:2"], until=NOW + 10)
    hand_over_ended_jobs(state, ["slurm:1"], until=NOW + 100)
    assert set(read_ended_jobs(state, NOW + 50).jobs) == {"slurm:1"}
    assert set(read_ended_jobs(state, NOW).jobs) == {"slurm:1", "slurm:2"}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"not json", "Expecting value"),
        (b"[1, 2]", ""),
        (json.dumps({"job": "slurm:4x2", "until": NOW + 5}).encode(), "not a valid slurm id"),
        (json.dumps({"job": "gpu:0", "until": NOW + 5}).encode(), "expected KIND:ID"),
        (json.dumps({"job": "slurm:7", "until": "soon"}).encode(), "no expiry"),
        (json.dumps({"job": "slurm:7", "until": True}).encode(), "no expiry"),
        (json.dumps({"job": "slurm:7", "until": NOW + 7 * 86400}).encode(), "a day ahead"),
        (json.dumps({"job": "slurm:8", "until": NOW + 5}).encode(), "does not match"),
    ],
)
def test_a_bad_hand_over_is_ignored_named_and_removed(
    tmp_path: Path, state: StateDir, body: bytes, why: str
) -> None:
    hand_over_ended_jobs(state, ["slurm:7"], until=NOW + 5)
    (name,) = files(tmp_path)
    (tmp_path / name).write_bytes(body)
    found = read_ended_jobs(state, NOW, remove_stale=True)
    assert not found.jobs
    assert len(found.problems) == 1
    assert found.problems[0].startswith(name)
    assert why in found.problems[0]
    assert files(tmp_path) == []


def test_a_link_or_a_folder_is_not_followed(tmp_path: Path, state: StateDir) -> None:
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps({"job": "slurm:9", "until": NOW + 5}))
    os.symlink(secret, tmp_path / f"{ENDED_JOB_PREFIX}link")
    (tmp_path / f"{ENDED_JOB_PREFIX}dir").mkdir()
    found = read_ended_jobs(state, NOW)
    assert not found.jobs
    assert len(found.problems) == 2


def test_over_the_limit_valid_hand_overs_wait_and_are_never_removed(
    tmp_path: Path, state: StateDir
) -> None:
    """A 65th epilog's hand-over is not honoured at once, but it is not deleted either: it
    waits (counted) until others expire; only expired or bad files are ever removed."""
    jobs = [f"slurm:{i}" for i in range(MAX_ENDED_JOBS + 10)]
    for job in jobs:  # one epilog each
        hand_over_ended_jobs(state, [job], until=NOW + 5)
    found = read_ended_jobs(state, NOW, remove_stale=True)
    assert len(found.jobs) == MAX_ENDED_JOBS
    assert found.over_limit == 10
    assert len(files(tmp_path)) == MAX_ENDED_JOBS + 10, "no valid hand-over is dropped"
    honoured = found.jobs
    for job in sorted(honoured)[:10]:  # ten of the honoured ones expire
        hand_over_ended_jobs(state, [job], until=NOW + 1)
    later = read_ended_jobs(state, NOW + 2, remove_stale=True)
    assert later.over_limit == 0
    assert set(later.jobs) == set(jobs) - set(sorted(honoured)[:10])


def test_the_daemon_reports_waiting_hand_overs_when_their_number_changes(
    tmp_path: Path, state: StateDir
) -> None:
    for i in range(MAX_ENDED_JOBS + 3):
        hand_over_ended_jobs(state, [f"slurm:{i}"], until=NOW + 60)
    policy = dataclasses.replace(default_policy(), state_dir=str(tmp_path), dry_run=True)
    daemon = Daemon(policy, config_path="/nonexistent/gpuwatchd.yaml", wall_clock=lambda: NOW)
    with capture_logs() as logs:
        daemon._take_ended_jobs()
        daemon._take_ended_jobs()
    over = [e for e in logs if e["event"] == "scheduler.ended_jobs_over_limit"]
    assert [(e["waiting"], e["honoured"], e["log_level"]) for e in over] == [
        (3, MAX_ENDED_JOBS, "warning")
    ]
    assert len(files(tmp_path)) == MAX_ENDED_JOBS + 3
    daemon.store.close()


def test_more_than_the_limit_at_once_is_refused_not_cut(state: StateDir) -> None:
    with pytest.raises(ValueError, match="at most"):
        hand_over_ended_jobs(state, [f"slurm:{i}" for i in range(MAX_ENDED_JOBS + 1)], until=NOW)


def test_a_hand_over_says_when_and_in_which_boot_it_was_said(state: StateDir) -> None:
    """The word covers only processes older than it (assess), so it carries its time in
    boot ticks; a word from another boot, or one without a time, covers nothing (None)."""
    hand_over_ended_jobs(state, ["slurm:42"], until=NOW + 5, said_at=777, boot_id="b1")
    hand_over_ended_jobs(state, ["slurm:43"], until=NOW + 5)  # an older writer's file
    assert read_ended_jobs(state, NOW, boot_id="b1").jobs == {"slurm:42": 777, "slurm:43": None}
    assert read_ended_jobs(state, NOW, boot_id="b2").jobs["slurm:42"] is None
    assert read_ended_jobs(state, NOW).jobs["slurm:42"] is None  # this boot unknown
