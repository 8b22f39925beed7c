"""The accepted policy kept compiled in ``state_dir``, so that ``scan`` need not parse YAML.

In detail: docs/internals.md, section `gpuwatchd.state.compiled_policy`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import stat
from collections.abc import Callable
from typing import Any

from gpuwatchd.config.peek import ancestors, conf_d, drop_in_names, guess_state_dir
from gpuwatchd.core.checked import flag, items, text
from gpuwatchd.core.codec import Format
from gpuwatchd.decide import policy as policy_module
from gpuwatchd.decide.policy import Policy
from gpuwatchd.state.directory import StateDir

COMPILED_FILE = "policy.compiled.json"
VERSION = 1
MAX_BYTES = 4 << 20
MAX_DEPTH = 16
COMPILED = Format(
    "compiled policy",
    MAX_BYTES,
    version=VERSION,
    fields={"main_file": text, "strict": flag, "identity": items},  # "policy": decode()
)
# The types a compiled policy may name: the policy's own dataclasses and enums, nothing else.
_TYPES: dict[str, type] = {
    name: value
    for name, value in vars(policy_module).items()
    if isinstance(value, type)
    and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
    and value is not enum.Enum
}


# --- the typed JSON form ------------------------------------------------------------------------


def encode(value: object) -> object:
    """``value`` (a policy, or any part of one) as JSON-able data; TypeError for a type this
    form does not carry."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return {"$enum": type(value).__name__, "value": encode(value.value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"$class": type(value).__name__, "fields": fields}
    if isinstance(value, tuple):
        return {"$tuple": [encode(item) for item in value]}
    if isinstance(value, re.Pattern):
        return {"$re": value.pattern, "flags": value.flags}
    raise TypeError(f"a compiled policy cannot carry {type(value).__name__}")


def decode(data: object, depth: int = 0) -> Any:
    """What :func:`encode` made; ValueError naming what is wrong (never another error)."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"unexpected {type(data).__name__}")
    if "$tuple" in data:
        items = data["$tuple"]
        if not isinstance(items, list):
            raise ValueError("a tuple is not a list")
        return tuple(decode(item, depth + 1) for item in items)
    if "$re" in data:
        pattern, flags = data["$re"], data.get("flags")
        if not isinstance(pattern, str) or isinstance(flags, bool) or not isinstance(flags, int):
            raise ValueError("a bad pattern")
        try:
            return re.compile(pattern, flags)
        except (re.error, ValueError, OverflowError) as err:
            raise ValueError(f"a bad pattern: {err}") from None
    kind = data.get("$enum", data.get("$class"))
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"not a type of the policy: {str(kind)[:40]!r}")
    if "$enum" in data:
        if not issubclass(cls, enum.Enum):
            raise ValueError(f"{kind} is not an enum")
        try:
            return cls(decode(data.get("value"), depth + 1))
        except ValueError:
            raise ValueError(f"not a {kind}") from None
    fields = data.get("fields")
    if not dataclasses.is_dataclass(cls) or not isinstance(fields, dict):
        raise ValueError(f"{kind} without fields")
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(fields) != known:
        raise ValueError(f"{kind}: fields differ from this version's")
    try:
        return cls(**{name: decode(value, depth + 1) for name, value in fields.items()})
    except TypeError as err:
        raise ValueError(f"{kind}: {err}") from None


# --- which files, unchanged ---------------------------------------------------------------------


def _stat_entry(path: str, *, content: bool = False) -> list[int] | None:
    """The identity of ``path`` (None: it does not exist; docs/internals.md), with its size
    and times when ``content``; OSError for a link or a failure."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise OSError(f"{path} is a symbolic link")
    entry = [st.st_dev, st.st_ino, st.st_mode, st.st_uid, st.st_gid]
    return [*entry, st.st_size, st.st_mtime_ns, st.st_ctime_ns] if content else entry


def identity(main_file: str) -> list[list[object]] | None:
    """[path, identity] of the main file, every folder above it, ``conf.d/`` (null when
    absent) and each drop-in; None (no shortcut) when any is a link or cannot be looked at, or
    the main file or a drop-in is not a regular file."""
    main = os.path.abspath(main_file)
    folder = conf_d(main)
    try:
        files = [(main, _stat_entry(main, content=True))]
        found = files + [(path, _stat_entry(path)) for path in ancestors(main)]
        found.append((folder, conf := _stat_entry(folder)))
        if conf is not None:
            drop_ins = [os.path.join(folder, name) for name in drop_in_names(folder)]
            files += [(path, _stat_entry(path, content=True)) for path in drop_ins]
            found += files[1:]
    except OSError:
        return None
    if found[1][1] is None or any(e is None or not stat.S_ISREG(e[2]) for _, e in files):
        return None
    return [[path, entry] for path, entry in found]


# --- the daemon's side --------------------------------------------------------------------------


def save_compiled(
    state_dir: StateDir, main_file: str, load: Callable[[str], Policy], *, strict: bool
) -> bool:
    """Write the compiled policy of ``main_file`` (read by ``load``, with StrictModes when
    ``strict``) into ``state_dir`` when it may stand for the files (docs/internals.md), else
    remove a stale one; True when written. OSError from the write."""
    before = identity(main_file)
    doc: dict[str, object] | None = None
    try:
        policy = None if before is None else load(main_file)
        if (
            policy is not None
            and before == identity(main_file)
            and policy.state_dir == state_dir.path
        ):
            doc = COMPILED.envelope(
                {
                    "main_file": os.path.abspath(main_file),
                    "strict": strict,
                    "identity": before,
                    "policy": encode(policy),
                }
            )
            if decode(COMPILED.decode(COMPILED.encode(doc))["policy"]) != policy:
                doc = None
    except Exception:  # any refusal (ConfigError, OSError, a value the form cannot carry): none
        doc = None
    if doc is None:
        state_dir.discard(COMPILED_FILE)
        return False
    state_dir.write(COMPILED_FILE, COMPILED.encode(doc))
    return True


# --- the reader's side --------------------------------------------------------------------------


def load_compiled(main_file: str, default_state_dir: str) -> Policy | None:
    """The compiled policy for ``main_file`` when it may stand for reading the files now,
    else None: the caller then loads the YAML."""
    here = identity(main_file)
    if here is None:
        return None
    folders = dict.fromkeys((guess_state_dir(main_file), default_state_dir))
    found = (_compiled_in(f, main_file, here) for f in folders if f and os.path.isabs(f))
    return next((policy for policy in found if policy is not None), None)


def _compiled_in(folder: str, main_file: str, here: list[list[object]]) -> Policy | None:
    try:
        with StateDir.open(folder) as state_dir:
            raw = state_dir.read(COMPILED_FILE, MAX_BYTES + 1)
        doc = COMPILED.decode(raw)
        if doc["main_file"] != os.path.abspath(main_file) or doc["identity"] != here:
            return None
        if not doc["strict"] and os.geteuid() == 0:
            return None  # written without StrictModes, which this process would check
        policy = decode(doc.get("policy"))
    except (OSError, ValueError, RecursionError):  # RecursionError: a pattern nested too deeply
        return None
    return policy if isinstance(policy, Policy) and policy.state_dir == folder else None
