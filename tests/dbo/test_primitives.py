"""The dbo_* primitives: vLLM's ordering rules, recv hooks, explicit events, no-ops outside a run."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import asyncdbo.dbo
from _recording_backend import RecordingBackend

from asyncdbo import (
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_get_previous_event,
    dbo_maybe_run_recv_hook,
    dbo_num_ubatches,
    dbo_record_event,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_wait_event,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)
from asyncdbo.lowlevel import Signal, get_ubatch

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


async def test_high_throughput_schedule_records_before_yield_and_waits_after_resume() -> None:
    """vLLM's rule: the done-event is recorded on the stream being left *before* the yield (so it
    covers only this ubatch's work) and waited on by the stream entered *after* the resume."""
    log: list[str] = []

    async def moe(i: int) -> None:
        log.append(f"ub{i}: attn")
        await dbo_yield_and_switch_from_compute_to_comm("dispatch")
        log.append(f"ub{i}: dispatch")
        await dbo_switch_to_compute_sync()
        log.append(f"ub{i}: experts")
        await dbo_yield_and_switch_from_compute_to_comm("combine")
        log.append(f"ub{i}: combine")
        await dbo_yield_and_switch_from_comm_to_compute("done")
        log.append(f"ub{i}: finalize")

    await run_ubatches(moe, [(0,), (1,)], backend=RecordingBackend(log))
    assert log == [
        "install compute",
        "ub0: attn",
        "ub0 record ub0.compute_done on compute",
        "ub1: attn",
        "ub1 record ub1.compute_done on compute",
        "install comm",
        "ub0 comm waits ub0.compute_done",
        "ub0: dispatch",
        "ub0 record ub0.comm_done on comm",
        "install compute",
        "ub0 compute waits ub0.comm_done",
        "ub0: experts",
        "ub0 record ub0.compute_done on compute",
        "install comm",
        "ub1 comm waits ub1.compute_done",
        "ub1: dispatch",
        "ub1 record ub1.comm_done on comm",
        "install compute",
        "ub1 compute waits ub1.comm_done",
        "ub1: experts",
        "ub1 record ub1.compute_done on compute",
        "install comm",
        "ub0 comm waits ub0.compute_done",
        "ub0: combine",
        "ub0 record ub0.comm_done on comm",
        "install compute",  # the scheduler re-installs ub1's stream on resume ...
        "install comm",  # ... and ub1's switch then moves it to comm
        "ub1 comm waits ub1.compute_done",
        "ub1: combine",
        "ub1 record ub1.comm_done on comm",
        "install compute",
        "ub0 compute waits ub0.comm_done",
        "ub0: finalize",
        "install comm",
        "install compute",
        "ub1 compute waits ub1.comm_done",
        "ub1: finalize",
    ]


async def test_plain_switches_change_the_stream_without_any_dependency() -> None:
    log: list[str] = []

    async def fwd(i: int) -> None:
        dbo_switch_to_comm()
        log.append(f"ub{i} on {get_ubatch().ext.stream}")
        await dbo_switch_to_compute()  # awaiting a plain switch is allowed and free
        log.append(f"ub{i} on {get_ubatch().ext.stream}")
        await dbo_switch_to_comm_sync()
        await dbo_yield("y")

    await run_ubatches(fwd, [(0,), (1,)], backend=RecordingBackend(log))
    assert log == [
        "install compute",
        "install comm",
        "ub0 on comm",
        "install compute",
        "ub0 on compute",
        "ub0 record ub0.compute_done on compute",
        "install comm",
        "ub0 comm waits ub0.compute_done",
        "install compute",
        "install comm",
        "ub1 on comm",
        "install compute",
        "ub1 on compute",
        "ub1 record ub1.compute_done on compute",
        "install comm",
        "ub1 comm waits ub1.compute_done",
    ]


async def test_switching_from_the_wrong_stream_is_an_error_naming_the_ubatch() -> None:
    async def fwd(i: int) -> None:
        await dbo_yield("attn")
        await dbo_yield_and_switch_from_comm_to_compute()  # still on compute

    with pytest.raises(
        asyncdbo.dbo.WrongStreamError,
        match=r"dbo_yield_and_switch_from_comm_to_compute\(\) called in ubatch 0 while it is on the compute stream; "
        r"it must be on the comm stream \(last yield point 'attn'\)",
    ):
        await run_ubatches(fwd, [(0,), (1,)], backend=RecordingBackend([]))


async def test_ubatch_stream_policy_gives_each_ubatch_its_own_stream() -> None:
    log: list[str] = []

    async def fwd(i: int) -> None:
        log.append(f"ub{i} on {get_ubatch().ext.stream}")
        await dbo_yield_and_switch_from_compute_to_comm("dispatch")
        log.append(f"ub{i} on {get_ubatch().ext.stream}")

    await run_ubatches(fwd, [(0,), (1,)], backend=RecordingBackend(log), stream_policy="ubatch")
    assert log == [
        "install ub0",
        "ub0 on ub0",
        "ub0 record ub0.compute_done on ub0",
        "install ub1",
        "ub1 on ub1",
        "ub1 record ub1.compute_done on ub1",
        "install ub0",
        "ub0 ub0 waits ub0.compute_done",
        "ub0 on ub0",
        "install ub1",
        "ub1 ub1 waits ub1.compute_done",
        "ub1 on ub1",
    ]


# ---------------------------------------------------------------- recv hooks


async def test_recv_hook_is_run_by_the_next_ubatch_after_it_queued_its_own_compute() -> None:
    """The low-latency schedule: ub i sends, registers its receive on ub i+1 and yields; ub i+1
    queues its compute, then launches ub i's receive; a ubatch's exit runs its pending hook."""
    trace: list[str] = []

    async def fwd(i: int) -> None:
        trace.append(f"ub{i}: attn")
        dbo_maybe_run_recv_hook()  # vLLM's MoE prepare starts by launching the peer's pending recv
        trace.append(f"ub{i}: dispatch send")
        handle = dbo_register_recv_hook(lambda: trace.append(f"recv of ub{i} (launched by ub{dbo_current_ubatch_id()})"))
        await dbo_yield("dispatch_send")
        dbo_maybe_run_recv_hook()
        await handle  # the data is here once the hook ran
        trace.append(f"ub{i}: experts")

    await run_ubatches(fwd, [(0,), (1,)])
    assert trace == [
        "ub0: attn",
        "ub0: dispatch send",
        "ub1: attn",
        "recv of ub0 (launched by ub1)",
        "ub1: dispatch send",
        "recv of ub1 (launched by ub0)",
        "ub0: experts",
        "ub1: experts",
    ]


async def test_with_three_ubatches_a_hook_passes_over_a_ubatch_that_already_holds_one() -> None:
    """ub1 is parked when ub0 registers, so ub0's hook goes to ub2; ub1 wakes and registers before
    ub2 ran it: ub1's hook goes on to ub0 instead of replacing ub0's (which would lose a receive)."""
    from asyncdbo.lowlevel import Signal

    trace: list[str] = []
    woken = Signal("ub1 may go on")

    def hook(i: int) -> Callable[[], None]:
        return lambda: trace.append(f"recv of ub{i} (launched by ub{dbo_current_ubatch_id()})")

    async def fwd(i: int) -> None:
        if i == 1:
            await woken  # parked while ub0 registers
        else:
            await dbo_yield("attn")
        if i != 2:
            handle = dbo_register_recv_hook(hook(i))
            if i == 0:
                woken.set()
            await dbo_yield("dispatch_send")
            dbo_maybe_run_recv_hook()
            await handle
        else:
            await dbo_yield("compute")
            dbo_maybe_run_recv_hook()
        trace.append(f"ub{i} done")

    await run_ubatches(fwd, [(0,), (1,), (2,)])
    assert sorted(trace) == sorted(["recv of ub0 (launched by ub2)", "recv of ub1 (launched by ub0)",
                                    "ub0 done", "ub1 done", "ub2 done"])


async def test_a_ubatch_exit_runs_its_pending_recv_hook_before_handing_over() -> None:
    trace: list[str] = []

    async def fwd(i: int) -> None:
        if i == 0:
            dbo_register_recv_hook(lambda: trace.append("ub0's combine recv, run by ub1 at exit"))
            await dbo_yield("combine_send")
            trace.append("ub0 finished")
        else:
            trace.append("ub1 finished")

    await run_ubatches(fwd, [(0,), (1,)])
    assert trace == ["ub1 finished", "ub0's combine recv, run by ub1 at exit", "ub0 finished"]


async def test_a_lone_ubatch_runs_its_hook_at_once_and_a_parking_one_launches_the_hook_it_holds() -> None:
    trace: list[str] = []

    async def fwd(i: int) -> None:
        if i == 1:
            trace.append("ub1 finished")
            return
        await dbo_yield("send")  # ub1 finishes meanwhile: ub0 is the only live ubatch left
        handle = dbo_register_recv_hook(lambda: trace.append("ub0's recv ran at once"))
        await handle
        trace.append("ub0 finished")

    await run_ubatches(fwd, [(0,), (1,)])
    assert trace == ["ub1 finished", "ub0's recv ran at once", "ub0 finished"]

    trace.clear()

    async def park(i: int) -> None:
        if i == 0:
            handle = dbo_register_recv_hook(lambda: trace.append(f"ub0's recv launched by ub{dbo_current_ubatch_id()}"))
            await dbo_yield("send")
            await handle
            dbo_record_event("ub0 received")
            trace.append("ub0 finished")
        else:
            trace.append("ub1 parks")
            await dbo_wait_event("ub0 received")  # parking launches the hook ub0 left with ub1 first
            trace.append("ub1 finished")

    await run_ubatches(park, [(0,), (1,)])
    assert trace == ["ub1 parks", "ub0's recv launched by ub1", "ub0 finished", "ub1 finished"]


async def test_registering_over_an_unrun_hook_is_an_error_instead_of_a_lost_receive() -> None:
    async def fwd(i: int) -> None:
        if i == 0:
            dbo_register_recv_hook(lambda: None)
            dbo_register_recv_hook(lambda: None)
        await dbo_yield()

    with pytest.raises(asyncdbo.dbo.RecvHookOverwriteError, match=r"ubatch 0 registered a recv hook on ubatch 1, which still holds an unrun hook"):
        await run_ubatches(fwd, [(0,), (1,)])


async def test_with_three_ubatches_the_next_live_one_launches_two_hooks_in_registration_order() -> None:
    """ub1 leaves its hook with ub2 and parks; ub0 then finds ub1 parked and leaves its hook with ub2
    too: ub2 launches both, ub1's first (with 2 ubatches this cannot happen; with 4, the ll schedule
    met it when two ubatches parked at once)."""
    trace: list[str] = []

    async def fwd(i: int) -> None:
        if i == 0:
            await dbo_yield("first")
            handle = dbo_register_recv_hook(lambda: trace.append("ub0's recv"))
            dbo_record_event("ub1 go")
            await handle
            trace.append("ub0 finished")
        elif i == 1:
            handle = dbo_register_recv_hook(lambda: trace.append("ub1's recv"))
            await dbo_wait_event("ub1 go")
            trace.append("ub1 woke")
            await handle
            trace.append("ub1 finished")
        else:
            await dbo_yield("before")
            trace.append("ub2 runs its hooks")
            dbo_maybe_run_recv_hook()
            trace.append("ub2 finished")

    await run_ubatches(fwd, [(0,), (1,), (2,)])
    # ub0's record wakes ub1 behind ub2, which was already waiting its turn
    assert trace == ["ub2 runs its hooks", "ub1's recv", "ub0's recv", "ub2 finished",
                     "ub1 woke", "ub1 finished", "ub0 finished"]


# ---------------------------------------------------------------- explicit events (CANN style)


async def test_wait_event_parks_until_another_ubatch_records_it() -> None:
    trace: list[str] = []

    async def fwd(i: int) -> None:
        if i == 0:
            await dbo_wait_event("ub1.gate")  # recorded later by ub1: ub0 must not run ahead
            trace.append("ub0 after wait")
        else:
            trace.append("ub1 gate")
            dbo_record_event("ub1.gate")
            await dbo_yield()
            trace.append("ub1 after record")

    await run_ubatches(fwd, [(0,), (1,)])
    assert trace == ["ub1 gate", "ub0 after wait", "ub1 after record"]


async def test_recording_a_key_twice_is_an_error() -> None:
    async def fwd(i: int) -> None:
        dbo_record_event(("layer0", "dispatch"))
        await dbo_yield()

    with pytest.raises(asyncdbo.dbo.DuplicateEventError, match=r"event \('layer0', 'dispatch'\) recorded twice in one run \(again by ubatch 1"):
        await run_ubatches(fwd, [(0,), (1,)])


# ---------------------------------------------------------------- misc


async def test_get_previous_event_runs_under_the_compute_stream() -> None:
    log: list[str] = []

    async def fwd(i: int) -> tuple[object, object]:
        await dbo_yield_and_switch_from_compute_to_comm()
        seen = dbo_get_previous_event(lambda: get_ubatch().ext.stream)
        return seen, get_ubatch().ext.stream

    assert await run_ubatches(fwd, [(0,), (1,)], backend=RecordingBackend(log)) == [("compute", "comm")] * 2


async def test_identity_primitives_inside_a_run() -> None:
    async def fwd(i: int) -> tuple[bool, int, int]:
        await dbo_yield()
        return dbo_enabled(), dbo_current_ubatch_id(), dbo_num_ubatches()

    assert await run_ubatches(fwd, [(0,), (1,), (2,)]) == [(True, 0, 3), (True, 1, 3), (True, 2, 3)]


async def test_outside_a_run_every_primitive_is_a_no_op() -> None:
    ran: list[str] = []
    assert (dbo_enabled(), dbo_current_ubatch_id(), dbo_num_ubatches()) == (False, 0, 1)
    await dbo_yield()
    await dbo_yield_and_switch_from_compute_to_comm()
    await dbo_yield_and_switch_from_comm_to_compute()
    await dbo_switch_to_comm_sync()
    await dbo_switch_to_compute_sync()
    dbo_switch_to_comm()
    dbo_switch_to_compute()
    dbo_record_event("x")
    await dbo_wait_event("x")
    dbo_maybe_run_recv_hook()
    assert dbo_get_previous_event(lambda: "called") is None
    handle = dbo_register_recv_hook(lambda: ran.append("hook"))
    await handle
    assert ran == ["hook"]  # no other ubatch exists to launch it, so it ran at once


class _FailedCommBackend(RecordingBackend):
    """A backend whose comm already failed when the switch waits on it (a peer rank died)."""

    def wait(self, stream: object, event: object) -> Signal:
        failed = Signal("dispatch")
        failed.set(RuntimeError("comm work 'dispatch' failed: peer rank 1 is gone"))
        return failed


async def test_a_comm_failure_seen_by_a_sync_switch_is_raised_in_the_ubatch() -> None:
    async def fwd(i: int) -> None:
        dbo_switch_to_comm()
        await dbo_switch_to_compute_sync()  # the wait is already failed: it must raise, not pass

    with pytest.raises(RuntimeError, match=r"comm work 'dispatch' failed: peer rank 1 is gone"):
        await run_ubatches(fwd, [(0,), (1,)], backend=_FailedCommBackend([]))
