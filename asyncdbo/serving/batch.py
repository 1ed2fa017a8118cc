"""One step's inputs on one rank, and the block allocator that builds them against a KV cache."""

# Shape legend: T = tokens (real), R = requests, B = max blocks per request.

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..plan import AttentionMetadata
from .kv_cache import KVCacheConfig

__all__ = ["Batch", "BatchBuilder", "check_token_ids"]

#: Dtypes an embedding lookup takes as indices (a bool or uint8 tensor would index as a mask).
ID_DTYPES = (torch.int64, torch.int32)


def check_token_ids(ids_T: torch.Tensor, vocab_size: int | None = None, *, what: str = "input_ids") -> None:
    """Token ids must be an int64/int32 tensor and, on the host, lie in ``0 .. vocab_size - 1``.

    Without this, a float id failed deep in the model or was truncated on the way in, and ``-1``
    silently read the embedding's last row (Python indexing from the end). The range of a tensor
    on an accelerator is not read here (its min and max would make every step wait for the
    device); :class:`BatchBuilder` with ``vocab_size`` checks the ids it builds on the host."""
    if not isinstance(ids_T, torch.Tensor):
        raise TypeError(f"{what} must be a tensor of token ids, got {type(ids_T).__name__}; "
                        "build it with torch.tensor(ids, dtype=torch.int64)")
    if ids_T.dtype not in ID_DTYPES:
        raise ValueError(f"{what} must hold token ids as torch.int64 (or torch.int32), got {ids_T.dtype}; "
                         "build it with torch.tensor(ids, dtype=torch.int64)")
    if vocab_size is None or ids_T.device.type != "cpu" or ids_T.numel() == 0:
        return
    if torch.compiler.is_compiling():  # Dynamo cannot break a graph inside a coroutine's body
        return
    bad_T = (ids_T < 0) | (ids_T >= vocab_size)
    if bool(bad_T.any()):
        first = int(bad_T.nonzero()[0, 0]) if ids_T.dim() == 1 else tuple(bad_T.nonzero()[0].tolist())
        raise ValueError(_out_of_vocab(f"{what}[{first}]", int(ids_T[first]), vocab_size))


def _out_of_vocab(where: str, token: int, vocab_size: int) -> str:
    return (f"{where} is {token}, not a token id of a vocabulary of {vocab_size} (0 .. {vocab_size - 1}); "
            "map padding and unknown tokens to a real id (the runner pads with 0)")


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One step's inputs on one rank: token ids and positions ``[T]`` plus attention metadata."""

    input_ids_T: torch.Tensor
    positions_T: torch.Tensor
    attn: AttentionMetadata

    def __post_init__(self) -> None:
        check_token_ids(self.input_ids_T)  # the dtype; the model checks the range against its vocabulary
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
    chunk attends over the earlier ones.  Blocks come from a free list, lowest id first;
    :meth:`free` returns a finished request's blocks to it (a later request reuses them: attention
    reads a slot only below its request's ``seq_len``, so what a freed block still holds is never
    seen), and :meth:`reset` starts over. Token ids must be integers; with
    ``vocab_size`` they are also checked against the vocabulary here, on the host, where it costs
    no device wait.
    """

    def __init__(self, cache_cfg: KVCacheConfig, *, device: torch.device | str = "cpu",
                 vocab_size: int | None = None) -> None:
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
            raise ValueError(f"vocab_size must be a number of tokens >= 1 or None (got {vocab_size!r})")
        self.cache_cfg = cache_cfg
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.reset()

    def reset(self) -> None:
        # Popped from the end: reversed, so a fresh builder hands out blocks 0, 1, 2, ... in order.
        self._free: list[int] = list(range(self.cache_cfg.num_blocks - 1, -1, -1))
        self.blocks: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds."""
        return len(self._free)

    def free(self, request_id: int) -> int:
        """Forget a finished request and return its blocks to the free list; returns how many.
        An unknown id is a ValueError (freeing twice would hand a block to two requests)."""
        if request_id not in self.num_computed:
            raise ValueError(f"request {request_id} holds no KV blocks (never built, or freed already)")
        blocks = self.blocks.pop(request_id, [])
        del self.num_computed[request_id]
        self._free.extend(sorted(blocks, reverse=True))
        self._free.sort(reverse=True)  # lowest id next: reuse stays predictable
        return len(blocks)

    def mark(self, request_ids: Sequence[int]) -> dict[int, tuple[int | None, int]]:
        """What :meth:`rollback` needs to undo a :meth:`build` of these requests: each one's
        tokens in the cache (None: not known yet) and blocks held."""
        return {rid: (self.num_computed.get(rid), len(self.blocks.get(rid, ()))) for rid in request_ids}

    def rollback(self, mark: dict[int, tuple[int | None, int]]) -> None:
        """Undo every :meth:`build` since :meth:`mark` for the requests it names (a step that did
        not take effect): their lengths as they were, and the blocks they took back on the free
        list. The cache slots those builds wrote are not read again before being written anew:
        attention reads a slot only below its request's ``seq_len``."""
        for rid, (computed, held) in mark.items():
            blocks = self.blocks.get(rid, [])
            extra = blocks[held:]
            del blocks[held:]
            if computed is None:
                self.num_computed.pop(rid, None)
                self.blocks.pop(rid, None)
            else:
                self.num_computed[rid] = computed
            if extra:
                self._free.extend(extra)
                self._free.sort(reverse=True)

    def _token_ids(self, rid: int, tokens: Sequence[int]) -> list[int]:
        """``tokens`` as ints, refusing a float (``int()`` would truncate it), a bool and, with
        ``vocab_size``, an id outside the vocabulary."""
        out = []
        for j, t in enumerate(tokens):
            try:
                if isinstance(t, bool):
                    raise TypeError
                token = operator.index(t)
            except TypeError:
                raise ValueError(f"request {rid}: token {j} is {t!r}, not an integer token id; pass ints "
                                 "(a float id would be truncated)") from None
            if self.vocab_size is not None and not 0 <= token < self.vocab_size:
                raise ValueError(_out_of_vocab(f"request {rid}: token {j}", token, self.vocab_size))
            out.append(token)
        return out

    def _ensure_blocks(self, request_id: int, num_tokens: int) -> list[int]:
        blocks = self.blocks.setdefault(request_id, [])
        needed = -(-num_tokens // self.cache_cfg.block_size)
        while len(blocks) < needed:
            assert self._free, "build() checks the capacity first"
            blocks.append(self._free.pop())
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
        ids_per_chunk = []
        for rid, tokens in chunks:
            if rid in seen:
                raise ValueError(f"request {rid} appears twice in one batch; pass its tokens as one chunk")
            seen.add(rid)
            ids_per_chunk.append(self._token_ids(rid, tokens))
            have = len(self.blocks.get(rid, ()))
            new_blocks += max(0, -(-(self.num_computed.get(rid, 0) + len(tokens)) // bs) - have)
        if new_blocks > len(self._free):
            raise ValueError(
                f"the KV cache is full ({self.cache_cfg.num_blocks} blocks of {bs}, {len(self._free)} free, "
                f"this batch needs {new_blocks} more); raise MiniConfig.num_kv_blocks, use fewer/shorter "
                f"requests, or free finished ones (BatchBuilder.free)"
            )
        for (rid, tokens), chunk_ids in zip(chunks, ids_per_chunk):
            start = self.num_computed.get(rid, 0)
            end = start + len(tokens)
            blocks = self._ensure_blocks(rid, end)
            ids.extend(chunk_ids)
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
