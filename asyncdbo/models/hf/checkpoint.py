"""Load a local Hugging Face checkpoint directory onto this rank: ``config.json`` plus safetensors
(one ``model.safetensors``, or shards listed in ``model.safetensors.index.json``).

Nothing is downloaded: the directory must already hold the files.  The model is built from the
config first, so it knows exactly which tensors this rank needs (every replicated tensor, and the
routed experts this rank owns); then each shard is opened once, in order, and only the tensors
with a slot on this rank are read from it (safetensors reads a tensor without reading the rest of
the file), in blocks of rows of at most ``READ_BLOCK_BYTES``: a rank never holds a second copy of
a large tensor beside its slot.  Another rank's experts are never read.  Expert tensors stored fused (transformers 5's
in-memory layout, ``experts.gate_up_proj``) are read as row slices of this rank's experts.

Every failure names the file and the tensor: no config.json, an index that points at a missing
shard, a tensor the config needs that no shard holds, or one whose shape disagrees with the config.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .model import FUSED_EXPERTS, HFMoEModel
from .registry import architecture_for

__all__ = ["LoadReport", "load_checkpoint", "read_config", "shard_map"]

INDEX = "model.safetensors.index.json"
#: A tensor is read in blocks of rows of about this size: the loader never holds a whole large
#: tensor beside the slot it fills (see WeightSlots.fill_rows).
READ_BLOCK_BYTES = 64 << 20
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class LoadReport:
    """What one rank read: the shards it opened, in order, and the tensors it took from each."""

    directory: str
    shards: tuple[str, ...]
    read: dict[str, tuple[str, ...]]  # shard file name -> tensor names read from it

    @property
    def tensors_read(self) -> tuple[str, ...]:
        return tuple(name for shard in self.shards for name in self.read.get(shard, ()))


def read_config(directory: str | Path) -> Any:
    """The transformers config of a local checkpoint directory (offline)."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {str(path)!r} does not exist; pass a local directory with config.json "
                         "and *.safetensors (nothing is downloaded)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{config_file}: no config.json in the checkpoint directory; a Hugging Face checkpoint "
                         "has config.json next to its safetensors files")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds (JSON, validation, unknown model_type)
        raise ValueError(f"{config_file}: not a config transformers can read ({exc})") from exc


def shard_map(directory: str | Path) -> dict[str, str]:
    """Tensor name -> the safetensors file (name inside ``directory``) that holds it."""
    path = Path(directory)
    index = path / INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        for name, file in weight_map.items():
            if not (path / file).is_file():
                raise ValueError(f"{index}: tensor {name!r} is in shard {file}, which is not in {path}")
        return weight_map
    if (path / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(path / SINGLE), framework="pt") as f:
            return {name: SINGLE for name in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    raise ValueError(f"{path}: neither {SINGLE} nor {INDEX}; only safetensors checkpoints are read")


def load_checkpoint(directory: str | Path, *, model: str | None = None, **kwargs: Any) -> tuple[HFMoEModel, LoadReport]:
    """This rank's :class:`HFMoEModel` from a local checkpoint directory (module docstring), and
    what it read.  ``model``: the architecture the caller expects (``mixtral``, ``qwen3-moe``,
    ``deepseek-v3``), checked against the config.  ``kwargs`` go to :class:`HFMoEModel`; with EP
    size > 1 every rank calls it at the same time."""
    from safetensors import safe_open

    path = Path(directory)
    arch = architecture_for(read_config(path))
    if model is not None and arch.name != model:
        raise ValueError(f"{path / 'config.json'}: model_type {arch.model_type!r} is a {arch.name} checkpoint, "
                         f"not {model}; pass --model {arch.name}")
    where = shard_map(path)
    net = HFMoEModel(arch, **kwargs)
    per_shard: dict[str, list[str]] = defaultdict(list)
    for name, file in where.items():
        per_shard[file].append(name)
    read: dict[str, tuple[str, ...]] = {}
    for file in sorted(per_shard):
        taken: list[str] = []
        with safe_open(str(path / file), framework="pt") as f:
            held = set(f.keys())  # noqa: SIM118 - safe_open is not a dict
            for name in per_shard[file]:
                if name not in held:
                    raise ValueError(f"{path / file}: no tensor {name!r}, though {INDEX} lists it in this shard")
                hub = arch.hub_name(name)
                if net.slots.wants(hub):
                    tensor_slice = f.get_slice(name)
                    shape = tuple(tensor_slice.get_shape())
                    if not shape:
                        net.slots.fill(hub, f.get_tensor(name), origin=str(path / file))
                    else:
                        row_bytes = math.prod(shape[1:]) * 4  # at most 4 bytes a value (float32)
                        net.slots.fill_rows(hub, shape, _rows_of(tensor_slice), origin=str(path / file),
                                            block_rows=READ_BLOCK_BYTES // max(1, row_bytes))
                    taken.append(name)
                elif FUSED_EXPERTS.match(hub) and read_fused_experts(net, arch, hub, f.get_slice(name), origin=str(path / file)):
                    taken.append(name)
        read[file] = tuple(taken)
    net.check_loaded(str(path / (INDEX if (path / INDEX).is_file() else SINGLE)))
    return net, LoadReport(directory=str(path), shards=tuple(sorted(per_shard)), read=read)


def _rows_of(tensor_slice: Any) -> Callable[[int, int], Any]:
    """Rows ``a:b`` of a safetensors slice, read from the file."""
    return lambda a, b: tensor_slice[a:b]


def read_fused_experts(net: HFMoEModel, arch: Any, hub: str, tensor_slice: Any, *, origin: str) -> bool:
    """Fill this rank's experts from a fused expert tensor, reading only their rows (the MoE and the
    TP loaders share it: False when this rank owns none of the tensor's experts)."""
    m = FUSED_EXPERTS.match(hub)
    assert m is not None
    g, u, d = arch.expert_names
    prefix, which = m["prefix"], m["which"]
    owned = [e for e in range(tensor_slice.get_shape()[0])
             if net.slots.wants(f"{prefix}.{e}.{d if which == 'down_proj' else g}.weight")]
    if not owned:
        return False
    lo, hi = owned[0], owned[-1] + 1
    rows = tensor_slice[lo:hi]
    for expert in range(lo, hi):
        t = rows[expert - lo]
        if which == "down_proj":
            net.slots.fill(f"{prefix}.{expert}.{d}.weight", t, origin=origin)
        else:
            half = t.shape[0] // 2
            net.slots.fill(f"{prefix}.{expert}.{g}.weight", t[:half], origin=origin)
            net.slots.fill(f"{prefix}.{expert}.{u}.weight", t[half:], origin=origin)
    return True
