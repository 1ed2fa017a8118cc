"""A first analytical prediction of what DBO gains for a dense model under tensor parallelism:
each rank's layer as GEMMs, attention and norms priced on a :class:`~asyncdbo.sim.devices.DeviceSpec`,
its two row-parallel all-reduces as NCCL's ring on a :class:`~asyncdbo.backends.links.LinkSpec`, and
the DBO step as two ubatches taking turns on one compute and one comm resource.

This is not the op-by-op simulator of :mod:`asyncdbo.sim.predict` (which runs the real MoE model on
meta tensors): the dense layer is a closed formula, and nothing in it is fitted to a dense-TP
measurement.  It reuses the device constants the MoE sim calibrated (GEMM and memory efficiency,
kernel overhead, GEMM tile: :mod:`asyncdbo.sim.devices`) and the links' nominal rates; the
comparison points in docs/sim.md say how far that carries.

Per layer and ubatch of ``T`` tokens (``P`` ranks, ``H``/``G`` heads/KV heads, ``K`` head dim,
``D`` hidden, ``I`` intermediate, bf16):

* GEMMs ``qkv`` (``D -> (H + 2G) K / P``), ``o`` (``H K / P -> D``), ``gate_up`` (``D -> 2 I / P``),
  ``down`` (``I / P -> D``): ``max(2 M' N K / (peak * gemm_eff), bytes / (hbm * mem_eff))`` plus
  the kernel overhead, ``M'`` the rows rounded up to the GEMM tile;
* attention: prefill ``2 B (H/P) S (S+1)/2 * 2K`` FLOPs, decode the KV cache read
  ``B C 2 (G/P) K * 2`` bytes;
* two fused residual-add + RMSNorm and the SwiGLU product: memory-bound, small kernels;
* two all-reduces of ``T D * 2`` bytes: ``2 (P-1) * latency + 2 (P-1)/P * bytes / bandwidth``.

Serial: every piece in turn.  DBO with two ubatches of ``T/2``: the compute resource runs ub0's
stage, ub1's stage, ub0's next..., a stage waiting for its own previous all-reduce; the comm
resource runs the all-reduces in issue order; compute that runs while an all-reduce is in flight is
slowed by ``comm_sm_share`` (the SMs NCCL's kernels hold).
"""

# Shape legend: T = tokens of a step (or ubatch), B = requests, S = prompt length, C = context.

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..backends.links import LinkSpec, link_spec
from .devices import DeviceSpec, device_spec

__all__ = ["DENSE_SHAPES", "DenseShape", "DensePrediction", "all_reduce_s", "dense_shape", "layer_stages",
           "predict_dense_tp", "ubatches_makespan"]


@dataclass(frozen=True)
class DenseShape:
    """The sizes of a dense decoder, from its published ``config.json``."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int


#: Llama-3-8B and -70B (meta-llama ``config.json``), Qwen3-32B (Qwen ``config.json``).
DENSE_SHAPES: dict[str, DenseShape] = {
    "llama-3-8b": DenseShape("llama-3-8b", 4096, 14336, 32, 8, 128, 32),
    "llama-3-70b": DenseShape("llama-3-70b", 8192, 28672, 64, 8, 128, 80),
    "qwen3-32b": DenseShape("qwen3-32b", 5120, 25600, 64, 8, 128, 64),
}


@dataclass(frozen=True)
class DensePrediction:
    """One prediction: serial and DBO step time, the all-reduces' share of the serial step."""

    serial_s: float
    dbo_s: float
    comm_s: float

    @property
    def gain(self) -> float:
        return self.serial_s / self.dbo_s

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.serial_s


def _gemm(dev: DeviceSpec, m: int, n: int, k: int) -> float:
    rows = math.ceil(m / dev.min_tile) * dev.min_tile if m else 0
    flops = 2.0 * rows * n * k
    nbytes = (m * k + n * k + m * n) * dev.dtype_bytes
    return max(flops / (dev.peak_flops * dev.gemm_efficiency), nbytes / (dev.hbm_Bps * dev.mem_efficiency)) \
        + dev.kernel_overhead_s


def _memory(dev: DeviceSpec, nbytes: float) -> float:
    return nbytes / (dev.hbm_Bps * dev.mem_efficiency) + dev.small_kernel_overhead_s


def _attention(dev: DeviceSpec, m: DenseShape, tp: int, reqs: Sequence[tuple[int, int]]) -> float:
    """One layer's attention over ``reqs`` (``(query tokens, cached tokens)`` each): a one-token
    request reads its KV cache (memory-bound, ``C 2 (G/P) K * 2`` bytes); a longer one is a
    prefill chunk, ``2 (H/P) q (c + (q+1)/2) * 2K`` causal FLOPs or reading its q, k, v and o,
    whichever takes longer. One kernel for the lot."""
    Hp, Gp, K, b = m.heads // tp, max(1, m.kv_heads // tp), m.head_dim, dev.dtype_bytes
    kv_bytes = sum(c * 2 * Gp * K * b for q, c in reqs if q == 1)
    flops = sum(2.0 * Hp * q * (c + (q + 1) / 2) * 2 * K for q, c in reqs if q > 1)
    chunk_tokens = sum(q for q, _ in reqs if q > 1)
    t = dev.kernel_overhead_s
    if kv_bytes:
        t += _memory(dev, kv_bytes)
    if chunk_tokens:
        t += max(flops / (dev.peak_flops * dev.gemm_efficiency),
                 4 * chunk_tokens * Hp * K * b / (dev.hbm_Bps * dev.mem_efficiency))
    return t


def layer_stages(dev: DeviceSpec, m: DenseShape, tp: int, reqs: Sequence[tuple[int, int]]) -> tuple[float, float, float]:
    """One layer of one (u)batch of ``reqs`` (``(query tokens, cached tokens)`` each):
    attention-block compute, MLP-block compute, one all-reduce's bytes."""
    T = sum(q for q, _ in reqs)
    Hp, Gp, K, D, Ip = m.heads // tp, max(1, m.kv_heads // tp), m.head_dim, m.hidden, m.intermediate // tp
    b = dev.dtype_bytes
    norm = _memory(dev, 3 * T * D * b)
    attn_block = norm + _gemm(dev, T, (Hp + 2 * Gp) * K, D) + _attention(dev, m, tp, reqs) + _gemm(dev, T, D, Hp * K)
    mlp_block = norm + _gemm(dev, T, 2 * Ip, D) + _memory(dev, 3 * T * Ip * b) + _gemm(dev, T, D, Ip)
    return attn_block, mlp_block, float(T * D * b)


def _stages(dev: DeviceSpec, m: DenseShape, tp: int, requests: int, length: int,
            decode: bool) -> tuple[float, float, float]:
    """:func:`layer_stages` of ``requests`` decodes at context ``length``, or prompts of ``length``."""
    return layer_stages(dev, m, tp, [(1, length)] * requests if decode else [(length, 0)] * requests)


def all_reduce_s(link: LinkSpec, tp: int, nbytes: float) -> float:
    """NCCL's ring all-reduce of ``nbytes`` over ``tp`` ranks."""
    return 2 * (tp - 1) * link.latency_s + 2 * (tp - 1) / tp * nbytes / link.bandwidth_Bps


def dense_shape(model: str | DenseShape, tp: int) -> DenseShape:
    """``model`` (a :data:`DENSE_SHAPES` name or a shape), refused unless its heads and MLP
    columns divide over ``tp`` ranks."""
    m = DENSE_SHAPES[model] if isinstance(model, str) else model
    if tp < 1 or m.heads % tp or m.intermediate % tp:
        raise ValueError(f"{m.name}'s {m.heads} heads and {m.intermediate} intermediate columns do not divide over "
                         f"TP {tp}; use a TP size that divides both")
    return m


def predict_dense_tp(model: str | DenseShape, *, tp: int, device: str | DeviceSpec = "h100",
                     link: str | LinkSpec = "nvlink", requests: int, length: int, decode: bool,
                     comm_sm_share: float = 0.15) -> DensePrediction:
    """Serial and two-ubatch DBO step time of a dense model on ``tp`` ranks (module docstring):
    a prefill of ``requests`` prompts of ``length`` tokens, or a decode step of ``requests``
    requests at context ``length``."""
    m = dense_shape(model, tp)
    if requests < 2 or not 0 <= comm_sm_share < 1:
        raise ValueError(f"predict_dense_tp needs requests >= 2 (two ubatches) and comm_sm_share in [0, 1) "
                         f"(got {requests}, {comm_sm_share})")
    dev, lk = device_spec(device), link_spec(link)
    a, f, nbytes = _stages(dev, m, tp, requests, length, decode)
    ar = all_reduce_s(lk, tp, nbytes)
    serial = m.layers * (a + f + 2 * ar)
    half = requests // 2
    ha, hf, hbytes = _stages(dev, m, tp, half, length, decode)
    har = all_reduce_s(lk, tp, hbytes)
    return DensePrediction(serial_s=serial, dbo_s=_two_ubatches(m.layers, (ha, hf), har, comm_sm_share),
                           comm_s=m.layers * 2 * ar)


def _two_ubatches(layers: int, stages: tuple[float, float], ar: float, share: float) -> float:
    """The makespan of two equal ubatches (:func:`ubatches_makespan`)."""
    return ubatches_makespan(layers, [stages, stages], [ar, ar], share)


def ubatches_makespan(layers: int, stages: Sequence[tuple[float, float]], ars: Sequence[float], share: float) -> float:
    """The makespan of ubatches taking turns on one compute and one comm resource: per layer and
    stage (attention block, MLP block), ubatch ``u``'s compute of ``stages[u]`` after its previous
    all-reduce, then its all-reduce of ``ars[u]`` seconds on the comm resource in issue order;
    compute runs at ``1 - share`` speed while an all-reduce is in flight. One ubatch is the serial
    step."""
    n = len(stages)
    compute_free = comm_free = 0.0
    ready = [0.0] * n  # when each ubatch's last all-reduce completes
    in_flight: list[tuple[float, float]] = []  # (start, end) of the all-reduces issued so far
    for _ in range(layers):
        for k in (0, 1):
            for u in range(n):
                start = max(compute_free, ready[u])
                end = _slowed(start, stages[u][k], in_flight[-(n + 2):], share)
                compute_free = end
                ar_start = max(comm_free, end)
                comm_free = ready[u] = ar_start + ars[u]
                in_flight.append((ar_start, comm_free))
    return max(compute_free, comm_free)


def _slowed(start: float, work: float, in_flight: list[tuple[float, float]], share: float) -> float:
    """When compute of ``work`` seconds started at ``start`` ends, running at ``1 - share`` speed
    while an all-reduce is in flight."""
    t, left = start, work
    for a, b in sorted(in_flight):  # the caller passes the last few: only those can still be in flight
        if b <= t or left <= 0:
            continue
        if a > t:  # full speed until it starts
            run = min(left, a - t)
            t, left = t + run, left - run
            if left <= 0:
                break
        span = b - max(a, t)
        done = span * (1 - share)
        if done >= left:
            return t + left / (1 - share)
        t, left = b, left - done
    return t + left
