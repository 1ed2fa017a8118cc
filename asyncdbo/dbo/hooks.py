"""vLLM's recv hooks: a low-latency receive launched by the *other* ubatch.

Under the low-latency schedule a ubatch sends, then registers the matching receive as a hook on
the next ubatch, which launches it after queuing its own compute (:func:`dbo_maybe_run_recv_hook`).
A ubatch that parks or finishes launches the hook it holds first (:func:`run_pending_hook`, which
the run installs as the kernel's ``before_park``/``at_exit``): parked, it could not launch it
until it wakes, and the owner may be waiting for exactly that receive.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Protocol

from .._core import RecvHookOverwriteError, Signal, UBatch, UBatchState, current_ubatch
from .awaits import check_unawaited

__all__ = [
    "RUN_GUARD",
    "RecvHookHandle",
    "RunGuard",
    "dbo_maybe_run_recv_hook",
    "dbo_register_recv_hook",
    "on_exit",
    "run_pending_hook",
    "set_run_guard",
]


class RunGuard(Protocol):
    """What the layer that owns the process groups does around every run (:mod:`asyncdbo.dist`,
    which this layer may not import: it registers itself with :func:`set_run_guard`)."""

    async def drive(self, run: Any) -> list[Any]:
        """Drive ``run`` (a kernel run) to its results; on a failure tell the other ranks."""
        ...


#: The registered guard factory, if any: called before each run, it returns None (nothing to
#: guard, e.g. no per-ubatch process groups) or the :class:`RunGuard` to drive the run with,
#: after making sure the run starts on groups with nothing of a failed run in flight.
RUN_GUARD: list[Callable[[], RunGuard | None]] = []


def set_run_guard(guard: Callable[[], RunGuard | None]) -> None:
    """Register the guard factory every :func:`asyncdbo.run_ubatches` calls before it runs."""
    RUN_GUARD[:] = [guard]


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

    Parked ubatches are passed over (one may be waiting for this very ubatch, and could not
    launch the hook before it wakes), and so are ubatches that already hold another's hook while
    a later one holds none (one that holds several runs them in order); when no other ubatch can
    take it (outside a run, a run of one, the others finished or parked) the hook runs at once. ``await`` the returned handle to
    wait until the hook has run."""
    if not callable(hook):
        raise TypeError(f"dbo_register_recv_hook expects a callable, got {hook!r}")
    ub = current_ubatch.get(None)
    if ub is None:
        handle = RecvHookHandle(hook, 0, 0)
        handle._run()
        return handle
    if ub.unawaited is not None:
        check_unawaited(ub)
    ring = ub.run.ubatches
    n = len(ring)
    ready = [c for c in (ring[(ub.id + k) % n] for k in range(1, n)) if c.state is UBatchState.READY]
    if not ready:
        handle = RecvHookHandle(hook, ub.id, ub.id)
        handle._run()
        return handle
    # With 3+ ubatches a parked one is passed over, so two ubatches may pick the same next one:
    # the later one goes on to the first ready ubatch that holds no hook yet; if every ready one
    # holds one (many ubatches parked), the first runs both, in the order they were registered.
    target = next((c for c in ready if c.ext.recv_hook is None), ready[0])
    handle = RecvHookHandle(hook, ub.id, target.id)
    lane = target.ext
    held = lane.recv_hook
    if held is None:
        lane.recv_hook = handle._run
        return handle
    owners = _owners(held)
    if ub.id in owners:
        raise RecvHookOverwriteError(
            f"ubatch {ub.id} registered a recv hook on ubatch {target.id}, which still holds an unrun hook "
            f"of ubatch {ub.id} ({held!r}); the earlier receive would be lost. Call dbo_maybe_run_recv_hook() "
            "in every ubatch before it registers its next hook."
        )
    lane.recv_hook = _HookChain(held, handle._run, (*owners, ub.id))._run
    return handle


class _HookChain:
    """Hooks of several ubatches held by one: run in registration order, all of them even if one
    raises (the first error propagates once the rest are launched)."""

    __slots__ = ("first", "then", "owners", "owner")

    def __init__(self, first: Callable[[], object], then: Callable[[], object], owners: tuple[int, ...]) -> None:
        self.first, self.then, self.owners, self.owner = first, then, owners, owners[0]

    def _run(self) -> None:
        try:
            self.first()
        except BaseException as exc:
            try:
                self.then()  # its owner waits on it too; its own failure reaches it through its handle
            except BaseException as later:
                exc.add_note(f"asyncdbo: the recv hook launched after it failed too: {later!r}")
            raise
        self.then()


def _owners(hook: Callable[[], object]) -> tuple[int, ...]:
    held = getattr(hook, "__self__", None)
    if isinstance(held, _HookChain):
        return held.owners
    assert isinstance(held, RecvHookHandle), f"a lane holds a hook that is no handle: {hook!r}"
    return (held.owner,)


def dbo_maybe_run_recv_hook() -> None:
    """Run the recv hook another ubatch left for this one, if any."""
    ub = current_ubatch.get(None)
    if ub is not None:
        if ub.unawaited is not None:
            check_unawaited(ub)
        run_pending_hook(ub)


def run_pending_hook(ub: UBatch) -> None:
    """Run (and clear) the recv hook ``ub`` holds, if any."""
    lane = ub.ext
    hook = lane.recv_hook
    if hook is not None:
        lane.recv_hook = None
        hook()


def on_exit(ub: UBatch) -> None:
    """What the run does when a ubatch returns: report an awaitable it left unawaited, then launch
    the recv hook it holds (vLLM: a ubatch's exit launches its pending receive)."""
    if ub.unawaited is not None:
        check_unawaited(ub)
    lane = ub.ext  # run_pending_hook(ub), inline: every ubatch of every run ends here
    hook = lane.recv_hook
    if hook is not None:
        lane.recv_hook = None
        hook()
