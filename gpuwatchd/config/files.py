"""The policy's files on disk: which files are read, how, and who may have written them.

It finds the drop-ins in ``conf.d/``, reads each file bounded (regular files only, at most
:data:`MAX_DOCUMENT_BYTES`, UTF-8) and checks StrictModes; it returns (file name, text) pairs in
merge order and never parses YAML. :func:`read_regular_file` is the bounded reader every command
uses for a file it is given (a scenario, a saved report).

In detail: docs/internals.md, section `gpuwatchd.config.files`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from gpuwatchd.config.peek import ancestors, conf_d, drop_in_names, drop_in_paths
from gpuwatchd.config.yamlsrc import MAX_DOCUMENT_BYTES, ConfigError, line_of
from gpuwatchd.core.escape import escape, unescape_mount_path

# A node has a handful of drop-ins; more than this is a mistake (or a loop writing files), and
# bounds the policy to MAX_DROP_INS + 1 files of MAX_DOCUMENT_BYTES each.
MAX_DROP_INS = 128
_OPEN_FLAGS = os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC


def read_policy_files(
    path: str, *, check_permissions: bool | None = None, trusted_root: str = "/"
) -> list[tuple[str, str]]:
    """The main file ``path`` and its drop-ins as (file name, text), in merge order, after
    StrictModes (``check_permissions``; by default as root). ConfigError ("not found", ...)."""
    if check_permissions is None:
        check_permissions = os.geteuid() == 0
    if _not_utf8_name(path) is not None or not os.path.lexists(path):
        read_config_file(path)  # raises the name's or the "not found" error
    drop_ins = find_drop_ins(path)
    if check_permissions:
        check_config_permissions(path, drop_ins, trusted_root=trusted_root)
    texts, problem = read_leading_files([path, *drop_ins])
    if problem is not None:
        raise problem
    return texts


def read_leading_files(paths: Sequence[str]) -> tuple[list[tuple[str, str]], ConfigError | None]:
    """The leading run of ``paths`` that reads (:func:`read_config_file`) as (file name,
    text), and the ConfigError of the first that does not (None: all read)."""
    texts: list[tuple[str, str]] = []
    for path in paths:
        try:
            texts.append((path, read_config_file(path)))
        except ConfigError as err:
            return texts, err
    return texts, None


def find_drop_ins(main_file: str) -> list[str]:
    """The drop-ins beside ``main_file`` (:func:`drop_in_names` of its ``conf.d/``), as paths;
    ConfigError for one that is not a regular file or whose name is not UTF-8, or too many
    (docs/internals.md)."""
    folder = conf_d(main_file)
    try:
        paths = [os.path.join(folder, name) for name in drop_in_names(folder)]
    except FileNotFoundError:
        return []
    except OSError as err:
        raise ConfigError(f"cannot list drop-ins: {err.strerror}", path=folder) from None
    if len(paths) > MAX_DROP_INS:
        raise ConfigError(
            f"more than {MAX_DROP_INS} drop-ins ({len(paths)} files named *.yaml)", path=folder
        )
    found = (_not_utf8_name(path) or _not_regular(path) for path in paths)
    problems = [problem for problem in found if problem is not None]
    if problems:
        raise ConfigError.combine(problems)
    return paths


def _not_utf8_name(path: str) -> ConfigError | None:
    """A ConfigError for a path that is not UTF-8 (its bytes arrive as surrogate escapes),
    naming it with those bytes escaped: a policy's file names are kept as UTF-8 text (the
    saved policy's header, ``check-config``'s output), which could not hold it."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        try:
            shown = os.fsencode(path).decode("utf-8", "backslashreplace")  # 10-r\xe4te.yaml
        except UnicodeEncodeError:  # a lone surrogate no file system gave
            shown = path
        return ConfigError(
            "the file name is not UTF-8 text; gpuwatchd keeps its policy files' names as text "
            "(rename it)",
            path=escape(shown),
        )
    return None


def policy_files_key(main_file: str) -> tuple[object, ...]:
    """What changes when the policy's files do (the main file, ``conf.d/``, each drop-in,
    followed through links): a stat each, no read, which the daemon compares every poll."""
    drop_ins = drop_in_paths(main_file)  # none when conf.d cannot be listed: its entry says why
    key: list[object] = []
    for path in [main_file, conf_d(main_file), *drop_ins][: MAX_DROP_INS + 3]:
        try:
            st = os.stat(path)
        except OSError as err:
            key.append((path, err.errno))
            continue
        key.append((path, st.st_dev, st.st_ino, st.st_mode, st.st_uid, st.st_size))
        key.append((st.st_mtime_ns, st.st_ctime_ns))
    return (len(drop_ins), *key)


def read_config_file(path: str) -> str:
    """The text of the regular file ``path`` (a link to one is followed; its name UTF-8), by
    :func:`read_regular_file`; ConfigError for anything else, naming the line of bytes that are
    not UTF-8."""
    if (problem := _not_utf8_name(path) or _not_regular(path)) is not None:
        raise problem
    try:
        data = read_regular_file(path, MAX_DOCUMENT_BYTES)
    except FileTooLarge:
        raise ConfigError(
            f"larger than the 1 MiB limit of a configuration file ({MAX_DOCUMENT_BYTES} bytes)",
            path=path,
        ) from None
    except NotARegularFile as err:
        raise ConfigError(_not_regular_message(err.kind), path=path) from None
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror}", path=path) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        before = data[: err.start].decode("utf-8")
        line = line_of(before, len(before))
        raise ConfigError(f"not UTF-8 text: {err.reason}", path=path, line=line) from None


class NotARegularFile(OSError):
    """A file argument that is a directory, FIFO, socket or device (``kind``, in words)."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"not a regular file ({kind})")
        self.kind = kind


class FileTooLarge(OSError):
    """A file argument larger than its limit: refused before it is parsed."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"larger than {limit} bytes")


def read_regular_file(path: str, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` (docs/internals.md). Raises
    FileNotFoundError, NotARegularFile, FileTooLarge or another OSError."""
    if (kind := _kind(os.stat(path).st_mode)) is not None:
        raise NotARegularFile(kind)
    fd = os.open(path, _OPEN_FLAGS)
    try:
        if (kind := _kind(os.fstat(fd).st_mode)) is not None:
            raise NotARegularFile(kind)
        chunks, most = [], limit + 1  # one byte past the limit tells a larger file
        while most > 0 and (chunk := os.read(fd, min(1 << 20, most))):
            chunks.append(chunk)
            most -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise FileTooLarge(limit)
    return data


def _not_regular(path: str) -> ConfigError | None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            return ConfigError(
                f"a dangling symbolic link (to {os.readlink(path)!r}); only regular files are "
                "read as configuration",
                path=path,
            )
        return ConfigError(
            "configuration file not found (the shipped example is config/gpuwatchd.yaml)", path=path
        )
    except OSError as err:
        return ConfigError(f"cannot read: {err.strerror}", path=path)
    kind = _kind(info.st_mode)
    return None if kind is None else ConfigError(_not_regular_message(kind), path=path)


def _kind(mode: int) -> str | None:
    """What a file that is not a regular file is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((word for test, word in kinds if test(mode)), "not a file")


def _not_regular_message(kind: str) -> str:
    return (
        f"not a regular file ({kind}); only regular files are read as configuration "
        "(remove it, or rename it so that it does not end in .yaml)"
    )


# --- StrictModes ----------------------------------------------------------------------------------


def _unsafe(path: str, *, allow_sticky: bool) -> ConfigError | None:
    try:
        info = os.stat(path)
    except OSError as err:
        return ConfigError(f"cannot check permissions: {err.strerror}", path=path)
    if info.st_uid != 0:
        return ConfigError(
            f"owned by uid {info.st_uid}, not root; gpuwatchd runs the commands its config names "
            f"as root, so only root may control this path. Fix: chown root: {path}",
            path=path,
        )
    sticky = allow_sticky and stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (sticky or _read_only_everywhere(path)):
        return ConfigError(
            f"writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}); gpuwatchd runs "
            f"the commands its config names as root. Fix: chmod go-w {path}",
            path=path,
        )
    return None


MOUNTINFO = "/proc/self/mountinfo"
MOUNTINFO_LIMIT = 4 << 20  # characters read of it; a longer table is judged not read-only


def _read_only_everywhere(path: str) -> bool:
    """Whether nobody can write to ``path`` (:func:`read_only_everywhere`), as for a ConfigMap
    volume: a 0777 directory, read-only, seen through the kubelet's mount alone. A mount table
    past its limit may hide a writable mount: no."""
    try:
        if not os.statvfs(path).f_flag & os.ST_RDONLY:
            return False
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as handle:
            mounts = handle.read(MOUNTINFO_LIMIT + 1)
    except OSError:
        return False
    return len(mounts) <= MOUNTINFO_LIMIT and read_only_everywhere(mounts, os.path.realpath(path))


def _within(path: str, top: str) -> bool:
    return top in ("/", path) or path.startswith(top.rstrip("/") + "/")


def read_only_everywhere(mountinfo: str, path: str) -> bool:
    """Whether the resolved ``path`` is on a read-only mount whose content no writable mount
    in ``mountinfo`` (``/proc/self/mountinfo``'s text) also shows (docs/internals.md). Pure."""
    entries = [  # (device, root, mount point, writable)
        (f[2], unescape_mount_path(f[3]), unescape_mount_path(f[4]), "rw" in f[5].split(","))
        for f in (line.split(" ") for line in mountinfo.split("\n"))
        if len(f) >= 6
    ]
    mine = [e for e in entries if _within(path, e[2])]
    if not mine:
        return False
    point = max((e[2] for e in mine), key=len)  # the innermost mount point
    device, root, _point, writable = [e for e in mine if e[2] == point][-1]  # last: on top
    if writable:
        return False
    inner = root if path == point else os.path.join(root, os.path.relpath(path, point))
    return not any(
        other_device == device and other_writable and _within(inner, other_root)
        for other_device, other_root, _other_point, other_writable in entries
    )


def check_config_permissions(
    main_file: str, drop_ins: Sequence[str] = (), *, trusted_root: str = "/"
) -> None:
    """StrictModes: refuse config paths that anyone but root could change (the rules:
    docs/internals.md). Raises ConfigError listing every unsafe path."""
    main_file = os.path.abspath(main_file)
    folder = conf_d(main_file)
    strict = [main_file, os.path.dirname(main_file), *[os.path.abspath(p) for p in drop_ins]]
    if os.path.isdir(folder):
        strict.append(folder)
    strict += [os.path.realpath(p) for p in strict]
    trusted = os.path.abspath(trusted_root)
    loose = [d for p in strict for d in ancestors(p, trusted)]
    paths = dict.fromkeys([*strict, *loose])  # each once, in this order
    found = (_unsafe(path, allow_sticky=path not in strict) for path in paths)
    problems = [problem for problem in found if problem is not None]
    if problems:
        raise ConfigError.combine(problems)
