"""``asyncdbo trace TRACE.json [--png out.png]``: look at a recorded trace.

The trace is the Chrome/Perfetto JSON of :class:`asyncdbo.observe.Tracer` (one rank or merged); open
it in ui.perfetto.dev or chrome://tracing for the interactive view, or render a PNG here. The
per-step numbers stored in the trace are printed in every case (with ``--png`` after the "wrote"
line), so a user who asked for a picture also sees what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["COLUMN_NOTES", "MAX_TRACE_BYTES", "add_arguments", "format_numbers", "main", "read_trace"]

#: The largest trace file read (a trace of a few steps is kilobytes to a few megabytes; a device
#: file such as /dev/zero never ends).
MAX_TRACE_BYTES = 256 * 2**20
#: The narrowest PNG the timeline draws (its title and legend need the room).
MIN_WIDTH_PX = 200

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
    parser.add_argument("--width", type=int, default=1600, help=f"PNG width in pixels, at least {MIN_WIDTH_PX} (default 1600)")
    parser.add_argument(
        "--print-numbers",
        action="store_true",
        help="print each rank's per-step numbers (always done; kept so older command lines still work)",
    )


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
    return "\n".join([*lines, "", *COLUMN_NOTES])


#: What each column of :func:`format_numbers` means (asyncdbo.observe.RunNumbers), printed under it.
COLUMN_NOTES = (
    "rank, step: the rank, and the step's index in its Tracer (0 = the first run it recorded)",
    "wall ms: from the first ubatch's first resume to the end of the step",
    "compute ms: time ubatches computed (CPU steps, or compute-stream spans on a device), summed over ubatches",
    "comm ms: time some comm was in flight (the union over ubatches, not a sum)",
    "hidden: share of comm ms during which some ubatch computed (the trace's PNG splits it by which ubatch)",
    "parked ms: time ubatches waited for their comm or an event, summed over ubatches (two parked at once count twice)",
    "switches: yields of all ubatches; yields/ub: yields of each ubatch",
    "plan: whether the planner split the step, where the step was marked (Tracer.mark_step); blank if not",
)


def read_trace(path: str) -> dict[str, Any]:
    """Read and check a trace file: at most :data:`MAX_TRACE_BYTES`, JSON, a Chrome trace object,
    and every asyncdbo field this command uses present with the right kind of value. Raises
    ValueError (or OSError) naming what is wrong."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_TRACE_BYTES:
            raise ValueError(f"it is {size / 2**20:.0f} MiB, more than the {MAX_TRACE_BYTES // 2**20} MiB a trace may have")
        raw = f.read(MAX_TRACE_BYTES + 1)
    if len(raw) > MAX_TRACE_BYTES:
        raise ValueError(f"it goes on past {MAX_TRACE_BYTES // 2**20} MiB (a device or a pipe, not a trace file)")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise ValueError(f"it is not UTF-8 JSON ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"it is not JSON ({exc})") from None
    except RecursionError:  # json's C decoder recurses per nesting level
        raise ValueError(
            f"it nests arrays or objects deeper than Python's JSON reader follows (recursion limit "
            f"{sys.getrecursionlimit()}); a Chrome trace nests a few levels, so this is not one"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError("it is JSON but not a Chrome trace: no 'traceEvents' list at the top level")
    _check_fields(data)
    return data


def _check_fields(data: dict[str, Any]) -> None:
    """The fields :func:`format_numbers` and the PNG timeline read, so a foreign or older trace
    fails here with its path instead of a KeyError later."""
    numbers = ("wall_s", "compute_s", "comm_s", "comm_hidden_s", "comm_hidden_share", "parked_s", "switches")
    ranks: Any = data
    for i, key in enumerate(("otherData", "asyncdbo", "ranks")):
        if not isinstance(ranks, dict) or key not in ranks:
            ranks = []  # no asyncdbo numbers: a plain Chrome trace
            break
        ranks = ranks[key]
        if i < 2 and not isinstance(ranks, dict):
            raise ValueError(f"{'.'.join(('otherData', 'asyncdbo')[: i + 1])} is not an object")
    if not isinstance(ranks, list):
        raise ValueError("otherData.asyncdbo.ranks is not a list")
    for i, r in enumerate(ranks):
        where = f"otherData.asyncdbo.ranks[{i}]"
        if not isinstance(r, dict) or "rank" not in r or not isinstance(r.get("steps", []), list):
            raise ValueError(f"{where} lacks 'rank' or its 'steps' list (not written by asyncdbo's Tracer?)")
        for j, step in enumerate(r.get("steps", [])):
            missing = [k for k in (*numbers, "step", "yields_per_ubatch") if not isinstance(step, dict) or k not in step]
            if missing:
                raise ValueError(f"{where}.steps[{j}] lacks {missing} (not written by asyncdbo's Tracer?)")
            bad = [k for k in numbers if not isinstance(step[k], (int, float)) or isinstance(step[k], bool)]
            if bad:
                raise ValueError(f"{where}.steps[{j}] has non-numbers in {bad}")
    for i, e in enumerate(data["traceEvents"]):
        if not isinstance(e, dict):
            raise ValueError(f"traceEvents[{i}] is not an object")
        args = e.get("args")
        if e.get("ph") == "X" and isinstance(args, dict) and "ub" in args:
            missing = [k for k in ("ts", "dur", "pid") if not isinstance(e.get(k), (int, float))]
            missing += [f"args.{k}" for k in ("kind",) if k not in args]
            if missing:
                raise ValueError(f"traceEvents[{i}] (an asyncdbo span) lacks {missing} or has non-numbers there")


def main(args: argparse.Namespace) -> int:
    from ..observe.timeline import render_png

    if args.width < MIN_WIDTH_PX:  # before reading a large trace, not after
        print(f"asyncdbo trace: error: --width {args.width} px is too narrow for a timeline; "
              f"use at least --width {MIN_WIDTH_PX} (default 1600)", file=sys.stderr)
        return 2
    try:
        trace = read_trace(args.trace)
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
    print(format_numbers(trace))
    return 0
