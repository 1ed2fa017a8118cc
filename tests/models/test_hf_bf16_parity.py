"""In bfloat16, asyncdbo's Mixtral, Qwen3-MoE and DeepSeek-V3 give transformers' logits bit for bit.

transformers is the oracle: tiny random models built the way ``from_pretrained(..., dtype=bf16)``
builds them (:func:`~asyncdbo.models.hf.reference.tiny_hf_model` with ``dtype``: what transformers
keeps in float32 stays float32), their eager forward over each request's fed tokens.  asyncdbo's
model on one rank runs a prefill of three uneven requests and two greedy decode steps, serially
and with DBO (a request cut between ubatches); every logits row of both runs must be
``torch.equal`` to transformers'.  Besides the project's tiny configs, four of our own change the
routing (top-1 to top-4, odd expert counts, grouped and ungrouped sigmoid routing, shared experts,
renormalisation on and off, a scaling factor) and the RoPE (linear, llama3, yarn, plain theta,
DeepSeek's interleaved pairs off).  A mixed run (issue 45: prompts of 9, 23 and 4 tokens, then
prefill and decode in one batch) over a KV cache filled with NaN before its first step gives
transformers' bits too, and finite fp32 logits within the fp32 tolerances.  What is rounded where,
and why, is in docs/design.md ("bf16 parity with transformers").
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from _hf_model_ranks import VARIANTS, Variant, prompts_for  # noqa: E402

import asyncdbo  # noqa: E402
from asyncdbo.models.hf import from_hf_model  # noqa: E402
from asyncdbo.models.hf.generate import Generation, greedy_generate  # noqa: E402
from asyncdbo.models.hf.reference import hf_logits, tiny_hf_model  # noqa: E402
from asyncdbo.moe import route  # noqa: E402
from asyncdbo.serving import BatchBuilder, DBORunner  # noqa: E402

#: (architecture, overrides of its tiny config): the project's configs, then our own.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", {}),
    "qwen3-moe": ("qwen3-moe", {}),
    "deepseek-v3": ("deepseek-v3", {}),
    # top-3 of 6 experts, renormalised and rounded to bf16; linear RoPE; every layer sparse
    "qwen3-top3-renorm-linear": ("qwen3-moe", dict(
        num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[],
        rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0})),
    # top-1 of 5 experts: renormalising one weight gives exactly 1; llama3 RoPE, tied embeddings
    "mixtral-top1-llama3-tied": ("mixtral", dict(
        num_local_experts=5, num_experts_per_tok=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # ungrouped sigmoid routing, top-2, no renormalisation, no scaling, two shared experts, no
    # q_lora (q_proj), plain RoPE on consecutive halves (rope_interleave off), no dense layer
    "deepseek-ungrouped-top2-plain-rope": ("deepseek-v3", dict(
        n_routed_experts=6, n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=False,
        routed_scaling_factor=1.0, n_shared_experts=2, q_lora_rank=None, first_k_dense_replace=0,
        rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # 16 experts in 8 groups keeping 3, top-4, yarn with mscale 0.7
    "deepseek-8groups-top4-yarn": ("deepseek-v3", dict(
        n_routed_experts=16, n_group=8, topk_group=3, num_experts_per_tok=4, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                         "original_max_position_embeddings": 512, "mscale": 0.7, "mscale_all_dim": 0.7,
                         "beta_fast": 32, "beta_slow": 1})),
}


async def _serial_and_dbo(hf: Any, v: Variant, prompts: dict[int, list[int]]) -> dict[str, Generation]:
    out = {}
    model = from_hf_model(hf, schedule=v.schedule, max_ubatches=3, block_size=4, num_kv_blocks=64,
                          dtype=torch.bfloat16)
    for mode, net in (("serial", model), ("dbo", model.with_fresh_cache())):
        runner = DBORunner(net, v.runner_config(), dp_group=None)
        (out[mode],) = await greedy_generate([(runner, mode == "dbo")], BatchBuilder(net.kv_cache_config), prompts,
                                             decode_steps=2)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES)
def test_bf16_logits_equal_transformers_bit_for_bit(case: str) -> None:
    name, overrides = CASES[case]
    hf = tiny_hf_model(name, dtype=torch.bfloat16, **overrides)
    prompts = prompts_for(0)
    runs = asyncdbo.run(_serial_and_dbo, hf, VARIANTS[name], prompts)
    assert all(rec.microbatched for rec in runs["dbo"].records)
    for r in prompts:
        fed = runs["serial"].fed[r]
        assert runs["dbo"].fed[r] == fed and len(fed) == len(prompts[r]) + 2
        ref_SV = hf_logits(hf, fed)
        for mode, gen in runs.items():
            assert gen.logits[r].dtype == torch.bfloat16
            assert torch.equal(gen.logits[r].float(), ref_SV), (mode, r, (gen.logits[r].float() - ref_SV).abs().max())


def test_a_model_cast_with_to_bf16_is_not_the_reference() -> None:
    """``model.to(torch.bfloat16)`` also casts the RoPE frequencies (a float32 buffer that
    ``from_pretrained(dtype=bf16)`` keeps) and DeepSeek-V3's float32 router: its logits are not
    transformers' bf16 model's, and asyncdbo matches the latter."""
    ref = tiny_hf_model("mixtral", dtype=torch.bfloat16)
    cast = tiny_hf_model("mixtral").to(torch.bfloat16)
    assert ref.model.rotary_emb.inv_freq.dtype == torch.float32
    assert cast.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    tokens = prompts_for(0)[1]
    assert not torch.equal(hf_logits(ref, tokens), hf_logits(cast, tokens))


@pytest.mark.parametrize("norm", [False, True])
def test_qwen3_router_rounds_the_topk_weights_to_bf16_like_transformers(norm: bool) -> None:
    """Qwen3-MoE's router rounds its top-k weights to the logits' dtype; asyncdbo's route gives its
    ids and weights exactly (the weights as float32 holding bf16 values)."""
    hf = tiny_hf_model("qwen3-moe", dtype=torch.bfloat16, norm_topk_prob=norm)
    gate = hf.model.layers[0].mlp.gate
    cfg = from_hf_model(hf, dtype=torch.bfloat16).layers[0].moe.cfg  # type: ignore[union-attr]
    assert cfg.round_topk_weights and cfg.norm_topk_prob == norm
    x_TD = torch.randn(300, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    _, ref_w_TK, ref_ids_TK = gate(x_TD)
    assert ref_w_TK.dtype == torch.bfloat16
    for deterministic in (False, True):
        w_TK, ids_TK = route(x_TD, gate.weight.detach(), cfg, deterministic=deterministic)
        assert w_TK.dtype == torch.float32
        assert torch.equal(ids_TK, ref_ids_TK) and torch.equal(w_TK, ref_w_TK.float())
    unrounded_TK, _ = route(x_TD, gate.weight.detach(), cfg.__class__(**{**cfg.__dict__, "round_topk_weights": False}))
    assert not torch.equal(unrounded_TK, ref_w_TK.float())  # the rounding is what makes them equal


def test_round_topk_weights_must_be_a_bool() -> None:
    from asyncdbo.moe import MoEConfig

    with pytest.raises(ValueError, match=r"^MoEConfig\.round_topk_weights must be True or False \(got 'yes'\)$"):
        MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2, round_topk_weights="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("norm", [False, True])
def test_moe_from_hf_takes_a_qwen3_block_and_gives_its_bf16_output_bit_for_bit(norm: bool) -> None:
    from asyncdbo.moe.hf import moe_from_hf

    block = tiny_hf_model("qwen3-moe", dtype=torch.bfloat16, norm_topk_prob=norm).model.layers[0].mlp
    layer = moe_from_hf(block)
    assert layer.cfg.round_topk_weights and layer.cfg.norm_topk_prob == norm
    x_BSD = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        ref_BSD = block(x_BSD)
    assert torch.equal(asyncdbo.run(layer.forward, x_BSD), ref_BSD)


#: The mixed run's steps, ``(request, new tokens)`` each. Step 0 is issue 45's prefill: prompts of
#: 9, 23 and 4 tokens, so requests 0 and 2 have their queries padded to 23 rows in the batched
#: attention. Step 1 puts prefill and decode in one batch: decode tokens of requests 0 and 1, a
#: chunked-prefill continuation of request 2 (5 tokens after its 4) and a new prompt of 13 tokens.
#: Step 2 decodes all four.
MIXED_STEPS = [[(0, 9), (1, 23), (2, 4)], [(0, 1), (3, 13), (1, 1), (2, 5)], [(0, 1), (1, 1), (2, 1), (3, 1)]]
#: fp32: max |logits diff| against transformers' forward, and between the serial and the DBO run
#: (test_hf_models.py's HF_TOL and DBO_TOL: GEMMs of other shapes round differently in fp32).
FP32_HF_TOL, FP32_DBO_TOL = 2e-5, 1e-5


async def _mixed_run(model: Any, v: Variant, steps: list[list[tuple[int, list[int]]]],
                     dbo: bool) -> tuple[dict[int, torch.Tensor], list[Any]]:
    """``steps`` on ``model`` with every KV cache slot NaN before the first (only the slots the
    steps write hold numbers after): each request's logits rows, in the order it fed its tokens,
    and the steps' records."""
    for t in (*model.kv_cache.k_cache_LNZHK, *model.kv_cache.v_cache_LNZHK):
        t.fill_(float("nan"))
    runner = DBORunner(model, v.runner_config(), dp_group=None)
    builder = BatchBuilder(model.kv_cache_config)
    rows: dict[int, list[torch.Tensor]] = {}
    records = []
    for chunks in steps:
        res = await runner.step(builder.build(chunks), enabled=dbo)
        records.append(res.record)
        offset = 0
        for r, tokens in chunks:
            rows.setdefault(r, []).append(res.logits_TV[offset: offset + len(tokens)])
            offset += len(tokens)
    return {r: torch.cat(rs) for r, rs in rows.items()}, records


Logits = dict[int, torch.Tensor]  # request -> its rows, [tokens fed, V]


def _mixed_serial_and_dbo(name: str, dtype: torch.dtype,
                          **model_kw: Any) -> tuple[Any, dict[int, list[int]], dict[str, Logits]]:
    """The transformers model, each request's fed tokens and the serial and DBO runs' logits of
    :data:`MIXED_STEPS` (every DBO step microbatched), each run on its own NaN-filled cache."""
    hf = tiny_hf_model(name, dtype=dtype)
    v = VARIANTS[name]
    g = torch.Generator().manual_seed(45)
    steps = [[(r, torch.randint(0, 96, (n,), generator=g).tolist()) for r, n in chunks] for chunks in MIXED_STEPS]
    fed: dict[int, list[int]] = {}
    for chunks in steps:
        for r, tokens in chunks:
            fed.setdefault(r, []).extend(tokens)
    model = from_hf_model(hf, schedule=v.schedule, max_ubatches=3, block_size=4, num_kv_blocks=64, dtype=dtype,
                          **model_kw)
    runs = {mode: asyncdbo.run(_mixed_run, net, v, steps, mode == "dbo")
            for mode, net in (("serial", model), ("dbo", model.with_fresh_cache()))}
    assert all(rec.microbatched for rec in runs["dbo"][1]) and not any(rec.microbatched for rec in runs["serial"][1])
    logits = {mode: rows for mode, (rows, _) in runs.items()}
    for mode, rows in logits.items():
        for r in fed:
            assert rows[r].dtype == dtype and rows[r].shape == (len(fed[r]), hf.config.vocab_size)
            nan_rows = (~rows[r].isfinite()).any(1).nonzero().flatten().tolist()
            assert not nan_rows, (mode, r, nan_rows)
    return hf, fed, logits


@pytest.mark.usefixtures("one_thread")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "deepseek-v3"])
def test_mixed_prefill_and_decode_steps_over_a_nan_filled_cache_give_transformers_logits(name: str,
                                                                                        dtype: str) -> None:
    """Issue 45 end to end: :data:`MIXED_STEPS` (uneven prompts, then prefill and decode in one
    batch), serially and with DBO (every step microbatched), on a KV cache whose every slot is NaN
    until a token writes it. Every logits row is finite and, in bf16, transformers' bits (the
    promise of this module); in fp32 within the fp32 tolerances. Before the fix (fbb170b) the bf16
    rows of requests 0 and 2 were NaN from step 0 on."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    hf, fed, runs = _mixed_serial_and_dbo(name, torch_dtype)
    for r, tokens in fed.items():
        ref_SV = hf_logits(hf, tokens)
        for mode, logits in runs.items():
            got_SV = logits[r]
            if dtype == "bf16":
                assert torch.equal(got_SV.float(), ref_SV), (mode, r, (got_SV.float() - ref_SV).abs().max())
            else:
                assert (got_SV - ref_SV).abs().max().item() <= FP32_HF_TOL, (mode, r)
        if dtype == "fp32":
            assert (runs["serial"][r] - runs["dbo"][r]).abs().max().item() <= FP32_DBO_TOL, r


@pytest.mark.usefixtures("one_thread")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name,mode", [("mixtral", "exact"), ("qwen3-moe", "exact"), ("deepseek-v3", "exact"),
                                       ("deepseek-v3", "mla_absorb")])
def test_exact_mode_and_absorbed_mla_over_a_nan_filled_cache(name: str, mode: str, dtype: str) -> None:
    """The model's other attention paths on the same mixed steps over a NaN-filled cache: exact
    mode (``deterministic=True``: the tiled attention, whose padding rows see no key) and DeepSeek's
    absorbed decode (``mla_absorb=True``). Neither keeps transformers' bf16 rounding (module
    docstring of :class:`~asyncdbo.models.hf.model.HFMoEModel`), so what they promise is checked:
    every row finite; exact mode's DBO run gives the serial run's bits; in fp32, transformers'
    logits within the fp32 tolerance."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    kw = {"deterministic": True} if mode == "exact" else {"mla_absorb": True}
    hf, fed, runs = _mixed_serial_and_dbo(name, torch_dtype, **kw)
    for r, tokens in fed.items():
        if mode == "exact":
            assert torch.equal(runs["dbo"][r], runs["serial"][r]), r
        if dtype == "fp32":
            ref_SV = hf_logits(hf, tokens)
            for run in runs.values():
                assert (run[r] - ref_SV).abs().max().item() <= FP32_HF_TOL, r
