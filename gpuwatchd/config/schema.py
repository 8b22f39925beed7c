"""Reading the YAML policy: load, merge drop-ins, validate strictly, render back.

This module owns the policy *file format*: durations and sizes with units, the schema and its
error messages (file, line, key path, "did you mean"), drop-in merge order and semantics, the
StrictModes permission check, and the one-GPU rule for reset commands. It turns text into the
frozen :class:`gpuwatchd.decide.policy.Policy` and back. It must not decide anything about processes
or GPUs and must not run commands; its only I/O is reading the config files and ``stat``.
The key names and merge rules are documented in ``docs/policy.md``; keep the two in step.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import stat
import string
from collections.abc import Callable, Sequence
from typing import TypeVar

import yaml

from gpuwatchd.config.yamlsrc import ConfigError, Map, Node, Scalar, Seq, join_key, load_document
from gpuwatchd.decide.policy import (
    DEFAULT_CONFIG_PATH,
    Detection,
    Hook,
    Limits,
    Policy,
    Protect,
    ResetPolicy,
    Rule,
    Step,
    default_rules,
)
from gpuwatchd.model import FindingKind

__all__ = [
    "GPU_PLACEHOLDERS",
    "SIGNAL_NAMES",
    "ConfigError",
    "check_config_permissions",
    "default_policy",
    "load_policy",
    "normalize_gpu_id",
    "parse_duration",
    "parse_policy_documents",
    "parse_size",
    "render_policy",
    "validate_reset_command",
]

T = TypeVar("T")

# Placeholders the reset command and hooks may use; the actor fills them for the GPU at hand.
GPU_PLACEHOLDERS = ("uuid", "pci_bus_id", "minor")
SIGNAL_NAMES = ("SIGTERM", "SIGKILL", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT")
LOG_FORMATS = ("logfmt", "json", "console")
# Kinds a rule may send signals for. The others are report-only or handled by the reset.
SIGNALLABLE_KINDS = (FindingKind.ORPHANED, FindingKind.ABANDONED)
_WHY_NOT_SIGNALLABLE = {
    FindingKind.DEAD_PROCESS: "a dead process cannot be signalled",
    FindingKind.ZOMBIE: "zombies are never signalled (their parent must reap them)",
    FindingKind.STUCK: "a process in uninterruptible sleep (D) cannot be killed; "
    "the on_failure hooks run for it",
    FindingKind.HIDDEN_HOLDER: "hidden holders are report-only",
    FindingKind.GHOST_MEMORY: "ghost memory is freed by the GPU reset; tune it under 'reset'",
    FindingKind.UNACCOUNTED_MEMORY: "unaccounted memory is report-only; "
    "the processes behind it are found as their own kinds",
}
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "csh", "tcsh", "fish", "busybox"})

# --- messages ---------------------------------------------------------------------------------


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    same_letters = [choice for choice in choices if choice.lower() == word.lower()]
    close = same_letters or difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --- durations and sizes ----------------------------------------------------------------------

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_SIZE_UNITS = {
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
    "kB": 1000,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]+)")


def parse_duration(value: object, *, where: str) -> float:
    """A duration in seconds from ``30s``, ``500ms``, ``5m``, ``2h``, ``1d`` or ``1h30m``.

    A bare number (int or float) means seconds. Negative, non-finite, boolean and unit-less
    strings are errors (``ConfigError`` with ``key=where``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"expected a duration such as '30s', got {_describe(value)}", key=where)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        if not text or _DURATION_PART.sub("", text) != "":
            raise ConfigError(
                f"invalid duration {value!r} (use a number with a unit: ms, s, m, h, d; "
                "e.g. '500ms', '30s', '1h30m')",
                key=where,
            )
        seconds = sum(
            float(number) * _DURATION_UNITS[unit] for number, unit in _DURATION_PART.findall(text)
        )
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"duration must be a finite value >= 0, got {value!r}", key=where)
    return seconds


def parse_size(value: object, *, where: str) -> int:
    """A size in bytes from ``256MiB``, ``1GiB``, ``512KiB`` or ``100MB`` (decimal units).

    A bare integer means bytes. The result must be a whole number of bytes, >= 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"expected a size such as '256MiB', got {_describe(value)}", key=where)
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.fullmatch(value.strip())
        unit = match.group(2) if match else ""
        if match is None or unit not in _SIZE_UNITS:
            hint = _did_you_mean(unit, list(_SIZE_UNITS)) if unit else ""
            raise ConfigError(
                f"invalid size {value!r}{hint} (units: B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)",
                key=where,
            )
        exact = float(match.group(1)) * _SIZE_UNITS[unit]
        if exact != int(exact):
            raise ConfigError(f"size {value!r} is not a whole number of bytes", key=where)
        size = int(exact)
    if size < 0:
        raise ConfigError(f"size must be >= 0, got {value!r}", key=where)
    return size


def format_duration(seconds: float) -> str:
    """The shortest unit spelling that parses back to exactly ``seconds``."""
    for unit in ("d", "h", "m", "s", "ms"):
        count = seconds / _DURATION_UNITS[unit]
        if count == int(count) and parse_duration(f"{int(count)}{unit}", where="") == seconds:
            return f"{int(count)}{unit}"
    return f"{seconds!r}s"


def format_size(size: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size and size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit}"
    return f"{size}B"


def _describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return f"{type(value).__name__} {value!r}"


# --- GPU ids and reset commands ---------------------------------------------------------------

_UUID = re.compile(r"(?i:GPU)-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
_BUS_ID = re.compile(r"(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")


def normalize_gpu_id(text: str) -> str:
    """A GPU UUID or PCI bus id in NVML's spelling (``GPU-`` + lower-case hex; bus id with an
    8-digit domain, upper-case, as ``00000000:3B:00.0``). Raises ValueError for anything else,
    indices included: an index is not a stable name for a GPU.
    """
    text = text.strip()
    if _UUID.fullmatch(text):
        return "GPU-" + text[4:].lower()
    if _BUS_ID.fullmatch(text):
        parts = text.upper().split(":")
        domain = parts[0] if len(parts) == 3 else "0"
        return f"{int(domain, 16):08X}:{parts[-2]}:{parts[-1]}"
    raise ValueError(f"{text!r} is neither a GPU UUID (GPU-...) nor a PCI bus id (0000:3b:00.0)")


def _placeholders(arg: str, allowed: Sequence[str], where: str) -> list[str]:
    try:
        parsed = list(string.Formatter().parse(arg))
    except ValueError as err:
        raise ConfigError(
            f"bad braces in {arg!r}: {err} (write '{{{{' for a brace)", key=where
        ) from None
    names = []
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in allowed or spec or conversion:
            raise ConfigError(
                f"unknown placeholder {{{name}}} in {arg!r}{_did_you_mean(name, allowed)}; "
                f"allowed: {', '.join('{' + p + '}' for p in allowed)}",
                key=where,
            )
        names.append(name)
    return names


def _check_argv(argv: object, where: str, allowed: Sequence[str]) -> tuple[str, ...]:
    if isinstance(argv, str) or not isinstance(argv, (list, tuple)):
        raise ConfigError(
            f"expected an argv list such as ['nvidia-smi', '--gpu-reset', '-i', '{{uuid}}'], "
            f"got {_describe(argv)} (commands run without a shell)",
            key=where,
        )
    if not argv:
        raise ConfigError("the command is empty", key=where)
    for arg in argv:
        if not isinstance(arg, str):
            raise ConfigError(f"every argument must be a string, got {_describe(arg)}", key=where)
        _placeholders(arg, allowed, where)
    if os.path.basename(argv[0]) in _SHELLS:
        raise ConfigError(
            f"{argv[0]!r} is a shell; give the command itself as an argv list "
            "(a shell hides what the command does)",
            key=where,
        )
    return tuple(argv)


def validate_reset_command(
    argv: Sequence[str], *, require_placeholder: bool = False, where: str = "reset.command"
) -> None:
    """Raise ConfigError unless ``argv`` names exactly one GPU, by UUID or PCI bus id.

    The GPU may be named by ``{uuid}`` / ``{pci_bus_id}`` or by a literal UUID or bus id
    (``require_placeholder`` refuses literals, as the policy's ``reset.command`` does: a fixed
    GPU would be reset whichever GPU holds the ghost memory). Refused: a string instead of a
    list, a shell, no GPU, two GPUs (also a comma list), and any GPU index — ``{minor}`` as the
    selector or ``-i 0``. For ``nvidia-smi`` the GPU must be the value of ``-i``/``--id``,
    because without ``-i`` it resets every GPU.
    """
    _validate_one_gpu(argv, GPU_PLACEHOLDERS, require_placeholder, where)


def _validate_one_gpu(
    argv: Sequence[str], allowed: Sequence[str], require_placeholder: bool, where: str
) -> None:
    args = _check_argv(argv, where, allowed)
    selectors: list[int] = []
    for position, arg in enumerate(args):
        names = _placeholders(arg, allowed, where)
        count = sum(name in ("uuid", "pci_bus_id") for name in names)
        if not require_placeholder:
            count += len(_UUID.findall(arg))
            count += len(_BUS_ID.findall(_UUID.sub("", arg)))
        if count and ("minor" in names or "," in arg):
            raise ConfigError(
                f"argument {arg!r} names more than one GPU or mixes in an index", key=where
            )
        selectors.extend([position] * count)
    for position, arg in enumerate(args[:-1]):
        value = args[position + 1]
        if arg in ("-i", "--id") and (value.strip().isdigit() or "{minor}" in value):
            raise ConfigError(
                f"'{arg} {value}' selects a GPU by index; indices change across resets and "
                "reboots: use {uuid} or {pci_bus_id}",
                key=where,
            )
    if len(selectors) != 1:
        found = "no GPU" if not selectors else f"{len(selectors)} GPUs"
        raise ConfigError(
            f"the reset command must name exactly one GPU by {{uuid}} or {{pci_bus_id}}; "
            f"it names {found}",
            key=where,
        )
    if any(os.path.basename(arg) == "nvidia-smi" for arg in args):
        position = selectors[0]
        previous = args[position - 1] if position > 0 else ""
        if previous not in ("-i", "--id") and not args[position].startswith("--id="):
            raise ConfigError(
                "nvidia-smi must get the GPU through '-i' (without -i it resets every GPU)",
                key=where,
            )


# --- merging drop-ins -------------------------------------------------------------------------


def _rule_name(node: Node) -> str | None:
    if isinstance(node, Map):
        name = node.entries.get("name")
        if isinstance(name, Scalar) and isinstance(name.value, str):
            return name.value
    return None


def _named_rules(seq: Seq, problems: list[ConfigError]) -> list[tuple[str | None, Node]]:
    seen: dict[str, Node] = {}
    named: list[tuple[str | None, Node]] = []
    for item in seq.items:
        name = _rule_name(item)
        if name is not None and name in seen:
            problems.append(
                item.error(f"duplicate rule name {name!r} (first at line {seen[name].line})")
            )
            continue
        if name is not None:
            seen[name] = item
        named.append((name, item))
    return named


def _merge_rules(base: Node | None, over: Seq, problems: list[ConfigError]) -> Seq:
    merged = _named_rules(base, problems) if isinstance(base, Seq) else []
    for name, item in _named_rules(over, problems):
        slot = next((i for i, (old, _) in enumerate(merged) if name and old == name), None)
        if slot is None:
            merged.append((name, item))
        else:
            merged[slot] = (name, item)
    return Seq(over.file, over.line, over.path, [item for _, item in merged])


def _merge(base: Map, over: Map, problems: list[ConfigError]) -> Map:
    result = Map(over.file, over.line, over.path, dict(base.entries), dict(base.key_lines))
    for key, new in over.entries.items():
        old = result.entries.get(key)
        if isinstance(new, Scalar) and new.value is None and isinstance(old, Map):
            continue  # an empty section ("reset:") in a drop-in changes nothing
        merged = new
        if isinstance(old, Map) and isinstance(new, Map):
            merged = _merge(old, new, problems)
        elif not over.path and key == "rules" and isinstance(new, Seq):
            merged = _merge_rules(old, new, problems)
        result.entries[key] = merged
        result.key_lines[key] = over.key_lines[key]
    return result


# --- validation -------------------------------------------------------------------------------

_TOP_KEYS = (
    "interval",
    "dry_run",
    "state_dir",
    "devices_dir",
    "proc_root",
    "device_major",
    "namespace_check",
    "nvml_timeout",
    "full_scan_interval",
    "protect",
    "rules",
    "reset",
    "limits",
    "detection",
    "on_failure",
    "log",
)
_SECTION_KEYS: dict[str, tuple[str, ...]] = {
    "": _TOP_KEYS,
    "protect": ("commands", "users", "units", "cgroups", "gpus"),
    "reset": (
        "enabled",
        "command",
        "confirm_for",
        "timeout",
        "drain",
        "before",
        "after",
        "toggle_persistence",
        "persistence_command",
        "health_command",
        "max_resets",
        "window",
        "cooldown",
        "max_failures",
        "allow_mig",
        "allow_nvlink_group",
    ),
    "limits": ("max_signalled_per_poll", "max_signalled_per_hour", "post_action_delay"),
    "detection": (
        "ghost_margin",
        "default_baseline",
        "unaccounted_margin",
        "pid_trust_min_unresolved",
    ),
    "log": ("format",),
    "rules[]": (
        "name",
        "enabled",
        "kind",
        "for",
        "min_memory",
        "users",
        "commands",
        "cgroups",
        "units",
        "jobs",
        "steps",
    ),
    "steps[]": ("signal", "wait"),
    "hook": ("command", "timeout"),
}

Converter = Callable[[Node], T]


class _Section:
    """One mapping of the config being read; collects problems instead of stopping."""

    def __init__(
        self, node: Node | None, section: str, problems: list[ConfigError], path: str
    ) -> None:
        self.problems = problems
        self.path = path
        self.map: Map | None = None
        if isinstance(node, Map):
            self.map = node
        elif node is not None and not (isinstance(node, Scalar) and node.value is None):
            problems.append(node.error(f"expected a mapping, got {_kind_of(node)}"))
        if self.map is not None:
            self._check_keys(section)

    def _check_keys(self, section: str) -> None:
        assert self.map is not None  # noqa: S101 -- only called with a mapping
        allowed = _SECTION_KEYS[section]
        for key, line in self.map.key_lines.items():
            if key in allowed:
                continue
            hint = _did_you_mean(key, allowed)
            if not hint:
                homes = [name for name, keys in _SECTION_KEYS.items() if key in keys and name]
                if homes and not homes[0].endswith("[]") and homes[0] != "hook":
                    hint = f" (it belongs under '{homes[0]}')"
            self.problems.append(
                ConfigError(
                    f"unknown key{hint}",
                    path=self.map.entries[key].file,
                    line=line,
                    key=join_key(self.path, key),
                )
            )

    def node(self, key: str) -> Node | None:
        return None if self.map is None else self.map.entries.get(key)

    def get(self, key: str, convert: Converter[T], default: T) -> T:
        node = self.node(key)
        if node is None:
            return default
        try:
            return convert(node)
        except ConfigError as err:
            for problem in err.problems:
                self.problems.append(
                    problem if problem.path else node.error(problem.message, problem.key)
                )
            return default

    def need(self, key: str, convert: Converter[T]) -> T | None:
        if self.node(key) is None:
            where = self.map if self.map is not None else None
            message = f"missing required key {key!r}"
            if where is not None:
                self.problems.append(where.error(message, key=self.path))
            return None
        return self.get(key, convert, None)


def _kind_of(node: Node) -> str:
    if isinstance(node, Scalar):
        return _describe(node.value)
    return "a list" if isinstance(node, Seq) else "a mapping"


def _scalar(node: Node) -> object:
    if not isinstance(node, Scalar):
        raise node.error(f"expected a single value, got {_kind_of(node)}")
    return node.value


def _bool(node: Node) -> bool:
    value = _scalar(node)
    if not isinstance(value, bool):
        raise node.error(f"expected true or false, got {_describe(value)}")
    return value


def _int(minimum: int, maximum: int | None = None) -> Converter[int]:
    def convert(node: Node) -> int:
        value = _scalar(node)
        if isinstance(value, bool) or not isinstance(value, int):
            raise node.error(f"expected an integer, got {_describe(value)}")
        if value < minimum or (maximum is not None and value > maximum):
            upper = "" if maximum is None else f" and <= {maximum}"
            raise node.error(f"must be >= {minimum}{upper}, got {value}")
        return value

    return convert


def _duration(*, positive: bool = False) -> Converter[float]:
    def convert(node: Node) -> float:
        seconds = parse_duration(_scalar(node), where=node.path)
        if positive and seconds <= 0:
            raise node.error("must be greater than 0")
        return seconds

    return convert


def _size(node: Node) -> int:
    return parse_size(_scalar(node), where=node.path)


def _optional(convert: Converter[T]) -> Converter[T | None]:
    def convert_or_none(node: Node) -> T | None:
        if isinstance(node, Scalar) and node.value is None:
            return None
        return convert(node)

    return convert_or_none


def _string(node: Node) -> str:
    value = _scalar(node)
    if not isinstance(value, str) or not value:
        raise node.error(f"expected a non-empty string, got {_describe(value)}")
    return value


def _abs_path(node: Node) -> str:
    value = _string(node)
    if not value.startswith("/"):
        raise node.error(f"expected an absolute path, got {value!r}")
    return value


def _one_of(choices: Sequence[str]) -> Converter[str]:
    def convert(node: Node) -> str:
        value = _scalar(node)
        if value not in choices:
            hint = _did_you_mean(value, choices) if isinstance(value, str) else ""
            raise node.error(f"expected one of {', '.join(choices)}, got {_describe(value)}{hint}")
        return str(value)

    return convert


def _items(node: Node) -> list[Node]:
    if isinstance(node, Scalar) and node.value is None:
        return []
    if not isinstance(node, Seq):
        raise node.error(f"expected a list, got {_kind_of(node)}")
    return node.items


def _list_of(convert: Converter[T]) -> Converter[tuple[T, ...]]:
    def convert_all(node: Node) -> tuple[T, ...]:
        problems: list[ConfigError] = []
        values: list[T] = []
        for item in _items(node):
            try:
                values.append(convert(item))
            except ConfigError as err:
                problems.extend(p if p.path else item.error(p.message) for p in err.problems)
        if problems:
            raise ConfigError.combine(problems)
        return tuple(values)

    return convert_all


def _regex(node: Node) -> re.Pattern[str]:
    pattern = _string(node)
    try:
        return re.compile(pattern)
    except re.error as err:
        raise node.error(f"invalid regular expression {pattern!r}: {err}") from None


def _gpu_id(node: Node) -> str:
    try:
        return normalize_gpu_id(_string(node))
    except ValueError as err:
        raise node.error(str(err)) from None


def _argv(placeholders: Sequence[str], one_gpu: bool = False) -> Converter[tuple[str, ...]]:
    def convert(node: Node) -> tuple[str, ...]:
        raw: object = node.value if isinstance(node, Scalar) else None
        if isinstance(node, Seq):
            raw = [item.value if isinstance(item, Scalar) else item for item in node.items]
        elif isinstance(node, Map):
            raise node.error(f"expected an argv list, got {_kind_of(node)}")
        argv = _check_argv(raw, node.path, placeholders)
        if one_gpu:
            _validate_one_gpu(argv, placeholders, True, node.path)
        return argv

    return convert


def _hook(node: Node) -> Hook:
    if not isinstance(node, Map):
        return Hook(_argv(GPU_PLACEHOLDERS)(node))
    problems: list[ConfigError] = []
    section = _Section(node, "hook", problems, node.path)
    argv = section.need("command", _argv(GPU_PLACEHOLDERS))
    timeout = section.get("timeout", _duration(positive=True), Hook(()).timeout)
    if problems or argv is None:
        raise ConfigError.combine(problems or [node.error("missing required key 'command'")])
    return Hook(argv, timeout)


def _signal(node: Node) -> str | None:
    value = _scalar(node)
    if value is None:
        return None
    if isinstance(value, str):
        name = value.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in SIGNAL_NAMES:
            return name
    hint = _did_you_mean(str(value).upper(), SIGNAL_NAMES) if isinstance(value, str) else ""
    raise node.error(
        f"expected a signal name ({', '.join(SIGNAL_NAMES)}) or null for report-only, "
        f"got {_describe(value)}{hint}"
    )


def _kind(node: Node) -> FindingKind:
    kinds = [kind.value for kind in FindingKind]
    return FindingKind(_one_of(kinds)(node))


def _step(node: Node) -> Step:
    problems: list[ConfigError] = []
    section = _Section(node, "steps[]", problems, node.path)
    if section.map is None:
        raise ConfigError.combine(problems or [node.error("expected a mapping")])
    if section.node("signal") is None:
        problems.append(node.error("missing required key 'signal' (null for report-only)"))
    signal = section.get("signal", _signal, None)
    if signal is not None and section.node("wait") is None:
        problems.append(node.error("missing required key 'wait' (how long to wait after it)"))
    wait = section.get("wait", _duration(), 0.0)
    if problems:
        raise ConfigError.combine(problems)
    return Step(signal, wait)


def _rule(node: Node, problems: list[ConfigError]) -> Rule | None:
    section = _Section(node, "rules[]", problems, node.path)
    if section.map is None:
        return None
    if not section.get("enabled", _bool, True):
        return None
    before = len(problems)
    name = section.need("name", _string)
    kind = section.need("kind", _kind)
    steps = section.need("steps", _list_of(_step))
    if steps == ():
        problems.append(section.map.error("a rule needs at least one step", key=node.path))
    rule_for = section.get("for", _duration(), 0.0)
    min_memory = section.get("min_memory", _optional(_size), None)
    no_strings: tuple[str, ...] = ()
    users = section.get("users", _list_of(_string), no_strings)
    commands = section.get("commands", _list_of(_regex), Rule.commands)
    cgroups = section.get("cgroups", _list_of(_string), no_strings)
    units = section.get("units", _list_of(_string), no_strings)
    jobs = section.get("jobs", _list_of(_string), no_strings)
    if kind is not None and kind not in SIGNALLABLE_KINDS and steps:
        steps_node = section.node("steps")
        assert isinstance(steps_node, Seq)  # noqa: S101 -- steps parsed, so it is a list
        for step, step_node in zip(steps, steps_node.items, strict=True):
            if step.signal is not None:
                problems.append(
                    step_node.error(
                        f"a '{kind.value}' rule cannot send signals: "
                        f"{_WHY_NOT_SIGNALLABLE[kind]}; use 'signal: null' to report only",
                        key=join_key(step_node.path, "signal"),
                    )
                )
    if len(problems) > before or name is None or kind is None or not steps:
        return None
    return Rule(
        name=name,
        kind=kind,
        steps=steps,
        for_=rule_for,
        min_memory=min_memory,
        users=users,
        commands=commands,
        cgroups=cgroups,
        units=units,
        jobs=jobs,
    )


def _build_policy(root: Map, problems: list[ConfigError], sources: tuple[str, ...]) -> Policy:
    top = _Section(root, "", problems, "")
    base = Policy()
    hooks = _list_of(_hook)

    protect_section = _Section(top.node("protect"), "protect", problems, "protect")
    protect = Protect(
        commands=protect_section.get("commands", _list_of(_regex), ()),
        users=protect_section.get("users", _list_of(_string), ()),
        units=protect_section.get("units", _list_of(_string), ()),
        cgroups=protect_section.get("cgroups", _list_of(_string), ()),
        gpus=protect_section.get("gpus", _list_of(_gpu_id), ()),
    )

    r = _Section(top.node("reset"), "reset", problems, "reset")
    d = ResetPolicy()
    reset = ResetPolicy(
        enabled=r.get("enabled", _bool, d.enabled),
        command=r.get("command", _argv(GPU_PLACEHOLDERS, one_gpu=True), d.command),
        confirm_for=r.get("confirm_for", _duration(), d.confirm_for),
        timeout=r.get("timeout", _duration(positive=True), d.timeout),
        drain=r.get("drain", hooks, d.drain),
        before=r.get("before", hooks, d.before),
        after=r.get("after", hooks, d.after),
        toggle_persistence=r.get("toggle_persistence", _bool, d.toggle_persistence),
        persistence_command=r.get(
            "persistence_command",
            _argv((*GPU_PLACEHOLDERS, "mode"), one_gpu=True),
            d.persistence_command,
        ),
        health_command=r.get(
            "health_command", _argv(GPU_PLACEHOLDERS, one_gpu=True), d.health_command
        ),
        max_resets=r.get("max_resets", _int(0), d.max_resets),
        window=r.get("window", _duration(positive=True), d.window),
        cooldown=r.get("cooldown", _duration(), d.cooldown),
        max_failures=r.get("max_failures", _int(1), d.max_failures),
        allow_mig=r.get("allow_mig", _bool, d.allow_mig),
        allow_nvlink_group=r.get("allow_nvlink_group", _bool, d.allow_nvlink_group),
    )

    lim = _Section(top.node("limits"), "limits", problems, "limits")
    dl = Limits()
    limits = Limits(
        max_signalled_per_poll=lim.get(
            "max_signalled_per_poll", _int(0), dl.max_signalled_per_poll
        ),
        max_signalled_per_hour=lim.get(
            "max_signalled_per_hour", _int(0), dl.max_signalled_per_hour
        ),
        post_action_delay=lim.get("post_action_delay", _duration(), dl.post_action_delay),
    )

    det = _Section(top.node("detection"), "detection", problems, "detection")
    dd = Detection()
    detection = Detection(
        ghost_margin=det.get("ghost_margin", _size, dd.ghost_margin),
        default_baseline=det.get("default_baseline", _size, dd.default_baseline),
        unaccounted_margin=det.get("unaccounted_margin", _size, dd.unaccounted_margin),
        pid_trust_min_unresolved=det.get(
            "pid_trust_min_unresolved", _int(1), dd.pid_trust_min_unresolved
        ),
    )

    log = _Section(top.node("log"), "log", problems, "log")
    rules_node = top.node("rules")
    rules: list[Rule] = []
    if rules_node is not None:
        try:
            for item in _items(rules_node):
                rule = _rule(item, problems)
                if rule is not None:
                    rules.append(rule)
        except ConfigError as err:
            problems.extend(err.problems)

    return Policy(
        interval=top.get("interval", _duration(positive=True), base.interval),
        dry_run=top.get("dry_run", _bool, base.dry_run),
        state_dir=top.get("state_dir", _abs_path, base.state_dir),
        devices_dir=top.get("devices_dir", _abs_path, base.devices_dir),
        proc_root=top.get("proc_root", _abs_path, base.proc_root),
        device_major=top.get("device_major", _int(0, 4095), base.device_major),
        namespace_check=top.get("namespace_check", _bool, base.namespace_check),
        nvml_timeout=top.get("nvml_timeout", _duration(positive=True), base.nvml_timeout),
        full_scan_interval=top.get(
            "full_scan_interval", _duration(positive=True), base.full_scan_interval
        ),
        detection=detection,
        protect=protect,
        rules=tuple(rules),
        reset=reset,
        limits=limits,
        on_failure=top.get("on_failure", hooks, base.on_failure),
        log_format=log.get("format", _one_of(LOG_FORMATS), base.log_format),
        sources=sources,
    )


def parse_policy_documents(docs: Sequence[tuple[str, str]]) -> Policy:
    """The policy from (filename, YAML text) pairs, merged in the order given. Pure.

    Every problem in every document is collected; ConfigError lists them all. An empty
    document is an empty mapping. See ``docs/policy.md`` for the merge rules.
    """
    problems: list[ConfigError] = []
    merged = Map(docs[0][0] if docs else "<none>", 1, "")
    for filename, text in docs:
        try:
            document = load_document(filename, text)
        except ConfigError as err:
            problems.extend(err.problems)
            continue
        merged = _merge(merged, document, problems)
    sources = tuple(name for name, _ in docs)
    policy = _build_policy(merged, problems, sources)
    if problems:
        order = {name: index for index, name in enumerate(sources)}
        problems.sort(key=lambda p: (order.get(p.path or "", -1), p.line or 0))
        raise ConfigError.combine(problems)
    return policy


def default_policy() -> Policy:
    """The policy the shipped ``config/gpuwatchd.yaml`` spells out (a test keeps them equal)."""
    return Policy(rules=default_rules())


# --- rendering --------------------------------------------------------------------------------


def _render_hooks(hooks: Sequence[Hook]) -> list[dict[str, object]]:
    return [{"command": list(h.argv), "timeout": format_duration(h.timeout)} for h in hooks]


def _render_rule(rule: Rule) -> dict[str, object]:
    data: dict[str, object] = {"name": rule.name, "kind": rule.kind.value}
    data["for"] = format_duration(rule.for_)
    if rule.min_memory is not None:
        data["min_memory"] = format_size(rule.min_memory)
    data["users"] = list(rule.users)
    data["commands"] = [pattern.pattern for pattern in rule.commands]
    data["cgroups"] = list(rule.cgroups)
    data["units"] = list(rule.units)
    data["jobs"] = list(rule.jobs)
    data["steps"] = [
        {"signal": step.signal, "wait": format_duration(step.wait)} for step in rule.steps
    ]
    return data


def render_policy(policy: Policy) -> str:
    """The effective policy as YAML, every key spelled out (``check-config`` prints it).

    Parsing the result with :func:`parse_policy_documents` gives back an equal policy (apart
    from ``sources``, which the header comment lists).
    """
    reset = policy.reset
    data: dict[str, object] = {
        "interval": format_duration(policy.interval),
        "dry_run": policy.dry_run,
        "state_dir": policy.state_dir,
        "devices_dir": policy.devices_dir,
        "proc_root": policy.proc_root,
        "device_major": policy.device_major,
        "namespace_check": policy.namespace_check,
        "nvml_timeout": format_duration(policy.nvml_timeout),
        "full_scan_interval": format_duration(policy.full_scan_interval),
        "log": {"format": policy.log_format},
        "protect": {
            "commands": [pattern.pattern for pattern in policy.protect.commands],
            "users": list(policy.protect.users),
            "units": list(policy.protect.units),
            "cgroups": list(policy.protect.cgroups),
            "gpus": list(policy.protect.gpus),
        },
        "rules": [_render_rule(rule) for rule in policy.rules],
        "reset": {
            "enabled": reset.enabled,
            "command": list(reset.command),
            "confirm_for": format_duration(reset.confirm_for),
            "timeout": format_duration(reset.timeout),
            "drain": _render_hooks(reset.drain),
            "before": _render_hooks(reset.before),
            "after": _render_hooks(reset.after),
            "toggle_persistence": reset.toggle_persistence,
            "persistence_command": list(reset.persistence_command),
            "health_command": list(reset.health_command),
            "max_resets": reset.max_resets,
            "window": format_duration(reset.window),
            "cooldown": format_duration(reset.cooldown),
            "max_failures": reset.max_failures,
            "allow_mig": reset.allow_mig,
            "allow_nvlink_group": reset.allow_nvlink_group,
        },
        "limits": {
            "max_signalled_per_poll": policy.limits.max_signalled_per_poll,
            "max_signalled_per_hour": policy.limits.max_signalled_per_hour,
            "post_action_delay": format_duration(policy.limits.post_action_delay),
        },
        "detection": {
            "ghost_margin": format_size(policy.detection.ghost_margin),
            "default_baseline": format_size(policy.detection.default_baseline),
            "unaccounted_margin": format_size(policy.detection.unaccounted_margin),
            "pid_trust_min_unresolved": policy.detection.pid_trust_min_unresolved,
        },
        "on_failure": _render_hooks(policy.on_failure),
    }
    header = "# Effective gpuwatchd policy"
    if policy.sources:
        header += ", merged from:\n" + "".join(f"#   {source}\n" for source in policy.sources)
    else:
        header += " (built-in defaults)\n"
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)
    return header + body


# --- files and permissions --------------------------------------------------------------------


def _ancestors(path: str, trusted_root: str) -> list[str]:
    """The directories above ``path``, nearest first, up to ``trusted_root`` (inclusive)."""
    found = []
    current = os.path.dirname(path)
    while True:
        found.append(current)
        if current == trusted_root or current == os.path.dirname(current):
            return found
        current = os.path.dirname(current)


def _unsafe(path: str, *, allow_sticky: bool) -> ConfigError | None:
    try:
        info = os.stat(path)
    except OSError as err:
        return ConfigError(f"cannot check permissions: {err.strerror}", path=path)
    sticky_root_dir = (
        allow_sticky and stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX
    ) and info.st_uid == 0
    if info.st_uid != 0:
        return ConfigError(
            f"owned by uid {info.st_uid}, not root; gpuwatchd runs the commands its config names "
            f"as root, so only root may control this path. Fix: chown root: {path}",
            path=path,
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_root_dir:
        return ConfigError(
            f"writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}); gpuwatchd runs "
            f"the commands its config names as root. Fix: chmod go-w {path}",
            path=path,
        )
    return None


def check_config_permissions(
    main_file: str, drop_ins: Sequence[str] = (), *, trusted_root: str = "/"
) -> None:
    """StrictModes: refuse config paths that anyone but root could change.

    The main file, its directory, its ``conf.d/`` and every drop-in must be owned by root and
    not writable by group or others. Directories further up (to ``trusted_root``) must be owned
    by root and not writable either, except root-owned sticky directories such as ``/tmp``:
    there nobody else can rename or replace root's entries. Symbolic links are checked along
    both the given and the resolved path. Raises ConfigError listing every unsafe path.
    """
    main_file = os.path.abspath(main_file)
    config_dir = os.path.dirname(main_file)
    conf_d = os.path.join(config_dir, "conf.d")
    strict = [main_file, config_dir, *[os.path.abspath(p) for p in drop_ins]]
    if os.path.isdir(conf_d):
        strict.append(conf_d)
    strict += [os.path.realpath(p) for p in strict]
    trusted = os.path.abspath(trusted_root)
    loose = [d for p in strict for d in _ancestors(p, trusted)]
    problems: list[ConfigError] = []
    checked: set[str] = set()
    for path, allow_sticky in [(p, False) for p in strict] + [(p, True) for p in loose]:
        if path in checked:
            continue
        checked.add(path)
        problem = _unsafe(path, allow_sticky=allow_sticky and path not in strict)
        if problem is not None:
            problems.append(problem)
    if problems:
        raise ConfigError.combine(problems)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        raise ConfigError(
            "configuration file not found (the shipped example is config/gpuwatchd.yaml)",
            path=path,
        ) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"not UTF-8 text: {err.reason}", path=path) from None
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror}", path=path) from None


def find_drop_ins(main_file: str) -> list[str]:
    """The drop-ins beside ``main_file``: ``conf.d/*.yaml`` (no hidden files), in name order."""
    conf_d = os.path.join(os.path.dirname(os.path.abspath(main_file)), "conf.d")
    try:
        names = sorted(os.listdir(conf_d))
    except FileNotFoundError:
        return []
    except OSError as err:
        raise ConfigError(f"cannot list drop-ins: {err.strerror}", path=conf_d) from None
    return [
        os.path.join(conf_d, name)
        for name in names
        if name.endswith(".yaml")
        and not name.startswith(".")
        and os.path.isfile(os.path.join(conf_d, name))
    ]


def load_policy(
    path: str = DEFAULT_CONFIG_PATH,
    *,
    check_permissions: bool | None = None,
    trusted_root: str = "/",
) -> Policy:
    """Read ``path`` and the drop-ins in ``conf.d/`` beside it, merge, validate, return.

    ``check_permissions`` (StrictModes) defaults to on when running as root. A missing main
    file is a ConfigError ("not found"); what to do then is the caller's decision.
    """
    if check_permissions is None:
        check_permissions = os.geteuid() == 0
    if not os.path.exists(path):
        _read(path)  # raises the "not found" error
    drop_ins = find_drop_ins(path)
    if check_permissions:
        check_config_permissions(path, drop_ins, trusted_root=trusted_root)
    return parse_policy_documents([(name, _read(name)) for name in [path, *drop_ins]])
