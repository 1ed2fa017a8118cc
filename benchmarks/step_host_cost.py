"""The host CPU a ``DBORunner`` step costs around the kernel, by part (issue 46).

A trivial model (each ubatch yields once and returns one logit per token) runs steps of ``R``
one-token requests (64, 256, 1024) at N = 2 on the host backend, one process, no DP group. Per
step, process CPU time (``time.process_time_ns``):

- ``step``: ``DBORunner.step`` end to end;
- ``plan``: the runner's plan (``_plan_any``: thresholds, the cut, the attention metadata and
  its checks);
- ``measure``: the runner's measurement (``host_timing`` and ``_measured``: the timing, the
  record, the ledger);
- ``run_ubatches``: a prepared run of the same two ubatches, the kernel beneath the step;
- ``rest``: step - plan - measure - run_ubatches (padding, slicing, merge, the step's own code).

``--base REV`` builds the package at ``REV`` in a temporary folder from its own sources (``git
archive``, ``setup.py build_ext --inplace``, as ``compare_commits.py`` does) and measures it the
same way in the same rounds: each round runs one worker process per side (order alternating), so
machine noise hits both alike. Reported: medians over rounds with min..max, the ratio of the
medians, and the load average at start and end. ``--json`` prints (and with ``--out`` writes) the
raw per-round numbers as JSON too.

    python benchmarks/step_host_cost.py --base HEAD --rounds 9 --json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PARTS = ("step", "plan", "measure", "run_ubatches", "rest")


# ------------------------------------------------------------------------- worker (one side, one round)
def worker(sizes: list[int], steps: int) -> dict[str, Any]:
    """One round on the ``asyncdbo`` first on ``sys.path``: µs of CPU per step, per part and size."""
    import asyncdbo
    from asyncdbo import dbo_yield, prepare_run
    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving import BatchBuilder, DBORunner, KVCacheConfig, RunnerConfig
    from asyncdbo.serving import runner as runner_mod

    class Trivial:
        max_ubatches = 8

        async def forward(self, ids_T: Any, pos_T: Any, attn: Any) -> Any:
            await dbo_yield()
            return ids_T.float().unsqueeze(1)

    async def main() -> dict[str, Any]:
        await measure(sizes, 20)  # a first pass, discarded: one-time costs (torch's first calls) stay out
        return await measure(sizes, steps)

    async def measure(sizes: list[int], steps: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for R in sizes:
            cache = KVCacheConfig(num_layers=1, num_blocks=R + 8, block_size=16, num_heads=1, head_dim=8)
            batch = BatchBuilder(cache).build([(i, [i % 90 + 1]) for i in range(R)])
            cfg = RunnerConfig(num_ubatches=2, backend="host",
                               thresholds=ThresholdConfig(decode_threshold=1, prefill_threshold=1))
            runner = DBORunner(Trivial(), cfg)
            spent = {"plan": 0, "measure": 0}

            def timed(part: str, fn: Any) -> Any:
                def wrapped(*a: Any, **k: Any) -> Any:
                    c0 = time.process_time_ns()
                    try:
                        return fn(*a, **k)
                    finally:
                        spent[part] += time.process_time_ns() - c0
                return wrapped

            runner._plan_any = timed("plan", runner._plan_any)  # type: ignore[method-assign]
            runner._measured = timed("measure", runner._measured)  # type: ignore[method-assign]
            host_timing = runner_mod.host_timing
            runner_mod.host_timing = timed("measure", host_timing)
            try:
                for _ in range(20):
                    res = await runner.step(batch)
                assert res.plan.microbatched, res.plan.record
                spent.update(plan=0, measure=0)
                c0 = time.process_time_ns()
                for _ in range(steps):
                    await runner.step(batch)
                step_ns = time.process_time_ns() - c0
            finally:
                runner_mod.host_timing = host_timing
            # the kernel beneath: a prepared run of the same ubatches
            plan = res.plan
            args = [(batch.input_ids_T[s.padded_token_slice], batch.positions_T[s.padded_token_slice], meta)
                    for s, meta in zip(plan.slices, plan.attn_metadata)]
            model = Trivial()
            runs = prepare_run(backend="host")
            for _ in range(20):
                await runs.run_ubatches(model.forward, args)
            c0 = time.process_time_ns()
            for _ in range(steps):
                await runs.run_ubatches(model.forward, args)
            run_ns = time.process_time_ns() - c0
            us = {"step": step_ns / steps / 1e3, "plan": spent["plan"] / steps / 1e3,
                  "measure": spent["measure"] / steps / 1e3, "run_ubatches": run_ns / steps / 1e3}
            us["rest"] = us["step"] - us["plan"] - us["measure"] - us["run_ubatches"]
            out[str(R)] = us
        return out

    return asyncdbo.run(main)


# ------------------------------------------------------------------------------------------ parent
def build_base(rev: str, into: Path) -> tuple[str, bool]:
    """The tree at ``rev`` in ``into``, its C extensions built from its own sources."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    made = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=into,
                          capture_output=True, check=False)
    return sha, made.returncode == 0


def run_side(root: Path, sizes: list[int], steps: int) -> dict[str, Any]:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]); "
            "import step_host_cost as s; "
            "print('RESULT', json.dumps(s.worker(json.loads(sys.argv[3]), int(sys.argv[4]))))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code, str(root), str(HERE), json.dumps(sizes), str(steps)],
                          cwd=str(root), capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"worker at {root} failed:\n{done.stderr[-3000:]}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}..{max(xs):.1f}]"


def table(sides: dict[str, list[dict[str, Any]]], sizes: list[int]) -> list[str]:
    names = list(sides)
    head = "| R | part | " + " | ".join(f"{n} µs/step, median [min..max]" for n in names)
    head += " | new / base |" if len(names) == 2 else " |"
    lines = [head + "\n", "|---:|---|" + "---:|" * (len(names) + (len(names) == 2)) + "\n"]
    for R in sizes:
        for part in PARTS:
            vals = {n: [r[str(R)][part] for r in rounds] for n, rounds in sides.items()}
            cells = " | ".join(spread(vals[n]) for n in names)
            ratio = ""
            if len(names) == 2:
                b, w = (statistics.median(vals[n]) for n in names)
                ratio = f" {w / b:.2f} |" if b > 0 else " - |"
            lines.append(f"| {R} | {part} | {cells} |{ratio}\n")
        steps = {n: [r[str(R)]["step"] / r[str(R)]["run_ubatches"] for r in rounds] for n, rounds in sides.items()}
        lines.append(f"| {R} | step / run_ubatches | " + " | ".join(spread(steps[n]) for n in names)
                     + (" |  |" if len(names) == 2 else " |") + "\n")
    return lines


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from _results import publish_results, results_preamble, results_stem

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=None, help="a revision to measure beside the working tree")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300, help="steps per size per round (default 300)")
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--json", action="store_true", help="print (and with --out write) the raw rounds as JSON")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    lines, info = results_preamble("Host cost of a DBORunner step, by part (measured)",
                                   "python benchmarks/step_host_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    roots: dict[str, Path] = {"working tree": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.base is not None:
            sha, built = build_base(args.base, Path(tmp))
            roots = {f"base {sha}" + ("" if built else " (pure Python)"): Path(tmp), "working tree": ROOT}
        sides: dict[str, list[dict[str, Any]]] = {n: [] for n in roots}
        t0 = time.perf_counter()
        for r in range(args.rounds):
            order = list(roots) if r % 2 == 0 else list(reversed(roots))
            for name in order:
                sides[name].append(run_side(roots[name], sizes, args.steps))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines.append(f"\nTrivial model (one yield per ubatch), R one-token requests, N = 2, host backend, one process; "
                 f"{args.steps} steps per size per round, {args.rounds} rounds, one worker process per side per "
                 f"round (order alternating). Process CPU µs per step; medians over rounds [min..max].\n\n")
    lines += table(sides, sizes)
    lines.append(f"\nWall time {time.perf_counter() - t0:.0f} s; load average at the end {load}.\n")
    text = "".join(lines)
    stem = results_stem(args.out, "step_host_cost", info) if args.out is not None else None
    publish_results(text, args.out, "step_host_cost", info)
    if args.json:
        raw = json.dumps({"info": info, "sides": sides, "sizes": sizes, "steps": args.steps}, indent=1)
        print(raw)
        if stem is not None:
            stem.with_suffix(".json").write_text(raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
