"""MIG inputs: the capability minors file, capability file paths, and the worker's MIG devices.

In detail: docs/findings.md#mig and docs/internals.md, section `gpuwatchd.collect.mig`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from gpuwatchd.collect.health_reading import bounded
from gpuwatchd.core.model import GpuMemory, MigCapability, MigDevice, NvmlProcess

DEFAULT_MIG_MINORS_FILE = "/proc/driver/nvidia-caps/mig-minors"
CAPABILITIES_DIR = "/proc/driver/nvidia/capabilities"
MAX_MINORS_FILE = 1 << 20  # bytes; the real file has a few thousand short lines


def cap_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The nvidia-cap minor current drivers give a MIG capability (``config`` 1, ``monitor`` 2,
    then per GPU 15 GPU instances of one access and 8 compute instances each), for tables made
    up where none is read (``simulate``, ``explain``); the daemon always reads the real one."""
    base = 3 + gpu_minor * 135 + gi * 9
    return base if ci is None else base + 1 + ci


MAX_GPU_MINOR = 255
MAX_INSTANCE_ID = 255
MAX_CAP_MINOR = (1 << 20) - 1  # MINORBITS
MAX_MIG_DEVICES = 16

_LINE = re.compile(r"gpu(\d{1,3})/gi(\d{1,3})(?:/ci(\d{1,3}))?/access (\d{1,7})")
_OTHER = re.compile(r"[A-Za-z0-9_./-]{1,128} \d{1,7}")
_CAP_FILE = re.compile(r"gpu(\d{1,3})/mig/gi(\d{1,3})(?:/ci(\d{1,3}))?/access")
_PROFILE = re.compile(r" MIG ([0-9a-z.+-]{1,32})$")


def _capability(match: re.Match[str]) -> MigCapability | None:
    """The capability a pattern's match names (GPU minor, GPU instance, compute instance or
    None); None when an id is out of range."""
    gpu, gi, text = int(match.group(1)), int(match.group(2)), match.group(3)
    ci = None if text is None else int(text)
    if gpu > MAX_GPU_MINOR or gi > MAX_INSTANCE_ID or (ci is not None and ci > MAX_INSTANCE_ID):
        return None
    return MigCapability(gpu, gi, ci)


class MigMinorsError(ValueError):
    """The mig-minors file could not be read or is not what the driver writes."""


def parse_mig_minors(text: str, path: str) -> dict[int, MigCapability]:
    """The table ``nvidia-cap`` minor → capability; raises :class:`MigMinorsError`. Pure."""
    table: dict[int, MigCapability] = {}
    named: set[MigCapability] = set()
    for number, line in enumerate(text.split("\n"), start=1):
        if not line:
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            if _OTHER.fullmatch(line) is None:
                raise MigMinorsError(
                    f"{path} line {number}: {line[:80]!r} is not '<capability> <minor>'"
                )
            continue  # config, monitor, fabric capabilities: not about an instance
        capability, minor = _capability(match), int(match.group(4))
        if capability is None:
            raise MigMinorsError(f"{path} line {number}: {line!r}: an id out of range")
        if minor > MAX_CAP_MINOR:
            raise MigMinorsError(f"{path} line {number}: minor {minor} out of range")
        if minor in table or capability in named:
            raise MigMinorsError(
                f"{path} line {number}: {line!r} names a minor or capability twice"
            )
        table[minor] = capability
        named.add(capability)
    return table


def read_mig_minors(path: str) -> tuple[dict[int, MigCapability] | None, str | None]:
    """(table, None), or (None, why) when the file cannot be read (at most
    :data:`MAX_MINORS_FILE` bytes, no symlink last) or is not ASCII in the driver's format."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            data = os.read(fd, MAX_MINORS_FILE + 1)
        finally:
            os.close(fd)
    except OSError as err:
        return None, f"mig_minors_file {path}: {err.strerror or err}"
    if len(data) > MAX_MINORS_FILE:
        return None, f"mig_minors_file {path}: larger than {MAX_MINORS_FILE} bytes"
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return None, f"mig_minors_file {path}: not ASCII text"
    try:
        return parse_mig_minors(text, f"mig_minors_file {path}"), None
    except MigMinorsError as err:
        return None, str(err)


def match_cap_file(path: str, capabilities_dir: str = CAPABILITIES_DIR) -> MigCapability | None:
    """The capability a procfs capability file directly under ``capabilities_dir`` (only the
    driver creates files there) stands for, or None: ``gpu0/mig/gi1/ci0/access`` →
    ``MigCapability(0, 1, 0)``. Pure."""
    prefix = capabilities_dir.rstrip("/") + "/"
    if not path.startswith(prefix):
        return None
    match = _CAP_FILE.fullmatch(path[len(prefix) :])
    return None if match is None else _capability(match)


def _text(value: Any, most: int = 256) -> str | None:
    return value[:most] if isinstance(value, str) else None


def profile_of(name: str | None) -> str | None:
    """``1g.10gb`` from ``NVIDIA H100 80GB HBM3 MIG 1g.10gb``, the driver's MIG device name."""
    if name is None:
        return None
    match = _PROFILE.search(name)
    return None if match is None else match.group(1)


def to_mig_devices(raw: Any, to_memory: Any, to_processes: Any) -> tuple[MigDevice, ...] | None:
    """The worker's ``mig_devices`` list (at most :data:`MAX_MIG_DEVICES` objects) as
    :class:`MigDevice` values, memory and processes read by the GPU's own converters
    (collect/nvml.py); None when unknown."""
    if not isinstance(raw, list):
        return None
    devices: list[MigDevice] = []
    for entry in raw[:MAX_MIG_DEVICES]:
        if not isinstance(entry, Mapping):
            continue
        placement = entry.get("placement")
        where: tuple[int, int] | None = None
        if isinstance(placement, list) and len(placement) == 2:
            start, size = (bounded(v, MAX_INSTANCE_ID) for v in placement)
            where = None if start is None or size is None else (start, size)
        name = _text(entry.get("name"))
        try:
            processes: tuple[NvmlProcess, ...] | None = to_processes(entry.get("processes"))
        except (KeyError, TypeError, ValueError, AttributeError):
            processes = None  # not the worker's shape: unknown, never "none"
        try:
            memory: GpuMemory | None = to_memory(entry.get("memory"))
        except (TypeError, ValueError, AttributeError):
            memory = None
        devices.append(
            MigDevice(
                index=bounded(entry.get("index"), MAX_MIG_DEVICES) or 0,
                uuid=_text(entry.get("uuid"), 96),
                gi=bounded(entry.get("gi"), MAX_INSTANCE_ID),
                ci=bounded(entry.get("ci"), MAX_INSTANCE_ID),
                name=name,
                profile=profile_of(name),
                gi_profile_id=bounded(entry.get("gi_profile_id"), MAX_INSTANCE_ID),
                placement=where,
                memory=memory,
                processes=processes,
                error=_text(entry.get("error"), 1024),
            )
        )
    return tuple(devices)
