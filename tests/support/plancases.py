"""Small builders for the planning tests: a policy, processes, snapshots, orphan and ghost
findings, and the signals a plan sends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuwatchd.core import model
from gpuwatchd.decide.plan.intents import PlanResult, SignalIntent
from gpuwatchd.decide.policy import Limits, Policy, Protect, ResetPolicy, Rule, Step

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"
BUS0 = "00000000:3B:00.0"


def proc(
    pid: int = 1000,
    ticks: int | None = 500,
    *,
    state: str = "S",
    user: str | None = "bob",
    comm: str | None = "python3",
    exe: str | None = "/usr/bin/python3.11",
    cmdline: tuple[str, ...] | None = ("python3", "train.py"),
    cgroup: model.CgroupInfo | None = None,
    kernel_thread: bool = False,
    ppid: int = 1,
    uid: int | None = 1000,
    exe_trusted: bool | None = None,
) -> model.ProcessInfo:
    return model.ProcessInfo(
        pid=pid,
        start_ticks=ticks,
        state=state,
        ppid=ppid,
        pgid=pid,
        sid=pid,
        uid=uid,
        user=user,
        comm=comm,
        exe=exe,
        cmdline=cmdline,
        cgroup=cgroup or model.CgroupInfo(path="/user.slice/session-1.scope"),
        kernel_thread=kernel_thread,
        exe_trusted=exe_trusted,
    )


def gpu(
    uuid: str = GPU0,
    minor: int = 0,
    *,
    mig: bool | None = False,
    lost: bool = False,
    arch: int | None = None,
    nvlinks: int | None = None,
) -> model.GpuInfo:
    return model.GpuInfo(
        index=minor, uuid=uuid, pci_bus_id=BUS0 if uuid == GPU0 else None, minor=minor,
        mig_enabled=mig, lost=lost, architecture=arch, nvlink_active=nvlinks,
    )  # fmt: skip


def snap(
    procs: Sequence[model.ProcessInfo] = (),
    *,
    gpus: Sequence[model.GpuInfo] = (gpu(), gpu(GPU1, 1)),
    holders: Mapping[int, model.DeviceHolding] | None = None,
    boot_id: str = "boot-a",
    self_pids: frozenset[int] = frozenset({4242}),
    host_namespaces: bool | None = True,
    wedged: bool = False,
) -> model.Snapshot:
    if holders is None:
        holders = {
            p.pid: model.DeviceHolding(p.pid, frozenset({0}), frozenset(), ctl=True, uvm=True)
            for p in procs
        }
    return model.Snapshot(
        monotonic=0.0,
        wall_time=0.0,
        boot_id=boot_id,
        nvml=model.NvmlReading(available=True, wedged=wedged, gpus=tuple(gpus)),
        processes={p.pid: p for p in procs},
        holders=model.HolderScan(mode="full", holdings=dict(holders)),
        self_pids=self_pids,
        host_namespaces=host_namespaces,
    )


def orphan(
    p: model.ProcessInfo,
    *,
    kind: model.FindingKind = model.FindingKind.ORPHANED,
    gpu_uuid: str | None = GPU0,
    memory: int | None = 512 * model.MIB,
    actionable: bool = True,
    evidence: Mapping[str, object] | None = None,
) -> model.Finding:
    return model.Finding(
        kind=kind,
        gpu=gpu_uuid,
        pid=p.pid,
        start_ticks=p.start_ticks,
        reason="holds the GPU of dead owner 900",
        memory=memory,
        actionable=actionable,
        evidence=dict(evidence if evidence is not None else {"uvm": True, "dead_owner": 900}),
    )


def ghost(uuid: str = GPU0) -> model.Finding:
    return model.Finding(
        kind=model.FindingKind.GHOST_MEMORY,
        gpu=uuid,
        pid=None,
        start_ticks=None,
        reason="900 MiB allocated, no live holder",
        memory=900 * model.MIB,
    )


LADDER = (Step("SIGTERM", 30.0), Step("SIGKILL", 10.0))


def policy(
    *,
    rules: Sequence[Rule] | None = None,
    dry_run: bool = False,
    protect: Protect | None = None,
    limits: Limits | None = None,
    reset: ResetPolicy | None = None,
) -> Policy:
    return Policy(
        dry_run=dry_run,
        rules=tuple(rules)
        if rules is not None
        else (Rule("orphans", model.FindingKind.ORPHANED, LADDER, for_=0.0),),
        protect=protect or Protect(),
        limits=limits or Limits(max_signalled_per_poll=4, max_signalled_per_hour=32),
        reset=reset
        or ResetPolicy(
            confirm_for=60.0, cooldown=600.0, max_resets=2, window=3600.0, max_failures=2
        ),
    )


def signals(result: PlanResult) -> list[SignalIntent]:
    return [i for i in result.intents if isinstance(i, SignalIntent)]
