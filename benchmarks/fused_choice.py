"""Is ``mode="auto"``'s choice between the fused and the split dispatch right? A long paired A/B.

``moe_step.py`` runs five designs per step for 7 steps; its fused-vs-split ratios moved by 5-10%
between runs (``ll`` prefill at N = 8: 0.86x, 0.94x, 0.98x in three runs), as much as the effect,
so a single "0.98x" there cannot say whether fusing loses. Here only the two dispatches of one
schedule run, back to back in every step, in alternating order (split first in even steps, fused
first in odd ones, so a drift of the machine's speed hits both alike), for ``--steps`` steps.

Per step the ratio is split time / fused time on the slower rank (the speedup of fusing); the
table gives its median over steps with a 95% bootstrap interval (10,000 resamples of the steps,
fixed seed) and the verdict: ``fused wins`` if the whole interval is above 1, ``split wins`` if it
is below 1, else ``level`` (no difference this run can resolve). The choice is right where the
link model chose fused and the verdict is not ``split wins``, or chose split and it is not
``fused wins``.

Same model, link and batches as ``moe_step.py`` (``asyncdbo.models.MiniModel``, ``ib400 x1000``,
2 gloo ranks, equal batches; the fused designs run under ``dispatch_options(ubatch tokens,
"fused")``), logits checked equal between the two in every step.

    python benchmarks/fused_choice.py            # ~5 min, writes benchmarks/results/fused_choice_<hw>_<date>.md
    python benchmarks/fused_choice.py --quick    # one tiny case, seconds, prints only
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
RESAMPLES = 10_000


@dataclass(frozen=True, kw_only=True)
class Cell:
    shape: str  # "decode" | "prefill"
    tokens: int  # per rank
    layers: int
    ubatches: int
    schedule: str  # "ht" | "ll"
    context: int = 64

    @property
    def name(self) -> str:
        return f"{self.shape} {self.tokens} tok/rank, {self.layers} layers"


def _rank(rank: int, world: int, cells: list[Cell], steps: int, warmup: int) -> list[dict[str, Any]]:
    import asyncdbo

    return asyncdbo.run(_rank_async, rank, world, cells, steps, warmup)


async def _rank_async(rank: int, world: int, cells: list[Cell], steps: int, warmup: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist
    from moe_step import _set_schedule, step_batch

    import asyncdbo
    from asyncdbo.backends.host import HostBackend
    from asyncdbo.cli.demo import DemoConfig, decode_chunks
    from asyncdbo.dist import choose_dispatch, dispatch_options
    from asyncdbo.models import MiniModel
    from asyncdbo.plan import merge_outputs, plan_step
    from asyncdbo.serving import BatchBuilder

    out = []
    for cell in cells:
        dcfg = DemoConfig(ranks=world, tokens=cell.tokens, layers=cell.layers, shape=cell.shape, context=cell.context,
                          steps=steps, warmup=warmup, link="ib400", link_scale=1000.0)
        mcfg = dcfg.model_config()
        group = dist.group.WORLD
        model = MiniModel(mcfg, ep_group=group, max_ubatches=8, device=torch.device("cpu"))
        _set_schedule(model, cell.schedule)
        builder = BatchBuilder(mcfg.kv_cache_config)
        link = dcfg.link_spec()
        if cell.shape == "decode":
            ctx = builder.build(decode_chunks(dcfg, rank, -1, mcfg.vocab_size, cell.context))
            await asyncdbo.run_ubatches(model.forward, [(ctx.input_ids_T, ctx.positions_T, ctx.attn)],
                                        backend=HostBackend(link=link))
        times: dict[str, list[float]] = {"split": [], "fused": []}
        choice = None
        for i in range(warmup + steps):
            batch = step_batch(builder, dcfg, rank, i, mcfg.vocab_size)
            plan = plan_step(batch.attn.query_start_loc_cpu, num_ubatches=cell.ubatches, attn_metadata=batch.attn,
                             dp_group=group)
            assert plan.record.microbatched, plan.record.reason
            args = [(batch.input_ids_T[s.padded_token_slice], batch.positions_T[s.padded_token_slice], m)
                    for s, m in zip(plan.slices, plan.attn_metadata)]
            ub_tokens = max(s.num_tokens_padded for s in plan.slices)
            choice = choose_dispatch(link, max_tokens=ub_tokens, top_k=mcfg.top_k,
                                     experts_per_rank=mcfg.num_experts // world, ranks=world,
                                     hidden=mcfg.hidden_size, itemsize=4, schedule=cell.schedule,
                                     ubatches=cell.ubatches)
            order = ("split", "fused") if i % 2 == 0 else ("fused", "split")
            logits = {}
            for design in order:
                options = dispatch_options(ub_tokens, "fused") if design == "fused" else contextlib.nullcontext()
                dist.barrier()
                t0 = time.perf_counter()
                with torch.inference_mode(), options:
                    outs = await asyncdbo.run_ubatches(model.forward, args, backend=HostBackend(link=link))
                wall = time.perf_counter() - t0
                logits[design] = merge_outputs(outs, plan.slices, batch.num_tokens)
                if i >= warmup:
                    times[design].append(wall)
            if not torch.equal(logits["split"], logits["fused"]):
                raise SystemExit(f"{cell}: fused and split logits differ in step {i}")
        assert choice is not None
        out.append({"times": times, "fused_chosen": choice.fused, "saved_s": choice.saved_s,
                    "padding_s": choice.padding_s})
    return out


def median_ci(values: list[float], seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the median and its 95% bootstrap interval (fixed seed)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(RESAMPLES))
    return statistics.median(values), meds[int(0.025 * RESAMPLES)], meds[int(0.975 * RESAMPLES) - 1]


def verdict(low: float, high: float) -> str:
    return "fused wins" if low > 1.0 else "split wins" if high < 1.0 else "level"


def row(cell: Cell, per_rank: list[dict[str, Any]]) -> tuple[str, bool]:
    """One table row and whether the choice was right."""
    split = [max(vals) for vals in zip(*(r["times"]["split"] for r in per_rank))]  # slower rank per step
    fused = [max(vals) for vals in zip(*(r["times"]["fused"] for r in per_rank))]
    med, low, high = median_ci([s / f for s, f in zip(split, fused)])
    v = verdict(low, high)
    chosen = per_rank[0]["fused_chosen"]
    right = v != ("split wins" if chosen else "fused wins")
    line = (f"| {cell.name} | {cell.ubatches} | {cell.schedule} | {statistics.median(split) * 1e3:.1f} | "
            f"{statistics.median(fused) * 1e3:.1f} | {med:.3f}x [{low:.3f}..{high:.3f}] | {v} | "
            f"{per_rank[0]['saved_s'] * 1e3:.1f} / {per_rank[0]['padding_s'] * 1e3:.1f} | "
            f"{'fused' if chosen else 'split'} | {'yes' if right else 'no'} |")
    return line, right


def parse_cell(text: str) -> Cell:
    """``SHAPE:TOKENS:LAYERS:N:SCHEDULE`` (``--cell``), checked."""
    parts = text.split(":")
    if len(parts) != 5 or parts[0] not in ("decode", "prefill") or parts[4] not in ("ht", "ll") \
            or not all(p.isdigit() for p in parts[1:4]):
        raise SystemExit(f"--cell {text!r}: expected SHAPE:TOKENS:LAYERS:N:SCHEDULE, e.g. decode:64:8:2:ht "
                         "(SHAPE decode or prefill, SCHEDULE ht or ll)")
    return Cell(shape=parts[0], tokens=int(parts[1]), layers=int(parts[2]), ubatches=int(parts[3]), schedule=parts[4])


FULL = [Cell(shape=s, tokens=t, layers=layers, ubatches=n, schedule=sched)
        for sched in ("ht", "ll")
        for s, t, layers, n in (("decode", 64, 2, 2), ("decode", 64, 8, 2), ("decode", 64, 2, 4), ("decode", 64, 2, 8),
                                ("prefill", 1024, 2, 2), ("prefill", 1024, 2, 4), ("prefill", 1024, 2, 8))]
QUICK = [Cell(shape="decode", tokens=32, layers=1, ubatches=2, schedule="ll", context=16)]


def main(argv: list[str] | None = None) -> int:
    import _progress

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one tiny case, 2 steps, print only (smoke test)")
    parser.add_argument("--steps", type=int, default=25, help="measured steps per cell (default 25)")
    parser.add_argument("--cell", action="append", default=[], metavar="SHAPE:TOKENS:LAYERS:N:SCHEDULE",
                        help="run only this cell (repeatable), e.g. decode:64:8:2:ht")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results, not with --quick)")
    _progress.add_quiet_flag(parser)
    args = parser.parse_args(argv)
    from _results import publish_results, results_preamble

    from asyncdbo.testing import RankPool

    cells = QUICK if args.quick else [parse_cell(c) for c in args.cell] or FULL
    steps, warmup = (2, 1) if args.quick else (args.steps, 2)
    t0 = time.perf_counter()
    _progress.start(args.quiet, "cells, all in one call on 2 ranks", len(cells))
    _progress.step(f"{len(cells)} cell(s) of {steps} paired steps each (one call: no per-cell line)")
    with RankPool(2, timeout_s=900) as pool:
        per_rank = pool.run(_rank, cells, steps, warmup)
    _progress.done()
    lines, info = results_preamble(
        "Fused or split dispatch: a long paired A/B of the two, against mode='auto''s choice",
        f"python benchmarks/fused_choice.py{' --quick' if args.quick else ''}"
        + (f" --steps {args.steps}" if args.steps != 25 and not args.quick else "")
        + "".join(f" --cell {c}" for c in args.cell),
    )
    lines.append(
        f"2 gloo ranks, asyncdbo.models.MiniModel, link ib400 x1000 (10 ms + 50 MB/s), {steps} measured steps "
        f"after {warmup} warm-up per cell, split and fused back to back in alternating order. Speedup of fused = "
        "split / fused per step (slower rank), median over steps [95% bootstrap interval]; link model: one "
        "latency saved / the padded rows' cost (ms), as `asyncdbo.dist.choose_dispatch` prices them.\n"
    )
    lines += ["| case | N | schedule | split ms | fused ms | speedup of fused | verdict | link model: saved / paid (ms) | "
              "auto chose | right? |", "|---|---:|---|---:|---:|---:|---|---|---|---|"]
    rights = []
    for k, cell in enumerate(cells):
        line, right = row(cell, [r[k] for r in per_rank])
        lines.append(line)
        rights.append(right)
    lines.append(f"\nThe choice was right in {sum(rights)} of {len(rights)} cells. "
                 f"Total benchmark time {time.perf_counter() - t0:.0f} s.")
    publish_results("\n".join(lines) + "\n", args.out if args.out is not None else (None if args.quick else RESULTS),
                    "fused_choice", info)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
