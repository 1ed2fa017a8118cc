"""The engine's agreement across the DP group: one small all-reduce (MAX) that no failure can
leave a peer waiting in.

Every rank joins every agreement, whatever failed on it (a failure is a value it contributes, not
a missing rank), so a rank that failed while admitting, running or sampling is named to its peers
in the same agreement. A rank that cannot join (its task was cancelled, it stopped or hung) has
posted a failure notice first where it could (:mod:`asyncdbo.dist.recovery`); the others wait for
the all-reduce without blocking the event loop and read that notice every
:data:`~asyncdbo.dist.recovery.POLL_S` seconds, so they raise
:class:`~asyncdbo.dist.StepAborted` naming it instead of waiting for the group's timeout.

An all-reduce that a rank left unfinished would pair with the next one a peer issues (gloo pairs
collectives by their sequence number), so the agreements run on a clone of the DP group of their
own, and at the start of the step after a failed one every rank renews that clone with the
per-ubatch groups and starts the next recovery epoch (:meth:`DPAgreement.recover`): from then on a
notice read while waiting for an agreement can only be a new failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from ..dist.groups import clone_group, retire_groups
from ..dist.recovery import POLL_S, StepAborted, StepSync

__all__ = ["DPAgreement"]

#: The first waits between two looks at an unfinished all-reduce, in seconds: a loopback gloo
#: all-reduce of a few ints ends within them, so the event loop turns without adding a poll's
#: worth of latency to every step; the wait doubles up to the cap.
_FIRST_WAIT_S, _MAX_WAIT_S = 1e-5, 1e-3


class DPAgreement:
    """``await agree(values)``: the elementwise MAX of ``values`` over ``group``'s ranks (the
    values themselves without a group of more than one rank). ``sync``: the runner's recovery
    state (None: no notices to read, no clone renewal)."""

    def __init__(self, group: Any, sync: StepSync | None, device: torch.device | str | None) -> None:
        self.group = group
        self.sync = sync
        self.device = device or "cpu"
        self.world = 1 if group is None else torch.distributed.get_world_size(group)
        self._clone: Any = None
        self._renew = False  # the last step raised: renew before the next agreement
        self._deferred: BaseException | None = None  # a cancellation that came during an agreement

    def raise_deferred(self, instead_of: BaseException | None = None) -> None:
        """Raise the cancellation that came during an agreement (at the step's end), if one did."""
        exc, self._deferred = self._deferred, None
        if exc is not None:
            raise exc from instead_of

    def failed(self) -> None:
        """This rank's step raised (its own failure, a peer's named in an agreement or by its
        notice, or a cancellation): the next step renews first (:meth:`recover`)."""
        self._renew = True

    def recover(self) -> None:
        """Before the first agreement of the step after a failed one: renew every per-ubatch
        group and this clone and start the next recovery epoch. Every rank's step raised at the
        same agreement (or, for a stopped rank, where it stopped, its peers at their next read of
        its notice), so every rank renews at the same step; after it, a notice read while waiting
        is a new failure. Not decided from the store: a peer that is ahead may already have posted
        a failure of the step this rank is only starting."""
        if not self._renew:
            return
        self._renew = False
        sync = self.sync
        if sync is None or self._clone is None:
            return
        sync.renew()
        old = [self._clone]  # may hold an all-reduce a stopped peer never joined
        self._clone = clone_group(self.group)
        retire_groups(old)

    def _current(self) -> Any:
        if self._clone is None:
            self._clone = clone_group(self.group)
        return self._clone

    def post(self, exc: BaseException) -> None:
        """Tell the peers this rank failed (before contributing the failure to an agreement)."""
        if self.sync is not None:
            self.sync.post_failure(exc)

    async def agree(self, values: Sequence[int]) -> list[int]:
        if self.world == 1:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        work = torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self._current(),
                                            async_op=True)
        wait, since_poll = _FIRST_WAIT_S, 0.0
        while not work.is_completed():
            try:
                await asyncio.sleep(wait)
            except asyncio.CancelledError as exc:  # the peers wait for this all-reduce too: end it first
                self._deferred = exc
            since_poll += wait
            wait = min(wait * 2, _MAX_WAIT_S)
            if since_poll >= POLL_S and self.sync is not None:
                since_poll = 0.0
                aborted = self.sync.peer_failure()
                if aborted is not None:
                    raise aborted
        work.wait()  # a collective's own error (a closed connection) is raised here
        return [int(v) for v in t.tolist()]

    def failed_rank(self, flag: int) -> int | None:
        """The lowest failing rank of an agreed failure flag (see :meth:`flag`), or None."""
        return None if flag == 0 else self.world - flag

    def flag(self, rank_failed: bool) -> int:
        """This rank's failure flag: under MAX the lowest failing rank wins (0: none failed)."""
        if not rank_failed:
            return 0
        rank = torch.distributed.get_rank(self.group) if self.world > 1 else 0
        return self.world - rank

    def aborted(self, rank: int) -> StepAborted:
        """The error a rank raises when peer ``rank`` failed the step: the notice's reason where
        there is one."""
        found = self.sync.peer_failure() if self.sync is not None else None
        return found if found is not None else StepAborted(rank, "failed in the engine's step")
