"""The kernel room stays one a newcomer can read: no module of ``asyncdbo/_core`` grows past about
450 lines and no function in it past about 60 (issue 23 asked for ``kernel.py`` under ~450 lines
and no function over ~60; it had grown back to 520 before this check)."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "asyncdbo" / "_core"
MAX_MODULE_LINES = 460
MAX_FUNCTION_LINES = 60


def test_no_kernel_module_is_longer_than_about_450_lines() -> None:
    long = {p.name: n for p in sorted(CORE.glob("*.py")) if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"split these by concept (limit {MAX_MODULE_LINES} lines): {long}"


def test_no_kernel_function_is_longer_than_about_60_lines() -> None:
    long = {}
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{path.name}:{node.name}"] = n
    assert long == {}, f"split these (limit {MAX_FUNCTION_LINES} lines): {long}"
