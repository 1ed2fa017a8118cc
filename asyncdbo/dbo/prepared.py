"""Runs prepared once, run step after step: ``prepared = prepare_run(**options)``, then
``await prepared.run_ubatches(fn, ubatch_args)`` each step.

:func:`~asyncdbo.run_ubatches` reads its keyword options, resolves its backend and takes a run
shell (:mod:`asyncdbo.dbo.shell`) from the process's pool on every call; a serving loop calls it
with the same options every step. A :class:`PreparedRun` does that work once: its options are
validated and its backend resolved when it is made, and it keeps the run shells of its own runs
in a pool of its own, so that each shell is armed with its options once and every later run of
as many ubatches only refills it (``DBORun.rerun``). What changes per step is a call argument:
the run's ``name`` and its ``instrument``.

A prepared run keeps every promise of ``run_ubatches``: the same checks of ``fn`` and
``ubatch_args``, the same errors, tracebacks and cancellation, the run guard of
:mod:`asyncdbo.dist` before each run, and the same shell rules (a shell whose objects something
still refers to after its run is never reused). It holds no event loop and no coroutine between
runs, so one can be made outside a loop and used from one loop after another, and by several
runs in flight at once on one loop (each has a shell of its own).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from .._core import Instrument
from ..backends import StreamBackend, get_backend
from . import shell
from .options import DBOOptions, _options, check_instrument
from .run import RunStats, _run, entry_error

__all__ = ["PreparedRun", "prepare_run"]

T = TypeVar("T")
_KEEP: Any = object()  # "as prepared", for ``name`` and ``instrument``


class PreparedRun:
    """Runs with one set of :class:`~asyncdbo.DBOOptions`, prepared once (see the module
    docstring). Make one with :func:`prepare_run`.

    ``options``: the validated options. ``backend``: the stream backend its runs use, resolved
    when it was prepared (for ``backend="auto"`` or a device backend's name: the accelerator and
    device current then)."""

    __slots__ = ("options", "backend", "_pool")

    def __init__(self, options: DBOOptions, backend: StreamBackend) -> None:
        self.options = options
        self.backend = backend
        self._pool: dict[int, list[shell.Shell]] = {}  # its idle run shells, per number of ubatches

    def __repr__(self) -> str:
        return f"PreparedRun({self.options!r}, backend={self.backend.describe()!r})"

    async def run_ubatches(
        self,
        fn: Callable[..., Awaitable[T]],
        ubatch_args: Iterable[Sequence[Any]],
        *,
        name: str | None = _KEEP,
        instrument: Instrument | Sequence[Instrument] | None = _KEEP,
    ) -> list[T]:
        """:func:`asyncdbo.run_ubatches` with the prepared options. ``name`` and ``instrument``:
        this run's, in place of the options' (a serving loop names each step; default: the
        options')."""
        opts = self.options
        try:
            insts, name = _per_run(opts, instrument, name)
            results, _ = await _run(fn, ubatch_args, opts, self.backend, insts, name, self._pool, False)
        except BaseException as exc:
            raise entry_error(exc, fn)  # as asyncdbo.run_ubatches: the ubatch's own frames
        return results

    async def run_ubatches_with_stats(
        self,
        fn: Callable[..., Awaitable[T]],
        ubatch_args: Iterable[Sequence[Any]],
        *,
        name: str | None = _KEEP,
        instrument: Instrument | Sequence[Instrument] | None = _KEEP,
    ) -> tuple[list[T], RunStats]:
        """:meth:`run_ubatches`, also returning the run's :class:`~asyncdbo.RunStats`."""
        opts = self.options
        try:
            insts, name = _per_run(opts, instrument, name)
            results, stats = await _run(fn, ubatch_args, opts, self.backend, insts, name, self._pool, True)
        except BaseException as exc:
            raise entry_error(exc, fn)
        assert stats is not None
        return results, stats


def _per_run(opts: DBOOptions, instrument: object, name: object) -> tuple[Any, str | None]:
    """A run's instruments and name: the options' where not given, else checked."""
    if instrument is _KEEP:
        instrument = opts.instrument
    else:
        check_instrument(instrument)
    if name is _KEEP:
        return instrument, opts.name
    if name is not None and type(name) is not str:
        raise TypeError(f"name must be a str or None (got {name!r} of type {type(name).__name__})")
    return instrument, name


def prepare_run(*, options: DBOOptions | None = None, **kwargs: Any) -> PreparedRun:
    """A :class:`PreparedRun` with these options: keyword options are the fields of
    :class:`~asyncdbo.DBOOptions` (or pass ``options=DBOOptions(...)``), checked now with the
    errors :func:`~asyncdbo.run_ubatches` raises; the backend is resolved now."""
    opts = _options({**kwargs, "options": options} if options is not None else kwargs, "prepare_run")
    return PreparedRun(opts, get_backend(opts.backend))
