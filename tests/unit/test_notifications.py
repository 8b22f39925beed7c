"""``on_action`` notifications and the ``{hostname}``/``{user}`` placeholders.

The engine runs with the fake edges of ``test_engine`` (no processes, no sleeping); the
background runner is replaced to show that a notification never runs on the poll itself.
:class:`gpuwatchd.daemon.host.HookQueue` is tested with real threads. The real daemon in the systemd
container runs one after a kill (``tests/system/test_systemd.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

import pytest

from gpuwatchd.act.commands import CommandResult
from gpuwatchd.config.schema import parse_policy_documents, render_policy
from gpuwatchd.config.yamlsrc import ConfigError
from gpuwatchd.core.model import ProcessIdentity
from gpuwatchd.core.vocabulary import EventName, SignalOutcome
from gpuwatchd.daemon.host import HookQueue, node_name
from gpuwatchd.decide.argv import HOOK_VALUE_LIMIT, check_value, format_argv, hook_environment
from gpuwatchd.decide.policy import Policy
from gpuwatchd.engine.cycle import Engine
from tests.support import enginerig

NOTIFY = """
on_action:
  - [notify, "{user}", "{hostname}", "{uuid}"]
"""


def policy(extra: str, *, dry_run: bool = False) -> Policy:
    """The engine tests' policy with ``extra`` as a drop-in (its lists replace theirs)."""
    base = enginerig.make_policy(dry_run=dry_run)
    return parse_policy_documents([("<base>", render_policy(base)), ("<drop-in>", extra)])


class Deferred:
    """A background that keeps the work until told to run it (a thread that is slow)."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.pending: list[Callable[[], None]] = []

    def __call__(self, work: Callable[[], None]) -> bool:
        if self.accept:
            self.pending.append(work)
        return self.accept

    def run_all(self) -> None:
        while self.pending:
            self.pending.pop(0)()


def with_background(
    r: enginerig.Rig, background: Deferred, hostname: str | None = "gpu17"
) -> enginerig.Rig:
    engine: Engine = r.engine
    engine.background = background
    engine.hostname = hostname
    return r


def notify_commands(r: enginerig.Rig) -> list[tuple[tuple[str, ...], dict[str, str]]]:
    return [
        (argv, dict(env or {})) for argv, env in r.actuator.commands if argv and argv[0] == "notify"
    ]


def kill_worker(r: enginerig.Rig, *, pause: str | None = None) -> None:
    """Poll once (SIGTERM to worker 201), then (paused for ``pause``) it is seen to exit."""
    r.poll_at(0.0)
    pid, signal, dry = r.actuator.signals[0]
    assert (pid, signal, dry) == (201, "SIGTERM", False)
    if pause is not None:
        r.engine.set_paused(pause)
    start = enginerig.orphan_host(0.0).build().processes[pid].start_ticks or 0
    r.clock.now = 0.5
    r.engine.note_exits([ProcessIdentity(pid, start)])


def test_a_freed_target_notifies_with_its_owner_the_node_and_the_gpu_off_the_poll() -> None:
    background = Deferred()
    r = with_background(enginerig.rig(policy(NOTIFY), enginerig.orphan_host), background)
    kill_worker(r)
    assert notify_commands(r) == []  # queued, not run on the main loop
    assert len(background.pending) == 1
    background.run_all()
    ((argv, env),) = notify_commands(r)
    assert argv == ("notify", "alice", "gpu17", enginerig.GPU0)
    assert env["GPUWATCHD_EVENT"] == "on_action"
    assert env["GPUWATCHD_ACTION"] == "signal"
    assert env["GPUWATCHD_OUTCOME"] == "freed"
    assert env["GPUWATCHD_USER"] == "alice"
    assert env["GPUWATCHD_HOSTNAME"] == "gpu17"
    assert env["GPUWATCHD_PID"] == "201"
    assert env["GPUWATCHD_RULE"] == "orphans"
    # One sentence for a chat or a mail, worded by the event catalogue (no internal key).
    assert env["GPUWATCHD_MESSAGE"] == (
        f"PID 201 of user alice on {enginerig.GPU0}, signalled by rule orphans, was stopped; its"
        " GPU memory is freed (target exited)."
    )
    assert r.sink.named(EventName.HOOK_RUN) == []  # reported by the main loop, at its next poll
    r.poll_at(1.0)
    (ran,) = r.sink.named(EventName.HOOK_RUN)
    assert ran["hook"] == "on_action"
    assert ran["argv"] == ["notify", "alice", "gpu17", enginerig.GPU0]
    assert ran["returncode"] == 0


@pytest.mark.parametrize("end", ["exited", "survived"])
def test_a_ladder_that_ends_during_a_pause_still_notifies(end: str) -> None:
    """A pause holds new actions, not the news of one taken before it (docs/escalation.md): a
    ladder whose target exits, or whose last wait ends, while paused notifies its owner."""
    background = Deferred()
    r = with_background(enginerig.rig(policy(NOTIFY), enginerig.orphan_host), background)
    if end == "exited":
        kill_worker(r, pause="driver upgrade")
    else:
        r.poll_at(0.0)
        r.poll_at(30.0)
        r.engine.set_paused("driver upgrade")
        r.poll_at(40.0)
    background.run_all()
    ((_argv, env),) = notify_commands(r)
    assert env["GPUWATCHD_OUTCOME"] == {"exited": "freed", "survived": "survived"}[end]


def test_a_full_queue_drops_the_notification_and_says_so() -> None:
    r = with_background(
        enginerig.rig(policy(NOTIFY), enginerig.orphan_host), Deferred(accept=False)
    )
    kill_worker(r)
    (dropped,) = r.sink.named(EventName.HOOK_RUN)
    assert dropped["outcome"] == "dropped"
    assert "queue is full" in str(dropped["detail"])
    assert notify_commands(r) == []


class CrashingActuator(enginerig.Actuator):
    """A command runner with a bug: it raises instead of returning a result."""

    def run_command(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        if argv and argv[0] == "notify":
            raise RuntimeError("bug in the runner")
        return super().run_command(argv, timeout=timeout, env=env)


def test_a_crashing_notification_is_one_hook_run_through_the_event_sink() -> None:
    """Not logged past the sink on the notification's thread: reported by the main loop as
    ``hook.run`` ``outcome=crashed`` (error), so metrics and status see it too."""
    background = Deferred()
    r = with_background(
        enginerig.rig(policy(NOTIFY), enginerig.orphan_host, actuator=CrashingActuator()),
        background,
    )
    kill_worker(r)
    background.run_all()  # the notification raises on its thread: nothing escapes
    r.poll_at(1.0)
    (crashed,) = r.sink.named(EventName.HOOK_RUN)
    assert crashed["outcome"] == "crashed"
    assert crashed["hook"] == "on_action"
    assert "bug in the runner" in str(crashed["error"])
    assert [level for name, level, _ in r.sink.events if name == EventName.HOOK_RUN] == ["error"]


def test_dry_run_notifies_nobody_and_shows_the_would_be_notification_once() -> None:
    background = Deferred()
    r = with_background(
        enginerig.rig(policy(NOTIFY, dry_run=True), enginerig.orphan_host), background
    )
    for t in (0.0, 31.0, 42.0, 60.0):  # the whole would-be ladder
        r.poll_at(t)
    assert background.pending == []
    assert notify_commands(r) == []
    # The would-be SIGKILL is assumed to end the target (as enforcement's would): its
    # notification is shown as enforcement would send it, marked would-be, once.
    (shown,) = [h for h in r.sink.named(EventName.HOOK_RUN) if h["hook"] == "on_action"]
    assert shown["dry_run"] is True
    assert shown["outcome"] == "dry_run"
    assert shown["argv"] == ["notify", "alice", "gpu17", enginerig.GPU0]


def test_a_target_that_survives_its_ladder_notifies_survived() -> None:
    r = with_background(enginerig.rig(policy(NOTIFY), enginerig.orphan_host), Deferred())
    for t in (0.0, 30.0, 40.0):  # SIGTERM, SIGKILL, the end: it never exits
        r.poll_at(t)
    r.engine.background.run_all()  # type: ignore[attr-defined]
    ((_argv, env),) = notify_commands(r)
    assert env["GPUWATCHD_OUTCOME"] == "survived"


def test_a_denied_signal_notifies_failed() -> None:
    act = enginerig.Actuator(outcome=SignalOutcome.DENIED)
    r = with_background(
        enginerig.rig(policy(NOTIFY), enginerig.orphan_host, actuator=act), Deferred()
    )
    r.poll_at(0.0)
    r.engine.background.run_all()  # type: ignore[attr-defined]
    ((_argv, env),) = notify_commands(r)
    assert env["GPUWATCHD_OUTCOME"] == "failed"


def test_a_reset_notifies_and_a_hook_needing_an_unknown_user_is_not_run() -> None:
    extra = """
reset: {confirm_for: 0s}
on_action:
  - [notify, "{hostname}", "{pci_bus_id}"]
  - [notify, "{user}"]
"""
    r = with_background(enginerig.rig(policy(extra), enginerig.ghost_host), Deferred())
    r.poll_at(0.0)
    r.engine.background.run_all()  # type: ignore[attr-defined]
    ((argv, env),) = notify_commands(r)  # the {user} one did not run
    assert argv[:2] == ("notify", "gpu17")
    assert env["GPUWATCHD_ACTION"] == "reset"
    assert env["GPUWATCHD_OUTCOME"] == "reset"
    assert env["GPUWATCHD_MESSAGE"] == f"{enginerig.GPU0} was reset."
    assert "GPUWATCHD_USER" not in env
    r.poll_at(1.0)
    ran = [h for h in r.sink.named(EventName.HOOK_RUN) if h["hook"] == "on_action"]
    assert len(ran) == 2
    assert ran[0]["returncode"] == 0
    assert ran[1]["returncode"] is None
    assert "no value for {user}" in str(ran[1]["error"])


def test_a_failed_reset_notifies_reset_failed_besides_on_failure() -> None:
    extra = """
reset: {confirm_for: 0s}
on_failure:
  - [drain-node, "{hostname}", "{pci_bus_id}"]
"""
    r = with_background(
        enginerig.rig(
            policy(extra + NOTIFY),
            enginerig.ghost_host,
            actuator=enginerig.Actuator(returncode=255),
        ),
        Deferred(),
    )
    r.poll_at(0.0)
    # on_failure now gets its placeholders filled (it used to be run without values).
    drains = [argv for argv, _env in r.actuator.commands if argv[0] == "drain-node"]
    assert len(drains) == 1
    assert drains[0][1] == "gpu17"
    assert drains[0][2].endswith(":00.0")
    r.engine.background.run_all()  # type: ignore[attr-defined]
    assert notify_commands(r) == []  # NOTIFY needs {user}, unknown after a reset: not run
    r.poll_at(1.0)
    ran = [h for h in r.sink.named(EventName.HOOK_RUN) if h["hook"] == "on_action"]
    assert len(ran) == 1
    assert "reset_failed" in str(ran[0]["reason"])


def test_an_unknown_hostname_fails_only_the_hooks_that_use_it() -> None:
    extra = """
on_action:
  - [notify, "{hostname}"]
  - [notify, plain]
"""
    r = with_background(
        enginerig.rig(policy(extra), enginerig.orphan_host), Deferred(), hostname=None
    )
    kill_worker(r)
    r.engine.background.run_all()  # type: ignore[attr-defined]
    assert [argv for argv, _env in notify_commands(r)] == [("notify", "plain")]


# --- placeholders in the policy -----------------------------------------------------------------


def test_user_and_hostname_are_hook_placeholders_only() -> None:
    policy('on_action: [[notify, "{user}@{hostname}"]]')
    policy('on_failure: [[notify, "{hostname}"]]')
    policy('reset: {drain: [[scontrol, "nodename={hostname}"]]}')
    with pytest.raises(ConfigError, match=r"unknown placeholder \{user\}"):
        policy('reset: {command: [nvidia-smi, -r, -i, "{uuid}", "{user}"]}')
    with pytest.raises(ConfigError, match="did you mean 'user'"):
        policy('on_action: [[notify, "{usr}"]]')


@pytest.mark.parametrize(
    ("name", "value", "ok"),
    [
        ("hostname", "gpu17", True),
        ("hostname", "gpu17.cluster.example", True),
        ("hostname", "-rf", False),
        ("hostname", "a b", False),
        ("hostname", "gpu17.", False),
        ("hostname", "x" * 64, False),  # one label is at most 63
        ("hostname", ".".join(["x" * 63] * 4), False),  # 255 > 253
        ("user", "alice", True),
        ("user", "svc_train.bot", True),
        ("user", "machine$", True),
        ("user", "-alice", False),
        ("user", "alice;rm", False),
        ("user", "a" * 33, False),
        ("user", "", False),
    ],
)
def test_hostname_and_user_values_are_checked_before_a_hook_runs(
    name: str, value: str, ok: bool
) -> None:
    if ok:
        assert check_value(name, value) == value
        assert format_argv([f"{{{name}}}"], **{name: value}) == (value,)
    else:
        with pytest.raises(ValueError, match="refusing to run"):
            check_value(name, value)


def test_node_name_is_this_hosts_name() -> None:
    import socket

    assert node_name() == socket.gethostname()


# --- the daemon's queue -------------------------------------------------------------------------


def test_hook_queue_runs_work_in_order_on_one_thread_and_close_waits() -> None:
    queue = HookQueue(capacity=4)
    seen: list[tuple[int, str]] = []

    def work(i: int) -> Callable[[], None]:
        return lambda: seen.append((i, threading.current_thread().name))

    for i in range(3):
        assert queue(work(i))
    assert queue.close(grace=5.0) == 0
    assert [i for i, _ in seen] == [0, 1, 2]
    assert {name for _, name in seen} == {"gpuwatchd-notify"}


def test_hook_queue_refuses_past_capacity_and_close_is_bounded() -> None:
    queue = HookQueue(capacity=2)
    release = threading.Event()
    started = threading.Event()

    def blocker() -> None:
        started.set()
        release.wait(10)

    assert queue(blocker)
    assert started.wait(5)
    assert queue(lambda: None)
    assert queue(lambda: None)
    assert not queue(lambda: None)  # two wait already: refused, not queued
    t0 = time.monotonic()
    left = queue.close(grace=0.3)
    assert time.monotonic() - t0 < 3.0
    assert left == 2  # never started
    release.set()


@pytest.mark.parametrize("started", [True, False])
def test_hook_queue_refuses_work_after_close_rather_than_keep_it_unrun(started: bool) -> None:
    """Work handed over after close would never run, nor be counted as dropped: it is
    refused, which the engine says as a dropped notification."""
    queue = HookQueue()
    seen: list[int] = []
    if started:
        assert queue(lambda: seen.append(0))
    assert queue.close(grace=5.0) == 0
    assert not queue(lambda: seen.append(1))
    assert queue.close(grace=5.0) == 0
    assert seen == ([0] if started else [])


def test_hook_queue_survives_a_crashing_notification() -> None:
    queue = HookQueue()
    seen: list[int] = []

    def crash() -> None:
        raise RuntimeError("bug")

    assert queue(crash)
    assert queue(lambda: seen.append(1))
    assert queue.close(grace=5.0) == 0
    assert seen == [1]


def test_hook_environment_values_carry_no_control_characters_and_are_bounded() -> None:
    """A process's name is a user's text; in GPUWATCHD_REASON it must not carry a newline
    (a forged mail header or log line in the hook) nor grow without bound."""
    hostile = "pid 4242 (evil\nSubject: you won\r\x1b[2J\u2028\x85) " + "y" * 5000
    env = hook_environment("on_action", reason=hostile, user="alice", pid=4242, outcome=None)
    reason = env["GPUWATCHD_REASON"]
    assert reason.isprintable()
    assert reason.startswith("pid 4242 (evil\\nSubject: you won\\r\\x1b[2J\\u2028\\x85) yyy")
    assert len(reason) == HOOK_VALUE_LIMIT
    assert reason.endswith("...")
    assert env["GPUWATCHD_USER"] == "alice"
    assert env["GPUWATCHD_PID"] == "4242"
    assert "GPUWATCHD_OUTCOME" not in env
    assert all(value.isprintable() for value in env.values())
