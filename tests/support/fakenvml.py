"""Drive the fake ``libnvidia-ml.so.1`` (tests/fakenvml) from tests.

Owns building the fake library on demand, writing its JSON state atomically, and the
environment that makes the real pynvml load it. It knows nothing about gpuwatchd itself. The
state format is documented in ``tests/fakenvml/README.md``.

Typical use::

    fake = FakeNvml(tmp_path)
    fake.write(fake.state([fake.gpu(i, allocated=2 * GiB) for i in range(8)]))
    client = NvmlClient(env=fake.env())
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

MiB = 1024 * 1024
GiB = 1024 * MiB
NOT_AVAILABLE = None  # a process's used_memory that NVML reports as "not available" (2^64-1)

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKENVML_DIR = REPO_ROOT / "tests" / "fakenvml"
LIBRARY_DIR = FAKENVML_DIR / "build"
LIBRARY = LIBRARY_DIR / "libnvidia-ml.so.1"

# NVML return codes a test may force (nvml.h).
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999


def ensure_built() -> Path:
    """Build the fake library with ``make fakenvml`` unless it is there and up to date."""
    source = FAKENVML_DIR / "fakenvml.c"
    helper = LIBRARY_DIR / "dstate"  # built by the same make target (tests/support/dstate.c)
    if (
        not LIBRARY.exists()
        or not helper.exists()
        or LIBRARY.stat().st_mtime < source.stat().st_mtime
    ):
        subprocess.run(
            ["make", "--no-print-directory", "fakenvml"],
            cwd=REPO_ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return LIBRARY


def gpu(
    index: int,
    *,
    total: int = 80 * GiB,
    allocated: int = 2 * MiB,
    reserved: int = 512 * MiB,
    processes: Iterable[Mapping[str, Any]] = (),
    graphics: Iterable[Mapping[str, Any]] = (),
    mps: Iterable[Mapping[str, Any]] = (),
    **over: Any,
) -> dict[str, Any]:
    """One fake GPU: an idle H100 at ``index`` unless told otherwise.

    ``processes`` are compute processes as ``{"pid": ..., "used_memory": ...}`` (``None`` memory
    means NVML reports it as not available); ``over`` sets or replaces any other state key.
    """
    entry: dict[str, Any] = {
        "index": index,
        "uuid": f"GPU-{index:08x}-face-4000-8000-{index:012x}",
        "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": f"00000000:{0x18 + 0x10 * index:02X}:00.0",
        "minor": index,
        "memory": {"total": total, "reserved": reserved, "used": allocated},
        "processes": {"compute": list(processes), "graphics": list(graphics), "mps": list(mps)},
        "mig_mode": 0,
        "persistence_mode": 1,
        "numa_node": None,
    }
    entry.update(over)
    return entry


def mig_device(
    gi: int,
    ci: int = 0,
    *,
    gpu_index: int = 0,
    profile: str = "1g.10gb",
    total: int = 10 * GiB,
    allocated: int = 2 * MiB,
    processes: Iterable[Mapping[str, Any]] = (),
    placement: tuple[int, int] | None = None,
    gi_profile_id: int = 19,
    **over: Any,
) -> dict[str, Any]:
    """One MIG device (compute instance ``ci`` of GPU instance ``gi``) of a fake GPU.

    Its memory is the GPU instance's; give every compute instance of one GPU instance the same
    ``allocated`` (the fake counts a GPU instance's memory once in the parent's aggregate).
    """
    entry: dict[str, Any] = {
        "gi": gi,
        "ci": ci,
        "uuid": f"MIG-{gpu_index:08x}-{gi:04x}-4{ci:03x}-8000-{gi * 16 + ci:012x}",
        "profile": profile,
        "gi_profile_id": gi_profile_id,
        "placement": {
            "start": gi if placement is None else placement[0],
            "size": 1 if placement is None else placement[1],
        },
        "memory": {"total": total, "used": allocated},
        "processes": {"compute": list(processes)},
    }
    entry.update(over)
    return entry


def cap_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The ``nvidia-cap`` minor the driver gives a MIG capability (its mig-minors numbering:
    ``config`` 1, ``monitor`` 2, then per GPU 15 GPU instances of 1 + 8 compute instances)."""
    base = 3 + gpu_minor * 135 + gi * 9
    return base if ci is None else base + 1 + ci


def mig_minors_text(gpu_minors: Iterable[int] = (0,)) -> str:
    """The whole mig-minors file for GPUs with these minors, as the driver writes it."""
    lines = ["config 1", "monitor 2"]
    for minor in gpu_minors:
        for gi in range(15):
            lines.append(f"gpu{minor}/gi{gi}/access {cap_minor(minor, gi)}")
            lines += [
                f"gpu{minor}/gi{gi}/ci{ci}/access {cap_minor(minor, gi, ci)}" for ci in range(8)
            ]
    return "\n".join(lines) + "\n"


def process(pid: int, used_memory: int | None = 500 * MiB) -> dict[str, Any]:
    """One NVML process-list entry."""
    return {"pid": pid, "used_memory": used_memory}


def state(gpus: Iterable[Mapping[str, Any]], **over: Any) -> dict[str, Any]:
    """A whole host: driver version, no forced errors, the given GPUs; ``over`` adds keys."""
    whole: dict[str, Any] = {
        "driver_version": "550.54.15",
        "init_error": None,
        "errors": {},
        "delays": {},
        "gpus": [dict(g) for g in gpus],
    }
    whole.update(over)
    return whole


class FakeNvml:
    """The fake library's state file, device folder and environment for one test."""

    gpu = staticmethod(gpu)
    state = staticmethod(state)
    process = staticmethod(process)
    mig_device = staticmethod(mig_device)

    def __init__(self, tmp_path: Path, devices_dir: Path | None = None) -> None:
        ensure_built()
        self.root = Path(tmp_path)
        self.state_path = self.root / "fakenvml-state.json"
        self.devices_dir = devices_dir if devices_dir is not None else self.root / "dev"
        self.devices_dir.mkdir(parents=True, exist_ok=True)
        self.current: dict[str, Any] = {}

    @property
    def library_dir(self) -> Path:
        return LIBRARY_DIR

    def write(self, new_state: Mapping[str, Any]) -> None:
        """Replace the state atomically (the library re-reads it on every call).

        Also creates the device files the state names (``nvidiactl``, ``nvidia<minor>``) in
        ``devices_dir``, as the driver's device nodes would exist.
        """
        self.current = json.loads(json.dumps(new_state))
        self.make_device_files(new_state)
        fd, temp = tempfile.mkstemp(dir=self.root, prefix=".fakenvml-", suffix=".json")
        with os.fdopen(fd, "w") as handle:
            json.dump(new_state, handle)
        os.replace(temp, self.state_path)

    def update_gpu(self, index: int, **changes: Any) -> None:
        """Change some keys of GPU ``index`` in the current state and write it."""
        new_state = json.loads(json.dumps(self.current))
        new_state["gpus"][index].update(changes)
        self.write(new_state)

    def make_device_files(self, new_state: Mapping[str, Any]) -> None:
        names = ["nvidiactl"]
        for position, entry in enumerate(new_state.get("gpus", ())):
            minor = entry.get("minor", position)
            names.append(f"nvidia{minor}")
            for mig in entry.get("mig_devices") or ():
                if isinstance(mig, Mapping):  # the capability files of its GI and CI
                    names.append(f"nvidia-caps/nvidia-cap{cap_minor(minor, mig['gi'])}")
                    names.append(f"nvidia-caps/nvidia-cap{cap_minor(minor, mig['gi'], mig['ci'])}")
        for name in names:
            (self.devices_dir / name).parent.mkdir(exist_ok=True)
            (self.devices_dir / name).touch(exist_ok=True)

    def env(self) -> dict[str, str]:
        """What a process needs to load the fake instead of a real NVML."""
        return {
            "LD_LIBRARY_PATH": str(LIBRARY_DIR),
            "FAKENVML_STATE": str(self.state_path),
            "FAKENVML_DEVICES_DIR": str(self.devices_dir),
        }


def open_device_files(pid: int, devices_dir: Path) -> set[str]:
    """Names of the files under ``devices_dir`` that process ``pid`` has open (empty if gone)."""
    found: set[str] = set()
    prefix = str(devices_dir.resolve()) + os.sep
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            found.add(target[len(prefix) :])
    return found


@pytest.fixture
def fake_nvml(tmp_path: Path) -> FakeNvml:
    """A fake NVML with its own state file and devices folder under ``tmp_path``."""
    return FakeNvml(tmp_path)
