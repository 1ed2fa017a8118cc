"""The kernel's fast path: the Python side of ``asyncdbo/_core/_spin.c`` and the reuse of a finished run.

Why a module of its own: :mod:`asyncdbo._core.kernel` is the reference, the loop a reader follows
and the tests specify (its invariants). Everything here only makes the same behaviour cheaper, for
a serving loop that runs the same short step thousands of times: the switch loop in C while no
instrument or loop wait is involved (:meth:`FastPath._switch`, whose reference is
``DBORun._switch_in_python``), a record's refill and release in C (references ``UBatch._start``,
``Endings._release_records``), a finished run refilled for the next one instead of rebuilt
(:meth:`FastPath.restart`, :meth:`FastPath.rerun`; ``asyncdbo/dbo/shell.py`` keeps such runs) and
the reference counts that tell a run is free to reuse (:data:`counts`, :data:`same_counts`;
references in :mod:`asyncdbo._core.refcounts`). :meth:`FastPath._switch` is the one place in
Python that picks the C or the Python loop.

The seam: :func:`kernel_loop` runs the kernel on the C loop, on the Python reference alone, or on
a stand-in, for tests and benchmarks that compare them (``tests/native/test_differential.py``); no
one else sets this module's state. ``ASYNCDBO_PURE_PYTHON=1`` (or ``ASYNCDBO_NO_C_KERNEL=1``) at
import leaves the extension unloaded (:mod:`asyncdbo._core.extensions`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine, Iterator
from types import EllipsisType, ModuleType
from typing import TYPE_CHECKING, Any, Self

from . import ubatch as _ubatch
from .endings import Endings
from .extensions import load_extension
from .parking import LOOP_POLL_S
from .refcounts import py_counts, py_same_counts
from .ubatch import UBatch, UBatchState, current_ubatch

if TYPE_CHECKING:
    from .clock import Clock
    from .instrument import Instrument

__all__ = ["C", "LOOPS", "FastPath", "counts", "kernel_loop", "same_counts"]

READY, DONE = UBatchState.READY, UBatchState.DONE
_SWITCHED, _PARKED, _FAILED, _EMPTY, _EXITED, _EXIT_FAILED = range(6)  # what spin() reports (its enum)


def _load() -> ModuleType | None:
    """The C extension, or None where it was not built (no compiler at install time) or was switched off."""
    mod = load_extension("asyncdbo._core._spin")
    if mod is not None:
        mod.configure(UBatch)
    return mod


#: The C extension as loaded at import (None: not built, or switched off).
C = _load()
#: The kernel loops this process can run: ``"c"`` where :data:`C` is loaded, and the Python reference.
LOOPS: tuple[str, ...] = ("c", "python") if C is not None else ("python",)
_spin = C  # what the kernel runs now: C, None (the Python reference) or a stand-in (kernel_loop)

#: The reference count of each of ``objs``, then the weak reference count of each of ``weak``
#: (``counts(objs, weak)``), and whether they are ``expected`` (``same_counts(objs, weak, expected)``):
#: in C where it was built. A baseline is compared with the function that made it (the C reads one
#: reference fewer than :func:`sys.getrefcount`), so these are picked once, here, and :func:`kernel_loop`
#: leaves them alone.
counts: Callable[[tuple[object, ...], tuple[object, ...]], tuple[int, ...]] = py_counts if C is None else C.counts
same_counts: Callable[[tuple[object, ...], tuple[object, ...], object], bool] = (
    py_same_counts if C is None else C.same_counts
)


@contextlib.contextmanager
def kernel_loop(loop: str | ModuleType) -> Iterator[None]:
    """Run the kernel on ``loop`` while inside: ``"c"``, the C loop as loaded (an error where it is
    not); ``"python"``, the Python reference alone (its switch loop, record refill and release, and a
    resume through ``functools.partial``); or a module with ``_spin``'s functions (a test's spy).
    Runs started inside should also end inside. For tests and benchmarks (``tests/conftest.py``'s
    ``kernel_loop`` fixture runs a test on each of :data:`LOOPS`)."""
    global _spin
    if loop == "c":
        if C is None:
            raise ValueError("kernel_loop('c'): the C kernel extension is not loaded here; use one of LOOPS")
        new, resume = C, C.Resume
    elif loop == "python":
        new, resume = None, None
    elif isinstance(loop, str):
        raise ValueError(f"kernel_loop({loop!r}): name 'c' or 'python', or pass a module with _spin's functions")
    else:
        new, resume = loop, _ubatch._Resume
    saved = _spin, _ubatch._Resume
    _spin, _ubatch._Resume = new, resume
    try:
        yield
    finally:
        _spin, _ubatch._Resume = saved


class FastPath(Endings):
    """The fast path and run reuse of :class:`~asyncdbo._core.kernel.DBORun` (its base class)."""

    ubatches: list[UBatch]
    instrument: Instrument | None
    installs: bool
    _loop_waits: int
    _num_parked: int
    _live: int
    _spin_args: tuple[tuple[Any, ...], tuple[Any, ...]]

    if TYPE_CHECKING:
        def __init__(self, coros: list[Coroutine[Any, Any, Any]]) -> None: ...
        def install(self, obj: object) -> None: ...
        def _switch_in_python(self) -> None: ...
        def _reset(self) -> None: ...
        def _arm(self, install: Callable[[object], None] | None, before_park: Callable[[UBatch], None] | None,
                 at_exit: Callable[[UBatch], None] | None, instrument: Instrument | None, watchdog_s: float | None,
                 clock: Clock | None, loop_poll_s: float, name: str | None) -> None: ...

    # ------------------------------------------------------------------ which loop switches
    def _switch(self) -> None:
        """Switch ubatches until one parks, finishes or fails (or a loop poll is due): the one place
        in Python that picks a loop. In C where it was loaded and no instrument or loop wait is
        involved (``_switch_in_python`` is its reference), else in the Python loop. The C loop
        hands back what it cannot decide (:meth:`_spun`); it finishes a ubatch that returns itself
        (``_finish``, exit hook included) and goes on, so a run whose ubatches only switch is one
        call (written out here, not in a method of its own: every run starts with it)."""
        spin = _spin
        if spin is None or self.instrument is not None or self._loop_waits:
            self._switch_in_python()
            return
        watch = self._num_parked > 0 or bool(self._timers)
        args = self._spin_args[watch]
        if self.installs:
            args = (*args[:5], self.install)
        if self._ready:
            n, ub, status, value = spin.spin(*args, self, DONE)
            if status == _EMPTY:  # each ran to its end, or none is left to run
                self.num_switches += n
                return
            try:
                self._spun(args, watch, n, ub, status, value)
            finally:
                del ub, value  # an error's traceback holds this frame: no cycle through it (invariant 8)

    def _spun(self, args: tuple[Any, ...], watch: bool, n: int, ub: UBatch, status: int, value: Any) -> None:
        """The rest of :meth:`_switch`'s C loop once ``spin(*args, self, DONE)`` reported ``n`` switches
        and ``status`` (``ub``, ``value``): act on it, and spin on while one switched with timers or
        wake-ups pending."""
        ready, push = self._ready, self._ready.append
        try:
            while True:
                if status == _SWITCHED:  # switched, with timers or wake-ups pending
                    if watch:
                        self._drain()  # woken during this step: they were runnable first
                    else:
                        self._fire_timers()
                    push(ub)
                elif status == _PARKED:
                    self._park(ub, value)
                    return
                elif status == _EXITED or status == _EMPTY:
                    return  # its exit woke or armed something (drained out there first), or none is left to run
                else:
                    if status == _EXIT_FAILED:  # _finish's annotation of an exit that raised
                        self._annotate(ub, value, where="at its exit")
                    else:
                        assert status == _FAILED, status
                        self._failed(ub, value)
                    try:
                        raise value
                    finally:
                        # The traceback holds this frame: keeping the error in a local too would
                        # make a cycle that only the cycle collector frees (invariant 8).
                        del value
                if not ready:
                    return
                k, ub, status, value = _spin.spin(*args, self, DONE)  # type: ignore[union-attr]
                n += k
        finally:
            self.num_switches += n

    def _release_records(self) -> list[Any]:
        if _spin is None:
            return Endings._release_records(self)
        results: list[Any] = _spin.release(self.ubatches)  # the same in C (Endings._release_records is its reference)
        return results

    # ------------------------------------------------------------------ run reuse
    @classmethod
    def released(cls, n: int) -> Self:
        """``n`` ubatch records holding no coroutine yet, as a finished run: :meth:`restart` fills them."""
        coros = [_nothing() for _ in range(n)]
        for coro in coros:
            coro.close()  # closed before its first step: no "never awaited" warning
        run = cls(coros)
        run._release()
        return run

    def restart(
        self,
        coros: list[Coroutine[Any, Any, Any]],
        *,
        install: Callable[[object], None] | None = None,
        before_park: Callable[[UBatch], None] | None = None,
        at_exit: Callable[[UBatch], None] | None = None,
        instrument: Instrument | None = None,
        watchdog_s: float | None = None,
        clock: Clock | None = None,
        loop_poll_s: float = LOOP_POLL_S,
        name: str | None = None,
    ) -> None:
        """Make this run, driven to its end, a new one: ``coros`` (as many as it had ubatches) in its
        records, each with a fresh copy of the caller's context, every counter and option as
        ``__init__`` sets them; ``ext`` stays (``asyncdbo.dbo``'s run shells reuse runs so)."""
        self._refill(coros)
        self._arm(install, before_park, at_exit, instrument, watchdog_s, clock, loop_poll_s, name)

    def rerun(self, coros: list[Coroutine[Any, Any, Any]], name: str | None | EllipsisType = ...) -> None:
        """:meth:`restart` with the options its last :meth:`restart` (or ``__init__``) gave it: only the
        records and per-run counters are set again. ``name``: the run's name from now on, where it
        changes per run (a serving loop's step number; default: the name it had)."""
        if name is not ...:
            self._name = name
        ubs = self.ubatches
        if _spin is not None and self._released and len(coros) == len(ubs):  # _refill, without its frame
            _spin.start(ubs, self, coros, current_ubatch, READY)
            self._ready.extend(ubs)
            self._released = False
        else:
            self._refill(coros)
        self._reset()

    def _refill(self, coros: list[Coroutine[Any, Any, Any]]) -> None:
        ubs = self.ubatches
        if not self._released or len(coros) != len(ubs):
            for c in coros:
                c.close()
            raise ValueError(
                f"run {self.name!r} can restart only after it was driven to its end, with as many coroutines as it "
                f"has ubatches ({len(ubs)}; got {len(coros)}, {'released' if self._released else 'not finished'}); "
                "build a new DBORun instead"
            )
        if _spin is None:
            for ub, coro in zip(ubs, coros):
                ub._start(self, coro)  # type: ignore[arg-type]  # self is a DBORun
        else:  # the same loop in C (UBatch._start is its reference)
            _spin.start(ubs, self, coros, current_ubatch, READY)
        self._ready.extend(ubs)
        self._released = False


async def _nothing() -> None:
    """What the records of :meth:`FastPath.released` are built around (closed at once)."""
