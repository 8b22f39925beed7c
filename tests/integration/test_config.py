"""Tests for the policy file format: units, strict validation, drop-ins, rendering, StrictModes."""

from __future__ import annotations

import dataclasses
import os
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from gpuwatchd.act.reset_target import (
    Commands,
    ResetTarget,
    prepare_commands,
)
from gpuwatchd.cli.main import main as cli_main
from gpuwatchd.config.files import (
    check_config_permissions,
    read_leading_files,
    read_policy_files,
)
from gpuwatchd.config.keys import normalize_gpu_id
from gpuwatchd.config.schema import (
    default_policy,
    load_policy,
    parse_policy_documents,
    render_policy,
)
from gpuwatchd.config.units import format_duration, format_size, parse_duration, parse_size
from gpuwatchd.config.yamlsrc import ConfigError
from gpuwatchd.core.model import MIB, FindingKind
from gpuwatchd.decide.argv import MAX_ARGS as MAX_RECORDED_ARGS
from gpuwatchd.decide.argv import MAX_COMMANDS as MAX_RECORDED_COMMANDS
from gpuwatchd.decide.argv import MAX_FILLED_CHARS as MAX_RECORDED_CHARS
from gpuwatchd.decide.policy import Hook, Policy, Step
from gpuwatchd.state.accepted import render_accepted

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "config" / "gpuwatchd.yaml"
DROP_IN = "/etc/gpuwatchd/conf.d/10-site.yaml"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="StrictModes checks need root")


def parse(text: str, filename: str = DROP_IN) -> Policy:
    return parse_policy_documents([(filename, textwrap.dedent(text))])


def error_of(text: str, filename: str = DROP_IN) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse(text, filename)
    return caught.value


def without_sources(policy: Policy) -> Policy:
    return dataclasses.replace(policy, sources=())


# --- durations and sizes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("500ms", 0.5),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("0s", 0.0),
        (" 10s ", 10.0),
        (5, 5.0),
        (0.25, 0.25),
        (0, 0.0),
    ],
)
def test_parse_duration_accepts_units_and_bare_seconds(text: object, seconds: float) -> None:
    assert parse_duration(text, where="interval") == seconds


@pytest.mark.parametrize(
    "text",
    ["-1s", -1, -0.5, "30", "5x", "30 s", "", "s", "1e3s", "30S", True, None, [1], float("inf")],
)
def test_parse_duration_refuses_bad_values_naming_the_key(text: object) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_duration(text, where="reset.timeout")
    assert caught.value.key == "reset.timeout"
    assert "reset.timeout" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("256MiB", 256 * MIB),
        ("1GiB", 1024 * MIB),
        ("512KiB", 512 * 1024),
        ("100MB", 100_000_000),
        ("1kB", 1000),
        ("1.5GiB", 1536 * MIB),
        ("1.001kB", 1001),  # exactly whole: refused once, a float product being 1000.9999...
        ("0.003MB", 3000),
        ("7B", 7),
        (1024, 1024),
        (0, 0),
    ],
)
def test_parse_size_accepts_binary_and_decimal_units(text: object, size: int) -> None:
    assert parse_size(text, where="detection.ghost_margin") == size


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("256mib", "did you mean 'MiB'"),
        ("-1MiB", "invalid size"),
        (-5, ">= 0"),
        ("1.5B", "whole number"),
        ("1.0000000000000001KiB", "whole number"),  # 1024.0000000000001024: was read as 1024
        ("MiB", "invalid size"),
        ("256", "invalid size"),
        (1.5, "expected a size"),
        (True, "expected a size"),
        (None, "expected a size"),
    ],
)
def test_parse_size_refuses_bad_values(text: object, hint: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(hint)):
        parse_size(text, where="detection.ghost_margin")


@pytest.mark.parametrize(
    "seconds", [0.0, 0.5, 0.001, 1.5, 5.0, 90.0, 3600.0, 86400.0, 0.1234, 1e-05, 2.5e-07]
)
def test_format_duration_round_trips(seconds: float) -> None:
    assert parse_duration(format_duration(seconds), where="x") == seconds


@pytest.mark.parametrize(
    ("size", "text"), [(256 * MIB, "256MiB"), (1024 * MIB, "1GiB"), (1000, "1000B"), (0, "0B")]
)
def test_format_size_uses_the_largest_exact_binary_unit(size: int, text: str) -> None:
    assert format_size(size) == text
    assert parse_size(text, where="x") == size


# --- strict validation --------------------------------------------------------------------------

SITE_WITH_TYPO = """\
# site policy
dry_run: false
rules:
  - name: orphans
    kind: orphaned
    for: 30s
    steps:
      - signal: SIGTERM
        wait: 30s
      - signal: SIGKILL
        wait: 10s
        sginal: SIGKILL
"""


def test_unknown_key_names_file_line_key_path_and_suggestion() -> None:
    err = error_of(SITE_WITH_TYPO)
    assert str(err) == (
        f"{DROP_IN}:12: rules[0].steps[1].sginal: unknown key (did you mean 'signal'?)"
    )
    assert (err.path, err.line, err.key) == (DROP_IN, 12, "rules[0].steps[1].sginal")


@pytest.mark.parametrize(
    ("text", "line", "key", "hint"),
    [
        ("intervall: 5s\n", 1, "intervall", "did you mean 'interval'"),
        ("dry_run: true\nreset:\n  confirm_fro: 1m\n", 3, "reset.confirm_fro", "'confirm_for'"),
        ("confirm_for: 1m\n", 1, "confirm_for", "it belongs under 'reset'"),
        ("limits:\n  max_signaled_per_poll: 1\n", 2, "limits.max_signaled_per_poll", "did you"),
        ("protect:\n  user: [bob]\n", 2, "protect.user", "did you mean 'users'"),
        ("log:\n  fromat: json\n", 2, "log.fromat", "did you mean 'format'"),
        ("reset:\n  before:\n    - {command: [x], timout: 5s}\n", 3, "reset.before[0].timout", ""),
        ("zzz: 1\n", 1, "zzz", "unknown key"),
    ],
)
def test_unknown_keys_are_located(text: str, line: int, key: str, hint: str) -> None:
    err = error_of(text)
    assert (err.line, err.key) == (line, key)
    assert hint in str(err)


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        ("interval: 5s\ndry_run: true\ninterval: 6s\n", 3, "interval"),
        ("reset:\n  enabled: true\n  enabled: false\n", 3, "reset.enabled"),
        ("rules:\n  - name: a\n    kind: zombie\n    kind: orphaned\n", 4, "rules[0].kind"),
    ],
)
def test_duplicate_keys_in_one_mapping_are_refused(text: str, line: int, key: str) -> None:
    err = error_of(text)
    assert (err.line, err.key) == (line, key)
    assert "duplicate key (first at line" in err.message


def test_duplicate_rule_names_in_one_file_are_refused() -> None:
    text = """\
    rules:
      - {name: a, kind: zombie, steps: [{signal: null}]}
      - {name: a, kind: stuck, steps: [{signal: null}]}
    """
    err = error_of(text)
    assert err.line == 3
    assert "duplicate rule name 'a' (first at line 2)" in str(err)


@pytest.mark.parametrize(
    ("text", "key", "hint"),
    [
        ("interval: 0s\n", "interval", ">= 100ms and <= 1h"),
        ("interval: fast\n", "interval", "invalid duration"),
        ("nvml_timeout: -1\n", "nvml_timeout", ">= 0"),
        ("dry_run: maybe\n", "dry_run", "expected true or false"),
        ("dry_run: 1\n", "dry_run", "expected true or false"),
        ("state_dir: var/lib\n", "state_dir", "absolute path"),
        ("state_dir: [a]\n", "state_dir", "expected a single value"),
        ("device_major: 195.5\n", "device_major", "expected an integer"),
        ("device_major: true\n", "device_major", "expected an integer"),
        ("device_major: 5000\n", "device_major", "<= 4095"),
        ("limits: {max_signalled_per_poll: -1}\n", "limits.max_signalled_per_poll", ">= 0"),
        ("reset: {max_failures: 0}\n", "reset.max_failures", ">= 1"),
        ("reset: {window: 0s}\n", "reset.window", ">= 1m and <= 7d"),
        ("reset: [1]\n", "reset", "expected a mapping"),
        ("reset: {monitors: [gpustat]}\n", "reset.monitors[0]", "expected a mapping"),
        ("reset: {monitors: [{}]}\n", "reset.monitors[0]", "exactly one of 'unit' and"),
        ("reset: {monitors: [{unit: a.service, command: a}]}\n", "reset.monitors[0]", "exactly"),
        ("reset: {monitors: [{unit: null}]}\n", "reset.monitors[0]", "exactly one of 'unit' and"),
        ("reset: {monitors: [{command: null}]}\n", "reset.monitors[0]", "exactly one of 'unit'"),
        ("reset: {monitors: [{unit: gpustat}]}\n", "reset.monitors[0].unit", "service name"),
        ("reset: {monitors: [{unit: -a.service}]}\n", "reset.monitors[0].unit", "service name"),
        ("reset: {monitors: [{command: '(('}]}\n", "reset.monitors[0].command", "regular exp"),
        ("reset: {monitors: [{name: a}]}\n", "reset.monitors[0].name", "unknown key"),
        (f"reset: {{monitors: [{'{unit: a.service}, ' * 17}]}}\n", "reset.monitors", "at most 16"),
        ("protect: {users: bob}\n", "protect.users", "expected a list"),
        ("protect: {users: [1000]}\n", "protect.users[0]", "non-empty string"),
        ("protect: {commands: ['((']}\n", "protect.commands[0]", "invalid regular expression"),
        ("protect: {gpus: ['0']}\n", "protect.gpus[0]", "neither a GPU UUID"),
        ("detection: {ghost_margin: 256mb}\n", "detection.ghost_margin", "invalid size"),
        ("log: {format: xml}\n", "log.format", "expected one of logfmt, json, console"),
        ("on_failure: [[]]\n", "on_failure[0]", "the command is empty"),
        ("on_failure: ['drain-node']\n", "on_failure[0]", "expected an argv list"),
        ("on_failure: [{timeout: 5s}]\n", "on_failure[0]", "missing required key 'command'"),
        ("on_failure: [[sh, -c, 'scontrol']]\n", "on_failure[0]", "is a shell"),
        (f"on_failure: [[echo, {'x' * 4097}]]\n", "on_failure[0]", "longer than 4096 char"),
        (
            f"reset: {{command: [site-reset, '{{uuid}}', {'x' * 4097}]}}\n",
            "reset.command",
            "longer than 4096 characters",
        ),
        ("on_failure: [[drain, '{uid}']]\n", "on_failure[0]", "did you mean 'uuid'"),
        ("rules: {name: a}\n", "rules", "expected a list"),
        ("rules: [null]\n", "rules[0]", "expected a mapping"),
        ("rules: [{name: a, kind: zombie, steps: [{signal: null}]}, ~]\n", "rules[1]", "a mapping"),
        ("rules: [{kind: orphaned, steps: [{signal: null}]}]\n", "rules[0]", "'name'"),
        ("rules: [{name: a, steps: [{signal: null}]}]\n", "rules[0]", "'kind'"),
        ("rules: [{name: a, kind: orphaned}]\n", "rules[0]", "'steps'"),
        ("rules: [{name: a, kind: orphaned, steps: []}]\n", "rules[0]", "at least one step"),
        ("rules: [{name: a, kind: idle, steps: [{signal: null}]}]\n", "rules[0].kind", "one of"),
        (
            "rules: [{name: a, kind: orphaned, steps: [{wait: 1s}]}]\n",
            "rules[0].steps[0]",
            "missing required key 'signal'",
        ),
        (
            "rules: [{name: a, kind: orphaned, steps: [{signal: SIGTERM}]}]\n",
            "rules[0].steps[0]",
            "missing required key 'wait'",
        ),
        (
            "rules: [{name: a, kind: orphaned, steps: [{signal: SIGTREM, wait: 1s}]}]\n",
            "rules[0].steps[0].signal",
            "did you mean 'SIGTERM'",
        ),
        (
            "rules: [{name: a, kind: orphaned, steps: [{signal: 9, wait: 1s}]}]\n",
            "rules[0].steps[0].signal",
            "expected a signal name",
        ),
        (
            "rules: [{name: a, kind: orphaned, min_memory: lots, steps: [{signal: null}]}]\n",
            "rules[0].min_memory",
            "invalid size",
        ),
        ("<<: {interval: 5s}\n", None, "merge keys"),
        ("- a\n- b\n", None, "top level must be a mapping"),
    ],
)
def test_type_and_value_errors_name_the_key(text: str, key: str | None, hint: str) -> None:
    err = error_of(text)
    assert err.key == key
    assert err.path == DROP_IN
    assert hint in str(err)


def test_yaml_syntax_error_names_the_line() -> None:
    err = error_of("interval: 5s\nrules:\n  - name: [unclosed\n")
    assert err.path == DROP_IN
    assert err.line is not None
    assert err.line >= 3
    assert "YAML syntax" in err.message


def test_every_problem_is_reported_in_file_order() -> None:
    err = error_of("interval: 5x\ndry_run: 2\nlog: {format: xml}\n")
    assert [p.line for p in err.problems] == [1, 2, 3]
    assert len(str(err).splitlines()) == 3


@pytest.mark.parametrize(
    ("text", "value"),
    [("off", "off"), ("Off", "off"), ("'off'", "off"), ("journal", "journal"), ("/k", "/k")],
)
def test_health_kernel_log_takes_off_as_policy_md_spells_it(text: str, value: str) -> None:
    # YAML 1.1 reads a bare off as boolean false: the documented spelling must not be refused.
    policy = parse(f"health: {{kernel_log: {text}}}\n")
    assert policy.health.kernel_log == value
    assert parse(render_policy(policy)).health == policy.health


def test_empty_document_is_an_empty_mapping() -> None:
    assert without_sources(parse("")) == Policy()
    assert without_sources(parse("# only a comment\n")) == Policy()


def test_empty_sections_and_lists_mean_defaults() -> None:
    policy = parse("protect:\nreset:\non_failure:\n")
    assert without_sources(policy) == Policy()


@pytest.mark.parametrize(
    ("kind", "reason"),
    {
        "ghost_memory": "freed by the GPU reset",
        "unaccounted_memory": "report-only",
        "zombie": "never signalled",
        "dead_process": "cannot be signalled",
        "stuck": "cannot be killed",
        "hidden_holder": "report-only",
    }.items(),
)
def test_rules_cannot_signal_kinds_that_are_not_process_actions(kind: str, reason: str) -> None:
    text = f"rules: [{{name: r, kind: {kind}, steps: [{{signal: SIGKILL, wait: 1s}}]}}]\n"
    err = error_of(text)
    assert err.key == "rules[0].steps[0].signal"
    assert reason in err.message
    assert "signal: null" in err.message
    report_only = parse(f"rules: [{{name: r, kind: {kind}, steps: [{{signal: null}}]}}]\n")
    assert report_only.rules[0].steps == (Step(None, 0.0),)


@pytest.mark.parametrize("kind", ["orphaned", "abandoned"])
def test_process_level_kinds_may_be_signalled(kind: str) -> None:
    text = f"rules: [{{name: r, kind: {kind}, steps: [{{signal: term, wait: 5s}}]}}]\n"
    assert parse(text).rules[0].steps == (Step("SIGTERM", 5.0),)


def test_a_full_rule_and_hooks_are_read_into_the_typed_policy() -> None:
    policy = parse(
        """\
        protect:
          commands: ['^python .*serve']
          gpus: ['gpu-8F0A1E2B-0000-1111-2222-333344445555', '0000:3b:00.0']
        rules:
          - name: old-jobs
            kind: abandoned
            for: 5m
            min_memory: 1GiB
            users: ['ml-*']
            commands: ['train\\.py']
            cgroups: ['/slurm/*']
            units: ['job-*.scope']
            jobs: ['slurm:*']
            steps:
              - {signal: SIGINT, wait: 1m}
              - {signal: SIGKILL, wait: 10s}
        reset:
          drain: [[scontrol, update, 'nodename=x', state=drain]]
          after: [{command: [notify, '{uuid}'], timeout: 5s}]
        on_failure: [[page-oncall, '{pci_bus_id}']]
        """
    )
    (rule,) = policy.rules
    assert rule.kind is FindingKind.ABANDONED
    assert (rule.for_, rule.min_memory) == (300.0, 1024 * MIB)
    assert rule.commands == (re.compile(r"train\.py"),)
    assert (rule.users, rule.cgroups, rule.units, rule.jobs) == (
        ("ml-*",),
        ("/slurm/*",),
        ("job-*.scope",),
        ("slurm:*",),
    )
    assert rule.steps == (Step("SIGINT", 60.0), Step("SIGKILL", 10.0))
    assert policy.protect.gpus == ("GPU-8f0a1e2b-0000-1111-2222-333344445555", "00000000:3B:00.0")
    assert policy.reset.drain == (Hook(("scontrol", "update", "nodename=x", "state=drain")),)
    assert policy.reset.after == (Hook(("notify", "{uuid}"), 5.0),)
    assert policy.on_failure == (Hook(("page-oncall", "{pci_bus_id}")),)


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("GPU-8F0A1E2B-0000-1111-2222-333344445555", "GPU-8f0a1e2b-0000-1111-2222-333344445555"),
        ("0000:3b:00.0", "00000000:3B:00.0"),
        ("00000000:3B:00.0", "00000000:3B:00.0"),
        ("3b:00.0", "00000000:3B:00.0"),
    ],
)
def test_gpu_ids_are_normalized_to_nvml_spelling(text: str, normal: str) -> None:
    assert normalize_gpu_id(text) == normal


@pytest.mark.parametrize("text", ["0", "GPU-1234", "MIG-8f0a1e2b-0000-1111-2222-333344445555"])
def test_gpu_indices_and_malformed_ids_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="neither"):
        normalize_gpu_id(text)


# --- reset command ------------------------------------------------------------------------------

UUID = "GPU-8f0a1e2b-0000-1111-2222-333344445555"


@pytest.mark.parametrize(
    "argv",
    [
        ["nvidia-smi", "--gpu-reset", "-i", "{uuid}"],
        ["nvidia-smi", "--gpu-reset", "-i", "{pci_bus_id}"],
        ["/usr/bin/nvidia-smi", "-r", "--id={uuid}"],
        ["/usr/local/sbin/site-reset", "--gpu", "{uuid}", "--dev", "/dev/nvidia{minor}"],
        ["site-reset", "{pci_bus_id}"],
    ],
)
def test_reset_command_naming_one_gpu_by_stable_id_is_accepted(argv: list[str]) -> None:
    policy = parse(f"reset:\n  command: {yaml.safe_dump(argv, default_flow_style=True)}")
    assert policy.reset.command == tuple(argv)


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["nvidia-smi", "--gpu-reset", "-i", "{minor}"], "by index"),
        (["nvidia-smi", "--gpu-reset", "-i", "0"], "by index"),
        (["site-reset", "-i", "3", "{uuid}"], "by index"),
        (["site-reset", "/dev/nvidia{minor}"], "names no GPU"),
        (["nvidia-smi", "--gpu-reset"], "names no GPU"),
        (["nvidia-smi", "--gpu-reset", "-i", "{uuid},{uuid}"], "more than one GPU"),
        (["nvidia-smi", "--gpu-reset", "-i", "{uuid},{pci_bus_id}"], "more than one GPU"),
        (["nvidia-smi", "--gpu-reset", "-i", f"{{uuid}},{UUID}"], "more than one GPU"),
        (["nvidia-smi", "--gpu-reset", "-i", "{uuid},1"], "more than one GPU"),
        (["nvidia-smi", "-i", "{uuid}", "-i", "{pci_bus_id}"], "names 2 GPUs"),
        (["nvidia-smi", "--gpu-reset", "{uuid}"], "through '-i'"),
        ("nvidia-smi --gpu-reset -i {uuid}", "expected an argv list"),
        ([], "empty"),
        (["sh", "-c", "nvidia-smi --gpu-reset -i {uuid}"], "is a shell"),
        (["nvidia-smi", "--gpu-reset", "-i", "{uid}"], "did you mean 'uuid'"),
        (["nvidia-smi", "--gpu-reset", "-i", "{uuid"], "bad braces"),
    ],
)
def test_reset_command_not_naming_exactly_one_gpu_is_refused(argv: object, hint: str) -> None:
    err = error_of(f"reset:\n  command: {yaml.safe_dump(argv, default_flow_style=True)}")
    assert hint in str(err)
    assert err.key == "reset.command"


def test_policy_reset_command_refuses_a_literal_gpu() -> None:
    err = error_of(f"reset:\n  command: [nvidia-smi, --gpu-reset, -i, {UUID}]\n")
    assert err.key == "reset.command"
    assert err.line == 2
    assert "names no GPU" in err.message


@pytest.mark.parametrize(
    ("key", "argv"),
    [
        ("command", "[nvidia-smi, --gpu-reset, -i, '{minor}']"),
        ("persistence_command", "[nvidia-smi, -pm, '{mode}']"),
        ("health_command", "[nvidia-smi, -q]"),
    ],
)
def test_every_nvidia_smi_command_of_the_reset_names_one_gpu(key: str, argv: str) -> None:
    err = error_of(f"reset:\n  {key}: {argv}\n")
    assert err.key == f"reset.{key}"


def test_mig_recovery_is_off_by_default_and_its_commands_are_read_in_order() -> None:
    assert parse("").reset.mig_recovery is False
    policy = parse(
        "reset:\n  mig_recovery: true\n  mig_recovery_commands:\n"
        "    - [nvidia-smi, mig, -i, '{uuid}', -gi, '{gi}', -dgi]\n"
        "    - [nvidia-smi, mig, -i, '{pci_bus_id}', -cgi, '{profile}:{placement}', -C]\n"
    )
    assert policy.reset.mig_recovery is True
    assert policy.reset.mig_recovery_commands == (
        ("nvidia-smi", "mig", "-i", "{uuid}", "-gi", "{gi}", "-dgi"),
        ("nvidia-smi", "mig", "-i", "{pci_bus_id}", "-cgi", "{profile}:{placement}", "-C"),
    )


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("[]", "expected at least one command"),
        ("[[nvidia-smi, mig, -gi, '{gi}', -dgi]]", "must name exactly one GPU"),
        ("[[nvidia-smi, mig, -i, '{uuid}', -gi, '{g}', -dgi]]", "did you mean 'gi'"),
        ("[[nvidia-smi, mig, -i, '{uuid}', -gi, '{minor}', -dgi]]", "minor"),
        ("[[nvidia-smi, mig, -i, '0', -dgi]]", "index"),
        ("{a: 1}", "expected a list"),
    ],
)
def test_a_bad_mig_recovery_command_list_is_refused_naming_the_key_and_line(
    value: str, said: str
) -> None:
    err = error_of(f"reset:\n  mig_recovery: true\n  mig_recovery_commands: {value}\n")
    assert err.key is not None
    assert err.key.startswith("reset.mig_recovery_commands")
    assert err.line == 3
    assert said in err.message


def _reset_policy(*, hooks: int = 1, mig_commands: int = 1, args: int = 4) -> str:
    """A reset section with ``hooks`` hooks in each list, ``mig_commands`` recovery commands
    and commands of ``args`` arguments (``--`` pads the reset command and the hooks)."""
    pad, mig_pad = ", --" * (args - 4), ", --" * (args - 7)
    hook = f"    - [echo, hook, x, y{pad}]\n"
    mig = f"    - [nvidia-smi, mig, -i, '{{uuid}}', -gi, '{{gi}}', -dgi{mig_pad}]\n"
    return (
        f"reset:\n  command: [nvidia-smi, --gpu-reset, -i, '{{uuid}}'{pad}]\n"
        + "".join(f"  {step}:\n" + hook * hooks for step in ("drain", "before", "after"))
        + "  mig_recovery: true\n  mig_recovery_commands:\n"
        + mig * mig_commands
    )


@pytest.mark.parametrize(
    ("changed", "key", "line"),
    [
        ({"hooks": MAX_RECORDED_COMMANDS + 1}, "reset.drain", 4),
        ({"mig_commands": MAX_RECORDED_COMMANDS + 1}, "reset.mig_recovery_commands", 11),
        ({"args": MAX_RECORDED_ARGS + 1}, "reset.command", 2),
    ],
)
def test_reset_commands_beyond_what_a_reset_records_are_refused(
    changed: dict[str, int], key: str, line: int
) -> None:
    """check-config used to pass them, and then the daemon refused every reset: a reset's
    commands are recorded before its first step, within these bounds (act/reset_target.py)."""
    err = error_of(_reset_policy(**changed))
    assert err.key == key
    assert err.line == line
    bound = MAX_RECORDED_ARGS if "args" in changed else MAX_RECORDED_COMMANDS
    assert f"at most {bound} " in err.message
    if "args" in changed:  # every command of the reset is bounded, each named
        keys = {p.key for p in err.problems}
        assert {"reset.drain[0]", "reset.after[0]", "reset.mig_recovery_commands[0]"} <= keys


def test_reset_commands_at_the_bounds_are_accepted_and_recorded() -> None:
    """What check-config accepts, a reset records: no policy it passes is refused at the first
    step for its size."""
    for shape in ({"hooks": MAX_RECORDED_COMMANDS}, {"args": MAX_RECORDED_ARGS}):
        reset = parse(_reset_policy(**shape)).reset
        target = ResetTarget(UUID, "00000000:1A:00.0", 0, persistence_was_on=True)
        assert isinstance(prepare_commands(target, reset), Commands)


@pytest.mark.parametrize("copies", [32, 33, 409])
def test_an_argument_check_config_accepts_is_never_refused_for_its_filled_length(
    copies: int,
) -> None:
    """Each ``{hostname}`` fills to up to 253 characters: 409 of them (4,090 characters, under
    the unfilled bound) used to pass check-config and grow past what a reset records, so every
    reset was refused. Now 32 (8,096 filled) pass and are recorded; 33 (8,349) are refused."""
    host = ".".join(["h" * 63] * 3 + ["h" * 61])
    text = f"reset:\n  before:\n    - [echo, '{'{hostname}' * copies}']\n"
    if len(host) * copies > MAX_RECORDED_CHARS:
        err = error_of(text)
        assert (err.key, err.line) == ("reset.before[0]", 3)
        assert f"can grow to {len(host) * copies} characters" in err.message
        return
    target = ResetTarget(UUID, "00000000:1A:00.0", 0, persistence_was_on=True, hostname=host)
    commands = prepare_commands(target, parse(text).reset)
    assert isinstance(commands, Commands)
    assert len(commands.before[0].argv[1]) == len(host) * copies


# --- drop-ins and merging -----------------------------------------------------------------------

MAIN = """\
interval: 5s
dry_run: true
protect:
  users: [root, slurm]
  commands: ['^sshd']
rules:
  - name: orphans
    kind: orphaned
    for: 30s
    steps:
      - {signal: SIGTERM, wait: 30s}
      - {signal: SIGKILL, wait: 10s}
  - name: zombies
    kind: zombie
    steps: [{signal: null}]
reset:
  enabled: true
  confirm_for: 10m
  before: [[echo, before]]
"""


def write_config(root: Path, main: str, drop_ins: dict[str, str]) -> Path:
    config_dir = root / "etc"
    (config_dir / "conf.d").mkdir(parents=True)
    main_file = config_dir / "gpuwatchd.yaml"
    main_file.write_text(main)
    for name, text in drop_ins.items():
        (config_dir / "conf.d" / name).write_text(textwrap.dedent(text))
    return main_file


def test_drop_ins_are_read_in_name_order_and_recorded_as_sources(tmp_path: Path) -> None:
    main_file = write_config(
        tmp_path,
        MAIN,
        {
            "20-late.yaml": "interval: 20s\n",
            "10-early.yaml": "interval: 10s\nnvml_timeout: 3s\n",
            ".hidden.yaml": "interval: 99s\n",
            "30-old.yaml.dpkg-old": "interval: 99s\n",
            "40-ignored.yml": "interval: 99s\n",
        },
    )
    policy = load_policy(str(main_file), check_permissions=False)
    assert (policy.interval, policy.nvml_timeout) == (20.0, 3.0)
    conf_d = main_file.parent / "conf.d"
    assert policy.sources == (
        str(main_file),
        str(conf_d / "10-early.yaml"),
        str(conf_d / "20-late.yaml"),
    )


def test_a_drop_in_name_with_a_newline_leaves_the_rendered_policy_readable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The names are comments of check-config's output and of the saved accepted policy: one
    # line each, or the rest of the name is read as YAML (the fallback then never loads).
    name = "10-a\nstate_dir: x\x1b[2J.yaml"
    main_file = write_config(tmp_path, MAIN, {name: "interval: 7s\n"})
    policy = load_policy(str(main_file), check_permissions=False)
    assert policy.sources[1].endswith(name)
    for rendered in (render_policy(policy), render_accepted(policy)):
        assert "\x1b" not in rendered
        assert "#   " + str(main_file.parent / "conf.d" / "10-a\\nstate_dir") in rendered
        assert without_sources(parse(rendered)) == without_sources(policy)
    assert cli_main(["check-config", str(main_file)]) == 0
    out, err = capsys.readouterr()
    assert without_sources(parse(out)) == without_sources(policy)
    assert err.startswith("# OK: ")
    assert err.count("\n") == 1
    # A problem in it is named by the escaped name, on one line.
    (main_file.parent / "conf.d" / name).write_text("interval: soon\n")
    assert cli_main(["check-config", str(main_file)]) == 78
    err = capsys.readouterr().err
    assert "10-a\\nstate_dir: x\\x1b[2J.yaml:1: interval: " in err, err
    assert "\x1b" not in err


def test_merge_semantics_rules_by_name_lists_replace_mappings_merge(tmp_path: Path) -> None:
    main_file = write_config(
        tmp_path,
        MAIN,
        {
            "10-site.yaml": """\
                protect:
                  users: [alice]
                rules:
                  - name: orphans
                    kind: orphaned
                    for: 2m
                    steps: [{signal: SIGKILL, wait: 5s}]
                  - name: stuck
                    kind: stuck
                    steps: [{signal: null}]
                reset:
                  confirm_for: 30m
                """,
            "20-no-zombies.yaml": """\
                rules:
                  - {name: zombies, enabled: false}
                reset:
                """,
        },
    )
    policy = load_policy(str(main_file), check_permissions=False)
    assert policy.protect.users == ("alice",)  # lists replace
    assert policy.protect.commands == (re.compile("^sshd"),)  # untouched keys stay
    assert [rule.name for rule in policy.rules] == ["orphans", "stuck"]
    orphans = policy.rules[0]
    assert orphans.for_ == 120.0  # merged in place, field by field
    assert orphans.steps == (Step("SIGKILL", 5.0),)
    assert policy.reset.confirm_for == 1800.0  # mappings merge key by key
    assert policy.reset.enabled is True
    assert policy.reset.before == (Hook(("echo", "before")),)


def test_a_drop_in_changes_one_field_of_a_named_rule_and_keeps_the_rest(tmp_path: Path) -> None:
    """{name: orphans, for: 10s} used to fail with "missing kind/steps": the rule was replaced
    as a whole. It is merged field by field now; a list field is still replaced whole."""
    main = (
        "rules:\n"
        "  - {name: r, kind: orphaned, for: 1m, users: [bob],"
        " steps: [{signal: SIGTERM, wait: 30s}, {signal: SIGKILL, wait: 10s}]}\n"
    )
    drop_in = {"10.yaml": "rules:\n  - {name: r, for: 10s}\n"}
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    policy = load_policy(str(write_config(first, main, drop_in)), check_permissions=False)
    (rule,) = policy.rules
    assert rule.for_ == 10.0
    assert (rule.kind.value, rule.users) == ("orphaned", ("bob",))
    assert [s.signal for s in rule.steps] == ["SIGTERM", "SIGKILL"]
    lists = {"10.yaml": "rules:\n  - {name: r, users: [carol], steps: [{signal: null}]}\n"}
    policy = load_policy(str(write_config(second, main, lists)), check_permissions=False)
    (rule,) = policy.rules
    assert rule.users == ("carol",)
    assert [s.signal for s in rule.steps] == [None]


def test_errors_in_a_drop_in_name_the_drop_in(tmp_path: Path) -> None:
    main_file = write_config(tmp_path, MAIN, {"10-site.yaml": "\n\nreset:\n  timout: 5s\n"})
    with pytest.raises(ConfigError) as caught:
        load_policy(str(main_file), check_permissions=False)
    err = caught.value
    assert err.path == str(main_file.parent / "conf.d" / "10-site.yaml")
    assert (err.line, err.key) == (4, "reset.timout")
    assert "did you mean 'timeout'" in str(err)


def test_a_drop_in_may_disable_the_last_rule() -> None:
    policy = parse_policy_documents(
        [("main.yaml", MAIN), ("10.yaml", "rules: [{name: orphans, enabled: false}]\n")]
    )
    assert [rule.name for rule in policy.rules] == ["zombies"]


def test_an_empty_rules_key_in_a_drop_in_is_refused_not_read_as_no_rules(tmp_path: Path) -> None:
    """``rules:`` alone in a drop-in (its entries all commented out) used to replace every rule
    with none, while ``rules: []`` changes nothing: rules merge by name, so it is refused,
    located, saying how to remove a rule. In the main file it still means no rules."""
    main_file = write_config(tmp_path, MAIN, {"10-site.yaml": "interval: 5s\nrules:\n#  - x\n"})
    with pytest.raises(ConfigError) as caught:
        load_policy(str(main_file), check_permissions=False)
    err = caught.value
    drop_in = str(main_file.parent / "conf.d" / "10-site.yaml")
    assert (err.path, err.line, err.key) == (drop_in, 2, "rules")
    assert "merge by name" in err.message
    assert "{name: NAME, enabled: false}" in err.message
    kept = parse_policy_documents([("main.yaml", MAIN), ("10.yaml", "rules: []\n")])
    assert [rule.name for rule in kept.rules] == ["orphans", "zombies"]
    assert parse_policy_documents([("main.yaml", "rules:\n")]).rules == ()


def test_missing_main_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as caught:
        load_policy(str(missing), check_permissions=False)
    assert caught.value.path == str(missing)


@pytest.mark.parametrize("how", ["fifo", "bytes-not-utf8", "name-not-utf8"])
def test_the_leading_files_that_read_stop_at_an_unreadable_one_in_the_middle(
    tmp_path: Path, how: str
) -> None:
    """One reader for both callers: the files before an unreadable drop-in are read, in order,
    and its ConfigError names it; the drop-in after it is not read."""
    main_file = write_config(tmp_path, MAIN, {"10-a.yaml": "interval: 5s\n"})
    conf_d = main_file.parent / "conf.d"
    bad = str(conf_d / "20-b.yaml")
    if how == "fifo":
        os.mkfifo(bad)
    elif how == "bytes-not-utf8":
        Path(bad).write_bytes(b"# r\xe4te\n")
    else:
        bad = os.fsdecode(os.path.join(os.fsencode(conf_d), b"20-r\xe4te.yaml"))
        Path(bad).write_text("interval: 6s\n")
    (conf_d / "30-c.yaml").write_text("interval: 7s\n")
    paths = [str(main_file), str(conf_d / "10-a.yaml"), bad, str(conf_d / "30-c.yaml")]
    texts, problem = read_leading_files(paths)
    assert texts == [(str(main_file), MAIN), (paths[1], "interval: 5s\n")]
    assert problem is not None
    assert "20-" in str(problem.path)
    assert read_leading_files(paths[:2]) == (texts, None)
    if how == "bytes-not-utf8":  # the other two are refused when the drop-ins are listed
        with pytest.raises(ConfigError) as caught:
            read_policy_files(str(main_file), check_permissions=False)
        assert (caught.value.path, caught.value.message) == (problem.path, problem.message)


# --- the shipped config and rendering -----------------------------------------------------------


def test_shipped_config_parses_and_equals_default_policy() -> None:
    policy = load_policy(str(SHIPPED), check_permissions=False)
    assert without_sources(policy) == default_policy()
    assert policy.dry_run is True
    assert policy.reset.enabled is True
    assert policy.reset.confirm_for == 600.0
    assert (policy.reset.max_resets, policy.reset.window) == (1, 86400.0)
    assert (policy.limits.max_signalled_per_poll, policy.limits.max_signalled_per_hour) == (16, 64)
    assert [(rule.kind, rule.steps) for rule in policy.rules] == [
        (FindingKind.ORPHANED, (Step("SIGTERM", 30.0), Step("SIGKILL", 10.0))),
        (FindingKind.STUCK, (Step(None, 0.0),)),
    ]


def _key_paths(node: object, prefix: str = "") -> set[str]:
    """Every key of a YAML document as its path (``health.kernel_log``; list items ``[]``)."""
    if isinstance(node, dict):
        return {f"{prefix}{key}" for key in node} | {
            path for key, value in node.items() for path in _key_paths(value, f"{prefix}{key}.")
        }
    if isinstance(node, list):
        return {path for item in node for path in _key_paths(item, f"{prefix[:-1]}[].")}
    return set()


def test_shipped_config_spells_out_every_key_render_policy_prints() -> None:
    """Every key of the rendered effective policy appears in the shipped file too, at its
    place: also those rendered in a flow mapping (``health: {..., kernel_log: journal}``)."""
    rendered = _key_paths(yaml.safe_load(render_policy(default_policy())))
    assert rendered - _key_paths(yaml.safe_load(SHIPPED.read_text())) == set()


def test_render_policy_round_trips_the_default_policy() -> None:
    policy = default_policy()
    assert without_sources(parse(render_policy(policy))) == policy


def test_render_policy_round_trips_a_rich_merged_policy() -> None:
    policy = parse_policy_documents(
        [
            ("main.yaml", MAIN),
            (
                "10.yaml",
                """\
interval: 1500ms
log: {format: json}
protect: {gpus: ['0000:3b:00.0'], cgroups: ['/system.slice/*'], units: [x.service]}
rules:
  - {name: big, kind: abandoned, min_memory: 100MB, jobs: ['pod:*'],
     steps: [{signal: SIGHUP, wait: 0.25}]}
reset:
  command: [/usr/sbin/site-reset, '{pci_bus_id}']
  drain: [{command: [drain, '{minor}'], timeout: 45s}]
  window: 36h
  monitors: [{unit: gpustat-exporter.service}, {command: '^nvidia-smi -l '}]
limits: {post_action_delay: 0s}
detection: {ghost_margin: 300000000}
on_failure: [[echo, failed]]
""",
            ),
        ]
    )
    rendered = render_policy(policy)
    assert "#   10.yaml" in rendered
    assert without_sources(parse(rendered)) == without_sources(policy)
    assert [(m.unit, m.command and m.command.pattern) for m in policy.reset.monitors] == [
        ("gpustat-exporter.service", None),
        (None, "^nvidia-smi -l "),
    ]


# --- StrictModes --------------------------------------------------------------------------------


def safe_tree(tmp_path: Path) -> Path:
    """A root-owned, 0755 config tree with a 0644 main file and one drop-in."""
    tmp_path.chmod(0o755)
    main_file = write_config(tmp_path, MAIN, {"10-site.yaml": "interval: 7s\n"})
    for path in (tmp_path / "etc", tmp_path / "etc" / "conf.d"):
        path.chmod(0o755)
    for path in (main_file, tmp_path / "etc" / "conf.d" / "10-site.yaml"):
        path.chmod(0o644)
    return main_file


@needs_root
@pytest.mark.parametrize("trusted_root", ["tmp", "/"])
def test_root_owned_0644_file_in_0755_dirs_is_accepted(tmp_path: Path, trusted_root: str) -> None:
    main_file = safe_tree(tmp_path)
    root = str(tmp_path) if trusted_root == "tmp" else "/"
    policy = load_policy(str(main_file), check_permissions=True, trusted_root=root)
    assert policy.interval == 7.0


@needs_root
@pytest.mark.parametrize(
    ("relative", "mode"),
    [
        ("etc/conf.d", 0o777),
        ("etc/conf.d", 0o1777),  # sticky does not help the config's own folders
        ("etc/conf.d/10-site.yaml", 0o666),
        ("etc/gpuwatchd.yaml", 0o664),
        ("etc", 0o775),
    ],
)
def test_group_or_world_writable_config_paths_are_refused(
    tmp_path: Path, relative: str, mode: int
) -> None:
    main_file = safe_tree(tmp_path)
    (tmp_path / relative).chmod(mode)
    with pytest.raises(ConfigError) as caught:
        load_policy(str(main_file), trusted_root=str(tmp_path))  # root: checked by default
    assert caught.value.path == str(tmp_path / relative)
    assert f"chmod go-w {tmp_path / relative}" in str(caught.value)


@needs_root
def test_config_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    main_file = safe_tree(tmp_path)
    os.chown(main_file, 65534, -1)
    with pytest.raises(ConfigError, match="owned by uid 65534") as caught:
        load_policy(str(main_file), trusted_root=str(tmp_path))
    assert "chown root" in str(caught.value)


@needs_root
def test_writable_ancestor_is_refused_unless_sticky_and_root_owned(tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    parent.mkdir()
    main_file = safe_tree(parent)
    parent.chmod(0o777)
    with pytest.raises(ConfigError, match=re.escape(f"chmod go-w {parent}")):
        check_config_permissions(str(main_file), trusted_root=str(tmp_path))
    parent.chmod(0o1777)  # like /tmp: nobody else can replace root's entries
    check_config_permissions(str(main_file), trusted_root=str(tmp_path))
    os.chown(parent, 65534, -1)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        check_config_permissions(str(main_file), trusted_root=str(tmp_path))


@needs_root
def test_walk_stops_at_trusted_root(tmp_path: Path) -> None:
    (tmp_path / "inner").mkdir()
    main_file = safe_tree(tmp_path / "inner")
    tmp_path.chmod(0o777)  # above the trusted root: not looked at
    check_config_permissions(str(main_file), trusted_root=str(tmp_path / "inner"))
    with pytest.raises(ConfigError):
        check_config_permissions(str(main_file), trusted_root=str(tmp_path))


@needs_root
def test_a_mount_table_cut_at_its_read_limit_never_makes_a_writable_folder_safe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuwatchd.config import files

    main_file = safe_tree(tmp_path)
    folder = os.path.realpath(main_file.parent)
    main_file.parent.chmod(0o777)
    read_only = os.statvfs_result((0,) * 8 + (os.ST_RDONLY, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: read_only)
    mountinfo = tmp_path / "mountinfo"
    monkeypatch.setattr(files, "MOUNTINFO", str(mountinfo))
    seen_alone = f"1 0 0:41 / {folder} ro - tmpfs tmpfs ro\n"
    mountinfo.write_text(seen_alone)  # a ConfigMap volume: accepted
    check_config_permissions(str(main_file), trusted_root=str(tmp_path))
    # The same volume also mounted writable, past the 4 MiB the check reads: refused.
    filler = "2 0 0:42 / /other ro - tmpfs tmpfs ro\n" * (4 * MIB // 38 + 1)
    mountinfo.write_text(seen_alone + filler + "3 0 0:41 / /rw rw - tmpfs tmpfs rw\n")
    with pytest.raises(ConfigError, match="writable by group or others"):
        check_config_permissions(str(main_file), trusted_root=str(tmp_path))


def test_permission_check_is_skipped_when_turned_off(tmp_path: Path) -> None:
    main_file = write_config(tmp_path, MAIN, {})
    (main_file.parent / "conf.d").chmod(0o777)
    assert load_policy(str(main_file), check_permissions=False).interval == 5.0


# --- the key table and the modules behind schema ----------------------------------------------


def test_the_key_table_refuses_a_dataclass_field_it_does_not_list() -> None:
    from gpuwatchd.config.keys import count, section_of
    from gpuwatchd.decide.policy import Limits

    with pytest.raises(TypeError, match="post_action_delay"):
        section_of("limits", Limits, {"max_signalled_per_poll": count(0, 1)})
    with pytest.raises(TypeError, match="max_kills"):
        section_of(
            "limits",
            Limits,
            {
                "max_signalled_per_poll": count(0, 1),
                "max_signalled_per_hour": count(0, 1),
                "post_action_delay": count(0, 1),
                "max_kills": count(0, 1),
            },
        )


def test_every_policy_field_has_exactly_one_key() -> None:
    from gpuwatchd.config.keys import SECTIONS

    listed = [(section.cls, key.field) for section in SECTIONS.values() for key in section.keys]
    fields = [(cls, field) for cls, field in listed if field is not None]
    assert len(fields) == len(set(fields))
    for cls in {cls for cls, _ in fields}:
        names = {f.name for f in dataclasses.fields(cls)} - {"sources"}
        assert {field for owner, field in fields if owner is cls} == names


def test_names_moved_out_of_schema_stay_importable_from_it() -> None:
    from gpuwatchd.config import files, keys, schema, units, yamlsrc

    assert schema.parse_duration is units.parse_duration
    assert schema.parse_size is units.parse_size
    assert schema.format_duration is units.format_duration
    assert schema.format_size is units.format_size
    assert schema.find_drop_ins is files.find_drop_ins
    assert schema.check_config_permissions is files.check_config_permissions
    assert schema.normalize_gpu_id is keys.normalize_gpu_id
    assert schema.ConfigError is yamlsrc.ConfigError


# --- the documentation --------------------------------------------------------------------------


def test_every_yaml_example_in_the_policy_doc_is_a_valid_policy() -> None:
    doc = (REPO / "docs" / "policy.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    assert len(blocks) >= 4
    for block in blocks:
        parse_policy_documents([("docs/policy.md", block)])


def test_policy_doc_names_every_key_of_the_schema() -> None:
    doc = (REPO / "docs" / "policy.md").read_text()
    keys = set(re.findall(r"^\s*-?\s*([a-z_]+):", render_policy(default_policy()), re.M))
    keys |= {"enabled", "min_memory", "signal", "wait", "command", "timeout"}
    assert {key for key in keys if f"`{key}`" not in doc} == set()
