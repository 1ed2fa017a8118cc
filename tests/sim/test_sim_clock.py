"""The simulated device's clock, cost model and dead-wait report.

Hand-written schedules (matmuls + a modeled transfer through ``submit``) run on the sim backend;
the expected timelines are computed from the same cost model and link spec, so each test states
exactly when each op starts and ends on the virtual clock.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import asyncdbo
from asyncdbo.backends import get_backend, link_spec
from asyncdbo.dbo import (
    dbo_submit,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)
from asyncdbo.lowlevel import get_ubatch
from asyncdbo.sim import CostModel, SimCheckError, device_spec
from asyncdbo.sim.backend import SimBackend
from asyncdbo.sim.clock import Engine

DEV = device_spec("h100")
LINK = link_spec("ib400")
COST = CostModel(DEV)
W_KN = torch.randn(256, 512)


def mm_time(m: int, k: int, n: int) -> float:
    x, w = torch.empty(m, k, device="meta"), torch.empty(k, n, device="meta")  # shapes are all it needs
    return COST.op_cost(torch.ops.aten.mm.default, (x, w), {}, x @ w).seconds


# ------------------------------------------------------------------------------------ cost model
def test_gemm_time_scales_with_flops_above_the_tile() -> None:
    t1, t2 = mm_time(4096, 4096, 4096), mm_time(8192, 4096, 4096)
    assert t2 / t1 == pytest.approx(2.0, rel=0.01)


def test_half_size_gemm_below_the_tile_is_less_than_twice_as_fast() -> None:
    assert DEV.min_tile == 64
    full, half = mm_time(64, 7168, 2048), mm_time(32, 7168, 2048)
    assert half < full < 2 * half  # both pay a whole 64-row tile and read the same weights


def test_flops_are_torchs_own_count_times_tile_waste() -> None:
    x, w = torch.randn(128, 300), torch.randn(300, 640)
    with FlopCounterMode(display=False) as fc:
        out = x @ w
    cost = COST.op_cost(torch.ops.aten.mm.default, (x, w), {}, out)
    assert cost.flops == fc.get_total_flops()  # 128 and 640 are whole 64-tiles: no waste
    assert cost.nbytes == (128 * 300 + 300 * 640 + 128 * 640) * 2  # BF16 on the modeled device
    y = torch.randn(16, 300)
    padded = COST.op_cost(torch.ops.aten.mm.default, (y, w), {}, y @ w)
    assert padded.flops == 2 * 64 * 300 * 640


def test_views_cost_nothing() -> None:
    x = torch.randn(8, 8)
    assert COST.op_cost(torch.ops.aten.view.default, (x, [64]), {}, x.view(64)).seconds == 0.0
    assert COST.op_cost(torch.ops.aten.t.default, (x,), {}, x.t()).seconds == 0.0


def test_specs_are_overridable_and_reject_bad_values() -> None:
    assert device_spec("h200", hbm_Bps=5e12).hbm_Bps == 5e12
    assert device_spec("ascend910b").peak_flops == 313e12
    with pytest.raises(ValueError, match=r"unknown device 'mi300x'; choose one of "
                                         r"\['ascend910b', 'b200', 'h100', 'h20', 'h200'\] or pass a DeviceSpec"):
        device_spec("mi300x")
    with pytest.raises(ValueError, match=r"unknown DeviceSpec field\(s\) \['tflops'\]"):
        device_spec("h100", tflops=1.0)
    with pytest.raises(ValueError, match=r"gemm_efficiency must be in \(0, 1\] \(got 1.5\)"):
        device_spec("h100", gemm_efficiency=1.5)
    with pytest.raises(ValueError, match=r"on_problem must be 'raise' or 'record' \(got 'warn'\)"):
        SimBackend(on_problem="warn")


def test_get_backend_builds_the_sim_by_name() -> None:
    be = get_backend("sim", device="h100", link="nvlink", check_races=False)
    assert isinstance(be, SimBackend) and be.describe() == "sim (h100, nvlink)"


# ------------------------------------------------------------------------------------ engines
def test_engine_fills_idle_gaps_in_order_of_readiness() -> None:
    e = Engine("compute")
    assert e.reserve(0.0, 2.0) == 0.0
    assert e.reserve(5.0, 1.0) == 5.0
    assert e.reserve(1.0, 2.0) == 2.0  # fits between 2 and 5
    assert e.reserve(1.0, 2.0) == 6.0  # the 4..5 gap is too small
    assert e.busy_s == 7.0


# ------------------------------------------------------------------------------------ schedules
async def dispatch_layer(x_MK: torch.Tensor) -> torch.Tensor:
    """vLLM's order: compute, yield to comm, a modeled dispatch, yield back to compute, compute."""
    h_MN = x_MK @ W_KN
    recv_MN = torch.empty_like(h_MN)
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    recv_MN.copy_(h_MN)  # the data a real all-to-all would deliver
    dbo_submit(None, nbytes=h_MN.numel() * 2, what="dispatch", outputs=[recv_MN], inputs=[h_MN])
    await dbo_yield_and_switch_from_comm_to_compute("expert")
    return torch.relu(recv_MN)


@pytest.mark.asyncio
async def test_role_streams_overlap_one_ubatchs_comm_with_the_others_compute() -> None:
    x = torch.randn(256, 256)
    be = SimBackend(device=DEV, link=LINK)
    out = await asyncdbo.run_ubatches(dispatch_layer, [(x[:128],), (x[128:],)], backend=be)
    assert torch.equal(torch.cat(out), torch.relu(x @ W_KN))
    mm = mm_time(128, 256, 512)
    dst = torch.empty(128, 512)
    copy = COST.op_cost(torch.ops.aten.copy_.default, (dst, torch.empty(128, 512)), {}, dst).seconds
    relu = COST.op_cost(torch.ops.aten.relu.default, (torch.empty(128, 512),), {}, torch.empty(128, 512)).seconds
    wire = 128 * 512 * 2 / LINK.bandwidth_Bps
    rep = be.report
    got = [(s.stream, s.kind, s.ubatch, s.tag, s.start, s.end) for s in rep.spans]
    d0 = mm + copy  # ub0's dispatch leaves once its copy is done (the copy runs on comm SMs)
    want = [
        ("compute", "compute", 0, None, 0.0, mm),
        ("compute", "compute", 1, None, mm, 2 * mm),
        ("comm", "compute", 0, "dispatch", mm, mm + copy),
        ("comm", "comm", 0, "dispatch", d0, d0 + wire + LINK.latency_s),
        ("comm", "compute", 1, "dispatch", max(2 * mm, d0 + wire + LINK.latency_s), None),
    ]
    for g, w in zip(got, want):
        assert g[:4] == w[:4]
        assert g[4] == pytest.approx(w[4])
        if w[5] is not None:
            assert g[5] == pytest.approx(w[5])
    assert rep.makespan_s == pytest.approx(got[-1][5])
    assert got[-1][:4] == ("compute", "compute", 1, "expert") and got[-1][5] - got[-1][4] == pytest.approx(relu)
    assert rep.compute_busy_s == pytest.approx(2 * mm + 2 * relu)
    assert 0.0 < rep.hidden_comm_share < 1.0
    assert rep.races == [] and rep.lost_overlaps == [] and rep.dead_waits == []


@pytest.mark.asyncio
async def test_serial_run_is_the_sum_of_its_ops() -> None:
    x = torch.randn(256, 256)
    be = SimBackend(device=DEV, link=LINK)
    await asyncdbo.run_ubatches(dispatch_layer, [(x,)], backend=be)
    mm = mm_time(256, 256, 512)
    dst = torch.empty(256, 512)
    copy = COST.op_cost(torch.ops.aten.copy_.default, (dst, torch.empty(256, 512)), {}, dst).seconds
    relu = COST.op_cost(torch.ops.aten.relu.default, (torch.empty(256, 512),), {}, torch.empty(256, 512)).seconds
    assert be.report.makespan_s == pytest.approx(mm + copy + LINK.transfer_s(256 * 512 * 2) + relu)
    assert be.report.hidden_comm_share == 0.0


# ------------------------------------------------------------------------------------ dead waits
async def waits_on_an_unrecorded_done_event(x_MK: torch.Tensor) -> torch.Tensor:
    """A hand-rolled switch that forgot to record the compute done-event before yielding."""
    h_MN = x_MK @ W_KN
    lane = get_ubatch().ext
    await dbo_yield("dispatch")
    lane.role = "comm"
    lane.set_stream(lane.streams["comm"])
    lane.ub.run.ext.backend.wait(lane.stream, lane.events["compute"])  # DEAD WAIT
    return h_MN


def _line(marker: str) -> int:
    import inspect

    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()  # type: ignore[arg-type]
    return next(i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(marker))


@pytest.mark.asyncio
async def test_a_wait_on_a_never_recorded_event_is_a_dead_wait_with_the_waiting_place() -> None:
    x = torch.randn(64, 256)
    line = _line("# DEAD WAIT")
    with pytest.raises(SimCheckError) as info:
        await asyncdbo.run_ubatches(waits_on_an_unrecorded_done_event, [(x[:32],), (x[32:],)], backend=SimBackend())  # RUN DEAD WAITS
    msg = str(info.value)
    assert msg.splitlines()[0] == "asyncdbo sim: 2 ordering problem(s):"
    here = "test_a_wait_on_a_never_recorded_event_is_a_dead_wait_with_the_waiting_place"
    for ub in (0, 1):
        assert (
            f"dead wait: stream comm waits on an event that no one recorded before the run ended\n"
            f"    wait event: ubatch {ub} after its yield 'dispatch', stream comm\n"
            f"        at tests/sim/test_sim_clock.py:{line} in waits_on_an_unrecorded_done_event\n"
            f"           tests/sim/test_sim_clock.py:{_line('# RUN DEAD WAITS')} in {here}"
        ) in msg, msg
    assert [d.waiter.ubatch for d in info.value.findings] == [0, 1]


@pytest.mark.asyncio
async def test_one_sim_run_at_a_time() -> None:
    async def nested(x_MK: torch.Tensor) -> torch.Tensor:
        return (await asyncdbo.run_ubatches(dispatch_layer, [(x_MK,)], backend=SimBackend(), name="inner"))[0]

    with pytest.raises(RuntimeError, match=r"a sim run \('outer'\) is already in progress in this process"):
        await asyncdbo.run_ubatches(nested, [(torch.randn(64, 256),)], backend=SimBackend(), name="outer")
    # the refusal left nothing behind: the next run works
    out = await asyncdbo.run_ubatches(dispatch_layer, [(torch.ones(8, 256),)], backend=SimBackend())
    assert torch.equal(out[0], torch.relu(torch.ones(8, 256) @ W_KN))


_SHARED_EVENTS: dict[str, Any] = {}  # run name -> the one event both ubatches use


async def waits_before_ubatch_1_records(x_MK: torch.Tensor) -> torch.Tensor:
    """Ubatch 0's stream waits on an event ubatch 1 records only later (a CANN-style pipeline with
    the record and the wait in the wrong order)."""
    ub = get_ubatch()
    be = ub.run.ext.backend
    shared = _SHARED_EVENTS.setdefault(ub.run.name, be.new_event())
    if ub.id == 0:
        be.wait(ub.ext.stream, shared)  # WAIT TOO EARLY
    h_MN = x_MK @ W_KN
    await dbo_yield("stage")
    if ub.id == 1:
        be.record(shared, ub.ext.stream)  # RECORDED LATER
    return h_MN


@pytest.mark.asyncio
async def test_a_wait_issued_before_the_record_is_reported_with_both_places() -> None:
    x = torch.randn(64, 256)
    be = SimBackend(on_problem="record")
    await asyncdbo.run_ubatches(waits_before_ubatch_1_records, [(x[:32],), (x[32:],)], backend=be, stream_policy="ubatch")  # RUN EARLY WAIT
    (dead,) = be.report.dead_waits
    here = "tests/sim/test_sim_clock.py"
    assert str(dead) == (
        "wait before record: stream ub0 waits on an event first recorded later (CUDA ignores such a wait: early "
        "read; NPU stalls)\n"
        "    wait event: ubatch 0 before its first yield, stream ub0\n"
        f"        at {here}:{_line('# WAIT TOO EARLY')} in waits_before_ubatch_1_records\n"
        f"           {here}:{_line('# RUN EARLY WAIT')} in test_a_wait_issued_before_the_record_is_reported_with_both_places\n"
        "    record event: ubatch 1 after its yield 'stage', stream ub1\n"
        f"        at {here}:{_line('# RECORDED LATER')} in waits_before_ubatch_1_records\n"
        f"           {here}:{_line('# RUN EARLY WAIT')} in test_a_wait_issued_before_the_record_is_reported_with_both_places"
    )


@pytest.mark.asyncio
async def test_the_race_checker_does_not_change_the_timeline() -> None:
    x = torch.randn(256, 256)
    reports = []
    for check in (True, False):
        be = SimBackend(check_races=check)
        await asyncdbo.run_ubatches(dispatch_layer, [(x[:128],), (x[128:],)], backend=be)
        reports.append([(s.stream, s.kind, s.ubatch, s.tag, s.start, s.end) for s in be.report.spans])
    assert reports[0] == reports[1]
