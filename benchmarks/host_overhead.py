"""Host time per yield of an eager DBO step: asyncdbo against the same code without DBO, with a
vLLM-style thread baton beside it.

The step is what the host does for a 61-layer MoE model under the ``ht`` schedule with role
streams and nothing to wait for: per layer and ubatch the primitive sequence of
``asyncdbo.moe.layer`` (``dbo_yield_and_switch_from_compute_to_comm("dispatch")``,
``dbo_switch_to_compute_sync()``, ``..._compute_to_comm("combine")``, ``dbo_switch_to_compute()``,
``dbo_switch_to_comm()``, ``..._comm_to_compute("combine_done")``): three yields, three event
records and waits, four stream switches, no comm, no parking, no tensor work. Designs, run
interleaved in every round:

* ``no DBO``: the same coroutines awaited one after the other outside a run (every primitive is
  then a no-op returning a done awaitable): the cost of the code itself;
* ``asyncdbo``: ``run_ubatches`` on the host backend (run set-up and tear-down included), awaited
  in a running loop as ``asyncdbo.serving.runner`` awaits it, a sample's steps one after the other
  under one ``asyncio.Runner.run`` (so are ``no DBO`` and the ladder's async rungs: the runner's own
  work per call, 60-110 us measured here, stays out of every design);
* ``floor``: the least any coroutine design can pay, and what the ``<= 400 ns`` goal is measured
  against: the same number of ubatch coroutines, each awaiting a one-line generator that yields a
  sentinel 3 times per layer, driven round-robin by ``ctx.run(coro.send, None)`` from a deque (the
  kernel's fast loop with nothing else in it: no primitives, no marks, no events, no streams),
  minus the same coroutines awaiting a done awaitable instead;
* ``kernel``: the same bare coroutines (yielding the kernel's ``SWITCH``) driven by asyncdbo's
  kernel (``DBORun(...).drive()``: its fast loop, run set-up and tear-down, no DBO layer) over the
  same coroutines awaited in turn: what the kernel adds to the floor;
* ``dbo_yield``: ``run_ubatches`` on the host backend with ``await dbo_yield(tag)`` as each of the
  3 yields (the whole DBO layer's set-up and the cheapest primitive, no stream or event work) over
  the same code without DBO: what the DBO layer adds to the kernel, before any stream work. The
  gap from here to ``asyncdbo`` is the ``ht`` sequence's own work (4 event records and waits,
  4 stream switches, the role checks and missing-await marks of 6 primitive calls);
* ``vllm`` (only where ``vllm`` is importable): vLLM's own ``UBatchContext`` threads making the
  calls of its DeepEP ``ht`` path (``benchmarks/_vllm_ubatch.py``), over the same calls with DBO
  off (``vllm no-DBO``);
* ``threads`` / ``threads pinned``: the ubatches driven by ``benchmarks/_thread_baton.py``,
  ``moe_step.py``'s driver (vLLM's ``UBatchWrapper`` control flow: one OS thread per ubatch, a
  ``threading.Event`` baton each), the same primitives, streams and events; ``pinned`` runs
  every thread on one CPU (``os.sched_setaffinity``), where a baton pass needs no cross-CPU
  wake-up.

host ns per yield = (design step time - no-DBO step time) / (layers x 3 x N), the baseline's sample
taken right before the design's in each round. Both wall time and
the process's CPU time are reported (the machine may be shared: CPU time is steadier; for the
thread design wall time also counts the OS's wake-up latency, which CPU time does not).
``--base REV`` (repeatable) adds ``asyncdbo`` at an earlier commit as another design, in the
same rounds (exported with ``git archive``, see ``compare_commits.py``: Python files only, so it
runs without its C extensions; ``--base HEAD`` measures this commit's pure-Python paths).

Each C extension's share: where they were built, the current package runs as four designs in the
same rounds, ``(Python)``, ``(C kernel)`` (the kernel's switch loop in C, asyncdbo/_core/_spin.c),
``(C primitives)`` (the primitives in C, asyncdbo/dbo/_speedups.c, the Python loop) and
``(C kernel + C primitives)`` (what an install runs). Users pick the same configurations with
``ASYNCDBO_PURE_PYTHON=1``, ``ASYNCDBO_NO_C_PRIMITIVES=1`` and ``ASYNCDBO_NO_C_KERNEL=1`` at import
(asyncdbo/_core/extensions.py); here one process swaps the same module attributes around each
step instead (the kernel's loop module and UBatch's resume type; the primitives from
``primitives.PURE`` or ``primitives.FAST``), so the four run interleaved on the same machine state.

    python benchmarks/host_overhead.py                 # writes benchmarks/results/host_overhead_<hw>_<date>.md
    python benchmarks/host_overhead.py --base 6e15bd5 --base HEAD  # also 6e15bd5 and HEAD in pure Python
    python benchmarks/host_overhead.py --quick         # seconds, prints only
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import _progress
import _vllm_ubatch

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
YIELDS_PER_LAYER = 3


def make_forward(pkg: Any, layers: int) -> Callable[[int], Any]:
    """The ``ht`` layer's host-side primitive sequence, ``layers`` times (see the module doc)."""
    to_comm = pkg.dbo_yield_and_switch_from_compute_to_comm
    to_compute = pkg.dbo_yield_and_switch_from_comm_to_compute
    sync_compute = pkg.dbo_switch_to_compute_sync
    switch_compute, switch_comm = pkg.dbo_switch_to_compute, pkg.dbo_switch_to_comm

    async def forward(i: int) -> int:
        for _ in range(layers):
            await to_comm("dispatch")
            await sync_compute()
            await to_comm("combine")
            switch_compute()
            switch_comm()
            await to_compute("combine_done")
        return i

    return forward


class _Done:
    __slots__ = ()

    def __await__(self) -> Any:
        return
        yield


_SENTINEL, _DONE = object(), _Done()


@types.coroutine
def _bare_switch() -> Any:
    yield _SENTINEL


async def _await_done(layers: int) -> None:
    """The baseline of the floor and the kernel: 3 awaits per layer that never suspend."""
    for _ in range(layers):
        await _DONE
        await _DONE
        await _DONE


class Awaited:
    """A design whose step is a coroutine, awaited inside the benchmark's running loop the way a
    server awaits ``run_ubatches`` (asyncdbo.serving.runner), ``repeat`` steps per ``runner.run``:
    the runner's own work per call (a task, signal handlers) stays out of every design's time."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


Design = Callable[[], Any] | Awaited  # a plain call (the floor, the thread baton), or an awaited step


def floor_designs(layers: int, N: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(bare round-robin step, the same coroutines awaited in turn): see ``floor`` in the module doc."""

    async def switching() -> None:
        for _ in range(layers):
            await _bare_switch()
            await _bare_switch()
            await _bare_switch()

    def bare() -> None:
        ready = collections.deque(
            functools.partial(contextvars.copy_context().run, switching().send, None) for _ in range(N)
        )
        pop, push = ready.popleft, ready.append
        while ready:
            resume = pop()
            try:
                if resume() is _SENTINEL:
                    push(resume)
            except StopIteration:
                pass

    def awaited() -> None:
        for _ in range(N):
            try:
                contextvars.copy_context().run(_await_done(layers).send, None)
            except StopIteration:
                pass

    return bare, awaited


def ladder_designs(layers: int, N: int) -> dict[str, Design]:
    """``kernel`` and ``dbo_yield`` (module doc) and their baselines, as plain calls."""
    import asyncdbo
    from asyncdbo.lowlevel import SWITCH, DBORun

    @types.coroutine
    def trap() -> Any:
        yield SWITCH

    y = asyncdbo.dbo_yield

    async def bare(i: int) -> None:
        for _ in range(layers):
            await trap()
            await trap()
            await trap()

    async def yields(i: int) -> None:
        for _ in range(layers):
            await y("a")
            await y("b")
            await y("c")

    async def each(fn: Callable[[int], Any]) -> None:
        for i in range(N):
            await fn(i)

    args = [(i,) for i in range(N)]
    return {
        "kernel": Awaited(lambda: DBORun([bare(i) for i in range(N)]).drive()),
        "kernel no-switch": Awaited(lambda: each(lambda i: _await_done(layers))),
        "dbo_yield": Awaited(lambda: asyncdbo.run_ubatches(yields, args, backend="host")),
        "dbo_yield no-switch": Awaited(lambda: each(yields)),
    }


BASELINES = {"floor": "floor no-switch", "kernel": "kernel no-switch", "dbo_yield": "dbo_yield no-switch",
             "vllm": "vllm no-DBO"}


def _times(design: Design, repeat: int, runner: asyncio.Runner) -> tuple[float, float]:
    """(wall s, CPU s) of ``repeat`` steps."""
    if isinstance(design, Awaited):
        make = design.make

        async def steps() -> tuple[float, float]:
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(repeat):
                await make()
            return time.perf_counter() - t0, time.process_time() - c0

        return runner.run(steps())
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(repeat):
        design()
    return time.perf_counter() - t0, time.process_time() - c0


def designs(pkgs: dict[str, Any], layers: int, N: int) -> dict[str, Design]:
    """One step of each design: a plain call, or an :class:`Awaited` step."""
    import asyncdbo
    from asyncdbo.backends.host import HostBackend
    from _thread_baton import run_threads

    fwd = make_forward(asyncdbo, layers)
    args = [(i,) for i in range(N)]

    async def plain() -> None:
        for i in range(N):
            await fwd(i)

    out: dict[str, Design] = {"no DBO": Awaited(plain)}
    for name, pkg in pkgs.items():
        f = make_forward(pkg, layers)

        def step(pkg: Any = pkg, f: Callable[[int], Any] = f) -> Any:
            return pkg.run_ubatches(f, args, backend="host")

        out[name] = Awaited(step)
    out["floor"], out["floor no-switch"] = floor_designs(layers, N)
    out.update(ladder_designs(layers, N))
    out["threads"] = lambda: run_threads(fwd, args, HostBackend())
    cpus = sorted(os.sched_getaffinity(0))

    def pinned() -> None:
        # Threads inherit the creating thread's CPU set: every baton pass stays on one CPU.
        os.sched_setaffinity(0, {cpus[0]})
        try:
            run_threads(fwd, args, HostBackend())
        finally:
            os.sched_setaffinity(0, cpus)

    out["threads pinned"] = pinned
    if _vllm_ubatch.available():  # vLLM's own UBatchContext, over its own code with DBO off
        out["vllm"] = lambda: _vllm_ubatch.vllm_ht_step(layers, N)
        out["vllm no-DBO"] = lambda: _vllm_ubatch.vllm_ht_serial(layers, N)
    return out


Samples = dict[str, dict[str, list[float]]]


def measure(pkgs: dict[str, Any], layers: int, N: int, rounds: int, runner: asyncio.Runner) -> Samples:
    """Per design: ``wall``/``cpu`` seconds per step, one sample per round (designs interleaved),
    and under ``"<design> baseline"`` its baseline (:data:`BASELINES`, else no DBO) measured right
    before it in the same round: each difference is taken between neighbouring samples, so a
    machine whose speed drifts within a round (a shared VM) adds less noise to it."""
    ds = designs(pkgs, layers, N)
    # Repeat each step so that one sample lasts ~60,000 yields of asyncdbo time; threads get fewer.
    yields = layers * YIELDS_PER_LAYER * N
    reps = {name: max(1, 60_000 // yields) for name in ds}
    for slow in ("threads", "threads pinned", "vllm", "vllm no-DBO"):
        if slow in reps:
            reps[slow] = max(1, reps[slow] // 20)
    for name, fn in ds.items():  # warm-up
        _times(fn, 1, runner)
    bases = {"no DBO", *BASELINES.values()}
    samples: Samples = {name: {"wall": [], "cpu": []} for name in ds}
    samples.update({f"{name} baseline": {"wall": [], "cpu": []} for name in ds if name not in bases})
    for _ in range(rounds):
        for name, fn in ds.items():
            if name in bases:
                continue
            base = BASELINES.get(name, "no DBO")
            for into, f in ((samples[f"{name} baseline"], ds[base]), (samples[name], fn)):
                wall, cpu = _times(f, reps[name], runner)
                into["wall"].append(wall / reps[name])
                into["cpu"].append(cpu / reps[name])
            if base == "no DBO":
                for key in ("wall", "cpu"):
                    samples[base][key].append(samples[f"{name} baseline"][key][-1])
    return samples


def per_yield(samples: Samples, design: str, key: str, yields: int) -> tuple[float, float, float]:
    """(median, min, max) ns per yield of ``design`` over its baseline (no DBO, or for the ladder's
    rungs the same coroutines without switching) measured beside it, by round."""
    vals = [(d - b) / yields * 1e9 for d, b in zip(samples[design][key], samples[f"{design} baseline"][key])]
    return statistics.median(vals), min(vals), max(vals)


def variants(label: str) -> dict[str, Any]:
    """The current package under each extension configuration (module doc), by design name: an
    object with the primitives and a ``run_ubatches`` that runs under that configuration."""
    import asyncdbo
    from asyncdbo._core import fastpath
    from asyncdbo.dbo import primitives

    spin = fastpath.C
    configs = {"Python": (False, False)}
    if spin is not None:
        configs["C kernel"] = (True, False)
    if primitives.FAST is not None:
        configs["C primitives"] = (False, True)
    if spin is not None and primitives.FAST is not None:
        configs["C kernel + C primitives"] = (True, True)
    out: dict[str, Any] = {}
    for config, (c_kernel, c_prims) in configs.items():
        table = primitives.FAST if c_prims else primitives.PURE
        assert table is not None

        async def run(fn: Callable[..., Any], args: Any, c_kernel: bool = c_kernel, **kw: Any) -> Any:
            with fastpath.kernel_loop("c" if c_kernel else "python"):  # the kernel's seam for this
                return await asyncdbo.run_ubatches(fn, args, **kw)

        out[f"asyncdbo {label} ({config})"] = types.SimpleNamespace(**table, run_ubatches=run)
    return out


def export_base(rev: str, into: Path, name: str) -> ModuleType:
    from compare_commits import export_base as export

    sub = into / name
    sub.mkdir()
    return export(rev, sub, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, N = 2, one round, print only")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--base", action="append", default=[],
                        help="also measure asyncdbo at this git revision (pure Python: its C extensions are not "
                             "built), same rounds; may be given more than once")
    parser.add_argument("--out", type=Path, default=None)
    _progress.add_quiet_flag(parser)
    args = parser.parse_args(argv)
    import uvloop

    import asyncdbo
    from _results import publish_results, results_preamble

    cells = [(2, 2)] if args.quick else [(61, 2), (61, 4), (61, 8), (15, 2), (15, 8)]
    rounds = 1 if args.quick else args.rounds
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    head, dirty = git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "asyncdbo"))
    pkgs: dict[str, Any] = variants(f"{head}{'+changes' if dirty else ''}")
    command = "python benchmarks/host_overhead.py" + (" --quick" if args.quick else "")
    command += "".join(f" --base {b}" for b in args.base)
    with tempfile.TemporaryDirectory() as tmp, asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        bases: dict[str, ModuleType] = {}
        for k, base in enumerate(args.base):
            rev = git("rev-parse", "--short", base)
            bases[f"asyncdbo {rev} (Python)"] = export_base(rev, Path(tmp), f"asyncdbo_base{k}")
        pkgs = {**bases, **pkgs}
        title = "Host overhead per yield: an eager ht step of primitives, no comm, no parking"
        lines, info = results_preamble(title, command)
        names = ["floor", "kernel", "dbo_yield", *pkgs, "threads", "threads pinned"]
        if _vllm_ubatch.available():
            names.append("vllm")
            lines.append(f"`vllm`: vLLM {_vllm_ubatch.version()}'s own `UBatchContext` threads making the calls of its "
                         "DeepEP `ht` prepare/finalize (benchmarks/_vllm_ubatch.py: only the CUDA stream and event calls "
                         "stubbed), over the same calls with DBO off. `threads`: the re-implemented baton.\n")
        lines.append(
            f"ns of host time per yield over the same code without DBO, medians of {rounds} interleaved rounds "
            "[min..max] (each design's sample minus its baseline's, measured right before it in the same round); wall time, then the process's CPU "
            f"time. `ht` primitive sequence, {YIELDS_PER_LAYER} yields per layer and ubatch, uvloop; a step is "
            "`run_ubatches` with its set-up, awaited in a running loop (a sample's steps under one `Runner.run`).\n"
        )
        head_row = ("| layers | N | no DBO us/step | " + " | ".join(f"{n} ns/yield wall" for n in names) + " | "
                    + " | ".join(f"{n} ns/yield CPU" for n in names) + " |")
        lines += [head_row, "|---:|---:|---:|" + "---:|" * (2 * len(names))]
        extra: dict[tuple[int, int, str, str], float] = {}  # (layers, N, design, key) -> median s/step over no DBO
        _progress.start(args.quiet, "cells (layers x N)", len(cells))
        for layers, N in cells:
            _progress.step(f"{layers} layers, N={N}")
            samples = measure(pkgs, layers, N, rounds, runner)
            yields = layers * YIELDS_PER_LAYER * N
            base_us = statistics.median(samples["no DBO"]["wall"]) * 1e6
            row = [str(layers), str(N), f"{base_us:.0f}"]
            for key in ("wall", "cpu"):
                for n in names:
                    med, lo, hi = per_yield(samples, n, key, yields)
                    extra[(layers, N, n, key)] = med * yields / 1e9
                    row.append(f"{med:,.0f} [{lo:,.0f}..{hi:,.0f}]")
            lines.append("| " + " | ".join(row) + " |")
            print(f"layers={layers} N={N} done", file=sys.stderr)
        slopes = [(lo, hi, N) for lo, hi in ((15, 61),) for N in (2, 8) if (lo, N) in cells and (hi, N) in cells]
        if slopes:
            lines += [
                "",
                "Marginal host time per yield, without the per-run set-up: (overhead at 61 layers - overhead at 15 "
                "layers) / (46 x 3 x N), from the medians above.",
                "",
                "| N | design | marginal ns/yield wall | marginal ns/yield CPU |",
                "|---:|---|---:|---:|",
            ]
            for lo, hi, N in slopes:
                for n in names:
                    marg = {k: (extra[(hi, N, n, k)] - extra[(lo, N, n, k)]) / ((hi - lo) * YIELDS_PER_LAYER * N)
                            for k in ("wall", "cpu")}
                    lines.append(f"| {N} | {n} | {marg['wall'] * 1e9:,.0f} | {marg['cpu'] * 1e9:,.0f} |")
        lines.append(
            "\nCPU time is the process's (every thread's), sampled with `time.process_time`, whose resolution on Linux "
            "is fine enough for these samples (60,000 yields of asyncdbo each, tens of ms)."
        )
    publish_results("\n".join(lines) + "\n", args.out if args.out is not None else (None if args.quick else RESULTS),
                    "host_overhead", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
