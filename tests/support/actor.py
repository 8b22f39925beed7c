"""A scripted stand-in for a GPU job's process, for end-to-end tests and the demo.

Run as ``python -m tests.support.actor SCRIPT_JSON``. The script is a JSON object::

    {"name": "trainer", "ready_dir": "/tmp/x/ready", "steps": [...]}

Steps run in order; each is a one-key object:

- ``{"open": [path, ...]}`` — open files and keep the fds (inherited by forks);
- ``{"mmap": path}`` — map a file (MAP_SHARED) and keep the mapping;
- ``{"close": "all"}`` — close every fd opened so far (mappings stay);
- ``{"cgroup": dir}`` — move into the cgroup (v2) at ``dir``;
- ``{"comm": name}`` — rename the process (what ``ps`` and ``/proc/PID/comm`` show);
- ``{"setsid": true}`` — become a session (and process-group) leader;
- ``{"ignore": "SIGTERM"}`` — ignore a signal;
- ``{"fork": SCRIPT}`` — fork a child that runs SCRIPT (a nested script object);
- ``{"fork_zombie": true}`` — fork a child that exits at once and is never reaped;
- ``{"sleep": seconds}``; ``{"exit": code}``.

Before its last step the actor writes its PID to ``<ready_dir>/<name>`` (atomically), so the
test knows its PID even when the script ends in ``exit``. Without an ``exit`` step it sleeps
until killed. This file must stay free of third-party imports: it starts many times per test.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import sys
import time
from typing import Any

_KEEP: list[Any] = []  # fds and mappings stay referenced for the actor's lifetime


def _map_page(fd: int) -> int:
    """mmap one shared page through libc: Python's mmap module keeps a dup of the fd."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    address = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return int(address)


def _announce(script: dict[str, Any]) -> None:
    ready_dir = script["ready_dir"]
    path = os.path.join(ready_dir, script["name"])
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(str(os.getpid()))
    os.replace(tmp, path)


def run(script: dict[str, Any]) -> None:
    steps: list[dict[str, Any]] = list(script.get("steps", []))
    fds: list[int] = []
    announced = False
    for index, step in enumerate(steps):
        if index == len(steps) - 1 and ("exit" in step or "sleep" in step):
            _announce(script)
            announced = True
        if "open" in step:
            fds.extend(os.open(path, os.O_RDWR) for path in step["open"])
        elif "mmap" in step:
            fd = os.open(step["mmap"], os.O_RDWR)
            _KEEP.append(_map_page(fd))
            os.close(fd)
        elif "close" in step:
            for fd in fds:
                os.close(fd)
            fds.clear()
        elif "cgroup" in step:
            with open(os.path.join(step["cgroup"], "cgroup.procs"), "w", encoding="ascii") as f:
                f.write(str(os.getpid()))
        elif "comm" in step:
            with open("/proc/self/comm", "w", encoding="utf-8") as handle:
                handle.write(step["comm"])
        elif "setsid" in step:
            os.setsid()
        elif "ignore" in step:
            signal.signal(getattr(signal, step["ignore"]), signal.SIG_IGN)
        elif "fork" in step:
            if os.fork() == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                run(step["fork"])
                os._exit(0)
        elif "fork_zombie" in step:
            if os.fork() == 0:
                os._exit(0)
        elif "sleep" in step:
            time.sleep(float(step["sleep"]))
        elif "exit" in step:
            sys.stdout.flush()
            os._exit(int(step["exit"]))
        else:
            raise SystemExit(f"actor {script.get('name')}: unknown step {step!r}")
    if not announced:
        _announce(script)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
