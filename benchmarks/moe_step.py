"""One DP+EP MoE step on 2 gloo ranks: serial vs asyncdbo DBO vs a vLLM-style thread DBO.

All designs run the same model code (``asyncdbo.models.MiniModel``, whose MoE layers yield through
the ``dbo_*`` primitives) on the same planned ubatches, back to back in every step:

* ``serial``: the whole batch as one ubatch under the same backend (so its comm crosses the same
  modeled link), as the runner's fall-back path does;
* ``asyncdbo ht`` / ``asyncdbo ll``: the ubatches under :func:`asyncdbo.run_ubatches`, the MoE
  layers on the ``ht`` or the ``ll`` schedule (same weights);
* ``threads ...``: the ubatches (``ht`` schedule) driven the way vLLM's ``UBatchWrapper`` drives
  them. Every ubatch gets its own OS thread, started each step; a thread runs only while its
  ``threading.Event`` baton is set; the main thread starts them all and hands the baton to
  ubatch 0; at each ``dbo_*`` yield a thread passes the baton to the next ready thread and waits
  for its own (vLLM's ``_cpu_yield``); a finishing thread runs its pending recv hook and passes
  the baton on (vLLM's ``__exit__``). Each ubatch coroutine is stepped with ``coro.send`` inside
  its ubatch context, so the primitives, streams and events are exactly asyncdbo's. Three
  waiting policies, because on this backend every comm wait is a CPU wait:

  - ``threads vLLM``: a thread that needs comm blocks while it holds the baton (the strict port:
    what a vLLM ubatch thread does in a CPU-blocking wait);
  - ``threads GPU-like``: only the counts exchange blocks holding the baton (on a GPU only the
    counts are read on the CPU; the dispatch and combine waits are stream waits), the other
    waits hand the baton on and queue up for it again once the comm completed;
  - ``threads handoff``: every wait hands the baton on (asyncdbo's policy, with threads).

  So ``threads handoff / asyncdbo ht`` is what coroutines buy on the same schedule and policy,
  and ``threads vLLM / threads handoff`` what the waiting policy buys.

Numbers per step and rank (medians over steps, then the max over ranks: a DP step ends when the
slowest rank ends):

* step time: the driver call, planning excluded (identical for all designs);
* compute: union of the CPU steps of all ubatches (on the host backend the CPU is the compute
  stream); comm: union of the comm works from issue to release; hidden share: comm time during
  which some ubatch computed;
* overhead: step time outside both compute and comm (scheduler work, handoffs, wake-ups);
* msgs: comm messages per step and rank;
* the schedule bound: ``max(compute, comm, longest per-ubatch chain)`` from the run's own spans,
  where each message is priced at the link model's ``latency + bytes / bandwidth`` from its issue
  (its queueing behind other messages is the schedule's doing, not a floor), comm is the union of
  those intervals or the link's busy time (all bytes / bandwidth) if longer, and a ubatch's chain
  is the union of its own CPU steps and its own messages, and, since the CPU is one, the ubatch
  that takes its first step last starts its chain only after every other ubatch's first step
  (the chain term is the larger of the longest chain and the least over ubatches of its chain plus
  the others' first steps): no schedule of these ubatches sending these messages can end before
  any of the three. On loopback the messages are priced as they ran. ``step / bound`` is
  the median over steps of each step's ratio (slower rank);
* the replay (``_replay.py``, asyncdbo designs and serial): the run's own CPU steps, with their
  measured durations, on an overhead-free runtime with the kernel's policy (one CPU, a FIFO ready
  queue, steps not preempted; a ubatch that switches goes to the back at once, one that parks
  joins when what it waited for completes), each message issued at its offset inside its step
  and carried by the host backend's link model (one shared link, in issue order). What each park
  waited for is read off the run (``_schedule_trace.py``: the comm work, the works a stream wait
  covered, or the step that set a recv hook's signal). The replay is not a lower bound
  (round-robin is one policy, not the best order, and the steps keep the run's boundaries); it is
  what this schedule reaches with a perfect runtime. So ``step / replay`` is what the runtime
  costs (goal <= 1.05), ``replay / bound`` what the schedule loses to the one CPU (a ubatch whose
  message arrived waits for the step in progress, which no term of the bound counts), and the gap
  ``step - bound`` splits into CPU contention (``replay - bound``) and runtime (``step - replay``),
  each a median over steps (slower rank). "What binds" in the goals table names the larger part
  (and the bound's largest term). A replay longer than its step would mean a wrong dependency,
  and one shorter than the bound a wrong model; the report counts both over every step and rank.
  Beside the runtime part, in brackets: the time during which some message had been released by
  the link model but not yet completed by gloo (the real transfer, on this host's own CPUs), which
  the replay does not model and no runtime could remove.
  The recorder's own cost (a log entry per stream wait, a waiter per message) is inside the step time;
* peak memory: the process's peak RSS during the step minus its RSS before it (``VmHWM`` after
  resetting it through ``/proc/self/clear_refs``), with glibc's mmap threshold fixed so that
  large tensors go back to the OS when freed.

    python benchmarks/moe_step.py            # full run, writes benchmarks/results/moe_step_<hw>_<date>.md
    python benchmarks/moe_step.py --quick    # a few seconds, prints only
"""

# Legend: T tokens on this rank, V vocab.

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _replay import replay
from _schedule_trace import ScheduleRecorder
from _thread_baton import run_threads

RESULTS = Path(__file__).resolve().parent / "results"


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
    ubatches: int = 2
    designs: tuple[str, ...] = ("serial", "asyncdbo ht")


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


def _numbers(wall: float, spans: list[tuple[int, float, float]], run: Any, link: Any,
             rec: ScheduleRecorder | None = None) -> dict[str, float]:
    """Step numbers, the schedule bound and (given the run's recorder) the replay of one run, from
    its own spans (see the module doc). No replay (NaN) for the thread designs."""
    from asyncdbo.observe import hidden_seconds, union_seconds

    records = run.ext.comm_records()
    comm = [(w.t_issue, w.t_end or w.t_issue) for w in records]
    cpu = [(a, b) for _, a, b in spans]
    # The bound prices each message at the link model's own cost (latency + bytes / bandwidth),
    # without the queueing behind other messages that the schedule caused; on loopback, as run.
    if link is not None:
        ideal = [(w.ub, w.t_issue, w.t_issue + link.transfer_s(w.nbytes)) for w in records]
        link_busy = sum(w.nbytes for w in records) / link.bandwidth_Bps
    else:
        ideal = [(w.ub, a, b) for w, (a, b) in zip(records, comm)]
        link_busy = 0.0
    comm_s = union_seconds(comm)
    compute_s = union_seconds(cpu)
    busy_s = union_seconds([*cpu, *comm])
    comm_bound = max(union_seconds([(a, b) for _, a, b in ideal]), link_busy)
    ubs = sorted({u for u, _, _ in spans})
    chains = {u: union_seconds([(a, b) for u2, a, b in [*spans, *ideal] if u2 == u]) for u in ubs}
    # One CPU: the ubatch that takes its first step last starts its chain after every other
    # ubatch's first step (attention and routing, before any message), whichever it is.
    first = {u: next(b - a for u2, a, b in spans if u2 == u) for u in ubs}
    fill_s = min(chains[u] + sum(first[v] for v in ubs if v != u) for u in ubs)
    chain_s = max(max(chains.values()), fill_s)
    replay_s = float("nan") if rec is None else replay(*rec.trace(), link)
    # On a modeled link a message completes at the later of the model's release and gloo's own
    # completion; the replay knows only the model. Time during which some message was released
    # by the model but not yet delivered by gloo (the real transfer on this host's CPUs) is part
    # of step - replay that no runtime could remove.
    late = [(w.t_release, w.t_done) for w in records
            if w.t_release is not None and w.t_done is not None and w.t_done > w.t_release]
    return {
        "step_s": wall,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "hidden_share": hidden_seconds(comm, cpu) / comm_s if comm_s else 0.0,
        "overhead_s": max(0.0, wall - busy_s),
        "comm_bound_s": comm_bound,
        "chain_s": chain_s,
        "bound_s": max(compute_s, comm_bound, chain_s),
        "replay_s": replay_s,
        "late_s": union_seconds(late),
        "messages": float(len(records)),
    }


def _set_schedule(model: Any, schedule: str) -> None:
    """Switch every MoE layer of ``model`` to ``schedule`` (same weights, same numbers)."""
    import dataclasses

    for layer in model.layers:
        moe = layer["moe"]
        moe.cfg = dataclasses.replace(moe.cfg, schedule=schedule)


def _design(name: str) -> tuple[str, str, str]:
    """(driver, schedule, wait policy or dispatch mode) of a design name."""
    if name == "serial":
        return "serial", "ht", ""
    driver, schedule, *rest = name.split()
    if driver == "threads":
        return "threads", "ht", {"vLLM": "hold", "GPU-like": "counts", "handoff": "handoff"}[schedule]
    return "asyncdbo", schedule, rest[0] if rest else ""


def step_batch(builder: Any, dcfg: Any, rank: int, i: int, vocab_size: int) -> Any:
    """Step ``i``'s batch on ``rank`` (``dcfg.shape``): a fresh prefill, or one decode token per
    request over the context the builder holds."""
    from asyncdbo.cli.demo import decode_chunks, prefill_chunks

    if dcfg.shape == "prefill":
        builder.reset()
        return builder.build(prefill_chunks(dcfg, rank, i, vocab_size))
    return builder.build(decode_chunks(dcfg, rank, i, vocab_size, 1))


async def _rank_async(rank: int, world: int, case: Case, steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    import asyncdbo
    from asyncdbo.backends.host import HostBackend
    from asyncdbo.cli.demo import DemoConfig, decode_chunks
    from asyncdbo.dist import choose_dispatch, dispatch_options
    from asyncdbo.models import MiniModel
    from asyncdbo.plan import merge_outputs, plan_step
    from asyncdbo.serving import BatchBuilder

    dcfg = DemoConfig(ranks=world, tokens=case.tokens, layers=case.layers, shape=case.shape, context=case.context,
                      steps=steps, warmup=warmup, link=case.link, link_scale=case.link_scale)
    mcfg = dcfg.model_config()
    group = dist.group.WORLD
    model = MiniModel(mcfg, ep_group=group, max_ubatches=8, device=torch.device("cpu"))
    builder = BatchBuilder(mcfg.kv_cache_config)
    link = dcfg.link_spec()
    peak_ok = _reset_peak()

    def backend() -> Any:
        return HostBackend(link=link)

    if case.shape == "decode":
        ctx_batch = builder.build(decode_chunks(dcfg, rank, -1, mcfg.vocab_size, case.context))
        await asyncdbo.run_ubatches(model.forward, [(ctx_batch.input_ids_T, ctx_batch.positions_T, ctx_batch.attn)], backend=backend())
    out: dict[str, Any] = {d: [] for d in case.designs}
    out["max_abs_diff"] = 0.0
    out["peak_ok"] = peak_ok
    for i in range(warmup + steps):
        batch = step_batch(builder, dcfg, rank, i, mcfg.vocab_size)
        plan = plan_step(batch.attn.query_start_loc_cpu, num_ubatches=case.ubatches, attn_metadata=batch.attn, dp_group=group)
        if not plan.record.microbatched:
            raise SystemExit(f"case {case.name}: the step did not microbatch ({plan.record.reason}: {plan.record.detail})")
        assert plan.num_tokens_padded == batch.num_tokens, "benchmark batches are equal on every rank: no padding"
        args = [(batch.input_ids_T[s.padded_token_slice], batch.positions_T[s.padded_token_slice], m)
                for s, m in zip(plan.slices, plan.attn_metadata)]
        ubatch_tokens = max(s.num_tokens_padded for s in plan.slices)
        out["choice"] = {sched: choose_dispatch(link, max_tokens=ubatch_tokens, top_k=mcfg.top_k,
                                                experts_per_rank=mcfg.num_experts // world, ranks=world,
                                                hidden=mcfg.hidden_size, itemsize=4, schedule=sched,
                                                ubatches=case.ubatches)
                         for sched in ("ht", "ll")}
        logits: dict[str, torch.Tensor] = {}
        for design in case.designs:
            driver, schedule, wait = _design(design)
            _set_schedule(model, schedule)
            dist.barrier()
            rss0, _ = _rss()
            _reset_peak()
            rec: ScheduleRecorder | None = None  # the asyncdbo runs' schedule, for the replay
            if driver == "threads":
                t0 = time.perf_counter()
                outs, run, spans = run_threads(model.forward, args, backend(), wait=wait)
                wall = time.perf_counter() - t0
                logits[design] = merge_outputs(outs, plan.slices, batch.num_tokens)
            else:
                rec = recorder = ScheduleRecorder()
                whole = [(batch.input_ids_T, batch.positions_T, batch.attn)]
                # "fused": every rank's ubatches have these many tokens (equal batches, same split)
                options = dispatch_options(ubatch_tokens, "fused") if wait == "fused" else contextlib.nullcontext()
                t0 = time.perf_counter()
                with torch.inference_mode(), options:
                    outs = await asyncdbo.run_ubatches(
                        model.forward, whole if driver == "serial" else args, backend=recorder.backend(link=link),
                        instrument=recorder.instrument,
                    )
                wall = time.perf_counter() - t0
                run, spans = recorder.run, recorder.spans
                logits[design] = outs[0] if driver == "serial" else merge_outputs(outs, plan.slices, batch.num_tokens)
            _, peak = _rss()
            if i >= warmup:
                row = _numbers(wall, spans, run, link, rec)
                row["peak_bytes"] = float(peak - rss0)
                out[design].append(row)
        for design in case.designs:
            diff = float((logits[design] - logits["serial"]).abs().max())
            out["max_abs_diff"] = max(out["max_abs_diff"], diff)
    return out


def bench_rank(rank: int, world: int, case: Case, steps: int, warmup: int) -> dict[str, Any]:
    import asyncdbo

    return asyncdbo.run(_rank_async, rank, world, case, steps, warmup)


# ------------------------------------------------------------------ report
KEYS = ("step_s", "compute_s", "comm_s", "hidden_share", "overhead_s", "peak_bytes", "comm_bound_s", "chain_s", "bound_s",
        "replay_s", "late_s", "messages")
#: Per-step ratios and differences, each a median over steps per rank, then the slowest rank.
PER_STEP = {
    "step_per_bound": lambda x: x["step_s"] / x["bound_s"],
    "step_per_replay": lambda x: x["step_s"] / x["replay_s"],
    "replay_per_bound": lambda x: x["replay_s"] / x["bound_s"],
    "contention_s": lambda x: x["replay_s"] - x["bound_s"],
    "runtime_s": lambda x: x["step_s"] - x["replay_s"],
}


def _med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def summarize(case: Case, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per design: medians over steps per rank, then the slowest rank (max)."""
    s: dict[str, Any] = {"diff": max(r["max_abs_diff"] for r in per_rank), "choice": per_rank[0]["choice"]}
    for d in case.designs:
        s[d] = {k: max(_med(r[d], k) for r in per_rank) for k in KEYS}
        s[d]["min_step_s"] = max(min(x["step_s"] for x in r[d]) for r in per_rank)
        s[d]["max_step_s"] = max(max(x["step_s"] for x in r[d]) for r in per_rank)
        # ratios per step and rank, then as the step times: median per rank, slowest rank
        for key, f in PER_STEP.items():
            s[d][key] = max(statistics.median(f(x) for x in r[d]) for r in per_rank)
        # the replay's invariants, over every step and rank (NaN, no replay, counts as neither)
        s[d]["replay_over_step"] = sum(x["replay_s"] > x["step_s"] for r in per_rank for x in r[d])
        s[d]["bound_over_replay"] = sum(x["bound_s"] > x["replay_s"] * (1 + 1e-9) for r in per_rank for x in r[d])
        s[d]["samples"] = sum(len(r[d]) for r in per_rank)
    # Paired ratios: design / reference of the same step (the designs of one step run back to back,
    # so a burst of load on the shared machine hits both), the step time being the slower rank's;
    # then the median over steps. Steadier than a ratio of medians when the machine is shared.
    steps = len(per_rank[0][case.designs[0]])
    step_time = {d: [max(r[d][i]["step_s"] for r in per_rank) for i in range(steps)] for d in case.designs}
    s["paired"] = {(d, ref): statistics.median(a / b for a, b in zip(step_time[d], step_time[ref]))
                   for d in case.designs for ref in case.designs}
    return s


def table(results: list[tuple[Case, dict[str, Any]]]) -> list[str]:
    rows = [
        "| case | N | design | step ms [min..max] | speedup vs serial (paired) | speedup vs threads vLLM (paired) | compute ms | comm ms | comm hidden | "
        "overhead ms | msgs | bound ms (compute / comm / chain) | replay ms | step / bound | peak MiB |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for case, s in results:
        for d in case.designs:
            x = s[d]
            vs_threads = f"{1 / s['paired'][(d, 'threads vLLM')]:.2f}x" if "threads vLLM" in s else "-"
            rows.append(
                f"| {case.name} | {case.ubatches if d != 'serial' else 1} | {d} | {x['step_s'] * 1e3:.1f} "
                f"[{x['min_step_s'] * 1e3:.1f}..{x['max_step_s'] * 1e3:.1f}] | "
                f"{1 / s['paired'][(d, 'serial')]:.2f}x | {vs_threads} | "
                f"{x['compute_s'] * 1e3:.1f} | {x['comm_s'] * 1e3:.1f} | {x['hidden_share']:.0%} | "
                f"{x['overhead_s'] * 1e3:.2f} | {x['messages']:.0f} | {x['bound_s'] * 1e3:.1f} ({x['compute_s'] * 1e3:.1f} / "
                f"{x['comm_bound_s'] * 1e3:.1f} / {x['chain_s'] * 1e3:.1f}) | {_ms(x['replay_s'])} | {x['step_per_bound']:.2f} | "
                f"{x['peak_bytes'] / 2**20:.1f} |"
            )
    return rows


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def goals(results: list[tuple[Case, dict[str, Any]]]) -> list[str]:
    rows = [
        "| case | N | design | step / bound (goal <= 1.05) | step / replay: the runtime (goal <= 1.05) | "
        "replay / bound: the one CPU | gap ms: CPU contention / runtime (gloo past the link model) | what binds | "
        "max abs diff vs serial (case) |",
        "|---|---:|---|---:|---:|---:|---|---|---:|",
    ]
    for case, s in results:
        for d in case.designs:
            if not d.startswith("asyncdbo"):
                continue
            x = s[d]
            r, rt = x["step_per_bound"], x["step_per_replay"]
            term = max((("compute", x["compute_s"]), ("comm", x["comm_bound_s"]), ("one ubatch's chain", x["chain_s"])),
                       key=lambda kv: kv[1])[0]
            if r <= 1.05:
                binds = f"the bound ({term})"
            elif x["contention_s"] >= x["runtime_s"]:
                binds = f"the schedule on one CPU (bound: {term}; steps wait for a step in progress)"
            else:
                binds = f"the runtime (bound: {term})"
            rows.append(
                f"| {case.name} | {case.ubatches} | {d} | {r:.2f} ({'met' if r <= 1.05 else 'missed'}) | "
                f"{rt:.2f} ({'met' if rt <= 1.05 else 'missed'}) | {x['replay_per_bound']:.2f} | "
                f"{x['contention_s'] * 1e3:.2f} / {x['runtime_s'] * 1e3:.2f} ({x['late_s'] * 1e3:.2f}) | {binds} | "
                f"{s['diff']:.1e} |"
            )
    return rows


def replay_checks(results: list[tuple[Case, dict[str, Any]]]) -> str:
    """The replay's invariants over every measured step and rank: it runs the run's own steps
    with no overhead, so it must not take longer than the step (else a dependency is wrong), and
    it runs them one at a time on a shared link, so it must not end before the bound."""
    n = over = under = 0
    for case, s in results:
        for d in case.designs:
            if not math.isnan(s[d]["replay_s"]):
                n += s[d]["samples"]
                over += s[d]["replay_over_step"]
                under += s[d]["bound_over_replay"]
    return f"Replay checks over {n} steps x ranks: replay longer than the step in {over}, bound above the replay in {under}."


def fused_table(results: list[tuple[Case, dict[str, Any]]]) -> list[str]:
    """Split vs fused dispatch per case and schedule, beside the link model's choice."""
    rows = [
        "| case | N | schedule | split ms | fused ms | speedup of fused over split (paired) | msgs split / fused | link model: saved by fusing / "
        "padding cost (us, scaled link) | choice | right? |",
        "|---|---:|---|---:|---:|---:|---|---|---|---|",
    ]
    for case, s in results:
        for sched in ("ht", "ll"):
            c = s["choice"][sched]
            split, fused = s.get(f"asyncdbo {sched}"), s.get(f"asyncdbo {sched} fused")
            if split is None or fused is None:
                continue
            ratio = s["paired"][(f"asyncdbo {sched} fused", f"asyncdbo {sched}")]
            right = "yes" if (ratio < 1.0) == c.fused else "no"
            rows.append(
                f"| {case.name} | {case.ubatches} | {sched} | {split['step_s'] * 1e3:.1f} | {fused['step_s'] * 1e3:.1f} | "
                f"{1 / ratio:.2f}x | {split['messages']:.0f} / {fused['messages']:.0f} | {c.saved_s * 1e6:,.0f} / "
                f"{c.padding_s * 1e6:,.0f} | {'fused' if c.fused else 'split'} | {right} |"
            )
    return rows


THREADS = ("threads vLLM", "threads GPU-like", "threads handoff")
LOOPBACK = ("serial", "asyncdbo ht", "asyncdbo ll", *THREADS)
FUSED = ("asyncdbo ht fused", "asyncdbo ll fused")
ALL = ("serial", "asyncdbo ht", "asyncdbo ll", *FUSED, *THREADS)
NSWEEP = ("serial", "asyncdbo ht", "asyncdbo ll", *FUSED)
FULL_CASES = [
    Case(name="decode 64 tok/rank, 2 layers, loopback", shape="decode", tokens=64, layers=2, link=None, designs=LOOPBACK),
    Case(name="decode 64 tok/rank, 2 layers, ib400 x1000", shape="decode", tokens=64, layers=2, link="ib400", designs=ALL),
    Case(name="decode 64 tok/rank, 8 layers, ib400 x1000", shape="decode", tokens=64, layers=8, link="ib400", designs=ALL),
    Case(name="prefill 1024 tok/rank, 2 layers, loopback", shape="prefill", tokens=1024, layers=2, link=None,
         designs=LOOPBACK),
    Case(name="prefill 1024 tok/rank, 2 layers, ib400 x1000", shape="prefill", tokens=1024, layers=2, link="ib400",
         designs=ALL),
    *(Case(name="decode 64 tok/rank, 2 layers, ib400 x1000", shape="decode", tokens=64, layers=2, link="ib400",
           ubatches=n, designs=NSWEEP) for n in (4, 8)),
    *(Case(name="prefill 1024 tok/rank, 2 layers, ib400 x1000", shape="prefill", tokens=1024, layers=2, link="ib400",
           ubatches=n, designs=NSWEEP) for n in (4, 8)),
]
QUICK_CASES = [
    Case(name="decode 32 tok/rank, 1 layer, ib400 x1000", shape="decode", tokens=32, layers=1, link="ib400", context=16,
         designs=ALL),
]


def main(argv: list[str] | None = None, *, pool: Any = None) -> int:
    """``pool``: a live 2-rank :class:`asyncdbo.testing.RankPool` to run on, left open (the smoke
    test hands it the suite's shared ranks); default: start one and close it after."""
    import _progress

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one tiny case, 2 steps, print only (smoke test)")
    parser.add_argument("--steps", type=int, default=7, help="measured steps per case (default 7)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results, not with --quick)")
    _progress.add_quiet_flag(parser)
    args = parser.parse_args(argv)
    if pool is None:  # the ranks it starts: large tensors through mmap, returned to the OS when freed
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # (RSS then follows live memory)
    from _results import publish_results, results_preamble

    from asyncdbo.testing import RankPool

    cases = QUICK_CASES if args.quick else FULL_CASES
    steps, warmup = (2, 1) if args.quick else (args.steps, 2)
    results = []
    t_start = time.perf_counter()
    _progress.start(args.quiet, "cases on 2 ranks", len(cases))
    with RankPool(2, timeout_s=600) if pool is None else contextlib.nullcontext(pool) as pool:
        for case in cases:
            _progress.step(case.name)
            per_rank = pool.run(bench_rank, case, steps, warmup)
            results.append((case, summarize(case, per_rank)))
    _progress.done()
    lines, info = results_preamble(
        "MoE step: serial vs asyncdbo DBO vs vLLM-style thread DBO (three waiting policies), 2 gloo ranks",
        f"python benchmarks/moe_step.py{' --quick' if args.quick else ''}",
    )
    lines[-1] = lines[-1].rstrip("\n") + f" ({steps} measured steps after {warmup} warm-up, designs interleaved in every step)\n"
    lines.append(
        "Model: asyncdbo.models.MiniModel (hidden 256, 8 experts, top-2, 1 shared expert), "
        "EP over both ranks, N ubatches (token split); the thread designs run the `ht` schedule. `ib400 x1000`: the ib400 link with latency x1000 and "
        "bandwidth /1000 (10 ms + 50 MB/s), because the CPU computes ~1000x slower than the GPUs such a link "
        "serves. Times: medians over steps of the slower rank; ratios marked paired: the median over steps of "
        "the two designs' times in the same step (slower rank). See the module docstring for each column.\n"
    )
    lines += table(results)
    lines += ["", "The schedule bound and the replay (issue 17): step / max(compute, comm, longest per-ubatch chain) of each "
              "run's own spans, and the replay of the run's own steps on an overhead-free runtime with the same policy "
              "(step / replay: what the runtime costs; replay / bound: what the schedule loses to the one CPU; the gap "
              "step - bound split into the two; see the module docstring):", ""] + goals(results)
    lines += ["", replay_checks(results)]
    lines += ["", "One message per dispatch (issue 17): the asyncdbo designs with the counts in the token message "
              "(`dispatch_options(ubatch tokens, 'fused')`) against the split dispatch, and what `mode='auto'` "
              "would choose from the link model (`asyncdbo.dist.choose_dispatch`):", ""] + fused_table(results)
    lines.append(f"\nTotal benchmark time {time.perf_counter() - t_start:.0f} s.")
    text = "\n".join(lines) + "\n"
    publish_results(text, args.out if args.out is not None else (None if args.quick else RESULTS), "moe_step", info)
    unequal = [case.name for case, s in results if s["diff"] != 0.0]
    if unequal:  # deterministic mode (the CPU default): every design must give the serial logits
        print(f"moe_step: logits differ from serial in {unequal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
