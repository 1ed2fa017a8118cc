"""BROKEN on purpose: a host sync inside a ubatch kills the overlap.

Run: python examples/03_item_kills_overlap_broken.py   (then compare with 04_..._fixed.py)

An expert-parallel dispatch is two exchanges: first the per-expert row counts (the receiver needs
them on the CPU to size its buffer: ``.item()`` / ``.tolist()``), then the rows. Reading the
counts right after issuing the exchange forces a wait for the comm *on the CPU thread*. Under DBO
every ubatch shares that one thread, so while one ubatch blocks, no other ubatch can compute: the
step takes as long as the serial one. (On a GPU the same happens with ``.item()`` on a tensor the
comm stream writes: the CPU waits for the device and stops queuing the other ubatch's kernels.)

The comm runs over a one-rank gloo group with a modeled link (each transfer takes ~4 ms and no
CPU), so this runs on any CPU. Wall times depend on the machine and its load; the blocked time
does not: it is what the script measured the CPU thread waiting inside ``counts_done.wait()``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import asyncdbo
from asyncdbo import (
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)
from asyncdbo.backends import LinkSpec
from asyncdbo.backends.host import HostBackend
from asyncdbo.observe import Tracer

# Legend: T tokens of this ubatch, D hidden, E experts, R rows received.
D, E, LAYERS, TOKENS = 384, 8, 3, 512
LINK = LinkSpec(name="slow-demo", latency_s=4e-3, bandwidth_Bps=2e9)
torch.manual_seed(0)
torch.set_num_threads(1)  # steadier timings on a small shared CPU
W_ROUTER_DE = torch.randn(D, E) / D**0.5
W_EXPERT_DD = torch.randn(D, D) / D**0.5
BLOCKED_S = [0.0]  # CPU time spent blocked in host syncs, this process


def exchange(t: torch.Tensor, what: str):
    """Issue an async all-to-all; returns (output, handle). The handle is the host backend's
    HostWork: ``handle.wait()`` blocks the thread, ``await handle`` parks only this ubatch."""
    out = torch.empty_like(t)
    work = dist.all_to_all_single(out, t, async_op=True)
    return out, asyncdbo.dbo_submit(work, nbytes=t.numel() * t.element_size(), what=what)


async def moe_forward(x_TD: torch.Tensor) -> torch.Tensor:
    for layer in range(LAYERS):
        expert_T = (x_TD @ W_ROUTER_DE).argmax(-1)
        counts_E = torch.bincount(expert_T, minlength=E)
        await dbo_yield_and_switch_from_compute_to_comm(f"L{layer}:counts")
        recv_counts_E, counts_done = exchange(counts_E, "counts")
        t0 = time.perf_counter()
        counts_done.wait()  # BROKEN: blocks the one thread every ubatch runs on
        BLOCKED_S[0] += time.perf_counter() - t0
        num_rows = int(recv_counts_E.sum().item())
        recv_RD, _ = exchange(x_TD[:num_rows], "dispatch")
        await dbo_yield_and_switch_from_comm_to_compute(f"L{layer}:experts")
        x_TD = x_TD + torch.tanh(recv_RD @ W_EXPERT_DD)
    return x_TD


async def step(x_TD: torch.Tensor, num_ubatches: int, tracer: Tracer) -> torch.Tensor:
    chunks = x_TD.chunk(num_ubatches)
    outs = await asyncdbo.run_ubatches(
        moe_forward, [(c,) for c in chunks], backend=HostBackend(link=LINK), instrument=tracer
    )
    return torch.cat(outs)


def main() -> dict[str, float]:
    # One process: an in-memory store, no port to listen on.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x_TD = torch.randn(TOKENS, D)
        serial, dbo = Tracer(), Tracer()
        asyncdbo.run(step, x_TD, 1, serial)  # warm-up (first gloo calls, allocator)
        serial, dbo = Tracer(), Tracer()
        out_serial = asyncdbo.run(step, x_TD, 1, serial)
        BLOCKED_S[0] = 0.0
        out_dbo = asyncdbo.run(step, x_TD, 2, dbo)
        torch.testing.assert_close(out_dbo, out_serial)
    finally:
        dist.destroy_process_group()
    s, d = serial.numbers(), dbo.numbers()
    print(f"serial: {s.summary()}")
    print(f"DBO:    {d.summary()}")
    print(f"DBO / serial wall time: {d.wall_s / s.wall_s:.2f}")
    print(f"DBO step: CPU blocked in host syncs for {BLOCKED_S[0] * 1e3:.1f} ms (no ubatch could run meanwhile)")
    return {"serial_wall_s": s.wall_s, "dbo_wall_s": d.wall_s, "dbo_blocked_s": BLOCKED_S[0]}


if __name__ == "__main__":
    main()
