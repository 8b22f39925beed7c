"""The NVML worker process: the only module that imports pynvml.

In detail: docs/internals.md, section `gpuwatchd.collect.nvml_worker`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import IO, Any, TypeVar

import pynvml

T = TypeVar("T")
# The reply's notice that a GPU answers only the v1 memory query (the client logs it once).
MEMORY_V1_NOTICE = "memory_v1"

NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230  # R565 and later; NotSupported before
EVENT_TYPE_XID = 0x8  # nvmlEventTypeXidCriticalError
EVENT_TYPE_RECOVERY_ACTION = 0x8000  # nvmlEventTypeGpuRecoveryAction (R565 and later)
# A poll never waits for an event: the event set queues them between polls, so asking with a
# zero timeout takes what is there (NVML_ERROR_TIMEOUT: nothing) without holding the poll up.
EVENT_WAIT_MS = 0
MAX_EVENTS_PER_READ = 256


class GpuLostError(Exception):
    """NVML said NVML_ERROR_GPU_IS_LOST for this GPU."""


def describe_error(error: BaseException) -> str:
    """A short, stable text for an NVML error (pynvml's str() gives the driver's message)."""
    return str(error) or type(error).__name__


def note_error(errors: list[str], name: str, error: Exception) -> None:
    """The one mapping of a failed query: GPU lost ends the GPU's reading (GpuLostError); any
    other error, NVML's or a binding bug that must not take the worker down, is noted."""
    if isinstance(error, pynvml.NVMLError):
        if getattr(error, "value", None) == NVML_ERROR_GPU_IS_LOST:
            raise GpuLostError(name) from error
        errors.append(f"{name}: {describe_error(error)}")
    else:
        errors.append(f"{name}: {type(error).__name__}: {error}")


class GpuReader:
    """Reads one GPU, collecting per-value errors instead of raising them."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.errors: list[str] = []

    def call(self, name: str, fn: Callable[[], T]) -> T | None:
        """Run one NVML query: NotSupported → None, GPU lost → GpuLostError, else None + error."""
        try:
            return fn()
        except pynvml.NVMLError_NotSupported:
            return None
        except Exception as error:
            note_error(self.errors, name, error)
            return None


def count_active_nvlinks(reader: GpuReader, handle: Any) -> int | None:
    """How many NVLink links of this GPU are active; 0 without NVLink; None when unknown.

    Read once per worker with the GPU's identity (links do not come and go between resets).
    The links are probed in order until the driver says there are no more (InvalidArgument)
    or the GPU has none (NotSupported, or the function is absent).
    """
    active = 0
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            state = pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except (
            pynvml.NVMLError_NotSupported,
            pynvml.NVMLError_InvalidArgument,
            pynvml.NVMLError_FunctionNotFound,
        ):
            break
        except pynvml.NVMLError as error:
            note_error(reader.errors, "nvmlDeviceGetNvLinkState", error)
            return None
        if state:
            active += 1
    return active


def probe(name: str, fn: Callable[[], T], errors: list[str]) -> tuple[str, T | None]:
    """One health query: ("ok", value), ("not_supported", None) or ("unknown", None) + error.

    NotSupported and FunctionNotFound (an older driver) are answers; anything else is unknown.
    """
    try:
        return "ok", fn()
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return "not_supported", None
    except Exception as error:
        note_error(errors, name, error)
        return "unknown", None


def handle_address(handle: Any) -> int | None:
    """The address a device handle points at: how an event names its GPU."""
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
    return address if isinstance(address, int) else None


def read_recovery_action(handle: Any, errors: list[str]) -> dict[str, Any]:
    name = "nvmlDeviceGetFieldValues"
    status, values = probe(
        name,
        lambda: pynvml.nvmlDeviceGetFieldValues(handle, [NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]),
        errors,
    )
    if status != "ok" or values is None:
        return {"status": status, "value": None}
    field = values[0]
    code = int(field.nvmlReturn)
    if code == pynvml.NVML_ERROR_NOT_SUPPORTED:
        return {"status": "not_supported", "value": None}
    if code == NVML_ERROR_GPU_IS_LOST:
        raise GpuLostError(name)
    if code != pynvml.NVML_SUCCESS:
        errors.append(f"{name}(recovery action): NVML error {code}")
        return {"status": "unknown", "value": None}
    kind = int(field.valueType)
    value = field.value
    number = {
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: lambda: value.uiVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: lambda: value.ulVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: lambda: value.ullVal,
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: lambda: value.sllVal,
        pynvml.NVML_VALUE_TYPE_SIGNED_INT: lambda: value.siVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: lambda: value.usVal,
    }.get(kind)
    if number is None:
        errors.append(f"{name}(recovery action): unexpected value type {kind}")
        return {"status": "unknown", "value": None}
    return {"status": "ok", "value": int(number())}


def read_fabric(handle: Any, errors: list[str], version: int) -> tuple[dict[str, Any], int]:
    """The NVLink fabric of one GPU through ``nvmlDeviceGetGpuFabricInfoV``: the struct of
    ``version`` (3 carries the health summary), falling back to 2 when the driver answers
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH. Returns the entry and the version to use next time.

    NotSupported (no NVSwitch fabric) and FunctionNotFound (a driver before the call existed)
    are "not_supported"; any other error is "unknown". pynvml passes the argument through, so
    the struct goes by reference, its version field set by the struct's constructor.
    """
    name = "nvmlDeviceGetGpuFabricInfoV"
    structs = {3: "c_nvmlGpuFabricInfo_v3_t", 2: "c_nvmlGpuFabricInfo_v2_t"}
    while True:
        struct = getattr(pynvml, structs[version], None)
        if struct is None:
            if version == 2:
                return {"status": "not_supported"}, version
            version = 2
            continue
        info = struct()
        try:
            pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            return {"status": "not_supported"}, version
        except Exception as error:
            mismatch = getattr(error, "value", None) == NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            if isinstance(error, pynvml.NVMLError) and mismatch and version == 3:
                version = 2
                continue
            note_error(errors, name, error)
            return {"status": "unknown"}, version
        return {
            "status": "ok",
            "version": version,
            "state": int(info.state),
            "probe_status": int(info.status),
            "health_mask": int(info.healthMask),
            "health_summary": int(info.healthSummary) if version >= 3 else None,
        }, version


def read_remapped_rows(handle: Any, errors: list[str]) -> dict[str, Any]:
    status, rows = probe(
        "nvmlDeviceGetRemappedRows", lambda: pynvml.nvmlDeviceGetRemappedRows(handle), errors
    )
    if status != "ok" or rows is None:
        return {"status": status}
    correctable, uncorrectable, pending, failure = (int(v) for v in rows)
    return {
        "status": "ok",
        "correctable": correctable,
        "uncorrectable": uncorrectable,
        "pending": bool(pending),
        "failure": bool(failure),
    }


def read_retired_pages(handle: Any, errors: list[str]) -> dict[str, Any]:
    status, pending = probe(
        "nvmlDeviceGetRetiredPagesPendingStatus",
        lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle),
        errors,
    )
    if status != "ok" or pending is None:
        return {"status": status}
    counts: dict[str, int | None] = {}
    for key, cause in (
        ("single_bit", pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
        ("double_bit", pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
    ):

        def pages_of(cause: int = cause) -> Any:
            return pynvml.nvmlDeviceGetRetiredPages_v2(handle, cause)

        got, pages = probe("nvmlDeviceGetRetiredPages_v2", pages_of, errors)
        counts[key] = len(pages) if got == "ok" and pages is not None else None
    return {"status": "ok", "pending": bool(pending), **counts}


class Worker:
    """NVML session state that lives as long as the worker process."""

    def __init__(self) -> None:
        self.initialised = False
        self.handles: dict[int, Any] = {}
        self.identity: dict[int, dict[str, Any]] = {}
        self.memory_v1: set[int] = set()
        self.event_set: Any = None
        self.events_status: dict[int, str] = {}  # GPU index → "ok", "not_supported", "unknown"
        self.fabric_version: dict[int, int] = {}  # GPU index → fabric struct version that works

    # --- requests -------------------------------------------------------------------------

    def init(self) -> str | None:
        """Initialise NVML once; returns why it is unavailable, or None."""
        if self.initialised:
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            return "libnvidia-ml.so.1 not found (is the NVIDIA driver installed?)"
        except pynvml.NVMLError as error:
            return f"nvmlInit: {describe_error(error)}"
        except OSError as error:
            return f"cannot load libnvidia-ml.so.1: {error}"
        self.initialised = True
        return None

    def shutdown(self) -> None:
        if self.initialised:
            self.initialised = False
            if self.event_set is not None:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlEventSetFree(self.event_set)
                self.event_set = None
                self.events_status.clear()
            self.handles.clear()
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()

    def read(self) -> dict[str, Any]:
        reason = self.init()
        if reason is not None:
            return {"available": False, "error": reason, "fatal": True}
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as error:
            return {"available": False, "error": f"nvmlDeviceGetCount: {describe_error(error)}"}
        driver: str | None
        try:
            driver = str(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            driver = None
        notices: list[dict[str, Any]] = []
        gpus = [self.read_gpu(index, notices) for index in range(count)]
        self.read_events(gpus)
        return {"available": True, "driver_version": driver, "gpus": gpus, "notices": notices}

    # --- one GPU --------------------------------------------------------------------------

    def read_gpu(self, index: int, notices: list[dict[str, Any]]) -> dict[str, Any]:
        reader = GpuReader(index)
        entry: dict[str, Any] = {
            "index": index,
            "uuid": None,
            "name": None,
            "pci_bus_id": None,
            "minor": None,
            "memory": None,
            "processes": None,
            "mig_mode": None,
            "persistence_mode": None,
            "numa_node": None,
            "architecture": None,
            "nvlink_active": None,
            "lost": False,
            "error": None,
        }
        entry.update(self.identity.get(index, {}))
        try:
            handle = self.handles.get(index)
            if handle is None:
                handle = reader.call(
                    "nvmlDeviceGetHandleByIndex", lambda: pynvml.nvmlDeviceGetHandleByIndex(index)
                )
                if handle is None:
                    entry["error"] = "; ".join(reader.errors) or "no handle"
                    return entry
                self.handles[index] = handle
            if index not in self.identity:
                identity = self.read_identity(reader, handle)
                entry.update(identity)
                if identity["uuid"] is not None:
                    self.identity[index] = identity
            entry["memory"] = self.read_memory(reader, handle, entry, notices)
            entry["processes"] = self.read_processes(reader, handle)
            errors_before = len(reader.errors)
            mig = reader.call("nvmlDeviceGetMigMode", lambda: pynvml.nvmlDeviceGetMigMode(handle))
            if mig is not None:
                entry["mig_mode"] = int(mig[0])
            elif len(reader.errors) == errors_before:
                # NotSupported: a GPU without MIG cannot have it enabled (known, not unknown).
                entry["mig_mode"] = 0
            if entry["mig_mode"] == 1:
                entry["mig_devices"] = read_mig_devices(reader, handle)
            persistence = reader.call(
                "nvmlDeviceGetPersistenceMode", lambda: pynvml.nvmlDeviceGetPersistenceMode(handle)
            )
            entry["persistence_mode"] = None if persistence is None else int(persistence)
            entry["numa_node"] = reader.call(
                "nvmlDeviceGetNumaNodeId", lambda: pynvml.nvmlDeviceGetNumaNodeId(handle)
            )
            entry["health"] = self.read_health(index, handle, reader.errors)
        except GpuLostError as lost:
            entry["lost"] = True
            reader.errors.append(f"{lost}: GPU is lost")
        if reader.errors:
            entry["error"] = "; ".join(reader.errors)
        return entry

    # --- health ---------------------------------------------------------------------------

    def read_health(self, index: int, handle: Any, errors: list[str]) -> dict[str, Any]:
        """The health fields of one GPU; events are added by :meth:`read_events`."""
        self.register_events(index, handle, errors)
        fabric, self.fabric_version[index] = read_fabric(
            handle, errors, self.fabric_version.get(index, 3)
        )
        return {
            "events": self.events_status.get(index, "unknown"),
            "xids": [],
            "recovery_action": read_recovery_action(handle, errors),
            "remapped_rows": read_remapped_rows(handle, errors),
            "retired_pages": read_retired_pages(handle, errors),
            "fabric": fabric,
        }

    def register_events(self, index: int, handle: Any, errors: list[str]) -> None:
        """Register the GPU for Xid and recovery-action events, once per worker."""
        if self.events_status.get(index) in ("ok", "not_supported"):
            return
        if self.event_set is None:
            status, created = probe("nvmlEventSetCreate", pynvml.nvmlEventSetCreate, errors)
            if status != "ok":
                self.events_status[index] = status
                return
            self.event_set = created
        status, supported = probe(
            "nvmlDeviceGetSupportedEventTypes",
            lambda: pynvml.nvmlDeviceGetSupportedEventTypes(handle),
            errors,
        )
        wanted = int(supported or 0) & (EVENT_TYPE_XID | EVENT_TYPE_RECOVERY_ACTION)
        if status != "ok" or not wanted:
            self.events_status[index] = "not_supported" if status == "ok" else status
            return
        status, _ = probe(
            "nvmlDeviceRegisterEvents",
            lambda: pynvml.nvmlDeviceRegisterEvents(handle, wanted, self.event_set),
            errors,
        )
        self.events_status[index] = status

    def read_events(self, gpus: list[dict[str, Any]]) -> None:
        """Take the queued Xid / recovery-action events into the GPUs' ``health`` entries.

        Never waits (``EVENT_WAIT_MS``); at most ``MAX_EVENTS_PER_READ`` are taken. A
        recovery-action event only says to read the field again, which this poll already did,
        so only Xids are passed on.
        """
        if self.event_set is None:
            return
        by_address = {handle_address(h): i for i, h in self.handles.items()}
        entries = {gpu["index"]: gpu for gpu in gpus}
        for _ in range(MAX_EVENTS_PER_READ):
            try:
                data = pynvml.nvmlEventSetWait_v2(self.event_set, EVENT_WAIT_MS)
            except pynvml.NVMLError:
                return  # Timeout: nothing (more) queued; any other error: try next poll
            if int(data.eventType) != EVENT_TYPE_XID:
                continue
            index = by_address.get(handle_address(data.device))
            health = entries.get(index, {}).get("health") if index is not None else None
            if isinstance(health, dict):
                health["xids"].append({"xid": int(data.eventData), "wall": time.time()})

    @staticmethod
    def read_identity(reader: GpuReader, handle: Any) -> dict[str, Any]:
        uuid = reader.call("nvmlDeviceGetUUID", lambda: pynvml.nvmlDeviceGetUUID(handle))
        name = reader.call("nvmlDeviceGetName", lambda: pynvml.nvmlDeviceGetName(handle))
        minor = reader.call(
            "nvmlDeviceGetMinorNumber", lambda: pynvml.nvmlDeviceGetMinorNumber(handle)
        )
        pci = reader.call("nvmlDeviceGetPciInfo_v3", lambda: pynvml.nvmlDeviceGetPciInfo_v3(handle))
        bus_id = None if pci is None else pci.busId
        if isinstance(bus_id, bytes):
            bus_id = bus_id.decode(errors="replace")
        architecture = reader.call(
            "nvmlDeviceGetArchitecture", lambda: pynvml.nvmlDeviceGetArchitecture(handle)
        )
        return {
            "uuid": uuid,
            "name": name,
            "minor": minor,
            "pci_bus_id": bus_id,
            "architecture": architecture,
            "nvlink_active": count_active_nvlinks(reader, handle),
        }

    def read_memory(
        self,
        reader: GpuReader,
        handle: Any,
        entry: dict[str, Any],
        notices: list[dict[str, Any]],
    ) -> dict[str, Any] | None:
        if self.index_uses_v2(entry["index"]):
            try:
                v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound) as error:
                self.memory_v1.add(entry["index"])
                notices.append(
                    {
                        "notice": MEMORY_V1_NOTICE,
                        "index": entry["index"],
                        "uuid": entry["uuid"],
                        "reason": f"nvmlDeviceGetMemoryInfo_v2: {describe_error(error)}",
                    }
                )
            except pynvml.NVMLError as error:
                note_error(reader.errors, "nvmlDeviceGetMemoryInfo_v2", error)
                return None
            else:
                return _memory_v2(v2)
        v1 = reader.call("nvmlDeviceGetMemoryInfo", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
        return None if v1 is None else _memory_v1(v1)

    def index_uses_v2(self, index: int) -> bool:
        return index not in self.memory_v1

    @staticmethod
    def read_processes(reader: GpuReader, handle: Any) -> list[dict[str, Any]] | None:
        kinds = (
            ("compute", "nvmlDeviceGetComputeRunningProcesses"),
            ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
            ("mps", "nvmlDeviceGetMPSComputeRunningProcesses"),
        )
        found: list[dict[str, Any]] = []
        for kind, base in kinds:
            listed = list_processes(reader, handle, base)
            if listed is None:
                if kind == "compute":
                    return None
                continue
            for process in listed:
                used = process.usedGpuMemory
                found.append(
                    {
                        "pid": int(process.pid),
                        "used_memory": None if used is None else int(used),
                        "kind": kind,
                    }
                )
        return found


def list_processes(reader: GpuReader, handle: Any, base: str) -> list[Any] | None:
    """One process list through ``_v3``, then ``_v2`` where ``_v3`` is absent; None if unknown."""
    for suffix in ("_v3", "_v2"):
        name = base + suffix
        fn = getattr(pynvml, name, None)
        if fn is None:
            continue
        try:
            return list(fn(handle))
        except pynvml.NVMLError_FunctionNotFound:
            continue
        except pynvml.NVMLError_NotSupported:
            return None
        except pynvml.NVMLError as error:
            note_error(reader.errors, name, error)
            return None
    reader.errors.append(f"{base}: no _v3 or _v2 symbol in this driver")
    return None


def read_mig_devices(reader: GpuReader, handle: Any) -> list[dict[str, Any]] | None:
    """The MIG devices of a GPU with MIG on, by index; None when the list cannot be read.

    Each: ``index``, ``uuid`` (``MIG-...``), ``name`` (the driver's "<GPU> MIG <profile>"),
    ``gi`` and ``ci`` (GPU and compute instance ids), ``gi_profile_id`` and ``placement``
    (``[start, size]``, from the GPU instance's info: what re-creating it needs), ``memory``
    (the GPU instance's, which its compute instances share: ``nvmlDeviceGetMemoryInfo`` on a MIG
    handle, v2, else v1 with allocated unknown), ``processes`` (the MIG device's own lists, as
    for a GPU) and ``error``. NVML's per-instance figures come only from MIG handles: on the
    parent they are aggregates.
    A missing index (NotFound) is a hole, not an error; GPU lost ends the GPU's reading.
    """
    count = reader.call(
        "nvmlDeviceGetMaxMigDeviceCount", lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    )
    if count is None:
        return None
    found: list[dict[str, Any]] = []
    for index in range(min(int(count), 16)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError_NotFound:
            continue
        except pynvml.NVMLError as error:
            note_error(reader.errors, "nvmlDeviceGetMigDeviceHandleByIndex", error)
            return None
        found.append(read_mig_device(reader, handle, mig, index))
    return found


def read_mig_device(reader: GpuReader, parent: Any, mig: Any, index: int) -> dict[str, Any]:
    own = GpuReader(reader.index)
    name = own.call("nvmlDeviceGetName", lambda: pynvml.nvmlDeviceGetName(mig))
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    uuid = own.call("nvmlDeviceGetUUID", lambda: pynvml.nvmlDeviceGetUUID(mig))
    if isinstance(uuid, bytes):
        uuid = uuid.decode(errors="replace")
    gi = own.call("nvmlDeviceGetGpuInstanceId", lambda: pynvml.nvmlDeviceGetGpuInstanceId(mig))
    ci = own.call(
        "nvmlDeviceGetComputeInstanceId", lambda: pynvml.nvmlDeviceGetComputeInstanceId(mig)
    )
    profile_id, placement = _instance_placement(own, parent, gi)
    memory = _mig_memory(own, mig)
    processes = Worker.read_processes(own, mig)
    return {
        "index": index,
        "uuid": uuid,
        "name": name,
        "gi": None if gi is None else int(gi),
        "ci": None if ci is None else int(ci),
        "gi_profile_id": profile_id,
        "placement": placement,
        "memory": memory,
        "processes": processes,
        "error": "; ".join(own.errors) or None,
    }


def _instance_placement(
    own: GpuReader, parent: Any, gi: Any
) -> tuple[int | None, list[int] | None]:
    """A MIG device's GPU instance profile id and placement ([start, size]) as its parent GPU
    reports them; None each when the instance id or its info cannot be read."""
    profile_id = placement = None
    if gi is not None:
        instance = own.call(
            "nvmlDeviceGetGpuInstanceById",
            lambda: pynvml.nvmlDeviceGetGpuInstanceById(parent, gi),
        )
        info = (
            None
            if instance is None
            else own.call("nvmlGpuInstanceGetInfo", lambda: pynvml.nvmlGpuInstanceGetInfo(instance))
        )
        if info is not None:
            profile_id = int(info.profileId)
            placement = [int(info.placement.start), int(info.placement.size)]
    return profile_id, placement


def _mig_memory(own: GpuReader, mig: Any) -> dict[str, Any] | None:
    """A MIG device's memory, as a GPU's is read: v2 (allocated = total - free - reserved),
    else v1 (allocated unknown); None when neither can be read. GpuLostError when the GPU is
    lost."""
    memory = None
    v2: Any = None
    try:
        v2 = pynvml.nvmlDeviceGetMemoryInfo(mig, version=pynvml.nvmlMemory_v2)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        # v1, whose "used" includes the reservation: allocated unknown, as for a GPU (no
        # ghost detection in the instance until an idle baseline is learned).
        v1 = own.call("nvmlDeviceGetMemoryInfo", lambda: pynvml.nvmlDeviceGetMemoryInfo(mig))
        if v1 is not None:
            memory = _memory_v1(v1)
    except pynvml.NVMLError as error:
        note_error(own.errors, "nvmlDeviceGetMemoryInfo_v2", error)
    if v2 is not None:
        memory = _memory_v2(v2)
    return memory


def _memory_v2(v2: Any) -> dict[str, Any]:
    """nvmlMemory_v2 as the reply says it: allocated = total - free - reserved (None when the
    driver's figures do not add up)."""
    total, free, reserved = int(v2.total), int(v2.free), int(v2.reserved)
    allocated = total - free - reserved
    return {
        "api": "v2",
        "total": total,
        "free": free,
        "reserved": reserved,
        "allocated": allocated if allocated >= 0 else None,
        "used_v1": None,
    }


def _memory_v1(v1: Any) -> dict[str, Any]:
    """nvmlMemory_t, whose "used" includes the reservation: allocated unknown."""
    return {
        "api": "v1",
        "total": int(v1.total),
        "free": int(v1.free),
        "reserved": None,
        "allocated": None,
        "used_v1": int(v1.used),
    }


def serve(requests: IO[str], replies: IO[str]) -> int:
    """Answer requests until ``shutdown`` or end of input; returns the exit status."""
    worker = Worker()
    try:
        for line in requests:
            try:
                request = json.loads(line)
                op = request.get("op") if isinstance(request, dict) else None
            except ValueError:
                op = None
            if op == "read":
                try:
                    reply = worker.read()
                except Exception as error:  # never die mid-poll: report and carry on
                    reply = {"available": False, "error": f"worker error: {error!r}"}
            elif op == "shutdown":
                worker.shutdown()
                replies.write(json.dumps({"shutdown": True}) + "\n")
                replies.flush()
                return 0
            else:
                reply = {"error": f"unknown request: {line.strip()[:100]!r}"}
            replies.write(json.dumps(reply) + "\n")
            replies.flush()
            if reply.get("fatal"):
                return 0
    finally:
        worker.shutdown()
    return 0


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Keep the protocol channel private: whatever the library prints goes to stderr.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return serve(sys.stdin, replies)


if __name__ == "__main__":
    status = main()
    # NVML is shut down and every reply flushed: leave without the interpreter's teardown
    # (tens of milliseconds of module clean-up the caller would wait for when reaping us).
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    os._exit(status)
