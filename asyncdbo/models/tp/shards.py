"""Which part of each checkpoint tensor a tensor-parallel rank holds, and the weight slots that
take only that part.

Megatron's split, as vLLM and TokenWeave run it: column-parallel projections (q/k/v, gate/up)
keep a block of output rows, row-parallel ones (o, down) the matching block of input columns,
the embedding and the LM head a block of vocabulary rows; norms are replicated.  A rank's slot
for a sharded tensor is registered with the full tensor's shape and its block
(:class:`ShardedSlots`): a loader reads only those rows or columns from a safetensors file, and
an in-memory state dict is cut to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..hf.common import WeightSlots

__all__ = ["Shard", "ShardedSlots", "check_tp_size", "kv_head_range", "shard_range"]


def shard_range(n: int, size: int, rank: int, what: str) -> tuple[int, int]:
    """``(start, count)`` of rank ``rank``'s equal block of ``n`` items over ``size`` ranks."""
    if n % size:
        raise ValueError(f"{what} ({n}) does not divide over {size} tensor-parallel ranks; use a TP size that "
                         f"divides {n}")
    count = n // size
    return rank * count, count


def kv_head_range(kv_heads: int, heads: int, size: int, rank: int) -> tuple[int, int]:
    """``(first, count)`` of the KV heads rank ``rank`` keeps: its block when the KV heads divide
    over the ranks, else (more ranks than KV heads) the one KV head its query heads read, kept on
    every rank whose query heads read it (vLLM's replication)."""
    if kv_heads >= size:
        return shard_range(kv_heads, size, rank, "num_key_value_heads")
    if size % kv_heads:
        raise ValueError(f"{size} tensor-parallel ranks cannot share {kv_heads} KV heads: with more ranks than KV "
                         f"heads the ranks must be a multiple of them; use a TP size that divides or is a multiple "
                         f"of {kv_heads}")
    first_q, _ = shard_range(heads, size, rank, "num_attention_heads")
    return first_q // (heads // kv_heads), 1


@dataclass(frozen=True)
class Shard:
    """This rank's block of a checkpoint tensor: ``count`` entries from ``start`` along ``dim``
    of a tensor of ``full_shape``."""

    full_shape: tuple[int, ...]
    dim: int
    start: int
    count: int

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(self.dim, self.start, self.count)


class ShardedSlots(WeightSlots):
    """:class:`WeightSlots` whose sharded slots take their block of the full tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.shards: dict[str, Shard] = {}

    def new_shard(self, name: str, full_shape: tuple[int, ...], dim: int, start: int, count: int, *,
                  dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Register a slot for block ``[start, start + count)`` along ``dim`` of ``name``."""
        shape = list(full_shape)
        shape[dim] = count
        self.shards[name] = Shard(tuple(full_shape), dim, start, count)
        return self.new(name, *shape, dtype=dtype, device=device)

    def fill(self, name: str, value: torch.Tensor, *, origin: str) -> bool:
        """Fill from the full tensor (cut to this rank's block) or, unsharded, as it is."""
        shard = self.shards.get(name)
        if shard is None or not self.wants(name):
            return super().fill(name, value, origin=origin)
        self.check_full_shape(name, tuple(value.shape), origin)
        return super().fill(name, shard.cut(value), origin=origin)

    def fill_block(self, name: str, block: torch.Tensor, *, origin: str) -> bool:
        """Fill a sharded slot from its block alone (a loader read just those rows or columns)."""
        return super().fill(name, block, origin=origin)

    def check_full_shape(self, name: str, shape: tuple[int, ...], origin: str) -> None:
        full = self.shards[name].full_shape
        if shape != full:
            raise ValueError(f"{origin}: tensor {name!r} has shape {shape}, but the model built from the config "
                             f"expects {full}; the checkpoint does not match its config.json")


def check_tp_size(hf_config: object, size: int) -> None:
    """Raise the ValueError a rank would raise building the model on ``size`` TP ranks (before
    any rank starts)."""
    hf: Any = hf_config
    heads, kv_heads = int(hf.num_attention_heads), int(hf.num_key_value_heads)
    shard_range(heads, size, 0, "num_attention_heads")
    kv_head_range(kv_heads, heads, size, 0)
    shard_range(int(hf.intermediate_size), size, 0, "intermediate_size")
    shard_range(int(hf.vocab_size), size, 0, "vocab_size")
