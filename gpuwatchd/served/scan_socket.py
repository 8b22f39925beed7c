"""The socket on which a running daemon answers ``scan`` (docs/scan.md, "Answered by the daemon"),
or declines and says why (the command then scans by itself).

In detail: docs/internals.md, section `gpuwatchd.served.scan_socket`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import struct
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

SOCKET_NAME = "scan.sock"
VERSION = 1
MAX_REQUEST = 8192  # bytes of the request line, newline included
MAX_HEADER = 65536  # bytes of the answer's header line
MAX_BODY = 64 << 20  # bytes of the printed report (a node's report is ~100 kB)
MAX_STDERR_LINES = 16
MAX_PATH = 4096
REQUEST_TIMEOUT = 0.5  # seconds the daemon waits for a connected command's request
SEND_TIMEOUT = 2.0  # seconds the daemon waits for the command to take its answer
MAX_PER_WAKE = 4  # connections answered each time the daemon's loop wakes
BACKLOG = 8
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class ExchangeError(Exception):
    """The other side sent something this side does not accept (or nothing in time)."""


class ScanRequest(NamedTuple):
    """What the command asks: a report for ``config`` (an absolute path), as JSON or text."""

    config: str
    as_json: bool
    color: bool


class ScanAnswer(NamedTuple):
    """The daemon's answer: ``answered`` False with ``reason`` when it declines (the command
    then scans by itself); else what the command prints and its exit code."""

    answered: bool
    reason: str
    exit_code: int = 0
    stdout: str = ""
    stderr: tuple[str, ...] = ()


def trusted_peer(uid: int, own_uid: int) -> bool:
    return uid in (0, own_uid)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of ``sock``, as the kernel saw it connect."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    _pid, uid, _gid = _PEERCRED.unpack(raw)
    return int(uid)


def encode_request(request: ScanRequest) -> bytes:
    line = json.dumps(
        {"version": VERSION, "config": request.config, "json": request.as_json,
         "color": request.color},
        separators=(",", ":"),
    )  # fmt: skip
    return line.encode() + b"\n"


def decode_request(raw: bytes) -> ScanRequest:
    """The request in ``raw`` (one line, newline included); ExchangeError naming what is wrong."""
    if len(raw) > MAX_REQUEST or not raw.endswith(b"\n"):
        raise ExchangeError("the request is not one line of at most 8192 bytes")
    doc = _object(raw)
    if set(doc) != {"version", "config", "json", "color"} or not _our_version(doc["version"]):
        raise ExchangeError("the request has unknown keys or another version")
    config, as_json, color = doc["config"], doc["json"], doc["color"]
    if not isinstance(config, str) or not 0 < len(config) <= MAX_PATH:
        raise ExchangeError("the request's config is not a path")
    if not os.path.isabs(config) or "\0" in config:
        raise ExchangeError("the request's config is not an absolute path")
    if not isinstance(as_json, bool) or not isinstance(color, bool):
        raise ExchangeError("the request's json and color are not true or false")
    return ScanRequest(config, as_json, color)


def encode_answer(answer: ScanAnswer) -> bytes:
    header = {
        "version": VERSION,
        "answered": answer.answered,
        "reason": answer.reason[:1000],
        "exit": answer.exit_code,
        "stderr": [line[:4000] for line in answer.stderr[:MAX_STDERR_LINES]],
    }
    head = json.dumps(header, separators=(",", ":")).encode() + b"\n"
    return head + (answer.stdout.encode() if answer.answered else b"")


def _our_version(found: object) -> bool:
    """Whether ``found`` is :data:`VERSION` itself (``true`` and ``1.0`` equal 1 in Python; a
    scan answered must not load core/checked.is_version's imports)."""
    return type(found) is int and found == VERSION


def decode_answer_header(raw: bytes) -> ScanAnswer:
    """The answer's header line (``stdout`` left empty: it is the rest of the stream)."""
    doc = _object(raw)
    answered, reason, code, stderr = (
        doc.get("answered"), doc.get("reason"), doc.get("exit"), doc.get("stderr"),
    )  # fmt: skip
    if not _our_version(doc.get("version")) or not isinstance(answered, bool):
        raise ExchangeError("the answer has another version")
    if not isinstance(reason, str) or len(reason) > 1000:
        raise ExchangeError("the answer's reason is not a short text")
    if not isinstance(code, int) or isinstance(code, bool) or not 0 <= code <= 255:
        raise ExchangeError("the answer's exit code is not 0-255")
    if not isinstance(stderr, list) or len(stderr) > MAX_STDERR_LINES:
        raise ExchangeError("the answer's stderr is not a short list")
    lines = tuple(line for line in stderr if isinstance(line, str) and len(line) <= 4000)
    if len(lines) != len(stderr):
        raise ExchangeError("the answer's stderr holds something other than short lines")
    return ScanAnswer(answered, reason, code, "", lines)


def _object(raw: bytes) -> dict[str, object]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise ExchangeError(f"not JSON: {err}") from None
    if not isinstance(doc, dict):
        raise ExchangeError("not a JSON object")
    return doc


class ScanServer:
    """The daemon's listening socket. ``answer`` runs the served scan for a request (an
    exception in it declines that request); ``on_error`` hears what went wrong."""

    def __init__(
        self, answer: Callable[[ScanRequest], ScanAnswer], on_error: Callable[[str], None]
    ) -> None:
        self._answer = answer
        self._on_error = on_error
        self._sock: socket.socket | None = None
        self._dir_fd = -1
        self._inode: tuple[int, int] | None = None
        self.answered = 0
        self.declined = 0
        self.accept_failed = False  # the last serve's accept failed (EMFILE: still queued)

    def start(self, dir_fd: int) -> str | None:
        """Listen on :data:`SOCKET_NAME` in the directory open as ``dir_fd`` (kept open here
        until :meth:`close`); None when listening, else why not."""
        if self._sock is not None:
            return None
        try:
            old = os.stat(SOCKET_NAME, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            old = None
        except OSError as err:
            return f"{SOCKET_NAME}: {err.strerror or err}"
        if old is not None and not stat.S_ISSOCK(old.st_mode):
            return f"{SOCKET_NAME} exists and is not a socket; it is left alone"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        own = os.dup(dir_fd)
        try:
            if old is not None:  # left by a daemon that ended without closing it
                os.unlink(SOCKET_NAME, dir_fd=own)
            sock.bind(_via_fd(own))
            os.chmod(SOCKET_NAME, 0o600, dir_fd=own)
            made = os.stat(SOCKET_NAME, dir_fd=own, follow_symlinks=False)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            os.close(own)
            return f"{SOCKET_NAME}: {err.strerror or err}"
        self._sock, self._dir_fd, self._inode = sock, own, (made.st_dev, made.st_ino)
        return None

    def fileno(self) -> int | None:
        return None if self._sock is None else self._sock.fileno()

    def serve(self) -> int:
        """Answer the connections waiting now (at most :data:`MAX_PER_WAKE`); how many."""
        served = 0
        self.accept_failed = False
        while self._sock is not None and served < MAX_PER_WAKE:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as err:
                self._on_error(f"accept: {err.strerror or err}")
                self.accept_failed = True
                break
            served += 1
            with conn:
                self._serve_one(conn)
        return served

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            uid = peer_uid(conn)
            # Read first either way: a socket closed with bytes unread resets the exchange.
            raw = _read(conn, MAX_REQUEST, time.monotonic() + REQUEST_TIMEOUT, line=True)
            if not trusted_peer(uid, os.geteuid()):
                answer = ScanAnswer(False, f"uid {uid} may not ask this daemon")
            else:
                answer = self._answer_request(raw)
            conn.settimeout(SEND_TIMEOUT)
            conn.sendall(encode_answer(answer))
        except ExchangeError as err:
            self._on_error(f"a request was refused: {err}")
            with contextlib.suppress(OSError):
                conn.sendall(encode_answer(ScanAnswer(False, f"bad request: {err}")))
        except OSError as err:  # the command left, or did not read in time
            self._on_error(f"an answer was not delivered: {err.strerror or err}")

    def _answer_request(self, raw: bytes) -> ScanAnswer:
        request = decode_request(raw)
        try:
            answer = self._answer(request)
        except Exception as err:  # a bug in the served scan: the command scans by itself
            self._on_error(f"the served scan failed: {type(err).__name__}: {err}")
            answer = ScanAnswer(False, f"the daemon's scan failed ({type(err).__name__})")
        self.answered += answer.answered
        self.declined += not answer.answered
        return answer

    def close(self) -> None:
        """Stop listening and remove the socket, if it is still the one made here."""
        if self._sock is None:
            return
        self._sock.close()
        self._sock = None
        with contextlib.suppress(OSError):
            now = os.stat(SOCKET_NAME, dir_fd=self._dir_fd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == self._inode:
                os.unlink(SOCKET_NAME, dir_fd=self._dir_fd)
        os.close(self._dir_fd)
        self._dir_fd = -1


def _via_fd(dir_fd: int) -> str:
    return f"/proc/self/fd/{dir_fd}/{SOCKET_NAME}"


def _read(conn: socket.socket, limit: int, deadline: float, *, line: bool) -> bytes:
    """At most ``limit`` bytes by ``deadline`` (``time.monotonic``): up to and including the
    first newline, nothing after it (``line``: the request), or to the end of the stream (the
    answer); ExchangeError otherwise."""
    late = "no request line in time" if line else "no answer in time"
    data = bytearray()
    while not (line and b"\n" in data):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ExchangeError(late)
        conn.settimeout(left)
        try:
            chunk = conn.recv(min(1 << 16, limit + 1 - len(data)))
        except TimeoutError:
            raise ExchangeError(late) from None
        if not chunk:
            if line:
                raise ExchangeError("the stream ended before a full line")
            return bytes(data)
        data += chunk
        if len(data) > limit:
            raise ExchangeError(
                f"a line longer than {limit} bytes" if line else "the answer is too long"
            )
    if data.index(b"\n") != len(data) - 1:
        raise ExchangeError("bytes after the request line")
    return bytes(data)


def ask(state_dirs: Sequence[str], request: ScanRequest, timeout: float) -> ScanAnswer:
    """Ask the daemon of the first of ``state_dirs`` that listens, within ``timeout`` seconds
    in all. Never raises: whatever goes wrong is a declined answer saying so."""
    deadline = time.monotonic() + timeout
    reason = "no daemon socket"
    for folder in state_dirs:
        try:
            return _ask_one(folder, request, deadline)
        # ValueError: a NUL byte in the path (guessed from a file read as is) names no folder.
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError, ValueError):
            continue  # no daemon listens there
        except ExchangeError as err:
            return ScanAnswer(False, f"the daemon's answer was refused: {err}")
        except OSError as err:
            reason = f"the daemon could not be asked: {err.strerror or err}"
            break
    return ScanAnswer(False, reason)


def _ask_one(folder: str, request: ScanRequest, deadline: float) -> ScanAnswer:
    dir_fd = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect(_via_fd(dir_fd))
            uid = peer_uid(sock)
            if not trusted_peer(uid, os.geteuid()):
                raise ExchangeError(f"the socket belongs to uid {uid}, neither root nor this user")
            try:
                sock.sendall(encode_request(request))
                sock.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon refused before reading: its answer says why
            return _read_answer(sock, deadline)
    except TimeoutError:
        raise ExchangeError("no answer in time") from None
    finally:
        os.close(dir_fd)


def _read_answer(sock: socket.socket, deadline: float) -> ScanAnswer:
    data = _read(sock, MAX_HEADER + MAX_BODY, deadline, line=False)
    head, newline, body = data.partition(b"\n")
    if not newline or len(head) >= MAX_HEADER:
        raise ExchangeError("the answer has no header line")
    answer = decode_answer_header(head)
    if not answer.answered:
        return answer
    try:
        return answer._replace(stdout=body.decode())
    except UnicodeDecodeError:
        raise ExchangeError("the answer's report is not UTF-8") from None
