"""The engine's edges: what it reads, what it acts through, its clock, where its events go, how
slow work runs, and what a poll is handed and hands back. The daemon implements them on the
real host, ``simulate`` on a virtual one (docs/architecture.md, "The four edges").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from gpuwatchd.act.commands import CommandResult
from gpuwatchd.act.signals import SignalResult
from gpuwatchd.core.checked import as_xid_event, items, obj
from gpuwatchd.core.model import (
    GpuInfo,
    HolderScan,
    KernelXid,
    ProcessIdentity,
    ProcessInfo,
    Snapshot,
    Spare,
    XidEvent,
)
from gpuwatchd.core.model import Pause as Pause  # noqa: PLC0414 - re-exported: a poll input
from gpuwatchd.core.vocabulary import Level
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.gpu_ids import pci_device
from gpuwatchd.decide.health.state import MAX_XID_KINDS
from gpuwatchd.decide.nvml_state import NvmlAvailability
from gpuwatchd.decide.plan.intents import Intent
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.verdict import NodeVerdict

T = TypeVar("T")
MAX_KEPT_RUNS = 256  # kernel-log runs kept for a poll that reads their GPU (a poll reads as many)
MAX_KEPT_XIDS = 256  # NVML events kept per GPU (a reading takes as many); past it, folded


class HostReader(Protocol):
    """Where the engine's facts come from."""

    def collect(self) -> Snapshot:
        """One snapshot of NVML and the process table (its clocks are the snapshot's)."""

    def stop_nvml(self) -> bool:
        """Release every NVML handle of ours before a reset; True when none remains."""

    def final_scan(self, minor: int | None) -> tuple[HolderScan, Mapping[int, ProcessInfo]]:
        """A fresh full holder scan right before a reset, with the holders' process facts."""

    def read_gpus(self) -> tuple[GpuInfo, ...]:
        """A fresh NVML reading of every GPU (in a reset); the engine keeps its Xid events."""

    def self_pids(self) -> frozenset[int]:
        """Our own processes (the daemon and its NVML worker): never holders or blockers."""


@dataclass
class TakenXids:
    """The Xids a reading between two polls took (each is read once: NVML's events, the kernel
    log's new lines), kept for the next poll's snapshot (docs/internals.md)."""

    events: dict[str, tuple[XidEvent, ...]] = field(default_factory=dict)  # by GPU UUID
    kernel: tuple[KernelXid, ...] = ()

    def to_json(self) -> dict[str, object]:
        """NVML's events, saved: nothing delivers them again (the kernel log is read again)."""
        return {uuid: [[x.xid, x.wall] for x in xids] for uuid, xids in sorted(self.events.items())}

    @classmethod
    def from_json(cls, data: object) -> TakenXids:
        """Rebuild :meth:`to_json`'s form; ValueError naming the bad entry otherwise."""
        events: dict[str, tuple[XidEvent, ...]] = {}
        for uuid, raw in obj(data, "taken_xids").items():
            what = f"taken_xids.{uuid}"
            kept = []
            for entry in items(raw, what, MAX_KEPT_XIDS):
                pair = items(entry, what)
                event = as_xid_event(*pair) if len(pair) == 2 else None
                if event is None:
                    raise ValueError(f"{what}: expected [xid, wall] pairs")
                kept.append(event)
            events[uuid] = tuple(kept)
        return cls(events)

    def add(self, gpus: Iterable[GpuInfo], kernel: tuple[KernelXid, ...] = ()) -> None:
        for gpu in gpus:
            if gpu.health is not None and gpu.health.xids:
                kept = self.events.get(gpu.uuid, ()) + gpu.health.xids
                self.events[gpu.uuid] = kept if len(kept) <= MAX_KEPT_XIDS else _folded(kept)
        self.kernel += kernel

    def first_in(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot`` with the Xids kept in front of its own: NVML's of each GPU whose health
        it read, the kernel log's while NVML names GPUs (the collector reads the log only
        then) but a GPU's whose health it did not read (the poll's own too); the others are
        kept for a poll that reads them (the kernel log's first :data:`MAX_KEPT_RUNS`)."""
        gpus = snapshot.nvml.gpus
        read = {gpu.uuid for gpu in gpus if gpu.health is not None}
        events = {uuid: xids for uuid, xids in self.events.items() if uuid in read}
        self.events = {uuid: xids for uuid, xids in self.events.items() if uuid not in read}
        unread = {pci_device(gpu.pci_bus_id) for gpu in gpus if gpu.health is None} - {None}
        logged = (self.kernel if gpus else ()) + snapshot.kernel_xids
        waits = [pci_device(run.pci, kernel_log=True) in unread for run in logged]
        kernel = tuple(run for run, wait in zip(logged, waits, strict=True) if not wait)
        if gpus:
            self.kernel = tuple(run for run, wait in zip(logged, waits, strict=True) if wait)
            self.kernel = self.kernel[:MAX_KEPT_RUNS]
        if not events and kernel == snapshot.kernel_xids:
            return snapshot
        gpus = tuple(
            gpu
            if gpu.health is None or gpu.uuid not in events
            else replace(gpu, health=replace(gpu.health, xids=events[gpu.uuid] + gpu.health.xids))
            for gpu in gpus
        )
        return replace(snapshot, nvml=replace(snapshot.nvml, gpus=gpus), kernel_xids=kernel)


def _folded(events: tuple[XidEvent, ...]) -> tuple[XidEvent, ...]:
    """The first and the last event of each Xid number (of the first :data:`MAX_XID_KINDS`
    numbers, as the judge remembers), in their order: the times the judge reads are kept, the
    count it says is of the events kept (docs/internals.md)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, event in enumerate(events):
        if event.xid in first or len(first) < MAX_XID_KINDS:
            first.setdefault(event.xid, i)
            last[event.xid] = i
    return tuple(events[i] for i in sorted({*first.values(), *last.values()}))


class Actuator(Protocol):
    """What the engine does to the host. Each call re-verifies before it acts."""

    def signal(self, identity: ProcessIdentity, signal: str, *, dry_run: bool) -> SignalResult:
        """Signal exactly ``identity`` (dry-run: check it, send nothing)."""

    def run_command(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        """Run one argv command (the reset procedure's commands and every hook)."""

    def exits(self, timeout: float) -> list[ProcessIdentity]:
        """Signalled targets seen to exit within ``timeout`` seconds (0: only those already)."""


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class EventSink(Protocol):
    def emit(self, name: str, level: Level, fields: Mapping[str, object]) -> None:
        """One structured event (names and levels: docs/events.md)."""


def run_inline(work: Callable[[], T]) -> T:
    """The default way to run slow work (a reset, hooks): right here. The daemon's runner also
    keeps the systemd watchdog fed meanwhile."""
    return work()


class Runner(Protocol):
    def __call__(self, work: Callable[[], T], /) -> T: ...


# Start ``work`` off the main loop and return at once; False if it cannot be taken (the queue is
# full). Used for ``on_action`` notifications, which no poll waits for.
Background = Callable[[Callable[[], None]], bool]


def run_now(work: Callable[[], None]) -> bool:
    """The default background: right here (``simulate``, tests), so results are deterministic."""
    work()
    return True


@dataclass(frozen=True)
class PollInputs:
    """What one poll is handed: the admin switches as read (None: as it is), and when the poll
    started by the caller's clock, just after it read them (None: the engine's clock now)."""

    pause: Pause | None = None
    spares: tuple[Spare, ...] | None = None  # ``gpuwatchd spare``: those in force
    spares_read_at: float | None = None  # the wall time the spares were read at
    clear_latches: float | None = None  # ``resume --clear-latches``: when (wall; inf: unknown)
    started: float | None = None  # monotonic
    started_wall: float | None = None


@dataclass(frozen=True)
class Standing:
    """Where the engine stands now: what the state file and ``gpuwatchd status`` show (the last
    poll's parts None before the first poll)."""

    assess: AssessState
    plan: PlanState
    reset_in_progress: Mapping[str, object] | None
    snapshot: Snapshot | None
    assessment: Assessment | None
    verdict: NodeVerdict | None
    spares: tuple[Spare, ...]
    nvml: NvmlAvailability
    taken_xids: TakenXids  # NVML's events the next poll judges (a copy: saved by to_json)


@dataclass(frozen=True)
class PollReport:
    """What one poll saw, decided and did: all that the daemon's observers read (metrics, the
    STATUS line, the served view, ``run --once``'s progress)."""

    snapshot: Snapshot
    assessment: Assessment
    plan: PlanState  # as the poll left it: ladders, pause, latches
    verdict: NodeVerdict | None = None  # each GPU clean for a new job? (None: not judged)
    intents: tuple[Intent, ...] = ()  # the plan's intents carried out (dry-run ones too)
    started: float = 0.0  # monotonic
    started_wall: float = 0.0
    seconds: float = 0.0  # how long the poll took
    wake_at: float = 0.0  # monotonic: when the next poll is due (Engine.wake_at)
