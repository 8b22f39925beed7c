"""The ``scan`` report: the JSON document's shape and values, and the text view's lines.

Snapshots are built by hand from the model types; roles stand in for what the assessment
concludes, so these tests pin only how the report presents them.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping
from typing import Any

import pytest

from gpuwatchd.cli.report import build_report
from gpuwatchd.cli.report_text import render_text
from gpuwatchd.core import model
from gpuwatchd.core.vocabulary import HolderRoleName
from gpuwatchd.decide.assess.shared import HolderRole

GIB = 1024 * model.MIB
UUID0 = "GPU-00000000-aaaa-0000-0000-000000000000"
UUID1 = "GPU-11111111-bbbb-1111-1111-111111111111"
UUID2 = "GPU-22222222-cccc-2222-2222-222222222222"
UUID3 = "GPU-33333333-dddd-3333-3333-333333333333"
NOW = 1_700_000_000.0
BOOT = NOW - 86_400.0  # booted a day ago
TICKS = 100


def holder_role(
    pid: int,
    gpu: str,
    role: str,
    *,
    owner_pid: int | None = None,
    via: tuple[str, ...] = ("fd",),
    note: str = "",
) -> HolderRole:
    return HolderRole(pid, gpu, HolderRoleName(role), owner_pid, via, note)


def proc(pid: int, **overrides: object) -> model.ProcessInfo:
    base = model.ProcessInfo(
        pid=pid,
        start_ticks=(86_400 - 3_600) * TICKS,  # started an hour ago
        state="S",
        ppid=1,
        pgid=pid,
        sid=pid,
        uid=1000,
        user="alice",
        comm="python",
        exe="/usr/bin/python3.11",
        cmdline=("python", "train.py", "--epochs", "90"),
        cgroup=model.CgroupInfo(
            path="/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0",
            slurm_job="4242",
            slurm_step="0",
        ),
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def _h100(
    index: int,
    uuid: str,
    bus: str,
    *,
    free: int,
    allocated: int,
    persistence: bool,
    processes: tuple[model.NvmlProcess, ...],
) -> model.GpuInfo:
    """An 80 GiB H100 (512 MiB reserved), MIG off, that NVML reads in full."""
    memory = model.GpuMemory(
        total=80 * GIB, free=free, reserved=512 * model.MIB, allocated=allocated
    )
    return model.GpuInfo(
        index=index, uuid=uuid, name="NVIDIA H100 80GB HBM3", pci_bus_id=bus, minor=index,
        memory=memory, processes=processes, mig_enabled=False, persistence_mode=persistence,
    )  # fmt: skip


def make_snapshot(*, wedged: bool = False, host_namespaces: bool | None = True) -> model.Snapshot:
    gpus = (
        _h100(
            0,
            UUID0,
            "00000000:17:00.0",
            free=78 * GIB,
            allocated=int(1.5 * GIB),
            persistence=True,
            processes=(
                model.NvmlProcess(pid=1999, used_memory=512 * model.MIB, kind="compute"),
                model.NvmlProcess(pid=1000, used_memory=GIB, kind="compute"),
            ),
        ),
        _h100(
            1,
            UUID1,
            "00000000:2A:00.0",
            free=79 * GIB,
            allocated=700 * model.MIB,
            persistence=False,
            processes=(model.NvmlProcess(pid=3000, used_memory=None, kind="compute"),),
        ),
        model.GpuInfo(
            index=2,
            uuid=UUID2,
            name="NVIDIA H100 80GB HBM3",
            minor=2,
            lost=True,
            error="GPU is lost",
        ),
        # v1-only memory query, no process list, most facts unknown
        model.GpuInfo(
            index=3,
            uuid=UUID3,
            memory=model.GpuMemory(
                total=16 * GIB,
                free=15 * GIB,
                reserved=None,
                allocated=None,
                api="v1",
                used_v1=GIB,
            ),
            processes=None,
        ),
    )
    processes = {
        1000: proc(1000),
        1001: proc(1001, ppid=1000, pgid=1000, sid=1000),
        2000: proc(
            2000,
            user="bob",
            uid=1001,
            ppid=1,
            pgid=1999,
            sid=1999,
            cmdline=("python", "-c", "from multiprocessing.spawn import spawn_main"),
            cgroup=model.CgroupInfo(
                path="/user.slice/user-1001.slice/session-3.scope", systemd_unit="session-3.scope"
            ),
        ),
        4000: proc(
            4000,
            user="root",
            uid=0,
            comm="nvidia-smi",
            cmdline=("nvidia-smi",),
            cgroup=model.CgroupInfo(path="/system.slice/cron.service", systemd_unit="cron.service"),
        ),
        5000: proc(5000, user="root", uid=0, comm="gpuwatchd", cmdline=("gpuwatchd", "scan")),
        7000: proc(7000, user="carol", uid=1002, cmdline=("./cuda_probe",), cgroup=None),
    }
    holders = model.HolderScan(
        mode="full",
        holdings={
            1000: model.DeviceHolding(1000, frozenset({0}), frozenset({0}), ctl=True, uvm=True),
            1001: model.DeviceHolding(1001, frozenset(), frozenset({0}), ctl=True, uvm=True),
            2000: model.DeviceHolding(2000, frozenset({0}), frozenset(), ctl=True, uvm=True),
            4000: model.DeviceHolding(4000, frozenset({1}), frozenset(), ctl=True, uvm=False),
            5000: model.DeviceHolding(5000, frozenset({0}), frozenset(), ctl=True),
            7000: model.DeviceHolding(7000, ctl=True, uvm=True),  # no per-GPU node
            7001: model.DeviceHolding(
                7001, frozenset({9}), frozenset()
            ),  # a minor NVML did not list
        },
        unreadable=frozenset({6001, 6000}),
    )
    return model.Snapshot(
        monotonic=1234.5,
        wall_time=NOW,
        boot_id="3f1c0b1e-boot",
        nvml=model.NvmlReading(
            available=True,
            wedged=wedged,
            error="nvmlDeviceGetMemoryInfo timed out after 10s" if wedged else None,
            driver_version="550.54.15",
            gpus=gpus,
        ),
        processes=processes,
        holders=holders,
        self_pids=frozenset({5000}),
        host_namespaces=host_namespaces,
    )


ROLES = (
    holder_role(1000, UUID0, "context_owner", via=("fd", "map")),
    holder_role(1001, UUID0, "worker", owner_pid=1000, via=("map",)),
    holder_role(2000, UUID0, "orphaned", owner_pid=1999, note="inherited from dead 1999"),
    holder_role(4000, UUID1, "management", note="NVML-only client"),
    holder_role(7000, "node", "hidden", via=(), note="holds nvidiactl and nvidia-uvm only"),
)

FINDINGS = (
    model.Finding(
        model.FindingKind.DEAD_PROCESS,
        UUID0,
        1999,
        None,
        "NVML lists pid 1999, not in /proc",
        memory=512 * model.MIB,
        actionable=False,
    ),
    model.Finding(
        model.FindingKind.ORPHANED,
        UUID0,
        2000,
        12345,
        "holds GPU 0 from dead owner 1999",
        memory=None,
        evidence={"dead_owner": 1999, "via": ("fd",), "minors": frozenset({0})},
    ),
    model.Finding(
        model.FindingKind.GHOST_MEMORY,
        UUID1,
        None,
        None,
        "700 MiB allocated, baseline 4 MiB, no live holder",
        memory=696 * model.MIB,
    ),
    model.Finding(
        model.FindingKind.DEAD_PROCESS,
        UUID1,
        3000,
        None,
        "NVML lists pid 3000, not in /proc",
        actionable=False,
    ),
)


def make_report(**kwargs: object) -> dict[str, object]:
    snapshot_kwargs = {k: kwargs.pop(k) for k in ("wedged", "host_namespaces") if k in kwargs}
    arguments: dict[str, object] = {
        "findings": FINDINGS,
        "roles": ROLES,
        "report_only": {UUID3: "MIG enabled"},
        "notes": {UUID1: ("targeted holder scan",), "node": ("pid 6000 unreadable",)},
        "baselines": {UUID1: 4 * model.MIB},
        "first_seen": {FINDINGS[2].key: NOW - 600},
        "version": "0.1.0",
        "hostname": "node17",
        "boot_time": BOOT,
        "clock_ticks": TICKS,
    }
    arguments.update(kwargs)
    return build_report(make_snapshot(**snapshot_kwargs), **arguments)  # type: ignore[arg-type]


def gpu(report: Mapping[str, object], index: int) -> dict[str, object]:
    for entry in report["gpus"]:  # type: ignore[attr-defined]
        if entry["index"] == index:
            return entry  # type: ignore[no-any-return]
    raise AssertionError(f"no GPU {index}")


def none_for(field: str) -> dict[str, Any]:
    return {field: None}


def by_pid(entries: object) -> dict[int, dict[str, object]]:
    return {e["pid"]: e for e in entries}  # type: ignore[attr-defined]


# --- JSON -------------------------------------------------------------------------------------


def test_report_survives_a_json_round_trip_unchanged() -> None:
    report = make_report()
    assert json.loads(json.dumps(report)) == report


def test_top_level_shape_and_node_facts() -> None:
    report = make_report()
    assert set(report) == {
        "version",
        "time",
        "host",
        "nvml",
        "scan_mode",
        "gpus",
        "findings",
        "node_holders",
        "report_only",
        "notes",
        "unreadable_pids",
        "thread_tables_unread_pids",
    }
    assert report["version"] == "0.1.0"
    assert report["time"] == NOW
    assert report["host"] == {
        "hostname": "node17",
        "boot_id": "3f1c0b1e-boot",
        "host_namespaces": True,
        "mps_server_running": False,
    }
    assert report["nvml"] == {
        "available": True,
        "wedged": False,
        "error": None,
        "driver_version": "550.54.15",
    }
    assert report["scan_mode"] == "full"
    assert report["unreadable_pids"] == [6000, 6001]
    assert report["report_only"] == {UUID3: "MIG enabled"}
    assert report["notes"] == {"node": ["pid 6000 unreadable"], UUID1: ["targeted holder scan"]}
    assert gpu(report, 1)["notes"] == ["targeted holder scan"]
    assert gpu(report, 0)["notes"] == []


def test_holders_of_no_listed_gpu_are_node_holders_not_dropped() -> None:
    holders = by_pid(make_report()["node_holders"])
    assert sorted(holders) == [7000, 7001]
    assert holders[7000]["devices"] == ["nvidiactl", "nvidia-uvm"]
    assert holders[7000]["role"] == "hidden"
    assert holders[7000]["user"] == "carol"
    assert holders[7000]["cgroup"] is None
    assert holders[7001]["devices"] == ["nvidia9"]
    assert holders[7001]["role"] is None
    assert holders[7001]["alive"] is None  # seen holding a file; its facts were not collected
    assert holders[7001]["user"] is None


def test_gpus_are_ordered_by_index_with_memory_in_integer_bytes() -> None:
    report = make_report()
    assert [g["index"] for g in report["gpus"]] == [0, 1, 2, 3]  # type: ignore[attr-defined]
    first = gpu(report, 0)
    assert first["uuid"] == UUID0
    assert first["pci_bus_id"] == "00000000:17:00.0"
    assert first["memory"] == {
        "total": 80 * GIB,
        "used": int(1.5 * GIB),
        "reserved": 512 * model.MIB,
        "free": 78 * GIB,
        "baseline": None,
        "api": "v2",
        "used_v1": None,
    }
    assert gpu(report, 1)["memory"]["baseline"] == 4 * model.MIB  # type: ignore[index]
    for entry in report["gpus"]:  # type: ignore[attr-defined]
        for value in entry["memory"].values():
            assert value is None or isinstance(value, (int, str))
            assert not isinstance(value, float)


def test_v1_gpu_reports_used_as_null_and_keeps_the_v1_figure_apart() -> None:
    v1 = gpu(make_report(), 3)
    assert v1["memory"]["used"] is None  # type: ignore[index]
    assert v1["memory"]["used_v1"] == GIB  # type: ignore[index]
    assert v1["memory"]["api"] == "v1"  # type: ignore[index]
    assert v1["processes_known"] is False
    assert v1["processes"] == []
    assert v1["report_only"] == "MIG enabled"
    assert v1["name"] is None
    assert v1["minor"] is None


def test_lost_gpu_is_listed_with_its_error_and_unknown_memory() -> None:
    lost = gpu(make_report(), 2)
    assert lost["lost"] is True
    assert lost["error"] == "GPU is lost"
    assert set(lost["memory"].values()) == {None}  # type: ignore[attr-defined]


def test_holders_carry_roles_host_facts_and_exclude_the_daemon_itself() -> None:
    holders = by_pid(gpu(make_report(), 0)["holders"])
    assert sorted(holders) == [1000, 1001, 2000]  # 5000 is gpuwatchd itself
    owner, worker, orphan = holders[1000], holders[1001], holders[2000]
    assert owner["role"] == "context_owner"
    assert owner["nvml_listed"] is True
    assert owner["used_memory"] == GIB
    assert owner["via"] == ["fd", "map"]
    assert owner["uvm"] is True
    assert owner["cmdline"] == ["python", "train.py", "--epochs", "90"]
    assert owner["cgroup"]["slurm_job"] == "4242"  # type: ignore[index]
    assert owner["cgroup"]["job"] == "slurm:4242"  # type: ignore[index]
    assert owner["started"] == pytest.approx(NOW - 3600)
    assert worker["role"] == "worker"
    assert worker["owner_pid"] == 1000
    assert worker["via"] == ["map"]
    assert worker["nvml_listed"] is False
    assert worker["used_memory"] is None
    assert (worker["ppid"], worker["pgid"], worker["sid"]) == (1000, 1000, 1000)
    assert orphan["role"] == "orphaned"
    assert orphan["owner_pid"] == 1999
    assert orphan["user"] == "bob"
    assert orphan["note"] == "inherited from dead 1999"
    assert orphan["cgroup"]["job"] is None  # type: ignore[index]  # a login scope is no job


def test_nvml_processes_are_merged_with_host_facts_and_dead_pids_have_none() -> None:
    processes = by_pid(gpu(make_report(), 0)["processes"])
    assert sorted(processes) == [1000, 1999]
    owner, dead = processes[1000], processes[1999]
    assert owner["alive"] is True
    assert owner["type"] == "compute"
    assert owner["role"] == "context_owner"
    assert owner["user"] == "alice"
    assert owner["start_ticks"] == (86_400 - 3_600) * TICKS
    assert dead["alive"] is False
    assert dead["used_memory"] == 512 * model.MIB
    assert dead["role"] is None
    for key in ("user", "state", "start_ticks", "cmdline", "ppid", "pgid", "sid", "cgroup"):
        assert dead[key] is None, key


def test_findings_use_uuids_null_pid_for_gpu_level_and_first_seen_when_known() -> None:
    findings = make_report()["findings"]
    assert [(f["kind"], f["pid"]) for f in findings] == [  # type: ignore[attr-defined]
        ("dead_process", 1999),
        ("orphaned", 2000),
        ("dead_process", 3000),
        ("ghost_memory", None),
    ]
    ghost = findings[3]  # type: ignore[index]
    assert ghost["gpu"] == UUID1
    assert ghost["start_ticks"] is None
    assert ghost["memory"] == 696 * model.MIB
    assert ghost["first_seen"] == NOW - 600
    assert ghost["key"] == f"ghost_memory:{UUID1}:gpu"
    orphan = findings[1]  # type: ignore[index]
    assert orphan["first_seen"] is None
    assert orphan["actionable"] is True
    assert orphan["evidence"] == {"dead_owner": 1999, "via": ["fd"], "minors": [0]}
    assert findings[0]["actionable"] is False  # type: ignore[index]


def test_report_does_not_depend_on_input_order() -> None:
    shuffled_roles = list(ROLES)
    shuffled_findings = list(FINDINGS)
    random.Random(7).shuffle(shuffled_roles)
    random.Random(7).shuffle(shuffled_findings)
    assert make_report(roles=shuffled_roles, findings=shuffled_findings) == make_report()


def test_start_times_are_null_without_boot_time() -> None:
    report = make_report(boot_time=None)
    assert gpu(report, 0)["holders"][0]["started"] is None  # type: ignore[index]


# --- text -------------------------------------------------------------------------------------


def lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def test_text_gpu_header_names_index_name_uuid_and_bus_id() -> None:
    text = render_text(make_report())
    (header,) = lines_with(text, UUID0)
    assert header.startswith("GPU 0")
    assert "NVIDIA H100 80GB HBM3" in header
    assert "00000000:17:00.0" in header
    assert "total 80.0 GiB  allocated 1.5 GiB  reserved 512 MiB  baseline not learned" in text
    assert "baseline 4 MiB" in text
    assert "allocated ? (v1 query: used 1.0 GiB incl. reservation)" in text


@pytest.mark.parametrize(
    ("pid", "expected"),
    [
        (
            "1000",
            [
                "alice",
                "S",
                "context owner",
                "1.0 GiB",
                "fd,map",
                "slurm:4242",
                "1h00m",
                "python train.py --epochs 90",
            ],
        ),
        ("1001", ["alice", "worker of 1000", "map", "slurm:4242"]),
        ("2000", ["bob", "orphaned from 1999", "fd", "session-3.scope"]),
        ("1999", ["dead (NVML)", "512 MiB", "-"]),
        ("4000", ["root", "management client", "cron.service", "nvidia-smi"]),
        ("3000", ["dead (NVML)", "?", "-"]),
    ],
)
def test_text_has_one_row_per_holder_or_listed_process(pid: str, expected: list[str]) -> None:
    rows = [line for line in render_text(make_report()).splitlines() if line.split()[:1] == [pid]]
    assert len(rows) == 1
    for cell in expected:
        assert cell in rows[0], (cell, rows[0])


def test_text_lists_node_holders_and_notes_in_the_node_section() -> None:
    text = render_text(make_report())
    node_at = text.splitlines().index("node")
    (row,) = [line for line in text.splitlines() if line.split()[:1] == ["7000"]]
    assert text.splitlines().index(row) > node_at
    for cell in ("carol", "hidden holder", "nvidiactl,nvidia-uvm", "./cuda_probe"):
        assert cell in row
    assert "note (node): pid 6000 unreadable" in text
    (gpu1_note,) = lines_with(text, "note: targeted holder scan")
    assert text.splitlines().index(gpu1_note) < node_at


def test_text_never_lists_the_daemon_itself() -> None:
    text = render_text(make_report())
    assert not [line for line in text.splitlines() if line.split()[:1] == ["5000"]]


def test_text_columns_line_up_under_their_headers() -> None:
    text = render_text(make_report())
    lines = text.splitlines()
    header_at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("PID"))
    header = lines[header_at]
    role_col = header.index("ROLE")
    rows = lines[header_at + 1 : header_at + 5]
    assert [row[role_col:].split("  ")[0] for row in rows] == [
        "context owner",
        "worker of 1000",
        "dead (NVML)",
        "orphaned from 1999",
    ]


def test_text_lists_findings_with_their_reasons_under_their_gpu() -> None:
    text = render_text(make_report())
    (orphan,) = lines_with(text, "holds GPU 0 from dead owner 1999")
    assert "orphaned" in orphan
    assert "pid 2000" in orphan
    assert "actionable" in orphan
    (ghost,) = lines_with(text, "no live holder")
    assert "gpu" in ghost.split()
    assert "696 MiB" in ghost
    assert "for 10m" in ghost
    # Ghost memory is "no holder that /proc shows": the text says what no walk can see.
    (unseen,) = lines_with(text, "nobody that /proc shows holds it")
    assert text.index(unseen) > text.index(ghost)
    assert lines_with(text, "(SCM_RIGHTS)")
    (dead,) = lines_with(text, "NVML lists pid 1999")
    assert "report only" in dead
    # findings come after their own GPU's header and before the next GPU's
    lines = text.splitlines()
    assert lines.index(lines_with(text, UUID0)[0]) < lines.index(orphan)
    assert lines.index(orphan) < lines.index(lines_with(text, UUID1)[0]) < lines.index(ghost)


def test_text_node_notes_say_wedged_unreadable_and_report_only() -> None:
    text = render_text(make_report(wedged=True))
    (wedged,) = lines_with(text, "driver wedged")
    assert "nvmlDeviceGetMemoryInfo timed out after 10s" in wedged
    (unreadable,) = lines_with(text, "could not be inspected")
    assert "6000, 6001" in unreadable
    assert "report-only: MIG enabled" in text
    assert "LOST" in lines_with(text, "error: GPU is lost")[0]
    assert "processes: ? (NVML could not list them)" in text
    assert "processes: ? (the GPU is lost)" in text


def test_text_node_note_when_host_namespaces_are_not_visible() -> None:
    text = render_text(make_report(host_namespaces=False))
    assert "does not see the host PID and cgroup namespaces" in text
    with_reason = render_text(
        make_report(host_namespaces=False, report_only={"node": "no hostPID"})
    )
    assert "report-only (node): no hostPID" in with_reason
    assert "does not see the host PID" not in with_reason


def test_text_has_colors_only_when_asked() -> None:
    assert "\x1b[" not in render_text(make_report())
    assert "\x1b[" in render_text(make_report(), color=True)


def test_text_escapes_control_characters_from_hostile_command_lines() -> None:
    snapshot = make_snapshot()
    hostile = proc(1001, cmdline=("evil\n4242  root  R  context owner", "\x1b[2J"))
    snapshot = dataclasses.replace(snapshot, processes={**snapshot.processes, 1001: hostile})
    report = build_report(snapshot, FINDINGS, ROLES, {}, {}, version="0.1.0")
    for color in (False, True):
        text = render_text(report, color=color)
        assert not [line for line in text.splitlines() if line.lstrip().startswith("4242")]
        assert "\x1b[2J" not in text
        assert "evil\\n4242" in text


def test_text_truncates_long_command_lines() -> None:
    snapshot = make_snapshot()
    long = proc(1001, cmdline=("python", "x" * 500))
    snapshot = dataclasses.replace(snapshot, processes={**snapshot.processes, 1001: long})
    text = render_text(build_report(snapshot, (), ROLES, {}, {}, version="0.1.0"))
    (row,) = [line for line in text.splitlines() if line.split()[:1] == ["1001"]]
    assert row.endswith("...")
    assert "x" * 100 not in row


def test_text_names_a_worker_and_an_orphan_by_their_owner() -> None:
    """The ROLE column: ``worker of <owner>``, ``orphaned from <dead owner>``; the bare role
    when no owner is known."""

    def roles_shown(roles: tuple[HolderRole, ...]) -> dict[str, str]:
        text = render_text(build_report(make_snapshot(), (), roles, {}, {}, version="0.1.0"))
        rows = [line.split("  ") for line in text.splitlines() if line.startswith("  1001 ")]
        rows += [line.split("  ") for line in text.splitlines() if line.startswith("  2000 ")]
        return {row[1]: [cell.strip() for cell in row if cell.strip()][3] for row in rows}

    assert roles_shown(ROLES) == {"1001": "worker of 1000", "2000": "orphaned from 1999"}
    bare = (holder_role(1001, UUID0, "worker"), holder_role(2000, UUID0, "orphaned"))
    assert roles_shown((ROLES[0], *bare)) == {"1001": "worker", "2000": "orphaned"}


def test_text_is_stable() -> None:
    assert render_text(make_report()) == render_text(make_report())


def test_text_without_nvml_says_so() -> None:
    snapshot = dataclasses.replace(
        make_snapshot(),
        nvml=model.NvmlReading(available=False, error="libnvidia-ml.so.1 not found"),
    )
    text = render_text(build_report(snapshot, (), (), {}, {}, version="0.1.0"))
    assert "NVML unavailable: libnvidia-ml.so.1 not found" in text
    assert "0 GPUs" in text


# --- the None column --------------------------------------------------------------------------

PROCESS_FIELDS = [
    f.name for f in dataclasses.fields(model.ProcessInfo) if f.name not in ("pid", "kernel_thread")
]
GPU_FIELDS = [
    "name",
    "pci_bus_id",
    "minor",
    "memory",
    "processes",
    "mig_enabled",
    "persistence_mode",
    "numa_node",
    "error",
]
MEMORY_FIELDS = ["total", "free", "reserved", "allocated", "used_v1"]


@pytest.mark.parametrize("field", PROCESS_FIELDS)
def test_unknown_process_fact_is_null_in_json_and_does_not_break_text(field: str) -> None:
    snapshot = make_snapshot()
    processes = {
        pid: dataclasses.replace(info, **none_for(field))
        for pid, info in snapshot.processes.items()
    }
    report = build_report(
        dataclasses.replace(snapshot, processes=processes),
        FINDINGS,
        ROLES,
        {},
        {},
        version="0.1.0",
        boot_time=BOOT,
        clock_ticks=TICKS,
    )
    assert json.loads(json.dumps(report)) == report
    owner = by_pid(gpu(report, 0)["holders"])[1000]
    json_key = {"start_ticks": "start_ticks"}.get(field, field)
    if json_key in owner:
        assert owner[json_key] is None
    text = render_text(report)
    (row,) = [line for line in text.splitlines() if line.split()[:1] == ["1000"]]
    assert "context owner" in row


@pytest.mark.parametrize("field", GPU_FIELDS)
def test_unknown_gpu_fact_does_not_break_json_or_text(field: str) -> None:
    snapshot = make_snapshot()
    gpus = tuple(dataclasses.replace(g, **none_for(field)) for g in snapshot.nvml.gpus)
    snapshot = dataclasses.replace(snapshot, nvml=dataclasses.replace(snapshot.nvml, gpus=gpus))
    report = build_report(snapshot, FINDINGS, ROLES, {}, {}, version="0.1.0")
    assert json.loads(json.dumps(report)) == report
    assert "GPU 0  " in render_text(report)


@pytest.mark.parametrize("field", MEMORY_FIELDS)
def test_unknown_memory_figure_is_null_and_prints_as_question_mark(field: str) -> None:
    snapshot = make_snapshot()
    first = snapshot.nvml.gpus[0]
    assert first.memory is not None
    changed = dataclasses.replace(
        first, memory=dataclasses.replace(first.memory, **none_for(field))
    )
    nvml = dataclasses.replace(snapshot.nvml, gpus=(changed, *snapshot.nvml.gpus[1:]))
    report = build_report(dataclasses.replace(snapshot, nvml=nvml), (), (), {}, {}, version="x")
    json_key = {"allocated": "used"}.get(field, field)
    assert gpu(report, 0)["memory"][json_key] is None  # type: ignore[index]
    render_text(report)


def _nulled(value: object) -> object:
    """The same document with every leaf replaced by None."""
    if isinstance(value, dict):
        return {key: _nulled(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_nulled(item) for item in value]
    return None


@pytest.mark.parametrize(
    "report",
    [
        {},
        {"gpus": None, "findings": None, "host": None, "nvml": None},
        {"gpus": [{}], "findings": [{}]},
        {"gpus": [{"holders": [{}], "processes": [{}]}], "unreadable_pids": ["x", None]},
        {"gpus": ["not a dict"], "findings": [42], "report_only": {"node": None}},
        {"gpus": [{"memory": {"total": "lots", "used": True}, "index": 1.5}]},
    ],
    ids=["empty", "null-sections", "empty-entries", "empty-rows", "wrong-types", "odd-values"],
)
def test_text_renders_any_document_without_raising(report: dict[str, object]) -> None:
    text = render_text(report)
    assert text.endswith("\n")
    assert text.startswith("gpuwatchd ? scan")


def test_text_renders_a_report_whose_every_value_is_null() -> None:
    report = _nulled(make_report(wedged=True))
    assert isinstance(report, dict)
    text = render_text(report, color=True)
    assert "GPU ?" in text
    assert "context owner" not in text
