"""``asyncdbo check``: check a model's DBO schedule for ordering bugs and predict what DBO gains on
a modeled deployment, without a GPU.

Each row runs the model serially (one ubatch) and as DBO ubatches on the sim backend (see
:mod:`asyncdbo.sim.predict`): the library's MoE layer with a real architecture's sizes and routing
(``--model``, default DeepSeek-V3 at EP 32). It prints the per-layer step times, the speedup
(serial time / DBO time, asyncdbo's one speed convention) and the share of comm hidden, then the sim's error band (:mod:`asyncdbo.sim.calibration`). The race checker
runs on every run: a race or a dead wait exits 1 with every finding (``--no-check-races`` skips
it); lost overlap is reported, and exits 1 with ``--fail-on lost-overlap``. ``--stream-policy
both`` prints the role-stream schedule (vLLM) and the per-ubatch-stream pipeline (CANN) side by
side; ``--trace DIR`` writes one Chrome trace per run. ``--workload FILE|synthetic`` replays per-step
batch compositions across DP ranks instead, under each ``--policy`` (off, the fixed thresholds,
the runner's ``"auto"`` tuning: :mod:`asyncdbo.cli.check_workload`).
``--paged-kv`` checks the serving path instead: one runner step with the paged KV cache and a
request cut between ubatches, under both stream policies by default (:mod:`asyncdbo.sim.serving`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from ..sim.devices import DEVICES
from . import inputs
from .inputs import PROCESS_BASE_BYTES, check_output_dir, human_bytes, largest_fitting
from .progress import Progress, wants_progress

__all__ = ["add_arguments", "check_bytes", "main", "rank_tokens_check"]

#: Bytes per token per routed expert that a ``check`` row holds at its peak: the router's float32
#: scores and what routing derives from them (weights and activations are meta tensors). Fitted to
#: DeepSeek-V3 (256 experts; ``/usr/bin/time -f %M asyncdbo check --tokens T --shape S``): peak
#: RSS grows about 5.2 KiB per token from 1,024 to 32,768 tokens and 6.9 KiB from 32,768 to 131,072,
#: decode and prefill alike; 7 x 4 B x 256 = 7 KiB keeps the estimate above every measured peak
#: (benchmarks/results/check_memory_cpu-2c_2026-12-03.md).
ROUTED_BYTES = 7 * 4
#: What the simulator holds beyond the process base at any size (measured: 315 MiB peak RSS at
#: 1024 tokens, against 256 MiB of base).
SIM_BASE_BYTES = 64 * 2**20


def check_bytes(model: Any, tokens: int) -> float:
    """Estimated peak bytes of one ``check`` row of ``tokens`` tokens per rank: the process, the
    simulator, and per token the router's scores over every expert (the only tensors that are
    real; the model runs on meta tensors). Errs high, by 3-14% from 1,024 to 131,072 tokens
    (see :data:`ROUTED_BYTES`)."""
    return float(PROCESS_BASE_BYTES + SIM_BASE_BYTES + tokens * model.experts * ROUTED_BYTES)


def _tokens(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens must be integers like 16,32,64 (got {text!r})") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"--tokens needs at least one value >= 2 (got {text!r})")
    return values


_FLAGS = {"true": True, "on": True, "false": False, "off": False, "none": None, "auto": None}


def _moe_option(text: str) -> tuple[str, bool | None]:
    """``--moe NAME=VALUE``: one MoE layer option (``asyncdbo.sim.shapes.MOE_OPTIONS``) for every layer."""
    from ..sim.shapes import MOE_OPTIONS

    name, eq, value = text.partition("=")
    if not eq or name not in MOE_OPTIONS or value.lower() not in _FLAGS:
        raise argparse.ArgumentTypeError(f"--moe takes NAME=VALUE with NAME one of {', '.join(MOE_OPTIONS)} and VALUE "
                                         f"true, false or none (got {text!r})")
    return name, _FLAGS[value.lower()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..backends.links import LINKS
    from ..plan import ThresholdConfig
    from ..sim.comm import COMMS
    from ..sim.host import HOSTS
    from ..sim.dense_tp import DENSE_SHAPES
    from ..sim.models import REAL_CONFIGS

    p.add_argument("--model", choices=sorted(REAL_CONFIGS) + sorted(DENSE_SHAPES), default="deepseek-v3",
                   help="architecture, sized and routed by its published config (default deepseek-v3); the dense "
                        "ones (with --tp) are predicted by asyncdbo.sim.dense_tp")
    p.add_argument("--tp", type=int, default=None, help="dense models: tensor-parallel ranks (default 2)")
    p.add_argument("--device", choices=sorted(DEVICES), default="h200", help="modeled accelerator (default h200)")
    p.add_argument("--link", choices=sorted(LINKS), default="ib400", help="modeled EP interconnect (default ib400)")
    p.add_argument("--comm", choices=sorted(COMMS), default="deepep",
                   help="comm kernels: deepep (fitted to DeepEP's tables) or a2a (plain collectives)")
    p.add_argument("--host", choices=sorted(HOSTS), default=None,
                   help="CPU side: graph (replay) or eager launches; default graph for decode, eager for prefill")
    p.add_argument("--tokens", type=_tokens, default=[16, 32, 64, 128, 256], help="tokens per rank to sweep, e.g. 32,256")
    p.add_argument("--shape", choices=("decode", "prefill"), default="decode")
    p.add_argument("--context", type=int, default=None,
                   help="decode: cached tokens per request (default 2000, at most 2**24); prefill: prompt length (default 4096)")
    p.add_argument("--spec-tokens", type=int, default=0,
                   help="decode: draft tokens per request (MTP, speculative verify): each request decodes 1 + K "
                        "tokens a step, modeled as decode (default 0); with --workload, the planner's uniform decode "
                        "and the synthetic trace's decode requests")
    p.add_argument("--ep", type=int, default=32, help="expert-parallel ranks (modeled; default 32)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks that share a node's NVLink/HCCS (default 8)")
    p.add_argument("--ubatches", type=int, default=2, help="DBO ubatches, 2 to 4 (default 2)")
    p.add_argument("--schedule", choices=("ht", "ll"), default=None,
                   help="MoE schedule; default ll for decode, ht for prefill (as deployments run them)")
    p.add_argument("--stream-policy", choices=("role", "ubatch", "both"), default=None,
                   help="role (vLLM), ubatch (CANN) or both; default role, both with --paged-kv")
    p.add_argument("--imbalance", type=float, default=1.0,
                   help="the busiest EP rank's expert work over this rank's (default 1.0: balanced)")
    p.add_argument("--layers", type=int, default=None, help="MoE layers simulated (default 3; the middle one is timed)")
    p.add_argument("--moe", type=_moe_option, action="append", default=[], metavar="NAME=VALUE",
                   help="a MoE layer option for every layer, repeatable, e.g. yield_after_route=true (a schedule "
                        "step added as a layer option is race-checked so: docs/maintaining.md)")
    for name, help_ in (("hidden", "hidden size"), ("intermediate", "expert intermediate size"), ("experts", "routed experts"),
                        ("top-k", "experts per token"), ("shared-experts", "shared experts"), ("heads", "attention heads")):
        p.add_argument(f"--{name}", type=int, default=None, help=f"override the model's {help_}")
    p.add_argument("--weights", choices=("bf16", "fp8", "int8"), default=None, help="override the weight format")
    p.add_argument("--check-races", action=argparse.BooleanOptionalAction, default=True,
                   help="run the happens-before race checker (default on; --no-check-races to skip)")
    p.add_argument("--fail-on", choices=("lost-overlap",), action="append", default=[],
                   help="fail (exit 1) on lost overlap: the default now, kept for scripts that pass it")
    p.add_argument("--allow-lost-overlap", action="store_true",
                   help="report lost overlap (with its measured cost) without failing")
    p.add_argument("--workload", metavar="FILE|synthetic",
                   help="replay per-step batch compositions across DP ranks (JSON lines; see docs/sim.md)")
    p.add_argument("--split-policy", choices=("token", "request", "balanced"), default="token",
                   help="the planner's split policy for --workload (default token)")
    p.add_argument("--policy", action="append", metavar="off,fixed,auto",
                   help="--workload: the policies to replay, repeatable or comma separated (default fixed,auto): "
                        "off (every step unsplit), fixed (the thresholds), auto (the runner's tuning='auto')")
    p.add_argument("--decode-threshold", type=int, default=ThresholdConfig().decode_threshold,
                   help="--workload: fewest tokens of uniform decode per rank that the fixed thresholds microbatch "
                        "(default %(default)s)")
    p.add_argument("--prefill-threshold", type=int, default=ThresholdConfig().prefill_threshold,
                   help="--workload: the same for mixed and prefill steps (default %(default)s)")
    p.add_argument("--repeat", type=int, default=1,
                   help="--workload: replay the trace this many times in a row (auto keeps what it learned, as a "
                        "runner does over a longer run; default 1)")
    p.add_argument("--paged-kv", action="store_true",
                   help="check the serving path instead: the runner with the paged KV cache and a request cut "
                        "between ubatches (see docs/sim.md)")
    p.add_argument("--layer", metavar="FILE:NAME",
                   help="check your own layer instead: NAME in FILE is an object with 'async def forward(self, x_TD)' "
                        "or a factory taking the EP group that returns one (docs/sim.md, 'Your own layer')")
    p.add_argument("--trace", metavar="DIR", help="write a Chrome trace per run into DIR")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines (they are only written to a terminal anyway)")


def _setup(args: argparse.Namespace) -> tuple[Any, Any]:
    from ..sim.predict import Deployment, ModelShape
    from ..sim.workload import MAX_CACHED_TOKENS

    if not getattr(args, "workload", None):
        from ..plan import ThresholdConfig

        th = ThresholdConfig()
        given = [flag for flag, value, unset in (
            ("--policy", getattr(args, "policy", None), None), ("--repeat", getattr(args, "repeat", 1), 1),
            ("--decode-threshold", getattr(args, "decode_threshold", th.decode_threshold), th.decode_threshold),
            ("--prefill-threshold", getattr(args, "prefill_threshold", th.prefill_threshold),
             th.prefill_threshold)) if value != unset]
        if given:
            raise ValueError(f"{', '.join(given)} apply to --workload only; add --workload FILE|synthetic or drop them")
    if not 2 <= args.ubatches <= 4:
        raise ValueError(f"--ubatches must be 2, 3 or 4 (got {args.ubatches}); 1 is the serial run every row has anyway")
    for flag, value, default in (("--ep", args.ep, 32), ("--gpus-per-node", args.gpus_per_node, 8)):
        if value < 1:
            raise ValueError(f"{flag} must be a number of ranks >= 1 (got {value}); the default is {default}")
    if args.context is not None and args.context < 1:
        raise ValueError(f"--context must be a number of tokens >= 1 (got {args.context}); "
                         "the default is 2000 for decode, 4096 for prefill")
    if args.context is not None and args.shape == "decode" and args.context > MAX_CACHED_TOKENS:
        # the bound of a --workload request's cached tokens: past it torch's size of the sim's (meta)
        # attention tensors overflowed int64 after the table's header (a prefill prompt is cut by --tokens)
        raise ValueError(f"--context is the cached tokens of each decode request, at most {MAX_CACHED_TOKENS} (got "
                         f"{args.context}; 2**24, over 100 times the longest context window of the models the sim "
                         "ships, DeepSeek-V3's 163,840 tokens); the default is 2000")
    if not args.imbalance >= 1:  # also refuses nan
        raise ValueError(f"--imbalance is the busiest rank's expert work over this rank's, >= 1 (got {args.imbalance:g}); "
                         "1 is balanced")
    model = ModelShape.of(args.model).with_overrides(
        layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, experts=args.experts, top_k=args.top_k,
        shared_experts=args.shared_experts, heads=args.heads, weights=args.weights)
    if model.experts % args.ep:
        raise ValueError(f"{model.name}: experts ({model.experts}) must be divisible by ep ({args.ep}); "
                         "change --ep or --experts")
    dep = Deployment(device=args.device, link=args.link, comm=args.comm, host=args.host, ep=args.ep,
                     gpus_per_node=args.gpus_per_node, schedule=args.schedule, imbalance=args.imbalance,
                     moe=dict(getattr(args, "moe", [])))
    if args.trace:
        check_output_dir("--trace", args.trace)
    _check_memory(model, max(args.tokens))
    return model, dep


def _shortfall(model: Any, tokens: int, bound: tuple[int, str] | None,
               lowest: int) -> tuple[str, int | None] | None:
    """None where a row of ``tokens`` fits in ``bound``'s bytes (:func:`~asyncdbo.cli.inputs.usable_bytes`;
    None: unknown, so it is not refused), else what it needs against what the bound leaves (which
    bound: the machine's available memory or a limit of this process), and the most tokens from
    ``lowest`` up that fit (None: not even ``lowest``)."""
    if bound is None:
        return None
    avail, which = bound
    need = check_bytes(model, tokens)
    if need <= avail:
        return None
    best = largest_fitting(lambda t: check_bytes(model, t), lowest, tokens, avail)
    return (f"needs about {human_bytes(need)} (the sim routes every token on this CPU; estimated before running "
            f"it), but {human_bytes(avail)} {which}"), best


def rank_tokens_check(model: Any) -> Callable[[int], str | None]:
    """What ``--workload`` asks of each rank's step as it reads the file
    (:func:`~asyncdbo.sim.workload.load_workload`'s ``check_rank``): a rank of more tokens than the
    machine's available memory (or this process's memory limit, where one is set and smaller) can
    simulate is refused up front, with the most that fit (a rank of 10**12 tokens used to end in
    an allocation failure inside the sim, as did one that fit the memory but not ``ulimit -v``)."""
    bound = inputs.usable_bytes()

    def check(tokens: int) -> str | None:
        short = _shortfall(model, tokens, bound, 1)
        if short is None:
            return None
        needs, best = short
        fix = (f"give a rank at most {best} new tokens a step (cut a long prefill into chunks), or simulate fewer "
               "experts (--experts)" if best else "simulate fewer experts (--experts)")
        return f"simulating them {needs}; {fix}"

    return check


def _check_memory(model: Any, tokens: int) -> None:
    """Refuse a size whose row would take more than the machine's available memory or this
    process's memory limit, up front (it used to end in an allocation failure or the OOM killer
    after the earlier rows)."""
    short = _shortfall(model, tokens, inputs.usable_bytes(), 2)
    if short is not None:
        needs, best = short
        fix = f"use --tokens up to {best}" if best else "use a model with fewer experts (--experts)"
        raise ValueError(f"--tokens {tokens} {needs}; {fix}")


def main(args: argparse.Namespace) -> int:
    import torch

    from ..sim.calibration import band
    from ..sim.races import SimCheckError

    threads = torch.get_num_threads()
    # One thread: the sim's real ops (routing tables, counts) are too small to split, and torch's
    # second intra-op thread added 10 s of CPU to --workload synthetic's 24 s and, on a loaded
    # machine, made every parallel op wait for both threads to get a core (measured:
    # benchmarks/results/check_workload_cpu-2c_2026-12-01.md).
    torch.set_num_threads(1)
    if args.stream_policy is None:  # the policies a check needs: a skipped KV wait shows only on ubatch streams
        args.stream_policy = "both" if getattr(args, "paged_kv", False) else "role"
    try:
        if args.model in ("llama-3-8b", "llama-3-70b", "qwen3-32b"):
            from .check_dense import main_dense

            return main_dense(args)
        if getattr(args, "paged_kv", False):
            return _paged_kv(args)
        if getattr(args, "layer", None):
            from .check_layer import main_layer

            return main_layer(args, _fail_on(args))
        model, dep = _setup(args)
        code = _workload(args, model, dep) if args.workload else _sweep(args, model, dep)
    except SimCheckError as exc:
        print(f"\n{exc}")
        return 1
    except ValueError as exc:  # an input error: on stderr like argparse's own, so stdout stays the table
        print(f"asyncdbo check: error: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    print(band())
    return code


def _header(args: argparse.Namespace, model: Any, dep: Any, shape: str | None) -> None:
    d = dep.resolved(shape or "decode")
    if shape is None and (dep.host is None or dep.schedule is None):
        run = (f"schedule {dep.schedule or 'll for decode steps, ht for others'}, "
               f"host {dep.host or 'graph for decode steps, eager for others'}")
    else:
        run = f"{d.host.name} host, schedule {d.schedule}"
    print(f"asyncdbo check: {model.describe()}")
    print(f"deployment: {d.device.name} + {d.link.name} ({d.link.latency_s * 1e6:g} us, {d.link.bandwidth_Bps / 1e9:g} GB/s), "
          f"EP {d.ep} ({d.gpus_per_node} per node), {d.comm.name} comm, {run}, "
          f"{args.ubatches} ubatches{', imbalance %g' % d.imbalance if d.imbalance != 1 else ''}"
          f"{''.join(f', moe {k}={v}' for k, v in d.moe)}")
    print(f"checks: {'races, dead waits and lost overlap' if args.check_races else 'none (--no-check-races)'}"
          f"{'; lost overlap is reported, not failed (--allow-lost-overlap)' if _allow(args) else ''}")


def _allow(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "allow_lost_overlap", False))


def _fail_on(args: argparse.Namespace) -> list[str]:
    """Lost overlap fails by default (each finding costed by a counterfactual run)."""
    return [] if _allow(args) else ["lost-overlap"]


def _sweep(args: argparse.Namespace, model: Any, dep: Any) -> int:
    import asyncdbo

    from ..sim.predict import Prediction, predict, sim_trace

    policies = ["role", "ubatch"] if args.stream_policy == "both" else [args.stream_policy]
    progress = Progress(len(args.tokens) * len(policies), "configurations (serial and DBO each)",
                        enabled=wants_progress(getattr(args, "quiet", False)))
    _header(args, model, dep, args.shape)
    head = f"{'tokens/rank':>11} {'serial us':>10}"
    for pol in policies:
        head += f" | {pol + ' DBO us':>14} {'speedup':>7} {'comm hidden':>11}"
    print(f"{args.shape}, per MoE layer in steady state; every DBO run is split into {args.ubatches} ubatches "
          "(--workload applies the planner's thresholds instead):")
    print(head)
    print("-" * len(head))
    lost: dict[str, int] = {}
    slower: list[str] = []
    plain: list[str] = []
    for t_i, tokens in enumerate(args.tokens):
        row = f"{tokens:>11}"
        for i, pol in enumerate(policies):
            progress.step(t_i * len(policies) + i + 1, f"{tokens} tokens/rank, {pol} streams")
            pred: Prediction = asyncdbo.run(
                _call(predict, tokens, model=model, shape=args.shape, context=args.context, deployment=dep,
                      spec_tokens=getattr(args, "spec_tokens", 0),
                      ubatches=args.ubatches, stream_policy=pol, check_races=args.check_races, fail_on=_fail_on(args)),
                loop="asyncio",
            )
            for lo in pred.dbo.lost_overlaps:
                lost.setdefault(str(lo), 0)
                lost[str(lo)] += 1
            if i == 0:
                row += f" {pred.serial_layer_s * 1e6:>10.1f}"
            row += f" | {pred.dbo_layer_s * 1e6:>14.1f} {1 + pred.gain:>6.2f}x {pred.hidden_comm_share * 100:>10.0f}%"
            if pred.plain_gain is not None:
                plain.append(f"{tokens} {pol} {1 + pred.plain_gain:.2f}x")
            if pred.gain < 0 and pred.hidden_comm_share >= 0.5:
                slower.append(slower_note(tokens, pol, pred))
            if args.trace:
                _write(args.trace, f"sim_{args.shape}_{tokens}_serial.json", sim_trace(pred.serial, label="serial"))
                _write(args.trace, f"sim_{args.shape}_{tokens}_dbo_{pol}.json", sim_trace(pred.dbo, label=f"DBO {pol} streams"))
        progress.clear()
        print(row)
    progress.done()
    print("speedup: serial time / DBO time per MoE layer (above 1x: DBO is faster). See docs/sim.md for the model.")
    if slower:
        print("comm hidden: share of DBO's comm time during which some ubatch computed. Hiding comm saves at most "
              "the comm the serial run exposed; where DBO computes more than that saves, it is slower however much "
              "it hides:")
        for line in slower:
            print("  " + line)
    print("over the serial run without DBO's yields and hooks (one stream; the speedup above is over the one-ubatch "
          f"run, which a schedule that loses its own overlap slows): {', '.join(plain)}")
    for text, n in lost.items():
        print(f"\n{'warning' if _allow(args) else 'note'} ({n} run(s)): {text}")
    return 0


def slower_note(tokens: int, policy: str, pred: Any) -> str:
    """Why a DBO run that hides most of its comm is still slower: what its time is made of next
    to the serial run's (the whole simulated runs, whose ratios the per-layer times share)."""
    ser, dbo = pred.serial, pred.dbo
    return (f"{tokens} tokens/rank, {policy} streams, the whole simulated run: serial {ser.makespan_s * 1e6:.1f} us = "
            f"{ser.compute_busy_s * 1e6:.1f} us compute + {ser.exposed_comm_s * 1e6:.1f} us exposed comm "
            f"(+ {max(0.0, ser.makespan_s - ser.compute_busy_s - ser.exposed_comm_s) * 1e6:.1f} us other); DBO "
            f"{dbo.makespan_s * 1e6:.1f} us, its compute {dbo.compute_busy_s * 1e6:.1f} us "
            f"({dbo.compute_busy_s / ser.compute_busy_s if ser.compute_busy_s else 0:.2f}x serial's: every ubatch's "
            f"GEMMs read the same weights, and kernels share the device with comm), {dbo.exposed_comm_s * 1e6:.1f} us "
            "comm still exposed")


def _workload(args: argparse.Namespace, model: Any, dep: Any) -> int:
    from .check_workload import run

    return run(args, model, dep, _header, _fail_on(args), rank_tokens_check(model))


def _paged_kv(args: argparse.Namespace) -> int:
    """``--paged-kv``: one runner step with the paged KV cache and a request cut between ubatches,
    checked under each stream policy (:mod:`asyncdbo.sim.serving`); every finding is printed."""
    from ..sim.races import SimCheckError
    from ..sim.serving import PAGED_KV_STEPS, check_paged_kv, describe_paged_kv

    if args.workload:
        raise ValueError("--paged-kv checks one serving step of its own; drop --workload (or --paged-kv)")
    schedule, host = args.schedule or "ht", args.host or "eager"
    policies = ["role", "ubatch"] if args.stream_policy == "both" else [args.stream_policy]
    print(f"asyncdbo check --paged-kv: {describe_paged_kv(schedule, PAGED_KV_STEPS)}")
    print(f"deployment: {args.device} + {args.link}, {args.comm} comm, {host} host, schedule {schedule}, 2 ubatches")
    print(f"checks: {'races, dead waits and lost overlap' if args.check_races else 'none (--no-check-races)'}"
          f"{'; lost overlap is reported, not failed (--allow-lost-overlap)' if _allow(args) else ''}")
    failed: list[tuple[str, str]] = []
    notes: list[str] = []
    for pol in policies:
        try:
            res = asyncdbo_run(_call(check_paged_kv, stream_policy=pol, schedule=schedule, device=args.device,
                                     link=args.link, comm=args.comm, host=host, check_races=args.check_races,
                                     fail_on=_fail_on(args)))
        except SimCheckError as exc:
            print(f"{pol} streams: {len(exc.findings)} finding(s)")
            failed.append((pol, str(exc)))
            continue
        rep = res.report
        notes += [f"{pol} streams: {lo}" for lo in rep.lost_overlaps]
        cut = " | ".join(map(str, res.ubatch_tokens))
        cont = [i for i, c in enumerate(res.continuation) if c]
        print(f"{pol} streams: cut {cut} (ubatch {', '.join(map(str, cont))} continues a request of the one before); "
              f"no race, no dead wait{'' if rep.lost_overlaps else ', no lost overlap'}; "
              f"step {rep.makespan_s * 1e6:.1f} us on the modeled device")
    for text in notes:
        print(f"\nwarning: {text}")
    for pol, text in failed:
        print(f"\n{pol} streams: {text}")
    return 1 if failed else 0


def asyncdbo_run(fn: Any) -> Any:
    import asyncdbo

    return asyncdbo.run(fn, loop="asyncio")


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    async def call() -> Any:
        return await fn(*args, **kwargs)

    return call


def _write(folder: str, name: str, trace: dict[str, Any]) -> None:
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        json.dump(trace, f)
