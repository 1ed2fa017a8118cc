"""Expert MLPs (SwiGLU) and the deterministic global weights every EP rank derives from a seed.

Legend (shape suffixes): R rows received by this rank, D hidden, F expert intermediate,
L local experts, E experts, S shared-expert intermediate (num_shared_experts * F), P source ranks,
C rows per source block, M rows per (source, expert) window.

Each expert's weights come from its own generator seeded by ``(seed, expert)``, so a rank builds
only its own shard and still gets exactly the weights it would hold at any other EP size: the
same model, whatever the parallelism.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .batch_invariant import swiglu
from .config import MoEConfig

__all__ = ["router_init", "expert_init", "run_experts", "run_experts_padded", "shared_init", "swiglu"]

_ROUTER_STREAM = 1 << 40
_SHARED_STREAM = 2 << 40


def _gen(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + stream) % (1 << 63))


def router_init(cfg: MoEConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(router_ED, bias_E)``: bias only for sigmoid scoring (DeepSeek's correction bias)."""
    g = _gen(seed, _ROUTER_STREAM)
    router_ED = torch.randn(cfg.num_experts, cfg.hidden_size, generator=g) * cfg.hidden_size**-0.5
    bias_E = torch.randn(cfg.num_experts, generator=g) * 0.05 if cfg.scoring == "sigmoid" else None
    return router_ED, bias_E


def expert_init(cfg: MoEConfig, seed: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(gate_FD, up_FD, down_DF)`` of one global expert."""
    g = _gen(seed, expert)
    D, Fi = cfg.hidden_size, cfg.intermediate_size
    gate_FD = torch.randn(Fi, D, generator=g) * D**-0.5
    up_FD = torch.randn(Fi, D, generator=g) * D**-0.5
    down_DF = torch.randn(D, Fi, generator=g) * Fi**-0.5
    return gate_FD, up_FD, down_DF


def shared_init(cfg: MoEConfig, seed: int) -> dict[str, torch.Tensor] | None:
    """Shared-expert weights in ``nn.Linear`` layout (``gate_proj`` S x D, ``up_proj`` S x D,
    ``down_proj`` D x S), or None without shared experts."""
    S = cfg.shared_intermediate_size
    if S == 0:
        return None
    g = _gen(seed, _SHARED_STREAM)
    D = cfg.hidden_size
    return {
        "gate_proj": torch.randn(S, D, generator=g) * D**-0.5,
        "up_proj": torch.randn(S, D, generator=g) * D**-0.5,
        "down_proj": torch.randn(D, S, generator=g) * S**-0.5,
    }


def run_experts(
    x_RD: torch.Tensor,
    local_ids_R: torch.Tensor,
    gate_LFD: torch.Tensor,
    up_LFD: torch.Tensor,
    down_LDF: torch.Tensor,
    tile: int | None = None,
    *,
    mlp: Callable[..., torch.Tensor] = swiglu,
) -> torch.Tensor:
    """Apply each row's local expert; rows of one expert go through one batched matmul (with
    ``tile``: GEMMs of exactly ``tile`` rows, so a row's result does not depend on how many rows
    its expert received, see :mod:`asyncdbo.moe.batch_invariant`). An expert that received no
    rows issues no GEMM. ``mlp`` is the expert function (:func:`swiglu`, or a compiled twin)."""
    y_RD = torch.empty_like(x_RD)
    if x_RD.shape[0] == 0:
        return y_RD
    for expert in torch.unique(local_ids_R).tolist():
        rows = (local_ids_R == expert).nonzero().squeeze(1)
        y_RD[rows] = mlp(x_RD[rows], gate_LFD[expert], up_LFD[expert], down_LDF[expert], tile)
    return y_RD


def run_experts_padded(
    x_PCD: torch.Tensor,
    recv_PL: torch.Tensor,
    window: int,
    gate_LFD: torch.Tensor,
    up_LFD: torch.Tensor,
    down_LDF: torch.Tensor,
    tile: int | None = None,
    *,
    mlp: Callable[..., torch.Tensor] = swiglu,
) -> torch.Tensor:
    """The experts over the sync-free layout (:mod:`asyncdbo.dist.ep`): block ``p`` of
    ``x_PCD`` holds source ``p``'s rows grouped by local expert, ``recv_PL`` (on the device) how
    many per expert. Each local expert reads a window of ``window`` rows per source (rows past its
    count are read but their outputs dropped), so no size depends on the data and the host never
    waits. Returns ``[P * C, D]``: each valid row's output in its place, the other rows undefined.

    The cost is the padding: ``L * P * window`` rows through the MLPs instead of the rows
    received. In deterministic mode (``tile``) a row's output does not depend on the other rows
    of its GEMM, so every valid row gets the bits :func:`run_experts` gives it."""
    P, C, D = x_PCD.shape
    L = recv_PL.shape[1]
    dev = x_PCD.device
    y_RD = x_PCD.new_empty((P * C + 1, D))  # the last row takes every padding row's output
    if P * C == 0 or window == 0:
        return y_RD[: P * C]
    # Every expert's window at once, [L, P, M]: the block row each window row reads, whether it
    # holds one of the expert's rows, and where its output goes (padding: the spare last row).
    start_PL = torch.cumsum(recv_PL, dim=1) - recv_PL  # where each expert's rows start in a block
    j_M = torch.arange(window, device=dev)
    valid_LPM = j_M < recv_PL.t()[:, :, None]
    c_LPM = torch.where(valid_LPM, start_PL.t()[:, :, None] + j_M, 0)  # a padding row reads row 0
    p_PM = torch.arange(P, device=dev)[:, None].expand(P, window)
    dst_LX = torch.where(valid_LPM, p_PM * C + c_LPM, P * C).reshape(L, P * window)  # broadcasting picks strides
    for expert in range(L):
        rows_XD = x_PCD[p_PM, c_LPM[expert]].reshape(P * window, D)  # index may pick its own strides
        y_RD[dst_LX[expert]] = mlp(rows_XD, gate_LFD[expert], up_LFD[expert], down_LDF[expert], tile)
    return y_RD[: P * C]
