"""Tests for gpuwatchd.collect.cgroups: what a cgroup path says about a process's job.

Parsers are pinned by tables. The hostile rows are paths a user (below ``user@UID.service``,
where systemd delegates cgroup creation) or a container's root can create: they may name
themselves anything, break lines with anything but ``\\n``, and must still never become part of
somebody else's Slurm job or pod.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpuwatchd.collect.cgroups import (
    classify_cgroup_path,
    kernel_lines,
    parse_cgroup,
    parse_cgroup2_mount,
    parse_systemd_mount,
)
from gpuwatchd.core.escape import unescape_mount_path
from gpuwatchd.core.model import CgroupInfo

DOCKER_ID = "4f9a" * 16
CTR_ID = "ab12" * 16
POD_UID = "0b7c3f5e-2d2a-4c55-9a6e-1f2e3d4c5b6a"
USER_SUBTREE = "/user.slice/user-1000.slice/user@1000.service/app.slice"
# Every character str.splitlines breaks at, except the one the kernel uses.
LINE_BREAKS = ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
STOLEN = "0::/system.slice/slurmstepd.scope/job_999/step_0/user/task_0"

# --- parse_cgroup -------------------------------------------------------------------------


POD = POD_UID.replace("-", "_")
CONTAINERD = f"cri-containerd-{CTR_ID}.scope"
STEPD = "/system.slice/slurmstepd.scope"
MULTI_STEPD = "/system.slice/node07_slurmstepd.scope"
USER_MANAGER = "/user.slice/user-1000.slice/user@1000.service"


def _unified(path: str, case: str, *info: Any, **named: Any) -> Any:
    """A cgroup v2 file of the one line ``0::path``, and what ``parse_cgroup`` reads in it."""
    return pytest.param(f"0::{path}\n", CgroupInfo(path, *info, **named), id=case)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        _unified(f"/system.slice/docker-{DOCKER_ID}.scope", "docker-systemd-driver",
                 DOCKER_ID, "docker", systemd_unit=f"docker-{DOCKER_ID}.scope"),
        pytest.param(
            f"12:devices:/docker/{DOCKER_ID}\n1:name=systemd:/docker/{DOCKER_ID}\n",
            CgroupInfo(f"/docker/{DOCKER_ID}", DOCKER_ID, "docker"),
            id="docker-cgroupfs-driver-v1",
        ),
        _unified(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD}.slice/"
                 f"{CONTAINERD}", "k8s-containerd-burstable", CTR_ID, "containerd", POD_UID,
                 systemd_unit=CONTAINERD),
        _unified(f"/kubepods.slice/kubepods-pod{POD}.slice/{CONTAINERD}",
                 "k8s-containerd-guaranteed", CTR_ID, "containerd", POD_UID,
                 systemd_unit=CONTAINERD),
        _unified(f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD}.slice/"
                 f"crio-{CTR_ID}.scope", "k8s-crio", CTR_ID, "crio", POD_UID,
                 systemd_unit=f"crio-{CTR_ID}.scope"),
        _unified(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD}.slice/"
                 f"crio-conmon-{CTR_ID}.scope", "k8s-crio-conmon", CTR_ID, "crio", POD_UID,
                 systemd_unit=f"crio-conmon-{CTR_ID}.scope"),
        _unified(f"/kubepods/burstable/pod{POD_UID}/{CTR_ID}", "k8s-cgroupfs-driver", CTR_ID,
                 None, POD_UID),
        _unified(f"/machine.slice/libpod-{CTR_ID}.scope/container", "podman", CTR_ID, "podman",
                 systemd_unit=f"libpod-{CTR_ID}.scope"),
        _unified(f"{STEPD}/job_4242/step_0/user/task_1", "slurm-v2-step", slurm_job="4242",
                 slurm_step="0", systemd_unit="slurmstepd.scope",
                 slurm_job_dir=f"{STEPD}/job_4242"),
        _unified(f"{STEPD}/job_77/step_batch/user/task_0", "slurm-v2-batch", slurm_job="77",
                 slurm_step="batch", systemd_unit="slurmstepd.scope",
                 slurm_job_dir=f"{STEPD}/job_77"),
        _unified(f"{MULTI_STEPD}/job_77/step_extern/slurm_processes",
                 "slurm-v2-multi-slurmd-extern", slurm_job="77", slurm_step="extern",
                 systemd_unit="node07_slurmstepd.scope", slurm_job_dir=f"{MULTI_STEPD}/job_77"),
        _unified(f"{STEPD}/system", "slurmstepd-itself-is-no-job",
                 systemd_unit="slurmstepd.scope"),
        pytest.param(
            "11:memory:/slurm/uid_1000/job_913/step_interactive/task_0\n"
            "5:devices:/slurm/uid_1000/job_913/step_interactive/task_0\n"
            "1:name=systemd:/system.slice/slurmd.service\n",
            CgroupInfo("/slurm/uid_1000/job_913/step_interactive/task_0",
                       slurm_job="913", slurm_step="interactive",
                       slurm_job_dir="/slurm/uid_1000/job_913"),
            id="slurm-v1",
        ),
        _unified("/system.slice/nvidia-persistenced.service", "systemd-service",
                 systemd_unit="nvidia-persistenced.service"),
        _unified("/user.slice/user-1000.slice/session-4.scope", "login-session",
                 systemd_unit="session-4.scope"),
        _unified(f"{USER_MANAGER}/app.slice/app-jupyter.service", "user-service",
                 systemd_unit="app-jupyter.service"),
        _unified(f"{USER_MANAGER}/init.scope", "user-manager", systemd_unit="init.scope"),
        _unified("/", "root"),
        pytest.param(
            "9:name=systemd:/\n4:memory:/process_api/836a\n0::/\n",
            CgroupInfo("/"),
            id="hybrid-prefers-unified",
        ),
        pytest.param(
            "3:cpu:/batch\n1:name=systemd:/system.slice/cron.service\n",
            CgroupInfo("/system.slice/cron.service", systemd_unit="cron.service"),
            id="v1-prefers-name-systemd",
        ),
        pytest.param("", None, id="empty"),
        pytest.param("garbage without colons\n", None, id="garbage"),
        pytest.param("0::relative/path\n", None, id="relative-path"),
        pytest.param("0::/docker/not-an-id\n", CgroupInfo("/docker/not-an-id"), id="odd-path"),
    ],
)  # fmt: skip
def test_parse_cgroup(text: str, expected: CgroupInfo | None) -> None:
    assert parse_cgroup(text) == expected


@pytest.mark.parametrize(
    ("text", "job_key"),
    [
        ("0::/system.slice/slurmstepd.scope/job_9/step_0/user/task_0\n", "slurm:9"),
        (f"0::/kubepods/pod{POD_UID}/{CTR_ID}\n", f"pod:{POD_UID}"),
        (f"0::/system.slice/docker-{DOCKER_ID}.scope\n", f"container:{DOCKER_ID}"),
        ("0::/system.slice/train.service\n", "unit:train.service"),
        ("0::/user.slice/user-1000.slice/session-4.scope\n", None),
        ("0::/user.slice/user-1000.slice\n", None),
        ("0::/\n", None),
    ],
)
def test_parsed_cgroups_group_jobs_but_never_shared_slices(text: str, job_key: str | None) -> None:
    info = parse_cgroup(text)
    assert info is not None
    assert info.job_key == job_key


# --- hostile names ----------------------------------------------------------------------------


@pytest.mark.parametrize("brk", LINE_BREAKS, ids=[f"U+{ord(c):04X}" for c in LINE_BREAKS])
def test_a_cgroup_name_cannot_inject_a_line_that_claims_another_slurm_job(brk: str) -> None:
    """A user names a cgroup "x<break>0::/system.slice/slurmstepd.scope/job_999/...": nested
    directories under their delegated subtree, printed by the kernel as one unescaped line."""
    path = f"{USER_SUBTREE}/x{brk}{STOLEN}"
    info = parse_cgroup(f"0::{path}\n")
    assert info is not None
    assert info.path == path
    assert info.slurm_job is None
    assert info.job_key != "slurm:999"


@pytest.mark.parametrize("brk", LINE_BREAKS, ids=[f"U+{ord(c):04X}" for c in LINE_BREAKS])
def test_kernel_lines_break_at_newline_only(brk: str) -> None:
    assert kernel_lines(f"a{brk}b\nc") == [f"a{brk}b", "c"]


@pytest.mark.parametrize(
    ("path", "slurm_job", "pod_uid", "container_id"),
    [
        pytest.param(f"{USER_SUBTREE}/system.slice/slurmstepd.scope/job_999/step_0", None,
                     None, None, id="slurm-below-user-subtree"),
        pytest.param(f"{USER_SUBTREE}/slurm/uid_0/job_999/step_0", None, None, None,
                     id="slurm-v1-below-user-subtree"),
        pytest.param(f"{USER_SUBTREE}/kubepods-pod{POD_UID.replace('-', '_')}.slice", None,
                     None, None, id="pod-below-user-subtree"),
        pytest.param(f"/system.slice/docker-{DOCKER_ID}.scope/system.slice/slurmstepd.scope/"
                     "job_999/step_0", None, None, DOCKER_ID, id="slurm-inside-a-container"),
        pytest.param(f"/system.slice/docker-{DOCKER_ID}.scope/kubepods-pod"
                     f"{POD_UID.replace('-', '_')}.slice/cri-containerd-{CTR_ID}.scope", None,
                     None, DOCKER_ID, id="pod-inside-a-container"),
        pytest.param(f"/system.slice/docker-{DOCKER_ID}.scope/docker-{CTR_ID}.scope", None,
                     None, DOCKER_ID, id="container-inside-a-container"),
        pytest.param("/system.slice/slurmstepd.scope/job_41/step_0/user/slurmstepd.scope/job_9",
                     "41", None, None, id="slurm-inside-a-slurm-job"),
        pytest.param("/system.slice/slurmstepd.scope/extra/job_999", None, None, None,
                     id="job-not-directly-below-slurmstepd"),
        pytest.param("/slurm/job_999/step_0", None, None, None, id="slurm-v1-without-uid"),
        pytest.param("/system.slice/slurmd.service/job_999", None, None, None,
                     id="slurmd-service-is-no-anchor"),
        pytest.param("/gpuwatchd-test-1/system.slice/slurmstepd.scope/job_42/step_0/user/task_0",
                     "42", None, None, id="slurm-below-a-root-made-prefix"),
        pytest.param("/user.slice/user-1000.slice/user@1000.service/user.slice/"
                     f"libpod-{CTR_ID}.scope/container", None, None, CTR_ID,
                     id="rootless-podman-keeps-its-container"),
    ],
)  # fmt: skip
def test_job_names_count_only_where_their_software_puts_them(
    path: str, slurm_job: str | None, pod_uid: str | None, container_id: str | None
) -> None:
    info = classify_cgroup_path(path)
    assert (info.slurm_job, info.pod_uid, info.container_id) == (slurm_job, pod_uid, container_id)


@pytest.mark.parametrize(
    ("path", "job_dir"),
    [
        ("/system.slice/slurmstepd.scope/job_42/step_0/user/task_0",
         "/system.slice/slurmstepd.scope/job_42"),
        ("/system.slice/node7_slurmstepd.scope/job_42/step_0",
         "/system.slice/node7_slurmstepd.scope/job_42"),
        ("/job_5/system.slice/slurmstepd.scope/job_42/step_0",
         "/job_5/system.slice/slurmstepd.scope/job_42"),
        ("/slurm/uid_0/job_5/step_0/task_0", "/slurm/uid_0/job_5"),
        (f"{USER_SUBTREE}/system.slice/slurmstepd.scope/job_999/step_0", None),
        ("/system.slice/train.service", None),
    ],
)  # fmt: skip
def test_slurm_job_dir_is_the_part_the_classifier_calls_the_job(
    path: str, job_dir: str | None
) -> None:
    assert classify_cgroup_path(path).slurm_job_dir == job_dir
    assert (job_dir is None) == (classify_cgroup_path(path).slurm_job is None)


# --- mountinfo --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("35 24 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n",
                     "/sys/fs/cgroup", id="unified"),
        pytest.param("30 24 0:26 / /sys/fs/cgroup ro - tmpfs tmpfs ro\n"
                     "31 30 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
                     "/sys/fs/cgroup/unified", id="hybrid"),
        pytest.param("30 24 0:26 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n", None,
                     id="v1-only"),
        pytest.param("31 30 0:27 / /mnt/my\\040cgroup rw shared:9 - cgroup2 none rw\n",
                     "/mnt/my cgroup", id="escaped-space"),
        pytest.param("31 30 0:27 / /mnt/cg\rroup rw - cgroup2 none rw\n", "/mnt/cg\rroup",
                     id="carriage-return-is-part-of-the-name"),
        pytest.param("", None, id="empty"),
        pytest.param("garbage - cgroup2\n", None, id="short-line"),
    ],
)  # fmt: skip
def test_cgroup2_mount_is_parsed_from_newline_separated_mountinfo(
    text: str, expected: str | None
) -> None:
    assert parse_cgroup2_mount(text) == expected


def test_unescape_mount_path_undoes_the_kernels_octal_escapes() -> None:
    assert unescape_mount_path("/a\\040b\\011c\\012d\\134e") == "/a b\tc\nd\\e"
    assert unescape_mount_path("/plain") == "/plain"


HYBRID = (
    "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    "40 31 0:37 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("25 20 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n", "/sys/fs/cgroup"),
        (HYBRID, "/sys/fs/cgroup/systemd"),  # where systemd sets its marks on a hybrid host
        (HYBRID.split("\n")[1] + "\n", "/sys/fs/cgroup/systemd"),  # legacy: v1 only
        ("32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n", None),
        # A FUSE mount a user named like systemd's hierarchy is not a cgroup mount.
        ("50 31 0:50 / /home/u/x rw - fuse.sshfs name=systemd rw,name=systemd\n", None),
        ("", None),
    ],
    ids=["unified", "hybrid", "legacy", "no-systemd-hierarchy", "fuse-look-alike", "empty"],
)  # fmt: skip
def test_parse_systemd_mount_finds_where_systemd_keeps_its_cgroups(
    text: str, expected: str | None
) -> None:
    assert parse_systemd_mount(text) == expected
