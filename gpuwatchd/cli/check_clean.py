"""``gpuwatchd check-clean``: may these GPUs be handed to the next job? (a Slurm prolog)

One read-only scan judged by :mod:`gpuwatchd.decide.verdict` (never here); this module selects
the GPUs (``--gpu``, ``--slurm-gpus``) and words the answer and its exit code.

In detail: docs/internals.md, section `gpuwatchd.cli.check_clean`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

from gpuwatchd.core.checked import as_list, decimal
from gpuwatchd.core.escape import escape
from gpuwatchd.core.paths import DEFAULT_CONFIG_PATH
from gpuwatchd.core.vocabulary import Cleanliness, ExitCode
from gpuwatchd.decide.gpu_ids import same_pci_bus_id, slurm_numbering
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.verdict import GpuVerdict, NodeVerdict, cannot_tell, describe

EXIT_DIRTY = 1
EXIT_USAGE = 2  # as argparse: a bad argument (an unknown GPU)
EXIT_POLICY = ExitCode.CONFIG  # cannot judge by the policy files: never a reason to drain
EXIT_FAILED = 70  # EX_SOFTWARE: check-clean itself failed (a bug); never 1, which says "dirty"
EXIT_UNREAD = ExitCode.TEMPFAIL  # the daemon's saved state cannot be read: not clean either
# The first stderr line when the files do not validate; the Slurm scripts read its mode.
RUNNING_POLICY = "the policy files do not validate; judged with the policy the daemon runs"


@dataclasses.dataclass(frozen=True)
class Judge:
    """The policy the GPUs are judged with, and why it is not the files' when it is not."""

    policy: Policy | None  # None: nothing to judge with
    problem: str | None = None  # the files' error: they do not validate
    running: str | None = None  # which policy stands in for them (accepted.Fallback.describe)


def files_policy(path: str | None, *, required: bool) -> Policy:
    """The policy of ``path``, else of the default file; a missing default file is the
    built-in policy where ``required`` is False. ConfigError."""
    from gpuwatchd.config.schema import default_policy, load_policy

    chosen = path or DEFAULT_CONFIG_PATH
    if path is None and not required and not os.path.exists(chosen):
        return default_policy()
    return load_policy(chosen)


def judging_policy(config: str | None) -> Judge:
    """The files' policy (``config``, else the default file; none there: the built-in one);
    when they do not validate, the one the daemon runs: its last accepted, or None."""
    from gpuwatchd.config.yamlsrc import ConfigError

    try:
        return Judge(files_policy(config, required=config is not None))
    except ConfigError as exc:
        from gpuwatchd.state.accepted import load_fallback

        fallback = load_fallback(config or DEFAULT_CONFIG_PATH)
        problems = "".join(f"; {p}" for p in fallback.problems)
        return Judge(fallback.policy, str(exc), fallback.describe() + problems)


class SelectionError(ValueError):
    """A ``--gpu`` value that names no GPU of this host."""


def split_selectors(values: Sequence[str] | None) -> list[str] | None:
    """The ``--gpu`` values, each possibly a comma list (``$CUDA_VISIBLE_DEVICES``); None when
    no ``--gpu`` was given (every GPU). Empty items are dropped, so ``--gpu ""`` selects none."""
    if values is None:
        return None
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _names(gpu: GpuVerdict, selector: str) -> bool:
    return (
        gpu.uuid.lower() == selector.lower()
        or decimal(selector, 64) == gpu.index
        or (gpu.pci_bus_id is not None and same_pci_bus_id(selector, gpu.pci_bus_id))
    )


def select_gpus(gpus: Sequence[GpuVerdict], selectors: Sequence[str]) -> list[GpuVerdict]:
    """The GPUs named by ``selectors`` (UUID, PCI bus id or index), in NVML's order."""
    chosen: set[int] = set()
    for selector in selectors:
        found = next((pos for pos, gpu in enumerate(gpus) if _names(gpu, selector)), None)
        if found is None and selector[:4].upper() == "MIG-":
            raise SelectionError(
                f"--gpu {escape(selector)!r} is a MIG device: check-clean judges whole GPUs "
                "(a MIG GPU is dirty when any of its instances is); name its GPU by UUID, "
                "index or PCI bus id (`gpuwatchd scan` lists each instance under its GPU)"
            )
        if found is None:
            known = ", ".join(f"{g.index} {g.uuid} {g.pci_bus_id}" for g in gpus)
            raise SelectionError(
                f"--gpu {escape(selector)!r} names no GPU of this host (known: {known or 'none'})"
            )
        chosen.add(found)
    return [gpu for position, gpu in enumerate(gpus) if position in chosen]


def slurm_selectors(gpus: Sequence[object], ids: Sequence[str], order: str) -> list[str]:
    """The UUIDs of the GPUs Slurm's GPU ids ``ids`` name (``gpus``: the report's GPU entries),
    numbered by ``order`` (:func:`gpuwatchd.decide.gpu_ids.slurm_numbering`). SelectionError for
    an id that is no number or names no GPU, or when the order cannot be told."""
    entries = [g for g in gpus if isinstance(g, dict)]
    by_index = {g.get("index"): str(g.get("uuid")) for g in entries}
    pairs = [
        (g["index"], g.get("minor") if isinstance(g.get("minor"), int) else None)
        for g in entries
        if isinstance(g.get("index"), int)
    ]
    numbered = slurm_numbering(pairs, order)
    if numbered is None:
        raise SelectionError(
            "--slurm-gpus: a GPU's device minor is unknown, so Slurm's numbering by device "
            "file cannot be told"
        )
    chosen: list[str] = []
    for ident in ids:
        number = decimal(ident, 6)
        if number is None:
            raise SelectionError(f"--slurm-gpus {escape(ident)!r} is not a Slurm GPU id")
        if number >= len(numbered):
            raise SelectionError(
                f"--slurm-gpus {ident}: Slurm's GPU id {ident} names no GPU of this host "
                f"({len(numbered)} GPU(s), numbered by {order} order)"
            )
        chosen.append(by_index[numbered[number]])
    return chosen


def answer(
    verdict: NodeVerdict, selectors: Sequence[str] | None
) -> tuple[int, list[str], list[str]]:
    """(exit code, stdout lines, stderr lines) for the GPUs ``selectors`` name (None: every
    GPU): 0 when each is clean, 1 when one is not (a line per such GPU). SelectionError for a
    selector that names no GPU. ``verdict`` must have been judged (``unavailable`` None)."""
    selected = list(verdict.gpus) if selectors is None else select_gpus(verdict.gpus, selectors)
    lines = [escape(describe(gpu)) for gpu in selected if not gpu.clean]
    notes = [
        escape(f"gpuwatchd: GPU {gpu.index} {gpu.uuid}: clean; would block a reset: {b.text}")
        for gpu in selected
        if gpu.clean
        for b in gpu.reset_blockers
    ]
    return (EXIT_DIRTY if lines else ExitCode.OK), lines, notes


def check_clean(
    config: str | None,
    selectors: Sequence[str] | None,
    *,
    slurm: tuple[Sequence[str], str] | None = None,
) -> tuple[int, str | None]:
    """Judge with :func:`judging_policy`'s policy and answer: (exit code, an error for stderr or
    None). ``slurm``: (Slurm GPU ids, order), the GPUs ``--slurm-gpus`` names."""
    judge = judging_policy(config)
    if judge.policy is None:
        return EXIT_POLICY, (
            f"{judge.problem}\n(cannot judge: {judge.running} to judge with instead; "
            "a policy problem drains nothing)"
        )
    if judge.problem is None:
        return _judged(judge.policy, selectors, slurm)
    dry = "true" if judge.policy.dry_run else "false"
    running = escape(str(judge.running))
    print(f"gpuwatchd: {RUNNING_POLICY} (dry_run: {dry}): {running}", file=sys.stderr, flush=True)
    code, error = _judged(judge.policy, selectors, slurm)
    if code in (EXIT_DIRTY, EXIT_USAGE, ExitCode.UNAVAILABLE, EXIT_UNREAD, ExitCode.NOPERM):
        return code, error
    return EXIT_POLICY, (
        f"{judge.problem}\n(no GPU asked about is dirty by the policy the daemon runs; "
        "cannot judge by the files: fix them, `gpuwatchd check-config`)"
    )


def _judged(
    policy: Policy, selectors: Sequence[str] | None, slurm: tuple[Sequence[str], str] | None
) -> tuple[int, str | None]:
    """Scan once (a full walk of ``/proc``) and answer by ``policy``."""
    from gpuwatchd.cli.scan import scan_host

    result = scan_host(policy)
    verdict = result.verdict
    if result.report is None or verdict is None or verdict.unavailable is not None:
        why = result.error or (verdict.unavailable if verdict is not None else None)
        return ExitCode.UNAVAILABLE, why or "NVIDIA driver/NVML not available"
    try:
        if slurm is not None:
            named = slurm_selectors(as_list(result.report.get("gpus")), *slurm)
            selectors = [*(selectors or ()), *named]
        code, lines, notes = answer(verdict, selectors)
    except SelectionError as exc:
        return EXIT_USAGE, str(exc)
    for line in lines:
        print(line)
    for note in notes:
        print(note, file=sys.stderr)
    chosen = verdict.gpus if selectors is None else select_gpus(verdict.gpus, selectors)
    if result.permission_note and not any(g.state is Cleanliness.DIRTY for g in chosen):
        # Not dirty, but an incomplete scan cannot prove a GPU clean: run as root.
        return ExitCode.NOPERM, result.permission_note
    if result.state_unread is not None and chosen and code == ExitCode.OK:
        # A MIG recovery or reset left half done makes its GPU dirty, and only the daemon's
        # saved plan tells it: cannot tell until the daemon writes one this version reads.
        return EXIT_UNREAD, escape(cannot_tell(result.state_unread))
    return code, None
