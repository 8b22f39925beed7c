"""The ended-job hand-over files in ``state_dir`` (gpuwatchd/pause.py): an epilog's
``run --once --ended-job`` beside a running daemon. Read by the daemon and every scan;
hostile until validated; honoured only while the epilog that wrote it waits."""

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
    withdraw_ended_jobs,
)

NOW = 1_800_000_000.0
EPILOG = (4242, 987654)  # the waiting epilog: PID and start ticks
LATER = (4242, 999999)  # another process that got the same PID later


def waiting(pid: int, ticks: int) -> bool:
    """The epilog :data:`EPILOG` still waits; nothing else runs."""
    return (pid, ticks) == EPILOG


def hand_over(d: Path, jobs: list[str], until: float, waiter: tuple[int, int] = EPILOG) -> None:
    hand_over_ended_jobs(str(d), jobs, until=until, waiter=waiter)


def read(d: Path, now: float, *, remove_stale: bool = False) -> tuple[frozenset[str], list[str]]:
    return read_ended_jobs(str(d), now, waiting=waiting, remove_stale=remove_stale)


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(ENDED_JOB_PREFIX))


def test_a_hand_over_is_read_until_it_expires_and_then_removed_by_the_daemon(
    tmp_path: Path,
) -> None:
    hand_over(tmp_path, ["slurm:42", "pod:abc-1"], until=NOW + 60)
    assert len(files(tmp_path)) == 2
    jobs, problems = read(tmp_path, NOW)
    assert jobs == {"slurm:42", "pod:abc-1"}
    assert problems == []
    # A scan only reads; the daemon removes what expired.
    assert read(tmp_path, NOW + 61)[0] == frozenset()
    assert len(files(tmp_path)) == 2
    assert read(tmp_path, NOW + 61, remove_stale=True)[0] == frozenset()
    assert files(tmp_path) == []


def test_two_epilogs_never_overwrite_each_other_and_a_second_hand_over_extends(
    tmp_path: Path,
) -> None:
    hand_over(tmp_path, ["slurm:1"], until=NOW + 10)
    hand_over(tmp_path, ["slurm:2"], until=NOW + 10)
    hand_over(tmp_path, ["slurm:1"], until=NOW + 100)
    assert read(tmp_path, NOW + 50)[0] == {"slurm:1"}
    assert read(tmp_path, NOW)[0] == {"slurm:1", "slurm:2"}


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
        (json.dumps({"job": "slurm:7", "until": NOW + 5}).encode(), "no waiting process"),
        (
            json.dumps({"job": "slurm:7", "until": NOW + 5, "waiter": [0, 1]}).encode(),
            "no waiting process",
        ),
        (
            json.dumps({"job": "slurm:7", "until": NOW + 5, "waiter": [1, True]}).encode(),
            "no waiting process",
        ),
    ],
)
def test_a_bad_hand_over_is_ignored_named_and_removed(
    tmp_path: Path, body: bytes, why: str
) -> None:
    hand_over(tmp_path, ["slurm:7"], until=NOW + 5)
    (name,) = files(tmp_path)
    (tmp_path / name).write_bytes(body)
    jobs, problems = read(tmp_path, NOW, remove_stale=True)
    assert jobs == frozenset()
    assert len(problems) == 1
    assert problems[0].startswith(name)
    assert why in problems[0]
    assert files(tmp_path) == []


def test_a_link_or_a_folder_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps({"job": "slurm:9", "until": NOW + 5}))
    os.symlink(secret, tmp_path / f"{ENDED_JOB_PREFIX}link")
    (tmp_path / f"{ENDED_JOB_PREFIX}dir").mkdir()
    jobs, problems = read(tmp_path, NOW)
    assert jobs == frozenset()
    assert len(problems) == 2


def test_at_most_so_many_jobs_are_honoured(tmp_path: Path) -> None:
    jobs = [f"slurm:{i}" for i in range(MAX_ENDED_JOBS + 10)]
    for job in jobs:  # one epilog each
        hand_over(tmp_path, [job], until=NOW + 5)
    assert len(read(tmp_path, NOW)[0]) == MAX_ENDED_JOBS


def test_no_state_folder_is_no_hand_over(tmp_path: Path) -> None:
    assert read(tmp_path / "missing", NOW) == (frozenset(), [])


def test_a_hand_over_counts_only_while_its_epilog_waits_and_never_for_a_later_run(
    tmp_path: Path,
) -> None:
    """Job 42's epilog handed over and its wait ended without withdrawing (killed): a later
    run — job 43's epilog, or job 42 requeued under the same id — must not take it."""
    hand_over(tmp_path, ["slurm:42"], until=NOW + 600)
    assert read(tmp_path, NOW)[0] == {"slurm:42"}
    gone = read_ended_jobs(str(tmp_path), NOW, waiting=lambda pid, ticks: False)
    assert gone == (frozenset(), [])  # not a problem: only over
    assert len(files(tmp_path)) == 1  # a scan changes nothing
    reused = read_ended_jobs(str(tmp_path), NOW, waiting=lambda p, t: (p, t) == LATER)
    assert reused[0] == frozenset()  # the PID alone is not the epilog
    read_ended_jobs(str(tmp_path), NOW, waiting=lambda pid, ticks: False, remove_stale=True)
    assert files(tmp_path) == []  # the daemon removes it


def test_the_epilog_withdraws_its_own_hand_over_and_only_its_own(tmp_path: Path) -> None:
    hand_over(tmp_path, ["slurm:42", "slurm:43"], until=NOW + 600)
    hand_over(tmp_path, ["slurm:43"], until=NOW + 600, waiter=LATER)  # a second epilog's
    withdraw_ended_jobs(str(tmp_path), ["slurm:42", "slurm:43"], waiter=EPILOG)
    assert len(files(tmp_path)) == 1
    found = read_ended_jobs(str(tmp_path), NOW, waiting=lambda p, t: (p, t) == LATER)
    assert found == (frozenset({"slurm:43"}), [])
