"""What deterministic mode costs: serial and DBO step times with the mode on and off, same run.

Deterministic mode (``MiniConfig.deterministic`` / ``MoEConfig.deterministic``, on by default on a
CPU) makes a token's numbers independent of the other tokens in its call, so a DBO step equals
the serial step bit for bit. It pays with fixed-shape GEMMs (row tiles padded with zeros, issued
as one ``bmm``), attention over fixed key tiles with query items padded to a fixed row count, and
silu/sigmoid composed from ``exp``. This script measures that price on the demo's model
(``asyncdbo.models.MiniModel``: hidden 256, 8 experts top-2, 1 shared expert, HT schedule) on 2
gloo ranks (DP = EP = 2), 2 ubatches, token split:

* every step runs four designs back to back on every rank, in a rotating order: serial and DBO
  with the mode off, serial and DBO with it on (two models with the same weights and their own
  KV caches, fed the same batches);
* step time: ``DBORunner.step`` wall time (planning included, the same for all four), medians
  over the measured steps of the slower rank;
* CPU time: the rank process's CPU seconds over the same call (all its threads, gloo's included),
  medians over steps, the larger rank. On a shared machine this moves less than wall time with
  other jobs' load, so the on/off ratio is given for both;
* max |diff|: the largest logits difference between DBO and serial of the same mode.

It also runs the probes behind :mod:`asyncdbo.moe.batch_invariant`'s claims (which GEMM row
counts and which elementwise ops change a row's bits on this machine), at 1 and 2 threads.

The Hugging Face models (``asyncdbo.models.hf``: Mixtral, Qwen3-MoE, DeepSeek-V3, random
weights) get the same four designs with exact mode (``HFMoEModel(deterministic=...)``) on and off,
at two sizes: the project's tiny configs over a 128-token prefill per rank, and a small config of
each (hidden 256, 8 heads, 8 experts top-2) over a 512-token prefill per rank; four requests per
rank, so the token split cuts one inside.

    python benchmarks/deterministic.py            # full run, writes benchmarks/results/deterministic_<hw>_<date>.md
    python benchmarks/deterministic.py --hf       # the HF models only, writes deterministic_hf_<hw>_<date>.md
    python benchmarks/deterministic.py --quick    # one tiny case, prints only (--quick --hf: one tiny HF case)
"""

# Legend: T tokens on this rank, D hidden, M rows of a GEMM, N its output columns.

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
MODES = (("off", False), ("on", True))


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    shape: str  # "prefill" | "decode"
    tokens: int  # per rank (decode: requests, one token each)
    layers: int = 2
    context: int = 32  # decode: context tokens per request before the measured steps
    hidden: int = 256
    experts: int = 8


# ------------------------------------------------------------------ per rank
async def _rank_async(rank: int, world: int, case: Case, steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    from asyncdbo.cli.demo import DemoConfig, decode_chunks, prefill_chunks
    from asyncdbo.models import MiniModel
    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

    dcfg = DemoConfig(ranks=world, tokens=case.tokens, layers=case.layers, shape=case.shape, context=case.context,
                      hidden=case.hidden, experts=case.experts, steps=steps, warmup=warmup)
    group = dist.group.WORLD
    always = ThresholdConfig(prefill_threshold=0, decode_threshold=0)
    runners, builders = {}, {}
    for label, det in MODES:
        mcfg = replace(dcfg.model_config(), deterministic=det)
        runners[label] = DBORunner(MiniModel(mcfg, ep_group=group), RunnerConfig(thresholds=always), dp_group=group)
        builders[label] = BatchBuilder(mcfg.kv_cache_config)
    vocab = dcfg.model_config().vocab_size
    if case.shape == "decode":
        ctx = decode_chunks(dcfg, rank, -1, vocab, case.context)
        for label, _ in MODES:
            await runners[label].step(builders[label].build(ctx), enabled=False)
    designs = [(label, dbo) for label, _ in MODES for dbo in (False, True)]
    out: dict[str, Any] = {f"{label}/{'dbo' if dbo else 'serial'}": [] for label, dbo in designs}
    out.update({f"cpu:{label}/{'dbo' if dbo else 'serial'}": [] for label, dbo in designs})
    out["diff"] = {label: 0.0 for label, _ in MODES}
    out["microbatched"] = True
    for i in range(warmup + steps):
        chunks = (prefill_chunks(dcfg, rank, i, vocab) if case.shape == "prefill"
                  else decode_chunks(dcfg, rank, i, vocab, 1))
        batches = {}
        for label, _ in MODES:
            if case.shape == "prefill":
                builders[label].reset()
            batches[label] = builders[label].build(chunks)
        logits: dict[tuple[str, bool], torch.Tensor] = {}
        k = i % len(designs)
        for label, dbo in designs[k:] + designs[:k]:  # rotate the order step by step
            dist.barrier()
            cpu0 = time.process_time()
            res = await runners[label].step(batches[label], enabled=dbo)
            cpu_s = time.process_time() - cpu0
            logits[label, dbo] = res.logits_TV
            if dbo and not res.record.microbatched:
                out["microbatched"] = False
            if i >= warmup:
                out[f"{label}/{'dbo' if dbo else 'serial'}"].append(res.step_s)
                out[f"cpu:{label}/{'dbo' if dbo else 'serial'}"].append(cpu_s)
        for label, _ in MODES:
            d = float((logits[label, True] - logits[label, False]).abs().max())
            out["diff"][label] = max(out["diff"][label], d)
    return out


def bench_rank(rank: int, world: int, case: Case, steps: int, warmup: int) -> dict[str, Any]:
    import asyncdbo

    return asyncdbo.run(_rank_async, rank, world, case, steps, warmup)


# ------------------------------------------------------------------ HF models
@dataclass(frozen=True, kw_only=True)
class HFCase:
    name: str
    arch: str
    size: str  # "tiny" (the project's tiny config) | "small" (SMALL_HF overrides)
    tokens: int  # prefill tokens per rank, four requests


#: A small config per architecture (hidden 256, 8 heads of 32, 8 experts top-2, 2 layers).
SMALL_HF: dict[str, dict[str, Any]] = {
    "mixtral": dict(hidden_size=256, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4,
                    num_local_experts=8, num_experts_per_tok=2, vocab_size=1024),
    "qwen3-moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=32, num_experts=8, num_experts_per_tok=2, vocab_size=1024),
    "deepseek-v3": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=8,
                        num_key_value_heads=8, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_group=4, topk_group=2,
                        num_experts_per_tok=2, vocab_size=1024),
}


async def _hf_rank_async(rank: int, world: int, case: HFCase, steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    from asyncdbo.models.hf import from_hf_model
    from asyncdbo.models.hf.reference import tiny_hf_model
    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

    group = dist.group.WORLD
    hf = tiny_hf_model(case.arch, **(SMALL_HF[case.arch] if case.size == "small" else {}))
    vocab = hf.config.vocab_size
    always = ThresholdConfig(prefill_threshold=0, decode_threshold=0)
    runners, builders = {}, {}
    for label, det in MODES:
        model = from_hf_model(hf, ep_group=group, max_ubatches=2, block_size=16, num_kv_blocks=4 * case.tokens // 16 + 8,
                              deterministic=det)
        runners[label] = DBORunner(model, RunnerConfig(thresholds=always), dp_group=group)
        builders[label] = BatchBuilder(model.kv_cache_config)
    designs = [(label, dbo) for label, _ in MODES for dbo in (False, True)]
    out: dict[str, Any] = {f"{label}/{'dbo' if dbo else 'serial'}": [] for label, dbo in designs}
    out.update({f"cpu:{label}/{'dbo' if dbo else 'serial'}": [] for label, dbo in designs})
    out["diff"] = {label: 0.0 for label, _ in MODES}
    out["microbatched"] = True
    q = case.tokens // 4
    for i in range(warmup + steps):
        g = torch.Generator().manual_seed(1000 * rank + i)
        # four requests of uneven lengths summing to the case's tokens: the token split cuts one
        lens = (q // 2, q + q // 2 + case.tokens % 4, q, q)
        chunks = [(r, torch.randint(0, vocab, (n,), generator=g).tolist()) for r, n in enumerate(lens)]
        batches = {}
        for label, _ in MODES:
            builders[label].reset()
            batches[label] = builders[label].build(chunks)
        logits: dict[tuple[str, bool], torch.Tensor] = {}
        k = i % len(designs)
        for label, dbo in designs[k:] + designs[:k]:
            dist.barrier()
            cpu0 = time.process_time()
            res = await runners[label].step(batches[label], enabled=dbo)
            cpu_s = time.process_time() - cpu0
            logits[label, dbo] = res.logits_TV
            if dbo and not res.record.microbatched:
                out["microbatched"] = False
            if i >= warmup:
                out[f"{label}/{'dbo' if dbo else 'serial'}"].append(res.step_s)
                out[f"cpu:{label}/{'dbo' if dbo else 'serial'}"].append(cpu_s)
        for label, _ in MODES:
            out["diff"][label] = max(out["diff"][label], float((logits[label, True] - logits[label, False]).abs().max()))
    return out


def hf_bench_rank(rank: int, world: int, case: HFCase, steps: int, warmup: int) -> dict[str, Any]:
    import asyncdbo

    return asyncdbo.run(_hf_rank_async, rank, world, case, steps, warmup)


HF_CASES = [
    HFCase(name=f"{arch} {size}, prefill {tokens} tok/rank", arch=arch, size=size, tokens=tokens)
    for size, tokens in (("tiny", 128), ("small", 512)) for arch in ("mixtral", "qwen3-moe", "deepseek-v3")
]
HF_QUICK_CASES = [HFCase(name="mixtral tiny, prefill 32 tok/rank", arch="mixtral", size="tiny", tokens=32)]


# ------------------------------------------------------------------ probes
def probe(threads: int) -> dict[str, Any]:
    """Which float32 GEMM row counts give a row other bits than the same row in a 512-row call,
    whether fixed 16/64-row tiles give every row the same bits wherever it sits, and how many of
    116 cuts (77 lengths, 39 offsets) change an elementwise op's bits. Runs in a fresh process per
    thread count."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    W_ND = torch.randn(256, 256, generator=g)
    X_MD = torch.randn(512, 256, generator=g)
    whole = torch.nn.functional.linear(X_MD, W_ND)
    rows_differ = [m for m in range(1, 65) if not torch.equal(torch.nn.functional.linear(X_MD[:m], W_ND), whole[:m])]
    tiles_ok = True
    for tile in (16, 64):
        ref = torch.nn.functional.linear(torch.cat([X_MD[:1], torch.zeros(tile - 1, 256)]), W_ND)[0]
        for off in range(tile):
            t = torch.randn(tile, 256, generator=g)
            t[off] = X_MD[0]
            tiles_ok &= bool(torch.equal(torch.nn.functional.linear(t, W_ND)[off], ref))
            n = 1 + off % 5
            b = torch.bmm(t.expand(n, tile, 256).contiguous(), W_ND.t().expand(n, 256, 256))
            tiles_ok &= bool(torch.equal(b[n - 1, off], ref))
    x = torch.randn(200_000, generator=g)
    cuts = [(0, n) for n in [*range(1, 70), 1000, 1001, 1007, 40000, 40001, 65537, 70001, 199999]]
    cuts += [(s, s + 1000) for s in range(1, 40)]
    elementwise = {}
    for name, fn in (("silu", torch.nn.functional.silu), ("sigmoid", torch.sigmoid), ("exp", torch.exp),
                     ("sin", torch.sin), ("cos", torch.cos), ("rsqrt", lambda t: torch.rsqrt(t.abs()))):
        ref = fn(x)
        elementwise[name] = sum(not torch.equal(fn(x[a:b]), ref[a:b]) for a, b in cuts)
    return {"threads": threads, "rows_differ": rows_differ, "tiles_ok": tiles_ok, "elementwise": elementwise,
            "cuts": len(cuts), "capability": torch.backends.cpu.get_cpu_capability()}


# ------------------------------------------------------------------ row tile sweep
def tile_sweep() -> list[dict[str, Any]]:
    """CPU ms of one forward of the demo's model on one rank (EP 1, one thread, median of 7) with
    the mode off and on at several row tiles: what picked ``ROW_TILE``."""
    import asyncio

    import asyncdbo.models.mini as mini
    import asyncdbo.moe.layer as layer
    import asyncdbo.moe.router as router
    from asyncdbo.cli.demo import DemoConfig, decode_chunks, prefill_chunks
    from asyncdbo.models import MiniModel
    from asyncdbo.serving import BatchBuilder

    torch.set_num_threads(1)
    rows = []
    for shape, tokens in (("prefill", 512), ("decode", 512), ("decode", 32)):
        dcfg = DemoConfig(ranks=1, shape=shape, tokens=tokens)
        row: dict[str, Any] = {"case": f"{shape} {tokens} {'tokens' if shape == 'prefill' else 'requests'}"}
        for label, tile in (("off", None), ("16", 16), ("32", 32), ("64", 64), ("128", 128)):
            for mod in (mini, layer, router):
                mod.ROW_TILE = tile or 64  # type: ignore[attr-defined]
            mcfg = replace(dcfg.model_config(), deterministic=tile is not None)
            model, builder = MiniModel(mcfg), BatchBuilder(mcfg.kv_cache_config)
            if shape == "decode":
                builder.build(decode_chunks(dcfg, 0, -1, mcfg.vocab_size, dcfg.context))
            batch = builder.build(prefill_chunks(dcfg, 0, 0, mcfg.vocab_size) if shape == "prefill"
                                  else decode_chunks(dcfg, 0, 0, mcfg.vocab_size, 1))
            samples = []
            for _ in range(8):
                t0 = time.process_time()
                asyncio.run(model.forward(batch.input_ids_T, batch.positions_T, batch.attn))
                samples.append(time.process_time() - t0)
            row[label] = statistics.median(samples[1:])
        rows.append(row)
    return rows


# ------------------------------------------------------------------ report
def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    s: dict[str, Any] = {"diff": {k: max(r["diff"][k] for r in per_rank) for k, _ in MODES},
                         "microbatched": all(r["microbatched"] for r in per_rank)}
    for key in per_rank[0]:
        if "/" in key and isinstance(per_rank[0][key], list):
            s[key] = {
                "med": max(statistics.median(r[key]) for r in per_rank),
                "min": max(min(r[key]) for r in per_rank),
                "max": max(max(r[key]) for r in per_rank),
            }
    return s


def table(results: list[tuple[Case, dict[str, Any]]]) -> list[str]:
    rows = [
        "| case | mode | serial ms [min..max] | DBO ms [min..max] | speedup (serial / DBO) | max abs diff DBO vs serial |",
        "|---|---|---|---|---:|---:|",
    ]
    for case, s in results:
        for label, _ in MODES:
            ser, dbo = s[f"{label}/serial"], s[f"{label}/dbo"]
            rows.append(
                f"| {case.name} | {label} | {ser['med'] * 1e3:.1f} [{ser['min'] * 1e3:.1f}..{ser['max'] * 1e3:.1f}] | "
                f"{dbo['med'] * 1e3:.1f} [{dbo['min'] * 1e3:.1f}..{dbo['max'] * 1e3:.1f}] | "
                f"{ser['med'] / dbo['med']:.2f}x | {s['diff'][label]:.3g} |"
            )
    rows += ["", "| case | CPU ms serial off / on | CPU ms DBO off / on | wall: serial on / off | wall: DBO on / off "
             "| CPU: serial on / off | CPU: DBO on / off |", "|---|---|---|---:|---:|---:|---:|"]
    for case, s in results:
        def r(key: str) -> float:
            return float(s[key.replace("X", "on")]["med"] / s[key.replace("X", "off")]["med"])

        rows.append(
            f"| {case.name} | {s['cpu:off/serial']['med'] * 1e3:.1f} / {s['cpu:on/serial']['med'] * 1e3:.1f} | "
            f"{s['cpu:off/dbo']['med'] * 1e3:.1f} / {s['cpu:on/dbo']['med'] * 1e3:.1f} | {r('X/serial'):.2f} | "
            f"{r('X/dbo'):.2f} | {r('cpu:X/serial'):.2f} | {r('cpu:X/dbo'):.2f} |")
    return rows


def probe_lines(probes: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| threads | GEMM 256x256: row counts 1..64 whose rows differ from a 512-row call | fixed 16/64-row tiles: same bits at every offset and in bmm | "
        + " | ".join(f"{k}: cuts that differ" for k in probes[0]["elementwise"]) + " |",
        "|---|---|---|" + "---:|" * len(probes[0]["elementwise"]),
    ]
    for p in probes:
        rows.append(f"| {p['threads']} | {p['rows_differ']} | {'yes' if p['tiles_ok'] else 'NO'} | "
                    + " | ".join(f"{v} / {p['cuts']}" for v in p["elementwise"].values()) + " |")
    return rows


FULL_CASES = [
    Case(name="prefill 512 tok/rank (the demo)", shape="prefill", tokens=512),
    Case(name="prefill 2048 tok/rank", shape="prefill", tokens=2048),
    Case(name="decode 512 req/rank, context 32 (the demo)", shape="decode", tokens=512),
    Case(name="decode 64 req/rank, context 512", shape="decode", tokens=64, context=512),
]
QUICK_CASES = [Case(name="decode 16 req/rank, 1 layer", shape="decode", tokens=16, layers=1, context=8, hidden=64, experts=4)]


def main(argv: list[str] | None = None, *, pool: Any = None) -> int:
    """``pool``: a live 2-rank :class:`asyncdbo.testing.RankPool` to run on, left open (the smoke
    test hands it the suite's shared ranks); default: start one and close it after."""
    import contextlib

    import _progress

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one tiny case (with --hf: one tiny HF case), 2 steps, print only (smoke test)")
    parser.add_argument("--hf", action="store_true", help="the Hugging Face models only (exact mode on and off)")
    parser.add_argument("--hf-steps", type=int, default=5, help="measured steps per HF case (default 5)")
    parser.add_argument("--steps", type=int, default=11, help="measured steps per case (default 11)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results, not with --quick)")
    _progress.add_quiet_flag(parser)
    args = parser.parse_args(argv)
    from _results import publish_results, results_preamble
    from asyncdbo.testing import RankPool

    cases = [] if args.hf else QUICK_CASES if args.quick else FULL_CASES
    hf_cases = [] if args.quick and not args.hf else HF_QUICK_CASES if args.quick else HF_CASES
    steps, warmup = (2, 1) if args.quick else (args.steps, 2)
    hf_steps, hf_warmup = (2, 1) if args.quick else (args.hf_steps, 1)
    flags = (" --quick" if args.quick else "") + (" --hf" if args.hf else "")
    lines, info = results_preamble(
        "Deterministic mode: serial and DBO step time with the mode on and off, 2 gloo ranks",
        f"python benchmarks/deterministic.py{flags}",
    )
    t_start = time.perf_counter()
    results: list[tuple[Any, dict[str, Any]]] = []
    hf_results: list[tuple[Any, dict[str, Any]]] = []
    extra = 0 if args.quick or args.hf else 2
    _progress.start(args.quiet, "cases on 2 ranks, then the probes", len(cases) + len(hf_cases) + extra)
    with RankPool(2, timeout_s=900) if pool is None else contextlib.nullcontext(pool) as pool:
        for case in cases:
            _progress.step(case.name)
            results.append((case, summarize(pool.run(bench_rank, case, steps, warmup))))
        for hcase in hf_cases:
            _progress.step(hcase.name)
            hf_results.append((hcase, summarize(pool.run(hf_bench_rank, hcase, hf_steps, hf_warmup))))
    no_probes = args.quick or args.hf
    if not no_probes:
        _progress.step("probes of asyncdbo.moe.batch_invariant, 1 and 2 threads")
    probes = [] if no_probes else [_in_subprocess(f"probe({t})") for t in (1, 2)]
    if not no_probes:
        _progress.step("tile sweep")
    sweep = [] if no_probes else _in_subprocess("tile_sweep()")
    _progress.done()
    if results:
        lines[-1] = lines[-1].rstrip("\n") + f" ({steps} measured steps after {warmup} warm-up, four designs per step)\n"
        lines.append(
            "Model: asyncdbo.models.MiniModel, hidden 256, 8 experts top-2, 1 shared expert, HT schedule, 2 layers; "
            "EP over both ranks, 2 ubatches (token split), real gloo all-to-all over loopback (no modeled link). "
            "Times: medians over steps of the slower rank; CPU: the rank process's CPU time over the same call.\n"
        )
        lines += table(results)
    if hf_results:
        lines += ["", f"Hugging Face models (asyncdbo.models.hf, random weights, float32), exact mode "
              f"(HFMoEModel(deterministic=...)) off and on, {hf_steps} measured steps after {hf_warmup} warm-up, "
              "four designs per step; EP over both ranks, HT schedule, 2 ubatches (token split: four requests "
              "per rank, one cut inside); 'small' is hidden 256, 8 heads, 8 experts top-2, 2 layers:", ""]
        lines += table(hf_results)
    results = results + hf_results
    not_split = [case.name for case, s in results if not s["microbatched"]]
    if not_split:
        lines.append(f"\nWARNING: some DBO steps did not microbatch in: {not_split}")
    if probes:
        lines += ["", f"Probes (CPU capability {probes[0]['capability']}), the facts asyncdbo.moe.batch_invariant relies on:", ""]
        lines += probe_lines(probes)
    if sweep:
        lines += ["", "Row tile (`ROW_TILE`): CPU ms of one forward, one rank, one thread, median of 7, mode off and on "
                  "with each tile:", "", "| case | off | 16 | 32 | 64 | 128 |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['case']} | " + " | ".join(f"{r[k] * 1e3:.1f}" for k in ("off", "16", "32", "64", "128")) + " |"
                  for r in sweep]
    lines.append(f"\nTotal benchmark time {time.perf_counter() - t_start:.0f} s.")
    text = "\n".join(lines) + "\n"
    publish_results(text, args.out if args.out is not None else (None if args.quick else RESULTS),
                    "deterministic_hf" if args.hf else "deterministic", info)
    return 0 if all(s["diff"]["on"] == 0.0 for _, s in results) else 1


def _in_subprocess(call: str) -> Any:
    """torch's thread count is fixed once work ran in a process: run each setting in a fresh one."""
    import json
    import subprocess

    code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import deterministic as d; print(json.dumps(d.{call}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


if __name__ == "__main__":
    raise SystemExit(main())
