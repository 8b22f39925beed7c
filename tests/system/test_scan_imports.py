"""``gpuwatchd scan`` loads only what a scan uses (issue 25: start-up is most of a small scan).

End to end, inside a PID namespace: the real command line runs a scan in a fresh interpreter,
once with no daemon and once beside a running daemon that was not asked (the scan walks by
itself either way; what a scan the daemon answered loads: tests/system/test_scan_answered.py),
and reports which modules it had loaded when it finished. Neither loads structlog (nor asyncio,
which structlog brings), pynvml (the NVML worker's, in its own process), the daemon's actuator
and wiring, the plan, another command's module, or the standard modules only a rare path needs
(hashlib, platform); beside the daemon, not even YAML and the config schema (the daemon's
compiled policy). A structural property, never a timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.served import holders as holder_view
from tests.support.daemonrun import job_host
from tests.support.simhost import SimHost, pid_namespace_command, run_in_pid_namespace

pytestmark = pytest.mark.skipif(
    pid_namespace_command() is None,
    reason="needs a PID namespace (root, or unprivileged user namespaces) for end-to-end tests",
)

# Runs the command line as `python -m gpuwatchd` would, then writes the loaded modules to the
# descriptor named by its first argument.
_PROBE = """
import json, os, sys
from gpuwatchd.cli.main import main
code = main(sys.argv[2:])
with os.fdopen(int(sys.argv[1]), "w") as out:
    json.dump({"code": code, "modules": sorted(sys.modules)}, out)
"""

# Modules a scan must not load: (module, why it is not needed).
NOT_LOADED = {
    "structlog": "logging is lazy: loaded only for an error (gpuwatchd.events.lazylog)",
    "asyncio": "only structlog brings it",
    "pynvml": "NVML is read in the worker process, never in the command",
    "gpuwatchd.daemon.host": "the daemon's host: reader, actuator, hooks, signaller",
    "gpuwatchd.act.commands": "a scan never acts",
    "gpuwatchd.act.signals": "a scan never signals",
    "gpuwatchd.config.changes": "the reload diff, the daemon.s",
    "gpuwatchd.daemon.lifecycle": "another command's",
    "gpuwatchd.engine.cycle": "another command's",
    "gpuwatchd.decide.plan.decisions": "a scan judges (verdict), it does not plan",
    "gpuwatchd.sim.simulation": "another command's",
    "gpuwatchd.cli.explain": "another command's",
    "gpuwatchd.cli.run": "another command's",
    "gpuwatchd.state.status_document": "status's: look_at_process is in gpuwatchd.cli.process_kind",
    "gpuwatchd.events.catalogue": "the daemon's and status's event text",
    "hashlib": "names spare and hand-over files only, loaded when one is there (OpenSSL: ~3 ms)",
    "platform": "kcmp's machine name comes from os.uname() (~2 ms)",
    "difflib": "suggests a key name for a typo in the policy only, loaded then",
}


# ... and what a scan beside the daemon does not load either: the policy comes compiled from it.
BESIDE_NOT_LOADED = {
    "yaml": "the daemon's compiled policy is used (gpuwatchd/state/compiled_policy.py)",
    "gpuwatchd.config.schema": "the daemon's compiled policy is used",
}


def _scan_modules(host: SimHost, config: Path) -> tuple[dict[str, Any], set[str]]:
    """(the report, the modules loaded) of one scan in a fresh interpreter."""
    read, write = os.pipe()
    try:
        with subprocess.Popen(
            [sys.executable, "-c", _PROBE, str(write), "--config", str(config), "scan", "--json"],
            env=host.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(write,),
            text=True,
        ) as proc:
            os.close(write)
            write = -1
            stdout, stderr = proc.communicate(timeout=60)
            with os.fdopen(read) as handle:
                read = -1
                loaded = json.loads(handle.read() or "{}")
    finally:
        for fd in (read, write):
            if fd >= 0:
                os.close(fd)
    assert loaded.get("code") == 0, stderr
    assert loaded["code"] == 0, stderr
    report: dict[str, Any] = json.loads(stdout)
    return report, set(loaded["modules"])


def _clean(view: Path) -> bool:
    try:
        return json.loads(view.read_text()).get("clean") is True
    except (OSError, ValueError):
        return False


def host_imports(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with SimHost(root) as host:
        job_host(host)
        config = host.config(interval="200ms")
        report, modules = _scan_modules(host, config)
        out["alone"] = {"view": report["daemon_view"], "nvml": report["nvml_reading"],
                        "modules": sorted(modules)}  # fmt: skip
        daemon = host.start_daemon("run", "--config", str(config))
        view = host.state_dir / holder_view.VIEW_FILE
        try:
            deadline = time.monotonic() + 30
            while not _clean(view) and time.monotonic() < deadline:
                time.sleep(0.05)
            report, modules = _scan_modules(host, config)
            out["beside"] = {"view": report["daemon_view"], "nvml": report["nvml_reading"],
                             "modules": sorted(modules)}  # fmt: skip
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=30)
    return out


def test_a_scan_alone_and_beside_the_daemon_load_no_logging_nvml_or_daemon_modules(
    tmp_path: Path,
) -> None:
    result = run_in_pid_namespace(f"{__name__}:host_imports", {}, root=tmp_path, timeout=120)
    for case in ("alone", "beside"):
        assert result[case]["view"]["used"] is False
        assert result[case]["nvml"]["source"] == "own"
        modules = set(result[case]["modules"])
        assert "gpuwatchd.cli.scan" in modules  # the probe saw a real scan
        unwanted = {**NOT_LOADED, **(BESIDE_NOT_LOADED if case == "beside" else {})}
        loaded = {name: why for name, why in unwanted.items() if name in modules}
        assert not loaded, f"{case}: loaded {loaded}"
