"""The architectures at their released width: the configs hold the released sizes, a random
checkpoint written in the Hub layout loads through the normal loader into exactly what is on disk,
the memory estimate's weights and KV cache are the bytes the model allocates, and a run that would
not fit is refused with its estimate before anything is written or any rank starts.

Checkpoints here are written at a small width (the same structure; real widths are what
``benchmarks/real_dims.py`` runs)."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from asyncdbo.models.hf import HFMoEModel, architecture_for  # noqa: E402
from asyncdbo.models.hf.checkpoint import INDEX, load_checkpoint  # noqa: E402
from asyncdbo.models.hf.memory import MemoryEstimate, check_fits, estimate_memory  # noqa: E402
from asyncdbo.models.hf.real_dims import RELEASED, checkpoint_tensors, real_config, write_random_checkpoint  # noqa: E402

#: Small widths of the same structure (heads, KV heads, top-k, groups, shared experts kept).
SMALL: dict[str, dict[str, Any]] = {
    "qwen3-moe": dict(hidden_size=64, moe_intermediate_size=32, vocab_size=128, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=16, num_experts=16),
    "mixtral": dict(hidden_size=64, intermediate_size=48, vocab_size=128, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=16),
    "deepseek-v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, vocab_size=128,
                        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16),
}
NAMES = tuple(SMALL)
GIB = 2**30


def small_config(name: str, layers: int = 2) -> Any:
    return real_config(name, layers=layers, **SMALL[name])


def test_the_configs_have_the_released_sizes_and_the_asked_depth() -> None:
    for name, released in RELEASED.items():
        config = real_config(name, layers=2)
        for key, value in released.items():
            if key not in ("num_hidden_layers", "first_k_dense_replace"):
                assert getattr(config, key) == value, (name, key)
        assert config.num_hidden_layers == 2
    assert real_config("deepseek-v3", layers=2).first_k_dense_replace == 1  # one dense layer, one MoE layer
    assert real_config("deepseek-v3", layers=4).first_k_dense_replace == 3  # as released
    assert real_config("deepseek-v3", layers=2, experts=32).n_routed_experts == 32


def test_a_released_moe_layer_has_the_size_the_issue_quotes() -> None:
    # bf16 bytes of one MoE layer's routed experts: Qwen3-30B-A3B ~1.2 GB, Mixtral-8x7B ~2.8 GB,
    # DeepSeek-V3 ~22.5 GB (which is why its experts are cut for a 24 GiB machine).
    for name, layers, gb in (("qwen3-moe", 1, 1.21), ("mixtral", 1, 2.82), ("deepseek-v3", 2, 22.55)):
        specs = checkpoint_tensors(real_config(name, layers=layers))
        expert_bytes = sum(s.nbytes for s in specs if ".experts." in s.name)
        assert round(expert_bytes / 1e9, 2) == gb, name


def test_bad_cuts_are_refused_with_what_would_work() -> None:
    with pytest.raises(ValueError, match=r"^layers must be >= 1 \(got 0\)$"):
        real_config("mixtral", layers=0)
    with pytest.raises(ValueError, match=r"^experts=300: deepseek-v3 has 256 routed experts; cut to between 1 and 256$"):
        real_config("deepseek-v3", layers=2, experts=300)
    with pytest.raises(ValueError, match=r"^deepseek-v3: 12 experts in 8 groups \(4 kept, each scored by its top 2\) "
                                         r"cannot give top-8; use a multiple of 8 with at least 2 per group, e\.g\. 16$"):
        real_config("deepseek-v3", layers=2, experts=12)
    with pytest.raises(ValueError, match=r"^mixtral: top-2 routing needs at least 2 experts \(got 1\)$"):
        real_config("mixtral", layers=2, experts=1)


@pytest.mark.parametrize("name", NAMES)
def test_a_written_sharded_checkpoint_loads_into_exactly_what_is_on_disk(name: str, tmp_path: Path) -> None:
    config = small_config(name)
    specs = write_random_checkpoint(config, tmp_path, seed=3, max_shard_bytes=16 << 10)
    index = json.loads((tmp_path / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in specs)
    assert sorted(index["weight_map"]) == sorted(s.name for s in specs)
    model, report = load_checkpoint(tmp_path, model=name, dtype=torch.bfloat16)
    assert report.shards == tuple(shards)
    assert sorted(report.tensors_read) == sorted(model.slots.names())  # every slot filled, once
    for file in shards:
        with safe_open(str(tmp_path / file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                on_disk = f.get_tensor(key)
                assert torch.isfinite(on_disk.float()).all(), key
                held = model.slots[architecture_for(config).hub_name(key)]
                assert torch.equal(held, on_disk.to(held.dtype)), key
                if key.endswith("norm.weight"):
                    assert torch.equal(on_disk, torch.ones_like(on_disk)), key
    if name == "deepseek-v3":  # kept in float32, as transformers keeps them
        assert {s.dtype for s in specs if ".gate." in s.name} == {torch.float32}


def test_the_checkpoint_is_the_seeds_and_large_tensors_come_from_the_pool(tmp_path: Path) -> None:
    config = small_config("qwen3-moe")
    write_random_checkpoint(config, tmp_path / "a", seed=1, drawn_max=100)
    write_random_checkpoint(config, tmp_path / "b", seed=1, drawn_max=100)
    write_random_checkpoint(config, tmp_path / "c", seed=2, drawn_max=100)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    shard = "model-00001-of-00001.safetensors"
    with safe_open(str(tmp_path / "a" / shard), framework="pt") as a, safe_open(str(tmp_path / "c" / shard), framework="pt") as c:
        embed_a, embed_c = a.get_tensor("model.embed_tokens.weight"), c.get_tensor("model.embed_tokens.weight")
    assert not torch.equal(embed_a, embed_c)
    assert abs(float(embed_a.float().std()) - config.initializer_range) < 0.002  # the scale transformers draws at
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'a' / 'config.json'} already exists; give an empty or new directory$"):
        write_random_checkpoint(config, tmp_path / "a")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_estimate_has_the_models_parameter_and_kv_cache_bytes(name: str, dtype: torch.dtype) -> None:
    config = small_config(name)
    model = HFMoEModel(architecture_for(config), dtype=dtype, block_size=16, num_kv_blocks=5)
    held = {t.data_ptr(): t.numel() * t.element_size() for t in (model.slots[n] for n in model.slots.names())}
    cache = model.kv_cache
    est = estimate_memory(config, ranks=1, dtype=dtype, num_kv_blocks=5, block_size=16, step_tokens=8, longest_context=8)
    assert est.weights == sum(held.values())
    assert est.kv_cache == sum(t.numel() * t.element_size() for t in (*cache.k_cache_LNZHK, *cache.v_cache_LNZHK))
    experts = sum(s.nbytes // s.dtype.itemsize * dtype.itemsize for s in checkpoint_tensors(config) if ".experts." in s.name)
    est2 = estimate_memory(config, ranks=2, dtype=dtype, num_kv_blocks=5, block_size=16, step_tokens=8, longest_context=8)
    assert est.weights - est2.weights == experts // 2  # each of 2 ranks holds half the routed experts
    assert est2.total == 2 * est2.per_rank


def test_a_run_that_does_not_fit_is_refused_with_its_estimate() -> None:
    est = MemoryEstimate(ranks=2, weights=3 * GIB, kv_cache=GIB // 2, loading=GIB, activations=GIB // 4, base=GIB // 4)
    check_fits(est, 2 * (3 * GIB + GIB // 2 + GIB + GIB // 4), what="x", fix="y")  # exactly fits
    with pytest.raises(ValueError, match=r"^mixtral on 2 ranks needs about 2 rank\(s\) x 4.75 GiB = 9.50 GiB \(per rank: "
                                         r"weights 3.00 GiB, KV cache 0.50 GiB, the larger of loading 1.00 GiB and step "
                                         r"activations 0.25 GiB, process 0.25 GiB\), but 9.00 GiB is available; "
                                         r"use fewer layers$"):
        check_fits(est, 9 * GIB, what="mixtral on 2 ranks", fix="use fewer layers")


def _benchmark() -> Any:
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    # by its own name, on sys.path: the ranks (spawned with this sys.path) unpickle bench_rank from it
    return importlib.import_module("real_dims")


def test_the_benchmark_refuses_before_writing_or_starting_a_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _benchmark()
    ckpt = tmp_path / "ckpts"
    code = bench.main(["--quick", "--model", "mixtral", "--memory-limit", "100MiB", "--ckpt-dir", str(ckpt), "-q"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("real_dims: error: mixtral (2 layers, bf16) on 2 ranks needs about 2 rank(s) x ")
    assert "(per rank: weights " in err and "but 0.10 GiB is available; use fewer --layers, or fewer tokens" in err
    assert "--deepseek-experts" not in err  # a flag of DeepSeek-V3's only
    assert not ckpt.exists()  # nothing written; the ranks start after the checkpoint is
    # the same estimate the message gives, for the same run
    quick = bench.plan(bench.argparse.Namespace(model=["mixtral"], quick=True, layers=2, deepseek_experts=32,
                                                 dtype="bf16", prefill_tokens=16, decode_requests=8, context=16,
                                                 steps=2, warmup=1))
    assert f"needs about {quick[0][2].describe()}" in err
    assert math.isclose(quick[0][2].total, 2 * quick[0][2].per_rank)


def test_a_large_tensor_is_read_in_blocks_of_rows_into_its_slot() -> None:
    from asyncdbo.models.hf.common import WeightSlots

    slots = WeightSlots()
    slot = slots.new("w", 10, 4, dtype=torch.bfloat16, device="cpu")
    source = torch.arange(40, dtype=torch.float32).view(10, 4)
    reads: list[tuple[int, int]] = []

    def read(a: int, b: int) -> torch.Tensor:
        reads.append((a, b))
        return source[a:b]

    assert slots.fill_rows("w", (10, 4), read, origin="f", block_rows=3)
    assert reads == [(0, 3), (3, 6), (6, 9), (9, 10)] and torch.equal(slot, source.to(torch.bfloat16))
    assert slots.missing() == [] and not slots.fill_rows("x", (1,), read, origin="f", block_rows=3)
    with pytest.raises(ValueError, match=r"^f: tensor 'w' has shape \(10, 5\), but the model built from the config "
                                         r"expects \(10, 4\); the checkpoint does not match its config.json$"):
        slots.fill_rows("w", (10, 5), read, origin="f", block_rows=3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_benchmark_adds_each_architecture_to_one_results_file_and_records_a_stopped_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _benchmark()
    md, ckpts = tmp_path / "real_dims.md", tmp_path / "ckpts"
    # a run that stops (here before its ranks start: --reuse finds a checkpoint of other sizes) is
    # in the file with its status and what it knew
    write_random_checkpoint(real_config("mixtral", layers=2, **bench.QUICK["mixtral"]), ckpts / "qwen3-moe", seed=0)
    small = ["--quick", "-q", "--steps", "1", "--warmup", "0", "--prefill-tokens", "2", "--decode-requests", "2",
             "--context", "2", "--results", str(md), "--ckpt-dir", str(ckpts)]
    assert bench.main([*small, "--model", "qwen3-moe", "--reuse", "--keep"]) == 1
    err = capsys.readouterr().err
    assert "real_dims: error: qwen3-moe: --reuse: " in err and "differs from this run's config" in err
    text = md.read_text()
    assert "\n## qwen3-moe\n" in text and "Status: 0 of 4 cases (link x shape) measured; the run stopped: --reuse: " in text
    # a second architecture is added to the same file, the first kept
    assert bench.main([*small, "--model", "mixtral"]) == 0
    capsys.readouterr()
    state = json.loads(md.with_suffix(".json").read_text())
    assert list(state["runs"]) == ["qwen3-moe", "mixtral"] and state["runs"]["qwen3-moe"]["per_rank"] == []
    run = state["runs"]["mixtral"]
    assert (run["status"], run["cases_done"], run["cases_total"]) == ("complete", 4, 4)
    assert [len(pr["rows"]) for pr in run["per_rank"]] == [8, 8]  # 2 links x 2 shapes x 2 modes, 1 timed step
    assert {(r["link"], r["shape"], r["mode"]) for r in run["per_rank"][0]["rows"]} == {
        (link, shape, mode) for link in ("none", "ib400") for shape in bench.SHAPES for mode in bench.MODES}
    text = md.read_text()
    assert text.index("\n## qwen3-moe\n") < text.index("\n## mixtral\n")
    assert "Status: complete, 4 of 4 cases (link x shape) measured." in text
    assert text.count("| ib400 | decode | 1 | 2 | dbo |") == 1
    # a results file of another machine or versions is refused, the file untouched
    state["machine_info"]["torch"] = "0.0"
    md.with_suffix(".json").write_text(json.dumps(state))
    assert bench.main([*small, "--model", "mixtral"]) == 2
    assert "real_dims: error: --results " + str(md) + ": its runs were measured on another machine or versions (torch " \
        "'0.0' there" in capsys.readouterr().err
    assert md.read_text() == text
