"""End to end: one verdict for "is this GPU clean for a new job?" (decide/verdict.py).

``scan``, ``check-clean`` (a prolog) and ``run --once`` (an epilog) must agree, for every GPU
alone and for the whole node, with or without a running daemon. Like tests/test_e2e_run.py,
each ``host_*`` function runs as PID 1 of its own PID namespace (tests/support/simhost.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.fakenvml import gpu
from tests.support.simhost import SimHost, pid_namespace_command, run_in_pid_namespace
from tests.test_e2e_run import ORPHAN_RULE, Run

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
