"""Does ``tuning="auto"`` choose well on real runs? auto against DBO off, today's fixed rule and the
best fixed configuration a sweep finds, measured on 2 gloo ranks (issue 26, item 4).

``auto_policy.py`` answers the same question on the simulated device; here every number is a
wall clock of real ``DBORunner`` steps: 2 gloo DP ranks on 127.0.0.1 (a :class:`RankPool`, no
port), EP over both, ``asyncdbo.models.MiniModel`` (hidden 256, 8 experts, top-2, a shared expert,
2 layers, deterministic mode off), the host backend.

**Links**: ``loopback`` (gloo's own comm, no model), ``ib400 xS`` and ``eth100 xS``: the presets
with latency x S and bandwidth / S (``--link-scale``, default 1000: the CPU computes about 1000x
slower than the GPUs such a link serves, as in ``moe_step.py``), so that a step's comm is long
next to the shared machine's noise.

**Workloads** (``--steps`` steps, seeded; the step *shapes* alternate so every shape bucket gets
its share; decode requests are fresh one-token requests, so attention is cheap and the MoE layer
is the step):

- ``decode-small``: 16 or 48 decode requests per rank (today's threshold, 32, splits only 48);
- ``prefill-heavy``: one prefill chunk of 128 or 512 tokens per rank (threshold 512);
- ``mixed-arrivals``: 32 decode requests per rank; in a quarter of the steps (seeded positions) a
  256-token prefill chunk arrives on one rank (alternating) beside its decodes;
- ``regime-change`` (issue 47; not in the default ``--workloads``): 48 decode requests per rank every
  step (one shape bucket), and the link 5x slower (latency x5, bandwidth /5) from the trace's middle
  step on, under every configuration's runner (``runner.backend.link``), fast again at the next
  round's start: a change each way per round after the first. At least 400 steps a trace, so that
  auto settles and measures its change detection's reference in each half. The sweep runs the first
  ``--sweep-steps`` of each half, so there are two best fixed configurations (``best fixed`` for the
  fast link, ``best fixed after`` for the slow one); a table per change gives the steps from it to
  auto's re-exploration, the steps until auto's choice is within 3% of that regime's best by the
  sweep's times, and that regime's best fixed configuration's time over auto's. Its steps are
  long on the slow link (ib400 x1000: 2 rounds measured in 742 s; eth100 x1000 ran past the
  default ``--timeout`` of 1800 s per pool call at 2 rounds: pass a larger one).

**Configurations**: ``off`` (one batch, ``enabled=False``); ``fixed N=2 today`` (the runner's
defaults: N = 2, token split, ``dispatch="auto"``, thresholds 32 decode / 512 prefill); ``auto``
(``tuning="auto"``, default ``AutoConfig``: one runner over all the rounds, as a server keeps its
policy, so its exploration falls in the first rounds); ``best fixed``: the fastest of auto's own
search space run on every step (``AutoConfig().arms()``: off and N in 2, 3, 4 x token/balanced
split x auto/split dispatch, 13), found by a sweep phase over the trace's first ``--sweep-steps``
steps before the measuring phase. In the measuring phase the four run the whole trace one after
the other in each of ``--rounds`` rounds, the order rotated every round. Before each phase every
configuration runs the trace's first ``--warmup`` steps once, unrecorded.

A trace's time is the sum over its steps of the slower rank's step wall time. Ratios are speed
ratios, ``other time / auto time`` (> 1: auto faster), paired by round, median [min..max] over
rounds. The noise is the spread of off's trace time over the rounds. ``auto after exploring``: the
same ratio over the steps where auto had stopped exploring that step's bucket, against the best
fixed configuration's same steps of the same round, and summed over those rounds. The results file
also keeps auto's choice history: per cell and shape bucket, every auto step in order, the
configuration it ran and why (a warm-up, a pair of a comparison, an extra pair of one not yet
separated, the bucket's choice), so a miss can be read back from it.

    python benchmarks/auto_measured.py --out benchmarks/results     # ~15-25 min on the shared 2 cores
    python benchmarks/auto_measured.py --quick                      # one link, one short workload, print only
    python benchmarks/auto_measured.py --links ib400,eth100 --workloads regime-change --rounds 2 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import publish_results, results_preamble  # noqa: E402

#: ``(decode requests, prefill tokens)`` per rank: one step's shape on each rank.
Step = tuple[tuple[int, int], ...]

LINKS: dict[str, str | None] = {"loopback": None, "ib400": "ib400", "eth100": "eth100"}


def decode_small(steps: int, rng: random.Random) -> list[Step]:
    return [((b, 0), (b, 0)) for b in (rng.choice((16, 48)) for _ in range(steps))]


def prefill_heavy(steps: int, rng: random.Random) -> list[Step]:
    return [((0, c), (0, c)) for c in (rng.choice((128, 512)) for _ in range(steps))]


def mixed_arrivals(steps: int, rng: random.Random) -> list[Step]:
    # A quarter of the steps, drawn without replacement: a short trace drawn step by step with
    # probability 1/4 can have none (24 steps, seed 0 had none).
    arrivals = sorted(rng.sample(range(steps), steps // 4))
    out: list[Step] = [((32, 0), (32, 0))] * steps
    for turn, i in enumerate(arrivals):
        out[i] = ((32, 256), (32, 0)) if turn % 2 == 0 else ((32, 0), (32, 256))
    return out


def regime_change(steps: int, rng: random.Random) -> list[Step]:
    # One shape bucket (48 decode requests per rank, decode 32-63) all along; the link changes
    # under it: 5x slower from the trace's middle step (REGIME_SLOWER), as another job on the same
    # links or a degraded NIC would (issue 47).
    return [((48, 0), (48, 0))] * steps


WORKLOADS = {"decode-small": decode_small, "prefill-heavy": prefill_heavy, "mixed-arrivals": mixed_arrivals,
             "regime-change": regime_change}
#: Workloads whose link gets this many times slower (latency x, bandwidth /) from the trace's middle step on
#: (on every configuration's runner; at the start of the next round it is fast again: a change each way).
REGIME_SLOWER = {"regime-change": 5.0}
#: Their least trace length: a bucket explores (up to 79 steps) and measures its 64-step reference
#: before its change detection watches, in each half.
REGIME_MIN_STEPS = 400


@dataclass(frozen=True)
class Config:
    """One configuration of the comparison: ``kind`` ``off`` | ``today`` | ``auto`` | ``arm``
    (a fixed arm of auto's search space on every step: ``n``, ``split``, ``dispatch``)."""

    label: str
    kind: str
    n: int = 1
    split: str = "token"
    dispatch: str = "auto"


OFF = Config("off", "off")
TODAY = Config("fixed N=2 today", "today")
AUTO = Config("auto", "auto")


def sweep_configs() -> list[Config]:
    """auto's own search space, each configuration on every step (off is one of them)."""
    from asyncdbo.serving import AutoConfig

    return [OFF if a.num_ubatches == 1 else Config(f"fixed {a.label}", "arm", a.num_ubatches, a.split, a.dispatch)
            for a in AutoConfig().arms()]


# ------------------------------------------------------------------------------------ per rank
def run_rounds(rank: int, world: int, link: str | None, scale: float, trace: list[Step], configs: list[Config],
               rounds: int, warmup: int, slow_from: int | None = None, slower: float = 1.0) -> dict[str, Any]:
    """On every rank: ``rounds`` rounds of ``trace`` under each of ``configs`` (order rotated per
    round). Returns this rank's step wall times ``times[label][round][step]`` and, for auto, which
    steps ran while their bucket was still exploring and what auto chose. ``slow_from``: from this
    step of the trace on, the link is ``slower`` times slower (None: never)."""
    import asyncdbo

    return asyncdbo.run(_run_rounds, rank, world, link, scale, trace, configs, rounds, warmup, slow_from, slower)


def scaled_link(link: str | None, scale: float) -> Any:
    """The preset ``link`` with latency x ``scale`` and bandwidth / ``scale`` (None: loopback)."""
    from asyncdbo.backends import link_spec

    if link is None:
        return None
    base = link_spec(link)
    return link_spec(base, latency_s=base.latency_s * scale, bandwidth_Bps=base.bandwidth_Bps / scale)


def rank_model(link: str | None, scale: float) -> tuple[Any, Any, Any, Any, Any]:
    """This rank's part of the set-up: the EP group (WORLD), the link scaled by ``scale`` (None:
    loopback), the MiniModel's config, the model and a batch builder for its KV cache."""
    import torch
    import torch.distributed as dist

    from asyncdbo.models import MiniConfig, MiniModel
    from asyncdbo.serving import BatchBuilder

    torch.set_num_threads(1)
    group = dist.group.WORLD
    spec = scaled_link(link, scale)
    mcfg = MiniConfig(num_kv_blocks=256, deterministic=False)
    model = MiniModel(mcfg, ep_group=group, max_ubatches=4)
    return group, spec, mcfg, model, BatchBuilder(mcfg.kv_cache_config)


def step_batch(builder: Any, prompt: list[int], mine: tuple[int, int]) -> Any:
    """This rank's batch of a step: ``mine`` = (fresh one-token decode requests, prefill tokens)."""
    decodes, prefill = mine
    builder.reset()
    chunks = [(rid, [prompt[rid]]) for rid in range(decodes)]
    if prefill:
        chunks.append((10_000, prompt[:prefill]))
    return builder.build(chunks)


async def _run_rounds(rank: int, world: int, link: str | None, scale: float, trace: list[Step],
                      configs: list[Config], rounds: int, warmup: int, slow_from: int | None = None,
                      slower: float = 1.0) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving import DBORunner, RunnerConfig

    group, spec, mcfg, model, builder = rank_model(link, scale)
    slow_spec = scaled_link(link, scale * slower)
    always = ThresholdConfig(decode_threshold=1, prefill_threshold=1)
    g = torch.Generator().manual_seed(rank)
    prompt = torch.randint(0, mcfg.vocab_size, (2048,), generator=g).tolist()

    def runner_config(c: Config) -> RunnerConfig:
        common: dict[str, Any] = {"backend": "host", "link": spec}
        if c.kind == "off":
            return RunnerConfig(enabled=False, **common)
        if c.kind == "today":
            return RunnerConfig(**common)
        if c.kind == "auto":
            return RunnerConfig(tuning="auto", **common)
        return RunnerConfig(num_ubatches=c.n, policy=c.split, dispatch=c.dispatch, thresholds=always,  # type: ignore[arg-type]
                            **common)

    def new_runner(c: Config) -> Any:
        return DBORunner(model, runner_config(c), dp_group=group)

    def batch(step: Step) -> Any:
        return step_batch(builder, prompt, step[rank])

    async def run_trace(runner: Any, steps: list[Step]) -> tuple[list[float], list[Any]]:
        times, records = [], []
        for i, step in enumerate(steps):
            b = batch(step)
            if slow_from is not None:  # the regime change: the modeled link under the runner's backend
                runner.backend.link = slow_spec if i >= slow_from else spec
            t0 = time.perf_counter()
            res = await runner.step(b)
            times.append(time.perf_counter() - t0)
            records.append(res.record)
            if runner.auto is not None:  # the bucket's choice after the step, and the re-explorations so far
                pol = runner.auto
                bucket = res.record.evidence.partition(": ")[0] if res.record.evidence else None
                auto_steps.append((pol.buckets[bucket].incumbent.label if bucket in pol.buckets else res.record.config,
                                   len(pol.reexplorations)))
        return times, records

    runners = {c.label: new_runner(c) for c in configs}
    auto_steps: list[tuple[str, int]] = []
    for c in configs:  # warm-up: the first steps of the trace, once, unrecorded (auto's on a runner of its own)
        dist.barrier()
        await run_trace(new_runner(c) if c.kind == "auto" else runners[c.label], trace[:warmup])
    auto_steps.clear()
    times: dict[str, list[list[float]]] = {c.label: [] for c in configs}
    auto_exploring: list[list[bool]] = []
    auto_choices: list[str] = []
    auto_history: list[list[tuple[str, str, str]]] = []
    for r in range(rounds):
        k = r % len(configs)
        for c in configs[k:] + configs[:k]:
            dist.barrier()
            ts, recs = await run_trace(runners[c.label], trace)
            if c.kind == "auto":  # one runner over every round, as a server keeps its policy
                auto_exploring.append([": exploring " in rec.evidence for rec in recs])
                auto_history.append([step_why(rec) for rec in recs])
                pol = runners[c.label].auto
                # the choice and its evidence (medians, spreads, samples, verdicts), so a miss can be read back
                auto_choices = [f"{b}: {pol.bucket(b).incumbent.label} ({pol.evidence(b)})" for b in sorted(pol.buckets)
                                if b != "idle"]
            times[c.label].append(ts)
    return {"times": times, "auto_exploring": auto_exploring, "auto_choices": auto_choices, "auto_history": auto_history,
            "auto_steps": auto_steps, "auto_report": runners[AUTO.label].report() if AUTO.label in runners else ""}


def step_why(rec: Any) -> tuple[str, str, str]:
    """``(bucket, configuration, why)`` of one auto step from its record: why is ``warm-up``,
    ``pair`` (a trial's first pairs, either side), ``extra pair`` (a comparison not separated yet),
    ``chosen`` (the bucket's choice, exploring done), ``cannot split`` or ``no vote`` (the DP
    decision did not microbatch, so the policy was not asked)."""
    if not rec.evidence:
        return "(no vote)", rec.config, "no vote"
    bucket, _, rest = rec.evidence.partition(": ")
    if rest.startswith("exploring "):
        phase = rest.split(" (", 1)[1]
        why = "warm-up" if phase.startswith("warm-up") else "extra pair" if phase.startswith("not separated") else "pair"
    elif "cannot split this batch" in rest:
        why = "cannot split"
    else:
        why = "chosen"
    return bucket, rec.config, why


def history_lines(history: list[list[tuple[str, str, str]]]) -> list[str]:
    """Per bucket, the configurations its steps ran in order over the rounds, run-length coded:
    ``off x3 (pair)`` is three consecutive steps of that bucket; the trial and the incumbent of
    a comparison alternate, so a comparison reads ``N=3 token auto (warm-up), N=3 token auto
    (pair), off (pair), ...``; ``|`` marks a new round."""
    per: dict[str, list[str]] = {}
    last: dict[str, list[Any]] = {}
    for rnd, steps in enumerate(history):
        for bucket, config, why in steps:
            runs = per.setdefault(bucket, [])
            cur = last.get(bucket)
            if cur is not None and cur[0] == (config, why) and cur[2] == rnd:
                cur[1] += 1
                runs[-1] = f"{cur[3]}{config} x{cur[1]} ({why})"
                continue
            mark = "| " if cur is not None and cur[2] != rnd else ""
            last[bucket] = [(config, why), 1, rnd, mark]
            runs.append(f"{mark}{config} ({why})")
    return [f"  - {b}: {', '.join(runs)}" for b, runs in sorted(per.items())]


# ------------------------------------------------------------------------------------ parent side
def group_times(per_rank: list[dict[str, Any]], label: str) -> list[list[float]]:
    """``[round][step]``: the slower rank's step time."""
    return [[max(ts) for ts in zip(*rounds)] for rounds in zip(*(r["times"][label] for r in per_rank))]


def spread(xs: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}..{fmt.format(max(xs))}]"


def measure_cell(pool: Any, link: str, workload: str, args: argparse.Namespace,
                 say: Any = lambda s: None, sweep: list[Config] | None = None) -> dict[str, Any]:
    """Sweep (``sweep``: default :func:`sweep_configs`), then the measuring rounds, for one link and
    workload; one table row's numbers (and, for a regime-change workload, :func:`regime_numbers`)."""
    steps = max(args.steps, REGIME_MIN_STEPS) if workload in REGIME_SLOWER else args.steps
    trace = WORKLOADS[workload](steps, random.Random(args.seed))
    warmup = min(args.warmup, len(trace))
    timeout = args.timeout
    sweep = sweep_configs() if sweep is None else sweep
    slower = REGIME_SLOWER.get(workload)
    mid = len(trace) // 2 if slower else None
    t0 = time.perf_counter()
    n_sweep = args.sweep_steps or len(trace)
    if mid is None:
        sweep_trace, sweep_slow = trace[:n_sweep], None
    else:  # both regimes: the first steps of each half, the link slower from the second part on
        n_sweep = min(n_sweep, mid)
        sweep_trace, sweep_slow = trace[:n_sweep] + trace[mid:mid + n_sweep], n_sweep
    res = pool.run(run_rounds, LINKS[link], args.link_scale, sweep_trace, sweep, args.sweep_rounds, warmup,
                   sweep_slow, slower or 1.0, timeout_s=timeout)
    per_phase = [slice(0, sweep_slow), slice(sweep_slow, None)] if sweep_slow else [slice(None)]
    phase_s = [{c.label: statistics.median(sum(ts[ph]) for ts in group_times(res, c.label)) for c in sweep}
               for ph in per_phase]
    sweep_s = phase_s[0] if mid is None else {k: phase_s[0][k] + phase_s[1][k] for k in phase_s[0]}
    bests = [min(sweep, key=lambda c: (ps[c.label], sweep.index(c))) for ps in phase_s]
    best = bests[0]
    say(f"{link} {workload}: swept {len(sweep)} in {time.perf_counter() - t0:.0f} s, best {' then '.join(b.label for b in bests)}")
    best_cfg = Config("best fixed", best.kind, best.n, best.split, best.dispatch)
    configs = [OFF, TODAY, best_cfg, AUTO]
    if mid is not None:
        after = bests[1]
        configs.insert(3, Config("best fixed after", after.kind, after.n, after.split, after.dispatch))
    t1 = time.perf_counter()
    res = pool.run(run_rounds, LINKS[link], args.link_scale, trace, configs, args.rounds, warmup, mid, slower or 1.0,
                   timeout_s=timeout)
    say(f"{link} {workload}: measured in {time.perf_counter() - t1:.0f} s")
    g = {c.label: group_times(res, c.label) for c in configs}
    total = {k: [sum(ts) for ts in v] for k, v in g.items()}
    exploring = res[0]["auto_exploring"]
    assert all(r["auto_exploring"] == exploring for r in res), "the ranks disagree on what auto explored"
    assert all(r["auto_steps"] == res[0]["auto_steps"] for r in res), "the ranks disagree on auto's choices"
    after_r, after_best, after_auto = [], 0.0, 0.0
    for rnd, flags in enumerate(exploring):
        idx = [i for i, f in enumerate(flags) if not f]
        if idx:
            best_s, auto_s = sum(g["best fixed"][rnd][i] for i in idx), sum(g["auto"][rnd][i] for i in idx)
            after_r.append(best_s / auto_s)
            after_best, after_auto = after_best + best_s, after_auto + auto_s
    ratio = lambda a, b: [x / y for x, y in zip(total[a], total[b])]  # noqa: E731
    out = {
        "link": link, "workload": workload, "steps": len(trace), "total": total,
        "sweep": sweep_s, "best_label": " then ".join(b.label for b in bests),
        "auto_vs_off": ratio("off", "auto"), "auto_vs_today": ratio("fixed N=2 today", "auto"),
        "auto_vs_best": ratio("best fixed", "auto"),
        "noise": (max(total["off"]) - min(total["off"])) / statistics.median(total["off"]),
        "after": after_r, "after_sum": after_best / after_auto if after_auto else None,
        "auto_vs_best_sum": sum(total["best fixed"]) / sum(total["auto"]),
        "exploring_steps": [sum(f) for f in exploring], "choices": res[0]["auto_choices"],
        "history": history_lines(res[0]["auto_history"]),
        "wall_s": time.perf_counter() - t0,
    }
    if mid is not None:
        out["regime"] = regime_numbers(g, res[0]["auto_steps"], phase_s, len(trace), mid)
        out["auto_report"] = res[0]["auto_report"]
    return out


def regime_numbers(g: dict[str, list[list[float]]], auto_steps: list[tuple[str, int]], phase_s: list[dict[str, float]],
                   n: int, mid: int) -> list[dict[str, Any]]:
    """Per change (the link 5x slower at step ``mid`` of every round; 5x faster again at step 0 of
    every round but the first): the steps from the change to auto's next re-exploration, the steps
    until auto's choice is, by the sweep's times of that regime, within 3% of its best and stays
    so to the regime's end, and the new regime's best fixed configuration's time over auto's,
    over the whole regime and over its steps from 100 after the change."""
    rows = []
    rounds = len(g["auto"])
    fixed = {"slow": "best fixed after", "fast": "best fixed"}
    for rnd in range(rounds):
        for kind, start, end in (("fast", 0, mid), ("slow", mid, n)):
            if kind == "fast" and rnd == 0:
                continue  # no change before the first round
            ps = phase_s[1] if kind == "slow" else phase_s[0]
            best_s = min(ps.values())
            base = rnd * n
            seq = auto_steps[base + start: base + end]
            again0 = auto_steps[base + start - 1][1] if base + start > 0 else 0
            detect = next((i for i, (_, k) in enumerate(seq) if k > again0), None)
            good = [ps.get("off" if c == "off" else f"fixed {c}", float("inf")) <= best_s * 1.03 for c, _ in seq]
            bad = [i for i, ok in enumerate(good) if not ok]
            within = 0 if not bad else (bad[-1] + 1 if bad[-1] + 1 < len(good) else None)
            bf, au = g[fixed[kind]][rnd][start:end], g["auto"][rnd][start:end]
            rows.append({"round": rnd, "change": f"link 5x {'slower' if kind == 'slow' else 'faster'}",
                         "detect": detect, "within": within, "vs_best": sum(bf) / sum(au),
                         "vs_best_100": sum(bf[100:]) / sum(au[100:]) if len(au) > 100 else None,
                         "final": seq[-1][0] if seq else ""})
    return rows


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"\n2 gloo ranks, MiniModel (hidden 256, 8 experts top-2, 1 shared expert, 2 layers), host backend; links "
        f"scaled x{args.link_scale:g} (latency x, bandwidth /); {args.steps} steps per trace, seed {args.seed}; "
        f"a sweep of 13 configurations over the trace's first {args.sweep_steps or args.steps} steps "
        f"({args.sweep_rounds} round(s)), then {args.rounds} measuring rounds of 4 configurations (order rotated), "
        f"{args.warmup} warm-up steps per configuration before each phase. Trace times: seconds, the sum over "
        "steps of the slower rank's step, median [min..max] over rounds. Ratios: other / auto (> 1: auto "
        "faster), paired by round, median [min..max]. Noise: the spread of off's trace time over the rounds, "
        "(max - min) / median. auto is one runner over all rounds (its exploration falls in the first ones); "
        "'all rounds summed': the best fixed's total time over auto's, exploration included; 'after exploring': "
        "over the steps where auto had stopped exploring that step's bucket, the best fixed's time of the same "
        "steps over auto's, per round that has such steps, and summed over those rounds.\n\n",
        "| link | workload | off s | fixed N=2 today s | best fixed s | auto s | noise | auto vs off | "
        "auto vs today | auto vs best | auto vs best, all rounds summed | auto vs best after exploring | "
        "auto vs best after exploring, summed | "
        "auto exploring steps |\n",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    ]
    for r in rows:
        t = r["total"]
        after = spread(r["after"]) if r["after"] else "n/a"
        lines.append(
            f"| {r['link']} | {r['workload']} | {spread(t['off'], '{:.2f}')} | {spread(t['fixed N=2 today'], '{:.2f}')} | "
            f"{spread(t['best fixed'], '{:.2f}')} | {spread(t['auto'], '{:.2f}')} | {r['noise']:.1%} | "
            f"{spread(r['auto_vs_off'])} | {spread(r['auto_vs_today'])} | {spread(r['auto_vs_best'])} | "
            f"{r['auto_vs_best_sum']:.3f} | {after} | {'n/a' if r['after_sum'] is None else format(r['after_sum'], '.3f')} | "
            f"{sum(r['exploring_steps'])} of {r['steps'] * len(t['auto'])} |\n")
    lines.append("\nThe sweep (median trace seconds per configuration), the best fixed one, and auto's final "
                 "choice per shape bucket:\n\n")
    for r in rows:
        sw = ", ".join(f"{k} {v:.2f}" for k, v in r["sweep"].items())
        lines.append(f"- {r['link']} {r['workload']} ({r['wall_s']:.0f} s): best {r['best_label']}; auto chose "
                     f"{'; '.join(r['choices'])}. Sweep: {sw}\n")
    regimes = [r for r in rows if "regime" in r]
    if regimes:
        lines.append("\nRegime change (issue 47): per change, the steps from it to auto's next re-exploration, the steps "
                     "until auto's choice is within 3% of that regime's best by the sweep's times and stays so to the "
                     "regime's end ('never': not within the regime), and that regime's best fixed configuration's time "
                     "over auto's, over the whole regime and from 100 steps after the change. The link is 5x slower "
                     "from each round's middle step and fast again from the next round's first step.\n\n"
                     "| link | round | change | steps to re-exploration | steps to within 3% | best fixed / auto, "
                     "regime | from step 100 | auto's final choice |\n|---|---:|---|---:|---:|---:|---:|---|\n")
        for r in regimes:
            for x in r["regime"]:
                lines.append(f"| {r['link']} | {x['round'] + 1} | {x['change']} | "
                             f"{'none' if x['detect'] is None else x['detect']} | "
                             f"{'never' if x['within'] is None else x['within']} | {x['vs_best']:.3f} | "
                             f"{'n/a' if x['vs_best_100'] is None else format(x['vs_best_100'], '.3f')} | {x['final']} |\n")
        for r in regimes:
            lines.append(f"\n{r['link']} {r['workload']}: auto's report: {r['auto_report']}\n")
    lines.append("\nauto's choice history per cell and shape bucket (every auto step over the rounds, in order: the "
                 "configuration it ran and why; run-length coded, '|' starts a round):\n\n")
    for r in rows:
        lines.append(f"- {r['link']} {r['workload']}:\n" + "\n".join(r["history"]) + "\n")
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24,
                        help=f"steps per trace (default 24; regime-change: at least {REGIME_MIN_STEPS})")
    parser.add_argument("--rounds", type=int, default=4, help="measuring rounds (default 4)")
    parser.add_argument("--sweep-rounds", type=int, default=1, help="sweep rounds (default 1)")
    parser.add_argument("--sweep-steps", type=int, default=12,
                        help="the sweep runs the trace's first steps only (default 12; 0: all of them)")
    parser.add_argument("--warmup", type=int, default=2, help="unrecorded warm-up steps per configuration (default 2)")
    parser.add_argument("--link-scale", type=float, default=1000.0, help="latency x, bandwidth / (default 1000)")
    parser.add_argument("--links", default=",".join(LINKS), help=f"comma-separated, of {list(LINKS)}")
    parser.add_argument("--workloads", default=",".join(w for w in WORKLOADS if w not in REGIME_SLOWER),
                        help=f"comma-separated, of {list(WORKLOADS)} (default: all but regime-change, which runs "
                             f"{REGIME_MIN_STEPS} steps or more a trace)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per pool call before it fails")
    parser.add_argument("--quick", action="store_true", help="ib400, decode-small, 8 steps, 1 round, print only")
    parser.add_argument("--out", type=Path, default=None, help="write the results file into this folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.links, args.workloads, args.steps, args.rounds, args.sweep_rounds, args.sweep_steps, args.warmup = (
            "ib400", "decode-small", 8, 2, 1, 4, 1)
    links, workloads = args.links.split(","), args.workloads.split(",")
    bad = [x for x in links if x not in LINKS] + [x for x in workloads if x not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown link or workload {bad}; links: {list(LINKS)}, workloads: {list(WORKLOADS)}")
    if args.steps < 1 or args.rounds < 1 or args.sweep_rounds < 1 or args.warmup < 0 or args.link_scale <= 0 \
            or args.sweep_steps < 0:
        raise SystemExit(f"--steps ({args.steps}), --rounds ({args.rounds}) and --sweep-rounds ({args.sweep_rounds}) "
                         f"must be >= 1, --warmup ({args.warmup}) and --sweep-steps ({args.sweep_steps}) >= 0, "
                         f"--link-scale ({args.link_scale}) > 0")
    from asyncdbo.testing import RankPool

    lines, info = results_preamble("auto vs off, today's fixed rule and the best fixed configuration (measured)",
                                   "python benchmarks/auto_measured.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    rows, t0 = [], time.perf_counter()
    say = (lambda s: print(f"[{time.perf_counter() - t0:.0f} s] {s}", file=sys.stderr)) if not args.quick else (
        lambda s: None)
    import os

    with RankPool(2, timeout_s=args.timeout, start_timeout_s=300.0) as pool:
        for link in links:
            for workload in workloads:
                rows.append(measure_cell(pool, link, workload, args, say))
                say(next(ln for ln in render(rows[-1:], args).splitlines() if ln.startswith(f"| {link} ")))
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines.append(render(rows, args))
    lines.append(f"\nWall time {time.perf_counter() - t0:.0f} s; load average at the end {load_end}.\n")
    publish_results("".join(lines), None if args.quick else args.out, "auto_measured", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
