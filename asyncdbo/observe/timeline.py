"""A PNG timeline of a DBO trace: compute and comm lanes per ubatch, hidden comm highlighted.

Reads the Chrome trace JSON that :class:`asyncdbo.observe.Tracer` exports (one rank or merged), so
``asyncdbo trace TRACE.json --png out.png`` renders a trace recorded anywhere. Per rank and ubatch
there are two lanes: *compute* (CPU steps, or compute-stream device spans; waits drawn hatched)
and *comm* (comm works or comm-stream spans). Comm time of one ubatch that coincides with compute
on the same rank (in practice: of the other ubatch) is drawn green on the comm lane: that is the
overlap DBO is for, and the same measure as ``RunNumbers.comm_hidden_s``. The title carries each
rank's numbers.

matplotlib is the optional 'plot' extra (in a clone: ``pip install -e '.[plot]'``); it is imported only here, and
drawn through the Agg canvas directly so that no global matplotlib backend is changed.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any

__all__ = ["load_trace", "render_png"]

_COLORS = {"compute": "#4C72B0", "issue": "#8172B2", "blocking": "#C44E52", "wait": "#DDDDDD", "comm": "#DD8452",
           "hidden": "#55A868"}


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


def _title(trace: dict[str, Any]) -> str:
    lines = []
    for r in trace.get("otherData", {}).get("asyncdbo", {}).get("ranks", []):
        steps = r.get("steps", [])
        if not steps:
            continue
        comm = sum(s["comm_s"] for s in steps)
        hidden = sum(s["comm_hidden_s"] for s in steps)
        falls = [s["reason"] for s in steps if s.get("microbatched") is False]
        line = (
            f"rank {r['rank']}: {len(steps)} step(s), wall {sum(s['wall_s'] for s in steps) * 1e3:.1f} ms, "
            f"compute {sum(s['compute_s'] for s in steps) * 1e3:.1f} ms, comm {comm * 1e3:.1f} ms "
            f"({hidden / comm if comm else 0:.0%} hidden), parked {sum(s['parked_s'] for s in steps) * 1e3:.1f} ms, "
            f"{sum(s['switches'] for s in steps)} switches"
        )
        if falls:
            line += f", {len(falls)} not microbatched ({', '.join(sorted(set(map(str, falls))))})"
        lines.append(line)
    return "\n".join(lines[:4]) or "asyncdbo timeline"


def render_png(
    trace: dict[str, Any] | str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    width_px: int = 1600,
    height_px: int | None = None,
    dpi: int = 100,
) -> tuple[int, int]:
    """Draw ``trace`` (a Chrome trace dict or JSON path) to the PNG ``out``; return its pixel size.

    ``height_px`` defaults to 160 px plus 36 px per lane."""
    if width_px < 200 or (height_px is not None and height_px < 100):
        raise ValueError(f"PNG size {width_px}x{height_px} px is too small; use at least 200x100")
    data = load_trace(trace)
    spans = [e for e in data["traceEvents"] if e.get("ph") == "X" and "ub" in e.get("args", {})]
    if not spans:
        raise ValueError("the trace has no asyncdbo spans to draw (was it exported by asyncdbo.observe.Tracer?)")
    Figure, FigureCanvasAgg = _import_matplotlib()
    t0 = min(e["ts"] for e in spans)
    lanes: dict[tuple[int, int, str], list[tuple[float, float, str]]] = defaultdict(list)
    for e in spans:
        a = e["args"]
        lane = "comm" if a["kind"] == "comm" else "compute"
        style = a["kind"]
        if style == "compute" and a.get("role") == "comm" and not a.get("device"):
            style = "issue"  # CPU time spent issuing comm
        lanes[(e["pid"], a["ub"], lane)].append(((e["ts"] - t0) / 1e3, e["dur"] / 1e3, style))
    keys = sorted(lanes, key=lambda k: (k[0], k[1], k[2] != "compute"))
    height = height_px if height_px is not None else 160 + 36 * len(keys)
    fig = Figure(figsize=(width_px / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for row, key in enumerate(keys):
        y = len(keys) - 1 - row
        for style in ("wait", "compute", "issue", "blocking", "comm"):
            bars = [(s, d) for s, d, st in lanes[key] if st == style]
            if bars:
                hatch = {"wait": "//", "blocking": "xx"}.get(style)
                ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=_COLORS[style], hatch=hatch,
                               edgecolor="#999999" if hatch else "none", linewidth=0.3)
        if key[2] == "comm":
            others = [(s, s + d) for k2 in keys if k2[0] == key[0] and k2[2] == "compute"
                      for s, d, st in lanes[k2] if st in ("compute", "issue")]
            hidden = _intersections([(s, s + d) for s, d, _ in lanes[key]], others)
            if hidden:
                ax.broken_barh([(a, b - a) for a, b in hidden], (y - 0.35, 0.7), facecolors=_COLORS["hidden"], alpha=0.9)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"rank {p} ub{u} {lane}" for p, u, lane in reversed(keys)], fontsize=8)
    ax.set_xlabel("time (ms)")
    ax.set_ylim(-0.7, len(keys) - 0.3)
    ax.grid(axis="x", linewidth=0.3)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=n) for n, c in _COLORS.items()], fontsize=7, loc="lower right",
              bbox_to_anchor=(1.0, 1.0), ncol=5, frameon=False)
    ax.set_title(_title(data), fontsize=8, loc="left")
    fig.subplots_adjust(left=0.12, right=0.98, top=1 - 70 / height, bottom=50 / height)
    fig.savefig(out, dpi=dpi, format="png")
    return width_px, height


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
