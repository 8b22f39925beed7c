"""The ended-job hand-over files in ``state_dir`` (gpuwatchd/state/pause.py): an epilog's
``run --once --ended-job`` beside a running daemon. Read by the daemon and every scan;
hostile until validated."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.config.schema import default_policy
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.daemon.lifecycle import Daemon
from gpuwatchd.state.directory import AlreadyRunning, StateDir
from gpuwatchd.state.pause import (
    ENDED_JOB_PREFIX,
    MAX_ENDED_JOBS,
    HandOvers,
    hand_over_ended_jobs,
    read_ended_jobs,
    withdraw_ended_jobs,
)
from tests.support.fakeproc import FakeProc, format_stat

NOW = 1_800_000_000.0
EPILOG = (4242, 987654)  # the waiting epilog: PID and start ticks
LATER = (4242, 999999)  # another process that got the same PID later


def waiting(pid: int, ticks: int) -> bool:
    """The epilog :data:`EPILOG` still waits; nothing else runs."""
    return (pid, ticks) == EPILOG


def hand_over(
    state: StateDir,
    jobs: list[str],
    until: float,
    waiter: tuple[int, int] = EPILOG,
    *,
    said_at: int | None = None,
    boot_id: str | None = None,
) -> None:
    """Handed over at :data:`NOW` until wall time ``until`` (the boot clock unknown: ``at``)."""
    clock = at(NOW, boot_id)
    hand_over_ended_jobs(
        state, jobs, clock=clock, seconds=until - NOW, waiter=waiter, said_at=said_at
    )


def at(now: float, boot_id: str | None = None) -> BootTime:
    """Wall time ``now`` in boot ``boot_id``, the boot clock unknown (the wall time counts)."""
    return BootTime(now, None, boot_id)


def read(
    state: StateDir, now: float, *, remove_stale: bool = False, boot_id: str | None = None
) -> HandOvers:
    return read_ended_jobs(state, at(now, boot_id), waiting=waiting, remove_stale=remove_stale)


@pytest.fixture
def state(tmp_path: Path) -> Iterator[StateDir]:
    with StateDir.open(str(tmp_path)) as directory:
        yield directory


def _own_start_ticks() -> int:
    """This process's start time in clock ticks (/proc/self/stat, field 22)."""
    stat = Path("/proc/self/stat").read_text()
    return int(stat.rpartition(")")[2].split()[19])


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(ENDED_JOB_PREFIX))


def test_a_hand_over_is_read_until_it_expires_and_then_removed_by_the_daemon(
    tmp_path: Path, state: StateDir
) -> None:
    hand_over(state, ["slurm:42", "pod:abc-1"], NOW + 60)
    assert len(files(tmp_path)) == 2
    found = read(state, NOW)
    assert found == HandOvers({"slurm:42": None, "pod:abc-1": None}, (), 0)
    # A scan only reads; the daemon removes what expired.
    assert not read(state, NOW + 61).jobs
    assert len(files(tmp_path)) == 2
    assert not read(state, NOW + 61, remove_stale=True).jobs
    assert files(tmp_path) == []


def test_two_epilogs_never_overwrite_each_other_and_a_second_hand_over_extends(
    tmp_path: Path, state: StateDir
) -> None:
    hand_over(state, ["slurm:1"], NOW + 10)
    hand_over(state, ["slurm:2"], NOW + 10)
    hand_over(state, ["slurm:1"], NOW + 100)
    assert set(read(state, NOW + 50).jobs) == {"slurm:1"}
    assert set(read(state, NOW).jobs) == {"slurm:1", "slurm:2"}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"not json", "Expecting value"),
        (b"[1, 2]", ""),
        (json.dumps({"job": "slurm:4x2", "until": NOW + 5}).encode(), "not a valid slurm id"),
        (json.dumps({"job": "gpu:0", "until": NOW + 5}).encode(), "expected KIND:ID"),
        (json.dumps({"job": "slurm:7", "until": "soon"}).encode(), "no expiry"),
        (json.dumps({"job": "slurm:7", "until": True}).encode(), "no expiry"),
        (b'{"job": "slurm:7", "until": NaN}', "no expiry"),
        (b'{"job": "slurm:7", "until": -Infinity}', "no expiry"),
        (json.dumps({"job": "slurm:7", "until": NOW + 7 * 86400}).encode(), "a day ahead"),
        (
            json.dumps({"job": "slurm:8", "until": NOW + 5, "waiter": list(EPILOG)}).encode(),
            "does not match",
        ),
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
    tmp_path: Path, state: StateDir, body: bytes, why: str
) -> None:
    hand_over(state, ["slurm:7"], NOW + 5)
    (name,) = files(tmp_path)
    (tmp_path / name).write_bytes(body)
    found = read(state, NOW, remove_stale=True)
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
    found = read(state, NOW)
    assert not found.jobs
    assert len(found.problems) == 2


def test_over_the_limit_valid_hand_overs_wait_and_are_never_removed(
    tmp_path: Path, state: StateDir
) -> None:
    """A 65th epilog's hand-over is not honoured at once, but it is not deleted either: it
    waits (counted) until others expire; only expired or bad files are ever removed."""
    jobs = [f"slurm:{i}" for i in range(MAX_ENDED_JOBS + 10)]
    for job in jobs:  # one epilog each
        hand_over(state, [job], NOW + 5)
    found = read(state, NOW, remove_stale=True)
    assert len(found.jobs) == MAX_ENDED_JOBS
    assert found.over_limit == 10
    assert len(files(tmp_path)) == MAX_ENDED_JOBS + 10, "no valid hand-over is dropped"
    honoured = found.jobs
    for job in sorted(honoured)[:10]:  # ten of the honoured ones expire
        hand_over(state, [job], NOW + 1)
    later = read(state, NOW + 2, remove_stale=True)
    assert later.over_limit == 0
    assert set(later.jobs) == set(jobs) - set(sorted(honoured)[:10])


def test_the_daemon_reports_waiting_hand_overs_when_their_number_changes(
    tmp_path: Path, state: StateDir
) -> None:
    me = (os.getpid(), _own_start_ticks())  # the daemon asks whether the waiter still runs
    for i in range(MAX_ENDED_JOBS + 3):
        hand_over(state, [f"slurm:{i}"], NOW + 60, waiter=me)
    policy = dataclasses.replace(default_policy(), state_dir=str(tmp_path), dry_run=True)
    daemon = Daemon(policy, config_path="/nonexistent/gpuwatchd.yaml", wall_clock=lambda: NOW)
    with capture_logs() as logs:
        daemon._take_ended_jobs()
        daemon._take_ended_jobs()
    over = [e for e in logs if e["event"] == EventName.SCHEDULER_ENDED_JOBS_OVER_LIMIT]
    assert [(e["waiting"], e["honoured"], e["log_level"]) for e in over] == [
        (3, MAX_ENDED_JOBS, "warning")
    ]
    assert len(files(tmp_path)) == MAX_ENDED_JOBS + 3
    daemon.store.close()


def test_more_than_the_limit_at_once_is_refused_not_cut(state: StateDir) -> None:
    with pytest.raises(ValueError, match="at most"):
        hand_over(state, [f"slurm:{i}" for i in range(MAX_ENDED_JOBS + 1)], NOW)


def test_a_hand_over_says_when_and_in_which_boot_it_was_said(state: StateDir) -> None:
    """The word covers only processes older than it (assess), so it carries its time in
    boot ticks; a word from another boot, or one without a time, covers nothing (None)."""
    hand_over(state, ["slurm:42"], NOW + 5, said_at=777, boot_id="b1")
    hand_over(state, ["slurm:43"], NOW + 5)  # an older writer's file
    assert read(state, NOW, boot_id="b1").jobs == {"slurm:42": 777, "slurm:43": None}
    assert read(state, NOW, boot_id="b2").jobs["slurm:42"] is None
    assert read(state, NOW).jobs["slurm:42"] is None  # this boot unknown


def test_a_hand_over_counts_only_while_its_epilog_waits_and_never_for_a_later_run(
    tmp_path: Path, state: StateDir
) -> None:
    """Job 42's epilog handed over and its wait ended without withdrawing (killed): a later
    run — job 43's epilog, or job 42 requeued under the same id — must not take it."""
    hand_over(state, ["slurm:42"], NOW + 600)
    assert set(read(state, NOW).jobs) == {"slurm:42"}
    gone = read_ended_jobs(state, at(NOW), waiting=lambda pid, ticks: False)
    assert gone == HandOvers({}, (), 0)  # not a problem, not waiting over the limit: only over
    assert len(files(tmp_path)) == 1  # a scan changes nothing
    reused = read_ended_jobs(state, at(NOW), waiting=lambda p, t: (p, t) == LATER)
    assert not reused.jobs  # the PID alone is not the epilog
    read_ended_jobs(state, at(NOW), waiting=lambda pid, ticks: False, remove_stale=True)
    assert files(tmp_path) == []  # the daemon removes it


def test_a_hand_over_whose_epilog_cannot_be_read_is_kept_but_not_honoured(
    tmp_path: Path, state: StateDir
) -> None:
    """The daemon's check (``ProcFS.is_running``) on an epilog whose ``/proc/PID/stat`` cannot
    be read (EISDIR here; EIO, EMFILE): unknown is neither "waits" (the word covers nothing
    while its epilog is unknown) nor "gone" (the file of a live epilog was removed for good, so
    the epilog waited in vain); known again, it counts."""
    proc = FakeProc(tmp_path / "proc")
    (proc.root / str(EPILOG[0]) / "stat").mkdir(parents=True)
    procfs = ProcFS(str(proc.root))
    assert procfs.is_running(*EPILOG) is None
    hand_over(state, ["slurm:42"], NOW + 600)
    unknown = read_ended_jobs(state, at(NOW), waiting=procfs.is_running, remove_stale=True)
    assert unknown == HandOvers({}, (), 0)
    assert len(files(tmp_path)) == 1  # kept
    (proc.root / str(EPILOG[0]) / "stat").rmdir()
    proc.write(f"{EPILOG[0]}/stat", format_stat(EPILOG[0], "gpuwatchd", starttime=EPILOG[1]))
    known = read_ended_jobs(state, at(NOW), waiting=procfs.is_running, remove_stale=True)
    assert set(known.jobs) == {"slurm:42"}


def test_the_epilog_withdraws_its_own_hand_over_and_only_its_own(
    tmp_path: Path, state: StateDir
) -> None:
    hand_over(state, ["slurm:42", "slurm:43"], NOW + 600)
    hand_over(state, ["slurm:43"], NOW + 600, waiter=LATER)  # a second epilog's
    withdraw_ended_jobs(state, ["slurm:42", "slurm:43"], waiter=EPILOG)
    assert len(files(tmp_path)) == 1
    found = read_ended_jobs(state, at(NOW), waiting=lambda p, t: (p, t) == LATER)
    assert found == HandOvers({"slurm:43": None}, (), 0)


def test_two_epilogs_of_one_job_keep_their_own_hand_overs_and_the_later_word_covers_more(
    tmp_path: Path, state: StateDir
) -> None:
    """The same job key twice (a requeued run's epilog beside the first's, or an admin's run
    --once): neither overwrites nor withdraws the other's; an older version's file (the job's
    name only) still counts while its epilog waits."""
    both = {EPILOG, LATER}
    hand_over(state, ["slurm:43"], NOW + 600, said_at=5_000, boot_id="b1")
    hand_over(state, ["slurm:43"], NOW + 600, waiter=LATER, said_at=6_000, boot_id="b1")
    found = read_ended_jobs(state, at(NOW, "b1"), waiting=lambda p, t: (p, t) in both)
    assert found == HandOvers({"slurm:43": 6_000}, (), 0)
    withdraw_ended_jobs(state, ["slurm:43"], waiter=LATER)  # the later epilog is done first
    found = read_ended_jobs(state, at(NOW, "b1"), waiting=waiting, remove_stale=True)
    assert found == HandOvers({"slurm:43": 5_000}, (), 0)
    withdraw_ended_jobs(state, ["slurm:43"], waiter=EPILOG)
    assert files(tmp_path) == []
    old = ENDED_JOB_PREFIX + hashlib.sha256(b"slurm:44").hexdigest()[:32]
    body = {"job": "slurm:44", "until": NOW + 600, "waiter": list(EPILOG)}
    (tmp_path / old).write_text(json.dumps(body) + "\n")
    assert read(state, NOW, remove_stale=True).jobs == {"slurm:44": None}


def test_a_waiting_epilogs_word_still_covers_only_processes_older_than_it(
    state: StateDir,
) -> None:
    """Both rules at once: the waiter decides whether the hand-over counts at all, its said
    time (in this boot) which processes it covers."""
    hand_over(state, ["slurm:42"], NOW + 600, said_at=5_000, boot_id="b1")
    assert read(state, NOW, boot_id="b1").jobs == {"slurm:42": 5_000}
    assert read_ended_jobs(state, at(NOW, "b1"), waiting=lambda p, t: False).jobs == {}


def test_run_once_going_on_alone_keeps_when_the_scheduler_said_it(
    tmp_path: Path, state: StateDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run --once --ended-job`` beside an instance that stops mid-wait takes the lock and
    goes on alone: its word still dates from when the epilog heard it (covering only processes
    older than that), never from the moment it took over; its hand-over named it as the waiter
    and is withdrawn when it is done."""
    from gpuwatchd.cli import run as run_module

    policy = dataclasses.replace(default_policy(), state_dir=str(tmp_path), dry_run=True)
    refused = Daemon(
        policy,
        config_path="/nonexistent/gpuwatchd.yaml",
        once=True,
        ended_jobs=frozenset({"slurm:42"}),
        ended_jobs_said={"slurm:42": 777},
    )
    seen: dict[str, object] = {}

    def stopped_meanwhile(policy: object, timeout: float) -> None:
        found = read_ended_jobs(
            state,
            BootTime.read(time.time(), refused.procfs.boot_id()),
            waiting=lambda p, t: p == os.getpid(),
        )
        seen["handed"] = dict(found.jobs)

    def successor_run(self: Daemon) -> int:
        seen["successor"] = dict(self.own_ended_jobs)
        return 0

    monkeypatch.setattr(run_module, "wait_for_daemon", stopped_meanwhile)
    monkeypatch.setattr(Daemon, "run", successor_run)
    daemon_for = functools.partial(  # as run_daemon makes it
        Daemon,
        policy,
        config_path="/nonexistent/gpuwatchd.yaml",
        dry_run=True,
        once=True,
        ended_jobs=frozenset({"slurm:42"}),
    )
    code = run_module._once_beside_the_daemon(
        refused,
        daemon_for,
        once_timeout=30.0,
        ended_jobs=frozenset({"slurm:42"}),
    )
    assert code == 0
    assert seen == {"handed": {"slurm:42": 777}, "successor": {"slurm:42": 777}}
    assert files(tmp_path) == []  # withdrawn
    refused.store.close()


def test_a_run_once_refused_the_lock_leaves_no_pipe_open(tmp_path: Path, state: StateDir) -> None:
    """``run --once`` makes a successor each time the instance it waits on stops, and another
    may take the lock first: each refused instance left its wake-up and command pipes open (4
    fds), so a long wait beside epilogs taking turns ran out of file descriptors."""
    policy = dataclasses.replace(default_policy(), state_dir=str(tmp_path), dry_run=True)
    with state.lock():
        before = sorted(os.listdir("/proc/self/fd"))
        for _ in range(3):
            refused = Daemon(policy, config_path="/nonexistent/gpuwatchd.yaml", once=True)
            with pytest.raises(AlreadyRunning):
                refused.run()
        assert sorted(os.listdir("/proc/self/fd")) == before


def test_the_hand_over_of_an_epilog_waiting_more_than_a_day_is_honoured(
    state: StateDir, capsys: pytest.CaptureFixture[str]
) -> None:
    """``run --once --timeout 2d`` beside the daemon wrote an expiry past what a reader takes
    (a day ahead): the daemon named the file bad and removed it, though the epilog had said
    "handed to the running daemon". Its expiry is at most a day ahead now."""
    from types import SimpleNamespace

    from gpuwatchd.cli.run import _hand_over

    refused: Any = SimpleNamespace(
        own_ended_jobs={"slurm:7": None},
        store=SimpleNamespace(directory=lambda: state),
        procfs=SimpleNamespace(boot_id=lambda: "b1"),
    )
    assert _hand_over(refused, frozenset({"slurm:7"}), EPILOG, 2 * 86400.0) is state
    assert "handed to the running daemon: slurm:7 ended" in capsys.readouterr().err
    found = read(state, time.time(), remove_stale=True)
    assert (found.jobs, found.problems) == ({"slurm:7": None}, ())


@pytest.mark.parametrize("step", [3600.0, -2 * 86400.0])
def test_a_wall_clock_step_neither_ends_nor_refuses_a_waiting_epilogs_hand_over(
    tmp_path: Path, state: StateDir, capsys: pytest.CaptureFixture[str], step: float
) -> None:
    """The expiry was a wall time: a clock stepped forward past it (NTP at a node's start) made
    the daemon drop the hand-over of an epilog still waiting, one stepped back a day named it
    "more than a day ahead" and removed it; it lasts on the boot clock, as a pause does."""
    from types import SimpleNamespace

    from gpuwatchd.cli.run import _hand_over

    me = (os.getpid(), _own_start_ticks())  # the daemon asks whether the waiter still runs
    policy = dataclasses.replace(default_policy(), state_dir=str(tmp_path), dry_run=True)
    daemon = Daemon(
        policy, config_path="/nonexistent/gpuwatchd.yaml", wall_clock=lambda: time.time() + step
    )
    refused: Any = SimpleNamespace(
        own_ended_jobs={"slurm:7": None}, store=daemon.store, procfs=daemon.procfs
    )
    assert _hand_over(refused, frozenset({"slurm:7"}), me, 120.0) is not None
    with capture_logs() as logs:
        daemon._take_ended_jobs()
    assert [e.get("job") for e in logs] == ["slurm:7"]
    assert "slurm:7" in daemon.collector.ended_by_scheduler
    assert len(files(tmp_path)) == 1
    daemon.store.close()


def test_a_hand_over_ends_on_the_boot_clock_in_its_boot_and_on_the_wall_clock_in_another(
    state: StateDir,
) -> None:
    stamped = BootTime(NOW, 100.0, "b1")
    hand_over_ended_jobs(state, ["slurm:42"], clock=stamped, seconds=60, waiter=EPILOG)
    for wall, boot, honoured in [
        (NOW + 3600, 150.0, True),  # stepped forward: 10 s left on the boot clock
        (NOW - 2 * 86400, 150.0, True),  # stepped back two days: never "a day ahead"
        (NOW - 3600, 161.0, False),  # its time is up, whatever the wall clock says
    ]:
        found = read_ended_jobs(state, BootTime(wall, boot, "b1"), waiting=waiting)
        assert (set(found.jobs) == {"slurm:42"}) is honoured
    assert set(read_ended_jobs(state, BootTime(NOW + 59, 5.0, "b2"), waiting=waiting).jobs) == {
        "slurm:42"
    }  # another boot's: its wall time
    assert not read_ended_jobs(state, BootTime(NOW + 61, 5.0, "b2"), waiting=waiting).jobs
