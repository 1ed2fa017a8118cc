"""Checking ubatch slices against the batch they claim to split.

Slices reach :func:`~asyncdbo.plan.split_attn_metadata` from the planners, but also from users
porting vLLM code (two-field slices: request range and token range) or SGLang code (a split
request index and token index).  A slice that does not fit the batch gives attention metadata
that reads KV slots not yet written or drops tokens, and nothing downstream notices, so the
split checks every slice first and says which one is wrong and how:

* every range must lie inside the batch, and no two token ranges may overlap (a token computed
  twice); :func:`~asyncdbo.plan.split_attn_metadata` accepts any such set, as vLLM's
  ``split_attn_metadata`` does (one slice of a batch, slices with gaps);
* the slices of a step (``tile=True``, what :func:`~asyncdbo.plan.plan_step` checks of its own)
  must also tile the batch: ubatch 0 starts at token 0, each starts where the previous one
  stops, the last stops at ``num_actual_tokens`` (no gap);
* a ubatch's request range must list exactly the requests with a token in its token range (a
  request without query tokens may sit at either edge);
* the continuation and truncation flags follow from the ranges and ``query_start_loc``: None
  means "derive them" (vLLM's slices carry none), a value that disagrees is refused.
"""

# Shape legend: R = requests, T = tokens (real).

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

from .slices import UBatchSlice

__all__ = ["check_slices"]


def _span(sl: slice) -> str:
    return f"{sl.start}:{sl.stop}"


def _describe(k: int, s: UBatchSlice) -> str:
    return f"ubatch {k} (tokens {_span(s.token_slice)}, requests {_span(s.request_slice)})"


def check_slices(qsl: Sequence[int], slices: Sequence[UBatchSlice], *, tile: bool = True) -> list[tuple[bool, bool]]:
    """Validate ``slices`` against the batch ``qsl`` (``query_start_loc_cpu`` as ints) and return
    each slice's ``(first_is_continuation, last_is_truncated)`` as the batch defines them.
    ``tile``: the token ranges must also cover the batch in order, with no gap (a step's slices);
    else any set of non-overlapping ranges inside the batch is valid.
    Raises ValueError naming the first bad slice."""
    num_reqs, num_tokens = len(qsl) - 1, qsl[-1]
    if not slices:
        raise ValueError("no ubatch slices given; pass at least one (the whole batch is one slice)")
    for k, s in enumerate(slices):  # first what does not fit at all: it explains the rest
        if s.token_slice.stop > num_tokens or s.request_slice.stop > num_reqs:
            raise ValueError(
                f"{_describe(k, s)} exceeds the batch ({num_tokens} tokens, {num_reqs} requests); plan the "
                f"slices from this metadata's query_start_loc_cpu"
            )
    if tile:
        _check_tiling(num_tokens, slices)
    else:
        _check_disjoint(slices)
    return [_flags(qsl, k, s) for k, s in enumerate(slices)]


def _check_disjoint(slices: Sequence[UBatchSlice]) -> None:
    order = sorted(range(len(slices)), key=lambda k: (slices[k].token_slice.start, slices[k].token_slice.stop))
    for a, b in zip(order, order[1:]):
        sa, sb = slices[a].token_slice, slices[b].token_slice
        if sb.start < sa.stop and sb.start < sb.stop:  # an empty range overlaps nothing
            first, second = sorted((a, b))
            raise ValueError(
                f"{_describe(second, slices[second])} overlaps {_describe(first, slices[first])}: tokens "
                f"{sb.start}:{min(sa.stop, sb.stop)} would be computed twice; slices may leave tokens out, but "
                f"no token may be in two"
            )


def _check_tiling(num_tokens: int, slices: Sequence[UBatchSlice]) -> None:
    expected_start = 0
    for k, s in enumerate(slices):
        t0, t1 = s.token_slice.start, s.token_slice.stop
        if t0 < expected_start:
            raise ValueError(
                f"{_describe(k, s)} overlaps ubatch {k - 1} (tokens {_span(slices[k - 1].token_slice)}): "
                f"tokens {t0}:{min(expected_start, t1)} would be computed twice; each ubatch must start where "
                f"the previous one stops"
            )
        if t0 > expected_start:
            where = "before it" if k == 0 else f"after ubatch {k - 1} (tokens {_span(slices[k - 1].token_slice)})"
            raise ValueError(
                f"{_describe(k, s)} leaves tokens {expected_start}:{t0} {where} in no ubatch; each ubatch must "
                f"start where the previous one stops, the first at token 0"
            )
        expected_start = t1
    if expected_start != num_tokens:
        raise ValueError(
            f"the ubatches stop at token {expected_start} but the batch has {num_tokens} tokens: tokens "
            f"{expected_start}:{num_tokens} are in no ubatch"
        )


def _flags(qsl: Sequence[int], k: int, s: UBatchSlice) -> tuple[bool, bool]:
    """Check slice ``k``'s requests against its tokens; its continuation and truncation flags."""
    num_reqs = len(qsl) - 1
    t0, t1 = s.token_slice.start, s.token_slice.stop
    r0, r1 = s.request_slice.start, s.request_slice.stop
    # Requests with a token in [t0, t1): their range [qsl[r], qsl[r+1]) meets it. qsl does not
    # decrease, so they are the non-empty requests of [lo, hi) (found by bisection: the checks
    # cost O(requests of the slice), not O(requests of the batch) per slice).
    lo = bisect.bisect_right(qsl, t0, 1, num_reqs + 1) - 1 if t0 < t1 else 0
    hi = bisect.bisect_left(qsl, t1, 0, num_reqs) if t0 < t1 else 0

    def has_token(r: int) -> bool:
        return lo <= r < hi and qsl[r] < qsl[r + 1]

    if not (lo <= r0 and r1 <= hi):  # inside [lo, hi), an empty request lies within [t0, t1]: fine
        for r in range(r0, r1):
            empty_at_edge = qsl[r] == qsl[r + 1] and t0 <= qsl[r] <= t1
            if not has_token(r) and not empty_at_edge:
                raise ValueError(
                    f"{_describe(k, s)} lists request {r} (tokens {qsl[r]}:{qsl[r + 1]}), which has no token in "
                    f"it; a ubatch's requests are exactly those with tokens in its token range (use "
                    f"slices_from_split_points to build slices)"
                )
    for r in itertools.chain(range(lo, min(hi, r0)), range(max(lo, r1), hi)):
        if has_token(r):
            raise ValueError(
                f"{_describe(k, s)} omits request {r} (tokens {qsl[r]}:{qsl[r + 1]}), which has tokens "
                f"{max(qsl[r], t0)}:{min(qsl[r + 1], t1)} in it; a ubatch's requests are exactly those with "
                f"tokens in its token range (use slices_from_split_points to build slices)"
            )
    cont = r1 > r0 and qsl[r0] < t0
    trunc = r1 > r0 and qsl[r1] > t1
    for name, given, derived in (("first_is_continuation", s.first_is_continuation, cont),
                                 ("last_is_truncated", s.last_is_truncated, trunc)):
        if given is not None and given != derived:
            raise ValueError(
                f"{_describe(k, s)} has {name}={given}, but query_start_loc says {derived}; leave the flags "
                f"None to derive them"
            )
    return cont, trunc
