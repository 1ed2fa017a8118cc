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
import math
import sys

from . import demo_config
from .demo_config import LINK_CHOICES, DemoConfig, _config_from_args
from .demo_memory import check_memory, rank_bytes
from .demo_run import _format as _format
from .demo_run import _report, decode_chunks, demo_rank, error_line, passed, prefill_chunks, split_note, summarize
from .inputs import check_output_dir
from .progress import Progress

__all__ = [
    "DemoConfig", "add_arguments", "decode_chunks", "demo_rank", "error_line", "main", "passed", "prefill_chunks", "rank_bytes",
    "split_note", "summarize",
]

_decode_chunks, _prefill_chunks = decode_chunks, prefill_chunks  # their names before issue 52, which benchmarks imported


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


def main(args: argparse.Namespace) -> int:
    from ..testing.ranks import RankError

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
        with demo_config.start_ranks(cfg.ranks, cfg.timeout_s) as pool:
            per_rank = pool.run(demo_rank, cfg, timeout_s=math.inf)
    except RankError as exc:
        progress.done()
        print(f"asyncdbo demo: error: {exc.root_line()}", file=sys.stderr)
        return 1
    progress.done()
    return _report(cfg, per_rank)
