"""Collectives on per-ubatch groups that never reached ``dbo_submit``, counted outside debug mode.

The scheduler waits only for the comm works it was handed (:func:`asyncdbo.dbo_submit`): a ubatch
that issues ``dist.all_to_all_single(..., group=ubatch_group(), async_op=True)`` and drops the
work reads the output before it arrives. Debug mode catches each such collective by its line
(:class:`asyncdbo.dbo.debug.CommGuard`, a torch dispatch mode that sees every op: too slow to
leave on). Outside debug mode this module counts instead, at a cost only to the runs that call
:func:`asyncdbo.ubatch_group`:

* the first time :func:`~asyncdbo.ubatch_group` hands a ubatch a gloo clone in a run, it notes
  the clone's sequence number (gloo counts every collective issued on a group) and the number of
  works the ubatch has submitted so far;
* when the run ends, a ubatch that issued more collectives on its clones since then than it
  handed to ``dbo_submit`` gets a ``RuntimeWarning`` (or, if the run failed, a note on its error)
  naming the line that asked for the group.

A synchronous collective counts as not submitted too: on gloo it blocks the one thread every
ubatch runs on until the peers answer, which is worth a warning of its own. On NCCL a
synchronous collective is ordered on the current stream and blocks nothing, so NCCL groups are
not counted (debug mode still checks them).
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

from .._core import UBatch
from ..dbo.state import Lane, RunState

__all__ = ["note_handout"]


@dataclass(eq=False)
class _Handout:
    """A clone handed to a ubatch: its sequence number and the ubatch's submitted count then."""

    ub: int
    lane: Lane
    group: Any
    seq0: int
    submitted0: int
    site: str


@dataclass(eq=False)
class _Account:
    """One run's handouts, keyed by (ubatch id, group)."""

    handouts: dict[tuple[int, int], _Handout] = field(default_factory=dict)

    def finish(self, exc: BaseException | None) -> None:
        for message in self.unsubmitted():
            if exc is None:
                # finish <- dbo.run._finish <- _run <- run_ubatches <- the caller
                warnings.warn(message, RuntimeWarning, stacklevel=5)
            elif isinstance(exc, Exception):
                exc.add_note(f"asyncdbo: {message}")
        self.handouts.clear()

    def unsubmitted(self) -> list[str]:
        """One message per ubatch that issued more collectives on its clones than it submitted."""
        by_ub: dict[int, list[_Handout]] = {}
        for h in self.handouts.values():
            by_ub.setdefault(h.ub, []).append(h)
        out = []
        for ub_id, hs in sorted(by_ub.items()):
            try:
                issued = sum(h.group._get_sequence_number_for_group() - h.seq0 for h in hs)
            except Exception:  # noqa: BLE001 - a group torn down by a failure: nothing to count
                continue
            submitted = hs[0].lane.submitted - min(h.submitted0 for h in hs)
            if issued > submitted:
                sites = ", ".join(sorted({h.site for h in hs}))
                out.append(
                    f"ubatch {ub_id} issued {issued} collective(s) on the per-ubatch group(s) asyncdbo.ubatch_group() "
                    f"handed it at {sites}, but handed only {submitted} work(s) to dbo_submit. The scheduler waits "
                    "only for submitted works: an async one (async_op=True) it does not know is read before it "
                    "arrives (wrong numbers), and a synchronous one blocks every ubatch on this thread. Pass each "
                    "work to asyncdbo.dbo_submit(work, ...) right after issuing it; run_ubatches(..., debug=True) "
                    "names the line of each collective it was not handed."
                )
        return out


def note_handout(ub: UBatch, group: Any) -> None:
    """Count the collectives ``ub`` issues on ``group`` from now to the end of its run (see the
    module docstring); called by :func:`asyncdbo.ubatch_group` inside a run."""
    if ub.debug is not None:
        return  # debug mode checks every async collective itself, by its line
    state = ub.run.ext
    if not isinstance(state, RunState):
        return  # a bare kernel run (asyncdbo.lowlevel): no dbo_submit to count against
    account = state.comm_account
    key = (ub.id, id(group))
    if account is not None and key in account.handouts:
        return
    import torch.distributed as dist

    if dist.get_backend(group) != "gloo":
        return
    if account is None:
        account = state.comm_account = _Account()
        if state.on_finish is None:
            state.on_finish = []
        state.on_finish.append(account.finish)
    lane: Lane = ub.ext
    caller = sys._getframe(2)  # note_handout <- ubatch_group <- the user's line
    account.handouts[key] = _Handout(ub.id, lane, group, group._get_sequence_number_for_group(), lane.submitted,
                                     f"{caller.f_code.co_filename}:{caller.f_lineno}")
