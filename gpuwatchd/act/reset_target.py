"""What a reset is about and what it reports: the target, its commands, the outcome, the edges.

In detail: docs/internals.md, section `gpuwatchd.act.reset_target`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from gpuwatchd.act.commands import CommandResult, PreparedHook, fill_hooks
from gpuwatchd.core.checked import as_number
from gpuwatchd.core.model import GpuInfo, fields_of
from gpuwatchd.core.vocabulary import (
    RESET_RESULT_LEVELS,
    Level,
    ResetResult,
    ResetStep,
)
from gpuwatchd.decide.argv import (
    MAX_ARGS,
    MAX_COMMANDS,
    MAX_FILLED_CHARS,
    check_value,
    format_argv,
)
from gpuwatchd.decide.mig.recovery import InstanceRecovery, layout_argvs, recovery_argvs
from gpuwatchd.decide.plan.monitors import StoppableMonitor
from gpuwatchd.decide.policy import MAX_HOOK_TIMEOUT, Hook, ResetPolicy

UNRECORDED = "could not record reset progress in the state file"  # why a step was not run


@dataclass(frozen=True)
class ResetTarget:
    """The GPU to reset. ``persistence_was_on`` None (unknown) means it is not toggled."""

    uuid: str
    pci_bus_id: str | None
    minor: int | None
    persistence_was_on: bool | None
    hostname: str | None = None  # {hostname} in the drain/before/after hooks
    fabric: bool = False  # an NVSwitch system's GPU: the reset waits for its NVLink fabric
    # Re-create this MIG GPU instance of the GPU in place instead of resetting the GPU.
    recovery: InstanceRecovery | None = None
    # A MIG GPU's reset: its GPU instances, created again after it (act/reset.py).
    layout: tuple[InstanceRecovery, ...] = ()


# --- the commands, worked out once ------------------------------------------------------------

Argv = tuple[str, ...]
_HOOK_STEPS = ("drain", "before", "after")


@dataclass(frozen=True)
class Commands:
    """Every command and hook a reset procedure may run, filled in once before its first step
    and recorded with its progress (``commands``), so a resume runs these, not today's policy's.
    ``persistence_off``/``persistence_on`` None: they cannot be built (an old record's resume)."""

    reset: tuple[Argv, ...]  # one reset command, or a MIG recovery's commands
    health: Argv
    persistence_off: Argv | None
    persistence_on: Argv | None
    restore: tuple[Argv, ...] = ()  # a MIG GPU's reset: create its instances again
    drain: tuple[PreparedHook, ...] = ()
    before: tuple[PreparedHook, ...] = ()
    after: tuple[PreparedHook, ...] = ()

    def record(self) -> dict[str, object]:
        """The JSON-able form :func:`commands_from_record` reads back."""
        record: dict[str, object] = {
            "reset": [list(argv) for argv in self.reset],
            "health": list(self.health),
            "persistence_off": None if self.persistence_off is None else list(self.persistence_off),
            "persistence_on": None if self.persistence_on is None else list(self.persistence_on),
            "restore": [list(argv) for argv in self.restore],
        }
        for step in _HOOK_STEPS:
            hooks: tuple[PreparedHook, ...] = getattr(self, step)
            record[step] = [
                {"argv": list(h.argv), "timeout": h.timeout}
                | ({} if h.error is None else {"error": h.error})
                for h in hooks
            ]
        return record


def _values(target: ResetTarget) -> dict[str, str | None]:
    return {
        "uuid": target.uuid,
        "pci_bus_id": target.pci_bus_id,
        "minor": None if target.minor is None else str(target.minor),
        "hostname": target.hostname,
    }


def prepare_hooks(hooks: Sequence[Hook], target: ResetTarget) -> tuple[PreparedHook, ...]:
    """``hooks`` filled in for ``target`` (each that cannot be says why, within the record's
    bound, and will fail)."""
    return tuple(
        replace(hook, error=hook.error[:MAX_FILLED_CHARS]) if hook.error else hook
        for hook in fill_hooks(hooks, _values(target))
    )


def prepare_commands(target: ResetTarget, policy: ResetPolicy) -> Commands | str:
    """Fill every command and hook up front (a bad template must not surface halfway), once:
    the procedure records them and a resume runs the record. Or say why they cannot be."""
    values = _values(target)
    key = "reset.command" if target.recovery is None else "reset.mig_recovery_commands"
    try:
        if target.recovery is None:
            resets: tuple[Argv, ...] = (format_argv(policy.command, **values),)
        else:
            resets = recovery_argvs(target.recovery, policy.mig_recovery_commands)
        commands = Commands(
            resets,
            format_argv(policy.health_command, **values),
            format_argv(policy.persistence_command, mode="0", **values),
            format_argv(policy.persistence_command, mode="1", **values),
            layout_argvs(target.layout, policy.mig_recovery_commands),
            *(prepare_hooks(h, target) for h in (policy.drain, policy.before, policy.after)),
        )
    except ValueError as err:
        return f"cannot build the {key} for {target.uuid}: {err}"
    if (unsafe := _unsafe(commands, target)) is not None:
        return unsafe
    # What is recorded must read back: the record's bounds hold for these commands too.
    read = commands_from_record(commands.record(), target)
    return read if isinstance(read, Commands) else f"cannot record the commands: {read}"


def _unsafe(commands: Commands, target: ResetTarget) -> str | None:
    """Why ``commands`` must not run for ``target`` (built now, or read back from a record)."""
    key = "reset.command" if target.recovery is None else "reset.mig_recovery_commands"
    names = _gpu_names(target)
    for reset in commands.reset + commands.restore:
        if not any(name in arg for arg in reset for name in names):
            # The last line of defence behind check-config: never a command that does not
            # name this GPU (nvidia-smi without -i resets every GPU).
            return f"{key} {list(reset)!r} does not name GPU {target.uuid}; refusing"
    if not commands.reset:
        return f"{key} is empty; refusing"
    if target.recovery is None and len(commands.reset) != 1:
        return f"a reset of {target.uuid} has one reset command, not {len(commands.reset)}"
    if len(commands.restore) != len(target.layout):
        return f"reset.mig_recovery_commands is empty: the MIG layout of {target.uuid} is lost"
    return None


def _gpu_names(target: ResetTarget) -> list[str]:
    """The names of ``target``'s GPU a reset command must hold: those in the format NVML
    gives them (a record's are hostile: a UUID ``i`` is in ``-dgi``, a bus id ``0`` an index).
    An argument may hold one with more around it (``--id={uuid}``, ``-i{uuid}``: check-config
    accepts them); in its format, one cannot be there by chance."""
    names = [("uuid", target.uuid), ("pci_bus_id", target.pci_bus_id)]
    return [value for name, value in names if value is not None and is_a(name, value)]


def is_a(name: str, value: str) -> bool:
    """Whether ``value`` is in the format NVML gives placeholder ``name`` (``uuid``, ...)."""
    try:
        check_value(name, value)
    except ValueError:
        return False
    return True


def commands_from_record(raw: object, target: ResetTarget) -> Commands | str:
    """The ``commands`` of a progress record, read strictly (hostile input: exactly the keys
    :meth:`Commands.record` writes, within decide/argv's ``MAX_*`` bounds, naming ``target``'s
    GPU), or what is wrong."""
    if not isinstance(raw, Mapping) or set(raw) != {*_HOOK_STEPS, *_COMMAND_KEYS}:
        return "not an object with the keys " + ", ".join(sorted({*_HOOK_STEPS, *_COMMAND_KEYS}))
    try:
        commands = Commands(
            _argvs(raw["reset"], "reset"),
            _argv(raw["health"], "health"),
            _argv(raw["persistence_off"], "persistence_off"),
            _argv(raw["persistence_on"], "persistence_on"),
            _argvs(raw["restore"], "restore"),
            *(_hooks(raw[step], step) for step in _HOOK_STEPS),
        )
    except ValueError as err:
        return str(err)
    return _unsafe(commands, target) or commands


_COMMAND_KEYS = ("reset", "health", "persistence_off", "persistence_on", "restore")


def _argv(raw: object, where: str) -> Argv:
    if not isinstance(raw, list) or not raw or len(raw) > MAX_ARGS:
        raise ValueError(f"{where}: not a command of 1 to {MAX_ARGS} arguments")
    for arg in raw:
        if not isinstance(arg, str) or len(arg) > MAX_FILLED_CHARS or "\0" in arg:
            raise ValueError(f"{where}: an argument is not a string of at most "
                             f"{MAX_FILLED_CHARS} characters without NUL")  # fmt: skip
    if not raw[0]:
        raise ValueError(f"{where}: the program is empty")
    return tuple(raw)


def _list(raw: object, where: str) -> list[object]:
    if not isinstance(raw, list) or len(raw) > MAX_COMMANDS:
        raise ValueError(f"{where}: not a list of at most {MAX_COMMANDS} entries")
    return raw


def _argvs(raw: object, where: str) -> tuple[Argv, ...]:
    return tuple(_argv(item, f"{where}[{n}]") for n, item in enumerate(_list(raw, where)))


def _hooks(raw: object, where: str) -> tuple[PreparedHook, ...]:
    hooks = []
    for n, item in enumerate(_list(raw, where)):
        at = f"{where}[{n}]"
        if not isinstance(item, Mapping) or not {"argv", "timeout"} <= set(item) <= {
            "argv", "timeout", "error"
        }:  # fmt: skip
            raise ValueError(f"{at}: not an object with argv, timeout and perhaps error")
        timeout, error = as_number(item["timeout"]), item.get("error")
        if timeout is None or not 0 < timeout <= MAX_HOOK_TIMEOUT:
            raise ValueError(
                f"{at}: the timeout is not a number of seconds in (0, {MAX_HOOK_TIMEOUT:g}]"
            )
        if error is not None and (
            not isinstance(error, str) or not error or len(error) > MAX_FILLED_CHARS
        ):
            raise ValueError(f"{at}: the error is not a text of 1 to {MAX_FILLED_CHARS} chars")
        hooks.append(PreparedHook(_argv(item["argv"], at), timeout, error))
    return tuple(hooks)


# --- reading a reset command's result (the table of exit codes: docs/internals.md) -----------

REASON_OUTPUT_LIMIT = 2000  # characters of a command's output quoted in a reason

_EXIT_MEANINGS = {
    2: "invalid argument",
    3: "reset is not supported on this GPU",
    4: "no permission to reset (needs root with CAP_SYS_ADMIN)",
    6: "GPU not found",
    8: "GPU power cables not connected",
    9: "NVIDIA driver not loaded",
    10: "GPU interrupt (IRQ) problem",
    12: "NVML library not found",
    13: "function not implemented",
    14: "GPU infoROM corrupted",
    15: "GPU has fallen off the bus or is inaccessible",
    255: "nvidia-smi reported an error",  # unless it says the GPU is in use
}
_IN_USE_MARKERS = ("in use by another client", "currently in use", "being used by")
IN_USE_REASON = (
    "exit 255: the driver says the GPU is in use by another client, which the final holder "
    "scan did not see (a hidden holder: a file descriptor in flight in a unix-socket message, "
    "a holder in another PID namespace or a VM, or a thread whose files could not be read)"
)


def fold_output(output: str) -> str:
    """Output on one line (whitespace folded), its last :data:`REASON_OUTPUT_LIMIT` characters."""
    text = " ".join(output.split())
    if len(text) > REASON_OUTPUT_LIMIT:
        text = "..." + text[-REASON_OUTPUT_LIMIT:]
    return text


def quote_output(output: str) -> str:
    """``; output: '...'`` for a reason, or nothing when there was no output."""
    text = fold_output(output)
    return f"; output: {text!r}" if text else ""


def says_in_use(result: CommandResult) -> bool:
    """The command failed with nvidia-smi's "in use by another client" text."""
    return not result.ok and any(marker in result.output.lower() for marker in _IN_USE_MARKERS)


def interpret_reset_exit(result: CommandResult) -> tuple[ResetResult, bool, str]:
    """``(result, needs_reboot, reason)`` for a finished reset command, its output quoted."""
    output = quote_output(result.output)
    if result.timed_out:  # a process of its tree stuck in the kernel: the GPU is wedged
        unkillable = result.returncode is None or result.unkillable > 0
        reason = f"reset command did not finish within {result.duration:.1f}s and was killed"
        if unkillable:
            reason += f"; {result.error}: the GPU is probably wedged"
        return ResetResult.TIMEOUT, unkillable, reason + output
    if result.returncode is None:
        return ResetResult.FAILED, False, f"reset command could not run: {result.error}"
    code = result.returncode
    if code == 0:
        return ResetResult.SUCCESS, False, "GPU reset" + output
    if code < 0:
        return ResetResult.FAILED, False, f"reset command was killed by signal {-code}" + output
    if code == 15:
        reason = f"exit 15: {_EXIT_MEANINGS[15]}; the node needs a reboot{output}"
        return ResetResult.FAILED, True, reason
    if code == 255 and says_in_use(result):
        return ResetResult.IN_USE, False, IN_USE_REASON + output
    meaning = _EXIT_MEANINGS.get(code, "unexpected exit code")
    return ResetResult.FAILED, False, f"exit {code}: {meaning}" + output


@dataclass(frozen=True)
class ResetOutcome:
    """How a reset ended: its ``result``, the ``step`` it ended at (``done`` when it went all
    the way), the final scan's ``blockers``, the reset ``command``'s result when it ran."""

    result: ResetResult
    step: ResetStep
    reason: str
    needs_reboot: bool
    command: CommandResult | None
    blockers: tuple[str, ...]

    def fields(self) -> dict[str, object]:
        """What the reset's events say of how it ended."""
        return {
            "result": self.result,
            "step": self.step.value,
            "reason": self.reason,
            "needs_reboot": self.needs_reboot,
            "blockers": list(self.blockers),
        }


class ResetEnvironment(Protocol):
    """What the reset needs from the daemon. Tests pass a fake."""

    def stop_nvml(self) -> bool:
        """Stop the NVML worker; True when no NVML handle of ours remains."""

    def final_blockers(self, target: ResetTarget, ignore: frozenset[int]) -> list[str]:
        """A fresh full holder scan: a reason per blocker, not counting ``ignore`` (monitors
        a dry run would have stopped)."""

    def find_monitors(self, target: ResetTarget) -> list[StoppableMonitor]:
        """A fresh holder scan: the holders of the GPU that ``reset.monitors`` lets stop."""

    def stop_monitors(
        self, target: ResetTarget, monitors: Sequence[StoppableMonitor], timeout: float
    ) -> list[str]:
        """SIGTERM to each monitor process, then a wait up to ``timeout`` seconds until none
        holds the GPU: a reason per one that still does."""

    def memory_back_to_baseline(self, target: ResetTarget) -> bool | None:
        """After the reset: restart NVML and read memory. None = unknown."""

    def instance_back(self, target: ResetTarget) -> str | None:
        """After a MIG recovery: None when the instance is back, listed, its memory freed;
        else what is not (unknown is not back)."""

    def reread_gpu(self, target: ResetTarget) -> GpuInfo | None:
        """A fresh NVML reading of the GPU (None: not in it), the worker stopped again before
        this returns (raises when it cannot be): nothing of ours holds the GPU then."""

    def record_step(self, target: ResetTarget, step: ResetStep, data: Mapping[str, object]) -> None:
        """Persist progress before ``step`` runs (see :func:`progress_record`)."""

    def emit(self, event: str, level: Level, **fields: object) -> None: ...


# Wait up to ``timeout`` seconds for the GPU's NVLink fabric registration to be COMPLETED:
# (target, timeout) -> (whether it is, the last state read).
FabricWait = Callable[[ResetTarget, float], tuple[bool, str]]


class CommandRunner(Protocol):
    """Runs one command or hook with :func:`gpuwatchd.act.commands.run_command`'s contract:
    a :class:`~gpuwatchd.act.commands.CommandResult`, never an exception for a failure."""

    def __call__(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult: ...


def progress_record(
    target: ResetTarget, step: ResetStep, data: Mapping[str, object]
) -> dict[str, object]:
    """The record the state file keeps for a reset in progress (its fields: docs/internals.md),
    read back by :func:`resume_interrupted`."""
    record: dict[str, object] = {
        **fields_of(target, ("uuid", "pci_bus_id", "minor", "persistence_was_on")),
        "step": step.value,
        **data,
    }
    if target.fabric:  # only then: the records of other GPUs read as before
        record["fabric"] = True
    if target.recovery is not None:
        record["recovery"] = target.recovery.record()
    if target.layout:
        record["mig_layout"] = [r.record() for r in target.layout]
    return record


def outcome_event(
    outcome: ResetOutcome, *, gpu: str, pci_bus_id: str | None, dry_run: bool
) -> tuple[Level, dict[str, object]]:
    """The level and fields of ``EventName.RESET_OUTCOME`` (the daemon's and simulate's)."""
    level = Level.CRITICAL if outcome.needs_reboot else RESET_RESULT_LEVELS[outcome.result]
    return level, {"gpu": gpu, "pci_bus_id": pci_bus_id, **outcome.fields(), "dry_run": dry_run}
