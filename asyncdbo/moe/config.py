"""Configuration of one MoE layer: routing rule, expert sizes and the DBO schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["MoEConfig"]

Scoring = Literal["softmax", "sigmoid"]
Schedule = Literal["ht", "ll"]


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer's shape and routing.

    Routing covers both families asyncdbo is tested against: Mixtral (``softmax`` scores, top-k,
    renormalised) and DeepSeek-V3 (``sigmoid`` scores plus a selection-only correction bias,
    group-limited top-k over ``n_group`` groups keeping ``topk_group``, weights renormalised and
    scaled by ``routed_scaling_factor``, plus ``num_shared_experts`` always-on experts fused into
    one MLP of ``num_shared_experts * intermediate_size``).

    ``round_topk_weights`` rounds the chosen experts' weights to the router logits' dtype after
    renormalising, as Qwen3-MoE's router does (``router_top_value.to(router_logits.dtype)``: bf16
    weights in a bf16 model); Mixtral and DeepSeek-V3 keep them in float32 (the default).

    ``schedule`` picks where the layer yields under DBO: ``ht`` (high-throughput: dispatch and
    combine on the comm stream, three yields per layer) or ``ll`` (low-latency: send/receive
    halves with the receive launched by the next ubatch's recv hook, two yields per layer). Both
    give the same numbers; they differ only in what overlaps what.

    ``deterministic`` makes the layer batch-invariant: a token's output does not depend on which
    other tokens share the call (expert and dense GEMMs in fixed row tiles, lane-independent
    silu/sigmoid, see :mod:`asyncdbo.moe.batch_invariant`), so a DBO run equals the serial one
    bit for bit. None (the default) turns it on for CPU inputs and off on accelerators; True or
    False force it.

    ``sync_free`` keeps every count, offset and split of the dispatch on the device, so a forward
    issues no host sync between its yields (fixed-size blocks and windows, see
    :mod:`asyncdbo.dist.ep`); under expert parallelism it needs the bound that
    :func:`asyncdbo.dist.dispatch_options` declares. None (the default) turns it on for
    accelerator inputs (without that bound, EP > 1 keeps the exact splits) and off for CPU inputs,
    where nothing waits for a sync and the exact sizes compute fewer rows; True or False force it
    (True under EP > 1 without the bound is an error). The numbers are the same either way in
    deterministic mode.

    ``yield_after_route`` (``ht``, ``ubatch`` streams) hands over once more, after routing and
    before the dispatch's counts go out: the router and the dispatch's first step run as two steps
    (benchmarks/results/extra_yield_cpu-2c_2026-12-01.md asked the same of attention). The
    numbers are the same either way. Under ``role`` streams the step is not taken: a yield inside a compute phase lets the other
    ubatch queue compute that the next compute-done event would then cover, so the ubatches would
    serialize (the race checker reports it as lost overlap: ``asyncdbo check --moe
    yield_after_route=true``, docs/maintaining.md).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    scoring: Scoring = "softmax"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    round_topk_weights: bool = False
    schedule: Schedule = "ht"
    deterministic: bool | None = None
    sync_free: bool | None = None
    yield_after_route: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be an integer >= 1 (got {value!r})")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(f"MoEConfig.num_shared_experts must be an integer >= 0 (got {self.num_shared_experts!r})")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k ({self.top_k}) is larger than num_experts ({self.num_experts}); "
                "a token cannot pick more experts than exist: lower top_k"
            )
        if not isinstance(self.round_topk_weights, bool):
            raise ValueError(f"MoEConfig.round_topk_weights must be True or False (got {self.round_topk_weights!r})")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEConfig.scoring must be 'softmax' or 'sigmoid' (got {self.scoring!r})")
        if self.schedule not in ("ht", "ll"):
            raise ValueError(
                f"MoEConfig.schedule must be 'ht' (high-throughput) or 'll' (low-latency) (got {self.schedule!r})"
            )
        if not (self.deterministic is None or isinstance(self.deterministic, bool)):
            raise ValueError(
                f"MoEConfig.deterministic must be True, False or None (on for CPU inputs) (got {self.deterministic!r})"
            )
        if not (self.sync_free is None or isinstance(self.sync_free, bool)):
            raise ValueError(
                f"MoEConfig.sync_free must be True, False or None (on for accelerator inputs) (got {self.sync_free!r})"
            )
        if not isinstance(self.yield_after_route, bool):
            raise ValueError(f"MoEConfig.yield_after_route must be True or False (got {self.yield_after_route!r})")
        if self.num_experts % self.n_group != 0:
            raise ValueError(
                f"MoEConfig.n_group ({self.n_group}) must divide num_experts ({self.num_experts}) "
                "so that every expert group has the same size"
            )
        if self.topk_group > self.n_group:
            raise ValueError(
                f"MoEConfig.topk_group ({self.topk_group}) is larger than n_group ({self.n_group}); "
                "it counts the groups a token may use: lower it to at most n_group"
            )
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(
                f"MoEConfig: group-limited routing scores a group by its top-2 experts, so each of the "
                f"n_group ({self.n_group}) groups needs >= 2 of the num_experts ({self.num_experts}) experts"
            )
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"MoEConfig.top_k ({self.top_k}) exceeds the experts in the kept groups "
                f"(topk_group {self.topk_group} x {self.num_experts // self.n_group} per group)"
            )

    @property
    def shared_intermediate_size(self) -> int:
        """Intermediate size of the fused shared-expert MLP (0: no shared experts)."""
        return self.num_shared_experts * self.intermediate_size
