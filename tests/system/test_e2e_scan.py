"""End to end: ``gpuwatchd scan --json`` on a simulated host, inside a fresh PID namespace.

Each ``host_*`` function runs as PID 1 of its own PID namespace (see tests/support/simhost.py):
it starts real processes that hold the fake device files the way CUDA jobs do, writes the fake
NVML state naming their PIDs, runs the real command line, and returns the JSON report plus the
PIDs. The test functions outside assert on that. Finding kinds that must appear, and the cases
that must NOT be flagged (docs/design-notes.md §4), each have a scenario.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemonrun import job_host, stuck_host
from tests.support.fakenvml import GiB, MiB, gpu, process
from tests.support.simhost import SimHost, pid_namespace_command, run_in_pid_namespace

pytestmark = pytest.mark.skipif(
    pid_namespace_command() is None,
    reason="needs a PID namespace (root, or unprivileged user namespaces) for end-to-end tests",
)


def _scan(host: SimHost, pids: dict[str, int], **config: Any) -> dict[str, Any]:
    report = host.scan_json(host.config(**config))
    return {"report": report, "pids": pids}


# --- scenarios, run inside the namespace ---------------------------------------------------


def host_holder_fd(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        pids = job_host(host)
        return _scan(host, pids)


def host_holder_map_only(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        host.spawn("mapper", [{"mmap": host.dev("nvidia0")[0]}])
        pids = host.wait_ready("mapper")
        host.nvml([gpu(0)])
        return _scan(host, pids)


def host_real_orphan(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        worker = host.script("worker", [{"sleep": 3600}])
        # A job runs in a session of its own (from a shell, a scheduler), so its forked worker
        # keeps the dead trainer's PID as its process group and session.
        host.spawn(
            "trainer", [{"setsid": True}, {"open": host.cuda(0)}, {"fork": worker}, {"exit": 0}]
        )
        pids = host.wait_ready("trainer", "worker")
        host.wait_gone("trainer")
        host.nvml([gpu(0, allocated=700 * MiB, processes=[process(pids["trainer"], 700 * MiB)])])
        return _scan(host, pids)


def host_nohup_job(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """`setsid nohup python train.py &` from a script that exits: a healthy detached job."""
    with SimHost(root) as host:
        job = host.script("job", [{"open": host.cuda(0)}, {"sleep": 3600}])
        host.spawn("launcher", [{"setsid": True}, {"fork": job}, {"exit": 0}])
        pids = host.wait_ready("launcher", "job")
        host.wait_gone("launcher")
        host.nvml([gpu(0, allocated=900 * MiB, processes=[process(pids["job"], 900 * MiB)])])
        return _scan(host, pids)


def host_daemon_ppid1(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        host.spawn("server", [{"open": host.cuda(0)}])  # our child: ppid 1 in the namespace
        pids = host.wait_ready("server")
        host.nvml([gpu(0, allocated=2 * GiB, processes=[process(pids["server"], 2 * GiB)])])
        result = _scan(host, pids)
        result["ppid"] = _ppid(pids["server"])
        return result


def host_dataloader_workers(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        w1 = host.script("w1", [{"sleep": 3600}])
        w2 = host.script("w2", [{"sleep": 3600}])
        host.spawn("trainer", [{"open": host.cuda(0)}, {"fork": w1}, {"fork": w2}])
        pids = host.wait_ready("trainer", "w1", "w2")
        host.nvml([gpu(0, allocated=3 * GiB, processes=[process(pids["trainer"], 3 * GiB)])])
        return _scan(host, pids)


def host_live_job_all_gpus(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """A live job holds every GPU's device file; GPU 2 has memory nobody accounts for."""
    with SimHost(root, gpus=3) as host:
        host.spawn("job", [{"open": host.dev("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1")}])
        host.spawn("job2", [{"open": host.dev("nvidia2")}])
        pids = host.wait_ready("job", "job2")
        job = pids["job"]
        host.nvml(
            [
                gpu(0, allocated=GiB, processes=[process(job, GiB)]),
                gpu(1, allocated=GiB, processes=[process(job, GiB)]),
                gpu(2, allocated=4 * GiB),
            ]
        )
        return _scan(host, pids)


def host_nvml_only_client(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """An inheritor of a dead owner that holds nvidiactl + the GPU but no nvidia-uvm."""
    with SimHost(root) as host:
        monitor = host.script("monitor", [{"sleep": 3600}])
        host.spawn(
            "owner",
            [{"open": host.dev("nvidiactl", "nvidia0")}, {"fork": monitor}, {"exit": 0}],
        )
        pids = host.wait_ready("owner", "monitor")
        host.wait_gone("owner")
        host.nvml([gpu(0, allocated=GiB, processes=[process(pids["owner"], GiB)])])
        return _scan(host, pids)


def host_zombie(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        dead_child = host.script("child", [{"open": host.cuda(0)}, {"exit": 0}])
        host.spawn("parent", [{"fork": dead_child}, {"sleep": 3600}])
        pids = host.wait_ready("parent", "child")
        deadline = time.monotonic() + 10
        while SimHost.state_of(pids["child"]) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        host.nvml([gpu(0, allocated=GiB, processes=[process(pids["child"], GiB)])])
        return _scan(host, pids)


def host_stuck(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """A holder of GPU 0 in uninterruptible sleep (D): it cannot be killed."""
    with SimHost(root) as host:
        pids = stuck_host(host)
        return _scan(host, pids)


def host_ghost(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root, gpus=2) as host:
        host.nvml([gpu(0, allocated=2 * GiB), gpu(1)])
        return _scan(host, {})


def host_unaccounted(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        host.spawn("job", [{"open": host.cuda(0)}])
        pids = host.wait_ready("job")
        host.nvml([gpu(0, allocated=20 * GiB, processes=[process(pids["job"], GiB)])])
        return _scan(host, pids)


def host_big(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """8 GPUs, 60 GPU processes (live jobs, their workers, four orphans), 300 bystanders.

    Each job runs in its own session, as jobs started by a scheduler or a login shell do.
    """
    with SimHost(root, gpus=8) as host:
        host.spawn("bystanders", [{"fork": host.script(f"b{i}", [])} for i in range(300)])
        names = []
        for g in range(8):
            for j in range(5):
                worker = host.script(f"w{g}-{j}", [{"sleep": 3600}])
                steps: list[dict[str, Any]] = [
                    {"setsid": True},
                    {"open": host.cuda(g)},
                    {"fork": worker},
                ]
                host.spawn(f"t{g}-{j}", steps)
                names += [f"t{g}-{j}", f"w{g}-{j}"]
        for g in range(4):
            orphan = host.script(f"o{g}", [{"sleep": 3600}])
            steps = [{"setsid": True}, {"open": host.cuda(g)}, {"fork": orphan}, {"exit": 0}]
            host.spawn(f"dead{g}", steps)
            names += [f"dead{g}", f"o{g}"]
        pids = host.wait_ready(*names, "bystanders", timeout=60)
        host.wait_gone(*(f"dead{g}" for g in range(4)))
        gpus = []
        for g in range(8):
            procs = [process(pids[f"t{g}-{j}"], GiB) for j in range(5)]
            if g < 4:
                procs.append(process(pids[f"dead{g}"], GiB))
            gpus.append(gpu(g, allocated=len(procs) * GiB, processes=procs))
        host.nvml(gpus)
        started = time.monotonic()
        result = _scan(host, pids)
        result["seconds"] = time.monotonic() - started
        return result


def _ppid(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[1])


# --- helpers for assertions ----------------------------------------------------------------


def run(name: str, tmp_path: Path, timeout: float = 120.0) -> dict[str, Any]:
    return run_in_pid_namespace(f"{__name__}:{name}", {}, root=tmp_path, timeout=timeout)


def findings(result: dict[str, Any], kind: str | None = None) -> list[dict[str, Any]]:
    found = result["report"]["findings"]
    return [f for f in found if kind is None or f["kind"] == kind]


def holders(result: dict[str, Any], gpu_index: int = 0) -> dict[int, dict[str, Any]]:
    return {h["pid"]: h for h in result["report"]["gpus"][gpu_index]["holders"]}


def process_findings_for(result: dict[str, Any], pid: int) -> list[str]:
    return [f["kind"] for f in findings(result) if f["pid"] == pid]


# --- tests ---------------------------------------------------------------------------------


def test_holder_through_fd_is_a_context_owner_and_quiet(tmp_path: Path) -> None:
    result = run("host_holder_fd", tmp_path)
    job = result["pids"]["job"]
    held = holders(result)
    assert held[job]["role"] == "context_owner"
    assert "fd" in held[job]["via"]
    assert findings(result) == []
    memory = result["report"]["gpus"][0]["memory"]
    assert memory["used"] == 600 * MiB
    assert isinstance(memory["total"], int)


def test_holder_through_mapping_only_is_seen(tmp_path: Path) -> None:
    result = run("host_holder_map_only", tmp_path)
    mapper = result["pids"]["mapper"]
    held = holders(result)
    assert mapper in held
    assert held[mapper]["via"] == ["map"]
    assert process_findings_for(result, mapper) == ["hidden_holder"]


def test_real_orphan_and_dead_owner_are_found(tmp_path: Path) -> None:
    result = run("host_real_orphan", tmp_path)
    trainer, worker = result["pids"]["trainer"], result["pids"]["worker"]
    dead = findings(result, "dead_process")
    assert [f["pid"] for f in dead] == [trainer]
    orphans = findings(result, "orphaned")
    assert [f["pid"] for f in orphans] == [worker]
    assert orphans[0]["gpu"] == result["report"]["gpus"][0]["uuid"]
    assert orphans[0]["reason"]
    assert orphans[0]["actionable"] is True


def test_healthy_nohup_job_is_not_flagged(tmp_path: Path) -> None:
    result = run("host_nohup_job", tmp_path)
    job = result["pids"]["job"]
    assert findings(result) == []
    assert holders(result)[job]["role"] == "context_owner"


def test_daemon_style_process_with_ppid_1_is_not_flagged(tmp_path: Path) -> None:
    result = run("host_daemon_ppid1", tmp_path)
    assert result["ppid"] == 1
    assert findings(result) == []


def test_dataloader_workers_of_a_live_trainer_are_listed_under_it(tmp_path: Path) -> None:
    result = run("host_dataloader_workers", tmp_path)
    pids = result["pids"]
    held = holders(result)
    for worker in ("w1", "w2"):
        assert held[pids[worker]]["role"] == "worker"
        assert held[pids[worker]]["owner_pid"] == pids["trainer"]
    assert findings(result) == []


def test_live_job_holding_every_gpu_is_not_orphaned_by_unaccounted_memory(
    tmp_path: Path,
) -> None:
    result = run("host_live_job_all_gpus", tmp_path)
    job = result["pids"]["job"]
    assert process_findings_for(result, job) == []
    assert findings(result, "orphaned") == []


def test_nvml_only_client_is_never_orphaned(tmp_path: Path) -> None:
    result = run("host_nvml_only_client", tmp_path)
    monitor = result["pids"]["monitor"]
    assert "orphaned" not in process_findings_for(result, monitor)
    assert findings(result, "orphaned") == []


def test_listed_zombie_is_reported_with_its_parent(tmp_path: Path) -> None:
    result = run("host_zombie", tmp_path)
    zombies = findings(result, "zombie")
    assert [f["pid"] for f in zombies] == [result["pids"]["child"]]
    assert str(result["pids"]["parent"]) in json.dumps(zombies[0]["evidence"])


def test_holder_in_uninterruptible_sleep_is_stuck(tmp_path: Path) -> None:
    result = run("host_stuck", tmp_path)
    stuck = result["pids"]["stuck"]
    assert process_findings_for(result, stuck) == ["stuck"]
    assert findings(result, "ghost_memory") == []
    assert holders(result)[stuck]["state"] == "D"


def test_ghost_memory_on_a_gpu_nobody_holds(tmp_path: Path) -> None:
    result = run("host_ghost", tmp_path)
    ghosts = findings(result, "ghost_memory")
    assert [f["gpu"] for f in ghosts] == [result["report"]["gpus"][0]["uuid"]]
    assert ghosts[0]["pid"] is None
    assert ghosts[0]["memory"] >= 2 * GiB - 64 * MiB


def test_unaccounted_memory_with_a_live_owner(tmp_path: Path) -> None:
    result = run("host_unaccounted", tmp_path)
    kinds = [f["kind"] for f in findings(result)]
    assert kinds == ["unaccounted_memory"]


@pytest.mark.slow
def test_eight_gpus_sixty_gpu_processes_hundreds_of_bystanders(tmp_path: Path) -> None:
    result = run("host_big", tmp_path, timeout=300)
    pids = result["pids"]
    orphans = sorted(f["pid"] for f in findings(result, "orphaned"))
    assert orphans == sorted(pids[f"o{g}"] for g in range(4))
    dead = sorted(f["pid"] for f in findings(result, "dead_process"))
    assert dead == sorted(pids[f"dead{g}"] for g in range(4))
    assert {f["kind"] for f in findings(result)} == {"orphaned", "dead_process"}
    for g in range(8):
        held = holders(result, g)
        for j in range(5):
            assert held[pids[f"t{g}-{j}"]]["role"] == "context_owner"
            assert held[pids[f"w{g}-{j}"]]["role"] == "worker"
