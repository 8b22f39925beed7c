"""Commands the daemon runs as root (decide/argv.py): no shell or inline code hidden behind an
interpreter's or launcher's options, one GPU by a stable name, values filled in only in their
documented format. Tables of argvs, each refused or accepted for a stated reason.
"""

from __future__ import annotations

import pytest

from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.argv import (
    ARGV_PLACEHOLDERS,
    GPU_PLACEHOLDERS,
    HOOK_PLACEHOLDERS,
    MAX_FILLED_CHARS,
    ArgvError,
    check_command,
    check_hook_command,
    check_one_gpu,
    check_value,
    filled_length,
    format_argv,
    hook_environment,
)

CODE = "import os; os.system('nvidia-smi -r')"
UUID = "GPU-8f0a1e2b-0000-1111-2222-333344445555"
DRAIN = "/usr/local/sbin/drain"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        # interpreter options before the inline code, with their values
        (["python3", "-W", "ignore", "-c", CODE], "-c"),
        (["python3", "-Wignore", "-c", CODE], "-c"),
        (["python3", "-sW", "error", "-c", CODE], "-c"),
        (["python3", "-X", "dev", "-I", "-c", CODE], "-c"),
        (["python3", "-I", "-E", "-bb", "-c", CODE], "-c"),
        (["python3", "-OO", "-c", CODE], "-c"),
        (["python3", "--check-hash-based-pycs", "always", "-c", CODE], "-c"),
        (["perl", "-I", "/opt/lib", "-e", CODE], "-e"),
        (["ruby", "-r", "json", "-e", CODE], "-e"),
        (["node", "-r", "tracing", "--eval", CODE], "--eval"),
        (["node", "--require", "tracing", "-e", CODE], "-e"),
        # launchers whose own options run a shell
        (["sudo", "-u", "root", "-s"], "-s"),
        (["sudo", "-uroot", "-i"], "-i"),
        (["sudo", "--user", "root", "-i"], "-i"),
        (["env", "--s", "nvidia-smi -r -i {uuid}"], "--s"),
        (["env", "--split", "nvidia-smi -r -i {uuid}"], "--split"),
        (["systemd-run", "--wait", "--pipe", "--shell"], "--shell"),
        (["systemd-run", "--wait", "--shell"], "--shell"),
        (["flock", "-w", "5", "/run/lock/gpu", "-c", "nvidia-smi -r"], "-c"),
        (["flock", "--", "/run/lock/gpu", "-c", "nvidia-smi -r"], "-c"),
        # A long option may take the next argument as its value: that argument is never taken
        # for the program, so a program's own look-alike option needs "--" before the program.
        (["systemd-run", "--collect", DRAIN, "-S", "x"], "-S"),
    ],
)
def test_inline_code_behind_options_is_refused(argv: list[str], flag: str) -> None:
    with pytest.raises(ArgvError) as caught:
        check_command(argv, GPU_PLACEHOLDERS)
    message = str(caught.value)
    assert f"{flag}' runs a shell string or inline code" in message, message


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["python3", "-m", "site_drain", "-c", "/etc/drain.conf"], "-c belongs to the module"),
        (["python3", "-Im", "site_drain", "-c", "x"], "-m ends python's options"),
        (["python3", f"{DRAIN}.py", "-c", "/etc/drain.conf"], "-c belongs to the script"),
        (["python3", "-Werror::DeprecationWarning", f"{DRAIN}.py"], "a -W value, not options"),
        (["python3", "-W", "error", f"{DRAIN}.py", "-c", "x"], "-W takes the next argument"),
        (["python3", "-V"], "options up to the last argument"),
        (["python3", "--version"], "a long option as the last argument"),
        (["python3", "-mcProfile", f"{DRAIN}.py"], "-m's value is the module cProfile"),
        (["flock", "/var/lock/gpu", DRAIN], "the lock file is an operand, not options"),
        (["flock", "/run/lock/gpu", DRAIN, "-c", "conf"], "-c belongs to the program"),
        (["flock", "-w", "5", "/run/lock/gpu", DRAIN], "-w takes a value"),
        (["flock", "--", "/run/lock/gpu", DRAIN, "-c", "conf"], "after the lock file"),
        (["sudo", "-u", "gpuadmin", DRAIN, "-s", "fast"], "-s belongs to the program"),
        (["systemd-run", "--wait", "--collect", "--", DRAIN, "-S", "x"], "-- ends the options"),
        (["systemd-run", "--property=Nice=5", DRAIN], "a long option with its value"),
        (["env", "LC_ALL=C", DRAIN, "--split", "x"], "--split belongs to the program"),
    ],
)
def test_a_program_behind_options_is_accepted_with_its_own_options(
    argv: list[str], why: str
) -> None:
    check_command(argv, GPU_PLACEHOLDERS)  # no ArgvError: {why}
    assert why


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sh", "-c", "x"], "'sh' is a shell"),
        (["timeout", "5", "/bin/bash", "x"], "argument 2 ('/bin/bash') is a shell"),
    ],
)
def test_a_refused_shell_is_named_where_it_stands(argv: list[str], message: str) -> None:
    with pytest.raises(ArgvError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        check_command(argv, GPU_PLACEHOLDERS)


# --- one GPU, by a stable name ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["nvidia-smi", "-r", "-i", "{uuid}", "-iX"],
            "selects a GPU 2 times ('-i {uuid}', '-iX'); once only",
        ),
        (
            ["nvidia-smi", "-r", "-i", UUID, "{uuid}"],
            "'-i GPU-8f0a1e2b-0000-1111-2222-333344445555' must select the GPU by {uuid} or "
            "{pci_bus_id} alone",
        ),
        (["nvidia-smi", "-r", "-i", "0,abc"], "'-i 0,abc' selects a GPU by index"),
        # nvidia-smi's other spellings of the option, each named as written
        (["nvidia-smi", "-r", "--id=0"], "'--id=0' selects a GPU by index"),
        (["nvidia-smi", "-r", "-i=1"], "'-i=1' selects a GPU by index"),
        (["nvidia-smi", "-r", "-i2"], "'-i2' selects a GPU by index"),
        (["nvidia-smi", "-r", "-i"], "'-i' has no value: it must name the GPU"),
    ],
)
def test_a_reset_command_names_one_gpu_once(argv: list[str], message: str) -> None:
    with pytest.raises(ArgvError) as caught:
        check_one_gpu(argv)
    assert message in str(caught.value)


def test_a_literal_gpu_is_refused_where_the_gpu_must_be_named() -> None:
    with pytest.raises(ArgvError, match="must name exactly one GPU"):
        check_one_gpu(["nvidia-smi", "-r", "-i", UUID])
    # A hook that runs nvidia-smi is held to placeholders: a literal GPU there is refused.
    with pytest.raises(ArgvError, match=r"^a hook that runs nvidia-smi must name exactly one"):
        check_hook_command(["nvidia-smi", "-q", "-i", UUID], HOOK_PLACEHOLDERS)
    check_hook_command(["nvidia-smi", "-q", "-i", "{uuid}", "-f", "{hostname}"], HOOK_PLACEHOLDERS)


# --- placeholders and the values filled into them -----------------------------------------------


def test_an_unknown_placeholder_after_an_escaped_brace_is_refused() -> None:
    with pytest.raises(ArgvError, match=r"unknown placeholder \{nope\}"):
        check_command(["tool", "{{literal}}-{nope}"], GPU_PLACEHOLDERS)
    with pytest.raises(ArgvError, match=r"unknown placeholder \{hostname\}"):  # a hook's only
        check_command(["tool", "{hostname}"], GPU_PLACEHOLDERS)


@pytest.mark.parametrize(
    ("template", "values", "error"),
    [
        (["-i", "{uuid}"], {}, "no value for {uuid}"),
        (["-i", "{uuid}"], {"uuid": None}, "no value for {uuid}"),
        (["-i", "{uuid!r}"], {"uuid": UUID}, "unknown placeholder {uuid}"),
        (["-i", "{uuid}"], {"uuid": UUID, "colour": "red"}, "unknown placeholder value 'colour'"),
    ],
)
def test_format_argv_refuses_what_it_cannot_fill_exactly(
    template: list[str], values: dict[str, str | None], error: str
) -> None:
    with pytest.raises(ValueError, match=error.replace("{", r"\{").replace("}", r"\}")):
        format_argv(template, **values)


def test_format_argv_fills_every_placeholder_and_keeps_escaped_braces() -> None:
    assert format_argv(["tag={{{uuid}}}", "-i", "{minor}"], uuid=UUID, minor="3") == (
        "tag={" + UUID + "}",
        "-i",
        "3",
    )


_BODY = UUID[len("GPU-") :]
_HOST = ".".join(["h" * 63] * 3 + ["h" * 61])
# Each placeholder's longest value, and the same one character longer (refused).
_LONGEST = {
    "uuid": (f"MIG-GPU-{_BODY}/999/999", f"MIG-GPU-{_BODY}/999/9999"),
    "mig_uuid": (f"MIG-GPU-{_BODY}/999/999", f"MIG-GPU-{_BODY}/9999/999"),
    "pci_bus_id": ("00000000:3B:00.0", "000000000:3B:00.0"),
    "minor": ("255", "2555"),
    "mode": ("1", "11"),
    **dict.fromkeys(("gi", "ci", "profile", "placement"), ("99", "999")),
    "hostname": (_HOST, _HOST + "h"),
    "user": ("u" * 32 + "$", "u" * 33 + "$"),
}


@pytest.mark.parametrize("name", ARGV_PLACEHOLDERS)
def test_each_placeholder_fills_to_at_most_its_known_longest_value(name: str) -> None:
    """check-config bounds an argument's filled length with these (``filled_length``)."""
    longest, longer = _LONGEST[name]
    assert check_value(name, longest) == longest
    assert filled_length(f"{{{name}}}") == len(longest)
    with pytest.raises(ValueError, match="refusing to run"):
        check_value(name, longer)


def test_an_argument_that_fills_past_what_a_reset_records_is_refused() -> None:
    """A reset records arguments of at most MAX_FILLED_CHARS characters (act/reset_target.py):
    an argument whose placeholders can fill it past that is refused when the policy is read,
    not at every reset. ``{{`` counts as the one brace it becomes."""
    assert filled_length("tag={{{uuid}}}") == len("tag={") + 52 + len("}")
    room = "x" * (MAX_FILLED_CHARS - len(_HOST))
    check_command(["echo", room + "{hostname}"], HOOK_PLACEHOLDERS)
    check_command(["echo", "{{}}" + room[2:] + "{hostname}"], HOOK_PLACEHOLDERS)
    with pytest.raises(ArgvError) as caught:
        check_command(["echo", room + "x{hostname}"], HOOK_PLACEHOLDERS)
    assert f"can grow to {MAX_FILLED_CHARS + 1} characters" in str(caught.value)
    assert f"at most {MAX_FILLED_CHARS} (what a reset records)" in str(caught.value)


def test_hook_environment_names_only_known_values() -> None:
    assert hook_environment(EventName.RESET_FAILED, gpu=UUID, user=None, minor=0) == {
        "GPUWATCHD_EVENT": EventName.RESET_FAILED,
        "GPUWATCHD_GPU": UUID,
        "GPUWATCHD_MINOR": "0",
    }
