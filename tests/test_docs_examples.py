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

ROOT = Path(__file__).resolve().parent.parent
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
    }


# ---------------------------------------------------------------- the API reference
# docs/reference.md is generated from the code: `python tests/test_docs_examples.py --write-reference`.
MODULES: list[tuple[str, str]] = [
    ("asyncdbo", "The top-level API: run ubatches, the DBO primitives, errors, backends."),
    ("asyncdbo.streams", "Stream backends and links."),
    ("asyncdbo.streams.host", "The CPU backend."),
    ("asyncdbo.streams.accelerator", "CUDA / NPU / XPU backend."),
    ("asyncdbo.streams.sim", "The simulated-device backend."),
    ("asyncdbo.plan", "Planning a step: thresholds, DP vote, splits, metadata, records."),
    ("asyncdbo.comm", "Expert-parallel all-to-all through the stream backend."),
    ("asyncdbo.moe", "The reference MoE layer."),
    ("asyncdbo.models", "A small DeepSeek-like model and its paged attention."),
    ("asyncdbo.models.hf", "Hugging Face MoE architectures under DBO."),
    ("asyncdbo.models.hf.checkpoint", "Local checkpoint loading."),
    ("asyncdbo.models.hf.generate", "Greedy generation and parity with transformers."),
    ("asyncdbo.runner", "Plan, run, merge: the overlapped step runner."),
    ("asyncdbo.trace", "Spans, numbers and trace export."),
    ("asyncdbo.sim", "The simulated device: specs, cost model, checks."),
    ("asyncdbo.checks", "The yield-discipline checker."),
    ("asyncdbo.debug", "Stack dumps of live runs."),
    ("asyncdbo.testing", "Test helpers."),
    ("asyncdbo.launch", "Local multi-process groups for tests and demos."),
    ("asyncdbo._core", "Scheduler internals that backends and tools use."),
]


def _first_para(obj: object) -> str:
    import inspect

    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _sig(name: str, obj: object) -> str:
    import inspect

    try:
        s = re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(obj)))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return name
    return f"{name}{s[:157] + '...)' if len(s) > 160 else s}"


def generate_reference() -> str:
    """Every name in each module's ``__all__``: signature, first docstring paragraph, and for
    classes their public methods and properties."""
    import importlib
    import inspect

    out = [
        "# API reference",
        "",
        "Every public name, with its signature and the first paragraph of its docstring (generated from the",
        "code with `inspect` by `python tests/test_docs_examples.py --write-reference`; the docstrings hold",
        "the rest). `tests/test_docs_examples.py` checks that every name in each module's `__all__` appears here.",
        "",
        "Modules: " + ", ".join(f"[`{m}`](#{m.replace('.', '')})" for m, _ in MODULES) + ".",
        "",
    ]
    for modname, blurb in MODULES:
        mod = importlib.import_module(modname)
        out += [f"## {modname}", "", f"{blurb} {_first_para(mod)}", ""]
        for n in getattr(mod, "__all__", ()):
            obj = getattr(mod, n)
            if inspect.isclass(obj):
                kind, header = "class", _sig(n, obj)
            elif callable(obj):
                kind = "async function" if inspect.iscoroutinefunction(obj) else "function"
                header = _sig(n, obj)
            else:
                r = re.sub(r" at 0x[0-9a-f]+", "", repr(obj))  # no memory addresses in the docs
                kind, header = "constant", n + (" = " + r if len(r) < 80 else "")
            out += [f"### `{modname}.{n}`", "", f"{kind}: `{header}`", ""]
            para = _first_para(obj) if kind != "constant" else ""
            if para:
                out += [para, ""]
            if inspect.isclass(obj):
                members = []
                for mn, mv in vars(obj).items():
                    if mn.startswith("_") or not (callable(mv) or isinstance(mv, (property, classmethod, staticmethod))):
                        continue
                    f = mv.fget if isinstance(mv, property) else getattr(mv, "__func__", mv)
                    d = _first_para(f)
                    label = mn if isinstance(mv, property) else _sig(mn, f)
                    members.append(f"- `{label}`" + (f": {d}" if d else ""))
                if members:
                    out += [*members, ""]
    return "\n".join(out) + "\n"


def test_reference_covers_every_public_name() -> None:
    """docs/reference.md has a ``### `module.name` `` entry for every name in the ``__all__`` of
    every module it documents, and it documents at least the modules users import."""
    import importlib

    text = (ROOT / "docs" / "reference.md").read_text()
    modules = re.findall(r"^## (asyncdbo[\w.]*)$", text, re.MULTILINE)
    assert set(modules) >= {"asyncdbo", "asyncdbo.plan", "asyncdbo.moe", "asyncdbo.trace", "asyncdbo.runner", "asyncdbo.sim"}
    missing = [
        f"{m}.{name}"
        for m in modules
        for name in getattr(importlib.import_module(m), "__all__", ())
        if f"### `{m}.{name}`" not in text
    ]
    assert missing == [], "regenerate it: python tests/test_docs_examples.py --write-reference"


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


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-reference"]:
        raise SystemExit("usage: python tests/test_docs_examples.py --write-reference")
    (ROOT / "docs" / "reference.md").write_text(generate_reference())
