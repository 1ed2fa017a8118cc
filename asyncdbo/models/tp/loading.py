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

from ..hf.checkpoint import INDEX, SINGLE, LoadReport, read_config, shard_map
from .arch import dense_architecture_for
from .model import TPDenseModel

__all__ = ["load_tp_checkpoint", "tp_from_hf_model"]


def tp_from_hf_model(hf_model: Any, **kwargs: Any) -> TPDenseModel:
    """This rank's :class:`TPDenseModel` with its blocks of an in-memory transformers Llama or
    Qwen3 (``kwargs`` go to the model; with TP size > 1 every rank calls it at the same time)."""
    model = TPDenseModel(dense_architecture_for(hf_model.config), **kwargs)
    where = f"the state dict of {type(hf_model).__name__}"
    model.slots.fill_all(hf_model.state_dict().items(), origin=where)
    model.check_loaded(where)
    return model


def load_tp_checkpoint(directory: str | Path, *, model: str | None = None,
                       **kwargs: Any) -> tuple[TPDenseModel, LoadReport]:
    """This rank's :class:`TPDenseModel` from a local checkpoint directory, and what it read.
    ``model``: the architecture the caller expects (``llama``, ``qwen3``), checked against the
    config."""
    from safetensors import safe_open

    path = Path(directory)
    arch = dense_architecture_for(read_config(path))
    if model is not None and arch.name != model:
        raise ValueError(f"{path / 'config.json'}: model_type {arch.model_type!r} is a {arch.name} checkpoint, "
                         f"not {model}; pass --model {arch.name}")
    where = shard_map(path)
    net = TPDenseModel(arch, **kwargs)
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
                if not slots.wants(name):
                    continue
                shard = slots.shards.get(name)
                if shard is None:
                    slots.fill(name, f.get_tensor(name), origin=origin)
                else:
                    part = f.get_slice(name)
                    slots.check_full_shape(name, tuple(part.get_shape()), origin)
                    lo, hi = shard.start, shard.start + shard.count
                    slots.fill_block(name, part[lo:hi] if shard.dim == 0 else part[:, lo:hi], origin=origin)
                taken.append(name)
        read[file] = tuple(taken)
    net.check_loaded(str(path / (INDEX if (path / INDEX).is_file() else SINGLE)))
    return net, LoadReport(directory=str(path), shards=tuple(sorted(per_shard)), read=read)
