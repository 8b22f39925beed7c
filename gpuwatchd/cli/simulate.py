"""``gpuwatchd simulate``: the daemon's decision core on a virtual clock over a scenario.

This module owns the *virtual host* (GPUs, processes that react to signals, contexts whose
memory outlives their owner, scripted ``nvidia-smi`` answers) and the timeline. Every poll it
builds a :class:`gpuwatchd.model.Snapshot` from the virtual world and calls ``assess`` and
``plan`` exactly as ``daemon.Daemon.poll_once`` does; it carries out the intents against the
virtual world (signals → the process reacts; resets → the real ``reset.perform_reset`` with a
:class:`VirtualReset` as its environment and command runner; on_failure hooks → recorded),
feeds the outcomes back through ``record_signal`` / ``record_exit`` / ``record_reset``, and
wakes at ``min(interval, next_deadline)`` or at once when a signalled process exits, like the
daemon's wait loop. Scenario events happen at their time, or (``during``) when a reset reaches
their step. It never touches the real host: no ``/proc``, no NVML, no signals, no commands.
It must not make decisions of its own: anything it would decide differently from the daemon
is a bug here. Output formats are documented in ``docs/simulate.md``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from gpuwatchd.act.commands import CommandResult
from gpuwatchd.act.reset import ResetStep, ResetTarget, outcome_event, perform_reset
from gpuwatchd.act.signals import SIGNAL_OUTCOME_LEVELS
from gpuwatchd.cli.scenario import EventSpec, GpuSpec, ProcessSpec, Scenario, ScenarioError
from gpuwatchd.collect.procfs import parse_cgroup
from gpuwatchd.config.schema import ConfigError, default_policy, load_policy, parse_policy_documents
from gpuwatchd.config.schema import render_policy as _render_policy
from gpuwatchd.decide.argv import format_argv
from gpuwatchd.decide.assess import Assessment, AssessState, assess, back_to_baseline
from gpuwatchd.decide.plan import (
    Event,
    HookIntent,
    Intent,
    PlanResult,
    PlanState,
    ResetIntent,
    SignalIntent,
    next_deadline,
    plan,
    record_exit,
    record_reset,
    record_signal,
    set_paused,
)
from gpuwatchd.decide.policy import Policy
from gpuwatchd.model import (
    MIB,
    DeviceHolding,
    GpuInfo,
    GpuMemory,
    HolderScan,
    NvmlProcess,
    NvmlReading,
    ProcessIdentity,
    ProcessInfo,
    Snapshot,
)

WALL0 = 1_700_000_000.0  # the virtual wall clock at +0s
BOOT_ID = "00000000-0000-4000-8000-5100a7ed0000"
ARCH_HOPPER = 9  # NVML_DEVICE_ARCH_HOPPER: every virtual GPU
BUSY_POLLS = 50  # polls at one instant before the simulation calls it a busy loop


class SimulationError(Exception):
    """The scenario cannot be played (its inline policy is invalid, say). Exit 65."""


# --- the timeline -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One line of the timeline. ``name`` is the daemon's event name (docs/events.md) or a
    ``world.*`` name for what the scenario made happen; ``t`` is seconds since the start."""

    t: float
    name: str
    level: str
    text: str
    fields: Mapping[str, object]

    def to_json(self) -> dict[str, object]:
        return {
            "t": round(self.t, 3),
            "event": self.name,
            "level": self.level,
            "text": self.text,
            "fields": _jsonable(dict(self.fields)),
        }


@dataclass
class SimulationResult:
    """The timeline and the final state of one run."""

    scenario: Scenario
    policy: Policy
    policy_source: str
    timeline: list[Entry]
    final: dict[str, object]
    polls: int

    def entries(self, name: str) -> list[Entry]:
        return [e for e in self.timeline if e.name == name]

    def signals(self) -> list[tuple[float, str, str, str]]:
        """(t, process name, signal, outcome) for every signal the daemon sent or would send."""
        return [
            (e.t, str(e.fields.get("process")), str(e.fields["signal"]), str(e.fields["outcome"]))
            for e in self.entries("action.signal")
        ]

    def resets(self) -> list[tuple[float, str, str]]:
        """(t, GPU UUID, result) for every reset attempt the daemon made."""
        return [
            (e.t, str(e.fields["gpu"]), str(e.fields["result"]))
            for e in self.entries("reset.outcome")
        ]

    def to_json(self) -> dict[str, object]:
        return {
            "scenario": self.scenario.path,
            "description": self.scenario.description,
            "duration": self.scenario.duration,
            "interval": self.policy.interval,
            "policy": self.policy_source,
            "dry_run": self.policy.dry_run,
            "polls": self.polls,
            "timeline": [e.to_json() for e in self.timeline],
            "final": _jsonable(self.final),
        }


# --- the virtual world ------------------------------------------------------------------------


@dataclass
class _Proc:
    spec: ProcessSpec
    start_ticks: int
    started_at: float
    ppid: int
    state: str
    minors: frozenset[int]
    ctl: bool
    uvm: bool
    alive: bool = True  # False once exited (a zombie is not alive but still present)
    present: bool = True  # in the process table (alive or zombie)
    exited_at: float | None = None
    exit_why: str | None = None
    signals: list[tuple[float, str, str]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.spec.pid

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class _Context:
    """GPU memory charged to one process on one GPU; it outlives the process while heirs hold
    the device (status "dead"), or for good when leaked (status "leaked", NVML lists nothing)."""

    pid: int
    owner: str
    gpu: int
    size: int | None
    status: str = "live"  # live, dead, leaked, freed
    heirs: set[int] = field(default_factory=set)


@dataclass
class _Gpu:
    spec: GpuSpec
    base: int  # allocated memory that no context accounts for (idle, or set_memory)
    lost: bool
    persistence: bool


class World:
    """The virtual host. Mutated only by the scenario's events and by the daemon's intents."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.gpus = {
            g.index: _Gpu(g, g.allocated + g.leaked, g.lost, g.persistence) for g in scenario.gpus
        }
        self.by_minor = {g.spec.minor: g for g in self.gpus.values()}
        self.procs: dict[int, _Proc] = {}
        self.history: list[_Proc] = []
        self.contexts: list[_Context] = []
        self.leak_on_exit: set[str] = set()
        self.reset_results: list[str] = []
        self.ticks = itertools.count(1_000_000, 100)
        for spec in scenario.processes:
            self.start(spec, at=0.0, initial=True)

    # -- processes --

    def start(self, spec: ProcessSpec, *, at: float, initial: bool = False) -> _Proc:
        old = self.procs.get(spec.pid)
        if old is not None and old.present:
            raise SimulationError(
                f"{self.scenario.path}:{spec.line}: pid {spec.pid} ({spec.name}) is still in use "
                f"by {old.name} at +{at:g}s"
            )
        minors = frozenset(self.gpus[i].spec.minor for i in spec.holds.gpus)
        ticks = spec.pid * 100 if initial else next(self.ticks) + int(at * 100)
        proc = _Proc(
            spec=spec,
            start_ticks=ticks,
            started_at=at,
            ppid=spec.ppid,
            state=spec.state,
            minors=minors,
            ctl=spec.holds.ctl,
            uvm=spec.holds.uvm,
        )
        if spec.state == "Z":
            proc.alive = False
        self.procs[spec.pid] = proc
        self.history.append(proc)
        for index, size in spec.nvml.items():
            self.contexts.append(_Context(spec.pid, spec.name, index, size))
        return proc

    def by_name(self, name: str) -> _Proc | None:
        for proc in reversed(self.history):
            if proc.name == name:
                return proc
        return None

    def exit(self, proc: _Proc, at: float, why: str) -> list[str]:
        """The process exits: children reparented, device files closed, contexts settled."""
        if not proc.alive:
            return []
        notes: list[str] = []
        proc.alive, proc.exited_at, proc.exit_why = False, at, why
        heirs_by_gpu = {ctx.gpu: self._heirs(proc, ctx.gpu) for ctx in self._live_contexts(proc)}
        reaper = self._reaper(proc)
        for child in self.procs.values():
            if child.ppid == proc.pid and child.present and child is not proc:
                child.ppid = reaper
        proc.minors, proc.ctl, proc.uvm = frozenset(), False, False
        if proc.spec.on_exit == "zombie":
            proc.state = "Z"
            notes.append("left a zombie (its parent does not reap it)")
        else:
            proc.present = False
            del self.procs[proc.pid]
        leak = proc.spec.on_exit == "leak" or proc.name in self.leak_on_exit
        for ctx in self._live_contexts(proc):
            heirs = heirs_by_gpu.get(ctx.gpu, set())
            if leak:
                ctx.status = "leaked"
                notes.append(f"its {_size(ctx.size)} on GPU {ctx.gpu} stays allocated (leaked)")
            elif heirs:
                ctx.status, ctx.heirs = "dead", heirs
                names = ", ".join(self._name(pid) for pid in sorted(heirs))
                notes.append(f"its {_size(ctx.size)} on GPU {ctx.gpu} stays pinned by {names}")
            else:
                ctx.status = "freed"
        for ctx in self.contexts:
            if ctx.status == "dead" and proc.pid in ctx.heirs:
                ctx.heirs.discard(proc.pid)
                if not ctx.heirs:
                    ctx.status = "leaked" if ctx.owner in self.leak_on_exit else "freed"
                    if ctx.status == "freed":
                        notes.append(
                            f"last holder gone: {ctx.owner}'s {_size(ctx.size)} on GPU "
                            f"{ctx.gpu} is freed"
                        )
        return notes

    def reap(self, proc: _Proc) -> None:
        if proc.present and not proc.alive:
            proc.present = False
            self.procs.pop(proc.pid, None)

    def _live_contexts(self, proc: _Proc) -> list[_Context]:
        return [c for c in self.contexts if c.pid == proc.pid and c.status == "live"]

    def _descends(self, proc: _Proc, ancestor: int) -> bool:
        seen: set[int] = set()
        current = proc.ppid
        while current > 1 and current not in seen:
            if current == ancestor:
                return True
            seen.add(current)
            parent = self.procs.get(current)
            if parent is None:
                return False
            current = parent.ppid
        return False

    def _heirs(self, owner: _Proc, gpu: int) -> set[int]:
        """Live processes that inherited ``owner``'s device files: its descendants or process
        group members that hold the GPU and own no context of their own there."""
        minor = self.gpus[gpu].spec.minor
        found = set()
        for proc in self.procs.values():
            if proc is owner or not proc.alive or minor not in proc.minors:
                continue
            if any(c.pid == proc.pid and c.status == "live" for c in self.contexts):
                continue
            if self._descends(proc, owner.pid) or proc.spec.pgid == owner.spec.pgid:
                found.add(proc.pid)
        return found

    def _reaper(self, proc: _Proc) -> int:
        current = proc.ppid
        seen: set[int] = set()
        while current > 1 and current not in seen:
            seen.add(current)
            parent = self.procs.get(current)
            if parent is None:
                break
            if parent.spec.subreaper and parent.alive:
                return parent.pid
            current = parent.ppid
        return 1

    def _name(self, pid: int) -> str:
        proc = self.procs.get(pid)
        return f"{proc.name} (pid {pid})" if proc else f"pid {pid}"

    # -- GPUs --

    def gpu_by_uuid(self, uuid: str) -> _Gpu | None:
        return next((g for g in self.gpus.values() if g.spec.uuid == uuid), None)

    def allocated(self, gpu: _Gpu) -> int:
        charged = sum(
            c.size or 0
            for c in self.contexts
            if c.gpu == gpu.spec.index and c.status in ("live", "dead", "leaked")
        )
        return min(gpu.base + charged, gpu.spec.total - gpu.spec.reserved)

    def restore(self, gpu: _Gpu) -> None:
        """A successful reset: every context on the GPU is gone, memory back to idle."""
        gpu.base = gpu.spec.allocated
        for ctx in self.contexts:
            if ctx.gpu == gpu.spec.index and ctx.status in ("dead", "leaked"):
                ctx.status = "freed"
                ctx.heirs.clear()

    # -- what the daemon would read --

    def process_info(self, proc: _Proc) -> ProcessInfo:
        spec = proc.spec
        zombie = proc.state == "Z"
        return ProcessInfo(
            pid=spec.pid,
            start_ticks=proc.start_ticks,
            state=proc.state,
            ppid=proc.ppid,
            pgid=spec.pgid,
            sid=spec.sid,
            uid=spec.uid,
            user=spec.user,
            comm=spec.comm,
            exe=None if zombie else spec.exe,
            cmdline=() if zombie else spec.command,
            cgroup=parse_cgroup(f"0::{spec.cgroup}\n"),
        )

    def processes(self) -> dict[int, ProcessInfo]:
        return {pid: self.process_info(p) for pid, p in self.procs.items() if p.spec.visible}

    def holders(self) -> HolderScan:
        holdings: dict[int, DeviceHolding] = {}
        for pid, proc in self.procs.items():
            if not proc.spec.visible or not (proc.minors or proc.ctl or proc.uvm):
                continue
            via = proc.spec.holds.via
            holdings[pid] = DeviceHolding(
                pid=pid,
                gpu_minors_fd=proc.minors if via in ("fd", "both") else frozenset(),
                gpu_minors_map=proc.minors if via in ("map", "both") else frozenset(),
                ctl=proc.ctl,
                uvm=proc.uvm,
            )
        return HolderScan(mode="full", holdings=holdings)

    def nvml(self) -> NvmlReading:
        infos = []
        for index in sorted(self.gpus):
            gpu = self.gpus[index]
            spec = gpu.spec
            listed = []
            for ctx in self.contexts:
                if ctx.gpu == index and ctx.status in ("live", "dead"):
                    listed.append(NvmlProcess(ctx.pid, ctx.size, "compute"))
            allocated = self.allocated(gpu)
            memory = GpuMemory(
                total=spec.total,
                free=spec.total - spec.reserved - allocated,
                reserved=spec.reserved,
                allocated=allocated,
            )
            infos.append(
                GpuInfo(
                    index=index,
                    uuid=spec.uuid,
                    name=spec.name,
                    pci_bus_id=spec.pci_bus_id,
                    minor=spec.minor,
                    memory=memory,
                    processes=tuple(sorted(listed, key=lambda p: p.pid)),
                    mig_enabled=spec.mig,
                    persistence_mode=gpu.persistence,
                    numa_node=1 if spec.coherent else None,
                    architecture=ARCH_HOPPER,
                    nvlink_active=0,  # each virtual GPU resets alone
                    lost=gpu.lost,
                    error="GPU is lost" if gpu.lost else None,
                )
            )
        return NvmlReading(available=True, driver_version="550.54.15", gpus=tuple(infos))

    def snapshot(self, now: float) -> Snapshot:
        host = self.scenario.host
        return Snapshot(
            monotonic=now,
            wall_time=WALL0 + now,
            boot_id=BOOT_ID,
            nvml=self.nvml(),
            processes=self.processes(),
            holders=self.holders(),
            pid_max=host.pid_max,
            host_namespaces=host.host_namespaces,
            mps_server_running=host.mps_server_running,
        )


# --- the policy -------------------------------------------------------------------------------


def scenario_policy(scenario: Scenario, config_path: str | None) -> tuple[Policy, str]:
    """The policy to simulate under, and a phrase saying where it came from.

    With ``--config`` that file and its drop-ins are the whole policy, as the daemon would read
    them (the scenario's inline ``policy:`` is ignored; StrictModes is not checked). Without it,
    the scenario's ``policy:`` is a drop-in over the built-in defaults. A broken ``--config``
    raises ConfigError (exit 78); a broken inline policy is a malformed scenario (exit 65).
    """
    if config_path is not None:
        return load_policy(config_path, check_permissions=False), config_path
    docs = [("<built-in defaults>", _render_policy(default_policy()))]
    source = "built-in defaults"
    if scenario.policy_doc is not None:
        docs.append(scenario.policy_doc)
        source = "built-in defaults + the scenario's policy"
    try:
        return parse_policy_documents(docs), source
    except ConfigError as err:
        first = err.problems[0]
        key = f"policy.{first.key}" if first.key else "policy"
        extra = f" (and {len(err.problems) - 1} more)" if len(err.problems) > 1 else ""
        raise ScenarioError(
            first.message + extra, path=scenario.path, line=first.line, key=key
        ) from None


# --- the simulation ---------------------------------------------------------------------------


class Simulation:
    """One run of a scenario. Construct, then :meth:`run`."""

    def __init__(self, scenario: Scenario, policy: Policy, policy_source: str = "") -> None:
        self.scenario = scenario
        self.policy = policy
        self.policy_source = policy_source
        self.interval = scenario.interval or policy.interval
        self.world = World(scenario)
        self.now = 0.0
        self.assess_state = AssessState()
        self.plan_state = PlanState()
        self.assessment: Assessment | None = None
        self.timeline: list[Entry] = []
        self.polls = 0
        self.watched: set[ProcessIdentity] = set()  # the daemon's kept pidfds
        self.exited: list[ProcessIdentity] = []  # watched exits not yet reported
        self.queue: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.during: dict[str, list[EventSpec]] = {}  # reset step -> its events, fired once
        for event in scenario.events:
            if event.during is not None:
                self.during.setdefault(event.during, []).append(event)
            else:
                self.schedule(event.at, "event", event)
        for spec in scenario.processes:
            if spec.exits_at is not None:
                self.schedule(spec.exits_at, "exit", (spec.name, "exits_at", None))
        self.gpu_names = {g.uuid: f"GPU {g.index}" for g in scenario.gpus}

    # -- bookkeeping --

    def schedule(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self.queue, (at, next(self.seq), kind, payload))

    def add(self, name: str, level: str, text: str, **fields: object) -> None:
        self.timeline.append(Entry(self.now, name, level, text, fields))

    def pname(self, pid: object) -> str:
        if not isinstance(pid, int):
            return "pid ?"
        proc = self.world.procs.get(pid) or next(
            (p for p in reversed(self.world.history) if p.pid == pid), None
        )
        return f"pid {pid} ({proc.name})" if proc else f"pid {pid}"

    def gname(self, uuid: object) -> str:
        return self.gpu_names.get(str(uuid), str(uuid))

    # -- the loop (daemon._run_locked / poll_once / _wait) --

    def run(self) -> SimulationResult:
        self.advance(0.0)
        busy = 0
        while self.now <= self.scenario.duration:
            previous = self.now
            self.poll()
            due = next_deadline(self.plan_state)
            until = self.now + self.interval
            if due is not None:
                until = min(until, max(self.now, due))
            busy = busy + 1 if until <= previous else 0
            if busy >= BUSY_POLLS:
                self.add("sim.busy_loop", "warning", "the daemon would poll in a busy loop")
                until = self.now + self.interval
                busy = 0
            if until > self.scenario.duration:
                self.advance(self.scenario.duration)
                self.now = self.scenario.duration
                self.report_exits()
                break
            if not self.advance(until):
                self.now = until
            self.report_exits()
        return SimulationResult(
            scenario=self.scenario,
            policy=self.policy,
            policy_source=self.policy_source,
            timeline=self.timeline,
            final=self.final_state(),
            polls=self.polls,
        )

    def advance(self, until: float) -> bool:
        """Apply the world's happenings up to ``until``; True when a watched process exited
        (the daemon's pidfd wait returns at once, and it polls then)."""
        while self.queue and self.queue[0][0] <= until:
            at, _, kind, payload = heapq.heappop(self.queue)
            self.now = max(self.now, at)
            if kind == "event":
                assert isinstance(payload, EventSpec)  # noqa: S101 - scheduled as such
                self.apply(payload)
            else:
                name, why, identity = cast("tuple[str, str, int | None]", payload)
                proc = self.world.by_name(name)
                if proc is not None and (identity is None or proc.start_ticks == identity):
                    self.exit_process(proc, why)
            if self.exited:
                return True
        return False

    def report_exits(self) -> None:
        exited, self.exited = self.exited, []
        for identity in exited:
            self.add(
                "target.exited",
                "info",
                f"{self.pname(identity.pid)} exited (seen through its pidfd)",
                pid=identity.pid,
                start_ticks=identity.start_ticks,
            )
            self.take(record_exit(self.plan_state, identity, now=self.now))

    def poll(self) -> None:
        self.polls += 1
        snapshot = self.world.snapshot(self.now)
        assessment = assess(snapshot, self.assess_state, self.policy.detection)
        self.assess_state = assessment.state
        self.assessment = assessment
        result = plan(
            assessment.findings,
            snapshot,
            self.plan_state,
            self.policy,
            now=self.now,
            wall=WALL0 + self.now,
            report_only=assessment.report_only,
            self_ancestors=frozenset(),
        )
        for intent in self.take(result):
            self.execute(intent, snapshot)

    def take(self, result: PlanResult) -> tuple[Intent, ...]:
        self.plan_state = result.state
        for event in result.events:
            self.add_event(event)
        return tuple(result.intents)

    def add_event(self, event: Event) -> None:
        fields = dict(event.fields)
        self.add(event.name, event.level, describe_event(event.name, fields, self), **fields)

    # -- world events --

    def exit_process(self, proc: _Proc, why: str) -> None:
        identity = ProcessIdentity(proc.pid, proc.start_ticks)
        notes = self.world.exit(proc, self.now, why)
        if proc.exited_at != self.now:
            return
        text = f"{proc.name} (pid {proc.pid}) exited ({why})"
        self.add("world.exit", "info", "; ".join([text, *notes]), process=proc.name, pid=proc.pid)
        if identity in self.watched:
            self.watched.discard(identity)
            self.exited.append(identity)

    def apply(self, event: EventSpec) -> None:
        world = self.world
        action = event.action
        if action == "exit" and event.target is not None:
            proc = world.by_name(event.target)
            if proc is not None and proc.alive:
                self.exit_process(proc, "scenario: exit")
        elif action == "start" and event.process is not None:
            spec = event.process
            proc = world.start(spec, at=self.now)
            self.add(
                "world.start",
                "info",
                f"{spec.name} (pid {spec.pid}) started: {' '.join(spec.command)}",
                process=spec.name,
                pid=spec.pid,
            )
            if spec.exits_at is not None:
                self.schedule(
                    self.now + spec.exits_at, "exit", (spec.name, "exits_at", proc.start_ticks)
                )
        elif action == "set_memory" and event.gpu is not None and event.memory is not None:
            gpu = world.gpus[event.gpu]
            charged = world.allocated(gpu) - gpu.base
            gpu.base = max(0, event.memory - charged)
            self.add(
                "world.memory",
                "info",
                f"GPU {event.gpu}: allocated memory set to {_size(event.memory)}",
                gpu=gpu.spec.uuid,
                allocated=event.memory,
            )
        elif action == "memory_stays_allocated" and event.target is not None:
            world.leak_on_exit.add(event.target)
            self.add(
                "world.leak",
                "info",
                f"{event.target}'s GPU memory will stay allocated after it exits (driver fault)",
                process=event.target,
            )
        elif action == "reset_result" and event.value is not None:
            world.reset_results.append(event.value)
            self.add(
                "world.reset_result",
                "info",
                f"the next GPU reset will end: {event.value}",
                result=event.value,
            )
        elif action == "state" and event.target is not None and event.value is not None:
            proc = world.by_name(event.target)
            if proc is not None and proc.alive:
                proc.state = event.value
                self.add(
                    "world.state",
                    "info",
                    f"{proc.name} (pid {proc.pid}) is now in state {event.value}",
                    process=proc.name,
                    pid=proc.pid,
                    state=event.value,
                )
        elif action == "reap" and event.target is not None:
            proc = world.by_name(event.target)
            if proc is not None and proc.present and not proc.alive:
                world.reap(proc)
                self.add("world.reap", "info", f"zombie {proc.name} was reaped", pid=proc.pid)
        elif action in ("pause", "resume"):
            paused = action == "pause"
            reason = event.value or "admin"
            self.plan_state = set_paused(self.plan_state, paused, reason=reason)
            self.add(
                "daemon.paused" if paused else "daemon.resumed",
                "warning",
                f"an administrator ran gpuwatchd {action}" + (f" ({reason})" if paused else ""),
                reason=reason if paused else None,
            )

    # -- intents (daemon._execute) --

    def execute(self, intent: Intent, snapshot: Snapshot) -> None:
        if isinstance(intent, SignalIntent):
            self.execute_signal(intent, snapshot)
        elif isinstance(intent, ResetIntent):
            self.execute_reset(intent, snapshot)
        else:
            self.execute_hook(intent)

    def execute_signal(self, intent: SignalIntent, snapshot: Snapshot) -> None:
        identity = intent.identity
        proc = self.world.procs.get(identity.pid)
        if proc is None or not proc.spec.visible:
            outcome, detail = "gone", f"PID {identity.pid} does not exist"
        elif proc.start_ticks != identity.start_ticks:
            outcome, detail = "reused", f"PID {identity.pid} now belongs to {proc.name}"
        elif proc.state == "Z":
            outcome, detail = "zombie", f"PID {identity.pid} is a zombie"
        elif intent.dry_run:
            outcome, detail = "dry_run", f"would send {intent.signal}"
        else:
            outcome, detail = "delivered", f"{intent.signal} sent"
        if outcome in ("delivered", "dry_run"):
            self.watched.add(identity)
        name = proc.name if proc is not None else None
        self.add(
            "action.signal",
            SIGNAL_OUTCOME_LEVELS.get(outcome, "info"),
            f"{intent.signal} → {self.pname(identity.pid)}: {outcome}"
            + (" (dry-run: nothing sent)" if outcome == "dry_run" else ""),
            pid=identity.pid,
            start_ticks=identity.start_ticks,
            signal=intent.signal,
            gpu=intent.gpu,
            rule=intent.rule,
            step=intent.step,
            dry_run=intent.dry_run,
            outcome=outcome,
            detail=detail,
            reason=intent.reason,
            process=name,
        )
        if proc is not None and outcome == "delivered":
            proc.signals.append((self.now, intent.signal, outcome))
            self.react(proc, intent.signal)
        for follow_up in self.take(record_signal(self.plan_state, intent, outcome, now=self.now)):
            self.execute(follow_up, snapshot)

    def react(self, proc: _Proc, signal: str) -> None:
        spec = proc.spec
        if proc.state == "D":
            return  # the signal stays pending until it leaves uninterruptible sleep
        if signal == "SIGKILL":
            if spec.on_sigkill == "stuck":
                proc.state = "D"
                self.add(
                    "world.state",
                    "info",
                    f"{proc.name} (pid {proc.pid}) hangs in the driver (D state) on SIGKILL",
                    process=proc.name,
                    pid=proc.pid,
                    state="D",
                )
            else:
                self.schedule(
                    self.now, "exit", (proc.name, f"killed by {signal}", proc.start_ticks)
                )
            return
        if spec.on_sigterm == "exit":
            self.schedule(self.now, "exit", (proc.name, f"on {signal}", proc.start_ticks))
        elif spec.on_sigterm == "exit_after":
            self.schedule(
                self.now + spec.sigterm_delay,
                "exit",
                (proc.name, f"{spec.sigterm_delay:g}s after {signal}", proc.start_ticks),
            )

    def execute_hook(self, intent: HookIntent) -> None:
        hooks = self.policy.on_failure
        if not hooks:
            self.add(
                "hook.run",
                "warning",
                f"{intent.hook}: no hooks configured ({intent.reason})",
                hook=intent.hook,
                argv=[],
                reason=intent.reason,
                dry_run=intent.dry_run,
            )
            return
        for hook in hooks:
            self.add(
                "hook.run",
                "warning",
                f"{intent.hook} hook ran: {' '.join(hook.argv)} ({intent.reason})",
                hook=intent.hook,
                argv=list(hook.argv),
                returncode=0,
                timed_out=False,
                reason=intent.reason,
                dry_run=intent.dry_run,
            )

    def execute_reset(self, intent: ResetIntent, snapshot: Snapshot) -> None:
        """reset.perform_reset itself, against the virtual host (daemon._execute_reset)."""
        gpu = next((g for g in snapshot.nvml.gpus if g.uuid == intent.gpu), None)
        target = ResetTarget(
            uuid=intent.gpu,
            pci_bus_id=intent.pci_bus_id,
            minor=intent.minor,
            persistence_was_on=gpu.persistence_mode if gpu else None,
        )
        virtual = VirtualReset(self, target)
        outcome = perform_reset(
            target,
            self.policy.reset,
            virtual,
            dry_run=intent.dry_run,
            hook_env={"GPUWATCHD_GPU_UUID": intent.gpu},
            runner=virtual.run,
        )
        level, fields = outcome_event(
            outcome, gpu=intent.gpu, pci_bus_id=intent.pci_bus_id, dry_run=intent.dry_run
        )
        self.add(
            "reset.outcome",
            level,
            f"reset {self.gname(intent.gpu)}: {outcome.result} — {outcome.reason}",
            **fields,
        )
        follow_ups = self.take(
            record_reset(
                self.plan_state,
                intent,
                outcome.result,
                now=self.now,
                wall=WALL0 + self.now,
                needs_reboot=outcome.needs_reboot,
            )
        )
        for follow_up in follow_ups:
            self.execute(follow_up, self.world.snapshot(self.now))

    def reached(self, step: str) -> None:
        """The reset procedure has run ``step``: the scenario's ``during: STEP`` events happen
        now (once each, at the first reset that gets there)."""
        for event in self.during.pop(step, []):
            first = len(self.timeline)
            self.apply(event)
            for i in range(first, len(self.timeline)):
                entry = self.timeline[i]
                self.timeline[i] = dataclasses.replace(
                    entry,
                    text=f"{entry.text} (during the reset's {step} step)",
                    fields={**entry.fields, "during": step},
                )

    # -- the end --

    def final_state(self) -> dict[str, object]:
        world = self.world
        gpus = []
        for index in sorted(world.gpus):
            gpu = world.gpus[index]
            gpus.append(
                {
                    "index": index,
                    "uuid": gpu.spec.uuid,
                    "allocated": world.allocated(gpu),
                    "idle": gpu.spec.allocated,
                    "lost": gpu.lost,
                }
            )
        processes = []
        for proc in world.history:
            status = "alive" if proc.alive else ("zombie" if proc.present else "exited")
            if proc.alive and proc.state == "D":
                status = "stuck (D)"
            processes.append(
                {
                    "name": proc.name,
                    "pid": proc.pid,
                    "status": status,
                    "exited_at": proc.exited_at,
                    "exit_why": proc.exit_why,
                    "signals": [{"t": t, "signal": s} for t, s, _ in proc.signals],
                }
            )
        findings = [] if self.assessment is None else [f.key for f in self.assessment.findings]
        state = self.plan_state
        return {
            "t": self.now,
            "gpus": gpus,
            "processes": processes,
            "open_findings": findings,
            "signals_delivered": sum(len(p.signals) for p in world.history),
            "resets": [
                {"t": e.t, "gpu": e.fields["gpu"], "result": e.fields["result"]}
                for e in self.timeline
                if e.name == "reset.outcome"
            ],
            "hooks_run": sum(1 for e in self.timeline if e.name == "hook.run"),
            "forced_dry_run": state.forced_dry_run,
            "circuit_open": state.circuit_open,
            "paused": state.paused,
        }


class VirtualReset:
    """The virtual host's side of one reset: a :class:`gpuwatchd.act.reset.ResetEnvironment` for
    the daemon's part (NVML worker, holder scan, memory, progress, events) and, in :meth:`run`,
    a :class:`gpuwatchd.act.reset.CommandRunner` that answers the procedure's commands as the
    virtual host would. Nothing is ever executed.

    =============================  ==========================================================
    command (matched by argv)      answer
    =============================  ==========================================================
    ``reset.command``              the next scripted ``reset_result`` (default ``success``):
                                   ``success`` exit 0, every dead or leaked context on the
                                   GPU freed; ``fail`` exit 255; ``in_use`` exit 255 "In use
                                   by another client"; ``hang`` killed at its timeout, the
                                   clock advanced by it; ``fell_off_bus`` exit 15, GPU lost
    ``reset.persistence_command``  exit 0, persistence mode set (exit 15 on a lost GPU)
    ``reset.health_command``       exit 0 (exit 15 on a lost GPU)
    a hook                         exit 0, recorded in the step's event; ``drain`` and
                                   ``before`` hooks stop the ``stops_for_reset`` processes
    anything else                  could not be started
    =============================  ==========================================================
    """

    def __init__(self, sim: Simulation, target: ResetTarget) -> None:
        self.sim = sim
        self.target = target
        self.gpu = sim.world.gpu_by_uuid(target.uuid)
        policy = sim.policy.reset
        values: dict[str, str | None] = {
            "uuid": target.uuid,
            "pci_bus_id": target.pci_bus_id,
            "minor": None if target.minor is None else str(target.minor),
        }
        self.commands: dict[tuple[str, ...], str] = {}
        for what, template, mode in (
            ("reset", policy.command, None),
            ("health", policy.health_command, None),
            ("persistence_off", policy.persistence_command, "0"),
            ("persistence_on", policy.persistence_command, "1"),
        ):
            try:
                argv = format_argv(template, **values, **({"mode": mode} if mode else {}))
            except ValueError:
                continue  # perform_reset refuses before anything runs
            self.commands.setdefault(argv, what)

    # -- reset.ResetEnvironment --

    def stop_nvml(self) -> bool:
        return True  # the daemon's NVML worker is virtual too: nothing of ours holds the GPU

    def final_blockers(self, target: ResetTarget) -> list[str]:
        """The daemon's own ``reset_blockers`` over the virtual host's holders right now."""
        from gpuwatchd.decide.floor import reset_blockers

        world = self.sim.world
        scan = world.holders()
        if self.gpu is not None and not self.gpu.persistence:
            # nvidia-persistenced lets go of a GPU once its persistence mode is off.
            kept = {
                pid: holding
                for pid, holding in scan.holdings.items()
                if not world.procs[pid].spec.comm.startswith("nvidia-persiste")
            }
            scan = dataclasses.replace(scan, holdings=kept)
        return reset_blockers(scan, world.processes(), target.minor, frozenset())

    def memory_back_to_baseline(self, target: ResetTarget) -> bool | None:
        """As the daemon reads it: allocated within ``ghost_margin`` of the learned baseline."""
        if self.gpu is None or self.gpu.lost:
            return None
        return back_to_baseline(
            target.uuid,
            self.sim.world.allocated(self.gpu),
            self.sim.assess_state,
            self.sim.policy.detection,
        )

    def record_step(self, target: ResetTarget, step: ResetStep, data: Mapping[str, object]) -> None:
        """The virtual host has no state file; the daemon logs no event for a record."""

    def emit(self, event: str, level: str, **fields: object) -> None:
        sim = self.sim
        sim.add(event, level, describe_event(event, fields, sim), **fields)
        if event == "reset.step":
            sim.reached(str(fields.get("step")))

    # -- reset.CommandRunner --

    def run(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        args = tuple(argv)
        hook = (env or {}).get("GPUWATCHD_EVENT")
        if hook is not None:
            return self.hook(args, hook)
        what = self.commands.get(args)
        gpu = self.gpu
        bus = self.target.pci_bus_id or self.target.uuid
        if what is None or gpu is None:
            error = f"cannot run {args[0] if args else '?'}: not a command of the virtual host"
            return CommandResult(args, None, "", False, 0.0, error)
        if gpu.lost:
            lost = f"Unable to determine the device handle for GPU {bus}: GPU is lost."
            return CommandResult(args, 15, lost, False, 0.1, None)
        if what == "reset":
            return self.reset(args, gpu, bus, timeout)
        if what in ("persistence_off", "persistence_on"):
            gpu.persistence = what == "persistence_on"
            state = "Enabled" if gpu.persistence else "Disabled"
            return CommandResult(
                args, 0, f"{state} persistence mode for GPU {bus}.", False, 0.1, None
            )
        return CommandResult(args, 0, "", False, 0.2, None)  # the health query

    def hook(self, argv: tuple[str, ...], event: str) -> CommandResult:
        if event in ("reset_drain", "reset_before"):
            phase = event.removeprefix("reset_")
            for proc in list(self.sim.world.procs.values()):
                if proc.spec.stops_for_reset and proc.alive:
                    self.sim.exit_process(proc, f"stopped by the reset's {phase} hook")
        return CommandResult(argv, 0, "", False, 0.0, None)

    def reset(self, argv: tuple[str, ...], gpu: _Gpu, bus: str, timeout: float) -> CommandResult:
        world, sim = self.sim.world, self.sim
        scripted = world.reset_results.pop(0) if world.reset_results else "success"
        if scripted == "success":
            world.restore(gpu)
            done = f"GPU {bus} was successfully reset.\nAll done."
            return CommandResult(argv, 0, done, False, 2.0, None)
        if scripted == "hang":
            sim.now += timeout
            sim.advance(sim.now)
            return CommandResult(argv, -9, "", True, timeout, None)  # killed with its group
        if scripted == "fell_off_bus":
            gpu.lost = True
            lost = f"Unable to reset GPU {bus}: GPU has fallen off the bus."
            return CommandResult(argv, 15, lost, False, 1.0, None)
        if scripted == "in_use":
            in_use = f"GPU {bus}: In use by another client"
            return CommandResult(argv, 255, in_use, False, 0.5, None)
        return CommandResult(
            argv, 255, f"Unable to reset GPU {bus}: Unknown Error", False, 0.5, None
        )


def simulate(scenario: Scenario, config_path: str | None = None) -> SimulationResult:
    """Play ``scenario`` under its policy (or ``config_path``'s) and return the timeline."""
    policy, source = scenario_policy(scenario, config_path)
    return Simulation(scenario, policy, source).run()


# --- text -------------------------------------------------------------------------------------


def _size(value: object) -> str:
    if not isinstance(value, int) or isinstance(value, bool):
        return "an unknown amount"
    if value >= 1024 * MIB and value % (1024 * MIB) == 0:
        return f"{value // (1024 * MIB)} GiB"
    if value >= 1024 * MIB:
        return f"{value / (1024 * MIB):.1f} GiB"
    return f"{value // MIB} MiB"


def _num(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _fmt_t(seconds: float) -> str:
    return f"+{seconds:.1f}s"


def _target(fields: Mapping[str, object], sim: Simulation) -> str:
    pid = fields.get("pid")
    return sim.pname(pid) if isinstance(pid, int) else sim.gname(fields.get("gpu"))


def _describe_finding_new(f: Mapping[str, object], sim: Simulation) -> str:
    tag = "" if f.get("actionable") else " [report only]"
    where = f" on {sim.gname(f.get('gpu'))}" if isinstance(f.get("pid"), int) else ""
    return f"{f.get('kind')} {_target(f, sim)}{where}{tag}: {f.get('reason')}"


def _describe_resolved(f: Mapping[str, object], sim: Simulation) -> str:
    kind, _, rest = str(f.get("finding")).partition(":")
    target = rest.rpartition(":")[2]
    pid = target.split("@", 1)[0]
    who = sim.pname(int(pid)) if pid.isdigit() else sim.gname(f.get("gpu"))
    lasted = f.get("lasted")
    after = f"{lasted:g}s" if isinstance(lasted, (int, float)) else "?"
    return f"{kind} {who} resolved after {after}"


def _argv(value: object) -> str:
    return shlex.join(str(a) for a in value) if isinstance(value, (list, tuple)) else "?"


def _describe_reset_step(f: Mapping[str, object], sim: Simulation) -> str:
    """One line per ``reset.step`` event: the step, how it went, what ran or blocked it."""
    status = str(f.get("status"))
    line = f"reset {sim.gname(f.get('gpu'))}: {f.get('step')} {status}"
    blockers, hooks, argv = f.get("blockers"), f.get("hooks"), f.get("argv")
    detail = f.get("detail")
    if isinstance(blockers, list) and blockers:
        return f"{line}: " + "; ".join(str(b) for b in blockers)
    if status == "failed" and isinstance(hooks, list):
        return f"{line}: {detail}"
    if isinstance(hooks, list):
        return f"{line}: " + "; ".join(_argv(h) for h in hooks)
    if argv is not None:
        line += f": {_argv(argv)}"
        if detail is not None:
            line += f" → {detail}"
        output = f.get("output")
        if output and status == "failed":
            line += f" ({output})"
        return line
    detail = detail or _STEP_NOTES.get((str(f.get("step")), status))
    return f"{line} ({detail})" if detail else line


_STEP_NOTES = {
    ("stop_nvml", "ok"): "the daemon's NVML worker stopped",
    ("final_scan", "clear"): "no other process holds the GPU",
}


_DESCRIBERS: dict[str, Callable[[Mapping[str, object], Simulation], str]] = {
    "finding.new": _describe_finding_new,
    "finding.changed": lambda f, s: f"{f.get('kind')} {_target(f, s)} changed: {f.get('reason')}",
    "finding.resolved": _describe_resolved,
    "escalation.confirming": lambda f, s: (
        f"{f.get('kind')} {_target(f, s)} matches rule "
        f"{f.get('rule')}; confirming until {_fmt_t(_num(f.get('due')))}"
    ),
    "escalation.step_due": lambda f, s: (
        f"rule {f.get('rule')} step {f.get('step')}/{f.get('of')}: "
        f"{f.get('signal') or 'report'} {_target(f, s)}, then wait {_num(f.get('wait')):g}s"
        + (" [dry-run]" if f.get("dry_run") else "")
    ),
    "escalation.resolved": lambda f, s: f"escalation of {_target(f, s)} resolved: {f.get('why')}",
    "escalation.ended": lambda f, s: f"escalation of {_target(f, s)} ended: {f.get('why')}",
    "escalation.aborted": lambda f, s: f"escalation of {_target(f, s)} aborted: {f.get('why')}",
    "escalation.restarted": lambda f, s: f"escalation of {_target(f, s)} restarted: {f.get('why')}",
    "action.refused": lambda f, s: f"no action on {_target(f, s)}: {f.get('why')}",
    "action.deferred": lambda f, s: (
        f"{_target(f, s)} deferred: {f.get('why')} until {_fmt_t(_num(f.get('until')))}"
    ),
    "rule.report_only": lambda f, s: (
        f"{f.get('kind')} {_target(f, s)} matches report-only rule {f.get('rule')}"
    ),
    "target.stuck": lambda f, s: f"{_target(f, s)} is stuck: {f.get('why')}",
    "zombie.needs_reap": lambda f, s: (
        f"{_target(f, s)} is a zombie; its parent "
        f"{s.pname(f.get('parent')) if f.get('parent') else '(unknown)'} must reap it"
    ),
    "limits.kill_cap_reached": lambda f, s: f"kill cap reached ({f.get('why')}): dry-run engaged",
    "reset.confirming": lambda f, s: f"{s.gname(f.get('gpu'))}: ghost memory, {f.get('why')}",
    "reset.due": lambda f, s: (
        f"{s.gname(f.get('gpu'))}: reset due" + (" [dry-run]" if f.get("dry_run") else "")
    ),
    "reset.refused": lambda f, s: f"{s.gname(f.get('gpu'))}: no reset: {f.get('why')}",
    "reset.limit_reached": lambda f, s: f"{s.gname(f.get('gpu'))}: reset limit: {f.get('why')}",
    "reset.circuit_open": lambda f, s: f"resets stopped: {f.get('why')}",
    "reset.succeeded": lambda f, s: f"{s.gname(f.get('gpu'))}: reset succeeded",
    "reset.failed": lambda f, s: (
        f"{s.gname(f.get('gpu'))}: reset {f.get('outcome')} (failure {f.get('failures')})"
    ),
    "reset.dry_run": lambda f, s: f"{s.gname(f.get('gpu'))}: reset would have run (dry-run)",
    "gpu.needs_reboot": lambda f, s: f"{s.gname(f.get('gpu'))} needs a reboot",
    "reset.step": _describe_reset_step,
    "reset.finished": lambda f, s: (
        f"reset {s.gname(f.get('gpu'))} finished at {f.get('step')}: {f.get('result')} "
        f"— {f.get('reason')}"
    ),
}


def describe_event(name: str, fields: Mapping[str, object], sim: Simulation) -> str:
    """One human line for a planner event."""
    describer = _DESCRIBERS.get(name)
    if describer is not None:
        return describer(fields, sim)
    return ", ".join(f"{k}={v}" for k, v in fields.items() if v is not None)


# reset.finished says what the reset.outcome line after it says again.
_QUIET = frozenset({"escalation.signal_recorded", "reset.finished"})
_COLUMN = {
    "finding": "finding",
    "escalation": "plan",
    "action": "action",
    "rule": "plan",
    "target": "target",
    "zombie": "plan",
    "limits": "LIMIT",
    "reset": "reset",
    "gpu": "GPU",
    "hook": "hook",
    "world": "world",
    "daemon": "admin",
}


def render_text(result: SimulationResult) -> str:
    """The timeline for people: a header, one line per entry, the final state."""
    scenario, policy = result.scenario, result.policy
    lines = [
        f"simulate {scenario.path}: {len(scenario.gpus)} GPU(s), "
        f"{len(scenario.processes)} process(es), {scenario.duration:g}s, "
        f"interval {scenario.interval or policy.interval:g}s, "
        f"{'dry-run' if policy.dry_run else 'enforcing'}; policy: {result.policy_source}",
    ]
    if scenario.description:
        lines.append(f"  {scenario.description.strip().splitlines()[0]}")
    lines.append("")
    for entry in result.timeline:
        if entry.name in _QUIET:
            continue
        column = _COLUMN.get(entry.name.split(".", 1)[0], "sim")
        lines.append(f"{_fmt_t(entry.t):>9}  {column:<8} {entry.text}")
    final = result.final
    lines.append("")
    lines.append(f"final state at {_fmt_t(float(final['t']))} ({result.polls} polls):")  # type: ignore[arg-type]
    for gpu in final["gpus"]:  # type: ignore[attr-defined]
        lost = ", LOST" if gpu["lost"] else ""
        lines.append(
            f"  GPU {gpu['index']}: {_size(gpu['allocated'])} allocated "
            f"(idle {_size(gpu['idle'])}){lost}"
        )
    for proc in final["processes"]:  # type: ignore[attr-defined]
        signals = ", ".join(f"{s['signal']} at {_fmt_t(s['t'])}" for s in proc["signals"])
        ended = ""
        if proc["exited_at"] is not None:
            ended = f" at {_fmt_t(proc['exited_at'])} ({proc['exit_why']})"
        lines.append(
            f"  {proc['name']} (pid {proc['pid']}): {proc['status']}{ended}"
            + (f"; signalled: {signals}" if signals else "; never signalled")
        )
    resets = final["resets"]
    lines.append(
        f"  signals delivered: {final['signals_delivered']}; resets: "
        + (", ".join(f"{r['result']} at {_fmt_t(r['t'])}" for r in resets) or "none")  # type: ignore[attr-defined]
        + f"; hooks run: {final['hooks_run']}"
    )
    open_findings = final["open_findings"]
    lines.append(
        "  open findings: " + (", ".join(open_findings) if open_findings else "none")  # type: ignore[arg-type]
    )
    return "\n".join(lines) + "\n"


def _jsonable(value: object) -> object:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
