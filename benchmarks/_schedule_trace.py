"""Record an asyncdbo run's schedule on the host backend: its CPU steps, and what each step waited for.

:class:`ScheduleRecorder` is an instrument (each step's span, resume to suspend, and the request it
ended with) plus a :class:`HostBackend` that logs every stream wait. :meth:`ScheduleRecorder.trace`
turns what they saw into the input of :func:`_replay.replay`. The dependencies come from the run:

* a step that parked in a stream wait (a ``dbo_*_sync`` or ``dbo_yield_and_switch_*``) waited for
  every work the event covered (under role streams one comm stream holds every ubatch's works,
  so that can include another ubatch's messages);
* a step that parked awaiting a comm work directly waited for that message;
* a step that parked on any other signal (a recv hook another ubatch runs, a named event another
  ubatch records) waited for the step that set it: a waiter on the signal notes when it was set,
  and the step of the run that holds that instant set it;
* a wait the kernel never saw (an ``await`` that found its work complete does not park) still
  ordered the step after it: a stream wait that returned at once is in the backend's log, and
  the step depends on the works its event covered that were issued before the step; a message of
  the ubatch's own that completed while the ubatch was off the CPU counts as awaited at its next
  resume (the kernel cannot see a direct ``await`` that did not park; the MoE schedules here await
  every message at the first resume after it can arrive);
* anything else (an asyncio future) is replayed as a wake-up at the time the step resumed.
"""

from __future__ import annotations

import time
from typing import Any

from _replay import Msg, SetBy, Step

from asyncdbo.backends.host import HostBackend, HostEvent, HostStream
from asyncdbo.lowlevel import SWITCH, Instrument, Signal, get_ubatch

__all__ = ["ScheduleRecorder"]


class _WaitLog(HostBackend):
    """The host backend, logging each stream wait as (ubatch, time, works covered, signal or None)."""

    def __init__(self, log: list[tuple[int, float, tuple[Any, ...], Signal | None]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._log = log

    def wait(self, stream: HostStream, event: HostEvent) -> Signal | None:
        signal = super().wait(stream, event)
        ub = get_ubatch()
        if ub is not None:
            self._log.append((ub.id, time.perf_counter(), event.works, signal))
        return signal


class ScheduleRecorder:
    """Spans, park requests and completion times of one run (see the module docstring).

    ``spans``: (ubatch, start, end) of each CPU step in run order, on ``time.perf_counter`` (the
    host backend's clock); pass :attr:`instrument` to the run and :meth:`backend` as its backend."""

    def __init__(self) -> None:
        outer = self
        self.spans: list[tuple[int, float, float]] = []
        self.requests: list[object] = []  # what each span ended with: SWITCH, a Signal, None (returned)
        self.run: Any = None
        self.waits: list[tuple[int, float, tuple[Any, ...], Signal | None]] = []
        self._set_at: dict[int, float] = {}  # span index -> when the non-comm signal it parked on was set
        self._visible: dict[int, float] = {}  # comm work index -> when its signal completed
        self._t0 = 0.0

        class _I(Instrument):
            def run_started(self, run: Any) -> None:
                outer.run = run

            def resuming(self, ub: Any) -> None:
                outer._t0 = time.perf_counter()

            def stepped(self, ub: Any, request: object) -> None:
                outer._stepped(ub, request, time.perf_counter())

        self.instrument = _I()

    def backend(self, **kwargs: Any) -> HostBackend:
        return _WaitLog(self.waits, **kwargs)

    def _stepped(self, ub: Any, request: object, t1: float) -> None:
        i = len(self.spans)
        self.spans.append((ub.id, self._t0, t1))
        self.requests.append(request)
        comm = self.run.ext.comm
        for j in range(len(self._visible), len(comm)):  # the works this step issued: note completion
            self._visible.setdefault(j, -1.0)
            comm[j].signal.add_waiter(lambda j=j: self._visible.__setitem__(j, time.perf_counter()))
        if isinstance(request, Signal) and not request.external:
            request.add_waiter(lambda: self._set_at.__setitem__(i, time.perf_counter()))

    def trace(self) -> tuple[list[list[Step]], list[Msg]]:
        """The run as :func:`_replay.replay` input: steps per ubatch, and messages."""
        spans, comm = self.spans, self.run.ext.comm
        origin = spans[0][1]
        index: list[tuple[int, int]] = []  # span -> (ubatch, its step number)
        per_ub: dict[int, list[int]] = {}
        for i, (u, _, _) in enumerate(spans):
            index.append((u, len(per_ub.setdefault(u, []))))
            per_ub[u].append(i)

        def span_at(t: float, ub: int | None = None) -> int:
            found = [i for i, (u, a, b) in enumerate(spans) if a <= t <= b and (ub is None or u == ub)]
            assert found, f"no step of ubatch {ub} holds t={t}"
            return found[0]

        msgs = []
        msg_of = {}
        for j, w in enumerate(comm):
            i = span_at(w.t_issue, w.ub)
            visible = self._visible.get(j, -1.0)
            done = visible if visible >= 0 else (w.t_done or w.t_issue)
            msgs.append(Msg(ub=w.ub, step=index[i][1], offset_s=w.t_issue - spans[i][1], nbytes=w.nbytes,
                            measured_s=max(0.0, done - w.t_issue)))
            msg_of[id(w.signal)] = j
        by_work = {id(w): j for j, w in enumerate(comm)}
        covered: dict[tuple[int, int], list[int]] = {}  # (span, id of the signal a wait returned) -> works
        for u, t, works, sig in self.waits:
            if sig is not None:
                covered.setdefault((span_at(t, u), id(sig)), []).extend(by_work[id(w)] for w in works)
        after: dict[int, set[int]] = {i: set() for i in range(len(spans))}
        sets: dict[int, SetBy] = {}
        outside: dict[int, float] = {}
        for i, req in enumerate(self.requests):  # parks: what the next step of that ubatch waited for
            u, k = index[i]
            if req is SWITCH or req is None or k + 1 >= len(per_ub[u]):
                continue
            nxt = per_ub[u][k + 1]
            if (i, id(req)) in covered:  # a stream wait: every work its event covered
                after[nxt].update(covered[i, id(req)])
            elif id(req) in msg_of:  # an await of one work
                after[nxt].add(msg_of[id(req)])
            elif i in self._set_at:
                s = span_at(self._set_at[i])
                sets[nxt] = SetBy(ub=spans[s][0], step=index[s][1], offset_s=self._set_at[i] - spans[s][1])
            else:
                outside[nxt] = spans[nxt][1] - origin
        for u, t, works, sig in self.waits:  # stream waits that did not park: deps of the step they ran in
            i = span_at(t, u)
            if sig is not None and self.requests[i] is sig:
                continue  # it parked: the next step's dependency, above
            after[i].update(by_work[id(w)] for w in works if w.t_issue < spans[i][1])
        for u, ids in per_ub.items():  # own messages completed while the ubatch was off the CPU
            for before, i in zip(ids, ids[1:]):
                after[i].update(j for j, w in enumerate(comm)
                                if w.ub == u and spans[before][2] < self._visible.get(j, -1.0) <= spans[i][1])
        steps: list[list[Step]] = [[] for _ in per_ub]
        for i, (u, a, b) in enumerate(spans):
            came_from = self.requests[per_ub[u][index[i][1] - 1]] if index[i][1] else SWITCH
            steps[u].append(Step(duration_s=b - a, parked=came_from is not SWITCH, after_msgs=tuple(sorted(after[i])),
                                 after_sets=(sets[i],) if i in sets else (), after_s=outside.get(i)))
        return steps, msgs
