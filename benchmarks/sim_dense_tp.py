"""Predicted DBO gain for dense tensor-parallel models (:mod:`asyncdbo.sim.dense_tp`): Llama-3-8B,
Llama-3-70B and Qwen3-32B at TP 2, 4 and 8 on H100 and H200 over NVLink and PCIe 5, a prefill of
4 x 2048 tokens and a decode step of 128 requests at context 2048; then the published points it is
compared with (none of them fitted).  Deterministic, a few ms.

    python benchmarks/sim_dense_tp.py
"""

from __future__ import annotations

import argparse

from asyncdbo.sim.dense_tp import predict_dense_tp

#: (what, model, tp, device, link, requests, length, decode, published gain, published AR share, source)
PUBLISHED = [
    ("vLLM PR 44677 (DBO++), Qwen3-32B TP4 prefill bs 4 x 4096: 1110 ms -> 1047 ms, AR 248 ms; GPU not stated "
     "(H100 NVLink assumed)", "qwen3-32b", 4, "h100", "nvlink", 4, 4096, False, 1110 / 1047, 248 / 1110),
    ("TokenWeave (arXiv 2505.11329), 8xH100 NVLink: 'up to 1.28x' latency over models and workloads (fused "
     "AR-RMSNorm on 2-8 SMs); Llama-3-70B TP8 prefill 4 x 2048 as the nearest case", "llama-3-70b", 8, "h100",
     "nvlink", 4, 2048, False, 1.28, None),
]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    cells = [(d, k) for d in ("h100", "h200") for k in ("nvlink", "pcie5")]
    print("predicted gain = serial / DBO step time (the all-reduces' share of the serial step)\n")
    print("| model | TP | phase | " + " | ".join(f"{d.upper()} {k}" for d, k in cells) + " |")
    print("|---|---|---|" + "---|" * len(cells))
    for model in ("llama-3-8b", "llama-3-70b", "qwen3-32b"):
        for tp in (2, 4, 8):
            for phase, requests, decode in (("prefill 4x2048", 4, False), ("decode 128 @2048", 128, True)):
                row = []
                for device, link in cells:
                    r = predict_dense_tp(model, tp=tp, device=device, link=link, requests=requests, length=2048,
                                         decode=decode)
                    row.append(f"{r.gain:.2f}x ({r.comm_share:.0%})")
                print(f"| {model} | {tp} | {phase} | " + " | ".join(row) + " |")
    print()
    print("| published point | predicted gain | published gain | error | predicted AR share | published AR share |")
    print("|---|---|---|---|---|---|")
    for what, model, tp, device, link, requests, length, decode, gain, share in PUBLISHED:
        r = predict_dense_tp(model, tp=tp, device=device, link=link, requests=requests, length=length, decode=decode)
        pub_share = "-" if share is None else f"{share:.0%}"
        print(f"| {what} | {r.gain:.3f}x | {gain:.3f}x | {r.gain / gain - 1:+.1%} | {r.comm_share:.0%} | {pub_share} |")


if __name__ == "__main__":
    main()
