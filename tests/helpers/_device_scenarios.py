"""DBO programs that run unchanged on a real GPU (tests/backends/test_cuda.py, the first-contact
script) and on the fake device (tests/backends/test_fake_device.py), so what the fake settles on
a CPU is the very program the GPU runs.

``comm()`` and ``compute()`` queue one stage's work on the current stream: on a GPU a
``torch.cuda._sleep`` standing in for an all-to-all and a run of matmuls; on the fake, kernels of
a given virtual length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncdbo import (
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)


async def overlap_forward(i: int, comm: Callable[[], None], compute: Callable[[], None]) -> None:
    """Ubatch 1 computes while ubatch 0 communicates; with the streams concurrent the step takes
    about max(comm, compute), not their sum.

    Ubatch 1 queues its compute *before* its first switch, as DBO's schedules do (the next
    ubatch's compute overlaps this one's comm). Queued after its comm->compute switch, it would
    wait on the shared compute stream behind ubatch 0's comm->compute wait (and its own comm
    event, recorded behind ubatch 0's comm on the shared comm stream): the sum, every time."""
    if i == 1:
        compute()  # on the compute stream, concurrent with ubatch 0's comm below
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    if i == 0:
        comm()  # on the comm stream (installed by the primitive)
    await dbo_yield_and_switch_from_comm_to_compute("experts")


async def capture_forward(i: int, x_in: list[torch.Tensor], w: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """The interleaved forward test_cuda.py captures in one CUDA graph. What the comm stream
    writes lives in blocks allocated on the compute stream before the switch (``m``, ``c``), and
    what it reads stays referenced until compute has waited for it: a block allocated on one
    stream and freed while the other may still use it goes back to its stream's pool, where the
    other ubatch's next allocation could take it (the fake device reports it; in eager mode)."""
    h = torch.relu(x_in[i] @ w)
    m = torch.empty_like(h)
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    torch.mul(h, 2, out=m)  # stands in for comm work on the comm stream
    await dbo_switch_to_compute_sync()
    h2 = m @ w
    c = torch.empty_like(h2)
    await dbo_yield("combine")
    await dbo_yield_and_switch_from_compute_to_comm("combine")
    torch.add(h2, 1, out=c)
    await dbo_yield_and_switch_from_comm_to_compute("done")  # comm rejoins compute before capture ends
    outs[i].copy_(c)
