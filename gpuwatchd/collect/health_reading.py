"""The NVML worker's health entry → :class:`gpuwatchd.core.model.GpuHealth`, every value bounded.

The reply is hostile until checked: a value of the wrong type or out of range becomes unknown
(``Support.UNKNOWN``, value None), never a number that could lead to an action. What the values
mean is ``decide/health/judge.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuwatchd.core.checked import as_flag, as_map, as_number
from gpuwatchd.core.model import GpuHealth, Support, XidEvent, as_int

MAX_XID = 0xFFFF  # Xid numbers are small (under 200 today); anything past this is garbage
MAX_RECOVERY_ACTION = 255
MAX_COUNT = 2**32 - 1  # NVML's counters are unsigned int
MAX_XIDS_PER_POLL = 256  # the worker takes no more; a longer list is cut
MAX_FABRIC_STATE = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
MAX_NVML_RETURN = 0xFFFF  # nvmlReturn_t values are small (999 is "unknown")
MAX_MASK = 2**32 - 1
MAX_SUMMARY = 255  # an unsigned char


def _support(raw: object) -> Support:
    try:
        return Support(raw)
    except ValueError:
        return Support.UNKNOWN


def bounded(value: object, high: int) -> int | None:
    """An integer (not a bool) from 0 to ``high``; None otherwise."""
    number = as_int(value)
    return number if number is not None and 0 <= number <= high else None


def _checked(
    section: Mapping[str, object], *values: object
) -> tuple[Support, Mapping[str, object]]:
    """A section's support (unknown where it says ok but a value it must carry is invalid), and
    what its values are read from: the section when ok, else nothing (every value None)."""
    support = _support(section.get("status"))
    if support is Support.OK and None in values:
        support = Support.UNKNOWN
    return support, section if support is Support.OK else {}


def _xids(raw: object) -> tuple[XidEvent, ...]:
    if not isinstance(raw, list):
        return ()
    found = []
    for item in raw[:MAX_XIDS_PER_POLL]:
        if not isinstance(item, Mapping):
            continue
        xid, wall = bounded(item.get("xid"), MAX_XID), as_number(item.get("wall"))
        if xid is not None and wall is not None and wall >= 0:
            found.append(XidEvent(xid, wall))
    return tuple(found)


def to_health(raw: object) -> GpuHealth | None:
    """A checked :class:`GpuHealth`, or None when the entry is missing or not an object."""
    if not isinstance(raw, Mapping):
        return None
    action, rows = as_map(raw.get("recovery_action")), as_map(raw.get("remapped_rows"))
    pages, fabric = as_map(raw.get("retired_pages")), as_map(raw.get("fabric"))
    action_support, action = _checked(action, bounded(action.get("value"), MAX_RECOVERY_ACTION))
    remap_support, rows = _checked(rows, as_flag(rows.get("pending")), as_flag(rows.get("failure")))
    pages_support, pages = _checked(pages, as_flag(pages.get("pending")))
    fabric_support, fabric = _checked(fabric, bounded(fabric.get("state"), MAX_FABRIC_STATE))
    return GpuHealth(
        events=_support(raw.get("events")),
        xids=_xids(raw.get("xids")),
        recovery_action=bounded(action.get("value"), MAX_RECOVERY_ACTION),
        recovery_support=action_support,
        remap_correctable=bounded(rows.get("correctable"), MAX_COUNT),
        remap_uncorrectable=bounded(rows.get("uncorrectable"), MAX_COUNT),
        remap_pending=as_flag(rows.get("pending")),
        remap_failure=as_flag(rows.get("failure")),
        remap_support=remap_support,
        pages_pending=as_flag(pages.get("pending")),
        pages_single_bit=bounded(pages.get("single_bit"), MAX_COUNT),
        pages_double_bit=bounded(pages.get("double_bit"), MAX_COUNT),
        pages_support=pages_support,
        fabric_support=fabric_support,
        fabric_state=bounded(fabric.get("state"), MAX_FABRIC_STATE),
        fabric_status=bounded(fabric.get("probe_status"), MAX_NVML_RETURN),
        fabric_health_mask=bounded(fabric.get("health_mask"), MAX_MASK),
        fabric_health_summary=bounded(fabric.get("health_summary"), MAX_SUMMARY),
    )
