"""How the sim prices one dispatch or combine: the comm library's efficiency, fixed cost, payload
format and SM use, on top of a link's ``latency + bytes / bandwidth``.

Two presets:

* ``a2a``: plain all-to-all collectives (NCCL, HCCL, gloo): what asyncdbo's MoE layer issues
  through ``torch.distributed``. The link's nominal bandwidth, no fixed cost beyond its latency,
  BF16 payloads, and the receive counts are read by the host (a blocking sync).
* ``deepep``: DeepEP's kernels, fitted to DeepEP's published tables
  (:mod:`asyncdbo.sim.published`). Normal mode (transfers issued from a comm stream: the ``ht``
  schedule) reaches the bandwidth DeepEP measured per link, holds ``sm_share`` of the SMs
  (DeepSeek's prefill: 24 of 132) and sends a token once per destination *node* over the
  scale-out link (NVLink forwards it inside the node: ``node_dedup``); its counts exchange makes
  the CPU wait, as DeepEP's normal dispatch does. Low-latency mode (transfers issued from the compute role: the ``ll`` schedule)
  has a fixed in-flight cost per transfer and the efficiency fitted to DeepEP's low-latency
  table; it holds no SMs in flight, sends FP8 (one float32 scale per 128 values) and keeps the
  counts on the device (no host sync; the counts ride with the data).

:func:`fit_low_latency` is the least-squares line ``time = fixed + wire_bytes * s`` through
DeepEP's low-latency rows at EP >= 32 (dispatch and combine together, wire bytes = the share
leaving the node), so ``efficiency = 1 / (s * bandwidth)``: the two numbers are derived from the
table, not typed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..backends.links import LINKS, preset
from .published import DEEPEP_LL, DEEPEP_NORMAL, LL_HIDDEN, LL_TOKENS, LL_TOP_K

__all__ = ["COMMS", "CommSpec", "comm_spec", "fit_low_latency", "payload_scale", "wire_share"]

FP8_SCALE_GROUP = 128  # values per float32 scale in DeepEP's FP8 dispatch


def payload_scale(fp8: bool) -> float:
    """Bytes on the wire per BF16 byte: 1 for BF16, (1 + 4/128) / 2 for FP8 with float32 scales."""
    return (1.0 + 4.0 / FP8_SCALE_GROUP) / 2.0 if fp8 else 1.0


def wire_share(ep: int, gpus_per_node: int, scale_out: bool) -> float:
    """The share of a rank's all-to-all bytes that crosses the modeled link: the rows for the
    other nodes on a scale-out link (the rest moves over NVLink/HCCS in parallel), the rows for
    the other ranks on a scale-up link or when the group fits in one node."""
    if ep <= 1:
        return 0.0
    if scale_out and ep > gpus_per_node:
        return (ep - gpus_per_node) / ep
    return (ep - 1) / ep


@dataclass(frozen=True, kw_only=True)
class CommSpec:
    """One comm library's costs (see the module docstring). ``efficiency``: per link name, the
    share of its bandwidth the library's transfers reach (1.0 for a link not listed)."""

    name: str
    efficiency: tuple[tuple[str, float], ...] = ()
    ll_efficiency: tuple[tuple[str, float], ...] = ()
    fixed_s: float = 0.0
    ll_fixed_s: float = 0.0
    fp8_dispatch: bool = False
    sm_share: float = 0.0
    counts_on_device: bool = False
    node_dedup: bool = False
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.sm_share < 1:
            raise ValueError(f"CommSpec {self.name!r}: sm_share must be in [0, 1) (got {self.sm_share!r})")
        for name, e in (*self.efficiency, *self.ll_efficiency):
            if not 0 < e <= 1:
                raise ValueError(f"CommSpec {self.name!r}: efficiency on {name} must be in (0, 1] (got {e!r})")
        if self.fixed_s < 0 or self.ll_fixed_s < 0:
            raise ValueError(f"CommSpec {self.name!r}: fixed costs must be >= 0")

    def link_efficiency(self, link: str, low_latency: bool) -> float:
        table = dict(self.ll_efficiency if low_latency and self.ll_efficiency else self.efficiency)
        return table.get(link, 1.0)


def fit_low_latency(link_Bps: float = LINKS["ib400"].bandwidth_Bps, gpus_per_node: int = 8,
                    min_ep: int = 32) -> tuple[float, float, list[tuple[int, str, float, float]]]:
    """``(fixed_s, efficiency, rows)``: the line through DeepEP's low-latency table (module
    docstring) and, per row used, ``(ep, kind, published_us, fitted_us)``."""
    copies = LL_TOKENS * LL_TOP_K
    points: list[tuple[int, str, float, float]] = []  # (ep, kind, wire bytes, us)
    for row in DEEPEP_LL:
        if row.ep < min_ep:
            continue
        share = wire_share(row.ep, gpus_per_node, scale_out=True)
        points.append((row.ep, "dispatch", copies * LL_HIDDEN * 2 * payload_scale(True) * share, row.dispatch_us))
        points.append((row.ep, "combine", copies * LL_HIDDEN * 2 * share, row.combine_us))
    n = len(points)
    mx = sum(p[2] for p in points) / n
    my = sum(p[3] for p in points) / n
    slope = sum((p[2] - mx) * (p[3] - my) for p in points) / sum((p[2] - mx) ** 2 for p in points)  # us per byte
    fixed_us = my - slope * mx
    rows = [(ep, kind, us, fixed_us + slope * b) for ep, kind, b, us in points]
    return fixed_us * 1e-6, min(1.0, 1e6 / (slope * link_Bps)), rows


def _normal_efficiency() -> tuple[tuple[str, float], ...]:
    return tuple((link, min(1.0, sum(bw) / len(bw) / peak)) for link, (bw, peak) in DEEPEP_NORMAL.items())


_LL_FIXED_S, _LL_EFF, _ = fit_low_latency()
_LL_FIXED_S = max(0.0, _LL_FIXED_S - LINKS["ib400"].latency_s)  # the sim adds the link's own latency

COMMS: dict[str, CommSpec] = {
    "a2a": CommSpec(name="a2a", source="link nominal bandwidth; counts read by the host"),
    "deepep": CommSpec(
        name="deepep", efficiency=_normal_efficiency(), ll_efficiency=(("ib400", _LL_EFF),), ll_fixed_s=_LL_FIXED_S,
        fp8_dispatch=True, sm_share=24 / 132, counts_on_device=True, node_dedup=True,
        source="DeepEP V1 tables (fit_low_latency, DEEPEP_NORMAL); 24 of 132 SMs from DeepSeek's inference overview",
    ),
}


def comm_spec(name_or_spec: str | CommSpec, **overrides: object) -> CommSpec:
    """A preset by name (``a2a``, ``deepep``), with fields overridden."""
    return preset(COMMS, name_or_spec, "comm library", **overrides)
