"""The administrator's timed switches of a rollout week: ``pause --for`` that ends by itself,
``resume --reason``, ``spare PID|job:ID`` honoured by every signal decision and ended by
itself, and NVML's availability as a state whose return is an event."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from gpuwatchd.cli.main import main
from gpuwatchd.cli.status import describe
from gpuwatchd.cli.status_text import render_text
from gpuwatchd.config.schema import default_policy
from gpuwatchd.decide.nvml_state import NvmlAvailability, next_availability
from gpuwatchd.decide.plan import plan, set_paused
from gpuwatchd.decide.plan_state import PlanState
from gpuwatchd.decide.spares import spare_changes, spare_reason
from gpuwatchd.decide.targets import refusal
from gpuwatchd.model import CgroupInfo, NvmlReading, Spare
from gpuwatchd.pause import PAUSE_FILE, RESUMED_FILE, note_resume, poll_pause, set_pause
from gpuwatchd.spares import cancel_spare, parse_target, read_spares, write_spare
from gpuwatchd.statedir import StateDir
from gpuwatchd.status_document import with_document
from gpuwatchd.vocabulary import EventName
from tests.support.plancases import orphan, policy, proc, signals, snap

NOW = 1_800_000_000.0
DAY = 86400.0


@pytest.fixture
def state(tmp_path: Path) -> Iterator[StateDir]:
    with StateDir.open(str(tmp_path)) as directory:
        yield directory


# --- pause --for ------------------------------------------------------------------------------


def test_a_timed_pause_holds_until_its_end_then_is_removed_and_said_to_have_ended(
    state: StateDir, tmp_path: Path
) -> None:
    set_pause(state, reason="driver upgrade", until=NOW + 3600)
    now = poll_pause(state, NOW + 3599, max_pause=DAY)
    assert (now.reason, now.until, now.resumed) == ("driver upgrade", NOW + 3600, None)
    ended = poll_pause(state, NOW + 3600, max_pause=DAY)
    assert ended.reason is None
    assert ended.resumed is not None
    assert "ended by itself" in ended.resumed
    assert not (tmp_path / PAUSE_FILE).exists()


def test_a_pause_without_an_end_lasts_max_pause_from_when_it_was_set(state: StateDir) -> None:
    """A pause file from before pauses had an end (or hand-made) still ends: a forgotten
    pause never disables the node for good."""
    state.write(PAUSE_FILE, json.dumps({"reason": "old", "since": NOW}).encode())
    assert poll_pause(state, NOW + 100, max_pause=3600).until == NOW + 3600
    assert poll_pause(state, NOW + 3600, max_pause=3600).reason is None


def test_an_unreadable_pause_file_stays_paused_without_an_end(
    state: StateDir, tmp_path: Path
) -> None:
    os.mkfifo(tmp_path / PAUSE_FILE)
    now = poll_pause(state, NOW + 10 * DAY, max_pause=DAY)
    assert now.reason == "pause file unreadable"
    assert now.until is None


def test_resume_reason_is_said_once_and_then_consumed(state: StateDir, tmp_path: Path) -> None:
    note_resume(state, "upgrade done")
    assert poll_pause(state, NOW, max_pause=DAY).resumed == "gpuwatchd resume: upgrade done"
    assert not (tmp_path / RESUMED_FILE).exists()
    assert poll_pause(state, NOW, max_pause=DAY).resumed == "gpuwatchd resume"


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
    assert 1790 < saved["until"] - saved["since"] <= 1800


def _written(saved: Mapping[str, object]) -> dict[str, object]:
    """``saved`` with the status document the daemon would write at NOW."""
    return with_document(saved, policy=default_policy(), wall=NOW, monotonic=None)


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
    spare: Spare, process: object, spared: bool
) -> None:
    assert (spare_reason(process, (spare,), NOW) is not None) is spared  # type: ignore[arg-type]


def test_a_job_spare_excuses_no_process_whose_cgroup_is_unknown() -> None:
    unknown = dataclasses.replace(proc(7, 1), cgroup=None)
    spare = _spare(target="job:slurm:42", job="slurm:42")
    why = spare_reason(unknown, (spare,), NOW)
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


@pytest.mark.parametrize("text", ["0", "1", "abc", "job:", "job:42;rm", "pid:12", "job:nope:1"])
def test_bad_spare_targets_are_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="spare"):
        parse_target(text)


def test_spare_files_round_trip_and_end_by_themselves(state: StateDir, tmp_path: Path) -> None:
    write_spare(
        state, "pid:1000", until=NOW + 60, reason="r", pid=1000, start_ticks=5, boot_id="b1"
    )
    write_spare(state, "job:slurm:42", until=NOW + 120, reason="bench", job="slurm:42")
    this_boot = time.time() - 3600  # the spares were given in this boot...
    found = read_spares(state, NOW, boot_wall=this_boot, max_spare=DAY, remove_stale=True)
    assert [s.target for s in found.spares] == ["pid:1000", "job:slurm:42"]
    assert found.spares[0].start_ticks == 5
    assert found.problems == ()
    # Another boot: the process spare names nobody now, and is removed; the job's stays.
    later_boot = time.time() + 3600  # ...and before a later one
    other = read_spares(state, NOW, boot_wall=later_boot, max_spare=DAY, remove_stale=True)
    assert [s.target for s in other.spares] == ["job:slurm:42"]
    assert any("another boot" in p for p in other.problems)
    # Its time up: gone, and removed.
    assert (
        read_spares(state, NOW + 120, boot_wall=None, max_spare=DAY, remove_stale=True).spares == ()
    )
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("spare-")] == []
    write_spare(state, "job:slurm:7", until=NOW + 60, reason="", job="slurm:7")
    assert cancel_spare(state, "job:slurm:7")
    assert not cancel_spare(state, "job:slurm:7")


def test_hostile_spare_files_are_ignored_and_named(state: StateDir, tmp_path: Path) -> None:
    write_spare(state, "job:slurm:42", until=NOW + 10 * DAY, reason="forever", job="slurm:42")
    name = next(p.name for p in tmp_path.iterdir() if p.name.startswith("spare-"))
    (tmp_path / "spare-0000").write_text(json.dumps({"target": "job:slurm:1", "until": NOW + 9}))
    (tmp_path / "spare-link").symlink_to("/etc/passwd")
    found = read_spares(state, NOW, boot_wall=None, max_spare=DAY, remove_stale=True)
    assert found.spares == ()
    text = " ".join(found.problems)
    assert f"{name}: ends later than limits.max_spare" in text
    assert "spare-0000: the file name does not match" in text
    assert "spare-link" in text
    # Bad files are removed (the link itself, never what it points at).
    assert not (tmp_path / "spare-link").is_symlink()
    assert os.path.exists("/etc/passwd")
    assert not (tmp_path / name).exists()


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


def test_status_lists_the_daemons_spares() -> None:
    saved = {
        "plan": PlanState().to_json(),
        "status": {
            "pid": 1,
            "last_poll": NOW,
            "spares": [{"target": "job:slurm:42", "until": NOW + 120, "reason": "bench"}],
        },
    }
    result = describe(_written(saved), policy=default_policy(), now_wall=NOW)
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
    saved = {
        "plan": PlanState().to_json(),
        "status": {
            "pid": 1,
            "last_poll": NOW,
            "nvml": {"state": "wedged", "since": NOW - 30, "error": "hung"},
        },
    }
    result = describe(_written(saved), policy=default_policy(), now_wall=NOW)
    assert result["nvml"] == {"state": "wedged", "error": "hung", "since": NOW - 30}
    assert "NVML:     wedged since" in render_text(result)
    assert "30s ago" in render_text(result)
