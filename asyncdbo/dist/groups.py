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

A run that fails or is cancelled half-way leaves collectives in flight on some clones and not on
others; the next collective on such a clone would pair with a stale one of the failed run. So
after a failed run every clone is replaced (:func:`renew_ubatch_groups`, which the next
``run_ubatches`` calls on every rank: :mod:`asyncdbo.dist.recovery`): look clones up when you issue
(``ubatch_group``), do not keep them.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .._core import get_ubatch
from .unsubmitted import note_handout

__all__ = [
    "clone_group",
    "current_clones",
    "destroy_process_groups",
    "forget_group",
    "on_destroy",
    "renew_ubatch_groups",
    "retire_groups",
    "ubatch_group",
    "ubatch_groups",
]

log = logging.getLogger("asyncdbo.dist.groups")



@dataclass(eq=False)
class _Clones:
    """The per-ubatch clones of one base group, and what it takes to make more of them."""

    ranks: list[int]
    backend: str
    timeout: timedelta | None
    local: bool  # a sub-group: only its members take part in making a clone
    groups: list[Any]


# group_name of the base group -> its per-ubatch clones, in ubatch order (made in this order)
_CLONES: dict[str, _Clones] = {}
# Threads that release replaced clones (a gloo group's destructor waits for its works in flight).
_RELEASERS: list[threading.Thread] = []
# Other caches that hold process groups (the EP comm cache), emptied by destroy_process_groups().
_FORGETTERS: list[Callable[[], None]] = []


def _base(group: Any) -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group before asking for ubatch groups")
    return dist.group.WORLD if group is None else group


def clone_group(group: Any = None) -> Any:
    """A new process group over the ranks of ``group`` (None: the default group), with its backend
    and collective timeout. A collective: every rank of ``group`` calls it, in the same order."""
    return _make_clone(_spec(_base(group)))


def _spec(base: Any) -> _Clones:
    import torch.distributed as dist

    # A sub-group (one of several disjoint EP groups under DP) syncs only its own members, so each
    # such group makes its clones independently of the others.
    return _Clones(ranks=dist.get_process_group_ranks(base), backend=dist.get_backend(base),
                   timeout=_timeout(base), local=base is not dist.group.WORLD, groups=[])


_NAMING = threading.Lock()
# Clones made over each set of ranks in this process, ever: the same count on every member, since
# making one is a collective over exactly those ranks (per-ubatch clones, renewals, clone_group).
_MADE: dict[tuple[int, ...], int] = {}


def _make_clone(spec: _Clones) -> Any:
    import torch.distributed as dist

    if not spec.local:  # named by torch's group counter, never reused
        with _NAMING:
            key = tuple(sorted(spec.ranks))
            _MADE[key] = _MADE.get(key, 0) + 1
        return dist.new_group(spec.ranks, backend=spec.backend, timeout=spec.timeout)
    # torch (2.13) names a group made with local synchronization by a hash of its ranks and the
    # number of live groups. A renewal makes new clones while the old ones live, then destroys
    # those, so the next renewal's hash names equal the live clones' ("The specified group name
    # has already been created"); and a name reused after a destroy would rendezvous through the
    # old group's keys in the store. So each clone's name also carries the count of clones made
    # over these ranks in this process, which every member has alike: unique for the process's life.
    from torch.distributed import distributed_c10d as c10d

    with _NAMING:  # one patch at a time, and the count with it
        hashed = getattr(c10d, "_process_group_name", None)
        if hashed is None:  # a torch without it names groups its own way
            return dist.new_group(spec.ranks, backend=spec.backend, timeout=spec.timeout,
                                  use_local_synchronization=True)
        key = tuple(sorted(spec.ranks))  # torch hashes the sorted ranks
        made = _MADE[key] = _MADE.get(key, 0) + 1
        suffix = f"-asyncdbo-clone-{made}"

        def unique(ranks: Any, use_hashed_name: bool) -> Any:
            return hashed(ranks, use_hashed_name) + suffix

        c10d._process_group_name = unique
        try:
            return dist.new_group(spec.ranks, backend=spec.backend, timeout=spec.timeout, use_local_synchronization=True)
        finally:
            c10d._process_group_name = hashed


def ubatch_groups(num_ubatches: int, group: Any = None) -> tuple[Any, ...]:
    """Make sure ``group`` has at least ``num_ubatches`` per-ubatch clones; return them.

    Call it on every rank of ``group``, in the same order, outside a DBO run (it creates process
    groups, which is a collective). Clones are cached, so calling it again is free. The tuple is
    a snapshot: a failed step replaces every clone (see :func:`renew_ubatch_groups`)."""
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1 (got {num_ubatches})")
    if get_ubatch() is not None:
        raise RuntimeError(
            "ubatch_groups() creates process groups (a collective) and must run on every rank outside a DBO run; "
            "call it once at start-up, e.g. ubatch_groups(max_ubatches, ep_group)"
        )
    base = _base(group)
    clones = _CLONES.get(base.group_name)
    if clones is None:
        clones = _CLONES[base.group_name] = _spec(base)
    if len(clones.groups) < num_ubatches:
        _agree_on_count(clones, base.group_name, num_ubatches)
        while len(clones.groups) < num_ubatches:
            clones.groups.append(_make_clone(clones))
        log.debug("%d per-ubatch %s clones of group %s over ranks %s", len(clones.groups), clones.backend,
                  base.group_name, clones.ranks)
    return tuple(clones.groups[:num_ubatches])


def _agree_on_count(clones: _Clones, name: str, num_ubatches: int) -> None:
    """Before making clones (a collective), check through the rendezvous store that every member of
    the group asks for as many: ranks built with different ``max_ubatches`` would otherwise wait
    inside ``new_group`` until the group timeout, with no cause given. Costs one store write and a
    read per member, at set-up only. Raises ValueError naming each rank's count, or RuntimeError
    naming the ranks that did not ask at all within the group timeout."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if dist.get_backend() == "fake":  # the sim's fake world has one process and no real store
        return
    store = c10d._get_default_store()
    ranks = sorted(clones.ranks)
    # The group's name and the clones made over its ranks so far (the same number on every member:
    # each clone was made by all of them) name one round of making; a group made later has another
    # name, so a round that failed leaves no key a later one reads.
    prefix = f"asyncdbo/ubatch-groups/{name}/{_MADE.get(tuple(ranks), 0)}/"
    store.set(prefix + str(dist.get_rank()), str(num_ubatches))
    keys = [prefix + str(r) for r in ranks]
    try:
        if clones.timeout is None:
            store.wait(keys)
        else:
            store.wait(keys, clones.timeout)
    except Exception:  # the store's own timeout error (its type varies across torch versions)
        missing = [r for r in ranks if not store.check([prefix + str(r)])]
        waited = f"{clones.timeout.total_seconds():g} s" if clones.timeout is not None else "the store timeout"
        raise RuntimeError(
            f"ubatch_groups({num_ubatches}) on process group {name!r}: rank(s) {missing} did not ask for per-ubatch "
            f"clones of it within {waited} (the group timeout), so they would never take part in making them. Every "
            "rank of the group must call ubatch_groups(n, group) with the same n at the same point (build every "
            "rank's model with the same max_ubatches)"
        ) from None
    counts = [int(store.get(k)) for k in keys]
    if len(set(counts)) > 1:
        by_rank = ", ".join(f"rank {r}: {n}" for r, n in zip(ranks, counts))
        raise ValueError(
            f"ranks ask for different numbers of per-ubatch clones of process group {name!r} ({by_rank}); making "
            "a clone is a collective, so the ranks that ask for more would wait for the others until the group "
            "timeout. Build every rank's model with the same max_ubatches (call ubatch_groups(n, group) with one n "
            "on every rank)"
        )


def forget_group(group: Any) -> None:
    """Drop the cached clones of ``group`` (call it before destroying the group: a later group
    may reuse its name)."""
    name = getattr(group, "group_name", None)
    if name is not None:
        _CLONES.pop(name, None)


def current_clones(group: Any = None) -> list[Any]:
    """The current per-ubatch clones of ``group`` (empty if none were made); a live list."""
    base = _base(group)
    clones = _CLONES.get(base.group_name)
    return clones.groups if clones is not None else []


def renew_ubatch_groups() -> int:
    """Replace every per-ubatch clone of every group with a new one; return how many.

    A collective over every group that has clones: all their ranks call it together, outside any
    DBO run (the next ``run_ubatches`` does, after a failed run: :mod:`asyncdbo.dist.recovery`). The new groups start with
    no collective in flight, so nothing of the failed step can pair with the next one. The old
    ones are aborted (NCCL ends their kernels in flight; for gloo ``abort()`` is a no-op in torch
    2.13), unregistered, and released by a background thread: a gloo group's destructor waits for
    its works in flight, and one whose peer has not closed its side yet would wait up to the
    group timeout. :func:`destroy_process_groups` waits for these threads."""
    import torch.distributed as dist

    if get_ubatch() is not None:
        raise RuntimeError("renew_ubatch_groups() makes process groups (a collective); call it outside a DBO run")
    old: list[Any] = []
    for clones in _CLONES.values():
        fresh = [_make_clone(clones) for _ in clones.groups]
        old += clones.groups
        clones.groups[:] = fresh
    count = len(old)
    retire_groups(old)
    log.debug("replaced %d per-ubatch groups", count)
    return count


def retire_groups(old: list[Any]) -> None:
    """Abort, unregister and release (in a background thread) the groups of ``old``, a list only
    the caller holds, emptied here: groups replaced after a failure, which may have work in flight
    (see :func:`renew_ubatch_groups`)."""
    import torch.distributed as dist

    for i in range(len(old)):  # by index: a loop variable would keep the last group alive here
        try:
            old[i].abort()
        except RuntimeError as exc:  # an abort must never stop the renewal
            log.debug("abort of a replaced group failed: %s", exc)
        dist.destroy_process_group(old[i])
    _release_later(old)


def _release_later(groups: list[Any]) -> None:
    """Drop the last references to ``groups`` in a background thread (the caller's must be gone:
    pass the only list that holds them)."""
    _RELEASERS[:] = [t for t in _RELEASERS if t.is_alive()]
    if groups:
        releaser = threading.Thread(target=groups.clear, name="asyncdbo-release-groups", daemon=True)
        releaser.start()
        _RELEASERS.append(releaser)


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
    a run it is the running ubatch's clone, made earlier by :func:`ubatch_groups`. Hand every
    work of a collective issued on it to :func:`asyncdbo.dbo_submit`: a run whose ubatch issued
    more collectives on it (gloo) than it submitted warns when it ends
    (:mod:`asyncdbo.dist.unsubmitted`)."""
    ub = get_ubatch()
    base = _base(group)
    if ub is None:
        return base
    clones = current_clones(base)
    if ub.id >= len(clones):
        raise RuntimeError(
            f"ubatch {ub.id} needs its own clone of process group {base.group_name!r}, but only {len(clones)} exist; "
            f"call asyncdbo.ubatch_groups({len(ub.run.ubatches)}, group) on every rank before the DBO run "
            "(making groups is a collective, so it cannot happen inside the run)"
        )
    clone = clones[ub.id]
    if _CLONES[base.group_name].backend == "gloo":  # count its collectives against dbo_submit
        note_handout(ub, clone)
    return clone


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
        _join_releasers()
        return
    if get_ubatch() is not None:
        raise RuntimeError("destroy_process_groups() must run outside a DBO run (it destroys the groups the run uses)")
    from torch.distributed import distributed_c10d as c10d

    groups = {id(g): g for g in (*c10d._world.pg_map, *(g for clones in _CLONES.values() for g in clones.groups))}
    alive = [weakref.ref(g) for g in groups.values()]
    del groups
    if barrier:
        dist.barrier()
    for forget in _FORGETTERS:
        forget()
    _CLONES.clear()
    dist.destroy_process_group()
    _join_releasers()
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


def _join_releasers() -> None:
    """Wait for the threads that release replaced groups: left running into interpreter exit, a
    gloo thread of theirs could abort the process (see :func:`destroy_process_groups`). Each waits
    at most for its groups' works in flight, which the group timeout bounds."""
    while _RELEASERS:
        thread = _RELEASERS.pop()
        thread.join()
