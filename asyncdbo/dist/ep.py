"""Expert-parallel all-to-all dispatch and combine, issued through the DBO stream backend.

Legend (shape suffixes): T tokens of this ubatch on this rank, D hidden, K top-k, N = T*K routed
(token, expert) pairs, P ranks in the EP group, L experts per rank (local experts), R rows this
rank receives (sum over senders), E experts in all, C rows of a fused dispatch's capacity per rank.

Dispatch is two collectives: the per-(rank, local expert) counts (``P*L`` int64, needed on the
CPU to size the second), then the routed rows with uneven splits. Rows are sent sorted by global
expert id, so what a rank receives from each sender is already grouped by local expert, and the
counts say where each group starts: expert ids never travel. Routing weights stay home and are
applied after the combine (the reverse all-to-all), in the original token order. Inside
:func:`asyncdbo.dist.dispatch_options` counts and rows can go as one message
(:meth:`DispatchPlan.fuse`, :mod:`asyncdbo.dist.fused`).

**Why one process group per ubatch.** Gloo matches collectives on a group by issue order, so
every rank must issue them in the same order. A DBO run is round-robin, but a ubatch that parks
on comm resumes when that comm completes, and completion order is timing: rank 0 might resume
ubatch 1 first while rank 1 resumes ubatch 0, and their next collectives would pair wrongly.
Giving each ubatch slot its own group (same ranks) makes each group's order that ubatch's program
order, which is the same on every rank whatever the interleaving. :func:`ep_comm` takes the
clones from :func:`asyncdbo.dist.ubatch_groups` (made once per EP group, a collective call: every
rank must construct its layers in the same order, which model construction does) for all layers,
and looks the current clone up at every call: a failed step replaces them all
(:mod:`asyncdbo.dist.recovery`).

All state of one call lives in a :class:`DispatchPlan` the caller keeps in a local variable.

**The sync-free (padded) layout.** The split dispatch above reads the counts on the host (to size
the receive buffer and the splits), and so does the exact unpacking of a fused one: on an
accelerator each read drains the stream. A plan made with ``window=(C, M)`` keeps every count on
the device, as DeepEP's low-latency mode and vLLM's batched experts do: each destination gets a
block of ``C`` rows (its rows first, the rest never read), the rows travel as one equal-split
all_to_all of ``P * C`` rows, the counts as a device tensor (their own equal-split message, or the
fused header), and the experts read each (source, local expert) group through a window of ``M``
rows (``M`` bounds the rows one source sends one expert: a token picks an expert at most once, so
``M`` is the most tokens a rank's call carries). The combine sends the same blocks back, and each
sender picks its rows out by the slot it put them in. Both bounds come from what every rank
knows (:func:`asyncdbo.dist.fused.padded_window`), so they cannot be exceeded by a well-formed
routing; a routing that picks one expert twice for a token is refused on the device
(``torch._assert_async``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._core import get_ubatch
from ..backends import COMPLETED
from ..dbo import dbo_submit
from .groups import current_clones, forget_group, on_destroy, ubatch_groups

__all__ = ["DispatchPlan", "EPComm", "ep_comm", "forget_ep_comm", "plan_dispatch"]




@dataclass(frozen=True, eq=False)
class EPComm:
    """The expert-parallel group of a layer and its per-ubatch twin groups (see module doc)."""

    size: int
    rank: int
    group: Any  # ProcessGroup | None (None: the default group, or no distributed at all)
    max_ubatches: int = 0  # per-ubatch clones this layer uses (0 for a single-rank EP)
    #: What the group carries, for messages: "EP" (expert all-to-alls) or "TP" (tensor-parallel
    #: all-reduces, :mod:`asyncdbo.dist.tp`), which share this type and its clones.
    kind: str = "EP"

    @property
    def ubatch_groups(self) -> tuple[Any, ...]:
        """The current per-ubatch clones, in ubatch order (new ones after a failed step)."""
        if self.size == 1:
            return ()
        return tuple(current_clones(self.group)[: self.max_ubatches])

    def group_for(self, ub_id: int | None) -> Any:
        """The group a ubatch issues on: its own slot inside a run, the base group outside."""
        if ub_id is None or self.size == 1:
            return self.group
        if ub_id >= self.max_ubatches:
            layer = "an expert-parallel MoE layer" if self.kind == "EP" else "a tensor-parallel model"
            raise ValueError(
                f"ubatch {ub_id} ran {layer} built for at most {self.max_ubatches} "
                f"ubatches; build the {'layer' if self.kind == 'EP' else 'model'} with max_ubatches >= {ub_id + 1}"
            )
        return current_clones(self.group)[ub_id]


_CACHE: dict[tuple[int, int], EPComm] = {}
on_destroy(_CACHE.clear)


def ep_comm(group: Any = None, *, max_ubatches: int = 4) -> EPComm:
    """The :class:`EPComm` of ``group`` (None: the default group when torch.distributed is
    initialised, else a single-rank EP). Creating the per-ubatch groups is collective over the
    default group; later calls for the same group return the cached object."""
    if max_ubatches < 1:
        raise ValueError(f"max_ubatches must be >= 1 (got {max_ubatches})")
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return EPComm(size=1, rank=0, group=None)
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if size == 1:
        return EPComm(size=1, rank=0, group=group)
    key = (id(group if group is not None else dist.group.WORLD), max_ubatches)
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    ubatch_groups(max_ubatches, group)
    comm = EPComm(size=size, rank=rank, group=group, max_ubatches=max_ubatches)
    _CACHE[key] = comm
    return comm


def forget_ep_comm(group: Any) -> None:
    """Drop the cached :class:`EPComm` and per-ubatch clones of ``group`` (before destroying it)."""
    for key in [k for k, v in _CACHE.items() if v.group is group]:
        del _CACHE[key]
    forget_group(group)


def _all_to_all(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int] | None,
    in_splits: list[int] | None,
    *,
    group: Any,
    what: str,
) -> Any:
    """Issue one all_to_all_single: async through the stream backend inside a DBO run (returns
    the backend's handle: ``await`` it), synchronous outside (returns a done awaitable)."""
    if get_ubatch() is None:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        return COMPLETED
    work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)
    return dbo_submit(work, nbytes=inp.numel() * inp.element_size(), what=what)


@dataclass(eq=False)
class DispatchPlan:
    """Everything one dispatch/combine round trip needs; one per (layer call, ubatch).

    ``order_N``: the (token, k) pairs sorted by expert (stable), as flat indices into T*K.
    ``send_PL``: rows this rank sends per (destination rank, local expert there).
    ``recv_PL``: rows it receives per (source rank, own local expert); known after the counts
    exchange completes."""

    comm: EPComm
    group: Any
    num_tokens: int
    top_k: int
    experts_per_rank: int
    order_N: torch.Tensor
    send_PL: torch.Tensor
    recv_PL: torch.Tensor
    counts_done: Any = COMPLETED
    capacity: int = 0  # > 0: counts and rows go as one message (:meth:`fuse`)
    fused_x_TD: torch.Tensor | None = None
    packed_PCD: torch.Tensor | None = None
    fused_done: Any = COMPLETED
    sorted_N: torch.Tensor | None = None  # the expert ids in sorted order
    starts_E1: torch.Tensor | None = None  # where each expert's rows start among them (E + 1)
    # The sync-free layout (module doc), set by plan_dispatch(window=(C, M)): every count stays
    # on the device; C rows per destination block, M rows per (source, local expert) window.
    padded: bool = False
    block_rows: int = 0
    window: int = 0

    def fuse(self, x_TD: torch.Tensor, capacity: int) -> None:
        """Send counts and rows as one message of ``capacity`` rows per rank: :meth:`start_counts`
        then issues it (rows included), :meth:`start_tokens` returns its buffer and handle, and
        :meth:`received` unpacks the rows once it arrived (:mod:`asyncdbo.dist.fused`)."""
        self.capacity = capacity
        self.fused_x_TD = x_TD

    @property
    def send_splits(self) -> list[int]:
        return self.send_PL.sum(dim=1).tolist()

    @property
    def recv_splits(self) -> list[int]:
        return self.recv_PL.sum(dim=1).tolist()

    def start_counts(self) -> Any:
        """Issue the counts exchange; returns the handle to await before :meth:`start_tokens`."""
        if self.comm.size == 1:
            self.recv_PL = self.send_PL
            self.counts_done = COMPLETED
        elif self.capacity:  # the counts ride in the rows' message: nothing to wait for here
            assert self.fused_x_TD is not None
            self.packed_PCD, self.fused_done = self.start_fused(self.fused_x_TD, self.capacity)
            self.counts_done = COMPLETED
        else:
            self.counts_done = _all_to_all(
                self.recv_PL.view(-1), self.send_PL.view(-1), None, None, group=self.group, what="counts"
            )
        return self.counts_done

    def start_tokens(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Issue the routed rows (counts must have arrived). Returns (recv_x_RD, handle)."""
        assert self.counts_done.done(), "start_tokens before the counts exchange completed"
        if self.packed_PCD is not None:  # fused: already on its way since start_counts()
            return self.packed_PCD, self.fused_done
        send_x_ND = x_TD[self.order_N // self.top_k]
        if self.comm.size == 1:
            return send_x_ND, COMPLETED
        if self.padded:  # equal splits of C rows: no count needed on the host
            send_PCD = self._blocks(send_x_ND, 0, self.block_rows)
            recv_PCD = torch.empty_like(send_PCD)
            return recv_PCD, _all_to_all(recv_PCD, send_PCD, None, None, group=self.group, what="dispatch")
        recv_x_RD = send_x_ND.new_empty((int(self.recv_PL.sum()), x_TD.shape[1]))
        handle = _all_to_all(
            recv_x_RD, send_x_ND, self.recv_splits, self.send_splits, group=self.group, what="dispatch"
        )
        return recv_x_RD, handle

    def start_fused(self, x_TD: torch.Tensor, capacity: int) -> tuple[torch.Tensor, Any]:
        """Issue counts and rows as one message (:mod:`asyncdbo.dist.fused`): a ``[P, 1 + C, D]``
        buffer per rank, each destination's block a header row of counts then its rows, padded to
        ``capacity`` rows. Returns (the receive buffer, handle); :meth:`finish_fused` unpacks it."""
        P, L = self.send_PL.shape
        send_PCD = self._blocks(x_TD[self.order_N // self.top_k], 1, capacity)
        send_PCD[:, 0].view(torch.uint8)[:, : L * 8].copy_(self.send_PL.view(torch.uint8).view(P, L * 8))
        recv_PCD = torch.empty_like(send_PCD)
        return recv_PCD, _all_to_all(recv_PCD, send_PCD, None, None, group=self.group, what="dispatch+counts")

    def _blocks(self, send_x_ND: torch.Tensor, header: int, capacity: int) -> torch.Tensor:
        """``[P, header + C, D]``: each destination's rows at the top of its block, after
        ``header`` rows (one scatter by place; the rows below them are zeros and never read)."""
        P, D, B = self.comm.size, send_x_ND.shape[1], header + capacity
        send_PBD = send_x_ND.new_zeros((P, B, D))
        dest_N, place_N = self._places()
        send_PBD.view(P * B, D)[dest_N * B + header + place_N] = send_x_ND
        return send_PBD

    def _places(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert-sorted row's destination rank and its place among the rows sent there."""
        assert self.sorted_N is not None and self.starts_E1 is not None
        dest_N = self.sorted_N // self.experts_per_rank
        place_N = torch.arange(self.order_N.numel(), device=dest_N.device) - self.starts_E1[dest_N * self.experts_per_rank]
        return dest_N, place_N

    def received(self, recv_x_RD: torch.Tensor) -> torch.Tensor:
        """The received rows: as they came (split), or out of the fused buffer once it arrived.
        Padded plans keep the buffer (the rows of ``[P, C, D]``, a fused one's headers dropped) and
        read ``recv_PL`` out of a fused one's headers, on the device."""
        fused = self.packed_PCD is not None and recv_x_RD is self.packed_PCD
        if self.padded and self.comm.size > 1:
            if not fused:
                return recv_x_RD
            P, L = self.recv_PL.shape
            header = recv_x_RD[:, 0].view(torch.uint8)[:, : L * 8].contiguous()
            self.recv_PL = header.view(torch.int64).view(P, L)
            return recv_x_RD[:, 1:]
        if fused:
            return self.finish_fused(recv_x_RD)
        return recv_x_RD

    def finish_fused(self, recv_PCD: torch.Tensor) -> torch.Tensor:
        """The received rows of a fused dispatch (arrived), in the split path's order; sets
        ``recv_PL`` from the headers."""
        P, L = self.recv_PL.shape
        header = recv_PCD[:, 0].view(torch.uint8)[:, : L * 8].contiguous()
        self.recv_PL = header.view(torch.int64).view(P, L).clone()
        return torch.cat([recv_PCD[p, 1 : 1 + n] for p, n in enumerate(self.recv_PL.sum(dim=1).tolist())])

    def local_expert_ids(self) -> torch.Tensor:
        """Local expert index of every received row (rows arrive as [source rank][local expert])."""
        L = self.experts_per_rank
        ids_PL = torch.arange(L, device=self.recv_PL.device).repeat(self.recv_PL.shape[0])
        return torch.repeat_interleave(ids_PL, self.recv_PL.reshape(-1))

    def start_combine(self, y_RD: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Send expert outputs back to their tokens' ranks. Returns (back_ND, handle); a padded
        plan sends (and returns) the ``[P, C, D]`` blocks, which :meth:`finish` reads by slot."""
        if self.comm.size == 1:
            return y_RD, COMPLETED
        if self.padded:
            back_PCD = torch.empty_like(y_RD)
            return back_PCD, _all_to_all(back_PCD, y_RD, None, None, group=self.group, what="combine")
        back_ND = y_RD.new_empty((self.order_N.numel(), y_RD.shape[1]))
        handle = _all_to_all(back_ND, y_RD, self.send_splits, self.recv_splits, group=self.group, what="combine")
        return back_ND, handle

    def finish(self, back_ND: torch.Tensor, topk_w_TK: torch.Tensor, out_TD: torch.Tensor) -> torch.Tensor:
        """Add each token's weighted expert outputs into ``out_TD``, in expert-id order.

        The rows are gathered to ``[T, K, D]`` (each token's K outputs in expert-id order) and
        added one k at a time, so the sum has one fixed order on every backend: an
        ``index_add_`` would add in index order on a CPU but with atomics in any order on CUDA.
        Expert-id order is also Hugging Face's (its expert loop ``index_add_``s expert by expert),
        and so is the dtype rule: the float32 weight multiplies in float32 and the product is
        rounded to ``out_TD``'s dtype before it is added."""
        T, K = self.num_tokens, self.top_k
        if T == 0:
            return out_TD
        N = T * K
        if self.padded and self.comm.size > 1:  # each sent row picked out of the block it went to
            dest_N, place_N = self._places()
            back_ND = back_ND.reshape(-1, back_ND.shape[-1])[dest_N * self.block_rows + place_N]
        pos_N = torch.empty_like(self.order_N)
        pos_N[self.order_N] = torch.arange(N, device=self.order_N.device)
        # Rows of back_ND are sorted by expert (stably), so a token's rows in ascending position
        # are its experts in ascending id.
        rows_TK = pos_N.view(T, K).sort(dim=1).values
        y_TKD = back_ND[rows_TK]
        w_TK = topk_w_TK.reshape(-1)[self.order_N][rows_TK].float()
        for k in range(K):
            out_TD += (y_TKD[:, k].float() * w_TK[:, k, None]).to(out_TD.dtype)
        return out_TD


def plan_dispatch(topk_ids_TK: torch.Tensor, *, num_experts: int, comm: EPComm, ub_id: int | None,
                  window: tuple[int, int] | None = None) -> DispatchPlan:
    """Sort this ubatch's routed pairs by expert and count rows per (rank, local expert).
    ``window=(C, M)``: the sync-free layout (module doc) with ``C`` rows per destination block
    and ``M`` rows per (source, local expert) window; every count stays on the device."""
    P = comm.size
    L = num_experts // P
    ids_N = topk_ids_TK.reshape(-1)
    sorted_N, order_N = torch.sort(ids_N, stable=True)
    # Counts from the sorted ids (where each expert's run starts): bincount would read the ids'
    # min and max to the host on a device.
    starts_E1 = torch.searchsorted(sorted_N, torch.arange(num_experts + 1, device=ids_N.device))
    send_PL = (starts_E1[1:] - starts_E1[:-1]).view(P, L)
    T, K = topk_ids_TK.shape
    C, M = window if window is not None else (0, 0)
    if window is not None:
        # Well-formed routing cannot exceed the windows (module doc); a repeated expert could.
        torch._assert_async(send_PL.max() <= T,
                            f"MoE dispatch: a token picked one expert twice, so an expert got more rows than the "
                            f"{T} tokens of the call; the sync-free layout holds at most {M} rows per "
                            f"(rank, expert) and {C} per rank")
    return DispatchPlan(
        comm=comm,
        group=comm.group_for(ub_id),
        num_tokens=T,
        top_k=K,
        experts_per_rank=L,
        order_N=order_N,
        send_PL=send_PL,
        recv_PL=torch.empty_like(send_PL),
        sorted_N=sorted_N,
        starts_E1=starts_E1,
        padded=window is not None,
        block_rows=C,
        window=M,
    )
