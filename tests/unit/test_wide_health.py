"""What the wide mutation run found untested in the idle baseline (decide/assess/baselines.py): each
GPU is judged on its own (one GPU that may not be learned never stops the next one from being
learned), which holders keep a GPU from being learned, and the ceiling a first figure must stay
under, exactly at its edge. Pure: hand-built snapshots through learn_baselines."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpuwatchd.core.model import MIB
from gpuwatchd.decide.assess.baselines import (
    V1_BASELINE_SUFFIX,
    V1_MAX_RESERVATION,
    learn_baselines,
)
from gpuwatchd.decide.assess.host_view import HostView
from gpuwatchd.decide.policy import Detection
from tests.support.snapshots import HostBuilder, gpu_uuid

DETECTION = Detection()
CEILING = DETECTION.default_baseline + DETECTION.ghost_margin  # the most a first v2 figure may be
IDLE = 3 * MIB


def learned(builder: HostBuilder, previous: dict[str, int] | None = None) -> dict[str, int]:
    return learn_baselines(HostView(builder.build()), previous or {}, DETECTION)


def _lost(b: HostBuilder) -> HostBuilder:
    return b.gpu(0, lost=True)


def _listed(b: HostBuilder) -> HostBuilder:
    return b.gpu(0).nvml(0, 2300)


def _job_holder(b: HostBuilder) -> HostBuilder:
    return b.gpu(0).proc(2301, holds={0})


def _infrastructure_with_uvm(b: HostBuilder) -> HostBuilder:
    return b.gpu(0).proc(2302, comm="nvidia-persiste", holds={0}, uvm=True, uid=0,
                         exe_trusted=True)  # fmt: skip


def _memory_unknown(b: HostBuilder) -> HostBuilder:
    return b.gpu(0, memory_known=False)


def _above_the_ceiling(b: HostBuilder) -> HostBuilder:
    return b.gpu(0, allocated=CEILING + 1)


@pytest.mark.parametrize(
    "busy",
    [
        pytest.param(_lost, id="lost"),
        pytest.param(_listed, id="NVML lists a process"),
        pytest.param(_job_holder, id="a job's process holds the device file"),
        pytest.param(_infrastructure_with_uvm, id="infrastructure holding nvidia-uvm"),
        pytest.param(_memory_unknown, id="memory unknown"),
        pytest.param(_above_the_ceiling, id="a first figure above the ceiling"),
    ],
)
def test_a_gpu_that_may_not_be_learned_is_skipped_and_the_next_one_still_learned(
    busy: Callable[[HostBuilder], HostBuilder],
) -> None:
    host = busy(HostBuilder()).gpu(1, allocated=IDLE)
    assert learned(host) == {gpu_uuid(1): IDLE}


@pytest.mark.parametrize(
    ("api", "figure", "kept"),
    [
        ("v2", CEILING, True),
        ("v2", CEILING + 1, False),
        # v1 "used" includes the driver's reservation: its ceiling is the v2 one plus it.
        ("v1", CEILING + V1_MAX_RESERVATION, True),
        ("v1", CEILING + V1_MAX_RESERVATION + 1, False),
        ("v1", V1_MAX_RESERVATION + MIB, True),
    ],
)
def test_a_first_figure_is_learned_up_to_its_ceiling_inclusive(
    api: str, figure: int, kept: bool
) -> None:
    if api == "v1":
        host, key = HostBuilder().gpu(0, api="v1", used_v1=figure), gpu_uuid(0) + V1_BASELINE_SUFFIX
    else:
        host, key = HostBuilder().gpu(0, allocated=figure), gpu_uuid(0)
    assert learned(host) == ({key: figure} if kept else {})
