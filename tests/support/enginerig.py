"""An engine over a recording actuator and hand-built hosts, shared by the engine and notification
tests."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from gpuwatchd.act.commands import CommandResult
from gpuwatchd.act.signals import SignalResult
from gpuwatchd.config.schema import default_policy, parse_policy_documents, render_policy
from gpuwatchd.core.model import MIB, GpuInfo, HolderScan, ProcessIdentity, ProcessInfo, Snapshot
from gpuwatchd.core.vocabulary import SignalOutcome
from gpuwatchd.decide.policy import Policy
from gpuwatchd.engine.cycle import Engine, EngineState
from gpuwatchd.engine.edges import PollReport
from tests.support.snapshots import HostBuilder, gpu_uuid

T = TypeVar("T")
W0 = 1_700_000_000.0
LEAK = 1200 * MIB
GPU0 = gpu_uuid(0)


def make_policy(extra: str = "", *, dry_run: bool = False) -> Policy:
    doc = f"""
dry_run: {str(dry_run).lower()}
rules:
  - name: orphans
    kind: orphaned
    for: 0s
    steps:
      - {{signal: SIGTERM, wait: 30s}}
      - {{signal: SIGKILL, wait: 10s}}
  - name: stuck
    kind: stuck
    steps:
      - {{signal: null}}
on_failure:
  - command: [drain-node, "reason=gpu"]
{extra}
"""
    return parse_policy_documents(
        [("<defaults>", render_policy(default_policy())), ("<test>", doc)]
    )


def orphan_host(t: float, *, state: str = "S") -> HostBuilder:
    """Trainer 200 is dead and still listed on GPU 0; worker 201 (its process group) holds it."""
    return (
        HostBuilder(monotonic=t, wall_time=W0 + t)
        .gpu(0, allocated=LEAK)
        .proc(201, ppid=1, pgid=200, sid=200, holds={0}, uvm=True, state=state)
        .nvml(0, 200, used=LEAK)
    )


def ghost_host(t: float, *, allocated: int = LEAK) -> HostBuilder:
    """GPU 0 has memory allocated and nothing holds it."""
    return HostBuilder(monotonic=t, wall_time=W0 + t).gpu(0, allocated=allocated)


@dataclass
class Clock:
    now: float = 0.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return W0 + self.now


@dataclass
class Reader:
    clock: Clock
    host: Callable[[float], HostBuilder]
    blockers: list[int] = field(default_factory=list)  # pids holding GPU 0 at the final scan
    after_reset: int = 2 * MIB
    final_scans: int = 0
    stopped: int = 0

    def collect(self) -> Snapshot:
        return self.host(self.clock.now).build()

    def stop_nvml(self) -> bool:
        self.stopped += 1
        return True

    def final_scan(self, minor: int | None) -> tuple[HolderScan, Mapping[int, ProcessInfo]]:
        self.final_scans += 1
        builder = HostBuilder().gpu(0)
        for pid in self.blockers:
            builder.proc(pid, holds={0}, uvm=True)
        snapshot = builder.build()
        return snapshot.holders, snapshot.processes

    def read_gpus(self) -> tuple[GpuInfo, ...]:
        return ghost_host(self.clock.now, allocated=self.after_reset).build().nvml.gpus

    def self_pids(self) -> frozenset[int]:
        return frozenset()


@dataclass
class Actuator:
    outcome: SignalOutcome = SignalOutcome.DELIVERED
    signals: list[tuple[int, str, bool]] = field(default_factory=list)
    commands: list[tuple[tuple[str, ...], Mapping[str, str] | None]] = field(default_factory=list)
    returncode: int = 0

    def signal(self, identity: ProcessIdentity, signal: str, *, dry_run: bool) -> SignalResult:
        self.signals.append((identity.pid, signal, dry_run))
        outcome = SignalOutcome.DRY_RUN if dry_run else self.outcome
        return SignalResult(outcome, "fake")

    def run_command(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        self.commands.append((tuple(argv), env))
        return CommandResult(tuple(argv), self.returncode, "done", False, 0.0, None)

    def exits(self, timeout: float) -> list[ProcessIdentity]:
        return []


@dataclass
class Sink:
    events: list[tuple[str, str, dict[str, object]]] = field(default_factory=list)

    def emit(self, name: str, level: str, fields: Mapping[str, object]) -> None:
        self.events.append((name, level, dict(fields)))

    def named(self, name: str) -> list[dict[str, object]]:
        return [f for n, _, f in self.events if n == name]


@dataclass
class Rig:
    engine: Engine
    clock: Clock
    reader: Reader
    actuator: Actuator
    sink: Sink
    slow_calls: list[str] = field(default_factory=list)

    def poll_at(self, t: float) -> PollReport:
        self.clock.now = t
        return self.engine.poll()


def rig(
    policy: Policy,
    host: Callable[[float], HostBuilder],
    *,
    state: EngineState | None = None,
    actuator: Actuator | None = None,
) -> Rig:
    clock = Clock()
    reader = Reader(clock, host)
    act = actuator or Actuator()
    sink = Sink()
    slow_calls: list[str] = []

    def slow(work: Callable[[], T]) -> T:
        slow_calls.append("slow")
        return work()

    engine = Engine(
        policy,
        reader=reader,
        actuator=act,
        clock=clock,
        sink=sink,
        state=state or EngineState(),
        slow=slow,
    )
    return Rig(engine, clock, reader, act, sink, slow_calls)
