"""A forked child that opens a file on command and closes it on command, for tests that must
know the moment an ``open(2)`` has returned (a served scan's staleness tests).

:func:`opener` starts it; :func:`tell` sends "o" (open), "c" (close) or anything else (exit)
and waits for its answer. Only the test that started it signals or reaps it.
"""

from __future__ import annotations

import os
import select

__all__ = ["opener", "tell"]


def opener(path: str) -> tuple[int, int, int]:
    """A child that opens ``path`` on "o" and closes it on "c", answering each: (pid, to, from)."""
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(to_w)
        os.close(from_r)
        held: int | None = None
        while True:
            command = os.read(to_r, 1)
            if command == b"o":
                held = os.open(path, os.O_RDONLY)
            elif command == b"c" and held is not None:
                os.close(held)
                held = None
            else:
                os._exit(0)
            os.write(from_w, b"k")
    os.close(to_r)
    os.close(from_w)
    return pid, to_w, from_r


def tell(to_w: int, from_r: int, command: bytes) -> None:
    os.write(to_w, command)
    ready, _, _ = select.select([from_r], [], [], 10.0)
    assert ready
    assert os.read(from_r, 1) == b"k"
