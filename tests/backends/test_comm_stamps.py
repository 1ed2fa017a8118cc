"""A run's comm works as stamps in arrays (issue 46, item 3): the host backend stamps each work's
times into the run's CommStamps, the runner's measurement folds them as arrays, and a CommRecord
per work is made only when someone reads ``RunStats.comm``, with the same fields as before."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
from _host_works import HandWork

from asyncdbo import dbo_submit, dbo_yield
from asyncdbo._core import VirtualClock
from asyncdbo.backends import CommRecord, CommStamps
from asyncdbo.dbo import RunStats, run_ubatches_with_stats
from asyncdbo.plan import StepTiming
from asyncdbo.serving.measure import host_timing

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


async def _run(clock: VirtualClock) -> tuple[RunStats, list[Any], HandWork]:
    """ub0 issues a dispatch at 1 and waits for it from 2; ub1 completes it at 3 and issues a send
    at 3 that the run leaves in flight (returned, to complete later)."""
    dispatch, send = HandWork(), HandWork()
    handles: list[Any] = []

    async def fwd(i: int) -> int:
        clock.advance(1.0)
        if i == 0:
            handles.append(dbo_submit(dispatch, nbytes=8, what="dispatch"))
            await dbo_yield()
            await handles[0]
        else:
            await dbo_yield()
            clock.advance(1.0)
            dispatch.fut.complete()
            handles.append(dbo_submit(send, nbytes=4, what="send"))
        return i

    results, stats = await run_ubatches_with_stats(fwd, [(0,), (1,)], backend="host", clock=clock)
    assert results == [0, 1]
    return stats, handles, send


async def test_the_run_stamps_its_works_and_the_stats_make_records_only_when_read() -> None:
    clock = VirtualClock()
    stats, (dispatch, send), send_work = await _run(clock)
    assert "comm" not in vars(stats)  # no record made yet: the measurement reads the stamps
    assert host_timing(stats, 5.0) == StepTiming(step_s=5.0, num_ubatches=2, comm_s=2.0, exposed_s=0.0,
                                                 hidden_by_others_s=1.0, hidden_own_s=1.0, source="host")
    assert "comm" not in vars(stats)
    clock.advance(1.0)
    send_work.fut.complete()  # after the run: the handle reads it, the run's stats do not
    assert (dispatch.t_issue, dispatch.t_wait, dispatch.t_done, dispatch.t_release) == (1.0, 2.0, 3.0, None)
    assert (send.t_issue, send.t_wait, send.t_done) == (3.0, None, 4.0)
    assert stats.comm == (
        CommRecord(ub=0, what="dispatch", nbytes=8, t_issue=1.0, t_done=3.0, t_release=None, t_wait=2.0),
        CommRecord(ub=1, what="send", nbytes=4, t_issue=3.0, t_done=None, t_release=None, t_wait=None),
    )
    built = RunStats(**{f.name: getattr(stats, f.name) for f in fields(RunStats)})
    assert stats == built and repr(stats) == repr(built) and vars(stats) == vars(built)
    assert host_timing(stats, 5.0) == host_timing(built, 5.0)  # from the records now, the same numbers


async def test_stamps_made_from_records_give_the_records_back() -> None:
    records = [CommRecord(ub=1, what="combine", nbytes=16, t_issue=0.5, t_done=2.0, t_release=2.5, t_wait=1.0),
               CommRecord(ub=-1, what="send", nbytes=0, t_issue=3.0, t_done=None)]
    stamps = CommStamps.of(records)
    assert (len(stamps), stamps.records(), stamps.frozen().records()) == (2, records, records)


async def test_on_a_device_a_run_makes_no_timing_event_and_no_comm_stamps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator backend leaves comm timing to device events it never makes for the runner's
    measurement: a step's run records none with timing (on the fake device; untested on a GPU),
    and its stats hold no comm works, so every step's measurement is its step time alone."""
    from asyncdbo.backends.accelerator import AcceleratorBackend
    from asyncdbo.testing import fake_streams
    from asyncdbo.testing.fake_device import FakeDevice

    timing: list[bool] = []
    init = fake_streams.FakeEvent.__init__

    def counting(self: Any, *args: Any, enable_timing: bool = False, **kwargs: Any) -> None:
        timing.append(enable_timing)
        init(self, *args, enable_timing=enable_timing, **kwargs)

    monkeypatch.setattr(fake_streams.FakeEvent, "__init__", counting)

    async def forward(i: int) -> int:
        await dbo_yield()
        return i

    with FakeDevice():
        _, stats = await run_ubatches_with_stats(forward, [(0,), (1,)], backend=AcceleratorBackend("cuda"))
    assert timing and not any(timing)  # events made (the streams' order), none timing
    assert (stats.comm, len(stats.stamps)) == ((), 0)
