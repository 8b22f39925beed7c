"""On a real NVIDIA GPU: ``scan`` against the driver itself (marked ``gpu``).

These tests skip visibly wherever the real NVIDIA driver is absent (every CI machine of this
project). Where it is present they are read-only: they never reset a GPU, never change its
settings, and signal only the processes they start. This pytest process itself never touches
CUDA or NVML, so that it is not a holder of the GPU it inspects.

What they pin: scan agrees with ``nvidia-smi`` on memory and PIDs; a CUDA process started here
appears with its PID and memory; after its launcher dies while a forked worker keeps the
inherited device files, scan reports what docs/design-notes.md §4 predicts, and the test records
what the real driver lists for the dead owner (docs/architecture.md, testing without a GPU; the
documentation disagrees on it).

The core loop (docs/design-notes.md, "The core loop on a real GPU"): a daemon in enforce mode,
whose only rule matches this run's own CUDA launcher, sees the launcher die, signals its forked
worker as ``orphaned``, and nvidia-smi shows the memory back, within bounded times
(tests/support/gpucoreloop.py; the same scenario runs on the fake host in
tests/system/test_core_loop_fake.py). Resets stay off. Where MIG is available, the real
``mig-minors`` file is parsed and the instance profiles listed, read-only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.collect.mig import DEFAULT_MIG_MINORS_FILE, read_mig_minors
from tests.support.gpucoreloop import assert_core_loop, core_loop
from tests.support.simhost import pid_namespace_command, run_in_pid_namespace

pytestmark = pytest.mark.gpu

MiB = 1024 * 1024


def _real_driver() -> str | None:
    """Why the real driver cannot be used here, or None when it can."""
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi: not a GPU machine"
    fake = str(Path(__file__).parents[1] / "fakenvml")
    if fake in os.environ.get("LD_LIBRARY_PATH", ""):
        return "LD_LIBRARY_PATH points at the fake NVML"
    probe = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if probe.returncode != 0 or not probe.stdout.strip():
        return f"nvidia-smi cannot query the driver: {probe.stderr.strip() or probe.returncode}"
    return None


def _torch_cuda() -> str | None:
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return None if probe.returncode == 0 else "PyTorch with CUDA is not importable here"


def _libcuda() -> str | None:
    """Why the CUDA driver library cannot be loaded here (a child tries; this process never
    loads it), or None when it can."""
    probe = subprocess.run(
        [sys.executable, "-c", "import ctypes; ctypes.CDLL('libcuda.so.1')"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return None if probe.returncode == 0 else "libcuda.so.1 cannot be loaded"


SKIP_DRIVER = _real_driver()
needs_driver = pytest.mark.skipif(SKIP_DRIVER is not None, reason=SKIP_DRIVER or "")
SKIP_CUDA = SKIP_DRIVER or _libcuda()
needs_cuda = pytest.mark.skipif(
    SKIP_CUDA is not None,
    reason=f"no NVIDIA GPU/driver: libcuda.so.1 / NVML not found ({SKIP_CUDA})",
)


def scan_json(tmp_path: Path) -> dict[str, Any]:
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "scan", "--json", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode in (0, 77), result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def smi(query: str, fields: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-{query}={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line]


@needs_driver
def test_scan_agrees_with_nvidia_smi_on_gpus_and_memory(tmp_path: Path) -> None:
    report = scan_json(tmp_path)
    rows = {row[0]: row for row in smi("gpu", "uuid,memory.total,memory.used,pci.bus_id")}
    assert {g["uuid"] for g in report["gpus"]} == set(rows)
    for entry in report["gpus"]:
        _uuid, total, used, _bus = rows[entry["uuid"]]
        assert abs(entry["memory"]["total"] - int(total) * MiB) <= MiB
        if entry["memory"]["used"] is not None:
            # Memory can move between the two reads; a few MiB of slack, more on a busy GPU.
            assert abs(entry["memory"]["used"] - int(used) * MiB) <= 64 * MiB


@needs_driver
def test_scan_lists_the_same_compute_pids_as_nvidia_smi(tmp_path: Path) -> None:
    report = scan_json(tmp_path)
    smi_pids = {int(row[0]) for row in smi("compute-apps", "pid") if row[0].isdigit()}
    ours = {p["pid"] for g in report["gpus"] for p in g["processes"] if p.get("type") != "graphics"}
    # A process may start or stop between the two reads: allow churn, not disagreement.
    assert len(smi_pids ^ ours) <= 1, (smi_pids, ours)


CUDA_CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    block = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    if sys.argv[1] == "orphan":
        worker = os.fork()
        if worker == 0:                      # the "DataLoader worker": inherits, never uses CUDA
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)                 # not the launcher's pipes: its reader sees EOF
            os.dup2(null, 2)
            time.sleep(600)
            os._exit(0)
        print(os.getpid(), worker, flush=True)
        os._exit(0)                          # the launcher dies; the worker keeps the files
    print(os.getpid(), flush=True)
    time.sleep(600)
    """
)


@needs_driver
@pytest.mark.slow
def test_a_cuda_process_started_here_appears_with_its_pid_and_memory(tmp_path: Path) -> None:
    reason = _torch_cuda()
    if reason:
        pytest.skip(reason)
    child = subprocess.Popen(
        [sys.executable, "-c", CUDA_CHILD, "live"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        pid = int(child.stdout.readline())
        time.sleep(1)
        report = scan_json(tmp_path)
        listed = [p for g in report["gpus"] for p in g["processes"] if p["pid"] == pid]
        if not listed and report.get("report_only", {}).get("node"):
            pytest.skip(f"not in the host PID namespace: {report['report_only']['node']}")
        assert listed, "the CUDA child is not in NVML's list"
        assert listed[0]["used_memory"] is None or listed[0]["used_memory"] >= 256 * MiB
        held = [h for g in report["gpus"] for h in g["holders"] if h["pid"] == pid]
        assert held
        assert held[0]["role"] == "context_owner"
        assert not [f for f in report["findings"] if f["pid"] == pid]
    finally:
        child.kill()
        child.wait()


@needs_driver
@pytest.mark.slow
def test_worker_left_by_a_dead_cuda_launcher_is_reported_as_designed(tmp_path: Path) -> None:
    reason = _torch_cuda()
    if reason:
        pytest.skip(reason)
    launcher = subprocess.run(
        [sys.executable, "-c", CUDA_CHILD, "orphan"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    dead, worker = (int(x) for x in launcher.stdout.split())
    try:
        time.sleep(2)
        report = scan_json(tmp_path)
        record: dict[str, Any] = {
            "dead_owner_listed_by_nvml": any(
                p["pid"] == dead for g in report["gpus"] for p in g["processes"]
            ),
            "worker_findings": [f["kind"] for f in report["findings"] if f["pid"] == worker],
            "gpu_findings": [f["kind"] for f in report["findings"] if f["pid"] is None],
        }
        # What the real driver did, for the record (docs/architecture.md asks for it).
        print(f"real-driver observation: {json.dumps(record)}")
        out = os.environ.get("OUT")
        if out:
            Path(out, "gpu-dead-owner.json").write_text(json.dumps(record, indent=2))
        holders = [h for g in report["gpus"] for h in g["holders"] if h["pid"] == worker]
        assert holders, "the worker holding the inherited device files was not found"
        assert record["worker_findings"], "the worker pinning a dead job's memory is not reported"
        assert set(record["worker_findings"]) <= {"orphaned", "hidden_holder"}
    finally:
        _kill_own_worker(worker)


def _kill_own_worker(pid: int) -> None:
    """SIGKILL the worker this test forked, after checking through a pidfd that it is ours."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"DataLoader worker" in cmdline:  # the CUDA_CHILD script is its argv
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass
    finally:
        os.close(pidfd)


@needs_driver
def test_health_apis_answer_read_only_and_are_recorded(tmp_path: Path) -> None:
    """What the real driver answers for the health APIs (docs/findings.md#gpu-health): events,
    the recovery-action field, row remapping, retired pages — supported or not, and the values.

    Read-only: scan's NVML worker only reads; nothing is reset, no setting changes. The pinned
    part is what must hold on any driver: every value is "ok", "not_supported" or "unknown",
    a value is present exactly when it is "ok", and a healthy GPU has no health finding unless
    the driver itself asks for something (then the record says what).
    """
    report = scan_json(tmp_path)
    record: dict[str, Any] = {"driver": report["nvml"].get("driver_version"), "gpus": []}
    supports = {"ok", "not_supported", "unknown"}
    for entry in report["gpus"]:
        health = entry["health"]
        assert health is not None, f"GPU {entry['index']}: health was not read"
        rows, pages = health["remapped_rows"], health["retired_pages"]
        assert health["events"] in supports
        assert health["recovery_action_support"] in supports
        assert rows["support"] in supports
        assert pages["support"] in supports
        assert (health["recovery_action"] is not None) == (
            health["recovery_action_support"] == "ok"
        )
        assert (rows["pending"] is not None) == (rows["support"] == "ok")
        assert (pages["pending"] is not None) == (pages["support"] == "ok")
        record["gpus"].append(
            {
                "name": entry["name"],
                "architecture": entry["architecture"],
                "mig_enabled": entry["mig_enabled"],
                "health": health,
            }
        )
    record["health_findings"] = [
        {"kind": f["kind"], "gpu": f["gpu"], "reason": f["reason"]}
        for f in report["findings"]
        if f["kind"] in ("reset_required", "reboot_required", "drain_required")
    ]
    # What the real driver did, for the record.
    print(f"real-driver health observation: {json.dumps(record)}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu-health.json").write_text(json.dumps(record, indent=2))


@needs_driver
def test_a_scan_beside_a_dry_run_daemon_is_answered_by_it_and_finds_what_a_walk_finds(
    tmp_path: Path,
) -> None:
    """On the real driver: a dry-run daemon this test starts (every reset command ``false``,
    no hooks) publishes its view and answers a plain ``scan`` over its socket; the answer
    lists the same GPUs and holders as ``scan --full``, which walks ``/proc`` and reads NVML
    itself (docs/scan.md, "Answered by the daemon"). Only this test's own daemon is signalled."""
    state = tmp_path / "state"
    config = tmp_path / "gpuwatchd.yaml"
    false = shutil.which("false") or "/bin/false"
    config.write_text(
        f"interval: 1s\ndry_run: true\nstate_dir: {state}\nreset:\n"
        f'  command: [{false}, "{{uuid}}"]\n'
        f'  persistence_command: [{false}, "{{mode}}", "{{uuid}}"]\n'
        f'  health_command: [{false}, "{{uuid}}"]\n'
        f'  mig_recovery_commands: [[{false}, "{{uuid}}", "{{gi}}"]]\n'
    )
    log = (tmp_path / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(config)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (state / "scan.sock").exists() or not _view_clean(state):
            if daemon.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the daemon published no clean view: {_tail(tmp_path)}")
            time.sleep(0.1)
        answered = _scan(config)
        full = _scan(config, "--full")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
        log.close()
    view = answered["daemon_view"]
    record = {"answered_by": view.get("answered_by"), "reason": view.get("reason"),
              "nvml_reading": answered["nvml_reading"]}  # fmt: skip
    print(f"real-driver observation: {json.dumps(record)}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu-answered-scan.json").write_text(json.dumps(record, indent=2))
    assert view["answered_by"] == "daemon", view
    assert full["daemon_view"]["answered_by"] == "this scan"
    assert [g["uuid"] for g in answered["gpus"]] == [g["uuid"] for g in full["gpus"]]
    for ours, walked in zip(answered["gpus"], full["gpus"], strict=True):
        assert ours["memory"]["total"] == walked["memory"]["total"]
        assert {h["pid"] for h in ours["holders"]} == {h["pid"] for h in walked["holders"]}
    assert daemon.returncode == 0, _tail(tmp_path)
    assert not (state / "scan.sock").exists()


def _view_clean(state: Path) -> bool:
    try:
        return json.loads((state / "holders.json").read_text()).get("clean") is True
    except (OSError, ValueError):
        return False


def _tail(folder: Path) -> str:
    try:
        return (folder / "daemon.log").read_text()[-3000:]
    except OSError:
        return "(no log)"


def _scan(config: Path, *extra: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "scan", "--json", "--config", str(config), *extra],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode in (0, 77), result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _record(name: str, record: Mapping[str, Any]) -> None:
    """What the real driver did, printed and (on a lent machine) written to ``$OUT``."""
    print(f"real-driver observation ({name}): {json.dumps(record)}")
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{name}.json").write_text(json.dumps(record, indent=2))


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize("api", ["driver", "torch"])
def test_the_daemon_frees_the_memory_a_dead_cuda_launchers_worker_pins(
    tmp_path: Path, api: str
) -> None:
    """The mission on a real driver: enforce mode, only this run's tag, resets off.

    Run in a PID namespace of its own where the driver reports PIDs as that namespace sees
    them; where it does not (NVML lists the launcher under another PID), the same scenario runs
    in the host's namespace, where the rule's tag, the kill cap of two and the pidfd-pinned
    identities keep it to this test's two processes.
    """
    if api == "torch" and (reason := _torch_cuda()):
        pytest.skip(reason)
    enabled = [row[0] for row in smi("gpu", "index,mig.mode.current") if row[1] == "Enabled"]
    if enabled:
        pytest.skip(f"MIG mode on GPU(s) {enabled}: the core loop needs a whole GPU")
    arg = {"mode": "real", "tag": f"gputest{os.getpid()}{api}", "api": api}
    record: dict[str, Any] | None = None
    if pid_namespace_command() is not None:
        (tmp_path / "ns").mkdir()
        record = run_in_pid_namespace(
            "tests.support.gpucoreloop:core_loop", arg, root=tmp_path / "ns", timeout=420
        )
    if record is None or "namespace_unusable" in record:
        first = record.get("namespace_unusable") if record else "no PID namespace here"
        (tmp_path / "host").mkdir()
        record = core_loop(arg, tmp_path / "host")
        record["namespace_tried"] = first
    _record(f"gpu-core-loop-{api}", {k: v for k, v in record.items() if k != "log_tail"})
    if "skip" in record:
        pytest.skip(record["skip"])
    assert_core_loop(record)


def _mig_available() -> dict[str, str]:
    """``mig.mode.current`` per GPU index, for the GPUs that support MIG at all."""
    rows = smi("gpu", "index,mig.mode.current")
    return {row[0]: row[1] for row in rows if row[1] in ("Enabled", "Disabled")}


@needs_driver
def test_mig_minors_and_instance_profiles_are_read_read_only(tmp_path: Path) -> None:
    """Where MIG is available: the driver's real ``mig-minors`` file parses with the daemon's
    parser and names every MIG-capable GPU's minor; ``nvidia-smi mig -lgip`` lists the
    instance profiles (a listing, never a change); each GPU instance scan reports sits in the
    table and has one of the listed profiles. Nothing is created or destroyed."""
    modes = _mig_available()
    if not modes:
        pytest.skip("MIG is not available on these GPUs (mig.mode.current is N/A)")
    table, why = read_mig_minors(DEFAULT_MIG_MINORS_FILE)
    assert why is None, why
    assert table is not None
    capabilities = set(table.values())
    report = scan_json(tmp_path)
    listing = subprocess.run(
        ["nvidia-smi", "mig", "-lgip"], capture_output=True, text=True, timeout=60, check=False
    )
    record: dict[str, Any] = {
        "mig_modes": modes,
        "capabilities": len(capabilities),
        "gpu_minors": sorted({c.gpu_minor for c in capabilities}),
        "lgip_exit": listing.returncode,
        "lgip": listing.stdout[-4000:],
        "instances": [],
    }
    try:
        for entry in report["gpus"]:
            if str(entry["index"]) not in modes:
                continue
            assert any(c.gpu_minor == entry["minor"] for c in capabilities), entry["minor"]
            for instance in entry.get("mig_instances") or []:
                record["instances"].append(
                    {k: instance.get(k) for k in ("gi", "ci", "profile", "placement")}
                )
                assert (entry["minor"], instance["gi"]) in {
                    (c.gpu_minor, c.gi) for c in capabilities if c.ci is None
                }
                if instance.get("profile"):
                    assert f"MIG {instance['profile']}" in listing.stdout, instance["profile"]
        if "Enabled" in modes.values():
            assert listing.returncode == 0, listing.stderr
            assert "MIG " in listing.stdout
    finally:
        _record("gpu-mig-read-only", record)
