"""Filling a :class:`~asyncdbo.models.tp.TPDenseModel`'s slots on one TP rank: from an in-memory
transformers model (each rank cuts its blocks out of the state dict) or from a local checkpoint
directory (``config.json`` plus safetensors, one file or shards with an index), where each rank
reads only its block of each sharded tensor: rows of a column-parallel weight, columns of a
row-parallel one, vocabulary rows of the embedding and the LM head (safetensors reads a slice
without the rest of the tensor).  Every failure names the file and the tensor.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from ..hf.checkpoint import INDEX, SINGLE, LoadReport, read_fused_experts, read_config, shard_map
from ..hf.deepseek_v3 import DeepseekV3
from ..hf.model import FUSED_EXPERTS, hub_layout
from .arch import dense_architecture_for
from .deepseek import TPDeepseekV3
from .model import TPDenseModel

__all__ = ["load_tp_checkpoint", "tp_from_hf_model"]


def _build(hf_config: Any, kwargs: dict[str, Any]) -> tuple[Any, TPDenseModel]:
    """The architecture of a config and this rank's model of it (DeepSeek-V3: TP attention with
    EP MoE layers, :class:`TPDeepseekV3`)."""
    if getattr(hf_config, "model_type", None) == DeepseekV3.model_type:
        arch: Any = DeepseekV3(hf_config)
        return arch, TPDeepseekV3(arch, **kwargs)
    arch = dense_architecture_for(hf_config)
    return arch, TPDenseModel(arch, **kwargs)


def tp_from_hf_model(hf_model: Any, **kwargs: Any) -> TPDenseModel:
    """This rank's :class:`TPDenseModel` with its blocks of an in-memory transformers Llama,
    Qwen3 or DeepSeek-V3 (its own experts only); ``kwargs`` go to the model; with TP size > 1 every
    rank calls it at the same time."""
    arch, model = _build(hf_model.config, kwargs)
    where = f"the state dict of {type(hf_model).__name__}"
    items = hf_model.state_dict().items()
    model.slots.fill_all(hub_layout(arch, dict(items)) if isinstance(arch, DeepseekV3) else items, origin=where)
    model.check_loaded(where)
    return model


def load_tp_checkpoint(directory: str | Path, *, model: str | None = None,
                       **kwargs: Any) -> tuple[TPDenseModel, LoadReport]:
    """This rank's :class:`TPDenseModel` from a local checkpoint directory, and what it read.
    ``model``: the architecture the caller expects (``llama``, ``qwen3``), checked against the
    config."""
    from safetensors import safe_open

    path = Path(directory)
    arch, net = _build(read_config(path), kwargs)
    if model is not None and arch.name != model:
        raise ValueError(f"{path / 'config.json'}: model_type {arch.model_type!r} is a {arch.name} checkpoint, "
                         f"not {model}; pass --model {arch.name}")
    where = shard_map(path)
    slots = net.slots
    per_shard: dict[str, list[str]] = defaultdict(list)
    for name, file in where.items():
        per_shard[file].append(name)
    read: dict[str, tuple[str, ...]] = {}
    for file in sorted(per_shard):
        taken: list[str] = []
        origin = str(path / file)
        with safe_open(origin, framework="pt") as f:
            for name in per_shard[file]:
                name_in_file, name = name, arch.hub_name(name) if isinstance(arch, DeepseekV3) else name
                if not slots.wants(name):
                    if FUSED_EXPERTS.match(name) and read_fused_experts(net, arch, name, f.get_slice(name_in_file),  # type: ignore[arg-type]
                                                                 origin=origin):
                        taken.append(name_in_file)
                    continue
                shard = slots.shards.get(name)
                if shard is None:
                    slots.fill(name, f.get_tensor(name_in_file), origin=origin)
                else:
                    part = f.get_slice(name_in_file)
                    slots.check_full_shape(name, tuple(part.get_shape()), origin)
                    lo, hi = shard.start, shard.start + shard.count
                    slots.fill_block(name, part[lo:hi] if shard.dim == 0 else part[:, lo:hi], origin=origin)
                taken.append(name_in_file)
        read[file] = tuple(taken)
    net.check_loaded(str(path / (INDEX if (path / INDEX).is_file() else SINGLE)))
    return net, LoadReport(directory=str(path), shards=tuple(sorted(per_shard)), read=read)
