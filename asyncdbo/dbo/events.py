"""Named events between ubatches (the CANN dual-stream pattern): ``dbo_record_event(key)`` in one
ubatch, ``await dbo_wait_event(key)`` in another.

A CUDA stream that waits on an event nobody recorded yet does not wait at all (the CANN guide's
"early read"); here the waiting ubatch parks until some ubatch records the key, and if none ever
will, the run fails with a deadlock report instead of hanging.
"""

from __future__ import annotations

import types
from collections.abc import Awaitable, Generator, Hashable
from typing import Any

from .._core import DuplicateEventError, Signal, UBatch, current_ubatch, trap
from ..backends import COMPLETED
from .awaits import check_unawaited, mark_unawaited
from .state import RunState

__all__ = ["dbo_record_event", "dbo_wait_event"]


def _key_signal(state: RunState, key: Hashable) -> tuple[Any, Signal]:
    entry = state.events.get(key)
    if entry is None:
        entry = state.events[key] = (None, Signal(f"event {key!r} (never recorded yet)"))
    return entry


def dbo_record_event(key: Hashable) -> None:
    """Record a named event on this ubatch's current stream (CANN-style explicit ordering).

    Each key may be recorded once per run; :func:`dbo_wait_event` on it orders after everything
    queued on the recording stream so far. Outside a run this does nothing."""
    ub = current_ubatch.get(None)
    if ub is None:
        return
    if ub.unawaited is not None:
        check_unawaited(ub)
    state: RunState = ub.run.ext
    device_event, signal = _key_signal(state, key)
    if device_event is not None:
        raise DuplicateEventError(
            f"event {key!r} recorded twice in one run (again by ubatch {ub.id} at yield point {ub.tag!r}); "
            "use a distinct key per (layer, ubatch, stage)"
        )
    backend = state.backend
    device_event = backend.new_event()
    backend.record(device_event, ub.ext.stream)
    state.events[key] = (device_event, signal)
    signal.what = f"event {key!r} (recorded by ubatch {ub.id})"
    signal.set()


@types.coroutine
def _wait_event(ub: UBatch, key: Hashable) -> Generator[Any, Any, None]:
    ub.unawaited = None
    state: RunState = ub.run.ext
    _, signal = _key_signal(state, key)
    if not signal.done():
        yield from trap(signal)  # parked until someone records it; never recorded -> deadlock error
    device_event, _ = state.events[key]
    on_device = ub.ext.wait(ub.ext.stream, device_event)  # the lane's wait: what a tracer times
    if on_device is not None:
        yield from on_device.__await__()


def dbo_wait_event(key: Hashable) -> Awaitable[None]:
    """Make this ubatch's current stream wait for the event recorded under ``key``.

    If no ubatch has recorded it yet, this ubatch parks until one does (a CUDA stream would
    silently not wait: the CANN guide's "early read"); if none ever will, the run fails with a
    deadlock report instead of hanging."""
    ub = current_ubatch.get(None)
    if ub is None:
        return COMPLETED
    mark_unawaited(ub, "dbo_wait_event", repr(key), hazard=True, event_wait=True)
    return _wait_event(ub, key)
