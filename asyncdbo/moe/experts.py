"""Expert MLPs (SwiGLU) and the deterministic global weights every EP rank derives from a seed.

Legend (shape suffixes): R rows received by this rank, D hidden, F expert intermediate,
L local experts, E experts, S shared-expert intermediate (num_shared_experts * F).

Each expert's weights come from its own generator seeded by ``(seed, expert)``, so a rank builds
only its own shard and still gets exactly the weights it would hold at any other EP size: the
same model, whatever the parallelism.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .batch_invariant import swiglu
from .config import MoEConfig

__all__ = ["router_init", "expert_init", "run_experts", "shared_init", "swiglu"]

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
