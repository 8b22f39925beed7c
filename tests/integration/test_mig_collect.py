"""MIG collection: the mig-minors file, capability files in the holder scan, the collector.

The mig-minors parser is checked line by line against what the driver writes and what it
never writes; the holder scan runs over real child processes of this test that hold stand-in
capability files (path mode), the procfs form, or a real character device whose major is
given as nvidia-caps' (device-number mode).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.collect.collector import Collector
from gpuwatchd.collect.holders import DeviceFiles, HolderScanner, match_device_name
from gpuwatchd.collect.mig import (
    MigMinorsError,
    match_cap_file,
    parse_mig_minors,
    read_mig_minors,
)
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.model import MigCapability
from tests.support.children import Spawn, hold
from tests.support.collecting import fake_collector
from tests.support.fakenvml import (
    FakeNvml,
    cap_minor,
    gpu,
    mig_device,
    mig_minors_text,
    state,
)

# --- the mig-minors file ----------------------------------------------------------------------


def test_the_driver_numbering_parses_to_capabilities_and_skips_the_others() -> None:
    table = parse_mig_minors(mig_minors_text([0, 1]), "f")
    assert table[12] == MigCapability(0, 1)
    assert table[13] == MigCapability(0, 1, 0)
    assert table[cap_minor(1, 2, 3)] == MigCapability(1, 2, 3)
    assert 1 not in table  # config
    assert 2 not in table  # monitor
    assert len(table) == 2 * 15 * 9


@pytest.mark.parametrize(
    ("text", "fragment"),
    {
        "gpu0/gi1/access twelve\n": "line 1",
        "config 1\ngpu0/gi1/access 12 extra\n": "line 2",
        "gpu0/gi1/access 12\ngpu0/gi2/access 12\n": "names a minor or capability twice",
        "gpu0/gi1/access 12\ngpu0/gi1/access 13\n": "names a minor or capability twice",
        "gpu999/gi1/access 12\n": "out of range",
        "gpu0/gi1/access 9999999\n": "out of range",
        "gpu0/gi1/ci0/access\t13\n": "line 1",
        "\x1b[31m 5\n": "line 1",
    }.items(),
)
def test_a_malformed_table_is_refused_naming_the_file_and_line(text: str, fragment: str) -> None:
    with pytest.raises(MigMinorsError) as caught:
        parse_mig_minors(text, "mig_minors_file /m")
    assert str(caught.value).startswith("mig_minors_file /m")
    assert fragment in str(caught.value)


def test_reading_the_file_says_why_it_could_not(tmp_path: Path) -> None:
    good = tmp_path / "mig-minors"
    good.write_text(mig_minors_text([0]))
    table, error = read_mig_minors(str(good))
    assert error is None
    assert table is not None
    assert table[12] == MigCapability(0, 1)

    table, error = read_mig_minors(str(tmp_path / "missing"))
    assert table is None
    assert error == f"mig_minors_file {tmp_path / 'missing'}: No such file or directory"

    link = tmp_path / "link"
    link.symlink_to(good)
    table, error = read_mig_minors(str(link))
    assert table is None
    assert error is not None

    binary = tmp_path / "binary"
    binary.write_bytes(b"gpu0/gi1/access 12\n\xff\n")
    assert read_mig_minors(str(binary)) == (None, f"mig_minors_file {binary}: not ASCII text")

    bad = tmp_path / "bad"
    bad.write_text("gpu0/gi1/access 12\nnonsense here\n")
    table, error = read_mig_minors(str(bad))
    assert table is None
    assert error is not None
    assert "line 2" in error


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/proc/driver/nvidia/capabilities/gpu0/mig/gi1/access", MigCapability(0, 1)),
        ("/proc/driver/nvidia/capabilities/gpu3/mig/gi2/ci1/access", MigCapability(3, 2, 1)),
        ("/proc/driver/nvidia/capabilities/mig/config", None),
        ("/tmp/driver/nvidia/capabilities/gpu0/mig/gi1/access", None),
        ("/proc/driver/nvidia/capabilities/gpu0/mig/gi1/access/../x", None),
        ("/proc/driver/nvidia/capabilities/gpu0/mig/gi1/ci0/access (deleted)", None),
    ],
)
def test_procfs_capability_files_are_recognised_only_where_the_driver_puts_them(
    path: str, expected: MigCapability | None
) -> None:
    assert match_cap_file(path) == expected


def test_capability_device_names_stand_for_their_minor() -> None:
    assert match_device_name("nvidia-caps/nvidia-cap12") == ("cap", 12)
    assert match_device_name("nvidia-cap12") == ("cap", 12)
    assert match_device_name("nvidia-caps") is None


# --- the holder scan --------------------------------------------------------------------------


def test_path_mode_finds_capability_files_beside_the_parent_node(
    spawn: Spawn, tmp_path: Path
) -> None:
    caps = tmp_path / "nvidia-caps"
    caps.mkdir()
    for name in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-caps/nvidia-cap12",
                 "nvidia-caps/nvidia-cap13"):  # fmt: skip
        (tmp_path / name).touch()
    child = spawn(hold([str(tmp_path / n) for n in
                        ("nvidia0", "nvidia-uvm", "nvidia-caps/nvidia-cap12",
                         "nvidia-caps/nvidia-cap13")]))  # fmt: skip
    parent_only = spawn(hold([str(tmp_path / "nvidia0"), str(tmp_path / "nvidia-uvm")]))
    scanner = ProcFS(devices_dir=str(tmp_path)).holders

    scan = scanner.scan([child.pid, parent_only.pid])

    holding = scan.holdings[child.pid]
    assert holding.gpu_minors_fd == {0}
    assert holding.cap_minors_fd == {12, 13}
    assert holding.uvm
    assert scan.holdings[parent_only.pid].cap_minors_fd == frozenset()
    assert scan.holdings[parent_only.pid].gpu_minors_fd == {0}


def test_the_procfs_capability_form_is_found_in_the_fd_table(spawn: Spawn, tmp_path: Path) -> None:
    where = tmp_path / "driver" / "nvidia" / "capabilities" / "gpu0" / "mig" / "gi2" / "ci0"
    where.mkdir(parents=True)
    (where / "access").touch()
    (where.parent / "access").touch()
    decoy = tmp_path / "elsewhere" / "gpu0" / "mig" / "gi1"
    decoy.mkdir(parents=True)
    (decoy / "access").touch()
    child = spawn(
        hold([str(where / "access"), str(where.parent / "access"), str(decoy / "access")])
    )
    scanner = ProcFS(devices_dir=str(tmp_path)).holders

    holding = scanner.scan([child.pid]).holdings[child.pid]

    assert holding.cap_files == {MigCapability(0, 2, 0), MigCapability(0, 2)}
    assert holding.gpu_minors == frozenset()


def test_device_number_mode_knows_capabilities_by_the_nvidia_caps_major(
    spawn: Spawn, tmp_path: Path
) -> None:
    """/dev/ptmx is 5:2: with 5 as nvidia-caps' major it stands for nvidia-cap2."""
    if not os.path.exists("/dev/ptmx"):
        pytest.skip("no /dev/ptmx here")
    child = spawn(hold(["/dev/null", "/dev/ptmx"]))
    procfs = ProcFS()
    devices = DeviceFiles(
        procfs, devices_dir=str(tmp_path), match_by_path=False, device_major=1, caps_major=5
    )
    scanner = HolderScanner(procfs, devices)
    holding = scanner.scan([child.pid]).holdings[child.pid]
    assert holding.gpu_minors_fd == {3}
    assert holding.cap_minors_fd == {2}


# --- the collector ----------------------------------------------------------------------------


@pytest.fixture
def collector_for(fake_nvml: FakeNvml, tmp_path: Path) -> Iterator[tuple[Collector, Path]]:
    minors = tmp_path / "mig-minors"
    with fake_collector(fake_nvml, mig_minors_file=str(minors)) as collector:
        yield collector, minors


def test_the_collector_reads_the_table_only_when_a_gpu_has_mig_on(
    fake_nvml: FakeNvml, collector_for: tuple[Collector, Path]
) -> None:
    collector, minors = collector_for
    fake_nvml.write(state([gpu(0)]))
    plain = collector.collect()
    assert (plain.mig_caps, plain.mig_caps_error) == (None, None)

    fake_nvml.write(state([gpu(0, mig_mode=1, mig_devices=[mig_device(1)])]))
    missing = collector.collect()
    assert missing.mig_caps is None
    assert missing.mig_caps_error == f"mig_minors_file {minors}: No such file or directory"

    minors.write_text(mig_minors_text([0]))
    found = collector.collect()
    assert found.mig_caps_error is None
    assert found.mig_caps is not None
    assert found.mig_caps[cap_minor(0, 1, 0)] == MigCapability(0, 1, 0)
    (mig_gpu,) = found.nvml.gpus
    assert mig_gpu.mig_devices is not None
    assert [d.gi for d in mig_gpu.mig_devices] == [1]
