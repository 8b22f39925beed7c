"""The daemon's answer to a ``scan`` that asked it (docs/scan.md, "Answered by the daemon").

The command (:mod:`gpuwatchd.cli.entry`) asks over the daemon's socket
(:mod:`gpuwatchd.served.scan_socket`); the daemon calls :func:`answer` in its own process, between
polls. The answer is what the command would print had it scanned by itself on the served path,
or a refusal saying why, after which the command does exactly that. So the daemon answers only
when the command's own scan would have used the daemon's view and its NVML reading, and with
the policy the command would have used.

In detail: docs/internals.md, section `gpuwatchd.cli.served`.
"""

from __future__ import annotations

import os

from gpuwatchd.cli.scan import scan_host, scan_output
from gpuwatchd.served.scan_socket import ScanAnswer, ScanRequest
from gpuwatchd.state.compiled_policy import load_compiled


def answer(request: ScanRequest, *, config_path: str, state_dir: str) -> ScanAnswer:
    """The daemon's answer to ``request``, or its refusal (module docstring). ``config_path``:
    the main file the daemon was started with; ``state_dir``: the one it runs in."""
    if request.config != os.path.abspath(config_path):
        return ScanAnswer(False, "the daemon runs with another configuration file")
    policy = load_compiled(request.config, state_dir)
    if policy is None:
        return ScanAnswer(False, "the configuration files changed since the daemon accepted them")
    if policy.state_dir != state_dir:
        return ScanAnswer(False, "the configuration names another state_dir")
    result = scan_host(policy, full=False, nvml_from_daemon=True, served_only=True)
    if result.declined is not None:
        return ScanAnswer(False, result.declined)
    output = scan_output(result, as_json=request.as_json, color=request.color)
    return ScanAnswer(True, "answered", output.exit_code, output.stdout, output.stderr)
