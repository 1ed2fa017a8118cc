"""``asyncdbo bench``: what one ubatch switch costs on this machine, against the alternatives.

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
  ``asyncdbo_inst`` adds an :class:`~asyncdbo.Instrument` whose hooks do nothing (the cost of
  enabled tracing hooks); ``asyncdbo_aio`` runs on asyncio's default loop instead of uvloop;
  ``asyncdbo_nohooks`` is the scheduler's switch loop with its two instrument branches deleted
  and nothing else changed: ``asyncdbo / asyncdbo_nohooks`` is what *disabled* tracing costs.
* ``threads``: vLLM's thread baton. One OS thread per participant and one ``threading.Event``
  per participant; a yield sets the next participant's event, waits on its own and clears it.
* ``aio_fut`` / ``aio_fut_uv``: each participant an ``asyncio.Task``; a yield resolves the next
  participant's Future and awaits a fresh one of its own (default loop / uvloop).

The full sweep with busy-thread and torch-op scenarios and result files is
``benchmarks/switch_cost.py``; this module holds the measured code so that both the command and
the benchmark time the same thing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import importlib.util
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from ._core import SWITCH, DBORun, Instrument
from .loop import _loop_factory as loop_factory
from .primitives import dbo_yield

__all__ = [
    "DESIGNS",
    "Design",
    "add_arguments",
    "check_round_robin",
    "machine_info",
    "main",
    "measure",
    "median_table",
]

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
    return loop_factory("uvloop" if uv else "asyncio")


def _bench_asyncdbo(
    N: int, K: int, work: Work, depth: int, *, uv: bool, instrument: Instrument | None, run_cls: type[DBORun] = DBORun
) -> float:
    """The scheduler's own run, built as ``run_ubatches`` builds it (host backend), so that a
    variant ``run_cls`` can stand in for it; ``run_ubatches``' per-run argument checks are left
    out, which is nothing next to the switches measured."""
    from .streams.host import HostBackend

    async def leaf(i: int) -> None:
        for _ in range(K):
            if work is not None:
                work(i)
            await dbo_yield("bench")

    fn = chain(depth, leaf)
    runs: list[DBORun] = []

    async def main() -> float:
        run = run_cls([fn(i) for i in range(N)], instrument=instrument)
        HostBackend().attach(run, "role")
        runs.append(run)
        t0 = now()
        await run.drive()
        return now() - t0

    with asyncio.Runner(loop_factory=_loop_factory(uv)) as runner:
        dt = runner.run(main())
    assert runs[0].num_switches == N * K, (runs[0].num_switches, N, K)
    return dt


class _NoHooksRun(DBORun):
    """DBORun whose switch loop is the scheduler's fast path minus the two ``inst is not None``
    branches (this benchmark never parks, so only that path runs). It exists to measure what the
    branches cost when no instrument is set; keep it in step with ``DBORun._loop_until_done``."""

    async def _loop_until_done(self) -> None:
        ready, woken, timers = self._ready, self._woken, self._timers
        watch = self._num_parked > 0 or bool(timers)
        streams = self._install is not None
        switch, pop, push = SWITCH, ready.popleft, ready.append
        n = 0
        try:
            while ready:
                ub = pop()
                if streams and ub.stream is not self._installed:
                    self.install_stream(ub.stream)
                try:
                    request = ub.resume()
                except BaseException as exc:
                    self._stopped(ub, exc)
                    continue
                if request is switch:
                    n += 1
                    if watch and (woken or timers):
                        self._drain()
                    push(ub)
                else:
                    raise AssertionError(f"the switch benchmark never parks (got {request!r})")
        finally:
            self.num_switches += n


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


def machine_info() -> dict[str, str]:
    """What a result file must name: CPU model and cores, kernel, and the versions that matter."""
    import os
    import platform

    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    info = {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
    for mod in ("torch", "uvloop"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = "not installed"
    import torch

    info["torch threads"] = str(torch.get_num_threads())
    info["accelerator"] = str(getattr(torch, "accelerator", None) and torch.accelerator.current_accelerator())
    return info


def hardware_tag(info: dict[str, str]) -> str:
    """Short name for result files: ``cpu-2c`` or ``cuda-<gpu>``."""
    acc = info.get("accelerator", "None")
    if acc not in ("None", ""):
        return acc.replace(":", "")
    return f"cpu-{info['cores']}c"


def results_preamble(title: str, command: str, machine_label: str = "Machine") -> tuple[list[str], dict[str, str]]:
    """The opening lines every results file carries (title, machine with its load average at the
    start, the exact command) and the machine info they came from."""
    import os

    info = machine_info()
    info["load average at start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        f"# {title}\n",
        f"{machine_label}: " + ", ".join(f"{k} {v}" for k, v in info.items()) + "\n",
        f"Command: `{command}`\n",
    ]
    return lines, info


def results_stem(out: Any, theme: str, info: dict[str, str]) -> Any:
    """``out/<theme>_<hardware>_<date>[_runN]`` (a ``pathlib.Path`` without suffix), the first one
    with no ``.md`` yet: earlier runs of the day stay, since noisy machines need more than one."""
    import datetime
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = f"{theme}_{hardware_tag(info)}_{datetime.date.today().isoformat()}"
    stem, n = out / base, 2
    while stem.with_suffix(".md").exists():
        stem, n = out / f"{base}_run{n}", n + 1
    return stem


def publish_results(text: str, out: Any, theme: str, info: dict[str, str]) -> None:
    """Print a results report, and write it to the next free results file when ``out`` is set."""
    print(text)
    if out is not None:
        path = results_stem(out, theme, info).with_suffix(".md")
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)


# ------------------------------------------------------------------ the command
_NEEDS_UVLOOP = ("asyncdbo", "asyncdbo_inst", "aio_fut_uv")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ubatches", "-n", type=int, nargs="+", default=[2], help="numbers of ubatches (default 2)")
    parser.add_argument("--depth", type=int, default=2, help="async def frames on the await chain (default 2)")
    parser.add_argument("--switches", type=int, default=100_000, help="switches per run of the fast designs")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; medians are over rounds (default 5)")
    parser.add_argument(
        "--designs", nargs="+", default=list(DESIGNS), choices=list(DESIGNS), help="designs to measure (default all)"
    )


def main(args: argparse.Namespace) -> int:
    if args.switches < 10 or args.rounds < 1:
        print(f"asyncdbo bench: need --switches >= 10 and --rounds >= 1 (got {args.switches}, {args.rounds})", file=sys.stderr)
        return 2
    designs = list(args.designs)
    if importlib.util.find_spec("uvloop") is None:
        uv = [d for d in designs if d in _NEEDS_UVLOOP]
        designs = [d for d in designs if d not in _NEEDS_UVLOOP]
        if uv:
            print(f"asyncdbo bench: uvloop is not installed; skipping {', '.join(uv)}", file=sys.stderr)
    switches = {"fast": args.switches, "aio": max(10, args.switches // 4), "threads": max(10, args.switches // 20)}
    print(f"# switch cost, depth {args.depth}, {args.rounds} rounds (python {sys.version.split()[0]})")
    for N in args.ubatches:
        if N < 1:
            print(f"asyncdbo bench: --ubatches must be >= 1 (got {N})", file=sys.stderr)
            return 2
        samples = measure(designs, N=N, depth=args.depth, switches=switches, rounds=args.rounds)
        print(f"\nN = {N} ubatches")
        print("\n".join(median_table(samples)))
    return 0
