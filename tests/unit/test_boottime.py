"""The boot clock's arithmetic (gpuwatchd/collect/boottime.py): which boot a stamp is of,
and how long it has left, whatever the wall clock did."""

from __future__ import annotations

import math

import pytest

from gpuwatchd.collect.boottime import BootTime

NOW = 1_800_000_000.0
GIVEN = BootTime(NOW, 1000.0, "b1").stamp(3600.0)  # an hour, given 1000 s into boot b1


@pytest.mark.parametrize(
    ("clock", "same", "left"),
    [
        (BootTime(NOW + 10, 1010.0, "b1"), True, 3590.0),
        (BootTime(NOW + 10 - 120, 1010.0, "b1"), True, 3590.0),  # wall stepped back
        (BootTime(NOW + 10 + 7200, 1010.0, "b1"), True, 3590.0),  # wall stepped forward
        (BootTime(NOW + 10 + 7200, None, "b1"), True, 3600.0 - 7210),  # no boot clock: wall
        # Another boot id, begun after the stamp by the wall clock: another boot; wall end.
        (BootTime(NOW + 3000, 50.0, "b2"), False, 600.0),
        # Another boot id, but this boot began before the stamp: a container's other view.
        (BootTime(NOW + 10, 1010.0, "service-view"), True, 3590.0),
        (BootTime(NOW + 10, 1010.0, None), True, 3590.0),  # the boot id unreadable: the same
    ],
)
def test_a_stamp_lasts_on_the_boot_clock_of_its_own_boot(
    clock: BootTime, same: bool, left: float
) -> None:
    assert clock.same_boot(GIVEN) is same
    assert clock.left(GIVEN) == pytest.approx(left)


@pytest.mark.parametrize(
    ("data", "left"),
    [
        ({"since": NOW, "until": NOW + 60}, 50.0),  # a file from before the boot clock
        ({"since": NOW, "until": NOW + 60, "until_boot": math.inf, "boot_id": "b1"}, 50.0),
        ({"since": NOW, "until": NOW + 60, "until_boot": True, "boot_id": "b1"}, 50.0),
        ({"since": NOW, "until": "soon"}, None),
        ({}, None),
    ],
)
def test_a_stamp_without_a_valid_boot_clock_end_falls_back_to_its_wall_end(
    data: dict[str, object], left: float | None
) -> None:
    assert BootTime(NOW + 10, 1010.0, "b1").left(data) == left


def test_a_stamp_names_both_clocks_and_the_boot() -> None:
    assert GIVEN == {
        "since": NOW,
        "until": NOW + 3600,
        "boot_id": "b1",
        "since_boot": 1000.0,
        "until_boot": 4600.0,
    }
    assert BootTime(NOW, 1000.0, "b1").booted_at == NOW - 1000
    assert BootTime(NOW, None, "b1").booted_at is None
    read = BootTime.read(NOW, "b1")
    assert read.seconds is not None
    assert read.seconds > 0
