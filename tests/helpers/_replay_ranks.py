"""Rank worker for tests/docs/test_benchmark_replay.py: one recorded 2-ubatch run on a modeled link.

Each ubatch parks once on each kind of wait the replay must tie to its cause: a recv hook the
other ubatch runs, a comm work awaited directly, and a role-stream wait on the shared comm stream.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks' helpers

from _schedule_trace import ScheduleRecorder  # noqa: E402

import asyncdbo  # noqa: E402
from asyncdbo import (  # noqa: E402
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_submit,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)
from asyncdbo.backends.links import LinkSpec  # noqa: E402

#: Every message is held 50 ms, far longer than any step here: each await of a message parks.
LINK = LinkSpec(name="test-50ms", latency_s=0.05, bandwidth_Bps=1e9)


def _a2a(x_T: torch.Tensor, what: str) -> Any:
    out_T = torch.empty_like(x_T)
    work = dist.all_to_all_single(out_T, x_T, group=asyncdbo.ubatch_group(), async_op=True)
    return dbo_submit(work, nbytes=x_T.numel() * x_T.element_size(), what=what)


async def _program(ub: int, x_T: torch.Tensor) -> None:
    if ub == 0:
        received = dbo_register_recv_hook(lambda: None)  # held by ubatch 1, run in its first step
        await received  # parks: ubatch 1 has not run yet
    else:
        dbo_maybe_run_recv_hook()  # runs ubatch 0's hook: ubatch 0 wakes
        await dbo_yield("hook run")
    direct = _a2a(x_T, "direct")
    await dbo_yield("sent")
    await direct  # parks on the work's own signal
    await dbo_yield_and_switch_from_compute_to_comm("to comm")
    _a2a(x_T, "streamed")  # on the shared comm stream
    await dbo_yield_and_switch_from_comm_to_compute("comm done")  # parks on the stream's works


def recorded_run(rank: int, world_size: int) -> tuple[Any, list[tuple[int, str]]]:
    """The replay trace of one run, and each message's (ubatch, what)."""
    asyncdbo.ubatch_groups(2)  # collective: before the run, on every rank
    rec = ScheduleRecorder()

    async def main() -> None:
        dist.barrier()
        await asyncdbo.run_ubatches(_program, [(0, torch.ones(4)), (1, torch.ones(4))], backend=rec.backend(link=LINK),
                                    instrument=rec.instrument)

    asyncdbo.run(main)
    return rec.trace(), [(w.ub, w.what) for w in rec.run.ext.comm]
