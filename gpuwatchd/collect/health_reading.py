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


def _checked(section: Mapping[str, object], *values: object) -> Support:
    """A section's support: unknown where it says ok but a value it must carry is invalid."""
    support = _support(section.get("status"))
    return Support.UNKNOWN if support is Support.OK and None in values else support


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
    action_value = bounded(action.get("value"), MAX_RECOVERY_ACTION)
    action_support = _checked(action, action_value)
    remap_pending, remap_failure = as_flag(rows.get("pending")), as_flag(rows.get("failure"))
    remap_support = _checked(rows, remap_pending, remap_failure)
    ok_rows = remap_support is Support.OK
    pending = as_flag(pages.get("pending"))
    pages_support = _checked(pages, pending)
    ok_pages = pages_support is Support.OK
    fabric_state = bounded(fabric.get("state"), MAX_FABRIC_STATE)
    fabric_support = _checked(fabric, fabric_state)
    ok_fabric = fabric_support is Support.OK
    return GpuHealth(
        events=_support(raw.get("events")),
        xids=_xids(raw.get("xids")),
        recovery_action=action_value if action_support is Support.OK else None,
        recovery_support=action_support,
        remap_correctable=bounded(rows.get("correctable"), MAX_COUNT) if ok_rows else None,
        remap_uncorrectable=bounded(rows.get("uncorrectable"), MAX_COUNT) if ok_rows else None,
        remap_pending=remap_pending if ok_rows else None,
        remap_failure=remap_failure if ok_rows else None,
        remap_support=remap_support,
        pages_pending=pending if ok_pages else None,
        pages_single_bit=bounded(pages.get("single_bit"), MAX_COUNT) if ok_pages else None,
        pages_double_bit=bounded(pages.get("double_bit"), MAX_COUNT) if ok_pages else None,
        pages_support=pages_support,
        fabric_support=fabric_support,
        fabric_state=fabric_state if ok_fabric else None,
        fabric_status=bounded(fabric.get("probe_status"), MAX_NVML_RETURN) if ok_fabric else None,
        fabric_health_mask=bounded(fabric.get("health_mask"), MAX_MASK) if ok_fabric else None,
        fabric_health_summary=(
            bounded(fabric.get("health_summary"), MAX_SUMMARY) if ok_fabric else None
        ),
    )
