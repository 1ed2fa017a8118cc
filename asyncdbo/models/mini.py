"""A small DeepSeek-like MoE model: the workload for DBO tests, examples and the demo.

Embedding -> L x [RMSNorm -> causal self-attention (RoPE, paged KV cache) -> residual -> RMSNorm
-> MoE (routed experts over the EP group + shared expert) -> residual] -> RMSNorm -> LM head.
Weights come from a seed, so every rank builds the same global model and keeps only its own
expert shard (the MoE layer's job).  Each DP rank owns its KV cache and its requests.

Why a request that straddles two ubatches (token split) still reads the right K/V under DBO:
ubatch ``k+1`` holds the continuation of a request whose first tokens are in ubatch ``k``, so
in every layer ``l`` it must read the K/V that ubatch ``k`` writes in layer ``l``, after ubatch
``k`` wrote them (a chunked-prefill continuation, exactly as in vLLM).

* vLLM gets this order for free: both ubatches queue their attention on one compute stream, in
  CPU order, and a ubatch thread only hands over at the MoE yields.
* The DBO loop runs the ubatches round-robin and attention never yields, so in the common case
  ubatch ``k`` runs layer ``l``'s attention before ubatch ``k+1`` gets there.  But a ubatch
  *parked* on its comm is skipped: with per-ubatch comm streams (or a comm completion that
  arrives out of order) ubatch ``k+1`` can overtake a parked ubatch ``k`` and reach layer
  ``l``'s attention first.  Round-robin alone is therefore not enough (tests caught exactly
  this with 3 ubatches on ubatch streams).
* So the order is made explicit, CANN-style: in layer ``l`` ubatch ``k`` writes its K/V, waits
  for event ``kv(l, k-1)`` if it continues a request of ubatch ``k-1``, then records ``kv(l, k)``
  and reads.  Recording after the wait makes
  the chain transitive: ``kv(l, k)`` means ubatches ``0..k`` all wrote layer ``l``, which a
  request spanning three ubatches needs.  In the
  common case the event is already recorded and the wait costs a dict lookup; when it is not,
  the overtaking ubatch parks until ubatch ``k`` catches up.  On an accelerator the same pair
  becomes a stream wait on an event (no CPU wait).

``tests/test_runner.py`` checks the consequence: token splits with straddling requests give the
same logits as the serial run for both stream policies and 2 to 4 ubatches, bit for bit in
deterministic mode (``MiniConfig.deterministic``, on by default on a CPU: every GEMM in fixed row
tiles, attention in fixed key tiles, see :mod:`asyncdbo.moe.batch_invariant` and
:mod:`asyncdbo.models.tiled_attention`).
"""

# Shape legend: T = tokens, D = hidden, H = heads, K = head dim, V = vocab, F = H*K.

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..dist.ep import EPComm, ep_comm
from ..moe import MoEConfig, MoELayer
from ..moe.batch_invariant import ROW_TILE, is_deterministic, linear
from ..moe.config import Schedule, Scoring
from ..plan.metadata import AttentionMetadata
from ..serving import KVCacheConfig, PagedKVCache, check_token_ids
from .attention import check_logits, lm_head, paged_causal_attention, wait_for_earlier_kv

__all__ = ["MiniConfig", "MiniModel"]

logger = logging.getLogger("asyncdbo.models")

SCHEDULES = ("ht", "ll")
SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True, kw_only=True)
class MiniConfig:
    """Sizes of the model and of one rank's KV cache.  Defaults run a demo step in tens of ms on
    2 CPU cores.  ``schedule`` is the MoE layer's DBO schedule (``ht`` high-throughput, ``ll``
    low-latency).  ``deterministic``: a token's logits do not depend on the other tokens of the
    call, so DBO equals serial bit for bit (module docstring); None (the default) is on for CPU
    inputs, off on accelerators."""

    vocab_size: int = 1024
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 64
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 256
    num_shared_experts: int = 1
    scoring: Scoring = "softmax"
    schedule: Schedule = "ht"
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    block_size: int = 16
    num_kv_blocks: int = 512
    seed: int = 0
    deterministic: bool | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "num_experts",
                     "top_k", "moe_intermediate_size", "block_size", "num_kv_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"MiniConfig.{name} must be >= 1 (got {getattr(self, name)})")
        if self.num_shared_experts < 0:
            raise ValueError(f"MiniConfig.num_shared_experts must be >= 0 (got {self.num_shared_experts})")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts}); pick top_k <= num_experts"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown MoE schedule {self.schedule!r}; use one of {SCHEDULES}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"unknown router scoring {self.scoring!r}; use one of {SCORINGS}")
        if not (self.deterministic is None or isinstance(self.deterministic, bool)):
            raise ValueError(f"MiniConfig.deterministic must be True, False or None (got {self.deterministic!r})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        return KVCacheConfig(num_layers=self.num_layers, num_blocks=self.num_kv_blocks,
                             block_size=self.block_size, num_heads=self.num_heads, head_dim=self.head_dim)


def _rms_norm(x_TD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm, normalised in float32 then rounded (float32 input: the same bits as in its own
    dtype). In bfloat16 a CPU ``rsqrt`` gives an element other bits in a vector lane than in the
    scalar remainder of the loop, so a token's norm depended on how many tokens shared the call,
    and deterministic mode's DBO step differed from the serial one; float32's ``rsqrt`` does not
    (:mod:`asyncdbo.moe.batch_invariant`)."""
    x32_TD = x_TD.float()
    return (x32_TD * torch.rsqrt(x32_TD.pow(2).mean(-1, keepdim=True) + eps)).to(x_TD.dtype) * w_D


def _matmul(x_TD: torch.Tensor, w_DF: torch.Tensor, tile: int | None) -> torch.Tensor:
    """``x @ w``; with ``tile``, in GEMMs of exactly ``tile`` rows (batch-invariant)."""
    return x_TD @ w_DF if tile is None else linear(x_TD, w_DF.t(), tile)


def _rope(x_THK: torch.Tensor, positions_T: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) by absolute position."""
    half = x_THK.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x_THK.device) / half)
    angles_TK = positions_T.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles_TK.cos()[:, None, :].to(x_THK.dtype), angles_TK.sin()[:, None, :].to(x_THK.dtype)
    x1, x2 = x_THK[..., :half], x_THK[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MiniModel:
    """The model on one rank.  ``ep_group`` is the expert-parallel process group (None: the default
    group when torch.distributed is initialised, else one rank; see :class:`asyncdbo.moe.MoELayer`,
    which also refuses experts that do not divide over the group).  ``max_ubatches`` bounds the
    ubatches of a DBO run (one comm group clone each).  The KV cache is this rank's own.  With EP
    size > 1, building the model is a collective: every rank builds it at the same time.

    ``logits``: ``"all"`` (the default) computes the LM head for every token; ``"last"`` only for
    each request's last new token of the step (what a sampler reads), the other rows of the
    ``[T, V]`` logits being zeros: a prefill of ``T`` tokens in ``R`` requests then runs the
    ``D x V`` LM head GEMM on ``R`` rows instead of ``T``.  Under DBO the last row of a request
    that continues in the next ubatch is skipped too (the slice says so), so a DBO step computes
    the serial step's rows."""

    def __init__(self, cfg: MiniConfig, *, ep_group: Any = None, max_ubatches: int = 4,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 logits: str = "all") -> None:
        check_logits("MiniModel", logits)
        self.cfg = cfg
        self.logits = logits
        self.max_ubatches = max_ubatches
        gen = torch.Generator().manual_seed(cfg.seed)
        d, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim

        def init(*shape: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(dtype=dtype, device=device)

        self.embed_VD = init(cfg.vocab_size, d, fan_in=1)
        self.layers: list[dict[str, Any]] = []
        moe_cfg = MoEConfig(
            hidden_size=d,
            intermediate_size=cfg.moe_intermediate_size,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            scoring=cfg.scoring,
            num_shared_experts=cfg.num_shared_experts,
            schedule=cfg.schedule,
            deterministic=cfg.deterministic,
        )
        for layer in range(cfg.num_layers):
            self.layers.append({
                "attn_norm_D": torch.ones(d, dtype=dtype, device=device),
                "wq_DF": init(d, f, fan_in=d),
                "wk_DF": init(d, f, fan_in=d),
                "wv_DF": init(d, f, fan_in=d),
                "wo_FD": init(f, d, fan_in=f),
                "moe_norm_D": torch.ones(d, dtype=dtype, device=device),
                "moe": MoELayer(moe_cfg, ep_group=ep_group, seed=cfg.seed * 1000 + layer + 1, dtype=dtype,
                                max_ubatches=max_ubatches).to(device),
            })
        #: The EP group its MoE layers all-to-all on (one for all of them; a tuning="auto"
        #: DBORunner checks that its DP vote holds every rank of it).
        self.ep_comm: EPComm = ep_comm(ep_group, max_ubatches=max_ubatches)  # the layers' own, cached
        self.final_norm_D = torch.ones(d, dtype=dtype, device=device)
        self.lm_head_DV = init(d, cfg.vocab_size, fan_in=d)
        self.kv_cache = PagedKVCache(cfg.kv_cache_config, dtype=dtype, device=device)

    async def _attention(self, layer: int, p: dict[str, Any], h_TD: torch.Tensor, positions_T: torch.Tensor,
                         attn: AttentionMetadata, tile: int | None) -> torch.Tensor:
        cfg = self.cfg
        n = attn.num_actual_tokens  # rows past n are padding: no K/V written, zero attention output
        q_THK = _matmul(h_TD, p["wq_DF"], tile).view(-1, cfg.num_heads, cfg.head_dim)
        k_THK = _matmul(h_TD[:n], p["wk_DF"], tile).view(-1, cfg.num_heads, cfg.head_dim)
        v_THK = _matmul(h_TD[:n], p["wv_DF"], tile).view(-1, cfg.num_heads, cfg.head_dim)
        q_THK = _rope(q_THK, positions_T, cfg.rope_theta)
        k_THK = _rope(k_THK, positions_T[:n], cfg.rope_theta)
        self.kv_cache.write(layer, k_THK, v_THK, attn.slot_mapping, padded=False)  # every slot real
        # Order the read after the previous ubatch's write in this layer (module docstring).
        # No-ops outside a DBO run.
        await wait_for_earlier_kv(self, layer)
        o_THK = paged_causal_attention(q_THK, positions_T, self.kv_cache, layer, attn, deterministic=tile is not None)
        return _matmul(o_THK.reshape(-1, cfg.num_heads * cfg.head_dim), p["wo_FD"], tile)

    async def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor,
                      attn: AttentionMetadata) -> torch.Tensor:
        """Logits ``[T, V]`` of a (u)batch.  ``T`` may exceed ``attn.num_actual_tokens``: the
        extra rows are padding, which joins the MoE collectives (same sizes on every rank) but
        writes no K/V; their logits are meaningless and dropped by the runner.  ``T`` may be 0
        (an empty ubatch still takes part in every collective)."""
        if input_ids_T.shape[0] != positions_T.shape[0]:
            raise ValueError(
                f"input_ids has {input_ids_T.shape[0]} tokens but positions has {positions_T.shape[0]}; "
                f"pass one position per token"
            )
        if input_ids_T.shape[0] < attn.num_actual_tokens:
            raise ValueError(
                f"the attention metadata covers {attn.num_actual_tokens} tokens but only "
                f"{input_ids_T.shape[0]} were given"
            )
        check_token_ids(input_ids_T, self.cfg.vocab_size)
        x_TD = self.embed_VD[input_ids_T]
        tile = ROW_TILE if is_deterministic(self.cfg.deterministic, x_TD) else None
        for layer, p in enumerate(self.layers):
            h_TD = _rms_norm(x_TD, p["attn_norm_D"], self.cfg.rms_eps)
            x_TD = x_TD + await self._attention(layer, p, h_TD, positions_T, attn, tile)
            h_TD = _rms_norm(x_TD, p["moe_norm_D"], self.cfg.rms_eps)
            x_TD = x_TD + await p["moe"].forward(h_TD)
        h_TD = _rms_norm(x_TD, self.final_norm_D, self.cfg.rms_eps)
        return lm_head(h_TD, attn, self.logits, self.cfg.vocab_size, lambda h: _matmul(h, self.lm_head_DV, tile))

