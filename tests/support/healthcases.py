"""Hand-built health readings and snapshots shared by the GPU health tests."""

from __future__ import annotations

from dataclasses import replace

from gpuwatchd.core.model import (
    GpuHealth,
    GpuInfo,
    HolderScan,
    NvmlProcess,
    NvmlReading,
    ProcessInfo,
    Snapshot,
    Support,
)

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"


def health(**over: object) -> GpuHealth:
    base = GpuHealth(
        events=Support.OK,
        recovery_action=0,
        recovery_support=Support.OK,
        remap_pending=False,
        remap_failure=False,
        remap_correctable=0,
        remap_uncorrectable=0,
        remap_support=Support.OK,
        pages_support=Support.NOT_SUPPORTED,
    )
    return replace(base, **over)  # type: ignore[arg-type]


def gpu(index: int, uuid: str, h: GpuHealth | None, pids: tuple[int, ...] = ()) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=uuid,
        pci_bus_id=f"00000000:{index + 0x10:02X}:00.0",
        minor=index,
        processes=tuple(NvmlProcess(pid, 500 << 20, "compute") for pid in pids),
        mig_enabled=False,
        persistence_mode=True,
        nvlink_active=0,
        health=h,
    )


def snap(*gpus: GpuInfo, t: float = 1000.0, procs: tuple[ProcessInfo, ...] = ()) -> Snapshot:
    return Snapshot(
        monotonic=t,
        wall_time=1_700_000_000.0 + t,
        boot_id="boot-1",
        nvml=NvmlReading(available=True, gpus=gpus),
        processes={p.pid: p for p in procs},
        holders=HolderScan(mode="full"),
    )
