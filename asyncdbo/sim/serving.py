"""The serving path on the simulated device: the runner with the paged KV cache, a request cut
between ubatches (``asyncdbo check --paged-kv``).

The library's :class:`~asyncdbo.serving.DBORunner` runs one step of the library's
:class:`~asyncdbo.models.MiniModel` (paged KV cache, :class:`~asyncdbo.serving.BatchBuilder` block
tables, the MoE layer's ``ht`` or ``ll`` schedule over a fake EP group) on a
:class:`~asyncdbo.sim.backend.SimBackend`. The step is a chunked prefill whose token split cuts a
request between two ubatches, after an earlier step cached a prefix of it: the second ubatch
continues the request, so in every layer it reads keys and values the first ubatch writes in the
same layer (:func:`~asyncdbo.models.attention.wait_for_earlier_kv` orders that read), besides the
prefix cached before the step and its own new slots.

What the checker sees there: the cache is one storage per layer, and the ubatches write disjoint
slots of it, so races are tracked per byte range (:func:`asyncdbo.sim.ops.self_region`: the slots
``index_copy_`` writes and ``index_select`` or ``t[idx]`` gathers), not per storage. The step's
metadata (token ids, positions, slot mapping, block table, lengths) is prepared by the host, so
reading it, or what is computed from it alone, is not a host sync (``host_args``). Under role
streams both ubatches queue attention on one compute stream in launch order, which orders the
read after the write whether or not the ubatch waits; under per-ubatch streams only the KV event
does, so a skipped wait is a ``read-after-write`` race there. Both policies are checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..backends import LinkSpec
from .backend import SimBackend
from .comm import CommSpec
from .counterfactual import measure_lost_overlap
from .devices import DeviceSpec
from .host import HostSpec
from .model import fake_ep_group
from .report import SimReport

__all__ = ["PAGED_KV_STEPS", "PagedKVCheck", "check_paged_kv", "describe_paged_kv"]

PAGED_KV_STEPS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((0, 4), (1, 6)),
    ((0, 5), (1, 6), (2, 5)),
)
"""``(request id, new tokens)`` per step: step 0 caches requests 0 and 1 (no DBO); the checked
step 1 has 16 tokens, cut 8 | 8 by the token split inside request 1 (ubatch 1 continues it), with
request 0's second chunk and request 1's on top of their cached prefixes, and a new request 2."""


@dataclass(frozen=True)
class PagedKVCheck:
    """One checked step: the stream ``policy``, the sim's ``report`` (its races, dead waits and
    lost overlap, each lost overlap costed), and the token counts of the ubatches."""

    policy: str
    report: SimReport
    ubatch_tokens: tuple[int, ...]
    continuation: tuple[bool, ...]


def _model_config(schedule: str) -> Any:
    from ..models import MiniConfig

    return MiniConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, head_dim=8, num_experts=4, top_k=2,
                      moe_intermediate_size=32, block_size=4, num_kv_blocks=16, schedule=schedule)  # type: ignore[arg-type]


def describe_paged_kv(schedule: str, steps: Sequence[Sequence[tuple[int, int]]] = PAGED_KV_STEPS) -> str:
    """What :func:`check_paged_kv` runs, in one line: the model, the cache and the checked step."""
    c = _model_config(schedule)
    cached: dict[int, int] = {}
    for chunks in steps[:-1]:
        for rid, n in chunks:
            cached[rid] = cached.get(rid, 0) + n
    reqs = ", ".join(f"{n} new on {cached.get(rid, 0)} cached" for rid, n in steps[-1])
    return (f"DBORunner with the paged KV cache: MiniModel ({c.num_layers} layer, hidden {c.hidden_size}, "
            f"{c.num_experts} experts top-{c.top_k}, KV blocks of {c.block_size}), MoE over a fake EP group of 2; "
            f"checked step: {sum(n for _, n in steps[-1])} tokens of {len(steps[-1])} requests ({reqs}), "
            "token split into 2 ubatches")


def _tokens(rid: int, n: int, start: int) -> list[int]:
    return [(7 * rid + 3 * (start + i)) % 64 for i in range(n)]


async def check_paged_kv(
    *,
    stream_policy: Literal["role", "ubatch"] = "ubatch",
    schedule: Literal["ht", "ll"] = "ht",
    device: str | DeviceSpec = "h200",
    link: str | LinkSpec = "ib400",
    comm: str | CommSpec = "deepep",
    host: str | HostSpec = "none",
    ep: int = 2,
    check_races: bool = True,
    fail_on: Sequence[str] = ("lost-overlap",),
    steps: Sequence[Sequence[tuple[int, int]]] = PAGED_KV_STEPS,
) -> PagedKVCheck:
    """Run ``steps`` through a :class:`~asyncdbo.serving.DBORunner` with the paged KV cache: every
    step but the last caches its tokens without DBO, the last runs as 2 DBO ubatches (token split)
    on the sim under ``stream_policy``. Races and dead waits raise
    :class:`~asyncdbo.sim.SimCheckError`, as does lost overlap (each costed by a counterfactual
    run) when ``fail_on`` names it. Raises ValueError when the last step is not cut inside a
    request (there would be nothing to order)."""
    from ..models import MiniModel
    from ..plan import ThresholdConfig
    from ..serving import BatchBuilder, DBORunner, RunnerConfig

    if stream_policy not in ("role", "ubatch"):
        raise ValueError(f"stream_policy must be 'role' or 'ubatch' (got {stream_policy!r})")
    if not steps:
        raise ValueError("steps must hold at least the checked step")
    cfg = _model_config(schedule)
    always = ThresholdConfig(decode_threshold=1, prefill_threshold=1)
    builder = BatchBuilder(cfg.kv_cache_config, vocab_size=cfg.vocab_size)
    done: dict[int, int] = {}
    batches = []
    for chunks in steps:
        batches.append(builder.build([(rid, _tokens(rid, n, done.get(rid, 0))) for rid, n in chunks]))
        for rid, n in chunks:
            done[rid] = done.get(rid, 0) + n
    last = batches[-1]
    state: dict[str, Any] = {}
    with torch.no_grad(), fake_ep_group(ep) as group:
        model = MiniModel(cfg, ep_group=group, max_ubatches=2)

        async def run(be: SimBackend) -> None:
            model.kv_cache.reset()
            warm = DBORunner(model, RunnerConfig(enabled=False, backend=SimBackend(check_races=False), watchdog_s=None))
            for batch in batches[:-1]:  # the cached prefixes, written before the checked step
                await warm.step(batch)
            runner = DBORunner(model, RunnerConfig(thresholds=always, backend=be, stream_policy=stream_policy,
                                                   watchdog_s=None))
            state["plan"] = (await runner.step(last)).plan

        def make(**overrides: Any) -> SimBackend:
            return SimBackend(device=device, link=link, comm=comm, host=host, check_races=check_races,
                              fail_on=fail_on, **overrides)  # host_args: on by default

        report, _ = await measure_lost_overlap(run, make)
    plan = state["plan"]
    if not plan.microbatched or not any(s.first_is_continuation for s in plan.slices):
        raise ValueError(f"the checked step must be cut inside a request into 2 ubatches; its plan ran "
                         f"{plan.record.ubatch_num_tokens} ({plan.record.reason.value}): change steps")
    return PagedKVCheck(stream_policy, report, tuple(plan.record.ubatch_num_tokens),
                        tuple(s.first_is_continuation for s in plan.slices))
