"""The daemon and its policy files: `gpuwatchd reload` finds the running daemon, files that stop
validating show at once (status, metrics), and a policy rejected at start does not leave the
node unwatched.

Pins gpuwatchd/cli/reload.py (the daemon found by its state, its lock and its process, never
by a PID number like 1; a broken policy refused before any signal; none running: exit 3) and
the start-up fallback of gpuwatchd/state/accepted.py: a daemon that never accepted a policy exits
78 over a broken one; one that did runs with the last policy it accepted, logs
``config.start_rejected`` at critical, sets ``gpuwatchd_policy_rejected``, and ``gpuwatchd
status`` (even with the broken files) says so and exits 1. Real daemons in a PID namespace
(tests/support/simhost.py); the same under real systemd: tests/system/test_systemd.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support.daemonrun import Run
from tests.support.fakenvml import gpu
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)

pytestmark = [needs_pid_namespace(), pytest.mark.slow]


def _result(proc: Any) -> dict[str, Any]:
    return {"code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


def host_reload_and_rejected_start(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=1) as host:
        host.nvml([gpu(0)])
        metrics = host.root / "gpuwatchd.prom"
        run = Run(host, metrics={"textfile": str(metrics)})
        conf_d = run.config.parent / "conf.d"
        conf_d.mkdir(exist_ok=True)
        config = ["--config", str(run.config)]
        out: dict[str, Any] = {"none": _result(host.gpuwatchd("reload", *config))}
        # Never accepted a policy (a node being set up): a broken one is refused, exit 78.
        (conf_d / "90-broken.yaml").write_text("interval: sometimes\n")
        out["first_start"] = _result(host.gpuwatchd("run", *config, timeout=30))
        (conf_d / "90-broken.yaml").unlink()
        run.start()
        assert run.wait_for(lambda: run.saw(EventName.DAEMON_START)), "the daemon did not start"
        (conf_d / "50-site.yaml").write_text("interval: 300ms\n")
        out["reload"] = _result(host.gpuwatchd("reload", *config))
        out["reloaded"] = run.wait_for(lambda: run.saw(EventName.CONFIG_RELOADED))
        out["reloaded_event"] = next(
            e for e in run.events() if e.get("event") == EventName.CONFIG_RELOADED
        )
        (conf_d / "90-broken.yaml").write_text("interval: sometimes\n")
        out["broken"] = _result(host.gpuwatchd("reload", *config))
        run.wait_for(lambda: False, timeout=1.0)
        out["rejected_by_daemon"] = run.saw(EventName.CONFIG_RELOAD_REJECTED)
        out["stopped"] = run.stop()
        # Restart (as after a reboot) with the broken drop-in still there.
        run.start()
        out["running"] = run.wait_for(
            lambda: sum(1 for e in run.events() if e.get("event") == EventName.DAEMON_START) >= 2
        )
        out["start_rejected"] = [
            e for e in run.events() if e.get("event") == EventName.CONFIG_START_REJECTED
        ]
        status = host.gpuwatchd("status", "--json", *config)
        out["status_code"] = status.returncode
        out["status_stderr"] = status.stderr
        out["status"] = json.loads(status.stdout) if status.stdout.strip() else None
        out["alive"] = run.proc is not None and run.proc.poll() is None
        run.wait_for(lambda: metrics.exists() and "policy_rejected 1" in metrics.read_text())
        out["metrics"] = metrics.read_text() if metrics.exists() else ""
        (conf_d / "90-broken.yaml").unlink()
        out["fixed"] = _result(host.gpuwatchd("reload", *config))
        out["reloaded_after_fix"] = run.wait_for(
            lambda: sum(1 for e in run.events() if e.get("event") == EventName.CONFIG_RELOADED) >= 2
        )
        run.stop()
        return out


def test_reload_and_a_rejected_start(tmp_path: Path) -> None:
    r = run_in_pid_namespace(
        f"{__name__}:host_reload_and_rejected_start", {}, root=tmp_path, timeout=180
    )
    assert r["none"]["code"] == 3, r["none"]
    assert "nobody holds the instance lock" in r["none"]["stderr"]
    assert r["first_start"]["code"] == 78, r["first_start"]
    assert "90-broken.yaml" in r["first_start"]["stderr"]
    assert "not started: no saved policy" in r["first_start"]["stderr"]
    assert r["reload"]["code"] == 0, r["reload"]
    assert "asked the daemon (pid " in r["reload"]["stdout"]
    assert r["reloaded"] is True
    # The journal says what changed, in a line, not the whole merged policy.
    assert r["reloaded_event"]["changed"]["interval"].endswith(" -> 300ms")
    assert set(r["reloaded_event"]["changed"]) == {"interval"}
    # A broken policy is refused by the command: the daemon gets no signal.
    assert r["broken"]["code"] == 78, r["broken"]
    assert "90-broken.yaml" in r["broken"]["stderr"]
    assert r["rejected_by_daemon"] is False
    assert r["stopped"] == 0

    # The restart with the broken drop-in runs (not exit 78), on the last accepted policy.
    assert r["running"] is True
    assert r["alive"] is True
    (event,) = r["start_rejected"]
    assert event["level"] == "critical"
    assert "90-broken.yaml" in event["error"]
    assert event["running"].startswith("the last accepted policy (")
    assert "policy.accepted.yaml" in event["running"]
    assert event["dry_run"] is False  # the accepted policy enforced; so does its fallback
    assert r["status_code"] == 1, r["status_stderr"]  # running, but needs attention
    assert "90-broken.yaml" in r["status_stderr"]
    status = r["status"]
    assert status["running"] is True
    assert status["policy"]["rejected"]["at_start"] is True
    assert any("rejected at start" in a for a in status["attention"])
    assert "\ngpuwatchd_policy_rejected 1.0\n" in r["metrics"]
    assert r["fixed"]["code"] == 0
    assert r["reloaded_after_fix"] is True


def host_files_rejected_while_running(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=1) as host:
        host.nvml([gpu(0)])
        metrics = host.root / "gpuwatchd.prom"
        run = Run(host, metrics={"textfile": str(metrics)}, interval="200ms")
        conf_d = run.config.parent / "conf.d"
        conf_d.mkdir(exist_ok=True)
        config = ["--config", str(run.config)]
        run.start()
        assert run.wait_for(lambda: run.saw(EventName.DAEMON_START)), "the daemon did not start"
        out: dict[str, Any] = {}
        out["status_before"] = host.gpuwatchd("status", "--json", *config).returncode
        (conf_d / "90-typo.yaml").write_text("interval: sometimes\n")
        out["reload"] = _result(host.gpuwatchd("reload", *config))  # refused: no signal
        out["said"] = run.wait_for(lambda: run.saw(EventName.CONFIG_FILES_REJECTED))
        run.wait_for(lambda: metrics.exists() and "policy_rejected 1" in metrics.read_text())
        out["metrics"] = metrics.read_text() if metrics.exists() else ""
        out["alive"] = run.proc is not None and run.proc.poll() is None
        out["last_events"] = [e.get("event") for e in run.events()][-12:]
        status = host.gpuwatchd("status", "--json", *config)
        out["status_code"] = status.returncode
        out["status"] = json.loads(status.stdout) if status.stdout.strip() else None
        (conf_d / "90-typo.yaml").unlink()
        run.wait_for(lambda: metrics.exists() and "policy_rejected 0" in metrics.read_text())
        out["metrics_fixed"] = metrics.read_text() if metrics.exists() else ""
        out["status_fixed"] = host.gpuwatchd("status", "--json", *config).returncode
        out["reload_rejected"] = run.saw(EventName.CONFIG_RELOAD_REJECTED)
        run.stop()
        return out


def test_files_that_stop_validating_show_in_status_and_metrics_without_a_reload(
    tmp_path: Path,
) -> None:
    """Issue 35, finding 2: `gpuwatchd reload` (like the unit's ExecReload) refuses bad files
    before any signal, so the daemon looks at its files itself: the refusal shows in `status`
    (exit 1, attention) and gpuwatchd_policy_rejected until the files validate again."""
    r = run_in_pid_namespace(
        f"{__name__}:host_files_rejected_while_running", {}, root=tmp_path, timeout=180
    )
    assert r["status_before"] == 0
    assert r["reload"]["code"] == 78, r["reload"]
    assert r["said"] is True
    assert r["reload_rejected"] is False  # no signal was sent: the daemon saw the files itself
    said = {"alive": r["alive"], "last events": r["last_events"]}
    assert "\ngpuwatchd_policy_rejected 1.0\n" in r["metrics"], said
    assert r["status_code"] == 1
    status = r["status"]
    assert status["running"] is True
    assert "90-typo.yaml" in status["policy"]["rejected"]["error"]
    assert any("policy files rejected" in a for a in status["attention"])
    assert "\ngpuwatchd_policy_rejected 0.0\n" in r["metrics_fixed"]
    assert r["status_fixed"] == 0
