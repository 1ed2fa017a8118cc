"""The DBO primitives, under vLLM's names, so porting a thread-DBO MoE layer is adding ``await``.

The yield and switch primitives are rows of :mod:`asyncdbo.dbo.table` (their kinds, in Python and
C, are :mod:`asyncdbo.dbo.kinds`), importable from here as before. Each yield/sync primitive
returns an awaitable; the ones that only change the current stream act at call time and may be
awaited or not. On the host backend a switch's wait may park the ubatch until its comm work
completes, while the other ubatches compute. This module holds the rest: queries, the comm
hand-off (:func:`dbo_submit`) and :func:`dbo_get_previous_event`.

Outside a DBO run every primitive is a no-op (``dbo_enabled()`` is False, yields return at once,
``dbo_current_ubatch_id()`` is 0, ``dbo_get_previous_event`` returns None), so model code runs
unchanged in a plain call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .._core import current_ubatch
from ..backends import CommHandle, DoneWork, StreamPolicy
from .awaits import check_unawaited
from .kinds import FAST as FAST, PURE as PURE  # by name: the C fast paths in use (or None), the Python references
from .state import Lane
from .table import *  # noqa: F403  (the yield and switch primitives, one row each)

__all__ = [
    "dbo_current_ubatch_id",
    "dbo_enabled",
    "dbo_get_previous_event",
    "dbo_num_ubatches",
    "dbo_stream_policy",
    "dbo_submit",
]

T = TypeVar("T")

_get_ubatch = current_ubatch.get


def dbo_enabled() -> bool:
    """True inside a DBO run (in this task's context only: runs in other tasks don't count)."""
    return _get_ubatch(None) is not None


def dbo_current_ubatch_id() -> int:
    """This ubatch's index in its run, or 0 outside a run (vLLM's convention)."""
    ub = _get_ubatch(None)
    return 0 if ub is None else ub.id


def dbo_num_ubatches() -> int:
    """Number of ubatches in this run, or 1 outside a run."""
    ub = _get_ubatch(None)
    return 1 if ub is None else len(ub.run.ubatches)


def dbo_stream_policy() -> StreamPolicy | None:
    """The run's stream policy (``"role"``: shared compute and comm streams, ordered by role
    switches; ``"ubatch"``: a stream per ubatch, ordered by explicit events), or None outside a
    run. Model code picks its ordering primitives by it (see asyncdbo.moe.layer)."""
    ub = _get_ubatch(None)
    if ub is None:
        return None
    policy: StreamPolicy = ub.run.ext.policy
    return policy


def dbo_get_previous_event(func: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """Run ``func`` with this ubatch's compute stream current and return its result (DeepEP's
    ``Buffer.capture`` taken here covers exactly this ubatch's compute). None outside a run."""
    ub = _get_ubatch(None)
    if ub is None:
        return None
    if ub.unawaited is not None:
        check_unawaited(ub)
    lane: Lane = ub.ext
    prev = lane.stream
    lane.set_stream(lane.streams["compute"])
    try:
        return func(*args, **kwargs)
    finally:
        lane.set_stream(prev)


def dbo_submit(work: Any, *, nbytes: int = 0, what: str = "comm", **backend_options: Any) -> CommHandle:
    """Hand an async ``torch.distributed`` work (``async_op=True``) to the run's stream backend.

    Returns a handle: ``await handle`` (or a later comm->compute switch) waits for it the way the
    backend needs: on a CPU host the ubatch parks until gloo completes the work while the others
    run; on CUDA/NPU the current stream waits for the collective and the CPU goes on at once.
    ``nbytes`` feeds the modeled link and the trace numbers; ``what`` names it in traces.
    ``backend_options`` go to the backend (the sim backend takes ``inputs``/``outputs`` tensors
    for its race checker). Outside a run the work is waited for at once (serial semantics).

    Inside a run, hand every async work to it before the ubatch next yields, parks or returns:
    the scheduler waits only for works it knows, so the output of one it does not know is read
    before it arrives. Debug mode fails such a run naming the collective's line; outside it,
    :func:`asyncdbo.ubatch_group` counts the collectives on the groups it hands out and the run
    warns (``RuntimeWarning``) when a ubatch issued more on gloo than it submitted."""
    ub = _get_ubatch(None)
    if ub is None:
        if work is not None:
            work.wait()
        return DoneWork(what, nbytes, work)
    if ub.unawaited is not None:
        check_unawaited(ub)
    lane: Lane = ub.ext
    lane.submitted += 1
    if ub.debug is not None:
        pending = ub.run.ext.unsubmitted
        if pending:
            pending.pop(id(work), None)
    handle: CommHandle = ub.run.ext.backend.submit(work, lane, nbytes=nbytes, what=what, **backend_options)
    return handle
