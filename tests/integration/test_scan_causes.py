"""The daemon walks /proc on cause, and no holder escapes (issue 16, scan on cause).

Pinned here: the pure rule's new causes (``device_opened``, ``backstop``, ``holder_gone``);
the inotify reader (opens, a removed file watched again when it reappears, a new device file,
a lost-events overflow); and, with real processes of this test and the fake NVML, the shapes
a holder can take between two walks — each must be found by a cause, or, for the one shape no
cause can see (an fd passed over a Unix socket), by the backstop sweep:

- a process opens a device file (``device_opened``);
- a holder forks a child that keeps the file (a descendant of a known holder: the targeted
  scan follows it, no walk needed);
- a holder forks a child and exits (the child is re-parented away: ``holder_gone``);
- a holder passes its fd over a Unix socket and keeps its own (no open, no descendant, no
  holder gone: found by the ``backstop`` walk, and only by it).

And a process a walk could not read (an unknown holder) stays unknown at every targeted poll,
and in a scan on the daemon's view, until it is read or gone.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.collect.collector import Collector
from gpuwatchd.collect.devwatch import DeviceWatch
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.model import Finding, GpuInfo, NvmlReading
from gpuwatchd.core.vocabulary import LadderStatus
from gpuwatchd.decide.full_scan import FullScanReason, FullScanState, full_scan_due, holder_gone
from gpuwatchd.decide.plan.decisions import plan
from gpuwatchd.decide.plan.intents import SignalIntent
from gpuwatchd.decide.plan.state import Ladder, PlanState
from gpuwatchd.decide.policy import Detection
from gpuwatchd.served.holders import HolderView
from tests.support import plancases
from tests.support.children import HOLD_FD, Spawn
from tests.support.collecting import fake_collector
from tests.support.fakenvml import FakeNvml, gpu, state
from tests.support.fakeproc import FakeProc, make_devices

# --- the rule ---------------------------------------------------------------------------------

QUIET = NvmlReading(available=True, gpus=())
RECENT = FullScanState(last_full=990.0)


@pytest.mark.parametrize(
    ("last", "watching", "changed", "expected"),
    [
        (990.0, False, False, None),
        (900.0, False, False, FullScanReason.PERIODIC),  # no watch: the plain interval
        (900.0, True, False, None),  # watched: the interval no longer walks...
        (300.0, True, False, FullScanReason.BACKSTOP),  # ...the backstop does
        (990.0, True, True, FullScanReason.DEVICE_OPENED),
        (990.0, False, True, FullScanReason.DEVICE_OPENED),  # a partial watch still counts
    ],
)
def test_watched_devices_replace_the_interval_with_causes_and_a_backstop(
    last: float, watching: bool, changed: bool, expected: FullScanReason | None
) -> None:
    reason, after = full_scan_due(
        QUIET,
        {},
        FullScanState(last_full=last),
        1000.0,
        interval=60.0,
        detection=Detection(),
        watching=watching,
        device_changed=changed,
        backstop=600.0,
    )
    assert reason == expected
    assert after.last_full == (1000.0 if expected is not None else last)


def test_a_holder_gone_is_a_cause_and_a_new_one_is_not() -> None:
    assert holder_gone(frozenset({1, 2}), frozenset({1, 2, 3})) is None
    assert holder_gone(frozenset({1, 2}), frozenset({2})) == FullScanReason.HOLDER_GONE
    assert holder_gone(frozenset(), frozenset()) is None


# --- the inotify reader -----------------------------------------------------------------------


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[DeviceWatch, Path]]:
    folder = tmp_path / "dev"
    folder.mkdir()
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0", "other"):
        (folder / name).touch()
    watch = DeviceWatch(str(folder))
    if not watch.start():
        pytest.skip(f"no inotify here: {watch.error}")
    yield watch, folder
    watch.close()


def test_an_open_of_a_device_file_is_news_and_of_another_file_is_not(
    watched: tuple[DeviceWatch, Path],
) -> None:
    watch, folder = watched
    assert not watch.drain().changed
    os.close(os.open(folder / "other", os.O_RDONLY))
    assert not watch.drain().changed
    os.close(os.open(folder / "nvidia0", os.O_RDONLY))
    news = watch.drain()
    assert news.changed
    assert news.opened == 1
    assert not watch.drain().changed  # drained


def test_a_removed_device_file_is_news_and_watched_again_when_it_returns(
    watched: tuple[DeviceWatch, Path],
) -> None:
    watch, folder = watched
    (folder / "nvidiactl").unlink()
    assert watch.drain().changed  # IN_IGNORED
    (folder / "nvidiactl").touch()
    assert watch.drain().changed  # a new device file
    os.close(os.open(folder / "nvidiactl", os.O_RDONLY))
    assert watch.drain().opened == 1


def test_a_device_file_replaced_while_the_old_one_is_held_is_watched(
    watched: tuple[DeviceWatch, Path],
) -> None:
    """The old file's watch lasts while a process holds it (no IN_IGNORED until its last
    close), so its name is no proof that the new file is watched: opens of the new one are
    news too (the device node made again, e.g. by nvidia-modprobe)."""
    watch, folder = watched
    held = os.open(folder / "nvidia0", os.O_RDONLY)
    try:
        (folder / "nvidia0").unlink()
        (folder / "nvidia0").touch()
        assert watch.drain().rewatched == 1
        os.close(os.open(folder / "nvidia0", os.O_RDONLY))
        assert watch.drain().opened == 1
    finally:
        os.close(held)


def test_a_new_device_file_is_watched(watched: tuple[DeviceWatch, Path]) -> None:
    watch, folder = watched
    (folder / "nvidia7").touch()
    assert watch.drain().rewatched == 1
    os.close(os.open(folder / "nvidia7", os.O_RDONLY))
    assert watch.drain().opened == 1


def test_an_open_of_a_mig_capability_file_is_news(watched: tuple[DeviceWatch, Path]) -> None:
    """``nvidia-caps/`` (MIG capability files) is watched too, also when it appears later: a
    process entering a MIG instance opens its capability file, and a served scan must not
    take a view that predates it."""
    watch, folder = watched
    caps = folder / "nvidia-caps"
    caps.mkdir()
    (caps / "nvidia-cap12").touch()
    (caps / "not-a-cap").touch()
    news = watch.drain()
    assert news.changed  # the folder appeared: watched, with what is in it
    assert news.rewatched == 1
    assert watch.available
    os.close(os.open(caps / "not-a-cap", os.O_RDONLY))
    assert not watch.drain().changed
    os.close(os.open(caps / "nvidia-cap12", os.O_RDONLY))
    assert watch.drain().opened == 1
    (caps / "nvidia-cap13").touch()  # a new instance's capability file
    assert watch.drain().rewatched == 1
    os.close(os.open(caps / "nvidia-cap13", os.O_RDONLY))
    assert watch.drain().opened == 1


def test_a_capability_folder_present_at_start_is_watched(tmp_path: Path) -> None:
    folder = tmp_path / "dev"
    (folder / "nvidia-caps").mkdir(parents=True)
    (folder / "nvidia0").touch()
    (folder / "nvidia-caps" / "nvidia-cap1").touch()
    watch = DeviceWatch(str(folder))
    if not watch.start():
        pytest.skip(f"no inotify here: {watch.error}")
    try:
        assert not watch.drain().changed
        os.close(os.open(folder / "nvidia-caps" / "nvidia-cap1", os.O_RDONLY))
        assert watch.drain().opened == 1
    finally:
        watch.close()


class _FolderWatchRefused(DeviceWatch):
    """The kernel refuses the folder's watch (ENOSPC: the user's inotify watches are used up)
    while ``refused``."""

    refused = True

    def _add_folder(self, path: str) -> int | None:
        return None if self.refused else super()._add_folder(path)


def test_a_folder_that_cannot_be_watched_leaves_the_watch_incomplete_until_it_is(
    tmp_path: Path,
) -> None:
    """Without the folder's watch a device file created later (the driver loaded) would never
    be watched, its opens unseen: the watch is not complete, and tries the folder again."""
    folder = tmp_path / "dev"
    folder.mkdir()
    watch = _FolderWatchRefused(str(folder))
    if not watch.start():
        pytest.skip(f"no inotify here: {watch.error}")
    try:
        assert not watch.available
        assert not watch.drain().available
        watch.refused = False
        assert watch.drain().available
        (folder / "nvidia0").touch()
        assert watch.drain().rewatched == 1
        os.close(os.open(folder / "nvidia0", os.O_RDONLY))
        assert watch.drain().opened == 1
    finally:
        watch.close()


def test_a_folder_that_cannot_be_listed_leaves_the_watch_incomplete_until_it_is(
    watched: tuple[DeviceWatch, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device file created while the folder cannot be listed (EMFILE: the daemon's fds used
    up) is not watched: its opens would go unseen, so the watch is not complete until a later
    listing watches it."""
    watch, folder = watched

    def no_fds(path: object) -> list[str]:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(os, "listdir", no_fds)
    (folder / "nvidia7").touch()
    assert not watch.drain().available
    monkeypatch.undo()
    news = watch.drain()
    assert (news.available, news.rewatched) == (True, 1)
    os.close(os.open(folder / "nvidia7", os.O_RDONLY))
    assert watch.drain().opened == 1


def _queue_limit() -> int:
    """The inotify queue's length, when it is short enough to overflow quickly."""
    try:
        limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    except (OSError, ValueError):
        pytest.skip("max_queued_events unknown")
    if limit > 100_000:
        pytest.skip("queue too long to overflow quickly")
    return limit


def test_lost_events_are_news(watched: tuple[DeviceWatch, Path]) -> None:
    watch, folder = watched
    limit = _queue_limit()
    paths = (folder / "nvidia0", folder / "nvidiactl")  # alternate: equal events coalesce
    for at in range(limit + 10):
        os.close(os.open(paths[at % 2], os.O_RDONLY))
    news = watch.drain()
    assert news.overflow
    assert news.changed


def test_a_device_file_replaced_during_lost_events_is_watched(
    watched: tuple[DeviceWatch, Path],
) -> None:
    """An overflow may have dropped a replaced file's IN_CREATE, and its name is still
    watched (the old file, held open, keeps its watch): each device file is watched again
    (before: opens of the new file went unseen while the watch said available)."""
    watch, folder = watched
    limit = _queue_limit()
    held = os.open(folder / "nvidia0", os.O_RDONLY)
    try:
        paths = (folder / "nvidiactl", folder / "nvidia-uvm")  # alternate: equal events coalesce
        for at in range(limit + 10):
            os.close(os.open(paths[at % 2], os.O_RDONLY))
        (folder / "nvidia0").unlink()
        (folder / "nvidia0").touch()  # its IN_CREATE is lost
        news = watch.drain()
        assert news.overflow
        assert news.rewatched == 1  # the new nvidia0; the others keep their watches
        os.close(os.open(folder / "nvidia0", os.O_RDONLY))
        assert watch.drain().opened == 1
    finally:
        os.close(held)


def test_without_inotify_the_watch_says_so() -> None:
    watch = DeviceWatch("/nonexistent-folder")
    news = watch.drain()  # never started
    assert not news.available
    assert not watch.available


# --- the shapes, with real processes ----------------------------------------------------------


@pytest.fixture
def daemonish(fake_nvml: FakeNvml) -> Iterator[tuple[Collector, list[float], Path]]:
    """A collector as the daemon builds it: device watch on, backstop 600 s, interval 60 s."""
    fake_nvml.write(state([gpu(0)]))
    clock = [1000.0]
    watch = DeviceWatch(str(fake_nvml.devices_dir))
    if not watch.start():
        pytest.skip(f"no inotify here: {watch.error}")
    with fake_collector(fake_nvml, clock, watch=watch, backstop=600.0) as collector:
        yield collector, clock, fake_nvml.devices_dir / "nvidia0"
    watch.close()


def _poll(
    collector: Collector, clock: list[float], step: float = 5.0
) -> tuple[str | None, set[int]]:
    snapshot = collector.collect()
    clock[0] += step
    reason = collector.last_scan_reason
    # Our own NVML worker holds the files too; the daemon never counts it.
    return (None if reason is None else reason.value), set(snapshot.holders.holdings) - set(
        snapshot.self_pids
    )


def _quiet(collector: Collector, clock: list[float]) -> None:
    """Poll until the walks of setting up are done; then polls are targeted."""
    for _ in range(5):
        if _poll(collector, clock)[0] is None:
            return
    raise AssertionError("never quiet")


WAIT_LINE = "import sys\nsys.stdin.readline()\n"


def script(body: str) -> str:
    """A child running ``body`` after its setup lines; ``body`` prints "ready" itself."""
    return f"import ctypes, mmap, os, time\n{body}time.sleep(60)\n"


def test_a_process_that_opens_a_device_file_starts_a_walk(
    daemonish: tuple[Collector, list[float], Path], spawn: Spawn
) -> None:
    collector, clock, node = daemonish
    _quiet(collector, clock)
    opener = spawn(HOLD_FD.format(body=f"fd = os.open({str(node)!r}, os.O_RDONLY)"))
    reason, holders = _poll(collector, clock)
    assert reason == "device_opened"
    assert opener.pid in holders
    assert _poll(collector, clock) == (None, holders)  # followed, no further walk


def _holder_that_forks(
    daemonish: tuple[Collector, list[float], Path], spawn: Spawn, *, child: str, after: str
) -> tuple[subprocess.Popen[str], int]:
    """A holder of GPU 0's device file, seen by two polls, told to fork: its child runs
    ``child`` and sleeps, it runs ``after`` once it printed the child's PID. The holder and
    that PID."""
    collector, clock, node = daemonish
    body = (
        f"fd = os.open({str(node)!r}, os.O_RDONLY)\n"
        'print("ready", flush=True)\n' + WAIT_LINE + "kid = os.fork()\n"
        f"if kid == 0:\n{child}    time.sleep(60)\n    os._exit(0)\n"
        "print(kid, flush=True)\n" + after
    )
    holder = spawn(script(body))
    _poll(collector, clock)
    _quiet(collector, clock)
    assert holder.stdin is not None
    assert holder.stdout is not None
    holder.stdin.write("go\n")
    holder.stdin.flush()
    return holder, int(holder.stdout.readline())


def test_a_child_of_a_holder_is_followed_without_a_walk(
    daemonish: tuple[Collector, list[float], Path], spawn: Spawn
) -> None:
    collector, clock, _ = daemonish
    holder, kid = _holder_that_forks(daemonish, spawn, child="", after="")
    reason, holders = _poll(collector, clock)
    assert reason is None  # no open happened, nobody left: the targeted scan follows it
    assert {holder.pid, kid} <= holders


def test_a_holder_that_forks_and_exits_starts_a_walk_that_finds_the_child(
    daemonish: tuple[Collector, list[float], Path], spawn: Spawn
) -> None:
    collector, clock, _ = daemonish
    holder, kid = _holder_that_forks(
        daemonish, spawn, child="    os.setsid()\n", after="os._exit(0)\n"
    )
    holder.wait(timeout=10)
    try:
        reason, holders = _poll(collector, clock)
        assert reason == "holder_gone"
        assert kid in holders
    finally:
        os.kill(kid, signal.SIGKILL)  # the orphan this test made (re-parented to init)


def test_an_fd_passed_over_a_socket_is_found_by_the_backstop(
    daemonish: tuple[Collector, list[float], Path], spawn: Spawn, tmp_path: Path
) -> None:
    collector, clock, node = daemonish
    address = str(tmp_path / "pass.sock")
    receiver = spawn(
        "import os, socket, time\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.bind({address!r}); s.listen(1)\n"
        'print("ready", flush=True)\n'
        "c, _ = s.accept()\n"
        "_, fds, _, _ = socket.recv_fds(c, 16, 1)\n"
        'print("got", flush=True)\n'
        "time.sleep(60)\n"
    )
    body = (
        "import socket\n"
        f"fd = os.open({str(node)!r}, os.O_RDONLY)\n"
        'print("ready", flush=True)\n' + WAIT_LINE + "c = socket.socket(socket.AF_UNIX)\n"
        f"c.connect({address!r})\n"
        "socket.send_fds(c, [b'x'], [fd])\n"
        'print("sent", flush=True)\n'
        "time.sleep(60)\n"
    )
    sender = spawn(script(body))
    _poll(collector, clock)
    _quiet(collector, clock)
    assert sender.stdin is not None
    assert sender.stdout is not None
    assert receiver.stdout is not None
    sender.stdin.write("go\n")
    sender.stdin.flush()
    assert sender.stdout.readline().strip() == "sent"
    assert receiver.stdout.readline().strip() == "got"
    # The blind spot: no open, not a descendant, nobody gone.
    reason, holders = _poll(collector, clock)
    assert reason is None
    assert receiver.pid not in holders
    clock[0] += 600.0
    reason, holders = _poll(collector, clock)
    assert reason == "backstop"
    assert receiver.pid in holders


# --- what a walk could not read ---------------------------------------------------------------


class _OneGpu:
    """An NVML source: one GPU, no processes listed."""

    worker_pids: frozenset[int] = frozenset()

    def read(self) -> NvmlReading:
        return NvmlReading(available=True, gpus=(GpuInfo(index=0, uuid="GPU-0", minor=0),))


@pytest.fixture
def unknown_holder(tmp_path: Path) -> tuple[FakeProc, ProcFS]:
    """A fake /proc: 500 holds nvidiactl, 600's fds cannot be read (its fd folder is a file:
    ENOTDIR, as EACCES or a thread-table budget spent make it unknown on a host)."""
    devices = make_devices(tmp_path / "dev")
    fake = FakeProc(tmp_path / "proc")
    fake.add(500, fds={3: str(devices / "nvidiactl")})
    hidden = fake.add(600, comm="hidden")
    shutil.rmtree(hidden / "fd")
    (hidden / "fd").write_text("")
    return fake, ProcFS(str(fake.root), devices_dir=str(devices))


def test_a_process_a_walk_could_not_read_stays_unknown_at_every_targeted_poll(
    unknown_holder: tuple[FakeProc, ProcFS],
) -> None:
    """What it holds is unknown, not nothing: the targeted polls after the walk read it again
    (a verdict must not turn clean by not looking), and forget it once it is gone."""
    fake, procfs = unknown_holder
    clock = [1000.0]
    collector = Collector(
        procfs,
        _OneGpu(),
        namespace_check=False,
        clock=lambda: clock[0],
        wall_clock=lambda: clock[0],
    )
    polls = []
    for _ in range(3):
        snapshot = collector.collect()
        polls.append((collector.last_scan_reason, sorted(snapshot.holders.unreadable)))
        clock[0] += 2.0
    assert polls == [(FullScanReason.FIRST, [600]), (None, [600]), (None, [600])]
    fake.remove(600)
    snapshot = collector.collect()
    assert (collector.last_scan_reason, snapshot.holders.unreadable) == (
        FullScanReason.HOLDER_GONE,
        frozenset(),
    )


def test_a_process_a_walk_could_not_read_that_exits_is_a_holder_gone(
    unknown_holder: tuple[FakeProc, ProcFS], tmp_path: Path
) -> None:
    """It may have held the files: a child it forked since the walk (not followed: an unknown
    PID's descendants are not scanned) keeps them once it exits, and only a walk finds it."""
    fake, procfs = unknown_holder
    collector = Collector(procfs, _OneGpu(), namespace_check=False)
    collector.collect()
    fake.add(700, ppid=600, fds={3: str(tmp_path / "dev" / "nvidiactl")})
    assert 700 not in collector.collect().holders.holdings
    fake.remove(600)
    snapshot = collector.collect()
    assert collector.last_scan_reason == FullScanReason.HOLDER_GONE
    assert set(snapshot.holders.holdings) == {500, 700}


def test_a_scan_on_the_daemons_view_keeps_what_its_poll_could_not_read(
    unknown_holder: tuple[FakeProc, ProcFS],
) -> None:
    """The view carries the unknown PIDs (in memory) to the collector of a served scan, seeded
    as cli/scan.py seeds it: its targeted scan reads them again, as a walk would."""
    _fake, procfs = unknown_holder
    daemon = Collector(procfs, _OneGpu(), namespace_check=False)
    polled = daemon.collect()
    view = HolderView.of(
        boot_id="b" * 36, daemon_pid=1, daemon_start_ticks=1, worker_pids=frozenset(),
        polled=0.0, fresh_for=60.0, settings=("/proc", "/dev", 195), holders=polled.holders,
        start_ticks={}, dead_listed=daemon.dead_listed, held_minors=daemon.held_minors,
    )  # fmt: skip
    served = Collector(procfs, _OneGpu(), namespace_check=False, may_walk=False)
    served.seed(view.holders, view.dead_listed, unknown=view.unknown, held_minors=view.held_minors)
    snapshot = served.collect()
    assert served.last_scan_reason is None
    assert (set(snapshot.holders.holdings), set(snapshot.holders.unreadable)) == ({500}, {600})


# --- a ladder's target, holder or not -----------------------------------------------------------


def test_a_target_whose_ladder_ended_is_described_while_it_lives_and_never_signalled_again(
    tmp_path: Path,
) -> None:
    """An orphan that outlived its ladder closes its device files: no holder, no process NVML
    lists, so the snapshot left it out and its ended ladder was dropped as gone; opening them
    again started a new ladder, a second SIGTERM. The daemon's collector describes every
    ladder's target (``watched``): the ladder goes only once /proc has no such process."""
    devices = make_devices(tmp_path / "dev")
    fake = FakeProc(tmp_path / "proc")
    fds = {3: str(devices / "nvidia0"), 4: str(devices / "nvidia-uvm")}
    fake.add(500, starttime=1000, fds=fds)
    target = plancases.proc(500, 1000)
    finding = plancases.orphan(target, gpu_uuid="GPU-0")
    ended = Ladder(target="500@1000", pid=500, start_ticks=1000, finding_key=finding.key,
                   rule="orphans", gpu="GPU-0", steps=(("SIGTERM", 30.0),), step=1, due=None,
                   status=LadderStatus.ENDED, dry_run=False, started=0.0)  # fmt: skip
    plan_state = [PlanState(ladders={ended.target: ended})]
    collector = Collector(ProcFS(str(fake.root), devices_dir=str(devices)), _OneGpu(),
                          namespace_check=False)  # fmt: skip
    collector.watched = lambda: [lad.pid for lad in plan_state[0].ladders.values()]

    def poll(findings: list[Finding]) -> list[SignalIntent]:
        result = plan(findings, collector.collect(full=True), plan_state[0], plancases.policy(),
                      now=100.0, wall=100.0)  # fmt: skip
        plan_state[0] = result.state
        return plancases.signals(result)

    assert poll([finding]) == []
    for fd in fds:
        (fake.root / "500" / "fd" / str(fd)).unlink()
    assert poll([]) == []
    assert list(plan_state[0].ladders) == ["500@1000"]
    for fd, device in fds.items():
        fake.open_fd(500, fd, device)
    assert poll([finding]) == []  # still its ended ladder: never signalled again
    fake.remove(500)
    assert (poll([]), plan_state[0].ladders) == ([], {})
