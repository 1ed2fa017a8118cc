"""The ``asyncdbo demo`` configuration (:class:`DemoConfig`), its checks and its limits, how the
command line becomes one, and where the local ranks start (:func:`start_ranks`). The lowest of
the demo's modules: ``demo_run`` runs it, ``demo_memory`` sizes it, ``demo`` (the command) and its
``env``/``hf``/``tp`` launchers read it."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..moe.config import Schedule
from .inputs import check_timeout
from .progress import wants_progress

if TYPE_CHECKING:
    from ..testing.ranks import RankPool

__all__ = ["DETERMINISTIC_CHOICES", "LINK_CHOICES", "MATCH_ATOL", "START_TIMEOUT_S", "DemoConfig", "start_ranks"]

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


def start_ranks(ranks: int, timeout_s: float) -> RankPool:
    """The ``--launcher local`` demos' ranks (mini, ``--model``, ``--tp``), as a context manager:
    a fresh :class:`asyncdbo.testing.RankPool` whose group timeout is ``--timeout`` (each wait, not
    the run), closed when the run ends. The one place these demos start processes: the test suite
    points it at its shared ranks (``tests/cli/conftest.py``)."""
    from ..testing.ranks import RankPool

    return RankPool(ranks, timeout_s=timeout_s, start_timeout_s=max(timeout_s, START_TIMEOUT_S))


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
