"""What one ubatch switch costs on this machine, against the alternatives: the measured code of
benchmarks/switch_cost.py.

Every design runs the same program: N participants each make K steps in strict round-robin
order; a step is ``work(i)`` (optional) followed by a handoff to the next participant. The
handoff is made at the bottom of an await chain of ``depth`` frames (``depth`` async def frames
counting the participant's entry function and the frame that awaits the yield point), because
each frame on the chain is passed on every suspend and resume. ns/switch = wall time / (N*K).

Designs:

* ``tramp``: the floor for coroutines in CPython. A deque of coroutines driven by
  ``coro.send(None)``; the yield point is a ``types.coroutine`` generator yielding a sentinel,
  the same shape as :func:`asyncdbo.dbo_yield`.
* ``tramp_ctx``: ``tramp`` plus a ``contextvars.Context`` per coroutine, resumed with
  ``ctx.run(coro.send, None)``: what per-ubatch context isolation costs.
* ``asyncdbo``: a DBO run built as ``run_ubatches`` builds it, with ``await dbo_yield()`` on the
  host backend.
  ``asyncdbo_inst`` adds an :class:`~asyncdbo.lowlevel.Instrument` whose hooks do nothing (the cost
  of enabled tracing hooks); ``asyncdbo_aio`` runs on asyncio's default loop instead of uvloop;
  ``asyncdbo_nohooks`` is the kernel's switch loop with its two instrument branches deleted and
  nothing else changed: ``asyncdbo / asyncdbo_nohooks`` is what *disabled* tracing costs.
* ``threads``: vLLM's thread baton. One OS thread per participant and one ``threading.Event``
  per participant; a yield sets the next participant's event, waits on its own and clears it.
* ``aio_fut`` / ``aio_fut_uv``: each participant an ``asyncio.Task``; a yield resolves the next
  participant's Future and awaits a fresh one of its own (default loop / uvloop).

The sweep with busy-thread and torch-op scenarios and result files is ``switch_cost.py``.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import statistics
import threading
import time
import types
from collections.abc import Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import _vllm_ubatch
from asyncdbo import dbo_yield
from asyncdbo.backends.host import HostBackend
from asyncdbo.dbo.hooks import on_exit, run_pending_hook
from asyncdbo.dbo.state import Lane, RunState
from asyncdbo.lowlevel import SWITCH, DBORun, Instrument

__all__ = ["DESIGNS", "Design", "chain", "check_round_robin", "measure", "median_table"]

now = time.perf_counter
Work = Callable[[int], object] | None
Leaf = Callable[[int], Coroutine[Any, Any, None]]


def chain(depth: int, leaf: Leaf) -> Leaf:
    """An async function whose await chain, down to ``leaf``'s frame, has ``depth`` frames."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1 async def frame (got {depth})")
    if depth == 1:
        return leaf
    inner = chain(depth - 1, leaf)

    async def level(i: int) -> None:
        await inner(i)

    return level


# ------------------------------------------------------------------ trampoline floors
_SENTINEL = object()


@types.coroutine
def _tramp_yield() -> Generator[object, Any, None]:
    yield _SENTINEL


def _tramp_leaf(K: int, work: Work) -> Leaf:
    async def leaf(i: int) -> None:
        for _ in range(K):
            if work is not None:
                work(i)
            await _tramp_yield()

    return leaf


def bench_tramp(N: int, K: int, work: Work, depth: int) -> float:
    fn = chain(depth, _tramp_leaf(K, work))
    ready = collections.deque(fn(i) for i in range(N))
    pop, push = ready.popleft, ready.append
    t0 = now()
    while ready:
        c = pop()
        try:
            c.send(None)
        except StopIteration:
            continue
        push(c)
    return now() - t0


def bench_tramp_ctx(N: int, K: int, work: Work, depth: int) -> float:
    fn = chain(depth, _tramp_leaf(K, work))
    ready = collections.deque((fn(i), contextvars.copy_context().run) for i in range(N))
    pop, push = ready.popleft, ready.append
    t0 = now()
    while ready:
        item = pop()
        c, run = item
        try:
            run(c.send, None)
        except StopIteration:
            continue
        push(item)
    return now() - t0


# ------------------------------------------------------------------ asyncdbo
class _NullInstrument(Instrument):
    """Every hook inherited and empty: measures the cost of having hooks called at all."""


def _loop_factory(uv: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop, as ``asyncdbo.run(loop="uvloop")`` picks it, or asyncio's default (``None``)."""
    if not uv:
        return None
    import uvloop

    return uvloop.new_event_loop


def _bench_asyncdbo(
    N: int, K: int, work: Work, depth: int, *, uv: bool, instrument: Instrument | None, run_cls: type[DBORun] = DBORun
) -> float:
    """The kernel's own run, built as ``run_ubatches`` builds it (host backend), so that a variant
    ``run_cls`` can stand in for it; ``run_ubatches``' per-run argument checks are left out, which
    is nothing next to the switches measured."""
    async def leaf(i: int) -> None:
        for _ in range(K):
            if work is not None:
                work(i)
            await dbo_yield("bench")

    fn = chain(depth, leaf)
    runs: list[DBORun] = []

    async def main() -> float:
        backend = HostBackend()
        run = run_cls([fn(i) for i in range(N)], install=backend.install_stream, before_park=run_pending_hook,
                      at_exit=on_exit, instrument=instrument)
        state = RunState(backend=backend, policy="role", lanes=[Lane(ub) for ub in run.ubatches])
        run.ext = state
        for ub, lane in zip(run.ubatches, state.lanes):
            ub.ext = lane
        backend.attach(run, state)
        runs.append(run)
        t0 = now()
        await run.drive()
        return now() - t0

    with asyncio.Runner(loop_factory=_loop_factory(uv)) as runner:
        dt = runner.run(main())
    assert runs[0].num_switches == N * K, (runs[0].num_switches, N, K)
    return dt


class _NoHooksRun(DBORun):
    """DBORun whose switch loop is the kernel's fast path minus the two ``inst is not None``
    branches (this benchmark never parks, so only that path runs). It exists to measure what the
    branches cost when no instrument is set; keep it in step with asyncdbo/_core/kernel.py's
    ``DBORun._loop_until_done`` and ``DBORun._switch_in_python``."""

    def _switch(self) -> None:
        """Nothing: drive()'s first pass leaves every pass to the loop below."""

    async def _loop_until_done(self) -> None:
        ready, woken, timers = self._ready, self._woken, self._timers
        while self._live:
            if timers or woken:
                self._drain()
            if not ready:
                raise AssertionError("the switch benchmark never parks")
            watch = self._num_parked > 0 or bool(timers)
            installs = self._install is not None
            n = 0
            switch, pop, push = SWITCH, ready.popleft, ready.append
            self._enter_view()
            try:
                while ready:
                    ub = pop()
                    if installs and ub.resume_with is not self._installed:
                        self.install(ub.resume_with)
                    try:
                        request = ub.resume()
                    except StopIteration as stop:
                        self._finish(ub, stop.value)
                        break
                    if request is switch:
                        n += 1
                        if watch:
                            if woken or timers:
                                self._drain()
                            push(ub)
                        else:
                            push(ub)
                    else:
                        raise AssertionError(f"the switch benchmark never parks (got {request!r})")
            finally:
                self.num_switches += n
                self._leave_view()


def bench_asyncdbo_nohooks(N: int, K: int, work: Work, depth: int) -> float:
    return _bench_asyncdbo(N, K, work, depth, uv=True, instrument=None, run_cls=_NoHooksRun)


def bench_asyncdbo(N: int, K: int, work: Work, depth: int) -> float:
    return _bench_asyncdbo(N, K, work, depth, uv=True, instrument=None)


def bench_asyncdbo_aio(N: int, K: int, work: Work, depth: int) -> float:
    return _bench_asyncdbo(N, K, work, depth, uv=False, instrument=None)


def bench_asyncdbo_inst(N: int, K: int, work: Work, depth: int) -> float:
    return _bench_asyncdbo(N, K, work, depth, uv=True, instrument=_NullInstrument())


# ------------------------------------------------------------------ vLLM-style thread baton
def bench_threads(N: int, K: int, work: Work, depth: int) -> float:
    """One thread per participant; participant i waits on ``events[i]`` and signals
    ``events[(i + 1) % N]``, as vLLM's UBatchContext does. ``depth`` does not apply: a thread
    keeps its Python stack across a handoff."""
    events = [threading.Event() for _ in range(N)]
    start = threading.Barrier(N + 1)

    def body(i: int) -> None:
        mine, nxt = events[i], events[(i + 1) % N]
        start.wait()
        mine.wait()
        mine.clear()
        for _ in range(K):
            if work is not None:
                work(i)
            nxt.set()
            mine.wait()
            mine.clear()
        nxt.set()  # let the next one leave too

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(N)]
    for t in threads:
        t.start()
    start.wait()
    t0 = now()
    events[0].set()
    for t in threads:
        t.join()
    return now() - t0


# ------------------------------------------------------------------ asyncio Future handoff
async def _aio_fut_main(N: int, K: int, work: Work, depth: int) -> float:
    loop = asyncio.get_running_loop()
    futs = [loop.create_future() for _ in range(N)]

    def handoff(i: int) -> asyncio.Future[None]:
        own = futs[i] = loop.create_future()
        futs[(i + 1) % N].set_result(None)
        return own

    async def leaf(i: int) -> None:
        if i:
            await futs[i]
        for _ in range(K):
            if work is not None:
                work(i)
            await handoff(i)
        nxt = futs[(i + 1) % N]
        if not nxt.done():
            nxt.set_result(None)

    fn = chain(depth, leaf)
    tasks = [asyncio.ensure_future(fn(i)) for i in range(N)]
    t0 = now()
    await asyncio.gather(*tasks)
    return now() - t0


def bench_aio_fut(N: int, K: int, work: Work, depth: int) -> float:
    with asyncio.Runner() as runner:
        return runner.run(_aio_fut_main(N, K, work, depth))


def bench_aio_fut_uv(N: int, K: int, work: Work, depth: int) -> float:
    with asyncio.Runner(loop_factory=_loop_factory(True)) as runner:
        return runner.run(_aio_fut_main(N, K, work, depth))


# ------------------------------------------------------------------ no handoff at all
def bench_work_only(N: int, K: int, work: Work, depth: int) -> float:
    """The same N*K calls of ``work`` in round-robin order with no handoff: the baseline for
    "work between switches" runs (how much a design slows the work itself down)."""
    t0 = now()
    for _ in range(K):
        for i in range(N):
            if work is not None:
                work(i)
    return now() - t0


@dataclass(frozen=True, kw_only=True)
class Design:
    """A handoff design: ``fn(N, K, work, depth) -> seconds``; ``cost`` sizes runs (slow designs
    make fewer switches so that every run lasts about as long)."""

    name: str
    fn: Callable[[int, int, Work, int], float]
    cost: str  # "fast" | "aio" | "threads"
    label: str


DESIGNS: dict[str, Design] = {
    d.name: d
    for d in (
        Design(name="tramp", fn=bench_tramp, cost="fast", label="bare `coro.send()` trampoline"),
        Design(name="tramp_ctx", fn=bench_tramp_ctx, cost="fast", label="trampoline + `Context.run` per coroutine"),
        Design(name="asyncdbo", fn=bench_asyncdbo, cost="fast", label="asyncdbo `dbo_yield` (uvloop)"),
        Design(name="asyncdbo_aio", fn=bench_asyncdbo_aio, cost="fast", label="asyncdbo `dbo_yield` (default loop)"),
        Design(name="asyncdbo_inst", fn=bench_asyncdbo_inst, cost="fast", label="asyncdbo + empty Instrument"),
        Design(
            name="asyncdbo_nohooks", fn=bench_asyncdbo_nohooks, cost="fast",
            label="asyncdbo loop without instrument branches (reference)",
        ),
        Design(name="threads", fn=bench_threads, cost="threads", label="vLLM thread baton (`threading.Event`)"),
        Design(name="aio_fut", fn=bench_aio_fut, cost="aio", label="asyncio Future handoff (default loop)"),
        Design(name="aio_fut_uv", fn=bench_aio_fut_uv, cost="aio", label="asyncio Future handoff (uvloop)"),
        Design(name="work_only", fn=bench_work_only, cost="fast", label="no handoff (the work alone)"),
    )
}


if _vllm_ubatch.available():  # vLLM's own UBatchContext beside the re-implementation (_vllm_ubatch.py)
    DESIGNS["vllm"] = Design(name="vllm", fn=_vllm_ubatch.bench_vllm_yield, cost="threads",
                             label=f"vLLM {_vllm_ubatch.version()} `UBatchContext` (its own code, CUDA calls stubbed)")


def check_round_robin(N: int = 3, K: int = 4, depth: int = 2) -> dict[str, list[int]]:
    """Run every design with a ``work`` that records who ran; each must give 0,1,..,N-1,0,1,..
    (a design that does not hand over in order would be measuring something else)."""
    orders: dict[str, list[int]] = {}
    for name, d in DESIGNS.items():
        order: list[int] = []
        d.fn(N, K, order.append, depth)
        orders[name] = order
    return orders


def measure(
    designs: Sequence[str],
    *,
    N: int,
    depth: int,
    switches: dict[str, int],
    rounds: int,
    work: Work = None,
    per: str = "switch",
) -> dict[str, list[float]]:
    """ns per switch (or per step, ``per="step"``) of each design, one sample per round, with
    the designs interleaved inside each round so that machine noise hits them alike."""
    samples: dict[str, list[float]] = {name: [] for name in designs}
    for name in designs:  # warm-up: lazy imports, first loop creation, first thread start
        DESIGNS[name].fn(N, 2, work, depth)
    for _ in range(rounds):
        for name in designs:
            d = DESIGNS[name]
            K = max(1, switches[d.cost] // N)
            dt = d.fn(N, K, work, depth)
            samples[name].append(dt / (N * K) * 1e9)
    return samples


def median_table(
    samples: dict[str, list[float]],
    *,
    baselines: Sequence[str] = ("tramp",),
    speedup_vs: str | None = "threads",
    unit: str = "ns",
    digits: int = 0,
) -> list[str]:
    """Markdown rows: design, median [min..max], the ratio of its median to each baseline's
    (``x tramp``: how many trampoline switches one costs), and how many times faster than
    ``speedup_vs`` it is. Ratios use medians from the same run only."""
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = [b for b in baselines if b in med]
    speed = speedup_vs if speedup_vs in med else None
    cols = [f"x {b}" for b in base] + ([f"{speed} / design"] if speed else [])
    rows = [f"| design | median {unit} | [min..max] | " + " | ".join(cols) + " |", "|---|---:|---|" + "---:|" * len(cols)]
    for name, vals in samples.items():
        cells = [f"{med[name] / med[b]:.2f}" for b in base]
        if speed:
            cells.append(f"{med[speed] / med[name]:.1f}")
        lo, mid, hi = (f"{v:,.{digits}f}" for v in (min(vals), med[name], max(vals)))
        rows.append(f"| {DESIGNS[name].label} | {mid} | {lo}..{hi} | " + " | ".join(cells) + " |")
    return rows
