"""The supported architectures at their released width, truncated in depth, and random checkpoints
of them written locally in the Hub layout (nothing is downloaded).

:func:`real_config` gives the transformers config of Qwen3-30B-A3B, Mixtral-8x7B or DeepSeek-V3
with the released hidden size, attention heads and KV heads (MLA ranks for DeepSeek-V3),
experts, top-k, shared experts, intermediate sizes, vocabulary, norms and RoPE (the values of
each model's ``config.json`` on the Hub, in :data:`RELEASED`), and ``layers`` decoder layers
instead of 48, 32 or 61.  ``experts`` cuts the routed experts (DeepSeek-V3's 256 are about 22.5 GB
of bf16 per MoE layer); the expert GEMM shapes, top-k and groups stay.

:func:`write_random_checkpoint` writes such a config as a sharded safetensors checkpoint in the
Hub layout: ``config.json``, ``model-0000i-of-0000n.safetensors`` shards and
``model.safetensors.index.json``, one tensor per expert, the tensor names, shapes and dtypes
being those transformers gives the architecture (:func:`checkpoint_tensors`; a bf16 model keeps
DeepSeek-V3's router and correction bias in float32, as the released bf16 conversions do).  The
shards are written one tensor at a time, so writing needs about the largest tensor in memory,
not a shard.  Values: RMSNorm weights 1, biases and the correction bias 0; every other tensor of
up to :data:`DRAWN_MAX` values is drawn from a seeded normal of std ``initializer_range`` (what
transformers initialises with); a larger one is cut, at a seeded random offset, from one seeded
pool of :data:`POOL_SIZE` such draws, since drawing each of the billions of values of a real-width
checkpoint takes minutes on a small CPU (``torch.empty(2**28, dtype=torch.bfloat16).normal_()``
took 11 s on the shared 2-core machine of the benchmark results: 24 M values/s).  The values only have to be finite and of the right scale: what is measured
with them is time and memory, and the routers, whose values decide the routing, are drawn in full.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .registry import architecture

__all__ = ["DRAWN_MAX", "POOL_SIZE", "RELEASED", "TensorSpec", "checkpoint_tensors", "real_config",
           "write_random_checkpoint"]

#: The released configs (``config.json`` on the Hub) of each architecture's reference model, as
#: transformers 5 names the fields; ``num_hidden_layers`` is what :func:`real_config` truncates.
RELEASED: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-30B-A3B: 48 layers, every one MoE (decoder_sparse_step 1, mlp_only_layers []).
    "qwen3-moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False, attention_bias=False,
        initializer_range=0.02, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # mistralai/Mixtral-8x7B-v0.1: 32 layers, 8 experts top-2, no sliding window.
    "mixtral": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_local_experts=8, num_experts_per_tok=2,
        rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=False, sliding_window=None,
        initializer_range=0.02, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # deepseek-ai/DeepSeek-V3: 61 layers, the first 3 dense, 256 routed experts in 8 groups
    # (4 kept), top-8, 1 shared expert, MLA with q_lora_rank 1536 and kv_lora_rank 512, yarn x40.
    "deepseek-v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=163840,
        tie_word_embeddings=False, attention_bias=False, initializer_range=0.02,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "beta_fast": 32, "beta_slow": 1},
    ),
}

#: The config field holding each architecture's routed-expert count.
EXPERTS_FIELD = {"qwen3-moe": "num_experts", "mixtral": "num_local_experts", "deepseek-v3": "n_routed_experts"}

#: Tensors of up to this many values are drawn in full; larger ones are cut from the pool.
DRAWN_MAX = 1 << 22
#: Values in the seeded pool the large tensors are cut from.
POOL_SIZE = 1 << 24

_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def real_config(name: str, *, layers: int, experts: int | None = None, **overrides: Any) -> Any:
    """The transformers config of ``name`` at its released width with ``layers`` decoder layers
    (module docstring); ``experts`` cuts the routed experts; ``overrides`` change any other field
    (tests write checkpoints of the same structure at a small width).  DeepSeek-V3 keeps its first
    3 layers dense but always leaves at least one MoE layer."""
    arch = architecture(name)  # unknown names: the registry's message
    if layers < 1:
        raise ValueError(f"layers must be >= 1 (got {layers})")
    kw = {**RELEASED[name], "num_hidden_layers": layers}
    if name == "deepseek-v3":
        kw["first_k_dense_replace"] = min(kw["first_k_dense_replace"], layers - 1)
    if experts is not None:
        released = RELEASED[name][EXPERTS_FIELD[name]]
        if not 1 <= experts <= released:
            raise ValueError(f"experts={experts}: {name} has {released} routed experts; cut to between 1 and {released}")
        kw[EXPERTS_FIELD[name]] = experts
    kw.update(overrides)
    _check_routing(name, kw)
    from transformers import AutoConfig

    config = AutoConfig.for_model(arch.model_type, **kw)
    arch(config)  # what the model does not implement: the architecture's own ValueError
    return config


def _check_routing(name: str, kw: dict[str, Any]) -> None:
    experts, top_k = kw[EXPERTS_FIELD[name]], kw["num_experts_per_tok"]
    if top_k > experts:
        raise ValueError(f"{name}: top-{top_k} routing needs at least {top_k} experts (got {experts})")
    if name == "deepseek-v3":
        groups, kept = kw["n_group"], kw["topk_group"]
        if experts % groups or (experts // groups) * kept < top_k or experts // groups < 2:
            raise ValueError(
                f"deepseek-v3: {experts} experts in {groups} groups ({kept} kept, each scored by its top 2) cannot "
                f"give top-{top_k}; use a multiple of {groups} with at least {max(2, math.ceil(top_k / kept))} "
                f"per group, e.g. {groups * max(2, math.ceil(top_k / kept))}"
            )


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint: its Hub name, shape and dtype on disk."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def checkpoint_tensors(config: Any, dtype: torch.dtype = torch.bfloat16) -> list[TensorSpec]:
    """Every tensor of a checkpoint of ``config`` saved in ``dtype``, in the Hub layout: the
    names, shapes and dtypes of transformers' model for the config (built on the meta device,
    no memory), fused experts split one tensor per expert (:func:`~asyncdbo.models.hf.hub_layout`)."""
    from transformers import AutoModelForCausalLM

    from .model import hub_layout
    from .registry import architecture_for

    arch = architecture_for(config)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = hf_model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in hub_layout(arch, state)
            if not (tied and name == "lm_head.weight")]


def _fill(spec: TensorSpec, gen: torch.Generator, pool: torch.Tensor, std: float, drawn_max: int) -> torch.Tensor:
    """The values of one tensor (module docstring)."""
    n = math.prod(spec.shape)
    if spec.name.endswith("norm.weight"):
        return torch.ones(spec.shape, dtype=spec.dtype)
    if spec.name.endswith((".bias", "e_score_correction_bias")):
        return torch.zeros(spec.shape, dtype=spec.dtype)
    if n <= drawn_max:
        return (torch.randn(spec.shape, generator=gen) * std).to(spec.dtype)
    out = torch.empty(n, dtype=spec.dtype)
    pos, off = 0, int(torch.randint(0, pool.numel(), (1,), generator=gen))
    while pos < n:
        take = min(n - pos, pool.numel() - off)
        out[pos: pos + take] = pool[off: off + take]
        pos, off = pos + take, 0
    return out.view(spec.shape)


def _shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors grouped into shards of at most ``max_shard_bytes`` (a larger tensor
    gets a shard of its own), as ``save_pretrained`` groups them."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_random_checkpoint(config: Any, directory: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                            seed: int = 0, max_shard_bytes: int = 2 << 30, drawn_max: int = DRAWN_MAX) -> list[TensorSpec]:
    """Write a random checkpoint of ``config`` into ``directory`` (created; it must not hold a
    checkpoint yet) in the Hub layout (module docstring), and return its tensors.  Tensors of
    more than ``drawn_max`` values are cut from the seeded pool."""
    if dtype not in _SAFETENSORS_DTYPE:
        raise ValueError(f"dtype {dtype} is not one a checkpoint is saved in; use torch.bfloat16, float16 or float32")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1 (got {max_shard_bytes})")
    path = Path(directory)
    if (path / "config.json").exists():
        raise ValueError(f"{path / 'config.json'} already exists; give an empty or new directory")
    path.mkdir(parents=True, exist_ok=True)
    specs = checkpoint_tensors(config, dtype)
    shards = _shards(specs, max_shard_bytes)
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(config, "initializer_range", 0.02))
    pool = (torch.randn(POOL_SIZE, generator=gen) * std).to(dtype)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(path / file, shard, lambda s: _fill(s, gen, pool.to(s.dtype), std, drawn_max))
        weight_map.update({s.name: file for s in shard})
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.dtype = dtype
    config.save_pretrained(str(path))
    return specs


def _write_shard(file: Path, specs: list[TensorSpec], values: Any) -> None:
    """One safetensors file, streamed: the header (8-byte length, JSON, space-padded to 8 bytes),
    then each tensor's bytes as it is made."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": _SAFETENSORS_DTYPE[s.dtype], "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for s in specs:
            t = values(s).contiguous()
            assert tuple(t.shape) == s.shape and t.dtype == s.dtype, (s, t.shape, t.dtype)
            f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
