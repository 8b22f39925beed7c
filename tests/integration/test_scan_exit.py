"""A ``gpuwatchd scan`` process ends without the interpreter's last walk over its objects.

At exit CPython runs one more cycle collection over every object still alive, the imports'
classes and functions included (~10 ms of a scan); a scan freezes them first
(:func:`gc.freeze` at exit), so that pass has next to nothing to walk. The run starts no
processes besides gpuwatchd, so it needs no PID namespace. A structural property, never a
timing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.support.fakenvml import gpu
from tests.support.simhost import SimHost

# Runs the command line as `python -m gpuwatchd` would. Its own exit handler is registered
# before main(), so it runs after any main() registers (last in, first out): it writes how
# many objects were frozen by then to the descriptor named by the first argument.
_PROBE = """
import atexit, gc, json, os, sys
out = int(sys.argv[1])
def report():
    with os.fdopen(out, "w") as handle:
        json.dump({"frozen": gc.get_freeze_count()}, handle)
atexit.register(report)
from gpuwatchd.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def _frozen_at_exit(host: SimHost, *argv: str) -> tuple[int, int, str]:
    """(exit code, objects frozen when the process exited, stdout) of one command."""
    read, write = os.pipe()
    try:
        proc = host.run([sys.executable, "-c", _PROBE, str(write), *argv], pass_fds=(write,))
        os.close(write)
        write = -1
        with os.fdopen(read) as handle:
            read = -1
            frozen = int(json.loads(handle.read())["frozen"])
    finally:
        for fd in (read, write):
            if fd >= 0:
                os.close(fd)
    return proc.returncode, frozen, proc.stdout


def test_a_scan_freezes_its_objects_before_the_interpreter_exits(tmp_path: Path) -> None:
    """The report is complete and the exit is clean; the objects were frozen by then (a
    command that does not freeze, ``check-config``, leaves none frozen: the probe can tell)."""
    host = SimHost(tmp_path, gpus=1)
    host.nvml([gpu(0)])
    config = str(host.config())
    code, frozen, stdout = _frozen_at_exit(host, "--config", config, "scan", "--json")
    assert code in (0, 77)  # 77: not root, some processes unreadable (the report says so)
    assert [g["index"] for g in json.loads(stdout)["gpus"]] == [0]
    assert frozen > 10_000
    code, frozen, _ = _frozen_at_exit(host, "check-config", "-q", config)
    assert (code, frozen) == (0, 0)
