"""``asyncdbo demo --model llama|qwen3 --tp N [--weights DIR] [--link ib400]``: a dense Hugging Face
architecture tensor-parallel over N local ranks, serial vs DBO, checked against transformers.

Without ``--weights`` the model is a tiny random one (built offline from a config), saved as a
sharded checkpoint that each rank reads its blocks of (rows of the column-parallel weights,
columns of the row-parallel ones, vocabulary rows of the embedding and the LM head), as it would
a real one; with ``--weights DIR`` the ranks load that directory and this process loads it into
transformers (float32) for the reference.

Every rank of the TP group runs the same requests: ``--tokens`` prompt tokens in 1-4 requests,
then ``--steps`` greedy decode steps; each step runs serially and then with DBO on a second KV
cache, back to back on the same inputs, after ``--warmup`` untimed generations.  The generation
is repeated ``--repeats`` times on fresh caches; each back-to-back pair is one sample of the
speedup (serial / DBO step time of the slowest rank), printed as the median of N samples with
their min-max.  The logits of both runs must match each other and transformers' forward over the
same tokens, every rank must hold the same logits, and the greedy tokens must be transformers',
or the command exits with status 1.
"""

# Shape legend: V = vocab.

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from .demo_hf import MATCH_ATOL
from .progress import Progress, wants_progress

__all__ = ["TPDemoConfig", "main_tp", "speedup_samples", "tp_demo_rank"]


@dataclass(frozen=True, kw_only=True)
class TPDemoConfig:
    """Everything one ``--model llama|qwen3`` demo run needs; identical on every rank."""

    model: str
    weights: str | None = None
    tp: int = 2
    tokens: int = 512
    steps: int = 5
    warmup: int = 1
    repeats: int = 3
    stream_policy: str = "role"
    ubatches: int = 2
    loop: str = "auto"
    seed: int = 0
    prefill_threshold: int = 512
    decode_threshold: int = 32
    link: str | None = None
    link_scale: float = 1000.0
    sequence_parallel: bool = False
    progress: bool = False

    def __post_init__(self) -> None:
        from ..models.tp import dense_architecture

        dense_architecture(self.model)
        for name in ("tp", "tokens", "ubatches", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1 (got {getattr(self, name)})")
        if self.steps < 0 or self.warmup < 0:
            raise ValueError(f"--steps and --warmup must be >= 0 (got {self.steps}, {self.warmup})")
        if self.stream_policy not in ("role", "ubatch"):
            raise ValueError(f"unknown --stream-policy {self.stream_policy!r}; use 'role' or 'ubatch'")
        self.link_spec()

    def link_spec(self) -> Any:
        from .demo_config import DemoConfig

        return DemoConfig(link=self.link, link_scale=self.link_scale).link_spec()


async def _rank_async(rank: int, world: int, cfg: TPDemoConfig, ckpt: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ..models.hf.generate import greedy_generate
    from ..models.tp import load_tp_checkpoint
    from ..plan import ThresholdConfig
    from ..serving import BatchBuilder, DBORunner, RunnerConfig
    from .demo_hf import _prompts

    group = dist.group.WORLD if dist.is_initialized() and world > 1 else None
    blocks = (cfg.tokens + 4 * (cfg.steps + 1)) // 16 + 8
    model, report = load_tp_checkpoint(ckpt, model=cfg.model, tp_group=group, max_ubatches=max(cfg.ubatches, 2),
                                       block_size=16, num_kv_blocks=blocks, sequence_parallel=cfg.sequence_parallel)
    rc = RunnerConfig(num_ubatches=cfg.ubatches, stream_policy=cfg.stream_policy,  # type: ignore[arg-type]
                      thresholds=ThresholdConfig(prefill_threshold=cfg.prefill_threshold,
                                                 decode_threshold=cfg.decode_threshold),
                      backend="host" if cfg.link else "auto", link=cfg.link_spec())
    prompts = _prompts(cfg, 0, model.hf.vocab_size)  # type: ignore[arg-type]  # every TP rank: the same requests
    barrier = dist.barrier if group is not None else None
    gens = []
    for i in range(cfg.warmup + cfg.repeats):
        runners = [(DBORunner(model.with_fresh_cache(), rc, dp_group=group), mode) for mode in (False, True)]
        steps = min(cfg.steps, 1) if i < cfg.warmup else cfg.steps
        gen = await greedy_generate(runners, BatchBuilder(model.kv_cache_config), prompts, decode_steps=steps,
                                    barrier=barrier)
        if i >= cfg.warmup:
            gens.append(gen)
    first = {"serial": gens[0][0], "dbo": gens[0][1]}
    return {**first, "times": [(g[0].step_s, g[1].step_s) for g in gens], "read": len(report.tensors_read),
            "shards": len(report.shards), "kept": model.slots.numel(),
            "heads": model.layers[0]["attention"].num_heads}


def tp_demo_rank(rank: int, world: int, cfg: TPDemoConfig, ckpt: str) -> dict[str, Any]:
    from ..dbo import run

    return run(_rank_async, rank, world, cfg, ckpt, loop=cfg.loop)  # type: ignore[arg-type]


def speedup_samples(per_rank: list[dict[str, Any]], decode: bool) -> tuple[list[float], list[float], list[float]]:
    """Serial and DBO step times (slowest rank) and their ratios, one per back-to-back pair:
    the prefill of every repeat, or every decode step of every repeat."""
    serial, dbo = [], []
    for rep in range(len(per_rank[0]["times"])):
        steps = range(1, len(per_rank[0]["times"][rep][0])) if decode else range(1)
        for s in steps:
            serial.append(max(r["times"][rep][0][s] for r in per_rank))
            dbo.append(max(r["times"][rep][1][s] for r in per_rank))
    return serial, dbo, [a / b for a, b in zip(serial, dbo)]


def _report(cfg: TPDemoConfig, hf_model: Any, per_rank: list[dict[str, Any]], where: str) -> int:
    from ..models.hf.generate import compare_with_hf, worst_diff
    from .demo_hf import microbatched

    hf = hf_model.config
    diff = worst_diff(float((rows - r["dbo"].logits[req]).abs().max())
                      for r in per_rank for req, rows in r["serial"].logits.items())
    same = all(torch.equal(r[m].logits[q], per_rank[0][m].logits[q]) for r in per_rank for m in ("serial", "dbo")
               for q in r[m].logits)
    parity = {mode: compare_with_hf(hf_model, per_rank[0][mode]) for mode in ("serial", "dbo")}
    lines = [
        f"asyncdbo demo: {cfg.model} ({type(hf_model).__name__}: {hf.num_hidden_layers} layers, hidden "
        f"{hf.hidden_size}, {hf.num_attention_heads} heads, vocab {hf.vocab_size}), tensor-parallel over {cfg.tp} "
        f"ranks ({per_rank[0]['heads']} heads each{', sequence-parallel' if cfg.sequence_parallel else ''}), "
        f"{cfg.tokens} prompt tokens + {cfg.steps} decode steps, x{cfg.repeats} after {cfg.warmup} warm-up, "
        f"stream policy {cfg.stream_policy}, {cfg.ubatches} ubatches",
        f"weights: {where}; each rank read its block of {per_rank[0]['read']} tensors from {per_rank[0]['shards']} "
        f"shard(s), keeping {per_rank[0]['kept']:,} of the model's {sum(p.numel() for p in hf_model.parameters()):,} "
        "values",
        ("comm: real gloo all-reduce over loopback (it shares the CPU with compute)" if cfg.link is None else
         f"comm: MODELED LINK {cfg.link} x{cfg.link_scale:g} (the real all-reduce runs, its completion is released "
         "on the modeled link)"),
        "",
    ]
    rows = [("", "serial", "DBO", "speedup (median, min-max, N)", "")]
    for label, decode in (("prefill step", False), ("decode step", True)):
        if decode and cfg.steps == 0:
            continue
        s, d, ratio = speedup_samples(per_rank, decode)
        split, total = microbatched(per_rank, slice(1, None) if decode else slice(0, 1))
        if split == 0:
            speed, note = "-", "(not microbatched: below its --" + ("decode" if decode else "prefill") + "-threshold)"
        else:
            speed = f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}, N={len(ratio)})"
            note = "(microbatched)" if split == total else f"(microbatched: {split} of {total})"
        rows.append((label, f"{statistics.median(s) * 1e3:.2f} ms", f"{statistics.median(d) * 1e3:.2f} ms", speed, note))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines += [f"  {a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {e:>{widths[3]}}  {n}".rstrip()
              for a, b, c, e, n in rows]
    lines += ["", "speedup = serial step time / DBO step time of the slowest rank, one sample per back-to-back pair"]
    ok_dbo = diff <= MATCH_ATOL and same
    lines.append(f"outputs serial vs DBO: max |logits diff| = {diff:.3g} "
                 f"({'bitwise equal' if diff == 0 else 'match' if diff <= MATCH_ATOL else 'MISMATCH'}, tolerance "
                 f"{MATCH_ATOL:g}); every rank's logits {'identical' if same else 'DIFFER'}")
    worst = worst_diff(p.max_abs_diff for p in parity.values())
    equal = sum(p.greedy_equal for p in parity.values())
    total = sum(p.greedy_total for p in parity.values())
    ok_hf = worst <= MATCH_ATOL and equal == total
    lines.append(f"vs transformers ({type(hf_model).__name__} forward, eager fp32): max |logits diff| = "
                 f"{parity['serial'].max_abs_diff:.3g} serial, {parity['dbo'].max_abs_diff:.3g} DBO; greedy tokens "
                 f"{equal}/{total} identical ({'match' if ok_hf else 'MISMATCH'}, tolerance {MATCH_ATOL:g})")
    print("\n".join(lines))
    return 0 if ok_dbo and ok_hf else 1


def main_tp(args: argparse.Namespace) -> int:
    """``asyncdbo demo --model llama|qwen3 --tp N``: start the ranks, load, run, compare, print."""
    from ..testing.ranks import RankError
    from . import demo_config
    from .demo_hf import _reference, _refuse_mini_only_flags
    from .inputs import check_timeout

    try:
        if args.launcher != "local":
            raise ValueError("--model llama|qwen3 runs with --launcher local only")
        _refuse_mini_only_flags(args)
        timeout_s = check_timeout("--timeout", args.timeout)
        cfg = TPDemoConfig(model=args.model, weights=args.weights, tp=args.tp or 2, tokens=args.tokens,
                           steps=args.steps, warmup=args.warmup, repeats=args.repeats, stream_policy=args.stream_policy,
                           ubatches=args.ubatches, loop=args.loop, seed=args.seed,
                           prefill_threshold=args.prefill_threshold, decode_threshold=args.decode_threshold,
                           link=None if args.link == "none" else args.link, link_scale=args.link_scale,
                           sequence_parallel=args.sequence_parallel,
                           progress=wants_progress(getattr(args, "quiet", False)))
        from ..models.hf.reference import tiny_hf_model

        from ..models.hf.checkpoint import read_config
        from ..models.tp.shards import check_tp_size

        hf_model = tiny_hf_model(cfg.model, seed=cfg.seed) if cfg.weights is None else None
        check_tp_size(hf_model.config if hf_model is not None else read_config(str(cfg.weights)), cfg.tp)
    except ValueError as exc:
        print(f"asyncdbo demo: error: {exc}", file=sys.stderr)
        return 2
    progress = Progress(1, f"{cfg.warmup + cfg.repeats} generations on {cfg.tp} TP ranks", enabled=cfg.progress)
    with tempfile.TemporaryDirectory(prefix="asyncdbo-demo-") as tmp:
        if hf_model is not None:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            hf_model.save_pretrained(tmp, max_shard_size="50KB")
            where = f"a tiny random {type(hf_model).__name__} (seed {cfg.seed}) saved to a temporary sharded checkpoint"
        else:
            where = str(cfg.weights)
        try:
            progress.note(f"starting {cfg.tp} ranks, each loading its blocks of the checkpoint")
            with demo_config.start_ranks(cfg.tp, timeout_s) as pool:
                per_rank = pool.run(tp_demo_rank, cfg, cfg.weights or tmp, timeout_s=math.inf)
        except RankError as exc:
            progress.done()
            print(f"asyncdbo demo: error: {exc.root_line()}", file=sys.stderr)
            return 1
    if hf_model is None:
        hf_model = _reference(cfg)  # type: ignore[arg-type]
    progress.done()
    return _report(cfg, hf_model, per_rank, where)
