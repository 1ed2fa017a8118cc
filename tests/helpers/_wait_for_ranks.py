"""Rank worker for tests/dbo/test_wait_for_comm.py: ``asyncio.wait_for`` around a real gloo
all-to-all's handle and around the role switch that waits on it, inside a 2-ubatch run."""

from __future__ import annotations

import asyncio

import torch
import torch.distributed as dist

import asyncdbo
from asyncdbo import dbo_submit, dbo_yield, dbo_yield_and_switch_from_comm_to_compute, dbo_yield_and_switch_from_compute_to_comm


def wait_for_comm(rank: int, world_size: int) -> list[list[float]]:
    """Each ubatch sends ``[rank, ub]`` to every rank twice: awaited through its handle, then
    through the role switch back to compute; ubatch 0 wraps both awaits in ``wait_for``, ubatch 1
    awaits them directly. Returns what each ubatch received, both times."""
    asyncdbo.ubatch_groups(2)  # collective: before the run, on every rank

    async def forward(ub: int) -> list[float]:
        async def wait(x: object) -> None:
            await (asyncio.wait_for(x, 30) if ub == 0 else x)  # type: ignore[arg-type]

        x_W = torch.tensor([float(rank * 10 + ub)] * world_size)
        first_W = torch.empty(world_size)
        handle = dbo_submit(dist.all_to_all_single(first_W, x_W, group=asyncdbo.ubatch_group(), async_op=True),
                            nbytes=4 * world_size, what="direct")
        await dbo_yield("sent")
        await wait(handle)
        await wait(dbo_yield_and_switch_from_compute_to_comm("to comm"))
        second_W = torch.empty(world_size)
        dbo_submit(dist.all_to_all_single(second_W, x_W + 100, group=asyncdbo.ubatch_group(), async_op=True),
                   nbytes=4 * world_size, what="streamed")  # on the comm stream: the switch back waits for it
        await wait(dbo_yield_and_switch_from_comm_to_compute("comm done"))
        return first_W.tolist() + second_W.tolist()

    async def main() -> list[list[float]]:
        return await asyncdbo.run_ubatches(forward, [(0,), (1,)], backend="host")

    return asyncdbo.run(main)
