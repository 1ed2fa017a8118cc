"""The dense TP prediction (:mod:`asyncdbo.sim.dense_tp`): what its formula must do, not its numbers."""

from __future__ import annotations

import pytest

from asyncdbo.sim.dense_tp import DENSE_SHAPES, _two_ubatches, predict_dense_tp


def test_overlap_with_no_compute_slowdown_is_the_two_resource_bound() -> None:
    # stages of 1 s compute and 1 s all-reduce: after the first stage, compute and comm run side by side
    assert _two_ubatches(1, (1.0, 1.0), 1.0, 0.0) == pytest.approx(5.0)
    # comm far below compute: only the last all-reduce shows
    assert _two_ubatches(2, (1.0, 1.0), 0.01, 0.0) == pytest.approx(8.01)


def test_prefill_gains_more_where_the_all_reduce_weighs_more() -> None:
    gains = [predict_dense_tp("llama-3-70b", tp=tp, link="nvlink", requests=4, length=2048, decode=False)
             for tp in (2, 4, 8)]
    assert [g.comm_share for g in gains] == sorted(g.comm_share for g in gains)
    assert 1.0 < gains[0].gain < gains[1].gain < gains[2].gain
    pcie = predict_dense_tp("llama-3-70b", tp=2, link="pcie5", requests=4, length=2048, decode=False)
    assert pcie.comm_share > gains[0].comm_share and pcie.gain > gains[0].gain


def test_a_decode_step_of_a_dense_model_loses_weights_are_read_twice() -> None:
    r = predict_dense_tp("qwen3-32b", tp=4, link="nvlink", requests=128, length=2048, decode=True)
    assert r.gain < 1.0


def test_bad_sizes_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"^llama-3-8b's 32 heads and 14336 intermediate columns do not divide over "
                                         r"TP 3; use a TP size that divides both$"):
        predict_dense_tp("llama-3-8b", tp=3, requests=4, length=16, decode=False)
    with pytest.raises(ValueError, match=r"requests >= 2"):
        predict_dense_tp("llama-3-8b", tp=2, requests=1, length=16, decode=False)
    assert set(DENSE_SHAPES) == {"llama-3-8b", "llama-3-70b", "qwen3-32b"}


def test_check_predicts_a_dense_model_under_tp(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncdbo.cli import main

    assert main(["check", "--model", "qwen3-32b", "--tp", "4", "--link", "nvlink", "--shape", "prefill",
                 "--tokens", "1024,16384"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("asyncdbo check: qwen3-32b tensor-parallel over 4 ranks on h200 over nvlink, prefill")
    assert len(out) == 4 and out[2].split()[0] == "1024" and out[3].split()[3].endswith("x")
    assert main(["check", "--model", "llama-3-70b", "--tp", "3"]) == 2
    assert "do not divide over TP 3" in capsys.readouterr().err
