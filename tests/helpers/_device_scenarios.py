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
    """Ubatch 0 communicates while ubatch 1 computes; with the streams concurrent the step takes
    about max(comm, compute), not their sum."""
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    if i == 0:
        comm()  # on the comm stream (installed by the primitive)
    await dbo_yield_and_switch_from_comm_to_compute("experts")
    if i == 1:
        compute()
