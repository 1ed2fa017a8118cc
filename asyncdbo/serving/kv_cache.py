"""One rank's paged KV cache, the way vLLM's KV cache manager lays it out.

New keys/values are written through ``slot_mapping`` (one slot per token, ``block_id * block_size
+ offset``; ``PAD_SLOT_ID`` writes nothing); a request's context is read back through its
``block_table`` row. The runner's batch builder allocates blocks; attention kernels
(:mod:`asyncdbo.models.attention`) read and write the cache.
"""

# Shape legend: T = tokens, H = heads, K = head dim, N = blocks in the cache, Z = block size,
# L = layers.

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PAD_SLOT_ID", "KVCacheConfig", "PagedKVCache", "slots_for"]

#: slot_mapping value of a token that writes nothing (padding), as in vLLM.
PAD_SLOT_ID = -1


@dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """Shape of one rank's paged KV cache (all layers).  ``v_head_dim``: the values' head dim
    (None: ``head_dim``; 0: no value cache, for a latent cache that keeps keys only)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_heads", "head_dim"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"KVCacheConfig.{name} must be >= 1 (got {value})")
        if self.v_head_dim is not None and self.v_head_dim < 0:
            raise ValueError(f"KVCacheConfig.v_head_dim must be >= 0 or None (got {self.v_head_dim})")

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


class PagedKVCache:
    """Per-layer key and value caches ``[N, Z, H, K]``, zero-initialised.

    Zero-initialised (not empty) so that a wrong read shows up as a numeric mismatch against the
    serial run rather than as uninitialised garbage that might differ from run to run.
    """

    def __init__(self, cfg: KVCacheConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        shape = (cfg.num_blocks, cfg.block_size, cfg.num_heads, cfg.head_dim)
        v_shape = (*shape[:3], cfg.value_dim)
        self.k_cache_LNZHK = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v_cache_LNZHK = ([torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
                              if cfg.value_dim else [])

    def write(self, layer: int, k_THK: torch.Tensor, v_THK: torch.Tensor | None, slot_mapping_T: torch.Tensor, *,
              padded: bool = True) -> None:
        """Store the new tokens' keys/values at their slots; ``PAD_SLOT_ID`` slots are skipped.
        ``padded=False``: the caller knows no slot is ``PAD_SLOT_ID`` (the runner's rows past
        ``num_actual_tokens`` are cut off before), so no mask is built (on a device, a boolean
        index reads its count to the host).
        ``v_THK`` is None exactly when the cache keeps keys only."""
        assert (v_THK is None) == (self.cfg.value_dim == 0), "values given to a keys-only cache, or missing"
        if k_THK.shape[0] == 0:
            return
        slots = slot_mapping_T
        if padded:  # unpadded: no mask, which on a device would read its count to the host (a sync)
            keep_T = slot_mapping_T >= 0
            slots, k_THK = slot_mapping_T[keep_T], k_THK[keep_T]
            v_THK = None if v_THK is None else v_THK[keep_T]
        flat_k = self.k_cache_LNZHK[layer].view(-1, self.cfg.num_heads, self.cfg.head_dim)
        flat_k.index_copy_(0, slots, k_THK)
        if v_THK is not None:
            flat_v = self.v_cache_LNZHK[layer].view(-1, self.cfg.num_heads, self.cfg.value_dim)
            flat_v.index_copy_(0, slots, v_THK)

    def read(self, layer: int, slots_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys ``[S, H, K]`` and values (None for a keys-only cache) stored at ``slots_S``."""
        k_SHK = self.k_cache_LNZHK[layer].view(-1, self.cfg.num_heads, self.cfg.head_dim)[slots_S]
        if not self.cfg.value_dim:
            return k_SHK, None
        return k_SHK, self.v_cache_LNZHK[layer].view(-1, self.cfg.num_heads, self.cfg.value_dim)[slots_S]

    def reset(self) -> None:
        for t in (*self.k_cache_LNZHK, *self.v_cache_LNZHK):
            t.zero_()


def slots_for(block_table_B: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of the given positions (int64): of one request (a table row ``[B]``), or of
    several at once (tables ``[R, B]`` and positions ``[R, S]``, one row per request)."""
    return block_table_B.long().gather(-1, positions // block_size) * block_size + positions % block_size
