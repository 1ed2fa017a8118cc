"""The overlapped runner: plan a step, run its ubatches under the DBO loop, merge (vLLM's
``UBatchWrapper`` plus the runner code around it).

Per step, every rank of the DP group:

1. plans with :func:`asyncdbo.plan.plan_step` (thresholds, then ONE all-reduce over the DP group:
   all ranks microbatch or none, all pad to the group's largest count, idle ranks follow with
   padding-only ubatches), which also records a :class:`~asyncdbo.plan.StepRecord` with the
   reason when the step falls back;
2. pads the inputs, slices them per ubatch, and runs ``model.forward`` once per ubatch under
   :func:`asyncdbo.run_ubatches` (or once over the whole batch on fall-back);
3. merges the per-ubatch logits, dropping padding.

The fall-back path runs the whole batch as a *single ubatch* under the same backend, so it issues
exactly the collectives one ubatch issues (an empty batch still joins every all-to-all) and its
comm goes through the same (possibly modeled) link: serial and overlapped steps are measured on
equal terms.

Numerical contract: the runner adds no arithmetic (it slices, runs and concatenates), so the
merged logits equal the single-batch logits bit for bit exactly when the model is batch-invariant:
:class:`~asyncdbo.models.MiniModel` in deterministic mode (``MiniConfig.deterministic``, on by
default for CPU tensors; see :mod:`asyncdbo.moe.batch_invariant` and "Numerics" in
``docs/design.md``). Without it (deterministic=False, or on an accelerator, where it is off by
default) they agree to float rounding only: a ubatch's GEMMs see other row counts than the whole
batch's, and a request cut between ubatches is attended over a shorter context in the first one
(measured with the mode off: 2.4e-6 on the demo's prefill logits on one rank as on two, and in
decode steps over a 512-token context; ``benchmarks/results/deterministic_*.md``).
"""

# Shape legend: T = tokens (real), P = tokens (padded), R = requests, B = max blocks per request,
# V = vocab.

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._core import Instrument, get_ubatch
from .loop import DBOOptions, run_ubatches
from .models.attention import KVCacheConfig
from .plan import (
    AttentionMetadata,
    PlanStats,
    SplitPolicy,
    StepPlan,
    StepRecord,
    ThresholdConfig,
    check_max_ubatches,
    merge_outputs,
    plan_step,
)
from .streams import LinkSpec, StreamBackend, StreamPolicy, get_backend

__all__ = ["Batch", "BatchBuilder", "DBORunner", "RunnerConfig", "StepResult"]

logger = logging.getLogger("asyncdbo.runner")


@dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """How the runner microbatches.

    ``enabled=False`` runs every step as one batch (the serial baseline; the DP vote still runs,
    so ranks stay in step).  ``backend``: a stream backend name or instance; ``link``: a modeled
    link for the host backend (see :class:`asyncdbo.streams.host.HostBackend`).  ``watchdog_s``
    turns a lost comm completion into an error naming the parked ubatches instead of a hang.
    """

    num_ubatches: int = 2
    policy: SplitPolicy = "token"
    thresholds: ThresholdConfig = field(default_factory=ThresholdConfig)
    enabled: bool = True
    stream_policy: StreamPolicy = "role"
    backend: str | StreamBackend = "auto"
    link: str | LinkSpec | None = None
    watchdog_s: float | None = 60.0
    max_imbalance: float | None = None
    min_share: float = 0.48

    def __post_init__(self) -> None:
        if self.num_ubatches < 1:
            raise ValueError(f"num_ubatches ({self.num_ubatches}) must be at least 1 (2 for DBO)")
        if self.policy not in ("token", "request", "balanced"):
            raise ValueError(f"unknown split policy {self.policy!r}; use 'token', 'request' or 'balanced'")
        # The remaining fields are checked where they are used, with the same messages:
        DBOOptions(stream_policy=self.stream_policy, watchdog_s=self.watchdog_s)

    def make_backend(self) -> StreamBackend:
        if self.link is None:
            return get_backend(self.backend)
        backend = get_backend(self.backend, link=self.link) if isinstance(self.backend, str) else self.backend
        if getattr(backend, "link", None) is None:
            raise ValueError(
                f"link={self.link!r} is a modeled link of the host backend, but backend is "
                f"{backend.describe()!r}; use backend='host' or drop link"
            )
        return backend


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One step's inputs on one rank: token ids and positions ``[T]`` plus attention metadata."""

    input_ids_T: torch.Tensor
    positions_T: torch.Tensor
    attn: AttentionMetadata

    def __post_init__(self) -> None:
        n = self.attn.num_actual_tokens
        if self.input_ids_T.shape != (n,) or self.positions_T.shape != (n,):
            raise ValueError(
                f"input_ids {tuple(self.input_ids_T.shape)} and positions {tuple(self.positions_T.shape)} "
                f"must both have shape ({n},), one entry per token of the attention metadata"
            )

    @property
    def num_tokens(self) -> int:
        return self.attn.num_actual_tokens


class BatchBuilder:
    """Block allocation and batch assembly for one rank's KV cache.

    ``add(request_id, token_ids)`` appends new tokens to a request (a prefill chunk, or one decode
    token); the builder keeps how many tokens each request already has in the cache, so a later
    chunk attends over the earlier ones.  Blocks are handed out in order and never freed (demo and
    test workloads fit the cache; :meth:`reset` starts over).
    """

    def __init__(self, cache_cfg: KVCacheConfig, *, device: torch.device | str = "cpu") -> None:
        self.cache_cfg = cache_cfg
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        self._next_block = 0
        self.blocks: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def _ensure_blocks(self, request_id: int, num_tokens: int) -> list[int]:
        blocks = self.blocks.setdefault(request_id, [])
        needed = -(-num_tokens // self.cache_cfg.block_size)
        while len(blocks) < needed:
            assert self._next_block < self.cache_cfg.num_blocks, "build() checks the capacity first"
            blocks.append(self._next_block)
            self._next_block += 1
        return blocks

    def build(self, chunks: Sequence[tuple[int, Sequence[int]]]) -> Batch:
        """A batch with one entry per ``(request_id, new_token_ids)``; each request's new tokens
        follow its tokens of earlier steps.  An empty ``chunks`` is an idle rank's batch."""
        bs = self.cache_cfg.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        seq_lens: list[int] = []
        rows: list[list[int]] = []
        # Check everything before changing any state, so a refused batch leaves the builder as it was.
        seen: set[int] = set()
        new_blocks = 0
        for rid, tokens in chunks:
            if rid in seen:
                raise ValueError(f"request {rid} appears twice in one batch; pass its tokens as one chunk")
            seen.add(rid)
            have = len(self.blocks.get(rid, ()))
            new_blocks += max(0, -(-(self.num_computed.get(rid, 0) + len(tokens)) // bs) - have)
        if self._next_block + new_blocks > self.cache_cfg.num_blocks:
            raise ValueError(
                f"the KV cache is full ({self.cache_cfg.num_blocks} blocks of {bs}); "
                f"raise MiniConfig.num_kv_blocks or use fewer/shorter requests"
            )
        for rid, tokens in chunks:
            start = self.num_computed.get(rid, 0)
            end = start + len(tokens)
            blocks = self._ensure_blocks(rid, end)
            ids.extend(int(t) for t in tokens)
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            qlens.append(len(tokens))
            seq_lens.append(end)
            rows.append(blocks)
            self.num_computed[rid] = end
        width = max((len(r) for r in rows), default=0)
        table_RB = torch.zeros(len(rows), max(width, 1), dtype=torch.int32)
        for r, blocks in enumerate(rows):
            table_RB[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        attn = AttentionMetadata.from_lengths(
            qlens, seq_lens, table_RB, torch.tensor(slots, dtype=torch.int64), device=self.device
        )
        return Batch(
            input_ids_T=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions_T=torch.tensor(positions, dtype=torch.int64, device=self.device),
            attn=attn,
        )


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """Logits ``[T, V]`` of the step's real tokens, its plan and record, and what it cost.

    ``comm_works``: ``(ubatch id, HostWork)`` of every comm work the host backend tracked (empty
    on accelerators).  ``time_asleep_s``: time every ubatch was parked (exposed wait: on the host
    backend, comm that nothing hid).  ``num_switches``: ubatch switches in the run."""

    logits_TV: torch.Tensor
    plan: StepPlan
    step_s: float
    time_asleep_s: float
    num_switches: int
    comm_works: tuple[tuple[int, Any], ...] = ()

    @property
    def record(self) -> StepRecord:
        return self.plan.record


class DBORunner:
    """Runs steps of ``model`` (anything with ``async forward(input_ids_T, positions_T, attn)``)
    with DBO across the ranks of ``dp_group`` (None: no DP agreement, plan locally).

    Every rank of the group must call :meth:`step` for every step, idle ranks with an empty batch.
    A model with a ``max_ubatches`` attribute (:class:`~asyncdbo.models.MiniModel`) must allow
    ``cfg.num_ubatches``: checked here and at every plan.
    """

    def __init__(self, model: Any, cfg: RunnerConfig = RunnerConfig(), *, dp_group: Any = None,
                 device: torch.device | str | None = None, instrument: Instrument | None = None) -> None:
        check_max_ubatches(cfg.num_ubatches, getattr(model, "max_ubatches", None))
        self.model = model
        self.cfg = cfg
        self.dp_group = dp_group
        self.device = device
        self.instrument = instrument
        self.backend = cfg.make_backend()
        self.stats = PlanStats()

    async def step(self, batch: Batch, *, enabled: bool | None = None,
                   instrument: Instrument | None = None) -> StepResult:
        """Plan, run and merge one step.  ``enabled`` overrides the config for this step;
        ``instrument`` adds scheduler hooks for this step (e.g. a tracer)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        plan = plan_step(
            batch.attn.query_start_loc_cpu,
            num_ubatches=cfg.num_ubatches,
            policy=cfg.policy,
            thresholds=cfg.thresholds,
            enabled=cfg.enabled if enabled is None else enabled,
            is_idle=batch.num_tokens == 0,
            attn_metadata=batch.attn,
            dp_group=self.dp_group,
            device=self.device,
            max_imbalance=cfg.max_imbalance,
            min_share=cfg.min_share,
            stats=self.stats,
            max_ubatches=getattr(self.model, "max_ubatches", None),
        )
        pad = plan.num_tokens_padded - batch.num_tokens
        ids_P, pos_P = batch.input_ids_T, batch.positions_T
        if pad:
            # Padding tokens: id 0 at position 0; they write no K/V (no slot) and are dropped.
            ids_P = torch.cat([ids_P, ids_P.new_zeros(pad)])
            pos_P = torch.cat([pos_P, pos_P.new_zeros(pad)])
        args = [
            (ids_P[s.padded_token_slice], pos_P[s.padded_token_slice], meta, s.first_is_continuation)
            for s, meta in zip(plan.slices, plan.attn_metadata)
        ]
        runs: list[Any] = []

        async def ubatch_forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                                 continuation: bool) -> torch.Tensor:
            ub = get_ubatch()
            assert ub is not None
            if ub.id == 0:
                runs.append(ub.run)
            # Tells attention whether it must read K/V the previous ubatch writes (see MiniModel).
            ub.data["first_is_continuation"] = continuation
            return await self.model.forward(ids, pos, meta)  # type: ignore[no-any-return]

        insts = [i for i in (self.instrument, instrument) if i is not None]
        for inst in insts:
            mark_step = getattr(inst, "mark_step", None)  # a Tracer labels the run with the record
            if mark_step is not None:
                mark_step(plan.record)
        outputs = await run_ubatches(
            ubatch_forward,
            args,
            backend=self.backend,
            stream_policy=cfg.stream_policy,
            watchdog_s=cfg.watchdog_s,
            instrument=insts,
            name=f"step{plan.record.step}",
        )
        logits_TV = merge_outputs(outputs, plan.slices, batch.num_tokens)
        step_s = time.perf_counter() - t0
        run = runs[0]
        return StepResult(
            logits_TV=logits_TV,
            plan=plan,
            step_s=step_s,
            time_asleep_s=float(run.time_asleep_s),
            num_switches=int(run.num_switches),
            comm_works=tuple(run.data.get("comm_works", ())),
        )
