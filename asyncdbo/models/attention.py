"""Paged KV cache and varlen causal attention over it, the way vLLM's attention backends see a batch.

A batch is a concatenation of requests' new tokens (``query_start_loc``); each request ``r`` has
``seq_lens[r]`` tokens of context in total, the last ``q_len`` of which are the new ones here.
New keys/values are written into a paged cache through ``slot_mapping`` (one slot per token,
``block_id * block_size + offset``); a request's context is read back through its
``block_table`` row up to ``seq_len``.  The causal mask is by *position*: a query at position
``p`` sees every cached key at position ``<= p``.

This is exactly what makes a chunked-prefill continuation work: a request whose first tokens
were in an earlier ubatch finds their keys in the cache (the earlier ubatch wrote them in the
same layer first), and its ``seq_len`` spans that prefix.  Under DBO that order is not free when
a ubatch can overtake a parked one; :func:`wait_for_earlier_kv` makes it explicit (see
:mod:`asyncdbo.models.mini` for the full argument).

A cache may hold keys only (``v_head_dim=0``): multi-head latent attention (DeepSeek-V3) stores
one compressed latent per token and expands it to per-head keys and values after the read.

The reference implementation loops over requests with CPU-side lengths (``*_cpu`` mirrors): it
needs no device sync and is exact, not fast; it is the numerical reference for DBO-vs-serial.
"""

# Shape legend: T = tokens, R = requests, B = max blocks per request, S = context length of one
# request, H = heads, K = head dim, N = blocks in the cache, Z = block size, L = layers.

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._core import get_ubatch
from ..plan.metadata import AttentionMetadata
from ..primitives import dbo_record_event, dbo_wait_event

__all__ = ["KVCacheConfig", "PagedKVCache", "paged_causal_attention", "slots_for", "wait_for_earlier_kv"]

#: slot_mapping value of a token that writes nothing (padding), as in vLLM.
PAD_SLOT_ID = -1


@dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """Shape of one rank's paged KV cache (all layers).  ``v_head_dim``: the values' head dim
    (None: ``head_dim``; 0: no value cache, for a latent cache that keeps keys only)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_heads", "head_dim"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"KVCacheConfig.{name} must be >= 1 (got {value})")
        if self.v_head_dim is not None and self.v_head_dim < 0:
            raise ValueError(f"KVCacheConfig.v_head_dim must be >= 0 or None (got {self.v_head_dim})")

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


class PagedKVCache:
    """Per-layer key and value caches ``[N, Z, H, K]``, zero-initialised.

    Zero-initialised (not empty) so that a wrong read shows up as a numeric mismatch against the
    serial run rather than as uninitialised garbage that might differ from run to run.
    """

    def __init__(self, cfg: KVCacheConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        shape = (cfg.num_blocks, cfg.block_size, cfg.num_heads, cfg.head_dim)
        v_shape = (*shape[:3], cfg.value_dim)
        self.k_cache_LNZHK = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v_cache_LNZHK = ([torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
                              if cfg.value_dim else [])

    def write(self, layer: int, k_THK: torch.Tensor, v_THK: torch.Tensor | None, slot_mapping_T: torch.Tensor) -> None:
        """Store the new tokens' keys/values at their slots; ``PAD_SLOT_ID`` slots are skipped.
        ``v_THK`` is None exactly when the cache keeps keys only."""
        assert (v_THK is None) == (self.cfg.value_dim == 0), "values given to a keys-only cache, or missing"
        if k_THK.shape[0] == 0:
            return
        keep_T = slot_mapping_T >= 0
        slots = slot_mapping_T[keep_T]
        flat_k = self.k_cache_LNZHK[layer].view(-1, self.cfg.num_heads, self.cfg.head_dim)
        flat_k.index_copy_(0, slots, k_THK[keep_T])
        if v_THK is not None:
            flat_v = self.v_cache_LNZHK[layer].view(-1, self.cfg.num_heads, self.cfg.value_dim)
            flat_v.index_copy_(0, slots, v_THK[keep_T])

    def read(self, layer: int, slots_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys ``[S, H, K]`` and values (None for a keys-only cache) stored at ``slots_S``."""
        k_SHK = self.k_cache_LNZHK[layer].view(-1, self.cfg.num_heads, self.cfg.head_dim)[slots_S]
        if not self.cfg.value_dim:
            return k_SHK, None
        return k_SHK, self.v_cache_LNZHK[layer].view(-1, self.cfg.num_heads, self.cfg.value_dim)[slots_S]

    def reset(self) -> None:
        for t in (*self.k_cache_LNZHK, *self.v_cache_LNZHK):
            t.zero_()


def slots_for(block_table_B: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of the given positions of one request (int64)."""
    return block_table_B.long()[positions // block_size] * block_size + positions % block_size


async def wait_for_earlier_kv(owner: object, layer: int) -> None:
    """Order this ubatch's K/V read in ``layer`` of ``owner`` (a model) after the earlier
    ubatches' writes; a no-op outside a DBO run.  Call it between the write and the read.

    Only a ubatch that continues a request of the previous one waits; the runner says so in
    ``ub.data["first_is_continuation"]`` (absent: wait, to be safe).  A decode ubatch never
    waits, so a low-latency schedule keeps its natural lead of one ubatch over the next.  If it
    parks, the scheduler first launches the recv hook the previous ubatch left with it (under the
    low-latency schedule that ubatch may be waiting for exactly that receive).
    """
    ub = get_ubatch()
    if ub is None:
        return
    if ub.id > 0 and ub.data.get("first_is_continuation", True):
        await dbo_wait_event(("models.kv", id(owner), layer, ub.id - 1))
    # Recorded after the wait, so kv(l, k) means "ubatches 0..k wrote layer l" whenever k
    # continues a request: a request spanning three ubatches needs the first one's K/V too.
    dbo_record_event(("models.kv", id(owner), layer, ub.id))


def paged_causal_attention(
    q_THK: torch.Tensor,
    positions_T: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    attn: AttentionMetadata,
) -> torch.Tensor:
    """Attention of each request's new queries over its cached context, causal by position.

    Expects the new tokens' K/V already written to ``cache`` (write, then read: the same order
    vLLM's backends use).  Rows past ``attn.num_actual_tokens`` (padding) get zeros.
    """
    num_heads, head_dim = q_THK.shape[1], q_THK.shape[2]
    out_THK = torch.zeros_like(q_THK)
    scale = 1.0 / math.sqrt(head_dim)
    block_size = cache.cfg.block_size
    k_flat = cache.k_cache_LNZHK[layer].view(-1, num_heads, head_dim)
    v_flat = cache.v_cache_LNZHK[layer].view(-1, num_heads, head_dim)
    qsl = attn.query_start_loc_cpu.tolist()
    seq_lens = attn.seq_lens_cpu.tolist()
    if attn.num_reqs and attn.max_query_len == 1 and attn.num_actual_tokens == attn.num_reqs:
        out_THK[: attn.num_reqs] = _decode_attention(q_THK[: attn.num_reqs], positions_T[: attn.num_reqs],
                                                     k_flat, v_flat, attn, block_size, scale)
        return out_THK
    for r in range(attn.num_reqs):
        t0, t1, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        if t1 == t0:
            continue
        slots_S = slots_for(attn.block_table[r], torch.arange(seq_len, device=q_THK.device), block_size)
        k_SHK, v_SHK = k_flat[slots_S], v_flat[slots_S]
        q_HTK = q_THK[t0:t1].transpose(0, 1)
        scores_HTS = torch.matmul(q_HTK, k_SHK.permute(1, 2, 0)) * scale
        # Causal by position: key position s is visible to a query at position p iff s <= p.
        visible_TS = torch.arange(seq_len, device=q_THK.device)[None, :] <= positions_T[t0:t1, None]
        scores_HTS = scores_HTS.masked_fill(~visible_TS[None], float("-inf"))
        probs_HTS = torch.softmax(scores_HTS, dim=-1)
        out_THK[t0:t1] = torch.matmul(probs_HTS, v_SHK.transpose(0, 1)).transpose(0, 1)
    return out_THK


def _decode_attention(q_RHK: torch.Tensor, positions_R: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                      attn: AttentionMetadata, block_size: int, scale: float) -> torch.Tensor:
    """Uniform decode (one query per request), all requests at once.

    The per-request loop costs a few Python-level ops per request, which dominates a decode step
    of hundreds of short requests on a CPU; here the contexts are gathered into one padded
    ``[R, S]`` slot table (entries past a request's ``seq_len`` are masked) and attended in one
    batched matmul.
    """
    s_max = attn.max_seq_len
    pos_S = torch.arange(s_max, device=q_RHK.device)
    table_RB = attn.block_table.long()
    blocks_RS = table_RB[:, (pos_S // block_size).clamp_(max=table_RB.shape[1] - 1)]
    slots_RS = blocks_RS * block_size + pos_S % block_size
    k_RSHK, v_RSHK = k_flat[slots_RS], v_flat[slots_RS]
    scores_RHS = torch.einsum("rhk,rshk->rhs", q_RHK, k_RSHK) * scale
    visible_RS = (pos_S[None, :] <= positions_R[:, None]) & (pos_S[None, :] < attn.seq_lens.long()[:, None])
    probs_RHS = scores_RHS.masked_fill(~visible_RS[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("rhs,rshk->rhk", probs_RHS, v_RSHK)
