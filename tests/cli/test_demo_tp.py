"""``asyncdbo demo --model llama|qwen3 --tp N``: a dense model tensor-parallel over local ranks,
serial vs DBO, checked against transformers, the speedup printed as a median of N samples; a TP
size the model does not divide over is one error line before any rank starts (exit 2)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from asyncdbo.cli import main  # noqa: E402
from asyncdbo.models.hf.reference import tiny_hf_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("shared_demo_ranks")  # the session's ranks (tests/cli/conftest.py)

QUICK = ["--tokens", "48", "--steps", "2", "--warmup", "0", "--repeats", "2", "--prefill-threshold", "1",
         "--decode-threshold", "1", "-q"]


@pytest.mark.timeout(150)
def test_llama_on_two_tp_ranks_matches_transformers_and_reports_the_speedup(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--model", "llama", "--tp", "2", "--link", "ib400", *QUICK])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tensor-parallel over 2 ranks (4 heads each)" in out
    assert "comm: MODELED LINK ib400 x1000" in out
    assert re.search(r"^  prefill step +\S+ ms +\S+ ms +\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d, N=2\)  \(microbatched\)$", out,
                     re.MULTILINE), out
    assert re.search(r"^  decode step .* N=4\)  \(microbatched\)$", out, re.MULTILINE), out
    assert "outputs serial vs DBO: max |logits diff| = 0 (bitwise equal" in out
    assert "every rank's logits identical" in out
    assert re.search(r"greedy tokens (\d+)/\1 identical \(match", out), out


@pytest.mark.timeout(150)
def test_qwen3_checkpoint_on_four_ranks_sequence_parallel(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    tiny_hf_model("qwen3", seed=2).save_pretrained(tmp_path, max_shard_size="20KB")
    rc = main(["demo", "--model", "qwen3", "--weights", str(tmp_path), "--tp", "4", "--sequence-parallel",
               "--stream-policy", "ubatch", *QUICK])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"weights: {tmp_path}; each rank read its block of" in out
    assert "(2 heads each, sequence-parallel)" in out


def test_a_tp_size_the_heads_do_not_divide_over_is_refused_before_any_rank_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model", "qwen3", "--tp", "3"]) == 2
    assert capsys.readouterr().err == ("asyncdbo demo: error: num_attention_heads (8) does not divide over 3 "
                                       "tensor-parallel ranks; use a TP size that divides 8\n")
