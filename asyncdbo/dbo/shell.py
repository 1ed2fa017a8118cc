"""Run shells: the records of a finished run, reused by the next run with as many ubatches.

A run needs a kernel run with a record per ubatch (:class:`~asyncdbo._core.DBORun`) and the DBO
layer's state with a lane per ubatch (:class:`~asyncdbo.dbo.state.RunState`). Building them was
most of the fixed cost of a short run (``benchmarks/run_setup.py``), and a serving loop runs the
same shape step after step. A *shell* is one such set of objects: :func:`take` hands out an idle
shell with the run's number of ubatches (refilled by :meth:`DBORun.restart`: new coroutines, a
fresh copy of the caller's context per ubatch, every per-run field at its start value) or builds
one; :func:`give_back` keeps it for the next run.

It keeps it only when nothing outside the shell refers to any of its objects any more: their
reference counts (and weak references) must be what they were when the shell was built idle.
Whatever a run may leave behind that points at its records (a ``get_ubatch()`` stored away, a
loop callback scheduled from a ubatch, whose context names it, an instrument that kept the run,
a signal that still holds a waker) shows up in those counts, and such a shell is dropped as every
run was before shells: a reference kept past its run never sees the record serve another run. A
run that fails, is cancelled or whose set-up raised is dropped too, so the failure paths build
nothing and reuse nothing. An idle shell holds none of its run's coroutines, contexts, results,
named events or comm works (:meth:`DBORun._release` and :func:`_idle`). Its lanes' streams and
done-events stay only where the backend keeps them for the next run, emptied of the run's works
and on the same terms, by their own counts (:meth:`~asyncdbo.backends.StreamBackend.keep`; the
host backend does); otherwise they go too. A next run with the same options and backend reruns
the kernel run as it is (:meth:`DBORun.rerun`), else restarts it with its own.

The kernel's side of reuse (a released run, :meth:`DBORun.restart`/:meth:`~DBORun.rerun`, the
count functions) is in ``asyncdbo/_core/fastpath.py`` with the kernel's other fast paths; this
module only decides, per run, whether a shell is free to serve the next one.

Shells are per number of ubatches, at most :data:`MAX_IDLE` idle per number, and none past
:data:`MAX_UBATCHES` ubatches or on a free-threaded build running without the GIL (where other
threads' references are not all in the count at once).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from .._core import DBORun, Instrument
from .._core.extensions import gil_disabled
from .._core.fastpath import counts, same_counts
from ..backends import StreamBackend, StreamPolicy
from .hooks import on_exit, run_pending_hook
from .state import Lane, RunState

if TYPE_CHECKING:
    from .options import DBOOptions

__all__ = ["MAX_IDLE", "MAX_UBATCHES", "Shell", "give_back", "take"]

#: Idle shells kept per number of ubatches (more only for runs in flight at once).
MAX_IDLE = 4
#: Runs with more ubatches build their records every time.
MAX_UBATCHES = 64

_IDLE: dict[int, list[Shell]] = {}
_REUSE = not gil_disabled()


class Shell:
    """A kernel run and its DBO state, wired together (``run.ext`` is ``state``, each lane's
    ``ub`` the record at its index), plus the reference counts of its objects when idle."""

    __slots__ = ("n", "run", "state", "pairs", "objs", "weakable", "baseline", "armed")

    def __init__(self, n: int, backend: StreamBackend, policy: StreamPolicy) -> None:
        self.n = n  # its number of records and lanes (give_back checks the run and state hold as many)
        run = self.run = DBORun.released(n)
        state = self.state = RunState(backend=backend, policy=policy, lanes=[Lane(ub) for ub in run.ubatches])
        run.ext = state
        # each record with its lane: a released record's ``ext`` is None (no cycle through an
        # idle shell), so take() sets it from these every run, without a zip of its own
        self.pairs = tuple(zip(run.ubatches, state.lanes))
        # its objects, whose counts give_back compares (this tuple's own reference is in the baseline)
        self.objs = (run, state, *run.ubatches, *state.lanes)
        # those a weak reference can point to (a Lane has no __weakref__ slot: its count stays 0)
        self.weakable = tuple(obj for obj in self.objs if type(obj).__weakrefoffset__)
        self.baseline: tuple[int, ...] = ()
        # the options and backend its run was last restarted with (see take)
        self.armed: tuple[object, object] = (None, None)


def _build(n: int, backend: StreamBackend, policy: StreamPolicy) -> Shell:
    shell = Shell(n, backend, policy)
    _idle(shell)
    # References to each object of the shell, strong then weak (asyncdbo._core.refcounts), read
    # here and in give_back from frames that hold the shell alone (not its run, state, records or
    # lanes), so that two reads of the same idle structure agree.
    shell.baseline = counts(shell.objs, shell.weakable)
    return shell


def take(
    coros: list[Coroutine[Any, Any, Any]],
    backend: StreamBackend,
    opts: DBOOptions,
    debug: object,
    instrument: Instrument | None,
    name: str | None,
    pool: dict[int, list[Shell]] | None = None,
) -> Shell:
    """A shell for a run of ``coros`` with ``opts``, ready to attach and drive (``debug``: each
    record's debug state, None outside debug mode; ``instrument``: the run's, made from ``opts``;
    ``name``: the run's, ``opts.name`` unless the caller names each run; ``pool``: where idle
    shells wait, the process's by default, a prepared run's own)."""
    n = len(coros)
    policy = opts.stream_policy
    idle = (_IDLE if pool is None else pool).get(n)
    shell = None
    if idle:
        try:
            shell = idle.pop()
        except IndexError:  # another thread took the last one
            shell = None
    if shell is None:
        shell = _build(n, backend, policy)
    run, state = shell.run, shell.state
    armed_opts, armed_backend = shell.armed
    if armed_opts is opts and armed_backend is backend and instrument is None:
        # The options of its last run (a frozen DBOOptions, one per set of plain keyword options:
        # asyncdbo.dbo.run._options) with the same backend and no instrument: its run has them all.
        run.rerun(coros, name)
    else:
        run.restart(coros, install=backend.install_stream, before_park=run_pending_hook, at_exit=on_exit,
                    instrument=instrument, watchdog_s=opts.watchdog_s, clock=opts.clock,
                    loop_poll_s=opts.loop_poll_s, name=name)
        shell.armed = (opts, backend) if instrument is None else (None, None)
    if state.backend is not backend:
        state.backend = backend
        for lane in state.lanes:
            lane.record, lane.wait = backend.record, backend.wait
    state.policy = policy
    for ub, lane in shell.pairs:
        ub.ext = lane
    # a released record's debug and an idle lane's install are None already
    if debug is not None:
        for ub in run.ubatches:
            ub.debug = debug
    if run.installs:
        install = run.install
        for lane in state.lanes:
            lane.install = install
    return shell


def _idle(shell: Shell) -> None:
    """Drop what the shell's last run left in its state and lanes (the kernel run released its
    records itself), so an idle shell holds nothing of it. Written out field by field: every run
    that ends goes through here."""
    run, state = shell.run, shell.state
    if run.instrument is not None:
        run.instrument = None
    if state.on_finish is not None:
        state.on_finish = None
    if state.unsubmitted is not None:
        state.unsubmitted = None
    if state.comm_account is not None:
        state.comm_account = None
    if state.comm:
        state.comm = []
    if state.stamps is not None:  # the works' handles keep it: the next run stamps into its own
        state.stamps = None
    if state.events:
        state.events = {}
    if state.blocking:
        state.blocking = []
    for lane in state.lanes:
        if lane.install is not None:
            lane.install = None
        if lane.recv_hook is not None:
            lane.recv_hook = None
        if lane.stream is not None:
            lane.stream = None
        if lane.role != "compute":
            lane.role = "compute"
        if lane.submitted:
            lane.submitted = 0
    # the backend keeps the lanes' streams and events for the next run, emptied, or they go
    if not state.backend.keep(state):
        if state.kept is not None:  # what a backend kept of an earlier run is gone with the lanes' fields
            state.kept = None
        for lane in state.lanes:
            if lane.streams:
                lane.streams = {}
            if lane.events:
                lane.events = {}


def give_back(shell: Shell, pool: dict[int, list[Shell]] | None = None) -> None:
    """The run of ``shell`` ended cleanly and its caller read what it needed: keep the shell for
    the next run if nothing outside it refers to its objects (see the module docstring). The
    caller must hold the shell alone, not its run, state, records or lanes.

    The counts are read before :func:`_idle` drops what the run left: moving those values out of
    their fields would change no count of the shell's objects (every reference a value holds
    stays while it lives), so they are the counts the idle shell would have; a shell not reused
    is left as its run ended, its comm records and streams included, for whoever still holds it
    (an instrument that kept the run, a stored ``get_ubatch()``). ``pool``: the one it was taken
    from (:func:`take`)."""
    n = len(shell.run.ubatches)
    if not _REUSE or n > MAX_UBATCHES:
        return
    # the same records and lanes, if they are as many as it was built with and the counts agree
    if n != shell.n or len(shell.state.lanes) != n or not same_counts(shell.objs, shell.weakable, shell.baseline):
        return
    _idle(shell)
    pool = _IDLE if pool is None else pool
    idle = pool.get(n)
    if idle is None:
        idle = pool.setdefault(n, [])
    if len(idle) < MAX_IDLE:
        idle.append(shell)
