"""Functions the MoE and comm tests run on RankPool ranks (module level: pickled by reference).

Legend (shape suffixes): T tokens on this rank, D hidden, P ranks.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import asyncdbo
from asyncdbo.backends import link_spec
from asyncdbo.backends.host import HostBackend
from asyncdbo.dist import forget_group
from asyncdbo.dist.ep import ep_comm, plan_dispatch
from asyncdbo.lowlevel import Instrument
from asyncdbo.moe import MoEConfig, MoELayer

from _step_errors import error_kind_and_line, error_line

MIXTRAL_LIKE = dict(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2)
DEEPSEEK_LIKE = dict(
    hidden_size=32, intermediate_size=16, num_experts=8, top_k=3, scoring="sigmoid", n_group=4, topk_group=2,
    routed_scaling_factor=2.5, num_shared_experts=2,
)


def rank_input(rank: int, T: int, D: int, salt: int = 0) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(1000 * rank + T + salt))


def cut(x_TD: torch.Tensor, sizes: list[int]) -> list[tuple[torch.Tensor]]:
    assert sum(sizes) == x_TD.shape[0], (sizes, x_TD.shape)
    return [(part,) for part in torch.split(x_TD, sizes)]


class StepLog(Instrument):
    """Records (ubatch id, perf_counter) at every resume."""

    def __init__(self) -> None:
        self.resumes: list[tuple[int, float]] = []

    def resuming(self, ub: Any) -> None:
        self.resumes.append((ub.id, time.perf_counter()))


def moe_dbo_vs_serial(
    rank: int,
    world_size: int,
    cfg_kwargs: dict[str, Any],
    tokens_per_rank: list[int],
    sizes_per_rank: list[list[int]],
    policy: str = "role",
    link: str | None = None,
) -> dict[str, Any]:
    """Serial forward of this rank's whole batch vs the DBO run over its ubatch slices."""
    cfg = MoEConfig(**cfg_kwargs)
    layer = MoELayer(cfg, seed=7)
    x_TD = rank_input(rank, tokens_per_rank[rank], cfg.hidden_size)
    ref_TD = asyncdbo.run(layer, x_TD)

    async def dbo() -> list[torch.Tensor]:
        backend = HostBackend(link=link) if link else "host"
        return await asyncdbo.run_ubatches(layer, cut(x_TD, sizes_per_rank[rank]), backend=backend, stream_policy=policy)

    outs = asyncdbo.run(dbo)
    out_TD = torch.cat(outs)
    return {
        "shapes": [tuple(o.shape) for o in outs],
        "max_abs_diff": float((out_TD - ref_TD).abs().max()) if out_TD.numel() else 0.0,
        "equal": torch.equal(out_TD, ref_TD),
        "finite": bool(torch.isfinite(ref_TD).all()),
    }


def moe_overlap_trace(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    """One layer, 2 ubatches, a slow modeled link (200 ms latency) so each comm completes well after
    the issuing ubatch parks, even on a loaded machine (at 20 ms, one of three suite runs beside
    two others saw a rank descheduled past a dispatch's whole flight): returns which ubatches resumed while ubatch 0's dispatch was in
    flight (issue to completion), each ubatch's comm works in issue order, the yield counts and
    whether anything parked. (The interleaving of the two ubatches' works is left out: which
    counts exchange completes first is timing.)"""
    cfg = MoEConfig(**MIXTRAL_LIKE, schedule=schedule)
    layer = MoELayer(cfg, seed=7)
    x_TD = rank_input(rank, 16, cfg.hidden_size)
    log = StepLog()
    holder: dict[str, Any] = {}

    class Keep(Instrument):
        def run_finished(self, run: Any, exc: BaseException | None) -> None:
            holder["run"] = run

    link = link_spec("ib400", latency_s=200e-3)

    async def dbo() -> list[torch.Tensor]:
        return await asyncdbo.run_ubatches(
            layer, cut(x_TD, [8, 8]), backend=HostBackend(link=link), instrument=[log, Keep()]
        )

    asyncdbo.run(dbo)
    run = holder["run"]
    works = run.ext.comm_records()
    disp0 = next(w for w in works if w.ub == 0 and w.what == "dispatch")
    end = disp0.t_end or 0.0
    during = sorted({ub for ub, t in log.resumes if disp0.t_issue < t < end})
    return {
        "works": [[w.what for w in works if w.ub == i] for i in range(2)],
        "resumed_during_dispatch0": during,
        "yields": [ub.num_yields for ub in run.ubatches],
        "parked": run.num_parks > 0,
    }


def moe_raise_mid_forward(rank: int, world_size: int) -> str:
    """Rank 1's experts raise after the dispatch; it reports its error as a value, so the pool
    keeps waiting for rank 0, which must then fail in the combine (collective timeout), not hang."""
    cfg = MoEConfig(**MIXTRAL_LIKE)
    layer = MoELayer(cfg, seed=7)
    x_TD = rank_input(rank, 8, cfg.hidden_size)
    if rank == 1:
        def boom(*args: Any) -> torch.Tensor:
            raise RuntimeError("expert shard corrupted on rank 1")

        layer._experts = boom  # type: ignore[method-assign]

    async def dbo() -> list[torch.Tensor]:
        return await asyncdbo.run_ubatches(layer, cut(x_TD, [4, 4]), backend="host")

    try:
        asyncdbo.run(dbo)
    except RuntimeError as exc:
        if rank == 1:
            return f"rank 1 raised: {exc}"
        raise
    return "finished"


def moe_layer_error(rank: int, world_size: int, cfg_kwargs: dict[str, Any]) -> str:
    try:
        MoELayer(MoEConfig(**cfg_kwargs))
    except ValueError as exc:
        return str(exc)
    return "no error"


def comm_round_trip(rank: int, world_size: int, ids_per_rank: list[list[list[int]]], in_run: bool) -> dict[str, Any]:
    """Dispatch rows tagged with (rank, token) to their experts' ranks and back.

    Returns what this rank received per (source, local expert) and the round-tripped rows, which
    must equal the sent rows in expert order."""
    comm = ep_comm(None)
    E = 2 * world_size
    ids_TK = torch.tensor(ids_per_rank[rank], dtype=torch.int64).reshape(-1, 2)
    T = ids_TK.shape[0]
    x_TD = torch.stack([torch.full((T,), float(rank)), torch.arange(T, dtype=torch.float32)], dim=1)
    result: dict[str, Any] = {}

    async def body() -> None:
        ub = asyncdbo._core.get_ubatch()
        plan = plan_dispatch(ids_TK, num_experts=E, comm=comm, ub_id=None if ub is None else ub.id)
        await plan.start_counts()
        recv_x_RD, handle = plan.start_tokens(x_TD)
        await handle
        result["recv_PL"] = plan.recv_PL.tolist()
        result["recv_rows"] = recv_x_RD.tolist()
        result["local_ids"] = plan.local_expert_ids().tolist()
        back_ND, handle = plan.start_combine(recv_x_RD * 10)
        await handle
        result["back_ok"] = bool(torch.equal(back_ND, x_TD[plan.order_N // 2] * 10))
        out_TD = torch.zeros_like(x_TD)
        plan.finish(back_ND, torch.full((T, 2), 0.5), out_TD)
        result["finish_ok"] = bool(torch.equal(out_TD, x_TD * 10))

    if in_run:
        async def one() -> list[None]:
            return await asyncdbo.run_ubatches(body, [()], backend="host")

        asyncdbo.run(one)
    else:
        asyncdbo.run(body)
    return result


def group_sizes(rank: int, world_size: int) -> list[int]:
    comm = ep_comm(None)
    return [dist.get_world_size(g) for g in comm.ubatch_groups]


def moe_two_ep_groups(rank: int, world_size: int) -> dict[str, Any]:
    """4 ranks as 2 disjoint EP groups of 2 ({0,1}, {2,3}): each group's DBO output equals its
    serial output (the per-ubatch twins are created per EP group)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    cfg = MoEConfig(**MIXTRAL_LIKE)
    layer = MoELayer(cfg, ep_group=mine, seed=7)
    x_TD = rank_input(rank, 12, cfg.hidden_size)
    ref_TD = asyncdbo.run(layer, x_TD)

    async def dbo() -> list[torch.Tensor]:
        return await asyncdbo.run_ubatches(layer, cut(x_TD, [5, 7]), backend="host")

    out_TD = torch.cat(asyncdbo.run(dbo))
    # The pool's later tests must not renew these groups' clones after a failed step (torch 2.13
    # names a sub-group's clones by a hash that repeats across renewals: see renew_ubatch_groups).
    for g in groups:
        forget_group(g)
    return {"ep": (layer.comm.size, layer.comm.rank), "equal": torch.equal(out_TD, ref_TD)}


def moe_stage_events(rank: int, world_size: int, schedule: str) -> list[tuple[Any, ...]]:
    """The explicit events one layer called twice records under the ubatch-stream policy."""
    layer = MoELayer(MoEConfig(**MIXTRAL_LIKE, schedule=schedule), seed=7, name="L0")
    x_TD = rank_input(rank, 8, 32)
    holder: dict[str, Any] = {}

    class Keep(Instrument):
        def run_finished(self, run: Any, exc: BaseException | None) -> None:
            holder["run"] = run

    async def twice(x: torch.Tensor) -> torch.Tensor:
        return await layer(await layer(x))

    async def dbo() -> list[torch.Tensor]:
        return await asyncdbo.run_ubatches(twice, cut(x_TD, [3, 5]), backend="host", stream_policy="ubatch", instrument=Keep())

    asyncdbo.run(dbo)
    return sorted(holder["run"].ext.events)


def teardown_after_a_dbo_step(rank: int, world_size: int) -> dict[str, Any]:
    """A DBO MoE step (fills the EP comm cache and the per-ubatch clones), then
    destroy_process_groups(): which groups are still alive, and how many threads remain."""
    import os
    import weakref

    from torch.distributed import distributed_c10d as c10d

    from asyncdbo.dist.groups import destroy_process_groups

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    cfg = MoEConfig(**MIXTRAL_LIKE)
    layer = MoELayer(cfg, seed=7)
    x_TD = rank_input(rank, 16, cfg.hidden_size)

    async def dbo() -> list[torch.Tensor]:
        return await asyncdbo.run_ubatches(layer, cut(x_TD, [8, 8]), backend="host")

    asyncdbo.run(dbo)
    del layer, dbo  # the layer holds its EP group and clones: a model must go before the groups
    groups = list(c10d._world.pg_map)
    alive = [weakref.ref(g) for g in groups]
    before = threads()
    del groups
    destroy_process_groups()
    return {
        "groups": len(alive),
        "alive_after": sum(r() is not None for r in alive),
        "threads_joined": before - threads(),
    }


def ubatches_share_the_default_group(rank: int, world_size: int, debug: bool) -> str:
    """Two ubatches issue their all-to-alls on the default group (not their own clones)."""
    async def forward(i: int) -> None:
        out = torch.empty(2 * world_size)
        work = dist.all_to_all_single(out, torch.ones(2 * world_size), async_op=True)
        await asyncdbo.dbo_submit(work, nbytes=8, what="a2a")
        await asyncdbo.dbo_yield("after")

    async def main() -> None:
        await asyncdbo.run_ubatches(forward, [(0,), (1,)], backend="host", debug=debug)

    try:
        asyncdbo.run(main)
    except RuntimeError as exc:
        kind, line = error_kind_and_line(exc)
        return f"{kind}: {line}"
    return "no error"


def ubatch_group_without_clones(rank: int, world_size: int) -> str:
    group = dist.new_group(list(range(world_size)))  # fresh: no per-ubatch clones made for it

    async def forward(i: int) -> None:
        asyncdbo.ubatch_group(group)
        await asyncdbo.dbo_yield("y")

    async def main() -> None:
        await asyncdbo.run_ubatches(forward, [(0,), (1,), (2,)], backend="host")

    try:
        asyncdbo.run(main)
    except RuntimeError as exc:
        return error_line(exc)
    return "no error"


def moe_fused_vs_split(
    rank: int,
    world_size: int,
    cfg_kwargs: dict[str, Any],
    sizes_per_rank: list[list[int]],
    policy: str,
    mode: str,
    link: Any = None,
) -> dict[str, Any]:
    """This rank's ubatches through one layer under DBO, split (no dispatch options) and inside
    ``dispatch_options(max_tokens, mode)``, and its whole batch serially: whether the outputs are
    bitwise equal, and the names of the second run's comm messages in issue order."""
    from asyncdbo.dist import dispatch_options

    cfg = MoEConfig(**cfg_kwargs)
    layer = MoELayer(cfg, seed=7)
    x_TD = rank_input(rank, sum(sizes_per_rank[rank]), cfg.hidden_size)
    ref_TD = asyncdbo.run(layer, x_TD)
    max_tokens = max(max(s) for s in sizes_per_rank)
    sent: list[str] = []

    class Sent(Instrument):
        def run_finished(self, run: Any, exc: BaseException | None) -> None:
            sent.extend(w.what for w in run.ext.comm_records())

    async def dbo(options: bool) -> torch.Tensor:
        backend = HostBackend(link=link)
        args = cut(x_TD, sizes_per_rank[rank])
        if not options:
            outs = await asyncdbo.run_ubatches(layer, args, backend=backend, stream_policy=policy)
        else:
            with dispatch_options(max_tokens, mode):  # type: ignore[arg-type]
                outs = await asyncdbo.run_ubatches(layer, args, backend=backend, stream_policy=policy,
                                                   instrument=Sent())
        return torch.cat(outs)

    split_TD = asyncdbo.run(dbo, False)
    fused_TD = asyncdbo.run(dbo, True)
    return {
        "split_equals_serial": torch.equal(split_TD, ref_TD),
        "options_equal_split": torch.equal(fused_TD, split_TD),
        "sent": sent,
    }


def renew_sub_group_clones(rank: int, world_size: int, renewals: int) -> list[float]:
    """The clones of a sub-group (made with local synchronization), renewed ``renewals`` times;
    after each renewal every clone all-reduces ``rank + 1``."""
    from asyncdbo.dist import current_clones, renew_ubatch_groups, ubatch_groups

    base = dist.new_group([0, 1])
    ubatch_groups(2, base)
    sums = []
    try:
        for _ in range(renewals):
            renew_ubatch_groups()
            for g in current_clones(base):
                t_1 = torch.tensor([rank + 1.0])
                dist.all_reduce(t_1, group=g)
                sums.append(t_1.item())
    finally:
        forget_group(base)
    return sums


def moe_sync_free_vs_exact(
    rank: int,
    world_size: int,
    cfg_kwargs: dict[str, Any],
    sizes_per_rank: list[list[int]],
    policy: str,
    mode: str,
) -> dict[str, Any]:
    """This rank's whole batch serially on the exact path (CPU default), and its ubatches under DBO
    with ``sync_free=True`` inside ``dispatch_options(max_tokens, mode)`` under a forbidding
    :class:`HostSyncs`: whether the outputs are bitwise equal, the syncs seen, and the messages."""
    from asyncdbo.syncs import HostSyncs
    from asyncdbo.dist import dispatch_options

    exact = MoELayer(MoEConfig(**cfg_kwargs), seed=7)
    free = MoELayer(MoEConfig(**cfg_kwargs, sync_free=True), seed=7)
    x_TD = rank_input(rank, sum(sizes_per_rank[rank]), exact.cfg.hidden_size)
    ref_TD = asyncdbo.run(exact, x_TD)
    max_tokens = max(max(s) for s in sizes_per_rank)
    sent: list[str] = []

    class Sent(Instrument):
        def run_finished(self, run: Any, exc: BaseException | None) -> None:
            sent.extend(w.what for w in run.ext.comm_records())

    async def dbo() -> tuple[torch.Tensor, int]:
        with dispatch_options(max_tokens, mode), HostSyncs(forbid=True) as syncs:  # type: ignore[arg-type]
            outs = await asyncdbo.run_ubatches(free, cut(x_TD, sizes_per_rank[rank]), backend="host",
                                               stream_policy=policy, instrument=Sent())
        return torch.cat(outs), syncs.count

    out_TD, syncs = asyncdbo.run(dbo)
    return {"equal": torch.equal(out_TD, ref_TD), "syncs": syncs, "sent": sorted(sent)}


def moe_sync_free_without_bound(rank: int, world_size: int) -> str:
    layer = MoELayer(MoEConfig(**MIXTRAL_LIKE, sync_free=True), seed=7, name="sf")
    try:
        asyncdbo.run(layer, rank_input(rank, 4, 32))
    except ValueError as exc:
        return str(exc)
    return "no error"
