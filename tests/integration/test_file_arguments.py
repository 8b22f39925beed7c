"""Every file a command is given is read bounded, and only if it is a regular file.

``simulate SCENARIO`` and ``explain SNAPSHOT`` once read ``/dev/zero`` without end and hung on
a FIFO; ``explain`` died with a traceback on a 5,000-digit integer (Python's limit on integer
conversion). Each is now one line naming the file (and the field) with exit 65; a policy file
that is not a regular file stays exit 78. Real commands, each under a timeout that a hang
would exceed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatchd.config.files import (
    FileTooLarge,
    NotARegularFile,
    read_regular_file,
)


def gpuwatchd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", *args],
        capture_output=True,
        text=True,
        timeout=30,  # a FIFO that blocked the open would run into this
        check=False,
    )


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("command", ["simulate", "explain"])
@pytest.mark.parametrize(
    ("target", "kind"),
    [("/dev/zero", "a character device"), ("fifo", "a FIFO"), ("dir", "a directory")],
)
def test_a_file_argument_that_is_not_a_regular_file_is_refused_at_once(
    command: str, target: str, kind: str, fifo: Path, tmp_path: Path
) -> None:
    path = {"fifo": str(fifo), "dir": str(tmp_path)}.get(target, target)
    result = gpuwatchd(command, path)
    assert result.returncode == 65, result.stderr
    assert result.stderr.startswith(f"gpuwatchd: {path}")
    assert f"not a regular file ({kind})" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_a_policy_that_is_a_fifo_stays_a_configuration_error(fifo: Path) -> None:
    result = gpuwatchd("check-config", str(fifo))
    assert result.returncode == 78
    assert "a FIFO" in result.stderr


@pytest.mark.parametrize(("command", "limit"), [("simulate", 1 << 20), ("explain", 64 << 20)])
def test_a_file_argument_over_its_limit_is_refused_unparsed(
    command: str, limit: int, tmp_path: Path
) -> None:
    big = tmp_path / "big"
    with open(big, "wb") as handle:
        handle.truncate(limit + 1)  # sparse: costs no disk
    result = gpuwatchd(command, str(big))
    assert result.returncode == 65, result.stderr
    assert "larger than" in result.stderr


def test_explain_names_the_field_of_a_number_python_cannot_convert(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    report.write_text('{"gpus": [{"index": 0, "memory": {"total": ' + "9" * 5000 + "}}]}")
    result = gpuwatchd("explain", str(report))
    assert result.returncode == 65, result.stderr
    assert "gpus[0].memory.total" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr) < 300, "the number itself is not echoed"


def test_the_bounded_reader_checks_the_open_descriptor_too(tmp_path: Path, fifo: Path) -> None:
    small = tmp_path / "small"
    small.write_bytes(b"12345")
    assert read_regular_file(str(small), 5) == b"12345"
    with pytest.raises(FileTooLarge):
        read_regular_file(str(small), 4)
    with pytest.raises(NotARegularFile):
        read_regular_file(str(fifo), 4)
    with pytest.raises(FileNotFoundError):
        read_regular_file(str(tmp_path / "missing"), 4)


# `gpuwatchd ARGS`, then the process's peak resident memory in KiB on the last line of stdout:
# VmHWM, its own memory's high-water mark (ru_maxrss would also count the forked parent's, the
# test runner's, which Linux carries over an exec).
_MEASURED = """
import sys
from gpuwatchd.cli.main import main
code = main(sys.argv[1:])
with open("/proc/self/status") as status:
    print(next(line.split()[1] for line in status if line.startswith("VmHWM:")))
sys.exit(code)
"""


def test_explain_refuses_a_report_by_its_shape_before_parsing_it(tmp_path: Path) -> None:
    """Issue 34 #11: 60 MB of nested empty lists, under the 64 MiB cap, took explain 1.5 GB of
    memory to parse. Now values and nesting are counted first (strings set aside): refused,
    exit 65, in well under the memory the parse would take."""
    report = tmp_path / "report.json"
    with open(report, "w", encoding="ascii") as handle:
        handle.write('{"gpus": [')
        handle.write("[]," * 20_000_000)  # 60 MB
        handle.write("[]]}")
    result = subprocess.run(
        [sys.executable, "-c", _MEASURED, "explain", str(report)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 65, result.stderr
    assert "more than 1000000 values" in result.stderr
    peak_mib = int(result.stdout.split()[-1]) // 1024
    assert peak_mib < 400, peak_mib  # the parse alone: about 1,500; this: about 190


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"gpus": [' + "[]," * 1_000_000 + "[]]}", "more than 1000000 values"),
        ('{"gpus": ' + "[" * 40 + "]" * 40 + "}", "nested more than 32 deep"),
    ],
)
def test_a_report_past_a_shape_bound_is_a_snapshot_error(
    text: str, problem: str, tmp_path: Path
) -> None:
    from gpuwatchd.cli.report_read import SnapshotError, load_report

    report = tmp_path / "report.json"
    report.write_text(text)
    with pytest.raises(SnapshotError, match=problem):
        load_report(str(report))


def test_brackets_and_commas_inside_strings_are_text_not_shape(tmp_path: Path) -> None:
    from gpuwatchd.cli.report_read import load_report

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"cmdline": "[{," * 400_000 + '\\"]', "gpus": []}))
    assert load_report(str(report))["gpus"] == []


def test_a_string_left_open_over_escaped_quotes_is_refused_at_once(tmp_path: Path) -> None:
    """A report of one string never closed, made of 400,000 escaped quotes (800 KB): setting
    its strings aside tried each escaped quote as a string's start and read on to the end
    (hours, quadratic). Now the open string runs to the end: one line, exit 65, at once."""
    report = tmp_path / "report.json"
    report.write_text('{"gpus": [], "cmdline": "' + '\\"' * 400_000)
    result = gpuwatchd("explain", str(report))
    assert result.returncode == 65, result.stderr
    assert result.stderr.startswith(f"gpuwatchd: {report}:1: not JSON: Unterminated string")


@pytest.mark.parametrize(
    "document",
    [
        {"evidence": {}, "truncated": ["processes\n\x1b[2Jgpuwatchd: forged"]},
        {"gpus\n\x1b[2Jgpuwatchd: forged": 10**50},
    ],
    ids=["an evidence file's cut", "a key over a long number"],
)
def test_the_report_text_a_refusal_names_is_escaped(document: object, tmp_path: Path) -> None:
    """A refusal that quotes the report (what an evidence file says it cut, the key of an
    over-long number) wrote its newline and ESC raw: a forged second line, a repainted
    terminal. Now one line, each as a visible escape."""
    report = tmp_path / "report.json"
    report.write_text(json.dumps(document))
    result = gpuwatchd("explain", str(report))
    assert result.returncode == 65, result.stderr
    assert result.stderr.count("\n") == 1
    assert "\x1b" not in result.stderr
    assert "\\n\\x1b[2Jgpuwatchd: forged" in result.stderr
