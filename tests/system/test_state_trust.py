"""One trusted ``state_dir`` for every command (gpuwatchd/state/directory.py).

Every command that reads or writes ``state_dir`` opens it the one checked way: a walk from
``/`` that follows no symbolic link, every directory on the way and every file read owned by
root (or the user running the command) and writable by nobody else. The attacks pinned here:
a symlinked ``state_dir``; a ``state_dir`` another user can write, through which a user made a
dirty ``check-clean`` clean by naming a GPU holder as "the daemon" in ``holders.json``; a
forged ``holders.json`` even in a trusted folder (the daemon is whoever the kernel says holds
the instance lock, not whoever a file names).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from gpuwatchd.core.checked import as_map, as_number
from gpuwatchd.core.model import HolderScan, as_int
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.served import holders as holder_view
from gpuwatchd.state.directory import StateDir, StateDirError, UntrustedFile, open_directory
from gpuwatchd.state.saved import StateStore
from tests.support.daemonrun import Run, orphan_host
from tests.support.fakenvml import MiB, gpu
from tests.support.simhost import SimHost, pid_namespace_command, run_in_pid_namespace

ATTACKER = 1001  # an ordinary user's uid (no account needed: setpriv takes numbers)

needs_root_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv (to act as another, unprivileged user)",
)
needs_namespace = pytest.mark.skipif(
    pid_namespace_command() is None or os.geteuid() != 0,
    reason="needs root and a PID namespace for the end-to-end attack",
)

COMMANDS = [
    (["scan", "--json"], 78),
    (["check-clean"], 78),
    (["status"], 4),
    (["pause", "--reason", "x"], 78),
    (["resume"], 78),
    (["run", "--once", "--timeout", "5s"], 78),
]


@pytest.mark.parametrize(("argv", "code"), COMMANDS, ids=[c[0][0] for c in COMMANDS])
def test_every_command_refuses_a_symlinked_state_dir(
    tmp_path: Path, argv: list[str], code: int
) -> None:
    host = SimHost(tmp_path / "host")
    real = tmp_path / "real-state"
    real.mkdir(mode=0o700)
    link = tmp_path / "linked-state"
    link.symlink_to(real)
    host.nvml([gpu(0)])
    config = host.config(state_dir=str(link))
    result = host.gpuwatchd(*argv, "--config", str(config))
    out = result.stdout + result.stderr
    assert result.returncode == code, out
    assert "symbolic link" in out
    assert "Traceback" not in out
    assert list(real.iterdir()) == [], "nothing was read or written through the link"


@needs_root_setpriv
@pytest.mark.parametrize(("argv", "code"), COMMANDS, ids=[c[0][0] for c in COMMANDS])
def test_every_command_refuses_a_state_dir_another_user_can_write(
    tmp_path: Path, argv: list[str], code: int
) -> None:
    host = SimHost(tmp_path / "host")
    os.chown(host.state_dir, ATTACKER, ATTACKER)
    host.nvml([gpu(0)])
    result = host.gpuwatchd(*argv, "--config", str(host.config()))
    out = result.stdout + result.stderr
    assert result.returncode == code, out
    assert f"owned by uid {ATTACKER}" in out
    assert "Traceback" not in out


@pytest.mark.parametrize("command", ["pause", "resume"])
@pytest.mark.parametrize(
    ("make", "says"),
    [
        ("file", "not a directory"),
        ("parent-file", "not a directory"),
    ],
)
def test_pause_and_resume_say_what_is_wrong_with_state_dir_in_one_line(
    tmp_path: Path, command: str, make: str, says: str
) -> None:
    """A bad state_dir used to end ``pause``/``resume`` in a traceback."""
    host = SimHost(tmp_path / "host")
    bad = tmp_path / "bad"
    bad.write_text("")
    state_dir = bad if make == "file" else bad / "state"
    result = host.gpuwatchd(command, "--config", str(host.config(state_dir=str(state_dir))))
    assert result.returncode == 78, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert says in line
    assert "the switch is not changed" in line


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777])
def test_a_state_dir_writable_by_group_or_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "state"
    path.mkdir()
    path.chmod(mode)
    with pytest.raises(StateDirError, match="writable by group or others"):
        StateDir.open(str(path))


def test_a_link_anywhere_on_the_path_is_refused_even_to_a_good_folder(tmp_path: Path) -> None:
    (tmp_path / "a" / "state").mkdir(parents=True, mode=0o700)
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(StateDirError, match=r"/b: a symbolic link \(not followed\)"):
        StateDir.open(str(tmp_path / "b" / "state"))
    with pytest.raises(StateDirError, match="symbolic link"):
        StateDir.open(str(tmp_path / "b" / "new"), create=True)
    assert not (tmp_path / "a" / "new").exists(), "nothing created through the link"
    StateDir.open(str(tmp_path / "a" / "state")).close()


def test_an_open_state_dir_is_used_through_its_descriptor_when_the_path_is_swapped(
    tmp_path: Path,
) -> None:
    """A folder renamed and replaced by a link after the daemon opened it redirects nothing."""
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    with StateDir.open(str(path)) as directory:
        path.rename(tmp_path / "moved")
        path.symlink_to(elsewhere)
        directory.write("state.json", b'{"x": 1}')
    assert list(elsewhere.iterdir()) == []
    assert json.loads((tmp_path / "moved" / "state.json").read_text()) == {"x": 1}


@needs_root_setpriv
def test_a_file_another_user_owns_in_the_state_dir_is_never_read(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    (path / "paused").write_text('{"reason": "mine"}')
    (path / "holders.json").write_text("{}")
    os.chown(path / "holders.json", ATTACKER, ATTACKER)
    (path / "paused").chmod(0o666)
    with StateDir.open(str(path)) as directory:
        with pytest.raises(UntrustedFile, match="owned by uid 1001"):
            directory.read("holders.json", 1024)
        with pytest.raises(UntrustedFile, match="writable by group or others"):
            directory.read("paused", 1024)


def test_the_metrics_walk_refuses_links_but_not_owners(tmp_path: Path) -> None:
    """``open_directory`` with no owner rule (node_exporter's folder may be another user's)
    still follows no link."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    os.close(open_directory(str(tmp_path / "real"), owners=None))
    with pytest.raises(StateDirError, match="symbolic link"):
        open_directory(str(tmp_path / "link"), owners=None)


# --- the attack, end to end ----------------------------------------------------------------------


def _forged_view(daemon_pid: int, workers: list[int], host: SimHost) -> str:
    """A holders.json that names ``daemon_pid`` as the daemon, with the right start ticks and
    boot id (anyone can read those), as a user who can write state_dir would write it."""
    with open(f"/proc/{daemon_pid}/stat", encoding="ascii") as handle:
        ticks = int(handle.read().rpartition(")")[2].split()[19])
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
        boot_id = handle.read().strip()
    view = holder_view.HolderView.of(
        boot_id=boot_id,
        daemon_pid=daemon_pid,
        daemon_start_ticks=ticks,
        worker_pids=frozenset(workers),
        polled=time.time(),
        fresh_for=300.0,
        settings=("/proc", str(host.devices_dir), 195),
        holders=HolderScan("full"),
        start_ticks={},
        dead_listed=frozenset(),
    )
    return json.dumps(view.document())


def _as_attacker(state_dir: Path, name: str, text: str) -> int:
    """Write ``state_dir/name`` as uid 1001, through a descriptor of the folder (the test's own
    temporary folders above it are root's and closed to others)."""
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        done = subprocess.run(
            ["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups",
             "sh", "-c", f'cat > "/proc/self/fd/{fd}/{name}"'],
            input=text, text=True, pass_fds=(fd,), capture_output=True, check=False,
        )  # fmt: skip
    finally:
        os.close(fd)
    return done.returncode


def attack_check_clean(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with SimHost(root) as host:
        host.spawn("holder", [{"open": host.dev("nvidiactl", "nvidia0")}])
        pids = host.wait_ready("holder")
        holder = pids["holder"]
        host.nvml([gpu(0, allocated=600 * MiB)])
        config = str(host.config())
        before = host.gpuwatchd("check-clean", "--config", config)
        out["before"] = (before.returncode, before.stdout)
        # The attacker owns state_dir (a careless install) and names the holder as the daemon
        # and as its NVML worker, in the view and in the state file.
        os.chown(host.state_dir, ATTACKER, ATTACKER)
        out["wrote"] = [
            _as_attacker(host.state_dir, holder_view.VIEW_FILE,
                         _forged_view(holder, [holder], host)),
            _as_attacker(host.state_dir, "state.json", json.dumps({"status": {"pid": holder}})),
        ]  # fmt: skip
        refused = host.gpuwatchd("check-clean", "--config", config)
        out["untrusted"] = (refused.returncode, refused.stderr)
        # Even in a trusted folder (root's again), the forged files are only words.
        os.chown(host.state_dir, 0, 0)
        for name in (holder_view.VIEW_FILE, "state.json"):
            os.chown(host.state_dir / name, 0, 0)
        trusted = host.gpuwatchd("check-clean", "--config", config)
        out["trusted"] = (trusted.returncode, trusted.stdout)
        scan = host.scan_json(host.config())
        out["view"] = scan["daemon_view"]
        out["holder_seen"] = any(
            h["pid"] == holder for g in scan["gpus"] for h in g.get("holders", [])
        )
    return out


@needs_namespace
@needs_root_setpriv
def test_a_user_who_can_write_state_dir_cannot_make_a_dirty_gpu_clean(tmp_path: Path) -> None:
    out = run_in_pid_namespace(f"{__name__}:attack_check_clean", {}, root=tmp_path)
    assert out["before"][0] == 1, out["before"]
    assert out["wrote"] == [0, 0], "the attacker could write into the folder it owns"
    code, err = out["untrusted"]
    assert code == 78, err
    assert f"owned by uid {ATTACKER}" in err
    code, lines = out["trusted"]
    assert code == 1, "the forged daemon PID hides nothing: the GPU is still dirty"
    assert "GPU 0" in lines
    assert out["view"]["used"] is False  # a scan reads no holders.json: the daemon answers
    assert out["view"]["answered_by"] == "this scan"
    assert out["holder_seen"]


def test_running_without_root_keeps_working_in_a_folder_of_ones_own(tmp_path: Path) -> None:
    """The trust rule accepts the user running the command as an owner, so unprivileged test
    and dry runs work; a uid that is neither root nor this user is refused."""
    path = tmp_path / "state"
    StateDir.open(str(path), create=True, euid=os.geteuid()).close()
    assert path.stat().st_mode & 0o777 == 0o700
    if os.geteuid() == 0:
        os.chown(path, ATTACKER, ATTACKER)
        StateDir.open(str(path), euid=ATTACKER).close()
        with pytest.raises(StateDirError, match=f"owned by uid {ATTACKER}, not root$"):
            StateDir.open(str(path))


# --- no irreversible step while the state cannot be saved -----------------------------------------


def _fill(folder: Path) -> Path:
    """Write a file into ``folder`` until its filesystem is full; the file's path."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    return filler


def full_disk(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    small = root / "small"
    small.mkdir(mode=0o700)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(small)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        return {"skipped": f"cannot mount a small tmpfs: {mounted.stderr.strip()}"}
    state_dir = small / "state"
    state_dir.mkdir(mode=0o700)
    with SimHost(root) as host:
        host.nvml([gpu(0)])
        run = Run(host, state_dir=str(state_dir))
        run.start()
        started = run.wait_for((state_dir / "state.json").exists)
        filler = _fill(small)
        orphan_host(host)
        worker = host.pids["worker"]
        withheld = run.wait_for(lambda: run.saw(EventName.ACTION_WITHHELD))
        time.sleep(1.0)  # several polls: still nothing sent
        alive_while_full = host.alive(worker)
        signals_while_full = [e for e in run.events() if e.get("event") == EventName.ACTION_SIGNAL]
        filler.unlink()
        gone = run.wait_for(lambda: host.state_of(worker) is None)
        saved = json.loads((state_dir / "state.json").read_text())
        run.stop(signal.SIGKILL)
        return {
            "started": started,
            "withheld": withheld,
            "withheld_events": [
                e for e in run.events() if e.get("event") == EventName.ACTION_WITHHELD
            ],
            "save_failed": run.saw(EventName.STATE_SAVE_FAILED),
            "alive_while_full": alive_while_full,
            "signals_while_full": signals_while_full,
            "gone": gone,
            "history": saved["plan"]["signal_history"],
            "worker": worker,
        }


@needs_namespace
def test_no_signal_is_sent_while_state_dir_is_full(tmp_path: Path) -> None:
    """With state_dir's filesystem full the SIGTERM that the state cannot record is not sent
    (``action.withheld`` says so); once there is room it is saved first, then sent."""
    out = run_in_pid_namespace(f"{__name__}:full_disk", {}, root=tmp_path, timeout=120)
    if "skipped" in out:
        pytest.skip(out["skipped"])
    assert out["started"]
    assert out["withheld"], "no action.withheld while the disk was full"
    assert out["save_failed"]
    assert out["alive_while_full"], "a signal went out that the state could not record"
    assert out["signals_while_full"] == []
    assert f"SIGTERM to pid {out['worker']}" in out["withheld_events"][0]["steps"]
    assert out["gone"], "the step was taken once the state could be saved"
    assert [entry[0].split("@")[0] for entry in out["history"]] == [str(out["worker"])], (
        "the kill cap counts it"
    )


def test_the_lenient_reader_gives_unknown_for_every_malformed_part(tmp_path: Path) -> None:
    """One typed, lenient way to read what the state files say: a missing or malformed value
    is None, never an exception (the readers of state.json share it)."""
    doc = {"status": {"pid": 42, "bad": True, "big": 10**400, "t": 1.5, "nan": float("nan")}}
    status = as_map(doc.get("status"))
    assert as_int(status.get("pid")) == 42
    assert as_int(status.get("bad")) is None
    assert as_number(status.get("big")) is None
    assert as_number(status.get("t")) == 1.5
    assert as_number(status.get("nan")) is None
    assert as_int(as_map(as_map(doc.get("missing")).get("deeper")).get("pid")) is None
    assert as_map(as_map([1, 2]).get("status")) == {}
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    (path / "state.json").write_text('{"a": ' + "1" * 5000 + "}")
    with capture_logs() as logs:
        assert StateStore(str(path)).load() == {}  # present, not valid JSON: moved aside
        assert StateStore(str(tmp_path / "absent")).load() == {}  # absent: nothing said
    [said] = logs
    assert said["event"] == EventName.STATE_CORRUPT
    assert "not valid JSON" in str(said["why"])
    assert [p.name.split("-")[0] for p in path.iterdir()] == ["state.json.corrupt"]
