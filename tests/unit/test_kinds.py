"""The finding kinds' table (decide/kinds.py): one row per kind, documented, and the one
source of what verdict, health, the policy schema and the planner ask about a kind."""

from __future__ import annotations

import pathlib
import re

import pytest

from gpuwatchd.config.schema import parse_policy_documents
from gpuwatchd.config.yamlsrc import ConfigError
from gpuwatchd.core.model import FindingKind
from gpuwatchd.decide import kinds, verdict
from gpuwatchd.decide.health import judge as health
from gpuwatchd.decide.plan import resets as plan_resets

FINDINGS_DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "findings.md"
SIGNALLABLE = {k for k, row in kinds.KINDS.items() if row.why_not_signallable is None}


def _anchor(row: kinds.KindProperties) -> str:
    """A kind's section in docs/findings.md (the health kinds share "GPU health")."""
    if row.health:
        return "gpu-health"
    return f"{row.kind.value}-gpu-level" if row.scope is kinds.Scope.GPU else row.kind.value


def _anchors(markdown: str) -> set[str]:
    """The anchors a Markdown renderer gives the headings: lower case, punctuation dropped
    (but ``-`` and ``_``), spaces as ``-``."""
    out = set()
    for line in markdown.splitlines():
        match = re.match(r"#+\s+(.*)", line)
        if match:
            title = re.sub(r"[^\w\- ]", "", match.group(1).lower())
            out.add(title.replace(" ", "-"))
    return out


def test_every_kind_has_a_row_with_words() -> None:
    assert set(kinds.KINDS) == set(FindingKind)
    for kind, row in kinds.KINDS.items():
        assert row.kind is kind
        assert row.words
        assert row.words == kinds.words(kind.value)
    assert kinds.words("no_such_kind") is None


def test_docs_findings_has_a_section_for_every_kind() -> None:
    text = FINDINGS_DOC.read_text()
    anchors = _anchors(text)
    for kind, row in kinds.KINDS.items():
        assert _anchor(row) in anchors, f"docs/findings.md has no section #{_anchor(row)} ({kind})"
        assert f"`{kind.value}`" in text


def test_the_properties_are_consistent() -> None:
    for row in kinds.KINDS.values():
        if row.holds_device or row.listing or row.live_holder:
            assert row.scope is kinds.Scope.PROCESS
        if row.memory or row.health:
            assert row.scope is kinds.Scope.GPU
            assert row.why_not_signallable is not None
    # A rule may signal for orphaned and abandoned processes, and for nothing else.
    assert {FindingKind.ORPHANED, FindingKind.ABANDONED} == SIGNALLABLE


def test_the_modules_ask_the_table() -> None:
    """verdict, health and plan's reset gates hold the table's sets, not their own."""
    assert {k.value for k in kinds.SETTLING} <= verdict.SETTLING
    tables = [value for value in vars(kinds).values() if isinstance(value, frozenset)]
    for module in (verdict, plan_resets, health):
        held = [
            value
            for value in vars(module).values()
            if isinstance(value, frozenset)
            and value
            and all(isinstance(k, FindingKind) for k in value)
        ]
        assert all(any(value is table for table in tables) for value in held), module.__name__


@pytest.mark.parametrize("kind", sorted(set(FindingKind) - SIGNALLABLE))
def test_a_rule_that_signals_a_kind_that_cannot_be_signalled_is_refused_with_the_tables_reason(
    kind: FindingKind,
) -> None:
    step = "      - signal: SIGTERM\n        wait: 30s\n"
    doc = f"rules:\n  - name: r\n    kind: {kind.value}\n    steps:\n{step}"
    with pytest.raises(ConfigError) as caught:
        parse_policy_documents([("p.yaml", doc)])
    why = kinds.KINDS[kind].why_not_signallable
    assert why is not None
    assert why in str(caught.value)
