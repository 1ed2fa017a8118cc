"""How close the CLI's memory estimates come to the memory a run really takes.

``asyncdbo demo`` and ``asyncdbo check`` refuse sizes that would not fit before starting anything
(``asyncdbo/cli/demo_memory.py``, ``asyncdbo/cli/check.py``); this runs the same configurations and
compares each estimate with the peak resident memory (``ru_maxrss``) of the process that ran it:
demo ranks in a ``RankPool`` (the largest rank's peak), each ``check`` size in its own process.

    python benchmarks/memory_estimate.py [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import publish_results, results_preamble  # noqa: E402

MIB = 2**20


def _base(rank: int, world: int) -> int:
    import asyncdbo.models
    import asyncdbo.observe
    import asyncdbo.serving  # noqa: F401  (what a demo rank imports)

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _demo_peak(rank: int, world: int, kw: dict) -> int:
    from asyncdbo.cli.demo import DemoConfig, demo_rank

    demo_rank(rank, world, DemoConfig(**kw))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_CHECK = """
import json, resource, sys
import asyncdbo
from asyncdbo.sim.predict import predict
tokens, shape = int(sys.argv[1]), sys.argv[2]
async def go():
    await predict(tokens, shape=shape)
asyncdbo.run(go, loop="asyncio")
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def demo_rows(sizes: dict[str, list[int]], ranks: list[int]) -> tuple[int, list[str]]:
    from asyncdbo.cli.demo import DemoConfig, rank_bytes
    from asyncdbo.cli.inputs import PROCESS_BASE_BYTES
    from asyncdbo.testing import RankPool

    with RankPool(1, timeout_s=600) as pool:
        base = pool.run(_base)[0]
    rows = []
    for shape, tokens_list in sizes.items():
        for world in ranks if shape == "prefill" else ranks[:1]:
            for tokens in tokens_list:
                kw = dict(ranks=world, tokens=tokens, shape=shape, steps=1, warmup=0, hidden=256, layers=2, context=32)
                with RankPool(world, timeout_s=600) as pool:
                    peak = max(pool.run(_demo_peak, kw))
                est = PROCESS_BASE_BYTES + rank_bytes(DemoConfig(**kw))
                rows.append(f"| {shape} | {world} | {tokens} | {peak / MIB:.0f} | {est / MIB:.0f} | {est / peak:.2f} |")
                print(rows[-1], file=sys.stderr, flush=True)
    return base, rows


def check_rows(sizes: dict[str, list[int]]) -> list[str]:
    from asyncdbo.cli.check import check_bytes
    from asyncdbo.sim.predict import ModelShape

    model = ModelShape.of("deepseek-v3")  # what predict() simulates by default
    rows = []
    for shape, tokens_list in sizes.items():
        for tokens in tokens_list:
            done = subprocess.run([sys.executable, "-c", _CHECK, str(tokens), shape], capture_output=True, text=True, check=True)
            peak = int(done.stdout.split()[-1])
            est = check_bytes(model, tokens)  # the same for both shapes: the router's scores
            rows.append(f"| {shape} | {tokens} | {peak / MIB:.0f} | {est / MIB:.0f} | {est / peak:.2f} |")
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one tiny size each (a smoke test)")
    p.add_argument("--out", default=None, help="write the results file into this folder")
    args = p.parse_args(argv)
    if args.quick:
        demo_sizes, ranks, check_sizes = {"prefill": [256]}, [1], {"decode": [16]}
    else:
        demo_sizes = {"prefill": [512, 2048, 4096], "decode": [512, 4096]}
        ranks, check_sizes = [1, 2], {"decode": [256, 1024, 2048], "prefill": [256, 1024, 2048]}
    command = "python benchmarks/memory_estimate.py" + (" --quick" if args.quick else "")
    lines, info = results_preamble("Memory estimates of asyncdbo demo and check against measured peak RSS", command)
    base, demo = demo_rows(demo_sizes, ranks)
    check = check_rows(check_sizes)
    lines += [
        "\nPeak RSS (`ru_maxrss`) of the process that ran each configuration against the CLI's estimate "
        "(the estimate is meant to err high, by a small factor).\n",
        f"\nBase rank process (imports, a gloo group): {base / MIB:.0f} MiB peak RSS.\n",
        "\n## asyncdbo demo (hidden 256, 2 layers, 8 experts top-2, decode with --context 32; the largest rank)\n",
        "\n| shape | ranks | tokens | measured peak MiB | estimate MiB | estimate / measured |\n|---|---:|---:|---:|---:|---:|",
        *demo,
        "\n## asyncdbo check (default ModelShape)\n",
        "\n| shape | tokens | measured peak MiB | estimate MiB | estimate / measured |\n|---|---:|---:|---:|---:|",
        *check,
        "",
    ]
    publish_results("\n".join(lines), args.out, "memory_estimate", info)
    print(json.dumps({"demo_rows": len(demo), "check_rows": len(check)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
