"""``asyncdbo demo --model mixtral|qwen3-moe|deepseek-v3 [--weights DIR]``: a Hugging Face MoE
architecture on W local ranks, serial vs DBO, checked against transformers' own forward.

Without ``--weights`` the model is a tiny random one of the architecture (built offline from a
config), saved to a temporary checkpoint directory so that the ranks go through the same loading
path as a real checkpoint: shard by shard, each rank reading its own experts.  With ``--weights
DIR`` the ranks load that local directory (config.json + safetensors), and this process loads the
same directory into transformers for the reference, in float32 (the whole model: size the demo
for this machine's memory).

Every rank gets ``--tokens`` prompt tokens in 1-4 requests, then ``--steps`` greedy decode steps;
each step runs serially and then with DBO on a second KV cache, on the same inputs (the serial
run's tokens), so the two are timed back to back (after ``--warmup`` untimed generations on
throwaway caches).  The logits of both runs must match each other
and transformers' forward over the same tokens, and the greedy tokens must be identical, or the
command exits with status 1.
"""

# Shape legend: V = vocab.

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .progress import Progress, wants_progress
from .reasons import plural, why_unsplit

__all__ = ["HFDemoConfig", "hf_demo_rank", "main_hf", "threshold_hints"]

#: Max |logits diff| accepted as a match (serial vs DBO, and against transformers; fp32 CPU).
MATCH_ATOL = 1e-4


@dataclass(frozen=True, kw_only=True)
class HFDemoConfig:
    """Everything one ``--model`` demo run needs; identical on every rank."""

    model: str
    weights: str | None = None
    ranks: int = 2
    tokens: int = 512
    steps: int = 5
    warmup: int = 1
    schedule: str = "ht"
    stream_policy: str = "role"
    ubatches: int = 2
    loop: str = "auto"
    seed: int = 0
    prefill_threshold: int = 512
    decode_threshold: int = 32
    link: str | None = None
    link_scale: float = 1000.0
    progress: bool = False  # rank 0 keeps a "[i/N]" line on stderr (set when stderr is a terminal)

    def __post_init__(self) -> None:
        from ..models.hf import architecture

        architecture(self.model)  # unknown names: one ValueError listing the known ones
        if self.steps < 0 or self.warmup < 0:
            raise ValueError(f"--steps and --warmup must be >= 0 (got {self.steps}, {self.warmup})")
        for name in ("ranks", "tokens", "ubatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1 (got {getattr(self, name)})")
        if self.schedule not in ("ht", "ll"):
            raise ValueError(f"unknown MoE schedule {self.schedule!r}; use one of ('ht', 'll')")
        if self.stream_policy not in ("role", "ubatch"):
            raise ValueError(f"unknown --stream-policy {self.stream_policy!r}; use 'role' or 'ubatch'")
        self.link_spec()  # an unknown link or a bad scale: the mini demo's messages

    def link_spec(self) -> Any:
        from .demo_config import DemoConfig

        return DemoConfig(link=self.link, link_scale=self.link_scale).link_spec()


def _prompts(cfg: HFDemoConfig, rank: int, vocab: int) -> dict[int, list[int]]:
    """``cfg.tokens`` prompt tokens in 1-4 requests of uneven, seeded lengths."""
    g = torch.Generator().manual_seed(cfg.seed * 100003 + rank * 1009)
    num_reqs = min(cfg.tokens, int(torch.randint(1, 5, (1,), generator=g)))
    cuts = sorted(torch.randperm(cfg.tokens - 1, generator=g)[: num_reqs - 1].add(1).tolist()) if num_reqs > 1 else []
    bounds = [0, *cuts, cfg.tokens]
    ids = torch.randint(0, vocab, (cfg.tokens,), generator=g).tolist()
    return {r: ids[bounds[r]: bounds[r + 1]] for r in range(num_reqs)}


async def _rank_async(rank: int, world: int, cfg: HFDemoConfig, ckpt: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ..models.hf.checkpoint import load_checkpoint
    from ..models.hf.generate import greedy_generate
    from ..plan import ThresholdConfig
    from ..serving import BatchBuilder, DBORunner, RunnerConfig

    group = dist.group.WORLD if dist.is_initialized() and world > 1 else None
    blocks = (cfg.tokens + 4 * (cfg.steps + 1)) // 16 + 8  # every request's prompt and decode tokens
    model, report = load_checkpoint(ckpt, model=cfg.model, ep_group=group, schedule=cfg.schedule,
                                    max_ubatches=max(cfg.ubatches, 2), block_size=16, num_kv_blocks=blocks)
    rc = RunnerConfig(num_ubatches=cfg.ubatches, stream_policy=cfg.stream_policy,  # type: ignore[arg-type]
                      thresholds=ThresholdConfig(prefill_threshold=cfg.prefill_threshold,
                                                 decode_threshold=cfg.decode_threshold),
                      backend="host" if cfg.link else "auto", link=cfg.link_spec())
    prompts = _prompts(cfg, rank, model.hf.vocab_size)
    barrier = dist.barrier if group is not None else None
    show = cfg.progress and rank == 0
    for w in range(cfg.warmup):  # untimed, on throwaway caches: first-call costs (gloo, allocator)
        if show:
            _show(f"warm-up generation {w + 1} of {cfg.warmup} (untimed)")
        warm = [(DBORunner(model.with_fresh_cache(), rc, dp_group=group), mode) for mode in (False, True)]
        await greedy_generate(warm, BatchBuilder(model.kv_cache_config), prompts, decode_steps=min(cfg.steps, 1),
                              barrier=barrier)
    runners = [(DBORunner(model, rc, dp_group=group), False),
               (DBORunner(model.with_fresh_cache(), rc, dp_group=group), True)]

    def on_step(i: int, n: int) -> None:
        _show(f"[{i + 1}/{n}] {'prefill' if i == 0 else f'decode step {i}'}: serial, then DBO")

    serial, dbo = await greedy_generate(runners, BatchBuilder(model.kv_cache_config), prompts,
                                        decode_steps=cfg.steps, barrier=barrier, on_step=on_step if show else None)
    moe = next(layer.moe for layer in model.layers if layer.moe is not None)
    return {"serial": serial, "dbo": dbo, "experts": (moe.first_expert, moe.first_expert + moe.experts_per_rank - 1),
            "read": len(report.tensors_read), "shards": len(report.shards)}


def _show(text: str) -> None:
    """Rank 0's status line on stderr (the parent's terminal), rewritten in place; the parent
    erases it before printing the table."""
    sys.stderr.write(f"{_ERASE}{text} ...")
    sys.stderr.flush()


_ERASE = "\r\033[K"


def hf_demo_rank(rank: int, world: int, cfg: HFDemoConfig, ckpt: str) -> dict[str, Any]:
    """The work of one rank (the process group is already initialised); SIGUSR1 prints its
    ubatches' await chains."""
    from ..dbo import run
    from ..observe import install_stack_dump_signal

    install_stack_dump_signal()
    return run(_rank_async, rank, world, cfg, ckpt, loop=cfg.loop)  # type: ignore[arg-type]


def _reference(cfg: HFDemoConfig) -> Any:
    """The transformers model: the tiny random one, or the checkpoint loaded in float32."""
    from ..models.hf.reference import tiny_hf_model

    if cfg.weights is None:
        return tiny_hf_model(cfg.model, seed=cfg.seed)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its loading bar is no part of the demo's output

    from ..models.hf.checkpoint import read_config

    config = read_config(cfg.weights)
    config._experts_implementation = "eager"
    return AutoModelForCausalLM.from_pretrained(cfg.weights, config=config, local_files_only=True,
                                                attn_implementation="eager", dtype=torch.float32).eval()


def threshold_hints(records_by_rank: list[list[Any]], *, prefill_threshold: int, decode_threshold: int) -> list[str]:
    """Lines for the DBO steps that stayed serial because a rank fell below a threshold: how many,
    the token counts of the ranks with requests, and the flag value that would split those steps.

    ``records_by_rank[r]`` are rank ``r``'s :class:`~asyncdbo.plan.StepRecord` of the DBO run, step
    0 the prefill and the rest decode steps (the demo's order). A rank's token count comes from
    its vote (``rec.ranks``), or from its own record without a DP group. A lower threshold only
    passes the threshold test: a step can still fall back for another reason, which its record
    then names."""
    from ..plan import PlanReason

    below = PlanReason.BELOW_THRESHOLD
    lines = []
    for flag, current, kind, steps in (("--prefill-threshold", prefill_threshold, "prefill", slice(0, 1)),
                                       ("--decode-threshold", decode_threshold, "decode", slice(1, None))):
        per_step = list(zip(*(recs[steps] for recs in records_by_rank)))
        counts, fell = [], 0
        for recs in per_step:
            if any(rec.microbatched for rec in recs):
                continue
            votes = recs[0].ranks
            if votes:
                if not any(v.reason is below for v in votes):
                    continue
                counts += [v.num_tokens_unpadded for v in votes if v.num_tokens_unpadded > 0]
            else:
                if not any(rec.reason is below for rec in recs):
                    continue
                counts += [sum(rec.ubatch_num_tokens) for rec in recs if sum(rec.ubatch_num_tokens) > 0]
            fell += 1
        if not fell:
            continue
        lo, hi = min(counts), max(counts)
        lines.append(f"{fell} of {plural(len(per_step), kind + ' step')} ran unsplit, below the threshold: a rank "
                     f"splits a {kind} batch from {plural(current, 'token')} up ({flag} {current}), and the ranks "
                     f"with requests had {f'{lo} to {hi}' if hi != lo else lo} tokens; {flag} {lo} would split "
                     "them")
    if lines:
        lines.append("(the thresholds' defaults are vLLM's, for a real engine's batches: measure where DBO pays "
                     "before lowering them, docs/integration.md, section 5)")
    return lines


def _below_threshold(recs: tuple[Any, ...]) -> bool:
    """Whether a step that did not microbatch (its record on every rank) fell below a threshold
    somewhere: what :func:`threshold_hints` explains."""
    from ..plan import PlanReason

    below = PlanReason.BELOW_THRESHOLD
    return any(rec.reason is below or any(v.reason is below for v in rec.ranks) for rec in recs)


def _report(cfg: HFDemoConfig, hf_model: Any, per_rank: list[dict[str, Any]], where: str,
            before_print: Callable[[], None] = lambda: None) -> int:
    from ..models.hf.generate import compare_with_hf, worst_diff

    hf = hf_model.config
    diff = worst_diff(float((rows - r["dbo"].logits[req]).abs().max())
                      for r in per_rank for req, rows in r["serial"].logits.items())
    parity = {mode: [compare_with_hf(hf_model, r[mode]) for r in per_rank] for mode in ("serial", "dbo")}

    def step_ms(mode: str, steps: slice) -> float:
        per_step = zip(*(r[mode].step_s[steps] for r in per_rank))  # slowest rank per step
        values = [max(s) for s in per_step]
        return statistics.median(values) * 1e3 if values else 0.0

    lines = [
        f"asyncdbo demo: {cfg.model} ({type(hf_model).__name__}: {plural(hf.num_hidden_layers, 'layer')}, hidden "
        f"{hf.hidden_size}, vocab {hf.vocab_size}), {plural(cfg.ranks, 'rank')} x {plural(cfg.tokens, 'prompt token')} + "
        f"{plural(cfg.steps, 'decode step')} after {cfg.warmup} warm-up, schedule {cfg.schedule}, stream policy "
        f"{cfg.stream_policy}, {plural(cfg.ubatches, 'ubatch', 'ubatches')}, "
        f"loop {cfg.loop}",
        f"weights: {where}; each rank read {per_rank[0]['read']} tensors from {per_rank[0]['shards']} shard(s), "
        "routed experts by rank: " + " ".join(f"{a}-{b}" for a, b in (r["experts"] for r in per_rank)),
        ("comm: real gloo all-to-all over loopback (it shares the CPU with compute)" if cfg.link is None else
         f"comm: MODELED LINK {cfg.link} x{cfg.link_scale:g} (the real all-to-all runs, its completion is released "
         "on the modeled link)"),
        "",
    ]
    rows = [("", "serial", "DBO", "speedup", "")]
    for label, steps in (("prefill step", slice(0, 1)), ("decode step (median)", slice(1, None))):
        if steps == slice(1, None) and cfg.steps == 0:
            continue
        s, d = step_ms("serial", steps), step_ms("dbo", steps)
        split, total = microbatched(per_rank, steps)
        if split == 0:  # DBO ran these steps serially: a ratio of two serial runs is noise
            speedup = "-"
            note = f"(no speedup: {'the step did not microbatch' if total == 1 else f'none of the {total} steps microbatched'})"
        else:
            speedup = f"{s / d:.2f}x" if d else ""
            per_step = [max(a) / max(b) for a, b in zip(zip(*(r["serial"].step_s[steps] for r in per_rank)),
                                                          zip(*(r["dbo"].step_s[steps] for r in per_rank))) if max(b) > 0]
            spread = ("one step: a single sample" if len(per_step) <= 1 else
                      f"medians of {len(per_step)} steps, per-step speedups {min(per_step):.2f}-{max(per_step):.2f}x")
            note = (f"(microbatched; {spread})" if total == 1 else
                    f"(microbatched: {'all' if split == total else split} of {total}; {spread})")
        rows.append((label, f"{s:.2f} ms", f"{d:.2f} ms", speedup, note))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines += [f"  {a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {e:>{widths[3]}}  {n}".rstrip()
              for a, b, c, e, n in rows]
    lines += ["", "speedup = serial step time / DBO step time (above 1x: DBO is faster)"]
    per_step = [recs for recs in zip(*(r["dbo"].records for r in per_rank))]
    unsplit = [recs for recs in per_step if not any(rec.microbatched for rec in recs)]
    if not unsplit:
        lines.append("DBO steps: microbatched, every step on every rank")
    else:
        lines.append(f"DBO steps: {len(unsplit)} of {plural(len(per_step), 'step')} ran unsplit (one batch per rank, "
                     "as in the serial run):")
        lines += ["  " + h for h in threshold_hints([r["dbo"].records for r in per_rank],
                                                     prefill_threshold=cfg.prefill_threshold,
                                                     decode_threshold=cfg.decode_threshold)]
        lines += ["  " + w for w in why_unsplit(recs[0] for recs in unsplit if not _below_threshold(recs))]
    ok_dbo = diff <= MATCH_ATOL
    lines.append(f"outputs serial vs DBO: max |logits diff| = {diff:.3g} "
                 f"({'bitwise equal' if diff == 0 else 'match' if ok_dbo else 'MISMATCH'}, tolerance {MATCH_ATOL:g})")
    worst = {mode: worst_diff(p.max_abs_diff for p in ps) for mode, ps in parity.items()}
    equal = sum(p.greedy_equal for ps in parity.values() for p in ps)
    total = sum(p.greedy_total for ps in parity.values() for p in ps)
    ok_hf = worst_diff(worst.values()) <= MATCH_ATOL and equal == total
    lines.append(f"vs transformers ({type(hf_model).__name__} forward, eager fp32, over each request's tokens): "
                 f"max |logits diff| = {worst['serial']:.3g} serial, {worst['dbo']:.3g} DBO; greedy tokens "
                 f"{equal}/{total} identical ({'match' if ok_hf else 'MISMATCH'}, tolerance {MATCH_ATOL:g})")
    before_print()
    print("\n".join(lines))
    return 0 if ok_dbo and ok_hf else 1


def microbatched(per_rank: list[dict[str, Any]], steps: slice) -> tuple[int, int]:
    """How many of the DBO run's ``steps`` microbatched on every rank, and how many there were."""
    per_step = list(zip(*(r["dbo"].records[steps] for r in per_rank)))
    return sum(all(rec.microbatched for rec in s) for s in per_step), len(per_step)


def main_hf(args: argparse.Namespace) -> int:
    """``asyncdbo demo --model ...``: start the ranks here, load, run, compare, print."""
    from ..testing.ranks import RankError
    from . import demo_config
    from .inputs import check_timeout

    try:
        if importlib.util.find_spec("transformers") is None:
            raise ValueError("--model needs transformers (configs and the reference), the optional 'hf' extra: in your "
                             "asyncdbo clone, pip install -e '.[hf]' (asyncdbo is not on PyPI yet)")
        if args.launcher != "local":
            raise ValueError("--model runs with --launcher local only")
        if args.model == "mini":
            raise ValueError("--weights needs --model mixtral, qwen3-moe or deepseek-v3")
        _refuse_mini_only_flags(args)
        timeout_s = check_timeout("--timeout", args.timeout)
        cfg = HFDemoConfig(model=args.model, weights=args.weights, ranks=args.ranks, tokens=args.tokens,
                           steps=args.steps, warmup=args.warmup, schedule=args.schedule, stream_policy=args.stream_policy,
                           ubatches=args.ubatches, loop=args.loop, seed=args.seed,
                           prefill_threshold=args.prefill_threshold, decode_threshold=args.decode_threshold,
                           link=None if args.link == "none" else args.link, link_scale=args.link_scale,
                           progress=wants_progress(getattr(args, "quiet", False)))
        if cfg.weights is None:
            hf_model = _reference(cfg)
            config = hf_model.config
        else:
            from ..models.hf import architecture_for
            from ..models.hf.checkpoint import read_config

            config = read_config(cfg.weights)
            if architecture_for(config).name != cfg.model:
                raise ValueError(f"{cfg.weights}/config.json: model_type {config.model_type!r} is a "
                                 f"{architecture_for(config).name} checkpoint, not {cfg.model}; "
                                 f"pass --model {architecture_for(config).name}")
        experts = _num_experts(config)
        if experts % cfg.ranks:
            raise ValueError(f"the model's {experts} routed experts do not divide over --ranks {cfg.ranks}: "
                             f"each rank owns an equal share; use a divisor of {experts}")
        if cfg.weights is not None:  # before any rank starts (the tiny random models are small)
            from .demo_memory import check_memory_hf

            check_memory_hf(config, model=cfg.model, ranks=cfg.ranks, tokens=cfg.tokens, steps=cfg.steps,
                            reference=True)
    except ValueError as exc:
        print(f"asyncdbo demo: error: {exc}", file=sys.stderr)
        return 2
    progress = Progress(cfg.steps + 1, f"steps (a prefill, then {cfg.steps} decode; each serial, then DBO) "
                        f"after {cfg.warmup} untimed warm-up generation(s) on {cfg.ranks} ranks",
                        enabled=cfg.progress)
    with tempfile.TemporaryDirectory(prefix="asyncdbo-demo-") as tmp:
        if cfg.weights is None:
            progress.note("saving the tiny random model as a checkpoint")
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            hf_model.save_pretrained(tmp, max_shard_size="50KB")
            where = f"a tiny random {type(hf_model).__name__} (seed {cfg.seed}) saved to a temporary checkpoint"
        else:
            where = cfg.weights
        try:
            # --timeout bounds each collective (the group's timeout), not the run.
            progress.note(f"starting {cfg.ranks} ranks, each loading its share of the checkpoint")
            with demo_config.start_ranks(cfg.ranks, timeout_s) as pool:
                per_rank = pool.run(hf_demo_rank, cfg, cfg.weights or tmp, timeout_s=math.inf)
        except RankError as exc:
            progress.done()
            print(f"asyncdbo demo: error: {exc.root_line()}", file=sys.stderr)
            return 1
    if cfg.weights is not None:  # after the ranks: their loader names a broken file and tensor first
        progress.note(f"loading {cfg.weights} into transformers for the reference")
        hf_model = _reference(cfg)
    progress.note("comparing with transformers' forward")
    code = _report(cfg, hf_model, per_rank, where, before_print=progress.done)
    return code


#: Flags of the mini model's demo that ``--model`` takes from the config or does not have.
MINI_ONLY = ("layers", "experts", "top_k", "hidden", "shape", "context", "trace")


def _refuse_mini_only_flags(args: argparse.Namespace) -> None:
    from .demo_config import DemoConfig

    defaults = DemoConfig()
    for name in MINI_ONLY:
        if getattr(args, name) != getattr(defaults, name):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} is not used with --model (the sizes come from the model's config.json; "
                             "prefill then decode is what every run does); drop it")


def _num_experts(hf: Any) -> int:
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(hf, name, None):
            return int(getattr(hf, name))
    raise ValueError(f"the config of model_type {getattr(hf, 'model_type', None)!r} names no routed experts")
