"""The ended-job hand-over files in ``state_dir`` (gpuwatchd/pause.py): an epilog's
``run --once --ended-job`` beside a running daemon. Read by the daemon and every scan;
hostile until validated."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuwatchd.pause import (
    ENDED_JOB_PREFIX,
    MAX_ENDED_JOBS,
    hand_over_ended_jobs,
    read_ended_jobs,
)

NOW = 1_800_000_000.0


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(ENDED_JOB_PREFIX))


def test_a_hand_over_is_read_until_it_expires_and_then_removed_by_the_daemon(
    tmp_path: Path,
) -> None:
    hand_over_ended_jobs(str(tmp_path), ["slurm:42", "pod:abc-1"], until=NOW + 60)
    assert len(files(tmp_path)) == 2
    jobs, problems = read_ended_jobs(str(tmp_path), NOW)
    assert set(jobs) == {"slurm:42", "pod:abc-1"}
    assert problems == []
    # A scan only reads; the daemon removes what expired.
    assert not read_ended_jobs(str(tmp_path), NOW + 61)[0]
    assert len(files(tmp_path)) == 2
    assert not read_ended_jobs(str(tmp_path), NOW + 61, remove_stale=True)[0]
    assert files(tmp_path) == []


def test_two_epilogs_never_overwrite_each_other_and_a_second_hand_over_extends(
    tmp_path: Path,
) -> None:
    hand_over_ended_jobs(str(tmp_path), ["slurm:1"], until=NOW + 10)
    hand_over_ended_jobs(str(tmp_path), ["slurm:2"], until=NOW + 10)
    hand_over_ended_jobs(str(tmp_path), ["slurm:1"], until=NOW + 100)
    assert set(read_ended_jobs(str(tmp_path), NOW + 50)[0]) == {"slurm:1"}
    assert set(read_ended_jobs(str(tmp_path), NOW)[0]) == {"slurm:1", "slurm:2"}


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
    tmp_path: Path, body: bytes, why: str
) -> None:
    hand_over_ended_jobs(str(tmp_path), ["slurm:7"], until=NOW + 5)
    (name,) = files(tmp_path)
    (tmp_path / name).write_bytes(body)
    jobs, problems = read_ended_jobs(str(tmp_path), NOW, remove_stale=True)
    assert not jobs
    assert len(problems) == 1
    assert problems[0].startswith(name)
    assert why in problems[0]
    assert files(tmp_path) == []


def test_a_link_or_a_folder_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps({"job": "slurm:9", "until": NOW + 5}))
    os.symlink(secret, tmp_path / f"{ENDED_JOB_PREFIX}link")
    (tmp_path / f"{ENDED_JOB_PREFIX}dir").mkdir()
    jobs, problems = read_ended_jobs(str(tmp_path), NOW)
    assert not jobs
    assert len(problems) == 2


def test_at_most_so_many_jobs_are_honoured(tmp_path: Path) -> None:
    jobs = [f"slurm:{i}" for i in range(MAX_ENDED_JOBS + 10)]
    for job in jobs:  # one epilog each
        hand_over_ended_jobs(str(tmp_path), [job], until=NOW + 5)
    assert len(read_ended_jobs(str(tmp_path), NOW)[0]) == MAX_ENDED_JOBS


def test_no_state_folder_is_no_hand_over(tmp_path: Path) -> None:
    assert read_ended_jobs(str(tmp_path / "missing"), NOW) == ({}, [])


def test_a_hand_over_says_when_and_in_which_boot_it_was_said(tmp_path: Path) -> None:
    """The word covers only processes older than it (assess), so it carries its time in
    boot ticks; a word from another boot, or one without a time, covers nothing (None)."""
    hand_over_ended_jobs(str(tmp_path), ["slurm:42"], until=NOW + 5, said_at=777, boot_id="b1")
    hand_over_ended_jobs(str(tmp_path), ["slurm:43"], until=NOW + 5)  # an older writer's file
    assert read_ended_jobs(str(tmp_path), NOW, boot_id="b1")[0] == {
        "slurm:42": 777,
        "slurm:43": None,
    }
    assert read_ended_jobs(str(tmp_path), NOW, boot_id="b2")[0]["slurm:42"] is None
