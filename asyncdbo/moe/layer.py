"""The DP+EP MoE layer, written once as ``async def``, with the DBO yields where vLLM puts them.

Legend (shape suffixes): T tokens of this call, D hidden, F expert intermediate, S shared-expert
intermediate, E experts, L local experts (E / EP size), K top-k, R rows received by this rank,
N = T*K routed pairs.

One ``forward`` serves three situations with the same numbers:

* a plain call (outside DBO): every primitive is a no-op and every collective is synchronous;
* a DBO run with **role streams** (vLLM): the layer switches between the compute and the comm
  stream with the ``dbo_yield_and_switch_*`` primitives;
* a DBO run with **ubatch streams** (the CANN prefill case): each ubatch owns a compute and a
  comm stream, so the layer orders its stages (routed -> dispatched -> experts -> combined) with
  explicit ``dbo_record_event``/``dbo_wait_event`` pairs keyed by (layer, call, ubatch, stage)
  around plain role switches, and yields with ``dbo_yield`` at the same points. The layer asks
  ``dbo_stream_policy()`` which one it runs under; no option is needed.

Schedules (``MoEConfig.schedule``), per ubatch and layer:

* ``ht``: issue the counts exchange, yield "dispatch", read the counts (the CPU waits for the
  peers here, after the other ubatch's compute was queued), dispatch on comm, sync back to compute,
  experts, yield "combine", combine on comm, shared expert on compute while it is in flight, yield
  "combine_done" (host: parks until the combine arrived), weighted sum. Three yields.
* ``ll``: no comm stream. Each half issues its sends *before* it yields (the dispatch: counts,
  then the rows; the combine: the rows) and registers the receive as a recv hook; the *next*
  ubatch launches that receive after queuing its own compute (``dbo_maybe_run_recv_hook`` at the
  start of its own prepare/finalize). On a device the hook makes the shared compute stream wait
  for the transfer there (DeepEP's receive, vLLM's hook), and the owner awaits the hook and its
  handle before it touches the received rows (the handle orders its own stream under the ubatch
  policy; on the host, where a hook cannot receive, the owner parks on the transfer). Two yields.

Inside :func:`asyncdbo.dist.dispatch_options` either schedule may send the counts and the rows as
one message (a header row in a fixed-capacity buffer) where the run's link model says it pays
(:mod:`asyncdbo.dist.fused`); the numbers are the same bit for bit.

**Host syncs.** On an accelerator the layer runs sync-free by default (``MoEConfig.sync_free``):
counts, offsets and splits stay on the device in fixed-size blocks and windows
(:mod:`asyncdbo.dist.ep`), so nothing between two yields makes the host wait for the device (under
EP > 1 inside :func:`asyncdbo.dist.dispatch_options`, which gives every rank the same bound).
On a CPU it keeps the exact sizes: nothing waits for a sync there, and the fixed windows compute
``E / K`` times the expert rows on one rank, more under EP (``benchmarks/sync_free.py``
measures both paths on a CPU).

Every ubatch takes part in every collective even with T = 0: the other ranks' same ubatch waits
for it. So under EP every rank must run the same number of ubatches through the same layers in
a DBO run (pad with empty ubatches); a rank that runs fewer leaves its peers waiting until the
group's collective timeout.
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from .._core import get_ubatch
from ..dbo import (
    dbo_maybe_run_recv_hook,
    dbo_record_event,
    dbo_register_recv_hook,
    dbo_stream_policy,
    dbo_switch_to_comm,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_wait_event,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)
from ..dist.ep import DispatchPlan, EPComm, ep_comm, plan_dispatch
from ..dist.fused import fused_rows, padded_window
from .batch_invariant import ROW_TILE, is_deterministic, swiglu
from .config import MoEConfig
from .experts import expert_init, router_init, run_experts, run_experts_padded, shared_init
from .router import route

__all__ = ["MoELayer"]

_layer_ids = itertools.count()

# Per-ubatch MoE call counts by layer name: set inside a ubatch, so each ubatch's own context
# (a copy made at run start) holds its own dict and no other run or ubatch sees it.
_CALLS: contextvars.ContextVar[dict[str, int]] = contextvars.ContextVar("asyncdbo_moe_calls")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _Stages:
    """Stage ordering for one call under the ubatch-stream policy: record, then wait, per key."""

    __slots__ = ("prefix",)

    def __init__(self, prefix: tuple[Hashable, ...]) -> None:
        self.prefix = prefix

    def record(self, stage: str) -> None:
        dbo_record_event((*self.prefix, stage))

    def wait(self, stage: str) -> Any:
        return dbo_wait_event((*self.prefix, stage))


def _noop() -> None:
    return None


def _receive(handle: Any) -> Any:
    """The recv hook of a low-latency transfer: under role streams, the stream wait that the next
    ubatch issues on the shared compute stream after queuing its own compute; under per-ubatch
    streams nothing (the owner's own stream waits when it awaits the handle)."""
    return handle.stream_wait if dbo_stream_policy() == "role" else _noop


async def _to_comm(st: Any, tag: str, *, after: str) -> None:
    """Yield and continue on the comm stream: a sync role switch under role streams; under
    per-ubatch streams an explicit record of stage ``after`` on compute, the yield, a plain switch
    and a wait on the record (the CANN pattern)."""
    if st is None:
        await dbo_yield_and_switch_from_compute_to_comm(tag)
    else:
        st.record(after)
        await dbo_yield(tag)
        await dbo_switch_to_comm()
        await st.wait(after)


async def _to_compute(st: Any, *, after: str) -> None:
    """Continue on the compute stream after this ubatch's comm so far (no yield): a sync switch,
    or under per-ubatch streams a record of stage ``after`` on comm, a switch and a wait."""
    if st is None:
        await dbo_switch_to_compute_sync()  # host: parks until the comm arrived
    else:
        st.record(after)
        await dbo_switch_to_compute()
        await st.wait(after)


def _empty_weights(cfg: MoEConfig, local: int, dtype: torch.dtype) -> tuple[Any, ...]:
    """Uninitialised weights of the shapes :func:`router_init`, :func:`expert_init` and
    :func:`shared_init` give (the correction bias zeroed: a checkpoint may lack it), allocated in
    the dtype they are kept in: no float32 twin of a bf16 layer's experts is made on the way (at
    Mixtral's width that twin would be 2.8 GB per layer and rank)."""
    E, D, Fi, S = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size
    bias_E = torch.zeros(E) if cfg.scoring == "sigmoid" else None
    router_dtype = dtype if cfg.scoring == "softmax" else torch.float32
    shared = None if S == 0 else {"gate_proj": torch.empty(S, D, dtype=dtype), "up_proj": torch.empty(S, D, dtype=dtype),
                                  "down_proj": torch.empty(D, S, dtype=dtype)}
    return (torch.empty(E, D, dtype=router_dtype), bias_E, torch.empty(local, Fi, D, dtype=dtype),
            torch.empty(local, Fi, D, dtype=dtype), torch.empty(local, D, Fi, dtype=dtype), shared)


class MoELayer(nn.Module):
    """A routed-experts layer (plus optional shared experts) under DP+EP, as ``async def``.

    Every rank derives the same global weights from ``seed`` and keeps its shard (experts
    ``rank*L .. rank*L+L-1``); router, correction bias and shared experts are replicated
    (``init_weights=False`` skips the seeded draw and leaves the weights uninitialised, for a
    loader that fills them from a checkpoint). EP size
    and rank come from ``ep_group`` (None: the default group when torch.distributed is
    initialised, else a single rank). With EP size > 1, building the first layer of a group is a
    collective call (it creates ``max_ubatches`` per-ubatch process groups, see
    :mod:`asyncdbo.dist.ep`), so every rank must build its layers in the same order.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        ep_group: Any = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        max_ubatches: int = 4,
        name: str | None = None,
        init_weights: bool = True,
    ) -> None:
        super().__init__()
        comm = ep_comm(ep_group, max_ubatches=max_ubatches)
        if cfg.num_experts % comm.size != 0:
            raise ValueError(
                f"num_experts ({cfg.num_experts}) is not divisible by the EP size ({comm.size}); "
                "every rank must hold the same number of experts: change num_experts or the number of ranks"
            )
        self.cfg = cfg
        self.max_ubatches = max_ubatches
        self.comm: EPComm = comm
        self.name = name if name is not None else f"moe{next(_layer_ids)}"
        self.experts_per_rank = cfg.num_experts // comm.size
        self.first_expert = comm.rank * self.experts_per_rank
        if init_weights:
            router_ED, bias_E = router_init(cfg, seed)
            local = [expert_init(cfg, seed, e) for e in self._local_range()]
            gate_LFD, up_LFD = torch.stack([w[0] for w in local]), torch.stack([w[1] for w in local])
            down_LDF = torch.stack([w[2] for w in local])
            shared = shared_init(cfg, seed)
        else:
            router_ED, bias_E, gate_LFD, up_LFD, down_LDF, shared = _empty_weights(cfg, self.experts_per_rank, dtype)
        # Each routing rule keeps its reference's router dtype: Mixtral's gate is a Linear of the
        # model's dtype (logits in that dtype), DeepSeek-V3 keeps its gate and correction bias in
        # float32 in a bf16 model (see asyncdbo.moe.router).
        self.router_ED = _frozen(router_ED.to(dtype) if cfg.scoring == "softmax" else router_ED)
        self.bias_E: torch.Tensor | None
        self.register_buffer("bias_E", bias_E)
        self.gate_LFD = _frozen(gate_LFD.to(dtype))
        self.up_LFD = _frozen(up_LFD.to(dtype))
        self.down_LDF = _frozen(down_LDF.to(dtype))
        self.shared_gate_SD = None if shared is None else _frozen(shared["gate_proj"].to(dtype))
        self.shared_up_SD = None if shared is None else _frozen(shared["up_proj"].to(dtype))
        self.shared_down_DS = None if shared is None else _frozen(shared["down_proj"].to(dtype))
        # The synchronous pieces between the yields; compile_segments() swaps in compiled ones.
        self._route = route
        self._mlp = swiglu

    def compile_segments(self, **compile_kwargs: Any) -> None:
        """Compile the synchronous pieces between this layer's yields with ``torch.compile``:
        routing and the SwiGLU MLP (each local expert's GEMMs and the shared expert).  The comm,
        the yields and the per-expert row grouping stay eager: a coroutine cannot suspend inside a
        compiled region, so every compiled piece must end before a yield.  ``compile_kwargs`` go
        to ``torch.compile`` (e.g. ``dynamic=True``: row counts change every call)."""
        self._route = torch.compile(route, **compile_kwargs)
        self._mlp = torch.compile(swiglu, **compile_kwargs)

    def _local_range(self) -> range:
        return range(self.first_expert, self.first_expert + self.experts_per_rank)

    def extra_repr(self) -> str:
        c = self.cfg
        return (
            f"name={self.name}, experts={c.num_experts} (local {self.first_expert}..{self.first_expert + self.experts_per_rank - 1}"
            f" of EP {self.comm.size}), top_k={c.top_k}, scoring={c.scoring}, shared={c.num_shared_experts}, "
            f"schedule={c.schedule}"
        )

    # -- weights --------------------------------------------------------------------------------

    @torch.no_grad()
    def load_global_weights(
        self,
        *,
        router_weight_ED: torch.Tensor,
        w_gate_EFD: torch.Tensor,
        w_up_EFD: torch.Tensor,
        w_down_EDF: torch.Tensor,
        shared: dict[str, torch.Tensor] | None,
        e_score_correction_bias_E: torch.Tensor | None = None,
    ) -> None:
        """Take the full model's weights and keep this rank's shard. ``shared`` holds
        ``gate_proj`` (S x D), ``up_proj`` (S x D), ``down_proj`` (D x S), or is None when the
        config has no shared experts."""
        c = self.cfg
        E, D, Fi = c.num_experts, c.hidden_size, c.intermediate_size
        expect: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {
            "router_weight_ED": (router_weight_ED, (E, D)),
            "w_gate_EFD": (w_gate_EFD, (E, Fi, D)),
            "w_up_EFD": (w_up_EFD, (E, Fi, D)),
            "w_down_EDF": (w_down_EDF, (E, D, Fi)),
        }
        if e_score_correction_bias_E is not None:
            expect["e_score_correction_bias_E"] = (e_score_correction_bias_E, (E,))
        S = c.shared_intermediate_size
        if (shared is None) != (S == 0):
            raise ValueError(
                f"shared weights are {'missing' if shared is None else 'given'} but the config has "
                f"num_shared_experts={c.num_shared_experts}; pass shared=None exactly when it is 0"
            )
        if shared is not None:
            for key, shape in (("gate_proj", (S, D)), ("up_proj", (S, D)), ("down_proj", (D, S))):
                if key not in shared:
                    raise ValueError(f"shared weights lack {key!r}; expected keys gate_proj, up_proj, down_proj")
                expect[f"shared[{key!r}]"] = (shared[key], shape)
        for label, (tensor, want) in expect.items():
            if tuple(tensor.shape) != want:
                raise ValueError(f"{label} has shape {tuple(tensor.shape)}; this layer expects {want}")
        lo, hi = self.first_expert, self.first_expert + self.experts_per_rank
        self.router_ED.copy_(router_weight_ED)
        self.gate_LFD.copy_(w_gate_EFD[lo:hi])
        self.up_LFD.copy_(w_up_EFD[lo:hi])
        self.down_LDF.copy_(w_down_EDF[lo:hi])
        if e_score_correction_bias_E is not None:
            self.bias_E = e_score_correction_bias_E.detach().float().clone().to(self.router_ED.device)
        if shared is not None:
            assert self.shared_gate_SD is not None and self.shared_up_SD is not None and self.shared_down_DS is not None
            self.shared_gate_SD.copy_(shared["gate_proj"])
            self.shared_up_SD.copy_(shared["up_proj"])
            self.shared_down_DS.copy_(shared["down_proj"])

    # -- forward --------------------------------------------------------------------------------

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor | None:
        if self.shared_gate_SD is None:
            return None
        assert self.shared_up_SD is not None and self.shared_down_DS is not None
        tile = ROW_TILE if is_deterministic(self.cfg.deterministic, x_TD) else None
        return self._mlp(x_TD, self.shared_gate_SD, self.shared_up_SD, self.shared_down_DS, tile)

    def _experts(self, plan: DispatchPlan, recv_x_RD: torch.Tensor) -> torch.Tensor:
        recv_x_RD = plan.received(recv_x_RD)  # a fused dispatch's buffer: the rows out of it
        tile = ROW_TILE if is_deterministic(self.cfg.deterministic, recv_x_RD) else None
        if plan.padded:  # the sync-free layout: [P, C, D] blocks (one block of N rows on one rank)
            x_PCD = recv_x_RD.reshape(1, -1, recv_x_RD.shape[-1]) if recv_x_RD.dim() == 2 else recv_x_RD
            return run_experts_padded(x_PCD, plan.recv_PL, plan.window, self.gate_LFD, self.up_LFD, self.down_LDF,
                                      tile, mlp=self._mlp)
        return run_experts(recv_x_RD, plan.local_expert_ids(), self.gate_LFD, self.up_LFD, self.down_LDF, tile,
                           mlp=self._mlp)

    def _stages(self) -> _Stages | None:
        """Explicit-event stage keys under the ubatch-stream policy, else None (role streams or
        no run). Keys carry a per-ubatch call count so one layer may run many times per run."""
        ub = get_ubatch()
        if ub is None or dbo_stream_policy() != "ubatch":
            return None
        calls = _CALLS.get(None)
        if calls is None:  # first MoE call of this ubatch: its context gets its own counter
            calls = {}
            _CALLS.set(calls)
        call = calls.get(self.name, 0)
        calls[self.name] = call + 1
        return _Stages((self.name, call, ub.id))

    async def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Route, dispatch to the experts' ranks, run the local experts, combine back. Same shape
        and dtype out. Inside a DBO run it yields per ``cfg.schedule``; outside it is serial."""
        D = self.cfg.hidden_size
        self._check_input(x_TD)
        lead = x_TD.shape[:-1]
        x_TD = x_TD.reshape(-1, D)
        if self.cfg.schedule == "ht":
            out_TD = await self._forward_ht(x_TD)
        else:
            out_TD = await self._forward_ll(x_TD)
        return out_TD.reshape(*lead, D)

    def _check_input(self, x_TD: torch.Tensor) -> None:
        """Refuse what would fail deep inside routing or the expert GEMMs with a message that names
        neither the layer nor the fix (an IndexError, "expected scalar type Float")."""
        D, w = self.cfg.hidden_size, self.gate_LFD
        if not isinstance(x_TD, torch.Tensor):
            raise TypeError(f"MoELayer {self.name!r} expects a tensor of shape (..., {D}), got {type(x_TD).__name__}")
        if x_TD.dim() == 0 or x_TD.shape[-1] != D:
            got = "a 0-dim tensor" if x_TD.dim() == 0 else f"shape {tuple(x_TD.shape)}"
            raise ValueError(f"MoELayer {self.name!r} expects inputs of shape (tokens, {D}) or (..., {D}): one row of "
                             f"hidden size {D} per token; got {got}")
        if x_TD.dtype != w.dtype:
            raise ValueError(f"MoELayer {self.name!r} holds {w.dtype} weights but got {x_TD.dtype} inputs; cast them "
                             f"with x.to({w.dtype}) or build the layer with dtype={x_TD.dtype}")
        if x_TD.device != w.device:
            raise ValueError(f"MoELayer {self.name!r} holds its weights on {w.device} but got inputs on {x_TD.device}; "
                             f"move them with x.to({str(w.device)!r}) or the layer with layer.to(...)")

    def _fused_capacity(self, x_TD: torch.Tensor) -> int:
        """Rows per destination of a fused dispatch for this call, or 0 to split."""
        return fused_rows(self.name, x_TD.shape[0], top_k=self.cfg.top_k, experts_per_rank=self.experts_per_rank,
                          ranks=self.comm.size, hidden=self.cfg.hidden_size, itemsize=x_TD.element_size(),
                          schedule=self.cfg.schedule)

    def _window(self, x_TD: torch.Tensor) -> tuple[int, int] | None:
        """The sync-free layout's ``(C, M)`` for this call, or None for the exact splits
        (``MoEConfig.sync_free``; :func:`asyncdbo.dist.fused.padded_window`)."""
        on = self.cfg.sync_free
        if on is None:
            on = x_TD.device.type not in ("cpu", "meta")
        if not on:
            return None
        return padded_window(self.name, x_TD.shape[0], top_k=self.cfg.top_k, experts_per_rank=self.experts_per_rank,
                             ranks=self.comm.size, required=self.cfg.sync_free is True)

    def _prepare(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, DispatchPlan]:
        topk_w_TK, topk_ids_TK = self._route(x_TD, self.router_ED, self.cfg, bias_E=self.bias_E,
                                             deterministic=is_deterministic(self.cfg.deterministic, x_TD))
        ub = get_ubatch()
        plan = plan_dispatch(
            topk_ids_TK, num_experts=self.cfg.num_experts, comm=self.comm, ub_id=None if ub is None else ub.id,
            window=self._window(x_TD),
        )
        capacity = self._fused_capacity(x_TD)
        if capacity:  # one message: start_counts() sends the rows too, start_tokens() hands it over
            plan.fuse(x_TD, capacity)
        return topk_w_TK, plan

    def _finalize(
        self, plan: DispatchPlan, back_ND: torch.Tensor, topk_w_TK: torch.Tensor, shared_TD: torch.Tensor | None,
        x_TD: torch.Tensor,
    ) -> torch.Tensor:
        out_TD = torch.zeros_like(x_TD)
        plan.finish(back_ND, topk_w_TK, out_TD)
        return out_TD if shared_TD is None else out_TD + shared_TD

    async def _forward_ht(self, x_TD: torch.Tensor) -> torch.Tensor:
        st = self._stages()
        topk_w_TK, plan = self._prepare(x_TD)
        # The counts go out before the yield, so they travel while the other ubatch computes; the
        # read of the peers' counts (the CPU wait) comes after it. (Fused: the rows go with them.)
        counts = plan.start_counts()
        if self.cfg.yield_after_route and st is not None:  # MoEConfig.yield_after_route: ubatch streams only
            await dbo_yield("routed")
        await _to_comm(st, "dispatch", after="routed")
        await counts  # host: parks until every peer's counts arrived
        recv_x_RD, dispatched = plan.start_tokens(x_TD)
        await _to_compute(st, after="dispatched")
        await dispatched
        y_RD = self._experts(plan, recv_x_RD)
        await _to_comm(st, "combine", after="experts")
        back_ND, combined = plan.start_combine(y_RD)
        if st is None:
            dbo_switch_to_compute()  # no sync: the shared expert overlaps the combine in flight
            shared_TD = self._shared(x_TD)
            dbo_switch_to_comm()
            await dbo_yield_and_switch_from_comm_to_compute("combine_done")
        else:
            st.record("combined")
            await dbo_switch_to_compute()  # no wait yet: the shared expert overlaps the combine
            shared_TD = self._shared(x_TD)
            await dbo_yield("combine_done")
            await st.wait("combined")
        await combined
        return self._finalize(plan, back_ND, topk_w_TK, shared_TD, x_TD)

    async def _forward_ll(self, x_TD: torch.Tensor) -> torch.Tensor:
        dbo_maybe_run_recv_hook()  # launch the previous ubatch's pending receive
        topk_w_TK, plan = self._prepare(x_TD)
        await plan.start_counts()  # the rows' sizes (exact path on a device: a stream wait, then a host read)
        recv_x_RD, dispatched = plan.start_tokens(x_TD)  # the send half, issued before the yield
        received = dbo_register_recv_hook(_receive(dispatched))
        await dbo_yield("dispatch_send")
        await received  # the next ubatch launched our receive
        await dispatched
        y_RD = self._experts(plan, recv_x_RD)
        dbo_maybe_run_recv_hook()
        back_ND, combined = plan.start_combine(y_RD)  # the send half of the combine
        shared_TD = self._shared(x_TD)  # overlaps the combine in flight
        received = dbo_register_recv_hook(_receive(combined))
        await dbo_yield("combine_send")
        await received
        await combined
        return self._finalize(plan, back_ND, topk_w_TK, shared_TD, x_TD)
