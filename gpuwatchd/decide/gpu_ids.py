"""PCI bus ids, read and compared one way however spelled (NVML's ``00000000:3B:00.0``, an
admin's ``0000:3b:00.0`` or ``3b:00.0``), and how Slurm numbers GPUs. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

BusKey = tuple[int, int, int, int]  # domain, bus, device, function
DeviceKey = tuple[int, int, int]  # domain, bus, device: a GPU whichever function is named
_BUS_ID = re.compile(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])")


def pci_bus_key(text: str) -> BusKey | None:
    """``00000000:17:00.0``, ``0000:17:00.0`` and ``17:00.0`` as (0, 0x17, 0, 0); None for
    anything that is not a bus id."""
    match = _BUS_ID.fullmatch(text.strip().lower())
    if match is None:
        return None
    domain, bus, device, function = match.groups()
    return (int(domain or "0", 16), int(bus, 16), int(device, 16), int(function, 16))


def pci_device(bus_id: str | None, *, kernel_log: bool = False) -> DeviceKey | None:
    """A bus id's domain, bus and device: NVML's ``00000000:17:00.0`` or, with ``kernel_log``,
    the kernel log's ``0000:17:00`` (it names no function); None for None and for anything
    else (the kernel log's form where NVML's is read, and the other way round)."""
    key = None if bus_id is None else pci_bus_key(f"{bus_id}.0" if kernel_log else bus_id)
    return None if key is None else key[:3]


def same_pci_bus_id(one: str, other: str) -> bool:
    """Whether two bus ids name the same PCI function, however each is spelled. Text that is
    not a bus id names nothing (never equal, not even to itself)."""
    key = pci_bus_key(one)
    return key is not None and key == pci_bus_key(other)


def nvml_bus_id(key: BusKey) -> str:
    """A bus id as NVML spells it: ``00000000:3B:00.0``."""
    domain, bus, device, function = key
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function:X}"


# How Slurm numbers a node's GPUs (docs/operations.md, "Which GPUs are the job's"): by their
# device files' minors (gres.conf ``File=``, ``AutoDetect=nvidia``) or in NVML's order.
SLURM_ORDERS = ("files", "nvml")


def slurm_numbering(gpus: Sequence[tuple[int, int | None]], order: str) -> list[int] | None:
    """The NVML indices of ``gpus`` (each ``(index, minor)``) in the order Slurm numbers them:
    Slurm's GPU id k is the k-th. None when ``order`` is ``files`` and a GPU's device minor is
    unknown (its place cannot be told)."""
    if order == "nvml":
        return sorted(index for index, _ in gpus)
    if order != "files":
        raise ValueError(f"Slurm GPU order {order!r}: expected one of {', '.join(SLURM_ORDERS)}")
    if any(minor is None for _, minor in gpus):
        return None
    return [index for index, minor in sorted(gpus, key=lambda gpu: (gpu[1], gpu[0]))]
