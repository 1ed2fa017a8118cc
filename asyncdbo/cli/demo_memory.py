"""How much memory ``asyncdbo demo`` would need, estimated before any rank starts.

The sizes come from the config alone; :func:`check_memory` compares them with the memory the
machine has available (and each rank's with this process's data limit, which the ranks
inherit) and refuses a run that does not fit, naming the largest ``--tokens`` that would (see
:mod:`asyncdbo.cli.inputs` for why, and for the measurements).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn

from . import inputs
from .inputs import PROCESS_BASE_BYTES, human_bytes, largest_fitting

if TYPE_CHECKING:
    from .demo_config import DemoConfig

__all__ = ["check_memory", "check_memory_hf", "rank_bytes"]


def rank_bytes(cfg: DemoConfig) -> float:
    """Estimated bytes one demo rank allocates on top of the process itself (``PROCESS_BASE_BYTES``):
    weights, the KV cache, attention and per-token activations and logits. A prefill step may be
    one request of ``--tokens`` tokens, whose attention holds ``heads x T x T`` scores three times
    over (scores, masked, softmax) plus the ``T x T`` mask; a decode step gathers each request's
    context keys and values, and before it the demo fills ``--context`` tokens of every request in
    one untimed step, whose activations dominate. Measured against peak RSS: 1.0-1.7x
    (``benchmarks/results/memory_estimate_cpu-2c_2026-12-01.md``)."""
    m = cfg.model_config()
    f32 = 4
    T, D, H, L, V, I = cfg.tokens, m.hidden_size, m.num_heads, m.num_layers, m.vocab_size, m.moe_intermediate_size
    F = H * m.head_dim
    experts_here = m.num_experts // cfg.ranks + m.num_shared_experts
    weights = (2 * V * D + L * (4 * D * F + 3 * experts_here * D * I + D * m.num_experts)) * f32
    kv_cache = m.num_kv_blocks * m.block_size * L * 2 * F * f32
    if cfg.shape == "prefill":
        attention = 3 * H * T * T * f32 + T * T
        step_tokens = T
    else:
        ctx = cfg.context + cfg.warmup + cfg.steps
        attention = (2 * T * ctx * F + 3 * T * H * ctx) * f32
        step_tokens = T * cfg.context
    activations = step_tokens * (6 * D + 2 * cfg.top_k * D + cfg.top_k * I + 2 * V) * f32
    return float(weights + kv_cache + attention + activations)


def check_memory(cfg: DemoConfig, *, processes: int | None = None, available: int | None = None,
                 limits: Sequence[inputs.ProcessLimit] | None = None) -> None:
    """Refuse (ValueError) a run whose ranks on this machine (``processes``, default all
    ``cfg.ranks``) would not fit the memory available here, or one of whose ranks would not fit
    this process's data limit (``ulimit -d``: each rank inherits it, and each counts its own),
    naming the largest ``--tokens`` that would; before any rank starts.
    ``available`` and ``limits``: the machine's and the process's (default: read now)."""
    avail = inputs.available_bytes() if available is None else available
    here = cfg.ranks if processes is None else processes

    def rank(tokens: int) -> float:
        return PROCESS_BASE_BYTES + rank_bytes(_with_tokens(cfg, tokens))

    if avail is not None and here * rank(cfg.tokens) > avail:
        _refuse(cfg, lambda t: here * rank(t), avail, f"for {here} rank(s) on this machine",
                f"{human_bytes(avail)} is available")
    for lim in inputs.process_limits() if limits is None else limits:
        # Only the data limit: a rank's address space is far larger than this process's, beyond
        # what it keeps resident (at --tokens 2048 a rank mapped 1.65 GiB at its peak for 406 MiB resident,
        # this process 406 MiB beyond its own), so no bound on it is known before the ranks start.
        if lim.name != "RLIMIT_DATA":
            continue
        if rank(cfg.tokens) > lim.left:
            _refuse(cfg, rank, lim.left, "per rank", f"{human_bytes(lim.left)} is left under each rank's {lim.what} "
                                                     f"limit ({lim.describe()}; the ranks inherit this process's)")


def _refuse(cfg: DemoConfig, need: Callable[[int], float], bound: int, whose: str, left: str) -> NoReturn:
    best = largest_fitting(need, 1, cfg.tokens, bound)
    fix = f"use --tokens {best} or fewer" if best else "use fewer --ranks or a smaller --hidden"
    raise ValueError(
        f"--tokens {cfg.tokens} needs about {human_bytes(need(cfg.tokens))} {whose} (estimated "
        f"before starting them; the {cfg.shape} step's "
        f"{'attention scores' if cfg.shape == 'prefill' else 'KV cache and activations'} dominate), but "
        f"{left}; {fix}"
    )


def _with_tokens(cfg: DemoConfig, tokens: int) -> DemoConfig:
    return replace(cfg, tokens=tokens)


def check_memory_hf(config: Any, *, model: str, ranks: int, tokens: int, steps: int, reference: bool,
                    available: int | None = None, limits: Sequence[inputs.ProcessLimit] | None = None) -> None:
    """``demo --model`` (``--weights``): refuse (ValueError) a run that would not fit, before any
    rank starts, with the estimate and the largest ``--tokens`` that fits, or, where the weights
    alone do not fit, what to change. Each rank holds its share of the checkpoint in float32 (the
    routed experts split over ``ranks``, the rest whole: :func:`~asyncdbo.models.hf.memory.estimate_memory`),
    its KV cache and a step's activations; with ``reference`` this process then (after the ranks
    have ended) holds transformers' whole model in float32 to compare with. ``available`` and ``limits``: the
    machine's and the process's (default: read now); ``ulimit -d`` bounds each process alone."""
    import torch

    from ..models.hf.memory import estimate_memory

    ckpt_dtype = getattr(config, "dtype", None) or torch.bfloat16  # transformers 5 names it dtype
    if isinstance(ckpt_dtype, str):
        ckpt_dtype = getattr(torch, ckpt_dtype, torch.bfloat16)

    def est(ranks_: int, t: int) -> Any:
        blocks = (t + 4 * (steps + 1)) // 16 + 8  # as demo_hf's ranks size their cache
        return estimate_memory(config, ranks=ranks_, dtype=torch.float32, num_kv_blocks=blocks, block_size=16,
                               step_tokens=t, longest_context=t + steps + 1, checkpoint_dtype=ckpt_dtype,
                               base=PROCESS_BASE_BYTES)

    ref = est(1, 1).weights if reference else 0  # transformers' model: every tensor, float32

    def total(t: int) -> float:  # the ranks, then the reference: never both at once
        return max(est(ranks, t).total, ref + PROCESS_BASE_BYTES)

    what = f"--model {model} with these weights on {ranks} rank(s) at --tokens {tokens}"
    parts = (f"{est(ranks, tokens).describe()}" + (f"; after the ranks, {human_bytes(ref)} for transformers' float32 "
                                                    "reference model in this process" if ref else ""))
    avail = inputs.available_bytes() if available is None else available
    if avail is not None and total(tokens) > avail:
        _refuse_hf(what, parts, total, tokens, avail, f"{human_bytes(avail)} is available")
    for lim in inputs.process_limits() if limits is None else limits:
        if lim.name != "RLIMIT_DATA":
            continue
        left = f"{human_bytes(lim.left)} is left under each process's {lim.what} limit ({lim.describe()})"
        if est(ranks, tokens).per_rank > lim.left:
            _refuse_hf(what, parts, lambda t: est(ranks, t).per_rank, tokens, lim.left, left + " per rank")
        if ref + PROCESS_BASE_BYTES > lim.left:
            raise ValueError(f"{what} needs about {human_bytes(ref + PROCESS_BASE_BYTES)} in this process for "
                             f"transformers' float32 reference model, but {left}; raise the limit or use a "
                             "checkpoint with fewer layers")


def _refuse_hf(what: str, parts: str, need: Callable[[int], float], tokens: int, bound: int, left: str) -> NoReturn:
    best = largest_fitting(need, 1, tokens, bound)
    fix = (f"use --tokens {best} or fewer" if best else
           "no --tokens fits, the weights dominate: use more --ranks (each holds fewer experts), a machine with more "
           "memory, or a checkpoint with fewer layers (asyncdbo.models.hf.real_dims.real_config(..., layers=N) and "
           "write_random_checkpoint)")
    raise ValueError(f"{what} needs about {human_bytes(need(tokens))} (estimated from its config.json before any "
                     f"rank starts: {parts}), but {left}; {fix}")
