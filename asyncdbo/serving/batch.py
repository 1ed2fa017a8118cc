"""One step's inputs on one rank, and the block allocator that builds them against a KV cache."""

# Shape legend: T = tokens (real), R = requests, B = max blocks per request.

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..plan import AttentionMetadata
from .kv_cache import KVCacheConfig

__all__ = ["Batch", "BatchBuilder"]


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One step's inputs on one rank: token ids and positions ``[T]`` plus attention metadata."""

    input_ids_T: torch.Tensor
    positions_T: torch.Tensor
    attn: AttentionMetadata

    def __post_init__(self) -> None:
        n = self.attn.num_actual_tokens
        if self.input_ids_T.shape != (n,) or self.positions_T.shape != (n,):
            raise ValueError(
                f"input_ids {tuple(self.input_ids_T.shape)} and positions {tuple(self.positions_T.shape)} "
                f"must both have shape ({n},), one entry per token of the attention metadata"
            )

    @property
    def num_tokens(self) -> int:
        return self.attn.num_actual_tokens


class BatchBuilder:
    """Block allocation and batch assembly for one rank's KV cache.

    ``add(request_id, token_ids)`` appends new tokens to a request (a prefill chunk, or one decode
    token); the builder keeps how many tokens each request already has in the cache, so a later
    chunk attends over the earlier ones.  Blocks are handed out in order and never freed (demo and
    test workloads fit the cache; :meth:`reset` starts over).
    """

    def __init__(self, cache_cfg: KVCacheConfig, *, device: torch.device | str = "cpu") -> None:
        self.cache_cfg = cache_cfg
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        self._next_block = 0
        self.blocks: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def _ensure_blocks(self, request_id: int, num_tokens: int) -> list[int]:
        blocks = self.blocks.setdefault(request_id, [])
        needed = -(-num_tokens // self.cache_cfg.block_size)
        while len(blocks) < needed:
            assert self._next_block < self.cache_cfg.num_blocks, "build() checks the capacity first"
            blocks.append(self._next_block)
            self._next_block += 1
        return blocks

    def build(self, chunks: Sequence[tuple[int, Sequence[int]]]) -> Batch:
        """A batch with one entry per ``(request_id, new_token_ids)``; each request's new tokens
        follow its tokens of earlier steps.  An empty ``chunks`` is an idle rank's batch."""
        bs = self.cache_cfg.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        seq_lens: list[int] = []
        rows: list[list[int]] = []
        # Check everything before changing any state, so a refused batch leaves the builder as it was.
        seen: set[int] = set()
        new_blocks = 0
        for rid, tokens in chunks:
            if rid in seen:
                raise ValueError(f"request {rid} appears twice in one batch; pass its tokens as one chunk")
            seen.add(rid)
            have = len(self.blocks.get(rid, ()))
            new_blocks += max(0, -(-(self.num_computed.get(rid, 0) + len(tokens)) // bs) - have)
        if self._next_block + new_blocks > self.cache_cfg.num_blocks:
            raise ValueError(
                f"the KV cache is full ({self.cache_cfg.num_blocks} blocks of {bs}); "
                f"raise MiniConfig.num_kv_blocks or use fewer/shorter requests"
            )
        for rid, tokens in chunks:
            start = self.num_computed.get(rid, 0)
            end = start + len(tokens)
            blocks = self._ensure_blocks(rid, end)
            ids.extend(int(t) for t in tokens)
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            qlens.append(len(tokens))
            seq_lens.append(end)
            rows.append(blocks)
            self.num_computed[rid] = end
        width = max((len(r) for r in rows), default=0)
        table_RB = torch.zeros(len(rows), max(width, 1), dtype=torch.int32)
        for r, blocks in enumerate(rows):
            table_RB[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        attn = AttentionMetadata.from_lengths(
            qlens, seq_lens, table_RB, torch.tensor(slots, dtype=torch.int64), device=self.device
        )
        return Batch(
            input_ids_T=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions_T=torch.tensor(positions, dtype=torch.int64, device=self.device),
            attn=attn,
        )
