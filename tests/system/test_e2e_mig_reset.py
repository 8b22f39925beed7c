"""End to end, the reset of a whole MIG GPU: the real ``gpuwatchd run`` daemon, the fake NVML,
real processes, a fake ``nvidia-smi`` that writes the fake NVML state as the driver would.

GPU 0 is in MIG mode with GPU instance 1 (1g.10gb, GI profile 19, placement 1:1) and GPU
instance 2 (3g.40gb, GI profile 9, placement 4:4), and NVML's recovery action says GPU_RESET.
A trainer of the test's own runs in GPU instance 2. With ``reset.allow_mig`` the daemon drains
and waits: while the trainer lives nothing is reset and it is never signalled. Once the test
ends the trainer, the GPU is reset once, and its layout is created again: the fake reset leaves
the GPU in MIG mode with no instance at all (the driver destroys them), each ``-cgi
<profile>:<placement>`` brings one back, and the daemon checks both are back.

Each ``host_*`` function runs as PID 1 of its own PID namespace (tests/support/simhost.py): the
daemon can only ever see and signal processes this test started.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support import daemonrun
from tests.support.daemonrun import Run, _signals, mig_recovery_argvs, smi_calls
from tests.support.fakenvml import MiB, cap_minor, gpu, mig_device, mig_minors_text, process, state
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)

pytestmark = [needs_pid_namespace(), pytest.mark.slow]

GPU0 = "GPU-00000000-face-4000-8000-000000000000"

# Logs its argv. `--gpu-reset` refuses while a process holds /dev/nvidia0 (as the driver does),
# else writes the state after a reset (MIG mode on, no GPU instance); `-cgi 19:1` and `-cgi 9:4`
# write the state with GPU instance 1, then both, back. Nothing else does anything.
FAKE_SMI = (
    r"""#!/bin/sh
echo "$*" >> "%(log)s"
case " $* " in
*" --gpu-reset "*)
"""
    + daemonrun.REFUSE_WHILE_HELD
    + r"""    cp "%(root)s/reset.json" "%(state)s.tmp" && mv "%(state)s.tmp" "%(state)s"
    echo "GPU 00000000:18:00.0 was successfully reset." ;;
*" -cgi 19:1 "*)
    cp "%(root)s/gi1.json" "%(state)s.tmp" && mv "%(state)s.tmp" "%(state)s" ;;
*" -cgi 9:4 "*)
    cp "%(root)s/both.json" "%(state)s.tmp" && mv "%(state)s.tmp" "%(state)s" ;;
esac
exit 0
"""
)


def caps(host: SimHost, gi: int, ci: int = 0) -> list[str]:
    (host.devices_dir / "nvidia-caps").mkdir(exist_ok=True)
    return host.dev(f"nvidia-caps/nvidia-cap{cap_minor(0, gi)}",
                    f"nvidia-caps/nvidia-cap{cap_minor(0, gi, ci)}")  # fmt: skip


def mig_gpu(*, gi1: bool = True, gi2: bool = True, action: int = 0, **gi2_over: Any) -> Any:
    devices = []
    if gi1:
        devices.append(mig_device(1, 0, allocated=2 * MiB))
    if gi2:
        over = {"allocated": 2 * MiB, **gi2_over}
        devices.append(mig_device(2, 0, profile="3g.40gb", gi_profile_id=9, placement=(4, 4),
                                  **over))  # fmt: skip
    return gpu(0, mig_mode=1, mig_devices=devices, recovery_action=action)


def reset_config(host: SimHost) -> dict[str, Any]:
    for name, entry in (
        ("reset", mig_gpu(gi1=False, gi2=False)),
        ("gi1", mig_gpu(gi2=False)),
        ("both", mig_gpu()),
    ):
        (host.root / f"{name}.json").write_text(json.dumps(state([entry])))
    script = host.root / "fake-nvidia-smi"
    script.write_text(FAKE_SMI % {"log": host.root / "smi.log", "root": host.root,
                                  "device": host.devices_dir / "nvidia0",
                                  "state": host.fake.state_path})  # fmt: skip
    script.chmod(0o755)
    smi = str(script)
    return {
        "enabled": True,
        "allow_mig": True,
        "command": [smi, "--gpu-reset", "-i", "{uuid}"],
        "persistence_command": [smi, "-pm", "{mode}", "-i", "{uuid}"],
        "health_command": [smi, "-q", "-i", "{uuid}"],
        "mig_recovery_commands": mig_recovery_argvs(smi),
        "confirm_for": "1s",
        "timeout": "5s",
        "cooldown": "0s",
    }


def host_mig_gpu_reset(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        (host.root / "mig-minors").write_text(mig_minors_text([0]))
        caps(host, 1)
        host.spawn("trainer", [{"open": host.cuda(0) + caps(host, 2)}, {"sleep": 3600}])
        trainer = host.wait_ready("trainer")["trainer"]
        busy = process(trainer, 900 * MiB)
        host.nvml([mig_gpu(action=1, allocated=900 * MiB, processes=[busy])])
        run = Run(host, reset=reset_config(host), mig_minors_file=str(host.root / "mig-minors"),
                  health={"drain_timeout": "10m"})  # fmt: skip
        run.start()
        waited = run.wait_for(lambda: run.saw(EventName.HEALTH_DRAIN_WAITING), timeout=30)
        time.sleep(2)  # ten polls: the trainer runs on, never signalled, and no reset
        before_exit = {"alive": host.alive(trainer), "calls": smi_calls(host)}
        os.kill(trainer, signal.SIGTERM)  # the job ends on its own terms (ours: we started it)
        host.wait_gone("trainer")
        host.nvml([mig_gpu(action=1)])
        run.wait_for(lambda: run.saw(EventName.RESET_OUTCOME), timeout=40)
        run.wait_for(lambda: run.saw(EventName.FINDING_RESOLVED), timeout=20)
        time.sleep(1)
        run.stop()
        devices = json.loads(host.fake.state_path.read_text())["gpus"][0]["mig_devices"]
        return {
            "waited": waited,
            "before_exit": before_exit,
            "calls": smi_calls(host),
            "outcomes": [e for e in run.events() if e.get("event") == EventName.RESET_OUTCOME],
            "signals": _signals(run),
            "layout": [(d["gi_profile_id"], d["placement"]) for d in devices],
            "said": [
                (e.get("event"), e.get("why") or e.get("reason") or e.get("kind"))
                for e in run.events()
                if str(e.get("event", "")).startswith(("reset", "health", "finding"))
            ],
        }


def test_a_mig_gpu_asking_for_a_reset_waits_for_its_job_then_is_reset_once_with_its_layout(
    tmp_path: Path,
) -> None:
    result = run_in_pid_namespace(f"{__name__}:host_mig_gpu_reset", {}, root=tmp_path,
                                  timeout=150)  # fmt: skip
    assert result["waited"], result["said"]
    assert result["before_exit"] == {"alive": True, "calls": []}, result["said"]
    assert result["signals"] == []
    assert result["calls"] == [
        f"-pm 0 -i {GPU0}",
        f"--gpu-reset -i {GPU0}",
        f"-q -i {GPU0}",
        f"-pm 1 -i {GPU0}",  # before the creates: a deinitialised GPU loses its instances
        f"mig -i {GPU0} -cgi 19:1 -C",
        f"mig -i {GPU0} -cgi 9:4 -C",
    ], result["said"]
    (outcome,) = result["outcomes"]
    assert outcome["result"] == "success", outcome["reason"]
    assert "its MIG layout is back (2 GPU instance(s))" in outcome["reason"]
    assert result["layout"] == [[19, {"start": 1, "size": 1}], [9, {"start": 4, "size": 4}]]
