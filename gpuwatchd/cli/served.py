"""The daemon's answer to a ``scan`` that asked it (docs/scan.md, "Answered by the daemon"):
the report of a scan built on its last poll, with the policy the command would have used, or a
refusal saying why (the command then walks by itself).

In detail: docs/internals.md, section `gpuwatchd.cli.served`.
"""

from __future__ import annotations

import os

from gpuwatchd.cli.scan import scan_host, scan_output
from gpuwatchd.served.guard import ServedPoll
from gpuwatchd.served.scan_socket import ScanAnswer, ScanRequest
from gpuwatchd.state.compiled_policy import load_compiled


def answer(
    request: ScanRequest, config_path: str, state_dir: str, served: ServedPoll | None
) -> ScanAnswer:
    """The daemon's answer to ``request``, or its refusal (module docstring). ``config_path``:
    the main file the daemon was started with; ``state_dir``: the one it runs in; ``served``:
    its last poll (None: none to serve from)."""
    if request.config != os.path.abspath(config_path):
        return ScanAnswer(False, "the daemon runs with another configuration file")
    policy = load_compiled(request.config, state_dir)
    if policy is None:
        return ScanAnswer(False, "the configuration files changed since the daemon accepted them")
    if policy.state_dir != state_dir:
        return ScanAnswer(False, "the configuration names another state_dir")
    if served is None:
        return ScanAnswer(False, "the daemon has no holder view (its device watch is not working)")
    result = scan_host(policy, served=served)
    if result.declined is not None:
        return ScanAnswer(False, result.declined)
    output = scan_output(result, as_json=request.as_json, color=request.color)
    return ScanAnswer(True, "answered", output.exit_code, output.stdout, output.stderr)
