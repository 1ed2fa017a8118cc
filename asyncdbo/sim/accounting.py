"""The op half of :class:`~asyncdbo.sim.backend.SimBackend` (a mixin, as
:class:`~asyncdbo.sim.transfers.Transfers` is the comm half): what the backend does with each
torch op :class:`~asyncdbo.sim.mode.SimMode` hands it. It places the op on its virtual stream at
the cost model's price, tells the race checker what it reads and writes, charges host syncs, and
keeps each ubatch's ownership of its segments."""

from __future__ import annotations

import os
import sys
from types import FrameType
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core import get_ubatch
from ..syncs import SyncRecord
from .clock import Engine, Span, VStream
from .ops import FACTORY, Region, is_view, self_region, span, storage_key, tensor_items, union
from .races import _SKIP, LostOverlap, Site, user_frames
from .transfers import Transfers

__all__ = ["Block", "Hold", "Moved", "OpAccounting"]

_COMM_LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dist")
_MACHINERY = tuple(p for p in _SKIP if not p.startswith(_COMM_LIBRARY))


def _in_comm_library() -> bool:
    """Whether the innermost frame outside the sim, the backends, torch and the standard library
    is asyncdbo's EP all-to-all (``asyncdbo/dist``): a host read the comm library makes."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(_MACHINERY) and not fn.startswith("<"):
            return fn.startswith(_COMM_LIBRARY)
        f = f.f_back
    return False


def _sizing_tensors(op: str, args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors whose values a host sync reads: a boolean-mask index reads only its masks (the
    host needs their count, not the indexed data); any other sync, every tensor it takes."""
    if op.startswith(("aten.index", "aten._unsafe_index", "aten._index_put")) and len(args) > 1:
        return [t for t in tensor_items(args[1]) if t.dtype in (torch.bool, torch.uint8)]
    return tensor_items(list(args))


@dataclass
class Hold:
    """A stream wait on a ubatch's own transfer that moved the stream's time: ``pre`` is the
    stream's time before it, ``wait`` where it was issued; ``fixing`` once the counterfactual moves the ubatch's
    work that does not need the transfer before it (``unneeded-comm-wait``)."""

    pre: float
    wait: Site
    fixing: bool = False
    seg: int | None = None  # the ubatch's segment, when the moved work is the first it queued there
    start: float = -1.0  # ``pre`` as the wait found it (the counterfactual moves ``pre`` on): what is "after"
    mine: set[int] = field(default_factory=set)  # what the moved work wrote (its own data, not the transfer's)

    def __post_init__(self) -> None:
        self.start = self.pre if self.start < 0 else self.start


@dataclass(frozen=True)
class Moved:
    """An op the ``unneeded-comm-wait`` counterfactual moved before a wait that started its
    ubatch's segment ``seg`` on stream ``stream``: the ``n``-th priced op of ubatch ``ub``. A second
    counterfactual issues it before the yield that started that segment, as the fixed schedule does."""

    ub: int
    n: int
    seconds: float
    on_compute: bool
    stream: str
    seg: int


@dataclass
class Block:
    """A stream wait on comm that moved the stream's time, issued by ubatch ``waiter`` at ``wait``
    on the transfer issued at ``comm``: until the waiter's own next op on the stream, another
    ubatch's work queued there waits for the transfer too (``comm-wait-blocks-other``). ``pre``:
    the stream's time before the wait; ``mine``: what that other ubatch wrote since (its own
    data, not the transfer's)."""

    waiter: int
    pre: float
    wait: Site
    comm: Site
    mine: set[int] = field(default_factory=set)
    reported: bool = False


class OpAccounting(Transfers):
    """The op half of :class:`~asyncdbo.sim.backend.SimBackend`, on top of its comm half (a mixin;
    see the module docstring). The state it reads is made by ``SimBackend.__init__``/``attach``."""

    _comm_sms: Engine
    _last_ub: dict[int, int]  # stream id -> ubatch of its last op
    _sync_ops: dict[str, int]  # host syncs charged, by op
    _lost_keys: set[tuple[str, str]]

    def _site(self, ub: Any, stream: VStream, op: str) -> Site:
        return Site(None if ub is None else ub.id, None if ub is None else ub.tag, stream.name, user_frames(), op)

    def _covers_foreign(self, ub: Any, stream: VStream) -> tuple[int, float] | None:
        """(other ubatch, end of this ubatch's own work) when the stream's last op is another
        ubatch's and this one queued work there before: a record (or send) now covers it."""
        if ub is None:
            return None
        last = self._last_ub.get(stream.id)
        own_end = self._ub_end.get((stream.id, ub.id))
        if last is None or last == ub.id or own_end is None:
            return None
        return last, own_end

    _held: dict[tuple[int, int], Hold]
    _written_at: dict[int, float]  # storage -> when its last write ends (virtual time)

    def _hold(self, stream: VStream, owner: int, wait: Site) -> None:
        """A wait on ``owner``'s transfer holds ``stream`` (see :class:`Hold`); the first one counts."""
        if (stream.id, owner) not in self._held:
            self._held[(stream.id, owner)] = Hold(stream.t, wait)

    def _needs(self, hold: Hold, reads: set[int]) -> bool:
        """Whether an op reading ``reads`` reads data written after the held stream's time before
        the wait (what the transfer delivered, or what was computed from it since)."""
        return any(self._written_at.get(k, 0.0) > hold.start for k in reads - hold.mine)

    def _held_ready(self, ub: Any, stream: VStream, func: Any, args: tuple[Any, ...], heavy: bool) -> float | None:
        """Where the ubatch's op goes when a wait on its own transfer holds the stream: None (after
        the wait, as issued) unless the op needs nothing the transfer delivered and this run is the
        ``unneeded-comm-wait`` counterfactual, then the time it could start before the wait."""
        hold = self._held.get((stream.id, ub.id))
        if hold is None:
            return None
        reads = {k for t in tensor_items(list(args)) if (k := storage_key(t)) is not None}
        if self._needs(hold, reads):
            del self._held[(stream.id, ub.id)]
            return None
        if heavy and not hold.fixing:
            site = self._site(ub, stream, str(func.name()))
            hold.fixing = self._lost_overlap(LostOverlap("unneeded-comm-wait", site, hold.wait, None))
            seg = self._segment[ub.id]
            hold.seg = seg if seg > 0 and (stream.id, ub.id, seg) not in self._seg_end else None
        return hold.pre if hold.fixing else None

    _op_n: dict[int, int]  # ubatch -> priced ops it issued
    moved: list[Moved]  # what an unneeded-comm-wait counterfactual moved before a wait
    _preissue: list[Moved]  # set before a run: ops to issue at the yield before their segment
    _preissued: dict[tuple[int, int], float]  # (ubatch, op) -> end of its early copy

    def _issue_early(self, ub: Any, seg: int) -> None:
        """At ``ub``'s yield that ends segment ``seg``: issue the :class:`Moved` ops of the next
        segment (the counterfactual where they were issued before this yield)."""
        streams = {s.name: s for s in ub.ext.streams.values()}
        for m in self._preissue:
            if m.ub == ub.id and m.seg == seg + 1 and (m.ub, m.n) not in self._preissued:
                engine = self._compute if m.on_compute else self._comm_sms
                _, end = self._place(ub, streams[m.stream], "compute", ub.tag or "compute", m.seconds, engine,
                                     ready=self._host.launch())
                self._preissued[(m.ub, m.n)] = end

    _blocked: dict[int, Block]

    def _blocked_by(self, ub: Any, stream: VStream, func: Any, args: tuple[Any, ...], heavy: bool) -> None:
        """Report ``comm-wait-blocks-other`` when the op is another ubatch's queued behind a wait
        on comm that it does not need (the counterfactual puts the wait off: ``_late_wait``). The
        waiter's own op, or one that reads what arrived after the wait's start, ends the block."""
        block = self._blocked.get(stream.id)
        if block is None:
            return
        reads = {k for t in tensor_items(list(args)) if (k := storage_key(t)) is not None}
        if ub.id == block.waiter or any(self._written_at.get(k, 0.0) > block.pre for k in reads - block.mine):
            del self._blocked[stream.id]
            return
        if heavy and not block.reported:
            site = self._site(ub, stream, str(func.name()))
            self._lost_overlap(LostOverlap("comm-wait-blocks-other", block.wait, block.comm, ub.id, blocked=site))
            block.reported = True

    def _lost_overlap(self, lo: LostOverlap) -> bool:
        """Report ``lo`` (once per kind and place); True when this run is the counterfactual
        without it (its key is in ``fix``): the caller then does what the fixed schedule does."""
        if lo.key not in self._lost_keys:
            self._lost_keys.add(lo.key)
            self._lost.append(lo)
        return lo.key in self.fix

    def _place(self, ub: Any, stream: VStream, kind: str, name: str, dur: float, engine: Engine, extra: float = 0.0,
               ready: float = 0.0) -> tuple[float, float]:
        start = engine.reserve(max(stream.t, ready), dur)
        end = start + dur + extra
        stream.t = end
        self._timeline.add(Span(stream.name, kind, name, start, end, ub.id, ub.tag))
        self._ub_end[(stream.id, ub.id)] = end
        self._seg_end[(stream.id, ub.id, self._segment[ub.id])] = end
        self._last_ub[stream.id] = ub.id
        return start, end

    def _tick(self, ub: Any, stream: VStream) -> None:
        self._own(ub, stream, self._clocks.tick(stream.id))

    def _own(self, ub: Any, stream: VStream, seq: int) -> None:
        self._ub_seq[(stream.id, ub.id)] = seq
        self._seg_seq[(stream.id, ub.id, self._segment[ub.id])] = seq

    def _on_op(self, ub: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        stream = ub.ext.stream
        assert isinstance(stream, VStream), stream
        if func.namespace == "c10d":
            self._flush_c10d()
            self._c10d_op(ub, stream, func, args, kwargs)
            return
        self._flush_c10d()
        if self._deferred:
            self._settle(ub, {k for t in tensor_items(list(args)) if (k := storage_key(t)) is not None})
        cost = self.cost.op_cost(func, args, kwargs, out)
        end_t = stream.t
        n = self._op_n.get(ub.id, 0)  # the ubatch's priced ops so far: the same op in every run of the schedule
        if cost.seconds > 0:
            n = self._op_n[ub.id] = n + 1
        if cost.seconds > 0 and (ub.id, n) in self._preissued:  # the counterfactual: issued before the yield
            end_t = self._preissued[(ub.id, n)]
        elif cost.seconds > 0:
            # Ops a ubatch issues in its comm role that only move data (packing rows for a dispatch)
            # run on the SMs the comm kernels own (DeepEP fuses them into its kernels): they take
            # stream time but not the compute engine. A compute kernel (a GEMM, attention) needs the
            # compute SMs whichever stream it is queued on: on the comm stream it competes with the
            # compute stream's kernels, and holds up the transfers queued behind it.
            heavy = self.cost.is_compute(func)
            engine = self._comm_sms if ub.ext.role == "comm" and not heavy else self._compute
            on = stream
            if self._relocated:  # the counterfactual below: a comm-stream op waits for what it reads
                stream.t = max([stream.t] + [self._relocated.get(storage_key(t) or 0, 0.0)
                                             for t in tensor_items(list(args))])
            if heavy and ub.ext.role == "comm" and self._multi and stream is not ub.ext.streams["compute"]:
                site = self._site(ub, stream, str(func.name()))
                if self._lost_overlap(LostOverlap("compute-on-comm-stream", site, None, None)):
                    on = ub.ext.streams["compute"]  # the counterfactual: the op runs on compute
            early = self._held_ready(ub, on, func, args, heavy) if self._held and self.check_races else None
            if self._blocked and self.check_races:
                self._blocked_by(ub, on, func, args, heavy)
            self._late_wait(ub, on)
            held_t = on.t
            if early is not None:  # the counterfactual: issued before the wait, it starts no later than then
                on.t = early
            _, end = self._place(ub, on, "compute", ub.tag or "compute", cost.seconds, engine, ready=self._host.launch())
            if early is not None:
                hold = self._held[(on.id, ub.id)]
                hold.pre = end
                hold.mine |= {k for t in tensor_items(out if isinstance(out, (tuple, list)) else [out])
                              if (k := storage_key(t)) is not None}
                on.t = max(held_t, end)
                if hold.seg is not None:
                    self.moved.append(Moved(ub.id, n, cost.seconds, engine is self._compute, on.name, hold.seg))
            end_t = end
            if on is not stream:
                for t in tensor_items(out if isinstance(out, (tuple, list)) else [out]):
                    if (k := storage_key(t)) is not None:
                        self._relocated[k] = end
        if is_view(func):
            return
        if self.check_races or self._device_counts:
            # Allocations (empty, new_empty) cost nothing but still start a fresh history: the CPU
            # allocator reuses addresses, while a device's caching allocator keeps each block on
            # the stream that allocated it, so an old access to the address is no dependency.
            reads, writes, regions = self._accesses(func, args, kwargs, out)
            for k in writes:
                self._written_at[k] = end_t
            if (b := self._blocked.get(ub.ext.stream.id)) is not None and b.waiter != ub.id:
                b.mine |= writes  # the other ubatch's own data, written while the wait held the stream
            # What the host can compute itself (from the data it prepared, factories, and what is
            # computed from those alone) stays host data; anything else written is device data.
            if reads <= self._host_known:
                self._host_known |= writes
            elif writes & self._host_known:
                self._host_known -= writes
            if self._device_counts and reads & self._device_counts:
                self._device_counts |= writes
            if self._comm_derived and reads & self._comm_derived:
                self._comm_derived |= writes
            if self._watch and reads & self._watch.keys():
                self._used(ub, reads)
            if self._pending_reads and reads & self._pending_reads.keys():
                self._read_before_await(ub, stream, func, reads)
            if self.check_races:
                self._clocks.access(stream.id, reads, writes, self._site(ub, stream, str(func.name())), regions)
                self._own(ub, stream, self._clocks.seq[stream.id])
                # Produced as early as its inputs allow (inputs from outside the run: now).
                known = [self._seg_of[k] for k in reads if k in self._seg_of]
                seg = max(known) if known else self._segment[ub.id]
                for k in writes:
                    self._seg_of[k] = seg
                return
        self._tick(ub, stream)

    def _read_before_await(self, ub: Any, stream: VStream, func: Any, reads: set[int]) -> None:
        """The owner of a transfer reads what it wrote without having waited on its handle itself:
        another ubatch's recv hook may have ordered the device stream (role streams), but a backend
        without device streams (the host's) completes the transfer only when the owner awaits it."""
        for k in reads & self._pending_reads.keys():
            h = self._pending_reads[k]
            if ub.id != h.owner:
                continue
            del self._pending_reads[k]
            ev = h.event
            ordered = ev is not None and self._clocks.knows(stream.id, ev.stream_id) >= ev.clock.get(ev.stream_id, 0)
            if ordered and not h.owner_waited and self.check_races and h.site is not None:  # else: an early read
                self._clocks.report("read-before-await", self._site(ub, stream, str(func.name())), h.site, stream.id)

    def _on_sync(self, record: SyncRecord, args: tuple[Any, ...]) -> None:
        """An op that makes the host wait (:mod:`asyncdbo.syncs`: a read to the host, or
        an output sized by the data): the CPU waits for the end of the work queued on the stream
        it reads, and later work on every stream follows it."""
        ub = get_ubatch()
        if ub is None or ub.run is not self._run:
            return
        keys = {k for t in tensor_items(list(args)) if (k := storage_key(t)) is not None}
        if self._deferred:
            self._settle(ub, keys)
        sized_by = {k for t in _sizing_tensors(record.op, args) if (k := storage_key(t)) is not None}
        if sized_by and sized_by <= self._host_known:
            return  # the host holds these values (metadata it prepared): it waits for no device
        if keys & self._device_counts:
            return  # counts the comm library keeps on the device (and what they size): no host read
        stream = ub.ext.stream
        fixed = False
        if self._multi and self.check_races and keys and not keys & self._comm_derived and not _in_comm_library():
            # A read of the schedule's own compute, not of counts a transfer delivered nor the
            # split sizes a plain collective takes on the host (the comm library's own reads, which
            # the comm preset models): the CPU stops launching every ubatch's work.
            site = self._site(ub, stream, record.op)
            fixed = self._lost_overlap(LostOverlap("host-sync", site, None, None))
        if not fixed:  # the counterfactual: the host does not wait here
            self._host.sync(stream.t)
        self._clocks.sync_all_to(stream.id)
        self._sync_ops[record.op] = self._sync_ops.get(record.op, 0) + 1

    def _accesses(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  out: Any) -> tuple[set[int], set[int], dict[int, Region]]:
        """The storages ``func`` reads and writes, and the bytes of each it touches."""
        schema = func._schema
        factory = bool(FACTORY.match(schema.name.split("::")[-1]))
        reads: set[int] = set()
        writes: set[int] = set()
        regions: dict[int, Region] = {}

        def touch(k: int, reg: Region) -> None:
            regions[k] = union(regions[k], reg) if k in regions else reg

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
                else:
                    continue
                touch(k, self_region(func, args, kwargs) if i == 0 else span(t))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for r, o in zip(schema.returns, outs):
            if r.alias_info is None:
                for t in tensor_items(o):
                    k = storage_key(t)
                    if k is not None:
                        self._clocks.fresh(k)
                        self._device_counts.discard(k)
                        self._comm_derived.discard(k)
                        self._watch.pop(k, None)
                        self._pending_reads.pop(k, None)
                        writes.add(k)
                        touch(k, span(t))
        return reads, writes, regions
