"""Reading the YAML policy: merge drop-ins, validate strictly, render back.

It walks the merged documents along the key table (:mod:`gpuwatchd.config.keys`), collecting
every problem with its file, line and key path, checks the rules of rules (required keys, which
finding kinds may be signalled), and turns text into the frozen
:class:`gpuwatchd.decide.policy.Policy` and back. It decides nothing and runs no command.

In detail: docs/internals.md, section `gpuwatchd.config.schema`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import yaml

from gpuwatchd.config.files import check_config_permissions, find_drop_ins, read_policy_files
from gpuwatchd.config.keys import (
    BOOL,
    HOOK_COMMAND,
    OMIT,
    SECTIONS,
    Nested,
    Section,
    items_of,
    kind_of,
    normalize_gpu_id,
)
from gpuwatchd.config.units import format_duration, format_size, parse_duration, parse_size
from gpuwatchd.config.yamlsrc import (
    MAX_DOCUMENT_BYTES,
    MAX_NODES,
    Budget,
    ConfigError,
    Map,
    Node,
    Scalar,
    Seq,
    did_you_mean,
    join_key,
    load_document,
    shown,
)
from gpuwatchd.core.escape import escape
from gpuwatchd.core.model import FindingKind
from gpuwatchd.core.paths import DEFAULT_CONFIG_PATH
from gpuwatchd.decide import kinds
from gpuwatchd.decide.plan.monitors import UNIT_NAME
from gpuwatchd.decide.policy import Policy, Step, default_rules

__all__ = [
    "ConfigError",
    "check_config_permissions",
    "default_policy",
    "find_drop_ins",
    "format_duration",
    "format_size",
    "load_policy",
    "normalize_gpu_id",
    "parse_duration",
    "parse_policy_documents",
    "parse_size",
    "policy_data",
    "render_policy",
]

# ``rules:`` alone in a drop-in: rules merge by name, so neither "none" nor "no change" is safe
# to guess (``rules: []`` changes nothing; the main file's ``rules:`` alone means no rules).
_NULL_RULES = (
    "an empty 'rules' in a drop-in is refused: rules merge by name, so it would not say which"
    " to keep; remove one with {name: NAME, enabled: false}, or write 'rules: []' to keep them"
)
_FAILED = object()  # a value that could not be read (its problem is recorded)
_HEADER_ROOM = 1024  # characters a saver may write above a rendered policy (state/accepted.py)
# Sections a misplaced key can be sent to by name (a rule, step or hook has no one place).
_HOMES = tuple(
    key.name for key in SECTIONS[""].keys if isinstance(key.value, Nested) and not key.value.many
)


# --- merging drop-ins -------------------------------------------------------------------------


def _named_rules(seq: Seq, problems: list[ConfigError]) -> list[tuple[str | None, Node]]:
    seen: dict[str, Node] = {}
    named: list[tuple[str | None, Node]] = []
    for item in seq.items:
        field = item.entries.get("name") if isinstance(item, Map) else None
        name = field.value if isinstance(field, Scalar) and isinstance(field.value, str) else None
        if name is not None and name in seen:
            problems.append(
                item.error(f"duplicate rule name {shown(name)} (first at line {seen[name].line})")
            )
            continue
        if name is not None:
            seen[name] = item
        named.append((name, item))
    return named


def _merge_rules(base: Node | None, over: Seq, problems: list[ConfigError]) -> Seq:
    merged = _named_rules(base, problems) if isinstance(base, Seq) else []
    for name, item in _named_rules(over, problems):
        slot = next((i for i, (old, _) in enumerate(merged) if name and old == name), None)
        if slot is None:
            merged.append((name, item))
        elif isinstance(old := merged[slot][1], Map) and isinstance(item, Map):
            # Field by field, like any mapping: {name: orphans, for: 10s} changes one field.
            merged[slot] = (name, _merge(old, item, problems))
        else:
            merged[slot] = (name, item)
    return Seq(over.file, over.line, over.path, [item for _, item in merged])


def _merge(base: Map, over: Map, problems: list[ConfigError], *, drop_in: bool = False) -> Map:
    result = Map(over.file, over.line, over.path, dict(base.entries), dict(base.key_lines))
    for key, new in over.entries.items():
        old = result.entries.get(key)
        null = isinstance(new, Scalar) and new.value is None
        if null and isinstance(old, Map):
            continue  # an empty section ("reset:") in a drop-in changes nothing
        merged = new
        if isinstance(old, Map) and isinstance(new, Map):
            merged = _merge(old, new, problems)
        elif not over.path and key == "rules" and isinstance(new, Seq):
            merged = _merge_rules(old, new, problems)
        elif not over.path and key == "rules" and null and drop_in:
            problems.append(new.error(_NULL_RULES))
        result.entries[key] = merged
        result.key_lines[key] = over.key_lines[key]
    return result


# --- validation -------------------------------------------------------------------------------


class _Section:
    """One mapping of the config being read, the section named ``name`` of the key table;
    collects problems instead of stopping."""

    def __init__(
        self, node: Node | None, name: str, problems: list[ConfigError], path: str
    ) -> None:
        self.section = SECTIONS[name]
        self.problems = problems
        self.path = path
        self.map = node if isinstance(node, Map) else None
        if not isinstance(node, Map):
            if node is not None and not (isinstance(node, Scalar) and node.value is None):
                problems.append(node.error(f"expected a mapping, got {kind_of(node)}"))
            return
        allowed = self.section.names
        for key, line in node.key_lines.items():
            if key in allowed:
                continue
            home = next((name for name in _HOMES if key in SECTIONS[name].names), None)
            hint = did_you_mean(key, allowed) or (f" (it belongs under '{home}')" if home else "")
            where = join_key(path, key)
            problems.append(
                ConfigError(f"unknown key{hint}", path=node.entries[key].file, line=line, key=where)
            )

    def node(self, key: str) -> Node | None:
        return None if self.map is None else self.map.entries.get(key)

    def get(self, key: str, read: Callable[[Node], Any], default: Any) -> Any:
        node = self.node(key)
        if node is None:
            return default
        try:
            return read(node)
        except ConfigError as err:
            self.problems.extend(
                p if p.path else node.error(p.message, p.key) for p in err.problems
            )
            return default


def _read_fields(reader: _Section, *, lenient: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The dataclass fields of its section that ``reader``'s mapping sets validly. Absent keys
    are left out (the default applies); a required one is a problem unless ``lenient``."""
    fields: dict[str, Any] = {}
    problems = reader.problems
    for key in reader.section.keys:
        node = reader.node(key.name)
        value: Any = _FAILED
        if isinstance(key.value, Nested):
            path = join_key(reader.path, key.name)
            if key.value.flatten:
                fields.update(_read_fields(_Section(node, key.value.section, problems, path)))
                continue
            if node is not None:
                value = _read_nested(node, key.value, problems, path)
        elif node is not None:
            value = reader.get(key.name, key.value.read, _FAILED)
        if node is None and key.required and key.name not in lenient and reader.map is not None:
            message = f"missing required key {key.name!r}{key.missing}"
            problems.append(reader.map.error(message, key=reader.path))
        if value is not _FAILED and key.field is not None:
            fields[key.field] = value
    return fields


def _read_nested(node: Node, nested: Nested, problems: list[ConfigError], path: str) -> Any:
    section = SECTIONS[nested.section]
    if not nested.many:
        return section.cls(**_read_fields(_Section(node, section.name, problems, path)))
    try:
        items = items_of(node, nested.most)
    except ConfigError as err:
        problems.extend(err.problems)
        return _FAILED
    before = len(problems)
    results = [_ITEM_READERS[section.name](item, problems) for item in items]
    if len(problems) > before:
        return _FAILED  # built only when every item is valid
    return tuple(section.cls(**fields) for fields in results if fields is not None)


def _item(
    node: Node, section: str, problems: list[ConfigError], null: str = "expected a mapping"
) -> _Section:
    """The reader of a list item, which must be a mapping: a null one, too, is a problem."""
    if isinstance(node, Scalar) and node.value is None:
        problems.append(node.error(null))
    return _Section(node, section, problems, node.path)


def _rule(node: Node, problems: list[ConfigError]) -> dict[str, Any] | None:
    """One rule's fields; None when it is disabled or not a mapping."""
    reader = _item(node, "rules[]", problems)
    if reader.map is None or not reader.get("enabled", BOOL.read, True):
        return None
    fields = _read_fields(reader)
    steps: tuple[Step, ...] | None = fields.get("steps")
    if steps == ():
        problems.append(reader.map.error("a rule needs at least one step", key=node.path))
    kind: FindingKind | None = fields.get("kind")
    # Only some kinds may be signalled for; the others are report-only or the reset's.
    why_not = None if kind is None else kinds.KINDS[kind].why_not_signallable
    if kind is not None and why_not is not None and steps:
        steps_node = reader.node("steps")
        assert isinstance(steps_node, Seq)  # noqa: S101 -- steps parsed, so it is a list
        for step, step_node in zip(steps, steps_node.items, strict=True):
            if step.signal is not None:
                problems.append(
                    step_node.error(
                        f"a '{kind.value}' rule cannot send signals: "
                        f"{why_not}; use 'signal: null' to report only",
                        key=join_key(step_node.path, "signal"),
                    )
                )
    return fields


def _step(node: Node, problems: list[ConfigError]) -> dict[str, Any] | None:
    reader = _item(node, "steps[]", problems)
    if reader.map is None:
        return None
    fields = _read_fields(reader, lenient=frozenset({"wait"}))
    if fields.get("signal") is not None and reader.node("wait") is None:
        problems.append(node.error("missing required key 'wait' (how long to wait after it)"))
    return {"wait": 0.0, **fields}


def _hook(node: Node, problems: list[ConfigError]) -> dict[str, Any] | None:
    """A hook: a bare argv list, or a mapping with ``command`` and ``timeout``."""
    if isinstance(node, Map):
        return _read_fields(_Section(node, "hook", problems, node.path))
    try:
        return {"argv": HOOK_COMMAND.read(node)}
    except ConfigError as err:
        problems.extend(err.problems)
        return None


def _monitor(node: Node, problems: list[ConfigError]) -> dict[str, Any] | None:
    """A ``reset.monitors`` entry: exactly one of ``unit`` and ``command``."""
    before = len(problems)
    reader = _item(node, "monitors[]", problems, "expected a mapping with 'unit' or 'command'")
    if reader.map is None:
        return None
    fields = _read_fields(reader)
    unit = fields.get("unit")
    if len(problems) == before and (len(reader.map.entries) != 1 or None in fields.values()):
        problems.append(node.error("a monitor has exactly one of 'unit' and 'command'"))
    elif unit is not None and not UNIT_NAME.fullmatch(unit):
        problems.append(
            reader.map.entries["unit"].error(
                f"expected a systemd service name such as 'gpustat.service', got {shown(unit)}"
            )
        )
    return fields


_ITEM_READERS: dict[str, Callable[[Node, list[ConfigError]], dict[str, Any] | None]] = {
    "rules[]": _rule,
    "steps[]": _step,
    "hook": _hook,
    "monitors[]": _monitor,
}


def parse_policy_documents(docs: Sequence[tuple[str, str]]) -> Policy:
    """The policy from (filename, YAML text) pairs, merged in the order given (the rules:
    ``docs/policy.md``). Pure. ConfigError lists every problem in every document."""
    problems: list[ConfigError] = []
    merged = Map(docs[0][0] if docs else "<none>", 1, "")
    budget = Budget()  # shared: many drop-ins may not add up to what one file may not hold
    for index, (filename, text) in enumerate(docs):
        try:
            document = load_document(filename, text, budget)
        except ConfigError as err:
            problems.extend(err.problems)
            continue
        merged = _merge(merged, document, problems, drop_in=index > 0)
    sources = tuple(name for name, _ in docs)
    policy = Policy(**_read_fields(_Section(merged, "", problems, "")), sources=sources)
    if problems:
        order = {name: index for index, name in enumerate(sources)}
        problems.sort(key=lambda p: (order.get(p.path or "", -1), p.line or 0))
        raise ConfigError.combine(problems)
    if (too_large := _too_large_written_out(policy)) is not None:
        raise ConfigError(too_large, path=sources[0])
    return policy


def _too_large_written_out(policy: Policy) -> str | None:
    """Why ``policy`` written out in full (:func:`render_policy`: ``check-config`` prints it,
    the daemon keeps it as the last accepted policy) would not read back as one file, which
    defaults spelled out make larger than what was read; None when it would."""
    values = _values(policy_data(policy))
    if values > MAX_NODES:
        return (
            f"written out in full, the policy holds {values} YAML values, more than one file "
            f"may ({MAX_NODES}); use fewer rules, hooks or list entries"
        )
    size = len(render_policy(policy)) + _HEADER_ROOM
    if size > MAX_DOCUMENT_BYTES:
        return (
            f"written out in full, the policy is {size} characters, more than one file may "
            f"hold ({MAX_DOCUMENT_BYTES}); use fewer or shorter list entries"
        )
    return None


def _values(data: object) -> int:
    """The YAML values (nodes, keys included) that ``data`` is written as."""
    if isinstance(data, dict):
        return 1 + sum(1 + _values(value) for value in data.values())
    if isinstance(data, list):
        return 1 + sum(_values(value) for value in data)
    return 1


def default_policy() -> Policy:
    """The policy the shipped ``config/gpuwatchd.yaml`` spells out (a test keeps them equal)."""
    return Policy(rules=default_rules())


def load_policy(
    path: str = DEFAULT_CONFIG_PATH,
    *,
    check_permissions: bool | None = None,
    trusted_root: str = "/",
) -> Policy:
    """Read ``path`` and its drop-ins (:func:`gpuwatchd.config.files.read_policy_files`), merge,
    validate, return. A missing main file is a ConfigError ("not found")."""
    return parse_policy_documents(
        read_policy_files(path, check_permissions=check_permissions, trusted_root=trusted_root)
    )


# --- rendering --------------------------------------------------------------------------------


def _render(obj: object, section: Section) -> dict[str, object]:
    data: dict[str, object] = {}
    for key in section.keys:
        if isinstance(key.value, Nested) and key.value.flatten:
            data[key.name] = _render(obj, SECTIONS[key.value.section])
            continue
        assert key.field is not None  # noqa: S101 -- only flattened sections have none
        value = getattr(obj, key.field)
        if isinstance(key.value, Nested):
            nested = SECTIONS[key.value.section]
            many = key.value.many
            data[key.name] = [_render(v, nested) for v in value] if many else _render(value, nested)
        elif (rendered := key.value.render(value)) is not OMIT:
            data[key.name] = rendered
    return data


def policy_data(policy: Policy) -> dict[str, object]:
    """The policy as the plain data :func:`render_policy` writes as YAML (key names as the
    policy file spells them, durations and sizes as text)."""
    return _render(policy, SECTIONS[""])


def render_policy(policy: Policy) -> str:
    """The effective policy as YAML, every key spelled out (``check-config`` prints it); it
    parses back to an equal policy (``sources`` aside, which the header comment lists)."""
    header = "# Effective gpuwatchd policy"
    if policy.sources:
        # A name is one comment line whatever it holds: escaped, a newline in it ends no line.
        header += ", merged from:\n" + "".join(f"#   {escape(s)}\n" for s in policy.sources)
    else:
        header += " (built-in defaults)\n"
    return header + yaml.safe_dump(
        policy_data(policy), sort_keys=False, default_flow_style=None, width=100
    )
