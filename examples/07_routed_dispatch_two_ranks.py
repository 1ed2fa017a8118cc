"""Two ranks, routed: a dispatch and combine of variable sizes under DBO, bitwise equal to serial.

    python examples/07_routed_dispatch_two_ranks.py

This is the tutorial's section 8 (docs/tutorial.md) as a script: its code block is this file from
``P, L, D = ...`` to the end, and ``tests/docs/test_docs_examples.py`` checks that the two agree
and runs this file. Every token goes to the rank that holds its expert, so how many rows each rank
sends to each other rank changes from call to call: the ranks first exchange counts, then the
rows with ``all_to_all_single``'s split lists, and the combine sends them back with the lists
swapped. The counts go out before the ubatch yields, so they travel while the other ubatch
computes; the ubatch reads them on the CPU (``.tolist()``) only after awaiting them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import asyncdbo
from asyncdbo import (
    dbo_submit,
    dbo_switch_to_compute_sync,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    ubatch_group,
    ubatch_groups,
)
from asyncdbo.testing import run_ranks

P, L, D = 2, 2, 16  # ranks, experts per rank, hidden size
E = P * L  # experts in all: expert e lives on rank e // L


def all_to_all(out, inp, what, out_splits=None, in_splits=None):
    """all_to_all_single on the running ubatch's own group (split lists in rows); the handle."""
    work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=ubatch_group(), async_op=True)
    return dbo_submit(work, nbytes=inp.numel() * inp.element_size(), what=what)


async def moe(x_TD, expert_T, scale_ED):
    """Send each token to its expert's rank, apply the expert there, bring the rows back."""
    # Rows sorted by expert: each destination's rows are contiguous and grouped by its experts.
    order_T = torch.argsort(expert_T, stable=True)
    send_PL = torch.bincount(expert_T, minlength=E).view(P, L)  # rows for (rank, its local expert)
    recv_PL = torch.empty_like(send_PL)
    # 1. The counts go out first, before the yield: they travel while the other ubatch computes.
    counts = all_to_all(recv_PL, send_PL, "counts")
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    # 2. The split lists must be Python ints: wait for the counts (the host parks this ubatch and
    #    runs the other), and only then read them on the CPU.
    await counts
    send_P, recv_P = send_PL.sum(1).tolist(), recv_PL.sum(1).tolist()
    recv_RD = x_TD.new_empty(sum(recv_P), D)
    dispatched = all_to_all(recv_RD, x_TD[order_T], "dispatch", recv_P, send_P)
    await dbo_switch_to_compute_sync()  # host: parks until the rows arrived
    await dispatched
    # 3. The experts. From each sender the rows come grouped by local expert; recv_PL says how many.
    local_R = torch.arange(L).repeat(P).repeat_interleave(recv_PL.flatten())
    y_RD = recv_RD * scale_ED[dist.get_rank() * L + local_R]  # row by row: the split changes nothing
    await dbo_yield_and_switch_from_compute_to_comm("combine")
    # 4. The combine: the same all-to-all backwards, the split lists swapped.
    back_TD = torch.empty_like(x_TD)
    combined = all_to_all(back_TD, y_RD, "combine", send_P, recv_P)
    await dbo_yield_and_switch_from_comm_to_compute("combine_done")
    await combined
    out_TD = torch.empty_like(back_TD)
    out_TD[order_T] = back_TD  # back to token order
    return out_TD + x_TD


def on_rank(rank, world_size):
    ubatch_groups(2)  # a collective: once, on every rank, before the first run
    g = torch.Generator().manual_seed(rank)
    x_TD = torch.randn(24, D, generator=g)
    # Skewed routing: expert 0 gets the most tokens, so every split list is uneven.
    expert_T = torch.multinomial(torch.tensor([0.4, 0.3, 0.2, 0.1]), 24, replacement=True, generator=g)
    scale_ED = torch.randn(E, D, generator=torch.Generator().manual_seed(0))

    async def serial_and_dbo():
        serial_TD = await moe(x_TD, expert_T, scale_ED)  # outside a run: comm waits at once
        parts = [(x, e, scale_ED) for x, e in zip(x_TD.split([10, 14]), expert_T.split([10, 14]))]
        dbo_TD = torch.cat(await asyncdbo.run_ubatches(moe, parts, backend="host"))
        return serial_TD, dbo_TD

    serial_TD, dbo_TD = asyncdbo.run(serial_and_dbo)
    tokens_per_rank = torch.bincount(expert_T // L, minlength=P).tolist()
    return torch.equal(serial_TD, dbo_TD), tokens_per_rank


if __name__ == "__main__":
    for rank, (equal, sent) in enumerate(run_ranks(on_rank, 2, timeout_s=120)):
        print(f"rank {rank}: sent {sent} rows to ranks 0 and 1; DBO {'bitwise equal to' if equal else 'DIFFERS from'} serial")
        assert equal
