"""MIG inputs: the capability minors file and the capability file paths.

In detail: docs/findings.md#mig and docs/internals.md, section `gpuwatchd.collect.mig`.
"""

from __future__ import annotations

import os
import re

from gpuwatchd.core.model import MigCapability

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
