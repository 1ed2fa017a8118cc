"""The host CPU a ``DBORunner`` step costs around the kernel, by part (issue 46).

A trivial model (each ubatch yields once and returns one logit per token) runs steps of ``R``
one-token requests (64, 256, 1024) at N = 2 on the host backend, one process, no DP group. Per
step, process CPU time (``time.process_time_ns``):

- ``step``: ``DBORunner.step`` end to end, in a pass of its own (the parts below come from a second
  pass with a timer around each: the timers' own cost stays out of ``step``); ``fixed``: step -
  run_ubatches, the runner's own cost;
- ``plan``: the runner's plan (``_plan_any``: the offsets' check, thresholds, the cut, the
  attention metadata and its checks), of it ``split``: the per-ubatch metadata (``split_checked``,
  or where the split keeps templates, ``SplitTemplate.apply``);
- ``measure``: the runner's measurement (``step_timing`` or, at older commits, ``host_timing``,
  and ``_measured``: the timing, the record, the ledger);
- ``merge``: the merge of the ubatches' outputs (``merge_outputs``);
- ``run_ubatches``: a prepared run of the same two ubatches, the kernel beneath the step;
- ``rest``: step - plan - measure - merge - run_ubatches (padding, slicing, the step's own code).

Then, at the first size: ``tuning="auto"`` settled on N = 2 and on off (a clock that makes the
target the fastest), beside a fixed N = 2 runner and a plain off runner (``enabled=False``),
interleaved in blocks of 10 steps, each runner on the same clock class (``_ArmClock``: its own
cost is not the policy's); and the runner's measurement of a 61-layer step's 366 comm
works, the stats' records or stamps made in the timing as a run makes them, every step and, where
the side has ``measure_every``, sampled every 16th step.

``--base REV`` builds the package at ``REV`` in a temporary folder from its own sources (``git
archive``, ``setup.py build_ext --inplace``, as ``compare_commits.py`` does) and measures it the
same way in the same rounds: each round runs one worker process per side (order alternating), so
machine noise hits both alike. Reported: medians over rounds with min..max, the ratio of the
medians, and the load average at start and end. ``--json`` prints (and with ``--out`` writes) the
raw per-round numbers as JSON too.

    python benchmarks/step_host_cost.py --base HEAD --rounds 9 --json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SAMPLE_EVERY = 16  # measure_every of the sampled measurement
PARTS = ("step", "fixed", "plan", "split", "measure", "merge", "run_ubatches", "rest")


# ------------------------------------------------------------------------- worker (one side, one round)
def worker(sizes: list[int], steps: int) -> dict[str, Any]:
    """One round on the ``asyncdbo`` first on ``sys.path``: µs of CPU per step, per part and size;
    the ``"auto"`` runners beside the fixed ones at the first size; the measurement of a 61-layer
    step's comm records."""
    import asyncdbo

    async def main() -> dict[str, Any]:
        await _parts(sizes, 20)  # a first pass, discarded: one-time costs (torch's first calls) stay out
        out = await _parts(sizes, steps)
        out["auto"] = await _auto(sizes[0], steps)
        out["measure61"] = await _measure61(steps)
        return out

    return asyncdbo.run(main)


class _Trivial:
    max_ubatches = 8

    async def forward(self, ids_T: Any, pos_T: Any, attn: Any) -> Any:
        from asyncdbo import dbo_yield

        await dbo_yield()
        return ids_T.float().unsqueeze(1)


def _batch(R: int) -> Any:
    from asyncdbo.serving import BatchBuilder, KVCacheConfig

    cache = KVCacheConfig(num_layers=1, num_blocks=R + 8, block_size=16, num_heads=1, head_dim=8)
    return BatchBuilder(cache).build([(i, [i % 90 + 1]) for i in range(R)])


def _config(**kw: Any) -> Any:
    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving import RunnerConfig

    return RunnerConfig(num_ubatches=2, backend="host",
                        thresholds=ThresholdConfig(decode_threshold=1, prefill_threshold=1), **kw)


async def _parts(sizes: list[int], steps: int) -> dict[str, Any]:
    from asyncdbo import prepare_run
    from asyncdbo.plan import step as step_mod
    from asyncdbo.serving import DBORunner
    from asyncdbo.serving import runner as runner_mod

    out: dict[str, Any] = {}
    for R in sizes:
        batch = _batch(R)
        runner = DBORunner(_Trivial(), _config())
        spent = {"plan": 0, "split": 0, "measure": 0, "merge": 0}

        def timed(part: str, fn: Any) -> Any:
            def wrapped(*a: Any, **k: Any) -> Any:
                c0 = time.process_time_ns()
                try:
                    return fn(*a, **k)
                finally:
                    spent[part] += time.process_time_ns() - c0
            return wrapped

        for _ in range(20):
            res = await runner.step(batch)
        assert res.plan.microbatched, res.plan.record
        c0 = time.process_time_ns()  # the step as it is, then its parts (their timers cost time too)
        for _ in range(steps):
            await runner.step(batch)
        step_ns = time.process_time_ns() - c0
        runner._plan_any = timed("plan", runner._plan_any)  # type: ignore[method-assign]
        runner._measured = timed("measure", runner._measured)  # type: ignore[method-assign]
        timing_fn = "step_timing" if hasattr(runner_mod, "step_timing") else "host_timing"
        saved = [(runner_mod, timing_fn, "measure"), (runner_mod, "merge_outputs", "merge")]
        # the per-ubatch metadata: split_checked at earlier commits, the kept template's apply after
        split_mod = importlib.import_module("asyncdbo.plan.split") if importlib.util.find_spec(
            "asyncdbo.plan.split") else None
        saved.append((split_mod.SplitTemplate, "apply", "split") if split_mod is not None
                     else (step_mod, "split_checked", "split"))
        originals = [getattr(mod, name) for mod, name, _ in saved]
        for (mod, name, part), fn in zip(saved, originals):
            setattr(mod, name, timed(part, fn))
        try:
            for _ in range(20):
                await runner.step(batch)
            spent.update(plan=0, split=0, measure=0, merge=0)
            for _ in range(steps):
                await runner.step(batch)
        finally:
            for (mod, name, _), fn in zip(saved, originals):
                setattr(mod, name, fn)
            del runner._plan_any, runner._measured
        # the kernel beneath: a prepared run of the same ubatches
        plan = res.plan
        args = [(batch.input_ids_T[s.padded_token_slice], batch.positions_T[s.padded_token_slice], meta)
                for s, meta in zip(plan.slices, plan.attn_metadata)]
        model = _Trivial()
        runs = prepare_run(backend="host")
        for _ in range(20):
            await runs.run_ubatches(model.forward, args)
        c0 = time.process_time_ns()
        for _ in range(steps):
            await runs.run_ubatches(model.forward, args)
        run_ns = time.process_time_ns() - c0
        us = {"step": step_ns / steps / 1e3, "run_ubatches": run_ns / steps / 1e3}
        us.update({part: ns / steps / 1e3 for part, ns in spent.items()})
        us["rest"] = us["step"] - us["plan"] - us["measure"] - us["merge"] - us["run_ubatches"]
        us["fixed"] = us["step"] - us["run_ubatches"]
        out[str(R)] = us
    return out


class _ArmClock:
    """A runner clock under which ``target`` runs each step in 1 ms and every other configuration in
    1.5 ms: the ``"auto"`` policy settles on ``target`` and, its steps all alike, stays there (no
    drift to detect, no near-tie to probe). Reads the arm the runner planned (``_last``)."""

    def __init__(self, target: Any) -> None:
        self.target, self.t, self.calls = target, 0.0, 0
        self.runner: Any = None

    def now(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # a step's end (each step reads the clock at its start and its end)
            last = getattr(self.runner, "_last", None)
            self.t += 1e-3 if last is not None and last[1] == self.target else 1.5e-3
        return self.t

    def wait_s(self, deadline: float) -> float:
        return 0.0


async def _auto(R: int, steps: int) -> dict[str, float]:
    """µs of CPU per step at ``R`` requests: a fixed N = 2 runner, ``tuning="auto"`` settled on
    N = 2 token, a plain off runner (``enabled=False``) and ``tuning="auto"`` settled on off,
    interleaved in blocks of 10 steps, each on an ``_ArmClock``."""
    from asyncdbo.serving import DBORunner
    from asyncdbo.serving.auto import OFF, Arm

    batch = _batch(R)
    runners = {}
    for label, kw in (("fixed", {}), ("off", {"enabled": False})):
        # the same clock as the auto runners' below (its now() costs more than a plain clock's)
        clock = _ArmClock(Arm(2))
        runners[label] = clock.runner = DBORunner(_Trivial(), _config(**kw), clock=clock)
    for label, target in (("auto", Arm(2)), ("auto off", OFF)):
        clock = _ArmClock(target)
        runner = runners[label] = DBORunner(_Trivial(), _config(tuning="auto"), clock=clock)
        clock.runner = runner
        for i in range(2000):
            res = await runner.step(batch)
            if i > 50 and res.plan.record.evidence and ": exploring " not in res.plan.record.evidence \
                    and ": probing " not in res.plan.record.evidence:
                break
        rec = res.plan.record
        assert rec.config == target.label or (target == OFF and rec.config == "off"), (label, rec.config, rec.evidence)
    spent = dict.fromkeys(runners, 0)
    for block in range(max(1, steps // 10)):
        for label in (list(runners) if block % 2 == 0 else list(reversed(runners))):
            runner = runners[label]
            c0 = time.process_time_ns()
            for _ in range(10):
                res = await runner.step(batch)
            spent[label] += time.process_time_ns() - c0
            assert ": exploring " not in res.plan.record.evidence, (label, res.plan.record.evidence)
    n = max(1, steps // 10) * 10
    return {label: ns / n / 1e3 for label, ns in spent.items()}


async def _measure61(steps: int) -> dict[str, float]:
    """µs of CPU per step of the runner's whole measurement of a 61-layer step at N = 2 (366 comm
    works: per layer and ubatch a counts message, a dispatch and a combine, two thirds waited for
    in flight, at the times ``benchmarks/measure_cost.py`` gives them): the run's stats made from
    the works as the side's run leaves them (``asyncdbo.dbo.run._stats``: the records, or the
    stamps), ``host_timing`` and ``_measured`` (record, ledger) of a real runner; with
    ``RunnerConfig.measure_every`` where the side has it, the same per step over a run of steps
    (the sampled steps' fold spread over all; the stats are made every step)."""
    import importlib
    import inspect
    from types import SimpleNamespace

    from asyncdbo import dbo_submit, dbo_yield, run_ubatches
    from asyncdbo.lowlevel import get_ubatch
    from asyncdbo.backends import RunStreams, get_backend
    run_mod = importlib.import_module("asyncdbo.dbo.run")  # (asyncdbo.dbo's ``run`` is the function)
    from asyncdbo.serving import DBORunner
    from asyncdbo.serving import runner as runner_mod

    class _Future:  # never completed: the run's ubatches do not wait (each work is issued from compute)
        def add_done_callback(self, fn: Any) -> None:
            pass

    class _Work:
        def get_future(self) -> _Future:
            return _Future()

    held: list[Any] = []

    async def layers(ub: int) -> None:
        for _layer in range(61):
            for what in ("counts", "dispatch", "combine"):
                dbo_submit(_Work(), nbytes=4096, what=what)
            await dbo_yield()
        if ub == 1:
            ext = get_ubatch().run.ext
            held.append((ext.comm, getattr(ext, "stamps", None)))  # the list and the stamps the run filled

    await run_ubatches(layers, [(0,), (1,)], backend="host")
    works, stamps = held[0]
    t = 0.0
    for j, w in enumerate(works):  # the times measure_cost.py gives: issue every 0.1 ms, 0.3 ms in flight
        t += 1e-4
        k = j % 3
        if stamps is not None:
            stamps.t_issue[w.row], stamps.t_done[w.row] = t, t + 3e-4
            if k:
                stamps.t_wait[w.row] = t + 1e-4
        else:
            w.t_issue, w.t_done, w.t_wait = t, t + 3e-4, (t + 1e-4 if k else None)
    dbo_ns = SimpleNamespace(ubatches=(0, 1), num_switches=0, num_parks=0, time_asleep_s=1e-3)
    state_ns = SimpleNamespace(backend=get_backend("host"), comm=works, stamps=stamps, blocking=[])
    state_ns.comm_records = lambda: RunStreams.comm_records(state_ns)  # type: ignore[arg-type]

    batch = _batch(64)
    runner = DBORunner(_Trivial(), _config())
    plan = runner._plan_any(batch, None)[0]
    params = list(inspect.signature(runner._measured).parameters)
    takes_uniform = "uniform" in params
    first: Any = batch.num_tokens if params[0] == "num_tokens" else batch  # (its first argument at later commits)
    measure = getattr(runner_mod, "step_timing", None)

    def once(i: int) -> None:
        stats = run_mod._stats(dbo_ns, state_ns)  # type: ignore[arg-type]
        timing = (measure(stats, 2e-2, i, SAMPLE_EVERY) if measure is not None
                  else getattr(runner_mod, "host_timing")(stats, 2e-2))
        measured: Any = runner._measured
        if takes_uniform:
            measured(first, plan, timing, True)
        else:
            measured(first, plan, timing)

    for i in range(20):
        once(i)
    c0 = time.process_time_ns()
    for i in range(steps):
        once(0)  # step 0: a sampled step on every side
    out = {"every step": (time.process_time_ns() - c0) / steps / 1e3}
    if measure is not None:
        c0 = time.process_time_ns()
        for i in range(steps):
            once(i)
        out["sampled"] = (time.process_time_ns() - c0) / steps / 1e3
    return out


# ------------------------------------------------------------------------------------------ parent
def build_base(rev: str, into: Path) -> tuple[str, bool]:
    """The tree at ``rev`` in ``into``, its C extensions built from its own sources."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    made = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=into,
                          capture_output=True, check=False)
    return sha, made.returncode == 0


def run_side(root: Path, sizes: list[int], steps: int) -> dict[str, Any]:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]); "
            "import step_host_cost as s; "
            "print('RESULT', json.dumps(s.worker(json.loads(sys.argv[3]), int(sys.argv[4]))))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code, str(root), str(HERE), json.dumps(sizes), str(steps)],
                          cwd=str(root), capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"worker at {root} failed:\n{done.stderr[-3000:]}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}..{max(xs):.1f}]"


def _row(label: str, vals: dict[str, list[float]], names: list[str]) -> str:
    cells = " | ".join(spread(vals[n]) for n in names)
    ratio = ""
    if len(names) == 2:
        b, w = (statistics.median(vals[n]) for n in names)
        ratio = f" {w / b:.2f} |" if b > 0 else " - |"
    return f"| {label} | {cells} |{ratio}\n"


def _head(first: str, sides: dict[str, Any], unit: str) -> list[str]:
    names = list(sides)
    head = f"| {first} | " + " | ".join(f"{n} {unit}, median [min..max]" for n in names)
    head += " | new / base |" if len(names) == 2 else " |"
    return [head + "\n", "|---|" + "---:|" * (len(names) + (len(names) == 2)) + "\n"]


def table(sides: dict[str, list[dict[str, Any]]], sizes: list[int]) -> list[str]:
    names = list(sides)
    lines = _head("R: part", sides, "µs/step")
    for R in sizes:
        for part in PARTS:
            vals = {n: [r[str(R)][part] for r in rounds] for n, rounds in sides.items()}
            lines.append(_row(f"{R}: {part}", vals, names))
        steps = {n: [r[str(R)]["step"] / r[str(R)]["run_ubatches"] for r in rounds] for n, rounds in sides.items()}
        lines.append(f"| {R}: step / run_ubatches | " + " | ".join(spread(steps[n]) for n in names)
                     + (" |  |" if len(names) == 2 else " |") + "\n")
    return lines


def auto_table(sides: dict[str, list[dict[str, Any]]]) -> list[str]:
    names = list(sides)
    lines = _head("runner", sides, "µs/step")
    for label in ("fixed", "auto", "off", "auto off"):
        lines.append(_row(label, {n: [r["auto"][label] for r in rounds] for n, rounds in sides.items()}, names))
    for label, a, b in (("auto / fixed", "auto", "fixed"), ("auto off / off", "auto off", "off")):
        vals = {n: [r["auto"][a] / r["auto"][b] for r in rounds] for n, rounds in sides.items()}
        lines.append(f"| {label} | " + " | ".join(f"{statistics.median(vals[n]):.3f} [{min(vals[n]):.3f}.."
                                                  f"{max(vals[n]):.3f}]" for n in names)
                     + (" |  |" if len(names) == 2 else " |") + "\n")
    return lines


def measure_table(sides: dict[str, list[dict[str, Any]]]) -> list[str]:
    names = list(sides)
    lines = _head("measurement", sides, "µs/step")
    for label in ("every step", "sampled"):
        vals = {n: [r["measure61"][label] for r in rounds if label in r["measure61"]] for n, rounds in sides.items()}
        cells = " | ".join(spread(vals[n]) if vals[n] else "-" for n in names)
        ratio = ""
        if len(names) == 2:
            ratio = (f" {statistics.median(vals[names[1]]) / statistics.median(vals[names[0]]):.2f} |"
                     if all(vals[n] for n in names) else " - |")
        lines.append(f"| {label} | {cells} |{ratio}\n")
    return lines

def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from _results import publish_results, results_preamble, results_stem

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=None, help="a revision to measure beside the working tree")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300, help="steps per size per round (default 300)")
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--json", action="store_true", help="print (and with --out write) the raw rounds as JSON")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    lines, info = results_preamble("Host cost of a DBORunner step, by part (measured)",
                                   "python benchmarks/step_host_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    roots: dict[str, Path] = {"working tree": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.base is not None:
            sha, built = build_base(args.base, Path(tmp))
            roots = {f"base {sha}" + ("" if built else " (pure Python)"): Path(tmp), "working tree": ROOT}
        sides: dict[str, list[dict[str, Any]]] = {n: [] for n in roots}
        t0 = time.perf_counter()
        for r in range(args.rounds):
            order = list(roots) if r % 2 == 0 else list(reversed(roots))
            for name in order:
                sides[name].append(run_side(roots[name], sizes, args.steps))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines.append(f"\nTrivial model (one yield per ubatch), R one-token requests, N = 2, host backend, one process; "
                 f"{args.steps} steps per size per round, {args.rounds} rounds, one worker process per side per "
                 f"round (order alternating). Process CPU µs per step; medians over rounds [min..max].\n\n")
    lines += table(sides, sizes)
    lines.append(f"\n`fixed` is the runner's own cost, step - run_ubatches; `split` (the per-ubatch attention metadata) "
                 f"is part of `plan`; `rest` is step - plan - measure - merge - run_ubatches.\n\n"
                 f"`tuning=\"auto\"` at R = {sizes[0]}, settled (a clock under which its target runs each step in 1 ms "
                 f"and any other configuration in 1.5 ms, so it settles and stays), interleaved in blocks of 10 steps "
                 f"with a fixed N = 2 runner and a plain off runner (`enabled=False`), all four on the same clock class:\n\n")
    lines += auto_table(sides)
    lines.append("\nThe runner's measurement of a 61-layer step at N = 2 (366 comm works, their records or stamps made in the timing as the run's stats make them, "
                 "at `benchmarks/measure_cost.py`'s times): the run's stats (`_stats`), `host_timing` and `_measured` per step (`every step`), "
                 "and, where the side samples (`RunnerConfig.measure_every`, default), per step over a run of steps "
                 "(`sampled`):\n\n")
    lines += measure_table(sides)
    lines.append(f"\nWall time {time.perf_counter() - t0:.0f} s; load average at the end {load}.\n")
    text = "".join(lines)
    stem = results_stem(args.out, "step_host_cost", info) if args.out is not None else None
    publish_results(text, args.out, "step_host_cost", info)
    if args.json:
        raw = json.dumps({"info": info, "sides": sides, "sizes": sizes, "steps": args.steps}, indent=1)
        print(raw)
        if stem is not None:
            stem.with_suffix(".json").write_text(raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
