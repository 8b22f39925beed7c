"""The scenario format's values for ``gpuwatchd simulate``: what a scenario *is*, once read.

This module owns the frozen values a scenario file becomes (:class:`Scenario` and its specs),
the constants of the format and :class:`ScenarioError`. Reading the YAML is
:mod:`gpuwatchd.sim.scenario`'s; playing it needs only these values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from gpuwatchd.config.yamlsrc import ConfigError
from gpuwatchd.core.model import MIB
from gpuwatchd.core.vocabulary import ResetStep
from gpuwatchd.decide.health.fabric import FabricState
from gpuwatchd.decide.health.judge import RecoveryAction

GIB = 1024 * MIB
FIRST_AUTO_PID = 1000
SIGKILL_REACTIONS = ("exit", "stuck")
EXIT_MODES = ("release", "zombie", "leak")
RESET_RESULTS = ("success", "fail", "in_use", "hang", "fell_off_bus")
VIA = ("fd", "map", "both")
# The reset steps an event can be tied to (``during``); ``done`` is bookkeeping, not a moment.
RESET_STEPS = tuple(step.value for step in ResetStep if step is not ResetStep.DONE)


EVENT_ACTIONS = (
    "exit",
    "start",
    "set_memory",
    "memory_stays_allocated",
    "reset_result",
    "state",
    "reap",
    "pause",
    "resume",
    "xid",
    "health",
    "spare",
)


FABRIC_STATES = tuple(state.name for state in FabricState)  # in order: the state's number
FABRIC_SETTLE = 5.0  # seconds the fabric takes to register again after a reset, by default
RECOVERY_ACTIONS = tuple(action.name for action in RecoveryAction)  # in order: its number
FILES = ("inherited", "own")  # what kcmp says of a holder's device files vs its owners'


def keys_of(spec: Any, *, but: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The keys of ``spec``'s mapping in a scenario file: its fields in order, less ``but``."""
    return tuple(f.name for f in fields(spec) if f.name not in but)


class ScenarioError(ConfigError):
    """A malformed scenario, located and said as a policy's problem is: ``file:line: field:
    message``. The CLI exits 65 on it (``simulate`` catches it before any ConfigError)."""


@dataclass(frozen=True)
class HostSpec:
    host_namespaces: bool | None = True
    mps_server_running: bool = False
    pid_max: int = 4194304
    ended_jobs: frozenset[str] = frozenset()  # what an epilog's run --once --ended-job says


@dataclass(frozen=True)
class HealthSpec:
    """A virtual GPU's health. ``recovery_action`` None: the driver does not offer the field
    (before R565); ``retired_pages_pending`` None: no page retirement (Ampere and later);
    ``fabric`` None: no NVSwitch fabric, else its registration state (FABRIC_STATES index),
    which a reset sets IN_PROGRESS for ``fabric_after_reset`` seconds (None: never done)."""

    recovery_action: int | None = None
    remap_pending: bool = False
    remap_failure: bool = False
    retired_pages_pending: bool | None = None
    fabric: int | None = None
    fabric_after_reset: float | None = FABRIC_SETTLE


@dataclass(frozen=True)
class MigInstanceSpec:
    """One GPU instance of a virtual MIG GPU (one compute instance, id 0): its own memory."""

    gi: int
    profile: str = "1g.10gb"
    total: int = 10 * GIB
    allocated: int = 4 * MIB
    leaked: int = 0


@dataclass(frozen=True)
class GpuSpec:
    """One virtual GPU. ``allocated`` is its idle allocation (what a reset restores);
    ``leaked`` is memory already held by no process at the start (freed only by a reset)."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    minor: int
    total: int
    allocated: int
    reserved: int
    leaked: int = 0
    mig: bool = False
    coherent: bool = False
    persistence: bool = True
    lost: bool = False
    health: HealthSpec = HealthSpec()
    mig_instances: tuple[MigInstanceSpec, ...] = ()  # with ``mig``: its GPU instances


@dataclass(frozen=True)
class HoldSpec:
    """Which device files a process holds: GPUs by index, through fd and/or map; ``mig``: the
    GPU instance whose capability files it holds on each MIG GPU it holds (None: none, a
    parent-only process), where its contexts there live."""

    gpus: tuple[int, ...] = ()
    via: str = "both"
    ctl: bool = True
    uvm: bool = True
    mig: int | None = None


@dataclass(frozen=True, kw_only=True)
class ProcessSpec:
    """One virtual process and how it behaves. References (ppid, pgid, sid) are resolved PIDs;
    ``nvml``: GPU index -> the memory of its context there (None: listed without a figure)."""

    name: str
    pid: int
    ppid: int
    pgid: int
    sid: int
    user: str
    uid: int
    command: tuple[str, ...]
    comm: str
    exe: str | None
    exe_trusted: bool | None = None  # its program is root's (floor.py); None: cannot be read
    cgroup: str
    state: str
    holds: HoldSpec
    nvml: Mapping[int, int | None]
    on_sigterm: str = "exit"
    sigterm_delay: float = 0.0
    on_sigkill: str = "exit"
    on_exit: str = "release"
    exits_at: float | None = None
    visible: bool = True
    subreaper: bool = False
    stops_for_reset: bool = False
    files: str | None = None  # FILES: kcmp's answer against live owners above it; None unknown
    line: int = 0


@dataclass(frozen=True)
class EventSpec:
    """One event (``action``: one of EVENT_ACTIONS) at ``at`` seconds, or once right after
    the first reset procedure runs the step ``during`` names."""

    at: float
    action: str
    line: int
    target: str | None = None  # a process name (exit, memory_stays_allocated, reap, state)
    process: ProcessSpec | None = None  # start
    gpu: int | None = None  # set_memory
    memory: int | None = None  # set_memory
    value: str | None = None  # reset_result, state letter, pause reason
    during: str | None = None  # a reset step instead of a time
    xid: int | None = None  # xid (on ``gpu``)
    health: Mapping[str, object] | None = None  # health: the fields that change (on ``gpu``)
    job: str | None = None  # spare: the job key (``slurm:42``) instead of a process (``target``)
    lasts: float | None = None  # spare: for how long


@dataclass(frozen=True)
class Scenario:
    """A whole scenario, validated. ``policy`` is the inline policy as a (file, text) pair
    whose text keeps the scenario's line numbers, ready for ``config.parse_policy_documents``."""

    path: str
    description: str
    duration: float
    interval: float | None
    policy: tuple[str, str] | None
    host: HostSpec
    gpus: tuple[GpuSpec, ...]
    processes: tuple[ProcessSpec, ...]
    events: tuple[EventSpec, ...] = field(default_factory=tuple)
