"""The guard in front of a real ``nvidia-smi`` during the tests (tests/support/smiguard.py):
every operation that changes a GPU is refused before anything runs; queries pass through."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.smiguard import REFUSED_EXIT, write_guard

UUID = "GPU-12345678-1234-1234-1234-123456789abc"


@pytest.fixture
def guard(tmp_path: Path) -> tuple[Path, Path]:
    """The guard, handing what it allows to a stand-in that records its argv."""
    log = tmp_path / "real.log"
    real = tmp_path / "real-nvidia-smi"
    real.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n')
    real.chmod(0o755)
    return write_guard(tmp_path / "guard", str(real)), log


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpu-reset", "-i", UUID],
        ["-r", "-i", UUID],
        ["-i", UUID, "-pm", "0"],
        ["mig", "-i", UUID, "-gi", "1", "-dgi"],
        ["mig", "-i", UUID, "-cgi", "19:1", "-C"],
        ["mig", "-i", UUID, "-gi", "1", "-ci", "0", "-dci"],
        ["-i", "0", "-mig", "1"],
        ["-i", UUID, "-pl", "300"],
        ["-i", UUID, "-c", "EXCLUSIVE_PROCESS"],
        ["-i", UUID, "--lock-gpu-clocks=1000,1000"],
    ],
)
def test_anything_that_changes_a_gpu_is_refused_and_nothing_runs(
    guard: tuple[Path, Path], argv: list[str]
) -> None:
    script, log = guard
    done = subprocess.run([str(script), *argv], capture_output=True, text=True, check=False)
    assert done.returncode == REFUSED_EXIT
    assert "refused" in done.stderr
    assert not log.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--query-gpu=uuid", "--format=csv,noheader"],
        ["-q", "-i", UUID],
        ["-L"],
        ["mig", "-lgi"],
    ],
)
def test_queries_reach_the_real_program_unchanged(
    guard: tuple[Path, Path], argv: list[str]
) -> None:
    script, log = guard
    done = subprocess.run([str(script), *argv], capture_output=True, text=True, check=False)
    assert done.returncode == 0
    assert log.read_text().splitlines() == [" ".join(argv)]
