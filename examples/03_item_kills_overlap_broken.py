"""BROKEN on purpose: a host sync inside a ubatch kills the overlap.

Run: python examples/03_item_kills_overlap_broken.py   (then compare with 04_..._fixed.py)

An expert-parallel dispatch is two exchanges: first the per-expert row counts (the receiver needs
them on the CPU to size its buffer: ``.item()`` / ``.tolist()``), then the rows. Reading the
counts right after issuing the exchange forces a wait for the comm *on the CPU thread*. Under DBO
every ubatch shares that one thread, so while one ubatch blocks, no other ubatch can compute. (On
a GPU the same happens with ``.item()`` on a tensor the comm stream writes: the CPU waits for the
device and stops queuing the other ubatch's kernels.)

The comm runs over a one-rank gloo group with a modeled link (each message takes 4 ms and no CPU),
so this runs on any CPU. The step is sized so that comm and compute are about equal per layer
(two 4 ms messages against about 7 ms of expert compute for both halves together, measured on a
2-core VM), where DBO can pay most. Every number printed is measured: the wall times by the tracer (also
less the time the thread waited for a CPU core, which other jobs on a shared machine add), the
blocked time by debug mode's blocking detector (``debug=True``: a step between two yields that
spends more than ``blocking_s`` off the CPU, neither computing nor waiting for a core), run on
the serial and the DBO step alike.

Each ubatch issues its comm first and then hands over (``dbo_switch_to_comm`` switches the stream
without yielding): on the host backend the CPU is the compute stream, so a yield *before* the
issue would only delay the comm behind the other ubatch's compute.

What it shows: DBO no faster than serial (a speedup below 1x: 0.84-0.95x in four runs on a
2-core VM shared with other jobs), and the CPU blocked for most of one link latency per ubatch and layer.
``04_item_kills_overlap_fixed.py`` is the same step with the wait made a park;
``benchmarks/example_claims.py`` runs both in one process, alternating, and reports their
speedups side by side (``benchmarks/results/example_claims_cpu-2c_2026-12-02.md``: 04's median
speedup 1.20x this one's over 5 alternations, 0.85-1.49x per alternation, at load 7 on a 2-core
VM); ``tests/docs/test_examples_claims.py`` checks the blocked times.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist

import asyncdbo
from asyncdbo import dbo_switch_to_comm, dbo_yield_and_switch_from_comm_to_compute
from asyncdbo.backends import LinkSpec
from asyncdbo.backends.host import HostBackend
from asyncdbo.observe import RunNumbers, Tracer

# Legend: T tokens of this ubatch, D hidden, H expert hidden, E experts, R rows received.
D, H, E, LAYERS, TOKENS = 256, 1024, 8, 3, 512
LINK = LinkSpec(name="slow-demo", latency_s=4e-3, bandwidth_Bps=2e9)
ROUNDS = 5  # serial/DBO pairs, alternating; the medians are reported
BLOCKING_S = 3e-3  # debug mode reports a step that spends longer than this blocked (the link: 4 ms)
torch.manual_seed(0)
torch.set_num_threads(1)  # steadier timings on a small shared CPU
W_ROUTER_DE = torch.randn(D, E) / D**0.5
W_UP_DH = torch.randn(D, H) / D**0.5
W_DOWN_HD = torch.randn(H, D) / H**0.5


def exchange(t: torch.Tensor, what: str):
    """Issue an async all-to-all; returns (output, handle). The handle is the host backend's
    HostWork: ``handle.wait()`` blocks the thread, ``await handle`` parks only this ubatch."""
    out = torch.empty_like(t)
    work = dist.all_to_all_single(out, t, group=asyncdbo.ubatch_group(), async_op=True)  # this ubatch's group
    return out, asyncdbo.dbo_submit(work, nbytes=t.numel() * t.element_size(), what=what)


async def moe_forward(x_TD: torch.Tensor) -> torch.Tensor:
    for layer in range(LAYERS):
        expert_T = (x_TD @ W_ROUTER_DE).argmax(-1)
        counts_E = torch.bincount(expert_T, minlength=E)
        await dbo_switch_to_comm()  # comm goes on the comm stream; no yield: issue it first, then hand over
        recv_counts_E, counts_done = exchange(counts_E, "counts")
        counts_done.wait()  # BROKEN: blocks the one thread every ubatch runs on
        num_rows = int(recv_counts_E.sum().item())
        recv_RD, _ = exchange(x_TD[:num_rows], "dispatch")
        await dbo_yield_and_switch_from_comm_to_compute(f"L{layer}:experts")
        x_TD = x_TD + torch.nn.functional.gelu(recv_RD @ W_UP_DH) @ W_DOWN_HD
    return x_TD


def cpu_wait_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU core (Linux's schedstat; 0
    elsewhere). Other jobs on a shared machine stretch a step by this much; subtracting it gives
    the step time this machine would show unloaded, which is what the comparison is about."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return 0.0


def timed_step(x_TD: torch.Tensor, num_ubatches: int) -> tuple[torch.Tensor, RunNumbers, float]:
    """One step: its output, its numbers, and its wall time less the time spent waiting for a core.

    Both clocks are read around the same call: the core wait counts the whole ``asyncdbo.run``
    (event loop set-up included), so it is taken from that call's wall time, not from the tracer's
    shorter one (which would go negative on a loaded machine)."""
    tracer = Tracer()
    wait0, t0 = cpu_wait_s(), time.perf_counter()
    out = asyncdbo.run(step, x_TD, num_ubatches, tracer)
    wall_s, waited_s = time.perf_counter() - t0, cpu_wait_s() - wait0
    return out, tracer.numbers(), wall_s - waited_s


async def step(x_TD: torch.Tensor, num_ubatches: int, tracer: Tracer) -> torch.Tensor:
    chunks = x_TD.chunk(num_ubatches)
    outs = await asyncdbo.run_ubatches(moe_forward, [(c,) for c in chunks], backend=HostBackend(link=LINK),
                                       instrument=tracer, debug=True, blocking_s=BLOCKING_S)
    return torch.cat(outs)


def main(quiet: bool = False, rounds: int = ROUNDS) -> dict[str, float]:
    """Serial and DBO steps alternating for ``rounds`` rounds after a warm-up; medians."""
    logging.getLogger("asyncdbo").setLevel(logging.ERROR)  # one line per blocked step: summed below
    # One process: an in-memory store, no port to listen on.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    serial: list[RunNumbers] = []
    dbo: list[RunNumbers] = []
    own: dict[str, list[float]] = {"serial": [], "dbo": []}  # wall less waiting for a core
    try:
        asyncdbo.ubatch_groups(2)  # a group per ubatch slot, as multi-rank code needs (debug mode checks it)
        x_TD = torch.randn(TOKENS, D)
        for n in (1, 2):  # warm-up, both shapes (first gloo calls, allocator, GEMM paths)
            asyncdbo.run(step, x_TD, n, Tracer())
        for _ in range(rounds):  # alternate, so load from other jobs hits both alike
            out_serial, s, s_own = timed_step(x_TD, 1)
            out_dbo, d, d_own = timed_step(x_TD, 2)
            torch.testing.assert_close(out_dbo, out_serial)
            serial.append(s)
            dbo.append(d)
            own["serial"].append(s_own)
            own["dbo"].append(d_own)
    finally:
        dist.destroy_process_group()
    result = {
        "serial_wall_s": statistics.median(n.wall_s for n in serial),
        "dbo_wall_s": statistics.median(n.wall_s for n in dbo),
        "serial_own_s": statistics.median(own["serial"]),
        "dbo_own_s": statistics.median(own["dbo"]),
        "serial_blocked_s": statistics.median(n.blocking_s for n in serial),
        "dbo_blocked_s": statistics.median(n.blocking_s for n in dbo),
    }
    result["speedup_wall"] = result["serial_wall_s"] / result["dbo_wall_s"]
    result["speedup"] = result["serial_own_s"] / result["dbo_own_s"]
    if not quiet:
        split = f"DBO microbatched into {'/'.join(sorted({str(n.num_ubatches) for n in dbo}))} ubatches in all {rounds} rounds"
        print(f"last round, serial: {serial[-1].summary()}")
        print(f"last round, DBO:    {dbo[-1].summary()}")
        print(f"medians of {rounds} rounds, less the time spent waiting for a CPU core (other jobs' load): serial "
              f"{result['serial_own_s'] * 1e3:.1f} ms, DBO {result['dbo_own_s'] * 1e3:.1f} ms: speedup "
              f"{result['speedup']:.2f}x (serial / DBO; above 1x: DBO is faster; {split})")
        print(f"  as wall time: serial {result['serial_wall_s'] * 1e3:.1f} ms, DBO {result['dbo_wall_s'] * 1e3:.1f} ms: "
              f"speedup {result['speedup_wall']:.2f}x ({split})")
        print(f"CPU blocked (steps blocked > {BLOCKING_S * 1e3:g} ms, medians): DBO step "
              f"{result['dbo_blocked_s'] * 1e3:.1f} ms, serial step {result['serial_blocked_s'] * 1e3:.1f} ms; "
              "no ubatch could run meanwhile")
    return result


if __name__ == "__main__":
    main()
