"""What examples 03 (a host sync that blocks the thread) and 04 (the same wait made a park) claim,
measured side by side: each one's DBO speedup over its serial step, and how long DBO's steps kept
the CPU blocked.

Both examples run in this one interpreter (they set torch's thread count at import), alternating,
each call timing ``--steps`` serial/DBO pairs after a warm-up and returning medians. A speedup is
serial / DBO with each step's time taken as its wall time less the time its thread waited for a
CPU core (Linux's schedstat), which moves less with other jobs' load than plain wall time; the
plain wall-time speedup is reported beside it. The blocked time is debug mode's blocking detector:
per step, the time spent between two yields neither computing nor waiting for a core.

    python benchmarks/example_claims.py             # 5 alternations; writes benchmarks/results/example_claims_<hw>_<date>.md
    python benchmarks/example_claims.py --quick     # 2 alternations of 3 pairs each, prints only
    python benchmarks/example_claims.py --quick --json   # the same as one JSON line (tests/docs/test_examples_claims.py)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import statistics
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import publish_results, results_preamble  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name.replace(".py", ""), ROOT / "examples" / name)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure(alternations: int, steps: int) -> dict[str, Any]:
    """Each example's medians per alternation (03 first, then 04, ``alternations`` times)."""
    broken = _load("03_item_kills_overlap_broken.py")
    fixed = _load("04_item_kills_overlap_fixed.py")
    runs: dict[str, list[dict[str, float]]] = {"broken": [], "fixed": []}
    for _ in range(alternations):
        runs["broken"].append(broken.main(quiet=True, rounds=steps))
        runs["fixed"].append(fixed.main(quiet=True, rounds=steps))
    return {"runs": runs, "latency_s": broken.LINK.latency_s, "layers": broken.LAYERS,
            "blocking_s": broken.BLOCKING_S}


def report(data: dict[str, Any], alternations: int, steps: int, command: str) -> tuple[str, dict[str, str]]:
    runs = data["runs"]
    med = {k: {f: statistics.median(r[f] for r in runs[k]) for f in runs[k][0]} for k in runs}
    ratio = med["fixed"]["speedup"] / med["broken"]["speedup"]
    ratio_wall = med["fixed"]["speedup_wall"] / med["broken"]["speedup_wall"]
    paired = [f["speedup"] / b["speedup"] for b, f in zip(runs["broken"], runs["fixed"])]
    expected_block_ms = 2 * data["layers"] * data["latency_s"] * 1e3
    lines, info = results_preamble("Examples 03 (blocking host sync) and 04 (the wait made a park), side by side",
                                   command)
    lines += [
        f"\n{alternations} alternations (03, then 04), each call {steps} serial/DBO pairs after a warm-up; medians "
        f"over the alternations of each call's medians. Link: {data['latency_s'] * 1e3:g} ms per message, "
        f"{data['layers']} layers, 2 ubatches: a DBO step that blocks for the whole latency per ubatch and layer "
        f"blocks {expected_block_ms:.1f} ms.\n\n",
        "| example | serial ms | DBO ms | speedup | speedup (wall) | DBO blocked ms | serial blocked ms |\n",
        "|---|---:|---:|---:|---:|---:|---:|\n",
    ]
    for key, name in (("broken", "03 blocking"), ("fixed", "04 park")):
        m = med[key]
        lines.append(f"| {name} | {m['serial_own_s'] * 1e3:.1f} | {m['dbo_own_s'] * 1e3:.1f} | {m['speedup']:.3f} | "
                     f"{m['speedup_wall']:.3f} | {m['dbo_blocked_s'] * 1e3:.2f} | {m['serial_blocked_s'] * 1e3:.2f} |\n")
    lines += [
        f"\n04's speedup / 03's: {ratio:.3f} (wall time: {ratio_wall:.3f}); per alternation "
        f"{', '.join(f'{p:.3f}' for p in paired)} (min {min(paired):.3f}, max {max(paired):.3f}).\n",
        "Speedups: serial / DBO, each step's time its wall time less the time its thread waited for a CPU "
        "core; (wall): plain wall time.\n",
    ]
    return "".join(lines), info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alternations", type=int, default=5, help="03-then-04 rounds (default 5)")
    ap.add_argument("--steps", type=int, default=5, help="serial/DBO pairs per example call (default 5)")
    ap.add_argument("--quick", action="store_true", help="2 alternations of 3 pairs, print only")
    ap.add_argument("--json", action="store_true", help="print the measurements as one JSON line instead")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"folder for the results file (default {RESULTS.relative_to(ROOT)} without --quick)")
    args = ap.parse_args(argv)
    for flag in ("alternations", "steps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.quick:
        args.alternations, args.steps = 2, 3
    data = measure(args.alternations, args.steps)
    if args.json:
        print(json.dumps(data))
        return 0
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/example_claims.py", *(argv or sys.argv[1:])])
    text, info = report(data, args.alternations, args.steps, command)
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    publish_results(text, out, "example_claims", info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
