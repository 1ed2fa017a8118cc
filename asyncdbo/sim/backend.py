"""Simulated device: virtual streams on a virtual clock, a cost model, a host timeline and a race
checker.

Every torch op a ubatch issues during the run is seen by a ``TorchDispatchMode``
(:mod:`asyncdbo.sim.mode`: executed for real; meta tensors as shapes only) and placed on the
ubatch's current *virtual* stream with the duration the cost model gives it on the modeled device
(:mod:`asyncdbo.sim.cost`), no earlier than the modeled CPU launched it
(:mod:`asyncdbo.sim.host`). Events record and wait with device semantics on the virtual clock, so
the makespan is the step time the schedule would have on that device.

**Streams, as the accelerator backend makes them.** Role policy: one compute and one comm stream
shared by all ubatches. Ubatch policy: each ubatch owns a compute stream and a comm stream, and
explicit events order them. **Comm, as NCCL/HCCL run it** (:meth:`SimBackend.submit`): a
collective runs on a stream of its own that first waits for the work queued on the issuing
stream. Issued from a comm stream (the ``ht`` schedule), the issuing stream waits for it at once
(``work.wait()`` in the accelerator backend) and events carry that to compute. Issued from the
compute role (the ``ll`` schedule: send now, receive later), nothing waits until the handle is
awaited or its ``stream_wait`` runs (in a recv hook), so reading the received rows before that is
an early read. Costs come from the link and the comm library preset (:mod:`asyncdbo.sim.comm`).

**Checks** (:mod:`asyncdbo.sim.races`), on by default: early reads and buffers reused in flight
(happens-before over vector clocks), dead waits, and lost overlap (structural, the kinds of
:data:`~asyncdbo.sim.races.LOST_KINDS`: an event recorded, or a transfer sent, after a yield; a
recv hook held across a yield; a host sync between yields; a transfer with no yield around it; a
compute kernel on a comm stream). ``fix`` makes the run the counterfactual that measures a
finding's cost (:mod:`asyncdbo.sim.counterfactual`). At the end of the run the backend raises
:class:`~asyncdbo.sim.races.SimCheckError` for races and dead waits, and for lost overlap when
``fail_on`` contains ``"lost-overlap"`` (``on_problem="raise"``), or only records them
(``"record"``). The last run's :class:`SimReport` is ``backend.report``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from .._core import SWITCH, Instrument, get_ubatch
from .._core.stacks import await_chain
from ..backends import LinkSpec, RunStreams, StreamBackend, UBatchStreams, link_spec
from ..syncs import HostSyncs
from ..dbo.hooks import run_pending_hook
from .clock import Engine, Timeline, VEvent, VStream
from .comm import CommSpec, comm_spec
from .cost import CostModel
from .devices import DeviceSpec, device_spec
from .host import HostSpec, HostTimeline, host_spec
from .mode import SimMode
from .ops import span, storage_key
from .races import _SKIP, FRAMES, DeadWait, LostOverlap, RaceChecker, SimCheckError, Site
from .report import SimReport
from .accounting import Block, Hold, Moved, OpAccounting
from .transfers import SimHandle, Watch

if TYPE_CHECKING:
    from .._core import DBORun, UBatch

__all__ = ["FAIL_ON", "SimBackend", "SimHandle", "SimReport"]

log = logging.getLogger("asyncdbo")

#: What ``fail_on`` accepts besides races and dead waits (which always fail).
FAIL_ON = ("lost-overlap",)


def _suspended_frames(ub: UBatch) -> tuple[str, ...]:
    """The user's innermost frames of a suspended ubatch (its await chain)."""
    import os

    frames = [f for f in reversed(await_chain(ub.coro)) if not f.filename.startswith(_SKIP)]
    return tuple(f"{os.path.relpath(f.filename)}:{f.lineno} in {f.name.split('.')[-1]}" for f in frames[:FRAMES]) or ("?",)


def _host_args(run: DBORun) -> set[int]:
    """The storages of the integer and boolean tensors among the ubatches' arguments, and among
    the tensor fields of dataclasses there (token ids, positions, attention metadata): what the
    host prepared for the step and still holds (``host_args``)."""
    import dataclasses
    import inspect

    out: set[int] = set()

    def add(v: Any, depth: int = 0) -> None:
        if isinstance(v, torch.Tensor):
            if not (v.is_floating_point() or v.is_complex()) and (k := storage_key(v)) is not None:
                out.add(k)
        elif isinstance(v, (list, tuple)) and depth < 2:
            for x in v:
                add(x, depth + 1)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type) and depth < 2:
            for f in dataclasses.fields(v):
                add(getattr(v, f.name, None), depth + 1)

    for ub in run.ubatches:
        for v in inspect.getcoroutinelocals(ub.coro).values():  # not started yet: its arguments
            add(v)
    return out


class _Hooks(Instrument):
    """The sim's scheduler hooks: a switch costs host time; a switch while holding another
    ubatch's recv hook is lost overlap; the end of the run closes the report."""

    def __init__(self, backend: SimBackend) -> None:
        self.backend = backend

    def stepped(self, ub: UBatch, request: object) -> None:
        be = self.backend
        hook = getattr(ub.ext, "recv_hook", None)
        if request is SWITCH and hook is not None:
            owner = getattr(getattr(hook, "__self__", None), "owner", -1)
            site = Site(ub.id, ub.tag, ub.ext.stream.name, _suspended_frames(ub), f"yield {ub.tag!r}")
            if be._lost_overlap(LostOverlap("skipped-recv-hook", site, None, owner)):
                ub.ctx_run(run_pending_hook, ub)  # the counterfactual: the hook runs before the yield
        seg = be._segment.get(ub.id, 0)
        if request is SWITCH:
            be._hooks_at_yield(ub, seg)
        if request is SWITCH and be._preissue:
            ub.ctx_run(be._issue_early, ub, seg)
        if request is None and be._deferred.get(ub.id):  # ended with a moved await still pending
            be._segment[ub.id] = seg + 1
            ub.ctx_run(be._settle, ub)
        be._seg_host[(ub.id, seg)] = be._host.t  # when this segment's last launch was issued
        if not be.plain:  # outside a DBO run a yield is no switch at all
            be._host.switch()
        be._segment[ub.id] = seg + 1

    def run_finished(self, run: DBORun, exc: BaseException | None) -> None:
        self.backend._finish(run, exc)


class SimBackend(OpAccounting, StreamBackend):
    """Simulated device streams (see the module docstring).

    ``device``/``link``/``comm``/``host``: a spec or preset name (:func:`device_spec`,
    :func:`~asyncdbo.backends.link_spec`, :func:`~asyncdbo.sim.comm.comm_spec`,
    :func:`~asyncdbo.sim.host.host_spec`). ``check_races``: track every access (on by default; it
    walks the stack once per op). ``fail_on``: findings besides races and dead waits that fail the
    run (``"lost-overlap"``). ``on_problem``: ``raise`` or ``record``. ``comm_scale``: multiplies
    every byte count (the share of an all-to-all that crosses the link). ``weights``/``weight_bytes``: tensors priced as weights,
    at that many bytes per element. ``compute_share``: the SM share compute kernels get.
    ``contention``: transfers also take HBM time on the compute engine. ``imbalance``: the busiest
    EP rank's expert work over this rank's; a combine completes that much later (the straggler).
    ``node_dedup``: bytes a comm library that sends a token once per node puts on the link, over
    the bytes of one copy per (token, expert) (applied where the comm spec says so). ``fix``:
    lost-overlap keys (:attr:`LostOverlap.key`) this run removes, the counterfactual that measures
    their cost (:mod:`asyncdbo.sim.counterfactual`). ``host_args``: the integer and boolean tensors
    among the ubatches' arguments (token ids, positions, attention metadata) are data the host
    prepared and holds: reading them, or what is computed from them (and factories) alone, is
    no host sync (:mod:`asyncdbo.sim.serving`); ``host_args=False`` treats them as device results.
    ``plain``: the serial baseline without DBO, for a run of one ubatch: its compute and comm
    share one stream (the primitives' switches, records and waits order nothing new, every
    transfer is waited for where the stream reaches it) and yields cost the host nothing, as the
    layer run outside a DBO run does; transfers keep the kernels their role picks.
    """

    stand_in = True  # CPU tensors play the simulated device's

    name = "sim"
    _active: DBORun | None = None  # the one sim run in progress (see attach)

    def __init__(
        self,
        *,
        device: str | DeviceSpec = "h200",
        link: str | LinkSpec = "ib400",
        comm: str | CommSpec = "a2a",
        host: str | HostSpec = "none",
        check_races: bool = True,
        fail_on: Iterable[str] = (),
        on_problem: str = "raise",
        comm_scale: float = 1.0,
        weights: Iterable[torch.Tensor] = (),
        weight_bytes: int | None = None,
        compute_share: float = 1.0,
        contention: bool = False,
        imbalance: float = 1.0,
        node_dedup: float = 1.0,
        fix: Iterable[tuple[str, str]] = (),
        host_args: bool = True,
        plain: bool = False,
    ) -> None:
        if on_problem not in ("raise", "record"):
            raise ValueError(f"on_problem must be 'raise' or 'record' (got {on_problem!r})")
        if not comm_scale >= 0:
            raise ValueError(f"comm_scale must be >= 0 (got {comm_scale!r})")
        self.fail_on = tuple(fail_on)
        bad = [f for f in self.fail_on if f not in FAIL_ON]
        if bad:
            raise ValueError(f"fail_on takes {list(FAIL_ON)} (got {bad}); races and dead waits always fail")
        if not imbalance >= 1:
            raise ValueError(f"imbalance is the busiest rank's expert work over this rank's, >= 1 (got {imbalance!r})")
        self.device = device_spec(device)
        self.link = link_spec(link)
        self.comm = comm_spec(comm)
        self.host = host_spec(host)
        keys = frozenset(k for t in weights if (k := storage_key(t)) is not None)
        self.cost = CostModel(self.device, weight_keys=keys, weight_bytes=weight_bytes, compute_share=compute_share)
        self.check_races = check_races
        self.on_problem = on_problem
        self.comm_scale = comm_scale
        self.contention = contention
        self.imbalance = imbalance
        self.node_dedup = node_dedup
        self.fix = frozenset(fix)
        self.host_args = host_args
        self.plain = plain
        #: ``comm-not-overlapped`` keys in ``fix`` whose await this run could not move past the
        #: next yield (the transfer's data was used before it): :mod:`.counterfactual` reruns them.
        self.undeferred: set[tuple[str, str]] = set()
        #: ops an ``unneeded-comm-wait`` counterfactual moved before a wait that started their
        #: ubatch's segment; ``_preissue`` (set before a run) issues such ops before that yield
        self.moved: list[Moved] = []
        self._preissue: list[Moved] = []
        self.report: SimReport | None = None
        self._run: DBORun | None = None
        self._mode: SimMode | None = None
        self._syncs: HostSyncs | None = None

    def describe(self) -> str:
        return f"sim ({self.device.name}, {self.link.name})"

    # ------------------------------------------------------------------ run lifecycle
    def attach(self, run: DBORun, state: RunStreams) -> None:
        from .._core import Fanout

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
        if self.plain and len(run.ubatches) != 1:
            for ub in run.ubatches:
                ub.coro.close()
            raise ValueError(f"SimBackend(plain=True) is the serial baseline: run it with one ubatch (got "
                             f"{len(run.ubatches)})")
        SimBackend._active = run
        self._run = run
        self._policy = state.policy
        self._compute = Engine("compute")
        self._link = Engine(f"link {self.link.name}")
        self._comm_sms = Engine("comm SMs")
        self._comm_bytes = 0
        self._timeline = Timeline()
        self._host = HostTimeline(self.host)
        self._clocks = RaceChecker()  # vector clocks always; accesses only with check_races
        self._lost: list[LostOverlap] = []
        self._waits_unrecorded: list[tuple[VEvent, Site]] = []
        self._pending_c10d: tuple[Any, VStream, set[int], set[int], Site, int] | None = None
        self._ub_end: dict[tuple[int, int], float] = {}  # (stream id, ubatch) -> end of its last op
        self._ub_seq: dict[tuple[int, int], int] = {}  # (stream id, ubatch) -> seq of its last op
        # Segments (a ubatch's work between two suspensions): where the data of each storage could
        # first have been issued, and each ubatch's last op per stream and segment.
        self._segment: dict[int, int] = {lane.ub.id: 0 for lane in state.lanes}
        self._seg_of: dict[int, int] = {}
        self._seg_seq: dict[tuple[int, int, int], int] = {}
        self._last_ub: dict[int, int] = {}  # stream id -> ubatch of its last op
        self._device_counts: set[int] = set()  # storages holding counts that never reach the host
        self._host_known: set[int] = _host_args(run) if self.host_args else set()  # values the host holds
        self._sync_ops: dict[str, int] = {}  # host syncs charged, by op
        self._dispatch_done: dict[int, float] = {}  # ubatch -> end of its last dispatch
        self._multi = len(run.ubatches) > 1  # lost overlap needs another ubatch to overlap with
        self._lost_keys: set[tuple[str, str]] = set()
        self._seg_host: dict[tuple[int, int], float] = {}  # (ubatch, segment) -> host time at its yield
        self._comm_derived: set[int] = set()  # storages a transfer wrote, and what was computed from them
        self._watch: dict[int, Watch] = {}
        self._seg_end: dict[tuple[int, int, int], float] = {}  # (stream, ubatch, segment) -> end of its last op
        self._pending_reads: dict[int, SimHandle] = {}  # storage -> the background transfer that writes it
        self._deferred: dict[int, list[SimHandle]] = {}  # ubatch -> awaits a counterfactual moved past its yield
        self._hook_out: dict[int, int] = {}  # ubatch -> its last segment that ended with its recv hook held by another
        self._unreceived: dict[int, list[SimHandle]] = {}  # ubatch -> its transfers no stream waited on yet
        self.undeferred = set()
        self._written_at: dict[int, float] = {}
        self._comm_ids: set[int] = set()  # streams comm ran on (a wait on them is a wait on comm)
        self._held: dict[tuple[int, int], Hold] = {}  # (stream, ubatch) -> a wait on that ubatch's comm holding it
        self._op_n: dict[int, int] = {}
        self._preissued: dict[tuple[int, int], float] = {}
        self._blocked: dict[int, Block] = {}  # stream -> a wait on comm no op of the waiting ubatch followed yet
        self._last_comm: dict[int, Site] = {}  # stream -> its last transfer
        self._late_waits: dict[tuple[int, int], float] = {}  # counterfactual: (stream, ubatch) -> a wait put off
        self._relocated: dict[int, float] = {}  # counterfactual: outputs moved to compute -> their end  # storage -> a transfer not yet used, issued in its data's segment
        self.report = SimReport(self.device.name, self.link.name, state.policy, len(run.ubatches))
        shared = {"compute": VStream("compute"), "comm": VStream("comm")}
        for lane in state.lanes:
            if self.plain:
                one = VStream("compute")
                lane.streams = {"compute": one, "comm": one}
            elif state.policy == "role":
                lane.streams = dict(shared)
            else:
                i = lane.ub.id
                lane.streams = {"compute": VStream(f"ub{i}"), "comm": VStream(f"ub{i}:comm")}
            lane.events = {"compute": VEvent(), "comm": VEvent()}
            lane.stream = lane.ub.resume_with = lane.streams["compute"]
        hooks = _Hooks(self)
        run.instrument = hooks if run.instrument is None else Fanout(run.instrument, hooks)
        self._mode = SimMode(self)
        self._mode.__enter__()
        # Entered after the sim's mode, so it sees each op first, lets the sim price it, then
        # charges the host's wait once the op is on its stream (asyncdbo.syncs).
        self._syncs = HostSyncs(on_sync=self._on_sync)
        self._syncs.__enter__()

    def detach(self, run: DBORun, state: RunStreams) -> None:
        if SimBackend._active is run:
            SimBackend._active = None
        if self._syncs is not None:
            self._syncs.__exit__(None, None, None)
            self._syncs = None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._run = None

    def _finish(self, run: DBORun, exc: BaseException | None) -> None:
        self._flush_c10d()
        rep = self.report
        assert rep is not None
        rep.spans = self._timeline.spans
        rep.makespan_s = max(self._timeline.end, self._host.t if self._timeline.spans else 0.0)
        rep.compute_busy_s = self._compute.busy_s
        rep.comm_busy_s = sum(sp.end - sp.start for sp in rep.spans if sp.kind == "comm")
        rep.host_blocked_s, rep.host_syncs = self._host.blocked_s, self._host.syncs
        rep.host_sync_ops = dict(self._sync_ops)
        rep.lost_overlaps = self._lost
        rep.races = list(self._clocks.races)
        rep.dead_waits = [DeadWait(site) for ev, site in self._waits_unrecorded if not ev.recorded]
        rep.dead_waits += [DeadWait(site, ev.by) for ev, site in self._waits_unrecorded if ev.recorded]
        rep.fail_on = self.fail_on
        rep.switches, rep.parks = run.num_switches, run.num_parks
        rep.comm_bytes = self._comm_bytes
        if exc is None and rep.problems and self.on_problem == "raise":
            raise SimCheckError(rep.problems)
        if self.on_problem == "raise":  # a recording run's caller reports (asyncdbo.sim.counterfactual)
            for lo in rep.lost_overlaps:
                log.warning("asyncdbo sim: %s", lo)

    # ------------------------------------------------------------------ places

    # ------------------------------------------------------------------ streams and events
    def new_event(self) -> VEvent:
        return VEvent()

    def record(self, event: VEvent, stream: VStream) -> None:
        self._flush_c10d()
        ub = get_ubatch()
        if self._deferred and ub is not None and ub.run is self._run:
            self._settle(ub)
        self._late_wait(ub, stream)
        event.recorded = True
        event.t = stream.t
        event.by = self._site(ub, stream, "record event")
        event.clock = self._clocks.record(stream.id)
        event.stream_id = stream.id
        event.covers_foreign = self._covers_foreign(ub, stream)


    def wait(self, stream: VStream, event: VEvent) -> None:
        self._flush_c10d()
        ub = get_ubatch()
        if self._deferred and ub is not None and ub.run is self._run:
            self._settle(ub)
        if not event.recorded:
            # A device would hang here (NPU) or not wait at all (CUDA): report it at the end.
            self._waits_unrecorded.append((event, self._site(ub, stream, "wait event")))
            return
        t = event.t
        if isinstance(event.by, Site):
            self._clocks.last_wait[stream.id] = event.by
        if event.covers_foreign is not None and self._clocks.knows(stream.id, event.stream_id) < event.clock.get(
                event.stream_id, 0):
            foreign, own_end = event.covers_foreign
            site = self._site(ub, stream, "wait event")
            if self._lost_overlap(LostOverlap("record-after-yield", site, event.by, foreign)):
                t = own_end  # the counterfactual: the event covers this ubatch's own work only
        if (t > stream.t and self._multi and self.check_races and event.stream_id in self._comm_ids
                and isinstance(event.by, Site) and event.by.ubatch is not None):
            self._hold(stream, event.by.ubatch, self._site(ub, stream, "wait event"))
            if ub is not None:
                site = self._site(ub, stream, "wait event")
                # a wait on a recorded event: name the transfer it covers, not the record
                comm = self._last_comm.get(event.stream_id, event.by) if event.by.op == "record event" else event.by
                self._blocked[stream.id] = Block(ub.id, stream.t, site, comm)
                if ("comm-wait-blocks-other", site.place) in self.fix:
                    # the counterfactual: the wait holds the waiting ubatch's next op on the stream only
                    self._late_waits[(stream.id, ub.id)] = max(t, self._late_waits.get((stream.id, ub.id), 0.0))
                    t = stream.t
        stream.t = max(stream.t, t)
        self._clocks.wait(stream.id, event.clock)


    # ------------------------------------------------------------------ ops







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
        """Model one comm op issued on the running ubatch's current stream.

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
