"""The modeled model of a prediction (see :mod:`asyncdbo.sim.predict`): one rank of an EP group
on torch's fake process group, layers of production-form attention and the library's MoE layer
on meta weights, and how a ubatch's requests become attention calls.

Legend (shape suffixes): T tokens of a ubatch, D hidden, E experts, K top-k, H heads, G KV heads,
Q q_lora_rank, L kv_lora_rank, P rope dims, N nope dims, V value head dim, F projection width,
B requests of an attention call, S key positions, C latent + rope dims of a cached row.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._core import get_ubatch
from .kernels import attention, grouped_swiglu
from .shapes import ModelShape, MoEOptions, Request, Shape

__all__ = ["DECODE_QUERIES", "AttentionGroup", "ModelLayer", "chunks", "attention_groups", "default_requests",
           "fake_ep_group", "is_decode",
           "forward", "meta", "node_dedup", "order"]

AttentionGroup = tuple[int, int, int, int]  # (first row, rows, queries per request, keys per request)


# ------------------------------------------------------------------------ the fake EP world
_WORLD = 1 << 16
_groups: dict[int, Any] = {}


@contextlib.contextmanager
def fake_ep_group(ep: int) -> Iterator[Any]:
    """An ``ep``-rank fake process group (this process is rank 0), torn down afterwards if this
    call created the fake world. None for ``ep == 1``. Refuses a process that already runs a real
    torch.distributed world: the prediction must not join its collectives."""
    if ep == 1:
        yield None
        return
    created = False
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=_WORLD)
        created = True
    elif dist.get_backend() != "fake":
        raise ValueError(
            f"predict() needs its own fake torch.distributed world, but this process already runs a "
            f"{dist.get_backend()!r} one; run the prediction in a separate process (e.g. `asyncdbo check`)"
        )
    try:
        group = _groups.get(ep)
        if group is None:
            group = _groups[ep] = dist.new_group(list(range(ep)), backend="fake")
        yield group
    finally:
        if created:
            _forget(list(_groups.values()))
            _groups.clear()
            dist.destroy_process_group()


def _forget(groups: list[Any]) -> None:
    """Drop asyncdbo's caches of ``groups`` (EP comm state, per-ubatch clones): they die with the
    fake world, and a later world reuses their ids and names."""
    from ..dist.ep import forget_ep_comm

    for g in groups:
        forget_ep_comm(g)


# ------------------------------------------------------------------------ the modeled model
_TOKENS: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("asyncdbo_sim_tokens")


def meta(*shape: int) -> torch.Tensor:
    """An empty meta tensor (a shape without data)."""
    return torch.empty(shape, device="meta")


class ModelLayer:
    """One layer on meta weights: production-form attention and the library's MoE layer."""

    def __init__(self, m: ModelShape, index: int, schedule: str, group: Any, ubatches: int, tokens: int,
                 gen: torch.Generator, moe_options: MoEOptions = ()) -> None:
        from ..moe import MoELayer
        from ..moe.router import route

        self.m = m
        D, H = m.hidden, m.heads
        if m.attention == "mla":
            qk = m.head_dim + m.rope_dim
            self.w = {"q_a": meta(m.q_lora_rank, D), "q_b": meta(H * qk, m.q_lora_rank),
                      "kv_a": meta(m.kv_lora_rank + m.rope_dim, D),
                      "kv_b": meta(H * (m.head_dim + m.v_head_dim), m.kv_lora_rank), "o": meta(D, H * m.v_head_dim)}
            kv_b = self.w["kv_b"].view(H, m.head_dim + m.v_head_dim, m.kv_lora_rank)
            self.uk_HNL, self.uv_HLV = kv_b[:, : m.head_dim], kv_b[:, m.head_dim:].transpose(1, 2)
        else:
            self.w = {"q": meta(H * m.head_dim, D), "k": meta(m.kv_heads * m.head_dim, D),
                      "v": meta(m.kv_heads * m.head_dim, D), "o": meta(D, H * m.head_dim)}
        cfg = m.moe_config(schedule, moe_options)
        with torch.device("meta"):
            self.moe = MoELayer(cfg, ep_group=group, seed=index, max_ubatches=max(2, ubatches), init_weights=False)
        # One routing table per layer for the step's tokens: the library's routing rule on random
        # logits (uniform routing), shared by the serial and the DBO run.
        logits_TE = torch.randn(tokens, m.experts, generator=gen)
        bias_E = torch.randn(m.experts, generator=gen) * 0.05 if cfg.scoring == "sigmoid" else None
        self.table = route(logits_TE, torch.eye(m.experts), cfg, bias_E=bias_E)
        self.moe._route = self._route
        self.moe._experts = self._experts  # type: ignore[method-assign]

    def weights(self) -> list[torch.Tensor]:
        moe = self.moe
        shared = [t for t in (moe.shared_gate_SD, moe.shared_up_SD, moe.shared_down_DS) if t is not None]
        return [*self.w.values(), moe.gate_LFD, moe.up_LFD, moe.down_LDF, *shared]

    def _route(self, x_TD: torch.Tensor, router_ED: torch.Tensor, cfg: Any, *, bias_E: Any = None, deterministic: bool = False) -> Any:
        F.linear(x_TD, router_ED)  # the router GEMM, priced (the table stands for its result)
        lo, hi = _TOKENS.get()
        return self.table[0][lo:hi], self.table[1][lo:hi]

    def _experts(self, plan: Any, recv_x_RD: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        return grouped_swiglu(recv_x_RD, plan.local_expert_ids(), moe.gate_LFD, moe.up_LFD, moe.down_LDF)

    def attention(self, h_TD: torch.Tensor, groups: list[AttentionGroup]) -> torch.Tensor:
        """``groups``: ``(first row, rows, queries per request, keys per request)``; rows of one
        group are ``rows / queries`` requests of equal shape (decode: one query each)."""
        m, w, H = self.m, self.w, self.m.heads
        outs = []
        if m.attention == "mla":
            L, P, N = m.kv_lora_rank, m.rope_dim, m.head_dim
            q_TF = F.linear(F.linear(h_TD, w["q_a"]), w["q_b"])
            F.linear(h_TD, w["kv_a"])  # the latent and rope key written to the cache
            for r0, n, q, keys in groups:
                if 1 < q <= DECODE_QUERIES and keys > q:  # multi-token decode (MTP, speculative verify): absorbed
                    b = n // q
                    q_nHF = q_TF[r0:r0 + n].view(n, H, N + P)
                    q_lat_HnL = torch.bmm(q_nHF[..., :N].transpose(0, 1), self.uk_HNL)
                    q_BHqC = torch.cat([q_lat_HnL.transpose(0, 1), q_nHF[..., N:]], -1).view(b, q, H, L + P).transpose(1, 2)
                    cache_B1SC = meta(b, 1, keys, L + P)
                    o_BHqL = attention(q_BHqC, cache_B1SC, cache_B1SC[..., :L], True)
                    o_nHL = o_BHqL.transpose(1, 2).reshape(n, H, L)
                    outs.append(torch.bmm(o_nHL.transpose(0, 1), self.uv_HLV).transpose(0, 1).reshape(n, -1))
                elif q == 1:  # decode: absorbed into the latent (FlashMLA)
                    q_HBN = q_TF[r0:r0 + n].view(n, H, N + P)[..., :N].transpose(0, 1)
                    q_lat_HBL = torch.bmm(q_HBN, self.uk_HNL)
                    cache_B1SC = meta(n, 1, keys, L + P)
                    q_BH1C = torch.cat([q_lat_HBL.transpose(0, 1), q_TF[r0:r0 + n].view(n, H, N + P)[..., N:]], -1)
                    o_BH1L = attention(q_BH1C.unsqueeze(2), cache_B1SC, cache_B1SC[..., :L], False)
                    outs.append(torch.bmm(o_BH1L.squeeze(2).transpose(0, 1), self.uv_HLV).transpose(0, 1).reshape(n, -1))
                else:  # prefill: the latents expanded per head, then flash attention
                    b = n // q
                    kv_SF = F.linear(meta(b * keys, L), w["kv_b"])
                    k_BHSK = meta(b, H, keys, N + P)
                    v_BHSV = kv_SF.view(b, keys, H, -1)[..., N:].transpose(1, 2)
                    q_BHTK = q_TF[r0:r0 + n].view(b, q, H, N + P).transpose(1, 2)
                    o = attention(q_BHTK, k_BHSK, v_BHSV, True)
                    outs.append(o.transpose(1, 2).reshape(n, -1))
        else:
            G, K = m.kv_heads, m.head_dim
            q_TF, _, _ = F.linear(h_TD, w["q"]), F.linear(h_TD, w["k"]), F.linear(h_TD, w["v"])
            for r0, n, q, keys in groups:
                b = n // q
                q_BHTK = q_TF[r0:r0 + n].view(b, q, H, K).transpose(1, 2)
                o = attention(q_BHTK, meta(b, G, keys, K), meta(b, G, keys, K), q > 1)
                outs.append(o.transpose(1, 2).reshape(n, -1))
        if not outs:  # an empty ubatch (padding for an idle rank's peers): nothing to attend
            return F.linear(h_TD.new_empty((0, w["o"].shape[1])), w["o"])
        return F.linear(torch.cat(outs) if len(outs) > 1 else outs[0], w["o"])


def _rms(x_TD: torch.Tensor) -> torch.Tensor:
    return x_TD * torch.rsqrt(x_TD.pow(2).mean(-1, keepdim=True) + 1e-6)


async def forward(layers: list[ModelLayer], x_TD: torch.Tensor, groups: list[AttentionGroup], lo: int,
                   hi: int, marks: dict[int, list[float]]) -> torch.Tensor:
    _TOKENS.set((lo, hi))
    ub = get_ubatch()
    assert ub is not None
    mine = marks.setdefault(ub.id, [])
    for layer in layers:
        x_TD = x_TD + layer.attention(_rms(x_TD), groups)
        x_TD = x_TD + await layer.moe.forward(_rms(x_TD))
        mine.append(ub.ext.stream.t)  # when this layer's output is ready on this ubatch's stream
    return x_TD


def chunks(requests: Sequence[Request], lo: int, hi: int) -> list[Request]:
    """The parts of ``requests`` (laid out back to back) in tokens ``[lo, hi)``, as (queries,
    keys): a request cut by ``lo`` continues after the part before it."""
    out, start = [], 0
    for q, ctx in requests:
        a, b = max(start, lo), min(start + q, hi)
        if a < b:
            out.append((b - a, ctx + (a - start) + (b - a)))
        start += q
    return out


#: The most query tokens per request that decode in the decode form (MLA absorbed into the
#: latent): one token, or 1 + the draft tokens of MTP or speculative verify. vLLM's MLA backends
#: likewise send a request to the decode kernel when its query is at most 1 + the speculative
#: tokens; FlashMLA takes several queries per request. Longer chunks are prefill.
DECODE_QUERIES = 8


def is_decode(q: int, keys: int) -> bool:
    """Whether a request of ``q`` new tokens seeing ``keys`` keys in all decodes: a few queries
    over a longer cached context (a prompt's first chunk, with nothing cached, is prefill)."""
    return q == 1 or (q <= DECODE_QUERIES and keys > q)


def attention_groups(chunks: list[Request]) -> list[AttentionGroup]:
    """Attention calls for a ubatch: the decode requests with the same number of queries (1, or 1
    + the draft tokens of MTP or speculative verify) in one call each (keys: their mean), every
    longer chunk in a call of its own."""
    by_q: dict[int, list[int]] = {}
    for q, k in chunks:
        if is_decode(q, k):
            by_q.setdefault(q, []).append(k)
    groups, row = [], 0
    for q in sorted(by_q):
        keys = by_q[q]
        groups.append((row, q * len(keys), q, max(1, round(sum(keys) / len(keys)))))
        row += q * len(keys)
    for q, k in chunks:
        if not is_decode(q, k):
            groups.append((row, q, q, k))
            row += q
    return groups


def node_dedup(ids_TK: torch.Tensor, per_rank: int, ep: int, gpus_per_node: int, share: float) -> float:
    """Bytes on the scale-out link when each token goes once to each *other* node holding one of
    its experts (DeepEP's normal kernels), over one copy per (token, expert) times ``share``
    (what the sim charges otherwise). This rank is rank 0, on node 0."""
    if share <= 0 or ep <= gpus_per_node:
        return 1.0
    nodes_TK = ids_TK // per_rank // gpus_per_node
    remote = sum(len(set(row) - {0}) for row in nodes_TK.tolist())
    return remote / (ids_TK.numel() * share)


def order(requests: Sequence[Request]) -> list[Request]:
    """Decode requests first, by queries per request, as :func:`attention_groups` lays them out."""
    return sorted(requests, key=lambda r: (not is_decode(r[0], r[0] + r[1]), r[0] if is_decode(r[0], r[0] + r[1]) else 0))


def default_requests(tokens: int, shape: Shape, context: int, spec_tokens: int = 0) -> list[Request]:
    """Decode: ``1 + spec_tokens`` tokens per request (MTP or speculative verify when above one)
    with ``context`` cached; prefill: prompts of ``context`` tokens (the last one shorter) with
    nothing cached."""
    if shape == "decode":
        q = 1 + spec_tokens
        if spec_tokens < 0 or q > DECODE_QUERIES or tokens % q:
            raise ValueError(f"decode with {spec_tokens} draft tokens takes {q} tokens per request: tokens ({tokens}) "
                             f"must be a multiple of {q}, and spec_tokens between 0 and {DECODE_QUERIES - 1}")
        return [(q, context)] * (tokens // q)
    full, rest = divmod(tokens, context)
    return [(context, 0)] * full + ([(rest, 0)] if rest else [])
