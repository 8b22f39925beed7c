"""``kcmp(2)``: whether two processes share a kernel object, asked through libc's ``syscall``.

In detail: docs/internals.md, section `gpuwatchd.collect.kcmp`.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

KCMP_FILE = 0  # <linux/kcmp.h>: one open file description each
KCMP_FILES = 2  # the whole file descriptor table
# kcmp's syscall number; the generic table (aarch64, riscv64, loongarch64) shares 272.
_SYS_KCMP = {"x86_64": 312, "aarch64": 272, "riscv64": 272, "loongarch64": 272, "ppc64le": 354}


class Kcmp:
    """``kcmp`` through libc's ``syscall``; each question is None when it cannot be answered.
    ``unavailable``: why it cannot be used at all (no syscall number, ENOSYS, or EPERM/EACCES
    for :meth:`same_file`, which compares other users' processes: one refusal stands for all)."""

    def __init__(self, number: int | None = None) -> None:
        machine = os.uname().machine  # not platform.machine(): `platform` costs ~2 ms to import
        self.number = _SYS_KCMP.get(machine) if number is None else number
        self._syscall: Callable[..., int] | None = None
        self.unavailable: str | None = None
        if self.number is None:
            self.unavailable = f"no kcmp syscall number known for {machine}"
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)  # its own function objects: typed here only
            syscall = libc.syscall
            syscall.argtypes = [ctypes.c_long] * 6  # plain ints in: no c_long made per call
            syscall.restype = ctypes.c_long
            self._syscall = syscall
        except (OSError, AttributeError) as err:
            self.unavailable = f"libc syscall() not found: {err}"

    def _ask(self, pid1: int, pid2: int, kind: int, a: int, b: int) -> int | None:
        """kcmp's answer: 0 (the same object), 1 (pid1's sorts first), 2 (pid2's sorts first),
        3 (different, no order); None on an error (its errno in ``ctypes.get_errno()``)."""
        if self._syscall is None or self.unavailable is not None:
            return None
        result = self._syscall(self.number or 0, pid1, pid2, kind, a, b)
        if result in (0, 1, 2, 3):
            return int(result)
        if ctypes.get_errno() == errno.ENOSYS:
            self.unavailable = os.strerror(errno.ENOSYS)  # the same for every later question
        return None

    def same_file(self, pid1: int, fd1: int, pid2: int, fd2: int) -> bool | None:
        """Whether fd1 of pid1 and fd2 of pid2 are one open file description; None = unknown."""
        answer = self._ask(pid1, pid2, KCMP_FILE, fd1, fd2)
        if answer is None and ctypes.get_errno() in (errno.EPERM, errno.EACCES):
            self.unavailable = os.strerror(ctypes.get_errno())  # stop asking
        return None if answer is None else answer == 0  # None also for EBADF, ESRCH

    def order_files(self, tid1: int, tid2: int) -> int | None:
        """-1, 0 or 1 as tid1's file descriptor table sorts before, is, or sorts after tid2's
        (the kernel's order, stable while both exist); None = unknown (no kcmp, no ptrace
        access to one of them, or one of them is gone)."""
        answer = self._ask(tid1, tid2, KCMP_FILES, 0, 0)
        return None if answer is None or answer == 3 else (0, -1, 1)[answer]
