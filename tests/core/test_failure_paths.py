"""Failure and cancellation paths, built as carefully as the fast path.

When one ubatch raises (or the run is cancelled), every other live ubatch is cancelled at its
suspension point: its cleanup (``finally``, ``except CancelledError``, ``GeneratorExit``) runs in
its own context with its stream installed; the user's original exception is the one that
propagates, later errors ride on it as notes; a ubatch that refuses cancellation gets a bounded
number of throws and is then named, never spun on; after the run, everything it held is freed
without the cycle collector.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import weakref
from typing import Any

import pytest
from _recording_backend import RecordingBackend

from asyncdbo import (
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_register_recv_hook,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)
from asyncdbo.lowlevel import Instrument

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

LABEL: contextvars.ContextVar[str] = contextvars.ContextVar("label", default="caller")


class Boom(Exception):
    pass


async def test_cleanup_runs_in_the_ubatchs_own_context_with_its_stream_installed() -> None:
    log: list[str] = []

    async def forward(i: int) -> None:
        LABEL.set(f"label of ub{i}")
        await dbo_yield_and_switch_from_compute_to_comm("to comm")  # ub1 then waits on the comm stream
        if i == 0:  # ub0 goes back to compute, so the compute stream is installed when it raises
            await dbo_yield_and_switch_from_comm_to_compute("ub1 enters its try")
            raise Boom("ub0 failed")
        try:
            await dbo_yield("parked here")
        finally:
            log.append(f"cleanup ub{dbo_current_ubatch_id()} enabled={dbo_enabled()} {LABEL.get()}")

    with pytest.raises(Boom, match="ub0 failed"):
        await run_ubatches(forward, [(0,), (1,)], backend=RecordingBackend(log))
    cleanup = log.index("cleanup ub1 enabled=True label of ub1")
    assert log[cleanup - 1] == "install comm"  # ub1's stream went back in before its cleanup ran


async def test_the_original_error_propagates_and_every_sibling_is_cancelled_even_if_one_cleanup_raises() -> None:
    cleaned: list[int] = []

    async def forward(i: int) -> None:
        await dbo_yield("start")
        if i == 0:
            await dbo_yield("the others enter their try")
            raise Boom("the real error")
        try:
            await dbo_yield("parked")
        finally:
            cleaned.append(i)
            if i == 1:
                raise ValueError("cleanup of ub1 failed too")

    with pytest.raises(Boom, match="the real error") as info:
        await run_ubatches(forward, [(0,), (1,), (2,)])
    assert cleaned == [1, 2]
    notes = info.value.__notes__
    assert notes[0] == (
        "asyncdbo: raised in ubatch 0 of 3 while running (last yield point 'the others enter their try'); the other "
        "ubatches were cancelled"
    )
    assert notes[1] == "asyncdbo: while cancelling ubatch 1, its cleanup raised ValueError: cleanup of ub1 failed too"


async def test_a_ubatch_that_refuses_cancellation_is_named_not_spun_on() -> None:
    attempts: list[str] = []

    async def forward(i: int) -> None:
        if i == 0:
            await dbo_yield("start")
            raise Boom("ub0 failed")
        while len(attempts) < 100:  # swallows everything, the worst sibling there is (bounded: a test
            try:                     # that could spin forever must not, even if the library regressed)
                await dbo_yield("stubborn")
            except BaseException as exc:  # noqa: BLE001 - the point of the test
                attempts.append(type(exc).__name__)

    with pytest.raises(Boom) as info:
        await run_ubatches(forward, [(0,), (1,)])
    assert attempts == ["CancelledError", "CancelledError", "CancelledError", "GeneratorExit"]
    assert info.value.__notes__[1] == (
        "asyncdbo: ubatch 1 ignored cancellation 3 times and then GeneratorExit, at yield point 'stubborn'; "
        "it was abandoned (its cleanup did not finish). Let CancelledError and GeneratorExit propagate."
    )


async def test_a_cleanup_that_awaits_while_the_run_fails_is_cut_short_and_named() -> None:
    """Not Task.cancel: the failing run schedules nothing, so an await in a cleanup that suspends
    gets CancelledError again, and a note says so (asyncdbo._core.cancel)."""
    log: list[str] = []

    async def forward(i: int) -> None:
        try:
            await dbo_yield("a")
            if i == 1:
                raise Boom("sibling failed")
            await dbo_yield("b")
        finally:
            if i == 0:
                try:
                    await dbo_yield("cleanup")
                    log.append("cleanup finished")
                except asyncio.CancelledError:
                    log.append("cleanup await cancelled")
                    raise

    with pytest.raises(Boom) as info:
        await run_ubatches(forward, [(0,), (1,)])
    assert log == ["cleanup await cancelled"]
    assert info.value.__notes__ == [
        "asyncdbo: raised in ubatch 1 of 2 while running (last yield point 'a'); the other ubatches were cancelled",
        "asyncdbo: while cancelling ubatch 0, its cleanup awaited (last yield point 'cleanup'); a failing run "
        "schedules nothing, so that await got CancelledError too and the cleanup did not finish: do cleanup that "
        "waits after run_ubatches returns or raises"]


async def test_a_recv_hook_that_fails_as_its_holder_parks_closes_the_holder_at_once() -> None:
    log: list[str] = []

    def failing_hook() -> None:
        raise Boom("the receive could not be launched")

    async def forward(i: int) -> None:
        try:
            if i == 0:
                dbo_register_recv_hook(failing_hook)  # left with ub1
                await dbo_yield("sent")
                await asyncio.sleep(1)
            else:
                await asyncio.sleep(0.001)  # ub1 parks: it must launch the hook first, which fails
        finally:
            log.append(f"finally ub{i}")

    with pytest.raises(Boom, match="could not be launched") as info:
        await run_ubatches(forward, [(0,), (1,)])
    assert sorted(log) == ["finally ub0", "finally ub1"]  # both ran before run_ubatches raised
    assert "raised in ubatch 1 of 2 as it parked" in info.value.__notes__[0]


async def test_cancelling_the_awaiting_task_runs_every_ubatchs_cleanup_in_its_context() -> None:
    cleaned: list[str] = []
    started = asyncio.Event()

    async def forward(i: int) -> None:
        LABEL.set(f"ub{i}")
        try:
            started.set()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cleaned.append(LABEL.get())
            raise

    task = asyncio.create_task(run_ubatches(forward, [(0,), (1,)]))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cleaned) == ["ub0", "ub1"]


async def test_a_cancel_requested_while_the_run_never_waits_ends_that_run_not_a_later_one() -> None:
    # asyncio delivers a cancel at the task's next suspension; these ubatches only switch, so the
    # run has none: the kernel takes it once they finished, and the run raises (invariant 10)
    task = asyncio.current_task()
    assert task is not None
    trace: list[str] = []

    async def forward(i: int, cancel_at: int | None) -> int:
        for k in range(2):
            if k == cancel_at:
                task.cancel()
                trace.append(f"ub{i} cancels the task")
            await dbo_yield()
            trace.append(f"ub{i} yield {k}")
        return i

    with pytest.raises(asyncio.CancelledError) as info:
        await run_ubatches(forward, [(0, 1), (1, None)], name="step1")
    assert trace == ["ub0 yield 0", "ub0 cancels the task", "ub1 yield 0", "ub0 yield 1", "ub1 yield 1"]
    assert info.value.__notes__ == ["asyncdbo: run 'step1' took a cancel of its task that no wait had delivered (the run never waited on the event loop); "
                                    "its ubatches had finished, and their results were dropped"]
    assert task.uncancel() == 0  # the one request, taken by that run
    trace.clear()
    assert await run_ubatches(forward, [(0, None), (1, None)], name="step2") == [0, 1]  # the next run is untouched
    assert trace == ["ub0 yield 0", "ub1 yield 0", "ub0 yield 1", "ub1 yield 1"]


async def test_an_instrument_hears_the_cancel_a_run_took_after_its_ubatches_finished() -> None:
    # the run ends as its caller sees it: run_finished gets the CancelledError, never None first
    task = asyncio.current_task()
    assert task is not None
    heard: list[str] = []

    class Ends(Instrument):
        def run_finished(self, run: Any, exc: BaseException | None) -> None:
            heard.append(f"{run.name}: {type(exc).__name__}")

    async def forward(i: int) -> int:
        if i == 0:
            task.cancel()
        await dbo_yield()
        return i

    with pytest.raises(asyncio.CancelledError):
        await run_ubatches(forward, [(0,), (1,)], name="step1", instrument=Ends())
    assert task.uncancel() == 0
    assert await run_ubatches(forward, [(1,), (1,)], name="step2", instrument=Ends()) == [1, 1]
    assert heard == ["step1: CancelledError", "step2: NoneType"]


async def test_a_run_that_starts_while_its_task_is_being_cancelled_is_not_cancelled_again() -> None:
    # a cleanup step in an except CancelledError block: the request it handles is not this run's
    task = asyncio.current_task()
    assert task is not None

    async def forward(i: int) -> int:
        await dbo_yield()
        return i

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.sleep(0)
    assert task.cancelling() == 1
    assert await run_ubatches(forward, [(0,), (1,)]) == [0, 1]
    assert task.uncancel() == 0


async def test_a_cancel_requested_before_a_run_that_never_waits_ends_that_run() -> None:
    # requested between two runs (Ctrl-C in the loop's own code) and not delivered yet: no wait
    # follows in a loop of runs that only switch, so the run is the one that must deliver it
    task = asyncio.current_task()
    assert task is not None
    ran: list[int] = []

    async def forward(i: int) -> int:
        await dbo_yield()
        ran.append(i)
        return i

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run_ubatches(forward, [(0,), (1,)], name="step1")
    assert ran == [0, 1]  # its ubatches finished first, as for a cancel requested during the run
    assert task.uncancel() == 0
    assert await run_ubatches(forward, [(0,), (1,)], name="step2") == [0, 1]


async def test_a_run_nested_in_a_ubatch_leaves_a_pending_cancel_of_the_task_to_the_outer_run() -> None:
    # the nested run's task is the outer run's view (cancels per ubatch): the task's cancel, requested
    # by a ubatch of the outer run, ends the outer run, as one that never nests
    task = asyncio.current_task()
    assert task is not None
    inner_results: list[list[int]] = []

    async def inner(i: int) -> int:
        await dbo_yield()
        return i

    async def outer(i: int) -> int:
        await dbo_yield()
        if i == 0:
            task.cancel()
            inner_results.append(await run_ubatches(inner, [(0,), (1,)], name="inner"))
        await dbo_yield()
        return i

    with pytest.raises(asyncio.CancelledError) as info:
        await run_ubatches(outer, [(0,), (1,)], name="outer")
    assert inner_results == [[0, 1]]
    assert info.value.__notes__ == ["asyncdbo: run 'outer' took a cancel of its task that no wait had delivered (the run never waited on the event loop); "
                                    "its ubatches had finished, and their results were dropped"]
    assert task.uncancel() == 0


class KeepRun(Instrument):
    """Holds the run only weakly: a test tool must not keep it alive itself."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[Any]] = []

    def run_started(self, run: Any) -> None:
        self.refs.append(weakref.ref(run))
        self.refs += [weakref.ref(ub) for ub in run.ubatches]


async def test_a_finished_run_frees_itself_its_ubatches_and_their_results_without_gc() -> None:
    torch = pytest.importorskip("torch", reason="the results are tensors (CI runs tests/core on 3.12/3.13 without torch)")

    keep = KeepRun()

    async def forward(i: int) -> torch.Tensor:
        await dbo_yield("y")
        return torch.full((4,), float(i))

    gc.disable()
    try:
        results = await run_ubatches(forward, [(0,), (1,)], instrument=keep)
        result_refs = [weakref.ref(t) for t in results]
        del results
        await asyncio.sleep(0)
        assert [r() for r in keep.refs] == [None, None, None]
        assert [r() for r in result_refs] == [None, None]
    finally:
        gc.enable()


async def test_a_failed_run_frees_itself_once_the_error_is_dropped_without_gc() -> None:
    keep = KeepRun()

    async def forward(i: int) -> None:
        await dbo_yield("y")
        if i == 1:
            raise Boom("fail")
        await asyncio.sleep(30)

    gc.disable()
    try:
        try:
            await run_ubatches(forward, [(0,), (1,)], instrument=keep)
        except Boom:
            pass
        await asyncio.sleep(0)
        assert [r() for r in keep.refs] == [None, None, None]
    finally:
        gc.enable()



# ------------------------------------------------------------------------- what a user reads
async def _raises_at_layer_1(bad: int) -> None:
    for layer in range(3):
        await dbo_yield(f"L{layer}")
        if layer == 1 and dbo_current_ubatch_id() == bad:
            raise Boom(f"bad value at layer {layer}")


@pytest.mark.parametrize("entry", ["run_ubatches", "run_ubatches_with_stats", "with an instrument",
                                   "prepared run_ubatches", "prepared run_ubatches_with_stats"])
async def test_a_ubatchs_traceback_ends_in_its_own_frame_without_the_kernels(entry: str) -> None:
    import os
    import traceback

    import asyncdbo

    core = os.path.join("asyncdbo", "_core") + os.sep

    async def caller() -> None:
        if entry.startswith("prepared"):
            await getattr(asyncdbo.prepare_run(), entry.split()[1])(_raises_at_layer_1, [(1,), (1,)])
        elif entry == "run_ubatches_with_stats":
            await asyncdbo.run_ubatches_with_stats(_raises_at_layer_1, [(1,), (1,)])
        else:  # an instrument sends every switch through the Python loop
            await run_ubatches(_raises_at_layer_1, [(1,), (1,)],
                               instrument=Instrument() if entry == "with an instrument" else None)

    with pytest.raises(Boom) as info:
        await caller()
    frames = traceback.extract_tb(info.value.__traceback__)
    # from the caller's await, through the one re-raise line of the entry point, into the ubatch
    assert [f.name for f in frames] == ["test_a_ubatchs_traceback_ends_in_its_own_frame_without_the_kernels", "caller",
                                        entry.replace("with an instrument", "run_ubatches").split()[-1],
                                        "_raises_at_layer_1"]
    assert frames[-1].line == 'raise Boom(f"bad value at layer {layer}")'
    assert not [f for f in frames if core in f.filename]  # no frame of the kernel's loop or its re-raise
    assert info.value.__notes__ == [
        "asyncdbo: raised in ubatch 1 of 2 while running (last yield point 'L1'); the other ubatches were cancelled"]


async def test_an_error_that_never_reached_a_ubatch_keeps_every_frame() -> None:
    import traceback

    with pytest.raises(TypeError) as info:
        await run_ubatches(_raises_at_layer_1, [(1, 2)])  # one argument too many: fails in the run's set-up
    names = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert names[:2] == ["test_an_error_that_never_reached_a_ubatch_keeps_every_frame", "run_ubatches"]
    assert names.count("run_ubatches") == 1  # re-raised as it was, not once more
