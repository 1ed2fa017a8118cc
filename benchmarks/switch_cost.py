"""Switch cost of asyncdbo against a bare trampoline, a vLLM-style thread baton and asyncio.

Scenarios (the designs are described in benchmarks/_switch_bench.py, which holds the measured code):

* ``plain``: no work between switches; N = 2, 4, 8 ubatches, await-chain depth 2, 8, 16.
* ``busy``: the same with a busy pure-Python thread in the process (servers have them): a thread
  handoff then waits for the GIL, and an asyncio loop iteration releases it in ``epoll_wait``.
* ``torch``: a 256x256 ``torch.mm`` between switches; reports us per step and the slowdown against
  the matmuls alone. One OS thread keeps one OpenMP team; a thread per ubatch gets a team each.

Method: the designs run interleaved inside each round, medians over rounds with [min..max], every
ratio from the same run. Slow designs make fewer switches so that every run lasts about as long.

    python benchmarks/switch_cost.py            # full run, writes benchmarks/results/switch_cost_<hw>_<date>.md
    python benchmarks/switch_cost.py --quick    # a few seconds, prints only (the smoke test runs this)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import _progress
from _results import publish_results, results_preamble
from _switch_bench import DESIGNS, check_round_robin, measure, median_table

RESULTS = Path(__file__).resolve().parent / "results"
SWITCH_DESIGNS = [
    "tramp", "tramp_ctx", "asyncdbo", "asyncdbo_aio", "asyncdbo_inst", "asyncdbo_nohooks", "threads", "aio_fut", "aio_fut_uv",
] + (["vllm"] if "vllm" in DESIGNS else [])  # vLLM's own code where it is installed (benchmarks/_vllm_ubatch.py)

FULL = {
    "rounds": 7,
    "busy_rounds": 5,
    "ns": (2, 4, 8),
    "depths": (2, 8, 16),
    "plain": {"fast": 100_000, "aio": 40_000, "threads": 10_000},
    "busy": {"fast": 200_000, "aio": 1_000, "threads": 200},
    "torch": {"fast": 400, "aio": 400, "threads": 400},
    "torch_ns": (2,),
    "busy_ns": (2, 4),
}
QUICK = {
    "rounds": 1,
    "busy_rounds": 1,
    "ns": (2,),
    "depths": (2,),
    "plain": {"fast": 2_000, "aio": 400, "threads": 100},
    "busy": {"fast": 2_000, "aio": 20, "threads": 10},
    "torch": {"fast": 40, "aio": 40, "threads": 40},
    "torch_ns": (2,),
    "busy_ns": (2,),
}


@contextmanager
def busy_thread() -> Iterator[None]:
    """A pure-Python thread spinning for the duration (it holds the GIL whenever it can)."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def _goal(ok: bool) -> str:
    return "met" if ok else "MISSED"


def run(cfg: dict, log: list[str]) -> None:
    orders = check_round_robin()
    bad = {k: v for k, v in orders.items() if v != [0, 1, 2] * 4}
    if bad:
        raise SystemExit(f"designs not round-robin, refusing to measure: {bad}")
    log.append("Round-robin check (N=3, K=4): every design hands over 0,1,2,0,1,2,...\n")

    med: dict[tuple[int, int], dict[str, float]] = {}
    log.append(f"## plain: ns per switch, no work between switches ({cfg['rounds']} rounds)\n")
    log.append(f"Switches per run: {cfg['plain']}.\n")
    for depth in cfg["depths"]:
        for N in cfg["ns"]:
            _progress.step(f"plain N={N} depth={depth}")
            s = measure(SWITCH_DESIGNS, N=N, depth=depth, switches=cfg["plain"], rounds=cfg["rounds"])
            med[(N, depth)] = {k: statistics.median(v) for k, v in s.items()}
            log.append(f"### N = {N}, depth {depth}\n")
            log += median_table(s, baselines=("tramp", "tramp_ctx"))
            log.append("")

    log.append("## Goals (issue 2), same run\n")
    log.append(
        "| N | depth | asyncdbo / tramp (goal <= 1.5) | asyncdbo / tramp_ctx | threads / asyncdbo (goal >= 30 at N=2) "
        "| disabled tracing: asyncdbo / no-branch loop (goal <= 1.05) | empty Instrument / none |"
        + (" vLLM's own code / asyncdbo | vLLM's own code / the re-implementation |" if "vllm" in SWITCH_DESIGNS else "")
    )
    log.append("|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if "vllm" in SWITCH_DESIGNS else ""))
    for (N, depth), m in sorted(med.items()):
        r = m["asyncdbo"] / m["tramp"]
        sp = m["threads"] / m["asyncdbo"]
        sp_txt = f"{sp:.0f} ({_goal(sp >= 30)})" if N == 2 else f"{sp:.0f}"
        off = m["asyncdbo"] / m["asyncdbo_nohooks"]
        log.append(
            f"| {N} | {depth} | {r:.2f} ({_goal(r <= 1.5)}) | {m['asyncdbo'] / m['tramp_ctx']:.2f} | {sp_txt} | "
            f"{off:.3f} ({_goal(off <= 1.05)}) | {m['asyncdbo_inst'] / m['asyncdbo']:.2f} |"
            + (f" {m['vllm'] / m['asyncdbo']:.0f} | {m['vllm'] / m['threads']:.2f} |" if "vllm" in m else "")
        )
    log.append(
        "\n`asyncdbo / tramp_ctx` is the price of the scheduler itself over a trampoline that already gives each "
        "coroutine its own context (deque ring, state, stream check, switch counter, the `instrument is None` "
        "branch); `empty Instrument / none` is what enabled-but-empty hooks add.\n"
    )

    log.append(f"## busy: a busy Python thread in the process, depth 2 ({cfg['busy_rounds']} rounds)\n")
    log.append(f"Switches per run: {cfg['busy']}.\n")
    for N in cfg["busy_ns"]:
        _progress.step(f"busy thread, N={N}")
        with busy_thread():
            s = measure(SWITCH_DESIGNS, N=N, depth=2, switches=cfg["busy"], rounds=cfg["busy_rounds"])
        log.append(f"### N = {N}\n")
        log += median_table(s)
        log.append("")

    import torch

    a = torch.randn(256, 256)
    b = torch.randn(256, 256)

    def mm(_i: int) -> object:
        return torch.mm(a, b)

    torch_designs = ["work_only", *SWITCH_DESIGNS]
    default_threads = torch.get_num_threads()
    for threads in dict.fromkeys((default_threads, 1)):
        torch.set_num_threads(threads)
        for _ in range(20):  # warm up this thread count's OpenMP team before the first timed run
            mm(0)
        log.append(
            f"## torch: one 256x256 `torch.mm` per step, depth 2, {threads} intra-op thread(s) "
            f"({cfg['busy_rounds']} rounds)\n"
        )
        log.append(f"Steps per run: {cfg['torch']['fast']}. Times are us per step (matmul + handoff).\n")
        for N in cfg["torch_ns"]:
            _progress.step(f"torch.mm per step, {threads} thread(s), N={N}")
            s = measure(torch_designs, N=N, depth=2, switches=cfg["torch"], rounds=cfg["busy_rounds"], work=mm)
            s = {k: [v / 1000 for v in vals] for k, vals in s.items()}
            log.append(f"### N = {N}\n")
            log += median_table(s, baselines=("work_only",), speedup_vs=None, unit="us", digits=1)
            log.append("")
    torch.set_num_threads(default_threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round, print only (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results, not with --quick)")
    _progress.add_quiet_flag(parser)
    args = parser.parse_args(argv)
    _progress.start(args.quiet, "switch-cost measurements (plain, busy thread, torch)")
    cfg = QUICK if args.quick else FULL
    log, info = results_preamble(
        "Switch cost: asyncdbo vs trampoline, vLLM thread baton, asyncio",
        f"python benchmarks/switch_cost.py{' --quick' if args.quick else ''}",
    )
    log.append(
        "Designs: " + "; ".join(f"`{k}` = {d.label}" for k, d in DESIGNS.items()) + ". Depth = async def frames "
        "on the await chain from the ubatch function to the frame that awaits the yield point (threads keep their "
        "stack, so depth does not apply to them). Medians over rounds, [min..max], ratios of medians from this run.\n"
    )
    t0 = time.perf_counter()
    run(cfg, log)
    _progress.done()
    log.append(f"Total benchmark time {time.perf_counter() - t0:.0f} s.")
    text = "\n".join(log) + "\n"
    publish_results(text, args.out if args.out is not None else (None if args.quick else RESULTS), "switch_cost", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
