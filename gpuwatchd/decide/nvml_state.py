"""NVML's availability as a state with transitions: ``ok``, ``wedged`` (a call missed its
deadline), ``unavailable`` (library or driver missing, init failed), and since when.

In detail: docs/internals.md, section `gpuwatchd.decide.nvml_state`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.core.model import NvmlReading
from gpuwatchd.core.vocabulary import EventName, Level

OK = "ok"
WEDGED = "wedged"
UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class NvmlAvailability:
    """NVML's state, the wall time of the first reading in that state, and the last error.
    ``state`` None: no reading yet."""

    state: str | None = None
    since: float | None = None
    error: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"state": self.state or "unknown", "since": self.since, "error": self.error}


def next_availability(
    previous: NvmlAvailability, reading: NvmlReading, wall: float
) -> tuple[NvmlAvailability, list[tuple[str, Level, dict[str, object]]]]:
    """The state after ``reading`` (taken at wall time ``wall``), and the events of the
    transition: ``EventName.NVML_RECOVERED`` when NVML answers after being wedged or unavailable."""
    state = UNAVAILABLE if not reading.available else WEDGED if reading.wedged else OK
    error = reading.error if state != OK else None
    if state == previous.state:
        return NvmlAvailability(state, previous.since, error or previous.error), []
    current = NvmlAvailability(state, wall, error)
    if state != OK or previous.state not in (WEDGED, UNAVAILABLE):
        return current, []
    since = previous.since
    gone_for = None if since is None else round(max(0.0, wall - since), 3)
    fields: dict[str, object] = {"was": previous.state, "since": since, "gone_for": gone_for}
    fields["error"] = previous.error
    return current, [(EventName.NVML_RECOVERED, Level.WARNING, fields)]
