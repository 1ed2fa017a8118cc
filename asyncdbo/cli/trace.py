"""``asyncdbo trace TRACE.json [--png out.png] [--print-numbers]``: look at a recorded trace.

The trace is the Chrome/Perfetto JSON of :class:`asyncdbo.observe.Tracer` (one rank or merged); open
it in ui.perfetto.dev or chrome://tracing for the interactive view, or render a PNG here.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "format_numbers", "main"]

_COLUMNS = (
    ("rank", "rank", "{}"),
    ("step", "step", "{}"),
    ("wall ms", "wall_s", "{:.2f}"),
    ("compute ms", "compute_s", "{:.2f}"),
    ("comm ms", "comm_s", "{:.2f}"),
    ("hidden", "comm_hidden_share", "{:.0%}"),
    ("parked ms", "parked_s", "{:.2f}"),
    ("switches", "switches", "{}"),
    ("yields/ub", "yields_per_ubatch", "{}"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace JSON written by Tracer.export or merge_traces")
    parser.add_argument("--png", metavar="OUT", help="write a PNG timeline here (needs the 'plot' extra)")
    parser.add_argument("--width", type=int, default=1600, help="PNG width in pixels (default 1600)")
    parser.add_argument("--print-numbers", action="store_true", help="print each rank's per-step numbers")


def _value(rank: dict, step: dict, key: str) -> object:
    if key == "rank":
        return rank["rank"]
    return step[key] * 1e3 if key.endswith("_s") else step[key]  # seconds are shown in ms


def format_numbers(trace: dict) -> str:
    """A plain table of the per-step numbers stored in the trace."""
    rows = []
    for r in trace.get("otherData", {}).get("asyncdbo", {}).get("ranks", []):
        for s in r.get("steps", []):
            row = [fmt.format(_value(r, s, key)) for _, key, fmt in _COLUMNS]
            mb = s.get("microbatched")
            row.append("" if mb is None else ("microbatched" if mb else f"fell out: {s.get('reason')}"))
            rows.append(row)
    header = [name for name, _, _ in _COLUMNS] + ["plan"]
    if not rows:
        return "no asyncdbo numbers in this trace"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from ..observe.timeline import load_trace, render_png

    try:
        trace = load_trace(args.trace)
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        print(f"asyncdbo trace: cannot read {args.trace!r}: {exc}", file=sys.stderr)
        return 2
    if args.png:
        try:
            w, h = render_png(trace, args.png, width_px=args.width)
        except (ModuleNotFoundError, ValueError) as exc:
            print(f"asyncdbo trace: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.png} ({w}x{h} px)")
    if args.print_numbers or not args.png:
        print(format_numbers(trace))
    return 0
