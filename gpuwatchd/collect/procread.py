"""The bottom of the ``/proc`` readers (``procfs`` and ``holders`` build on it): the whole-file
read (the ``stat`` line's parser is :mod:`gpuwatchd.core.procstat`).
"""

from __future__ import annotations

import errno
import os

GONE_ERRNOS = frozenset({errno.ENOENT, errno.ESRCH})
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC


def read_proc_file(path: str) -> bytes:
    """The whole file, read in chunks (``/proc`` files report size 0, so no single read)."""
    fd = os.open(path, _READ_FLAGS)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)
