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
from functools import partial
from types import CodeType
from typing import Any

from .._core import UBatch
from ..dbo.state import Lane, RunState

__all__ = ["note_handout"]


# A clone handed to a ubatch in a run: the ubatch's lane, the clone, its sequence number and the
# lane's submitted count then, and the code and line that asked for it (formatted for a warning only).
_Handout = tuple[Lane, Any, int, int, CodeType, int]


def _finish(handouts: dict[int, _Handout], exc: BaseException | None) -> None:
    """The end of a run that handed out clones: warn (or note on ``exc``) per ubatch that issued
    more collectives on them than it submitted."""
    messages = unsubmitted(handouts)
    handouts.clear()  # it holds the lanes, which hold the run: no cycle outlives the run
    for message in messages:
        if exc is None:
            # _finish <- dbo.run._finish <- _run <- run_ubatches <- the caller
            warnings.warn(message, RuntimeWarning, stacklevel=5)
        elif isinstance(exc, Exception):
            exc.add_note(f"asyncdbo: {message}")


def unsubmitted(handouts: dict[int, _Handout]) -> list[str]:
    """One message per ubatch that issued more collectives on its clones than it submitted."""
    counts: dict[int, list[Any]] = {}  # ub id -> [lane, issued, submitted count at the first handout, sites]
    for lane, group, seq0, submitted0, code, lineno in handouts.values():
        try:
            issued = group._get_sequence_number_for_group() - seq0
        except Exception:  # noqa: BLE001 - a group torn down by a failure: nothing to count
            continue
        c = counts.get(lane.ub.id)
        if c is None:
            counts[lane.ub.id] = [lane, issued, submitted0, [(code, lineno)]]
        else:
            c[1] += issued
            c[2] = min(c[2], submitted0)
            c[3].append((code, lineno))
    out = []
    for ub_id, (lane, issued, submitted0, sites) in sorted(counts.items()):
        submitted = lane.submitted - submitted0
        if issued > submitted:
            where = ", ".join(sorted({f"{code.co_filename}:{lineno}" for code, lineno in sites}))
            out.append(
                f"ubatch {ub_id} issued {issued} collective(s) on the per-ubatch group(s) asyncdbo.ubatch_group() "
                f"handed it at {where}, but handed only {submitted} work(s) to dbo_submit. The scheduler waits "
                "only for submitted works: an async one (async_op=True) it does not know is read before it "
                "arrives (wrong numbers), and a synchronous one blocks every ubatch on this thread. Pass each "
                "work to asyncdbo.dbo_submit(work, ...) right after issuing it; run_ubatches(..., debug=True) "
                "names the line of each collective it was not handed."
            )
    return out


def note_handout(ub: UBatch, group: Any) -> None:
    """Count the collectives ``ub`` issues on the gloo group ``group`` from now to the end of its
    run (see the module docstring); called by :func:`asyncdbo.ubatch_group` inside a run.

    Two calls into torch per ubatch and clone and run (the sequence number here and at the end),
    nothing per yield: ``benchmarks/results/unsubmitted_comm_cpu-2c_2026-12-01.md``."""
    if ub.debug is not None:
        return  # debug mode checks every async collective itself, by its line
    state = ub.run.ext
    if not isinstance(state, RunState):
        return  # a bare kernel run (asyncdbo.lowlevel): no dbo_submit to count against
    handouts = state.comm_account
    key = id(group)  # a clone serves one ubatch slot
    if handouts is None:
        handouts = state.comm_account = {}
        if state.on_finish is None:
            state.on_finish = []
        state.on_finish.append(partial(_finish, handouts))
    elif key in handouts:
        return
    lane: Lane = ub.ext
    caller = sys._getframe(2)  # note_handout <- ubatch_group <- the user's line
    handouts[key] = (lane, group, group._get_sequence_number_for_group(), lane.submitted, caller.f_code, caller.f_lineno)
