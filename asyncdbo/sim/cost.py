"""Cost model: how long one torch op takes on a modeled device.

Legend: M, K, N are GEMM dimensions (rows, reduction, columns); T tokens, D hidden size.

``time = overhead + max(flops / (peak * gemm_efficiency), bytes / (hbm * mem_efficiency))``
(a roofline with a fixed per-kernel cost: ``kernel_overhead_s`` for ops with a FLOP formula,
``small_kernel_overhead_s`` for the rest). FLOPs come from torch's own formulas
(``torch.utils.flop_counter.flop_registry``: mm, addmm, bmm, baddbmm, convolutions, SDPA) so the
sim counts exactly what ``FlopCounterMode`` would; ops without a formula count one FLOP per output
element. GEMM rows and columns are rounded up to the device's ``min_tile``: a 16-row GEMM on a
64-row tile pays for 64 rows. That is what makes two half-size GEMMs more than half as slow as the
full one at small batches, the effect behind DBO's loss at small decode batches.

Bytes are every tensor read plus every tensor written, counted with the device's element size for
floating tensors (the CPU run may use float32; the modeled model is BF16). Tensors registered as
weights (``weight_keys``, by storage) count ``weight_bytes`` per element instead, and a GEMM that
reads a weight stored in one byte (FP8, INT8) runs at the device's 8-bit peak. ``compute_share``
is the share of the SMs compute kernels get (DeepEP's normal kernels hold the rest while they
overlap compute: a static split, as DeepSeek and SGLang configure it); it scales the FLOP rate.
Views and other metadata-only ops cost nothing: they launch no kernel. The fused kernels of
:mod:`asyncdbo.sim.kernels` have their own formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from .devices import DeviceSpec
from . import kernels as _kernels  # noqa: F401  (registers the ops KERNEL_COSTS prices, below)
from .ops import storage_key

__all__ = ["CostModel", "OpCost"]

_aten = torch.ops.aten
_GEMMS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm}
_FREE = {
    _aten._local_scalar_dense,  # a host read: no kernel (it synchronizes the stream instead)
    _aten.empty,
    _aten.empty_like,
    _aten.empty_strided,
    _aten.lift_fresh,
    _aten.detach,
    _aten.alias,
    _aten.new_empty,
    _aten.new_empty_strided,
    _aten._unsafe_view,
}


@dataclass(frozen=True)
class OpCost:
    """One op's modeled cost. ``seconds`` is 0 for metadata-only ops."""

    flops: float
    nbytes: int
    seconds: float


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def is_metadata_only(func: Any) -> bool:
    """True for ops that only make views (every return aliases an input, none is written)."""
    if func in _FREE or getattr(func, "_overloadpacket", None) in _FREE:
        return True
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


class CostModel:
    """Modeled durations of torch ops on one :class:`DeviceSpec` (see the module docstring)."""

    def __init__(self, device: DeviceSpec, *, weight_keys: frozenset[int] = frozenset(), weight_bytes: int | None = None,
                 compute_share: float = 1.0) -> None:
        if not 0 < compute_share <= 1:
            raise ValueError(f"compute_share must be in (0, 1] (got {compute_share!r})")
        self.device = device
        self.weight_keys = weight_keys
        self.weight_bytes = device.dtype_bytes if weight_bytes is None else weight_bytes
        self.compute_share = compute_share

    def is_weight(self, t: torch.Tensor) -> bool:
        return bool(self.weight_keys) and storage_key(t) in self.weight_keys

    def nbytes(self, t: torch.Tensor) -> int:
        if self.is_weight(t):
            return t.numel() * self.weight_bytes
        size = self.device.dtype_bytes if t.is_floating_point() else t.element_size()
        return t.numel() * size

    def bytes_per_weight(self, ts: list[torch.Tensor]) -> int:
        return self.weight_bytes if any(self.is_weight(t) for t in ts) else self.device.dtype_bytes

    def distinct_bytes(self, ts: list[torch.Tensor]) -> int:
        """Bytes of ``ts`` with tensors that share a storage (views of one buffer) counted once."""
        by_key: dict[int | None, int] = {}
        for t in ts:
            k = storage_key(t)
            b = self.nbytes(t)
            if k is None:
                by_key[id(t)] = b
            else:
                by_key[k] = max(by_key.get(k, 0), b)
        return sum(by_key.values())

    def priced(self, flops: float, nbytes: float, *, kernels: int = 1, weights: tuple[torch.Tensor, ...] = ()) -> OpCost:
        """An :class:`OpCost` for a kernel of ``flops`` and ``nbytes`` (``kernels`` fixed costs);
        8-bit weights among ``weights`` select the 8-bit FLOP rate."""
        peak = self._peak(list(weights))
        return OpCost(flops, int(nbytes), self._time(flops, nbytes, kernels * self.device.kernel_overhead_s, peak))

    def _peak(self, ts: list[torch.Tensor]) -> float:
        d = self.device
        eight_bit = self.weight_bytes == 1 and any(self.is_weight(t) for t in ts)
        return (d.peak_8bit_flops if eight_bit else d.peak_flops) * self.compute_share

    def gemm_time(self, m: int, k: int, n: int, batch: int = 1) -> float:
        """Seconds for a ``[m, k] @ [k, n]`` GEMM (``batch`` of them), tile-rounded, BF16 operands."""
        d = self.device
        tile = d.min_tile
        flops = 2.0 * batch * math.ceil(m / tile) * tile * k * math.ceil(n / tile) * tile
        nbytes = batch * (m * k + k * n + m * n) * d.dtype_bytes
        return self._time(flops, nbytes)

    def _time(self, flops: float, nbytes: float, overhead: float | None = None, peak: float | None = None) -> float:
        d = self.device
        rate = (d.peak_flops * self.compute_share if peak is None else peak) * d.gemm_efficiency
        return (d.kernel_overhead_s if overhead is None else overhead) + max(
            flops / rate, nbytes / (d.hbm_Bps * d.mem_efficiency)
        )

    def is_compute(self, func: Any) -> bool:
        """True for a compute kernel (one with a FLOP formula: GEMMs, attention, the fused
        kernels), as opposed to an op that only moves or combines data."""
        return func in KERNEL_COSTS or getattr(func, "_overloadpacket", None) in flop_registry

    def op_cost(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> OpCost:
        """The cost of ``func(*args, **kwargs)`` that returned ``out``."""
        if is_metadata_only(func):
            return OpCost(0.0, 0, 0.0)
        kernel = KERNEL_COSTS.get(func)
        if kernel is not None:
            return kernel(self, args, out)
        ins = _tensors(args) + _tensors(kwargs)
        outs = _tensors(out)
        # An output that is one of the inputs (in-place, out=) was counted once already: copy_
        # reads src and writes self, two tensors' worth of traffic, not three.
        seen = {id(t) for t in ins}
        nbytes = sum(self.nbytes(t) for t in ins) + sum(self.nbytes(t) for t in outs if id(t) not in seen)
        packet = func._overloadpacket
        formula = flop_registry.get(packet)
        if formula is not None:
            flops = float(formula(*args, out_val=out, **kwargs))  # the registry maps tensors to shapes itself
            if packet in _GEMMS and outs:
                flops *= self._tile_waste(outs[0])
        else:
            flops = float(sum(t.numel() for t in outs))
            return OpCost(flops, nbytes, self._time(flops, nbytes, self.device.small_kernel_overhead_s))
        return OpCost(flops, nbytes, self._time(flops, nbytes, peak=self._peak(ins)))

    def _tile_waste(self, out_MN: torch.Tensor) -> float:
        """Factor by which tile rounding inflates a GEMM whose output is ``[..., M, N]``."""
        if out_MN.dim() < 2 or out_MN.numel() == 0:
            return 1.0
        tile = self.device.min_tile
        m, n = out_MN.shape[-2], out_MN.shape[-1]
        return (math.ceil(m / tile) * tile / m) * (math.ceil(n / tile) * tile / n)


# ------------------------------------------------------------------ the sim kernels' cost formulas
def _attention_cost(cm: CostModel, args: tuple[Any, ...], out: torch.Tensor) -> OpCost:
    q, k, v, causal = args
    B, H, Tq, Dq = q.shape
    Tk, Dv = k.shape[2], v.shape[-1]
    keys = Tk - (Tq - 1) / 2 if causal and Tq <= Tk else Tk
    flops = 2.0 * B * H * Tq * keys * (Dq + Dv)
    return cm.priced(flops, cm.distinct_bytes([q, k, v]) + cm.nbytes(out), kernels=1)


def _grouped_cost(cm: CostModel, args: tuple[Any, ...], out: torch.Tensor) -> OpCost:
    x, ids, gate, up, down = args
    L, Fi, D = gate.shape
    counts = torch.bincount(ids, minlength=L).tolist() if ids.device.type != "meta" else [x.shape[0] // max(L, 1)] * L
    tile = cm.device.min_tile
    rows = sum(math.ceil(m / tile) * tile for m in counts if m)
    used = sum(1 for m in counts if m)
    flops = 2.0 * rows * D * Fi * 3
    act = cm.nbytes(x) + cm.nbytes(out) + 3 * x.shape[0] * Fi * cm.device.dtype_bytes
    weights = used * 3 * Fi * D * cm.bytes_per_weight([gate, up, down])
    return cm.priced(flops, act + weights, kernels=2, weights=(gate, up, down))


#: Cost formulas of asyncdbo.sim.kernels' ops, by op (see :meth:`asyncdbo.sim.cost.CostModel.op_cost`).
KERNEL_COSTS: dict[Any, Any] = {
    torch.ops.asyncdbo_sim.attention.default: _attention_cost,
    torch.ops.asyncdbo_sim.grouped_swiglu.default: _grouped_cost,
}
