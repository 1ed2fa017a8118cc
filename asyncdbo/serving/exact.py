"""The exact check: run one step serially and with DBO, and name the first tensor where they differ.

For someone porting a model: with batch-invariant ops (deterministic mode on a CPU) a DBO step
must give the serial step's logits bit for bit, and when it does not, the logits alone do not say
where the bits parted.  :func:`exact_check` runs the step twice through the same runner, once as
one batch and once microbatched, while :func:`exact_tap` calls in the model's ``forward`` record
named intermediate tensors of every (u)batch; then it compares each ubatch's tensors with the
serial step's rows of the same tokens, in the order the forward tapped them, and reports the
first difference: the layer, the ubatch, the tensor, the element and both values.

A tap is ``x = exact_tap("attn", x_TD, layer=i)``: the tensor's first dimension must be the
tokens of the call (padding rows included, as ``forward`` got them); they are compared by token,
so a ubatch's row ``j`` is checked against the serial row of the same token.  Outside a check a
tap costs one context-variable read and returns ``x``.  The models in :mod:`asyncdbo.models.hf`
tap the attention output, the residual after it, the MoE (or dense MLP) output and the residual
after it, per layer; the logits are always compared, after every tap.

The step runs twice over the same model, so its ``forward`` must be repeatable: the second run
must find the state the first found.  A paged KV cache is (each run writes this step's keys and
values at the same slots before it reads them; the cache ends with the DBO run's); a cache that
appends is not.  Under DP every rank calls :func:`exact_check` at the same time (both steps are
collective), and each gets the report of its own tokens.
"""

# Shape legend: T = tokens of a call (padding included), V = vocab.

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core import get_ubatch
from .batch import Batch
from .runner import DBORunner, StepResult

__all__ = ["ExactDifference", "ExactReport", "exact_check", "exact_tap"]


@dataclass(frozen=True)
class _Tap:
    name: str
    layer: int | None
    x: torch.Tensor


@dataclass
class _Recording:
    """Every tap of one step, per ubatch id, in the order each ubatch made them."""

    by_ubatch: dict[int, list[_Tap]] = field(default_factory=dict)


_RECORDING: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("asyncdbo_exact_recording",
                                                                              default=None)


def exact_tap(name: str, x_T: torch.Tensor, *, layer: int | None = None) -> torch.Tensor:
    """Record ``x_T`` (first dimension: the call's tokens) as tensor ``name`` of ``layer`` when an
    :func:`exact_check` is running, and return it unchanged (module docstring)."""
    rec = _RECORDING.get()
    if rec is None:
        return x_T
    if not isinstance(x_T, torch.Tensor) or x_T.dim() == 0:
        raise ValueError(f"exact_tap({name!r}) needs a tensor whose first dimension is the call's tokens, "
                         f"got {x_T!r}")
    ub = get_ubatch()
    rec.by_ubatch.setdefault(0 if ub is None else ub.id, []).append(_Tap(name, layer, x_T.detach().clone()))
    return x_T


@dataclass(frozen=True)
class ExactDifference:
    """The first element where the DBO step left the serial step's bits.

    ``tensor`` and ``layer`` name the tap (``"logits"``, layer None: the step's output);
    ``ubatch`` is the DBO ubatch, ``index`` the element in that ubatch's tensor (its row counts
    the ubatch's tokens) and ``token`` the row's token in the batch; ``serial`` and ``dbo`` are
    the two values (exact: a float holds every float32 and bf16 value); ``count`` elements of
    that ubatch's tensor differ.  A tap that the two runs made differently (another name, layer
    or shape at the same place in the forward) has ``index == ()`` and NaN values, and
    ``structure`` says what differed."""

    layer: int | None
    ubatch: int
    tensor: str
    index: tuple[int, ...]
    token: int | None
    serial: float
    dbo: float
    count: int
    structure: str | None = None

    def __str__(self) -> str:
        where = f"layer {self.layer}" if self.layer is not None else "no layer"
        if self.structure is not None:
            return f"{where}, ubatch {self.ubatch}, tensor {self.tensor!r}: {self.structure}"
        return (f"{where}, ubatch {self.ubatch}, tensor {self.tensor!r} at index {list(self.index)} "
                f"(token {self.token} of the batch): serial {self.serial!r} ({_hex(self.serial)}), "
                f"DBO {self.dbo!r} ({_hex(self.dbo)}); {self.count} element(s) of this tensor differ")


def _hex(v: float) -> str:
    return v.hex() if math.isfinite(v) else repr(v)


@dataclass(frozen=True)
class ExactReport:
    """What :func:`exact_check` found: ``first`` is None when every tap and the logits were
    equal bit for bit; ``compared`` counts the (ubatch, tap) pairs compared, the logits included.
    ``serial`` and ``dbo`` are the two steps' results."""

    first: ExactDifference | None
    compared: int
    serial: StepResult
    dbo: StepResult

    @property
    def equal(self) -> bool:
        return self.first is None

    def __str__(self) -> str:
        ubs = len(self.dbo.plan.slices)
        if self.first is None:
            return f"exact: the DBO step ({ubs} ubatches) equals the serial step bit for bit ({self.compared} tensors)"
        return f"exact check: the DBO step ({ubs} ubatches) first differs from the serial step at {self.first}"


async def exact_check(runner: DBORunner, batch: Batch) -> ExactReport:
    """Run ``batch`` through ``runner`` serially, then with DBO, recording every
    :func:`exact_tap`, and report the first difference (module docstring).  Raises ValueError when
    the DBO step does not microbatch (nothing to compare), naming the planner's reason."""
    serial, serial_rec = await _recorded(runner, batch, enabled=False)
    dbo, dbo_rec = await _recorded(runner, batch, enabled=True)
    if not dbo.plan.microbatched:
        raise ValueError(
            f"exact_check: the DBO step was not microbatched ({dbo.record.reason}), so there is nothing to "
            f"compare; give the runner thresholds that microbatch this batch, e.g. "
            f"RunnerConfig(thresholds=ThresholdConfig(decode_threshold=1, prefill_threshold=1))"
        )
    first, compared = _compare(serial_rec, dbo_rec, serial, dbo)
    return ExactReport(first=first, compared=compared, serial=serial, dbo=dbo)


async def _recorded(runner: DBORunner, batch: Batch, *, enabled: bool) -> tuple[StepResult, _Recording]:
    rec = _Recording()
    token = _RECORDING.set(rec)  # the run copies this context into every ubatch's
    try:
        return await runner.step(batch, enabled=enabled), rec
    finally:
        _RECORDING.reset(token)


def _compare(serial_rec: _Recording, dbo_rec: _Recording, serial: StepResult,
             dbo: StepResult) -> tuple[ExactDifference | None, int]:
    """The first difference in forward order (the earliest tap, then the lowest ubatch), then the
    logits; and how many tensors were compared."""
    serial_taps = serial_rec.by_ubatch.get(0, [])
    serial_rows = serial.plan.num_tokens_padded
    found: list[tuple[int, int, ExactDifference]] = []  # (tap position, ubatch, difference)
    compared = 0
    for u, sl in enumerate(dbo.plan.slices):
        taps = dbo_rec.by_ubatch.get(u, [])
        t0, n = sl.token_slice.start, sl.num_tokens
        for k in range(max(len(taps), len(serial_taps))):
            if k >= len(taps) or k >= len(serial_taps):
                run, other, have = ("DBO", "serial", taps[k]) if k < len(taps) else ("serial", "DBO", serial_taps[k])
                found.append((k, u, _structural(have, u, f"tap {k} ({have.name!r}) of the {run} run has no "
                                                         f"counterpart in the {other} run ({len(serial_taps)} serial "
                                                         f"taps, {len(taps)} in this ubatch)")))
                break
            a, b = serial_taps[k], taps[k]
            compared += 1
            if (a.name, a.layer) != (b.name, b.layer) or a.x.shape[1:] != b.x.shape[1:] or a.x.dtype != b.x.dtype:
                found.append((k, u, _structural(b, u, f"tap {k} is {a.name!r} (layer {a.layer}, "
                                                      f"{tuple(a.x.shape)} {a.x.dtype}) in the serial run but "
                                                      f"{b.name!r} (layer {b.layer}, {tuple(b.x.shape)} {b.x.dtype}) "
                                                      f"in the DBO run")))
                break
            _check_rows(a, serial_rows, "the serial step")
            _check_rows(b, sl.num_tokens_padded, f"ubatch {u}")
            diff = _first_diff(a.x[t0:t0 + n], b.x[:n], b.name, b.layer, u, t0)
            if diff is not None:
                found.append((k, u, diff))
                break
    if found:
        return min(found, key=lambda f: (f[0], f[1]))[2], compared
    for u, sl in enumerate(dbo.plan.slices):  # every tap equal: the merged logits
        t0, n = sl.token_slice.start, sl.num_tokens
        compared += 1
        diff = _first_diff(serial.logits_TV[t0:t0 + n], dbo.logits_TV[t0:t0 + n], "logits", None, u, t0)
        if diff is not None:
            return diff, compared
    return None, compared


def _check_rows(tap: _Tap, rows: int, where: str) -> None:
    if tap.x.shape[0] != rows:
        raise ValueError(
            f"exact_tap({tap.name!r}, layer={tap.layer}) got {tap.x.shape[0]} rows in {where}, which ran {rows} "
            f"tokens: a tapped tensor's first dimension must be the tokens of the call (padding included)"
        )


def _structural(tap: _Tap, ubatch: int, what: str) -> ExactDifference:
    return ExactDifference(layer=tap.layer, ubatch=ubatch, tensor=tap.name, index=(), token=None, serial=math.nan,
                           dbo=math.nan, count=0, structure=what)


def _first_diff(serial_T: torch.Tensor, dbo_T: torch.Tensor, name: str, layer: int | None, ubatch: int,
                t0: int) -> ExactDifference | None:
    """The first differing element (row-major) of a ubatch's rows, or None when bitwise equal.
    Bitwise: a NaN equals a NaN of the same bits, and 0.0 differs from -0.0."""
    if serial_T.dtype.is_floating_point:
        width = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[serial_T.element_size()]
        differ = serial_T.contiguous().view(width) != dbo_T.contiguous().view(width)
    else:
        differ = serial_T != dbo_T
    if not bool(differ.any()):
        return None
    flat = int(differ.reshape(-1).nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), differ.shape))
    return ExactDifference(layer=layer, ubatch=ubatch, tensor=name, index=index, token=t0 + index[0],
                           serial=float(serial_T[index]), dbo=float(dbo_T[index]), count=int(differ.sum()))
