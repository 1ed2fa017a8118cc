"""A PNG timeline of a DBO trace that explains itself: lanes per rank and ubatch, labelled bars,
a legend that defines every colour, hidden comm split by who hid it.

Reads the Chrome trace JSON that :class:`asyncdbo.observe.Tracer` exports (one rank or merged), so
``asyncdbo trace TRACE.json --png out.png`` renders a trace recorded anywhere. Per rank and ubatch
there are two lanes: *compute* (CPU steps, or compute-stream device spans) and *comm* (comm works,
or comm-stream spans). What a stranger needs to read it is drawn on it:

* every bar wide enough carries its tag: a compute step the yield point it resumed from
  (``dispatch``, ``combine``, ...), a wait what it waits on, a comm bar what was sent; labels never
  overlap: where two works of one lane are in flight together (a dispatch and its ids), their
  labels are stacked above and below the lane's centre, and a label that still has no room is
  left out and counted in the legend;
* the legend defines every colour drawn, and only those, including the two kinds of hidden comm:
  under *another* ubatch's compute (the overlap DBO adds, ``RunNumbers.comm_hidden_by_other_s``)
  and under the same ubatch's own compute (between issuing a transfer and waiting for it, such as
  a shared expert while its combine is in flight; no DBO needed);
* blocking host code (debug mode's ``BlockingStep`` records) is drawn red and cross-hatched, not
  as compute, with a note saying that without ``debug=True`` it cannot be told apart;
* each rank is drawn from its own step start (x = 0), and a note gives each rank's offset on the
  shared clock, so ranks that began a few ms apart are aligned and the reader is told so;
* the title carries the trace's own title when it has one (``otherData.asyncdbo.title``: the demo
  names the step as the user counts it) and each rank's numbers.

:func:`timeline_figure` builds the matplotlib figure (tests read its text elements);
:func:`render_png` writes it. matplotlib is the optional 'plot' extra (in a clone:
``pip install -e '.[plot]'``); it is imported only here, and drawn through the Agg canvas directly
so that no global matplotlib backend is changed.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any

__all__ = ["STYLES", "load_trace", "render_png", "timeline_figure"]

#: style -> (colour, what it means): every colour the timeline draws, as its legend states it.
STYLES: dict[str, tuple[str, str]] = {
    "compute": ("#4C72B0", "computing: a ubatch's step between two yields (label: the yield it resumed from)"),
    "issue": ("#8172B2", "issuing comm: a step that ends on the comm stream (label: the yield it resumed from)"),
    "blocking": ("#C44E52", "CPU blocked in a host sync (.wait(), .item(), sleep): no ubatch could run"),
    "wait": ("#DDDDDD", "parked: the ubatch waits for its own comm or an event (label: what); others may run"),
    "comm": ("#DD8452", "comm in flight, exposed: no ubatch on this rank computed meanwhile (label: what was sent)"),
    "hidden": ("#55A868", "comm in flight while another ubatch computed: the overlap DBO adds"),
    "own": ("#B5DDA8", "comm in flight while its own ubatch computed (work between issuing it and waiting for it): "
                       "no DBO needed"),
}
#: A label lifted above or dropped below the lane's centre when it would overlap a neighbour's,
#: in lane units (a lane is 1; a label is about 0.3 at the default sizes).
_STACK_DY = 0.19
_HATCH = {"wait": "//", "blocking": "xx"}
_DARK_TEXT = {"wait", "own"}  # light fills get black labels
_LANE_PX, _LABEL_PT = 34, 6.5


def _import_matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ModuleNotFoundError(
            "PNG timelines need matplotlib, the optional 'plot' extra: in your asyncdbo clone, "
            "pip install -e '.[plot]' (asyncdbo is not on PyPI yet), or pip install matplotlib"
        ) from exc
    return Figure, FigureCanvasAgg


def load_trace(trace: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    if isinstance(trace, dict):
        return trace
    with open(trace, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "traceEvents" not in data:
        raise ValueError(f"{os.fspath(trace)!r} is not a Chrome trace JSON object with 'traceEvents'")
    return data


def _title(trace: dict[str, Any]) -> list[str]:
    meta = trace.get("otherData", {}).get("asyncdbo", {})
    lines = [str(meta["title"])] if meta.get("title") else []
    for r in meta.get("ranks", []):
        steps = r.get("steps", [])
        if not steps:
            continue
        comm = sum(s["comm_s"] for s in steps)
        hidden = sum(s["comm_hidden_s"] for s in steps)
        other = sum(s.get("comm_hidden_by_other_s", 0.0) for s in steps)
        falls = [s["reason"] for s in steps if s.get("microbatched") is False]
        line = (
            f"rank {r['rank']}: {len(steps)} step(s), wall {sum(s['wall_s'] for s in steps) * 1e3:.1f} ms, "
            f"compute {sum(s['compute_s'] for s in steps) * 1e3:.1f} ms, comm {comm * 1e3:.1f} ms "
            f"({hidden / comm if comm else 0:.0%} hidden, {other / comm if comm else 0:.0%} by another ubatch), "
            f"parked {sum(s['parked_s'] for s in steps) * 1e3:.1f} ms, {sum(s['switches'] for s in steps)} yields"
        )
        if sum(s.get("blocking_s", 0.0) for s in steps):
            line += f", blocked {sum(s['blocking_s'] for s in steps) * 1e3:.1f} ms"
        if falls:
            line += f", {len(falls)} not microbatched ({', '.join(sorted(set(map(str, falls))))})"
        lines.append(line)
    return lines[:5] or ["asyncdbo timeline"]


def _label(e: dict[str, Any], style: str) -> str:
    a = e["args"]
    if style == "wait":
        return str(e["name"]).removeprefix("wait: ")
    if a["kind"] == "comm":
        return str(e["name"])
    return str(a.get("from") or str(e["name"]).split(":", 1)[-1])


def _bars(data: dict[str, Any]) -> tuple[dict[tuple[int, int, str], list[tuple[float, float, str, str]]], dict[int, float]]:
    """Bars per (rank, ubatch, lane): (x ms from the rank's start, width ms, style, label), and
    each rank's start in trace microseconds."""
    spans = [e for e in data["traceEvents"] if e.get("ph") == "X" and "ub" in e.get("args", {})]
    if not spans:
        raise ValueError("the trace has no asyncdbo spans to draw (was it exported by asyncdbo.observe.Tracer?)")
    starts: dict[int, float] = {}
    for e in spans:
        starts[e["pid"]] = min(starts.get(e["pid"], e["ts"]), e["ts"])
    lanes: dict[tuple[int, int, str], list[tuple[float, float, str, str]]] = defaultdict(list)
    for e in spans:
        a = e["args"]
        lane = "comm" if a["kind"] == "comm" else "compute"
        style = a["kind"]
        if style == "compute" and a.get("role") == "comm" and not a.get("device"):
            style = "issue"  # CPU time spent issuing comm
        x = (e["ts"] - starts[e["pid"]]) / 1e3
        lanes[(e["pid"], a["ub"], lane)].append((x, e["dur"] / 1e3, style, _label(e, style)))
    return lanes, starts


def _notes(starts: dict[int, float], blocking: bool) -> list[str]:
    ranks = sorted(starts)
    if len(ranks) == 1:
        align = f"x: ms since rank {ranks[0]}'s step started."
    else:
        first = min(starts.values())
        offsets = ", ".join(f"rank {r} +{(starts[r] - first) / 1e3:.1f} ms" for r in ranks)
        align = (f"Ranks aligned: each is drawn from its own step start (x = 0); on the shared clock they "
                 f"started at {offsets}.")
    block = ("Blocked steps are drawn red." if blocking else
             "No blocked step recorded: host syncs show as red only with debug=True, else they look like compute.")
    return [align + " " + block]


def timeline_figure(
    trace: dict[str, Any] | str | os.PathLike[str],
    *,
    width_px: int = 1600,
    height_px: int | None = None,
    dpi: int = 100,
) -> Any:
    """The timeline of ``trace`` as a matplotlib ``Figure`` (on an Agg canvas). ``height_px``
    defaults to what the title, the lanes (34 px each), the notes and the legend need."""
    if width_px < 200:
        raise ValueError(f"PNG width {width_px} px is too narrow for a timeline; use at least 200")
    if height_px is not None and height_px < 100:
        raise ValueError(f"PNG height {height_px} px is too short for a timeline; use at least 100 (or None to fit the lanes)")
    data = load_trace(trace)
    lanes, starts = _bars(data)
    Figure, FigureCanvasAgg = _import_matplotlib()
    from matplotlib.patches import Patch

    keys = sorted(lanes, key=lambda k: (k[0], k[1], k[2] != "compute"))
    drawn_bars = {key: _split_hidden(list(lanes[key]), key, lanes) if key[2] == "comm" else list(lanes[key])
                  for key in keys}
    present = [st for st in STYLES if any(b[2] == st for bars in drawn_bars.values() for b in bars)]
    title = _title(data)
    blocking = "blocking" in present
    notes = _notes(starts, blocking)
    top_px = 16 + 12 * len(title)
    bottom_px = 52 + 12 * len(notes) + 14 * ((len(present) + 2) // 2) + 10  # room for an "elided" entry
    height = height_px if height_px is not None else top_px + _LANE_PX * len(keys) + bottom_px
    fig = Figure(figsize=(width_px / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    left, right = 0.09, 0.99
    ax = fig.add_subplot(1, 1, 1)
    fig.subplots_adjust(left=left, right=right, top=1 - top_px / height, bottom=bottom_px / height)
    x_max = max(x + w for bars in lanes.values() for x, w, _, _ in bars) or 1.0
    ax.set_xlim(0, x_max * 1.02)
    ax.set_ylim(-0.7, len(keys) - 0.3)
    renderer = fig.canvas.get_renderer()
    elided = 0
    for row, key in enumerate(keys):
        y = len(keys) - 1 - row
        bars = drawn_bars[key]
        for style in STYLES:
            drawn = [(x, w) for x, w, st, _ in bars if st == style]
            if drawn:
                hatch = _HATCH.get(style)
                ax.broken_barh(drawn, (y - 0.35, 0.7), facecolors=STYLES[style][0], hatch=hatch,
                               edgecolor="#999999" if hatch else "none", linewidth=0.3)
        elided += _place_labels(ax, renderer, lanes[key], y, dark=key[2] == "comm")
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"rank {p} ub{u} {lane}" for p, u, lane in reversed(keys)], fontsize=8)
    ax.set_xlabel("ms since the rank's step start", fontsize=8)
    ax.grid(axis="x", linewidth=0.3)
    ax.set_title("\n".join(title), fontsize=8, loc="left")
    y_notes = (bottom_px - 46) / height
    for i, note in enumerate(notes):
        fig.text(0.01, y_notes - i * 12 / height, note, fontsize=7, va="top")
    handles = [Patch(facecolor=STYLES[n][0], hatch=_HATCH.get(n), edgecolor="#999999" if n in _HATCH else STYLES[n][0],
                     label=f"{n}: {STYLES[n][1]}") for n in present]
    if elided:
        handles.append(Patch(facecolor="none", edgecolor="none",
                             label=f"{elided} label(s) left out where works of one lane overlap (the JSON in "
                                   "ui.perfetto.dev names every one)"))
    fig.legend(handles=handles, fontsize=7, loc="lower left", bbox_to_anchor=(0.01, 0.0), ncol=2, frameon=False)
    return fig


def _place_labels(ax: Any, renderer: Any, bars: list[tuple[float, float, str, str]], y: float, *, dark: bool) -> int:
    """Label the bars of one lane at height ``y``; return how many labels were left out.

    A label is drawn only inside its bar (measured as drawn, in pixels). Labels whose extents
    overlap form a cluster: a lone label sits on the lane's centre, the labels of a cluster go
    above and below it in turn (the first free of the two rows), and one with neither row free
    is removed and counted."""
    to_px = ax.transData
    placed: list[tuple[float, float, Any]] = []  # (left px, right px, text) of labels kept
    for x, w, style, label in sorted(bars, key=lambda b: (b[0], -b[1])):
        if not label:
            continue
        t = ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=_LABEL_PT, clip_on=True,
                    color="black" if style in _DARK_TEXT or dark else "white")
        box = t.get_window_extent(renderer)
        bar_px = to_px.transform((x + w, y))[0] - to_px.transform((x, y))[0]
        if box.width + 4 > bar_px:  # does not fit inside its own bar
            t.remove()
            continue
        placed.append((box.x0 - 2, box.x1 + 2, t))
    elided = 0
    cluster: list[tuple[float, float, Any]] = []
    for item in sorted(placed, key=lambda p: p[0]) + [(float("inf"), float("inf"), None)]:
        if cluster and item[0] >= max(c[1] for c in cluster):
            if len(cluster) > 1:
                elided += _stack(cluster, y)
            cluster = []
        if item[2] is not None:
            cluster.append(item)
    return elided


def _stack(cluster: list[tuple[float, float, Any]], y: float) -> int:
    """Two rows, above and below ``y``, for overlapping labels (left to right, first free row)."""
    ends = [-float("inf"), -float("inf")]
    elided = 0
    for left, right, t in cluster:
        row = next((r for r in (0, 1) if ends[r] <= left), None)
        if row is None:
            t.remove()
            elided += 1
            continue
        ends[row] = right
        t.set_y(y + (_STACK_DY if row == 0 else -_STACK_DY))
    return elided


def render_png(
    trace: dict[str, Any] | str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    width_px: int = 1600,
    height_px: int | None = None,
    dpi: int = 100,
) -> tuple[int, int]:
    """Draw ``trace`` (a Chrome trace dict or JSON path) to the PNG ``out``; return its pixel size
    (see :func:`timeline_figure` for the default height)."""
    fig = timeline_figure(trace, width_px=width_px, height_px=height_px, dpi=dpi)
    fig.savefig(out, dpi=dpi, format="png")
    w, h = fig.get_size_inches() * dpi
    return int(round(w)), int(round(h))


def _split_hidden(bars: list[tuple[float, float, str, str]], key: tuple[int, int, str],
                  lanes: dict[tuple[int, int, str], list[tuple[float, float, str, str]]]) -> list[tuple[float, float, str, str]]:
    """A comm lane's bars plus the pieces hidden under another ubatch's compute ("hidden") and
    under its own ubatch's compute ("own"), drawn over them."""
    rank, ub, _ = key
    computing = ("compute", "issue")
    other = [(x, x + w) for k, bs in lanes.items() if k[0] == rank and k[2] == "compute" and k[1] != ub
             for x, w, st, _ in bs if st in computing]
    own = [(x, x + w) for x, w, st, _ in lanes.get((rank, ub, "compute"), []) if st in computing]
    comm = [(x, x + w) for x, w, _, _ in bars]
    by_other = _intersections(comm, other)
    by_own = _subtract(_intersections(comm, own), by_other)
    return (bars + [(a, b - a, "own", "") for a, b in by_own]
            + [(a, b - a, "hidden", "") for a, b in by_other])


def _subtract(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Pieces of ``xs`` (disjoint, sorted) outside ``ys`` (disjoint, sorted)."""
    out = []
    for a, b in xs:
        cur = a
        for c, d in ys:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


def _intersections(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Pieces of ``union(xs)`` that lie inside ``union(ys)``."""
    out = []
    for a, b in xs:
        for c, d in ys:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                out.append((lo, hi))
    # merge, so the green pieces are drawn once
    merged: list[tuple[float, float]] = []
    for a, b in sorted(out):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged
