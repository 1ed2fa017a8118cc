"""Compiled segments: a Hugging Face MoE model's step with every synchronous piece between its
yields compiled (``torch.compile``, inductor, CPU) against the same model eager, serially and with
DBO, on 2 gloo ranks (DP + EP).

The model is ``asyncdbo.models.hf`` Qwen3-MoE with random weights (hidden 512, 4 MoE layers of 8
experts top-2, expert size 512, 8 query / 4 KV heads of 64, vocab 4096).  "compiled" is
``HFMoEModel.compile_segments(dynamic=True)``: norms, residual adds, QKV projections with q/k
norms and RoPE, the per-request attention kernel, the output projection, the LM head, and in
every MoE layer the router and the expert MLPs (each local expert's GEMMs, the shared expert).
The comm, the yields, the per-request loop around attention and the per-expert row grouping stay
eager: a coroutine cannot suspend inside a compiled region.

Every round runs each (variant, mode) once on fresh KV caches, in alternating variant order, with
a barrier before every timed step; the table gives medians over rounds of the slower rank (a DP
step ends when its slowest rank ends), [min..max], and compiled / eager from the same rounds.
Prefill: 256 new tokens per rank in 3 requests.  Decode: 32 requests with 32 tokens of context,
one new token each.  Both microbatch under DBO (2 ubatches, token split).  The first compiled
rounds (warm-up, untimed) pay the compilation; their wall time is reported separately.

    python benchmarks/compiled_segments.py           # full run, writes benchmarks/results/compiled_segments_<hw>_<date>.md
    python benchmarks/compiled_segments.py --quick   # tiny sizes, backend "eager" (Dynamo only), prints only
"""

# Legend: V vocab.

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("eager", "compiled")
MODES = ("serial", "dbo")

FULL_SIZES = dict(vocab_size=4096, hidden_size=512, moe_intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=8, mlp_only_layers=[])
QUICK_SIZES = dict(mlp_only_layers=[])  # the tiny test config


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    shape: str  # "prefill" | "decode"
    tokens: int  # prefill: new tokens per rank; decode: requests per rank
    context: int = 32


FULL_CASES = (Case(name="prefill 256", shape="prefill", tokens=256), Case(name="decode 32", shape="decode", tokens=32))
QUICK_CASES = (Case(name="prefill 24", shape="prefill", tokens=24), Case(name="decode 4", shape="decode", tokens=4, context=4))


def _chunks(case: Case, rank: int, vocab: int) -> tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]]]:
    """``(context chunks, timed chunks)`` for one rank (prefill: no context)."""
    g = torch.Generator().manual_seed(100 + rank)
    if case.shape == "prefill":
        cuts = [0, case.tokens // 3, 2 * case.tokens // 3 + 5, case.tokens]
        ids = torch.randint(0, vocab, (case.tokens,), generator=g).tolist()
        return [], [(r, ids[cuts[r]: cuts[r + 1]]) for r in range(3)]
    ctx = torch.randint(0, vocab, (case.tokens, case.context + 1), generator=g).tolist()
    return [(r, ctx[r][:-1]) for r in range(case.tokens)], [(r, [ctx[r][-1]]) for r in range(case.tokens)]


async def _rank_async(rank: int, sizes: dict[str, Any], cases: tuple[Case, ...], rounds: int, warmup: int,
                      backend: str) -> dict[str, Any]:
    import torch.distributed as dist

    from asyncdbo.models.hf import from_hf_model
    from asyncdbo.models.hf.reference import tiny_hf_model
    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

    group = dist.group.WORLD
    hf = tiny_hf_model("qwen3-moe", seed=0, **sizes)
    vocab = hf.config.vocab_size
    models = {v: from_hf_model(hf, ep_group=group, block_size=16, num_kv_blocks=256) for v in VARIANTS}
    models["compiled"].compile_segments(backend=backend, dynamic=True)
    rc = RunnerConfig(thresholds=ThresholdConfig(prefill_threshold=1, decode_threshold=1))
    out: dict[str, Any] = {"warmup_s": {}, "steps": {}, "diff": {}}
    for case in cases:
        context, timed = _chunks(case, rank, vocab)
        runs = {(v, m): DBORunner(models[v].with_fresh_cache(), rc, dp_group=group) for v in VARIANTS for m in MODES}
        samples: dict[tuple[str, str], list[float]] = {k: [] for k in runs}
        logits: dict[tuple[str, str], torch.Tensor] = {}
        for i in range(warmup + rounds):
            order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
            for v in order:
                t_variant = time.perf_counter()
                for m in MODES:
                    runner = runs[(v, m)]
                    runner.model.kv_cache.reset()
                    builder = BatchBuilder(runner.model.kv_cache_config)
                    if context:
                        await runner.step(builder.build(context), enabled=False)
                    batch = builder.build(timed)
                    dist.barrier()
                    res = await runner.step(batch, enabled=(m == "dbo"))
                    if i >= warmup:
                        samples[(v, m)].append(res.step_s)
                    logits[(v, m)] = res.logits_TV
                if i < warmup:
                    out["warmup_s"].setdefault(case.name, {}).setdefault(v, []).append(time.perf_counter() - t_variant)
        out["steps"][case.name] = {f"{v}/{m}": s for (v, m), s in samples.items()}
        out["diff"][case.name] = {m: float((logits[("eager", m)] - logits[("compiled", m)]).abs().max()) for m in MODES}
        out["diff"][case.name]["dbo vs serial (compiled)"] = float(
            (logits[("compiled", "serial")] - logits[("compiled", "dbo")]).abs().max())
    dist.barrier()
    if rank == 0:  # alone on the machine's cores now: the pieces themselves, same compiled code
        out["segments"] = _segment_times(models, 256 if sizes is FULL_SIZES else 24, backend)
    return out


def _segment_times(models: dict[str, Any], T: int, backend: str, calls: int = 50) -> dict[str, tuple[float, float]]:
    """Median microseconds per call of single pieces, eager vs the compiled model's, at prefill
    shapes: ``T`` tokens, one request's attention over ``T // 3`` tokens, an expert's rows; and
    ``x + 1`` on one element, the fixed cost of calling a compiled function (guards, wrapper)."""

    m = models["eager"]
    layer = m.layers[0]
    att, moe = layer.attention, layer.moe
    D, g = m.hf.hidden_size, torch.Generator().manual_seed(0)
    x_TD, d_TD = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    cos_TK, sin_TK = m.rope.tables(torch.arange(T), torch.float32)
    S, H, K = T // 3, att.num_heads, att.head_dim
    q, k, v = (torch.randn(H, S, K, generator=g) for _ in range(3))
    visible_SS = torch.ones(S, S, dtype=torch.bool).tril()
    rows_RD = torch.randn(T * moe.cfg.top_k // moe.cfg.num_experts, D, generator=g)
    one = torch.ones(1)
    cases: dict[str, Any] = {
        "fixed cost: x + 1, one element": lambda seg, mo: seg.add_one(one),
        "residual + RMSNorm": lambda seg, mo: seg.residual_norm(x_TD, d_TD, layer.ffn_norm_D, m.eps),
        "QKV + q/k norm + RoPE": lambda seg, mo: seg.gqa_qkv(x_TD, att.wq_FD, None, att.wk_FD, None, att.wv_FD, None,
                                                            att.q_norm_K, att.k_norm_K, cos_TK, sin_TK, H,
                                                            att.num_kv_heads, K, m.eps),
        "attention (1 request)": lambda seg, mo: seg.attend(q, k, v, visible_SS, K**-0.5),
        "router (top-k)": lambda seg, mo: mo._route(x_TD, mo.router_ED, mo.cfg, bias_E=mo.bias_E),
        "expert SwiGLU (1 expert)": lambda seg, mo: mo._mlp(rows_RD, mo.gate_LFD[0], mo.up_LFD[0], mo.down_LDF[0]),
    }
    add_one = {"eager": _add_one, "compiled": torch.compile(_add_one, backend=backend, dynamic=True)}
    out = {}
    for name, fn in cases.items():
        per = {}
        for v_name in VARIANTS:
            seg, mo = models[v_name].segments, models[v_name].layers[0].moe
            seg = _WithAddOne(seg, add_one[v_name])
            for _ in range(3):
                fn(seg, mo)  # warm (compiles the compiled one at these shapes if it has not yet)
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                fn(seg, mo)
                times.append(time.perf_counter() - t0)
            per[v_name] = statistics.median(times) * 1e6
        out[name] = (per["eager"], per["compiled"])
    return out


def _add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


class _WithAddOne:
    """The model's segments plus ``add_one`` (the fixed cost of calling a compiled function)."""

    def __init__(self, seg: Any, add_one: Any) -> None:
        self._seg, self.add_one = seg, add_one

    def __getattr__(self, name: str) -> Any:
        return getattr(self._seg, name)


def bench_rank(rank: int, world: int, sizes: dict[str, Any], cases: tuple[Case, ...], rounds: int, warmup: int,
               backend: str) -> dict[str, Any]:
    import asyncdbo

    try:
        return asyncdbo.run(_rank_async, rank, sizes, cases, rounds, warmup, backend)
    finally:  # the rank may run other work next (the smoke test's shared ranks): no compiled code left behind
        torch._dynamo.reset()


def table(cases: tuple[Case, ...], per_rank: list[dict[str, Any]]) -> list[str]:
    rows = ["| case | mode | eager ms [min..max] | compiled ms [min..max] | compiled / eager | "
            "max abs logits diff eager vs compiled |", "|---|---|---|---|---:|---:|"]
    for case in cases:
        for m in MODES:
            cell = {}
            for v in VARIANTS:
                per_round = [max(s) for s in zip(*(r["steps"][case.name][f"{v}/{m}"] for r in per_rank))]
                cell[v] = (statistics.median(per_round), min(per_round), max(per_round))
            diff = max(r["diff"][case.name][m] for r in per_rank)
            (e, e0, e1), (c, c0, c1) = cell["eager"], cell["compiled"]
            rows.append(f"| {case.name} | {m} | {e * 1e3:.2f} [{e0 * 1e3:.2f}..{e1 * 1e3:.2f}] | "
                        f"{c * 1e3:.2f} [{c0 * 1e3:.2f}..{c1 * 1e3:.2f}] | {c / e:.2f} | {diff:.1e} |")
    return rows


def main(argv: list[str] | None = None, *, pool: Any = None) -> int:
    """``pool``: a live 2-rank :class:`asyncdbo.testing.RankPool` to run on, left open (the smoke
    test hands it the suite's shared ranks; --quick's eager backend needs no compile threads);
    default: start one and close it after."""
    import contextlib

    import _progress

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round, backend eager, print only (smoke test)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per case (default 15)")
    parser.add_argument("--backend", default=None, help="torch.compile backend (default inductor; --quick: eager)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results, not with --quick)")
    _progress.add_quiet_flag(parser)
    args = parser.parse_args(argv)
    from _results import publish_results, results_preamble

    from asyncdbo.testing import RankPool

    sizes, cases = (QUICK_SIZES, QUICK_CASES) if args.quick else (FULL_SIZES, FULL_CASES)
    rounds, warmup = (1, 1) if args.quick else (args.rounds, 2)
    backend = args.backend or ("eager" if args.quick else "inductor")
    t_start = time.perf_counter()
    _progress.start(args.quiet, "calls on 2 ranks", 1)
    _progress.step(f"{len(cases)} case(s) x {rounds} round(s), eager and compiled ({backend}), in one call")
    # One inductor compile thread: no compile-worker subprocesses next to the ranks on a small machine.
    with (RankPool(2, timeout_s=1800, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"}) if pool is None
          else contextlib.nullcontext(pool)) as pool:
        per_rank = pool.run(bench_rank, sizes, cases, rounds, warmup, backend)
    _progress.done()
    command = "python benchmarks/compiled_segments.py" + (" --quick" if args.quick else "") + (
        f" --backend {args.backend}" if args.backend else "")
    lines, info = results_preamble(f"Compiled segments ({backend}) vs eager: a Qwen3-MoE step on 2 gloo ranks", command)
    lines[-1] = lines[-1].rstrip("\n") + (f" ({rounds} timed rounds after {warmup} warm-up, variants alternating in "
                                          "every round)\n")
    lines.append(f"Model: asyncdbo.models.hf Qwen3-MoE, random weights, config overrides {sizes}; DP + EP over both "
                 "ranks; DBO: 2 ubatches, token split. See the module docstring for what is compiled.\n")
    lines += table(cases, per_rank)
    warm = {case.name: {v: [round(s, 1) for s in per_rank[0]["warmup_s"][case.name][v]] for v in VARIANTS}
            for case in cases}
    lines += ["", f"Warm-up rounds, wall seconds per variant on rank 0 (the first compiled one includes compilation): {warm}"]
    lines += ["", f"Single pieces on rank 0 alone (median us per call of 50 calls, same compiled code as the steps; "
              "prefill shapes):", "", "| piece | eager us | compiled us | compiled / eager |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {e:.1f} | {c:.1f} | {c / e:.2f} |" for name, (e, c) in per_rank[0]["segments"].items()]
    lines += ["", f"Max abs logits diff DBO vs serial (compiled): "
              f"{max(r['diff'][c.name]['dbo vs serial (compiled)'] for r in per_rank for c in cases):.1e}"]
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines.append(f"\nTotal benchmark time {time.perf_counter() - t_start:.0f} s; load average at the end {load_end}. "
                 "The machine (2 cores) is shared with other jobs: compare the ratios, which come from the same "
                 "rounds, not the absolute times.")
    publish_results("\n".join(lines) + "\n", args.out if args.out is not None else (None if args.quick else RESULTS),
                    "compiled_segments", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
