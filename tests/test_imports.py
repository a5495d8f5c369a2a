"""The layering of alignaudit, checked on its import graph (every import statement, at module level or inside a
function, read with ast: a lazy import couples modules as much as an eager one).

    kernels (alignaudit_kernels)  import nothing of alignaudit
    comparison and reports        never reach an engine, the workers, the strict wiring or an engine package
    engines                       never reach a report
    no module                     reaches itself (no cycles)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGES = {"alignaudit": ROOT / "alignaudit", "alignaudit_kernels": ROOT / "kernels"}
COMPARISON = ("alignaudit.numerics", "alignaudit.opdiff", "alignaudit.diff", "alignaudit.gate", "alignaudit.verify")
REPORTS = ("alignaudit.report", "alignaudit.report_html")
ENGINE_SIDE = ("alignaudit.engines", "alignaudit.runner", "alignaudit.strict", "alignaudit.pipeline", "vllm",
               "megatron")


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
    assert "alignaudit.strict.custom_ops" in graph["alignaudit.strict.common"]
    runner = _violations(graph, ("alignaudit.runner",), ("alignaudit.engines",))
    assert "alignaudit.engines.base" in runner["alignaudit.runner"]


def test_kernels_import_nothing_of_alignaudit(graph):
    assert not _violations(graph, ("alignaudit_kernels",), ("alignaudit",), transitive=False)


@pytest.mark.parametrize("layer", ["comparison", "reports"])
def test_comparison_and_reports_never_reach_an_engine(graph, layer):
    assert not _violations(graph, COMPARISON if layer == "comparison" else REPORTS, ENGINE_SIDE)


def test_engines_never_reach_a_report(graph):
    assert not _violations(graph, ("alignaudit.engines",), REPORTS)


def test_no_import_cycles(graph):
    assert not [m for m in graph if m in _reach(graph, m)]
