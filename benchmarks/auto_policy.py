"""Does ``tuning="auto"`` choose well? auto against DBO off, today's fixed rule and the best fixed
configuration a sweep finds, per link and workload (issue 26, item 4), on the simulated device.

**Simulated times.** Each policy replays the same trace of per-step batch compositions (2 DP
ranks) through :mod:`asyncdbo.sim.workload` and :mod:`asyncdbo.sim.tuning`: the planner for the
fixed rules, the runner's own ``AutoPolicy`` code for auto, every composition simulated once on
the sim (DeepSeek-V3 MoE layers on H200, DeepEP-fitted comm) and shared by every policy. The
numbers are predicted MoE-layer times, not wall clocks: the sim is deterministic, so a replay has
no noise and "side by side" means the same steps and the same simulations for every policy; there
is nothing to interleave or take a median of. Real 2-rank gloo runs are ``auto_measured.py``'s: on
the shared 2-core machine (load 6-15) their step-to-step noise is larger than the 3% this compares
(see ``benchmarks/results/fused_choice_*`` and ``auto_measured_*``), and a sweep of these 145 fixed
configurations over three links and three workloads would take hours there, so that one measures a
small model, short traces and auto's own 13 configurations.

**Links**: ``nvlink`` (EP 8 inside one node: the fast end; the sim has no loopback), ``ib400``
(EP 32 over 400 Gb/s InfiniBand), ``eth100`` (EP 32 over 100 Gb/s Ethernet: the slow one), the
presets of :mod:`asyncdbo.backends.links`.

**Workloads** (``--steps`` steps each, seeded, both ranks alike unless said):

- ``decode-small``: decode batches of 8, 16, 32 or 64 requests per rank (2000 cached tokens).
- ``prefill-heavy``: one prefill chunk of 512, 1024 or 2048 tokens per rank.
- ``mixed-arrivals``: 64 decode requests per rank; with probability 1/4 a new request arrives on
  one rank (alternating) as a 1024-token prefill chunk beside its decodes.

**Policies**: ``off``; ``fixed N=2`` (today's thresholds, 32 decode / 512 prefill, token split);
``best fixed``, the fastest over the whole trace of every fixed configuration (N in 2, 3, 4, token
or balanced split, decode threshold in 0, 16, 32, 64, 128, never, prefill threshold in 0, 1024,
2048, never (0 and 512 split the same steps of these workloads); ``never`` is DBO off for that kind); ``auto`` (search space as
``asyncdbo check --workload``: off, N = 2/3/4 token, N = 2 balanced, 1 warm-up + 3 samples each,
3% margin, split dispatch), and the same with ``AutoConfig(climb=False)`` (every configuration of the
schedule explored, as before climbing). auto is reported over the whole trace (its exploration included) and
over the steps after its bucket stopped exploring (against the best fixed on those same steps).

    python benchmarks/auto_policy.py [--steps 300] [--out benchmarks/results]
    python benchmarks/auto_policy.py --quick    # one link, one short workload, print only
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import publish_results, results_preamble  # noqa: E402

from asyncdbo.plan import ThresholdConfig  # noqa: E402
from asyncdbo.sim.predict import Deployment, ModelShape  # noqa: E402
from asyncdbo.sim.tuning import SIM_AUTO, replay_auto  # noqa: E402
from asyncdbo.sim.workload import StepSims, replay  # noqa: E402

NEVER = 10**9
LINKS = {"nvlink": Deployment(link="nvlink", ep=8), "ib400": Deployment(link="ib400", ep=32),
         "eth100": Deployment(link="eth100", ep=32)}


def decode_small(steps: int, rng: random.Random) -> list:
    out = []
    for _ in range(steps):
        b = rng.choice((8, 16, 32, 64))
        out.append([[(1, 2000)] * b, [(1, 2000)] * b])
    return out


def prefill_heavy(steps: int, rng: random.Random) -> list:
    out = []
    for _ in range(steps):
        c = rng.choice((512, 1024, 2048))
        out.append([[(c, 0)], [(c, 0)]])
    return out


def mixed_arrivals(steps: int, rng: random.Random) -> list:
    out, turn = [], 0
    for _ in range(steps):
        ranks = [[(1, 2000)] * 64, [(1, 2000)] * 64]
        if rng.random() < 0.25:
            ranks[turn].append((1024, 0))
            turn = 1 - turn
        out.append(ranks)
    return out


WORKLOADS = {"decode-small": decode_small, "prefill-heavy": prefill_heavy, "mixed-arrivals": mixed_arrivals}


@dataclass(frozen=True)
class Fixed:
    n: int
    split: str
    decode: int
    prefill: int

    @property
    def label(self) -> str:
        th = lambda v: "never" if v == NEVER else str(v)  # noqa: E731
        return f"N={self.n} {self.split}, thresholds {th(self.decode)}/{th(self.prefill)}"


def _tput(tokens: int, seconds: float) -> float:
    return tokens / seconds / 1e6


def _cell(link: str, name: str, steps: list, sims: StepSims) -> dict:
    fixed_cfgs = [Fixed(n, s, d, p) for n, s in itertools.product((2, 3, 4), ("token", "balanced"))
                  for d in (0, 16, 32, 64, 128, NEVER) for p in (0, 1024, 2048, NEVER)]
    today = Fixed(2, "token", 32, 512)
    fixed_cfgs.append(today)
    # A fixed rule decides each step from that step alone: replay each distinct step once per
    # configuration and weigh it by how often it occurs (auto, which learns, replays every step).
    keys = [repr(step) for step in steps]
    distinct = {k: step for k, step in zip(keys, steps)}
    index = {k: i for i, k in enumerate(distinct)}
    at = [index[k] for k in keys]
    results: dict[Fixed, list[float]] = {}
    for cfg in fixed_cfgs:
        res = replay(list(distinct.values()), model=sims.model, ubatches=cfg.n, policy=cfg.split, sims=sims,
                     thresholds=ThresholdConfig(decode_threshold=cfg.decode, prefill_threshold=cfg.prefill))
        results[cfg] = [res.steps[i].dbo_s for i in at]
    auto = replay_auto(steps, sims=sims, cfg=SIM_AUTO)
    flat = replay_auto(steps, sims=sims, cfg=dataclasses.replace(SIM_AUTO, climb=False))
    tokens = sum(sum(s.tokens) for s in auto.steps)
    serial_s = sum(s.serial_s for s in auto.steps)
    best = min(fixed_cfgs, key=lambda c: (sum(results[c]), fixed_cfgs.index(c)))
    settled = [i for i, (_, _, ev) in enumerate(auto.choices) if ": exploring " not in ev]
    sub_tokens = sum(sum(auto.steps[i].tokens) for i in settled)
    row = {
        "link": link, "workload": name, "steps": len(steps),
        "off": _tput(tokens, serial_s), "today": _tput(tokens, sum(results[today])),
        "best": _tput(tokens, sum(results[best])), "best_label": best.label,
        "auto": _tput(tokens, auto.dbo_s), "exploring": auto.exploring(),
        "flat": _tput(tokens, flat.dbo_s), "flat_exploring": flat.exploring(),
        "choices": "; ".join(f"{b}: {auto.policy.bucket(b).incumbent.label}" for b in auto.buckets() if b != "idle"),
    }
    if settled:
        row["auto_settled"] = _tput(sub_tokens, sum(auto.steps[i].dbo_s for i in settled))
        row["best_settled"] = _tput(sub_tokens, sum(results[best][i] for i in settled))
        row["off_settled"] = _tput(sub_tokens, sum(auto.steps[i].serial_s for i in settled))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per workload (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="ib400, decode-small, 40 steps, print only")
    parser.add_argument("--out", type=Path, default=None, help="write the results file into this folder")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1 (got {args.steps})")
    import torch

    torch.set_num_threads(1)  # as asyncdbo check: the sim's real ops are too small to split
    links = {"ib400": LINKS["ib400"]} if args.quick else LINKS
    workloads = {"decode-small": decode_small} if args.quick else WORKLOADS
    steps_n = 40 if args.quick else args.steps
    lines, info = results_preamble("auto vs off, today's fixed rule and the best fixed configuration (simulated)",
                                   "python benchmarks/auto_policy.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    model = ModelShape.of("deepseek-v3")
    rows, sims_total, t0 = [], 0, time.perf_counter()
    for (link, dep), (name, make) in itertools.product(links.items(), workloads.items()):
        steps = make(steps_n, random.Random(args.seed))
        sims = StepSims(model=model, deployment=dep, check_races=False)
        rows.append(_cell(link, name, steps, sims))
        sims_total += sims.simulations
        print(f"{link} {name}: {sims.simulations} simulations, {time.perf_counter() - t0:.0f} s so far", file=sys.stderr)
    lines.append(f"\nSimulated (asyncdbo.sim; DeepSeek-V3 MoE layers, H200, DeepEP-fitted comm, 2 DP ranks), "
                 f"{steps_n} steps per workload, seed {args.seed}; {sims_total} distinct simulations, "
                 f"{time.perf_counter() - t0:.0f} s. Throughput: real tokens of both ranks per microsecond of "
                 "MoE-layer time (M tokens/s); ratios are auto's throughput over the other's.\n\n")
    lines.append("| link | workload | off | fixed N=2 today | best fixed | auto (all steps) | auto / off | "
                 "auto / best | auto / best after exploring | auto, climb=False / best |\n"
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    for r in rows:
        after = (f"{r['auto_settled'] / r['best_settled']:.3f} ({r['steps'] - r['exploring']} steps)"
                 if "auto_settled" in r else "n/a (never settled)")
        lines.append(f"| {r['link']} | {r['workload']} | {r['off']:.3f} | {r['today']:.3f} | {r['best']:.3f} | "
                     f"{r['auto']:.3f} | {r['auto'] / r['off']:.3f} | {r['auto'] / r['best']:.3f} | {after} | "
                     f"{r['flat'] / r['best']:.3f} ({r['flat_exploring']} exploring) |\n")
    lines.append("\nThe best fixed configuration and auto's final choice per shape bucket:\n\n")
    for r in rows:
        lines.append(f"- {r['link']} {r['workload']}: best fixed {r['best_label']}; auto explored "
                     f"{r['exploring']} of {r['steps']} steps, chose {r['choices']}\n")
    publish_results("".join(lines), None if args.quick else args.out, "auto_policy", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
