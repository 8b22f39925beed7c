"""End to end: one verdict for "is this GPU clean for a new job?" (decide/verdict.py).

``scan``, ``check-clean`` (a prolog) and ``run --once`` (an epilog) must agree, for every GPU
alone and for the whole node, with or without a running daemon. Like tests/test_e2e_run.py,
each ``host_*`` function runs as PID 1 of its own PID namespace (tests/support/simhost.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakenvml import gpu
from tests.support.simhost import SimHost, pid_namespace_command, run_in_pid_namespace
from tests.test_e2e_run import ORPHAN_RULE, Run, orphan_host

pytestmark = [
    pytest.mark.skipif(
        pid_namespace_command() is None,
        reason="needs a PID namespace (root, or unprivileged user namespaces)",
    ),
    pytest.mark.slow,
]

SELECTIONS = {"all": [], "gpu0": ["--gpu", "0"], "gpu1": ["--gpu", "1"], "both": ["--gpu", "1,0"]}


def _checks(host: SimHost, config: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, args in SELECTIONS.items():
        result = host.gpuwatchd("check-clean", "--config", str(config), *args)
        out[name] = {"code": result.returncode, "out": result.stdout, "err": result.stderr}
    return out


def host_monitor_client(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """A monitor (gpustat, ``nvidia-smi -l``, an exporter) holds nvidiactl and both GPUs'
    nodes, no nvidia-uvm and no memory: judged alone, with ``protect``, and beside a daemon."""
    with SimHost(root, gpus=2) as host:
        host.spawn(
            "monitor",
            [{"comm": "gpustat"}, {"open": host.dev("nvidiactl", "nvidia0", "nvidia1")},
             {"sleep": 3600}],
        )  # fmt: skip
        pids = host.wait_ready("monitor")
        host.nvml([gpu(0), gpu(1)])
        plain = host.config(rules=[ORPHAN_RULE])
        scan = host.scan_json(plain)
        alone = _checks(host, plain)
        protected = _checks(
            host, host.config(rules=[ORPHAN_RULE], protect={"commands": ["^gpustat"]})
        )
        run = Run(host)
        run.start()
        assert run.wait_for(lambda: run.saw("daemon.start")), "the daemon did not start"
        assert run.wait_for((host.state_dir / "holders.json").exists, timeout=10)
        beside = _checks(host, run.config)
        beside_scan = host.scan_json(run.config)
        run.stop()
        return {
            "monitor": pids["monitor"],
            "scan": scan,
            "beside_scan": beside_scan,
            "alone": alone,
            "protected": protected,
            "beside": beside,
            "monitor_alive": host.alive(pids["monitor"]),
        }


def test_a_monitor_client_makes_no_gpu_dirty_alone_protected_or_beside_a_daemon(
    tmp_path: Path,
) -> None:
    result = run_in_pid_namespace(f"{__name__}:host_monitor_client", {}, root=tmp_path)
    monitor = result["monitor"]
    for scan in (result["scan"], result["beside_scan"]):
        for entry in scan["gpus"]:
            roles = [h["role"] for h in entry["holders"] if h["pid"] == monitor]
            assert roles == ["management"], entry
    for case in ("alone", "protected", "beside"):
        for selection, check in result[case].items():
            assert check["code"] == 0, (case, selection, check)
            assert check["out"] == "", (case, selection, check)
    assert result["monitor_alive"] is True


TEARDOWN = 1.5  # seconds the fake driver takes to drop a dead context (a real one: ~1-2 s)


def host_epilog_waits_for_the_driver(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """A crashed job's forked worker pins GPU 0 (NVML lists the dead trainer). The epilog's
    ``run --once`` frees it — alone, or beside a running daemon — and the driver takes
    :data:`TEARDOWN` seconds to tear the context down, NVML listing the dead trainer with its
    memory meanwhile. Then the epilog's ``check-clean``, at once."""
    with SimHost(root) as host:
        orphan_host(host)
        host.free_when_gone(["worker"], [gpu(0)], delay=TEARDOWN)
        run = None
        if arg["daemon"]:
            run = Run(host)
            run.start()
            assert run.wait_for(lambda: run.saw("daemon.start")), "the daemon did not start"
            config = run.config
        else:
            config = host.config(
                dry_run=False,
                rules=[ORPHAN_RULE],
                limits={"post_action_delay": "0s"},
                log={"format": "json"},
            )
        started = time.monotonic()
        once = host.gpuwatchd("run", "--once", "--timeout", "30s", "--config", str(config))
        took = time.monotonic() - started
        check = host.gpuwatchd("check-clean", "--config", str(config), "--gpu", "0")
        if run is not None:
            run.stop()
        return {
            "once_code": once.returncode,
            "once_output": once.stdout + once.stderr,
            "took": took,
            "check": {"code": check.returncode, "out": check.stdout, "err": check.stderr},
            "worker_alive": host.alive(host.pids["worker"]),
        }


@pytest.mark.parametrize("daemon", [False, True], ids=["alone", "beside-the-daemon"])
def test_run_once_returns_only_when_the_driver_has_let_go_so_the_epilog_never_drains(
    tmp_path: Path, daemon: bool
) -> None:
    result = run_in_pid_namespace(
        f"{__name__}:host_epilog_waits_for_the_driver", {"daemon": daemon}, root=tmp_path
    )
    assert result["worker_alive"] is False
    assert result["once_code"] == 0, result["once_output"]
    assert result["took"] >= TEARDOWN, result["once_output"]
    assert result["check"] == {"code": 0, "out": "", "err": ""}, result["once_output"]
