"""Exact mode of the Hugging Face models: the functions its tests run, in process or on RankPool
ranks (module level: pickled by name).

One *combo* is a model (an architecture with config overrides), a dtype and a DBO variant
(schedule, stream policy, ubatch count, split policy).  :func:`exact_combo` builds the model on
every rank of the group (the same seeded weights everywhere, each rank keeping its own experts),
runs the same steps twice, serially and with DBO, each run on its own KV cache, and reports
per step whether the logits are ``torch.equal`` and, after the last step, whether both KV caches
are.  The steps: a prefill whose long request the token split cuts inside, then a chunked
prefill (that request's next chunk, a new request's first chunk) mixed with decode tokens, then
pure decode; a rank listed in ``idle`` has no requests in that step and runs padding-only
ubatches.

Legend (shape suffixes): T tokens, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import asyncdbo
from asyncdbo.models.hf import from_hf_model
from asyncdbo.models.hf.generate import worst_diff
from asyncdbo.models.hf.reference import tiny_hf_model
from asyncdbo.plan import ThresholdConfig
from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

ALWAYS = ThresholdConfig(decode_threshold=1, prefill_threshold=1)
VOCAB = 96  # every tiny config's vocab_size

#: name -> (architecture, overrides of its tiny config).  The first three are the project's
#: tiny configs; the others differ in routing (top-1 of 6 experts, top-3 with
#: renormalised weights, top-4 over one group without two shared experts) and in RoPE (linear, yarn,
#: llama3, DeepSeek's non-interleaved), plus tied embeddings, q/k/v biases, no q LoRA, no dense
#: layer and a wider model (hidden 128, head dim 64) whose GEMMs take the vectorised paths.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", {}),
    "qwen3-moe": ("qwen3-moe", {}),
    "deepseek-v3": ("deepseek-v3", {}),
    "mixtral-top1-linear-tied": ("mixtral", dict(
        num_local_experts=6, num_experts_per_tok=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen3-top3-yarn-bias-wide": ("qwen3-moe", dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=64, intermediate_size=96,
        moe_intermediate_size=48, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[],
        attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024})),
    "deepseek-top4-llama3-flat": ("deepseek-v3", dict(
        q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2, first_k_dense_replace=0,
        num_experts_per_tok=4, norm_topk_prob=False, routed_scaling_factor=1.0, rope_interleave=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256})),
}


@dataclass(frozen=True, kw_only=True)
class Combo:
    model: str
    dtype: str = "float32"
    schedule: str = "ht"
    stream_policy: str = "role"
    num_ubatches: int = 2
    policy: str = "token"
    idle: tuple[tuple[int, int], ...] = ()  # (step, rank) pairs where the rank has no requests

    def runner_config(self) -> RunnerConfig:
        return RunnerConfig(thresholds=ALWAYS, stream_policy=self.stream_policy,  # type: ignore[arg-type]
                            num_ubatches=self.num_ubatches, policy=self.policy)  # type: ignore[arg-type]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def steps_for(rank: int, combo: Combo) -> list[list[tuple[int, list[int]]]]:
    """This rank's three steps of ``(request id, token ids)`` chunks (module docstring).  Request
    1's first chunk has ``97 + 13 * rank`` tokens, so the token split cuts it at another place on
    every rank and for every ubatch count; its second chunk continues it."""
    s = 100 * rank
    steps = [
        [(0, _tokens(9 + rank, s + 1)), (1, _tokens(97 + 13 * rank, s + 2)), (2, _tokens(5, s + 3))],
        [(0, _tokens(1, s + 4)), (1, _tokens(70, s + 5)), (2, _tokens(1, s + 6)), (3, _tokens(23, s + 7))],
        [(r, _tokens(1, s + 10 + r)) for r in range(4)],
    ]
    return [[] if (i, rank) in combo.idle else chunks for i, chunks in enumerate(steps)]


async def _exact_combo(rank: int, combo: Combo, deterministic: bool) -> dict[str, Any]:
    group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
    arch, overrides = MODELS[combo.model]
    dtype = getattr(torch, combo.dtype)
    hf = tiny_hf_model(arch, **overrides)
    model = from_hf_model(hf, ep_group=group, schedule=combo.schedule, max_ubatches=combo.num_ubatches, block_size=4,
                          num_kv_blocks=256, dtype=dtype, deterministic=deterministic)
    twin = model.with_fresh_cache()
    cfg = combo.runner_config()
    serial, dbo = DBORunner(model, cfg, dp_group=group), DBORunner(twin, cfg, dp_group=group)
    builder = BatchBuilder(model.kv_cache_config)
    out: dict[str, Any] = {"equal": [], "max_abs_diff": 0.0, "cuts": [], "microbatched": []}
    for chunks in steps_for(rank, combo):
        batch = builder.build(chunks)
        s = await serial.step(batch, enabled=False)
        d = await dbo.step(batch)
        out["equal"].append(torch.equal(s.logits_TV, d.logits_TV))
        if batch.num_tokens:
            diff = (s.logits_TV.float() - d.logits_TV.float()).abs().max().item()
            out["max_abs_diff"] = worst_diff([out["max_abs_diff"], diff])
        out["cuts"].append(d.record.ubatch_num_tokens)
        out["microbatched"].append(d.record.microbatched and not s.record.microbatched)
    caches = (model.kv_cache, twin.kv_cache)
    out["kv_equal"] = all(torch.equal(a, b) for a, b in zip(*(c.k_cache_LNZHK + c.v_cache_LNZHK for c in caches)))
    out["kv_nonzero"] = any(bool(k.abs().sum() > 0) for k in model.kv_cache.k_cache_LNZHK)
    return out


def exact_combos(rank: int, world_size: int, combos: list[Combo], deterministic: bool = True) -> dict[Combo, Any]:
    """Every combo on this rank, in one call (one pool round for many cases)."""
    return {c: asyncdbo.run(_exact_combo, rank, c, deterministic) for c in combos}  # type: ignore[arg-type]
