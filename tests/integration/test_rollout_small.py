"""The small things a first look at gpuwatchd trips on: no ``_created`` series in the metrics
file, a metrics folder that cannot be written said with what to do, every finding event naming
its finding, and ``make demo`` writing no ANSI codes into a pipe."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.core.vocabulary import EventName, Level
from gpuwatchd.daemon.metrics import Metrics, _why_not_written
from gpuwatchd.decide.plan.decisions import plan
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.events.logs import journal_entry
from tests.support.demo import banner
from tests.support.plancases import ghost, orphan, policy, proc, snap

REPO = Path(__file__).resolve().parents[2]


def test_the_metrics_have_no_created_series_and_keep_their_counters() -> None:
    metrics = Metrics(None)
    metrics.observe(
        EventName.ACTION_SIGNAL, Level.WARNING, {"signal": "SIGTERM", "outcome": "gone"}
    )
    text = metrics.render().decode()
    assert "_created" not in text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "gpuwatchd_signals" in names  # the counter family, samples named ..._total
    assert "gpuwatchd_signals_total{" in text


def test_a_metrics_folder_that_does_not_exist_is_said_with_what_to_do(tmp_path: Path) -> None:
    metrics = Metrics(str(tmp_path / "later" / "gpuwatchd.prom"))
    error = metrics.write()
    assert error is not None
    assert f"{tmp_path / 'later'} does not exist; create it" in error
    assert "ReadWritePaths=" in error


def test_a_read_only_metrics_folder_names_read_write_paths() -> None:
    err = OSError(errno.EROFS, "Read-only file system")
    said = _why_not_written("/var/lib/prometheus/node-exporter/gpuwatchd.prom", err)
    assert said.startswith("Read-only file system: /var/lib/prometheus/node-exporter is read-only")
    assert "ReadWritePaths=" in said
    assert "restart gpuwatchd" in said
    other = _why_not_written("/x/y.prom", OSError(errno.ENOSPC, "No space left on device"))
    assert other == "No space left on device"


@pytest.mark.parametrize("gpu_level", [False, True])
def test_finding_resolved_names_the_finding(gpu_level: bool) -> None:
    target = proc(1000, 500)
    finding = ghost() if gpu_level else orphan(target)
    first = plan([finding], snap([target]), PlanState(), policy(), now=0.0, wall=0.0)
    gone = plan([], snap([target]), first.state, policy(), now=5.0, wall=5.0)
    (resolved,) = [e for e in gone.events if e.name == EventName.FINDING_RESOLVED]
    assert resolved.fields["kind"] == finding.kind.value
    assert resolved.fields["finding"] == finding.key
    assert resolved.fields["pid"] == (None if gpu_level else 1000)
    journal = journal_entry("info", {"event": EventName.FINDING_RESOLVED, **resolved.fields})
    assert f"FINDING_KIND={finding.kind.value}\n".encode() in journal


def test_the_demo_banner_is_plain_when_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    banner("scan")
    out = capsys.readouterr().out
    assert "=== scan" in out
    assert "\033" not in out


def test_make_set_up_sends_pip_output_to_a_log() -> None:
    """`make demo` starts quietly: both pip commands of the venv set-up are in one block whose
    output goes to .venv/setup.log (shown only when it fails); no command line is echoed."""
    dry = subprocess.run(
        ["make", "-n", "-B", "-C", str(REPO), ".venv/.installed"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert dry.returncode == 0, dry.stderr
    recipe = dry.stdout.replace("\\\n", " ")
    (block,) = [line for line in recipe.splitlines() if "pip install" in line]
    assert block.count("pip install") == 2
    assert "} >.venv/setup.log 2>&1 ||" in block
    assert "cat .venv/setup.log >&2" in block
    makefile = (REPO / "Makefile").read_text()
    recipe_lines = makefile.split("$(VENV)/.installed: pyproject.toml\n", 1)[1].split("\n\n")[0]
    assert all(line.startswith("\t@") for line in recipe_lines.splitlines() if line[:2] != "\t\t")


def test_out_is_ignored() -> None:
    ignored = subprocess.run(
        ["git", "-C", str(REPO), "check-ignore", "-q", "out/gpuwatchd_0_all.deb"], check=False
    )
    assert ignored.returncode == 0
