"""Predictions of the sim for the reference MoE model, and ``asyncdbo check`` end to end.

The model is small enough for a CPU (hidden 512) but keeps DeepSeek-V3's routing (64 experts,
top-8, one shared expert, 2 experts per rank at EP 32), so the modeled device sees per-expert
batches and all-to-all sizes of that shape. The published shape to match (docs/sim.md): on H100 +
400 Gb/s InfiniBand DBO loses at small decode batches and gains at large ones (SGLang: -27% at 32
tokens/GPU, +25% at 256); on NVLink it gains nothing (vLLM maintainers).
"""

from __future__ import annotations

import functools
import json
import re

import pytest

import asyncdbo
from asyncdbo.cli.check import main as check_main
from asyncdbo.sim.predict import ModelShape, Prediction, predict, sim_trace

pytestmark = pytest.mark.timeout(120)

MODEL = ModelShape(layers=1, hidden=512, intermediate=256, experts=64, top_k=8, shared_experts=1,
                   heads=4, head_dim=128, context=256, ep=32)


def run_predict(tokens: int, **kw: object) -> Prediction:
    return asyncdbo.run(functools.partial(predict, tokens, model=MODEL, device="h100", **kw), loop="asyncio")


def test_dbo_loses_at_small_decode_batches_and_gains_at_large_ones_over_infiniband() -> None:
    small, large = run_predict(32, link="ib400"), run_predict(512, link="ib400")
    assert small.gain < -0.05, small.gain
    assert large.gain > 0.05, large.gain
    # Small batches lose because each ubatch pays the fixed costs again (weights read twice,
    # twice the kernels, half-empty GEMM tiles), not because comm stays exposed.
    assert small.hidden_comm_share > large.hidden_comm_share
    assert small.dbo.compute_busy_s > small.serial.compute_busy_s
    for p in (small, large):
        assert p.serial.num_ubatches == 1 and p.dbo.num_ubatches == 2
        # serially only the shared expert runs under the combine (the ht schedule's own overlap)
        assert 0.0 < p.serial.hidden_comm_share < p.dbo.hidden_comm_share


def test_dbo_gains_nothing_over_nvlink() -> None:
    p = run_predict(512, link="nvlink")
    assert p.gain < 0.02, p.gain
    assert p.serial.comm_busy_s < 0.25 * p.serial.compute_busy_s  # too little comm to pay for splitting


def test_the_trace_uses_the_tracers_layout() -> None:
    p = run_predict(32, link="ib400")
    trace = sim_trace(p.dbo, rank=3, label="DBO")
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in trace["traceEvents"]} == {3}
    assert {(e["args"]["ub"], e["args"]["kind"]) for e in spans} == {(0, "compute"), (1, "compute"), (0, "comm"), (1, "comm")}
    assert all(e["tid"] - 100 * e["args"]["ub"] in (50, 51, 60, 61) for e in spans)
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(p.dbo_s * 1e6)
    (rank,) = trace["otherData"]["asyncdbo"]["ranks"]
    (step,) = rank["steps"]
    assert step["wall_s"] == p.dbo_s and step["comm_hidden_share"] == p.hidden_comm_share
    json.dumps(trace)


def test_check_prints_the_sweep_for_both_stream_policies(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    import argparse

    from asyncdbo.cli.check import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--device", "h100", "--link", "ib400", "--tokens", "8,16", "--shape", "prefill", "--layers", "2",
        "--hidden", "64", "--intermediate", "64", "--experts", "8", "--top-k", "2", "--heads", "2",
        "--head-dim", "16", "--ep", "4", "--stream-policy", "both", "--check-races", "--trace", str(tmp_path),
    ])
    assert check_main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "asyncdbo check: h100 (989 TFLOP/s, 3.35 TB/s) + ib400 (10 us, 50 GB/s), prefill, 2 ubatches, schedule ht"
    assert out[1] == "model: 2 layers, hidden 64, 8 experts of 64 (top-2, 1 shared), 2x16 attention, EP 4"
    assert re.fullmatch(r"tokens/rank\s+serial us \|\s+role DBO us\s+gain comm hidden \|\s+ubatch DBO us\s+gain comm hidden", out[2])
    row = r"\s+{}\s+[\d.]+ \|\s+[\d.]+\s+[+-][\d.]+%\s+\d+% \|\s+[\d.]+\s+[+-][\d.]+%\s+\d+%"
    assert re.fullmatch(row.format(8), out[4]) and re.fullmatch(row.format(16), out[5]), out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"sim_prefill_{t}_{kind}.json" for t in (16, 8) for kind in ("dbo_role", "dbo_ubatch", "serial")
    ]


def test_check_rejects_a_bad_model(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncdbo.cli import main

    assert main(["check", "--experts", "10", "--ep", "4", "--tokens", "8"]) == 2
    assert capsys.readouterr().out == "asyncdbo check: ModelShape: experts (10) must be divisible by ep (4)\n"
