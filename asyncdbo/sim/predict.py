"""Predict a DBO schedule's step time on a modeled deployment: serial vs DBO, share of comm hidden.

Legend (shape suffixes): T tokens of a ubatch, D hidden, E experts, K top-k, H heads, G KV heads,
Q q_lora_rank, L kv_lora_rank, P rope dims, N nope dims, V value head dim, F projection width,
B requests of an attention call, S key positions.

**The model** is the library's: each layer is attention, then the library's
:class:`~asyncdbo.moe.MoELayer` with its ``ht`` or ``ll`` schedule, sized and routed by a real
architecture's config through :mod:`asyncdbo.models.hf` (:mod:`asyncdbo.sim.models`). Two pieces
run in their production form instead of the reference code's (see :mod:`asyncdbo.sim.kernels`):
attention is one fused kernel per request group (MLA decode absorbed into the latent, MLA
prefill expanded per head, GQA as is), and the local experts are one grouped GEMM. Dense layers
and the LM head are not modeled: the gain is the MoE layers'.

**Shapes, not numbers.** Weights and activations are meta tensors (:mod:`asyncdbo.sim.mode`):
nothing of DeepSeek-V3's width is allocated. What steers the schedule runs for real on the CPU:
routing (the library's :func:`~asyncdbo.moe.router.route` on random logits, one table per layer
and token, so the serial and the DBO run route every token the same way: uniform routing, what a
well-balanced EP deployment approaches; ``imbalance`` models the busiest rank), the dispatch plan,
counts and split sizes.

**All EP ranks in one process.** One rank of an ``ep``-rank EP group on torch's fake process group:
collectives return at once and copy input into output, so the counts exchange hands the rank its
own counts back ("every rank routes like this one"): it receives as many rows as it sends, over its
``E/ep`` local experts, the real per-expert batch of a symmetric deployment. The share of the bytes
that crosses the modeled link is :func:`~asyncdbo.sim.comm.wire_share`.

**Steady state.** A real model has tens of layers, so the ramp-up and drain of a DBO run (the
first attention and the last combine have nothing to overlap with) matter little. The prediction
runs ``layers`` MoE layers (default 3) and takes the period of one layer in the middle: from the
end of ubatch 0's layer ``L-2`` to the end of its layer ``L-1``, both followed by more work (every
layer is the same, so this is the per-layer time a deep model repeats). ``gain`` compares those
per-layer times; the makespans stay in the reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..backends import LinkSpec
from ..dbo import run_ubatches
from .backend import SimBackend, SimReport
from .comm import CommSpec, wire_share
from .counterfactual import measure_lost_overlap
from .model import (
    ModelLayer,
    attention_groups,
    chunks,
    default_requests,
    fake_ep_group,
    forward,
    meta,
    node_dedup,
    order,
)
from .shapes import WEIGHT_BYTES, Deployment, ModelShape, Request, Shape

__all__ = ["Deployment", "ModelShape", "Prediction", "Request", "default_requests", "fake_ep_group", "predict",
           "sim_trace", "simulate"]

_SCALE_OUT = ("ib400", "eth100", "roce200")


@dataclass(frozen=True)
class Prediction:
    """Serial vs DBO on one modeled rank. ``gain`` > 0: DBO is faster (0.25 = 25% more
    throughput), per layer in steady state; ``serial``/``dbo`` hold the full reports."""

    tokens: int
    shape: Shape
    serial: SimReport
    dbo: SimReport
    serial_layer_s: float
    dbo_layer_s: float
    #: the serial baseline without DBO's yields, switches and hooks (``SimBackend(plain=True)``):
    #: compute and comm on one stream, as the layer runs outside a DBO run; None where not run
    plain: SimReport | None = None
    plain_layer_s: float | None = None

    @property
    def plain_gain(self) -> float | None:
        """Serial / DBO - 1 per layer over the plain serial run (None where not run): a schedule
        that slows its own one-ubatch run (losing the overlap of a ubatch's own comm and compute)
        cannot raise it, as it raises :attr:`gain`."""
        return None if self.plain_layer_s is None else self.plain_layer_s / self.dbo_layer_s - 1.0

    @property
    def serial_s(self) -> float:
        return self.serial.makespan_s

    @property
    def dbo_s(self) -> float:
        return self.dbo.makespan_s

    @property
    def gain(self) -> float:
        """Serial / DBO - 1 per layer, over the one-ubatch run (calibrated: docs/sim.md)."""
        return self.serial_layer_s / self.dbo_layer_s - 1.0

    @property
    def hidden_comm_share(self) -> float:
        return self.dbo.hidden_comm_share


def _cuts(tokens: int, ubatches: int, ubatch_tokens: Sequence[int] | None) -> list[int]:
    if ubatch_tokens is None:
        step = math.ceil(tokens / ubatches)
        return [min(step, max(0, tokens - i * step)) for i in range(ubatches)]
    cuts = list(ubatch_tokens)
    if len(cuts) != ubatches or min(cuts) < 0 or sum(cuts) != tokens:
        raise ValueError(f"ubatch_tokens {cuts} must split {tokens} tokens into {ubatches} parts")
    return cuts


async def simulate(
    requests: Sequence[Request],
    splits: Sequence[Sequence[int]],
    *,
    model: ModelShape,
    shape: Shape,
    deployment: Deployment,
    stream_policy: Literal["role", "ubatch"] = "role",
    check_races: bool = True,
    fail_on: Sequence[str] = (),
    seed: int = 0,
    plain: Sequence[bool] = (),
) -> list[tuple[SimReport, float]]:
    """Run ``model`` on one rank's ``requests`` once per split (ubatch token counts; ``[T]`` is the
    serial run) with the same weights and routing; return each run's report and per-layer time.
    ``plain[i]``: split ``i`` (of one ubatch) runs as the serial baseline without DBO
    (``SimBackend(plain=True)``)."""
    m, d = model, deployment.resolved(shape)
    if m.experts % d.ep:
        raise ValueError(f"{m.name}: experts ({m.experts}) must be divisible by ep ({d.ep})")
    reqs = order(requests)
    tokens = sum(q for q, _ in reqs)
    for parts in splits:
        if sum(parts) != tokens or min(parts) < 0:
            raise ValueError(f"split {list(parts)} must divide the {tokens} tokens of the requests")
    assert isinstance(d.link, LinkSpec) and isinstance(d.comm, CommSpec)
    gen = torch.Generator().manual_seed(seed)
    scale_out = d.link.name in _SCALE_OUT
    scale = wire_share(d.ep, d.gpus_per_node, scale_out=scale_out)
    most = max(len(parts) for parts in splits)
    out = []
    with torch.no_grad(), fake_ep_group(d.ep) as group:
        layers = [ModelLayer(m, i, str(d.schedule), group, most, tokens, gen, d.moe) for i in range(m.layers)]
        dedup = node_dedup(layers[0].table[1], m.experts // d.ep, d.ep, d.gpus_per_node, scale) if scale_out else 1.0
        weights = [t for layer in layers for t in layer.weights()]
        x_TD = meta(tokens, m.hidden)
        for i, parts in enumerate(splits):
            share = 1.0 - d.comm.sm_share if len(parts) > 1 and d.schedule == "ht" else 1.0
            assert d.host is not None
            config = dict(device=d.device, link=d.link, comm=d.comm, host=d.host, check_races=check_races,
                          fail_on=fail_on, comm_scale=scale, weights=weights, weight_bytes=WEIGHT_BYTES[m.weights],
                          compute_share=share, contention=d.contention, imbalance=d.imbalance, node_dedup=dedup,
                          plain=i < len(plain) and plain[i])

            def make(_config: dict[str, Any] = config, **overrides: Any) -> SimBackend:
                return SimBackend(**{**_config, **overrides})

            async def run(be: SimBackend, _parts: Sequence[int] = parts) -> list[float]:
                args: list[tuple[Any, ...]] = []
                lo, marks = 0, dict[int, list[float]]()
                for n in _parts:
                    args.append((layers, x_TD[lo:lo + n], attention_groups(chunks(reqs, lo, lo + n)), lo, lo + n, marks))
                    lo += n
                await run_ubatches(forward, args, backend=be, stream_policy=stream_policy)
                return marks[0]

            # Lost overlap is costed by a counterfactual run per finding (asyncdbo.sim.counterfactual).
            # Host syncs also by the cost model with eager launches on this device: a GPU pays them at any size.
            report, ends = await measure_lost_overlap(run, make, estimate={"host": "eager"})
            per_layer = ends[-2] - ends[-3] if m.layers > 2 else (ends[-1] - ends[0] if m.layers == 2 else report.makespan_s)
            out.append((report, per_layer))
    return out


async def predict(
    tokens: int,
    *,
    model: ModelShape | str = "deepseek-v3",
    shape: Shape = "decode",
    context: int | None = None,
    deployment: Deployment = Deployment(),
    ubatches: int = 2,
    stream_policy: Literal["role", "ubatch"] = "role",
    check_races: bool = True,
    fail_on: Sequence[str] = (),
    requests: Sequence[Request] | None = None,
    ubatch_tokens: Sequence[int] | None = None,
    seed: int = 0,
    spec_tokens: int = 0,
) -> Prediction:
    """Run ``model`` on ``tokens`` tokens of one rank, serially (one ubatch, and the plain serial
    baseline without DBO: :attr:`Prediction.plain_gain`) and as ``ubatches`` DBO ubatches, on the
    sim backend; return the reports. ``requests`` (default: from ``shape``
    and ``context``) lays the tokens out; ``ubatch_tokens`` sets the DBO split (default: equal).
    ``spec_tokens``: decode requests carry ``1 + spec_tokens`` tokens each (MTP, speculative
    verify), attended in the decode form (:func:`asyncdbo.sim.model.is_decode`)."""
    m = ModelShape.of(model) if isinstance(model, str) else model
    if shape not in ("decode", "prefill"):
        raise ValueError(f"shape must be 'decode' or 'prefill' (got {shape!r})")
    if not 1 <= ubatches <= 8:
        raise ValueError(f"ubatches must be between 1 and 8 (got {ubatches})")
    if tokens < ubatches:
        raise ValueError(f"tokens ({tokens}) must be >= ubatches ({ubatches}) so that every ubatch gets a token")
    reqs = list(requests) if requests is not None else default_requests(
        tokens, shape, context or (2000 if shape == "decode" else 4096), spec_tokens)
    if sum(q for q, _ in reqs) != tokens:
        raise ValueError(f"requests hold {sum(q for q, _ in reqs)} tokens, not {tokens}")
    q = 1 + spec_tokens if shape == "decode" and requests is None else 1
    if ubatch_tokens is None and q > 1:  # whole requests per ubatch, as the planner cuts a uniform decode
        cuts = [n * q for n in _cuts(tokens // q, ubatches, None)]
    else:
        cuts = _cuts(tokens, ubatches, ubatch_tokens)
    (serial, serial_layer), (plain, plain_layer), (dbo, dbo_layer) = await simulate(
        reqs, [[tokens], [tokens], cuts], model=m, shape=shape, deployment=deployment, stream_policy=stream_policy,
        check_races=check_races, fail_on=fail_on, seed=seed, plain=[False, True, False])
    return Prediction(tokens, shape, serial, dbo, serial_layer, dbo_layer, plain, plain_layer)


def sim_trace(report: SimReport, *, rank: int = 0, label: str = "") -> dict[str, Any]:
    """A Chrome trace (Perfetto, ``asyncdbo trace`` PNGs) of one sim run, in the layout of
    :meth:`asyncdbo.trace.Tracer.to_chrome` for device spans: pid = rank, one thread per (ubatch,
    stream role) with tid ``ub * 100 + 50`` (compute) or ``+ 60`` (comm) plus a lane when spans of
    one thread overlap; ``ts``/``dur`` in microseconds of the virtual clock; the run's numbers
    under ``otherData.asyncdbo.ranks[0].steps`` with the Tracer's field names."""
    from .report import chrome_trace

    return chrome_trace(report, rank=rank, label=label)
