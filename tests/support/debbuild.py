"""The gpuwatchd .deb the packaging and container tests list or install: built once per test
run with packaging/build-deb.sh, shared by every pytest-xdist worker of the run."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def built_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package built from this tree; the first caller builds it (its output shown on a
    failure), the others wait for it under a file lock and take the same file."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's own folder, above each worker's
    out = base / "deb"
    failed = base / "deb-failed.txt"
    with (base / "deb.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.exists():
            pytest.fail(failed.read_text())
        if not list(out.glob("gpuwatchd_*_all.deb")):
            build = subprocess.run(
                [str(REPO / "packaging" / "build-deb.sh"), str(out)],
                capture_output=True,
                text=True,
                check=False,
                timeout=600,
            )
            if build.returncode != 0:
                failed.write_text(
                    f"packaging/build-deb.sh exited {build.returncode}:\n"
                    f"{build.stdout}{build.stderr}"
                )
                pytest.fail(failed.read_text())
    (deb,) = out.glob("gpuwatchd_*_all.deb")
    return deb
