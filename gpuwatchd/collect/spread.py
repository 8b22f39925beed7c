"""Spreading the holder scan's per-process work over idle cores, by fork, merged in order.

In detail: docs/internals.md, section `gpuwatchd.collect.spread`.
"""

from __future__ import annotations

import contextlib
import functools
import marshal
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence

# (pid, GPU minors via fd, GPU minors via mapping, nvidiactl, nvidia-uvm, matched by name,
# partly unreadable, threads' own fd tables left unread, nvidia-cap minors via fd, via mapping,
# procfs capability files as (GPU minor, GPU instance, compute instance or None))
Minors = tuple[int, ...]
CapFile = tuple[int, int, int | None]
Row = tuple[int, Minors, Minors, bool, bool, bool, bool, bool, Minors, Minors, tuple[CapFile, ...]]
# What a scan of a slice is given besides its PIDs: a call after each process (or None)
Tick = Callable[[], None] | None
Scan = Callable[[Sequence[int], Tick], list[Row]]

MIN_SLICE = 400  # fewer processes than this per worker: a fork costs more than it saves
MAX_WORKERS = 4
HEARTBEAT = 0.5  # seconds between a worker's signs of progress on its pipe
_ALIVE, _ROWS = b".", b"R"  # a worker's pipe: any number of _ALIVE, then _ROWS + its rows


def idle_cpus(loadavg: str, cpus: int) -> int:
    """CPUs not busy now: ``cpus`` less the runnable tasks other than us (the fourth field of
    ``/proc/loadavg``'s text, ``running/total``). Pure."""
    try:
        running = int(loadavg.split()[3].split("/", maxsplit=1)[0])
    except (IndexError, ValueError):
        return 1
    return max(1, cpus - max(0, running - 1))


def worker_count(
    processes: int,
    *,
    cpus: int,
    idle: int,
    max_workers: int | None,
    min_slice: int = MIN_SLICE,
) -> int:
    """How many processes (the caller included) should share a walk of ``processes``. Pure."""
    limit = MAX_WORKERS if max_workers is None else max(1, max_workers)
    return max(1, min(limit, cpus, idle, processes // max(1, min_slice)))


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _idle(cpus: int) -> int:
    try:
        with open("/proc/loadavg", encoding="ascii") as handle:
            return idle_cpus(handle.read(), cpus)
    except (OSError, ValueError):
        return 1


def scan_spread(
    scan: Scan,
    pids: Sequence[int],
    *,
    workers: int | None = None,
    min_slice: int = MIN_SLICE,
    progress: Tick = None,
) -> list[Row]:
    """``scan(pids, progress)``, its work spread over forked workers where that pays.

    ``workers``: None decides from the idle CPUs; 1 never forks; n forks up to n - 1 whatever
    the load (within :func:`worker_count`'s other limits). ``progress`` is called here only, as
    this slice advances and on each heartbeat of a worker (so a worker stuck in a system call
    is never reported as progress)."""

    count = functools.partial(worker_count, len(pids), max_workers=workers, min_slice=min_slice)
    # One worker even with every CPU idle (a poll's few processes): no need to ask the CPUs.
    if threading.active_count() > 1 or count(cpus=MAX_WORKERS, idle=MAX_WORKERS) <= 1:
        return scan(pids, progress)
    cpus = _cpus()
    workers_now = count(cpus=cpus, idle=_idle(cpus) if workers is None else cpus)
    if workers_now <= 1:
        return scan(pids, progress)
    size = -(-len(pids) // workers_now)
    slices = [pids[at : at + size] for at in range(0, len(pids), size)]
    started = [_fork(scan, part) for part in slices[1:]]
    rows = scan(slices[0], progress)
    for part, child in zip(slices[1:], started, strict=True):
        answer = _collect(child, progress) if child is not None else None
        rows.extend(scan(part, progress) if answer is None else answer)
    return rows


def _heartbeat(write_end: int) -> Callable[[], None]:
    """A worker's tick: one :data:`_ALIVE` byte on its pipe, at most every :data:`HEARTBEAT`."""
    last = time.monotonic()

    def tick() -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= HEARTBEAT:
            last = now
            os.write(write_end, _ALIVE)

    return tick


def _fork(scan: Scan, part: Sequence[int]) -> tuple[int, int] | None:
    """(pid, read end) of a worker scanning ``part``; None when no worker could be forked."""
    try:
        read_end, write_end = os.pipe()
    except OSError:
        return None
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return None
    if pid == 0:  # the worker: scan, write, leave without running the parent's clean-up
        status = 1
        try:
            os.close(read_end)
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(signum, signal.SIG_DFL)
            data = memoryview(_ROWS + marshal.dumps(scan(part, _heartbeat(write_end))))
            while data:
                data = data[os.write(write_end, data) :]
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    return pid, read_end


def _collect(child: tuple[int, int], progress: Tick) -> list[Row] | None:
    """A worker's rows, read to the end of its pipe (``progress`` called for each read), the
    worker reaped; None if it failed."""
    pid, read_end = child
    chunks = []
    try:
        while chunk := os.read(read_end, 1 << 16):
            chunks.append(chunk)
            if progress is not None:
                progress()
    except OSError:
        chunks = []
    finally:
        os.close(read_end)
    status = 1
    with contextlib.suppress(ChildProcessError):
        status = os.waitpid(pid, 0)[1]
    if status != 0:
        return None
    data = b"".join(chunks).lstrip(_ALIVE)
    if not data.startswith(_ROWS):
        return None
    try:
        rows = marshal.loads(data[1:])  # noqa: S302 - from our own fork, via our pipe
    except (EOFError, ValueError, TypeError):
        return None
    return rows if isinstance(rows, list) else None
