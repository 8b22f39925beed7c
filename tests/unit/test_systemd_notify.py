"""sd_notify and the watchdog (gpuwatchd/daemon/notify.py): slow work runs on the caller's own
thread while a helper thread only feeds the watchdog."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from gpuwatchd.daemon.notify import Notifier, keep_watchdog_fed, watchdog_slice


class _Recorder(Notifier):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[tuple[str, str]] = []

    def notify(self, message: str) -> None:
        self.messages.append((message, threading.current_thread().name))


def _feeders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpuwatchd-watchdog"]


def test_slow_work_runs_on_the_callers_thread_and_the_watchdog_is_fed_meanwhile() -> None:
    notifier = _Recorder()
    caller = threading.current_thread()

    def work() -> threading.Thread:
        time.sleep(0.35)
        return threading.current_thread()

    ran_on = keep_watchdog_fed(notifier, work, every=0.05)
    assert ran_on is caller
    pings = [name for message, name in notifier.messages if message == "WATCHDOG=1"]
    assert pings.count("gpuwatchd-watchdog") >= 3  # fed while the work ran, not only after
    assert _feeders() == []


def test_an_error_in_slow_work_reaches_the_caller_and_the_feeder_stops() -> None:
    notifier = _Recorder()

    def work() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        keep_watchdog_fed(notifier, work, every=0.05)
    assert _feeders() == []


@pytest.mark.parametrize(
    ("usec", "expected"),
    [
        ("30000000", 10.0),
        (None, 5.0),
        ("bogus", 5.0),
        ("-3", 5.0),
        ("³0", 5.0),
        ("\u0663\u0660000000", 5.0),  # Arabic-Indic digits, which int() would read
        ("9" * 5000, 5.0),  # more digits than int() converts
        ("0", 5.0),
    ],
)
def test_the_watchdog_is_fed_three_times_a_period(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, expected: float
) -> None:
    if usec is None:
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    else:
        monkeypatch.setenv("WATCHDOG_USEC", usec)
    assert watchdog_slice() == expected


def test_the_pinger_feeds_at_most_once_per_period_and_never_from_a_forked_child() -> None:
    """A long holder scan calls the pinger after each process: the watchdog hears of it at most
    every ``every`` seconds, from this process only (NotifyAccess=main refuses a child's)."""
    import os

    from gpuwatchd.daemon.notify import WatchdogPinger

    now = [100.0]
    pings: list[float] = []
    pinger = WatchdogPinger(lambda: pings.append(now[0]), every=1.0, clock=lambda: now[0])
    for _ in range(12):  # 3 s of progress in steps of 0.25 s
        now[0] += 0.25
        pinger()
    assert len(pings) == 3
    pinger.pid = os.getpid() + 1  # as seen from a forked scan worker
    now[0] += 5
    pinger()
    assert len(pings) == 3


def test_a_notification_reaches_systemd_as_utf_8_whatever_its_text(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """systemd reads a notification as UTF-8; sdnotify encodes as Latin-1, and a character
    past it (in an NVML error, a policy path) dropped the whole message unsaid, the STATUS
    line and its WATCHDOG=1 with it; a file name that is not UTF-8 is sent escaped."""
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(path)
        systemd.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        message = "STATUS=NVML unavailable: café → 故障 (retrying)\nWATCHDOG=1"
        Notifier().notify(message)
        assert systemd.recv(4096) == message.encode()
        Notifier().notify("STATUS=policy rejected, running the previous one (/etc/\udcff.yaml)")
        assert systemd.recv(4096).endswith(b"(/etc/\\udcff.yaml)")
