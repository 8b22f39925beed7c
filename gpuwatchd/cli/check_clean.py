"""``gpuwatchd check-clean``: may these GPUs be handed to the next job? (Slurm prolog)

This module owns the decision of docs/operations.md §4 — one read-only scan, no daemon, no
waiting — as a pure function from a ``scan --json`` report and the GPUs asked about to an exit
code and the lines to print, plus the small I/O edge around it.

A GPU is dirty when any of its findings is actionable, or is of a kind that means memory or a
holder nothing accounts for (:data:`DIRTY_KINDS`), or when NVML reports the GPU lost.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from gpuwatchd.decide.policy import Policy
from gpuwatchd.escape import escape
from gpuwatchd.model import FindingKind
from gpuwatchd.vocabulary import ExitCode

# Not necessarily actionable (a rule may not cover them, or they are report-only), but a GPU
# with any of these must not go to the next job.
DIRTY_KINDS = frozenset(
    {
        FindingKind.GHOST_MEMORY.value,
        FindingKind.ORPHANED.value,
        FindingKind.STUCK.value,
        FindingKind.UNACCOUNTED_MEMORY.value,
        FindingKind.HIDDEN_HOLDER.value,
        # GPU health: the driver asks for a reset or a reboot first.
        FindingKind.RESET_REQUIRED.value,
        FindingKind.REBOOT_REQUIRED.value,
    }
)
EXIT_DIRTY = 1
EXIT_USAGE = 2  # as argparse: a bad argument (an unknown GPU)

_BUS_ID = re.compile(r"^(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])$")


class SelectionError(ValueError):
    """A ``--gpu`` value that names no GPU of this host."""


def _bus_key(text: str) -> tuple[int, int, int, int] | None:
    """``00000000:17:00.0``, ``0000:17:00.0`` and ``17:00.0`` all name the same function."""
    match = _BUS_ID.match(text.strip().lower())
    if match is None:
        return None
    domain, bus, device, function = match.groups()
    return (int(domain or "0", 16), int(bus, 16), int(device, 16), int(function, 16))


def _as_map(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def _as_list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def split_selectors(values: Sequence[str] | None) -> list[str] | None:
    """The ``--gpu`` values, each possibly a comma list (``$CUDA_VISIBLE_DEVICES``); None when
    no ``--gpu`` was given (every GPU). Empty items are dropped, so ``--gpu ""`` selects none."""
    if values is None:
        return None
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def select_gpus(
    gpus: Sequence[Mapping[str, object]], selectors: Sequence[str]
) -> list[Mapping[str, object]]:
    """The GPUs named by ``selectors`` (UUID, PCI bus id or index), in the report's order."""
    chosen: set[int] = set()
    for selector in selectors:
        found = None
        for position, gpu in enumerate(gpus):
            uuid, bus, index = gpu.get("uuid"), gpu.get("pci_bus_id"), gpu.get("index")
            if (
                (isinstance(uuid, str) and uuid.lower() == selector.lower())
                or (selector.isdigit() and isinstance(index, int) and int(selector) == index)
                or (
                    isinstance(bus, str)
                    and _bus_key(selector) is not None
                    and _bus_key(selector) == _bus_key(bus)
                )
            ):
                found = position
                break
        if found is None:
            known = ", ".join(
                f"{gpu.get('index')} {gpu.get('uuid')} {gpu.get('pci_bus_id')}" for gpu in gpus
            )
            raise SelectionError(
                f"--gpu {escape(selector)!r} names no GPU of this host (known: {known or 'none'})"
            )
        chosen.add(found)
    return [gpu for position, gpu in enumerate(gpus) if position in chosen]


def _dirty(finding: Mapping[str, object]) -> bool:
    return finding.get("actionable") is True or finding.get("kind") in DIRTY_KINDS


def _describe(finding: Mapping[str, object]) -> str:
    kind = escape(str(finding.get("kind")))
    reason = escape(str(finding.get("reason") or ""))
    return f"{kind} {reason}".rstrip()


def decide(report: Mapping[str, object], selectors: Sequence[str] | None) -> tuple[int, list[str]]:
    """(exit code, lines for stdout): 0 and no line when every selected GPU is clean; 1 and one
    line per dirty GPU (its first dirty finding, and how many more); SelectionError for a
    selector that names no GPU. ``selectors`` None means every GPU, and then findings on no
    known GPU (a device node NVML does not list) count too."""
    gpus = [_as_map(g) for g in _as_list(report.get("gpus"))]
    findings = [_as_map(f) for f in _as_list(report.get("findings"))]
    selected = gpus if selectors is None else select_gpus(gpus, selectors)
    lines: list[str] = []
    for gpu in selected:
        uuid = gpu.get("uuid")
        why = [_describe(f) for f in findings if f.get("gpu") == uuid and _dirty(f)]
        if gpu.get("lost") is True:
            why.insert(0, f"lost {escape(str(gpu.get('error') or 'NVML reports the GPU lost'))}")
        if why:
            more = f" (and {len(why) - 1} more)" if len(why) > 1 else ""
            lines.append(f"GPU {gpu.get('index')} {escape(str(uuid))}: {why[0]}{more}")
    if selectors is None:
        known = {g.get("uuid") for g in gpus}
        for finding in findings:
            if finding.get("gpu") not in known and _dirty(finding):
                where = escape(str(finding.get("gpu") or "-"))
                lines.append(f"GPU - {where}: {_describe(finding)}")
    return (EXIT_DIRTY if lines else ExitCode.OK), lines


def check_clean(
    policy: Policy, selectors: Sequence[str] | None, *, out: TextIO = sys.stdout
) -> tuple[int, str | None]:
    """Scan once and decide; returns (exit code, a one-line error for stderr or None)."""
    from gpuwatchd.cli.scan import scan_host

    result = scan_host(policy)
    if result.report is None or result.error is not None:
        return ExitCode.UNAVAILABLE, result.error or "NVIDIA driver/NVML not available"
    if result.wedged:
        return ExitCode.UNAVAILABLE, "NVML did not answer within nvml_timeout"
    try:
        code, lines = decide(result.report, selectors)
    except SelectionError as exc:
        return EXIT_USAGE, str(exc)
    for line in lines:
        out.write(line + "\n")
    if code == ExitCode.OK and result.permission_note:
        # An incomplete scan cannot prove a GPU clean.
        return ExitCode.NOPERM, result.permission_note
    return code, None
