"""The DBO primitives, under vLLM's names, so porting a thread-DBO MoE layer is adding ``await``.

Each yield/sync primitive returns an awaitable; the ones that only change the current stream act
at call time and may be awaited or not. Ordering follows vLLM exactly: a ubatch records its
done-event on the stream it leaves *before* it yields, and the stream it enters waits on that
event *after* it resumes. On the host backend such a wait may park the ubatch until its comm work
completes, while the other ubatches compute.

Outside a DBO run every primitive is a no-op (``dbo_enabled()`` is False, yields return at once,
``dbo_current_ubatch_id()`` is 0, ``dbo_get_previous_event`` returns None), so model code runs
unchanged in a plain call.
"""

from __future__ import annotations

import types
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

from .._core import SWITCH, Signal, UBatch, WrongStreamError, current_ubatch, load_extension, switch
from ..backends import COMPLETED, CommHandle, DoneWork, Role, StreamPolicy
from .awaits import Unawaited, _site, check_unawaited, made_at, mark_unawaited, marks
from .state import Lane

__all__ = [
    "dbo_current_ubatch_id",
    "dbo_enabled",
    "dbo_get_previous_event",
    "dbo_num_ubatches",
    "dbo_stream_policy",
    "dbo_submit",
    "dbo_switch_to_comm",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute",
    "dbo_switch_to_compute_sync",
    "dbo_yield",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_yield_and_switch_from_compute_to_comm",
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


def dbo_yield(tag: str = "yield") -> Awaitable[None]:
    """``await dbo_yield(tag)``: hand the CPU to the next ubatch; come back after every other
    runnable ubatch had a turn. ``tag`` names the yield point in traces, stack dumps and the
    yield-discipline checker. Outside a run it returns at once.

    The hottest path in asyncdbo: a plain call that marks the ubatch (the missing-await check,
    :mod:`asyncdbo.dbo.awaits`) and returns the kernel's switch."""
    ub = _get_ubatch(None)
    if ub is None:
        return COMPLETED
    if ub.unawaited is not None or ub.debug is not None:
        _mark_yield(ub, tag)
    else:
        ub.unawaited = tag
    ub.unawaited_at = made_at(1)
    ub.tag = tag
    return switch(ub)


def _mark_yield(ub: UBatch, tag: str) -> None:
    if ub.unawaited is not None:
        check_unawaited(ub)
    ub.unawaited = tag if ub.debug is None else Unawaited("dbo_yield", tag, hazard=False, site=_site(3))


def _other(role: Role) -> Role:
    return "comm" if role == "compute" else "compute"


def _check_role(ub: UBatch, lane: Lane, expected: Role, name: str) -> None:
    if lane.role != expected:
        raise WrongStreamError(
            f"{name}() called in ubatch {ub.id} while it is on the {lane.role} stream; it must be on the "
            f"{expected} stream (last yield point {ub.tag!r}). Check the order of switches in this layer."
        )


@types.coroutine
def _yield_and_switch(ub: UBatch, lane: Lane, tag: str, src: Role, dst: Role) -> Generator[Any, Any, None]:
    ub.unawaited = None
    event = lane.events[src]  # None: a synchronous role, nothing to record or wait on
    if event is not None:
        lane.record(event, lane.streams[src])  # before the yield: covers only this ubatch's work
    ub.tag = tag
    yield SWITCH  # trap(SWITCH) inlined: one generator frame less on every resume
    lane.role = dst
    lane.stream = ub.resume_with = stream = lane.streams[dst]  # lane.set_stream, inlined
    if lane.install is not None:
        lane.install(stream)
    if event is not None:
        signal = lane.wait(stream, event)  # after the resume
        if signal is not None:
            yield from signal.__await__()


@types.coroutine
def _then_wait(ub: UBatch, signal: Signal | None) -> Generator[Any, Any, None]:
    ub.unawaited = None
    if signal is not None:
        yield from signal.__await__()


# Outside debug mode a primitive's missing-await mark is shared by every call with its tag
# (asyncdbo.dbo.awaits.Marks): the hot path is one lookup in a plain dict.
_TO_COMM_MARKS = marks("dbo_yield_and_switch_from_compute_to_comm")
_TO_COMPUTE_MARKS = marks("dbo_yield_and_switch_from_comm_to_compute")
_to_comm_mark, _to_compute_mark = _TO_COMM_MARKS.table.get, _TO_COMPUTE_MARKS.table.get


def dbo_yield_and_switch_from_compute_to_comm(tag: str = "compute->comm") -> Awaitable[None]:
    """Record compute-done, yield, then continue on the comm stream after compute-done."""
    ub = _get_ubatch(None)
    if ub is None:
        return COMPLETED
    if ub.unawaited is not None or ub.debug is not None:
        mark_unawaited(ub, "dbo_yield_and_switch_from_compute_to_comm", tag, hazard=True)
    else:
        ub.unawaited = _to_comm_mark(tag) or _TO_COMM_MARKS.make(tag)
        ub.unawaited_at = made_at(1)
    lane = ub.ext
    if lane.role != "compute":
        _check_role(ub, lane, "compute", "dbo_yield_and_switch_from_compute_to_comm")
    return _yield_and_switch(ub, lane, tag, "compute", "comm")


def dbo_yield_and_switch_from_comm_to_compute(tag: str = "comm->compute") -> Awaitable[None]:
    """Record comm-done, yield, then continue on the compute stream after comm-done.

    On the host backend this parks the ubatch until its comm work has completed."""
    ub = _get_ubatch(None)
    if ub is None:
        return COMPLETED
    if ub.unawaited is not None or ub.debug is not None:
        mark_unawaited(ub, "dbo_yield_and_switch_from_comm_to_compute", tag, hazard=True)
    else:
        ub.unawaited = _to_compute_mark(tag) or _TO_COMPUTE_MARKS.make(tag)
        ub.unawaited_at = made_at(1)
    lane = ub.ext
    if lane.role != "comm":
        _check_role(ub, lane, "comm", "dbo_yield_and_switch_from_comm_to_compute")
    return _yield_and_switch(ub, lane, tag, "comm", "compute")


def _plain_switch(role: Role) -> Awaitable[None]:
    ub = _get_ubatch(None)
    if ub is None:
        return COMPLETED
    if ub.unawaited is not None:
        check_unawaited(ub)
    lane: Lane = ub.ext
    lane.role = role
    lane.stream = ub.resume_with = stream = lane.streams[role]  # lane.set_stream, inlined
    if lane.install is not None:
        lane.install(stream)
    return COMPLETED


_SYNC_MARKS = {name: marks(name).of(None) for name in ("dbo_switch_to_comm_sync", "dbo_switch_to_compute_sync")}


def _sync_switch(role: Role, name: str) -> Awaitable[None]:
    ub = _get_ubatch(None)
    if ub is None:
        return COMPLETED
    lane: Lane = ub.ext
    if ub.unawaited is not None or ub.debug is not None:
        mark_unawaited(ub, name, None, hazard=True, depth=2)
    else:
        ub.unawaited = _SYNC_MARKS[name]
        ub.unawaited_at = made_at(2)
    event = lane.events[lane.role]  # None: a synchronous role, nothing to record or wait on
    if event is not None:
        lane.record(event, lane.stream)
    lane.role = role
    lane.stream = ub.resume_with = stream = lane.streams[role]  # lane.set_stream, inlined
    if lane.install is not None:
        lane.install(stream)
    return _then_wait(ub, None if event is None else lane.wait(stream, event))  # a failed comm raises when awaited


def dbo_switch_to_comm() -> Awaitable[None]:
    """Continue on the comm stream, with no dependency on earlier compute."""
    return _plain_switch("comm")


def dbo_switch_to_compute() -> Awaitable[None]:
    """Continue on the compute stream, with no dependency on earlier comm."""
    return _plain_switch("compute")


def dbo_switch_to_comm_sync() -> Awaitable[None]:
    """Continue on the comm stream after everything this ubatch queued on its current stream."""
    return _sync_switch("comm", "dbo_switch_to_comm_sync")


def dbo_switch_to_compute_sync() -> Awaitable[None]:
    """Continue on the compute stream after this ubatch's comm. Await it: on the host backend it
    parks the ubatch until the comm work completes."""
    return _sync_switch("compute", "dbo_switch_to_compute_sync")


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


# ---------------------------------------------------------------------------------- C fast paths
#: The Python implementations above, by name: the reference the C fast paths fall back to (and
#: what tests/dbo/test_speedups.py runs side by side with them).
PURE: dict[str, Callable[..., Any]] = {
    "dbo_yield": dbo_yield,
    "dbo_yield_and_switch_from_compute_to_comm": dbo_yield_and_switch_from_compute_to_comm,
    "dbo_yield_and_switch_from_comm_to_compute": dbo_yield_and_switch_from_comm_to_compute,
    "dbo_switch_to_comm_sync": dbo_switch_to_comm_sync,
    "dbo_switch_to_compute_sync": dbo_switch_to_compute_sync,
    "dbo_switch_to_comm": dbo_switch_to_comm,
    "dbo_switch_to_compute": dbo_switch_to_compute,
}


def _fast_paths() -> dict[str, Callable[..., Any]] | None:
    """The C versions of :data:`PURE` (``asyncdbo/dbo/_speedups.c``), or None where the extension
    was not built (no compiler at install time) or ``ASYNCDBO_PURE_PYTHON=1`` is set.

    Each handles only the common case and calls its Python version for everything else (see the C
    file's header), so behaviour and error messages are the Python ones."""
    _speedups = load_extension("asyncdbo.dbo._speedups")
    if _speedups is None:
        return None
    _speedups.configure(current_ubatch, UBatch, Lane, SWITCH, COMPLETED)
    P = _speedups.Primitive
    return {
        "dbo_yield": P(dbo_yield, "yield", tag="yield"),
        "dbo_yield_and_switch_from_compute_to_comm": P(
            dbo_yield_and_switch_from_compute_to_comm, "role", tag="compute->comm", src="compute", dst="comm",
            marks=_TO_COMM_MARKS.table),
        "dbo_yield_and_switch_from_comm_to_compute": P(
            dbo_yield_and_switch_from_comm_to_compute, "role", tag="comm->compute", src="comm", dst="compute",
            marks=_TO_COMPUTE_MARKS.table),
        "dbo_switch_to_comm_sync": P(dbo_switch_to_comm_sync, "sync", dst="comm",
                                     marks=_SYNC_MARKS["dbo_switch_to_comm_sync"]),
        "dbo_switch_to_compute_sync": P(dbo_switch_to_compute_sync, "sync", dst="compute",
                                        marks=_SYNC_MARKS["dbo_switch_to_compute_sync"]),
        "dbo_switch_to_comm": P(dbo_switch_to_comm, "plain", dst="comm"),
        "dbo_switch_to_compute": P(dbo_switch_to_compute, "plain", dst="compute"),
    }


FAST: dict[str, Callable[..., Any]] | None = _fast_paths()
"""The C fast paths in use (None: the pure-Python primitives run)."""
if FAST is not None:
    globals().update(FAST)
