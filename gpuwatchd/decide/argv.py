"""The command lines a policy names (reset, persistence, health, hooks): what makes one safe to
run, checked once when the policy is read, and filling one in for a GPU when it runs.

In detail: docs/internals.md, section `gpuwatchd.decide.argv`.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

from gpuwatchd.core.escape import escape

# Placeholders the reset commands and hooks may use; ``mode`` only the persistence command.
GPU_PLACEHOLDERS = ("uuid", "pci_bus_id", "minor")
# Hooks also know the node and, for an action on a process, the user who owned it.
HOOK_PLACEHOLDERS = (*GPU_PLACEHOLDERS, "hostname", "user")
# A MIG recovery command names the parent GPU by its stable names, and the GPU instance.
MIG_PLACEHOLDERS = ("uuid", "pci_bus_id", "gi", "ci", "mig_uuid", "profile", "placement")
# How many a reset records (act/reset_target.py) and so the policy may hold (config/keys.py).
MAX_COMMANDS = 100  # commands, or hooks, in one list
MAX_ARGS = 1000  # arguments of one command
# Characters of one argument with its placeholders filled in (a reset records no longer one):
# bounded when the policy is read from each placeholder's longest value (``_LONGEST``).
MAX_FILLED_CHARS = 8192
# The only stable names of a GPU: an index (``{minor}``, ``-i 0``) changes across resets.
_SELECTOR_PLACEHOLDERS = ("{uuid}", "{pci_bus_id}")

_HEX = "[0-9a-fA-F]"
_UUID_BODY = f"{_HEX}{{8}}(?:-{_HEX}{{4}}){{3}}-{_HEX}{{12}}"
# What NVML reports. MIG devices: ``MIG-<uuid>`` (R470+) or ``MIG-GPU-<uuid>/<gi>/<ci>``.
_VALUE_FORMATS: dict[str, tuple[re.Pattern[str], str]] = {
    "uuid": (
        re.compile(f"(?:GPU|MIG)-{_UUID_BODY}|MIG-GPU-{_UUID_BODY}/[0-9]{{1,3}}/[0-9]{{1,3}}"),
        "an NVML UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, hex; or MIG-...)",
    ),
    "pci_bus_id": (
        re.compile(f"(?:{_HEX}{{4}}|{_HEX}{{8}}):{_HEX}{{2}}:{_HEX}{{2}}\\.[0-7]"),
        "a PCI bus id (domain:bus:device.function in hex, e.g. 00000000:3B:00.0)",
    ),
    "minor": (re.compile("0|[1-9][0-9]{0,2}"), "a device minor number (decimal 0..255)"),
    "mode": (re.compile("[01]"), "a persistence mode (0 or 1)"),
    # RFC 1123 labels, dot-separated: what a scheduler accepts as a node name.
    "hostname": (
        re.compile(
            r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
            r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
        ),
        "a host name (letters, digits, '-' and '.', at most 253 characters, no leading '-')",
    ),
    # What useradd and directory services accept, without a leading '-' (never an option).
    "user": (
        re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}\$?"),
        "a user name (letters, digits, '_', '.', '-', at most 32 characters, no leading '-')",
    ),
    # A MIG GPU instance's recovery (decide/mig/recovery.py): ``{uuid}`` is then its parent's.
    "gi": (re.compile("0|[1-9][0-9]?"), "a GPU instance id (decimal 0..99)"),
    "ci": (re.compile("0|[1-9][0-9]?"), "a compute instance id (decimal 0..99)"),
    "mig_uuid": (
        re.compile(f"MIG-{_UUID_BODY}|MIG-GPU-{_UUID_BODY}/[0-9]{{1,3}}/[0-9]{{1,3}}"),
        "a MIG device UUID (MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, hex)",
    ),
    "profile": (re.compile("0|[1-9][0-9]?"), "a GPU instance profile id (decimal 0..99)"),
    "placement": (re.compile("0|[1-9][0-9]?"), "a placement start slice (decimal 0..99)"),
}
# The longest value of each (``MIG-GPU-`` + 36 + ``/999/999``): what a placeholder can add.
_LONGEST = {"uuid": 52, "mig_uuid": 52, "pci_bus_id": 16, "minor": 3, "mode": 1, "user": 33}
_LONGEST.update(hostname=253, gi=2, ci=2, profile=2, placement=2)
ARGV_PLACEHOLDERS = tuple(_VALUE_FORMATS)
# Literal GPU names as an admin may write them (case-insensitive, bus id domain optional).
LITERAL_UUID = re.compile(f"(?i:GPU)-{_UUID_BODY}")
LITERAL_BUS_ID = re.compile(f"(?:{_HEX}{{4,8}}:)?{_HEX}{{2}}:{_HEX}{{2}}\\.[0-7]")

# A shell hides what the command does: refused anywhere in the argv (behind any launcher too),
# at the cost of a false alarm for an argument that is just "sh" or "su".
_SHELL = re.compile(
    r"(?:sh|ash|bash|dash|zsh|ksh|ksh93|mksh|oksh|pdksh|yash|posh|rbash|csh|tcsh|fish"
    r"|elvish|xonsh|pwsh|busybox|toybox)[0-9.]*"
)
# Programs that hand their argument to a shell, or are a language whose program is inline.
_RUNS_A_SHELL = frozenset({"su", "runuser", "sg", "watch", "script", "ssh"})
_INLINE_ALWAYS = frozenset({"awk", "gawk", "mawk", "nawk", "sed"})


@dataclass(frozen=True)
class _Options:
    """Which options of a launcher or interpreter run a shell string or inline code."""

    letters: str  # in a short option cluster (``-e``, ``-ne``, ``-Ic``)
    long: tuple[str, ...] = ()  # long options, also abbreviated or with ``=value``
    values: str = ""  # short options whose value may be the next argument
    stop: str = ""  # short options after which the rest belongs to the program (python -m)
    positional: int = 0  # operands before a second round of options (flock FILE -c CMD)


_INLINE_OPTIONS: tuple[tuple[re.Pattern[str], _Options], ...] = (
    (re.compile(r"(?:python|pypy)[0-9.]*"), _Options("c", values="WX", stop="m")),
    (re.compile(r"perl[0-9.]*"), _Options("eE", values="I")),
    (re.compile(r"j?ruby[0-9.]*"), _Options("e", values="IrCEF")),
    (re.compile(r"node(?:js)?|bun"), _Options("ep", ("--eval", "--print"), values="r")),
    (re.compile(r"php[0-9.]*"), _Options("rBRE", values="cdfz")),
    (re.compile(r"lua(?:jit)?[0-9.]*|Rscript"), _Options("e", values="l")),
    (re.compile(r"tclsh[0-9.]*|wish[0-9.]*|expect"), _Options("c")),
    (re.compile(r"env"), _Options("S", ("--split-string",), values="uC")),
    (re.compile(r"sudo|doas"), _Options("si", ("--shell", "--login"), values="ugCDhpUrtT")),
    (re.compile(r"flock"), _Options("c", ("--command",), values="wEn", positional=1)),
    (re.compile(r"systemd-run"), _Options("S", ("--shell",), values="pEuHM")),
)


class ArgvError(ValueError):
    """A command line that must not run, and why. ``unknown`` is the unknown placeholder's
    name when that is the reason (the config reader adds a "did you mean" for it)."""

    def __init__(self, message: str, *, unknown: str | None = None) -> None:
        super().__init__(message)
        self.unknown = unknown


# --- placeholders and values --------------------------------------------------------------------


def placeholders_in(arg: str, allowed: Sequence[str] = ARGV_PLACEHOLDERS) -> list[str]:
    """The placeholder names in ``arg``, in order (``{{``/``}}``: literal braces). Raises
    :class:`ArgvError` for unbalanced braces, a name not in ``allowed``, or a format spec or
    conversion (``{uuid:>5}``, ``{uuid!r}``)."""
    try:
        parsed = list(string.Formatter().parse(arg))
    except ValueError as err:
        raise ArgvError(f"bad braces in {arg!r}: {err} (write '{{{{' for a brace)") from None
    names = []
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in allowed or spec or conversion:
            raise ArgvError(
                f"unknown placeholder {{{name}}} in {arg!r}; allowed: "
                + ", ".join("{" + p + "}" for p in allowed),
                unknown=name,
            )
        names.append(name)
    return names


def check_value(name: str, value: str) -> str:
    """``value`` if it is in the documented format of placeholder ``name``, else ValueError."""
    pattern, description = _VALUE_FORMATS[name]
    if pattern.fullmatch(value) is None or (name == "minor" and int(value) > 255):
        raise ValueError(
            f"value {value[:80]!r} for {{{name}}} is not {description}; refusing to run"
        )
    return value


def format_argv(template: Sequence[str], **values: str | None) -> tuple[str, ...]:
    """Fill the placeholders in each argument (``{{``/``}}``: literal braces). ValueError for an
    unknown placeholder, a spec or conversion, a missing or None value, or one not in its
    format (:func:`check_value`); values the template does not use are not checked."""
    for given in values:
        if given not in ARGV_PLACEHOLDERS:
            raise ValueError(f"unknown placeholder value {given!r}")
    result = []
    for arg in template:
        filled: dict[str, str] = {}
        for name in placeholders_in(arg):  # the checks and messages of the config reader
            value = values.get(name)
            if value is None:
                raise ValueError(f"no value for {{{name}}} in {arg!r}")
            filled[name] = check_value(name, value)
        result.append(arg.format_map(filled))  # plain names only: placeholders_in checked
    return tuple(result)


HOOK_VALUE_LIMIT = 1024  # characters of one GPUWATCHD_* value; a longer one is cut


def hook_environment(event: str, **fields: object) -> dict[str, str]:
    """``GPUWATCHD_EVENT=event`` plus ``GPUWATCHD_<FIELD>`` for each field that is not None,
    escaped and cut to HOOK_VALUE_LIMIT characters (docs/internals.md says why)."""
    named = {"event": event, **fields}
    texts = {f"GPUWATCHD_{k.upper()}": escape(str(v)) for k, v in named.items() if v is not None}
    return {
        key: text if len(text) <= HOOK_VALUE_LIMIT else text[: HOOK_VALUE_LIMIT - 3] + "..."
        for key, text in texts.items()
    }


# --- checking a command when the policy is read -------------------------------------------------


def check_command(argv: Sequence[str], allowed: Sequence[str]) -> None:
    """Raise :class:`ArgvError` unless ``argv`` is a command the daemon may run as root: not
    empty, no NUL, known placeholders, and no shell or inline code anywhere (:func:`_shell_in`)."""
    if not argv:
        raise ArgvError("the command is empty")
    for arg in argv:
        if "\0" in arg:
            raise ArgvError(f"argument {arg[:80]!r} contains a NUL character")
    reason = _shell_in(argv)
    if reason is not None:
        raise ArgvError(
            f"{reason}; give the command itself as an argv list "
            "(a shell or inline code hides what the command does)"
        )
    for arg in argv:
        placeholders_in(arg, allowed)
        longest = filled_length(arg)
        if longest > MAX_FILLED_CHARS:
            raise ArgvError(
                f"argument {arg[:80]!r} can grow to {longest} characters when its placeholders"
                f" are filled in; at most {MAX_FILLED_CHARS} (what a reset records)"
            )


def filled_length(arg: str) -> int:
    """The most characters ``arg`` (its placeholders checked) has once filled in: its literal
    text (``{{`` is one brace) and each placeholder's longest value."""
    return sum(
        len(literal) + (0 if name is None else _LONGEST[name])
        for literal, name, _spec, _conversion in string.Formatter().parse(arg)
    )


def check_hook_command(argv: Sequence[str], allowed: Sequence[str] = HOOK_PLACEHOLDERS) -> None:
    """:func:`check_command`, and a hook that runs nvidia-smi is held to the reset command's
    rule (:func:`check_one_gpu`, placeholders only): without ``-i`` it acts on every GPU."""
    check_command(argv, allowed)
    if _runs_nvidia_smi(argv):
        check_one_gpu(argv, allowed, what="a hook that runs nvidia-smi")


def check_one_gpu(
    argv: Sequence[str],
    allowed: Sequence[str] = GPU_PLACEHOLDERS,
    *,
    what: str = "the reset command",
) -> None:
    """Raise :class:`ArgvError` unless ``argv`` names exactly one GPU, once, by ``{uuid}`` or
    ``{pci_bus_id}`` (never a literal one): no index, no comma list, one selector in any
    spelling, and nvidia-smi only with the GPU as its selector."""
    check_command(argv, allowed)
    mentions = 0
    for arg in argv:
        names = placeholders_in(arg)  # check_command refused any name not ``allowed``
        count = sum(f"{{{name}}}" in _SELECTOR_PLACEHOLDERS for name in names)
        if count and ("minor" in names or "," in arg):
            raise ArgvError(f"argument {arg!r} names more than one GPU or mixes in an index")
        mentions += count
    selectors = _selectors(argv)
    for selector in selectors:
        if selector.value is None:
            raise ArgvError(f"'{selector.spelling}' has no value: it must name the GPU")
        if _is_index(selector.value):
            raise ArgvError(
                f"'{selector.spelling}' selects a GPU by index; indices change across resets "
                "and reboots: use {uuid} or {pci_bus_id}"
            )
    if mentions != 1:
        found = "no GPU" if not mentions else f"{mentions} GPUs"
        raise ArgvError(
            f"{what} must name exactly one GPU by {{uuid}} or {{pci_bus_id}}; it names {found}"
        )
    if len(selectors) > 1:
        spellings = ", ".join(f"'{s.spelling}'" for s in selectors)
        raise ArgvError(f"{what} selects a GPU {len(selectors)} times ({spellings}); once only")
    for selector in selectors:
        if selector.value not in _SELECTOR_PLACEHOLDERS:
            raise ArgvError(
                f"'{selector.spelling}' must select the GPU by {{uuid}} or {{pci_bus_id}} "
                "alone, nothing around it"
            )
    if _runs_nvidia_smi(argv) and not selectors:
        raise ArgvError("nvidia-smi must get the GPU through '-i' (without -i it resets every GPU)")


@dataclass(frozen=True)
class _Selector:
    spelling: str  # as written: "-i {uuid}", "-i0", "--id=0"
    value: str | None  # None: "-i" or "--id" as the last argument


def _selectors(argv: Sequence[str]) -> list[_Selector]:
    """Every GPU selector option in ``argv``, in nvidia-smi's spellings, to any program."""
    found = []
    position = 0
    while position < len(argv):
        arg = argv[position]
        if arg in ("-i", "--id"):
            value = argv[position + 1] if position + 1 < len(argv) else None
            found.append(_Selector(f"{arg} {value}" if value is not None else arg, value))
            position += 2
            continue
        if arg.startswith("--id="):
            found.append(_Selector(arg, arg[len("--id=") :]))
        elif arg.startswith("-i") and len(arg) > 2:
            found.append(_Selector(arg, arg[2:].removeprefix("=")))
        position += 1
    return found


def _is_index(value: str) -> bool:
    return "{minor}" in value or any(part.strip().isdigit() for part in value.split(","))


def _basename(arg: str) -> str:
    """The last part of a path, as a program is named (``/usr/bin/env`` -> ``env``)."""
    return arg.rpartition("/")[2]


def _runs_nvidia_smi(argv: Sequence[str]) -> bool:
    return any(_basename(arg) == "nvidia-smi" for arg in argv)


def _shell_in(argv: Sequence[str]) -> str | None:
    """Why ``argv`` runs a shell or inline code (any argument, behind a launcher too), or None."""
    for position, arg in enumerate(argv):
        name = _basename(arg)
        where = f"{arg!r}" if position == 0 else f"argument {position} ({arg!r})"
        if _SHELL.fullmatch(name):
            return f"{where} is a shell"
        if name in _RUNS_A_SHELL:
            return f"{where} runs its argument through a shell"
        if name in _INLINE_ALWAYS:
            return f"{where} runs inline code"
        for pattern, options in _INLINE_OPTIONS:
            if pattern.fullmatch(name):
                flag = _inline_flag(argv[position + 1 :], options)
                if flag is not None:
                    return f"'{arg} {flag}' runs a shell string or inline code"
    return None


def _inline_flag(args: Sequence[str], options: _Options) -> str | None:
    """The option among a program's leading options that runs inline code, or None (where its
    options end: docs/internals.md)."""
    position = 0
    operands = options.positional
    while position < len(args):
        arg = args[position]
        position += 1
        if arg == "--":
            if operands == 0:
                return None
            continue
        if not arg.startswith("-") or arg == "-":
            if operands == 0:
                return None
            operands -= 1
            continue
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            if len(name) >= 3 and any(long.startswith(name) for long in options.long):
                return arg
            if "=" not in arg and position < len(args) and not args[position].startswith("-"):
                position += 1  # perhaps its value
            continue
        for index, letter in enumerate(arg[1:], start=1):
            if letter in options.letters:
                return arg
            if letter in options.stop:
                return None
            if letter in options.values:
                if index == len(arg) - 1:
                    position += 1  # the value is the next argument
                break
    return None
