"""GPU health through the real pynvml and the fake NVML: events, fields, errors, bounds.

The worker reads Xid events (consumed once), the recovery action (field 230), row remapping
and retired pages; "not supported" is an answer, any other error is unknown; and nothing a
worker reply carries can become an out-of-range value (``collect/nvml.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

from gpuwatchd.collect.nvml import NvmlClient, to_health
from gpuwatchd.config.schema import default_policy
from gpuwatchd.core.model import Support
from gpuwatchd.daemon.host import build_real_host
from tests.support.fakenvml import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    FakeNvml,
    gpu,
    state,
)

XID = 0x8
RECOVERY = 0x8000


@pytest.fixture
def client(fake_nvml: FakeNvml) -> Iterator[NvmlClient]:
    nvml = NvmlClient(timeout=5.0, env=fake_nvml.env())
    yield nvml
    nvml.stop()


def test_health_fields_are_read_with_their_values(fake_nvml: FakeNvml, client: NvmlClient) -> None:
    fake_nvml.write(
        state(
            [
                gpu(
                    0,
                    recovery_action=4,
                    remapped_rows={"correctable": 2, "uncorrectable": 1, "pending": True},
                ),
                gpu(
                    1, retired_pages={"single_bit": [4096, 8192], "double_bit": [], "pending": True}
                ),
            ]
        )
    )
    reading = client.read()
    first, second = (g.health for g in reading.gpus)
    assert first is not None
    assert second is not None
    assert (first.recovery_support, first.recovery_action) == (Support.OK, 4)
    assert first.remap_support is Support.OK
    assert (first.remap_correctable, first.remap_uncorrectable) == (2, 1)
    assert (first.remap_pending, first.remap_failure) == (True, False)
    assert first.pages_support is Support.NOT_SUPPORTED
    assert first.pages_pending is None
    assert second.recovery_support is Support.NOT_SUPPORTED
    assert second.recovery_action is None
    assert second.remap_support is Support.NOT_SUPPORTED
    assert second.remap_pending is None
    assert (second.pages_pending, second.pages_single_bit, second.pages_double_bit) == (True, 2, 0)
    assert first.events is Support.OK
    assert second.events is Support.OK


def test_xid_events_are_delivered_once_to_their_gpu(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    gpus = [gpu(0), gpu(1)]
    fake_nvml.write(state(gpus))
    assert all(g.health and g.health.xids == () for g in client.read().gpus)
    events = [
        {"id": "a", "gpu": 1, "type": XID, "data": 95},
        {"id": "b", "gpu": 1, "type": XID, "data": 13},
        {"id": "c", "gpu": 0, "type": RECOVERY, "data": 1},
    ]
    fake_nvml.write(state(gpus, events=events))
    before = time.time()
    reading = client.read()
    zero, one = (g.health for g in reading.gpus)
    assert zero is not None
    assert one is not None
    assert zero.xids == ()
    assert [x.xid for x in one.xids] == [95, 13]
    assert all(x.wall >= before for x in one.xids)
    again = client.read()
    assert all(g.health and g.health.xids == () for g in again.gpus), "consumed once"
    # A fresh worker (as after a reset) does not see them again either.
    client.stop()
    assert all(g.health and g.health.xids == () for g in client.read().gpus)


def test_a_gpu_lost_from_the_event_set_does_not_hide_the_other_gpus_xid_events(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    """NVML's wait answers GPU_IS_LOST for a whole set while one GPU in it is lost (Xid 79), and
    again at every wait: the worker makes a new set without that GPU, so its neighbours' Xids
    (48, 94 ...) are still read from the next poll on."""
    gpus = [gpu(0), gpu(1), gpu(2)]
    fake_nvml.write(state(gpus))
    assert all(g.health and g.health.events is Support.OK for g in client.read().gpus)
    gpus[1]["lost"] = True
    fake_nvml.write(state(gpus))
    assert client.read().gpus[1].lost
    events = [
        {"id": "a", "gpu": 0, "type": XID, "data": 48},
        {"id": "b", "gpu": 2, "type": XID, "data": 94},
    ]
    fake_nvml.write(state(gpus, events=events))
    zero, one, two = client.read().gpus
    assert one.lost
    assert zero.health is not None
    assert two.health is not None
    assert ([x.xid for x in zero.health.xids], [x.xid for x in two.health.xids]) == ([48], [94])
    assert (zero.health.events, two.health.events) == (Support.OK, Support.OK)


def test_a_reading_between_polls_hands_every_gpus_xid_events_over(fake_nvml: FakeNvml) -> None:
    """The reset procedure reads its GPU again (its memory after the reset, its NVLink fabric
    each second): the worker's reading takes every GPU's queued events, so the daemon's reader
    hands them all to the engine, which keeps them for its next poll (test_engine's
    test_xid_events_a_reading_of_one_gpu_took_are_the_next_polls); the reader keeps none."""
    gpus = [gpu(0), gpu(1)]
    fake_nvml.write(state(gpus))
    policy = dataclasses.replace(
        default_policy(), devices_dir=str(fake_nvml.devices_dir), namespace_check=False
    )
    host = build_real_host(policy, nvml_env=fake_nvml.env())
    try:
        first = host.reader.collect().nvml.gpus
        assert all(g.health and g.health.xids == () for g in first)
        fake_nvml.write(state(gpus, events=[{"id": "a", "gpu": 1, "type": XID, "data": 48}]))
        zero, one = (g.health for g in host.reader.read_gpus())
        assert zero is not None
        assert one is not None
        assert (zero.xids, [x.xid for x in one.xids]) == ((), [48])
        assert all(g.health and g.health.xids == () for g in host.reader.collect().nvml.gpus)
    finally:
        host.close()


def test_unsupported_events_and_fields_are_not_supported_not_errors(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    fake_nvml.write(
        state(
            [gpu(0, event_types=0)],
            errors={"nvmlDeviceGetFieldValues": NVML_ERROR_FUNCTION_NOT_FOUND},
            events=[{"id": "x", "gpu": 0, "type": XID, "data": 79}],
        )
    )
    reading = client.read()
    (health,) = (g.health for g in reading.gpus)
    assert health is not None
    assert health.events is Support.NOT_SUPPORTED
    assert health.xids == ()
    assert health.recovery_support is Support.NOT_SUPPORTED
    assert reading.gpus[0].error is None


def test_other_errors_make_the_value_unknown_and_are_named(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    fake_nvml.write(
        state(
            [
                gpu(
                    0,
                    recovery_action=1,
                    field_errors={"230": NVML_ERROR_NO_PERMISSION},
                    remapped_rows={"pending": False},
                    errors={"nvmlDeviceGetRemappedRows": NVML_ERROR_NO_PERMISSION},
                )
            ],
            errors={"nvmlDeviceRegisterEvents": NVML_ERROR_NO_PERMISSION},
        )
    )
    reading = client.read()
    info = reading.gpus[0]
    health = info.health
    assert health is not None
    assert health.recovery_support is Support.UNKNOWN
    assert health.recovery_action is None
    assert health.remap_support is Support.UNKNOWN
    assert health.remap_pending is None
    assert health.events is Support.UNKNOWN
    assert info.error is not None
    assert "nvmlDeviceGetRemappedRows" in info.error
    assert "recovery action" in info.error
    assert "nvmlDeviceRegisterEvents" in info.error


def test_per_field_not_supported_is_an_answer(fake_nvml: FakeNvml, client: NvmlClient) -> None:
    fake_nvml.write(
        state([gpu(0, recovery_action=1, field_errors={"230": NVML_ERROR_NOT_SUPPORTED})])
    )
    health = client.read().gpus[0].health
    assert health is not None
    assert health.recovery_support is Support.NOT_SUPPORTED


def test_event_wait_never_holds_up_the_poll(fake_nvml: FakeNvml, client: NvmlClient) -> None:
    fake_nvml.write(state([gpu(i) for i in range(8)]))
    client.read()
    started = time.monotonic()
    client.read()
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    ("raw", "field", "expected"),
    [
        (
            {"recovery_action": {"status": "ok", "value": 2**40}},
            "recovery_support",
            Support.UNKNOWN,
        ),
        ({"recovery_action": {"status": "ok", "value": -1}}, "recovery_action", None),
        ({"recovery_action": {"status": "ok", "value": True}}, "recovery_action", None),
        ({"recovery_action": {"status": "weird", "value": 1}}, "recovery_support", Support.UNKNOWN),
        (
            {"remapped_rows": {"status": "ok", "pending": 1, "failure": False}},
            "remap_pending",
            None,
        ),
        (
            {
                "remapped_rows": {
                    "status": "ok",
                    "pending": True,
                    "failure": False,
                    "correctable": 2**33,
                }
            },
            "remap_correctable",
            None,
        ),
        ({"retired_pages": {"status": "ok", "pending": "yes"}}, "pages_support", Support.UNKNOWN),
        ({"xids": [{"xid": 2**20, "wall": 1.0}, {"xid": 79, "wall": float("nan")}]}, "xids", ()),
        ({"xids": "95"}, "xids", ()),
        ({"fabric": {"status": "ok", "state": 7}}, "fabric_support", Support.UNKNOWN),
        (
            {"fabric": {"status": "ok", "state": 3, "health_mask": 2**40}},
            "fabric_health_mask",
            None,
        ),
        (
            {"fabric": {"status": "ok", "state": 3, "health_summary": -1}},
            "fabric_health_summary",
            None,
        ),
        ({"fabric": {"status": "not_supported", "state": 3}}, "fabric_state", None),
        ({"fabric": "COMPLETED"}, "fabric_support", Support.UNKNOWN),
        ({"events": None}, "events", Support.UNKNOWN),
    ],
)
def test_hostile_worker_values_become_unknown(
    raw: dict[str, object], field: str, expected: object
) -> None:
    health = to_health(raw)
    assert health is not None
    assert getattr(health, field) == expected


def test_xids_are_capped_per_poll() -> None:
    health = to_health({"xids": [{"xid": 13, "wall": 1.0}] * 10_000})
    assert health is not None
    assert len(health.xids) == 256


def test_missing_health_entry_is_none() -> None:
    assert to_health(None) is None
    assert to_health([1, 2]) is None


def test_the_fabric_is_read_through_the_v3_struct_and_v2_on_older_drivers(
    fake_nvml: FakeNvml, client: NvmlClient
) -> None:
    mask = 2 | (1 << 8) | (1 << 12)
    fake_nvml.write(
        state(
            [
                gpu(0, fabric={"state": 2, "status": 0, "health_mask": mask, "health_summary": 1}),
                gpu(1, fabric={"state": 3, "status": 5, "health_mask": 4, "max_version": 2}),
                gpu(2),
            ]
        )
    )
    first, older, pcie = (g.health for g in client.read().gpus)
    assert first is not None
    assert older is not None
    assert pcie is not None
    assert (first.fabric_support, first.fabric_state, first.fabric_status) == (Support.OK, 2, 0)
    assert (first.fabric_health_mask, first.fabric_health_summary) == (mask, 1)
    # Struct v3 refused with a version mismatch: v2, which has no summary.
    assert (older.fabric_support, older.fabric_state, older.fabric_status) == (Support.OK, 3, 5)
    assert (older.fabric_health_mask, older.fabric_health_summary) == (4, None)
    # No NVSwitch fabric: an answer, not an error.
    assert pcie.fabric_support is Support.NOT_SUPPORTED
    assert pcie.fabric_state is None


@pytest.mark.parametrize(
    ("code", "support"),
    [(NVML_ERROR_FUNCTION_NOT_FOUND, Support.NOT_SUPPORTED), (NVML_ERROR_NO_PERMISSION,
     Support.UNKNOWN)],
)  # fmt: skip
def test_a_driver_without_the_fabric_call_or_an_error_is_not_a_fabric_state(
    fake_nvml: FakeNvml, client: NvmlClient, code: int, support: Support
) -> None:
    fake_nvml.write(
        state([gpu(0, fabric={"state": 3})], errors={"nvmlDeviceGetGpuFabricInfoV": code})
    )
    info = client.read().gpus[0]
    assert info.health is not None
    assert info.health.fabric_support is support
    assert info.health.fabric_state is None
    if support is Support.UNKNOWN:
        assert info.error is not None
        assert "nvmlDeviceGetGpuFabricInfoV" in info.error
