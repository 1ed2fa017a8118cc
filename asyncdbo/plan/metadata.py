"""Attention metadata for a batch, the rules of its split into per-ubatch metadata (the split
itself: :mod:`asyncdbo.plan.split`), and the merge of outputs.

Splitting follows vLLM's ``split_attn_metadata``, with two rules made explicit:

* A *continuation* (a ubatch whose first request started in an earlier ubatch) keeps that
  request's full ``seq_len``: it attends over the prefix the earlier ubatch wrote to the KV cache
  first (the ubatches reach each layer's attention in order on one compute stream), exactly like a
  chunked-prefill continuation.
* A *truncated head* (a ubatch whose last request continues later) sees only the part of the
  sequence written so far: its ``seq_len`` drops by the tokens that are not in this ubatch.

A field the splitter does not know how to split is an error, never copied silently (a copied
per-token field is the classic silently-wrong sub-batch, cf. SGLang's ``filter_batch``).
Subclasses of :class:`AttentionMetadata` declare a rule for each new field in ``split_rules``;
loose per-step tensors go through :func:`~asyncdbo.plan.split.split_extra` with a declared :class:`SplitKind`.
"""

# Shape legend: R = requests, T = tokens (real), P = tokens (padded), B = max blocks per request.

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import torch

from .slices import UBatchSlice

__all__ = [
    "AttentionMetadata",
    "SplitKind",
    "merge_outputs",
    "slice_tokens",
]


# Set (per thread) while asyncdbo.plan.split builds a ubatch's metadata from metadata that was checked
# when it was built, by slices check_slices passed: AttentionMetadata's own checks (O(requests))
# then run once per batch, not again per ubatch; a subclass's own __post_init__ still runs.
_TRUSTED = threading.local()


class SplitKind(enum.Enum):
    """How a per-step field is split across ubatches."""

    PER_TOKEN = "token"  # dim 0 is tokens: sliced by ``token_slice``
    PER_REQUEST = "request"  # dim 0 is requests: sliced by ``request_slice``
    SHARED = "shared"  # the same value for every ubatch (e.g. a scale or a cache handle)


def _check_int(name: str, t: torch.Tensor, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if t.dim() != dim or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(
            f"{name} must be a {dim}-D integer tensor (got shape {tuple(t.shape)}, dtype {t.dtype})"
        )


@dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    """What an attention backend needs for one batch (or one ubatch).

    Fields (device tensors may live on any device; the ``*_cpu`` mirrors let the planner read
    values without a device sync, so validation only reads the mirrors):

    * ``query_start_loc`` int32 [R+1]: token offset of each request's queries, from 0.
    * ``seq_lens`` int32 [R]: tokens each request attends over (prefix + its queries here).
    * ``block_table`` int32 [R, B]: KV-cache block ids of each request.
    * ``slot_mapping`` int64 [T]: KV-cache slot each new token is written to.
    * ``max_query_len``, ``max_seq_len``: upper bounds on the per-request lengths (kernels size
      their launch grids from them).
    * ``num_actual_tokens``: real tokens, ``query_start_loc[-1]``.
    * ``query_start_loc_cpu`` [R+1], ``seq_lens_cpu`` [R]: CPU copies of the above.

    Subclasses adding fields must declare each one in ``split_rules``; see the module docstring.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor

    #: Split rule of each field a subclass adds.
    split_rules: ClassVar[Mapping[str, SplitKind]] = {}

    def __post_init__(self) -> None:
        if getattr(_TRUSTED, "on", False):
            return  # a ubatch's metadata cut from checked metadata by checked slices: valid by construction
        _check_int("query_start_loc", self.query_start_loc, 1)
        _check_int("query_start_loc_cpu", self.query_start_loc_cpu, 1)
        _check_int("seq_lens", self.seq_lens, 1)
        _check_int("seq_lens_cpu", self.seq_lens_cpu, 1)
        _check_int("block_table", self.block_table, 2)
        _check_int("slot_mapping", self.slot_mapping, 1)
        num_reqs = self.query_start_loc_cpu.shape[0] - 1
        if num_reqs < 0:
            raise ValueError("query_start_loc_cpu must hold R+1 >= 1 entries (got 0)")
        for name in ("query_start_loc",):
            if getattr(self, name).shape[0] != num_reqs + 1:
                raise ValueError(
                    f"{name} has {getattr(self, name).shape[0]} entries but query_start_loc_cpu "
                    f"has {num_reqs + 1}; they must mirror each other"
                )
        for name in ("seq_lens", "seq_lens_cpu", "block_table"):
            if getattr(self, name).shape[0] != num_reqs:
                raise ValueError(
                    f"{name} has {getattr(self, name).shape[0]} rows but there are {num_reqs} "
                    f"requests (query_start_loc_cpu has {num_reqs + 1} entries)"
                )
        qsl = [int(v) for v in self.query_start_loc_cpu.tolist()]
        seq = [int(v) for v in self.seq_lens_cpu.tolist()]
        if qsl[0] != 0:
            raise ValueError(f"query_start_loc must start at 0 (got {qsl[0]})")
        for r in range(num_reqs):
            qlen = qsl[r + 1] - qsl[r]
            if qlen < 0:
                raise ValueError(
                    f"query_start_loc must be non-decreasing, but request {r} has a negative "
                    f"query length ({qsl[r + 1]} - {qsl[r]} = {qlen})"
                )
            if seq[r] < qlen:
                raise ValueError(
                    f"seq_len of request {r} ({seq[r]}) is below its query length ({qlen}); a "
                    f"request attends over at least its own new tokens"
                )
        if self.num_actual_tokens != qsl[-1]:
            raise ValueError(
                f"num_actual_tokens ({self.num_actual_tokens}) must equal query_start_loc[-1] "
                f"({qsl[-1]})"
            )
        if self.slot_mapping.shape[0] != self.num_actual_tokens:
            raise ValueError(
                f"slot_mapping has {self.slot_mapping.shape[0]} entries but there are "
                f"{self.num_actual_tokens} tokens; it holds one slot per token"
            )
        max_q = max((qsl[r + 1] - qsl[r] for r in range(num_reqs)), default=0)
        if self.max_query_len < max_q:
            raise ValueError(f"max_query_len ({self.max_query_len}) is below the longest query ({max_q})")
        if self.max_seq_len < max(seq, default=0):
            raise ValueError(f"max_seq_len ({self.max_seq_len}) is below the longest seq_len ({max(seq)})")

    @property
    def num_reqs(self) -> int:
        return int(self.query_start_loc_cpu.shape[0]) - 1

    @classmethod
    def from_lengths(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        device: torch.device | str | None = None,
        **extra_fields: Any,
    ) -> AttentionMetadata:
        """Build metadata from per-request query and sequence lengths (tests, examples, runners)."""
        for r, q in enumerate(query_lens):
            if q < 0:
                raise ValueError(f"query length of request {r} ({q}) is negative; lengths are >= 0")
        qsl_cpu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl_cpu[1:] = torch.tensor(list(query_lens), dtype=torch.int32).cumsum(0)
        seq_cpu = torch.tensor(list(seq_lens), dtype=torch.int32)
        device = torch.device(device) if device is not None else block_table.device
        return cls(
            query_start_loc=qsl_cpu.to(device),
            seq_lens=seq_cpu.to(device),
            block_table=block_table.to(device),
            slot_mapping=slot_mapping.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            num_actual_tokens=int(qsl_cpu[-1]),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
            **extra_fields,
        )


#: How each ubatch's ``max_seq_len`` is set (:func:`split_attn_metadata`): ``"ubatch"``, its own
#: longest request (the tightest bound, what a kernel sizing its work per call wants), or ``"batch"``,
#: the whole batch's (vLLM's ``split_attn_metadata``: the attention kernel chosen when a CUDA graph
#: was captured, which for sliding-window layers depends on it, stays the one replayed).
MAX_SEQ_LEN_RULES = ("ubatch", "batch")


def check_max_seq_len(where: str, rule: object) -> None:
    """ValueError unless ``rule`` is one of :data:`MAX_SEQ_LEN_RULES` (``where``: whose argument)."""
    if rule not in MAX_SEQ_LEN_RULES:
        raise ValueError(f"{where} max_seq_len={rule!r}: use 'ubatch' (each ubatch's own longest request, the default) "
                         "or 'batch' (the whole batch's in every ubatch, vLLM's rule, for graphs captured per batch)")


def slice_tokens(x_P: torch.Tensor, slices: Sequence[UBatchSlice], *, padded: bool = True) -> list[torch.Tensor]:
    """Views of a token-major input, one per ubatch (padded ranges by default)."""
    return [x_P[s.padded_token_slice if padded else s.token_slice] for s in slices]


Output = Union[torch.Tensor, tuple[torch.Tensor, ...]]


def merge_outputs(outputs: Sequence[Output], slices: Sequence[UBatchSlice], num_tokens_unpadded: int) -> Output:
    """Concatenate per-ubatch outputs in ubatch order, dropping each ubatch's padding rows.

    Each output's dim 0 holds that ubatch's real tokens first (then optional padding).  Tuple
    outputs (e.g. hidden states plus auxiliary hidden states) are merged element-wise.
    """
    if len(outputs) != len(slices) or not outputs:
        raise ValueError(f"got {len(outputs)} outputs for {len(slices)} ubatches; pass one per ubatch")
    sizes = [s.token_slice.stop - s.token_slice.start for s in slices]
    total = sum(sizes)
    if total != num_tokens_unpadded:
        raise ValueError(
            f"the slices hold {total} real tokens but num_tokens_unpadded is {num_tokens_unpadded}"
        )
    if isinstance(outputs[0], tuple) and all(isinstance(o, tuple) for o in outputs):
        arity = {len(o) for o in outputs}
        if len(arity) != 1:
            raise ValueError(f"tuple outputs differ in length across ubatches ({sorted(arity)})")
        return tuple(
            merge_outputs([o[i] for o in outputs], slices, num_tokens_unpadded)  # type: ignore[misc]
            for i in range(arity.pop())
        )
    parts: list[torch.Tensor] = []
    for k, (o, n) in enumerate(zip(outputs, sizes)):
        if not isinstance(o, torch.Tensor) or not o.dim():
            what = "a 0-d tensor" if isinstance(o, torch.Tensor) else f"a {type(o).__name__}"
            raise ValueError(f"output of ubatch {k} is {what}; expected a tensor with a row per token or a tuple of them")
        rows = o.shape[0]
        if rows != n:  # padding rows (fewer than the real tokens is an error)
            if rows < n:
                raise ValueError(f"output of ubatch {k} has {rows} rows but the ubatch has {n} real tokens")
            o = o[:n]
        parts.append(o)
    return torch.cat(parts, dim=0)
