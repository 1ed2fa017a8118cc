"""Link specs: the time a transfer takes on an interconnect, ``latency + bytes / bandwidth``.

Used by the host backend's modeled-link mode (the real all-to-all runs; its completion is released
when the modeled transfer would end) and by the simulated device. Preset numbers are per direction,
per GPU/NIC, from public vendor specs:

* ``nvlink``: NVLink 4 on H100/H200 SXM, 900 GB/s bidirectional = 450 GB/s per direction
  (NVIDIA H100/H200 datasheets); ~2 us software + hop latency.
* ``ib400``: 400 Gb/s NDR InfiniBand (ConnectX-7) = 50 GB/s; ~10 us end-to-end all-to-all latency
  (DeepEP reports 77-194 us dispatch for 128 tokens at EP8-256 with 43-58 GB/s RDMA achieved).
* ``eth100``: 100 Gb/s Ethernet (RoCE) = 12.5 GB/s; ~25 us.
* ``hccs``: Huawei HCCS between Ascend 910B chips, 56 GB/s per direction (vendor material); ~5 us.
* ``roce200``: 200 Gb/s RoCE between Ascend servers (Atlas 800T A2: one 200GE port per NPU) = 25
  GB/s; ~10 us.
* ``pcie5``: PCIe 5.0 x16 between GPUs without NVLink (PCIe cards, e.g. H20/L20 PCIe servers):
  32 GT/s x 16 lanes with 128b/130b coding = 63 GB/s per direction (PCI-SIG's PCIe 5.0 base
  specification rate). Its latency is not a spec-sheet number: the ``ib400`` preset's 10 us is
  assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

__all__ = ["LINKS", "LinkSpec", "link_spec", "preset"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One direction of an interconnect. ``bandwidth_Bps`` in bytes per second."""

    name: str
    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"LinkSpec {self.name!r}: latency_s must be >= 0 (got {self.latency_s})")
        if self.bandwidth_Bps <= 0:
            raise ValueError(f"LinkSpec {self.name!r}: bandwidth_Bps must be > 0 (got {self.bandwidth_Bps})")

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` over this link (one message)."""
        return self.latency_s + nbytes / self.bandwidth_Bps


LINKS: dict[str, LinkSpec] = {
    "nvlink": LinkSpec(name="nvlink", latency_s=2e-6, bandwidth_Bps=450e9),
    "ib400": LinkSpec(name="ib400", latency_s=10e-6, bandwidth_Bps=50e9),
    "eth100": LinkSpec(name="eth100", latency_s=25e-6, bandwidth_Bps=12.5e9),
    "hccs": LinkSpec(name="hccs", latency_s=5e-6, bandwidth_Bps=56e9),
    "roce200": LinkSpec(name="roce200", latency_s=10e-6, bandwidth_Bps=25e9),
    "pcie5": LinkSpec(name="pcie5", latency_s=10e-6, bandwidth_Bps=63e9),
}


def preset(table: dict[str, T], name_or_spec: str | T, kind: str, **overrides: Any) -> T:
    """``table[name]`` (or a spec given as is) with fields overridden; a ValueError names an
    unknown preset or field and lists the valid ones. Shared by links and simulated devices."""
    if isinstance(name_or_spec, str):
        try:
            base = table[name_or_spec]
        except KeyError:
            spec_cls = type(next(iter(table.values()))).__name__
            raise ValueError(f"unknown {kind} {name_or_spec!r}; choose one of {sorted(table)} or pass a {spec_cls}") from None
    else:
        base = name_or_spec
    if not overrides:
        return base
    known = {f.name for f in fields(base)}  # type: ignore[arg-type]
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown {type(base).__name__} field(s) {sorted(unknown)}; fields are {sorted(known)}")
    return replace(base, **overrides)  # type: ignore[type-var]


def link_spec(name_or_spec: str | LinkSpec, **overrides: float) -> LinkSpec:
    """A preset by name (``nvlink``, ``ib400``, ``eth100``, ``hccs``, ``roce200``), with fields overridden."""
    return preset(LINKS, name_or_spec, "link", **overrides)
