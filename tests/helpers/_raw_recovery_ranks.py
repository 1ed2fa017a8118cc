"""Rank functions of the raw-API recovery tests: ``run_ubatches`` on per-ubatch gloo groups, with
no runner, one failed run, then ten good ones.

The layer is the tutorial's (section 7): equal row blocks to every rank through an all-to-all on
the running ubatch's own group, row-wise "experts", and the combine back; three of them per step.
Rows come back to where they came from and every op works row by row, so a DBO run of two halves
equals the serial run of the whole batch bit for bit.

:func:`fail_then_ten` computes ten batches serially (outside a run, on the base group), runs one
step that fails on this rank as ``Fault`` says (cancelled, timed out or raising, after its own
number of scheduler steps), then runs the ten batches with DBO and returns how the failed run
ended here and whether each of the ten equals the serial one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import asyncdbo
from asyncdbo import (
    dbo_current_ubatch_id,
    dbo_submit,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    ubatch_group,
    ubatch_groups,
)
from asyncdbo.dist.recovery import run_sync
from asyncdbo.lowlevel import Instrument

# Shape legend: T = tokens (rows), D = hidden.

D = 32
ROWS = 16  # per rank and step: two ubatches of 8
LAYERS = 3
GOOD_STEPS = 10


@dataclass(frozen=True)
class Fault:
    """How rank ``rank``'s run of the failed step ends: ``cancel`` (its task is cancelled),
    ``timeout`` (an ``asyncio.timeout`` around it expires) or ``raise`` (ubatch 1 raises), after
    ``after`` scheduler steps of that run (``raise``: in layer ``after``); ``wait_for``: an
    ``asyncio.wait_for`` of ``after`` tenths of a second around it; ``stop``: the rank stops itself
    (SIGSTOP) in ubatch 0 of layer 1, and rank 0 resumes it once every other rank is done; None:
    nothing of its own. ``block_s``: block the thread that long in ubatch 0 of layer 1 (a busy rank)."""

    kind: str | None
    after: int = 0
    block_s: float = 0.0


Faults = dict[int, Fault]


def _all_to_all(x_TD: torch.Tensor, what: str) -> tuple[torch.Tensor, Any]:
    out_TD = torch.empty_like(x_TD)
    work = dist.all_to_all_single(out_TD, x_TD, group=ubatch_group(), async_op=True)
    return out_TD, dbo_submit(work, nbytes=x_TD.numel() * x_TD.element_size(), what=what)


_HOOK: dict[str, Callable[[int], None]] = {}  # "layer": called with the layer index, in every ubatch


async def _layer(x_TD: torch.Tensor, w_DD: torch.Tensor) -> torch.Tensor:
    h_TD = torch.tanh(x_TD @ w_DD)
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    recv_TD, _ = _all_to_all(h_TD, "dispatch")
    await dbo_yield_and_switch_from_comm_to_compute("experts")  # host: parks until the rows arrived
    y_TD = recv_TD * 2.0 + 1.0
    await dbo_yield_and_switch_from_compute_to_comm("combine")
    back_TD, _ = _all_to_all(y_TD, "combine")
    await dbo_yield_and_switch_from_comm_to_compute("done")
    return back_TD + x_TD


async def forward(x_TD: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    for i, w_DD in enumerate(ws):
        hook = _HOOK.get("layer")
        if hook is not None:
            hook(i)
        if "park" in _HOOK:  # a cancel of the step task is pending: wait on the loop (see _failing_step)
            await asyncio.sleep(0)
        x_TD = await _layer(x_TD, w_DD)
    return x_TD


def _batch(rank: int, i: int) -> torch.Tensor:
    return torch.randn(ROWS, D, generator=torch.Generator().manual_seed(1000 * rank + i))


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(D, D, generator=g) / D**0.5 for _ in range(LAYERS)]


async def dbo_step(x_TD: torch.Tensor, ws: list[torch.Tensor], **options: Any) -> torch.Tensor:
    halves = [(part, ws) for part in x_TD.split(ROWS // 2)]
    return torch.cat(await asyncdbo.run_ubatches(forward, halves, backend="host", **options))


class _After(Instrument):
    """Call ``fn()`` after ``n`` scheduler steps of the run."""

    def __init__(self, n: int, fn: Callable[[], object]) -> None:
        self.n, self.seen, self.fn = n, 0, fn

    def stepped(self, ub: Any, request: object) -> None:
        self.seen += 1
        if self.seen == self.n:
            self.fn()


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _failing_step(rank: int, fault: Fault | None, ws: list[torch.Tensor], watchdog_s: float | None,
                        pids: list[int]) -> str:
    """Run the failed step on this rank; how it ended, as ``Type: message`` (or ``completed``)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    x_TD = _batch(rank, 99)
    options: dict[str, Any] = {"watchdog_s": watchdog_s}
    kind = fault.kind if fault is not None else None
    if kind == "cancel":
        # The request reaches the run where it next waits on the loop; a run whose comm has always
        # arrived already (a peer ahead of it) never does, and would complete with the request still
        # pending for the caller's next await: the layers wait on the loop from then on, as a model
        # that awaits the loop would.
        def cancel() -> None:
            task.cancel()  # type: ignore[union-attr]
            _HOOK["park"] = lambda i: None
        options["instrument"] = _After(fault.after, cancel)  # type: ignore[union-attr]
    if kind == "raise":
        def hook(i: int) -> None:
            if i == fault.after and dbo_current_ubatch_id() == 1:  # type: ignore[union-attr]
                raise RuntimeError(f"expert weights lost in layer {i}")
        _HOOK["layer"] = hook
    if kind == "stop" or (fault is not None and fault.block_s):
        def pause(i: int) -> None:
            if i == 1 and dbo_current_ubatch_id() == 0:
                if kind == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    time.sleep(fault.block_s)  # type: ignore[union-attr]
        _HOOK["layer"] = pause
    try:
        if kind == "timeout":
            async with asyncio.timeout(None) as cm:
                options["instrument"] = _After(fault.after, lambda: cm.reschedule(loop.time()))  # type: ignore[union-attr]
                await dbo_step(x_TD, ws, **options)
        elif kind == "wait_for":
            await asyncio.wait_for(dbo_step(x_TD, ws, **options), fault.after / 10)  # type: ignore[union-attr]
        else:
            await dbo_step(x_TD, ws, **options)
        return "completed"
    except asyncio.CancelledError as exc:
        if task.uncancel():
            raise
        return _line(exc)
    except Exception as exc:
        return _line(exc)
    finally:
        _HOOK.clear()


def _resume_the_stopped_rank(rank: int, world: int, faults: Faults, pids: list[int]) -> None:
    """Every rank but the stopped one checks in; rank 0 then sends SIGCONT to the stopped one."""
    stopped = [r for r, f in faults.items() if f.kind == "stop"]
    if not stopped or rank in stopped:
        return
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    sync = run_sync()
    assert sync is not None
    tag = f"test/resume/{sync.epoch}"
    store.set(f"{tag}/{rank}", "done")
    if rank == 0:
        store.wait([f"{tag}/{r}" for r in range(world) if r not in stopped])
        for r in stopped:
            os.kill(pids[r], signal.SIGCONT)


async def _fail_then_ten(rank: int, world: int, faults: Faults, watchdog_s: float | None) -> dict[str, Any]:
    ubatch_groups(2)  # a collective, once per process (cached afterwards)
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    ws = _weights()
    serial_TD = [await forward(_batch(rank, i), ws) for i in range(GOOD_STEPS)]  # outside a run
    await dbo_step(_batch(rank, 0), ws)  # a good run first: it heals what an earlier test left
    sync = run_sync()
    assert sync is not None
    epoch = sync.epoch
    started = time.monotonic()
    outcome = await _failing_step(rank, faults.get(rank), ws, watchdog_s, pids)
    failed_s = time.monotonic() - started
    _resume_the_stopped_rank(rank, world, faults, pids)
    equal = [torch.equal(await dbo_step(_batch(rank, i), ws), serial_TD[i]) for i in range(GOOD_STEPS)]
    return {"outcome": outcome, "failed_s": failed_s, "equal": equal, "epochs": sync.epoch - epoch}


def fail_then_ten(rank: int, world: int, faults: Faults, watchdog_s: float | None = None) -> dict[str, Any]:
    return asyncdbo.run(_fail_then_ten, rank, world, faults, watchdog_s)  # type: ignore[arg-type]


def mismatched_max_ubatches(rank: int, world: int) -> str:
    """Each rank builds an EP model with its own ``max_ubatches`` on a fresh group: the error."""
    from _model_ranks import SMALL

    from asyncdbo.dist.ep import forget_ep_comm
    from asyncdbo.models import MiniModel

    group = dist.new_group(list(range(world)))
    try:
        MiniModel(SMALL, ep_group=group, max_ubatches=2 + 2 * rank)
    except ValueError as exc:
        return str(exc)
    finally:
        forget_ep_comm(group)
        dist.destroy_process_group(group)
    return "built"


def a_rank_that_never_asks(rank: int, world: int) -> str:
    """Rank 0 asks for clones of a fresh group (timeout 2 s); the others never do."""
    from datetime import timedelta

    from asyncdbo.dist import forget_group

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=2))
    try:
        if rank == 0:
            ubatch_groups(2, group)
        return "built"
    except RuntimeError as exc:
        return str(exc)
    finally:
        forget_group(group)
        dist.barrier()
        dist.destroy_process_group(group)
