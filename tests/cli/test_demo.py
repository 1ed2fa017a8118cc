"""``asyncdbo demo`` end to end: it runs on its ranks (here the session's, through the demo's
one seam: tests/cli/conftest.py; under torchrun, its own), prints the table, checks the outputs
are bitwise equal (deterministic mode, the CPU default), writes a trace, says why a step did not
microbatch, and turns bad flags into one error line with exit status 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncdbo.cli import main
from asyncdbo.cli.demo import DemoConfig, demo_rank, passed, summarize
from asyncdbo.testing import RankPool

SMALL = ["--hidden", "64", "--layers", "1", "--experts", "4", "--steps", "2", "--warmup", "1"]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("shared_demo_ranks")
def test_demo_prints_the_table_on_a_modeled_link_and_writes_a_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["demo", *SMALL, "--tokens", "512", "--schedule", "ll", "--stream-policy", "ubatch",
               "--link", "ib400", "--loop", "asyncio", "--trace", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith(
        "asyncdbo demo: 2 ranks x 512 tokens (prefill), 1 layer, 4 experts top-2, hidden 64, schedule ll, "
        "stream policy ubatch, 2 ubatches, loop asyncio, 2 steps after 1 warm-up\n"
        "comm: MODELED LINK ib400 x1000 (10000 us + 50 MB/s per message;"
    )
    for row in ("step time (median)", "speedup", "time in comm", "comm hidden", "  by the other ubatch",
                "  by its own ubatch", "yields / step", "messages / step"):
        assert re.search(rf"^  {re.escape(row)} ", out, re.MULTILINE), row
    # serial has no other ubatch: none of its comm can be hidden by one
    assert re.search(r"^    by the other ubatch +0% +\d+%  \(DBO microbatched all of 2 steps\)$", out, re.MULTILINE), out
    assert re.search(r"^  speedup +\d+\.\d\dx  \(DBO microbatched all of 2 steps; medians of 2 steps, per-step "
                     r"speedups \d+\.\d\d-\d+\.\d\dx\)$", out, re.MULTILINE), out
    assert "\nspeedup = serial step time / DBO step time (above 1x: DBO is faster)\n" in out
    assert "DBO steps: microbatched, every step on every rank (real tokens per ubatch by rank: [256, 256] [256, 256])" in out
    assert "\noutputs serial vs DBO: max |logits diff| = 0 (bitwise equal; deterministic mode)\n" in out
    # 256 tokens per ubatch, hidden 64: 514 padded rows cost 2.6 ms at 50 MB/s, less than one 10 ms latency
    assert ("\nMoE dispatch, chosen per step from the link model and the schedule: serial fused, DBO fused (fused: the counts ride in "
            "the token message; split: counts, then tokens)\n") in out
    assert re.search(r"^  messages / step +2 +4$", out, re.MULTILINE), out  # 1 layer: dispatch + combine per ubatch
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged.json", "numbers.json", "rank0.json", "rank1.json", "timeline.png"]
    trace = json.loads((tmp_path / "merged.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    numbers = json.loads((tmp_path / "numbers.json").read_text())
    assert numbers["config"]["link"] == "ib400" and numbers["summary"]["max_abs_diff"] <= 1e-4


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("shared_demo_ranks")
def test_demo_decode_on_three_ranks_says_why_it_did_not_microbatch(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", *SMALL, "--ranks", "3", "--experts", "6", "--tokens", "8", "--shape", "decode", "--context", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith("asyncdbo demo: 3 ranks x 8 tokens (decode), 1 layer, 6 experts top-2")
    assert "comm: real gloo all-to-all over loopback" in out
    assert "\nMoE dispatch: split (counts, then tokens); with no link model to price it, never fused\n" in out
    # every rank below its threshold: that is the reason (no rank kept another from overlapping)
    assert ("\nDBO steps: NOT microbatched in any step: every rank's batch was below the threshold: a rank splits a "
            "decode batch from 32 tokens up (--decode-threshold 32), and each rank had 8 tokens; --decode-threshold 8 "
            "would split them\n") in out
    # no step overlapped: no speedup is printed, and the line says why
    note = "(no speedup: none of the 2 DBO steps microbatched (see 'DBO steps' below), DBO ran serially)"
    assert re.search(rf"^  speedup +-  {re.escape(note)}$", out, re.MULTILINE), out
    assert re.search(rf"^    by the other ubatch +0% +0%  {re.escape(note)}$", out, re.MULTILINE), out


def rank_steps(reasons: list[str], serial_s: float, dbo_s: float) -> dict[str, object]:
    """One rank's measured steps as demo_rank returns them: ``reasons`` of its DBO steps."""
    def entry(step_s: float, reason: str) -> dict[str, object]:
        return {"step_s": step_s, "comm_s": 0.01, "hidden_share": 0.5, "hidden_by_other_share": 0.4, "switches": 6,
                "messages": 6, "fused": False, "reason": reason, "detail": "", "ubatch_tokens": [64, 64]}
    return {"serial": [entry(serial_s, "disabled") for _ in reasons], "dbo": [entry(dbo_s, r) for r in reasons],
            "max_abs_diff": 0.0, "bitwise": True, "deterministic": True}


@pytest.mark.parametrize(
    ("reasons", "speedup", "note"),
    [
        (["microbatched"] * 3, "1.25x", "(DBO microbatched all of 3 steps{})"),
        (["microbatched", "rank_declined", "microbatched"], "1.25x", "(DBO microbatched 2 of 3 steps{})"),
        (["rank_declined"] * 3, "-",
         "(no speedup: none of the 3 DBO steps microbatched (see 'DBO steps' below), DBO ran serially)"),
    ],
)
def test_the_speedup_line_says_how_many_steps_microbatched(reasons: list[str], speedup: str, note: str) -> None:
    from asyncdbo.cli.demo import _format

    cfg = DemoConfig(steps=3)
    summary = summarize(cfg, [rank_steps(reasons, 0.125, 0.1), rank_steps(reasons, 0.125, 0.1)])
    out = _format(cfg, summary)
    n = reasons.count("microbatched")
    spread = f"; medians of {n} steps, per-step speedups 1.25-1.25x" if n else ""
    assert re.search(rf"^  speedup +{re.escape(speedup)}  {re.escape(note.format(spread))}$", out, re.MULTILINE), out
    assert re.search(rf"^    by the other ubatch +40% +40%  {re.escape(note.format(''))}$", out, re.MULTILINE), out
    assert summary["microbatched_steps"] == reasons.count("microbatched")
    assert summary["speedup"] == (None if speedup == "-" else 1.25)


TINY = dict(hidden=64, layers=1, experts=4, steps=1, warmup=1)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("shape", "schedule", "stream_policy", "ubatches"),
    [("prefill", "ht", "role", 2), ("prefill", "ll", "ubatch", 4), ("decode", "ll", "role", 3), ("decode", "ht", "ubatch", 4)],
)
def test_the_demo_is_bitwise_equal_on_two_ranks(pool: RankPool, shape: str, schedule: str, stream_policy: str,
                                                 ubatches: int) -> None:
    # The demo's own per-rank function on the session's pool of 2 ranks (tests/conftest.py; the
    # CLI adds only the launcher and the table, tested above); decode with 12 requests of
    # context 8, always split.
    tokens = 300 if shape == "prefill" else 12
    cfg = DemoConfig(ranks=2, tokens=tokens, shape=shape, context=8, schedule=schedule, stream_policy=stream_policy,
                     ubatches=ubatches, prefill_threshold=0, decode_threshold=0, **TINY)  # type: ignore[arg-type]
    summary = summarize(cfg, pool.run(demo_rank, cfg))
    assert [r for r, _ in summary["dbo"]["reasons"]] == ["microbatched"]
    assert summary["deterministic"] and summary["bitwise"], summary["max_abs_diff"]
    assert passed(summary)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("ranks", "shape"), [(1, "prefill"), (4, "decode")])
@pytest.mark.usefixtures("shared_demo_ranks")
def test_the_demo_prints_bitwise_equal_on_one_and_four_ranks(capsys: pytest.CaptureFixture[str], ranks: int, shape: str) -> None:
    rc = main(["demo", "--ranks", str(ranks), "--experts", "4", "--hidden", "64", "--layers", "1", "--steps", "1",
               "--warmup", "1", "--shape", shape, "--tokens", "64" if shape == "prefill" else "8", "--context", "8",
               "--ubatches", "3", "--schedule", "ll", "--stream-policy", "ubatch",
               "--prefill-threshold", "0", "--decode-threshold", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "DBO steps: microbatched, every step on every rank" in out
    assert "\noutputs serial vs DBO: max |logits diff| = 0 (bitwise equal; deterministic mode)\n" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--experts", "9"], "--experts 9 is not divisible by --ranks 2: each rank owns an equal share of experts; use a multiple of 2"),
        (["--top-k", "9"], "top_k (9) exceeds num_experts (8); pick top_k <= num_experts"),
        (["--tokens", "0"], "--tokens 0 gives every rank zero tokens: there is nothing to run; use --tokens >= 1"),
        (["--schedule", "fast"], "unknown MoE schedule 'fast'; use one of ('ht', 'll')"),
        (["--link", "pigeon"], "unknown --link 'pigeon'; use one of ('none', 'nvlink', 'ib400', 'eth100')"),
        (["--shape", "square"], "unknown --shape 'square'; use 'prefill' or 'decode'"),
        (["--deterministic", "maybe"], "unknown --deterministic 'maybe'; use one of ('auto', 'on', 'off')"),
    ],
)
def test_bad_flags_give_one_error_line_and_exit_2(capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    assert main(["demo", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"asyncdbo demo: error: {message}\n"


def test_a_failed_rank_is_reported_by_its_exception_line() -> None:
    from asyncdbo.cli.demo import error_line

    deadlock = (
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n'
        "    await received\n"
        "asyncdbo.DeadlockError: asyncdbo deadlock in run 'step6': every live ubatch waits. Ubatch stacks:\n"
        "ubatch 0: parked, last yield point 'combine_send'\n"
        '  File "layer.py", line 318, in _forward_ll\n'
        "    await received\n"
    )
    assert error_line(deadlock) == (
        "asyncdbo.DeadlockError: asyncdbo deadlock in run 'step6': every live ubatch waits. Ubatch stacks:"
    )
    assert error_line("process died (exit code 3) during demo_rank") == "process died (exit code 3) during demo_rank"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_same_demo_runs_under_torchrun_with_env_rendezvous() -> None:
    """The README's multi-node path: torchrun starts the ranks, env:// joins them (gloo here), the
    steps really microbatch, and every rank leaves cleanly (no abort at interpreter exit, no
    process group left alive by asyncdbo's caches: a RuntimeWarning would say so)."""
    cmd = [  # --standalone: torchrun's store binds port 0 itself (no port picked here and raced for)
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "asyncdbo", "demo", "--launcher", "env", *SMALL, "--tokens", "512", "--link", "ib400",
    ]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="error::RuntimeWarning")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("asyncdbo demo: 2 ranks x 512 tokens (prefill)")
    assert done.stdout.count("step time (median)") == 1  # rank 0 prints, rank 1 does not
    assert "DBO steps: microbatched, every step on every rank (real tokens per ubatch by rank: [256, 256] [256, 256])" in done.stdout
    assert "\noutputs serial vs DBO: max |logits diff| = 0 (bitwise equal; deterministic mode)\n" in done.stdout
    assert "terminate called" not in done.stderr and "RuntimeWarning" not in done.stderr, done.stderr
