"""A configuration's files, looked at without parsing them: which files are drop-ins, and
where the policy keeps its state (a guess, only where to look).

In detail: docs/internals.md, section `gpuwatchd.config.peek`.
"""

from __future__ import annotations

import os
import re
import stat

MAX_BYTES = 4 << 20  # bytes read of each file
_STATE_DIR_LINE = re.compile(r"^state_dir:[ \t]*(.*?)[ \t]*(?:#.*)?\r?$", re.MULTILINE)
_PLAIN = re.compile(r"""'([^']*)'|"([^"\\]*)"|([^'"\s{\[][^#]*)""")


def conf_d(main_file: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(main_file)), "conf.d")


def ancestors(path: str, trusted_root: str = "/") -> list[str]:
    """The directories above ``path``, nearest first, up to ``trusted_root`` (inclusive)."""
    found = [os.path.dirname(path)]
    while found[-1] not in (trusted_root, os.path.dirname(found[-1])):
        found.append(os.path.dirname(found[-1]))
    return found


def drop_in_names(folder: str) -> list[str]:
    """The entries of ``folder`` named like drop-ins (``*.yaml``, not hidden), sorted; OSError."""
    return sorted(n for n in os.listdir(folder) if n.endswith(".yaml") and not n.startswith("."))


def drop_in_paths(main_file: str) -> list[str]:
    """The paths of :func:`drop_in_names` beside ``main_file``; none when it cannot be listed."""
    folder = conf_d(main_file)
    try:
        return [os.path.join(folder, name) for name in drop_in_names(folder)]
    except OSError:
        return []


def guess_state_dir(main_file: str) -> str | None:
    """The ``state_dir`` the last top-level ``state_dir:`` line of the main file and its
    drop-ins names; None when there is none or its value is not plain or simply quoted."""
    found: str | None = None
    for path in [main_file, *drop_in_paths(main_file)]:
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                return None  # never opened, as the reader does: opening a device may act
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                text = os.read(fd, MAX_BYTES).decode("utf-8", "replace")
            finally:
                os.close(fd)
        except OSError:
            return None
        for match in _STATE_DIR_LINE.finditer(text):
            value = _PLAIN.fullmatch(match.group(1))
            found = None if value is None else next(g for g in value.groups() if g is not None)
    return found.strip() if found else None
