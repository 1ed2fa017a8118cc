"""What a :class:`~asyncdbo.observe.Tracer` records about one run (:class:`StepRecorder`): CPU
steps, waits, instants and comm, turned into spans and numbers only when read."""

from __future__ import annotations

from typing import Any

from .._core import DBORun, UBatch
from ..backends import CommRecord
from .intervals import hidden_seconds, intersection, union_seconds
from .spans import RunNumbers, Span

__all__ = ["StepRecorder"]


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
