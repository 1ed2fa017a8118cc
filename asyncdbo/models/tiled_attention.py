"""Causal attention whose result for a query depends only on its position: the deterministic path.

Shape legend: T = tokens, H = heads, K = head dim, V = value head dim, G = cached heads, C' = cached
row width, N = gathered cache rows, R = requests, I = query items (QUERY_TILE rows
of one request), Q = QUERY_TILE, J = key tiles, C = KEY_TILE, X = rows of a chunk's items (n*Q),
S = key positions of a chunk (J*C).

Without it, DBO changes a token's bits: a request cut between two ubatches is attended by ubatch 0
over a shorter context than in the serial step, and the BLAS and softmax reductions over the
context split their sums by its length (the masked keys add exact zeros, but the summation tree
moves); a few queries also take other GEMM paths than many. So:

* each request's queries are cut into items of ``QUERY_TILE`` rows (the last one zero-padded),
  and every score or value GEMM is one item against one key tile: ``[Q, K] x [K, C]`` and
  ``[Q, C] x [C, K]``, the same shapes whatever the call holds;
* the context is read in ``KEY_TILE``-key tiles at fixed absolute positions (``[j*C, (j+1)*C)``);
  the softmax max is exact in any order, and the per-tile sums of ``exp`` and of ``P @ V`` are
  added in tile order 0, 1, 2, ... A tile a query cannot see (past its position, or past its
  request's context) contributes exact zeros at the end of that order, so a shorter context (a
  truncated head in DBO) or a longer one (other tokens of the serial step) ends with the same bits.

Items of one request share its keys (a zero-stride ``bmm`` batch, no copies); items alone in
their request get their own keys, in one batch. At ``QUERY_TILE >= 8`` rows neither the batching
nor the operand strides change a row's bits (``tests/test_batch_invariant.py`` checks head dims
32 to 128; at 1-2 rows they do). Elementwise ops and per-row reductions give a row the same bits
wherever it sits. Items are processed in chunks whose score block stays under ``CHUNK_SCORES``
elements, which bounds memory and, each item being computed on its own, changes no bits.

A cache that stores something other than per-head keys and values (grouped KV heads, MLA's
compressed latent) passes a ``context`` that turns the gathered cache rows into them; it is called
on every row of a request's key tiles, so it must itself give a row the same bits whatever rows
share the call (a repeat, or a GEMM in fixed row tiles: :func:`asyncdbo.moe.batch_invariant.linear`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..plan.metadata import AttentionMetadata

__all__ = ["CHUNK_SCORES", "KEY_TILE", "QUERY_TILE", "tiled_causal_attention"]

#: Queries per GEMM (a decode request pads its one query to this).
QUERY_TILE = 8
#: Keys per tile; tiles start at multiples of it.
KEY_TILE = 64
#: Score elements (heads x rows x keys) one chunk of items may hold.
CHUNK_SCORES = 1 << 22


#: Cache rows ``(k_NGC', v_NGC' or None)`` -> per-head ``(k_HNK, v_HNV)`` (module docstring).
Context = Callable[[torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]


def tiled_causal_attention(q_THK: torch.Tensor, positions_T: torch.Tensor, k_flat: torch.Tensor,
                           v_flat: torch.Tensor | None, attn: AttentionMetadata, block_size: int,
                           scale: float, *, context: Context | None = None,
                           v_dim: int | None = None) -> torch.Tensor:
    """Attention of the new queries over their cached context (K/V already written), causal by
    position. ``k_flat``/``v_flat`` are the layer's cache as ``[slots, H, K]``, or as stored
    (``[slots, G, C']``, values possibly None) with a ``context`` that expands gathered rows to
    per-head keys and ``v_dim``-wide values. Returns ``[num_actual_tokens, H, V]``; half types
    are computed in float32."""
    H, K = q_THK.shape[1], q_THK.shape[2]
    V = K if v_dim is None else v_dim
    T = attn.num_actual_tokens
    out_THK = q_THK.new_zeros((T, H, V))
    if T == 0:
        return out_THK
    Q, C = QUERY_TILE, KEY_TILE
    # Items, on the host from the CPU mirrors: item i holds token rows rows_IQ[i] of request
    # req_I[i]; a request's queries are the last positions of its seq_len.
    qsl_R1 = attn.query_start_loc_cpu.long()
    end_R, seq_R = qsl_R1[1:], attn.seq_lens_cpu.long()
    items_R = (end_R - qsl_R1[:-1] + Q - 1) // Q
    req_I = torch.repeat_interleave(torch.arange(attn.num_reqs), items_R)
    nth_I = torch.arange(req_I.numel()) - torch.repeat_interleave(items_R.cumsum(0) - items_R, items_R)
    rows_IQ = qsl_R1[:-1][req_I, None] + nth_I[:, None] * Q + torch.arange(Q)[None, :]
    real_IQ = rows_IQ < end_R[req_I, None]
    rows_IQ = rows_IQ.where(real_IQ, 0)
    tiles_I = (seq_R[req_I] - end_R[req_I] + rows_IQ.amax(dim=1)) // C + 1  # key tiles an item needs
    work = torch.float32 if q_THK.dtype in (torch.float16, torch.bfloat16) else q_THK.dtype
    tiles = tiles_I.tolist()
    first = 0
    while first < len(tiles):  # chunks of consecutive items
        last, J = first + 1, tiles[first]
        while last < len(tiles) and H * max(J, tiles[last]) * (last + 1 - first) * Q * C <= CHUNK_SCORES:
            J = max(J, tiles[last])
            last += 1
        _attend_chunk(out_THK, q_THK, positions_T, k_flat, v_flat, attn, block_size, scale, work,
                      req_I[first:last], rows_IQ[first:last], real_IQ[first:last], tiles_I[first:last], J, context)
        first = last
    return out_THK


def _attend_chunk(out_THK: torch.Tensor, q_THK: torch.Tensor, positions_T: torch.Tensor, k_flat: torch.Tensor,
                  v_flat: torch.Tensor | None, attn: AttentionMetadata, block_size: int, scale: float,
                  work: torch.dtype, req_I: torch.Tensor, rows_IQ: torch.Tensor, real_IQ: torch.Tensor,
                  tiles_I: torch.Tensor, J: int, context: Context | None) -> None:
    """Items ``req_I``/``rows_IQ`` against key tiles ``0..J-1``: the scores of every (item, tile)
    pair the item needs (the others stay -inf), one exact max, then the tile sums in order. Writes
    the items' real rows of ``out_THK``."""
    dev = q_THK.device
    H, K, V = q_THK.shape[1], q_THK.shape[2], out_THK.shape[2]
    Q, C = QUERY_TILE, KEY_TILE
    # Order: items alone in their request first (one batch), then each shared request's items.
    reqs, per_req = torch.unique_consecutive(req_I, return_counts=True)
    alone_I = torch.repeat_interleave(per_req == 1, per_req)
    order = torch.cat([alone_I.nonzero().squeeze(1), (~alone_I).nonzero().squeeze(1)])
    req_I, rows_IQ, real_IQ, tiles_I = req_I[order], rows_IQ[order], real_IQ[order], tiles_I[order]
    n, X, S = req_I.numel(), req_I.numel() * Q, J * C
    num_alone = int(alone_I.sum())
    # Keys and values of every request of the chunk at positions 0..S-1; positions past a context
    # read the slot of its position 0: real, finite values, whose weights are exact zeros.
    table = attn.block_table
    kpos_S = torch.arange(S)
    kpos_RS = kpos_S[None, :].where(kpos_S[None, :] < _seq_of(attn, reqs)[:, None], 0).to(table.device)
    table_RB = table.index_select(0, reqs.to(table.device)).long()
    slots = (table_RB.gather(1, kpos_RS // block_size) * block_size + kpos_RS % block_size).flatten().to(dev)
    k_rows, v_rows = k_flat.index_select(0, slots), None if v_flat is None else v_flat.index_select(0, slots)
    if context is not None:
        k_HNK, v_HNV = context(k_rows, v_rows)
        k_rows, v_rows = k_HNK.transpose(0, 1), v_HNV.transpose(0, 1)
    assert v_rows is not None, "a keys-only cache needs a context that makes the values"
    k_RSHK = k_rows.reshape(-1, S, H, K).to(work)
    v_RSHV = v_rows.reshape(-1, S, H, V).to(work)
    # Groups of items that share one bmm: (first item, count, keys [count or 1, S, H, K], values).
    groups: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    if num_alone == reqs.numel():  # every request has one item (decode): the keys are per item already
        groups.append((0, num_alone, k_RSHK, v_RSHV))
    elif num_alone:
        idx = (per_req == 1).nonzero().squeeze(1).to(dev)
        groups.append((0, num_alone, k_RSHK.index_select(0, idx), v_RSHV.index_select(0, idx)))
    start = num_alone
    for r, cnt in zip((per_req > 1).nonzero().squeeze(1).tolist(), per_req[per_req > 1].tolist()):
        groups.append((start, cnt, k_RSHK[r:r + 1].expand(cnt, S, H, K), v_RSHV[r:r + 1].expand(cnt, S, H, V)))
        start += cnt
    tiles = tiles_I.tolist()

    def live(a: int, cnt: int, j: int) -> tuple[int, int]:
        """The group's items that need tile j: a suffix for one request (its items' positions grow),
        all of them for the alone items (a tile nobody needs costs a GEMM, changes no bits)."""
        if a < num_alone:
            return 0, cnt
        skip = next((i for i in range(cnt) if tiles[a + i] > j), cnt)
        return skip, cnt - skip
    q_IQHK = q_THK[rows_IQ.to(dev)].to(work).masked_fill(~real_IQ.to(dev)[:, :, None, None], 0)
    # Scores [H, J, X, C]: one [Q, K] x [K, C] GEMM per (item, head, tile it needs).
    s_HJXC = q_IQHK.new_full((H, J, X, C), float("-inf"))
    for j in range(J):
        for a, cnt, k_GSHK, _ in groups:
            skip, m = live(a, cnt, j)
            if not m:
                continue
            b = a + skip
            for h in range(H):
                torch.bmm(q_IQHK[b:b + m, :, h], k_GSHK[skip:, j * C:(j + 1) * C, h].transpose(1, 2),
                          out=s_HJXC[h, j, b * Q:(b + m) * Q].view(m, Q, C))
    rows_X, real_X = rows_IQ.flatten().to(dev), real_IQ.flatten().to(dev)
    # Padding rows see no key (unlike the fast paths' padded_causal_mask): their max is set to 0
    # and their sum to 1 below, so they give exact zeros, never NaN, in any dtype.
    qpos_X = positions_T[rows_X].masked_fill(~real_X, -1)
    seq_X = _seq_of(attn, req_I).repeat_interleave(Q).to(dev)
    kpos_JC = torch.arange(S, device=dev).view(J, C)
    visible_JXC = (kpos_JC[:, None, :] <= qpos_X[None, :, None]) & (kpos_JC[:, None, :] < seq_X[None, :, None])
    s_HJXC = s_HJXC.mul_(scale).masked_fill_(~visible_JXC, float("-inf"))
    m_HX = s_HJXC.amax(dim=(1, 3))  # exact in any order
    m_HX = m_HX.masked_fill_(m_HX == float("-inf"), 0.0)
    p_HJXC = s_HJXC.sub_(m_HX[:, None, :, None]).exp_()
    l_HJX = p_HJXC.sum(dim=-1)
    pv_HJXV = q_IQHK.new_zeros((H, J, X, V))  # pairs skipped above: exact zeros
    for j in range(J):
        for a, cnt, _, v_GSHV in groups:
            skip, m = live(a, cnt, j)
            if not m:
                continue
            b = a + skip
            for h in range(H):
                torch.bmm(p_HJXC[h, j, b * Q:(b + m) * Q].view(m, Q, C), v_GSHV[skip:, j * C:(j + 1) * C, h],
                          out=pv_HJXV[h, j, b * Q:(b + m) * Q].view(m, Q, V))
    l_HX, o_HXV = l_HJX[:, 0], pv_HJXV[:, 0]
    for j in range(1, J):  # tile order: tiles a row cannot see add exact zeros
        l_HX = l_HX + l_HJX[:, j]
        o_HXV = o_HXV + pv_HJXV[:, j]
    o_XHV = (o_HXV / l_HX.masked_fill(l_HX == 0, 1.0)[..., None]).permute(1, 0, 2)
    # The real rows picked on the host (real_IQ comes from the CPU mirrors): a boolean index on the
    # device would read its count back to the host, a sync in the middle of the step.
    sel_X = real_IQ.flatten().nonzero().squeeze(1)
    out_THK[rows_IQ.flatten()[sel_X].to(dev)] = o_XHV[sel_X.to(dev)].to(out_THK.dtype)


def _seq_of(attn: AttentionMetadata, reqs: torch.Tensor) -> torch.Tensor:
    """``seq_lens`` of the given requests, from the CPU mirror (int64, on the host)."""
    return attn.seq_lens_cpu.long()[reqs]
