"""The runner's configuration and step result: :class:`RunnerConfig` (checked at construction) and
:class:`StepResult`, plus the checks :class:`~asyncdbo.serving.DBORunner` makes of its model and
groups when it is built (:mod:`asyncdbo.serving.runner` runs the steps)."""

# Shape legend: T = tokens (real), V = vocab.

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..backends import CommRecord, LinkSpec, StreamBackend, StreamPolicy, get_backend
from ..dbo import DBOOptions, RunStats
from ..dist.ep import EPComm
from ..dist.fused import DISPATCH_MODES, DispatchMode
from ..plan import SplitPolicy, StepPlan, StepRecord, ThresholdConfig
from ..plan.dp import check_thresholds
from ..plan.metadata import check_max_seq_len
from ..plan._checks import check_bool, check_config, check_finite, check_int, check_number
from .auto_config import AutoConfig

__all__ = ["RunnerConfig", "StepResult", "check_ep_group", "check_model"]


@dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """How the runner microbatches.

    ``enabled=False`` runs every step as one batch (the serial baseline; the DP vote still runs,
    so ranks stay in step).  ``backend``: a stream backend name or instance; ``link``: a modeled
    link for the host backend (see :class:`asyncdbo.backends.host.HostBackend`).  ``watchdog_s``
    turns a lost comm completion into an error naming the parked ubatches instead of a hang.
    ``dispatch`` says how the MoE layers send the per-expert counts: ``"auto"`` rides them in the
    token message where the run's link model prices one message below two (one latency saved
    against the padding of a fixed-capacity buffer, which grows with the tokens per call: small
    calls on a latency-bound link), with no link model to price it (real comm) never;
    ``"fused"`` always, ``"split"`` never (:mod:`asyncdbo.dist.fused`; a fused call raises
    ValueError where a row is too small to hold the counts). The buffer is sized from the step's
    DP vote, which every rank shares, so a step without one (no ``dp_group``) splits in every
    mode, under ``tuning="auto"`` too (its one-rank vote is this rank's alone), whose search then
    tries only the first of ``AutoConfig.dispatches`` (the others would run alike). The EP group's
    ranks must all be in the DP group: ranks outside it would size their buffers from another vote,
    and under ``tuning="auto"`` choose another configuration (an auto runner refuses such a
    ``dp_group``, or none, where the model names its EP group as ``model.ep_comm``, as
    :class:`~asyncdbo.models.MiniModel` and the HF models do).

    ``measure_every``: the step's comm is summarized into its record's timing (``comm_s``,
    ``exposed_s``, ...: :func:`~asyncdbo.serving.measure.host_timing`) on every k-th step (the
    steps whose ``StepRecord.step`` is a multiple of k); the others' timing carries the step time
    alone, as on a backend that tracks no comm, and the ledger averages the comm over the steps
    that have it. 1 (the default) summarizes every step; what each costs is in docs/host_cost.md.
    The ``tuning="auto"`` policy reads the step time only, which every step keeps.

    ``max_seq_len``: each ubatch's attention metadata carries its own longest request
    (``"ubatch"``, the default) or the whole step's (``"batch"``, vLLM's rule, where attention
    kernels are chosen per captured CUDA graph; :data:`asyncdbo.plan.metadata.MAX_SEQ_LEN_RULES`).
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
    dispatch: DispatchMode = "auto"
    tuning: Literal["fixed", "auto"] = "fixed"
    auto: AutoConfig = field(default_factory=AutoConfig)
    measure_every: int = 1
    max_seq_len: str = "ubatch"

    def __post_init__(self) -> None:
        if self.tuning not in ("fixed", "auto"):
            raise ValueError(f"unknown tuning {self.tuning!r}; use 'fixed' or 'auto'")
        check_bool("RunnerConfig.", "enabled", self.enabled)
        check_int("RunnerConfig.", "num_ubatches", self.num_ubatches, 2)
        check_number("RunnerConfig.", "min_share", self.min_share, 0.48)
        check_number("RunnerConfig.", "max_imbalance", self.max_imbalance, 4.0, none="no limit")
        if self.num_ubatches < 1:
            raise ValueError(f"num_ubatches ({self.num_ubatches}) must be at least 1 (2 for DBO)")
        check_int("RunnerConfig.", "measure_every", self.measure_every, 1)
        if self.measure_every < 1:
            raise ValueError(f"measure_every ({self.measure_every}) must be at least 1: the comm of every k-th step is "
                             "summarized (1: every step, the default; e.g. measure_every=16)")
        # checked again where they are used (each step's plan and vote); here so that a bad value fails at
        # construction, not at the first step, and nan (which no comparison refuses there) fails at all
        if not 0.0 <= self.min_share <= 0.5:
            raise ValueError(f"min_share ({self.min_share}) must lie in [0, 0.5] (the smaller ubatch's least share of "
                             "the tokens); e.g. min_share=0.48, the default")
        if self.max_imbalance is not None and not self.max_imbalance >= 1.0:
            raise ValueError(f"max_imbalance ({self.max_imbalance}) must be >= 1 (a max/min token ratio across DP "
                             "ranks) or None (no limit); e.g. max_imbalance=4.0")
        check_finite("max_imbalance", self.max_imbalance, "no ratio would reach it",
                     "use max_imbalance=None for no limit")
        if self.policy not in ("token", "request", "balanced"):
            raise ValueError(f"unknown split policy {self.policy!r}; use 'token', 'request' or 'balanced'")
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"unknown dispatch {self.dispatch!r}; use 'auto', 'fused' or 'split'")
        check_config("RunnerConfig.auto", "auto", self.auto, AutoConfig, "asyncdbo.serving.AutoConfig", "AutoConfig(...)")
        check_thresholds("RunnerConfig.thresholds", self.thresholds)  # else read (and failing) at the first step
        check_max_seq_len("RunnerConfig", self.max_seq_len)
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
class StepResult:
    """Logits ``[T, V]`` of the step's real tokens, its plan and record, its wall time
    (``step_s``) and what the run cost (``stats``: switches, parks, time asleep, comm works)."""

    logits_TV: torch.Tensor
    plan: StepPlan
    step_s: float
    stats: RunStats

    @property
    def record(self) -> StepRecord:
        return self.plan.record

    @property
    def time_asleep_s(self) -> float:
        """Time every ubatch was parked (exposed wait: on the host backend, comm nothing hid)."""
        return self.stats.time_asleep_s

    @property
    def num_switches(self) -> int:
        """Ubatch switches in the run."""
        return self.stats.num_switches

    @property
    def comm(self) -> tuple[CommRecord, ...]:
        """Every comm work the host backend tracked (empty on accelerators)."""
        return self.stats.comm


def check_model(model: Any) -> None:
    """Refuse a model the runner cannot call: it needs ``model.forward``, an ``async def``."""
    if not callable(getattr(model, "forward", None)):
        raise TypeError(
            f"DBORunner needs a model with an async forward(input_ids_T, positions_T, attn) method; "
            f"{type(model).__name__} has no callable forward")


def check_ep_group(model: Any, dp_group: Any, cfg: RunnerConfig) -> None:
    """Refuse (``tuning="auto"``) or warn about (``"fixed"``) a runner whose model's EP all-to-all
    spans ranks that do not vote with it. Every EP peer must run the step's configuration: the
    same ubatch count, so the same all-to-alls on the per-ubatch groups. Only the DP vote gives
    every rank the same one. A rank that plans alone (no ``dp_group``), or whose vote misses some
    of its EP peers, decides from its own batch (a fixed runner's thresholds and split policy) or
    its own step times (``"auto"``), and EP peers that decide differently issue different
    all-to-alls: a watchdog error after the peers' collectives mismatch, or an abort inside gloo.
    A fixed runner whose every rank always splits alike (thresholds 0, equal batches) is safe, so
    it gets a DeprecationWarning for now; an auto runner chooses from times no two ranks share.
    The model says its EP group as ``model.ep_comm`` (an :class:`~asyncdbo.dist.ep.EPComm`, as
    :class:`~asyncdbo.models.MiniModel` and the HF models do); a model without one is not checked."""
    comm = getattr(model, "ep_comm", None)
    if not isinstance(comm, EPComm) or comm.size == 1 or (cfg.tuning == "fixed" and not cfg.enabled):
        return
    ep_group = comm.group if comm.group is not None else torch.distributed.group.WORLD
    if torch.distributed.get_backend(ep_group) == "fake":
        return  # one process plays every rank (asyncdbo.sim): there is no peer to disagree with
    ep_ranks = torch.distributed.get_process_group_ranks(ep_group)
    k, ops = comm.kind, ("all-to-alls" if comm.kind == "EP" else "collectives")
    if dp_group is None:
        sep, problem = " ", (
            f"with {'an' if k == 'EP' else 'a'} {k} group of {comm.size} ranks {ep_ranks} needs dp_group: without it each rank "
            f"{'chooses its configuration from its own step times' if cfg.tuning == 'auto' else 'plans from its own batch'}, "
            f"and {k} peers that choose different ubatch counts issue different {ops}; pass "
            f"dp_group= a group holding every {k} rank (e.g. the {k} group itself)")
    else:
        dp_ranks = torch.distributed.get_process_group_ranks(dp_group)
        outside = sorted(set(ep_ranks) - set(dp_ranks))
        if not outside:
            return
        sep, problem = ": ", (
            f"{k} ranks {outside} ({k} group {ep_ranks}) are not in dp_group (ranks {sorted(dp_ranks)}), so they "
            f"would choose their configuration from other votes and issue different {ops}; pass a dp_group "
            f"that holds every {k} rank")
    if cfg.tuning == "auto":
        raise ValueError(f"tuning='auto'{sep}{problem}" + (", or use tuning='fixed'" if dp_group is None else ""))
    warnings.warn(f"DBORunner{sep}{problem}; this will raise ValueError in the next release", DeprecationWarning,
                  stacklevel=3)
