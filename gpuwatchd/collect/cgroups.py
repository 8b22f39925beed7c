"""What a cgroup path says about a process's job: pure parsing of cgroup and mount text.

In detail: docs/internals.md, section `gpuwatchd.collect.cgroups`.
"""

from __future__ import annotations

import errno
import functools
import os
import re
from collections.abc import Iterator

from gpuwatchd.core.escape import unescape_mount_path
from gpuwatchd.core.model import CgroupInfo

_CONTAINER_SCOPES = (  # a container's scope (or cgroup) name, and its runtime
    (re.compile(r"docker-([0-9a-f]{12,64})\.scope"), "docker"),
    (re.compile(r"cri-containerd-([0-9a-f]{12,64})\.scope"), "containerd"),
    (re.compile(r"crio-(?:conmon-)?([0-9a-f]{12,64})(?:\.scope)?"), "crio"),
    (re.compile(r"libpod-(?:conmon-)?([0-9a-f]{12,64})(?:\.scope)?"), "podman"),
)
_BARE_ID = re.compile(r"[0-9a-f]{64}")
_POD_SLICE = re.compile(r"kubepods(?:-[a-z]+)?-pod([0-9a-fA-F_-]+)\.slice")
_POD_DIR = re.compile(r"pod([0-9a-fA-F]{8}-[0-9a-fA-F-]{27,})")
_SLURM_JOB = re.compile(r"job_(\d+)")
_SLURM_STEP = re.compile(r"step_(\w+)")
_SLURM_V1_ROOT = re.compile(r"slurm(?:_[^/]+)?")
_SLURM_V1_UID = re.compile(r"uid_\d+")
_DELEGATED_TO_USER = re.compile(r"user@\d+\.service")
# Cheap substring checks that must hold for a path to name a job or container.
_JOB_HINTS = ("job_", "docker", "containerd", "crio-", "libpod-", "kubepods")


def kernel_lines(text: str) -> list[str]:
    """``text`` split at ``\\n`` only, the one line break the kernel's text files use. Pure."""
    return text.split("\n")


def _slurm_job_at(parts: list[str], index: int) -> bool:
    """Whether ``parts[index]`` is a ``job_<ID>`` where Slurm itself puts one."""
    if index < 1 or not _SLURM_JOB.fullmatch(parts[index]):
        return False
    anchor = parts[index - 1]
    if anchor == "slurmstepd.scope" or anchor.endswith("_slurmstepd.scope"):
        return True  # cgroup v2: <...>/slurmstepd.scope/job_<ID>
    if index < 2 or _SLURM_V1_UID.fullmatch(anchor) is None:
        return False
    return _SLURM_V1_ROOT.fullmatch(parts[index - 2]) is not None  # v1: slurm/uid_<UID>/job_<ID>


@functools.lru_cache(maxsize=4096)
def classify_cgroup_path(path: str) -> CgroupInfo:
    """What one cgroup path names: container, pod, Slurm job and step, systemd unit. Pure."""
    parts = [p for p in path.split("/") if p]
    container_id: str | None = None
    runtime: str | None = None
    pod_uid: str | None = None
    slurm_job: str | None = None
    slurm_step: str | None = None
    slurm_index: int | None = None
    unit: str | None = None
    delegated = False  # below a user's own subtree: job names there are the user's words
    for index, part in enumerate(parts):
        if part.endswith((".service", ".scope")):
            unit = part
        trusted = not delegated and container_id is None
        if trusted and pod_uid is None and slurm_job is None:
            if match := _POD_SLICE.fullmatch(part):
                pod_uid = match.group(1).replace("_", "-")
            elif (match := _POD_DIR.fullmatch(part)) and index > 0 and "kubepods" in parts[0]:
                pod_uid = match.group(1)
        if container_id is None:
            for pattern, name in _CONTAINER_SCOPES:
                if match := pattern.fullmatch(part):
                    container_id, runtime = match.group(1), name
                    break
            else:
                if index > 0 and parts[index - 1] == "docker" and _BARE_ID.fullmatch(part):
                    container_id, runtime = part, "docker"  # docker's cgroupfs driver
                elif pod_uid is not None and _BARE_ID.fullmatch(part):
                    container_id = part  # kubelet's cgroupfs driver: /kubepods/<qos>/pod<uid>/<id>
        if trusted and slurm_job is None and pod_uid is None and _slurm_job_at(parts, index):
            slurm_job, slurm_index = part[len("job_") :], index
        elif (
            slurm_index is not None
            and index == slurm_index + 1
            and (match := _SLURM_STEP.fullmatch(part))
        ):
            slurm_step = match.group(1)
        if _DELEGATED_TO_USER.fullmatch(part):
            delegated = True
    return CgroupInfo(
        path=path,
        container_id=container_id,
        container_runtime=runtime,
        pod_uid=pod_uid,
        slurm_job=slurm_job,
        slurm_step=slurm_step,
        systemd_unit=unit,
        slurm_job_dir=None if slurm_index is None else "/" + "/".join(parts[: slurm_index + 1]),
    )


def parse_cgroup(text: str) -> CgroupInfo | None:
    """Parse ``/proc/PID/cgroup`` (v1, v2 or hybrid) into the path that names the job: the first
    naming a Slurm job or container (v1 Slurm lives only in some controllers), else the
    unified ``0::`` line, else ``name=systemd``, else the first; None when no line parses. Pure."""
    lines = (line.split(":", 2) for line in kernel_lines(text))
    entries = [(f[0], f[1], f[2]) for f in lines if len(f) == 3 and f[2].startswith("/")]
    if not entries:
        return None
    for _, _, path in entries:
        if any(hint in path for hint in _JOB_HINTS):
            info = classify_cgroup_path(path)
            if info.slurm_job is not None or info.container_id is not None or info.pod_uid:
                return info
    preferred = [path for hierarchy, ctl, path in entries if (hierarchy, ctl) == ("0", "")]
    preferred += [path for _, ctl, path in entries if ctl == "name=systemd"]
    return classify_cgroup_path((preferred or [entries[0][2]])[0])


def _mounts(mountinfo: str) -> Iterator[tuple[list[str], str]]:
    """Each ``/proc/PID/mountinfo`` line's fields after `` - `` (the file system type first)
    and its mount point (field 5), unescaped. Pure."""
    for line in kernel_lines(mountinfo):
        left, separator, right = line.partition(" - ")
        fields = left.split(" ")
        if separator and len(fields) >= 5:
            yield right.split(" "), unescape_mount_path(fields[4])


def parse_cgroup2_mount(mountinfo: str) -> str | None:
    return next((point for after, point in _mounts(mountinfo) if after[0] == "cgroup2"), None)


def parse_systemd_mount(mountinfo: str) -> str | None:
    """Where systemd keeps its cgroup tree according to mountinfo text: the v1 ``name=systemd``
    hierarchy where mounted (legacy and hybrid set-ups keep the extended attributes there),
    else the unified one; None without either. Pure."""
    for after, point in _mounts(mountinfo):
        if after[0] == "cgroup" and len(after) >= 3 and "name=systemd" in after[2].split(","):
            return point
    return parse_cgroup2_mount(mountinfo)


DELEGATION_MARKS = ("trusted.delegate", "user.delegate")
_NO_MARK_ERRNOS = frozenset({errno.ENODATA, errno.EOPNOTSUPP})  # none set / none settable


def delegation_mark(mount: str, path: str) -> bool | None:
    """Whether systemd marked cgroup ``path`` (below ``mount``) or one above it as delegated
    (:data:`DELEGATION_MARKS`, a value other than ``0``); None when a level cannot be read
    (gone, no privilege, not a cgroup), so that unknown stays unknown."""
    parts = [p for p in path.split("/") if p]
    if any(part in (".", "..") for part in parts):
        return None
    current = mount.rstrip("/")
    for part in parts:
        current = f"{current}/{part}"
        for name in DELEGATION_MARKS:
            try:
                value = os.getxattr(current, name, follow_symlinks=False)
            except OSError as err:
                if err.errno in _NO_MARK_ERRNOS:
                    continue
                return None
            if value.strip(b"\0\n ") != b"0":
                return True
    return False
