"""``asyncdbo check --workload``: replay per-step batch compositions across DP ranks under each
requested policy (``--policy off,fixed,auto``) and stream policy, on the simulated device.

``off`` runs every step unsplit, ``fixed`` through the planner's thresholds (:mod:`asyncdbo.sim.workload`),
``auto`` through the runner's own ``"auto"`` tuning fed with the simulated step times
(:mod:`asyncdbo.sim.tuning`). It prints the thresholds and the search space it used, one throughput
row per policy and stream policy, why the fixed run's steps fell out, what ``auto`` chose per shape
bucket with its evidence, and a warning for every bucket where the fixed thresholds microbatch
below break-even.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .progress import Progress, wants_progress

__all__ = ["parse_policies", "run"]


def parse_policies(values: list[str] | None) -> list[str]:
    """``--policy`` values (repeatable, comma separated) in the order of :data:`POLICIES`;
    default ``fixed`` and ``auto`` (``off`` is every table's baseline anyway)."""
    from ..sim.tuning import POLICIES

    chosen: set[str] = set()
    for value in values or ["fixed,auto"]:
        for name in value.split(","):
            name = name.strip()
            if name not in POLICIES:
                raise ValueError(f"--policy {name!r} is not a policy; use some of {', '.join(POLICIES)} "
                                 "(repeat the flag or separate them with commas)")
            chosen.add(name)
    return [p for p in POLICIES if p in chosen]


def _thresholds(args: argparse.Namespace) -> Any:
    from ..plan import ThresholdConfig

    from ..sim.model import DECODE_QUERIES

    spec = getattr(args, "spec_tokens", 0)
    if not 0 <= spec < DECODE_QUERIES:
        raise ValueError(f"--spec-tokens must be between 0 and {DECODE_QUERIES - 1} (got {spec}): the draft tokens "
                         "each decode request carries (MTP, speculative verify)")
    return ThresholdConfig(decode_threshold=args.decode_threshold, prefill_threshold=args.prefill_threshold,
                           num_spec_tokens=spec)


def run(args: argparse.Namespace, model: Any, dep: Any, header: Any, fail_on: list[str],
        check_rank: Callable[[int], str | None] | None = None, *, dense: Any = None) -> int:
    """The workload mode of ``asyncdbo check`` (``header(args, model, dep, None)`` prints the
    deployment lines; ``check_rank`` refuses a rank the memory cannot simulate as the trace is
    read: ``asyncdbo.cli.check.rank_tokens_check``, handed down by the command). ``dense``: a
    :class:`~asyncdbo.sim.dense_workload.DenseStepSims` that times every step instead of the MoE
    simulation (a dense model under TP: one stream policy, ``auto`` starting from its prediction)."""
    from ..sim.tuning import SIM_AUTO, below_break_even, replay_auto
    from ..sim.workload import StepSims, load_workload, replay, synthetic_workload

    policies = parse_policies(args.policy)
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1 (got {args.repeat}): how many times to replay the trace in a row")
    thresholds = _thresholds(args)
    trace = (synthetic_workload(spec_tokens=thresholds.num_spec_tokens) if args.workload == "synthetic"
             else load_workload(args.workload, check_rank=check_rank))
    steps = list(trace) * args.repeat
    streams = ["role"] if dense is not None else ["role", "ubatch"] if args.stream_policy == "both" else [args.stream_policy]
    layer = "MoE layer" if dense is None else "decoder layer"
    header(args, model, dep, None)
    source = "synthetic (seed 0)" if args.workload == "synthetic" else args.workload
    repeat = f", replayed {args.repeat} times in a row" if args.repeat > 1 else ""
    where = (f"{' and '.join(streams)} streams" if dense is None
             else "one compute and one comm resource per rank (the dense model has no stream policies)")
    print(f"workload: {source}, {len(trace)} steps x {len(trace[0])} DP ranks{repeat}; policies "
          f"{', '.join(policies)}; {where}")
    print(f"thresholds: fixed splits a step into {args.ubatches} ubatches ({args.split_policy} split) when every busy rank "
          f"has >= {thresholds.decode_threshold} tokens of uniform decode"
          f"{f' (1 + {thresholds.num_spec_tokens} tokens per request, --spec-tokens)' if thresholds.num_spec_tokens else ''}"
          f" or >= {thresholds.prefill_threshold} "
          "otherwise (--decode-threshold, --prefill-threshold)"
          + ("; auto starts from them" if dense is None else ""))
    if "auto" in policies:
        cfg = SIM_AUTO
        start = ("the thresholds' choice" if dense is None else
                 "the dense model's prediction for the bucket's smallest step (DBO where it gains, else off; decode at "
                 f"context {args.context or 2048}, --context)")
        print(f"auto: per shape bucket, off or N={'/'.join(map(str, cfg.ubatch_counts))} with the "
              f"{'/'.join(cfg.splits)} split, from the simulated step times (asyncdbo.serving.AutoPolicy, the runner's); "
              f"starts from {start}, {cfg.warmup} warm-up + {cfg.samples} to {cfg.max_samples} samples per "
              f"configuration, each paired with one of the incumbent's, the pairs' median ratio apart from 1 by "
              f"{cfg.margin:.0%} and {cfg.separation:g} standard errors"
              + ("; split dispatch only (the sim does not model fused counts)" if dense is None else ""))
    runs = len(streams) * (("off" in policies or "fixed" in policies) + ("auto" in policies))
    progress = Progress(runs * len(steps), "workload steps (each composition simulated once)",
                        enabled=wants_progress(getattr(args, "quiet", False)))
    rows: list[tuple[str, str, Any]] = []
    fixed: dict[str, Any] = {}
    auto: dict[str, Any] = {}
    simulations = done = 0
    for pol in streams:
        sims = dense if dense is not None else StepSims(model=model, deployment=dep, stream_policy=pol,
                                                         check_races=args.check_races, fail_on=fail_on)

        def on_step(i: int, n: int, what: str, _pol: str = pol) -> None:
            progress.step(done + i, f"{what}, {_pol} streams: step {i} of {n}")

        if "off" in policies or "fixed" in policies:  # off's times are the fixed replay's serial ones
            res = replay(steps, model=model, ubatches=args.ubatches, policy=args.split_policy, thresholds=thresholds,
                         sims=sims, on_step=lambda i, n: on_step(i, n, " and ".join(p for p in ("off", "fixed") if p in policies)))
            done += len(steps)
            rows += [(name, pol, res) for name in ("off", "fixed") if name in policies]
            if "fixed" in policies:
                fixed[pol] = res
        if "auto" in policies:
            prior = None
            if dense is not None:
                from ..sim.dense_workload import dense_prior

                prior = dense_prior(dense, SIM_AUTO, context=args.context or 2048)
            auto[pol] = replay_auto(steps, sims=sims, thresholds=thresholds, cfg=SIM_AUTO,
                                    on_step=lambda i, n: on_step(i, n, "auto"), prior=prior)
            done += len(steps)
            rows.append(("auto", pol, auto[pol]))
        simulations += sims.simulations
    progress.done()
    n = len(steps)
    base = rows[0][2]
    print(f"throughput, real tokens of all ranks per second of {layer.replace(' ', '-')} time "
          f"(off runs every step unsplit: {base.tokens / base.serial_s / 1e6:.2f} M):")
    for name, pol, res in rows:
        label = f"  {name:<5} {pol:<6}"
        if name == "off":
            print(f"{label} {res.tokens / res.serial_s / 1e6:.2f} M  speedup 1.00x  (0 of {n} steps microbatched)")
            continue
        split = [s for s in res.steps if s.microbatched]
        text = f"{label} {res.tokens / res.dbo_s / 1e6:.2f} M  speedup {1 + res.gain:.2f}x  ({len(split)} of {n} steps microbatched"
        if name == "auto":
            text += f", {res.exploring()} while exploring"
        elif split:
            text += f"; on those alone {sum(s.serial_s for s in split) / sum(s.dbo_s for s in split):.2f}x"
        print(text + ")")
    for pol, res in fixed.items():
        where = f" ({pol} streams)" if len(streams) > 1 else ""
        if not res.reasons():
            continue
        print(f"fixed{where}: steps that fell out")
        for reason, count in sorted(res.reasons().items(), key=lambda kv: -kv[1]):
            print(f"  fell out: {reason.value} in {count} step(s)")
        for reason, count in sorted(res.rank_reasons().items(), key=lambda kv: -kv[1]):
            print(f"    a rank voted no: {reason.value} ({count} rank-step(s))")
        example = next((s for s in res.steps if not s.microbatched), None)
        if example is not None:
            print(f"  e.g. tokens by rank {list(example.tokens)}: {example.detail}")
    for pol, res in auto.items():
        where = f" ({pol} streams)" if len(streams) > 1 else ""
        print(f"auto{where}: per shape bucket, the choice and its evidence (us per real token of the largest rank, "
              f"per {layer}; samples)")
        for bucket, (count, exploring) in res.buckets().items():
            if bucket == "idle":
                continue
            last = [evidence for b, _, evidence in res.choices if b == bucket][-1]
            state = (f"still exploring ({exploring} of {count} step(s))" if ": exploring " in last
                     else f"{exploring} of {count} step(s) exploring")
            print(f"  {bucket}: {state}; {res.policy.evidence(bucket)}")
    for pol, res in fixed.items():
        where = f" ({pol} streams)" if len(streams) > 1 else ""
        for low in below_break_even(steps, res, thresholds.num_spec_tokens):
            kind = "decode" if low.bucket.startswith("decode") else "prefill"
            then = ""
            if pol in auto:
                last = [evidence for b, _, evidence in auto[pol].choices if b == low.bucket][-1]
                then = ("; auto was still exploring there (--repeat replays longer)" if ": exploring " in last
                        else f"; auto chose {auto[pol].policy.bucket(low.bucket).incumbent.label} there")
            print(f"warning{where}: the fixed thresholds microbatch {low.bucket} below break-even: {low.speedup:.2f}x of off "
                  f"over {low.steps} step(s) (--{kind}-threshold {getattr(thresholds, kind + '_threshold')}){then}")
    print(f"({simulations} distinct simulations)")
    return 0
