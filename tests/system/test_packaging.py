"""The Debian package ships what the docs point at, and the shell completions know every command.

The completions are generated from the real parser (packaging/completions.py, shtab); the .deb
is built with packaging/build-deb.sh (skipped, with the reason, where dpkg-buildpackage, dh or
python3-shtab is missing: tests/systemd/host-setup.sh installs them) and listed with dpkg -c.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpuwatchd.cli.main import build_parser
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.events.catalogue import message_id
from tests.support.debbuild import built_deb

REPO = Path(__file__).resolve().parents[2]
DOC = "usr/share/doc/gpuwatchd"
pytestmark = [pytest.mark.slow]


def subcommands() -> list[str]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(action.choices)


def test_the_parser_has_the_commands_the_docs_name() -> None:
    assert {"scan", "run", "check-clean", "check-config", "status"} <= set(subcommands())


@pytest.fixture(scope="module")
def completions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    pytest.importorskip("shtab", reason="pip install shtab (the [test] extra)")
    out = tmp_path_factory.mktemp("completions")
    subprocess.run(
        [sys.executable, str(REPO / "packaging" / "completions.py"), out / "bash", out / "zsh"],
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return {shell: (out / shell).read_text() for shell in ("bash", "zsh")}


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_the_completion_knows_every_subcommand(completions: dict[str, str], shell: str) -> None:
    text = completions[shell]
    for command in subcommands():
        assert re.search(rf"(?<![\w-]){re.escape(command)}(?![\w-])", text), (shell, command)
    for flag in ("--config", "--json", "--once", "--timeout", "--gpu", "--clear-latches"):
        assert flag in text, (shell, flag)


def test_the_bash_completion_parses(completions: dict[str, str], tmp_path: Path) -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    script = tmp_path / "gpuwatchd"
    script.write_text(completions["bash"])
    proc = subprocess.run([bash, "-n", str(script)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def _bash_completion(python: str, out: Path) -> Path:
    """The bash completion packaging/completions.py writes with ``python``'s shtab."""
    subprocess.run(
        [python, str(REPO / "packaging" / "completions.py"), out / "bash", out / "zsh"],
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return out / "bash"


def _shtabs() -> list[object]:
    """The shtabs to generate with: the system python3's (Debian 12: python3-shtab 1.5, what
    the package is built with) and this interpreter's (pip), each skipped when absent."""
    system = subprocess.run(
        ["/usr/bin/python3", "-c", "import shtab"], capture_output=True, check=False
    )
    return [
        pytest.param(
            "/usr/bin/python3",
            id="system-shtab",
            marks=pytest.mark.skipif(
                system.returncode != 0, reason="the system python3 lacks shtab (python3-shtab)"
            ),
        ),
        pytest.param(sys.executable, id="pip-shtab"),
    ]


def _complete(script: Path, words: list[str], cwd: Path) -> list[str]:
    """What bash offers for the last of ``words`` (the word being completed), one per line,
    calling the completion function as bash's `complete -F` does."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    program = (
        'source "$1"; shift; COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); '
        "_shtab_gpuwatchd; printf '%s\\n' \"${COMPREPLY[@]}\""
    )
    proc = subprocess.run(
        [bash, "-c", program, "bash", str(script), *words],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line]


@pytest.mark.parametrize("python", _shtabs())
def test_bash_completes_every_subcommand_and_file_names(python: str, tmp_path: Path) -> None:
    """`gpuwatchd <Tab>` offers every command (shtab 1.5 offered the first alone), a prefix
    narrows them, choices complete, and FILE, SCENARIO and SNAPSHOT complete file names."""
    if python == sys.executable:
        pytest.importorskip("shtab", reason="pip install shtab (the [test] extra)")
    out = tmp_path / "out"
    script = _bash_completion(python, out)
    files = tmp_path / "files"
    files.mkdir()
    (files / "site policy.yaml").write_text("")
    (files / "scenario.yaml").write_text("")
    assert sorted(_complete(script, ["gpuwatchd", ""], files)) == subcommands()
    assert _complete(script, ["gpuwatchd", "check-c"], files) == ["check-clean", "check-config"]
    assert _complete(script, ["gpuwatchd", "scan", "--color", ""], files) == [
        "auto",
        "always",
        "never",
    ]
    everything = sorted(["site policy.yaml", "scenario.yaml"])
    for words in (
        ["gpuwatchd", "check-config", ""],
        ["gpuwatchd", "--config", ""],
        ["gpuwatchd", "status", "--config", ""],
        ["gpuwatchd", "simulate", ""],
        ["gpuwatchd", "explain", "--json", ""],
    ):
        assert sorted(_complete(script, words, files)) == everything, words
    assert _complete(script, ["gpuwatchd", "simulate", "sc"], files) == ["scenario.yaml"]
    assert "--gpu" in _complete(script, ["gpuwatchd", "check-clean", "--"], files)


@pytest.mark.skipif(shutil.which("dpkg-checkbuilddeps") is None, reason="dpkg-dev not installed")
def test_missing_build_dependencies_are_named_with_the_command_to_install_them() -> None:
    """On a machine without them (here: one that does not exist), build-deb's check names the
    missing build dependencies and how to install them, as a user who cannot install them."""
    with tempfile.TemporaryDirectory() as scratch:  # readable by nobody, unlike tmp_path
        os.chmod(scratch, 0o755)  # noqa: S103 - nobody must read the copied control file
        _check_missing_build_dep(Path(scratch) / "src")


def _check_missing_build_dep(src: Path) -> None:
    shutil.copytree(REPO / "packaging" / "debian", src / "debian")
    control = src / "debian" / "control"
    control.write_text(
        control.read_text().replace(
            "Build-Depends: debhelper-compat (= 13),",
            "Build-Depends: debhelper-compat (= 13), gpuwatchd-no-such-build-dep (>= 1),",
        )
    )
    argv = [str(REPO / "packaging" / "check-build-deps.sh"), str(src)]
    if os.geteuid() == 0:  # as root it would install them: check as nobody
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # Named with its version among the missing (a machine without debhelper lists it too).
    missing = proc.stderr.partition("missing build dependencies:")[2].splitlines()
    assert missing, proc.stderr
    assert "gpuwatchd-no-such-build-dep (>= 1)" in missing[0]
    assert "apt-get install --no-install-recommends" in proc.stderr
    install = next(line for line in proc.stderr.splitlines() if "apt-get install" in line)
    assert "gpuwatchd-no-such-build-dep" in install
    assert "(" not in install.split("apt-get install", 1)[1]  # names apt takes as they are


def test_the_journal_catalog_loads_in_journalctl_with_one_entry_per_event(
    tmp_path: Path,
) -> None:
    """packaging/journal_catalog.py, run as the package build runs it (the system python3,
    no third-party module), gives journalctl one entry per event under its MESSAGE_ID, with
    the event's meaning as its subject and its fields by their journal names."""
    journalctl = shutil.which("journalctl")
    if journalctl is None:
        pytest.skip("no journalctl (systemd) on this machine")
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    catalog = tmp_path / "usr" / "lib" / "systemd" / "catalog" / "gpuwatchd.catalog"
    subprocess.run(
        [python, "-I", "-c", "import runpy, sys; sys.path.insert(0, sys.argv[1]); "
         "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')",
         str(REPO), str(REPO / "packaging" / "journal_catalog.py"), str(catalog)],
        check=True,
    )  # fmt: skip
    subprocess.run([journalctl, f"--root={tmp_path}", "--update-catalog"], check=True)
    listed = subprocess.run(
        [journalctl, f"--root={tmp_path}", "--list-catalog"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    ids = {line.split()[0] for line in listed.splitlines() if line.strip()}
    assert ids == {message_id(event) for event in EventName}
    dumped = subprocess.run(
        [journalctl, f"--root={tmp_path}", "--dump-catalog", message_id(EventName.ACTION_SIGNAL)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "Subject: action.signal: one signal, after the pidfd identity check" in dumped
    assert "TARGET_PID: pid" in dumped
    assert "Level: warning (also error, info, by outcome)" in dumped


def _why_no_build() -> str | None:
    missing = [t for t in ("dpkg-buildpackage", "dh", "dpkg-deb") if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (run tests/systemd/host-setup.sh)"
    probe = subprocess.run(
        ["/usr/bin/python3", "-c", "import shtab"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        return "the system python3 lacks shtab (apt install python3-shtab)"
    return None


@pytest.fixture(scope="module")
def deb_listing(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """{path in the package: its mode string}, from dpkg -c of a fresh build."""
    why = _why_no_build()
    if why is not None:
        pytest.skip(why)
    deb = built_deb(tmp_path_factory)
    listing = subprocess.run(
        ["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True
    ).stdout
    files = {}
    for line in listing.splitlines():
        mode, *_rest, name = line.split(None, 5)
        files[name.removeprefix("./").split(" -> ")[0]] = mode
    return files


def test_the_package_ships_the_docs(deb_listing: dict[str, str]) -> None:
    for doc in sorted((REPO / "docs").glob("*.md")):
        assert f"{DOC}/docs/{doc.name}.gz" in deb_listing or f"{DOC}/docs/{doc.name}" in (
            deb_listing
        ), doc.name
    assert f"{DOC}/README.md.gz" in deb_listing


@pytest.fixture(scope="module")
def deb_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's files, unpacked with dpkg-deb -x from a fresh build."""
    why = _why_no_build()
    if why is not None:
        pytest.skip(why)
    tree = tmp_path_factory.mktemp("deb-tree")
    subprocess.run(["dpkg-deb", "-x", str(built_deb(tmp_path_factory)), str(tree)], check=True)
    return tree


def test_the_project_and_packaging_readmes_are_both_shipped_each_whole(deb_tree: Path) -> None:
    """Both are named README.md: in one folder the second replaced the first, so the package's
    README.md.gz was the packaging notes and the project's README was not shipped."""
    for source, shipped in (
        ("README.md", "README.md.gz"),
        ("packaging/README.md", "packaging/README.md.gz"),
    ):
        assert (
            gzip.decompress((deb_tree / DOC / shipped).read_bytes()) == (REPO / source).read_bytes()
        )


def test_the_man_pages_name_documentation_the_package_ships(deb_tree: Path) -> None:
    """A path under /usr/share/doc/gpuwatchd that a man page names is a file or folder of
    the package, as installed (compressed where dh_compress compresses it)."""
    named = {
        path.rstrip(".").replace("\\-", "-")
        for page in (REPO / "docs" / "man").iterdir()
        for path in re.findall(rf"/{DOC}/[^\s)*]*", page.read_text())
    }
    assert named
    assert {path for path in named if not (deb_tree / path.lstrip("/")).exists()} == set()


def test_the_journal_catalog_links_documentation_the_package_ships(deb_tree: Path) -> None:
    """`journalctl -x` shows each entry's Documentation: a file:// link must name a file that
    is there (dh_compress would have made events.md events.md.gz)."""
    catalog = (deb_tree / "usr/lib/systemd/catalog/gpuwatchd.catalog").read_text()
    links = set(re.findall(r"^Documentation: file://(\S+)$", catalog, re.M))
    assert links
    assert {link for link in links if not (deb_tree / link.lstrip("/")).is_file()} == set()


def test_the_package_ships_the_scenarios_where_the_docs_point(
    deb_listing: dict[str, str],
) -> None:
    where = "/usr/share/doc/gpuwatchd/examples/scenarios"
    assert where in (REPO / "docs" / "operations.md").read_text()
    for scenario in sorted((REPO / "examples" / "scenarios").glob("*.yaml")):
        # Uncompressed: the docs run `gpuwatchd simulate <that folder>/*.yaml`.
        assert f"{where.lstrip('/')}/{scenario.name}" in deb_listing, scenario.name


def test_the_package_ships_contrib(deb_listing: dict[str, str]) -> None:
    for path in sorted(p for p in (REPO / "contrib").rglob("*") if p.is_file()):
        assert f"{DOC}/contrib/{path.relative_to(REPO / 'contrib')}" in deb_listing, path


def test_the_package_installs_the_integration_commands_executable(
    deb_listing: dict[str, str],
) -> None:
    for path in (
        "usr/lib/gpuwatchd/slurm/gpuwatchd-slurm",
        "usr/lib/gpuwatchd/slurm/gpuwatchd-prolog",
        "usr/lib/gpuwatchd/slurm/gpuwatchd-epilog",
        "usr/lib/gpuwatchd/kubernetes/gpuwatchd-npd",
    ):
        assert deb_listing.get(path) == "-rwxr-xr-x", path


def test_the_package_ships_the_slurm_undrain_timer(deb_listing: dict[str, str]) -> None:
    for unit in ("gpuwatchd-slurm-undrain.service", "gpuwatchd-slurm-undrain.timer"):
        assert f"lib/systemd/system/{unit}" in deb_listing, unit


def test_the_package_ships_the_journal_catalog(deb_listing: dict[str, str]) -> None:
    assert "usr/lib/systemd/catalog/gpuwatchd.catalog" in deb_listing


def test_the_package_ships_bash_and_zsh_completion(deb_listing: dict[str, str]) -> None:
    assert "usr/share/bash-completion/completions/gpuwatchd" in deb_listing
    assert "usr/share/zsh/vendor-completions/_gpuwatchd" in deb_listing


def test_the_package_does_not_depend_on_psutil() -> None:
    control = (REPO / "packaging" / "debian" / "control").read_text()
    assert "psutil" not in control
    importers = [p for p in REPO.glob("gpuwatchd/**/*.py") if "psutil" in p.read_text()]
    assert importers == []
