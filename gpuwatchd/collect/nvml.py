"""NVML access for the daemon and ``scan``: a deadline-bound client of the NVML worker process.

This module starts the worker (:mod:`gpuwatchd.collect.nvml_worker`, the only importer of
pynvml), asks it for one poll at a time over a pipe and turns the reply into model values. It
never imports pynvml and decides nothing. In detail: docs/internals.md, `gpuwatchd.collect.nvml`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from importlib.machinery import PathFinder
from typing import Any, Protocol

from gpuwatchd.collect.mig import MAX_INSTANCE_ID, MAX_MIG_DEVICES
from gpuwatchd.core.checked import as_flag, as_map, as_xid_event, items, obj, opt_integer, opt_text
from gpuwatchd.core.codec import decode_json_object
from gpuwatchd.core.model import (
    GpuHealth,
    GpuInfo,
    GpuMemory,
    MigDevice,
    NvmlProcess,
    NvmlReading,
    Support,
    XidEvent,
    as_int,
)
from gpuwatchd.core.paths import NVML_LAUNCHER_FILE, NVML_WORKER_FILE
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.events import lazylog
from gpuwatchd.events.words import short

log = lazylog.get_logger()

UNAVAILABLE_PREFIX = "NVIDIA driver/NVML not available: "
REAP_GRACE = 0.2  # seconds to wait for a SIGKILLed worker to disappear
BACKOFF_MAX = 60.0  # seconds: the longest wait before a failed read is tried again
WORKER_FILE = NVML_WORKER_FILE
MEMORY_V1_NOTICE = "memory_v1"  # nvml_worker's (the worker imports nothing from gpuwatchd)
# All the worker inherits of our environment (the real libnvidia-ml reads none of it):
# LD_LIBRARY_PATH for a driver outside the loader's cache, FAKENVML_* for the test double.
_INHERITED_NAMES = frozenset({"PATH", "LD_LIBRARY_PATH"})
_INHERITED_PREFIXES = ("FAKENVML_",)
_DEFAULT_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
# A reply line longer than this is no worker's: 64 GPUs of 4,096 processes each take ~40 MiB.
MAX_REPLY = 64 << 20

Spawn = Callable[..., "subprocess.Popen[bytes]"]


def worker_environment(inherited: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The worker's whole environment: the allowed part of ``inherited``, then ``extra``, less
    any ``PYTHON*`` variable (``-I`` ignores them anyway). Pure."""
    env = {
        name: value
        for name, value in inherited.items()
        if name in _INHERITED_NAMES or name.startswith(_INHERITED_PREFIXES)
    }
    env.update(extra)
    env.setdefault("PATH", _DEFAULT_PATH)
    return {name: value for name, value in env.items() if not name.startswith("PYTHON")}


def library_folders(search_path: Sequence[str], cwd: str | None) -> list[str]:
    """The absolute ``search_path`` entry, never ``cwd`` (which a hostile user may have filled,
    and ``-m``, ``-c`` or an empty ``PYTHONPATH`` element put there), where pynvml is found;
    empty when nowhere else (the worker then finds it itself or reports NVML unavailable)."""
    for entry in search_path:
        if not os.path.isabs(entry) or entry == cwd:
            continue
        if PathFinder.find_spec("pynvml", [entry]) is not None:
            return [entry]
    return []


def worker_command(python: str, folders: Sequence[str], worker: str = WORKER_FILE) -> list[str]:
    return [python, "-I", NVML_LAUNCHER_FILE, worker, *folders]


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether ``proc`` (our child) exits within ``timeout`` seconds; it is reaped if so. One
    ``select`` on a pidfd (our unreaped child's PID cannot be reused), else, before Linux 5.3,
    ``Popen.wait``'s loop of sleeps."""
    if proc.poll() is not None:
        return True
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    return proc.poll() is not None


class NvmlSource(Protocol):
    """Where a collector's NVML reading comes from: an :class:`NvmlClient`, or the daemon's
    published reading (:class:`gpuwatchd.served.nvml.Published`, a served ``scan``)."""

    @property
    def worker_pids(self) -> frozenset[int]: ...

    def read(self) -> NvmlReading: ...


class _WorkerGone(Exception):
    """The worker closed its pipe or died before answering."""


class NvmlClient:
    """Reads NVML through a worker process, with a deadline per poll.

    ``env`` is added to the worker's environment (:func:`worker_environment`); ``clock`` times
    the backoff only (deadlines on the pipe use the real monotonic clock); ``spawn`` starts the
    worker (tests model one that SIGKILL cannot end)."""

    def __init__(
        self,
        timeout: float = 10.0,
        *,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        clock: Callable[[], float] = time.monotonic,
        backoff_initial: float = 1.0,
        spawn: Spawn = subprocess.Popen,
    ) -> None:
        self.timeout = timeout
        self._spawn = spawn
        self._env = dict(env) if env is not None else {}
        self._python = python
        self._clock = clock
        self._backoff_initial = backoff_initial
        self._backoff = backoff_initial
        self._retry_at: float | None = None
        self._last_failure: NvmlReading | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._hung: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._pending = False  # a read request was sent ahead (prefetch) and not yet answered
        self._asked_wall = 0.0  # when the pending request was sent (wall seconds)
        # The last successful read's reply and when it was asked for (wall seconds), None after
        # a failed one: what the daemon publishes (gpuwatchd/served/nvml.py).
        self.last_reply: Mapping[str, Any] | None = None
        self.last_asked_wall: float | None = None
        self._v1_logged: set[str] = set()
        # Each GPU's last reply and what it was decoded into: a quiet GPU's is reused.
        self._decoded: list[tuple[object, GpuInfo]] = []

    @property
    def worker_pids(self) -> frozenset[int]:
        """PIDs of our live workers, a hung one included: never holders, never targets."""
        procs = (self._proc, self._hung)
        return frozenset(p.pid for p in procs if p is not None and p.poll() is None)

    def prefetch(self) -> None:
        """Send the next ``read`` request without waiting, so the worker's start-up overlaps a
        short command's own; :meth:`read` collects the reply and reports a failed start."""
        self._reap_hung()
        if self._pending or self._hung is not None or self._retry_at is not None:
            return
        with contextlib.suppress(OSError, _WorkerGone):
            if self._proc is None:
                self._start()
            self._send(self._proc, {"op": "read"})
            self._pending = True
            self._asked_wall = time.time()

    def read(self) -> NvmlReading:
        """One poll of every GPU; never blocks much past ``timeout``."""
        self._reap_hung()
        self.last_reply = self.last_asked_wall = None
        if self._proc is None:
            if self._hung is not None:
                return NvmlReading(
                    available=True,
                    wedged=True,
                    error=f"NVML worker pid {self._hung.pid} is stuck in the kernel "
                    "(driver may be hung)",
                )
            failure, retry_at = self._last_failure, self._retry_at
            if failure is not None and retry_at is not None and self._clock() < retry_at:
                return failure
        deadline = time.monotonic() + self.timeout
        try:
            if self._proc is None:
                self._start()
            if self._pending:
                self._pending, asked = False, self._asked_wall
            else:
                asked = time.time()
                self._send(self._proc, {"op": "read"})
            reply = self._receive(self._proc, deadline)
        except TimeoutError:
            return self._wedged()
        except (_WorkerGone, OSError) as error:
            return self._unavailable(str(error))
        if not reply.get("available"):
            return self._unavailable(str(reply.get("error") or "unknown reason"))
        try:
            reading = self._to_reading(reply)
        except ValueError as error:  # not the worker's shape: as unknown as a failed read
            return self._unavailable(f"NVML worker sent a malformed reply: {str(error)[:200]}")
        self.last_reply, self.last_asked_wall = reply, asked
        self._backoff, self._retry_at, self._last_failure = self._backoff_initial, None, None
        return reading

    def stop(self) -> bool:
        """Shut the worker down so we hold no device file. True when no worker of ours lives.
        The client may still be used afterwards (the worker restarts on demand)."""
        self._retire_worker()
        self._reap_hung()
        return not self.worker_pids

    def _start(self) -> None:
        try:
            cwd: str | None = os.getcwd()
        except OSError:
            cwd = None  # our folder was removed: nothing to exclude
        self._buffer = b""
        self._proc = self._spawn(
            worker_command(self._python, library_folders(sys.path, cwd)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=worker_environment(os.environ, self._env),
            cwd="/",
            close_fds=True,
            bufsize=0,
        )
        log.debug(EventName.NVML_WORKER_STARTED, pid=self._proc.pid)

    def _send(self, proc: subprocess.Popen[bytes] | None, request: Mapping[str, Any]) -> None:
        if proc is None or proc.stdin is None:
            raise _WorkerGone("no NVML worker")
        try:
            os.write(proc.stdin.fileno(), (json.dumps(request) + "\n").encode())
        except BrokenPipeError as error:
            raise _WorkerGone(self._death_note(proc)) from error

    def _receive(self, proc: subprocess.Popen[bytes] | None, deadline: float) -> dict[str, Any]:
        if proc is None or proc.stdout is None:
            raise _WorkerGone("no NVML worker")
        fd, pending, scanned = proc.stdout.fileno(), bytearray(self._buffer), 0
        while (end := pending.find(b"\n", scanned)) < 0:
            if len(pending) > MAX_REPLY:
                raise _WorkerGone(f"NVML worker sent a reply over {MAX_REPLY >> 20} MiB")
            scanned = len(pending)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise _WorkerGone(self._death_note(proc))
            pending += chunk
        line, self._buffer = bytes(pending[:end]), bytes(pending[end + 1 :])
        try:
            return decode_json_object(line)
        except ValueError as error:
            raise _WorkerGone(f"NVML worker sent garbage: {line[:200]!r}") from error

    def _death_note(self, proc: subprocess.Popen[bytes]) -> str:
        if not wait_exit(proc, REAP_GRACE):
            return "NVML worker closed its pipe"
        return f"NVML worker exited unexpectedly (status {proc.returncode})"

    def _finish(self, proc: subprocess.Popen[bytes]) -> None:
        """Wait briefly for ``proc`` to exit, SIGKILL it if not, and close its pipes; keep it as
        hung if it lives (in the driver's uninterruptible sleep until the kernel call returns)."""
        if not wait_exit(proc, REAP_GRACE):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            if not wait_exit(proc, REAP_GRACE):
                self._hung = proc
                log.critical(
                    EventName.NVML_WORKER_HUNG,
                    pid=proc.pid,
                    reason="NVML worker did not die after SIGKILL (stuck in the kernel); "
                    "no new worker starts while it lives",
                )
                return
        self._close_pipes(proc)

    def _retire_worker(self) -> None:
        """Ask the worker to shut NVML down and exit; SIGKILL it if it does not."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(_WorkerGone, OSError, TimeoutError):
                    deadline = time.monotonic() + self.timeout
                    self._send(proc, {"op": "shutdown"})
                    # A prefetched read is answered first; the shutdown's reply ends the wait.
                    while "shutdown" not in self._receive(proc, deadline):
                        pass
            self._finish(proc)
        self._buffer = b""
        self._pending = False

    def _reap_hung(self) -> None:
        if self._hung is not None and self._hung.poll() is not None:
            log.info(EventName.NVML_HUNG_WORKER_EXITED, pid=self._hung.pid)
            self._close_pipes(self._hung)
            self._hung = None

    @staticmethod
    def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def _schedule_retry(self, reading: NvmlReading) -> NvmlReading:
        self._retry_at = self._clock() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        self._last_failure = reading
        return reading

    def _wedged(self) -> NvmlReading:
        reading = NvmlReading(
            available=True,
            wedged=True,
            error=f"NVML call did not return within {self.timeout:g}s (driver may be hung)",
        )
        proc, self._proc = self._proc, None
        if not (self._last_failure is not None and self._last_failure.wedged):
            # Once a stretch: each retry of a hung driver would repeat it (EventName.NVML_RECOVERED
            # ends the stretch; status and the status line show it meanwhile).
            log.critical(
                EventName.NVML_WEDGED, timeout=self.timeout, pid=None if proc is None else proc.pid
            )
        if proc is not None:
            self._finish(proc)
        self._buffer = b""
        return self._schedule_retry(reading)

    def _unavailable(self, reason: str) -> NvmlReading:
        self._retire_worker()  # a fresh worker per retry finds a driver that appeared since
        reading = NvmlReading(available=False, error=UNAVAILABLE_PREFIX + reason)
        if self._last_failure is None or self._last_failure.error != reading.error:
            log.warning(EventName.NVML_UNAVAILABLE, reason=reason)  # once a reason, as wedged
        return self._schedule_retry(reading)

    def _to_reading(self, reply: Mapping[str, Any]) -> NvmlReading:
        # A GPU whose part of the reply equals the last poll's gets the same GpuInfo back.
        last = self._decoded
        self._decoded = [
            (raw, last[i][1] if i < len(last) and last[i][0] == raw else decode_gpu(raw))
            for i, raw in enumerate(items(reply.get("gpus") or [], "gpus"))
        ]
        gpus = tuple(gpu for _, gpu in self._decoded)
        for notice in map(as_map, items(reply.get("notices") or [], "notices")):
            if notice.get("notice") != MEMORY_V1_NOTICE:
                continue
            index, uuid, reason = notice.get("index"), notice.get("uuid"), notice.get("reason")
            gpu = short(uuid if isinstance(uuid, str) and uuid else f"index:{index}")
            if gpu not in self._v1_logged:
                self._v1_logged.add(gpu)
                log.warning(
                    EventName.NVML_MEMORY_V1_FALLBACK,
                    gpu=gpu,
                    index=as_int(index),
                    reason=short(reason) if isinstance(reason, str) else None,
                    consequence="allocated memory unknown (v1 'used' includes the driver "
                    "reservation); no ghost detection until an idle baseline is learned",
                )
        driver = opt_text(reply.get("driver_version"), "driver_version")
        return NvmlReading(available=True, driver_version=driver, gpus=gpus)


def _whole(raw: Mapping[str, object], key: str, high: int = 2**32 - 1) -> int | None:
    """None, or an integer from 0 to ``high`` (NVML's unsigned int); ValueError otherwise."""
    return opt_integer(raw.get(key), key, 0, high + 1)


def _switch(raw: Mapping[str, object], key: str) -> bool | None:
    """None, or true or false (the worker sends NVML's modes as 0 or 1); ValueError otherwise,
    where ``bool()`` would read the string "false" as true."""
    value = raw.get(key)
    if value is not None and not (isinstance(value, int) and value in (0, 1)):
        raise ValueError(f"{key}: expected true or false")
    return None if value is None else bool(value)


def _needed(raw: Mapping[str, object], key: str) -> int:
    found = _whole(raw, key)
    if found is None:
        raise ValueError(f"{key}: missing")
    return found


def _to_memory(raw: object) -> GpuMemory | None:
    if raw is None:
        return None
    raw = obj(raw, "memory")
    names = ("total", "free", "reserved", "allocated", "used_v1")
    total, free, reserved, allocated, used_v1 = (_whole(raw, key, 2**64 - 1) for key in names)
    api = opt_text(raw.get("api"), "api") or "v2"
    return GpuMemory(total, free, reserved, allocated, api, used_v1)


def _to_processes(processes: object) -> tuple[NvmlProcess, ...] | None:
    if processes is None:
        return None
    return tuple(
        NvmlProcess(
            pid=_needed(p, "pid"),
            used_memory=_whole(p, "used_memory", 2**64 - 1),
            kind=opt_text(p.get("kind"), "kind") or "compute",
        )
        for p in (obj(entry, "process") for entry in items(processes, "processes"))
    )


def decode_gpu(raw: object) -> GpuInfo:
    """One GPU of a worker reply (or of :mod:`gpuwatchd.served.nvml`'s reading) as a
    :class:`GpuInfo`; ValueError on an entry not of the worker's shape (docs/internals.md)."""
    raw = obj(raw, "gpu")
    return GpuInfo(
        index=_needed(raw, "index"),
        # A GPU lost before its UUID was ever read has none; "" never matches a real GPU.
        uuid=opt_text(raw.get("uuid"), "uuid") or "",
        name=opt_text(raw.get("name"), "name"),
        pci_bus_id=opt_text(raw.get("pci_bus_id"), "pci_bus_id"),
        minor=_whole(raw, "minor"),
        memory=_to_memory(raw.get("memory")),
        processes=_to_processes(raw.get("processes")),
        mig_enabled=_switch(raw, "mig_mode"),
        persistence_mode=_switch(raw, "persistence_mode"),
        numa_node=_whole(raw, "numa_node"),
        numa_node_unknown=_switch(raw, "numa_node_unknown") is True,
        architecture=_whole(raw, "architecture"),
        nvlink_active=_whole(raw, "nvlink_active"),
        lost=_switch(raw, "lost") is True,
        error=opt_text(raw.get("error"), "error"),
        health=to_health(raw.get("health")),
        mig_devices=to_mig_devices(raw.get("mig_devices")),
    )


# --- a GPU's health and MIG devices: a value of the wrong type or out of range is unknown, never
# a number that could lead to an action (what it means is decide/health/judge.py's) ----------

MAX_RECOVERY_ACTION = 255
MAX_COUNT = 2**32 - 1  # NVML's counters are unsigned int
MAX_XIDS_PER_POLL = 256  # the worker takes no more; a longer list is cut
MAX_FABRIC_STATE = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
MAX_NVML_RETURN = 0xFFFF  # nvmlReturn_t values are small (999 is "unknown")
MAX_MASK = 2**32 - 1
MAX_SUMMARY = 255  # an unsigned char


def _support(raw: object) -> Support:
    try:
        return Support(raw)
    except ValueError:
        return Support.UNKNOWN


def bounded(value: object, high: int) -> int | None:
    """An integer (not a bool) from 0 to ``high``; None otherwise."""
    number = as_int(value)
    return number if number is not None and 0 <= number <= high else None


def _checked(
    section: Mapping[str, object], *values: object
) -> tuple[Support, Mapping[str, object]]:
    """A section's support (unknown where it says ok but a value it must carry is invalid), and
    what its values are read from: the section when ok, else nothing (every value None)."""
    support = _support(section.get("status"))
    if support is Support.OK and None in values:
        support = Support.UNKNOWN
    return support, section if support is Support.OK else {}


def _xids(raw: object) -> tuple[XidEvent, ...]:
    if not isinstance(raw, list):
        return ()
    found = (as_map(item) for item in raw[:MAX_XIDS_PER_POLL])
    events = (as_xid_event(item.get("xid"), item.get("wall")) for item in found)
    return tuple(event for event in events if event is not None)


def to_health(raw: object) -> GpuHealth | None:
    """A checked :class:`GpuHealth`, or None when the entry is missing or not an object."""
    if not isinstance(raw, Mapping):
        return None
    action, rows = as_map(raw.get("recovery_action")), as_map(raw.get("remapped_rows"))
    pages, fabric = as_map(raw.get("retired_pages")), as_map(raw.get("fabric"))
    action_support, action = _checked(action, bounded(action.get("value"), MAX_RECOVERY_ACTION))
    remap_support, rows = _checked(rows, as_flag(rows.get("pending")), as_flag(rows.get("failure")))
    pages_support, pages = _checked(pages, as_flag(pages.get("pending")))
    fabric_support, fabric = _checked(fabric, bounded(fabric.get("state"), MAX_FABRIC_STATE))
    return GpuHealth(
        events=_support(raw.get("events")),
        xids=_xids(raw.get("xids")),
        recovery_action=bounded(action.get("value"), MAX_RECOVERY_ACTION),
        recovery_support=action_support,
        remap_correctable=bounded(rows.get("correctable"), MAX_COUNT),
        remap_uncorrectable=bounded(rows.get("uncorrectable"), MAX_COUNT),
        remap_pending=as_flag(rows.get("pending")),
        remap_failure=as_flag(rows.get("failure")),
        remap_support=remap_support,
        pages_pending=as_flag(pages.get("pending")),
        pages_single_bit=bounded(pages.get("single_bit"), MAX_COUNT),
        pages_double_bit=bounded(pages.get("double_bit"), MAX_COUNT),
        pages_support=pages_support,
        fabric_support=fabric_support,
        fabric_state=bounded(fabric.get("state"), MAX_FABRIC_STATE),
        fabric_status=bounded(fabric.get("probe_status"), MAX_NVML_RETURN),
        fabric_health_mask=bounded(fabric.get("health_mask"), MAX_MASK),
        fabric_health_summary=bounded(fabric.get("health_summary"), MAX_SUMMARY),
    )


# The profile in the driver's MIG device name: 1g.10gb in "NVIDIA H100 80GB HBM3 MIG 1g.10gb".
_PROFILE = re.compile(r" MIG ([0-9a-z.+-]{1,32})$")


def _text(value: Any, most: int = 256) -> str | None:
    return value[:most] if isinstance(value, str) else None


def to_mig_devices(raw: Any) -> tuple[MigDevice, ...] | None:
    """The worker's ``mig_devices`` as :class:`MigDevice` values; None when unknown."""
    if not isinstance(raw, list):
        return None
    devices: list[MigDevice] = []
    for entry in raw[:MAX_MIG_DEVICES]:
        if not isinstance(entry, Mapping):
            continue
        placement = entry.get("placement")
        where: tuple[int, int] | None = None
        if isinstance(placement, list) and len(placement) == 2:
            start, size = (bounded(v, MAX_INSTANCE_ID) for v in placement)
            where = None if start is None or size is None else (start, size)
        name = _text(entry.get("name"))
        profile = None if name is None else _PROFILE.search(name)
        try:
            processes: tuple[NvmlProcess, ...] | None = _to_processes(entry.get("processes"))
        except ValueError:
            processes = None  # not the worker's shape: unknown, never "none"
        try:
            memory: GpuMemory | None = _to_memory(entry.get("memory"))
        except ValueError:
            memory = None
        devices.append(
            MigDevice(
                index=bounded(entry.get("index"), MAX_MIG_DEVICES) or 0,
                uuid=_text(entry.get("uuid"), 96),
                gi=bounded(entry.get("gi"), MAX_INSTANCE_ID),
                ci=bounded(entry.get("ci"), MAX_INSTANCE_ID),
                name=name,
                profile=None if profile is None else profile.group(1),
                gi_profile_id=bounded(entry.get("gi_profile_id"), MAX_INSTANCE_ID),
                placement=where,
                memory=memory,
                processes=processes,
                error=_text(entry.get("error"), 1024),
            )
        )
    return tuple(devices)
