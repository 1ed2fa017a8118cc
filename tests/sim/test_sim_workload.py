"""Workload replay: per-step batch compositions across DP ranks through the real planner and the sim.

Hand-written steps pin each planner outcome (split, a rank below its threshold vetoes the step,
an idle rank follows with padding) and what the replay makes of it; the file format's errors
name the line and the fix."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from asyncdbo.cli import main as cli_main
from asyncdbo.plan import PlanReason, ThresholdConfig
from asyncdbo.sim.predict import Deployment, ModelShape
from asyncdbo.sim.workload import _summary, load_workload, replay, step_shape, synthetic_workload

pytestmark = pytest.mark.timeout(120)

TINY = ModelShape(name="tiny", hidden=64, intermediate=32, experts=8, top_k=2, shared_experts=1, heads=2, kv_heads=1,
                  head_dim=16, v_head_dim=16, layers=3)
STEPS = [
    [[(1, 512)] * 64, [(1, 1024)] * 48],  # both ranks decode above the threshold of 32: split
    [[(1, 512)] * 64, [(1, 1024)] * 8],  # rank 1 has 8 decode tokens: below 32, it votes no
    [[(1, 512)] * 64, []],  # rank 1 idle: it follows with padding-only ubatches
    [[(256, 0), (1, 700)], [(1, 700)] * 40],  # rank 0 mixed: 257 tokens < the prefill threshold of 512
]


def write(tmp_path: Path, steps: list[Any]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("# a comment\n" + "\n".join(json.dumps({"step": i, "ranks": s}) for i, s in enumerate(steps)) + "\n\n")
    return path


def test_a_file_round_trips(tmp_path: Path) -> None:
    assert load_workload(write(tmp_path, STEPS)) == STEPS


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "not JSON (Expecting value); each line is one step like"),
    ('{"rank": []}', 'a step needs "ranks": a non-empty list with one request list per DP rank'),
    ('{"ranks": [[[1, 5]], [[0, 3]]]}', "rank 1 has request [0, 3]; a request is [new_tokens >= 1, cached_tokens >= 0]"),
    ('{"ranks": [[[1, 5]]]}', "1 ranks, but the first step has 2; every step lists every DP rank"),
    ('{"ranks": [[[true, 5]], []]}', "rank 0 has request [true, 5]; a request is [new_tokens >= 1, cached_tokens >= 0]: "
                                     "true is a JSON bool, not a number of tokens"),
    ('{"ranks": [[], [[1, false]]]}', "rank 1 has request [1, false]; a request is [new_tokens >= 1, cached_tokens >= 0]: "
                                      "false is a JSON bool, not a number of tokens"),
    ('{"ranks": [[[2.5, 5]], []]}', "rank 0 has request [2.5, 5]; a request is [new_tokens >= 1, cached_tokens >= 0]: "
                                    "2.5 is not a whole number of tokens"),
    ('{"ranks": [[[1, 5, 7]], []]}', "rank 0 has request [1, 5, 7]; a request is [new_tokens >= 1, cached_tokens >= 0]"),
])
def test_a_bad_line_names_the_line_and_the_fix(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ranks": [[[1, 5]], []]}\n' + line + "\n")
    with pytest.raises(ValueError) as info:
        load_workload(path)
    assert str(info.value).startswith(f"{path}:2: {message}")


_CONTEXT = ("cached_tokens (the request's context) must be at most 16777216 (2**24, over 100 times the longest "
            "context window of the models the sim ships, DeepSeek-V3's 163,840 tokens); give the tokens the request's "
            "KV cache holds")


@pytest.mark.parametrize("cached", [2**24 + 1, 10**18, 2**63])
def test_a_context_past_the_bound_is_refused_naming_the_rank_the_request_and_the_bound(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], cached: int) -> None:
    # 10**18 (and 2**63) passed, and the sim failed after the table's header: torch refused the size of an
    # attention tensor sized by the context ("Storage size calculation overflowed")
    path = tmp_path / "long.jsonl"
    path.write_text(f'{{"ranks": [[[1, 5]], []]}}\n{{"ranks": [[[1, 100]], [[512, 0], [1, {cached}]]]}}\n')
    message = f"{path}:2: rank 1 has request [1, {cached}]; {_CONTEXT}"
    with pytest.raises(ValueError) as info:
        load_workload(path)
    assert str(info.value) == message
    assert cli_main(["check", "--workload", str(path), "-q"]) == 2
    assert capsys.readouterr() == ("", f"asyncdbo check: error: {message}\n")


def test_a_context_at_the_bound_is_replayed() -> None:
    # DeepSeek-V3: the largest attention tensors per key of the models the sim ships
    steps = [[[(1, 2**24)] * 64, [(512, 2**24), (1, 2**24)]]]
    result = replay(steps, model=ModelShape.of("deepseek-v3", layers=1), deployment=Deployment(ep=8))
    assert [s.tokens for s in result.steps] == [(64, 513)] and 0 < result.serial_s < float("inf")


EXAMPLE = '{"ranks": [[[1, 2048]], [[512, 0]], []]}'


def test_check_rank_refuses_a_rank_as_it_is_read_naming_the_line_and_its_largest_request(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text('{"ranks": [[[1, 5]], []]}\n{"ranks": [[[1, 5], [300, 0], [2, 9]], []]}\n')
    seen: list[int] = []

    def at_most_100(tokens: int) -> str | None:
        seen.append(tokens)
        return None if tokens <= 100 else "more than 100"

    with pytest.raises(ValueError) as info:
        load_workload(path, check_rank=at_most_100)
    assert str(info.value) == f"{path}:2: rank 0 has 303 new tokens (its largest request [300, 0]); more than 100"
    assert seen == [1, 303]  # busy ranks only, in file order
    assert load_workload(path, check_rank=lambda tokens: None) == load_workload(path)


def test_a_file_that_cannot_be_read_names_the_file_and_why(tmp_path: Path) -> None:
    binary = tmp_path / "trace.bin"
    binary.write_bytes(b'{"ranks": [[[1, 5]]]}\n\xff\n')
    for path, why in ((tmp_path / "missing.jsonl", "cannot read the workload (No such file or directory)"),
                      (tmp_path, "cannot read the workload (Is a directory)"),
                      (binary, "not UTF-8 text (invalid start byte at byte 22)")):
        with pytest.raises(ValueError) as info:
            load_workload(path)
        assert str(info.value) == f"{path}: {why}; give a JSON-lines file, one step per line like {EXAMPLE}"


def test_a_file_whose_every_rank_is_idle_has_nothing_to_replay(tmp_path: Path) -> None:
    path = write(tmp_path, [[[], []], [[], []]])
    with pytest.raises(ValueError) as info:
        load_workload(path)
    assert str(info.value) == (f"{path}: no step has tokens (every rank is idle in all 2 step(s)), so there is nothing "
                               "to replay; give a busy rank its requests, like [[1, 2048]] for a decode request over "
                               "2048 cached tokens")
    path.write_text('{"ranks": [[], []]}\n{"ranks": [[[1, 5]], []]}\n')  # one busy rank in one step is enough
    assert load_workload(path) == [[[], []], [[(1, 5)], []]]


def test_check_refuses_an_unreadable_or_all_idle_workload_with_an_error_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    idle = write(tmp_path, [[[], []]])
    missing = tmp_path / "nonexist.jsonl"
    for path, message in (
        (idle, f"{idle}: no step has tokens (every rank is idle in all 1 step(s)), so there is nothing to replay; give "
               "a busy rank its requests, like [[1, 2048]] for a decode request over 2048 cached tokens"),
        (missing, f"{missing}: cannot read the workload (No such file or directory); give a JSON-lines file, one step "
                  f"per line like {EXAMPLE}"),
    ):
        assert cli_main(["check", "--workload", str(path), "-q"]) == 2
        assert capsys.readouterr() == ("", f"asyncdbo check: error: {message}\n")


def test_the_synthetic_workload_mixes_what_serving_sees() -> None:
    steps = synthetic_workload(ranks=4, steps=16, seed=0)
    assert steps == synthetic_workload(ranks=4, steps=16, seed=0) and len(steps) == 16
    ranks = [r for s in steps for r in s]
    assert any(r == [] for r in ranks)  # idle ranks
    assert any(any(q > 1 for q, _ in r) for r in ranks)  # prefill chunks among decodes
    assert any(0 < len(r) < 32 and all(q == 1 for q, _ in r) for r in ranks)  # decode below the threshold
    assert len({sum(q for q, _ in r) for r in steps[0]}) > 1  # uneven ranks


def test_replay_follows_the_planner_and_times_every_rank() -> None:
    res = replay(STEPS, model=TINY, deployment=Deployment(ep=4))
    got = [(s.microbatched, s.reason, s.tokens) for s in res.steps]
    assert got == [
        (True, PlanReason.MICROBATCHED, (64, 48)),
        (False, PlanReason.RANK_DECLINED, (64, 8)),
        (True, PlanReason.MICROBATCHED, (64, 0)),
        (False, PlanReason.RANK_DECLINED, (257, 40)),
    ]
    assert res.steps[1].detail == "rank 1: below_threshold"
    assert res.steps[2].detail == "idle rank(s) [1] run padding-only ubatches"
    assert res.steps[3].detail == "rank 0: below_threshold"
    for s in res.steps:
        assert s.serial_s > 0 and s.dbo_s > 0
        if not s.microbatched:
            assert s.dbo_s == s.serial_s  # a step that fell out runs unsplit either way
    assert res.gain == pytest.approx(res.serial_s / res.dbo_s - 1)
    assert res.microbatched_share == 0.5
    assert res.reasons() == {PlanReason.RANK_DECLINED: 2}
    assert res.rank_reasons() == {PlanReason.BELOW_THRESHOLD: 2}


def test_multi_token_decode_is_replayed_as_decode_and_held_to_the_decode_threshold() -> None:
    # MTP / speculative verify: 2 tokens per request over a long cache. They were simulated as
    # prefill chunks (issue 27); now as decode, each query count summarized at its mean context.
    step = [[(2, 700)] * 32, [(2, 900)] * 20]  # 64 and 40 tokens of uniform 2-token decode
    assert step_shape(step) == "decode"
    assert step_shape([[(2, 700)], [(256, 0)]]) == step_shape([[(2, 0)]]) == "prefill"  # a chunk, a first chunk
    assert _summary([(1, 500), (2, 1000), (2, 2000), (512, 0)], 512) == [(1, 512), (2, 1536), (2, 1536), (512, 0)]
    with_k = replay([step], model=TINY, deployment=Deployment(ep=4), thresholds=ThresholdConfig(num_spec_tokens=1))
    without = replay([step], model=TINY, deployment=Deployment(ep=4))
    assert [(s.microbatched, s.reason) for s in with_k.steps] == [(True, PlanReason.MICROBATCHED)]
    # without the draft-token count the planner does not see uniform decode: the prefill threshold (512) holds
    assert [(s.microbatched, s.reason, s.detail) for s in without.steps] == [
        (False, PlanReason.BELOW_THRESHOLD, "rank 0: below_threshold; rank 1: below_threshold")]
    assert synthetic_workload(spec_tokens=1) == [[[(q + 1, c) if q == 1 else (q, c) for q, c in r] for r in s]
                                                 for s in synthetic_workload()]


ARGV = ["--model", "qwen3-moe", "--hidden", "64", "--intermediate", "32", "--experts", "8", "--heads", "4", "--ep", "4"]
THRESHOLDS = ("thresholds: fixed splits a step into 2 ubatches (token split) when every busy rank has >= 32 tokens of "
              "uniform decode or >= 512 otherwise (--decode-threshold, --prefill-threshold); auto starts from them")


def test_check_replays_a_file_under_fixed_and_auto_and_prints_why(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check", "--workload", str(write(tmp_path, STEPS)), *ARGV]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[3:6] == [
        f"workload: {tmp_path / 'trace.jsonl'}, 4 steps x 2 DP ranks; policies fixed, auto; role streams",
        THRESHOLDS,
        "auto: per shape bucket, off or N=2/3/4 with the token/balanced split, from the simulated step times "
        "(asyncdbo.serving.AutoPolicy, the runner's); starts from the thresholds' choice, 1 warm-up + 3 to 6 samples per "
        "configuration, each paired with one of the incumbent's, the pairs' median ratio apart from 1 by 3% and 2 "
        "standard errors; split dispatch only (the sim does not model fused "
        "counts)",
    ]
    assert re.fullmatch(r"throughput, real tokens of all ranks per second of MoE-layer time \(off runs every step "
                        r"unsplit: \d+\.\d\d M\):", out[6]), out[6]
    fixed = re.fullmatch(r"  fixed role   \d+\.\d\d M  speedup (\d+\.\d\d)x  \(2 of 4 steps microbatched; on those "
                         r"alone (\d+\.\d\d)x\)", out[7])
    assert fixed, out[7]
    # auto's prior is the thresholds' choice; step 2 (8 tokens on rank 1) is in the same bucket as step 1
    # (the largest rank's 64), so it runs there as the prior's warm-up (the one split step), then
    # off's warm-up and its first sample; the mixed step of 257 tokens starts off
    assert re.fullmatch(r"  auto  role   \d+\.\d\d M  speedup \d+\.\d\dx  \(1 of 4 steps microbatched, 4 while "
                        r"exploring\)", out[8]), out[8]
    assert out[9:15] == [
        "fixed: steps that fell out",
        "  fell out: rank_declined in 2 step(s)",
        "    a rank voted no: below_threshold (2 rank-step(s))",
        "  e.g. tokens by rank [64, 8]: rank 1: below_threshold",
        "auto: per shape bucket, the choice and its evidence (us per real token of the largest rank, per MoE layer; "
        "samples)",
        out[14],
    ]
    assert re.fullmatch(r"  decode 64-127: still exploring \(3 of 3 step\(s\)\); best N=2 token split "
                        r"\(prior, unmeasured\); off \d+\.\d\d±\d+\.\d\d \(1\)", out[14]), out[14]
    assert out[15] == "  mixed 256-511: still exploring (1 of 1 step(s)); best off (prior, unmeasured)"
    # the sim prices this tiny model's split decode steps above the serial ones (launch-bound): flagged
    assert float(fixed.group(2)) < 1
    assert out[16] == (f"warning: the fixed thresholds microbatch decode 64-127 below break-even: {fixed.group(2)}x "
                       "of off over 2 step(s) (--decode-threshold 32); auto was still exploring there (--repeat "
                       "replays longer)")
    assert out[-1].startswith("error band: ")


def test_check_prints_every_policy_under_both_stream_policies(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    below = [[[[1, 100]] * 4, [[1, 100]] * 2]] * 2  # 2 steps of 4 and 2 decode requests: below the threshold of 32
    argv = ["check", "--workload", str(write(tmp_path, below)), *ARGV, "--policy", "off", "--policy", "fixed",
            "--stream-policy", "both", "--no-check-races"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[3:5] == [f"workload: {tmp_path / 'trace.jsonl'}, 2 steps x 2 DP ranks; policies off, fixed; role and "
                        "ubatch streams", THRESHOLDS]
    rows = [re.sub(r"\d+\.\d\d M", "x M", line) for line in out[6:10]]
    assert rows == [f"  {p:<5} {s:<6} x M  speedup 1.00x  (0 of 2 steps microbatched)"
                    for s in ("role", "ubatch") for p in ("off", "fixed")]
    assert out[10:14] == [
        "fixed (role streams): steps that fell out",
        "  fell out: below_threshold in 2 step(s)",  # every rank below: no rank declined for another
        "    a rank voted no: below_threshold (4 rank-step(s))",
        "  e.g. tokens by rank [4, 2]: rank 0: below_threshold; rank 1: below_threshold",
    ]
    assert out[14] == "fixed (ubatch streams): steps that fell out"


@pytest.mark.parametrize(("flags", "message"), [
    (["--policy", "fixed,bogus"], "--policy 'bogus' is not a policy; use some of off, fixed, auto (repeat the flag or "
                                  "separate them with commas)"),
    (["--repeat", "0"], "--repeat must be >= 1 (got 0): how many times to replay the trace in a row"),
    (["--decode-threshold", "-1"], "decode_threshold (-1) must be >= 0; use 0 to always microbatch"),
    (["--spec-tokens", "8"], "--spec-tokens must be between 0 and 7 (got 8): the draft tokens each decode request "
                             "carries (MTP, speculative verify)"),
])
def test_check_workload_refuses_bad_flags_before_simulating(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            flags: list[str], message: str) -> None:
    assert cli_main(["check", "--workload", str(write(tmp_path, STEPS)), *ARGV, *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"asyncdbo check: error: {message}\n" and captured.out == ""


def test_the_workload_flags_are_refused_without_a_workload(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check", "--policy", "auto", "--repeat", "2"]) == 2
    assert capsys.readouterr().err == ("asyncdbo check: error: --policy, --repeat apply to --workload only; add "
                                       "--workload FILE|synthetic or drop them\n")


def test_check_workload_takes_the_draft_tokens_and_prints_them(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    steps = [[[[2, 700]] * 32, [[2, 900]] * 20]]
    argv = ["check", "--workload", str(write(tmp_path, steps)), *ARGV, "--policy", "fixed", "--no-check-races",
            "--spec-tokens", "1"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[4] == THRESHOLDS.replace("uniform decode or", "uniform decode (1 + 1 tokens per request, --spec-tokens) or")
    assert re.fullmatch(r"  fixed role   \d+\.\d\d M  speedup \d+\.\d\dx  \(1 of 1 steps microbatched; on those "
                        r"alone \d+\.\d\dx\)", out[6]), out


DOCS = Path(__file__).resolve().parents[2] / "docs" / "sim.md"


@pytest.mark.slow
@pytest.mark.timeout(900)  # 20 to 23 s of CPU; on the shared 2-core machine its wall time follows the load
def test_docs_show_the_synthetic_runs_output_and_say_what_it_shows(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncdbo.sim.tuning as tuning
    import asyncdbo.sim.workload as workload

    got: dict[str, Any] = {}
    for mod, name in ((workload, "replay"), (tuning, "replay_auto")):
        def keep(*args: Any, _name: str = name, _fn: Any = getattr(mod, name), **kwargs: Any) -> Any:
            got[_name] = _fn(*args, **kwargs)
            return got[_name]
        monkeypatch.setattr(mod, name, keep)
    assert cli_main(["check", "--workload", "synthetic"]) == 0
    out = capsys.readouterr().out
    docs = DOCS.read_text()
    block = docs.split("`benchmarks/results/check_workload_time_cpu-2c_2026-12-03.md`):\n\n```\n", 1)[1].split("```", 1)[0]
    assert out == block  # the example is this run's output, whole

    fixed, auto = got["replay"].steps, got["replay_auto"]
    assert auto.exploring() == len(auto.steps) == len(fixed) == 16  # every step explored
    split = {i for i, s in enumerate(auto.steps) if s.microbatched}
    by_fixed = {i for i, s in enumerate(fixed) if s.microbatched}
    assert {arm.label for i, (_, arm, _) in enumerate(auto.choices) if i in split} == {"N=2 token split"}
    assert all(" of off)" in evidence for i, (_, _, evidence) in enumerate(auto.choices) if i not in split)
    cfg = tuning.SIM_AUTO
    vetoed = {i for i, s in enumerate(fixed)  # a rank below its threshold voted no, another yes
              if PlanReason.BELOW_THRESHOLD in s.local and PlanReason.MICROBATCHED in s.local}
    assert vetoed == set(range(16)) - by_fixed
    prose = " ".join(docs.split("Over this 16-step trace `auto`", 1)[1].split("\n\n", 1)[0].split())
    assert prose == (
        f"is still exploring every bucket (a configuration takes {cfg.warmup + cfg.samples} steps of its bucket: "
        f"{cfg.warmup} warm-up and {cfg.samples} samples), so "
        f"every one of its 16 steps ran a configuration it was measuring: it microbatched {len(split)} (N=2 token split, "
        f"the thresholds' choice it starts from) and ran the other {16 - len(split)} off, to measure off against that "
        f"split. The thresholds split {len(by_fixed)} steps: in the other {len(vetoed)}, at least one rank below its "
        "threshold vetoed the split the others voted for, while `auto` chooses per bucket of the largest rank; "
        f"{len(split & vetoed)} of auto's {len(split)} microbatched steps are among those {len(vetoed)}, and "
        f"{len(by_fixed - split)} of the fixed run's {len(by_fixed)} fell on auto's turns to measure off."
    )
