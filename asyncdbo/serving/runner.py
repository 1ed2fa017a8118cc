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

A step that fails or is cancelled on any rank, at any point, leaves every rank able to run the
next one: call ``step()`` again on every rank. :func:`asyncdbo.run_ubatches` itself does the work
(:mod:`asyncdbo.dist.recovery`): a rank whose run failed tells the others through the rendezvous
store, a rank waiting in the step gives up with :class:`~asyncdbo.dist.StepAborted` naming the
failing rank, and the next run renews every per-ubatch group first. The DP vote runs on a clone of
the DP group made at construction (a collective, like building the model), which only votes: a
vote is synchronous, so it cannot be left half-done.

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

import contextlib
import dataclasses
import inspect
import logging
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from .._core import Clock, Instrument, MonotonicClock
from ..dbo import PreparedRun, prepare_run
from ..dbo.options import check_instrument
from ..dist.fused import DispatchMode, dispatch_options
from ..dist.recovery import StepSync, step_sync
from ..plan import (
    AttentionMetadata,
    DPDecision,
    LocalStepInfo,
    PlanReason,
    PlanStats,
    RankVote,
    StepPlan,
    ShapePlanner,
    StepRecord,
    agree_across_dp,
    check_max_ubatches,
    decide_from_votes,
    is_uniform_decode,
    merge_outputs,
    plan_step,
)
from ..plan._checks import check_bool
from ..plan.records import with_fields
from ..plan.planner import Offsets, remember
from ..plan.slices import CheckedOffsets, as_query_start_loc
from .auto import OFF, Arm, AutoPolicy, group_choice_lazy, splittable_mask, threshold_prior
from .batch import Batch
from .measure import OverlapLedger, shape_bucket, step_timing
from .runner_config import RunnerConfig, StepResult, check_ep_group, check_model
from .step_slices import RUNNING_STEP, current_slice

__all__ = ["DBORunner", "RunnerConfig", "StepResult", "current_slice"]

logger = logging.getLogger("asyncdbo.serving")


class DBORunner:
    """Runs steps of ``model`` (anything with ``async forward(input_ids_T, positions_T, attn)``)
    with DBO across the ranks of ``dp_group`` (None: no DP agreement, plan locally).

    Every rank of the group must call :meth:`step` for every step, idle ranks with an empty batch,
    and after a failed step too (the next step recovers first). With a ``dp_group`` of more than
    one rank, construction is a collective (it clones the group for the votes): build the runners
    on every rank in the same order.
    A model with a ``max_ubatches`` attribute (:class:`~asyncdbo.models.MiniModel`) must allow
    ``cfg.num_ubatches``: checked here and at every plan.

    Every step is measured (:mod:`asyncdbo.serving.measure`): its record carries the configuration
    it ran and a :class:`~asyncdbo.plan.StepTiming` (step time on ``clock``, a
    :class:`~asyncdbo.Clock`, real monotonic time unless a test injects one; comm exposed and hidden
    from the host backend), and :meth:`report` sums them up. ``stats`` (a
    :class:`~asyncdbo.plan.PlanStats`) counts the steps by their plan's reason. Both count the
    steps that completed: a step that raised or was cancelled is in neither (it may have planned
    to microbatch and run nothing), and :meth:`report` ends by saying how many failed.
    """

    def __init__(self, model: Any, cfg: RunnerConfig = RunnerConfig(), *, dp_group: Any = None,
                 device: torch.device | str | None = None, instrument: Instrument | None = None,
                 clock: Clock | None = None) -> None:
        check_model(model)
        if cfg.tuning == "auto":
            cfg.auto.check_max_ubatches(getattr(model, "max_ubatches", None))
        else:
            check_max_ubatches(cfg.num_ubatches, getattr(model, "max_ubatches", None))
        check_ep_group(model, dp_group, cfg)
        self.model = model
        self.cfg = cfg
        self.dp_group = dp_group
        self.device = device
        self.instrument = instrument
        self.backend = cfg.make_backend()
        self._runs: PreparedRun | None = None  # see _prepared
        self.stats = PlanStats()
        self.ledger = OverlapLedger()
        self.clock: Clock = MonotonicClock() if clock is None else clock
        self.sync: StepSync | None = step_sync(dp_group) if dp_group is not None else None
        # Without a DP group every step splits (see step), so the dispatch modes run alike:
        # the policy explores the first only.
        space = cfg.auto if dp_group is not None else dataclasses.replace(cfg.auto, dispatches=cfg.auto.dispatches[:1])
        self.auto: AutoPolicy | None = (
            AutoPolicy(space, threshold_prior(cfg.thresholds, space)) if cfg.tuning == "auto" else None)
        self._arms = space.arms()
        # A fixed runner without a DP group plans from the shapes it kept (ShapePlanner): nothing but
        # the offsets goes into its cut, so a repeated shape is cut by its template.
        self._shapes = (ShapePlanner(num_ubatches=cfg.num_ubatches, policy=cfg.policy, thresholds=cfg.thresholds,
                                     min_share=cfg.min_share, max_seq_len=cfg.max_seq_len,
                                     max_ubatches=getattr(model, "max_ubatches", None))
                        if cfg.tuning != "auto" and dp_group is None else None)
        # an "auto" runner's keys of what it keeps with a step's offsets (Offsets.memo): its split
        # mask, its own one-rank vote with the flag False and True
        self._memo_mask, self._memo_vote = object(), (object(), object())
        self._planners: dict[Arm, ShapePlanner] = {}  # an "auto" runner's, per configuration (_arm_planner)
        self._async_def: dict[Any, bool] = {}  # see _is_async_def
        self._config_names: dict[int, str] = {}  # a fixed runner's record.config by ubatch count (0: off)
        # What every rank's policy must share to choose alike (its search space and prior), as a
        # number the vote carries: ranks with other settings are refused, not left to diverge.
        self._auto_print = zlib.crc32(repr((space, cfg.thresholds, cfg.min_share)).encode())
        # the last step's (bucket, arm, DP-max real tokens) and this rank's time for it (-1: none)
        self._last: tuple[str, Arm, int] | None = None
        self._last_ns = -1
        # steps planned so far (failed ones included): the next step's StepRecord.step and run name
        self._num_planned = 0

    def report(self) -> str:
        """One line over the steps so far: per configuration the steps, time per real token, the
        comm exposed on the critical path and hidden by other ubatches; DBO's speed-up over the
        serial steps of the same shape where both ran; why steps fell out; how many steps failed
        (:meth:`OverlapLedger.summary`); under ``tuning="auto"``, which buckets explored again after
        settling, at which of their steps and why (:meth:`AutoPolicy.summary`)."""
        again = self.auto.summary() if self.auto is not None else ""
        return self.ledger.summary() + (f"; {again}" if again else "")

    async def step(self, batch: Batch, *, enabled: bool | None = None,
                   instrument: Instrument | Sequence[Instrument] | None = None) -> StepResult:
        """Plan, run and merge one step.  ``enabled`` overrides the config for this step;
        ``instrument`` (an :class:`~asyncdbo.lowlevel.Instrument`, a list of them, or None) adds
        scheduler hooks for this step (e.g. a tracer).

        :attr:`stats` and :meth:`report` count the steps that completed; a step that raised (or was
        cancelled) after its arguments were checked is counted by :meth:`report` as failed, and by
        neither as run."""
        if not isinstance(batch, Batch):
            raise TypeError(
                f"step() takes an asyncdbo.serving.Batch, got {type(batch).__name__}; build one with "
                "asyncdbo.serving.BatchBuilder(kv_cache_config).build([(request_id, new_token_ids), ...])")
        if enabled is not None:
            check_bool("DBORunner.step() ", "enabled", enabled, none="None: RunnerConfig.enabled")
        insts: list[Instrument] = [self.instrument] if self.instrument is not None else []
        if instrument is not None:
            check_instrument(instrument)
            if isinstance(instrument, Instrument):
                insts.append(instrument)
            else:
                insts.extend(instrument)
        ran = False
        try:
            plan, dispatch, t0, uniform = self._plan_any(batch, enabled)
            ran = True
            result = await self._run(batch, plan, dispatch, insts, t0, uniform)
        except BaseException as exc:
            self.ledger.failed += 1
            if ran and self.sync is not None:  # a run's failure is posted already; this also posts the merge's
                self.sync.post_failure(exc)
            raise
        self._last_ns = int(result.step_s * 1e9)
        self.stats.record(result.record)  # at the end: a step that failed counts in neither (see above)
        return result

    def _plan_any(self, batch: Batch, enabled: bool | None) -> tuple[StepPlan, DispatchMode, float, bool]:
        """The step's plan (fixed or ``"auto"``), its dispatch mode, its start time and whether the
        batch is a uniform decode (read once per step, for the plan and the ledger's bucket)."""
        cfg = self.cfg
        t0 = self.clock.now()
        enabled = cfg.enabled if enabled is None else enabled
        self._last_ns, last_ns = -1, self._last_ns  # a step that fails measures nothing
        dispatch: DispatchMode
        if self._shapes is not None:
            check_max_ubatches(cfg.num_ubatches, getattr(self.model, "max_ubatches", None))
            plan, uniform = self._shapes.plan(batch.attn, enabled=enabled, step=self._num_planned)
            self._num_planned += 1
            return plan, "split", t0, uniform  # no DP group: split (below)
        if self.auto is None:
            # the offsets checked once per step: the planners below take them as they are
            qsl = CheckedOffsets(as_query_start_loc(batch.attn.query_start_loc_cpu))
            uniform = is_uniform_decode(qsl, cfg.thresholds.num_spec_tokens)
            plan, dispatch = self._plan(batch, qsl, uniform, enabled), cfg.dispatch
        else:
            # (every configuration's planner reads offsets alike: with the runner's thresholds)
            offsets = self._arm_planner(self._arms[0]).offsets(batch.attn)
            uniform = offsets.uniform
            plan, arm = self._plan_auto(batch, offsets, enabled, last_ns)
            dispatch = _arm_dispatch(arm, cfg.dispatch)
        self._num_planned += 1
        if self.dp_group is None:
            # No vote every rank shares to size a fused buffer from (an auto runner's one-rank vote
            # is this rank's alone): split in every mode (RunnerConfig).
            dispatch = "split"
        return plan, dispatch, t0, uniform

    def _arm_planner(self, arm: Arm) -> ShapePlanner:
        """The planner of ``arm``'s configuration (an ``"auto"`` runner's; made on first use)."""
        planner = self._planners.get(arm)
        if planner is None:
            cfg = self.cfg
            planner = self._planners[arm] = ShapePlanner(
                num_ubatches=arm.num_ubatches, policy=arm.split, thresholds=cfg.thresholds, min_share=cfg.min_share,
                max_seq_len=cfg.max_seq_len)
        return planner

    def _plan(self, batch: Batch, qsl: CheckedOffsets, uniform: bool, enabled: bool) -> StepPlan:
        cfg, sync = self.cfg, self.sync
        return plan_step(
            qsl,
            num_ubatches=cfg.num_ubatches,
            policy=cfg.policy,
            thresholds=cfg.thresholds,
            enabled=enabled,
            is_idle=batch.num_tokens == 0,
            attn_metadata=batch.attn,
            dp_group=self.dp_group if sync is None else sync.group,
            device=self.device,
            max_imbalance=cfg.max_imbalance,
            min_share=cfg.min_share,
            max_seq_len=cfg.max_seq_len,
            uniform_decode=uniform,
            step=self._num_planned,
            max_ubatches=getattr(self.model, "max_ubatches", None),
        )

    def _plan_auto(self, batch: Batch, offsets: Offsets, enabled: bool, last_ns: int) -> tuple[StepPlan, Arm]:
        """The ``"auto"`` step and the configuration it runs: ONE vote carries each rank's plan
        inputs and its last step time; every rank feeds the same group measurement to its policy and
        picks the same configuration from the same table (see :mod:`asyncdbo.serving.auto`)."""
        cfg, auto = self.cfg, self.auto
        assert auto is not None
        qsl, uniform = offsets.checked, offsets.uniform
        num_tokens = qsl[-1]
        # which configurations can split these offsets: a function of the offsets, kept with them
        memo = offsets.memo
        mask = memo.get(self._memo_mask, -1)
        if mask < 0:
            mask = splittable_mask(qsl, self._arms, cfg.min_share)
            remember(offsets, self._memo_mask, mask)
        is_idle = batch.num_tokens == 0
        sync = self.sync
        if self.dp_group is not None:
            local = _local_info(num_tokens, enabled, is_idle)
            extra = (int(uniform), mask, last_ns, self._auto_print)
            group = self.dp_group if sync is None else sync.group
            decision = agree_across_dp(local, cfg.auto.max_ubatches, group, device=self.device,
                                       max_imbalance=cfg.max_imbalance, extra=extra)
            uniform_R, mask_R, last_R, print_R = decision.extra
            if len(set(print_R)) != 1:
                by_rank = ", ".join(f"rank {r}: {p:08x}" for r, p in enumerate(print_R))
                raise ValueError(
                    f"the DP ranks' tuning='auto' runners have different settings (fingerprints {by_rank}); "
                    "every rank must choose from the same RunnerConfig.auto, thresholds and min_share")
        else:
            # One rank's vote decides from its own inputs alone (its offsets and the flag): the same
            # inputs, the same decision (immutable), kept with the offsets instead of voting again.
            own = memo.get(self._memo_vote[1 if enabled else 0])
            if own is None:
                local = _local_info(num_tokens, enabled, is_idle)
                vote = RankVote(0, local.vote, local.reason, local.num_tokens_unpadded, local.padded)
                own = decide_from_votes([vote], max_imbalance=cfg.max_imbalance)
                remember(offsets, self._memo_vote[1 if enabled else 0], own)
            decision = own
            uniform_R, mask_R, last_R = (int(uniform),), (mask,), (last_ns,)
        if self._last is not None and min(last_R) >= 0:  # every rank measured the last step
            bucket, arm, tokens = self._last
            auto.observe(bucket, arm, max(last_R) * 1e-9 / max(tokens, 1))
        tokens = max(decision.num_tokens_across_dp)
        self._last = None
        # the evidence of a settled choice is a snapshot the record puts in words when read
        bucket, arm, evidence, refused = group_choice_lazy(auto, self._arms, decision, uniform_R, mask_R)
        if decision.should_ubatch and arm == OFF:
            # off by the policy's choice, or because the configuration it would run (pinned, or the
            # bucket's choice) cannot split this batch: the split policy's refusal, as a fixed runner's
            reason = PlanReason.AUTO_OFF if refused is None else PlanReason.POLICY_REFUSED
            d = decision  # field by field: cheaper than the generic with_fields (step_host_cost run10 notes)
            decision = DPDecision(False, reason, evidence, d.num_tokens_padded, d.num_tokens_across_dp,  # type: ignore[arg-type]
                                  d.ranks, d.rank, d.world_size, d.extra)  # the detail: the evidence, text when read
        if tokens > 0 and refused is None:  # a refused step ran off out of the schedule's turn: not a sample
            self._last = (bucket, arm, tokens)
        check_max_ubatches(arm.num_ubatches, getattr(self.model, "max_ubatches", None))
        plan, _ = self._arm_planner(arm).plan(batch.attn, enabled=enabled, step=self._num_planned, config=arm.label,
                                              decision=decision, evidence=evidence, offsets=offsets)
        return plan, arm

    async def _run(self, batch: Batch, plan: StepPlan, dispatch: DispatchMode, insts: list[Instrument],
                   t0: float, uniform: bool) -> StepResult:
        num_tokens = batch.attn.num_actual_tokens
        pad = plan.num_tokens_padded - num_tokens
        ids_P, pos_P = batch.input_ids_T, batch.positions_T
        if pad:
            # Padding tokens: id 0 at position 0; they write no K/V (no slot) and are dropped.
            ids_P = torch.cat([ids_P, ids_P.new_zeros(pad)])
            pos_P = torch.cat([pos_P, pos_P.new_zeros(pad)])
        args = [(ids_P[s.padded_token_slice], pos_P[s.padded_token_slice], meta)
                for s, meta in zip(plan.slices, plan.attn_metadata)]
        for inst in insts:
            mark_step = getattr(inst, "mark_step", None)  # a Tracer labels the run with the record
            if mark_step is not None:
                mark_step(plan.record)
        name = f"step{plan.record.step}"
        forward = self.model.forward
        if self._is_async_def(forward):  # the model's coroutines are the ubatches (no frame between)
            run = self._prepared().run_ubatches_with_stats(forward, args, name=name, instrument=insts or None)
        else:
            run = self._prepared().run_ubatches_with_stats(self._ubatch_forward, args, name=name,
                                                           instrument=insts or None)
        token = RUNNING_STEP.set((name, plan.slices))  # before the run makes its ubatches' contexts
        try:
            if dispatch == "split":  # (no dispatch options to set)
                outputs, stats = await run
            else:
                with _dispatch_block(plan, self.cfg.policy if self.auto is None else plan.record.policy, dispatch):
                    outputs, stats = await run
        finally:
            RUNNING_STEP.reset(token)
        logits_TV = merge_outputs(outputs, plan.slices, num_tokens)
        assert isinstance(logits_TV, torch.Tensor), type(logits_TV)  # one tensor in, one out
        step_s = self.clock.now() - t0
        plan = self._measured(num_tokens, plan, step_timing(stats, step_s, plan.record.step, self.cfg.measure_every),
                              uniform, bool(insts))
        return StepResult(logits_TV=logits_TV, plan=plan, step_s=step_s, stats=stats)

    async def _ubatch_forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One ubatch of a step whose ``model.forward`` is not an ``async def`` (a function that
        returns an awaitable): it is awaited here, or refused with what to write instead."""
        out = self.model.forward(ids, pos, meta)
        if not inspect.isawaitable(out):
            raise TypeError(
                f"{type(self.model).__name__}.forward returned {type(out).__name__}, not an awaitable: DBORunner "
                "awaits it once per ubatch under the DBO loop; write `async def forward(self, input_ids_T, "
                "positions_T, attn)` (its yield points hand the CPU to the other ubatches)")
        return await out

    def _is_async_def(self, forward: Any) -> bool:
        """Whether ``forward`` (the model's bound ``forward``) is an ``async def``, kept per function."""
        func = getattr(forward, "__func__", forward)
        known = self._async_def.get(func)
        if known is None:
            known = self._async_def[func] = inspect.iscoroutinefunction(forward)
        return known

    def _prepared(self) -> PreparedRun:
        """The runs' options and backend, set up once (asyncdbo.dbo.prepared): a step names its run
        and passes its instruments, nothing more. Made at the first step, and again if
        ``self.backend`` was replaced since (a test's, a tool's)."""
        runs = self._runs
        if runs is None or runs.backend is not self.backend:
            cfg = self.cfg
            runs = self._runs = prepare_run(backend=self.backend, stream_policy=cfg.stream_policy,
                                            watchdog_s=cfg.watchdog_s)
        return runs

    def _measured(self, num_tokens: int, plan: StepPlan, timing: Any, uniform: bool, seen: bool = True) -> StepPlan:
        """The plan with its record carrying the configuration it ran and ``timing``; counted in
        the ledger under the step's shape bucket (from the DP vote where there is one; ``uniform``:
        this rank's batch is a uniform decode; ``num_tokens``: its real tokens; ``seen``: an
        instrument was given the plan's record before the run)."""
        cfg = self.cfg
        config = plan.record.config
        if not config:
            n = len(plan.slices) if plan.microbatched else 0
            config = self._config_names.get(n, "")
            if not config:
                config = self._config_names[n] = f"N={n} {cfg.policy} {cfg.dispatch}" if n else "off"
        record = plan.record
        if seen:  # an instrument holds the record as it was before the run: a new one
            record = with_fields(record, config=config, timing=timing)
            plan = with_fields(plan, record=record)
        else:
            # Made for this step and held by nothing else yet (plan_step and ShapePlanner make a new
            # record every step): its last two fields set as its own __init__ sets them, no copy.
            object.__setattr__(record, "config", config)
            object.__setattr__(record, "timing", timing)
        tokens = max(plan.decision.num_tokens_across_dp) if plan.decision is not None else num_tokens
        self.ledger.add(record, num_tokens, shape_bucket(tokens, uniform))
        return plan


def _local_info(num_tokens: int, enabled: bool, is_idle: bool) -> LocalStepInfo:
    """An ``"auto"`` step's input to the DP vote (its thresholds are the policy's business)."""
    return LocalStepInfo(num_tokens_unpadded=num_tokens, wants_ubatch=enabled, is_idle=is_idle,
                         reason=PlanReason.MICROBATCHED if enabled else PlanReason.DISABLED,
                         detail="" if enabled else "disabled by the caller")


def _arm_dispatch(arm: Arm, unsplit: DispatchMode) -> DispatchMode:
    """The dispatch mode of an ``"auto"`` step that runs ``arm``: its own, or, for off (any
    ``Arm(1, ...)``, a pinned one included), ``unsplit`` (``RunnerConfig.dispatch``), as a fixed
    runner's unsplit step does: off is compared with DBO and must be the off a fixed runner runs, so
    it fuses where the link model prices one message below two (a split off paid one more message
    latency per MoE layer and lost to DBO configurations that beat the fixed off)."""
    return unsplit if arm.num_ubatches == 1 else arm.dispatch


def _dispatch_block(plan: StepPlan, policy: str, dispatch: DispatchMode) -> contextlib.AbstractContextManager[Any]:
    """The step's :func:`~asyncdbo.dist.dispatch_options`: the most tokens any rank's MoE call
    carries, from the DP vote every rank shares (under the token policy each ubatch's padded size
    comes from the common total alone; request-aligned cuts differ by rank, so the total bounds
    them). Without a vote, or with ``dispatch="split"``, nothing: the layers split."""
    if dispatch == "split" or plan.decision is None or plan.decision.num_tokens_padded < 1:
        return contextlib.nullcontext()
    bound = plan.decision.num_tokens_padded
    if plan.microbatched and policy == "token":
        bound = max(s.num_tokens_padded for s in plan.slices)
    return dispatch_options(max(bound, 1), dispatch)
