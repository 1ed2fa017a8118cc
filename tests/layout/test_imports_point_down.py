"""The package layout is the architecture: every import between asyncdbo's subpackages points down
this table, and there is no cycle. A module's imports are read from its source (module level,
functions and ``TYPE_CHECKING`` blocks alike), so a lazy import cannot hide an upward edge; nor can
a ``"module:attribute"`` string imported later (a backend factory)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import asyncdbo

PKG = Path(asyncdbo.__file__).resolve().parent

#: subpackage (or top-level module) -> the subpackages it may import. Read it bottom-up: the kernel
#: knows nothing; backends know the kernel; the DBO layer knows both; and so on up to the CLI.
ALLOWED: dict[str, set[str]] = {
    "_core": set(),
    "lowlevel": {"_core"},
    "backends": {"_core"},
    "syncs": {"_core"},  # the host-sync detector: watches torch ops, knows no backend
    "dbo": {"_core", "backends", "syncs"},  # syncs: debug mode's blocking warning names the syncs it saw
    "dist": {"_core", "backends", "dbo"},
    "plan": {"_core"},  # its errors derive from the one root (asyncdbo._core.errors)
    "observe": {"_core", "backends", "dbo"},
    "moe": {"_core", "backends", "dbo", "dist"},
    "serving": {"_core", "backends", "dbo", "dist", "plan"},
    "models": {"_core", "backends", "dbo", "dist", "moe", "plan", "serving"},
    "sim": {"_core", "backends", "syncs", "dbo", "dist", "moe", "plan", "serving", "models", "observe"},
    "testing": {"_core", "lowlevel", "backends", "syncs", "dbo"},
    "cli": {"_core", "lowlevel", "backends", "syncs", "dbo", "dist", "plan", "observe", "moe", "serving", "models", "sim",
            "testing"},
    "_compat": set(),
    "__init__": {"_core", "_compat", "backends", "dbo", "dist", "observe", "sim"},  # sim: registered by name
    "__main__": {"cli"},
}


#: a module named by string to be imported later (a backend factory's "module:attribute"): an edge too
IMPORT_SPEC = re.compile(r"^asyncdbo(\.\w+)+:\w+$")


def _unit(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_units(path: Path) -> set[str]:
    """The asyncdbo subpackages a module imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), str(path))
    package = list(path.relative_to(PKG).parent.parts)
    units: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                mod = [*base, *(node.module.split(".") if node.module else [])]
                if not mod:  # `from . import x` at the top level
                    names = [f"asyncdbo.{a.name}" for a in node.names]
                else:
                    names = ["asyncdbo." + ".".join(mod)]
                    if node.module is None:
                        names = [f"asyncdbo.{'.'.join(mod)}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and IMPORT_SPEC.match(node.value):
            names = [node.value.partition(":")[0]]  # "module:attribute", imported on first use
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "asyncdbo" and len(parts) > 1:
                units.add(parts[1])
    return units


def _edges() -> dict[str, dict[str, list[str]]]:
    """unit -> imported unit -> the files that import it."""
    edges: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PKG.rglob("*.py")):
        unit = _unit(path)
        for other in _imported_units(path):
            if other != unit:
                edges.setdefault(unit, {}).setdefault(other, []).append(str(path.relative_to(PKG)))
    return edges


def test_every_unit_is_in_the_table() -> None:
    units = {_unit(p) for p in PKG.rglob("*.py")}
    assert units == set(ALLOWED), (
        f"units not in ALLOWED: {sorted(units - set(ALLOWED))}; entries with no code: {sorted(set(ALLOWED) - units)}"
    )


def test_imports_only_point_down() -> None:
    upward = [
        f"{unit} -> {other} ({', '.join(files)})"
        for unit, targets in _edges().items()
        for other, files in targets.items()
        if other not in ALLOWED[unit]
    ]
    assert upward == [], "imports that point up or sideways:\n" + "\n".join(upward)


def test_no_import_cycle_between_units() -> None:
    edges = {u: set(t) for u, t in _edges().items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                cycles.append([*path[path.index(v):], v] if v in path else [*path, v])
            elif v not in state:
                visit(v, [*path, v])
        state[u] = 2

    for u in sorted(edges):
        if u not in state:
            visit(u, [u])
    assert cycles == []


def test_the_table_itself_has_no_cycle() -> None:
    """ALLOWED must be a partial order, or 'points down' would mean nothing."""
    order: list[str] = []
    left = {u: set(deps) for u, deps in ALLOWED.items()}
    while left:
        ready = sorted(u for u, deps in left.items() if deps <= set(order))
        assert ready, f"ALLOWED has a cycle among {sorted(left)}"
        order += ready
        for u in ready:
            del left[u]
