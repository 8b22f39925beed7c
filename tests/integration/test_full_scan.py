"""The full-scan rule (gpuwatchd.decide.full_scan) and the collector that follows it.

The rule is pinned by a table over hand-built NVML readings; the collector by real polls of
this host through the fake NVML: which polls scan all of /proc, and why.
"""

from __future__ import annotations

import collections
import dataclasses
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from gpuwatchd.collect.collector import Collector
from gpuwatchd.collect.nvml import NvmlClient
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.config.schema import default_policy
from gpuwatchd.core.model import (
    MIB,
    GpuInfo,
    GpuMemory,
    HolderScan,
    MigDevice,
    NvmlProcess,
    NvmlReading,
    ProcessIdentity,
    ProcessInfo,
)
from gpuwatchd.core.vocabulary import SignalOutcome
from gpuwatchd.daemon.host import build_real_host
from gpuwatchd.decide.full_scan import (
    FullScanReason,
    FullScanState,
    full_scan_due,
    has_unowned_memory,
)
from gpuwatchd.decide.policy import Detection
from tests.support.children import Spawn, hold, wait_for_state
from tests.support.collecting import fake_collector
from tests.support.fakenvml import FakeNvml, gpu, process, state

DETECTION = Detection()  # default baseline 64 MiB, ghost margin 256 MiB
LIVE, ZOMBIE, DEAD = 100, 101, 102


def _gpu(
    allocated: int | None = 2 * MIB,
    pids: tuple[int, ...] | None = (),
    *,
    api: str = "v2",
    numa_node: int | None = None,
    lost: bool = False,
) -> GpuInfo:
    memory = GpuMemory(
        total=80 * 1024 * MIB,
        free=None,
        reserved=512 * MIB,
        allocated=allocated,
        api=api,
        used_v1=None if allocated is None else allocated + 512 * MIB,
    )
    return GpuInfo(
        index=0,
        uuid="GPU-0",
        name="H100",
        pci_bus_id="00000000:18:00.0",
        minor=0,
        memory=None if lost else memory,
        processes=None
        if pids is None
        else tuple(NvmlProcess(pid, 500 * MIB, "compute") for pid in pids),
        numa_node=numa_node,
        lost=lost,
    )


def _reading(*gpus: GpuInfo) -> NvmlReading:
    return NvmlReading(available=True, gpus=gpus)


def _proc(pid: int, state: str = "S") -> ProcessInfo:
    return ProcessInfo(pid=pid, start_ticks=1, state=state, ppid=1, pgid=pid, sid=pid)


LIVE_PROCS = {LIVE: _proc(LIVE), ZOMBIE: _proc(ZOMBIE, "Z")}
RECENT = FullScanState(last_full=990.0, dead_listed=frozenset({DEAD}))
ZOMBIE_KNOWN = FullScanState(last_full=990.0, dead_listed=frozenset({ZOMBIE}))


@pytest.mark.parametrize(
    ("reading", "previous", "forced", "reason"),
    [
        pytest.param(_reading(_gpu()), RECENT, True, FullScanReason.FORCED, id="forced"),
        pytest.param(_reading(_gpu()), FullScanState(), False, FullScanReason.FIRST, id="first"),
        pytest.param(_reading(_gpu()), FullScanState(last_full=900.0), False,
                     FullScanReason.PERIODIC, id="periodic"),
        pytest.param(_reading(_gpu()), RECENT, False, None, id="idle-gpu"),
        pytest.param(_reading(_gpu(2 * MIB, (LIVE, 55))), RECENT, False,
                     FullScanReason.NEW_DEAD_PID, id="newly-listed-dead-pid"),
        pytest.param(_reading(_gpu(2 * MIB, (LIVE, ZOMBIE))), RECENT, False,
                     FullScanReason.NEW_DEAD_PID, id="newly-listed-zombie"),
        pytest.param(_reading(_gpu(2 * MIB, (LIVE, DEAD))), RECENT, False, None,
                     id="dead-pid-still-listed"),
        pytest.param(_reading(_gpu(65 * MIB)), RECENT, False, FullScanReason.UNOWNED_MEMORY,
                     id="memory-and-nothing-listed"),
        pytest.param(_reading(_gpu(64 * MIB)), RECENT, False, None, id="at-the-threshold"),
        pytest.param(_reading(_gpu(3000 * MIB, (DEAD,))), RECENT, False,
                     FullScanReason.UNOWNED_MEMORY, id="memory-of-a-dead-listed-pid"),
        pytest.param(_reading(_gpu(3000 * MIB, (ZOMBIE,))), ZOMBIE_KNOWN, False, None,
                     id="memory-of-a-listed-zombie"),
        pytest.param(_reading(_gpu(3000 * MIB, (LIVE,))), RECENT, False, None,
                     id="memory-of-a-live-owner"),
        pytest.param(_reading(_gpu(3000 * MIB, None)), RECENT, False,
                     FullScanReason.UNOWNED_MEMORY, id="process-list-unknown"),
        pytest.param(_reading(_gpu(3000 * MIB, numa_node=1)), RECENT, False, None,
                     id="coherent-memory"),
        pytest.param(_reading(_gpu(lost=True)), RECENT, False, None, id="lost-gpu"),
        pytest.param(_reading(_gpu(None, api="v1")), RECENT, False, None, id="v1-only"),
    ],
)  # fmt: skip
def test_full_scan_is_due_exactly_when_the_targeted_view_cannot_answer(
    reading: NvmlReading, previous: FullScanState, forced: bool, reason: FullScanReason | None
) -> None:
    due, after = full_scan_due(
        reading, LIVE_PROCS, previous, 1000.0, interval=60.0, detection=DETECTION, forced=forced
    )
    assert due == reason
    assert after.last_full == (1000.0 if reason is not None else previous.last_full)


def test_dead_pids_are_remembered_on_every_poll_so_one_scan_follows_each() -> None:
    """Also on the first and periodic polls: the PID they scanned for is not new next time."""
    listing = _reading(_gpu(2 * MIB, (DEAD,)))
    state = FullScanState()
    reasons = []
    for now in (1000.0, 1005.0, 1061.0, 1065.0):
        reason, state = full_scan_due(listing, {}, state, now, interval=60.0, detection=DETECTION)
        reasons.append(reason)
    assert reasons == [FullScanReason.FIRST, None, FullScanReason.PERIODIC, None]


@pytest.mark.parametrize(
    ("margin", "allocated", "expected"),
    [(256 * MIB, 100 * MIB, True), (32 * MIB, 40 * MIB, True), (32 * MIB, 30 * MIB, False)],
)
def test_a_lowered_ghost_margin_lowers_the_memory_threshold(
    margin: int, allocated: int, expected: bool
) -> None:
    """Ghost memory is anything above a learned baseline (maybe near 0) plus the margin."""
    detection = Detection(ghost_margin=margin)
    assert has_unowned_memory(_gpu(allocated), {}, detection) is expected


# --- the collector follows the rule -----------------------------------------------------------


@pytest.fixture
def dead_pid() -> int:
    """The PID of a child of ours that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


@pytest.fixture
def collector(fake_nvml: FakeNvml) -> Iterator[tuple[Collector, list[float]]]:
    clock = [1000.0]
    with fake_collector(fake_nvml, clock) as collector:
        yield collector, clock


def _poll_modes(collector: Collector, clock: list[float], polls: int) -> list[str | None]:
    reasons = []
    for _ in range(polls):
        snapshot = collector.collect()
        reason = collector.last_scan_reason
        assert snapshot.holders.mode == ("targeted" if reason is None else "full")
        reasons.append(None if reason is None else reason.value)
        clock[0] += 5.0
    return reasons


def test_ghost_memory_of_a_dead_listed_pid_is_judged_on_a_full_scan_every_poll(
    fake_nvml: FakeNvml, collector: tuple[Collector, list[float]], dead_pid: int
) -> None:
    """NVML still charges 3 GiB to a dead PID and nothing holds the GPU: a targeted poll in
    between would make ghost_memory vanish and reappear, never lasting its confirmation."""
    fake_nvml.write(state([gpu(0, allocated=3072 * MIB, processes=[process(dead_pid, 3 << 30)])]))
    assert _poll_modes(*collector, polls=4) == ["first", *["unowned_memory"] * 3]


def test_a_dead_pid_seen_by_the_first_scan_does_not_scan_again(
    fake_nvml: FakeNvml, collector: tuple[Collector, list[float]], dead_pid: int, tmp_path: Path
) -> None:
    """A small leftover (below the threshold) with a dead listed PID: one full scan finds its
    inheritors; the targeted scans follow them from then on."""
    fake_nvml.write(state([gpu(0, allocated=20 * MIB, processes=[process(dead_pid, 20 * MIB)])]))
    assert _poll_modes(*collector, polls=3) == ["first", None, None]


def test_a_coherent_memory_gpu_keeping_pages_does_not_scan_every_poll(
    fake_nvml: FakeNvml, collector: tuple[Collector, list[float]]
) -> None:
    fake_nvml.write(state([gpu(0, allocated=3072 * MIB, numa_node=1)]))
    assert _poll_modes(*collector, polls=3) == ["first", None, None]


def test_memory_with_no_process_listed_scans_every_poll_and_idle_does_not(
    fake_nvml: FakeNvml, collector: tuple[Collector, list[float]]
) -> None:
    fake_nvml.write(state([gpu(0, allocated=3072 * MIB), gpu(1)]))
    assert _poll_modes(*collector, polls=3) == ["first", "unowned_memory", "unowned_memory"]
    fake_nvml.write(state([gpu(0), gpu(1)]))
    assert _poll_modes(*collector, polls=2) == [None, None]


def test_a_known_holder_of_the_gpu_exempts_it_from_scanning_every_poll() -> None:
    """With a live holder there is no ghost memory to conclude: the targeted scan follows it."""
    listing = _reading(_gpu(3000 * MIB, (DEAD,)))
    held, _ = full_scan_due(
        listing, {}, RECENT, 1000.0, interval=60.0, detection=DETECTION, held_minors=frozenset({0})
    )
    unheld, _ = full_scan_due(listing, {}, RECENT, 1000.0, interval=60.0, detection=DETECTION)
    assert (held, unheld) == (None, FullScanReason.UNOWNED_MEMORY)


def _mig_gpu(*instances: tuple[int, int, tuple[int, ...] | None]) -> GpuInfo:
    """A MIG GPU with (gi, allocated, listed pids) per GPU instance (one compute instance
    each), its parent's figures the aggregate: a live process listed in any instance."""
    devices = tuple(
        MigDevice(
            index=position,
            uuid=f"MIG-{gi}",
            gi=gi,
            ci=0,
            memory=GpuMemory(total=10 * 1024 * MIB, free=None, reserved=0, allocated=allocated),
            processes=None if pids is None else tuple(NvmlProcess(p, 1, "compute") for p in pids),
        )
        for position, (gi, allocated, pids) in enumerate(instances)
    )
    parent = _gpu(sum(a for _, a, _ in instances), (LIVE,))
    return dataclasses.replace(parent, mig_enabled=True, mig_devices=devices)


@pytest.mark.parametrize(
    ("instances", "due"),
    [
        # GI 1 holds 3 GiB with nothing listed beside a live job in GI 2: scan every poll.
        (((1, 3000 * MIB, ()), (2, 900 * MIB, (LIVE,))), True),
        (((1, 3000 * MIB, None), (2, 900 * MIB, (LIVE,))), True),  # unreadable lists none
        (((1, 3000 * MIB, (DEAD,)), (2, 900 * MIB, (LIVE,))), True),
        # Idle beside the live job, or the memory owned by a live listed process: no need.
        (((1, 2 * MIB, ()), (2, 900 * MIB, (LIVE,))), False),
        (((1, 3000 * MIB, (LIVE,)), (2, 2 * MIB, ())), False),
    ],
)
def test_a_mig_gpu_is_asked_instance_by_instance_whatever_its_parent_says(
    instances: tuple[tuple[int, int, tuple[int, ...] | None], ...], due: bool
) -> None:
    """The parent lists the live job and its node is held by it: on a whole GPU that would
    explain the memory; on a MIG GPU it says nothing about GPU instance 1."""
    live = {LIVE: _proc(LIVE)}
    held = frozenset({0})
    assert has_unowned_memory(_mig_gpu(*instances), live, DETECTION, held) is due


def test_the_inheritors_of_a_dead_trainer_are_followed_not_rescanned_every_poll(
    fake_nvml: FakeNvml,
    collector: tuple[Collector, list[float]],
    dead_pid: int,
    spawn: Spawn,
) -> None:
    """NVML charges 3 GiB to the dead trainer while its worker still holds the GPU (the common
    orphan case): one full scan finds the worker, then targeted polls follow it, so a ladder
    against it is not delayed by a full scan on every poll. Once it is gone, scans resume. (It
    holds nvidia-uvm, as a CUDA process's fork does: an NVML-only holder, a monitor, holds no
    memory and keeps the scans full, test_memory_beside_a_monitor_keeps_the_scans_full.)"""
    fake_nvml.write(state([gpu(0, allocated=3072 * MIB, processes=[process(dead_pid, 3 << 30)])]))
    node = fake_nvml.devices_dir / "nvidia0"
    uvm = fake_nvml.devices_dir / "nvidia-uvm"
    node.touch()
    uvm.touch()
    worker = spawn(hold([str(node), str(uvm)]))
    collector_, clock = collector
    assert _poll_modes(collector_, clock, polls=3) == ["first", None, None]
    worker.kill()
    worker.wait(timeout=10)
    # The worker's exit is itself a cause (its children, if any, inherited the file and are no
    # longer its descendants); then the memory with no live owner keeps the scans full.
    assert _poll_modes(collector_, clock, polls=3) == [
        "holder_gone",
        "unowned_memory",
        "unowned_memory",
    ]


def test_memory_beside_a_monitor_keeps_the_scans_full(
    fake_nvml: FakeNvml, collector: tuple[Collector, list[float]], spawn: Spawn
) -> None:
    """A monitor (the GPU's node, no nvidia-uvm, not listed) holds no memory: memory no live
    process owns beside it is still looked for in all of /proc, every poll, as ghost_memory
    needs (decide/plan/monitors.py)."""
    fake_nvml.write(state([gpu(0, allocated=3072 * MIB)]))
    node = fake_nvml.devices_dir / "nvidia0"
    node.touch()
    spawn(hold([str(node)]))
    collector_, clock = collector
    assert _poll_modes(collector_, clock, polls=3) == ["first", "unowned_memory", "unowned_memory"]


class _CountingProcFS(ProcFS):
    """The real ProcFS, counting the full reads of each process's facts."""

    def __init__(self, devices_dir: str) -> None:
        super().__init__(devices_dir=devices_dir)
        self.reads: collections.Counter[int] = collections.Counter()

    def read_process(self, pid: int) -> ProcessInfo | None:
        self.reads[pid] += 1
        return super().read_process(pid)


def test_a_walk_with_nothing_remembered_reads_each_listed_process_once(
    fake_nvml: FakeNvml, spawn: Spawn
) -> None:
    """A fresh collector's forced walk (a one-shot ``scan``) reads the facts of a listed
    process once, not again once it has decided to walk; a collector that remembers facts
    still reads them afresh for a walk (nothing remembered survives one)."""
    node = fake_nvml.devices_dir / "nvidia0"
    node.touch()
    trainer = spawn(hold([str(node)]))
    fake_nvml.write(state([gpu(0, allocated=600 * MIB, processes=[process(trainer.pid)])]))
    procfs = _CountingProcFS(str(fake_nvml.devices_dir))
    nvml = NvmlClient(timeout=10.0, env=fake_nvml.env())
    try:
        collector = Collector(procfs, nvml, namespace_check=False)
        first = collector.collect(full=True)
        assert trainer.pid in first.holders.holdings
        assert trainer.pid in first.processes
        assert procfs.reads[trainer.pid] == 1
        again = collector.collect(full=True)
        assert again.processes[trainer.pid] == first.processes[trainer.pid]
        assert procfs.reads[trainer.pid] == 2
    finally:
        nvml.stop()


def test_a_listed_holding_is_reused_while_nvml_lists_it_on_the_same_gpus(
    fake_nvml: FakeNvml, spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A targeted poll takes a listed process's holding from the last poll while NVML lists it
    on the same GPUs and its identity is unchanged (its device files are not read again), and
    reads them again once NVML lists it on another set of GPUs: the same holdings either way."""
    for name in ("nvidia0", "nvidia1"):
        (fake_nvml.devices_dir / name).touch()
    trainer = spawn(hold([str(fake_nvml.devices_dir / "nvidia0")]))
    listed = [process(trainer.pid)]
    fake_nvml.write(state([gpu(0, allocated=600 * MIB, processes=listed), gpu(1)]))
    procfs = ProcFS(devices_dir=str(fake_nvml.devices_dir))
    asked: list[frozenset[int]] = []
    scan = procfs.holders.scan

    def counting(pids: Iterable[int] | None = None, **kwargs: Iterable[int]) -> HolderScan:
        wanted = None if pids is None else list(pids)
        if wanted is not None:
            asked.append(frozenset(wanted))
        return scan(wanted, **kwargs)

    monkeypatch.setattr(procfs.holders, "scan", counting)
    nvml = NvmlClient(timeout=10.0, env=fake_nvml.env())
    try:
        collector = Collector(procfs, nvml, namespace_check=False)
        first = collector.collect(full=True)
        assert trainer.pid in first.holders.holdings
        steady = collector.collect()
        assert collector.last_scan_reason is None
        assert steady.holders.mode == "targeted"
        assert trainer.pid not in asked[-1]
        assert steady.holders.holdings[trainer.pid] == first.holders.holdings[trainer.pid]
        both = [gpu(0, allocated=600 * MIB, processes=listed), gpu(1, processes=listed)]
        fake_nvml.write(state(both))
        moved = collector.collect()
        assert moved.holders.mode == "targeted"
        assert trainer.pid in asked[-1]
        assert moved.holders.holdings[trainer.pid] == first.holders.holdings[trainer.pid]
        again = collector.collect()
        assert trainer.pid not in asked[-1]
        assert again.holders.holdings[trainer.pid] == first.holders.holdings[trainer.pid]
    finally:
        nvml.stop()


def test_a_remembered_process_is_checked_by_its_stat_at_every_targeted_poll(
    fake_nvml: FakeNvml, spawn: Spawn
) -> None:
    """A listed process's remembered facts stand while its ``stat`` reads the same (the same
    facts again), and a change of its state is seen at the next targeted poll, however many
    polls confirmed it before."""
    node = fake_nvml.devices_dir / "nvidia0"
    node.touch()
    trainer = spawn(hold([str(node)]))
    fake_nvml.write(state([gpu(0, allocated=600 * MIB, processes=[process(trainer.pid)])]))
    procfs = ProcFS(devices_dir=str(fake_nvml.devices_dir))
    nvml = NvmlClient(timeout=10.0, env=fake_nvml.env())
    try:
        collector = Collector(procfs, nvml, namespace_check=False)
        wait_for_state(procfs, trainer.pid, "S")
        first = collector.collect(full=True).processes[trainer.pid]
        steady = [collector.collect().processes[trainer.pid] for _ in range(3)]
        assert collector.last_scan_reason is None
        assert steady == [first] * 3
        assert steady[1] is steady[2]
        trainer.send_signal(signal.SIGSTOP)
        wait_for_state(procfs, trainer.pid, "T")
        stopped = collector.collect().processes[trainer.pid]
        assert stopped.state == "T"
        assert stopped.start_ticks == first.start_ticks
        trainer.send_signal(signal.SIGCONT)
        wait_for_state(procfs, trainer.pid, "S")
        assert collector.collect().processes[trainer.pid].state == "S"
    finally:
        nvml.stop()


EXEC_SAME_NAME = """
import os, signal, sys, time
fd = os.open({node!r}, os.O_RDONLY)
os.set_inheritable(fd, True)
signal.signal(signal.SIGUSR1, lambda *_: os.execv(sys.executable, [sys.executable, "-c", {then!r}]))
print("ready", flush=True)
time.sleep(60)
"""


def test_a_remembered_process_that_execs_a_program_of_the_same_name_is_read_afresh(
    fake_nvml: FakeNvml, spawn: Spawn
) -> None:
    """An exec keeps the PID, start time, parents and, for a program of the same name, comm:
    the remembered command line must not outlive it (a rule's ``commands`` and ``protect``
    judge the new one at the next targeted poll)."""
    node = fake_nvml.devices_dir / "nvidia0"
    node.touch()
    then = "import time\nprint('ready', flush=True)\ntime.sleep(60)  # after the exec"
    trainer = spawn(EXEC_SAME_NAME.format(node=str(node), then=then))
    fake_nvml.write(state([gpu(0, allocated=600 * MIB, processes=[process(trainer.pid)])]))
    procfs = ProcFS(devices_dir=str(fake_nvml.devices_dir))
    nvml = NvmlClient(timeout=10.0, env=fake_nvml.env())
    try:
        collector = Collector(procfs, nvml, namespace_check=False)
        before = collector.collect(full=True).processes[trainer.pid]
        assert collector.collect().processes[trainer.pid] == before
        trainer.send_signal(signal.SIGUSR1)
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "ready"  # the new program runs
        after = collector.collect().processes[trainer.pid]
        assert (after.comm, after.start_ticks, after.ppid) == (
            before.comm,
            before.start_ticks,
            before.ppid,
        )
        assert after.cmdline == (sys.executable, "-c", then)
        assert after.cmdline != before.cmdline
    finally:
        nvml.stop()


def test_a_process_moved_to_another_cgroup_after_it_was_judged_is_not_signalled(
    fake_nvml: FakeNvml, spawn: Spawn, cgroup_base: Path
) -> None:
    """A move to another cgroup (a job step the scheduler moves, an admin's write to
    cgroup.procs to protect a process) keeps every stat field the collector reuses remembered
    facts on, so the snapshot may judge the old cgroup: the daemon's signaller reads the judged
    facts again and sends nothing to a process that moved, and the next poll reads them afresh
    (``protect.cgroups`` then judges the new cgroup)."""
    moved_to = cgroup_base / "moved"
    moved_to.mkdir()
    node = fake_nvml.devices_dir / "nvidia0"
    node.touch()
    trainer = spawn(hold([str(node)]))
    fake_nvml.write(state([gpu(0, allocated=600 * MIB, processes=[process(trainer.pid)])]))
    policy = dataclasses.replace(
        default_policy(), devices_dir=str(fake_nvml.devices_dir), namespace_check=False
    )
    host = build_real_host(policy, nvml_env=fake_nvml.env())
    try:
        before = host.collector.collect(full=True).processes[trainer.pid]
        (moved_to / "cgroup.procs").write_text(str(trainer.pid))
        judged = host.collector.collect().processes[trainer.pid]
        assert judged == before  # the precondition: this poll reused the remembered facts
        assert judged.start_ticks is not None
        identity = ProcessIdentity(trainer.pid, judged.start_ticks)
        result = host.actuator.signal(identity, "SIGTERM", dry_run=False)
        assert (result.outcome, trainer.poll()) == (SignalOutcome.REUSED, None)
        assert "(cgroup changed)" in result.detail
        after = host.collector.collect().processes[trainer.pid]
        assert after.cgroup is not None
        assert after.cgroup.path == f"/{cgroup_base.name}/moved"
    finally:
        host.close()


def test_a_full_scan_reads_every_process_afresh(
    fake_nvml: FakeNvml, spawn: Spawn, cgroup_base: Path
) -> None:
    """A full scan refills the remembered facts, so none is older than one full-scan interval:
    a holder NVML does not list, moved to another cgroup, is reported there by the next full
    scan (it kept the facts read before the move)."""
    moved_to = cgroup_base / "moved"
    moved_to.mkdir()
    node = fake_nvml.devices_dir / "nvidia0"
    node.touch()
    holder = spawn(hold([str(node)]))
    fake_nvml.write(state([gpu(0, allocated=600 * MIB, processes=[])]))
    with fake_collector(fake_nvml) as collector:
        collector.collect(full=True)
        (moved_to / "cgroup.procs").write_text(str(holder.pid))
        moved = collector.collect(full=True).processes[holder.pid].cgroup
    assert moved is not None
    assert moved.path == f"/{cgroup_base.name}/moved"


def test_gpus_that_claim_one_minor_have_no_minor_in_the_snapshot(
    fake_nvml: FakeNvml, spawn: Spawn
) -> None:
    """/dev/nvidiaN is one GPU's: when NVML reports a minor for two GPUs, the holders of that
    file (here a trainer of GPU 0) cannot be told to be either's, so neither GPU has a minor
    (holders unknown: reported, never acted on) and its error says why; a third GPU keeps its."""
    node = fake_nvml.devices_dir / "nvidia0"
    node.touch()
    trainer = spawn(hold([str(node)]))
    gpus = [gpu(0, processes=[process(trainer.pid)]), gpu(1, minor=0), gpu(2)]
    fake_nvml.write(state(gpus))
    with fake_collector(fake_nvml) as collector:
        snapshot = collector.collect(full=True)
    assert [g.minor for g in snapshot.nvml.gpus] == [None, None, 2]
    for shared in snapshot.nvml.gpus[:2]:
        assert shared.error == "NVML reports minor 0 for another GPU too"
    assert snapshot.nvml.gpus[2].error is None
    assert snapshot.holders.holdings[trainer.pid].gpu_minors == {0}  # still held, unattributed
