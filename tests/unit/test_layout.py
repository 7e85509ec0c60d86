"""The package layout: imports go only down the pipeline, and no module imports itself back.

__main__ (the console script) -> cli -> repro -> distribute -> build -> recipe -> the shared modules (errors, files, net, gitfetch, imageref, registry, proc, inimage).
Every import counts, those inside functions too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT

PACKAGE = ROOT / "sparkforge"
ORDER = ("__main__", "cli", "repro", "distribute", "build", "recipe")  # top first; anything else is the shared bottom


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def rank(module: str) -> int:
    """How far down the pipeline a module sits: 0 for the console script, len(ORDER) for the shared modules."""
    parts = module.split(".")
    return ORDER.index(parts[1]) if len(parts) > 1 and parts[1] in ORDER else len(ORDER)


def imports(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The sparkforge modules that one file imports, by their dotted names."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import name` imports the module pkg.name when there is one, else pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = {module_name(p, package.parent): p for p in package.rglob("*.py")}
    return {name: imports(path, set(files), package.parent) for name, path in files.items()}


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Imports of a module further up the pipeline than the importer (a package's __init__ may import
    its own modules)."""
    bad = []
    for name, targets in sorted(edges.items()):
        for target in sorted(targets):
            if target.startswith(name + "."):
                continue
            if rank(target) < rank(name):
                bad.append(f"{name} imports {target}")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def test_imports_go_down_the_pipeline():
    assert upward(graph()) == []


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_the_image_side_imports_only_itself():
    """inimage is copied into images alone: it may import nothing else of sparkforge."""
    edges = graph()
    outside = {f"{name} imports {t}" for name, targets in edges.items() if name.startswith("sparkforge.inimage")
               for t in targets if not t.startswith("sparkforge.inimage")}
    assert outside == set()


def test_the_checker_finds_an_upward_import_and_a_cycle(tmp_path):
    """The checker itself: a recipe module importing the CLI, and two modules importing each other."""
    pkg = tmp_path / "sparkforge"
    for folder in (pkg, pkg / "recipe", pkg / "cli"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (pkg / "recipe" / "plan.py").write_text("from ..cli import app\n")
    (pkg / "cli" / "app.py").write_text("def f():\n    from . import views\n")
    (pkg / "cli" / "views.py").write_text("from .app import f\n")
    edges = graph(pkg)
    assert upward(edges) == ["sparkforge.recipe.plan imports sparkforge.cli.app"]
    assert cycles(edges) == [["sparkforge.cli.app", "sparkforge.cli.views"]]
