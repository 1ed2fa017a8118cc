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
needs no device sync and is exact, not fast.

**Deterministic mode** (``deterministic=True``) runs :mod:`asyncdbo.models.tiled_attention`
instead: a query's result then depends only on its position and its request's keys, not on the
call it is in, so a DBO ubatch computes the serial step's bits.
"""

# Shape legend: T = tokens, R = requests, B = max blocks per request, S = context length of one
# request, H = heads, K = head dim, N = blocks in the cache, Z = block size, L = layers.

from __future__ import annotations

import math

import torch

from .._core import get_ubatch
from ..dbo import dbo_record_event, dbo_wait_event
from ..plan.metadata import AttentionMetadata
from ..serving import current_slice
from ..serving.kv_cache import PAD_SLOT_ID, KVCacheConfig, PagedKVCache, slots_for
from .tiled_attention import tiled_causal_attention

__all__ = ["PAD_SLOT_ID", "KVCacheConfig", "PagedKVCache", "paged_causal_attention", "slots_for", "wait_for_earlier_kv"]

async def wait_for_earlier_kv(owner: object, layer: int) -> None:
    """Order this ubatch's K/V read in ``layer`` of ``owner`` (a model) after the earlier
    ubatches' writes; a no-op outside a DBO run.  Call it between the write and the read.

    Only a ubatch that continues a request of the previous one waits; the runner's
    :func:`~asyncdbo.serving.current_slice` says so (no slice: wait, to be safe).  A decode ubatch never
    waits, so a low-latency schedule keeps its natural lead of one ubatch over the next.  If it
    parks, the scheduler first launches the recv hook the previous ubatch left with it (under the
    low-latency schedule that ubatch may be waiting for exactly that receive).
    """
    ub = get_ubatch()
    if ub is None:
        return
    ub_slice = current_slice()
    if ub.id > 0 and (ub_slice is None or ub_slice.first_is_continuation):
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
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """Attention of each request's new queries over its cached context, causal by position.

    Expects the new tokens' K/V already written to ``cache`` (write, then read: the same order
    vLLM's backends use).  Rows past ``attn.num_actual_tokens`` (padding) get zeros.
    ``deterministic``: a query's result depends only on its position (module docstring).
    """
    num_heads, head_dim = q_THK.shape[1], q_THK.shape[2]
    out_THK = torch.zeros_like(q_THK)
    scale = 1.0 / math.sqrt(head_dim)
    block_size = cache.cfg.block_size
    k_flat = cache.k_cache_LNZHK[layer].view(-1, num_heads, head_dim)
    v_flat = cache.v_cache_LNZHK[layer].view(-1, num_heads, head_dim)
    if deterministic:
        out_THK[: attn.num_actual_tokens] = tiled_causal_attention(q_THK, positions_T, k_flat, v_flat, attn,
                                                                   block_size, scale)
        return out_THK
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
