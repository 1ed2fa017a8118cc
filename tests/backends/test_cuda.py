"""CUDA: real comm/compute overlap on two streams, and one CUDA graph of the interleaved forward.

Skipped without a CUDA device (CI has none); benchmarks/first_contact.py runs them on a GPU machine.
On a CPU the same programs run against the fake device (tests/backends/test_fake_device.py).
"""

from __future__ import annotations

import pytest
import torch

import asyncdbo
from asyncdbo import (
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)
from asyncdbo.lowlevel import get_ubatch

from _device_scenarios import capture_forward, overlap_forward

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _sleep_cycles_for(ms: float) -> int:
    """Clock cycles torch.cuda._sleep needs to spin for about ``ms`` milliseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return int(10_000_000 * ms / start.elapsed_time(end))


def test_comm_stream_work_overlaps_compute_stream_matmuls() -> None:
    """ub0 'communicates' (a 20 ms _sleep kernel on the comm stream) while ub1 runs ~20 ms of
    matmuls on the compute stream; with the streams running concurrently the step takes about
    max(comm, compute), not their sum. Timed with CUDA events on the device, not the host clock."""
    cycles = _sleep_cycles_for(20.0)
    a = torch.randn(2048, 2048, device="cuda")
    # calibrate how many matmuls take ~20 ms
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        a @ a
    e.record()
    torch.cuda.synchronize()
    n_mm = max(1, int(10 * 20.0 / s.elapsed_time(e)))

    def comm() -> None:
        torch.cuda._sleep(cycles)

    def compute() -> None:
        for _ in range(n_mm):
            a @ a

    async def forward(i: int) -> None:
        await overlap_forward(i, comm, compute)

    def timed(overlap: bool) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if overlap:
            asyncdbo.run(lambda: run_ubatches(forward, [(0,), (1,)], backend="cuda"))
        else:
            comm()
            compute()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    timed(True)  # warm-up
    serial = min(timed(False) for _ in range(3))
    dbo = min(timed(True) for _ in range(3))
    assert dbo < 0.8 * serial, f"no overlap: DBO {dbo:.1f} ms vs serial {serial:.1f} ms"


def test_whole_interleaved_forward_captures_in_one_cuda_graph_and_replays_equal() -> None:
    torch.manual_seed(0)
    w = torch.randn(256, 256, device="cuda") / 16
    x_in = [torch.randn(64, 256, device="cuda") for _ in range(2)]
    outs = [torch.empty(64, 256, device="cuda") for _ in range(2)]

    async def forward(i: int) -> None:
        await capture_forward(i, x_in, w, outs)
        assert get_ubatch().ext.stream is get_ubatch().ext.streams["compute"]

    def step() -> None:
        asyncdbo.run(lambda: run_ubatches(forward, [(0,), (1,)], backend="cuda"))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture (cuBLAS handles, allocator)
    torch.cuda.current_stream().wait_stream(side)
    eager = [o.clone() for o in outs]

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for o in outs:
        o.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, eager):
        torch.testing.assert_close(got, want)
    # new inputs flow through the captured interleaving
    for x in x_in:
        x.mul_(-1)
    graph.replay()
    torch.cuda.synchronize()
    ref = [(torch.relu(x @ w) * 2) @ w + 1 for x in x_in]
    for got, want in zip(outs, ref):
        torch.testing.assert_close(got, want)


def test_compute_role_comm_is_waited_only_where_the_schedule_says() -> None:
    """The ``ll`` contract on a device: a collective issued from the compute role is not waited for
    at issue (that would stall the shared compute stream until the rows arrive); its
    ``stream_wait()`` (what a recv hook runs) or ``await`` orders the then-current stream. One
    issued from the comm stream is waited for at once. A one-rank NCCL group keeps it on one GPU."""
    import torch.distributed as dist

    from asyncdbo.backends import DoneWork
    from asyncdbo.backends.accelerator import DeviceWork
    from asyncdbo.dbo import dbo_submit, dbo_switch_to_comm, dbo_switch_to_compute
    from asyncdbo.testing.ranks import free_port

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        seen: list[tuple[str, bool]] = []

        async def forward(i: int) -> torch.Tensor:
            x = torch.full((4,), float(i), device="cuda")
            out = torch.empty_like(x)
            handle = dbo_submit(dist.all_to_all_single(out, x, async_op=True), what="send")  # compute role
            seen.append((type(handle).__name__, handle.done()))
            await dbo_yield("send")
            handle.stream_wait()  # what the next ubatch's recv hook does
            seen.append((type(handle).__name__, handle.done()))
            await dbo_switch_to_comm()
            held = dbo_submit(dist.all_to_all_single(torch.empty_like(x), x, async_op=True), what="comm")
            seen.append((type(held).__name__, held.done()))
            await dbo_switch_to_compute()
            return out.clone()

        outs = asyncdbo.run(lambda: run_ubatches(forward, [(0,), (1,)], backend="cuda"))
        torch.cuda.synchronize()
        assert [o.tolist() for o in outs] == [[0.0] * 4, [1.0] * 4]
        assert seen[:2] == [(DeviceWork.__name__, False), (DeviceWork.__name__, False)]
        assert seen[2:4] == [(DeviceWork.__name__, True), (DoneWork.__name__, True)]
    finally:
        dist.destroy_process_group()
