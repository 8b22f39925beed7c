"""Wall clock steps, end to end (issue 34, findings 1 and 2): the real daemon, in a PID
namespace of its own (tests/support/simhost.py), runs under libfaketime, whose offset file
steps its wall clock while it runs (``FAKETIME_TIMESTAMP_FILE``, re-read at every call; the
monotonic and boot clocks are left alone). The real command line gives the spare and the
pause, unstepped, as an administrator's shell would.

A dead job's forked worker pins GPU 0 and is spared for 24 h (the default
``limits.max_spare``). The clock steps back two minutes (the spare file was deleted as
"ends later than limits.max_spare allows" and the worker killed), then forward two days (the
spare ended by itself): the worker lives and its spare file stays. A one-hour pause holds
while the clock steps forward two hours and back. A reload lowering ``limits.max_spare``
cuts the spare (``spare.cut``), never drops it. Cancelled and resumed, the worker is freed:
the daemon enforced all along.

The kill-cap latch too: two orphans of one user at a cap of one a poll latch that user into
dry-run for ``limits.kill_cap_latch``; stepped forward two hours, the wall clock lifted the
latch at once and the second orphan was killed; now it holds, and ``resume --clear-latches``
frees the orphan.
"""

from __future__ import annotations

import glob
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support.daemonrun import ORPHAN_RULE, Run, orphan_host
from tests.support.fakenvml import MiB, gpu, process
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)

FAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), None)

pytestmark = [
    needs_pid_namespace(),
    pytest.mark.skipif(
        FAKETIME is None, reason="needs libfaketime (Debian: apt-get install faketime)"
    ),
    pytest.mark.slow,
]

SETTLE = 1.5  # seconds after a step: several polls at the test host's 200 ms interval


def _spare_files(host: SimHost) -> list[str]:
    return sorted(p.name for p in host.state_dir.iterdir() if p.name.startswith("spare-"))


def _faketime(root: Path) -> tuple[dict[str, str], Callable[[str], None]]:
    """The daemon's environment under libfaketime, and a function that steps its wall clock
    to an offset from the real one (``+7200``, ``-120``) and lets a few polls pass."""
    offset = root / "faketime-offset"
    offset.write_text("+0\n")
    env = {
        "LD_PRELOAD": str(FAKETIME),
        "FAKETIME_TIMESTAMP_FILE": str(offset),
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }

    def step(to: str) -> None:
        offset.write_text(f"{to}\n")
        time.sleep(SETTLE)

    return env, step


def host_clock_steps(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    env, step = _faketime(root)

    with SimHost(root) as host:
        orphan_host(host)
        worker = host.pids["worker"]
        run = Run(host)
        config = str(run.config)
        spared = host.gpuwatchd(
            "spare", str(worker), "--for", "24h", "--reason", "debugging", "--config", config
        )
        out["spare_cli"] = (spared.returncode, spared.stderr)
        files = _spare_files(host)
        run.start(env=env)
        out["started"] = run.wait_for(lambda: run.saw(EventName.SPARE_STARTED), timeout=30)
        for name, to in (("back", "-120"), ("forward", "+172800")):
            step(to)
            out[name] = {
                "alive": host.alive(worker),
                "files_kept": _spare_files(host) == files,
                "ended": [
                    e.get("why") for e in run.events() if e.get("event") == EventName.SPARE_ENDED
                ],
            }
        step("+0")
        paused = host.gpuwatchd("pause", "--for", "1h", "--reason", "swap", "--config", config)
        out["pause_cli"] = paused.returncode
        out["paused"] = run.wait_for(lambda: run.saw(EventName.DAEMON_PAUSED), timeout=30)
        step("+7200")
        out["resumed_forward"] = run.saw(EventName.DAEMON_RESUMED)
        step("-600")
        out["resumed_back"] = run.saw(EventName.DAEMON_RESUMED)
        run.reload_with("50-short.yaml", "limits:\n  max_spare: 1h\n")
        run.wait_for(lambda: run.saw(EventName.SPARE_CUT), timeout=30)
        out["cut"] = [e for e in run.events() if e.get("event") == EventName.SPARE_CUT]
        out["alive_after_cut"] = host.alive(worker)
        out["files_after_cut"] = _spare_files(host)
        host.gpuwatchd("resume", "--config", config)
        host.gpuwatchd("spare", "--cancel", str(worker), "--config", config)
        run.wait_for(lambda: not host.alive(worker), timeout=30)
        out["alive_at_the_end"] = host.alive(worker)
        out["files"] = files
        # the daemon's wall clock did step
        out["stepped_back"] = run.saw(EventName.CLOCK_STEPPED_BACK)
        out["counts"] = {
            name: sum(1 for e in run.events() if e.get("event") == name)
            for name in (EventName.SPARE_STARTED, EventName.DAEMON_PAUSED)
        }
        run.stop()
    return out


def test_wall_clock_steps_neither_end_nor_drop_a_spare_or_a_pause(tmp_path: Path) -> None:
    r = run_in_pid_namespace(f"{__name__}:host_clock_steps", {}, root=tmp_path, timeout=180)
    assert r["spare_cli"][0] == 0, r["spare_cli"][1]
    assert r["started"] is True
    for name in ("back", "forward"):
        assert r[name] == {"alive": True, "files_kept": True, "ended": []}, name
    assert (r["pause_cli"], r["paused"]) == (0, True)
    assert r["resumed_forward"] is False
    assert r["resumed_back"] is False
    (cut,) = r["cut"]
    assert cut["max_spare"] == 3600
    assert 0 < cut["was_until"] - cut["until"] < 86400 - 3600 + 60
    assert r["alive_after_cut"] is True
    assert r["files_after_cut"] == r["files"]
    assert r["alive_at_the_end"] is False
    assert r["stepped_back"] is True
    # Said once each, not at every poll while the wall end moves: the spare once; the pause
    # when set and when each step moved its wall end.
    assert r["counts"][EventName.SPARE_STARTED] == 1
    assert r["counts"][EventName.DAEMON_PAUSED] <= 3


def host_latch_steps(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    env, step = _faketime(root)
    with SimHost(root) as host:
        first = host.script("worker-1", [{"sleep": 3600}])
        second = host.script("worker-2", [{"sleep": 3600}])
        host.spawn("trainer", [{"setsid": True}, {"open": host.cuda(0)}, {"fork": first},
                               {"fork": second}, {"exit": 0}])  # fmt: skip
        pids = host.wait_ready("trainer", "worker-1", "worker-2")
        host.wait_gone("trainer")
        host.nvml([gpu(0, allocated=700 * MiB, processes=[process(pids["trainer"], 700 * MiB)])])
        limits = {"post_action_delay": "0s", "max_signalled_per_poll": 1, "kill_cap_latch": "1h"}
        run = Run(host, rules=[ORPHAN_RULE], limits=limits)
        run.start(env=env)
        out["latched"] = run.wait_for(
            lambda: run.saw(EventName.LIMITS_KILL_CAP_REACHED), timeout=30
        )
        workers = [pids["worker-1"], pids["worker-2"]]
        run.wait_for(lambda: sum(host.alive(w) for w in workers) == 1, timeout=30)
        (held,) = [w for w in workers if host.alive(w)]
        for name, to in (("forward", "+7200"), ("back", "-600")):
            step(to)
            out[name] = {
                "alive": host.alive(held),
                "expired": run.saw(EventName.LIMITS_KILL_CAP_EXPIRED),
            }
        cleared = host.gpuwatchd("resume", "--clear-latches", "--config", str(run.config))
        out["clear_cli"] = cleared.returncode
        run.wait_for(lambda: not host.alive(held), timeout=30)
        out["alive_at_the_end"] = host.alive(held)
        run.stop()
    return out


def test_a_wall_clock_step_does_not_lift_a_kill_cap_latch(tmp_path: Path) -> None:
    r = run_in_pid_namespace(f"{__name__}:host_latch_steps", {}, root=tmp_path, timeout=180)
    assert r["latched"] is True
    assert r["forward"] == {"alive": True, "expired": False}
    assert r["back"] == {"alive": True, "expired": False}
    assert r["clear_cli"] == 0
    assert r["alive_at_the_end"] is False
