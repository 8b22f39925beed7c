"""What the running daemon serves to ``scan``: its answers, and the files it publishes.

This module owns the daemon's side of the served scan (docs/scan.md, "Answered by the daemon"):
the socket ``scan.sock`` and the files ``holders.json`` and ``nvml.json``, from the last poll.
The formats are :mod:`gpuwatchd.served`'s, the answer the command line's (handed in). It
decides nothing about findings and never acts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import structlog

from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.daemon.host import RealHost
from gpuwatchd.decide.policy import Policy
from gpuwatchd.engine.edges import PollReport
from gpuwatchd.served import holders as holder_view
from gpuwatchd.served import nvml as nvml_view
from gpuwatchd.served.guard import ServedPoll, ViewPublisher
from gpuwatchd.served.holders import HolderView
from gpuwatchd.served.scan_socket import ScanAnswer, ScanRequest, ScanServer
from gpuwatchd.state.directory import StateDir

log = structlog.get_logger("gpuwatchd")


class ScanServing:
    """The holder view, the NVML reading and the scan socket of one daemon. ``answer``: the
    daemon's ``ScanAnswerer`` (lifecycle.py), its main file and state_dir bound in; the last
    poll is None when there is none to serve from."""

    def __init__(
        self,
        state_dir: Callable[[], StateDir | None],
        wall_clock: Callable[[], float] = time.time,
        answer: Callable[[ScanRequest, ServedPoll | None], ScanAnswer] | None = None,
    ) -> None:
        self._state_dir = state_dir
        # Marked dirty by the device watch before its events are read.
        self.view = ViewPublisher(state_dir, _save_failed(holder_view.VIEW_FILE), wall_clock)
        self._reading = nvml_view.ReadingPublisher(state_dir, _save_failed(nvml_view.READING_FILE))
        self._own_start_ticks: int | None = None
        self._last: ServedPoll | None = None  # what a scan is answered from
        self._server = (
            None
            if answer is None
            else ScanServer(
                lambda request: answer(request, self._last),
                lambda problem: log.info(EventName.DAEMON_SCAN_REQUEST_FAILED, problem=problem),
            )
        )

    def publish(self, report: PollReport, policy: Policy, host: RealHost) -> None:
        """Keep the poll's holder view and NVML reading (both from its report) to answer
        ``scan`` from, and publish them; only while the device watch works."""
        snapshot, watch, nvml = report.snapshot, host.collector.watch, host.nvml
        self._last = None
        if watch is None or not watch.available or snapshot.boot_id is None:
            return
        if self._own_start_ticks is None:
            own = host.procfs.read_stat(os.getpid())
            if own is None:
                return
            self._own_start_ticks = own.starttime
        view = HolderView.of(
            boot_id=snapshot.boot_id,
            daemon_pid=os.getpid(),
            daemon_start_ticks=self._own_start_ticks,
            worker_pids=nvml.worker_pids,
            polled=snapshot.wall_time,
            fresh_for=holder_view.REFRESH + 2 * policy.interval + policy.nvml_timeout,
            settings=(policy.proc_root, policy.devices_dir, policy.device_major),
            holders=snapshot.holders,
            start_ticks={pid: info.start_ticks for pid, info in snapshot.processes.items()},
            dead_listed=host.collector.dead_listed,
            watch_fd=host.device_watch.fileno(),
            held_minors=host.collector.held_minors,
        )
        rewritten = self.view.publish(view.document())
        reply, asked = nvml.last_reply, nvml.last_asked_wall
        reading = (
            None
            if reply is None or asked is None
            else nvml_view.encode(
                boot_id=snapshot.boot_id,
                daemon_pid=os.getpid(),
                daemon_start_ticks=self._own_start_ticks,
                read_at=asked,
                polled=snapshot.wall_time,
                interval=policy.interval,
                reply=reply,
            )
        )
        self._reading.publish(reading, rewrite=rewritten)
        self._last = ServedPoll(view, reading, watch, self.view)

    def listen(self) -> None:
        """Listen for ``scan`` on the socket in ``state_dir``; without it, scans run alone."""
        if self._server is None:
            return
        state_dir = self._state_dir()
        error = "state_dir unusable" if state_dir is None else self._server.start(state_dir.fd)
        if error is not None:
            log.warning(
                EventName.DAEMON_SCAN_SOCKET_UNAVAILABLE,
                reason=error,
                consequence="each scan walks /proc by itself",
            )
            self._server = None

    def fileno(self) -> int | None:
        return None if self._server is None else self._server.fileno()

    def answer(self) -> bool:
        """Answer the scans waiting now (the daemon's wait saw its socket readable); False
        when a connection could not be accepted (out of file descriptors): it stays queued and
        the socket readable, so the wait leaves it until the next poll."""
        if self._server is not None:
            self._server.serve()
        return self._server is None or not self._server.accept_failed

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


def _save_failed(path: str) -> Callable[[str], None]:
    return lambda error: log.error(EventName.STATE_SAVE_FAILED, path=path, error=error)
