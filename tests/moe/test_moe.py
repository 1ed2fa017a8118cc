"""MoELayer under DP+EP on real gloo ranks: every DBO mode gives the serial forward's output,
the overlap really happens on the host backend, config errors are exact, and a failing rank
makes its peer fail in bounded time.

Numbers: on a CPU the layer runs in deterministic mode by default (expert GEMMs in fixed row
tiles, see asyncdbo.moe.batch_invariant), so every DBO output is ``torch.equal`` to the serial one.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from _moe_ranks import (
    DEEPSEEK_LIKE,
    MIXTRAL_LIKE,
    moe_dbo_vs_serial,
    moe_fused_vs_split,
    moe_layer_error,
    moe_overlap_trace,
    moe_raise_mid_forward,
    moe_stage_events,
    moe_two_ep_groups,
)

import asyncdbo
from asyncdbo.backends import LinkSpec, link_spec
from asyncdbo.dist import choose_dispatch, dispatch_options
from asyncdbo.dist.fused import fused_rows
from asyncdbo.moe import MoEConfig, MoELayer
from asyncdbo.testing import RankError, RankPool

pytestmark = pytest.mark.slow


def _check(results: list[dict[str, Any]], sizes_per_rank: list[list[int]]) -> None:
    for rank, res in enumerate(results):
        assert res["shapes"] == [(n, 32) for n in sizes_per_rank[rank]]
        assert res["finite"]
        assert res["equal"], (rank, res)


CASES = {
    # name: (tokens per rank, ubatch sizes per rank)
    "decode_2ub": ([8, 8], [[4, 4], [4, 4]]),
    "prefill_2ub_uneven": ([256, 256], [[100, 156], [200, 56]]),
    "3ub_with_empty": ([256, 8], [[100, 0, 156], [5, 0, 3]]),
    "rank1_idle": ([8, 0], [[4, 4], [0, 0]]),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["ht", "ll"])
@pytest.mark.parametrize("policy", ["role", "ubatch"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_dbo_equals_serial_mixtral_like(pool: RankPool, case: str, policy: str, schedule: str) -> None:
    tokens, sizes = CASES[case]
    _check(pool.run(moe_dbo_vs_serial, dict(MIXTRAL_LIKE, schedule=schedule), tokens, sizes, policy), sizes)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["ht", "ll"])
@pytest.mark.parametrize("case", ["decode_2ub", "3ub_with_empty"])
def test_dbo_equals_serial_deepseek_like_with_shared_experts(pool: RankPool, case: str, schedule: str) -> None:
    tokens, sizes = CASES[case]
    _check(pool.run(moe_dbo_vs_serial, dict(DEEPSEEK_LIKE, schedule=schedule), tokens, sizes, "role"), sizes)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["ht", "ll"])
def test_dbo_equals_serial_on_a_modeled_ib400_link(pool: RankPool, schedule: str) -> None:
    tokens, sizes = CASES["prefill_2ub_uneven"]
    _check(pool.run(moe_dbo_vs_serial, dict(DEEPSEEK_LIKE, schedule=schedule), tokens, sizes, "role", "ib400"), sizes)


@pytest.mark.timeout(60)
def test_ht_overlaps_ubatch1_with_ubatch0_dispatch(pool: RankPool) -> None:
    # With a 20 ms modeled link every comm completes long after its ubatch parked: ubatch 1 runs
    # while ubatch 0's dispatch is in flight; three yields per ubatch.
    expected = {
        "works": [["counts", "dispatch", "combine"], ["counts", "dispatch", "combine"]],
        "resumed_during_dispatch0": [1],
        "yields": [3, 3],
        "parked": True,
    }
    assert pool.run(moe_overlap_trace, "ht") == [expected, expected]


@pytest.mark.timeout(60)
def test_ll_overlaps_ubatch1_with_ubatch0_dispatch(pool: RankPool) -> None:
    # The low-latency schedule: two yields per ubatch, and the rows go out before the yield, so
    # ubatch 0's dispatch is still in flight when it resumes after ubatch 1's turn (then it parks
    # on the rows): the transfer spans its yield instead of starting after it.
    expected = {
        "works": [["counts", "dispatch", "combine"], ["counts", "dispatch", "combine"]],
        "resumed_during_dispatch0": [0, 1],
        "yields": [2, 2],
        "parked": True,
    }
    assert pool.run(moe_overlap_trace, "ll") == [expected, expected]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("schedule", "stages"),
    [("ht", ["combined", "dispatched", "experts", "routed"]), ("ll", [])],
)
def test_ubatch_streams_order_stages_with_explicit_events(pool: RankPool, schedule: str, stages: list[str]) -> None:
    # one key per (layer, call, ubatch, stage); the layer runs twice per ubatch. The ll schedule
    # has no comm stream to order: its receives are ordered by the handles (and hooks), no keys.
    expected = sorted(("L0", call, ub, stage) for call in (0, 1) for ub in (0, 1) for stage in stages)
    assert pool.run(moe_stage_events, schedule) == [expected, expected]


@pytest.mark.timeout(60)
def test_experts_not_divisible_by_ranks(pool: RankPool) -> None:
    msg = (
        "num_experts (3) is not divisible by the EP size (2); every rank must hold the same number "
        "of experts: change num_experts or the number of ranks"
    )
    assert pool.run(moe_layer_error, dict(hidden_size=8, intermediate_size=4, num_experts=3, top_k=1)) == [msg, msg]


def test_top_k_larger_than_experts() -> None:
    with pytest.raises(ValueError, match=r"^MoEConfig\.top_k \(5\) is larger than num_experts \(4\); a token cannot pick more experts than exist: lower top_k$"):
        MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=5)


def test_unknown_schedule() -> None:
    with pytest.raises(ValueError, match=r"^MoEConfig\.schedule must be 'ht' \(high-throughput\) or 'll' \(low-latency\) \(got 'fast'\)$"):
        MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2, schedule="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(scoring="relu"), r"MoEConfig\.scoring must be 'softmax' or 'sigmoid' \(got 'relu'\)"),
        (dict(n_group=3), r"MoEConfig\.n_group \(3\) must divide num_experts \(4\)"),
        (dict(n_group=2, topk_group=3), r"MoEConfig\.topk_group \(3\) is larger than n_group \(2\)"),
        (dict(hidden_size=0), r"MoEConfig\.hidden_size must be an integer >= 1 \(got 0\)"),
        (dict(num_shared_experts=-1), r"MoEConfig\.num_shared_experts must be an integer >= 0 \(got -1\)"),
    ],
)
def test_other_config_errors(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = dict(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{**base, **kwargs})


@pytest.mark.timeout(90)
def test_a_rank_failing_mid_forward_makes_its_peer_fail_not_hang() -> None:
    # A separate pool with a 10 s collective timeout: rank 1's experts raise after the dispatch
    # (it returns its error as a value); rank 0 is parked in its combine when it hears of it.
    with RankPool(2, timeout_s=10.0, start_timeout_s=180.0) as small:
        with pytest.raises(RankError, match=r"rank\(s\) \[0\] failed during moe_raise_mid_forward") as info:
            small.run(moe_raise_mid_forward, timeout_s=40.0)
    assert info.value.ranks == (0,)
    # Rank 1's failure reaches rank 0 out of band (asyncdbo.dist.recovery's store notice), so rank
    # 0 stops waiting in its combine and names rank 1 and its error, well before gloo's timeout.
    assert re.search(r"StepAborted: step aborted: rank 1 failed it \(RuntimeError: expert shard corrupted on rank 1\)",
                     info.value.details[0]), info.value.details[0]


@pytest.mark.timeout(90)
def test_dp_with_two_disjoint_ep_groups(pool4: RankPool) -> None:
    # 4 ranks, EP groups {0, 1} and {2, 3}: each group builds its own per-ubatch twins.
    results = pool4.run(moe_two_ep_groups, timeout_s=60.0)
    assert [r["ep"] for r in results] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert all(r["equal"] for r in results), results


# -- single process (EP size 1, no torch.distributed): runs on both event loops ---------------------


def _local_layer(schedule: str) -> MoELayer:
    return MoELayer(MoEConfig(**DEEPSEEK_LIKE, schedule=schedule), seed=3)


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["role", "ubatch"])
@pytest.mark.parametrize("schedule", ["ht", "ll"])
async def test_single_rank_dbo_equals_plain_call(schedule: str, policy: str) -> None:
    layer = _local_layer(schedule)
    x_TD = torch.randn(20, 32, generator=torch.Generator().manual_seed(5))
    ref_TD = await layer(x_TD)  # a plain call: every primitive is a no-op
    outs = await asyncdbo.run_ubatches(layer, [(x_TD[:7],), (x_TD[7:7],), (x_TD[7:],)], backend="host", stream_policy=policy)
    assert [tuple(o.shape) for o in outs] == [(7, 32), (0, 32), (13, 32)]
    assert torch.equal(torch.cat(outs), ref_TD)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["ht", "ll"])
async def test_a_run_of_one_ubatch_launches_its_own_receive(schedule: str) -> None:
    # ll registers each receive on the next live ubatch; alone, a ubatch gets its own hook back
    layer = _local_layer(schedule)
    x_TD = torch.randn(6, 32, generator=torch.Generator().manual_seed(8))
    (out_TD,) = await asyncdbo.run_ubatches(layer, [(x_TD,)], backend="host")
    assert torch.equal(out_TD, await layer(x_TD))


@pytest.mark.asyncio
async def test_leading_dims_are_kept() -> None:
    layer = _local_layer("ht")
    x_BSD = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(6))
    out_BSD = await layer(x_BSD)
    assert out_BSD.shape == (2, 5, 32)
    assert torch.equal(out_BSD.reshape(10, 32), await layer(x_BSD.reshape(10, 32)))


def test_every_ep_size_holds_the_same_model() -> None:
    # The shard a rank keeps at EP size 1 covers all experts; its weights are what load_global_weights
    # takes, so reloading them is a no-op on the output.
    layer = _local_layer("ht")
    x_TD = torch.randn(6, 32, generator=torch.Generator().manual_seed(7))
    before_TD = asyncdbo.run(layer, x_TD)
    layer.load_global_weights(
        router_weight_ED=layer.router_ED.clone(),
        w_gate_EFD=layer.gate_LFD.clone(),
        w_up_EFD=layer.up_LFD.clone(),
        w_down_EDF=layer.down_LDF.clone(),
        shared={"gate_proj": layer.shared_gate_SD.clone(), "up_proj": layer.shared_up_SD.clone(),
                "down_proj": layer.shared_down_DS.clone()},
        e_score_correction_bias_E=layer.bias_E.clone(),
    )
    assert torch.equal(asyncdbo.run(layer, x_TD), before_TD)


def test_load_global_weights_names_the_bad_shape() -> None:
    layer = _local_layer("ht")
    with pytest.raises(ValueError, match=r"^w_up_EFD has shape \(8, 16, 31\); this layer expects \(8, 16, 32\)$"):
        layer.load_global_weights(
            router_weight_ED=torch.zeros(8, 32), w_gate_EFD=torch.zeros(8, 16, 32), w_up_EFD=torch.zeros(8, 16, 31),
            w_down_EDF=torch.zeros(8, 32, 16), shared={"gate_proj": torch.zeros(32, 32), "up_proj": torch.zeros(32, 32),
                                                        "down_proj": torch.zeros(32, 32)},
        )
    with pytest.raises(ValueError, match=r"^shared weights are missing but the config has num_shared_experts=2"):
        layer.load_global_weights(
            router_weight_ED=torch.zeros(8, 32), w_gate_EFD=torch.zeros(8, 16, 32), w_up_EFD=torch.zeros(8, 16, 32),
            w_down_EDF=torch.zeros(8, 32, 16), shared=None,
        )


BAD_INPUTS = [
    (torch.zeros(4, 16), ValueError, "expects inputs of shape (tokens, 32) or (..., 32): one row of hidden size 32 per "
                                     "token; got shape (4, 16)"),
    (torch.tensor(1.0), ValueError, "expects inputs of shape (tokens, 32) or (..., 32): one row of hidden size 32 per "
                                    "token; got a 0-dim tensor"),
    (torch.zeros(4, 32, dtype=torch.float64), ValueError,
     "holds torch.float32 weights but got torch.float64 inputs; cast them with x.to(torch.float32) or build the layer "
     "with dtype=torch.float64"),
    (torch.zeros(4, 32, dtype=torch.bfloat16), ValueError,
     "holds torch.float32 weights but got torch.bfloat16 inputs; cast them with x.to(torch.float32) or build the layer "
     "with dtype=torch.bfloat16"),
    (torch.zeros(4, 32, device="meta"), ValueError,
     "holds its weights on cpu but got inputs on meta; move them with x.to('cpu') or the layer with layer.to(...)"),
    ([[0.0] * 32], TypeError, "expects a tensor of shape (..., 32), got list"),
]


@pytest.mark.parametrize(("x", "kind", "message"), BAD_INPUTS,
                         ids=["hidden size", "0-dim", "float64", "bf16", "device", "list"])
def test_bad_inputs_are_refused_naming_the_layer_and_the_fix(x: Any, kind: type, message: str) -> None:
    layer = _local_layer("ll")
    with pytest.raises(kind) as info:
        asyncdbo.run(layer, x)
    assert str(info.value) == f"MoELayer {layer.name!r} {message}"


# ---------------------------------------------------------------- one message per dispatch
FUSED_SIZES = [[5, 3], [0, 7]]  # uneven ubatches, an empty one: the capacity is the largest call (7)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["ht", "ll"])
@pytest.mark.parametrize("policy", ["role", "ubatch"])
def test_fused_dispatch_gives_the_split_numbers_bit_for_bit(pool: RankPool, schedule: str, policy: str) -> None:
    cfg = dict(DEEPSEEK_LIKE, schedule=schedule)
    for r in pool.run(moe_fused_vs_split, cfg, FUSED_SIZES, policy, "fused"):
        assert r["split_equals_serial"] and r["options_equal_split"]
        # per ubatch and layer: one dispatch message (counts inside) and the combine
        assert sorted(r["sent"]) == ["combine"] * 2 + ["dispatch+counts"] * 2


@pytest.mark.timeout(120)
def test_auto_fuses_where_the_link_model_says_one_latency_outweighs_the_padding(pool: RankPool) -> None:
    cfg = dict(MIXTRAL_LIKE, schedule="ll")
    # ib400: 10 us of latency against a few hundred padded bytes at 50 GB/s: fused
    for r in pool.run(moe_fused_vs_split, cfg, FUSED_SIZES, "role", "auto", link_spec("ib400")):
        assert r["options_equal_split"] and sorted(r["sent"]) == ["combine"] * 2 + ["dispatch+counts"] * 2
    # no latency, 1 MB/s: the padding costs more than the counts message: split
    slow = LinkSpec(name="slow", latency_s=0.0, bandwidth_Bps=1e6)
    for r in pool.run(moe_fused_vs_split, cfg, FUSED_SIZES, "role", "auto", slow):
        assert r["options_equal_split"] and sorted(r["sent"]) == ["combine"] * 2 + ["counts"] * 2 + ["dispatch"] * 2


def test_choose_dispatch_compares_one_latency_with_the_padding() -> None:
    # decode-like: 32 tokens, top-2, 4 experts per rank, 2 ranks, hidden 256 float32, ib400 x1000
    link = LinkSpec(name="ib400 x1000", latency_s=10e-3, bandwidth_Bps=50e6)
    c = choose_dispatch(link, max_tokens=32, top_k=2, experts_per_rank=4, ranks=2, hidden=256, itemsize=4)
    padded_rows = 2 * (1 + 64) - 64
    assert c.fused and c.padding_s == pytest.approx(padded_rows * 1024 / 50e6)
    assert c.saved_s == pytest.approx(10e-3 + 2 * 4 * 8 / 50e6)
    # prefill-like: 512 tokens per ubatch: 512 padded rows (10.5 ms) outweigh one latency (10 ms)
    c = choose_dispatch(link, max_tokens=512, top_k=2, experts_per_rank=4, ranks=2, hidden=256, itemsize=4)
    assert not c.fused and c.padding_s > c.saved_s
    assert not choose_dispatch(None, max_tokens=32, top_k=2, experts_per_rank=4, ranks=2, hidden=256, itemsize=4).fused
    # the ht schedule with 2 ubatches splits whatever the link says; with 3 it follows the link model
    ht2 = choose_dispatch(link, max_tokens=32, top_k=2, experts_per_rank=4, ranks=2, hidden=256, itemsize=4,
                          schedule="ht", ubatches=2)
    assert not ht2.fused and ht2.reason.startswith("ht with 2 ubatches: its counts already travel")
    assert choose_dispatch(link, max_tokens=32, top_k=2, experts_per_rank=4, ranks=2, hidden=256, itemsize=4,
                           schedule="ht", ubatches=3).fused
    assert choose_dispatch(link, max_tokens=32, top_k=2, experts_per_rank=4, ranks=2, hidden=256, itemsize=4,
                           schedule="ll", ubatches=2).fused


def test_dispatch_options_refuse_bad_values_and_calls_above_the_bound() -> None:
    with pytest.raises(ValueError, match=r"^dispatch_options: max_tokens must be an integer >= 1 \(got 0\)$"):
        with dispatch_options(0):
            pass
    with pytest.raises(ValueError, match=r"^dispatch_options: unknown mode 'both'; use 'auto', 'fused' or 'split'$"):
        with dispatch_options(8, "both"):  # type: ignore[arg-type]
            pass
    with dispatch_options(8, "fused"):
        with pytest.raises(ValueError, match=r"^MoE layer moe9: a call of 9 tokens inside dispatch_options\(max_tokens=8\); "
                                             r"raise max_tokens to the most tokens any rank's call carries$"):
            fused_rows("moe9", 9, top_k=2, experts_per_rank=4, ranks=2, hidden=32, itemsize=4)
        assert fused_rows("moe9", 8, top_k=2, experts_per_rank=4, ranks=2, hidden=32, itemsize=4) == 16
    assert fused_rows("moe9", 9, top_k=2, experts_per_rank=4, ranks=2, hidden=32, itemsize=4) == 0  # outside: split
