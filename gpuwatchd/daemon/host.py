"""The real host, built once, and its edges for the engine: NVML and ``/proc`` in, pidfd signals
and commands out.

This module owns the adapters that give :class:`gpuwatchd.engine.cycle.Engine` the machine it
runs on (reader, actuator, clock, log sink, the ``on_action`` hook thread, the node's name), the
wiring of ``run`` and ``run --once`` (:func:`build_real_host`; :func:`procfs_for` is also
``scan``'s) and :meth:`RealHost.apply`, the one place where the policy's reloadable settings
reach the parts that keep a copy of them. It adds no decisions of its own.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from gpuwatchd.act.commands import CommandResult, CommandScope, run_command
from gpuwatchd.act.signals import Signaller, SignalResult
from gpuwatchd.collect.collector import Collector
from gpuwatchd.collect.jobs import cgroup2_mount
from gpuwatchd.collect.kernel_log import KernelLog
from gpuwatchd.collect.nvml import NvmlClient
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.model import GpuInfo, HolderScan, ProcessIdentity, ProcessInfo, Snapshot
from gpuwatchd.core.vocabulary import EventName, HookName, HookOutcome, Level
from gpuwatchd.decide.policy import Policy
from gpuwatchd.served.guard import GuardedWatch

log = structlog.get_logger("gpuwatchd")


@dataclass(eq=False)
class HostReader:
    """The engine's :class:`gpuwatchd.engine.edges.HostReader` on the real host."""

    collector: Collector
    procfs: ProcFS
    nvml: NvmlClient

    def collect(self) -> Snapshot:
        return self.collector.collect()

    def stop_nvml(self) -> bool:
        return self.nvml.stop()

    def final_scan(self, minor: int | None) -> tuple[HolderScan, Mapping[int, ProcessInfo]]:
        holders = self.procfs.holders.scan(None)
        pids = set(holders.holdings) | set(holders.unreadable)
        return holders, self.procfs.read_processes(pids)

    def read_gpus(self) -> tuple[GpuInfo, ...]:
        return self.nvml.read().gpus

    def self_pids(self) -> frozenset[int]:
        return frozenset({os.getpid()}) | self.nvml.worker_pids


class HostActuator:
    """The engine's :class:`gpuwatchd.engine.edges.Actuator` on the real host."""

    def __init__(self, signaller: Signaller) -> None:
        self.signaller = signaller
        self.commands = CommandScope()

    def signal(self, identity: ProcessIdentity, signal: str, *, dry_run: bool) -> SignalResult:
        return self.signaller.send(identity, signal, dry_run=dry_run)

    def run_command(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        return run_command(argv, timeout=timeout, env=env, scope=self.commands)

    def exits(self, timeout: float) -> list[ProcessIdentity]:
        return self.signaller.wait(timeout)


@dataclass(frozen=True)
class SystemClock:
    """Monotonic time for deadlines, wall time for history and logs (both injectable)."""

    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


class LogSink:
    """Every engine event as one structlog event at its level (journald priority)."""

    def emit(self, name: str, level: Level, fields: Mapping[str, object]) -> None:
        getattr(log, level if level in set(Level) else Level.INFO)(name, **fields)


def node_name() -> str | None:
    """This node's name for ``{hostname}``: the kernel's host name (the UTS namespace's: in a
    container, the container's, unless it shares the host's). Unknown if it cannot be read."""
    try:
        return socket.gethostname() or None
    except OSError:
        return None


class HookQueue:
    """Runs ``on_action`` notifications one after another on one thread, off the main loop.

    At most ``capacity`` wait (a notification past that is refused: the engine logs it as
    dropped). A notification that raises is handed to ``on_crash`` (the daemon's engine);
    only a queue with none logs it itself.
    """

    def __init__(self, capacity: int = 32) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=capacity)
        self._thread: threading.Thread | None = None
        self._closing = False
        self.on_crash: Callable[[str], None] | None = None

    def __call__(self, work: Callable[[], None]) -> bool:
        if self._closing:  # nothing would run it: refused, so the engine says it is dropped
            return False
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name="gpuwatchd-notify", daemon=True
            )
            self._thread.start()
        try:
            self._queue.put_nowait(work)
        except queue.Full:
            return False
        return True

    def _serve(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            try:
                work()
            except Exception as err:  # a bug in one notification must not stop the others
                self._crashed(repr(err))

    def _crashed(self, error: str) -> None:
        if self.on_crash is not None:
            try:
                self.on_crash(error)
            except Exception:  # noqa: S110 - said below, the last resort
                pass
            else:
                return
        LogSink().emit(
            EventName.HOOK_RUN,
            Level.ERROR,
            {"hook": HookName.ON_ACTION, "outcome": HookOutcome.CRASHED, "error": error},
        )

    def close(self, grace: float) -> int:
        """Take no more work; let the queue finish for up to ``grace`` seconds. Returns how
        many notifications never started (dropped now)."""
        was_closing, self._closing = self._closing, True
        if self._thread is None:
            return 0
        deadline = time.monotonic() + grace
        if not was_closing:
            with contextlib.suppress(queue.Full):  # full: the join below runs out instead
                self._queue.put(None, timeout=grace)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            return 0
        dropped = 0
        with contextlib.suppress(queue.Empty):  # every notification never started, taken
            while True:
                dropped += self._queue.get_nowait() is not None
        self._queue.put_nowait(None)  # the thread ends after the one it runs
        return dropped

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the running notification; True when none runs."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.busy


def procfs_for(policy: Policy) -> ProcFS:
    return ProcFS(
        policy.proc_root, devices_dir=policy.devices_dir, device_major=policy.device_major
    )


@dataclass
class RealHost:
    procfs: ProcFS
    nvml: NvmlClient
    collector: Collector
    device_watch: GuardedWatch
    signaller: Signaller
    actuator: HostActuator
    reader: HostReader
    hook_queue: HookQueue = field(default_factory=HookQueue)

    def apply(self, policy: Policy) -> None:
        """Hand the policy's reloadable settings to the parts that keep a copy of them (the
        daemon's reload keeps the others: ``daemon.lifecycle.FIXED_SETTINGS``)."""
        self.nvml.timeout = policy.nvml_timeout
        self.collector.full_scan_interval = policy.full_scan_interval
        self.collector.backstop = policy.full_scan_backstop
        self.collector.detection = policy.detection
        self.collector.namespace_check = policy.namespace_check

    def close(self) -> None:
        if self.collector.kernel_log is not None:
            self.collector.kernel_log.close()
        self.signaller.close()
        self.nvml.stop()
        self.device_watch.close()


def build_real_host(
    policy: Policy,
    *,
    on_device_event: Callable[[], bool] = lambda: True,
    nvml_env: Mapping[str, str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    ended_by_scheduler: Mapping[str, int | None] | None = None,
    kernel_log: bool = False,
) -> RealHost:
    """Build the real host for ``policy``. ``on_device_event``: called before the device
    watch's queued events are read (the daemon marks its published holder view dirty; False
    closes the watch). ``ended_by_scheduler``: the jobs ``run --once
    --ended-job`` was told of (job -> when it was said, in boot ticks). ``kernel_log``: read
    the kernel log's Xids (``health.kernel_log``; the daemon, not ``run --once``)."""
    procfs = procfs_for(policy)
    nvml = NvmlClient(policy.nvml_timeout, env=nvml_env)
    collector = Collector(
        procfs,
        nvml,
        cgroup_root=cgroup2_mount(),
        clock=clock,
        wall_clock=wall_clock,
        ended_by_scheduler={} if ended_by_scheduler is None else ended_by_scheduler,
        mig_minors_file=policy.mig_minors_file,
        kernel_log=(
            KernelLog(
                policy.health.kernel_log,
                read_process=procfs.read_process,
                clock=clock,
                wall_clock=wall_clock,
            )
            if kernel_log
            else None
        ),
    )
    signaller = Signaller(policy.proc_root, as_judged=collector.as_judged)
    host = RealHost(  # the reloadable settings: apply() below, as at each reload
        procfs=procfs,
        nvml=nvml,
        collector=collector,
        # Scan on cause (docs/scan.md): walk /proc when a device file is opened, else on the
        # backstop; the daemon starts the watch once it holds the lock.
        device_watch=GuardedWatch(policy.devices_dir, on_device_event),
        signaller=signaller,
        actuator=HostActuator(signaller),
        reader=HostReader(collector, procfs, nvml),
    )
    host.apply(policy)
    return host
