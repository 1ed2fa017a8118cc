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


# ---------------------------------------------------------------- the workload replay of a dense model
def test_a_request_cut_between_ubatches_continues_with_its_first_tokens_as_context() -> None:
    from asyncdbo.sim.dense_workload import cut_requests

    assert cut_requests([(5, 100), (1, 40), (3, 0)], [4, 5]) == [[(4, 100)], [(1, 104), (1, 40), (3, 0)]]
    assert cut_requests([(6, 0)], [2, 2, 2]) == [[(2, 0)], [(2, 2)], [(2, 4)]]
    with pytest.raises(ValueError) as err:
        cut_requests([(3, 0)], [2, 2])
    assert str(err.value) == ("the parts [2, 2] hold 4 tokens, the requests 3: give parts that sum to the requests' "
                              "tokens")


@pytest.mark.parametrize("decode", [False, True])
def test_the_workload_times_of_a_uniform_step_are_the_predictions(decode: bool) -> None:
    """A step of 8 prompts of 512 tokens (or 8 decodes at context 2048), unsplit and cut in two
    halves: per layer, the prediction's serial and DBO step times."""
    from asyncdbo.sim.dense_workload import DenseStepSims

    sims = DenseStepSims(model="llama-3-70b", tp=8, device="h100", link="nvlink")
    r = predict_dense_tp("llama-3-70b", tp=8, device="h100", link="nvlink", requests=8,
                         length=2048 if decode else 512, decode=decode)
    reqs = [(1, 2048)] * 8 if decode else [(512, 0)] * 8
    T = sum(q for q, _ in reqs)
    serial, dbo = sims.timed(reqs, [[T], [T // 2, T // 2]], "")
    layers = DENSE_SHAPES["llama-3-70b"].layers
    assert serial * layers == pytest.approx(r.serial_s, rel=1e-12) and dbo * layers == pytest.approx(r.dbo_s, rel=1e-12)
    assert sims.timed(reqs, [[T], [T // 2, T // 2]], "") == [serial, dbo] and sims.simulations == 1  # cached


def test_auto_starts_a_dense_bucket_from_the_prediction_dbo_where_it_gains_off_where_it_loses() -> None:
    from asyncdbo.serving import OFF, Arm
    from asyncdbo.sim.dense_workload import DenseStepSims, dense_prior
    from asyncdbo.sim.tuning import SIM_AUTO

    prior = dense_prior(DenseStepSims(model="llama-3-70b", tp=8, device="h100", link="nvlink"), SIM_AUTO)
    assert prior("mixed 8192-16383") == Arm(2, SIM_AUTO.splits[0], SIM_AUTO.dispatches[0])  # a long prefill gains
    prior = dense_prior(DenseStepSims(model="qwen3-32b", tp=4, device="h100", link="nvlink"), SIM_AUTO)
    assert prior("decode 128-255") == OFF  # weights read twice (test above)
    assert prior("decode 1-1") == OFF  # one token cannot be cut in two


def test_check_replays_a_workload_on_a_dense_model(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncdbo.cli import main

    assert main(["check", "--model", "llama-3-8b", "--tp", "2", "--workload", "synthetic",
                 "--policy", "off,fixed,auto"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("asyncdbo check: llama-3-8b tensor-parallel over 2 ranks on h200 over ib400, each DP rank's "
                      "steps timed by the analytical dense model (not fitted: docs/sim.md)")
    assert out[1] == ("workload: synthetic (seed 0), 16 steps x 4 DP ranks; policies off, fixed, auto; one compute and "
                      "one comm resource per rank (the dense model has no stream policies)")
    assert "starts from the dense model's prediction for the bucket's smallest step" in out[3]
    assert out[4].startswith("throughput, real tokens of all ranks per second of decoder-layer time")
    assert [line.split()[:2] for line in out[5:8]] == [["off", "role"], ["fixed", "role"], ["auto", "role"]]
