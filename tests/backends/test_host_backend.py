"""Host backend on a real 2-process gloo group: comm parks only its own ubatch, others compute."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import asyncdbo
from asyncdbo import (
    dbo_submit,
    dbo_switch_to_comm,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
    run_ubatches_with_stats,
)
from asyncdbo.backends import LinkSpec
from asyncdbo.backends.host import HostBackend, HostEvent, HostStream, HostWork
from asyncdbo.dist.groups import forget_group, ubatch_group, ubatch_groups
from asyncdbo.lowlevel import MonotonicClock, get_ubatch
from asyncdbo.testing import RankPool

from _step_errors import error_line

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _submit_a2a(x: torch.Tensor, what: str):  # type: ignore[no-untyped-def]
    out = torch.empty_like(x)
    work = dist.all_to_all_single(out, x, group=ubatch_group(), async_op=True)
    return out, dbo_submit(work, nbytes=x.numel() * x.element_size(), what=what)


def _exchange_rank(rank: int, world_size: int, link: LinkSpec | None, loop: str) -> dict:
    """ub0 sends, yields to compute; ub1 computes while ub0's all-to-all is outstanding."""
    trace: list[str] = []
    pending_seen: list[bool] = []

    async def forward(i: int) -> list[float]:
        if i == 0:
            await dbo_yield_and_switch_from_compute_to_comm("dispatch")
            out, handle = _submit_a2a(torch.tensor([rank * 10.0, rank * 10.0 + 1]), "dispatch")
            trace.append("ub0: a2a issued")
            await dbo_yield_and_switch_from_comm_to_compute("dispatch_done")  # parks until complete
            trace.append("ub0: a2a done")
            return out.tolist()
        a = torch.randn(64, 64, generator=torch.Generator().manual_seed(rank))
        for k in range(3):
            a = torch.tanh(a @ a)
            ub0_work = [w for w in get_ubatch().run.ext.comm if w.ub == 0]
            pending_seen.append(bool(ub0_work) and not ub0_work[0].done())
            trace.append(f"ub1: compute {k}")
            await dbo_yield(f"mm{k}")
        return [float(a.sum())]

    async def main() -> list:
        return await run_ubatches(forward, [(0,), (1,)], backend=HostBackend(link=link))

    ubatch_groups(2)

    results = asyncdbo.run(main, loop=loop)  # type: ignore[arg-type]
    return {"ub0": results[0], "trace": trace, "pending_seen": pending_seen}


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_all_to_all_overlaps_the_other_ubatch_under_a_modeled_link(pool: RankPool, loop: str) -> None:
    # 50 ms of modeled latency makes the overlap certain: ub1 computes while ub0's work is out.
    link = LinkSpec(name="slow-nic", latency_s=0.05, bandwidth_Bps=1e9)
    res = pool.run(_exchange_rank, link, loop)
    assert [r["ub0"] for r in res] == [[0.0, 10.0], [1.0, 11.0]]
    for r in res:
        # ub0 yields before issuing (the CPU-blocking call comes after the peer's compute is
        # queued), ub1 computes while the 50 ms transfer is out, ub0 resumes only once it landed.
        assert r["trace"] == ["ub1: compute 0", "ub0: a2a issued", "ub1: compute 1", "ub1: compute 2", "ub0: a2a done"]
        assert r["pending_seen"] == [False, True, True]


def _released_while_switching_rank(rank: int, world_size: int) -> dict:
    """ub0 issues on a 20 ms modeled link and keeps switching (never parked) until the work is
    complete, both its arrivals counted: gloo's (its thread) and the link's release, a kernel timer
    that only a switch can fire here (nothing parks); then it awaits the work.

    It waits on the work's signal, not on ``t_done``: gloo's thread stores ``t_done`` just before it
    counts its arrival, so a ubatch that saw ``t_done`` could await the work before the arrival
    was counted and park (a race that a loaded machine loses now and then)."""

    async def forward(i: int) -> str:
        if i == 0:
            await dbo_switch_to_comm()
            _, handle = _submit_a2a(torch.tensor([float(rank), 1.0]), "dispatch")
            (work,) = get_ubatch().run.ext.comm
            clock = get_ubatch().run.clock
            give_up = clock.now() + 60.0  # a bound, never reached: gloo and a 20 ms link take far less
            while not work.done():  # each yield is a switch: the kernel fires due link timers there
                if clock.now() > give_up:
                    raise AssertionError(f"the work never completed while ub0 switched: {work!r}, {work.signal!r}")
                await dbo_yield("spin")
            assert work.t_done is not None and clock.now() >= work.t_release
            await handle
            return "received"
        while get_ubatch().run.ubatches[0].state.name != "DONE":
            await dbo_yield("other")
        return "switched"

    async def main() -> tuple[list[str], int]:
        results, stats = await asyncdbo.run_ubatches_with_stats(
            forward, [(0,), (1,)], backend=HostBackend(link=LinkSpec(name="slow-nic", latency_s=0.02, bandwidth_Bps=1e9))
        )
        return results, stats.num_parks

    ubatch_groups(2)
    results, parks = asyncdbo.run(main)
    return {"results": results, "parks": parks}


def test_a_message_the_link_released_while_its_ubatch_kept_switching_does_not_park_it(pool: RankPool) -> None:
    # The link's release is a kernel timer set during the fast loop: it fires at the first switch
    # after it is due, so awaiting the work finds it complete.
    for r in pool.run(_released_while_switching_rank):
        assert r == {"results": ["received", "switched"], "parks": 0}


def test_all_to_all_is_correct_over_real_loopback(pool: RankPool) -> None:
    res = pool.run(_exchange_rank, None, "uvloop")
    assert [r["ub0"] for r in res] == [[0.0, 10.0], [1.0, 11.0]]
    for r in res:
        assert sorted(r["trace"]) == sorted(["ub0: a2a issued", "ub0: a2a done"] + [f"ub1: compute {k}" for k in range(3)])


def _both_ubatches_rank(rank: int, world_size: int, n_ub: int) -> list:
    """Every ubatch dispatches and combines; per-ubatch results must match the serial exchange."""

    async def forward(i: int) -> list[float]:
        x = torch.arange(4, dtype=torch.float32) + 100 * rank + 10 * i
        await dbo_yield_and_switch_from_compute_to_comm("dispatch")
        y, _ = _submit_a2a(x, f"dispatch{i}")
        await dbo_switch_to_compute_sync()  # park until the dispatch landed
        y = y * 2
        await dbo_yield_and_switch_from_compute_to_comm("combine")
        z, handle = _submit_a2a(y, f"combine{i}")
        dbo_switch_to_comm()
        await dbo_yield_and_switch_from_comm_to_compute("combine_done")
        assert handle.done()
        return z.tolist()

    async def main() -> list:
        return await run_ubatches(forward, [(i,) for i in range(n_ub)], backend="host")

    ubatch_groups(n_ub)  # each ubatch's collectives on its own group clone: no cross-rank ubatch order needed
    return asyncdbo.run(main)


@pytest.mark.parametrize("n_ub", [1, 2, 3, 4])
def test_dispatch_and_combine_per_ubatch_match_the_serial_exchange(pool: RankPool, n_ub: int) -> None:
    # Run it a few times: completion order differs between ranks, the per-ubatch groups make
    # that harmless (on one shared group, ubatch 0's combine could meet ubatch 1's).
    for _ in range(3):
        res = pool.run(_both_ubatches_rank, n_ub)
        for rank in range(2):
            # a2a then *2 then a2a back: every element returns home doubled
            assert res[rank] == [[2.0 * (v + 100 * rank + 10 * i) for v in range(4)] for i in range(n_ub)]


def _group_misuse_rank(rank: int, world_size: int) -> str:
    base = dist.new_group([0, 1])
    ubatch_groups(2, base)

    async def forward(i: int) -> None:
        ubatch_group(base)

    async def main() -> None:
        await run_ubatches(forward, [(0,)] * 3)

    try:
        asyncdbo.run(main)
    except RuntimeError as exc:
        return error_line(exc)  # this rank's error, or the same one from the peer that posted it first
    finally:
        forget_group(base)  # later tests in this pool renew clones after failed steps: not these
    return "no error"


def test_a_ubatch_without_its_group_clone_gets_an_error_with_the_fix(pool: RankPool) -> None:
    msgs = pool.run(_group_misuse_rank)
    assert msgs[0].startswith("ubatch 2 needs its own clone of process group")
    assert "but only 2 exist; call asyncdbo.ubatch_groups(3, group) on every rank before the DBO run" in msgs[0]


def _outside_a_run_rank(rank: int, world_size: int) -> list[float]:
    backend = HostBackend(link="ib400")
    out = torch.empty(2)
    work = dist.all_to_all_single(out, torch.tensor([rank + 0.5, rank + 1.5]), async_op=True)
    handle = backend.submit(work, None, nbytes=8, what="serial")
    assert handle.done()  # outside a run, submit waits: serial semantics
    return out.tolist()


def _dbo_submit_outside_a_run_rank(rank: int, world_size: int) -> tuple[bool, list[float]]:
    out = torch.empty(2)
    work = dist.all_to_all_single(out, torch.tensor([rank + 0.25, rank + 2.25]), async_op=True)
    handle = dbo_submit(work, nbytes=8, what="serial")  # no run: waited for at once
    return handle.done(), out.tolist()


def test_submit_outside_a_run_waits_at_once(pool: RankPool) -> None:
    assert pool.run(_outside_a_run_rank) == [[0.5, 1.5], [1.5, 2.5]]
    assert pool.run(_dbo_submit_outside_a_run_rank) == [(True, [0.25, 1.25]), (True, [2.25, 3.25])]


def test_a_failed_work_is_reported_by_the_wait_that_covers_it() -> None:
    """A comm error must reach the ubatch that waits for the comm, also when the work failed
    before the wait (a peer died early) and when it is one of several covered works."""
    backend = HostBackend()
    comm = HostStream("comm", inline=False)
    ok, bad, late = (HostWork(w, 0, None, arrivals=1, clock=MonotonicClock(), ub=0) for w in ("ok", "bad", "late"))
    comm.pending = [ok, bad, late]
    ok.signal.set()
    bad.signal.set(RuntimeError("comm work 'bad' failed: peer gone"))
    event = HostEvent()
    backend.record(event, comm)
    assert event.works == (bad, late)  # the succeeded one is pruned, the failed one kept
    joined = backend.wait(comm, event)
    assert joined is not None and joined.done()
    assert str(joined.exception()) == "comm work 'bad' failed: peer gone"
    assert backend.wait(comm, HostEvent(works=(bad,))) is bad.signal


class _HeldWork:
    """A torch.distributed-like async work that completes when the test says so."""

    def __init__(self) -> None:
        self.fut: torch.futures.Future[None] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[None]:
        return self.fut

    def wait(self) -> None:
        self.fut.wait()


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["role", "ubatch"])
async def test_a_comm_event_is_there_only_while_its_stream_has_works_pending(policy: str) -> None:
    """Recorded on an idle comm stream a comm-done event would be empty, so the host keeps none
    there: the switches then skip the record and the wait. A submitted work puts the events of
    every ubatch on its stream in place (all of them on the shared stream of the role policy);
    the first record after every work completed takes them out again."""
    work = _HeldWork()
    log: list[str] = []

    def comm_events() -> str:
        lanes = get_ubatch().run.ext.lanes
        return " ".join(f"ub{lane.ub.id}:{'event' if lane.events['comm'] is not None else '-'}" for lane in lanes)

    async def forward(i: int) -> None:
        await dbo_yield_and_switch_from_compute_to_comm("dispatch")
        if i == 0:
            log.append(f"idle: {comm_events()}")
            dbo_submit(work, what="a2a")
            log.append(f"pending: {comm_events()}")
        else:
            work.fut.set_result(None)
            log.append(f"done, not recorded yet: {comm_events()}")
        await dbo_yield_and_switch_from_comm_to_compute("dispatch done")
        log.append(f"ub{i} on compute: {comm_events()}")

    stats = await run_ubatches_with_stats(forward, [(0,), (1,)], backend=HostBackend(), stream_policy=policy,
                                          watchdog_s=60)
    armed = "ub0:event ub1:event" if policy == "role" else "ub0:event ub1:-"
    assert log == [
        "idle: ub0:- ub1:-",
        f"pending: {armed}",
        f"done, not recorded yet: {armed}",
        # ub0's switch recorded while the work was pending (its event covers it; the work is done
        # by its wait, so it does not park); on the shared stream ub1's record found it done.
        f"ub0 on compute: {'ub0:- ub1:-' if policy == 'role' else armed}",
        f"ub1 on compute: {'ub0:- ub1:-' if policy == 'role' else armed}",
    ]
    assert stats[1].num_parks == 0


def test_a_named_host_backend_resolves_to_the_shared_one_until_its_name_is_registered_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``get_backend("host")`` returns the process's one host backend, resolved once and then
    looked up (a run that names it pays one dict lookup); "auto" is not remembered, as what it
    resolves to follows torch's current accelerator; options still make a new one, and registering
    the name again is what later calls get."""
    from asyncdbo.backends import get_backend, register_backend, registry

    for name in ("_REGISTRY", "_PROCESS_SHARED", "_RESOLVED"):
        monkeypatch.setattr(registry, name, type(getattr(registry, name))(getattr(registry, name)))
    shared = get_backend("host")
    assert get_backend("host") is shared and registry._RESOLVED["host"] is shared
    assert get_backend("host", link=None) is not shared  # options: a new backend, not remembered
    assert get_backend("auto") is shared  # no accelerator here: "auto" is the host, resolved each time
    assert registry._RESOLVED == {"host": shared}  # never "auto": the accelerator can change (FakeDevice)
    other = HostBackend()
    register_backend("host", lambda: other)
    assert (get_backend("host"), get_backend("host"), registry._RESOLVED) == (other, other, {})
