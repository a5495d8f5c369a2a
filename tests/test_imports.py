"""The layering of alignaudit, checked on its import graph (every import statement, at module level or inside a
function, read with ast: a lazy import couples modules as much as an eager one). The folders follow the data
flow, and each may reach only what comes before it:

    inputs       what a run is asked to do (request, checkpoint, prompts, checks before any engine starts)
    capture      the capture format: the only thing both the engine side and the comparison side import
    engines      one folder per engine (adapter, taps, weights, options, strict wiring) over engines/base
    training     the trainer an engine becomes in an rl worker: GRPO loss, optimizer, weight transfer
    workers      the processes engines run in (one-shot captures, the rl session's worker and its parent handle)
    comparison   pure: never reaches an engine, a worker, the strict wiring, a command or vllm/megatron
    reports      terminal and HTML: never reach an engine either
    commands     the CLI and the pipelines it runs (and rl/, the GRPO loop beside them)

    kernels (alignaudit_kernels)  import nothing of alignaudit
    engines                       never reach a report, a command or the comparison
    no module                     reaches itself (no cycles)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import ROOT

PACKAGES = {"alignaudit": ROOT / "alignaudit", "alignaudit_kernels": ROOT / "kernels"}
ENGINE_SIDE = ("alignaudit.engines", "alignaudit.training", "alignaudit.workers", "alignaudit.commands",
               "alignaudit.rl", "vllm", "megatron")
ABOVE_WORKERS = ("alignaudit.commands", "alignaudit.rl", "alignaudit.comparison", "alignaudit.reports",
                 "alignaudit.api", "alignaudit.integrations")
# folder -> the folders (and engine packages) it must never reach, directly or through another module
FORBIDDEN = {
    "alignaudit.inputs": ENGINE_SIDE + ("alignaudit.capture", "alignaudit.comparison", "alignaudit.reports"),
    "alignaudit.capture": ENGINE_SIDE + ("alignaudit.comparison", "alignaudit.reports"),
    "alignaudit.comparison": ENGINE_SIDE + ("alignaudit.reports",),
    "alignaudit.reports": ENGINE_SIDE,
    "alignaudit.engines": ("alignaudit.training", "alignaudit.workers") + ABOVE_WORKERS,
    "alignaudit.training": ("alignaudit.workers",) + ABOVE_WORKERS,
    "alignaudit.workers": ABOVE_WORKERS,
}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for file in folder.rglob("*.py"):
            parts = (package, *file.relative_to(folder).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return modules


def _imported(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    """The modules ``name`` imports: ours resolved to the deepest module that exists, others by top package."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] not in PACKAGES:
                found.add(target.split(".")[0])
                continue
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, file, modules) for name, file in modules.items()}


def _reach(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(graph, sources, forbidden, transitive=True) -> dict[str, list[str]]:
    """{module under ``sources``: the modules under ``forbidden`` it imports (or reaches)} where any."""
    found = {}
    for module in graph:
        if _under(module, sources):
            targets = _reach(graph, module) if transitive else graph[module]
            if bad := sorted(t for t in targets if _under(t, forbidden)):
                found[module] = bad
    return found


def test_the_graph_is_read(graph):
    """The reader sees real edges (a broken reader would pass every contract below)."""
    assert {"alignaudit_kernels.primitives", "torch"} <= graph["alignaudit_kernels.moe"]
    assert "alignaudit.engines.custom_ops" in graph["alignaudit.engines.strict_modules"]
    spawn = _violations(graph, ("alignaudit.workers.spawn",), ("alignaudit.engines",))
    assert "alignaudit.engines.base" in spawn["alignaudit.workers.spawn"]


def test_kernels_import_nothing_of_alignaudit(graph):
    assert not _violations(graph, ("alignaudit_kernels",), ("alignaudit",), transitive=False)


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_each_folder_reaches_only_what_comes_before_it(graph, folder):
    assert not _violations(graph, (folder,), FORBIDDEN[folder])


def test_an_engine_folder_reaches_no_other_engine_folder(graph):
    """Adding an engine, or another version of one, touches that engine's folder only."""
    engines = ("alignaudit.engines.hf", "alignaudit.engines.megatron", "alignaudit.engines.vllm")
    for engine in engines:
        assert not _violations(graph, (engine,), tuple(e for e in engines if e != engine), transitive=False)


def test_the_framework_integrations_are_leaves(graph):
    """alignaudit.integrations (TRL, verl, the Megatron spec for slime) sits on top: each imports its framework, so
    no module of the library may import it (a user without TRL or verl imports alignaudit all the same), and one
    integration never imports another."""
    leaf = ("alignaudit.integrations",)
    assert not {m: sorted(t for t in targets if _under(t, leaf)) for m, targets in graph.items()
                if not _under(m, leaf) and any(_under(t, leaf) for t in targets)}
    integrations = [m for m in graph if m.startswith("alignaudit.integrations.")]
    assert {"alignaudit.integrations.trl", "alignaudit.integrations.verl"} <= set(integrations)
    for module in integrations:
        assert not _violations(graph, (module,), tuple(i for i in integrations if i != module), transitive=False)


def test_no_import_cycles(graph):
    assert not [m for m in graph if m in _reach(graph, m)]


def test_every_package_folder_is_in_the_wheel():
    """pyproject.toml lists packages by name (kernels/ and fixtures/ install under other names): a folder added
    without its entry would be missing from a non-editable install only."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name.rpartition(".")[0] for name, file in _modules().items() if file.name != "__init__.py"}
    packages = {name for name, file in _modules().items() if file.name == "__init__.py"}
    assert folders - packages == set(), "a folder of modules without __init__.py"
    assert packages - listed == set()


def test_the_api_and_the_request_builder_reach_no_typer(graph):
    """The Python API gets the CLI's checks from the typer-free request builder, not from the CLI's options."""
    for module in ("alignaudit.api", "alignaudit.commands.requests", "alignaudit.rl.request"):
        assert "typer" not in _reach(graph, module), module
    assert "typer" in _reach(graph, "alignaudit.commands.options")  # the reader sees typer where it is


def test_no_module_is_over_600_lines():
    """One job per file: a module past 600 lines is doing several (split it, as kernels/attention/ was)."""
    long = {name: n for name, file in _modules().items() if (n := len(file.read_text().splitlines())) > 600}
    assert long == {}
