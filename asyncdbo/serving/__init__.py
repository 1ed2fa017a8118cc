"""Serving: the runner that plans a step, runs its ubatches under DBO and merges them (vLLM's
``UBatchWrapper`` and the model-runner code around it), the batch it takes, and the paged KV cache.

The runner knows no model: it takes anything with ``async forward(input_ids_T, positions_T,
attn)``.
"""

from .batch import Batch, BatchBuilder, check_token_ids
from .kv_cache import PAD_SLOT_ID, KVCacheConfig, PagedKVCache, slots_for
from .runner import DBORunner, RunnerConfig, StepResult, current_slice

__all__ = [
    "PAD_SLOT_ID",
    "Batch",
    "BatchBuilder",
    "DBORunner",
    "KVCacheConfig",
    "PagedKVCache",
    "RunnerConfig",
    "StepResult",
    "check_token_ids",
    "current_slice",
    "slots_for",
]
