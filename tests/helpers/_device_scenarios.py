"""DBO programs that run unchanged on a real GPU (tests/backends/test_cuda.py, the first-contact
script) and on the fake device (tests/backends/test_fake_device.py), so what the fake settles on
a CPU is the very program the GPU runs.

``comm()`` and ``compute()`` queue one stage's work on the current stream: on a GPU a
``torch.cuda._sleep`` standing in for an all-to-all and a run of matmuls; on the fake, kernels of
a given virtual length.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncdbo import dbo_yield_and_switch_from_comm_to_compute, dbo_yield_and_switch_from_compute_to_comm


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
