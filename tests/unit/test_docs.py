"""docs/events.md documents exactly the event catalogue (gpuwatchd.core.vocabulary.EventName and
gpuwatchd/events/catalogue.py: names, levels), every logging call names its event through that
catalogue, and no code spells an event name as a string."""

from __future__ import annotations

import ast
import pathlib
import re

from gpuwatchd.core.vocabulary import EventName, Level
from gpuwatchd.events.catalogue import CATALOGUE, MESSAGE_ID_NAMESPACE, message_id

ROOT = pathlib.Path(__file__).resolve().parents[2]
EVENTS_DOC = ROOT / "docs" / "events.md"
LOG_METHODS = {"debug", "info", "warning", "error", "critical", "exception"}
# The simulator's own timeline entries (world.*, sim.*) are documented in docs/simulate.md.
SIMULATION_ONLY = ("world.", "sim.")


def documented_events() -> set[str]:
    """Event names in the first column of docs/events.md's tables."""
    return set(re.findall(r"^\| `([a-z0-9_]+\.[a-z0-9_]+)` \|", EVENTS_DOC.read_text(), re.M))


def test_every_event_in_the_catalogue_is_documented() -> None:
    missing = sorted(str(e) for e in EventName if str(e) not in documented_events())
    assert not missing, f"events missing from docs/events.md: {missing}"


def test_every_documented_event_is_in_the_catalogue() -> None:
    catalogue = {str(e) for e in EventName}
    extra = sorted(n for n in documented_events() - catalogue if not n.startswith(SIMULATION_ONLY))
    assert not extra, f"docs/events.md documents events the code cannot emit: {extra}"


def documented_levels() -> dict[str, str]:
    """Each event's level column in docs/events.md's tables (not the MESSAGE_ID table)."""
    text = EVENTS_DOC.read_text().partition("### MESSAGE_ID per event")[0]
    return dict(re.findall(r"^\| `([a-z0-9_]+\.[a-z0-9_]+)` \| ([^|]*) \|", text, re.M))


def test_each_event_is_documented_at_the_catalogue_s_levels() -> None:
    """The level column starts with the catalogue's usual level, and every other level it
    names (outside a parenthesis or a quoted name) is one the catalogue allows."""
    names = {level.value for level in Level}
    wrong = []
    for event, column in sorted(documented_levels().items()):
        spec = CATALOGUE.get(EventName(event)) if event in {e.value for e in EventName} else None
        if spec is None:
            continue  # the simulator's own: docs/simulate.md
        plain = re.sub(r"\([^)]*\)|`[^`]*`", "", column)
        said = [word for word in re.findall(r"[a-z]+", plain) if word in names]
        allowed = {level.value for level in spec.levels}
        if not said or said[0] != spec.level or not set(said) <= allowed:
            wrong.append(f"{event}: docs say {column!r}; catalogue {spec.level}, {sorted(allowed)}")
    assert not wrong, "\n".join(wrong)


def test_no_string_in_the_code_is_an_event_name() -> None:
    """An event is named by its EventName member, anywhere: not spelled as a string in a
    comparison, a table or a call (only gpuwatchd/core/vocabulary.py says the names)."""
    names = {e.value for e in EventName}
    offenders = []
    for path in sorted((ROOT / "gpuwatchd").rglob("*.py")):
        if path.name == "vocabulary.py" and path.parent.name == "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not offenders, "use gpuwatchd.core.vocabulary.EventName:\n" + "\n".join(offenders)


def _literal_event_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """Logging and emit calls whose event is a string literal instead of an EventName."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = node.func.attr
        owner = node.func.value
        is_log = name in LOG_METHODS and isinstance(owner, ast.Name) and owner.id == "log"
        if not (is_log or name in ("emit", "_emit", "event")):
            continue
        if node.args and isinstance(node.args[0], ast.Constant):
            value = node.args[0].value
            if isinstance(value, str) and re.fullmatch(r"[a-z0-9_]+\.[a-z0-9_]+", value):
                found.append((node.lineno, value))
    return found


def test_events_are_named_through_the_catalogue_not_spelled_again() -> None:
    offenders = []
    for path in sorted((ROOT / "gpuwatchd").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for line, value in _literal_event_calls(tree):
            if not value.startswith(SIMULATION_ONLY):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {value!r}")
    assert not offenders, "use gpuwatchd.core.vocabulary.EventName:\n" + "\n".join(offenders)


def test_the_literal_finder_finds_literals() -> None:
    tree = ast.parse('log.warning("a.b", x=1)\nlog.info(EventName.X)\nself._emit("c.d")\n')
    assert _literal_event_calls(tree) == [(1, "a.b"), (3, "c.d")]


def documented_message_ids() -> dict[str, str]:
    """The rows of docs/events.md's "MESSAGE_ID per event" table: event → id."""
    text = EVENTS_DOC.read_text()
    section = text.partition("### MESSAGE_ID per event")[2]
    rows = re.findall(r"^\| `([a-z0-9_]+\.[a-z0-9_]+)` \| `([0-9a-f]{32})` \|$", section, re.M)
    assert len(rows) == len(dict(rows)), "an event is listed twice"
    return dict(rows)


def test_every_event_has_its_message_id_documented() -> None:
    expected = {str(e): message_id(e) for e in EventName}
    if documented_message_ids() != expected:
        table = "\n".join(f"| `{e}` | `{i}` |" for e, i in sorted(expected.items()))
        raise AssertionError(
            "docs/events.md's MESSAGE_ID table differs from event_catalogue.message_id over "
            f"EventName; the table should read:\n{table}"
        )


def test_the_message_id_namespace_in_the_docs_is_the_code_s() -> None:
    assert str(MESSAGE_ID_NAMESPACE) in EVENTS_DOC.read_text()
