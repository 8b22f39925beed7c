"""Static checks of the systemd unit and the Debian packaging files (no container, no root).

Owns: what `systemd/gpuwatchd.service` must and must not say (docs/design-notes.md §9), the
`systemd-analyze verify` / `security --offline` gates, and the packaging files pointing at
files that exist. It must not build or install anything: tests/system/test_systemd.py does that.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuwatchd.decide.policy import Hook, ResetPolicy
from tests.support.unitfile import REPO, UNIT, memory_bytes, values

DEBIAN = REPO / "packaging" / "debian"
MAX_EXPOSURE = 2.5
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze not installed (apt-get install systemd)",
)


def seconds(value: str) -> float:
    """A systemd time span such as ``300s``, ``5min``, ``2min 30s`` in seconds."""
    units = {"ms": 0.001, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit or "s"]
    return total


@pytest.mark.parametrize(
    ("key", "bad_value"),
    [
        ("PrivateDevices", r".*"),  # hides /dev/nvidia*
        ("ProtectProc", r"invisible|ptraceable|noaccess"),  # hides other users' processes
        ("ProcSubset", r"pid"),  # hides /proc/devices and /proc/driver/nvidia
        ("SecureBits", r".*noroot.*"),  # strips CAP_SYS_ADMIN from nvidia-smi at exec
        ("PrivateUsers", r".*"),  # capabilities would not count in the host namespace
        ("PrivatePIDs", r".*"),  # NVML reports host PIDs
        ("User", r".*"),  # nvidia-smi --gpu-reset wants root
        ("DynamicUser", r".*"),
        ("ProtectHostname", r".*"),  # freezes {hostname} at the start's name (DHCP sets it later)
    ],
)
def test_unit_never_sets_directive_that_breaks_gpu_access(key: str, bad_value: str) -> None:
    offending = [v for v in values(key) if re.fullmatch(bad_value, v)]
    assert offending == [], f"{key}={offending} must not be in the unit"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("Type", "notify"),
        ("NotifyAccess", "main"),
        ("ExecStart", "/usr/bin/gpuwatchd run"),
        ("Restart", "on-failure"),
        ("RestartPreventExitStatus", "77 78"),
        ("KillMode", "mixed"),
        ("StateDirectory", "gpuwatchd"),
        ("StateDirectoryMode", "0700"),
        ("ConfigurationDirectory", "gpuwatchd"),
        ("DevicePolicy", "closed"),
        ("ProtectProc", "default"),
        ("ProcSubset", "all"),
        ("SyslogLevelPrefix", "yes"),
        ("NoNewPrivileges", "yes"),
    ],
)
def test_unit_sets_lifecycle_and_sandbox_directive(key: str, expected: str) -> None:
    assert values(key) == [expected]


def test_a_reload_validates_the_policy_before_it_signals_the_daemon() -> None:
    """systemd runs ExecReload lines in order and stops at the first failure: a bad policy
    makes `systemctl reload` fail visibly instead of a silent rejection in the daemon. The
    check is quiet: the journal gets its one OK line, not the whole merged policy."""
    assert values("ExecReload") == [
        "/usr/bin/gpuwatchd check-config --quiet",
        "/bin/kill -HUP $MAINPID",
    ]


def test_unit_capabilities_are_exactly_the_four_the_daemon_needs() -> None:
    (bounding,) = values("CapabilityBoundingSet")
    assert set(bounding.split()) == {
        "CAP_KILL",
        "CAP_SYS_PTRACE",
        "CAP_DAC_READ_SEARCH",
        "CAP_SYS_ADMIN",
    }
    assert set(" ".join(values("AmbientCapabilities")).split()) <= set(bounding.split())


def test_unit_allows_only_nvidia_device_groups() -> None:
    allowed = [v.split()[0] for v in values("DeviceAllow")]
    assert allowed, "DevicePolicy=closed without DeviceAllow= would hide every GPU"
    assert all(a.startswith("char-nvidia") for a in allowed), allowed
    assert "char-nvidia-frontend" in allowed


def test_unit_has_watchdog_and_start_limits() -> None:
    (watchdog,) = values("WatchdogSec")
    assert 0 < seconds(watchdog) <= 60
    assert values("StartLimitBurst", section="Unit")
    assert values("StartLimitIntervalSec", section="Unit")


def test_unit_stop_timeout_covers_a_reset_and_its_hooks() -> None:
    (timeout,) = values("TimeoutStopSec")
    reset = ResetPolicy()
    assert seconds(timeout) > reset.timeout + Hook(argv=("true",)).timeout


def test_unit_orders_after_nvidia_modules_and_persistenced() -> None:
    after = " ".join(values("After", section="Unit")).split()
    assert "nvidia-persistenced.service" in after
    assert "systemd-modules-load.service" in after


@needs_analyze
def test_systemd_analyze_verify_prints_nothing(tmp_path: Path) -> None:
    env = dict(os.environ, SYSTEMD_LOG_COLOR="0")
    proc = subprocess.run(
        [str(SYSTEMD_ANALYZE), "verify", "--man=no", str(UNIT)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    if not Path("/usr/bin/gpuwatchd").exists():
        # Only on a machine without the package: the binary is checked inside the container.
        lines = [ln for ln in lines if "/usr/bin/gpuwatchd is not executable" not in ln]
    assert lines == []


@needs_analyze
def test_systemd_analyze_security_exposure_at_most_2_5() -> None:
    proc = subprocess.run(
        [str(SYSTEMD_ANALYZE), "security", "--offline=true", "--no-pager", str(UNIT)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert match is not None, proc.stdout + proc.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, proc.stdout


def test_the_undrain_unit_takes_its_settings_only_as_the_script_reads_them() -> None:
    """gpuwatchd-slurm reads /etc/default/gpuwatchd-slurm itself (its own names only, never
    run), as the prolog and epilog do: an EnvironmentFile= would hand the timer's run every
    line of it (PATH=, LD_PRELOAD=, GPUWATCHD_SLURM_DEFAULTS=), which the scripts ignore."""
    text = (REPO / "systemd" / "gpuwatchd-slurm-undrain.service").read_text()
    assert not re.search(r"^\s*EnvironmentFile\s*=", text, re.MULTILINE)


def test_debian_install_files_name_files_that_exist() -> None:
    listed: list[str] = []
    for name in ("gpuwatchd.install", "gpuwatchd.manpages", "gpuwatchd.docs", "gpuwatchd.examples"):
        for line in (DEBIAN / name).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                listed.append(line.split()[0])
    missing = [p for p in listed if not list(REPO.glob(p))]
    assert missing == []
    assert "systemd/gpuwatchd.service" in listed
    assert "config/gpuwatchd.yaml" in listed


def test_debian_package_depends_on_procps_for_exec_reload() -> None:
    control = (DEBIAN / "control").read_text()
    assert re.search(r"^Depends:.*\bprocps\b", control, re.MULTILINE | re.DOTALL)
    assert "/bin/kill" in values("ExecReload")[-1]


# What bench/unit_limits.py measured, as the unit's comment and docs/operations.md state it.
MEASURED_PEAK_RSS_MIB = 80
MEASURED_PEAK_TASKS = 5


def test_unit_caps_memory_and_tasks_with_the_measured_headroom() -> None:
    (memory,) = values("MemoryMax")
    (tasks,) = values("TasksMax")
    assert memory_bytes(memory) >= 4 * MEASURED_PEAK_RSS_MIB * 1024**2
    assert int(tasks) >= 8 * MEASURED_PEAK_TASKS
    unit = UNIT.read_text()
    operations = (REPO / "docs" / "operations.md").read_text()
    for text in (unit, operations):
        assert f"{MEASURED_PEAK_RSS_MIB} MiB" in text
        assert f"{MEASURED_PEAK_TASKS} tasks" in text
    assert f"MemoryMax={memory}" in operations
    assert f"TasksMax={tasks}" in operations
