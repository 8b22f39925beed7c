"""Signals through pidfds, the command runner and hooks, against real child processes.

Every process signalled here is a child this file spawned itself; PIDs of other processes are
only ever used with a deliberately wrong identity or below the floor, where nothing is sent.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.act import commands
from gpuwatchd.act.commands import OUTPUT_LIMIT, fill_hooks, run_command, run_hooks
from gpuwatchd.act.reset import perform_reset
from gpuwatchd.act.reset_target import ResetTarget
from gpuwatchd.act.signals import Signaller, stat_start_ticks
from gpuwatchd.core.model import ProcessIdentity
from gpuwatchd.core.vocabulary import SignalOutcome
from gpuwatchd.decide.argv import format_argv, hook_environment
from gpuwatchd.decide.policy import Hook
from tests.support.children import Spawn
from tests.support.fakesmi import FakeSmi
from tests.support.liveness import is_dead
from tests.support.resetrig import FakeEnvironment, make_policy
from tests.support.unkillable import HangingFuse

REPO_ROOT = Path(__file__).resolve().parents[2]
RESET_UUID = "GPU-12345678-1234-1234-1234-123456789abc"
IGNORES_SIGTERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(1000)\n"
)


# --- helpers ----------------------------------------------------------------------------------


def identity_of(pid: int) -> ProcessIdentity:
    stat = stat_start_ticks("/proc", pid)
    assert stat is not None
    return ProcessIdentity(pid, stat[0])


def wait_for_state(pid: int, state: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stat = stat_start_ticks("/proc", pid)
        if stat is not None and stat[1] == state:
            return
        time.sleep(0.005)
    raise AssertionError(f"PID {pid} never reached state {state}")


@pytest.fixture
def signaller() -> Iterator[Signaller]:
    with Signaller() as sig:
        yield sig


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A child that dies to SIGTERM (the default action)."""
    child = subprocess.Popen(["sleep", "1000"])
    yield child
    if child.poll() is None:
        child.kill()
    child.wait()


@pytest.fixture
def stubborn() -> Iterator[subprocess.Popen[str]]:
    """A child that ignores SIGTERM, returned once the handler is in place."""
    child = subprocess.Popen(
        [sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    yield child
    if child.poll() is None:
        child.kill()
    child.wait()
    child.stdout.close()


# --- signals ----------------------------------------------------------------------------------


def test_sigterm_is_delivered_and_the_exit_is_seen_through_the_pidfd_at_once(
    signaller: Signaller, sleeper: subprocess.Popen[bytes]
) -> None:
    identity = identity_of(sleeper.pid)
    result = signaller.send(identity, "SIGTERM", dry_run=False)
    sent = time.monotonic()
    assert result.outcome is SignalOutcome.DELIVERED, result.detail
    assert signaller.fileno_list(), "the pidfd is kept after a delivered signal"
    exited = signaller.wait(5.0)
    elapsed = time.monotonic() - sent
    print(f"exit seen {elapsed * 1000:.1f} ms after SIGTERM")
    assert exited == [identity]
    assert elapsed < 1.0
    assert signaller.fileno_list() == [], "the pidfd of an exited process is closed"
    assert sleeper.wait(1.0) == -signal.SIGTERM


def test_a_child_ignoring_sigterm_stays_and_sigkill_kills_it(
    signaller: Signaller, stubborn: subprocess.Popen[str]
) -> None:
    identity = identity_of(stubborn.pid)
    assert signaller.send(identity, "SIGTERM", dry_run=False).outcome is SignalOutcome.DELIVERED
    assert signaller.wait(0.3) == []
    assert stubborn.poll() is None
    assert signaller.send(identity, "SIGKILL", dry_run=False).outcome is SignalOutcome.DELIVERED
    assert signaller.wait(5.0) == [identity]
    assert stubborn.wait(1.0) == -signal.SIGKILL


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_wrong_start_time_is_reused_and_nothing_is_sent(
    signaller: Signaller, sleeper: subprocess.Popen[bytes], dry_run: bool
) -> None:
    real = identity_of(sleeper.pid)
    impostor = ProcessIdentity(real.pid, real.start_ticks + 1)
    result = signaller.send(impostor, "SIGKILL", dry_run=dry_run)
    assert result.outcome is SignalOutcome.REUSED
    assert signaller.fileno_list() == []
    time.sleep(0.05)
    assert sleeper.poll() is None, "the process behind a reused PID must not be signalled"


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_live_process_whose_stat_cannot_be_read_is_not_gone_and_nothing_is_sent(
    sleeper: subprocess.Popen[bytes], tmp_path: Path, dry_run: bool
) -> None:
    """Its pidfd says it lives; a ``stat`` read failing otherwise than "no such process"
    (EISDIR here; EMFILE, EIO on a host) proves no identity: "gone" would close its ladder
    as freed while it holds the GPU."""
    identity = identity_of(sleeper.pid)
    (tmp_path / str(sleeper.pid) / "stat").mkdir(parents=True)
    with Signaller(str(tmp_path)) as signaller:
        result = signaller.send(identity, "SIGTERM", dry_run=dry_run)
        assert result.outcome is SignalOutcome.FAILED, result.detail
        assert "stat" in result.detail
        assert signaller.fileno_list() == []
    time.sleep(0.05)
    assert sleeper.poll() is None


def test_a_reaped_pid_is_gone(signaller: Signaller) -> None:
    child = subprocess.Popen(["true"])
    identity = identity_of(child.pid)
    child.wait()
    result = signaller.send(identity, "SIGTERM", dry_run=False)
    assert result.outcome is SignalOutcome.GONE, result.detail


@pytest.mark.parametrize("dry_run", [False, True])
def test_an_unreaped_dead_child_is_a_zombie_and_is_not_signalled(
    signaller: Signaller, dry_run: bool
) -> None:
    child = subprocess.Popen(["sleep", "0.01"])
    identity = identity_of(child.pid)
    wait_for_state(child.pid, "Z")
    result = signaller.send(identity, "SIGKILL", dry_run=dry_run)
    assert result.outcome is SignalOutcome.ZOMBIE
    assert result.state == "Z"
    assert "reap" in result.detail
    assert signaller.fileno_list() == []
    assert child.wait(1.0) == 0, "a zombie that was signalled would not report a clean exit"


def test_dry_run_checks_identity_and_sends_nothing(
    signaller: Signaller, sleeper: subprocess.Popen[bytes]
) -> None:
    identity = identity_of(sleeper.pid)
    result = signaller.send(identity, "SIGKILL", dry_run=True)
    assert result.outcome is SignalOutcome.DRY_RUN
    assert "would send SIGKILL" in result.detail
    assert signaller.wait(0.2) == []
    assert sleeper.poll() is None


def test_a_kept_process_that_exited_is_reported_as_zombie_then_gone(
    signaller: Signaller, sleeper: subprocess.Popen[bytes]
) -> None:
    identity = identity_of(sleeper.pid)
    assert signaller.send(identity, "SIGTERM", dry_run=False).outcome is SignalOutcome.DELIVERED
    wait_for_state(sleeper.pid, "Z")
    assert signaller.send(identity, "SIGKILL", dry_run=False).outcome is SignalOutcome.ZOMBIE
    sleeper.wait(1.0)
    assert signaller.send(identity, "SIGKILL", dry_run=False).outcome is SignalOutcome.GONE


def test_wait_returns_at_once_when_nothing_is_watched(signaller: Signaller) -> None:
    started = time.monotonic()
    assert signaller.wait(5.0) == []
    assert time.monotonic() - started < 0.5


def test_forget_stops_watching(signaller: Signaller, sleeper: subprocess.Popen[bytes]) -> None:
    identity = identity_of(sleeper.pid)
    signaller.send(identity, "SIGCONT", dry_run=False)
    assert len(signaller.fileno_list()) == 1
    signaller.forget(identity)
    assert signaller.fileno_list() == []


@pytest.mark.parametrize(
    ("pid", "signal_name", "expected"),
    [
        (1, "SIGTERM", "safety floor"),
        (2, "SIGTERM", "safety floor"),
        (0, "SIGTERM", "safety floor"),
        (-1, "SIGKILL", "safety floor"),
        # Named, not numbered: each pytest-xdist worker has its own pid, the same test ids.
        pytest.param(os.getpid(), "SIGTERM", "safety floor", id="own-pid"),
    ],
)
def test_the_floor_refuses_before_opening_anything(
    signaller: Signaller, pid: int, signal_name: str, expected: str
) -> None:
    result = signaller.send(ProcessIdentity(pid, 0), signal_name, dry_run=False)
    assert result.outcome is SignalOutcome.FAILED
    assert expected in result.detail
    assert signaller.fileno_list() == []


@pytest.mark.parametrize("name", ["SIGBOGUS", "SIG_IGN", "", "15"])
def test_an_unknown_signal_name_fails_without_sending(
    signaller: Signaller, sleeper: subprocess.Popen[bytes], name: str
) -> None:
    result = signaller.send(identity_of(sleeper.pid), name, dry_run=False)
    assert result.outcome is SignalOutcome.FAILED
    assert sleeper.poll() is None


@pytest.mark.parametrize("name", ["SIGTERM", "TERM", "sigterm"])
def test_signal_names_with_or_without_prefix_are_accepted(
    signaller: Signaller, sleeper: subprocess.Popen[bytes], name: str
) -> None:
    result = signaller.send(identity_of(sleeper.pid), name, dry_run=False)
    assert result.outcome is SignalOutcome.DELIVERED
    assert sleeper.wait(2.0) == -signal.SIGTERM


PROBE = """
import sys
from gpuwatchd.act.signals import Signaller
from gpuwatchd.core.model import ProcessIdentity
identity = ProcessIdentity(int(sys.argv[1]), int(sys.argv[2]))
print(Signaller().send(identity, "SIGKILL", dry_run=sys.argv[3] == "1").outcome.value)
"""


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run processes as two other uids")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize("dry_run", [False, True])
def test_signalling_another_users_process_without_cap_kill_is_denied(dry_run: bool) -> None:
    drop = ["setpriv", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
    target = subprocess.Popen([*drop, "--reuid=65534", "--regid=65534", "sleep", "1000"])
    try:
        identity = identity_of(target.pid)
        probe = subprocess.run(
            [
                *drop,
                "--reuid=65533",
                "--regid=65533",
                sys.executable,
                "-c",
                PROBE,
                str(identity.pid),
                str(identity.start_ticks),
                "1" if dry_run else "0",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            check=False,
        )
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.strip() == SignalOutcome.DENIED.value
        assert target.poll() is None
    finally:
        target.kill()
        target.wait()


# --- /proc/PID/stat ---------------------------------------------------------------------------

# fields 4 to 21, then field 22 (start ticks) = 424242, then 23 and on
STAT_TAIL = "".join(f" {n}" for n in range(4, 22)) + " 424242 23 24 25"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (f"77 (python3) S{STAT_TAIL}", (424242, "S")),
        (f"77 (a b) c) (d) Z{STAT_TAIL}", (424242, "Z")),
        (f"77 ()) D{STAT_TAIL}", (424242, "D")),
        ("77 (short) S 1 2 3", None),
        (f"77 python3 S{STAT_TAIL}", None),
        (f"77 (x) S{STAT_TAIL.replace('424242', 'abc')}", None),
        ("", None),
    ],
)
def test_stat_start_ticks_parses_after_the_last_parenthesis(
    tmp_path: Path, content: str, expected: tuple[int, str] | None
) -> None:
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "stat").write_text(content)
    assert stat_start_ticks(str(tmp_path), 77) == expected


def test_stat_start_ticks_of_a_missing_pid_is_unknown(tmp_path: Path) -> None:
    assert stat_start_ticks(str(tmp_path), 12345) is None


def test_stat_start_ticks_reads_the_real_proc() -> None:
    stat = stat_start_ticks("/proc", os.getpid())
    assert stat is not None
    assert stat[1] in ("R", "S")


# --- commands ---------------------------------------------------------------------------------


def test_run_command_captures_stdout_and_stderr_and_the_exit_code() -> None:
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    result = run_command([sys.executable, "-c", code], timeout=10)
    assert result.returncode == 3
    assert "out" in result.output
    assert "err" in result.output
    assert not result.timed_out
    assert result.error is None
    assert not result.ok
    assert result.describe() == "exit 3"


def test_run_command_passes_the_given_environment_only() -> None:
    code = "import os; print(os.environ.get('ONLY'), os.environ.get('HOME'))"
    result = run_command([sys.executable, "-c", code], timeout=10, env={"ONLY": "yes"})
    assert result.output.strip() == "yes None"


HANGS_WITH_GRANDCHILD = """
import os, subprocess, sys, time
grandchild = subprocess.Popen(["sleep", "1000"])
with open(sys.argv[1], "w") as pids:
    pids.write(f"{os.getpid()} {grandchild.pid}")
print("started", flush=True)
time.sleep(1000)
"""


def test_a_command_past_its_timeout_is_killed_with_its_whole_process_group(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "pids"
    result = run_command([sys.executable, "-c", HANGS_WITH_GRANDCHILD, str(pid_file)], timeout=1.5)
    assert result.timed_out
    assert 1.5 <= result.duration < 10
    assert result.returncode == -signal.SIGKILL
    assert "started" in result.output
    assert "timed out" in result.describe()
    leader, grandchild = (int(p) for p in pid_file.read_text().split())
    deadline = time.monotonic() + 5
    while not (is_dead(leader) and is_dead(grandchild)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert is_dead(leader)
    assert is_dead(grandchild), "the grandchild in the command's group must be killed too"


def test_a_command_that_leaves_a_background_child_holding_its_output_returns_promptly(
    tmp_path: Path,
) -> None:
    code = (
        "import subprocess, sys\n"
        "child = subprocess.Popen(['sleep', '3'])\n"
        "open(sys.argv[1], 'w').write(str(child.pid))\n"
        "print('done')\n"
    )
    pid_file = tmp_path / "pid"
    result = run_command([sys.executable, "-c", code, str(pid_file)], timeout=30)
    assert result.returncode == 0
    assert not result.timed_out
    assert result.duration < 2.5
    assert "done" in result.output


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["/nonexistent/gpuwatchd-test-command"], "cannot run"),
        ([], "empty command"),
        # Refused by the exec call itself, before any process starts: no text the OS can take
        (["/bin/tr\0ue"], "cannot run /bin/tr"),
        (["true", "\ud800"], "cannot run true"),
    ],
)
def test_a_command_that_cannot_be_started_has_no_exit_code_and_says_why(
    argv: list[str], message: str
) -> None:
    open_fds = len(os.listdir("/proc/self/fd"))
    result = run_command(argv, timeout=5)
    assert len(os.listdir("/proc/self/fd")) == open_fds  # the status pipe is closed
    assert result.returncode is None
    assert result.error is not None
    assert message in result.error
    assert not result.timed_out
    assert not result.ok


def test_a_file_that_is_not_executable_cannot_be_started(tmp_path: Path) -> None:
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    result = run_command([str(script)], timeout=5)
    assert result.returncode is None
    assert result.error is not None


def test_run_command_keeps_only_the_tail_of_a_long_output() -> None:
    code = "import sys; sys.stdout.write('x' * 300000 + 'END')"
    result = run_command([sys.executable, "-c", code], timeout=10)
    assert result.returncode == 0
    assert result.output.endswith("END")
    assert "bytes dropped" in result.output
    assert len(result.output) < OUTPUT_LIMIT + 100


@pytest.mark.root
@pytest.mark.slow
def test_a_reset_script_whose_child_cannot_be_killed_at_its_timeout_needs_a_reboot(
    tmp_path: Path, hanging_fuse: HangingFuse
) -> None:
    """A site script as ``reset.command`` runs nvidia-smi, which hangs in the driver: at the
    timeout the script dies and its child cannot (state D). The command's tree could not be
    killed, so the GPU needs a reboot, as when the command itself is stuck (docs/reset.md)."""
    script = tmp_path / "reset-gpu"
    script.write_text(
        f"#!/bin/sh\nsh -c 'exec 3<\"{hanging_fuse.file}\"; exec sleep 600' &\nwait\n"
    )
    script.chmod(0o755)
    smi = FakeSmi(tmp_path / "bin")
    policy = make_policy(smi, command=(str(script), "{uuid}"), timeout=1.0)
    target = ResetTarget(uuid=RESET_UUID, pci_bus_id=None, minor=0, persistence_was_on=False)
    outcome = perform_reset(target, policy, FakeEnvironment(smi), dry_run=False)
    assert (outcome.result, outcome.needs_reboot) == ("timeout", True)
    assert "1 process(es) still running after SIGKILL" in outcome.reason
    assert outcome.command is not None
    assert (outcome.command.returncode, outcome.command.unkillable) == (-signal.SIGKILL, 1)


# --- argv templates and hooks -----------------------------------------------------------------

UUID = "GPU-12345678-1234-1234-1234-123456789abc"


@pytest.mark.parametrize(
    ("template", "values", "expected"),
    [
        (["nvidia-smi", "--gpu-reset", "-i", "{uuid}"], {"uuid": UUID}, UUID),
        (["x", "--bus={pci_bus_id}"], {"pci_bus_id": "00000000:3B:00.0"}, "--bus=00000000:3B:00.0"),
        (["x", "{minor}"], {"minor": "3"}, "3"),
        (["x", "-pm", "{mode}"], {"mode": "0"}, "0"),
        (["x", "{{literal}}"], {}, "{literal}"),
        (["x", "plain"], {"uuid": UUID}, "plain"),
    ],
)
def test_format_argv_fills_placeholders(
    template: list[str], values: dict[str, str], expected: str
) -> None:
    assert format_argv(template, **values)[-1] == expected
    assert format_argv(template, **values)[0] == template[0]


@pytest.mark.parametrize(
    ("template", "values", "message"),
    [
        (["x", "{index}"], {"uuid": UUID}, "unknown placeholder"),
        (["x", "{uuid!r}"], {"uuid": UUID}, "unknown placeholder"),
        (["x", "{uuid:>5}"], {"uuid": UUID}, "unknown placeholder"),
        (["x", "{pci_bus_id}"], {"uuid": UUID}, "no value"),
        (["x", "{pci_bus_id}"], {"pci_bus_id": None}, "no value"),
        (["x", "{uuid"], {"uuid": UUID}, "bad braces"),
    ],
)
def test_format_argv_refuses_what_it_cannot_fill(
    template: list[str], values: dict[str, str | None], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        format_argv(template, **values)


def test_format_argv_refuses_unknown_value_names() -> None:
    with pytest.raises(ValueError, match="unknown placeholder value"):
        format_argv(["x"], index="0")


def test_hook_environment_names_every_known_field() -> None:
    env = hook_environment("reset_after", gpu_uuid=UUID, gpu_minor=3, gpu_pci_bus_id=None)
    assert env == {
        "GPUWATCHD_EVENT": "reset_after",
        "GPUWATCHD_GPU_UUID": UUID,
        "GPUWATCHD_GPU_MINOR": "3",
    }


def test_hooks_see_the_daemon_environment_plus_the_event_and_their_placeholders() -> None:
    code = (
        "import os, sys; print(os.environ['GPUWATCHD_EVENT'], os.environ['GPUWATCHD_GPU_UUID'], "
        "'PATH' in os.environ, sys.argv[1])"
    )
    hooks = [Hook((sys.executable, "-c", code, "{uuid}"), timeout=10)]
    env = hook_environment("reset_before", gpu_uuid=UUID)
    [result] = run_hooks(fill_hooks(hooks, {"uuid": UUID}), env=env)
    assert result.ok
    assert result.output.split() == ["reset_before", UUID, "True", UUID]


def test_a_hook_whose_placeholder_cannot_be_filled_fails_without_running() -> None:
    [result] = run_hooks(fill_hooks([Hook(("echo", "{pci_bus_id}"))], {"uuid": UUID}), env={})
    assert result.returncode is None
    assert result.error is not None
    assert "no value" in result.error


@pytest.mark.parametrize(("stop_on_failure", "ran"), [(True, 2), (False, 3)])
def test_hooks_stop_at_the_first_failure_only_when_asked(stop_on_failure: bool, ran: int) -> None:
    hooks = [Hook(("true",)), Hook(("false",)), Hook(("true",))]
    results = run_hooks(fill_hooks(hooks, {}), env={}, stop_on_failure=stop_on_failure)
    assert len(results) == ran
    assert [r.returncode for r in results] == [0, 1, 0][:ran]


def test_a_hook_past_its_timeout_is_killed() -> None:
    [result] = run_hooks(fill_hooks([Hook(("sleep", "30"), timeout=0.3)], {}), env={})
    assert result.timed_out
    assert result.duration < 5


ESCAPES_WITH_SETSID = """
import os, subprocess, sys, time
escaped = subprocess.Popen(["sleep", "1000"], start_new_session=True)  # leaves the group
with open(sys.argv[1], "w") as pids:
    pids.write(str(escaped.pid))
time.sleep(1000)
"""


def test_a_child_that_left_the_process_group_is_killed_at_the_timeout_too(tmp_path: Path) -> None:
    """setsid or a double fork takes a child out of the command's group: it still carries the
    command's marker, and is ended with the command."""
    pid_file = tmp_path / "pids"
    script = [sys.executable, "-c", ESCAPES_WITH_SETSID, str(pid_file)]
    result = run_command(script, timeout=1.5)
    assert result.timed_out
    escaped = int(pid_file.read_text())
    try:
        deadline = time.monotonic() + 5
        while not is_dead(escaped) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert is_dead(escaped), "the setsid child outlived the command's timeout"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(escaped, signal.SIGKILL)  # our own grandchild, if the test failed


def test_the_marker_fallback_reads_each_environment_once_and_kills_the_marked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kill_marked reads every process's environment (a fallback): once each, after its pidfd
    is open, not once to choose and again to confirm."""
    value = uuid.uuid4().hex
    marked = subprocess.Popen(["sleep", "1000"], env={"GPUWATCHD_COMMAND_ID": value})
    plain = subprocess.Popen(["sleep", "1000"], env={})
    reads: list[int] = []
    carries = commands._carries

    def counted(pid: int, wanted: bytes) -> bool:
        reads.append(pid)
        return carries(pid, wanted)

    monkeypatch.setattr(commands, "_carries", counted)
    try:
        commands.kill_marked(f"GPUWATCHD_COMMAND_ID={value}".encode())
        assert marked.wait(timeout=5) == -signal.SIGKILL
        assert plain.poll() is None
        assert reads.count(marked.pid) == 1
        assert reads.count(plain.pid) == 1
    finally:
        for proc in (marked, plain):
            proc.kill()
            proc.wait()


# Any user's process may point its environment at any memory of its own (PR_SET_MM_MAP).
WIDE_ENVIRONMENT = """
import ctypes, mmap, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.sbrk.restype = ctypes.c_void_p
with open("/proc/self/stat") as handle:
    field = [0, 0, 0, 0, *map(int, handle.read().rpartition(")")[2].split()[1:])]  # 1-based
size = 64 << 20
area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
area.write(b"x" * size)
start = ctypes.addressof(ctypes.c_char.from_buffer(area))
ids = (26, 27, 45, 46, 47)  # start_code, end_code, start_data, end_data, start_brk
mm = [field[n] for n in ids] + [libc.sbrk(0)] + [field[n] for n in (28, 48, 49)]
mm_map = struct.pack("11QQIi", *mm, start, start + size, 0, 0, -1)
assert libc.prctl(35, 14, mm_map, len(mm_map), 0) == 0, ctypes.get_errno()  # PR_SET_MM_MAP
print("ready", flush=True)
input()
"""


def test_an_environment_of_any_size_is_read_bounded(spawn: Spawn) -> None:
    """The marker fallback reads every process's environment: one a user widened to 64 MiB
    (gigabytes as easily) is read no further than exec could have filled it."""
    wide = spawn(WIDE_ENVIRONMENT)
    with open(f"/proc/{wide.pid}/environ", "rb") as handle:
        assert len(handle.read(7 << 20)) == 7 << 20  # past what an exec can give
    tracemalloc.start()
    try:
        assert not commands._carries(wide.pid, b"GPUWATCHD_COMMAND_ID=" + b"0" * 32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak >> 20} MiB held to read a 64 MiB environment"


def test_each_command_gets_its_own_marker() -> None:
    code = "import os; print(os.environ['GPUWATCHD_COMMAND_ID'])"
    first = run_command([sys.executable, "-c", code], timeout=10).output.strip()
    second = run_command([sys.executable, "-c", code], timeout=10, env={}).output.strip()
    assert len(first) == 32
    assert first != second


def test_a_command_runs_in_the_root_folder_not_the_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = run_command([sys.executable, "-c", "import os; print(os.getcwd())"], timeout=10)
    assert result.output.strip() == "/"


def test_a_command_gets_no_python_settings_from_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/tmp/hostile")
    monkeypatch.setenv("PYTHONSTARTUP", "/tmp/hostile/start.py")
    code = "import os; print(sorted(k for k in os.environ if k.startswith('PYTHON')))"
    result = run_command([sys.executable, "-c", code], timeout=10)
    assert result.output.strip() == "[]"
    given = run_command([sys.executable, "-c", code], timeout=10, env={"PYTHONPATH": "/x"})
    assert given.output.strip() == "[]"


def test_a_command_gets_no_systemd_notification_socket_or_watchdog_of_the_daemons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """systemd gives them to the daemon alone: a hook or reset command that inherited them
    (systemd-notify, a library's sd_notify) spoke for the daemon or was refused and logged."""
    own = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000"}
    for name, value in {**own, "WATCHDOG_PID": str(os.getpid())}.items():
        monkeypatch.setenv(name, value)
    code = "import os; print(sorted(k for k in os.environ if 'NOTIFY' in k or 'WATCHDOG' in k))"
    assert run_command([sys.executable, "-c", code], timeout=10).output.strip() == "[]"
    hooked = run_command([sys.executable, "-c", code], timeout=10, env={**os.environ, **own})
    assert hooked.output.strip() == "[]"  # run_hooks hands the daemon's environment over
