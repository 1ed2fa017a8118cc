"""What does the ``tuning="auto"`` runner cost beyond the configuration it runs? (issue 26: the
ib400 prefill-heavy cell of ``auto_measured.py`` read 0.966 of the best fixed configuration in a
run where auto ran that configuration in both shape buckets.)

2 gloo ranks, ``MiniModel`` on the host backend over a modeled link (as ``auto_measured.py``: the
preset scaled x ``--link-scale``), one workload's trace. Runners, all built once on the same model:

- ``fixed``: the configuration ``--arm`` on every step (``tuning="fixed"``, thresholds 1/1);
- ``fixed again``: a second runner of the same, the control: what two identical runners differ by;
- ``auto converged``: ``tuning="auto"`` with the default ``AutoConfig``, its policy fed, before the
  run, measurements under which ``--arm`` wins in every shape bucket of the trace, until no bucket
  explores: each step it votes with its measurements, chooses, builds the evidence and observes,
  as after exploring;
- ``auto pinned``: ``tuning="auto"``, ``AutoConfig.pin`` fixing ``--arm`` in every bucket of the trace.

**Interleaved** (``--rounds``): the runners take turns step by step (order rotated every step), so
a load change on the shared machine moves all of them alike. Reported: the group's time (the slower
rank's step) summed over the steps, ``fixed`` over each other runner, with a 95% bootstrap interval
over steps; the plan's CPU time per step on each rank (``time.thread_time`` around the runner's
plan: the DP vote and, under auto, the split mask, choice, evidence and observation); and whether
each auto step ran what ``fixed`` ran: the ubatch sizes, the padded total, the split policy and
every comm work's ubatch, kind and bytes.

**Switching N** (``--switch-rounds``, 0: skip): ``fixed`` and ``auto switching``, auto pinned to
``--arm`` in the trace's bucket of the fewest tokens and to N = 2 token auto in the others (as auto
chose on ib400 prefill-heavy in two runs of ``auto_measured.py`` on 2026-12-02), each running the
whole trace per round (order rotated), as ``auto_measured.py`` runs them. Reported per step shape,
configuration and the configuration of the step before it: the median group step time of both (the
``fixed`` runner ran ``--arm`` on the same steps); and per runner the trace's wall time (first start
to last end over both ranks) against ``auto_measured.py``'s measure, the sum over steps of the
slower rank's step, which also counts a rank's wait in the next step's vote for the other.

    python benchmarks/auto_runner_cost.py --out benchmarks/results      # ~4 min on the shared 2 cores
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import publish_results, results_preamble  # noqa: E402
from auto_measured import LINKS, WORKLOADS, Step, rank_model, spread, step_batch  # noqa: E402

INTERLEAVED = ("fixed", "fixed again", "auto converged", "auto pinned")
SWITCHING = ("fixed", "auto switching")


def buckets_of(trace: list[Step]) -> list[str]:
    """The shape buckets of the trace's steps, as the runner names them (largest rank's tokens;
    decode where every busy rank runs one-token requests only), in order of first appearance."""
    from asyncdbo.serving.measure import shape_bucket

    out: list[str] = []
    for step in trace:
        busy = [(d, p) for d, p in step if d + p]
        name = shape_bucket(max(d + p for d, p in step), bool(busy) and all(p == 0 for _, p in busy))
        if name not in out:
            out.append(name)
    return out


def converge(policy: Any, arms: list[Any], trace: list[Step], arm: Any) -> None:
    """Feed ``policy`` measurements under which ``arm`` costs 1 and every other configuration 1.5
    per token, step after step of ``trace``, until no bucket explores (deterministic: every rank
    ends with the same account)."""
    from asyncdbo.plan import PlanReason, RankVote, decide_from_votes
    from asyncdbo.serving.auto import choose_for_group, splittable_mask

    for i in range(4000):
        step = trace[i % len(trace)]
        votes = [RankVote(r, "yes", PlanReason.MICROBATCHED, d + p, d + p) for r, (d, p) in enumerate(step)]
        masks = tuple(splittable_mask([0, *range(1, d + 1), d + p] if p else list(range(d + 1)), arms, 0.48)
                      for d, p in step)
        uniform = tuple(int(p == 0) for _, p in step)
        bucket, ran, evidence = choose_for_group(policy, arms, decide_from_votes(votes), uniform, masks)
        policy.observe(bucket, ran, 1.0 if ran == arm else 1.5)
        if i >= len(trace) and all(": exploring " not in policy.choose(b)[1] for b in policy.buckets):
            assert all(policy.bucket(b).incumbent == arm for b in policy.buckets), "the fed account chose another"
            return
    raise AssertionError("the policy still explores after 4000 fed steps")


def run_cost(rank: int, world: int, link: str | None, scale: float, trace: list[Step], arm_n: int, rounds: int,
             switch_rounds: int) -> dict[str, Any]:
    import asyncdbo

    return asyncdbo.run(_run_cost, rank, world, link, scale, trace, arm_n, rounds, switch_rounds)


async def _run_cost(rank: int, world: int, link: str | None, scale: float, trace: list[Step], arm_n: int,
                    rounds: int, switch_rounds: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving import Arm, AutoConfig, DBORunner, RunnerConfig

    group, spec, mcfg, model, builder = rank_model(link, scale)
    prompt = torch.randint(0, mcfg.vocab_size, (2048,), generator=torch.Generator().manual_seed(rank)).tolist()
    arm, names = Arm(arm_n), buckets_of(trace)
    smallest = min(names, key=lambda b: int(b.split()[1].split("-")[0]))
    common: dict[str, Any] = {"backend": "host", "link": spec}
    configs = {
        "fixed": RunnerConfig(num_ubatches=arm_n, thresholds=ThresholdConfig(decode_threshold=1, prefill_threshold=1),
                              **common),
        "auto converged": RunnerConfig(tuning="auto", **common),
        "auto pinned": RunnerConfig(tuning="auto", auto=AutoConfig(pin=tuple((b, arm) for b in names)), **common),
        "auto switching": RunnerConfig(tuning="auto", auto=AutoConfig(
            pin=tuple((b, arm if b == smallest else Arm(2)) for b in names)), **common),
    }
    configs["fixed again"] = configs["fixed"]
    runners = {label: DBORunner(model, cfg, dp_group=group) for label, cfg in configs.items()}
    auto = runners["auto converged"].auto
    assert auto is not None
    converge(auto, runners["auto converged"]._arms, trace, arm)
    plan_ns = {label: _time_plan(r) for label, r in runners.items()}

    def batch(step: Step) -> Any:
        return step_batch(builder, prompt, step[rank])

    async def one(label: str, step: Step) -> tuple[Any, ...]:
        b = batch(step)
        before = plan_ns[label][0]
        t0 = time.perf_counter()
        res = await runners[label].step(b)
        t1 = time.perf_counter()
        rec = res.record
        sig = (rec.ubatch_num_tokens_padded, rec.num_tokens_padded, rec.policy,
               tuple(sorted((c.ub, c.what, c.nbytes) for c in res.stats.comm)))
        return t0, t1, plan_ns[label][0] - before, rec.config, ": exploring " in rec.evidence, sig

    for label in runners:  # warm-up: the trace's first two steps, unrecorded
        for step in trace[:2]:
            dist.barrier()
            await one(label, step)
    inter: dict[str, list[tuple[Any, ...]]] = {label: [] for label in INTERLEAVED}
    for r in range(rounds):
        for i, step in enumerate(trace):
            k = (r * len(trace) + i) % len(INTERLEAVED)
            for label in INTERLEAVED[k:] + INTERLEAVED[:k]:
                dist.barrier()
                inter[label].append(await one(label, step))
    switch: dict[str, list[list[tuple[Any, ...]]]] = {label: [] for label in SWITCHING}
    for r in range(switch_rounds):
        for label in SWITCHING[r % 2:] + SWITCHING[:r % 2]:
            dist.barrier()
            switch[label].append([await one(label, step) for step in trace])
    return {"inter": inter, "switch": switch}


def _time_plan(runner: Any) -> list[int]:
    """Thread CPU nanoseconds spent in ``runner``'s plan (the fixed or the auto one), summed into
    the returned one-element list: the benchmark wraps the runner's own method on this instance."""
    total = [0]
    name = "_plan_auto" if runner.auto is not None else "_plan"
    inner = getattr(runner, name)

    def timed(*args: Any) -> Any:
        c0 = time.thread_time_ns()
        try:
            return inner(*args)
        finally:
            total[0] += time.thread_time_ns() - c0

    setattr(runner, name, timed)
    return total


# ------------------------------------------------------------------------------------ parent side
def group_steps(per_rank: list[list[tuple[Any, ...]]]) -> list[float]:
    """Per step, the slower rank's step time."""
    return [max(s[1] - s[0] for s in steps) for steps in zip(*per_rank)]


def summed_ratio(ref: list[float], other: list[float], seed: int = 0) -> tuple[float, float, float]:
    """``sum(ref) / sum(other)`` over paired steps and its 95% bootstrap interval (2000 resamples
    of the steps, seeded)."""
    rng, idx = random.Random(seed), range(len(ref))
    boots = sorted(sum(ref[j] for j in ii) / sum(other[j] for j in ii)
                   for ii in (rng.choices(idx, k=len(ref)) for _ in range(2000)))
    return sum(ref) / sum(other), boots[50], boots[1949]


def interleaved_lines(res: list[dict[str, Any]]) -> list[str]:
    inter = [r["inter"] for r in res]
    steps = {label: group_steps([i[label] for i in inter]) for label in INTERLEAVED}
    lines = ["| runner | steps | group time s | fixed / runner, summed [95%] | plan CPU ms/step rank 0, 1 | "
             "ran what fixed ran |\n", "|---|---:|---:|---:|---:|---:|\n"]
    for label in INTERLEAVED:
        ratio = "1" if label == "fixed" else "{:.4f} [{:.4f}..{:.4f}]".format(*summed_ratio(steps["fixed"], steps[label]))
        cpu = ", ".join(f"{statistics.mean(s[2] for s in i[label]) / 1e6:.3f}" for i in inter)
        same = [sum(a[5] == b[5] for a, b in zip(i["fixed"], i[label])) for i in inter]
        lines.append(f"| {label} | {len(steps[label])} | {sum(steps[label]):.2f} | {ratio} | {cpu} | "
                     f"{min(same)} of {len(steps[label])} |\n")
    return lines


def switching_lines(res: list[dict[str, Any]], trace: list[Step]) -> list[str]:
    sw = [r["switch"] for r in res]
    rounds = len(sw[0]["fixed"])
    if not rounds:
        return []
    lines = ["\n| runner | trace wall s, median [min..max] | sum of slower rank's steps s | sum / wall |\n",
             "|---|---:|---:|---:|\n"]
    for label in SWITCHING:
        wall = [max(x[label][r][-1][1] for x in sw) - min(x[label][r][0][0] for x in sw) for r in range(rounds)]
        total = [sum(group_steps([x[label][r] for x in sw])) for r in range(rounds)]
        lines.append(f"| {label} | {spread(wall)} | "
                     f"{statistics.median(total):.3f} | {statistics.median(t / w for t, w in zip(total, wall)):.4f} |\n")
    lines += ["\n| step tokens | auto switching ran | after a step of | steps | fixed ms (median) | "
              "auto switching ms | fixed / auto switching (median of steps) |\n", "|---:|---|---|---:|---:|---:|---:|\n"]
    groups: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
    for r in range(rounds):
        fixed, auto = group_steps([x["fixed"][r] for x in sw]), group_steps([x["auto switching"][r] for x in sw])
        ran = sw[0]["auto switching"][r]
        for i in range(1, len(trace)):
            key = (max(d + p for d, p in trace[i]), ran[i][3], ran[i - 1][3])
            groups.setdefault(key, []).append((fixed[i], auto[i]))
    for (tokens, cfg, prev), v in sorted(groups.items()):
        lines.append(f"| {tokens} | {cfg} | {prev} | {len(v)} | {statistics.median(f for f, _ in v) * 1e3:.2f} | "
                     f"{statistics.median(a for _, a in v) * 1e3:.2f} | {statistics.median(f / a for f, a in v):.3f} |\n")
    return lines


def measure(pool: Any, args: argparse.Namespace) -> tuple[list[str], list[Step]]:
    trace = WORKLOADS[args.workload](args.steps, random.Random(args.seed))
    res = pool.run(run_cost, LINKS[args.link], args.link_scale, trace, args.arm, args.rounds, args.switch_rounds,
                   timeout_s=args.timeout)
    return interleaved_lines(res) + switching_lines(res, trace), trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", default="ib400", help=f"one of {list(LINKS)} (default ib400)")
    parser.add_argument("--workload", default="prefill-heavy", help=f"one of {list(WORKLOADS)} (default prefill-heavy)")
    parser.add_argument("--arm", type=int, default=3, help="the ubatch count N of the configuration, token split, "
                        "dispatch auto (default 3: ib400 prefill-heavy's best fixed in auto_measured runs 7 and 8)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds of the trace (default 8)")
    parser.add_argument("--switch-rounds", type=int, default=8, help="rounds of the switching comparison (0: none)")
    parser.add_argument("--link-scale", type=float, default=1000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--quick", action="store_true", help="4 steps, 1 round of each, print only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.switch_rounds = 4, 1, 1
    if args.link not in LINKS or args.workload not in WORKLOADS or args.arm not in (2, 3, 4):
        raise SystemExit(f"--link {args.link!r} must be one of {list(LINKS)}, --workload {args.workload!r} one of "
                         f"{list(WORKLOADS)}, --arm {args.arm} one of 2, 3, 4")
    if args.steps < 2 or args.rounds < 1 or args.switch_rounds < 0:
        raise SystemExit(f"--steps ({args.steps}) must be >= 2, --rounds ({args.rounds}) >= 1, "
                         f"--switch-rounds ({args.switch_rounds}) >= 0")
    import os

    from asyncdbo.testing import RankPool

    lines, info = results_preamble("What the auto runner costs beyond the configuration it runs (measured)",
                                   "python benchmarks/auto_runner_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    t0 = time.perf_counter()
    with RankPool(2, timeout_s=args.timeout, start_timeout_s=300.0) as pool:
        table, trace = measure(pool, args)
    lines.append(f"\n2 gloo ranks, MiniModel (2 layers), host backend, {args.link} x{args.link_scale:g}, {args.workload} "
                 f"({args.steps} steps, seed {args.seed}; shape buckets {', '.join(buckets_of(trace))}); configuration "
                 f"N={args.arm} token auto. Interleaved: {args.rounds} rounds of the trace, the runners taking turns "
                 f"step by step; switching: {args.switch_rounds} rounds, whole traces. Group time: the slower rank's "
                 "step.\n\n")
    lines += table
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines.append(f"\nWall time {time.perf_counter() - t0:.0f} s; load average at the end {load}.\n")
    publish_results("".join(lines), None if args.quick else args.out, "auto_runner_cost", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
