"""The NVLink fabric of NVSwitch systems: what NVML's fabric state and health mask mean.

In detail: docs/internals.md, section `gpuwatchd.decide.health.fabric`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from gpuwatchd.core.model import GpuHealth, Support


class FabricState(enum.IntEnum):
    """``NVML_GPU_FABRIC_STATE_*``."""

    NOT_SUPPORTED = 0
    NOT_STARTED = 1
    IN_PROGRESS = 2
    COMPLETED = 3


class Summary(enum.IntEnum):
    """``NVML_GPU_FABRIC_HEALTH_SUMMARY_*`` (struct v3 and later)."""

    NOT_SUPPORTED = 0
    HEALTHY = 1
    UNHEALTHY = 2
    LIMITED_CAPACITY = 3


_TRISTATE = {0: "not_supported", 1: "true", 2: "false"}
_CONFIGURATION = {
    0: "not_supported",
    1: "none",
    2: "incorrect_sysguid",
    3: "incorrect_chassis_sn",
    4: "no_partition",
    5: "insufficient_nvlinks",
    6: "incompatible_gpu_fw",
    7: "invalid_location",
    8: "gpu_state_invalid",
}
_GFM = {0: "not_supported", 1: "connected", 2: "disconnected"}
# (name, shift, width, values): the health mask's fields, in nvml.h's order.
_FIELDS = (
    ("degraded_bw", 0, 0x3, _TRISTATE),
    ("route_recovery", 2, 0x3, _TRISTATE),
    ("route_unhealthy", 4, 0x3, _TRISTATE),
    ("access_timeout_recovery", 6, 0x3, _TRISTATE),
    ("incorrect_configuration", 8, 0xF, _CONFIGURATION),
    ("partition_assigned", 12, 0x3, _TRISTATE),
    ("gfm_state", 14, 0x3, _GFM),
)


def decode_mask(mask: int) -> dict[str, str]:
    """The health mask, one named value per field (``unknown_N`` for a value nvml.h lacks)."""
    decoded: dict[str, str] = {}
    for name, shift, width, table in _FIELDS:
        value = (mask >> shift) & width
        decoded[name] = table.get(value, f"unknown_{value}")
    return decoded


def supported(health: GpuHealth) -> bool:
    """The GPU is part of an NVLink fabric NVML reports on (an NVSwitch system)."""
    return (
        health.fabric_support is Support.OK
        and health.fabric_state is not None
        and health.fabric_state != FabricState.NOT_SUPPORTED
    )


def _name(kind: type[enum.IntEnum], value: int | None) -> str | None:
    """``kind``'s name of ``value``; None when it was not read."""
    if value is None:
        return None
    try:
        return kind(value).name
    except ValueError:
        return f"unknown ({value})"


def _state_name(value: int | None) -> str:
    return _name(FabricState, value) or "unknown"


def registering(health: GpuHealth) -> bool | None:
    """True while the GPU's fabric registration is NOT_STARTED or IN_PROGRESS; False once
    completed or where there is no fabric; None when it could not be read."""
    if health.fabric_support is Support.NOT_SUPPORTED:
        return False
    if health.fabric_support is not Support.OK or health.fabric_state is None:
        return None
    return health.fabric_state in (FabricState.NOT_STARTED, FabricState.IN_PROGRESS)


def waiting_for_partition(health: GpuHealth) -> bool:
    """Registration waits for a partition to be activated (NVLink5 with Fabric Manager's
    partition mode), where IN_PROGRESS is the normal state and not a stuck fabric."""
    mask = health.fabric_health_mask
    return mask is not None and decode_mask(mask)["partition_assigned"] == "false"


def problems(health: GpuHealth) -> list[str]:
    """What is wrong with a COMPLETED fabric, in words; empty when nothing is (or unknown)."""
    if not supported(health) or health.fabric_state != FabricState.COMPLETED:
        return []
    found: list[str] = []
    status = health.fabric_status
    if status is not None and status != 0:
        found.append(f"fabric registration completed with NVML error {status}")
    if health.fabric_health_summary == Summary.UNHEALTHY:
        found.append("the fabric's health summary is UNHEALTHY")
    mask = health.fabric_health_mask
    if mask is not None:
        decoded = decode_mask(mask)
        if decoded["degraded_bw"] == "true":
            found.append("NVLink bandwidth is degraded")
        if decoded["route_unhealthy"] == "true":
            found.append("a fabric route is unhealthy")
        config = decoded["incorrect_configuration"]
        if config not in ("none", "not_supported"):
            found.append(f"the fabric is misconfigured ({config})")
    return found


def after_reset(health: GpuHealth | None) -> tuple[str, str]:
    """A reading after one of our resets: ``("completed" | "waiting" | "failed" | "unknown",
    detail)``; only ``completed`` lets the reset count as done."""
    if health is None or health.fabric_support is not Support.OK:
        return "unknown", "the fabric state could not be read"
    state = health.fabric_state
    if state == FabricState.COMPLETED:
        bad = problems(health)
        if bad:
            return "failed", "; ".join(bad)
        return "completed", "fabric registration COMPLETED"
    if state in (FabricState.NOT_STARTED, FabricState.IN_PROGRESS):
        return "waiting", f"fabric registration {_state_name(state)}"
    return "unknown", f"fabric state {_state_name(state)}"


def evidence(health: GpuHealth) -> Mapping[str, object]:
    """The fabric part of a health finding's evidence."""
    mask = health.fabric_health_mask
    return {
        "support": str(health.fabric_support),
        "state": _state_name(health.fabric_state) if health.fabric_support is Support.OK else None,
        "status": health.fabric_status,
        "health_mask": None if mask is None else decode_mask(mask),
        "health_summary": _name(Summary, health.fabric_health_summary),
    }
