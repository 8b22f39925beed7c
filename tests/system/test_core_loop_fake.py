"""The real-GPU core-loop scenario (tests/support/gpucoreloop.py), run end to end on the fake
host: the same launcher, daemon policy, waits and judgement as ``test_gpu.py`` on a real driver,
with ``fakecuda.c`` as libcuda.so.1 and the fake NVML, in a PID namespace of its own."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.gpucoreloop import assert_core_loop
from tests.support.simhost import pid_namespace_command, run_in_pid_namespace

pytestmark = [
    pytest.mark.skipif(pid_namespace_command() is None, reason="no PID namespace available"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for fakecuda.c"),
]


def test_the_core_loop_scenario_frees_a_dead_launchers_worker_on_the_fake_host(
    tmp_path: Path,
) -> None:
    record = run_in_pid_namespace(
        "tests.support.gpucoreloop:core_loop",
        {"mode": "fake", "tag": "fakehost", "mib": 700},
        root=tmp_path,
        timeout=240,
    )
    assert record["pid_namespace"] is True
    assert "skip" not in record, record
    assert "namespace_unusable" not in record, record
    assert_core_loop(record)
