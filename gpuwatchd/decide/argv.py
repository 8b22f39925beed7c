"""Filling the placeholders of a hook or reset argv, and the environment hooks get.

Pure: no I/O.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

ARGV_PLACEHOLDERS = ("uuid", "pci_bus_id", "minor", "mode")


def format_argv(template: Sequence[str], **values: str | None) -> tuple[str, ...]:
    """Fill ``{uuid}``, ``{pci_bus_id}``, ``{minor}`` and ``{mode}`` in each argument.

    ``{{`` and ``}}`` stand for literal braces. An unknown placeholder, a format spec or
    conversion, or a placeholder whose value is missing or None (unknown) raises ValueError:
    a command is never run with a guessed argument.
    """
    for given in values:
        if given not in ARGV_PLACEHOLDERS:
            raise ValueError(f"unknown placeholder value {given!r}")
    formatter = string.Formatter()
    result = []
    for arg in template:
        pieces: list[str] = []
        try:
            parsed = list(formatter.parse(arg))
        except ValueError as err:
            raise ValueError(f"bad braces in {arg!r}: {err}") from None
        for literal, name, spec, conversion in parsed:
            pieces.append(literal)
            if name is None:
                continue
            if name not in ARGV_PLACEHOLDERS or spec or conversion:
                raise ValueError(
                    f"unknown placeholder {{{name}}} in {arg!r}; allowed: "
                    + ", ".join("{" + p + "}" for p in ARGV_PLACEHOLDERS)
                )
            value = values.get(name)
            if value is None:
                raise ValueError(f"no value for {{{name}}} in {arg!r}")
            pieces.append(value)
        result.append("".join(pieces))
    return tuple(result)


def hook_environment(event: str, **fields: object) -> dict[str, str]:
    """``GPUWATCHD_EVENT=event`` plus ``GPUWATCHD_<FIELD>`` for each field that is not None."""
    env = {"GPUWATCHD_EVENT": event}
    for name, value in fields.items():
        if value is not None:
            env[f"GPUWATCHD_{name.upper()}"] = str(value)
    return env
