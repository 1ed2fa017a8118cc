"""The sim's happens-before checker on hand-written schedules with known ordering bugs, and on the
library's own MoE schedules (which must pass clean).

Comm is a real ``all_to_all_single`` on torch's fake process group (two ranks, this process is
rank 0; with equal splits it hands rank 0 its own rows back), handed to the backend's ``submit``
as asyncdbo.dist.ep does. Shape legend: M rows of a ubatch, K in features, N out features.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import asyncdbo
from asyncdbo.dbo import (
    dbo_record_event,
    dbo_submit,
    dbo_switch_to_comm,
    dbo_switch_to_compute,
    dbo_wait_event,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)
from asyncdbo.lowlevel import get_ubatch
from asyncdbo.sim.counterfactual import measure_lost_overlap
from asyncdbo.sim import SimCheckError
from asyncdbo.sim.backend import SimBackend
from asyncdbo.sim.predict import Deployment, ModelShape, fake_ep_group, predict

pytestmark = pytest.mark.timeout(60)

W_KN = torch.randn(64, 128)
GROUP: list[Any] = []


@pytest.fixture(scope="module", autouse=True)
def ep_group() -> Iterator[Any]:
    with fake_ep_group(2) as g:
        GROUP.append(g)
        yield g
        GROUP.clear()


def a2a(out_MN: torch.Tensor, in_MN: torch.Tensor) -> Any:
    work = dist.all_to_all_single(out_MN, in_MN, group=GROUP[0], async_op=True)  # ALL-TO-ALL
    return dbo_submit(work, nbytes=in_MN.numel() * in_MN.element_size(), what="dispatch")


def line(marker: str) -> int:
    src = inspect.getsource(inspect.getmodule(line)).splitlines()  # type: ignore[arg-type]
    return next(i + 1 for i, s in enumerate(src) if s.rstrip().endswith(marker))


def place(fn: str, marker: str) -> str:
    return re.escape(f"tests/sim/test_sim_races.py:{line(marker)} in {fn}")


# ------------------------------------------------------------------------------------ schedules
async def correct(x_MK: torch.Tensor) -> torch.Tensor:
    h_MN = x_MK @ W_KN
    recv_MN = torch.empty_like(h_MN)
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    a2a(recv_MN, h_MN)
    await dbo_yield_and_switch_from_comm_to_compute("expert")
    return torch.relu(recv_MN)


async def early_read(x_MK: torch.Tensor) -> torch.Tensor:
    h_MN = x_MK @ W_KN
    recv_MN = torch.empty_like(h_MN)
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    a2a(recv_MN, h_MN)  # DISPATCH
    dbo_switch_to_compute()  # the bug: no wait for the dispatch
    return torch.relu(recv_MN)  # EARLY READ


async def record_after_yield(x_MK: torch.Tensor) -> torch.Tensor:
    """vLLM #38451: the compute done-event is recorded after the yield, so it also covers the
    other ubatch's compute queued meanwhile. Correct, but the ubatches serialize."""
    h_MN = x_MK @ W_KN
    recv_MN = torch.empty_like(h_MN)
    lane = get_ubatch().ext
    be = lane.ub.run.ext.backend
    await dbo_yield("dispatch")
    be.record(lane.events["compute"], lane.streams["compute"])  # LATE RECORD
    lane.role = "comm"
    lane.set_stream(lane.streams["comm"])
    be.wait(lane.stream, lane.events["compute"])  # WAIT ON LATE EVENT
    a2a(recv_MN, h_MN)
    await dbo_yield_and_switch_from_comm_to_compute("expert")
    return torch.relu(recv_MN)


SHARED_MN = torch.empty(32, 128)


async def cann_dispatch(x_MK: torch.Tensor, recv_MN: torch.Tensor | None) -> torch.Tensor:
    """Per-ubatch streams (CANN): compute and comm streams of this ubatch ordered by explicit
    events. ``recv_MN`` None receives into a fresh buffer; a shared one is the bug."""
    ub = get_ubatch().id
    h_MN = x_MK @ W_KN
    recv_MN = torch.empty_like(h_MN) if recv_MN is None else recv_MN
    dbo_record_event(("h", ub))
    await dbo_yield("dispatch")
    await dbo_switch_to_comm()
    await dbo_wait_event(("h", ub))
    a2a(recv_MN, h_MN)
    dbo_record_event(("recv", ub))
    await dbo_yield("expert")
    await dbo_switch_to_compute()
    await dbo_wait_event(("recv", ub))
    return torch.relu(recv_MN)  # READS THE RECEIVED ROWS


async def shared_recv_buffer(x_MK: torch.Tensor) -> torch.Tensor:
    """Both ubatches receive into one buffer: ubatch 1's dispatch overwrites it while ubatch 0's
    may still be landing, and ubatch 0 then reads ubatch 1's rows."""
    return await cann_dispatch(x_MK, SHARED_MN)


async def own_recv_buffer(x_MK: torch.Tensor) -> torch.Tensor:
    return await cann_dispatch(x_MK, None)


async def run(fn: Any, policy: str = "role") -> tuple[list[torch.Tensor], SimBackend]:
    x = torch.randn(64, 64)
    be = SimBackend(device="h100", link="ib400", on_problem="record")
    out = await asyncdbo.run_ubatches(fn, [(x[:32],), (x[32:],)], backend=be, stream_policy=policy)  # RUN
    return [torch.cat(out), torch.relu(x @ W_KN)], be


# ------------------------------------------------------------------------------------ tests
@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["role", "ubatch"])
async def test_a_correct_schedule_is_clean_and_equals_the_serial_run(policy: str) -> None:
    fn = correct if policy == "role" else own_recv_buffer
    (got, want), be = await run(fn, policy)
    assert torch.equal(got, want)
    rep = be.report
    assert (rep.races, rep.lost_overlaps, rep.dead_waits) == ([], [], [])


@pytest.mark.asyncio
async def test_a_missing_wait_after_dispatch_is_an_early_read_naming_both_accesses_and_the_missing_wait() -> None:
    _, be = await run(early_read)  # RUN EARLY READ
    (race,) = be.report.races
    assert race.kind == "read-after-write"
    here = "tests/sim/test_sim_races.py"
    assert str(race) == (
        "read-after-write race: aten::relu on stream compute reads a buffer c10d::alltoall_base_ on stream comm "
        "wrote, with no event between them\n"
        "    1. write by c10d::alltoall_base_: ubatch 0 after its yield 'dispatch', stream comm\n"
        f"        at {here}:{line('# ALL-TO-ALL')} in a2a\n"
        f"           {here}:{line('# DISPATCH')} in early_read\n"
        f"           {here}:{line('# RUN')} in run\n"
        "    2. read by aten::relu: ubatch 0 after its yield 'dispatch', stream compute\n"
        f"        at {here}:{line('# EARLY READ')} in early_read\n"
        f"           {here}:{line('# RUN')} in run\n"
        f"           {here}:{line('# RUN EARLY READ')} in "
        "test_a_missing_wait_after_dispatch_is_an_early_read_naming_both_accesses_and_the_missing_wait\n"
        f"    missing: no wait on stream comm between c10d::alltoall_base_ ({here}:{line('# ALL-TO-ALL')} in a2a) and "
        f"aten::relu ({here}:{line('# EARLY READ')} in early_read): record an event on comm after the write and make "
        "stream compute wait on it before the read"
    )
    with pytest.raises(SimCheckError, match=r"asyncdbo sim: 1 ordering problem\(s\):\n  1\. read-after-write race: aten::relu"):
        x = torch.randn(64, 64)
        await asyncdbo.run_ubatches(early_read, [(x[:32],), (x[32:],)], backend=SimBackend())


@pytest.mark.asyncio
async def test_an_event_recorded_after_the_yield_is_lost_overlap_not_a_race() -> None:
    (got, want), be = await run(record_after_yield)
    assert torch.equal(got, want)  # correct numbers: only the overlap is lost
    rep = be.report
    assert rep.races == [] and rep.dead_waits == []
    (lost,) = rep.lost_overlaps
    assert (lost.kind, lost.site.ubatch, lost.other.ubatch, lost.foreign_ubatch) == ("record-after-yield", 0, 0, 1)
    assert lost.cost_s is None  # a bare backend run: no counterfactual run measured it
    # measured: the same schedule again, the event carrying only ubatch 0's own work
    x = torch.randn(64, 64)

    async def again(be: SimBackend) -> None:
        await asyncdbo.run_ubatches(record_after_yield, [(x[:32],), (x[32:],)], backend=be)  # RUN

    costed, _ = await measure_lost_overlap(again, lambda **kw: SimBackend(device="h100", link="ib400", **kw))
    (lost,) = costed.lost_overlaps
    _, good = await run(correct)
    assert lost.cost_s is not None and lost.cost_s > 0
    assert lost.cost_s <= costed.makespan_s - good.report.makespan_s + 1e-12  # at most what the correct schedule saves
    here = "tests/sim/test_sim_races.py"
    assert re.fullmatch(
        r"lost overlap \(record-after-yield, costs [\d.]+ us of this run\): a wait on stream comm also waits for "
        r"ubatch 1's work\n"
        r"    wait event: ubatch 0 after its yield 'dispatch', stream comm\n"
        rf"        at {here}:{line('# WAIT ON LATE EVENT')} in record_after_yield\n"
        rf"           {here}:\d+ in again\n"
        rf"           {here}:\d+ in test_an_event_recorded_after_the_yield_is_lost_overlap_not_a_race\n"
        r"    after a yield: record event: ubatch 0 after its yield 'dispatch', stream compute\n"
        rf"        at {here}:{line('# LATE RECORD')} in record_after_yield\n"
        rf"           {here}:\d+ in again\n"
        rf"           {here}:\d+ in test_an_event_recorded_after_the_yield_is_lost_overlap_not_a_race\n"
        r"    the event covers work ubatch 1 queued on stream compute after ubatch 0's own, so the ubatches serialize: "
        r"record it before yielding",
        str(lost),
    ), str(lost)
    assert good.report.makespan_s < rep.makespan_s
    # asked to fail on lost overlap, the same run fails with it
    x = torch.randn(64, 64)
    with pytest.raises(SimCheckError, match=r"1 ordering problem\(s\):\n  1\. lost overlap \(record-after-yield"):
        await asyncdbo.run_ubatches(record_after_yield, [(x[:32],), (x[32:],)], backend=SimBackend(fail_on=["lost-overlap"]))


@pytest.mark.asyncio
async def test_a_buffer_reused_by_the_next_ubatch_before_the_comm_finished_is_a_race() -> None:
    (got, want), be = await run(shared_recv_buffer, "ubatch")
    assert not torch.equal(got, want)  # ubatch 0 computed on ubatch 1's rows
    kinds = [(r.kind, r.now.ubatch, r.before.ubatch) for r in be.report.races]
    assert kinds == [("write-after-write", 1, 0), ("read-after-write", 0, 1)]
    waw, raw = (str(r).splitlines() for r in be.report.races)
    assert waw[0] == ("write-after-write race: c10d::alltoall_base_ on stream ub1:comm writes a buffer "
                      "c10d::alltoall_base_ on stream ub0:comm wrote, with no event between them")
    assert waw[-1].startswith("    missing: no wait on stream ub0:comm between c10d::alltoall_base_")
    assert raw[0] == ("read-after-write race: aten::relu on stream ub0 reads a buffer c10d::alltoall_base_ on stream "
                      "ub1:comm wrote, with no event between them")
    assert f"tests/sim/test_sim_races.py:{line('# READS THE RECEIVED ROWS')} in cann_dispatch" in raw[-1]


@pytest.mark.parametrize("schedule", ["ht", "ll"])
@pytest.mark.parametrize("policy", ["role", "ubatch"])
def test_the_librarys_moe_schedules_are_race_free(schedule: str, policy: str) -> None:
    # One event loop is enough here: the sim never parks a ubatch on the loop.
    tiny = ModelShape(name="tiny", hidden=32, intermediate=32, experts=4, top_k=2, shared_experts=1, heads=2, kv_heads=1,
                      head_dim=16, v_head_dim=16, layers=2)
    for shape in ("decode", "prefill"):
        p = asyncdbo.run(
            functools.partial(predict, 8, model=tiny, shape=shape, context=8, stream_policy=policy,
                              deployment=Deployment(device="h100", link="ib400", ep=2, schedule=schedule)),
            loop="asyncio",
        )
        for rep in (p.serial, p.dbo):
            assert (rep.races, rep.dead_waits, rep.lost_overlaps) == ([], [], []), (shape, rep.problems, rep.lost_overlaps)
        assert p.dbo.num_ubatches == 2 and p.dbo.comm_busy_s > 0


async def ll_style(x_MK: torch.Tensor, early: bool) -> torch.Tensor:
    """The low-latency shape: send from the compute role, yield, then receive. The transfer runs in
    the background; awaiting its handle is what orders the reads after it."""
    h_MN = x_MK @ W_KN
    recv_MN = torch.empty_like(h_MN)
    received = a2a(recv_MN, h_MN)
    await dbo_yield("dispatch_send")
    if early:
        y_MN = torch.relu(recv_MN)  # LL EARLY READ
        await received
        return y_MN
    await received
    return torch.relu(recv_MN)


@pytest.mark.asyncio
@pytest.mark.parametrize("early", [False, True])
async def test_a_background_transfer_is_ordered_by_awaiting_its_handle(early: bool) -> None:
    x = torch.randn(64, 64)
    be = SimBackend(device="h100", link="ib400", on_problem="record")
    out = await asyncdbo.run_ubatches(ll_style, [(x[:32], early), (x[32:], early)], backend=be)
    assert torch.equal(torch.cat(out), torch.relu(x @ W_KN))  # the CPU copy is instant: only the sim sees the race
    rep = be.report
    comm = [s for s in rep.spans if s.kind == "comm"]
    assert [(s.ubatch, s.stream) for s in comm] == [(0, "compute:dispatch"), (1, "compute:dispatch")]
    ub1_mm = next(s for s in rep.spans if s.kind == "compute" and s.ubatch == 1)
    assert comm[0].start < ub1_mm.end  # ubatch 0's rows move while ubatch 1 computes
    if not early:
        assert rep.races == []
        return
    (race,) = rep.races
    lines = str(race).splitlines()
    assert lines[0] == ("read-after-write race: aten::relu on stream compute reads a buffer c10d::alltoall_base_ on "
                        "stream compute:dispatch wrote, with no event between them")
    assert lines[1] == "    1. write by c10d::alltoall_base_: ubatch 0 before its first yield, stream compute:dispatch"
    assert lines[-1].startswith("    missing: no wait on stream compute:dispatch between c10d::alltoall_base_ ")
    assert f"test_sim_races.py:{line('# LL EARLY READ')} in ll_style" in lines[-1]


async def ll_sends_after_its_yield(x_MK: torch.Tensor) -> torch.Tensor:
    """The send of a low-latency transfer issued after the yield: it leaves only once the other
    ubatch's compute queued meanwhile on the shared stream is done (asyncdbo 0.1's ll on the host)."""
    h_MN = x_MK @ W_KN
    recv_MN = torch.empty_like(h_MN)
    await dbo_yield("dispatch_send")
    received = a2a(recv_MN, h_MN)  # SEND AFTER YIELD
    await received
    return torch.relu(recv_MN)


@pytest.mark.asyncio
async def test_a_send_issued_after_the_yield_is_lost_overlap() -> None:
    (got, want), be = await run(ll_sends_after_its_yield)
    assert torch.equal(got, want)
    rep = be.report
    assert rep.races == []
    # each ubatch's send follows work the other queued on the shared stream after its own
    # reported once per place (like races), by the first ubatch that sent late
    assert [(lo.kind, lo.site.ubatch, lo.foreign_ubatch) for lo in rep.lost_overlaps] == [("send-after-yield", 0, 1)]
    assert str(rep.lost_overlaps[0]).splitlines()[1:3] == [
        "    send c10d::alltoall_base_: ubatch 0 after its yield 'dispatch_send', stream compute",
        f"        at tests/sim/test_sim_races.py:{line('# ALL-TO-ALL')} in a2a",
    ]
