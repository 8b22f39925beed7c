"""Real child processes for tests of ``/proc`` reading: started, awaited, and always killed.

Owns the ``spawn`` fixture: start a Python child running some code, wait until it prints
"ready" (its files are open by then), and kill and reap it when the test ends. Tests only
ever inspect and signal these children of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from gpuwatchd.collect.holders import ProcessTable

Spawn = Callable[[str], "subprocess.Popen[str]"]

HOLD_FD = """
import ctypes, mmap, os, time
{body}
print("ready", flush=True)
time.sleep(60)
"""


def hold(paths: list[str]) -> str:
    """Code for a child that keeps ``paths`` open (read-only fds) until killed."""
    opens = ", ".join(f"os.open({p!r}, os.O_RDONLY)" for p in paths)
    return HOLD_FD.format(body=f"held = [{opens}]")


# Python's mmap.mmap keeps a dup of the fd, so map through libc to leave a mapping alone.
MAP_ONLY = """
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
fd = os.open({path!r}, os.O_RDWR)
addr = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
os.close(fd)
"""


def map_only(path: str) -> str:
    """Code for a child that maps ``path`` and closes its fd: held by the mapping alone."""
    return HOLD_FD.format(body=MAP_ONLY.format(path=path))


SYS_EXIT = {"x86_64": 60, "aarch64": 93}.get(os.uname().machine)  # exit(2): one thread only


def zombie_leader(path: str) -> str:
    """Code for a child that opens ``path`` and whose main thread alone then exits (SYS_exit,
    not exit_group): the leader turns Z while another thread keeps the shared fd table, and so
    the file, alive. Needs ``SYS_EXIT``."""
    body = (
        f"fd = os.open({path!r}, os.O_RDONLY)\n"
        "import threading; threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "print('ready', flush=True)\n"
        f"ctypes.CDLL(None).syscall({SYS_EXIT}, 0)"
    )
    return HOLD_FD.format(body=body).replace('print("ready", flush=True)\n', "", 1)


def wait_for_state(procfs: ProcessTable, pid: int, state: str) -> None:
    """Wait up to 10 s until ``pid``'s stat says ``state``; fail the test if it never does."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        fields = procfs.read_stat(pid)
        if fields is not None and fields.state == state:
            return
        time.sleep(0.01)
    pytest.fail(f"pid {pid} never reached state {state}")


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start a Python child running ``code``; wait for it to print "ready"; kill it after."""
    children: list[subprocess.Popen[str]] = []

    def start(code: str) -> subprocess.Popen[str]:
        child = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        children.append(child)
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "ready", line
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)


PRIVATE_TABLES = """
import ctypes, os, threading, time
libc = ctypes.CDLL(None, use_errno=True)
threading.stack_size(256 * 1024)
done = threading.Semaphore(0)
forever = threading.Event()

def own_table(path, workers):
    if libc.unshare(0x400) != 0:  # CLONE_FILES: a table of this thread's own
        raise OSError(ctypes.get_errno(), "unshare(CLONE_FILES)")
    held = os.open(path, os.O_RDONLY) if path else None
    for _ in range(workers):  # threads started here share this thread's table
        threading.Thread(target=forever.wait, daemon=True).start()
    done.release()
    forever.wait()

spare = [os.open("/dev/null", os.O_RDONLY) for _ in range({fds})]  # copied into each table
for number in range({threads}):
    path = {path!r} if number == {threads} - 1 else None
    sharing = {sharing} if number == 0 else 0
    threading.Thread(target=own_table, args=(path, sharing), daemon=True).start()
for _ in range({threads}):
    done.acquire()
print("ready", flush=True)
time.sleep(600)
"""


def private_tables(threads: int, path: str | None = None, sharing: int = 0, fds: int = 0) -> str:
    """Code for a child with ``threads`` threads that each called ``unshare(CLONE_FILES)``
    (a file descriptor table of their own); the last holds ``path`` open in its table, the
    first starts ``sharing`` more threads that share its table; ``fds`` more descriptors
    are open in the leader's table first (so in every copy)."""
    return PRIVATE_TABLES.format(threads=threads, path=path, sharing=sharing, fds=fds)
