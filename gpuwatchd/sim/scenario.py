"""Scenario files for ``gpuwatchd simulate``: parsing and strict validation.

In detail: docs/internals.md, section `gpuwatchd.sim.scenario`.
"""

from __future__ import annotations

import itertools
import shlex
from collections.abc import Sequence
from dataclasses import replace

import yaml

from gpuwatchd.config.files import FileTooLarge, NotARegularFile, read_regular_file
from gpuwatchd.config.keys import BOOL, INTERVAL, items_of, kind_of, scalar
from gpuwatchd.config.yamlsrc import (
    MAX_DOCUMENT_BYTES,
    ConfigError,
    Map,
    Node,
    Scalar,
    Seq,
    join_key,
    load_document,
    shown,
)
from gpuwatchd.core.checked import MAX_REASON, decimal
from gpuwatchd.sim.scenario_gpus import HEALTH_KEYS, GpuReader
from gpuwatchd.sim.scenario_spec import (
    EVENT_ACTIONS,
    EXIT_MODES,
    FILES,
    FIRST_AUTO_PID,
    RESET_RESULTS,
    RESET_STEPS,
    SIGKILL_REACTIONS,
    VIA,
    EventSpec,
    HoldSpec,
    ProcessSpec,
    Scenario,
    ScenarioError,
    keys_of,
)
from gpuwatchd.state.spares import parse_target

_TOP_KEYS = keys_of(Scenario, but=("path",))  # the file's keys are its fields

# sigterm_delay is said in on_sigterm; line is where the process was read
_PROCESS_KEYS = keys_of(ProcessSpec, but=("sigterm_delay", "line"))


_SYSTEM_PROGRAM_DIRS = ("/usr/", "/bin/", "/sbin/", "/opt/")  # exe_trusted's default


def load_scenario(path: str) -> Scenario:
    """Read and validate the scenario file at ``path``; ScenarioError on any problem."""
    try:
        raw = read_regular_file(path, MAX_DOCUMENT_BYTES)
    except FileNotFoundError:
        raise ScenarioError("scenario file not found", path=path) from None
    except NotARegularFile as err:
        raise ScenarioError(f"{err}: a scenario is a regular file", path=path) from None
    except FileTooLarge as err:
        raise ScenarioError(f"{err}: not a scenario", path=path) from None
    except OSError as err:
        raise ScenarioError(f"cannot read: {err.strerror}", path=path) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ScenarioError(f"not UTF-8 text: {err.reason}", path=path) from None
    return parse_scenario(path, text)


def parse_scenario(path: str, text: str) -> Scenario:
    """Validate scenario ``text`` (named ``path`` in messages). Pure."""
    try:
        return _Reader(path, text).scenario(load_document(path, text))
    except ConfigError as err:  # the YAML's, or a value config's readers refused
        raise ScenarioError(err.message, path=path, line=err.line, key=err.key) from None


def _policy_text(text: str) -> str:
    """The inline ``policy:`` value of a scenario that has one as its own YAML document, on
    the same lines as in the file (so a policy error names the scenario's own line numbers)."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    assert isinstance(root, yaml.MappingNode)  # noqa: S101 -- load_document read a mapping
    value = next(v for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value == "policy")
    if isinstance(value, yaml.ScalarNode) and value.tag == "tag:yaml.org,2002:null":
        return ""
    start, end = value.start_mark, value.end_mark
    body = text[int(start.index) : int(end.index)]
    return "\n" * int(start.line) + " " * int(start.column) + body + "\n"


class _Reader(GpuReader):
    """Turns the positioned YAML tree into a Scenario, stopping at the first problem."""

    def scenario(self, root: Map) -> Scenario:
        top = self.mapping(root, _TOP_KEYS)
        get = top.entries.get
        duration_node = self.required(top, "duration", " (e.g. '10m')")
        if (duration := self.duration(duration_node)) <= 0:
            raise duration_node.error("must be longer than 0s")
        interval = INTERVAL.read(n) if (n := get("interval")) is not None else None
        description = self.string(d) if (d := get("description")) is not None else ""
        host = self.host(get("host"))
        gpus_node = self.required(top, "gpus", " (a list of GPUs)")
        gpu_nodes = items_of(gpus_node)
        gpus = tuple(self.gpu(n, i) for i, n in enumerate(gpu_nodes))
        if not gpus:
            raise gpus_node.error("a scenario needs at least one GPU")
        self.know_gpus(gpu_nodes, gpus)
        proc_nodes = items_of(p) if (p := get("processes")) is not None else []
        event_nodes = items_of(e) if (e := get("events")) is not None else []
        starts = [
            s
            for n in event_nodes
            if isinstance(n, Map) and isinstance(s := n.entries.get("start"), Map)
        ]
        # Names and PIDs first, so that ppid/pgid/sid may name a process listed later.
        self.reserve(proc_nodes, starts)
        processes = tuple(self.process(n) for n in proc_nodes)
        events = tuple(self.event(n) for n in event_nodes)
        policy = None
        if (policy_node := get("policy")) is not None:
            if not isinstance(policy_node, Map) and not (
                isinstance(policy_node, Scalar) and policy_node.value is None
            ):
                raise policy_node.error(f"expected a mapping, got {kind_of(policy_node)}")
            policy = (self.path, _policy_text(self.text))
        return Scenario(
            path=self.path,
            description=description,
            duration=duration,
            interval=interval,
            policy=policy,
            host=host,
            gpus=gpus,
            processes=processes,
            events=tuple(sorted(events, key=lambda ev: ev.at)),
        )

    def reserve(self, listed: Sequence[Node], started: Sequence[Node]) -> None:
        """Give each process its name and PID before anything refers to one. The PIDs written
        come first, so that no automatic one (from FIRST_AUTO_PID up) takes a PID written
        further down; the ``listed`` processes start together, so no two of them share one."""
        automatic: list[str] = []
        written: dict[int, str] = {}  # PID -> the listed process written with it
        for position, node in enumerate([*listed, *started]):
            m = self.mapping(node, _PROCESS_KEYS)
            name_node = self.required(m, "name")
            if not (name := self.string(name_node)):
                raise name_node.error("a process name cannot be empty")
            if name in self.names:
                raise name_node.error(f"two processes are named {shown(name)}")
            if (n := m.entries.get("pid")) is None:
                automatic.append(name)
                self.names[name] = 0  # assigned below
                continue
            pid = self.names[name] = self.integer(n, 3)
            if pid in written and position < len(listed):
                both = f"{shown(written[pid])} and {shown(name)}"
                raise n.error(f"two processes have PID {pid} ({both})")
            written.setdefault(pid, name)
        free = (pid for pid in itertools.count(FIRST_AUTO_PID) if pid not in written)
        self.names.update(zip(automatic, free, strict=False))

    def ref(self, node: Node) -> int:
        """A process reference: a name from this scenario, or a number (1 = init)."""
        value = scalar(node)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        if isinstance(value, str) and value in self.names:
            return self.names[value]
        known = ", ".join(sorted(self.names)) or "none"
        raise node.error(f"not a PID or a process name of this scenario: {shown(value)} ({known})")

    def process(self, node: Node) -> ProcessSpec:
        m = self.mapping(node, _PROCESS_KEYS)
        get = m.entries.get
        name = self.string(m.entries["name"])
        pid = self.names[name]
        if pid >= self.pid_max:  # as the kernel gives PIDs (NVML's listing of another: invalid)
            where, most = get("pid") or m.entries["name"], self.pid_max
            raise where.error(f"PID {pid} is not below host.pid_max ({most}); no process has it")
        ppid = self.ref(n) if (n := get("ppid")) is not None else 1
        pgid = self.ref(n) if (n := get("pgid")) is not None else pid
        sid = self.ref(n) if (n := get("sid")) is not None else pgid
        user = self.string(n) if (n := get("user")) is not None else "root"
        uid = self.integer(n) if (n := get("uid")) is not None else (0 if user == "root" else 1000)
        command = self.command(get("command"), name)
        comm = self.string(n) if (n := get("comm")) is not None else command[0].rsplit("/", 1)[-1]
        exe = self.string(n) if (n := get("exe")) is not None else None
        # Its program is where the admin installs programs, unless the scenario says (null:
        # it cannot be read).
        exe_trusted: bool | None = (exe or command[0]).startswith(_SYSTEM_PROGRAM_DIRS)
        if (n := get("exe_trusted")) is not None:
            exe_trusted = None if scalar(n) is None else BOOL.read(n)
        cgroup = self.cgroup(get("cgroup"), uid)
        state = self.choice(n, ("R", "S", "D", "Z", "T")) if (n := get("state")) else "S"
        holds = self.holds(get("holds"))
        nvml = self.nvml(get("nvml"))
        self.check_mig(m, holds, nvml)
        on_sigterm, delay = (
            self.sigterm(n) if (n := get("on_sigterm")) is not None else ("exit", 0.0)
        )
        return ProcessSpec(
            name=name,
            pid=pid,
            ppid=ppid,
            pgid=pgid,
            sid=sid,
            user=user,
            uid=uid,
            command=command,
            comm=comm[:15],
            exe=exe,
            cgroup=cgroup,
            state=state,
            holds=holds,
            nvml=nvml,
            on_sigterm=on_sigterm,
            sigterm_delay=delay,
            on_sigkill=self.choice(n, SIGKILL_REACTIONS) if (n := get("on_sigkill")) else "exit",
            on_exit=self.choice(n, EXIT_MODES) if (n := get("on_exit")) else "release",
            exits_at=self.duration(n) if (n := get("exits_at")) is not None else None,
            visible=self.flag(get("visible"), True),
            subreaper=self.flag(get("subreaper"), False),
            stops_for_reset=self.flag(get("stops_for_reset"), False),
            files=self.choice(n, FILES) if (n := get("files")) is not None else None,
            exe_trusted=exe_trusted,
            line=m.line,
        )

    def cgroup(self, node: Node | None, uid: int) -> str:
        """A process's cgroup path, starting with '/' (by default a user session's of ``uid``)."""
        if node is None and uid == 0:
            return "/system.slice/cron.service"
        if node is None:
            return f"/user.slice/user-{uid}.slice/session-1.scope"
        cgroup = self.string(node)
        if not cgroup.startswith("/"):
            raise node.error("a cgroup path starts with '/'")
        return cgroup

    def command(self, node: Node | None, name: str) -> tuple[str, ...]:
        if node is None:
            return (name,)
        if isinstance(node, Seq):
            argv = tuple(self.string(item) for item in node.items)
        else:
            try:
                argv = tuple(shlex.split(self.string(node)))
            except ValueError as err:
                raise node.error(f"cannot split the command line: {err}") from None
        if not argv:
            raise node.error("a command needs at least one word")
        return argv

    def sigterm(self, node: Node) -> tuple[str, float]:
        text = self.string(node).strip()
        word, _, rest = text.partition(" ")
        if word == "exit_after" and rest.strip():
            return "exit_after", self.duration(Scalar(node.file, node.line, node.path, rest))
        if word in ("exit", "ignore") and not rest:
            return word, 0.0
        raise node.error(f"expected exit, ignore or 'exit_after <duration>', got {shown(text)}")

    def holds(self, node: Node | None) -> HoldSpec:
        if node is None:
            return HoldSpec(ctl=False, uvm=False)
        if isinstance(node, Seq):  # shorthand: a list of GPU indexes
            return HoldSpec(tuple(self.gpu_index(item) for item in node.items))
        m = self.mapping(node, keys_of(HoldSpec))
        get = m.entries.get
        gpus = tuple(self.gpu_index(i) for i in items_of(n)) if (n := get("gpus")) else ()
        via = self.choice(n, VIA) if (n := get("via")) is not None else "both"
        ctl, uvm = self.flag(get("ctl"), True), self.flag(get("uvm"), True)
        mig = self.integer(n) if (n := get("mig")) is not None else None
        return HoldSpec(gpus, via, ctl, uvm, mig)

    def nvml(self, node: Node | None) -> dict[int, int | None]:
        if node is None:
            return {}
        if not isinstance(node, Map):
            raise node.error("expected a mapping of GPU index to memory, e.g. {0: 10GiB}")
        result: dict[int, int | None] = {}
        for key, value in node.entries.items():
            if (index := decimal(key)) is None or index not in self.gpus:
                raise value.error(f"no GPU with index {shown(key)} in this scenario")
            is_null = isinstance(value, Scalar) and value.value is None
            result[index] = None if is_null else self.size(value)
        return result

    def event(self, node: Node) -> EventSpec:
        m = self.mapping(node, ("at", "during", *EVENT_ACTIONS))
        at_node, during_node = m.entries.get("at"), m.entries.get("during")
        if at_node is None and during_node is None:
            raise m.error(
                "missing required field 'at' (e.g. '30s') or 'during' (a reset step)",
                join_key(m.path, "at"),
            )
        if at_node is not None and during_node is not None:
            raise during_node.error("an event has 'at' or 'during', not both")
        at = self.duration(at_node) if at_node is not None else 0.0
        during = self.choice(during_node, RESET_STEPS) if during_node is not None else None
        actions = [key for key in m.entries if key not in ("at", "during")]
        if len(actions) != 1:
            raise m.error(f"an event needs exactly one of: {', '.join(EVENT_ACTIONS)}")
        event = self.event_action(m, actions[0], at)
        return event if during is None else replace(event, during=during)

    def event_action(self, m: Map, action: str, at: float) -> EventSpec:
        value = m.entries[action]
        if action in ("exit", "memory_stays_allocated", "reap"):
            return EventSpec(at, action, m.line, target=self.name_ref(value))
        if action == "start":
            return EventSpec(at, action, m.line, process=self.process(value))
        if action == "set_memory":
            mm = self.mapping(value, ("gpu", "allocated"))
            gpu_node, alloc_node = mm.entries.get("gpu"), mm.entries.get("allocated")
            if gpu_node is None or alloc_node is None:
                raise mm.error("set_memory needs 'gpu' and 'allocated'")
            gpu = self.gpu_index(gpu_node)
            return EventSpec(at, action, m.line, gpu=gpu, memory=self.size(alloc_node))
        if action == "reset_result":
            return EventSpec(at, action, m.line, value=self.choice(value, RESET_RESULTS))
        if action in ("xid", "health"):
            hm = self.mapping(value, ("gpu", "xid") if action == "xid" else ("gpu", *HEALTH_KEYS))
            if (gpu_node := hm.entries.get("gpu")) is None:
                raise hm.error(f"{action} needs 'gpu'")
            gpu = self.gpu_index(gpu_node)
            if action == "health":
                rest = {k: v for k, v in hm.entries.items() if k != "gpu"}
                return EventSpec(at, action, m.line, gpu=gpu, health=self.health(rest))
            if (xid_node := hm.entries.get("xid")) is None:
                raise hm.error("xid needs 'xid' (the Xid number)")
            if (number := self.integer(xid_node, 1)) > 0xFFFF:
                raise xid_node.error("an Xid number is at most 65535")
            return EventSpec(at, action, m.line, gpu=gpu, xid=number)
        if action == "state":
            if not isinstance(value, Map) or len(value.entries) != 1:
                raise value.error("expected {process-name: state letter}, e.g. {worker: D}")
            ((proc_name, letter_node),) = value.entries.items()
            self.name_ref(Scalar(letter_node.file, letter_node.line, letter_node.path, proc_name))
            letter = self.choice(letter_node, ("R", "S", "D", "T"))
            return EventSpec(at, action, m.line, target=proc_name, value=letter)
        if action == "spare":
            return self.spare(value, at, m.line)
        reason = self.string(value) if scalar(value) is not None else ""
        return EventSpec(at, action, m.line, value=reason)  # pause / resume

    def spare(self, node: Node, at: float, line: int) -> EventSpec:
        """``spare: {process: NAME | job: ID, for: DURATION, reason: TEXT}``: as ``gpuwatchd
        spare PID|job:ID --for DURATION --reason TEXT`` at that moment."""
        sm = self.mapping(node, ("process", "job", "for", "reason"))
        who = [k for k in ("process", "job") if k in sm.entries]
        reason = self.string(sm.entries["reason"])[:MAX_REASON] if "reason" in sm.entries else ""
        if len(who) != 1 or "for" not in sm.entries or not reason:  # as gpuwatchd spare, cut
            raise sm.error("spare needs 'for', a 'reason' and one of 'process' or 'job'")
        if (lasts := self.duration(sm.entries["for"])) <= 0:
            raise sm.entries["for"].error("a spare lasts more than 0s")
        if who == ["process"]:
            name = self.name_ref(sm.entries["process"])
            return EventSpec(at, "spare", line, target=name, value=reason, lasts=lasts)
        job_node = sm.entries["job"]
        try:
            _, _, job = parse_target(f"job:{self.string(job_node)}")
        except ValueError as exc:
            raise job_node.error(str(exc)) from None
        return EventSpec(at, "spare", line, job=job, value=reason, lasts=lasts)

    def name_ref(self, node: Node) -> str:
        if (name := self.string(node)) not in self.names:
            known = ", ".join(sorted(self.names)) or "none"
            raise node.error(f"no process named {shown(name)} in this scenario ({known})")
        return name
