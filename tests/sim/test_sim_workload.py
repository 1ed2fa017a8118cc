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
from asyncdbo.plan import PlanReason
from asyncdbo.sim.predict import Deployment, ModelShape
from asyncdbo.sim.workload import load_workload, replay, synthetic_workload

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
])
def test_a_bad_line_names_the_line_and_the_fix(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ranks": [[[1, 5]], []]}\n' + line + "\n")
    with pytest.raises(ValueError) as info:
        load_workload(path)
    assert str(info.value).startswith(f"{path}:2: {message}")


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


def test_check_replays_a_file_and_prints_the_gain_and_why_steps_fell_out(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["check", "--workload", str(write(tmp_path, STEPS)), "--model", "qwen3-moe", "--hidden", "64",
            "--intermediate", "32", "--experts", "8", "--heads", "4", "--ep", "4"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[3] == f"workload: {tmp_path / 'trace.jsonl'}, 4 steps x 2 DP ranks, split policy token"
    assert out[4].startswith("throughput, real tokens of all ranks per second of MoE-layer time: ")
    assert re.search(r" with: speedup \d+\.\d\dx \(2 of 4 steps microbatched\)$", out[4]), out[4]
    assert out[5:9] == [
        "steps microbatched: 2 of 4 (50%); on those steps alone, speedup " + out[5].rsplit(" ", 1)[-1],
        "  fell out: rank_declined in 2 step(s)",
        "    a rank voted no: below_threshold (2 rank-step(s))",
        "  e.g. tokens by rank [64, 8]: rank 1: below_threshold",
    ]
    assert out[-1].startswith("error band: ")


def test_check_prints_no_speedup_when_no_step_microbatched(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    below = [[[[1, 100]] * 4, [[1, 100]] * 2]] * 2  # 2 steps of 4 and 2 decode requests: below the threshold of 32
    argv = ["check", "--workload", str(write(tmp_path, below)), "--model", "qwen3-moe", "--hidden", "64",
            "--intermediate", "32", "--experts", "8", "--heads", "4", "--ep", "4"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[4].endswith(" M without DBO; no speedup: none of the 2 steps microbatched, so DBO ran every step serially")
    assert "speedup" not in out[4].split(";")[0] and not re.search(r"\d\.\d\dx", "\n".join(out[4:-1]))
    assert out[5] == "steps microbatched: 0 of 2 (0%)"
