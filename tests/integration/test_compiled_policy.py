"""The daemon's compiled policy (``state_dir/policy.compiled.json``) that spares ``scan`` YAML.

The compiled form reads back equal to the policy for every kind of value a policy holds; a
scan takes it only while every file the YAML would be read from, and every folder above them,
is unchanged — else (a write, a new drop-in, a loosened mode, a link, another state_dir, a
file not of the daemon's trust, a corrupt or foreign document) it returns None and the caller
parses the YAML as always. The writer never publishes what would not read back equal, nor a
policy the files no longer say.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.config.peek import guess_state_dir
from gpuwatchd.config.schema import load_policy
from gpuwatchd.config.yamlsrc import ConfigError
from gpuwatchd.decide.policy import Policy
from gpuwatchd.state import compiled_policy
from gpuwatchd.state.compiled_policy import COMPILED_FILE, decode, encode, load_compiled
from gpuwatchd.state.directory import StateDir

RICH = """\
interval: 2s
dry_run: false
protect:
  commands: ['^/opt/keep', 'sshd?']
  users: [alice]
rules:
  - name: orphans
    kind: orphaned
    for: 30s
    commands: ['python.*train']
    steps:
      - signal: SIGTERM
        wait: 10s
      - signal: SIGKILL
        wait: 5s
reset:
  before:
    - command: [/usr/local/bin/drain, '{uuid}']
      timeout: 30s
"""


def _setup(tmp_path: Path, text: str = RICH, *drop_ins: tuple[str, str]) -> tuple[Path, Path]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    main = tmp_path / "etc" / "gpuwatchd.yaml"
    main.parent.mkdir(mode=0o755)
    main.write_text(f"state_dir: {state}\n{text}")
    main.chmod(0o644)
    if drop_ins:
        (main.parent / "conf.d").mkdir(mode=0o755)
    for name, body in drop_ins:
        (main.parent / "conf.d" / name).write_text(body)
        (main.parent / "conf.d" / name).chmod(0o644)
    return main, state


def _save(main: Path, state: Path) -> bool:
    with StateDir.open(str(state)) as opened:
        return compiled_policy.save_compiled(
            opened, str(main), load_policy, strict=os.geteuid() == 0
        )


def test_every_kind_of_policy_value_reads_back_equal(tmp_path: Path) -> None:
    main, _ = _setup(tmp_path)
    for policy in (Policy(), load_policy(str(main))):
        data = json.loads(json.dumps(encode(policy)))
        assert decode(data) == policy
    rich = load_policy(str(main))
    assert rich.rules[0].commands[0].pattern == "python.*train"  # a pattern, compiled back


def test_a_scan_takes_the_compiled_policy_while_the_files_are_unchanged(tmp_path: Path) -> None:
    main, state = _setup(tmp_path, RICH, ("50-site.yaml", "interval: 3s\n"))
    assert _save(main, state)
    compiled = load_compiled(str(main), "/nonexistent/default")
    assert compiled == load_policy(str(main))
    assert compiled is not None
    assert compiled.interval == 3.0  # the drop-in's


@pytest.mark.parametrize(
    "change",
    [
        "main file written",
        "drop-in written",
        "drop-in added",
        "drop-in removed",
        "config folder writable by others",
        "main file linked",
        "compiled file writable by others",
        "compiled file corrupt",
        "compiled file names a class it may not",
        "compiled for another main file",
        "found in another state_dir",
    ],
)
def test_anything_changed_or_untrusted_means_read_the_yaml(tmp_path: Path, change: str) -> None:
    main, state = _setup(tmp_path, RICH, ("50-site.yaml", "interval: 3s\n"))
    assert _save(main, state)
    compiled = state / COMPILED_FILE
    conf_d = main.parent / "conf.d"
    default = "/nonexistent/default"
    if change == "main file written":
        main.write_text(main.read_text() + "# a comment changes nothing but the file\n")
    elif change == "drop-in written":
        (conf_d / "50-site.yaml").write_text("interval: 4s\n")
    elif change == "drop-in added":
        (conf_d / "60-more.yaml").write_text("interval: 4s\n")
    elif change == "drop-in removed":
        (conf_d / "50-site.yaml").unlink()
    elif change == "config folder writable by others":
        main.parent.chmod(0o777)
    elif change == "main file linked":
        real = tmp_path / "real.yaml"
        main.rename(real)
        main.symlink_to(real)
    elif change == "compiled file writable by others":
        compiled.chmod(0o666)
    elif change == "compiled file corrupt":
        compiled.write_text("{")
    elif change == "compiled file names a class it may not":
        doc = json.loads(compiled.read_text())
        doc["policy"]["$class"] = "Popen"
        compiled.write_text(json.dumps(doc))
    elif change == "compiled for another main file":
        doc = json.loads(compiled.read_text())
        doc["main_file"] = "/etc/gpuwatchd/gpuwatchd.yaml"
        compiled.write_text(json.dumps(doc))
    elif change == "found in another state_dir":
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        (other / COMPILED_FILE).write_bytes(compiled.read_bytes())
        (other / COMPILED_FILE).chmod(0o600)
        compiled.unlink()
        default = str(other)  # looked at, but the policy there names `state`
    assert load_compiled(str(main), default) is None


def test_the_writer_publishes_nothing_for_a_policy_the_files_reject(tmp_path: Path) -> None:
    main, state = _setup(tmp_path)
    assert _save(main, state)
    main.write_text(main.read_text() + "interval: sometimes\n")
    with pytest.raises(ConfigError):
        load_policy(str(main))
    assert not _save(main, state)
    assert not (state / COMPILED_FILE).exists()  # the stale one is gone too


def test_the_writer_publishes_nothing_for_another_state_dir(tmp_path: Path) -> None:
    main, _ = _setup(tmp_path)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    assert not _save(main, other)  # the policy names `state`, not `other`
    assert not (other / COMPILED_FILE).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="StrictModes is checked only as root")
def test_root_takes_no_policy_compiled_without_strict_modes(tmp_path: Path) -> None:
    main, state = _setup(tmp_path)
    with StateDir.open(str(state)) as opened:
        assert compiled_policy.save_compiled(opened, str(main), load_policy, strict=False)
    assert load_compiled(str(main), "/nonexistent/default") is None


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ("state_dir: /var/lib/x\n", "/var/lib/x"),
        ("state_dir: '/var/lib/x'  # quoted\n", "/var/lib/x"),
        ('state_dir: "/var/lib/x"\n', "/var/lib/x"),
        ("interval: 5s\n", None),
        ("  state_dir: /nested/not/top\n", None),
        ("state_dir: {path: /x}\n", None),
        ("state_dir: /a\nstate_dir: /b\n", "/b"),
        ("state_dir: '/var/lib/x'\r\ninterval: 5s\r\n", "/var/lib/x"),  # CRLF, as YAML reads it
    ],
)
def test_where_to_look_is_guessed_from_top_level_state_dir_lines(
    tmp_path: Path, lines: str, expected: str | None
) -> None:
    main = tmp_path / "gpuwatchd.yaml"
    main.write_text(lines)
    assert guess_state_dir(str(main)) == expected


def test_a_drop_in_state_dir_line_wins_over_the_main_files(tmp_path: Path) -> None:
    main = tmp_path / "gpuwatchd.yaml"
    main.write_text("state_dir: /a\n")
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "10-x.yaml").write_text("state_dir: /c\n")
    assert guess_state_dir(str(main)) == "/c"


def test_the_guess_never_opens_what_is_not_a_regular_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a device may act (a tape rewinds, a watchdog arms): the policy reader checks a
    file's type before it opens it, and so does the guess (it opened any entry named *.yaml)."""
    main = tmp_path / "gpuwatchd.yaml"
    main.write_text("state_dir: /a\n")
    (tmp_path / "conf.d").mkdir()
    fifo = tmp_path / "conf.d" / "10-x.yaml"
    os.mkfifo(fifo)
    opened: list[str] = []
    real_open = os.open

    def recording_open(path: str, flags: int, *args: Any) -> int:
        opened.append(path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", recording_open)
    assert guess_state_dir(str(main)) is None
    assert str(fifo) not in opened


def test_the_compiled_file_is_json_dumps_layout_with_its_version_first(tmp_path: Path) -> None:
    """Its bytes as the hand-written encoder wrote them (gpuwatchd/core/codec.py's Format)."""
    main, state = _setup(tmp_path)
    assert _save(main, state)
    raw = (state / COMPILED_FILE).read_bytes()
    data = json.loads(raw)
    assert list(data) == ["version", "main_file", "strict", "identity", "policy"]
    assert (data["version"], data["main_file"]) == (1, str(main))
    assert raw == json.dumps(data).encode()
