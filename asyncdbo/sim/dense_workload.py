"""``asyncdbo check --workload`` for a dense model under tensor parallelism: the replay of
:mod:`asyncdbo.sim.workload` and :mod:`asyncdbo.sim.tuning` (the planner's thresholds, the runner's
``"auto"``), each rank's step timed by the analytical dense-TP model of :mod:`asyncdbo.sim.dense_tp`
instead of the op-by-op MoE simulation.

A step's requests are cut into ubatches as the planner cuts its tokens (token order, a request's
later tokens seeing its earlier ones as cached context; padding tokens are one-token requests
with no context), and each ubatch's layer is :func:`~asyncdbo.sim.dense_tp.layer_stages`; the
ubatches take turns on one compute and one comm resource
(:func:`~asyncdbo.sim.dense_tp.ubatches_makespan`). There are no races to check and no stream
policies to tell apart: the dense model is a formula, not a run of the model's code.

:func:`dense_prior` gives ``"auto"`` a first configuration per shape bucket from the same model
(DBO where the prediction for the bucket's smallest step gains, else off), in place of the
prior from the fixed thresholds.
"""

# Shape legend: a composition is a list of (query tokens, cached tokens), one per request.

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..backends.links import LinkSpec, link_spec
from ..serving.auto_config import OFF, Arm, AutoConfig
from .dense_tp import DenseShape, all_reduce_s, dense_shape, layer_stages, ubatches_makespan
from .devices import DeviceSpec, device_spec
from .shapes import Request
from .workload import StepSims

__all__ = ["DenseStepSims", "cut_requests", "dense_prior"]


def cut_requests(reqs: Sequence[Request], parts: Sequence[int]) -> list[list[Request]]:
    """``reqs`` cut into ubatches of ``parts`` tokens, in token order (a request cut between two
    ubatches continues in the next with its first tokens as cached context)."""
    if sum(parts) != sum(q for q, _ in reqs):
        raise ValueError(f"the parts {list(parts)} hold {sum(parts)} tokens, the requests "
                         f"{sum(q for q, _ in reqs)}: give parts that sum to the requests' tokens")
    out: list[list[Request]] = []
    it = iter(reqs)
    q, c = 0, 0
    for part in parts:
        ub: list[Request] = []
        while part:
            if q == 0:
                q, c = next(it)
            take = min(q, part)
            ub.append((take, c))
            q, c, part = q - take, c + take, part - take
        out.append(ub)
    return out


class DenseStepSims(StepSims):
    """:class:`~asyncdbo.sim.workload.StepSims` for a dense model under TP (module docstring):
    per-layer times of a rank's requests under each split, computed once per composition."""

    def __init__(self, *, model: str | DenseShape, tp: int, device: str | DeviceSpec = "h100",
                 link: str | LinkSpec = "nvlink", comm_sm_share: float = 0.15) -> None:
        self.shape = dense_shape(model, tp)
        self.tp, self.device, self.link = tp, device_spec(device), link_spec(link)
        self.comm_sm_share = comm_sm_share
        # what the replays read (StepSims.serial/split call timed): the cache and its count
        self.cache: dict[Any, list[float]] = {}
        self.simulations = 0

    def timed(self, reqs: list[Request], splits: list[list[int]], shape: str) -> list[float]:
        """Per-layer seconds of ``reqs`` under each split (``shape`` is the MoE sim's; unused)."""
        key = (tuple(reqs), tuple(map(tuple, splits)))
        if key not in self.cache:
            m, layers = self.shape, self.shape.layers
            out = []
            for parts in splits:
                stages = [layer_stages(self.device, m, self.tp, ub) for ub in cut_requests(reqs, parts)]
                ars = [all_reduce_s(self.link, self.tp, nbytes) if self.tp > 1 else 0.0 for _, _, nbytes in stages]
                out.append(ubatches_makespan(layers, [(a, f) for a, f, _ in stages], ars, self.comm_sm_share) / layers)
            self.cache[key] = out
            self.simulations += 1
        return self.cache[key]


def dense_prior(sims: DenseStepSims, cfg: AutoConfig, *, context: int = 2048) -> Callable[[str], Arm]:
    """``"auto"``'s first configuration per shape bucket from the dense model: N = 2 (the first
    split and dispatch of ``cfg``) where the bucket's smallest step is predicted faster split in
    two, else off. A decode bucket of ``lo`` tokens is ``lo`` requests at ``context``; a mixed one
    two prompts of ``lo / 2`` tokens."""
    n = 2 if 2 in cfg.ubatch_counts else cfg.ubatch_counts[0]
    dbo = Arm(n, cfg.splits[0], cfg.dispatches[0])

    def prior(bucket: str) -> Arm:
        kind, _, rng = bucket.partition(" ")
        lo = int(rng.split("-")[0]) if rng else 0
        if lo < 2:
            return OFF
        reqs: list[Request] = [(1, context)] * lo if kind == "decode" else [(lo // 2, 0), (lo - lo // 2, 0)]
        serial, split = sims.timed(reqs, [[lo], [lo // 2, lo - lo // 2]], "")
        return dbo if split < serial else OFF

    return prior
