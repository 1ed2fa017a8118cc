"""Dense TP DBO measured on this CPU: ``asyncdbo demo --model llama|qwen3 --tp N``'s measurement
(:mod:`asyncdbo.cli.demo_tp`) over TP sizes and links, side by side, into one markdown table.

Each cell: a random model of the architecture at the width below (2 layers), saved as a sharded
checkpoint every rank reads its blocks of; ``--repeats`` generations of a prefill (``--tokens``
prompt tokens in 1-4 requests) and ``--steps`` decode steps, every step serial then DBO back to
back; the speedup (serial / DBO step time of the slowest rank) as the median of its samples with
min-max.  Comm is real gloo over loopback (``none``) or a modeled link x1000 (the real collective
runs, its completion is released on the modeled link).  Thresholds are 1: every step microbatches.

    python benchmarks/tp_dense.py [--quick] [--out benchmarks/results/tp_dense_cpu-2c_DATE.md]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from asyncdbo.cli.demo_tp import TPDemoConfig, speedup_samples, tp_demo_rank
from asyncdbo.models.hf.reference import tiny_hf_model
from asyncdbo.testing import RankPool

WIDTH = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             vocab_size=1024, num_hidden_layers=2)


def cell(pool: RankPool, ckpt: str, model: str, tp: int, link: str | None, args: argparse.Namespace) -> list[str]:
    cfg = TPDemoConfig(model=model, weights=ckpt, tp=tp, tokens=args.tokens, steps=args.steps, warmup=1,
                       repeats=args.repeats, link=link, prefill_threshold=1, decode_threshold=1)
    per_rank: list[dict[str, Any]] = pool.run(tp_demo_rank, cfg, ckpt, timeout_s=600)
    rows = []
    for phase, decode in (("prefill", False), ("decode", True)):
        s, d, ratio = speedup_samples(per_rank, decode)
        rows.append(f"| {model} | {tp} | {link or 'loopback'} | {phase} | {statistics.median(s) * 1e3:.2f} | "
                    f"{statistics.median(d) * 1e3:.2f} | {statistics.median(ratio):.2f}x | "
                    f"{min(ratio):.2f}-{max(ratio):.2f} | {len(ratio)} |")
    return rows


def main(argv: list[str] | None = None, *, pool: RankPool | None = None) -> int:
    """``pool``: a live :class:`RankPool` for the TP size of its world size, left open (the smoke
    test hands it the suite's shared 2 ranks: --quick runs TP 2 only); the other sizes start their
    own pool and close it after."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sizes, links, models = ((2,), (None, "ib400"), ("llama",)) if args.quick else \
        ((2, 4), (None, "ib400", "nvlink"), ("llama", "qwen3"))
    if args.quick:
        args.tokens, args.steps, args.repeats = 64, 1, 1
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"# Dense TP DBO on CPU (benchmarks/tp_dense.py), commit {commit}", "",
             f"`python benchmarks/tp_dense.py{' --quick' if args.quick else ''}` on {platform.machine()}, "
             f"{torch.get_num_threads()} torch threads here, load {os.getloadavg()[0]:.2f} at start; "
             f"width {WIDTH}; {args.tokens} prompt tokens, {args.steps} decode steps, {args.repeats} repeats",
             "", "| model | TP | link | phase | serial ms | DBO ms | speedup (median) | min-max | N |",
             "|---|---|---|---|---|---|---|---|---|"]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            ckpt = f"{tmp}/{model}"
            tiny_hf_model(model, **WIDTH).save_pretrained(ckpt, max_shard_size="2MB")
            for tp in sizes:
                shared = pool if pool is not None and pool.world_size == tp else None
                with contextlib.nullcontext(shared) if shared else RankPool(tp, timeout_s=600) as ranks:
                    for link in links:
                        lines += cell(ranks, ckpt, model, tp, link, args)
                        print(lines[-2], lines[-1], sep="\n", file=sys.stderr)
    lines += ["", f"wall time {time.time() - t0:.0f} s"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
