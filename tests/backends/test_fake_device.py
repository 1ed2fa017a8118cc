"""CUDA's stream rules on a CPU: the real AcceleratorBackend under asyncdbo.testing.fake_device.

First the fake itself (each rule it enforces fails a small wrong program and passes the right
one), then the bugs it found in the accelerator path, each pinned by the program that showed it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import asyncdbo
from asyncdbo import (
    dbo_switch_to_comm,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)
from asyncdbo.backends.accelerator import AcceleratorBackend
from asyncdbo.observe import Tracer
from asyncdbo.testing.fake_device import FakeDevice, StreamRuleError

from _device_scenarios import capture_forward, overlap_forward

pytestmark = pytest.mark.timeout(120)

POLICIES = ("role", "ubatch")
MS = 1_000_000  # torch.cuda._sleep cycles per virtual millisecond on the fake


def _problems(fn) -> list[str]:  # type: ignore[no-untyped-def]
    """Run ``fn(dev)`` under a fresh fake device; the problems it found (empty: none)."""
    try:
        with FakeDevice() as dev:
            fn(dev)
    except StreamRuleError as err:
        return err.problems
    return []


# ------------------------------------------------------------------------------- the fake itself
def test_a_race_between_streams_is_found_and_an_event_orders_it() -> None:
    def unordered(dev: FakeDevice) -> None:
        side = torch.cuda.Stream()
        x = torch.ones(4)  # written on the default stream
        with torch.cuda.stream(side):
            x.add(1)  # read on the side stream, nothing ordered it after the write

    def ordered(dev: FakeDevice) -> None:
        side = torch.cuda.Stream()
        x = torch.ones(4)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add(1)

    found = _problems(unordered)
    assert len(found) == 1 and found[0].startswith("race (read-after-write) on stream s"), found
    assert "after unordered write on stream default: aten.ones.default from outside ubatches" in found[0]
    assert _problems(ordered) == []


def test_index_ops_are_tracked_per_row_like_a_paged_kv_cache() -> None:
    """Two streams writing disjoint slots of one cache is no race; reading a slot another stream
    wrote, with no event between, is."""
    def slots(dev: FakeDevice, read_other: bool) -> None:
        cache = torch.zeros(8, 2)
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        a.wait_stream(torch.cuda.current_stream())
        b.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(a):
            cache.index_copy_(0, torch.tensor([0, 1]), torch.ones(2, 2))
        with torch.cuda.stream(b):
            cache.index_copy_(0, torch.tensor([2, 3]), torch.ones(2, 2))
            cache.index_select(0, torch.tensor([1 if read_other else 3]))

    assert _problems(lambda dev: slots(dev, read_other=False)) == []
    found = _problems(lambda dev: slots(dev, read_other=True))
    assert len(found) == 1 and found[0].startswith("race (read-after-write) on stream s"), found
    assert "aten.index_select.default from outside ubatches" in found[0]


def test_a_block_freed_while_another_stream_uses_it_is_found_unless_record_stream() -> None:
    def free(dev: FakeDevice, record: bool) -> None:
        side = torch.cuda.Stream()
        x = torch.ones(1024)  # allocated on the default stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.mul(2)  # used on the side stream
        if record:
            x.record_stream(side)
        del x  # back to the default stream's pool...
        torch.zeros(1024)  # ...whose next kernel may reuse it while the side stream still reads

    found = _problems(lambda dev: free(dev, record=False))
    assert len(found) == 1 and found[0].startswith("free while in use: a block allocated on default"), found
    assert _problems(lambda dev: free(dev, record=True)) == []


def test_capturable_mode_fails_every_host_sync() -> None:
    """Host syncs come from asyncdbo.syncs.HostSyncs (CPU tensors counted as device
    ones) and from the fake's own synchronize/query."""
    with pytest.raises(StreamRuleError) as err:
        with FakeDevice(capturable=True):
            x = torch.ones(2)
            float(x.sum())  # .item()
            x.nonzero()
            torch.cuda.synchronize()
    assert [p.split(" from ")[0] for p in err.value.problems] == [
        "host sync aten._local_scalar_dense (reads a value to the host)",
        "host sync aten.nonzero (output size depends on the data (the host reads a count))",
        "host sync torch.cuda.synchronize()",
    ]
    assert err.value.problems[0].endswith("test_fake_device.py:108 (not allowed while capturing a CUDA graph)")
    with FakeDevice() as dev:  # not capturable: listed, not failed
        torch.ones(2).tolist()
    assert [h.split(" from ")[0] for h in dev.host_syncs] == ["host sync Tensor.tolist (copies the tensor to the host)"]


def test_a_ubatch_kernel_on_another_stream_and_missing_joins_are_found() -> None:
    """A ubatch that makes another stream current itself (``torch.cuda.stream``) launches on a
    stream that is not its own; a side stream used without a fork and a join breaks the entry and
    exit rules."""
    async def forward(i: int) -> None:
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            torch.ones(2)
        await dbo_yield()

    def run(dev: FakeDevice) -> None:
        asyncdbo.run(lambda: run_ubatches(forward, [(0,), (1,)], backend=AcceleratorBackend("cuda")))

    found = _problems(run)
    assert [p.split(":")[0] for p in found] == ["wrong stream", "wrong stream"], found
    assert "aten.ones.default from ubatch 0 of 'dbo-run-" in found[0] and "not its own stream default" in found[0]


# ----------------------------------------------------------------------- the bugs the fake found
def _kernels(ms: float):  # type: ignore[no-untyped-def]
    return lambda: torch.cuda._sleep(int(ms * MS))


@pytest.mark.parametrize("policy", POLICIES)
def test_overlap_program_of_the_cuda_test_overlaps_comm_with_compute(policy: str) -> None:
    """The program tests/backends/test_cuda.py times on a GPU: ubatch 0's 20 ms comm and ubatch
    1's 20 ms compute must take max, not the sum. (As first written, ubatch 1 computed after its
    comm->compute switch: under role streams the shared compute stream then waited for ubatch 0's
    comm first, 40 ms against 40 ms serial, so the GPU test could never pass.)"""
    comm, compute = _kernels(20), _kernels(20)
    with FakeDevice() as dev:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        comm()
        compute()
        end.record()
        serial = start.elapsed_time(end)
        start.record()
        asyncdbo.run(lambda: run_ubatches(overlap_forward, [(0, comm, compute), (1, comm, compute)],
                                          backend=AcceleratorBackend("cuda"), stream_policy=policy))
        end.record()
        dbo = start.elapsed_time(end)
    assert (serial, dbo) == (40.0, 20.0)


async def _stage(x_T: torch.Tensor) -> torch.Tensor:
    y_T = x_T * 2
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    z_T = y_T + 1
    await dbo_yield_and_switch_from_comm_to_compute("combine")
    return z_T * 3


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_side_streams_wait_for_the_caller_at_entry_and_the_caller_waits_for_them_at_exit(policy: str, n: int) -> None:
    """The caller writes the inputs on its stream just before the run and reads the outputs just
    after: side streams must fork from it and join back (per-ubatch streams did neither: races on
    both sides), and the outputs' blocks, freed by the caller, must not be reused early."""
    with FakeDevice():
        backend = AcceleratorBackend("cuda")
        for _ in range(2):  # the second run reuses the first run's streams and freed blocks
            xs = [torch.full((8,), float(i)) for i in range(n)]
            outs = asyncdbo.run(lambda: run_ubatches(_stage, [(x,) for x in xs], backend=backend, stream_policy=policy))
            total = torch.stack(outs).sum()
            del outs, xs
        assert float(total) == sum((2 * i + 1) * 3 * 8 for i in range(n))


@pytest.mark.parametrize("policy", POLICIES)
def test_one_comm_stream_per_backend_not_one_per_run(policy: str) -> None:
    """Streams come from the backend and live as long as it does: a run makes none once the
    first made them, so a warmed-up run and a captured one use the same streams."""
    seen: list[dict[int, tuple[object, ...]]] = []

    async def forward(i: int) -> None:
        from asyncdbo.lowlevel import get_ubatch

        lane = get_ubatch().ext
        seen[-1][i] = (lane.streams["compute"], lane.streams["comm"])
        await dbo_yield()

    with FakeDevice() as dev:
        backend = AcceleratorBackend("cuda")
        for _ in range(3):
            seen.append({})
            asyncdbo.run(lambda: run_ubatches(forward, [(0,), (1,)], backend=backend, stream_policy=policy))
            made = len(dev.streams)
        assert seen[0] == seen[1] == seen[2]
        assert made == (2 if policy == "role" else 4)  # default + comm; default + ub1 compute + 2 comms
        assert asyncdbo.backends.get_backend("cuda") is asyncdbo.backends.get_backend("cuda")


async def _loop_wait_stage(x_T: torch.Tensor) -> torch.Tensor:
    # What the comm stream writes lives in blocks of the compute stream (allocated there before the
    # switch), as an all-to-all's receive buffers must: a block allocated on the comm stream and
    # freed after compute read it would go back to the comm stream's pool, where the other
    # ubatch's next transfer could take it before that read ran (the fake reports it).
    y_T, z_T = torch.empty_like(x_T), torch.empty_like(x_T)
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    torch.add(x_T, 1, out=y_T)  # comm stream
    await asyncio.sleep(0)  # every ubatch parks on the event loop: other tasks run here
    torch.mul(y_T, 2, out=z_T)  # still the comm stream
    await dbo_yield_and_switch_from_comm_to_compute("combine")
    return z_T - 1


@pytest.mark.parametrize("policy", POLICIES)
def test_two_runs_in_two_tasks_each_keep_their_own_streams_across_event_loop_waits(policy: str) -> None:
    """Invariant 6 on a device: two runs as asyncio tasks on one thread share its current stream.
    While a run waits on the loop the other installs its own streams (and a plain task its own),
    so each run must re-install its stream after every loop wait, leave the caller's stream
    current while it waits, and restore it at the end."""
    async def other_task(stream: object) -> None:
        torch.accelerator.set_stream(stream)  # a task that manages its own stream...
        torch.ones(3)
        await asyncio.sleep(0)
        torch.ones(3)
        torch.accelerator.set_stream(home)

    async def main() -> list[torch.Tensor]:
        be = AcceleratorBackend("cuda")
        mine = torch.cuda.Stream()
        mine.wait_stream(home)
        xs = [torch.full((4,), float(i)) for i in range(4)]
        a = run_ubatches(_loop_wait_stage, [(xs[0],), (xs[1],)], backend=be, stream_policy=policy)
        b = run_ubatches(_loop_wait_stage, [(xs[2],), (xs[3],)], backend=be, stream_policy=policy)
        ra, rb, _ = await asyncio.gather(a, b, other_task(mine))
        home.wait_stream(mine)
        return [*ra, *rb]

    after: list[object] = []

    def body(dev: FakeDevice) -> None:
        nonlocal home
        home = torch.cuda.current_stream()
        after.extend([asyncdbo.run(main), torch.cuda.current_stream() is home])

    home = None
    assert _problems(body) == []
    outs, restored = after
    assert restored, "the caller's stream is not current after the runs"
    assert [o.tolist() for o in outs] == [[(i + 1) * 2 - 1] * 4 for i in range(4)]


def test_a_task_that_runs_while_a_run_waits_on_the_loop_launches_on_the_callers_stream() -> None:
    """What another task launches while a run waits on the event loop goes to the thread's
    current stream: that must be the caller's, not the DBO comm stream the run was on."""
    async def bystander() -> torch.Tensor:
        await asyncio.sleep(0)
        return torch.ones(3) * 2  # a plain task: the caller's stream

    async def main() -> None:
        be = AcceleratorBackend("cuda")
        await asyncio.gather(run_ubatches(_loop_wait_stage, [(torch.zeros(2),)] * 2, backend=be), bystander())

    with FakeDevice():
        asyncdbo.run(main)


def test_device_spans_start_after_the_wait_queued_at_resume() -> None:
    """A compute span must not include the comm it waited for: one ubatch, 20 ms of comm, then
    5 ms of compute after the comm->compute switch hides nothing (the span used to start before
    the switch's wait, so the comm looked 100% hidden)."""
    async def forward() -> None:
        await dbo_yield_and_switch_from_compute_to_comm("dispatch")
        torch.cuda._sleep(20 * MS)
        await dbo_yield_and_switch_from_comm_to_compute("combine")
        torch.cuda._sleep(5 * MS)

    tracer = Tracer()
    with FakeDevice():
        asyncdbo.run(lambda: run_ubatches(forward, [()], backend=AcceleratorBackend("cuda"), instrument=tracer))
        numbers = tracer.numbers()
    assert (round(numbers.comm_s * 1e3, 6), round(numbers.compute_s * 1e3, 6)) == (20.0, 5.0)
    assert numbers.comm_hidden_s == 0.0 and numbers.comm_hidden_share == 0.0


def test_plain_switch_to_comm_still_forks_from_the_caller() -> None:
    """``dbo_switch_to_comm`` orders nothing by itself; the comm stream's fork at entry still
    puts its first kernel after what the caller queued before the run."""
    async def forward(x_T: torch.Tensor) -> torch.Tensor:
        await dbo_switch_to_comm()
        y_T = x_T + 1
        await dbo_yield_and_switch_from_comm_to_compute("back")
        return y_T

    with FakeDevice():
        xs = [torch.ones(2), torch.ones(2)]
        outs = asyncdbo.run(lambda: run_ubatches(forward, [(x,) for x in xs], backend=AcceleratorBackend("cuda")))
        assert torch.equal(outs[0] + outs[1], torch.full((2,), 4.0))


@pytest.mark.parametrize("policy", POLICIES)
def test_the_captured_program_of_the_cuda_test_keeps_cuda_rules_in_eager_mode(policy: str) -> None:
    """test_cuda.py warms its captured program up eagerly. As first written, under role streams
    it let comm-stream results (``h * 2``, ``h + 1``) be freed while the compute stream could
    still read them (and the other way round): 4 blocks freed while in use over two runs."""
    w = torch.randn(8, 8) / 4
    x_in = [torch.randn(4, 8) for _ in range(2)]
    outs = [torch.empty(4, 8) for _ in range(2)]
    with FakeDevice():
        be = AcceleratorBackend("cuda")
        for _ in range(2):  # the second run allocates where the first freed
            asyncdbo.run(lambda: run_ubatches(capture_forward, [(i, x_in, w, outs) for i in range(2)], backend=be,
                                              stream_policy=policy))
    for x, out in zip(x_in, outs):
        torch.testing.assert_close(out, (torch.relu(x @ w) * 2) @ w + 1)


def test_auto_is_the_host_here_the_fake_accelerator_under_it_and_the_host_again_after() -> None:
    """"auto", every run's default backend, follows what torch says the accelerator is."""
    from asyncdbo.backends import get_backend
    from asyncdbo.backends.accelerator import AcceleratorBackend
    from asyncdbo.backends.host import HostBackend

    assert type(get_backend("auto")) is HostBackend
    with FakeDevice():
        assert type(get_backend("auto")) is AcceleratorBackend
        assert type(get_backend(None)) is AcceleratorBackend
    assert type(get_backend("auto")) is HostBackend
