"""The rollout week, end to end, in a PID namespace of its own (tests/support/simhost.py): the
real daemon, the real command line and the Slurm scripts against a fake ``scontrol``.

One daemon plays what docs/operations.md ("Roll out in dry-run first") tells an administrator
to do, in order:

1. dry-run: a dead job's forked worker pins GPU 0; the daemon only says what it would do,
   the epilog neither waits nor drains and reports the drain it would have made;
2. a spare of that worker (``spare PID --for``) and a timed pause (``pause --for``), then
   the switch to enforcing (a drop-in and SIGHUP): nothing is signalled while paused; the
   pause ends by itself; the worker is left alone while spared; when the spare ends it is
   freed;
3. NVML wedged and back: ``status`` says "wedged" (exit 1) from the first failed reading,
   and ``nvml.recovered`` marks the return with how long it was gone.

The container test (tests/system/test_systemd_slurm.py, ``test_the_rollout_week``) plays the same
week with the installed package, systemd, journald and real Slurm.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support.daemonrun import Run, orphan_host
from tests.support.fakenvml import gpu
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)
from tests.support.slurmfake import NODE, Slurm

pytestmark = [needs_pid_namespace(), pytest.mark.slow]

PAUSE_FOR = 6.0  # seconds
SPARE_FOR = 14.0  # seconds, from the same moment: the spare outlasts the pause
HANG = {"nvmlDeviceGetComputeRunningProcesses_v3": 3600.0}


def _status(host: SimHost, config: Path) -> tuple[int, dict[str, Any]]:
    result = host.gpuwatchd("status", "--json", "--config", str(config))
    return result.returncode, json.loads(result.stdout)


def _index(run: Run, event: str, **fields: Any) -> int | None:
    for i, entry in enumerate(run.events()):
        if entry.get("event") == event and all(entry.get(k) == v for k, v in fields.items()):
            return i
    return None


def host_rollout_week(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with SimHost(root, gpus=2) as host:
        orphan_host(host)
        worker = host.pids["worker"]
        trainer = host.pids["trainer"]
        run = Run(host, dry_run=True, nvml_timeout="1s")
        slurm = Slurm(host, run.config)
        run.start()
        assert run.wait_for(lambda: run.saw(EventName.DAEMON_START), timeout=30)

        # 1. dry-run: the would-be signals, and the epilog's would-be drain.
        run.wait_for(
            lambda: run.saw(EventName.ACTION_SIGNAL, pid=worker, outcome="dry_run"), timeout=30
        )
        out["dry_signal"] = run.saw(EventName.ACTION_SIGNAL, pid=worker, outcome="dry_run")
        out["epilog"] = slurm.script("epilog", "0", timeout="30s", job="4711")
        out["would_drain"] = slurm.would_drain()
        out["alive_after_dry_run"] = host.alive(worker)

        # 2. spare the worker, pause, then enforce.
        given = time.monotonic()
        spared = host.gpuwatchd(
            "spare", str(worker), "--for", f"{SPARE_FOR:g}s", "--reason", "owner looks",
            "--config", str(run.config),
        )  # fmt: skip
        paused = host.gpuwatchd(
            "pause", "--for", f"{PAUSE_FOR:g}s", "--reason", "switching to enforce",
            "--config", str(run.config),
        )  # fmt: skip
        out["spare_cli"], out["pause_cli"] = spared.returncode, paused.returncode
        run.wait_for(
            lambda: run.saw(EventName.SPARE_STARTED) and run.saw(EventName.DAEMON_PAUSED),
            timeout=30,
        )

        def paused_and_spared() -> bool:  # logged as the poll takes them; saved at its end
            out["status_paused"] = _status(host, run.config)
            shown = out["status_paused"][1]
            return bool(shown.get("effective_mode") == "paused" and shown.get("spares"))

        run.wait_for(paused_and_spared, timeout=30)
        run.reload_with("50-enforce.yaml", "dry_run: false\n")
        run.wait_for(lambda: run.saw(EventName.CONFIG_RELOADED, dry_run=False), timeout=30)
        run.wait_for(lambda: run.saw(EventName.DAEMON_RESUMED), timeout=30)
        out["resumed_after"] = time.monotonic() - given
        out["alive_after_pause"] = host.alive(worker)
        run.wait_for(lambda: run.saw(EventName.SPARE_ENDED), timeout=30)
        out["spare_ended_after"] = time.monotonic() - given
        run.wait_for(lambda: not host.alive(worker), timeout=30)
        out["alive_at_the_end"] = host.alive(worker)
        # action.signal is logged once the kill has returned: the worker may be gone first.
        run.wait_for(
            lambda: run.saw(EventName.ACTION_SIGNAL, pid=worker, outcome="delivered"), timeout=10
        )
        out["order"] = {
            "paused": _index(run, EventName.DAEMON_PAUSED),
            "resumed": _index(run, EventName.DAEMON_RESUMED),
            "spare_started": _index(run, EventName.SPARE_STARTED),
            "spare_ended": _index(run, EventName.SPARE_ENDED),
            "delivered": _index(run, EventName.ACTION_SIGNAL, pid=worker, outcome="delivered"),
        }
        out["spare_refusals"] = [
            e.get("why")
            for e in run.events()
            if e.get("event") == EventName.ACTION_REFUSED
            and str(e.get("why", "")).startswith("spare:")
        ]

        # 3. NVML wedged, then back.
        host.nvml([gpu(0, delays=HANG), gpu(1)])
        wedged_at = time.monotonic()
        seen: list[tuple[int, dict[str, Any]]] = []

        def wedged() -> bool:
            seen.append(_status(host, run.config))
            return bool(seen[-1][1].get("nvml", {}).get("state") == "wedged")

        run.wait_for(wedged, timeout=30)
        out["status_wedged"] = seen[-1]
        out["wedged_seen_after"] = time.monotonic() - wedged_at
        host.nvml([gpu(0), gpu(1)])
        run.wait_for(lambda: run.saw(EventName.NVML_RECOVERED), timeout=60)
        out["recovered"] = [e for e in run.events() if e.get("event") == EventName.NVML_RECOVERED]

        def back() -> bool:  # nvml.recovered is logged in the poll that saves it at its end
            out["status_back"] = _status(host, run.config)
            return bool(out["status_back"][1].get("nvml", {}).get("state") == "ok")

        run.wait_for(back, timeout=30)
        out["resumed"] = [e for e in run.events() if e.get("event") == EventName.DAEMON_RESUMED]
        out["spare_events"] = [
            e
            for e in run.events()
            if e.get("event") in (EventName.SPARE_STARTED, EventName.SPARE_ENDED)
        ]
        out["pids"] = {"worker": worker, "trainer": trainer}
        run.stop()
    return out


def test_the_rollout_week(tmp_path: Path) -> None:
    r = run_in_pid_namespace(f"{__name__}:host_rollout_week", {}, root=tmp_path, timeout=240)
    worker = r["pids"]["worker"]

    # 1. dry-run: would-be signal, no drain, no wait, the would-be drain reported.
    assert r["dry_signal"] is True
    assert r["alive_after_dry_run"] is True
    epilog = r["epilog"]
    assert epilog["code"] == 0, epilog["stderr"]
    assert epilog["updates"] == []
    assert f"dry-run: would drain {NODE}: gpuwatchd: GPU-" in epilog["stderr"]
    assert epilog["took"] < 20
    assert r["would_drain"] is not None
    assert "mode=epilog" in r["would_drain"]

    # 2. pause ends by itself, then the spare, then the worker is freed.
    assert (r["spare_cli"], r["pause_cli"]) == (0, 0)
    code, status = r["status_paused"]
    assert status["effective_mode"] == "paused"
    assert status["paused_until"] is not None
    assert [s["target"] for s in status["spares"]] == [f"pid:{worker}"]
    assert code == 0  # paused is a choice, not trouble
    assert r["resumed"][-1]["reason"] == "the pause ended by itself (its time was up)"
    assert PAUSE_FOR - 0.5 <= r["resumed_after"] < SPARE_FOR
    assert r["alive_after_pause"] is True
    assert r["spare_ended_after"] >= SPARE_FOR - 0.5
    ended = [e for e in r["spare_events"] if e["event"] == EventName.SPARE_ENDED]
    assert [e["why"] for e in ended] == ["its time was up"]
    assert r["spare_refusals"], "the spared worker's ladder never said it was held"
    assert r["alive_at_the_end"] is False
    order = r["order"]
    assert order["delivered"] is not None
    assert order["paused"] < order["resumed"] < order["spare_ended"] < order["delivered"]

    # 3. NVML: wedged in status from the first failed reading; its return is an event.
    code, status = r["status_wedged"]
    assert status["nvml"]["state"] == "wedged"
    assert code == 1
    assert r["wedged_seen_after"] < 10  # the deadline (1s) and a poll, not a minute's refresh
    (back,) = r["recovered"]
    assert back["was"] == "wedged"
    assert back["gone_for"] > 0
    code, status = r["status_back"]
    assert status["nvml"]["state"] == "ok"
    assert code == 0
