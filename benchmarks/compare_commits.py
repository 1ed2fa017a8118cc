"""Switch cost of asyncdbo at an earlier commit against the working tree, side by side in one run.

A change to the kernel or the primitives must not slow the switch down: this measures
``await dbo_yield()`` through the public ``run_ubatches`` (host backend, uvloop) for the package
as it was at ``--base`` and as it is now, interleaved round by round in one process, so that machine
noise hits both alike. The base is exported with ``git archive`` into a temporary folder and
renamed ``asyncdbo_base`` (its own imports are relative; the few absolute ``asyncdbo.`` strings it
has are rewritten too).

``--own`` measures instead each package's own cost per yield (issue 46 item 4): CPU ns per yield of a
61-layer step at N = 2 (``--layers``, ``--n``) through ``run_ubatches`` (host backend, set-up
included) minus the same coroutines awaited in turn outside a run with this checkout's primitives
(each a no-op there: the same baseline for every package, as ``host_overhead.py``'s ``no DBO``),
measured right before it in the same round, for two programs: ``yield`` (three ``dbo_yield`` per
layer) and ``ht`` (``host_overhead.py``'s ``ht`` primitive sequence: three yields, four stream
switches, three event records and waits per layer); and per extra yield, the run's set-up left out
(the difference from a 15-layer step in the same round, as ``host_overhead.py``'s marginal cost). ``--base`` may then be given more than once.

    python benchmarks/compare_commits.py --base 20e61dd            # prints, writes benchmarks/results/
    python benchmarks/compare_commits.py --base HEAD~3 --quick     # seconds, prints only
    python benchmarks/compare_commits.py --own --base d7836a9 --base main --rounds 11
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


def own_programs(pkg: ModuleType, layers: int) -> dict[str, Callable[[int], Any]]:
    """The two programs of ``--own`` written with ``pkg``'s primitives."""
    from host_overhead import make_forward

    y = pkg.dbo_yield

    async def yields(i: int) -> int:
        for _ in range(layers):
            await y("a")
            await y("b")
            await y("c")
        return i

    return {"yield": yields, "ht": make_forward(pkg, layers)}


def own_sample(pkg: ModuleType, fn: Callable[[int], Any], base: Callable[[int], Any], N: int, reps: int,
               runner: asyncio.Runner) -> tuple[float, float]:
    """(CPU s per step of ``base`` awaited in turn, CPU s per step of ``fn`` through ``pkg.run_ubatches``),
    measured in that order."""
    args = [(i,) for i in range(N)]

    async def outside() -> float:
        c0 = time.process_time()
        for _ in range(reps):
            for a in args:
                await base(*a)
        return (time.process_time() - c0) / reps

    async def inside() -> float:
        c0 = time.process_time()
        for _ in range(reps):
            await pkg.run_ubatches(fn, args, backend="host")
        return (time.process_time() - c0) / reps

    return runner.run(outside()), runner.run(inside())


#: The short step of ``--own``'s "per extra yield" (host_overhead.py's marginal cost uses 15 and 61 layers too).
SHORT = 15


def own_table(pkgs: dict[str, ModuleType], layers: int, N: int, rounds: int) -> list[str]:
    """``--own``'s rows: per program, each package's own CPU ns per yield at ``layers`` (the run's
    set-up shared among its yields) and per extra yield (the set-up left out: the difference from a
    :data:`SHORT`-layer step measured in the same round, over the yields it adds), medians [min..max]."""
    import uvloop

    sizes = (layers, SHORT)
    reps = {L: max(1, 60_000 // (L * 3 * N)) for L in sizes}
    progs = {(name, L): own_programs(pkg, L) for name, pkg in pkgs.items() for L in sizes}
    import asyncdbo

    bases = {L: own_programs(asyncdbo, L) for L in sizes}  # awaited outside a run: the same baseline for all
    rows = []
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for prog in ("yield", "ht"):
            for (name, L), fns in progs.items():  # warm-up
                own_sample(pkgs[name], fns[prog], bases[L][prog], N, 1, runner)
            per: dict[str, list[float]] = {name: [] for name in pkgs}
            extra: dict[str, list[float]] = {name: [] for name in pkgs}
            for _ in range(rounds):
                for name, pkg in pkgs.items():
                    own = {}
                    for L in sizes:
                        out, run = own_sample(pkg, progs[(name, L)][prog], bases[L][prog], N, reps[L], runner)
                        own[L] = run - out
                    per[name].append(own[layers] / (layers * 3 * N) * 1e9)
                    extra[name].append((own[layers] - own[SHORT]) / ((layers - SHORT) * 3 * N) * 1e9)
            for what, data in (("per yield", per), ("per extra yield", extra)):
                med = {k: statistics.median(v) for k, v in data.items()}
                first = next(iter(med.values()))
                cells = [f"{med[k]:.1f} [{min(v):.1f}..{max(v):.1f}]" for k, v in data.items()]
                ratios = [f"{med[k] / first:.2f}" for k in list(data)[1:]]
                rows.append(f"| {prog} | {what} | {layers} | {N} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, action="append",
                        help="git revision to compare against (e.g. a commit before a change); with --own, repeatable")
    parser.add_argument("--own", action="store_true", help="each package's own CPU cost per yield (module doc)")
    parser.add_argument("--layers", type=int, default=61, help="--own: layers per step (default 61)")
    parser.add_argument("--n", type=int, default=2, help="--own: ubatches (default 2)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round, print only")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--switches", type=int, default=100_000, help="switches per run")
    parser.add_argument("--out", type=Path, default=None)
    import _progress

    _progress.add_quiet_flag(parser)
    args = parser.parse_args(argv)
    rounds, switches = (1, 2_000) if args.quick else (args.rounds, args.switches)
    if args.own:
        return main_own(args, rounds)
    if len(args.base) != 1:
        parser.error("--base once, unless --own")
    args.base = args.base[0]
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


def main_own(args: argparse.Namespace, rounds: int) -> int:
    """``--own``: each base built from its own sources, then the working tree, interleaved."""
    import asyncdbo
    import asyncdbo.dbo.primitives

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    head, dirty = git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "asyncdbo"))
    layers, N = (2, 2) if args.quick else (args.layers, args.n)
    with tempfile.TemporaryDirectory() as tmp:
        pkgs: dict[str, ModuleType] = {}
        built: dict[str, bool] = {}
        for k, base in enumerate(args.base):
            rev = git("rev-parse", "--short", base)
            src = Path(tmp) / f"src{k}"
            src.mkdir()
            so = tuple((src / "asyncdbo").rglob("*.so")) if build_rev(rev, src) else ()
            into = Path(tmp) / f"pkg{k}"
            into.mkdir()
            pkgs[rev] = export_base(rev, into, f"asyncdbo_base{k}", built=so, built_in=src / "asyncdbo")
            built[rev] = bool(so)
        now = f"now {head}{'+changes' if dirty else ''}"
        pkgs[now] = asyncdbo
        built[now] = asyncdbo.dbo.primitives.FAST is not None
        command = "python benchmarks/compare_commits.py --own" + "".join(f" --base {b}" for b in args.base)
        command += f" --rounds {rounds}" + (" --quick" if args.quick else "")
        lines, info = results_preamble("Own cost per yield: " + ", ".join(pkgs) + ", same run", command)
        lines.append(
            f"CPU ns per yield through `run_ubatches` (host backend, uvloop, set-up included) minus the same "
            f"coroutines awaited in turn outside a run with this checkout's primitives (no-ops there), measured right "
            f"before it; {layers} layers x 3 yields x N = "
            f"{N}, medians of {rounds} interleaved rounds [min..max] (~60,000 yields per sample). 'per extra yield': "
            f"the same at {layers} layers less at {SHORT} layers, over the {(layers - SHORT) * 3 * N} yields more (the run's set-up "
            "left out: what a yield costs in a long step). C extensions "
            "built: " + ", ".join(f"{k} {v}" for k, v in built.items()) + ". Ratios: each over the first.\n")
        names = list(pkgs)
        lines.append("| program | ns | layers | N | " + " | ".join(names) + " | "
                     + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
        lines.append("|---|---|---:|---:|" + "---:|" * (2 * len(names) - 1))
        lines += own_table(pkgs, layers, N, rounds)
    publish_results("\n".join(lines) + "\n", args.out if args.out is not None else (None if args.quick else RESULTS),
                    "compare_commits_own", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
