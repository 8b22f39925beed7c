"""The policy's keys: one table, from which validation, "did you mean", rendering, defaults
and the documented bounds (``docs/policy.md``) all come, and how each value is read.

Each YAML section is a policy dataclass (:mod:`gpuwatchd.decide.policy`); the table gives, for
every field, the YAML key and its :class:`Value`: how a node is read, bounded and written back.
Names, order and defaults come from the dataclasses (a field without a line here fails at
import). Sections, rules and drop-ins are ``gpuwatchd.config.schema``'s. Pure.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatchd.config.units import format_duration, format_size, parse_duration, parse_size
from gpuwatchd.config.yamlsrc import (
    ConfigError,
    Node,
    Scalar,
    Seq,
    describe_value,
    did_you_mean,
    shown,
)
from gpuwatchd.core.checked import MAX_STRING
from gpuwatchd.core.model import FindingKind
from gpuwatchd.decide.argv import (
    GPU_PLACEHOLDERS,
    HOOK_PLACEHOLDERS,
    LITERAL_BUS_ID,
    LITERAL_UUID,
    MAX_ARGS,
    MAX_COMMANDS,
    MIG_PLACEHOLDERS,
    ArgvError,
    check_hook_command,
    check_one_gpu,
)
from gpuwatchd.decide.gpu_ids import nvml_bus_id, pci_bus_key
from gpuwatchd.decide.patterns import NotLinear, TooCostly, check_linear
from gpuwatchd.decide.plan.monitors import MAX_MONITORS
from gpuwatchd.decide.policy import (
    HEALTH_ACTIONS,
    MAX_HOOK_TIMEOUT,
    SIGNAL_NAMES,
    XID_63_CHOICES,
    XID_94_CHOICES,
    Detection,
    HealthPolicy,
    Hook,
    Limits,
    MetricsPolicy,
    Monitor,
    Policy,
    Protect,
    ResetPolicy,
    Rule,
    Step,
)

LOG_FORMATS = ("logfmt", "json", "console")
MAX_PATTERN = 1024  # a regex longer than this is a mistake, and sre compiles it recursively

Reader = Callable[[Node], Any]
Renderer = Callable[[Any], object]
OMIT = object()  # a Renderer's answer for "leave the key out" (an unset optional)


@dataclass(frozen=True)
class Bound:
    """The inclusive range of a duration (seconds), size (bytes) or count, and its spelling."""

    unit: str  # "duration", "size" or "count"
    lowest: float
    highest: float
    lowest_text: str
    highest_text: str


@dataclass(frozen=True)
class Value:
    """How one YAML value is read (checked and bounded) and written back."""

    read: Reader
    render: Renderer
    bound: Bound | None = None


@dataclass(frozen=True)
class Nested:
    """A value that is a section of its own (``many``: a list of them). ``flatten``: the
    section's keys are fields of the parent dataclass (``log.format`` is Policy.log_format)."""

    section: str
    many: bool = False
    flatten: bool = False
    most: int | None = None  # ``many``: at most this many items


@dataclass(frozen=True)
class Key:
    name: str  # as written in YAML
    field: str | None  # the dataclass attribute; None for a flattened section
    value: Value | Nested
    required: bool = False  # the dataclass gives no default
    missing: str = ""  # added to "missing required key" (what to write)


@dataclass(frozen=True)
class Section:
    """One mapping of the YAML, as one dataclass. ``extra``: keys read outside the table."""

    name: str
    cls: type
    keys: tuple[Key, ...]
    extra: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(key.name for key in self.keys) + self.extra


# --- reading one value ------------------------------------------------------------------------


def kind_of(node: Node) -> str:
    """A node as an error message names it."""
    if isinstance(node, Scalar):
        return describe_value(node.value)
    return "a list" if isinstance(node, Seq) else "a mapping"


def scalar(node: Node) -> object:
    """A single value's own value; a located ConfigError for a list or a mapping."""
    if not isinstance(node, Scalar):
        raise node.error(f"expected a single value, got {kind_of(node)}")
    return node.value


def _read_bool(node: Node) -> bool:
    value = scalar(node)
    if not isinstance(value, bool):
        raise node.error(f"expected true or false, got {describe_value(value)}")
    return value


def _integer(value: object, *, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"expected an integer, got {describe_value(value)}", key=where)
    return value


def count(lowest: int, highest: int) -> Value:
    bound = Bound("count", lowest, highest, str(lowest), str(highest))
    return _with_unit(_integer, _same, bound)


def duration(lowest: str | int, highest: str | float) -> Value:
    """A duration in ``lowest..highest``, both written as in YAML (``0``, ``100ms``, ``1h``)."""
    low, high = parse_duration(lowest, where=""), parse_duration(highest, where="")
    low_text = format_duration(low) if low else "0s"
    bound = Bound("duration", low, high, low_text, format_duration(high))
    return _with_unit(parse_duration, format_duration, bound)


def size(lowest: int, highest: str) -> Value:
    """A size in ``lowest..highest`` bytes (``highest`` written as in YAML: ``1TiB``)."""
    high = parse_size(highest, where="")
    bound = Bound("size", lowest, high, format_size(lowest), format_size(high))
    return _with_unit(parse_size, format_size, bound)


def _with_unit(parse: Callable[..., float], render: Renderer, bound: Bound) -> Value:
    """A number within ``bound``: ``parse`` reads it (ConfigError), ``render`` writes it."""

    def read(node: Node) -> float:
        value = scalar(node)
        try:
            number = parse(value, where=node.path)
        except ConfigError as err:  # its file and line too, for every reader
            raise node.error(err.message) from None
        if not bound.lowest <= number <= bound.highest:
            raise node.error(
                f"must be >= {bound.lowest_text} and <= {bound.highest_text}, got {shown(value)}"
            )
        return number

    return Value(read, render, bound)


def optional(value: Value) -> Value:
    """``value`` or null (None), which is left out when written back."""

    def read(node: Node) -> Any:
        if isinstance(node, Scalar) and node.value is None:
            return None
        return value.read(node)

    return Value(read, lambda v: OMIT if v is None else value.render(v), value.bound)


def _read_string(node: Node) -> str:
    value = scalar(node)
    if not isinstance(value, str) or not value:
        raise node.error(f"expected a non-empty string, got {describe_value(value)}")
    if "\0" in value:
        raise node.error(f"{shown(value)} contains a NUL character")
    if len(value) > MAX_STRING:
        raise node.error(f"longer than {MAX_STRING} characters")
    return value


def _read_abs_path(node: Node) -> str:
    value = _read_string(node)
    if not value.startswith("/"):
        raise node.error(f"expected an absolute path, got {shown(value)}")
    return value


def _read_kernel_log(node: Node) -> str:
    """``health.kernel_log``: journal, off (written bare, YAML's boolean false) or a path."""
    if scalar(node) is False:
        return "off"
    value = _read_string(node)
    return value if value in ("journal", "off") else _read_abs_path(node)


def _read_textfile(node: Node) -> str | None:
    """``metrics.textfile``: null or "" (none), else an absolute path to a ``.prom`` file."""
    if isinstance(node, Scalar) and (node.value is None or node.value == ""):
        return None
    path = _read_abs_path(node)
    name = path.rsplit("/", 1)[-1]
    if not name.endswith(".prom") or name == ".prom":
        raise node.error(
            f"expected a file name ending in .prom (node_exporter's textfile collector reads "
            f"only those), got {shown(path)}"
        )
    return path


def one_of(choices: Sequence[str]) -> Value:
    def read(node: Node) -> str:
        value = scalar(node)
        if not isinstance(value, str) or value not in choices:
            hint = did_you_mean(value, choices) if isinstance(value, str) else ""
            raise node.error(
                f"expected one of {', '.join(choices)}, got {describe_value(value)}{hint}"
            )
        return value

    return Value(read, _same)


def items_of(node: Node, most: int | None = None) -> list[Node]:
    """The items of a list node (at most ``most``); null is an empty list."""
    if isinstance(node, Scalar) and node.value is None:
        return []
    if not isinstance(node, Seq):
        raise node.error(f"expected a list, got {kind_of(node)}")
    if most is not None and len(node.items) > most:
        raise node.error(f"at most {most} items, got {len(node.items)}")
    return node.items


def list_of(value: Value, *, empty: str = "", most: int | None = None) -> Value:
    """A list of at most ``most`` ``value``s (null: empty), every bad item reported;
    ``empty``: the error for an empty list (none: it is allowed)."""

    def read(node: Node) -> tuple[Any, ...]:
        problems: list[ConfigError] = []
        values: list[Any] = []
        for item in items_of(node, most):
            try:
                values.append(value.read(item))
            except ConfigError as err:
                problems.extend(p if p.path else item.error(p.message) for p in err.problems)
        if problems:
            raise ConfigError.combine(problems)
        if empty and not values:
            raise node.error(empty)
        return tuple(values)

    return Value(read, lambda values: [value.render(v) for v in values])


def _read_regex(node: Node) -> re.Pattern[str]:
    pattern = _read_string(node)
    if len(pattern) > MAX_PATTERN:
        raise node.error(f"regular expression longer than {MAX_PATTERN} characters")
    try:
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as err:
        raise node.error(f"invalid regular expression {shown(pattern)}: {err}") from None
    try:
        check_linear(compiled)  # searched in hostile command lines: never by backtracking
    except TooCostly as err:
        raise node.error(f"regular expression {shown(pattern)} is too costly: {err}") from None
    except NotLinear as err:
        raise node.error(
            f"regular expression {shown(pattern)} cannot be matched in linear time: {err} "
            "(command lines are chosen by users; see docs/policy.md#patterns)"
        ) from None
    return compiled


def normalize_gpu_id(text: str) -> str:
    """A GPU UUID or PCI bus id in NVML's spelling (``GPU-`` + lower-case hex, or
    ``00000000:3B:00.0``). ValueError for anything else: an index is no stable name."""
    text = text.strip()
    if LITERAL_UUID.fullmatch(text):
        return "GPU-" + text[4:].lower()
    key = pci_bus_key(text) if LITERAL_BUS_ID.fullmatch(text) else None
    if key is not None:
        return nvml_bus_id(key)
    raise ValueError(
        f"{shown(text)} is neither a GPU UUID (GPU-...) nor a PCI bus id (0000:3b:00.0)"
    )


def _read_gpu_id(node: Node) -> str:
    try:
        return normalize_gpu_id(_read_string(node))
    except ValueError as err:
        raise node.error(str(err)) from None


def check_argv(raw: object, allowed: Sequence[str], *, one_gpu: bool) -> tuple[str, ...]:
    """``raw`` as an argv tuple checked by :mod:`gpuwatchd.decide.argv`: a hook's, or
    (``one_gpu``) one that names exactly one GPU, through a placeholder.
    ConfigError (without a location) otherwise, with a "did you mean" for a placeholder."""
    if isinstance(raw, str) or not isinstance(raw, (list, tuple)):
        raise ConfigError(
            "expected an argv list such as ['nvidia-smi', '--gpu-reset', '-i', '{uuid}'], "
            f"got {describe_value(raw)} (commands run without a shell)"
        )
    if len(raw) > MAX_ARGS:  # a reset records no more (act/reset_target.py)
        raise ConfigError(f"at most {MAX_ARGS} arguments, got {len(raw)}")
    for arg in raw:
        if not isinstance(arg, str):
            raise ConfigError(f"every argument must be a string, got {describe_value(arg)}")
        if len(arg) > MAX_STRING:
            raise ConfigError(f"argument {shown(arg)} is longer than {MAX_STRING} characters")
    try:
        if one_gpu:
            check_one_gpu(tuple(raw), allowed)
        else:
            check_hook_command(tuple(raw), allowed)
    except ArgvError as err:
        hint = "" if err.unknown is None else did_you_mean(err.unknown, allowed)
        raise ConfigError(f"{err}{hint}") from None
    return tuple(raw)


def argv(allowed: Sequence[str] = GPU_PLACEHOLDERS, *, one_gpu: bool = False) -> Value:
    """An argv list (:func:`check_argv`): a hook's, or one that names exactly one GPU."""

    def read(node: Node) -> tuple[str, ...]:
        if isinstance(node, Seq):
            for item in node.items:
                if not isinstance(item, Scalar):
                    raise node.error(f"every argument must be a string, got {kind_of(item)}")
            raw: object = [item.value for item in node.items if isinstance(item, Scalar)]
        elif isinstance(node, Scalar):
            raw = node.value
        else:
            raise node.error(f"expected an argv list, got {kind_of(node)}")
        try:
            return check_argv(raw, allowed, one_gpu=one_gpu)
        except ConfigError as err:
            raise node.error(err.message) from None

    return Value(read, list)


def _read_signal(node: Node) -> str | None:
    value = scalar(node)
    if value is None:
        return None
    if isinstance(value, str):
        name = "SIG" + value.strip().upper().removeprefix("SIG")
        if name in SIGNAL_NAMES:
            return name
    hint = did_you_mean(str(value).upper(), SIGNAL_NAMES) if isinstance(value, str) else ""
    raise node.error(
        f"expected a signal name ({', '.join(SIGNAL_NAMES)}) or null for report-only, "
        f"got {describe_value(value)}{hint}"
    )


def _read_kind(node: Node) -> FindingKind:
    return FindingKind(one_of([kind.value for kind in FindingKind]).read(node))


def _same(value: Any) -> object:
    return value


BOOL = Value(_read_bool, _same)
STRING = Value(_read_string, _same)
ABS_PATH = Value(_read_abs_path, _same)
KERNEL_LOG = Value(_read_kernel_log, _same)
STRINGS = list_of(STRING)
REGEX = Value(_read_regex, lambda pattern: pattern.pattern)
REGEXES = list_of(REGEX)
HOOKS = Nested("hook", many=True)
RESET_HOOKS = Nested("hook", many=True, most=MAX_COMMANDS)  # as many as a reset records
MEMORY = size(0, "1TiB")  # GPU memory is under 300 GB today: past 1 TiB is a typo
INTERVAL = duration("100ms", "1h")  # a scenario's interval too (sim/scenario.py)
HOOK_COMMAND = argv(HOOK_PLACEHOLDERS)  # also a hook written as a bare list (config/schema.py)

# --- the table ----------------------------------------------------------------------------------


def section_of(
    name: str,
    cls: type,
    table: Mapping[str, Value | Nested],
    *,
    yaml_names: Mapping[str, str] | None = None,
    missing: Mapping[str, str] | None = None,
    flattened: Sequence[Key] = (),
    extra: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
) -> Section:
    """The section of ``cls``: one key per dataclass field, in ``table``'s order, with the
    ``flattened`` sections' keys; ``skip``: fields that are not configuration. TypeError (at
    import) when ``table`` and the dataclass's fields differ."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    flat = {name for name, value in table.items() if isinstance(value, Nested) and value.flatten}
    covered = (set(table) - flat) | {key.field for key in flattened if key.field} | set(skip)
    if covered != set(fields):
        raise TypeError(f"key table of {cls.__name__} out of step: {sorted(covered ^ set(fields))}")
    keys = []
    for field_name, value in table.items():
        if field_name in flat:
            keys.append(Key(field_name, None, value))
            continue
        spec = fields[field_name]
        required = spec.default is spec.default_factory is dataclasses.MISSING
        yaml_name = (yaml_names or {}).get(field_name, field_name)
        keys.append(
            Key(yaml_name, field_name, value, required, (missing or {}).get(field_name, ""))
        )
    return Section(name, cls, tuple(keys), extra)


_LOG_FORMAT = Key("format", "log_format", one_of(LOG_FORMATS))

SECTIONS: dict[str, Section] = {
    section.name: section
    for section in (
        section_of(
            "",
            Policy,
            {
                "interval": INTERVAL,
                "dry_run": BOOL,
                "state_dir": ABS_PATH,
                "devices_dir": ABS_PATH,
                "mig_minors_file": ABS_PATH,
                "proc_root": ABS_PATH,
                "device_major": count(0, 4095),
                "namespace_check": BOOL,
                # Waited for on the main loop: well under the unit's WatchdogSec=30s.
                "nvml_timeout": duration("1s", "20s"),
                "full_scan_interval": duration("1s", "1h"),
                "full_scan_backstop": duration("1m", "1d"),
                "log": Nested("log", flatten=True),
                "protect": Nested("protect"),
                "rules": Nested("rules[]", many=True),
                "reset": Nested("reset"),
                "health": Nested("health"),
                "limits": Nested("limits"),
                "detection": Nested("detection"),
                "on_failure": HOOKS,
                "on_action": HOOKS,
                "metrics": Nested("metrics"),
            },
            flattened=(_LOG_FORMAT,),
            skip=("sources",),  # where the policy was read from, not a setting
        ),
        Section("log", Policy, (_LOG_FORMAT,)),
        section_of(
            "protect",
            Protect,
            {
                "commands": REGEXES,
                "users": STRINGS,
                "units": STRINGS,
                "cgroups": STRINGS,
                "gpus": list_of(Value(_read_gpu_id, _same)),
            },
        ),
        section_of(
            "rules[]",
            Rule,
            {
                "name": STRING,
                "kind": Value(_read_kind, lambda kind: kind.value),
                "for_": duration(0, "7d"),
                "min_memory": optional(MEMORY),
                "users": STRINGS,
                "commands": REGEXES,
                "cgroups": STRINGS,
                "units": STRINGS,
                "jobs": STRINGS,
                "steps": Nested("steps[]", many=True),
            },
            yaml_names={"for_": "for"},
            extra=("enabled",),
        ),
        section_of(
            "steps[]",
            Step,
            {"signal": Value(_read_signal, _same), "wait": duration(0, "1d")},
            missing={"signal": " (null for report-only)"},
        ),
        section_of(
            "hook",
            Hook,
            {"argv": HOOK_COMMAND, "timeout": duration("1s", MAX_HOOK_TIMEOUT)},
            yaml_names={"argv": "command"},
        ),
        section_of(
            "reset",
            ResetPolicy,
            {
                "enabled": BOOL,
                "command": argv(one_gpu=True),
                "confirm_for": duration(0, "7d"),
                "timeout": duration("1s", "10m"),
                "drain": RESET_HOOKS,
                "before": RESET_HOOKS,
                "after": RESET_HOOKS,
                "toggle_persistence": BOOL,
                "persistence_command": argv((*GPU_PLACEHOLDERS, "mode"), one_gpu=True),
                "health_command": argv(one_gpu=True),
                "max_resets": count(0, 100),
                "window": duration("1m", "7d"),
                "cooldown": duration(0, "7d"),
                "max_failures": count(1, 100),
                "allow_mig": BOOL,
                "mig_recovery": BOOL,
                "mig_recovery_commands": list_of(
                    argv(MIG_PLACEHOLDERS, one_gpu=True),
                    empty="expected at least one command (a list of argv lists)",
                    most=MAX_COMMANDS,
                ),
                "allow_nvlink_group": BOOL,
                # Waited for with the watchdog fed, like the reset command itself.
                "fabric_timeout": duration("1s", "30m"),
                "monitors": Nested("monitors[]", many=True, most=MAX_MONITORS),
            },
        ),
        section_of("monitors[]", Monitor, {"unit": optional(STRING), "command": optional(REGEX)}),
        section_of(
            "health",
            HealthPolicy,
            {
                "enabled": BOOL,
                "action": one_of(HEALTH_ACTIONS),
                "drain_timeout": duration("1m", "7d"),
                "device_isolation": BOOL,
                "xid_63": one_of(XID_63_CHOICES),
                "xid_94": one_of(XID_94_CHOICES),
                "fabric_stuck_after": duration("1m", "1d"),
                "kernel_log": KERNEL_LOG,  # journal, off, or a file in /dev/kmsg's format
            },
        ),
        section_of(
            "limits",
            Limits,
            {
                "max_signalled_per_poll": count(0, 1000),
                "max_signalled_per_hour": count(0, 10000),
                "node_max_signalled_per_hour": count(0, 100000),
                "kill_cap_latch": duration("1m", "7d"),
                "post_action_delay": duration(0, "1h"),
                "max_pause": duration("1m", "7d"),
                "max_spare": duration("1m", "7d"),
            },
        ),
        section_of("metrics", MetricsPolicy, {"textfile": Value(_read_textfile, _same)}),
        section_of(
            "detection",
            Detection,
            {
                "ghost_margin": MEMORY,
                "default_baseline": MEMORY,
                "unaccounted_margin": MEMORY,
                "pid_trust_min_unresolved": count(1, 1000),
                "orphans_without_history": BOOL,
            },
        ),
    )
}
