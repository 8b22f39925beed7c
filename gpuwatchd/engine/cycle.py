"""The poll cycle, written once: collect → assess → plan → carry out → feed back → next wake-up.

This module owns the one cycle that ``run``, ``run --once`` and ``simulate`` share.

In detail: docs/internals.md, section `gpuwatchd.engine.cycle`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace
from functools import partial

from gpuwatchd.act.commands import CommandResult, fill_hooks, run_hooks
from gpuwatchd.act.evidence import EvidenceAction, EvidenceKeeper, Kept, Step
from gpuwatchd.act.reset import perform_reset
from gpuwatchd.act.reset_resume import of_another_boot, resume_interrupted, shown_record
from gpuwatchd.act.reset_target import ResetOutcome, ResetTarget, outcome_event, progress_record
from gpuwatchd.core.checked import as_list, as_text
from gpuwatchd.core.model import (
    GpuInfo,
    ProcessIdentity,
    Snapshot,
    Spare,
    as_int,
    fields_of,
)
from gpuwatchd.core.vocabulary import (
    SIGNAL_OUTCOME_LEVELS,
    EventName,
    HookName,
    HookOutcome,
    Level,
    ResetResult,
    ResetStep,
    SignalOutcome,
)
from gpuwatchd.decide.argv import hook_environment
from gpuwatchd.decide.assess.baselines import back_to_baseline
from gpuwatchd.decide.assess.reuse import Reuse
from gpuwatchd.decide.assess.shared import Assessment
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.floor import reset_blockers
from gpuwatchd.decide.health import fabric
from gpuwatchd.decide.health.judge import drop_assumed, note_reset, rebase_wall
from gpuwatchd.decide.mig.recovery import from_record, recovered, recovery_blockers
from gpuwatchd.decide.nvml_state import NvmlAvailability, next_availability
from gpuwatchd.decide.plan.decisions import (
    clear_circuit,
    clear_forced_dry_run,
    forget_reset_refusals,
    hidden_holders,
    next_deadline,
    plan,
    set_paused,
)
from gpuwatchd.decide.plan.intents import HookIntent, Intent, PlanResult, ResetIntent, SignalIntent
from gpuwatchd.decide.plan.monitors import StoppableMonitor, monitors_to_stop
from gpuwatchd.decide.plan.outcomes import (
    RESUMED,
    record_assumed_exit,
    record_exit,
    record_reset,
    record_signal,
)
from gpuwatchd.decide.plan.state import PlanState, unfinished_recoveries
from gpuwatchd.decide.policy import Hook, Policy
from gpuwatchd.decide.spares import spare_changes
from gpuwatchd.decide.targets import gpu_by_uuid
from gpuwatchd.decide.verdict import NodeVerdict, lost_state, unread_verdict
from gpuwatchd.engine.edges import (
    Actuator,
    Background,
    Clock,
    EventSink,
    HostReader,
    Pause,
    PollInputs,
    PollReport,
    Runner,
    Standing,
    TakenXids,
    run_inline,
    run_now,
)
from gpuwatchd.events.catalogue import notification
from gpuwatchd.events.words import short

_IDENTITY = ("pid", "start_ticks")
EXIT_GRACE = 0.01  # seconds to watch just-signalled targets before the checkpoint
STATE_NOT_SAVED = "the state cannot be saved (state_dir full or unwritable)"
REBOOTED = "the node rebooted since it was decided on"
NOT_RECORDED = (
    "no reset record: the last run stopped or crashed before the reset's first step, "
    "or after its last one, before its outcome was booked"
)
# A monitor sent SIGTERM (or already gone) lets go of the GPU; any other outcome is a failure.
_LET_GO = frozenset({SignalOutcome.DELIVERED, SignalOutcome.GONE, SignalOutcome.ZOMBIE})


def _text(value: object) -> str | None:
    """A fact as a placeholder value: None stays unknown (the hook that needs it is not run)."""
    return None if value is None or isinstance(value, bool) else str(value)


# A hook's placeholder values from its intent's facts (placeholder, fact).
_HOOK_VALUES = (("uuid", "gpu"), ("pci_bus_id", "pci_bus_id"), ("minor", "minor"), ("user", "user"))


def _describe_intent(intent: Intent) -> str:
    """``SIGTERM to pid 4242``, ``reset of GPU-…``, ``on_action hooks``: for events."""
    if isinstance(intent, SignalIntent):
        return f"{intent.signal} to pid {intent.identity.pid}"
    if isinstance(intent, ResetIntent):
        return f"reset of {intent.gpu}"
    return f"{intent.hook} hooks"


@dataclass
class EngineState:
    """What the engine carries from poll to poll and across restarts (the state file's body)."""

    assess: AssessState = field(default_factory=AssessState)
    plan: PlanState = field(default_factory=PlanState)
    reset_in_progress: dict[str, object] | None = None
    taken: TakenXids = field(default_factory=TakenXids)  # by a reading between polls


@dataclass(eq=False)
class Engine:
    """One host's decision loop. Build it with its edges, then call :meth:`poll` repeatedly.
    It is the reset procedure's environment too (``act.reset_target.ResetEnvironment``)."""

    policy: Policy
    _: KW_ONLY
    reader: HostReader
    actuator: Actuator
    clock: Clock
    sink: EventSink
    state: EngineState = field(default_factory=EngineState)
    self_ancestors: frozenset[int] = frozenset()
    checkpoint: Callable[[], bool] = lambda: True
    slow: Runner = run_inline
    background: Background = run_now
    hostname: str | None = None  # {hostname} in hooks; read at an I/O edge by the caller
    stopping: Callable[[], bool] = lambda: False
    sleep: Callable[[float], None] = time.sleep  # waits in the reset procedure; virtual in simulate
    evidence: EvidenceKeeper | None = None  # files before each destructive step; none in simulate

    def __post_init__(self) -> None:
        # Targets a dry run's would-be SIGKILL went to this poll: assumed to exit (plan).
        self._assumed_exits: list[ProcessIdentity] = []
        # Background hooks for the main loop to report: (intent, results or a bug's error).
        self._hooks_done: collections.deque[tuple[HookIntent, list[CommandResult] | str]] = (
            collections.deque()
        )
        self._crashed: collections.deque[str] = collections.deque()  # background_crashed
        self._snapshot: Snapshot | None = None
        self._assessment: Assessment | None = None
        self._verdict: NodeVerdict | None = None  # each GPU clean for a new job?
        self.reuse = Reuse()  # the last assessment and verdict, when the inputs are equal
        self._paused_reason: str | None = None
        self.nvml_availability = NvmlAvailability()
        self.spares: tuple[Spare, ...] = ()  # ``gpuwatchd spare``: put into each snapshot
        self._spares_read = 0.0  # the wall time the spares' ends were read at (set_spares)

    def poll(self, inputs: PollInputs | None = None) -> PollReport:
        """One cycle (module docstring), from the admin switches to the checkpoint."""
        inputs = inputs or PollInputs()
        started = self.clock.monotonic() if inputs.started is None else inputs.started
        wall = self.clock.wall() if inputs.started_wall is None else inputs.started_wall
        self._take_switches(inputs)
        self.report_background_hooks()
        snapshot = self._read()
        state = self.state
        assessment = self._assess(snapshot)
        verdict = self.reuse.judge(
            snapshot, assessment, self.policy, unfinished=unfinished_recoveries(state.plan)
        )
        lost = lost_state(state.plan)  # latched on a saved state it could not read: unknown
        self._verdict = verdict if lost is None else unread_verdict(verdict, lost)
        result = self._plan(assessment, snapshot, state.plan)
        if any(self._irreversible(intent) for intent in result.intents):
            # The new plan state already counts each step and kill-cap entry as taken: it is
            # saved before anything irreversible, so a crash in between never repeats a step
            # nor forgets it (a crash at worst leaves one signal unsent, and the ladder goes on
            # after its wait). If it cannot be saved, nothing irreversible is done this poll.
            previous = state.plan
            state.plan = result.state
            if not self.checkpoint():
                state.plan = previous
                result = self._replan_held(result, previous, assessment, snapshot)
        carried = self._carry_out_until_stopped(self._take(result))
        assumed, self._assumed_exits = self._assumed_exits, []
        for identity in assumed:  # of a dry run's would-be SIGKILL
            self._exited(record_assumed_exit, identity)
        self.checkpoint()
        return PollReport(
            snapshot=snapshot,
            assessment=assessment,
            plan=state.plan,
            verdict=self._verdict,
            intents=tuple(carried),
            started=started,
            started_wall=wall,
            seconds=self.clock.monotonic() - started,
            wake_at=self.wake_at(),
        )

    def _plan(self, assessment: Assessment, snapshot: Snapshot, state: PlanState) -> PlanResult:
        """Plan at the snapshot's time: a finding "was seen" when /proc and NVML were read, not
        when a long full scan of this same poll ended (its for-window must not start late)."""
        return plan(
            assessment.findings,
            snapshot,
            state,
            self.policy,
            now=snapshot.monotonic,
            wall=snapshot.wall_time,
            report_only=assessment.report_only,
            self_ancestors=self.self_ancestors,
        )

    def _take_switches(self, inputs: PollInputs) -> None:
        """The admin switches the poll was handed (a switch left None stays as it is)."""
        if (pause := inputs.pause) is not None:
            self.set_paused(pause.reason, until=pause.until, resumed=pause.resumed)
        if inputs.spares is not None:
            self.set_spares(inputs.spares, read_at=inputs.spares_read_at)
        if (made := inputs.clear_latches) is not None:  # lift a forced dry-run, the reset breaker
            plan = clear_circuit(clear_forced_dry_run(self.state.plan, made), made)
            kept = ["node"] if plan.forced_dry_run else []
            kept += ["circuit"] if plan.reset_failures else []  # a reset failed after it
            kept += sorted(plan.scope_latches)
            self.state.plan = plan  # those latched after the request: nobody saw them
            fields = {"kept": kept} if kept else {}
            self.emit(EventName.LIMITS_LATCHES_CLEARED, Level.WARNING, **fields)
            self.checkpoint()  # the request is taken: a crash later in the poll must not lose it

    def _read(self) -> Snapshot:
        """The poll's snapshot, with the spares in force, NVML's availability changes said."""
        snapshot = self.state.taken.first_in(self.reader.collect())
        if self.spares:
            # Read at ``_spares_read`` (wall): their ends keep the time they had left then,
            # whatever the wall clock did since (a step must not end one early).
            shift = snapshot.wall_time - self._spares_read
            spares = tuple(replace(s, until=s.until + shift) for s in self.spares)
            snapshot = replace(snapshot, spares=spares)
        self.nvml_availability, changes = next_availability(
            self.nvml_availability, snapshot.nvml, snapshot.wall_time
        )
        for name, level, fields in changes:
            self.emit(name, level, **fields)
        self._snapshot = snapshot
        return snapshot

    def _assess(self, snapshot: Snapshot) -> Assessment:
        """The snapshot assessed with the state carried from the last poll; Xid notices said."""
        state = self.state
        if not (self.policy.dry_run or state.plan.forced_dry_run):
            # Acting for real: a dry run's assumed resets never stand in for real ones.
            state.assess = replace(state.assess, health=drop_assumed(state.assess.health))
        self._follow_wall(snapshot.wall_time)
        assessment = self.reuse.assess(
            snapshot,
            state.assess,
            self.policy.detection,
            driver_refused=hidden_holders(state.plan),
            health_policy=self.policy.health,
        )
        state.assess = assessment.state
        self._assessment = assessment
        for notice in assessment.xid_notices:  # decide/health/xid_sources.py: floods said once
            self.emit(EventName.HEALTH_XID, notice.level, **notice.fields())
        return assessment

    def _follow_wall(self, wall: float) -> None:
        """The wall clock stepped back to ``wall`` since the plan's last wall time: the health
        history's times move with it, as the plan's do when it books at ``wall`` (the plan's
        rebase_wall: an Xid after a reset is after it, one before it stays before it)."""
        if (last := self.state.plan.last_wall) is not None and wall < last:
            moved = rebase_wall(self.state.assess.health, last - wall)
            self.state.assess = replace(self.state.assess, health=moved)

    def _carry_out_until_stopped(self, intents: Sequence[Intent]) -> list[Intent]:
        """Carry out the intents in order; those carried out. A stop leaves the resets still
        to come (a reset is long), never a signal or a hook: the state saved before acting
        books each as taken (a ladder step and its kill-cap entry, a drain done, a page sent),
        so one left would be lost for good; a signal takes microseconds, a hook is bounded by
        its timeout. After a real signal, the exits it caused are seen before the checkpoint."""
        signalled = False
        carried: list[Intent] = []
        for intent in intents:
            if isinstance(intent, ResetIntent) and self.stopping():
                # A reset handed over but never started books no outcome: not in flight.
                self._drop_in_flight(intent.gpu, "the daemon stopped before it started")
                continue
            self._carry_out(intent)
            carried.append(intent)
            signalled = signalled or (isinstance(intent, SignalIntent) and not intent.dry_run)
        if signalled:
            # Most targets die within milliseconds of a signal: see that before the checkpoint
            # (whose fsyncs can take tens of ms), not after it.
            self.note_exits(self.actuator.exits(EXIT_GRACE))
        return carried

    def restore(self, state: EngineState) -> None:
        """Carry on from ``state`` (the state file's body, read at start before any poll)."""
        self.state = state

    def standing(self) -> Standing:
        """Where the engine stands now: what a checkpoint saves, inside a poll too."""
        state = self.state
        return Standing(
            state.assess,
            state.plan,
            state.reset_in_progress,
            self._snapshot,
            self._assessment,
            self._verdict,
            self.spares,
            self.nvml_availability,
            TakenXids(dict(state.taken.events)),  # compared by each save, encoded by a write
        )

    def _replan_held(
        self,
        result: PlanResult,
        previous: PlanState,
        assessment: Assessment,
        snapshot: Snapshot,
    ) -> PlanResult:
        """The plan of this poll with every step held (said as ``EventName.ACTION_WITHHELD``),
        as while paused, because the state that would record the steps cannot be saved."""
        self._withhold(result.intents)
        held = self._plan(assessment, snapshot, set_paused(previous, True, reason=STATE_NOT_SAVED))
        unpaused = set_paused(
            held.state,
            previous.paused,
            reason=previous.paused_reason or "",
            until=previous.paused_until,
        )
        return replace(held, state=unpaused)

    def _withhold(self, intents: Sequence[Intent]) -> None:
        """Say which irreversible steps are not taken because the state cannot be saved."""
        steps = [_describe_intent(intent) for intent in intents if self._irreversible(intent)]
        self.emit(EventName.ACTION_WITHHELD, Level.ERROR, why=STATE_NOT_SAVED, steps=steps)

    def _carry_out_all(self, intents: Sequence[Intent]) -> None:
        """Follow-up intents (an outcome's hooks): saved first like a poll's, or withheld."""
        if any(self._irreversible(intent) for intent in intents) and not self.checkpoint():
            self._withhold(intents)
            intents = [intent for intent in intents if not self._irreversible(intent)]
        for intent in intents:
            self._carry_out(intent)

    def wake_at(self) -> float:
        """When the next poll is due: ``interval`` from now, or earlier for a plan deadline."""
        now = self.clock.monotonic()
        due = next_deadline(self.state.plan)
        until = now + self.policy.interval
        return until if due is None else min(until, max(now, due))

    def note_exits(self, exited: Sequence[ProcessIdentity]) -> None:
        """Signalled targets that exited (their pidfds became readable): ladders resolve."""
        for identity in exited:
            self.emit(EventName.TARGET_EXITED, Level.INFO, **fields_of(identity, _IDENTITY))
            self._exited(record_exit, identity)

    def _exited(self, record: Callable[..., PlanResult], identity: ProcessIdentity) -> None:
        """The plan told that ``identity`` exited (``record_exit``), or is assumed to have
        exited after a dry run's would-be SIGKILL (``record_assumed_exit``)."""
        self._carry_out_all(
            self._take(record(self.state.plan, identity, now=self.clock.monotonic()))
        )

    def set_paused(
        self, reason: str | None, *, until: float | None = None, resumed: str | None = None
    ) -> None:
        """The admin pause switch (``gpuwatchd pause``/``resume``); logged when it changes:
        a pause with its end (wall time ``until``), a resume with why (``resumed``)."""
        plan = self.state.plan
        same_end = until == plan.paused_until or (
            until is not None and plan.paused_until is not None
            and abs(until - plan.paused_until) < 1.0  # a wall end read again after a step
        )  # fmt: skip
        if reason == self._paused_reason and (reason is not None) == plan.paused and same_end:
            return
        # A saved state may be paused while this engine has not said so yet (a restart).
        was_paused = self._paused_reason is not None or plan.paused
        self._paused_reason = reason
        self.state.plan = set_paused(
            self.state.plan, reason is not None, reason=reason or "admin", until=until
        )
        if reason is not None:
            self.emit(EventName.DAEMON_PAUSED, Level.WARNING, reason=reason, until=until)
        elif was_paused:
            self.emit(EventName.DAEMON_RESUMED, Level.WARNING, reason=resumed or "gpuwatchd resume")

    def set_spares(self, spares: tuple[Spare, ...], *, read_at: float | None = None) -> None:
        """The spares in force at wall time ``read_at`` (None: now); each that starts or ends
        is logged."""
        wall = self.clock.wall() if read_at is None else read_at
        for name, level, fields in spare_changes(self.spares, spares, wall):
            self.emit(name, level, **fields)
        self.spares, self._spares_read = spares, wall

    def reload(self, policy: Policy, *, hostname: str | None) -> None:
        """A reloaded policy, and the node's name read again with it (a renamed node). A new
        configuration (new ``before`` hooks, say) may succeed where a reset was refused: those
        incidents may be tried again."""
        self.policy, self.hostname = policy, hostname
        gpus = sorted(self.state.plan.reset_refusals)
        self.state.plan = forget_reset_refusals(self.state.plan)
        for gpu in gpus:
            self.emit(
                EventName.RESET_REFUSAL_CLEARED, Level.INFO, gpu=gpu, why="configuration reloaded"
            )

    def emit(self, event: str, level: Level, **fields: object) -> None:
        self.sink.emit(event, level, fields)

    def _take(self, result: PlanResult) -> tuple[Intent, ...]:
        """Adopt the planner's new state, emit its events, return its intents."""
        self.state.plan = result.state
        for event in result.events:
            self.sink.emit(event.name, event.level, event.fields)
        return result.intents

    def _carry_out(self, intent: Intent) -> None:
        if isinstance(intent, SignalIntent):
            follow_up = self._signal(intent)
        elif isinstance(intent, ResetIntent):
            follow_up = self._reset(intent)
        else:
            follow_up = self._hooks(intent)
        self._carry_out_all(follow_up)

    def _signal(self, intent: SignalIntent) -> tuple[Intent, ...]:
        result = self.actuator.signal(intent.identity, intent.signal, dry_run=intent.dry_run)
        outcome = SignalOutcome(result.outcome)
        if intent.dry_run and intent.signal == "SIGKILL" and outcome is SignalOutcome.DRY_RUN:
            self._assumed_exits.append(intent.identity)
        fields = {
            **intent.facts,
            **fields_of(intent.identity, _IDENTITY),
            **fields_of(intent, ("signal", "gpu", "rule", "step", "dry_run")),
            "outcome": outcome,
            "detail": result.detail,
            "reason": intent.reason,
        }
        self.sink.emit(EventName.ACTION_SIGNAL, SIGNAL_OUTCOME_LEVELS[outcome], fields)
        return self._take(
            record_signal(self.state.plan, intent, outcome, now=self.clock.monotonic())
        )

    def _hooks(self, intent: HookIntent) -> tuple[Intent, ...]:
        """Run the hooks ``intent`` names: ``on_action`` in the background (a notification
        never delays a poll), the others here (watchdog-fed)."""
        if not (hooks := self._hooks_for(intent)):
            return ()
        facts = intent.facts
        kept: dict[str, object] = {}
        destructive = {
            HookName.RESET_DRAIN: EvidenceAction.DRAIN,
            HookName.ON_FAILURE: EvidenceAction.ON_FAILURE,
        }.get(HookName(intent.hook))
        if destructive is not None:  # a drain (or whatever on_failure does): evidence first
            uuid = as_text(facts.get("gpu"))
            kept = self._keep_evidence(Step(destructive, uuid, intent.dry_run, intent.reason))
        values = {key: _text(facts.get(fact)) for key, fact in _HOOK_VALUES}
        values["hostname"] = self.hostname
        prepared = fill_hooks(hooks, values)
        if intent.dry_run:  # each said as it would run (placeholders filled), none run
            for hook in prepared:
                self.emit(
                    EventName.HOOK_RUN,
                    Level.WARNING,  # a would-be action: reviewed with -p warning
                    hook=intent.hook,
                    argv=list(hook.argv),
                    dry_run=True,
                    outcome=HookOutcome.DRY_RUN,
                    reason=intent.reason,
                    **({} if hook.error is None else {"detail": f"would not run: {hook.error}"}),
                    **kept,
                )
            return ()
        env = self._hook_env(intent, values)
        work = partial(run_hooks, prepared, env=env, runner=self.actuator.run_command)
        if intent.hook != HookName.ON_ACTION:
            self._report_hooks(intent, self.slow(work), kept)
            return ()

        def notify() -> None:  # on the background thread: the main loop reports it
            try:
                self._hooks_done.append((intent, work()))
            except Exception as err:  # a bug in one notification must not stop the others
                self._hooks_done.append((intent, repr(err)))

        if not self.background(notify):
            self.hooks_not_run(
                HookOutcome.DROPPED,
                "the notification queue is full; this notification is not sent",
                hook=intent.hook,
                reason=intent.reason,
            )
        self.report_background_hooks()
        return ()

    def _hook_env(self, intent: HookIntent, values: Mapping[str, str | None]) -> dict[str, str]:
        """The ``GPUWATCHD_*`` environment of ``intent``'s hooks: its facts, and for
        ``on_action`` the notification's message."""
        facts = intent.facts
        return hook_environment(
            intent.hook,
            reason=intent.reason,
            **{f"gpu_{key}": values[key] for key in ("uuid", "pci_bus_id", "minor")},
            user=values["user"],
            hostname=self.hostname,
            **{key: facts.get(key) for key in ("action", "outcome", "pid", "rule")},
            message=notification(facts) if intent.hook == HookName.ON_ACTION else None,
        )

    def hooks_not_run(
        self,
        outcome: HookOutcome,
        detail: str,
        *,
        hook: str | None = HookName.ON_ACTION,
        reason: str | None = None,
        level: Level = Level.WARNING,
    ) -> None:
        """Say (through the sink, so metrics count it) that hooks did not run to their end."""
        fields: dict[str, object] = {"hook": hook, "dry_run": False, "outcome": outcome}
        fields.update({} if reason is None else {"reason": reason})
        self.emit(EventName.HOOK_RUN, level, **fields, detail=detail)

    def _hooks_for(self, intent: HookIntent) -> tuple[Hook, ...]:
        named = {
            HookName.ON_ACTION: self.policy.on_action,
            HookName.RESET_DRAIN: self.policy.reset.drain,
        }
        return tuple(named.get(HookName(intent.hook), self.policy.on_failure))

    def _irreversible(self, intent: Intent) -> bool:
        """Whether carrying ``intent`` out does something to the host (a signal, a reset, a
        hook that is configured), which the saved state must know of first."""
        if intent.dry_run:
            return False
        return not isinstance(intent, HookIntent) or bool(self._hooks_for(intent))

    def background_crashed(self, error: str) -> None:
        """A background job raised past its own guard (called on its thread): the main loop
        says it as a crashed ``EventName.HOOK_RUN``."""
        self._crashed.append(error)

    def report_background_hooks(self) -> None:
        """Log the hooks that finished in the background since the last call (main loop only)."""
        while self._crashed:
            self._hook_crashed(HookName.ON_ACTION, None, self._crashed.popleft())
        while self._hooks_done:
            intent, results = self._hooks_done.popleft()
            if isinstance(results, str):  # the notification raised
                self._hook_crashed(intent.hook, intent.reason, results)
            else:
                self._report_hooks(intent, results)

    def _hook_crashed(self, hook: str, reason: str | None, error: str) -> None:
        self.emit(
            EventName.HOOK_RUN,
            Level.ERROR,
            hook=hook,
            dry_run=False,
            outcome=HookOutcome.CRASHED,
            reason=reason,
            error=error,
        )

    def _report_hooks(
        self,
        intent: HookIntent,
        results: Sequence[CommandResult],
        kept: Mapping[str, object] | None = None,
    ) -> None:
        for res in results:
            self.emit(
                EventName.HOOK_RUN,
                Level.WARNING,
                hook=intent.hook,
                dry_run=False,
                argv=list(res.argv),
                returncode=res.returncode,
                timed_out=res.timed_out,
                output=res.output[-2000:],
                reason=intent.reason,
                **({"error": res.error} if res.error else {}),
                **({"outcome": HookOutcome.CANCELLED} if res.cancelled else {}),
                **({"leftovers": res.leftovers} if res.leftovers else {}),
                **(kept or {}),
            )

    def _last_gpu(self, uuid: str) -> GpuInfo | None:
        return gpu_by_uuid(self._snapshot, uuid) if self._snapshot else None

    def _reset(self, intent: ResetIntent) -> tuple[Intent, ...]:
        instance = intent.instance  # None: the whole GPU, else one MIG GPU instance re-created
        gpu = self._last_gpu(intent.gpu) if instance is None else None
        health = None if gpu is None else gpu.health
        target = ResetTarget(
            uuid=intent.gpu,
            pci_bus_id=intent.pci_bus_id,
            minor=intent.minor,
            persistence_was_on=None if gpu is None else gpu.persistence_mode,
            hostname=self.hostname,
            # An NVSwitch system's GPU: the reset is done once its fabric re-registered.
            fabric=health is not None and fabric.supported(health),
            recovery=instance,
            layout=intent.layout,
        )
        # Before the procedure's first step (its drain hooks): what led to it, for a human.
        kept = self._keep_evidence(
            Step(
                EvidenceAction.GPU_RESET if instance is None else EvidenceAction.MIG_INSTANCE,
                intent.gpu,
                intent.dry_run,
                intent.reason,
                instance={} if instance is None else instance.fields(),
                instance_uuid=None if instance is None else instance.mig_uuid,
            )
        )
        work = partial(
            perform_reset,
            target,
            self.policy.reset,
            self,
            dry_run=intent.dry_run,
            runner=self.actuator.run_command,
            drained=intent.drained,
            fabric_wait=self._wait_for_fabric,
        )
        try:
            outcome = self.slow(work)
        except Exception as err:  # a bug in the procedure must not end the daemon
            outcome = self._procedure_crashed(intent.gpu, err)
        booked = self._book_reset(intent, outcome, kept)
        self.checkpoint()  # the record gone and the outcome booked, in one save
        return booked

    def _procedure_crashed(self, gpu: str | None, err: Exception) -> ResetOutcome:
        """A reset procedure that raised (a bug): said, and over as a failed reset. Its last
        record is dropped, saved with the booking: kept, it would read as a reset under way
        until a start, however much later, resumed it (docs/reset.md)."""
        self.emit(EventName.RESET_CRASHED, Level.ERROR, gpu=gpu, error=repr(err))
        self.state.reset_in_progress = None
        crashed = f"the reset procedure crashed: {err!r}"
        return ResetOutcome(ResetResult.FAILED, ResetStep.DONE, crashed, False, None, ())

    def _keep_evidence(self, step: Step) -> dict[str, object]:
        """Write the evidence file of ``step``: the step's event field naming it, or nothing
        when none is kept (said as ``EventName.EVIDENCE_UNSAVED``; the step goes on)."""
        snapshot, assessment = self._snapshot, self._assessment
        if self.evidence is None or snapshot is None or assessment is None:
            return {}
        now_mono, now_wall = snapshot.monotonic, snapshot.wall_time
        first_seen = {
            key: now_wall - max(0.0, now_mono - seen.first_seen)
            for key, seen in self.state.plan.seen.items()
        }
        try:
            kept = self.evidence.keep(
                step,
                snapshot=snapshot,
                assessment=assessment,
                verdict=self._verdict,
                health=self.state.assess.health,
                first_seen=first_seen,
                wall=self.clock.wall(),
            )
        except Exception as err:  # a bug in keeping evidence must not stop the step
            kept = Kept(None, error=f"crashed (a bug): {err!r}")
        if kept.path is None:
            self.emit(
                EventName.EVIDENCE_UNSAVED,
                Level.ERROR,
                action=str(step.action),
                gpu=step.gpu,
                dry_run=step.dry_run,
                error=kept.error,
            )
            return {}
        return {"evidence_file": kept.path}

    def _wait_for_fabric(self, target: ResetTarget, timeout: float) -> tuple[bool, str]:
        """Read the GPU until its NVLink fabric registration is COMPLETED (decide/health/fabric.py
        judges each reading), at most ``timeout`` seconds, a second apart."""
        deadline = self.clock.monotonic() + timeout
        while True:
            reading = self._read_gpu(target.uuid)
            verdict, detail = fabric.after_reset(None if reading is None else reading.health)
            if verdict == "completed":
                return True, detail
            if verdict == "failed":
                return False, detail
            if self.clock.monotonic() >= deadline:
                return False, f"{detail} after {timeout:g}s"
            self.sleep(1.0)

    def _book_reset(
        self,
        intent: ResetIntent,
        outcome: ResetOutcome,
        kept: Mapping[str, object] | None = None,
    ) -> tuple[Intent, ...]:
        would_succeed = (
            intent.dry_run
            and outcome.result == ResetResult.DRY_RUN
            and outcome.step is ResetStep.DONE
        )
        gpu = self._last_gpu(intent.gpu) if would_succeed else None
        assumed = None if gpu is None else gpu.health
        real = outcome.result == ResetResult.SUCCESS and not intent.dry_run
        wall = self.clock.wall()
        self._follow_wall(wall)  # a step while the reset ran: record_reset books it too
        # A whole GPU's real reset deals with the Xids before it; a dry run's would-be reset is
        # assumed to have succeeded for the decisions that follow (decide/health/judge.py). A
        # MIG GPU instance re-created leaves the GPU's health as it was.
        if intent.instance is None and (real or assumed is not None):
            assessed = self.state.assess
            health = note_reset(assessed.health, intent.gpu, wall, assumed_from=assumed)
            self.state.assess = replace(assessed, health=health)
        level, fields = outcome_event(
            outcome, gpu=intent.gpu, pci_bus_id=intent.pci_bus_id, dry_run=intent.dry_run
        )
        if intent.instance is not None:
            fields.update(intent.instance.fields())
        fields.update(kept or {})
        self.sink.emit(EventName.RESET_OUTCOME, level, fields)
        return self._take(
            record_reset(
                self.state.plan,
                intent,
                outcome.result,
                now=self.clock.monotonic(),
                wall=wall,
                needs_reboot=outcome.needs_reboot,
                would_succeed=would_succeed,
            )
        )

    def resume_interrupted_reset(self, pause: Pause | None = None) -> None:
        """Finish or undo the reset the last run left in progress (once, before the first
        poll), and book its outcome like any reset's: the plan's in-flight marker is cleared.
        A marker that no record books is cleared too: nothing else ever would (every reset
        would be refused as "another reset is in flight").
        ``pause``: the pause switch read before it (one set while the daemon was down holds
        the booked outcome's ``on_failure`` hooks as any pause does)."""
        if record := self.state.reset_in_progress:
            self._resume(record, pause)
        if (flight := self.state.plan.reset_in_flight) is not None:
            rebooted = record is not None and of_another_boot(record)
            self._drop_in_flight(flight.gpu, REBOOTED if rebooted else NOT_RECORDED)
            self.checkpoint()

    def _drop_in_flight(self, gpu: str, why: str) -> None:
        """The plan's reset of ``gpu`` in flight is no longer, with no outcome booked (none
        will come back: ``why``); said as ``EventName.RESET_IN_FLIGHT_CLEARED``."""
        if (flight := self.state.plan.reset_in_flight) is None or flight.gpu != gpu:
            return
        self.state.plan = replace(self.state.plan, reset_in_flight=None)
        self.emit(
            EventName.RESET_IN_FLIGHT_CLEARED,
            Level.WARNING,
            gpu=short(gpu),  # read from the state file: any string, as large as the file
            finding=short(flight.finding_key),
            dry_run=flight.dry_run,
            why=why,
        )

    def _resume(self, record: dict[str, object], pause: Pause | None) -> None:
        """:meth:`resume_interrupted_reset` of ``record``, the progress record."""
        if pause is not None and pause.reason is not None:
            self.set_paused(pause.reason, until=pause.until)
        self.emit(EventName.RESET_RESUME, Level.WARNING, record=shown_record(record))
        uuid = record.get("uuid")  # the state file's, of an unreadable record too: shown cut
        try:
            outcome = resume_interrupted(
                record,
                self.policy.reset,
                self,
                runner=self.actuator.run_command,
                hostname=self.hostname,
                fabric_wait=self._wait_for_fabric,
            )
        except Exception as err:  # a bug the record leads to must not end every start
            outcome = self._procedure_crashed(None if uuid is None else short(uuid), err)
        self.state.reset_in_progress = None  # saved with the outcome booked, as a reset's
        if outcome is None:
            self.checkpoint()
            return
        self.emit(
            EventName.RESET_RESUMED,
            Level.WARNING,
            gpu=None if uuid is None else short(uuid),
            result=outcome.result,
            step=outcome.step.value,
            reason=outcome.reason,
            needs_reboot=outcome.needs_reboot,
        )
        flight = self.state.plan.reset_in_flight
        # Another boot's reset is over: the reboot ended it (as decide/plan's boot change).
        if flight is not None and flight.gpu == record.get("uuid") and not of_another_boot(record):
            recoveries = map(from_record, as_list(record.get("mig_layout")))
            intent = ResetIntent(
                gpu=flight.gpu,
                pci_bus_id=as_text(record.get("pci_bus_id")),
                minor=as_int(record.get("minor")),
                finding_key=flight.finding_key,
                dry_run=False,
                reason=RESUMED,
                facts={},
                instance=from_record(record.get("recovery")),
                layout=tuple(r for r in recoveries if r is not None),
            )
            self._carry_out_all(self._book_reset(intent, outcome))
        self.checkpoint()

    # --- the reset procedure's environment (act.reset_target.ResetEnvironment) -------------

    def stop_nvml(self) -> bool:
        return self.reader.stop_nvml()

    def final_blockers(self, target: ResetTarget, ignore: frozenset[int]) -> list[str]:
        holders, processes = self.reader.final_scan(target.minor)
        own = self.reader.self_pids() | ignore
        if target.recovery is not None:
            if (last := self._snapshot) is None:
                return ["no snapshot to place the holders in MIG GPU instances"]
            return recovery_blockers(last, holders, processes, own, target.recovery.mig_uuid)
        return reset_blockers(holders, processes, target.minor, own)

    def find_monitors(self, target: ResetTarget) -> list[StoppableMonitor]:
        if (last := self._snapshot) is None:
            return []  # no NVML reading to tell context owners: nothing is stopped
        owners = {p.pid for g in last.nvml.gpus for p in g.processes or ()}
        holders, processes = self.reader.final_scan(target.minor)
        return monitors_to_stop(
            holders,
            processes,
            target.minor,
            self_pids=self.reader.self_pids() | self.self_ancestors,  # never stopped
            context_owners=owners,
            monitors=self.policy.reset.monitors,
            last=last,  # its spares
            policy=self.policy,  # its protect
        )

    def stop_monitors(
        self, target: ResetTarget, monitors: Sequence[StoppableMonitor], timeout: float
    ) -> list[str]:
        sent = [(m, self.actuator.signal(m.identity, "SIGTERM", dry_run=False)) for m in monitors]
        failures = [f"{m.who}: {r.detail}" for m, r in sent if r.outcome not in _LET_GO]
        # The engine's clock and sleep, as the fabric wait's: virtual in simulate.
        deadline = self.clock.monotonic() + timeout
        waiting = {m.identity.pid: m.who for m in monitors}
        while waiting and target.minor is not None:
            holders, _processes = self.reader.final_scan(target.minor)
            still = {h.pid for h in holders.holders_of(target.minor)}
            waiting = {pid: who for pid, who in waiting.items() if pid in still}
            if waiting and self.clock.monotonic() >= deadline:
                failures += [
                    f"{who} still holds the GPU after {timeout:g}s" for who in waiting.values()
                ]
                break
            if waiting:
                self.sleep(0.05)
        return failures

    def instance_back(self, target: ResetTarget) -> str | None:
        recovery = target.recovery
        if recovery is None:
            return "not a MIG GPU instance's recovery"
        detection = self.policy.detection
        baseline = self.state.assess.baselines.get(recovery.mig_uuid, detection.default_baseline)
        snapshot = self.reader.collect()
        self.state.taken.add(snapshot.nvml.gpus, snapshot.kernel_xids)  # the next poll's
        return recovered(recovery, snapshot, max_used=baseline + detection.ghost_margin)

    def _read_gpu(self, uuid: str) -> GpuInfo | None:
        gpus = self.reader.read_gpus()  # it takes every GPU's queued Xid events: kept
        self.state.taken.add(gpus)
        return next((gpu for gpu in gpus if gpu.uuid == uuid), None)

    def reread_gpu(self, target: ResetTarget) -> GpuInfo | None:
        gpu = self._read_gpu(target.uuid)
        if not self.reader.stop_nvml():  # the next MIG command runs with nothing of ours held
            raise OSError("our own NVML worker still holds the device")
        return gpu

    def memory_back_to_baseline(self, target: ResetTarget) -> bool | None:
        gpu = self._read_gpu(target.uuid)
        if gpu is None or gpu.lost:
            return None
        allocated = gpu.memory.allocated if gpu.memory else None
        return back_to_baseline(target.uuid, allocated, self.state.assess, self.policy.detection)

    def record_step(self, target: ResetTarget, step: ResetStep, data: Mapping[str, object]) -> None:
        if step is ResetStep.DONE:
            # Saved with the outcome booked (_reset, _resume): a crash before leaves the last
            # step's record, whose resume books it, never a reset that no limit counts.
            self.state.reset_in_progress = None
            return
        record = progress_record(target, step, data)
        record["since"] = self.clock.wall()
        self.state.reset_in_progress = record
        if not self.checkpoint():
            # The procedure stops (and undoes what it did) rather than run a step a crash
            # would forget: act/reset.py treats a failed record as an abort.
            raise OSError(STATE_NOT_SAVED)
