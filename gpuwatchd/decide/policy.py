"""The typed policy: every setting the daemon acts on, as one frozen value, with its defaults.

Reading and validating YAML is ``config/``'s job. Durations are float seconds and sizes int
bytes here; the YAML spells them ``30s`` and ``256MiB``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuwatchd.core.model import MIB, FindingKind
from gpuwatchd.core.paths import DEFAULT_STATE_DIR

# Re-create one MIG GPU instance in place (decide/mig/recovery.py): destroy its compute and GPU
# instance, create it again with the same profile and placement, with its default CI (-C).
DEFAULT_MIG_RECOVERY_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("nvidia-smi", "mig", "-i", "{uuid}", "-gi", "{gi}", "-ci", "{ci}", "-dci"),
    ("nvidia-smi", "mig", "-i", "{uuid}", "-gi", "{gi}", "-dgi"),
    ("nvidia-smi", "mig", "-i", "{uuid}", "-cgi", "{profile}:{placement}", "-C"),
)

# Infrastructure that no configuration can make a target (docs/design-notes.md §10). Matched against
# comm (cut to 15 characters by the kernel), the executable's basename and argv[0]'s basename.
FLOOR_PROCESS_NAMES = frozenset(
    {
        "nvidia-persistenced",
        "nv-hostengine",
        "dcgm-exporter",
        "dcgmi",
        "nvidia-cuda-mps-control",
        "nvidia-cuda-mps-server",
        "nv-fabricmanager",
        "nvidia-fabricmanager",
        "nvidia-imex",
        "nvidia-powerd",
        "nvsm",
        "nvidia-device-plugin",
        "nvidia-device-plugin-daemon",
        "gpu-feature-discovery",
        "nvidia-smi",
        "Xorg",
        "X",
        "Xwayland",
        "gnome-shell",
        "kwin_wayland",
        "sway",
        "weston",
        "gpuwatchd",
        "systemd",
        "init",
    }
)
FLOOR_UNIT_PATTERNS = (
    "nvidia-persistenced.service",
    "nvidia-dcgm.service",
    "dcgm.service",
    "dcgm-exporter.service",
    "nvidia-fabricmanager.service",
    "nvidia-imex.service",
    "nvidia-powerd.service",
    "nvsm*.service",
    "gpuwatchd.service",
    "display-manager.service",
    "gdm*.service",
    "sddm.service",
    "lightdm.service",
)
# The systemd units an infrastructure program may run in as a service account (decide/floor.py);
# a name absent here is believed only as root.
FLOOR_NAME_UNITS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "nvidia-persistenced": ("nvidia-persistenced.service",),
        "nv-hostengine": ("nvidia-dcgm.service", "dcgm.service"),
        "dcgm-exporter": ("dcgm-exporter.service",),
        "nvidia-cuda-mps-control": ("nvidia-mps.service", "nvidia-cuda-mps*.service"),
        "nvidia-cuda-mps-server": ("nvidia-mps.service", "nvidia-cuda-mps*.service"),
        "nv-fabricmanager": ("nvidia-fabricmanager.service",),
        "nvidia-fabricmanager": ("nvidia-fabricmanager.service",),
        "nvidia-imex": ("nvidia-imex.service",),
        "nvidia-powerd": ("nvidia-powerd.service",),
        "nvsm": ("nvsm*.service",),
        "gpuwatchd": ("gpuwatchd.service",),
    }
)


# The longest a hook may run: the policy's bound (config/keys.py) and a recorded reset's
# (act/reset_target.py). The watchdog is fed while hooks run; a drain may wait for a scheduler.
MAX_HOOK_TIMEOUT = 600.0


@dataclass(frozen=True)
class Hook:
    """A command an admin configured (argv, no shell), run with a deadline."""

    argv: tuple[str, ...]
    timeout: float = 60.0


# The signals a ladder may send: the config and the state file's reader refuse any other.
SIGNAL_NAMES = ("SIGTERM", "SIGKILL", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT")


@dataclass(frozen=True)
class Step:
    """One rung of a rule's ladder: send ``signal`` (a name such as "SIGTERM"; None: report
    only), then wait."""

    signal: str | None
    wait: float


@dataclass(frozen=True)
class Rule:
    """Selects findings by kind, confirmation window (``for_``) and filters (empty: any;
    ``commands`` regexes, the others globs); acts through ordered steps."""

    name: str
    kind: FindingKind
    steps: tuple[Step, ...]
    for_: float = 0.0
    min_memory: int | None = None
    users: tuple[str, ...] = ()
    commands: tuple[re.Pattern[str], ...] = ()
    cgroups: tuple[str, ...] = ()
    units: tuple[str, ...] = ()
    jobs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Protect:
    """What no rule may touch: overrides every rule (the floor below it is built in)."""

    commands: tuple[re.Pattern[str], ...] = ()
    users: tuple[str, ...] = ()
    units: tuple[str, ...] = ()
    cgroups: tuple[str, ...] = ()
    gpus: tuple[str, ...] = ()  # UUIDs or PCI bus ids


@dataclass(frozen=True)
class Monitor:
    """An NVML-only monitor the reset procedure may stop and bring back (``reset.monitors``,
    docs/policy.md#reset): a systemd ``unit`` or a ``command`` pattern, exactly one set."""

    unit: str | None = None
    command: re.Pattern[str] | None = None


@dataclass(frozen=True)
class ResetPolicy:
    """When and how a GPU is reset (docs/design-notes.md §7)."""

    enabled: bool = True
    command: tuple[str, ...] = ("nvidia-smi", "--gpu-reset", "-i", "{uuid}")
    confirm_for: float = 600.0
    timeout: float = 120.0
    drain: tuple[Hook, ...] = ()
    before: tuple[Hook, ...] = ()
    after: tuple[Hook, ...] = ()
    toggle_persistence: bool = True
    persistence_command: tuple[str, ...] = ("nvidia-smi", "-pm", "{mode}", "-i", "{uuid}")
    health_command: tuple[str, ...] = ("nvidia-smi", "-q", "-i", "{uuid}")
    max_resets: int = 1  # per GPU within ``window``
    window: float = 86400.0
    cooldown: float = 3600.0  # per GPU, after any reset attempt
    max_failures: int = 2  # circuit breaker: node-wide failures before resets stop
    allow_mig: bool = False
    mig_recovery: bool = False
    mig_recovery_commands: tuple[tuple[str, ...], ...] = DEFAULT_MIG_RECOVERY_COMMANDS
    allow_nvlink_group: bool = False
    fabric_timeout: float = 120.0
    monitors: tuple[Monitor, ...] = ()


HEALTH_ACTIONS = ("report", "drain", "reset")
XID_63_CHOICES = ("ignore", "drain")  # NVIDIA: ignore; EC2 replaces the instance
XID_94_CHOICES = ("restart_app", "drain")  # NVIDIA: restart the application; DCGM warns


@dataclass(frozen=True)
class HealthPolicy:
    """What to do about GPU health findings; each key: docs/policy.md#health."""

    enabled: bool = True
    action: str = "reset"
    drain_timeout: float = 7200.0
    device_isolation: bool = False
    xid_63: str = "ignore"
    xid_94: str = "restart_app"
    fabric_stuck_after: float = 600.0
    kernel_log: str = "journal"


@dataclass(frozen=True)
class Limits:
    """Damping (docs/design-notes.md §12; docs/policy.md): caps past which one user's targets,
    or the whole node's, go dry-run, until ``kill_cap_latch`` has passed."""

    # One crashed 8-GPU job can leave 8 DataLoader workers per GPU: above that, below a massacre.
    max_signalled_per_poll: int = 16
    max_signalled_per_hour: int = 64
    node_max_signalled_per_hour: int = 256
    kill_cap_latch: float = 3600.0
    post_action_delay: float = 15.0
    # The longest `pause --for` / `spare --for`, so a forgotten one ends; also a bare `pause`.
    max_pause: float = 86400.0
    max_spare: float = 86400.0


@dataclass(frozen=True)
class Detection:
    """Thresholds of the findings."""

    ghost_margin: int = 256 * MIB
    default_baseline: int = 64 * MIB  # allocated memory assumed idle until one is learned
    unaccounted_margin: int = 1024 * MIB
    pid_trust_min_unresolved: int = 3  # this many listed PIDs not in /proc → stop trusting
    orphans_without_history: bool = False


@dataclass(frozen=True)
class MetricsPolicy:
    """Prometheus metrics through node_exporter's textfile collector (docs/metrics.md)."""

    textfile: str | None = None  # the .prom file rewritten each poll; None: no metrics file


@dataclass(frozen=True)
class Policy:
    """The whole effective policy, defaults included."""

    interval: float = 5.0
    dry_run: bool = True
    state_dir: str = DEFAULT_STATE_DIR
    devices_dir: str = "/dev"
    mig_minors_file: str = "/proc/driver/nvidia-caps/mig-minors"
    proc_root: str = "/proc"
    device_major: int = 195
    namespace_check: bool = True  # False: trust the PID namespace we run in (tests only)
    nvml_timeout: float = 10.0
    full_scan_interval: float = 60.0  # a scan of all of /proc at least this often
    # ... unless the daemon's inotify watch on the device files works: then at least this often
    full_scan_backstop: float = 600.0
    detection: Detection = field(default_factory=Detection)
    protect: Protect = field(default_factory=Protect)
    rules: tuple[Rule, ...] = ()
    reset: ResetPolicy = field(default_factory=ResetPolicy)
    health: HealthPolicy = field(default_factory=HealthPolicy)
    limits: Limits = field(default_factory=Limits)
    on_failure: tuple[Hook, ...] = ()
    on_action: tuple[Hook, ...] = ()  # notifications after a real kill ladder or reset ended
    metrics: MetricsPolicy = field(default_factory=MetricsPolicy)
    log_format: str = "logfmt"  # "logfmt", "json" or "console"
    sources: tuple[str, ...] = ()  # files this policy was read from, in merge order


def default_rules() -> tuple[Rule, ...]:
    """The rules the shipped config spells out: orphans get SIGTERM, then SIGKILL; a stuck
    holder cannot be killed: it is reported (the ``on_failure`` hooks run once)."""
    return (
        Rule(
            name="orphans",
            kind=FindingKind.ORPHANED,
            for_=30.0,
            steps=(Step("SIGTERM", 30.0), Step("SIGKILL", 10.0)),
        ),
        Rule(name="stuck", kind=FindingKind.STUCK, for_=60.0, steps=(Step(None, 0.0),)),
    )
