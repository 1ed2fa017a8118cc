"""One message per dispatch where the link model says it pays: the counts ride in a header row of
a fixed-capacity token buffer (DeepEP's low-latency layout).

Legend (shape suffixes): P ranks in the EP group, L experts per rank, C rows of capacity per
destination rank, D hidden, T tokens of the call, K top-k.

The split dispatch (:mod:`asyncdbo.dist.ep`) is two messages: the per-(rank, expert) counts, then
the rows sized by them. On a latency-bound link each message costs a full latency, and a ubatch
sends as many messages per layer as the serial step does, so the counts message lengthens every
ubatch's own chain. The fused dispatch sends one buffer ``[P, 1 + C, D]`` per rank: row 0 of each
destination's block holds the counts (int64, bit-copied into the row's bytes), rows 1.. the
routed rows, padded to ``C`` rows. The receiver reads its counts from the headers and keeps only
the valid rows, in the same order as the split path, so every later number is the same, bit for
bit.

``C`` must be the same on every rank, so it comes from a bound every rank knows, not from the
call's own tokens: :func:`dispatch_options` declares that every rank's calls carry at most
``max_tokens`` tokens, and ``C = max_tokens * min(K, L)`` (a token's K distinct experts put at
most ``min(K, L)`` rows on one rank). Without that declaration the layer always splits.

The choice (``mode="auto"``) is made per call from the run's link model, from quantities every
rank shares, so all ranks choose alike: fused saves one message's latency (and the counts' bytes)
and costs the padding, ``(P * (1 + C) - max_tokens * K) * D * itemsize`` bytes over the bandwidth;
it is chosen only where the saving is larger. With no link model (real comm, a device backend)
``auto`` splits; ``mode="fused"`` or ``"split"`` forces one.

One exception, measured: the ``ht`` schedule with 2 ubatches splits. ``ht`` sends its counts
before the dispatch yield, so their latency already travels while the other ubatch computes, and
one fused message per dispatch makes both ubatches' dispatches travel and land together instead
(in ``benchmarks/moe_step.py``'s 8-layer decode the comm hidden behind compute fell from 55% to
20%, ``results/moe_step_cpu-2c_2026-12-01_run6.md``). In ``benchmarks/fused_choice.py``'s paired runs fusing gained nothing there that the runs
could resolve (decode, 2 layers: 1.044x [0.996..1.092], 40 steps) and lost in the 8-layer decode
(0.955x [0.937..0.972], 60 steps), while ``ht`` with 4 and 8 ubatches gained 1.15x and 1.11x
(``benchmarks/results/fused_choice_cpu-2c_2026-12-01_run3.md`` and ``_run2.md``), and ``ll``
gained wherever the link model chose fused (``..._2026-12-01.md``, 25 steps per cell).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from .._core import get_ubatch
from ..backends.links import LinkSpec

__all__ = ["DispatchChoice", "DispatchOptions", "choose_dispatch", "current_dispatch_options", "dispatch_options",
           "fused_capacity", "fused_rows", "padded_window"]

DispatchMode = Literal["auto", "fused", "split"]
DISPATCH_MODES: tuple[DispatchMode, ...] = ("auto", "fused", "split")
_COUNT_BYTES = 8  # int64 counts


@dataclass(frozen=True)
class DispatchOptions:
    """What the caller declares for the MoE dispatches made inside :func:`dispatch_options`."""

    max_tokens: int  # every rank's calls carry at most this many tokens (the capacity's basis)
    mode: DispatchMode = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"dispatch_options: max_tokens must be an integer >= 1 (got {self.max_tokens!r})")
        if self.mode not in DISPATCH_MODES:
            raise ValueError(f"dispatch_options: unknown mode {self.mode!r}; use 'auto', 'fused' or 'split'")


_OPTIONS: contextvars.ContextVar[DispatchOptions | None] = contextvars.ContextVar("asyncdbo_dispatch", default=None)


@contextlib.contextmanager
def dispatch_options(max_tokens: int, mode: DispatchMode = "auto") -> Iterator[DispatchOptions]:
    """Inside the block (and in the DBO runs started in it: each ubatch copies the context), MoE
    dispatches may be fused: every rank promises that each of its calls carries at most
    ``max_tokens`` tokens, so all ranks size the fused buffer alike. Every rank must enter it with
    the same arguments, around the same calls."""
    opts = DispatchOptions(max_tokens, mode)
    token = _OPTIONS.set(opts)
    try:
        yield opts
    finally:
        _OPTIONS.reset(token)


def current_dispatch_options() -> DispatchOptions | None:
    """The options of the innermost :func:`dispatch_options` block, or None."""
    return _OPTIONS.get()


def fused_capacity(max_tokens: int, top_k: int, experts_per_rank: int) -> int:
    """Rows of the fused buffer per destination rank: at most ``min(K, L)`` rows per token."""
    return max_tokens * min(top_k, experts_per_rank)


@dataclass(frozen=True)
class DispatchChoice:
    """The link model's verdict for one call: ``fused`` and the two prices it compared."""

    fused: bool
    saved_s: float  # one message's latency plus the counts' bytes, saved by fusing
    padding_s: float  # the padded rows (and headers) over the bandwidth, paid by fusing
    reason: str


def choose_dispatch(
    link: LinkSpec | None, *, max_tokens: int, top_k: int, experts_per_rank: int, ranks: int, hidden: int,
    itemsize: int, schedule: str | None = None, ubatches: int = 1,
) -> DispatchChoice:
    """Fused or split, from the link model and what every rank shares: the shapes, the layer's
    ``schedule`` and the run's number of ``ubatches`` (see the module doc)."""
    if ranks == 1:
        return DispatchChoice(False, 0.0, 0.0, "a single rank sends nothing")
    if schedule == "ht" and ubatches == 2:
        return DispatchChoice(False, 0.0, 0.0, "ht with 2 ubatches: its counts already travel while the other ubatch "
                                               "computes, and one message per dispatch puts both in flight together")
    if hidden * itemsize < experts_per_rank * _COUNT_BYTES:
        return DispatchChoice(False, 0.0, 0.0, f"a row of {hidden * itemsize} B cannot hold {experts_per_rank} counts")
    if link is None:
        return DispatchChoice(False, 0.0, 0.0, "no link model to price it")
    cap = fused_capacity(max_tokens, top_k, experts_per_rank)
    padded_rows = ranks * (1 + cap) - max_tokens * top_k
    padding_s = padded_rows * hidden * itemsize / link.bandwidth_Bps
    saved_s = link.latency_s + ranks * experts_per_rank * _COUNT_BYTES / link.bandwidth_Bps
    fused = saved_s > padding_s
    verdict = "saves" if fused else "does not save"
    return DispatchChoice(
        fused, saved_s, padding_s,
        f"fusing {verdict} time on {link.name}: one latency {saved_s * 1e6:.0f} us vs {padded_rows} padded rows "
        f"{padding_s * 1e6:.0f} us",
    )


def padded_window(layer: str, tokens: int, *, top_k: int, experts_per_rank: int, ranks: int,
                  required: bool) -> tuple[int, int] | None:
    """``(C, M)`` of the sync-free layout (:mod:`asyncdbo.dist.ep`) for a call of ``tokens``
    tokens: ``C`` rows per destination block, ``M`` rows per (source, local expert) window.

    On one rank they come from the call itself (its ``T * K`` rows, and at most ``T`` per expert:
    a token picks an expert once). Under EP the blocks travel in one equal-split message, so every
    rank must size them alike, from the bound :func:`dispatch_options` declares: ``M = max_tokens``
    and ``C = max_tokens * min(K, L)``, as the fused dispatch does. Neither can overflow: a call
    above ``max_tokens`` is refused here, before anything is sent. Without the bound: None (the
    exact splits), or with ``required`` a ValueError naming the fix."""
    if ranks == 1:
        return tokens * top_k, tokens
    opts = _OPTIONS.get()
    if opts is None:
        if required:
            raise ValueError(
                f"MoE layer {layer}: sync_free=True under expert parallelism ({ranks} ranks) needs the most tokens any "
                "rank's call carries, to size the blocks alike on every rank: run it inside "
                "asyncdbo.dist.dispatch_options(max_tokens=...)"
            )
        return None
    if tokens > opts.max_tokens:
        raise ValueError(
            f"MoE layer {layer}: a call of {tokens} tokens inside dispatch_options(max_tokens={opts.max_tokens}); "
            "raise max_tokens to the most tokens any rank's call carries"
        )
    return fused_capacity(opts.max_tokens, top_k, experts_per_rank), opts.max_tokens


def fused_rows(layer: str, tokens: int, *, top_k: int, experts_per_rank: int, ranks: int, hidden: int,
               itemsize: int, schedule: str | None = None) -> int:
    """Rows per destination of a fused dispatch for a call of ``tokens`` tokens, or 0 to split:
    0 outside :func:`dispatch_options` and for ``mode="split"``; under ``"auto"`` the current
    run's link model decides (:func:`choose_dispatch`, with the caller's ``schedule`` and the
    run's number of ubatches). ``layer`` names the caller in errors."""
    opts = _OPTIONS.get()
    if opts is None or ranks == 1 or opts.mode == "split":
        return 0
    if tokens > opts.max_tokens:
        raise ValueError(
            f"MoE layer {layer}: a call of {tokens} tokens inside dispatch_options(max_tokens={opts.max_tokens}); "
            "raise max_tokens to the most tokens any rank's call carries"
        )
    if opts.mode == "auto":
        ub = get_ubatch()
        link = None if ub is None else getattr(ub.run.ext.backend, "link", None)
        choice = choose_dispatch(link, max_tokens=opts.max_tokens, top_k=top_k, experts_per_rank=experts_per_rank,
                                 ranks=ranks, hidden=hidden, itemsize=itemsize, schedule=schedule,
                                 ubatches=1 if ub is None else len(ub.run.ubatches))
        if not choice.fused:
            return 0
    elif hidden * itemsize < experts_per_rank * _COUNT_BYTES:
        raise ValueError(
            f"MoE layer {layer}: dispatch_options(mode='fused') needs a row of at least {experts_per_rank * _COUNT_BYTES} B "
            f"for the counts header, and a row has {hidden * itemsize} B; use mode='auto' or 'split'"
        )
    return fused_capacity(opts.max_tokens, top_k, experts_per_rank)
