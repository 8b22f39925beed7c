"""Reading a scenario's GPUs for ``gpuwatchd simulate``: the two layers of the scenario reader
that :mod:`gpuwatchd.sim.scenario` builds on, :class:`ReaderBase` (typed values) and
:class:`GpuReader` (the host section and the GPUs)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from gpuwatchd.collect.holders import MAX_GPU_MINOR
from gpuwatchd.collect.jobs import scheduler_ended_job
from gpuwatchd.collect.kernel_log import MAX_PID
from gpuwatchd.config.keys import BOOL, items_of, kind_of, scalar
from gpuwatchd.config.units import parse_duration, parse_size
from gpuwatchd.config.yamlsrc import (
    ConfigError,
    Map,
    Node,
    Scalar,
    did_you_mean,
    join_key,
    shown,
)
from gpuwatchd.core.model import MIB
from gpuwatchd.decide.argv import check_value
from gpuwatchd.decide.gpu_ids import pci_bus_key
from gpuwatchd.sim.scenario_spec import (
    FABRIC_STATES,
    GIB,
    RECOVERY_ACTIONS,
    GpuSpec,
    HealthSpec,
    HoldSpec,
    HostSpec,
    MigInstanceSpec,
    keys_of,
)

# A GPU's health (docs/simulate.md): the recovery action by number or name, row remapping,
# retired pages and the NVLink fabric; a successful reset clears what a reset applies.
HEALTH_KEYS = keys_of(HealthSpec)

# GpuSpec's fields, but its memory figures are one mapping (``memory``) and its instances are
# read under ``mig``.
_SPEC_KEYS = keys_of(GpuSpec, but=("allocated", "reserved", "leaked", "mig_instances"))
_GPU_KEYS = tuple("memory" if key == "total" else key for key in _SPEC_KEYS)

_INSTANCE_SIZES = ("total", "allocated", "leaked")

_PROFILE = re.compile(r"[0-9]{1,2}(?:c\.[0-9]{1,2})?g\.[0-9]{1,4}gb(?:\+[a-z]{1,8})?")


class ReaderBase:
    """The typed values of a scenario, each failure a ConfigError naming its file, line and key
    (``parse_scenario`` makes it a ScenarioError)."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.text = text
        self.names: dict[str, int] = {}
        self.gpus: dict[int, GpuSpec] = {}  # the scenario's GPUs by index, once read
        self.pid_max = HostSpec.pid_max  # the host's, once read: every PID is below it

    def mapping(self, node: Node, keys: Sequence[str]) -> Map:
        if not isinstance(node, Map):
            raise node.error(f"expected a mapping, got {kind_of(node)}")
        for key, line in node.key_lines.items():
            if key not in keys:
                where = Scalar(node.file, line, join_key(node.path, key))  # the key's own line
                hint = did_you_mean(key, keys)
                raise where.error(f"unknown field{hint}; known: {', '.join(keys)}")
        return node

    def required(self, m: Map, key: str, what: str = "") -> Node:
        """``m``'s ``key``, refused where it is absent (``what``: what to write there)."""
        if (node := m.entries.get(key)) is None:
            raise m.error(f"missing required field '{key}'{what}", join_key(m.path, key))
        return node

    def string(self, node: Node) -> str:
        value = scalar(node)
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise node.error(f"expected a string, got {kind_of(node)}")
        return str(value)

    def flag(self, node: Node | None, default: bool) -> bool:
        return default if node is None else BOOL.read(node)

    def integer(self, node: Node, minimum: int = 0) -> int:
        value = scalar(node)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise node.error(f"expected an integer >= {minimum}, got {kind_of(node)}")
        return value

    def duration(self, node: Node) -> float:
        try:
            return parse_duration(scalar(node), where=node.path)
        except ConfigError as err:
            raise node.error(err.message) from None

    def size(self, node: Node) -> int:
        """A size in bytes below 2**53, as a size with a unit is (config/units): no GPU has
        more, and the daemon's sums of NVML's figures are exact only below it."""
        try:
            size = parse_size(scalar(node), where=node.path)
        except ConfigError as err:
            raise node.error(err.message) from None
        if size >= 2**53:
            raise node.error(f"size {shown(scalar(node))} is too large")
        return size

    def choice(self, node: Node, choices: Sequence[str]) -> str:
        if (value := self.string(node)) not in choices:
            raise node.error(f"expected one of {', '.join(choices)}, got {shown(value)}")
        return value


class GpuReader(ReaderBase):
    """The host section and the GPUs of a scenario (memory, MIG layout, health)."""

    def host(self, node: Node | None) -> HostSpec:
        if node is None:
            return HostSpec()
        m = self.mapping(node, keys_of(HostSpec))
        namespaces = scalar(n) if (n := m.entries.get("host_namespaces")) else True
        if not isinstance(namespaces, (bool, type(None))):
            raise m.entries["host_namespaces"].error("expected true, false or null (unknown)")
        mps = BOOL.read(n) if (n := m.entries.get("mps_server_running")) else False
        pid_max = self.integer(n, 1) if (n := m.entries.get("pid_max")) else HostSpec.pid_max
        if n is not None and pid_max > MAX_PID:  # a start time sorts by PID (world.py)
            raise n.error(f"at most {MAX_PID}, the kernel's largest pid_max; got {pid_max}")
        ended: set[str] = set()
        for item in items_of(n) if (n := m.entries.get("ended_jobs")) is not None else []:
            try:
                ended.add(scheduler_ended_job(self.string(item), {}))
            except ValueError as err:
                raise item.error(str(err)) from None
        self.pid_max = pid_max
        return HostSpec(namespaces, mps, pid_max, frozenset(ended))

    def know_gpus(self, nodes: Sequence[Node], gpus: Sequence[GpuSpec]) -> None:
        """The GPUs that processes and events refer to by index; no two share an index, UUID,
        PCI bus id (however spelled) or minor."""
        for what in ("index", "uuid", "pci_bus_id", "minor"):
            seen: set[object] = set()
            for node, value in zip(nodes, (getattr(gpu, what) for gpu in gpus), strict=True):
                same = pci_bus_key(value) if what == "pci_bus_id" else value
                if same in seen:
                    where = join_key(node.path, what)
                    raise node.error(f"two GPUs have the same {what} {shown(value)}", where)
                seen.add(same)
        self.gpus = {gpu.index: gpu for gpu in gpus}

    def gpu_index(self, node: Node) -> int:
        if (index := self.integer(node)) not in self.gpus:
            raise node.error(f"no GPU with index {index} in this scenario")
        return index

    def nvml_value(self, node: Node, name: str, value: str) -> None:
        """A UUID or PCI bus id in the form the real driver reports (the daemon refuses to put
        anything else into a reset command, so the scenario says so up front)."""
        try:
            check_value(name, value)
        except ValueError as err:
            raise node.error(str(err).removesuffix("; refusing to run")) from None

    def gpu(self, node: Node, position: int) -> GpuSpec:
        m = self.mapping(node, _GPU_KEYS)
        get = m.entries.get
        index = self.integer(n) if (n := get("index")) is not None else position
        uuid = f"GPU-{index:08x}-0000-4000-8000-{index:012x}"
        if (n := get("uuid")) is not None:
            uuid = self.string(n)
        if not uuid.startswith("GPU-"):
            raise (get("uuid") or m).error("a GPU UUID starts with 'GPU-'")
        self.nvml_value(get("uuid") or m, "uuid", uuid)
        name = self.string(n) if (n := get("name")) is not None else "NVIDIA H100 80GB HBM3"
        # Bus 17, 27, ... F7, 07 of PCI domain 0 for the first 16 GPUs; of domain 1, 2, ... next.
        bus = f"{index // 16:08X}:{(0x17 + 0x10 * index) % 256:02X}:00.0"
        if (n := get("pci_bus_id")) is not None:
            bus = self.string(n)
            if not isinstance(scalar(n), str):  # YAML 1.1: 17:00.0 is base 60
                raise n.error(f"YAML read a number ({shown(scalar(n))}): quote a PCI bus id")
        self.nvml_value(get("pci_bus_id") or m, "pci_bus_id", bus)
        if (minor := self.integer(n) if (n := get("minor")) is not None else index) > MAX_GPU_MINOR:
            # The holder scan's: no driver numbers a GPU's /dev/nvidiaN further (nor 248 GPUs).
            raise (n or m).error(
                f"at most {MAX_GPU_MINOR}, the driver's last /dev/nvidiaN of a GPU; got {minor}"
            )
        memory = {"total": 80 * GIB, "allocated": 4 * MIB, "reserved": 512 * MIB, "leaked": 0}
        if (mem := get("memory")) is not None:
            entries = self.mapping(mem, tuple(memory)).entries
            memory |= {key: self.size(entries[key]) for key in tuple(memory) if key in entries}
            if memory["allocated"] + memory["leaked"] + memory["reserved"] > memory["total"]:
                raise mem.error("allocated + leaked + reserved is more than total")
        instances = self.mig_instances(n) if isinstance(n := get("mig"), Map) else ()
        return GpuSpec(
            index=index,
            uuid=uuid,
            name=name,
            pci_bus_id=bus,
            minor=minor,
            **memory,
            mig=bool(instances) or self.flag(get("mig"), False),  # a mapping of instances: on
            coherent=self.flag(get("coherent"), False),
            persistence=self.flag(get("persistence"), True),
            lost=self.flag(get("lost"), False),
            health=self.health_spec(n) if (n := get("health")) is not None else HealthSpec(),
            mig_instances=instances,
        )

    def mig_instances(self, node: Map) -> tuple[MigInstanceSpec, ...]:
        """``mig: {instances: [{gi, profile, total, allocated, leaked}, ...]}``."""
        m = self.mapping(node, ("instances",))
        found: list[MigInstanceSpec] = []
        for item in items_of(m.entries["instances"]) if "instances" in m.entries else []:
            im = self.mapping(item, keys_of(MigInstanceSpec))
            get = im.entries.get
            gi = self.integer(gi_node := self.required(im, "gi", " (the GPU instance id)"))
            if gi > 14:
                raise gi_node.error("a GPU instance id is 0 to 14")
            profile = self.string(n) if (n := get("profile")) is not None else "1g.10gb"
            if not _PROFILE.fullmatch(profile):
                raise (get("profile") or im).error(f"not a MIG profile name: {shown(profile)}")
            sizes = {k: self.size(im.entries[k]) for k in _INSTANCE_SIZES if k in im.entries}
            spec = MigInstanceSpec(gi=gi, profile=profile, **sizes)  # the others: its defaults
            if spec.allocated + spec.leaked > spec.total:
                raise im.error("allocated + leaked is more than total")
            found.append(spec)
        if not found:
            raise node.error("a MIG GPU needs at least one instance ({gi: 1})")
        if len({i.gi for i in found}) != len(found):
            raise node.error("two GPU instances have the same gi")
        return tuple(found)

    def check_mig(self, entry: Map, holds: HoldSpec, nvml: Mapping[int, int | None]) -> None:
        """A context on a MIG GPU lives in a GPU instance: ``holds.mig`` must name one of it."""
        where, key = entry.entries.get("holds") or entry, join_key(entry.path, "holds")
        for gpu in self.gpus.values():
            known = {i.gi for i in gpu.mig_instances}
            if known and gpu.index in nvml and holds.mig is None:
                needs = f"a context on MIG GPU {gpu.index} needs holds.mig (its GPU instance)"
                raise where.error(needs, key)
            if known and holds.mig not in (None, *known) and gpu.index in holds.gpus:
                raise where.error(f"GPU {gpu.index} has no GPU instance {holds.mig}", key + ".mig")

    def health_spec(self, node: Node) -> HealthSpec:
        return HealthSpec(**self.health(self.mapping(node, HEALTH_KEYS).entries))  # type: ignore[arg-type]

    def health(self, entries: Mapping[str, Node]) -> dict[str, object]:
        """The fields that the checked ``health`` mapping of a GPU or of an event sets."""
        found: dict[str, object] = {}
        for key, value in entries.items():
            if key in ("recovery_action", "fabric"):  # by name or null; an action also 0-255
                names = RECOVERY_ACTIONS if key == "recovery_action" else FABRIC_STATES
                raw = scalar(value)
                number = isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw <= 255
                if raw is None or (number and key == "recovery_action"):
                    found[key] = raw
                elif raw in names:
                    found[key] = names.index(str(raw))
                else:
                    also = "0-255 or " if key == "recovery_action" else ""
                    raise value.error(f"expected {also}one of {', '.join(names)} or null")
            elif key == "retired_pages_pending" and scalar(value) is None:
                found[key] = None
            elif key == "fabric_after_reset":
                found[key] = None if scalar(value) == "never" else self.duration(value)
            else:
                found[key] = BOOL.read(value)
        return found
