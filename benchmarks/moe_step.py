"""One DP+EP MoE step on 2 gloo ranks: serial vs asyncdbo DBO vs a vLLM-style thread DBO.

All three run the same model code (``asyncdbo.models.MiniModel``, whose MoE layers yield through
the ``dbo_*`` primitives) on the same planned ubatches, back to back in every step:

* ``serial``: the whole batch as one ubatch under the same backend (so its comm crosses the same
  modeled link), as the runner's fall-back path does;
* ``asyncdbo``: the ubatches under :func:`asyncdbo.run_ubatches`;
* ``threads``: the ubatches driven the way vLLM's ``UBatchWrapper`` drives them. Every ubatch gets
  its own OS thread, started each step. The threads form a ring of ``threading.Event`` batons
  (ubatch i waits on event i and sets event i+1). The main thread starts them all, then hands the
  baton to ubatch 0 (vLLM's ready barrier plus ``ctx[0].cpu_wait_event.set()``). At each ``dbo_*``
  yield the thread passes the baton on and waits for its own event (vLLM's ``_cpu_yield``).
  A thread that must wait for comm blocks on it while it holds the baton, as a vLLM ubatch thread
  does in a CPU-blocking dispatch; a finishing thread runs its pending recv hook and passes the
  baton on (vLLM's ``__exit__``). Each ubatch coroutine is stepped with ``coro.send`` inside its
  ubatch context, so the primitives, streams and events are exactly asyncdbo's. Only the handoff
  differs.

Numbers per step and rank (medians over steps, then the max over ranks: a DP step ends when the
slowest rank ends):

* step time: the driver call, planning excluded (identical for all three);
* compute: union of the CPU steps of all ubatches (on the host backend the CPU is the compute
  stream); comm: union of the comm works from issue to release; hidden share: comm time during
  which some ubatch computed;
* overhead: step time outside both compute and comm (scheduler work, handoffs, wake-ups);
* peak memory: the process's peak RSS during the step minus its RSS before it (``VmHWM`` after
  resetting it through ``/proc/self/clear_refs``), with glibc's mmap threshold fixed so that
  large tensors go back to the OS when freed.

    python benchmarks/moe_step.py            # full run, writes benchmarks/results/moe_step_<hw>_<date>.md
    python benchmarks/moe_step.py --quick    # a few seconds, prints only
"""

# Legend: T tokens on this rank, V vocab.

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
DESIGNS = ("serial", "asyncdbo", "threads")


@dataclass(frozen=True, kw_only=True)
class Case:
    """One row of the table."""

    name: str
    shape: str  # "decode" | "prefill"
    tokens: int  # per rank
    layers: int
    link: str | None  # None: real loopback gloo; else a modeled link preset, scaled
    link_scale: float = 1000.0
    context: int = 64


# ------------------------------------------------------------------ the thread-baton driver
def run_threads(fn: Any, ubatch_args: list[tuple[Any, ...]], backend: Any, policy: str = "role") -> tuple[list[Any], Any, list[tuple[float, float]]]:
    """Drive ``fn(*args)`` per ubatch the vLLM way (see the module docstring). Returns the
    results, the DBORun (for its comm works) and the CPU step spans."""
    from asyncdbo.dbo.hooks import run_pending_hook
    from asyncdbo.dbo.state import Lane, RunState
    from asyncdbo.lowlevel import SWITCH, DBORun, Signal

    coros = [fn(*a) for a in ubatch_args]
    run = DBORun(coros, install=backend.install_stream, at_exit=run_pending_hook, name="threads")
    state = RunState(backend=backend, policy=policy, lanes=[Lane(ub) for ub in run.ubatches])
    run.ext = state
    for ub, lane in zip(run.ubatches, state.lanes):
        ub.ext = lane
    backend.attach(run, state)
    n = len(coros)
    batons = [threading.Event() for _ in range(n)]
    done = [False] * n
    spans: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    def pass_baton(i: int) -> None:
        for step in range(1, n + 1):
            j = (i + step) % n
            if not done[j]:
                batons[j].set()
                return

    def block_on(signal: Signal) -> None:
        """Wait for a comm completion while holding the baton, firing the modeled link's timers."""
        woke = threading.Event()
        signal.add_waiter(woke.set)
        while not signal.done():
            run._fire_timers()
            timeout = max(0.0, run._timers[0][0] - time.perf_counter()) if run._timers else None
            woke.wait(timeout)

    def body(i: int) -> None:
        ub = run.ubatches[i]
        mine = batons[i]
        with torch.inference_mode():
            mine.wait()
            mine.clear()
            try:
                while True:
                    if run._timers:
                        run._fire_timers()
                    t0 = time.perf_counter()
                    try:
                        request = ub.resume()
                    except StopIteration as stop:
                        spans.append((t0, time.perf_counter()))
                        run._finish(ub, stop.value)  # runs the pending recv hook, like __exit__
                        return
                    spans.append((t0, time.perf_counter()))
                    if request is SWITCH:
                        run.num_switches += 1
                        if any(not done[j] for j in range(n) if j != i):
                            pass_baton(i)
                            mine.wait()
                            mine.clear()
                    elif isinstance(request, Signal):
                        block_on(request)
                    else:
                        raise TypeError(f"thread driver cannot wait on {request!r}")
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)
                for b in batons:
                    b.set()
            finally:
                done[i] = True
                pass_baton(i)

    threads = [threading.Thread(target=body, args=(i,), name=f"ubatch-{i}") for i in range(n)]
    for t in threads:
        t.start()
    batons[0].set()
    for t in threads:
        t.join()
    backend.detach(run, state)
    if errors:
        raise errors[0]
    return [ub.result for ub in run.ubatches], run, spans


# ------------------------------------------------------------------ per rank
def _rss() -> tuple[int, int]:
    """(current RSS, peak RSS since the last reset) in bytes, from /proc/self/status."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                vals[line.split(":")[0]] = int(line.split()[1]) * 1024
    return vals["VmRSS"], vals["VmHWM"]


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Spans:
    """Instrument recording each CPU step of an asyncdbo run (resume -> suspend)."""

    def __init__(self) -> None:
        from asyncdbo.lowlevel import Instrument

        outer = self
        self.spans: list[tuple[float, float]] = []
        self.run: Any = None

        class _I(Instrument):
            def run_started(self, run: Any) -> None:
                outer.run = run

            def resuming(self, ub: Any) -> None:
                outer._t0 = time.perf_counter()

            def stepped(self, ub: Any, request: object) -> None:
                outer.spans.append((outer._t0, time.perf_counter()))

        self.instrument = _I()
        self._t0 = 0.0


def _numbers(wall: float, spans: list[tuple[float, float]], run: Any) -> dict[str, float]:
    from asyncdbo.observe import hidden_seconds, union_seconds

    comm = [(w.t_issue, w.t_end or w.t_issue) for w in run.ext.comm_records()]
    comm_s = union_seconds(comm)
    compute_s = union_seconds(spans)
    busy_s = union_seconds([*spans, *comm])
    return {
        "step_s": wall,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "hidden_share": hidden_seconds(comm, spans) / comm_s if comm_s else 0.0,
        "overhead_s": max(0.0, wall - busy_s),
    }


async def _rank_async(rank: int, world: int, case: Case, steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    import asyncdbo
    from asyncdbo.backends.host import HostBackend
    from asyncdbo.cli.demo import DemoConfig, _decode_chunks, _prefill_chunks
    from asyncdbo.models import MiniModel
    from asyncdbo.plan import merge_outputs, plan_step
    from asyncdbo.serving import BatchBuilder

    dcfg = DemoConfig(ranks=world, tokens=case.tokens, layers=case.layers, shape=case.shape, context=case.context,
                      steps=steps, warmup=warmup, link=case.link, link_scale=case.link_scale)
    mcfg = dcfg.model_config()
    group = dist.group.WORLD
    model = MiniModel(mcfg, ep_group=group, max_ubatches=2, device=torch.device("cpu"))
    builder = BatchBuilder(mcfg.kv_cache_config)
    link = dcfg.link_spec()
    peak_ok = _reset_peak()

    def backend() -> Any:
        return HostBackend(link=link)

    if case.shape == "decode":
        ctx_batch = builder.build(_decode_chunks(dcfg, rank, -1, mcfg.vocab_size, case.context))
        await asyncdbo.run_ubatches(model.forward, [(ctx_batch.input_ids_T, ctx_batch.positions_T, ctx_batch.attn)], backend=backend())
    out: dict[str, Any] = {d: [] for d in DESIGNS}
    out["max_abs_diff"] = 0.0
    out["peak_ok"] = peak_ok
    for i in range(warmup + steps):
        if case.shape == "prefill":
            builder.reset()
            batch = builder.build(_prefill_chunks(dcfg, rank, i, mcfg.vocab_size))
        else:
            batch = builder.build(_decode_chunks(dcfg, rank, i, mcfg.vocab_size, 1))
        plan = plan_step(batch.attn.query_start_loc_cpu, num_ubatches=2, attn_metadata=batch.attn, dp_group=group)
        if not plan.record.microbatched:
            raise SystemExit(f"case {case.name}: the step did not microbatch ({plan.record.reason}: {plan.record.detail})")
        assert plan.num_tokens_padded == batch.num_tokens, "benchmark batches are equal on every rank: no padding"
        args = [(batch.input_ids_T[s.padded_token_slice], batch.positions_T[s.padded_token_slice], m)
                for s, m in zip(plan.slices, plan.attn_metadata)]
        logits: dict[str, torch.Tensor] = {}
        for design in DESIGNS:
            dist.barrier()
            rss0, _ = _rss()
            _reset_peak()
            if design == "threads":
                t0 = time.perf_counter()
                outs, run, spans = run_threads(model.forward, args, backend())
                wall = time.perf_counter() - t0
                logits[design] = merge_outputs(outs, plan.slices, batch.num_tokens)
            else:
                rec = _Spans()
                whole = [(batch.input_ids_T, batch.positions_T, batch.attn)]
                t0 = time.perf_counter()
                with torch.inference_mode():
                    outs = await asyncdbo.run_ubatches(
                        model.forward, whole if design == "serial" else args, backend=backend(), instrument=rec.instrument
                    )
                wall = time.perf_counter() - t0
                run, spans = rec.run, rec.spans
                logits[design] = outs[0] if design == "serial" else merge_outputs(outs, plan.slices, batch.num_tokens)
            _, peak = _rss()
            if i >= warmup:
                row = _numbers(wall, spans, run)
                row["peak_bytes"] = float(peak - rss0)
                out[design].append(row)
        for design in ("asyncdbo", "threads"):
            diff = float((logits[design] - logits["serial"]).abs().max())
            out["max_abs_diff"] = max(out["max_abs_diff"], diff)
    return out


def bench_rank(rank: int, world: int, case: Case, steps: int, warmup: int) -> dict[str, Any]:
    import asyncdbo

    return asyncdbo.run(_rank_async, rank, world, case, steps, warmup)


# ------------------------------------------------------------------ report
def _med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def summarize(case: Case, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per design: medians over steps per rank, then the slowest rank (max)."""
    s: dict[str, Any] = {"diff": max(r["max_abs_diff"] for r in per_rank)}
    for d in DESIGNS:
        s[d] = {k: max(_med(r[d], k) for r in per_rank) for k in ("step_s", "compute_s", "comm_s", "hidden_share", "overhead_s", "peak_bytes")}
        s[d]["min_step_s"] = max(min(x["step_s"] for x in r[d]) for r in per_rank)
        s[d]["max_step_s"] = max(max(x["step_s"] for x in r[d]) for r in per_rank)
    return s


def table(results: list[tuple[Case, dict[str, Any]]]) -> list[str]:
    rows = [
        "| case | design | step ms [min..max] | speedup vs serial | speedup vs threads | compute ms | comm ms | comm hidden | overhead ms | peak MiB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, s in results:
        for d in DESIGNS:
            x = s[d]
            rows.append(
                f"| {case.name} | {d} | {x['step_s'] * 1e3:.1f} [{x['min_step_s'] * 1e3:.1f}..{x['max_step_s'] * 1e3:.1f}] | "
                f"{s['serial']['step_s'] / x['step_s']:.2f}x | {s['threads']['step_s'] / x['step_s']:.2f}x | "
                f"{x['compute_s'] * 1e3:.1f} | {x['comm_s'] * 1e3:.1f} | {x['hidden_share']:.0%} | "
                f"{x['overhead_s'] * 1e3:.2f} | {x['peak_bytes'] / 2**20:.1f} |"
            )
    return rows


def goals(results: list[tuple[Case, dict[str, Any]]]) -> list[str]:
    rows = [
        "| case | asyncdbo step / max(serial compute, serial comm) (goal <= 1.1 on a modeled link) | asyncdbo / threads (goal <= 1.0) | max abs diff vs serial |",
        "|---|---:|---:|---:|",
    ]
    for case, s in results:
        bound = max(s["serial"]["compute_s"], s["serial"]["comm_s"])
        r = s["asyncdbo"]["step_s"] / bound
        g = "" if case.link is None else (" (met)" if r <= 1.1 else " (MISSED)")
        rt = s["asyncdbo"]["step_s"] / s["threads"]["step_s"]
        rows.append(f"| {case.name} | {r:.2f}{g} | {rt:.2f} ({'met' if rt <= 1.0 else 'MISSED'}) | {s['diff']:.1e} |")
    return rows


FULL_CASES = [
    Case(name="decode 64 tok/rank, 2 layers, loopback", shape="decode", tokens=64, layers=2, link=None),
    Case(name="decode 64 tok/rank, 2 layers, ib400 x1000", shape="decode", tokens=64, layers=2, link="ib400"),
    Case(name="decode 64 tok/rank, 8 layers, ib400 x1000", shape="decode", tokens=64, layers=8, link="ib400"),
    Case(name="prefill 1024 tok/rank, 2 layers, loopback", shape="prefill", tokens=1024, layers=2, link=None),
    Case(name="prefill 1024 tok/rank, 2 layers, ib400 x1000", shape="prefill", tokens=1024, layers=2, link="ib400"),
]
QUICK_CASES = [
    Case(name="decode 32 tok/rank, 1 layer, ib400 x1000", shape="decode", tokens=32, layers=1, link="ib400", context=16),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one tiny case, 2 steps, print only (smoke test)")
    parser.add_argument("--steps", type=int, default=7, help="measured steps per case (default 7)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results, not with --quick)")
    args = parser.parse_args(argv)
    # Large tensors through mmap, returned to the OS when freed: RSS then follows live memory.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    from _results import publish_results, results_preamble

    from asyncdbo.testing import RankPool

    cases = QUICK_CASES if args.quick else FULL_CASES
    steps, warmup = (2, 1) if args.quick else (args.steps, 2)
    results = []
    t_start = time.perf_counter()
    with RankPool(2, timeout_s=600) as pool:
        for case in cases:
            per_rank = pool.run(bench_rank, case, steps, warmup)
            results.append((case, summarize(case, per_rank)))
            print(f"{case.name} done", file=sys.stderr)
    lines, info = results_preamble(
        "MoE step: serial vs asyncdbo DBO vs vLLM-style thread DBO, 2 gloo ranks",
        f"python benchmarks/moe_step.py{' --quick' if args.quick else ''}",
    )
    lines[-1] = lines[-1].rstrip("\n") + f" ({steps} measured steps after {warmup} warm-up, designs interleaved in every step)\n"
    lines.append(
        "Model: asyncdbo.models.MiniModel (hidden 256, 8 experts, top-2, 1 shared expert, HT schedule), "
        "EP over both ranks, 2 ubatches (token split). `ib400 x1000`: the ib400 link with latency x1000 and "
        "bandwidth /1000 (10 ms + 50 MB/s), because the CPU computes ~1000x slower than the GPUs such a link "
        "serves. Times: medians over steps of the slower rank. See the module docstring for each column.\n"
    )
    lines += table(results)
    lines += ["", "Goals (issue 7):", ""] + goals(results)
    lines.append(f"\nTotal benchmark time {time.perf_counter() - t_start:.0f} s.")
    text = "\n".join(lines) + "\n"
    publish_results(text, args.out if args.out is not None else (None if args.quick else RESULTS), "moe_step", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
