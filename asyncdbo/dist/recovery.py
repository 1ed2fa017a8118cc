"""Step recovery: after a step fails or is cancelled on any rank, at any point, every rank can run
the next one.

Why a failed step poisons the next one: gloo pairs the collectives of a group by their sequence
number on that group. A step cancelled on rank 0 after its third all-to-all on a per-ubatch group
and on rank 1 after its fifth leaves rank 1's fourth and fifth in flight; rank 0's next step issues
its fourth there, which receives rank 1's stale data, and gloo's transport thread aborts the
process ("Received data size doesn't match expected size"; reproduced with two ranks cancelling a
step at different yields: exit -6 at the next step).

What torch offers does not help on gloo (torch 2.13, measured with two ranks): ``abort()`` of a
gloo group is a no-op (a pending all-to-all on the aborting rank and on its peer kept waiting until
the group timeout, and the group stayed usable), and ``shrink_group`` needs a backend that supports
shrinking, which gloo does not (and drops ranks, where every rank is still alive here). So the
groups are replaced instead, with an agreement on when:

1. Every step's DP vote (:func:`asyncdbo.plan.agree_across_dp`) runs on a clone of the DP group
   that only votes (:attr:`StepSync.group`), so its sequence stays in step on every rank: a vote is
   synchronous and cannot be left half-done.
2. A rank whose step fails after its vote, by an exception, a cancellation, or a peer's failure,
   posts a notice in the rendezvous store (the first poster names the failing rank) and remembers
   that it must recover (:meth:`StepSync.post_failure`).
3. A rank parked in a step polls the notice every :data:`POLL_S` seconds while it waits (nothing
   while it computes), cancels its run on one and raises :class:`StepAborted` naming the rank.
4. At its next step, a rank that must recover votes *recover* instead of a plan. Every rank of that
   vote, the recovering ones and any that had finished the failed step and were voting on the next,
   replaces every per-ubatch clone (:func:`asyncdbo.dist.renew_ubatch_groups`), so the next step
   starts on groups with nothing in flight; the ranks that voted a plan vote again.

:class:`asyncdbo.serving.DBORunner` runs this protocol, so after a failed step there is nothing
to do but call ``step()`` again on every rank. A rank that died cannot be recovered this way (its
peers' collectives fail with a closed connection or time out): restart every rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .groups import _base, clone_group, on_destroy, renew_ubatch_groups

__all__ = ["POLL_S", "StepAborted", "StepSync", "roll_call", "step_sync"]

log = logging.getLogger("asyncdbo.recovery")

#: Seconds between two looks at the failure notice while a step waits for comm.
POLL_S = 0.05

_SYNCS: dict[str, StepSync] = {}
on_destroy(_SYNCS.clear)


class StepAborted(RuntimeError):
    """This rank's step was ended because rank ``rank`` failed the same step (``reason``: its
    exception line, or ``cancelled``). Call ``step()`` again: the ranks recover first."""

    def __init__(self, rank: int, reason: str) -> None:
        self.rank = rank
        self.reason = reason
        super().__init__(f"step aborted: rank {rank} failed it ({reason}); the next step recovers on every rank")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    if isinstance(exc, StepAborted):
        return f"aborted after rank {exc.rank} failed"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class StepSync:
    """Step recovery state of one DP group on this rank; get it with :func:`step_sync`.

    ``group``: the clone of the DP group that carries the step votes. ``epoch``: recoveries so far
    (the same on every rank). ``failure``: why this rank must recover before its next step, or
    None."""

    def __init__(self, base: Any) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self.group = clone_group(base)
        self.rank = dist.get_rank()
        self.epoch = 0
        self.failure: str | None = None
        self._store = c10d._get_default_store()

    @property
    def must_recover(self) -> bool:
        return self.failure is not None

    def _key(self) -> str:
        return f"asyncdbo/step-failed/{self.group.group_name}/{self.epoch}"

    def post_failure(self, exc: BaseException) -> None:
        """This rank's step failed after its vote: remember to recover, and tell the other ranks
        (the first rank to post in an epoch is the one they name)."""
        if self.failure is None:
            self.failure = _describe(exc)
        try:
            self._store.compare_set(self._key(), "", f"{self.rank}:{self.failure}")
        except Exception as post_exc:  # a store that is gone: the peers fail by their own timeouts
            log.warning("could not post the failed step to the store: %s", post_exc)

    def peer_failure(self) -> StepAborted | None:
        """A :class:`StepAborted` for the rank that posted a failure in this epoch, if another did."""
        key = self._key()
        if not self._store.check([key]):
            return None
        rank, _, reason = self._store.get(key).decode().partition(":")
        return None if int(rank) == self.rank else StepAborted(int(rank), reason)

    async def watch(self, run: asyncio.Future[Any]) -> StepAborted | None:
        """Poll the notice until a peer posts one, then cancel ``run`` and return it."""
        while True:
            await asyncio.sleep(POLL_S)
            aborted = self.peer_failure()
            if aborted is not None:
                run.cancel()
                return aborted

    def renew(self, ranks: tuple[int, ...]) -> None:
        """A vote asked to recover (``ranks`` voted recover): replace every per-ubatch group."""
        count = renew_ubatch_groups()
        log.info("recovered from a failed step (ranks %s voted recover): %d per-ubatch groups replaced, epoch %d",
                 list(ranks), count, self.epoch + 1)
        self.epoch += 1
        self.failure = None


def step_sync(group: Any = None) -> StepSync | None:
    """The :class:`StepSync` of DP group ``group`` (None: the default group), made on first use
    (a collective: every rank of the group, in the same order, outside a DBO run); None without an
    initialised process group of more than one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    base = _base(group)
    if dist.get_world_size(base) == 1:
        return None
    sync = _SYNCS.get(base.group_name)
    if sync is None:
        sync = _SYNCS[base.group_name] = StepSync(base)
    return sync


def roll_call(tag: str, wait_s: float) -> list[int] | None:
    """Check in under ``tag`` in the rendezvous store and wait up to ``wait_s`` seconds for every
    rank of the default group to do the same; return the ranks that did not (a stopped, hung or
    dead rank never does), or None if the store cannot be reached.

    For a failure path: every rank that fails calls it with the same ``tag``, so the survivors of a
    silent peer name it instead of the peer they happened to be waiting on."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        store = c10d._get_default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        store.set(f"asyncdbo/roll-call/{tag}/{rank}", "here")
        deadline = time.monotonic() + wait_s
        missing = [r for r in range(world) if r != rank]
        while True:
            missing = [r for r in missing if not store.check([f"asyncdbo/roll-call/{tag}/{r}"])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(POLL_S)
    except Exception as exc:  # the store's host is gone too
        log.warning("roll call %r failed: %s", tag, exc)
        return None


StepAborted.__module__ = "asyncdbo.dist"  # tracebacks print the public path, not this private module
