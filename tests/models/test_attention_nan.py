"""Batched attention equals per-request attention, and reads no NaN, on poisoned ragged batches.

Issue 45: in bfloat16 the batched attention gave a padding query row (a request's queries padded
to the longest run of the call) no visible key; its softmax was NaN, and a bf16 CPU matmul spreads
a NaN row of one ``[Q, S]`` matrix into the real row it is packed with, so the shorter requests of
a mixed prefill got NaN logits (float32 kept them apart). Padding rows now see key position 0.

These tests run every batched attention path of the library against a per-request reference on
random ragged batches (prefills, decode tokens, chunked-prefill continuations, all of them mixed;
1 to 64 requests of 1 to 300 tokens of context) in float32 and bfloat16, with everything the call
must not read poisoned with NaN: every KV cache slot no token wrote (the rest of a request's last
block, free blocks, the other layer) and the padding rows of the queries past
``num_actual_tokens`` (the runner's padded batch). The functions allocate their outputs
themselves (zeros), so a caller's buffers are all there is to poison. The paths:

* :func:`~asyncdbo.models.attention.paged_causal_attention` (the mini model's: as many cached heads
  as query heads): its ragged batched path, its uniform-decode path, and ``deterministic=True``
  (:func:`~asyncdbo.models.tiled_attention.tiled_causal_attention`, padding rows at position -1
  there, computed in float32);
* :func:`~asyncdbo.models.hf.common.paged_attention` (the HF models'): GQA (KV heads repeated),
  MLA expanded (the latent expanded per head), MLA absorbed (``HFMoEModel(mla_absorb=True)``: the
  decode requests attend in the latent space), and exact mode (``HFMoEModel(deterministic=True)``:
  the tiled path with the context expanded in fixed row tiles).

The per-request reference is the same function called on each request alone (one request of
``Q`` queries: no padding query rows, no other request's keys), or for the HF fast paths
:func:`~asyncdbo.models.hf.common.per_request_attention` (the loop the batched form replaced).
The tiled path promises a query's bits whatever the call holds, so there the comparison is
``torch.equal``; elsewhere the GEMMs see other shapes (a padded context, more rows) and the
tolerances are in :data:`TOL`. Every path is also checked against a float64 attention computed
here from the written slots alone (:func:`_oracle`), so a wrong read that the batched and the
per-request form share cannot pass either.

Beside the random steps: issue 45's bf16 prefill of 9, 23 and 4 tokens by name (it fails on every
fast path in bf16 without the fix), requests with no new tokens whose table row points at an
unwritten block, and the mini model end to end in bf16 (the HF models' end-to-end tests against
transformers are in test_hf_bf16_parity.py).
"""

# Shape legend: T = tokens (padded), H = query heads, G = cached heads, K = query/key head dim,
# V = value head dim, C = cached row width, S = context of one request, R = requests.

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from asyncdbo.models.attention import paged_causal_attention
from asyncdbo.models.hf.common import attend, paged_attention, per_request_attention
from asyncdbo.models.hf.mla import mla_absorbed_decode, mla_expand
from asyncdbo.moe.batch_invariant import ROW_TILE
from asyncdbo.plan.metadata import AttentionMetadata
from asyncdbo.serving import BatchBuilder, KVCacheConfig, PagedKVCache
from asyncdbo.serving.kv_cache import slots_for

NAN = float("nan")


pytestmark = pytest.mark.usefixtures("one_thread")  # many small ops (conftest.py)


H, G, K = 4, 2, 16  # query heads, cached GQA heads, head dim
LORA, ROPE, NOPE, VDIM = 12, 4, 8, 10  # MLA: latent rank, rotary dim, per-head key (no rope) and value dims
LAYER = 1  # of two: layer 0 is never written (all NaN), so a read of the wrong layer shows
PAD = 3  # query rows past num_actual_tokens (NaN in, zeros out)
MAX_CONTEXT = 300
MAX_NEW_TOKENS = 512  # per step, so the padded [R, H, Q, S] products stay small on a 2-core CPU

#: Largest |batched - per-request| allowed where the bits may differ: (path kind, dtype) -> atol.
#: Outputs are convex combinations of values ~ N(0, 1), so |out| < 4. Measured over 48 random
#: steps per path (torch 2.13 CPU): float32 at most 9.5e-7 (a few ulps: the GEMMs add the same
#: products in other orders, other blocking for other shapes and masked exact zeros over a longer
#: padded context), allowed 1e-5. bfloat16 fast paths at most 2^-8: the products are the same, but
#: scores and probabilities are rounded to bf16 between the GEMMs, and a sum taken in another order
#: can round to the neighbouring bf16 (2^-8 relative) and carry that on; allowed 2^-6, one bf16
#: ulp at 4. The absorbed MLA decode is another association of the products (the query times W_UK
#: before the scores) and rounds other intermediates (the weighted latent, not per-head values):
#: measured 0.039 (2.5 bf16 ulps at 4), allowed 2^-4 (four ulps).
TOL = {
    ("fast", torch.float32): 1e-5,
    ("fast", torch.bfloat16): 2 ** -6,
    ("absorbed", torch.float32): 1e-5,
    ("absorbed", torch.bfloat16): 2 ** -4,
}
#: |out - float64 oracle| allowed: float32 as above (measured 2.2e-6); bf16 the computation's own
#: roundings of scores, probabilities and outputs to 8 bits (the inputs are bf16 already; measured
#: 0.035, the mini path's softmax in bf16 and MLA's expanded values rounded), allowed 2^-4.
ORACLE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -4}


@dataclass
class Layout:
    """What one attention path caches per token and how it attends (names the test's cases)."""

    name: str
    cache_cfg: Callable[[int, int], KVCacheConfig]  # (num_blocks, block_size) -> config
    qk_dim: int
    v_dim: int


LAYOUTS = {
    "mini": Layout("mini", lambda n, z: KVCacheConfig(num_layers=2, num_blocks=n, block_size=z, num_heads=H,
                                                      head_dim=K), K, K),
    "gqa": Layout("gqa", lambda n, z: KVCacheConfig(num_layers=2, num_blocks=n, block_size=z, num_heads=G,
                                                    head_dim=K), K, K),
    "mla": Layout("mla", lambda n, z: KVCacheConfig(num_layers=2, num_blocks=n, block_size=z, num_heads=1,
                                                    head_dim=LORA + ROPE, v_head_dim=0), NOPE + ROPE, VDIM),
}


@dataclass
class Step:
    """One poisoned step: the cache (unwritten slots NaN), the step's metadata, its queries and
    positions (``PAD`` NaN rows past the real ones), and what the oracle needs."""

    cache: PagedKVCache
    attn: AttentionMetadata
    q_THK: torch.Tensor
    positions_T: torch.Tensor
    layout: Layout
    kv_b_FL: torch.Tensor  # MLA's up-projection (unused by GQA layouts)


def _poisoned_cache(cfg: KVCacheConfig, dtype: torch.dtype) -> PagedKVCache:
    cache = PagedKVCache(cfg, dtype=dtype)
    for t in (*cache.k_cache_LNZHK, *cache.v_cache_LNZHK):
        t.fill_(NAN)
    return cache


def _write(cache: PagedKVCache, attn: AttentionMetadata, g: torch.Generator) -> None:
    """Random keys (and values) at the step's real slots, in layer ``LAYER`` only."""
    cfg, n = cache.cfg, attn.num_actual_tokens
    dtype = cache.k_cache_LNZHK[0].dtype
    k = torch.randn(n, cfg.num_heads, cfg.head_dim, generator=g).to(dtype)
    v = torch.randn(n, cfg.num_heads, cfg.value_dim, generator=g).to(dtype) if cfg.value_dim else None
    cache.write(LAYER, k, v, attn.slot_mapping)


def make_step(layout: Layout, dtype: torch.dtype, lengths: list[tuple[int, int]], *, block_size: int,
              seed: int) -> Step:
    """A step whose request ``r`` has ``lengths[r] = (prefix, new)``: ``prefix`` tokens written by
    an earlier step (a decode request or a chunked-prefill continuation; 0: a prefill) and ``new``
    tokens here. Only the written slots hold numbers."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-(p + n) // block_size) for p, n in lengths) + 2  # two spare blocks stay NaN
    cache = _poisoned_cache(layout.cache_cfg(blocks, block_size), dtype)
    builder = BatchBuilder(cache.cfg)
    earlier = [(r, [0] * p) for r, (p, _) in enumerate(lengths) if p]
    if earlier:
        _write(cache, builder.build(earlier).attn, g)
    batch = builder.build([(r, [0] * n) for r, (_, n) in enumerate(lengths)])
    _write(cache, batch.attn, g)
    assert cache.k_cache_LNZHK[LAYER].isnan().any(), "the spare blocks stay poisoned"
    q_THK = torch.randn(batch.num_tokens, H, layout.qk_dim, generator=g).to(dtype)
    q_THK = torch.cat([q_THK, q_THK.new_full((PAD, H, layout.qk_dim), NAN)])
    positions_T = torch.cat([batch.positions_T, torch.zeros(PAD, dtype=torch.int64)])
    kv_b_FL = (torch.randn(H * (NOPE + VDIM), LORA, generator=g) / math.sqrt(LORA)).to(dtype)
    return Step(cache, batch.attn, q_THK, positions_T, layout, kv_b_FL)


def random_lengths(rng: random.Random, kind: str, num: int) -> list[tuple[int, int]]:
    """``num`` requests of 1 to ``MAX_CONTEXT`` tokens of context (half of them drawn short);
    ``kind`` picks what each does this step: "prefill", "decode", "chunked" (a continuation of
    2+ new tokens after a prefix) or "mixed" (each its own). The new tokens of one request are at
    most ``MAX_NEW_TOKENS / num``, so a step of 64 requests attends a few new tokens each over
    long contexts and a step of one or two requests prefills up to ``MAX_CONTEXT`` tokens."""
    cap = max(2, MAX_NEW_TOKENS // num)
    out = []
    for _ in range(num):
        each = kind if kind != "mixed" else rng.choice(["prefill", "decode", "chunked"])
        ctx = rng.choice([rng.randint(1, 24), rng.randint(1, MAX_CONTEXT)])
        if each == "prefill":
            ctx = min(ctx, cap)
            out.append((0, ctx))
        elif each == "decode":
            out.append((ctx - 1, 1))
        else:
            ctx = max(ctx, 3)
            new = rng.randint(2, min(cap, ctx - 1))
            out.append((ctx - new, new))
    return out


# -- the paths -----------------------------------------------------------------------------------------


def _gqa_context(k_SGK: torch.Tensor, v_SGK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    assert v_SGK is not None
    return (k_SGK.transpose(0, 1).repeat_interleave(H // G, dim=0),
            v_SGK.transpose(0, 1).repeat_interleave(H // G, dim=0))


def _hf_kwargs(step: Step, tile: int | None) -> dict[str, Any]:
    if step.layout.name == "gqa":
        return dict(scale=K ** -0.5, context=_gqa_context, attend_fn=attend, v_dim=K)

    def context(latent_S1C: torch.Tensor, _: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_expand(latent_S1C, step.kv_b_FL, H, NOPE, LORA, tile)
    return dict(scale=(NOPE + ROPE) ** -0.5, context=context, attend_fn=attend, v_dim=VDIM)


def _absorbed(step: Step) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    def decode(q_RHK: torch.Tensor, latent_RS1C: torch.Tensor, visible_RS: torch.Tensor) -> torch.Tensor:
        return mla_absorbed_decode(q_RHK, latent_RS1C, visible_RS, step.kv_b_FL, H, NOPE, LORA,
                                   (NOPE + ROPE) ** -0.5)
    return decode


Attention = Callable[[Step, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

#: path -> (layout, the batched call (q, positions, metadata) -> [T, H, V], reference kind).
#: Reference kinds: "alone" (the same call on each request alone, bitwise), "alone~" (the same,
#: within TOL["fast"]), "loop" (per_request_attention, within TOL[...]).
PATHS: dict[str, tuple[str, Attention, str]] = {
    "mini": ("mini", lambda s, q, p, a: paged_causal_attention(q, p, s.cache, LAYER, a), "alone~"),
    "mini-deterministic": ("mini", lambda s, q, p, a: paged_causal_attention(q, p, s.cache, LAYER, a,
                                                                             deterministic=True), "alone"),
    "hf-gqa": ("gqa", lambda s, q, p, a: paged_attention(q, p, s.cache, LAYER, a, **_hf_kwargs(s, None)), "loop"),
    "hf-gqa-exact": ("gqa", lambda s, q, p, a: paged_attention(q, p, s.cache, LAYER, a, exact=True,
                                                               **_hf_kwargs(s, ROW_TILE)), "alone"),
    "hf-mla": ("mla", lambda s, q, p, a: paged_attention(q, p, s.cache, LAYER, a, **_hf_kwargs(s, None)), "loop"),
    "hf-mla-absorbed": ("mla", lambda s, q, p, a: paged_attention(q, p, s.cache, LAYER, a, decode=_absorbed(s),
                                                                  **_hf_kwargs(s, None)), "loop"),
    "hf-mla-exact": ("mla", lambda s, q, p, a: paged_attention(q, p, s.cache, LAYER, a, exact=True,
                                                               **_hf_kwargs(s, ROW_TILE)), "alone"),
}


def _alone(step: Step, r: int) -> tuple[int, int, AttentionMetadata]:
    """Request ``r`` of the step as a batch of its own: its token rows and metadata."""
    attn = step.attn
    t0, t1 = int(attn.query_start_loc_cpu[r]), int(attn.query_start_loc_cpu[r + 1])
    seq = int(attn.seq_lens_cpu[r])
    one = AttentionMetadata.from_lengths([t1 - t0], [seq], attn.block_table[r: r + 1], attn.slot_mapping[t0:t1])
    return t0, t1, one


def _oracle(step: Step) -> torch.Tensor:
    """Float64 causal attention of each request over the slots its context was written to (never
    a padded or unwritten one): ``[num_actual_tokens, H, V]``."""
    attn, cfg = step.attn, step.cache.cfg
    out = []
    for r in range(attn.num_reqs):
        t0, t1 = int(attn.query_start_loc_cpu[r]), int(attn.query_start_loc_cpu[r + 1])
        pos_S = torch.arange(int(attn.seq_lens_cpu[r]))
        k_S, v_S = step.cache.read(LAYER, slots_for(attn.block_table[r], pos_S, cfg.block_size))
        if step.layout.name == "mla":
            kv_SHF = (k_S[:, 0, :LORA].double() @ step.kv_b_FL.double().T).view(-1, H, NOPE + VDIM)
            k_SHK = torch.cat([kv_SHF[..., :NOPE], k_S[:, :, LORA:].double().expand(-1, H, -1)], dim=-1)
            v_SHV, scale = kv_SHF[..., NOPE:], (NOPE + ROPE) ** -0.5
        else:
            assert v_S is not None
            rep = H // cfg.num_heads
            k_SHK, v_SHV = k_S.double().repeat_interleave(rep, 1), v_S.double().repeat_interleave(rep, 1)
            scale = K ** -0.5
        s_HTS = torch.einsum("thk,shk->hts", step.q_THK[t0:t1].double(), k_SHK) * scale
        visible_TS = pos_S[None, :] <= step.positions_T[t0:t1, None]
        p_HTS = s_HTS.masked_fill(~visible_TS, float("-inf")).softmax(-1)
        out.append(torch.einsum("hts,shv->thv", p_HTS, v_SHV))
    return torch.cat(out) if out else torch.zeros(0, H, step.layout.v_dim, dtype=torch.float64)


def check_path(path: str, step: Step) -> dict[str, float]:
    """The batched call against its reference and the oracle (module docstring); returns the
    largest differences (for measuring the tolerances)."""
    _, fn, ref_kind = PATHS[path]
    n, dtype = step.attn.num_actual_tokens, step.q_THK.dtype
    out_THV = fn(step, step.q_THK, step.positions_T, step.attn)
    assert out_THV.shape == (n + PAD, H, step.layout.v_dim) and out_THV.dtype == dtype
    nan_rows = out_THV[:n].isnan().flatten(1).any(1).nonzero().flatten().tolist()
    assert not nan_rows, f"{path} {dtype}: NaN in real rows {nan_rows}"
    assert torch.equal(out_THV[n:], torch.zeros(PAD, H, step.layout.v_dim, dtype=dtype)), "padding rows are not zeros"
    if ref_kind == "loop":
        ref_THV = per_request_attention(step.q_THK, step.positions_T, step.cache, LAYER, step.attn,
                                        **_hf_kwargs(step, None))[:n]
    else:
        ref_THV = torch.full_like(out_THV[:n], NAN)
        for r in range(step.attn.num_reqs):
            t0, t1, one = _alone(step, r)
            ref_THV[t0:t1] = fn(step, step.q_THK[t0:t1], step.positions_T[t0:t1], one)
    assert not ref_THV.isnan().any()
    diff = (out_THV[:n].float() - ref_THV.float()).abs().max().item() if n else 0.0
    if ref_kind == "alone":
        assert torch.equal(out_THV[:n], ref_THV), f"{path}: not the bits of each request alone (max diff {diff})"
    else:
        tol = TOL[("absorbed" if path == "hf-mla-absorbed" else "fast", dtype)]
        assert diff <= tol, f"{path} {dtype}: batched vs per-request {diff} > {tol}"
    oracle = (out_THV[:n].double() - _oracle(step)).abs().max().item() if n else 0.0
    assert oracle <= ORACLE_TOL[dtype], f"{path} {dtype}: vs the float64 oracle {oracle} > {ORACLE_TOL[dtype]}"
    return {"ref": diff, "oracle": oracle}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KINDS = ("prefill", "decode", "chunked", "mixed")
#: Requests of each random step of a (path, dtype); the step's kind is KINDS in turn, so each
#: kind gets 64 requests once and a few once.
NUM_REQS = (64, 64, 64, 64, 1, 2, 7, 23)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_batched_attention_equals_each_request_alone_with_nan_everywhere_it_must_not_read(path: str,
                                                                                      dtype: str) -> None:
    layout = LAYOUTS[PATHS[path][0]]
    rng = random.Random(f"{path}-{dtype}")
    for i, num in enumerate(NUM_REQS):
        lengths = random_lengths(rng, KINDS[i % len(KINDS)], num)
        step = make_step(layout, DTYPES[dtype], lengths, block_size=rng.choice([1, 4, 16]), seed=i)
        check_path(path, step)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_issue_45_bf16_prefill_of_9_23_and_4_tokens(path: str, dtype: str) -> None:
    """The step that gave NaN logits (issue 45): three prompts of 9, 23 and 4 tokens, so the first
    and last requests' queries are padded to 23 rows. Before fbb170b, in bf16, the padding rows
    softmaxed to NaN and a bf16 matmul spread them into real rows of the same requests."""
    layout = LAYOUTS[PATHS[path][0]]
    check_path(path, make_step(layout, DTYPES[dtype], [(0, 9), (0, 23), (0, 4)], block_size=4, seed=45))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_requests_with_no_new_tokens_change_no_other_request(path: str, dtype: str) -> None:
    """A request with no new tokens in the step (the metadata allows it) beside a ragged prefill
    and a decode token: one with no context at all, whose block-table row points at a block no
    token wrote (NaN: a fast path reads its position 0 there for its padding rows), and one that
    repeats request 1's context. Their rows are padding only; what they read stays out of every
    real row."""
    layout = LAYOUTS[PATHS[path][0]]
    step = make_step(layout, DTYPES[dtype], [(0, 9), (5, 1), (0, 23), (0, 4)], block_size=4, seed=7)
    attn, spare = step.attn, step.cache.cfg.num_blocks - 1  # make_step leaves the last blocks unwritten
    assert step.cache.k_cache_LNZHK[LAYER][spare].isnan().all()
    table = attn.block_table
    rows = [table[0], torch.full_like(table[0], spare), table[1], table[2], table[1], table[3]]
    step.attn = AttentionMetadata.from_lengths([9, 0, 1, 23, 0, 4], [9, 0, 6, 23, 6, 4], torch.stack(rows),
                                               attn.slot_mapping)
    check_path(path, step)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_mini_model_in_bf16_gives_finite_logits_on_mixed_steps_over_a_nan_filled_cache(deterministic: bool) -> None:
    """The mini model end to end (its attention is :func:`paged_causal_attention`): issue 45's
    prefill of 9, 23 and 4 tokens, then decode tokens beside a chunked continuation and a new
    prompt, then a decode step, serially and with DBO (every step microbatched), each run on a KV
    cache that is NaN until a token writes it. Every logits row is finite; in deterministic mode
    the DBO run gives the serial run's bits (its promise). There is no transformers reference for
    this model: the HF models' parity with it is test_hf_bf16_parity.py's."""
    from asyncdbo.models import MiniConfig, MiniModel
    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving import DBORunner, RunnerConfig

    cfg = MiniConfig(vocab_size=96, hidden_size=32, num_heads=4, head_dim=16, num_experts=4, top_k=2,
                     moe_intermediate_size=32, block_size=4, num_kv_blocks=64, deterministic=deterministic)
    g = torch.Generator().manual_seed(45)
    steps = [[(r, torch.randint(0, 96, (n,), generator=g).tolist()) for r, n in chunks]
             for chunks in ([(0, 9), (1, 23), (2, 4)], [(0, 1), (3, 13), (1, 1), (2, 5)], [(0, 1), (1, 1), (2, 1), (3, 1)])]

    async def run(dbo: bool) -> list[torch.Tensor]:
        model = MiniModel(cfg, dtype=torch.bfloat16, max_ubatches=3)
        for t in (*model.kv_cache.k_cache_LNZHK, *model.kv_cache.v_cache_LNZHK):
            t.fill_(NAN)
        runner = DBORunner(model, RunnerConfig(thresholds=ThresholdConfig(prefill_threshold=1, decode_threshold=1)),
                           dp_group=None)
        builder, out = BatchBuilder(cfg.kv_cache_config), []
        for chunks in steps:
            res = await runner.step(builder.build(chunks), enabled=dbo)
            assert res.record.microbatched == dbo
            out.append(res.logits_TV)
        return out

    import asyncdbo

    runs = {mode: asyncdbo.run(run, mode == "dbo") for mode in ("serial", "dbo")}
    for mode, logits in runs.items():
        for i, l_TV in enumerate(logits):
            assert l_TV.dtype == torch.bfloat16 and l_TV.shape == (sum(len(t) for _, t in steps[i]), 96)
            nan_rows = (~l_TV.isfinite()).any(1).nonzero().flatten().tolist()
            assert not nan_rows, (mode, i, nan_rows)
            if deterministic:
                assert torch.equal(l_TV, runs["serial"][i]), (mode, i)
