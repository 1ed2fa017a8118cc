"""What the run guard costs a clean run: the store read that ``run_ubatches`` makes before every run
once per-ubatch groups exist (:mod:`asyncdbo.dist.recovery`), and the poll timer it arms.

On 2 gloo ranks of a :class:`asyncdbo.testing.RankPool` (a ``file://`` store, like the tests; a
``torchrun`` job's TCP store is not measured here), each rank times, in alternating blocks:

* ``guard``: the guard's own call (``asyncdbo.dist.recovery._guard``: one ``store.check``);
* ``run, guarded`` and ``run, unguarded``: a run of 2 ubatches with 8 yields each and no comm
  (the guard's cost shows on its own), with the guard registered and with it removed.

Usage::

    python benchmarks/run_guard.py        # ~1 min, writes benchmarks/results/run_guard_<hw>_<date>.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
YIELDS = 8


def _bench_rank(rank: int, world: int, blocks: int, per_block: int) -> dict[str, list[float]]:
    import asyncdbo
    from asyncdbo.dbo import hooks
    from asyncdbo.dist import recovery

    asyncdbo.ubatch_groups(2)  # the guard does nothing until per-ubatch groups exist

    async def ubatch(i: int) -> int:
        for _ in range(YIELDS):
            await asyncdbo.dbo_yield()
        return i

    async def timed_runs(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            await asyncdbo.run_ubatches(ubatch, [(0,), (1,)], backend="host")
        return (time.perf_counter() - t0) / n

    async def main() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"guard": [], "run, guarded": [], "run, unguarded": []}
        guard = hooks.RUN_GUARD[0]
        await timed_runs(per_block)  # warm-up
        for _ in range(blocks):
            t0 = time.perf_counter()
            for _ in range(per_block):
                recovery._guard()
            out["guard"].append((time.perf_counter() - t0) / per_block)
            out["run, guarded"].append(await timed_runs(per_block))
            hooks.RUN_GUARD.clear()
            try:
                out["run, unguarded"].append(await timed_runs(per_block))
            finally:
                hooks.set_run_guard(guard)
        return out

    return asyncdbo.run(main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--per-block", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from _results import publish_results, results_preamble

    from asyncdbo.testing import RankPool

    lines, info = results_preamble("The run guard's cost on a clean run (a store read before every run)",
                                   "python benchmarks/run_guard.py")
    with RankPool(2, timeout_s=600) as pool:
        per_rank = pool.run(_bench_rank, args.blocks, args.per_block)
    lines += [
        f"2 ranks of a RankPool (file:// store), {args.blocks} alternating blocks of {args.per_block} calls or runs "
        f"per rank; runs of 2 ubatches x {YIELDS} yields, host backend, no comm. Microseconds per call or run: "
        "the fastest block (the cost with the CPU to itself; on a shared, loaded machine the medians mostly "
        "measure the other processes) and the median block.",
        "",
        "| rank | guard call (store.check), min / median | run, guarded, min / median | "
        "run, unguarded, min / median | guarded - unguarded, min |",
        "|---:|---:|---:|---:|---:|",
    ]
    for rank, r in enumerate(per_rank):
        med = {k: statistics.median(v) * 1e6 for k, v in r.items()}
        low = {k: min(v) * 1e6 for k, v in r.items()}
        lines.append(
            f"| {rank} | {low['guard']:.1f} / {med['guard']:.1f} | {low['run, guarded']:.1f} / {med['run, guarded']:.1f} | "
            f"{low['run, unguarded']:.1f} / {med['run, unguarded']:.1f} | "
            f"{low['run, guarded'] - low['run, unguarded']:.1f} |"
        )
    publish_results("\n".join(lines) + "\n", args.out, "run_guard", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
