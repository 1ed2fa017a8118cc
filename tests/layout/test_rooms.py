"""Every room (package) of asyncdbo stays one a maintainer can learn (issue 52 item 6): no module
over 450 lines, and no circle of imports between the files of one package, a ``TYPE_CHECKING``
import or one inside a function included. The one exception is the kernel's (``_core``): its
modules name the run's type, :class:`~asyncdbo._core.kernel.DBORun`, for type checkers only, each
edge explained below; without those edges ``_core`` has no circle either."""

from __future__ import annotations

import ast
from pathlib import Path

import asyncdbo

PKG = Path(asyncdbo.__file__).resolve().parent
MAX_MODULE_LINES = 450

#: (importer, imported) inside ``_core``, under ``if TYPE_CHECKING:`` only, and why it is there.
EXPLAINED_CORE_EDGES: dict[tuple[str, str], str] = {
    ("cancel", "kernel"): "cancel_all/throw_at_next_resume take the run whose ubatches they cancel",
    ("endings", "kernel"): "Endings is DBORun's base class: its methods are DBORun's, typed as such",
    ("instrument", "kernel"): "an Instrument's hooks receive the run they observe",
    ("live", "kernel"): "LIVE_RUNS holds weak references to the runs being driven",
    ("parking", "kernel"): "Parking is DBORun's base class: its methods are DBORun's, typed as such",
    ("tasks", "kernel"): "a ubatch's task view stands for the run's task, and names the run",
    ("ubatch", "kernel"): "a UBatch record points at its run (ub.run)",
    ("parking", "instrument"): "Parking calls the run's instrument, typed as Instrument",
    ("instrument", "ubatch"): "an Instrument's hooks receive the ubatch they observe",
}


def _edges(package: Path) -> dict[str, dict[str, bool]]:
    """file -> file of the same package it imports -> whether only under ``TYPE_CHECKING``."""
    names = {p.stem for p in package.glob("*.py")}
    dotted = "asyncdbo." + ".".join(package.relative_to(PKG).parts) + "."
    edges: dict[str, dict[str, bool]] = {}
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        typing_only: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                typing_only |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
        out: dict[str, bool] = {}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 1:
                targets = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            elif node.level == 0 and node.module and node.module.startswith(dotted):
                targets = [node.module[len(dotted):].split(".")[0]]
            else:
                continue
            for t in targets:
                if t in names and t != path.stem:
                    out[t] = out.get(t, True) and id(node) in typing_only
        edges[path.stem] = out
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(u: str) -> None:
        index[u] = low[u] = len(index)
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if v not in index:
                visit(v)
                low[u] = min(low[u], low[v])
            elif v in stack:
                low[u] = min(low[u], index[v])
        if low[u] == index[u]:
            comp = []
            while True:
                v = stack.pop()
                comp.append(v)
                if v == u:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for u in sorted(edges):
        if u not in index:
            visit(u)
    return found


def _packages() -> list[Path]:
    return sorted(p.parent for p in PKG.rglob("__init__.py"))


def test_no_module_is_longer_than_450_lines() -> None:
    long = {str(p.relative_to(PKG)): n for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"split these by concept (limit {MAX_MODULE_LINES} lines): {long}"


def test_no_file_circle_inside_a_package() -> None:
    circles = {}
    for package in _packages():
        if package.name == "_core":
            continue
        found = _circles({u: set(t) for u, t in _edges(package).items()})
        if found:
            circles[str(package.relative_to(PKG))] = found
    assert circles == {}, f"files that import each other (move what both need to a module below them): {circles}"


def test_the_kernel_circle_is_only_its_explained_type_checking_edges() -> None:
    edges = _edges(PKG / "_core")
    for (a, b), why in EXPLAINED_CORE_EDGES.items():
        assert edges[a].get(b) is True, f"_core/{a}.py no longer imports {b} for type checkers only ({why}): update the list"
    runtime = {u: {v for v in t if (u, v) not in EXPLAINED_CORE_EDGES} for u, t in edges.items()}
    assert _circles(runtime) == []
