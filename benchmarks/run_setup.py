"""The fixed cost of one ``run_ubatches`` call, and where it goes.

A run whose ubatches yield once each costs almost nothing but its set-up and tear-down, so its CPU
time per call is the fixed cost a short decode step pays on top of its switches. Measured here:

* ``run_ubatches`` end to end (host backend, uvloop), N = 2, 4, 8, each ubatch yielding once;
* the same run through a prepared run (``prepare_run(backend="host")`` once, then its
  ``run_ubatches``: options and backend settled once, run shells of its own);
* a serving loop's runs, DBORunner's call before and after it held a prepared run;
* the same run taken apart into the phases ``asyncdbo.dbo.run._run`` goes through (options and
  coroutines, backend, taking a run shell, attach, drive, detach, giving the shell back), each
  timed on its own;
* a prepared run's own mechanics alone: its run shell driven by hand with every check, every
  piece of bookkeeping and every promise left out (no cancel accounting, no registry of live runs,
  no task-factory check, no reuse check of the shell, no error handling): what a run costs before
  any of what ``run_ubatches`` guarantees (C kernel loop only);
* the floor: a bare trampoline's set-up (one ``copy_context`` per coroutine, a ``send`` loop).

CPU time (``time.process_time_ns``) over ``--calls`` calls, the minimum of ``--rounds`` rounds
(the machine is shared: the minimum is the cost without interference). The phases are read with
eight clock reads per call (each a system call), so their sum exceeds the end-to-end time.

``--base REV`` also measures the package as it was at ``REV`` (exported with ``git archive``, as
benchmarks/compare_commits.py does, with this checkout's built C extensions copied in when the C
sources did not change since), end to end, interleaved round by round with the working tree in
one process: medians, min..max, and the ratio of the medians.

    python benchmarks/run_setup.py --base c058287 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results"

import uvloop  # noqa: E402

from asyncdbo import dbo_yield, prepare_run, run_ubatches, run_ubatches_with_stats  # noqa: E402
from asyncdbo._core import fastpath, kernel  # noqa: E402
from asyncdbo.backends import get_backend  # noqa: E402
from asyncdbo.dbo import shell  # noqa: E402

run_mod = sys.modules["asyncdbo.dbo.run"]  # the module (asyncdbo.dbo.run is the function)

PREPARED = "prepared"
PHASES = ("options + coroutines", "backend", "take a run shell", "attach", "drive (incl. N switches)", "detach",
          "give the shell back")


async def forward(i: int) -> int:
    await dbo_yield("y")
    return i


_PREPARED_RUNS: dict[tuple[tuple[str, Any], ...], Any] = {}


def _prepared(**options: Any) -> Any:
    """One prepared run per set of options, kept across rounds and event loops as a server keeps
    its own: every round measures its steady state, as the process's shells are for run_ubatches."""
    key = tuple(options.items())
    if key not in _PREPARED_RUNS:
        _PREPARED_RUNS[key] = prepare_run(**options)
    return _PREPARED_RUNS[key]


async def end_to_end(n: int, calls: int, pkg: ModuleType | str | None = None) -> float:
    """CPU µs per ``run_ubatches`` call of ``pkg`` (None: the working tree's asyncdbo; ``PREPARED``:
    the ``run_ubatches`` of its one ``prepare_run(backend="host")``, options and backend settled once)."""
    if pkg == PREPARED:
        prepared = _prepared(backend="host")
        args = [(i,) for i in range(n)]
        t0 = time.process_time_ns()
        for _ in range(calls):
            await prepared.run_ubatches(forward, args)
        return (time.process_time_ns() - t0) / calls / 1e3
    assert not isinstance(pkg, str), pkg
    run, fwd = (run_ubatches, forward) if pkg is None else (pkg.run_ubatches, _forward_of(pkg))
    args = [(i,) for i in range(n)]
    t0 = time.process_time_ns()
    for _ in range(calls):
        await run(fwd, args, backend="host")
    return (time.process_time_ns() - t0) / calls / 1e3


def _forward_of(pkg: ModuleType) -> Callable[[int], Any]:
    yield_ = pkg.dbo_yield

    async def fwd(i: int) -> int:
        await yield_("y")
        return i

    return fwd


C_SOURCES = ("asyncdbo/_core/_spin.c", "asyncdbo/dbo/_speedups.c", "asyncdbo/_native")


def export_base(rev: str, into: Path) -> tuple[ModuleType, str]:
    """The package at ``rev`` (compare_commits.export_base) with its C extensions: this checkout's
    built ones copied in when their sources are the same at ``rev``, else built from ``rev``'s own
    sources (``setup.py build_ext`` in a copy of that revision); without a compiler it runs pure
    Python. Returns the package and a line saying which."""
    from compare_commits import ROOT, build_rev
    from compare_commits import export_base as export

    same = subprocess.run(["git", "diff", "--quiet", rev, "--", *C_SOURCES], cwd=ROOT, check=False).returncode == 0
    built_in, built = ROOT / "asyncdbo", tuple(ROOT.joinpath("asyncdbo").rglob("_*.so")) if same else ()
    if not same:
        src = into / "src"
        src.mkdir()
        built_in, built = src / "asyncdbo", tuple(src.joinpath("asyncdbo").rglob("_*.so")) if build_rev(rev, src) else ()
    pkg = export(rev, into, built=built, built_in=built_in)
    spin = sys.modules["asyncdbo_base._core.kernel"]._spin
    whose = "this checkout's build" if same else f"built from {rev}'s sources"
    return pkg, f"its C kernel loop {f'on ({whose})' if spin is not None else 'off (its C extensions did not build)'}"


async def _warm(n: int, variants: dict[str, Any], measure: Callable[[int, int, Any], Coroutine[Any, Any, float]]) -> None:
    for variant in variants.values():
        await measure(n, 200, variant)


def side_by_side(n: int, variants: dict[str, Any], calls: int, rounds: int,
                 measure: Callable[[int, int, Any], Coroutine[Any, Any, float]] = end_to_end) -> dict[str, list[float]]:
    """``measure(n, calls, variant)`` of each variant (by default a package, :func:`end_to_end`),
    after 200 warm-up calls each: each round measures every variant once (in turn), so machine
    noise hits them alike."""
    uvloop.run(_warm(n, variants, measure))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, variant in variants.items():
            samples[name].append(uvloop.run(measure(n, calls, variant)))
    return samples


def medians_and_cells(samples: dict[str, list[float]]) -> tuple[dict[str, float], list[str]]:
    """Each variant's median, and its table cell: ``median [min..max]``."""
    med = {k: statistics.median(v) for k, v in samples.items()}
    return med, [f"{med[k]:.1f} [{min(v):.1f}..{max(v):.1f}]" for k, v in samples.items()]


async def serving_pattern(n: int, calls: int, prepared: bool) -> float:
    """CPU µs per step of a serving loop's run as DBORunner made it before it held a prepared
    run (``run_ubatches_with_stats`` with the runner's options, ``name=f"step{k}"`` and
    ``instrument=[]``: new options every step) or makes it now (its prepared run's
    ``run_ubatches_with_stats``, the step's name and no instrument)."""
    backend = get_backend("host")
    runs = _prepared(backend=backend, stream_policy="role", watchdog_s=60.0)
    args = [(i,) for i in range(n)]
    t0 = time.process_time_ns()
    if prepared:
        for k in range(calls):
            await runs.run_ubatches_with_stats(forward, args, name=f"step{k}", instrument=None)
    else:
        for k in range(calls):
            await run_ubatches_with_stats(forward, args, backend=backend, stream_policy="role", watchdog_s=60.0,
                                          instrument=[], name=f"step{k}")
    return (time.process_time_ns() - t0) / calls / 1e3


def serving_table(args: argparse.Namespace) -> list[str]:
    lines = [
        "## A serving loop's runs: per-step options, or a prepared run\n",
        f"CPU µs per step's run (host backend, uvloop, each ubatch yields once), medians of {args.rounds} interleaved "
        f"rounds of {args.calls} calls [min..max] (after 200 warm-up calls each): `run_ubatches_with_stats(..., backend, stream_policy, watchdog_s, "
        "instrument=[], name=f\"step{k}\")` (DBORunner's call before it held a prepared run: new options every "
        "step) against `prepared.run_ubatches_with_stats(..., name=f\"step{k}\", instrument=None)` (its call now).\n",
        "| N | per-step options | prepared run | prepared / per-step |",
        "|---:|---:|---:|---:|",
    ]
    for n in (2, 4, 8):
        samples = side_by_side(n, {"per-step": False, "prepared": True}, args.calls, args.rounds, serving_pattern)
        med, cells = medians_and_cells(samples)
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {med['prepared'] / med['per-step']:.2f} |")
        print(f"N={n} serving pattern done", file=sys.stderr)
    return [*lines, ""]


async def by_phase(n: int, calls: int) -> dict[str, float]:
    """``run_mod._run``'s steps one by one (keep in step with asyncdbo/dbo/run.py)."""
    args = [(i,) for i in range(n)]
    spent = dict.fromkeys(PHASES, 0)
    now = time.process_time_ns
    for _ in range(calls):
        t0 = now()
        opts = run_mod._options({"backend": "host"})
        coros = run_mod._make_coros(forward, args)
        t1 = now()
        backend = get_backend(opts.backend)
        t2 = now()
        held = shell.take(coros, backend, opts, None, None, opts.name)
        dbo, state = held.run, held.state
        t3 = now()
        backend.attach(dbo, state)
        t4 = now()
        await dbo.drive()
        t5 = now()
        backend.detach(dbo, state)
        t6 = now()
        del dbo, state
        shell.give_back(held)
        t7 = now()
        for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6)):
            spent[phase] += dt
    return {k: v / calls / 1e3 for k, v in spent.items()}


async def trampoline(n: int, calls: int) -> float:
    """The floor: N coroutines in fresh contexts, driven by a ``send`` loop to the end."""
    args = [(i,) for i in range(n)]

    async def leaf(i: int) -> int:
        return i

    t0 = time.process_time_ns()
    for _ in range(calls):
        runs = [(contextvars.copy_context(), leaf(*a)) for a in args]
        for ctx, coro in runs:
            try:
                ctx.run(coro.send, None)
            except StopIteration:
                pass
    return (time.process_time_ns() - t0) / calls / 1e3


async def mechanics(n: int, calls: int) -> float | None:
    """A prepared run's records driven by hand (see the module docstring): the coroutines made, the
    records refilled and the run's counters reset, each record bound to its lane and stream, the
    task view swapped in, the C loop, the records released, the shell back in its pool. None
    without the C kernel loop. Keep in step with DBORun.rerun/drive and asyncdbo.dbo.shell."""
    spin = fastpath.C
    if spin is None:
        return None
    from asyncdbo._core.tasks import UBatchTaskView, set_current_task
    from asyncdbo._core.ubatch import current_ubatch

    prepared = _prepared(backend="host")
    args = [(i,) for i in range(n)]
    await prepared.run_ubatches(forward, args)  # leaves an idle shell of n records in its pool
    idle = prepared._pool[n]
    assert not idle[-1].run.installs  # the host installs no stream: drive's spin arguments are _spin_args[0]
    cpu = prepared.backend._cpu
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    ready_state, done = kernel.READY, kernel.DONE

    async def one() -> list[Any]:
        coros = [forward(*a) for a in args]
        held = idle.pop()
        run = held.run
        ubs = run.ubatches
        spin.start(ubs, run, coros, current_ubatch, ready_state)
        ready = run._ready
        ready.extend(ubs)
        run._released = False
        run._reset()
        for ub, lane in held.pairs:
            ub.ext = lane
            lane.stream = ub.resume_with = cpu
        set_current_task(loop, UBatchTaskView(run, task))
        # the run's own arguments, as drive passes them (built with its records, not per call)
        status = spin.spin(*run._spin_args[0], run, done)[2]
        assert status == fastpath._EMPTY, status  # each ubatch ran to its end in the one call
        set_current_task(loop, task)
        results: list[Any] = spin.release(ubs)
        run._released = True
        for lane in held.state.lanes:
            lane.stream = None
        idle.append(held)
        return results

    assert await one() == list(range(n))  # the run's results, as run_ubatches returns them
    t0 = time.process_time_ns()
    for _ in range(calls):
        await one()
    return (time.process_time_ns() - t0) / calls / 1e3


def best(fn: Callable[[], Any], rounds: int) -> Any:
    results = [uvloop.run(fn()) for _ in range(rounds)]
    if isinstance(results[0], dict):
        return {k: min(r[k] for r in results) for k in results[0]}
    return min(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--base", default=None, help="also measure the package at this git revision, side by side")
    parser.add_argument("--out", type=Path, default=None, help="write the report here (e.g. benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="100 calls, 1 round: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.rounds = 100, 1
    from _results import publish_results, results_preamble

    command = f"python benchmarks/run_setup.py --calls {args.calls} --rounds {args.rounds}"
    lines, info = results_preamble("Fixed cost of a run: run_ubatches end to end and by phase",
                                   command + (f" --base {args.base}" if args.base else ""))
    with tempfile.TemporaryDirectory() as tmp:
        if args.base:
            lines += side_by_side_table(args, Path(tmp))
        lines += serving_table(args)
        lines += phase_table(args)
    publish_results("\n".join(lines) + "\n", args.out, "run_setup", info)
    return 0


def side_by_side_table(args: argparse.Namespace, tmp: Path) -> list[str]:
    from compare_commits import ROOT

    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    base, which = export_base(rev, tmp)
    pkgs: dict[str, ModuleType | str | None] = {f"base {rev}": base, "now": None, "now, prepared": PREPARED}
    lines = [
        f"## Side by side: {rev} and the working tree\n",
        f"CPU µs per run_ubatches call (host backend, uvloop, each ubatch yields once; \"now, prepared\": "
        f"prepare_run(backend=\"host\") once, then its run_ubatches), medians of {args.rounds} "
        f"interleaved rounds of {args.calls} calls [min..max]; the base at {rev} with {which}; now with the C "
        f"kernel loop {'on' if fastpath.C is not None else 'off'}.\n",
        "| N | " + " | ".join(pkgs) + " | now / base | now, prepared / base (medians) |",
        "|---:|" + "---:|" * (len(pkgs) + 2),
    ]
    for n in (2, 4, 8):
        samples = side_by_side(n, pkgs, args.calls, args.rounds)
        med, cells = medians_and_cells(samples)
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {med['now'] / med[f'base {rev}']:.2f} | "
                     f"{med['now, prepared'] / med[f'base {rev}']:.2f} |")
        print(f"N={n} side by side done", file=sys.stderr)
    return [*lines, ""]


def phase_table(args: argparse.Namespace) -> list[str]:
    lines = [
        "## The working tree by phase\n",
        f"CPU time per run_ubatches call, µs, host backend, uvloop, each ubatch yields once; minimum of {args.rounds} "
        f"rounds of {args.calls} calls (after 200 warm-up calls); C kernel loop "
        f"{'on' if fastpath.C is not None else 'off'}.",
        "",
        "| N | run_ubatches | prepared run | sum of phases | " + " | ".join(PHASES)
        + " | a prepared run's mechanics alone | bare trampoline set-up |",
        "|---:|---:|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|",
    ]
    for n in (2, 4, 8):
        uvloop.run(end_to_end(n, 200))
        total = best(lambda n=n: end_to_end(n, args.calls), args.rounds)
        prepared = best(lambda n=n: end_to_end(n, args.calls, PREPARED), args.rounds)
        phases = best(lambda n=n: by_phase(n, args.calls), args.rounds)
        bare = best(lambda n=n: mechanics(n, args.calls), args.rounds) if fastpath.C is not None else None
        floor = best(lambda n=n: trampoline(n, args.calls), args.rounds)
        lines.append(f"| {n} | {total:.1f} | {prepared:.1f} | {sum(phases.values()):.1f} | "
                     + " | ".join(f"{phases[p]:.1f}" for p in PHASES)
                     + f" | {'-' if bare is None else f'{bare:.1f}'} | {floor:.1f} |")
        print(f"N={n} done", file=sys.stderr)
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
