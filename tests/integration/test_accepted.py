"""The last accepted policy, kept in state_dir, and the daemon's fallback to it at start.

Pins gpuwatchd/state/accepted.py: a saved policy reads back equal; it is found through the state_dir
the configured files name as far as they load; one that anyone else could have written, that
is a link, or that names another state_dir is not used (and says why); with none there is no
fallback (the daemon exits 78). The daemon under real systemd: tests/system/test_systemd.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from gpuwatchd.config.schema import default_policy, load_policy
from gpuwatchd.decide.policy import Policy
from gpuwatchd.state.accepted import ACCEPTED_FILE, load_fallback, save_accepted
from gpuwatchd.state.directory import StateDir


def _save(policy: Policy) -> None:
    """As the daemon saves it: through its opened state directory."""
    with StateDir.open(policy.state_dir) as state_dir:
        save_accepted(state_dir, policy)


def _config(tmp_path: Path, state: Path, *drop_ins: tuple[str, str]) -> Path:
    main = tmp_path / "etc" / "gpuwatchd.yaml"
    (main.parent / "conf.d").mkdir(parents=True)
    main.write_text(f"state_dir: {state}\ninterval: 7s\n")
    for name, text in drop_ins:
        (main.parent / "conf.d" / name).write_text(text)
    return main


def _state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700, parents=True)
    return state


def test_a_saved_policy_is_the_fallback_when_a_drop_in_is_rejected(tmp_path: Path) -> None:
    state = _state(tmp_path)
    main = _config(tmp_path, state, ("50-site.yaml", "dry_run: false\n"))
    accepted = load_policy(str(main), check_permissions=False)
    _save(accepted)
    saved = state / ACCEPTED_FILE
    assert saved.stat().st_mode & 0o777 == 0o600
    (main.parent / "conf.d" / "90-broken.yaml").write_text("interval: sometimes\n")
    fallback = load_fallback(str(main))
    assert fallback.source == str(saved)
    assert fallback.saved_at is not None
    assert fallback.problems == ()
    assert fallback.policy is not None
    assert dataclasses.replace(fallback.policy, sources=()) == dataclasses.replace(
        accepted, sources=()
    )
    assert fallback.policy.dry_run is False  # the accepted policy, enforcing as it was
    assert "the last accepted policy (" in fallback.describe()


def test_without_a_saved_policy_there_is_no_fallback(tmp_path: Path) -> None:
    """Nothing was ever accepted (a node being set up): the daemon exits 78 as before."""
    state = _state(tmp_path)
    main = _config(tmp_path, state, ("90-broken.yaml", "rules: 3\n"))
    fallback = load_fallback(str(main))
    assert fallback.policy is None
    assert fallback.saved_at is None
    assert fallback.source == str(state / ACCEPTED_FILE)
    assert fallback.problems == ()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the checks are root's")
@pytest.mark.parametrize("how", ["group-writable", "symlink", "other-state-dir"])
def test_a_saved_policy_that_cannot_be_trusted_is_not_used(tmp_path: Path, how: str) -> None:
    state = _state(tmp_path)
    main = _config(tmp_path, state, ("90-broken.yaml", "interval: sometimes\n"))
    saved = state / ACCEPTED_FILE
    other = _state(tmp_path / "elsewhere")
    if how == "other-state-dir":
        _save(dataclasses.replace(default_policy(), state_dir=str(other)))
        (other / ACCEPTED_FILE).rename(saved)
    else:
        _save(dataclasses.replace(default_policy(), state_dir=str(state)))
    if how == "group-writable":
        saved.chmod(0o620)
    elif how == "symlink":
        saved.rename(other / "real.yaml")
        saved.symlink_to(other / "real.yaml")
    fallback = load_fallback(str(main))
    assert fallback.policy is None
    assert len(fallback.problems) == 1
    assert str(saved) in fallback.problems[0]


def test_the_state_dir_comes_from_the_files_that_load_else_the_default(tmp_path: Path) -> None:
    """A drop-in that moved state_dir before the broken one still leads to the saved policy."""
    state = _state(tmp_path)
    moved = _state(tmp_path / "moved")
    main = _config(
        tmp_path,
        state,
        ("40-state.yaml", f"state_dir: {moved}\n"),
        ("90-broken.yaml", "interval: sometimes\n"),
    )
    _save(dataclasses.replace(default_policy(), state_dir=str(moved), interval=3.0))
    fallback = load_fallback(str(main))
    assert fallback.source == str(moved / ACCEPTED_FILE)
    assert fallback.policy is not None
    assert fallback.policy.interval == 3.0


@pytest.mark.parametrize("how", ["name-not-utf8", "fifo", "bytes-not-utf8"])
def test_a_drop_in_refused_unread_still_leads_to_the_saved_policy(tmp_path: Path, how: str) -> None:
    """A drop-in refused before it is parsed (its name, its kind, its bytes) ends the run of
    files that load, as a bad value does: the main file's state_dir, not the default, is where
    the saved policy is looked for, and the daemon runs it rather than exit 78."""
    state = _state(tmp_path)
    main = _config(tmp_path, state)
    _save(load_policy(str(main), check_permissions=False))
    conf_d = main.parent / "conf.d"
    if how == "name-not-utf8":
        with open(os.path.join(os.fsencode(conf_d), b"10-r\xe4te.yaml"), "wb") as handle:
            handle.write(b"dry_run: true\n")
    elif how == "fifo":
        os.mkfifo(conf_d / "10-site.yaml")
    else:
        (conf_d / "10-site.yaml").write_bytes(b"# r\xe4te\ndry_run: true\n")
    fallback = load_fallback(str(main))
    assert fallback.source == str(state / ACCEPTED_FILE)
    assert fallback.problems == ()
    assert fallback.policy is not None
    assert fallback.policy.interval == 7.0


def test_looking_for_a_saved_policy_creates_no_state_dir(tmp_path: Path) -> None:
    missing = tmp_path / "no-state"
    main = _config(tmp_path, missing, ("90-broken.yaml", "interval: sometimes\n"))
    fallback = load_fallback(str(main))
    assert fallback.policy is None
    assert not missing.exists()


def test_a_state_dir_reached_through_a_link_is_not_read(tmp_path: Path) -> None:
    """The saved policy is read only the one checked way into state_dir (statedir.py): a
    symbolic link on the path — which whoever may write the folder above could plant — is
    refused, and said."""
    real = _state(tmp_path / "real")
    _save(dataclasses.replace(default_policy(), state_dir=str(real)))
    linked = tmp_path / "linked"
    linked.symlink_to(real)
    main = _config(tmp_path, linked, ("90-broken.yaml", "interval: sometimes\n"))
    fallback = load_fallback(str(main))
    assert fallback.policy is None
    assert len(fallback.problems) == 1
    assert "link" in fallback.problems[0]


def test_check_clean_judges_with_the_running_policy_when_the_files_do_not_validate(
    tmp_path: Path,
) -> None:
    """Issue 35, finding 1: check-clean (the Slurm prolog) judges valid files by themselves,
    files that do not validate by the policy the daemon runs (its last accepted one), and with
    none saved it has nothing to judge with (exit 78, which the scripts never drain on)."""
    from gpuwatchd.cli.check_clean import judging_policy

    state = _state(tmp_path)
    main = _config(tmp_path, state, ("50-site.yaml", "dry_run: false\n"))
    judge = judging_policy(str(main))
    assert judge.problem is None
    assert judge.policy is not None
    assert judge.policy.dry_run is False
    broken = main.parent / "conf.d" / "90-broken.yaml"
    broken.write_text("interval: sometimes\n")
    judge = judging_policy(str(main))
    assert judge.policy is None
    assert "90-broken.yaml" in str(judge.problem)
    assert "no saved policy" in str(judge.running)
    broken.unlink()
    _save(load_policy(str(main), check_permissions=False))
    broken.write_text("dry_run: true\ninterval: sometimes\n")
    judge = judging_policy(str(main))
    assert "90-broken.yaml" in str(judge.problem)
    assert judge.policy is not None
    assert judge.policy.dry_run is False  # the daemon's, not what the broken drop-in says
    assert judge.policy.interval == 7.0
    assert "the last accepted policy (" in str(judge.running)


def test_status_reads_the_running_policy_when_the_files_do_not_validate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`status` under files that do not validate: with no accepted policy, exit 78 naming the
    error; with one, the error on stderr and the state read from that policy's state_dir."""
    from gpuwatchd.cli.main import main as cli

    state = _state(tmp_path)
    main = _config(tmp_path, state)
    accepted = load_policy(str(main), check_permissions=False)
    (main.parent / "conf.d" / "90-broken.yaml").write_text("interval: sometimes\n")
    assert cli(["status", "--config", str(main)]) == 78
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("gpuwatchd: ")
    assert "90-broken.yaml" in err
    _save(accepted)
    assert cli(["status", "--config", str(main)]) == 3  # the daemon never ran: no state
    out, err = capsys.readouterr()
    assert f"no state in {state}" in out
    assert err.startswith("gpuwatchd: ")
    assert "90-broken.yaml" in err
