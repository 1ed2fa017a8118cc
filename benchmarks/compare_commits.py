"""Switch cost of asyncdbo at an earlier commit against the working tree, side by side in one run.

A change to the kernel or the primitives must not slow the switch down: this measures
``await dbo_yield()`` through the public ``run_ubatches`` (host backend, uvloop) for the package
as it was at ``--base`` and as it is now, interleaved round by round in one process, so that machine
noise hits both alike. The base is exported with ``git archive`` into a temporary folder and
renamed ``asyncdbo_base`` (its own imports are relative; the few absolute ``asyncdbo.`` strings it
has are rewritten too).

    python benchmarks/compare_commits.py --base 20e61dd            # prints, writes benchmarks/results/
    python benchmarks/compare_commits.py --base HEAD~3 --quick     # seconds, prints only
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from _results import publish_results, results_preamble

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


def build_rev(rev: str, into: Path) -> bool:
    """The whole tree at ``rev`` in ``into`` (``git archive``), its C extensions built in place
    from its own sources (``setup.py build_ext --inplace``); whether they built (False without a
    compiler: that copy then runs pure Python)."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    made = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=into,
                          capture_output=True, check=False)
    return made.returncode == 0


def export_base(rev: str, into: Path, name: str = "asyncdbo_base", built: tuple[Path, ...] = (),
                built_in: Path = ROOT / "asyncdbo") -> ModuleType:
    """The package at ``rev`` as an importable ``name``. Its Python files only: a C extension of
    that revision is not built, so the package runs its pure-Python paths, unless ``built`` names
    built extension files under ``built_in`` to copy in: this checkout's (do that only where their
    sources are the same at ``rev``), or ones built from ``rev``'s own sources."""
    archive = subprocess.run(["git", "archive", rev, "asyncdbo"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    pkg = into / "asyncdbo"
    for path in built:
        shutil.copy2(path, pkg / path.relative_to(built_in))
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        new = re.sub(r"\basyncdbo\.", f"{name}.", text)
        if new != text:
            path.write_text(new)
    pkg.rename(into / name)
    sys.path.insert(0, str(into))
    return importlib.import_module(name)


def chain(depth: int, leaf: Callable[[int], Any]) -> Callable[[int], Any]:
    if depth == 1:
        return leaf
    inner = chain(depth - 1, leaf)

    async def level(i: int) -> None:
        await inner(i)

    return level


def one_run(pkg: ModuleType, N: int, K: int, depth: int) -> float:
    """ns per switch of one run of N ubatches making K yields each at the bottom of a chain of
    ``depth`` async frames, timed around ``run_ubatches`` (its per-run set-up included)."""
    dbo_yield, run_ubatches = pkg.dbo_yield, pkg.run_ubatches

    async def leaf(i: int) -> None:
        for _ in range(K):
            await dbo_yield("bench")

    fn = chain(depth, leaf)

    async def main() -> float:
        t0 = time.perf_counter()
        await run_ubatches(fn, [(i,) for i in range(N)], backend="host")
        return time.perf_counter() - t0

    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main()) / (N * K) * 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision to compare against (e.g. a commit before a change)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round, print only")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--switches", type=int, default=100_000, help="switches per run")
    parser.add_argument("--out", type=Path, default=None)
    import _progress

    _progress.add_quiet_flag(parser)
    args = parser.parse_args(argv)
    rounds, switches = (1, 2_000) if args.quick else (args.rounds, args.switches)
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "asyncdbo"], cwd=ROOT, capture_output=True, text=True).stdout)
    import asyncdbo
    import asyncdbo.dbo.primitives

    with tempfile.TemporaryDirectory() as tmp:
        # the base with its own C extensions, built from its own sources (the working tree runs its
        # built ones): comparing a C path against a pure-Python one would measure the extensions
        src = Path(tmp) / "src"
        src.mkdir()
        built = tuple((src / "asyncdbo").rglob("*.so")) if build_rev(rev, src) else ()
        base = export_base(rev, Path(tmp), built=built, built_in=src / "asyncdbo")
        c_paths = {"base": bool(built), "now": asyncdbo.dbo.primitives.FAST is not None}
        pkgs = {f"base {rev}": base, f"now {head}{'+changes' if dirty else ''}": asyncdbo}
        command = f"python benchmarks/compare_commits.py --base {args.base}{' --quick' if args.quick else ''}"
        lines, info = results_preamble(f"Switch cost: {rev} vs the working tree, same run", command)
        lines.append(f"ns per switch through `run_ubatches` (host backend, uvloop), {switches} switches per run, "
                     f"medians of {rounds} interleaved rounds [min..max]. C extensions built: base "
                     f"{c_paths['base']}, now {c_paths['now']}.\n")
        lines.append("| N | depth | " + " | ".join(pkgs) + " | now / base |")
        lines.append("|---:|---:|" + "---:|" * (len(pkgs) + 1))
        _progress.start(args.quiet, "cells (N x depth), both packages each", 1 if args.quick else 9)
        for depth in (2, 8, 16) if not args.quick else (2,):
            for N in (2, 4, 8) if not args.quick else (2,):
                _progress.step(f"N={N} depth={depth}")
                K = max(1, switches // N)
                for pkg in pkgs.values():  # warm-up
                    one_run(pkg, N, 2, depth)
                samples: dict[str, list[float]] = {name: [] for name in pkgs}
                for _ in range(rounds):
                    for name, pkg in pkgs.items():
                        samples[name].append(one_run(pkg, N, K, depth))
                med = {k: statistics.median(v) for k, v in samples.items()}
                cells = [f"{med[k]:.0f} [{min(v):.0f}..{max(v):.0f}]" for k, v in samples.items()]
                names = list(pkgs)
                lines.append(f"| {N} | {depth} | " + " | ".join(cells) + f" | {med[names[1]] / med[names[0]]:.3f} |")
    _progress.done()
    publish_results("\n".join(lines) + "\n", args.out if args.out is not None else (None if args.quick else RESULTS),
                    "compare_commits", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
