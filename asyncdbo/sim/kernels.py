"""The fused kernels a deployment runs, as torch custom ops the sim can price: attention and the
grouped expert MLP.

The library's reference model code is a numerical reference: its attention loops over requests
and expands MLA latents per head, its experts loop over local experts with one GEMM each. A
deployment runs one fused attention kernel per layer (FlashAttention, FlashMLA on the absorbed
latent) and one grouped GEMM for all local experts (DeepGEMM). Priced op by op, the reference
code would charge kernels no deployment launches, so the prediction
(:mod:`asyncdbo.sim.predict`) calls these two ops instead. On the CPU they compute the real
result (plain math); the sim prices each as one kernel:

* ``attention(q, k, v, causal)``: ``q [B, H, Tq, Dq]``, ``k [B, G, Tk, Dq]``, ``v [B, G, Tk,
  Dv]`` with ``H`` a multiple of ``G`` (GQA; MLA's absorbed form is ``G = 1`` with ``v`` a view of
  ``k``'s latent). FLOPs ``2 B H Tq Tk' (Dq + Dv)`` with ``Tk' = Tk - (Tq - 1) / 2`` when causal
  (the queries are the last ``Tq`` positions); bytes: each distinct storage read once, plus the
  output.
* ``grouped_swiglu(x, ids, gate, up, down)``: rows ``x [R, D]`` of local expert ``ids [R]``
  through ``down(silu(gate x) * up x)``. FLOPs: each expert's rows rounded up to the GEMM tile
  (a grouped GEMM tiles per expert), three GEMMs; bytes: the weights of the experts that got
  rows, the rows in and out and the intermediate; two kernels (gate/up, down).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["attention", "grouped_swiglu"]  # their cost formulas: asyncdbo.sim.cost.KERNEL_COSTS


@torch.library.custom_op("asyncdbo_sim::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Softmax attention, heads of ``k``/``v`` shared by ``H / G`` query heads; causal aligns the
    queries with the last key positions."""
    B, H, Tq, _ = q.shape
    G, Tk = k.shape[1], k.shape[2]
    rep = H // G
    k_BHTD = k.repeat_interleave(rep, dim=1)
    v_BHTD = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k_BHTD.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        pos_q = torch.arange(Tk - Tq, Tk)[:, None]
        scores = scores.masked_fill(torch.arange(Tk)[None, :] > pos_q, float("-inf"))
    return torch.matmul(scores.softmax(-1), v_BHTD)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("asyncdbo_sim::grouped_swiglu", mutates_args=())
def grouped_swiglu(x: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` through its local expert's SwiGLU MLP."""
    y = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        rows = (ids == e).nonzero().squeeze(1)
        y[rows] = F.linear(F.silu(F.linear(x[rows], gate[e])) * F.linear(x[rows], up[e]), down[e])
    return y


@grouped_swiglu.register_fake
def _(x: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
