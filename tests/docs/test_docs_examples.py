"""Every ```python block in README.md and docs/*.md and every examples/*.py runs, so the docs cannot rot.

The blocks of one page run in order in one namespace, like a reader pasting them into one
interpreter session (later blocks use names earlier ones defined). A block may be skipped only
with an HTML comment on the line right before it that gives the reason::

    <!-- skip: needs a CUDA device -->

Examples run as scripts in a fresh interpreter (``python examples/x.py``), the way a user runs
them; the multi-rank ones start their own small process groups on 127.0.0.1.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
_SKIP = re.compile(r"<!--\s*skip:\s*(.+?)\s*-->\s*$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip_reason)`` of every ```python block, in order."""
    blocks = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        blocks.append((line, m.group(1), skip.group(1) if skip else None))
    return blocks


def test_block_parser_reads_code_lines_and_skip_reasons() -> None:
    text = "# t\n\n```python\nx = 1\n```\n\n<!-- skip: needs a GPU -->\n```python\ny = 2\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n", None), (8, "y = 2\n", "needs a GPU")]


def test_there_are_docs_and_examples() -> None:
    assert {p.name for p in DOCS} >= {"tutorial.md", "porting_from_vllm.md", "design.md", "reference.md", "troubleshooting.md",
                                      "integration.md", "compile.md"}
    assert {p.name for p in EXAMPLES} >= {
        "01_hello_pingpong.py",
        "03_item_kills_overlap_broken.py",
        "04_item_kills_overlap_fixed.py",
        "05_engine_integration.py",
        "07_routed_dispatch_two_ranks.py",
    }


def test_reference_covers_every_public_name() -> None:
    """docs/reference.md has a ``### `module.name` `` entry for every name in the ``__all__`` of
    every module it documents, and it documents at least the modules users import."""
    import importlib

    text = (ROOT / "docs" / "reference.md").read_text()
    modules = re.findall(r"^## (asyncdbo[\w.]*)$", text, re.MULTILINE)
    assert set(modules) >= {"asyncdbo", "asyncdbo.plan", "asyncdbo.moe", "asyncdbo.observe", "asyncdbo.serving", "asyncdbo.sim"}
    missing = [
        f"{m}.{name}"
        for m in modules
        for name in getattr(importlib.import_module(m), "__all__", ())
        if f"### `{m}.{name}`" not in text
    ]
    assert missing == [], "regenerate it: python docs/make_reference.py"


def test_reference_is_what_the_generator_writes_now() -> None:
    """docs/reference.md is generated, never edited by hand: it matches the code as it is."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        from make_reference import generate_reference
    finally:
        sys.path.remove(str(ROOT / "docs"))
    assert (ROOT / "docs" / "reference.md").read_text() == generate_reference(), (
        "docs/reference.md is stale: regenerate it with python docs/make_reference.py"
    )


#: Tutorial blocks that run as examples (they start their own processes): the block must be the
#: example's code from its first line to the ``if __name__ == "__main__":`` part, plus the call.
RUN_AS_EXAMPLES = {"07_routed_dispatch_two_ranks.py": "P, L, D = 2, 2, 16"}


@pytest.mark.parametrize("example", sorted(RUN_AS_EXAMPLES))
def test_a_tutorial_block_that_runs_as_an_example_is_its_code(example: str) -> None:
    blocks = [code for _, code, skip in python_blocks((ROOT / "docs" / "tutorial.md").read_text())
              if skip == f"two processes; runs as examples/{example}"]
    assert len(blocks) == 1, f"docs/tutorial.md has no block marked as running as examples/{example}"
    source = (ROOT / "examples" / example).read_text()
    body = source[source.index(RUN_AS_EXAMPLES[example]) : source.index('\n\nif __name__ == "__main__":')]
    assert blocks[0].startswith(body + "\n\n\nprint(run_ranks(on_rank, 2))")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_doc_code_blocks_run(page: Path) -> None:
    import torch.distributed as dist

    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    try:
        for line, code, skip in python_blocks(page.read_text()):
            if skip is not None:
                continue
            compiled = compile(code, f"{page.relative_to(ROOT)}:{line}", "exec")
            exec(compiled, namespace)  # noqa: S102 - running our own docs is the point
    finally:
        if dist.is_available() and dist.is_initialized():  # a page that failed half-way
            dist.destroy_process_group()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(example: Path) -> None:
    env = dict(os.environ, PYTHONWARNINGS="error::RuntimeWarning")
    proc = subprocess.run(
        [sys.executable, str(example)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=140, check=False
    )
    assert proc.returncode == 0, f"{example.name} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
