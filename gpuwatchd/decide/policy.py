"""The typed policy: every setting the daemon acts on, as one frozen value.

This module owns the *shape* and the built-in defaults of the policy. Reading YAML, merging
drop-ins and validating is ``config.py``'s job; deciding what to do is ``plan.py``'s. Durations
are float seconds and sizes are int bytes here; the YAML spells them ``30s`` and ``256MiB``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuwatchd.core.model import MIB, FindingKind
from gpuwatchd.core.paths import DEFAULT_STATE_DIR

DEFAULT_RESET_COMMAND = ("nvidia-smi", "--gpu-reset", "-i", "{uuid}")
# The re-creation of one MIG GPU instance in place (decide/mig/recovery.py): destroy its compute
# instance, then the GPU instance, then create it again with the same GI profile at the same
# placement start, with its default compute instance (-C). The GPU is named by UUID: an index
# may change across the re-creation.
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
# The systemd units an infrastructure program runs in when it is not root (it dropped to a
# service account, as nvidia-persistenced --user and nv-hostengine --service-account do): by
# its executable's name, such a program is believed only as root or inside one of its own
# units (decide/floor.py). A name absent here is believed only as root.
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


@dataclass(frozen=True)
class Hook:
    """A command an admin configured (argv, no shell), run with a deadline."""

    argv: tuple[str, ...]
    timeout: float = 60.0


@dataclass(frozen=True)
class Step:
    """One rung of a rule's ladder: send ``signal`` (a name such as "SIGTERM"), then wait.

    ``signal`` None means "report only" (log that the rule matched; act on nothing).
    """

    signal: str | None
    wait: float


@dataclass(frozen=True)
class Rule:
    """Selects findings by kind and optional filters; acts through ordered steps.

    Filters that are empty match everything; ``for_`` is how long the finding must have lasted
    (its confirmation window). Patterns: ``commands`` are regexes searched in the joined
    command line; ``users``, ``units``, ``cgroups`` and ``jobs`` are shell-style globs.
    """

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
    """A monitor the reset procedure may stop and bring back (``reset.monitors``): an NVML-only
    client (gpustat, ``nvidia-smi -l``, an exporter) that holds the GPU's device file and owns
    no context. ``unit``: a system service, ``systemctl stop`` before the final scan and
    ``systemctl start`` after the reset. ``command``: a process whose command line matches,
    sent SIGTERM; whatever supervises it starts it again. Exactly one of the two is set
    (docs/policy.md#reset, decide/plan/monitors.py)."""

    unit: str | None = None
    command: re.Pattern[str] | None = None


@dataclass(frozen=True)
class ResetPolicy:
    """When and how a GPU is reset (docs/design-notes.md §7). Only ``ghost_memory`` can lead to
    one."""

    enabled: bool = True
    command: tuple[str, ...] = DEFAULT_RESET_COMMAND
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
    # Ghost memory inside a MIG GPU instance: re-create that instance in place (off: report).
    mig_recovery: bool = False
    mig_recovery_commands: tuple[tuple[str, ...], ...] = DEFAULT_MIG_RECOVERY_COMMANDS
    allow_nvlink_group: bool = False
    # On an NVSwitch system, how long a reset waits for the GPU's NVLink fabric registration to
    # reach COMPLETED before the reset counts as done (and the after hooks undrain).
    fabric_timeout: float = 120.0
    # NVML-only monitors the procedure may stop and bring back; any other blocks the reset.
    monitors: tuple[Monitor, ...] = ()


HEALTH_ACTIONS = ("report", "drain", "reset")
XID_63_CHOICES = ("ignore", "drain")  # NVIDIA: ignore; EC2 replaces the instance
XID_94_CHOICES = ("restart_app", "drain")  # NVIDIA: restart the application; DCGM warns


@dataclass(frozen=True)
class HealthPolicy:
    """What to do about GPU health findings (docs/policy.md#health).

    ``action``: "report" (events only), "drain" (also run the ``reset.drain`` hooks once) or
    "reset" (drain, wait until nothing holds the GPU, then the reset procedure, under every
    reset gate and limit; without ``reset.enabled`` it is "drain"). ``drain_timeout`` bounds
    that wait; then the ``on_failure`` hooks run once (the reset still follows if the GPU is
    freed later: nothing is ever signalled for it). ``device_isolation``
    says jobs only open the device files of their own GPUs (cgroup device isolation): without
    it, a live job on any GPU keeps a health reset waiting. ``xid_63`` / ``xid_94``: the
    stricter peer choices (``drain``) instead of NVIDIA's buckets. ``fabric_stuck_after``: how
    long a fabric may take to register before it counts as stuck. ``kernel_log``: where
    Xids are read besides NVML's events (docs/findings.md#kernel-log).
    """

    enabled: bool = True
    action: str = "reset"
    drain_timeout: float = 7200.0
    device_isolation: bool = False
    # Stricter choices some peers make, off by default (docs/policy.md#health): "drain" takes
    # the GPU out of service on Xid 63 (a row remapped) or Xid 94 (a contained memory error).
    xid_63: str = "ignore"
    xid_94: str = "restart_app"
    # A GPU whose NVLink fabric registration stays NOT_STARTED or IN_PROGRESS this long is
    # stuck (drain_required naming Fabric Manager).
    fabric_stuck_after: float = 600.0
    # Where Xids are also read from (collect/kernel_log.py): "journal" (journalctl's kernel
    # messages of this boot, then followed), "off", or a file in /dev/kmsg's format. Read at
    # start: a change needs a restart.
    kernel_log: str = "journal"


@dataclass(frozen=True)
class Limits:
    """Damping (docs/design-notes.md §12): caps past which the daemon switches to dry-run.

    ``max_signalled_per_poll`` and ``max_signalled_per_hour`` count the distinct processes of
    one user (uid): past them only that user's targets go dry-run, so one user's storm cannot
    stop enforcement for everyone. ``node_max_signalled_per_hour`` counts the whole node: past
    it everything goes dry-run (a bug or a strange node). Each latch lifts by itself after
    ``kill_cap_latch`` (or earlier by ``resume --clear-latches``).
    """

    # One crashed 8-GPU job can leave 8 DataLoader workers per GPU: the caps sit above that
    # everyday incident and below a massacre.
    max_signalled_per_poll: int = 16
    max_signalled_per_hour: int = 64
    node_max_signalled_per_hour: int = 256
    kill_cap_latch: float = 3600.0
    post_action_delay: float = 15.0
    # The longest an admin's `pause --for` / `spare --for` may last (a forgotten pause or
    # spare must not disable the node for good): also the length of a `pause` without --for.
    max_pause: float = 86400.0
    max_spare: float = 86400.0


@dataclass(frozen=True)
class Detection:
    """Thresholds of the findings."""

    ghost_margin: int = 256 * MIB
    default_baseline: int = 64 * MIB  # allocated memory assumed idle until one is learned
    unaccounted_margin: int = 1024 * MIB
    pid_trust_min_unresolved: int = 3  # this many listed PIDs not in /proc → stop trusting
    # A likely heir of a leak from before the daemon watched (its session or process-group
    # leader gone, no history) is ``orphaned`` instead of ``hidden_holder`` (docs/policy.md).
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
    # MIG: the driver's table of capability minors (collect/mig.py); tests point it at a file
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
    """The rules the shipped config spells out.

    Orphans get SIGTERM, then SIGKILL. A holder stuck in uninterruptible sleep cannot be
    killed: it is reported and the ``on_failure`` hooks run once (drain the node, page someone).
    """
    return (
        Rule(
            name="orphans",
            kind=FindingKind.ORPHANED,
            for_=30.0,
            steps=(Step("SIGTERM", 30.0), Step("SIGKILL", 10.0)),
        ),
        Rule(name="stuck", kind=FindingKind.STUCK, for_=60.0, steps=(Step(None, 0.0),)),
    )
