"""Batch-invariant ops: a row's result does not depend on which other rows share the call.

Legend (shape suffixes): M rows of a call, K reduced (input) features, N output features,
I row tiles, Z rows per tile.

DBO computes every token in a smaller call than the serial step does (a ubatch instead of the
batch; an expert sees only the rows one ubatch routed to it), so a token's numbers are the serial
ones only if no op lets the *number* of rows change how a row is computed. On a CPU, measured with
torch 2.13 (MKL, AVX-512, 1 and 2 threads; ``benchmarks/deterministic.py`` reruns these probes,
``tests/test_batch_invariant.py`` keeps the ones the mode relies on):

* a float32 GEMM takes other code paths for very few rows (1 to 10 rows of a 256x256 GEMM give
  other bits than the same rows inside a 512-row call), while every call with the same number of
  rows (16 or 64 tested) gives a row the same bits whatever its place in the call and whatever
  the other rows hold, including each entry of a ``bmm`` over equal tiles;
* ``silu`` and ``sigmoid`` run vector lanes and the scalar remainder of an elementwise loop with
  different ``exp`` code, so an element's bits depend on its index in the call (48 to 54 of 116
  cuts differed); ``exp``, ``sin``, ``cos`` and ``rsqrt`` did not (0 of 116). In bfloat16
  ``rsqrt`` does too (the models' RMSNorms normalise in float32).

So in deterministic mode every GEMM is issued in tiles of a fixed number of rows (the last tile
zero-padded, all tiles in one ``bmm``), and ``silu``/``sigmoid`` are composed from ``exp``, ``+``
and ``/``, whose results do not depend on the lane. The cost is the padding (at most ``Z - 1``
rows per call, which small expert groups feel) and a batched instead of a single GEMM;
``benchmarks/deterministic.py`` measures it. Off the CPU these ops keep the same fixed shapes, which removes the row-count dependence of
cuBLAS's kernel choice, but asyncdbo has not measured them there (see ``docs/design.md``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ROW_TILE", "is_deterministic", "linear", "sigmoid", "silu", "swiglu"]

#: Rows per GEMM call, dense layers and experts alike. ``benchmarks/deterministic.py`` times one
#: forward of the demo's model per tile (16 to 128): 64 was fastest for a 512-request decode step
#: and as fast as any for a 512-token prefill; only small batches, whose experts get a few rows
#: each, prefer smaller tiles.
ROW_TILE = 64


def is_deterministic(flag: bool | None, x: torch.Tensor) -> bool:
    """Resolve a config's ``deterministic`` field for an input: None means on for CPU tensors."""
    return x.device.type == "cpu" if flag is None else flag


def _tiles(x_MK: torch.Tensor, tile: int) -> torch.Tensor:
    """``x`` as ``[I, tile, K]``, zero-padded to whole tiles (a view when nothing is padded)."""
    M, K = x_MK.shape
    I = -(-M // tile)
    if I * tile == M and x_MK.is_contiguous():
        return x_MK.view(I, tile, K)
    x_IZK = x_MK.new_zeros((I * tile, K))
    x_IZK[:M] = x_MK
    return x_IZK.view(I, tile, K)


def _bmm(x_IZK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    I, _, K = x_IZK.shape
    return torch.bmm(x_IZK, w_NK.t().expand(I, K, w_NK.shape[0]))


def linear(x_MK: torch.Tensor, w_NK: torch.Tensor, tile: int | None) -> torch.Tensor:
    """``F.linear(x, w)``; with ``tile`` every row goes through a GEMM of exactly ``tile`` rows."""
    if tile is None:
        return F.linear(x_MK, w_NK)
    M, N = x_MK.shape[0], w_NK.shape[0]
    if M == 0:
        return x_MK.new_empty((0, N))
    return _bmm(_tiles(x_MK, tile), w_NK).view(-1, N)[:M]


def silu(x: torch.Tensor, exact: bool) -> torch.Tensor:
    """``x * sigmoid(x)``; ``exact`` composes it from lane-independent ops (computed in float32
    and rounded once, as ``F.silu`` does for half types)."""
    if not exact:
        return F.silu(x)
    xf = x.float()
    return (xf / (1.0 + torch.exp(-xf))).to(x.dtype)


def sigmoid(x: torch.Tensor, exact: bool) -> torch.Tensor:
    """``1 / (1 + exp(-x))``; ``exact`` composes it from lane-independent ops."""
    if not exact:
        return x.sigmoid()
    xf = x.float()
    return (1.0 / (1.0 + torch.exp(-xf))).to(x.dtype)


def swiglu(
    x_MD: torch.Tensor,
    gate_FD: torch.Tensor,
    up_FD: torch.Tensor,
    down_DF: torch.Tensor,
    tile: int | None = None,
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``, the expert MLP of Mixtral and DeepSeek; with ``tile``,
    batch-invariant (fixed row tiles, lane-independent silu)."""
    if tile is None:
        return F.linear(F.silu(F.linear(x_MD, gate_FD)) * F.linear(x_MD, up_FD), down_DF)
    M, D = x_MD.shape[0], down_DF.shape[0]
    if M == 0:
        return x_MD.new_empty((0, D))
    x_IZD = _tiles(x_MD, tile)
    h_IZF = silu(_bmm(x_IZD, gate_FD), True) * _bmm(x_IZD, up_FD)
    return _bmm(h_IZF, down_DF).view(-1, D)[:M]
