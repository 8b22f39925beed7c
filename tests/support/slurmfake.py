"""A stand-in Slurm for the contrib/slurm and rollout tests: the node name, the fake ``scontrol``
script and the controller it answers for."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.simhost import SimHost

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "contrib" / "slurm"
NODE = "gpu-node-7"
SEP = "\x1f"


# A stand-in for scontrol: one line per call (argv joined by \x1f) in calls.log; `show node`
# answers from node.state / node.reason; `update` changes them as slurmctld would.
FAKE_SCONTROL = r"""#!/bin/sh
dir=$(dirname "$0")
line=""
for arg in "$@"; do line="$line$arg$(printf '\037')"; done
printf '%s\n' "$line" >> "$dir/calls.log"
state=$(cat "$dir/node.state"); reason=$(cat "$dir/node.reason")
case "$1" in
show)
    echo "NodeName=$3 Arch=x86_64 CoresPerSocket=32"
    echo "   CPUAlloc=0 CPUTot=64 CPULoad=0.10"
    echo "   State=$state ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A"
    at=$(cat "$dir/node.reason_at" 2>/dev/null || echo 2026-12-03T08:00:00)
    if [ -n "$reason" ]; then echo "   Reason=$reason [root@$at]"; fi
    ;;
update)
    for arg in "$@"; do
        case "$arg" in
        state=drain) printf 'IDLE+DRAIN' > "$dir/node.state" ;;
        state=resume) printf 'IDLE' > "$dir/node.state"; : > "$dir/node.reason" ;;
        reason=*) printf '%s' "${arg#reason=}" > "$dir/node.reason" ;;
        esac
    done
    ;;
esac
"""


class Slurm:
    """The fake Slurm side of one host: scontrol, the node's state, and the scripts' runs."""

    def __init__(self, host: SimHost, config: Path) -> None:
        self.host = host
        self.config = config
        self.dir = host.root / "slurm"
        self.dir.mkdir(exist_ok=True)
        self.scontrol = self.dir / "scontrol"
        self.scontrol.write_text(FAKE_SCONTROL)
        self.scontrol.chmod(0o755)
        self.gpuwatchd = self.dir / "gpuwatchd"
        self.gpuwatchd.write_text(f'#!/bin/sh\nexec {sys.executable} -m gpuwatchd "$@"\n')
        self.gpuwatchd.chmod(0o755)
        self.state = self.dir / "state"  # the scripts' drain records
        self.gres_conf = self.dir / "gres.conf"
        self.drain: str | None = None  # GPUWATCHD_SLURM_DRAIN; None: unset (auto)
        self.set_node("IDLE", "")

    def set_node(self, state: str, reason: str, at: float | None = None) -> None:
        """The node as scontrol shows it; ``at``: the reason's time (epoch), else a fixed one."""
        (self.dir / "node.state").write_text(state)
        (self.dir / "node.reason").write_text(reason)
        stamp = self.dir / "node.reason_at"
        if at is None:
            stamp.unlink(missing_ok=True)
        else:
            stamp.write_text(time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(at)))
        (self.dir / "calls.log").write_text("")

    def record(self) -> str | None:
        """The drain record the scripts keep for this node, if any."""
        path = self.state / f"drained.{NODE}"
        return path.read_text() if path.exists() else None

    def would_drain(self) -> str | None:
        """The dry-run report of the drain the scripts would have made, if any."""
        path = self.state / f"would-drain.{NODE}"
        return path.read_text() if path.exists() else None

    def write_record(self, at: float, reason: str) -> None:
        self.state.mkdir(mode=0o700, exist_ok=True)
        (self.state / f"drained.{NODE}").write_text(f"at={int(at)}\nreason={reason}\n")

    def node(self) -> dict[str, str]:
        return {
            "state": (self.dir / "node.state").read_text(),
            "reason": (self.dir / "node.reason").read_text(),
        }

    def calls(self) -> list[list[str]]:
        lines = (self.dir / "calls.log").read_text().splitlines()
        return [line.split(SEP)[:-1] for line in lines]

    def updates(self) -> list[list[str]]:
        return [call for call in self.calls() if call[:1] == ["update"]]

    def script(
        self,
        name: str,
        gpus: str | None,
        timeout: str = "20s",
        job: str | None = None,
        extra: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Run ``gpuwatchd-prolog``/``-epilog`` as slurmd would, or ``gpuwatchd-slurm undrain``;
        ``gpus`` is ``SLURM_JOB_GPUS``, ``extra`` more environment. The gres.conf the scripts
        read is ``gres_conf`` (none unless written)."""
        env = self.host.env()
        env.update(
            {
                "GPUWATCHD": str(self.gpuwatchd),
                "GPUWATCHD_CONFIG": str(self.config),
                "GPUWATCHD_SCONTROL": str(self.scontrol),
                "GPUWATCHD_EPILOG_TIMEOUT": timeout,
                "SLURMD_NODENAME": NODE,
                "GPUWATCHD_SLURM_STATE": str(self.state),
                "GPUWATCHD_SLURM_DEFAULTS": str(self.dir / "no-defaults"),
                "GPUWATCHD_SLURM_GRES_CONF": str(self.gres_conf),
            }
        )
        for var in (
            "SLURM_JOB_GPUS",
            "CUDA_VISIBLE_DEVICES",
            "GPUWATCHD_SLURM_GPUS",
            "GPUWATCHD_SLURM_GPU_ORDER",
        ):
            env.pop(var, None)
        env.pop("SLURM_JOB_ID", None)
        env.pop("GPUWATCHD_SLURM_DRAIN", None)
        if self.drain is not None:
            env["GPUWATCHD_SLURM_DRAIN"] = self.drain
        if gpus is not None:
            env["SLURM_JOB_GPUS"] = gpus
        if job is not None:
            env["SLURM_JOB_ID"] = job
        env.update(extra or {})
        (self.dir / "calls.log").write_text("")
        started = time.monotonic()
        proc = subprocess.run(
            [str(SLURM / "gpuwatchd-slurm"), name]
            if name == "undrain"
            else [str(SLURM / f"gpuwatchd-{name}")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        return {
            "code": proc.returncode,
            "stderr": proc.stderr,
            "took": time.monotonic() - started,
            "updates": self.updates(),
            "node": self.node(),
        }
