"""Instructions per run, counted by valgrind: a measure of a run's host cost that the machine's
load does not move.

On a shared 2-core machine CPU time per call moves by a few percent from round to round, so a
change of 1-3% to a run's fixed cost needs many interleaved rounds to show (benchmarks/run_setup.py
does that). The number of instructions the interpreter executes per call does not depend on the
load: ``valgrind --tool=callgrind`` counts them (``Ir``). Each cell is run twice in a fresh
process with ``PYTHONHASHSEED=0``, with ``calls`` and ``3 * calls`` calls, and the difference over
``2 * calls`` is the count per call: start-up and imports cancel out. Instructions are not time
(a cache miss costs more than an add), so this complements the CPU-time tables, it does not
replace them.

Cells (host backend, uvloop, N ubatches):

* ``run_ubatches`` and a prepared run (``prepare_run(backend="host")``) whose ubatches each await
  one ``dbo_yield``: the fixed cost of a run;
* ``ht step``: benchmarks/host_overhead.py's 61-layer ``ht`` sequence of primitives per ubatch
  through ``run_ubatches``: a decode step's host work without comm or tensors.

``--base REV`` also counts the package as it was at ``REV`` (``git archive``, its C extensions
built from its own sources; a revision without ``prepare_run`` gets no prepared cells).

    python benchmarks/instructions.py --base c7e9c2d --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

#: (cell label, kind, N, calls): the run kinds the child program knows
CELLS = (
    ("run_ubatches, N=2", "run_ubatches", 2, 1000),
    ("run_ubatches, N=8", "run_ubatches", 8, 1000),
    ("prepared run, N=2", "prepared", 2, 1000),
    ("prepared run, N=8", "prepared", 8, 1000),
    ("ht step (61 layers), N=2", "ht", 2, 20),
)

CHILD = """
import asyncio, sys
import uvloop
import asyncdbo
kind, n, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if kind == "ht":
    sys.path.insert(0, sys.argv[4])
    from host_overhead import make_forward
    fwd = make_forward(asyncdbo, 61)
else:
    async def fwd(i):
        await asyncdbo.dbo_yield("y")
        return i
args = [(i,) for i in range(n)]
if kind == "prepared":
    prepared = asyncdbo.prepare_run(backend="host")
    call = lambda: prepared.run_ubatches(fwd, args)
else:
    call = lambda: asyncdbo.run_ubatches(fwd, args, backend="host")
async def main():
    for _ in range(calls):
        await call()
uvloop.run(main())
"""


def instructions(pkg_root: Path, kind: str, n: int, calls: int) -> int:
    """valgrind's instruction count (Ir) of the child program, the package imported from ``pkg_root``."""
    env = {**os.environ, "PYTHONPATH": str(pkg_root), "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c", CHILD,
                               kind, str(n), str(calls), str(HERE)], cwd=tmp, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the {kind} N={n} child failed under valgrind (exit {done.returncode}):\n{done.stderr[-2000:]}")
        for line in out.read_text().splitlines():
            if line.startswith("summary:") or line.startswith("totals:"):
                return int(line.split()[1])
    raise RuntimeError(f"no instruction total in valgrind's output for {kind} N={n}")


def per_call(pkg_root: Path, kind: str, n: int, calls: int) -> float:
    return (instructions(pkg_root, kind, n, 3 * calls) - instructions(pkg_root, kind, n, calls)) / (2 * calls)


def export(rev: str, into: Path) -> tuple[Path, str]:
    """The package at ``rev`` in ``into``, its C extensions built from its own sources."""
    from compare_commits import build_rev

    return into, "C extensions built from its sources" if build_rev(rev, into) else "pure Python (its C did not build)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", action="append", default=[], help="also count the package at this git revision")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("benchmarks/instructions.py needs valgrind (e.g. `apt-get install valgrind`); none is on PATH",
              file=sys.stderr)
        return 2
    from _results import publish_results, results_preamble

    command = "python benchmarks/instructions.py" + "".join(f" --base {b}" for b in args.base)
    lines, info = results_preamble("Instructions per run (valgrind callgrind Ir)", command)
    with tempfile.TemporaryDirectory() as tmp:
        roots: dict[str, Path] = {}
        notes = []
        for k, rev in enumerate(args.base):
            short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                                   check=True).stdout.strip()
            into = Path(tmp) / f"base{k}"
            into.mkdir()
            roots[short], how = export(rev, into)
            notes.append(f"{short}: {how}")
        roots["working tree"] = ROOT
        has_prepared = {name: (root / "asyncdbo" / "dbo" / "prepared.py").exists() for name, root in roots.items()}
        table = {label: {name: per_call(root, kind, n, calls) if kind != "prepared" or has_prepared[name] else None
                         for name, root in roots.items()} for label, kind, n, calls in CELLS}
    names = list(roots)
    lines.append(f"Packages: {'; '.join(notes + ['working tree: this checkout, its built C extensions'])}.\n")
    calls = ", ".join(f"{label} {n}" for label, _, _, n in CELLS)
    lines.append(f"Instructions per call, (Ir(3 x calls) - Ir(calls)) / (2 x calls), calls: {calls}; "
                 "host backend, uvloop, each ubatch awaiting one dbo_yield (ht step: the 61-layer ht sequence). "
                 "Ratios: the working tree over each base.\n\n")
    ratio_heads = [f"now / {name}" for name in names[:-1]]
    lines.append("| cell | " + " | ".join(names) + (" | " + " | ".join(ratio_heads) if ratio_heads else "") + " |\n")
    lines.append("|---|" + "---:|" * (len(names) + len(ratio_heads)) + "\n")
    for label, row in table.items():
        now = row["working tree"]
        cells = [f"{v:,.0f}" if v is not None else "n/a" for v in row.values()]
        ratios = [f"{now / row[name]:.3f}" if now is not None and row[name] else "n/a" for name in names[:-1]]
        lines.append(f"| {label} | " + " | ".join(cells + ratios) + " |\n")
    publish_results("".join(lines), args.out, "instructions", info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
