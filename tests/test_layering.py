"""The package layering docs/architecture.md states, checked against the import graph.

A unit (a subpackage of gyre, or a top-level module) imports only units on lower floors, so
the code reads top-down and a fork can take a floor with everything below it.
"""

from __future__ import annotations

import ast
import pathlib

import gyre

# Top floor first; docs/architecture.md ("Layering") draws the same table.
FLOORS = (
    ("plan",),
    ("run", "analysis"),
    ("config",),
    ("rl",),
    ("cluster",),
    ("agent",),
    ("train", "rollout", "smoke"),
    ("envs", "elastic"),
    ("model",),
    ("chat", "trajectory", "mesh"),
    ("errors", "cache", "metrics", "plots", "signals", "watchdog", "bounds", "kvpool"),
)
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}
PACKAGE = pathlib.Path(gyre.__file__).parent


def _unit(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imports(tree: ast.AST):
    """(line, unit imported) for every import of gyre in ``tree``, lazy ones included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "gyre":
                continue
            if len(parts) > 1:
                yield node.lineno, parts[1]
            else:  # from gyre import mesh, signals
                yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("gyre."):
                    yield node.lineno, a.name.split(".")[1]


def test_every_unit_has_a_floor():
    units = {_unit(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert units <= set(FLOOR), f"units without a floor: {sorted(units - set(FLOOR))}"


def test_imports_go_down_only():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _unit(path)
        if me == "__init__":
            continue
        for line, other in _imports(ast.parse(path.read_text())):
            if other != me and FLOOR[other] <= FLOOR[me]:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} ({me}) imports {other}")
    assert not upward, upward
