"""What each command's ``--help`` says beyond its options: what the command does, and its exit
codes (the man page's EXIT STATUS, per command)."""

from __future__ import annotations

import argparse

# The codes every command shares, added where a command does not list them.
_COMMON_CODES = {2: "a bad argument", 77: "insufficient privilege", 78: "configuration error"}
_SWITCH_CODES = {74: "the switch could not be written (it is unchanged)"}  # pause, resume
COMMAND_HELP: dict[str, tuple[str, dict[int, str]]] = {
    "scan": (
        "One read-only look: every GPU, who holds it and why, and the findings. Answered by a "
        "running daemon when it can, else walked here. Never acts.",
        {
            0: "the report was printed (findings do not change the code)",
            69: "NVML or the driver unavailable, or wedged",
            75: "the report was printed, but the daemon's saved state cannot be read",
        },
    ),
    "run": (
        "The monitoring loop: poll, judge and act by the policy (systemd runs it). With --once, "
        "poll until every finding present at the start has resolved or ended its ladder (a "
        "Slurm epilog).",
        {
            0: "a clean stop; with --once, every finding settled",
            69: "--once: NVML unavailable",
            75: "--once: a GPU not clean at --timeout, or stuck; else another instance runs",
        },
    ),
    "check-clean": (
        "One read-only scan that says whether a new job may have the GPUs (a Slurm prolog): "
        "one line per GPU that is not clean.",
        {
            0: "every GPU asked about is clean",
            1: "one is not",
            2: "a bad argument, or a --gpu that names no GPU of this host",
            69: "NVML unavailable",
            70: "check-clean failed itself (a bug): no answer",
            75: "nothing dirty found, but the daemon's saved state cannot be read",
            77: "nothing dirty found, but some processes could not be inspected",
        },
    ),
    "check-config": (
        "Validate the policy file and its conf.d/ drop-ins, then print the effective policy.",
        {0: "valid", 78: "not valid (the file, key and value are named)"},
    ),
    "simulate": (
        "Play a scenario through the real decision core on a virtual clock: what the policy "
        "would do, step by step. Touches nothing.",
        {0: "played", 65: "a malformed scenario"},
    ),
    "explain": (
        "Say what the policy would do with a saved `scan --json` report, and when.",
        {0: "explained", 65: "a malformed or oversized report"},
    ),
    "pause": (
        "Stop all actions (maintenance) until `resume` or the end of --for; findings are still "
        "reported.",
        {0: "paused", **_SWITCH_CODES},
    ),
    "resume": (
        "Allow actions again; with --clear-latches also lift the kill-cap latches and the reset "
        "circuit breaker.",
        {0: "resumed", **_SWITCH_CODES},
    ),
    "spare": (
        "Leave one process or one job's processes alone for a while: never signalled until the "
        "spare ends. --list shows the spares in force, --cancel ends one.",
        {
            0: "done",
            74: "the spare could not be written",
            78: "no target, a bad target or --for, no --reason, or 64 spares in force: nothing "
            "is spared",
        },
    ),
    "reload": (
        "Check the policy, then make the running daemon reread it (where systemd does not run "
        "it: a Kubernetes pod).",
        {0: "reloaded", 3: "no running daemon found", 69: "no pidfd to signal the daemon with"},
    ),
    "status": (
        "What the daemon is doing, read from its state: mode, NVML, findings, actions under "
        "way, spares, and what needs a person.",
        {
            0: "running, nothing needs attention",
            1: "running, something needs attention",
            3: "not running",
            4: "the state cannot be read",
        },
    ),
}


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps the description as argparse does, keeps the exit-code table's lines as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith(_CODES_HEADING):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


_CODES_HEADING = "exit codes:"


def describe(sub: argparse.ArgumentParser, name: str) -> None:
    """Give a command's --help its description and exit codes (:data:`COMMAND_HELP`)."""
    what, codes = COMMAND_HELP[name]
    table = {**_COMMON_CODES, **codes}
    sub.description = what
    sub.epilog = _CODES_HEADING + "".join(f"\n{c:>4}  {table[c]}" for c in sorted(table))
    sub.formatter_class = _HelpFormatter
