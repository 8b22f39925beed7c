"""The administrator's timed switches of a rollout week: ``pause --for`` that ends by itself,
``resume --reason``, ``spare PID|job:ID`` honoured by every signal decision and ended by
itself, and NVML's availability as a state whose return is an event."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from gpuwatchd.cli.main import main
from gpuwatchd.cli.status import describe
from gpuwatchd.cli.status_text import render_text
from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.collect.procfs import PROC_PID_INIT_INO
from gpuwatchd.config.schema import default_policy
from gpuwatchd.core.checked import MAX_REASON
from gpuwatchd.core.model import CgroupInfo, NvmlReading, ProcessInfo, Spare
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.daemon.lifecycle import Daemon
from gpuwatchd.decide.nvml_state import NvmlAvailability, next_availability
from gpuwatchd.decide.plan.decisions import plan, set_paused
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.spares import spare_changes, spare_reason
from gpuwatchd.decide.targets import refusal
from gpuwatchd.state import pause
from gpuwatchd.state.directory import StateDir
from gpuwatchd.state.pause import PAUSE_FILE, RESUMED_FILE, note_resume, poll_pause, set_pause
from gpuwatchd.state.spares import MAX_SPARES, cancel_spare, parse_target, read_spares, write_spare
from tests.support.fakeproc import FakeProc
from tests.support.plancases import orphan, policy, proc, signals, snap
from tests.support.statusrig import with_document

NOW = 1_800_000_000.0
OTHER_NS = 4026532999  # a PID namespace not the host's
DAY = 86400.0


@pytest.fixture
def state(tmp_path: Path) -> Iterator[StateDir]:
    with StateDir.open(str(tmp_path)) as directory:
        yield directory


# --- pause --for ------------------------------------------------------------------------------


def test_a_timed_pause_holds_until_its_end_then_is_removed_and_said_to_have_ended(
    state: StateDir, tmp_path: Path
) -> None:
    set_pause(state, reason="driver upgrade", clock=BootTime(NOW, 1000.0, "b1"), seconds=3600)
    # The rule read only (scan's): in force until its end, the file left for the daemon.
    held = pause.pause_in_force(state, BootTime(NOW + 3599, 4599.0, "b1"), max_pause=DAY)
    assert (held.reason, held.until) == ("driver upgrade", NOW + 3600)
    over = pause.pause_in_force(state, BootTime(NOW + 3600, 4600.0, "b1"), max_pause=DAY)
    assert over.reason is None
    assert (tmp_path / PAUSE_FILE).exists()
    now = poll_pause(state, BootTime(NOW + 3599, 4599.0, "b1"), max_pause=DAY)
    assert (now.reason, now.until, now.resumed) == ("driver upgrade", NOW + 3600, None)
    ended = poll_pause(state, BootTime(NOW + 3600, 4600.0, "b1"), max_pause=DAY)
    assert ended.reason is None
    assert ended.resumed is not None
    assert "ended by itself" in ended.resumed
    assert not (tmp_path / PAUSE_FILE).exists()


def test_a_timed_pause_with_a_long_reason_still_ends_by_itself(state: StateDir) -> None:
    """The reason was written uncut: past the pause file's size bound the file no longer read
    as JSON, so the pause lost its end and held until resumed. It is cut as it is read."""
    reason = "r" * 70_000  # an argument may be 128 KiB
    set_pause(state, reason=reason, clock=BootTime(NOW, 1000.0, "b1"), seconds=60)
    now = poll_pause(state, BootTime(NOW + 59, 1059.0, "b1"), max_pause=DAY)
    assert (now.reason, now.until) == (reason[:MAX_REASON], NOW + 60)
    assert poll_pause(state, BootTime(NOW + 60, 1060.0, "b1"), max_pause=DAY).reason is None


@pytest.mark.parametrize("step", [-600.0, +7200.0], ids=["back", "forward"])
def test_a_wall_clock_step_neither_ends_a_timed_pause_early_nor_stretches_it(
    state: StateDir, step: float
) -> None:
    """Issue 34, finding 2: ``pause --for 1h``, then the clock stepped forward two hours: the
    pause ended at once (stepped back, it lasted the step longer). It lasts its hour on the
    boot clock; its end is shown in the stepped wall time."""
    set_pause(state, reason="swap", clock=BootTime(NOW, 1000.0, "b1"), seconds=3600)
    now = poll_pause(state, BootTime(NOW + 10 + step, 1010.0, "b1"), max_pause=DAY)
    assert (now.reason, now.until) == ("swap", NOW + step + 3600)
    still = poll_pause(state, BootTime(NOW + 3599 + step, 4599.0, "b1"), max_pause=DAY)
    assert still.reason == "swap"
    ended = poll_pause(state, BootTime(NOW + 3600 + step, 4600.0, "b1"), max_pause=DAY)
    assert ended.reason is None


def test_a_pause_without_an_end_lasts_max_pause_from_when_it_was_set(state: StateDir) -> None:
    """A pause file from before pauses had an end (or hand-made) still ends: a forgotten
    pause never disables the node for good."""
    state.write(PAUSE_FILE, json.dumps({"reason": "old", "since": NOW}).encode())
    assert poll_pause(state, BootTime(NOW + 100, 1.0, "b1"), max_pause=3600).until == NOW + 3600
    assert poll_pause(state, BootTime(NOW + 3600, 2.0, "b1"), max_pause=3600).reason is None


@pytest.mark.parametrize(
    "written", ["under a longer limit", "by hand, without a start", "without an end, set ahead"]
)
def test_a_pause_longer_than_max_pause_is_cut_to_it_and_the_cut_written(
    state: StateDir, written: str
) -> None:
    """A pause file saying "until next year" (written before a reload lowered
    ``limits.max_pause``, or by hand) held for a year: as a spare, it is cut to ``max_pause``
    from when it is first read (a lowered limit shortens a pause, never ends it at once); the
    cut is written into the file, so it holds at the next poll and after a restart. One with
    no end, set a year ahead (by hand, or under a clock set back since), held a year too: its
    end, max_pause after its start, moved with every poll and no cut was written."""
    if written == "under a longer limit":
        set_pause(state, reason="r", clock=BootTime(NOW, 1000.0, "b1"), seconds=365 * DAY)
    else:
        key = "until" if written == "by hand, without a start" else "since"
        state.write(PAUSE_FILE, json.dumps({"reason": "r", key: NOW + 365 * DAY}).encode())
    end = NOW + 10 + DAY
    first = BootTime(NOW + 10, 1010.0, "b1")
    assert pause.pause_in_force(state, first, max_pause=DAY).until == end
    assert poll_pause(state, first, max_pause=DAY).until == end
    held = poll_pause(state, BootTime(NOW + 20, 1020.0, "b1"), max_pause=DAY)
    assert (held.reason, held.until) == ("r", end)
    assert json.loads(state.read(PAUSE_FILE, 4096))["until"] == end
    ended = poll_pause(state, BootTime(end, 1000.0 + end - NOW, "b1"), max_pause=DAY)
    assert ended.reason is None


@contextlib.contextmanager
def admin_in_the_daemons_read(
    state: StateDir, nth_read: int, change: Callable[[StateDir], None]
) -> Iterator[None]:
    """Run ``change`` (an admin's command, its own StateDir) right after the daemon's
    ``nth_read`` of a switch file in the ``with`` block, and go on once it is done or waits
    for the daemon's switches' lock; the block's end waits for it."""
    landed, reads, read = threading.Event(), [0], state.read
    threads: list[threading.Thread] = []

    def waiting(seconds: float) -> None:
        landed.set()
        time.sleep(seconds)

    def admin() -> None:
        with StateDir.open(state.path) as own:
            own.sleep = waiting
            change(own)
        landed.set()

    def daemons_read(name: str, limit: int) -> bytes:
        raw = read(name, limit)
        reads[0] += 1
        if reads[0] == nth_read:
            threads.append(threading.Thread(target=admin))
            threads[0].start()  # joined below
            assert landed.wait(10)  # done, or waiting for the daemon
        return raw

    state.read = daemons_read  # type: ignore[method-assign]
    try:
        yield
    finally:
        del state.read
        threads[0].join(10)


@pytest.mark.parametrize(
    "case",
    [("resume", 2, None), ("pause", 1, "new")],
    ids=["resume during a cut", "pause at its end"],
)
def test_an_admins_pause_or_resume_beside_the_daemons_rewrite_is_never_undone(
    state: StateDir, case: tuple[str, int, str | None]
) -> None:
    """The daemon cut a pause (or removed an ended one) by read, compare, write: a resume (or
    a new pause) landing after its last read was undone, though resume said "actions
    resumed". The admin's command lands there (the daemon's ``nth_read`` of the pause file)
    and must wait for the daemon, then win."""
    change, nth_read, left = case
    seconds = 365 * DAY if change == "resume" else 60.0
    set_pause(state, reason="old", clock=BootTime(NOW, 1000.0, "b1"), seconds=seconds)
    reason = None if change == "resume" else "new"
    clock = BootTime(NOW + 60, 1060.0, "b1")
    with admin_in_the_daemons_read(
        state, nth_read, lambda own: set_pause(own, reason=reason, clock=clock, seconds=60)
    ):
        poll_pause(state, clock, max_pause=DAY)
    now = pause.pause_in_force(state, BootTime(NOW + 70, 1070.0, "b1"), max_pause=DAY)
    assert now.reason == left


def test_resume_while_the_switches_lock_stays_taken_changes_nothing_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path}/st\n")
    assert main(["pause", "--config", str(config), "--reason", "x"]) == 0
    monkeypatch.setattr(StateDir, "sleep", staticmethod(lambda seconds: None))
    with StateDir.open(str(tmp_path / "st")) as held, held.switch_lock():
        assert main(["resume", "--config", str(config)]) == 74
    assert "switches.lock" in capsys.readouterr().err
    assert (tmp_path / "st" / PAUSE_FILE).exists()
    assert main(["resume", "--config", str(config)]) == 0


def test_resume_with_a_reason_and_clear_latches_while_the_lock_stays_taken_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 74 says the switch is unchanged: the resume note and the clear-latches request were
    written before the lock was tried, so the daemon's next poll cleared the latches anyway."""
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path}/st\n")
    assert main(["pause", "--config", str(config), "--reason", "x"]) == 0
    monkeypatch.setattr(StateDir, "sleep", staticmethod(lambda seconds: None))
    resume = ["resume", "--config", str(config), "--reason", "done", "--clear-latches"]
    with StateDir.open(str(tmp_path / "st")) as held, held.switch_lock():
        assert main(resume) == 74
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == [PAUSE_FILE, "switches.lock"]


def test_a_pause_file_from_before_the_boot_clock_ends_by_its_wall_end(state: StateDir) -> None:
    state.write(PAUSE_FILE, json.dumps({"reason": "old", "since": NOW, "until": NOW + 60}).encode())
    assert poll_pause(state, BootTime(NOW + 59, 1.0, "b1"), max_pause=DAY).until == NOW + 60
    assert poll_pause(state, BootTime(NOW + 60, 2.0, "b1"), max_pause=DAY).reason is None


def test_an_unreadable_pause_file_stays_paused_without_an_end(
    state: StateDir, tmp_path: Path
) -> None:
    os.mkfifo(tmp_path / PAUSE_FILE)
    now = poll_pause(state, BootTime(NOW + 10 * DAY, 1.0, "b1"), max_pause=DAY)
    assert now.reason == "pause file unreadable"
    assert now.until is None


def test_resume_reason_is_said_once_and_then_consumed(state: StateDir, tmp_path: Path) -> None:
    note_resume(state, "upgrade done")
    clock = BootTime(NOW, 1.0, "b1")
    assert poll_pause(state, clock, max_pause=DAY).resumed == "gpuwatchd resume: upgrade done"
    assert not (tmp_path / RESUMED_FILE).exists()
    assert poll_pause(state, clock, max_pause=DAY).resumed == "gpuwatchd resume"


def test_a_resume_note_left_after_the_daemons_read_of_the_last_is_never_removed_unread(
    state: StateDir,
) -> None:
    """The daemon read the note, then removed the file without the switches' lock: a ``pause``
    and ``resume --reason`` landing in between lost the newer reason, never said."""
    clock = BootTime(NOW, 1.0, "b1")
    note_resume(state, "old")

    def pause_and_resume(own: StateDir) -> None:
        set_pause(own, reason="maintenance", clock=clock, seconds=3600)
        set_pause(own, reason=None, note="new")

    with admin_in_the_daemons_read(state, 1, pause_and_resume):
        taken = poll_pause(state, clock, max_pause=DAY).resumed
    later = poll_pause(state, clock, max_pause=DAY).resumed
    assert "gpuwatchd resume: new" in (taken, later)


@pytest.mark.parametrize("nth_read", [1, 2])
def test_a_clear_latches_request_left_after_the_daemons_read_of_the_last_is_never_lost(
    state: StateDir, nth_read: int
) -> None:
    """The daemon read the clear-latches request, then removed the file without the switches'
    lock: a ``resume --clear-latches`` landing in between (run again after ``kept``, as
    docs/operations.md says) was removed unread, its latches never lifted."""
    state.write(pause.CLEAR_LATCHES_FILE, b"1000.0\n")

    def resume_clearing(own: StateDir) -> None:
        set_pause(own, reason=None, clear=True)

    with admin_in_the_daemons_read(state, nth_read, resume_clearing):
        taken = pause.take_clear_latches(state)
    later = pause.take_clear_latches(state)
    assert max(t or 0.0 for t in (taken, later)) > 1000.0  # the new request's time, taken


def test_a_new_pause_discards_the_note_of_a_resume_the_daemon_never_saw(
    state: StateDir, tmp_path: Path
) -> None:
    """``resume --reason`` then ``pause`` before the daemon's next poll (or while it is down):
    the note of that resume must not explain the next, plain one."""
    clock = BootTime(NOW, 1.0, "b1")
    note_resume(state, "upgrade done")
    set_pause(state, reason=None)
    set_pause(state, reason="maintenance", clock=clock, seconds=3600)
    assert not (tmp_path / RESUMED_FILE).exists()
    assert poll_pause(state, clock, max_pause=DAY).reason == "maintenance"
    set_pause(state, reason=None)
    assert poll_pause(state, clock, max_pause=DAY).resumed == "gpuwatchd resume"


def test_a_failed_clear_latches_request_leaves_the_pause_in_force_as_it_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """resume removed the pause, then failed to write the clear-latches request and said
    'the switch is not changed': the daemon resumed, with its latches still set."""
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path}/st\n")
    assert main(["pause", "--config", str(config), "--for", "1h", "--reason", "x"]) == 0

    def full_disk(state_dir: StateDir) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pause, "clear_latches", full_disk)
    assert main(["resume", "--config", str(config), "--clear-latches"]) == 74
    assert "the switch is not changed" in capsys.readouterr().err
    assert (tmp_path / "st" / PAUSE_FILE).exists()
    # With --reason, its note was left to explain the next, plain resume.
    resume = ["resume", "--config", str(config), "--reason", "done", "--clear-latches"]
    assert main(resume) == 74
    assert not (tmp_path / "st" / RESUMED_FILE).exists()
    monkeypatch.undo()  # the pause that cannot be removed: the request it wrote is withdrawn
    monkeypatch.setattr(StateDir, "discard", lambda self, name: full_disk(self))
    assert main(resume) == 74
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == [PAUSE_FILE, "switches.lock"]


def test_pause_for_longer_than_max_pause_is_refused_and_nothing_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path}/st\nlimits:\n  max_pause: 1h\n")
    assert main(["pause", "--config", str(config), "--for", "2h"]) == 78
    assert "limits.max_pause (1h)" in capsys.readouterr().err
    assert not (tmp_path / "st" / PAUSE_FILE).exists()
    assert main(["pause", "--config", str(config), "--for", "30m", "--reason", "swap"]) == 0
    saved = json.loads((tmp_path / "st" / PAUSE_FILE).read_text())
    assert saved["reason"] == "swap"
    assert saved["until"] - saved["since"] == pytest.approx(1800)
    assert saved["until_boot"] - saved["since_boot"] == pytest.approx(1800)  # the boot clock


_BAD = "--for: invalid duration '{}' (use a number with a unit: ms, s, m, h, d; e.g. '500ms', '30s', '1h30m')"  # noqa: E501


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["pause", "--for", "2h"],
         "pause --for 2h: must be between 1s and limits.max_pause (1h); the switch is not changed"),
        (["pause", "--for", "xyz"],
         _BAD.format("xyz") + " (the switch is not changed)"),
        (["spare", "job:42", "--for", "2h"],
         "spare --for 2h: must be between 1s and limits.max_spare (1h); nothing is spared"),
        (["spare", "job:42", "--for", "0s"],
         "spare --for 0s: must be between 1s and limits.max_spare (1h); nothing is spared"),
        (["spare", "job:42", "--for", "abc"], _BAD.format("abc") + "; nothing is spared"),
        (["pause", "--for", " 2h\n"],  # read as 2h: said as read, on one line
         "pause --for 2h: must be between 1s and limits.max_pause (1h); the switch is not changed"),
    ],
)  # fmt: skip
def test_a_for_out_of_range_or_no_duration_is_refused_with_what_stays_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    """pause and spare share one --for reader; each still says what it left unchanged, and
    the duration as it read it (spaces around it are no part of it)."""
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path}/st\nlimits:\n  max_pause: 1h\n  max_spare: 1h\n")
    assert main([*args, "--config", str(config)]) == 78
    assert capsys.readouterr().err == f"gpuwatchd: {said}\n"
    assert not (tmp_path / "st" / PAUSE_FILE).exists()


def _written(saved: Mapping[str, object]) -> dict[str, object]:
    """``saved`` with the status document the daemon would write at NOW."""
    return with_document(saved, policy=default_policy(), wall=NOW, monotonic=None)


def _described_with_status(**status: object) -> Any:
    """``describe`` of an empty plan whose saved status (pid 1, polled at NOW) also says
    ``status``."""
    saved = {"plan": PlanState().to_json(), "status": {"pid": 1, "last_poll": NOW, **status}}
    return describe(_written(saved), policy=default_policy(), now_wall=NOW)


def test_status_shows_the_pause_end() -> None:
    plan_state = set_paused(PlanState(), True, reason="swap", until=NOW + 600)
    saved = {"plan": plan_state.to_json(), "status": {"pid": 1, "last_poll": NOW}}
    result = describe(_written(saved), policy=default_policy(), now_wall=NOW)
    assert result["paused_until"] == NOW + 600
    assert "ends by itself" in render_text(result)
    assert "in 10m" in render_text(result)


# --- spares -----------------------------------------------------------------------------------


def _spare(**kw: object) -> Spare:
    fields: dict[str, object] = {"target": "pid:1000", "until": NOW + 60, "reason": "debug"}
    fields.update(kw)
    return Spare(**fields)  # type: ignore[arg-type]


SLURM_42 = CgroupInfo(path="/system.slice/slurmstepd.scope/job_42/step_0", slurm_job="42")


@pytest.mark.parametrize(
    ("spare", "process", "spared"),
    [
        (_spare(pid=1000, start_ticks=500), proc(1000, 500), True),
        (_spare(pid=1000, start_ticks=500), proc(1000, 777), False),  # the PID reused
        (_spare(pid=1000, start_ticks=500), proc(1000, None), True),  # unknown: not excused
        (_spare(pid=1000, start_ticks=500), proc(1001, 500), False),
        (_spare(pid=1000, start_ticks=500, until=NOW), proc(1000, 500), False),  # over
        (_spare(target="job:slurm:42", job="slurm:42"), proc(7, 1, cgroup=SLURM_42), True),
        (_spare(target="job:slurm:42", job="slurm:43"), proc(7, 1, cgroup=SLURM_42), False),
    ],
)
def test_spare_covers_its_process_by_pid_and_start_time_or_its_job(
    spare: Spare, process: ProcessInfo, spared: bool
) -> None:
    at = dataclasses.replace(snap([process]), spares=(spare,), wall_time=NOW)
    assert (spare_reason(process, at) is not None) is spared


def test_a_job_spare_excuses_no_process_whose_cgroup_is_unknown() -> None:
    unknown = dataclasses.replace(proc(7, 1), cgroup=None)
    spare = _spare(target="job:slurm:42", job="slurm:42")
    at = dataclasses.replace(snap([unknown]), spares=(spare,), wall_time=NOW)
    why = spare_reason(unknown, at)
    assert why is not None
    assert "job is unknown" in why


def test_a_spared_orphan_gets_no_signal_then_its_ladder_starts_when_the_spare_ends() -> None:
    target = proc(1000, 500)
    finding = orphan(target)
    pol = policy()
    spared = dataclasses.replace(
        snap([target]), spares=(_spare(pid=1000, start_ticks=500, until=60.0),)
    )
    result = plan([finding], spared, PlanState(), pol, now=0.0, wall=0.0)
    assert signals(result) == []
    assert any(
        e.name == EventName.ACTION_REFUSED and "spare:" in str(e.fields.get("why"))
        for e in result.events
    )
    later = dataclasses.replace(spared, wall_time=60.0, monotonic=60.0)
    after = plan([finding], later, result.state, pol, now=60.0, wall=60.0)
    assert [s.signal for s in signals(after)] == ["SIGTERM"]


def test_a_ladder_under_way_holds_while_its_target_is_spared() -> None:
    """SIGTERM was sent; then the admin spares the process: no SIGKILL until the spare ends."""
    target = proc(1000, 500)
    finding, pol = orphan(target), policy()
    first = plan([finding], snap([target]), PlanState(), pol, now=0.0, wall=0.0)
    assert [s.signal for s in signals(first)] == ["SIGTERM"]
    spare = _spare(pid=1000, start_ticks=500, until=100.0)
    held = dataclasses.replace(snap([target]), spares=(spare,), monotonic=40.0, wall_time=40.0)
    second = plan([finding], held, first.state, pol, now=40.0, wall=40.0)
    assert signals(second) == []
    free = dataclasses.replace(held, monotonic=100.0, wall_time=100.0)
    third = plan([finding], free, second.state, pol, now=100.0, wall=100.0)
    assert [s.signal for s in signals(third)] == ["SIGKILL"]


def test_refusal_names_the_spare_after_the_floor() -> None:
    target = proc(1000, 500)
    spared = dataclasses.replace(snap([target]), spares=(_spare(pid=1000, start_ticks=500),))
    why = refusal(target, orphan(target), spared, policy(), frozenset())
    assert why is not None
    assert why.startswith("spare: pid 1000")


def test_spare_events_say_start_and_why_each_ended() -> None:
    a = _spare(target="pid:1", pid=1, start_ticks=1, until=NOW + 10)
    b = _spare(target="job:slurm:42", job="slurm:42", until=NOW + 100)
    started = spare_changes((), (a, b), NOW)
    assert [(n, f["target"]) for n, _l, f in started] == [
        (EventName.SPARE_STARTED, "job:slurm:42"),
        (EventName.SPARE_STARTED, "pid:1"),
    ]
    ended = spare_changes((a, b), (b,), NOW + 10)
    assert [(n, f["target"], f["why"]) for n, _l, f in ended] == [
        (EventName.SPARE_ENDED, "pid:1", "its time was up")
    ]
    cancelled = spare_changes((b,), (), NOW + 50)
    assert [f["why"] for _n, _l, f in cancelled] == ["cancelled"]
    assert spare_changes((b,), (b,), NOW + 50) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1234", ("pid:1234", 1234, None)),
        ("job:42", ("job:slurm:42", None, "slurm:42")),
        ("job:slurm:42", ("job:slurm:42", None, "slurm:42")),
        ("job:unit:train.service", ("job:unit:train.service", None, "unit:train.service")),
    ],
)
def test_spare_targets_parse(text: str, expected: tuple[str, int | None, str | None]) -> None:
    assert parse_target(text) == expected


@pytest.mark.parametrize("cancel", [True, False], ids=["cancel", "spare again"])
def test_a_spare_cancelled_or_given_again_beside_the_daemons_cut_is_never_undone(
    state: StateDir, cancel: bool
) -> None:
    """The daemon's cut of a spare longer than ``max_spare`` (read, compare, write) undid a
    ``spare --cancel`` landing after its re-read: the process stayed spared though the
    command said the spare ended; a new spare of the target was replaced by the old one."""
    write_spare(state, "job:slurm:9", clock=GIVEN, seconds=365 * DAY, reason="old", job="slurm:9")

    def change(own: StateDir) -> None:
        if cancel:
            assert cancel_spare(own, "job:slurm:9")
        else:
            write_spare(own, "job:slurm:9", clock=GIVEN, seconds=60, reason="new", job="slurm:9")

    with admin_in_the_daemons_read(state, 2, change):
        read_spares(state, boot(NOW + 10, 1010.0), max_spare=DAY, remove_stale=True)
    spares = read_spares(state, boot(NOW + 20, 1020.0), max_spare=DAY).spares
    assert [spare.reason for spare in spares] == ([] if cancel else ["new"])


def test_a_spare_given_again_as_the_daemon_removes_the_ended_one_is_never_removed(
    state: StateDir,
) -> None:
    """The daemon removed a spare whose time was up by its name, without the switches' lock
    or a look at what it removed: a new spare of the target landing after its read went with
    it, though ``spare`` said the target was spared."""
    write_spare(state, "job:slurm:9", clock=GIVEN, seconds=60, reason="old", job="slurm:9")

    def again(own: StateDir) -> None:
        write_spare(own, "job:slurm:9", clock=GIVEN, seconds=3600, reason="new", job="slurm:9")

    with admin_in_the_daemons_read(state, 1, again):
        read_spares(state, boot(NOW + 61, 1061.0), max_spare=DAY, remove_stale=True)
    spares = read_spares(state, boot(NOW + 70, 1070.0), max_spare=DAY).spares
    assert [spare.reason for spare in spares] == ["new"]


@pytest.mark.parametrize(
    "text", ["0", "1", "abc", "job:", "job:42;rm", "pid:12", "job:nope:1", "²", "9" * 5000]
)
def test_bad_spare_targets_are_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="spare"):
        parse_target(text)


def boot(wall: float, seconds: float, boot_id: str = "b1") -> BootTime:
    """A reading of the clocks: wall time, seconds since boot, the boot id."""
    return BootTime(wall, seconds, boot_id)


GIVEN = boot(NOW, 1000.0)  # when the spares below were given: 1000 s into boot b1


def test_spare_files_round_trip_and_end_by_themselves(state: StateDir, tmp_path: Path) -> None:
    write_spare(state, "pid:1000", clock=GIVEN, seconds=60, reason="r", pid=1000, start_ticks=5)
    write_spare(state, "job:slurm:42", clock=GIVEN, seconds=7200, reason="bench", job="slurm:42")
    found = read_spares(state, boot(NOW + 10, 1010.0), max_spare=DAY, remove_stale=True)
    assert [s.target for s in found.spares] == ["pid:1000", "job:slurm:42"]
    assert [s.until for s in found.spares] == [NOW + 60, NOW + 7200]
    assert found.spares[0].start_ticks == 5
    assert (found.problems, found.cut) == ((), ())
    # Another boot (another boot id, begun after the spare was given): the process spare names
    # nobody now, and is removed; the job's stays, by its wall end (the boot clock restarted).
    other = read_spares(state, boot(NOW + 3600, 50.0, "b2"), max_spare=DAY, remove_stale=True)
    assert [(s.target, s.until) for s in other.spares] == [("job:slurm:42", NOW + 7200)]
    assert any("another boot" in p for p in other.problems)
    # Its time up: gone, and removed.
    later = read_spares(state, boot(NOW + 7200, 8200.0), max_spare=DAY, remove_stale=True)
    assert later.spares == ()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("spare-")] == []
    write_spare(state, "job:slurm:7", clock=GIVEN, seconds=60, reason="", job="slurm:7")
    assert cancel_spare(state, "job:slurm:7")
    assert not cancel_spare(state, "job:slurm:7")


def _spare_files(tmp_path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("spare-")}


@pytest.mark.parametrize("step", [-120.0, +2 * DAY], ids=["back 2 min", "forward 2 days"])
def test_a_wall_clock_step_neither_drops_nor_ends_a_spare(
    state: StateDir, tmp_path: Path, step: float
) -> None:
    """Issue 34, finding 1: ``spare --for 24h`` at the default 24 h limit, then the clock
    stepped back two minutes: the file was deleted as "ends later than limits.max_spare
    allows" and the process a target again. Stepped forward, the spare ended early. It
    lasts its time on the boot clock, and shows its end in the stepped wall time."""
    write_spare(state, "pid:1000", clock=GIVEN, seconds=DAY, reason="r", pid=1000, start_ticks=5)
    write_spare(state, "job:slurm:42", clock=GIVEN, seconds=DAY, reason="", job="slurm:42")
    files = _spare_files(tmp_path)
    stepped = boot(NOW + 10 + step, 1010.0)
    found = read_spares(state, stepped, max_spare=DAY, remove_stale=True)
    assert [(s.target, s.until) for s in found.spares] == [
        ("job:slurm:42", stepped.wall + DAY - 10),
        ("pid:1000", stepped.wall + DAY - 10),
    ]
    assert (found.problems, found.cut) == ((), ())
    assert _spare_files(tmp_path) == files  # nothing removed, nothing rewritten
    end = read_spares(state, boot(NOW + step + DAY, 1000.0 + DAY), max_spare=DAY)
    assert end.spares == ()  # it still ends on time


def test_a_forward_step_early_in_the_boot_keeps_a_process_spare_of_this_boot_id(
    state: StateDir,
) -> None:
    """Issue 34, finding 2: a spare given 5 s into the boot, then the wall clock stepped
    forward an hour: the boot's start recomputed from the wall clock fell after the spare,
    which was deleted as "of another boot". Another boot is another boot id."""
    given = boot(NOW, 5.0)
    write_spare(state, "pid:1000", clock=given, seconds=DAY, reason="r", pid=1000, start_ticks=5)
    found = read_spares(state, boot(NOW + 3600 + 10, 15.0), max_spare=DAY, remove_stale=True)
    assert [s.target for s in found.spares] == ["pid:1000"]
    assert found.problems == ()
    # A shell and a sandboxed service may see different boot ids in a container: a spare
    # given after this boot began (by the wall clock) is then still this boot's.
    container = read_spares(state, boot(NOW + 20, 25.0, "service-view"), max_spare=DAY)
    assert [s.target for s in container.spares] == ["pid:1000"]


def test_lowering_max_spare_cuts_the_spares_in_force_never_drops_them(
    state: StateDir, tmp_path: Path
) -> None:
    """A reload that lowered ``limits.max_spare`` silently deleted every longer spare; now
    each is cut to the new limit from now, the cut is written into its file (it holds at the
    next poll and after a restart) and listed, for ``spare.cut``."""
    write_spare(state, "pid:1000", clock=GIVEN, seconds=DAY, reason="r", pid=1000, start_ticks=5)
    write_spare(state, "job:slurm:42", clock=GIVEN, seconds=600, reason="", job="slurm:42")
    now = boot(NOW + 10, 1010.0)
    listing = read_spares(state, now, max_spare=3600)  # spare --list: says it, writes nothing
    assert [(s.target, s.until) for s in listing.spares] == [
        ("job:slurm:42", NOW + 600),
        ("pid:1000", NOW + 10 + 3600),
    ]
    files = _spare_files(tmp_path)
    found = read_spares(state, now, max_spare=3600, remove_stale=True)
    assert [(s.target, s.until, was) for s, was in found.cut] == [
        ("pid:1000", NOW + 10 + 3600, NOW + DAY)
    ]
    assert found.spares == listing.spares
    assert found.problems == ()
    later = read_spares(state, boot(NOW + 1000, 2000.0), max_spare=3600, remove_stale=True)
    assert later.cut == ()
    assert [(s.target, s.until) for s in later.spares] == [("pid:1000", NOW + 10 + 3600)]
    (name,) = _spare_files(tmp_path)  # the job's ended
    assert _spare_files(tmp_path)[name] != files[name]
    gone = read_spares(state, boot(NOW + 3610, 1010.0 + 3600), max_spare=3600, remove_stale=True)
    assert gone.spares == ()


def test_a_spare_file_from_before_the_boot_clock_still_loads_and_is_cut_not_dropped(
    state: StateDir,
) -> None:
    """The files users have: ``until`` and ``since`` in wall time only, with the boot id for
    a process. Set back two minutes after a 24 h spare, it has more than the limit left by
    the wall clock: it is cut to the limit, never dropped."""
    old = {
        "target": "pid:1000", "pid": 1000, "start_ticks": 5, "boot_id": "b1", "job": None,
        "until": NOW + DAY, "since": NOW, "reason": "old", "by_uid": 0,
    }  # fmt: skip
    name = next(iter(_written_name(state, old)))
    found = read_spares(state, boot(NOW - 120, 1010.0), max_spare=DAY, remove_stale=True)
    assert [(s.target, s.reason, s.until) for s in found.spares] == [
        ("pid:1000", "old", NOW - 120 + DAY)
    ]
    assert [was for _, was in found.cut] == [NOW + DAY]
    assert found.problems == ()
    assert json.loads(state.read(name, 4096))["until_boot"] == 1010.0 + DAY


def _written_name(state: StateDir, body: dict[str, object]) -> list[str]:
    """Write ``body`` as the spare file of its target (as an older version wrote it)."""
    write_spare(state, str(body["target"]), clock=GIVEN, seconds=1, reason="", pid=1000,
                start_ticks=5)  # fmt: skip
    (name,) = state.names("spare-")
    state.write(name, json.dumps(body).encode())
    return [name]


def test_hostile_spare_files_are_ignored_and_named(state: StateDir, tmp_path: Path) -> None:
    (tmp_path / "spare-0000").write_text(json.dumps({"target": "job:slurm:1", "until": NOW + 9}))
    (tmp_path / "spare-link").symlink_to("/etc/passwd")
    found = read_spares(state, boot(NOW, 1000.0), max_spare=DAY, remove_stale=True)
    assert found.spares == ()
    text = " ".join(found.problems)
    assert "spare-0000: the file name does not match" in text
    assert "spare-link" in text
    # Bad files are removed (the link itself, never what it points at).
    assert not (tmp_path / "spare-link").is_symlink()
    assert os.path.exists("/etc/passwd")
    assert not (tmp_path / "spare-0000").exists()


def test_spare_cli_records_the_process_start_time_lists_and_cancels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path}/st\n")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        args = ["spare", "--config", str(config), str(child.pid), "--for", "1h"]
        assert main([*args, "--reason", "debugging"]) == 0
        assert main(args) == 78  # a reason is required
        with open(f"/proc/{child.pid}/stat") as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        assert main(["spare", "--config", str(config), "--list", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out.split("\n", 1)[1])["spares"]
        assert [(s["pid"], s["start_ticks"], s["reason"]) for s in listed] == [
            (child.pid, ticks, "debugging")
        ]
        assert main(["spare", "--config", str(config), "--cancel", str(child.pid)]) == 0
        assert main(["spare", "--config", str(config), "--list"]) == 0
        assert "no spares" in capsys.readouterr().out
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--for", "1h", "--reason", "debug"],
         "spare needs a target (PID or job:ID): nothing is spared"),
        (["--reason", "debug"], "spare needs a target (PID or job:ID): nothing is spared"),
        (["--cancel"], "spare --cancel needs a target (PID or job:ID): nothing is changed"),
        (["--cancel", "x"],  # a cancel spares nothing: it says what it did not change
         "spare 'x': expected a PID or job:ID (job:42 for Slurm job 42); nothing is changed"),
        (["--list", "--cancel"], "spare --list takes no target and no --cancel"),
        (["--list", "42"], "spare --list takes no target and no --cancel"),
    ],
)  # fmt: skip
def test_spare_without_a_target_is_refused_naming_what_is_missing_not_a_listing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    """--for and --reason without a target listed the spares and exited 0, and --cancel alone
    was told it had given --list; only --list, or spare alone, lists. A --cancel of a target
    that is none says nothing is changed, as every refused --cancel does."""
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path}/st\n")
    assert main(["spare", "--config", str(config), *args]) == 78
    assert capsys.readouterr() == ("", f"gpuwatchd: {said}\n")
    assert main(["spare", "--config", str(config)]) == 0
    assert main(["spare", "--config", str(config), "--json"]) == 0
    assert main(["spare", "--config", str(config), "--list"]) == 0
    listed = capsys.readouterr().out  # spare alone and --list as text, --json as JSON
    assert listed.startswith("no spares\n{")
    assert listed.endswith("}\nno spares\n")


@pytest.mark.parametrize("args", [["--list"], ["job:42", "--cancel"]])
def test_spare_refuses_a_state_dir_that_cannot_be_trusted_with_exit_78_as_every_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """Its StateDirError (an OSError) was taken for a failed write: exit 74, the reason twice."""
    (tmp_path / "st").write_text("")
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path}/st\n")
    assert main(["spare", "--config", str(config), *args]) == 78
    assert capsys.readouterr().err.count("not a directory") == 1


def test_spare_of_a_thread_id_is_refused_naming_its_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A thread id (htop, ps -L) has its /proc/TID/stat, so its start time was read and the
    spare written and said to hold; but a spare covers a process's PID: it spared nothing."""
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path}/st\n")
    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
    child = subprocess.Popen([sys.executable, "-c", code + "time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while not (threads := set(os.listdir(f"/proc/{child.pid}/task")) - {str(child.pid)}):
            assert time.monotonic() < deadline, "the child's thread never started"
            time.sleep(0.02)
        thread = int(threads.pop())
        args = ["spare", "--config", str(config), str(thread), "--for", "1h", "--reason", "r"]
        assert main(args) == 78
        assert capsys.readouterr().err == (
            f"gpuwatchd: spare {thread}: PID {thread} is a thread of process {child.pid}: "
            f"spare {child.pid}; nothing is spared\n"
        )
        assert not list(tmp_path.glob("st/spare-*"))
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("pid_ns", "init_ns"),
    [
        (OTHER_NS, None),  # a container without hostPID: refused
        (None, None),  # cannot tell (no namespace link): refused
        (PROC_PID_INIT_INO, OTHER_NS),  # the /proc of a container: refused
        (PROC_PID_INIT_INO, PROC_PID_INIT_INO),  # hostPID, a private cgroup namespace: spared
    ],
)
def test_spare_by_pid_outside_the_host_pid_namespace_is_refused(
    tmp_path: Path,
    fake: FakeProc,
    capsys: pytest.CaptureFixture[str],
    pid_ns: int | None,
    init_ns: int | None,
) -> None:
    """A PID read in a container's PID namespace was written as the daemon reads it, a host
    PID: another process was spared (and its cancel ended another's spare). Refused now,
    unless namespace_check is off (the tests' own); a cgroup namespace changes no PID
    (``kubectl exec`` into the hostPID DaemonSet's pod)."""
    fake.add(1, comm="systemd", ppid=0)
    fake.add(300, starttime=4242)
    fake.add(600)
    if pid_ns is not None:
        fake.set_self(600, pid_ns=pid_ns, cgroup_ns=OTHER_NS)
    if init_ns is not None:
        (fake.root / "1" / "ns").mkdir()
        (fake.root / "1" / "ns" / "pid").symlink_to(f"pid:[{init_ns}]")
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path}/st\nproc_root: {fake.root}\n")
    args = ["spare", "--config", str(config), "300"]
    if init_ns != PROC_PID_INIT_INO:
        assert main([*args, "--for", "1h", "--reason", "r"]) == 78
        assert main(["spare", "--config", str(config), "--cancel", "300"]) == 78
        said = "not run in the host PID namespace (or cannot tell), where the daemon reads "
        said += "PIDs: the PID may name another process there; nothing is"
        assert capsys.readouterr().err == (
            f"gpuwatchd: spare 300: {said} spared\ngpuwatchd: spare 300: {said} changed\n"
        )
        assert not list(tmp_path.glob("st/spare-*"))
        config.write_text(config.read_text() + "namespace_check: false\n")
    assert main([*args, "--for", "1h", "--reason", "r"]) == 0
    assert "pid 300 (start ticks 4242) is spared" in capsys.readouterr().out


def test_status_lists_the_daemons_spares() -> None:
    spares = [{"target": "job:slurm:42", "until": NOW + 120, "reason": "bench"}]
    result = _described_with_status(spares=spares)
    assert result["spares"] == [{"target": "job:slurm:42", "until": NOW + 120, "reason": "bench"}]
    assert "spared:   job:slurm:42 until" in render_text(result)


# --- NVML as a state --------------------------------------------------------------------------


def test_nvml_state_changes_at_the_first_failed_reading_and_its_return_is_an_event() -> None:
    ok, wedged = NvmlReading(available=True), NvmlReading(available=True, wedged=True, error="hung")
    state, events = next_availability(NvmlAvailability(), ok, NOW)
    assert (state.state, events) == ("ok", [])
    state, events = next_availability(state, wedged, NOW + 5)
    assert (state.state, state.since, state.error, events) == ("wedged", NOW + 5, "hung", [])
    state, events = next_availability(state, wedged, NOW + 10)
    assert state.since == NOW + 5
    assert events == []
    state, events = next_availability(state, ok, NOW + 65)
    assert state.state == "ok"
    assert state.error is None
    assert events == [
        (
            EventName.NVML_RECOVERED,
            "warning",
            {"was": "wedged", "since": NOW + 5, "gone_for": 60.0, "error": "hung"},
        )
    ]


def test_status_says_since_when_nvml_is_wedged_and_needs_attention() -> None:
    result = _described_with_status(nvml={"state": "wedged", "since": NOW - 30, "error": "hung"})
    assert result["nvml"] == {"state": "wedged", "error": "hung", "since": NOW - 30}
    assert "NVML:     wedged since" in render_text(result)
    assert "30s ago" in render_text(result)


def test_a_spare_beyond_the_most_the_daemon_honours_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """read_spares honours MAX_SPARES spares at once, those that end first: one more was
    written and said to hold ("never signalled until then") though the daemon never saw it.
    It is refused now, nothing written; a spare in force may still be replaced."""
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path}/st\n")
    with StateDir.open(str(tmp_path / "st"), create=True) as st:
        clock = BootTime.read(time.time(), None)
        for job in range(MAX_SPARES - 1):
            key = f"slurm:{job}"
            write_spare(st, f"job:{key}", clock=clock, seconds=600, reason="r", job=key)
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                for _ in range(2)]  # fmt: skip
    try:
        for child, code in ((children[0], 0), (children[0], 0), (children[1], 78)):
            args = ["spare", "--config", str(config), str(child.pid), "--for", "1h"]
            assert main([*args, "--reason", "debugging"]) == code
        said = capsys.readouterr().err
        assert f"spare {children[1].pid}: {MAX_SPARES} spares are in force" in said
        assert "nothing is spared" in said
        with StateDir.open(str(tmp_path / "st")) as st:
            found = read_spares(st, BootTime.read(time.time(), None), max_spare=DAY).spares
        assert len(found) == MAX_SPARES
        assert f"pid:{children[0].pid}" in {spare.target for spare in found}
        st_names = [name for name in os.listdir(tmp_path / "st") if name != "switches.lock"]
        assert len(st_names) == MAX_SPARES, st_names
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_the_daemon_says_once_which_spares_past_the_most_it_honours_are_not(
    tmp_path: Path,
) -> None:
    """Hand-made files (or two `spare` commands racing) can hold more than MAX_SPARES valid
    spares: those the daemon does not honour are said (an admin believes them in force), once,
    and their files are kept for when one in force ends."""
    st = tmp_path / "st"
    policy = dataclasses.replace(default_policy(), state_dir=str(st), dry_run=True)
    daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    with StateDir.open(str(st), create=True) as directory:
        clock = BootTime.read(time.time(), None)
        for job in range(MAX_SPARES + 2):
            key = f"slurm:{job}"
            write_spare(
                directory, f"job:{key}", clock=clock, seconds=600 + job, reason="r", job=key
            )
    with capture_logs() as logs:
        inputs = daemon._read_switches()
        daemon._read_switches()
    assert len(inputs.spares or ()) == MAX_SPARES
    said = [e["why"] for e in logs if e["event"] == EventName.SPARE_ENDED]
    past = f"more than {MAX_SPARES} spares at once; honoured when one ends"
    assert said == [f"ignored: job:slurm:{job}: {past}" for job in (MAX_SPARES, MAX_SPARES + 1)]
    assert len([p for p in st.iterdir() if p.name.startswith("spare-")]) == MAX_SPARES + 2


def test_spare_files_past_those_read_are_counted(state: StateDir, tmp_path: Path) -> None:
    for n in range(4 * MAX_SPARES + 3):
        (tmp_path / f"spare-{n:04}").write_text("{}")
    found = read_spares(state, boot(NOW, 1000.0), max_spare=DAY)
    assert found.over == (f"3 spare files past the first {4 * MAX_SPARES} not read",)


def test_the_largest_spare_written_is_read_back(state: StateDir) -> None:
    """A reason of MAX_REASON characters outside the BMP is 12 bytes each as JSON: the spare
    file was larger than the reader's bound, read as no JSON, so the spare the command had
    said to hold was ignored (and removed by the daemon)."""
    job = "unit:" + "\\" * 250 + ".service"  # the longest unit name, each byte escaped
    key, _pid, checked = parse_target(f"job:{job}")
    reason = "\U0001f600" * MAX_REASON
    clock = boot(NOW, 1000.0)
    write_spare(state, key, clock=clock, seconds=600, reason=reason + "!", job=checked)
    found = read_spares(state, clock, max_spare=DAY, remove_stale=True)
    assert found.problems == ()
    assert [(spare.target, spare.reason) for spare in found.spares] == [(key, reason)]
