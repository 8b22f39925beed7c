"""The benchmark host: cheap filler processes and device-file holders, all ``sleep`` children.

Owns spawning and cleaning up the processes the benchmarks scan. Every process is a ``sleep``
spawned with ``posix_spawn`` from this process, inheriting ``fds`` open file descriptions (a
few shared temp files), so 8,000 of them cost little memory and no Python start-up. Holders
also inherit the device files a CUDA process keeps open (nvidiactl, nvidia-uvm, one GPU node).
It never signals anything it did not spawn.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Sequence
from pathlib import Path

SLEEP = "/bin/sleep"


class ProcessPool:
    """``sleep`` children, each holding ``fds`` inherited descriptors (plus stdio)."""

    def __init__(self, scratch: Path, *, fds: int = 50) -> None:
        self.scratch = Path(scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.fds = fds
        self.fillers: list[int] = []
        self.holders: dict[int, tuple[str, ...]] = {}
        # stdio of the children: a pipe nobody reads or writes (never /dev/null: device-number
        # mode uses /dev/null as a stand-in for a GPU node).
        self._stdin_r, self._stdin_w = os.pipe()
        self._common = self._open_common()

    def _open_common(self) -> list[int]:
        files = [self.scratch / f"shared-{i}" for i in range(8)]
        opened: list[int] = []
        for index in range(max(0, self.fds - 3)):
            fd = os.open(files[index % len(files)], os.O_RDWR | os.O_CREAT, 0o600)
            opened.append(fd)
        return opened

    def _spawn(self, extra: Sequence[int]) -> int:
        actions = [
            (os.POSIX_SPAWN_DUP2, self._stdin_r, 0),
            (os.POSIX_SPAWN_DUP2, self._stdin_w, 1),
            (os.POSIX_SPAWN_DUP2, self._stdin_w, 2),
        ]
        keep = [*self._common, *extra]
        for fd in keep:
            os.set_inheritable(fd, True)
        try:
            return os.posix_spawn(SLEEP, [SLEEP, "infinity"], {}, file_actions=actions)
        finally:
            for fd in keep:
                os.set_inheritable(fd, False)

    def set_fillers(self, count: int) -> None:
        """Grow or shrink the filler set to ``count`` processes."""
        while len(self.fillers) < count:
            self.fillers.append(self._spawn(()))
        surplus = self.fillers[count:]
        del self.fillers[count:]
        self._kill(surplus)

    def set_holders(self, devices: Sequence[Sequence[str]]) -> list[int]:
        """Replace the holders: one process per entry, holding those device paths open."""
        self._kill(list(self.holders))
        self.holders = {}
        for paths in devices:
            extra = [os.open(path, os.O_RDWR) for path in paths]
            try:
                self.holders[self._spawn(extra)] = tuple(paths)
            finally:
                for fd in extra:
                    os.close(fd)
        return list(self.holders)

    def _kill(self, pids: Sequence[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def close(self) -> None:
        self._kill([*self.fillers, *self.holders])
        self.fillers, self.holders = [], {}
        for fd in [*self._common, self._stdin_r, self._stdin_w]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._common = []


def cuda_devices(devices_dir: Path, holders: int, gpus: int) -> list[list[str]]:
    """What each of ``holders`` CUDA-like processes holds: ctl, uvm, its GPU's node."""
    return [
        [
            str(devices_dir / "nvidiactl"),
            str(devices_dir / "nvidia-uvm"),
            str(devices_dir / f"nvidia{index % gpus}"),
        ]
        for index in range(holders)
    ]
