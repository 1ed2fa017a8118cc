"""The engine: requests join and leave between steps, greedy output is transformers' ``generate()``
per request, finished requests give their KV blocks back, seeded sampling is reproducible and the
same serial or DBO, and a replayed trace is timed on an injected clock.

One rank, the tiny random Qwen3-MoE (layer 0 MoE, layer 1 dense) of
:mod:`asyncdbo.models.hf.reference`; the 2-rank path (an idle rank stepping while the other works)
runs as ``examples/05_engine_integration.py`` (tests/docs).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")


from asyncdbo.models.hf import from_hf_model  # noqa: E402
from asyncdbo.models.hf.reference import tiny_hf_model  # noqa: E402
from asyncdbo.plan import PlanReason, StepRecord, ThresholdConfig  # noqa: E402
from asyncdbo.serving import (  # noqa: E402
    BatchBuilder,
    NonFiniteLogitsError,
    DBORunner,
    Engine,
    EngineReport,
    Request,
    RequestStatus,
    RunnerConfig,
    SamplingParams,
    StepClock,
    compare_modes,
    sample_tokens,
    trace_requests,
)

pytestmark = pytest.mark.timeout(180)

ALWAYS = ThresholdConfig(decode_threshold=1, prefill_threshold=1)


@pytest.fixture(scope="module")
def hf_models() -> dict[str, Any]:
    return {name: tiny_hf_model(name) for name in ("qwen3-moe",)}


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]


def engine(model: Any, *, enabled: bool, clock: StepClock | None = None, **kw: Any) -> Engine:
    clock = clock or StepClock(step_s=1.0)  # every step lasts exactly 1 s of the engine's clock
    runner = DBORunner(model, RunnerConfig(thresholds=ALWAYS))
    return Engine(runner, BatchBuilder(model.kv_cache_config, vocab_size=96), enabled=enabled, clock=clock, sleep=clock.sleep, **kw)


def hf_generate(hf_model: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    stops = [*params.stop_token_ids, *([] if params.eos_token_id is None else [params.eos_token_id])]
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                            do_sample=False, eos_token_id=stops or None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.asyncio
async def test_greedy_output_is_transformers_generate_per_request_as_requests_join_and_leave(
        hf_models: dict[str, Any]) -> None:
    hf = hf_models["qwen3-moe"]
    ps = prompts(7, 11, 4, 9, 5)
    # Request 1 stops at an EOS, request 3 at a stop token: each the token transformers' greedy
    # run gives at that request's third output position (so generate() stops there too).
    free_run = {i: hf_generate(hf, ps[i], SamplingParams(max_tokens=3)) for i in (1, 3)}
    params = [SamplingParams(max_tokens=5), SamplingParams(max_tokens=6, eos_token_id=free_run[1][2]),
              SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, stop_token_ids=(free_run[3][2], 95)),
              SamplingParams(max_tokens=1)]
    trace = trace_requests(ps, [0.0, 0.0, 2.0, 3.0, 5.0], params)
    for enabled in (False, True):
        model = from_hf_model(hf, block_size=4, num_kv_blocks=32, max_ubatches=2)
        report = await engine(model, enabled=enabled).run(trace)
        for i, p in enumerate(ps):
            out = report.outputs[i]
            assert list(out.output_ids) == hf_generate(hf, p, params[i]), (enabled, i)
        assert [report.outputs[i].finish_reason for i in range(5)] == ["length", "stop", "length", "stop", "length"]
        # Joining and leaving: step 2 (t = 2 s) prefills request 2 beside the decodes of 0 and 1.
        assert [r.microbatched for r in report.records] == [enabled] * len(report.records)
        if enabled:
            assert report.records[2].reason is PlanReason.MICROBATCHED
            assert sum(report.records[2].ubatch_num_tokens) == 1 + 1 + 4


@pytest.mark.asyncio
async def test_finished_requests_give_their_blocks_back_and_a_waiting_request_reuses_them(
        hf_models: dict[str, Any]) -> None:
    model = from_hf_model(hf_models["qwen3-moe"], block_size=4, num_kv_blocks=4, max_ubatches=2)
    eng = engine(model, enabled=True)
    a, b = prompts(7, 5)
    # a: 7 + 6 - 1 = 12 cached tokens, 3 blocks; b: 5 + 4 - 1 = 8, 2 blocks: b waits for a.
    eng.add_request(Request(request_id=0, prompt=tuple(a), params=SamplingParams(max_tokens=6)))
    eng.add_request(Request(request_id=1, prompt=tuple(b), params=SamplingParams(max_tokens=4)))
    held: list[dict[int, list[int]]] = []
    ended = {}
    while eng.num_unfinished:
        finished = await eng.step()
        ended.update((o.request_id, o) for o in finished)
        held.append({rid: list(blocks) for rid, blocks in eng.builder.blocks.items()})
        assert eng.builder.num_free_blocks == 4 - sum(len(v) for v in held[-1].values())
        if finished and finished[0].request_id == 0:
            assert 0 not in eng.builder.blocks
    assert held[:5] == [{0: [0, 1]}, {0: [0, 1]}, {0: [0, 1, 2]}, {0: [0, 1, 2]}, {0: [0, 1, 2]}]
    assert held[5] == {}  # a finished in step 5: every block back
    assert held[6] == {1: [0, 1]}  # b admitted next step, on a's old blocks
    assert eng.builder.num_free_blocks == 4 and eng.builder.blocks == {}
    assert [len(ended[0].output_ids), len(ended[1].output_ids)] == [6, 4]
    assert eng.outputs == {}  # handed over by step(): the engine keeps their status only
    assert eng.status(0) is eng.status(1) is RequestStatus.FINISHED


@pytest.mark.asyncio
async def test_seeded_sampling_is_reproducible_and_the_same_serial_or_dbo(hf_models: dict[str, Any]) -> None:
    hf = hf_models["qwen3-moe"]
    ps = prompts(6, 9, 3, seed=1)
    params = [SamplingParams(max_tokens=5, temperature=1.3, top_p=0.9, seed=s) for s in (11, 12, 13)]
    runs = {}
    for label, enabled, arrivals in (("serial", False, [0.0, 0.0, 0.0]), ("dbo", True, [0.0, 0.0, 0.0]),
                                     ("dbo, other arrivals", True, [3.0, 0.0, 1.0])):
        model = from_hf_model(hf, block_size=4, num_kv_blocks=32, max_ubatches=2)
        report = await engine(model, enabled=enabled).run(trace_requests(ps, arrivals, params))
        runs[label] = {i: o.output_ids for i, o in report.outputs.items()}
    assert runs["serial"] == runs["dbo"] == runs["dbo, other arrivals"]
    greedy = {i: tuple(hf_generate(hf, p, SamplingParams(max_tokens=5))) for i, p in enumerate(ps)}
    assert runs["serial"] != greedy  # it did sample


@pytest.mark.asyncio
async def test_a_replayed_trace_reports_ttft_tpot_and_tokens_per_second(hf_models: dict[str, Any]) -> None:
    model = from_hf_model(hf_models["qwen3-moe"], block_size=4, num_kv_blocks=32, max_ubatches=2)
    clock = StepClock(step_s=1.0)
    # Request 1 arrives at 10 s, long after request 0 finished: the engine waits (sleep) for it.
    trace = trace_requests(prompts(5, 6), [0.0, 10.0], [SamplingParams(max_tokens=3), SamplingParams(max_tokens=2)])
    report = await engine(model, enabled=True, clock=clock).run(trace)
    r0, r1 = report.outputs[0], report.outputs[1]
    # run starts at clock 0.5 (t = 0); step k reads the clock at t = 1 + 2k - 0.5 ... every step lasts 1 s
    assert (r0.first_token_s, r0.finish_s, r0.ttft_s, r0.tpot_s) == (1.0, 3.0, 1.0, 1.0)
    assert (r1.first_token_s, r1.finish_s, r1.ttft_s, r1.tpot_s) == (11.0, 12.0, 1.0, 1.0)
    assert report.makespan_s == 12.0 and report.output_tokens == 5
    assert report.tokens_per_s == 5 / 12.0 and report.mean_ttft_s == 1.0 and report.mean_tpot_s == 1.0
    assert len(report.records) == 5 and "5 tokens in 5 steps (5 microbatched)" in report.summary()
    assert report.summary().endswith(" ms (means over the requests of one run: a single sample of the engine's speed)")


def test_top_p_keeps_the_smallest_set_reaching_p_and_a_seed_repeats_its_draws() -> None:
    logits_RV = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).log()
    def draws(top_p: float, seed: int) -> set[int]:
        g = torch.Generator().manual_seed(seed)
        p = SamplingParams(temperature=1.0, top_p=top_p, seed=seed)
        return {sample_tokens(logits_RV, [p], [g])[0] for _ in range(200)}
    assert draws(0.5, 0) == {0}
    assert draws(0.6, 0) == {0, 1}
    assert draws(1.0, 0) == {0, 1, 2}
    seq = [sample_tokens(logits_RV, [SamplingParams(temperature=1.0, seed=3)], [g])[0]
           for g in [torch.Generator().manual_seed(3)] for _ in range(20)]
    again = [sample_tokens(logits_RV, [SamplingParams(temperature=1.0, seed=3)], [g])[0]
             for g in [torch.Generator().manual_seed(3)] for _ in range(20)]
    assert seq == again
    assert sample_tokens(torch.tensor([[0.0, 2.0, 1.0]]), [SamplingParams()], [None]) == [1]  # greedy


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 0}, r"max_tokens must be an int >= 1 \(got 0\)"),
    ({"temperature": -1.0}, r"temperature must be a finite number >= 0, 0 for greedy \(got -1.0\)"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], 1.0 keeping every token \(got 0.0\)"),
    ({"seed": -2}, r"seed must be an int in \[0, 2\*\*64\) or None, what torch.Generator.manual_seed takes \(got -2\)"),
    ({"seed": 2**70}, r"seed must be an int in \[0, 2\*\*64\) or None, .* \(got 1180591620717411303424\)"),
    ({"stop_token_ids": (3, -1)}, r"stop_token_ids and eos_token_id must be token ids \(ints >= 0\), got -1"),
])
def test_bad_sampling_params_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.asyncio
async def test_bad_requests_are_refused_before_any_step(hf_models: dict[str, Any]) -> None:
    model = from_hf_model(hf_models["qwen3-moe"], block_size=4, num_kv_blocks=4, max_ubatches=2)
    eng = engine(model, enabled=True, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match=r"request 7: the prompt is empty; give at least one token id"):
        Request(request_id=7, prompt=())
    with pytest.raises(ValueError, match=r"request 1: arrival_s must be a finite time >= 0 in seconds \(got -1.0\)"):
        Request(request_id=1, prompt=(1,), arrival_s=-1.0)
    with pytest.raises(ValueError, match=r"request 2: 10 prompt tokens \+ max_tokens 8 need 5 KV blocks of 4, "
                                         r"the cache has 4; lower max_tokens or raise num_kv_blocks"):
        eng.add_request(Request(request_id=2, prompt=(1,) * 10, params=SamplingParams(max_tokens=8)))
    with pytest.raises(ValueError, match=r"request 3: token 1 is 96, not a token id of a vocabulary of 96"):
        eng.add_request(Request(request_id=3, prompt=(1, 96), params=SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match=r"request 5: a prompt of 9 tokens exceeds max_num_batched_tokens \(8\); raise it"):
        eng.add_request(Request(request_id=5, prompt=(1,) * 9, params=SamplingParams(max_tokens=1)))
    eng.add_request(Request(request_id=4, prompt=(1, 2), params=SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match=r"request 4 was added already; request ids must be unique"):
        eng.add_request(Request(request_id=4, prompt=(1, 2)))
    assert eng.num_unfinished == 1 and not eng.records
    builder = BatchBuilder(model.kv_cache_config)
    builder.build([(0, [1])])
    with pytest.raises(ValueError, match=r"the builder already holds requests \[0\]; give the engine a fresh"):
        Engine(eng.runner, builder)


# -------------------------------------------------------------- never a wrong token (issue 45)


def _poison(eng: Engine, request_id: int, at_step: int, value: float) -> None:
    """Make ``request_id``'s last logits row of engine step ``at_step`` hold ``value`` in one
    entry (as a model that overflowed or read unwritten memory would)."""
    step = eng.runner.step

    async def poisoned(batch: Any, **kw: Any) -> Any:
        result = await step(batch, **kw)
        if eng.num_steps == at_step:
            rows = batch.attn.query_start_loc_cpu[1:].tolist()
            rids = [rid for rid, _ in eng._running.items()]  # the step's order: running first
            last = rows[rids.index(request_id)] - 1
            result.logits_TV[last, 7] = value
        return result
    eng.runner.step = poisoned  # type: ignore[method-assign]


@pytest.mark.asyncio
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
async def test_a_non_finite_logits_row_fails_its_request_by_name_and_the_others_get_the_clean_tokens(
        hf_models: dict[str, Any], value: float) -> None:
    hf = hf_models["qwen3-moe"]
    ps = prompts(5, 8, 3, seed=4)
    params = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, temperature=0.7, seed=3),
              SamplingParams(max_tokens=4)]
    runs = {}
    for label in ("clean", "poisoned"):
        eng = engine(from_hf_model(hf, block_size=4, num_kv_blocks=32, max_ubatches=2), enabled=True)
        if label == "poisoned":
            _poison(eng, request_id=1, at_step=2, value=value)
        runs[label] = await eng.run(trace_requests(ps, [0.0] * 3, params))
    clean, bad = runs["clean"].outputs, runs["poisoned"].outputs
    assert bad[0].output_ids == clean[0].output_ids and bad[2].output_ids == clean[2].output_ids
    assert bad[1].finish_reason == "error" and bad[1].status is RequestStatus.FAILED
    assert bad[1].output_ids == clean[1].output_ids[:2]  # the tokens of the steps before
    assert bad[1].error == (
        "NonFiniteLogitsError: request 1: its logits at step 2 hold NaN or +inf, or only -inf "
        f"({int(value != value)} NaN, {int(value == float('inf'))} inf of 96); no token was sampled from them")
    assert list(runs["poisoned"].failed) == [1] and "3 requests, 1 failed" in runs["poisoned"].summary()


def test_sample_tokens_refuses_a_row_it_cannot_draw_from_and_minus_inf_rules_a_token_out() -> None:
    greedy = [SamplingParams()] * 3
    rows = torch.tensor([[0.0, 1.0], [float("nan"), 1.0], [float("-inf"), float("-inf")]])
    with pytest.raises(NonFiniteLogitsError, match=r"logits rows \[1, 2\] hold NaN or \+inf \(or only -inf\)"):
        sample_tokens(rows, greedy, [None] * 3)
    ruled_out = torch.tensor([[2.0, float("-inf"), 1.0]])
    hot = SamplingParams(temperature=50.0, seed=1)
    draws = {sample_tokens(ruled_out, [hot], [torch.Generator().manual_seed(s)])[0] for s in range(200)}
    assert draws == {0, 2}


def test_a_tiny_temperature_samples_the_most_likely_token_instead_of_nan() -> None:
    rows = torch.tensor([[0.1, 3.0, 2.9, -4.0]])
    for t in (1e-300, 1e-30, 1e-6):
        params = SamplingParams(temperature=t, seed=9)
        assert sample_tokens(rows, [params], [torch.Generator().manual_seed(9)]) == [1]


@pytest.mark.asyncio
async def test_requests_are_refused_where_they_enter_naming_the_request_and_the_field(
        hf_models: dict[str, Any]) -> None:
    model = from_hf_model(hf_models["qwen3-moe"], block_size=4, num_kv_blocks=8, max_ubatches=2)
    eng = engine(model, enabled=True)
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match=rf"request 1: arrival_s must be a finite time >= 0 in seconds \(got {bad}\)"):
            Request(request_id=1, prompt=(1,), arrival_s=bad)
    with pytest.raises(ValueError, match=r"request 2: stop_token_ids/eos_token_id \[96, 500\] are outside the vocabulary "
                                         r"of 96 \(0 .. 95\); such a token is never sampled, so it never stops"):
        eng.add_request(Request(request_id=2, prompt=(1,), params=SamplingParams(stop_token_ids=(3, 96), eos_token_id=500)))
    with pytest.raises(ValueError, match=r"Engine seed must be an int in \[0, 2\*\*64\) \(got -1\)"):
        engine(model, enabled=True, seed=-1)
    with pytest.raises(ValueError, match=r"Engine keep_records must be an int >= 1 \(got 0\)"):
        engine(model, enabled=True, keep_records=0)
    assert eng.num_unfinished == 0
    with pytest.raises(KeyError, match=r"request 2 is not known to this engine"):
        eng.status(2)


@pytest.mark.asyncio
async def test_run_yields_every_step_and_serves_a_request_another_task_adds_meanwhile(
        hf_models: dict[str, Any]) -> None:
    import asyncio

    eng = engine(from_hf_model(hf_models["qwen3-moe"], block_size=4, num_kv_blocks=32, max_ubatches=2), enabled=True)
    ticks: list[int] = []

    async def ticker() -> None:
        while True:
            ticks.append(eng.num_steps)
            if eng.num_steps == 2 and eng.num_unfinished:  # mid-run: add one more request
                eng.add_request(Request(request_id=9, prompt=(4, 5, 6), params=SamplingParams(max_tokens=2)))
                await asyncio.sleep(0)
                break
            await asyncio.sleep(0)

    task = asyncio.ensure_future(ticker())
    report = await eng.run([Request(request_id=0, prompt=(1, 2, 3), params=SamplingParams(max_tokens=6))])
    await task
    assert sorted(report.outputs) == [0, 9] and len(report.outputs[9].output_ids) == 2
    assert {1, 2} <= set(ticks)  # the ticker ran after step 0 and after step 1


@pytest.mark.asyncio
async def test_records_and_statuses_are_kept_in_bounded_rings(hf_models: dict[str, Any]) -> None:
    eng = engine(from_hf_model(hf_models["qwen3-moe"], block_size=4, num_kv_blocks=64, max_ubatches=2), enabled=True,
                 keep_records=3)
    report = await eng.run(trace_requests(prompts(3, 4, 5, 2), [0.0] * 4, SamplingParams(max_tokens=5)))
    assert eng.num_steps == 5 and len(eng.records) == len(eng.step_s) == 3
    assert len(report.records) == 3 and report.records == tuple(eng.records)
    assert sorted(report.outputs) == [0, 1, 2, 3] and eng.outputs == {}  # handed over by run()
    with pytest.raises(KeyError):
        eng.status(0)  # ended before the last 3
    assert [eng.status(r) for r in (1, 2, 3)] == [RequestStatus.FINISHED] * 3


def test_an_auto_runner_is_refused_at_construction_for_a_model_built_for_fewer_ubatches(
        hf_models: dict[str, Any]) -> None:
    model = from_hf_model(hf_models["qwen3-moe"], block_size=4, num_kv_blocks=8, max_ubatches=2)
    with pytest.raises(ValueError, match=r"tuning='auto' may run 4 ubatches \(AutoConfig.ubatch_counts \(2, 3, 4\)\) "
                                         r"but the model's MoE layers were built for max_ubatches=2"):
        DBORunner(model, RunnerConfig(tuning="auto"))
    with pytest.raises(ValueError, match=r"num_ubatches \(3\) exceeds max_ubatches \(2\)"):
        DBORunner(model, RunnerConfig(num_ubatches=3))


@pytest.mark.asyncio
async def test_modes_compare_on_the_same_steps_under_a_step_clock_and_refuse_with_the_reason_otherwise(
        hf_models: dict[str, Any]) -> None:
    """Serial and DBO on one trace: under a StepClock every arrival lands on the same step, so the
    runs take the same steps with the same tokens and their measured step times compare; runs
    that part (here: one admits requests two at a time, the other three) are not compared, and
    the summary says where they part and what to do."""
    model = from_hf_model(hf_models["qwen3-moe"], block_size=4, num_kv_blocks=64, max_ubatches=2)
    trace = trace_requests(prompts(5, 9, 3, 7, 4), [0.0, 0.0, 1.5, 2.5, 4.0], SamplingParams(max_tokens=3))
    reports = {}
    for enabled in (False, True):
        clock = StepClock(step_s=1.0)
        reports[enabled] = await engine(model.with_fresh_cache(), enabled=enabled, clock=clock).run(trace)
    serial, dbo = reports[False], reports[True]
    cmp = compare_modes(serial, dbo)
    n = len(serial.records)
    assert cmp.same_steps and cmp.reason == "" and len(cmp.base_s) == len(cmp.other_s) == n > 3
    assert [sum(r.ubatch_num_tokens) for r in serial.records] == [sum(r.ubatch_num_tokens) for r in dbo.records]
    assert cmp.speedup == sum(serial.step_s) / sum(dbo.step_s)
    assert cmp.step_ratios == tuple(a / b for a, b in zip(serial.step_s, dbo.step_s))
    text = cmp.summary()
    assert text.startswith(f"serial vs DBO on the same {n} steps (the same tokens in each): step time ")
    assert f"(median [min..max] of {n}); speedup serial / DBO {cmp.speedup:.2f}x over their total; per-step " in text
    assert cmp.tokens_per_s == (serial.output_tokens / sum(serial.step_s), dbo.output_tokens / sum(dbo.step_s))
    assert f"; output tokens per second of step time {cmp.tokens_per_s[0]:.1f} vs {cmp.tokens_per_s[1]:.1f}. " in text
    assert text.endswith("One run of each: repeat the pair to see the spread between runs")

    clock = StepClock(step_s=1.0)
    fewer = await engine(model.with_fresh_cache(), enabled=True, clock=clock, max_num_seqs=2).run(trace)
    parted = compare_modes(serial, fewer, names=("serial", "DBO, 2 at a time"))
    assert not parted.same_steps and parted.step_ratios == ()
    assert parted.speedup != parted.speedup  # nan: no ratio of different work
    assert [len(serial.records), len(fewer.records)] == [7, 9]
    assert parted.summary() == (
        "serial and DBO, 2 at a time not compared: serial ran 7 steps and DBO, 2 at a time 9, so they batched the "
        "trace differently; the engine admits a request when its clock reaches the request's arrival, and on a wall "
        "clock a mode whose steps take longer admits more requests per step: give each run Engine(clock=c, "
        "sleep=c.sleep) with its own c = StepClock(), and the same max_num_seqs and KV cache")


def _report(tokens: list[int], *, kept: int | None = None) -> EngineReport:
    records = tuple(StepRecord(step=i, microbatched=False, reason=PlanReason.DISABLED, ubatch_num_tokens=(t,))
                    for i, t in enumerate(tokens))
    return EngineReport(outputs={}, records=records, step_s=(0.001,) * (len(tokens) if kept is None else kept),
                        makespan_s=1.0)


def test_runs_with_as_many_steps_but_other_tokens_or_a_cut_ring_are_not_compared() -> None:
    cmp = compare_modes(_report([8, 3, 2]), _report([8, 5, 0]))
    assert cmp.reason.startswith("step 1 ran 3 tokens under serial and 5 under DBO, so they batched the trace "
                                 "differently; the engine admits")
    assert compare_modes(_report([8, 3]), _report([8, 3], kept=1)).reason == (
        "a report holds only its last keep_records steps; raise Engine(keep_records=...) above the run's steps")
    same = compare_modes(_report([8, 3]), _report([8, 3]))
    assert same.same_steps and same.speedup == 1.0 and same.step_ratios == (1.0, 1.0)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "0.01"])
def test_a_step_clock_refuses_a_step_that_is_not_a_positive_finite_time(bad: Any) -> None:
    with pytest.raises(ValueError) as err:
        StepClock(step_s=bad)
    assert str(err.value) == (f"StepClock step_s must be a finite number of seconds > 0 (got {bad!r}); "
                              "e.g. StepClock(step_s=0.01)")
