"""Rank functions of the step-recovery tests: fail one step on purpose, then step on.

:func:`fail_then_step` runs ten prefill batches with DBO and serially on healthy groups, then one
step that fails (every rank cancels it after its own number of scheduler steps, or one rank's
ubatch 1 raises in the second MoE layer), then the same ten batches with DBO again, and returns
what a test needs to check that the ranks recovered: how the failed step ended on this rank, the
logits before and after, and the recovery epoch.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _model_ranks import ALWAYS, SMALL, tokens

import asyncdbo
from asyncdbo import dbo_current_ubatch_id
from asyncdbo.lowlevel import Instrument
from asyncdbo.models import MiniModel
from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

# Shape legend: T = tokens, D = hidden, V = vocab.

GOOD_STEPS = 10


@dataclass(frozen=True)
class Failure:
    """How the failed step fails: ``cancel_after[rank]`` scheduler steps into it, rank ``rank``'s
    task is cancelled (None: not by its own hand); ``raise_on``: this rank's ubatch 1 raises;
    ``late_on``: this rank fails after the step's last collective (the others finish the step
    and go on to the next one), as the runner records a failure of its merge."""

    cancel_after: tuple[int | None, ...] = ()
    raise_on: int | None = None
    late_on: int | None = None


class _CancelAfter(Instrument):
    """Cancel ``task`` (the serving loop's step task) after ``n`` scheduler steps of the run."""

    def __init__(self, n: int, task: asyncio.Task[Any]) -> None:
        self.n, self.seen, self.task = n, 0, task

    def stepped(self, ub: Any, request: object) -> None:
        self.seen += 1
        if self.seen == self.n:
            self.task.cancel()
            # The request reaches the run where it next waits on the loop; a run whose comm has
            # always arrived already (a peer ahead of it) never does, and would complete with the
            # request still pending for the caller's next await. The stand-in layer waits on the
            # loop from now on, as a model that awaits the loop would.
            _PARK.append(True)


_PARK: list[bool] = []  # non-empty: _RaisingMoE waits on the loop (a cancel of the step task is pending)


class _RaisingMoE:
    """Stands in for one MoE layer: ubatch 1 raises while ``armed``, after its peers' comm started."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.armed = inner, False

    async def forward(self, h_TD: torch.Tensor) -> torch.Tensor:
        if _PARK:
            await asyncio.sleep(0)
        if self.armed and dbo_current_ubatch_id() == 1:
            raise RuntimeError("expert weights lost in ubatch 1")
        return await self.inner.forward(h_TD)


def _batch(builder: BatchBuilder, rank: int, i: int) -> Any:
    builder.reset()
    return builder.build([(0, list(tokens(13 + i, 1000 * rank + i))), (1, list(tokens(11, 2000 * rank + i)))])


async def _fail_then_step(rank: int, failure: Failure) -> dict[str, Any]:
    group = dist.group.WORLD
    cfg = RunnerConfig(thresholds=ALWAYS, watchdog_s=60.0)
    model = MiniModel(SMALL, ep_group=group)
    raising = model.layers[1]["moe"] = _RaisingMoE(model.layers[1]["moe"])
    dbo = DBORunner(model, cfg, dp_group=group)
    serial = DBORunner(MiniModel(SMALL, ep_group=group), cfg, dp_group=group)
    builder = BatchBuilder(SMALL.kv_cache_config)
    epoch = dbo.sync.epoch if dbo.sync is not None else 0

    serial_TV, before_TV, after_TV = [], [], []
    for i in range(GOOD_STEPS):
        serial_TV.append((await serial.step(_batch(builder, rank, i), enabled=False)).logits_TV)
        before_TV.append((await dbo.step(_batch(builder, rank, i))).logits_TV)

    outcome = "completed"
    task = asyncio.current_task()
    assert task is not None
    cancel = failure.cancel_after[rank] if failure.cancel_after else None
    instrument = _CancelAfter(cancel, task) if cancel is not None else None
    raising.armed = failure.raise_on == rank
    try:
        await dbo.step(_batch(builder, rank, 99), instrument=instrument)
    except asyncio.CancelledError:
        task.uncancel()
        outcome = "cancelled"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    raising.armed = False
    _PARK.clear()
    if failure.late_on == rank:
        assert dbo.sync is not None
        dbo.sync.post_failure(RuntimeError("merge failed after the last collective"))

    microbatched = []
    for i in range(GOOD_STEPS):
        result = await dbo.step(_batch(builder, rank, i))
        after_TV.append(result.logits_TV)
        microbatched.append(result.record.microbatched)
    assert dbo.sync is not None
    return {
        "outcome": outcome,
        "epochs": dbo.sync.epoch - epoch,
        "microbatched": microbatched,
        "equal_before_after": [torch.equal(b, a) for b, a in zip(before_TV, after_TV)],
        "max_diff_serial": max((s - a).abs().max().item() for s, a in zip(serial_TV, after_TV)),
    }


def fail_then_step(rank: int, world_size: int, failure: Failure) -> dict[str, Any]:
    return asyncdbo.run(_fail_then_step, rank, failure)  # type: ignore[arg-type]
