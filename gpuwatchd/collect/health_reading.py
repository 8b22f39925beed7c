"""The NVML worker's health entry → :class:`gpuwatchd.core.model.GpuHealth`, every value bounded.

This module owns how the ``health`` part of a worker reply (see
:mod:`gpuwatchd.collect.nvml_worker`) becomes model values. The reply comes from another
process talking to a driver, so it is hostile until checked: a value of the wrong type or out
of range becomes *unknown* (``Support.UNKNOWN``, value None), never a number that could lead to
an action. It decides nothing about what the values mean (``decide/health/judge.py`` does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gpuwatchd.core.checked import as_flag
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


def _bounded(value: object, high: int) -> int | None:
    number = as_int(value)
    return number if number is not None and 0 <= number <= high else None


def _section(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key)
    return value if isinstance(value, Mapping) else {}


def _xids(raw: object) -> tuple[XidEvent, ...]:
    if not isinstance(raw, list):
        return ()
    found = []
    for item in raw[:MAX_XIDS_PER_POLL]:
        if not isinstance(item, Mapping):
            continue
        xid = _bounded(item.get("xid"), MAX_XID)
        wall = item.get("wall")
        if xid is None or isinstance(wall, bool) or not isinstance(wall, (int, float)):
            continue
        if not math.isfinite(wall) or wall < 0:
            continue
        found.append(XidEvent(xid, float(wall)))
    return tuple(found)


def to_health(raw: object) -> GpuHealth | None:
    """A checked :class:`GpuHealth`, or None when the entry is missing or not an object."""
    if not isinstance(raw, Mapping):
        return None
    action = _section(raw, "recovery_action")
    rows = _section(raw, "remapped_rows")
    pages = _section(raw, "retired_pages")
    action_value = _bounded(action.get("value"), MAX_RECOVERY_ACTION)
    action_support = _support(action.get("status"))
    if action_support is Support.OK and action_value is None:
        action_support = Support.UNKNOWN
    remap_pending, remap_failure = as_flag(rows.get("pending")), as_flag(rows.get("failure"))
    remap_support = _support(rows.get("status"))
    if remap_support is Support.OK and (remap_pending is None or remap_failure is None):
        remap_support = Support.UNKNOWN
    ok_rows = remap_support is Support.OK
    pages_support = _support(pages.get("status"))
    pending = as_flag(pages.get("pending"))
    if pages_support is Support.OK and pending is None:
        pages_support = Support.UNKNOWN
    ok_pages = pages_support is Support.OK
    fabric = _section(raw, "fabric")
    fabric_support = _support(fabric.get("status"))
    fabric_state = _bounded(fabric.get("state"), MAX_FABRIC_STATE)
    if fabric_support is Support.OK and fabric_state is None:
        fabric_support = Support.UNKNOWN
    ok_fabric = fabric_support is Support.OK
    return GpuHealth(
        events=_support(raw.get("events")),
        xids=_xids(raw.get("xids")),
        recovery_action=action_value if action_support is Support.OK else None,
        recovery_support=action_support,
        remap_correctable=_bounded(rows.get("correctable"), MAX_COUNT) if ok_rows else None,
        remap_uncorrectable=_bounded(rows.get("uncorrectable"), MAX_COUNT) if ok_rows else None,
        remap_pending=remap_pending if ok_rows else None,
        remap_failure=remap_failure if ok_rows else None,
        remap_support=remap_support,
        pages_pending=pending if ok_pages else None,
        pages_single_bit=_bounded(pages.get("single_bit"), MAX_COUNT) if ok_pages else None,
        pages_double_bit=_bounded(pages.get("double_bit"), MAX_COUNT) if ok_pages else None,
        pages_support=pages_support,
        fabric_support=fabric_support,
        fabric_state=fabric_state if ok_fabric else None,
        fabric_status=_bounded(fabric.get("probe_status"), MAX_NVML_RETURN) if ok_fabric else None,
        fabric_health_mask=_bounded(fabric.get("health_mask"), MAX_MASK) if ok_fabric else None,
        fabric_health_summary=(
            _bounded(fabric.get("health_summary"), MAX_SUMMARY) if ok_fabric else None
        ),
    )
