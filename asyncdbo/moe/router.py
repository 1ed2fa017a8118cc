"""Top-k routing: Mixtral's softmax rule and DeepSeek-V3's sigmoid, group-limited rule.

Legend (shape suffixes): T tokens, D hidden, E experts, K top-k, G expert groups (n_group).

Routing is pure per-token math (no comm, no yields). Each rule computes its scores the way its
reference model does, because in bf16 the dtype of the logits decides ties:

* Mixtral (``softmax``): logits in the activations' dtype (the gate is a Linear of the model's
  dtype), softmax in float32, ``topk`` on the probabilities. Computing the logits in float32
  instead sends the tokens whose bf16 logits tie to other experts.
* Qwen3-MoE (``softmax`` with ``round_topk_weights``): Mixtral's rule, then the chosen weights
  rounded to the logits' dtype (``router_top_value.to(router_logits.dtype)``); they are kept as
  float32 holding bf16 values, so the combine's float32 product is the bf16 product exactly
  (two bf16 mantissas multiply exactly in float32, one rounding either way).
* DeepSeek-V3 (``sigmoid``): logits and sigmoid in float32 (its gate weight and correction bias
  stay float32 in a bf16 model), the bias added for the choice only.

The renormalisation adds 1e-20 to the sum (DeepSeek-V3's guard); Mixtral and Qwen3-MoE add
nothing, which gives the same bits: the top-k probabilities of a softmax sum to at least
``top_k / num_experts``, whose float32 ulp is far above 1e-20.

With ``deterministic`` the logits GEMM runs in fixed row tiles and the sigmoid is composed from
lane-independent ops (:mod:`asyncdbo.moe.batch_invariant`), so a token gets the same experts and
weights whether it is routed alone, in a ubatch or in the whole batch.
"""

from __future__ import annotations

import torch

from .batch_invariant import ROW_TILE, linear, sigmoid
from .config import MoEConfig

__all__ = ["route"]


def route(
    x_TD: torch.Tensor,
    router_ED: torch.Tensor,
    cfg: MoEConfig,
    *,
    bias_E: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(topk_w_TK, topk_ids_TK)``: float32 weights (holding values of the logits' dtype
    with ``cfg.round_topk_weights``) and int64 expert ids per token.

    ``bias_E`` (DeepSeek's ``e_score_correction_bias``) shifts the scores used to *choose*
    experts only; the weights come from the unshifted scores."""
    tile = ROW_TILE if deterministic else None
    if cfg.scoring == "softmax":
        logits_TE = linear(x_TD, router_ED.to(x_TD.dtype), tile)
        scores_TE = torch.softmax(logits_TE.float(), dim=-1)
    else:
        logits_TE = linear(x_TD.float(), router_ED.float(), tile)
        scores_TE = sigmoid(logits_TE, deterministic)
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()
    if cfg.n_group > 1:
        T, E, G = x_TD.shape[0], cfg.num_experts, cfg.n_group
        group_TG = choice_TE.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        keep_TG = torch.zeros_like(group_TG)
        keep_TG.scatter_(1, torch.topk(group_TG, k=cfg.topk_group, dim=-1, sorted=False)[1], 1)
        keep_TE = keep_TG.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
        choice_TE = choice_TE.masked_fill(~keep_TE.bool(), float("-inf"))
    # Ties go where the reference's own topk call sends them: sorted for Mixtral, unsorted for
    # DeepSeek-V3 (the order of the K choices does not matter: the combine adds in expert order).
    topk_ids_TK = torch.topk(choice_TE, k=cfg.top_k, dim=-1, sorted=cfg.scoring == "softmax")[1]
    topk_w_TK = scores_TE.gather(1, topk_ids_TK)
    if cfg.norm_topk_prob:
        topk_w_TK = topk_w_TK / (topk_w_TK.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        topk_w_TK = topk_w_TK * cfg.routed_scaling_factor
    if cfg.round_topk_weights:
        topk_w_TK = topk_w_TK.to(logits_TE.dtype).float()
    return topk_w_TK, topk_ids_TK
