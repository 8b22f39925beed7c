"""The layout is the architecture: read (collect) → decide → act, checked on the import graph.

``decide`` is pure: it imports nothing from ``collect``, ``act``, ``config``, ``cli`` or the
daemon's modules, and no module that does I/O or reads a clock. ``collect`` and ``act`` are
edges: neither imports the other, the CLI or the daemon. ``model`` and ``vocabulary`` are
shared by all and import no layer. Over the whole package: no import circles, and no arrow
running back up the layering of docs/architecture.md ("The layers and the rule between them").
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gpuwatchd"

# Standard-library modules through which code reaches files, processes, the network or a clock.
IO_MODULES = frozenset(
    {
        "io", "os", "pathlib", "shutil", "socket", "select", "selectors", "signal",
        "subprocess", "sys", "tempfile", "threading", "time", "datetime", "logging",
        "structlog", "sdnotify", "pynvml", "psutil", "yaml", "json", "fcntl", "ctypes",
    }
)  # fmt: skip
APP_MODULES = ("daemon", "engine", "host", "state", "statedir", "pause", "logs")


def _module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports inside functions count)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _modules(layer: str) -> list[pathlib.Path]:
    folder = PACKAGE / layer
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{layer}.py"]


def _violations(layer: str, forbidden: tuple[str, ...], *, no_io: bool = False) -> list[str]:
    bad = []
    for path in _modules(layer):
        for name in sorted(imports_of(path)):
            top = name.split(".")[0]
            if name.startswith(forbidden) or (no_io and top in IO_MODULES):
                bad.append(f"{_module_name(path)} imports {name}")
    return bad


def _own(*layers: str) -> tuple[str, ...]:
    return tuple(f"gpuwatchd.{layer}" for layer in layers)


def test_decide_imports_no_other_layer_and_no_io() -> None:
    forbidden = _own("collect", "act", "config", "cli", *APP_MODULES)
    assert _violations("decide", forbidden, no_io=True) == []


def test_model_and_vocabulary_import_no_layer_and_no_io() -> None:
    forbidden = _own("collect", "decide", "act", "config", "cli", *APP_MODULES)
    assert _violations("model", forbidden, no_io=True) == []
    assert _violations("vocabulary", forbidden, no_io=True) == []


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("collect", _own("act", "cli", "config", *APP_MODULES)),
        ("act", _own("collect", "cli", "config", *APP_MODULES)),
        ("config", _own("collect", "act", "cli", *APP_MODULES)),
        ("engine", _own("collect", "cli", "config", "daemon", "host", "state", "pause")),
    ],
)
def test_edges_do_not_reach_into_each_other(layer: str, forbidden: tuple[str, ...]) -> None:
    assert _violations(layer, forbidden) == []


def test_the_checker_sees_lazy_imports(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    import os\n    from gpuwatchd.act import reset\n")
    assert imports_of(source) == {"os", "gpuwatchd.act", "gpuwatchd.act.reset"}


# The layering of docs/architecture.md, bottom first: a module imports only from its own layer
# or a lower one. A new module is placed here (by the longest matching prefix) when it is added.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("gpuwatchd", "gpuwatchd.checked", "gpuwatchd.escape", "gpuwatchd.lazylog",
                    "gpuwatchd.event_catalogue", "gpuwatchd.event_catalogue_resets",
                    "gpuwatchd.event_words",
                    "gpuwatchd.model", "gpuwatchd.paths", "gpuwatchd.vocabulary")),
    ("decide", ("gpuwatchd.decide",)),
    ("edges", ("gpuwatchd.collect", "gpuwatchd.act", "gpuwatchd.config", "gpuwatchd.statedir",
               "gpuwatchd.logs", "gpuwatchd.holder_view", "gpuwatchd.view_guard",
               "gpuwatchd.nvml_view", "gpuwatchd.scan_socket")),
    ("services", ("gpuwatchd.state", "gpuwatchd.pause", "gpuwatchd.accepted",
                  "gpuwatchd.compiled_policy",
                  "gpuwatchd.status_document",
                  "gpuwatchd.metrics", "gpuwatchd.metrics_mig", "gpuwatchd.engine",
                  "gpuwatchd.engine_edges",
                  "gpuwatchd.host", "gpuwatchd.spares", "gpuwatchd.systemd_notify",
                  "gpuwatchd.wiring")),
    ("lifecycle", ("gpuwatchd.daemon", "gpuwatchd.daemon_serving")),
    ("sim", ("gpuwatchd.sim",)),
    ("cli", ("gpuwatchd.cli", "gpuwatchd.__main__")),
)  # fmt: skip


def layer_of(module: str) -> int | None:
    """The rank of ``module``'s layer (0 is the bottom); None when no prefix places it."""
    best: tuple[int, int] | None = None  # (prefix length, rank)
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            placed = module == prefix or (prefix != "gpuwatchd" and module.startswith(prefix + "."))
            if placed and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank)
    return None if best is None else best[1]


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (lazy and type-checking imports included)."""
    paths = {_module_name(path, package.parent): path for path in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets = set()
        for imported in imports_of(path):
            # ``from gpuwatchd.collect import spread`` names the module gpuwatchd.collect.spread
            module = imported if imported in paths else imported.rpartition(".")[0]
            if module in paths and module not in (name, "gpuwatchd"):
                targets.add(module)
        graph[name] = targets
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def back_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a module to one of a higher layer."""
    return [
        f"{source} ({LAYERS[low][0]}) imports {target} ({LAYERS[high][0]})"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if (low := layer_of(source)) is not None
        and (high := layer_of(target)) is not None
        and high > low
    ]


def test_every_module_has_a_place_in_the_layering() -> None:
    unplaced = [name for name in import_graph() if layer_of(name) is None]
    assert unplaced == [], "add these to LAYERS (and to docs/architecture.md): " + ", ".join(
        unplaced
    )


def test_the_package_has_no_import_circles() -> None:
    assert import_circles(import_graph()) == []


def test_no_import_runs_back_up_the_layering() -> None:
    """The daemon imports nothing from cli/; collect, act and config nothing of the services."""
    assert back_arrows(import_graph()) == []


def test_the_measures_see_a_circle_and_a_back_arrow(tmp_path: pathlib.Path) -> None:
    package = tmp_path / "gpuwatchd"
    (package / "cli").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cli" / "__init__.py").write_text("")
    (package / "cli" / "scan.py").write_text("from gpuwatchd import daemon\n")
    (package / "daemon.py").write_text("def f():\n    from gpuwatchd.cli.scan import x\n")
    graph = import_graph(package)
    assert import_circles(graph) == [["gpuwatchd.cli.scan", "gpuwatchd.daemon"]]
    assert back_arrows(graph) == ["gpuwatchd.daemon (lifecycle) imports gpuwatchd.cli.scan (cli)"]


# The modules allowed over LONG_MODULE_LINES, each with why it is long. A new long module fails
# the test below: split it along its seams, or add it here with its reason. Shrink this list.
LONG_MODULE_LINES = 650
LONG_MODULES = {
    "gpuwatchd.collect.nvml_worker": "runs by path and imports nothing: every NVML reader is here",
    "gpuwatchd.daemon": "the lifecycle: lock, saved state, signals, reload, switches, the wait",
    "gpuwatchd.engine": "the poll cycle and the carrying out of its intents share one state",
}


def _module_lines() -> dict[str, int]:
    return {
        _module_name(path): path.read_text().count("\n") for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_no_module_is_over_the_size_limit_unless_listed_with_its_reason() -> None:
    long = [
        f"{name} ({lines} lines)"
        for name, lines in _module_lines().items()
        if lines > LONG_MODULE_LINES and name not in LONG_MODULES
    ]
    assert not long, (
        f"over {LONG_MODULE_LINES} lines: split along its seams, or add to LONG_MODULES with "
        "why: " + ", ".join(long)
    )


def test_the_long_module_list_names_only_modules_still_long() -> None:
    """An entry for a module that was split or removed is dropped, so the list only shrinks."""
    lines = _module_lines()
    stale = [name for name in LONG_MODULES if lines.get(name, 0) <= LONG_MODULE_LINES]
    assert not stale, "remove from LONG_MODULES (no longer long or gone): " + ", ".join(stale)


# Import name → distribution, for the runtime dependencies pyproject.toml declares.
RUNTIME_DISTRIBUTIONS = {
    "pynvml": "nvidia-ml-py",
    "yaml": "pyyaml",
    "structlog": "structlog",
    "sdnotify": "sdnotify",
    "prometheus_client": "prometheus-client",
}


DOCSTRING_MAX_LINES = 30  # what a module owns, in a few lines; how it works: docs/internals.md


def test_a_module_docstring_says_what_it_owns_and_leaves_the_long_story_to_the_docs() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        if docstring.count("\n") + 1 > DOCSTRING_MAX_LINES:
            long.append(f"{_module_name(path)} ({docstring.count(chr(10)) + 1} lines)")
    assert not long, "move the explanation to docs/internals.md: " + ", ".join(long)


def test_every_section_docs_internals_names_is_there() -> None:
    internals = (ROOT / "docs" / "internals.md").read_text()
    for path in sorted(PACKAGE.rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        for section in re.findall(r"docs/internals\.md, section `([\w.]+)`", docstring):
            assert f"## `{section}`" in internals, f"{_module_name(path)} names {section}"


def test_the_package_imports_only_the_standard_library_and_declared_dependencies() -> None:
    """An import of something pyproject.toml does not declare (psutil was dropped) would
    fail on an installed node, not here where the test extras are installed."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    declared = {
        re.split(r"[<>=!~ ;\[]", dep, maxsplit=1)[0].lower()
        for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    assert set(RUNTIME_DISTRIBUTIONS.values()) <= declared
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in sorted(imports_of(path)):
            top = name.split(".")[0]
            if top == "gpuwatchd" or top in sys.stdlib_module_names:
                continue
            if top not in RUNTIME_DISTRIBUTIONS:
                bad.append(f"{_module_name(path)} imports {name}")
    assert bad == []
