"""Device specs for the simulated device: what one accelerator can do per second.

Preset numbers are dense (no sparsity) peak rates from public vendor material; the efficiency
factors turn peaks into what large, well-shaped kernels reach in practice. Sources:

* ``h200``: NVIDIA H200 SXM datasheet: 989 TFLOP/s BF16 dense (1,979 with 2:4 sparsity), 4.8 TB/s
  HBM3e, 141 GB.
* ``h100``: NVIDIA H100 SXM datasheet: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3, 80 GB.
* ``ascend910b``: Huawei Ascend 910B (910B3 class) public material: ~313 TFLOP/s FP16/BF16,
  ~1.6 TB/s HBM2e, 64 GB. Less well documented than the NVIDIA parts; treat as approximate.

Efficiency and overhead defaults are modeling choices, not vendor numbers: large BF16 GEMMs reach
~70% of peak on Hopper (cuBLAS/CUTLASS benchmarks), streaming kernels ~80% of HBM bandwidth, and a
GEMM or attention kernel costs ~2 us of fixed time (launch gap plus ramp-up/tail) even inside a
CUDA graph, and any other op ~0.5 us (production stacks fuse routing and elementwise work into few
kernels, while the reference layer here issues them one by one). ``min_tile`` is the GEMM tile edge (Hopper WGMMA tiles are 64 rows; Ascend's cube unit works
on 16x16 fractals inside larger blocks): a GEMM with fewer rows than a tile still pays for a whole
tile, which is why two half-size GEMMs are slower than one full one at small batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.links import preset

__all__ = ["DEVICES", "DeviceSpec", "device_spec"]


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator. Rates are per second; ``dtype_bytes`` is the element size the modeled
    model uses for floating tensors (2 = BF16), whatever dtype the CPU run uses for real."""

    name: str
    peak_flops: float
    hbm_Bps: float
    gemm_efficiency: float = 0.7
    mem_efficiency: float = 0.8
    kernel_overhead_s: float = 2e-6
    small_kernel_overhead_s: float = 0.5e-6
    min_tile: int = 64
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for f in ("peak_flops", "hbm_Bps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"DeviceSpec {self.name!r}: {f} must be > 0 (got {getattr(self, f)!r})")
        for f in ("gemm_efficiency", "mem_efficiency"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ValueError(f"DeviceSpec {self.name!r}: {f} must be in (0, 1] (got {v!r})")
        for f in ("kernel_overhead_s", "small_kernel_overhead_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"DeviceSpec {self.name!r}: {f} must be >= 0 (got {getattr(self, f)!r})")
        if self.min_tile < 1 or self.dtype_bytes < 1:
            raise ValueError(f"DeviceSpec {self.name!r}: min_tile and dtype_bytes must be >= 1")


DEVICES: dict[str, DeviceSpec] = {
    "h200": DeviceSpec(name="h200", peak_flops=989e12, hbm_Bps=4.8e12),
    "h100": DeviceSpec(name="h100", peak_flops=989e12, hbm_Bps=3.35e12),
    "ascend910b": DeviceSpec(name="ascend910b", peak_flops=313e12, hbm_Bps=1.6e12, min_tile=16 * 8),
}


def device_spec(name_or_spec: str | DeviceSpec, **overrides: object) -> DeviceSpec:
    """A preset by name (``h200``, ``h100``, ``ascend910b``), with fields overridden."""
    return preset(DEVICES, name_or_spec, "device", **overrides)
