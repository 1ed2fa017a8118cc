"""The tracer: spans and numbers of DBO runs (did overlap engage, and if not, why).

:class:`Tracer` is a scheduler :class:`~asyncdbo._core.Instrument`. Pass it as
``instrument=tracer`` to :func:`~asyncdbo.run_ubatches`; each run it sees is one *step*. Without a
tracer the scheduler pays one ``if inst is not None`` branch per yield and nothing else.

What a step records (all times in seconds on the run's clock; by default ``time.perf_counter()``,
one clock for every process on a host, so per-rank traces merge without alignment):

* **CPU steps**: one span per resume of a ubatch, from ``resuming`` to ``stepped``. On the host
  backend the CPU *is* the compute stream, so these are the compute spans. A step is named by the
  yield point it resumed from (``ub1:compute->comm``; ``start`` for the first), the stage tag;
  ``args.role`` is the stream role the step ended on (a step that issues a collective ends on
  ``comm``).
* **Waits**: from the moment a ubatch parks (on a comm signal, an event, a timer) to its next
  resume, named by what it parked on.
* **Yield points**: an instant event per ``SWITCH``, named by its tag.
* **Comm** (host backend): each comm work the backend tracked in the run (its
  :class:`~asyncdbo.backends.CommRecord`) from issue to its effective completion
  ``max(t_done, t_release)`` (the modeled link may release it later than gloo).
* **Device spans** (accelerators): timing events recorded on each of the ubatch's streams at every
  resume and step end, and around every stream wait the step queues (a role switch's wait for
  the other role's done-event, ``dbo_wait_event``): a wait ends the span before it and starts a
  new one after it, so a span never includes the time its stream waited for comm. A span
  ``[start, end]`` on stream S is when S executed the work that step queued on it. Events are only *recorded* inside the step; they are read (``synchronize`` +
  ``elapsed_time``) when numbers or the trace are asked for, so tracing adds no host sync to the
  step. Device times are placed on the host clock through a base event recorded at run start,
  which assumes the stream was idle then (it is, between steps of a serving loop).

"Comm hidden" (:attr:`RunNumbers.comm_hidden_s`) is the measure of
``union(comm intervals) ∩ union(compute intervals)``: time in which some comm was in flight while
some ubatch computed. On the host, compute intervals are the CPU steps of all ubatches; on an
accelerator, the device spans on compute streams and comm intervals the device spans on comm
streams. ``comm_hidden_share = comm_hidden_s / comm_s`` (0 when there is no comm).
``comm_hidden_by_other_s`` counts only the comm time of a ubatch during which another ubatch
computed (the union over ubatches of ``comm(i) ∩ compute(not i)``): the overlap DBO adds, where
the rest is a ubatch's own compute between issuing a transfer and waiting for it.

Export (:meth:`Tracer.to_chrome`, :mod:`asyncdbo.observe.chrome`): Chrome trace event
JSON, pid = rank, one thread per ubatch and track: ``ub<i> compute`` (CPU steps, waits and yield
instants), ``ub<i> comm`` (host comm works), ``ub<i> compute stream`` / ``ub<i> comm stream``
(device spans, the layout sim traces use too); the per-step numbers under
``otherData.asyncdbo.ranks``. :mod:`asyncdbo.observe.timeline` renders it as a PNG.

Profiler ranges (``profiler_ranges=True``): every CPU step is wrapped in a
``torch.profiler.record_function("ub{id}:{tag}")`` range and, on CUDA, an NVTX range of the same
name, so the DBO schedule shows in torch.profiler and Nsight traces.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from .._core import SWITCH, DBORun, Instrument, UBatch, UBatchState
from ..backends import CommRecord
from .chrome import chrome_trace
from .intervals import hidden_seconds, intersection, union_seconds
from .spans import RunNumbers, Span

__all__ = ["StepRecorder", "Tracer"]

log = logging.getLogger("asyncdbo")


# ---------------------------------------------------------------------------------------- one step
class StepRecorder:
    """Everything recorded about one run."""

    def __init__(self, index: int, run: DBORun, record: object | None) -> None:
        self.index = index
        self.name = run.name
        self.backend = getattr(run.ext.backend, "name", "?")
        self.num_ubatches = len(run.ubatches)
        self.t0: float | None = None
        self.t1 = 0.0
        # Raw records, turned into Spans only when read (the hooks run on every switch):
        # CPU steps (ub, t0, t1, from_tag, outcome, to, role) with outcome "yield" | "park" | "done",
        # and waits (ub, t0, t1, parked_on).
        self.cpu: list[tuple[int, float, float, str, str, str | None, str]] = []
        self.waits: list[tuple[int, float, float, str]] = []
        self._spans: list[Span] | None = None
        self.idle_s = 0.0
        self.works: list[Any] = []  # the backend's handles, read as CommRecords when needed
        self.blocking: list[Any] = []  # debug mode's BlockingStep records of this run
        self.backend_obj: Any = run.ext.backend
        self.device: _DeviceTimer | None = None
        self.record = record
        self._numbers: RunNumbers | None = None

    @property
    def yields(self) -> list[int]:
        counts = [0] * self.num_ubatches
        for r in self.cpu:
            if r[4] == "yield":
                counts[r[0]] += 1
        return counts

    @property
    def instants(self) -> list[tuple[int, str, float]]:
        """Yield points: (ub, tag, t)."""
        return [(r[0], r[5] or "yield", r[2]) for r in self.cpu if r[4] == "yield"]

    @property
    def spans(self) -> list[Span]:
        """CPU-step and wait spans."""
        if self._spans is not None:
            return self._spans
        spans = []
        for ub, t0, t1, frm, outcome, to, role in self.cpu:
            to_text = {"yield": to, "done": "finished"}.get(outcome, f"parked on {to}")
            args = {"ub": ub, "kind": "compute", "from": frm, "role": role, "to": to_text}
            kind = "compute"
            # debug mode's record of a blocking step starts inside this span (its clock was read a
            # moment after the tracer's, in the same resume)
            b = next((b for b in self.blocking if b.ub == ub and t0 <= b.t0 <= t1), None)
            if b is not None:
                kind = args["kind"] = "blocking"
                args.update(blocked_ms=round(b.blocked_s * 1e3, 3), where=b.to_where)
            spans.append(Span(ub=ub, kind=kind, role=role, name=f"ub{ub}:{frm}", t0=t0, t1=t1, args=args))
        for ub, t0, t1, what in self.waits:
            args = {"ub": ub, "kind": "wait", "parked_on": what}
            spans.append(Span(ub=ub, kind="wait", role="", name=f"wait: {what}", t0=t0, t1=t1, args=args))
        spans.sort(key=lambda s: s.t0)
        if self.t1:
            self._spans = spans  # the step is over: nothing more will be recorded
        return spans

    def comm(self) -> list[CommRecord]:
        return [self.backend_obj.comm_record(w) for w in self.works]

    def comm_spans(self) -> list[Span]:
        spans = []
        for w in self.comm():
            if w.t_end is None:
                continue  # still in flight (never awaited): it has no end to show yet
            args = {"ub": w.ub, "kind": "comm", "nbytes": w.nbytes, "t_done": w.t_done, "t_release": w.t_release}
            spans.append(Span(ub=w.ub, kind="comm", role="comm", name=w.what, t0=w.t_issue, t1=w.t_end, args=args))
        return spans

    def all_spans(self) -> list[Span]:
        spans = self.spans + self.comm_spans()
        if self.device is not None:
            spans += self.device.resolve()
        return spans

    def numbers(self, rank: int) -> RunNumbers:
        if self._numbers is not None:
            return self._numbers
        spans = self.all_spans()
        if self.device is not None:  # accelerator: device spans carry compute and comm
            compute = [(s.t0, s.t1) for s in spans if s.args.get("device") and s.role == "compute"]
            comm = [(s.t0, s.t1) for s in spans if s.args.get("device") and s.role == "comm"]
            compute_s = sum(b - a for a, b in compute)
        else:
            compute = [(s.t0, s.t1) for s in spans if s.kind == "compute"]
            comm = [(s.t0, s.t1) for s in spans if s.kind == "comm"]
            compute_s = sum(b - a for a, b in compute)
        comm_s = union_seconds(comm)
        hidden = hidden_seconds(comm, compute)
        by_other = union_seconds(_hidden_by_other(spans, device=self.device is not None))
        yields = self.yields
        comm_records = self.comm()
        rec = self.record
        reason = getattr(rec, "reason", None)
        numbers = RunNumbers(
            step=self.index,
            rank=rank,
            name=self.name,
            backend=self.backend,
            num_ubatches=self.num_ubatches,
            wall_s=self.t1 - (self.t0 if self.t0 is not None else self.t1),
            switches=sum(yields),
            parks=sum(1 for r in self.cpu if r[4] == "park"),
            yields_per_ubatch=tuple(yields),
            parked_s=sum(s.t1 - s.t0 for s in self.spans if s.kind == "wait"),
            idle_s=self.idle_s,
            compute_s=compute_s,
            comm_s=comm_s,
            comm_hidden_s=hidden,
            comm_hidden_share=hidden / comm_s if comm_s > 0 else 0.0,
            num_comm_works=len(comm_records),
            comm_bytes=sum(int(w.nbytes) for w in comm_records),
            microbatched=None if rec is None else bool(getattr(rec, "microbatched")),
            reason=None if reason is None else str(getattr(reason, "value", reason)),
            blocking_s=sum(b.blocked_s for b in self.blocking),
            comm_hidden_by_other_s=by_other,
        )
        if all(w.t_done is not None for w in comm_records):
            self._numbers = numbers  # final: nothing left in flight
        return numbers


def _hidden_by_other(spans: list[Span], *, device: bool) -> list[tuple[float, float]]:
    """Comm intervals of each ubatch that ran under another ubatch's compute (see the module
    docstring), as one list of intervals to take the union of."""
    if device:
        spans = [s for s in spans if s.args.get("device")]
    by_ub: dict[int, tuple[list[tuple[float, float]], list[tuple[float, float]]]] = {}
    for s in spans:
        kind = s.role if device else s.kind
        if kind in ("comm", "compute"):
            by_ub.setdefault(s.ub, ([], []))[kind == "compute"].append((s.t0, s.t1))
    out: list[tuple[float, float]] = []
    for ub, (comm, _) in by_ub.items():
        others = [iv for other, (_, compute) in by_ub.items() if other != ub for iv in compute]
        out += intersection(comm, others)
    return out


class _DeviceTimer:
    """Timing events on an accelerator's streams; resolved only when read (see module docstring)."""

    def __init__(self, run: DBORun) -> None:
        import torch

        self._torch = torch
        self.device = run.ext.backend.device
        self.base = self._event()
        self.base.record(torch.accelerator.current_stream(self.device))
        self.t_base = run.clock.now()
        self.open: dict[int, list[tuple[str, Any, Any]]] = {}
        self.names: dict[int, str] = {}
        self.pending: list[tuple[int, str, str, Any, Any]] = []  # (ub, role, name, start, end)
        self._spans: list[Span] | None = None
        for lane in run.ext.lanes:  # every stream wait of the run goes through its lane's wait
            lane.wait = self._timed_wait(lane.ub, lane.wait)

    def _timed_wait(self, ub: UBatch, wait: Any) -> Any:
        """``wait(stream, event)``, closing the open span on ``stream`` before the wait and
        opening a new one after it."""
        def timed_wait(stream: Any, event: Any) -> Any:
            opened = self.open.get(ub.id)
            k = next((k for k, (_, s, _) in enumerate(opened) if s is stream), None) if opened else None
            if k is None:
                return wait(stream, event)
            role, _, start = opened[k]  # type: ignore[index]
            end = self._event()
            end.record(stream)
            self.pending.append((ub.id, role, self.names[ub.id], start, end))
            signal = wait(stream, event)
            after = self._event()
            after.record(stream)
            opened[k] = (role, stream, after)  # type: ignore[index]
            return signal

        return timed_wait

    def _event(self) -> Any:
        return self._torch.Event(device=self.device, enable_timing=True)

    def _streams(self, ub: UBatch) -> list[tuple[str, Any]]:
        seen: dict[int, tuple[str, Any]] = {}
        for role, stream in ub.ext.streams.items():
            seen.setdefault(id(stream), (role, stream))
        return list(seen.values())

    def resuming(self, ub: UBatch) -> None:
        opened = []
        for role, stream in self._streams(ub):
            ev = self._event()
            ev.record(stream)
            opened.append((role, stream, ev))
        self.open[ub.id] = opened
        self.names[ub.id] = f"ub{ub.id}:{ub.tag or 'start'}"

    def stepped(self, ub: UBatch, name: str) -> None:
        for role, stream, start in self.open.pop(ub.id, []):
            end = self._event()
            end.record(stream)
            self.pending.append((ub.id, role, name, start, end))

    def resolve(self) -> list[Span]:
        if self._spans is None:
            spans = []
            for ub_id, role, name, start, end in self.pending:
                end.synchronize()
                t0 = self.t_base + self.base.elapsed_time(start) / 1e3
                t1 = self.t_base + self.base.elapsed_time(end) / 1e3
                if t1 - t0 > 1e-6:  # the step queued nothing on this stream
                    kind = "comm" if role == "comm" else "compute"
                    args = {"ub": ub_id, "kind": kind, "device": True}
                    spans.append(Span(ub=ub_id, kind=kind, role=role, name=name, t0=t0, t1=t1, args=args))
            self._spans = spans
        return self._spans


def _has_device_streams(backend: object) -> bool:
    """Accelerator backends (CUDA, NPU, XPU) get timing events; host and sim keep host spans."""
    from ..backends.accelerator import AcceleratorBackend

    return isinstance(backend, AcceleratorBackend)


# ---------------------------------------------------------------------------------------- tracer
class Tracer(Instrument):
    """Records spans and numbers of every run it instruments (one run = one step).

    Reuse one tracer across the steps of a serving loop (it keeps every step; ``step_numbers()``),
    but give concurrent runs (two asyncio tasks) a tracer each: hooks go to the step in progress.

    ``rank`` becomes the trace's process id; ``profiler_ranges`` adds torch.profiler / NVTX ranges;
    ``device_timing`` (default: on for accelerator backends) records stream timing events.
    """

    def __init__(self, *, rank: int = 0, profiler_ranges: bool = False, device_timing: bool = True) -> None:
        self.rank = rank
        self.profiler_ranges = profiler_ranges
        self.device_timing = device_timing
        self.steps: list[StepRecorder] = []
        self._cur: StepRecorder | None = None
        self._pending_record: object | None = None
        self._resumed: dict[int, tuple[float, str]] = {}
        self._parked: dict[int, tuple[float, str]] = {}
        self._ranges: dict[int, tuple[Any, bool]] = {}
        self._t_sleep = 0.0
        self._now: Any = time.perf_counter  # the clock of the run in progress (set per run)
        self._record_function: Any = None
        self._nvtx: Any = None
        if profiler_ranges:
            import torch

            self._record_function = torch.profiler.record_function
            self._nvtx = torch.cuda.nvtx if torch.cuda.is_available() else None

    # ------------------------------------------------------------------ Instrument hooks
    def run_started(self, run: DBORun) -> None:
        step = StepRecorder(len(self.steps), run, self._pending_record)
        self._pending_record = None
        self._now = run.clock.now
        if self.device_timing and _has_device_streams(run.ext.backend):
            step.device = _DeviceTimer(run)
        self.steps.append(step)
        self._cur = step
        self._resumed.clear()
        self._parked.clear()

    def resuming(self, ub: UBatch) -> None:
        step = self._cur
        assert step is not None, "resuming() before run_started()"
        t = self._now()
        if step.t0 is None:
            step.t0 = t
        if self._parked:
            parked = self._parked.pop(ub.id, None)
            if parked is not None:
                step.waits.append((ub.id, parked[0], t, parked[1]))
        tag = ub.tag or "start"
        self._resumed[ub.id] = (t, tag)
        if step.device is not None:
            step.device.resuming(ub)
        if self._record_function is not None:
            name = f"ub{ub.id}:{tag}"
            rf = self._record_function(name)
            rf.__enter__()
            if self._nvtx is not None:
                self._nvtx.range_push(name)
            self._ranges[ub.id] = (rf, self._nvtx is not None)

    def stepped(self, ub: UBatch, request: object) -> None:
        t = self._now()
        step = self._cur
        assert step is not None, "stepped() before run_started()"
        if self._ranges:
            rng = self._ranges.pop(ub.id, None)
            if rng is not None:
                if rng[1]:
                    self._nvtx.range_pop()
                rng[0].__exit__(None, None, None)
        t0, tag = self._resumed.pop(ub.id, (t, ub.tag or "start"))
        if request is SWITCH:
            step.cpu.append((ub.id, t0, t, tag, "yield", ub.tag, ub.ext.role))
        elif ub.state is UBatchState.DONE:
            step.cpu.append((ub.id, t0, t, tag, "done", None, ub.ext.role))
        else:  # parked: on a Signal (has .what), an asyncio future, or a bare yield (a string)
            parked_on = ub.parked_on if ub.parked_on is not None else request
            what = parked_on if isinstance(parked_on, str) else getattr(parked_on, "what", None) or type(parked_on).__name__
            self._parked[ub.id] = (t, str(what))
            step.cpu.append((ub.id, t0, t, tag, "park", str(what), ub.ext.role))
        if step.device is not None:
            step.device.stepped(ub, f"ub{ub.id}:{tag}")

    def sleeping(self, run: DBORun) -> None:
        self._t_sleep = self._now()

    def woke(self, run: DBORun) -> None:
        if self._cur is not None:
            self._cur.idle_s += self._now() - self._t_sleep

    def run_finished(self, run: DBORun, exc: BaseException | None) -> None:
        step = self._cur
        if step is None:
            return
        step.t1 = self._now()
        if step.t0 is None:
            step.t0 = step.t1
        step.works = list(run.ext.comm)
        step.blocking = list(run.ext.blocking)
        step._spans = None
        for rf, nvtx in self._ranges.values():  # a failed step may leave ranges open
            if nvtx:
                self._nvtx.range_pop()
            rf.__exit__(None, None, None)
        self._ranges.clear()
        self._cur = None
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d step %d: %s", self.rank, step.index, step.numbers(self.rank).summary())

    # ------------------------------------------------------------------ results
    def mark_step(self, record: object) -> None:
        """Attach a planning record (anything with ``microbatched`` and ``reason``, such as
        :class:`asyncdbo.plan.StepRecord`) to the step in progress, or, between steps, to the next
        step this tracer records."""
        if not hasattr(record, "microbatched"):
            raise ValueError(f"mark_step expects a record with .microbatched and .reason (a StepRecord), got {record!r}")
        if self._cur is not None:
            self._cur.record = record
            self._cur._numbers = None
        else:
            self._pending_record = record

    def step_numbers(self) -> list[RunNumbers]:
        """The numbers of every step, in order."""
        return [s.numbers(self.rank) for s in self.steps]

    def numbers(self) -> RunNumbers:
        """The numbers of the last step (raises if no step was recorded)."""
        if not self.steps:
            raise ValueError("this Tracer has recorded no step yet; pass instrument=tracer to run_ubatches first")
        return self.steps[-1].numbers(self.rank)

    def spans(self, step: int = -1) -> list[Span]:
        """Every span of one step (default: the last), sorted by start time."""
        return sorted(self.steps[step].all_spans(), key=lambda s: (s.t0, s.ub))

    def to_chrome(self) -> dict[str, Any]:
        """Chrome trace event JSON (ui.perfetto.dev, chrome://tracing): pid = rank, one thread per
        (ubatch, track), ``ts``/``dur`` in microseconds of ``perf_counter``."""
        return chrome_trace(self.rank, self.steps)

    def export(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_chrome` to ``path`` as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome(), f)


