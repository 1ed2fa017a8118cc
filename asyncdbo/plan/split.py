"""The split of a batch's attention metadata into per-ubatch metadata (rules: :mod:`.metadata`).

A split is two parts. What follows from the offsets (``query_start_loc_cpu``) and the slices alone,
each ubatch's rebased offsets, its longest query and how much of a truncated head lies after it,
is a :class:`SplitTemplate`. What every step brings anew (``seq_lens``, ``block_table``,
``slot_mapping``, a subclass's fields) is cut by :meth:`SplitTemplate.apply`. A runner whose steps
repeat their offsets (a decode step keeps its request count) keeps the template and pays only for
the second part (:class:`~asyncdbo.plan.planner.ShapePlanner`, issue 46); :func:`split_checked`
makes both parts every call, so there is one split, not a fast one beside a checked one.
"""

# Shape legend: R = requests, T = tokens (real).

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar, Union

import numpy as np
import torch

from .metadata import _TRUSTED, AttentionMetadata, SplitKind, check_max_seq_len
from .slices import UBatchSlice
from .validate import check_slices

__all__ = ["SplitTemplate", "split_attn_metadata", "split_checked", "split_extra"]

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


class _Row(NamedTuple):
    """One ubatch of a template: its request and token ranges, its offsets rebased to its first
    token and clamped (a continuation's head and a truncated tail trimmed), its longest query, the
    tokens of its truncated last request that lie after it (0: not truncated), and where the
    template's ``reduceat`` holds its longest ``seq_len`` (-1: nowhere, cut on its own). A tuple:
    a step unpacks each row at once."""

    r0: int
    r1: int
    t0: int
    t1: int
    q: np.ndarray
    max_query_len: int
    not_here: int
    pick: int


@dataclass(frozen=True, slots=True)
class SplitTemplate(Generic[M]):
    """What the split of metadata with these offsets by ``slices`` is, before any per-step tensor
    is read: made by :meth:`make` from slices :func:`check_slices` passed (each row's offsets keep
    the dtype of the offsets they were cut from)."""

    slices: tuple[UBatchSlice, ...]
    rows: tuple[_Row, ...]
    #: The indices of one ``np.maximum.reduceat`` of ``seq_lens`` giving the ubatches' longest
    #: ``seq_len`` (each row's ``pick``); None: each is read on its own.
    reduce_at: np.ndarray | None

    @staticmethod
    def make(qsl_cpu: torch.Tensor, slices: Sequence[UBatchSlice], flags: Sequence[tuple[bool, bool]]) -> SplitTemplate[Any]:
        qsl_np = _host(qsl_cpu)
        rows = []
        for s, (_, truncated) in zip(slices, flags):
            r0, r1, t0, t1 = s.request_slice.start, s.request_slice.stop, s.token_slice.start, s.token_slice.stop
            num_tokens = t1 - t0
            # Rebase to the ubatch's first token; clamping trims a continuation's head (below 0) and a
            # truncated tail (past the ubatch's last token). The slices passed check_slices: only a
            # continuation's first offset lies below the ubatch, only a truncated head's last one past it.
            q = qsl_np[r0 : r1 + 1] - t0
            q[0] = max(q[0], 0)
            q[-1] = min(q[-1], num_tokens)
            max_q = int((q[1:] - q[:-1]).max()) if r1 > r0 else 0
            rows.append(_Row(r0, r1, t0, t1, q, max_q, int(qsl_np[r1]) - t1 if truncated else 0, -1))
        at, picks = _reductions(rows, len(qsl_np) - 1)
        if at is not None:
            rows = [row._replace(pick=p) for row, p in zip(rows, picks)]
        return SplitTemplate(tuple(slices), tuple(rows), at)

    def apply(self, meta: M, max_seq_len: str = "ubatch") -> list[M]:
        """The ubatches' metadata of ``meta``, whose offsets are the template's (the caller's
        word: a runner keeps a template per offsets it checked, :func:`split_checked` makes one)."""
        cls = type(meta)
        _check_rules(cls)
        seq_np = _host(meta.seq_lens_cpu)
        batch_max = meta.max_seq_len if max_seq_len == "batch" else None
        plain = _plain(cls)
        rules = cls.split_rules
        dev_qsl = meta.query_start_loc is not meta.query_start_loc_cpu  # on a CPU batch the mirrors are the tensors
        dev_seq = meta.seq_lens is not meta.seq_lens_cpu
        base = vars(meta)
        # every ubatch's longest seq_len in one array operation where the template allows it
        maxes = np.maximum.reduceat(seq_np, self.reduce_at).tolist() if self.reduce_at is not None else None
        out: list[M] = []
        for (r0, r1, t0, t1, q, max_q, not_here, pick), s in zip(self.rows, self.slices):
            qsl_cpu = torch.from_numpy(q.copy())  # a tensor of its own per step: a model may write it
            if not_here:
                # The truncated head sees only the tokens written so far: drop the ones after this ubatch.
                cut = seq_np[r0:r1].copy()
                cut[-1] -= not_here
                seq_cpu = torch.from_numpy(cut)
                seq_max = int(cut.max())
            else:
                seq_cpu = meta.seq_lens_cpu[r0:r1]
                if pick >= 0:
                    seq_max = maxes[pick]  # type: ignore[index]
                else:
                    seq_max = int(seq_np[r0:r1].max()) if r1 > r0 else 0
            qsl = meta.query_start_loc[r0 : r1 + 1].sub(t0).clamp_(0, t1 - t0) if dev_qsl else qsl_cpu
            if not dev_seq:
                seq = seq_cpu
            else:
                seq = meta.seq_lens[r0:r1]
                if not_here:
                    seq = seq.clone()
                    seq[-1] -= not_here
            changes: dict[str, Any] = {
                "query_start_loc": qsl,
                "query_start_loc_cpu": qsl_cpu,
                "seq_lens": seq,
                "seq_lens_cpu": seq_cpu,
                "block_table": meta.block_table[r0:r1],
                "slot_mapping": meta.slot_mapping[t0:t1],
                "max_query_len": max_q,
                "max_seq_len": seq_max if batch_max is None else batch_max,
                "num_actual_tokens": t1 - t0,
            }
            if rules:
                for name, kind in rules.items():
                    changes[name] = _split_one(getattr(meta, name), kind, s)
            if plain:
                # What dataclasses.replace does for a class whose fields are all set by __init__ and
                # whose __post_init__ is the base's (skipped here: trusted), at a fraction of its cost
                # (the dict set at once: the frozen class's own setattr refuses it).
                new = object.__new__(cls)
                object.__setattr__(new, "__dict__", {**base, **changes})
                out.append(new)
            else:
                trusted, _TRUSTED.on = getattr(_TRUSTED, "on", False), True
                try:
                    out.append(dataclasses.replace(meta, **changes))
                finally:
                    _TRUSTED.on = trusted
        return out


def _reductions(rows: Sequence[_Row], num_reqs: int) -> tuple[np.ndarray | None, tuple[int, ...]]:
    """Indices for one ``np.maximum.reduceat`` over ``seq_lens`` giving each plain ubatch's (neither
    empty nor truncated) longest ``seq_len``, and where each ubatch's lands (-1: none); (None, ())
    where some ubatch's range cannot be expressed so (a range ending inside another's). reduceat
    reduces ``a[at[i]:at[i + 1]]`` (the last to the end): after a ubatch's first request the next
    index must be its ``r1`` (or none, where ``r1`` is the last request)."""
    at: list[int] = []
    picks: list[int] = []
    for k, row in enumerate(rows):
        if row.r1 == row.r0 or row.not_here:
            picks.append(-1)
            continue
        picks.append(len(at))
        at.append(row.r0)
        nxt = next((r.r0 for r in rows[k + 1:] if r.r1 > r.r0 and not r.not_here), None)
        if row.r1 < num_reqs and nxt != row.r1:
            at.append(row.r1)
    ends = [*at[1:], num_reqs]
    if not at or any(p >= 0 and ends[p] != row.r1 for p, row in zip(picks, rows)):
        return None, ()
    return np.asarray(at, dtype=np.intp), tuple(picks)


_PLAIN: dict[type, bool] = {}
_RULES_OK: set[type] = set()


def _plain(cls: type) -> bool:
    """Whether a copy of ``cls``'s instance dict is what ``dataclasses.replace`` would build."""
    plain = _PLAIN.get(cls)
    if plain is None:
        # (an InitVar needs a __post_init__ of the subclass's own: not plain either)
        plain = _PLAIN[cls] = (getattr(cls, "__post_init__", None) is AttentionMetadata.__post_init__
                               and all(f.init for f in dataclasses.fields(cls)) and not hasattr(cls, "__slots__"))
    return plain


def _check_rules(cls: type[AttentionMetadata]) -> None:
    """ValueError if ``cls`` has a field without a split rule (checked once per class: a class's
    fields and ``split_rules`` are fixed when it is defined)."""
    if cls in _RULES_OK:
        return
    unknown = [f.name for f in dataclasses.fields(cls) if f.name not in _BASE_FIELDS and f.name not in cls.split_rules]
    if unknown:
        raise ValueError(
            f"{cls.__name__} has field(s) {unknown} with no split rule; declare one per field, "
            f"e.g. split_rules = {{{unknown[0]!r}: SplitKind.PER_TOKEN}} (or PER_REQUEST / SHARED)"
        )
    _RULES_OK.add(cls)


def split_attn_metadata(meta: M, slices: Sequence[UBatchSlice], *, max_seq_len: str = "ubatch") -> list[M]:
    """Split ``meta`` into one metadata per ubatch slice (see :mod:`asyncdbo.plan.metadata` for the
    rules). ``max_seq_len``: each ubatch's own (``"ubatch"``) or the whole batch's (``"batch"``,
    vLLM's rule; :data:`~asyncdbo.plan.metadata.MAX_SEQ_LEN_RULES`).

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
    return SplitTemplate.make(meta.query_start_loc_cpu, slices, flags).apply(meta, max_seq_len)


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
