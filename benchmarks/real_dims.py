"""Real widths: Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3 at their released hidden size, heads,
KV heads (MLA ranks), experts, top-k, shared experts, intermediate sizes and vocabulary, cut to a
few layers, on 2 gloo ranks (DP + EP): prefill and decode, serial and DBO, over real loopback
comm and over a modeled link.

For each architecture, in this order, before the next one starts:

1. its config (``asyncdbo.models.hf.real_dims.real_config``: ``--layers`` layers; DeepSeek-V3's
   256 routed experts cut to ``--deepseek-experts``, groups and top-8 kept) and a memory estimate
   per rank (``asyncdbo.models.hf.memory.estimate_memory``).  Every architecture's estimate is
   checked against the memory available (``MemAvailable``, or ``--memory-limit``) before anything
   is written or any rank starts: a run that would not fit is refused with its estimate (exit 2);
2. a random checkpoint written to a temporary directory (sharded safetensors in the Hub layout,
   ``write_random_checkpoint``; deleted afterwards unless ``--keep``);
3. 2 ranks load it through ``asyncdbo.models.hf.checkpoint.load_checkpoint`` (each reads its own
   experts), then, for each link (none: gloo over loopback; then ``--link`` scaled by
   ``--link-scale``, the demo's modeled link) and shape, ``--warmup`` untimed and ``--steps``
   timed steps, each run serially and then with DBO (2 ubatches, token split, thresholds 1 so
   that every step microbatches) on the same batch:

   * prefill: ``--prefill-tokens`` new tokens per rank in 2 requests (fresh KV cache each step);
   * decode: ``--decode-requests`` requests per rank, one new token each, after one untimed step
     that fills ``--context`` tokens of context for each.

The model runs its fast path (``--exact off``: ``HFMoEModel(deterministic=False)``; the default,
``--exact default``, makes the MoE layers batch-invariant on a CPU, which pads every expert GEMM
to tiles of 64 rows: a serial Mixtral prefill step took over 2 minutes that way on the shared
2-core machine) and the LM head on each request's last token only (``--logits last``, what a
sampler reads; ``--logits all`` for every token).

Per rank and timed step: the step's wall time; the main thread's CPU time (``time.thread_time``;
torch runs one intra-op thread per rank, so that is the rank's compute and Python); the time
inside torch ops (``torch.profiler``, CPU activity: the union of the op intervals on the main
thread, comm calls ``c10d``/``gloo`` apart); the time every ubatch was parked (the tracer's
``idle_s``: waiting for comm); the host time, what is left of the wall time outside torch ops,
comm calls and idle waits (Python: the model's code, the runner, the scheduler; and the time this
thread waited for a core on a shared machine); and the tracer's comm hidden share (comm time
during which some ubatch computed) and the part hidden by another ubatch.  Memory per rank: peak
RSS while loading and while stepping (``VmHWM``, reset after loading through
``/proc/self/clear_refs``), the parameter bytes the model holds, and the estimate.

The results file is written when an architecture starts, after each case (link x shape: its
serial and DBO steps) and when it ends, so a run that is stopped keeps what it measured and says
how far it got; ``--results FILE.md`` adds the architectures run to that file (the ones it holds
already are kept, one run again is replaced), so they can run one at a time.  Its state is kept
beside it as ``FILE.json`` (every rank's rows), from which the ``.md`` is rendered.

    python benchmarks/real_dims.py                       # all three, writes benchmarks/results/real_dims_<hw>_<date>.md
    python benchmarks/real_dims.py --model mixtral --results benchmarks/results/real_dims_cpu-2c_<date>.md
    python benchmarks/real_dims.py --model deepseek-v3 --results benchmarks/results/real_dims_cpu-2c_<date>.md
    python benchmarks/real_dims.py --quick               # tiny widths of the same structure, prints only
"""

# Legend: T tokens, V vocab.

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Other libraries' noise out of this script's output, in the ranks too (they inherit the
# environment): torch.profiler's kineto "USDT: profiler_start/stop" lines (6: none below an
# error) and transformers' / huggingface_hub's progress bars.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("qwen3-moe", "mixtral", "deepseek-v3")
MODES = ("serial", "dbo")
SHAPES = ("prefill", "decode")
BLOCK = 16

#: --quick: the same structure at a tiny width (heads, experts, groups and top-k kept where they fit).
QUICK: dict[str, dict[str, Any]] = {
    "qwen3-moe": dict(hidden_size=64, moe_intermediate_size=32, vocab_size=512, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=16, num_experts=16),
    "mixtral": dict(hidden_size=64, intermediate_size=96, vocab_size=512, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=16),
    "deepseek-v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, vocab_size=512,
                        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}


@dataclass(frozen=True, kw_only=True)
class Spec:
    """One architecture's run, identical on every rank."""

    model: str
    ckpt: str
    dtype: str
    prefill_tokens: int
    decode_requests: int
    context: int
    steps: int
    warmup: int
    link: str
    link_scale: float
    num_kv_blocks: int
    #: HFMoEModel(deterministic=...): False the fast path (MoE layers too), True exact mode, None the default.
    deterministic: bool | None = False
    #: HFMoEModel(logits=...): "last" runs the LM head on each request's last token only, as a sampler needs.
    logits: str = "last"
    #: The results file's state (JSON beside the ``.md``) that rank 0 updates after each case, or None.
    state: str | None = None


def _dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def kv_blocks(prefill_tokens: int, decode_requests: int, context: int, steps: int, warmup: int) -> int:
    """Blocks for the larger of the two shapes (they never hold the cache at once)."""
    prefill = 2 * (-(-prefill_tokens // BLOCK) + 1)
    decode = decode_requests * -(-(context + warmup + steps + 1) // BLOCK)
    return max(prefill, decode) + 2


# ------------------------------------------------------------------------------------------ rank
def _hwm_and_rss() -> tuple[int, int]:
    """(peak RSS since the last reset, RSS now) in bytes, from /proc/self/status."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, kb = line.split()[:2]
                values[key] = int(kb) * 1024
    return values["VmHWM:"], values["VmRSS:"]


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _param_bytes(model: Any) -> int:
    seen: dict[int, int] = {}
    for name in model.slots.names():
        t = model.slots[name]
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def _union_s(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _profile_split(prof: Any) -> tuple[float, float]:
    """(torch op seconds, comm call seconds) on the thread that ran the most ops."""
    events = list(prof.events())
    if not events:
        return 0.0, 0.0
    main = Counter(e.thread for e in events).most_common(1)[0][0]
    ops, comm = [], []
    for e in events:
        if e.thread != main:
            continue
        span = (e.time_range.start / 1e6, e.time_range.end / 1e6)
        if e.name.startswith(("c10d", "gloo", "record_param_comms")):
            comm.append(span)
        elif e.name.startswith("aten::"):
            ops.append(span)
    return _union_s(ops), _union_s(comm)


def _chunks(spec: Spec, rank: int, vocab: int) -> tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]]]:
    """(the prefill step's 2 requests, the decode requests' contexts), seeded per rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    T = spec.prefill_tokens
    ids = torch.randint(0, vocab, (T,), generator=g).tolist()
    cut = max(1, T * 2 // 5)
    prefill = [(0, ids[:cut]), (1, ids[cut:])] if T > 1 else [(0, ids)]
    ctx = torch.randint(0, vocab, (spec.decode_requests, spec.context), generator=g).tolist()
    return prefill, [(100 + r, ctx[r]) for r in range(spec.decode_requests)]


async def _rank_async(rank: int, spec: Spec) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from asyncdbo.backends import link_spec
    from asyncdbo.models.hf.checkpoint import load_checkpoint
    from asyncdbo.observe import Tracer
    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

    group = dist.group.WORLD
    reset_ok = _reset_peak()
    t0 = time.perf_counter()
    model, report = load_checkpoint(spec.ckpt, model=spec.model, ep_group=group, dtype=_dtype(spec.dtype),
                                    max_ubatches=2, block_size=BLOCK, num_kv_blocks=spec.num_kv_blocks,
                                    deterministic=spec.deterministic, logits=spec.logits)
    out: dict[str, Any] = {"rank": rank, "load_s": time.perf_counter() - t0, "param_bytes": _param_bytes(model),
                           "kv_bytes": sum(t.numel() * t.element_size() for t in
                                           (*model.kv_cache.k_cache_LNZHK, *model.kv_cache.v_cache_LNZHK)),
                           "tensors_read": len(report.tensors_read), "shards": len(report.shards)}
    out["load_peak"], out["rss_after_load"] = _hwm_and_rss()
    out["peak_reset"] = reset_ok and _reset_peak()
    base = link_spec(spec.link)
    links = {"none": None, spec.link: link_spec(base, latency_s=base.latency_s * spec.link_scale,
                                                bandwidth_Bps=base.bandwidth_Bps / spec.link_scale)}
    thresholds = ThresholdConfig(prefill_threshold=1, decode_threshold=1)
    runners = {name: DBORunner(model, RunnerConfig(thresholds=thresholds, backend="host" if link else "auto", link=link),
                               dp_group=group) for name, link in links.items()}
    prefill_chunks, context_chunks = _chunks(spec, rank, model.hf.vocab_size)
    rows: list[dict[str, Any]] = []
    out["rows"] = rows
    cases = [(link_name, runner, shape) for link_name, runner in runners.items() for shape in SHAPES]
    for done, (link_name, runner, shape) in enumerate(cases, 1):
        model.kv_cache.reset()
        builder = BatchBuilder(model.kv_cache_config)
        if shape == "decode":  # untimed: every request's context
            await runner.step(builder.build(context_chunks), enabled=False)
            next_ids = {r: 1 + r % 7 for r, _ in context_chunks}
        for i in range(spec.warmup + spec.steps):
            if shape == "prefill":
                model.kv_cache.reset()
                builder.reset()
                batch = builder.build(prefill_chunks)
            else:
                batch = builder.build([(r, [next_ids[r]]) for r, _ in context_chunks])
            for mode in MODES:
                tracer = Tracer(rank=rank)
                dist.barrier()
                timed = i >= spec.warmup
                with profile(activities=[ProfilerActivity.CPU]) if timed else _nothing() as prof:
                    c0, w0 = time.thread_time(), time.perf_counter()
                    res = await runner.step(batch, enabled=(mode == "dbo"), instrument=tracer)
                    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
                if not timed:
                    continue
                torch_s, comm_call_s = _profile_split(prof)
                n = tracer.numbers()
                rows.append({
                    "link": link_name, "shape": shape, "mode": mode, "step": i - spec.warmup, "tokens": batch.num_tokens,
                    "wall_s": wall, "cpu_s": cpu, "torch_s": torch_s, "comm_call_s": comm_call_s, "idle_s": n.idle_s,
                    "host_s": max(0.0, wall - torch_s - comm_call_s - n.idle_s), "comm_s": n.comm_s,
                    "hidden": n.comm_hidden_share, "hidden_by_other": n.comm_hidden_by_other_share,
                    "microbatched": res.record.microbatched, "reason": res.record.reason.value,
                    "detail": res.record.detail, "switches": res.num_switches,
                })
            if shape == "decode":
                next_ids = {r: int(res.logits_TV[j].argmax()) for j, (r, _) in enumerate(context_chunks)}
        out["step_peak"], out["rss_end"] = _hwm_and_rss()
        # after each case, rank 0 writes every rank's rows so far: a run stopped later keeps them
        gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(out, gathered, dst=0)
        if rank == 0 and spec.state is not None:
            assert gathered is not None
            update_run(Path(spec.state), spec.model, per_rank=gathered, cases_done=done, cases_total=len(cases))
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def bench_rank(rank: int, world: int, spec: Spec) -> dict[str, Any]:
    import asyncdbo

    return asyncdbo.run(_rank_async, rank, spec)


# ---------------------------------------------------------------------------------------- parent
def _parse_bytes(text: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(float(t))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 12GiB, 512MiB or a number of bytes") from None


def plan(args: argparse.Namespace) -> list[tuple[str, Any, Any]]:
    """(name, config, estimate) of every architecture asked for, or ValueError."""
    from asyncdbo.cli.inputs import PROCESS_BASE_BYTES
    from asyncdbo.models.hf.memory import estimate_memory
    from asyncdbo.models.hf.real_dims import real_config

    out = []
    for name in args.model:
        overrides = QUICK[name] if args.quick else {}
        experts = args.deepseek_experts if name == "deepseek-v3" else None
        config = real_config(name, layers=args.layers, experts=experts, **overrides)
        steps = args.warmup + args.steps
        est = estimate_memory(config, ranks=2, dtype=_dtype(args.dtype),
                              num_kv_blocks=kv_blocks(args.prefill_tokens, args.decode_requests, args.context,
                                                      args.steps, args.warmup), block_size=BLOCK,
                              step_tokens=max(args.prefill_tokens, args.decode_requests * args.context),
                              longest_context=max(args.prefill_tokens, args.context + 2 * steps + 1),
                              base=PROCESS_BASE_BYTES)
        out.append((name, config, est))
    return out


def check_memory(planned: list[tuple[str, Any, Any]], available: int | None, args: argparse.Namespace) -> None:
    from asyncdbo.models.hf.memory import check_fits

    if available is None:
        return
    for name, _, est in planned:
        experts = "fewer --deepseek-experts, " if name == "deepseek-v3" else ""
        check_fits(est, available, what=f"{name} ({args.layers} layers, {args.dtype}) on 2 ranks",
                   fix=f"use fewer --layers, {experts}or fewer tokens, or run it on a machine with more "
                       "memory (--memory-limit sets the limit checked against)")


def run_one(name: str, config: Any, args: argparse.Namespace, ckpt_root: Path, state: Path | None,
            record: Any) -> list[dict[str, Any]]:
    """Write (or reuse) ``name``'s checkpoint and run it on 2 ranks; ``record(**fields)`` keeps what
    is known so far in the results (with ``state``, rank 0 adds every rank's rows after each case)."""
    from asyncdbo.models.hf.real_dims import checkpoint_tensors, write_random_checkpoint
    from asyncdbo.testing import RankPool

    ckpt = ckpt_root / name
    t0 = time.perf_counter()
    if args.reuse and (ckpt / "config.json").exists():
        _check_same_config(name, config, ckpt)
        specs, write_s = checkpoint_tensors(config), None
    else:
        specs = write_random_checkpoint(config, ckpt, seed=0, max_shard_bytes=2 << 30)
        write_s = time.perf_counter() - t0
    spec = Spec(model=name, ckpt=str(ckpt), dtype=args.dtype, prefill_tokens=args.prefill_tokens,
                decode_requests=args.decode_requests, context=args.context, steps=args.steps, warmup=args.warmup,
                link=args.link, link_scale=args.link_scale,
                num_kv_blocks=kv_blocks(args.prefill_tokens, args.decode_requests, args.context, args.steps, args.warmup),
                deterministic=EXACT[args.exact], logits=args.logits, state=None if state is None else str(state))
    record(write_s=write_s, checkpoint_bytes=sum(s.nbytes for s in specs), checkpoint_tensors=len(specs))
    t0 = time.perf_counter()
    try:
        with RankPool(2, timeout_s=args.timeout) as pool:
            per_rank: list[dict[str, Any]] = pool.run(bench_rank, spec, timeout_s=args.timeout)
    finally:
        record(run_s=time.perf_counter() - t0)
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
    return per_rank


def _check_same_config(name: str, config: Any, ckpt: Path) -> None:
    """--reuse: the checkpoint's config.json must have every size this run asks for."""
    from asyncdbo.models.hf.checkpoint import read_config
    from asyncdbo.models.hf.real_dims import RELEASED

    on_disk = read_config(ckpt).to_dict()
    want = config.to_dict()
    differ = [k for k in RELEASED[name] if on_disk.get(k) != want.get(k)]
    if differ:
        raise ValueError(f"--reuse: {ckpt / 'config.json'} differs from this run's config in {differ}; "
                         "drop --reuse or give another --ckpt-dir")


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f}"


def describe_config(name: str, c: Any) -> str:
    if name == "deepseek-v3":
        return (f"hidden {c.hidden_size}, {c.num_attention_heads} heads MLA (q_lora_rank {c.q_lora_rank}, kv_lora_rank "
                f"{c.kv_lora_rank}, qk {c.qk_nope_head_dim}+{c.qk_rope_head_dim}, v {c.v_head_dim}), "
                f"{c.n_routed_experts} routed experts (released: 256) of intermediate {c.moe_intermediate_size} in "
                f"{c.n_group} groups ({c.topk_group} kept), top-{c.num_experts_per_tok}, {c.n_shared_experts} shared, "
                f"dense intermediate {c.intermediate_size} (first {c.first_k_dense_replace} layer(s)), vocab "
                f"{c.vocab_size}, {c.num_hidden_layers} layers")
    experts = c.num_experts if name == "qwen3-moe" else c.num_local_experts
    inter = c.moe_intermediate_size if name == "qwen3-moe" else c.intermediate_size
    return (f"hidden {c.hidden_size}, {c.num_attention_heads} heads / {c.num_key_value_heads} KV heads of {c.head_dim}, "
            f"{experts} experts of intermediate {inter}, top-{c.num_experts_per_tok}, vocab {c.vocab_size}, "
            f"{c.num_hidden_layers} layers (all MoE)")


# ----------------------------------------------------------------------------------- results file
# The results file (``.md``) is rendered from a JSON state beside it (same stem, ``.json``): the
# machine, and per architecture the command, settings, config, estimate, status and every rank's
# rows so far.  The parent writes it when an architecture starts and ends, rank 0 after each case,
# so a run that is stopped keeps what it measured; ``--results FILE`` adds architectures to a file
# (one run per architecture, one after the other) and replaces the ones run again.

#: --exact: HFMoEModel's deterministic argument.
EXACT: dict[str, bool | None] = {"off": False, "on": True, "default": None}

TITLE = "Real widths, truncated depth: prefill and decode on 2 gloo ranks"
#: Machine fields that must agree for runs to share a results file (the load average may differ).
SAME_MACHINE = ("cpu", "cores", "os", "python", "torch", "uvloop", "accelerator")


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def load_state(state: Path) -> dict[str, Any]:
    return json.loads(state.read_text()) if state.exists() else {"runs": {}}


def save_state(state: Path, data: dict[str, Any]) -> None:
    """The JSON and the ``.md`` rendered from it, each replaced whole (a reader never sees half)."""
    for path, text in ((state, json.dumps(data, indent=1) + "\n"), (state.with_suffix(".md"), render(data))):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def update_run(state: Path, name: str, **fields: Any) -> None:
    """Set ``fields`` of ``name``'s run in the results file (and the load average now)."""
    data = load_state(state)
    data["runs"][name].update(fields, load_last=_loadavg())
    save_state(state, data)


def check_same_machine(data: dict[str, Any], info: dict[str, str], path: Path) -> None:
    """A results file holds runs of one machine and one set of versions."""
    old = data.get("machine_info")
    if old is None:
        return
    differ = [f"{k} {old.get(k)!r} there, {info.get(k)!r} here" for k in SAME_MACHINE if old.get(k) != info.get(k)]
    if differ:
        raise ValueError(f"--results {path}: its runs were measured on another machine or versions ({'; '.join(differ)}); "
                         "give another --results file")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ("layers", "deepseek_experts", "dtype", "prefill_tokens", "decode_requests",
                                          "context", "warmup", "steps", "link", "link_scale", "exact", "logits")}


def _model_settings(st: dict[str, Any]) -> str:
    exact = {"off": "exact mode off (deterministic=False: the fast path, MoE layers included)",
             "on": "exact mode on (deterministic=True: every GEMM in fixed row tiles of 64)",
             "default": "exact mode at its default (deterministic=None: the MoE layers batch-invariant on a CPU, "
                        "their expert GEMMs in fixed row tiles of 64)"}
    # runs recorded before these flags existed ran the default and every row's logits
    logits = {"all": "the LM head on every token", "last": "the LM head on each request's last token only "
              "(logits='last')"}
    return f"{exact[st.get('exact', 'default')]}; {logits[st.get('logits', 'all')]}"


def render(data: dict[str, Any]) -> str:
    """The results file: the machine, then each architecture run so far (in MODELS order)."""
    lines = [f"# {TITLE}\n", data.get("machine", "Machine: not recorded") + "\n",
             "Each architecture's section gives the command that ran it, when, and the load average then (the "
             "machine's 2 cores are shared with other jobs: every time below includes time spent waiting for a "
             "core). See the module docstring of benchmarks/real_dims.py for what each column measures.\n"]
    for name in sorted(data["runs"], key=MODELS.index):
        lines += render_run(data["runs"][name])
    return "\n".join(lines) + "\n"


def _status(run: dict[str, Any]) -> str:
    done = f"{run.get('cases_done', 0)} of {run.get('cases_total', 2 * len(SHAPES))} cases (link x shape) measured"
    if run["status"] == "complete":
        return f"complete, {done}"
    if run["status"] == "running":
        return f"{done}; the run had not finished when this was written"
    return f"{done}; the run stopped: {run['status']}"


def render_run(run: dict[str, Any]) -> list[str]:
    name, est, per_rank, st = run["name"], run["estimate"], run.get("per_rank", []), run["settings"]
    ckpt = ("not written yet" if "checkpoint_tensors" not in run else
            f"{run['checkpoint_tensors']} tensors, {run['checkpoint_bytes'] / 2**30:.2f} GiB, "
            + ("reused (--reuse)" if run["write_s"] is None else f"written in {run['write_s']:.0f} s"))
    took = f"; the 2-rank run took {run['run_s']:.0f} s" if run.get("run_s") is not None else ""
    lines = [f"\n## {name}\n", run["command"] + "\n",
             f"Started {run['started']} UTC; load average at the start {run['load_start']}, at the last update "
             f"{run['load_last']}. Status: {_status(run)}.\n",
             f"Settings: {st['layers']} layers; weights and compute {st['dtype']} (checkpoint bf16); prefill "
             f"{st['prefill_tokens']} tokens per rank in 2 requests; decode {st['decode_requests']} requests per rank "
             f"with {st['context']} tokens of context; {st['warmup']} untimed + {st['steps']} timed steps per case, "
             f"each serial then DBO (2 ubatches, token split); links: none (gloo over loopback) and {st['link']} "
             f"x{st['link_scale']:g} (modeled); "
             + _model_settings(st) + ".\n",
             f"Config: {run['config']}; checkpoint: {ckpt}{took}.\n",
             f"Estimate before the run: {est['describe']}.\n"]
    if not per_rank:
        return lines
    lines += ["| rank | load s | params MiB (estimate) | KV cache MiB (estimate) | peak RSS loading MiB | "
              "peak RSS stepping MiB | estimate per rank MiB |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for pr in per_rank:
        step_peak = _mib(pr["step_peak"]) if pr["peak_reset"] else "n/a (no clear_refs)"
        lines.append(f"| {pr['rank']} | {pr['load_s']:.1f} | {_mib(pr['param_bytes'])} ({_mib(est['weights'])}) | "
                     f"{_mib(pr['kv_bytes'])} ({_mib(est['kv_cache'])}) | {_mib(pr['load_peak'])} | {step_peak} | "
                     f"{_mib(est['per_rank'])} |")
    lines += ["", "Medians over the timed steps, per rank (ms): wall, main-thread CPU, inside torch ops, in comm "
              "calls, idle (every ubatch parked), host (the rest: Python, and waiting for a core); comm hidden: "
              "share of comm time during which some ubatch computed (by another ubatch in brackets); tokens/s: the "
              "rank's tokens per step over its median wall; speedup: serial wall / DBO wall, above 1x DBO is "
              "faster.", "",
              "| link | shape | rank | tokens | mode | wall | tokens/s | CPU | torch | comm calls | idle | host | host share "
              "| comm | comm hidden | speedup (serial / DBO wall) | microbatched |",
              "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    links = list(dict.fromkeys(row["link"] for row in per_rank[0]["rows"]))
    for link in links:
        for shape in SHAPES:
            for pr in per_rank:
                med: dict[str, dict[str, Any]] = {}
                for mode in MODES:
                    rs = [x for x in pr["rows"] if x["link"] == link and x["shape"] == shape and x["mode"] == mode]
                    if not rs:
                        break
                    med[mode] = {k: statistics.median(x[k] for x in rs) for k in
                                 ("wall_s", "cpu_s", "torch_s", "comm_call_s", "idle_s", "host_s", "comm_s",
                                  "hidden", "hidden_by_other", "tokens")}
                    med[mode]["split"] = sum(x["microbatched"] for x in rs)
                    med[mode]["n"] = len(rs)
                    med[mode]["reasons"] = ", ".join(sorted({x["reason"] for x in rs if not x["microbatched"]}))
                for mode, m in med.items():
                    ratio = f"{med['serial']['wall_s'] / m['wall_s']:.2f}x" if mode == "dbo" else ""
                    mb = f"{m['split']:.0f}/{m['n']:.0f}" + (f" ({m['reasons']})" if m["reasons"] else "")
                    lines.append(
                        f"| {link} | {shape} | {pr['rank']} | {m['tokens']:.0f} | {mode} | {_ms(m['wall_s'])} | "
                        f"{m['tokens'] / m['wall_s']:.0f} | "
                        f"{_ms(m['cpu_s'])} | {_ms(m['torch_s'])} | {_ms(m['comm_call_s'])} | {_ms(m['idle_s'])} | "
                        f"{_ms(m['host_s'])} | {m['host_s'] / m['wall_s']:.0%} | {_ms(m['comm_s'])} | "
                        f"{m['hidden']:.0%} ({m['hidden_by_other']:.0%}) | {ratio} | {mb} |")
    lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _progress

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", choices=MODELS, help="an architecture (repeatable; default all three)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--deepseek-experts", type=int, default=32, help="DeepSeek-V3's routed experts (released 256; default 32)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the ranks' weights and compute (default bf16)")
    p.add_argument("--prefill-tokens", type=int, default=16, help="new tokens per rank in a prefill step (default 16)")
    p.add_argument("--decode-requests", type=int, default=8, help="requests per rank in a decode step (default 8)")
    p.add_argument("--context", type=int, default=16, help="context tokens of each decode request (default 16)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per case (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per case first (default 1)")
    p.add_argument("--exact", choices=tuple(EXACT), default="off",
                   help="HFMoEModel's exact mode: off (the fast path, default), on, or default (on for the MoE "
                        "layers on a CPU: their expert GEMMs padded to tiles of 64 rows, minutes a step at real width)")
    p.add_argument("--logits", choices=("all", "last"), default="last",
                   help="the LM head on every token or on each request's last one (default last, as a sampler needs)")
    p.add_argument("--link", default="ib400", help="the modeled link (default ib400)")
    p.add_argument("--link-scale", type=float, default=1000.0,
                   help="multiply its latency and divide its bandwidth by this, as asyncdbo demo does (default 1000)")
    p.add_argument("--memory-limit", type=_parse_bytes, default=None,
                   help="refuse a run whose estimate exceeds this (e.g. 12GiB; default: MemAvailable)")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="where the checkpoints are written (default a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    p.add_argument("--reuse", action="store_true",
                   help="load a checkpoint already in --ckpt-dir/<model> (written by --keep) instead of writing one")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for each architecture's ranks (default 1800)")
    p.add_argument("--quick", action="store_true", help="tiny widths of the same structure, print only (a smoke test)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder for a new file (default benchmarks/results, not with --quick)")
    p.add_argument("--results", type=Path, default=None,
                   help="the results file (.md) to add these architectures to (the ones it has already are kept, "
                        "the ones run again replaced); default a new file in --out")
    _progress.add_quiet_flag(p)
    args = p.parse_args(argv)
    args.model = args.model or list(MODELS)
    for flag in ("layers", "prefill_tokens", "decode_requests", "context", "steps"):
        if getattr(args, flag) < 1:
            print(f"real_dims: error: --{flag.replace('_', '-')} must be >= 1 (got {getattr(args, flag)})", file=sys.stderr)
            return 2
    if args.results is not None and args.results.suffix != ".md":
        print(f"real_dims: error: --results {args.results} must name a .md file (its state goes beside it as .json)",
              file=sys.stderr)
        return 2
    from _results import results_preamble, results_stem

    from asyncdbo.cli.inputs import available_bytes

    command = "python benchmarks/real_dims.py " + " ".join(argv if argv is not None else sys.argv[1:])
    preamble, info = results_preamble(TITLE, command.strip())
    state: Path | None = None
    if args.results is not None:
        state = args.results.with_suffix(".json")
    elif args.out is not None or not args.quick:
        state = results_stem(args.out if args.out is not None else RESULTS, "real_dims", info).with_suffix(".json")
    data: dict[str, Any] = {"runs": {}}
    try:
        if state is not None:
            data = load_state(state)
            check_same_machine(data, info, state.with_suffix(".md"))
        planned = plan(args)
        check_memory(planned, args.memory_limit if args.memory_limit is not None else available_bytes(), args)
        ckpt_root = args.ckpt_dir or Path(tempfile.mkdtemp(prefix="asyncdbo-real-dims-"))
        need = max(est.weights for _, _, est in planned) * 4  # a checkpoint is at most ~2x one rank's weights
        free = shutil.disk_usage(ckpt_root if ckpt_root.exists() else ckpt_root.parent).free
        if free < need:
            raise ValueError(f"{ckpt_root} has {free / 2**30:.1f} GiB free, and the largest checkpoint needs up to "
                             f"{need / 2**30:.1f} GiB; give --ckpt-dir on a disk with more space")
    except ValueError as exc:
        print(f"real_dims: error: {exc}", file=sys.stderr)
        return 2
    if "machine" not in data:  # the load average goes with each architecture's run instead
        data.update(machine="Machine: " + ", ".join(f"{k} {v}" for k, v in info.items() if k != "load average at start"),
                    machine_info={k: v for k, v in info.items() if k in SAME_MACHINE})
    if state is not None:
        state.parent.mkdir(parents=True, exist_ok=True)

    def record(name: str, **fields: Any) -> None:
        data["runs"][name].update(fields, load_last=_loadavg())
        if state is not None:
            fresh = load_state(state)  # rank 0 may have added rows since
            fresh["runs"][name].update(fields, load_last=_loadavg())
            data["runs"][name] = fresh["runs"][name]
            save_state(state, data)

    _progress.start(args.quiet, "architectures", len(planned))
    failed: list[str] = []
    try:
        for name, config, est in planned:
            _progress.step(f"{name}: write the checkpoint, load it on 2 ranks, run")
            data["runs"][name] = {
                "name": name, "command": preamble[2].strip(), "settings": _settings(args),
                "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                "load_start": _loadavg(), "load_last": _loadavg(), "config": describe_config(name, config),
                "estimate": {"describe": est.describe(), "weights": est.weights, "kv_cache": est.kv_cache,
                             "per_rank": est.per_rank},
                "status": "running", "cases_done": 0, "cases_total": 2 * len(SHAPES), "per_rank": [],
            }
            if state is not None:
                save_state(state, data)
            try:
                per_rank = run_one(name, config, args, ckpt_root, state, lambda **f: record(name, **f))
            except Exception as exc:  # noqa: BLE001 - recorded in the results, then the next architecture
                record(name, status=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                failed.append(f"{name}: {exc}")
                continue
            record(name, status="complete", per_rank=per_rank, cases_done=2 * len(SHAPES))
    finally:
        if args.ckpt_dir is None and not args.keep:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        _progress.done()
    print(render(data))
    if state is not None:
        print(f"wrote {state.with_suffix('.md')} (and its state, {state.name})", file=sys.stderr)
    for line in failed:
        print(f"real_dims: error: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
