"""Device specs for the simulated device: what one accelerator can do per second.

Preset numbers are dense (no sparsity) peak rates from public vendor material; the efficiency
factors turn peaks into what large, well-shaped kernels reach in practice. Sources:

* ``h200``: NVIDIA H200 SXM datasheet: 989 TFLOP/s BF16 dense (1,979 with 2:4 sparsity), 1,979
  TFLOP/s FP8 dense, 4.8 TB/s HBM3e, 141 GB.
* ``h100``: NVIDIA H100 SXM datasheet: 989 TFLOP/s BF16 dense, 1,979 TFLOP/s FP8 dense, 3.35 TB/s
  HBM3, 80 GB.
* ``h20``: NVIDIA H20 (Hopper, the export part) product brief: 148 TFLOP/s BF16 dense, 296 TFLOP/s
  FP8 dense, 4.0 TB/s HBM3, 96 GB, NVLink 900 GB/s (the ``nvlink`` link preset).
* ``b200``: NVIDIA HGX B200 datasheet, per GPU: 2.25 PFLOP/s BF16 dense (4.5 with 2:4 sparsity),
  4.5 PFLOP/s FP8 dense, 8 TB/s HBM3e, 180 GB (DGX B200: 1,440 GB and 64 TB/s over 8 GPUs); NVLink 5
  moves 1.8 TB/s bidirectional (``link_spec("nvlink", bandwidth_Bps=900e9)``). Its GEMM tile,
  efficiencies and kernel overhead are the Hopper values: no published Blackwell curve calibrates
  them.
* ``ascend910b``: Huawei Ascend 910B (910B3 class) public material: ~313 TFLOP/s FP16/BF16, ~640
  TOPS INT8, ~1.6 TB/s HBM2e, 64 GB. Less well documented than the NVIDIA parts; treat as
  approximate.

Two efficiencies turn peaks into what kernels reach. ``gemm_efficiency`` 0.7 is a modeling choice
that DeepGEMM's published H800 numbers bear out for prefill-sized FP8 GEMMs (1,025-1,358 TFLOP/s of
1,979 at M = 4096: 0.52-0.69). ``mem_efficiency`` 0.45 and ``kernel_overhead_s`` 2 us are
*calibrated* (:mod:`asyncdbo.sim.calibration`, ``benchmarks/sim_calibrate.py``): they are the pair
that best reproduces SGLang's published decode curve on H100; 0.45 sits at the low end of the
bandwidth DeepGEMM reports for decode-sized GEMMs on H800 (1.5-2.7 TB/s of 3.35: 0.45-0.80), an
independent check. Ops without a FLOP formula (elementwise, routing) pay a quarter of the kernel
overhead: production stacks fuse them. The same values serve every preset (no published curve
calibrates the 910B; its held-out point says how well they carry over). ``min_tile`` is the GEMM
tile edge (Hopper WGMMA tiles are 64 rows; Ascend's cube unit works on 16x16 fractals inside larger
blocks): a GEMM with fewer rows than a tile still pays for a whole tile, which is why two half-size
GEMMs are slower than one full one at small batches.
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
    peak_8bit_flops: float = 0.0  # FP8/INT8 dense; 0: same as peak_flops
    gemm_efficiency: float = 0.7
    mem_efficiency: float = 0.45
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
        if self.peak_8bit_flops <= 0:
            object.__setattr__(self, "peak_8bit_flops", self.peak_flops)


DEVICES: dict[str, DeviceSpec] = {
    "h200": DeviceSpec(name="h200", peak_flops=989e12, peak_8bit_flops=1979e12, hbm_Bps=4.8e12),
    "h100": DeviceSpec(name="h100", peak_flops=989e12, peak_8bit_flops=1979e12, hbm_Bps=3.35e12),
    "ascend910b": DeviceSpec(name="ascend910b", peak_flops=313e12, peak_8bit_flops=640e12, hbm_Bps=1.6e12,
                             min_tile=16 * 8),
    "h20": DeviceSpec(name="h20", peak_flops=148e12, peak_8bit_flops=296e12, hbm_Bps=4.0e12),
    "b200": DeviceSpec(name="b200", peak_flops=2250e12, peak_8bit_flops=4500e12, hbm_Bps=8.0e12),
}


def device_spec(name_or_spec: str | DeviceSpec, **overrides: object) -> DeviceSpec:
    """A preset by name (``h200``, ``h100``, ``h20``, ``b200``, ``ascend910b``), with fields overridden."""
    return preset(DEVICES, name_or_spec, "device", **overrides)
