"""A reload says what changed (``config.reloaded``'s ``changed``: key -> "old -> new"), not the
whole merged policy; and the unit's reload check (``check-config --quiet``) prints no policy."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gpuwatchd.cli.main import main
from gpuwatchd.config.changes import VALUE_LIMIT, policy_changes
from gpuwatchd.config.schema import default_policy, load_policy, parse_policy_documents
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.daemon.lifecycle import Daemon
from gpuwatchd.events.catalogue import render


def test_nothing_changed_is_an_empty_answer() -> None:
    assert policy_changes(default_policy(), default_policy()) == {}


def test_changed_keys_are_dotted_with_old_and_new_as_the_file_spells_them() -> None:
    old = parse_policy_documents([("<main>", "dry_run: false\n")])
    new = parse_policy_documents(
        [("<main>", "dry_run: false\ninterval: 30s\nreset:\n  cooldown: 2h\n"
                    "protect:\n  users: [ann]\n")]
    )  # fmt: skip
    assert policy_changes(old, new) == {
        "interval": "5s -> 30s",
        "protect.users": '[] -> ["ann"]',
        "reset.cooldown": "1h -> 2h",
    }


def test_a_long_value_is_cut() -> None:
    rules = "rules:\n" + "".join(
        f"  - name: r{i}\n    kind: orphaned\n    steps: [{{signal: SIGTERM, wait: 1s}}]\n"
        for i in range(20)
    )
    changed = policy_changes(
        parse_policy_documents([("<d>", "dry_run: true\n")]),
        parse_policy_documents([("<d>", rules)]),
    )
    old, _, new = changed["rules"].partition(" -> ")
    assert len(new) == VALUE_LIMIT
    assert new.endswith("...")
    assert old == "[]"


def test_a_reload_logs_the_keys_that_changed_not_the_policy(tmp_path: Path) -> None:
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text("dry_run: true\n")
    config.chmod(0o644)
    policy = dataclasses.replace(load_policy(str(config)), state_dir=str(tmp_path / "state"))
    daemon = Daemon(policy, config_path=str(config))
    config.write_text("dry_run: true\ninterval: 30s\nreset:\n  cooldown: 2h\n")
    with capture_logs() as logs:
        daemon._do_reload()
    (reloaded,) = [e for e in logs if e["event"] == EventName.CONFIG_RELOADED]
    assert reloaded["changed"] == {"interval": "5s -> 30s", "reset.cooldown": "1h -> 2h"}
    assert daemon.policy.interval == 30.0
    said = render(str(EventName.CONFIG_RELOADED), reloaded)
    assert said == "Policy reloaded; changed: interval (5s -> 30s), reset.cooldown (1h -> 2h)."
    with capture_logs() as logs:
        daemon._do_reload()  # the same file again
    (again,) = [e for e in logs if e["event"] == EventName.CONFIG_RELOADED]
    assert again["changed"] == {}
    assert render(str(EventName.CONFIG_RELOADED), again) == "Policy reloaded: nothing changed."


def test_check_config_quiet_validates_and_prints_no_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text("interval: 30s\n")
    config.chmod(0o644)
    assert main(["check-config", "--quiet", str(config)]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == f"# OK: {config}"
    assert main(["check-config", str(config)]) == 0
    assert "interval: 30s" in capsys.readouterr().out  # without it: the whole policy
    config.write_text("interval: sometimes\n")
    assert main(["check-config", "-q", str(config)]) == 78
    assert "interval" in capsys.readouterr().err
