"""Nothing a command or hook starts outlives it (gpuwatchd/act/commands.py, act/reaper.py).

The attacks: a hook's child that calls ``setsid`` and clears its environment escaped the
process-group kill and the environment marker, and outlived the deadline; the child of a
command that had already exited was never ended at all; and ``run --once`` exited with an
``on_action`` hook still running. Each command now runs under a keeper that is a child
subreaper: every descendant stays in its tree, and the tree ends with the command. Real
processes, all this test's own descendants.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from gpuwatchd.act import commands
from gpuwatchd.act.commands import KEEPER_FILE, CommandResult, CommandScope, run_command
from gpuwatchd.config.schema import default_policy
from gpuwatchd.core.vocabulary import EventName, HookName
from gpuwatchd.daemon.lifecycle import Daemon
from gpuwatchd.decide.plan.intents import HookIntent
from gpuwatchd.decide.policy import Hook
from tests.support.daemonrun import ORPHAN_RULE, orphan_host
from tests.support.fakenvml import gpu
from tests.support.liveness import is_dead
from tests.support.simhost import SimHost, pid_namespace_command, run_in_pid_namespace

# The command forks a child that leaves the session (setsid) and execs `sleep` with an empty
# environment (no GPUWATCHD_COMMAND_ID), from a second fork: its parent exits at once, so it
# is nobody's child in the command's tree but the keeper's. Then the command itself either
# exits at once ("exit") or hangs ("hang").
ESCAPES = """
import os, sys, time
child = os.fork()
if child == 0:
    os.setsid()
    grandchild = os.fork()
    if grandchild == 0:
        os.execve("/bin/sleep", ["sleep", "1000"], {})
    with open(sys.argv[1], "w") as out:
        out.write(str(grandchild))
    os._exit(0)
os.waitpid(child, 0)
print("started", flush=True)
if sys.argv[2] == "hang":
    time.sleep(1000)
"""


def _escaped(pid_file: Path) -> int:
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the command never started its child"
        time.sleep(0.01)
    return int(pid_file.read_text())


def _gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not is_dead(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return is_dead(pid)


def _cleanup(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # our own descendant, if a test failed


def test_a_setsid_child_with_a_cleared_environment_dies_at_the_deadline(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    result = run_command([sys.executable, "-c", ESCAPES, str(pid_file), "hang"], timeout=1.5)
    escaped = _escaped(pid_file)
    try:
        assert result.timed_out
        assert 1.5 <= result.duration < 10
        assert "started" in result.output
        assert _gone(escaped, timeout=1.0), "the setsid child outlived the command's deadline"
    finally:
        _cleanup(escaped)


def test_what_a_command_leaves_running_when_it_exits_dies_at_its_deadline(
    tmp_path: Path,
) -> None:
    """The command's result comes when it exits; the child it left (outside its session, its
    environment cleared) may run on until the command's deadline, and not a moment longer."""
    pid_file = tmp_path / "pid"
    scope = CommandScope()
    argv = [sys.executable, "-c", ESCAPES, str(pid_file), "exit"]
    result = run_command(argv, timeout=3.0, scope=scope)
    escaped = _escaped(pid_file)
    try:
        assert result.returncode == 0
        assert not result.timed_out
        assert result.duration < 2.5, "the caller goes on when the command exits"
        assert result.leftovers == 1
        assert "it left 1 process(es) running (killed at its deadline)" in result.describe()
        assert not is_dead(escaped), "it may run until the deadline"
        assert scope.lingering == 1
        assert _gone(escaped, timeout=3.0), "the exited command's child outlived its deadline"
        assert scope.wait(2.0)
    finally:
        _cleanup(escaped)


def test_what_a_command_leaves_running_dies_at_its_deadline_also_when_the_daemon_died(
    tmp_path: Path,
) -> None:
    """The daemon died before the command exited: the keeper's report had no reader, its
    write raised, and the keeper exited at once, leaving the child to run on for good."""
    pid_file, (status_read, status_write) = tmp_path / "pid", os.pipe()
    os.close(status_read)  # the daemon's end, gone
    argv = [sys.executable, "-I", "-S", KEEPER_FILE, str(status_write), "2.0", "--"]
    argv += [sys.executable, "-c", ESCAPES, str(pid_file), "exit"]
    keeper = subprocess.Popen(argv, stdout=subprocess.DEVNULL, pass_fds=(status_write,))
    os.close(status_write)
    escaped = _escaped(pid_file)
    try:
        assert keeper.wait(10) == 0
        assert _gone(escaped, timeout=1.0), "the child outlived the keeper and its deadline"
    finally:
        _cleanup(escaped)


def test_a_cancelled_command_ends_with_its_whole_tree_at_once(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    scope = CommandScope()
    results: list[CommandResult] = []
    argv = [sys.executable, "-c", ESCAPES, str(pid_file), "hang"]
    worker = threading.Thread(
        target=lambda: results.append(run_command(argv, timeout=60, scope=scope))
    )
    worker.start()
    escaped = _escaped(pid_file)
    try:
        scope.cancel()
        worker.join(15)
        assert not worker.is_alive()
        (result,) = results
        assert result.cancelled
        assert not result.timed_out
        assert result.duration < 15
        assert "cancelled" in result.describe()
        assert _gone(escaped, timeout=1.0)
        after = run_command(["true"], timeout=5, scope=scope)
        assert after.cancelled, "nothing new starts once cancelled"
        assert after.returncode is None
    finally:
        _cleanup(escaped)


def test_cancelling_ends_what_finished_commands_left_running(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    scope = CommandScope()
    result = run_command(
        [sys.executable, "-c", ESCAPES, str(pid_file), "exit"], timeout=60, scope=scope
    )
    escaped = _escaped(pid_file)
    try:
        assert result.leftovers == 1
        assert scope.cancel() == 1
        assert _gone(escaped, timeout=1.0)
        assert scope.lingering == 0
    finally:
        _cleanup(escaped)


# The keeper itself, slow to exit once it sent its last report (the command done, its tree
# ended): as a loaded machine's interpreter shutdown may be, for longer than the output drain.
SLOW_KEEPER = """
import sys, time
sys.path.insert(0, %(folder)r)
import reaper
code = reaper.main(sys.argv)
time.sleep(1.0)
sys.exit(code)
"""


def test_a_keeper_slow_to_exit_after_its_last_report_is_no_command_left_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command that exited leaving nothing: its keeper, still exiting when the output's drain
    ended, was handed to the scope as one that keeps what its command left running, so the
    daemon's stop said '1 finished command(s) had left processes running before their
    deadline; they were killed' (a ``EventName.HOOK_RUN`` of its own; the flake of the e2e
    hanging-reset test on a loaded machine). The keeper's last report is now waited out, never
    adopted."""
    slow = tmp_path / "slow_keeper.py"
    slow.write_text(SLOW_KEEPER % {"folder": str(Path(KEEPER_FILE).parent)})
    monkeypatch.setattr(commands, "KEEPER_FILE", str(slow))
    policy = dataclasses.replace(default_policy(), state_dir=str(tmp_path / "state"))
    daemon = Daemon(policy, config_path="/nonexistent/gpuwatchd.yaml")
    try:
        result = daemon.actuator.run_command(["true"], timeout=30.0)
        assert (result.returncode, result.leftovers, result.error) == (0, 0, None)
        assert daemon.actuator.commands.lingering == 0, "an ended keeper counted as lingering"
        with capture_logs() as logs:
            daemon._finish_notifications()
        runs = [e for e in logs if e["event"] == EventName.HOOK_RUN]
        assert runs == [], runs
    finally:
        daemon.signaller.close()


HOOK = """
import os, sys, time
with open(sys.argv[1], "w") as out:
    out.write(str(os.getpid()))
time.sleep(1000)
"""


def test_a_stopping_daemon_cancels_a_notification_still_running_and_says_which(
    tmp_path: Path,
) -> None:
    """``run --once`` (and a stopping daemon) waits a bounded time for its ``on_action`` hooks,
    then cancels the one still running: its process is gone when the daemon returns, and
    ``hook.run`` names it with ``outcome=cancelled``; the queued one never starts."""
    pid_file = tmp_path / "hook.pid"
    hook = Hook((sys.executable, "-c", HOOK, str(pid_file)), timeout=600.0)
    policy = dataclasses.replace(
        default_policy(), state_dir=str(tmp_path / "state"), on_action=(hook,)
    )
    daemon = Daemon(policy, config_path="/nonexistent/gpuwatchd.yaml")
    daemon.notify_stop_grace = 0.5
    notify = HookIntent(HookName.ON_ACTION, "4242@1: freed (target exited)", {"user": "alice"})
    daemon.engine._carry_out(notify)
    daemon.engine._carry_out(notify)  # queued behind the first
    pid = _escaped(pid_file)
    try:
        with capture_logs() as logs:
            started = time.monotonic()
            daemon._finish_notifications()
        assert time.monotonic() - started < 15
        assert _gone(pid, timeout=0.5), "the hook outlived the daemon"
        runs = [e for e in logs if e["event"] == EventName.HOOK_RUN]
        cancelled = [e for e in runs if e.get("outcome") == "cancelled"]
        assert len(cancelled) == 1
        assert cancelled[0]["argv"] == list(hook.argv)
        assert cancelled[0]["returncode"] == -signal.SIGKILL
        assert "error" not in cancelled[0]
        dropped = [e for e in runs if e.get("outcome") == "dropped"]
        assert len(dropped) == 1
        assert "1 notification(s) not sent" in dropped[0]["detail"]
    finally:
        _cleanup(pid)
        daemon.signaller.close()


# --- end to end: run --once leaves nothing behind ----------------------------------------------


def once_with_a_lingering_hook(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    with SimHost(root) as host:
        orphan_host(host)
        hook = root / "notify-hook"
        hook.write_text(f"#!{sys.executable}\n{ESCAPES}")
        hook.chmod(0o755)
        pid_file = root / "escaped.pid"
        config = host.config(
            dry_run=False,
            rules=[ORPHAN_RULE],
            limits={"post_action_delay": "0s"},
            on_action=[{"command": [str(hook), str(pid_file), "exit"], "timeout": "60s"}],
        )
        # The driver frees the dead trainer's memory once its last holder is gone: run --once
        # is done (exit 0) only when the GPU is clean again.
        host.free_when_gone(["worker"], [gpu(0)])
        once = host.gpuwatchd("run", "--once", "--timeout", "30s", "--config", str(config))
        escaped = int(pid_file.read_text()) if pid_file.exists() else None
        alive = escaped is not None and not is_dead(escaped)
        if alive:
            assert escaped is not None
            os.kill(escaped, signal.SIGKILL)
        return {"code": once.returncode, "out": once.stdout + once.stderr,
                "escaped": escaped, "alive_after_exit": alive}  # fmt: skip


@pytest.mark.skipif(pid_namespace_command() is None, reason="needs a PID namespace")
def test_run_once_exits_with_no_process_of_its_hooks_left(tmp_path: Path) -> None:
    """An on_action hook that exits at once, leaving a child that left the session with a
    cleared environment (it could run until the hook's 60 s deadline): when ``run --once`` has
    exited, nothing of the hook is still running."""
    out = run_in_pid_namespace(f"{__name__}:once_with_a_lingering_hook", {}, root=tmp_path)
    assert out["code"] == 0, out["out"]
    assert out["escaped"] is not None, out["out"]
    assert not out["alive_after_exit"], "run --once exited with its hook's child running"


# The command cleans up after itself as hook scripts do (`trap 'kill 0' EXIT`): a signal to
# its whole process group, which it ignores itself, then it waits for its child and exits 0.
SIGNALS_ITS_GROUP = """
import os, signal, subprocess, sys
child = subprocess.Popen(["sleep", "1000"])
signum = getattr(signal, sys.argv[1])
signal.signal(signum, signal.SIG_IGN)
os.kill(0, signum)
print("child ended", child.wait(), flush=True)
"""


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP"])
def test_a_command_that_signals_its_own_process_group_is_neither_cancelled_nor_failed(
    signum: str,
) -> None:
    """Its `kill 0` reaches its own process group only: never its keeper, which took a
    SIGTERM for the daemon cancelling it ("cancelled: the daemon stopped", a drain hook that
    refused every reset) and died of a SIGHUP ("its keeper failed")."""
    result = run_command([sys.executable, "-c", SIGNALS_ITS_GROUP, signum], timeout=10)
    assert result.ok, result.describe()
    assert result.returncode == 0
    assert not result.cancelled
    assert f"child ended -{getattr(signal, signum)}" in result.output


def test_a_command_whose_keeper_died_is_killed_with_its_session_environment_or_not(
    tmp_path: Path,
) -> None:
    """The fallback when a keeper fails: the command (its environment cleared, so without its
    marker, in a process group of its own) is in the keeper's session, and dies with it."""
    pid_file = tmp_path / "pids"
    script = f"echo $$ $PPID > {pid_file}; exec env -i sleep 1000"
    results: list[CommandResult] = []
    runner = threading.Thread(
        target=lambda: results.append(run_command(["sh", "-c", script], timeout=30))
    )
    runner.start()
    deadline = time.monotonic() + 10
    while not pid_file.exists() or len(pid_file.read_text().split()) < 2:
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.01)
    command, keeper = (int(pid) for pid in pid_file.read_text().split())
    try:
        os.kill(keeper, signal.SIGKILL)  # this test's own child (run_command's keeper)
        runner.join(20)
        assert results, "run_command did not return"
        assert "its keeper failed" in (results[0].error or "")
        assert _gone(command), "the command outlived its failed keeper"
    finally:
        _cleanup(command)
