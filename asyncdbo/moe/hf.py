"""Build an asyncdbo :class:`~asyncdbo.moe.MoELayer` from a Hugging Face transformers MoE block.

Legend (shape suffixes): E experts, D hidden, F expert intermediate, S shared-expert intermediate.

Supported blocks (transformers 5.x, experts stored as fused 3-D parameters ``gate_up_proj``
E x 2F x D, gate rows first, and ``down_proj`` E x D x F):

* Mixtral's ``MixtralSparseMoeBlock``: router logits in the block's dtype, softmax in float32,
  top-k, renormalised.
* Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``: Mixtral's rule with renormalisation only under
  ``norm_topk_prob``, and the top-k weights rounded to the logits' dtype.
* DeepSeek-V3's ``DeepseekV3MoE``: float32 logits and sigmoid scores, ``e_score_correction_bias``
  for selection only, group-limited top-k (``n_group``/``topk_group``), weights optionally
  renormalised and times ``routed_scaling_factor``, plus the shared-expert MLP.

The layer computes each rule the way the block does (``asyncdbo.moe.router``): in bf16 the same
tokens go to the same experts, exact ties included, and the combine adds expert outputs in the
block's order and dtype. ``tests/test_hf_interop.py`` checks fp32 and bf16, serial and DBO.

The layer takes the block's weights (copied, then sharded by EP rank), so the same block on every
rank gives an expert-parallel layer with the block's numbers. transformers is only imported to
recognise the classes; it is an optional extra (``pip install -e '.[hf]'`` in a clone).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import MoEConfig, Schedule
from .layer import MoELayer

__all__ = ["moe_from_hf"]


def _check_silu(config: Any, what: str) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{what} uses hidden_act={act!r}; asyncdbo's experts are SwiGLU (silu) only")


def _split_gate_up(experts: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj"):
        raise ValueError(
            f"{type(experts).__name__} has no fused gate_up_proj/down_proj parameters; moe_from_hf supports the "
            "transformers 5.x expert layout (E x 2F x D and E x D x F)"
        )
    if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        raise ValueError(f"{type(experts).__name__} stores its experts transposed or interleaved; not supported")
    gate_up_E2FD = experts.gate_up_proj.detach()
    Fi = gate_up_E2FD.shape[1] // 2
    return gate_up_E2FD[:, :Fi], gate_up_E2FD[:, Fi:], experts.down_proj.detach()


def moe_from_hf(
    hf_block: nn.Module,
    *,
    ep_group: Any = None,
    schedule: Schedule = "ht",
    max_ubatches: int = 4,
) -> MoELayer:
    """An EP-sharded :class:`MoELayer` with ``hf_block``'s weights and routing rule.

    Call it on every rank of ``ep_group`` with the same block (same weights), in the same order
    as the other layers: building the first layer of a group is collective."""
    kind = type(hf_block).__name__
    gate: Any
    experts: Any
    if kind == "MixtralSparseMoeBlock":
        gate, experts = hf_block.gate, hf_block.experts
        _check_silu(experts.config if hasattr(experts, "config") else None, kind)
        cfg = MoEConfig(
            hidden_size=gate.hidden_dim,
            intermediate_size=experts.intermediate_dim,
            num_experts=gate.num_experts,
            top_k=gate.top_k,
            scoring="softmax",
            norm_topk_prob=True,
            schedule=schedule,
        )
        bias_E = None
        shared = None
    elif kind == "Qwen3MoeSparseMoeBlock":
        gate, experts = hf_block.gate, hf_block.experts
        _check_silu(getattr(experts, "config", None), kind)
        cfg = MoEConfig(
            hidden_size=gate.hidden_dim,
            intermediate_size=experts.intermediate_dim,
            num_experts=gate.num_experts,
            top_k=gate.top_k,
            scoring="softmax",
            norm_topk_prob=bool(gate.norm_topk_prob),
            round_topk_weights=True,
            schedule=schedule,
        )
        bias_E = None
        shared = None
    elif kind == "DeepseekV3MoE":
        gate, experts = hf_block.gate, hf_block.experts
        _check_silu(hf_block.config, kind)
        c: Any = hf_block.config
        cfg = MoEConfig(
            hidden_size=gate.hidden_dim,
            intermediate_size=experts.intermediate_dim,
            num_experts=gate.num_experts,
            top_k=gate.top_k,
            scoring="sigmoid",
            norm_topk_prob=bool(gate.norm_topk_prob),
            n_group=gate.num_group,
            topk_group=gate.topk_group,
            routed_scaling_factor=float(gate.routed_scaling_factor),
            num_shared_experts=int(c.n_shared_experts),
            schedule=schedule,
        )
        bias_E = gate.e_score_correction_bias.detach()
        mlp: Any = hf_block.shared_experts
        shared = {
            "gate_proj": mlp.gate_proj.weight.detach(),
            "up_proj": mlp.up_proj.weight.detach(),
            "down_proj": mlp.down_proj.weight.detach(),
        }
    else:
        raise ValueError(
            f"moe_from_hf does not know {kind}; supported: MixtralSparseMoeBlock (transformers.models.mixtral), "
            "Qwen3MoeSparseMoeBlock (transformers.models.qwen3_moe) and DeepseekV3MoE (transformers.models.deepseek_v3)"
        )
    gate_EFD, up_EFD, down_EDF = _split_gate_up(experts)
    # The experts' dtype is the model's: DeepSeek-V3 keeps its router in float32 in a bf16 model.
    layer = MoELayer(cfg, ep_group=ep_group, dtype=gate_EFD.dtype, max_ubatches=max_ubatches)
    layer.load_global_weights(
        router_weight_ED=gate.weight.detach(),
        w_gate_EFD=gate_EFD,
        w_up_EFD=up_EFD,
        w_down_EDF=down_EDF,
        shared=shared,
        e_score_correction_bias_E=bias_E,
    )
    return layer
