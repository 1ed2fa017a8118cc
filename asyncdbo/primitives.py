"""The DBO primitives, under vLLM's names, so porting a thread-DBO MoE layer is adding ``await``.

Each yield/sync primitive returns an awaitable; the ones that only change the current stream act
at call time and may be awaited or not. Ordering follows vLLM exactly: a ubatch records its
done-event on the stream it leaves *before* it yields, and the stream it enters waits on that
event *after* it resumes. On the host backend such a wait may park the ubatch until its comm work
completes, while the other ubatches compute.

Outside a DBO run every primitive is a no-op (``dbo_enabled()`` is False, yields return at once,
``dbo_current_ubatch_id()`` is 0, ``dbo_get_previous_event`` returns None, and a registered recv
hook runs at once since no other ubatch exists to launch it), so model code runs unchanged in a
plain call.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Generator, Hashable
from typing import Any, TypeVar

from ._core import SWITCH, Signal, UBatch, current_ubatch, trap
from .streams.base import READY, DoneWork

__all__ = [
    "RecvHookHandle",
    "dbo_current_ubatch_id",
    "dbo_enabled",
    "dbo_get_previous_event",
    "dbo_maybe_run_recv_hook",
    "dbo_num_ubatches",
    "dbo_record_event",
    "dbo_register_recv_hook",
    "dbo_submit",
    "dbo_switch_to_comm",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute",
    "dbo_switch_to_compute_sync",
    "dbo_wait_event",
    "dbo_yield",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_yield_and_switch_from_compute_to_comm",
]

T = TypeVar("T")


def dbo_enabled() -> bool:
    """True inside a DBO run (in this task's context only: runs in other tasks don't count)."""
    return current_ubatch.get(None) is not None


def dbo_current_ubatch_id() -> int:
    """This ubatch's index in its run, or 0 outside a run (vLLM's convention)."""
    ub = current_ubatch.get(None)
    return 0 if ub is None else ub.id


def dbo_num_ubatches() -> int:
    """Number of ubatches in this run, or 1 outside a run."""
    ub = current_ubatch.get(None)
    return 1 if ub is None else len(ub.run.ubatches)


_get_ubatch = current_ubatch.get


@types.coroutine
def dbo_yield(tag: str = "yield") -> Generator[Any, Any, None]:
    """Hand the CPU to the next ubatch; come back after every other runnable ubatch had a turn.

    ``tag`` names the yield point in traces, stack dumps and the yield-discipline checker.

    This is the hottest path in asyncdbo, so it is the one primitive that suspends with its own
    ``yield SWITCH`` instead of calling :func:`trap` (one generator frame less per switch, measured
    in benchmarks/switch_cost.py). The scheduler cannot tell the difference."""
    ub = _get_ubatch(None)
    if ub is not None:
        ub.tag = tag
        yield SWITCH


def _other(role: str) -> str:
    return "comm" if role == "compute" else "compute"


def _check_role(ub: UBatch, expected: str, name: str) -> None:
    if ub.role != expected:
        raise RuntimeError(
            f"{name}() called in ubatch {ub.id} while it is on the {ub.role} stream; it must be on the "
            f"{expected} stream (last yield point {ub.tag!r}). Check the order of switches in this layer."
        )


@types.coroutine
def _yield_and_switch(ub: UBatch, tag: str, src: str, dst: str) -> Generator[Any, Any, None]:
    backend = ub.run.backend
    event = ub.events[src]
    backend.record(event, ub.streams[src])  # before the yield: covers only this ubatch's work
    ub.tag = tag
    yield from trap(SWITCH)
    ub.role = dst
    ub.set_stream(ub.streams[dst])
    signal = backend.wait(ub.stream, event)  # after the resume
    if signal is not None:
        yield from signal.__await__()


def dbo_yield_and_switch_from_compute_to_comm(tag: str = "compute->comm") -> Any:
    """Record compute-done, yield, then continue on the comm stream after compute-done."""
    ub = current_ubatch.get(None)
    if ub is None:
        return READY
    _check_role(ub, "compute", "dbo_yield_and_switch_from_compute_to_comm")
    return _yield_and_switch(ub, tag, "compute", "comm")


def dbo_yield_and_switch_from_comm_to_compute(tag: str = "comm->compute") -> Any:
    """Record comm-done, yield, then continue on the compute stream after comm-done.

    On the host backend this parks the ubatch until its comm work has completed."""
    ub = current_ubatch.get(None)
    if ub is None:
        return READY
    _check_role(ub, "comm", "dbo_yield_and_switch_from_comm_to_compute")
    return _yield_and_switch(ub, tag, "comm", "compute")


def _switch(role: str, sync: bool) -> Any:
    ub = current_ubatch.get(None)
    if ub is None:
        return READY
    src = ub.role
    signal = None
    if sync:
        backend = ub.run.backend
        event = ub.events[src]
        backend.record(event, ub.stream)
        ub.role = role
        ub.set_stream(ub.streams[role])
        signal = backend.wait(ub.stream, event)
    else:
        ub.role = role
        ub.set_stream(ub.streams[role])
    return READY if signal is None else signal  # a failed comm raises when awaited


def dbo_switch_to_comm() -> Any:
    """Continue on the comm stream, with no dependency on earlier compute."""
    return _switch("comm", sync=False)


def dbo_switch_to_compute() -> Any:
    """Continue on the compute stream, with no dependency on earlier comm."""
    return _switch("compute", sync=False)


def dbo_switch_to_comm_sync() -> Any:
    """Continue on the comm stream after everything this ubatch queued on its current stream."""
    return _switch("comm", sync=True)


def dbo_switch_to_compute_sync() -> Any:
    """Continue on the compute stream after this ubatch's comm. Await it: on the host backend it
    parks the ubatch until the comm work completes."""
    return _switch("compute", sync=True)


class RecvHookHandle:
    """Returned by :func:`dbo_register_recv_hook`; ``await handle`` parks until the hook has run.

    Awaiting a hook no other ubatch will ever run is reported as a deadlock, not a hang."""

    __slots__ = ("hook", "signal", "owner", "runner")

    def __init__(self, hook: Callable[[], object], owner: int, runner: int) -> None:
        self.hook = hook
        self.owner = owner
        self.runner = runner
        self.signal = Signal(f"recv hook of ubatch {owner} (to be run by ubatch {runner})")

    def _run(self) -> None:
        try:
            self.hook()
        except BaseException as exc:
            self.signal.set(exc)
            raise
        self.signal.set()

    def __await__(self) -> Generator[Any, Any, None]:
        return self.signal.__await__()


def dbo_register_recv_hook(hook: Callable[[], object]) -> RecvHookHandle:
    """Store ``hook`` on the next live ubatch in the ring; it runs it at its next
    :func:`dbo_maybe_run_recv_hook` (after queuing its own compute), or when it parks or exits.

    This is how a low-latency receive is launched by the *other* ubatch. Parked ubatches are
    passed over (one may be waiting for this very ubatch, and could not launch the hook before it
    wakes); when no other ubatch can take it (outside a run, a run of one, the others finished or
    parked) the hook runs at once. ``await`` the returned handle to wait until the hook has run."""
    if not callable(hook):
        raise TypeError(f"dbo_register_recv_hook expects a callable, got {hook!r}")
    ub = current_ubatch.get(None)
    if ub is None:
        handle = RecvHookHandle(hook, 0, 0)
        handle._run()
        return handle
    ring = ub.run.ubatches
    n = len(ring)
    target = next((c for c in (ring[(ub.id + k) % n] for k in range(1, n)) if c.state == "ready"), None)
    if target is None:
        handle = RecvHookHandle(hook, ub.id, ub.id)
        handle._run()
        return handle
    handle = RecvHookHandle(hook, ub.id, target.id)
    if target.recv_hook is not None:
        raise RuntimeError(
            f"ubatch {ub.id} registered a recv hook on ubatch {target.id}, which still holds an unrun hook "
            f"({target.recv_hook!r}); the earlier receive would be lost. Call dbo_maybe_run_recv_hook() in "
            "every ubatch before it registers its next hook."
        )
    target.recv_hook = handle._run
    return handle


def dbo_maybe_run_recv_hook() -> None:
    """Run the recv hook another ubatch left for this one, if any."""
    ub = current_ubatch.get(None)
    if ub is None or ub.recv_hook is None:
        return
    hook, ub.recv_hook = ub.recv_hook, None
    hook()


def dbo_get_previous_event(func: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """Run ``func`` with this ubatch's compute stream current and return its result (DeepEP's
    ``Buffer.capture`` taken here covers exactly this ubatch's compute). None outside a run."""
    ub = current_ubatch.get(None)
    if ub is None:
        return None
    prev = ub.stream
    ub.set_stream(ub.streams["compute"])
    try:
        return func(*args, **kwargs)
    finally:
        ub.set_stream(prev)


def dbo_submit(work: Any, *, nbytes: int = 0, what: str = "comm", **backend_options: Any) -> Any:
    """Hand an async ``torch.distributed`` work (``async_op=True``) to the run's stream backend.

    Returns a handle: ``await handle`` (or a later comm->compute switch) waits for it the way the
    backend needs: on a CPU host the ubatch parks until gloo completes the work while the others
    run; on CUDA/NPU the current stream waits for the collective and the CPU goes on at once.
    ``nbytes`` feeds the modeled link and the trace numbers; ``what`` names it in traces.
    ``backend_options`` go to the backend (the sim backend takes ``inputs``/``outputs`` tensors
    for its race checker). Outside a run the work is waited for at once (serial semantics)."""
    ub = current_ubatch.get(None)
    if ub is None:
        if work is not None:
            work.wait()
        return DoneWork(what, nbytes, work)
    return ub.run.backend.submit(work, nbytes=nbytes, what=what, **backend_options)


def _events(ub: UBatch) -> dict[Hashable, tuple[Any, Signal]]:
    reg = ub.run.data.get("events")
    if reg is None:
        reg = ub.run.data["events"] = {}
    return reg  # type: ignore[return-value]


def _key_signal(reg: dict[Hashable, tuple[Any, Signal]], key: Hashable) -> tuple[Any, Signal]:
    entry = reg.get(key)
    if entry is None:
        entry = reg[key] = (None, Signal(f"event {key!r} (never recorded yet)"))
    return entry


def dbo_record_event(key: Hashable) -> None:
    """Record a named event on this ubatch's current stream (CANN-style explicit ordering).

    Each key may be recorded once per run; :func:`dbo_wait_event` on it orders after everything
    queued on the recording stream so far. Outside a run this does nothing."""
    ub = current_ubatch.get(None)
    if ub is None:
        return
    reg = _events(ub)
    device_event, signal = _key_signal(reg, key)
    if device_event is not None:
        raise RuntimeError(
            f"event {key!r} recorded twice in one run (again by ubatch {ub.id} at yield point {ub.tag!r}); "
            "use a distinct key per (layer, ubatch, stage)"
        )
    backend = ub.run.backend
    device_event = backend.new_event()
    backend.record(device_event, ub.stream)
    reg[key] = (device_event, signal)
    signal.what = f"event {key!r} (recorded by ubatch {ub.id})"
    signal.set()


@types.coroutine
def _wait_event(ub: UBatch, key: Hashable) -> Generator[Any, Any, None]:
    reg = _events(ub)
    _, signal = _key_signal(reg, key)
    if not signal.done():
        yield from trap(signal)  # parked until someone records it; never recorded -> deadlock error
    device_event, _ = reg[key]
    signal = ub.run.backend.wait(ub.stream, device_event)
    if signal is not None:
        yield from signal.__await__()


def dbo_wait_event(key: Hashable) -> Any:
    """Make this ubatch's current stream wait for the event recorded under ``key``.

    If no ubatch has recorded it yet, this ubatch parks until one does (a CUDA stream would
    silently not wait: the CANN guide's "early read"); if none ever will, the run fails with a
    deadlock report instead of hanging."""
    ub = current_ubatch.get(None)
    if ub is None:
        return READY
    return _wait_event(ub, key)
