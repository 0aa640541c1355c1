"""The package's layers import each other in one direction only: each subpackage imports on its own, and the
graph of imports between subpackages (``if TYPE_CHECKING:`` blocks aside) has no cycle."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "lightning_hstu"
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())


def imported_by_the_package() -> set[str]:
    """The subpackages ``lightning_hstu/__init__.py`` imports itself (``from .name...``)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level and node.module]
    found = {node.module.split(".")[0] for node in relative}
    return found & set(SUBPACKAGES)


def test_each_subpackage_imports_alone_in_a_fresh_interpreter():
    """``import lightning_hstu.name`` runs the package's ``__init__`` first, which imports some subpackages
    itself: for those it is ``import lightning_hstu``, one interpreter for all of them."""
    alone = [f"lightning_hstu.{name}" for name in SUBPACKAGES if name not in imported_by_the_package()]
    processes = {
        name: subprocess.Popen(
            [sys.executable, "-c", f"import {name}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ["lightning_hstu", *alone]
    }
    failed = {}
    for name, process in processes.items():
        _, stderr = process.communicate(timeout=300)
        if process.returncode != 0:
            failed[name] = stderr.strip().splitlines()[-1]
    assert not failed, failed


def imports_between_subpackages() -> dict[str, set[str]]:
    """Subpackage (or top-level module) -> the others it imports, at module level or inside functions."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        owner = parts[0] if len(parts) > 1 else path.stem
        tree = ast.parse(path.read_text())
        type_checking = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for node in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in type_checking or not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0:
                module = (node.module or "").split(".")
                targets = [module[1]] if module[0] == "lightning_hstu" and len(module) > 1 else []
            else:
                base = list(parts[:-1])[: len(parts) - node.level]  # the package the dots name
                names = base + (node.module.split(".") if node.module else [])
                targets = [names[0]] if names else [alias.name for alias in node.names]
            graph.setdefault(owner, set()).update(t for t in targets if t != owner and t != "__init__")
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target] if target in path else [node, target]
            if target not in state and (cycle := visit(target, path + [target])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_subpackages_import_each_other_without_a_cycle():
    graph = imports_between_subpackages()
    assert graph.get("engine") and graph.get("strategies")  # the graph was read
    assert "strategies" not in graph.get("loops", set())  # the loop is handed its strategy, never imports it
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
