"""Benchmarks use asyncdbo's public API or a documented internal seam (issue 52 item 7), so a
refactor of the internals breaks no benchmark that the allow-list below does not name.

A private name is one with a leading underscore anywhere in its dotted path: an import
(``from asyncdbo._core import kernel``, ``from asyncdbo.cli.demo import _decode_chunks``) or an
attribute read through an imported asyncdbo name (``recovery._guard``,
``MiniModel._attention``). Attributes of objects a benchmark makes (``run._ready``) are not seen
here: they are the allow-listed script's business."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"

#: private modules a benchmark may import, each a seam docs/maintaining.md documents
SEAMS: dict[str, str] = {
    "asyncdbo._core.fastpath": "the kernel's one seam: which loop runs (kernel_loop, C, LOOPS)",
}
#: scripts that may use any private name, each with why
SCRIPTS: dict[str, str] = {
    "run_setup.py": "times a run's set-up phase by phase (dbo/run.py's _run taken apart); its --quick runs in "
                    "tests/docs/test_benchmarks_smoke.py, so a refactor that breaks it fails there",
}


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.endswith("__") for part in dotted.split("."))


def private_names(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of each private asyncdbo name ``source`` imports or reads through an import."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the asyncdbo path it stands for
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "asyncdbo":
            for alias in node.names:
                path = f"{node.module}.{alias.name}"
                bound[alias.asname or alias.name] = path
                found.append((node.lineno, path))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "asyncdbo":
                    bound[alias.asname or "asyncdbo"] = alias.name if alias.asname else "asyncdbo"
                    found.append((node.lineno, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain: list[str] = []
            value: ast.expr = node
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                found.append((node.lineno, ".".join([bound[value.id], *reversed(chain)])))
    return sorted({(line, name) for line, name in found if _private(name)})


def _allowed(name: str) -> bool:
    return any(name == seam or (name.startswith(seam + ".") and not _private(name[len(seam) + 1:])) for seam in SEAMS)


def test_benchmarks_import_no_private_asyncdbo_name_outside_the_allow_list() -> None:
    found = [
        f"benchmarks/{script.name}:{line}: {name}"
        for script in sorted(BENCH.glob("*.py")) if script.name not in SCRIPTS
        for line, name in private_names(script.read_text()) if not _allowed(name)
    ]
    assert found == [], "\n".join(found)


def test_the_allow_list_names_what_exists_and_the_guide_documents_each_seam() -> None:
    guide = (ROOT / "docs" / "maintaining.md").read_text()
    assert [s for s in SCRIPTS if not (BENCH / s).exists()] == []
    assert [s for s in SEAMS if s.replace(".", "/") + ".py" not in guide] == []


def test_the_check_sees_private_imports_and_reads_through_them() -> None:
    source = (
        "from asyncdbo._core import kernel\n"
        "from asyncdbo.cli.demo import _decode_chunks, DemoConfig\n"
        "import asyncdbo.dist.recovery as recovery\n"
        "from asyncdbo.models import mini\n"
        "recovery._guard()\n"
        "mini.MiniModel._attention = None\n"
        "mini.MiniModel.forward\n"
    )
    assert private_names(source) == [
        (1, "asyncdbo._core.kernel"), (2, "asyncdbo.cli.demo._decode_chunks"), (5, "asyncdbo.dist.recovery._guard"),
        (6, "asyncdbo.models.mini.MiniModel._attention"),
    ]
    assert _allowed("asyncdbo._core.fastpath.kernel_loop") and not _allowed("asyncdbo._core.fastpath._EMPTY")
