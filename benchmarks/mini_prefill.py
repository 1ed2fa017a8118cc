"""CPU time of one prefill forward of the reference ``MiniModel`` (one process, one thread, no
DP/EP): R requests of P new tokens each, in the default (non-exact) mode, whose attention
attends every request in one padded call (it looped over the requests before), with the LM head
on every token (``logits="all"``) or only on each request's last token (``logits="last"``), and
in exact (deterministic) mode, whose tiled attention is unchanged.

    python benchmarks/mini_prefill.py [--vocab 32000] [--out benchmarks/results]

Each time is the median of ``--repeat`` calls' thread CPU time (a busy machine stretches wall
time, CPU time less), after one untimed call.  Run it at two commits to compare them (the
results file names the commit).
"""

# Shape legend: T tokens, V vocab.

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import publish_results, results_preamble  # noqa: E402

import asyncdbo  # noqa: E402
from asyncdbo.models import MiniConfig, MiniModel  # noqa: E402
from asyncdbo.serving import BatchBuilder  # noqa: E402

CASES = ((8, 16), (32, 16), (64, 8))


def _model(cfg: MiniConfig, logits: str) -> MiniModel:
    try:
        return MiniModel(cfg, logits=logits)
    except TypeError:  # a commit before MiniModel(logits=...): it computes every row
        if logits != "all":
            raise
        return MiniModel(cfg)


def time_forward(cfg: MiniConfig, logits: str, nreq: int, ntok: int, repeat: int) -> tuple[float, torch.Tensor]:
    """(median thread CPU seconds of one forward, its last-token logits)."""
    model = _model(cfg, logits)
    g = torch.Generator().manual_seed(0)
    chunks = [(r, torch.randint(0, cfg.vocab_size, (ntok,), generator=g).tolist()) for r in range(nreq)]
    times = []
    out_TV = torch.empty(0)
    for i in range(repeat + 1):
        model.kv_cache.reset()
        batch = BatchBuilder(cfg.kv_cache_config).build(chunks)
        c0 = time.thread_time()
        out_TV = asyncio.run(model.forward(batch.input_ids_T, batch.positions_T, batch.attn))
        if i:
            times.append(time.thread_time() - c0)
    last_T = torch.arange(1, nreq + 1) * ntok - 1
    return statistics.median(times), out_TV[last_T]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000, Mixtral's)")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per case (default 5)")
    p.add_argument("--out", default=None, help="write the results file to this directory")
    args = p.parse_args()
    torch.set_num_threads(1)
    command = "python benchmarks/mini_prefill.py " + " ".join(sys.argv[1:])
    lines, info = results_preamble("MiniModel prefill: batched attention, LM head on the last tokens", command.strip())
    lines += [f"asyncdbo from {Path(asyncdbo.__file__).parent}; MiniConfig defaults but vocab {args.vocab}; CPU ms "
              f"per forward, median of {args.repeat}; max |diff| of the last-token logits against the first column.\n",
              "| requests x tokens | non-exact, logits all | non-exact, logits last | exact, logits all | "
              "exact, logits last | max abs diff (non-exact last) |", "|---|---:|---:|---:|---:|---:|"]
    for nreq, ntok in CASES:
        cells, ref = [], None
        diff = "n/a"
        for deterministic in (False, True):
            cfg = MiniConfig(vocab_size=args.vocab, deterministic=deterministic, num_kv_blocks=nreq * (ntok // 16 + 1) + 4)
            for logits in ("all", "last"):
                try:
                    s, last_RV = time_forward(cfg, logits, nreq, ntok, args.repeat)
                except TypeError:
                    cells.append("n/a")
                    continue
                cells.append(f"{s * 1e3:.1f}")
                if ref is None:
                    ref = last_RV
                elif not deterministic and logits == "last":
                    diff = f"{(last_RV - ref).abs().max().item():.1e}"
        lines.append(f"| {nreq} x {ntok} | " + " | ".join(cells) + f" | {diff} |")
    publish_results("\n".join(lines) + "\n", args.out, "mini_prefill", info)


if __name__ == "__main__":
    main()
