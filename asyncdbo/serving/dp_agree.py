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
own, and every rank replaces that clone at its first agreement after a failure notice of the
current recovery epoch: the notice is in the store before any rank learns of the failure, and the
epoch moves on only in the runner's next run, after that agreement.
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
        self._epoch = -1  # the recovery epoch whose notice the clone was renewed for

    def _current(self) -> Any:
        sync = self.sync
        if self._clone is None:
            self._clone = clone_group(self.group)
            self._epoch = -1 if sync is None else sync.epoch
        if sync is not None and sync.epoch != self._epoch and sync.run.has_notice():
            old = [self._clone]  # may hold an all-reduce a failed peer never joined
            self._clone = clone_group(self.group)  # every rank, at the same agreement
            self._epoch = sync.epoch
            retire_groups(old)
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
            await asyncio.sleep(wait)
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
