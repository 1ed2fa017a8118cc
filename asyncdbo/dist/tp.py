"""Tensor-parallel collectives (all-reduce, all-gather, reduce-scatter) issued through the DBO
stream backend, so that one ubatch's collective runs while another ubatch computes.

Legend (shape suffixes): T tokens of this ubatch, D hidden (or any feature width), P ranks in the
TP group, S = T / P rows of a sequence-parallel shard.

A dense decoder layer under TP ends its attention and its MLP with a row-parallel projection
whose partial sums every rank adds up: the same ping-pong as expert parallelism's dispatch and
combine. Each collective here is one yield point: the ubatch continues on the comm stream after
its compute (:func:`~asyncdbo.dbo.dbo_switch_to_comm_sync`, no yield), issues the collective,
hands it to :func:`~asyncdbo.dbo.dbo_submit`, then yields and comes back on the compute stream
after it (:func:`~asyncdbo.dbo.dbo_yield_and_switch_from_comm_to_compute`: on a host the ubatch
parks until gloo completes the work while the other ubatches compute). Outside a run every call
is synchronous: the serial step.

The per-ubatch process groups are :class:`~asyncdbo.dist.ep.EPComm`'s (one clone of the group per
ubatch slot, see :mod:`asyncdbo.dist.ep` for why): a TP group is "a group and its per-ubatch
clones" exactly as an EP group is, and a model with TP attention and EP experts over the same
ranks shares the clones (a ubatch issues both kinds in its program order on every rank).

**Exact mode.** gloo's ring all-reduce cuts the buffer into one chunk per rank and adds each chunk
in another rank order, and where the chunks fall depends on the buffer's size: with more than two
ranks a row's sum would depend on how many rows the call holds (a ubatch or the whole step). With
``exact=True`` the all-reduce is an all-gather and a sum in rank order, ``((x0 + x1) + x2) + ...``,
which gives a row the same bits whatever the call holds (and every rank the same bits); the
reduce-scatter likewise (on gloo always: its reduce-scatter work gives the host backend no future
to wait on, so it is an all-to-all and a rank-ordered sum there). With two ranks both orders give
``x0 + x1`` (addition commutes), but the exact path is taken all the same: one rule for every size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._core import get_ubatch
from ..dbo import dbo_submit, dbo_switch_to_comm_sync, dbo_yield_and_switch_from_comm_to_compute
from .ep import EPComm

__all__ = ["tp_all_gather", "tp_all_reduce", "tp_reduce_scatter"]


def _group(comm: EPComm) -> tuple[Any, bool]:
    """The group this ubatch issues on, and whether a DBO run is on."""
    ub = get_ubatch()
    return comm.group_for(None if ub is None else ub.id), ub is not None


async def _issue(work: Any, nbytes: int, what: str, in_run: bool) -> None:
    """Hand ``work`` (async_op=True) to the run and yield until it completed (module docstring)."""
    if not in_run:
        work.wait()
        return
    handle = dbo_submit(work, nbytes=nbytes, what=what)
    await dbo_yield_and_switch_from_comm_to_compute(f"{what}_done")
    await handle


def _gather_rows(x_TD: torch.Tensor, group: Any, size: int) -> tuple[torch.Tensor, Any]:
    """``[P, T, D]`` receive buffer of an all-gather of ``x_TD`` and its async work."""
    out_PTD = x_TD.new_empty((size, *x_TD.shape))
    flat = out_PTD.view(size * x_TD.shape[0], *x_TD.shape[1:])
    return out_PTD, dist.all_gather_single(flat, x_TD.contiguous(), group=group, async_op=True)


def _sum_in_rank_order(x_PTD: torch.Tensor) -> torch.Tensor:
    out_TD = x_PTD[0].clone()
    for p in range(1, x_PTD.shape[0]):
        out_TD += x_PTD[p]
    return out_TD


async def tp_all_reduce(x_TD: torch.Tensor, comm: EPComm, *, exact: bool = False, what: str = "all_reduce") -> torch.Tensor:
    """The sum of ``x_TD`` over the TP group (every rank gets the same bits), a yield point
    inside a DBO run. ``exact``: rank-ordered, batch-invariant (module docstring)."""
    if comm.size == 1:
        return x_TD
    group, in_run = _group(comm)
    nbytes = x_TD.numel() * x_TD.element_size()
    if in_run:
        await dbo_switch_to_comm_sync()
    if exact:
        out_PTD, work = _gather_rows(x_TD, group, comm.size)
        await _issue(work, nbytes * (comm.size - 1), what, in_run)
        return _sum_in_rank_order(out_PTD)
    out_TD = x_TD.contiguous().clone()
    ring = 2 * (comm.size - 1) * nbytes // comm.size  # what a ring all-reduce sends per rank
    await _issue(dist.all_reduce(out_TD, group=group, async_op=True), ring, what, in_run)
    return out_TD


async def tp_all_gather(x_TD: torch.Tensor, comm: EPComm, *, dim: int = 0, what: str = "all_gather") -> torch.Tensor:
    """Every rank's ``x_TD`` concatenated along ``dim`` in rank order (a yield point in a run)."""
    if comm.size == 1:
        return x_TD
    group, in_run = _group(comm)
    if in_run:
        await dbo_switch_to_comm_sync()
    out_PTD, work = _gather_rows(x_TD, group, comm.size)
    await _issue(work, x_TD.numel() * x_TD.element_size() * (comm.size - 1), what, in_run)
    return torch.cat(out_PTD.unbind(0), dim=dim)


async def tp_reduce_scatter(x_TD: torch.Tensor, comm: EPComm, *, exact: bool = False,
                            what: str = "reduce_scatter") -> torch.Tensor:
    """This rank's ``T / P`` rows of the sum of ``x_TD`` over the group (sequence parallelism:
    the rows of rank ``r`` are ``r * T / P`` onwards); ``T`` must divide by the group's size."""
    if comm.size == 1:
        return x_TD
    T, P = x_TD.shape[0], comm.size
    if T % P:
        raise ValueError(f"tp_reduce_scatter: {T} rows do not divide over {P} ranks; pad the rows to a multiple of {P}")
    group, in_run = _group(comm)
    nbytes = x_TD.numel() * x_TD.element_size()
    if in_run:
        await dbo_switch_to_comm_sync()
    x_PSD = x_TD.contiguous().view(P, T // P, *x_TD.shape[1:])
    # gloo's reduce-scatter work has no future (the host backend waits through one): there, as in
    # exact mode, every rank's block p goes to rank p, which adds them in rank order
    if exact or dist.get_backend(group) == "gloo":
        recv_PSD = torch.empty_like(x_PSD)
        work = dist.all_to_all_single(recv_PSD, x_PSD, group=group, async_op=True)
        await _issue(work, nbytes * (P - 1) // P, what, in_run)
        return _sum_in_rank_order(recv_PSD)
    out_SD = x_PSD.new_empty(x_PSD.shape[1:])
    await _issue(dist.reduce_scatter_single(out_SD, x_PSD.reshape(T, *x_TD.shape[1:]), group=group, async_op=True),
                 nbytes * (P - 1) // P, what, in_run)
    return out_SD
