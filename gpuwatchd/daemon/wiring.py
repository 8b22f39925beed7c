"""The real host, built once: every part the daemon's engine reads and acts through.

This module owns the wiring of ``run`` and ``run --once`` on this machine: the ``/proc`` reader
(:func:`procfs_for`, also ``scan``'s), the NVML client, the collector, the device-file watch,
the signaller, the actuator and the host reader of :mod:`gpuwatchd.daemon.host`; and
:meth:`RealHost.apply`, the one place where the policy's reloadable settings reach the parts
that keep a copy of them (at start and at every reload alike). It decides and reads nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gpuwatchd.act.signals import Signaller
from gpuwatchd.collect.collector import Collector
from gpuwatchd.collect.jobs import cgroup2_mount
from gpuwatchd.collect.kernel_log import KernelLog
from gpuwatchd.collect.nvml import NvmlClient
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.daemon.host import HookQueue, HostActuator, HostReader
from gpuwatchd.decide.policy import Policy
from gpuwatchd.served.guard import GuardedWatch


def procfs_for(policy: Policy) -> ProcFS:
    """The ``/proc`` reader (and its holder scan) the policy's settings describe."""
    return ProcFS(
        policy.proc_root, devices_dir=policy.devices_dir, device_major=policy.device_major
    )


@dataclass
class RealHost:
    """The parts of the real host; :func:`build_real_host` makes them."""

    procfs: ProcFS
    nvml: NvmlClient
    collector: Collector
    device_watch: GuardedWatch
    signaller: Signaller
    actuator: HostActuator
    reader: HostReader
    hook_queue: HookQueue = field(default_factory=HookQueue)

    def apply(self, policy: Policy) -> None:
        """Hand the policy's reloadable settings to the parts that keep a copy of them. The
        fixed ones (``state_dir``, ``devices_dir``, ``proc_root``, ``device_major``,
        ``mig_minors_file``) need a restart: the daemon's reload keeps them."""
        self.nvml.timeout = policy.nvml_timeout
        self.collector.full_scan_interval = policy.full_scan_interval
        self.collector.backstop = policy.full_scan_backstop
        self.collector.detection = policy.detection

    def close(self) -> None:
        if self.collector.kernel_log is not None:
            self.collector.kernel_log.close()
        self.signaller.close()
        self.nvml.close()
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
        namespace_check=policy.namespace_check,
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
    signaller = Signaller(policy.proc_root)
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
