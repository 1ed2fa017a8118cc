"""Simulated device: virtual streams on a virtual clock, a cost model, and a race checker.

Every torch op a ubatch issues during the run executes on the CPU for real (the numbers are the
real model's) and is also placed on the ubatch's current *virtual* stream with the duration the
cost model gives it on the modeled device (see :mod:`asyncdbo.sim.cost`). Comm handed to
:meth:`SimBackend.submit` takes ``latency + bytes / bandwidth`` of the modeled link. Events record
and wait with device semantics on the virtual clock, so the makespan of the run is the step time
the schedule would have on that device, and the timeline shows what overlapped.

With ``check_races`` every storage read and write is also checked for happens-before across
streams (:mod:`asyncdbo.sim.races`). At the end of the run the backend raises
:class:`~asyncdbo.sim.races.SimCheckError` for races and dead waits (``on_problem="raise"``) or
only records them (``"record"``); lost overlap (an event recorded after a yield) is correct but
serial, so it is reported, never raised. The last run's :class:`SimReport` is ``backend.report``.

The interception is a ``TorchDispatchMode`` entered from ``attach`` to ``detach``. Ops issued
while it is active by code that is not a ubatch of this run pass through untouched.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._core import Instrument, get_ubatch
from ..backends import LinkSpec, RunStreams, StreamBackend, UBatchStreams, link_spec
from .clock import Engine, Span, Timeline, VEvent, VStream
from .cost import CostModel
from .devices import DeviceSpec, device_spec
from .ops import FACTORY, is_view, storage_key, tensor_items
from .races import DeadWait, LostOverlap, RaceChecker, SimCheckError, Site, user_place
from .report import SimReport

if TYPE_CHECKING:
    from .._core import DBORun

__all__ = ["SimBackend", "SimHandle", "SimReport"]

log = logging.getLogger("asyncdbo")


class SimHandle:
    """A submitted comm op; ``t_done`` is its modeled completion time. Awaiting it never parks.

    A transfer issued on a comm stream is ordered by that stream, and awaiting its handle does
    nothing more. A transfer issued from the compute role (the low-latency schedule: send now,
    receive later) runs in the background; awaiting its handle (or ``wait()``) makes the awaiting
    ubatch's current stream wait for its completion, like waiting on the receive's event."""

    __slots__ = ("backend", "event", "nbytes", "t_done", "t_start", "what")

    def __init__(self, what: str, nbytes: int, t_start: float, t_done: float, *, backend: SimBackend | None = None,
                 event: VEvent | None = None) -> None:
        self.what, self.nbytes, self.t_start, self.t_done = what, nbytes, t_start, t_done
        self.backend, self.event = backend, event

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        if self.event is not None and self.backend is not None:
            ub = get_ubatch()
            if ub is not None and ub.run is self.backend._run:
                self.backend.wait(ub.ext.stream, self.event)

    def __await__(self) -> Any:
        self.wait()
        return iter(())

    def __repr__(self) -> str:
        return f"<SimHandle {self.what} {self.nbytes}B {self.t_start * 1e6:.1f}-{self.t_done * 1e6:.1f}us>"


class _Finisher(Instrument):
    def __init__(self, backend: SimBackend) -> None:
        self.backend = backend

    def run_finished(self, run: DBORun, exc: BaseException | None) -> None:
        self.backend._finish(run, exc)


class _Mode(TorchDispatchMode):
    def __init__(self, backend: SimBackend) -> None:
        super().__init__()
        self.backend = backend

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ub = get_ubatch()
        if ub is not None and ub.run is self.backend._run:
            self.backend._on_op(ub, func, args, kwargs, out)
        return out


class SimBackend(StreamBackend):
    """Simulated device streams (see the module docstring).

    device: a :class:`DeviceSpec` or preset name (``h200``, ``h100``, ``ascend910b``). link: a
    :class:`LinkSpec` or preset name (``nvlink``, ``ib400``, ``eth100``, ``hccs``). check_races: run
    the happens-before checker (slower: it walks the stack once per op). on_problem: ``raise`` or
    ``record`` races and dead waits. comm_scale: multiplies every submitted byte count (e.g. the
    share of an all-to-all that leaves the rank, see :mod:`asyncdbo.sim.predict`).
    """

    name = "sim"
    _active: DBORun | None = None  # the one sim run in progress (see attach)

    def __init__(
        self,
        *,
        device: str | DeviceSpec = "h200",
        link: str | LinkSpec = "ib400",
        check_races: bool = True,
        on_problem: str = "raise",
        comm_scale: float = 1.0,
    ) -> None:
        if on_problem not in ("raise", "record"):
            raise ValueError(f"on_problem must be 'raise' or 'record' (got {on_problem!r})")
        if not comm_scale >= 0:
            raise ValueError(f"comm_scale must be >= 0 (got {comm_scale!r})")
        self.device = device_spec(device)
        self.link = link_spec(link)
        self.cost = CostModel(self.device)
        self.check_races = check_races
        self.on_problem = on_problem
        self.comm_scale = comm_scale
        self.report: SimReport | None = None
        self._run: DBORun | None = None
        self._mode: _Mode | None = None

    def describe(self) -> str:
        return f"sim ({self.device.name}, {self.link.name})"

    # ------------------------------------------------------------------ run lifecycle
    def attach(self, run: DBORun, state: RunStreams) -> None:
        from .._core import Fanout

        policy = state.policy

        if SimBackend._active is not None:
            # The dispatch mode is a per-thread stack: two interleaved sim runs would pop each
            # other's mode. One at a time keeps every op attributed to the right run. The refused
            # run never starts: close its coroutines so none is reported as never awaited.
            for ub in run.ubatches:
                ub.coro.close()
            raise RuntimeError(
                f"a sim run ({SimBackend._active.name!r}) is already in progress in this process; the sim backend "
                "runs one DBO run at a time: await it before starting another"
            )
        SimBackend._active = run
        self._run = run
        self._policy = policy
        self._compute = Engine("compute")
        self._link = Engine(f"link {self.link.name}")
        self._comm_sms = Engine("comm SMs")
        self._comm_bytes = 0
        self._timeline = Timeline()
        self._checker = RaceChecker() if self.check_races else None
        self._lost: list[LostOverlap] = []
        self._waits_unrecorded: list[tuple[VEvent, Site]] = []
        self._pending_c10d: tuple[Any, VStream, set[int], set[int], Site, int] | None = None
        self._ub_end: dict[tuple[int, int], float] = {}  # (stream id, ubatch) -> end of its last op
        self._last_ub: dict[int, int] = {}  # stream id -> ubatch of its last op
        self.report = SimReport(self.device.name, self.link.name, policy, len(run.ubatches))
        shared = {"compute": VStream("compute"), "comm": VStream("comm")}
        for lane in state.lanes:
            if policy == "role":
                lane.streams = dict(shared)
            else:
                own = VStream(f"ub{lane.ub.id}")
                lane.streams = {"compute": own, "comm": own}
            lane.events = {"compute": VEvent(), "comm": VEvent()}
            lane.stream = lane.ub.resume_with = lane.streams["compute"]
        fin = _Finisher(self)
        run.instrument = fin if run.instrument is None else Fanout(run.instrument, fin)
        self._mode = _Mode(self)
        self._mode.__enter__()

    def detach(self, run: DBORun, state: RunStreams) -> None:
        if SimBackend._active is run:
            SimBackend._active = None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._run = None

    def _finish(self, run: DBORun, exc: BaseException | None) -> None:
        self._flush_c10d()
        rep = self.report
        assert rep is not None
        rep.spans = self._timeline.spans
        rep.makespan_s = self._timeline.end
        rep.compute_busy_s = self._compute.busy_s
        rep.comm_busy_s = sum(sp.end - sp.start for sp in rep.spans if sp.kind == "comm")
        rep.lost_overlaps = self._lost
        rep.races = list(self._checker.races) if self._checker is not None else []
        rep.dead_waits = [DeadWait(site) for ev, site in self._waits_unrecorded if not ev.recorded]
        rep.dead_waits += [DeadWait(site, ev.by) for ev, site in self._waits_unrecorded if ev.recorded]
        rep.switches, rep.parks = run.num_switches, run.num_parks
        rep.comm_bytes = self._comm_bytes
        for lo in rep.lost_overlaps:
            log.warning("asyncdbo sim: %s", lo)
        if exc is None and rep.problems and self.on_problem == "raise":
            raise SimCheckError(rep.problems)

    # ------------------------------------------------------------------ places
    def _site(self, ub: Any, stream: VStream, op: str) -> Site:
        return Site(None if ub is None else ub.id, None if ub is None else ub.tag, stream.name, user_place(), op)

    # ------------------------------------------------------------------ streams and events
    def new_event(self) -> VEvent:
        return VEvent()

    def record(self, event: VEvent, stream: VStream) -> None:
        self._flush_c10d()
        ub = get_ubatch()
        event.recorded = True
        event.t = stream.t
        event.by = self._site(ub, stream, "record event")
        event.covers_foreign = None
        if self._checker is not None:
            event.clock = self._checker.record(stream.id)
        if ub is not None:
            last = self._last_ub.get(stream.id)
            own_end = self._ub_end.get((stream.id, ub.id))
            if last is not None and last != ub.id and own_end is not None and stream.t > own_end:
                event.covers_foreign = (last, own_end)

    def wait(self, stream: VStream, event: VEvent) -> None:
        self._flush_c10d()
        ub = get_ubatch()
        if not event.recorded:
            # A device would hang here (NPU) or not wait at all (CUDA): report it at the end.
            self._waits_unrecorded.append((event, self._site(ub, stream, "wait event")))
            return
        before = stream.t
        stream.t = max(stream.t, event.t)
        if self._checker is not None:
            self._checker.wait(stream.id, event.clock)
        if event.covers_foreign is not None:
            foreign, own_end = event.covers_foreign
            lost = event.t - max(before, own_end)
            if lost > 0:
                self._lost.append(LostOverlap(self._site(ub, stream, "wait event"), event.by, foreign, lost))
        return

    # ------------------------------------------------------------------ ops
    def _place(self, ub: Any, stream: VStream, kind: str, name: str, dur: float, engine: Engine, extra: float = 0.0) -> tuple[float, float]:
        start = engine.reserve(stream.t, dur)
        end = start + dur + extra
        stream.t = end
        self._timeline.add(Span(stream.name, kind, name, start, end, ub.id, ub.tag))
        self._ub_end[(stream.id, ub.id)] = end
        self._last_ub[stream.id] = ub.id
        return start, end

    def _on_op(self, ub: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        stream = ub.ext.stream
        assert isinstance(stream, VStream), stream
        if func.namespace == "c10d":
            self._flush_c10d()
            self._c10d_op(ub, stream, func, args, kwargs)
            return
        self._flush_c10d()
        if func is torch.ops.aten._local_scalar_dense.default:
            if self._checker is not None:
                self._checker.sync_all_to(stream.id)  # .item(): the host waits for this stream
            return
        cost = self.cost.op_cost(func, args, kwargs, out)
        if cost.seconds > 0:
            # Ops a ubatch issues in its comm role (packing rows for a dispatch, say) run on the SMs
            # the comm kernels own (DeepEP fuses them into its kernels): they take stream time but
            # not the compute engine, so they never queue behind the other ubatch's compute.
            engine = self._comm_sms if ub.ext.role == "comm" and self._policy == "role" else self._compute
            self._place(ub, stream, "compute", ub.tag or "compute", cost.seconds, engine)
        if self._checker is not None and not is_view(func):
            # Allocations (empty, new_empty) cost nothing but still start a fresh history: the CPU
            # allocator reuses addresses, while a device's caching allocator keeps each block on
            # the stream that allocated it, so an old access to the address is no dependency.
            reads, writes = self._accesses(func, args, kwargs, out)
            self._checker.access(stream.id, reads, writes, self._site(ub, stream, str(func.name())))

    def _accesses(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[set[int], set[int]]:
        schema = func._schema
        factory = bool(FACTORY.match(schema.name.split("::")[-1]))
        reads: set[int] = set()
        writes: set[int] = set()
        for i, a in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(a.name)
            for t in tensor_items(value):
                k = storage_key(t)
                if k is None:
                    continue
                if a.alias_info is not None and a.alias_info.is_write:
                    writes.add(k)
                elif not factory:
                    reads.add(k)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for r, o in zip(schema.returns, outs):
            if r.alias_info is None:
                for t in tensor_items(o):
                    k = storage_key(t)
                    if k is not None:
                        assert self._checker is not None
                        self._checker.fresh(k)
                        writes.add(k)
        return reads, writes

    # ------------------------------------------------------------------ comm
    def _c10d_op(self, ub: Any, stream: VStream, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A c10d collective: its first argument is its output (c10d schemas don't say so)."""
        name = func._schema.name.split("::")[-1]
        outs = {k for t in tensor_items(args[0] if args else ()) if (k := storage_key(t)) is not None}
        ins = {k for a in args[1:] for t in tensor_items(a) if (k := storage_key(t)) is not None}
        if name.startswith(("allreduce", "broadcast", "reduce_")):
            ins |= outs  # in place
        sent = [t for a in args[1:] for t in tensor_items(a)] or tensor_items(args[0] if args else ())
        nbytes = sum(self.cost.nbytes(t) for t in sent)  # what this rank sends, at the device's dtype
        self._pending_c10d = (ub, stream, ins, outs, self._site(ub, stream, f"c10d::{name}"), nbytes)

    def _flush_c10d(self, nbytes: int | None = None, what: str | None = None) -> SimHandle | None:
        pending, self._pending_c10d = self._pending_c10d, None
        if pending is None:
            return None
        ub, stream, reads, writes, site, seen_bytes = pending
        return self._comm(ub, stream, reads, writes, site, seen_bytes if nbytes is None else nbytes, what or site.op)

    def _comm(self, ub: Any, stream: VStream, reads: set[int], writes: set[int], site: Site, nbytes: int, what: str) -> SimHandle:
        """A transfer of ``nbytes`` on ``stream``: it occupies the link for bytes / bandwidth and
        completes a latency later; its outputs count as written by ``stream`` at completion."""
        wire = nbytes * self.comm_scale
        self._comm_bytes += int(wire)
        if self._policy == "role" and ub.ext.role == "compute":
            return self._background_comm(ub, stream, reads, writes, site, wire, what)
        start, end = self._place(ub, stream, "comm", what, wire / self.link.bandwidth_Bps, self._link, self.link.latency_s)
        if self._checker is not None:
            self._checker.access(stream.id, reads, writes, site)
        return SimHandle(what, int(wire), start, end)

    def _background_comm(self, ub: Any, stream: VStream, reads: set[int], writes: set[int], site: Site, wire: float,
                         what: str) -> SimHandle:
        """A transfer issued from the compute role under role streams (the low-latency schedule,
        DeepEP's send + recv hook): it leaves once the issuing stream's work so far is done, but
        does not hold that shared stream, which keeps computing (both ubatches' kernels) while the
        bytes move. Its writes belong to a stream of its own, so reading the received buffer
        before awaiting the handle is an early read."""
        bg = VStream(f"{stream.name}:{what}")
        send = VEvent()
        self.record(send, stream)
        send.covers_foreign = None  # the send waits for what was queued; overlap is not lost here
        self.wait(bg, send)
        start = self._link.reserve(bg.t, wire / self.link.bandwidth_Bps)
        end = start + wire / self.link.bandwidth_Bps + self.link.latency_s
        bg.t = end
        self._timeline.add(Span(bg.name, "comm", what, start, end, ub.id, ub.tag))
        if self._checker is not None:
            self._checker.access(bg.id, reads, writes, replace(site, stream=bg.name))
        done = VEvent()
        self.record(done, bg)
        return SimHandle(what, int(wire), start, end, backend=self, event=done)

    def submit(  # type: ignore[override]
        self,
        work: Any,
        lane: UBatchStreams | None,
        *,
        nbytes: int = 0,
        what: str = "comm",
        outputs: tuple[torch.Tensor, ...] | list[torch.Tensor] = (),
        inputs: tuple[torch.Tensor, ...] | list[torch.Tensor] = (),
    ) -> SimHandle:
        """Model one comm op on the running ubatch's current stream.

        ``work``: the ``torch.distributed`` work the caller issued (waited for now: its data is
        real; only its timing is modeled), or None for a modeled-only transfer whose ``outputs``
        and ``inputs`` the race checker should see. The c10d op that produced ``work`` was already
        seen by the dispatch mode and supplies the written buffers itself."""
        if work is not None:
            work.wait()
        if lane is None or lane.ub.run is not self._run:
            self._pending_c10d = None
            return SimHandle(what, nbytes, 0.0, 0.0)
        if self._pending_c10d is not None:  # its own byte count (device dtype) beats the caller's
            handle = self._flush_c10d(None, what)
            assert handle is not None
            return handle
        ub, stream = lane.ub, lane.stream
        reads = {k for t in inputs if (k := storage_key(t)) is not None}
        writes = {k for t in outputs if (k := storage_key(t)) is not None}
        return self._comm(ub, stream, reads, writes, self._site(ub, stream, what), nbytes, what)
