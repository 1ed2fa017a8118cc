"""Predict a DBO schedule's step time on a modeled device: serial vs DBO, share of comm hidden.

Legend (shape suffixes): T tokens on this rank, D hidden, H heads, C attention context (decode:
cached tokens per request), Q head dim, F = H*Q.

**The model.** ``layers`` x [RMSNorm -> attention -> residual -> reference :class:`MoELayer`
(routed experts over EP, shared experts, ``ht`` or ``ll`` schedule) -> residual]. Attention is
written with explicit matmuls so torch's FLOP formulas see it: decode attends each token's heads
to its own ``context`` cached keys/values with one shared KV head (MQA; DeepSeek's MLA also reads
one latent per cached token), prefill is causal over the rank's
tokens as one sequence. Every op runs for real on the CPU; its duration comes from the cost model.

**All EP ranks in one process.** The prediction models one rank of an ``ep``-rank EP group on
torch's fake process group (``backend="fake"``): collectives return at once and copy their input
into their output (an all-to-all with equal splits hands each rank back its own rows), so nothing
leaves the process. That is the "every rank routes like this one" assumption: with symmetric
routing a rank receives as many rows as it sends, so its expert GEMMs get ``T*K`` rows over its
``E/ep`` local experts (the real per-expert batch) and its all-to-alls carry the real byte
counts. The comm time counts the ``(ep-1)/ep`` share of those bytes that leaves the rank, at the
device's element size. What the fake group loses is the *values* of the MoE output (rows are
processed by this rank's experts, not their owners'), so a prediction's outputs are not the real
model's numbers; its FLOPs, bytes and schedule are. Correctness is what the host backend's
multi-rank tests are for.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..backends import LinkSpec
from ..dbo import run_ubatches
from .backend import SimBackend, SimReport
from .devices import DeviceSpec

__all__ = ["ModelShape", "Prediction", "predict", "sim_trace"]

Shape = Literal["decode", "prefill"]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The modeled model and parallel layout. Defaults are DeepSeek-V3's routing (top-8, one
    shared expert, EP wide enough for 2 experts per rank) at a width a CPU runs in seconds
    (hidden 2048 instead of 7168, expert intermediate 1024 instead of 2048, 64 experts)."""

    layers: int = 2
    hidden: int = 2048
    intermediate: int = 1024
    experts: int = 64
    top_k: int = 8
    shared_experts: int = 1
    heads: int = 16
    head_dim: int = 128
    context: int = 1024
    ep: int = 32
    schedule: Literal["ht", "ll"] = "ht"

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "intermediate", "experts", "top_k", "heads", "head_dim", "context", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape.{name} must be an integer >= 1 (got {v!r})")
        if self.experts % self.ep:
            raise ValueError(f"ModelShape: experts ({self.experts}) must be divisible by ep ({self.ep})")
        if self.schedule not in ("ht", "ll"):
            raise ValueError(f"ModelShape.schedule must be 'ht' or 'll' (got {self.schedule!r})")


@dataclass(frozen=True)
class Prediction:
    """Serial vs DBO on one modeled rank. ``gain`` > 0: DBO is faster (0.25 = 25% more
    throughput); ``serial``/``dbo`` hold the full reports (timelines, races)."""

    tokens: int
    shape: Shape
    serial: SimReport
    dbo: SimReport

    @property
    def serial_s(self) -> float:
        return self.serial.makespan_s

    @property
    def dbo_s(self) -> float:
        return self.dbo.makespan_s

    @property
    def gain(self) -> float:
        return self.serial_s / self.dbo_s - 1.0

    @property
    def hidden_comm_share(self) -> float:
        return self.dbo.hidden_comm_share


# ------------------------------------------------------------------------ the fake EP world
_WORLD = 1 << 16
_groups: dict[int, Any] = {}


@contextlib.contextmanager
def fake_ep_group(ep: int) -> Iterator[Any]:
    """An ``ep``-rank fake process group (this process is rank 0), torn down afterwards if this
    call created the fake world. None for ``ep == 1``. Refuses a process that already runs a real
    torch.distributed world: the prediction must not join its collectives."""
    if ep == 1:
        yield None
        return
    created = False
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=_WORLD)
        created = True
    elif dist.get_backend() != "fake":
        raise ValueError(
            f"predict() needs its own fake torch.distributed world, but this process already runs a "
            f"{dist.get_backend()!r} one; run the prediction in a separate process (e.g. `asyncdbo check`)"
        )
    try:
        group = _groups.get(ep)
        if group is None:
            group = _groups[ep] = dist.new_group(list(range(ep)), backend="fake")
        yield group
    finally:
        if created:
            _forget(list(_groups.values()))
            _groups.clear()
            dist.destroy_process_group()


def _forget(groups: list[Any]) -> None:
    """Drop asyncdbo's caches of ``groups`` (EP comm state, per-ubatch clones): they die with the
    fake world, and a later world reuses their ids and names."""
    from ..dist.ep import forget_ep_comm

    for g in groups:
        forget_ep_comm(g)


# ------------------------------------------------------------------------ the modeled model
class _Block:
    """One transformer layer: attention (explicit matmuls) + the reference MoE layer."""

    def __init__(self, m: ModelShape, layer: int, group: Any, gen: torch.Generator) -> None:
        from ..moe import MoEConfig, MoELayer

        D, F = m.hidden, m.heads * m.head_dim
        self.m = m
        self.qkv_DF3 = torch.randn(D, 3 * F, generator=gen) * D**-0.5
        self.o_FD = torch.randn(F, D, generator=gen) * F**-0.5
        cfg = MoEConfig(
            hidden_size=D, intermediate_size=m.intermediate, num_experts=m.experts, top_k=m.top_k,
            num_shared_experts=m.shared_experts, schedule=m.schedule,
            deterministic=False,  # the modeled device is an accelerator, where the mode is off by default
        )
        self.moe = MoELayer(cfg, ep_group=group, seed=layer, max_ubatches=2)

    def attention(self, h_TD: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        m = self.m
        T = h_TD.shape[0]
        q_TF, k_TF, v_TF = (h_TD @ self.qkv_DF3).split(m.heads * m.head_dim, dim=1)
        if kv is None:  # prefill: causal over this ubatch's tokens
            q_HTQ = q_TF.view(T, m.heads, m.head_dim).transpose(0, 1)
            k_HTQ = k_TF.view(T, m.heads, m.head_dim).transpose(0, 1)
            v_HTQ = v_TF.view(T, m.heads, m.head_dim).transpose(0, 1)
            s_HTT = torch.bmm(q_HTQ, k_HTQ.transpose(1, 2)) * m.head_dim**-0.5
            mask_TT = torch.ones(T, T, dtype=torch.bool).triu(1)
            a_HTQ = torch.bmm(torch.softmax(s_HTT.masked_fill(mask_TT, float("-inf")), dim=-1), v_HTQ)
            o_TF = a_HTQ.transpose(0, 1).reshape(T, -1)
        else:  # decode: each token's heads attend to its request's cached context (one KV head)
            k_TCQ, v_TCQ = kv
            q_THQ = q_TF.view(T, m.heads, m.head_dim)
            s_THC = torch.bmm(q_THQ, k_TCQ.transpose(1, 2)) * m.head_dim**-0.5
            o_TF = torch.bmm(torch.softmax(s_THC, dim=-1), v_TCQ).reshape(T, -1)
        return o_TF @ self.o_FD


def _rms(x_TD: torch.Tensor) -> torch.Tensor:
    return x_TD * torch.rsqrt(x_TD.pow(2).mean(-1, keepdim=True) + 1e-6)


async def _forward(blocks: list[_Block], x_TD: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
    for i, b in enumerate(blocks):
        x_TD = x_TD + b.attention(_rms(x_TD), None if kv is None else kv[i])
        x_TD = x_TD + await b.moe.forward(_rms(x_TD))
    return x_TD


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    step = math.ceil(n / parts)
    return [(i, min(n, i + step)) for i in range(0, n, step)]


async def predict(
    tokens: int,
    *,
    model: ModelShape = ModelShape(),
    shape: Shape = "decode",
    device: str | DeviceSpec = "h200",
    link: str | LinkSpec = "ib400",
    ubatches: int = 2,
    stream_policy: Literal["role", "ubatch"] = "role",
    check_races: bool = False,
    seed: int = 0,
) -> Prediction:
    """Run the modeled model on ``tokens`` tokens of one rank, serially (one ubatch) and as
    ``ubatches`` DBO ubatches, on the sim backend; return both reports."""
    if tokens < ubatches:
        raise ValueError(f"tokens ({tokens}) must be >= ubatches ({ubatches}) so that every ubatch gets a token")
    if shape not in ("decode", "prefill"):
        raise ValueError(f"shape must be 'decode' or 'prefill' (got {shape!r})")
    gen = torch.Generator().manual_seed(seed)
    scale = (model.ep - 1) / model.ep
    with torch.no_grad(), fake_ep_group(model.ep) as group:
        blocks = [_Block(model, i, group, gen) for i in range(model.layers)]
        x_TD = torch.randn(tokens, model.hidden, generator=gen)
        kv = None
        if shape == "decode":
            kv = [
                (torch.randn(tokens, model.context, model.head_dim, generator=gen), torch.randn(tokens, model.context, model.head_dim, generator=gen))
                for _ in blocks
            ]

        async def run(parts: int) -> SimReport:
            be = SimBackend(device=device, link=link, check_races=check_races, comm_scale=scale)
            args = []
            for lo, hi in _split(tokens, parts):
                ub_kv = None if kv is None else [(k[lo:hi], v[lo:hi]) for k, v in kv]
                args.append((blocks, x_TD[lo:hi], ub_kv))
            await run_ubatches(_forward, args, backend=be, stream_policy=stream_policy)
            assert be.report is not None
            return be.report

        serial = await run(1)  # the serial baseline: one ubatch, same schedule
        dbo = await run(ubatches)
    return Prediction(tokens, shape, serial, dbo)


def sim_trace(report: SimReport, *, rank: int = 0, label: str = "") -> dict[str, Any]:
    """A Chrome trace (Perfetto, ``asyncdbo trace`` PNGs) of one sim run, in the layout of
    :meth:`asyncdbo.observe.Tracer.to_chrome` for device spans: pid = rank, one thread per (ubatch,
    stream role) with tid ``ub * 100 + 50`` (compute) or ``+ 60`` (comm) plus a lane when spans of
    one thread overlap; ``ts``/``dur`` in microseconds of the virtual clock; the run's numbers
    under ``otherData.asyncdbo.ranks[0].steps`` with the Tracer's field names."""
    name = f"rank {rank} (sim {report.device} + {report.link}{', ' + label if label else ''})"
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    lanes: dict[tuple[int, str], list[float]] = {}
    named: set[int] = set()
    for s in sorted(report.spans, key=lambda s: s.start):
        ub = s.ubatch or 0
        ends = lanes.setdefault((ub, s.kind), [])
        lane = next((k for k, e in enumerate(ends) if s.start >= e - 1e-12), len(ends))
        if lane == len(ends):
            ends.append(s.end)
        else:
            ends[lane] = s.end
        tid = ub * 100 + (50 if s.kind == "compute" else 60) + lane
        if tid not in named:
            named.add(tid)
            label_t = f"ub{ub} {s.kind} stream" + (f" {lane}" if lane else "")
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label_t}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
        args = {"ub": ub, "kind": s.kind, "role": s.kind, "device": True, "stream": s.stream, "tag": s.tag, "step": 0}
        events.append({"ph": "X", "name": s.name, "cat": s.kind, "pid": rank, "tid": tid, "ts": s.start * 1e6,
                       "dur": (s.end - s.start) * 1e6, "args": args})
    comm_s = report.comm_s
    step = {
        "step": 0, "rank": rank, "name": label or "sim", "backend": f"sim ({report.device}, {report.link})",
        "num_ubatches": report.num_ubatches, "wall_s": report.makespan_s, "switches": report.switches,
        "parks": report.parks, "yields_per_ubatch": [], "parked_s": 0.0,
        "idle_s": max(0.0, report.makespan_s - report.compute_busy_s), "compute_s": report.compute_busy_s,
        "comm_s": comm_s, "comm_hidden_s": comm_s - report.exposed_comm_s,
        "comm_hidden_share": report.hidden_comm_share, "num_comm_works": sum(1 for s in report.spans if s.kind == "comm"),
        "comm_bytes": report.comm_bytes, "microbatched": report.num_ubatches > 1,
        "reason": None if report.num_ubatches > 1 else "serial baseline",
    }
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"asyncdbo": {"ranks": [{"rank": rank, "steps": [step]}], "clock": "sim"}},
    }


def with_overrides(m: ModelShape, **kw: Any) -> ModelShape:
    """``m`` with the fields in ``kw`` that are not None replaced."""
    return replace(m, **{k: v for k, v in kw.items() if v is not None})
