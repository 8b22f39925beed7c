"""The last policy the daemon accepted, kept in ``state_dir``, and the fallback to it at start.

In detail: docs/internals.md, section `gpuwatchd.state.accepted`.
"""

from __future__ import annotations

import dataclasses
import os
import time

from gpuwatchd.config.files import MAX_DROP_INS, check_config_permissions, read_leading_files
from gpuwatchd.config.peek import drop_in_paths
from gpuwatchd.config.schema import default_policy, parse_policy_documents, render_policy
from gpuwatchd.config.yamlsrc import MAX_DOCUMENT_BYTES, ConfigError
from gpuwatchd.decide.policy import Policy
from gpuwatchd.state.directory import StateDir, StateDirError

ACCEPTED_FILE = "policy.accepted.yaml"


@dataclasses.dataclass(frozen=True)
class Fallback:
    """What the daemon runs when its configured policy is rejected at start."""

    policy: Policy | None  # None: no usable saved policy
    source: str  # the saved file's path
    saved_at: float | None  # when the saved file was written (its mtime)
    problems: tuple[str, ...] = ()  # why saved files that were looked at were not used

    def describe(self) -> str:
        """``the last accepted policy (/var/lib/gpuwatchd/policy.accepted.yaml, saved …)``."""
        if self.saved_at is None:
            return f"no saved policy ({self.source})"
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.saved_at))
        return f"the last accepted policy ({self.source}, saved {when})"


def render_accepted(policy: Policy) -> str:
    return (
        "# The last policy gpuwatchd accepted, saved by the daemon; run with when the configured\n"
        "# one is rejected at start (docs/operations.md, 'Failure modes'). Do not edit.\n"
        + render_policy(policy)
    )


def save_accepted(state_dir: StateDir, policy: Policy) -> None:
    """Save ``policy`` (as loaded: no command-line dry-run) in ``state_dir`` (its own, opened
    by the daemon); OSError."""
    state_dir.write(ACCEPTED_FILE, render_accepted(policy).encode())


def _state_dir_hint(config_path: str) -> str:
    """Where the saved policy may be (docs/internals.md): the ``state_dir`` of the longest
    leading run of the configured files that loads, else the built-in default. A drop-in that
    cannot be read (its name, its kind, its bytes: config/files.read_leading_files) ends the run."""
    drop_ins = drop_in_paths(config_path)[:MAX_DROP_INS]
    docs, _problem = read_leading_files([config_path, *drop_ins])
    try:
        if os.geteuid() == 0:
            check_config_permissions(config_path, [path for path, _text in docs[1:]])
    except ConfigError:
        docs = []
    for count in range(len(docs), 0, -1):
        try:
            return parse_policy_documents(docs[:count]).state_dir
        except ConfigError:
            continue
    return default_policy().state_dir


def load_fallback(config_path: str) -> Fallback:
    """The policy to run with when ``config_path``'s is rejected at start: the last one the
    daemon accepted; ``policy`` None when there is none (or none usable). Never raises."""
    state_dir = _state_dir_hint(config_path)
    path = os.path.join(state_dir, ACCEPTED_FILE)
    try:
        # Looking creates nothing: a missing state_dir is FileNotFoundError.
        with StateDir.open(state_dir) as directory:
            data, info = directory.read_with_stat(ACCEPTED_FILE, MAX_DOCUMENT_BYTES + 1)
        if len(data) > MAX_DOCUMENT_BYTES:
            raise ValueError("larger than a policy may be")
        policy = parse_policy_documents([(path, data.decode("utf-8", errors="strict"))])
        if policy.state_dir != state_dir:
            raise ValueError(f"names another state_dir ({policy.state_dir})")
    except FileNotFoundError:
        return Fallback(None, path, None)
    except (OSError, StateDirError, ValueError, ConfigError) as err:
        return Fallback(None, path, None, (f"{path}: {err}",))
    return Fallback(policy, path, info.st_mtime)
