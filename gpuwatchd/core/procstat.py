"""The parsed ``/proc/PID/stat`` line: one parser for the readers of ``collect`` and the
signaller of ``act`` (neither imports the other). Pure."""

from __future__ import annotations

from dataclasses import dataclass

PF_KTHREAD = 0x00200000


@dataclass(frozen=True)
class StatFields:
    """The fields of ``/proc/PID/stat`` gpuwatchd uses. ``starttime`` is field 22 (ticks)."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    flags: int
    num_threads: int
    starttime: int
    # Where the program's code, stack, arguments and environment lie (fields 26-28, 48-51, as
    # far as the line goes): an exec moves them, though the PID, start time and comm may stay.
    exec_mark: tuple[str, ...] = ()

    @property
    def kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


def parse_stat(text: str) -> StatFields | None:
    """Parse one ``/proc/PID/stat`` line; None when it is malformed. ``comm`` may hold anything
    but NUL (``foo) Z 1 (`` too): it runs from the first ``(`` to the last ``)``."""
    opening = text.find("(")
    closing = text.rfind(")")
    if opening < 0 or closing < opening:
        return None
    rest = text[closing + 1 :].split()
    if len(rest) < 20:  # fields 3..22
        return None
    try:
        return StatFields(
            pid=int(text[:opening]),
            comm=text[opening + 1 : closing],
            state=rest[0],
            ppid=int(rest[1]),
            pgrp=int(rest[2]),
            session=int(rest[3]),
            flags=int(rest[6]),
            num_threads=int(rest[17]),
            starttime=int(rest[19]),
            exec_mark=(*rest[23:26], *rest[45:49]),
        )
    except ValueError:
        return None
