"""What the sync-free MoE path costs on a CPU, and what it removes: the exact path (the CPU
default) against ``MoEConfig(sync_free=True)`` (the accelerator default), one MoE layer, one rank.

For each case (decode-like and prefill-like token counts, 2 ubatches) and each path, in
alternating order, every round times one DBO step (``asyncdbo.run_ubatches`` on the host backend,
2 ubatches) and one plain serial call, and reports:

* step wall time and process CPU time (medians over rounds; CPU time moves less with other jobs'
  load on a shared machine);
* host syncs per step (ops that would make the host wait on an accelerator, counted by
  :class:`asyncdbo.syncs.HostSyncs`) and torch ops dispatched per step (what a device
  would launch);
* expert MLP rows per step: the rows that went through the experts' GEMMs (the sync-free path
  reads a fixed window of rows per expert, so it computes padding rows);
* whether both paths give the same output bit for bit (deterministic mode, the CPU default).

    python benchmarks/sync_free.py            # full run, writes benchmarks/results/sync_free_<hw>_<date>.md
    python benchmarks/sync_free.py --quick    # one small case, prints only
"""

# Legend: T tokens of the step, D hidden.

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import asyncdbo
from asyncdbo.syncs import HostSyncs
from asyncdbo.moe import MoEConfig, MoELayer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import publish_results, results_preamble  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PATHS = (("exact", False), ("sync-free", True))


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _layer(sync_free: bool, hidden: int, experts: int, top_k: int, schedule: str) -> tuple[MoELayer, list[int]]:
    cfg = MoEConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_experts=experts, top_k=top_k,
                    schedule=schedule, sync_free=sync_free)
    layer = MoELayer(cfg, seed=3)
    rows = [0]
    mlp = layer._mlp

    def counting(x_MD: torch.Tensor, *args: Any) -> torch.Tensor:
        rows[0] += x_MD.shape[0]
        return mlp(x_MD, *args)

    layer._mlp = counting
    return layer, rows


async def _case(tokens: int, rounds: int, hidden: int, experts: int, top_k: int, schedule: str) -> dict[str, Any]:
    x_TD = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    half = tokens // 2
    parts = [(x_TD[:half],), (x_TD[half:],)]
    layers = {name: _layer(flag, hidden, experts, top_k, schedule) for name, flag in PATHS}
    stats: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": [], "serial": []} for name, _ in PATHS}
    outs: dict[str, torch.Tensor] = {}
    counts: dict[str, dict[str, int]] = {}
    for name, (layer, rows) in layers.items():  # warm-up, and the per-step counts (same every step)
        await asyncdbo.run_ubatches(layer, parts, backend="host")
        rows[0] = 0
        with HostSyncs() as syncs, _OpCount() as ops:
            outs[name] = torch.cat(await asyncdbo.run_ubatches(layer, parts, backend="host"))
        counts[name] = {"syncs": syncs.count, "ops": ops.ops, "rows": rows[0]}
    for r in range(rounds):
        order = PATHS if r % 2 == 0 else PATHS[::-1]
        for name, _ in order:
            layer = layers[name][0]
            w0, c0 = time.perf_counter(), time.process_time()
            await asyncdbo.run_ubatches(layer, parts, backend="host")
            stats[name]["wall"].append(time.perf_counter() - w0)
            stats[name]["cpu"].append(time.process_time() - c0)
            s0 = time.perf_counter()
            await layer(x_TD)
            stats[name]["serial"].append(time.perf_counter() - s0)
    med = {name: {k: statistics.median(v) for k, v in s.items()} for name, s in stats.items()}
    return {"med": med, "counts": counts, "equal": torch.equal(outs["exact"], outs["sync-free"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small case, few rounds, print only")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cases = [("decode", 64), ("prefill", 512)] if not args.quick else [("decode", 16)]
    rounds = 3 if args.quick else args.rounds
    hidden, experts, top_k = (256, 8, 2) if not args.quick else (32, 8, 2)
    cmd = "python benchmarks/sync_free.py" + (" --quick" if args.quick else f" --rounds {rounds}")
    lines, info = results_preamble("Sync-free MoE path vs the exact path on a CPU (one layer, one rank)", cmd)
    lines.append(f"\nLayer: hidden {hidden}, intermediate {2 * hidden}, {experts} experts, top-{top_k}, schedule ht, "
                 f"deterministic (CPU default), 1 torch thread; {rounds} rounds, paths alternating; medians.\n\n")
    lines.append("| case | path | DBO step ms | DBO step CPU ms | serial call ms | host syncs / step | "
                 "torch ops / step | expert rows / step | equal |\n|---|---|---:|---:|---:|---:|---:|---:|---|\n")
    ok = True
    for case, tokens in cases:
        res = asyncio.run(_case(tokens, rounds, hidden, experts, top_k, "ht"))
        ok &= res["equal"]
        for name, _ in PATHS:
            m, c = res["med"][name], res["counts"][name]
            lines.append(f"| {case} T={tokens} | {name} | {m['wall'] * 1e3:.2f} | {m['cpu'] * 1e3:.2f} | "
                         f"{m['serial'] * 1e3:.2f} | {c['syncs']} | {c['ops']} | {c['rows']} | {res['equal']} |\n")
        ex, sf = res["med"]["exact"], res["med"]["sync-free"]
        lines.append(f"| {case} T={tokens} | sync-free / exact | {sf['wall'] / ex['wall']:.2f}x | "
                     f"{sf['cpu'] / ex['cpu']:.2f}x | {sf['serial'] / ex['serial']:.2f}x | | | | |\n")
    publish_results("".join(lines), None if args.quick else RESULTS, "sync_free", info)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
