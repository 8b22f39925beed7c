"""GPU health as NVIDIA documents it, pure (decide/health/judge.py, decide/health/fabric.py): every
recovery
action value, the solo rules (48, 45) over a window of co-occurring Xids, an NVLink peer's
Xid 74 after our own reset, the stricter peer options, the NVLink fabric, the health check
after a reset, and a dry run's assumed reset."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gpuwatchd.core.model import Finding, FindingKind, GpuHealth, Support, XidEvent
from gpuwatchd.decide.health import fabric
from gpuwatchd.decide.health.judge import (
    PEER_XID_WINDOW,
    XID_WINDOW,
    assess_health,
    drop_assumed,
    note_reset,
)
from gpuwatchd.decide.health.state import HealthState
from gpuwatchd.decide.policy import HealthPolicy
from tests.support.healthcases import GPU0, GPU1, gpu, health, snap

T0 = 1_700_000_000.0  # snap()'s wall time at t=0
WALL = T0 + 1000.0  # snap()'s default wall time


def judge(
    h: GpuHealth,
    state: HealthState | None = None,
    *,
    t: float = 1000.0,
    pol: HealthPolicy | None = None,
) -> tuple[list[Finding], HealthState]:
    result = assess_health(
        snap(gpu(0, GPU0, h), t=t), state or HealthState(), boot_changed=False, policy=pol
    )
    return list(result.findings), result.state


def kinds_of(findings: list[Finding]) -> list[FindingKind]:
    return [f.kind for f in findings]


def xids(*pairs: tuple[int, float]) -> tuple[XidEvent, ...]:
    return tuple(XidEvent(x, WALL + dt) for x, dt in pairs)


# --- the recovery action: every value ---------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "support", "kind", "actionable", "says"),
    [
        (0, Support.OK, None, None, None),
        (1, Support.OK, FindingKind.RESET_REQUIRED, True, "GPU_RESET (1)"),
        (2, Support.OK, FindingKind.REBOOT_REQUIRED, True, "NODE_REBOOT (2)"),
        (3, Support.OK, FindingKind.DRAIN_REQUIRED, True, "read the field again"),
        (4, Support.OK, FindingKind.RESET_REQUIRED, True, "DRAIN_AND_RESET (4)"),
        (5, Support.OK, FindingKind.DRAIN_REQUIRED, True, "RECOVER_IMEX_DOMAIN (5)"),
        (6, Support.OK, FindingKind.REBOOT_REQUIRED, True, "BUS_RESET (6)"),
        (7, Support.OK, FindingKind.REBOOT_REQUIRED, True, "SYSTEM_REBOOT (7)"),
        (8, Support.OK, FindingKind.DRAIN_REQUIRED, False, "unknown (8)"),
        (255, Support.OK, FindingKind.DRAIN_REQUIRED, False, "unknown (255)"),
        (None, Support.NOT_SUPPORTED, None, None, None),
        (None, Support.UNKNOWN, None, None, None),
    ],
)
def test_each_recovery_action_value_does_what_nvidia_says(
    value: int | None,
    support: Support,
    kind: FindingKind | None,
    actionable: bool | None,
    says: str | None,
) -> None:
    findings, _ = judge(health(recovery_action=value, recovery_support=support))
    if kind is None:
        assert findings == []
        return
    (finding,) = findings
    assert finding.kind is kind
    assert finding.actionable is actionable
    assert says is not None
    assert says in finding.reason
    # No value outside NVIDIA's reset ones ever asks for a reset.
    if value not in (1, 4):
        assert finding.kind is not FindingKind.RESET_REQUIRED


def test_a_driver_without_the_field_says_unknown_never_healthy() -> None:
    findings, _ = judge(
        health(
            recovery_action=None,
            recovery_support=Support.NOT_SUPPORTED,
            xids=xids((95, 0.0)),
        )
    )
    (finding,) = findings
    assert finding.evidence["recovery_action"] == (
        "unknown (not_supported: the driver does not offer it)"
    )
    unread, _ = judge(
        health(recovery_action=None, recovery_support=Support.UNKNOWN, remap_pending=True)
    )
    assert unread[0].evidence["recovery_action"] == "unknown (could not be read)"


def test_drain_p2p_is_re_read_and_the_finding_follows_the_settled_value() -> None:
    first, state = judge(health(recovery_action=3))
    assert kinds_of(first) == [FindingKind.DRAIN_REQUIRED]
    still, state = judge(health(recovery_action=3), state, t=1005.0)
    assert kinds_of(still) == [FindingKind.DRAIN_REQUIRED]
    settled, _ = judge(health(recovery_action=1), state, t=1010.0)
    assert kinds_of(settled) == [FindingKind.RESET_REQUIRED]


# --- the solo rules ---------------------------------------------------------------------------


def test_a_solo_xid_48_asks_for_a_reset() -> None:
    findings, _ = judge(health(xids=xids((48, 0.0))))
    (finding,) = findings
    assert finding.kind is FindingKind.RESET_REQUIRED
    assert "solo: NVIDIA: reset the GPU" in finding.reason
    assert finding.evidence["xids"]["48"]["note"] == "solo: NVIDIA: reset the GPU"  # type: ignore[index]


@pytest.mark.parametrize("companion", [63, 64])
def test_xid_48_with_63_or_64_in_the_window_is_drain_and_reset(companion: int) -> None:
    findings, _ = judge(health(xids=xids((48, 0.0), (companion, XID_WINDOW - 1))))
    (finding,) = findings
    assert finding.kind is FindingKind.RESET_REQUIRED
    assert f"with Xid {companion}: NVIDIA: drain and reset" in finding.reason


def test_xid_48_with_a_63_outside_the_window_is_still_solo() -> None:
    findings, _ = judge(health(xids=xids((48, 0.0), (63, XID_WINDOW + 5))), t=1100.0)
    assert "solo: NVIDIA: reset the GPU" in findings[0].reason


def fabric_health(state: int = 3, **over: object) -> GpuHealth:
    base = replace(
        health(),
        fabric_support=Support.OK,
        fabric_state=state,
        fabric_status=0,
        fabric_health_mask=0,
        fabric_health_summary=1,
    )
    return replace(base, **over)  # type: ignore[arg-type]


def test_xid_45_is_judged_only_once_its_window_has_passed() -> None:
    unhealthy = {"fabric_health_summary": 2}
    findings, state = judge(replace(fabric_health(**unhealthy), xids=xids((45, 0.0))))
    # The fabric itself is a reason; the 45 is not judged yet.
    assert "solo" not in findings[0].reason
    assert "judged once the window" in str(findings[0].evidence["xids"])
    later, _ = judge(fabric_health(**unhealthy), state, t=1000.0 + XID_WINDOW + 5)
    (finding,) = later
    assert finding.kind is FindingKind.DRAIN_REQUIRED
    assert "Xid 45 (Preemptive cleanup after earlier errors) seen 1 time(s), solo" in finding.reason
    assert "Fabric Manager" in finding.reason
    assert "never stops or restarts it" in finding.reason


@pytest.mark.parametrize(
    ("reading", "note"),
    [
        (health(), "no unhealthy NVLink fabric here"),  # a PCIe GPU: a killed process
        (fabric_health(), "no unhealthy NVLink fabric here"),  # healthy fabric
    ],
)
def test_a_solo_xid_45_without_an_unhealthy_fabric_is_only_counted(
    reading: GpuHealth, note: str
) -> None:
    _, state = judge(replace(reading, xids=xids((45, 0.0))))
    findings, _ = judge(reading, state, t=1000.0 + XID_WINDOW + 5)
    assert findings == []
    assert state.gpus[GPU0].xids[45].count == 1


def test_xid_45_with_another_xid_follows_that_xid() -> None:
    findings, _ = judge(
        replace(fabric_health(fabric_health_summary=2), xids=xids((45, 0.0), (95, 1.0))),
        t=1000.0 + XID_WINDOW + 5,
    )
    (finding,) = findings
    assert finding.kind is FindingKind.RESET_REQUIRED  # the 95
    assert "not solo (with Xid 95)" in str(finding.evidence["xids"])
    assert "Fabric Manager" in " ".join(finding.evidence["other_reasons"])  # type: ignore[arg-type]
    assert "Xid 45" not in " ".join(finding.evidence["other_reasons"])  # type: ignore[arg-type]


# --- Xid 74 on an NVLink peer during our own reset --------------------------------------------


def two_gpus(h0: GpuHealth, h1: GpuHealth, state: HealthState, t: float) -> list[Finding]:
    result = assess_health(snap(gpu(0, GPU0, h0), gpu(1, GPU1, h1), t=t), state, boot_changed=False)
    return list(result.findings)


@pytest.mark.parametrize("assumed", [False, True])
def test_xid_74_on_a_peer_right_after_our_reset_is_expected(assumed: bool) -> None:
    reset_at = WALL
    state = note_reset(HealthState(), GPU0, reset_at, assumed_from=health() if assumed else None)
    peer = health(xids=(XidEvent(74, reset_at + 20.0),))
    findings = two_gpus(health(), peer, state, t=1030.0)
    assert findings == []
    # Much later, the same Xid on the peer is an incident of its own.
    late = health(xids=(XidEvent(74, reset_at + PEER_XID_WINDOW + 60.0),))
    (finding,) = two_gpus(health(), late, state, t=1400.0)
    assert (finding.gpu, finding.kind) == (GPU1, FindingKind.RESET_REQUIRED)
    assert "NVLink error" in finding.reason


def test_xid_74_without_any_reset_asks_for_a_reset() -> None:
    findings, _ = judge(health(xids=xids((74, 0.0))))
    assert kinds_of(findings) == [FindingKind.RESET_REQUIRED]


def test_xid_74_on_the_gpu_we_reset_is_not_excused_as_a_peers() -> None:
    """Only another GPU's reset explains an Xid 74: on the reset GPU itself it is an incident."""
    state = note_reset(HealthState(), GPU0, WALL)
    findings, _ = judge(health(xids=xids((74, 20.0))), state, t=1030.0)
    assert kinds_of(findings) == [FindingKind.RESET_REQUIRED]


# --- the stricter peer choices ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("xid", "option", "text"),
    [(63, {"xid_63": "drain"}, "health.xid_63: drain"), (94, {"xid_94": "drain"}, "xid_94")],
)
def test_stricter_peer_choices_drain_only_when_chosen(
    xid: int, option: dict[str, str], text: str
) -> None:
    reading = health(xids=xids((xid, 0.0)))
    assert judge(reading)[0] == []  # NVIDIA's bucket: counted only
    findings, _ = judge(reading, pol=replace(HealthPolicy(), **option))  # type: ignore[arg-type]
    (finding,) = findings
    assert finding.kind is FindingKind.DRAIN_REQUIRED
    assert finding.actionable
    assert text in finding.reason


# --- the NVLink fabric ------------------------------------------------------------------------


def test_the_health_mask_is_decoded_field_by_field() -> None:
    # degraded_bw false(2), route_recovery not supported(0), route_unhealthy true(1),
    # access_timeout false(2), config none(1), partition assigned true(1), gfm connected(1)
    mask = 2 | (0 << 2) | (1 << 4) | (2 << 6) | (1 << 8) | (1 << 12) | (1 << 14)
    assert fabric.decode_mask(mask) == {
        "degraded_bw": "false",
        "route_recovery": "not_supported",
        "route_unhealthy": "true",
        "access_timeout_recovery": "false",
        "incorrect_configuration": "none",
        "partition_assigned": "true",
        "gfm_state": "connected",
    }
    assert fabric.decode_mask(0x80)["access_timeout_recovery"] == "false"  # not a fault
    assert fabric.decode_mask(9 << 8)["incorrect_configuration"] == "unknown_9"


@pytest.mark.parametrize(
    ("over", "problem"),
    [
        ({}, None),
        ({"fabric_health_mask": 0x80 | (1 << 8) | (1 << 12)}, None),  # busy, all fine
        ({"fabric_health_summary": 3}, None),  # limited capacity is not a fault by itself
        ({"fabric_status": 999}, "NVML error 999"),
        ({"fabric_health_summary": 2}, "UNHEALTHY"),
        ({"fabric_health_mask": 1}, "bandwidth is degraded"),
        ({"fabric_health_mask": 1 << 4}, "route is unhealthy"),
        ({"fabric_health_mask": 5 << 8}, "insufficient_nvlinks"),
    ],
)
def test_a_completed_fabric_is_unhealthy_only_on_a_real_fault(
    over: dict[str, int], problem: str | None
) -> None:
    findings, _ = judge(replace(fabric_health(), **over))  # type: ignore[arg-type]
    if problem is None:
        assert findings == []
        return
    (finding,) = findings
    assert finding.kind is FindingKind.DRAIN_REQUIRED
    assert problem in finding.reason
    assert "Fabric Manager" in finding.reason


def test_a_fabric_registering_too_long_is_stuck_unless_it_waits_for_a_partition() -> None:
    pol = replace(HealthPolicy(), fabric_stuck_after=300.0)
    findings, state = judge(fabric_health(2), pol=pol)
    assert findings == []
    assert state.gpus[GPU0].fabric_since == WALL
    still, state = judge(fabric_health(2), state, t=1299.0, pol=pol)
    assert still == []
    stuck, _ = judge(fabric_health(2), state, t=1300.0, pol=pol)
    assert kinds_of(stuck) == [FindingKind.DRAIN_REQUIRED]
    assert "not completed after 300s (state IN_PROGRESS)" in stuck[0].reason
    no_partition = fabric_health(2, fabric_health_mask=2 << 12)
    waiting, _ = judge(no_partition, state, t=1300.0, pol=pol)
    assert waiting == []
    done, after = judge(fabric_health(3), state, t=1305.0, pol=pol)
    assert done == []
    assert after.gpus[GPU0].fabric_since is None


@pytest.mark.parametrize(
    ("reading", "verdict"),
    [
        (None, "unknown"),
        (health(), "unknown"),  # no fabric read
        (fabric_health(1), "waiting"),
        (fabric_health(2), "waiting"),
        (fabric_health(3), "completed"),
        (fabric_health(3, fabric_status=5), "failed"),
        (fabric_health(0), "unknown"),
    ],
)
def test_what_a_reading_after_our_reset_says(reading: GpuHealth | None, verdict: str) -> None:
    assert fabric.after_reset(reading)[0] == verdict


# --- after a reset, real or assumed -----------------------------------------------------------


def test_the_health_check_is_the_first_reading_after_a_reset_not_every_later_one() -> None:
    _, state = judge(health(xids=xids((95, 0.0))))
    state = note_reset(state, GPU0, WALL + 10)
    unhealed, state = judge(health(recovery_action=1), state, t=1020.0)
    assert kinds_of(unhealed) == [FindingKind.REBOOT_REQUIRED]  # the check failed
    still, state = judge(health(recovery_action=1), state, t=1025.0)
    assert kinds_of(still) == [FindingKind.REBOOT_REQUIRED]  # as long as it shows
    cleared, state = judge(health(), state, t=1030.0)
    assert cleared == []
    # Weeks later the driver asks for a reset again: a new incident, not a failed check.
    again, _ = judge(health(recovery_action=1), state, t=1_000_000.0)
    assert kinds_of(again) == [FindingKind.RESET_REQUIRED]


def test_a_dry_runs_assumed_reset_deals_with_its_incident_until_acting_for_real() -> None:
    asking = health(recovery_action=1, remap_pending=True, xids=xids((95, 0.0)))
    findings, state = judge(asking)
    assert kinds_of(findings) == [FindingKind.RESET_REQUIRED]
    assumed = note_reset(state, GPU0, WALL + 1, assumed_from=asking)
    unchanged = replace(asking, xids=())
    after, kept = judge(unchanged, assumed, t=1005.0)
    assert after == []  # as if the would-be reset had applied it; not a reboot either
    # A new Xid after the assumed reset is a new incident.
    new, _ = judge(replace(unchanged, xids=xids((95, 10.0))), kept, t=1010.0)
    assert kinds_of(new) == [FindingKind.RESET_REQUIRED]
    assert "recovery action" not in new[0].reason  # the assumed cures still hold
    # Acting for real drops every assumption: the incident is back, for a real reset.
    real, _ = judge(unchanged, drop_assumed(kept), t=1010.0)
    assert kinds_of(real) == [FindingKind.RESET_REQUIRED]
    assert "recovery action is GPU_RESET" in real[0].reason


def test_an_assumed_cure_that_went_away_is_forgotten() -> None:
    asking = health(recovery_action=1)
    _, state = judge(asking)
    assumed = note_reset(state, GPU0, WALL + 1, assumed_from=asking)
    _, cleared = judge(health(), assumed, t=1005.0)
    assert cleared.gpus[GPU0].assumed_cured == ()
    back, _ = judge(asking, cleared, t=1010.0)
    assert kinds_of(back) == [FindingKind.RESET_REQUIRED]


def test_health_state_with_assumptions_and_fabric_round_trips_and_rejects_garbage() -> None:
    _, state = judge(fabric_health(2, recovery_action=1))
    state = note_reset(state, GPU0, WALL + 1, assumed_from=health(recovery_action=1))
    state = note_reset(state, GPU0, WALL + 2)
    again = HealthState.from_json(json.loads(json.dumps(state.to_json())))
    assert again == state
    assert again.gpus[GPU0].assumed_cured == ("recovery:1",)
    for bad in (
        {GPU0: {"assumed_cured": "recovery:1"}},
        {GPU0: {"assumed_cured": ["x" * 40]}},
        {GPU0: {"unhealed": [1]}},
        {GPU0: {"fabric_since": "soon"}},
        {GPU0: {"assumed_reset": float("nan")}},
    ):
        with pytest.raises(ValueError, match="health"):
            HealthState.from_json(bad)


def test_an_unreadable_fabric_keeps_the_stuck_clock_and_is_never_stuck_itself() -> None:
    pol = replace(HealthPolicy(), fabric_stuck_after=300.0)
    _, state = judge(fabric_health(2), pol=pol)
    unread = replace(fabric_health(2), fabric_support=Support.UNKNOWN, fabric_state=None)
    blind, state = judge(unread, state, t=1400.0, pol=pol)
    assert blind == []  # unknown is never a fault
    assert state.gpus[GPU0].fabric_since == WALL  # nor a reason to start the clock over
    stuck, _ = judge(fabric_health(2), state, t=1401.0, pol=pol)
    assert kinds_of(stuck) == [FindingKind.DRAIN_REQUIRED]
