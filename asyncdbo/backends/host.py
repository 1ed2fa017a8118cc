"""Host backend: DBO on a CPU with no accelerator.

A CPU has no device queue: ``torch.Event('cpu').record()`` raises, and every CPU op returns when
it is done. So this backend keeps its own streams:

* the **compute** stream is the CPU itself: work on it is finished when the call returns;
* a **comm** stream is a FIFO of outstanding ``torch.distributed`` async works (gloo). Gloo runs
  them on its own threads, so they progress while the other ubatch computes.

An event recorded on a stream snapshots that stream's unfinished works (CUDA's FIFO meaning: "all
work queued here so far"). Waiting on it returns a :class:`Signal` that completes when those works
do; the waiting ubatch parks on it while the others run. Completion comes from gloo's callback
thread straight into the scheduler's wake queue (no event-loop round trip, no polling).

With a :class:`LinkSpec` the backend models the link: each work's completion is also held back
until ``issue time + latency + bytes / bandwidth`` on a serialized link, taking no CPU, so a
2-core machine can show the overlap a real NIC would give.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._core import Clock, MonotonicClock, Signal
from .._core.fastpath import counts, same_counts
from .base import CommRecord, CommStamps, RunStreams, StreamBackend, UBatchStreams
from .links import LinkSpec, link_spec

if TYPE_CHECKING:
    from .._core import DBORun

_MONOTONIC = MonotonicClock()

__all__ = ["HostBackend", "HostEvent", "HostStream", "HostWork", "host_backend"]


@dataclass(eq=False)
class HostStream:
    """A host stream. ``inline`` streams run their work synchronously (the CPU).

    ``lanes``: the comm-done event slot of each ubatch on this stream and the event to put there
    while works are pending (see :meth:`HostBackend.attach`)."""

    name: str
    inline: bool
    pending: list[HostWork] = field(default_factory=list)
    lanes: list[tuple[dict[str, Any], HostEvent]] = field(default_factory=list, repr=False)

    def arm(self, pending: bool) -> None:
        """Put each lane's comm event in its slot (works are ``pending``), or None (the stream is idle)."""
        for events, event in self.lanes:
            events["comm"] = event if pending else None

    def __repr__(self) -> str:
        return f"<HostStream {self.name} pending={len(self.pending)}>"


@dataclass(eq=False)
class HostEvent:
    works: tuple[HostWork, ...] = ()
    recorded: bool = False


class HostWork:
    """One async comm work. ``await work`` parks the ubatch until it completes; ``wait()`` blocks
    (outside a DBO run). Its times live in row ``row`` of its run's :class:`CommStamps`
    (``t_issue``/``t_done``/``t_release``, the run's clock, feed the trace numbers, ``t_wait``, the
    first wait on it while in flight, the runner's per-step overlap measure,
    :mod:`asyncdbo.serving.measure`); read here as attributes, None where not stamped. ``ub`` is
    the issuing ubatch (None outside a run)."""

    __slots__ = ("what", "nbytes", "signal", "work", "ub", "clock", "stamps", "row")

    def __init__(self, what: str, nbytes: int, work: Any, arrivals: int, clock: Clock, ub: int | None,
                 stamps: CommStamps | None = None) -> None:
        self.what = what
        self.nbytes = nbytes
        self.work = work
        self.ub = ub
        self.clock = clock
        self.signal = Signal(what, external=True, arrivals=arrivals)
        self.stamps = stamps = CommStamps() if stamps is None else stamps  # outside a run: its own
        self.row = stamps.add(-1 if ub is None else ub, nbytes, what, clock.now())

    @property
    def t_issue(self) -> float:
        return self.stamps.t_issue[self.row]

    @property
    def t_done(self) -> float | None:
        t = self.stamps.t_done[self.row]
        return None if t != t else t

    @property
    def t_release(self) -> float | None:
        t = self.stamps.t_release[self.row]
        return None if t != t else t

    @property
    def t_wait(self) -> float | None:
        t = self.stamps.t_wait[self.row]
        return None if t != t else t

    def waited(self, now: float) -> None:
        """Stamp ``now`` as the first wait on this work, unless one was stamped before."""
        column = self.stamps.t_wait
        if column[self.row] != column[self.row]:  # NaN: no wait yet
            column[self.row] = now

    def done(self) -> bool:
        return self.signal.done()

    def succeeded(self) -> bool:
        """Done without an error: nothing left to wait for or to report."""
        return self.signal.done() and self.signal.exception() is None

    def _on_complete(self, fut: Any) -> None:  # gloo's thread, or inline if already complete
        self.stamps.t_done[self.row] = self.clock.now()
        exc = None
        try:
            fut.value()
        except BaseException as e:  # noqa: BLE001 - forwarded to the waiting ubatch
            exc = RuntimeError(f"comm work {self.what!r} failed: {e}")
        self.signal.set(exc)

    def __await__(self) -> Any:
        if not self.signal.done():
            self.waited(self.clock.now())
        return self.signal.__await__()

    def stream_wait(self) -> None:
        """Nothing: a CPU has no queue to order; the ubatch that needs the data awaits the work."""

    def wait(self) -> None:
        """Block this thread until the work (and the modeled link) completes."""
        self.work.wait()
        release = self.t_release
        if release is not None:
            delay = self.clock.wait_s(release)
            if delay > 0:
                time.sleep(delay)
        if self.signal.exception() is not None:
            raise self.signal.exception()  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"<HostWork {self.what} {self.nbytes}B {'done' if self.done() else 'pending'}>"


def _kept_objects(lanes: list[Any]) -> tuple[Any, ...]:
    """The lanes' streams and events dicts, their comm streams (each once) and those streams'
    comm events: what :meth:`HostBackend.keep` keeps, and counts."""
    streams = [lane.streams for lane in lanes]
    comms = list({id(s["comm"]): s["comm"] for s in streams}.values())
    return (*streams, *(lane.events for lane in lanes), *comms, *(event for c in comms for _, event in c.lanes))  # events last


_PENDING = operator.attrgetter("pending")  # a HostStream's works not yet completed


def _busy_counts(
    base: tuple[int, ...], objs: tuple[Any, ...], comms: tuple[HostStream, ...], pairs: tuple[Any, ...]
) -> tuple[int, ...]:
    """``base``, the counts of :func:`_kept_objects`, with one more for each lane's comm event of a
    stream with works pending: the lane's events dict holds that event too."""
    expected = list(base)
    start = len(objs) - len(pairs)  # where the events start in objs, each comm stream's in turn
    for comm in comms:
        if comm.pending:
            for j in range(start, start + len(comm.lanes)):
                expected[j] += 1
        start += len(comm.lanes)
    return tuple(expected)


def _forward(src: Signal, dst: Signal) -> Callable[[], None]:
    """Waiter for ``src`` that counts one arrival on ``dst``, carrying ``src``'s error if any."""
    return lambda: dst.set(src.exception())


class HostBackend(StreamBackend):
    """DBO streams for a CPU-only machine (see the module docstring)."""

    name = "host"

    def __init__(self, *, link: str | LinkSpec | None = None) -> None:
        self.link = None if link is None else link_spec(link)
        self._link_free_at = 0.0
        self._lock = threading.Lock()
        # The CPU: one compute stream for every run of this backend. Work on it is done when the
        # call returns, so it never holds a pending work or a lane's event: nothing of a run
        # stays on it, and runs need not build one each.
        self._cpu = HostStream("compute", inline=True)

    def describe(self) -> str:
        if self.link is None:
            return "host (real gloo comm)"
        return f"host (modeled link {self.link.name}: {self.link.latency_s * 1e6:g} us + {self.link.bandwidth_Bps / 1e9:g} GB/s)"

    def attach(self, run: DBORun, state: RunStreams) -> None:
        # The CPU is one compute stream for every ubatch; under the ubatch policy each ubatch gets
        # a comm stream of its own (its own FIFO of works), as a device backend gives it one.
        cpu = self._cpu
        kept = state.kept
        if kept is not None and kept[0] is self and kept[1] == state.policy:
            for lane in state.lanes:  # its streams and events are an earlier run's, emptied (keep)
                lane.stream = lane.ub.resume_with = cpu
            return
        state.kept = None
        shared_comm = HostStream("comm", inline=False)
        for lane in state.lanes:
            comm = shared_comm if state.policy == "role" else HostStream(f"ub{lane.ub.id}:comm", inline=False)
            lane.streams = {"compute": cpu, "comm": comm}
            # The CPU runs compute synchronously and comm never joins it (see submit): a
            # compute-done event would always be empty, so there is none to record or wait on.
            # A comm-done event is there only while its stream has works pending: recorded on an
            # idle stream it would be empty too. submit() puts it in place when the stream gets a
            # work, record() takes it out once every work has completed; the primitives skip the
            # record and the wait of a None event. Those two Python calls per comm->compute switch
            # were most of the host time per yield left with the C primitives: on
            # benchmarks/host_overhead.py's ht step (no comm, 61 layers) 179-251 ns with them and
            # 74-132 ns without (N = 8 / 2, CPU time, one run each, 2026-12-01).
            lane.events = {"compute": None, "comm": None}
            comm.lanes.append((lane.events, HostEvent()))
            lane.stream = lane.ub.resume_with = cpu
        if state.policy in ("role", "ubatch"):  # what keep() may hand the next run, and its counts now
            del shared_comm, comm
            objs = _kept_objects(state.lanes)
            comms = tuple(obj for obj in objs if type(obj) is HostStream)
            pairs = tuple(pair for c in comms for pair in c.lanes)
            # references to each of objs (asyncdbo._core.refcounts), read here and in keep from
            # frames that hold none of them but through the tuple, so that two reads agree
            state.kept = (self, state.policy, objs, counts(objs, ()), comms, pairs)

    def keep(self, state: RunStreams) -> bool:
        """Keep the lanes' streams and events for the next run of ``state``'s lanes (a run shell's),
        so that :meth:`attach` builds none: only while nothing but the lanes and their streams
        refers to them (a stream or dict taken out of a lane during the run is never handed to
        another run; the counts below, as the shell's own, show it), and emptied of this run's
        works first."""
        kept = state.kept
        if kept is None or kept[0] is not self:
            return False
        _, _, objs, expected, comms, pairs = kept
        # whether a comm stream has works pending, with no loop variable holding a stream while the
        # counts are read (the role policy's one shared stream read at once: any/map cost 165 ns)
        busy = bool(comms[0].pending) if len(comms) == 1 else any(map(_PENDING, comms))
        if busy:
            expected = _busy_counts(expected, objs, comms, pairs)
        if not same_counts(objs, (), expected):
            state.kept = None
            return False
        if busy:
            for comm in comms:  # drop every work of the run its comm streams ...
                if comm.pending:
                    comm.pending = []
                    comm.arm(False)
        for pair in pairs:  # ... and their events hold
            event = pair[1]
            if event.recorded:
                event.works = ()
                event.recorded = False
        return True

    def new_event(self) -> HostEvent:
        return HostEvent()

    def record(self, event: HostEvent, stream: HostStream) -> None:
        event.recorded = True
        if not stream.pending:  # the common case on the compute stream: nothing queued, no allocation
            event.works = ()
            return
        stream.pending = [w for w in stream.pending if not w.succeeded()]  # a failure stays to be reported
        event.works = tuple(stream.pending)
        if not stream.pending:
            stream.arm(False)  # idle again: the next records would be empty

    def wait(self, stream: HostStream, event: HostEvent) -> Signal | None:
        if not event.works:
            return None
        pending = [w for w in event.works if not w.succeeded()]
        if not pending:
            return None
        # The first wait on a work in flight: from here until it completes the waiting ubatch is
        # parked, so the comm is hidden only if another ubatch computes (serving.measure reads it).
        now = pending[0].clock.now()
        for w in pending:
            w.waited(now)
        if len(pending) == 1:
            return pending[0].signal  # awaiting it raises if the work failed
        # named by the works ("ub0 dispatch + ub1 dispatch": under the role policy one ubatch's
        # event covers every comm queued on the shared stream before it); waits and dumps show it
        name = " + ".join(w.what if w.ub is None else f"ub{w.ub} {w.what}" for w in pending)
        joined = Signal(name, external=True, arrivals=len(pending))
        for w in pending:  # the first failure completes the join with that error
            w.signal.add_waiter(_forward(w.signal, joined))
        return joined

    def submit(self, work: Any, lane: UBatchStreams | None, *, nbytes: int = 0, what: str = "comm",
               **options: Any) -> HostWork:
        """Track ``work`` (a torch.distributed Work with ``get_future()``).

        Inside a DBO run (``lane`` given) it joins that ubatch's current comm stream (from the
        compute role it joins no stream: the schedule awaits the handle); outside, it is waited
        for at once (serial semantics). ``options`` (the sim's race-checker hints) are
        ignored."""
        if lane is None:
            run = stamps = None
        else:
            run = lane.ub.run
            state = run.ext
            stamps = state.stamps
            if stamps is None:  # the run's first work: its stamps (asyncdbo.dbo.shell drops them after the run)
                stamps = state.stamps = CommStamps()
        clock = _MONOTONIC if run is None else run.clock
        hw = HostWork(what, nbytes, work, arrivals=2 if self.link is not None else 1, clock=clock,
                      ub=None if lane is None else lane.ub.id, stamps=stamps)
        if self.link is not None:
            with self._lock:
                start = max(hw.t_issue, self._link_free_at)
                self._link_free_at = start + nbytes / self.link.bandwidth_Bps
                release = hw.stamps.t_release[hw.row] = start + self.link.transfer_s(nbytes)
            if run is not None:
                run.call_at(release, hw.signal.set)
            else:
                hw.signal.set()  # the blocking wait() below sleeps until the release time
        work.get_future().add_done_callback(hw._on_complete)
        if lane is None:
            hw.wait()
            return hw
        stream = lane.stream
        assert isinstance(stream, HostStream), stream
        if not stream.inline:
            # Comm issued from the compute role (the CPU) is waited for where the schedule awaits
            # it, as on a device (see AcceleratorBackend): the shared CPU stream's events must not
            # make one ubatch wait for another ubatch's sends.
            if not stream.pending:
                stream.arm(True)
            stream.pending.append(hw)
        lane.ub.run.ext.comm.append(hw)  # every work of the run, for the numbers tools report
        return hw

    def comm_record(self, handle: Any) -> CommRecord:
        assert isinstance(handle, HostWork), handle
        return handle.stamps.record(handle.row)


_SHARED: list[HostBackend] = []


def host_backend(**options: Any) -> HostBackend:
    """``get_backend("host", **options)``: without options the process's one shared
    :class:`HostBackend` (without a modeled link it keeps no state between runs: a run's streams
    live in its lanes, built by ``attach`` or kept there by :meth:`HostBackend.keep`), so a run
    that names its backend builds none; with options a new one."""
    if options:
        return HostBackend(**options)
    if not _SHARED:
        _SHARED.append(HostBackend())
    return _SHARED[0]
