"""``asyncdbo demo --model ...`` end to end: a Hugging Face architecture on local ranks, from a
tiny random model or from a checkpoint directory, serial vs DBO, checked against transformers;
bad input is one error line (exit 2), a broken checkpoint is the rank's error line naming the file
and the tensor (exit 1)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from asyncdbo.cli import main  # noqa: E402
from asyncdbo.models.hf.checkpoint import INDEX  # noqa: E402
from asyncdbo.models.hf.reference import tiny_hf_model  # noqa: E402

QUICK = ["--tokens", "48", "--steps", "2", "--warmup", "0", "--prefill-threshold", "1", "--decode-threshold", "1"]
MATCH = re.compile(r"^vs transformers \((\w+) forward, eager fp32, over each request's tokens\): max \|logits diff\| = "
                   r"\S+ serial, \S+ DBO; greedy tokens (\d+)/(\d+) identical \(match, tolerance 0.0001\)$", re.MULTILINE)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "mixtral"
    tiny_hf_model("mixtral", seed=3).save_pretrained(path, max_shard_size="20KB")
    return path


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.usefixtures("shared_demo_ranks")
def test_demo_runs_a_tiny_random_deepseek_v3_and_matches_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--model", "deepseek-v3", *QUICK, "--schedule", "ll", "--loop", "asyncio"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith("asyncdbo demo: deepseek-v3 (DeepseekV3ForCausalLM: 2 layers, hidden 32, vocab 96), 2 ranks "
                          "x 48 prompt tokens + 2 decode steps after 0 warm-up, schedule ll, stream policy role")
    assert "weights: a tiny random DeepseekV3ForCausalLM (seed 0) saved to a temporary checkpoint; each rank read" in out
    assert "routed experts by rank: 0-3 4-7" in out
    assert re.search(r"^  prefill step +\S+ ms +\S+ ms +\S+x  \(microbatched; one step: a single sample\)$", out,
                     re.MULTILINE), out
    assert re.search(r"^  decode step \(median\) +\S+ ms +\S+ ms +\S+x  \(microbatched: all of 2; medians of 2 steps, "
                     r"per-step speedups \d+\.\d\d-\d+\.\d\dx\)$", out, re.MULTILINE), out
    assert "DBO steps: microbatched, every step on every rank" in out
    assert re.search(r"^outputs serial vs DBO: max \|logits diff\| = \S+ \((bitwise equal|match), tolerance 0.0001\)$",
                     out, re.MULTILINE)
    m = MATCH.search(out)
    assert m is not None, out
    assert m[1] == "DeepseekV3ForCausalLM" and m[2] == m[3]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.usefixtures("shared_demo_ranks")
def test_demo_loads_a_checkpoint_directory(capsys: pytest.CaptureFixture[str], mixtral_dir: Path) -> None:
    rc = main(["demo", "--model", "mixtral", "--weights", str(mixtral_dir), *QUICK, "--link", "ib400"])
    out = capsys.readouterr().out
    assert rc == 0, out
    shards = len(list(mixtral_dir.glob("*.safetensors")))
    assert f"weights: {mixtral_dir}; each rank read " in out and f"from {shards} shard(s)" in out
    assert "comm: MODELED LINK ib400 x1000 (the real all-to-all runs" in out
    assert "routed experts by rank: 0-1 2-3" in out
    m = MATCH.search(out)
    assert m is not None and m[1] == "MixtralForCausalLM" and m[2] == m[3], out


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("shared_demo_ranks")
def test_a_broken_checkpoint_fails_with_the_file_and_the_tensor(capsys: pytest.CaptureFixture[str],
                                                                 mixtral_dir: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(mixtral_dir, tmp_path / "broken"))
    index = json.loads((broken / INDEX).read_text())
    del index["weight_map"]["model.layers.1.block_sparse_moe.experts.0.w2.weight"]
    (broken / INDEX).write_text(json.dumps(index))
    assert main(["demo", "--model", "mixtral", "--weights", str(broken), "--ranks", "1", *QUICK]) == 1
    err = capsys.readouterr().err
    assert err.startswith("asyncdbo demo: error: rank 0: ValueError: "
                          f"{broken / INDEX}: no tensor 'model.layers.1.block_sparse_moe.experts.0.w2.weight' (1 of ")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "mixtral", "--ranks", "3"],
         "the model's 4 routed experts do not divide over --ranks 3: each rank owns an equal share; use a divisor of 4"),
        (["--model", "qwen3-moe", "--weights", "/nonexistent/ckpt"],
         "checkpoint directory '/nonexistent/ckpt' does not exist; pass a local directory with config.json and "
         "*.safetensors (nothing is downloaded)"),
        (["--weights", "/nonexistent/ckpt"], "--weights needs --model mixtral, qwen3-moe or deepseek-v3"),
        (["--model", "qwen3-moe", "--launcher", "env"], "--model runs with --launcher local only"),
        (["--model", "qwen3-moe", "--schedule", "fast"], "unknown MoE schedule 'fast'; use one of ('ht', 'll')"),
        (["--model", "qwen3-moe", "--hidden", "64"],
         "--hidden is not used with --model (the sizes come from the model's config.json; prefill then decode is "
         "what every run does); drop it"),
        (["--model", "qwen3-moe", "--link", "pigeon"], "unknown --link 'pigeon'; use one of ('none', 'nvlink', 'ib400', 'eth100')"),
    ],
)
def test_bad_flags_give_one_error_line_and_exit_2(capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    assert main(["demo", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"asyncdbo demo: error: {message}\n"


def test_a_checkpoint_of_another_architecture_is_refused_before_any_rank_starts(
        capsys: pytest.CaptureFixture[str], mixtral_dir: Path) -> None:
    assert main(["demo", "--model", "qwen3-moe", "--weights", str(mixtral_dir)]) == 2
    assert capsys.readouterr().err == (f"asyncdbo demo: error: {mixtral_dir}/config.json: model_type 'mixtral' is a "
                                       "mixtral checkpoint, not qwen3-moe; pass --model mixtral\n")


def test_threshold_hints_name_the_steps_below_a_threshold_and_the_value_that_reaches_them() -> None:
    from asyncdbo.cli.demo_hf import threshold_hints
    from asyncdbo.plan import PlanReason, RankVote, StepRecord

    def rec(step: int, split: bool, reason: PlanReason, tokens: tuple[int, ...], *votes: RankVote) -> StepRecord:
        return StepRecord(step=step, microbatched=split, reason=reason, ubatch_num_tokens=tokens, ranks=votes)

    def vote(rank: int, reason: PlanReason, n: int) -> RankVote:
        return RankVote(rank=rank, vote="yes" if reason is PlanReason.MICROBATCHED else "no" if n else "idle",
                        reason=reason, num_tokens_unpadded=n, num_tokens_padded=n)

    ok, below = PlanReason.MICROBATCHED, PlanReason.BELOW_THRESHOLD
    # Two ranks: the prefill split; decode step 1 fell back (rank 0 below with 3 tokens, rank 1
    # below with 2), decode step 2 fell back for another reason (not a threshold's doing).
    prefill = (vote(0, ok, 40), vote(1, ok, 24))
    step1 = (vote(0, below, 3), vote(1, below, 2))
    step2 = (vote(0, PlanReason.POLICY_REFUSED, 1), vote(1, PlanReason.DISABLED, 1))
    by_rank = [[rec(0, True, ok, (20, 20), *prefill), rec(1, False, PlanReason.RANK_DECLINED, (3,), *step1),
                rec(2, False, PlanReason.RANK_DECLINED, (1,), *step2)],
               [rec(0, True, ok, (12, 12), *prefill), rec(1, False, PlanReason.RANK_DECLINED, (2,), *step1),
                rec(2, False, PlanReason.RANK_DECLINED, (1,), *step2)]]
    assert threshold_hints(by_rank, prefill_threshold=16, decode_threshold=32) == [
        "1 of 2 decode steps ran unsplit, below the threshold: a rank splits a decode batch from 32 tokens up "
        "(--decode-threshold 32), and the ranks with requests had 2 to 3 tokens; --decode-threshold 2 would split "
        "them",
        "(the thresholds' defaults are vLLM's, for a real engine's batches: measure where DBO pays before lowering "
        "them, docs/integration.md, section 5)"]
    # One rank, no votes: its own records; the prefill of 48 tokens below 512 too.
    alone = [[rec(0, False, below, (48,)), rec(1, False, below, (3,)), rec(2, True, ok, (2, 1))]]
    hints = threshold_hints(alone, prefill_threshold=512, decode_threshold=32)
    assert [h.split(";")[0] for h in hints[:-1]] == [
        "1 of 1 prefill step ran unsplit, below the threshold: a rank splits a prefill batch from 512 tokens up "
        "(--prefill-threshold 512), and the ranks with requests had 48 tokens",
        "1 of 2 decode steps ran unsplit, below the threshold: a rank splits a decode batch from 32 tokens up "
        "(--decode-threshold 32), and the ranks with requests had 3 tokens"]
    assert threshold_hints(alone, prefill_threshold=1, decode_threshold=1) != []  # the records decide, not the flags
    assert threshold_hints([[rec(0, True, ok, (2, 2))]], prefill_threshold=1, decode_threshold=1) == []


def test_why_unsplit_says_each_reason_once_in_words_with_plurals() -> None:
    from asyncdbo.cli.reasons import plural, why_unsplit
    from asyncdbo.plan import PlanReason, StepRecord

    recs = [StepRecord(step=i, microbatched=False, reason=r, ubatch_num_tokens=(3,))
            for i, r in enumerate([PlanReason.IMBALANCE, PlanReason.IMBALANCE, PlanReason.AUTO_OFF])]
    assert why_unsplit(recs) == [
        '1 step: tuning="auto" measured (or, before measuring, its prior says) DBO is slower on this batch size',
        "2 steps: the busy DP ranks' token counts differed more than the allowed ratio (max_imbalance)"]
    assert why_unsplit(recs, skip=["imbalance", "auto_off"]) == []
    assert (plural(1, "layer"), plural(2, "layer"), plural(0, "token")) == ("1 layer", "2 layers", "0 tokens")


def test_weights_too_large_for_the_memory_are_refused_before_any_rank_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-30B-A3B at its released width, 2 layers: only its config.json is written (the check
    reads nothing else), and 8 GiB is all this machine has."""
    from asyncdbo.cli import inputs
    from asyncdbo.models.hf.real_dims import real_config

    real_config("qwen3-moe", layers=2).save_pretrained(tmp_path)
    monkeypatch.setattr(inputs, "available_bytes", lambda: 8 * 2**30)
    monkeypatch.setattr(inputs, "process_limits", lambda: [])
    assert main(["demo", "--model", "qwen3-moe", "--weights", str(tmp_path), "--tokens", "512", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncdbo demo: error: --model qwen3-moe with these weights on 2 rank(s) at --tokens 512 "
                          "needs about 12.3 GiB (estimated from its config.json before any rank starts: 2 rank(s) x "
                          "6.14 GiB = 12.27 GiB (per rank: weights 4.71 GiB, "), err
    assert err.endswith("after the ranks, 7.0 GiB for transformers' float32 reference model in this process), but "
                        "8.0 GiB is available; no --tokens fits, the weights dominate: use more --ranks (each holds "
                        "fewer experts), a machine with more memory, or a checkpoint with fewer layers "
                        "(asyncdbo.models.hf.real_dims.real_config(..., layers=N) and write_random_checkpoint)\n"), err
    # where the tokens are what does not fit, the largest --tokens that does
    monkeypatch.setattr(inputs, "available_bytes", lambda: 13 * 2**30)
    assert main(["demo", "--model", "qwen3-moe", "--weights", str(tmp_path), "--tokens", "8192", "-q"]) == 2
    assert re.search(r"but 13\.0 GiB is available; use --tokens \d+ or fewer\n$", capsys.readouterr().err)
