"""A dense Hugging Face decoder (Llama, Qwen3) as ``async def``, tensor-parallel over a process
group, with DBO overlapping one ubatch's all-reduces with another ubatch's compute.

Embedding (vocab-parallel) -> L x [RMSNorm -> attention (this rank's heads; paged KV cache of
its KV heads) -> o_proj (row-parallel) -> all-reduce -> residual -> RMSNorm -> gate/up
(column-parallel) -> SwiGLU -> down (row-parallel) -> all-reduce -> residual] -> RMSNorm -> LM
head (vocab-parallel) -> all-gather.

Every TP rank runs the same tokens (a TP group is one DP rank of the serving engine): each holds
``1 / P`` of the query heads (and of the KV heads, or a replica of the one its query heads read
when there are more ranks than KV heads), of the MLP's intermediate columns and of the vocabulary
(:mod:`asyncdbo.models.tp.shards`).  The two row-parallel all-reduces per layer, the embedding's
and the LM head's gather are yield points (:mod:`asyncdbo.dist.tp`): inside a DBO run one
ubatch's all-reduce travels while another computes, the ping-pong EP's dispatch and combine get
from :class:`~asyncdbo.moe.MoELayer`.

``sequence_parallel`` swaps each all-reduce for a reduce-scatter, keeping the residual stream
and the norms on ``T / P`` rows per rank (rows padded to a multiple of ``P``), and an all-gather
before the next column-parallel projection: Megatron's sequence parallelism, the same bytes on
the wire in two halves with a yield after each.

``deterministic`` is exact mode: projections and MLPs in fixed row tiles, attention tiled by
position and every reduction in rank order (:func:`~asyncdbo.dist.tp.tp_all_reduce` with
``exact``), so a DBO step gives the serial step's logits and KV cache bit for bit.
"""

# Shape legend: T = tokens, D = hidden, V = vocab, W = this rank's vocab block, H = this rank's
# query heads, G = its KV heads, K = head dim, I = its intermediate columns, S = T / P rows.

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from ...dist.ep import EPComm, ep_comm
from ...dist.tp import tp_all_gather, tp_all_reduce, tp_reduce_scatter
from ...moe.batch_invariant import ROW_TILE
from ...moe.experts import swiglu
from ...plan.metadata import AttentionMetadata
from ...serving import check_token_ids, exact_tap
from ..attention import KVCacheConfig, PagedKVCache, check_logits, wait_for_earlier_kv
from ..hf.common import attend, linear, paged_attention, residual_norm, rms_norm
from ..hf.gqa import gqa_context, gqa_qkv
from ..hf.model import Segments
from .arch import DenseArchitecture
from .shards import ShardedSlots, kv_head_range, shard_range

__all__ = ["TPAttention", "TPDenseModel"]


class TPAttention:
    """One layer's grouped-query attention over this rank's heads; returns the row-parallel
    ``o_proj`` partial sum (no bias: the model adds it once, after the all-reduce)."""

    def __init__(self, arch: DenseArchitecture, prefix: str, slots: ShardedSlots, *, size: int, rank: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        hf = arch.hf
        D, K = int(hf.hidden_size), arch.head_dim
        heads, kv_heads = int(hf.num_attention_heads), int(hf.num_key_value_heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
        q0, self.num_heads = shard_range(heads, size, rank, "num_attention_heads")
        g0, self.num_kv_heads = kv_head_range(kv_heads, heads, size, rank)
        self.head_dim, self.eps, self.scale = K, float(hf.rms_norm_eps), K**-0.5
        bias = bool(getattr(hf, "attention_bias", False))

        def shard(name: str, rows: int, dim: int, start: int, count: int) -> torch.Tensor:
            full = (rows, D) if dim == 0 else (D, rows)
            return slots.new_shard(f"{prefix}.{name}", full, dim, start * K, count * K, dtype=dtype, device=device)

        self.wq_FD = shard("q_proj.weight", heads * K, 0, q0, self.num_heads)
        self.wk_FD = shard("k_proj.weight", kv_heads * K, 0, g0, self.num_kv_heads)
        self.wv_FD = shard("v_proj.weight", kv_heads * K, 0, g0, self.num_kv_heads)
        self.wo_DF = shard("o_proj.weight", heads * K, 1, q0, self.num_heads)
        self.bq_F = self.bk_F = self.bv_F = self.bo_D = None
        if bias:
            def bias_shard(name: str, n: int, start: int, count: int) -> torch.Tensor:
                return slots.new_shard(f"{prefix}.{name}", (n * K,), 0, start * K, count * K, dtype=dtype,
                                       device=device)

            self.bq_F = bias_shard("q_proj.bias", heads, q0, self.num_heads)
            self.bk_F = bias_shard("k_proj.bias", kv_heads, g0, self.num_kv_heads)
            self.bv_F = bias_shard("v_proj.bias", kv_heads, g0, self.num_kv_heads)
            self.bo_D = slots.new(f"{prefix}.o_proj.bias", D, dtype=dtype, device=device)
        self.q_norm_K = self.k_norm_K = None
        if arch.qk_norm:
            self.q_norm_K = slots.new(f"{prefix}.q_norm.weight", K, dtype=dtype, device=device)
            self.k_norm_K = slots.new(f"{prefix}.k_norm.weight", K, dtype=dtype, device=device)

    @property
    def kv_cache_dims(self) -> tuple[int, int, int | None]:
        """``(heads, head_dim, v_head_dim)`` of this rank's cache: its KV heads."""
        return self.num_kv_heads, self.head_dim, None

    def _context(self, k_SGK: torch.Tensor, v_SGK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return gqa_context(self.num_heads, self.num_kv_heads, k_SGK, v_SGK)

    async def forward(self, model: TPDenseModel, layer: int, h_TD: torch.Tensor, positions_T: torch.Tensor,
                      rope_TK: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata) -> torch.Tensor:
        tile = model.tile
        q_THK, k_TGK, v_TGK = gqa_qkv(h_TD, self.wq_FD, self.bq_F, self.wk_FD, self.bk_F, self.wv_FD, self.bv_F,
                                      self.q_norm_K, self.k_norm_K, *rope_TK, self.num_heads, self.num_kv_heads,
                                      self.head_dim, self.eps, tile)
        n = attn.num_actual_tokens  # rows past n are padding: they write no K/V
        model.kv_cache.write(layer, k_TGK[:n], v_TGK[:n], attn.slot_mapping)
        await wait_for_earlier_kv(model, layer)
        o_THK = paged_attention(q_THK, positions_T, model.kv_cache, layer, attn, scale=self.scale,
                                context=self._context, attend_fn=model.attend, v_dim=self.head_dim,
                                exact=tile is not None)
        return linear(o_THK.reshape(o_THK.shape[0], self.num_heads * self.head_dim), self.wo_DF, None, tile)


class TPDenseModel:
    """The model on one TP rank (module docstring).  ``tp_group``: the ranks that share the
    model (None: the default group when torch.distributed is initialised, else one rank);
    building it with TP size > 1 is collective (per-ubatch clones of the group), so every rank
    builds it at the same time.  ``max_ubatches`` bounds a DBO run's ubatches; ``block_size`` /
    ``num_kv_blocks`` size this rank's KV cache.  Its weights are uninitialised until a loader
    fills :attr:`slots` (:mod:`asyncdbo.models.tp.loading`)."""

    def __init__(self, arch: DenseArchitecture, *, tp_group: Any = None, max_ubatches: int = 4, block_size: int = 16,
                 num_kv_blocks: int = 256, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 deterministic: bool = False, sequence_parallel: bool = False, logits: str = "all") -> None:
        for name, value in (("deterministic", deterministic), ("sequence_parallel", sequence_parallel)):
            if not isinstance(value, bool):
                raise ValueError(f"TPDenseModel {name} must be True or False (got {value!r})")
        check_logits("TPDenseModel", logits)
        if logits != "all":
            raise ValueError(f"TPDenseModel(logits={logits!r}): only 'all' is implemented; drop the argument")
        self.logits, self.max_ubatches, self.deterministic = logits, max_ubatches, deterministic
        self.sequence_parallel = sequence_parallel
        #: The TP group and its per-ubatch clones; named ``ep_comm`` too, so that a DBORunner checks
        #: its DP vote holds every TP rank (every rank of the group must run the same ubatches).
        self.tp_comm: EPComm = dataclasses.replace(ep_comm(tp_group, max_ubatches=max_ubatches), kind="TP")
        self.ep_comm = self.tp_comm
        P, r = self.tp_comm.size, self.tp_comm.rank
        hf = self.hf = arch.hf
        self.arch, self.slots = arch, ShardedSlots()
        self.tile: int | None = ROW_TILE if deterministic else None
        self.eps = float(hf.rms_norm_eps)
        self.attend = attend
        #: The synchronous pieces the attention classes call (eager; MLA's too).
        self.segments, self.mla_absorb = Segments(), False
        self.dtype, self.device = dtype, device
        D, V = int(hf.hidden_size), int(hf.vocab_size)
        new, shard = self.slots.new, self.slots.new_shard
        self.vocab_start, W = shard_range(V, P, r, "vocab_size")
        self.vocab_size = V
        self.embed_WD = shard("model.embed_tokens.weight", (V, D), 0, self.vocab_start, W, dtype=dtype, device=device)
        self.layers: list[dict[str, Any]] = []
        for i in range(hf.num_hidden_layers):
            p = f"model.layers.{i}"
            self.layers.append(dict(
                attn_norm_D=new(f"{p}.input_layernorm.weight", D, dtype=dtype, device=device),
                attention=self._attention(f"{p}.self_attn"),
                ffn_norm_D=new(f"{p}.post_attention_layernorm.weight", D, dtype=dtype, device=device),
                **self._ffn(i, f"{p}.mlp"),
            ))
        self.final_norm_D = new("model.norm.weight", D, dtype=dtype, device=device)
        tied = bool(getattr(hf, "tie_word_embeddings", False))
        self.lm_head_WD = self.embed_WD if tied else shard("lm_head.weight", (V, D), 0, self.vocab_start, W,
                                                             dtype=dtype, device=device)
        self.rope = arch.rope()
        heads, head_dim, v_head_dim = self.layers[0]["attention"].kv_cache_dims
        self.kv_cache_config = KVCacheConfig(num_layers=len(self.layers), num_blocks=num_kv_blocks,
                                             block_size=block_size, num_heads=heads, head_dim=head_dim,
                                             v_head_dim=v_head_dim)
        self.kv_cache = PagedKVCache(self.kv_cache_config, dtype=dtype, device=device)

    def _attention(self, prefix: str) -> Any:
        """One layer's attention over this rank's heads (a subclass may build another kind)."""
        return TPAttention(self.arch, prefix, self.slots, size=self.tp_comm.size, rank=self.tp_comm.rank,
                           dtype=self.dtype, device=self.device)

    def _ffn(self, layer: int, prefix: str) -> dict[str, Any]:
        """One layer's feed-forward weights: this rank's block of a dense SwiGLU MLP."""
        D, I = int(self.hf.hidden_size), int(self.hf.intermediate_size)
        i0, Ir = shard_range(I, self.tp_comm.size, self.tp_comm.rank, "intermediate_size")
        kw: dict[str, Any] = dict(dtype=self.dtype, device=self.device)
        shard = self.slots.new_shard
        return dict(gate_ID=shard(f"{prefix}.gate_proj.weight", (I, D), 0, i0, Ir, **kw),
                    up_ID=shard(f"{prefix}.up_proj.weight", (I, D), 0, i0, Ir, **kw),
                    down_DI=shard(f"{prefix}.down_proj.weight", (D, I), 1, i0, Ir, **kw))

    def check_loaded(self, where: str) -> None:
        """Raise a ValueError naming the first tensors this rank needs that no loader filled."""
        missing = self.slots.missing()
        if missing:
            raise ValueError(f"{where}: no tensor {missing[0]!r} ({len(missing)} of the {len(self.slots.names())} "
                             "tensors this rank needs are missing); the checkpoint does not match its config.json")

    def with_fresh_cache(self) -> TPDenseModel:
        """The same weights (shared) with a new, empty KV cache (serial vs DBO on the same steps)."""
        twin = copy.copy(self)
        k = self.kv_cache.k_cache_LNZHK[0]
        twin.kv_cache = PagedKVCache(self.kv_cache_config, dtype=k.dtype, device=k.device)
        return twin

    # -- the collectives: all-reduce, or reduce-scatter + all-gather under sequence parallelism ----

    def _pad(self, x_TD: torch.Tensor) -> torch.Tensor:
        extra = -x_TD.shape[0] % self.tp_comm.size
        return x_TD if not extra else torch.cat([x_TD, x_TD.new_zeros(extra, *x_TD.shape[1:])])

    async def _reduce(self, partial_TD: torch.Tensor, what: str) -> torch.Tensor:
        """The sum over the group of a row-parallel partial: all rows, or this rank's ``T / P``
        (padded) rows under sequence parallelism."""
        exact = self.deterministic
        if self.sequence_parallel and self.tp_comm.size > 1:
            return await tp_reduce_scatter(self._pad(partial_TD), self.tp_comm, exact=exact, what=what)
        return await tp_all_reduce(partial_TD, self.tp_comm, exact=exact, what=what)

    async def _full(self, h_SD: torch.Tensor, T: int, what: str) -> torch.Tensor:
        """Every row again before a column-parallel projection (sequence parallelism), else as is."""
        if self.sequence_parallel and self.tp_comm.size > 1:
            return (await tp_all_gather(h_SD, self.tp_comm, what=what))[:T]
        return h_SD

    async def _feed_forward(self, layer: dict[str, Any], h_TD: torch.Tensor, T: int) -> torch.Tensor:
        """The dense MLP: column-parallel gate/up, row-parallel down, then the reduction."""
        h_TD = await self._full(h_TD, T, "mlp_gather")
        f_TD = swiglu(h_TD, layer["gate_ID"], layer["up_ID"], layer["down_DI"], self.tile)
        return await self._reduce(f_TD, "mlp_reduce")

    async def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor,
                      attn: AttentionMetadata) -> torch.Tensor:
        """Logits ``[T, V]`` (the same on every rank of the group); rows past
        ``attn.num_actual_tokens`` are padding."""
        if input_ids_T.shape[0] != positions_T.shape[0]:
            raise ValueError(f"input_ids has {input_ids_T.shape[0]} tokens but positions has {positions_T.shape[0]}; "
                             "pass one position per token")
        if input_ids_T.shape[0] < attn.num_actual_tokens:
            raise ValueError(f"the attention metadata covers {attn.num_actual_tokens} tokens but only "
                             f"{input_ids_T.shape[0]} were given")
        check_token_ids(input_ids_T, self.vocab_size)
        T, eps, tile, W = input_ids_T.shape[0], self.eps, self.tile, self.embed_WD.shape[0]
        local_T = input_ids_T - self.vocab_start
        mine_T = (local_T >= 0) & (local_T < W)
        e_TD = self.embed_WD[local_T.where(mine_T, 0)] * mine_T[:, None].to(self.embed_WD.dtype)
        x_TD = e_TD if self.tp_comm.size == 1 else await self._reduce(e_TD, "embed")
        rope_TK = self.rope.tables(positions_T, x_TD.dtype)
        # exact_check compares a tap's rows by token; under sequence parallelism a rank holds T / P
        # padded rows of the residual stream, so nothing is tapped there
        tap = _untapped if self.sequence_parallel else exact_tap
        h_TD = rms_norm(x_TD, self.layers[0]["attn_norm_D"], eps)
        for i, layer in enumerate(self.layers):
            h_TD = await self._full(h_TD, T, "attn_gather")
            a_TD = await self._reduce(await layer["attention"].forward(self, i, h_TD, positions_T, rope_TK, attn),
                                      "attn_reduce")
            bo_D = layer["attention"].bo_D
            a_TD = tap("attn", a_TD if bo_D is None else a_TD + bo_D, layer=i)
            x_TD, h_TD = residual_norm(x_TD, a_TD, layer["ffn_norm_D"], eps)
            f_TD = tap("mlp", await self._feed_forward(layer, h_TD, T), layer=i)
            next_norm_D = self.layers[i + 1]["attn_norm_D"] if i + 1 < len(self.layers) else self.final_norm_D
            x_TD, h_TD = residual_norm(x_TD, f_TD, next_norm_D, eps)
            tap("residual", x_TD, layer=i)
        h_TD = await self._full(h_TD, T, "head_gather")
        logits_TW = linear(h_TD, self.lm_head_WD, None, tile)
        return await tp_all_gather(logits_TW, self.tp_comm, dim=1, what="logits")


def _untapped(name: str, x: torch.Tensor, **_: Any) -> torch.Tensor:
    return x
