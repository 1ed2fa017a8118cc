"""The docs agree with the code (issue 52 item 4): every path of this repository they name exists,
and the kernel's invariants are stated once, in ``asyncdbo/_core/kernel.py``; design.md links
there and summarizes as many as the kernel has; each invariant names the test that specifies it (issue 52
item 2), and that test exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
_PATH = re.compile(r"(?<![\w/.-])((?:asyncdbo|tests|benchmarks|examples|docs|\.ci)/[\w./-]*\w)")
#: paths of other repositories that look like this one's (vLLM's design docs)
OUTSIDE = {"docs/design/cuda_graphs.md"}


def _exists(path: str) -> bool:
    """The path, or a file it is the start of (``benchmarks/results/run_setup_`` names a family)."""
    full = ROOT / path
    return full.exists() or any(p.name.startswith(full.name) for p in full.parent.glob("*")) if full.parent.is_dir() else False


def test_every_path_the_docs_name_exists() -> None:
    missing = [
        f"{doc.relative_to(ROOT)}:{n}: {m.group(1)}"
        for doc in DOCS
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        for m in _PATH.finditer(line)
        if m.group(1) not in OUTSIDE and "*" not in m.group(1) and not _exists(m.group(1).rstrip("."))
    ]
    assert missing == [], "\n".join(missing)


def _kernel_invariant_texts() -> dict[int, str]:
    doc = (ROOT / "asyncdbo" / "_core" / "kernel.py").read_text().split('"""')[1]
    section = doc.split("Invariants", 1)[1].split("\n\n", 1)[1].split("\n\n", 1)[0]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^(\d+)\. (.*?)(?=^\d+\. |\Z)", section, re.M | re.S)}


def _kernel_invariants() -> list[int]:
    return list(_kernel_invariant_texts())


def test_each_kernel_invariant_names_its_test_and_the_test_exists() -> None:
    texts = _kernel_invariant_texts()
    assert len(texts) >= 10, texts
    unnamed, missing = [], []
    for n, text in texts.items():
        m = re.search(r"Test: ``(tests/[\w/]+\.py)::(test_\w+)``\.", text)
        if m is None:
            unnamed.append(n)
        elif not re.search(rf"^(async )?def {m.group(2)}\(", (ROOT / m.group(1)).read_text(), re.M):
            missing.append(f"{n}: {m.group(1)}::{m.group(2)}")
    assert (unnamed, missing) == ([], [])


def test_the_kernel_states_its_invariants_once_and_design_md_follows_it() -> None:
    numbers = _kernel_invariants()
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 10, numbers
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## The kernel and its invariants", 1)[1].split("\n## ", 1)[0]
    assert "asyncdbo/_core/kernel.py" in section
    assert not re.search(r"^\d+\. \*\*", section, re.MULTILINE), "design.md restates the invariants: link to kernel.py"
    summary = section.split("In short: ", 1)[1].split(". `tests/docs", 1)[0]
    assert len(re.split(r";\s+", summary)) == len(numbers), summary
