"""The tutorial's MoE (docs/tutorial.md, sections 1 and 4) ported to a layer ``asyncdbo check
--layer`` takes: a factory of the EP group whose object has ``async forward(x_TD)``. Every expert
runs on every token and the chosen one is picked by ``F.one_hot(expert_T, E)`` (no host sync on a
device: ``num_classes`` is given). ``ITEM_AFTER_ROUTER`` (set by the tests) adds an ``.item()``
after the router: a host sync between two yields."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from asyncdbo import dbo_submit, dbo_yield_and_switch_from_comm_to_compute, dbo_yield_and_switch_from_compute_to_comm
from asyncdbo import ubatch_group

D, E, H = 128, 4, 512  # hidden size, experts, expert hidden size
ITEM_AFTER_ROUTER = False


class TutorialMoE:
    hidden_size = D

    def __init__(self, group: object) -> None:
        g = torch.Generator().manual_seed(0)
        self.group = group
        self.w_router_DE = torch.randn(D, E, generator=g) / D**0.5
        self.w_up_EDH = torch.randn(E, D, H, generator=g) / D**0.5
        self.w_down_EHD = torch.randn(E, H, D, generator=g) / H**0.5

    def experts(self, x_TD: torch.Tensor, expert_T: torch.Tensor) -> torch.Tensor:
        h_ETH = torch.relu(torch.einsum("td,edh->eth", x_TD, self.w_up_EDH))
        y_ETD = torch.einsum("eth,ehd->etd", h_ETH, self.w_down_EHD)
        pick_TE = F.one_hot(expert_T, E).to(x_TD.dtype)
        return torch.einsum("etd,te->td", y_ETD, pick_TE)

    def all_to_all(self, x_TD: torch.Tensor, what: str) -> torch.Tensor:
        out_TD = torch.empty_like(x_TD)
        work = dist.all_to_all_single(out_TD, x_TD, group=ubatch_group(self.group), async_op=True)
        dbo_submit(work, nbytes=x_TD.numel() * x_TD.element_size(), what=what)
        return out_TD

    async def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        expert_T = (x_TD @ self.w_router_DE).argmax(dim=-1)
        if ITEM_AFTER_ROUTER:
            expert_T.max().item()  # the mutant: a host sync between two yields
        await dbo_yield_and_switch_from_compute_to_comm("dispatch")
        recv_TD = self.all_to_all(x_TD, "dispatch")
        await dbo_yield_and_switch_from_comm_to_compute("experts")
        y_TD = self.experts(recv_TD, expert_T)
        await dbo_yield_and_switch_from_compute_to_comm("combine")
        back_TD = self.all_to_all(y_TD, "combine")
        await dbo_yield_and_switch_from_comm_to_compute("residual")
        return x_TD + back_TD


def make_layer(group: object) -> TutorialMoE:
    return TutorialMoE(group)
