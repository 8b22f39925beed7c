"""gpuwatchd with real Slurm and a real node_exporter, in a systemd-nspawn container.

A one-node cluster from Debian 12's own packages (munge, slurmctld, slurmd, slurm-client),
configured as docs/operations.md ("Slurm epilog and prolog") tells admins — `Prolog=` and
`Epilog=` naming the installed scripts, the GPUs in `gres.conf`, the package's
`gpuwatchd-slurm-undrain.timer` left enabled — runs real batch jobs with `sbatch` against the
fake NVML (tests/fakenvml, compiled here with its state file as a default, since slurmd runs the
prolog and epilog with an environment of its own). It pins:

- (a) a job whose forked worker outlives it: the installed daemon frees the worker while the
  epilog waits, the job completes, and the node stays up;
- (b) a GPU a job leaves dirty: the epilog drains the node with a `gpuwatchd:` reason that
  `sinfo -R` shows; the prolog refuses a dirty GPU (Slurm requeues the job, held);
- (c) a node someone else drained is neither overwritten nor lifted;
- (d) our drain is lifted by the timer once every GPU is clean — also when Slurm has put its
  own "Epilog error" over our reason (our record says the drain is ours);
- (e) on a host whose device minors are not in NVML's order, the prolog judges the GPU Slurm
  gave the job by Slurm's id (gres.conf's device files), not NVML's index;
- (f) `spare job:ID` under `proctrack/linuxproc` (the job's processes in slurmd's cgroup) and
  under `proctrack/cgroup`: the job's orphaned worker is left alone until the spare is
  cancelled; a job with no process on the node is refused;
- the rollout week of docs/operations.md ("Roll out in dry-run first"), step by step:
  ``test_the_rollout_week``;
- node_exporter (Debian's prometheus-node-exporter, its default textfile directory) serves our
  series over HTTP; removing the package removes the file, and node_exporter stops serving
  them; purge removes what packaging/README.md says it removes.

Needs what tests/system/test_systemd.py needs, plus `ip` (iproute2) on the host: the container's
loopback gets a second address, because Slurm resolves host names with AI_ADDRCONFIG, which
finds nothing on a host with loopback alone. Skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.core.vocabulary import EventName
from tests.support.container import _REASON as SYSTEMD_REASON
from tests.support.container import CI_DIR, HARNESS, Container, wait_for
from tests.support.debbuild import built_deb
from tests.support.fakenvml import FAKENVML_DIR, GiB, gpu

NODE = "gpuwatchd-it"
NODE_ADDR = "10.254.0.1"  # on the container's loopback (see the module docstring)
EXTRA_PACKAGES = "munge,slurmctld,slurmd,slurm-client,prometheus-node-exporter,curl"
METRICS_FILE = "/var/lib/prometheus/node-exporter/gpuwatchd.prom"  # Debian's textfile dir
RECORDS = "/var/lib/gpuwatchd-slurm"


def _missing() -> str | None:
    if SYSTEMD_REASON is not None:
        return SYSTEMD_REASON
    if shutil.which("ip") is None:
        return "missing ip (iproute2; run tests/systemd/host-setup.sh)"
    return None


_WHY = _missing()
pytestmark = [
    pytest.mark.systemd,
    pytest.mark.slow,
    pytest.mark.skipif(_WHY is not None, reason=_WHY or ""),
]

# docs/operations.md, "Slurm epilog and prolog": the two lines an admin adds to slurm.conf;
# the rest is the smallest one-node cluster (no cgroup plugins in a container). slurmd logs at
# debug level, where it says each epilog that completed ("completed epilog for jobid N").
SLURM_CONF = f"""\
ClusterName=gpuwatchd-it
SlurmctldHost={NODE}
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmdDebug=debug
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
GresTypes=gpu
Prolog=/usr/lib/gpuwatchd/slurm/gpuwatchd-prolog
Epilog=/usr/lib/gpuwatchd/slurm/gpuwatchd-epilog
NodeName={NODE} CPUs=2 Gres=gpu:2 State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
# The GPUs in NVML's order (docs/operations.md). Slurm needs character devices here: 195:N, as
# the driver's; the fake NVML's files stand in for them in /srv/ci/dev.
GRES_CONF = "Name=gpu File=/dev/nvidia[0-1]\n"

POLICY = f"""\
interval: 1s
devices_dir: {CI_DIR}/dev
nvml_timeout: 10s
# In a container the daemon does not see the host's PID namespace; the fake NVML lists
# container PIDs, so it may act (tests/system/test_systemd.py says the same).
namespace_check: false
dry_run: false
rules:
  - name: orphans
    kind: orphaned
    for: 1s
    steps:
      - {{signal: SIGTERM, wait: 2s}}
      - {{signal: SIGKILL, wait: 2s}}
# Ghost memory stays dirty (no reset): what a job left that gpuwatchd will not clean.
reset:
  enabled: false
metrics:
  textfile: {METRICS_FILE}
"""
# Site settings for the scripts (slurmd passes them no environment): the epilog's wait, 2m by
# default, would make each job that leaves ghost memory (which the daemon counts as work to do,
# resets or not) take two minutes to end.
SLURM_DEFAULTS = "GPUWATCHD_EPILOG_TIMEOUT=15s\n"
# The timer's 2 minutes are too long for a test: every 2 s here, the same unit otherwise. (An
# empty OnActiveSec= drops every time the unit set, of all kinds; then both are set again.)
TIMER_DROPIN = """\
[Timer]
OnActiveSec=
OnActiveSec=1s
OnUnitInactiveSec=2s
AccuracySec=1s
"""


def _fake_nvml_with_defaults(out: Path) -> Path:
    """The fake libnvidia-ml.so.1 with /srv/ci/nvml.json and /srv/ci/dev built in."""
    lib = out / "libnvidia-ml.so.1"
    subprocess.run(
        [
            os.environ.get("CC", "cc"),
            "-std=c11",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-shared",
            "-fPIC",
            "-Wl,-soname,libnvidia-ml.so.1",
            f'-DFAKENVML_DEFAULT_STATE="{CI_DIR}/nvml.json"',
            f'-DFAKENVML_DEFAULT_DEVICES_DIR="{CI_DIR}/dev"',
            "-o",
            str(lib),
            str(FAKENVML_DIR / "fakenvml.c"),
            "-lpthread",
        ],
        check=True,
    )
    return lib


class Cluster:
    """The container with slurmctld, slurmd and node_exporter; helpers for jobs and the node."""

    def __init__(self, ct: Container) -> None:
        self.ct = ct

    def sh(self, script: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.ct.sh(script, check=check)

    def idle(self) -> None:
        self.ct.nvml([gpu(0), gpu(1)])

    def ghost_on_gpu1(self) -> None:
        """GPU 1 keeps 2 GiB no process holds: dirty, and (resets off) it stays so."""
        self.ct.nvml([gpu(0), gpu(1, allocated=2 * GiB)])

    def node(self) -> dict[str, str]:
        """The node's State and Reason as `scontrol show node` prints them."""
        out = self.sh(f"scontrol show node {NODE}").stdout
        found = {"State": "", "Reason": ""}
        for raw in out.splitlines():
            line = raw.strip()
            if line.startswith("Reason="):
                found["Reason"] = line.removeprefix("Reason=")
            for field in line.split():
                if field.startswith("State="):
                    found["State"] = field.removeprefix("State=")
        return found

    def sinfo_reasons(self) -> list[str]:
        """`sinfo -R`'s reasons, whole (%E), one per drained node."""
        out = self.sh("sinfo -R -h -o '%E'").stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def drained(self) -> bool:
        return "DRAIN" in self.node()["State"]

    def wait_idle(self, what: str, timeout: float = 60) -> None:
        try:
            wait_for(what, lambda: self.node()["State"] == "IDLE", timeout=timeout, step=0.5)
        except pytest.fail.Exception as failed:
            # A drain not lifted: what the node, the drain record and the timer said (diagnosis).
            said = self.sh(
                "cat /var/lib/gpuwatchd-slurm/* 2>&1; journalctl -u gpuwatchd-slurm-undrain"
                " -n 30 --no-pager -o short-monotonic 2>&1",
                check=False,
            ).stdout
            pytest.fail(f"{failed}; node {self.node()}; the record and the timer:\n{said}")

    def submit(self, name: str, body: str, gpus: int = 1) -> int:
        """sbatch a job script (as root) asking for ``gpus`` GPUs; its job ID."""
        script = self.ct.ci / f"{name}.sh"
        script.write_text(
            f"#!/bin/sh\n#SBATCH --gres=gpu:{gpus}\n#SBATCH --output={CI_DIR}/{name}.out\n{body}"
        )
        script.chmod(0o755)
        return int(self.sh(f"sbatch --parsable {CI_DIR}/{name}.sh").stdout.strip())

    def job(self, job_id: int) -> dict[str, str]:
        out = self.sh(f"scontrol show job -o {job_id}", check=False).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_job(self, job_id: int, states: tuple[str, ...], timeout: float = 90) -> str:
        wait_for(
            f"job {job_id} to be {'/'.join(states)}",
            lambda: self.job(job_id).get("JobState") in states,
            timeout=timeout,
            step=0.5,
        )
        return self.job(job_id)["JobState"]

    def epilog_completed(self, job_id: int) -> bool:
        """Whether slurmd says the epilog ran for ``job_id`` and exited 0 (its debug line)."""
        log = self.ct.root / "var/log/slurm/slurmd.log"
        return f"completed epilog for jobid {job_id}\n" in log.read_text(errors="replace")

    def journal(self, unit: str) -> list[dict[str, Any]]:
        out = self.sh(f"journalctl -u {unit} -o json --no-pager").stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def undrain_runs(self) -> int:
        """How many times the timer's service has finished."""
        return sum(
            1
            for e in self.journal("gpuwatchd-slurm-undrain.service")
            if str(e.get("MESSAGE", "")).startswith("Finished ")
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    artifacts = (
        Path(
            os.environ.get("GPUWATCHD_SYSTEMD_ARTIFACTS")
            or tempfile.mkdtemp(prefix="gpuwatchd-it-")
        )
        / "slurm"
    )
    artifacts.mkdir(parents=True, exist_ok=True)
    print(f"\nslurm test artifacts: {artifacts}")
    lib = _fake_nvml_with_defaults(artifacts)
    deb = built_deb(tmp_path_factory)
    cached = Path(
        subprocess.run(
            [str(HARNESS / "make-rootfs.sh")],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "GPUWATCHD_ROOTFS_EXTRA": EXTRA_PACKAGES},
        ).stdout.strip()
    )
    work = Path(tempfile.mkdtemp(prefix="gpuwatchd-slurm-", dir="/var/tmp"))
    root, ci = work / "root", work / "ci"
    subprocess.run(["cp", "-a", str(cached), str(root)], check=True)
    ci.mkdir()
    (ci / "dev").mkdir()
    for name in ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm"):
        (ci / "dev" / name).touch()
    shutil.copy(deb, ci / deb.name)
    shutil.copy(HARNESS / "orphan-maker", ci / "orphan-maker")
    ct = Container(root, ci, artifacts)
    ct.nvml([gpu(0), gpu(1)])
    ct.write("/etc/hostname", f"{NODE}\n")
    ct.write("/etc/hosts", f"127.0.0.1 localhost\n{NODE_ADDR} {NODE}\n")
    shutil.copy(lib, root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
    shutil.copy(HARNESS / "fake-nvidia-smi", root / "usr/bin/nvidia-smi")
    try:
        ct.boot()
        subprocess.run(
            [
                "nsenter",
                "-t",
                str(ct.leader),
                "-n",
                "ip",
                "addr",
                "add",
                f"{NODE_ADDR}/32",
                "dev",
                "lo",
            ],
            check=True,
        )
        ct.run(["ldconfig"])
        for minor in (0, 1):
            ct.run(["mknod", "-m", "0666", f"/dev/nvidia{minor}", "c", "195", str(minor)])
        ct.run(["apt-get", "install", "-y", "-q", f"{CI_DIR}/{deb.name}"])
        ct.write("/etc/gpuwatchd/conf.d/50-test.yaml", POLICY)
        ct.write("/etc/systemd/system/gpuwatchd-slurm-undrain.timer.d/50-test.conf", TIMER_DROPIN)
        ct.write("/etc/default/gpuwatchd-slurm", SLURM_DEFAULTS)
        ct.write("/etc/slurm/slurm.conf", SLURM_CONF)
        ct.write("/etc/slurm/gres.conf", GRES_CONF)
        ct.run(["systemctl", "daemon-reload"])
        ct.run(["systemctl", "restart", "gpuwatchd", "gpuwatchd-slurm-undrain.timer"])
        ct.run(["systemctl", "start", "munge", "slurmctld", "slurmd"])
        cluster = Cluster(ct)
        wait_for(
            "the node to be idle in Slurm",
            lambda: cluster.sh("sinfo -h -o %T", check=False).stdout.strip() == "idle",
            timeout=60,
            step=0.5,
        )
        yield cluster
    finally:
        if ct.leader:
            for log in ("slurmctld.log", "slurmd.log"):
                src = root / "var/log/slurm" / log
                if src.exists():
                    shutil.copy(src, artifacts / log)
            (artifacts / "journal.txt").write_text(
                ct.run(["journalctl", "--no-pager", "-o", "short-monotonic"], check=False).stdout
            )
        try:
            ct.shutdown()
        finally:
            if ct.nspawn is None or ct.nspawn.poll() is not None:
                shutil.rmtree(work, ignore_errors=True)


def _until(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    wait_for(what, check, timeout=timeout, step=0.5)


# -- (a) --------------------------------------------------------------------------------------
def test_a_worker_that_outlives_its_job_is_freed_and_the_node_stays_up(cluster: Cluster) -> None:
    """The job's trainer forks a worker that inherits its GPU files and outlives the job: the
    daemon kills it (the dead trainer's files tie it to the job), the epilog runs and succeeds,
    the job completes, nothing is drained. (Whether the daemon reads the epilog's word before
    the epilog sees the node clean is a race here: the word is needed only where nothing else
    ties a leftover to its job, which tests/system/test_e2e_run.py checks.)"""
    ct = cluster.ct
    cluster.idle()
    pids = ct.ci / "job-a.pids"
    job = cluster.submit("job-a", f"{CI_DIR}/orphan-maker {CI_DIR}/dev 0 {CI_DIR}/job-a.pids\n")
    _until("the job's trainer and worker", pids.exists)
    trainer, worker = (int(x) for x in pids.read_text().split())
    # NVML lists the trainer with the memory its worker keeps pinned after it exits.
    ct.nvml([gpu(0, allocated=GiB, processes=[{"pid": trainer, "used_memory": GiB}]), gpu(1)])

    def worker_gone() -> bool:
        return ct.run(["kill", "-0", str(worker)], check=False).returncode != 0

    _until(f"the worker {worker} to be freed", worker_gone, timeout=60)
    cluster.idle()  # as the driver does once the last holder is gone
    assert cluster.wait_job(job, ("COMPLETED", "FAILED")) == "COMPLETED"
    cluster.wait_idle("the node to be idle after the job")
    assert cluster.sinfo_reasons() == []
    assert cluster.epilog_completed(job), "slurmd does not say the epilog completed"

    def signals() -> list[dict[str, Any]]:  # logged once the kill returned; journald lags
        return [
            e
            for e in _events(cluster, EventName.ACTION_SIGNAL)
            if e.get("TARGET_PID") == str(worker)
        ]

    _until("the signal to the worker in the journal", lambda: bool(signals()), timeout=30)
    assert signals(), "no signal to the worker in the journal"


# -- (b) and (d) ------------------------------------------------------------------------------
def test_a_gpu_left_dirty_drains_with_our_reason_and_the_timer_lifts_it_once_clean(
    cluster: Cluster,
) -> None:
    """A job ends leaving memory on GPU 1 that no process holds (resets off): the epilog drains
    the node naming GPU 1 and the finding; the timer leaves it while GPU 1 is dirty, and lifts
    it once GPU 1 is clean — also after Slurm put its own reason over ours."""
    ct = cluster.ct
    cluster.idle()
    started, go = ct.ci / "job-b.started", ct.ci / "job-b.go"
    body = f"touch {CI_DIR}/job-b.started\nwhile [ ! -e {CI_DIR}/job-b.go ]; do sleep 0.1; done\n"
    job = cluster.submit("job-b", body, gpus=2)
    _until("job b to start", started.exists)
    cluster.ghost_on_gpu1()
    go.touch()
    cluster.wait_job(job, ("COMPLETED", "FAILED"))
    uuid1 = gpu(1)["uuid"]
    ours = f"gpuwatchd: {uuid1} ghost_memory"
    _until("our drain", cluster.drained)
    assert cluster.node()["Reason"].startswith(ours + " ["), cluster.node()
    assert cluster.sinfo_reasons() == [ours]

    runs = cluster.undrain_runs()
    _until("two runs of the timer", lambda: cluster.undrain_runs() >= runs + 2, timeout=30)
    assert cluster.drained(), "lifted while GPU 1 is still dirty"

    # Slurm may put its own reason over ours (some versions do for a failed epilog): done here
    # as slurmctld does it, as SlurmUser. The drain is still ours, by our record.
    cluster.sh(f"runuser -u slurm -- scontrol update nodename={NODE} reason='Epilog error'")
    assert cluster.node()["Reason"].startswith("Epilog error [slurm@")
    cluster.idle()
    cluster.wait_idle("the timer to lift our drain", timeout=60)
    assert cluster.sinfo_reasons() == []

    def lifted() -> list[str]:  # said before the resume, but journald may not have it yet
        return [
            str(e.get("MESSAGE", ""))
            for e in cluster.journal("gpuwatchd-slurm-undrain.service")
            if "resuming" in str(e.get("MESSAGE", ""))
        ]

    _until("the lift said in the journal", lambda: any('"Epilog error"' in m for m in lifted()))
    assert any('"Epilog error"' in m for m in lifted()), lifted()
    # The undrain removes our record after `scontrol update state=resume` has returned.
    record = ct.root / RECORDS.lstrip("/") / f"drained.{NODE}"
    _until("our drain record to go", lambda: not record.exists(), timeout=30)
    assert not record.exists()


def test_the_prolog_refuses_a_dirty_gpu_and_the_job_runs_once_it_is_clean(
    cluster: Cluster,
) -> None:
    """GPU 1 is dirty before a job starts: the prolog drains the node and Slurm requeues the
    job held; once GPU 1 is clean the timer lifts the drain and the released job runs."""
    cluster.idle()
    cluster.wait_idle("an idle node")
    cluster.ghost_on_gpu1()
    job = cluster.submit("job-p", "echo ran\n", gpus=2)
    _until("the prolog's drain", cluster.drained)
    assert cluster.sinfo_reasons() == [f"gpuwatchd: {gpu(1)['uuid']} ghost_memory"]
    _until("the job to be requeued", lambda: cluster.job(job).get("Restarts") == "1")
    assert cluster.job(job).get("JobState") != "RUNNING"
    cluster.idle()
    cluster.wait_idle("the timer to lift the prolog's drain", timeout=60)
    # Slurm holds a requeued job back for about two minutes (BeginTime); an admin may let it go.
    cluster.sh(f"scontrol release {job} && scontrol update jobid={job} StartTime=now")
    assert cluster.wait_job(job, ("COMPLETED", "FAILED")) == "COMPLETED"
    assert (cluster.ct.ci / "job-p.out").read_text().strip() == "ran"


# -- (c) --------------------------------------------------------------------------------------
def test_a_drain_set_by_someone_else_is_neither_overwritten_nor_lifted(cluster: Cluster) -> None:
    """An admin drains the node while a job runs; the job leaves GPU 1 dirty: the epilog keeps
    the admin's reason. Clean again, the timer still leaves the admin's drain alone."""
    ct = cluster.ct
    cluster.idle()
    cluster.wait_idle("an idle node")
    started, go = ct.ci / "job-c.started", ct.ci / "job-c.go"
    body = f"touch {CI_DIR}/job-c.started\nwhile [ ! -e {CI_DIR}/job-c.go ]; do sleep 0.1; done\n"
    job = cluster.submit("job-c", body, gpus=2)
    _until("job c to start", started.exists)
    admin = "admin: fan check, ticket 4711"
    cluster.sh(f"scontrol update nodename={NODE} state=drain reason='{admin}'")
    cluster.ghost_on_gpu1()
    go.touch()
    cluster.wait_job(job, ("COMPLETED", "FAILED"))
    _until("the epilog to finish", lambda: "COMPLETING" not in cluster.node()["State"])
    assert cluster.sinfo_reasons() == [admin]
    cluster.idle()
    runs = cluster.undrain_runs()
    _until("three runs of the timer", lambda: cluster.undrain_runs() >= runs + 3, timeout=30)
    assert cluster.drained()
    assert cluster.sinfo_reasons() == [admin]
    cluster.sh(f"scontrol update nodename={NODE} state=resume")
    cluster.wait_idle("the admin's resume")


# -- the rollout week -------------------------------------------------------------------------
# docs/operations.md, "Roll out in dry-run first": the preview loop, word for word.
PREVIEW_LOOP = """\
for s in /usr/share/doc/gpuwatchd/examples/scenarios/*.yaml; do
    echo "== $(basename "$s" .yaml)"
    gpuwatchd simulate --enforce --config /etc/gpuwatchd/gpuwatchd.yaml "$s" |
        sed -n '/^final state/,$p'
done
"""
ROLLOUT_DROPIN = "/etc/gpuwatchd/conf.d/60-rollout.yaml"
HANG = {"nvmlDeviceGetComputeRunningProcesses_v3": 3600.0}


def _preview(text: str) -> dict[str, list[str]]:
    """The preview loop's output: scenario name -> its final-state lines."""
    found: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("== "):
            current = found.setdefault(line.removeprefix("== "), [])
        else:
            current.append(line.strip())
    return found


def _delivered(lines: list[str]) -> int:
    (total,) = [line for line in lines if line.startswith("signals delivered: ")]
    return int(total.removeprefix("signals delivered: ").split(";")[0])


def _events(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return [e for e in cluster.journal("gpuwatchd.service") if e.get("GPUWATCHD_EVENT") == name]


def _status(cluster: Cluster) -> tuple[int, dict[str, Any]]:
    proc = cluster.sh("gpuwatchd status --json", check=False)
    return proc.returncode, json.loads(proc.stdout)


def test_the_rollout_week(cluster: Cluster) -> None:
    """What docs/operations.md's rollout section walks through, in its order: dry-run (the
    preview loop with `simulate --enforce`; a leaky job whose epilog neither waits nor drains
    and reports the drain it would have made); a spare and a timed pause, then enforcing (the
    pause ends by itself, the spared worker is left alone, then freed when the spare ends);
    NVML wedged and back (status from the first failed reading, `nvml.recovered`)."""
    ct = cluster.ct
    cluster.idle()
    cluster.wait_idle("an idle node")
    try:
        # Day 1: dry-run, and the preview of enforcement over the incident library.
        ct.write(ROLLOUT_DROPIN, "dry_run: true\nnvml_timeout: 2s\n")
        cluster.sh("systemctl reload gpuwatchd")
        _until("dry-run in force", lambda: any(
            e.get("GPUWATCHD_DRY_RUN") == "true" or e.get("DRY_RUN") == "true"
            for e in _events(cluster, EventName.CONFIG_RELOADED)))  # fmt: skip
        preview = _preview(ct.run(["sh", "-c", PREVIEW_LOOP], timeout=300).stdout)
        assert len(preview) >= 20, sorted(preview)
        assert _delivered(preview["nohup-job"]) == 0, preview["nohup-job"]
        torchrun = preview["torchrun-agent-died"]
        for healthy in ("rank-0 (", "rank-0-loader ("):
            (line,) = [x for x in torchrun if x.startswith(healthy)]
            assert line.endswith("never signalled"), line
        assert _delivered(preview["dataloader-orphans"]) > 0, preview["dataloader-orphans"]

        # Day 2: a job leaks a worker; dry-run: no drain, no wait, the would-be drain said.
        pids = ct.ci / "job-r.pids"
        job = cluster.submit("job-r", f"{CI_DIR}/orphan-maker {CI_DIR}/dev 0 {CI_DIR}/job-r.pids\n")
        _until("the job's trainer and worker", pids.exists)
        trainer, worker = (int(x) for x in pids.read_text().split())
        ct.nvml([gpu(0, allocated=GiB, processes=[{"pid": trainer, "used_memory": GiB}]), gpu(1)])
        assert cluster.wait_job(job, ("COMPLETED", "FAILED")) == "COMPLETED"
        _until("the epilog to finish", lambda: "COMPLETING" not in cluster.node()["State"])
        assert cluster.node()["State"] == "IDLE", cluster.node()
        assert cluster.sinfo_reasons() == []
        record = ct.root / RECORDS.lstrip("/") / f"would-drain.{NODE}"
        assert record.exists()
        assert f"reason=gpuwatchd: {gpu(0)['uuid']} " in record.read_text()
        would = f"epilog dry-run: would drain {NODE}: gpuwatchd: {gpu(0)['uuid']} "
        _until("the epilog's word in the journal", lambda: would in _slurm_said(cluster))
        assert would in _slurm_said(cluster)
        _until("the would-be signal to the worker", lambda: any(
            e.get("TARGET_PID") == str(worker) and e.get("OUTCOME") == "dry_run"
            for e in _events(cluster, EventName.ACTION_SIGNAL)))  # fmt: skip

        def alive() -> bool:
            return ct.run(["kill", "-0", str(worker)], check=False).returncode == 0

        assert alive()

        # Day 5: spare the worker (its owner looks at it), pause, then enforce.
        cluster.sh(f"gpuwatchd spare {worker} --for 40s --reason 'owner looks at it'")
        cluster.sh("gpuwatchd pause --for 15s --reason 'switching to enforce'")
        _until("the pause and the spare", lambda: bool(_events(cluster, EventName.DAEMON_PAUSED)
               and _events(cluster, EventName.SPARE_STARTED)))  # fmt: skip
        # Logged as the poll takes the switches; `status` shows them once it has saved.
        _until("status to show the pause and the spare", lambda: (
            _status(cluster)[1]["effective_mode"] == "paused"
            and bool(_status(cluster)[1]["spares"])))  # fmt: skip
        code, status = _status(cluster)
        assert (code, status["effective_mode"]) == (0, "paused"), status
        assert status["paused_until"] is not None
        assert [s["target"] for s in status["spares"]] == [f"pid:{worker}"]
        ct.write(ROLLOUT_DROPIN, "nvml_timeout: 2s\n")  # dry_run: false again (50-test.yaml)
        cluster.sh("systemctl reload gpuwatchd")
        _until("the pause to end by itself", lambda: any(
            "ended by itself" in str(e.get("GPUWATCHD_REASON"))
            for e in _events(cluster, EventName.DAEMON_RESUMED)), timeout=60)  # fmt: skip
        assert alive(), "the spared worker was signalled after the pause"
        _until(
            "the spare to end", lambda: bool(_events(cluster, EventName.SPARE_ENDED)), timeout=60
        )
        _until("the worker to be freed", lambda: not alive(), timeout=60)
        cluster.idle()
        _until("the signal to the worker in the journal", lambda: any(  # logged after the kill
            e.get("TARGET_PID") == str(worker) and e.get("OUTCOME") == "delivered"
            for e in _events(cluster, EventName.ACTION_SIGNAL)))  # fmt: skip
        events = [
            e.get("GPUWATCHD_EVENT")
            for e in cluster.journal("gpuwatchd.service")
            if e.get("GPUWATCHD_EVENT") in (EventName.SPARE_ENDED, EventName.DAEMON_RESUMED)
            or (e.get("TARGET_PID") == str(worker) and e.get("OUTCOME") == "delivered")
        ]
        assert events.index(EventName.DAEMON_RESUMED) < events.index(EventName.SPARE_ENDED)
        assert events.index(EventName.SPARE_ENDED) < events.index(EventName.ACTION_SIGNAL), events
        (ended,) = _events(cluster, EventName.SPARE_ENDED)
        assert ended["GPUWATCHD_WHY"] == "its time was up"

        # Day 6: NVML wedges, then answers again.
        ct.nvml([gpu(0, delays=HANG), gpu(1)])
        took = wait_for(
            "status to say NVML is wedged",
            lambda: _status(cluster)[1]["nvml"]["state"] == "wedged",
            timeout=30,
            step=0.5,
        )
        assert took < 20, "status said NVML: ok long after the first failed reading"
        assert _status(cluster)[0] == 1
        assert "NVML:     wedged since" in cluster.sh("gpuwatchd status", check=False).stdout
        cluster.idle()
        _until(
            EventName.NVML_RECOVERED,
            lambda: bool(_events(cluster, EventName.NVML_RECOVERED)),
            timeout=90,
        )
        (back,) = _events(cluster, EventName.NVML_RECOVERED)
        assert back["GPUWATCHD_WAS"] == "wedged"
        assert float(back["GPUWATCHD_GONE_FOR"]) > 0
        _until("status to say NVML is ok", lambda: _status(cluster)[0] == 0, timeout=30)
    finally:
        (ct.root / ROLLOUT_DROPIN.lstrip("/")).unlink(missing_ok=True)
        cluster.sh("gpuwatchd resume; systemctl reload gpuwatchd", check=False)
        cluster.idle()


# -- a bad drop-in ----------------------------------------------------------------------------
TYPO_DROPIN = "/etc/gpuwatchd/conf.d/70-typo.yaml"
DRY_DROPIN = "/etc/gpuwatchd/conf.d/65-dry.yaml"


def _slurm_said(cluster: Cluster) -> str:
    return cluster.sh("journalctl -t gpuwatchd-slurm -o cat --no-pager").stdout


def test_a_bad_drop_in_drains_nothing_and_shows_in_status(cluster: Cluster) -> None:
    """Issue 35, findings 1 and 2: a drop-in with a typo, pushed to a node. `systemctl reload`
    refuses it, and the daemon says so anyway (journal, `status`, STATUS, metrics); jobs on a
    clean node run and nothing drains, enforcing or dry-run; a dirty GPU still drains under the
    enforcing policy the daemon runs, and only says so under a dry-run one; our drain is lifted
    once clean, bad files or not."""
    ct = cluster.ct
    cluster.idle()
    cluster.wait_idle("an idle node")
    typo = ct.root / TYPO_DROPIN.lstrip("/")
    try:
        ct.write(TYPO_DROPIN, "interval: sometimes\n")
        assert cluster.sh("systemctl reload gpuwatchd", check=False).returncode != 0
        _until(
            EventName.CONFIG_FILES_REJECTED,
            lambda: bool(_events(cluster, EventName.CONFIG_FILES_REJECTED)),
        )
        # Logged before the poll; the state `status` reads is saved in it, STATUS sent after.
        _until("status to say the files are rejected", lambda: _status(cluster)[0] == 1)
        code, status = _status(cluster)
        assert code == 1, status
        assert "70-typo.yaml" in status["policy"]["rejected"]["error"]
        assert any("policy files rejected" in a for a in status["attention"])

        def status_line() -> str:
            return cluster.sh("systemctl show -p StatusText --value gpuwatchd").stdout

        _until("STATUS to say so", lambda: status_line().startswith("policy rejected"))
        line = status_line()
        assert line.startswith("policy rejected, running the previous one"), line
        _until("gpuwatchd_policy_rejected 1", lambda: "\ngpuwatchd_policy_rejected 1" in (
            ct.root / METRICS_FILE.lstrip("/")).read_text())  # fmt: skip

        # Enforcing (the policy the daemon runs), clean: the job runs, nothing drains.
        job = cluster.submit("job-t1", "echo ran\n", gpus=2)
        assert cluster.wait_job(job, ("COMPLETED", "FAILED")) == "COMPLETED"
        _until("the epilog to finish", lambda: "COMPLETING" not in cluster.node()["State"])
        assert cluster.node()["State"] == "IDLE", cluster.node()
        _until("the epilog's word in the journal", lambda: (
            "a policy problem drains nothing" in _slurm_said(cluster)))  # fmt: skip
        assert "a policy problem drains nothing" in _slurm_said(cluster)

        # Enforcing, GPU 1 dirty: the prolog still drains, saying how it judged.
        cluster.ghost_on_gpu1()
        job = cluster.submit("job-t2", "echo ran\n", gpus=2)
        _until("the prolog's drain", cluster.drained)
        (reason,) = cluster.sinfo_reasons()
        assert reason.startswith(f"gpuwatchd: {gpu(1)['uuid']} ghost_memory"), reason
        assert reason.endswith("[policy files invalid: judged by the policy the daemon runs]")
        cluster.sh(f"scancel {job}")
        cluster.idle()
        cluster.wait_idle("the timer to lift our drain, bad files or not", timeout=60)

        # The daemon runs a dry-run policy: a dirty GPU drains nothing, the drain is said.
        typo.unlink()
        ct.write(DRY_DROPIN, "dry_run: true\n")
        cluster.sh("systemctl reload gpuwatchd")
        _until("status clear again", lambda: _status(cluster)[0] == 0)
        ct.write(TYPO_DROPIN, "interval: sometimes\n")
        _until(
            "the new typo said", lambda: len(_events(cluster, EventName.CONFIG_FILES_REJECTED)) >= 2
        )
        job = cluster.submit("job-t3", "echo ran\n", gpus=2)
        assert cluster.wait_job(job, ("COMPLETED", "FAILED")) == "COMPLETED"
        cluster.ghost_on_gpu1()
        job = cluster.submit("job-t4", "echo ran\n", gpus=2)
        assert cluster.wait_job(job, ("COMPLETED", "FAILED")) == "COMPLETED"
        _until("the epilog to finish", lambda: "COMPLETING" not in cluster.node()["State"])
        assert cluster.node()["State"] == "IDLE", cluster.node()
        assert cluster.sinfo_reasons() == []
        would = f"prolog dry-run: would drain {NODE}: gpuwatchd: {gpu(1)['uuid']} "
        _until("the prolog's word in the journal", lambda: would in _slurm_said(cluster))
        said = _slurm_said(cluster)
        assert would in said
        assert "[policy files invalid: judged by the policy the daemon runs]" in said
    finally:
        typo.unlink(missing_ok=True)
        (ct.root / DRY_DROPIN.lstrip("/")).unlink(missing_ok=True)
        cluster.sh("systemctl reload gpuwatchd", check=False)
        cluster.idle()
    _until("status clear after the fix", lambda: _status(cluster)[0] == 0)
    cluster.wait_idle("an idle node at the end")


# -- node_exporter ----------------------------------------------------------------------------
def _scrape(cluster: Cluster) -> str:
    return cluster.sh("curl -sf http://127.0.0.1:9100/metrics").stdout


def _samples(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith((name + " ", name + "{"))]


def test_node_exporter_serves_our_series_over_http(cluster: Cluster) -> None:
    """Debian's node_exporter, as installed, reads our file from its default textfile
    directory and serves it; the file parses (no scrape error)."""
    ct = cluster.ct
    cluster.idle()
    _until("the metrics file", (ct.root / METRICS_FILE.lstrip("/")).exists)
    _until("node_exporter to answer", lambda: cluster.sh("curl -sf -o /dev/null "
           "http://127.0.0.1:9100/metrics", check=False).returncode == 0)  # fmt: skip
    text = _scrape(cluster)
    assert _samples(text, "gpuwatchd_build_info"), text[-2000:]
    assert _samples(text, "gpuwatchd_last_successful_poll_timestamp_seconds")
    assert len(_samples(text, "gpuwatchd_gpu_memory_allocated_bytes")) == 2
    assert _samples(text, "node_textfile_scrape_error") == ["node_textfile_scrape_error 0"]
    # An orphan killed in (a) is counted, and served.
    delivered = [s for s in _samples(text, "gpuwatchd_signals_total") if "delivered" in s]
    assert delivered, _samples(text, "gpuwatchd_signals_total")


# -- (e) (here: the rollout week reads every spare event of the journal) -----------------------
def test_the_prolog_judges_the_jobs_gpu_by_slurms_id_where_minors_are_not_in_nvmls_order(
    cluster: Cluster,
) -> None:
    """NVML's GPU 0 is /dev/nvidia1 and its GPU 1 is /dev/nvidia0 here. gres.conf lists
    File=/dev/nvidia[0-1], so Slurm's GPU id 0, which a one-GPU job on an idle node gets, is
    /dev/nvidia0: NVML's GPU 1. With NVML's GPU 0 dirty the job runs (not its GPU); with
    NVML's GPU 1 dirty the prolog refuses it, naming GPU 1."""
    cluster.idle()
    cluster.wait_idle("an idle node")
    try:
        cluster.ct.nvml([gpu(0, minor=1, allocated=2 * GiB), gpu(1, minor=0)])
        job = cluster.submit("job-e0", "echo ran\n", gpus=1)
        assert cluster.wait_job(job, ("COMPLETED", "FAILED")) == "COMPLETED"
        assert cluster.job(job).get("Restarts") == "0"
        _until("the epilog to finish", lambda: "COMPLETING" not in cluster.node()["State"])
        assert cluster.sinfo_reasons() == []

        cluster.ct.nvml([gpu(0, minor=1), gpu(1, minor=0, allocated=2 * GiB)])
        job = cluster.submit("job-e1", "echo ran\n", gpus=1)
        _until("the prolog's drain", cluster.drained)
        assert cluster.sinfo_reasons() == [f"gpuwatchd: {gpu(1)['uuid']} ghost_memory"]
        cluster.sh(f"scancel {job}")
    finally:
        cluster.idle()
    cluster.wait_idle("the timer to lift the prolog's drain", timeout=60)


# -- (f) --------------------------------------------------------------------------------------
# The jobs: orphan-maker's trainer exits after 3 s; the worker it forked keeps GPU 0. Under
# proctrack/linuxproc a subreaper in the job (as torchrun or tini are) adopts the worker, so it
# stays in the step's process tree; under proctrack/cgroup it stays in the job's cgroup.
ORPHAN_MAKER = f'["{CI_DIR}/orphan-maker", "{CI_DIR}/dev", "0", "{CI_DIR}/job-f.pids"]'
SUBREAPER_JOB = f"""\
exec python3 -c '
import ctypes, os, subprocess, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
subprocess.Popen({ORPHAN_MAKER}, env=dict(os.environ, ORPHAN_PARENT_LIFETIME="3"))
while not os.path.exists("{CI_DIR}/job-f.go"):
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        pass
    time.sleep(0.2)
'
"""
PLAIN_JOB = f"""\
ORPHAN_PARENT_LIFETIME=3 {CI_DIR}/orphan-maker {CI_DIR}/dev 0 {CI_DIR}/job-f.pids
while [ ! -e {CI_DIR}/job-f.go ]; do sleep 0.2; done
"""
CGROUP_CONF = "CgroupPlugin=autodetect\nCgroupAutomount=yes\nIgnoreSystemd=yes\n"


def _spare_holds_the_jobs_worker(cluster: Cluster, body: str) -> tuple[str, str]:
    """Run ``body`` as a job, spare the job once its worker is orphaned, check the spare holds
    it (refused with the spare as the reason, alive, never signalled) and that it is freed
    once the spare is cancelled; then end the job. (what `spare` said, the worker's cgroup)"""
    ct = cluster.ct
    cluster.idle()
    cluster.wait_idle("an idle node")
    pids, go = ct.ci / "job-f.pids", ct.ci / "job-f.go"
    pids.unlink(missing_ok=True)
    go.unlink(missing_ok=True)
    job = cluster.submit("job-f", body, gpus=1)
    try:
        _until("the job's trainer and worker", pids.exists)
        trainer, worker = (int(x) for x in pids.read_text().split())
        cgroup = ct.run(["cat", f"/proc/{worker}/cgroup"]).stdout
        said = cluster.sh(f"gpuwatchd spare job:{job} --for 90s --reason 'owner debugs'")
        ct.nvml([gpu(0, allocated=GiB, processes=[{"pid": trainer, "used_memory": GiB}]), gpu(1)])

        def alive() -> bool:
            return ct.run(["kill", "-0", str(worker)], check=False).returncode == 0

        def refused() -> bool:
            return any(
                e.get("TARGET_PID") == str(worker)
                and str(e.get("GPUWATCHD_WHY", "")).startswith(f"spare: job slurm:{job}")
                for e in _events(cluster, EventName.ACTION_REFUSED)
            )

        _until("the spare to refuse the worker's ladder", refused, timeout=60)
        assert alive(), "the spared job's worker was signalled"
        assert not [
            e
            for e in _events(cluster, EventName.ACTION_SIGNAL)
            if e.get("TARGET_PID") == str(worker)
        ]
        cluster.sh(f"gpuwatchd spare --cancel job:{job}")
        _until("the worker to be freed once the spare is cancelled", lambda: not alive())
        cluster.idle()
    finally:
        go.touch()
        cluster.idle()
    assert cluster.wait_job(job, ("COMPLETED", "FAILED")) == "COMPLETED"
    cluster.wait_idle("the node to be idle after the job")
    for absent in (job, job + 100000):
        proc = cluster.sh(f"gpuwatchd spare job:{absent} --for 1m --reason x", check=False)
        assert proc.returncode == 78, proc.stderr
        assert f"no process of job slurm:{absent} found" in proc.stderr
    assert "no spares" in cluster.sh("gpuwatchd spare --list").stdout
    return said.stdout, cgroup


def test_a_job_spare_holds_under_proctrack_linuxproc(cluster: Cluster) -> None:
    """`spare job:ID` with Slurm tracking the job by process: the job's processes sit in
    slurmd.service's cgroup, and the spare finds them by slurmstepd's process tree (and says
    so). A job id with no process on the node, or a job that has ended, is refused."""
    said, cgroup = _spare_holds_the_jobs_worker(cluster, SUBREAPER_JOB)
    assert "slurmd.service" in cgroup, cgroup  # nothing in the cgroup says which job
    assert "process tree" in said, said


def test_a_job_spare_holds_under_proctrack_cgroup(cluster: Cluster) -> None:
    """The same with `proctrack/cgroup` (cgroup v2): the worker, reparented out of the job's
    process tree, stays in the job's cgroup, which ties it to the job. Slurm is switched back
    to proctrack/linuxproc afterwards."""
    ct = cluster.ct

    def switch(proctrack: str) -> bool:
        ct.write("/etc/slurm/slurm.conf", SLURM_CONF.replace("proctrack/linuxproc", proctrack))
        cluster.sh("systemctl restart slurmctld slurmd", check=False)

        def settled() -> bool:  # idle, or slurmd has given up (no use waiting the minute out)
            if cluster.node()["State"] == "IDLE":
                return True
            return (
                ct.run(["systemctl", "is-failed", "--quiet", "slurmd"], check=False).returncode == 0
            )

        try:
            wait_for(f"the node to be idle under {proctrack}", settled, timeout=60, step=0.5)
        except BaseException:
            return False
        return cluster.node()["State"] == "IDLE"

    ct.write("/etc/slurm/cgroup.conf", CGROUP_CONF)
    try:
        if not switch("proctrack/cgroup"):
            log = cluster.sh(
                "grep -E 'fatal|Read-only|not supported' /var/log/slurm/slurmd.log | tail -n 1",
                check=False,
            ).stdout
            pytest.skip(f"slurmd does not run proctrack/cgroup in this container: {log}")
        said, cgroup = _spare_holds_the_jobs_worker(cluster, PLAIN_JOB)
        assert "/job_" in cgroup, cgroup
        assert "process tree" not in said, said  # its cgroup ties it: no caveat
    finally:
        (ct.root / "etc/slurm/cgroup.conf").unlink(missing_ok=True)
        assert switch("proctrack/linuxproc"), "slurmd did not come back under linuxproc"


# -- removal ----------------------------------------------------------------------------------
def test_remove_deletes_the_metrics_file_and_purge_what_the_docs_say(cluster: Cluster) -> None:
    """`apt remove`: the daemon stops, its .prom file goes, node_exporter serves no gpuwatchd
    series; the policy stays. `apt purge`: /etc/gpuwatchd (drop-ins included), the state and
    the Slurm records go, and the units are gone."""
    ct = cluster.ct
    cluster.sh(f"mkdir -p {RECORDS} && touch {RECORDS}/drained.other")
    cluster.sh("apt-get remove -y -q gpuwatchd")
    assert not (ct.root / METRICS_FILE.lstrip("/")).exists()
    assert not _samples(_scrape(cluster), "gpuwatchd_build_info")
    assert (ct.root / "etc/gpuwatchd/conf.d/50-test.yaml").exists()  # remove keeps the policy
    cluster.sh("apt-get purge -y -q gpuwatchd")
    gone_after_purge = (
        "etc/gpuwatchd",
        "etc/default/gpuwatchd-slurm",
        "var/lib/gpuwatchd",
        RECORDS.lstrip("/"),
    )
    for gone in gone_after_purge:
        assert not (ct.root / gone).exists(), gone
    for unit in ("gpuwatchd.service", "gpuwatchd-slurm-undrain.timer"):
        load = cluster.sh(f"systemctl show -p LoadState --value {unit}").stdout.strip()
        assert load == "not-found", unit
