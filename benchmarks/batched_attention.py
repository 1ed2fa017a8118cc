"""Host (CPU) time of the HF models' attention: the batched path (``paged_attention``: decode
requests in one call, the rest in another) against the per-request loop it replaced
(``per_request_attention``), GQA with 4 query heads over 2 KV heads of dim 16, one thread, on a
random paged cache, and MLA decode at DeepSeek-V3's ranks (expanded per head vs absorbed into the
latent); also the largest |difference| of their outputs.

    python benchmarks/batched_attention.py [--out benchmarks/results]

Each case is a decode step of R requests over a context of C tokens, with or without a prompt of P
tokens joining it; each time is the median of 5 calls' process CPU time (a busy machine stretches
wall time, CPU time less).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import publish_results, results_preamble  # noqa: E402

from asyncdbo.models.hf.common import attend, paged_attention, per_request_attention  # noqa: E402
from asyncdbo.models.hf.mla import mla_absorbed_decode, mla_expand  # noqa: E402
from asyncdbo.serving import BatchBuilder, KVCacheConfig, PagedKVCache  # noqa: E402

H, G, K = 4, 2, 16
CASES = ((8, 64, 0), (64, 128, 0), (64, 128, 256), (256, 64, 0))
MLA_H, MLA_L, MLA_P, MLA_N, MLA_V = 16, 512, 64, 128, 128
MLA_CASES = ((8, 128), (32, 256))


def gqa_context(k_SGK: torch.Tensor, v_SGK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    assert v_SGK is not None
    return (k_SGK.transpose(0, 1).repeat_interleave(H // G, dim=0),
            v_SGK.transpose(0, 1).repeat_interleave(H // G, dim=0))


def case(nreq: int, ctx: int, prefill: int, g: torch.Generator) -> tuple[PagedKVCache, Any, torch.Tensor]:
    cfg = KVCacheConfig(num_layers=1, num_blocks=nreq * (ctx // 16 + 2) + prefill // 16 + 2, block_size=16,
                        num_heads=G, head_dim=K)
    cache = PagedKVCache(cfg)
    for t in (*cache.k_cache_LNZHK, *cache.v_cache_LNZHK):
        t.copy_(torch.randn(t.shape, generator=g))
    builder = BatchBuilder(cfg)
    builder.build([(r, list(range(ctx))) for r in range(nreq)])
    batch = builder.build([(r, [1]) for r in range(nreq)] + ([(nreq, list(range(prefill)))] if prefill else []))
    return cache, batch, torch.randn(batch.num_tokens, H, K, generator=g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the results file to this directory")
    args = p.parse_args()
    torch.set_num_threads(1)
    lines, info = results_preamble("Batched attention vs the per-request loop (host CPU time)",
                                   "python benchmarks/batched_attention.py" + (f" --out {args.out}" if args.out else ""))
    lines += ["", "| decode requests x context | prompt joining | loop | batched | loop / batched | max abs diff |",
              "|---|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(0)
    kw: dict[str, Any] = dict(scale=K ** -0.5, context=gqa_context, attend_fn=attend, v_dim=K)
    for nreq, ctx, prefill in CASES:
        cache, batch, q_THK = case(nreq, ctx, prefill, g)
        cpu, outs = {}, {}
        for name, fn in (("loop", per_request_attention), ("batched", paged_attention)):
            fn(q_THK, batch.positions_T, cache, 0, batch.attn, **kw)  # warm-up
            times = []
            for _ in range(5):
                t0 = time.process_time()
                outs[name] = fn(q_THK, batch.positions_T, cache, 0, batch.attn, **kw)
                times.append(time.process_time() - t0)
            cpu[name] = statistics.median(times)
        diff = (outs["loop"] - outs["batched"]).abs().max().item()
        lines.append(f"| {nreq} x {ctx} | {prefill or '-'} | {cpu['loop'] * 1e3:.2f} ms | {cpu['batched'] * 1e3:.2f} ms "
                     f"| {cpu['loop'] / cpu['batched']:.1f}x | {diff:.2g} |")
    lines += ["", "MLA decode (DeepSeek-V3's ranks: latent 512 + rope 64, 16 heads of 128 + 64 keys and 128 values): "
              "the loop expanding each request's latents per head, the batched expansion, and the absorbed form",
              "", "| decode requests x context | loop | batched, expanded | absorbed | max abs diff (absorbed vs loop) |",
              "|---|---|---|---|---|"]
    for nreq, ctx in MLA_CASES:
        cfg = KVCacheConfig(num_layers=1, num_blocks=nreq * (ctx // 16 + 2), block_size=16, num_heads=1,
                            head_dim=MLA_L + MLA_P, v_head_dim=0)
        cache = PagedKVCache(cfg)
        cache.k_cache_LNZHK[0].copy_(torch.randn(cache.k_cache_LNZHK[0].shape, generator=g))
        builder = BatchBuilder(cfg)
        builder.build([(r, list(range(ctx))) for r in range(nreq)])
        batch = builder.build([(r, [1]) for r in range(nreq)])
        kv_b_FL = torch.randn(MLA_H * (MLA_N + MLA_V), MLA_L, generator=g) / MLA_L ** 0.5
        scale = (MLA_N + MLA_P) ** -0.5

        def context(latent_S1C: torch.Tensor, _: torch.Tensor | None, kv_b_FL: torch.Tensor = kv_b_FL) -> Any:
            return mla_expand(latent_S1C, kv_b_FL, MLA_H, MLA_N, MLA_L)

        def absorbed(q_RHK: torch.Tensor, lat_RS1C: torch.Tensor, vis_RS: torch.Tensor,
                     kv_b_FL: torch.Tensor = kv_b_FL, scale: float = scale) -> torch.Tensor:
            return mla_absorbed_decode(q_RHK, lat_RS1C, vis_RS, kv_b_FL, MLA_H, MLA_N, MLA_L, scale)

        q_THK = torch.randn(nreq, MLA_H, MLA_N + MLA_P, generator=g)
        mkw: dict[str, Any] = dict(scale=scale, context=context, attend_fn=attend, v_dim=MLA_V)
        runs = {"loop": lambda: per_request_attention(q_THK, batch.positions_T, cache, 0, batch.attn, **mkw),
                "batched": lambda: paged_attention(q_THK, batch.positions_T, cache, 0, batch.attn, **mkw),
                "absorbed": lambda: paged_attention(q_THK, batch.positions_T, cache, 0, batch.attn, decode=absorbed, **mkw)}
        cpu, outs = {}, {}
        for name, fn in runs.items():
            fn()
            times = []
            for _ in range(5):
                t0 = time.process_time()
                outs[name] = fn()
                times.append(time.process_time() - t0)
            cpu[name] = statistics.median(times)
        diff = (outs["loop"] - outs["absorbed"]).abs().max().item()
        lines.append(f"| {nreq} x {ctx} | {cpu['loop'] * 1e3:.2f} ms | {cpu['batched'] * 1e3:.2f} ms "
                     f"| {cpu['absorbed'] * 1e3:.2f} ms | {diff:.2g} |")
    publish_results("\n".join(lines) + "\n", args.out, "batched_attention", info)


if __name__ == "__main__":
    main()
