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

import logging
from datetime import timedelta
from typing import Any

from ._core import get_ubatch

__all__ = ["forget_group", "ubatch_group", "ubatch_groups"]

log = logging.getLogger("asyncdbo.groups")

# group_name of the base group -> its per-ubatch clones, in ubatch order
_CLONES: dict[str, list[Any]] = {}


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
            return base._get_backend(torch.device(device)).options._timeout  # type: ignore[no-any-return]
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
