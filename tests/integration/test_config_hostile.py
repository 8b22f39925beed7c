"""Hostile policy input: nothing a policy file, a ``conf.d/`` folder or a filled-in argv holds
may crash, hang or mislead the daemon.

Every file is bounded before it is parsed (size, nesting depth, no YAML anchors or aliases, no
control characters), only regular files are read, every duration, size and count is bounded
when it is validated, and every argv names its GPU exactly once through ``{uuid}`` or
``{pci_bus_id}`` with no shell hiding behind a launcher. What passes ``check-config`` cannot
fail later. Each problem is a ``ConfigError`` naming file, line and key; the values filled into
an argv at run time are checked by :func:`format_argv` (a ``ValueError``). The last section
fuzzes whole documents: a policy or a ``ConfigError``, never any other exception.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd.config import schema
from gpuwatchd.config.keys import SECTIONS, Bound, Nested, Section
from gpuwatchd.config.yamlsrc import ConfigError
from gpuwatchd.decide.argv import MAX_ARGS, MAX_COMMANDS, MAX_FILLED_CHARS, format_argv
from gpuwatchd.decide.policy import Policy

REPO = Path(__file__).resolve().parents[2]
DROP_IN = "/etc/gpuwatchd/conf.d/50-hostile.yaml"
UUID = "GPU-8f0a1e2b-0000-1111-2222-333344445555"
BUS = "00000000:3B:00.0"
# GPUWATCHD_HYPOTHESIS_PROFILE=ci runs the fuzz tests longer (as tests/unit/test_plan_stateful.py).
FUZZ_EXAMPLES = 2000 if os.environ.get("GPUWATCHD_HYPOTHESIS_PROFILE") == "ci" else 200
fuzz_settings = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def parse(text: str, filename: str = DROP_IN) -> Policy:
    return schema.parse_policy_documents([(filename, text)])


def error_of(text: str, filename: str = DROP_IN) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse(text, filename)
    return caught.value


def load_error(main_file: Path) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        schema.load_policy(str(main_file), check_permissions=False)
    return caught.value


def config_tree(tmp_path: Path, main: str = "interval: 5s\n") -> Path:
    (tmp_path / "conf.d").mkdir()
    main_file = tmp_path / "gpuwatchd.yaml"
    main_file.write_text(main)
    return main_file


def finishes(work: Callable[[], object], fifos: list[Path], seconds: float = 10.0) -> object:
    """``work()``'s result or exception, failing (and unblocking it) if it hangs on a FIFO."""
    box: list[object] = []

    def run() -> None:
        try:
            box.append(work())
        except BaseException as err:
            box.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:  # release a reader blocked in open()
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        thread.join(seconds)
        pytest.fail("reading the configuration blocked on a FIFO")
    return box[0]


# --- 1. control characters, encoding and scalar construction --------------------------------------


@pytest.mark.parametrize(
    ("char", "name"),
    {
        "\x00": "U+0000",
        "\x01": "U+0001",
        "\x07": "U+0007",
        "\x1b": "U+001B",
        "\x7f": "U+007F",
        "\x9b": "U+009B",
        "\ufffe": "U+FFFE",
    }.items(),
)
def test_a_control_character_is_a_config_error_naming_file_and_line(char: str, name: str) -> None:
    err = error_of(f"interval: 5s\ndry_run: true\nstate_dir: /var/lib/x{char}y\n")
    assert (err.path, err.line) == (DROP_IN, 3)
    assert "control character" in err.message
    assert name in err.message


def test_a_control_character_after_crlf_and_cr_line_ends_names_its_line() -> None:
    assert error_of("interval: 5s\r\ndry_run: true\r\n\x00\r\n").line == 3
    assert error_of("interval: 5s\rdry_run: true\r\x00").line == 3


def test_a_nul_byte_in_a_file_on_disk_is_a_config_error(tmp_path: Path) -> None:
    main_file = tmp_path / "gpuwatchd.yaml"
    main_file.write_bytes(b"interval: 5s\n\x00\n")
    err = load_error(main_file)
    assert (err.path, err.line) == (str(main_file), 2)


def test_check_config_exits_78_on_a_nul_byte_without_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "nul.yaml"
    config.write_bytes(b"interval: 5s\ndry_run: true\x00\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "check-config", str(config)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 78, result.stderr
    assert f"{config}:2:" in result.stderr
    assert "Traceback" not in result.stderr


def test_bytes_that_are_not_utf8_name_the_line(tmp_path: Path) -> None:
    main_file = tmp_path / "gpuwatchd.yaml"
    main_file.write_bytes(b"interval: 5s\nstate_dir: /x\xff\n")
    err = load_error(main_file)
    assert (err.path, err.line) == (str(main_file), 2)
    assert "UTF-8" in err.message


@pytest.mark.parametrize(
    "text",
    [
        "state_dir: 2023-02-30\n",  # a timestamp that is not a date
        "interval: !!int abc\n",
        "dry_run: !!bool maybe\n",
        "interval: !!float x\n",
        "interval: !!timestamp x\n",
        "device_major: " + "9" * 5000 + "\n",  # past Python's int digit limit
        "interval: !!python/object:os.system x\n",
    ],
)
def test_a_scalar_yaml_cannot_construct_is_a_located_config_error(text: str) -> None:
    err = error_of(text)
    assert (err.path, err.line) == (DROP_IN, 1)


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ('interval: 5s\non_failure: [[/bin/echo, "a\\ud800"]]\n', "U+D800"),
        ('rules:\n  - {name: "r\\udc80", kind: zombie, steps: [{signal: null}]}\n', "U+DC80"),
    ],
)
def test_a_surrogate_escape_no_utf8_text_can_hold_is_a_located_config_error(
    text: str, code: str
) -> None:
    """A hook's argument of one would pass and then fail to encode when the hook runs."""
    err = error_of(text)
    assert (err.path, err.line) == (DROP_IN, 2)
    assert code in err.message


# --- 2. bounded before parsing: size, depth, aliases; regular files only --------------------------


def test_a_file_over_the_size_limit_is_refused_before_parsing(tmp_path: Path) -> None:
    from gpuwatchd.config.yamlsrc import MAX_DOCUMENT_BYTES

    assert MAX_DOCUMENT_BYTES == 1024 * 1024
    main_file = tmp_path / "gpuwatchd.yaml"
    main_file.write_bytes(b"interval: [" + b"1," * MAX_DOCUMENT_BYTES + b"]\n")
    started = time.process_time()  # the work done (CPU), not the wall clock a load stretches
    err = load_error(main_file)
    assert time.process_time() - started < 2.0
    assert err.path == str(main_file)
    assert "1 MiB" in err.message
    text_err = error_of("#" * (MAX_DOCUMENT_BYTES + 1))
    assert "1 MiB" in text_err.message


def test_more_yaml_values_than_the_budget_are_refused_in_seconds() -> None:
    from gpuwatchd.config.yamlsrc import MAX_NODES

    # CPU time, not wall time: the budget bounds the parser's work, which a loaded machine
    # stretches on the wall clock.
    started = time.process_time()
    err = error_of("protect:\n  users: [" + "a, " * MAX_NODES + "]\n")
    assert time.process_time() - started < 5.0
    assert f"more than {MAX_NODES} YAML values" in err.message
    assert err.line == 2


def test_drop_ins_share_one_budget_of_size_and_values() -> None:
    from gpuwatchd.config.yamlsrc import MAX_DOCUMENT_BYTES, MAX_NODES, MAX_TOTAL_BYTES

    comments = "#" * (MAX_DOCUMENT_BYTES - 1) + "\n"
    files = MAX_TOTAL_BYTES // MAX_DOCUMENT_BYTES + 1
    docs = [(f"/etc/gpuwatchd/conf.d/{i}.yaml", comments) for i in range(files)]
    with pytest.raises(ConfigError, match="together are larger than their 4 MiB limit") as caught:
        schema.parse_policy_documents(docs)
    assert caught.value.path == docs[-1][0]
    third = "protect:\n  users: [" + "a, " * (MAX_NODES // 3) + "]\n"
    docs = [(f"/etc/gpuwatchd/conf.d/{i}.yaml", third) for i in range(4)]
    with pytest.raises(ConfigError, match="YAML values in the configuration files together"):
        schema.parse_policy_documents(docs)


@pytest.mark.parametrize(
    "text",
    [
        "interval: " + "[" * 5000,
        "rules: " + "[" * 200_000,
        "reset: " + "{a: " * 5000,
        "".join(f"{'  ' * depth}k{depth}:\n" for depth in range(500)),
        "rules:\n" + "".join(f"{'  ' * depth}- \n" for depth in range(1, 500)),
    ],
)
def test_deep_nesting_is_refused_without_recursion(text: str) -> None:
    from gpuwatchd.config.yamlsrc import MAX_DEPTH

    err = error_of(text)
    assert f"nested deeper than {MAX_DEPTH} levels" in err.message
    assert err.path == DROP_IN
    assert err.line is not None


def test_nesting_up_to_the_limit_is_read() -> None:
    from gpuwatchd.config.yamlsrc import MAX_DEPTH

    levels = MAX_DEPTH - 1  # the top-level mapping is the first level
    err = error_of("zzz: " + "[" * levels + "]" * levels + "\n")
    assert err.key == "zzz"
    assert "unknown key" in err.message


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(ord('b') + i)}: &{chr(ord('b') + i)} [{', '.join(['*' + chr(ord('a') + i)] * 10)}]\n"
    for i in range(9)
)


def test_an_alias_bomb_is_refused_at_once() -> None:
    started = time.process_time()  # the work done (CPU), not the wall clock a load stretches
    err = error_of(BILLION_LAUGHS)
    assert time.process_time() - started < 1.0
    assert "anchors" in err.message
    assert err.line == 1


@pytest.mark.parametrize(
    ("text", "line", "word"),
    [
        ("reset:\n  drain: &d [[drain-node]]\n", 2, "anchors (&name)"),
        ("reset:\n  drain: [[a]]\n  before: *d\n", 3, "aliases (*name)"),
        ("protect:\n  users: [&u bob]\n", 2, "anchors (&name)"),
    ],
)
def test_anchors_and_aliases_are_refused(text: str, line: int, word: str) -> None:
    err = error_of(text)
    assert err.line == line
    assert word in err.message


def test_a_directory_named_like_a_drop_in_is_an_error_naming_it(tmp_path: Path) -> None:
    main_file = config_tree(tmp_path)
    (tmp_path / "conf.d" / "10-site.yaml").mkdir()
    err = load_error(main_file)
    assert err.path == str(tmp_path / "conf.d" / "10-site.yaml")
    assert "not a regular file (a directory)" in err.message


def test_a_fifo_drop_in_is_an_error_and_never_blocks(tmp_path: Path) -> None:
    main_file = config_tree(tmp_path)
    fifo = tmp_path / "conf.d" / "10-site.yaml"
    os.mkfifo(fifo)
    outcome = finishes(lambda: schema.load_policy(str(main_file), check_permissions=False), [fifo])
    assert isinstance(outcome, ConfigError)
    assert outcome.path == str(fifo)
    assert "not a regular file (a FIFO)" in outcome.message


def test_a_fifo_main_file_is_an_error_and_never_blocks(tmp_path: Path) -> None:
    fifo = tmp_path / "gpuwatchd.yaml"
    os.mkfifo(fifo)
    outcome = finishes(lambda: schema.load_policy(str(fifo), check_permissions=False), [fifo])
    assert isinstance(outcome, ConfigError)
    assert outcome.path == str(fifo)
    assert "not a regular file" in outcome.message


@pytest.mark.parametrize(
    ("target", "kind"), [("/dev/null", "a character device"), ("/nonexistent", "dangling")]
)
def test_a_drop_in_symlink_to_anything_but_a_regular_file_is_an_error(
    tmp_path: Path, target: str, kind: str
) -> None:
    main_file = config_tree(tmp_path)
    link = tmp_path / "conf.d" / "10-site.yaml"
    link.symlink_to(target)
    err = load_error(main_file)
    assert err.path == str(link)
    assert kind in err.message


def test_a_drop_in_symlink_to_a_regular_file_is_read(tmp_path: Path) -> None:
    main_file = config_tree(tmp_path)
    real = tmp_path / "site.yaml"
    real.write_text("interval: 7s\n")
    (tmp_path / "conf.d" / "10-site.yaml").symlink_to(real)
    assert schema.load_policy(str(main_file), check_permissions=False).interval == 7.0


def test_entries_not_named_like_drop_ins_are_ignored_whatever_they_are(tmp_path: Path) -> None:
    main_file = config_tree(tmp_path)
    conf_d = tmp_path / "conf.d"
    (conf_d / "old").mkdir()
    (conf_d / ".hidden.yaml").mkdir()
    os.mkfifo(conf_d / "pipe")
    os.mkfifo(conf_d / ".pipe.yaml")
    (conf_d / "dev.yml").symlink_to("/dev/null")
    outcome = finishes(
        lambda: schema.load_policy(str(main_file), check_permissions=False),
        [conf_d / "pipe", conf_d / ".pipe.yaml"],
    )
    assert isinstance(outcome, Policy)
    assert outcome.sources == (str(main_file),)


def test_a_drop_in_whose_name_is_not_utf8_is_an_error_naming_it_escaped(tmp_path: Path) -> None:
    """Accepted, its name would reach the policy's sources and break every writer of them (the
    saved policy, check-config's header): the daemon would die at start and at each reload."""
    main_file = config_tree(tmp_path)
    name = os.path.join(os.fsencode(tmp_path / "conf.d"), b"10-r\xe4te.yaml")  # Latin-1
    with open(name, "wb") as handle:
        handle.write(b"dry_run: true\n")
    err = load_error(main_file)
    assert err.path == f"{tmp_path}/conf.d/10-r\\xe4te.yaml"
    assert "not UTF-8" in err.message
    assert str(err).isascii()


def test_a_main_file_whose_name_is_not_utf8_is_refused_by_check_config(tmp_path: Path) -> None:
    main_file = os.path.join(os.fsencode(tmp_path), b"gpuwatchd-\xff.yaml")
    with open(main_file, "wb") as handle:
        handle.write(b"interval: 5s\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "check-config", os.fsdecode(main_file)],
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"},
        check=False,
        timeout=60,
    )
    assert result.returncode == 78, result.stderr
    assert b"gpuwatchd-\\xff.yaml: the file name is not UTF-8" in result.stderr
    assert b"Traceback" not in result.stderr


def test_too_many_drop_ins_are_refused(tmp_path: Path) -> None:
    from gpuwatchd.config.files import MAX_DROP_INS

    main_file = config_tree(tmp_path)
    for index in range(MAX_DROP_INS + 1):
        (tmp_path / "conf.d" / f"{index:04d}.yaml").write_text("")
    err = load_error(main_file)
    assert err.path == str(tmp_path / "conf.d")
    assert f"more than {MAX_DROP_INS} drop-ins" in err.message


# --- 3. every duration, size and count is bounded -------------------------------------------------

RULE = "rules:\n  - name: r\n    kind: orphaned\n    steps: [{{signal: SIGTERM, wait: 1s}}]\n"
# key path -> (document with {v} on its line, line of {v}, lowest, highest, too low, too high)
BOUNDED: dict[str, tuple[str, int, object, object, object, object]] = {
    "interval": ("interval: {v}\n", 1, "100ms", "1h", "99ms", "61m"),
    "nvml_timeout": ("nvml_timeout: {v}\n", 1, "1s", "20s", "999ms", "21s"),
    "full_scan_interval": ("full_scan_interval: {v}\n", 1, "1s", "1h", "0s", "2h"),
    "full_scan_backstop": ("full_scan_backstop: {v}\n", 1, "1m", "1d", "59s", "25h"),
    "rules[0].for": (RULE.replace("orphaned\n", "orphaned\n    for: {v}\n"), 4, 0, "7d", -1, "8d"),
    "rules[0].steps[0].wait": (
        "rules:\n  - name: r\n    kind: orphaned\n    steps:\n      - signal: SIGTERM\n"
        "        wait: {v}\n",
        6,
        0,
        "1d",
        -1,
        "25h",
    ),
    "rules[0].min_memory": (
        RULE.replace("orphaned\n", "orphaned\n    min_memory: {v}\n"),
        4,
        0,
        "1TiB",
        -1,
        "1025GiB",
    ),
    "reset.confirm_for": ("reset:\n  confirm_for: {v}\n", 2, "0s", "7d", -1, "8d"),
    "reset.timeout": ("reset:\n  timeout: {v}\n", 2, "1s", "10m", "500ms", "11m"),
    "reset.window": ("reset:\n  window: {v}\n", 2, "1m", "7d", "59s", "8d"),
    "reset.cooldown": ("reset:\n  cooldown: {v}\n", 2, "0s", "7d", -1, "8d"),
    "reset.max_resets": ("reset:\n  max_resets: {v}\n", 2, 0, 100, -1, 101),
    "reset.max_failures": ("reset:\n  max_failures: {v}\n", 2, 1, 100, 0, 101),
    "reset.before[0].timeout": (
        "reset:\n  before:\n    - command: [x]\n      timeout: {v}\n",
        4,
        "1s",
        "10m",
        "0s",
        "11m",
    ),
    "on_failure[0].timeout": (
        "on_failure:\n  - command: [x]\n    timeout: {v}\n",
        3,
        "1s",
        "10m",
        "999ms",
        "99999999999999999999d",
    ),
    "limits.max_signalled_per_poll": (
        "limits:\n  max_signalled_per_poll: {v}\n",
        2,
        0,
        1000,
        -1,
        1001,
    ),
    "limits.max_signalled_per_hour": (
        "limits:\n  max_signalled_per_hour: {v}\n",
        2,
        0,
        10000,
        -1,
        10001,
    ),
    "limits.post_action_delay": ("limits:\n  post_action_delay: {v}\n", 2, 0, "1h", -1, "2h"),
    "detection.ghost_margin": ("detection:\n  ghost_margin: {v}\n", 2, 0, "1TiB", -1, "2TiB"),
    "detection.default_baseline": (
        "detection:\n  default_baseline: {v}\n",
        2,
        0,
        "1TiB",
        -1,
        "1025GiB",
    ),
    "detection.unaccounted_margin": (
        "detection:\n  unaccounted_margin: {v}\n",
        2,
        0,
        "1TiB",
        -1,
        "1099511627777",
    ),
    "detection.pid_trust_min_unresolved": (
        "detection:\n  pid_trust_min_unresolved: {v}\n",
        2,
        1,
        1000,
        0,
        1001,
    ),
    "device_major": ("device_major: {v}\n", 1, 0, 4095, -1, 4096),
}


@pytest.mark.parametrize("key", list(BOUNDED))
def test_each_bound_is_inclusive(key: str) -> None:
    template, _line, lowest, highest, _low, _high = BOUNDED[key]
    parse(template.format(v=lowest))
    parse(template.format(v=highest))


@pytest.mark.parametrize("key", list(BOUNDED))
@pytest.mark.parametrize("side", ["low", "high"])
def test_a_value_out_of_bounds_names_file_line_and_key(key: str, side: str) -> None:
    template, line, _lowest, _highest, low, high = BOUNDED[key]
    err = error_of(template.format(v=low if side == "low" else high))
    assert (err.path, err.line, err.key) == (DROP_IN, line, key)
    assert str(err).startswith(f"{DROP_IN}:{line}: {key}: ")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("nvml_timeout: 99999999999999999999d\n", "nvml_timeout"),
        ("reset:\n  timeout: 99999999999999999999d\n", "reset.timeout"),
        ("interval: 1" + "0" * 400 + "\n", "interval"),  # a bare int past float's range
        ("interval: 1" + "0" * 400 + "s\n", "interval"),
        ("detection:\n  ghost_margin: 1" + "0" * 400 + "MiB\n", "detection.ghost_margin"),
        ("detection:\n  ghost_margin: 1" + "0" * 400 + "\n", "detection.ghost_margin"),
        ("reset:\n  max_resets: 1" + "0" * 400 + "\n", "reset.max_resets"),
    ],
)
def test_huge_values_are_config_errors_not_overflows(text: str, key: str) -> None:
    err = error_of(text)
    assert err.key == key


@pytest.mark.parametrize(
    "text",
    [
        "interval: !!int 1" + "0" * 5000 + "\n",  # past Python's limit on integer digits
        '? "k\\x01' + "y" * 5000 + '"\n: 1\n',  # a key that is not printable
        "rules:\n  - {name: " + "r" * 5000 + "}\n  - {name: " + "r" * 5000 + "}\n",
        "reset:\n  monitors: [{unit: " + "u" * 4000 + "}]\n",
    ],
)
def test_a_problem_quotes_a_long_value_cut_short(text: str) -> None:
    """A value quoted in a problem is cut as everywhere else (shown): the message of a hostile
    file is logged, and kept in the state file, whole."""
    problems = error_of(text).problems
    assert max(len(p.message) for p in problems) < 300


def test_a_policy_with_thousands_of_problems_lists_the_first_hundred() -> None:
    """What a rejected policy's message holds is logged and kept in the state file: 49,600
    problems made 16 MB of it. All are still in ``problems``."""
    err = error_of("protect: {users: [" + "1, " * 250 + "]}\n")
    lines = str(err).splitlines()
    assert len(err.problems) == 250
    assert lines[:100] == [p.located() for p in err.problems[:100]]
    assert lines[100:] == ["(and 150 more problems)"]
    assert str(error_of("protect: {users: [" + "1, " * 100 + "]}\n")).count("\n") == 99


@pytest.mark.parametrize(
    ("template", "item", "too_many", "why"),
    [
        ("on_failure: [{}]\n", "[/bin/true]", 9000, "holds 54176 YAML values"),
        (
            "protect: {{users: [{}]}}\n",
            "\u00e9" * 4000,
            70,
            "characters, more than one file may hold (1048576)",
        ),
    ],
)
def test_a_policy_that_would_not_read_back_written_out_is_refused(
    template: str, item: str, too_many: int, why: str
) -> None:
    """``check-config`` prints the policy written out in full, and the daemon keeps that as
    the last accepted policy, its fallback at a rejected start. Defaults spelled out make it
    larger than what was read (a bare hook's 2 values are written as 6, an 'é' as '\\xE9'), and
    one past what a file may hold was accepted, then refused when read back."""
    err = error_of(template.format(", ".join([item] * too_many)))
    assert (err.path, err.line, err.key) == (DROP_IN, None, None)
    assert err.message.startswith("written out in full, the policy ")
    assert why in err.message


def bounded_keys() -> list[tuple[str, Bound]]:
    """Every bounded key of the key table, with its documented path (``rules[].for``,
    ``hooks[].timeout``)."""
    found: list[tuple[str, Bound]] = []

    def walk(section: Section, prefix: str) -> None:
        for key in section.keys:
            if isinstance(key.value, Nested):
                nested = SECTIONS[key.value.section]
                if nested.name == "hook":
                    continue  # listed once, as hooks[]
                inner = prefix if key.value.flatten else f"{prefix}{key.name}"
                inner += "[]." if key.value.many else ("" if key.value.flatten else ".")
                walk(nested, inner)
            elif key.value.bound is not None:
                found.append((prefix + key.name, key.value.bound))

    walk(SECTIONS[""], "")
    walk(SECTIONS["hook"], "hooks[].")
    return found


def test_every_duration_bound_fits_the_daemons_timers() -> None:
    """What passes check-config can be slept on, polled with and added to a monotonic clock."""
    for key, bound in bounded_keys():
        if bound.unit == "duration":
            assert bound.highest * 1000 < 2**31 - 1, key  # poll(2) milliseconds
            assert bound.highest < threading.TIMEOUT_MAX
            assert time.monotonic() + bound.highest > time.monotonic()


def test_nvml_timeout_stays_well_under_the_units_watchdog() -> None:
    unit = (REPO / "systemd" / "gpuwatchd.service").read_text()
    watchdog = re.search(r"^WatchdogSec=(\d+)s$", unit, re.M)
    assert watchdog is not None
    (nvml,) = [b for key, b in bounded_keys() if key == "nvml_timeout"]
    assert nvml.highest <= int(watchdog.group(1)) * 2 / 3


def test_the_bounds_tables_in_the_policy_doc_and_man_page_match_the_schema() -> None:
    doc = (REPO / "docs" / "policy.md").read_text()
    section = doc.split("## Bounds", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_.\[\]]+)` +\| ([^|]+?) +\| ([^|]+?) +\|", section, re.M)
    documented = {key: (low, high) for key, low, high in rows}
    expected = {key: (b.lowest_text, b.highest_text) for key, b in bounded_keys()}
    assert documented == expected
    man = (REPO / "docs" / "man" / "gpuwatchd.yaml.5").read_text()
    limits = man.split(".SH LIMITS", 1)[1].split(".SH ", 1)[0]
    lines = re.findall(r"^([a-z_.\[\]]+) +(\S+) \.\. (\S+)$", limits, re.M)
    assert {key: (low, high) for key, low, high in lines} == expected


def test_the_bounds_of_what_a_reset_records_are_documented_as_the_code_has_them() -> None:
    doc = (REPO / "docs" / "policy.md").read_text()
    section = doc.split("## Bounds", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(
        r"^\| (hooks in|commands in|arguments of|characters of)[^|]+\| (\d+) +\|", section, re.M
    )
    bounds = [("hooks in", MAX_COMMANDS), ("commands in", MAX_COMMANDS), ("arguments of", MAX_ARGS)]
    bounds += [("characters of", MAX_FILLED_CHARS)]
    assert rows == [(what, str(bound)) for what, bound in bounds]
    man = (REPO / "docs" / "man" / "gpuwatchd.yaml.5").read_text()
    limits = " ".join(man.split(".SH LIMITS", 1)[1].split(".SH ", 1)[0].split())
    assert f"At most {MAX_COMMANDS} hooks" in limits
    assert f"at most {MAX_COMMANDS} commands in .IR reset.mig_recovery_commands" in limits
    assert f"at most {MAX_ARGS} arguments in any command" in limits
    assert f"at most {MAX_FILLED_CHARS} characters in an argument once" in limits


# --- 4. NUL in argv and strings -------------------------------------------------------------------

NUL = '"x\\0y"'  # a YAML escape: the file itself holds no NUL


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (f"reset:\n  command: [nvidia-smi, --gpu-reset, -i, '{{uuid}}', {NUL}]\n", "reset.command"),
        (f"reset:\n  persistence_command: [{NUL}, '{{mode}}', -i, '{{uuid}}']\n", None),
        (f"reset:\n  health_command: [nvidia-smi, -q, -i, '{{uuid}}', {NUL}]\n", None),
        (f"reset:\n  drain: [[drain, {NUL}]]\n", "reset.drain[0]"),
        (f"reset:\n  after: [{{command: [notify, {NUL}]}}]\n", "reset.after[0].command"),
        (f"on_failure: [[page, {NUL}]]\n", "on_failure[0]"),
        (f"state_dir: {NUL[:1]}/var/lib\\0x{NUL[-1:]}\n", "state_dir"),
        (f"protect:\n  users: [{NUL}]\n", "protect.users[0]"),
    ],
)
def test_a_nul_in_an_argument_or_string_is_refused(text: str, key: str | None) -> None:
    err = error_of(text)
    assert "NUL" in err.message
    if key is not None:
        assert err.key == key


# --- 5. exactly one GPU selector; no shell behind a launcher --------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["nvidia-smi", "--gpu-reset", "-i", "{uuid}", "-i", "0,1"],
        ["nvidia-smi", "--gpu-reset", "-i", "{uuid}", "--id=0"],
        ["nvidia-smi", "--gpu-reset", "-i", "{uuid}", "-i0"],
        ["nvidia-smi", "--gpu-reset", "-i", "{uuid}", "--id", "1"],
        ["nvidia-smi", "--gpu-reset", "--id=0", "-i", "{uuid}"],
        ["nvidia-smi", "--gpu-reset", "-i{uuid}", "-i1"],
        ["nvidia-smi", "--gpu-reset", "-i", "{uuid}", "-i"],
        ["nvidia-smi", "--gpu-reset", "--id={minor}"],
        ["nvidia-smi", "--gpu-reset", "-i", "x{uuid}"],
        ["nvidia-smi", "--gpu-reset", "-i", "{uuid}", "--id=", "0"],
        ["/usr/local/sbin/site-reset", "{uuid}", "--id=3"],
        ["/usr/local/sbin/site-reset", "{uuid}", "-i3"],
        ["timeout", "60", "nvidia-smi", "--gpu-reset", "-i", "{uuid}", "--id=0"],
    ],
)
def test_a_second_or_index_selector_in_any_spelling_is_refused(argv: list[str]) -> None:
    err = error_of(f"reset:\n  command: {yaml.safe_dump(argv, default_flow_style=True)}")
    assert (err.key, err.line) == ("reset.command", 2)


@pytest.mark.parametrize(
    "argv",
    [
        ["nvidia-smi", "--gpu-reset", "-i", "{uuid}"],
        ["nvidia-smi", "--gpu-reset", "-i{uuid}"],
        ["nvidia-smi", "--gpu-reset", "--id", "{pci_bus_id}"],
        ["nvidia-smi", "--gpu-reset", "--id={pci_bus_id}"],
        ["timeout", "60", "nvidia-smi", "--gpu-reset", "-i", "{uuid}"],
        ["nice", "-n", "5", "/usr/bin/nvidia-smi", "-r", "-i", "{uuid}"],
        ["/usr/local/sbin/site-reset", "--gpu", "{uuid}", "--dev", "/dev/nvidia{minor}"],
    ],
)
def test_one_selector_in_any_spelling_is_accepted(argv: list[str]) -> None:
    policy = parse(f"reset:\n  command: {yaml.safe_dump(argv, default_flow_style=True)}")
    assert policy.reset.command == tuple(argv)


@pytest.mark.parametrize("key", ["command", "persistence_command", "health_command"])
def test_a_second_selector_from_a_drop_in_is_refused(key: str) -> None:
    mode = ", -pm, '{mode}'" if key == "persistence_command" else ""
    drop_in = f"reset:\n  {key}: [nvidia-smi{mode}, -i, '{{uuid}}', -i, '0,1']\n"
    with pytest.raises(ConfigError) as caught:
        schema.parse_policy_documents(
            [("/etc/gpuwatchd/gpuwatchd.yaml", "dry_run: true\n"), (DROP_IN, drop_in)]
        )
    assert (caught.value.path, caught.value.line, caught.value.key) == (DROP_IN, 2, f"reset.{key}")


@pytest.mark.parametrize(
    ("hook", "hint"),
    [
        ("[nvidia-smi, -r]", "names no GPU"),
        ("[nvidia-smi, -q, -i, '{uuid}', -i, '0']", ""),
        ("[nvidia-smi, -q, --id=0]", "by index"),
        ("{command: [timeout, '5', nvidia-smi, --gpu-reset], timeout: 10s}", "names no GPU"),
    ],
)
def test_a_hook_that_runs_nvidia_smi_names_exactly_one_gpu(hook: str, hint: str) -> None:
    err = error_of(f"on_failure:\n  - {hook}\n")
    assert err.key is not None
    assert err.key.startswith("on_failure[0]")
    assert hint in err.message


def test_a_hook_may_query_one_gpu_with_nvidia_smi() -> None:
    policy = parse("on_failure:\n  - [nvidia-smi, -q, -i, '{uuid}']\n")
    assert policy.on_failure[0].argv == ("nvidia-smi", "-q", "-i", "{uuid}")


SHELLS_BEHIND_LAUNCHERS = [
    ["env", "sh", "-c", "nvidia-smi -r -i {uuid}"],
    ["/usr/bin/env", "bash", "-c", "nvidia-smi -r -i {uuid}"],
    ["env", "-i", "PATH=/bin", "/bin/dash", "-c", "nvidia-smi -r -i {uuid}"],
    ["env", "-S", "nvidia-smi -r -i {uuid}"],
    ["env", "--split-string=nvidia-smi -r -i {uuid}"],
    ["sudo", "sh", "-c", "nvidia-smi -r -i {uuid}"],
    ["sudo", "-u", "root", "--", "zsh", "-c", "nvidia-smi -r -i {uuid}"],
    ["nice", "-n", "5", "sh", "-c", "nvidia-smi -r -i {uuid}"],
    ["timeout", "5", "sh", "-c", "nvidia-smi -r -i {uuid}"],
    ["systemd-run", "--wait", "--pipe", "bash", "-c", "nvidia-smi -r -i {uuid}"],
    ["busybox", "sh", "-c", "nvidia-smi -r -i {uuid}"],
    ["busybox", "timeout", "5", "nvidia-smi", "-r", "-i", "{uuid}"],
    ["python3", "-c", "import os; os.system('nvidia-smi -r -i {uuid}')"],
    ["/usr/bin/python3.11", "-Ic", "import os; os.system('nvidia-smi -r -i {uuid}')"],
    ["perl", "-e", "system('nvidia-smi -r -i {uuid}')"],
    ["perl", "-ne", "system('nvidia-smi -r -i {uuid}')"],
    ["ruby", "-e", "system('nvidia-smi -r -i {uuid}')"],
    ["node", "--eval", "require('child_process').execSync('nvidia-smi -r -i {uuid}')"],
    ["php", "-r", "system('nvidia-smi -r -i {uuid}');"],
    ["awk", 'BEGIN { system("nvidia-smi -r -i {uuid}") }'],
    ["su", "root", "-c", "nvidia-smi -r -i {uuid}"],
    ["flock", "/run/lock/gpu", "-c", "nvidia-smi -r -i {uuid}"],
    ["watch", "-n", "1", "nvidia-smi -r -i {uuid}"],
    ["ssh", "localhost", "nvidia-smi -r -i {uuid}"],
    ["xargs", "-0", "sh", "-c", "nvidia-smi -r -i {uuid}"],
    ["find", "/", "-maxdepth", "0", "-exec", "sh", "-c", "nvidia-smi -r -i {uuid}", ";"],
]


@pytest.mark.parametrize("argv", SHELLS_BEHIND_LAUNCHERS)
@pytest.mark.parametrize("where", ["reset.command", "on_failure[0]"])
def test_a_shell_or_inline_code_behind_a_launcher_is_refused(argv: list[str], where: str) -> None:
    flow = yaml.safe_dump(argv, default_flow_style=True, width=1000).strip()
    text = f"reset:\n  command: {flow}\n" if where == "reset.command" else f"on_failure: [{flow}]\n"
    err = error_of(text)
    assert err.key == where
    assert "shell" in err.message or "inline code" in err.message


@pytest.mark.parametrize(
    "argv",
    [
        [
            "systemd-run",
            "--wait",
            "--pipe",
            "--quiet",
            "--collect",
            "scontrol",
            "update",
            "nodename=gpu01",
            "state=drain",
            "reason=gpuwatchd: action failed",
        ],
        ["timeout", "5", "/usr/local/sbin/drain", "{uuid}"],
        ["python3", "/usr/local/sbin/drain.py", "{pci_bus_id}"],
        ["python3", "-m", "site_drain", "{uuid}"],
        ["env", "LC_ALL=C", "/usr/local/sbin/page-oncall", "gpu {uuid}"],
        ["logger", "-t", "gpuwatchd", "reason=sh -c is refused"],
        ["flock", "/run/lock/gpu", "/usr/local/sbin/drain"],
    ],
)
def test_launchers_and_interpreters_running_a_program_are_accepted(argv: list[str]) -> None:
    flow = yaml.safe_dump(argv, default_flow_style=True, width=1000).strip()
    assert parse(f"on_failure: [{flow}]\n").on_failure[0].argv == tuple(argv)


# --- 6. values filled into an argv at run time ----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("uuid", f"{UUID},GPU-00000000-0000-0000-0000-000000000000"),
        ("uuid", "-i"),
        ("uuid", "--all"),
        ("uuid", "-" + UUID),
        ("uuid", UUID + "\n"),
        ("uuid", " " + UUID),
        ("uuid", UUID[:-1]),
        ("uuid", UUID[:-1] + "g"),
        ("uuid", "GPU-00000000-fake-4000-8000-000000000000"),
        ("uuid", "0"),
        ("uuid", ""),
        ("uuid", "MIG-" + UUID + ",0"),
        ("pci_bus_id", f"{BUS},00000000:3C:00.0"),
        ("pci_bus_id", "3B:00.0"),
        ("pci_bus_id", "000:3B:00.0"),
        ("pci_bus_id", "00000000:3B:00.8"),
        ("pci_bus_id", "-1"),
        ("pci_bus_id", BUS + " "),
        ("minor", "256"),
        ("minor", "-1"),
        ("minor", "1,2"),
        ("minor", "01"),
        ("minor", ""),
        ("minor", "\u0663"),  # ARABIC-INDIC DIGIT THREE: isdigit() but not an index
        ("mode", "2"),
        ("mode", "on"),
    ],
)
def test_format_argv_refuses_a_value_not_in_its_documented_format(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{{{name}}}")):
        format_argv(["nvidia-smi", "-i", f"{{{name}}}"], **{name: value})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("uuid", UUID),
        ("uuid", UUID.upper().replace("GPU-", "GPU-")),
        ("uuid", "MIG-" + UUID[4:]),
        ("uuid", "MIG-" + UUID + "/1/0"),
        ("pci_bus_id", BUS),
        ("pci_bus_id", "0000:3b:00.0"),
        ("minor", "0"),
        ("minor", "255"),
        ("mode", "0"),
        ("mode", "1"),
    ],
)
def test_format_argv_accepts_values_in_their_documented_format(name: str, value: str) -> None:
    assert format_argv(["x", f"--gpu={{{name}}}"], **{name: value}) == ("x", f"--gpu={value}")


def test_format_argv_checks_only_the_values_it_fills_in() -> None:
    assert format_argv(["page-oncall", "plain"], uuid="-rf", minor="x") == ("page-oncall", "plain")


# --- 7. fuzz: a policy or a ConfigError, nothing else ---------------------------------------------

KEYS = sorted(
    set(re.findall(r"^\s*-?\s*([a-z_]+):", schema.render_policy(schema.default_policy()), re.M))
    | {"enabled", "min_memory", "signal", "wait", "command", "timeout", "for", "<<"}
)
VALUES = [
    "30s",
    "500ms",
    "1h30m",
    "99999999999999999999d",
    "1e400s",
    "256MiB",
    "1" + "0" * 400 + "MiB",
    "{uuid}",
    "{pci_bus_id}",
    "{minor}",
    "{mode}",
    "{",
    "nvidia-smi",
    "-i",
    "-i0",
    "--id=0",
    "sh",
    "env",
    "-c",
    "SIGTERM",
    "orphaned",
    "ghost_memory",
    UUID,
    "0000:3b:00.0",
    "/var/lib/x",
    "((",
    "x\x00y",
    "\x1b[31m",
]
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.just(10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(VALUES),
)
documents = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), children, max_size=6),
    ),
    max_leaves=40,
)
top_levels = st.dictionaries(st.sampled_from(KEYS), documents, max_size=8)


def _template() -> dict[str, Any]:
    """The rendered default policy, with a hook and every optional key filled in."""
    template: dict[str, Any] = yaml.safe_load(schema.render_policy(schema.default_policy()))
    hook = {"command": ["nvidia-smi", "-q", "-i", "{uuid}"], "timeout": "1m"}
    for hooks in (template["reset"], template):
        for key in ("drain", "before", "after", "on_failure"):
            if key in hooks:
                hooks[key] = [hook, ["drain-node", "{pci_bus_id}"]]
    template["rules"][0]["min_memory"] = "1GiB"
    return template


def mutated(template: object) -> st.SearchStrategy[Any]:
    """Documents shaped like ``template``: each key kept, left out or given a hostile value."""
    if isinstance(template, dict):
        inner = st.fixed_dictionaries({}, optional={k: mutated(v) for k, v in template.items()})
        return inner | documents
    if isinstance(template, list) and template:
        return st.lists(st.one_of(*(mutated(item) for item in template)), max_size=3) | leaves
    return st.just(template) | leaves


valid_shaped = mutated(_template())
YAML_TOKENS = [
    *"[]{}:,-?&*!|>'\"#%@` \n\t\\0123456789abcxyz_.",
    "\x00",
    "\x1b",
    "\x85",
    "\u2028",
    "\ufeff",
    "\udcff",
    ": ",
    "- ",
    "\n  ",
    "&a ",
    "*a",
    "!!int ",
    "!!bool ",
    "!!binary ",
    "!!timestamp ",
    "!!python/name:os.system ",
    "<<: ",
    "---\n",
    "...\n",
    "%YAML 1.1\n",
    *(f"{key}: " for key in KEYS),
    *VALUES,
]
yamlish = st.lists(st.sampled_from(YAML_TOKENS), max_size=60).map("".join)


def policy_or_config_error(*docs: str) -> None:
    problems: tuple[ConfigError, ...] = ()
    try:
        policy = schema.parse_policy_documents(
            [(f"/etc/f{i}.yaml", text) for i, text in enumerate(docs)]
        )
    except ConfigError as err:
        problems, message = err.problems, str(err)
        assert message  # every problem can be printed
    else:
        assert isinstance(policy, Policy)
    assert all(problem.path is not None for problem in problems)


@fuzz_settings
@given(yamlish)
def test_fuzz_yamlish_text_gives_a_policy_or_a_config_error(text: str) -> None:
    policy_or_config_error(text)


@fuzz_settings
@given(valid_shaped | top_levels, valid_shaped | top_levels)
def test_fuzz_structured_documents_give_a_policy_or_a_config_error(
    main: dict[str, Any], drop_in: dict[str, Any]
) -> None:
    dump: Callable[[object], str] = lambda data: yaml.safe_dump(data, allow_unicode=True)  # noqa: E731
    policy_or_config_error(dump(main), dump(drop_in))


@fuzz_settings
@given(st.integers(min_value=1, max_value=1500), st.sampled_from(["[", "{a: ", "- ", "k:\n "]))
def test_fuzz_nesting_gives_a_policy_or_a_config_error(depth: int, opener: str) -> None:
    policy_or_config_error("rules: " + opener * depth)


@fuzz_settings
@given(st.lists(st.sampled_from(VALUES) | st.text(max_size=8), max_size=8))
def test_fuzz_reset_commands_are_accepted_or_refused_with_config_error(argv: list[str]) -> None:
    policy_or_config_error(yaml.safe_dump({"reset": {"command": argv}}, allow_unicode=True))


@fuzz_settings
@given(st.sampled_from(["uuid", "pci_bus_id", "minor", "mode"]), st.text(max_size=60))
def test_fuzz_format_argv_fills_a_valid_value_or_raises_value_error(name: str, value: str) -> None:
    try:
        (filled,) = format_argv([f"{{{name}}}"], **{name: value})
    except ValueError:
        return
    assert filled == value
    assert not filled.startswith("-")
    assert "," not in filled
    assert filled.isprintable()
