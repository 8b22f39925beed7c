"""End to end on a MIG GPU: the real ``gpuwatchd run`` daemon, the fake NVML, real processes.

GPU 0 is in MIG mode with GPU instances 1 and 2 (tests/fakenvml: MIG device handles, instance
ids, per-instance memory and processes). Its capability files stand in under
``<devices_dir>/nvidia-caps/`` and the driver's mig-minors table is a file the policy names
(``mig_minors_file``). In GPU instance 1 a trainer died and its forked worker keeps GI 1's
capability files; in GPU instance 2 a trainer lives with its worker; beside them a process tied
to a dead owner listed in GI 1 holds only the parent node ``nvidia0`` and no capability. The
daemon must kill the first worker and nothing else, and a dry run must show exactly that.

Each ``host_*`` function runs as PID 1 of its own PID namespace (tests/support/simhost.py): the
daemon can only ever see and signal processes this test started.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemonrun import ORPHAN_RULE, Run, _signals
from tests.support.fakenvml import MiB, cap_minor, gpu, mig_device, mig_minors_text, process
from tests.support.simhost import SimHost, pid_namespace_command, run_in_pid_namespace

pytestmark = [
    pytest.mark.skipif(
        pid_namespace_command() is None,
        reason="needs a PID namespace (root, or unprivileged user namespaces)",
    ),
    pytest.mark.slow,
]

NAMES = ("worker1", "trainer2", "worker2", "parent_child")


def caps(host: SimHost, gi: int, ci: int = 0) -> list[str]:
    """The capability files of GPU instance ``gi`` / compute instance ``ci`` of GPU 0."""
    (host.devices_dir / "nvidia-caps").mkdir(exist_ok=True)
    return host.dev(f"nvidia-caps/nvidia-cap{cap_minor(0, gi)}",
                    f"nvidia-caps/nvidia-cap{cap_minor(0, gi, ci)}")  # fmt: skip


def mig_host(host: SimHost) -> dict[str, int]:
    """Build the host of the module docstring; returns the actors' PIDs."""
    (host.root / "mig-minors").write_text(mig_minors_text([0]))
    sleeper = [{"sleep": 3600}]
    host.spawn(
        "trainer1",
        [{"setsid": True}, {"open": host.cuda(0) + caps(host, 1)},
         {"fork": host.script("worker1", sleeper)}, {"exit": 0}],
    )  # fmt: skip
    host.spawn(
        "trainer2",
        [{"setsid": True}, {"open": host.cuda(0) + caps(host, 2)},
         {"fork": host.script("worker2", sleeper)}, {"sleep": 3600}],
    )  # fmt: skip
    host.spawn(
        "bystander",
        [{"setsid": True}, {"open": host.cuda(0)},
         {"fork": host.script("parent_child", sleeper)}, {"exit": 0}],
    )  # fmt: skip
    pids = host.wait_ready("trainer1", "trainer2", "bystander", *NAMES)
    host.wait_gone("trainer1", "bystander")
    host.nvml(
        [
            gpu(
                0,
                mig_mode=1,
                mig_devices=[
                    mig_device(1, 0, allocated=1200 * MiB, processes=[
                        process(pids["trainer1"], 700 * MiB), process(pids["bystander"], 400 * MiB)
                    ]),
                    mig_device(2, 0, profile="3g.40gb", allocated=900 * MiB,
                               processes=[process(pids["trainer2"], 900 * MiB)]),
                ],
            )
        ]
    )  # fmt: skip
    return pids


def host_mig_leak_beside_live_job(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        pids = mig_host(host)
        run = Run(
            host,
            dry_run=arg["dry_run"],
            mig_minors_file=str(host.root / "mig-minors"),
            rules=[ORPHAN_RULE],
        )
        run.start()
        if arg["dry_run"]:
            run.wait_for(lambda: run.saw("action.signal", pid=pids["worker1"]), timeout=30)
        else:
            run.wait_for(lambda: host.state_of(pids["worker1"]) is None, timeout=30)
        time.sleep(4)  # longer than the whole ladder: nothing else may be signalled
        alive = {name: host.alive(pids[name]) for name in NAMES}
        report = host.scan_json(run.config)
        run.stop()
        instances = report["gpus"][0]["mig_instances"]
        return {
            "pids": pids,
            "alive": alive,
            "signals": _signals(run),
            "findings": [
                {k: f.get(k) for k in ("kind", "pid", "gpu", "actionable")}
                for f in report["findings"]
            ],
            "instances": [
                {"gi": i["gi"], "uuid": i["uuid"], "holders": [h["pid"] for h in i["holders"]]}
                for i in instances
            ],
            "parent_holders": {h["pid"]: h["role"] for h in report["gpus"][0]["holders"]},
        }


def run_scenario(name: str, tmp_path: Path, **arg: Any) -> dict[str, Any]:
    return run_in_pid_namespace(f"{__name__}:{name}", arg, root=tmp_path, timeout=150)


def test_an_orphan_in_one_instance_is_killed_and_nothing_beside_it_is_signalled(
    tmp_path: Path,
) -> None:
    result = run_scenario("host_mig_leak_beside_live_job", tmp_path, dry_run=False)
    pids = result["pids"]
    assert {s["pid"] for s in result["signals"]} == {pids["worker1"]}
    assert [s["outcome"] for s in result["signals"]][:1] == ["delivered"]
    assert result["alive"] == {
        "worker1": False, "trainer2": True, "worker2": True, "parent_child": True
    }  # fmt: skip
    by_gi = {i["gi"]: i for i in result["instances"]}
    assert pids["worker2"] in by_gi[2]["holders"]
    assert pids["trainer2"] in by_gi[2]["holders"]
    assert pids["parent_child"] not in by_gi[1]["holders"] + by_gi[2]["holders"]
    parent_only = [f for f in result["findings"] if f["pid"] == pids["parent_child"]]
    assert [(f["kind"], f["actionable"]) for f in parent_only] == [("hidden_holder", False)]


def test_a_dry_run_on_a_mig_gpu_shows_the_same_single_target(tmp_path: Path) -> None:
    result = run_scenario("host_mig_leak_beside_live_job", tmp_path, dry_run=True)
    pids = result["pids"]
    assert result["signals"]
    assert {s["pid"] for s in result["signals"]} == {pids["worker1"]}
    assert all(s["dry_run"] is True for s in result["signals"])
    assert all(result["alive"].values())
    orphans = [f for f in result["findings"] if f["kind"] == "orphaned"]
    assert [(f["pid"], f["gpu"]) for f in orphans] == [
        (pids["worker1"], result["instances"][0]["uuid"])
    ]
