"""The fixed cost of one ``run_ubatches`` call, and where it goes.

A run whose ubatches yield once each costs almost nothing but its set-up and tear-down, so its CPU
time per call is the fixed cost a short decode step pays on top of its switches. Measured here:

* ``run_ubatches`` end to end (host backend, uvloop), N = 2, 4, 8, each ubatch yielding once;
* the same run taken apart into the phases ``asyncdbo.dbo.run._run`` goes through (options and
  coroutines, backend, kernel run, DBO state, attach, drive, detach), each timed on its own;
* the floor: a bare trampoline's set-up (one ``copy_context`` per coroutine, a ``send`` loop).

CPU time (``time.process_time_ns``) over ``--calls`` calls, the minimum of ``--rounds`` rounds
(the machine is shared: the minimum is the cost without interference). The phases are read with
eight clock reads per call (each a system call), so their sum exceeds the end-to-end time.
"""

from __future__ import annotations

import argparse
import contextvars
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results"

import uvloop  # noqa: E402

from asyncdbo import dbo_yield, run_ubatches  # noqa: E402
from asyncdbo._core import kernel  # noqa: E402
from asyncdbo.backends import get_backend  # noqa: E402
from asyncdbo.dbo.hooks import on_exit, run_pending_hook  # noqa: E402
from asyncdbo.dbo.state import Lane, RunState  # noqa: E402

run_mod = sys.modules["asyncdbo.dbo.run"]  # the module (asyncdbo.dbo.run is the function)

PHASES = ("options + coroutines", "backend", "kernel run (DBORun)", "DBO state (lanes)", "attach",
          "drive (incl. N switches)", "detach")


async def forward(i: int) -> int:
    await dbo_yield("y")
    return i


async def end_to_end(n: int, calls: int) -> float:
    args = [(i,) for i in range(n)]
    t0 = time.process_time_ns()
    for _ in range(calls):
        await run_ubatches(forward, args, backend="host")
    return (time.process_time_ns() - t0) / calls / 1e3


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
        dbo = kernel.DBORun(coros, install=backend.install_stream, before_park=run_pending_hook, at_exit=on_exit,
                            instrument=run_mod._instrument(opts), watchdog_s=opts.watchdog_s, clock=opts.clock,
                            loop_poll_s=opts.loop_poll_s, name=opts.name)
        t3 = now()
        state = RunState(backend=backend, policy=opts.stream_policy, lanes=[Lane(ub) for ub in dbo.ubatches])
        dbo.ext = state
        for ub, lane in zip(dbo.ubatches, state.lanes):
            ub.ext = lane
        t4 = now()
        backend.attach(dbo, state)
        t5 = now()
        await dbo.drive()
        t6 = now()
        backend.detach(dbo, state)
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


def best(fn: Callable[[], Any], rounds: int) -> Any:
    results = [uvloop.run(fn()) for _ in range(rounds)]
    if isinstance(results[0], dict):
        return {k: min(r[k] for r in results) for k in results[0]}
    return min(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the report here (e.g. benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="100 calls, 1 round: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.rounds = 100, 1
    from _results import publish_results, results_preamble

    lines, info = results_preamble("Fixed cost of a run: run_ubatches end to end and by phase",
                                   f"python benchmarks/run_setup.py --calls {args.calls} --rounds {args.rounds}")
    lines += [
        f"CPU time per run_ubatches call, µs, host backend, uvloop, each ubatch yields once; minimum of {args.rounds} "
        f"rounds of {args.calls} calls (after 200 warm-up calls); C kernel loop "
        f"{'on' if kernel._spin is not None else 'off'}.",
        "",
        "| N | run_ubatches | sum of phases | " + " | ".join(PHASES) + " | bare trampoline set-up |",
        "|---:|---:|---:|" + "---:|" * len(PHASES) + "---:|",
    ]
    for n in (2, 4, 8):
        uvloop.run(end_to_end(n, 200))
        total = best(lambda n=n: end_to_end(n, args.calls), args.rounds)
        phases = best(lambda n=n: by_phase(n, args.calls), args.rounds)
        floor = best(lambda n=n: trampoline(n, args.calls), args.rounds)
        lines.append(f"| {n} | {total:.1f} | {sum(phases.values()):.1f} | "
                     + " | ".join(f"{phases[p]:.1f}" for p in PHASES) + f" | {floor:.1f} |")
        print(f"N={n} done", file=sys.stderr)
    publish_results("\n".join(lines) + "\n", args.out, "run_setup", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
