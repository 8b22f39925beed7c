"""The notification helpers in ``contrib/notify/`` that ``on_action`` examples run.

The webhook poster is run against a local HTTP server (loopback only); the owner notice
against a fake ``logger`` and ``mail`` on PATH. No network beyond 127.0.0.1, no real mail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

CONTRIB = Path(__file__).resolve().parent.parent / "contrib" / "notify"
WEBHOOK = CONTRIB / "gpuwatchd-webhook"
TELL_OWNER = CONTRIB / "gpuwatchd-tell-owner"

FACTS = {
    "GPUWATCHD_EVENT": "on_action",
    "GPUWATCHD_ACTION": "signal",
    "GPUWATCHD_OUTCOME": "freed",
    "GPUWATCHD_REASON": "4242@99: freed (target exited)",
    "GPUWATCHD_GPU_UUID": "GPU-8f0a1e2b-0000-1111-2222-333344445555",
    "GPUWATCHD_USER": "alice",
    "GPUWATCHD_PID": "4242",
    "GPUWATCHD_RULE": "orphans",
}


class _Server:
    def __init__(self, status: int) -> None:
        self.status = status
        self.bodies: list[dict[str, object]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                outer.bodies.append(json.loads(self.rfile.read(length)))
                self.send_response(outer.status)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[_Server]:
    srv = _Server(getattr(request, "param", 204))
    yield srv
    srv.close()


def run_webhook(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "GPUWATCHD_WEBHOOK_URL": url, **FACTS}
    return subprocess.run(
        [sys.executable, str(WEBHOOK), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_the_webhook_posts_the_facts_as_json(server: _Server) -> None:
    done = run_webhook(server.url, "gpu17")
    assert done.returncode == 0, done.stderr
    (body,) = server.bodies
    assert body["host"] == "gpu17"
    assert body["outcome"] == "freed"
    assert body["user"] == "alice"
    assert body["gpu"] == FACTS["GPUWATCHD_GPU_UUID"]
    assert "gpu17" in str(body["text"])
    assert "alice" in str(body["text"])


@pytest.mark.parametrize("server", [500], indirect=True)
def test_a_server_error_is_a_failed_hook(server: _Server) -> None:
    done = run_webhook(server.url, "gpu17")
    assert done.returncode == 1
    assert "webhook post failed" in done.stderr


def test_only_http_urls_are_posted_to() -> None:
    done = run_webhook("file:///etc/shadow", "gpu17")
    assert done.returncode == 1
    assert "must be http" in done.stderr


def test_the_owner_notice_logs_and_mails_the_owner(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    for tool in ("logger", "mail"):
        fake = tmp_path / tool
        fake.write_text(f'#!/bin/sh\n{{ echo "{tool} $*"; cat; }} >> "{calls}"\n')
        fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", **FACTS}
    done = subprocess.run(
        [str(TELL_OWNER), "alice", "gpu17"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    text = calls.read_text()
    assert "logger -t gpuwatchd-notify -- to alice: gpuwatchd on gpu17: signal freed" in text
    assert "mail -s gpuwatchd: your GPU process on gpu17 -- alice" in text
