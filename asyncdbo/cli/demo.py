"""``asyncdbo demo``: the DP+EP MoE model on W local ranks, serial vs DBO, side by side.

Each step runs the same batch twice on every rank, first as one batch (DBO off) and then with
DBO, so the two are measured back to back on the same (noisy, shared) machine; the table reports
medians over the steps after a warm-up.  The logits of both runs must match, or the command exits
with status 1: bit for bit in deterministic mode (``--deterministic``, on by default on a CPU),
within ``MATCH_ATOL`` without it.

Two launchers share one per-rank function (:func:`demo_rank`):

* ``--launcher local`` (default): :func:`asyncdbo.testing.run_ranks` starts W processes joined in a
  gloo group on 127.0.0.1 and collects their numbers;
* ``--launcher env``: run under ``torchrun --nproc-per-node W -m asyncdbo demo --launcher env``;
  every process joins through ``env://`` (NCCL and its own GPU when CUDA is available, else
  gloo), and rank 0 prints.

On a CPU the "device" is the CPU and comm is gloo over loopback, which needs CPU time too, so on a
2-core machine real comm competes with compute and overlap shows little.  ``--link`` models an
interconnect: the real all-to-all still runs and carries the data, but its completion is released
only after ``latency + bytes / bandwidth`` of the named link, a wait that takes no CPU.  A CPU
computes ~1000x slower than the accelerators such links serve, so by default the modeled link's
times are scaled by ``--link-scale`` (1000) to keep comm:compute near what the real pair would
see.  Output from a modeled link is labelled ``MODELED LINK``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..moe.config import Schedule
from .demo_memory import check_memory, rank_bytes
from .inputs import check_output_dir, check_timeout
from .progress import Progress, wants_progress

__all__ = ["DemoConfig", "add_arguments", "demo_rank", "error_line", "main", "passed", "rank_bytes", "split_note", "summarize"]

logger = logging.getLogger("asyncdbo.cli.demo")

LINK_CHOICES = ("none", "nvlink", "ib400", "eth100")
#: --deterministic: auto (MiniConfig's default: on for CPU tensors), on, off.
DETERMINISTIC_CHOICES = ("auto", "on", "off")
#: Max |logits| difference between serial and DBO accepted as a match when deterministic mode is
#: off (fp32 rounding: other row counts take other GEMM and reduction paths). With it on (the CPU
#: default) the outputs must be bitwise equal.
MATCH_ATOL = 1e-4
#: Seconds the local ranks may take to start (spawn, import torch, join the group) on a loaded
#: machine, however short --timeout is.
START_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything one demo run needs; identical on every rank."""

    ranks: int = 2
    tokens: int = 512
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    hidden: int = 256
    schedule: Schedule = "ht"
    stream_policy: str = "role"
    ubatches: int = 2
    loop: str = "auto"
    steps: int = 5
    warmup: int = 1
    shape: str = "prefill"
    context: int = 32
    link: str | None = None
    link_scale: float = 1000.0
    trace: str | None = None
    seed: int = 0
    prefill_threshold: int = 512
    decode_threshold: int = 32
    deterministic: str = "auto"
    timeout_s: float = 120.0  # bounds a stuck rank or collective: group timeout and runner watchdog
    progress: bool = False  # rank 0 keeps a "[step i/N]" line on stderr (set when stderr is a terminal)

    def __post_init__(self) -> None:
        for name in ("ranks", "layers", "experts", "top_k", "hidden", "ubatches", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if self.prefill_threshold < 0 or self.decode_threshold < 0:
            raise ValueError(
                f"--prefill-threshold and --decode-threshold must be >= 0 "
                f"(got {self.prefill_threshold}, {self.decode_threshold}); 0 always microbatches"
            )
        if self.warmup < 0 or self.context < 1:
            raise ValueError(f"--warmup must be >= 0 and --context >= 1 (got {self.warmup}, {self.context})")
        if self.tokens < 0:
            raise ValueError(f"--tokens must be >= 0 (got {self.tokens})")
        if self.tokens == 0:
            raise ValueError("--tokens 0 gives every rank zero tokens: there is nothing to run; use --tokens >= 1")
        if self.experts % self.ranks:
            raise ValueError(
                f"--experts {self.experts} is not divisible by --ranks {self.ranks}: each rank owns "
                f"an equal share of experts; use a multiple of {self.ranks}"
            )
        if self.shape not in ("prefill", "decode"):
            raise ValueError(f"unknown --shape {self.shape!r}; use 'prefill' or 'decode'")
        if self.link is not None and self.link not in LINK_CHOICES[1:]:
            raise ValueError(f"unknown --link {self.link!r}; use one of {LINK_CHOICES}")
        if not 0 < self.link_scale < math.inf:
            raise ValueError(f"--link-scale must be a finite number > 0 (got {self.link_scale:g}); the default is 1000")
        check_timeout("--timeout", self.timeout_s)
        if self.loop not in ("auto", "asyncio", "uvloop"):
            raise ValueError(f"unknown --loop {self.loop!r}; use 'auto', 'asyncio' or 'uvloop'")
        if self.deterministic not in DETERMINISTIC_CHOICES:
            raise ValueError(f"unknown --deterministic {self.deterministic!r}; use one of {DETERMINISTIC_CHOICES}")
        if self.stream_policy not in ("role", "ubatch"):
            raise ValueError(f"unknown --stream-policy {self.stream_policy!r}; use 'role' or 'ubatch'")
        self.model_config()  # MiniConfig checks top-k, schedule and sizes with its own messages

    def model_config(self) -> Any:
        from ..models import MiniConfig

        heads = max(1, self.hidden // 64)
        # Enough blocks for the biggest step: every request's context plus all decode steps.
        block = 16
        if self.shape == "prefill":
            blocks = -(-self.tokens // block) + 8
        else:
            blocks = self.tokens * -(-(self.context + self.warmup + self.steps) // block)
        return MiniConfig(
            hidden_size=self.hidden, num_layers=self.layers, num_heads=heads, head_dim=self.hidden // heads,
            num_experts=self.experts, top_k=self.top_k, moe_intermediate_size=self.hidden,
            schedule=self.schedule, block_size=block, num_kv_blocks=blocks, seed=self.seed,
            deterministic={"auto": None, "on": True, "off": False}[self.deterministic],
        )

    def link_spec(self) -> Any:
        if self.link is None:
            return None
        from ..backends import link_spec

        base = link_spec(self.link)
        return link_spec(base, latency_s=base.latency_s * self.link_scale,
                         bandwidth_Bps=base.bandwidth_Bps / self.link_scale)


# ------------------------------------------------------------------------------------ per rank
def _prefill_chunks(cfg: DemoConfig, rank: int, step: int, vocab: int) -> list[tuple[int, list[int]]]:
    """``cfg.tokens`` new tokens in 1-4 requests of uneven, seeded lengths."""
    g = torch.Generator().manual_seed(cfg.seed * 100003 + rank * 1009 + step)
    num_reqs = min(cfg.tokens, int(torch.randint(1, 5, (1,), generator=g)))
    cuts = sorted(torch.randperm(cfg.tokens - 1, generator=g)[: num_reqs - 1].add(1).tolist()) if num_reqs > 1 else []
    bounds = [0, *cuts, cfg.tokens]
    ids = torch.randint(0, vocab, (cfg.tokens,), generator=g).tolist()
    return [(step * 1000 + r, ids[bounds[r] : bounds[r + 1]]) for r in range(num_reqs)]


def _decode_chunks(cfg: DemoConfig, rank: int, step: int, vocab: int, length: int) -> list[tuple[int, list[int]]]:
    g = torch.Generator().manual_seed(cfg.seed * 100003 + rank * 1009 + step)
    ids = torch.randint(0, vocab, (cfg.tokens, length), generator=g).tolist()
    return [(r, ids[r]) for r in range(cfg.tokens)]


async def _demo_rank_async(rank: int, world: int, cfg: DemoConfig, device: torch.device) -> dict[str, Any]:
    import torch.distributed as dist

    from ..models import MiniModel
    from ..observe import Tracer
    from ..plan import ThresholdConfig
    from ..serving import BatchBuilder, DBORunner, RunnerConfig

    group = dist.group.WORLD if dist.is_initialized() and world > 1 else None
    mcfg = cfg.model_config()
    model = MiniModel(mcfg, ep_group=group, max_ubatches=max(cfg.ubatches, 2), device=device)
    runner = DBORunner(
        model,
        RunnerConfig(num_ubatches=cfg.ubatches, stream_policy=cfg.stream_policy,  # type: ignore[arg-type]
                     thresholds=ThresholdConfig(prefill_threshold=cfg.prefill_threshold,
                                                decode_threshold=cfg.decode_threshold),
                     backend="host" if cfg.link else "auto", link=cfg.link_spec(), watchdog_s=cfg.timeout_s),
        dp_group=group,
        device=device,
    )
    builder = BatchBuilder(mcfg.kv_cache_config, device=device, vocab_size=mcfg.vocab_size)  # ids checked on the host

    def barrier() -> None:
        if group is not None:
            dist.barrier()

    if cfg.shape == "decode":  # fill every request's context once, untimed
        await runner.step(builder.build(_decode_chunks(cfg, rank, -1, mcfg.vocab_size, cfg.context)), enabled=False)
    from ..moe.batch_invariant import is_deterministic

    out: dict[str, Any] = {"rank": rank, "serial": [], "dbo": [], "max_abs_diff": 0.0, "trace": None, "bitwise": True,
                           "deterministic": is_deterministic(mcfg.deterministic, torch.empty(0, device=device))}
    for i in range(cfg.warmup + cfg.steps):
        if cfg.shape == "prefill":
            builder.reset()
            batch = builder.build(_prefill_chunks(cfg, rank, i, mcfg.vocab_size))
        else:
            batch = builder.build(_decode_chunks(cfg, rank, i, mcfg.vocab_size, 1))
        last = i == cfg.warmup + cfg.steps - 1
        if cfg.progress and rank == 0:
            _show_step(i, cfg)
        results = {}
        for mode in ("serial", "dbo"):
            tracer = Tracer(rank=rank)
            barrier()
            res = await runner.step(batch, enabled=(mode == "dbo"), instrument=tracer)
            results[mode] = res
            if i >= cfg.warmup:
                n = tracer.numbers()
                out[mode].append({
                    "step_s": res.step_s, "comm_s": n.comm_s, "hidden_share": n.comm_hidden_share,
                    "hidden_by_other_share": n.comm_hidden_by_other_share,
                    "idle_s": n.idle_s, "switches": n.switches, "reason": res.record.reason.value,
                    "detail": res.record.detail, "ubatch_tokens": list(res.record.ubatch_num_tokens),
                    "messages": len(res.comm), "fused": any(c.what == "dispatch+counts" for c in res.comm),
                })
            if last and mode == "dbo" and cfg.trace:
                out["trace"] = tracer.to_chrome()
                out["trace"]["otherData"]["asyncdbo"]["title"] = (
                    f"asyncdbo demo: step {i + 1} of {cfg.warmup + cfg.steps} ({cfg.warmup} warm-up + {cfg.steps} "
                    f"timed), its DBO run (each step runs serial, then DBO)")
        diff = (results["serial"].logits_TV - results["dbo"].logits_TV).abs().max().item() if batch.num_tokens else 0.0
        # NaN stays NaN (max(0.0, nan) is 0.0: asyncdbo.models.hf.generate.worst_diff says why)
        out["max_abs_diff"] = diff if math.isnan(diff) else max(out["max_abs_diff"], diff)
        out["bitwise"] &= torch.equal(results["serial"].logits_TV, results["dbo"].logits_TV)
    return out


def _show_step(i: int, cfg: DemoConfig) -> None:
    """Rank 0's status line, counted as the user counts (1..N; warm-up steps first, as in the
    header), rewritten in place; the launcher erases it before printing the table."""
    kind = "warm-up" if i < cfg.warmup else "timed"
    sys.stderr.write(f"\r\033[K[{i + 1}/{cfg.warmup + cfg.steps}] step {i + 1} ({kind}): serial, then DBO ...")
    sys.stderr.flush()


def demo_rank(rank: int, world: int, cfg: DemoConfig) -> dict[str, Any]:
    """The work of one rank, for either launcher: the process group is already initialised.
    ``kill -USR1 <pid>`` of a rank prints its ubatches' await chains (it keeps running)."""
    from ..dbo import run
    from ..observe import install_stack_dump_signal

    install_stack_dump_signal()

    device = torch.device("cpu")
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return run(_demo_rank_async, rank, world, cfg, device, loop=cfg.loop)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ report
def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarize(cfg: DemoConfig, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over steps of the slowest rank's step time; comm numbers averaged over ranks."""
    summary: dict[str, Any] = {
        "max_abs_diff": max(r["max_abs_diff"] for r in per_rank),
        "bitwise": all(r["bitwise"] for r in per_rank),
        "deterministic": all(r["deterministic"] for r in per_rank),
    }
    for mode in ("serial", "dbo"):
        steps = list(zip(*(r[mode] for r in per_rank)))  # per step: one entry per rank
        summary[mode] = {
            "step_s": _median([max(e["step_s"] for e in s) for s in steps]),
            "comm_s": _median([statistics.fmean(e["comm_s"] for e in s) for s in steps]),
            "hidden_share": _median([statistics.fmean(e["hidden_share"] for e in s) for s in steps]),
            "hidden_by_other_share": _median([statistics.fmean(e["hidden_by_other_share"] for e in s) for s in steps]),
            "switches": _median([statistics.fmean(e["switches"] for e in s) for s in steps]),
            "messages": _median([statistics.fmean(e.get("messages", 0) for e in s) for s in steps]),
            # steps in which the MoE dispatches went fused (on rank 0: every rank chooses alike)
            "fused_steps": sum(bool(s[0].get("fused", False)) for s in steps),
            "steps": len(steps),
            "reasons": sorted({(e["reason"], e["detail"]) for s in steps for e in s}),
            "ubatch_tokens": [r[mode][-1]["ubatch_tokens"] for r in per_rank] if steps else [],
        }
    # DBO steps that microbatched: a step counts when it did on every rank (DP agreement makes the
    # ranks agree; a rank that did not is what a rank_declined step reports).
    dbo_steps = list(zip(*(r["dbo"] for r in per_rank)))
    summary["microbatched_steps"] = sum(all(e["reason"] == "microbatched" for e in s) for s in dbo_steps)
    # The speed convention everywhere in asyncdbo's output: speedup = serial time / DBO time.
    # Over steps none of which microbatched it would compare two serial runs: noise, not a result.
    summary["speedup"] = (summary["serial"]["step_s"] / summary["dbo"]["step_s"]
                          if summary["dbo"]["step_s"] and summary["microbatched_steps"] else None)
    return summary


def split_note(s: dict[str, Any]) -> str:
    """What the DBO column summarizes, for the lines that show a speedup or an overlap share."""
    n, total = s["microbatched_steps"], s["dbo"]["steps"]
    if n == 0:
        return f"no speedup: none of the {total} DBO steps microbatched (see 'DBO steps' below), DBO ran serially"
    return f"DBO microbatched {'all' if n == total else n} of {total} steps"


def passed(s: dict[str, Any]) -> bool:
    """Serial and DBO agree: bit for bit in deterministic mode, else within MATCH_ATOL."""
    return bool(s["bitwise"]) if s["deterministic"] else s["max_abs_diff"] <= MATCH_ATOL


def _dispatch_line(modeled: bool, ser: dict[str, Any], dbo: dict[str, Any]) -> str:
    """How the MoE layers sent the per-expert counts (RunnerConfig.dispatch="auto": fused where
    asyncdbo.dist.choose_dispatch prices one message below two, never for the ht schedule with 2
    ubatches)."""
    if not modeled:
        return "MoE dispatch: split (counts, then tokens); with no link model to price it, never fused"

    def said(m: dict[str, Any]) -> str:
        if m["fused_steps"] == 0:
            return "split"
        return "fused" if m["fused_steps"] == m["steps"] else f"fused in {m['fused_steps']} of {m['steps']} steps"

    return (f"MoE dispatch, chosen per step from the link model and the schedule: serial {said(ser)}, DBO {said(dbo)} "
            "(fused: the counts ride in the token message; split: counts, then tokens)")


#: Rows whose DBO figure depends on whether the steps microbatched: they say how many did.
_SPLIT_ROWS = ("speedup", "  by the other ubatch")


def _format(cfg: DemoConfig, s: dict[str, Any]) -> str:
    spec = cfg.link_spec()
    if spec is None:
        comm = "comm: real gloo all-to-all over loopback (it shares the CPU with compute)"
    else:
        comm = (f"comm: MODELED LINK {cfg.link} x{cfg.link_scale:g} ({spec.latency_s * 1e6:g} us + "
                f"{spec.bandwidth_Bps / 1e6:g} MB/s per message; the real all-to-all runs, its "
                f"completion is released on the modeled link)")

    ser, dbo = s["serial"], s["dbo"]
    def own(m: dict[str, Any]) -> str:
        return f"{max(0.0, m['hidden_share'] - m['hidden_by_other_share']):.0%}"

    rows = [
        ("", "serial", "DBO"),
        ("step time (median)", f"{ser['step_s'] * 1e3:.2f} ms", f"{dbo['step_s'] * 1e3:.2f} ms"),
        ("speedup", "", "-" if s["speedup"] is None else f"{s['speedup']:.2f}x"),
        ("time in comm", f"{ser['comm_s'] * 1e3:.2f} ms", f"{dbo['comm_s'] * 1e3:.2f} ms"),
        ("comm hidden", f"{ser['hidden_share']:.0%}", f"{dbo['hidden_share']:.0%}"),
        ("  by the other ubatch", f"{ser['hidden_by_other_share']:.0%}", f"{dbo['hidden_by_other_share']:.0%}"),
        ("  by its own ubatch", own(ser), own(dbo)),
        ("yields / step", f"{ser['switches']:g}", f"{dbo['switches']:g}"),
        ("messages / step", *(f"{m['messages']:g}" if m["messages"] else "-" for m in (ser, dbo))),
    ]
    fell_back = [(r, d) for r, d in dbo["reasons"] if r != "microbatched"]
    if not fell_back:
        sizes = " ".join(str(t) for t in dbo["ubatch_tokens"])
        why = f"DBO steps: microbatched, every step on every rank (real tokens per ubatch by rank: {sizes})"
    else:
        which = "any step" if not s["microbatched_steps"] else "some steps"
        why = f"DBO steps: NOT microbatched in {which}: " + "; ".join(
            f"{r}" + (f" ({d})" if d else "") for r, d in fell_back)
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [
        (f"asyncdbo demo: {cfg.ranks} ranks x {cfg.tokens} tokens ({cfg.shape}), {cfg.layers} layers, "
        f"{cfg.experts} experts top-{cfg.top_k}, hidden {cfg.hidden}, schedule {cfg.schedule}, "
        f"stream policy {cfg.stream_policy}, {cfg.ubatches} ubatches, loop {cfg.loop}, "
        f"{cfg.steps} steps after {cfg.warmup} warm-up"),
        comm,
        "",
        *(f"  {a:<{w0}}  {b:>{w1}}  {c:>{w1}}" + (f"  ({split_note(s)})" if a in _SPLIT_ROWS else "")
          for a, b, c in rows),
        "",
        "speedup = serial step time / DBO step time (above 1x: DBO is faster)",
        "comm hidden: share of comm time during which some ubatch computed; by the other ubatch: the overlap DBO adds;",
        "  by its own ubatch: the shared expert, which runs while its own combine is in flight, with or without DBO",
        "messages: the all-to-alls a rank issued per step (per MoE layer and ubatch: counts, dispatch, combine;",
        "  a fused dispatch sends the counts with the tokens); - where the backend tracks none (accelerators)",
        "serial steps: one batch per rank (DBO off), run as a single ubatch on the same backend",
        why,
        _dispatch_line(spec is not None, ser, dbo),
    ]
    if s["deterministic"]:
        verdict = "bitwise equal" if s["bitwise"] else "MISMATCH: deterministic mode promises bitwise equality"
        rule = "deterministic mode"
    else:
        verdict = "bitwise equal" if s["bitwise"] else ("match" if passed(s) else "MISMATCH")
        rule = f"tolerance {MATCH_ATOL:g}, deterministic mode off"
    lines.append(f"outputs serial vs DBO: max |logits diff| = {s['max_abs_diff']:.3g} ({verdict}; {rule})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    p.add_argument("--ranks", type=int, default=d.ranks, help="local ranks (DP = EP size) [%(default)s]")
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per rank per step (decode: requests) [%(default)s]")
    p.add_argument("--layers", type=int, default=d.layers, help="[%(default)s]")
    p.add_argument("--experts", type=int, default=d.experts, help="routed experts, a multiple of --ranks [%(default)s]")
    p.add_argument("--top-k", type=int, default=d.top_k, help="[%(default)s]")
    p.add_argument("--hidden", type=int, default=d.hidden, help="[%(default)s]")
    p.add_argument("--schedule", default=d.schedule, help="MoE DBO schedule: ht or ll [%(default)s]")
    p.add_argument("--stream-policy", default=d.stream_policy, help="role or ubatch [%(default)s]")
    p.add_argument("--ubatches", type=int, default=d.ubatches, help="[%(default)s]")
    p.add_argument("--loop", default=d.loop, help="auto, asyncio or uvloop [%(default)s]")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps [%(default)s]")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps first [%(default)s]")
    p.add_argument("--shape", default=d.shape, help="prefill or decode [%(default)s]")
    p.add_argument("--context", type=int, default=d.context, help="decode: context tokens per request [%(default)s]")
    p.add_argument("--link", default="none", help=f"modeled link: {', '.join(LINK_CHOICES)} [%(default)s]")
    p.add_argument("--link-scale", type=float, default=d.link_scale,
                   help="multiply the modeled link's latency and divide its bandwidth by this (CPU vs accelerator speed) [%(default)s]")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="write the last DBO step's trace to DIR: rank<r>.json, merged.json (Chrome/Perfetto), timeline.png, numbers.json")
    p.add_argument("--prefill-threshold", type=int, default=d.prefill_threshold,
                   help="microbatch a mixed/prefill step from this many tokens per rank (vLLM's default) [%(default)s]")
    p.add_argument("--decode-threshold", type=int, default=d.decode_threshold,
                   help="microbatch a uniform-decode step from this many tokens per rank (vLLM's default) [%(default)s]")
    p.add_argument("--deterministic", default=d.deterministic,
                   help="batch-invariant numerics, DBO bitwise equal to serial: auto (on for CPU), on, off [%(default)s]")
    p.add_argument("--seed", type=int, default=d.seed, help="[%(default)s]")
    p.add_argument("--launcher", choices=("local", "env"), default="local",
                   help="local: start --ranks processes here; env: this process is one rank of torchrun [%(default)s]")
    p.add_argument("--timeout", type=float, default=d.timeout_s,
                   help="seconds before a stuck rank or collective fails (each wait, not the whole run) [%(default)s]")
    p.add_argument("--model", choices=("mini", "mixtral", "qwen3-moe", "deepseek-v3", "llama", "qwen3"), default="mini",
                   help="mini: the small reference model; or a Hugging Face architecture, checked against "
                        "transformers (see asyncdbo.cli.demo_hf; --layers/--experts/--top-k/--hidden come from its config) [%(default)s]")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines (they are only written to a terminal anyway)")
    p.add_argument("--weights", metavar="DIR", default=None,
                   help="--model: a local checkpoint directory (config.json + safetensors); default: a tiny random model")
    # dense tensor-parallel models (asyncdbo.cli.demo_tp)
    p.add_argument("--tp", type=int, default=None, help="--model llama|qwen3: tensor-parallel ranks [2]")
    p.add_argument("--repeats", type=int, default=3, help="--model llama|qwen3: timed generations [%(default)s]")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="--model llama|qwen3: reduce-scatter + all-gather instead of all-reduce")


def _config_from_args(args: argparse.Namespace, ranks: int | None = None) -> DemoConfig:
    return DemoConfig(
        ranks=args.ranks if ranks is None else ranks, tokens=args.tokens, layers=args.layers,
        experts=args.experts, top_k=args.top_k, hidden=args.hidden, schedule=args.schedule,
        stream_policy=args.stream_policy, ubatches=args.ubatches, loop=args.loop, steps=args.steps,
        warmup=args.warmup, shape=args.shape, context=args.context,
        link=None if args.link == "none" else args.link, link_scale=args.link_scale,
        trace=args.trace, seed=args.seed, prefill_threshold=args.prefill_threshold,
        decode_threshold=args.decode_threshold, deterministic=args.deterministic, timeout_s=args.timeout,
        progress=wants_progress(getattr(args, "quiet", False)),
    )


def _report(cfg: DemoConfig, per_rank: list[dict[str, Any]]) -> int:
    s = summarize(cfg, per_rank)
    if cfg.progress:  # erase rank 0's status line (torchrun: this process is rank 0)
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
    print(_format(cfg, s))
    if cfg.trace:
        import json

        from ..observe import write_traces

        paths = write_traces(cfg.trace, [r["trace"] for r in per_rank if r["trace"] is not None])
        paths.append(os.path.join(cfg.trace, "numbers.json"))
        with open(paths[-1], "w", encoding="utf-8") as f:
            json.dump({"config": asdict(cfg), "summary": s}, f, indent=1, default=str)
        print(f"trace of the last DBO step (open the JSON in ui.perfetto.dev): {', '.join(paths)}")
    return 0 if passed(s) else 1


def error_line(details: str) -> str:
    """The exception line of a rank's traceback text (its last unindented ``Name: message`` line,
    which for a multi-line message such as a deadlock report is not the text's last line)."""
    lines = [ln for ln in details.strip().splitlines() if ln and not ln[0].isspace()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if ":" in ln and " " not in head and not ln.startswith("Traceback"):
            return ln
    return lines[-1] if lines else details.strip()


def main(args: argparse.Namespace) -> int:
    from ..testing.ranks import RankError, RankPool

    if args.model in ("llama", "qwen3"):
        from .demo_tp import main_tp

        return main_tp(args)
    if args.model != "mini" or args.weights is not None:
        from .demo_hf import main_hf

        return main_hf(args)
    if args.launcher == "env":
        from .demo_env import main_env

        return main_env(args)
    try:
        cfg = _config_from_args(args)
        check_memory(cfg)
        if cfg.trace:
            check_output_dir("--trace", cfg.trace)
    except ValueError as exc:
        print(f"asyncdbo demo: error: {exc}", file=sys.stderr)
        return 2
    progress = Progress(cfg.warmup + cfg.steps, f"steps (each serial, then DBO) on {cfg.ranks} ranks",
                        enabled=cfg.progress)
    progress.note(f"starting {cfg.ranks} ranks")
    try:
        # --timeout bounds every collective and every wait of a step (group timeout, watchdog),
        # not the run: a healthy run of any length finishes; a stuck rank fails its peers.
        with RankPool(cfg.ranks, timeout_s=cfg.timeout_s, start_timeout_s=max(cfg.timeout_s, START_TIMEOUT_S)) as pool:
            per_rank = pool.run(demo_rank, cfg, timeout_s=math.inf)
    except RankError as exc:
        progress.done()
        print(f"asyncdbo demo: error: {exc.root_line()}", file=sys.stderr)
        return 1
    progress.done()
    return _report(cfg, per_rank)
