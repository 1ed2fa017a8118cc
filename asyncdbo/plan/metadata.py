"""Attention metadata for a batch, its split into per-ubatch metadata, and the merge of outputs.

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
loose per-step tensors go through :func:`split_extra` with a declared :class:`SplitKind`.
"""

# Shape legend: R = requests, T = tokens (real), P = tokens (padded), B = max blocks per request.

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union

import numpy as np
import torch

from .slices import UBatchSlice
from .validate import check_slices

__all__ = [
    "AttentionMetadata",
    "SplitKind",
    "merge_outputs",
    "slice_tokens",
    "split_attn_metadata",
    "split_extra",
]


# Set (per thread) while split_checked builds a ubatch's metadata from metadata that was checked
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


_BASE_FIELDS = frozenset(f.name for f in dataclasses.fields(AttentionMetadata))
M = TypeVar("M", bound=AttentionMetadata)


def _split_one(value: Any, kind: SplitKind, s: UBatchSlice) -> Any:
    if kind is SplitKind.SHARED:
        return value
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"a {kind.value} field must be a tensor (got {type(value).__name__})")
    return value[s.token_slice] if kind is SplitKind.PER_TOKEN else value[s.request_slice]


def _host(t: torch.Tensor) -> np.ndarray:
    """A CPU mirror's values as a numpy array (a view, no copy): the split reads its per-request
    lengths with array operations, not with one small torch operation each."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


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


def _split_one_meta(meta: M, s: UBatchSlice, truncated: bool, qsl_np: np.ndarray, seq_np: np.ndarray,
                    batch_max: int | None = None) -> M:
    r0, r1 = s.request_slice.start, s.request_slice.stop
    t0, t1 = s.token_slice.start, s.token_slice.stop
    num_tokens = t1 - t0
    # Rebase to the ubatch's first token; clamping trims a continuation's head (below 0) and a
    # truncated tail (past the ubatch's last token).
    q = qsl_np[r0 : r1 + 1] - t0
    # The slices passed check_slices: only a continuation's first offset lies below the ubatch and
    # only a truncated head's last one past it (every other request has its tokens inside).
    if q[0] < 0:
        q[0] = 0
    if q[-1] > num_tokens:
        q[-1] = num_tokens
    qsl_cpu = torch.from_numpy(q)
    seq_cpu = meta.seq_lens_cpu[r0:r1]
    seq_max = int(seq_np[r0:r1].max()) if r1 > r0 else 0
    if truncated:
        # The truncated head sees only the tokens written so far: drop the ones after this ubatch.
        not_here = int(qsl_np[r1]) - t1
        cut = seq_np[r0:r1].copy()
        cut[-1] -= not_here
        seq_cpu = torch.from_numpy(cut)
        seq_max = int(cut.max())
    # On a CPU batch the mirrors are the tensors themselves (BatchBuilder, from_lengths): cut once.
    if meta.query_start_loc is meta.query_start_loc_cpu:
        qsl = qsl_cpu
    else:
        qsl = meta.query_start_loc[r0 : r1 + 1].sub(t0).clamp_(0, num_tokens)
    if meta.seq_lens is meta.seq_lens_cpu:
        seq = seq_cpu
    else:
        seq = meta.seq_lens[r0:r1]
        if truncated:
            seq = seq.clone()
            seq[-1] -= not_here
    changes: dict[str, Any] = dict(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq,
        seq_lens_cpu=seq_cpu,
        block_table=meta.block_table[r0:r1],
        slot_mapping=meta.slot_mapping[t0:t1],
        max_query_len=int((q[1:] - q[:-1]).max()) if r1 > r0 else 0,
        max_seq_len=seq_max if batch_max is None else batch_max,
        num_actual_tokens=num_tokens,
    )
    cls = type(meta)
    for name, kind in cls.split_rules.items():
        changes[name] = _split_one(getattr(meta, name), kind, s)
    if not _plain(cls):
        return dataclasses.replace(meta, **changes)
    # What dataclasses.replace does for a class whose fields are all set by __init__ and whose
    # __post_init__ is the base's (skipped here: trusted), at a fraction of its cost per step.
    out = object.__new__(cls)
    vars(out).update(vars(meta))
    vars(out).update(changes)
    return out


_PLAIN: dict[type, bool] = {}


def _plain(cls: type) -> bool:
    """Whether a copy of ``cls``'s instance dict is what ``dataclasses.replace`` would build."""
    plain = _PLAIN.get(cls)
    if plain is None:
        # (an InitVar needs a __post_init__ of the subclass's own: not plain either)
        plain = _PLAIN[cls] = (getattr(cls, "__post_init__", None) is AttentionMetadata.__post_init__
                               and all(f.init for f in dataclasses.fields(cls)) and not hasattr(cls, "__slots__"))
    return plain


def split_attn_metadata(meta: M, slices: Sequence[UBatchSlice], *, max_seq_len: str = "ubatch") -> list[M]:
    """Split ``meta`` into one metadata per ubatch slice (see the module docstring for the rules).
    ``max_seq_len``: each ubatch's own (``"ubatch"``) or the whole batch's (``"batch"``, vLLM's
    rule; :data:`MAX_SEQ_LEN_RULES`).

    The slices are checked against ``meta.query_start_loc_cpu`` first (:mod:`asyncdbo.plan.validate`):
    each must lie inside the batch and no two may share a token (any such set, as with vLLM's
    ``split_attn_metadata``: one slice, or slices with gaps; a step's slices from
    :func:`~asyncdbo.plan.plan_step` also tile it), each request range must list exactly the
    requests with tokens in it, and the continuation/truncation flags are derived from the batch
    (None) or must agree with it.  Raises ValueError naming the bad slice, or if ``meta`` is a
    subclass with a field missing from its ``split_rules``.
    """
    check_max_seq_len("split_attn_metadata", max_seq_len)
    flags = check_slices([int(v) for v in meta.query_start_loc_cpu.tolist()], slices, tile=False)
    return split_checked(meta, slices, flags, max_seq_len=max_seq_len)


def split_checked(meta: M, slices: Sequence[UBatchSlice], flags: Sequence[tuple[bool, bool]], *,
                  max_seq_len: str = "ubatch") -> list[M]:
    """:func:`split_attn_metadata` of slices :func:`check_slices` already passed (with ``flags``)."""
    cls = type(meta)
    unknown = [f.name for f in dataclasses.fields(cls) if f.name not in _BASE_FIELDS and f.name not in cls.split_rules]
    if unknown:
        raise ValueError(
            f"{cls.__name__} has field(s) {unknown} with no split rule; declare one per field, "
            f"e.g. split_rules = {{{unknown[0]!r}: SplitKind.PER_TOKEN}} (or PER_REQUEST / SHARED)"
        )
    qsl_np, seq_np = _host(meta.query_start_loc_cpu), _host(meta.seq_lens_cpu)
    trusted, _TRUSTED.on = getattr(_TRUSTED, "on", False), True
    try:
        batch_max = meta.max_seq_len if max_seq_len == "batch" else None
        return [_split_one_meta(meta, s, trunc, qsl_np, seq_np, batch_max) for s, (_, trunc) in zip(slices, flags)]
    finally:
        _TRUSTED.on = trusted


ExtraKind = Union[SplitKind, str]


def split_extra(
    extra: Mapping[str, Any], kinds: Mapping[str, ExtraKind], slices: Sequence[UBatchSlice]
) -> list[dict[str, Any]]:
    """Split loose per-step fields (e.g. ``positions`` per token, ``temperature`` per request).

    Every key of ``extra`` needs a kind in ``kinds`` (a :class:`SplitKind` or its value string);
    a key without one raises ValueError rather than being copied to every ubatch.
    """
    missing = [k for k in extra if k not in kinds]
    if missing:
        raise ValueError(
            f"extra field(s) {missing} have no declared split kind; pass kinds={{{missing[0]!r}: "
            f"'token' | 'request' | 'shared'}}"
        )
    resolved: dict[str, SplitKind] = {}
    for name in extra:
        try:
            resolved[name] = SplitKind(kinds[name])
        except ValueError:
            raise ValueError(
                f"split kind {kinds[name]!r} of extra field {name!r} is unknown; use 'token', "
                f"'request' or 'shared'"
            ) from None
    return [{name: _split_one(v, resolved[name], s) for name, v in extra.items()} for s in slices]


def slice_tokens(x_P: torch.Tensor, slices: Sequence[UBatchSlice], *, padded: bool = True) -> list[torch.Tensor]:
    """Views of a token-major input, one per ubatch (padded ranges by default)."""
    return [x_P[s.padded_token_slice if padded else s.token_slice] for s in slices]


Output = Union[torch.Tensor, tuple[torch.Tensor, ...]]


def merge_outputs(outputs: Sequence[Output], slices: Sequence[UBatchSlice], num_tokens_unpadded: int) -> Output:
    """Concatenate per-ubatch outputs in ubatch order, dropping each ubatch's padding rows.

    Each output's dim 0 holds that ubatch's real tokens first (then optional padding).  Tuple
    outputs (e.g. hidden states plus auxiliary hidden states) are merged element-wise.
    """
    if len(outputs) != len(slices):
        raise ValueError(f"got {len(outputs)} outputs for {len(slices)} ubatches; pass one per ubatch")
    total = sum(s.num_tokens for s in slices)
    if total != num_tokens_unpadded:
        raise ValueError(
            f"the slices hold {total} real tokens but num_tokens_unpadded is {num_tokens_unpadded}"
        )
    if all(isinstance(o, tuple) for o in outputs):
        arity = {len(o) for o in outputs}
        if len(arity) != 1:
            raise ValueError(f"tuple outputs differ in length across ubatches ({sorted(arity)})")
        return tuple(
            merge_outputs([o[i] for o in outputs], slices, num_tokens_unpadded)  # type: ignore[misc]
            for i in range(arity.pop())
        )
    parts: list[torch.Tensor] = []
    for k, (o, s) in enumerate(zip(outputs, slices)):
        if not isinstance(o, torch.Tensor):
            raise ValueError(f"output of ubatch {k} is a {type(o).__name__}; expected a tensor or a tuple of tensors")
        if o.shape[0] < s.num_tokens:
            raise ValueError(
                f"output of ubatch {k} has {o.shape[0]} rows but the ubatch has {s.num_tokens} real tokens"
            )
        parts.append(o if o.shape[0] == s.num_tokens else o[: s.num_tokens])  # no padding: no view to make
    return torch.cat(parts, dim=0)
