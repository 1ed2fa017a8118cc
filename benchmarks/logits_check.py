"""What the engine's non-finite check costs beside the sampling it guards: ``finite_rows`` (one
``amax`` over each sampled row, then ``isfinite``) against the greedy path it sits in front of
(the rows' float32 host copy and ``argmax``), on CPU float32 rows of R requests x V vocabulary.

Both are timed in the same process, interleaved block by block (``--rounds`` rounds of
``--reps`` calls each), and reported as medians with their min-max over rounds.

Usage::

    python benchmarks/logits_check.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import publish_results, results_preamble  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import torch

    from asyncdbo.serving.sampling import finite_rows

    head, info = results_preamble("Non-finite logits check: cost beside greedy sampling",
                                  "python benchmarks/logits_check.py " + " ".join(sys.argv[1:]))
    lines = [*head, f"\n{args.rounds} rounds x {args.reps} calls, interleaved; medians (min-max) in microseconds per "
                    "call.\n\n| R x V | check | greedy (copy + argmax) | check / greedy |\n|---|---|---|---|\n"]
    for R, V in ((1, 32_000), (64, 32_000), (256, 32_000), (64, 151_936), (256, 151_936)):
        rows = torch.randn(R, V)
        check: list[float] = []
        greedy: list[float] = []
        for _ in range(args.rounds):
            for fn, out in ((lambda: finite_rows(rows), check),
                            (lambda: rows.detach().float().cpu().argmax(-1).tolist(), greedy)):
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    fn()
                out.append((time.perf_counter() - t0) / args.reps * 1e6)
        ratios = [c / g for c, g in zip(check, greedy)]
        lines.append(f"| {R} x {V} | {statistics.median(check):.1f} ({min(check):.1f}-{max(check):.1f}) | "
                     f"{statistics.median(greedy):.1f} ({min(greedy):.1f}-{max(greedy):.1f}) | "
                     f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |\n")
    publish_results("".join(lines), args.out, "logits_check", info)


if __name__ == "__main__":
    main()
