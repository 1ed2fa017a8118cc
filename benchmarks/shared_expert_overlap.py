"""Where the serial run's "comm hidden" comes from: the demo with and without its shared expert.

    python benchmarks/shared_expert_overlap.py [--steps 4] [--out benchmarks/results]

``asyncdbo demo`` reports comm hidden for the serial run too, although a serial run has no other
ubatch to hide comm behind. The MoE layer runs the shared expert on the compute side while the
same ubatch's combine is in flight (``asyncdbo/moe/layer.py``, the ``ht`` schedule), and that
overlap needs no DBO. This runs the demo's own per-rank function (2 ranks) with the default model
and with ``num_shared_experts=0``, on loopback gloo and on the modeled ib400 link, and reports the
medians over steps and ranks of the comm hidden share in total and by another ubatch. If the
shared expert is the cause, the serial share falls to about 0 without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import publish_results, results_preamble  # noqa: E402

from asyncdbo.cli.demo import DemoConfig, demo_rank  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoSharedExpert(DemoConfig):
    """The demo's model without its shared expert (everything else equal)."""

    def model_config(self) -> Any:
        return dataclasses.replace(super().model_config(), num_shared_experts=0)


def measure(steps: int) -> list[tuple[str, str, str, float, float, str]]:
    import _progress

    from asyncdbo.testing import run_ranks

    rows = []
    for link in (None, "ib400"):
        for cls, model in ((DemoConfig, "with shared expert"), (NoSharedExpert, "without")):
            _progress.step(f"{link or 'loopback gloo'}, {model}")
            per_rank = run_ranks(demo_rank, 2, cls(steps=steps, link=link))
            for mode in ("serial", "dbo"):
                total = statistics.median(e["hidden_share"] for r in per_rank for e in r[mode])
                other = statistics.median(e["hidden_by_other_share"] for r in per_rank for e in r[mode])
                steps_split = sum(all(r[mode][i]["reason"] == "microbatched" for r in per_rank) for i in range(steps))
                rows.append((link or "loopback gloo", model, mode, total, other, f"{steps_split} of {steps}"))
    _progress.done()
    return rows


def main() -> None:
    import _progress

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the report to the next free file in this folder")
    _progress.add_quiet_flag(ap)
    args = ap.parse_args()
    _progress.start(args.quiet, "runs of the demo on 2 ranks", 4)
    cmd = "python benchmarks/shared_expert_overlap.py " + " ".join(sys.argv[1:])
    lines, info = results_preamble("Serial comm hidden: the shared expert", cmd.strip())
    lines += [
        "\nThe machine was shared with other jobs; the shares are medians over steps and both ranks.\n",
        "| comm | model | run | comm hidden | by another ubatch | steps microbatched |",
        "|---|---|---|---:|---:|---:|",
    ]
    for link, model, mode, total, other, split in measure(args.steps):
        lines.append(f"| {link} | {model} | {'DBO' if mode == 'dbo' else mode} | {total:.0%} | {other:.0%} | "
                     f"{split if mode == 'dbo' else '- (serial)'} |")
    publish_results("\n".join(lines) + "\n", args.out, "shared_expert_overlap", info)


if __name__ == "__main__":
    main()
