"""Two ranks, two ubatches each: an all-to-all dispatch and combine under DBO, every ubatch on its
own clone of the process group, and the result equal to the serial run.

    python examples/06_two_ranks_own_groups.py

This is the tutorial's two-rank chapter (docs/tutorial.md, section 7) as a script. Each rank sends
an equal block of rows to every rank (the dispatch), the receiver transforms them (the experts),
and sends them back (the combine). Under DBO, ubatch 0's all-to-all is in flight while ubatch 1
computes; a ubatch parked on its comm is skipped, so the two ranks may issue the two ubatches'
collectives in different orders. Collectives on one process group are matched by issue order, so
each ubatch issues on its own clone: ``ubatch_groups(2)`` makes them once, before the first run, on
every rank; ``ubatch_group()`` picks the running ubatch's (outside a run: the group itself).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import asyncdbo
from asyncdbo import (
    dbo_submit,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    ubatch_group,
    ubatch_groups,
)
from asyncdbo.testing import run_ranks

ROWS, D = 16, 32  # rows per rank (a multiple of 2 ubatches x 2 ranks)


def all_to_all(x_TD: torch.Tensor, what: str) -> tuple[torch.Tensor, object]:
    """Equal row blocks to every rank, on the running ubatch's own group; the handle to await."""
    out_TD = torch.empty_like(x_TD)
    work = dist.all_to_all_single(out_TD, x_TD, group=ubatch_group(), async_op=True)
    return out_TD, dbo_submit(work, nbytes=x_TD.numel() * x_TD.element_size(), what=what)


async def layer(x_TD: torch.Tensor, w_DD: torch.Tensor) -> torch.Tensor:
    h_TD = torch.tanh(x_TD @ w_DD)  # attention stand-in
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    recv_TD, _ = all_to_all(h_TD, "dispatch")
    await dbo_yield_and_switch_from_comm_to_compute("experts")  # host: parks until the rows arrived
    y_TD = recv_TD * 2.0 + 1.0  # experts stand-in: row by row, so the split does not change it
    await dbo_yield_and_switch_from_compute_to_comm("combine")
    back_TD, _ = all_to_all(y_TD, "combine")
    await dbo_yield_and_switch_from_comm_to_compute("done")
    return back_TD + x_TD


def on_rank(rank: int, world_size: int) -> tuple[bool, float]:
    ubatch_groups(2)  # a collective: once, on every rank, before the first run
    g = torch.Generator().manual_seed(rank)
    x_TD = torch.randn(ROWS, D, generator=g)
    w_DD = torch.randn(D, D, generator=torch.Generator().manual_seed(0))

    async def serial_and_dbo() -> tuple[torch.Tensor, torch.Tensor]:
        serial_TD = await layer(x_TD, w_DD)  # no run: the primitives are no-ops, comm waits at once
        halves = [(part, w_DD) for part in x_TD.split(ROWS // 2)]
        dbo_TD = torch.cat(await asyncdbo.run_ubatches(layer, halves, backend="host"))
        return serial_TD, dbo_TD

    serial_TD, dbo_TD = asyncdbo.run(serial_and_dbo)
    return torch.equal(serial_TD, dbo_TD), (serial_TD - dbo_TD).abs().max().item()


if __name__ == "__main__":
    for rank, (same, diff) in enumerate(run_ranks(on_rank, 2, timeout_s=120)):
        print(f"rank {rank}: DBO {'equals' if same else 'differs from'} serial (max |diff| = {diff:.3g})")
        assert diff <= 1e-6, diff
