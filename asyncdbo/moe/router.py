"""Top-k routing: Mixtral's softmax rule and DeepSeek-V3's sigmoid, group-limited rule.

Legend (shape suffixes): T tokens, D hidden, E experts, K top-k, G expert groups (n_group).

Routing is pure per-token math (no comm, no yields), so a token gets the same experts and
weights whether it is routed alone, in a ubatch slice or in the whole batch. Scores are computed
in float32 whatever the activation dtype, as both reference implementations do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MoEConfig

__all__ = ["route"]


def route(
    x_TD: torch.Tensor,
    router_ED: torch.Tensor,
    cfg: MoEConfig,
    *,
    bias_E: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(topk_w_TK, topk_ids_TK)``: float32 weights and int64 expert ids per token.

    ``bias_E`` (DeepSeek's ``e_score_correction_bias``) shifts the scores used to *choose*
    experts only; the weights come from the unshifted scores."""
    logits_TE = F.linear(x_TD.float(), router_ED.float())
    if cfg.scoring == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = logits_TE.sigmoid()
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()
    if cfg.n_group > 1:
        T, E, G = x_TD.shape[0], cfg.num_experts, cfg.n_group
        group_TG = choice_TE.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        keep_TG = torch.zeros_like(group_TG)
        keep_TG.scatter_(1, torch.topk(group_TG, k=cfg.topk_group, dim=-1, sorted=False)[1], 1)
        keep_TE = keep_TG.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
        choice_TE = choice_TE.masked_fill(~keep_TE.bool(), float("-inf"))
    topk_ids_TK = torch.topk(choice_TE, k=cfg.top_k, dim=-1)[1]
    topk_w_TK = scores_TE.gather(1, topk_ids_TK)
    if cfg.norm_topk_prob:
        topk_w_TK = topk_w_TK / (topk_w_TK.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        topk_w_TK = topk_w_TK * cfg.routed_scaling_factor
    return topk_w_TK, topk_ids_TK
