"""Transfers on the simulated device: where a comm op runs, what it costs, who waits for it.

A collective runs on a stream of its own that first waits for the work queued on the issuing stream
(NCCL/HCCL run each communicator on its own stream). Issued from a comm stream (the ``ht``
schedule), the issuing stream waits for it at once: it holds that stream until it completes, as
``work.wait()`` in the accelerator backend makes it. Issued from the compute role (the ``ll``
schedule: send now, receive later), nothing waits until its :class:`SimHandle` is awaited or its
``stream_wait`` runs (in a recv hook). Its cost: the link's latency and bandwidth, the comm
library's efficiency, fixed cost, payload format and node dedup (:mod:`asyncdbo.sim.comm`), the
straggler delay of an imbalanced combine, and the HBM time its bytes take (``contention``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .._core import get_ubatch
from .clock import Engine, Span, Timeline, VEvent, VStream
from .comm import CommSpec, payload_scale
from .ops import storage_key, tensor_items
from .races import LostOverlap, RaceChecker, Site

if TYPE_CHECKING:
    from ..backends import LinkSpec
    from .cost import CostModel
    from .devices import DeviceSpec
    from .host import HostTimeline

__all__ = ["NOT_YET", "SimHandle", "Transfers", "Watch"]

NOT_YET = 1 << 30  # the segment of received data nobody waited for yet


@dataclass(eq=False)
class Watch:
    """A transfer issued in the segment its data was produced in: if the same ubatch also uses
    it (waits on it or reads what it wrote) in that segment, no yield ever let another ubatch's
    work overlap it (``comm-not-overlapped``)."""

    ubatch: int
    segment: int
    site: Site
    keys: set[int] = field(default_factory=set)


class SimHandle:
    """A submitted comm op. ``await handle`` (or :meth:`stream_wait`) makes the current stream of
    the ubatch running it wait for the transfer's completion; a transfer that already holds the
    issuing comm stream until it completes needs nothing more. Never parks."""

    __slots__ = ("backend", "event", "nbytes", "owner", "owner_waited", "received", "seg", "site", "t_done", "t_start",
                 "watch", "what", "writes")
    backend: Transfers | None

    def __init__(self, what: str, nbytes: int, t_start: float, t_done: float, *, backend: Transfers | None = None,
                 event: VEvent | None = None, writes: frozenset[int] = frozenset()) -> None:
        self.what, self.nbytes, self.t_start, self.t_done = what, nbytes, t_start, t_done
        self.backend, self.event, self.writes = backend, event, writes
        self.watch: Watch | None = None
        self.owner: int | None = None  # the ubatch that issued it
        self.owner_waited = False  # whether the owner itself waited on it (not only another's recv hook)
        self.received = False  # whether any stream waited on it yet (the owner's or another ubatch's)
        self.seg = 0  # the owner's segment when it was issued
        self.site: Site | None = None

    def done(self) -> bool:
        return True

    def stream_wait(self) -> None:
        """Order the running ubatch's current stream after this transfer (a device stream wait)."""
        w, be = self.watch, self.backend
        if w is not None and be is not None and ("comm-not-overlapped", w.site.place) in be.fix:
            ub = get_ubatch()
            if ub is not None and ub.id == w.ubatch and be._segment.get(ub.id) == w.segment and not self.owner_waited:
                # the counterfactual, for a wait no yield can precede (a recv hook the owner ran at
                # once): it moves past the owner's next yield, as an await would (``__await__``)
                be._deferred.setdefault(ub.id, []).append(self)
                return
        self._wait_now()

    def _wait_now(self) -> None:
        if self.event is not None and self.backend is not None:
            ub = get_ubatch()
            if ub is not None and ub.run is self.backend._run:
                if self.writes & self.backend._watch.keys():
                    self.backend._used(ub, set(self.writes))
                if ub.id == self.owner:
                    if not self.received:
                        self.backend._own_receive(ub, self)
                    self.owner_waited = True
                self.received = True
                self.backend.wait(ub.ext.stream, self.event)
                for k in self.writes:  # the rows are usable from here on
                    self.backend._seg_of[k] = min(self.backend._seg_of.get(k, NOT_YET), self.backend._segment[ub.id])

    wait = stream_wait

    def __await__(self) -> Any:
        w, be = self.watch, self.backend
        if w is not None and be is not None and ("comm-not-overlapped", w.site.place) in be.fix:
            ub = get_ubatch()
            if ub is not None and ub.id == w.ubatch and be._segment.get(ub.id) == w.segment:
                if ("yield-before-use", w.site.place) in be.fix:
                    # the counterfactual where the data is used before the next yield: a yield
                    # before the wait lets another ubatch's work overlap the transfer
                    from ..dbo import dbo_yield

                    aw: Any = dbo_yield("sim: counterfactual yield")
                    # the C primitive returns an object with __await__, the Python one a
                    # generator-based coroutine (types.coroutine), which has none: iterate either
                    yield from (aw.__await__() if hasattr(aw, "__await__") else aw)
                elif self.owner_waited:  # already used in this segment: the await cannot move
                    be.undeferred.add(("comm-not-overlapped", w.site.place))
                else:
                    # the counterfactual: the await moves past the ubatch's next yield (the fixed
                    # schedule awaits it once the other ubatch ran), unless its data is used first
                    be._deferred.setdefault(ub.id, []).append(self)
                    return
        self._wait_now()

    def __repr__(self) -> str:
        return f"<SimHandle {self.what} {self.nbytes}B {self.t_start * 1e6:.1f}-{self.t_done * 1e6:.1f}us>"



class Transfers:
    """The comm half of :class:`~asyncdbo.sim.backend.SimBackend` (a mixin; see the module docstring)."""

    device: DeviceSpec
    link: LinkSpec
    comm: CommSpec
    cost: CostModel
    check_races: bool
    comm_scale: float
    contention: bool
    imbalance: float
    node_dedup: float
    _run: Any
    _link: Engine
    _compute: Engine
    _timeline: Timeline
    _host: HostTimeline
    _clocks: RaceChecker
    _lost: list[LostOverlap]
    _pending_c10d: tuple[Any, VStream, set[int], set[int], Site, int] | None
    _comm_bytes: int
    _device_counts: set[int]
    _dispatch_done: dict[int, float]
    _segment: dict[int, int]
    _seg_of: dict[int, int]
    _seg_seq: dict[tuple[int, int, int], int]
    _ub_seq: dict[tuple[int, int], int]
    _ub_end: dict[tuple[int, int], float]
    _multi: bool
    _comm_derived: set[int]
    _host_known: set[int]
    _watch: dict[int, Watch]
    _seg_host: dict[tuple[int, int], float]
    _relocated: dict[int, float]
    _pending_reads: dict[int, SimHandle]
    _seg_end: dict[tuple[int, int, int], float]
    fix: frozenset[tuple[str, str]]
    _deferred: dict[int, list[SimHandle]]
    undeferred: set[tuple[str, str]]
    _policy: str
    _hook_out: dict[int, int]
    _unreceived: dict[int, list[SimHandle]]

    _comm_ids: set[int]
    plain: bool
    _written_at: dict[int, float]

    def _lost_overlap(self, lo: LostOverlap) -> bool:
        raise NotImplementedError

    _late_waits: dict[tuple[int, int], float]
    _last_comm: dict[int, Site]

    def _late_wait(self, ub: Any, stream: VStream) -> None:
        """The ``comm-wait-blocks-other`` counterfactual: a wait ``ub`` put off applies before its
        next op (or record) on ``stream``."""
        if self._late_waits and ub is not None and (k := (stream.id, ub.id)) in self._late_waits:
            stream.t = max(stream.t, self._late_waits.pop(k))

    def _settle(self, ub: Any, reads: set[int] | frozenset[int] = frozenset()) -> None:
        """Apply the waits a ``comm-not-overlapped`` counterfactual moved past ``ub``'s next yield
        (:meth:`SimHandle.__await__`): once that yield is behind it, on the stream it runs on now,
        where the fixed schedule's await would wait; before it, where an op reads what the transfer
        wrote (``reads``): then the await cannot move, and the key goes to ``undeferred`` (the
        counterfactual is rerun with a yield before the await instead)."""
        pending = self._deferred.get(ub.id) if self._deferred else None
        if not pending:
            return
        seg = self._segment[ub.id]
        due = [h for h in pending if h.watch is None or seg > h.watch.segment or reads & h.writes]
        if not due:
            return
        rest = [h for h in pending if h not in due]
        if rest:
            self._deferred[ub.id] = rest
        else:  # none left: ops stop checking (``if self._deferred``)
            del self._deferred[ub.id]
        for h in due:
            if h.watch is not None and seg == h.watch.segment:
                self.undeferred.add(("comm-not-overlapped", h.watch.site.place))
            h._wait_now()

    def _used(self, ub: Any, keys: set[int]) -> None:
        """``ub`` waits on or reads what a watched transfer wrote: report it if that happens in the
        segment the transfer and its data came from (see :class:`Watch`)."""
        for k in keys:
            w = self._watch.pop(k, None)
            if w is None:
                continue
            for other in w.keys:
                self._watch.pop(other, None)
            if ub.id == w.ubatch and self._segment[ub.id] == w.segment:
                self._lost_overlap(LostOverlap("comm-not-overlapped", w.site, None, None))

    def _holds_hook_of(self, owner: int) -> bool:
        """Whether some ubatch still holds an unrun recv hook of ``owner``."""
        for u in self._run.ubatches:
            held = getattr(getattr(u.ext, "recv_hook", None), "__self__", None)
            if held is not None and owner in getattr(held, "owners", (getattr(held, "owner", None),)):
                return True
        return False

    def _hooks_at_yield(self, ub: Any, seg: int) -> None:
        """At ``ub``'s yield under role streams: note whether another ubatch holds a recv hook of it
        (``empty-recv-hook``); in that kind's counterfactual, wait here for the receives of the
        hooks that ran meanwhile and received nothing, as a hook that receives would have."""
        if self._policy != "role" or not self._multi:
            return
        for owner, pending in self._unreceived.items():
            pending[:] = [h for h in pending if not h.received]
            if owner == ub.id or self._holds_hook_of(owner):
                continue
            for h in pending:
                fixed = h.site is not None and ("empty-recv-hook", h.site.place) in self.fix
                if fixed and self._hook_out.get(owner) == h.seg:
                    ub.ctx_run(h._wait_now)
        if self._holds_hook_of(ub.id):
            self._hook_out[ub.id] = seg

    def _own_receive(self, ub: Any, h: SimHandle) -> None:
        """The owner's own wait is the first on ``h``: where it yielded after issuing ``h`` with a
        recv hook held by another ubatch, and that hook has run, the hook received nothing."""
        if (self._policy == "role" and self._multi and h.site is not None and self._hook_out.get(ub.id) == h.seg
                and self._segment.get(ub.id, 0) > h.seg and not self._holds_hook_of(ub.id)):
            wait = self._site(ub, ub.ext.stream, f"wait on {h.what}")
            self._lost_overlap(LostOverlap("empty-recv-hook", h.site, wait, None))

    def wait(self, stream: VStream, event: VEvent) -> None:
        raise NotImplementedError

    def _site(self, ub: Any, stream: VStream, op: str) -> Site:
        raise NotImplementedError

    def _place(self, ub: Any, stream: VStream, kind: str, name: str, dur: float, engine: Engine, extra: float = 0.0,
               ready: float = 0.0) -> tuple[float, float]:
        raise NotImplementedError

    def _tick(self, ub: Any, stream: VStream) -> None:
        raise NotImplementedError

    def _covers_foreign(self, ub: Any, stream: VStream) -> tuple[int, float] | None:
        raise NotImplementedError

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
        """A transfer of ``nbytes`` issued on ``stream`` (module docstring: where it runs and who
        waits for it); its outputs count as written by the stream it runs on."""
        self._settle(ub, reads)
        lane = ub.ext
        low_latency = not (lane.role == "comm" and (self.plain or lane.streams["comm"] is not lane.streams["compute"]))
        spec = self.comm
        scale = self.comm_scale
        if what == "dispatch" and spec.fp8_dispatch:
            scale *= payload_scale(True)
        if what in ("dispatch", "combine") and spec.node_dedup and not low_latency:
            scale *= self.node_dedup
        on_device = what == "counts" and low_latency and spec.counts_on_device
        if on_device:  # the counts ride with the data and stay on the device (DeepEP low latency)
            self._device_counts |= writes
        wire = 0.0 if on_device else nbytes * scale
        self._comm_bytes += int(wire)
        dur = wire / (self.link.bandwidth_Bps * spec.link_efficiency(self.link.name, low_latency))
        latency = 0.0 if on_device else self.link.latency_s + (spec.ll_fixed_s if low_latency else spec.fixed_s)
        ready = self._host.launch_comm()
        self._late_wait(ub, stream)
        if self._relocated:  # counterfactual compute moved off this comm stream: wait for what it made
            stream.t = max([stream.t] + [self._relocated.get(k, 0.0) for k in reads])
        if what == "combine" and self.imbalance > 1:  # the busiest rank's experts finish later
            latency += (self.imbalance - 1) * max(0.0, stream.t - self._dispatch_done.get(ub.id, stream.t))
        watch = None
        if self._multi and self.check_races and dur + latency > 0:
            known = [self._seg_of[k] for k in reads if k in self._seg_of]
            if (max(known) if known else self._segment[ub.id]) == self._segment[ub.id]:
                watch = Watch(ub.id, self._segment[ub.id], site, set(writes))
            if ("comm-not-overlapped", site.place) in self.fix and not low_latency:
                dur = latency = 0.0  # the counterfactual, used without an await: the most a yield could hide
        if low_latency:
            handle = self._background(ub, stream, reads, writes, site, wire, dur, latency, ready, what)
        else:
            start, end = self._place(ub, stream, "comm", what, dur, self._link, latency, ready=ready)
            self._comm_ids.add(stream.id)
            self._last_comm[stream.id] = site
            self._contend(start, wire)
            if self.check_races:
                self._clocks.access(stream.id, reads, writes, site)
            else:
                self._tick(ub, stream)
            handle = SimHandle(what, int(wire), start, end)
        if what == "dispatch":
            self._dispatch_done[ub.id] = handle.t_done
        self._comm_derived |= writes
        self._host_known -= writes
        for k in writes:
            self._written_at[k] = handle.t_done
        if watch is not None:
            for k in writes:
                self._watch[k] = watch
            handle.watch = watch
        return handle

    def _late_send(self, ub: Any, stream: VStream, reads: set[int]) -> tuple[int | None, float, float] | None:
        """(the other ubatch that queued work on the stream since, if any; end of own work on the
        stream; host time at the yield) when this send's data was ready in an earlier segment of
        this ubatch (before a yield): issued before the yield, it would have left then, not after
        the other ubatch's launches (and, on a shared stream, its work). Without access tracking,
        the stream's last op being another ubatch's is the sign."""
        if not self.check_races:
            own_end = self._ub_end.get((stream.id, ub.id), 0.0)
            covers = self._covers_foreign(ub, stream)
            return None if covers is None else (covers[0], covers[1], 0.0)
        known = [self._seg_of[k] for k in reads if k in self._seg_of]
        seg = max(known) if known else self._segment[ub.id]
        if seg >= self._segment[ub.id]:
            return None
        at_yield = self._seg_host.get((ub.id, seg), 0.0)
        own_end = max((t for (sid, u, g), t in self._seg_end.items() if sid == stream.id and u == ub.id and g <= seg),
                      default=0.0)
        mine = self._seg_seq.get((stream.id, ub.id, seg))
        for (sid, other), seq in self._ub_seq.items():
            if sid == stream.id and other != ub.id and (mine is None or seq > mine):
                return other, own_end, at_yield
        return None, own_end, at_yield

    def _contend(self, start: float, wire: float) -> None:
        """HBM contention: the bytes are read at the sender and written at the receiver."""
        if self.contention and wire > 0:
            self._compute.reserve(start, 2 * wire / (self.device.hbm_Bps * self.device.mem_efficiency))

    def _background(self, ub: Any, stream: VStream, reads: set[int], writes: set[int], site: Site, wire: float,
                    dur: float, latency: float, ready: float, what: str) -> SimHandle:
        """A transfer issued from the compute role: it leaves once the issuing stream's work so
        far is done, on a stream of its own, and holds no stream; its writes belong to that
        stream, so a read of the received buffer before a wait on the handle is an early read."""
        bg = VStream(f"{stream.name}:{what}")
        self._comm_ids.add(bg.id)
        bg.t = max(stream.t, ready)
        late = self._late_send(ub, stream, reads) if self._multi else None
        if late is not None:
            other, own_end, at_yield = late
            if self._lost_overlap(LostOverlap("send-after-yield", replace(site, stream=stream.name), None, other)):
                bg.t = max(own_end, at_yield)  # the counterfactual: sent before the yield
        for k in writes:
            self._seg_of[k] = NOT_YET  # usable once a wait on the handle orders a stream after it
        self._clocks.wait(bg.id, self._clocks.record(stream.id))
        start = self._link.reserve(bg.t, dur)
        end = start + dur + latency
        bg.t = end
        self._contend(start, wire)
        self._timeline.add(Span(bg.name, "comm", what, start, end, ub.id, ub.tag))
        if self.check_races:
            self._clocks.access(bg.id, reads, writes, replace(site, stream=bg.name))
        else:
            self._clocks.tick(bg.id)
        done = VEvent(recorded=True, t=end, clock=self._clocks.record(bg.id), by=replace(site, stream=bg.name))
        done.stream_id = bg.id
        handle = SimHandle(what, int(wire), start, end, backend=self, event=done, writes=frozenset(writes))
        handle.owner, handle.site, handle.seg = ub.id, replace(site, stream=bg.name), self._segment.get(ub.id, 0)
        if self._policy == "role":  # empty-recv-hook: only a shared stream makes a hook the receive
            self._unreceived.setdefault(ub.id, []).append(handle)
        for k in writes:
            self._pending_reads[k] = handle
        return handle
