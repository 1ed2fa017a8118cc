"""What the Hugging Face architectures share: the synchronous pieces between yields (norms, RoPE,
projections, the attention kernel), paged attention over a per-request context, and the weight
slots a loader fills.

Every piece that runs between two yields is a plain function of tensors and Python scalars (the
model collects them in :class:`~asyncdbo.models.hf.model.Segments`), never a method that reads
weights from ``self``: one compiled graph then serves every layer (the weights are inputs, not
constants baked into the graph), and the whole set can be swapped for ``torch.compile``\\ d
twins without touching the ``async def`` code around them.  A coroutine cannot suspend inside a
compiled region, so the pieces end exactly where the forward awaits (the MoE layer's comm, the
K/V ordering wait).

Numerics follow transformers' reference code in fp32: RMSNorm in float32 then times the weight,
RoPE from ``cat(freqs, freqs)`` tables (rotate-half, or DeepSeek's interleaved pairs), softmax
attention scaled by the architecture's factor and masked causally by position.
"""

# Shape legend: T = tokens, D = hidden, H = heads, K = query/key head dim, V = value head dim,
# S = context length of one request, R = rotary dims / 2, F = input features, O = output features.

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...moe import batch_invariant
from ...plan.metadata import AttentionMetadata
from ..attention import PagedKVCache, padded_causal_mask, slots_for
from ..tiled_attention import tiled_causal_attention

__all__ = ["Rope", "WeightSlots", "apply_rope", "attend", "paged_attention", "per_request_attention", "rms_norm",
           "rope_from_hf"]

#: RoPE variants whose tables depend only on the config (not on the sequence length).
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def rms_norm(x_TD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: in float32, back to the input dtype, times the weight."""
    x32_TD = x_TD.float()
    return w_D * (x32_TD * torch.rsqrt(x32_TD.pow(2).mean(-1, keepdim=True) + eps)).to(x_TD.dtype)


def residual_norm(x_TD: torch.Tensor, delta_TD: torch.Tensor, w_D: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + delta`` and its RMSNorm: the residual stream and the next block's input."""
    x_TD = x_TD + delta_TD
    return x_TD, rms_norm(x_TD, w_D, eps)


def linear(x_TF: torch.Tensor, w_OF: torch.Tensor, b_O: torch.Tensor | None, tile: int | None = None) -> torch.Tensor:
    """A projection (a piece of its own: the attention output and the LM head).  With ``tile``
    (exact mode) the GEMM runs in fixed row tiles, so a row's bits do not depend on the other
    rows of the call (:func:`asyncdbo.moe.batch_invariant.linear`); the bias is then added on
    its own (an elementwise add is exact wherever the row sits)."""
    if tile is None:
        return F.linear(x_TF, w_OF, b_O)
    y_TO = batch_invariant.linear(x_TF, w_OF, tile)
    return y_TO if b_O is None else y_TO + b_O


def apply_rope(x_THK: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate ``x`` by position.  ``cos``/``sin`` are ``cat(freqs, freqs)`` tables; interleaved
    (DeepSeek) rotates pairs ``(x0, x1), (x2, x3), ...`` and returns them de-interleaved, as
    transformers does (queries and keys get the same permutation, so their dot products do not
    change)."""
    cos_T1K, sin_T1K = cos_TK[:, None, :], sin_TK[:, None, :]
    if interleave:
        half = cos_TK.shape[-1] // 2
        c, s = cos_T1K[..., :half], sin_T1K[..., :half]
        x1, x2 = x_THK[..., 0::2], x_THK[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    half = x_THK.shape[-1] // 2
    rotated = torch.cat([-x_THK[..., half:], x_THK[..., :half]], dim=-1)
    return x_THK * cos_T1K + rotated * sin_T1K


def attend(q_HTK: torch.Tensor, k_HSK: torch.Tensor, v_HSV: torch.Tensor, visible_TS: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Softmax attention of one request's queries over its context (``visible`` masks)."""
    scores_HTS = torch.matmul(q_HTK, k_HSK.transpose(1, 2)) * scale
    probs_HTS = scores_HTS.masked_fill(~visible_TS, float("-inf")).softmax(dim=-1, dtype=torch.float32)
    return torch.matmul(probs_HTS.to(v_HSV.dtype), v_HSV)


@dataclass(frozen=True)
class Rope:
    """Rotary tables of one model: ``inv_freq_R`` and transformers' ``attention_scaling``
    (yarn scales cos/sin by it; 1.0 otherwise)."""

    inv_freq_R: torch.Tensor
    scaling: float
    interleave: bool

    def tables(self, positions_T: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos_TK, sin_TK)`` with ``K = 2R`` for the given absolute positions."""
        freqs_TR = positions_T.float()[:, None] * self.inv_freq_R.to(positions_T.device)[None, :]
        emb_TK = torch.cat([freqs_TR, freqs_TR], dim=-1)
        return (emb_TK.cos() * self.scaling).to(dtype), (emb_TK.sin() * self.scaling).to(dtype)


def rope_from_hf(hf_config: Any, dim: int, *, interleave: bool = False) -> Rope:
    """RoPE of ``dim`` rotary dims from a transformers config's ``rope_parameters``.  Only static
    variants (tables that do not depend on the sequence length) are supported."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported: its tables change with the sequence length; "
            f"supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if factor not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor={factor} is not supported (only full rotary head dims)")
    if rope_type == "default":
        theta = float(params["rope_theta"])
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return Rope(inv_freq_R=inv_freq, scaling=1.0, interleave=interleave)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    if inv_freq.shape != (dim // 2,):
        raise ValueError(f"{rope_type} RoPE gave {tuple(inv_freq.shape)} frequencies; expected ({dim // 2},)")
    return Rope(inv_freq_R=inv_freq.float(), scaling=float(scaling), interleave=interleave)


def paged_attention(
    q_THK: torch.Tensor,
    positions_T: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    attn: AttentionMetadata,
    *,
    scale: float,
    context: Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]],
    attend_fn: Callable[..., torch.Tensor],
    v_dim: int,
    exact: bool = False,
    decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each request's new queries over its cached context, causal by position (the K/V of this
    step already written).  ``context(k_S.., v_S..)`` turns what the cache holds into per-head
    ``(k_HSK, v_HSV)``: repeated KV heads (GQA) or the expanded latent (MLA); it is called once
    over the rows of many requests.  Rows past ``attn.num_actual_tokens`` (padding) get zeros.

    The requests are attended in at most two calls (decode requests, then the rest), each padded
    to its longest query run and context, instead of a Python loop over requests
    (:func:`per_request_attention`, which it equals within float rounding: the GEMMs see other
    shapes). ``decode(q_RHK, cached_RS.., visible_RS)`` (optional) attends the decode requests
    straight from the cached rows instead (MLA's absorbed form: no per-head expansion), returning
    ``[R, H, V]``.

    ``exact`` runs :func:`~asyncdbo.models.tiled_attention.tiled_causal_attention` instead (a
    query's bits depend only on its position and its request's context, not on the call; half
    types computed in float32); ``context`` must then be batch-invariant too (exact mode's MLA
    expansion runs in fixed row tiles)."""
    out_THV = q_THK.new_zeros(q_THK.shape[0], q_THK.shape[1], v_dim)
    if exact:
        cfg = cache.cfg
        k_flat = cache.k_cache_LNZHK[layer].view(-1, cfg.num_heads, cfg.head_dim)
        v_flat = cache.v_cache_LNZHK[layer].view(-1, cfg.num_heads, cfg.value_dim) if cfg.value_dim else None
        out_THV[: attn.num_actual_tokens] = tiled_causal_attention(
            q_THK, positions_T, k_flat, v_flat, attn, cfg.block_size, scale, context=context, v_dim=v_dim)
        return out_THV
    if attn.num_reqs == 0:
        return out_THV
    # Decode requests (one query) and the rest go in two calls, so a long prefill does not pad
    # every decode request's queries to its length.
    qlen_R = attn.query_start_loc_cpu[1:] - attn.query_start_loc_cpu[:-1]
    for reqs_R, one in (((qlen_R == 1).nonzero().squeeze(1), True), ((qlen_R > 1).nonzero().squeeze(1), False)):
        if reqs_R.numel():
            _attend_requests(out_THV, q_THK, positions_T, cache, layer, attn, reqs_R, scale=scale,
                             context=context, attend_fn=attend_fn, decode=decode if one else None)
    return out_THV


def _attend_requests(out_THV: torch.Tensor, q_THK: torch.Tensor, positions_T: torch.Tensor, cache: PagedKVCache,
                     layer: int, attn: AttentionMetadata, reqs_R: torch.Tensor, *, scale: float,
                     context: Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]],
                     attend_fn: Callable[..., torch.Tensor],
                     decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None) -> None:
    """Requests ``reqs_R`` in one call, padded to the most queries (Q) and context (S) among them:
    the cached rows of every request are read through one ``[R, S]`` slot table (a position past
    a request's context reads its position 0: finite, and masked), expanded by ``context`` in one
    call, and attended as ``R x H`` batches; padding query rows see key position 0 and are dropped
    (:func:`~asyncdbo.models.attention.padded_causal_mask`). Shape legend here:
    Q = queries of one request (padded), S = context (padded), G = cached heads, X = R * H."""
    dev = q_THK.device
    qsl_R1 = attn.query_start_loc_cpu.long()
    start_R, qlen_R, seq_R = qsl_R1[reqs_R], (qsl_R1[1:] - qsl_R1[:-1])[reqs_R], attn.seq_lens_cpu.long()[reqs_R]
    R, Q, S = reqs_R.numel(), int(qlen_R.max()), int(seq_R.max())
    q_Q, pos_S = torch.arange(Q), torch.arange(S)
    real_RQ = q_Q[None, :] < qlen_R[:, None]
    rows_RQ = (start_R[:, None] + q_Q[None, :]).where(real_RQ, 0)
    kpos_RS = pos_S[None, :].where(pos_S[None, :] < seq_R[:, None], 0).to(attn.block_table.device)
    bs = cache.cfg.block_size
    table_RB = attn.block_table.index_select(0, reqs_R.to(attn.block_table.device)).long()
    slots_X = (table_RB.gather(1, kpos_RS // bs) * bs + kpos_RS % bs).flatten().to(dev)
    k_cached, v_cached = cache.read(layer, slots_X)
    rows = rows_RQ.flatten().to(dev)
    if decode is not None:  # one query per request: Q == 1
        assert v_cached is None and Q == 1, "the absorbed decode reads a keys-only (latent) cache"
        visible_RS = pos_S.to(dev)[None, :] <= positions_T[rows][:, None]
        o_RHV = decode(q_THK[rows], k_cached.view(R, S, *k_cached.shape[1:]), visible_RS)
        out_THV[rows] = o_RHV.to(out_THV.dtype)
        return
    k_HXK, v_HXV = context(k_cached, v_cached)  # X = R * S rows here
    H, K, V = k_HXK.shape[0], k_HXK.shape[-1], v_HXV.shape[-1]
    k_XSK = k_HXK.view(H, R, S, K).transpose(0, 1).reshape(R * H, S, K)
    v_XSV = v_HXV.view(H, R, S, V).transpose(0, 1).reshape(R * H, S, V)
    q_XQK = q_THK[rows].view(R, Q, H, -1).permute(0, 2, 1, 3).reshape(R * H, Q, -1)
    visible_RQS = padded_causal_mask(positions_T, rows, real_RQ, S)  # padding rows see key 0
    visible_XQS = visible_RQS[:, None].expand(R, H, Q, S).reshape(R * H, Q, S)
    o_RQHV = attend_fn(q_XQK, k_XSK, v_XSV, visible_XQS, scale).view(R, H, Q, V).transpose(1, 2)
    real = real_RQ.flatten().to(dev)
    out_THV[rows[real]] = o_RQHV.reshape(R * Q, H, V)[real].to(out_THV.dtype)


def per_request_attention(
    q_THK: torch.Tensor,
    positions_T: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    attn: AttentionMetadata,
    *,
    scale: float,
    context: Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]],
    attend_fn: Callable[..., torch.Tensor],
    v_dim: int,
) -> torch.Tensor:
    """The same attention one request at a time (the loop :func:`paged_attention` ran before it
    batched): the reference its tests compare with, and the baseline of its host-time measure."""
    out_THV = q_THK.new_zeros(q_THK.shape[0], q_THK.shape[1], v_dim)
    qsl, seq_lens = attn.query_start_loc_cpu.tolist(), attn.seq_lens_cpu.tolist()
    for r in range(attn.num_reqs):
        t0, t1, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        if t1 == t0:
            continue
        pos_S = torch.arange(seq_len, device=q_THK.device)
        k_cached, v_cached = cache.read(layer, slots_for(attn.block_table[r], pos_S, cache.cfg.block_size))
        k_HSK, v_HSV = context(k_cached, v_cached)
        visible_TS = pos_S[None, :] <= positions_T[t0:t1, None]
        out_THV[t0:t1] = attend_fn(q_THK[t0:t1].transpose(0, 1), k_HSK, v_HSV, visible_TS, scale).transpose(0, 1)
    return out_THV


class WeightSlots:
    """Checkpoint tensor name -> the tensor (or view) of this rank's model it fills.

    The model registers a slot for every tensor it needs on this rank (its own experts only);
    a loader streams ``(name, tensor)`` pairs in and :meth:`fill` copies the ones with a slot,
    checking shapes.  Names without a slot (another rank's experts, layers the model does not
    run) are skipped, so a rank never keeps what it does not own."""

    def __init__(self) -> None:
        self._slots: dict[str, torch.Tensor] = {}
        self._filled: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        assert name not in self._slots, f"slot {name} registered twice"
        self._slots[name] = tensor
        return tensor

    def new(self, name: str, *shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Register and return a fresh (uninitialised) tensor for ``name``."""
        return self.add(name, torch.empty(shape, dtype=dtype, device=device))

    def wants(self, name: str) -> bool:
        return name in self._slots

    def names(self) -> list[str]:
        return list(self._slots)

    def __getitem__(self, name: str) -> torch.Tensor:
        """The tensor registered for ``name`` (KeyError if this rank has no slot for it)."""
        return self._slots[name]

    def numel(self) -> int:
        """Elements this rank holds for the checkpoint (what it kept of the full model)."""
        return sum(t.numel() for t in self._slots.values())

    @torch.no_grad()
    def fill(self, name: str, value: torch.Tensor, *, origin: str) -> bool:
        """Copy ``value`` into the slot ``name`` (cast to its dtype); False if there is no slot.
        ``origin`` (a file, or "the state dict") names where it came from in errors."""
        slot = self._slots.get(name)
        if slot is None:
            return False
        _check_shape(name, tuple(value.shape), slot, origin)
        slot.copy_(value)
        self._filled.add(name)
        return True

    @torch.no_grad()
    def fill_rows(self, name: str, shape: tuple[int, ...], read: Callable[[int, int], torch.Tensor], *,
                  origin: str, block_rows: int) -> bool:
        """:meth:`fill` from a tensor of ``shape`` read ``block_rows`` rows at a time
        (``read(a, b)`` gives rows ``a:b``), so that no copy of the whole tensor is ever held
        beside its slot (DeepSeek-V3's embedding is 1.85 GB of bf16)."""
        slot = self._slots.get(name)
        if slot is None:
            return False
        assert shape, "a scalar has no rows: fill() it"
        _check_shape(name, shape, slot, origin)
        step = max(1, block_rows)
        for a in range(0, shape[0], step):
            slot[a: a + step].copy_(read(a, min(shape[0], a + step)))
        self._filled.add(name)
        return True

    def missing(self) -> list[str]:
        return [n for n in self._slots if n not in self._filled]

    def fill_all(self, items: Iterable[tuple[str, torch.Tensor]], *, origin: str) -> None:
        for name, value in items:
            self.fill(name, value, origin=origin)


def _check_shape(name: str, shape: tuple[int, ...], slot: torch.Tensor, origin: str) -> None:
    if shape != tuple(slot.shape):
        raise ValueError(
            f"{origin}: tensor {name!r} has shape {shape}, but the model built from the "
            f"config expects {tuple(slot.shape)}; the checkpoint does not match its config.json"
        )
