"""One process-group clone per ubatch, so the ubatches' collectives never need a global order.

Collectives on one process group must be issued in the same order on every rank. Under DBO a
ubatch parked on its comm is skipped while the others run, and when its comm completes depends on
the network, so two ranks can reach the next collective in different ubatch orders: ubatch 0's
combine on one rank would then meet ubatch 1's combine on the other, and exchange the wrong data
(or hang). vLLM avoids this by keeping a strict CPU order; asyncdbo keeps overlap and removes the
hazard: every ubatch slot issues its collectives on its own clone of the group (same ranks). Within
one ubatch the program order is the same on every rank, and that is all gloo/NCCL need.

Creating a group is itself a collective, so the clones are made up front, on every rank, outside
any DBO run (:func:`ubatch_groups`), and looked up inside a run (:func:`ubatch_group`).
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .._core import get_ubatch

__all__ = ["destroy_process_groups", "forget_group", "on_destroy", "ubatch_group", "ubatch_groups"]

log = logging.getLogger("asyncdbo.dist.groups")

# group_name of the base group -> its per-ubatch clones, in ubatch order
_CLONES: dict[str, list[Any]] = {}
# Other caches that hold process groups (the EP comm cache), emptied by destroy_process_groups().
_FORGETTERS: list[Callable[[], None]] = []


def _base(group: Any) -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group before asking for ubatch groups")
    return dist.group.WORLD if group is None else group


def ubatch_groups(num_ubatches: int, group: Any = None) -> tuple[Any, ...]:
    """Make sure ``group`` has at least ``num_ubatches`` per-ubatch clones; return them.

    Call it on every rank of ``group``, in the same order, outside a DBO run (it creates process
    groups, which is a collective). Clones are cached, so calling it again is free."""
    import torch.distributed as dist

    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1 (got {num_ubatches})")
    if get_ubatch() is not None:
        raise RuntimeError(
            "ubatch_groups() creates process groups (a collective) and must run on every rank outside a DBO run; "
            "call it once at start-up, e.g. ubatch_groups(max_ubatches, ep_group)"
        )
    base = _base(group)
    clones = _CLONES.setdefault(base.group_name, [])
    if len(clones) < num_ubatches:
        ranks = dist.get_process_group_ranks(base)
        backend = dist.get_backend(base)
        timeout = _timeout(base)
        # A sub-group (one of several disjoint EP groups under DP) syncs only its own members,
        # so each such group makes its clones independently of the others.
        local = base is not dist.group.WORLD
        while len(clones) < num_ubatches:
            clones.append(dist.new_group(ranks, backend=backend, timeout=timeout, use_local_synchronization=local))
        log.debug("%d per-ubatch %s clones of group %s over ranks %s", len(clones), backend, base.group_name, ranks)
    return tuple(clones[:num_ubatches])


def forget_group(group: Any) -> None:
    """Drop the cached clones of ``group`` (call it before destroying the group: a later group
    may reuse its name)."""
    name = getattr(group, "group_name", None)
    if name is not None:
        _CLONES.pop(name, None)


def _timeout(base: Any) -> timedelta | None:
    """The base group's collective timeout, so a dead peer fails the clones as fast as it fails the
    base group (``new_group`` would otherwise use torch's 30-minute default)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(base) == "fake":  # the sim's fake world: nothing to time out
        return None

    for device in ("cpu", "cuda"):
        try:
            return base._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    log.warning("could not read the timeout of group %s; its per-ubatch clones use torch's default", base.group_name)
    return None


def ubatch_group(group: Any = None) -> Any:
    """The process group the running ubatch must issue its collectives on.

    Outside a DBO run this is ``group`` itself (serial code keeps using the base group); inside
    a run it is the running ubatch's clone, made earlier by :func:`ubatch_groups`."""
    ub = get_ubatch()
    base = _base(group)
    if ub is None:
        return base
    clones = _CLONES.get(base.group_name, [])
    if ub.id >= len(clones):
        raise RuntimeError(
            f"ubatch {ub.id} needs its own clone of process group {base.group_name!r}, but only {len(clones)} exist; "
            f"call asyncdbo.ubatch_groups({len(ub.run.ubatches)}, group) on every rank before the DBO run "
            "(making groups is a collective, so it cannot happen inside the run)"
        )
    return clones[ub.id]


def on_destroy(forget: Callable[[], None]) -> None:
    """Register ``forget()``, which drops a cache's references to process groups; called by
    :func:`destroy_process_groups` before it destroys them (the EP comm cache registers here)."""
    _FORGETTERS.append(forget)


def destroy_process_groups(*, barrier: bool = True) -> None:
    """Leave torch.distributed so that no gloo thread outlives the interpreter: the last call of a
    rank, instead of ``dist.destroy_process_group()``.

    Why ``destroy_process_group()`` alone is not enough (measured: rank 0 of the torchrun demo
    aborted with ``terminate called without an active exception`` in 4 of 105 runs beside a CPU
    hog; the core dump shows a gloo worker thread in ``~AsyncBarrierWork`` -> ``~AsyncAllgatherWork``
    -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``): for gloo it only
    unregisters the groups. Their worker threads stop when the last Python reference to the group
    object goes, and asyncdbo's caches (the per-ubatch clones, the EP comm cache) kept them until
    interpreter finalization. A worker thread that finishes releasing its last work late (a
    loaded machine) then needs the GIL to free a tensor while Python is finalizing; Python 3.11
    ends such a thread with ``pthread_exit``, whose forced unwind through a ``noexcept`` destructor
    calls ``std::terminate``. Dropping every reference here makes each group's destructor run now,
    with the GIL released, which joins its threads while they can still take the GIL.

    ``barrier``: first wait until every rank got here (a rank that tears its groups down while a
    peer still sends would fail the peer). Warns (``RuntimeWarning``) if a group is still
    referenced afterwards: something outside asyncdbo (a model attribute, a global) keeps it, and
    its threads would outlive the interpreter again."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        _CLONES.clear()
        return
    if get_ubatch() is not None:
        raise RuntimeError("destroy_process_groups() must run outside a DBO run (it destroys the groups the run uses)")
    from torch.distributed import distributed_c10d as c10d

    groups = {id(g): g for g in (*c10d._world.pg_map, *(g for clones in _CLONES.values() for g in clones))}
    alive = [weakref.ref(g) for g in groups.values()]
    del groups
    if barrier:
        dist.barrier()
    for forget in _FORGETTERS:
        forget()
    _CLONES.clear()
    dist.destroy_process_group()
    if any(r() is not None for r in alive):
        gc.collect()  # reference cycles (a model, a finished run) may still hold a group
    left = sum(r() is not None for r in alive)
    if left:
        import warnings

        warnings.warn(
            f"destroy_process_groups(): {left} of {len(alive)} process groups are still referenced after their "
            "destruction, so their gloo threads stay alive until interpreter exit (where they can abort the "
            "process); drop the objects that hold them (models, runners, groups in globals) before calling it",
            RuntimeWarning,
            stacklevel=2,
        )
