"""status: the daemon's saved state read without touching it, rendered, and an LSB exit code.

Rendering is tested from hand-written state dicts (the ``plan`` section comes from the real
``PlanState.to_json`` so the shape cannot drift) whose status document is worked out the way
the daemon writes it (:func:`tests.support.statusrig.with_document`), then rendered; the
exit
codes through ``main([...])`` with a temporary config whose ``state_dir`` and ``proc_root`` are
temporary folders.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd.cli.humantime import ago, duration, until
from gpuwatchd.cli.main import main
from gpuwatchd.cli.process_kind import look_at_process
from gpuwatchd.cli.status import STALE_MIN, StatusCode, describe
from gpuwatchd.cli.status_text import render_text
from gpuwatchd.core.vocabulary import EventName, LadderStatus, Level
from gpuwatchd.decide.plan.state import Ladder, PlanState
from gpuwatchd.decide.verdict import UNREADABLE
from gpuwatchd.state.directory import StateDir
from gpuwatchd.state.saved import StateStore, read_saved_state, signalled_last_hour
from tests.support.fakeproc import FakeProc
from tests.support.statusrig import (
    BOOT,
    LADDER,
    MONO,
    NOW,
    PID,
    POLICY,
    plan_json,
    run_describe,
    saved,
    with_document,
)

# --- the table: state → exit code, health, and what the text says ------------------------------


def _without_status(s: dict[str, object]) -> None:
    del s["status"]


def _without_times(s: dict[str, object]) -> None:
    s["status"] = {**s["status"], "last_poll": None, "started": None}  # type: ignore[dict-item]


def _edit(path: str, value: object) -> Callable[[dict[str, object]], None]:
    def edit(s: dict[str, object]) -> None:
        *parents, last = path.split(".")
        node = s
        for key in parents:
            node = node[key]  # type: ignore[assignment]
        node[last] = value

    return edit


CASES: list[tuple[str, Callable[[dict[str, object]], None] | None, dict[str, object], int, str]] = [
    ("running", None, {}, 0, "gpuwatchd is running: pid 4242, up 1d01h, last poll 2s ago"),
    ("dry-run", _edit("status.mode", "dry-run"), {}, 0, "mode:     dry-run (policy"),
    ("paused", _edit("plan.paused", True), {}, 0, "mode:     paused: actions hold until"),
    ("pid gone", None, {"process": "gone"}, 3, "not running: pid 4242 is not running"),
    ("pid reused", None, {"process": "other"}, 3, "pid 4242 is not gpuwatchd"),
    ("stale", _edit("status.last_poll", NOW - 600), {}, 3, "no poll for 10m (more than 2m)"),
    ("within a refresh", _edit("status.last_poll", NOW - 110), {}, 0, "last poll 1m50s ago"),
    (
        "earlier boot",
        None,
        {"boot_id": "another-boot", "process": "gone"},
        3,
        "written in an earlier boot",
    ),
    (
        "boot id differs, daemon alive and fresh (a sandbox reads another boot id)",
        None,
        {"boot_id": "another-boot"},
        0,
        "gpuwatchd is running: pid 4242",
    ),
    ("no status section", _without_status, {}, 3, "the state names no daemon PID"),
    ("no poll, long started", _edit("status.last_poll", None), {}, 3, "no poll for 1d01h"),
    ("no poll, no start", _without_times, {}, 3, "no time of a poll or of the start"),
    (
        "kill-cap latch",
        _edit("plan.forced_dry_run", True),
        {},
        1,
        "kill cap reached: dry-run forced; clear with `gpuwatchd resume --clear-latches`",
    ),
    (
        "latched for an unreadable state file",
        _edit("plan", plan_json(forced_dry_run=True, forced_reason=f"{UNREADABLE} (x)")),
        {},
        1,
        f"{UNREADABLE} (x): dry-run forced; clear with `gpuwatchd resume",
    ),
    (
        "breaker open",
        _edit("plan.circuit_open", True),
        {},
        1,
        "reset circuit breaker open after 0 failed reset(s); clear with `gpuwatchd resume",
    ),
    ("NVML wedged", _edit("status.nvml", {"state": "wedged", "error": None}), {}, 1, "wedged"),
    (
        "NVML unavailable",
        _edit("status.nvml", {"state": "unavailable", "error": "driver not loaded"}),
        {},
        1,
        "NVML unavailable: driver not loaded: no GPU is watched",
    ),
    (
        "policy rejected",
        _edit("status.policy_rejected", {"at": NOW - 60, "error": "p.yaml:3: unknown key"}),
        {},
        1,
        "policy files rejected (p.yaml:3: unknown key)",
    ),
]


@pytest.mark.parametrize(
    ("edit", "kw", "code", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_state_to_exit_code_and_text(
    edit: Callable[[dict[str, object]], None] | None, kw: dict[str, Any], code: int, text: str
) -> None:
    state = saved()
    if edit is not None:
        edit(state)
    result = run_describe(state, **kw)
    assert result["exit_code"] == code
    rendered = render_text(result)
    assert text in rendered, rendered
    assert json.loads(json.dumps(result, allow_nan=False)) == result


def test_not_running_still_shows_the_last_known_state_and_what_needs_attention() -> None:
    state = saved(plan=plan_json(forced_dry_run=True, forced_reason="more than 64 an hour"))
    result = run_describe(state, process="gone")
    assert result["exit_code"] == StatusCode.NOT_RUNNING
    assert result["attention"]
    text = render_text(result)
    assert "last known state:" in text
    assert "kill cap: LATCHED: dry-run forced" in text
    assert "mode:     dry-run, forced by the kill-cap latch; configured: enforcing" in text


def test_no_state_is_one_line_and_exit_3() -> None:
    result = run_describe(None, process=None)
    assert result["exit_code"] == 3
    assert result["state"] == "missing"
    assert render_text(result) == (
        "gpuwatchd is not running: no state in /nonexistent-state "
        "(never started here, or another state_dir)\n"
    )


def test_an_unreadable_state_is_exit_4_and_says_why() -> None:
    result = run_describe(None, process=None, read_error="cannot read x: permission denied")
    assert (result["exit_code"], result["health"], result["running"]) == (4, "unknown", None)
    assert render_text(result) == "gpuwatchd status unknown: cannot read x: permission denied\n"


def test_paused_names_the_reason_and_stays_healthy() -> None:
    result = run_describe(saved(plan=plan_json(paused=True, paused_reason="driver upgrade")))
    assert (result["exit_code"], result["effective_mode"]) == (0, "paused")
    assert "paused (driver upgrade): actions hold until `gpuwatchd resume`" in render_text(result)


def test_a_stuck_target_needs_attention() -> None:
    stuck = {**LADDER.__dict__, "status": LadderStatus.STUCK}
    plan = PlanState(boot_id=BOOT, ladders={LADDER.target: Ladder(**stuck)}).to_json()
    result = run_describe(saved(plan=plan))
    assert result["exit_code"] == 1
    text = render_text(result)
    assert "stuck in D state (pid 4250)" in text
    assert "ladders in progress: none" in text
    assert "pid 4250  rule orphans  GPU-1  step 1/2: stuck" in text


def test_before_its_first_poll_a_daemon_started_just_now_is_running() -> None:
    result = run_describe(saved(last_poll=None, started=NOW - 20))
    assert result["exit_code"] == 0
    assert render_text(result).startswith("gpuwatchd is running: pid 4242, up 20s\n")


def test_the_daemons_own_interval_sets_when_it_is_stale() -> None:
    assert run_describe(saved(last_poll=NOW - 200))["exit_code"] == 3
    slow = run_describe(saved(last_poll=NOW - 200, interval=60.0))
    assert slow["exit_code"] == 0
    assert slow["daemon"]["stale_after"] == 60 + 3 * 60 + 10  # a refresh, 3 polls, NVML
    # One no policy allows (over 1h) is not the daemon's: stale_after was Infinity, no JSON.
    odd = run_describe(saved(last_poll=NOW - 200, interval=1e308))
    assert (odd["exit_code"], odd["daemon"]["stale_after"]) == (3, STALE_MIN)


def test_a_reset_in_progress_counts_as_a_sign_of_life() -> None:
    state = saved(last_poll=NOW - 200)
    state["reset_in_progress"] = {"uuid": "GPU-1", "step": "reset", "since": NOW - 30}
    result = run_describe(state)
    assert result["exit_code"] == 0
    assert "in progress: GPU-1 at step reset, since 30s ago" in render_text(result)


def test_a_mig_instance_being_recreated_is_said_to_be_one() -> None:
    state = saved(last_poll=NOW - 5)
    state["reset_in_progress"] = {
        "uuid": "GPU-1", "step": "reset", "since": NOW - 3,
        "recovery": {"mig_uuid": "MIG-1", "gi": 2, "uuid": "GPU-1"},
    }  # fmt: skip
    result = run_describe(state)
    progress = result["resets"]["in_progress"]
    assert (progress["instance"], progress["gi"]) == ("MIG-1", 2)
    text = render_text(result)
    assert "in progress: re-creation of MIG GPU instance 2 of GPU-1 at step reset" in text


# --- ladders: monotonic deadlines shown as wall time only when that is reliable ----------------


def test_a_ladder_shows_step_next_signal_and_when_converted_by_the_daemon() -> None:
    result = run_describe(saved())
    assert result["clock"] == "daemon"
    (lad,) = result["ladders"]
    assert (lad["step"], lad["steps"], lad["next"], lad["due_in"]) == (1, 2, "SIGKILL", 25.0)
    assert "pid 4250  rule orphans  GPU-1  step 1/2: next SIGKILL in 25s" in render_text(result)


def test_the_daemons_own_clock_places_its_deadlines_whatever_the_readers_boot() -> None:
    # The daemon's clock read MONO + 100 when it wrote, 2 s ago: the ladder is 77 s overdue.
    result = run_describe(saved(), boot_id=None, written=(NOW - 2, MONO + 100))
    assert result["clock"] == "daemon"
    (lad,) = result["ladders"]
    assert lad["due_in"] == pytest.approx(25.0 - 100.0 - 2.0)
    assert "next SIGKILL now" in render_text(result)


def test_without_a_reliable_clock_a_ladder_is_due_without_a_time() -> None:
    result = run_describe(saved(), boot_id=None, written=(NOW, None))
    (lad,) = result["ladders"]
    assert lad["due_in"] is None
    assert "next SIGKILL due (time unknown)" in render_text(result)


def test_the_last_step_done_the_ladder_ends() -> None:
    last = Ladder(**{**LADDER.__dict__, "step": 2, "due": MONO + 600})
    result = run_describe(saved(plan=PlanState(ladders={last.target: last}).to_json()))
    assert "step 2/2: ends in 10m" in render_text(result)


def test_confirmation_windows_are_listed_with_their_time() -> None:
    plan = plan_json(waiting={"ghost_memory:GPU-2:gpu": MONO + 420, LADDER.finding_key: MONO})
    result = run_describe(saved(plan=plan))
    assert result["pending"] == [
        {
            "finding": "ghost_memory:GPU-2:gpu",
            "label": "ghost_memory GPU-2",
            "due": NOW + 420,
            "due_in": 420.0,
        }
    ]
    text = render_text(result)
    assert "  ghost_memory GPU-2: in 7m" in text  # in words, not the internal key
    assert "ghost_memory:GPU-2:gpu" not in text


def test_signals_in_the_last_hour_are_counted_against_the_cap() -> None:
    plan = plan_json(
        signal_history=[["a@1", MONO - 10], ["b@2", MONO - 3000], ["c@3", MONO - 4000]]
    )
    result = run_describe(saved(plan=plan))
    assert result["kill_cap"]["signalled_last_hour"] == 2
    assert "kill cap: not latched; 2 of 256 processes signalled in the last hour" in render_text(
        result
    )


@pytest.mark.parametrize(
    ("history", "now", "expected"),
    [
        ((("a@1", 10.0), ("b@2", 3000.0)), 3700.0, 1),  # typed, as the plan keeps it
        ([["a@1", 10.0], ["b@2", 3000.0], "junk"], 3700.0, 1),  # saved: a non-pair is skipped
        ([["a@1", "soon"]], 3605.0, None),  # a time unknown: the count is too
        ([["a@1", 10.0]], None, None),
        ({"a@1": 10.0}, 3605.0, None),
    ],
)
def test_signalled_last_hour_is_one_rule_for_saved_and_typed_histories(
    history: object, now: float | None, expected: int | None
) -> None:
    assert signalled_last_hour(history, now) == expected


def test_a_users_kill_cap_latch_is_shown_and_needs_attention() -> None:
    plan = plan_json(scope_latches={"uid:1001": {"reason": "more than 16", "since": NOW - 60}})
    result = run_describe(saved(plan=plan))
    assert result["kill_cap"]["users_latched"] == ["uid:1001"]
    text = render_text(result)
    assert "latched for uid:1001" in text
    assert "kill cap reached for uid:1001" in text


# --- actions and resets -------------------------------------------------------------------------


def test_recent_actions_read_as_sentences_newest_last_at_most_20() -> None:
    actions = [
        {"at": NOW - 100 + i, "event": EventName.HOOK_RUN, "outcome": f"exit {i}", "dry_run": True}
        for i in range(25)
    ]
    actions[-1]["hook"] = "on_failure"
    actions.append(
        {"at": NOW - 60, "event": EventName.RESET_OUTCOME, "gpu": "GPU-2", "outcome": "success"}
    )
    result = run_describe(saved(recent_actions=actions))
    assert len(result["recent_actions"]) == 20
    text = render_text(result)
    assert "  1m ago: GPU-2 was reset." in text
    assert "exit 23" not in text
    assert "Dry run: would run the on_failure hook" in text  # the catalogue's sentences
    assert text.count("Dry run: would run the a hook") == 18
    assert "  5s ago: Sent SIGTERM to PID 4250 on GPU-1." in render_text(run_describe(saved()))


def test_a_recent_action_reads_as_the_catalogues_sentence_the_daemon_kept() -> None:
    action = {
        "at": NOW - 5,
        "event": EventName.ACTION_SIGNAL,
        "sentence": "Sent SIGKILL to PID 9 (x).",
    }
    text = render_text(run_describe(saved(recent_actions=[action])))
    assert "  5s ago: Sent SIGKILL to PID 9 (x).\n" in text


def test_reset_history_cooldown_and_window_limit() -> None:
    plan = plan_json(
        last_reset={"GPU-2": NOW - 600},
        reset_history=[["GPU-2", NOW - 600], ["GPU-2", NOW - 2 * 86400]],
    )
    result = run_describe(saved(plan=plan))
    (gpu,) = result["resets"]["gpus"]
    assert gpu["cooldown_left"] == 3000.0
    assert gpu["in_window"] == 1
    assert gpu["limit_left"] == 86400.0 - 600
    text = render_text(result)
    assert "resets (cooldown 1h):" in text
    assert "1 of 1 in the last 1d; cooldown ends in 50m; limit lifts in 23h50m" in text
    assert "earlier: " in text


def test_in_dry_run_a_dry_run_reset_starts_the_cooldown_too() -> None:
    plan = plan_json(last_dry_reset={"GPU-3": NOW - 60})
    enforcing = run_describe(saved(plan=plan))
    dry = run_describe(saved(plan=plan, mode="dry-run"))
    assert enforcing["resets"]["gpus"][0]["cooldown_left"] is None
    assert dry["resets"]["gpus"][0]["cooldown_left"] == 3540.0


# --- malformed and hostile state: unknown, never a traceback ------------------------------------


MALFORMED: list[tuple[str, object]] = [
    ("status", "x"),
    ("status.pid", "4242"),
    ("status.pid", True),
    ("status.pid", -1),
    ("status.started", "yesterday"),
    ("status.mode", "turbo"),
    ("status.dry_run", "no"),
    ("status.nvml", 5),
    ("status.nvml", {"state": "melted", "error": 3}),
    ("status.gpus", -2),
    ("status.policy", "p.yaml"),
    ("status.policy_rejected", "yes"),
    ("status.recent_actions", {"a": 1}),
    ("status.recent_actions", [1, None, {"at": "x", "event": 5, "pid": "7"}]),
    ("plan", []),
    ("plan.ladders", {"x": 3}),
    ("plan.ladders", {"x": {"steps": "SIGTERM", "step": 9, "due": "soon", "status": "odd"}}),
    ("plan.ladders", {"x": {"steps": [[None, 1], 5], "step": 1, "status": "active"}}),
    ("plan.signal_history", [["a", "x"], 3]),
    ("plan.reset_history", [[1, 2], ["GPU-1"], "z", ["GPU-1", 1e300]]),
    ("plan.last_reset", {"GPU-1": "then"}),
    ("plan.waiting", [1]),
    ("plan.forced_dry_run", "true"),
    ("plan.paused", 1),
    ("reset_in_progress", {"uuid": 5, "since": "now"}),
    ("saved_at", "x"),
    ("boot_id", 7),
]
DOCUMENT_MALFORMED: list[tuple[str, object]] = [
    ("status.document", "x"),
    ("status.document.format", 99),
    ("status.document.mode", "turbo"),
    ("status.document.kill_cap", [1]),
    ("status.document.kill_cap.users_latched", "uid:1"),
    ("status.document.nvml", {"state": "melted", "since": "then"}),
    ("status.document.verdict", {"gpus": [3, {"index": "0", "state": "shiny"}]}),
    ("status.document.policy", {"files": "p.yaml", "rejected": 4}),
    ("status.document.ladders", [{"step": -1, "due": "soon", "status": "odd"}, 5]),
    ("status.document.pending", {"a": 1}),
    ("status.document.recent_actions", [1, {"at": "x", "sentence": 5}]),
    ("status.document.resets", {"gpus": [{"cooldown_ends": "x", "history": 3}], "window": "1d"}),
    ("status.document.attention", [1, None, "ok"]),
    ("status.document.spares", [{"target": 4}, "x"]),
]


@pytest.mark.parametrize(("path", "value"), MALFORMED, ids=[f"{p}={v!r}" for p, v in MALFORMED])
def test_a_malformed_field_is_unknown_never_a_traceback(path: str, value: object) -> None:
    state = saved(plan=plan_json(last_reset={"GPU-1": NOW - 5}))
    _edit(path, value)(state)
    result = run_describe(state)
    assert result["exit_code"] in (0, 1, 3)
    json.dumps(result, allow_nan=False)
    text = render_text(result)
    assert "Traceback" not in text


@pytest.mark.parametrize(
    ("path", "value"), DOCUMENT_MALFORMED, ids=[f"{p}={v!r}" for p, v in DOCUMENT_MALFORMED]
)
def test_a_malformed_document_value_is_unknown_never_a_traceback(path: str, value: object) -> None:
    state = with_document(
        saved(plan=plan_json(last_reset={"GPU-1": NOW - 5})),
        policy=POLICY,
        wall=NOW,
        monotonic=MONO,
    )
    _edit(path, value)(state)
    result = run_describe(state, written=None)
    assert result["exit_code"] in (0, 1)
    json.dumps(result, allow_nan=False)
    render_text(result)


def test_a_state_written_before_the_status_document_is_shown_by_the_daemons_builder() -> None:
    """An upgraded node whose daemon still runs the old code saved no document: ``status``
    works it out with the daemon's own builder, its deadlines through the local clock in the
    same boot (or the daemon's clock pair when it saved one), and says there is no document."""
    old = saved(plan=plan_json(forced_dry_run=True))
    result = run_describe(old, written=None)
    assert result["document"] is None
    assert result["clock"] == "local"
    assert result["exit_code"] == StatusCode.ATTENTION
    assert result["kill_cap"]["latched"] is True
    assert result == {**run_describe(old), "clock": "local", "document": None}
    (lad,) = result["ladders"]
    assert lad["due_in"] == 25.0
    paired = run_describe(saved(monotonic=MONO + 100), boot_id=None, written=None)
    assert paired["clock"] == "daemon"
    assert paired["ladders"][0]["due_in"] == pytest.approx(25.0 - 100.0 - 2.0)
    unplaced = run_describe(saved(), boot_id=None, written=None)
    assert unplaced["clock"] is None
    assert "next SIGKILL due (time unknown)" in render_text(unplaced)


def test_unknown_values_print_as_unknown() -> None:
    state = saved(nvml={"state": "melted"}, gpus="eight", mode=None, dry_run=None, policy=3)
    text = render_text(run_describe(state))
    assert "mode:     unknown" in text
    assert "NVML:     unknown; unknown GPUs; 1 finding" in text
    assert "policy:   unknown" in text


def test_text_from_the_state_is_escaped() -> None:
    latch = {"user:ev\x1bil": {"reason": "more than 16", "since": NOW - 60}}  # /etc/subuid's
    plan = plan_json(paused=True, paused_reason="maint\n\x1b[2Jfake line", scope_latches=latch)
    text = render_text(run_describe(saved(plan=plan)))
    assert "\x1b" not in text
    assert "maint\\n\\x1b[2Jfake line" in text
    assert "latched for user:ev\\x1bil\n" in text


def _mutations() -> st.SearchStrategy[object]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False),
        st.text(max_size=8),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.sampled_from(["uuid", "at", "steps", "due", "x"]), inner),
        ),
        max_leaves=8,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_one_value_changed_still_renders(data: st.DataObject) -> None:
    state = saved(
        plan=plan_json(reset_history=[["GPU-1", NOW - 5]], signal_history=[["a@1", MONO]])
    )
    state["reset_in_progress"] = {"uuid": "GPU-1", "step": "reset", "since": NOW}
    state = with_document(state, policy=POLICY, wall=NOW, monotonic=MONO)  # mutated too
    node: object = state
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        child = node[data.draw(st.sampled_from(keys))]
        if not isinstance(child, (dict, list)) or not child:
            break
        node = child
    if isinstance(node, (dict, list)) and node:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        node[data.draw(st.sampled_from(keys))] = data.draw(_mutations())
    result = run_describe(copy.deepcopy(state), written=None)
    json.dumps(result, allow_nan=False)
    render_text(result)


# --- human times -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.5, "0.5s"),
        (42, "42s"),
        (60, "1m"),
        (90, "1m30s"),
        (593.405, "9m53s"),
        (3600, "1h"),
        (3720, "1h02m"),
        (86400, "1d"),
        (183600, "2d03h"),
        (-1, "?"),
        (float("nan"), "?"),
        ("5", "?"),
        (True, "?"),
    ],
)
def test_duration(seconds: object, text: str) -> None:
    assert duration(seconds) == text


def test_until_and_ago() -> None:
    assert until(593.405) == "in 9m53s"
    assert until(0.4) == "now"
    assert until(-30) == "now"
    assert ago(192.5) == "3m12s ago"
    assert ago(0.2) == "just now"
    assert ago(-120).startswith("2m in the future")
    assert until(None) == ago(None) == "?"


# --- the edge: reading the state and /proc, and the exit codes through main() -----------------


def _write_proc(root: Path, pid: int, *, comm: str, argv: list[str], state: str = "S") -> None:
    entry = root / str(pid)
    entry.mkdir(parents=True)
    (entry / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1\n")
    (entry / "comm").write_text(comm + "\n")
    (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (entry / "status").write_text(f"Name:\t{comm}\nUid:\t0\t0\t0\t0\n")  # root's


@pytest.fixture
def host(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(config, state_dir, proc_root) with a daemon process entry for PID."""
    state_dir, proc = tmp_path / "state", tmp_path / "proc"
    state_dir.mkdir(mode=0o700)
    _write_proc(proc, PID, comm="gpuwatchd", argv=["/usr/bin/python3", "/usr/bin/gpuwatchd", "run"])
    (proc / "sys/kernel/random").mkdir(parents=True)
    (proc / "sys/kernel/random/boot_id").write_text(BOOT + "\n")
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(f"state_dir: {state_dir}\nproc_root: {proc}\ninterval: 5s\n")
    return config, state_dir, proc


def _save(state_dir: Path, state: dict[str, object]) -> None:
    status = state.get("status")
    if isinstance(status, dict):  # times against the real clock: the command reads it
        status["last_poll"] = time.time() - 1
        status["started"] = time.time() - 100
    state = with_document(state, policy=POLICY, wall=time.time(), monotonic=time.monotonic())
    StateStore(str(state_dir)).save(state)


def _listing(folder: Path) -> list[tuple[str, float, int]]:
    return sorted((p.name, p.stat().st_mtime, p.stat().st_size) for p in folder.iterdir())


@pytest.mark.parametrize(
    ("plan", "code"),
    [({}, 0), ({"forced_dry_run": True}, 1), ({"circuit_open": True, "reset_failures": 2}, 1)],
)
def test_exit_code_through_main_changes_nothing_in_state_dir(
    host: tuple[Path, Path, Path],
    plan: dict[str, object],
    code: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config, state_dir, _ = host
    _save(state_dir, saved(plan=plan_json(**plan)))
    before = _listing(state_dir)
    assert main(["status", "--config", str(config)]) == code
    assert "gpuwatchd is running: pid 4242" in capsys.readouterr().out
    assert main(["status", "--config", str(config), "--json"]) == code
    document = json.loads(capsys.readouterr().out)
    assert document["exit_code"] == code
    assert document["daemon"]["process"] == "gpuwatchd"
    assert _listing(state_dir) == before  # no lock file, no write, nothing moved


def test_exit_3_when_there_is_no_state_or_the_pid_is_gone(
    host: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config, state_dir, proc = host
    assert main(["status", "--config", str(config)]) == 3
    assert "no state in" in capsys.readouterr().out
    assert not (state_dir / "lock").exists()
    _save(state_dir, saved())
    (proc / str(PID) / "stat").write_text(f"{PID} (gpuwatchd) Z 1 1 1 0 -1\n")
    assert main(["status", "--config", str(config)]) == 3  # a zombie: exited, not reaped
    assert "pid 4242 is not running" in capsys.readouterr().out


def test_exit_3_when_the_pid_was_reused_by_another_program(host: tuple[Path, Path, Path]) -> None:
    config, state_dir, proc = host
    _save(state_dir, saved(pid=4243))
    _write_proc(proc, 4243, comm="python3", argv=["python3", "train.py"])
    assert main(["status", "--config", str(config)]) == 3


def test_the_boot_is_compared_with_the_boot_id_under_proc_root(
    host: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """status reads ``sys/kernel/random/boot_id`` under the policy's proc_root; unreadable: None."""
    config, state_dir, proc = host
    _save(state_dir, saved())
    boot_file = proc / "sys/kernel/random/boot_id"
    for content, same_boot in ((BOOT + "\n", True), ("another-boot\n", False), (None, None)):
        if content is None:
            boot_file.unlink()
        else:
            boot_file.write_text(content)
        main(["status", "--config", str(config), "--json"])
        assert json.loads(capsys.readouterr().out)["daemon"]["same_boot"] is same_boot


def test_exit_4_when_the_state_is_malformed(
    host: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config, state_dir, _ = host
    (state_dir / "state.json").write_text("{not json")
    assert main(["status", "--config", str(config)]) == 4
    assert "is not a state file" in capsys.readouterr().out
    assert (state_dir / "state.json").read_text() == "{not json"  # left for the daemon


def test_exit_4_when_the_state_cannot_be_read(
    host: tuple[Path, Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config, _, _ = host

    def denied(*args: object, **kwargs: object) -> bytes:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(StateDir, "read", denied)
    assert main(["status", "--config", str(config)]) == 4
    assert "permission denied (run as root)" in capsys.readouterr().out


# Root reads a mode-000 folder anyway: as root, the command runs with every capability dropped.
CAPLESS = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
READ_THEN_STATUS = """import sys
from gpuwatchd.cli.main import main
from gpuwatchd.state.saved import read_saved_state
sys.exit(5 if read_saved_state(sys.argv[1]).problem is None else main(sys.argv[2:]))"""


@pytest.mark.skipif(CAPLESS != [] and shutil.which("setpriv") is None, reason="needs setpriv")
def test_exit_4_for_a_state_dir_this_user_cannot_read(host: tuple[Path, Path, Path]) -> None:
    config, state_dir, _ = host
    _save(state_dir, saved())
    state_dir.chmod(0)
    try:
        argv = [sys.executable, "-c", READ_THEN_STATUS, str(state_dir), "status", "--config"]
        result = subprocess.run([*CAPLESS, *argv, str(config)], capture_output=True, check=False)
    finally:
        state_dir.chmod(0o700)
    assert result.returncode == 4, result.stderr


def test_a_bad_config_is_exit_78(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("intervall: 5s\n")
    assert main(["status", "--config", str(config)]) == 78


def test_look_at_process_on_real_processes(tmp_path: Path) -> None:
    assert look_at_process("/proc", os.getpid()) == "other"  # `status` itself
    named = subprocess.Popen(["bash", "-c", "exec -a gpuwatchd sleep 30"])
    plain = subprocess.Popen(["sleep", "30"])
    done = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while look_at_process("/proc", named.pid) != "gpuwatchd" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert look_at_process("/proc", named.pid) == "gpuwatchd"
        assert look_at_process("/proc", plain.pid) == "other"
        while look_at_process("/proc", done.pid) != "gone" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert look_at_process("/proc", done.pid) == "gone"  # a zombie until waited for
    finally:
        for child in (named, plain):
            child.kill()
            child.wait()
        done.wait()
    assert look_at_process("/proc", done.pid) == "gone"
    assert look_at_process(str(tmp_path), 99) == "gone"


@pytest.mark.parametrize(
    ("uid", "comm", "cmdline", "kind"),
    [
        (0, "gpuwatchd", None, "gpuwatchd"),
        (os.geteuid(), "python3", ["python3", "/usr/bin/gpuwatchd", "run"], "gpuwatchd"),
        (os.geteuid() + 1, "gpuwatchd", None, "other"),  # prctl(PR_SET_NAME) by another user
        (os.geteuid() + 1, "python3", ["python3", "-m", "gpuwatchd", "run"], "other"),
        (None, "gpuwatchd", None, "unknown"),  # its uid unread: not known to be the daemon
    ],
)
def test_a_process_going_by_gpuwatchd_is_the_daemon_only_if_root_or_this_user_runs_it(
    tmp_path: Path, uid: int | None, comm: str, cmdline: list[str] | None, kind: str
) -> None:
    """Any user may name a process gpuwatchd (comm, argv): status would call it the running
    daemon at a reused PID, and a run --once waiting for the daemon would wait on it."""
    fake = FakeProc(tmp_path)
    base = fake.add(4242, comm=comm, cmdline=cmdline, uid=0 if uid is None else uid)
    if uid is None:
        (base / "status").write_text("Name:\tgpuwatchd\n")
    assert look_at_process(str(tmp_path), 4242) == kind


def test_what_the_daemon_writes_is_what_status_reads(tmp_path: Path) -> None:
    """The contract with daemon.py: a real Daemon's saved state, described (no poll needed)."""
    import dataclasses

    from gpuwatchd.collect.procfs import ProcFS
    from gpuwatchd.config.schema import default_policy
    from gpuwatchd.daemon.lifecycle import Daemon

    config = tmp_path / "gpuwatchd.yaml"
    config.write_text("dry_run: true\n")
    policy = dataclasses.replace(default_policy(), state_dir=str(tmp_path / "state"), dry_run=True)
    daemon = Daemon(policy, config_path=str(config))
    daemon.engine.sink.emit(
        EventName.ACTION_SIGNAL,
        Level.INFO,
        {"pid": 77, "signal": "SIGTERM", "outcome": "dry_run", "gpu": "GPU-1", "dry_run": True},
    )
    daemon.save_state()

    def described() -> dict[str, Any]:
        saved = read_saved_state(policy.state_dir)
        assert saved.problem is None
        return describe(
            dict(saved.data) if saved.found else None,
            policy=policy,
            now_wall=time.time(),
            now_monotonic=time.monotonic(),
            boot_id=ProcFS("/proc").boot_id(),
            process="gpuwatchd",
        )

    result = described()
    assert (result["exit_code"], result["mode"], result["daemon"]["pid"]) == (
        0,
        "dry-run",
        os.getpid(),
    )
    assert result["clock"] in ("daemon", "local")
    assert "Dry run: would send SIGTERM to PID 77 on GPU-1." in render_text(result)
    assert (
        result["recent_actions"][0]["sentence"] == "Dry run: would send SIGTERM to PID 77 on GPU-1."
    )
    config.write_text("dry_run: maybe\n")
    daemon._do_reload()
    daemon.save_state()
    result = described()
    assert result["exit_code"] == 1
    assert "policy files rejected" in render_text(result)


def test_every_field_of_status_json_is_documented() -> None:
    """docs/operations.md's table names each top-level field and each field of the ladders,
    pending windows, recent actions and resets (STATUS_FORMAT's shape)."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    section = docs[docs.index("## 10. Status") : docs.index("## 11.")]
    plan = plan_json(waiting={"ghost_memory:GPU-2:gpu": MONO + 60}, last_reset={"GPU-2": NOW})
    result = run_describe(saved(plan=plan))
    rows = {
        "": result,
        "ladders": result["ladders"][0],
        "pending": result["pending"][0],
        "recent_actions": result["recent_actions"][0],
        "resets": result["resets"],
        "resets.gpus": result["resets"]["gpus"][0],
    }
    for where, row in rows.items():
        for key in row:
            named = f"`{key}`" in section or re.search(rf"[{{ ]{key}[,}}:]", section)
            assert named, f"status --json {where}.{key} is not in docs/operations.md"
