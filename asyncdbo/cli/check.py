"""``asyncdbo check``: predict what DBO gains for the reference MoE model on a modeled device and
link, over a sweep of tokens per rank, without a GPU.

Each row runs the model serially (one ubatch) and as DBO ubatches on the sim backend (see
:mod:`asyncdbo.sim.predict`) and prints the predicted step times, the gain and the share of comm
time hidden under compute. ``--stream-policy both`` prints the role-stream schedule (vLLM) and the
per-ubatch-stream pipeline with explicit events (CANN) side by side; ``--check-races`` also runs
the happens-before checker; ``--trace DIR`` writes one Chrome trace per run (open in Perfetto or
render with ``asyncdbo trace``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..sim.devices import DEVICES
from ..sim.races import SimCheckError
from . import inputs
from .inputs import PROCESS_BASE_BYTES, check_output_dir, human_bytes, largest_fitting

__all__ = ["add_arguments", "check_bytes", "main"]


def check_bytes(model: Any, shape: str, tokens: int) -> float:
    """Estimated peak bytes of one ``check`` row: the sim runs the model for real on this CPU, the
    serial pass over all ``tokens`` at once. Weights (this rank's experts and the shared ones),
    prefill attention (``heads x T x T`` scores three times over, the mask) or decode attention
    (every token's cached keys and values over ``--context``, per layer, and its scores), and
    per-token activations; plus the process and 256 MiB the simulator holds beyond these terms
    (measured: peak RSS over tokens has a 745 MiB intercept where the terms give 489 MiB). Against
    the measured peak RSS: 1.1-1.6x (``benchmarks/results/memory_estimate_cpu-2c_2026-12-01.md``)."""
    f32 = 4
    T, D, L, I, k = tokens, model.hidden, model.layers, model.intermediate, model.top_k
    H, C, F = model.heads, model.context, model.heads * model.head_dim
    experts_here = model.experts // model.ep + model.shared_experts
    weights = L * (4 * D * F + 3 * experts_here * D * I + D * model.experts) * f32
    if shape == "prefill":
        attention = 3 * H * T * T * f32 + T * T
    else:
        attention = (L * 2 * T * C * model.head_dim + 2 * T * H * C) * f32
    activations = T * (8 * D + 3 * F + 4 * k * D + 2 * k * I) * f32
    return float(PROCESS_BASE_BYTES + 256 * 2**20 + weights + attention + activations)


def _tokens(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens must be integers like 16,32,64 (got {text!r})") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"--tokens needs at least one value >= 2 (got {text!r})")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..backends.links import LINKS
    from ..sim.predict import ModelShape

    d = ModelShape()
    p.add_argument("--device", choices=sorted(DEVICES), default="h200", help="modeled accelerator (default h200)")
    p.add_argument("--link", choices=sorted(LINKS), default="ib400", help="modeled EP interconnect (default ib400)")
    p.add_argument("--tokens", type=_tokens, default=[16, 32, 64, 128, 256], help="tokens per rank to sweep, e.g. 32,256")
    p.add_argument("--shape", choices=("decode", "prefill"), default="decode")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--intermediate", type=int, default=d.intermediate, help="expert intermediate size")
    p.add_argument("--experts", type=int, default=d.experts)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--shared-experts", type=int, default=d.shared_experts)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--context", type=int, default=d.context, help="decode: cached tokens per request")
    p.add_argument("--ep", type=int, default=d.ep, help="expert-parallel ranks (modeled)")
    p.add_argument("--ubatches", type=int, default=2)
    p.add_argument("--schedule", choices=("ht", "ll"), default=d.schedule)
    p.add_argument("--stream-policy", choices=("role", "ubatch", "both"), default="role")
    p.add_argument("--check-races", action="store_true", help="also run the happens-before race checker")
    p.add_argument("--trace", metavar="DIR", help="write a Chrome trace per run into DIR")


def main(args: argparse.Namespace) -> int:
    import asyncdbo

    from ..backends.links import link_spec
    from ..sim.devices import device_spec
    from ..sim.predict import ModelShape, Prediction, predict, sim_trace

    try:
        model = ModelShape(
            layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, experts=args.experts,
            top_k=args.top_k, shared_experts=args.shared_experts, heads=args.heads, head_dim=args.head_dim,
            context=args.context, ep=args.ep, schedule=args.schedule,
        )
        _check_inputs(args, model)
    except ValueError as exc:
        print(f"asyncdbo check: {exc}")
        return 2
    policies = ["role", "ubatch"] if args.stream_policy == "both" else [args.stream_policy]
    dev, link = device_spec(args.device), link_spec(args.link)
    print(
        f"asyncdbo check: {dev.name} ({dev.peak_flops / 1e12:g} TFLOP/s, {dev.hbm_Bps / 1e12:g} TB/s) + {link.name} "
        f"({link.latency_s * 1e6:g} us, {link.bandwidth_Bps / 1e9:g} GB/s), {args.shape}, {args.ubatches} ubatches, "
        f"schedule {model.schedule}"
    )
    print(
        f"model: {model.layers} layers, hidden {model.hidden}, {model.experts} experts of {model.intermediate} "
        f"(top-{model.top_k}, {model.shared_experts} shared), {model.heads}x{model.head_dim} attention, EP {model.ep}"
    )
    head = f"{'tokens/rank':>11} {'serial us':>10}"
    for pol in policies:
        head += f" | {pol + ' DBO us':>14} {'gain':>7} {'comm hidden':>11}"
    print(head)
    print("-" * len(head))
    for tokens in args.tokens:
        row = f"{tokens:>11}"
        for i, pol in enumerate(policies):
            try:
                pred: Prediction = asyncdbo.run(
                    _call(predict, tokens, model=model, shape=args.shape, device=dev, link=link,
                          ubatches=args.ubatches, stream_policy=pol, check_races=args.check_races),
                    loop="asyncio",
                )
            except SimCheckError as exc:
                print(f"\n{exc}")
                return 1
            except ValueError as exc:
                print(f"asyncdbo check: {exc}")
                return 2
            if i == 0:
                row += f" {pred.serial_s * 1e6:>10.1f}"
            row += f" | {pred.dbo_s * 1e6:>14.1f} {pred.gain * 100:>+6.1f}% {pred.hidden_comm_share * 100:>10.0f}%"
            if args.trace:
                _write(args.trace, f"sim_{args.shape}_{tokens}_serial.json", sim_trace(pred.serial, label="serial"))
                _write(args.trace, f"sim_{args.shape}_{tokens}_dbo_{pol}.json", sim_trace(pred.dbo, label=f"DBO {pol} streams"))
        print(row)
    print("gain: serial step time / DBO step time - 1 (positive: DBO is faster). See docs/sim.md for the model.")
    return 0


def _check_inputs(args: argparse.Namespace, model: Any) -> None:
    """Flags that would fail only after rows of output (or take the machine's memory): refuse them
    up front with the value and the fix."""
    if args.ubatches < 1:
        raise ValueError(f"--ubatches {args.ubatches}: a step needs at least 1 ubatch (DBO uses 2); use --ubatches 2")
    if args.trace:
        check_output_dir("--trace", args.trace)
    avail = inputs.available_bytes()
    tokens = max(args.tokens)
    if avail is not None and check_bytes(model, args.shape, tokens) > avail:
        best = largest_fitting(lambda t: check_bytes(model, args.shape, t), 2, tokens, avail)
        fix = f"use --tokens up to {best}" if best else "use a smaller model (--hidden, --layers, --context)"
        raise ValueError(
            f"--tokens {tokens} needs about {human_bytes(check_bytes(model, args.shape, tokens))} for the {args.shape} "
            f"step (the sim runs the model on this CPU; estimated before running it), but "
            f"{human_bytes(avail)} is available; {fix}"
        )


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    async def call() -> Any:
        return await fn(*args, **kwargs)

    return call


def _write(folder: str, name: str, trace: dict[str, Any]) -> None:
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        json.dump(trace, f)
