"""What the unit's ``MemoryMax=`` and ``TasksMax=`` must leave room for: the daemon at its busiest.

Owns one measurement: a real daemon (enforcing) on a simulated host kills an orphan and then
resets the GPU the dead job left memory on, with drain, before, after and ``on_action`` hooks
that are Python interpreters themselves (heavier than the ``scontrol``/``systemd-run`` a site
would run).
Meanwhile ``/proc`` is sampled every few milliseconds for the daemon's process tree — the daemon,
its NVML worker, hooks, the reset command — and the peaks are kept: the sum of their resident
memory (VmRSS) and the sum of their tasks (threads), which is what the cgroup counts against
``TasksMax=``. ``MemoryMax=`` counts more than RSS (page cache, kernel memory): the unit's limit
leaves headroom for that (docs/operations.md, "Unit limits").

Runs inside the benchmark's PID namespace (it signals processes): ``bench/run.py`` calls
:func:`measure`; ``python bench/unit_limits.py`` runs it alone in a fresh namespace.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from gpuwatchd.core.vocabulary import EventName  # noqa: E402
from tests.support.daemonrun import Run, fake_smi, orphan_host  # noqa: E402
from tests.support.fakenvml import gpu  # noqa: E402
from tests.support.simhost import SimHost, run_in_pid_namespace  # noqa: E402

SAMPLE_EVERY = 0.005  # seconds


def _status(pid: int) -> tuple[int, int, int] | None:
    """(ppid, VmRSS in KiB, threads) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    rss = fields.get("VmRSS", "0 kB").split()[0]  # absent for zombies
    return int(fields["PPid"]), int(rss), int(fields["Threads"])


def tree_usage(root_pid: int) -> tuple[int, int, int]:
    """(RSS KiB, tasks, processes) summed over ``root_pid`` and all its descendants."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (found := _status(int(name))) is not None:
            table[int(name)] = found
    members, frontier = {root_pid}, [root_pid]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _rss, _threads) in table.items():
            if ppid == parent and pid not in members:
                members.add(pid)
                frontier.append(pid)
    present = [table[pid] for pid in members if pid in table]
    return sum(p[1] for p in present), sum(p[2] for p in present), len(present)


class Sampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.stop = threading.Event()
        self.peak_rss_kib = self.peak_tasks = self.peak_processes = 0
        self.samples = 0

    def run(self) -> None:
        while not self.stop.is_set():
            rss, tasks, processes = tree_usage(self.pid)
            self.peak_rss_kib = max(self.peak_rss_kib, rss)
            self.peak_tasks = max(self.peak_tasks, tasks)
            self.peak_processes = max(self.peak_processes, processes)
            self.samples += 1
            time.sleep(SAMPLE_EVERY)


def measure(root: Path) -> dict[str, Any]:
    """Run the busy daemon once; its peaks, and whether the reset and the kill happened."""
    with SimHost(root, gpus=2) as host:
        script = root / "hook.py"
        script.write_text("import time\ntime.sleep(1)\n")
        hook = [sys.executable, str(script)]
        orphan_host(host)
        # Three lists, not one shared: the policy is written as YAML, which must have no anchors.
        reset = {**fake_smi(host), **{step: [list(hook)] for step in ("drain", "before", "after")}}
        # An on_action notification after the kill and after the reset: it runs on a thread of
        # the daemon's own while the NVML worker is up.
        run = Run(host, reset=reset, on_action=[list(hook)])
        run.start()
        assert run.proc is not None
        sampler = Sampler(run.proc.pid)
        sampler.start()
        try:
            worker = host.pids["worker"]
            run.wait_for(lambda: not host.alive(worker), timeout=30)
            # As the driver would: the job is gone from NVML, its memory is not (a leak).
            host.nvml([gpu(0, allocated=3 * 1024**3), gpu(1)])
            run.wait_for(lambda: run.saw(EventName.RESET_OUTCOME), timeout=60)
            run.wait_for(lambda: run.saw(EventName.HOOK_RUN, hook="on_action"), timeout=10)
            time.sleep(1.5)  # the notification after the reset, and its hook.run event
        finally:
            sampler.stop.set()
            sampler.join()
            run.stop()
        if not run.saw(EventName.DAEMON_START):
            raise RuntimeError(f"the daemon did not start: {run.events()[-3:]}")
        result = {
            "peak_rss_mib": round(sampler.peak_rss_kib / 1024, 1),
            "peak_tasks": sampler.peak_tasks,
            "peak_processes": sampler.peak_processes,
            "samples": sampler.samples,
            "killed": not host.alive(worker),
            "reset": run.saw(EventName.RESET_OUTCOME),
            "hooks": sum(
                1
                for e in run.events()
                if e.get("event") == EventName.RESET_STEP
                and e.get("step") in ("drain", "before_hooks", "after_hooks")
                and e.get("status") == "ok"
            ),
            "on_action": sum(
                1
                for e in run.events()
                if e.get("event") == EventName.HOOK_RUN and e.get("hook") == "on_action"
            ),
        }
    print(
        f"[bench] unit limits: peak RSS {result['peak_rss_mib']} MiB, "
        f"peak tasks {result['peak_tasks']} in {result['peak_processes']} processes "
        f"(kill: {result['killed']}, reset: {result['reset']}, reset hooks: {result['hooks']}, "
        f"on_action hooks: {result['on_action']})",
        flush=True,
    )
    return result


def _in_namespace(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    return measure(root / "unit-limits")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpuwatchd-unit-limits-") as tmp:
        found = run_in_pid_namespace("bench.unit_limits:_in_namespace", {}, root=Path(tmp))
    print(json.dumps(found, indent=1))
