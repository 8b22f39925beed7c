"""The NVML listing pass: ``dead_process`` and listed ``zombie`` findings (with the live
processes that descend from a dead one), and the roles of listed processes whose device files
do not match."""

from __future__ import annotations

from gpuwatchd.core.model import FindingKind, GpuInfo
from gpuwatchd.decide.assess.host_view import Listing
from gpuwatchd.decide.assess.shared import AssessorState
from gpuwatchd.decide.patterns import command_text


class ListingPass(AssessorState):
    """The NVML listings of every GPU."""

    def assess_listings(self) -> None:
        host = self.host
        for gpu in host.gpus:
            for row in host.listings[gpu.uuid]:
                pid = row.entry.pid
                if row.status == "dead":
                    heirs = self.heirs_of(pid)
                    self.add_listed(
                        FindingKind.DEAD_PROCESS, row, gpu, None,
                        f"NVML lists PID {pid} on GPU {gpu.index}, but no such process exists"
                        + (f"; {len(heirs)} live process(es) descend from it" if heirs else ""),
                        process_kind=row.entry.kind, heirs=heirs,
                        seen_alive=any(i.pid == pid for i in self.lineage),
                    )  # fmt: skip
                    continue
                proc = row.proc
                if proc is None:  # never: only dead rows lack their process
                    continue
                if row.status == "zombie":
                    holding = host.holds_anything(pid)
                    self.add_listed(
                        FindingKind.ZOMBIE, row, gpu, proc.start_ticks,
                        f"NVML lists zombie PID {pid} on GPU {gpu.index}; its parent "
                        f"{proc.ppid if proc.ppid is not None else '(unknown)'} must reap it",
                        ppid=proc.ppid, parent_cmdline=self.cmdline_of(proc.ppid),
                        holds_device_files=holding,
                    )  # fmt: skip
                    if holding:
                        self.role(pid, gpu, "context_owner", None, "zombie leader; live threads")
                    continue
                if proc.is_uninterruptible:
                    self.add_stuck(proc, gpu, [gpu])
                holds = host.holds_gpu(pid, gpu)
                if not holds:
                    why = (
                        "listed; whether it holds the GPU is unknown"
                        if holds is None
                        else "listed by NVML but holds no device file of this GPU (PID reused?)"
                    )
                    self.role(pid, gpu, "unknown", None, why)

    def add_listed(
        self, kind: FindingKind, row: Listing, gpu: GpuInfo, start_ticks: int | None, reason: str,
        **evidence: object,
    ) -> None:  # fmt: skip
        """A finding about a listed process: its listed memory leads its evidence."""
        used = row.entry.used_memory
        evidence = {"used_memory": used, **evidence}
        self.add(kind, gpu, row.entry.pid, start_ticks, reason, memory=used, evidence=evidence)

    def heirs_of(self, dead_pid: int) -> list[int]:
        heirs = []
        for pid, proc in sorted(self.host.procs.items()):
            recorded = self.lineage.get(proc.identity) if proc.identity is not None else None
            ids = {proc.ppid, proc.pgid, proc.sid}
            if recorded is not None:
                ids.add(recorded.ppid)
            if dead_pid in ids and not proc.is_zombie:
                heirs.append(pid)
        return heirs

    def cmdline_of(self, pid: int | None) -> str | None:
        proc = self.host.procs.get(pid) if pid is not None else None
        if proc is None or proc.cmdline is None:
            return None
        return command_text(proc.cmdline)
