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

The reference implementation attends every request of a call at once, padded to the longest
query run and context, from CPU-side lengths (``*_cpu`` mirrors): it needs no device sync.

**Deterministic mode** (``deterministic=True``) runs :mod:`asyncdbo.models.tiled_attention`
instead: a query's result then depends only on its position and its request's keys, not on the
call it is in, so a DBO ubatch computes the serial step's bits.
"""

# Shape legend: T = tokens, R = requests, B = max blocks per request, S = context length of one
# request, H = heads, K = head dim, N = blocks in the cache, Z = block size, L = layers.

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .._core import get_ubatch
from ..dbo import dbo_record_event, dbo_wait_event
from ..plan.metadata import AttentionMetadata
from ..serving import current_slice
from ..serving.kv_cache import PAD_SLOT_ID, KVCacheConfig, PagedKVCache, slots_for
from .tiled_attention import tiled_causal_attention

__all__ = ["LOGITS", "PAD_SLOT_ID", "KVCacheConfig", "PagedKVCache", "check_logits", "last_token_rows", "lm_head",
           "padded_causal_mask", "paged_causal_attention", "slots_for", "wait_for_earlier_kv"]

#: What a model's ``logits=`` may ask for: the LM head on every token, or on each request's last.
LOGITS = ("all", "last")

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


def check_logits(owner: str, logits: object) -> None:
    if logits not in LOGITS:
        raise ValueError(f"{owner}(logits={logits!r}): use one of {LOGITS}")


def last_token_rows(attn: AttentionMetadata) -> torch.Tensor:
    """The rows a sampler reads (a model's ``logits="last"``): each request's last new token in
    this (u)batch, but not that of a request the next ubatch continues
    (:func:`~asyncdbo.serving.current_slice`'s ``last_is_truncated``: its last token of the step
    is there), so a DBO step computes the serial step's rows."""
    qsl_R1 = attn.query_start_loc_cpu[: attn.num_reqs + 1]
    keep_R = qsl_R1[1:] > qsl_R1[:-1]
    ub_slice = current_slice()
    if attn.num_reqs and ub_slice is not None and ub_slice.last_is_truncated:
        keep_R[-1] = False
    return (qsl_R1[1:] - 1)[keep_R].long()


def lm_head(h_TD: torch.Tensor, attn: AttentionMetadata, logits: str, vocab_size: int,
            head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A model's ``[T, V]`` logits: ``head`` on every row (``logits="all"``), or only on
    :func:`last_token_rows` (``"last"``), the other rows zeros."""
    if logits == "all":
        return head(h_TD)
    rows = last_token_rows(attn).to(h_TD.device)
    logits_TV = h_TD.new_zeros(h_TD.shape[0], vocab_size)
    logits_TV[rows] = head(h_TD[rows])
    return logits_TV


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
    if attn.num_reqs and attn.max_query_len == 1 and attn.num_actual_tokens == attn.num_reqs:
        out_THK[: attn.num_reqs] = _decode_attention(q_THK[: attn.num_reqs], positions_T[: attn.num_reqs],
                                                     k_flat, v_flat, attn, block_size, scale)
        return out_THK
    if attn.num_reqs:
        _batched_attention(out_THK, q_THK, positions_T, k_flat, v_flat, attn, block_size, scale)
    return out_THK


def padded_causal_mask(positions_T: torch.Tensor, rows: torch.Tensor, real_RQ: torch.Tensor, S: int) -> torch.Tensor:
    """``visible_RQS`` of a call padded to ``Q`` queries and ``S`` keys per request: key position
    ``s`` is visible to a query at position ``p`` iff ``s <= p`` (causal by position). ``rows``
    (``[R * Q]``, on the queries' device) are the token rows read for the padded queries,
    ``real_RQ`` which of them are real queries.

    A padding query row sees key position 0 (finite: its request's own) and the caller drops it.
    A row that saw no key would softmax to NaN, and a bf16 CPU matmul spreads a NaN row of one
    ``[Q, S]`` matrix into the real row packed beside it: before this, the shorter requests of a
    mixed bf16 prefill got NaN logits (issue 45; tests/models/test_attention_nan.py)."""
    dev = positions_T.device
    R, Q = real_RQ.shape
    qpos_RQ = positions_T[rows].view(R, Q).masked_fill(~real_RQ.to(dev), 0)
    return torch.arange(S, device=dev)[None, None, :] <= qpos_RQ[:, :, None]


def _batched_attention(out_THK: torch.Tensor, q_THK: torch.Tensor, positions_T: torch.Tensor, k_flat: torch.Tensor,
                       v_flat: torch.Tensor, attn: AttentionMetadata, block_size: int, scale: float) -> None:
    """Every request at once (a ragged prefill, chunked continuations, decode requests among
    them), padded to the most new tokens of a request (Q) and the longest context (S), instead of
    a Python loop over requests, whose few ops per request dominated a prefill step of many
    short requests on a CPU.  A context position past a request's ``seq_len`` reads its position
    0 (finite) and is masked: a query's position is below its request's ``seq_len``.  Padding
    query rows see key position 0 and are dropped (:func:`padded_causal_mask`).  Shape legend
    here: Q = queries of one request (padded), S = context (padded)."""
    dev = q_THK.device
    qsl_R1 = attn.query_start_loc_cpu[: attn.num_reqs + 1].long()
    start_R, qlen_R, seq_R = qsl_R1[:-1], qsl_R1[1:] - qsl_R1[:-1], attn.seq_lens_cpu.long()[: attn.num_reqs]
    Q, S = int(qlen_R.max()), int(seq_R.max())
    if Q == 0:
        return
    q_Q, pos_S = torch.arange(Q), torch.arange(S)
    real_RQ = q_Q[None, :] < qlen_R[:, None]
    rows_RQ = (start_R[:, None] + q_Q[None, :]).where(real_RQ, 0)
    kpos_RS = pos_S[None, :].where(pos_S[None, :] < seq_R[:, None], 0).to(attn.block_table.device)
    slots_RS = slots_for(attn.block_table[: attn.num_reqs], kpos_RS, block_size).to(dev)
    k_RSHK, v_RSHK = k_flat[slots_RS], v_flat[slots_RS]
    rows = rows_RQ.flatten().to(dev)
    R, H, K = qlen_R.numel(), q_THK.shape[1], q_THK.shape[2]
    q_RQHK = q_THK[rows].view(R, Q, H, K)
    visible_RQS = padded_causal_mask(positions_T, rows, real_RQ, S)
    scores_RHQS = torch.einsum("rqhk,rshk->rhqs", q_RQHK, k_RSHK) * scale
    probs_RHQS = scores_RHQS.masked_fill(~visible_RQS[:, None], float("-inf")).softmax(-1)
    o_RQHK = torch.einsum("rhqs,rshk->rqhk", probs_RHQS, v_RSHK)
    real = real_RQ.flatten().to(dev)
    out_THK[rows[real]] = o_RQHK.reshape(R * Q, H, K)[real]


def _decode_attention(q_RHK: torch.Tensor, positions_R: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                      attn: AttentionMetadata, block_size: int, scale: float) -> torch.Tensor:
    """Uniform decode (one query per request), all requests at once.

    The per-request loop costs a few Python-level ops per request, which dominates a decode step
    of hundreds of short requests on a CPU; here the contexts are gathered into one padded
    ``[R, S]`` slot table (entries past a request's ``seq_len`` are masked) and attended in one
    batched matmul. The padding entries re-read the request's own last slot: read through the
    table's unused columns, they would touch blocks of other requests (whose contents the mask
    drops, but whose NaN would survive it, and whose reads order a DBO step against the ubatch
    that writes them).
    """
    s_max = attn.max_seq_len
    pos_S = torch.arange(s_max, device=q_RHK.device)
    last_R = (attn.seq_lens.long() - 1).clamp_(min=0)
    own_RS = torch.minimum(pos_S[None, :], last_R[:, None])
    slots_RS = slots_for(attn.block_table, own_RS, block_size)
    k_RSHK, v_RSHK = k_flat[slots_RS], v_flat[slots_RS]
    scores_RHS = torch.einsum("rhk,rshk->rhs", q_RHK, k_RSHK) * scale
    visible_RS = (pos_S[None, :] <= positions_R[:, None]) & (pos_S[None, :] < attn.seq_lens.long()[:, None])
    probs_RHS = scores_RHS.masked_fill(~visible_RS[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("rhs,rshk->rhk", probs_RHS, v_RSHK)
