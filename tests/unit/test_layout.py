"""The code's shape, checked from its source: packages in layers (no circle between rollflow's
packages and top-level modules, `TYPE_CHECKING` and function-level imports included), the
episode seam below every adapter, and the size limits docs/architecture.md states."""

from __future__ import annotations

import ast
from pathlib import Path

import rollflow

ROOT = Path(rollflow.__file__).parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
LONG_MODULES = {"config.py"}
"""config.py holds the whole schema, a docstring under every field."""


def units() -> dict[str, set[str]]:
    """Each package or top-level module of rollflow -> the others it imports (any import, anywhere)."""
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        unit = path.relative_to(ROOT).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}: relative import (rollflow imports by absolute name)")
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.ImportFrom):
                names += [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "rollflow" and len(parts) > 1 and parts[1] != unit and _is_unit(parts[1]):
                    edges.setdefault(unit, set()).add(parts[1])
    return edges


def _is_unit(name: str) -> bool:
    return (ROOT / name).is_dir() or (ROOT / f"{name}.py").is_file()


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_circle_between_packages_and_top_level_modules():
    edges = units()
    circles = sorted(unit for unit in edges if unit in reachable(edges, unit))
    assert not circles, {unit: sorted(edges[unit] & set(circles)) for unit in circles}


def test_the_episode_seam_imports_no_adapter_and_nothing_above_it():
    below = reachable(units(), "episodes")
    assert not below & {"envs", "agent", "verifiers", "sources", "controller", "tasks", "scoring"}, below


def test_the_checker_sees_a_circle_and_an_import_hidden_under_type_checking(tmp_path):
    # The check itself must be able to fail: a circle is found, and so is an edge in a function.
    edges = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert "a" in reachable(edges, "a") and "c" not in reachable(edges, "c")
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rollflow.envs import x\n"
    found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom) and n.module == "rollflow.envs"]
    assert found


def test_no_module_over_400_lines_and_no_function_over_80():
    long_modules, long_functions = [], []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES and path.name not in LONG_MODULES:
            long_modules.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    assert not long_modules, long_modules
    assert not long_functions, long_functions
