"""Checkpoints from disk: a tiny checkpoint written with ``save_pretrained`` loads shard by shard
into exactly the weights of the in-memory model, and every broken checkpoint fails early with the
file and the tensor named.  (That each of 2 ranks reads only its own experts is checked in
test_hf_models.py, which runs the loader on gloo ranks.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from asyncdbo.models.hf import from_hf_model, hub_layout  # noqa: E402
from asyncdbo.models.hf.checkpoint import INDEX, load_checkpoint  # noqa: E402
from asyncdbo.models.hf.reference import tiny_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def qwen() -> Any:
    return tiny_hf_model("qwen3-moe")


@pytest.fixture(scope="module")
def sharded(qwen: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "qwen"
    qwen.save_pretrained(path, max_shard_size="20KB")
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {name: model.slots[name] for name in model.slots.names()}


def test_a_sharded_checkpoint_loads_shard_by_shard_into_the_models_weights(qwen: Any, sharded: Path) -> None:
    model, report = load_checkpoint(sharded, model="qwen3-moe")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1 and report.shards == tuple(shards)  # every shard opened once, in order
    assert sorted(report.tensors_read) == sorted(model.slots.names())  # read what the model needs, once
    expected = _weights(from_hf_model(qwen))
    assert _weights(model).keys() == expected.keys()
    for name, tensor in _weights(model).items():
        assert torch.equal(tensor, expected[name]), name


def test_fused_experts_on_disk_load_like_split_ones(qwen: Any, tmp_path: Path, sharded: Path) -> None:
    # transformers 5's in-memory layout (experts.gate_up_proj / experts.down_proj), saved as is
    (tmp_path / "config.json").write_text((sharded / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in qwen.state_dict().items()}, str(tmp_path / "model.safetensors"))
    model, report = load_checkpoint(tmp_path)
    assert "model.layers.0.mlp.experts.gate_up_proj" in report.tensors_read
    expected = _weights(from_hf_model(qwen))
    for name, tensor in _weights(model).items():
        assert torch.equal(tensor, expected[name]), name


def test_hub_layout_splits_fused_experts_gate_rows_first(qwen: Any) -> None:
    split = dict(hub_layout(from_hf_model(qwen).arch, qwen.state_dict()))
    fused = qwen.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]  # E x 2F x D
    assert torch.equal(split["model.layers.0.mlp.experts.5.gate_proj.weight"], fused[5, :16])
    assert torch.equal(split["model.layers.0.mlp.experts.5.up_proj.weight"], fused[5, 16:])


def test_a_missing_directory_or_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"^checkpoint directory '{tmp_path / 'nope'}' does not exist; pass a local"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'config.json'}: no config.json in the checkpoint directory"):
        load_checkpoint(tmp_path)


def test_a_checkpoint_of_another_architecture_is_refused(sharded: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"^{sharded / 'config.json'}: model_type 'qwen3_moe' is a qwen3-moe "
                                         r"checkpoint, not mixtral; pass --model qwen3-moe$"):
        load_checkpoint(sharded, model="mixtral")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ValueError, match=r"^model_type 'llama' is not supported; supported: mixtral \(MixtralForCausalLM\)"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'config.json'}: not a config transformers can read"):
        load_checkpoint(tmp_path)


def test_a_shard_missing_from_the_directory_is_named_with_a_tensor_in_it(sharded: Path, tmp_path: Path) -> None:
    ckpt = _copy(sharded, tmp_path / "c")
    weight_map = json.loads((ckpt / INDEX).read_text())["weight_map"]
    name, shard = next(iter(sorted(weight_map.items())))
    (ckpt / shard).unlink()
    with pytest.raises(ValueError, match=rf"^{ckpt / INDEX}: tensor '{name}' is in shard {shard}, which is not in {ckpt}$"):
        load_checkpoint(ckpt)


def test_a_tensor_the_config_needs_but_no_shard_holds_is_named(sharded: Path, tmp_path: Path) -> None:
    ckpt = _copy(sharded, tmp_path / "c")
    index = json.loads((ckpt / INDEX).read_text())
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (ckpt / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"^{ckpt / INDEX}: no tensor 'model.layers.1.mlp.down_proj.weight' \(1 of "
                                         r"the \d+ tensors this rank needs are missing: .*\); the checkpoint does not "
                                         r"match its config.json$"):
        load_checkpoint(ckpt)


def test_a_tensor_of_the_wrong_shape_is_named_with_its_file(sharded: Path, tmp_path: Path) -> None:
    ckpt = _copy(sharded, tmp_path / "c")
    name = "model.layers.0.self_attn.q_norm.weight"
    shard = ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = torch.ones(17)
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=rf"^{shard}: tensor '{name}' has shape \(17,\), but the model built from the "
                                         r"config expects \(16,\); the checkpoint does not match its config.json$"):
        load_checkpoint(ckpt)


def test_an_index_entry_its_shard_does_not_hold_is_named(sharded: Path, tmp_path: Path) -> None:
    ckpt = _copy(sharded, tmp_path / "c")
    name = "model.norm.weight"
    shard = ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=rf"^{shard}: no tensor '{name}', though {INDEX} lists it in this shard$"):
        load_checkpoint(ckpt)
