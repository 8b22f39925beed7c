"""PCI bus ids are read and compared one way (gpuwatchd/decide/gpu_ids.py), wherever an admin
names a GPU by one: protect.gpus, check-clean --gpu, the policy reader."""

from __future__ import annotations

import pytest

from gpuwatchd.config.keys import normalize_gpu_id
from gpuwatchd.decide.gpu_ids import (
    nvml_bus_id,
    pci_bus_key,
    pci_device,
    same_pci_bus_id,
    slurm_numbering,
)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("00000000:3B:00.0", (0, 0x3B, 0, 0)),
        ("0000:3b:00.0", (0, 0x3B, 0, 0)),
        ("3b:00.0", (0, 0x3B, 0, 0)),
        (" 0001:17:1f.7 ", (1, 0x17, 0x1F, 7)),
        ("0010:3b:00.0", (0x10, 0x3B, 0, 0)),  # a domain read in base 16, not 10 or 17
        ("0000:3b:00.8", None),  # functions are 0..7
        ("3b:00", None),
        ("GPU-1", None),
        ("", None),
        ("000000000:3b:00.0", None),  # a domain of 9 digits
    ],
)
def test_a_bus_id_is_read_however_it_is_spelled(text: str, key: tuple[int, ...] | None) -> None:
    assert pci_bus_key(text) == key


@pytest.mark.parametrize(
    ("bus_id", "kernel_log", "device"),
    [
        ("00000000:3B:00.0", False, (0, 0x3B, 0)),  # NVML's
        ("00000000:3B:00.1", False, (0, 0x3B, 0)),  # another function of the same device
        ("0000:3b:00", True, (0, 0x3B, 0)),  # the kernel log's names no function
        ("0001:17:1F", True, (1, 0x17, 0x1F)),
        (" 0000:3b:00", True, (0, 0x3B, 0)),  # read as pci_bus_key reads it
        ("0000:3b:00 ", True, None),
        ("0000:3b:00.0", True, None),  # the kernel log's form has no function
        ("0000:3b:00", False, None),  # nor has NVML's none
        ("", False, None),
        ("", True, None),
        (None, False, None),
        (None, True, None),
        ("GPU-1", False, None),
        ("0000:3b:00.0\n", True, None),
        ("000000000:3b:00", True, None),  # a domain of 9 digits
    ],
)
def test_a_gpu_is_its_bus_ids_domain_bus_and_device_in_either_log(
    bus_id: str | None, kernel_log: bool, device: tuple[int, int, int] | None
) -> None:
    """NVML's bus id and the kernel log's name one GPU by the same domain, bus and device
    (engine/edges.py's TakenXids and decide/health/judge.py match the kernel log's Xids so)."""
    assert pci_device(bus_id, kernel_log=kernel_log) == device


def test_two_spellings_of_one_function_are_the_same_and_text_is_never_a_bus_id() -> None:
    assert same_pci_bus_id("0000:3b:00.0", "00000000:3B:00.0")
    assert same_pci_bus_id("3b:00.0", "00000000:3B:00.0")
    assert not same_pci_bus_id("0000:3b:00.0", "0000:3b:00.1")
    assert not same_pci_bus_id("0001:3b:00.0", "0000:3b:00.0")
    assert not same_pci_bus_id("weird", "weird")  # names nothing, not even itself


def test_the_policy_spells_a_bus_id_as_nvml_does() -> None:
    assert nvml_bus_id((0, 0x3B, 0, 0)) == "00000000:3B:00.0"
    assert normalize_gpu_id("0000:3b:00.0") == "00000000:3B:00.0"
    assert normalize_gpu_id("3B:1f.7") == "00000000:3B:1F.7"
    with pytest.raises(ValueError, match="neither a GPU UUID"):
        normalize_gpu_id("3b:00")


# --- how Slurm numbers GPUs (docs/operations.md, "Which GPUs are the job's") ---------------

# (NVML index, device minor): minors not in NVML's order, as on hosts where the driver's
# /dev/nvidiaN numbering and the PCI bus order differ.
CROSSED = [(0, 2), (1, 0), (2, 3), (3, 1)]


def test_slurm_numbers_gpus_by_device_file_or_in_nvmls_order() -> None:
    """`files`: Slurm's id k is the GPU of the k-th device file (/dev/nvidia0 first), as
    gres.conf's File=/dev/nvidia[0-3] numbers them; `nvml`: NVML's own order (AutoDetect=nvml)."""
    assert slurm_numbering(CROSSED, "files") == [1, 3, 0, 2]
    assert slurm_numbering(CROSSED, "nvml") == [0, 1, 2, 3]
    assert slurm_numbering([(0, 0), (1, 1)], "files") == slurm_numbering([(0, 0), (1, 1)], "nvml")
    # Two GPUs reported with one minor (a driver in trouble): NVML's order breaks the tie.
    assert slurm_numbering([(1, 0), (0, 0), (2, 1)], "files") == [0, 1, 2]


def test_an_unknown_minor_makes_the_file_order_unknown_not_a_guess() -> None:
    assert slurm_numbering([(0, 0), (1, None)], "files") is None
    assert slurm_numbering([(0, 0), (1, None)], "nvml") == [0, 1]
    with pytest.raises(ValueError, match="expected one of files, nvml"):
        slurm_numbering(CROSSED, "cuda")
