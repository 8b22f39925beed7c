"""The command line's contract: exit codes, one-line errors, and NVML failures seen by `scan`.

These runs start no processes of their own besides gpuwatchd, so they need no PID namespace
(one runs gpuwatchd alone in one, so that every process it sees is its own).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd import __version__
from gpuwatchd.cli.check_clean import RUNNING_POLICY
from gpuwatchd.cli.main import main
from gpuwatchd.config.schema import load_policy
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.assess.state import AssessState
from gpuwatchd.decide.plan.state import PlanState, SeenFinding
from gpuwatchd.state.accepted import save_accepted
from gpuwatchd.state.directory import StateDir
from gpuwatchd.state.pause import set_pause
from gpuwatchd.state.saved import STATE, StateStore
from tests.support.fakenvml import NVML_ERROR_DRIVER_NOT_LOADED, GiB, gpu, process
from tests.support.simhost import SimHost, needs_pid_namespace, pid_namespace_command


@pytest.fixture
def host(tmp_path: Path) -> SimHost:
    return SimHost(tmp_path, gpus=2)


def test_version_flag_prints_the_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == f"gpuwatchd {__version__}"


def test_scan_without_any_nvidia_library_exits_69_with_one_line(
    host: SimHost, tmp_path: Path
) -> None:
    empty = tmp_path / "nolib"
    empty.mkdir()
    env = host.env()
    env["LD_LIBRARY_PATH"] = str(empty)
    result = host.run(
        [sys.executable, "-m", "gpuwatchd", "scan", "--config", str(host.config())], env=env
    )
    assert result.returncode == 69
    lines = result.stderr.splitlines()
    assert len(lines) == 1, "one problem, one line (no logfmt warning before it)"
    assert lines[0].startswith("gpuwatchd:")
    assert "NVML" in lines[0] or "driver" in lines[0]
    assert result.stdout == ""
    with_json = host.run(
        [sys.executable, "-m", "gpuwatchd", "scan", "--json", "--config", str(host.config())],
        env=env,
    )
    assert with_json.returncode == 69
    report = json.loads(with_json.stdout)
    assert report["nvml"]["available"] is False
    assert report["nvml"]["error"]
    assert report["gpus"] == []
    assert len(with_json.stderr.splitlines()) == 1


def test_scan_when_the_driver_fails_to_initialise_exits_69(host: SimHost) -> None:
    host.nvml([gpu(0)], init_error=NVML_ERROR_DRIVER_NOT_LOADED)
    result = host.gpuwatchd("scan", "--config", str(host.config()))
    assert result.returncode == 69
    assert "gpuwatchd:" in result.stderr


def test_scan_with_a_hung_nvml_call_returns_within_timeout_and_says_wedged(
    host: SimHost,
) -> None:
    config = host.config(nvml_timeout="2s")
    host.nvml([gpu(0), gpu(1)])
    started = time.monotonic()
    answered = host.gpuwatchd("scan", "--json", "--config", str(config), timeout=30)
    start_up = time.monotonic() - started  # the same scan, the driver answering: start-up now
    assert answered.returncode == 0, answered.stderr
    host.nvml([gpu(0), gpu(1)], delays={"nvmlDeviceGetComputeRunningProcesses_v3": 60.0})
    started = time.monotonic()
    result = host.gpuwatchd("scan", "--json", "--config", str(config), timeout=30)
    elapsed = time.monotonic() - started
    report = json.loads(result.stdout)
    assert report["nvml"]["wedged"] is True
    assert result.returncode == 69
    assert "wedged" in result.stderr
    # The deadline is the feature: nvml_timeout + 1 s past the start-up (the interpreter's and
    # the NVML worker's, as long as a loaded machine makes them), with 1.5 s to spare.
    assert elapsed < start_up + 2 + 1 + 1.5, (elapsed, start_up)
    text = host.gpuwatchd("scan", "--config", str(config), timeout=30).stdout
    assert "wedged" in text


def test_scan_marks_a_lost_gpu_and_reports_the_others(host: SimHost) -> None:
    host.nvml([gpu(0, lost=True), gpu(1, allocated=3 * GiB)])
    report = host.scan_json()
    lost, fine = report["gpus"]
    assert lost["lost"] is True
    assert fine["lost"] is False
    assert fine["memory"]["used"] == 3 * GiB


def test_scan_with_only_the_v1_memory_query_reports_used_as_unknown(host: SimHost) -> None:
    host.nvml([gpu(0, allocated=3 * GiB, v2_memory=False), gpu(1)])
    report = host.scan_json()
    assert report["gpus"][0]["memory"]["used"] is None
    assert [f["kind"] for f in report["findings"]] == []


def test_check_config_rejects_an_unknown_key_with_exit_78(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("interval: 5s\nintreval: 3s\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "check-config", str(config)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 78
    assert "intreval" in result.stderr
    assert "interval" in result.stderr
    assert str(config) in result.stderr


def test_check_config_prints_the_effective_policy(host: SimHost) -> None:
    result = host.gpuwatchd("check-config", str(host.config(interval="7s")))
    assert result.returncode == 0, result.stderr
    assert "interval: 7s" in result.stdout or "interval: 7.0" in result.stdout


def test_run_with_a_missing_config_file_exits_78(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(tmp_path / "none.yaml")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 78
    assert "none.yaml" in result.stderr


def test_run_over_a_drop_in_whose_name_is_not_utf8_runs_the_last_accepted_policy(
    host: SimHost,
) -> None:
    """Refused, that drop-in takes the path of any other rejected at start (not exit 78):
    ``EventName.CONFIG_START_REJECTED`` names it, and the last accepted policy, in this
    state_dir, runs."""
    config = host.config()
    with StateDir.open(str(host.state_dir)) as state_dir:
        save_accepted(state_dir, load_policy(str(config), check_permissions=False))
    (host.root / "conf.d").mkdir()
    with open(os.path.join(os.fsencode(host.root / "conf.d"), b"10-r\xe4te.yaml"), "wb") as file:
        file.write(b"dry_run: false\n")
    host.nvml([gpu(0), gpu(1)])
    result = host.gpuwatchd("run", "--once", "--timeout", "10s", "--config", str(config))
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if EventName.CONFIG_START_REJECTED in x]
    assert "10-r\\\\xe4te.yaml: the file name is not UTF-8" in line
    assert f"the last accepted policy ({host.state_dir}/policy.accepted.yaml" in line


def _without_capabilities(
    host: SimHost, *args: str, alone: bool = False
) -> subprocess.CompletedProcess[str]:
    """``gpuwatchd args`` as root with every capability dropped (setpriv); ``alone``: in a PID
    namespace of its own."""
    argv = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", sys.executable, "-m", "gpuwatchd"]
    if alone:
        argv = [*(pid_namespace_command() or []), *argv]
    return host.run([*argv, *args])


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv (to drop capabilities and to start another user's process)",
)
@pytest.mark.parametrize("command", ["scan", "check-clean"])
def test_scan_without_capabilities_reports_unreadable_holders_and_exits_77(
    host: SimHost, command: str
) -> None:
    """Another user's holder cannot be inspected without CAP_SYS_PTRACE/CAP_DAC_READ_SEARCH.
    check-clean, judging by the policy the daemon runs as the files do not validate, says both
    and exits 77 (run as root), not 78: the Slurm scripts read that 78 as "nothing dirty"."""
    config = host.config()
    if command == "check-clean":
        with StateDir.open(str(host.state_dir)) as state_dir:
            save_accepted(state_dir, load_policy(str(config), check_permissions=False))
        (host.root / "conf.d").mkdir()
        (host.root / "conf.d" / "90-broken.yaml").write_text("interval: sometimes\n")
    device = host.dev("nvidia0")[0]
    holder = subprocess.Popen(  # our own child, run as nobody, holding the GPU's device file
        [
            "sh",
            "-c",
            f'exec 3<>"{device}"; '
            "exec setpriv --reuid=65534 --regid=65534 --clear-groups sleep 1000",
        ]
    )
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{holder.pid}/comm").read_text().startswith("sleep"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        host.nvml([gpu(0, allocated=GiB, processes=[process(holder.pid, GiB)])])
        args = ["--json"] if command == "scan" else []
        result = _without_capabilities(host, command, *args, "--config", str(config))
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 77, result.stderr
    assert "run as root" in result.stderr
    if command == "check-clean":
        assert RUNNING_POLICY in result.stderr
        return
    report = json.loads(result.stdout)
    assert holder.pid in report["unreadable_pids"]


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to drop capabilities",
)
@pytest.mark.parametrize(("dry_run", "code"), [(False, 77), (True, 77)])
def test_run_without_capabilities_refuses_to_enforce_but_may_dry_run(
    host: SimHost, dry_run: bool, code: int
) -> None:
    host.nvml([gpu(0)])
    config = str(host.config(dry_run=dry_run))
    result = _without_capabilities(host, "run", "--once", "--timeout", "10s", "--config", config)
    output = result.stdout + result.stderr
    assert result.returncode == code, output
    event = EventName.DAEMON_LIMITED_PERMISSIONS if dry_run else EventName.DAEMON_NO_PERMISSION
    assert event in output
    assert "CAP_KILL" in output
    # A dry run proceeds, but what it could not inspect proves no GPU clean (exit 77, as
    # check-clean says it); enforcing never starts.
    assert (EventName.DAEMON_START in output) is dry_run
    if dry_run:
        assert EventName.RUN_ONCE_UNRESOLVED in output or EventName.RUN_ONCE_TIMEOUT in output
        assert "unreadable" in output


@needs_pid_namespace()
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to drop capabilities",
)
def test_a_state_dir_this_process_may_not_open_is_no_proof_of_clean(host: SimHost) -> None:
    """Root without its capabilities may not open a mode-000 ``state_dir`` (EACCES, as a user
    may not open root's 0700 one): the daemon's saved state is unseen, not absent, so
    check-clean and scan cannot tell (75) and name the folder. Alone in a PID namespace, every
    process is its own: the scan is otherwise complete (no 77)."""
    host.nvml([gpu(0)])
    config = str(host.config())
    host.state_dir.chmod(0)
    try:
        results = [
            _without_capabilities(host, *args, "--config", config, alone=True)
            for args in (["check-clean"], ["scan", "--json"])
        ]
    finally:
        host.state_dir.chmod(0o700)
    for result in results:
        assert result.returncode == 75, result.stderr
        assert f"cannot read {host.state_dir}: permission denied (run as root)" in result.stderr
    assert json.loads(results[1].stdout)["verdict"]["clean"] is False


def test_pause_and_resume_write_the_switch_into_state_dir(host: SimHost) -> None:
    config = str(host.config())
    assert host.gpuwatchd("pause", "--reason", "maint", "--config", config).returncode == 0
    assert json.loads((host.state_dir / "paused").read_text())["reason"] == "maint"
    assert host.gpuwatchd("resume", "--config", config).returncode == 0
    assert not (host.state_dir / "paused").exists()


@pytest.mark.parametrize("before", [True, False])
def test_config_is_honoured_before_and_after_the_command(
    tmp_path: Path, before: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuwatchd --config X status` used to drop X (the command's own --config reset it)."""
    bad = tmp_path / "gpuwatchd.yaml"
    bad.write_text("interval: sometimes\n")
    argv = ["--config", str(bad), "status"] if before else ["status", "--config", str(bad)]
    assert main(argv) == 78
    assert str(bad) in capsys.readouterr().err


@pytest.mark.parametrize("command", [["check-config", "-q"], ["status"], ["reload"], ["spare"]])
@pytest.mark.parametrize("before", [True, False])
def test_an_empty_config_is_refused_not_read_as_the_default_file(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: list[str],
    before: bool,
) -> None:
    """`--config ""` (an unset variable, `--config "$CONF"`) silently meant the default file:
    check-config -q said OK of a file nobody named."""
    import gpuwatchd.cli.check_clean

    default = tmp_path / "gpuwatchd.yaml"
    default.write_text(f"state_dir: {tmp_path}/st\n")
    monkeypatch.setattr(gpuwatchd.cli.check_clean, "DEFAULT_CONFIG_PATH", str(default))
    argv = ["--config", "", *command] if before else [*command, "--config", ""]
    assert main(argv) == 78
    said = capsys.readouterr()
    assert said.out == ""
    assert said.err.startswith("gpuwatchd: --config: an empty path names no file")
    assert not (tmp_path / "st").exists()


def test_a_closed_pipe_is_not_a_traceback(host: SimHost) -> None:
    host.nvml([gpu(0)])
    script = (
        f"{sys.executable} -m gpuwatchd scan --json --config {host.config()} | head -c 1 >/dev/null"
    )
    result = host.run(["bash", "-o", "pipefail", "-c", script])
    assert "Traceback" not in result.stderr


def test_explain_of_a_scan_lists_the_daemons_pause_and_its_kill_cap_latch(host: SimHost) -> None:
    # The daemon paused by an administrator, its kill cap latched (its saved plan says so).
    with StateDir.open(str(host.state_dir), create=True) as state_dir:
        set_pause(state_dir, reason="driver upgrade")
    latched = PlanState(
        forced_dry_run=True,
        forced_reason="more than 64 in one hour",
        signal_history=(("pid:4250@1", time.monotonic() - 10.0),),
    )
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    StateStore(str(host.state_dir)).save({"boot_id": boot_id, "plan": latched.to_json()})
    host.nvml([gpu(0, allocated=3 * GiB)])  # memory nobody holds: a reset is the next step
    config = host.config(dry_run=False)
    scanned = host.gpuwatchd("scan", "--json", "--config", str(config))
    assert scanned.returncode == 0, scanned.stderr
    report = json.loads(scanned.stdout)
    assert report["daemon"] == {
        "paused": True,
        "paused_reason": "driver upgrade",
        "forced_dry_run": True,
        "forced_reason": "more than 64 in one hour",
        "signalled_last_hour": 1,
    }
    path = host.root / "report.json"
    path.write_text(scanned.stdout)
    result = host.gpuwatchd("explain", str(path), "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "pause: the daemon is paused (driver upgrade)" in result.stdout
    latch = "kill cap: reached (more than 64 in one hour); the daemon forced dry-run"
    assert latch in result.stdout


_GOOD_SECTIONS = {"assess": AssessState().to_json(), "plan": PlanState().to_json()}


def _plan_of_another_version() -> dict[str, object]:
    return {**PlanState().to_json(), "version": 99}


@pytest.mark.parametrize(
    ("state", "code"),
    [
        (lambda boot_id: STATE.envelope({"boot_id": boot_id, **_GOOD_SECTIONS}), 0),
        (lambda boot_id: {"boot_id": boot_id, "plan": _plan_of_another_version()}, 75),
        (lambda boot_id: "{not json", 75),
        (
            lambda boot_id: {
                **STATE.envelope({"boot_id": boot_id, **_GOOD_SECTIONS}),
                "version": 2,
            },
            75,
        ),
        (lambda boot_id: STATE.envelope({"boot_id": boot_id}), 75),
    ],
    ids=["readable", "plan-unreadable", "file-malformed", "file-of-another-version", "no-plan"],
)
def test_check_clean_cannot_call_a_gpu_clean_when_the_daemons_state_cannot_be_read(
    host: SimHost, state: Any, code: int
) -> None:
    """A saved plan this version cannot read (corrupt, or written in another format by the
    daemon still running after an upgrade) may hold a MIG recovery or reset left half done,
    which makes its GPU dirty: check-clean cannot tell, exits 75 naming the file, never 0."""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    saved = state(boot_id)
    if isinstance(saved, str):
        (host.state_dir / "state.json").write_text(saved)
    else:
        StateStore(str(host.state_dir)).save(saved)
    host.nvml([gpu(0), gpu(1)])
    result = host.gpuwatchd("check-clean", "--config", str(host.config()))
    assert result.returncode == code, result.stderr
    assert result.stdout == ""
    if code:
        assert str(host.state_dir / "state.json") in result.stderr
        assert "cannot tell" in result.stderr
        empty = host.gpuwatchd("check-clean", "--gpu", "", "--config", str(host.config()))
        assert empty.returncode == 0, "no GPU asked about: nothing to tell"
    # One verdict: scan does not call clean what check-clean cannot tell.
    scanned = host.gpuwatchd("scan", "--json", "--config", str(host.config()))
    assert scanned.returncode == code, scanned.stderr
    report = json.loads(scanned.stdout)
    assert report["verdict"]["clean"] is (code == 0)
    states = [g["verdict"]["state"] for g in report["gpus"]]
    assert states == (["clean"] * 2 if code == 0 else ["unknown"] * 2)
    text = host.gpuwatchd("scan", "--config", str(host.config()))
    assert text.returncode == code
    assert ("a new job may have it" in text.stdout) is (code == 0)
    assert ("cannot tell" in text.stderr) is (code != 0)
    # Nor does run --once without a daemon: it moves the state aside and starts latched.
    once = host.gpuwatchd("run", "--once", "--timeout", "10s", "--config", str(host.config()))
    assert once.returncode == code, once.stderr
    assert ("cannot tell" in once.stderr) is (code != 0)
    # While that latch holds, what the file held stays unknown to every verdict after it.
    for argv in (["check-clean"], ["run", "--once", "--timeout", "10s"]):
        after = host.gpuwatchd(*argv, "--config", str(host.config()))
        assert after.returncode == code, after.stderr
        assert ("cannot tell" in after.stderr) is (code != 0)


@pytest.mark.parametrize("version", [None, 99], ids=["readable", "plan-unreadable"])
def test_a_scan_shows_when_the_daemon_first_saw_a_finding_only_from_a_plan_it_can_read(
    host: SimHost, version: int | None
) -> None:
    """``first_seen`` comes from the plan as the verdict reads it: a plan that cannot be read
    (here written in another format) gives none, as it gives no ladder nor latch."""
    host.nvml([gpu(0, processes=[{"pid": 999_999, "used_memory": 4 * GiB}], allocated=5 * GiB)])
    config = ["scan", "--json", "--config", str(host.config())]
    (finding,) = json.loads(host.gpuwatchd(*config).stdout)["findings"]
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    seen = {finding["key"]: SeenFinding(time.monotonic(), "d", finding["gpu"], None)}
    plan = PlanState(boot_id=boot_id, seen=seen).to_json()
    if version is not None:
        plan["version"] = version
    StateStore(str(host.state_dir)).save(
        STATE.envelope({"boot_id": boot_id, **_GOOD_SECTIONS, "plan": plan})
    )
    (finding,) = json.loads(host.gpuwatchd(*config).stdout)["findings"]
    assert isinstance(finding["first_seen"], float) is (version is None), finding


def test_a_scan_reads_the_daemons_saved_plan_once(
    host: SimHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verdict (a recovery left half done) and the ``daemon`` section (the latch) share
    one parse of the saved plan, which grows with the findings seen."""
    from gpuwatchd.cli.scan import scan_host
    from gpuwatchd.config.schema import load_policy

    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    latched = PlanState(forced_dry_run=True, forced_reason="storm").to_json()
    StateStore(str(host.state_dir)).save(
        STATE.envelope({"boot_id": boot_id, **_GOOD_SECTIONS, "plan": latched})
    )
    host.nvml([gpu(0)])
    for name, value in host.fake.env().items():
        monkeypatch.setenv(name, value)
    parsed: list[object] = []
    read = PlanState.from_json

    def counted(data: object) -> PlanState:
        parsed.append(data)
        return read(data)

    monkeypatch.setattr(PlanState, "from_json", counted)
    result = scan_host(load_policy(str(host.config())))
    assert parsed == [latched]
    assert result.report is not None
    assert result.report["daemon"]["forced_dry_run"] is True  # type: ignore[index]
    assert result.state_unread is None  # the verdict read it too


def test_a_saved_plan_refused_for_a_key_of_any_size_is_said_cut_short(
    host: SimHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan's reader names the key it refuses, as large as the file: why the scan cannot
    tell (check-clean's and scan's message, each clean GPU's reason) says it cut."""
    from gpuwatchd.cli.scan import scan_host
    from gpuwatchd.config.schema import load_policy

    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    plan = {**PlanState(boot_id=boot_id).to_json(), "waiting": {"k" * 100_000: "x"}}
    StateStore(str(host.state_dir)).save(
        STATE.envelope({"boot_id": boot_id, **_GOOD_SECTIONS, "plan": plan})
    )
    host.nvml([gpu(0)])
    for name, value in host.fake.env().items():
        monkeypatch.setenv(name, value)
    result = scan_host(load_policy(str(host.config())))
    assert result.state_unread is not None
    assert "plan.waiting.kkkk" in result.state_unread
    assert len(result.state_unread) < len(str(host.state_dir)) + 250, result.state_unread[:300]
    assert len(json.dumps(result.report)) < 50_000
