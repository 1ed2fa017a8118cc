"""Serving: the runner that plans a step, runs its ubatches under DBO and merges them (vLLM's
``UBatchWrapper`` and the model-runner code around it), the batch it takes, the paged KV cache,
a continuous-batching engine with sampling over the runner, and the exact check (one step run
serially and with DBO, the first differing tensor named).

The runner knows no model: it takes anything with ``async forward(input_ids_T, positions_T,
attn)``.
"""

from .auto import OFF, Arm, AutoConfig, AutoPolicy
from .batch import Batch, BatchBuilder, check_token_ids
from .engine import Engine, EngineReport
from .requests import Request, RequestOutput, RequestStatus, trace_requests
from .exact import ExactDifference, ExactReport, exact_check, exact_tap
from .modes import ModeComparison, StepClock, compare_modes
from .kv_cache import PAD_SLOT_ID, KVCacheConfig, PagedKVCache, slots_for
from .runner import DBORunner, RunnerConfig, StepResult, current_slice
from .sampling import NonFiniteLogitsError, SamplingParams, sample_tokens

__all__ = [
    "OFF",
    "PAD_SLOT_ID",
    "Arm",
    "AutoConfig",
    "AutoPolicy",
    "Batch",
    "BatchBuilder",
    "DBORunner",
    "Engine",
    "EngineReport",
    "ExactDifference",
    "ExactReport",
    "KVCacheConfig",
    "ModeComparison",
    "NonFiniteLogitsError",
    "PagedKVCache",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "RunnerConfig",
    "SamplingParams",
    "StepClock",
    "StepResult",
    "check_token_ids",
    "compare_modes",
    "current_slice",
    "exact_check",
    "exact_tap",
    "sample_tokens",
    "slots_for",
    "trace_requests",
]
