"""A notification that raises past its own guard on the HookQueue's thread is said through
the engine's event sink, by the main loop, as the catalogue's crashed ``hook.run`` (so metrics
and ``status`` see it), and the queue keeps serving."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpuwatchd.config.schema import default_policy
from gpuwatchd.core.vocabulary import EventName, HookOutcome, Level
from gpuwatchd.daemon.host import HookQueue
from gpuwatchd.events.catalogue import render
from tests.support.enginerig import rig
from tests.support.snapshots import HostBuilder


def _crash() -> None:
    raise RuntimeError("bug in a notification")


def test_a_crash_goes_to_on_crash_and_the_next_notification_still_runs() -> None:
    queue = HookQueue()
    errors: list[str] = []
    seen: list[int] = []
    queue.on_crash = errors.append
    assert queue(_crash)
    assert queue(lambda: seen.append(1))
    assert queue.close(grace=5.0) == 0
    assert errors == ["RuntimeError('bug in a notification')"]
    assert seen == [1]


def test_the_engine_says_it_on_the_main_loop_through_its_sink() -> None:
    r = rig(default_policy(), lambda t: HostBuilder().gpu(0))
    queue = HookQueue()
    queue.on_crash = r.engine.background_crashed
    assert queue(_crash)
    assert queue.close(grace=5.0) == 0
    assert r.sink.named(EventName.HOOK_RUN) == []  # nothing emitted from the queue's thread
    r.engine.report_background_hooks()
    ((name, level, fields),) = [e for e in r.sink.events if e[0] == EventName.HOOK_RUN]
    assert level == Level.ERROR
    assert fields["outcome"] == HookOutcome.CRASHED
    assert fields["hook"] == "on_action"
    assert render(name, fields) == (
        "An on_action notification crashed: RuntimeError('bug in a notification')."
    )
    r.engine.report_background_hooks()  # said once
    assert len(r.sink.named(EventName.HOOK_RUN)) == 1


def test_the_daemon_hands_its_queue_to_its_engine(tmp_path: Path) -> None:
    from gpuwatchd.daemon.lifecycle import Daemon

    policy = dataclasses.replace(default_policy(), state_dir=str(tmp_path / "state"))
    daemon = Daemon(policy, config_path=str(tmp_path / "none.yaml"))
    assert daemon.hook_queue.on_crash == daemon.engine.background_crashed
