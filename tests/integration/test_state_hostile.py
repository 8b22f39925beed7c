"""state_dir and its files are hostile until checked: links are never followed, a bad
state_dir is one line and exit 78 at start, a failing disk is logged and never fatal."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from gpuwatchd.config.schema import default_policy
from gpuwatchd.core.vocabulary import EventName, ExitCode
from gpuwatchd.daemon.lifecycle import Daemon
from gpuwatchd.state.directory import StateDir, StateDirError
from gpuwatchd.state.pause import clear_latches, read_pause_switch, set_pause, take_clear_latches
from gpuwatchd.state.saved import StateStore

SECRET = "a file the daemon must never touch: hunter2\n"  # noqa: S105 - a marker, no password


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_text(SECRET)
    return path


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    return path


def test_a_linked_lock_file_is_refused_and_its_target_left_alone(
    state_dir: Path, victim: Path
) -> None:
    (state_dir / "lock").symlink_to(victim)
    with (
        pytest.raises(OSError, match="symbolic links"),
        StateStore(str(state_dir)).directory().lock(),
    ):
        pass
    assert victim.read_text() == SECRET


def _open(state_dir: Path) -> StateDir:
    return StateDir.open(str(state_dir))


def read_pause(directory: StateDir) -> str | None:
    """The pause reason when paused (``""`` when none was given), else None."""
    switch = read_pause_switch(directory)
    return None if switch is None else switch.reason


def check_state_dir(path: str, *, euid: int | None = None) -> None:
    """What the daemon does to its state_dir first: create it (0700), refuse it untrusted."""
    StateDir.open(path, create=True, euid=euid).close()


def test_a_linked_pause_file_is_paused_but_never_read(state_dir: Path, victim: Path) -> None:
    (state_dir / "paused").symlink_to(victim)
    with _open(state_dir) as directory:
        reason = read_pause(directory)
    assert reason == "pause file unreadable"
    assert "hunter2" not in reason


def test_a_pause_file_that_is_a_fifo_does_not_block(state_dir: Path) -> None:
    os.mkfifo(state_dir / "paused")
    with _open(state_dir) as directory:
        assert read_pause(directory) == "pause file unreadable"


def test_switches_never_write_through_a_planted_link(state_dir: Path, victim: Path) -> None:
    (state_dir / "clear-latches").symlink_to(victim)
    (state_dir / "paused").symlink_to(victim)
    with _open(state_dir) as directory:
        clear_latches(directory)
        set_pause(directory, reason="maintenance")
        assert victim.read_text() == SECRET
        assert read_pause(directory) == "maintenance"
        assert take_clear_latches(directory) is not None
        assert take_clear_latches(directory) is None
        (state_dir / "clear-latches").symlink_to(victim)  # a request, its time never read
        assert take_clear_latches(directory) == math.inf


def test_a_linked_state_file_is_moved_aside_not_read(state_dir: Path, victim: Path) -> None:
    (state_dir / "state.json").symlink_to(victim)
    with capture_logs() as logs:
        assert StateStore(str(state_dir)).load() == {}
    assert [e["event"] for e in logs] == [EventName.STATE_CORRUPT]
    assert victim.read_text() == SECRET


def test_a_deeply_nested_state_file_is_corrupt_not_a_crash(state_dir: Path) -> None:
    (state_dir / "state.json").write_text("[" * 100_000)
    with capture_logs() as logs:
        assert StateStore(str(state_dir)).load() == {}
    assert [e["event"] for e in logs] == [EventName.STATE_CORRUPT]


def test_a_state_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.write_text("")
    with pytest.raises(StateDirError, match="not a directory"):
        check_state_dir(str(path))


@pytest.mark.parametrize(
    ("mode", "uid", "message"),
    [(0o777, 0, "writable by group or others"), (0o700, 1000, "owned by uid 1000")],
)
def test_as_root_a_state_dir_others_can_write_is_refused(
    tmp_path: Path, mode: int, uid: int, message: str
) -> None:
    path = tmp_path / "state"
    path.mkdir()
    path.chmod(mode)
    if os.geteuid() != 0:
        pytest.skip("needs root to give the folder another owner")
    os.chown(path, uid, -1)
    with pytest.raises(StateDirError, match=message):
        check_state_dir(str(path), euid=0)
    if mode == 0o700:
        check_state_dir(str(path), euid=1000)  # the user running it may own it
    else:
        with pytest.raises(StateDirError, match=message):  # writable by others: never
            check_state_dir(str(path), euid=1000)


def test_a_new_state_dir_is_created_private(tmp_path: Path) -> None:
    path = tmp_path / "a" / "state"
    check_state_dir(str(path))
    assert path.stat().st_mode & 0o777 == 0o700


def _daemon(state_dir: Path) -> Daemon:
    policy = dataclasses.replace(default_policy(), state_dir=str(state_dir), dry_run=True)
    return Daemon(policy, config_path="/nonexistent/gpuwatchd.yaml")


def test_the_daemon_refuses_a_bad_state_dir_in_one_line_with_exit_78(tmp_path: Path) -> None:
    bad = tmp_path / "state"
    bad.write_text("")
    with capture_logs() as logs:
        code = _daemon(bad).run()
    assert code == ExitCode.CONFIG
    assert [(e["event"], e["log_level"]) for e in logs] == [
        (EventName.STATE_DIR_UNUSABLE, "critical")
    ]


def test_the_daemon_refuses_a_linked_lock_file_in_one_line(state_dir: Path, victim: Path) -> None:
    (state_dir / "lock").symlink_to(victim)
    with capture_logs() as logs:
        code = _daemon(state_dir).run()
    assert code == ExitCode.CONFIG
    assert [e["event"] for e in logs] == [EventName.STATE_DIR_UNUSABLE]
    assert victim.read_text() == SECRET


def test_a_state_write_that_fails_is_logged_and_the_daemon_goes_on(state_dir: Path) -> None:
    daemon = _daemon(state_dir)
    (state_dir / "state.json").mkdir()  # rename over a directory fails (EISDIR)
    with capture_logs() as logs:
        daemon.save_state()
    assert [e["event"] for e in logs] == [EventName.STATE_SAVE_FAILED]
    assert [p.name for p in state_dir.iterdir()] == ["state.json"], "no temporary file left"


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EMFILE, errno.EIO, errno.EACCES])
def test_an_error_the_loop_does_not_expect_ends_in_a_restartable_exit(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    """Exits 77 and 78 are never restarted (systemd/gpuwatchd.service): an OSError out of the
    poll loop is not the state folder's fault and must not leave the node unwatched for good."""
    daemon = _daemon(state_dir)

    def failing_poll(inputs: object) -> None:
        raise OSError(error, os.strerror(error), "/proc/1/fdinfo")

    monkeypatch.setattr(daemon.engine, "poll", failing_poll)
    monkeypatch.setattr(daemon, "_install_signal_handlers", lambda: None)
    with capture_logs() as logs, pytest.raises(RuntimeError, match="the poll loop failed") as got:
        daemon.run()
    assert isinstance(got.value.__cause__, OSError)
    assert got.value.__cause__.errno == error
    assert os.strerror(error) in str(got.value)
    assert EventName.STATE_DIR_UNUSABLE not in [e["event"] for e in logs]


@pytest.mark.parametrize("error", [errno.EIO, errno.EMFILE, errno.ENOMEM])
def test_a_state_file_that_cannot_be_read_now_fails_the_start_and_is_kept(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    """Only a malformed or untrusted state file is moved aside: one that a transient error
    keeps from being read still holds the ladders, the kill cap and the resets, so the start
    fails (exit 1, naming the file; systemd tries again) and the file stays for the next one."""
    (state_dir / "state.json").write_text('{"version": 1}')
    daemon = _daemon(state_dir)
    directory = daemon.store.directory()
    read = directory.read

    def failing_read(name: str, limit: int) -> bytes:
        if name == "state.json":
            raise OSError(error, os.strerror(error))
        return read(name, limit)

    def started() -> None:
        raise AssertionError("the daemon started without its saved state")

    monkeypatch.setattr(directory, "read", failing_read)
    monkeypatch.setattr(daemon, "poll_once", started)
    monkeypatch.setattr(daemon, "_install_signal_handlers", lambda: None)
    with capture_logs() as logs, pytest.raises(RuntimeError) as got:
        daemon.run()
    assert f"cannot read {state_dir / 'state.json'}: {os.strerror(error)}" in str(got.value)
    assert EventName.STATE_CORRUPT not in [e["event"] for e in logs]
    assert sorted(p.name for p in state_dir.iterdir()) == ["lock", "state.json"]
    assert (state_dir / "state.json").read_text() == '{"version": 1}'


@pytest.mark.parametrize("ending", ["stopped", "once answered", "loop failed"])
def test_a_lock_that_cannot_be_released_keeps_the_answer_of_the_loop(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    """The poll loop has ended (a SIGTERM, ``run --once`` done, or failed) when the instance
    lock is released: an unlock that fails is said, but never turns that answer into exit 78
    (a configuration a person must fix: systemd never restarts it)."""
    daemon = _daemon(state_dir)
    daemon.once = ending == "once answered"
    directory = daemon.store.directory()
    held = directory.lock
    unavailable = SimpleNamespace(snapshot=SimpleNamespace(nvml=SimpleNamespace(available=False)))

    @contextlib.contextmanager
    def lock_failing_at_release() -> Iterator[None]:
        with held():
            yield
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(state_dir / "lock"))

    def poll() -> object:
        if ending == "loop failed":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        daemon._stop = True
        return unavailable

    monkeypatch.setattr(directory, "lock", lock_failing_at_release)
    monkeypatch.setattr(daemon, "poll_once", poll)
    monkeypatch.setattr(daemon, "_install_signal_handlers", lambda: None)
    monkeypatch.setattr(daemon, "_wait", lambda: None)
    with capture_logs() as logs:
        if ending == "loop failed":
            with pytest.raises(RuntimeError, match="the poll loop failed"):
                daemon.run()
        else:
            expected = ExitCode.UNAVAILABLE if daemon.once else ExitCode.OK
            assert daemon.run() == expected
    [said] = [e for e in logs if e["event"] == EventName.STATE_DIR_UNUSABLE]
    assert os.strerror(errno.EIO) in said["error"]


def test_a_state_the_writer_refuses_is_said_and_the_daemon_goes_on(state_dir: Path) -> None:
    """A NaN (the codec writes no NaN) is refused as a full disk is: said, nothing written,
    False (no irreversible step), and the daemon runs on its state in memory."""
    daemon = _daemon(state_dir)
    daemon.started_wall = float("nan")
    with capture_logs() as logs:
        assert daemon.save_state() is False
    [said] = [e for e in logs if e["event"] == EventName.STATE_SAVE_FAILED]
    assert "not JSON compliant" in said["error"]
    assert list(state_dir.iterdir()) == []
    daemon.started_wall = 1.0
    assert daemon.save_state()


def test_a_second_outage_of_the_state_dir_is_said_again(state_dir: Path, tmp_path: Path) -> None:
    """Said once per distinct error, and again after the folder worked in between."""
    daemon = _daemon(state_dir)
    assert daemon._state_dir() is not None  # opened: the folder at the path is checked
    with capture_logs() as logs:
        for _ in range(2):
            state_dir.rename(tmp_path / "away")
            assert daemon._state_dir() is None
            assert daemon._state_dir() is None  # the same error: not said twice
            (tmp_path / "away").rename(state_dir)
            assert daemon._state_dir() is not None
    assert [e["event"] for e in logs] == [EventName.STATE_DIR_UNUSABLE] * 2
