"""The state file (atomic, 0600, corrupt → moved aside) and the single-instance lock."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gpuwatchd.core.checked import as_map
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.state.directory import AlreadyRunning
from gpuwatchd.state.saved import StateStore, read_saved_state


def test_load_without_a_file_is_empty(tmp_path: Path) -> None:
    assert StateStore(str(tmp_path / "missing")).load() == {}


def test_save_then_load_round_trips_and_leaves_no_temp_files(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path))
    data = {"version": 1, "boot_id": "b", "plan": {"paused": True, "times": [1.5, 2]}}
    store.save(data)
    store.save({**data, "boot_id": "c"})
    assert store.load() == {**data, "boot_id": "c"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_saved_file_is_private(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path / "sub"))
    store.save({"a": 1})
    mode = stat.S_IMODE(os.stat(tmp_path / "sub" / "state.json").st_mode)
    assert mode == 0o600


def test_save_refuses_non_finite_numbers_and_keeps_the_old_file(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path))
    store.save({"a": 1})
    with pytest.raises(ValueError, match="JSON"):
        store.save({"a": float("nan")})
    assert store.load() == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"", "not valid JSON"),
    ],
)
def test_corrupt_file_is_logged_moved_aside_and_load_starts_clean(
    tmp_path: Path, content: bytes, why: str
) -> None:
    (tmp_path / "state.json").write_bytes(content)
    store = StateStore(str(tmp_path))
    with capture_logs() as logs:
        assert store.load() == {}
    assert not (tmp_path / "state.json").exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("state.json.corrupt-")]
    assert len(aside) == 1
    assert aside[0].read_bytes() == content
    assert logs[0]["event"] == EventName.STATE_CORRUPT
    assert logs[0]["path"] == str(tmp_path / "state.json")
    assert why in str(logs[0]["why"])


def test_discard_corrupt_moves_a_malformed_but_valid_json_file_aside(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path))
    store.save({"plan": "garbage"})
    with capture_logs() as logs:
        store.discard_corrupt("plan: expected an object")
    assert store.load() == {}
    assert logs[0]["event"] == EventName.STATE_CORRUPT


_HOLDER = textwrap.dedent(
    """
    import sys
    from gpuwatchd.state.saved import StateStore
    with StateStore(sys.argv[1]).directory().lock():
        print("locked", flush=True)
        sys.stdin.readline()
    """
)


def test_lock_held_by_another_process_raises_already_running_with_its_pid(
    tmp_path: Path,
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(AlreadyRunning) as info, StateStore(str(tmp_path)).directory().lock():
            pass
        assert info.value.holder == f"pid {holder.pid}"
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=10) == 0
    # Released when the holder let go: it can be taken again.
    with StateStore(str(tmp_path)).directory().lock():
        pass


def test_lock_is_released_when_the_holder_is_killed(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()  # our own child
    holder.wait(timeout=10)
    with StateStore(str(tmp_path)).directory().lock():
        pass


def test_lock_is_exclusive_within_one_process_too(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path))
    with (
        store.directory().lock(),
        pytest.raises(AlreadyRunning),
        StateStore(str(tmp_path)).directory().lock(),
    ):
        pass


def test_saved_json_is_plain_and_sorted(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path))
    store.save({"b": 1, "a": [1, 2]})
    assert json.loads((tmp_path / "state.json").read_text()) == {"a": [1, 2], "b": 1}


def test_peek_reads_without_changing_anything(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path))
    assert dict(read_saved_state(store.state_dir).data) == {}
    store.save({"version": 1, "x": 2})
    assert dict(read_saved_state(store.state_dir).data) == {"version": 1, "x": 2}
    Path(store.path).write_text("{not json")
    assert dict(read_saved_state(store.state_dir).data) == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]  # not moved aside


def test_the_one_state_reader_types_what_it_finds_and_says_why_it_cannot(tmp_path: Path) -> None:
    """status, run --once and scan read state.json through read_saved_state: a missing file is
    nothing found, a malformed one a problem (left in place), a well-formed one typed."""
    from gpuwatchd.state.saved import STATE, read_saved_state

    missing = read_saved_state(str(tmp_path / "none"))
    assert (missing.found, missing.problem, missing.daemon_pid) == (False, None, None)
    store = StateStore(str(tmp_path))
    store.save(
        STATE.envelope(
            {
                "boot_id": "b1",
                "saved_at": 1.0,
                "assess": {},
                "plan": {"ladders": {}},
                "reset_in_progress": None,
                "status": {"pid": 4242},
            }
        )
    )
    saved = read_saved_state(str(tmp_path))
    assert saved.found
    assert saved.problem is None
    assert (saved.data["boot_id"], saved.daemon_pid) == ("b1", 4242)
    assert as_map(saved.data["plan"]) == {"ladders": {}}
    assert saved.same_boot("b1")
    assert not saved.same_boot("b2")
    (tmp_path / "state.json").write_text('{"status": {"pid": -3}, "boot_id": 7}')
    odd = read_saved_state(str(tmp_path))
    assert (odd.daemon_pid, odd.same_boot(None), odd.data["status"]) == (None, False, {"pid": -3})
    (tmp_path / "state.json").write_text("{not json")
    broken = read_saved_state(str(tmp_path))
    assert not broken.found
    assert broken.data == {}
    assert broken.problem is not None
    assert "is not a state file (malformed)" in broken.problem
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]  # left in place


def test_a_state_file_of_another_version_is_refused() -> None:
    from gpuwatchd.state.saved import STATE

    STATE.check({"version": 1})
    with pytest.raises(ValueError, match="unsupported state version 2"):
        STATE.check({"version": 2})
