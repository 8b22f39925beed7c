"""The notification helpers in ``contrib/notify/`` that ``on_action`` examples run.

The webhook poster is run against a local HTTP server (loopback only); the owner notice
against a fake ``logger`` and ``mail`` on PATH. No network beyond 127.0.0.1, no real mail.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from gpuwatchd.config.units import parse_duration
from gpuwatchd.decide.argv import HOOK_PLACEHOLDERS, check_command

CONTRIB = Path(__file__).resolve().parents[2] / "contrib" / "notify"
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
                if 300 <= outer.status < 400:
                    self.send_header("Location", "/moved")
                self.end_headers()

            def do_GET(self) -> None:  # where urllib follows a 301-303 of a POST, bodiless
                outer.bodies.append({"GET": self.path})
                self.send_response(200)
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


def test_the_webhook_text_is_the_daemon_s_sentence_when_it_is_given(server: _Server) -> None:
    """GPUWATCHD_MESSAGE (the event catalogue's wording) is the chat line, not the bare facts
    ("signal freed of alice (4242@99: …)"); still neutralised for chat markup."""
    message = "PID 4242 of user alice on GPU-8f0a…, signalled by rule orphans, was stopped <!here>."
    env = {"PATH": os.environ["PATH"], "GPUWATCHD_WEBHOOK_URL": server.url, **FACTS,
           "GPUWATCHD_MESSAGE": message}  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(WEBHOOK), "gpu17"], env=env, capture_output=True, text=True,
        timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (body,) = server.bodies
    text = str(body["text"])
    assert text.startswith("gpuwatchd on gpu17: PID 4242 of user alice on GPU-8f0a…, signalled")
    assert "4242@99" not in text
    assert "<!here>" not in text
    assert "&lt;!\u200bhere&gt;" in text


@pytest.mark.parametrize("server", [500], indirect=True)
def test_a_server_error_is_a_failed_hook(server: _Server) -> None:
    done = run_webhook(server.url, "gpu17")
    assert done.returncode == 1
    assert "webhook post failed" in done.stderr


@pytest.mark.parametrize("server", [301, 302, 303, 307], indirect=True)
def test_a_redirect_is_a_failed_hook_never_a_post_lost_as_a_get(server: _Server) -> None:
    """urllib turns a POST redirected by 301-303 into a GET without the body: the notification
    was lost, yet the GET's 200 made the hook succeed. A redirect is a failure, followed never."""
    done = run_webhook(server.url, "gpu17")
    assert done.returncode == 1
    assert "webhook post failed" in done.stderr
    assert len(server.bodies) == 1
    assert "GET" not in server.bodies[0]


def test_only_http_urls_are_posted_to() -> None:
    done = run_webhook("file:///etc/shadow", "gpu17")
    assert done.returncode == 1
    assert "must be http" in done.stderr


def test_a_refused_url_is_not_written_to_the_log() -> None:
    """stderr is ``EventName.HOOK_RUN``'s output in the journal; a mistyped URL still holds the
    token (a Mattermost hook's whole secret is its path): only the scheme is said."""
    done = run_webhook("htps://mm.example.com/hooks/xq7secret", "gpu17")
    assert done.returncode == 1
    assert "must be http" in done.stderr
    assert "'htps'" in done.stderr
    assert "example" not in done.stderr
    assert "secret" not in done.stderr


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


HOSTILE_REASON = (
    "4242@99: freed (evil\nSubject: you won\r\n~!id\x1b[2J\u2028<!channel> @here "
    "<http://phish.example|your GPU quota> [click](http://phish.example) " + "x" * 5000 + ")"
)


def _tell_owner(tmp_path: Path, *args: str, reason: str) -> tuple[int, list[list[str]], str]:
    """Run tell-owner with fake logger and mail that record each argument on its own line
    (NUL-separated calls), and the mail body."""
    calls = tmp_path / "calls"
    body = tmp_path / "body"
    logger = tmp_path / "logger"
    logger.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\036" "$a"; done >> "{calls}"\n'
                      f'printf "\\0" >> "{calls}"\n')  # fmt: skip
    mail = tmp_path / "mail"
    mail.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\036" "$a"; done >> "{calls}"\n'
                    f'printf "\\0" >> "{calls}"\ncat > "{body}"\n')  # fmt: skip
    for tool in (logger, mail):
        tool.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", **FACTS, "GPUWATCHD_REASON": reason}
    done = subprocess.run(
        [str(TELL_OWNER), *args], env=env, stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=30, check=False,
    )  # fmt: skip
    recorded = calls.read_text() if calls.exists() else ""
    argvs = [call.split("\036")[:-1] for call in recorded.split("\0") if call]
    return done.returncode, argvs, body.read_text() if body.exists() else ""


def test_the_owner_notice_keeps_a_hostile_reason_out_of_headers_and_syslog(tmp_path: Path) -> None:
    """A process name with newlines and escapes cannot add a mail header, start a mailx tilde
    command, paint a terminal or split the syslog line; everything is bounded."""
    code, argvs, body = _tell_owner(tmp_path, "alice", "gpu17", reason=HOSTILE_REASON)
    assert code == 0
    (logger, mail) = argvs
    assert logger[:3] == ["-t", "gpuwatchd-notify", "--"]
    (line,) = logger[3:]
    assert line.isprintable()
    assert line.isascii()
    assert len(line) < 1024
    assert "Subject: you won" in line, "the text is kept, on one line"
    assert mail == ["-s", "gpuwatchd: your GPU process on gpu17", "--", "alice"]
    first, *rest = body.splitlines()
    assert first.startswith("gpuwatchd on gpu17: signal freed: ")
    assert first.isprintable()
    assert first.isascii()
    assert not any(part.startswith("~") for part in body.splitlines())
    assert "Subject:" not in "\n".join(rest)


@pytest.mark.parametrize("user", ["-oFoo", "bob\nCc: eve", "a b", ""])
def test_the_owner_notice_refuses_what_is_not_a_user_name(tmp_path: Path, user: str) -> None:
    code, argvs, _ = _tell_owner(tmp_path, user, "gpu17", reason="x")
    assert code == 2
    assert argvs == []


def test_the_webhook_text_mentions_no_one_and_disguises_no_link(server: _Server) -> None:
    env_reason = dict(FACTS, GPUWATCHD_REASON=HOSTILE_REASON)
    done = subprocess.run(
        [sys.executable, str(WEBHOOK), "gpu17"],
        env={"PATH": os.environ["PATH"], "GPUWATCHD_WEBHOOK_URL": server.url, **env_reason},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (body,) = server.bodies
    text = str(body["text"])
    for markup in ("<!channel>", "<http", "@here", "](", "http://", "\n", "\x1b", "\u2028"):
        assert markup not in text, markup
    assert "&lt;!\u200bchannel&gt;" in text, "shown as text, not dropped"
    assert len(text) <= 1000
    reason = str(body["reason"])
    assert "\n" not in reason
    assert "\x1b" not in reason
    assert len(reason) <= 600


# --- the on_action examples that run the helpers --------------------------------------------

DOCS = CONTRIB.parents[1] / "docs"


def _helper_examples() -> list[tuple[str, list[str], float]]:
    """(where, argv, timeout in seconds) of every documented on_action hook that runs a helper:
    the YAML blocks of docs/policy.md and docs/operations.md, and each helper's own header."""
    blocks = [
        (doc.name, block)
        for doc in (DOCS / "policy.md", DOCS / "operations.md")
        for block in re.findall(r"```yaml\n(.*?)```", doc.read_text(), re.S)
    ]
    for helper in (WEBHOOK, TELL_OWNER):
        header = re.search(r"\n([# ]*)on_action:\n(.*?)\n[# ]*\n", helper.read_text(), re.S)
        assert header is not None, helper.name
        lines = [line[len(header[1]) :] for line in header[2].splitlines()]
        blocks.append((helper.name, "\n".join(["on_action:", *lines])))
    found = []
    for where, block in blocks:
        for hook in yaml.safe_load(textwrap.dedent(block)).get("on_action") or []:
            argv = hook["command"] if isinstance(hook, dict) else hook
            timeout = (
                parse_duration(hook.get("timeout", "1m"), where="timeout")
                if isinstance(hook, dict)
                else 60
            )
            if any(arg.startswith("/") and "gpuwatchd-" in arg for arg in argv):
                found.append((where, [str(arg) for arg in argv], timeout))
    return found


def test_the_docs_show_each_helper_run_with_what_it_reads() -> None:
    """Each documented hook that runs a helper is a valid hook, names the helper where the docs
    say to copy it, waits for it (so its failure shows in ``EventName.HOOK_RUN``) and passes
    through systemd-run every GPUWATCHD_* variable the helper reads: systemd-run passes none
    unasked."""
    examples = _helper_examples()
    assert {where for where, _, _ in examples} == {
        "policy.md", "operations.md", WEBHOOK.name, TELL_OWNER.name
    }  # fmt: skip
    for where, argv, _ in examples:
        check_command(argv, HOOK_PLACEHOLDERS)
        helper = next(Path(arg) for arg in argv if "gpuwatchd-" in arg)
        assert helper.parent == Path("/usr/local/sbin"), (where, argv)
        reads = set(
            re.findall(r'(?:get\("|\$\{)(GPUWATCHD_[A-Z_]+)', (CONTRIB / helper.name).read_text())
        )
        passed = {argv[i + 1] for i, arg in enumerate(argv) if arg == "-E"}
        assert argv[:2] == ["systemd-run", "--wait"], (where, argv)
        assert reads - {"GPUWATCHD_WEBHOOK_URL", "GPUWATCHD_HOSTNAME"} <= passed, (where, argv)


def test_the_docs_end_each_helpers_transient_unit_before_the_hook_timeout() -> None:
    """The daemon kills a hook at its timeout by its process tree, which a transient unit of
    systemd-run is not part of: only the unit's own RuntimeMaxSec= ends a helper that hangs."""
    for where, argv, timeout in _helper_examples():
        props = [argv[i + 1] for i, arg in enumerate(argv) if arg in ("-p", "--property")]
        limits = [
            parse_duration(prop.split("=", 1)[1], where=prop)
            for prop in props
            if prop.startswith("RuntimeMaxSec=")
        ]
        assert len(limits) == 1, (where, argv)
        assert limits[0] < timeout, (where, argv)
