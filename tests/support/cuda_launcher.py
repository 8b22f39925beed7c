"""A CUDA job for the real-GPU tests: it allocates device memory, forks a worker that inherits
the device files, says so, and waits to be killed.

Run by path (``python tests/support/cuda_launcher.py --tag TAG``); it imports nothing but the
standard library (and PyTorch with ``--api torch``). With ``--api driver`` (the default) it
talks to the CUDA driver API through ctypes on ``libcuda.so.1`` — ``cuInit``, ``cuDeviceGet``,
``cuDevicePrimaryCtxRetain``, ``cuCtxSetCurrent``, ``cuMemAlloc_v2``, ``cuMemsetD8_v2`` (so
the memory is really backed), ``cuCtxSynchronize`` — so no framework is needed.

Once the memory is allocated it forks a worker: the child inherits the open ``/dev/nvidia*``
files and their mappings, as a DataLoader worker does, and never touches CUDA after the fork
(it only sleeps). The launcher then prints one JSON line on stdout::

    {"launcher": PID, "worker": PID, "api": "driver", "device": 0,
     "pci_bus_id": "0000:17:00.0", "uuid": "GPU-...", "mib": 1024}

and sleeps until it is killed. Both processes end by themselves after ``--lifetime`` seconds,
so nothing a failed test leaves behind runs for ever. The worker's stdout and stderr are
``/dev/null``: a reader of the launcher's pipe sees EOF when the launcher dies.

Exit codes: 0 after the lifetime; 2 bad arguments; 3 no CUDA here (``libcuda.so.1`` or
PyTorch missing, no device), with the reason on stderr; 4 a CUDA call failed (named).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

MiB = 1024 * 1024
EXIT_NO_CUDA = 3
EXIT_CUDA_ERROR = 4
MAX_MIB = 64 * 1024
MAX_LIFETIME = 3600.0
CUDA_ERROR_NO_DEVICE = 100
TAG = re.compile(r"[A-Za-z0-9_-]{1,64}")


class NoCuda(Exception):
    """CUDA is not usable here at all (exit 3)."""


class CudaError(Exception):
    """A CUDA call failed (exit 4)."""


def _tag(text: str) -> str:
    if TAG.fullmatch(text) is None:
        raise argparse.ArgumentTypeError("1 to 64 of A-Z a-z 0-9 _ -")
    return text


def _bounded(kind: type[int] | type[float], low: float, high: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low:g}..{high:g}")
        return value

    return parse


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", type=_tag, required=True, help="a word naming this test run")
    parser.add_argument("--mib", type=_bounded(int, 1, MAX_MIB), default=1024)
    parser.add_argument("--device", type=_bounded(int, 0, 63), default=0, help="CUDA ordinal")
    parser.add_argument("--api", choices=("driver", "torch"), default="driver")
    parser.add_argument("--lifetime", type=_bounded(float, 1, MAX_LIFETIME), default=600.0)
    return parser.parse_args(argv)


def _bus_id(domain: int, bus: int, device: int) -> str:
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def _uuid(raw: bytes) -> str:
    text = raw.hex()
    return f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:32]}"


def allocate_driver(device: int, mib: int) -> tuple[str, str | None, object]:
    """Allocate ``mib`` MiB on CUDA device ``device``; (PCI bus id, UUID, what keeps it)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise NoCuda(f"no NVIDIA GPU/driver: libcuda.so.1 not found ({err})") from None

    def call(name: str, *args: object) -> None:
        result = getattr(cuda, name)(*args)
        if result == 0:
            return
        label = ctypes.c_char_p()
        cuda.cuGetErrorName(result, ctypes.byref(label))
        what = f"{name}: {(label.value or b'?').decode(errors='replace')} ({result})"
        if name == "cuInit" and result == CUDA_ERROR_NO_DEVICE:
            raise NoCuda(f"no NVIDIA GPU/driver: {what}")
        raise CudaError(what)

    handle = ctypes.c_int()
    context = ctypes.c_void_p()
    pointer = ctypes.c_uint64()
    bus = ctypes.create_string_buffer(32)
    uuid = ctypes.create_string_buffer(16)
    call("cuInit", 0)
    call("cuDeviceGet", ctypes.byref(handle), device)
    call("cuDevicePrimaryCtxRetain", ctypes.byref(context), handle)
    call("cuCtxSetCurrent", context)
    call("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(mib * MiB))
    call("cuMemsetD8_v2", pointer, ctypes.c_ubyte(0x5A), ctypes.c_size_t(mib * MiB))
    call("cuCtxSynchronize")
    call("cuDeviceGetPCIBusId", bus, len(bus), handle)
    call("cuDeviceGetUuid", uuid, handle)
    return bus.value.decode("ascii").lower(), _uuid(uuid.raw), (cuda, context, pointer)


def allocate_torch(device: int, mib: int) -> tuple[str, str | None, object]:
    """The same with PyTorch (``--api torch``)."""
    try:
        torch = importlib.import_module("torch")
    except ImportError as err:
        raise NoCuda(f"PyTorch is not importable here ({err})") from None
    if not torch.cuda.is_available():
        raise NoCuda("no NVIDIA GPU/driver: torch.cuda.is_available() is false")
    block = torch.empty(mib * MiB, dtype=torch.uint8, device=f"cuda:{device}")
    block.fill_(0x5A)
    torch.cuda.synchronize(device)
    props = torch.cuda.get_device_properties(device)
    bus = _bus_id(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    return bus, None, block


def fork_worker(lifetime: float) -> int:
    """Fork the worker: it keeps the inherited device files and never calls CUDA. Returns once
    the worker has let go of the launcher's standard streams (it closes its end of a pipe
    after moving them to /dev/null), so a reader of the report never waits on the worker."""
    ready_r, ready_w = os.pipe()
    worker = os.fork()
    if worker == 0:
        try:
            os.close(ready_r)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(ready_w)
            time.sleep(lifetime)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.read(ready_r, 1)  # end of file: the worker's streams are /dev/null now
    os.close(ready_r)
    return worker


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    allocate = allocate_driver if args.api == "driver" else allocate_torch
    try:
        bus, uuid, keep = allocate(args.device, args.mib)
    except NoCuda as err:
        print(f"cuda_launcher: {err}", file=sys.stderr)
        return EXIT_NO_CUDA
    except CudaError as err:
        print(f"cuda_launcher: CUDA call failed: {err}", file=sys.stderr)
        return EXIT_CUDA_ERROR
    sys.stdout.flush()
    worker = fork_worker(args.lifetime)
    report = {
        "launcher": os.getpid(),
        "worker": worker,
        "api": args.api,
        "device": args.device,
        "pci_bus_id": bus,
        "uuid": uuid,
        "mib": args.mib,
    }
    print(json.dumps(report), flush=True)
    time.sleep(args.lifetime)
    del keep
    return 0


if __name__ == "__main__":
    sys.exit(main())
