"""Chrome/Perfetto trace event JSON of traced steps: one process per rank, one thread per
(ubatch, track); merging per-rank traces, and writing what ``asyncdbo demo --trace DIR`` writes.

Timestamps (``ts``, microseconds) count from the start of the first recorded step, so a trace
reads the same on every machine; the absolute origin, in seconds of the recording clock
(``perf_counter``: one clock for every process on a host), is kept in
``otherData.asyncdbo.origin_s`` and per rank in ``otherData.asyncdbo.ranks[i].origin_s``.
:func:`merge_traces` puts the ranks on the earliest rank's origin, so spans of different ranks
still line up as recorded.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .spans import Span

if TYPE_CHECKING:
    from .recorder import StepRecorder

__all__ = ["chrome_trace", "merge_traces", "write_traces"]

log = logging.getLogger("asyncdbo")


def _tid(ub: int, track: int) -> int:
    return ub * 100 + track  # ubatch-major: ub0 compute, ub0 comm lanes..., ub1 compute, ...


def _lanes(spans: Sequence[Span]) -> list[int]:
    """Greedy lanes so that spans on one Chrome thread never partly overlap (two comm works of one
    ubatch may be in flight at once)."""
    ends: list[float] = []
    lanes = []
    for s in spans:
        for k, end in enumerate(ends):
            if s.t0 >= end:
                ends[k] = s.t1
                lanes.append(k)
                break
        else:
            ends.append(s.t1)
            lanes.append(len(ends) - 1)
    return lanes


def chrome_trace(rank: int, steps: Sequence[StepRecorder]) -> dict[str, Any]:
    """The Chrome trace of one rank's recorded steps (:meth:`Tracer.to_chrome`)."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    named: set[int] = set()

    def thread(ub: int, track: int, label: str) -> int:
        tid = _tid(ub, track)
        if tid not in named:
            named.add(tid)
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
        return tid

    origin = min((s.t0 for s in steps if s.t0 is not None), default=0.0)
    for step in steps:
        # tracks: CPU steps and waits (track 0, never overlapping: one thread), host comm works
        # (1 + lane), device compute stream (50 + lane) and comm stream (60 + lane), as sim traces.
        tracks: dict[tuple[int, int, str], list[Span]] = {}
        for s in step.all_spans():
            if s.args.get("device"):
                key = (s.ub, 50 if s.kind == "compute" else 60, f"ub{s.ub} {s.kind} stream")
            else:
                key = (s.ub, 1, f"ub{s.ub} comm") if s.kind == "comm" else (s.ub, 0, f"ub{s.ub} compute")
            tracks.setdefault(key, []).append(s)
        for (ub, base, label), spans in sorted(tracks.items()):
            spans.sort(key=lambda s: s.t0)
            for s, lane in zip(spans, _lanes(spans) if base else [0] * len(spans)):
                tid = thread(ub, base + lane, label + (f" {lane}" if lane else ""))
                events.append(_x(rank, tid, s, step.index, origin))
        for ub, tag, t in step.instants:
            events.append({"ph": "i", "s": "t", "name": tag, "cat": "yield", "pid": rank, "tid": thread(ub, 0, f"ub{ub} compute"),
                           "ts": (t - origin) * 1e6, "args": {"ub": ub, "step": step.index}})
    numbers = [dict(asdict(n), yields_per_ubatch=list(n.yields_per_ubatch)) for n in (s.numbers(rank) for s in steps)]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"asyncdbo": _meta(rank, numbers, origin if steps else None)},
    }


def _meta(rank: int, numbers: list[dict[str, Any]], origin: float | None) -> dict[str, Any]:
    """``otherData.asyncdbo`` of one rank; no origin when nothing was recorded."""
    entry: dict[str, Any] = {"rank": rank, "steps": numbers}
    meta: dict[str, Any] = {"ranks": [entry], "clock": "perf_counter"}
    if origin is not None:
        entry["origin_s"] = meta["origin_s"] = origin
    return meta


def _x(pid: int, tid: int, s: Span, step: int, origin: float) -> dict[str, Any]:
    args = {k: v for k, v in s.args.items() if v is not None}
    for key in ("t_done", "t_release"):  # clock readings, made relative like ts (in seconds)
        if isinstance(args.get(key), float):
            args[key] -= origin
    args["step"] = step
    return {"ph": "X", "name": s.name, "cat": s.kind, "pid": pid, "tid": tid, "ts": (s.t0 - origin) * 1e6,
            "dur": max(0.0, (s.t1 - s.t0) * 1e6), "args": args}


def merge_traces(traces: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One trace from per-rank traces (:meth:`Tracer.to_chrome`): one process lane per rank. Ranks
    on one host share ``perf_counter``, so once every rank's timestamps count from the earliest
    rank's origin (``origin_s``) their spans line up as recorded."""
    events: list[dict[str, Any]] = []
    ranks: list[dict[str, Any]] = []
    seen: set[int] = set()
    for i, trace in enumerate(traces):
        if not isinstance(trace, dict) or "traceEvents" not in trace:
            raise ValueError(f"merge_traces: traces[{i}] is not a Chrome trace dict with 'traceEvents' (got {type(trace).__name__})")
    origins = [t.get("otherData", {}).get("asyncdbo", {}).get("origin_s") for t in traces]
    known = [o for o in origins if isinstance(o, (int, float))]
    origin = min(known, default=None)
    for i, trace in enumerate(traces):
        info = trace.get("otherData", {}).get("asyncdbo", {}).get("ranks", [])
        pids = {e["pid"] for e in trace["traceEvents"]}
        clash = pids & seen
        if clash:
            raise ValueError(f"merge_traces: rank(s) {sorted(clash)} appear in more than one trace; give each Tracer its own rank=")
        seen |= pids
        shift_us = 0.0 if origin is None or not isinstance(origins[i], (int, float)) else (origins[i] - origin) * 1e6
        events += [dict(e, ts=e["ts"] + shift_us) if "ts" in e and shift_us else e for e in trace["traceEvents"]]
        ranks += info
    ranks.sort(key=lambda r: r["rank"])
    meta: dict[str, Any] = {"ranks": ranks, "clock": "perf_counter"}
    if origin is not None:
        meta["origin_s"] = origin
    titles = {t.get("otherData", {}).get("asyncdbo", {}).get("title") for t in traces} - {None}
    if len(titles) == 1:
        meta["title"] = titles.pop()
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"asyncdbo": meta}}


def write_traces(directory: str | os.PathLike[str], traces: Sequence[dict[str, Any]], *, png: bool = True) -> list[str]:
    """What ``asyncdbo demo --trace DIR`` writes: ``rank<r>.json`` per rank, ``merged.json``, and
    ``timeline.png`` of the merged trace (skipped, with a log warning, without the 'plot' extra).
    Returns the paths written."""
    os.makedirs(directory, exist_ok=True)
    merged = merge_traces(traces)
    paths = []
    for trace in traces:
        (rank,) = {e["pid"] for e in trace["traceEvents"]}
        paths.append(os.path.join(directory, f"rank{rank}.json"))
        with open(paths[-1], "w", encoding="utf-8") as f:
            json.dump(trace, f)
    paths.append(os.path.join(directory, "merged.json"))
    with open(paths[-1], "w", encoding="utf-8") as f:
        json.dump(merged, f)
    if png:
        from .timeline import render_png

        try:
            render_png(merged, os.path.join(directory, "timeline.png"))
        except ModuleNotFoundError as exc:
            log.warning("not writing timeline.png: %s", exc)
        else:
            paths.append(os.path.join(directory, "timeline.png"))
    return paths
