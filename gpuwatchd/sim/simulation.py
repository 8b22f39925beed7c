"""The simulation behind ``gpuwatchd simulate``: the engine on a virtual clock over a scenario.

In detail: docs/internals.md, section `gpuwatchd.sim.simulation`.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from gpuwatchd.act.commands import CommandResult
from gpuwatchd.act.signals import SignalResult
from gpuwatchd.config.schema import (
    default_policy,
    format_duration,
    load_policy,
    parse_policy_documents,
    render_policy,
)
from gpuwatchd.config.yamlsrc import ConfigError
from gpuwatchd.core.escape import escape
from gpuwatchd.core.model import (
    GpuInfo,
    HolderScan,
    Pause,
    ProcessIdentity,
    ProcessInfo,
    Snapshot,
    Spare,
    fields_of,
)
from gpuwatchd.core.vocabulary import EventName, Level, SignalOutcome, TimelineEvent
from gpuwatchd.decide.argv import format_argv
from gpuwatchd.decide.policy import Policy
from gpuwatchd.engine.cycle import Engine
from gpuwatchd.engine.edges import PollInputs
from gpuwatchd.events.catalogue import render
from gpuwatchd.sim.scenario_spec import EventSpec, Scenario, ScenarioError
from gpuwatchd.sim.timeline import Entry, SimulationResult, TimelineNamer
from gpuwatchd.sim.world import (
    GI_PROFILE_IDS,
    WALL0,
    SimulationError,
    World,
    WorldGpu,
    WorldProc,
    mig_uuid,
    size_text,
)
from gpuwatchd.state.pause import TIME_UP
from gpuwatchd.state.spares import MAX_SPARES

BUSY_POLLS = 50  # polls at one instant before the simulation calls it a busy loop
MAX_POLLS = 100_000  # interval polls one simulation may take; more is refused up front
# Polls times processes, and polls times GPUs, one simulation may take (each costs some 40 us, a
# GPU more): a 1 MiB scenario of 35,000 processes would otherwise poll for hours.
MAX_PROCESS_POLLS = 2_000_000
SIM_HOSTNAME = "sim-node"  # {hostname} in the hooks of a simulated host


# --- the policy -------------------------------------------------------------------------------


def scenario_policy(scenario: Scenario, config_path: str | None) -> tuple[Policy, str]:
    """The policy to simulate under, and a phrase saying where it came from: ``--config``'s
    files as the daemon reads them (ConfigError), else the scenario's ``policy:`` as a
    drop-in over the built-in defaults (ScenarioError)."""
    if config_path is not None:
        return load_policy(config_path, check_permissions=False), config_path
    docs = [("<built-in defaults>", render_policy(default_policy()))]
    source = "built-in defaults"
    if scenario.policy is not None:
        docs.append(scenario.policy)
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


def _check_playable(scenario: Scenario, policy: Policy) -> None:
    """SimulationError for a scenario that cannot be played under ``policy``: too many polls
    (or processes over them), or a spare event whose ``for`` the spare command refuses."""
    polls = scenario.duration / policy.interval
    if polls > MAX_POLLS:
        raise SimulationError(
            f"{scenario.path}: duration {scenario.duration:g}s at interval {policy.interval:g}s "
            f"is {polls:.0f} polls; at most {MAX_POLLS} are simulated (shorten duration or "
            "lengthen interval)"
        )
    procs = len(scenario.processes) + sum(e.process is not None for e in scenario.events)
    for count, one, many in ((procs, "process", "processes"), (len(scenario.gpus), "GPU", "GPUs")):
        if polls * count > MAX_PROCESS_POLLS:
            raise SimulationError(
                f"{scenario.path}: {count} {many} over {polls:.0f} polls are {polls * count:,.0f} "
                f"{one}-polls; at most {MAX_PROCESS_POLLS:,} are simulated (fewer {many}, a "
                "shorter duration or a longer interval)"
            )
    longest = policy.limits.max_spare
    for event in scenario.events:
        if event.lasts is not None and not 1 <= event.lasts <= longest:
            raise SimulationError(
                f"{scenario.path}:{event.line}: spare for: {format_duration(event.lasts)}: "
                f"'gpuwatchd spare --for' must be between 1s and limits.max_spare "
                f"({format_duration(longest)})"
            )


class Simulation:
    def __init__(self, scenario: Scenario, policy: Policy, policy_source: str = "") -> None:
        self.scenario = scenario
        # The policy the run plays under: the scenario's interval, if it has one, is its own.
        self.policy = dataclasses.replace(policy, interval=scenario.interval or policy.interval)
        self.policy_source = policy_source
        self.world = World(scenario)
        self.now = 0.0
        self.timeline: list[Entry] = []
        self.polls = 0
        self.watched: set[ProcessIdentity] = set()  # the daemon's kept pidfds
        self.exited: list[ProcessIdentity] = []  # watched exits not yet reported
        self.queue: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.during: dict[str, list[EventSpec]] = {}  # reset step -> its events, fired once
        self.spares: dict[str, Spare] = {}  # `spare` events: read by the daemon at each poll
        self.pause: Pause | None = None  # `pause`/`resume` events: read at the next poll, too
        _check_playable(scenario, self.policy)
        for event in scenario.events:
            if event.during is not None:
                self.during.setdefault(event.during, []).append(event)
            else:
                self.schedule(event.at, partial(self.apply, event))
        for spec in scenario.processes:
            if spec.exits_at is not None:
                self.exit_later(self.world.procs[spec.pid], spec.exits_at, "exits_at")
        self.gpu_names = {g.uuid: f"GPU {g.index}" for g in scenario.gpus}
        host = VirtualHost(self)
        self.engine = Engine(
            self.policy,
            reader=host,
            actuator=host,
            clock=host,
            sink=host,
            hostname=SIM_HOSTNAME,
            sleep=self.sleep,
        )

    def schedule(self, at: float, happening: Callable[[], None]) -> None:
        heapq.heappush(self.queue, (at, next(self.seq), happening))

    def exit_later(self, proc: WorldProc, delay: float, why: str) -> None:
        self.schedule(self.now + delay, partial(self.exit_process, proc, why))

    def add(self, name: str, level: Level, text: str, **fields: object) -> None:
        """A timeline entry; its sentence escaped, as the journal's is (the scenario's names)."""
        self.timeline.append(Entry(self.now, name, level, escape(text), fields))

    def happened(self, name: TimelineEvent, text: str, **fields: object) -> None:
        """What the scenario made happen: a ``world.*`` entry, at info."""
        self.add(name, Level.INFO, text, **fields)

    def pname(self, pid: object) -> str:
        if not isinstance(pid, int):
            return "pid ?"
        # The last process started with the PID: the one that has it now, if any.
        proc = next((p for p in reversed(self.world.history.values()) if p.pid == pid), None)
        return f"pid {pid} ({proc.name})" if proc else f"pid {pid}"

    def gname(self, uuid: object) -> str:
        return self.gpu_names.get(str(uuid), str(uuid))

    # -- the loop (the daemon's: poll, then wait until wake_at or an exit) --

    def run(self) -> SimulationResult:
        self.advance(0.0)
        busy = 0
        duration = self.scenario.duration
        while self.now <= duration:
            previous = self.now
            self.polls += 1
            wall = WALL0 + self.now  # as the daemon reads the spare files: those in force
            if self.pause is not None and self.pause.until is not None and self.pause.until <= wall:
                self.pause = Pause(None, resumed=TIME_UP)  # and the pause file, its time up
            spares = tuple(s for s in self.spares.values() if s.until > wall)
            until = self.engine.poll(PollInputs(pause=self.pause, spares=spares)).wake_at
            busy = busy + 1 if until <= previous else 0
            if busy >= BUSY_POLLS:
                self.add(
                    TimelineEvent.BUSY_LOOP, Level.WARNING, "the daemon would poll in a busy loop"
                )
                until = self.now + self.policy.interval
                busy = 0
            last = until > duration  # the run ends at its duration
            until = min(until, duration)
            if not self.advance(until) or last:
                self.now = until
            self.engine.note_exits(self.take_exits())
            if last:
                break
        return SimulationResult(
            scenario=self.scenario,
            policy=self.policy,
            policy_source=self.policy_source,
            timeline=self.timeline,
            final=self.final_state(),
            polls=self.polls,
            names=self,
        )

    def advance(self, until: float) -> bool:
        """Apply the world's happenings up to ``until``; True when a watched process exited
        (the daemon's pidfd wait returns at once, and it polls then)."""
        while self.queue and self.queue[0][0] <= until:
            at, _, happening = heapq.heappop(self.queue)
            self.now = max(self.now, at)
            happening()
            if self.exited:
                return True
        return False

    def sleep(self, seconds: float) -> None:
        """A wait inside the reset procedure (the NVLink fabric): virtual time passes, and
        the world's happenings in it take place."""
        self.now += seconds
        self.advance(self.now)

    def take_exits(self) -> list[ProcessIdentity]:
        exited, self.exited = self.exited, []
        return exited

    # -- world events --

    def exit_process(self, proc: WorldProc, why: str) -> None:
        """``proc`` exits now, unless it already has (two of its exits may fall at once)."""
        if not proc.alive:
            return
        identity = ProcessIdentity(proc.pid, proc.start_ticks)
        notes = self.world.exit(proc, self.now, why)
        said = "; ".join([f"{proc.name} (pid {proc.pid}) exited ({why})", *notes])
        self.happened(TimelineEvent.EXIT, said, process=proc.name, pid=proc.pid)
        if identity in self.watched:
            self.watched.discard(identity)
            self.exited.append(identity)

    def apply(self, event: EventSpec) -> None:
        """A timeline step applied: to the daemon's switches, to a process or to a GPU (each
        of these three leaves the others' steps alone)."""
        action, wall = event.action, WALL0 + self.now
        if action in ("pause", "resume"):  # `gpuwatchd pause` (no --for) lasts max_pause
            until = wall + self.policy.limits.max_pause
            self.pause = Pause(event.value or "admin", until) if action == "pause" else Pause(None)
        elif action == "spare" and (spare := self.world.spare(event, wall)) is not None:
            # As `gpuwatchd spare` refuses a new target while MAX_SPARES are in force.
            in_force = {s.target for s in self.spares.values() if s.until > wall}
            if len(in_force) >= MAX_SPARES and spare.target not in in_force:
                raise SimulationError(
                    f"{self.scenario.path}:{event.line}: spare: {MAX_SPARES} spares are in force, "
                    "the most the daemon honours at once: 'gpuwatchd spare' refuses another"
                )
            self.spares[spare.target] = spare
        self._apply_to_process(event)
        self._apply_to_gpu(event)

    def _apply_to_process(self, event: EventSpec) -> None:
        world, action = self.world, event.action
        proc = None if event.target is None else world.history.get(event.target)  # by its name
        if action == "exit" and proc is not None and proc.alive:
            self.exit_process(proc, "scenario: exit")
        elif action == "start" and event.process is not None:
            spec = event.process
            started = world.start(spec, at=self.now)
            said = f"{spec.name} (pid {spec.pid}) started: {' '.join(spec.command)}"
            self.happened(TimelineEvent.START, said, process=spec.name, pid=spec.pid)
            if spec.exits_at is not None:
                self.exit_later(started, spec.exits_at, "exits_at")
        elif action == "state" and proc is not None and proc.alive and event.value is not None:
            proc.state = event.value
            said = f"{proc.name} (pid {proc.pid}) is now in state {event.value}"
            self.happened(
                TimelineEvent.STATE, said, process=proc.name, pid=proc.pid, state=event.value
            )
            if event.value != "D" and any(s == "SIGKILL" for _, s, _ in proc.signals):
                self.exit_later(proc, 0, "killed by SIGKILL, pending while in D state")
        elif action == "reap" and proc is not None and proc.present and not proc.alive:
            world.reap(proc)
            self.happened(TimelineEvent.REAP, f"zombie {proc.name} was reaped", pid=proc.pid)

    def _apply_to_gpu(self, event: EventSpec) -> None:
        world, action = self.world, event.action
        gpu = None if event.gpu is None else world.gpus[event.gpu]  # set_memory, xid, health
        if action == "set_memory" and gpu is not None and event.memory is not None:
            charged = world.allocated(gpu) - gpu.base
            gpu.base = max(0, event.memory - charged)
            said = f"GPU {event.gpu}: allocated memory set to {size_text(event.memory)}"
            self.happened(TimelineEvent.MEMORY, said, gpu=gpu.spec.uuid, allocated=event.memory)
        elif action == "memory_stays_allocated" and event.target is not None:
            world.leak_on_exit.add(event.target)
            said = f"{event.target}'s GPU memory will stay allocated after it exits (driver fault)"
            self.happened(TimelineEvent.LEAK, said, process=event.target)
        elif action == "reset_result" and event.value is not None:
            world.reset_results.append(event.value)
            said = f"the next GPU reset will end: {event.value}"
            self.happened(TimelineEvent.RESET_RESULT, said, result=event.value)
        elif action == "xid" and gpu is not None and event.xid is not None:
            gpu.xids.append((event.xid, self.now))
            said = f"GPU {event.gpu}: Xid {event.xid}"
            self.happened(TimelineEvent.XID, said, gpu=gpu.spec.uuid, xid=event.xid)
        elif action == "health" and gpu is not None and event.health is not None:
            gpu.health = dataclasses.replace(gpu.health, **event.health)  # type: ignore[arg-type]
            said = f"GPU {event.gpu}: " + ", ".join(f"{k}={v}" for k, v in event.health.items())
            self.happened(TimelineEvent.HEALTH, said, gpu=gpu.spec.uuid, **event.health)

    def react(self, proc: WorldProc, signal: str) -> None:
        spec = proc.spec
        if proc.state == "D":
            return  # the signal stays pending until it leaves uninterruptible sleep
        if signal == "SIGKILL":
            if spec.on_sigkill == "stuck":
                proc.state = "D"
                said = f"{proc.name} (pid {proc.pid}) hangs in the driver (D state) on SIGKILL"
                self.happened(TimelineEvent.STATE, said, process=proc.name, pid=proc.pid, state="D")
            else:
                self.exit_later(proc, 0, f"killed by {signal}")
            return
        if spec.on_sigterm == "exit":
            self.exit_later(proc, 0, f"on {signal}")
        elif spec.on_sigterm == "exit_after":
            self.exit_later(proc, spec.sigterm_delay, f"{spec.sigterm_delay:g}s after {signal}")

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

    def final_state(self) -> dict[str, object]:
        world = self.world
        gpus = [
            {
                "index": index,
                "uuid": gpu.spec.uuid,
                "allocated": world.allocated(gpu),
                "idle": gpu.spec.allocated,
                "lost": gpu.lost,
            }
            for index, gpu in sorted(world.gpus.items())
        ]
        processes = [
            {
                **fields_of(proc, ("name", "pid", "status", "exited_at", "exit_why")),
                "signals": [{"t": t, "signal": s} for t, s, _ in proc.signals],
            }
            for proc in world.history.values()
        ]
        standing = self.engine.standing()  # as the last poll and the exits since left it
        findings = [f.key for f in standing.assessment.findings] if standing.assessment else []
        return {
            "t": self.now,
            "gpus": gpus,
            "processes": processes,
            "open_findings": findings,
            "signals_delivered": sum(len(p.signals) for p in world.history.values()),
            "resets": [
                {"t": e.t, "gpu": e.fields["gpu"], "result": e.fields["result"]}
                for e in self.timeline
                if e.name == EventName.RESET_OUTCOME
            ],
            "hooks_run": sum(
                e.name == EventName.HOOK_RUN and not e.fields.get("dry_run") for e in self.timeline
            ),
            **fields_of(standing.plan, ("forced_dry_run", "circuit_open", "paused")),
        }


# --- the simulation's edges for the engine ----------------------------------------------------


class VirtualHost:
    """The engine's four edges over the virtual host (docs/internals.md). Its clock is the
    timeline's (``+0s`` is WALL0 on the wall); commands, matched by argv, are answered as
    docs/simulate.md's table says, and any other could not be started."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        reset = sim.policy.reset
        self.commands: dict[tuple[str, ...], tuple[str, WorldGpu]] = {}
        # A MIG GPU instance's recovery commands (docs/simulate.md): argv -> (its position,
        # the GPU, the GPU instance id); the last of them re-creates the instance.
        self.mig: dict[tuple[str, ...], tuple[int, WorldGpu, int]] = {}
        for gpu in sim.world.gpus.values():
            spec = gpu.spec
            for instance in spec.mig_instances:
                filled = {
                    "uuid": spec.uuid, "pci_bus_id": spec.pci_bus_id, "gi": str(instance.gi),
                    "ci": "0", "mig_uuid": mig_uuid(spec.index, instance.gi),
                    "profile": str(GI_PROFILE_IDS.get(instance.profile, 0)),
                    "placement": str(instance.gi),
                }  # fmt: skip
                for position, template in enumerate(reset.mig_recovery_commands):
                    try:
                        argv = format_argv(template, **filled)
                    except ValueError:
                        continue  # perform_reset refuses before anything runs
                    self.mig.setdefault(argv, (position, gpu, instance.gi))
            values = {"uuid": spec.uuid, "pci_bus_id": spec.pci_bus_id, "minor": str(spec.minor)}
            for what, template, mode in (
                ("reset", reset.command, {}),
                ("health", reset.health_command, {}),
                ("persistence_off", reset.persistence_command, {"mode": "0"}),
                ("persistence_on", reset.persistence_command, {"mode": "1"}),
            ):
                try:
                    argv = format_argv(template, **values, **mode)
                except ValueError:
                    continue  # perform_reset refuses before anything runs
                self.commands.setdefault(argv, (what, gpu))

    def monotonic(self) -> float:
        return self.sim.now

    def wall(self) -> float:
        return WALL0 + self.sim.now

    def emit(self, name: str, level: Level, fields: Mapping[str, object]) -> None:
        """The event as a timeline entry with its human line; an ``EventName.RESET_STEP`` also
        fires the scenario's ``during`` events for that step."""
        sim = self.sim
        extra: dict[str, object] = {}
        if name == EventName.ACTION_SIGNAL:
            pid = fields.get("pid")
            proc = sim.world.procs.get(pid) if isinstance(pid, int) else None
            extra["process"] = proc.name if proc is not None else None
        sim.add(name, level, render(name, fields, TimelineNamer(sim)), **{**fields, **extra})
        if name == EventName.RESET_STEP:
            sim.reached(str(fields.get("step")))

    def collect(self) -> Snapshot:
        self.sim.world.settle(self.sim.now)
        return self.sim.world.snapshot(self.sim.now)

    def stop_nvml(self) -> bool:
        return True  # the daemon's NVML worker is virtual too: nothing of ours holds the GPU

    def final_scan(self, minor: int | None) -> tuple[HolderScan, Mapping[int, ProcessInfo]]:
        world = self.sim.world
        scan = world.holders()
        gpu = world.by_minor.get(minor) if minor is not None else None
        if gpu is not None and not gpu.persistence:
            # nvidia-persistenced lets go of a GPU once its persistence mode is off.
            kept = {
                pid: holding
                for pid, holding in scan.holdings.items()
                if not world.procs[pid].spec.comm.startswith("nvidia-persiste")
            }
            scan = dataclasses.replace(scan, holdings=kept)
        return scan, world.processes()

    def read_gpus(self) -> tuple[GpuInfo, ...]:
        self.sim.world.settle(self.sim.now)
        return self.sim.world.nvml().gpus

    def self_pids(self) -> frozenset[int]:
        return frozenset()

    def signal(self, identity: ProcessIdentity, signal: str, *, dry_run: bool) -> SignalResult:
        sim = self.sim
        proc = sim.world.procs.get(identity.pid)
        if proc is None or not proc.spec.visible:
            outcome, detail = SignalOutcome.GONE, f"PID {identity.pid} does not exist"
        elif proc.start_ticks != identity.start_ticks:
            outcome, detail = SignalOutcome.REUSED, f"PID {identity.pid} now belongs to {proc.name}"
        elif proc.state == "Z":
            outcome, detail = SignalOutcome.ZOMBIE, f"PID {identity.pid} is a zombie"
        elif dry_run:
            outcome, detail = SignalOutcome.DRY_RUN, f"would send {signal}"
        else:
            outcome, detail = SignalOutcome.DELIVERED, f"{signal} sent"
        if outcome in (SignalOutcome.DELIVERED, SignalOutcome.DRY_RUN):
            sim.watched.add(identity)
        if proc is not None and outcome is SignalOutcome.DELIVERED:
            proc.signals.append((sim.now, signal, outcome.value))
            sim.react(proc, signal)
        return SignalResult(outcome, detail)

    def exits(self, timeout: float) -> list[ProcessIdentity]:
        """The world's happenings within ``timeout``: a target that dies on its signal at once
        is seen before the checkpoint, as the daemon's short pidfd wait sees it."""
        if not self.sim.exited:
            self.sim.advance(self.sim.now + timeout)
        return self.sim.take_exits()

    def run_command(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        args = tuple(argv)
        if (hook := (env or {}).get("GPUWATCHD_EVENT")) is not None:
            return self.hook(args, hook)
        if args in self.mig:
            return self.mig_command(args)
        if (known := self.commands.get(args)) is None:
            error = f"cannot run {args[0] if args else '?'}: not a command of the virtual host"
            return CommandResult(args, None, "", False, 0.0, error)
        what, gpu = known
        bus = gpu.spec.pci_bus_id or gpu.spec.uuid
        if gpu.lost:
            lost = f"Unable to determine the device handle for GPU {bus}: GPU is lost."
            return CommandResult(args, 15, lost, False, 0.1, None)
        if what == "reset":
            return self.reset(args, gpu, bus, timeout)
        if what in ("persistence_off", "persistence_on"):
            gpu.persistence = what == "persistence_on"
            said = f"{'Enabled' if gpu.persistence else 'Disabled'} persistence mode for GPU {bus}."
            return CommandResult(args, 0, said, False, 0.1, None)
        return CommandResult(args, 0, "", False, 0.2, None)  # the health query

    def mig_command(self, argv: tuple[str, ...]) -> CommandResult:
        """The driver's answer to one of a MIG GPU instance's recovery commands."""
        position, gpu, gi = self.mig[argv]
        world = self.sim.world
        world.settle(self.sim.now)
        if world.instance_users(gpu, gi):
            said = f"Unable to destroy GPU instance ID {gi}: In use by another client"
            return CommandResult(argv, 255, said, False, 0.2, None)
        if position == len(self.sim.policy.reset.mig_recovery_commands) - 1:
            world.recreate_instance(gpu, gi)
            said = f"Successfully created GPU instance ID {gi} on GPU {gpu.spec.index}"
            return CommandResult(argv, 0, said, False, 0.5, None)
        gpu.destroyed.add(gi)  # listed again once the last command re-creates it
        said = f"Successfully destroyed an instance of GPU instance ID {gi}"
        return CommandResult(argv, 0, said, False, 0.2, None)

    def hook(self, argv: tuple[str, ...], event: str) -> CommandResult:
        if event in ("reset_drain", "reset_before"):
            phase = event.removeprefix("reset_")
            for proc in list(self.sim.world.procs.values()):
                if proc.spec.stops_for_reset and proc.alive:
                    self.sim.exit_process(proc, f"stopped by the reset's {phase} hook")
        return CommandResult(argv, 0, "", False, 0.0, None)

    def reset(
        self, argv: tuple[str, ...], gpu: WorldGpu, bus: str, timeout: float
    ) -> CommandResult:
        world, sim = self.sim.world, self.sim
        scripted = world.reset_results.pop(0) if world.reset_results else "success"
        if scripted == "hang":
            sim.sleep(timeout)
            return CommandResult(argv, -9, "", True, timeout, None)  # killed with its group
        if scripted == "success":
            world.restore(gpu, sim.now)
        if scripted == "fell_off_bus":
            gpu.lost = True
        code, said, took = {  # the driver's answer: exit code, output, seconds
            "success": (0, f"GPU {bus} was successfully reset.\nAll done.", 2.0),
            "fell_off_bus": (15, f"Unable to reset GPU {bus}: GPU has fallen off the bus.", 1.0),
            "in_use": (255, f"GPU {bus}: In use by another client", 0.5),
            "fail": (255, f"Unable to reset GPU {bus}: Unknown Error", 0.5),
        }[scripted]
        return CommandResult(argv, code, said, False, took, None)


def simulate(
    scenario: Scenario, config_path: str | None = None, *, enforce: bool = False
) -> SimulationResult:
    """Play ``scenario`` under its policy (or ``config_path``'s) and return the timeline;
    ``enforce`` turns ``dry_run`` off, nothing else."""
    policy, source = scenario_policy(scenario, config_path)
    if enforce:
        source += " (--enforce: dry_run off)" if policy.dry_run else " (--enforce)"
        policy = dataclasses.replace(policy, dry_run=False)
    return Simulation(scenario, policy, source).run()
