"""The socket a running daemon answers ``scan`` on (gpuwatchd/served/scan_socket.py) and the
command's first step (gpuwatchd/cli/entry.py): which command lines ask, the format read as
hostile input on both sides, and the server's limits — a silent, slow, garbled or failing
exchange never stops the daemon, and always leaves the command to scan by itself."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatchd.cli.entry import answered_by_daemon, scan_arguments
from gpuwatchd.served import scan_socket
from gpuwatchd.served.scan_socket import (
    SOCKET_NAME,
    ExchangeError,
    ScanAnswer,
    ScanRequest,
    ScanServer,
    ask,
    decode_answer_header,
    decode_request,
    encode_answer,
    encode_request,
)

# --- which command lines ask ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["scan"], (None, False, "auto")),
        (["scan", "--json"], (None, True, "auto")),
        (["--config", "/c.yaml", "scan", "--json"], ("/c.yaml", True, "auto")),
        (["scan", "--config=/c.yaml", "--color", "never"], ("/c.yaml", False, "never")),
        (["scan", "--color=always", "--json"], (None, True, "always")),
    ],
)
def test_a_plain_scan_asks_the_daemon(
    argv: list[str], expected: tuple[str | None, bool, str]
) -> None:
    assert scan_arguments(argv) == expected


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["status"],
        ["scan", "--full"],
        ["scan", "--json", "--json"],
        ["--config", "/a", "scan", "--config", "/b"],  # argparse's rule for a repeat: its own
        ["scan", "--js"],  # an abbreviation argparse accepts: the full command line reads it
        ["scan", "--color", "purple"],
        ["--color", "never", "scan"],  # --color belongs to scan: argparse refuses it here
        ["--json", "scan"],
        ["scan", "--config"],
        ["scan", "--config", "--json"],
        ["scan", "--config="],
        ["scan", "extra"],
        ["scan", "scan"],
        ["scan", "-h"],
    ],
)
def test_any_other_command_line_is_left_to_the_full_command(argv: list[str]) -> None:
    assert scan_arguments(argv) is None
    assert answered_by_daemon(argv) is None


# --- the format, read as hostile input -----------------------------------------------------------


def test_a_request_and_an_answer_read_back_as_written() -> None:
    request = ScanRequest("/etc/gpuwatchd/gpuwatchd.yaml", True, False)
    assert decode_request(encode_request(request)) == request
    answer = ScanAnswer(True, "answered", 77, '{"x": 1}\n', ("gpuwatchd: a note",))
    head, _, body = encode_answer(answer).partition(b"\n")
    assert decode_answer_header(head) == answer._replace(stdout="")
    assert body.decode() == answer.stdout
    declined = encode_answer(ScanAnswer(False, "the view is dirty", stdout="never sent"))
    assert declined.endswith(b"\n")
    assert b"never sent" not in declined


def _line(doc: object) -> bytes:
    return json.dumps(doc).encode() + b"\n"


GOOD = {"version": 1, "config": "/etc/g.yaml", "json": True, "color": False}


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{not json}\n",
        b"[]\n",
        b'{"version": 1}',  # no newline
        b"\xff\xfe\n",
        _line({**GOOD, "version": 2}),
        _line({**GOOD, "version": True}),
        _line({**GOOD, "version": 1.0}),
        _line({**GOOD, "extra": 1}),
        _line({k: v for k, v in GOOD.items() if k != "color"}),
        _line({**GOOD, "config": "relative.yaml"}),
        _line({**GOOD, "config": ""}),
        _line({**GOOD, "config": "/a\0b"}),
        _line({**GOOD, "config": 7}),
        _line({**GOOD, "json": "yes"}),
        _line({**GOOD, "color": 1}),
        _line({**GOOD, "config": "/" + "a" * 5000}),
        b"[" * 5000 + b"\n",
    ],
)
def test_a_malformed_request_is_refused_with_a_reason(raw: bytes) -> None:
    with pytest.raises(ExchangeError):
        decode_request(raw)


HEAD = {"version": 1, "answered": True, "reason": "answered", "exit": 0, "stderr": []}


@pytest.mark.parametrize(
    "doc",
    [
        {**HEAD, "version": 0},
        {**HEAD, "version": True},
        {**HEAD, "answered": "yes"},
        {**HEAD, "exit": 256},
        {**HEAD, "exit": -1},
        {**HEAD, "exit": True},
        {**HEAD, "reason": None},
        {**HEAD, "stderr": "one line"},
        {**HEAD, "stderr": [1]},
        {**HEAD, "stderr": ["x"] * 17},
        [],
    ],
)
def test_a_malformed_answer_header_is_refused(doc: object) -> None:
    with pytest.raises(ExchangeError):
        decode_answer_header(json.dumps(doc).encode())


# --- the server and the command, in one process --------------------------------------------------


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield tmp_path, fd
    finally:
        os.close(fd)


class Served:
    """A server answering with ``answer``, served from the test's thread while a command
    asks from another."""

    def __init__(self, fd: int, answer: Callable[[ScanRequest], ScanAnswer]) -> None:
        self.problems: list[str] = []
        self.asked: list[ScanRequest] = []

        def recorded(request: ScanRequest) -> ScanAnswer:
            self.asked.append(request)
            return answer(request)

        self.server = ScanServer(recorded, self.problems.append)
        assert self.server.start(fd) is None

    def serve_until(self, done: threading.Event, timeout: float = 10.0) -> int:
        served = 0
        deadline = time.monotonic() + timeout
        listening = self.server.fileno()
        assert listening is not None
        while not done.is_set() and time.monotonic() < deadline:
            ready, _, _ = select.select([listening], [], [], 0.05)
            if ready:
                served += self.server.serve()
        return served


def _ask_in_thread(
    folders: list[str], request: ScanRequest, timeout: float = 5.0
) -> tuple[threading.Event, list[ScanAnswer]]:
    done = threading.Event()
    answers: list[ScanAnswer] = []

    def run() -> None:
        answers.append(ask(folders, request, timeout))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, answers


REQUEST = ScanRequest("/etc/gpuwatchd/gpuwatchd.yaml", True, False)


def test_the_command_prints_what_the_daemon_answered(folder: tuple[Path, int]) -> None:
    path, fd = folder
    report = json.dumps({"gpus": [], "daemon_view": {"answered_by": "daemon"}}) + "\n"
    served = Served(fd, lambda request: ScanAnswer(True, "answered", 0, report, ()))
    mode = os.stat(path / SOCKET_NAME).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600
    done, answers = _ask_in_thread([str(path / "missing"), str(path)], REQUEST)
    assert served.serve_until(done) == 1
    assert answers == [ScanAnswer(True, "answered", 0, report, ())]
    assert served.asked == [REQUEST]
    assert served.server.answered == 1
    assert served.problems == []
    served.server.close()
    assert not (path / SOCKET_NAME).exists()


def test_a_refusal_reaches_the_command_which_then_scans_by_itself(
    folder: tuple[Path, int],
) -> None:
    path, fd = folder
    served = Served(fd, lambda request: ScanAnswer(False, "the view is dirty"))
    done, answers = _ask_in_thread([str(path)], REQUEST)
    served.serve_until(done)
    assert answers == [ScanAnswer(False, "the view is dirty")]
    assert served.server.declined == 1
    served.server.close()


def test_a_failing_answer_declines_that_request_and_the_server_goes_on(
    folder: tuple[Path, int],
) -> None:
    path, fd = folder

    def broken(request: ScanRequest) -> ScanAnswer:
        raise RuntimeError("a bug in the served scan")

    served = Served(fd, broken)
    done, answers = _ask_in_thread([str(path)], REQUEST)
    served.serve_until(done)
    assert answers[0].answered is False
    assert "RuntimeError" in answers[0].reason
    assert any("a bug in the served scan" in p for p in served.problems)
    done, answers = _ask_in_thread([str(path)], REQUEST)  # still listening
    served.serve_until(done)
    assert answers[0].answered is False
    served.server.close()


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path / SOCKET_NAME))
    return sock


def test_a_silent_client_costs_the_daemon_at_most_the_request_timeout(
    folder: tuple[Path, int],
) -> None:
    path, fd = folder
    served = Served(fd, lambda request: ScanAnswer(True, "answered", 0, "{}\n", ()))
    with _connect(path):
        started = time.monotonic()
        assert served.server.serve() == 1
        took = time.monotonic() - started
    assert took < scan_socket.REQUEST_TIMEOUT + 1.0
    assert served.asked == []
    assert any("in time" in p for p in served.problems)
    served.server.close()


@pytest.mark.parametrize(
    "sent",
    [b"garbage\n", b"x" * (scan_socket.MAX_REQUEST + 10), encode_request(REQUEST) + b"more\n"],
)
def test_a_garbled_request_is_refused_and_never_answered(
    folder: tuple[Path, int], sent: bytes
) -> None:
    path, fd = folder
    served = Served(fd, lambda request: ScanAnswer(True, "answered", 0, "{}\n", ()))
    with _connect(path) as client:
        client.sendall(sent)
        client.shutdown(socket.SHUT_WR)
        assert served.server.serve() == 1
        try:
            reply = client.recv(1 << 16)
        except ConnectionResetError:  # bytes left unread by the daemon may reset the exchange
            reply = b""
    assert served.asked == []
    assert any(p.startswith("a request was refused") for p in served.problems)
    if reply:
        head = decode_answer_header(reply.partition(b"\n")[0])
        assert head.answered is False
        assert head.reason.startswith("bad request")
    served.server.close()


def test_at_most_max_per_wake_connections_are_answered_per_wake(
    folder: tuple[Path, int],
) -> None:
    path, fd = folder
    served = Served(fd, lambda request: ScanAnswer(True, "answered", 0, "{}\n", ()))
    clients = [_connect(path) for _ in range(scan_socket.MAX_PER_WAKE + 2)]
    try:
        for client in clients:
            client.sendall(encode_request(REQUEST))
        assert served.server.serve() == scan_socket.MAX_PER_WAKE
        assert served.server.serve() == 2
    finally:
        for client in clients:
            client.close()
        served.server.close()


def test_a_stale_socket_is_replaced_and_anything_else_is_left_alone(
    folder: tuple[Path, int],
) -> None:
    path, fd = folder
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path / SOCKET_NAME))
    stale.close()  # a daemon that was killed left its socket behind
    server = ScanServer(lambda request: ScanAnswer(False, "no"), print)
    assert server.start(fd) is None
    server.close()
    (path / SOCKET_NAME).write_text("not a socket")
    server = ScanServer(lambda request: ScanAnswer(False, "no"), print)
    error = server.start(fd)
    assert error is not None
    assert "not a socket" in error
    assert server.fileno() is None
    assert (path / SOCKET_NAME).read_text() == "not a socket"


def test_closing_removes_only_the_socket_this_server_made(folder: tuple[Path, int]) -> None:
    path, fd = folder
    server = ScanServer(lambda request: ScanAnswer(False, "no"), print)
    assert server.start(fd) is None
    os.unlink(path / SOCKET_NAME)
    (path / SOCKET_NAME).write_text("someone else's")
    server.close()
    assert (path / SOCKET_NAME).read_text() == "someone else's"


def test_a_long_state_dir_path_still_works(tmp_path: Path) -> None:
    """A socket's path is at most 107 bytes; a state_dir's is not."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
    try:
        served = Served(fd, lambda request: ScanAnswer(True, "answered", 0, "{}\n", ()))
        done, answers = _ask_in_thread([str(deep)], REQUEST)
        served.serve_until(done)
        assert answers[0].answered is True
        served.server.close()
    finally:
        os.close(fd)


def test_no_socket_or_no_listener_means_not_asked(tmp_path: Path) -> None:
    assert ask([str(tmp_path)], REQUEST, 1.0).answered is False
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / SOCKET_NAME))  # bound, never listening: refused
    try:
        answer = ask([str(tmp_path)], REQUEST, 1.0)
    finally:
        dead.close()
    assert answer == ScanAnswer(False, "no daemon socket")


def test_a_state_dir_with_a_nul_byte_is_no_socket_and_the_command_reads_the_files_itself(
    tmp_path: Path,
) -> None:
    """The state_dir is guessed from the main file's bytes before they are parsed: a NUL in it
    (which the configuration reader refuses, exit 78 naming the file) is asked nowhere."""
    assert ask([f"{tmp_path}/st\0ate", str(tmp_path)], REQUEST, 1.0) == ScanAnswer(
        False, "no daemon socket"
    )
    config = tmp_path / "gpuwatchd.yaml"
    config.write_bytes(f"state_dir: {tmp_path}/st\0ate\n".encode())
    answer = answered_by_daemon(["--config", str(config), "scan"])
    assert answer is not None
    assert answer.answered is False


def test_a_daemon_that_does_not_answer_in_time_is_given_up(folder: tuple[Path, int]) -> None:
    path, fd = folder
    server = ScanServer(lambda request: ScanAnswer(True, "answered", 0, "{}\n", ()), print)
    assert server.start(fd) is None  # listening, never serving
    started = time.monotonic()
    answer = ask([str(path)], REQUEST, 0.3)
    assert time.monotonic() - started < 2.0
    assert answer.answered is False
    assert "in time" in answer.reason
    server.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a child switches to another user")
def test_another_user_can_neither_connect_nor_be_answered() -> None:
    path = Path(tempfile.mkdtemp(prefix="gw-sock-", dir="/tmp"))  # one another user can reach
    os.chmod(path, 0o755)  # noqa: S103 - another user must reach it
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    served = Served(fd, lambda request: ScanAnswer(True, "answered", 0, "{}\n", ()))

    listening = served.server.fileno()
    assert listening is not None

    def as_nobody(chmod_socket: bool) -> str:
        if chmod_socket:
            # Only the kernel's word on the peer is left to refuse it.
            os.chmod(path / SOCKET_NAME, 0o666)  # noqa: S103
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(read)
            try:
                os.setgid(65534)
                os.setuid(65534)
                answer = ask([str(path)], REQUEST, 3.0)
                os.write(write, answer.reason.encode()[:500])
            finally:
                os._exit(0)
        os.close(write)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if select.select([listening], [], [], 0.05)[0]:
                served.server.serve()
            if select.select([read], [], [], 0)[0]:
                break
        os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as handle:
            return handle.read().decode()

    try:
        assert "Permission denied" in as_nobody(False)
        assert "uid 65534 may not ask" in as_nobody(True)
        assert served.asked == []
    finally:
        served.server.close()
        os.close(fd)
        shutil.rmtree(path)
