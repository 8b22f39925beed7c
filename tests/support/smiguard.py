"""A guard in front of the real ``nvidia-smi`` for the whole test run: no test changes a GPU.

Owns :func:`write_guard` and :func:`install`. ``tests/conftest.py`` calls :func:`install` when
the test run starts: where a real ``nvidia-smi`` is on ``PATH`` (a GPU machine), a script of the
same name is put in front of it, so every test, every daemon a test starts and every command
they run that names plain ``nvidia-smi`` reaches the guard first. The guard refuses (exit 97,
nothing run) any operation that changes a GPU — a reset, persistence mode, MIG mode or MIG
instances, clocks, power, ECC, compute mode, accounting — and hands every other call (the
read-only queries of the ``gpu``-marked tests) to the real program. Where no real
``nvidia-smi`` exists nothing is installed: the tests that need one skip as before, and a
command naming it fails to start.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["REFUSED_EXIT", "install", "write_guard"]

REFUSED_EXIT = 97

_SCRIPT = r"""#!/bin/sh
# Written by tests/support/smiguard.py: a test must never change a GPU.
refuse() {
    echo "tests: refused: nvidia-smi $* (a test must never change a GPU)" >&2
    exit %(refused)d
}
for arg in "$@"; do
    case "$arg" in
    -r | --gpu-reset* | -pm | --persistence-mode* | -mig | --multi-instance-gpu* | \
    -cgi | -dgi | -cci | -dci | --create-gpu-instance* | --destroy-gpu-instance* | \
    --create-compute-instance* | --destroy-compute-instance* | -C | \
    -c | --compute-mode* | -e | --ecc-config* | -p | --reset-ecc-errors* | \
    -pl | --power-limit* | -lgc | -rgc | -lmc | -rmc | -ac | -rac | --lock-* | \
    --reset-*-clocks | --applications-clocks* | -am | --accounting-mode* | -caa | \
    --clear-accounted-apps | -dm | --driver-model* | -fdm | --force-driver-model*)
        refuse "$@" ;;
    esac
done
exec %(real)s "$@"
"""


def write_guard(directory: Path, real: str) -> Path:
    """Write the guard as ``directory/nvidia-smi``, handing allowed calls to ``real``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "nvidia-smi"
    quoted = "'" + real.replace("'", "'\\''") + "'"
    path.write_text(_SCRIPT % {"refused": REFUSED_EXIT, "real": quoted})
    path.chmod(0o755)
    return path


def install() -> Path | None:
    """Put the guard in front of a real ``nvidia-smi`` on this process's ``PATH`` (inherited
    by everything the tests start); its path, or None when there is no real one."""
    real = shutil.which("nvidia-smi")
    if real is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="gpuwatchd-smiguard-"))
    atexit.register(shutil.rmtree, folder, True)
    guard = write_guard(folder, real)
    os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
    return guard
