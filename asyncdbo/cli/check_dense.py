"""``asyncdbo check --model llama-3-8b|llama-3-70b|qwen3-32b --tp N``: the dense tensor-parallel
prediction (:mod:`asyncdbo.sim.dense_tp`) over ``--tokens``, on ``--device`` and ``--link``; with
``--workload FILE|synthetic``, the workload replay of every policy timed by the same model
(:mod:`asyncdbo.sim.dense_workload`).

A prefill of ``T`` tokens is two requests of ``T / 2`` tokens; a decode step of ``T`` tokens is
``T`` requests at ``--context`` (default 2048).  The model is analytical and not fitted to a dense-TP
measurement: docs/sim.md ("Dense tensor parallelism") gives its comparison points.
"""

from __future__ import annotations

import argparse

__all__ = ["main_dense"]


def main_dense(args: argparse.Namespace) -> int:
    from ..sim.dense_tp import predict_dense_tp

    tp = args.tp or 2
    if getattr(args, "workload", None):
        return _workload(args, tp)
    decode = args.shape == "decode"
    context = args.context or 2048
    rows = []
    for tokens in args.tokens:
        if tokens < 2:
            raise ValueError(f"--tokens {tokens}: a dense TP prediction needs at least 2 tokens (two ubatches)")
        r = predict_dense_tp(args.model, tp=tp, device=args.device, link=args.link,
                             requests=tokens if decode else 2, length=context if decode else tokens // 2,
                             decode=decode)
        rows.append(f"  {tokens:>7}  {r.serial_s * 1e3:>10.3f}  {r.dbo_s * 1e3:>10.3f}  {r.gain:>6.3f}x  {r.comm_share:>6.0%}")
    what = f"decode at context {context}" if decode else "prefill of two requests"
    print(f"asyncdbo check: {args.model} tensor-parallel over {tp} ranks on {args.device} over {args.link}, {what} "
          "(analytical model, not fitted: docs/sim.md)")
    print(f"  {'tokens':>7}  {'serial ms':>10}  {'DBO ms':>10}  {'gain':>7}  {'AR share':>8}")
    print("\n".join(rows))
    return 0


def _workload(args: argparse.Namespace, tp: int) -> int:
    """``--workload`` for a dense model: the replay of ``asyncdbo check --workload`` with each
    rank's step timed by the dense TP model (:mod:`asyncdbo.sim.dense_workload`)."""
    from ..sim.dense_workload import DenseStepSims
    from .check_workload import run

    sims = DenseStepSims(model=args.model, tp=tp, device=args.device, link=args.link)

    def header(*_: object) -> None:
        print(f"asyncdbo check: {args.model} tensor-parallel over {tp} ranks on {args.device} over {args.link}, each "
              "DP rank's steps timed by the analytical dense model (not fitted: docs/sim.md)")

    return run(args, None, None, header, [], dense=sims)
