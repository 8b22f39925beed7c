"""A fake reset environment for the reset procedure's tests (``act.reset.ResetEnvironment``).

Owns :class:`FakeEnvironment`, which records every call the procedure makes and answers as its
constructor says, and the reset policy whose every command and hook is the fake ``nvidia-smi``
(tests/support/fakesmi.py): no real ``nvidia-smi`` ever runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from gpuwatchd.act.reset_resume import resume_interrupted
from gpuwatchd.act.reset_target import ResetTarget, progress_record
from gpuwatchd.core.model import GpuInfo, MigDevice
from gpuwatchd.core.vocabulary import EventName, ResetStep
from gpuwatchd.decide.mig.recovery import InstanceRecovery
from gpuwatchd.decide.plan.monitors import StoppableMonitor
from gpuwatchd.decide.policy import Hook, ResetPolicy
from tests.support.fakesmi import FakeSmi


class FakeEnvironment:
    """Records every call; what the daemon would answer is set in the constructor."""

    def __init__(
        self,
        smi: FakeSmi,
        *,
        released: bool = True,
        blockers: Sequence[str] = (),
        memory: bool | None = True,
        record_fails: bool = False,
        scan_raises: bool = False,
        instance: str | None = None,
        rereads: Sequence[GpuInfo | Exception | None] | None = None,
        monitors: Sequence[StoppableMonitor] = (),
        monitors_left: Sequence[str] = (),
    ) -> None:
        self.smi = smi
        self.released = released
        self.blockers = list(blockers)
        self.memory = memory
        self.record_fails = record_fails
        self.scan_raises = scan_raises
        self.instance = instance  # what instance_back answers after a MIG recovery
        # What reread_gpu answers (an exception: raises it), in turn, the last one again; None:
        # the planned instance until a -dgi ran, then its placement free (instance_gpu); a GPU
        # out of MIG mode for a reset of a GPU that was.
        self.rereads = None if rereads is None else list(rereads)
        self.monitors = list(monitors)  # what find_monitors answers
        self.monitors_left = list(monitors_left)  # what stop_monitors answers
        self.ignored: list[frozenset[int]] = []  # final_blockers' ignore, per call
        self.calls: list[str] = []
        self.steps: list[ResetStep] = []
        self.records: list[dict[str, object]] = []
        self.events: list[tuple[str, str, dict[str, object]]] = []
        self.commands_seen_at: dict[str, list[list[str]]] = {}

    def stop_nvml(self) -> bool:
        self.calls.append("stop_nvml")
        self.commands_seen_at["stop_nvml"] = self.smi.calls()
        return self.released

    def find_monitors(self, target: ResetTarget) -> list[StoppableMonitor]:
        self.calls.append("find_monitors")
        return list(self.monitors)

    def stop_monitors(
        self, target: ResetTarget, monitors: Sequence[StoppableMonitor], timeout: float
    ) -> list[str]:
        self.calls.append("stop_monitors " + " ".join(str(m.identity.pid) for m in monitors))
        return list(self.monitors_left)

    def final_blockers(self, target: ResetTarget, ignore: frozenset[int]) -> list[str]:
        self.calls.append("final_blockers")
        self.ignored.append(ignore)
        self.commands_seen_at["final_blockers"] = self.smi.calls()
        if self.scan_raises:
            raise OSError("cannot read /proc")
        return list(self.blockers)

    def memory_back_to_baseline(self, target: ResetTarget) -> bool | None:
        self.calls.append("memory")
        return self.memory

    def instance_back(self, target: ResetTarget) -> str | None:
        self.calls.append("instance")
        return self.instance

    def reread_gpu(self, target: ResetTarget) -> GpuInfo | None:
        self.calls.append("reread")
        if self.rereads is not None:
            answer = self.rereads.pop(0) if len(self.rereads) > 1 else self.rereads[0]
            if isinstance(answer, Exception):
                raise answer
            return answer
        if target.layout:
            return layout_gpu(target.layout, present=layout_present(self.smi, target.layout))
        if target.recovery is None:  # a GPU out of MIG mode, as planned
            return GpuInfo(index=0, uuid=target.uuid, mig_enabled=False)
        destroyed = any("-dgi" in call for call in smi_commands(self.smi))
        return instance_gpu(target.recovery, present=not destroyed)

    def record_step(self, target: ResetTarget, step: ResetStep, data: Mapping[str, object]) -> None:
        if self.record_fails:
            raise OSError("disk full")
        self.steps.append(step)
        self.records.append(progress_record(target, step, data))

    def emit(self, event: str, level: str, **fields: object) -> None:
        self.events.append((event, level, fields))

    def finished(self) -> tuple[str, dict[str, object]]:
        [(level, fields)] = [(lvl, f) for e, lvl, f in self.events if e == EventName.RESET_FINISHED]
        return level, fields

    def step_events(self, step: ResetStep) -> list[dict[str, object]]:
        return [
            f for e, _l, f in self.events if e == EventName.RESET_STEP and f["step"] == step.value
        ]


def make_policy(smi: FakeSmi, **changes: object) -> ResetPolicy:
    policy = ResetPolicy(
        command=smi.argv("--gpu-reset", "-i", "{uuid}"),
        persistence_command=smi.argv("-pm", "{mode}", "-i", "{uuid}"),
        health_command=smi.argv("-q", "-i", "{uuid}"),
        drain=(Hook(smi.hook("drain"), timeout=10),),
        before=(Hook(smi.hook("before"), timeout=10),),
        after=(Hook(smi.hook("after"), timeout=10),),
        timeout=10.0,
    )
    return replace(policy, **changes)  # type: ignore[arg-type]


def mig_recovery_commands(smi: FakeSmi) -> tuple[tuple[str, ...], ...]:
    """``reset.mig_recovery_commands`` run by the fake: destroy the compute instance, destroy
    the GPU instance, create it again at its placement."""
    return (
        smi.argv("mig", "-i", "{uuid}", "-gi", "{gi}", "-ci", "{ci}", "-dci"),
        smi.argv("mig", "-i", "{uuid}", "-gi", "{gi}", "-dgi"),
        smi.argv("mig", "-i", "{uuid}", "-cgi", "{profile}:{placement}", "-C"),
    )


def smi_commands(smi: FakeSmi) -> list[list[str]]:
    """The calls that were nvidia-smi commands, not hooks."""
    return [call for call in smi.calls() if call[:1] != ["hook"]]


def instance_gpu(recovery: InstanceRecovery, *, present: bool = True, **device: object) -> GpuInfo:
    """A fresh reading of ``recovery``'s GPU: the planned instance (its MIG device changed by
    ``device``), or none at all (``present=False``: its placement free)."""
    planned = MigDevice(
        index=0, uuid=recovery.mig_uuid, gi=recovery.gi, ci=recovery.ci, profile="1g.10gb",
        gi_profile_id=recovery.profile, placement=(recovery.placement, recovery.size),
    )  # fmt: skip
    devices = (replace(planned, **device),) if present else ()  # type: ignore[arg-type]
    return GpuInfo(
        index=recovery.gpu_index, uuid=recovery.uuid, pci_bus_id=recovery.pci_bus_id,
        mig_enabled=True, mig_devices=devices,
    )  # fmt: skip


def layout_present(smi: FakeSmi, layout: Sequence[InstanceRecovery]) -> set[int]:
    """Which GPU instances of ``layout`` the fake GPU has: all until a ``--gpu-reset`` ran,
    then those a ``-cgi <profile>:<placement>`` created since."""
    calls = smi_commands(smi)
    resets = [n for n, call in enumerate(calls) if "--gpu-reset" in call]
    if not resets:
        return set(range(len(layout)))
    created = {call[call.index("-cgi") + 1] for call in calls[resets[-1] :] if "-cgi" in call}
    return {n for n, r in enumerate(layout) if f"{r.profile}:{r.placement}" in created}


def layout_gpu(
    layout: Sequence[InstanceRecovery], *, present: set[int], mig_enabled: bool | None = True
) -> GpuInfo:
    """A fresh reading of a MIG GPU with the GPU instances of ``layout`` at ``present``."""
    first = layout[0]
    devices = tuple(
        MigDevice(
            index=n,
            uuid=f"MIG-{n:08x}-0000-4000-8000-000000000000",
            gi=n + 1,
            ci=0,
            profile="1g.10gb",
            gi_profile_id=r.profile,
            placement=(r.placement, r.size),
        )
        for n, r in enumerate(layout)
        if n in present
    )
    return GpuInfo(
        index=first.gpu_index, uuid=first.uuid, pci_bus_id=first.pci_bus_id,
        mig_enabled=mig_enabled, mig_devices=devices,
    )  # fmt: skip


def resume_fails_untouched(
    smi: FakeSmi, record: dict[str, object], policy: ResetPolicy, why: str
) -> None:
    """Resuming ``record`` fails, its reason naming ``why``, and runs nothing at all."""
    outcome = resume_interrupted(record, policy, FakeEnvironment(smi))
    assert outcome is not None
    assert outcome.result == "failed"
    assert why in outcome.reason
    assert smi.calls() == []
