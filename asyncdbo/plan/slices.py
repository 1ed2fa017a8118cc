"""Cut one step's batch into microbatches (ubatches).

A batch is described by ``query_start_loc``: R+1 non-decreasing token offsets starting at 0,
request ``r`` owning tokens ``[qsl[r], qsl[r+1])``.  Every policy here reduces to choosing N+1
token cuts ``0 = c0 <= c1 <= ... <= cN = T``; ubatch k gets real tokens ``[c_k, c_k+1)`` and every
request that has a token there.  A request crossing a cut appears in both ubatches, its tokens
split and never duplicated: the second part is a chunked-prefill continuation (it attends over
the prefix the earlier ubatch wrote to the KV cache first, on the same compute stream).

Policies:

* ``"token"`` (vLLM): cut at multiples of ``padded // N``.  Every rank of a DP group that pads to
  the same total gets the same per-ubatch sizes, which is what CUDA graphs and per-ubatch
  collectives need.  All padding goes to the last ubatch, except when the real tokens do not
  reach the last cut: the earlier ubatches then carry padding too (possibly only padding), since
  their size is fixed by the group, not by this rank.
* ``"request"``: cuts only at request boundaries, each at the boundary nearest the even cut
  ``k*T/N`` among those that leave one distinct boundary for every later cut (for N=2 this is
  SGLang's min |left - right|, ``_split_array_by_balanced_sum``, which SGLang calls "balanced").
  No request is ever cut, and with at least N requests no ubatch is empty: ``[100, 100, 1000]``
  in three is cut at ``[100, 200]``.  This is ROCm vLLM's ``request_aligned_split_points`` (its
  batch-invariant DBO under DeepEP high-throughput), with two differences: the targets are the
  even cuts of the *real* tokens (ROCm: of the padded count, which is what its DP ranks run;
  here padding always goes last), and a batch with too few boundaries still gets slices, with
  empty ubatches that :func:`~asyncdbo.plan.plan_step` turns into ``POLICY_REFUSED`` (ROCm:
  ``None``, "do not microbatch": the same outcome).
* ``"balanced"``: ``"request"``, unless that leaves a ubatch too small; then the cuts bordering
  too-small ubatches move to their even point, cutting the request there (SGLang's two-chunk
  split, PR #8144).  ``min_share`` is SGLang's threshold (default 0.48): the fraction of all
  tokens the smaller half must hold for N=2.  For N parts it scales to ``2*min_share/N`` of the
  tokens, i.e. each ubatch must hold at least ``2*min_share`` (96%) of an even share.
  ``min_share=0`` never cuts a request.

The non-token policies put all padding at the end of the last ubatch; only the padded *total*
then matches across DP ranks, not the per-ubatch sizes.

:func:`slices_from_split_points` cuts at points you choose: token offsets (vLLM's
``split_point`` list) or SGLang's ``(tbo_split_seq_index, tbo_split_token_index)`` pairs.  It is
the way to build slices by hand: it fills the request ranges and flags from ``query_start_loc``.
"""

# Shape legend: R = requests, T = tokens (real), P = tokens (padded).

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Union, get_args

import torch

__all__ = [
    "SplitPolicy",
    "UBatchSlice",
    "as_query_start_loc",
    "plan_slices",
    "slices_from_split_points",
    "split_balanced",
    "split_requests",
    "split_tokens",
    "whole_batch_slice",
]

SplitPolicy = Literal["token", "request", "balanced"]
SPLIT_POLICIES: tuple[str, ...] = get_args(SplitPolicy)

QueryStartLoc = Union[Sequence[int], torch.Tensor]


def _integral_bounds(sl: object) -> tuple[int, int] | None:
    """``(start, stop)`` as Python ints when ``sl`` is a slice with integral bounds of any integer
    type (int, numpy or 0-d torch integers: anything with ``__index__``), else None."""
    if not isinstance(sl, slice):
        return None
    try:
        return operator.index(sl.start), operator.index(sl.stop)
    except TypeError:
        return None


@dataclass(frozen=True, slots=True)
class UBatchSlice:
    """One ubatch's share of the batch.

    ``token_slice`` holds the ubatch's real tokens; ``padded_token_slice`` is its range in the
    padded input buffer (real tokens first, then ``num_padding`` padding tokens).
    ``request_slice`` lists every request with a token in the ubatch; ``first_is_continuation``
    says its first request started in an earlier ubatch and ``last_is_truncated`` that its last
    request continues in a later one.  Both flags follow from ``query_start_loc``: the planners
    fill them in, and :func:`~asyncdbo.plan.split_attn_metadata` derives them when they are None
    (vLLM's two-field slices) and refuses them when they disagree.

    In SGLang's terms, ``(request_slice.start, token_slice.start)`` of the second ubatch is
    ``(tbo_split_seq_index, tbo_split_token_index)``.
    """

    request_slice: slice
    token_slice: slice
    padded_token_slice: slice
    first_is_continuation: bool | None = None
    last_is_truncated: bool | None = None

    def __post_init__(self) -> None:
        for name in ("request_slice", "token_slice", "padded_token_slice"):
            sl = getattr(self, name)
            if type(sl) is slice and type(sl.start) is int and type(sl.stop) is int and sl.step is None:
                if 0 <= sl.start <= sl.stop:
                    continue  # the planners' slices: plain ints, checked without the general path's calls
            bounds = _integral_bounds(sl)
            if bounds is None or sl.step not in (None, 1) or not 0 <= bounds[0] <= bounds[1]:
                raise ValueError(
                    f"UBatchSlice.{name} must be a slice(start, stop) with 0 <= start <= stop and no step (got {sl!r})"
                )
            if type(sl.start) is not int or type(sl.stop) is not int:
                # vLLM's own maybe_create_ubatch_slices returns slice(36, np.int32(72)): keep plain ints
                object.__setattr__(self, name, slice(*bounds))
        if self.num_tokens_padded < self.num_tokens:
            raise ValueError(
                f"UBatchSlice.padded_token_slice {self.padded_token_slice.start}:{self.padded_token_slice.stop} is "
                f"shorter than token_slice {self.token_slice.start}:{self.token_slice.stop}; it holds the real "
                f"tokens plus padding"
            )

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens."""
        return int(self.token_slice.stop - self.token_slice.start)

    @property
    def num_tokens_padded(self) -> int:
        return int(self.padded_token_slice.stop - self.padded_token_slice.start)

    @property
    def num_padding(self) -> int:
        return self.num_tokens_padded - self.num_tokens

    @property
    def num_requests(self) -> int:
        return int(self.request_slice.stop - self.request_slice.start)

    def is_empty(self) -> bool:
        """True when the ubatch has no real token (it may still carry padding)."""
        return self.num_tokens == 0


class CheckedOffsets(tuple[int, ...]):
    """``query_start_loc`` as :func:`as_query_start_loc` returned it, frozen: the planners take
    it as it is (a tuple cannot change after the check), so a step checks its offsets once, not
    once per function it calls (O(requests) each)."""

    __slots__ = ()


_INT_DTYPES = frozenset((torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8))


def as_query_start_loc(query_start_loc: QueryStartLoc) -> list[int]:
    """Validate ``query_start_loc`` and return it as a list of ints.

    A tensor is read with ``.tolist()``: pass the CPU mirror, a device tensor would sync.
    """
    if type(query_start_loc) is CheckedOffsets:
        return list(query_start_loc)  # checked when it was made
    if isinstance(query_start_loc, torch.Tensor):
        if query_start_loc.dim() != 1 or query_start_loc.is_floating_point():
            raise ValueError(
                f"query_start_loc must be a 1-D integer tensor (got shape "
                f"{tuple(query_start_loc.shape)}, dtype {query_start_loc.dtype})"
            )
        if query_start_loc.device.type == "cpu" and query_start_loc.dtype in _INT_DTYPES:
            # The usual case, a CPU mirror: its ints as they are, the order checked as an array.
            qsl = query_start_loc.tolist()
            if qsl and qsl[0] == 0:
                arr = query_start_loc.numpy()
                if bool((arr[1:] >= arr[:-1]).all()):
                    return qsl
        else:
            qsl = list(map(int, query_start_loc.tolist()))
    else:
        qsl = list(map(int, query_start_loc))
    if not qsl or qsl[0] != 0:
        raise ValueError(
            f"query_start_loc must start at 0 (got {qsl[:4]}); it holds R+1 token offsets, "
            f"the first being 0"
        )
    if all(map(operator.le, qsl, itertools.islice(qsl, 1, None))):  # the check at C speed; the loop names the entry
        return qsl
    for r in range(len(qsl) - 1):
        if qsl[r + 1] < qsl[r]:
            raise ValueError(
                f"query_start_loc must be non-decreasing, but entry {r + 1} ({qsl[r + 1]}) is "
                f"below entry {r} ({qsl[r]}); request {r} would have a negative length "
                f"({qsl[r + 1] - qsl[r]})"
            )
    return qsl


def _check_num_ubatches(num_ubatches: int) -> None:
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches ({num_ubatches}) must be at least 1")


def _check_padded(num_tokens: int, num_tokens_padded: int | None) -> int:
    if num_tokens_padded is None:
        return num_tokens
    if num_tokens_padded < num_tokens:
        raise ValueError(
            f"num_tokens_padded ({num_tokens_padded}) is below the real token count "
            f"({num_tokens}); pass None or a count >= {num_tokens}"
        )
    return num_tokens_padded


def _slices_from_cuts(qsl: list[int], cuts: list[int], padded_cuts: list[int]) -> list[UBatchSlice]:
    """Turn token cuts into ubatch slices.

    A request with zero query tokens sitting exactly on a cut goes to the ubatch starting there
    (or the last ubatch), so every request belongs to at least one ubatch.
    """
    num_reqs = len(qsl) - 1
    n = len(cuts) - 1
    out: list[UBatchSlice] = []
    for k in range(n):
        t0, t1 = cuts[k], cuts[k + 1]
        assert t0 <= t1 and padded_cuts[k] <= padded_cuts[k + 1]
        # First request: the one starting at t0, else the one containing t0 (a continuation).
        # An empty ubatch takes no request it would have zero tokens of.
        r0 = bisect.bisect_left(qsl, t0)
        if qsl[r0] > t0 and t1 > t0:
            r0 -= 1
        r0 = r0 if k else 0
        # Requests starting before t1 (the last is truncated if it ends after t1).
        r1 = num_reqs if k == n - 1 else max(bisect.bisect_left(qsl, t1), r0)
        cont = r1 > r0 and qsl[r0] < t0
        trunc = r1 > r0 and qsl[r1] > t1
        out.append(
            UBatchSlice(
                request_slice=slice(r0, r1),
                token_slice=slice(t0, t1),
                padded_token_slice=slice(padded_cuts[k], padded_cuts[k + 1]),
                first_is_continuation=cont,
                last_is_truncated=trunc,
            )
        )
    return out


def split_tokens(
    query_start_loc: QueryStartLoc, num_ubatches: int, num_tokens_padded: int | None = None
) -> list[UBatchSlice]:
    """vLLM's token split: cut at multiples of ``padded // N``; see the module docstring."""
    qsl = as_query_start_loc(query_start_loc)
    _check_num_ubatches(num_ubatches)
    num_tokens = qsl[-1]
    padded = _check_padded(num_tokens, num_tokens_padded)
    step = padded // num_ubatches
    padded_cuts = [k * step for k in range(num_ubatches)] + [padded]
    cuts = [min(c, num_tokens) for c in padded_cuts]
    return _slices_from_cuts(qsl, cuts, padded_cuts)


def _point(qsl: list[int], i: int, point: object) -> int:
    """A split point as a token offset: an int, or SGLang's (seq index, token index) pair."""
    num_tokens = qsl[-1]
    if isinstance(point, tuple) and len(point) == 2 and all(isinstance(v, int) for v in point):
        seq, token = point
        if not 0 <= seq < len(qsl):
            raise ValueError(f"split point {i} {point}: seq index {seq} is not a request index of the batch (0..{len(qsl) - 1}, the last meaning the end)")
        first = qsl[seq]
        last = qsl[seq + 1] if seq + 1 < len(qsl) else first
        if not (first <= token < last or token == first):
            raise ValueError(
                f"split point {i} {point}: token {token} is not in request {seq} (tokens {first}:{last}); "
                f"SGLang's (split_seq_index, split_token_index) names the request the second part starts in"
            )
        return token
    if isinstance(point, int) and not isinstance(point, bool):
        if not 0 <= point <= num_tokens:
            raise ValueError(
                f"split point {i} ({point}) is outside the batch's tokens 0..{num_tokens}; points are token "
                f"offsets into query_start_loc"
            )
        return point
    raise ValueError(
        f"split point {i} must be a token offset (int) or a (seq index, token index) pair of ints (got {point!r})"
    )


def slices_from_split_points(
    query_start_loc: QueryStartLoc,
    points: Sequence[int | tuple[int, int]],
    num_tokens_padded: int | None = None,
) -> list[UBatchSlice]:
    """Slices cut at ``points``: ``len(points) + 1`` ubatches.

    Each point is a token offset (vLLM's ``split_point`` list) or SGLang's ``(seq index, token
    index)`` pair, which must name the request the cut lies in (or starts).  Points must be
    non-decreasing; equal points give an empty ubatch.  The request ranges and the continuation
    and truncation flags come from ``query_start_loc``; padding goes to the end of the last
    ubatch.  Use this instead of building :class:`UBatchSlice` objects by hand.
    """
    qsl = as_query_start_loc(query_start_loc)
    padded = _check_padded(qsl[-1], num_tokens_padded)
    cuts = [_point(qsl, i, p) for i, p in enumerate(points)]
    for i in range(1, len(cuts)):
        if cuts[i] < cuts[i - 1]:
            raise ValueError(
                f"split points must be non-decreasing, but point {i} ({cuts[i]}) is below point {i - 1} ({cuts[i - 1]})"
            )
    cuts = [0, *cuts, qsl[-1]]
    return _slices_from_cuts(qsl, cuts, _with_padding(cuts, padded))


def _request_cuts(qsl: Sequence[int], num_ubatches: int) -> list[int]:
    """Interior cuts on request boundaries, each as near its even cut ``k*T/N`` as the boundaries
    left allow (ties go left).

    Each cut takes a distinct interior boundary (``0 < b < T``) above the previous cut and leaves
    one behind for every cut still to place, so a batch with at least ``N - 1`` interior
    boundaries never gets an empty ubatch: ``[100, 100, 1000]`` in three cuts at ``[100, 200]``,
    not ``[200, 1200]``. This is ROCm vLLM's ``request_aligned_split_points`` rule; see the module
    docstring for where the two differ. With fewer boundaries the remaining cuts repeat the last
    one (empty ubatches: :func:`~asyncdbo.plan.plan_step` then falls out as POLICY_REFUSED).
    """
    num_tokens, n = qsl[-1], num_ubatches
    # qsl is checked (starts at 0, never decreases): its distinct values in order are 0, the
    # interior boundaries, then T (dict.fromkeys keeps the first of each, at C speed)
    distinct = list(dict.fromkeys(qsl))
    interior = distinct[1:-1] if num_tokens > 0 else []

    def nearest(k: int, candidates: Sequence[int]) -> int:
        # k*T/N against a boundary b, compared as N*b vs k*T (exact); ties go to the lower one.
        # The candidates are sorted: the nearest is one of the two around the first b with
        # N*b >= k*T (a bisection, not a scan: O(log R) per cut).
        i = bisect.bisect_left(candidates, -(-k * num_tokens // n))
        if i == len(candidates):
            return candidates[-1]
        if i == 0 or abs(candidates[i] * n - k * num_tokens) < abs(candidates[i - 1] * n - k * num_tokens):
            return candidates[i]
        return candidates[i - 1]

    cuts = [0]
    for k in range(1, n):
        if len(interior) < n - 1:  # not enough requests: some ubatch stays empty whatever we do
            cuts.append(max(nearest(k, qsl), cuts[-1]))
            continue
        available = interior[bisect.bisect_right(interior, cuts[-1]):]
        cuts.append(nearest(k, available[: len(available) - (n - 1 - k)]))
    return cuts + [num_tokens]


def _with_padding(cuts: list[int], padded: int) -> list[int]:
    return cuts[:-1] + [padded]


def split_requests(
    query_start_loc: QueryStartLoc, num_ubatches: int, num_tokens_padded: int | None = None
) -> list[UBatchSlice]:
    """Request-aligned split: no request is cut; see the module docstring."""
    qsl = as_query_start_loc(query_start_loc)
    _check_num_ubatches(num_ubatches)
    padded = _check_padded(qsl[-1], num_tokens_padded)
    cuts = _request_cuts(qsl, num_ubatches)
    return _slices_from_cuts(qsl, cuts, _with_padding(cuts, padded))


def _balanced_cuts(qsl: Sequence[int], num_ubatches: int, min_share: float) -> list[int]:
    """:func:`split_balanced`'s cuts of checked offsets ``qsl`` (0, the interior cuts, T)."""
    num_tokens = qsl[-1]
    cuts = _request_cuts(qsl, num_ubatches)
    even = [k * num_tokens // num_ubatches for k in range(num_ubatches + 1)]
    # size >= 2*min_share*T/N, in integers: size*N >= 2*min_share*T.
    min_scaled = 2.0 * min_share * num_tokens
    for _ in range(num_ubatches):  # bounded: each pass moves at least one cut or stops
        changed = False
        for k in range(num_ubatches):
            if (cuts[k + 1] - cuts[k]) * num_ubatches >= min_scaled:
                continue
            for c in (k, k + 1):  # the two cuts bordering ubatch k (never the ends 0 and T)
                if 0 < c < num_ubatches and cuts[c] != even[c]:
                    cuts[c] = even[c]
                    changed = True
        cuts = [max(cuts[: i + 1]) for i in range(len(cuts))]  # keep them sorted
        if not changed:
            break
    return cuts


def split_balanced(
    query_start_loc: QueryStartLoc,
    num_ubatches: int,
    num_tokens_padded: int | None = None,
    *,
    min_share: float = 0.48,
) -> list[UBatchSlice]:
    """Request-aligned split, cutting a request only where a ubatch would be too small.

    A ubatch is too small below ``2*min_share/N`` of the tokens.  Each cut bordering a
    too-small ubatch moves to its even point ``k*T//N``; moving can make a neighbour too small,
    so this repeats until nothing changes (at most N passes).
    """
    if not 0.0 <= min_share <= 0.5:
        raise ValueError(
            f"min_share ({min_share}) must lie in [0, 0.5]: it is the fraction of tokens the "
            f"smaller of two halves must hold (0.48 in SGLang; 0 never cuts a request)"
        )
    qsl = as_query_start_loc(query_start_loc)
    _check_num_ubatches(num_ubatches)
    padded = _check_padded(qsl[-1], num_tokens_padded)
    cuts = _balanced_cuts(qsl, num_ubatches, min_share)
    return _slices_from_cuts(qsl, cuts, _with_padding(cuts, padded))


def plan_slices(
    query_start_loc: QueryStartLoc,
    num_ubatches: int,
    policy: SplitPolicy = "token",
    *,
    num_tokens_padded: int | None = None,
    min_share: float = 0.48,
) -> list[UBatchSlice]:
    """Split with the named policy (``"token"``, ``"request"`` or ``"balanced"``)."""
    if policy == "token":
        return split_tokens(query_start_loc, num_ubatches, num_tokens_padded)
    if policy == "request":
        return split_requests(query_start_loc, num_ubatches, num_tokens_padded)
    if policy == "balanced":
        return split_balanced(query_start_loc, num_ubatches, num_tokens_padded, min_share=min_share)
    raise ValueError(f"unknown split policy {policy!r}; use one of {SPLIT_POLICIES}")


def whole_batch_slice(query_start_loc: QueryStartLoc, num_tokens_padded: int | None = None) -> UBatchSlice:
    """The single slice of a step that does not microbatch."""
    return split_tokens(query_start_loc, 1, num_tokens_padded)[0]


def leaves_ubatch_empty(qsl: CheckedOffsets, num_ubatches: int, policy: Literal["request", "balanced"],
                        min_share: float = 0.48) -> bool:
    """Whether the request-aligned split ``policy`` of checked offsets ``qsl`` leaves a ubatch
    without real tokens (as :func:`plan_slices` would cut it), from its cuts alone: no slices built."""
    cuts = _request_cuts(qsl, num_ubatches) if policy == "request" else _balanced_cuts(qsl, num_ubatches, min_share)
    return any(a == b for a, b in zip(cuts, cuts[1:]))
