"""NVIDIA's Xid catalogue as data: one entry per Xid, each bucket mapped to one daemon action,
and docs/findings.md's table generated from the data (the page and the data cannot differ)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gpuwatchd.decide.health.xid_catalogue import (
    CATALOGUE_SOURCE,
    XID_CATALOGUE,
    Bucket,
    XidAction,
    parse_catalogue,
    render_markdown,
    xid_action,
)

FINDINGS = Path(__file__).resolve().parents[2] / "docs" / "findings.md"
# Every entry as the catalogue written as Python tuples gave it (generated once from that code):
# xid, mnemonic, name, immediate, investigatory, memory, read_directly, action.
OLD_ENTRIES = Path(__file__).resolve().parents[1] / "golden" / "xid-catalogue.json"

# What each bucket leads to (docs/findings.md#xid-table), written out independently of the
# module's own mapping.
EXPECTED = {
    Bucket.RESET_GPU: XidAction.RESET,
    Bucket.WORKFLOW_XID_48: XidAction.RESET,
    Bucket.WORKFLOW_NVLINK_ERR: XidAction.RESET,
    Bucket.RESTART_BM: XidAction.REBOOT,
    Bucket.RESTART_VM: XidAction.REBOOT,
    Bucket.XID_154: XidAction.RECOVERY_ACTION,
    Bucket.WORKFLOW_XID_45: XidAction.FABRIC_MANAGER,
    Bucket.RESTART_APP: XidAction.RESTART_APP,
    Bucket.IGNORE: XidAction.IGNORE,
    Bucket.CONTACT_SUPPORT: XidAction.REPORT,
    Bucket.CHECK_MECHANICALS: XidAction.REPORT,
    Bucket.UPDATE_SWFW: XidAction.REPORT,
    Bucket.CHECK_UVM: XidAction.REPORT,
    Bucket.WORKFLOW_NVLINK5_ERR: XidAction.REPORT,
    Bucket.NONE: XidAction.REPORT,
}

# The reset bucket as the catalogue lists it (issue: drivers without the recovery action
# acted only on 64, 95, 119, 120 and 79); 48 is its own workflow, 74 NVLink's.
RESET_CLASS = {46, 48, 62, 64, 74, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156, 158}


def test_the_catalogue_has_one_entry_per_xid_from_1_to_172() -> None:
    assert sorted(XID_CATALOGUE) == list(range(1, 173))
    assert all(entry.xid == xid for xid, entry in XID_CATALOGUE.items())
    assert len({e.mnemonic for e in XID_CATALOGUE.values()}) == len(XID_CATALOGUE)


@pytest.mark.parametrize("xid", sorted(XID_CATALOGUE))
def test_every_entry_maps_its_bucket_to_one_action(xid: int) -> None:
    entry = XID_CATALOGUE[xid]
    assert xid_action(xid) is EXPECTED[entry.immediate]
    assert entry.mnemonic
    assert entry.name
    # An "Unused" Xid has no operator remedy: never more than a report.
    if entry.name == "Unused":
        assert xid_action(xid) in (XidAction.REPORT, XidAction.IGNORE)


def test_the_reset_and_reboot_classes_are_the_catalogues() -> None:
    assert {x for x in XID_CATALOGUE if xid_action(x) is XidAction.RESET} == RESET_CLASS
    assert {x for x in XID_CATALOGUE if xid_action(x) is XidAction.REBOOT} == {79, 151}
    assert xid_action(154) is XidAction.RECOVERY_ACTION
    assert xid_action(45) is XidAction.FABRIC_MANAGER
    assert xid_action(94) is XidAction.RESTART_APP  # contained: the application restarts
    assert xid_action(63) is XidAction.IGNORE  # a remap recorded: reset when idle, not now


def test_an_xid_the_catalogue_lacks_is_only_reported() -> None:
    for xid in (0, 173, 999, 65535):
        assert xid_action(xid) is XidAction.REPORT


def test_buckets_the_catalogue_leaves_blank_say_so() -> None:
    blank = {x for x, e in XID_CATALOGUE.items() if e.immediate is Bucket.NONE}
    assert blank == set(range(162, 173))
    assert str(Bucket.NONE) == "(none given)"
    for xid in blank:
        assert "*none given*" in render_markdown().splitlines()[xid + 1]


def test_findings_md_carries_the_generated_table_and_cites_every_row() -> None:
    page = FINDINGS.read_text()
    table = render_markdown()
    assert table in page, (
        "regenerate the table: python -c 'from gpuwatchd.decide.health.xid_catalogue import "
        'render_markdown as r; print(r(), end="")\''
    )
    rows = list(table.splitlines()[2:])
    assert len(rows) == len(XID_CATALOGUE)
    for line in rows:
        assert re.search(r"\| \[C\]\*?( \[M\])? \|$", line), line
    # The sources the rows cite are spelled out on the page.
    assert CATALOGUE_SOURCE in page
    assert "a100-gpu-mem-error-mgmt" in page
    memory = {x for x, e in XID_CATALOGUE.items() if e.memory}
    assert {48, 63, 64, 94, 95} <= memory


def test_the_table_gives_every_answer_the_old_catalogue_gave() -> None:
    old = json.loads(OLD_ENTRIES.read_text())
    assert [row[0] for row in old] == sorted(XID_CATALOGUE)
    for xid, mnemonic, name, immediate, investigatory, memory, read_directly, action in old:
        entry = XID_CATALOGUE[xid]
        got = (entry.mnemonic, entry.name, entry.immediate.value, entry.investigatory)
        assert got == (mnemonic, name, immediate, investigatory), xid
        assert (entry.memory, entry.read_directly, xid_action(xid).value) == (
            memory,
            read_directly,
            action,
        ), xid


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ("1 A | Unused | CONTACT_SUPPORT\n1 B | Unused", "row 2: the Xid is not a number above"),
        ("2 A | Unused\n1 B | Unused", "row 2: the Xid is not a number above"),
        ("x A | Unused", "row 1: the Xid is not a number"),
        ("1 a_lower | Unused", "row 1: want: xid MNEMONIC"),
        ("1 A B | Unused", "row 1: want: xid MNEMONIC"),
        ("1 A", "row 1: want: xid MNEMONIC"),
        ("1 A |  | IGNORE", "row 1: want: xid MNEMONIC"),
        ("1 A | Unused | IGNORE | x | y", "row 1: want: xid MNEMONIC"),
        ("1 A | Unused | REBOOT_NOW", "row 1: unknown bucket 'REBOOT_NOW'"),
    ],
)
def test_a_malformed_row_is_refused_by_its_number(table: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"Xid table {problem}")):
        parse_catalogue(table)


def test_a_well_formed_table_parses_with_blank_buckets_left_off() -> None:
    entries = parse_catalogue("\n7 SOME_XID | A name\n48 ECC | Double | WORKFLOW_XID_48 | x y\n")
    assert entries[7].immediate is Bucket.NONE
    assert entries[7].investigatory == ""
    assert (entries[48].memory, entries[48].read_directly, entries[7].read_directly) == (
        True,
        False,
        True,
    )
    assert entries[48].investigatory == "x y"
