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
    pipelines    the typer-free runs (requests, compare, rescore, bisect, diff, ablate) over workers and comparison
    rl, api      the GRPO loop and the Python API, over the pipelines
    integrations TRL, verl, slime: over the API, imported by nothing of the library
    commands     the CLI: typer over all of it

    kernels (alignaudit_kernels)  import nothing of alignaudit
    engines                       never reach a report, a command or the comparison
    no module                     reaches itself (no cycles); no folder either (FOLDERS: what each folder may import
                                  directly, every folder named)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import ROOT

PACKAGES = {"alignaudit": ROOT / "alignaudit", "alignaudit_kernels": ROOT / "kernels" / "alignaudit_kernels"}
ENGINE_SIDE = (
    "alignaudit.engines",
    "alignaudit.training",
    "alignaudit.workers",
    "alignaudit.commands",
    "alignaudit.rl",
    "vllm",
    "megatron",
)
ABOVE_WORKERS = (
    "alignaudit.commands",
    "alignaudit.rl",
    "alignaudit.comparison",
    "alignaudit.reports",
    "alignaudit.api",
    "alignaudit.integrations",
)
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


_BASE = ("alignaudit.errors", "alignaudit.numerics")
# folder -> the folders it may import directly (besides itself); with no folder-level cycle, the layers above
FOLDERS = {
    "alignaudit": (),
    "alignaudit.errors": (),
    "alignaudit.numerics": (),
    "alignaudit_kernels": (),
    "alignaudit.arch": _BASE,
    "alignaudit.inputs": (*_BASE, "alignaudit.arch", "alignaudit_kernels"),
    "alignaudit.capture": (*_BASE, "alignaudit.inputs"),
    "alignaudit.comparison": (*_BASE, "alignaudit.capture", "alignaudit.inputs"),
    "alignaudit.reports": (*_BASE, "alignaudit", "alignaudit.capture", "alignaudit.comparison"),
    "alignaudit.engines": (*_BASE, "alignaudit.arch", "alignaudit.capture", "alignaudit.inputs", "alignaudit_kernels"),
    "alignaudit.training": (*_BASE, "alignaudit.engines", "alignaudit.inputs", "alignaudit_kernels"),
    "alignaudit.workers": (
        *_BASE,
        "alignaudit",
        "alignaudit.capture",
        "alignaudit.engines",
        "alignaudit.inputs",
        "alignaudit.training",
        "alignaudit_kernels",
    ),
    "alignaudit.pipelines": (
        *_BASE,
        "alignaudit.capture",
        "alignaudit.comparison",
        "alignaudit.engines",
        "alignaudit.inputs",
        "alignaudit.workers",
    ),
    "alignaudit.rl": (
        *_BASE,
        "alignaudit.capture",
        "alignaudit.comparison",
        "alignaudit.engines",
        "alignaudit.inputs",
        "alignaudit.pipelines",
        "alignaudit.reports",
        "alignaudit.workers",
    ),
    "alignaudit.api": (
        *_BASE,
        "alignaudit.capture",
        "alignaudit.comparison",
        "alignaudit.engines",
        "alignaudit.inputs",
        "alignaudit.pipelines",
        "alignaudit.rl",
        "alignaudit_kernels",
    ),
    "alignaudit.integrations": (
        *_BASE,
        "alignaudit.api",
        "alignaudit.engines",
        "alignaudit.inputs",
        "alignaudit_kernels",
    ),
    "alignaudit.commands": (
        *_BASE,
        "alignaudit",
        "alignaudit.capture",
        "alignaudit.comparison",
        "alignaudit.engines",
        "alignaudit.inputs",
        "alignaudit.pipelines",
        "alignaudit.reports",
        "alignaudit.rl",
    ),
    "alignaudit.__main__": ("alignaudit.commands",),
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
    assert not {
        m: sorted(t for t in targets if _under(t, leaf))
        for m, targets in graph.items()
        if not _under(m, leaf) and any(_under(t, leaf) for t in targets)
    }
    integrations = [m for m in graph if m.startswith("alignaudit.integrations.")]
    assert {"alignaudit.integrations.trl", "alignaudit.integrations.verl"} <= set(integrations)
    for module in integrations:
        assert not _violations(graph, (module,), tuple(i for i in integrations if i != module), transitive=False)


def test_no_import_cycles(graph):
    assert not [m for m in graph if m in _reach(graph, m)]


def _folder(module: str) -> str | None:
    """The folder a module of ours sits in (alignaudit.X for alignaudit.X.*; alignaudit_kernels whole); None for
    another package."""
    parts = module.split(".")
    if parts[0] == "alignaudit_kernels":
        return parts[0]
    return ".".join(parts[:2]) if parts[0] == "alignaudit" else None


def _folder_graph(graph) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = _folder(module)
        folders.setdefault(source, set()).update(t for t in map(_folder, targets) if t and t != source)
    return folders


def test_each_folder_imports_only_the_folders_below_it(graph):
    """Every folder is named in FOLDERS (a new one must be placed in the layers) and imports only what it lists."""
    folders = _folder_graph(graph)
    assert set(folders) - set(FOLDERS) == set(), "a folder FOLDERS does not place"
    assert {f: sorted(t - set(FOLDERS[f])) for f, t in folders.items() if t - set(FOLDERS[f])} == {}
    assert "alignaudit.pipelines" in folders["alignaudit.rl"]  # the reader sees folder edges


def test_no_folder_level_cycles(graph):
    """No two folders import each other, through any chain (rl/ and commands/ once did: rl/request.py reached up
    into commands/requests.py, now pipelines/requests.py)."""
    folders = _folder_graph(graph)
    assert not [f for f in folders if f in _reach(folders, f)]


def test_every_package_folder_is_in_the_wheel():
    """pyproject.toml lists packages by name (fixtures/ installs under another name): a folder added without its entry
    would be missing from a non-editable install only."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name.rpartition(".")[0] for name, file in _modules().items() if file.name != "__init__.py"}
    packages = {name for name, file in _modules().items() if file.name == "__init__.py"}
    assert folders - packages == set(), "a folder of modules without __init__.py"
    assert packages - listed == set()


def test_the_api_and_the_request_builder_reach_no_typer(graph):
    """The Python API gets the CLI's checks from the typer-free request builder, not from the CLI's options."""
    pipelines = [m for m in graph if _under(m, ("alignaudit.pipelines",))]
    for module in ("alignaudit.api", "alignaudit.rl.request", *pipelines):
        assert "typer" not in _reach(graph, module), module
    assert "typer" in _reach(graph, "alignaudit.commands.options")  # the reader sees typer where it is


def test_no_module_is_over_600_lines():
    """One job per file: a module past 600 lines is doing several (split it, as alignaudit_kernels.attention was)."""
    long = {name: n for name, file in _modules().items() if (n := len(file.read_text().splitlines())) > 600}
    assert long == {}
