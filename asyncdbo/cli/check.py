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

__all__ = ["add_arguments", "main"]


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
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
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


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    async def call() -> Any:
        return await fn(*args, **kwargs)

    return call


def _write(folder: str, name: str, trace: dict[str, Any]) -> None:
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        json.dump(trace, f)
