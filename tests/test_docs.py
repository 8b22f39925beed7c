"""docs/events.md documents every event name the code logs."""

from __future__ import annotations

import pathlib
import re

from gpuwatchd.decide.plan import EVENT_NAMES

ROOT = pathlib.Path(__file__).resolve().parent.parent
# log.warning("name", ...), getattr(log, level)("name", ...), env.emit("name", ...), and the
# conditional form log.warning("a.b" if x else "c.d", ...), across line breaks.
CALL = re.compile(
    r"(?:\blog\.(?:debug|info|warning|error|critical|exception)|getattr\(log,[^)]*\)|\.emit|\b_emit)"
    r"\(\s*\"([a-z0-9_]+\.[a-z0-9_]+)\"(?:\s+if\s+[^\"]+\s+else\s+\"([a-z0-9_]+\.[a-z0-9_]+)\")?"
)
# Modules that emit no journal events of their own: the simulator only mirrors the daemon's.
SKIP = {"simulate.py", "timeline.py"}


def emitted_names() -> set[str]:
    names = set(EVENT_NAMES)
    for path in (ROOT / "gpuwatchd").rglob("*.py"):
        if path.name in SKIP:
            continue
        for match in CALL.finditer(path.read_text()):
            names.update(n for n in match.groups() if n)
    return names


def test_the_extractor_finds_events_from_several_modules() -> None:
    names = emitted_names()
    assert {"action.signal", "finding.new", "reset.step", "daemon.resumed"} <= names


def test_every_emitted_event_is_documented() -> None:
    documented = set(
        re.findall(r"`([a-z0-9_]+\.[a-z0-9_]+)`", (ROOT / "docs" / "events.md").read_text())
    )
    missing = sorted(emitted_names() - documented)
    assert not missing, f"events missing from docs/events.md: {missing}"
