"""How the kernel lets a thread have the GIL while ubatches keep switching: three designs compared.

One ubatch awaits an executor job (``loop.run_in_executor(None, time.sleep, 0.001)``) while the
other keeps switching (``dbo_yield`` in a loop, capped at ``--cap-s`` seconds). The job needs the
GIL to start and to report back; the switching ubatch and the kernel's loop polls hold it.
Designs of the poll (``DBORun._let_the_loop_run``) once the wait is longer than the switch
interval:

* ``blocking sleep 0.1 ms``: ``time.sleep(GIL_HANDOFF_S)`` before the poll (the kernel's design);
* ``loop timer 0.1 ms`` / ``loop timer 1 ms``: the poll is ``await asyncio.sleep(s)`` instead, the
  event loop's own wait, which the job's completion ends early;
* ``none``: the plain poll (``GIL_HANDOFF_S = 0``).

Reported per design and event loop: the job's latency (from the ubatch's await to its wake-up;
1 ms of it is the job's own sleep) and the switching ubatch's switches per millisecond meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results"

from asyncdbo import dbo_yield, run_ubatches  # noqa: E402
from asyncdbo._core import fastpath, kernel, parking  # noqa: E402
import _progress  # noqa: E402

DESIGNS = ("blocking sleep 0.1 ms", "loop timer 0.1 ms", "loop timer 1 ms", "none")


@contextmanager
def design(name: str) -> Iterator[None]:
    """Patch the kernel's poll to ``name`` for the duration."""
    saved_s, saved_poll = parking.GIL_HANDOFF_S, parking.Parking._let_the_loop_run
    if name == "none":
        parking.GIL_HANDOFF_S = 0.0
    elif name.startswith("loop timer"):
        wait_s = 0.001 if name.endswith("1 ms") else 0.0001

        async def timer_poll(self: Any) -> None:
            self._poll_due = False
            wait = 0.0
            if self._loop_waits and kernel._now() - self._loop_wait_since > sys.getswitchinterval():
                wait = wait_s
            self._poll_at = kernel._now() + self.loop_poll_s
            await asyncio.sleep(wait)

        parking.Parking._let_the_loop_run = timer_poll  # type: ignore[method-assign]
    else:
        parking.GIL_HANDOFF_S = 0.0001
    try:
        yield
    finally:
        parking.GIL_HANDOFF_S, parking.Parking._let_the_loop_run = saved_s, saved_poll  # type: ignore[method-assign]


async def one_run(cap_s: float) -> tuple[float, float]:
    """(job latency s, switches per ms of the other ubatch while it waited)."""
    loop = asyncio.get_running_loop()
    woke_at: list[float] = []
    t0 = time.perf_counter()

    async def forward(i: int) -> int:
        if i == 0:
            await loop.run_in_executor(None, time.sleep, 0.001)
            woke_at.append(time.perf_counter())
            return 0
        n = 0
        while not woke_at and time.perf_counter() - t0 < cap_s:
            n += 1
            await dbo_yield("spin")
        return n

    _, n = await run_ubatches(forward, [(0,), (1,)], backend="host")
    latency = woke_at[0] - t0
    return latency, n / (min(latency, cap_s) * 1e3)


def measure(reps: int, cap_s: float) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """Every (loop, design) ``reps`` times, interleaved round by round, so that a change in the
    machine's load falls on every design alike."""
    import uvloop

    loops: dict[str, Callable[[], asyncio.AbstractEventLoop] | None] = {"asyncio": None, "uvloop": uvloop.new_event_loop}
    runners = {(lp, d): asyncio.Runner(loop_factory=f) for lp, f in loops.items() for d in DESIGNS}
    out: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in runners}
    try:
        for rnd in range(reps + 1):  # round 0 warms up (the executor's thread starts)
            _progress.step("warm-up round" if rnd == 0 else f"round {rnd} of {reps}")
            for (lp, d), runner in runners.items():
                with design(d):
                    got = runner.run(one_run(cap_s))
                if rnd:
                    out[(lp, d)].append(got)
    finally:
        for runner in runners.values():
            runner.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--cap-s", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=None, help="write the report here (e.g. benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="1 round, 0.3 s cap: a smoke run")
    _progress.add_quiet_flag(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.cap_s = 1, 0.3
    _progress.start(args.quiet, "rounds (the first a warm-up)", args.reps + 1)
    from _results import publish_results, results_preamble

    lines, info = results_preamble("GIL hand-over while ubatches switch: blocking sleep, loop timer, none",
                                   f"python benchmarks/gil_handoff.py --reps {args.reps} --cap-s {args.cap_s:g}")
    lines += [
        f"Kernel default GIL_HANDOFF_S = {parking.GIL_HANDOFF_S:g} s, switch interval {sys.getswitchinterval():g} s, loop_poll_s "
        f"{kernel.LOOP_POLL_S:g} s, C kernel loop {'on' if fastpath.C is not None else 'off'}; {args.reps} rounds after a "
        f"warm-up round, every row once per round; the switching ubatch stops after {args.cap_s:g} s. Latency includes the job's own 1 ms sleep.",
        "",
        "| loop | design | job latency ms: median | [min..max] | switches per ms meanwhile: median | [min..max] |",
        "|---|---|---:|---|---:|---|",
    ]
    for (loop_name, name), rows in measure(args.reps, args.cap_s).items():
        lat = [r[0] * 1e3 for r in rows]
        rate = [r[1] for r in rows]
        lines.append(
            f"| {loop_name} | {name} | {statistics.median(lat):.2f} | {min(lat):.2f}..{max(lat):.2f} | "
            f"{statistics.median(rate):.0f} | {min(rate):.0f}..{max(rate):.0f} |"
        )
    publish_results("\n".join(lines) + "\n", args.out, "gil_handoff", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
