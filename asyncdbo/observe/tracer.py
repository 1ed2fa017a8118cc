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
from .recorder import StepRecorder, _DeviceTimer
from .spans import RunNumbers, Span

__all__ = ["StepRecorder", "Tracer"]

log = logging.getLogger("asyncdbo")


# ---------------------------------------------------------------------------------------- one step
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


