"""Entry points: ``await run_ubatches(fn, ubatch_args)`` inside a loop, ``run(async_fn)`` outside.

``run_ubatches`` builds a kernel run, gives each ubatch a :class:`~asyncdbo.dbo.state.Lane` and the
run a :class:`~asyncdbo.dbo.state.RunState`, lets the stream backend fill them, and drives it.
:func:`run_ubatches_with_stats` also returns what the run cost (:class:`RunStats`).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, fields
from types import CoroutineType, FunctionType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from .._core import DBORun, Fanout, Instrument, from_the_ubatch
from ..backends import CommRecord, CommStamps, StreamBackend, get_backend
from .debug import DebugMode, debug_instruments
from .hooks import RUN_GUARD
from .options import DBOOptions, _options
from . import shell
from .state import RunState

__all__ = ["DBOOptions", "RunStats", "run", "run_ubatches", "run_ubatches_with_stats"]

T = TypeVar("T")
LoopName = Literal["auto", "uvloop", "asyncio"]


def _not_async_def_error(param: str, fn: object, call: str, result: object) -> TypeError:
    return TypeError(
        f"{param} must be an async def function: {getattr(fn, '__qualname__', fn)!r}({call}) "
        f"returned {type(result).__name__}, not a coroutine"
    )


def _not_a_coroutine_error(fn: object, where: str) -> TypeError:
    name = getattr(getattr(fn, "cr_code", None), "co_name", "fn")
    return TypeError(
        f"{where} expects an async function, but got the coroutine object {fn!r}.\n"
        f"Probably you wrote:\n    {where}({name}(...), ...)      # incorrect\n"
        f"Pass the function and its arguments instead:\n    {where}({name}, ...)"
    )


def _make_coros(fn: Callable[..., Awaitable[T]], ubatch_args: Iterable[Sequence[Any]]) -> list[Coroutine[Any, Any, T]]:
    if type(fn) is not FunctionType:  # the checks an ``async def`` function passes without them
        if inspect.iscoroutine(fn):
            fn.close()
            raise _not_a_coroutine_error(fn, "run_ubatches")
        if not callable(fn):
            raise TypeError(f"run_ubatches expects an async function as fn, got {fn!r}")
    if type(ubatch_args) is list:
        args_list = ubatch_args  # iterated once, below; only other iterables are copied
    elif isinstance(ubatch_args, (str, bytes)) or not isinstance(ubatch_args, Iterable):
        raise TypeError(f"ubatch_args must be a list of argument tuples, one per ubatch (got {ubatch_args!r})")
    else:
        args_list = list(ubatch_args)
    if len(args_list) < 1:
        raise ValueError("run_ubatches needs at least 1 ubatch (got 0 argument tuples); pass e.g. [(x0,), (x1,)]")
    coros: list[Coroutine[Any, Any, T]] = []
    # Any error closes the coroutines made so far (a coroutine dropped unstarted warns "never
    # awaited"); what fn raises keeps its type and gains a note naming the entry. (The try blocks
    # cost nothing until something raises: zero-cost exceptions, 3.11+.)
    try:
        for args in args_list:  # the entry's index, for an error, is len(coros)
            if type(args) is not tuple and not isinstance(args, (tuple, list)):
                raise TypeError(
                    f"ubatch_args[{len(coros)}] is {args!r}; each entry must be a tuple of arguments for fn "
                    f"(write ({args!r},) for a single argument)"
                )
            try:
                coro = fn(*args)
            except BaseException as exc:
                exc.add_note(f"asyncdbo: raised by {getattr(fn, '__qualname__', fn)!r}(*ubatch_args[{len(coros)}]), "
                             f"making ubatch {len(coros)}'s coroutine; no ubatch ran")
                raise
            if type(coro) is not CoroutineType and not inspect.iscoroutine(coro):
                raise _not_async_def_error("fn", fn, f"*ubatch_args[{len(coros)}]", coro)
            coros.append(coro)
    except BaseException:
        for c in coros:
            c.close()
        raise
    return coros


@dataclass(frozen=True)
class RunStats:
    """What one run cost: ``num_switches`` (handovers at a yield), ``num_parks`` (times a ubatch
    parked on a signal or future), ``time_asleep_s`` (time every ubatch was parked: exposed waits,
    on the host backend comm nothing hid), ``comm`` (every comm work the backend tracked; empty on
    accelerators, whose timing lives in device events).

    A run's stats keep its works' times as :class:`~asyncdbo.backends.CommStamps` (:attr:`stamps`,
    what the runner's measurement folds) and make ``comm``'s records on its first read."""

    num_ubatches: int
    num_switches: int
    num_parks: int
    time_asleep_s: float
    comm: tuple[CommRecord, ...]
    blocking: tuple[Any, ...] = ()  # debug mode: asyncdbo.dbo.debug.BlockingStep records

    @property
    def stamps(self) -> CommStamps:
        """The comm works' times as arrays, read without a :class:`~asyncdbo.backends.CommRecord`
        each where the run stamped them (else made from ``comm``; without works one empty
        :class:`~asyncdbo.backends.CommStamps` shared by every such run: read it, add nothing)."""
        stamps: CommStamps | None = self.__dict__.get("_stamps")
        if stamps is not None:
            return stamps
        return CommStamps.of(self.comm) if self.comm else _NO_STAMPS

    if not TYPE_CHECKING:  # (mypy would take every attribute name for one this makes)

        def __getattr__(self, name: str) -> Any:
            """``comm`` of a run's stats, made from its stamps on the first read and kept (the
            stamps then leave: the stats hold what ``RunStats(...)`` holds, field for field)."""
            d = self.__dict__
            if name != "comm" or "_stamps" not in d:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            d["comm"] = tuple(d["_stamps"].records())
            del d["_stamps"]
            return d["comm"]


# Keyword options made of plain values (names, numbers, flags) map to one shared frozen
# DBOOptions: a run's set-up then builds and validates none (benchmarks/host_overhead.py counts the
# set-up in the host time per yield). Bounded; instruments and clocks are never keys.
#: The error of a ubatch leaves through the kernel's loop and the entry points (this module's and
#: asyncdbo.dbo.prepared's); their frames are cut from its traceback
#: (asyncdbo._core.stacks.from_the_ubatch), so the traceback goes from the caller's
#: ``await run_ubatches(...)`` and the entry point's one re-raise line to the ubatch's frames and
#: ends where the ubatch raised.
_ENTRY_FILES = frozenset(os.path.join(os.path.dirname(os.path.abspath(__file__)), f) for f in ("run.py", "prepared.py"))


def from_the_ubatch_here(exc: BaseException) -> BaseException:
    """``exc`` for an entry point to raise as ``raise from_the_ubatch_here(exc)`` in the except
    clause around its run: its traceback the ubatch's own frames on (the machinery's cut), or,
    for an error that never reached a ubatch, every frame; either way without the entry point's
    own frame, which that ``raise`` puts back in front. No local here holds the traceback while
    the entry point's frame is in it (a cycle that only the cycle collector frees, and the
    run's inputs with it: tests/core/test_no_cycles.py)."""
    tb = exc.__traceback__
    assert tb is not None, "an exception caught in an entry point has a traceback"
    cut = from_the_ubatch(tb, _ENTRY_FILES)
    return exc.with_traceback(tb.tb_next if cut is tb else cut)


def entry_error(exc: BaseException, fn: object) -> BaseException:
    """What an entry point raises for ``exc`` in the except clause around its run (``raise
    entry_error(exc, fn)``): :func:`from_the_ubatch_here`, once a coroutine object passed as ``fn``
    is closed. Something refused before ``fn`` was checked (an option, a name) leaves it unstarted,
    and a coroutine dropped unstarted warns "never awaited" on top of the error."""
    if inspect.iscoroutine(fn):
        fn.close()
    return from_the_ubatch_here(exc)


async def run_ubatches(
    fn: Callable[..., Awaitable[T]],
    ubatch_args: Iterable[Sequence[Any]],
    **options: Any,
) -> list[T]:
    """Run ``fn(*args)`` for each tuple in ``ubatch_args`` as one ubatch, interleaved round-robin
    at their yield points on this thread, and return the results in ubatch order.

    Works in any running asyncio loop (default or uvloop). Keyword options are the fields of
    :class:`DBOOptions` (or pass ``options=DBOOptions(...)``). An exception in one ubatch cancels the
    others and propagates with a note naming the ubatch; cancelling the awaiting task cancels
    every ubatch.
    """
    try:
        opts = _options(options)
        results, _ = await _run(fn, ubatch_args, opts, None, opts.instrument, opts.name, None, False)
    except BaseException as exc:
        raise entry_error(exc, fn)  # the ubatch's own frames, without the kernel's (see _ENTRY_FILES)
    return results


async def run_ubatches_with_stats(
    fn: Callable[..., Awaitable[T]],
    ubatch_args: Iterable[Sequence[Any]],
    **options: Any,
) -> tuple[list[T], RunStats]:
    """:func:`run_ubatches`, also returning the run's :class:`RunStats`."""
    try:
        opts = _options(options)
        results, stats = await _run(fn, ubatch_args, opts, None, opts.instrument, opts.name, None, True)
    except BaseException as exc:
        raise entry_error(exc, fn)
    assert stats is not None
    return results, stats


async def _run(
    fn: Callable[..., Awaitable[T]],
    ubatch_args: Iterable[Sequence[Any]],
    opts: DBOOptions,
    backend: StreamBackend | None,
    insts: Instrument | Sequence[Instrument] | None,
    name: str | None,
    pool: dict[int, list[shell.Shell]] | None,
    with_stats: bool,
) -> tuple[list[T], RunStats | None]:
    """One run with ``opts``, on ``backend`` (None: the one ``opts`` names), with the instruments
    ``insts``, named ``name``, its run shell from ``pool`` (None: the process's): its results,
    and its :class:`RunStats` if asked for."""
    # asyncdbo.dist: renews the per-ubatch groups if a run failed on any rank, then watches this one
    guard = RUN_GUARD[0]() if RUN_GUARD else None
    coros = _make_coros(fn, ubatch_args)
    try:
        if backend is None:
            backend = get_backend(opts.backend)
        # the records of an earlier run with as many ubatches, or new ones (asyncdbo.dbo.shell)
        held = shell.take(coros, backend, opts, DebugMode(blocking_s=opts.blocking_s) if opts.debug else None,
                          None if insts is None and not opts.debug else _instrument(insts, opts), name, pool)
        dbo, state = held.run, held.state
        backend.attach(dbo, state)
    except BaseException:  # never leave a coroutine that was not awaited behind
        for c in coros:
            c.close()
        raise
    try:
        results = await (dbo.drive() if guard is None else guard.drive(dbo))
    except BaseException as exc:
        if state.on_finish is not None:
            _finish(state, exc)
        raise
    finally:
        backend.detach(dbo, state)
    if state.on_finish is not None:
        _finish(state, None)
    stats = _stats(dbo, state) if with_stats else None
    del dbo, state  # the shell is kept only if nothing but it refers to its objects
    shell.give_back(held, pool)
    return results, stats


def _stats(dbo: DBORun, state: RunState) -> RunStats:
    """The run's :class:`RunStats`, its fields stored at once: a frozen dataclass's ``__init__``
    stores each through a call of ``object.__setattr__``, and every run of a serving loop pays
    for them (benchmarks/run_setup.py). tests/dbo/test_prepared.py checks that this is the
    object ``RunStats(...)`` builds, field for field. The comm works' records are left to the
    first read of ``comm``: the stats keep a copy of the run's stamps (one record per work was
    most of a measured step's cost, issue 46)."""
    stats = _NEW(RunStats)
    fields_ = {
        "num_ubatches": len(dbo.ubatches),
        "num_switches": dbo.num_switches,
        "num_parks": dbo.num_parks,
        "time_asleep_s": dbo.time_asleep_s,
        "blocking": tuple(state.blocking) if state.blocking else (),
    }
    stamps = state.stamps
    if not state.comm:
        fields_["comm"] = ()
    elif stamps is not None and len(stamps) == len(state.comm):
        fields_["_stamps"] = stamps.frozen()
    else:  # a backend that tracks works without stamps
        fields_["comm"] = tuple(state.comm_records())
    _SET(stats, "__dict__", fields_)
    return stats


_NEW, _SET = object.__new__, object.__setattr__
_NO_STAMPS = CommStamps()  # RunStats.stamps of a run without comm works (most runs: not one made per step)


def _finish(state: RunState, exc: BaseException | None) -> None:
    """Tell the layers above that the run ended (they warn, or add notes to ``exc``)."""
    finishers, state.on_finish = state.on_finish or [], None
    for fn in finishers:
        fn(exc)


def _instrument(given: Instrument | Sequence[Instrument] | None, opts: DBOOptions) -> Instrument | None:
    """The run's one instrument: ``given`` and, in debug mode, the debug checks."""
    if given is None and not opts.debug:
        return None
    insts: list[Instrument] = []
    if isinstance(given, Instrument):
        insts.append(given)
    elif given is not None:
        insts.extend(given)
    if opts.debug:
        insts += debug_instruments(DebugMode(blocking_s=opts.blocking_s))
    if not insts:
        return None
    return insts[0] if len(insts) == 1 else Fanout(*insts)


def _loop_factory(loop: LoopName) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise ValueError("loop='uvloop' but uvloop is not installed; `pip install uvloop` or use loop='asyncio'") from None
        return None
    return uvloop.new_event_loop


def run(
    async_fn: Callable[..., Awaitable[T]],
    *args: Any,
    loop: LoopName = "auto",
    loop_debug: bool = False,
    debug: bool | None = None,
) -> T:
    """Run ``async_fn(*args)`` on a new event loop and return its result, like ``asyncio.run``.

    ``loop``: ``auto`` (uvloop when installed, else asyncio's default loop), ``uvloop`` or
    ``asyncio``. ``loop_debug``: the event loop's own debug mode (``asyncio.run(debug=...)``),
    not DBO's (that is ``run_ubatches(..., debug=True)``); ``debug`` is its deprecated old name.
    Raises RuntimeError if called from inside a running loop (await instead)."""
    if debug is not None:  # renamed: ``debug`` read as DBO's debug mode, which it never was
        warnings.warn(
            "asyncdbo.run(debug=...) is renamed loop_debug: it is the event loop's debug mode, not DBO's "
            "(for that pass debug=True to run_ubatches or DBOOptions); debug= stops working in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        loop_debug = loop_debug or debug
    if inspect.iscoroutine(async_fn):
        async_fn.close()
        raise _not_a_coroutine_error(async_fn, "asyncdbo.run")
    if not callable(async_fn):
        raise TypeError(f"asyncdbo.run expects an async function as async_fn, got {async_fn!r}")
    if loop not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"loop must be 'auto', 'uvloop' or 'asyncio' (got {loop!r})")
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("asyncdbo.run() cannot be called from a running event loop; use `await run_ubatches(...)` there")
    factory = _loop_factory(loop)
    coro = async_fn(*args)
    if not inspect.iscoroutine(coro):
        raise _not_async_def_error("async_fn", async_fn, "*args", coro)
    # The task returns None and the result travels in a box: asyncio's Runner (3.11, 3.12) looks up
    # its SIGINT handler with signal.getsignal, whose enum lookup formats the handler, a partial
    # holding the task, and with it repr(result), twice per run (CPython issue 112559): a tensor's
    # repr costs 0.3-2 ms, a list of tensors more.
    box: list[T] = []
    with asyncio.Runner(loop_factory=factory, debug=loop_debug) as runner:
        runner.run(_into(box, coro))
    return box[0]


async def _into(box: list[T], coro: Awaitable[T]) -> None:
    """Await ``coro`` and put its result in ``box`` (see :func:`run`)."""
    box.append(await coro)
