"""gpuwatchd as an installed .deb under real systemd and journald, in a systemd-nspawn container.

Owns the end-to-end service checks of issue 4: start waits for READY, STATUS in `systemctl
status`, a broken policy on reload keeps the old one, the watchdog restarts a stopped main
loop, an enforcing drop-in kills an orphan (journal PRIORITY 4 for the action), a hook (and so
nvidia-smi) gets CAP_SYS_ADMIN, stop exits 0, purge removes the unit.

One container is booted for the whole module (fixture ``ct``) from a cached Debian 12 root
file system (tests/systemd/make-rootfs.sh), copied per run. Everything the daemon sees runs
inside the container's PID namespace: the test only signals processes it created there.
Needs root, systemd-nspawn, nsenter, mmdebstrap or debootstrap, dpkg-buildpackage and lintian
(tests/systemd/host-setup.sh installs them); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support.container import _REASON, CI_DIR, HARNESS, REPO, UNIT, Container, wait_for
from tests.support.debbuild import built_deb
from tests.support.fakenvml import GiB, ensure_built, gpu
from tests.support.slurmfake import FAKE_SCONTROL

CAP_SYS_ADMIN = 21


pytestmark = [
    pytest.mark.systemd,
    pytest.mark.slow,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
]


TEST_DROPIN = f"""\
[Service]
Environment=FAKENVML_STATE={CI_DIR}/nvml.json FAKENVML_DEVICES_DIR={CI_DIR}/dev
Environment=GPUWATCHD_TEST_DIR={CI_DIR}
ReadWritePaths={CI_DIR}
WatchdogSec=5s
RestartSec=1s
"""

BASE_POLICY = f"""\
interval: 1s
devices_dir: {CI_DIR}/dev
nvml_timeout: 10s
"""

# namespace_check: false — inside the container the daemon is not in the host's PID
# namespace, and would rightly stay report-only; here NVML (the fake) lists container PIDs.
METRICS_FILE = "/var/lib/prometheus/node-exporter/gpuwatchd.prom"  # Debian's textfile dir
ENFORCING_POLICY = f"""\
dry_run: false
namespace_check: false
rules:
  - name: orphans
    kind: orphaned
    for: 1s
    steps:
      - {{signal: SIGTERM, wait: 2s}}
      - {{signal: SIGKILL, wait: 2s}}
limits:
  post_action_delay: 1s
reset:
  confirm_for: 2s
  timeout: 20s
  drain: [[{CI_DIR}/hook-caps, drain, "{{uuid}}"]]
  before: [[{CI_DIR}/hook-caps, before, "{{uuid}}"]]
  after: [[{CI_DIR}/hook-caps, after, "{{uuid}}"]]
metrics:
  textfile: {METRICS_FILE}
on_action:
  - [{CI_DIR}/notify-probe, inside, "{{user}}", "{{hostname}}", "{{uuid}}"]
  - [systemd-run, --wait, --quiet, --collect, -E, GPUWATCHD_OUTCOME, -E, GPUWATCHD_USER,
     {CI_DIR}/notify-probe, outside, "{{user}}", "{{hostname}}"]
"""


def idle_gpus() -> list[dict[str, Any]]:
    return [gpu(0), gpu(1)]


@pytest.fixture(scope="module")
def ct(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    t0 = time.monotonic()
    artifacts = Path(
        os.environ.get("GPUWATCHD_SYSTEMD_ARTIFACTS") or tempfile.mkdtemp(prefix="gpuwatchd-it-")
    )
    artifacts.mkdir(parents=True, exist_ok=True)
    print(f"\nsystemd test artifacts: {artifacts}")
    timings: dict[str, float] = {}

    def step(name: str, fn: Callable[[], Any]) -> Any:
        s = time.monotonic()
        result = fn()
        timings[name] = round(time.monotonic() - s, 1)
        return result

    lib = step("fakenvml", ensure_built)
    deb = step("build-deb", lambda: built_deb(tmp_path_factory))

    def make_rootfs() -> str:
        return subprocess.run(
            [str(HARNESS / "make-rootfs.sh")], check=True, capture_output=True, text=True
        ).stdout.strip()

    cached = Path(step("rootfs", make_rootfs))
    work = Path(tempfile.mkdtemp(prefix="gpuwatchd-ct-", dir="/var/tmp"))
    root, ci = work / "root", work / "ci"
    step("copy-rootfs", lambda: subprocess.run(["cp", "-a", str(cached), str(root)], check=True))
    ci.mkdir()
    (ci / "dev").mkdir()
    for name in ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm"):
        (ci / "dev" / name).touch()
    shutil.copy(deb, ci / deb.name)
    for tool in ("hook-caps", "orphan-maker", "notify-probe"):
        shutil.copy(HARNESS / tool, ci / tool)
    container = Container(root, ci, artifacts)
    container.nvml(idle_gpus())
    container.write("/etc/hostname", "gpuwatchd-it\n")
    shutil.copy(lib, root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
    shutil.copy(HARNESS / "fake-nvidia-smi", root / "usr/bin/nvidia-smi")
    try:
        step("boot", container.boot)
        container.run(["ldconfig"])
        installed = step(
            "install",
            lambda: container.run(["apt-get", "install", "-y", "-q", f"{CI_DIR}/{deb.name}"]),
        )
        (artifacts / "install.txt").write_text(installed.stdout + installed.stderr)
        timings["setup-total"] = round(time.monotonic() - t0, 1)
        print(f"systemd test setup timings (s): {timings}")
        yield container
    finally:
        (artifacts / "journal.txt").write_text(
            container.run(["journalctl", "--no-pager", "-o", "short-monotonic"], check=False).stdout
            if container.leader
            else ""
        )
        try:
            container.shutdown()
            with (artifacts / "journal.json").open("w") as out:
                subprocess.run(
                    ["journalctl", "-D", str(root / "var/log/journal"), "-o", "json"],
                    stdout=out,
                    stderr=subprocess.DEVNULL,
                    check=False,
                )
        finally:
            if container.nspawn is None or container.nspawn.poll() is not None:
                shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def configured(ct: Container) -> Container:
    """The installed service pointed at the fake NVML and device files, short watchdog."""
    ct.write(f"/etc/systemd/system/{UNIT}.d/50-test.conf", TEST_DROPIN)
    ct.write("/etc/gpuwatchd/conf.d/50-test.yaml", BASE_POLICY)
    ct.run(["systemctl", "daemon-reload"])
    return ct


# -- the package -----------------------------------------------------------------------------
def test_install_says_nothing_about_a_static_unit(ct: Container) -> None:
    said = (ct.artifacts / "install.txt").read_text()
    assert "static unit" not in said, said
    assert "gpuwatchd-slurm-undrain.service" not in said, said


def test_install_enables_and_starts_the_unit(ct: Container) -> None:
    assert ct.run(["systemctl", "is-enabled", UNIT], check=False).stdout.strip() == "enabled"
    assert (ct.root / "lib/systemd/system" / UNIT).is_file()
    assert (ct.root / "etc/gpuwatchd/gpuwatchd.yaml").is_file()
    assert (ct.root / "usr/share/man/man8/gpuwatchd.8.gz").is_file()
    assert (ct.root / "usr/share/man/man5/gpuwatchd.yaml.5.gz").is_file()
    # postinst started it; without FAKENVML_STATE the fake NVML fails, like a missing driver.
    assert ct.prop("ActiveState") == "active", ct.messages()[-20:]


@pytest.mark.parametrize(
    "unit", [UNIT, "gpuwatchd-slurm-undrain.service", "gpuwatchd-slurm-undrain.timer"]
)
def test_systemd_analyze_verify_is_silent_on_the_installed_unit(ct: Container, unit: str) -> None:
    proc = ct.run(
        ["systemd-analyze", "verify", "--man=no", f"/lib/systemd/system/{unit}"], check=False
    )
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def test_the_undrain_timer_is_enabled_and_does_nothing_without_slurm(ct: Container) -> None:
    """Installed everywhere, the timer must be harmless on a node without Slurm: its service
    ends at once, successfully."""
    timer = "gpuwatchd-slurm-undrain.timer"
    assert ct.run(["systemctl", "is-enabled", timer], check=False).stdout.strip() == "enabled"
    ct.run(["systemctl", "start", "gpuwatchd-slurm-undrain.service"])
    result = ct.run(
        ["systemctl", "show", "-p", "Result", "--value", "gpuwatchd-slurm-undrain.service"]
    )
    assert result.stdout.strip() == "success"


def test_installed_daemon_accepts_the_shipped_policy(ct: Container) -> None:
    proc = ct.run(["gpuwatchd", "check-config"], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- lifecycle -------------------------------------------------------------------------------
def test_start_waits_for_ready_after_first_poll(configured: Container) -> None:
    ct = configured
    ct.run(["systemctl", "stop", UNIT])
    delayed = [gpu(0, delays={"nvmlDeviceGetUUID": 3.0}), gpu(1)]
    ct.nvml(delayed)
    t0 = time.monotonic()
    ct.run(["systemctl", "start", UNIT])
    took = time.monotonic() - t0
    ct.nvml(idle_gpus())
    assert took >= 3.0, f"systemctl start returned after {took:.1f}s, before the first poll"
    assert ct.prop("ActiveState") == "active"
    assert ct.prop("StatusText") != ""


def test_the_daemon_sees_a_host_name_set_after_it_started(configured: Container) -> None:
    """{hostname} is the kernel's host name, read at start and on reload (docs/policy.md): a
    name set after the unit started (DHCP, a late hostnamectl) reaches the daemon on reload.
    The daemon reads it with gethostname(), in its own UTS namespace."""
    ct = configured
    ct.run(["systemctl", "start", UNIT])

    def reloaded() -> None:  # the unit stays "reloading" until the daemon says READY again
        ct.run(["systemctl", "reload", UNIT])
        wait_for("the reload to end", lambda: ct.prop("ActiveState") == "active", timeout=30)

    ct.run(["hostname", "gpu-renamed"])
    try:
        reloaded()
        pid = ct.prop("MainPID")
        seen = ct.run(["nsenter", "-t", pid, "-u", "hostname"]).stdout.strip()
        assert seen == "gpu-renamed"
    finally:
        ct.run(["hostname", "gpuwatchd-it"])
        reloaded()


def test_status_shows_the_status_line(configured: Container) -> None:
    ct = configured
    wait_for(
        "STATUS with 2 GPUs",
        lambda: "2 GPUs watched" in ct.prop("StatusText"),
        timeout=15,
    )
    out = ct.run(["systemctl", "status", "--no-pager", UNIT], check=False).stdout
    assert re.search(r'Status: "2 GPUs watched', out), out


def test_the_unit_follows_the_kernel_log_through_the_journal_in_its_sandbox(
    configured: Container,
) -> None:
    """health.kernel_log's default: ``journalctl --dmesg`` runs as the daemon's child under the
    unit's hardening (ProtectKernelLogs=yes kept), and nothing says it cannot be read."""
    ct = configured

    def tree() -> str:
        return ct.run(["systemctl", "status", "--no-pager", "--lines=0", UNIT], check=False).stdout

    wait_for("journalctl in the unit's cgroup", lambda: "journalctl --dmesg" in tree(), timeout=15)
    assert ct.journal("GPUWATCHD_EVENT=kernel_log.unavailable") == []
    assert ct.prop("ActiveState") == "active"


# Asks the daemon in the container directly, to say why it declined (a failure's diagnosis).
ASK_DAEMON = (
    "from gpuwatchd.served.scan_socket import ScanRequest, ask; "
    "print(ask(['/var/lib/gpuwatchd'], "
    "ScanRequest('/etc/gpuwatchd/gpuwatchd.yaml', True, False), 5.0)[:2])"
)


def test_scan_beside_the_unit_is_answered_by_the_daemon_inside_its_sandbox(
    configured: Container,
) -> None:
    """The unit's sandbox (PrivateNetwork=, RestrictAddressFamilies=AF_UNIX,
    ProtectSystem=strict) lets the daemon listen on state_dir/scan.sock, mode 0600; the
    installed `gpuwatchd scan` is answered by it, with the GPUs the command finds by itself
    (docs/scan.md, "Answered by the daemon")."""
    ct = configured
    sock = "/var/lib/gpuwatchd/scan.sock"
    wait_for(
        "the scan socket",
        lambda: ct.run(["test", "-S", sock], check=False).returncode == 0,
        timeout=15,
    )
    assert ct.run(["stat", "-c", "%a %U", sock]).stdout.split() == ["600", "root"]
    reports: dict[str, Any] = {}

    def answered() -> bool:
        out = ct.run(["gpuwatchd", "scan", "--json"], check=False)
        reports["daemon"] = json.loads(out.stdout or "{}")
        return bool(reports["daemon"].get("daemon_view", {}).get("answered_by") == "daemon")

    try:
        wait_for("a scan answered by the daemon", answered, timeout=20)
    except BaseException:
        asked = ct.run(["python3", "-c", ASK_DAEMON], check=False)
        print(f"the daemon's own word: {asked.stdout}{asked.stderr}")
        print(f"the last report's daemon_view: {reports['daemon'].get('daemon_view')}")
        raise
    fake = [f"FAKENVML_STATE={CI_DIR}/nvml.json", f"FAKENVML_DEVICES_DIR={CI_DIR}/dev"]
    alone = ct.run(
        ["env", "GPUWATCHD_ASK_DAEMON=0", *fake, "gpuwatchd", "scan", "--json"], check=False
    )
    itself = json.loads(alone.stdout or "{}")
    assert itself["daemon_view"]["answered_by"] == "this scan", alone.stderr
    assert [g["uuid"] for g in reports["daemon"]["gpus"]] == [g["uuid"] for g in itself["gpus"]]
    assert len(itself["gpus"]) == 2


def test_reload_with_broken_policy_fails_visibly_and_keeps_the_old_one(
    configured: Container,
) -> None:
    ct = configured
    pid = ct.prop("MainPID")
    ct.write("/etc/gpuwatchd/conf.d/90-broken.yaml", "interval: sometimes\n")
    try:
        # ExecReload runs check-config first: systemctl reload itself fails, naming the file.
        failed = ct.run(["systemctl", "reload", UNIT], check=False)
        assert failed.returncode != 0
        assert ct.prop("ActiveState") == "active"
        assert ct.prop("MainPID") == pid
        # check-config's word reaches journald through a stream it reads in its own time.
        wait_for(
            "the broken file named in the journal",
            lambda: any("90-broken.yaml" in m for m in ct.messages()),
            timeout=15,
        )
        assert any("90-broken.yaml" in m for m in ct.messages())
        # A SIGHUP sent by hand bypasses the check: the daemon rejects the policy itself, logs
        # it at error, and says so in STATUS until a good policy loads.
        ct.run(["kill", "-HUP", pid])
        wait_for(
            "config.reload_rejected in the journal",
            lambda: any(e.get("GPUWATCHD_EVENT") == EventName.CONFIG_RELOAD_REJECTED
                        for e in ct.journal()),
            timeout=15,
        )  # fmt: skip
        wait_for(
            "STATUS says the policy was rejected",
            lambda: "policy rejected" in ct.prop("StatusText"),
            timeout=30,
        )
    finally:
        (ct.root / "etc/gpuwatchd/conf.d/90-broken.yaml").unlink()
    rejected = [
        e for e in ct.journal() if e.get("GPUWATCHD_EVENT") == EventName.CONFIG_RELOAD_REJECTED
    ]
    assert rejected[-1]["PRIORITY"] == "3"
    ct.run(["systemctl", "reload", UNIT])  # the good policy reloads fine
    wait_for(
        "STATUS no longer says rejected",
        lambda: "policy rejected" not in ct.prop("StatusText"),
        timeout=30,
    )
    time.sleep(1.5)
    assert ct.prop("ActiveState") == "active"
    assert ct.prop("MainPID") == pid


def test_a_drop_in_rejected_at_start_leaves_the_node_watched_and_says_so(
    configured: Container,
) -> None:
    """A restart (as at boot) with a drop-in the daemon rejects: the unit is active, on the last
    policy it accepted (saved in /var/lib/gpuwatchd), and says so at critical in the journal,
    in STATUS and in `gpuwatchd status` (exit 1); a fixed policy reloads as usual."""
    ct = configured
    saved = ct.root / "var/lib/gpuwatchd/policy.accepted.yaml"
    wait_for("the accepted policy to be saved", saved.exists, timeout=15)
    assert saved.stat().st_mode & 0o777 == 0o600
    assert "\ninterval: 1s\n" in saved.read_text()
    ct.write("/etc/gpuwatchd/conf.d/90-broken.yaml", "interval: sometimes\n")
    try:
        restarted = ct.run(["systemctl", "restart", UNIT], check=False)
        assert restarted.returncode == 0, restarted.stderr
        assert ct.prop("ActiveState") == "active"
        assert "policy rejected at start" in ct.prop("StatusText")

        def start_rejected() -> list[dict[str, Any]]:  # sent before READY; journald may lag
            return [
                e
                for e in ct.journal()
                if e.get("GPUWATCHD_EVENT") == EventName.CONFIG_START_REJECTED
            ]

        wait_for("config.start_rejected in the journal", lambda: bool(start_rejected()), timeout=15)
        rejected = start_rejected()
        assert rejected, ct.messages()[-10:]
        assert rejected[-1]["PRIORITY"] == "2"  # critical
        assert "90-broken.yaml" in rejected[-1]["GPUWATCHD_ERROR"]
        assert "policy.accepted.yaml" in rejected[-1]["GPUWATCHD_RUNNING"]
        status = ct.run(["gpuwatchd", "status", "--json"], check=False)
        assert status.returncode == 1, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["running"] is True
        assert report["policy"]["rejected"]["at_start"] is True
        assert report["daemon"]["interval"] == 1.0  # the accepted policy's, from 50-test.yaml
    finally:
        (ct.root / "etc/gpuwatchd/conf.d/90-broken.yaml").unlink()
    ct.run(["systemctl", "reload", UNIT])
    wait_for(
        "STATUS no longer says rejected",
        lambda: "rejected" not in ct.prop("StatusText"),
        timeout=30,
    )


def test_watchdog_restarts_a_stopped_main_loop(configured: Container) -> None:
    ct = configured
    before = int(ct.prop("NRestarts"))
    pid = ct.prop("MainPID")
    ct.run(["kill", "-STOP", pid])
    took = wait_for(
        "a watchdog restart",
        lambda: (
            ct.prop("MainPID") not in (pid, "0")
            and ct.prop("ActiveState") == "active"
            and int(ct.prop("NRestarts")) > before
        ),
        timeout=30,
    )
    assert took < 20
    wait_for(
        "the watchdog timeout in the journal",
        lambda: any("Watchdog timeout" in m for m in ct.messages()),
        timeout=15,
    )
    assert any("Watchdog timeout" in m for m in ct.messages())


# -- enforcing -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def enforcing(configured: Container) -> Container:
    ct = configured
    ct.run(["mkdir", "-p", os.path.dirname(METRICS_FILE)])
    ct.write("/etc/gpuwatchd/conf.d/60-enforcing.yaml", ENFORCING_POLICY)
    ct.run(["systemctl", "restart", UNIT])
    return ct


def test_enforcing_kills_an_orphan_and_logs_the_action_at_warning(enforcing: Container) -> None:
    ct = enforcing
    pidfile = f"{CI_DIR}/orphan.pids"
    ct.run(
        [
            "systemd-run",
            "--scope",
            "--quiet",
            "--unit=gpuwatchd-it-job",
            f"{CI_DIR}/orphan-maker",
            f"{CI_DIR}/dev",
            "0",
            pidfile,
        ]
    )
    parent, child = (int(x) for x in (ct.ci / "orphan.pids").read_text().split())
    # NVML still lists the dead trainer (the parent) with the memory its worker pins.
    ct.nvml([gpu(0, allocated=GiB, processes=[{"pid": parent, "used_memory": GiB}]), gpu(1)])

    def child_gone() -> bool:
        return ct.run(["kill", "-0", str(child)], check=False).returncode != 0

    wait_for(f"orphan {child} to be killed", child_gone, timeout=45)

    def about_child() -> list[dict[str, Any]]:
        return [
            e
            for e in ct.journal()
            if re.search(rf"\bpid={child}\b", str(e.get("MESSAGE", "")))
            and re.search(r"SIG(TERM|KILL)", str(e.get("MESSAGE", "")))
        ]

    # action.signal is logged once the kill has returned, and journald reads it in its own time.
    wait_for(
        "the signal to the orphan in the journal",
        lambda: any(e.get("GPUWATCHD_EVENT") == EventName.ACTION_SIGNAL for e in about_child()),
        timeout=15,
    )
    about = about_child()
    assert about, "no journal entry names the signal sent to the orphan"
    # One warning line per action: the signal itself; the step that led to it is info.
    actions = [e for e in about if e.get("GPUWATCHD_EVENT") == EventName.ACTION_SIGNAL]
    assert actions
    assert {e["PRIORITY"] for e in actions} == {"4"}, actions
    assert {e["PRIORITY"] for e in about if e not in actions} <= {"6", "7"}


def _probe(ct: Container, name: str) -> dict[str, str]:
    path = ct.ci / f"notify-{name}.txt"
    wait_for(f"the on_action hook {name!r}", path.exists, timeout=30)
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition(
            ": " if line.startswith(("args", "netns", "cgroup")) else "="
        )
        if sep:
            found[key] = value
    return found


def test_on_action_runs_after_the_kill_with_its_placeholders_also_outside_the_sandbox(
    enforcing: Container,
) -> None:
    """Runs after the orphan kill above: both notifications ran, with {user}, {hostname} and
    {uuid} filled in; the one started through systemd-run ran outside the unit's network
    sandbox (another network namespace, not in gpuwatchd.service's cgroup)."""
    ct = enforcing
    inside, outside = _probe(ct, "inside"), _probe(ct, "outside")
    user, host, uuid = inside["args"].split()
    assert (user, host) == ("root", "gpuwatchd-it")
    assert uuid.startswith("GPU-")
    assert inside["GPUWATCHD_EVENT"] == "on_action"
    assert inside["GPUWATCHD_ACTION"] == "signal"
    assert inside["GPUWATCHD_OUTCOME"] == "freed"
    assert outside["args"] == "root gpuwatchd-it"
    assert outside["GPUWATCHD_OUTCOME"] == "freed"  # passed through with systemd-run -E
    daemon_net = ct.run(["readlink", f"/proc/{ct.prop('MainPID')}/ns/net"]).stdout.strip()
    assert inside["netns"] == daemon_net
    assert outside["netns"] != daemon_net
    assert UNIT in inside["cgroup"]
    assert UNIT not in outside["cgroup"]

    def ran() -> list[dict[str, Any]]:  # logged by the main loop at the poll after they ran
        return [
            e
            for e in ct.journal()
            if e.get("GPUWATCHD_EVENT") == EventName.HOOK_RUN
            and e.get("GPUWATCHD_HOOK") == "on_action"
        ]

    wait_for("hook.run for both notifications", lambda: len(ran()) >= 2, timeout=30)
    assert {e["PRIORITY"] for e in ran()} == {"4"}
    assert {e.get("GPUWATCHD_RETURNCODE") for e in ran()} == {"0"}


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + ("{" if labels else " ")):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_the_metrics_file_appears_and_counts_the_action(enforcing: Container) -> None:
    """Runs after the orphan kill above: node_exporter's textfile shows the signal."""
    path = enforcing.root / METRICS_FILE.lstrip("/")
    wait_for("the metrics file", path.exists, timeout=30)
    assert path.stat().st_mode & 0o777 == 0o644, "node_exporter must be able to read it"
    wait_for(
        "a delivered signal in the metrics",
        lambda: (
            (_metric(path.read_text(), "gpuwatchd_signals_total", outcome="delivered") or 0) >= 1
        ),
        timeout=30,
    )
    first = _metric(path.read_text(), "gpuwatchd_last_successful_poll_timestamp_seconds")
    assert first is not None
    wait_for(
        "the metrics to change with the next poll",
        lambda: (
            _metric(path.read_text(), "gpuwatchd_last_successful_poll_timestamp_seconds") != first
        ),
        timeout=30,
    )
    assert _metric(path.read_text(), "gpuwatchd_dry_run") == 0


def test_status_answers_while_the_daemon_runs(enforcing: Container) -> None:
    ct = enforcing
    text = ct.run(["gpuwatchd", "status"], check=False)
    assert text.returncode in (0, 1), text.stdout + text.stderr  # running (1: needs attention)
    assert "enforcing" in text.stdout
    report = json.loads(ct.run(["gpuwatchd", "status", "--json"], check=False).stdout)
    assert report["running"] is True
    assert report["daemon"]["pid"] == int(ct.prop("MainPID"))
    assert any(a["event"] == EventName.ACTION_SIGNAL for a in report["recent_actions"])


def test_hook_gets_cap_sys_admin_like_nvidia_smi(enforcing: Container) -> None:
    ct = enforcing
    # Memory no process holds on GPU 1: ghost memory, which leads to a reset and its hooks.
    ct.nvml([gpu(0), gpu(1, allocated=2 * GiB)])
    hooks = ct.ci

    def any_hook() -> bool:
        return any(hooks.glob("hook-*.txt"))

    wait_for("a reset hook to run", any_hook, timeout=60)
    for report in hooks.glob("hook-*.txt"):
        caps = dict(line.split(":\t") for line in report.read_text().splitlines() if "\t" in line)
        assert int(caps["CapEff"], 16) & (1 << CAP_SYS_ADMIN), report.read_text()
    smi = ct.ci / "nvidia-smi.log"
    if smi.exists():
        for line in smi.read_text().splitlines():
            assert int(json.loads(line)["CapEff"], 16) & (1 << CAP_SYS_ADMIN), line


def test_journal_priorities_follow_the_event_levels(enforcing: Container) -> None:
    """Events arrive as native journal entries (their own PRIORITY and fields); nothing is a
    raw line with a visible <N> prefix."""
    entries = [e for e in enforcing.journal() if e.get("GPUWATCHD_EVENT")]
    assert entries
    assert {e.get("_TRANSPORT") for e in entries} == {"journal"}
    assert all(not str(e.get("MESSAGE", "")).startswith("<") for e in enforcing.journal())
    assert {"4", "6"} <= {e["PRIORITY"] for e in entries}


def test_journal_lines_carry_no_none_no_empty_field_and_no_long_float(
    enforcing: Container,
) -> None:
    """What `journalctl -u gpuwatchd` shows after the sentence: only known values, each a
    value, floats with at most three decimals."""
    messages = [str(e.get("MESSAGE", "")) for e in enforcing.journal() if e.get("GPUWATCHD_EVENT")]
    assert messages
    for message in messages:
        assert "None" not in message, message
        tail = message.split(" event=", 1)[-1]
        assert not re.search(r"(^|\s)[\w.]+=(\s|$)", tail), message
        assert not re.search(r"=-?\d+\.\d{4,}(\s|$)", tail), message


# -- Slurm prolog and epilog beside the running daemon ---------------------------------------
SLURM_DIR = f"{CI_DIR}/slurm"
SLURM_NODE = "gpuwatchd-it"


@pytest.fixture(scope="module")
def slurm(enforcing: Container) -> Container:
    """The installed Slurm scripts, a fake scontrol (tests/system/test_contrib_slurm.py's) at
    /srv/ci/slurm/scontrol, and an idle node."""
    ct = enforcing
    folder = ct.ci / "slurm"
    folder.mkdir(exist_ok=True)
    (folder / "scontrol").write_text(FAKE_SCONTROL)
    (folder / "scontrol").chmod(0o755)
    _slurm_node(ct, "IDLE", "")
    ct.nvml(idle_gpus())
    return ct


def _slurm_node(ct: Container, state: str, reason: str) -> None:
    folder = ct.ci / "slurm"
    (folder / "node.state").write_text(state)
    (folder / "node.reason").write_text(reason)
    (folder / "calls.log").write_text("")


def _slurm_updates(ct: Container) -> list[list[str]]:
    lines = (ct.ci / "slurm" / "calls.log").read_text().splitlines()
    return [line.split("\x1f")[:-1] for line in lines if line.startswith("update")]


def _slurm_script(ct: Container, name: str, gpus: str) -> subprocess.CompletedProcess[str]:
    """Run /usr/lib/gpuwatchd/slurm/gpuwatchd-<name> as slurmd would, pointed at the fake
    NVML the daemon sees and at the fake scontrol."""
    (ct.ci / "slurm" / "calls.log").write_text("")
    return ct.run(
        [
            "env",
            f"FAKENVML_STATE={CI_DIR}/nvml.json",
            f"FAKENVML_DEVICES_DIR={CI_DIR}/dev",
            f"GPUWATCHD_SCONTROL={SLURM_DIR}/scontrol",
            f"SLURMD_NODENAME={SLURM_NODE}",
            f"SLURM_JOB_GPUS={gpus}",
            "GPUWATCHD_EPILOG_TIMEOUT=40s",
            f"/usr/lib/gpuwatchd/slurm/gpuwatchd-{name}",
        ],
        check=False,
        timeout=120,
    )


def test_epilog_beside_the_daemon_exits_0_after_a_job_and_drains_nothing(slurm: Container) -> None:
    """A job leaves an orphan on GPU 0: the installed daemon kills it while the epilog waits;
    once the driver has freed the memory the epilog exits 0 without touching the node."""
    ct = slurm
    assert ct.prop("ActiveState") == "active"
    pidfile = f"{CI_DIR}/orphan-slurm.pids"
    maker = [f"{CI_DIR}/orphan-maker", f"{CI_DIR}/dev", "0", pidfile]
    ct.run(["systemd-run", "--scope", "--quiet", "--unit=gpuwatchd-it-slurm-job", *maker])
    parent, child = (int(x) for x in (ct.ci / "orphan-slurm.pids").read_text().split())
    ct.nvml([gpu(0, allocated=GiB, processes=[{"pid": parent, "used_memory": GiB}]), gpu(1)])

    def driver() -> None:  # as the driver does once the last holder is gone
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if ct.run(["kill", "-0", str(child)], check=False).returncode != 0:
                break
            time.sleep(0.2)
        ct.nvml(idle_gpus())

    freeing = threading.Thread(target=driver, daemon=True)
    freeing.start()
    epilog = _slurm_script(ct, "epilog", "0")
    freeing.join(timeout=70)
    assert epilog.returncode == 0, epilog.stdout + epilog.stderr
    assert "is running; waiting" in epilog.stderr  # it waited for the daemon, acted on nothing
    assert _slurm_updates(ct) == []
    assert ct.run(["kill", "-0", str(child)], check=False).returncode != 0


def test_epilog_and_prolog_refuse_a_gpu_that_stays_dirty(slurm: Container) -> None:
    """The driver asks to stop placing work on GPU 1 (recovery action DRAIN_P2P: the daemon
    never acts on it, and a process that merely holds a GPU is no dirt since the one verdict,
    issue 21): the epilog exits non-zero and drains naming GPU 1 and the finding; the prolog
    refuses it; a job on GPU 0 still starts, and our drain stays while GPU 1 is dirty."""
    ct = slurm
    ct.nvml([gpu(0), {**gpu(1), "recovery_action": 3}])
    try:
        uuid1 = gpu(1)["uuid"]
        reason = f"gpuwatchd: {uuid1} drain_required"
        drain = ["update", f"nodename={SLURM_NODE}", "state=drain", f"reason={reason}"]

        _slurm_node(ct, "IDLE", "")
        epilog = _slurm_script(ct, "epilog", "1")
        assert epilog.returncode == 1, epilog.stdout + epilog.stderr
        assert _slurm_updates(ct) == [drain]

        _slurm_node(ct, "IDLE", "")
        prolog = _slurm_script(ct, "prolog", "1")
        assert prolog.returncode == 1, prolog.stdout + prolog.stderr
        assert _slurm_updates(ct) == [drain]
        assert (ct.ci / "slurm" / "node.reason").read_text() == reason

        other = _slurm_script(ct, "prolog", "0")
        assert other.returncode == 0, other.stdout + other.stderr
        assert _slurm_updates(ct) == []  # GPU 1 is still dirty: our drain stays
    finally:
        ct.nvml(idle_gpus())
    ct.run(["systemctl", "is-active", UNIT])
    lifted = _slurm_script(ct, "epilog", "0")
    assert lifted.returncode == 0, lifted.stdout + lifted.stderr
    assert _slurm_updates(ct) == [["update", f"nodename={SLURM_NODE}", "state=resume"]]


# -- stop and purge --------------------------------------------------------------------------
def test_stop_is_clean(configured: Container) -> None:
    ct = configured
    ct.run(["systemctl", "stop", UNIT])
    assert ct.prop("ActiveState") == "inactive"
    assert ct.prop("Result") == "success"
    assert ct.prop("ExecMainStatus") == "0"


def test_purge_removes_the_unit_and_state(ct: Container) -> None:
    ct.run(["gpuwatchd", "--version"])  # the package's modules are used (and compiled) first
    listed = ct.run(["dpkg", "-L", "gpuwatchd"]).stdout.split()
    folders = {p for p in listed if "gpuwatchd" in p and (ct.root / p.lstrip("/")).is_dir()}
    ct.run(["apt-get", "purge", "-y", "-q", "gpuwatchd"])
    left = sorted(
        str(path)
        for folder in folders
        if (ct.root / folder.lstrip("/")).exists()
        for path in (ct.root / folder.lstrip("/")).rglob("*")
    )
    assert not left, f"purge left files of the package behind: {left[:10]}"
    assert not (ct.root / "lib/systemd/system" / UNIT).exists()
    assert not (ct.root / "var/lib/gpuwatchd").exists()
    assert not (ct.root / "etc/systemd/system/multi-user.target.wants" / UNIT).exists()
    load = ct.run(["systemctl", "show", "-p", "LoadState", "--value", UNIT]).stdout.strip()
    assert load == "not-found"


# -- native journal fields -------------------------------------------------------------------
def _documented_message_id(event: str) -> str:
    """The MESSAGE_ID docs/events.md lists for ``event``."""
    text = (REPO / "docs" / "events.md").read_text()
    found = re.search(rf"^\| `{re.escape(event)}` \| `([0-9a-f]{{32}})` \|$", text, re.M)
    assert found, f"docs/events.md lists no MESSAGE_ID for {event}"
    return found.group(1)


def test_actions_are_native_journal_entries_with_their_fields(enforcing: Container) -> None:
    """After the orphan kill above (or one made here when run alone), the action is a native
    entry: its own fields, the documented MESSAGE_ID, PRIORITY 4, a sentence first."""
    ct = enforcing

    def delivered() -> list[dict[str, Any]]:
        query = ["GPUWATCHD_EVENT=action.signal", "OUTCOME=delivered"]
        return [
            e for e in ct.journal(*query) if e.get("GPUWATCHD_EVENT") == EventName.ACTION_SIGNAL
        ]

    if not delivered():  # run on its own: make the daemon act once
        pidfile = f"{CI_DIR}/orphan-journal.pids"
        maker = [f"{CI_DIR}/orphan-maker", f"{CI_DIR}/dev", "0", pidfile]
        ct.run(["systemd-run", "--scope", "--quiet", "--unit=gpuwatchd-it-journal", *maker])
        parent, _child = (int(x) for x in (ct.ci / "orphan-journal.pids").read_text().split())
        ct.nvml([gpu(0, allocated=GiB, processes=[{"pid": parent, "used_memory": GiB}]), gpu(1)])
        try:
            wait_for("an action.signal entry", lambda: bool(delivered()), timeout=45)
        finally:
            ct.nvml(idle_gpus())

    entries = delivered()
    assert entries, "no delivered action.signal entry in the journal"
    documented = _documented_message_id(EventName.ACTION_SIGNAL)
    for e in entries:
        assert e["_TRANSPORT"] == "journal", e  # the native protocol, not the stderr stream
        assert e["SYSLOG_IDENTIFIER"] == "gpuwatchd"
        assert e["MESSAGE_ID"] == documented
        assert e["PRIORITY"] == "4"
        assert re.fullmatch(r"[1-9][0-9]*", e["TARGET_PID"]), e
        assert e["SIGNAL"] in ("SIGTERM", "SIGKILL")
        assert e["DRY_RUN"] == "false"
        assert e["RULE"] == "orphans"
        assert e["GPU_UUID"].startswith("GPU-")
        said = (
            rf"Sent {e['SIGNAL']} to PID {e['TARGET_PID']}(?: \([^)]*\))?"
            rf" on {re.escape(e['GPU_UUID'])} \(rule orphans, step [12]\)\. "
        )
        assert re.match(said, e["MESSAGE"]), e["MESSAGE"]
        assert " event=action.signal " in e["MESSAGE"]  # then the fields as logfmt
        assert f" pid={e['TARGET_PID']} " in e["MESSAGE"]
    # The id alone finds them too, without naming the unit.
    by_id = ct.run(["journalctl", f"MESSAGE_ID={documented}", "-o", "json", "--no-pager"]).stdout
    assert len([line for line in by_id.splitlines() if line.strip()]) >= len(entries)
