"""dump_stacks: each live ubatch's await chain with file:line, last yield tag and what it waits on."""

from __future__ import annotations

import asyncio
import io
import os
import signal

import pytest

from asyncdbo import WatchdogTimeout, dbo_current_ubatch_id, dbo_yield, run_ubatches
from asyncdbo.observe.stacks import dump_stacks, install_stack_dump_signal, live_runs

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

HERE = __file__


def line_of(marker: str) -> int:
    """Line number of the source line that ends with ``# <marker>`` in this file."""
    with open(HERE, encoding="utf-8") as f:
        hits = [i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


async def wait_for_comm(fut: asyncio.Future[int]) -> int:
    return await fut  # PARK


async def forward(fut: asyncio.Future[int], dumps: list[str]) -> int:
    ub = dbo_current_ubatch_id()
    await dbo_yield("attn")
    if ub == 0:
        return await wait_for_comm(fut)  # CALL
    await dbo_yield("dispatch")
    dumps.append(dump_stacks())  # DUMP
    fut.set_result(7)
    return 1


def expected_dump(future_repr: str) -> str:
    return (
        f"asyncdbo stacks of pid {os.getpid()}, printed by dump_stacks()\n"
        "asyncdbo run 'dumped': 2 ubatches on host; ubatch 1 is running (it called dump_stacks)\n"
        f"ubatch 0: parked, last yield point 'attn', parked on {future_repr}\n"
        f'  File "{HERE}", line {line_of("CALL")}, in forward\n'
        "    return await wait_for_comm(fut)  # CALL\n"
        f'  File "{HERE}", line {line_of("PARK")}, in wait_for_comm\n'
        "    return await fut  # PARK\n"
        "ubatch 1: ready, last yield point 'dispatch'\n"
        f'  File "{HERE}", line {line_of("DUMP")}, in forward\n'
        "    dumps.append(dump_stacks())  # DUMP\n"
    )


async def test_dump_stacks_shows_the_await_chain_of_a_parked_ubatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    dumps: list[str] = []
    assert await run_ubatches(forward, [(fut, dumps), (fut, dumps)], backend="host", name="dumped") == [7, 1]
    # The future's repr names the scheduler's wake-up callback; take it from the text itself.
    future_repr = dumps[0].split("parked on ", 1)[1].split("\n", 1)[0]
    assert future_repr.startswith("<Future pending cb=[Parking._park.")
    assert dumps == [expected_dump(future_repr)]


async def test_dump_stacks_writes_to_a_file_and_sees_runs_from_another_task() -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()

    async def parked() -> int:
        await dbo_yield("attn")
        return await wait_for_comm(fut)

    # no instrument, no debug mode: the scheduler lists every run it drives
    run_task = asyncio.ensure_future(run_ubatches(parked, [(), ()], backend="host", name="outside"))
    while not live_runs() or any(str(ub.state) != "parked" for ub in live_runs()[0].ubatches):
        await asyncio.sleep(0.001)
    buf = io.StringIO()
    text = dump_stacks(buf)
    assert buf.getvalue() == text
    who, head, ub0, rest = text.split("\n", 3)
    assert who.startswith("asyncdbo stacks of ") and who.endswith(f"pid {os.getpid()}, printed by dump_stacks()")
    assert head == "asyncdbo run 'outside': 2 ubatches on host"
    assert ub0.startswith("ubatch 0: parked, last yield point 'attn', parked on <Future pending")
    assert text.count(f'line {line_of("PARK")}, in wait_for_comm') == 2  # both ubatches wait there
    fut.set_result(3)
    assert await run_task == [3, 3]
    assert live_runs() == []
    assert dump_stacks().endswith(", printed by dump_stacks()\nasyncdbo: no live DBO run\n")


async def test_the_signal_handler_prints_the_same_dump() -> None:
    buf = io.StringIO()
    uninstall = install_stack_dump_signal(signal.SIGUSR1, file=buf)
    try:

        async def forward_with_signal(fut: asyncio.Future[int], dumps: list[str]) -> int:
            ub = dbo_current_ubatch_id()
            await dbo_yield("attn")
            if ub == 0:
                return await wait_for_comm(fut)
            await dbo_yield("dispatch")
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs at the next bytecode, in this context
            dumps.append(dump_stacks())
            fut.set_result(1)
            return 2

        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        dumps: list[str] = []
        await run_ubatches(forward_with_signal, [(fut, dumps), (fut, dumps)], backend="host", name="signalled")
    finally:
        uninstall()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    text = buf.getvalue()
    who, text = text.split("\n", 1)
    assert who.endswith(f"pid {os.getpid()}, printed by the signal handler (SIGUSR1)")
    assert text.startswith(
        "asyncdbo run 'signalled': 2 ubatches on host; ubatch 1 is running (the signal handler interrupted it)\n"
    )
    assert f'line {line_of("PARK")}, in wait_for_comm' in text
    # Only the running ubatch's own line differs between the two dumps (it moved on by one line).
    assert text.split("ubatch 1:")[1] .split("\n", 1)[0] == dumps[0].split("ubatch 1:")[1].split("\n", 1)[0]
    assert text.split("ubatch 1:")[0].split("\n", 1)[1] == dumps[0].split("ubatch 1:")[0].split("\n", 2)[2]


async def test_the_watchdog_error_uses_the_same_printer() -> None:
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def stuck() -> int:
        await dbo_yield("attn")
        return await wait_for_comm(fut)

    with pytest.raises(WatchdogTimeout) as info:
        await run_ubatches(stuck, [(), ()], backend="host", watchdog_s=0.05, name="stuck")
    msg = str(info.value)
    assert msg.startswith("asyncdbo watchdog: run 'stuck' made no progress for 0.05 s")
    chain = (
        f'  File "{HERE}", line {line_of("PARK")}, in wait_for_comm\n'
        "    return await fut  # PARK"
    )
    assert msg.count("last yield point 'attn', parked on <Future") == 2
    assert msg.count(chain) == 2
