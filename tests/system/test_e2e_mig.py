"""End to end on a MIG GPU: the real ``gpuwatchd run`` daemon, the fake NVML, real processes.

Two hosts. The first:

GPU 0 is in MIG mode with GPU instances 1 and 2 (tests/fakenvml: MIG device handles, instance
ids, per-instance memory and processes). Its capability files stand in under
``<devices_dir>/nvidia-caps/`` and the driver's mig-minors table is a file the policy names
(``mig_minors_file``). In GPU instance 1 a trainer died and its forked worker keeps GI 1's
capability files; in GPU instance 2 a trainer lives with its worker; beside them a process tied
to a dead owner listed in GI 1 holds only the parent node ``nvidia0`` and no capability. The
daemon must kill the first worker and nothing else, and a dry run must show exactly that.

The second: ghost memory in GPU instance 1 (3 GiB allocated, no process listed, nothing holding
its capability files) beside the live trainer in GPU instance 2. With ``reset.mig_recovery``
the daemon re-creates GPU instance 1 through a fake ``nvidia-smi mig`` (which, like the
driver, refuses while a process holds the instance's capability files, and on ``-cgi`` writes
the fake NVML state with the instance's memory freed); it never resets the GPU and never
signals the trainer. A dry run runs no command and says the same plan.

Each ``host_*`` function runs as PID 1 of its own PID namespace (tests/support/simhost.py): the
daemon can only ever see and signal processes this test started.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support.daemonrun import (
    ORPHAN_RULE,
    Run,
    _signals,
    evidence_files,
    mig_recovery_argvs,
)
from tests.support.fakenvml import (
    GiB,
    MiB,
    cap_minor,
    gpu,
    mig_device,
    mig_minors_text,
    process,
    state,
)
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)

pytestmark = [needs_pid_namespace(), pytest.mark.slow]

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
            run.wait_for(lambda: run.saw(EventName.ACTION_SIGNAL, pid=pids["worker1"]), timeout=30)
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


# A stand-in for `nvidia-smi` on a MIG GPU: logs its argv. `mig -dci/-dgi` refuse "in use" while
# any process holds GPU instance 1's capability files (as the driver does); `mig -cgi` writes
# the fake NVML state with GPU instance 1's memory back to idle (`-dgi` with GPU instance 1 gone).
# A `drain` hook copies the admin's layout in, when the test wrote one. Nothing else does anything.
FAKE_MIG_SMI = r"""#!/bin/sh
if [ "$1" = hook ]; then
    echo "hook $2 $GPUWATCHD_EVENT $GPUWATCHD_MIG_INSTANCE $GPUWATCHD_MIG_GI" >> "%(log)s"
    if [ "$2" = drain ] && [ -f "%(admin)s" ]; then  # meanwhile, an admin re-creates GI 1
        cp "%(admin)s" "%(state)s.tmp" && mv "%(state)s.tmp" "%(state)s"
    fi
    exit 0
fi
echo "$*" >> "%(log)s"
case " $* " in
*" -dci "* | *" -dgi "*)
    if [ -f "%(hidden)s" ]; then  # a holder no scan can see (a test's stand-in)
        echo "Unable to destroy compute instance ID 0 from GPU 0: In use by another client"
        exit 255
    fi
    for fd in /proc/[0-9]*/fd/*; do
        case $(readlink "$fd" 2>/dev/null) in
        "%(gi_cap)s" | "%(ci_cap)s")
            echo "Unable to destroy GPU instance ID 1 from GPU 0: In use by another client"
            exit 255 ;;
        esac
    done
    echo "Successfully destroyed an instance of GPU 0"
    case " $* " in *" -dgi "*)  # NVML lists GPU instance 1 no more
        cp "%(destroyed)s" "%(state)s.tmp" && mv "%(state)s.tmp" "%(state)s" ;;
    esac ;;
*" -cgi "*)
    if [ -f "%(cgi_fails)s" ]; then
        echo "Failed to create GPU instances: Insufficient Resources"
        exit 2
    fi
    cp "%(recreated)s" "%(state)s.tmp" && mv "%(state)s.tmp" "%(state)s"
    echo "Successfully created GPU instance ID 1 on GPU 0 using profile MIG 1g.10gb (ID 19)" ;;
esac
exit 0
"""


def ghost_host(host: SimHost) -> tuple[dict[str, int], dict[str, Any]]:
    """GI 1 with ghost memory, GI 2 with a live trainer and its worker; the fake nvidia-smi.
    Returns the actors' PIDs and the reset section pointing every command at the fake."""
    (host.root / "mig-minors").write_text(mig_minors_text([0]))
    caps(host, 1)
    host.spawn(
        "trainer2",
        [{"setsid": True}, {"open": host.cuda(0) + caps(host, 2)},
         {"fork": host.script("worker2", [{"sleep": 3600}])}, {"sleep": 3600}],
    )  # fmt: skip
    pids = host.wait_ready("trainer2", "worker2")

    def layout(gi1_allocated: int | None, **gi1: Any) -> list[dict[str, Any]]:
        first = [] if gi1_allocated is None else [mig_device(1, 0, allocated=gi1_allocated, **gi1)]
        return [
            gpu(0, mig_mode=1, mig_devices=[
                *first,
                mig_device(2, 0, profile="3g.40gb", allocated=900 * MiB,
                           processes=[process(pids["trainer2"], 900 * MiB)]),
            ])
        ]  # fmt: skip

    host.nvml(layout(3 * GiB))
    recreated = host.root / "recreated.json"
    recreated.write_text(json.dumps(state(layout(2 * MiB))))
    (host.root / "destroyed.json").write_text(json.dumps(state(layout(None))))
    (host.root / "admin-layout.json").write_text(
        json.dumps(state(layout(2 * MiB, uuid=ADMIN_GI1, profile="1g.10gb")))
    )
    script = host.root / "fake-nvidia-smi"
    script.write_text(
        FAKE_MIG_SMI
        % {
            "log": host.root / "smi.log",
            "gi_cap": host.devices_dir / f"nvidia-caps/nvidia-cap{cap_minor(0, 1)}",
            "ci_cap": host.devices_dir / f"nvidia-caps/nvidia-cap{cap_minor(0, 1, 0)}",
            "recreated": recreated,
            "destroyed": host.root / "destroyed.json",
            "admin": host.root / "admin",
            "cgi_fails": host.root / "cgi-fails",
            "state": host.fake.state_path,
            "hidden": host.root / "hidden-holder",
        }
    )
    script.chmod(0o755)
    smi = str(script)
    reset = {
        "enabled": True,
        "mig_recovery": True,
        "command": [smi, "--gpu-reset", "-i", "{uuid}"],
        "persistence_command": [smi, "-pm", "{mode}", "-i", "{uuid}"],
        "health_command": [smi, "-q", "-i", "{uuid}"],
        "drain": [[smi, "hook", "drain"]],
        "after": [[smi, "hook", "after"]],
        "mig_recovery_commands": mig_recovery_argvs(smi),
        "confirm_for": "1s",
        "timeout": "5s",
        "cooldown": "1h",
    }
    return pids, reset


def host_mig_ghost_recovery(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """``arg["variant"]``: None; ``hidden_holder`` (the driver refuses the first command "in
    use"); ``parent_only`` (a user's process holds /dev/nvidia0 and no capability: which
    instance it uses is unknown, so GPU instance 1 is not known to be free); ``cgi_fails``
    (the re-create fails after the destroys: half done); ``admin`` (while
    the recovery drains, an administrator re-creates GPU instance 1: same ids, a new MIG
    UUID)."""
    with SimHost(root) as host:
        pids, reset = ghost_host(host)
        variant = arg.get("variant")
        if variant == "hidden_holder":
            (host.root / "hidden-holder").touch()
        if variant == "admin":
            (host.root / "admin-layout.json").rename(host.root / "admin")
        if variant == "cgi_fails":
            (host.root / "cgi-fails").touch()
        if variant == "parent_only":
            host.spawn("monitor", [{"open": host.dev("nvidiactl", "nvidia0")}, {"sleep": 3600}])
            pids.update(host.wait_ready("monitor"))
        run = Run(
            host,
            dry_run=arg["dry_run"],
            reset=reset,
            mig_minors_file=str(host.root / "mig-minors"),
        )
        run.start()
        if variant == "parent_only":
            run.wait_for(lambda: run.saw(EventName.RESET_REFUSED), timeout=40)
        else:
            run.wait_for(lambda: run.saw(EventName.RESET_OUTCOME), timeout=40)
        time.sleep(2)  # several more polls, within the cooldown
        run.stop()
        clean = host.gpuwatchd("check-clean", "--config", str(run.config))
        log = host.root / "smi.log"
        gi1 = json.loads(host.fake.state_path.read_text())["gpus"][0]["mig_devices"][0]
        steps = [e for e in run.events() if e.get("event") == EventName.RESET_STEP]
        return {
            "pids": pids,
            "calls": log.read_text().splitlines() if log.exists() else [],
            "outcomes": [e for e in run.events() if e.get("event") == EventName.RESET_OUTCOME],
            "due": [e for e in run.events() if e.get("event") == EventName.RESET_DUE],
            "refused": [
                e.get("why") for e in run.events() if e.get("event") == EventName.RESET_REFUSED
            ],
            "signals": _signals(run),
            "alive": {name: host.alive(pids[name]) for name in ("trainer2", "worker2")},
            "gi1_used": gi1["memory"]["used"],
            "gi1_uuid": gi1["uuid"],
            "check_clean": (clean.returncode, clean.stdout),
            "readings": [
                (e.get("status"), e.get("detail"))
                for e in steps
                if e.get("step") == "reset" and "argv" not in e
            ],
            "refused_calls": (host.root / "refused-calls.log").exists(),
            "evidence": evidence_files(host, run.config),
            "said": [  # what the daemon said about resets and findings, for a failure's message
                (e.get("event"), e.get("why") or e.get("reason") or e.get("kind"), e.get("gpu"))
                for e in run.events()
                if not str(e.get("event", "")).startswith(("poll", "scan."))
            ],
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


GPU0 = "GPU-00000000-face-4000-8000-000000000000"
ADMIN_GI1 = "MIG-00000000-0001-4000-8000-00000000ad01"


def test_ghost_memory_in_one_instance_recreates_it_and_never_resets_the_gpu(
    tmp_path: Path,
) -> None:
    result = run_scenario("host_mig_ghost_recovery", tmp_path, dry_run=False)
    gi1 = result["outcomes"][0]["instance"] if result["outcomes"] else "?"
    assert result["calls"] == [
        f"hook drain reset_drain {gi1} 1",
        f"mig -i {GPU0} -gi 1 -ci 0 -dci",
        f"mig -i {GPU0} -gi 1 -dgi",
        f"mig -i {GPU0} -cgi 19:1 -C",
        f"-q -i {GPU0}",
        f"hook after reset_after {gi1} 1",
    ], result["said"]
    assert not [c for c in result["calls"] if "--gpu-reset" in c or "-pm" in c]
    assert not result["refused_calls"]
    (outcome,) = result["outcomes"]
    assert outcome["result"] == "success", outcome["reason"]
    assert outcome["gi"] == 1
    assert outcome["instance"].startswith("MIG-")
    assert result["gi1_used"] == 2 * MiB
    assert result["signals"] == []
    assert result["alive"] == {"trainer2": True, "worker2": True}
    (kept,) = result["evidence"]["files"]  # before the drain hook, the first step
    assert (kept["action"], kept["gpu"], kept["dry_run"]) == ("mig_instance", GPU0, False)
    assert kept["path"] == outcome["evidence_file"]
    assert kept["path"].endswith(f"-mig_instance-{gi1}.json")
    assert result["evidence"]["explain"]["code"] == 0, result["evidence"]["explain"]


def test_a_dry_run_of_the_instance_recovery_runs_nothing_and_says_the_same_plan(
    tmp_path: Path,
) -> None:
    result = run_scenario("host_mig_ghost_recovery", tmp_path, dry_run=True)
    assert result["calls"] == []
    (outcome,) = result["outcomes"]
    assert outcome["result"] == "dry_run"
    assert outcome["gi"] == 1
    assert "would re-create MIG GPU instance 1 of GPU 0" in outcome["reason"]
    assert "-cgi', '19:1', '-C'" in outcome["reason"]
    assert [d["gi"] for d in result["due"]] == [1]
    assert result["gi1_used"] == 3 * GiB
    (kept,) = result["evidence"]["files"]  # what enforcement would have kept
    assert (kept["action"], kept["dry_run"]) == ("mig_instance", True)
    assert kept["path"] == outcome["evidence_file"]
    assert result["alive"] == {"trainer2": True, "worker2": True}


def test_the_driver_refusing_the_instance_as_in_use_destroys_nothing_and_is_not_retried(
    tmp_path: Path,
) -> None:
    result = run_scenario(
        "host_mig_ghost_recovery", tmp_path, dry_run=False, variant="hidden_holder"
    )
    gi1 = result["outcomes"][0]["instance"] if result["outcomes"] else "?"
    assert result["calls"] == [
        f"hook drain reset_drain {gi1} 1",
        f"mig -i {GPU0} -gi 1 -ci 0 -dci",
        f"hook after reset_after {gi1} 1",
    ], result["said"]
    (outcome,) = result["outcomes"]
    assert outcome["result"] == "in_use"
    assert result["gi1_used"] == 3 * GiB
    assert result["alive"] == {"trainer2": True, "worker2": True}


def test_a_process_holding_only_the_parent_node_keeps_the_instance_from_being_recreated(
    tmp_path: Path,
) -> None:
    result = run_scenario("host_mig_ghost_recovery", tmp_path, dry_run=False, variant="parent_only")
    assert result["calls"] == [], result["said"]
    assert result["outcomes"] == []
    monitor = result["pids"]["monitor"]
    assert any(f"PID {monitor} holding its GPU's device node" in str(w) for w in result["refused"])
    assert result["signals"] == []
    assert result["alive"] == {"trainer2": True, "worker2": True}


def test_an_instance_re_created_by_an_admin_after_the_plan_is_never_destroyed(
    tmp_path: Path,
) -> None:
    """Issue 34, finding 6: between the plan and ``-dci`` an administrator re-created GPU
    instance 1 (the driver gave it the same ids, a new MIG UUID). The recovery reads the GPU
    again right before its first command and refuses: nothing is destroyed."""
    result = run_scenario("host_mig_ghost_recovery", tmp_path, dry_run=False, variant="admin")
    gi1 = result["outcomes"][0]["instance"] if result["outcomes"] else "?"
    assert result["calls"] == [
        f"hook drain reset_drain {gi1} 1",
        f"hook after reset_after {gi1} 1",
    ], result["said"]
    (outcome,) = result["outcomes"]
    assert outcome["result"] == "refused"
    assert f"MIG UUID {ADMIN_GI1}" in outcome["reason"]
    assert result["readings"][0][0] == "changed"
    assert result["gi1_uuid"] == ADMIN_GI1
    assert result["signals"] == []
    assert result["alive"] == {"trainer2": True, "worker2": True}


def test_a_recovery_stopped_after_the_destroy_keeps_check_clean_from_calling_the_gpu_clean(
    tmp_path: Path,
) -> None:
    """Issue 34, finding 5: ``-dgi`` ran and ``-cgi`` failed. GPU instance 1 is gone (NVML lists
    only GPU instance 2), so no finding is left about it; ``check-clean``, reading the daemon's
    saved state, still says GPU 0 is dirty (``mig_unfinished``), so a prolog or the undrain
    timer does not hand it out."""
    result = run_scenario("host_mig_ghost_recovery", tmp_path, dry_run=False, variant="cgi_fails")
    (outcome,) = result["outcomes"]
    assert outcome["result"] == "failed"
    assert "is half done" in outcome["reason"]
    assert result["gi1_uuid"] != "MIG-00000000-0001-4000-8000-000000000010"  # GI 1 is gone
    code, said = result["check_clean"]
    assert code != 0, said
    assert "mig_unfinished" in said or "half done" in said, said
