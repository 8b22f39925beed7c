"""Reading a reset command's result: its exit code and output, as the reset procedure reports them
(the table of exit codes: docs/internals.md, section `gpuwatchd.act.reset`). Pure.
"""

from __future__ import annotations

from gpuwatchd.act.commands import CommandResult
from gpuwatchd.core.vocabulary import ResetResult

REASON_OUTPUT_LIMIT = 2000  # characters of a command's output quoted in a reason

_EXIT_MEANINGS = {
    2: "invalid argument",
    3: "reset is not supported on this GPU",
    4: "no permission to reset (needs root with CAP_SYS_ADMIN)",
    6: "GPU not found",
    8: "GPU power cables not connected",
    9: "NVIDIA driver not loaded",
    10: "GPU interrupt (IRQ) problem",
    12: "NVML library not found",
    13: "function not implemented",
    14: "GPU infoROM corrupted",
    15: "GPU has fallen off the bus or is inaccessible",
}
_IN_USE_MARKERS = ("in use by another client", "currently in use", "being used by")
IN_USE_REASON = (
    "exit 255: the driver says the GPU is in use by another client, which the final holder "
    "scan did not see (a hidden holder: a file descriptor in flight in a unix-socket message, "
    "a holder in another PID namespace or a VM, or a thread whose files could not be read)"
)


def fold_output(output: str) -> str:
    """Output on one line (whitespace folded), its last :data:`REASON_OUTPUT_LIMIT` characters."""
    text = " ".join(output.split())
    if len(text) > REASON_OUTPUT_LIMIT:
        text = "..." + text[-REASON_OUTPUT_LIMIT:]
    return text


def quote_output(output: str) -> str:
    """``; output: '...'`` for a reason, or nothing when there was no output."""
    text = fold_output(output)
    return f"; output: {text!r}" if text else ""


def says_in_use(result: CommandResult) -> bool:
    """The command failed with nvidia-smi's "in use by another client" text."""
    lowered = result.output.lower()
    return not result.ok and any(marker in lowered for marker in _IN_USE_MARKERS)


def interpret_reset_exit(result: CommandResult) -> tuple[ResetResult, bool, str]:
    """``(result, needs_reboot, reason)`` for a finished reset command, its output quoted."""
    output = quote_output(result.output)
    if result.timed_out:
        unkillable = result.returncode is None
        reason = f"reset command did not finish within {result.duration:.1f}s and was killed"
        if unkillable:
            reason += f"; {result.error}: the GPU is probably wedged"
        return ResetResult.TIMEOUT, unkillable, reason + output
    if result.returncode is None:
        return ResetResult.FAILED, False, f"reset command could not run: {result.error}"
    code = result.returncode
    if code == 0:
        return ResetResult.SUCCESS, False, "GPU reset" + output
    if code < 0:
        return ResetResult.FAILED, False, f"reset command was killed by signal {-code}" + output
    if code == 15:
        reason = f"exit 15: {_EXIT_MEANINGS[15]}; the node needs a reboot{output}"
        return ResetResult.FAILED, True, reason
    if code == 255 and says_in_use(result):
        return ResetResult.IN_USE, False, IN_USE_REASON + output
    if code == 255:
        return ResetResult.FAILED, False, "exit 255: nvidia-smi reported an error" + output
    meaning = _EXIT_MEANINGS.get(code, "unexpected exit code")
    return ResetResult.FAILED, False, f"exit {code}: {meaning}" + output
