"""Paged KV cache and varlen causal attention over it, the way vLLM's attention backends see a batch.

A batch is a concatenation of requests' new tokens (``query_start_loc``); each request ``r`` has
``seq_lens[r]`` tokens of context in total, the last ``q_len`` of which are the new ones here.
New keys/values are written into a paged cache through ``slot_mapping`` (one slot per token,
``block_id * block_size + offset``); a request's context is read back through its
``block_table`` row up to ``seq_len``.  The causal mask is by *position*: a query at position
``p`` sees every cached key at position ``<= p``.

This is exactly what makes a chunked-prefill continuation work: a request whose first tokens
were in an earlier ubatch finds their keys in the cache (the earlier ubatch wrote them in the
same layer first), and its ``seq_len`` spans that prefix.

The reference implementation loops over requests with CPU-side lengths (``*_cpu`` mirrors): it
needs no device sync and is exact, not fast.

**Deterministic mode** (``deterministic=True``) makes a query's result depend only on its own
position and its request's keys, not on the call it is in. Without it, DBO changes a token's
bits: a request cut between two ubatches is attended by ubatch 0 over a shorter context than in
the serial step, and the BLAS and softmax reductions over the context split their sums by the
context length (the masked keys are exact zeros, but the summation tree moves); small query
counts also take other GEMM paths. So the deterministic path:

* cuts each request's queries into items of ``QUERY_TILE`` rows (padded), so every GEMM has the
  same shape whatever the number of queries;
* reads the context in ``KEY_TILE``-key tiles at fixed absolute positions (``[j*KEY_TILE,
  (j+1)*KEY_TILE)``), computes one score GEMM and one value GEMM per tile, and adds the tiles'
  partial sums in tile order 0, 1, 2, ...; the row max is exact in any order. Tiles past a
  query's position contribute exact zeros at the end of that order, so a longer context (the
  serial step) leaves the bits unchanged.
"""

# Shape legend: T = tokens, R = requests, B = max blocks per request, S = context length of one
# request, H = heads, K = head dim, N = blocks in the cache, Z = block size, L = layers,
# I = query items (QUERY_TILE rows of one request), Q = QUERY_TILE, J = key tiles, C = KEY_TILE.

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..plan.metadata import AttentionMetadata

__all__ = ["KEY_TILE", "QUERY_TILE", "KVCacheConfig", "PagedKVCache", "paged_causal_attention", "slots_for"]

#: slot_mapping value of a token that writes nothing (padding), as in vLLM.
PAD_SLOT_ID = -1
#: Queries per GEMM in deterministic mode (a decode request pads its one query to this).
QUERY_TILE = 8
#: Keys per tile in deterministic mode; tiles start at multiples of it.
KEY_TILE = 64


@dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """Shape of one rank's paged KV cache (all layers)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_heads", "head_dim"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"KVCacheConfig.{name} must be >= 1 (got {value})")

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
        self.k_cache_LNZHK = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v_cache_LNZHK = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    def write(self, layer: int, k_THK: torch.Tensor, v_THK: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
        """Store the new tokens' keys/values at their slots; ``PAD_SLOT_ID`` slots are skipped."""
        if k_THK.shape[0] == 0:
            return
        keep_T = slot_mapping_T >= 0
        slots = slot_mapping_T[keep_T]
        flat_k = self.k_cache_LNZHK[layer].view(-1, self.cfg.num_heads, self.cfg.head_dim)
        flat_v = self.v_cache_LNZHK[layer].view(-1, self.cfg.num_heads, self.cfg.head_dim)
        flat_k.index_copy_(0, slots, k_THK[keep_T])
        flat_v.index_copy_(0, slots, v_THK[keep_T])

    def reset(self) -> None:
        for t in (*self.k_cache_LNZHK, *self.v_cache_LNZHK):
            t.zero_()


def slots_for(block_table_B: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of the given positions of one request (int64)."""
    return block_table_B.long()[positions // block_size] * block_size + positions % block_size


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
        if attn.num_actual_tokens:
            # Half types accumulate the online softmax in float32 (one rounding at the end).
            work = torch.float32 if q_THK.dtype in (torch.float16, torch.bfloat16) else q_THK.dtype
            out_THK[: attn.num_actual_tokens] = _tiled_attention(
                q_THK.to(work), positions_T, k_flat, v_flat, attn, block_size, scale).to(q_THK.dtype)
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


def _tiled_attention(q_THK: torch.Tensor, positions_T: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                     attn: AttentionMetadata, block_size: int, scale: float) -> torch.Tensor:
    """The deterministic path (module docstring). Returns ``[num_actual_tokens, H, K]``.

    An online softmax over the key tiles in order 0, 1, 2, ...: per tile, one ``[Q, K] x [K, C]``
    score GEMM and one ``[Q, C] x [C, K]`` value GEMM per (item, head), over the items that reach
    the tile. Items of one request share the tile's keys (a zero-stride batch, no copies); items
    alone in their request get their own keys in one batch. Every GEMM has the same shape either
    way, and at ``Q >= 8`` rows neither the batching nor the operand strides change a row's bits
    (``tests/test_batch_invariant.py``). Only the GEMMs see the padding rows; the softmax
    arithmetic runs on the real rows (elementwise ops and per-row reductions give a row the same
    bits wherever it sits). A tile whose keys a row cannot see changes nothing for that row (its
    max stays, the rescale factor is exactly 1, the added terms are exact zeros), so an item that
    stops earlier (a truncated head in DBO) ends with the same bits."""
    dev = q_THK.device
    H, K = q_THK.shape[1], q_THK.shape[2]
    Q, C = QUERY_TILE, KEY_TILE
    T = attn.num_actual_tokens
    table = attn.block_table
    # Items, on the host from the CPU mirrors: item i holds token rows rows_IQ[i] (Q of them, the
    # real ones first) of request req_I[i]; a request's queries are the last positions of its seq_len.
    qsl_R1 = attn.query_start_loc_cpu.long()
    end_R, seq_R = qsl_R1[1:], attn.seq_lens_cpu.long()
    items_R = (end_R - qsl_R1[:-1] + Q - 1) // Q
    req_I = torch.repeat_interleave(torch.arange(attn.num_reqs), items_R)
    nth_I = torch.arange(req_I.numel()) - torch.repeat_interleave(items_R.cumsum(0) - items_R, items_R)
    rows_IQ = qsl_R1[:-1][req_I, None] + nth_I[:, None] * Q + torch.arange(Q)[None, :]
    real_IQ = rows_IQ < end_R[req_I, None]
    rows_IQ = rows_IQ.where(real_IQ, 0)
    last_tile_I = (seq_R[req_I] - end_R[req_I] + rows_IQ.amax(dim=1)) // C  # tile of the item's last query
    q_IQHK = q_THK[rows_IQ.to(dev)].masked_fill(~real_IQ.to(dev)[:, :, None, None], 0)  # padding rows zero
    seq_T = torch.repeat_interleave(seq_R, end_R - qsl_R1[:-1]).to(dev)
    pos_T = positions_T[:T]

    def tile_kv(reqs: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[len(reqs), C, H, K]`` of tile j. Positions past a context read the
        slot of its position 0: real, finite values, whose weights are exact zeros."""
        kpos_C = torch.arange(j * C, (j + 1) * C)
        kpos_RC = kpos_C[None, :].where(kpos_C[None, :] < seq_R[reqs][:, None], 0).to(table.device)
        table_RB = table.index_select(0, reqs.to(table.device)).long()
        slots = (table_RB.gather(1, kpos_RC // block_size) * block_size + kpos_RC % block_size).flatten().to(dev)
        k_RCHK = k_flat.index_select(0, slots).view(-1, C, H, K).to(q_THK.dtype)
        return k_RCHK, v_flat.index_select(0, slots).view(-1, C, H, K).to(q_THK.dtype)

    # Online-softmax state per real query row (token) and head.
    m_HT = q_THK.new_full((H, T), float("-inf"))
    l_HT = q_THK.new_zeros((H, T))
    o_HTK = q_THK.new_zeros((H, T, K))
    for j in range(int(last_tile_I.max()) + 1):
        live = (last_tile_I >= j).nonzero().squeeze(1)
        reqs, per_req = torch.unique_consecutive(req_I[live], return_counts=True)
        alone = per_req == 1
        # Order: items alone in their request first (one batch), then each shared request's items.
        order = torch.cat([live[torch.repeat_interleave(alone, per_req)], live[torch.repeat_interleave(~alone, per_req)]])
        groups: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (first item, items, k, v)
        if bool(alone.any()):
            groups.append((0, int(alone.sum()), *tile_kv(reqs[alone], j)))
        first = int(alone.sum())
        for r, cnt in zip(reqs[~alone].tolist(), per_req[~alone].tolist()):
            k_1CHK, v_1CHK = tile_kv(torch.tensor([r]), j)
            groups.append((first, cnt, k_1CHK.expand(cnt, C, H, K), v_1CHK.expand(cnt, C, H, K)))
            first += cnt
        n = order.numel()
        real_LQ = real_IQ[order]
        tok = rows_IQ[order][real_LQ].to(dev)  # token rows of the tile, in padded order
        pad_pos = None if bool(real_LQ.all()) else real_LQ.flatten().nonzero().squeeze(1).to(dev)
        q_LQHK = q_IQHK if n == q_IQHK.shape[0] and bool((order == torch.arange(n)).all()) \
            else q_IQHK.index_select(0, order.to(dev))
        s_HXC = q_THK.new_empty((H, n * Q, C))
        for a, cnt, k_GCHK, _ in groups:
            for h in range(H):
                torch.bmm(q_LQHK[a:a + cnt, :, h], k_GCHK[:, :, h].transpose(1, 2),
                          out=s_HXC[h, a * Q:(a + cnt) * Q].view(cnt, Q, C))
        s_HNC = s_HXC if pad_pos is None else s_HXC.index_select(1, pad_pos)
        kpos_C = torch.arange(j * C, (j + 1) * C, device=dev)
        visible_NC = (kpos_C[None, :] <= pos_T[tok][:, None]) & (kpos_C[None, :] < seq_T[tok][:, None])
        s_HNC = (s_HNC * scale).masked_fill(~visible_NC, float("-inf"))
        m_old = m_HT[:, tok]
        m_new = torch.maximum(m_old, s_HNC.amax(dim=-1))
        m_use = m_new.masked_fill(m_new == float("-inf"), 0.0)
        alpha_HN = torch.exp(m_old - m_use)
        p_HNC = torch.exp(s_HNC - m_use[..., None])
        l_HT[:, tok] = l_HT[:, tok] * alpha_HN + p_HNC.sum(dim=-1)
        if pad_pos is None:
            p_HXC = p_HNC
        else:
            p_HXC = p_HNC.new_zeros((H, n * Q, C))
            p_HXC[:, pad_pos] = p_HNC
        pv_HXK = q_THK.new_empty((H, n * Q, K))
        for a, cnt, _, v_GCHK in groups:
            for h in range(H):
                torch.bmm(p_HXC[h, a * Q:(a + cnt) * Q].view(cnt, Q, C), v_GCHK[:, :, h],
                          out=pv_HXK[h, a * Q:(a + cnt) * Q].view(cnt, Q, K))
        pv_HNK = pv_HXK if pad_pos is None else pv_HXK.index_select(1, pad_pos)
        o_HTK[:, tok] = o_HTK[:, tok] * alpha_HN[..., None] + pv_HNK
        m_HT[:, tok] = m_new
    out_HTK = o_HTK / l_HT.masked_fill(l_HT == 0, 1.0)[..., None]
    return out_HTK.permute(1, 0, 2)
