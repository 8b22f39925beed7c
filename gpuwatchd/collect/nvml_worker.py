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
from typing import IO, Any

import pynvml

# The reply's notice that a GPU answers only the v1 memory query (the client logs it once).
MEMORY_V1_NOTICE = "memory_v1"

NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230  # R565 and later; NotSupported before
EVENT_TYPE_XID = 0x8  # nvmlEventTypeXidCriticalError
EVENT_TYPE_RECOVERY_ACTION = 0x8000  # nvmlEventTypeGpuRecoveryAction (R565 and later)
EVENT_WAIT_MS = 0  # the event set queues events between polls: take what is there, never wait
MAX_EVENTS_PER_READ = 256
GPU_FIELDS = (  # a GPU entry's values besides index, lost and error; None: unknown
    "uuid",
    "name",
    "pci_bus_id",
    "minor",
    "memory",
    "processes",
    "mig_mode",
    "persistence_mode",
    "numa_node",
    "architecture",
    "nvlink_active",
)


class GpuLostError(Exception):
    """NVML said NVML_ERROR_GPU_IS_LOST for this GPU."""


def describe_error(error: BaseException) -> str:
    """A short, stable text for an NVML error (pynvml's str() gives the driver's message)."""
    return str(error) or type(error).__name__


def _lost(error: Exception) -> bool:
    """Whether NVML said NVML_ERROR_GPU_IS_LOST."""
    return getattr(error, "value", None) == NVML_ERROR_GPU_IS_LOST


def note_error(errors: list[str], name: str, error: Exception) -> None:
    """The one mapping of a failed query: GPU lost ends the GPU's reading (GpuLostError); any
    other error, NVML's or a binding bug that must not take the worker down, is noted."""
    if isinstance(error, pynvml.NVMLError):
        if _lost(error):
            raise GpuLostError(name) from error
        errors.append(f"{name}: {describe_error(error)}")
    else:
        errors.append(f"{name}: {type(error).__name__}: {error}")


class GpuReader:
    """Reads one GPU, collecting per-value errors instead of raising them."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def query(self, name: str, *args: Any) -> Any:
        """``pynvml.<name>(*args)``: NotSupported → None, any other error → None + error."""
        try:
            return getattr(pynvml, name)(*args)
        except pynvml.NVMLError_NotSupported:
            return None
        except Exception as error:
            note_error(self.errors, name, error)
            return None


def count_active_nvlinks(reader: GpuReader, handle: Any) -> int | None:
    """How many NVLink links of this GPU are active; 0 without NVLink; None when unknown."""
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
        active += bool(state)
    return active


def probe(errors: list[str], name: str, *args: Any) -> tuple[str, Any]:
    """One health query ``pynvml.<name>(*args)``: ("ok", value), ("not_supported", None:
    NotSupported or FunctionNotFound, an older driver) or ("unknown", None) + error."""
    try:
        return "ok", getattr(pynvml, name)(*args)
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
    status, values = probe(errors, name, handle, [NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
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
    member = {
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
    }.get(kind)
    if member is None:
        errors.append(f"{name}(recovery action): unexpected value type {kind}")
        return {"status": "unknown", "value": None}
    return {"status": "ok", "value": int(getattr(field.value, member))}


def read_fabric(handle: Any, errors: list[str], first: int) -> tuple[dict[str, Any], int]:
    """One GPU's fabric entry from struct version ``first`` on, and the version to use next."""
    name = "nvmlDeviceGetGpuFabricInfoV"
    for version in (3, 2) if first == 3 else (2,):
        struct = getattr(pynvml, f"c_nvmlGpuFabricInfo_v{version}_t", None)
        if struct is None:
            continue
        info = struct()
        try:
            pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            return {"status": "not_supported"}, version
        except Exception as error:
            mismatch = getattr(error, "value", None) == NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            if isinstance(error, pynvml.NVMLError) and mismatch and version == 3:
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
    return {"status": "not_supported"}, 2


def read_remapped_rows(handle: Any, errors: list[str]) -> dict[str, Any]:
    status, rows = probe(errors, "nvmlDeviceGetRemappedRows", handle)
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
    status, pending = probe(errors, "nvmlDeviceGetRetiredPagesPendingStatus", handle)
    if status != "ok" or pending is None:
        return {"status": status}
    counts: dict[str, int | None] = {}
    for key, cause in (
        ("single_bit", pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
        ("double_bit", pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
    ):
        got, pages = probe(errors, "nvmlDeviceGetRetiredPages_v2", handle, cause)
        counts[key] = len(pages) if got == "ok" and pages is not None else None
    return {"status": "ok", "pending": bool(pending), **counts}


class Worker:
    """NVML session state that lives as long as the worker process."""

    def __init__(self) -> None:
        self.initialised = False
        self.handles: dict[int, Any] = {}
        self.identity: dict[int, dict[str, Any]] = {}
        self.identity_partial: set[int] = set()  # GPUs whose identity read had an error
        self.memory_v1: set[int] = set()
        self.event_set: Any = None
        self.events_status: dict[int, str] = {}  # GPU index → "ok", "not_supported", "unknown"
        self.fabric_version: dict[int, int] = {}  # GPU index → fabric struct version that works

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
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            driver = None
        notices: list[dict[str, Any]] = []
        gpus = [self.read_gpu(index, notices) for index in range(count)]
        self.read_events(gpus)
        return {"available": True, "driver_version": driver, "gpus": gpus, "notices": notices}

    def read_gpu(self, index: int, notices: list[dict[str, Any]]) -> dict[str, Any]:
        reader = GpuReader()
        entry: dict[str, Any] = {"index": index, **dict.fromkeys(GPU_FIELDS)}
        entry.update(lost=False, error=None, **self.identity.get(index, {}))
        try:
            handle = self.handles.get(index)
            if handle is None:
                handle = reader.query("nvmlDeviceGetHandleByIndex", index)
                if handle is None:
                    entry["error"] = "; ".join(reader.errors) or "no handle"
                    return entry
                self.handles[index] = handle
            if index not in self.identity or index in self.identity_partial:
                errors_before = len(reader.errors)
                # A value that failed is read again next poll; one read before is kept.
                known = self.identity.get(index, {})
                read = read_identity(reader, handle)
                identity = {k: known.get(k) if v is None else v for k, v in read.items()}
                entry.update(identity)
                if identity["uuid"] is not None:
                    self.identity[index] = identity
                    partial = len(reader.errors) > errors_before
                    (self.identity_partial.add if partial else self.identity_partial.discard)(index)

            def on_v1(reason: str) -> None:
                self.memory_v1.add(index)
                notice = {"notice": MEMORY_V1_NOTICE, "index": index, "uuid": entry["uuid"]}
                notices.append({**notice, "reason": reason})

            entry["memory"] = read_memory(reader, handle, index not in self.memory_v1, on_v1)
            entry["processes"] = read_processes(reader, handle)
            errors_before = len(reader.errors)
            mig = reader.query("nvmlDeviceGetMigMode", handle)
            if mig is not None:
                entry["mig_mode"] = int(mig[0])
            elif len(reader.errors) == errors_before:
                # NotSupported: a GPU without MIG cannot have it enabled (known, not unknown).
                entry["mig_mode"] = 0
            if entry["mig_mode"] == 1:
                entry["mig_devices"] = read_mig_devices(reader, handle)
            persistence = reader.query("nvmlDeviceGetPersistenceMode", handle)
            entry["persistence_mode"] = None if persistence is None else int(persistence)
            # Failed (not NotSupported, nor FunctionNotFound: older than coherent GPUs): unknown.
            numa = probe(reader.errors, "nvmlDeviceGetNumaNodeId", handle)
            entry["numa_node"], entry["numa_node_unknown"] = numa[1], numa[0] == "unknown"
            entry["health"] = self.read_health(index, handle, reader.errors)
        except GpuLostError as lost:
            entry["lost"] = True
            reader.errors.append(f"{lost}: GPU is lost")
        if reader.errors:
            entry["error"] = "; ".join(reader.errors)
        return entry

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
            status, created = probe(errors, "nvmlEventSetCreate")
            if status != "ok":
                self.events_status[index] = status
                return
            self.event_set = created
        status, supported = probe(errors, "nvmlDeviceGetSupportedEventTypes", handle)
        wanted = int(supported or 0) & (EVENT_TYPE_XID | EVENT_TYPE_RECOVERY_ACTION)
        if status != "ok" or not wanted:
            self.events_status[index] = "not_supported" if status == "ok" else status
            return
        status, _ = probe(errors, "nvmlDeviceRegisterEvents", handle, wanted, self.event_set)
        self.events_status[index] = status

    def read_events(self, gpus: list[dict[str, Any]]) -> None:
        """Take the queued Xid events into the GPUs' ``health`` entries. A recovery-action
        event only says to read the field again, which this poll already did."""
        if self.event_set is None:
            return
        by_address = {handle_address(h): i for i, h in self.handles.items()}
        entries = {gpu["index"]: gpu for gpu in gpus}
        for _ in range(MAX_EVENTS_PER_READ):
            try:
                data = pynvml.nvmlEventSetWait_v2(self.event_set, EVENT_WAIT_MS)
            except pynvml.NVMLError as error:
                if _lost(error):
                    self.rebuild_events(gpus)
                return  # Timeout: nothing (more) queued; any other error: try next poll
            if int(data.eventType) != EVENT_TYPE_XID:
                continue
            index = by_address.get(handle_address(data.device))
            health = entries.get(index, {}).get("health") if index is not None else None
            if isinstance(health, dict):
                health["xids"].append({"xid": int(data.eventData), "wall": time.time()})

    def rebuild_events(self, gpus: list[dict[str, Any]]) -> None:
        """A lost GPU fails every wait of its set, with the other GPUs' events (NVML: GPU_IS_LOST
        "if a GPU has fallen off the bus"): a new set for the GPUs that answer. The old set's
        unread events are gone; a failed registration is retried, and named, next poll."""
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlEventSetFree(self.event_set)
        self.event_set = None
        self.events_status.clear()
        for gpu in gpus:
            handle = self.handles.get(gpu["index"])
            if handle is not None and not gpu["lost"]:
                with contextlib.suppress(GpuLostError):
                    self.register_events(gpu["index"], handle, [])


def read_identity(reader: GpuReader, handle: Any) -> dict[str, Any]:
    """What a GPU is, read once per worker (links do not come and go between resets)."""
    return {
        "uuid": reader.query("nvmlDeviceGetUUID", handle),
        "name": reader.query("nvmlDeviceGetName", handle),
        "minor": reader.query("nvmlDeviceGetMinorNumber", handle),
        "pci_bus_id": None
        if (pci := reader.query("nvmlDeviceGetPciInfo_v3", handle)) is None
        else _text(pci.busId),
        "architecture": reader.query("nvmlDeviceGetArchitecture", handle),
        "nvlink_active": count_active_nvlinks(reader, handle),
    }


def _text(value: Any) -> Any:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def read_memory(
    reader: GpuReader,
    handle: Any,
    v2: bool = True,
    on_v1: Callable[[str], None] = lambda reason: None,
) -> dict[str, Any] | None:
    """A GPU's or MIG device's memory, v2 else v1 (``on_v1`` hears why); None when unknown."""
    if v2:
        try:
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound) as error:
            on_v1(f"nvmlDeviceGetMemoryInfo_v2: {describe_error(error)}")
        except pynvml.NVMLError as error:
            note_error(reader.errors, "nvmlDeviceGetMemoryInfo_v2", error)
            return None
        else:
            total, free, reserved = int(memory.total), int(memory.free), int(memory.reserved)
            allocated = total - free - reserved
            return {
                "api": "v2",
                "total": total,
                "free": free,
                "reserved": reserved,
                "allocated": allocated if allocated >= 0 else None,
                "used_v1": None,
            }
    v1 = reader.query("nvmlDeviceGetMemoryInfo", handle)
    if v1 is None:
        return None
    return {
        "api": "v1",
        "total": int(v1.total),
        "free": int(v1.free),
        "reserved": None,
        "allocated": None,
        "used_v1": int(v1.used),
    }


def read_processes(reader: GpuReader, handle: Any) -> list[dict[str, Any]] | None:
    """The compute, graphics and MPS lists; None when the compute list is unknown."""
    found: list[dict[str, Any]] = []
    for kind, base in (
        ("compute", "nvmlDeviceGetComputeRunningProcesses"),
        ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
        ("mps", "nvmlDeviceGetMPSComputeRunningProcesses"),
    ):
        listed = list_processes(reader, handle, base)
        if listed is None:
            if kind == "compute":
                return None
            continue
        found.extend({"pid": pid, "used_memory": used, "kind": kind} for pid, used in listed)
    return found


def list_processes(
    reader: GpuReader, handle: Any, base: str
) -> list[tuple[int, int | None]] | None:
    """One process list as (PID, used memory or None); None if unknown."""
    for suffix, entry in (("_v3", ProcessInfoV3), ("_v2", ProcessInfoV2)):
        name = base + suffix
        try:
            return running_processes(name, entry, handle)
        except pynvml.NVMLError_FunctionNotFound:
            continue
        except pynvml.NVMLError_NotSupported:
            return None
        except pynvml.NVMLError as error:
            note_error(reader.errors, name, error)
            return None
    reader.errors.append(f"{base}: no _v3 or _v2 symbol in this driver")
    return None


# pynvml's process entries' layouts as plain structures (docs/internals.md says why).
class ProcessInfoV2(ctypes.Structure):
    _fields_ = pynvml.c_nvmlProcessInfo_v2_t._fields_


class ProcessInfoV3(ctypes.Structure):
    _fields_ = pynvml.c_nvmlProcessInfo_v3_t._fields_


def running_processes(
    name: str, entry: type[ctypes.Structure], handle: Any
) -> list[tuple[int, int | None]]:
    """pynvml's ``<name>(handle)`` (the same two calls, the same errors raised) as (PID, used
    memory or None when NVML says it is not available)."""
    library = pynvml.nvmlLib
    if library is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
    try:
        function = getattr(library, name)
    except AttributeError:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND) from None
    count = ctypes.c_uint(0)
    status = function(handle, ctypes.byref(count), None)
    if status == pynvml.NVML_SUCCESS:
        return []
    if status != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
        raise pynvml.NVMLError(status)
    count.value = count.value * 2 + 5  # room for processes started since the first call
    entries = (entry * count.value)()
    status = function(handle, ctypes.byref(count), entries)
    if status != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(status)
    unknown = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
    return [
        (int(e.pid), None if e.usedGpuMemory == unknown else int(e.usedGpuMemory))
        for e in entries[: count.value]
    ]


def read_mig_devices(reader: GpuReader, handle: Any) -> list[dict[str, Any]] | None:
    """The MIG devices of a GPU with MIG on; None when the list cannot be read. Per-instance
    figures come only from MIG handles (the parent's are aggregates)."""
    count = reader.query("nvmlDeviceGetMaxMigDeviceCount", handle)
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
        found.append(read_mig_device(handle, mig, index))
    return found


def read_mig_device(parent: Any, mig: Any, index: int) -> dict[str, Any]:
    own = GpuReader()
    name = _text(own.query("nvmlDeviceGetName", mig))
    uuid = _text(own.query("nvmlDeviceGetUUID", mig))
    gi = own.query("nvmlDeviceGetGpuInstanceId", mig)
    ci = own.query("nvmlDeviceGetComputeInstanceId", mig)
    # The GPU instance's profile and placement ([start, size]): what re-creating it needs.
    instance = None if gi is None else own.query("nvmlDeviceGetGpuInstanceById", parent, gi)
    info = None if instance is None else own.query("nvmlGpuInstanceGetInfo", instance)
    placement = None if info is None else [int(info.placement.start), int(info.placement.size)]
    return {
        "index": index,
        "uuid": uuid,
        "name": name,
        "gi": None if gi is None else int(gi),
        "ci": None if ci is None else int(ci),
        "gi_profile_id": None if info is None else int(info.profileId),
        "placement": placement,
        "memory": read_memory(own, mig),
        "processes": read_processes(own, mig),
        "error": "; ".join(own.errors) or None,
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
                reply = {"shutdown": True}
            else:
                reply = {"error": f"unknown request: {line.strip()[:100]!r}"}
            replies.write(json.dumps(reply) + "\n")
            replies.flush()
            if op == "shutdown" or reply.get("fatal"):
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
